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

`--ttl-marker`: the same with no purge request of ours. A Limits stream with per-message TTLs,
subject delete markers and one message a subject (SubjectDeleteMarkerTTL, MaxMsgsPerSubject 1: as
the jobs and models buckets have); w.a.2 carries `Nats-TTL: 1s` and the AckWait is 3 s. When w.a.2
expires the server places its delete marker, which carries `Nats-Rollup: sub`, and the rollup is
the same subject purge (stream.go `processJetStreamMsgWithRollup` -> `purgeLocked`): A is stranded
as well (in a Limits stream it stays stored, acked by no one, never delivered again). Without
markers (a plain TTL removal, `--ttl-plain`) the expired delivery is let go of as a term and A
comes back.

    .venv/bin/python -m bench.nats_purge_strands                # exits 1 when the message is stranded
    .venv/bin/python -m bench.nats_purge_strands --ttl-marker   # the server's own marker, no purge of ours
    .venv/bin/python -m bench.nats_purge_strands --ttl-plain    # a TTL without markers: not stranded
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

import nats
from nats.js import api

from asyncinfer.embedded_nats import NatsServerProcess


async def main(case: str) -> int:
    server = NatsServerProcess(store_dir=Path(tempfile.mkdtemp(prefix="purge-strands-")))
    server.start()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        ack_wait_s = 1 if case == "purge" else 3  # with TTLs: past the 1.6 s wait for w.a.2's expiry
        if case == "purge":
            await js.add_stream(name="W", subjects=["w.>"], retention=api.RetentionPolicy.WORK_QUEUE)
        else:
            stream_config = api.StreamConfig(name="W", subjects=["w.>"], allow_msg_ttl=True, max_msgs_per_subject=1)
            if case == "ttl-marker":
                stream_config.subject_delete_marker_ttl = 60.0
            await js.add_stream(stream_config)
        await js.add_consumer(
            "W",
            api.ConsumerConfig(
                durable_name="c",
                ack_policy=api.AckPolicy.EXPLICIT,
                ack_wait=ack_wait_s,
                max_deliver=-1,
                filter_subject="w.a.>",
            ),
        )
        for k in (1, 2, 3):
            ttl = {"Nats-TTL": "1s"} if k == 2 and case != "purge" else None
            await js.publish(f"w.a.{k}", b"x", headers=ttl)
        sub = await js.pull_subscribe_bind("c", "W")
        _a, _p, x = await sub.fetch(3, timeout=2)
        if case == "purge":
            await js.purge_stream("W", subject="w.a.2")
        else:
            await asyncio.sleep(1.6)  # w.a.2's TTL ends (with markers: its marker, a rollup, purges it)
        await x.ack_sync()
        await asyncio.sleep(ack_wait_s + 0.5)  # AckWait: checkPending runs
        stream = await js.stream_info("W")
        consumer = await js.consumer_info("W", "c")
        print(
            f"stream: {stream.state.messages} message(s), first seq {stream.state.first_seq}; consumer: ack floor "
            f"{consumer.ack_floor.stream_seq if consumer.ack_floor else None}, ack pending {consumer.num_ack_pending}, "
            f"pending {consumer.num_pending}"
        )
        again = []
        try:
            while True:  # with markers the marker itself (seq 4) is delivered too
                got = (await sub.fetch(1, timeout=2))[0]
                again.append(got.metadata.sequence.stream)
                await got.ack_sync()
        except nats.errors.TimeoutError:
            pass
        stranded = 1 not in again
        if again:
            print(f"delivered again: stream seq(s) {again}")
        if stranded:
            print("seq 1 is in the stream below the ack floor and never delivered again: stranded")
        await nc.close()
        return 1 if stranded else 0
    finally:
        server.stop()


if __name__ == "__main__":
    cases = {"--ttl-marker": "ttl-marker", "--ttl-plain": "ttl-plain"}
    sys.exit(asyncio.run(main(cases.get(sys.argv[1], "purge") if len(sys.argv) > 1 else "purge")))
