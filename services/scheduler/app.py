"""The scheduler service: NATS declarations, the gRPC server (WorkerService + OpsService), one
dispatch loop per model, lease renewal, cancel notices, pauses, queue snapshots and metrics;
started and stopped in order. Every background loop runs under the app's supervisor: one that dies
is logged at once and stops the process (asyncinfer.runner)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

import grpc
import structlog
from prometheus_client import CollectorRegistry

from asyncinfer.access import AccessGuard, KeyRing, Role, require_keys_beyond_loopback
from asyncinfer.blobs import ensure_objects_bucket
from asyncinfer.cert_expiry import CertificateExpiry, watch_certificates
from asyncinfer.claim_lifetimes import ClaimLifetimes
from asyncinfer.config import Config
from asyncinfer.contract import CANCEL_SUBJECTS
from asyncinfer.declarations import ensure_jobs_bucket, ensure_queues_bucket, ensure_work_stream
from asyncinfer.errors import Unavailable
from asyncinfer.grpc_keepalive import Keepalive
from asyncinfer.grpc_server import GrpcServer
from asyncinfer.idempotency_claims import ClaimStore, ensure_idempotency_bucket
from asyncinfer.job_store import JobStore
from asyncinfer.jobs import Priority
from asyncinfer.metrics import MetricsServer
from asyncinfer.model_registry import ensure_models_bucket
from asyncinfer.nats import Client as NatsClient
from asyncinfer.nats import JetStreamContext, Msg, NatsError, Subscription
from asyncinfer.nats.connection import client_certificates, connect, disconnect
from asyncinfer.nats.failures import nats_failure_status
from asyncinfer.nats.kv import KvBucket
from asyncinfer.nats.streams import declaration
from asyncinfer.queues import SNAPSHOT_HEARTBEAT_S, CancelNotice
from asyncinfer.supervision import Supervisor, cancel_and_wait, end_if_cancelled
from asyncinfer.tls import serving_certificates
from asyncinfer.tracing import Tracing
from asyncinfer.v1 import ops_service_pb2_grpc, worker_service_pb2_grpc
from asyncinfer.work_summary import WorkSummary
from asyncinfer.worker_stream import work_message_bytes
from services.scheduler.batch_plans import BatchPlans
from services.scheduler.batchers import BatcherRegistry
from services.scheduler.blobs import (
    DEFAULT_SWEEP_INTERVAL_S,
    BlobSweeper,
    ClaimCheckIO,
    orphan_age_s,
)
from services.scheduler.cluster_drains import ClusterDrains
from services.scheduler.cluster_queues import ClusterQueues
from services.scheduler.completions import EventRates
from services.scheduler.dead_letters import DeadLetterStore, ensure_dead_letter_stream
from services.scheduler.deadline_sweep import DeadlineSweep
from services.scheduler.dispatcher import ModelDispatcher
from services.scheduler.instances import SchedulerInstance, instance_name, new_run
from services.scheduler.jobs_flow import JobFlow
from services.scheduler.lease_reclaim import LeaseReclaimer
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.model_controls import ModelControls
from services.scheduler.model_dispatchers import ModelDispatchers
from services.scheduler.model_registry_writer import ModelRegistryWriter
from services.scheduler.ops_service import OpsService
from services.scheduler.pauses import PauseState
from services.scheduler.peer_watch import PeerWatch
from services.scheduler.priority import PrioritySelector
from services.scheduler.put_back_checks import check_put_backs
from services.scheduler.queue_stats import QueueStatsReader
from services.scheduler.queued_records import QueuedRecords
from services.scheduler.runtime_models import RuntimeModels, declare_consumers
from services.scheduler.snapshot_writes import SnapshotWrites, write_snapshots
from services.scheduler.store_usage import StoreUsageReader
from services.scheduler.stranded_messages import StrandedMessages
from services.scheduler.webhooks.service import WebhookService
from services.scheduler.work_queue import ModelQueues
from services.scheduler.worker_service import WorkerService

log = structlog.get_logger("asyncinfer.scheduler")
# How often a periodic task that keeps failing on NATS says so again.
REPEAT_FAILURE_LOG_S = 30.0

SERVICE_NAMES = ("asyncinfer.v1.WorkerService", "asyncinfer.v1.OpsService")
# What anyone who reached a scheduler with no key could do (require_keys_beyond_loopback).
SCHEDULER_EXPOSES = (
    "read every tenant's dead letters (their inputs), replay or purge them, pause and drain queues, take "
    "work as a batcher, and load models into its batchers (a loader names any code they will run)"
)
# With API keys configured: batchers connect with a key of role batcher, operators call with one of role ops.
ROLES: dict[str, Role] = {"asyncinfer.v1.WorkerService": "batcher", "asyncinfer.v1.OpsService": "ops"}


class SchedulerApp:
    def __init__(
        self,
        config: Config,
        *,
        blob_sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        # The time its queue snapshots carry (`updated_at`); tests skew it against other processes'.
        self._wall_clock = wall_clock
        self._blob_sweep_interval_s = blob_sweep_interval_s
        self._sweeper: BlobSweeper | None = None
        self._run = new_run()
        # Its one name (services.scheduler.instances.instance_name): in its logs and welcomes as on
        # its snapshots, records and Drain answers.
        self.instance_name = instance_name(config, self._run)
        interval_s = config.logging.summary_interval_s
        self.summary = WorkSummary(interval_s) if interval_s > 0 else None
        self.metrics = SchedulerMetrics(CollectorRegistry(), summary=self.summary)
        self.metrics.count_models(model.name for model in config.models)
        self.batchers = BatcherRegistry()
        self.supervisor = Supervisor("scheduler")
        self.certificates: CertificateExpiry | None = None  # its TLS certificates' expiry, once started
        self.tracing = Tracing.start(config.tracing, service="scheduler")
        self.port = 0
        self.metrics_port = 0
        self._nc: NatsClient | None = None
        self._flow: JobFlow | None = None
        self._stats: QueueStatsReader | None = None
        self._batch_plans: BatchPlans | None = None
        self._snapshots_js: JetStreamContext | None = None  # where queue snapshots are written
        self._snapshot_writes = SnapshotWrites(heartbeat_s=SNAPSHOT_HEARTBEAT_S)  # which, each round
        self._instance: SchedulerInstance | None = None
        self._store: JobStore | None = None  # the job records: whether a job put back here was taken elsewhere
        self._cluster_queues: ClusterQueues | None = None  # every scheduler's snapshots: GetQueueStats, its last ones
        self._models_registry: ModelRegistryWriter | None = None
        self._pauses: PauseState | None = None
        self._cancels: Subscription | None = None
        self._drains: ClusterDrains | None = None  # drain orders to and from every scheduler
        # Set while dispatching, cleared by a drain (until undrain).
        self._undrained = asyncio.Event()
        self._undrained.set()
        self._submissions = EventRates()
        self._server: GrpcServer | None = None
        self._metrics_server = MetricsServer(
            self.metrics.registry, config.scheduler.host, config.scheduler.metrics_port
        )
        self._dispatchers = ModelDispatchers()
        self._loops: list[asyncio.Task[None]] = []
        self._stopping: asyncio.Task[None] | None = None
        self._webhooks: WebhookService | None = None
        self.deadline_sweep: DeadlineSweep | None = None  # None: scheduler.deadline_sweep_interval_s is 0

    @property
    def flow(self) -> JobFlow:
        if self._flow is None:
            raise RuntimeError("the scheduler has not started")
        return self._flow

    @property
    def nats_connected(self) -> bool:
        """Whether its NATS connection is up now (tests wait on it across a NATS restart)."""
        return self._nc is not None and self._nc.is_connected

    @property
    def webhooks(self) -> WebhookService:
        if self._webhooks is None:
            raise RuntimeError("the scheduler has not started")
        return self._webhooks

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop(grace_s=0.0)
            raise

    async def _start(self) -> None:
        config = self.config
        settings = config.scheduler
        require_keys_beyond_loopback(
            "scheduler", settings.host, config.gateway.api_keys, SCHEDULER_EXPOSES, tls=bool(settings.tls_cert_file)
        )
        tls = serving_certificates("scheduler", settings)  # a bad file stops start-up before anything connects
        self._nc = nc = await connect(config.nats, name=self.instance_name)
        self.certificates = watch_certificates(
            config, "scheduler", self.metrics.registry, self.supervisor, follow=(tls, client_certificates(nc))
        )
        js = nc.jetstream()
        await ensure_work_stream(js, config.nats)
        kv = await ensure_jobs_bucket(js, config.nats)
        for model in config.models:
            await declare_consumers(js, config.nats, model.name, ack_wait_s=settings.ack_wait_s)
        await ensure_dead_letter_stream(js, config.nats)
        queues_kv = await ensure_queues_bucket(js, config.nats)
        self._snapshots_js = js
        queues_bucket = KvBucket(name=config.nats.queues_bucket, kv=queues_kv, js=js)
        self._instance = instance = SchedulerInstance(self.instance_name, self._run, queues_bucket)
        # Its first beat waits out a leader election as the declarations above do (a node lost
        # as the scheduler started: the queues bucket's leader was on it, and the start failed).
        await declaration(lambda _timeout_s: instance.beat(), what="write the scheduler's heartbeat")
        self._cluster_queues = cluster_queues = ClusterQueues(
            js, nc, bucket=config.nats.queues_bucket, scheduler=instance.name, clock=self._wall_clock
        )
        await cluster_queues.start()
        self._pauses = pauses = PauseState(queues_kv, self.supervisor)
        await pauses.start()
        letters = DeadLetterStore(nc, js, config.nats)
        # A keyed job that this scheduler ends has its idempotency claim cut to its retention.
        claim_lifetimes = ClaimLifetimes(
            ClaimStore(await ensure_idempotency_bucket(js, config.nats), js, bucket=config.nats.idempotency_bucket),
            nc,
            self.supervisor,
        )
        store = JobStore(kv, work_stream=config.nats.work_stream, after_write=claim_lifetimes.after_write)
        self._store = store
        claim_lifetimes.start()
        blobs = await ensure_objects_bucket(nc, config.nats)
        queued_records = QueuedRecords()
        self._flow = flow = JobFlow(
            store=store,
            config=config,
            metrics=self.metrics,
            dead_letters=letters,
            claim_check=ClaimCheckIO(blobs, config),
            queued_records=queued_records,
            nc=nc,
            instance_id=instance.id,
            batchers=self.batchers,
            tracing=self.tracing,
        )
        self._batch_plans = batch_plans = BatchPlans(js, config.nats.batches_bucket)
        await batch_plans.start(config.nats)

        runtime = RuntimeModels(  # model names no file declares (start_dispatcher: below)
            config, self.batchers, js=js, start_dispatcher=lambda name: start_dispatcher(name)
        )
        self._stats = stats = QueueStatsReader(
            js=js,
            config=config,
            runtime_models=lambda: runtime.names,
            planned_chunks=batch_plans.planned,
            batchers=self.batchers,
            in_flight_count=flow.in_flight_count,
            completed_per_s=flow.completed_per_s,
            submitted_per_s=self._submissions.per_s,
            is_paused=pauses.is_paused,
            is_draining=lambda: self.draining,
            put_back_count=self._dispatchers.put_back_count,
            batch_sizes=flow.batch_sizes,
            clock=self._wall_clock,
            held_open=self._dispatchers.held_open,
            put_back_jobs=self._dispatchers.put_back_jobs,
            put_back_oldest=self._dispatchers.put_back_oldest,
            forget_put_back=self._dispatchers.forget_put_back,
            nc=nc,
        )
        cluster_queues.desire = stats.desired
        models_kv = await ensure_models_bucket(js, config.nats)
        self._models_registry = registry = ModelRegistryWriter(
            KvBucket(name=config.nats.models_bucket, kv=models_kv, js=js), self.batchers
        )
        self.supervisor.start("scheduler-model-registry", registry.run())
        controls = ModelControls(self.batchers)
        workers = WorkerService(
            scheduler_id=self.instance_name,
            batchers=self.batchers,
            flow=flow,
            on_models=runtime.chained(registry.changed),
            controls=controls,
        )
        self._drains = drains = ClusterDrains(
            nc,
            name=instance.name,
            drain=self.drain,
            undrain=self.undrain,
            is_draining=lambda: self.draining,
            reporting=cluster_queues.reporting,
        )
        ops = OpsService(
            config=config,
            stats=stats,
            letters=letters,
            store=store,
            nc=nc,
            js=js,
            pauses=pauses,
            drain=self.drain,
            undrain=self.undrain,
            scheduler_name=instance.name,
            drains=drains,
            controls=controls,
            knows_model=runtime.knows,
            learnt_models=lambda: runtime.names,
            claims=claim_lifetimes,
            cluster_wide=cluster_queues.cluster_wide,
        )
        self._cancels = await nc.subscribe(CANCEL_SUBJECTS, cb=self._on_cancel)
        await drains.start()
        self._webhooks = WebhookService(config, nc, self.metrics.registry, self.supervisor)
        await self._webhooks.start()

        def add_servicers(server: grpc.aio.Server) -> None:
            worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(workers, server)
            ops_service_pb2_grpc.add_OpsServiceServicer_to_server(ops, server)

        self._server = GrpcServer(
            host=settings.host,
            port=settings.port,
            add_servicers=add_servicers,
            service_names=SERVICE_NAMES,
            max_message_bytes=work_message_bytes(config),
            rpc_metrics=self.metrics.rpc,
            credentials=tls.credentials if tls else None,
            guard=AccessGuard(KeyRing(config.gateway.api_keys), ROLES),
            translate=nats_failure_status,
            keepalive=Keepalive(settings.keepalive_s),
        )
        await self._server.start()
        self.port = self._server.port
        weights = {
            Priority.HIGH: settings.weight_high,
            Priority.NORMAL: settings.weight_normal,
            Priority.LOW: settings.weight_low,
        }

        async def start_dispatcher(model_name: str) -> None:
            if self._stopping is not None:  # a model learnt at runtime as the scheduler stops
                return
            dispatcher = ModelDispatcher(
                nc=nc,
                queues=ModelQueues(
                    nc,
                    config.nats.work_stream,
                    model_name,
                    PrioritySelector(weights, settings.aging_s),
                    empty_for_s=settings.poll_interval_ms / 1000.0,
                ),
                batchers=self.batchers,
                flow=flow,
                poll_interval_s=settings.poll_interval_ms / 1000.0,
                queued_records=queued_records,
                supervisor=self.supervisor,
                resumed=pauses.resumed(model_name),
                undrained=self._undrained,
                on_queued=self._submissions.add,
                hold_pulls_open=settings.hold_pulls_open,
                linger_s=settings.dispatch_linger_ms / 1000.0,
                on_linger=self._count_linger,
            )
            await dispatcher.start()
            self._dispatchers.add(model_name, dispatcher)

        for model in config.models:
            await start_dispatcher(model.name)
        self.supervisor.start("scheduler-runtime-models", runtime.run())
        flow.on_put_back = self._dispatchers.put_back
        flow.on_message_dropped = self._dispatchers.forget_put_back
        self.supervisor.start("scheduler-heartbeat", instance.heartbeat())
        if self.summary is not None:
            self.supervisor.start("scheduler-jobs-summary", self.summary.run())
        reclaimer = LeaseReclaimer(nc, js, store, config, instance, models=lambda: list(self._dispatchers.by_model))
        self.supervisor.start("scheduler-lease-reclaim", reclaimer.run())
        # A peer that dies and is not replaced at once: its jobs back in seconds, not after AckWait.
        peers = PeerWatch(queues_bucket, instance.run, reclaimer.reclaim)
        self.supervisor.start("scheduler-peer-watch", peers.run())
        # A work message no consumer will deliver again (below its ack floor) is queued once more.
        stranded = StrandedMessages(nc, js, store, config, models=lambda: list(self._dispatchers.by_model))
        self.supervisor.start("scheduler-stranded-messages", stranded.run())
        self._loops.append(self._repeat("lease_renewal", settings.lease_renew_interval_s, flow.renew_leases))
        self._loops.append(self._repeat("queue_stats", settings.queue_stats_interval_s, self._observe_queues))
        if settings.deadline_sweep_interval_s > 0:
            self.deadline_sweep = sweep = DeadlineSweep(
                nc=nc,
                js=js,
                store=store,
                stream=config.nats.work_stream,
                metrics=self.metrics,
                models=lambda: list(self._dispatchers.by_model),
                is_paused=pauses.is_paused,
                backlog_s=settings.deadline_sweep_backlog_s,
                clock=self._wall_clock,
                on_message_dropped=self._dispatchers.forget_put_back,
            )
            self._loops.append(self._repeat("deadline_sweep", settings.deadline_sweep_interval_s, sweep.sweep))
        store_usage = StoreUsageReader(js, config.nats, monitor_urls=settings.nats_monitor_urls)

        async def observe_store() -> None:
            self.metrics.observe_store(await store_usage.read())

        # At once: read an interval (30 s) later, a scheduler restarted often (a crash loop, a
        # rollout) showed no store at all, and the dead-letter backlog read 0 meanwhile.
        self._loops.append(self._repeat("store_usage", settings.store_usage_interval_s, observe_store, at_once=True))
        self._sweeper = BlobSweeper(
            blobs, self.supervisor, interval_s=self._blob_sweep_interval_s, orphans_after_s=orphan_age_s(config)
        )
        self._sweeper.start()
        self._metrics_server.start()
        self.metrics_port = self._metrics_server.port
        log.info(
            "scheduler_started",
            scheduler_id=self.instance_name,
            address=self._server.address,
            metrics_port=self.metrics_port,
            models=[m.name for m in config.models],
        )

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stops dispatching, lets in-flight results arrive within grace_s, puts what is still in
        flight back in the queue (redelivered at once, e.g. to another scheduler), ends the
        batchers' streams, stops the server and drains NATS. Idempotent; concurrent calls wait
        for the same stop."""
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop(grace_s))
        await asyncio.shield(self._stopping)

    @property
    def draining(self) -> bool:
        return not self._undrained.is_set()

    async def drain(self, timeout_s: float) -> int:
        """Stops dispatching here (every model; the prelude to stopping, or to maintenance) until
        `undrain`, and waits up to timeout_s for the jobs in flight to finish; how many are still in
        flight. Jobs keep arriving and wait in the queue."""
        if not self.draining:
            log.info("scheduler_draining", scheduler_id=self.instance_name)
            self._undrained.clear()
        # A round that had begun dispatches what it pulled; after that nothing more is taken.
        for dispatcher in self._dispatchers.all:
            await dispatcher.settled()
        if self._flow is None:
            return 0
        await self._flow.wait_idle(timeout_s)
        return len(self._flow.in_flight)

    def undrain(self) -> bool:
        """Ends a drain: every model dispatches again (unless paused). Whether it was draining."""
        was_draining = self.draining
        if was_draining:
            log.info("scheduler_undrained", scheduler_id=self.instance_name)
        self._undrained.set()
        return was_draining

    def _count_linger(self, model_name: str) -> None:
        self.metrics.dispatch_lingers.labels(model=model_name).inc()

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            notice = CancelNotice.decode(msg.data)
        except (ValueError, TypeError) as exc:
            log.warning("cancel_notice_unreadable", error=str(exc))
            return
        if self._flow is not None:
            self._flow.cancel(notice)

    async def _stop(self, grace_s: float) -> None:
        self.supervisor.begin_stop()
        if self._server is not None:
            # NOT_SERVING now: the wait for jobs in flight below may take the whole grace.
            await self._server.begin_shutdown()
        await self._dispatchers.stop()
        if self._drains is not None:  # before the wait for jobs in flight, which an order's drain shares
            await self._drains.stop()
        if self._flow is not None and not await self._flow.wait_idle(grace_s):
            log.warning("stopping_with_jobs_in_flight", jobs=len(self._flow.in_flight))
        # Cancels are heard through the grace: a job cancelled while it waits in its batcher's
        # queue is dropped there (a CancelOrder), not computed to the end of the grace.
        if self._cancels is not None:
            try:
                await self._cancels.unsubscribe()
            except Exception as exc:
                log.warning("cancel_unsubscribe_failed", error=str(exc))
        if self._flow is not None:
            await self._flow.return_all()
        if self._sweeper is not None:
            await self._sweeper.stop()
        await cancel_and_wait(self._loops)
        for session in self.batchers.sessions:
            self.batchers.unregister(session)
        # The queue loop has ended (no snapshot of this scheduler comes after it) and its batchers
        # are gone, to reconnect elsewhere: each model's last snapshot says so.
        await self._write_last_snapshots()
        if self._server is not None:
            await self._server.stop(grace_s)
        if self._flow is not None:
            await self._flow.close()
        if self._webhooks is not None:
            await self._webhooks.stop(grace_s)
        if self._pauses is not None:
            await self._pauses.stop()
        if self._batch_plans is not None:
            await self._batch_plans.stop()
        await self.supervisor.stop()  # the loops not ended above (none, unless one hangs)
        nats_connected = self._nc is not None and self._nc.is_connected
        if self._nc is None:  # a start stopped before it connected (Ctrl-C at `up`'s start): nothing to clear
            pass
        elif not nats_connected:  # the entries and the heartbeat expire with their TTLs
            log.warning("stopping_without_nats", scheduler_id=self.instance_name)
        elif self._models_registry is not None:
            await self._models_registry.clear()
        if nats_connected and self._instance is not None:
            await self._instance.end()
        if self._cluster_queues is not None:
            await self._cluster_queues.stop()
        self._metrics_server.stop()
        await asyncio.to_thread(self.tracing.shutdown)  # flushes the spans not yet exported
        if self._nc is not None:
            await disconnect(self._nc)
        log.info("scheduler_stopped", scheduler_id=self.instance_name)

    async def _write_last_snapshots(self) -> None:
        """Each model's snapshot `stopped` (asyncinfer.snapshot_merge.stopped_snapshot): the gateways
        and the other schedulers drop this one from their merge at once, not SNAPSHOT_STALE_S (15 s)
        and a heartbeat (5 s) later, meanwhile counting its batchers twice once they reconnected to
        another scheduler. Killed, or NATS away, it writes nothing: the stale limit stays the bound."""
        if self._cluster_queues is None or self._snapshots_js is None or self._nc is None or not self._nc.is_connected:
            return
        last = self._cluster_queues.last_words()
        if not last:
            return
        try:
            await write_snapshots(self._snapshots_js, self.config.nats.queues_bucket, last)
        except (NatsError, TimeoutError) as exc:
            log.warning("last_snapshots_not_written", error=f"{type(exc).__name__}: {exc}", models=len(last))

    async def _observe_queues(self) -> None:
        """Metrics, the selectors' aging, and the snapshots the gateway reads."""
        if self._stats is None:
            return
        if self._store is not None:
            # A job put back here that another scheduler took is forgotten before it is counted.
            await check_put_backs(self._store, (d.queues for d in self._dispatchers.all))
        snapshots = await self._stats.snapshot()
        cluster = self._cluster_queues
        cluster_view = snapshots
        if cluster is not None:
            # The cluster's ask, in the gauge (KEDA's max over schedulers) and in the snapshots;
            # the gauges' depths the cluster's too (read as the max over schedulers), while the
            # snapshots keep this scheduler's own put-backs apart (the readers' merge sums them).
            snapshots = [dataclasses.replace(s, desired_batchers=cluster.cluster_desired(s)) for s in snapshots]
            cluster_view = [cluster.with_cluster_depths(s) for s in snapshots]
        self.metrics.observe(cluster_view)
        # Aging on the cluster's oldest times: a job another scheduler put back (its batcher shed
        # it, or was lost) is that one's alone, and it may have no batcher left to pull it; this
        # one, which may, aged its queue as if the job were not there.
        by_model = {s.model_name: s for s in cluster_view}
        for dispatcher in self._dispatchers.all:
            snapshot = by_model.get(dispatcher.model_name)
            if snapshot is not None:
                dispatcher.queues.selector.observe_ages(snapshot.oldest_ages())
        if self.deadline_sweep is not None:
            # The sweep's backlog on this scheduler's own view: the oldest job is either the
            # pending's first, which every scheduler reads, or a put-back its putter counts, so one
            # scheduler at least sweeps, and a sweep reads every message of the model whoever
            # pulled it. On the cluster's view every scheduler would, each reading them all.
            for snapshot in snapshots:
                self.deadline_sweep.observe(snapshot.model_name, snapshot.oldest_ages().values())
        if self._snapshots_js is not None and self._instance is not None:
            due = self._snapshot_writes.due(snapshots, scheduler=self._instance.name)
            if not due:
                return
            try:
                await write_snapshots(self._snapshots_js, self.config.nats.queues_bucket, due)
            except BaseException:
                self._snapshot_writes.failed()
                raise
            self._snapshot_writes.written()

    def _repeat(
        self, name: str, interval_s: float, action: Callable[[], Awaitable[None]], *, at_once: bool = False
    ) -> asyncio.Task[None]:
        """`action` every `interval_s`; with `at_once`, first as it starts (not an interval later)."""

        async def loop() -> None:
            failing_since: float | None = None
            said_at = 0.0
            wait_s = 0.0 if at_once else interval_s
            while True:
                end_if_cancelled()  # a stop's cancellation the last round's NATS request lost
                await asyncio.sleep(wait_s)
                wait_s = interval_s
                try:
                    await action()
                except (NatsError, TimeoutError, Unavailable) as exc:
                    # NATS away or its store full: expected, a line now and then rather than a
                    # traceback every interval (an operator's pass counted 24 in one outage).
                    now = time.monotonic()
                    if failing_since is None or now - said_at >= REPEAT_FAILURE_LOG_S:
                        log.warning(
                            f"{name}_failed", error=f"{type(exc).__name__}: {exc}", since_s=now - (failing_since or now)
                        )
                        said_at = now
                    failing_since = failing_since or now
                    continue
                except Exception:
                    log.exception(f"{name}_failed")
                    continue
                if failing_since is not None:
                    log.info(f"{name}_recovered", after_s=time.monotonic() - failing_since)
                    failing_since = None

        return self.supervisor.start(f"scheduler-{name}", loop())
