"""The KServe v2 / Triton model repository extension on the batcher: RepositoryIndex,
RepositoryModelLoad and RepositoryModelUnload, so that tritonclient's `get_model_repository_index`,
`load_model` and `unload_model` work against a batcher unchanged (Triton's explicit model
control). The repository is the batcher's configuration file: its [[models]] tables.

- `load_model(name)` makes the model's versions what the file declares now (loading the new ones,
  replacing the changed ones, unloading the ones it no longer lists);
- `load_model(name, config=JSON)` does the same with the versions the JSON declares: a model
  table (`version`, `loader`, `versions`, ...) laid over the file's table for the model (or the
  version served now when the file has none), its `versions` and `default_version` replaced;
- `unload_model(name)` unloads every version of the model.
A load answers once the new versions are warmed up and serving (or failed: UNAVAILABLE with the
reason); an unload once what the versions held has finished. Model control itself is
model_control.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from pydantic import ValidationError
from tritonclient.grpc import service_pb2

from asyncinfer.config import ModelConfig
from asyncinfer.errors import FieldViolation, InvalidArgument, NotFound, Unavailable
from asyncinfer.jobs import NAME_PATTERN
from services.batcher.engine import BatchingEngine
from services.batcher.model_control import ModelControl

Context = grpc.aio.ServicerContext[Any, Any]
# The model tables the repository (the configuration file) declares now.
Repository = Callable[[], Sequence[ModelConfig]]


def _config_parameter(request: service_pb2.RepositoryModelLoadRequest) -> dict[str, Any] | None:
    if "config" not in request.parameters:
        return None
    param = request.parameters["config"]
    if param.WhichOneof("parameter_choice") != "string_param":
        raise InvalidArgument(
            "parameter config must be a string", [FieldViolation("parameters.config", "give the model as JSON text")]
        )
    try:
        data = json.loads(param.string_param)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(
            f"parameter config is not JSON: {exc}", [FieldViolation("parameters.config", str(exc))]
        ) from None
    if not isinstance(data, dict):
        raise InvalidArgument("parameter config must be a JSON object", [FieldViolation("parameters.config", "")])
    return data


class RepositoryServicer:
    """The repository RPCs (mixed into KServeServicer)."""

    _engine: BatchingEngine
    _models: ModelControl | None
    _repository: Repository | None

    def _versions_to_load(self, name: str, override: dict[str, Any] | None) -> list[ModelConfig]:
        declared = self._declared(name)
        if override is None:
            if not declared:
                raise NotFound(f"the repository declares no model {name!r}", reason="MODEL_NOT_FOUND")
            return declared
        if declared:
            base = declared[0].model_dump()
        elif self._engine.has_model(name):
            base = self._engine.model_config(name).model_dump()
        else:
            base = {}
        data = {**base, "versions": (), "default_version": "", **override, "name": name}
        try:
            return list(ModelConfig.model_validate(data).version_configs())
        except ValidationError as exc:
            violations = [
                FieldViolation(f"parameters.config.{'.'.join(str(p) for p in e['loc'])}", e["msg"])
                for e in exc.errors(include_url=False)
            ]
            raise InvalidArgument(f"invalid model config: {violations[0].description}", violations) from None

    def _control(self) -> ModelControl:
        if self._models is None:
            raise Unavailable("this batcher has no model control", reason="MODEL_CONTROL_UNAVAILABLE")
        return self._models

    async def RepositoryModelLoad(
        self, request: service_pb2.RepositoryModelLoadRequest, context: Context
    ) -> service_pb2.RepositoryModelLoadResponse:
        name = request.model_name
        if not NAME_PATTERN.match(name):
            raise InvalidArgument(f"invalid model name {name[:64]!r}", [FieldViolation("model_name", "")])
        control = self._control()
        versions = self._versions_to_load(name, _config_parameter(request))
        await control.apply(name, versions)
        failed = {v: r for (n, v), r in control.failures.items() if n == name}
        if failed:
            detail = "; ".join(f"version {v}: {r}" for v, r in failed.items())
            raise Unavailable(f"model {name!r} did not load: {detail}", reason="MODEL_LOAD_FAILED")
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: service_pb2.RepositoryModelUnloadRequest, context: Context
    ) -> service_pb2.RepositoryModelUnloadResponse:
        control = self._control()
        if not self._engine.has_model(request.model_name):
            raise NotFound(f"model {request.model_name!r} is not loaded here", reason="MODEL_NOT_FOUND")
        await control.apply(request.model_name, [])
        return service_pb2.RepositoryModelUnloadResponse()

    async def RepositoryIndex(
        self, request: service_pb2.RepositoryIndexRequest, context: Context
    ) -> service_pb2.RepositoryIndexResponse:
        Index = service_pb2.RepositoryIndexResponse.ModelIndex
        rows: dict[tuple[str, str], tuple[str, str]] = {}
        if self._repository is not None and not request.ready:
            for model in self._repository():
                for config in model.version_configs():
                    rows[(model.name, config.version)] = ("UNAVAILABLE", "unloaded")
        if self._models is not None:
            for key, reason in self._models.failures.items():
                rows[key] = ("UNAVAILABLE", reason)
            for key in self._models.loading:
                rows[key] = ("LOADING", "")
        for name in self._engine.model_names:
            for version in self._engine.versions(name):
                rows[(name, version)] = ("READY", "")
        return service_pb2.RepositoryIndexResponse(
            models=[
                Index(name=name, version=version, state=state, reason=reason)
                for (name, version), (state, reason) in sorted(rows.items())
                if not request.ready or state == "READY"
            ]
        )

    def _declared(self, name: str) -> list[ModelConfig]:
        if self._repository is None:
            return []
        for model in self._repository():
            if model.name == name:
                return list(model.version_configs())
        return []
