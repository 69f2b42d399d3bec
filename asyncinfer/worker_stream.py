"""How large a WorkerService stream message may be, which both of its ends must agree on: work orders
carry resolved inputs (up to gateway.max_upload_bytes) and results come back the same way, so the
scheduler's server and the batcher allow that much, plus framing."""

from __future__ import annotations

from asyncinfer.config import Config

WORK_MESSAGE_HEADROOM_BYTES = 1024 * 1024
GRPC_MESSAGE_LIMIT_BYTES = 2**31 - 1


def work_message_bytes(config: Config, floor_bytes: int = 64 * 1024 * 1024) -> int:
    """The max message length both ends of the WorkerService stream use."""
    wanted = max(floor_bytes, config.gateway.max_upload_bytes + WORK_MESSAGE_HEADROOM_BYTES)
    return min(wanted, GRPC_MESSAGE_LIMIT_BYTES)
