"""Pipelines as configuration declares them (ModelConfig.steps), checked once at start-up.

A pipeline's tensors share one namespace, as in a Triton ensemble: it starts with the pipeline's
inputs; each step takes its inputs from it (`inputs`: the step model's input -> a tensor there)
and adds the outputs it keeps under their new names (`outputs`: the step's output -> name); the
pipeline's outputs are read from it at the end. The checks here make a job that passes the
gateway's validation (against the pipeline's declared inputs) reach every step with every tensor
it needs: each model step's inputs are mapped in full from tensors that exist by then, with the
datatype the step model declares where the tensor is one of the pipeline's inputs; what a function
step gives is known only when it runs (the batcher checks it then).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

# What the checks read of asyncinfer.config's ModelConfig, PipelineStepConfig and TensorSpecConfig
# (which call them: config imports this module, not the other way round).


class Spec(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def datatype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...


class Step(Protocol):
    @property
    def model(self) -> str: ...
    @property
    def inputs(self) -> Mapping[str, str]: ...
    @property
    def outputs(self) -> Mapping[str, str]: ...
    @property
    def label(self) -> str: ...


class Model(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def inputs(self) -> Sequence[Spec]: ...
    @property
    def outputs(self) -> Sequence[Spec]: ...
    @property
    def steps(self) -> Sequence[Step]: ...


# A tensor's datatype and shape, as far as the configuration knows it.
Known = tuple[str, tuple[int, ...]]


class PipelineMismatch(ValueError):
    """The first thing wrong with a pipeline's steps, and the tensor it is about (a pipeline
    tensor, or a step model's input or output; empty when none is): a batcher refusing a step
    model's new version names it in its error's details."""

    def __init__(self, message: str, tensor: str = "") -> None:
        super().__init__(message)
        self.tensor = tensor


def check_pipeline(pipeline: Model, models: Mapping[str, Model]) -> None:
    """PipelineMismatch (a ValueError) naming the first thing wrong with the pipeline's steps."""
    where = f"pipeline {pipeline.name!r}"
    # Tensor name -> its datatype and shape (None: a function step's output, known only at run time).
    known: dict[str, Known | None] = {spec.name: (spec.datatype, spec.shape) for spec in pipeline.inputs}
    for number, step in enumerate(pipeline.steps, start=1):
        at = f"{where} step {number} ({step.label})"
        missing = sorted(source for source in step.inputs.values() if source not in known)
        if missing:
            raise PipelineMismatch(f"{at} takes {missing}, which no pipeline input or earlier step gives", missing[0])
        if step.model:
            model = models.get(step.model)
            if model is None:
                raise PipelineMismatch(f"{at}: no model {step.model!r} is declared")
            if model.steps:
                raise PipelineMismatch(f"{at}: {step.model!r} is a pipeline itself (pipelines do not nest)")
            wanted = {spec.name: (spec.datatype, spec.shape) for spec in model.inputs}
            if set(step.inputs) != set(wanted):
                raise PipelineMismatch(
                    f"{at} maps inputs {sorted(step.inputs)}, but {step.model!r} takes {sorted(wanted)}",
                    sorted(set(step.inputs) ^ set(wanted))[0],
                )
            for name, source in step.inputs.items():
                have = known[source]
                if have is not None and not _fits(have, wanted[name]):
                    raise PipelineMismatch(
                        f"{at}: {source!r} is {_said(have)}, but {step.model!r} takes {_said(wanted[name])} as {name!r}",
                        source,
                    )
            given = {spec.name: (spec.datatype, spec.shape) for spec in model.outputs}
            unknown = sorted(set(step.outputs) - set(given))
            if unknown:
                raise PipelineMismatch(f"{at} keeps outputs {unknown}, which {step.model!r} does not give", unknown[0])
        for output, name in step.outputs.items():
            if name in known:
                raise PipelineMismatch(f"{at} names an output {name!r}, which the pipeline already has", name)
            known[name] = given[output] if step.model else None
    for spec in pipeline.outputs:
        if spec.name not in known:
            raise PipelineMismatch(f"{where}: its output {spec.name!r} is given by no step", spec.name)
        have, declared = known[spec.name], (spec.datatype, spec.shape)
        if have is not None and not _fits(have, declared):
            raise PipelineMismatch(
                f"{where}: its output {spec.name!r} is {_said(have)}, but it declares {_said(declared)}", spec.name
            )


def _fits(have: Known, want: Known) -> bool:
    """Whether a tensor of `have` always fits `want`: the same datatype and rank, and each
    non-batch dimension equal or free (-1) in `want`."""
    (have_type, have_shape), (want_type, want_shape) = have, want
    if have_type != want_type or len(have_shape) != len(want_shape):
        return False
    return all(w in (-1, h) for h, w in zip(have_shape[1:], want_shape[1:], strict=True))


def _said(known: Known) -> str:
    return f"{known[0]} {list(known[1])}"
