"""The contract between the services, as NATS sees it: every subject, stream, bucket, consumer,
header, key format and message ID that more than one module (or more than one service) must agree
on, named once. docs/ARCHITECTURE.md lists each of them, and tests/test_contract.py holds the two
to each other.

The names of streams and buckets here are the defaults of `asyncinfer.config.NatsConfig` (whose
fields say `Field(contract.WORK_STREAM, ...)`): a deployment may rename them, so code takes them
from the configuration and this module only for their defaults. Everything else is fixed.

Nothing here imports the rest of asyncinfer at run time, so any module (the config included) may
import it.
"""

from __future__ import annotations

import hashlib
from typing import Protocol


class Priority(Protocol):
    """What the contract needs of asyncinfer.jobs.Priority (not imported: the contract sits below
    every other module)."""

    @property
    def value(self) -> str: ...

    @property
    def subject_token(self) -> str: ...


# --- streams and buckets (NatsConfig defaults) ------------------------------------------------

WORK_STREAM = "WORK"  # NatsConfig.work_stream: WorkQueue stream of queued jobs
DEAD_LETTER_STREAM = "DEAD_LETTERS"  # NatsConfig.dead_letter_stream: jobs that failed for good
WEBHOOKS_STREAM = "WEBHOOKS"  # NatsConfig.webhooks_stream: WorkQueue stream of pending deliveries
JOBS_BUCKET = "jobs"  # NatsConfig.jobs_bucket: KV of job records
QUEUES_BUCKET = "queues"  # NatsConfig.queues_bucket: KV of snapshots, pauses, tenant counts
IDEMPOTENCY_BUCKET = "idempotency"  # NatsConfig.idempotency_bucket: KV of idempotency claims
WEBHOOKS_BUCKET = "webhooks"  # NatsConfig.webhooks_bucket: KV of delivery status, disabled URLs
BATCHES_BUCKET = "batches"  # NatsConfig.batches_bucket: KV of batch records
OBJECTS_BUCKET = "blobs"  # NatsConfig.objects_bucket: Object Store of large inputs and results
MODELS_BUCKET = "models"  # NatsConfig.models_bucket: KV registry of the model versions batchers serve

# --- subjects ---------------------------------------------------------------------------------

WORK_SUBJECT_PREFIX = "asyncinfer.work"  # .<model>.<priority>.<tenant>.<job_id>: the WORK stream
QUEUED_SUBJECT_PREFIX = "asyncinfer.queued"  # .<model>.<priority>: core NATS, queued notices
CANCEL_SUBJECT_PREFIX = "asyncinfer.control.cancel"  # .<model>: core NATS, cancel notices
PROGRESS_SUBJECT_PREFIX = "asyncinfer.progress"  # .<tenant>.<job_id>: core NATS, progress notices
DEAD_SUBJECT_PREFIX = "asyncinfer.dead"  # .<model>: the DEAD_LETTERS stream
WEBHOOK_SUBJECT_PREFIX = "asyncinfer.webhooks"  # .<tenant>: the WEBHOOKS stream
KV_SUBJECT_PREFIX = "$KV"  # .<bucket>.<key>: a KV bucket's writes (and its watch feed)
KV_STREAM_PREFIX = "KV_"  # <bucket>: the stream behind a KV bucket
JS_API_PREFIX = "$JS.API"  # JetStream's request API (pulls, purges)


def _all_under(prefix: str) -> str:
    return f"{prefix}.>"


# A gateway's probe of a full store: a write no consumer takes (one token where a queue has two),
# gone in a second (Nats-TTL).
STORE_PROBE_SUBJECT = f"{WORK_SUBJECT_PREFIX}.store-probe"
WORK_SUBJECTS = _all_under(WORK_SUBJECT_PREFIX)
DEAD_SUBJECTS = _all_under(DEAD_SUBJECT_PREFIX)
WEBHOOK_SUBJECTS = _all_under(WEBHOOK_SUBJECT_PREFIX)
CANCEL_SUBJECTS = f"{CANCEL_SUBJECT_PREFIX}.*"  # every model's cancel notices (each scheduler hears all)
# Drain and undrain orders (core NATS, request-reply): every scheduler subscribes, the one an
# operator's Drain with `all` or `scheduler` reached publishes, and each scheduler addressed answers
# to the reply inbox (asyncinfer.drain_orders).
DRAIN_SUBJECT = "asyncinfer.control.drain"


def work_subject(model_name: str, priority: Priority) -> str:
    """The queue of one (model, priority): its work consumer takes this subject and every job's
    under it. (Before one subject per job, every message of the queue was published here.)"""
    return f"{WORK_SUBJECT_PREFIX}.{model_name}.{priority.subject_token}"


def job_work_subject(model_name: str, priority: Priority, tenant: str, job_id: str) -> str:
    """A job's own work subject: its work message is its QUEUED record, read back by this subject."""
    return f"{work_subject(model_name, priority)}.{tenant}.{job_id}"


