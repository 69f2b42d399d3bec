"""Which queue the next free slot goes to: weighted across priorities with aging, round robin
across tenants within a priority.

Priorities. Each priority has a weight (SchedulerConfig.weight_high/normal/low). Slots are handed
out by weighted fair queuing on counts: the next slot goes to the non-empty priority with the
smallest `(served + 1) / weight`, ties to the higher priority. So with weights 8:3:1 and every
queue busy, HIGH gets 8 slots, NORMAL 3 and LOW 1 out of every 12, and with one free slot and a
fresh start HIGH always goes first. A queue that was found empty is inactive; when it has work
again it starts level with the busiest active queue (no banked credit, so no burst).

Aging: a queue whose oldest waiting job has waited `aging_s` counts one level higher (its weight
becomes that of the level above), two levels after `2 * aging_s`, so a LOW queue under a flood of
HIGH work climbs to HIGH's weight and its share grows until it drains. Ages come from the queue
snapshots (refreshed every queue_stats_interval_s): precise enough for a policy in tens of
seconds. With several schedulers, the cluster's (services.scheduler.cluster_queues.
with_cluster_depths): a job another scheduler pulled and put back (its batcher shed it) is counted
by that one alone, which may have no batcher left to pull it, and ages this one's queue too. An age
is on nats-server's clock (its time in the consumer info against its stamp on the oldest waiting
message, services.scheduler.queue_stats.waited_s), so a step of the scheduler's wall clock ages no
queue; a step of the server's clock ages the jobs stored before it, at worst every queue weighing
as HIGH (equal shares) while they wait; no queue falls below its own weight, so none starves
(docs/ARCHITECTURE.md, "A process that freezes, a clock that jumps"). One exception: a queue where
this scheduler reads no waiting job itself, only another's put-back, is aged on its own wall clock
against the server's stamp on that job (services.scheduler.cluster_queues._cluster_priorities): a
step of that clock ages it the same way, at worst to HIGH's weight while the job waits.

Tenants. Subjects are per (model, priority), not per tenant (that is the gateway's subject
contract), and a JetStream pull cannot pick by tenant. `TenantRoundRobin` therefore chooses from a
small window: while a priority's recent pulls showed more than one tenant (and once a second, as a
probe, while only one was seen), the dispatcher pulls up to twice the free slots, keeps one job per
tenant in turn (starting after the tenant served last) and gives the rest back at once (a NAK
without delay: JetStream redelivers NAKed messages before newer ones, so they keep their place;
the queue's depth still counts them: services.scheduler.work_queue.ModelQueues.put_back).
Otherwise nothing extra is pulled. Messages taken back this way do not spend attempts: attempts
are counted in the job record, not from the message's delivery count. A round whose pull comes
back once a pause or a drain began puts back every job it brought (services.scheduler.dispatcher),
and what the pull charged is refunded (ModelQueues.refund_last_pull): the tenants' turns and the
priorities' counts are as if it had pulled nothing, so the jobs a pause held back go first again.
So is a job a round chose and put back to wait for its version (no batcher serves it, or none with
a free slot: ModelQueues.refund_job), or after a NATS failure at its dispatch, or put back unrun
for another reason not its own (services.scheduler.job_dispatch.PUT_BACK_UNRUN), or adopted as
a redelivery by its attempt running here (nothing new runs), alone: its
priority's count, and its tenant's turn unless a later choice has passed the turn on since.

This is fair among the tenants whose jobs lie near the head of the queue (within the window), not
across a deep backlog: a tenant that queued 10,000 jobs ahead of another's one still goes first
until the window reaches the other's. The gateway's per-tenant limit (max_queued_per_tenant)
bounds how far ahead one tenant can get; full fairness over any depth would need per-tenant
subjects and consumers (a change to the gateway's subject contract).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from asyncinfer.jobs import PRIORITIES_BY_RANK, Priority

T = TypeVar("T")


class PrioritySelector:
    def __init__(self, weights: Mapping[Priority, int], aging_s: float) -> None:
        self._weights = dict(weights)
        self._aging_s = aging_s
        self._served: dict[Priority, float] = dict.fromkeys(PRIORITIES_BY_RANK, 0.0)
        self._active: set[Priority] = set(PRIORITIES_BY_RANK)
        # Oldest waiting age per priority, from the latest snapshot.
        self._oldest_age_s: dict[Priority, float] = {}

    def observe_ages(self, oldest_age_s: Mapping[Priority, float | None]) -> None:
        self._oldest_age_s = {p: age for p, age in oldest_age_s.items() if age is not None}

    def effective_weight(self, priority: Priority) -> int:
        rank = PRIORITIES_BY_RANK.index(priority)
        age = self._oldest_age_s.get(priority, 0.0)
        levels_up = int(age // self._aging_s) if self._aging_s > 0 else 0
        return self._weights[PRIORITIES_BY_RANK[max(rank - levels_up, 0)]]

    def plan(self, slots: int, eligible: Iterable[Priority]) -> dict[Priority, int]:
        """How many of `slots` each eligible priority would get (not yet charged)."""
        candidates = [p for p in PRIORITIES_BY_RANK if p in set(eligible)]
        counts = dict.fromkeys(candidates, 0)
        if not candidates:
            return counts
        self._wake(candidates)
        weights = {p: self.effective_weight(p) for p in candidates}
        for _ in range(slots):
            # min() keeps the first of equals: the higher priority wins ties.
            chosen = min(candidates, key=lambda p: (self._served[p] + counts[p] + 1) / weights[p])
            counts[chosen] += 1
        return counts

    def charge(self, priority: Priority, taken: int) -> None:
        self._served[priority] += taken

    def mark_empty(self, priority: Priority) -> None:
        self._active.discard(priority)

    def _wake(self, candidates: Sequence[Priority]) -> None:
        """Brings queues that were empty level with the active ones (in weighted terms)."""
        woken = [p for p in candidates if p not in self._active]
        if not woken:
            return
        active = [p for p in self._active if p in self._served]
        level = min((self._served[p] / self.effective_weight(p) for p in active), default=0.0)
        for priority in woken:
            self._served[priority] = max(self._served[priority], level * self.effective_weight(priority))
            self._active.add(priority)


class TenantRoundRobin:
    """Round robin across tenants for one queue, over the window of jobs pulled."""

    # The tenants of this many recent jobs decide whether a window is worth pulling.
    MEMORY = 64
    # While only one tenant is seen, a window is pulled this often to notice a second.
    PROBE_INTERVAL_S = 1.0

    def __init__(self) -> None:
        self._recent: deque[str] = deque(maxlen=self.MEMORY)
        self._last_served: str | None = None
        self._last_probe = 0.0

    @property
    def several_tenants(self) -> bool:
        return len(set(self._recent)) > 1

    @property
    def last_served(self) -> str | None:
        """The tenant a job was last chosen for: the next choice starts after it."""
        return self._last_served

    def give_turn_back(self, last_served: str | None) -> None:
        """The jobs chosen since `last_served` was read went back unrun: the turn is where it was."""
        self._last_served = last_served

    def window(self, slots: int) -> int:
        """How many jobs to pull for `slots` free slots."""
        if self.several_tenants:
            return slots * 2
        now = time.monotonic()
        if now - self._last_probe >= self.PROBE_INTERVAL_S:
            self._last_probe = now
            return slots * 2
        return slots

    def choose(self, items: Sequence[tuple[str, T]], slots: int) -> tuple[list[T], list[T]]:
        """(chosen, given back): one job per tenant in turn, each tenant's jobs in queue order."""
        by_tenant: OrderedDict[str, list[T]] = OrderedDict()
        for tenant, item in items:
            by_tenant.setdefault(tenant, []).append(item)
            self._recent.append(tenant)
        if len(items) <= slots:
            if items:
                self._last_served = items[-1][0]
            return [item for _, item in items], []
        tenants = list(by_tenant)
        start = 0
        last = self._last_served
        if last is not None and last in by_tenant:
            start = (tenants.index(last) + 1) % len(tenants)
        order = tenants[start:] + tenants[:start]
        chosen: list[T] = []
        while len(chosen) < slots:
            for tenant in order:
                if by_tenant[tenant] and len(chosen) < slots:
                    chosen.append(by_tenant[tenant].pop(0))
                    self._last_served = tenant
        chosen_ids = {id(c) for c in chosen}
        rest = [item for _, item in items if id(item) not in chosen_ids]
        return chosen, rest
