"""The webhook sender's HTTP POST (services/scheduler/webhooks/http_post.py, as the sender holds
it: one WebhookHttp for every attempt) against a loopback receiver: one attempt is one connection (no reuse, as a webhook to a vetted address must be), so
this measures the client's cost per attempt, sequentially (latency) and with many in flight.

    .venv/bin/python bench/webhook_post_bench.py [--label NAME] [--posts 2000] [--concurrency 64]

The receiver is a minimal asyncio HTTP/1.1 server in this process (read the head and the body,
answer 204, close), so client and server share one core's event loop: read the figures as
relative, beside the load average printed with them. Appends a row to bench/results/webhook_post.md.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import statistics
import time
from pathlib import Path

from asyncinfer.webhook_urls import parse_callback_url
from services.scheduler.webhooks.http_post import WebhookHttp

RESULTS = Path(__file__).resolve().parent / "results" / "webhook_post.md"
BODY = b'{"type":"job.succeeded","timestamp":"2026-01-01T00:00:00Z","data":{"job_id":"0190b8e4"}}' * 4
HEADERS = {"webhook-id": "msg_1", "webhook-timestamp": "1767225600", "webhook-signature": "v1,abc="}


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
        await writer.drain()
    finally:
        writer.close()


async def run(posts: int, concurrency: int) -> dict[str, float]:
    server = await asyncio.start_server(serve, "127.0.0.1", 0, backlog=1024)
    port = server.sockets[0].getsockname()[1]
    url = parse_callback_url(f"http://hooks.example:{port}/hook")
    address = ipaddress.ip_address("127.0.0.1")
    http = WebhookHttp()  # as the sender holds it: one for every attempt

    async def one() -> float:
        started = time.perf_counter()
        response = await http.post(url, address, headers=HEADERS, body=BODY, timeout_s=10.0)
        assert response.status == 204, response
        return time.perf_counter() - started

    for _ in range(50):  # warm up
        await one()
    sequential = [await one() for _ in range(min(posts, 500))]
    gate = asyncio.Semaphore(concurrency)

    async def gated() -> float:
        async with gate:
            return await one()

    started = time.perf_counter()
    await asyncio.gather(*(gated() for _ in range(posts)))
    elapsed = time.perf_counter() - started
    await http.close()
    server.close()
    await server.wait_closed()
    return {
        "p50_ms": statistics.median(sequential) * 1e3,
        "p99_ms": statistics.quantiles(sequential, n=100)[98] * 1e3,
        "sequential_per_s": len(sequential) / sum(sequential),
        "concurrent_per_s": posts / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="current")
    parser.add_argument("--posts", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the best of each figure is kept")
    args = parser.parse_args()
    rounds = [asyncio.run(run(args.posts, args.concurrency)) for _ in range(args.rounds)]
    best = {
        "p50_ms": min(r["p50_ms"] for r in rounds),
        "p99_ms": min(r["p99_ms"] for r in rounds),
        "sequential_per_s": max(r["sequential_per_s"] for r in rounds),
        "concurrent_per_s": max(r["concurrent_per_s"] for r in rounds),
    }
    load = os.getloadavg()[0]
    row = (
        f"| {args.label} | {best['p50_ms']:.2f} | {best['p99_ms']:.2f} | {best['sequential_per_s']:,.0f} | "
        f"{best['concurrent_per_s']:,.0f} | {load:.2f} |"
    )
    print(row)
    if not RESULTS.exists():
        RESULTS.write_text(
            "# Webhook POST: the sender's HTTP client per attempt (bench/webhook_post_bench.py)\n\n"
            f"{args.posts} posts at {args.concurrency} in flight, 500 sequential; best of {args.rounds} rounds; "
            "one connection per attempt; receiver in the same process.\n\n"
            "| client | sequential p50 ms | sequential p99 ms | sequential posts/s | concurrent posts/s | load (1 min) |\n"
            "|---|---|---|---|---|---|\n"
        )
    with RESULTS.open("a") as results:
        results.write(row + "\n")


if __name__ == "__main__":
    main()
