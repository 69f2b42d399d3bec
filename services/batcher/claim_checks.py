"""A batcher's own access to the claim-check store (`batcher.claim_check_io`): it reads the inputs
an order names by reference (an upload, or a file batch's chunk of rows) and stores outputs over
the order's `store_outputs_over_bytes` as the object its `output_name` names, so that a chunk's
bytes cross loopback once each way (NATS to the batcher, the batcher to NATS) rather than also
through the scheduler and the work stream (docs/BATCHES.md; measured in
bench/results/batch_files_ab_claim_check_io.md and, on a GPU, batch_files_ab_gpu_batchers.md).

The scheduler still owns the job: it fences the result (a late attempt's answer is dropped; its
object, named per attempt, is swept at its expiry) and writes the record that names the object.

Decoding rows (MiBs per chunk) runs on one thread of this object's own rather than asyncio's pool
(outputs need no encoding step: asyncinfer.outputs_wire). Each pool thread's allocations come from
a malloc arena of its own, and spread over several threads a chunk's buffers were fresh pages
again and again (the batcher took 72,000-110,000 page faults per 100,000 MLP records this way,
~33,000 with one arena).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import structlog

from asyncinfer.blobs import BlobStore
from asyncinfer.claim_check_io import read_inputs, store_outputs
from asyncinfer.config import Config
from asyncinfer.errors import AsyncInferError, Unavailable
from asyncinfer.jobs import BlobRef
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.connection import client_certificates, connect
from asyncinfer.nats.connection import close as close_client
from asyncinfer.tensors import Tensor
from asyncinfer.tls import ClientCertificates
from asyncinfer.v1 import worker_service_pb2

log = structlog.get_logger("asyncinfer.batcher.claim_checks")


class ClaimChecks:
    def __init__(self, nc: NatsClient, store: BlobStore, *, max_input_bytes: int) -> None:
        self._nc = nc
        self._store = store
        self._max_input_bytes = max_input_bytes
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batcher-claim-checks")

    @classmethod
    async def connect(cls, config: Config, batcher_id: str) -> ClaimChecks:
        """Over a NATS connection of the batcher's own (raises Unavailable when NATS cannot be reached)."""
        nc = await connect(config.nats, name=f"batcher-{batcher_id}")
        try:
            store = BlobStore.of(nc, config.nats)  # its objects' directory checked (ConfigError)
        except BaseException:
            await close_client(nc)
            raise
        return cls(nc, store, max_input_bytes=config.gateway.max_upload_bytes)

    @property
    def certificates(self) -> ClientCertificates[ssl.SSLContext] | None:
        """The NATS connection's TLS files (None: no TLS)."""
        return client_certificates(self._nc)

    async def close(self) -> None:
        await close_client(self._nc)
        self._executor.shutdown(wait=False)

    async def read(self, order: worker_service_pb2.WorkOrder) -> tuple[Tensor, ...]:
        """The order's inputs. Raises NotFound or InvalidArgument (gone or unreadable: final),
        BlobCorrupt or Unavailable (worth another attempt)."""
        try:
            return await read_inputs(
                self._store, order.tenant, order.input_ref, max_bytes=self._max_input_bytes, executor=self._executor
            )
        except AsyncInferError:
            raise
        except Exception as exc:  # nats-py's own errors on a connection in trouble
            raise Unavailable(f"cannot read the input {order.input_ref!r}: {exc}", reason="OBJECT_STORE") from exc

    def stores(self, order: worker_service_pb2.WorkOrder, outputs: Sequence[Tensor]) -> bool:
        """Whether the order asks for these outputs to be stored here."""
        over = order.store_outputs_over_bytes
        return bool(over and order.output_name) and sum(t.nbytes for t in outputs) > over

    async def store(self, order: worker_service_pb2.WorkOrder, outputs: Sequence[Tensor]) -> BlobRef:
        """Stores the outputs as the order's output_name, kept for its result retention (counted
        from now: the job ends when the scheduler takes this result). Raises Unavailable."""
        retention_s = order.result_retention.ToNanoseconds() / 1e9
        try:
            return await store_outputs(
                self._store,
                order.tenant,
                order.output_name,
                outputs,
                expires_at=time.time() + retention_s,
            )
        except AsyncInferError:
            raise
        except Exception as exc:
            raise Unavailable(f"cannot store the outputs: {exc}", reason="OBJECT_STORE") from exc
