"""One versioned codec per stored type: what NATS holds, as msgspec Structs (the wire forms),
converted to and from the domain's frozen dataclasses in one place per type. The record's and the
envelope's are here (every job writes them, on every service); the smaller ones sit at the end of
the module of their domain type (the table below), which keeps imports free of cycles.

The encoding is JSON, so `nats kv get` and `nats stream view` stay readable; msgspec writes bytes
(tensor data) as base64 itself, as the hand-written encoders before it did, so today's payloads
and the unversioned ones before them are the same shape.

Versions. Every wire form has `v` (its first field). The unversioned payloads written before
these codecs have none, which reads as version 0; version 1 is version 0's fields plus `v`, with
default values left out. The decoders read both, so a rolling upgrade can run old and new
processes side by side; and the previous release's readers read what these encoders write
(tests/test_codecs.py runs them, copied verbatim): where they refuse a field they do not know
(queue snapshots, cancel notices, webhook deliveries) the encoder still writes version 0, and a
later release moves to version 1 once that one is gone. A later version may add fields with
defaults (these readers ignore fields they do not know, and fill in the defaults when reading an
older payload); any other change bumps `v`, and the decoder then reads each version it knows.

Decode errors are `msgspec.DecodeError`s (a ValueError, which every caller already catches).

| stored type | codec |
|---|---|
| job record (jobs bucket) | `asyncinfer.codecs.record` |
| work envelope (WORK stream) | `asyncinfer.codecs.envelope` |
| queue snapshot, pause, tenant count (queues bucket); cancel notice | `asyncinfer.queues` |
| webhook delivery status (webhooks bucket) | `asyncinfer.webhook_status` |
| queued notice (core NATS, a hint, never stored: not versioned) | `asyncinfer.queued_notice` |
| dead letter (DEAD_LETTERS stream) | `services.scheduler.dead_letters` (its domain type is the scheduler's) |
| webhook delivery (WEBHOOKS stream) | `services.scheduler.webhooks.deliveries` |
| idempotency claim (idempotency bucket) | `services.gateway.claims` |

Object Store metas (the blobs bucket) are NATS's own format (`ObjectInfo`), not ours.
"""
