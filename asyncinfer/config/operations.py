"""[webhooks], [tracing], [logging] and [tls]: settings every service shares."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from asyncinfer.config.section import Section


class WebhookSecretConfig(Section):
    tenant: str = Field(description="The tenant whose webhooks this secret signs.")
    secret: str = Field(description="`whsec_` + base64 of 24-64 random bytes (`asyncinfer webhook-secret`).")

    @field_validator("secret")
    @classmethod
    def _valid_secret(cls, value: str) -> str:
        import base64
        import binascii

        if not value.startswith("whsec_"):
            raise ValueError("webhook secrets start with 'whsec_' (Standard Webhooks)")
        try:
            raw = base64.b64decode(value.removeprefix("whsec_"), validate=True)
        except binascii.Error:
            raise ValueError("a webhook secret is 'whsec_' followed by base64") from None
        if not 24 <= len(raw) <= 64:
            raise ValueError("a webhook secret holds 24 to 64 random bytes")
        return value


class WebhooksConfig(Section):
    secrets: tuple[WebhookSecretConfig, ...] = Field(
        (),
        description='Per-tenant signing secrets, e.g. [{ tenant = "acme", secret = "whsec_..." }]. A tenant '
        "without one cannot ask for webhooks (FAILED_PRECONDITION). To rotate one, list the new secret beside "
        "the old: every delivery is signed with each (Standard Webhooks' space-separated signatures, which a "
        "receiver checks against the secret it has), and once receivers have the new one, remove the old.",
    )
    allowed_networks: tuple[str, ...] = Field(
        (),
        description="CIDRs webhooks may reach although private, loopback or link-local (e.g. "
        '["10.0.0.0/8"]). Empty: only public addresses.',
    )
    retry_horizon_s: float = Field(
        3 * 86400.0, gt=0, description="How long a failing delivery is retried before it is given up."
    )
    backoff_base_s: float = Field(5.0, gt=0, description="First retry delay; doubles per attempt, with jitter.")
    backoff_max_s: float = Field(3600.0, gt=0, description="The longest delay between two attempts.")
    request_timeout_s: float = Field(15.0, gt=0, description="Timeout of one delivery attempt.")
    disabled_for_s: float = Field(
        7 * 86400.0,
        ge=0,
        description="How long a URL that answered 410 Gone stays disabled for its tenant (its deliveries end "
        "DISABLED without a request); then it is tried again. 0: until the key disabled.<tenant>.<URL's "
        "SHA-256> is deleted from the webhooks bucket.",
    )
    max_concurrent_deliveries: int = Field(32, ge=1, description="Deliveries in flight at once per scheduler.")
    max_concurrent_per_origin: int = Field(
        8,
        ge=1,
        description="Of those, at most this many to one origin (scheme, host and port) at once; a delivery past it "
        "waits for one of them to end, or, while the origin is slow (an attempt in flight for over a second), "
        "request_timeout_s without an attempt. A receiver that hangs took every slot, and every other receiver's "
        "webhooks waited for as long as it hung.",
    )

    @field_validator("allowed_networks")
    @classmethod
    def _valid_networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        import ipaddress

        for network in value:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(f"{network!r} is not a CIDR network") from None
        return value

    def secret_for(self, tenant: str) -> str | None:
        """The tenant's first listed secret (None without one)."""
        secrets = self.secrets_for(tenant)
        return secrets[0] if secrets else None

    def secrets_for(self, tenant: str) -> tuple[str, ...]:
        """Every secret listed for the tenant, in order: a delivery is signed with each (rotation)."""
        return tuple(entry.secret for entry in self.secrets if entry.tenant == tenant)


class TracingConfig(Section):
    enabled: bool = Field(
        False,
        description="OpenTelemetry traces of every job, from the caller's traceparent through the gateway, the "
        "scheduler and the batcher (off: no span is made and nothing is added per job).",
    )
    otlp_endpoint: str = Field(
        "",
        description="Where spans are exported, over OTLP/gRPC: an OpenTelemetry Collector or Jaeger, e.g. "
        "http://localhost:4317 (http: plaintext, https: TLS). Empty: $OTEL_EXPORTER_OTLP_ENDPOINT when set, "
        "else spans are made (trace IDs on records and log lines) but not exported.",
    )
    sample_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="The share of new traces recorded; a caller's traceparent decides for its own trace "
        "(its sampled flag is followed), and a new trace linked to a recorded span is recorded (a batch's chunk "
        "job, linked to its CreateBatch).",
    )
    service_name: str = Field(
        "asyncinfer",
        min_length=1,
        description="Each service's spans carry service.name <service_name>-gateway, -scheduler or -batcher "
        "and service.namespace <service_name>.",
    )


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Lowest level logged.")
    format: Literal["auto", "json", "console"] = Field(
        "auto", description="json (one object a line), console, or auto: console when stderr is a terminal, else json."
    )
    summary_interval_s: float = Field(
        60.0,
        ge=0,
        description="How often the gateway and the scheduler log jobs_summary at info: per model, the jobs accepted, "
        "dispatched, requeued and ended (by state) since the last one; nothing when there were none. Each job's "
        "own lines are at debug. 0: never.",
    )


class TlsConfig(Section):
    expiry_warning_days: float = Field(
        14.0,
        ge=0,
        description="Each service logs tls_certificate_expires_soon (warning) at start and once a day for a certificate "
        "it loaded (its serving one, its NATS client one, the batcher's client one to the scheduler) that expires within "
        "this many days, tls_certificate_expired (error) once past; the gauge "
        "asyncinfer_tls_certificate_expiry_timestamp_seconds says every one's expiry whatever this is. 0: never logged.",
    )
