"""Issue 17: NATS permissions per service, against a real nats-server with authorization on. Each
service connects as its own NKey user (asyncinfer.nats_users) and the whole stack runs: inline and
uploaded inputs, a large result, watches, ListJobs, a cancel, OpsService, a dead letter replayed;
the server logs no permission violation. A user that is none of the services (a batcher pod's
or a tenant's NATS login) is refused every read and write of the jobs bucket, and so is a
connection without credentials; it hears none of the services' replies or records (each service
has its own inbox prefix); the gateway's own user may not take work off the queue. A batcher with
`batcher.claim_check_io` runs as the batcher user, which reaches the objects bucket alone."""

from __future__ import annotations

import asyncio
import io
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import duration_pb2

from asyncinfer.client import AsyncClient
from asyncinfer.config import DEMO_MODEL, FLAKY_MODEL, Config, NatsConfig
from asyncinfer.contract import DRAIN_SUBJECT
from asyncinfer.drain_orders import DrainAction, DrainOrder, encode_order
from asyncinfer.errors import ConfigError, Unavailable
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import Msg
from asyncinfer.nats.connection import connect
from asyncinfer.nats_users import new_user_nkey
from asyncinfer.v1 import ops_service_pb2, ops_service_pb2_grpc
from tests.nats_auth import STRANGER, STRANGER_PASSWORD, PerServiceNats
from tests.stack import StartStack
from tests.test_claim_check import objects_stream_state
from tests.test_webhooks import all_final, submit, until
from tests.webhook_receiver import Receiver, receiver, webhook_config

__all__ = ["receiver"]  # the fixture, used by name
pytestmark = pytest.mark.timeout(120)
FAILING_X = {"x": np.array([[-1, 2, 3, 4]], np.float32)}  # flaky fails a row starting below 0


@pytest.fixture
def users(tmp_path: Path) -> Iterator[PerServiceNats]:
    nats = PerServiceNats(tmp_path / "nats-users")
    nats.start()
    try:
        yield nats
    finally:
        nats.stop()


async def run_file_batch(client: AsyncClient, records: int = 40) -> None:
    """A JSONL batch on demo, to the end: COMPLETED, its output in input order."""
    lines = [json.dumps({"custom_id": f"r{i}", "inputs": {"x": [float(i)] * 4}}) for i in range(records)]
    batch = await client.create_batch(("\n".join(lines) + "\n").encode(), "demo")
    ended = await client.wait_batch(batch, timeout_s=60)
    assert ended.state == "COMPLETED", ended
    out = io.BytesIO()
    await client.download(ended, out)
    assert [json.loads(line)["custom_id"] for line in out.getvalue().splitlines()] == [f"r{i}" for i in range(records)]


def base_config() -> Config:
    return Config().replace(
        gateway={"port": 0, "metrics_port": 0},
        scheduler={"port": 0, "metrics_port": 0, "poll_interval_ms": 50.0, "inline_result_max_bytes": 256},
        batcher={"port": 0, "metrics_port": 0, "scheduler_address": None},
        logging={"level": "warning", "format": "console"},
        models=[DEMO_MODEL, FLAKY_MODEL],
    )


