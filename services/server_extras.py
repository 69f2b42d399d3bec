"""What the commands that start servers need beyond the base install (the SDK and the client CLI),
checked before anything is imported: `pip install asyncinfer` alone gets one line naming the extra
to install, not a traceback from deep inside a service."""

from __future__ import annotations

from importlib.util import find_spec

# The modules each extra brings (pyproject.toml's optional dependencies), by import name.
_SERVER = (
    "nats",
    "uvloop",
    "prometheus_client",
    "stamina",
    "grpc_health",
    "grpc_reflection",
    "aiohttp",
    "cryptography",
)
_BATCHER = (*_SERVER, "torch", "tritonclient")

# Command -> (the extra that provides what it needs, the modules to look for).
NEEDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gateway": ("server", _SERVER),
    "scheduler": ("server", _SERVER),
    "console": ("server", _SERVER),
    "batcher": ("batcher", _BATCHER),
    "up": ("all", _BATCHER),
}


def missing_for(command: str) -> str | None:
    """One line saying what to install when the command's modules are missing; None when present."""
    extra, modules = NEEDS[command]
    missing = [name for name in modules if find_spec(name) is None]
    if not missing:
        return None
    return (
        f"`asyncinfer {command}` needs the servers' dependencies (missing: {', '.join(missing)}): "
        f"pip install 'asyncinfer[{extra}]'"
    )
