"""`dlq list|show|replay|purge`, `queue pause|resume|drain|undrain` and `stats`: the scheduler's
OpsService, for operators.

The OpsService has no SDK: this module calls the generated stub and turns its messages into
plain dicts (the JSON output) at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import msgspec
from grpc import aio

from asyncinfer.access import bearer_metadata
from asyncinfer.client import AsyncInferClientError, RetryPolicy
from asyncinfer.client._addresses import most_telling
from asyncinfer.client._retry import Deadline
from asyncinfer.client.errors import code_and_reason, from_rpc_error
from asyncinfer.codecs.envelope import decode_envelope
from asyncinfer.commands.inputs import text_argument
from asyncinfer.commands.options import Options, nothing_listens, say_retrying, sendable_key
from asyncinfer.commands.output import (
    EXIT_OK,
    EXIT_UNAVAILABLE,
    UsageError,
    attempts_counted_text,
    console,
    local_time,
    print_json,
    print_table,
    rich_table,
    table,
)
from asyncinfer.commands.stdin import read_stdin
from asyncinfer.drain_orders import ANSWER_MARGIN_S
from asyncinfer.duration_text import duration_text
from asyncinfer.v1 import error_pb2, job_pb2, ops_service_pb2, ops_service_pb2_grpc

# What a scheduler that wants a key is told without one.
NO_OPS_KEY = (
    "dlq, queue and stats send --ops-key (env ASYNCINFER_OPS_KEY), a key of role ops; "
    "--api-key is a tenant's key for the gateway and is never sent to the scheduler"
)

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.live import Live

AddOptions = Callable[[argparse.ArgumentParser], None]
T = TypeVar("T")


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser], add_options: AddOptions) -> None:
    dlq = commands.add_parser("dlq", help="dead letters: list, show, replay, purge (on the scheduler)")
    actions = dlq.add_subparsers(dest="dlq_action", required=True)
    listing = actions.add_parser("list", help="dead letters, oldest first")
    listing.add_argument("--model", default="", type=text_argument, help="only this model's")
    listing.add_argument("--limit", type=int, default=100, help="at most this many (default 100; 0: all)")
    add_options(listing)
    listing.set_defaults(handler=dlq_list)
    show = actions.add_parser("show", help="one dead letter")
    show.add_argument("sequence", type=int)
    add_options(show)
    show.set_defaults(handler=dlq_show)
    for name, verb in (("replay", "re-queue as new attempts of the same jobs"), ("purge", "delete")):
        sub = actions.add_parser(name, help=f"{verb}: the SEQUENCEs given, or --all (of --model)")
        sub.add_argument("sequences", nargs="*", type=int, metavar="SEQUENCE")
        sub.add_argument("--all", action="store_true", help="every dead letter (of --model, when given)")
        sub.add_argument("--model", default="", type=text_argument, help="with --all: only this model's")
        if name == "purge":
            sub.add_argument(
                "-y", "--yes", action="store_true", help="with --all: do not ask first (needed without a terminal)"
            )
        add_options(sub)
        sub.set_defaults(handler=dlq_replay if name == "replay" else dlq_purge)

    queue = commands.add_parser("queue", help="pause or resume a model's queue, or drain and undrain the scheduler")
    queue_actions = queue.add_subparsers(dest="queue_action", required=True)
    for name, verb in (("pause", "stop dispatching (jobs stay queued, reason PAUSED)"), ("resume", "dispatch again")):
        sub = queue_actions.add_parser(name, help=f"{verb}: MODEL's queue")
        sub.add_argument("model", type=text_argument)
        add_options(sub)
        sub.set_defaults(handler=queue_pause if name == "pause" else queue_resume)
    drain = queue_actions.add_parser(
        "drain",
        help="stop the scheduler reached (or --all, or --instance NAME) dispatching (until undrain) and wait "
        "(bounded) for jobs in flight",
    )
    drain.add_argument("--wait", type=float, default=30.0, help="seconds to wait for jobs in flight (default 30)")
    _add_addressed(drain, "drains")
    add_options(drain)
    drain.set_defaults(handler=queue_drain)
    undrain = queue_actions.add_parser(
        "undrain", help="end a drain: the scheduler reached (or --all, or --instance NAME) dispatches again"
    )
    _add_addressed(undrain, "undrains")
    add_options(undrain)
    undrain.set_defaults(handler=queue_undrain)

    stats = commands.add_parser(
        "stats",
        help="a live table of the queues (GetQueueStats: every scheduler's counts together)",
        # The columns were named nowhere: WANTED and CREDITS in particular (a first-hour pass, session 38).
        description=STATS_COLUMNS,
    )
    stats.add_argument("--model", default="", type=text_argument, help="only this model")
    stats.add_argument("--once", action="store_true", help="print once and exit")
    stats.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    add_options(stats)
    stats.set_defaults(handler=stats_command)


# A scheduler tried again (_ops_call) is connected to soon after it listens, as the SDK's channels
# are: grpc's first reconnect backoff is a whole second, in which every try failed at once.
RECONNECT_SOON = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 2000))


async def _ops_call(
    options: Options,
    call: Callable[[ops_service_pb2_grpc.OpsServiceAsyncStub, float], Awaitable[T]],
    say_retrying_as: Callable[[AsyncInferClientError, float], None] | None = None,
) -> T:
    """One OpsService call on a fresh channel; a failure raises the SDK's typed error.
    `say_retrying_as`: how a retry is said (stats' live screen says it in its title); else a line
    on stderr, once."""
    credentials = options.credentials()
    # The ops key alone: a key has one role, so --api-key (a tenant's, for the gateway) could only be
    # refused here, and it is not handed to a service that never takes it (NO_OPS_KEY says so).
    key = sendable_key(options.ops_key, "ASYNCINFER_OPS_KEY")
    interceptors: Any = [_WithKey(key)] if key else None
    channel = (
        aio.secure_channel(options.scheduler_target, credentials, RECONNECT_SOON, interceptors=interceptors)
        if credentials is not None
        else aio.insecure_channel(options.scheduler_target, RECONNECT_SOON, interceptors=interceptors)
    )
    async with channel:
        stub: ops_service_pb2_grpc.OpsServiceAsyncStub = ops_service_pb2_grpc.OpsServiceStub(channel)
        # A scheduler that does not listen (starting, or down) is tried again for a few seconds,
        # saying so once, as the gateway's commands do (the SDK's policy): `dlq list` failed at
        # once where `models` waited out a stack still starting. Only a refused connection: nothing
        # was sent, so a purge or a replay is as safe to try again as a read.
        retry = RetryPolicy()
        say = say_retrying_as or say_retrying(options.scheduler)
        deadline = Deadline(options.call_timeout_s)
        attempt = 0
        while True:
            attempt += 1
            try:
                return await call(stub, deadline.remaining() or 0.0)
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
                delay_s = retry.backoff_s(attempt, error)
                if nothing_listens(error) and attempt < retry.max_attempts and deadline.allows_sleep(delay_s):
                    say(error, delay_s)
                    await asyncio.sleep(delay_s)
                    continue
                # A refusal on one of the address's several addresses: what another met, if it says more.
                error = await most_telling(error, options.scheduler_target, credentials, (), options.timeout_s)
                if key is None and error.code == grpc.StatusCode.UNAUTHENTICATED:
                    error.message = f"{error.message}; {NO_OPS_KEY}"
                raise error from rpc_error


class _WithKey(aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    """Adds the ops key to every call (every OpsService method is unary)."""

    def __init__(self, key: str) -> None:
        self._metadata = bearer_metadata(key)

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        metadata = (*tuple(client_call_details.metadata or ()), *self._metadata)
        return await continuation(client_call_details._replace(metadata=aio.Metadata(*metadata)), request)


def _seconds(duration: Any) -> float:
    return float(duration.seconds + duration.nanos / 1e9)


def _error(status: error_pb2.ErrorStatus) -> dict[str, Any]:
    code = next((c.name for c in grpc.StatusCode if c.value[0] == status.code), str(status.code))
    return {
        "code": code,
        "reason": status.reason,
        "message": status.message,
        "violations": [{"field": v.field, "description": v.description} for v in status.field_violations],
    }


def dead_letter_json(letter: ops_service_pb2.DeadLetter) -> dict[str, Any]:
    data: dict[str, Any] = {
        "sequence": letter.sequence,
        "job_id": letter.job_id,
        "tenant": letter.tenant,
        "model_name": letter.model_name,
        "reason": letter.reason,
        "attempts": letter.attempts,
        "given_back_attempts": letter.given_back_attempts,
        "allowed_attempts": letter.allowed_attempts,
        "last_error": _error(letter.last_error) if letter.HasField("last_error") else None,
        "dead_time": letter.dead_time.ToDatetime(UTC).isoformat(timespec="milliseconds")
        if letter.HasField("dead_time")
        else None,
    }
    if letter.original_request:
        data["original_request"] = original_request_json(letter.original_request)
    return data


def original_request_json(original: bytes) -> dict[str, Any]:
    """The dead letter's work message as what was asked: model, priority, the inputs' names,
    datatypes and shapes (not their values), or where they are when they were stored apart."""
    try:
        envelope = decode_envelope(original)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return {"undecodable_bytes": len(original)}
    request: dict[str, Any] = {"model": envelope.model_name}
    if envelope.model_version:
        request["model_version"] = envelope.model_version
    request["priority"] = envelope.priority.value
    request["max_attempts"] = envelope.max_attempts
    if envelope.deadline is not None:
        request["deadline"] = datetime.fromtimestamp(envelope.deadline, UTC).isoformat()
    if envelope.execution_timeout_s is not None:
        request["execution_timeout_s"] = envelope.execution_timeout_s
    if envelope.labels:
        request["labels"] = dict(envelope.labels)
    request["inputs"] = [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in envelope.inputs]
    if envelope.input_ref is not None:
        request["inputs_stored_apart"] = {"ref": envelope.input_ref.ref, "bytes": envelope.input_ref.size_bytes}
    return request


def attempts_text(letter: dict[str, Any]) -> str:
    """The attempts that counted of those it could spend, and those given back (shed, put back)
    apart, as a job's attempt reads: "2 of 2 (4 given back)"; "6" from a letter an older scheduler
    wrote (its count included those given back, and it kept no limit)."""
    return attempts_counted_text(letter["attempts"], letter["allowed_attempts"], letter["given_back_attempts"])


DEAD_LETTER_COLUMNS = ["SEQ", "JOB_ID", "MODEL", "TENANT", "REASON", "ATTEMPTS", "DEAD", "LAST ERROR"]


def dead_letter_row(letter: dict[str, Any]) -> list[str]:
    """`dlq list`'s row of a letter (DEAD_LETTER_COLUMNS)."""
    error = letter["last_error"]
    return [
        str(letter["sequence"]),
        letter["job_id"],
        letter["model_name"],
        letter["tenant"],
        letter["reason"],
        attempts_text(letter),
        _dead_time(letter),
        f"{error['reason']}: {error['message']}" if error else "",
    ]


def _dead_time(letter: dict[str, Any]) -> str:
    """When the letter's job died, as the CLI's text shows a time (its JSON: ISO 8601 in UTC)."""
    return local_time(datetime.fromisoformat(letter["dead_time"])) if letter["dead_time"] else "-"


def dead_letter_text(letter: dict[str, Any]) -> str:
    """`dlq show` for a person: aligned lines, the error in words, the request as indented JSON."""
    lines = [
        f"sequence    {letter['sequence']}",
        f"job         {letter['job_id']}",
        f"tenant      {letter['tenant']}",
        f"model       {letter['model_name']}",
        f"reason      {letter['reason']}",
        f"attempts    {attempts_text(letter)}",
        f"dead        {_dead_time(letter)}",
    ]
    error = letter["last_error"]
    if error is not None:
        lines.append(f"last error  {code_and_reason(error['code'], error['reason'])}: {error['message']}")
        lines += [f"              {v['field']}: {v['description']}" for v in error["violations"]]
    if "original_request" in letter:
        body = _request_json_lines(letter["original_request"])
        lines += ["request     " + body[0], *(" " * 12 + line for line in body[1:])]
    return "\n".join(lines)


def _request_json_lines(request: dict[str, Any]) -> list[str]:
    """The request as indented JSON, one input to a line."""

    def dumps(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False)

    fields: list[str] = []
    for key, value in request.items():
        if key == "inputs" and value:
            items = ",\n".join(f"    {dumps(item)}" for item in value)
            fields.append(f'  "inputs": [\n{items}\n  ]')
        else:
            fields.append(f"  {dumps(key)}: {dumps(value)}")
    return ["{", *",\n".join(fields).split("\n"), "}"]


# -- dlq ----------------------------------------------------------------------------------------


async def dlq_list(args: argparse.Namespace, options: Options) -> int:
    if args.limit < 0:
        raise UsageError("--limit must be 0 (all) or more")
    letters: list[dict[str, Any]] = []
    token = ""
    total: int | None = None  # every page's answer says it (None from an older scheduler)
    while True:
        request = ops_service_pb2.ListDeadLettersRequest(
            model_name=args.model, page_size=min(args.limit or 500, 500), page_token=token
        )
        page = await _ops_call(options, lambda stub, t: stub.ListDeadLetters(request, timeout=t))  # noqa: B023
        letters += [dead_letter_json(letter) for letter in page.dead_letters]
        token = page.next_page_token
        total = page.total if page.HasField("total") else None
        if not token or (args.limit and len(letters) >= args.limit):
            break
    more = bool(token) or (args.limit and len(letters) > args.limit)
    if args.limit:
        letters = letters[: args.limit]
    if options.json:
        for letter in letters:
            print_json(letter)
    elif not letters:
        print(f"no dead letters of model {args.model}" if args.model else "no dead letters", flush=True)
    else:
        print_table(DEAD_LETTER_COLUMNS, [dead_letter_row(letter) for letter in letters])
    if more:  # said beside the list, not in it (a script reads stdout), as `list` does
        in_all = f"{total} dead letters in all; " if total is not None else "more dead letters than these; "
        oldest = "this is the oldest" if len(letters) == 1 else f"these are the oldest {len(letters)}"
        print(
            f"asyncinfer: {in_all}{oldest}; --limit N shows more, --limit 0 all",
            file=sys.stderr,
        )
    return EXIT_OK


async def dlq_show(args: argparse.Namespace, options: Options) -> int:
    request = ops_service_pb2.GetDeadLetterRequest(sequence=args.sequence)
    response = await _ops_call(options, lambda stub, t: stub.GetDeadLetter(request, timeout=t))
    letter = dead_letter_json(response.dead_letter)
    if options.json:
        print_json(letter)
    else:
        print(dead_letter_text(letter), flush=True)
    return EXIT_OK


def _selection(args: argparse.Namespace) -> tuple[list[int], bool, str]:
    if args.all == bool(args.sequences):
        raise UsageError("give dead-letter SEQUENCEs or --all (not both)")
    if args.model and not args.all:
        raise UsageError("--model selects with --all only")
    return list(args.sequences), bool(args.all), str(args.model)


async def dlq_replay(args: argparse.Namespace, options: Options) -> int:
    sequences, every, model = _selection(args)
    request = ops_service_pb2.ReplayDeadLettersRequest(sequences=sequences, all=every, model_name=model)
    response = await _ops_call(options, lambda stub, t: stub.ReplayDeadLetters(request, timeout=t))
    if options.json:
        print_json(
            {
                "replayed": response.replayed,
                "job_ids": list(response.job_ids),
                "skipped": response.skipped,
                "remaining": response.remaining,
            }
        )
    else:
        skipped = f", {response.skipped} skipped" if response.skipped else ""
        print(f"replayed {response.replayed} dead letter(s){skipped}; {response.remaining} left", flush=True)
    return EXIT_OK


async def _confirmed_purge_all(model: str) -> bool:
    """Asks on the terminal before every dead letter (of a model) is deleted; without a terminal a
    usage error: a script says --yes."""
    what = f"every dead letter of {model}" if model else "every dead letter"
    if not sys.stdin.isatty():
        raise UsageError(f"dlq purge --all deletes {what} and there is no terminal to ask on: add --yes")
    sys.stderr.write(f"delete {what}? This cannot be undone. [y/N] ")
    sys.stderr.flush()
    return (await read_stdin(sys.stdin.readline)).strip().lower() in ("y", "yes")


async def dlq_purge(args: argparse.Namespace, options: Options) -> int:
    sequences, every, model = _selection(args)
    if every and not args.yes and not await _confirmed_purge_all(model):
        print("nothing purged", flush=True)
        return EXIT_OK
    request = ops_service_pb2.PurgeDeadLettersRequest(sequences=sequences, all=every, model_name=model)
    response = await _ops_call(options, lambda stub, t: stub.PurgeDeadLetters(request, timeout=t))
    if options.json:
        print_json({"purged": response.purged, "remaining": response.remaining})
    else:
        print(f"purged {response.purged} dead letter(s); {response.remaining} left", flush=True)
    return EXIT_OK


# -- queue --------------------------------------------------------------------------------------


async def queue_pause(args: argparse.Namespace, options: Options) -> int:
    request = ops_service_pb2.PauseQueueRequest(model_name=args.model)
    response = await _ops_call(options, lambda stub, t: stub.PauseQueue(request, timeout=t))
    return _print_queue_state(args.model, response.paused, response.state, response.queued, options)


async def queue_resume(args: argparse.Namespace, options: Options) -> int:
    request = ops_service_pb2.ResumeQueueRequest(model_name=args.model)
    response = await _ops_call(options, lambda stub, t: stub.ResumeQueue(request, timeout=t))
    return _print_queue_state(args.model, response.paused, response.state, response.queued, options)


def queue_state_name(state: int) -> str:
    """The queue state's name, as the CLI and the console (services.console.backend) show it; one
    newer than the reader (a scheduler upgraded first: the protos add values) as its number:
    QueueState.Name raised ValueError, which in the console ended the queue sampler and with it
    the console's process."""
    if state == ops_service_pb2.QUEUE_STATE_UNSPECIFIED:
        return "unknown"
    try:
        name: str = ops_service_pb2.QueueState.Name(state)  # type: ignore[arg-type]
    except ValueError:
        return f"state {state}"
    return name.removeprefix("QUEUE_STATE_").lower()


def _print_queue_state(model: str, paused: bool, state: int, queued: int, options: Options) -> int:
    name = queue_state_name(state)
    if options.json:
        print_json({"model_name": model, "paused": paused, "state": name, "queued": queued})
    else:
        print(f"{model}: {name}, {queued} queued", flush=True)
    return EXIT_OK


def _add_addressed(parser: argparse.ArgumentParser, verb: str) -> None:
    """--all and --instance NAME: behind a Service (Kubernetes runs 2 schedulers) the call reaches
    one scheduler, which sends the order to the others through NATS."""
    addressed = parser.add_mutually_exclusive_group()
    addressed.add_argument("--all", action="store_true", help=f"every scheduler {verb}, whichever one is reached")
    # Not --scheduler: that is the client option of the scheduler's address.
    addressed.add_argument(
        "--instance",
        default="",
        type=text_argument,
        metavar="NAME",
        help=f"only the scheduler of this instance name {verb} (as a drain prints it), whichever one is reached",
    )


def _drained_line(in_flight: int) -> str:
    if in_flight == 0:
        return "draining: nothing in flight; nothing is dispatched until `queue undrain`"
    return f"draining: {in_flight} job(s) still in flight; nothing new is dispatched"


NO_ANSWER = "no answer (gone, cut off from NATS, or of a release without drain orders): its state is unknown"


async def queue_drain(args: argparse.Namespace, options: Options) -> int:
    """Exit 0, or 5 (unavailable) when a scheduler addressed did not answer."""
    if args.wait < 0:
        raise UsageError("--wait must not be negative")
    request = ops_service_pb2.DrainRequest(all=args.all, scheduler=args.instance)
    request.timeout.FromNanoseconds(int(args.wait * 1e9))
    # The call lasts as long as the drain may: the per-call timeout is added on top.
    response = await _ops_call(options, lambda stub, t: stub.Drain(request, timeout=t + args.wait))
    results = [
        {"scheduler": r.scheduler, "answered": r.answered, "drained": r.drained, "in_flight": r.in_flight}
        for r in response.schedulers
    ]
    if options.json:
        answer: dict[str, object] = {
            "state": queue_state_name(response.state),
            "drained": response.drained,
            "in_flight": response.in_flight,
            "scheduler": response.scheduler,
        }
        if args.all or args.instance:
            answer["schedulers"] = results
        print_json(answer)
    elif not (args.all or args.instance):
        reached = f"{response.scheduler}: " if response.scheduler else ""
        print(reached + _drained_line(response.in_flight), flush=True)
    else:
        for r in response.schedulers:
            print(f"{r.scheduler}: {_drained_line(r.in_flight) if r.answered else NO_ANSWER}", flush=True)
    return EXIT_OK if all(r.answered for r in response.schedulers) else EXIT_UNAVAILABLE


async def queue_undrain(args: argparse.Namespace, options: Options) -> int:
    """Exit 0, or 5 (unavailable) when a scheduler addressed did not answer."""
    request = ops_service_pb2.UndrainRequest(all=args.all, scheduler=args.instance)
    response = await _ops_call(options, lambda stub, t: stub.Undrain(request, timeout=t + ANSWER_MARGIN_S))

    def line(was_draining: bool) -> str:
        return "dispatching" + ("" if was_draining else " (was not draining)")

    if options.json:
        answer: dict[str, object] = {
            "state": queue_state_name(response.state),
            "was_draining": response.was_draining,
            "scheduler": response.scheduler,
        }
        if args.all or args.instance:
            answer["schedulers"] = [
                {"scheduler": r.scheduler, "answered": r.answered, "was_draining": r.was_draining}
                for r in response.schedulers
            ]
        print_json(answer)
    elif not (args.all or args.instance):
        print((f"{response.scheduler}: " if response.scheduler else "") + line(response.was_draining), flush=True)
    else:
        for r in response.schedulers:
            print(f"{r.scheduler}: {line(r.was_draining) if r.answered else NO_ANSWER}", flush=True)
    return EXIT_OK if all(r.answered for r in response.schedulers) else EXIT_UNAVAILABLE


# -- stats --------------------------------------------------------------------------------------

_PRIORITY_NAMES = {v: job_pb2.Priority.Name(v).removeprefix("PRIORITY_") for v in job_pb2.Priority.values()}


def model_stats_json(model: ops_service_pb2.ModelQueueStats) -> dict[str, Any]:
    return {
        "model_name": model.model_name,
        "paused": model.paused,
        "draining": model.draining,
        "state": queue_state_name(model.state),
        "in_flight": model.in_flight,
        "connected_batchers": model.connected_batchers,
        "free_credits": model.free_credits,
        "desired_batchers": model.desired_batchers,
        "submitted_per_second": model.submitted_per_second,
        "completed_per_second": model.completed_per_second,
        # The counts above but depths are every reporting scheduler's together (GetQueueStats).
        "schedulers": model.schedulers,
        "draining_schedulers": model.draining_schedulers,
        "queues": [
            {
                "priority": _PRIORITY_NAMES.get(p.priority, str(p.priority)),
                "depth": p.depth,
                "oldest_age_s": _seconds(p.oldest_age) if p.HasField("oldest_age") else None,
            }
            for p in model.priorities
        ],
    }


STATS_COLUMNS = (
    "A table of the queues, a row a model, every scheduler's counts together: QUEUED jobs waiting (BY PRIORITY: "
    "H, N and L), the OLDEST one's wait, IN FLIGHT jobs dispatched and not ended, the BATCHERS serving the "
    "model, the batchers WANTED to clear its backlog at the throughput measured (the autoscaler's "
    "asyncinfer_desired_batchers; 0 while paused or draining), CREDITS: the work orders its batchers would take "
    "now, and jobs submitted (IN/S) and completed (OUT/S) per second over the last minute. A paused or "
    "draining model says so after its name."
)


def stats_rows(models: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The stats screen's headers and rows, one row a model."""
    rows: list[list[str]] = []
    for model in models:
        depth = sum(q["depth"] for q in model["queues"])
        ages = [q["oldest_age_s"] for q in model["queues"] if q["oldest_age_s"] is not None and q["depth"]]
        by_priority = " ".join(f"{q['priority'][0]}:{q['depth']}" for q in model["queues"])
        rows.append(
            [
                model["model_name"] + model_suffix(model),
                str(depth),
                by_priority,
                duration_text(max(ages)) if ages else "-",
                str(model["in_flight"]),
                str(model["connected_batchers"]),
                str(model["desired_batchers"]),
                str(model["free_credits"]),
                f"{model['submitted_per_second']:.1f}",
                f"{model['completed_per_second']:.1f}",
            ]
        )
    headers = [
        "MODEL",
        "QUEUED",
        "BY PRIORITY",
        "OLDEST",
        "IN FLIGHT",
        "BATCHERS",
        "WANTED",
        "CREDITS",
        "IN/S",
        "OUT/S",
    ]
    return headers, rows


def model_suffix(model: dict[str, Any]) -> str:
    """The queue's state where it is not dispatching: paused, this scheduler draining, or other
    schedulers draining ("1/2 draining": of the schedulers reporting the model)."""
    if model["paused"] or model["draining"]:
        return f" ({model['state']})"
    draining, schedulers = model.get("draining_schedulers", 0), model.get("schedulers", 0)
    return f" ({draining}/{schedulers} draining)" if draining else ""


def stats_table(models: list[dict[str, Any]]) -> str:
    """The stats as plain aligned text (a pipe's, a file's)."""
    return table(*stats_rows(models))


def stats_screen(models: list[dict[str, Any]], scheduler: str, now: str, trouble: str = "") -> RenderableType:
    """What the live stats screen shows: a title line (with `trouble`, where the last poll met
    some), then the table drawn by rich."""
    from rich.console import Group
    from rich.text import Text

    # The counts are every scheduler's together (GetQueueStats): say how many, where more than one.
    schedulers = max((model.get("schedulers", 0) for model in models), default=0)
    cluster = f" ({schedulers} schedulers)" if schedulers > 1 else ""
    title = Text(f"asyncinfer queues at {scheduler}{cluster}  {now}  (Ctrl-C to stop)\n")
    if trouble:
        title.append(f"{trouble}\n", style="bold yellow")
    return Group(title, rich_table(*stats_rows(models)))


async def stats_command(args: argparse.Namespace, options: Options) -> int:
    """JSON lines, or the table; on a terminal a screen redrawn in place every --interval (a
    rich Live, drawn when told: no refresh thread), left showing the last one on Ctrl-C."""
    if args.interval <= 0:
        raise UsageError("--interval must be positive")
    live: Live | None = None
    if sys.stdout.isatty() and not options.json and not args.once:
        from rich.live import Live

        live = Live(console=console(sys.stdout), auto_refresh=False, redirect_stdout=False, redirect_stderr=False)
        live.start()
    request = ops_service_pb2.GetQueueStatsRequest(model_name=args.model)
    shown: list[dict[str, Any]] = []  # the models the screen shows: redrawn with a retry's line

    def say_in_screen(error: AsyncInferClientError, _delay_s: float) -> None:
        # A line on stderr, under a screen redrawn in place, is drawn over and shifts the screen
        # down a line each poll (a scheduler restarting while the screen shows): said in its title.
        if live is not None:
            trouble = f"{options.scheduler} does not answer; trying again"
            now = datetime.now().astimezone().strftime("%H:%M:%S")
            live.update(stats_screen(shown, options.scheduler, now, trouble), refresh=True)

    say = say_in_screen if live is not None else None
    try:
        while True:
            started = time.monotonic()
            response = await _ops_call(options, lambda stub, t: stub.GetQueueStats(request, timeout=t), say)
            models = [model_stats_json(m) for m in response.models]
            if options.json:
                print_json({"time": datetime.now(UTC).isoformat(), "models": models})
            elif live is not None:
                now = datetime.now().astimezone().strftime("%H:%M:%S")
                shown[:] = models
                live.update(stats_screen(models, options.scheduler, now), refresh=True)
            elif args.once:
                print_table(*stats_rows(models))
            else:
                print(stats_table(models) + "\n", flush=True)
            if args.once:
                return EXIT_OK
            await asyncio.sleep(max(args.interval - (time.monotonic() - started), 0.0))
    finally:
        if live is not None:
            live.stop()
