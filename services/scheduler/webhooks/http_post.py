"""The webhook sender's HTTP POST, on aiohttp, so that the request goes to the address that was
vetted (never one resolved again behind our back) and nothing is done that a webhook must not do:
redirects are never followed (a 3xx is just a status), no proxies from the environment, no
cookies, no connection reuse (a kept connection would skip the next attempt's vetting).

The pinning: the session's resolver answers every lookup with the address the caller vetted for
this request (a context variable set around the request, so one session serves every attempt),
with no DNS cache, and refuses a lookup that has none. The request still names the URL's host
(Host header, TLS SNI and the certificate check). Only the status and headers are read (bounded);
the body is ignored and the connection closed. `bench/webhook_post_bench.py` measures it against
the hand-written asyncio-streams client it replaced (bench/results/webhook_post.md).
"""

from __future__ import annotations

import contextvars
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from asyncinfer.webhook_urls import CallbackUrl, IPAddress

USER_AGENT = "asyncinfer-webhooks/1"
MAX_HEADER_LINE_BYTES = 8 * 1024
MAX_HEADER_LINES = 100

# The vetted address of the request being made in this task (and the tasks it starts).
_PINNED: contextvars.ContextVar[IPAddress | None] = contextvars.ContextVar("webhook_address", default=None)


class HttpFailure(Exception):
    """No usable response: connection refused, TLS failure, timeout, malformed answer."""


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    headers: Mapping[str, str]  # names lower-cased; a repeated header keeps its last value


class PinnedResolver(AbstractResolver):
    """Resolves every host to the address vetted for the current request; never asks DNS."""

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        address = _PINNED.get()
        if address is None:
            raise OSError(f"no vetted address for {host}: webhook requests go only to vetted addresses")
        return [
            ResolveResult(
                hostname=host,
                host=str(address),
                port=port,
                family=socket.AF_INET6 if address.version == 6 else socket.AF_INET,
                proto=0,
                flags=socket.AI_NUMERICHOST,
            )
        ]

    async def close(self) -> None:
        return None


class WebhookHttp:
    """One aiohttp session for every attempt (made on first use, in the running loop); close it."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._default_tls: ssl.SSLContext | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(resolver=PinnedResolver(), use_dns_cache=False, force_close=True, limit=0)
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,  # no proxies from the environment
                auto_decompress=False,
                skip_auto_headers=("Accept", "Accept-Encoding"),
                max_line_size=MAX_HEADER_LINE_BYTES,
                max_field_size=MAX_HEADER_LINE_BYTES,
                max_headers=MAX_HEADER_LINES,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(
        self,
        url: CallbackUrl,
        address: IPAddress,
        *,
        headers: Mapping[str, str],
        body: bytes,
        timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
    ) -> HttpResponse:
        """POSTs `body` to `url` over a connection to `address`; the status and headers of the
        answer. Raises HttpFailure when no answer came within timeout_s."""
        session = self._open()
        tls: ssl.SSLContext | bool = True
        if url.tls:
            if ssl_context is None and self._default_tls is None:
                self._default_tls = ssl.create_default_context()
            tls = ssl_context or self._default_tls or True
        request_headers = {"User-Agent": USER_AGENT, "Content-Type": "application/json", **headers}
        token = _PINNED.set(address)
        try:
            async with session.post(
                URL(f"{url.scheme}://{url.host_header}{url.target}", encoded=True),
                data=body,
                headers=request_headers,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                ssl=tls,
            ) as response:
                return HttpResponse(status=response.status, headers={k.lower(): v for k, v in response.headers.items()})
        except TimeoutError:  # asyncio's, and aiohttp's timeouts derive from it
            raise HttpFailure(f"no answer within {timeout_s:g} s") from None
        except (aiohttp.ClientSSLError, ssl.SSLError) as exc:
            raise HttpFailure(f"TLS failed: {getattr(exc, 'reason', None) or exc}") from None
        except aiohttp.ClientConnectorError as exc:
            raise HttpFailure(f"cannot connect: {exc.os_error.strerror or exc.os_error}") from None
        except (aiohttp.ClientResponseError, aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            raise HttpFailure(f"malformed response: {exc}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise HttpFailure(f"no usable response: {exc}") from None
        finally:
            _PINNED.reset(token)


async def post(
    url: CallbackUrl,
    address: IPAddress,
    *,
    headers: Mapping[str, str],
    body: bytes,
    timeout_s: float,
    ssl_context: ssl.SSLContext | None = None,
) -> HttpResponse:
    """One POST on a session of its own (for a caller without a WebhookHttp to keep)."""
    http = WebhookHttp()
    try:
        return await http.post(url, address, headers=headers, body=body, timeout_s=timeout_s, ssl_context=ssl_context)
    finally:
        await http.close()
