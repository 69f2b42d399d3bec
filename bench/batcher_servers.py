"""Servers for the batcher benchmark and tests, each run as its own process:

    python bench/batcher_servers.py batcher  PORT MODEL MAX_BATCH DELAY_MS
    python bench/batcher_servers.py pytriton PORT MODEL MAX_BATCH DELAY_MS   (needs LD_LIBRARY_PATH=libpython's dir)
    python bench/batcher_servers.py echo     PORT                            (a trivial unary grpc.aio call)
    python bench/batcher_servers.py kecho    PORT                            (a KServe ModelInfer doing nothing)

MODEL is mlp, minilm or affine (y = 2x + 1 on FP32 [-1, 4]; for tests: a batch holding -1 fails;
beside it the tests' affine-unbatched, and text and text-unbatched: BYTES texts upper-cased, and
their lengths in characters).
Both print "READY" on stdout once serving, and stop on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncinfer.gc_tuning import tune_for_serving

AFFINE_FAILURE = "affine refuses -1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


ECHO_METHOD = "/bench.Echo/Call"


def serve_echo(port: int) -> None:
    """A trivial unary call (1 KB in, 2 bytes out) on uvloop, like every server here."""
    import grpc

    async def call(request: bytes, context: object) -> bytes:
        return b"ok"

    async def main() -> None:
        handler = grpc.method_handlers_generic_handler(
            "bench.Echo", {"Call": grpc.unary_unary_rpc_method_handler(call)}
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        await _serve_until_signalled(server, port)

    _run_profiled(main)


async def _serve_until_signalled(server: Any, port: int) -> None:
    """Starts a grpc.aio server on 127.0.0.1:port and serves until SIGTERM/SIGINT."""
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await _ready_until_signalled()
    await server.stop(0)


async def _ready_until_signalled() -> None:
    """Once a server has started: tunes the collector (as services.cli does for every service),
    prints READY, and returns on SIGTERM/SIGINT."""
    tune_for_serving()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("READY", flush=True)
    await stop.wait()


def serve_kserve_echo(port: int) -> None:
    """A KServe v2 ModelInfer that does nothing: it answers every request with the same canned
    [1, 512] FP32 output (parsing the request, as any server must). Driven by the same
    tritonclient client as the batcher, it is the ceiling per-request RPC overhead puts on a
    Python KServe server here, client included."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    canned = np.zeros((1, 512), dtype=np.float32).tobytes()

    class Echo(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
        async def ModelInfer(
            self, request: service_pb2.ModelInferRequest, context: object
        ) -> service_pb2.ModelInferResponse:
            response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
            response.outputs.add(name="y", datatype="FP32", shape=[1, 512])
            response.raw_output_contents.append(canned)
            return response

    async def main() -> None:
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Echo(), server)
        await _serve_until_signalled(server, port)

    _run_profiled(main)


def serve_batcher(port: int, model: str, max_batch: int, delay_ms: float, metrics_port: int = 0) -> None:
    import os

    from asyncinfer.config import Config
    from bench.batcher_models import minilm_config, mlp_config
    from services.batcher.app import BatcherApp

    config = (mlp_config if model == "mlp" else minilm_config)(max_batch, delay_ms)
    if os.environ.get("BENCH_INFLIGHT"):  # for experiments
        config = config.model_copy(update={"max_inflight_batches": int(os.environ["BENCH_INFLIGHT"])})
    torch_threads = int(os.environ.get("BENCH_TORCH_THREADS", "0"))
    app_config = Config().replace(
        batcher={
            "port": port,
            "metrics_port": metrics_port,
            "scheduler_address": None,
            "torch_threads": torch_threads,
        },
        logging={"level": "warning"},
        models=[config],
    )

    async def main() -> None:
        app = BatcherApp(app_config)
        await app.start()
        await _ready_until_signalled()
        await app.stop(grace_s=1.0)

    _run_profiled(main)


def _run_profiled(main: Any) -> None:
    """main() on uvloop, under cProfile when BENCH_PROFILE names a file to write the stats to."""
    import os

    import uvloop

    # On uvloop, as the services run (services.cli).
    target = os.environ.get("BENCH_PROFILE")
    if not target:
        uvloop.run(main())
        return
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        uvloop.run(main())
    finally:
        profiler.disable()
        profiler.dump_stats(target)


def _affine_unbatched(requests: list[dict[str, np.ndarray[Any, Any]]]) -> list[dict[str, np.ndarray[Any, Any]]]:
    return [{"y": (2 * request["x"] + 1).astype(np.float32)} for request in requests]


