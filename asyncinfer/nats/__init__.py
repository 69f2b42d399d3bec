"""The NATS adapter: the one package that imports nats-py.

Everything else imports nats-py's types and errors from here, and calls the adapter's modules for
what it does with them: `connection` (connecting), `streams` (declaring streams and buckets,
durable publishes, retries of transient JetStream errors), `groups` (durable publishes in pipelined
groups), `requests` (requests and JetStream publishes on the hot paths), `kv` (the raw read and compare-and-set of one KV key) `pull_inbox` (a pull consumer's messages, held or no-wait, on an inbox of its own) and `scan` (many of a stream's messages, headers only, a bounded batch per pull). Only
`_fastpath` touches nats-py's private names; it checks nats-py's version at import and the rest
falls back to nats-py's public API without it (see `asyncinfer.nats._fastpath`).

Absolute imports inside this package still reach nats-py as `nats`.
"""

from __future__ import annotations

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import (
    BadHeaderError,
    BadSubjectError,
    ConnectionReconnectingError,
    NoRespondersError,
    StaleConnectionError,
    UnexpectedEOF,
)
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext, api
from nats.js.api import DeliverPolicy
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    InvalidKeyError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.errors import Error as JetStreamError
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE, KeyValue
from nats.js.object_store import (
    OBJ_ALL_META_PRE_TEMPLATE,
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DEFAULT_CHUNK_SIZE,
    OBJ_DIGEST_TEMPLATE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
)
from nats.nuid import NUID

__all__ = [
    "KV_DEL",
    "KV_MARKER_REASON",
    "KV_OP",
    "KV_PURGE",
    "NUID",
    "OBJ_ALL_META_PRE_TEMPLATE",
    "OBJ_CHUNKS_PRE_TEMPLATE",
    "OBJ_DEFAULT_CHUNK_SIZE",
    "OBJ_DIGEST_TEMPLATE",
    "OBJ_META_PRE_TEMPLATE",
    "OBJ_STREAM_TEMPLATE",
    "APIError",
    "BadHeaderError",
    "BadSubjectError",
    "BucketNotFoundError",
    "Client",
    "ConnectionReconnectingError",
    "DeliverPolicy",
    "InvalidKeyError",
    "JetStreamContext",
    "JetStreamError",
    "KeyDeletedError",
    "KeyNotFoundError",
    "KeyValue",
    "KeyWrongLastSequenceError",
    "Msg",
    "NatsError",
    "NatsTimeoutError",
    "NoRespondersError",
    "NoStreamResponseError",
    "NotFoundError",
    "ServiceUnavailableError",
    "StaleConnectionError",
    "Subscription",
    "UnexpectedEOF",
    "api",
]
