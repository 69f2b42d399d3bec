"""Container health check over grpc.health.v1, for Docker's HEALTHCHECK and compose:

    python /opt/asyncinfer/healthcheck.py HOST:PORT [SERVICE]

Exits 0 when the server answers SERVING for SERVICE ("" by default: the whole server), 1 otherwise
(NOT_SERVING, unreachable, or no answer within 3 s). Kubernetes does not need it: its native gRPC
probes ask the same service.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def is_serving(address: str, service: str = "", timeout_s: float = TIMEOUT_S) -> tuple[bool, str]:
    """Whether the server at `address` reports `service` SERVING, and what it said."""
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return response.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: healthcheck.py HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    serving, said = is_serving(argv[0], argv[1] if len(argv) == 2 else "")
    print(f"{argv[0]}: {said}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
