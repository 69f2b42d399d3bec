"""The SDK at its edges, found by using it as a user would (session 22): a closed client, a file
that fails while it uploads, Ctrl-C in the blocking client's bulk, a watch resumed at a finished
job's last revision, a request over the gateway's message limit, and arguments given loosely
(priority and state names in any case, a Tensor in an inputs mapping) or wrongly (one job ID where
many are taken, non-string labels, a window of 0). Real gateway, real NATS."""

from __future__ import annotations

import asyncio
import io
import os
import re
import sys
import textwrap
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest

from asyncinfer.client import (
    NO_RETRY,
    AsyncClient,
    AsyncInferClientError,
    Client,
    InvalidArgumentError,
    JobRequest,
    JobState,
    ResourceExhaustedError,
    UnavailableError,
    _retry,
)
from asyncinfer.client._retry import RetryPolicy
from asyncinfer.client.errors import MESSAGE_TOO_LARGE, DeadlineExceededError
from asyncinfer.commands.output import report_error
from asyncinfer.config import Config, TensorSpecConfig
from asyncinfer.embedded_nats import free_port
from asyncinfer.queued_notice import decode_queued_notice
from asyncinfer.tensors import Tensor
from asyncinfer.v1 import job_service_pb2_grpc
from tests.stack import Stack, StartStack

REPO = Path(__file__).resolve().parents[1]
X = np.ones((1, 4), np.float32)


async def test_a_closed_client_says_so_and_the_process_lives(idle_stack: Stack) -> None:
    client = AsyncClient(idle_stack.address)
    await client.close()
    # A batch call made a new stub on the closed channel, which crashed grpcio 1.85 (a segfault).
    for call in (client.get_batch("b"), client.get("j"), client.list_batches()):
        with pytest.raises(RuntimeError, match="the client is closed"):
            await call
    with pytest.raises(RuntimeError, match="the client is closed"):
        client.watch_batch("b")
    with pytest.raises(RuntimeError, match="the client is closed"):  # at `async with`, not at a call in it
        async with client:
            pass
    await client.close()  # idempotent


class FailingFile(io.RawIOBase):
    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        raise OSError("disk on fire")


async def test_an_upload_whose_file_fails_raises_the_files_error(idle_stack: Stack) -> None:
    async with AsyncClient(idle_stack.address) as client:
        with pytest.raises(OSError, match="disk on fire"):  # was a bare CancelledError
            await client.upload(FailingFile())
        with pytest.raises(ValueError, match="chunk_bytes"):
            await client.upload(b"abc", chunk_bytes=0)


async def test_a_watch_resumed_at_a_finished_jobs_last_revision_ends_at_once(stack: Stack) -> None:
    async with AsyncClient(stack.address) as client:
        done = await client.wait(await client.submit("demo", {"x": X}))
        assert done.succeeded
        seen = [job async for job in client.watch(done, after_revision=done.revision, timeout_s=5)]
        assert seen == []  # was UNAVAILABLE after ~1 s of reopening
        with pytest.raises(ValueError, match="after_revision"):
            await anext(client.watch(done, after_revision=-1))


