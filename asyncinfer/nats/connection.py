"""Connecting to NATS: reconnects without limit once connected, and a first connect that gives up.

nats-py has one setting for both: with unlimited reconnect attempts it retries the *first*
connect forever too, so a wrong URL would hang start-up. Here the client is connected with
unlimited attempts, and the first connect is abandoned once it has failed FIRST_CONNECT_ATTEMPTS
times per server (nats-py reports each failed attempt to the error callback; each is bounded by
`connect_timeout_s`), which raises Unavailable. A server whose TLS certificate cannot be
verified is given up on at its first failure (retrying cannot fix it, and nats-py's later attempts
may not report at all), and the whole first connect is bounded by a deadline besides.

With `nats.first_connect_wait_s` (60 s by default; `up` sets 0), a first connect that fails for
want of a server keeps trying until that long has passed (and the attempts are spent): a service
started before NATS answers (start order, a NATS restart during a deploy, a pod before the NATS
StatefulSet) waits for it rather than exiting 69 (into CrashLoopBackOff, on Kubernetes). Refused credentials and a TLS
failure still give up at once: waiting does not change them, and neither does a TLS setting that the
server's greeting (its INFO) shows to be wrong for it: a server that requires client certificates, to
a client without one (the server's alert at the handshake's end was often read as a broken pipe or a
lost connection, an outage to wait for), or a server without TLS, to a client configured for it
(found before anything is sent: nats-py connected in plaintext). A client certificate that such a
server refuses, its alert read as a broken connection, gives up at the second attempt in a row
to end so (a server that is down greets none). See Greetings.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import weakref
from collections.abc import Mapping
from typing import Any

import structlog
from nats.aio.client import Client
from nats.errors import AuthorizationError, UnexpectedEOF
from nats.errors import Error as NatsError

from asyncinfer.config import NatsConfig
from asyncinfer.errors import ConfigError, Unavailable
from asyncinfer.log_throttle import Throttle
from asyncinfer.nats import _fastpath
from asyncinfer.nats_users import INBOX_PREFIXES
from asyncinfer.tls import ClientCertificates, client_ssl_context, read_secret, warn_if_exposed

log = structlog.get_logger("asyncinfer.nats")

FIRST_CONNECT_ATTEMPTS = 3
RECONNECT_WAIT_S = 0.5
ABANDON_WAIT_S = 2.0
ERROR_LOG_INTERVAL_S = 10.0
REPLIES_CHECK_TIMEOUT_S = 10  # nats-py types it an int
PERMISSIONS_VIOLATION = "permissions violation"  # nats-py's wording of the server's -ERR, any case
MAX_VIOLATIONS_KEPT = 16
CLOSES_THAT_REFUSE = 2  # attempts in a row closed after the handshake, a certificate presented: refused


class TlsMismatch(NatsError):
    """What a server's greeting shows this configuration's TLS cannot do (a server verifying client
    certificates, and none configured; a server without TLS): a configuration error (exit 2) once
    the first connect gives up, which it does at once."""


class ConnectionChanges:
    """Wakes whoever waits on `next()` at the client's next change of connection (lost, or back):
    a dispatcher whose pulls are held open waits on it instead of looking at the connection every
    second (a wake-up per model a second: 100 a second in a scheduler of 100 idle models)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def next(self) -> asyncio.Event:
        return self._event

    def fire(self) -> None:
        fired, self._event = self._event, asyncio.Event()
        fired.set()


_changes: weakref.WeakKeyDictionary[Client, ConnectionChanges] = weakref.WeakKeyDictionary()


_certificates: weakref.WeakKeyDictionary[Client, ClientCertificates[ssl.SSLContext]] = weakref.WeakKeyDictionary()


def client_certificates(client: Client) -> ClientCertificates[ssl.SSLContext] | None:
    """The TLS files of a client made by `connect` (None: no TLS): a service's expiry gauge
    listens to their renewals."""
    return _certificates.get(client)


def connection_changes(client: Client) -> ConnectionChanges:
    """The client's ConnectionChanges (a client made by `connect`; another never fires)."""
    return _changes.setdefault(client, ConnectionChanges())


