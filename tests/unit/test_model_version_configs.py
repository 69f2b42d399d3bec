"""A model's versions as whole configurations (ModelConfig.version_configs): made once per
configuration, since every submit asks for its version's (each was a validation: ~24 us a submit
for a model of two versions), and never carried over to a copy whose fields differ."""

from __future__ import annotations

import pytest

from asyncinfer.config import DEMO_MODEL, ModelConfig, ModelVersionConfig

pytestmark = pytest.mark.unit


def two_versions() -> ModelConfig:
    return DEMO_MODEL.model_copy(update={"versions": (ModelVersionConfig(version="2", max_batch_size=8),)})


def test_the_versions_are_made_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model = two_versions()
    made = []
    real = ModelConfig.with_version

    def counting(self: ModelConfig, version: ModelVersionConfig) -> ModelConfig:
        made.append(version.version)
        return real(self, version)

    monkeypatch.setattr(ModelConfig, "with_version", counting)
    for _ in range(100):
        declared = model.declared_version("2")
        assert declared is not None
        assert declared.max_batch_size == 8
    assert made == ["2"]


def test_a_copy_with_other_fields_has_its_own_versions() -> None:
    model = two_versions()
    assert [c.version for c in model.version_configs()] == ["1", "2"]
    renamed = model.model_copy(update={"version": "9"})
    assert [c.version for c in renamed.version_configs()] == ["9", "2"]
    more = model.model_copy(update={"versions": (*model.versions, ModelVersionConfig(version="3"))})
    assert [c.version for c in more.version_configs()] == ["1", "2", "3"]
    assert [c.version for c in model.version_configs()] == ["1", "2"]