async def test_a_request_over_the_message_limit_is_not_sent_again(idle_stack: Stack) -> None:
    attempts = 0

    class Counting(RetryPolicy):
        def backoff_s(self, attempt: int, error: object) -> float:
            nonlocal attempts
            attempts += 1
            return 0.0

    async with AsyncClient(idle_stack.address, retry=Counting(retry_resource_exhausted=True)) as client:
        limit = idle_stack.config.gateway.max_request_bytes
        with pytest.raises(ResourceExhaustedError) as info:
            await client.submit("demo", {"x": np.ones((limit // 8, 4), np.float32)})
    assert info.value.reason == MESSAGE_TOO_LARGE
    assert "upload" in info.value.message
    assert attempts == 0


async def test_loose_arguments_are_taken_and_wrong_ones_refused_clearly(stack: Stack) -> None:
    async with AsyncClient(stack.address) as client:
        job = await client.submit("demo", {"x": X}, priority="high")
        assert job.priority.value == "HIGH"
        tensor = Tensor.from_numpy("ignored", X)  # its name is the mapping's
        outputs = await client.run("demo", {"x": tensor})
        np.testing.assert_allclose(outputs["y"], 2 * X + 1)
        await client.wait(job)
        listed = [j async for j in client.list(states=["succeeded"], limit=5)]
        assert listed
        assert all(j.state is JobState.SUCCEEDED for j in listed)
        with pytest.raises(ValueError, match="unknown priority 'urgent'"):
            await client.submit("demo", {"x": X}, priority="urgent")
        with pytest.raises(TypeError, match="as a list"):
            await client.get_jobs(job.job_id)
        with pytest.raises(TypeError, match="labels map strings to strings"):
            await client.submit("demo", {"x": X}, labels={"a": 1})  # type: ignore[dict-item]
        with pytest.raises(ValueError, match="window"):
            async for _ in client.bulk([JobRequest("demo", {"x": X})], window=0):
                pass


async def test_inputs_of_another_form_or_swapped_arguments_say_what_to_give(idle_stack: Stack) -> None:
    """A first-day pass (session 31): an array alone, a list of arrays or a torch tensor given as
    `inputs` failed deep in the SDK ("'numpy.ndarray' object has no attribute 'name'"), and the model
    and its inputs swapped failed in protobuf ("bad argument type for built-in operation"). Now a
    TypeError says what to give, the model's inputs by name, and nothing is sent."""
    labels = {"test": "forms"}
    example = "give {'x': array} (model 'demo' takes x: FP32 of shape [-1, 4]; -1: any size)"
    swapped = "model is the model's name (a str), got a dict: the name comes first"
    async with AsyncClient(idle_stack.address) as client:
        for inputs, problem in (
            (X, "inputs maps each input's name to its array, got a numpy.ndarray"),
            ([X], "inputs maps each input's name to its array, got a list"),
            ({0: X}, "inputs maps input names (str) to arrays, got the key 0"),
        ):
            with pytest.raises(TypeError) as raised:
                await client.submit("demo", inputs, labels=labels)  # type: ignore[arg-type]
            assert str(raised.value) == f"{problem}: {example}"
            with pytest.raises(TypeError) as raised:
                async for _ in client.bulk([JobRequest("demo", inputs, labels=labels)]):  # type: ignore[arg-type]
                    pass
            assert str(raised.value) == f"{problem}: {example}"
        with pytest.raises(TypeError, match=r"\(client.models\(\) lists each model's inputs\)$"):
            await client.submit("no-such-model", X, labels=labels)  # type: ignore[arg-type]
        for call in (
            client.submit({"x": X}, "demo", labels=labels),  # type: ignore[arg-type]
            client.run({"x": X}, "demo", labels=labels),  # type: ignore[arg-type]
            anext(client.bulk([JobRequest({"x": X}, "demo", labels=labels)])),  # type: ignore[arg-type]
        ):
            with pytest.raises(TypeError, match=re.escape(swapped)):
                await call
        with pytest.raises(TypeError, match=re.escape("got a list: create_batch(data, model) takes the data first")):
            await client.create_batch("demo", [[1, 2, 3, 4]], labels=labels)  # type: ignore[arg-type]
        assert [job async for job in client.list(labels=labels)] == []
        assert (await client.list_batches()) == ([], "")

    def blocking() -> None:
        with Client(idle_stack.address) as client:
            with pytest.raises(TypeError, match=re.escape(f"got a numpy.ndarray: {example}")):
                client.run("demo", X)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=re.escape(swapped)):
                client.submit({"x": X}, "demo")  # type: ignore[arg-type]

    await asyncio.to_thread(blocking)


async def test_a_refusal_whose_violation_restates_its_message_says_it_once(idle_stack: Stack) -> None:
    """A refused page token or page size: the gateway's message is the violation's description
    (`invalid page_token: not a token from ListBatches`, field page_token), and the SDK's error text
    (a traceback's last line, the console's error box) and the CLI's report said it twice, the second
    time after the field's name: `... not a token from ListBatches` then `page_token: invalid
    page_token: not a token from ListBatches`. The violations themselves are all kept."""
    async with AsyncClient(idle_stack.address) as client:
        for options, said in (
            (
                {"page_token": "garbage"},
                "INVALID_ARGUMENT INVALID_PAGE_TOKEN: invalid page_token: not a token from ListBatches",
            ),
            ({"page_size": 1000}, "INVALID_ARGUMENT: page_size must be between 1 and 100 (0: 20)"),
        ):
            with pytest.raises(InvalidArgumentError) as refused:
                await client.list_batches(**options)
            assert str(refused.value) == said
            (violation,) = refused.value.violations
            assert violation.field == next(iter(options))
            report = io.StringIO()
            report_error(refused.value, report)
            assert report.getvalue() == f"asyncinfer: error: {said}\n"


async def test_options_of_the_wrong_type_say_what_to_give_before_anything_is_sent(idle_stack: Stack) -> None:
    """A first-day pass (session 32): a timeout_s given as a str was "'>=' not supported between
    instances of 'str' and 'int'", a priority given as a number "'int' object has no attribute
    'upper'", a JobRequest's priority in lower case (as submit takes it) "'high' is not a valid
    Priority", queue_ttl_s as a str "can't multiply sequence by non-int of type 'float'", a NaN
    execution_timeout_s "cannot convert float NaN to integer", a max_attempts of 2.5 "'float' object
    cannot be interpreted as an integer", a deadline as a str "'str' object has no attribute
    'tzinfo'", inputs given to run as keywords "JobCalls.submit() got an unexpected keyword argument
    'x'", and one JobRequest given to bulk "'JobRequest' object is not iterable". Now a TypeError or
    ValueError naming the argument and what to give, and nothing is queued."""
    labels = {"test": "options"}
    seconds = "timeout_s is seconds, 0 or more (None: no limit), got "
    priority = "priority is a name, one of HIGH, LOW, NORMAL (any case), got an int 1"
    run_takes = "(run takes timeout_s and submit's options: callback, deadline, execution_timeout_s"
    async with AsyncClient(idle_stack.address) as client:
        for options, error, message in (
            ({"timeout_s": "5"}, TypeError, seconds + "a str '5'"),
            ({"timeout_s": True}, TypeError, seconds + "a bool True"),
            ({"timeout_s": -1}, ValueError, seconds + "-1"),
            ({"timeout_s": float("nan")}, ValueError, seconds + "nan"),
            ({"priority": 1}, TypeError, priority),
            ({"queue_ttl_s": "60"}, TypeError, "queue_ttl_s is seconds (a number), got a str '60'"),
            ({"execution_timeout_s": float("nan")}, ValueError, "execution_timeout_s is seconds (a finite number), got nan"),
            ({"retention_s": float("inf")}, ValueError, "retention_s is seconds (a finite number), got inf"),
            ({"max_attempts": 2.5}, TypeError, "max_attempts is a whole number of attempts (0: the model's default), got a float 2.5"),
            ({"deadline": "2030-01-01T00:00:00Z"}, TypeError, "deadline is a timezone-aware datetime (e.g. datetime.now(UTC)"),
            ({"wait_s": "5"}, TypeError, "wait_s is seconds (a number), got a str '5'"),
        ):  # fmt: skip
            for call in (client.submit, client.run):
                with pytest.raises(error) as raised:
                    await call("demo", {"x": X}, labels=labels, **options)
                assert str(raised.value).startswith(message), str(raised.value)
        for options in ({"priority": 1}, {"queue_ttl_s": "60"}, {"max_attempts": 2.5}):
            with pytest.raises(TypeError):
                async for _ in client.bulk([JobRequest("demo", {"x": X}, labels=labels, **options)]):  # type: ignore[arg-type]
                    pass
        with pytest.raises(TypeError, match=re.escape(seconds + "a str '5'")):
            async for _ in client.bulk([JobRequest("demo", {"x": X}, labels=labels)], timeout_s="5"):  # type: ignore[arg-type]
                pass
        with pytest.raises(TypeError, match=re.escape("pass many requests as a list (e.g. [request])")):
            async for _ in client.bulk(JobRequest("demo", {"x": X}, labels=labels)):  # type: ignore[arg-type]
                pass
        with pytest.raises(TypeError) as raised:
            await client.run("demo", x=X, labels=labels)
        assert str(raised.value).startswith(
            "run() got an unexpected keyword argument 'x': inputs go in a mapping: run(model, {'x': array}) "
            + run_takes
        ), str(raised.value)
        with pytest.raises(TypeError, match=re.escape("argument 'priorty': did you mean 'priority'?")):
            await client.run("demo", {"x": X}, labels=labels, priorty="high")
        assert [job async for job in client.list(labels=labels)] == []

        # A JobRequest's priority is taken in any case, as submit's is.
        [result] = [r async for r in client.bulk([JobRequest("demo", {"x": X}, priority="high", labels=labels)])]
        assert result.job is not None
        assert result.job.priority.value == "HIGH"

    def blocking() -> None:
        with Client(idle_stack.address) as client:
            with pytest.raises(TypeError, match=re.escape(priority)):
                client.submit("demo", {"x": X}, priority=1)  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=re.escape(seconds + "a str '5'")):
                client.run("demo", {"x": X}, timeout_s="5")  # type: ignore[arg-type]
            with pytest.raises(TypeError, match=re.escape("unexpected keyword argument 'x': inputs go in a mapping")):
                client.run("demo", x=X)

    await asyncio.to_thread(blocking)
    async with AsyncClient(idle_stack.address) as client:
        assert len([job async for job in client.list(labels=labels)]) == 1


async def test_values_no_tensor_holds_name_the_input_and_a_torch_tensor_is_its_values(stack: Stack) -> None:
    """A first-day pass (session 31): ragged rows raised numpy's ValueError ("setting an array element
    with a sequence ... inhomogeneous shape"), complex numbers "numpy dtype complex64 has no KServe v2
    datatype" (no input named), and a torch tensor that requires grad (a model's output) or is
    bfloat16 torch's own error. Now the first two are a ValueError naming the input and what the model
    takes, nothing sent, and a torch tensor is sent as its values."""
    import torch

    labels = {"test": "values"}
    takes = "; model 'demo' takes x: FP32 of shape [-1, 4]"
    async with AsyncClient(stack.address) as client:
        for value, problem in (
            ([[1, 2, 3, 4], [5, 6]], "input 'x' is not a rectangular array: its rows are not all the same length"),
            (X.astype(np.complex64), "input 'x' is complex64, which no tensor carries (booleans, integers, floats or text)"),
        ):  # fmt: skip
            with pytest.raises(ValueError, match=f"^{re.escape(problem + takes)}$"):
                await client.submit("demo", {"x": value}, labels=labels)
            with pytest.raises(ValueError, match=f"^{re.escape(problem + takes)}$"):
                async for _ in client.bulk([JobRequest("demo", {"x": value}, labels=labels)]):
                    pass
        assert [job async for job in client.list(labels=labels)] == []

        weights = torch.nn.Parameter(torch.ones(4))
        for tensor in (torch.ones(2, 4) * weights, torch.ones(2, 4, dtype=torch.bfloat16)):
            outputs = await client.run("demo", {"x": tensor})
            np.testing.assert_array_equal(outputs["y"], np.full((2, 4), 3, np.float32))


async def test_values_the_sdk_does_not_convert_are_refused_with_why_and_the_signature(
    config: Config, start_stack: StartStack
) -> None:
    """A first-day pass (session 32): a value the SDK does not convert to the model's datatype was
    refused by the gateway with the dtype numpy gave, which the caller never named: a list holding
    1e300 for an FP32 input "input 'x' must be FP32, got 'FP64'", an integer past 64 bits "must be
    FP32, got 'BYTES'", floats for an INT64 input "must be INT64, got 'FP64'". The refusal (still the
    gateway's, a bulk item's too) now says why the SDK left it and what the model takes."""
    demo = config.models[0]
    ids = demo.model_copy(
        update={"name": "ids", "inputs": (TensorSpecConfig(name="ids", datatype="INT64", shape=(-1, 2)),)}
    )
    stack = await start_stack(config.replace(models=[demo.model_dump(), ids.model_dump()]), batcher=False)
    labels = {"test": "declined"}
    fp32 = "; model 'demo' takes x: FP32 of shape [-1, 4]"
    async with AsyncClient(stack.address) as client:
        for model, inputs, description in (
            ("demo", {"x": [[1e300, 1, 1, 1]]}, "input 'x' must be FP32, got 'FP64': the SDK did not convert it, as it has 1e+300, past FP32's range (±3.4028235e+38)" + fp32),
            ("demo", {"x": [[2**70, 1, 1, 1]]}, "input 'x' must be FP32, got 'BYTES': the SDK did not convert it, as it holds no one numpy type (integers past 64 bits, or items of mixed types)" + fp32),
            ("ids", {"ids": [[1.5, 2.0]]}, "input 'ids' must be INT64, got 'FP64': the SDK did not convert it, as it has 1.5, not a whole number: INT64 takes whole numbers; model 'ids' takes ids: INT64 of shape [-1, 2]"),
        ):  # fmt: skip
            with pytest.raises(InvalidArgumentError) as raised:
                await client.submit(model, inputs, labels=labels)
            assert [v.description for v in raised.value.violations] == [description]
            assert str(raised.value).endswith(description), str(raised.value)
            [result] = [r async for r in client.bulk([JobRequest(model, inputs, labels=labels)])]
            assert result.error is not None
            assert [v.description for v in result.error.violations] == [description]
        # What the SDK converts is sent as the model's datatype, and a refusal of something else
        # is the gateway's alone (the shape here).
        with pytest.raises(InvalidArgumentError) as raised:
            await client.submit("ids", {"ids": [[1, 2, 3]]}, labels=labels)
        assert "did not convert" not in str(raised.value)
        assert [job async for job in client.list(labels=labels)] == []


async def test_booleans_beside_numbers_are_refused_not_sent_as_ones_and_zeros(stack: Stack) -> None:
    """numpy makes [True, 2.5] a float array: submit sent it to the FP32 input as 1.0 and 2.5, and
    create_batch's rows likewise. Now a ValueError naming the input, nothing sent (True and False
    alone are a BOOL tensor, which the gateway refuses for a float input, as before)."""
    labels = {"test": "booleans"}
    takes = "; model 'demo' takes x: FP32 of shape [-1, 4]"
    mixed = "mixes booleans (true/false) with numbers, which would run as 1 and 0"
    async with AsyncClient(stack.address) as client:
        problem = f"input 'x' {mixed}{takes}"
        for value in ([[True, 2.5, 0, 1]], [[1, 2, 3, False]]):
            with pytest.raises(ValueError, match=f"^{re.escape(problem)}$"):
                await client.submit("demo", {"x": value}, labels=labels)
        assert [job async for job in client.list(labels=labels)] == []
        with pytest.raises(ValueError, match=f"^{re.escape('the rows ' + mixed)}$"):
            await client.create_batch([[True, 2.5, 0, 1]], "demo")
        with pytest.raises(ValueError, match=f"^{re.escape('input ' + repr('x') + ' ' + mixed)}$"):
            await client.create_batch({"x": [[1, 2.5, 0, False]]}, "demo")
        outputs = await client.run("demo", {"x": [[1, 0, 2.5, 1]]})  # 0 and 1 as numbers are numbers
        np.testing.assert_array_equal(outputs["y"], [[3, 1, 6, 3]])


async def test_a_missing_input_is_refused_with_what_to_give(idle_stack: Stack) -> None:
    """A first-day pass (session 31): `submit("demo", {})` was refused "inputs: give the model's
    inputs (or an input_ref)", and a wrong name's companion "missing input 'x'", neither naming the
    datatype or shape to give. Refused by the gateway (every client's), nothing queued."""
    labels = {"test": "missing"}
    async with AsyncClient(idle_stack.address) as client:
        for inputs in ({}, None):
            with pytest.raises(InvalidArgumentError) as raised:
                await client.submit("demo", inputs, labels=labels)
            assert [(v.field, v.description) for v in raised.value.violations] == [
                ("inputs", "give the model's inputs (x: FP32 of shape [-1, 4]; -1: any size), or an input_ref")
            ]
        results = [result async for result in client.bulk([JobRequest("demo", {"X": X}, labels=labels)])]
        error = results[0].error
        assert error is not None
        assert [(v.field, v.description) for v in error.violations] == [
            ("inputs[0].name", "unknown input 'X'; the model takes: x"),
            ("inputs", "missing input 'x' (FP32 of shape [-1, 4])"),
        ]
        assert [job async for job in client.list(labels=labels)] == []


async def test_ctrl_c_in_the_blocking_clients_bulk_is_a_keyboard_interrupt() -> None:
    """The blocking client's iterators: the interrupted step was not awaited, so closing the
    generator found it still running (RuntimeError: aclose(): asynchronous generator is already
    running) and that replaced the KeyboardInterrupt; and a SIGINT taken by a thread other than
    the main one was not raised until the main thread's wait ended, never for a bulk (a hang in
    CI). The script's own gateway never answers its SubmitJobs, so the step is always under way
    when the interrupt comes; a hang dumps its threads."""
    script = textwrap.dedent(
        """
        import asyncio, faulthandler, signal, threading
        import grpc
        from asyncinfer.client import Client, JobRequest
        from asyncinfer.v1 import job_service_pb2_grpc

        faulthandler.dump_traceback_later(20, exit=True)
        # As an interactive shell leaves it: a process started in the background of a script
        # (a CI runner) inherits SIGINT ignored, and Python then installs no handler for it.
        signal.signal(signal.SIGINT, signal.default_int_handler)

        class Silent(job_service_pb2_grpc.JobServiceServicer):
            async def ListModels(self, request, context):
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no ListModels")

            async def SubmitJobs(self, requests, context):
                await asyncio.Event().wait()  # never answers
                yield

        loop = asyncio.new_event_loop()
        started = threading.Event()
        port = []

        async def serve():
            server = grpc.aio.server()
            job_service_pb2_grpc.add_JobServiceServicer_to_server(Silent(), server)
            port.append(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            started.set()
            await server.wait_for_termination()

        threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True).start()
        started.wait()
        with Client(f"127.0.0.1:{port[0]}") as client:
            # Ctrl-C as the kernel may deliver it: to a thread other than the main one.
            timer = threading.Timer(0.7, lambda: signal.pthread_kill(threading.get_ident(), signal.SIGINT))
            timer.daemon = True
            timer.start()
            try:
                for _ in client.bulk(JobRequest("demo", {"x": [[1, 2, 3, 4]]}) for _ in range(10)):
                    pass
            except KeyboardInterrupt:
                print("KeyboardInterrupt")
        """
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert out.decode().strip() == "KeyboardInterrupt", err.decode()
    assert "RuntimeError" not in err.decode(), err.decode()


async def test_a_reading_cancelled_by_its_caller_stays_a_cancellation(idle_stack: Stack) -> None:
    """The upload's own error wins over grpc's cancel, but a caller's cancel stays one."""
    async with AsyncClient(idle_stack.address) as client:
        task = asyncio.create_task(client.upload(b"x" * (8 << 20), chunk_bytes=1024))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_one_text_for_a_model_of_one_text_per_item_is_one_item(config: Config, start_stack: StartStack) -> None:
    """`client.run("minilm-l6", {"text": "hello"})` was refused (shape [] for [-1]) while the CLI's
    `-i text=hello` worked."""
    from asyncinfer.config import MINILM_MODEL

    stack = await start_stack(config.replace(models=[MINILM_MODEL.model_dump()]), batcher=False)
    async with AsyncClient(stack.address) as client:
        for text in ("hello", b"hello"):
            job = await client.submit("minilm-l6", {"text": text})
            assert job.state is JobState.QUEUED


async def test_a_gateway_a_few_hundred_ms_away_is_reached_at_the_first_attempt(idle_stack: Stack) -> None:
    """A helper's CLI pass, session 24: grpc.min_reconnect_backoff_ms = 100 is also the time gRPC
    gives a connection attempt, so a gateway 300 ms away (an ocean, a VPN) failed UNAVAILABLE
    ("timed out before receiving SETTINGS frame") at the first attempt, and took seconds of retries."""
    host, port = idle_stack.address.rsplit(":", 1)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await asyncio.sleep(0.3)  # each way
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))

    proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        far = f"127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
        async with AsyncClient(far, retry=NO_RETRY, timeout_s=10) as client:
            assert [m.name for m in await client.models()]
    finally:
        proxy.close()


FORKED_CHILD = """
import os, sys
from asyncinfer.client import Client
client = Client(sys.argv[1])
client.models()
pid = os.fork()
if pid == 0:
    try:
        client.models()
    except RuntimeError as error:
        os._exit(0 if "made in the parent of a forked process" in str(error) else 3)
    os._exit(4)
_, status = os.waitpid(pid, 0)
client.close()
sys.exit(os.waitstatus_to_exitcode(status))
"""


async def test_a_client_used_in_a_forked_child_says_so(idle_stack: Stack) -> None:
    """A helper's SDK pass, session 24: a child forked after the sync Client was used (multiprocessing's
    default on Linux) waited for ever on its first call: the client's loop thread is not copied."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", FORKED_CHILD, idle_stack.address, stderr=asyncio.subprocess.PIPE
    )
    try:
        _, err = await asyncio.wait_for(process.communicate(), 60)
    finally:
        if process.returncode is None:  # the child hung (and its parent with it)
            process.kill()
            await process.wait()
    assert process.returncode == 0, err.decode()[-2000:]


async def test_closing_the_client_ends_another_tasks_watch_with_a_runtime_error(idle_stack: Stack) -> None:
    """A helper's SDK pass, session 24: the watch raised a bare CancelledError in a task nobody had
    cancelled, which TaskGroup and asyncio.run take for a cancel of their own."""
    client = AsyncClient(idle_stack.address)
    job = await client.submit("demo", {"x": np.ones((1, 4), np.float32)})  # no batcher: it stays queued
    seen = asyncio.Event()

    async def watch() -> None:
        async for _ in client.watch(job, timeout_s=60):
            seen.set()

    watching = asyncio.create_task(watch())
    await asyncio.wait_for(seen.wait(), 10)
    await client.close()
    with pytest.raises(RuntimeError, match="the client was closed while this call ran"):
        await asyncio.wait_for(watching, 10)


async def test_a_cancelled_run_or_wait_says_where_the_job_is(idle_stack: Stack) -> None:
    """`await client.run(...)` cancelled (a task's cancel, an asyncio.timeout, Ctrl-C under
    asyncio.run) raised a bare CancelledError while the job went on; the blocking Client's
    KeyboardInterrupt named it. The CancelledError now carries the same note, and stays a
    cancellation."""
    queued: list[str] = []
    job_queued = asyncio.Event()

    async def heard(msg: Any) -> None:
        queued.append(decode_queued_notice(msg.data)[0])
        job_queued.set()

    await idle_stack.nc.subscribe("asyncinfer.queued.>", cb=heard)
    await idle_stack.nc.flush()
    async with AsyncClient(idle_stack.address) as client:
        run = asyncio.create_task(client.run("demo", {"x": X}))  # no batcher: the gateway holds the submit
        await job_queued.wait()
        run.cancel()
        with pytest.raises(asyncio.CancelledError) as cancelled:
            await run
        [note] = cancelled.value.__notes__
        key = note.split("idempotency_key='")[1].split("'")[0]
        found = await client.submit("demo", {"x": X}, idempotency_key=key)
        assert queued == [f"default.{found.job_id}"], "the key finds the cancelled run's job alone"

        job = await client.submit("demo", {"x": X})
        wait = asyncio.create_task(client.wait(job.job_id))
        await asyncio.sleep(0)  # one turn of the loop: the wait has begun (its watch's call is out)
        wait.cancel()
        with pytest.raises(asyncio.CancelledError) as cancelled:
            await wait
        [note] = cancelled.value.__notes__
        assert f"client.wait({job.job_id!r})" in note
        assert (await client.get(job)).state is JobState.QUEUED  # it goes on, and the client still works


def test_a_blocking_client_that_cannot_be_made_leaves_no_thread_running(tmp_path: Path) -> None:
    """Client() starts its loop's thread before it makes the channel; a channel that could not
    be made (a TLS file missing, a certificate without its key) raised, and the thread and its
    loop ran on for ever, one per try (a service retrying its start-up collected them)."""

    def client_threads() -> list[threading.Thread]:
        return [thread for thread in threading.enumerate() if thread.name == "asyncinfer-client"]

    before = client_threads()
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file go together"):
        Client("127.0.0.1:1", tls_cert_file=tmp_path / "client.pem")
    with pytest.raises(FileNotFoundError):
        Client("127.0.0.1:1", tls_ca_file=tmp_path / "missing-ca.pem")
    assert client_threads() == before


# Targets gRPC can never reach: UNAVAILABLE on every call, retried per the client's policy; a port
# past 65535 gRPC wraps (127.0.0.1:99999 dialled port 34463) and port 0 it dials.
UNREACHABLE_TARGETS = {
    "127.0.0.1:5005l": "its port '5005l' is not a number from 1 to 65535",
    "host:99999": "its port '99999' is not a number from 1 to 65535",
    "localhost:0": "its port '0' is not a number from 1 to 65535",
    "localhost:-1": "its port '-1' is not a number from 1 to 65535",
    ":": "it names no host",
    ":50051": "it names no host",
    "": "it names no host",
    "[::1:50051": "its '[' is not closed",
    "[::1]50051": "after ']' comes ':PORT' or nothing",
    "dns:///127.0.0.1:abc": "its port 'abc' is not a number from 1 to 65535",
    "ipv4:127.0.0.1": "an ipv4: or ipv6: address needs its port",
}
# What gRPC reaches, so what the client takes: a host alone is gRPC's default port, 443 (as with
# an empty port); http and https are port names its resolver knows.
REACHABLE_TARGETS = [
    "127.0.0.1:50051", "gateway.example.com:443", "gateway.example.com", "localhost:", "localhost:https",
    "[::1]:50051", "[::1]", "::1", "dns:///gateway:50051", "dns:gateway:50051", "dns:///[::1]:50051",
    "ipv4:127.0.0.1:50051,127.0.0.2:50052", "ipv6:[::1]:50051", "unix:/run/asyncinfer.sock",
    "unix:///run/asyncinfer.sock", "unix-abstract:asyncinfer", "xds:///gateway",
]  # fmt: skip


@pytest.mark.unit
async def test_a_target_grpc_can_never_reach_is_a_value_error_at_the_constructor() -> None:
    """A client made for "127.0.0.1:5005l" (a typo of 50051) was made, and each call failed
    UNAVAILABLE ("Failed to parse port", in gRPC's words) only once the retry policy gave up."""

    def client_threads() -> list[threading.Thread]:
        return [thread for thread in threading.enumerate() if thread.name == "asyncinfer-client"]

    before = client_threads()
    for target, problem in UNREACHABLE_TARGETS.items():
        with pytest.raises(ValueError, match="not a gRPC target") as refused:
            AsyncClient(target)
        assert f"not a gRPC target: {target!r}: {problem}" in str(refused.value)
        with pytest.raises(ValueError, match="not a gRPC target"):
            await asyncio.to_thread(Client, target)
    assert client_threads() == before, "the blocking client refused it before starting its thread"
    for target in REACHABLE_TARGETS:
        await AsyncClient(target).close()


async def test_a_negative_timeout_is_refused_at_the_call_and_zero_always_exceeds(stack: Stack) -> None:
    """A reviewer's pass: `timeout_s=-1` was taken (DeadlineExceededError "within -1 s", or an
    answer), and `timeout_s=0` answered most calls (gRPC sent them: a submit queued its job, a
    watch gave its first state) and exceeded some. Now a negative or NaN one is a ValueError at
    the call, before anything is sent (a watch's too, not at its first step), and 0 is a deadline
    already passed: DeadlineExceededError every time, nothing sent (as a zero timeout is in gRPC
    and httpx)."""
    labels = {"test": "zero-timeout"}
    async with AsyncClient(stack.address) as client:
        done = await client.wait(await client.submit("demo", {"x": X}), timeout_s=60)
        for bad in (-1.0, float("nan")):
            with pytest.raises(ValueError, match="0 or more"):
                client.watch_jobs([done], timeout_s=bad)  # at the call, not at the first step
            with pytest.raises(ValueError, match="0 or more"):
                client.watch_batch("01a24a3a-cd4b-7284-bc8e-00301d897e79", timeout_s=bad)
            for call in (
                client.get(done, timeout_s=bad),
                client.wait(done, timeout_s=bad),
                client.wait_jobs([done], timeout_s=bad),
                client.run("demo", {"x": X}, timeout_s=bad, labels=labels),
                client.submit("demo", {"x": X}, timeout_s=bad, labels=labels),
            ):
                with pytest.raises(ValueError, match="0 or more"):
                    await call
        for _ in range(10):
            for call in (
                client.get(done, timeout_s=0),
                client.wait(done, timeout_s=0),
                client.wait_jobs([done], timeout_s=0),
                client.watch_jobs(labels=labels, timeout_s=0).ready(),
                client.run("demo", {"x": X}, timeout_s=0, labels=labels),
                client.submit("demo", {"x": X}, timeout_s=0, labels=labels),
            ):
                with pytest.raises(DeadlineExceededError, match="within 0 s"):
                    await call
        assert [job async for job in client.list(labels=labels)] == []  # no submit was sent

    def blocking() -> None:
        with Client(stack.address) as client:
            with pytest.raises(ValueError, match="0 or more"):
                client.watch(done, timeout_s=-1)  # at the call, not at the first `next`
            with pytest.raises(DeadlineExceededError, match="within 0 s"):
                client.wait(done, timeout_s=0)

    await asyncio.to_thread(blocking)
    with pytest.raises(ValueError, match="0 or more"):
        AsyncClient(stack.address, timeout_s=-1)
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "asyncinfer", "get", done.job_id, "--timeout", "-1", "--gateway", stack.address,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await asyncio.wait_for(cli.communicate(), 60)
    assert cli.returncode == 2  # argparse's usage error, not a traceback
    assert "give 0 or more seconds" in stderr.decode()


async def test_a_host_name_that_does_not_exist_is_retried_then_raised_with_a_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A program often starts before its gateway's name exists (a headless Service's pod record, a
    compose service's name), so the SDK tries such a name within its RetryPolicy and the call's
    deadline, as a gateway not up yet; the error at the end says what to check. (8b31579 raised it
    at once, as the CLI does: the CLI's side is test_cli_daily's.) Counted in waits between tries,
    not in seconds; a refused address, the same count and no hint, is the control.
    (.invalid never resolves: RFC 2606.)"""
    waits: list[float] = []
    policy = RetryPolicy(
        initial_backoff_s=0.01, max_backoff_s=0.02, on_retry=lambda error, delay_s: waits.append(delay_s)
    )
    hint = "hint: no host has that name: is it spelled right?"
    async with AsyncClient("nosuchhost.invalid:50051", retry=policy, timeout_s=10) as client:
        calls = (
            lambda: client.models(),
            lambda: client.submit("demo", {"x": X}),
            lambda: client.get("j"),
            lambda: anext(client.watch("j")),
        )
        for call in calls:
            waits.clear()
            with pytest.raises(UnavailableError) as raised:
                await call()
            assert "errors resolving nosuchhost.invalid:50051" in str(raised.value)
            assert str(raised.value).endswith(hint), str(raised.value)
            assert len(waits) == policy.max_attempts - 1

    def blocking() -> AsyncInferClientError:
        with Client("nosuchhost.invalid:50051", retry=policy) as client:
            with pytest.raises(UnavailableError) as raised:
                client.run("demo", {"x": X})
            return raised.value

    waits.clear()
    assert str(await asyncio.to_thread(blocking)).endswith(hint)
    assert len(waits) == policy.max_attempts - 1

    waits.clear()
    async with AsyncClient(f"127.0.0.1:{free_port()}", retry=policy, timeout_s=10) as client:
        with pytest.raises(UnavailableError) as raised:
            await client.models()
    assert "Connection refused" in str(raised.value)
    assert "hint" not in str(raised.value)
    assert len(waits) == policy.max_attempts - 1

    # The call's deadline ends the tries before the policy's attempts do, with the same hint, also
    # where the wait before a try overran the deadline (a busy machine; here the SDK's clock jumps
    # past it at the second wait): that was DeadlineExceededError "the call did not complete
    # within 10 s" (a watch's: "the watch of job j ..."), nothing said of the name.
    jumped_s = 0.0
    clock = _retry.time.monotonic

    def stalled(error: AsyncInferClientError, delay_s: float) -> None:
        nonlocal jumped_s
        waits.append(delay_s)
        if len(waits) == 2:
            jumped_s = 3600.0

    monkeypatch.setattr(_retry, "time", SimpleNamespace(monotonic=lambda: clock() + jumped_s))
    patient = replace(policy, max_attempts=10_000, on_retry=stalled)
    async with AsyncClient("nosuchhost.invalid:50051", retry=patient, timeout_s=10) as client:
        for call in (lambda: client.models(), lambda: anext(client.watch("j", timeout_s=10))):
            waits.clear()
            jumped_s = 0.0
            with pytest.raises(UnavailableError) as raised:
                await call()
            assert str(raised.value).endswith(hint), str(raised.value)
            assert len(waits) == 2


async def test_a_deadline_met_on_a_try_after_a_name_dns_did_not_know_keeps_the_hint() -> None:
    """The last try of a name DNS says does not exist may wait on DNS asked again (a slow resolver,
    a pod's search domains) until the call's deadline: that ended DeadlineExceededError "Deadline
    Exceeded", nothing said of the name. A scripted gateway stands in for the resolver: its first
    answer is gRPC's text for such a name, its second never comes."""

    class Resolving(job_service_pb2_grpc.JobServiceServicer):
        def __init__(self) -> None:
            self.asked = 0

        async def GetJob(self, request: Any, context: Any) -> Any:
            self.asked += 1
            if self.asked == 1:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    "errors resolving gateway:50051: [field:hostname lookup error:... Domain name not found]",
                )
            await asyncio.Event().wait()  # never answers

    server = grpc.aio.server()
    servicer = Resolving()
    job_service_pb2_grpc.add_JobServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        policy = RetryPolicy(initial_backoff_s=0.01, max_backoff_s=0.02)
        async with AsyncClient(f"127.0.0.1:{port}", retry=policy, timeout_s=1) as client:
            with pytest.raises(DeadlineExceededError) as raised:
                await client.get("j")
        assert servicer.asked == 2
        assert str(raised.value).endswith("hint: earlier tries: no host has that name: is it spelled right?"), str(
            raised.value
        )
    finally:
        await server.stop(None)
