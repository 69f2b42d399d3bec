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

from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from asyncinfer.errors import FailedPrecondition, FieldViolation, InvalidArgument, Unavailable
from asyncinfer.model_json import parse_model_json
from services.batcher.engine import BatchingEngine
from services.batcher.model_control import ModelControl, Repository

Context = grpc.aio.ServicerContext[Any, Any]


def _config_parameter(request: service_pb2.RepositoryModelLoadRequest) -> dict[str, Any] | None:
    if "config" not in request.parameters:
        return None
    param = request.parameters["config"]
    if param.WhichOneof("parameter_choice") != "string_param":
        raise InvalidArgument(
            "parameter config must be a string", [FieldViolation("parameters.config", "give the model as JSON text")]
        )
    return parse_model_json(param.string_param, "parameters.config")


class RepositoryServicer:
    """The repository RPCs (mixed into KServeServicer)."""

    _engine: BatchingEngine
    _models: ModelControl | None
    _repository: Repository | None

    def _control(self) -> ModelControl:
        if self._models is None:
            raise Unavailable("this batcher has no model control", reason="MODEL_CONTROL_UNAVAILABLE")
        return self._models

    async def RepositoryModelLoad(
        self, request: service_pb2.RepositoryModelLoadRequest, context: Context
    ) -> service_pb2.RepositoryModelLoadResponse:
        await self._control().load_model(request.model_name, _config_parameter(request))
        return service_pb2.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, request: service_pb2.RepositoryModelUnloadRequest, context: Context
    ) -> service_pb2.RepositoryModelUnloadResponse:
        await self._control().unload_model(request.model_name)
        return service_pb2.RepositoryModelUnloadResponse()

    async def RepositoryIndex(
        self, request: service_pb2.RepositoryIndexRequest, context: Context
    ) -> service_pb2.RepositoryIndexResponse:
        Index = service_pb2.RepositoryIndexResponse.ModelIndex
        rows: dict[tuple[str, str], tuple[str, str]] = {}
        if self._repository is not None and not request.ready:
            try:
                declared = self._repository()
            except FailedPrecondition:
                declared = ()  # a file made invalid since: what serves is listed all the same
            for model in declared:
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
