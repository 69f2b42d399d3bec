"""Progress notices: "this running job's model reported this", from the scheduler to the gateways
that watch the job, on core NATS (`progress_subject(tenant, job_id)`; never stored).

A notice carries the attempt and the report's step, so a watcher drops what belongs to an older
attempt or arrives after a newer report. Its format is the progress part of the job record's
codec (`asyncinfer.codecs.parts.ProgressWire`, versioned JSON with `v` first) plus the job's ID;
one a gateway cannot read is dropped (the next report, or the record, says as much).
"""

from __future__ import annotations

import msgspec
import structlog

from asyncinfer.codecs.parts import ProgressWire, progress_from_wire, progress_to_wire
from asyncinfer.contract import progress_subject
from asyncinfer.jobs import ProgressReport
from asyncinfer.nats import Client as NatsClient

log = structlog.get_logger("asyncinfer.progress_notice")

VERSION = 1


class ProgressNoticeWire(msgspec.Struct, kw_only=True, omit_defaults=True):
    v: int = VERSION
    job_id: str
    progress: ProgressWire


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ProgressNoticeWire)


def encode_progress_notice(job_id: str, report: ProgressReport) -> bytes:
    wire = progress_to_wire(report)
    assert wire is not None
    return _encoder.encode(ProgressNoticeWire(v=VERSION, job_id=job_id, progress=wire))


def decode_progress_notice(payload: bytes) -> tuple[str, ProgressReport]:
    """(job ID, report); ValueError (msgspec.DecodeError) when it is not a progress notice."""
    wire = _decoder.decode(payload)
    report = progress_from_wire(wire.progress)
    assert report is not None
    return wire.job_id, report


async def announce_progress(nc: NatsClient, tenant: str, job_id: str, report: ProgressReport) -> None:
    """Sends the notice. Never raises: progress is a hint, the record keeps the latest."""
    try:
        await nc.publish(progress_subject(tenant, job_id), encode_progress_notice(job_id, report))
    except Exception as exc:
        log.debug("progress_notice_not_sent", job_id=job_id, error=str(exc))
