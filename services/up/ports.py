"""The ports `up` and a lone service listen on, checked before anything starts, and where `up`
may bind at all (loopback, but for a gateway whose callers authenticate over TLS)."""

from __future__ import annotations

from typing import Any

from asyncinfer.config import Config
from asyncinfer.errors import ConfigError
from asyncinfer.ports import IN_USE, PortUse, busy_ports, free_alternatives
from services.apps import SERVICES


def service_host(config: Config, name: str) -> str:
    section: Any = getattr(config, name)
    return str(section.host)


def check_up_exposure(config: Config) -> None:
    """`up` binds beyond loopback only where callers authenticate over TLS: the gateway with API
    keys and a certificate (`up --dev-tls`, or gateway.tls_cert_file); the scheduler's, the batcher's
    and NATS's ports stay on loopback."""
    from asyncinfer.access import is_loopback, require_keys_beyond_loopback
    from services.gateway.auth import GATEWAY_EXPOSES

    # `up` refuses keys in cleartext itself (below), rather than warning of them.
    require_keys_beyond_loopback("gateway", config.gateway.host, config.gateway.api_keys, GATEWAY_EXPOSES, tls=True)
    if not is_loopback(config.gateway.host) and not config.gateway.tls_cert_file:
        raise ConfigError(
            f"`asyncinfer up` stays on loopback without TLS: gateway.host is {config.gateway.host!r}, so API keys "
            "would travel in cleartext. Run `asyncinfer up --dev-tls` (a local development CA), or set "
            "gateway.tls_cert_file and tls_key_file."
        )
    for what, host in (
        ("scheduler", config.scheduler.host),
        ("batcher", config.batcher.host),
        ("embedded_nats", config.embedded_nats.host),
        ("console", config.console.host),
    ):
        if not is_loopback(host):
            raise ConfigError(
                f"`asyncinfer up` binds every port but the gateway's to loopback: {what}.host is {host!r}, and "
                f"the {what} has no authentication of its own. Set {what}.host to 127.0.0.1 (run services apart, "
                "on a private network, to spread them over machines)."
            )


def service_ports(config: Config, name: str) -> list[PortUse]:
    """The ports one service listens on, with the settings they come from (the console has no
    metrics port)."""
    section: Any = getattr(config, name)
    uses = [PortUse(f"{name}.port", section.host, section.port)]
    if hasattr(section, "metrics_port"):
        uses.append(PortUse(f"{name}.metrics_port", section.host, section.metrics_port))
    return uses


def up_ports(config: Config) -> list[PortUse]:
    """Every port `up` listens on, with the setting it comes from."""
    embedded = config.embedded_nats
    uses = [
        PortUse("embedded_nats.port", embedded.host, embedded.port),
        PortUse("embedded_nats.monitor_port", embedded.host, embedded.monitor_port),
    ]
    for name in SERVICES:
        uses += service_ports(config, name)
    return uses


def raise_if_busy(uses: list[PortUse], *, hint: str) -> None:
    """ConfigError, in one line naming them, when a port about to be listened on is taken: found
    before anything starts, rather than as a nats-server that exits or a gRPC bind traceback."""
    busy = busy_ports(uses)
    if not busy:
        return
    in_use = [str(port.use) for port in busy if port.why == IN_USE]
    other = [str(port) for port in busy if port.why != IN_USE]
    found = ([f"already in use: {', '.join(in_use)}"] if in_use else []) + other
    # The variables that move each taken port to a free one, ready to paste before the command: a
    # reader had to work out nine names for a second `up` beside the first (one per port).
    moved = free_alternatives(uses, busy)
    assignments = [f"{_variable(use.setting)}={port}" for use, port in moved.items()]
    if assignments and len(moved) == len(busy):
        where = f"or run this one on free ports: {' '.join(assignments)} (or set them in its configuration file)."
    else:
        section_key = busy[0].use.setting
        where = f"or give this one other ports in its configuration file or environment ({_variable(section_key)}=...)."
    raise ConfigError(f"cannot start, {'; '.join(found)}. {hint} Stop it, {where}")


def _variable(setting: str) -> str:
    """The environment variable of a setting: gateway.port -> ASYNCINFER_GATEWAY__PORT."""
    section, key = setting.split(".")
    return f"ASYNCINFER_{section.upper()}__{key.upper()}"
