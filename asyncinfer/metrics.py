"""Prometheus metrics: each service serves its own registry on its own port.

Metric objects are made per service instance (not module globals), so that several services can
run in one process (as `asyncinfer up` and the tests do) without clashing in one registry.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server


class MetricsServer:
    """Serves one registry over HTTP on a background thread (prometheus_client's own server)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.registry = registry
        self._host = host
        self._port = port
        self._server: WSGIServer | None = None

    @property
    def port(self) -> int:
        return self._server.server_port if self._server is not None else 0

    def start(self) -> None:
        if self._port == 0 and self._server is None:
            # 0 means off in the configuration; tests that want metrics pass a free port.
            return
        server, _thread = start_http_server(self._port, addr=self._host, registry=self.registry)
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