async def test_the_stack_runs_with_one_nats_user_per_service(
    users: PerServiceNats, start_stack: StartStack, receiver: Receiver
) -> None:
    base = webhook_config(base_config())
    stack = await start_stack(
        users.config_of(base, "gateway"), scheduler_config=users.config_of(base, "scheduler"), blob_sweep_interval_s=0.1
    )
    # A signed webhook: the scheduler's delivery streams and bucket, the gateway's status reads.
    hooked = await submit(stack, receiver.url("/done"))
    await receiver.wait_for("/done", 1)
    await until(stack, hooked, all_final(1))
    async with AsyncClient(stack.address) as client:
        small = await client.submit("demo", {"x": np.ones((2, 4), np.float32)})
        ref = await client.upload_inputs({"x": np.ones((32, 4), np.float32)})
        large = await client.submit("demo", input_ref=ref)
        done = await client.wait(small, timeout_s=30)
        assert done.state.name == "SUCCEEDED", done
        big = await client.wait(large, timeout_s=30)
        assert big.state.name == "SUCCEEDED", big
        assert big.result_ref, "a result above inline_result_max_bytes goes to the object store"
        assert (await client.read_result(big))["y"].shape == (32, 4)
        listed = [job.job_id async for job in client.list()]
        assert {small.job_id, large.job_id} <= set(listed)
        poison = await client.wait(await client.submit("flaky", FAILING_X), timeout_s=30)
        assert poison.state.name == "FAILED", poison
        async with grpc.aio.insecure_channel(stack.ops_address) as channel:
            ops = ops_service_pb2_grpc.OpsServiceStub(channel)
            stats = await ops.GetQueueStats(ops_service_pb2.GetQueueStatsRequest())
            assert stats.models
            paused = await ops.PauseQueue(ops_service_pb2.PauseQueueRequest(model_name="demo"))
            assert paused
            queued = await client.submit("demo", {"x": np.ones((1, 4), np.float32)})
            assert (await client.cancel(queued)).state.name in ("CANCELED", "CANCELLING")
            await ops.ResumeQueue(ops_service_pb2.ResumeQueueRequest(model_name="demo"))
            (letter,) = (await ops.ListDeadLetters(ops_service_pb2.ListDeadLettersRequest())).dead_letters
            await ops.GetDeadLetter(ops_service_pb2.GetDeadLetterRequest(sequence=letter.sequence))
            replayed = await ops.ReplayDeadLetters(
                ops_service_pb2.ReplayDeadLettersRequest(sequences=[letter.sequence])
            )
            assert replayed
            # A drain order to every scheduler, and its undrain: the scheduler sends on the drain
            # subject, hears it and answers to its own inbox's prefix.
            timeout = duration_pb2.Duration(seconds=5)
            drained = await ops.Drain(ops_service_pb2.DrainRequest(all=True, timeout=timeout))
            assert [(r.scheduler, r.answered) for r in drained.schedulers] == [(drained.scheduler, True)], drained
            undrained = await ops.Undrain(ops_service_pb2.UndrainRequest(all=True))
            assert [(r.answered, r.was_draining) for r in undrained.schedulers] == [(True, True)], undrained
        again = await client.wait(poison.job_id, timeout_s=30)
        assert again.state.name == "FAILED", again
        # A batch over a file: the batches bucket, its chunk objects and chunk jobs.
        await run_file_batch(client)
        # The scheduler's sweep of expired uploads (it failed on every run, looking a stream up by
        # subject, and expired uploads stayed, counted against their tenant's storage).
        before = await objects_stream_state(stack.nc, stack.config)
        await client.upload_inputs({"x": np.ones((4, 4), np.float32)}, retention_s=0.3)
        assert await objects_stream_state(stack.nc, stack.config) != before
        for _ in range(200):  # the sweep runs every 0.1 s; the upload expires after 0.3 s
            if await objects_stream_state(stack.nc, stack.config) == before:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the expired upload was never swept")
    # A stop ends the scheduler's held pulls with a message to its own inbox: refused, every stop
    # under NATS users waited out the hold (10 s) after a permissions violation.
    await stack.stop()
    assert users.violations() == []


async def test_a_stranger_cannot_touch_the_jobs_bucket(users: PerServiceNats, start_stack: StartStack) -> None:
    base = base_config()
    stack = await start_stack(users.config_of(base, "gateway"), scheduler_config=users.config_of(base, "scheduler"))
    anonymous = Config().replace(nats={"url": users.settings("test")["url"], "connect_timeout_s": 1.0}).nats
    stranger_config = anonymous.model_copy(update={"user": STRANGER, "password": STRANGER_PASSWORD})
    stranger: NatsClient = await connect(stranger_config, name="stranger")
    # Listening where replies and watch deliveries would go if the services shared `_INBOX`, and
    # on the records' own subjects (refused: a subscription violation).
    overheard: list[str] = []

    async def heard(msg: Msg) -> None:
        overheard.append(msg.subject)

    await stranger.subscribe("_INBOX.>", cb=heard)
    await stranger.subscribe("$KV.jobs.>", cb=heard)
    await stranger.flush()
    async with AsyncClient(stack.address) as client:
        job = await client.submit("demo", {"x": np.ones((2, 4), np.float32)})
        await client.wait(job, timeout_s=30)
        listed = [j.job_id async for j in client.list()]
    assert job.job_id in listed
    await stranger.flush()
    assert overheard == [], "the services' replies, deliveries and records reached another user"

    # No credentials at all: refused at connect, as a configuration error (not an outage to wait out).
    with pytest.raises(ConfigError, match="refused this connection's credentials"):
        await connect(anonymous, name="anonymous")

    # An NKey the server does not list: refused as well.
    unknown_seed = users.directory / "unknown.nk"
    unknown_seed.write_text(new_user_nkey()[0])
    with pytest.raises(ConfigError, match="refused this connection's credentials"):
        await connect(anonymous.model_copy(update={"nkey_seed_file": str(unknown_seed)}), name="unknown")

    try:
        js = stranger.jetstream(timeout=2.0)
        key = f"default.{job.job_id}"
        # Reads: the bucket's stream info, a direct get, a watch of its subjects.
        for read in (
            lambda: js.stream_info(f"KV_{base.nats.jobs_bucket}"),
            lambda: stranger.request(f"$JS.API.DIRECT.GET.KV_jobs.$KV.jobs.{key}", b"", timeout=2.0),
        ):
            with pytest.raises(Exception):  # noqa: B017,PT011 - a permission error or a timeout, per API
                await read()
        # Writes: a forged record published straight to its subject.
        with pytest.raises(Exception):  # noqa: B017,PT011
            await js.publish(f"$KV.jobs.{key}", b"forged", timeout=2.0)
    finally:
        await stranger.close()
    violations = users.violations()
    assert any("STREAM.INFO.KV_jobs" in line for line in violations), violations
    assert any("DIRECT.GET.KV_jobs" in line for line in violations), violations
    assert any('"$KV.jobs.' in line for line in violations), violations
    assert any("Subscription Violation" in line and "$KV.jobs.>" in line for line in violations), violations


