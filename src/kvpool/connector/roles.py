"""What each connector role runs for a kvpool config and a model plan: the pool it reaches, how it
looks up, and whether loads and saves run on the engine's thread.

Invariants:
- A remote pool (Mooncake) is shared with other engines, so the scheduler asks it: through a client
  of its own that lends the pool no memory (zero segment), closed with the scheduler. Such lookups
  leave the process, so they are async unless configured otherwise.
- Embedded pools live in the workers, one per rank. The scheduler answers lookups from an index of
  them fed by the workers' reports (a chunk counts once every replica of its shard holds it), on its
  own thread and synchronously by default; it never calls `exists`.
- Every load is async: the engine waits for it and never computes on, caches or shares its blocks
  before every rank reported it (see `load_watch`). From an embedded pool the copy itself runs on the
  engine's thread (a memcpy) and is reported finished in the same step; with a disk tier below it,
  on the loader's threads (a disk read must never block the engine), reported a step later.
- With a disk tier, the scheduler counts every rank's files before any rank reports (a restarted
  engine hits from its first request) and announces them as chains (each file keeps its chunk's
  parent); each rank's first report replaces that count.
- An in-process (embedded) pool is put and loaded on the engine's thread, where the put is the copy;
  a remote one through host copies on the sender's and the loader's threads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvpool.backends.base import Backend
from kvpool.backends.disk_file import stored_links
from kvpool.backends.factory import create_backend
from kvpool.backends.memory import MemoryBackend
from kvpool.backends.tiered import TieredPool
from kvpool.core.config import KVPoolConfig
from kvpool.core.plan import CONTRACT_STEPS, ModelPlan
from kvpool.scheduler.index import PoolIndex
from kvpool.scheduler.remote_events import RemoteEvents
from kvpool.scheduler.scheduler_core import Exists, Healthy, SchedulerConfig, SchedulerCore
from kvpool.worker.pool_tracker import PoolTracker, PutTracker
from kvpool.worker.worker_core import WorkerConfig, WorkerCore

log = logging.getLogger("kvpool.roles")

MakeBackend = Callable[[str, dict[str, Any]], Backend]

WORKER_DRAIN_S = 10.0  # at shutdown, how long queued saves and loads may still run


@dataclass
class SchedulerRole:
    core: SchedulerCore
    index: PoolIndex | None  # embedded pools: what they hold
    backend: Backend | None  # remote pool: the scheduler's own client
    events: RemoteEvents | None = None  # remote pool with KV events on: announced from the workers' puts

    def reset(self) -> bool:
        """Lookups miss from now on; the workers empty their pools at their next step, before its loads
        (see WorkerCore.reset). A shared pool is emptied now too. False: emptying it failed."""
        self.core.reset()
        if self.events is not None:
            self.events.reset(self.core.reset_epoch)
        try:
            if self.backend is not None:
                self.backend.clear()
            return True
        except Exception:
            log.exception("could not empty the pool")
            return False

    def change_weights(self, tag: str) -> None:
        """The engine's weights change in place: keys take the new name `tag` from the next step on, and
        everything cached, queued or in flight is dropped as by a reset (see `SchedulerCore.change_weights`);
        a shared pool keeps the old weights' chunks (other engines may still run them), this engine just
        never finds them again, and its KV events withdraw them."""
        self.core.change_weights(tag)
        if self.events is not None:
            self.events.reset(self.core.reset_epoch)
            self.events.rename(self.core.namespaces)

    def close(self) -> None:
        self.core.close()
        if self.backend is not None:
            self.backend.close()


def _no_exists(keys: list[str]) -> list[bool]:
    raise AssertionError("embedded pools are looked up in the index")


def scheduler_role(
    config: KVPoolConfig,
    plan: ModelPlan,
    *,
    track_events: bool = False,
    local_tracker: PoolTracker | None = None,
    make_backend: MakeBackend = create_backend,
) -> SchedulerRole:
    """`track_events`: the index also yields the engine's KV events. `local_tracker`: this engine's
    worker in the same process, whose pool's contents (an earlier engine's saves) count at once."""
    backend: Backend | None = None
    index: PoolIndex | None = None
    events: RemoteEvents | None = None
    exists: Exists
    healthy: Healthy | None
    if config.backend == "mooncake":
        backend = make_backend("mooncake", dict(config.backend_options(), global_segment_size=0))
        exists, healthy = backend.exists, backend.healthy
        if track_events:
            events = RemoteEvents(plan.lookup_namespaces())
    else:
        index = PoolIndex(plan.lookup_namespaces(), ranks_per_namespace=plan.replicas)
        index.track_events = track_events
        exists, healthy = _no_exists, None
        if config.disk_path is not None:
            _assume_disk_contents(index, config, plan)
        report = local_tracker.take_report() if local_tracker is not None else None
        if report is not None:
            index.apply(report)
    remote = backend is not None
    core = SchedulerCore(
        plan.coordinator,
        plan.lookup_namespaces(),
        exists,
        SchedulerConfig(
            save_decode=config.save_decode,
            lookup_async=remote if config.lookup_async is None else config.lookup_async,
            lookup_timeout_s=config.lookup_timeout_s,
            lookup_wait_s=config.lookup_wait_ms / 1000,
            drop_last_hit_block=plan.drop_last_hit_block,
            in_step_bytes=int(config.load_in_step_bytes) if in_step_loads(config, plan) else 0,
            in_step_bytes_per_token=plan.bytes_per_token,
        ),
        healthy=healthy,
        index=index,
    )
    return SchedulerRole(core, index, backend, events)


def in_step_loads(config: KVPoolConfig, plan: ModelPlan) -> bool:
    """Contract hits load in-step: the settings allow it (`KVPoolConfig.in_step_loads`) and the pool is
    large enough for the contract's reserve (`ModelPlan.holds_contract`); the scheduler and every
    worker decide alike, from the same settings and plan."""
    if not config.in_step_loads():
        return False
    if plan.holds_contract(int(config.capacity_bytes)):
        return True
    log.info(
        "kvpool: capacity_bytes %d is under %d engine steps of saves (%d tokens of %.0f bytes): every pool hit "
        "loads async (the hit contract's reserve would take too much of the pool)",
        int(config.capacity_bytes), CONTRACT_STEPS, plan.step_tokens, plan.bytes_per_token,
    )  # fmt: skip
    return False


def _assume_disk_contents(index: PoolIndex, config: KVPoolConfig, plan: ModelPlan) -> None:
    """Count what every rank's disk tier holds before any rank reports (an engine restarted onto its
    directory hits from its first request); each rank's first report then replaces this. Only keys of the
    rank's own namespaces count: the rank's scan reclaims every other file (other weights, layouts)."""
    for rank in range(plan.tp_size * plan.pp_size):
        own = replace(plan, tp_rank=rank % plan.tp_size, pp_rank=rank // plan.tp_size)  # that rank's plan
        spaces = [placement.keys for placement in own.placements()]
        # each file's parent: the chains its events announce
        links = stored_links(config.disk_dir(rank, plan.dp_rank))
        on_disk = list(links)
        report = PoolTracker(rank, spaces, on_disk, disk_only=on_disk, parents=list(links.values())).take_report()
        if report is not None:
            index.assume(report)


def worker_config(config: KVPoolConfig) -> WorkerConfig:
    in_process_pool = config.backend == "memory"
    # a disk tier's reads block: loads run on the loader's threads (a step's delay on every hit)
    sync_loads = in_process_pool and config.disk_path is None
    return WorkerConfig(
        put_batch_chunks=config.put_batch_chunks,
        check_exists_before_put=config.exists_before_put(),
        sync_saves=in_process_pool,
        save_buffer_bytes=config.save_buffer_bytes,
        save_linger_steps=config.save_linger_steps,
        save_linger_s=config.save_linger_ms / 1000,
        sync_loads=sync_loads,
        shared_pool=not in_process_pool,
        load_deadline_s=config.load_deadline_s,
    )


@dataclass
class WorkerRole:
    core: WorkerCore
    backend: Backend
    tracker: PoolTracker | PutTracker | None  # an embedded pool's contents, or a shared pool's puts

    def close(self) -> None:
        if self.tracker is not None and isinstance(self.backend, (MemoryBackend, TieredPool)):
            self.backend.remove_listener(self.tracker.dropped)  # the named pool outlives this worker
        if isinstance(self.tracker, PoolTracker) and isinstance(self.backend, TieredPool):
            self.backend.remove_tier_listener(self.tracker.moved)
        if isinstance(self.tracker, PoolTracker):
            self.tracker.unhold()
        self.core.drain(timeout_s=WORKER_DRAIN_S)
        self.core.close()
        self.backend.close()


def worker_role(
    config: KVPoolConfig, plan: ModelPlan, *, report_puts: bool = False, make_backend: MakeBackend = create_backend
) -> WorkerRole:
    """`report_puts`: a shared pool's worker reports what its puts stored, for the scheduler's KV events
    (an embedded pool's worker always reports what its pool holds: the scheduler's index is made of it)."""
    placements = plan.placements()
    options = config.backend_options(plan.rank, dp_rank=plan.dp_rank, namespaces=[p.keys for p in placements])
    backend = make_backend(config.backend, options)
    tracker: PoolTracker | PutTracker | None = None
    if isinstance(backend, (MemoryBackend, TieredPool)):
        disk_only = backend.disk_only_keys() if isinstance(backend, TieredPool) else []
        tracker = PoolTracker(plan.rank, [p.keys for p in placements], backend.keys(), disk_only)
        backend.add_listener(tracker.dropped)
        if isinstance(backend, TieredPool):
            backend.add_tier_listener(tracker.moved)  # chunks between DRAM and disk: their events' medium
        elif in_step_loads(config, plan) and plan.coordinator.resumes_at_failed_chunk:
            tracker.hold(backend, backend.hold_evictions())  # the hit contract: in-step loads cannot miss
    elif report_puts:
        tracker = PutTracker(plan.rank, [p.keys for p in placements])
    core = WorkerCore(backend, plan.coordinator, placements, config=worker_config(config), tracker=tracker)
    return WorkerRole(core, backend, tracker)