def _texts(text: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """Each UTF-8 text upper-cased (as np.bytes_, as models commonly return text) and its length
    in characters, in the shape of `text`."""
    decoded = [bytes(t).decode("utf-8") for t in text.reshape(-1)]
    upper = np.array([t.upper().encode("utf-8") for t in decoded], dtype=np.bytes_).reshape(text.shape)
    length = np.array([len(t) for t in decoded], dtype=np.int64).reshape(text.shape)
    return {"upper": upper, "length": length}


def _texts_unbatched(requests: list[dict[str, np.ndarray[Any, Any]]]) -> list[dict[str, np.ndarray[Any, Any]]]:
    return [_texts(request["text"]) for request in requests]


def serve_pytriton(port: int, model: str, max_batch: int, delay_ms: float) -> None:
    import os

    import torch

    if int(os.environ.get("BENCH_TORCH_THREADS", "0")) > 0:
        torch.set_num_threads(int(os.environ["BENCH_TORCH_THREADS"]))
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    if model == "affine":

        @batch  # type: ignore[misc]
        def infer(x: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
            if bool((x == -1).any()):
                raise ValueError(AFFINE_FAILURE)
            return {"y": (2 * x + 1).astype(np.float32)}

        inputs = [Tensor(name="x", dtype=np.float32, shape=(4,))]
        outputs = [Tensor(name="y", dtype=np.float32, shape=(4,))]
    elif model == "mlp":
        from bench.batcher_models import build_mlp, torch_device

        device = torch_device()  # $BENCH_DEVICE: the GPU benchmark runs both servers on CUDA
        mlp = build_mlp().to(device)

        @batch  # type: ignore[misc]
        def infer(x: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
            with torch.inference_mode():
                return {"y": mlp(torch.from_numpy(x).to(device)).cpu().numpy()}

        inputs = [Tensor(name="x", dtype=np.float32, shape=(512,))]
        outputs = [Tensor(name="y", dtype=np.float32, shape=(512,))]
    else:
        from asyncinfer.config import BatcherConfig
        from bench.batcher_models import minilm_config
        from services.batcher.backends.loading import load_backend

        backend = load_backend(minilm_config(max_batch, delay_ms), BatcherConfig())

        @batch  # type: ignore[misc]
        def infer(text: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
            return backend.infer_batch({"text": text.reshape(-1)})

        inputs = [Tensor(name="text", dtype=np.bytes_, shape=(1,))]
        outputs = [Tensor(name="embedding", dtype=np.float32, shape=(384,))]

    config = TritonConfig(grpc_port=port, http_port=free_port(), metrics_port=free_port(), log_verbose=0)
    with Triton(config=config) as triton:
        triton.bind(
            model_name=model,
            infer_func=infer,
            inputs=inputs,
            outputs=outputs,
            config=ModelConfig(
                max_batch_size=max_batch,
                batcher=DynamicBatcher(max_queue_delay_microseconds=int(delay_ms * 1000)),
            ),
        )
        if model == "affine":
            # The same model without Triton's batching (max_batch_size 0): each request is exactly
            # one row, shape [1, 4] (tests/test_batcher_triton.py).
            triton.bind(
                model_name="affine-unbatched",
                infer_func=_affine_unbatched,
                inputs=[Tensor(name="x", dtype=np.float32, shape=(1, 4))],
                outputs=[Tensor(name="y", dtype=np.float32, shape=(1, 4))],
                config=ModelConfig(batching=False),
            )
            # Text (BYTES) in and out, upper-cased and its length in characters: "text" batched by
            # Triton (shape [-1, 1]), "text-unbatched" taking a whole batch as one [-1] request.
            triton.bind(
                model_name="text",
                infer_func=batch(_texts),
                inputs=[Tensor(name="text", dtype=np.bytes_, shape=(1,))],
                outputs=[
                    Tensor(name="upper", dtype=np.bytes_, shape=(1,)),
                    Tensor(name="length", dtype=np.int64, shape=(1,)),
                ],
                config=ModelConfig(
                    max_batch_size=max_batch,
                    batcher=DynamicBatcher(max_queue_delay_microseconds=int(delay_ms * 1000)),
                ),
            )
            triton.bind(
                model_name="text-unbatched",
                infer_func=_texts_unbatched,
                inputs=[Tensor(name="text", dtype=np.bytes_, shape=(-1,))],
                outputs=[
                    Tensor(name="upper", dtype=np.bytes_, shape=(-1,)),
                    Tensor(name="length", dtype=np.int64, shape=(-1,)),
                ],
                config=ModelConfig(batching=False),
            )
        triton.run()
        print("READY", flush=True)
        stop = False

        def handle(_sig: int, _frame: object) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)
        while not stop:
            signal.pause()


if __name__ == "__main__":
    kind, port = sys.argv[1:3]
    if kind == "echo":
        serve_echo(int(port))
    elif kind == "kecho":
        serve_kserve_echo(int(port))
    elif kind == "batcher":
        model, max_batch, delay_ms, metrics_port = sys.argv[3:7]
        serve_batcher(int(port), model, int(max_batch), float(delay_ms), int(metrics_port))
    else:
        model, max_batch, delay_ms = sys.argv[3:6]
        serve_pytriton(int(port), model, int(max_batch), float(delay_ms))
