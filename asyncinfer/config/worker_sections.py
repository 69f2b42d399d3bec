"""[scheduler] and [batcher]: the work plane's settings."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from asyncinfer.config.section import Section


class SchedulerConfig(Section):
    host: str = Field("127.0.0.1", description="Address the WorkerService and OpsService bind.")
    port: int = Field(50052, ge=0, le=65535, description="Port batchers connect to (and grpcurl uses for ops).")
    tls_cert_file: str | None = Field(
        None,
        description="PEM certificate (chain) the WorkerService and OpsService serves TLS with (with tls_key_file); unset: plaintext. "
        "Renewed in place (the files replaced), it is served to new connections without a restart.",
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


class BatcherConfig(Section):
    host: str = Field("127.0.0.1", description="Address the KServe v2 inference API binds.")
    port: int = Field(50053, ge=0, le=65535, description="Port of the KServe v2 GRPCInferenceService.")
    tls_cert_file: str | None = Field(
        None,
        description="PEM certificate (chain) the KServe v2 API serves TLS with (with tls_key_file); unset: plaintext. "
        "Renewed in place (the files replaced), it is served to new connections without a restart.",
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
        None,
        description="PEM client certificate for a scheduler that requires mutual TLS (with scheduler_key_file). "
        "Renewed in place, it is presented from the next work stream (a reconnect).",
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
        "a KServe call's gRPC deadline) finishes on it past this, and is timed out there as with no rollout; so do "
        "the waiting parts of a batch's chunk one of whose parts has started. What else still waits then, or "
        "computes with no deadline (a KServe call without one whose model call has not returned), is answered "
        "UNAVAILABLE MODEL_VERSION_RETIRED, a job's attempt given back (it runs again on what serves now); the "
        "version is closed once the rest has ended. A thread, which cannot be stopped, ends when its call returns.",
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