def work_filters(model_name: str, priority: Priority) -> list[str]:
    """What the (model, priority) work consumer takes: every job's subject, and the queue's own
    subject for messages published before subjects were per job."""
    queue = work_subject(model_name, priority)
    return [queue, f"{queue}.>"]


def model_work_subjects(model_name: str) -> str:
    """Every priority's work subjects of one model (what the scheduler's deadline sweep reads)."""
    return f"{WORK_SUBJECT_PREFIX}.{model_name}.>"


def job_work_lookup(tenant: str, job_id: str) -> str:
    """The subject filter that finds a job's work message without knowing its model or priority."""
    return f"{WORK_SUBJECT_PREFIX}.*.*.{tenant}.{job_id}"


def tenant_work_subjects(tenant: str) -> str:
    """Every unfinished job's work subject of one tenant (what ListJobs scans for QUEUED jobs, and
    what the gateway counts against `max_queued_per_tenant`)."""
    return f"{WORK_SUBJECT_PREFIX}.*.*.{tenant}.*"


def queued_subject(model_name: str, priority: Priority) -> str:
    return f"{QUEUED_SUBJECT_PREFIX}.{model_name}.{priority.subject_token}"


def queued_subjects(model_name: str) -> str:
    """Every priority's queued notices of one model (what a dispatcher subscribes to)."""
    return f"{QUEUED_SUBJECT_PREFIX}.{model_name}.*"


def cancel_subject(model_name: str) -> str:
    return f"{CANCEL_SUBJECT_PREFIX}.{model_name}"


def progress_subject(tenant: str, job_id: str) -> str:
    """A running job's progress notices (core NATS, never stored): the scheduler sends, the
    gateways that watch the job subscribe to it."""
    return f"{PROGRESS_SUBJECT_PREFIX}.{tenant}.{job_id}"


def dead_subject(model_name: str) -> str:
    return f"{DEAD_SUBJECT_PREFIX}.{model_name}"


def webhook_subject(tenant: str) -> str:
    return f"{WEBHOOK_SUBJECT_PREFIX}.{tenant}"


def kv_subject_prefix(bucket: str) -> str:
    """`$KV.<bucket>.`: a key's subject is this plus the key."""
    return f"{KV_SUBJECT_PREFIX}.{bucket}."


def kv_subject(bucket: str, key: str) -> str:
    return f"{KV_SUBJECT_PREFIX}.{bucket}.{key}"


def kv_stream(bucket: str) -> str:
    return f"{KV_STREAM_PREFIX}{bucket}"


def consumer_next_subject(stream: str, consumer: str) -> str:
    """The pull request subject of a durable pull consumer."""
    return f"{JS_API_PREFIX}.CONSUMER.MSG.NEXT.{stream}.{consumer}"


def consumer_info_subject(stream: str, consumer: str) -> str:
    return f"{JS_API_PREFIX}.CONSUMER.INFO.{stream}.{consumer}"


def stream_purge_subject(stream: str) -> str:
    return f"{JS_API_PREFIX}.STREAM.PURGE.{stream}"


def stream_info_subject(stream: str) -> str:
    return f"{JS_API_PREFIX}.STREAM.INFO.{stream}"


def stream_msg_get_subject(stream: str) -> str:
    return f"{JS_API_PREFIX}.STREAM.MSG.GET.{stream}"


def stream_msg_delete_subject(stream: str) -> str:
    return f"{JS_API_PREFIX}.STREAM.MSG.DELETE.{stream}"


# --- consumers (durable names) ----------------------------------------------------------------

WORK_CONSUMER_PREFIX = "work"  # -<model>-<priority>: one per (model, priority) on WORK
WEBHOOK_SENDER_CONSUMER = "webhook-sender"  # on WEBHOOKS: sends deliveries
WEBHOOK_FEED_CONSUMER = "webhook-notifier"  # on KV_<jobs bucket>: turns record writes into deliveries


def work_consumer_name(model_name: str, priority: Priority) -> str:
    return f"{WORK_CONSUMER_PREFIX}-{model_name}-{priority.subject_token}"


# --- headers ----------------------------------------------------------------------------------

# NATS's own.
MSG_ID_HEADER = "Nats-Msg-Id"  # deduplication within a stream's duplicate window
EXPECTED_STREAM_HEADER = "Nats-Expected-Stream"  # a publish lands in this stream or fails
EXPECTED_LAST_SUBJECT_SEQUENCE_HEADER = "Nats-Expected-Last-Subject-Sequence"  # compare-and-set
MSG_TTL_HEADER = "Nats-TTL"  # per-message TTL (retention of records, claims, delivery status)
ROLLUP_HEADER = "Nats-Rollup"  # an Object Store meta write replaces the subject's earlier ones
KV_OPERATION_HEADER = "KV-Operation"  # DEL / PURGE on a KV write
MARKER_REASON_HEADER = "Nats-Marker-Reason"  # a server-placed delete marker (a TTL expired)

