"""`python -m asyncinfer`: the client CLI (asyncinfer.cli), without the commands that start servers
(up, gateway, scheduler, batcher), which are the installed `asyncinfer` command's (services.cli):
shared code never imports the services."""

from __future__ import annotations

import sys

import asyncinfer.grpc_logging  # noqa: F401  (before grpc is imported: see the module)
from asyncinfer.cli import main

if __name__ == "__main__":
    sys.exit(main())
