"""[nats] and [embedded_nats]: the NATS connection, its stream and bucket names, and `up`'s own server."""

from __future__ import annotations

from pydantic import Field, field_validator

from asyncinfer import contract
from asyncinfer.config.section import Section


class NatsConfig(Section):
    url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma-separated for a cluster.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Timeout of one connection attempt.")
    first_connect_wait_s: float = Field(
        60.0,
        ge=0,
        description="How long a service's first connect keeps trying a NATS it cannot reach (connection refused, "
        "name not resolved, no answer) before it gives up (exit 69, Unavailable), saying so in a line naming the URL "
        "when it starts waiting and then every 10 s. 60 by default: a service started before NATS answers (systemd "
        "or compose start order, a NATS restart during a deploy) waits for it and starts as soon as it does, as a "
        "Celery worker keeps trying its broker at start; a minute covers such races, and a wrong host or port is "
        "still said within it. 0: it gives up after 3 tries per server (a few seconds); `asyncinfer up` uses 0 "
        "unless the file sets it (it starts its own nats-server first). A TLS failure, refused credentials, or a "
        "server whose greeting shows this TLS setting cannot work (it requires a client certificate and "
        "tls_cert_file is unset; it has no TLS and this client requires it) give up at once whatever it says "
        "(exit 2, the setting named). The Kubernetes configuration sets 120: a pod started before the NATS "
        "StatefulSet answers waits for it rather than exiting into CrashLoopBackOff, whose delay doubles up to 5 "
        "minutes.",
    )
    ping_interval_s: float = Field(
        5.0,
        gt=0,
        description="Ping the server this often; after max_outstanding_pings unanswered the server is taken as hung "
        "and the client moves to another node of the cluster (nats-py's 120 s took minutes to leave a hung node).",
    )
    max_outstanding_pings: int = Field(2, ge=1, description="Unanswered pings after which the server is taken as hung.")
    credentials_file: str | None = Field(
        None, description="A NATS .creds file (a user JWT and its NKey seed), when the server needs one."
    )
    user: str | None = Field(None, description="NATS user name (with password or password_file).")
    password: str | None = Field(None, description="NATS password inline; prefer password_file.")
    password_file: str | None = Field(None, description="A file holding the NATS password (a mounted Secret).")
    token: str | None = Field(None, description="NATS authentication token inline; prefer token_file.")
    token_file: str | None = Field(None, description="A file holding the NATS token (a mounted Secret).")
    nkey_seed_file: str | None = Field(
        None, description="A file holding the NATS user's NKey seed (needs the `nkeys` package)."
    )
    tls_ca_file: str | None = Field(
        None,
        description="PEM CA bundle that verifies the NATS server; setting it (or a tls:// URL, or tls_cert_file) "
        "turns TLS on, and a server without TLS is then refused. Unset with a tls:// URL: the system's CAs.",
    )
    tls_cert_file: str | None = Field(
        None,
        description="PEM client certificate, for a NATS server that verifies clients (with tls_key_file). Renewed in "
        "place, it is presented from the next reconnect.",
    )
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file.")
    inbox_prefix: str = Field(
        "_INBOX",
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Prefix of this connection's reply subjects. Where NATS permissions separate the services "
        "(asyncinfer.nats_users), each gets its own (_INBOX_gateway, _INBOX_scheduler, _INBOX_batcher), so that "
        "no other user may read its replies.",
    )
    work_stream: str = Field(contract.WORK_STREAM, description="The WorkQueue stream holding queued jobs.")
    dead_letter_stream: str = Field(contract.DEAD_LETTER_STREAM, description="The stream of jobs that failed for good.")
    jobs_bucket: str = Field(contract.JOBS_BUCKET, description="The KV bucket holding job records.")
    queues_bucket: str = Field(
        contract.QUEUES_BUCKET, description="The KV bucket of queue snapshots, pauses and per-tenant queued counts."
    )
    models_bucket: str = Field(
        contract.MODELS_BUCKET,
        description="The KV registry of model versions: which batchers serve (or load) each, with its signature.",
    )
    replicas: int = Field(1, ge=1, le=5, description="Replicas of every stream and bucket (3 on a cluster).")
    duplicate_window_s: float = Field(
        120.0, gt=0, description="How long the WORK stream remembers job IDs to drop duplicate publishes."
    )
    expired_job_marker_ttl_s: float = Field(
        7 * 86400.0,
        ge=1,
        description="How long, after a job's retention passes, reads of it answer JOB_RETENTION_PASSED rather "
        "than JOB_NOT_FOUND (the delete marker's TTL: ~180 B of store per expired job; applied to the bucket at "
        "each start).",
    )
    idempotency_bucket: str = Field(
        contract.IDEMPOTENCY_BUCKET, description="The KV bucket mapping (tenant, idempotency key) to the first job."
    )
    objects_bucket: str = Field(
        contract.OBJECTS_BUCKET,
        description="The Object Store bucket of uploaded inputs and large results (the claim check).",
    )
    # Here, beside objects_bucket: every service builds its BlobStore from this section, and the
    # directory holds that bucket's bytes (<directory>/<bucket>/), its metas staying in the bucket.
    objects_directory: str | None = Field(
        None,
        description="A directory every gateway, scheduler and batcher shares (one host, or a ReadWriteMany "
        "volume) where new claim-check objects keep their bytes, one file each, their metadata staying in "
        "objects_bucket; unset: the bytes are chunks in the bucket's stream. Objects stored either way are "
        "read either way; checked at start (it must exist and be writable). `asyncinfer up` sets it to "
        '`objects` beside its embedded store unless the file sets it; "" keeps the bytes in the stream.',
    )

    @field_validator("objects_directory")
    @classmethod
    def _empty_is_unset(cls, value: str | None) -> str | None:
        # "" is how a file says "no directory" (TOML has no null): what `up` then leaves unset.
        return value or None

    webhooks_stream: str = Field(
        contract.WEBHOOKS_STREAM, description="The WorkQueue stream of pending webhook deliveries."
    )
    webhooks_bucket: str = Field(
        contract.WEBHOOKS_BUCKET, description="The KV bucket of webhook delivery outcomes per job, and disabled URLs."
    )
    batches_bucket: str = Field(
        contract.BATCHES_BUCKET, description="The KV bucket of batch records (BatchService), keyed <tenant>.<batch_id>."
    )


class EmbeddedNatsConfig(Section):
    host: str = Field("127.0.0.1", description="Address the embedded nats-server of `asyncinfer up` binds.")
    port: int = Field(4222, ge=0, le=65535, description="Client port of the embedded nats-server.")
    monitor_port: int = Field(8222, ge=0, le=65535, description="HTTP monitoring port (0: off).")
    store_dir: str = Field(
        ".asyncinfer/nats", description="JetStream store; a later `up` reuses it, a second at once is refused."
    )