# Ours. The routing facts of a work message, so that nothing parses a payload to route it (an
# older gateway's message has none: readers fall back to decoding the envelope).
TENANT_HEADER = "Asyncinfer-Tenant"
JOB_ID_HEADER = "Asyncinfer-Job-Id"
PRIORITY_HEADER = "Asyncinfer-Priority"  # the Priority value: HIGH, NORMAL, LOW
MODEL_HEADER = "Asyncinfer-Model"
# The job's queue deadline (Unix seconds, decimal), on the work message of a job that has one: the
# scheduler's deadline sweep finds overdue messages without decoding their envelopes (a message
# without it, from an older gateway, is expired at its dispatch or a read, as before).
DEADLINE_HEADER = "Asyncinfer-Deadline"
# On an Object Store meta message: when the object expires (Unix seconds) and its SHA-256 (hex).
EXPIRES_HEADER = "Asyncinfer-Expires-At"
SHA256_HEADER = "Asyncinfer-Sha256"
# ... and the stream sequences of its chunks, as runs "first+count,first+count" (chunk k is the k-th
# of them), so a byte range is read by sequence without walking the chunks before it.
CHUNK_SEQUENCES_HEADER = "Asyncinfer-Chunk-Sequences"
# ... and, on an upload, the batches created over it (one value each): DeleteInput refuses while
# one of them has not ended, as its chunks still read the upload.
BATCHES_HEADER = "Asyncinfer-Batches"
# ... and where its bytes are when not in the stream's chunks: "directory", a file of the objects'
# directory the services share (nats.objects_directory, asyncinfer.blob_files). Absent: chunks.
BYTES_IN_HEADER = "Asyncinfer-Bytes-In"
# W3C trace context (its own name, as the spec spells it): on a traced job's work message, the
# submit span's traceparent, the same as the record it carries (asyncinfer.tracing).
TRACEPARENT_HEADER = "traceparent"


def routing_headers(*, tenant: str, job_id: str, priority: Priority, model_name: str) -> dict[str, str]:
    """The headers a work message carries (the same on a replay's re-publish)."""
    return {
        TENANT_HEADER: tenant,
        JOB_ID_HEADER: job_id,
        PRIORITY_HEADER: priority.value,
        MODEL_HEADER: model_name,
    }


# --- keys -------------------------------------------------------------------------------------

# queues bucket: a snapshot's key is the bare model name (one token); these have two.
PAUSED_KEY_PREFIX = "paused."
SCHEDULER_KEY_PREFIX = "scheduler."
# webhooks bucket.
DELIVERIES_KEY_PREFIX = "job."
DISABLED_URL_KEY_PREFIX = "disabled."


def job_key(tenant: str, job_id: str) -> str:
    """A job record's key in the jobs bucket."""
    return f"{tenant}.{job_id}"


def tenant_keys(tenant: str) -> str:
    """Every job key of one tenant (a KV filter)."""
    return f"{tenant}.>"


def claim_key(tenant: str, idempotency_key: str) -> str:
    """An idempotency claim's key: the caller's key hashed (any bytes, any length, one token)."""
    return f"{tenant}.{hashlib.sha256(idempotency_key.encode()).hexdigest()}"


def snapshot_key(model_name: str) -> str:
    return model_name


def paused_key(model_name: str) -> str:
    return f"{PAUSED_KEY_PREFIX}{model_name}"


def scheduler_key(run: str) -> str:
    """A running scheduler instance's heartbeat (its run ID is one token)."""
    return f"{SCHEDULER_KEY_PREFIX}{run}"


def deliveries_key(tenant: str, job_id: str) -> str:
    return f"{DELIVERIES_KEY_PREFIX}{tenant}.{job_id}"


def disabled_url_key(tenant: str, url: str) -> str:
    return f"{DISABLED_URL_KEY_PREFIX}{tenant}.{hashlib.sha256(url.encode()).hexdigest()}"


def model_version_key(model_name: str, version: str, batcher_key: str) -> str:
    """One batcher's entry for one model version in the models bucket (batcher_key: the
    batcher's ID as one token, `model_registry.batcher_token`)."""
    return f"{model_name}.{version}.{batcher_key}"


def object_name(tenant: str, ref: str) -> str:
    """An Object Store object's name: the tenant, then the ref callers see (in/<id>, out/<job_id>,
    or out/<job_id>.<attempt> for outputs a batcher stored itself)."""
    return f"{tenant}/{ref}"


# --- message IDs (Nats-Msg-Id) ----------------------------------------------------------------
# A work publish's ID is the job ID; a webhook delivery's is its webhook ID.


def dead_letter_msg_id(job_id: str, attempt: int) -> str:
    """`attempt`: the record's attempt number when the job gave up (its fencing token)."""
    return f"{job_id}.dead.{attempt}"


def replay_msg_id(job_id: str, dead_letter_sequence: int) -> str:
    return f"{job_id}.replay.{dead_letter_sequence}"
