"""The batcher's synchronous API: KServe v2 `inference.GRPCInferenceService`, so tritonclient and
any v2 client work against it unchanged. Requests go through the same engine as scheduled work.

Like Triton, answers carry outputs in `raw_output_contents` (what tritonclient's `as_numpy`
reads). A model's versions are served side by side: a request that names no version runs on the
model's default (its default_version, else the highest served). The repository RPCs (load, unload,
index) are kserve_repository.py's. ModelConfig answers as Triton's would for the same model
(max_batch_size, the inputs and outputs without their batch dimension, the dynamic batcher's
settings), which perf_analyzer and clients that size their requests read. RPCs not implemented
here (shared memory, statistics, streaming) answer UNIMPLEMENTED from the generated base class.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import metadata
from typing import Any

import grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from asyncinfer.config import ModelConfig
from asyncinfer.errors import FieldViolation, InvalidArgument, NotFound, Unavailable
from asyncinfer.jobs import Priority
from asyncinfer.tensor_codec import decode_tensor
from asyncinfer.tensors import Tensor
from services.batcher.engine import BatchingEngine
from services.batcher.kserve_repository import RepositoryServicer
from services.batcher.model_control import ModelControl, Repository

SERVICE_NAME = "inference.GRPCInferenceService"
SERVER_NAME = "asyncinfer-batcher"
PLATFORMS = {"torch": "pytorch_libtorch", "triton": "triton"}

Context = grpc.aio.ServicerContext[Any, Any]


def _server_version() -> str:
    try:
        return metadata.version("asyncinfer")
    except metadata.PackageNotFoundError:
        return "0"


def decode_infer_inputs(request: service_pb2.ModelInferRequest) -> list[Tensor]:
    """The request's inputs as Tensors: v2 gives either typed contents inside each input or
    `raw_input_contents` parallel to the inputs. InvalidArgument lists every bad field."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgument(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs",
            [FieldViolation("raw_input_contents", "give one raw entry per input, in the inputs' order")],
        )
    tensors: list[Tensor] = []
    violations: list[FieldViolation] = []
    for index, message in enumerate(request.inputs):
        path = f"inputs[{index}]"
        if not message.name:
            violations.append(FieldViolation(f"{path}.name", "every tensor needs a name"))
            continue
        try:
            tensors.append(decode_tensor(message, path, raw[index] if raw else None))
        except InvalidArgument as exc:
            violations.extend(exc.violations)
    if violations:
        raise InvalidArgument(f"invalid inputs: {violations[0].field}: {violations[0].description}", violations)
    return tensors


def _triton_tensor(name: str, datatype: str, shape: tuple[int, ...]) -> dict[str, Any]:
    """A tensor as Triton's model configuration has it: its dims without the batch dimension (the
    model batches); a tensor of one value per row is dims [1] reshaped to [] (Triton's rule: dims
    are never empty)."""
    fields: dict[str, Any] = {
        "name": name,
        "data_type": model_config_pb2.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"),
        "dims": list(shape[1:]) or [1],
    }
    if not shape[1:]:
        fields["reshape"] = model_config_pb2.ModelTensorReshape(shape=[])
    return fields


def request_priority(request: service_pb2.ModelInferRequest) -> Priority:
    """Triton's `priority` request parameter: 1 is the highest level; 0 or absent is the default.
    Here 1 -> HIGH, 2 -> NORMAL, 3 or more -> LOW (the same numbers as asyncinfer.v1.Priority)."""
    if "priority" not in request.parameters:
        return Priority.NORMAL
    param = request.parameters["priority"]
    kind = param.WhichOneof("parameter_choice")
    if kind not in ("int64_param", "uint64_param"):
        raise InvalidArgument(
            "parameter priority must be an integer",
            [FieldViolation("parameters.priority", "give an integer: 1 (highest), 2, 3 (lowest); 0: default")],
        )
    level = int(getattr(param, kind))
    if level == 1:
        return Priority.HIGH
    if level >= 3:
        return Priority.LOW
    return Priority.NORMAL


def request_timeout_s(request: service_pb2.ModelInferRequest, context: Context) -> float | None:
    """The sooner of the call's deadline and Triton's `timeout` parameter (microseconds)."""
    remaining = context.time_remaining()
    if "timeout" in request.parameters:
        param = request.parameters["timeout"]
        kind = param.WhichOneof("parameter_choice")
        if kind in ("int64_param", "uint64_param") and int(getattr(param, kind)) > 0:
            timeout_s = int(getattr(param, kind)) / 1e6
            remaining = timeout_s if remaining is None else min(remaining, timeout_s)
    return remaining


