"""The gateway process: NATS connection, stream and bucket declarations, the queue view, the watch
hub, the public JobService and the metrics endpoint, started and stopped in order; its background
loop (the watch feed's idle stop) runs under the app's supervisor."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import structlog
from prometheus_client import CollectorRegistry

from asyncinfer.access import require_keys_beyond_loopback
from asyncinfer.blobs import ensure_objects_bucket
from asyncinfer.cert_expiry import CertificateExpiry, watch_certificates
from asyncinfer.claim_lifetimes import ClaimLifetimes
from asyncinfer.config import Config
from asyncinfer.declarations import ensure_jobs_bucket, ensure_queues_bucket, ensure_work_stream
from asyncinfer.grpc_keepalive import Keepalive
from asyncinfer.grpc_server import GrpcServer
from asyncinfer.idempotency_claims import ClaimStore, ensure_idempotency_bucket
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import JobRecord
from asyncinfer.metrics import MetricsServer
from asyncinfer.model_registry import ensure_models_bucket
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats.connection import client_certificates, connect, disconnect
from asyncinfer.nats.failures import nats_failure_status
from asyncinfer.supervision import Supervisor
from asyncinfer.tls import serving_certificates
from asyncinfer.tracing import Tracing
from asyncinfer.v1 import batch_service_pb2_grpc, job_service_pb2_grpc
from asyncinfer.webhook_status import ensure_webhooks_bucket
from asyncinfer.work_summary import WorkSummary
from services.gateway.admission import Admission
from services.gateway.auth import GATEWAY_EXPOSES, tenant_guard
from services.gateway.batch_callbacks import BatchCallbacks
from services.gateway.batch_driver import BatchDriver
from services.gateway.batch_metrics import BatchMetrics
from services.gateway.batch_prepare import Preparer
from services.gateway.batch_service import BatchService
from services.gateway.batch_store import BatchStore, ensure_batches_bucket
from services.gateway.blobs import ClaimCheck
from services.gateway.callbacks import CallbackDeliveries
from services.gateway.chunk_ends import ChunkEnds
from services.gateway.idempotency import IdempotentSubmitter
from services.gateway.job_service import JobService
from services.gateway.metrics import GatewayMetrics
from services.gateway.model_catalog import ModelCatalog
from services.gateway.queue_view import QueueView
from services.gateway.store_health import StoreHealth
from services.gateway.submit import JobSubmitter
from services.gateway.tenant_quota import TenantQuota
from services.gateway.transitions import Expiry
from services.gateway.upload_storage import UploadStorage
from services.gateway.watch_hub import WatchHub

SERVICE_NAME = "asyncinfer.v1.JobService"
BATCH_SERVICE_NAME = "asyncinfer.v1.BatchService"
SERVICE_NAMES = (SERVICE_NAME, BATCH_SERVICE_NAME)
# Room above max_request_bytes so that a request slightly over the limit reaches our own check
# (with a clear message) rather than gRPC's; it also bounds responses, and records (with their
# inline results) stay under NATS's 1 MB max payload.
MESSAGE_HEADROOM_BYTES = 1024 * 1024

log = structlog.get_logger("asyncinfer.gateway")

# Room a health probe wants in the work stream before it says SERVING again after a full store.
STORE_HEADROOM_BYTES = 64 * 1024


class GatewayApp:
    def __init__(self, config: Config, *, wall_clock: Callable[[], float] = time.time) -> None:
        self.config = config
        # Its wall clock for jobs and batches: their create_time and the deadline a queue_ttl
        # gives, expiry of queued jobs past their deadline (reads, watches), idempotency claims'
        # times, a batch create's time bound, the queue view's clock, and the time its label
        # watches' headers say they listen since (asyncinfer.grpc_headers). One clock, so that a
        # job's create_time and deadline agree. Tests skew it against nats-server's, as on
        # Kubernetes nodes whose clocks are off. (Batch runs' timings and uploads keep time.time:
        # docs/ARCHITECTURE.md, "A process that freezes, a clock that jumps".)
        self._wall_clock = wall_clock
        self.registry = CollectorRegistry()
        self.metrics = GatewayMetrics(self.registry)
        self.metrics.count_models(model.name for model in config.models)
        self.supervisor = Supervisor("gateway")
        self.certificates: CertificateExpiry | None = None  # its TLS certificates' expiry, once started
        interval_s = config.logging.summary_interval_s
        self.summary = WorkSummary(interval_s) if interval_s > 0 else None
        self.tracing = Tracing.start(config.tracing, service="gateway")
        self._metrics_server = MetricsServer(self.registry, config.gateway.host, config.gateway.metrics_port)
        self._nc: NatsClient | None = None
        self._hub: WatchHub | None = None
        self._queues: QueueView | None = None
        self._catalog: ModelCatalog | None = None
        self._submitter: JobSubmitter | None = None
        self._idempotent: IdempotentSubmitter | None = None
        self._job_service: JobService | None = None
        self._server: GrpcServer | None = None
        self.batch_driver: BatchDriver | None = None
        self._started = False
        self._stopped = False
        self.port = 0
        self.metrics_port = 0

    @property
    def watch_hub(self) -> WatchHub:
        if self._hub is None:
            raise RuntimeError("the gateway is not started")
        return self._hub

    @property
    def nats_connection(self) -> NatsClient:
        """Its NATS connection (tests follow its state through an outage)."""
        if self._nc is None:
            raise RuntimeError("the gateway is not started")
        return self._nc

    @property
    def queue_view(self) -> QueueView:
        if self._queues is None:
            raise RuntimeError("the gateway is not started")
        return self._queues

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("the gateway was already started")
        self._started = True
        try:
            await self._start()
        except BaseException:
            await self.stop(grace_s=0)
            raise

    async def _start(self) -> None:
        cfg = self.config
        # Before anything connects or binds: an open gateway must not serve even for a moment.
        require_keys_beyond_loopback(
            "gateway", cfg.gateway.host, cfg.gateway.api_keys, GATEWAY_EXPOSES, tls=bool(cfg.gateway.tls_cert_file)
        )
        tls = serving_certificates("gateway", cfg.gateway)
        self._nc = await connect(cfg.nats, name="asyncinfer-gateway")
        self.certificates = watch_certificates(
            cfg, "gateway", self.registry, self.supervisor, follow=(tls, client_certificates(self._nc))
        )
        js = self._nc.jetstream()
        await ensure_work_stream(js, cfg.nats)
        claims_kv = await ensure_idempotency_bucket(js, cfg.nats)
        # A keyed job that this gateway ends (a cancel or an expiry while queued) has its claim cut.
        claim_lifetimes = ClaimLifetimes(
            ClaimStore(claims_kv, js, bucket=cfg.nats.idempotency_bucket), self._nc, self.supervisor
        )
        records = JobStore(
            await ensure_jobs_bucket(js, cfg.nats),
            work_stream=cfg.nats.work_stream,
            after_write=claim_lifetimes.after_write,
        )
        claim_lifetimes.start()
        await ensure_queues_bucket(js, cfg.nats)  # the queue view reads it
        storage = UploadStorage(
            self._nc,
            bucket=cfg.nats.objects_bucket,
            limit_bytes=cfg.gateway.max_stored_upload_bytes_per_tenant,
            directory=cfg.nats.objects_directory,
        )
        store_health = StoreHealth(
            js, work_stream=cfg.nats.work_stream, headroom_bytes=STORE_HEADROOM_BYTES, supervisor=self.supervisor
        )
        blob_store = await ensure_objects_bucket(self._nc, cfg.nats)
        batch_store = BatchStore(await ensure_batches_bucket(js, cfg.nats), self._nc)
        claim_check = ClaimCheck(blob_store, cfg, storage=storage, store_health=store_health, batches=batch_store)
        self._queues = QueueView(
            js, self._nc, bucket=cfg.nats.queues_bucket, work_stream=cfg.nats.work_stream, clock=self._wall_clock
        )
        await self._queues.start()
        expiry = Expiry(records, on_expired=self._expired_on_read, clock=self._wall_clock)
        self._hub = WatchHub(
            self._nc,
            js,
            records,
            bucket=cfg.nats.jobs_bucket,
            expiry=expiry,
            supervisor=self.supervisor,
            idle_stop_s=cfg.gateway.watch_feed_idle_s,
        )
        await self._hub.start()
        self.metrics.count_watchers(lambda: self.watch_hub.watcher_count)
        limit = cfg.gateway.max_queued_per_tenant
        tenants = TenantQuota(
            self._nc, work_stream=cfg.nats.work_stream, limit=limit, read_retry_s=cfg.gateway.enqueue_retry_s
        )
        admission = Admission(self._queues, tenants, max_queued_per_tenant=limit)
        await ensure_models_bucket(js, cfg.nats)
        self._catalog = ModelCatalog(cfg, js)
        await self._catalog.start()
        self._submitter = JobSubmitter(
            cfg,
            self._nc,
            admission,
            claim_check=claim_check,
            recent=self._hub.recent,
            store_health=store_health,
            catalog=self._catalog,
            summary=self.summary,
            clock=self._wall_clock,
        )
        self._idempotent = IdempotentSubmitter(
            cfg, self._submitter, records, claims_kv, expiry, js=js, nc=self._nc, clock=self._wall_clock
        )
        self._job_service = servicer = JobService(
            cfg,
            submitter=self._submitter,
            idempotent=self._idempotent,
            records=records,
            hub=self._hub,
            queues=self._queues,
            expiry=expiry,
            nc=self._nc,
            metrics=self.metrics,
            claim_check=claim_check,
            callback_deliveries=CallbackDeliveries(await ensure_webhooks_bucket(js, cfg.nats)),
            tracing=self.tracing,
            wall_clock=self._wall_clock,
        )
        self.batch_driver = driver = BatchDriver(
            cfg,
            batch_store,
            Preparer(blob_store, cfg.batches, max_upload_bytes=cfg.gateway.max_upload_bytes),
            records=records,
            expiry=expiry,
            submitter=self._submitter,
            nc=self._nc,
            metrics=BatchMetrics(self.registry),
            callbacks=BatchCallbacks(js, cfg),
            chunk_ends=ChunkEnds(self._hub),
            blobs=blob_store,
            tracing=self.tracing,
        )
        batch_servicer = BatchService(
            cfg,
            batch_store,
            driver,
            blobs=blob_store,
            records=records,
            nc=self._nc,
            catalog=self._catalog,
            clock=self._wall_clock,
            tracing=self.tracing,
        )

        def add_servicers(server: grpc.aio.Server) -> None:
            job_service_pb2_grpc.add_JobServiceServicer_to_server(servicer, server)
            batch_service_pb2_grpc.add_BatchServiceServicer_to_server(batch_servicer, server)

        self._server = GrpcServer(
            host=cfg.gateway.host,
            port=cfg.gateway.port,
            add_servicers=add_servicers,
            service_names=SERVICE_NAMES,
            max_message_bytes=cfg.gateway.max_request_bytes + MESSAGE_HEADROOM_BYTES,
            rpc_metrics=self.metrics.rpc,
            credentials=tls.credentials if tls else None,
            guard=tenant_guard(cfg.gateway.api_keys, SERVICE_NAMES),
            translate=nats_failure_status,
            keepalive=Keepalive(cfg.gateway.keepalive_s),
        )
        await self._server.start()
        self.supervisor.start("gateway-batch-driver", driver.run())
        if self.summary is not None:
            self.supervisor.start("gateway-jobs-summary", self.summary.run())
        store_health.serve_on(self._server)
        self.port = self._server.port
        self._metrics_server.start()
        self.metrics_port = self._metrics_server.port
        log.info("gateway_started", address=self._server.address, metrics_port=self.metrics_port)

    def _expired_on_read(self, record: JobRecord) -> None:
        self.metrics.expired_on_read_of(record)
        if self.summary is not None:
            self.summary.count(record.model_name, "expired")

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stops intake, ends watches (resumable), lets running calls finish within grace_s, then
        drains NATS. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.supervisor.begin_stop()
        # Watches never end on their own: they are ended at the start of the grace, which then
        # serves unary calls. Not before the server stops intake: a client reopens an ended watch at
        # once, on the same connection, so here again; and the calls that came while the loop was
        # busy, not yet picked up when the server stopped, ended CANCELLED (gRPC core's answer to a
        # call it drops at shutdown), which no client retries: 114 of 200 label watches in a run of
        # bench/system/label_watch_reconnect.py. Once the server has sent GOAWAY they reopen elsewhere.
        hub_stop = self._hub.stop if self._hub is not None else None
        if self._server is not None:
            await self._server.stop(grace_s, once_closed=hub_stop)
        elif hub_stop is not None:
            await hub_stop()
        if self._job_service is not None:
            await self._job_service.close()  # listings whose callers all left
        if self._idempotent is not None:
            await self._idempotent.drain()  # keyed submits whose callers left; before the submitter's
        if self._submitter is not None:
            await self._submitter.drain()  # submits whose callers left, each bounded
        if self._queues is not None:
            await self._queues.stop()
        if self._catalog is not None:
            await self._catalog.stop()
        await self.supervisor.stop()  # the loops not ended above (none, unless one hangs)
        self._metrics_server.stop()
        await asyncio.to_thread(self.tracing.shutdown)  # flushes the spans not yet exported
        if self._nc is not None:
            await disconnect(self._nc)
        log.info("gateway_stopped")
