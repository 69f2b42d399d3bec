"""The NATS users of a deployment and what each may publish and subscribe to: one user per service
that talks to NATS, each allowed only the subjects of the streams and buckets it uses.

Who needs NATS at all: the gateway and the scheduler. The batcher and the console do not (the
batcher talks gRPC to the scheduler, the console gRPC to the gateway and the scheduler), so they
get no NATS user: with authorization on, a connection without credentials is refused, and a
batcher pod, which runs model code, holds nothing that opens NATS. The one exception is a batcher
with `batcher.claim_check_io` (it reads its orders' inputs from the objects bucket and stores
large outputs there itself, docs/BATCHES.md): `batcher_permissions` is its user, asked for with
`service_permissions(..., batcher=True)`. It reaches the objects bucket and nothing else, so model
code that takes it can read and replace stored objects (every tenant's uploads and results), but
not see or change a job, a queue or a record.

What each service may touch (ARCHITECTURE.md "The contract in NATS" names every subject):

- gateway: publishes work messages and queued/cancel notices; writes job records, idempotency
  claims, batch records (its batch driver) and uploaded inputs (and a batch's chunk objects); reads queue snapshots and pauses, webhook delivery status, the work
  stream (queue positions, ListJobs of queued jobs, tenant counts), the model registry and the
  job records' feed; pulls (never acknowledges) the jobs bucket's keys for ListJobs;
  hears progress notices. It may not pull or acknowledge work (`$JS.API.CONSUMER.MSG.NEXT.WORK.*`,
  `$JS.ACK.WORK.>`), read or write dead letters, nor touch the webhook deliveries stream.
- scheduler: everything of the stack's streams and buckets (it pulls, leases, stores results,
  dead-letters, replays, purges and sends webhooks), drain orders to and from the other schedulers
  (`asyncinfer.control.drain`, which no other service may send), and nothing else of the server's.
- batcher (claim_check_io only): reads objects (their meta by subject, their chunks by sequence),
  writes output objects (chunks, then the meta) and purges the chunks of a failed or replaced one.
  It may not create, change or read the info of any stream, nor consume from one.

JetStream's API is allowed per stream (`$JS.API.<ACTION>.<stream>...`), not as `$JS.API.>`, so a
service can neither read nor create a stream outside its list. Replies (and the deliveries of
ordered consumers: KV watches, object reads) come to each service's own inbox prefix
(`INBOX_PREFIXES`, the service's `nats.inbox_prefix`), never to the shared `_INBOX.>`, so no
other user may subscribe to them. JetStream's flow-control and acknowledgement subjects are
allowed per stream as well.

`authorization_block` renders the nats-server configuration (tests/nats_auth.py writes one for a
test server; deploy/k8s/generate_config.py writes the cluster's, whose credentials are NKeys read
from the environment: the public keys alone, none of them secret); `asyncinfer nats-users DIR`
(`users_with_seeds`) writes one NKey seed per service and prints the block, for a server run by hand."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from asyncinfer import contract
from asyncinfer.config import NatsConfig
from asyncinfer.embedded_nats import conf_string

# Each service's `nats.inbox_prefix` where these permissions apply (not under `_INBOX.`: a user
# allowed `_INBOX.>` would match it).
INBOX_PREFIXES = {"gateway": "_INBOX_gateway", "scheduler": "_INBOX_scheduler", "batcher": "_INBOX_batcher"}


def _inbox(service: str) -> str:
    return f"{INBOX_PREFIXES[service]}.>"


# The JetStream API requests a service makes of one of its streams (`$JS.API.<action>.<stream>`),
# and of that stream's consumers (`$JS.API.<action>.<stream>.<consumer>...`).
_STREAM_ACTIONS = ("STREAM.INFO", "STREAM.CREATE", "STREAM.UPDATE", "STREAM.MSG.GET", "DIRECT.GET")
_STREAM_WRITE_ACTIONS = ("STREAM.PURGE", "STREAM.MSG.DELETE")
_CONSUMER_ACTIONS = ("CONSUMER.CREATE", "CONSUMER.DURABLE.CREATE", "CONSUMER.INFO", "CONSUMER.DELETE")


@dataclass(frozen=True, kw_only=True)
class Permissions:
    """What one NATS user may publish to and subscribe to (allow lists: everything else is denied)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    deny_publish: tuple[str, ...] = field(default=())
    deny_subscribe: tuple[str, ...] = field(default=())

    def as_config(self) -> dict[str, object]:
        publish: dict[str, object] = {"allow": list(self.publish)}
        subscribe: dict[str, object] = {"allow": list(self.subscribe)}
        if self.deny_publish:
            publish["deny"] = list(self.deny_publish)
        if self.deny_subscribe:
            subscribe["deny"] = list(self.deny_subscribe)
        return {"publish": publish, "subscribe": subscribe}


