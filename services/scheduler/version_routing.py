"""Which batcher runs a job, among versions: a job pinned to a version (SubmitJob's
model_version) runs only on a batcher that serves that version; a job that names none runs on
the model's default version at its dispatch (the model's default_version, else the highest version
a connected batcher serves: Triton's `latest` policy), and its record says which.

The dispatcher reserves a credit of the model before it pulls (it cannot know the next job's
version before), so the reserved batcher may not serve the job's version: another that does and
has a credit takes the job instead. When none does, the job waits in the queue, unchanged (no
attempt spent): put back with a short delay when a batcher serves the version but has no free
slot, with WAIT_UNSERVED_S when none serves it (it runs when one does, or expires at its deadline).
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncinfer.config import Config, version_order
from services.scheduler.batchers import BatcherRegistry, BatcherSession

# A job whose version is served, but by batchers with no free slot now, is put back for this long.
WAIT_BUSY_S = 0.05
# A job whose version no connected batcher serves is put back for this long.
WAIT_UNSERVED_S = 1.0


@dataclass(frozen=True, slots=True)
class Routed:
    """Run it on `session` (the reserved one, or another whose credit was taken) as `version`."""

    session: BatcherSession
    version: str


@dataclass(frozen=True, slots=True)
class Waiting:
    version: str
    reason: str
    delay_s: float


def resolve_version(batchers: BatcherRegistry, config: Config, model_name: str, asked: str) -> str:
    """The version a job runs on: the one it asked for, else the model's default now."""
    if asked:
        return asked
    served = batchers.served_versions(model_name)
    model = config.model(model_name)
    if model is not None:
        return model.default_among(served)
    return max(served, key=version_order) if served else ""


def route(
    batchers: BatcherRegistry, config: Config, model_name: str, asked: str, reserved: BatcherSession
) -> Routed | Waiting:
    version = resolve_version(batchers, config, model_name, asked)
    if reserved.serves(model_name, version):
        return Routed(reserved, version)
    other = batchers.reserve_serving(model_name, version)
    if other is not None:
        return Routed(other, version)
    if version in batchers.served_versions(model_name):
        return Waiting(version, f"the batchers serving version {version!r} have no free slot", WAIT_BUSY_S)
    which = f"version {version!r}" if version else "any version"
    return Waiting(version, f"no batcher serves {which} of model {model_name!r}", WAIT_UNSERVED_S)
