"""What the adapter relies on of NATS's own wire protocol (not of nats-py): the status header of a
no-responders answer, the JetStream API's error codes for a lost compare-and-set, and how a KV
bucket maps onto its stream and subjects (ADR-8)."""

from __future__ import annotations

STATUS_HEADER = "Status"
NO_RESPONDERS_STATUS = "503"
# JSStreamWrongLastSequenceErrF, JSStreamWrongLastSequenceConstantErr: a compare-and-set lost.
WRONG_LAST_SEQUENCE_CODES = (10071, 10164)
# A full store: JSInsufficientResourcesErr, JSMemoryResourcesExceededErr, JSStorageResourcesExceededErr,
# and a stream at its max_msgs, max_bytes or max_msgs_per_subject with DiscardNew.
STORE_FULL_CODES = (10023, 10028, 10047, 10076, 10077, 10078)
EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
MSG_TTL = "Nats-TTL"


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def kv_subject_prefix(bucket: str) -> str:
    return f"$KV.{bucket}."


# "no suitable peers for placement" (JSClusterNoPeersErrF): a stream or consumer of more replicas
# than the servers with JetStream the cluster's meta leader counts now: one still joining as the
# cluster forms, or one lost.
NO_PLACEMENT_CODES = (10005,)
