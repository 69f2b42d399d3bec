"""The smallest reproduction of a work message stranded below its consumer's ack floor
(docs/ARCHITECTURE.md, "Work messages stranded below their consumer's ack floor").

A subject-filtered purge of one message that a consumer with a wider filter holds delivered makes
nats-server (2.15.1 here; consumer.go `purge(sseq, slseq, isWider)`) drop that pending delivery and
raise the consumer's delivered-sequence ack floor (`adflr`) to its delivery sequence, past the
deliveries still pending below it. The next ack whose delivery sequence is `adflr+1` then moves the
stream-sequence ack floor (`asflr`) to its own message, above the older pending ones; the AckWait
timer (`checkPending`) drops every pending entry at or below the floor without acking it, and in a
WorkQueue stream the message stays, never delivered again: 0 ack pending, 0 pending.

Protocol operations (stream W, WorkQueue, subjects w.>; durable pull consumer c, filter w.a.>,
AckExplicit, AckWait 1 s):

    PUB w.a.1, w.a.2, w.a.3                      -> stream seqs 1, 2, 3
    PUB $JS.API.CONSUMER.MSG.NEXT.W.c {"batch":3} -> A(1, dseq 1), P(2, dseq 2), X(3, dseq 3)
    PUB $JS.API.STREAM.PURGE.W {"filter":"w.a.2"} -> P gone; adflr 0 -> 2 (A's dseq 1 skipped)
    PUB $JS.ACK.W.c.1.3.3.<ts>.0 +ACK             -> dseq 3 == adflr+1: asflr = 3, above A
    (AckWait passes: checkPending drops A, seq 1 <= asflr, from pending, not from the stream)

In the soak the purge is a CancelJob's (asyncinfer.job_store.JobStore.drop_work_message, by the
job's own subject) while its queue's consumer holds other jobs' deliveries.

    .venv/bin/python -m bench.nats_purge_strands     # exits 1 when the message is stranded
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import nats
from nats.js import api

from asyncinfer.embedded_nats import NatsServerProcess


async def main() -> int:
    server = NatsServerProcess(store_dir=Path(tempfile.mkdtemp(prefix="purge-strands-")))
    server.start()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(name="W", subjects=["w.>"], retention=api.RetentionPolicy.WORK_QUEUE)
        await js.add_consumer(
            "W",
            api.ConsumerConfig(
                durable_name="c",
                ack_policy=api.AckPolicy.EXPLICIT,
                ack_wait=1,
                max_deliver=-1,
                filter_subject="w.a.>",
            ),
        )
        for k in (1, 2, 3):
            await js.publish(f"w.a.{k}", b"x")
        sub = await js.pull_subscribe_bind("c", "W")
        _a, _p, x = await sub.fetch(3, timeout=2)
        await js.purge_stream("W", subject="w.a.2")
        await x.ack_sync()
        await asyncio.sleep(1.5)  # AckWait: checkPending runs
        stream = await js.stream_info("W")
        consumer = await js.consumer_info("W", "c")
        print(
            f"stream: {stream.state.messages} message(s), first seq {stream.state.first_seq}; consumer: ack floor "
            f"{consumer.ack_floor.stream_seq if consumer.ack_floor else None}, ack pending {consumer.num_ack_pending}, "
            f"pending {consumer.num_pending}"
        )
        try:
            again = await sub.fetch(1, timeout=2)
            print(f"delivered again: stream seq {again[0].metadata.sequence.stream}")
            stranded = False
        except nats.errors.TimeoutError:
            print("seq 1 is in the stream below the ack floor and never delivered again: stranded")
            stranded = True
        await nc.close()
        return 1 if stranded else 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