async def test_a_password_in_the_nats_url_logs_in_and_no_error_shows_it(users: PerServiceNats) -> None:
    """nats-py logs in with a URL's user:password@ (or token@); the errors of a failed connect,
    which reach the service's log and its stderr, showed that URL whole, the password with it."""
    server = users.settings("test")["url"]
    assert isinstance(server, str)
    host = server.removeprefix("nats://")
    wrong, right = "wrong-" + STRANGER_PASSWORD, STRANGER_PASSWORD

    def login(password: str, at: str = host) -> NatsConfig:
        url = f"nats://{STRANGER}:{password}@{at}"
        return Config().replace(nats={"url": url, "connect_timeout_s": 1.0}).nats

    stranger = await connect(login(right), name="stranger")  # the URL's credentials are used
    await stranger.close()
    with pytest.raises(ConfigError, match="refused this connection's credentials") as refused:
        await connect(login(wrong), name="stranger")
    assert wrong not in refused.value.message
    assert STRANGER not in refused.value.message
    assert f"NATS at nats://***@{host} " in refused.value.message
    assert "user:password@ or token@ in nats.url" in refused.value.message
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        # first_connect_wait_s 0: it gives up after 3 tries, not the default's 60 s.
        away_settings = login(right, f"127.0.0.1:{port}").model_copy(update={"first_connect_wait_s": 0.0})
        with pytest.raises(Unavailable, match="cannot connect to NATS at") as away:
            await connect(away_settings, name="stranger")
    assert right not in away.value.message
    assert f"nats://***@127.0.0.1:{port}:" in away.value.message


@pytest.mark.parametrize("mistake", ["inbox-prefix-left-out", "another-services-seed"])
@pytest.mark.parametrize("service", ["gateway", "scheduler"])
async def test_a_service_whose_user_may_not_read_its_replies_is_told_so_at_once(
    users: PerServiceNats, service: str, mistake: str
) -> None:
    """`asyncinfer nats-users` prints two settings per service; with the inbox prefix left out (or
    another service's seed), the user may not subscribe to the service's reply subjects. Such a
    service connected, waited 30 s for JetStream's answers and exited 69, "cannot declare the WORK
    stream: JetStream did not answer for 30 s (TimeoutError()); is JetStream on (nats-server -js),
    and has the cluster a leader?": an outage to wait out, an orchestrator's restart loop."""
    from services.gateway.app import GatewayApp
    from services.scheduler.app import SchedulerApp

    settings = users.settings(service)
    if mistake == "inbox-prefix-left-out":
        del settings["inbox_prefix"]
        inbox = "_INBOX"
    else:
        other = "scheduler" if service == "gateway" else "gateway"
        settings["nkey_seed_file"] = str(users.seed_files[other])
        inbox = f"_INBOX_{service}"
    config = base_config().replace(nats=settings)
    app = GatewayApp(config) if service == "gateway" else SchedulerApp(config)
    try:
        with pytest.raises(ConfigError, match=rf"subscribe to its replies' subject {inbox}\.>") as refused:
            await app.start()
    finally:
        await app.stop(grace_s=0)
    assert "ASYNCINFER_NATS__INBOX_PREFIX" in refused.value.message
    assert f"{service}: _INBOX_{service}" in refused.value.message