class KServeServicer(RepositoryServicer, service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def __init__(
        self,
        engine: BatchingEngine,
        load_failures: Mapping[str, str] | None = None,
        models: ModelControl | None = None,
        repository: Repository | None = None,
    ) -> None:
        self._engine = engine
        # The app's own mapping (not a copy): a reload updates it.
        self._load_failures = load_failures if load_failures is not None else {}
        self._models = models
        self._repository = repository

    def _model(self, name: str, version: str) -> ModelConfig:
        """The version asked for (empty: the model's default), looked up per request: versions
        come and go while the batcher serves."""
        if self._engine.has_model(name, version) if version else self._engine.has_model(name):
            return self._engine.model_config(name, version)
        if name in self._load_failures:
            raise Unavailable(f"model {name!r} failed to load: {self._load_failures[name]}", reason="MODEL_LOAD_FAILED")
        if not self._engine.has_model(name):
            raise NotFound(f"model {name!r} is not served here", reason="MODEL_NOT_FOUND")
        served = ", ".join(self._engine.versions(name))
        raise NotFound(
            f"model {name!r} has no version {version!r} (served: {served})", reason="MODEL_VERSION_NOT_FOUND"
        )

    async def ServerLive(
        self, request: service_pb2.ServerLiveRequest, context: Context
    ) -> service_pb2.ServerLiveResponse:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: service_pb2.ServerReadyRequest, context: Context
    ) -> service_pb2.ServerReadyResponse:
        ready = self._engine.accepting and not self._load_failures and not self._engine.unreachable_models()
        return service_pb2.ServerReadyResponse(ready=ready)

    async def ServerMetadata(
        self, request: service_pb2.ServerMetadataRequest, context: Context
    ) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(name=SERVER_NAME, version=_server_version(), extensions=[])

    async def ModelReady(
        self, request: service_pb2.ModelReadyRequest, context: Context
    ) -> service_pb2.ModelReadyResponse:
        # Like Triton: an unknown model (or version) is simply not ready; nor is one whose Triton is
        # out of reach (it takes no work until it answers). With no version, the default version's
        # (the one a request naming none runs on), as Triton answers for the version it would pick:
        # another version's outage leaves the model ready.
        ready = self._engine.version_ready(request.name, request.version)
        return service_pb2.ModelReadyResponse(ready=ready and self._engine.accepting)

    async def ModelMetadata(
        self, request: service_pb2.ModelMetadataRequest, context: Context
    ) -> service_pb2.ModelMetadataResponse:
        config = self._model(request.name, request.version)
        signature = config.signature
        Meta = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=config.name,
            # Every version served, when no version is asked for (Triton lists the available ones).
            versions=[config.version] if request.version else self._engine.versions(config.name),
            platform=PLATFORMS.get(config.backend, config.backend),
            inputs=[Meta(name=s.name, datatype=s.datatype, shape=s.shape) for s in signature.inputs],
            outputs=[Meta(name=s.name, datatype=s.datatype, shape=s.shape) for s in signature.outputs],
        )

    async def ModelConfig(
        self, request: service_pb2.ModelConfigRequest, context: Context
    ) -> service_pb2.ModelConfigResponse:
        config = self._model(request.name, request.version)
        signature = config.signature
        return service_pb2.ModelConfigResponse(
            config=model_config_pb2.ModelConfig(
                name=config.name,
                platform=PLATFORMS.get(config.backend, config.backend),
                max_batch_size=config.max_batch_size,
                input=[
                    model_config_pb2.ModelInput(**_triton_tensor(s.name, s.datatype, s.shape)) for s in signature.inputs
                ],
                output=[
                    model_config_pb2.ModelOutput(**_triton_tensor(s.name, s.datatype, s.shape))
                    for s in signature.outputs
                ],
                dynamic_batching=model_config_pb2.ModelDynamicBatching(
                    preferred_batch_size=list(config.preferred_batch_sizes),
                    max_queue_delay_microseconds=round(config.max_queue_delay_ms * 1000),
                ),
            )
        )

    async def ModelInfer(
        self, request: service_pb2.ModelInferRequest, context: Context
    ) -> service_pb2.ModelInferResponse:
        config = self._model(request.model_name, request.model_version)
        declared = tuple(spec.name for spec in config.signature.outputs)
        requested = [output.name for output in request.outputs]
        unknown = [
            FieldViolation(f"outputs[{i}].name", f"unknown output {name!r}; the model has: {', '.join(declared)}")
            for i, name in enumerate(requested)
            if name not in declared
        ]
        if unknown:
            raise InvalidArgument(f"invalid outputs: {unknown[0].description}", unknown)
        inputs = decode_infer_inputs(request)
        outcome = await self._engine.infer(
            config.name,
            inputs,
            timeout_s=request_timeout_s(request, context),
            priority=request_priority(request),
            version=config.version,
        )
        response = service_pb2.ModelInferResponse(model_name=config.name, model_version=config.version, id=request.id)
        for tensor in outcome.outputs:
            if requested and tensor.name not in requested:
                continue
            response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            response.raw_output_contents.append(tensor.data)
        return response