def _stream_api(stream: str, *, write: bool, pull: bool) -> list[str]:
    subjects = ["$JS.API.INFO"]
    for action in _STREAM_ACTIONS:
        subjects += [f"$JS.API.{action}.{stream}", f"$JS.API.{action}.{stream}.>"]
    if write:
        subjects += [f"$JS.API.{action}.{stream}" for action in _STREAM_WRITE_ACTIONS]
    for action in _CONSUMER_ACTIONS:
        subjects += [f"$JS.API.{action}.{stream}", f"$JS.API.{action}.{stream}.>"]
    subjects.append(f"$JS.FC.{stream}.>")
    if pull:  # pull requests and acknowledgements: who takes work off the stream
        subjects += [f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>", f"$JS.ACK.{stream}.>"]
    return subjects


def _kv(bucket: str) -> str:
    return f"{contract.KV_SUBJECT_PREFIX}.{bucket}.>"


def _objects(bucket: str) -> str:
    return f"$O.{bucket}.>"


def _objects_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def gateway_permissions(nats: NatsConfig) -> Permissions:
    streams_read = (
        nats.work_stream,
        contract.kv_stream(nats.queues_bucket),
        contract.kv_stream(nats.webhooks_bucket),
        contract.kv_stream(nats.models_bucket),  # the model registry the gateway learns versions from
    )
    streams_write = (
        contract.kv_stream(nats.jobs_bucket),
        contract.kv_stream(nats.idempotency_bucket),
        contract.kv_stream(nats.batches_bucket),  # batch records, written by the gateways' batch drivers
        _objects_stream(nats.objects_bucket),
    )
    api: list[str] = []
    for stream in streams_read:
        api += _stream_api(stream, write=False, pull=False)
    for stream in streams_write:
        api += _stream_api(stream, write=True, pull=False)
    # ListJobs reads a tenant's keys through a pull consumer of its own, in bounded batches
    # (services/gateway/tenant_keys.py): pulls, no acknowledgements (it acknowledges nothing).
    api.append(f"$JS.API.CONSUMER.MSG.NEXT.{contract.kv_stream(nats.jobs_bucket)}.>")
    publish = [
        *_unique(api),
        contract.WORK_SUBJECTS,
        contract.WEBHOOK_SUBJECTS,  # a batch's terminal webhook, enqueued by its batch driver
        f"{contract.QUEUED_SUBJECT_PREFIX}.>",
        f"{contract.CANCEL_SUBJECT_PREFIX}.>",
        _kv(nats.jobs_bucket),
        _kv(nats.idempotency_bucket),
        _kv(nats.batches_bucket),
        _objects(nats.objects_bucket),
    ]
    subscribe = [_inbox("gateway"), f"{contract.PROGRESS_SUBJECT_PREFIX}.>", f"{contract.QUEUED_SUBJECT_PREFIX}.>"]
    return Permissions(publish=tuple(publish), subscribe=tuple(subscribe))


def scheduler_permissions(nats: NatsConfig) -> Permissions:
    streams = (
        nats.work_stream,
        nats.dead_letter_stream,
        nats.webhooks_stream,
        *(
            contract.kv_stream(bucket)
            for bucket in (
                nats.jobs_bucket,
                nats.queues_bucket,
                nats.idempotency_bucket,
                nats.webhooks_bucket,
                nats.models_bucket,
                nats.batches_bucket,  # read only (a headers-only watch: batches' planned chunks)
            )
        ),
        _objects_stream(nats.objects_bucket),
    )
    api: list[str] = []
    for stream in streams:
        api += _stream_api(stream, write=True, pull=True)
    # ListJobs reads a tenant's keys through a pull consumer of its own, in bounded batches
    # (services/gateway/tenant_keys.py): pulls, no acknowledgements (it acknowledges nothing).
    api.append(f"$JS.API.CONSUMER.MSG.NEXT.{contract.kv_stream(nats.jobs_bucket)}.>")
    publish = [
        *_unique(api),
        contract.WORK_SUBJECTS,
        contract.DEAD_SUBJECTS,
        contract.WEBHOOK_SUBJECTS,
        f"{contract.QUEUED_SUBJECT_PREFIX}.>",  # a retried or replayed job is queued again
        f"{contract.PROGRESS_SUBJECT_PREFIX}.>",
        *(
            _kv(bucket)
            for bucket in (
                nats.jobs_bucket,
                nats.queues_bucket,
                nats.idempotency_bucket,
                nats.webhooks_bucket,
                nats.models_bucket,  # the model registry: what its batchers serve
            )
        ),
        _objects(nats.objects_bucket),
        # Its own inbox: a stop ends a pull held open by waking its inbox's reader with a message
        # (asyncinfer.nats.pull_inbox.PullInbox.interrupt). Refused, each stop with NATS users
        # waited out the hold (10 s). No other service subscribes under this prefix.
        _inbox("scheduler"),
        # Drain orders to the other schedulers (their answers come to its inbox, and its own go to
        # another scheduler's: the same prefix). No other service may send one.
        contract.DRAIN_SUBJECT,
    ]
    subscribe = [
        _inbox("scheduler"),
        f"{contract.QUEUED_SUBJECT_PREFIX}.>",
        f"{contract.CANCEL_SUBJECT_PREFIX}.>",
        contract.DRAIN_SUBJECT,
    ]
    return Permissions(publish=tuple(publish), subscribe=tuple(subscribe))


def batcher_permissions(nats: NatsConfig) -> Permissions:
    """A batcher with `batcher.claim_check_io`: the objects bucket's reads and writes, nothing more."""
    stream = _objects_stream(nats.objects_bucket)
    publish = [
        f"$JS.API.DIRECT.GET.{stream}",  # a chunk by sequence
        f"$JS.API.DIRECT.GET.{stream}.>",  # an object's meta by subject
        f"$JS.API.STREAM.MSG.GET.{stream}",  # the same where direct gets are off
        f"$JS.API.STREAM.PURGE.{stream}",  # the chunks of a failed or replaced output
        _objects(nats.objects_bucket),  # output chunks and meta
    ]
    return Permissions(publish=tuple(publish), subscribe=(_inbox("batcher"),))


def service_permissions(nats: NatsConfig, *, batcher: bool = False) -> dict[str, Permissions]:
    """Each NATS-using service's permissions, by service name; with `batcher`, the user of
    batchers that move their orders' claim-checked bytes themselves (`batcher.claim_check_io`)."""
    services = {"gateway": gateway_permissions(nats), "scheduler": scheduler_permissions(nats)}
    if batcher:
        services["batcher"] = batcher_permissions(nats)
    return services


def _unique(subjects: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(subjects))


@dataclass(frozen=True, kw_only=True)
class NatsUser:
    """One user entry: a credential (an NKey public key, or user and password) and permissions.
    A value starting with `$` is written bare: nats-server reads it from its environment."""

    permissions: Permissions
    nkey: str | None = None
    user: str | None = None
    password: str | None = None

    def as_config(self) -> str:
        fields: list[str] = []
        for name in ("nkey", "user", "password"):
            value = getattr(self, name)
            if value is not None:
                fields.append(f"{name}: {value if value.startswith('$') else conf_string(value)}")
        fields.append(f"permissions: {_conf_value(self.permissions.as_config())}")
        return "{ " + ", ".join(fields) + " }"


def _conf_value(value: object) -> str:
    """A map, list or string as nats-server's configuration file reads it, laid out as json.dumps
    lays it out (the files rendered before are unchanged where all is ASCII), but not json.dumps,
    which writes a character beyond ASCII (a user named José, a tenant's subject) as \\uXXXX, which
    nats-server refuses ("Invalid escape character 'u'"), and the whole file with it."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{conf_string(key)}: {_conf_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_conf_value(item) for item in value) + "]"
    if isinstance(value, str):
        return conf_string(value)
    raise TypeError(f"not a configuration value: {value!r}")


def authorization_block(users: Mapping[str, NatsUser]) -> str:
    """A nats-server `authorization { users = [...] }` block (one line per user, led by a comment
    naming its service), its strings quoted as nats-server reads them (conf_string)."""
    lines = ["authorization {", "  users = ["]
    for service, user in users.items():
        lines.append(f"    # {service}")
        lines.append(f"    {user.as_config()}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def new_user_nkey() -> tuple[str, str]:
    """A fresh NATS user NKey: (seed, public key). The seed is the secret the service holds (its
    `nats.nkey_seed_file`); the public key is what the server's configuration lists."""
    import os

    import nkeys  # the server extra's; imported here so that the config renderer needs nothing more

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode(), nkeys.from_seed(bytearray(seed)).public_key.decode()


def users_with_seeds(
    directory: Path, nats: NatsConfig, *, batcher: bool = False
) -> tuple[dict[str, NatsUser], dict[str, Path]]:
    """Each service's NATS user with an NKey, and the seed file it holds (`<service>.nk` in the
    directory, written 0600; an existing one is kept, so running it again changes no credential)."""
    import nkeys  # the server extra's, as new_user_nkey's

    directory.mkdir(parents=True, exist_ok=True)
    users: dict[str, NatsUser] = {}
    seeds: dict[str, Path] = {}
    for service, permissions in service_permissions(nats, batcher=batcher).items():
        path = directory / f"{service}.nk"
        if not path.exists():
            seed, _public = new_user_nkey()
            path.touch(mode=0o600)
            path.write_text(seed + "\n")
        public = nkeys.from_seed(bytearray(path.read_text().strip().encode())).public_key.decode()
        users[service] = NatsUser(permissions=permissions, nkey=public)
        seeds[service] = path
    return users, seeds
