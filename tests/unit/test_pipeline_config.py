"""Pipelines as configuration declares them (asyncinfer.pipelines): what passes, and each way a
pipeline's steps can be wrong, refused at start-up with the step named."""

from __future__ import annotations

from typing import Any

import pytest

from asyncinfer.config import (
    DEMO_MODEL,
    MINILM_DOC_MODEL,
    MINILM_DOC_PIPELINE,
    MINILM_MODEL,
    Config,
    render_default_config,
)
from asyncinfer.errors import ConfigError

pytestmark = pytest.mark.unit

DEMO = DEMO_MODEL.model_dump()
X = {"name": "x", "datatype": "FP32", "shape": [-1, 4]}
Y = {"name": "y", "datatype": "FP32", "shape": [-1, 4]}


def pipeline(steps: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"name": "twice", "inputs": [X], "outputs": [Y], "steps": steps, **fields}


def twice_steps() -> list[dict[str, Any]]:
    return [
        {"model": "demo", "inputs": {"x": "x"}, "outputs": {"y": "once"}},
        {"model": "demo", "inputs": {"x": "once"}, "outputs": {"y": "y"}},
    ]


def load(*models: dict[str, Any]) -> Config:
    try:
        return Config.model_validate({"models": [DEMO, *models]})
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def test_a_pipeline_of_two_demo_steps_is_valid() -> None:
    config = load(pipeline(twice_steps()))
    twice = config.model("twice")
    assert twice is not None
    assert [step.label for step in twice.steps] == ["demo", "demo"]
    assert twice.signature.inputs == DEMO_MODEL.signature.inputs


def test_the_document_pipeline_is_valid_and_round_trips_through_toml() -> None:
    config = Config(models=(MINILM_MODEL, MINILM_DOC_MODEL, MINILM_DOC_PIPELINE))
    assert [step.label for step in MINILM_DOC_PIPELINE.steps] == ["chunk", "minilm-l6", "pool"]
    import tomllib

    again = Config.model_validate(tomllib.loads(render_default_config(config)))
    assert again.model("minilm-l6-doc-pipeline") == MINILM_DOC_PIPELINE


@pytest.mark.parametrize(
    ("steps", "fields", "said"),
    [
        ([{"model": "nope", "inputs": {"x": "x"}, "outputs": {"y": "y"}}], {}, "no model 'nope'"),
        ([{"model": "demo", "inputs": {"x": "z"}, "outputs": {"y": "y"}}], {}, "takes ['z']"),
        ([{"model": "demo", "inputs": {}, "outputs": {"y": "y"}}], {}, "maps inputs []"),
        ([{"model": "demo", "inputs": {"x": "x"}, "outputs": {"w": "y"}}], {}, "keeps outputs ['w']"),
        ([{"model": "demo", "inputs": {"x": "x"}, "outputs": {"y": "x"}}], {}, "already has"),
        ([{"model": "demo", "inputs": {"x": "x"}, "outputs": {"y": "other"}}], {}, "given by no step"),
        (
            twice_steps(),
            {"inputs": [{"name": "x", "datatype": "INT64", "shape": [-1, 4]}]},
            "'x' is INT64 [-1, 4], but 'demo' takes FP32",
        ),
        (twice_steps(), {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 5]}]}, "FP32 [-1, 5]"),
        (twice_steps(), {"outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}]}, "declares FP32 [-1, 3]"),
        (
            [{"model": "demo", "function": "a.b:c", "inputs": {"x": "x"}, "outputs": {"y": "y"}}],
            {},
            "either a model or a function",
        ),
        ([{"function": "nocolon", "inputs": {"x": "x"}, "outputs": {"y": "y"}}], {}, "package.module:function"),
    ],
)
def test_a_wrong_pipeline_is_refused_with_the_step_named(
    steps: list[dict[str, Any]], fields: dict[str, Any], said: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        load(pipeline(steps, **fields))
    assert said in str(refused.value)


def test_pipelines_do_not_nest() -> None:
    inner = pipeline(twice_steps())
    outer = pipeline(
        [{"model": "twice", "inputs": {"x": "x"}, "outputs": {"y": "y"}}],
        name="outer",
    )
    with pytest.raises(ConfigError, match="pipelines do not nest"):
        load(inner, outer)


def test_a_function_steps_outputs_are_checked_when_it_runs() -> None:
    """What a function gives is unknown to the configuration: a later step may take it."""
    steps = [
        {"function": "json:loads", "inputs": {"s": "x"}, "outputs": {"out": "mid"}},
        {"model": "demo", "inputs": {"x": "mid"}, "outputs": {"y": "y"}},
    ]
    assert load(pipeline(steps)).model("twice") is not None


WIDE_X = {"name": "x", "datatype": "FP32", "shape": [-1, 8]}


def demo_with_version_2(own_inputs: dict[str, Any], version_2_inputs: dict[str, Any], default: str) -> dict[str, Any]:
    return {
        **DEMO,
        "inputs": [own_inputs],
        "versions": [{"version": "2", "inputs": [version_2_inputs]}],
        "default_version": default,
    }


def load_with_demo(demo: dict[str, Any], *models: dict[str, Any]) -> Config:
    try:
        return Config.model_validate({"models": [demo, *models]})
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


@pytest.mark.parametrize("default", ["2", ""], ids=["default_version", "highest"])
def test_a_step_model_is_checked_on_the_version_its_steps_run_on(default: str) -> None:
    """Steps run on their model's default version (default_version, else the highest): a
    [[models.versions]] entry that changes the inputs and is that version was not checked (only
    the model's own table was), and every job of the pipeline failed at the step."""
    with pytest.raises(ConfigError) as refused:
        load_with_demo(demo_with_version_2(X, WIDE_X, default), pipeline(twice_steps()))
    said = str(refused.value)
    assert "pipeline 'twice' step 1 (demo): 'x' is FP32 [-1, 4], but 'demo' takes FP32 [-1, 8] as 'x'" in said
    assert "(steps run on their model's default version: 'demo' on version '2')" in said


def test_a_step_models_own_table_need_not_fit_when_its_default_version_does() -> None:
    """The model's own table is version 1; the steps run on version 2, which fits."""
    config = load_with_demo(demo_with_version_2(WIDE_X, X, "2"), pipeline(twice_steps()))
    assert config.model("twice") is not None
    with pytest.raises(ConfigError, match=r"'demo' takes FP32 \[-1, 8\] as 'x'"):
        load_with_demo(demo_with_version_2(WIDE_X, X, "1"), pipeline(twice_steps()))