async def connect(config: NatsConfig, *, name: str) -> Client:
    """Connects with reconnects on; Unavailable if the server cannot be reached at all."""
    servers = [u.strip() for u in config.url.split(",") if u.strip()]
    shown = url_without_credentials(config.url)  # what the errors below say of the URL
    logs_in_by_url = shown != ",".join(u.strip() for u in config.url.split(","))
    tls = tls_certificates(config)
    client = Client()
    if tls is not None:
        _certificates[client] = tls
    greetings = Greetings(config, wants_tls=tls is not None)
    _fastpath.vet_greetings(client, greetings.vet, wants_tls=tls is not None)
    if _fastpath.FASTPATH_ENABLED:
        _fastpath.closed_transport_errors(client)
        _fastpath.abandoned_pongs_skipped(client)
        _fastpath.larger_reads()
        _fastpath.quiet_flow_control_checks()
        _fastpath.close_replaced_connections()
    first_connect_failures: list[Exception] = []
    violations: list[str] = []  # the server's latest permissions violations, as nats-py words them
    connected = False
    gave_up = asyncio.Event()
    abandoned = asyncio.Event()  # this first connect is given up: what its close stirs up is not news

    attempts = FIRST_CONNECT_ATTEMPTS * max(1, len(servers))
    # nats.first_connect_wait_s: the first connect gives up once the attempts are spent and this
    # much time has passed, saying that it waits in one line every ERROR_LOG_INTERVAL_S meanwhile
    # (its failures at debug: one a RECONNECT_WAIT_S per server).
    loop = asyncio.get_running_loop()
    started = loop.time()
    wait_s = config.first_connect_wait_s
    waiting = Throttle(ERROR_LOG_INTERVAL_S)
    waited_out = 0  # the failures while waiting (first_connect_failures keeps the latest alone)
    # A server that is away is tried every RECONNECT_WAIT_S, each failure an error: one warning per
    # kind every ERROR_LOG_INTERVAL_S (the rest at debug), not one a second for as long as it is away
    # (~35 lines under `up` after its nats-server died, below the one line saying so).
    errors = Throttle(ERROR_LOG_INTERVAL_S)

    async def on_error(exc: Exception) -> None:
        exc = greetings.read(exc)
        if PERMISSIONS_VIOLATION in str(exc).lower():
            violations.append(str(exc))
            del violations[:-MAX_VIOLATIONS_KEPT]
        if gave_up.is_set() and not connected:
            # An attempt's failure can be told twice (a lost connection, then the TLS alert behind
            # it): the first gave up, and its caller says why.
            log.debug("nats_error", error=str(exc))
            return
        if not connected and greetings.refusal_suspected:
            log.debug("nats_error", error=str(exc))  # tried again: a second close after the handshake refuses
            return
        final = isinstance(exc, ssl.SSLError | TlsMismatch) or _login_refused(exc)  # waiting will not change it
        if not connected and wait_s > 0 and not final and not abandoned.is_set():
            nonlocal waited_out
            waited_out += 1
            first_connect_failures.append(exc)
            del first_connect_failures[:-attempts]  # a failure a RECONNECT_WAIT_S per server, for minutes
            waited_s = loop.time() - started
            if waited_out >= attempts and waited_s >= wait_s:
                gave_up.set()  # its caller says why, in the line that gives up
                log.debug("nats_error", error=str(exc))
                return
            held = waiting.allow("waiting")
            if held is None:
                log.debug("nats_error", error=str(exc))
            else:
                log.warning(
                    "nats_waiting_for_server",
                    url=shown,
                    error=_explain(exc),
                    waited_s=round(waited_s, 1),
                    gives_up_after_s=wait_s,
                    **({"attempts_since_last": held} if held else {}),
                )
            return
        held = errors.allow(str(exc))
        if abandoned.is_set():
            log.debug("nats_error", error=str(exc))
            return
        if (
            held is None
            or (connected and isinstance(exc, UnexpectedEOF))
            or (not connected and isinstance(exc, TlsMismatch))
        ):
            # (The server closed the connection: nats_disconnected, next, says so once. A first
            # connect's TlsMismatch: the ConfigError that ends it says so.)
            log.debug("nats_error", error=str(exc))
        else:
            log.warning("nats_error", error=str(exc), **({"more_since_last": held} if held else {}))
        if not connected:
            first_connect_failures.append(exc)
            if len(first_connect_failures) >= attempts or final:
                gave_up.set()
        elif tls is not None and not client.is_connected and not client.is_closed:
            # A reconnect that failed (the server away, or refusing a certificate that expired
            # during the outage): the next try, after this callback, presents one renewed meanwhile.
            _fastpath.use_tls_context(client, await asyncio.to_thread(tls.current))

    def changed() -> None:
        changes = _changes.get(client)
        if changes is not None:
            changes.fire()

    async def on_disconnected() -> None:
        changed()
        if client.is_closed:  # our own close() (nats-py marks it closed before calling back): no news
            log.debug("nats_closed")
            return
        if not connected:  # a first connect that failed or was abandoned: its caller says what happened
            log.debug("nats_disconnected_while_connecting")
            return
        log.warning("nats_disconnected")
        if tls is not None:
            # nats-py reads options["tls"] at each connect, and awaits this callback before it
            # reconnects (on_error after each failed try): a certificate renewed on disk is
            # presented from this reconnect. A context of its own, never one changed under a
            # connection: load_cert_chain into the live context would leave it half-loaded if
            # the key turned out not to match.
            _fastpath.use_tls_context(client, await asyncio.to_thread(tls.current))

    async def on_reconnected() -> None:
        changed()
        greetings.settled()
        log.info("nats_reconnected")

    options: dict[str, Any] = {
        "servers": servers,
        "name": name,
        "connect_timeout": config.connect_timeout_s,
        # A node that hangs (SIGSTOP, a stalled disk, a partition) closes nothing: only unanswered
        # pings tell. With nats-py's 120 s x 2, every service on a hung node stopped for as long as
        # it hung (60 s in the failover pass, while the other two nodes served).
        "ping_interval": config.ping_interval_s,
        "max_outstanding_pings": config.max_outstanding_pings,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": RECONNECT_WAIT_S,
        "allow_reconnect": True,
        "error_cb": on_error,
        "disconnected_cb": on_disconnected,
        "reconnected_cb": on_reconnected,
        "inbox_prefix": config.inbox_prefix,
    }
    options.update(security_options(config))
    if tls is not None:
        options["tls"] = tls.current()
    connecting = asyncio.ensure_future(client.connect(**options))
    giving_up = asyncio.ensure_future(gave_up.wait())
    deadline_s = attempts * (config.connect_timeout_s + RECONNECT_WAIT_S) + config.connect_timeout_s + wait_s
    try:
        await asyncio.wait((connecting, giving_up), timeout=deadline_s, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await _abandon(client, connecting, abandoned)
        raise
    finally:
        giving_up.cancel()
    failed = connecting.done() and not connecting.cancelled() and connecting.exception() is not None
    seen = [*first_connect_failures, *([connecting.exception()] if failed else [])]
    if any(_login_refused(failure) for failure in seen):
        # The server is there and said no to these credentials: a configuration error (exit 2), not
        # an outage to wait out (exit 69 restarts it in a loop).
        await _abandon(client, connecting, abandoned)
        raise ConfigError(
            f"NATS at {shown} refused this connection's credentials (authorization violation): check "
            "nats.user and password(_file), token(_file), nkey_seed_file or credentials_file"
            + (", and the user:password@ or token@ in nats.url" if logs_in_by_url else "")
        )
    mismatch = next((failure for failure in seen if isinstance(failure, TlsMismatch)), None)
    if mismatch is not None:
        await _abandon(client, connecting, abandoned)
        raise ConfigError(f"cannot connect to NATS at {shown}: {mismatch}")
    if not connecting.done():
        await _abandon(client, connecting, abandoned)
        last = first_connect_failures[-1] if first_connect_failures else f"no answer within {deadline_s:g}s"
        if isinstance(last, ssl.SSLError):
            # A certificate this configuration cannot verify: waiting or restarting will not help
            # (a server exits 2 for it, 69 for a NATS that is not there yet).
            raise ConfigError(f"cannot connect to NATS at {shown}: {_explain(last)}")
        hint = _closed_hint(first_connect_failures, config)
        raise Unavailable(f"cannot connect to NATS at {shown}: {_explain(last)}{hint}")
    failure = connecting.exception()
    if failure is not None:  # nats raises several unrelated types here
        await _abandon(client, connecting, abandoned)
        raise Unavailable(f"cannot connect to NATS at {shown}: {failure}") from failure
    connected = True
    greetings.settled()
    if await _replies_refused(client, violations):
        await _abandon(client, connecting, abandoned)
        prefix = config.inbox_prefix
        prefixes = ", ".join(f"{service}: {inbox}" for service, inbox in INBOX_PREFIXES.items())
        raise ConfigError(
            f"NATS at {shown} does not let this user subscribe to its replies' subject {prefix}.> "
            f"(nats.inbox_prefix {prefix!r}), so no JetStream request of it could be answered. With the users "
            f"of `asyncinfer nats-users`, each service reads its own prefix alone: set nats.inbox_prefix "
            f"(ASYNCINFER_NATS__INBOX_PREFIX) to its service's ({prefixes}), with that service's own "
            "nats.nkey_seed_file"
        )
    return client


async def _replies_refused(client: Client, violations: list[str]) -> bool:
    """Whether the server refuses this connection a subscription to one of its own reply subjects.
    A user that may not read them (nats.inbox_prefix left at _INBOX for a user of
    asyncinfer.nats_users, or another service's seed) connected, and each JetStream request then
    waited for an answer that the server would not deliver: the service's start failed 30 s later
    with "JetStream did not answer", exit 69, as if NATS were away.

    The server answers a SUB before a PING that follows it. nats-py queues the SUB for its flusher
    task but writes a flush's PING straight to the socket, so the first PONG may come before the
    refusal (1 run in 3 here); the flusher, woken by the subscribe, has written the SUB by then, so
    the second flush's PING follows it and its PONG comes after the server's answer to it."""
    inbox = client.new_inbox()
    subscription = await client.subscribe(inbox)
    try:
        for _ in range(2):
            await client.flush(timeout=REPLIES_CHECK_TIMEOUT_S)
    except Exception as exc:  # a server too slow to answer now: the requests that follow will say
        log.debug("nats_replies_check_skipped", error=str(exc))
        return False
    finally:
        with contextlib.suppress(Exception):
            await subscription.unsubscribe()
    refused = f'subscription to "{inbox.lower()}"'
    return any(refused in violation.lower() for violation in violations)


def url_without_credentials(url: str) -> str:
    """`nats.url` as a message may show it: each server's `user:password@` or `token@` (which
    nats-py logs in with) replaced by `***@`. The errors of a failed connect end up in the
    service's log and on its stderr; they printed the password."""
    return ",".join(_server_without_credentials(server.strip()) for server in url.split(","))


def _server_without_credentials(server: str) -> str:
    scheme, separator, rest = server.partition("://")
    if not separator:  # nats-py takes "host:port" (and "user:pw@host:port") without a scheme
        scheme, rest = "", server
    end = min((at for at in (rest.find("/"), rest.find("?")) if at >= 0), default=len(rest))
    # The last '@' of the authority: a password may hold an unescaped one.
    _userinfo, at, host = rest[:end].rpartition("@")
    if not at:
        return server
    return f"{scheme}{separator}***@{host}{rest[end:]}"


async def _abandon(client: Client, connecting: asyncio.Future[None], abandoned: asyncio.Event) -> None:
    """Stops a first connect and releases what it holds. The connection is closed first: a connect
    cancelled while it waits for a silent server's INFO does not end until its socket does."""
    abandoned.set()
    connecting.cancel()
    with contextlib.suppress(Exception):
        async with asyncio.timeout(ABANDON_WAIT_S):
            await client.close()
    await asyncio.wait((connecting,), timeout=ABANDON_WAIT_S)  # its own cancellation is not ours to raise
    if connecting.done() and not connecting.cancelled() and connecting.exception() is not None:
        # Read, so asyncio does not log it ("Task exception was never retrieved", a traceback) when
        # the task is collected: a connect cut off by the close above (Ctrl-C while `up` started)
        # ends with an error of its closed transport, which is the abandon, not news.
        log.debug("nats_connect_abandoned", error=str(connecting.exception()))


async def disconnect(client: Client) -> None:
    """A service's last NATS step at its stop: drain (what it published is flushed, its
    subscriptions' messages handled), and close whatever the drain's outcome. A drain refused on a
    connection that is reconnecting (its server gone: `up`'s nats-server killed) left the client
    reconnecting, its tasks alive, and the process's exit, cancelling them, hung now and then (a
    cancellation nats-py's reconnect loop swallowed)."""
    if client.is_closed:
        return
    if client.is_connected:
        try:
            await client.drain()
        except Exception as exc:  # a connection lost meanwhile has nothing left to flush
            log.info("nats_drain_failed", error=str(exc))
    await close(client)


async def close(client: Client) -> None:
    """Closes the client (within ABANDON_WAIT_S), and with it a reconnect that outlived nats-py's
    own close (asyncinfer.nats._fastpath.end_reconnection): nothing of it runs or stays open after."""
    if not client.is_closed:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(ABANDON_WAIT_S):
                await client.close()
    if _fastpath.FASTPATH_ENABLED:
        await _fastpath.end_reconnection(client, ABANDON_WAIT_S)


class Greetings:
    """The INFO that greeted a connect attempt, until that attempt's failure is told (`read` in the
    error callback), and the check of it against this configuration's TLS."""

    def __init__(self, config: NatsConfig, *, wants_tls: bool) -> None:
        self._config = config
        self._wants_tls = wants_tls
        self._latest: Mapping[str, Any] = {}
        # Attempts in a row that a server verifying client certificates greeted and closed after the
        # handshake, this client presenting a certificate.
        self._closed_after_handshake = 0
        # The failure `read` last returned was the first of such a run: not an outage to wait for (a
        # line saying so), nor a refusal yet; the next attempt tells.
        self.refusal_suspected = False

    def vet(self, info: Mapping[str, Any]) -> None:
        """Before the attempt's TLS handshake and CONNECT: TlsMismatch for a server without TLS, to a
        client that requires it (nats-py would go on in plaintext)."""
        self._latest = info
        if self._wants_tls and not (info.get("tls_required") or info.get("tls_available")):
            raise TlsMismatch(
                "the server does not offer TLS, which this configuration requires (a tls:// nats.url, "
                "nats.tls_ca_file or nats.tls_cert_file): turn TLS on at the server (its tls block), or "
                "point nats.url at the server that has it"
            )

    def read(self, failure: Exception) -> Exception:
        """The attempt's failure as the operator acts on it, where its greeting said the server verifies
        client certificates (tls_verify). The server closes the connection at the handshake's end with an
        alert, which the client, writing its CONNECT meanwhile, read now and then as a lost connection or
        a broken pipe: an outage to wait for under nats.first_connect_wait_s. To a client without a
        certificate: TlsMismatch saying to set one. To a client with one, the second attempt in a row to
        end so (a server that greets each attempt and closes it after the handshake refuses this
        certificate; one that is down greets none): TlsMismatch naming its files. A server certificate
        this client cannot verify (the handshake's first check) is left to say so, and so is an alert read."""
        greeting, self._latest = self._latest, {}
        if not greeting:
            # An attempt told twice (a lost connection, then the alert behind it or a lost connection
            # again: no greeting left to read) is still the attempt it was; one that reached no server
            # (an outage) ends a run of closes.
            if isinstance(failure, _CLOSED):
                return failure
            self.refusal_suspected = False
            if not isinstance(failure, ssl.SSLError):
                self._closed_after_handshake = 0
            return failure
        self.refusal_suspected = False
        verifying = bool(greeting.get("tls_verify")) and not isinstance(failure, ssl.SSLCertVerificationError)
        if not self._config.tls_cert_file:
            if verifying and isinstance(failure, ssl.SSLError | _CLOSED):
                return TlsMismatch(
                    "the server requires a client certificate (nats-server tls { verify: true }): set "
                    "nats.tls_cert_file and nats.tls_key_file to one signed by the CA it verifies clients with"
                )
            return failure
        if not verifying or not isinstance(failure, _CLOSED):
            self._closed_after_handshake = 0
            return failure
        self._closed_after_handshake += 1
        if self._closed_after_handshake < CLOSES_THAT_REFUSE:
            self.refusal_suspected = True  # a server may have gone at that moment: the next attempt tells
            return failure
        return TlsMismatch(
            "the server closed the connection right after the TLS handshake, twice, having said that it verifies "
            "client certificates (nats-server tls { verify: true }): it refuses this one, nats.tls_cert_file (with "
            "nats.tls_key_file), most likely signed by another CA than the one it verifies clients with (its "
            "tls { ca_file }; nats.tls_ca_file is the CA this client verifies the server with), or expired"
        )

    def settled(self) -> None:
        """Connected: a later close after a handshake starts a run of its own."""
        self._closed_after_handshake = 0


# A connection that broke, as the client reads the server's close at the TLS handshake's end when it
# does not read the alert before it.
_CLOSED = BrokenPipeError | ConnectionResetError | UnexpectedEOF


def _login_refused(failure: BaseException | None) -> bool:
    """The server's -ERR 'Authorization Violation': nats-py makes it an AuthorizationError only
    when the text is lower case, and nats-server 2.x capitalises it (a plain nats Error)."""
    return isinstance(failure, AuthorizationError) or "authorization violation" in str(failure).lower()


# The server's TLS alerts about this client's own certificate (ssl.SSLError.reason), as an operator
# acts on them: they said "TLS failed ([SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] tlsv13 alert
# certificate required (_ssl.c:2580)); check nats.tls_ca_file, tls_cert_file and tls_key_file".
_CLIENT_CERTIFICATE_ALERTS = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "the server requires a client certificate (nats-server tls { verify: true }): "
    "set nats.tls_cert_file and tls_key_file to one signed by the CA it verifies clients with",
    "TLSV1_ALERT_UNKNOWN_CA": "the server does not trust this client's certificate (nats.tls_cert_file): it is not "
    "signed by the CA the server verifies clients with (its tls { ca_file })",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the server refused this client's certificate (nats.tls_cert_file): signed by "
    "another CA than the one it verifies clients with, expired, or not for client authentication",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the server refused this client's certificate (nats.tls_cert_file): it expired",
}


