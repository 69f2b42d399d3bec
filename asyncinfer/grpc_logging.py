"""gRPC's C core at its documented default verbosity, ERROR, unless the environment says otherwise.

Imported for this side effect by the command-line entry points (asyncinfer/__main__.py,
services/cli.py) before anything imports grpc, which reads GRPC_VERBOSITY once, at import. Since
gRPC 1.65 logs through absl, an unset GRPC_VERBOSITY lets INFO lines through: a client given
--tls-ca for a plaintext server printed a `Handshake failed` line per connection retry over the
CLI's own one-line error. The SDK, a library, leaves the environment alone."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
