"""Container health check over grpc.health.v1, for Docker's HEALTHCHECK, compose and Kubernetes:

    python /opt/asyncinfer/healthcheck.py [--ca FILE [--cert FILE --key FILE]] HOST:PORT [SERVICE]

Exits 0 when the server answers SERVING for SERVICE ("" by default: the whole server), 1 otherwise
(NOT_SERVING, unreachable, or no answer within 3 s). With --ca the check speaks TLS and verifies
the server against that CA (the server's certificate must name HOST: the manifests' name
`localhost`); --cert/--key add a client certificate for a server that requires mutual TLS.
Kubernetes' native gRPC probes cannot speak TLS, so the manifests run this as an exec probe.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 3.0


def _channel(address: str, ca_file: str | None, cert_file: str | None, key_file: str | None) -> grpc.Channel:
    if ca_file is None:
        return grpc.insecure_channel(address)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(ca_file).read_bytes(),
        private_key=Path(key_file).read_bytes() if key_file else None,
        certificate_chain=Path(cert_file).read_bytes() if cert_file else None,
    )
    return grpc.secure_channel(address, credentials)


def is_serving(
    address: str,
    service: str = "",
    timeout_s: float = TIMEOUT_S,
    *,
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
) -> tuple[bool, str]:
    """Whether the server at `address` reports `service` SERVING, and what it said."""
    with _channel(address, ca_file, cert_file, key_file) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return response.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="healthcheck.py", description="grpc.health.v1 Check; exit 0 if SERVING")
    parser.add_argument("--ca", help="PEM CA that verifies the server: speak TLS")
    parser.add_argument("--cert", help="PEM client certificate (mutual TLS)")
    parser.add_argument("--key", help="PEM private key of --cert")
    parser.add_argument("address", help="HOST:PORT")
    parser.add_argument("service", nargs="?", default="", help='the health service name ("": the server)')
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        return 2
    if bool(args.cert) != bool(args.key) or (args.cert and not args.ca):
        print("--cert and --key go together, and need --ca", file=sys.stderr)
        return 2
    serving, said = is_serving(args.address, args.service, ca_file=args.ca, cert_file=args.cert, key_file=args.key)
    print(f"{args.address}: {said}")
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