def _explain(failure: Exception | str) -> str:
    if isinstance(failure, ssl.SSLCertVerificationError):
        return (
            f"the server's TLS certificate cannot be verified ({failure.verify_message}); set nats.tls_ca_file "
            "to the CA that signed it"
        )
    if isinstance(failure, ssl.SSLError) and failure.reason in _CLIENT_CERTIFICATE_ALERTS:
        return f"{_CLIENT_CERTIFICATE_ALERTS[failure.reason]} ({failure.reason})"
    if isinstance(failure, ssl.SSLError):
        return f"TLS failed ({failure}); check nats.tls_ca_file, tls_cert_file and tls_key_file"
    return str(failure)


def _closed_hint(failures: list[Exception], config: NatsConfig) -> str:
    """What a connection closed under a TLS client without a certificate may mean. A server that
    requires client certificates closes the connection at the handshake's end with an alert; the
    client, writing its CONNECT meanwhile, often reads the alert, and now and then (3 connects in 30
    here) only a broken pipe, attempt after attempt."""
    tls = any(u.strip().startswith("tls://") for u in config.url.split(",")) or config.tls_ca_file
    if not tls or not any(isinstance(failure, BrokenPipeError | ConnectionResetError) for failure in failures):
        return ""
    if config.tls_cert_file:
        return (
            "; if the server verifies client certificates (nats-server tls { verify: true }), nats.tls_cert_file "
            "must be signed by the CA it verifies them with"
        )
    return (
        "; if the server requires client certificates (nats-server tls { verify: true }), set nats.tls_cert_file "
        "and tls_key_file"
    )


