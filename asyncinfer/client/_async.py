"""`AsyncClient`: the asyncio client for the gateway's JobService, over grpc.aio.

Every call has a deadline: unary calls (submit, get, cancel, one page of list) take `timeout_s`,
defaulting to the client's `timeout_s` (30 s); calls that last as long as a job does (wait, watch,
bulk, upload, read_result) take `timeout_s` as their whole budget, defaulting to no limit.
`timeout_s` is seconds, 0 or more, or None: a negative one is a ValueError at the call (a watch's,
at its first step). 0 is a deadline already passed: DeadlineExceededError, nothing sent, as a zero
timeout is in gRPC and httpx (the OpenAI SDK's); not a poll of what is there (`get` is that).
UNAVAILABLE (and RESOURCE_EXHAUSTED, honouring the server's RetryInfo) is retried with
exponential backoff and jitter, within both the `RetryPolicy`'s attempts and the call's deadline.

`AsyncClient` is its parts, one module each, each building on those before it: `_async_channel`
(the channel, `close`, `_call` and its retries), `_async_jobs` (submit, get, get_jobs, models, cancel,
list), `_async_blobs` (upload, upload_inputs, delete_input, read_result, outputs), `_async_watch`
(watch, watch_jobs), `_async_wait` (wait, wait_jobs, run), `_async_bulk` (bulk) and `_async_batches`
(create_batch and the other batch methods).
"""

from __future__ import annotations

from asyncinfer.client._async_batches import BatchData, BatchFiles
from asyncinfer.client._async_blobs import UPLOAD_CHUNK_BYTES
from asyncinfer.client._async_bulk import BulkSubmits
from asyncinfer.client._async_channel import FORKED_AFTER_USE, JobLike, check_not_forked, tls_credentials
from asyncinfer.client._async_jobs import GET_JOBS_MAX_IDS, SUBMIT_JOBS_MAX_ITEMS, WATCH_JOBS_MAX_IDS
from asyncinfer.client._async_wait import JobWaits, run_interrupted_note, wait_interrupted_note
from asyncinfer.client._async_watch import watch_given_up_note

# What this module gave before AsyncClient's parts moved to the _async_* modules, still importable from here.
__all__ = [
    "FORKED_AFTER_USE",
    "GET_JOBS_MAX_IDS",
    "SUBMIT_JOBS_MAX_ITEMS",
    "UPLOAD_CHUNK_BYTES",
    "WATCH_JOBS_MAX_IDS",
    "AsyncClient",
    "BatchData",
    "JobLike",
    "check_not_forked",
    "run_interrupted_note",
    "tls_credentials",
    "wait_interrupted_note",
    "watch_given_up_note",
]


class AsyncClient(JobWaits, BulkSubmits, BatchFiles):
    """An asyncio client for one gateway.

    >>> async with AsyncClient("127.0.0.1:50051", api_key="...") as client:
    ...     job = await client.submit("demo", {"x": np.ones((1, 4), np.float32)})
    ...     done = await client.wait(job)
    ...     done.outputs["y"]

    Make it inside a running event loop (a coroutine): grpc.aio binds the channel to the loop
    current at creation. The blocking `Client` has no such rule.

    `target` is a gRPC target ("host:port", "[::1]:50051", "dns:///gateway:50051", "unix:/path"; a
    host alone is port 443, gRPC's default); one gRPC can never reach (a port that is not a number
    from 1 to 65535, no host, an unclosed '[') is a ValueError here. `credentials` switches to
    TLS (`grpc.ssl_channel_credentials()`); so do `tls_ca_file` (PEM CA bundle that verifies the
    gateway) and `tls_cert_file` with `tls_key_file` (a client certificate, for a gateway that
    requires mutual TLS). `api_key` is sent as `authorization: Bearer <key>`. While a call is in
    flight the client pings the gateway every `keepalive_s` (None: never), so a call on a connection
    that died silently (the gateway's host lost, a NAT that dropped the flow) ends UNAVAILABLE within
    twice that (and a watch resumes, as after any break) instead of waiting for ever;
    `channel_options` go before the client's own (gRPC takes the first of a name).
    The client owns one channel; `close()` it (or use `async with`).
    """
