"""OpsService.LoadModel / UnloadModel: hot updates across the batchers connected to this
scheduler (model_controls.py sends them and collects the answers). Mixed into OpsService."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from asyncinfer.errors import FieldViolation, InvalidArgument, Unavailable
from asyncinfer.jobs import NAME_PATTERN, NAME_RULE, JobError
from asyncinfer.model_json import parse_model_json
from asyncinfer.proto_durations import checked_duration
from asyncinfer.v1 import error_pb2, ops_service_pb2
from services.scheduler.model_controls import ControlOutcome, ModelControls

Context = grpc.aio.ServicerContext[Any, Any]
DEFAULT_CONTROL_TIMEOUT_S = 120.0


def _outcomes(
    outcomes: list[ControlOutcome], error_to_proto: Callable[[JobError], error_pb2.ErrorStatus]
) -> list[ops_service_pb2.ModelControlOutcome]:
    return [
        ops_service_pb2.ModelControlOutcome(
            batcher_id=o.batcher_id,
            ok=o.error is None,
            error=error_to_proto(o.error) if o.error is not None else None,
        )
        for o in outcomes
    ]


def _checked(model_name: str, timeout: Any, has_timeout: bool) -> float:
    if not model_name:
        raise InvalidArgument("model_name is required", [FieldViolation("model_name", "give the model")])
    if not NAME_PATTERN.match(model_name):
        raise InvalidArgument(
            f"model_name {model_name[:80]!r} cannot be a model's name",
            [FieldViolation("model_name", NAME_RULE)],
        )
    violations: list[FieldViolation] = []
    given = checked_duration(timeout, "timeout", violations) if has_timeout else None
    if violations:
        raise InvalidArgument(f"invalid request: timeout: {violations[0].description}", violations)
    timeout_s = given if given is not None else DEFAULT_CONTROL_TIMEOUT_S
    if timeout_s <= 0:
        raise InvalidArgument("timeout must be positive", [FieldViolation("timeout", "give a positive duration")])
    return timeout_s


class ModelOps:
    _controls: ModelControls | None
    _error_to_proto: Callable[[JobError], error_pb2.ErrorStatus]

    def _model_controls(self) -> ModelControls:
        if self._controls is None:
            raise Unavailable("model control is not set up on this scheduler", reason="MODEL_CONTROL_UNAVAILABLE")
        return self._controls

    async def LoadModel(
        self, request: ops_service_pb2.LoadModelRequest, context: Context
    ) -> ops_service_pb2.LoadModelResponse:
        timeout_s = _checked(request.model_name, request.timeout, request.HasField("timeout"))
        if request.config_json:
            parse_model_json(request.config_json, "config_json")  # refused here at once, not by each batcher
        outcomes = await self._model_controls().run(
            action="LOAD",
            model_name=request.model_name,
            config_json=request.config_json,
            batcher_ids=list(request.batcher_ids),
            timeout_s=timeout_s,
        )
        return ops_service_pb2.LoadModelResponse(outcomes=_outcomes(outcomes, self._error_to_proto))

    async def UnloadModel(
        self, request: ops_service_pb2.UnloadModelRequest, context: Context
    ) -> ops_service_pb2.UnloadModelResponse:
        timeout_s = _checked(request.model_name, request.timeout, request.HasField("timeout"))
        outcomes = await self._model_controls().run(
            action="UNLOAD",
            model_name=request.model_name,
            model_version=request.model_version,
            batcher_ids=list(request.batcher_ids),
            timeout_s=timeout_s,
        )
        return ops_service_pb2.UnloadModelResponse(outcomes=_outcomes(outcomes, self._error_to_proto))