async def test_the_gateway_user_may_not_take_work(users: PerServiceNats, start_stack: StartStack) -> None:
    base = base_config()
    await start_stack(
        users.config_of(base, "gateway"), scheduler_config=users.config_of(base, "scheduler"), batcher=False
    )
    gateway = await connect(Config().replace(nats=users.settings("gateway")).nats, name="gateway-as-thief")
    try:
        with pytest.raises(Exception):  # noqa: B017,PT011
            await gateway.request("$JS.API.CONSUMER.MSG.NEXT.WORK.work-demo-normal", b'{"batch": 1}', timeout=2.0)
        # Nor drain the schedulers (a tenant-facing service's credentials stop no dispatching).
        await gateway.publish(DRAIN_SUBJECT, encode_order(DrainOrder(action=DrainAction.DRAIN)))
        await gateway.flush()
    finally:
        await gateway.close()
    assert any("CONSUMER.MSG.NEXT.WORK" in line for line in users.violations())
    assert "Publish Violation" in await users.violation(f'"{DRAIN_SUBJECT}"')


async def test_a_batcher_that_moves_claim_checks_runs_as_its_own_user_on_the_objects_bucket_alone(
    users: PerServiceNats, start_stack: StartStack
) -> None:
    base = base_config()
    stack = await start_stack(
        users.config_of(base, "gateway"),
        scheduler_config=users.config_of(base, "scheduler"),
        batcher_config=users.config_of(base.replace(batcher={"claim_check_io": True}), "batcher"),
    )
    async with AsyncClient(stack.address) as client:
        # An uploaded input read by the batcher, its large result stored by it (the attempt's object).
        ref = await client.upload_inputs({"x": np.ones((32, 4), np.float32)})
        big = await client.wait(await client.submit("demo", input_ref=ref), timeout_s=30)
        assert big.state.name == "SUCCEEDED", big
        assert big.result_ref is not None
        assert big.result_ref.ref == f"out/{big.job_id}.1", "the batcher stored it"
        assert (await client.read_result(big))["y"].shape == (32, 4)
        # A file batch: its chunks' rows read by the batcher.
        await run_file_batch(client)
    assert users.violations() == []

    # The batcher's user reaches nothing but the objects bucket: no record, no work, no stream info.
    batcher = await connect(Config().replace(nats=users.settings("batcher")).nats, name="batcher-as-thief")
    try:
        for subject, payload in (
            (f"$JS.API.DIRECT.GET.KV_jobs.$KV.jobs.default.{big.job_id}", b""),
            ("$JS.API.CONSUMER.MSG.NEXT.WORK.work-demo-normal", b'{"batch": 1}'),
            ("$JS.API.STREAM.INFO.OBJ_objects", b""),
        ):
            with pytest.raises(Exception):  # noqa: B017,PT011 - a permission error or a timeout, per API
                await batcher.request(subject, payload, timeout=2.0)
        # A forged record: the server drops it and logs the violation (asserted below).
        await batcher.publish(f"$KV.jobs.default.{big.job_id}", b"forged")
        await batcher.flush(timeout=2)
    finally:
        await batcher.close()
    for refused in ("DIRECT.GET.KV_jobs", "CONSUMER.MSG.NEXT.WORK", "STREAM.INFO.OBJ_objects", '"$KV.jobs.'):
        await users.violation(refused)  # TimeoutError when the server never logged it


