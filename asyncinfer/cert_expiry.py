"""When the certificates a service serves and presents expire: a gauge, and a warning before they do.

A service reads its certificates again when their files change (asyncinfer.tls: cert-manager,
Vault and `up --dev-tls` renew them in place): its serving certificate (`<service>.tls_cert_file`)
at the next TLS handshake, its client certificates (mutual TLS to NATS, `nats.tls_cert_file`; the
batcher's to the scheduler, `batcher.scheduler_cert_file`) at the next connection (a reconnect).
Until this module an expiry went unnoticed until the handshakes failed (every client at once for
a serving certificate; the whole service's NATS connection for a client one).

So each service, once it has loaded its certificates:
- sets `asyncinfer_tls_certificate_expiry_timestamp_seconds{certificate="<setting>"}` to the
  notAfter (Unix seconds) of the leaf certificate each setting's file held when it was loaded: the
  one in use, not one renewed on disk since and not yet used (a serving certificate's renewal is
  served, and the gauge set, at the first TLS handshake after it; a client one's at the next
  connection: `follow`), so an alert on it clears when the renewed certificate is in use; an alert compares it with
  time() (deploy/k8s's PrometheusRule);
- logs `tls_certificate_expires_soon` at warning (`tls_certificate_expired` at error once past)
  for each certificate that expires within `tls.expiry_warning_days`, at start and then once a day
  (CHECK_INTERVAL_S) while it runs; 0 days: never logged, the gauge still set.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

import structlog
from prometheus_client import CollectorRegistry, Gauge

from asyncinfer.config import Config
from asyncinfer.errors import ConfigError
from asyncinfer.supervision import Supervisor
from asyncinfer.tls import Renewing

log = structlog.get_logger("asyncinfer.tls")

CHECK_INTERVAL_S = 24 * 3600.0
DAY_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class LoadedCertificate:
    setting: str  # the configuration key naming its file: the gauge's `certificate` label
    path: str
    not_after: float  # Unix seconds


def service_certificates(config: Config, service: Literal["gateway", "scheduler", "batcher"]) -> list[tuple[str, str]]:
    """The (setting, file) of each certificate `service` presents, as configured: its serving one,
    its NATS client one (mutual TLS to NATS), and the batcher's client one to the scheduler."""
    files: list[tuple[str, str | None]] = []
    if service == "gateway":
        files.append(("gateway.tls_cert_file", config.gateway.tls_cert_file))
    elif service == "scheduler":
        files.append(("scheduler.tls_cert_file", config.scheduler.tls_cert_file))
    else:
        files.append(("batcher.tls_cert_file", config.batcher.tls_cert_file))
        if config.batcher.scheduler_address:
            files.append(("batcher.scheduler_cert_file", config.batcher.scheduler_cert_file))
    if service != "batcher" or (config.batcher.scheduler_address and config.batcher.claim_check_io):
        files.append(("nats.tls_cert_file", config.nats.tls_cert_file))  # a batcher connects only to move claim checks
    return [(setting, path) for setting, path in files if path]


def not_after(path: str, setting: str) -> float:
    """The notAfter of the first certificate in the PEM file (the leaf of a chain), Unix seconds."""
    from cryptography import x509  # the server extra's; imported only where a certificate is configured

    try:
        with open(path, "rb") as file:
            data = file.read()
        return x509.load_pem_x509_certificate(data).not_valid_after_utc.timestamp()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{setting} {path!r}: cannot read its certificate's expiry ({exc})") from None


class CertificateExpiry:
    """The gauge and the warnings of one service's loaded certificates (the module's docstring)."""

    def __init__(
        self,
        certificates: Sequence[tuple[str, str]],
        *,
        registry: CollectorRegistry,
        warning_days: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._warning_s = warning_days * DAY_S
        self.loaded = [LoadedCertificate(setting, path, not_after(path, setting)) for setting, path in certificates]
        self._renewals = threading.Lock()
        self._gauge = Gauge(
            "asyncinfer_tls_certificate_expiry_timestamp_seconds",
            "When each certificate this service uses expires (its notAfter, Unix seconds), by the "
            "setting naming its file.",
            ["certificate"],
            registry=registry,
        )
        for certificate in self.loaded:
            self._gauge.labels(certificate=certificate.setting).set(certificate.not_after)

    def follow(self, renewing: Renewing | None) -> None:
        """Sets the gauge, and checks, to each certificate `renewing` renews from now on."""
        if renewing is not None:
            renewing.on_reloaded(self.reloaded)

    def reloaded(self, setting: str, path: str, not_after: float) -> None:
        """A renewed certificate is in use (a listener, maybe on a gRPC thread: the list is
        replaced whole, never changed in place, for check() on the event loop; the lock keeps two
        renewals told at once, a serving one on gRPC's thread and a client one on another, from
        each dropping the other's)."""
        renewed = LoadedCertificate(setting, path, not_after)
        with self._renewals:
            self.loaded = [*(c for c in self.loaded if c.setting != setting), renewed]
        self._gauge.labels(certificate=setting).set(not_after)

    def check(self) -> list[LoadedCertificate]:
        """Logs each certificate that expires within the warning window (or has expired); those."""
        if self._warning_s <= 0:
            return []
        now = self._clock()
        soon = [c for c in self.loaded if c.not_after - now <= self._warning_s]
        for certificate in soon:
            left_s = certificate.not_after - now
            fields = {
                "certificate": certificate.setting,
                "file": certificate.path,
                "expires_at": datetime.fromtimestamp(certificate.not_after, UTC).isoformat(timespec="seconds"),
                "days_left": round(left_s / DAY_S, 1),
                "hint": "renew it (the file replaced): a serving certificate is served from the next connection, "
                "a client one presented from the next reconnect",
            }
            if left_s <= 0:
                log.error("tls_certificate_expired", **fields)
            else:
                log.warning("tls_certificate_expires_soon", **fields)
        return soon

    async def run(self, interval_s: float = CHECK_INTERVAL_S) -> None:
        """check() every `interval_s` (a day) for as long as the service runs (an owned loop: the
        owner's Supervisor cancels it at stop)."""
        if not self.loaded or self._warning_s <= 0:
            return
        while True:
            await asyncio.sleep(interval_s)
            self.check()


def watch_certificates(
    config: Config,
    service: Literal["gateway", "scheduler", "batcher"],
    registry: CollectorRegistry,
    supervisor: Supervisor,
    follow: Sequence[Renewing | None] = (),
) -> CertificateExpiry:
    """The service's certificates' gauge set and checked now, then once a day by a loop the
    service's supervisor owns; the renewals of those it follows set the gauge as they are used."""
    expiry = CertificateExpiry(
        service_certificates(config, service), registry=registry, warning_days=config.tls.expiry_warning_days
    )
    for renewing in follow:
        expiry.follow(renewing)
    expiry.check()
    supervisor.start(f"{service}-tls-expiry", expiry.run())
    return expiry
