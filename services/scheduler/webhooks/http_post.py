"""A minimal HTTP/1.1 POST for webhooks, on asyncio streams, so that the request goes to the
address that was vetted (never one resolved again behind our back) and nothing is done that a
webhook must not do: redirects are never followed (a 3xx is just a status), no proxies from the
environment, no cookies, no connection reuse.

The request names the URL's host (Host header, TLS SNI and certificate check via server_hostname)
while the TCP connection goes to the given address. Only the status line and headers are read
(bounded); the body is ignored and the connection closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

from asyncinfer.webhook_urls import CallbackUrl, IPAddress

USER_AGENT = "asyncinfer-webhooks/1"
MAX_HEADER_LINE_BYTES = 8 * 1024
MAX_HEADER_LINES = 100
CLOSE_TIMEOUT_S = 1.0


class HttpFailure(Exception):
    """No usable response: connection refused, TLS failure, timeout, malformed answer."""


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    headers: Mapping[str, str]  # names lower-cased; a repeated header keeps its last value


def _request(url: CallbackUrl, headers: Mapping[str, str], body: bytes) -> bytes:
    lines = [
        f"POST {url.target} HTTP/1.1",
        f"Host: {url.host_header}",
        f"User-Agent: {USER_AGENT}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


async def _read_head(reader: asyncio.StreamReader) -> HttpResponse:
    while True:
        status_line = (await reader.readline()).decode("latin-1").rstrip("\r\n")
        version, _, rest = status_line.partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise HttpFailure(f"not an HTTP/1.x response: {status_line[:80]!r}")
        headers: dict[str, str] = {}
        for _ in range(MAX_HEADER_LINES):
            line = (await reader.readline()).decode("latin-1").rstrip("\r\n")
            if not line:
                break
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        else:
            raise HttpFailure(f"more than {MAX_HEADER_LINES} response headers")
        status = int(code)
        if 100 <= status < 200:  # interim (100 Continue): the final answer follows
            continue
        return HttpResponse(status=status, headers=headers)


async def post(
    url: CallbackUrl,
    address: IPAddress,
    *,
    headers: Mapping[str, str],
    body: bytes,
    timeout_s: float,
    ssl_context: ssl.SSLContext | None = None,
) -> HttpResponse:
    """POSTs `body` to `url` over a connection to `address`; the status and headers of the answer.
    Raises HttpFailure when no answer came within timeout_s."""
    context = (ssl_context or ssl.create_default_context()) if url.tls else None
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(
                host=str(address),
                port=url.port,
                ssl=context,
                server_hostname=url.host if context is not None else None,
                limit=MAX_HEADER_LINE_BYTES,
            )
            writer.write(_request(url, headers, body))
            await writer.drain()
            return await _read_head(reader)
    except TimeoutError:
        raise HttpFailure(f"no answer within {timeout_s:g} s") from None
    except ssl.SSLError as exc:
        raise HttpFailure(f"TLS failed: {exc.reason or exc}") from None
    except (ValueError, asyncio.LimitOverrunError, asyncio.IncompleteReadError) as exc:
        raise HttpFailure(f"malformed response: {exc}") from None
    except OSError as exc:
        raise HttpFailure(f"cannot connect: {exc.strerror or exc}") from None
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await writer.wait_closed()