async def test_the_batcher_settings_nats_users_prints_open_its_nats_connection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`asyncinfer nats-users --batcher DIR` made the batcher's seed and printed its seed file and
    inbox prefix, but a batcher opens NATS only with batcher.claim_check_io, off by default: given
    those two settings alone, it never used them (its bytes still went through the scheduler)."""
    from asyncinfer.cli import main
    from asyncinfer.config import load_config
    from asyncinfer.embedded_nats import NatsServerProcess

    seeds = tmp_path / "seeds"
    assert main(["nats-users", "--batcher", str(seeds)]) == 0
    printed = capsys.readouterr().out
    (line,) = [line for line in printed.splitlines() if line.startswith("#   batcher: ")]
    conf = tmp_path / "nats.conf"
    conf.write_text(printed)
    server = NatsServerProcess(
        store_dir=tmp_path / "store", log_file=tmp_path / "nats.log", extra_args=("-c", str(conf))
    )
    server.start()
    try:
        for setting in line.removeprefix("#   batcher: ").split():
            name, _, value = setting.partition("=")
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("ASYNCINFER_NATS__URL", server.url)
        config = load_config(None)
        assert config.batcher.claim_check_io, line
        nc = await connect(config.nats, name="batcher")  # as the batcher user, its replies its own
        await nc.close()
    finally:
        server.stop()


async def test_the_nats_users_command_writes_seeds_and_a_block_a_server_runs_the_stack_with(
    tmp_path: Path, start_stack: StartStack, capsys: pytest.CaptureFixture[str]
) -> None:
    """`asyncinfer nats-users DIR`: an operator outside Kubernetes had to write Python for this."""
    from asyncinfer.cli import main
    from asyncinfer.embedded_nats import NatsServerProcess
    from asyncinfer.nats_users import INBOX_PREFIXES

    seeds = tmp_path / "seeds"
    assert main(["nats-users", str(seeds)]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in seeds.iterdir()) == ["gateway.nk", "scheduler.nk"]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in seeds.iterdir())
    assert f"INBOX_PREFIX={INBOX_PREFIXES['scheduler']}" in printed
    conf = tmp_path / "nats.conf"
    conf.write_text(printed)  # its comments are nats-server's too
    log = tmp_path / "nats.log"
    server = NatsServerProcess(store_dir=tmp_path / "store", log_file=log, extra_args=("-c", str(conf)))
    server.start()
    try:

        def of(service: str) -> Config:
            settings = {"nkey_seed_file": str(seeds / f"{service}.nk"), "inbox_prefix": INBOX_PREFIXES[service]}
            return base_config().replace(nats={"url": server.url, **settings})

        stack = await start_stack(of("gateway"), scheduler_config=of("scheduler"))
        async with AsyncClient(stack.address) as client:
            done = await client.wait(await client.submit("demo", {"x": np.ones((2, 4), np.float32)}), timeout_s=30)
        assert done.state.name == "SUCCEEDED", done
        assert [line for line in log.read_text().splitlines() if "Violation" in line] == []
    finally:
        server.stop()
    capsys.readouterr()  # the stack's own lines
    assert main(["nats-users", str(seeds)]) == 0
    assert capsys.readouterr().out == printed, "run again, it keeps the seeds: the same users"


async def test_a_users_name_password_and_subjects_are_quoted_as_nats_server_reads_them(tmp_path: Path) -> None:
    r"""NatsUser.as_config quoted its values as JSON: a character beyond ASCII (a user named José, a
    tenant's subject) was written \uXXXX, which nats-server refuses ("Invalid escape character
    'u'"), and the whole configuration with it. Here a user whose name, password and subjects hold
    such characters, quotes, backslashes, a tab and a `#`: the file passes `nats-server -t`, a server
    runs with it, the user logs in and uses its subject (refused, its messages would not come back)."""
    import subprocess

    from asyncinfer.embedded_nats import NatsServerProcess, find_nats_server
    from asyncinfer.nats_users import NatsUser, Permissions, authorization_block

    name, password, subject = 'José "ops" \\ 日本', 'pä"ss\\wörd\t#1', "tenant.josé.日本"
    user = NatsUser(
        user=name, password=password, permissions=Permissions(publish=(subject,), subscribe=("_INBOX.>", subject))
    )
    conf = tmp_path / "nats.conf"
    conf.write_text(authorization_block({"josé": user}), encoding="utf-8")
    checked = await asyncio.to_thread(
        subprocess.run,
        [find_nats_server(), "-t", "-c", str(conf)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert checked.returncode == 0, checked.stderr or checked.stdout
    server = NatsServerProcess(
        store_dir=tmp_path / "store", log_file=tmp_path / "nats.log", extra_args=("-c", str(conf))
    )
    server.start()
    try:
        anonymous = Config().replace(nats={"url": server.url, "connect_timeout_s": 1.0}).nats
        nc = await connect(anonymous.model_copy(update={"user": name, "password": password}), name="josé")
        try:
            heard: asyncio.Queue[Msg] = asyncio.Queue()
            await nc.subscribe(subject, cb=heard.put)
            await nc.publish(subject, b"hello")
            assert (await asyncio.wait_for(heard.get(), 5.0)).data == b"hello"
        finally:
            await nc.close()
        with pytest.raises(ConfigError, match="refused this connection's credentials"):
            await connect(anonymous.model_copy(update={"user": name, "password": "pässword"}), name="josé")
    finally:
        server.stop()
