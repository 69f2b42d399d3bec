"""[gateway] (with its API keys), [batches] and [console]: the front end's settings."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from asyncinfer.config.section import SHA256_HEX_PATTERN, Section
from asyncinfer.jobs import NAME_PATTERN

# Where console.trace_url puts the trace ID.
TRACE_ID_PLACEHOLDER = "{trace_id}"


class ApiKeyConfig(Section):
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


class GatewayConfig(Section):
    host: str = Field("127.0.0.1", description="Address the public JobService binds.")
    port: int = Field(50051, ge=0, le=65535, description="Port of the public JobService.")
    tls_cert_file: str | None = Field(
        None,
        description="PEM certificate (chain) the JobService serves TLS with (with tls_key_file); unset: plaintext. "
        "Renewed in place (the files replaced), it is served to new connections without a restart.",
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


class BatchesConfig(Section):
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


class ConsoleConfig(Section):
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
        description="The key (role ops) for the queues and dead letters, with API keys; it also allows the console's "
        "actions (replay, purge, pause, resume, cancel a job, retry a dead-lettered job) unless read_only. Prefer "
        "ops_key_file.",
    )
    ops_key_file: str | None = Field(None, description="A file holding ops_key (a mounted Secret).")
    read_only: bool = Field(
        False,
        description="Offer no action (replay, purge, pause, resume, cancel, retry) even with an ops key. Without an ops key the "
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