def tls_certificates(config: NatsConfig) -> ClientCertificates[ssl.SSLContext] | None:
    """The connection's SSL context, from files read now (ConfigError names a bad one) and again
    for a reconnect after they changed; None: no TLS. TLS is on when a CA or client certificate is
    configured or a URL says tls://."""
    wants_tls = any(u.strip().startswith("tls://") for u in config.url.split(","))
    if not (wants_tls or config.tls_ca_file or config.tls_cert_file):
        return None
    files = [
        (f"nats.{name}", path)
        for name, path in (
            ("tls_ca_file", config.tls_ca_file),
            ("tls_cert_file", config.tls_cert_file),
            ("tls_key_file", config.tls_key_file),
        )
        if path
    ]
    return ClientCertificates(
        lambda: client_ssl_context(
            "nats", ca_file=config.tls_ca_file, cert_file=config.tls_cert_file, key_file=config.tls_key_file
        ),
        files,
        certificate=("nats.tls_cert_file", config.tls_cert_file) if config.tls_cert_file else None,
    )


def security_options(config: NatsConfig) -> dict[str, Any]:
    """nats-py's connect options for credentials, from files read now (ConfigError names a bad
    one). TLS is tls_certificates'."""
    options: dict[str, Any] = {}
    password = read_secret(config.password, config.password_file, "nats.password")
    token = read_secret(config.token, config.token_file, "nats.token")
    given = [
        name
        for name, value in (
            ("user", config.user),
            ("token", token),
            ("nkey_seed_file", config.nkey_seed_file),
            ("credentials_file", config.credentials_file),
        )
        if value
    ]
    if len(given) > 1:
        raise ConfigError(f"nats: give one way of authenticating, not {' and '.join(given)}")
    if password and not config.user:
        raise ConfigError("nats.password needs nats.user")
    if config.user:
        options["user"] = config.user
        if password:
            options["password"] = password
    if token:
        options["token"] = token
    if config.nkey_seed_file:
        _readable(config.nkey_seed_file, "nats.nkey_seed_file")
        options["nkeys_seed"] = config.nkey_seed_file
    if config.credentials_file:
        _readable(config.credentials_file, "nats.credentials_file")
        options["user_credentials"] = config.credentials_file
    return options


def _readable(path: str, key: str) -> None:
    warn_if_exposed(path, key)
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path!r}: {exc.strerror or exc}") from None
