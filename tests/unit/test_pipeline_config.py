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
