"""Worker side: incremental saves captured inside the engine step, an async sender, loads.

Block safety (DESIGN invariant 1): kvpool reads the engine's blocks only inside `save`, which the
engine calls once per step after that step's forward (vLLM: `wait_for_save`). There a save either
puts the blocks into the pool (an in-process pool: the put is the copy) or copies them into host
memory it owns and queues that copy for the sender thread. Once `save` returns, nothing of kvpool
reads an engine block again, so whatever the engine does with it next - free it on preemption,
abort or finish, slide it out of a window, zero it or copy into it (vLLM's Model Runner V2 does both
*before* the connector's pre-forward hook, V1 after it) - cannot reach a stored chunk. No fence, no
delayed frees, the same guarantee in every runner order.

`WorkerCore` is the facade the engine calls; it calls the stages and holds no step of either path.
What it knows of each request, and the ranges planned from that with two high-water marks, is
`SavePlanner`'s (`save_plan.py`); the save path's stages are `SavePath`'s (`save_path.py`: plan →
capture → put → retire), the load path's `LoadPath`'s (`load_path.py`: the hit's chunks → read →
retire → report). One lock guards the planner, the reset epoch and
the pressure gate: the sender's and the loader's threads end batches and loads while the engine's
thread plans the next.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpool.backends.base import Backend
from kvpool.core.config import DEFAULT_LOAD_DEADLINE_S
from kvpool.core.errors import LayoutError
from kvpool.core.masks import MaskCoordinator
from kvpool.core.metadata import RequestDelta, StepMetadata
from kvpool.core.plan import GroupPlacement
from kvpool.worker.layout import KVLayout
from kvpool.worker.load_path import LoadFailures, LoadPath
from kvpool.worker.pool_tracker import PoolTracker, PutTracker
from kvpool.worker.save_path import RESET_WAIT_S, SavePath
from kvpool.worker.save_plan import SavePlanner
from kvpool.worker.stats import WorkerStats

log = logging.getLogger("kvpool.worker")

@dataclass
class WorkerConfig:
    put_batch_chunks: int = 64
    check_exists_before_put: bool = True
    # put in the engine step: right for an in-process pool, where the put is the copy out of the engine's
    # blocks anyway; remote pools get a host copy taken in the step and put by the sender thread
    sync_saves: bool = False
    save_buffer_bytes: int = 1 << 30  # host copies queued for the sender; a step beyond this is not saved
    # the sender holds small batches for up to this many steps / seconds, to put several in one call
    save_linger_steps: int = 0
    save_linger_s: float = 0.0
    # load in the caller's thread: right for an in-process pool, where a load is a memcpy and a loader
    # thread would only wait for the GIL while the engine loop spins; remote pools load on a thread
    sync_loads: bool = False
    # a load on the loader's threads still reading this long after it started is reported failed
    load_deadline_s: float = DEFAULT_LOAD_DEADLINE_S
    # other engines read the pool (Mooncake): an in-place weight change leaves it as it is
    shared_pool: bool = False


class WorkerCore:
    """One per engine worker (rank). Thread-safe; the sender and the loader run on their own threads."""

    def __init__(
        self,
        backend: Backend,
        coordinator: MaskCoordinator,
        placements: Sequence[GroupPlacement],
        layout: KVLayout | None = None,
        config: WorkerConfig | None = None,
        tracker: PoolTracker | PutTracker | None = None,
    ) -> None:
        if len(placements) != len(coordinator.kinds):
            raise LayoutError(f"{len(placements)} group placements for {len(coordinator.kinds)} groups")
        self.backend = backend
        self.coordinator = coordinator
        self.placements = list(placements)
        self.layout = layout
        self.config = config or WorkerConfig()
        # an embedded pool's contents for the scheduler's index, or a shared pool's puts for its KV events
        self.tracker = tracker
        self.weights_tag = ""  # the name of the weights loaded since start-up ("": the ones it started with)
        self.cleared_epoch = 0  # the last reset epoch at which this rank emptied its pool
        self.stats = WorkerStats()
        self._lock = threading.Lock()
        self._planner = SavePlanner(coordinator, self.placements, self.stats)
        self.saves = SavePath(
            self._planner,
            self._lock,
            backend,
            self._layout,
            lambda: self.layout is not None,
            self.stats,
            sync=self.config.sync_saves,
            check_exists=self.config.check_exists_before_put,
            batch_chunks=self.config.put_batch_chunks,
            buffer_bytes=self.config.save_buffer_bytes,
            linger_steps=self.config.save_linger_steps,
            linger_s=self.config.save_linger_s,
            tracker=tracker,
        )
        self.loads = LoadPath(
            self._planner,
            self._lock,
            backend,
            lambda: self.layout,
            self.stats,
            batch_chunks=self.config.put_batch_chunks,
            sync=self.config.sync_loads,
            deadline_s=self.config.load_deadline_s,
        )
        self._registered: list[int] = []  # addresses registered with the backend, unregistered at close
        if layout is not None:
            self._register_memory(layout)

    def register_layout(self, layout: KVLayout) -> None:
        if layout.num_groups != len(self.placements):
            raise LayoutError(f"layout has {layout.num_groups} groups, the model {len(self.placements)}")
        self.layout = layout
        self._register_memory(layout)

    def _register_memory(self, layout: KVLayout) -> None:
        """Backends whose transport moves only registered memory (Mooncake over RDMA) get the engine's KV
        memory and the host staging ring registered now, and unregistered at close."""
        if not getattr(self.backend, "registers_kv_memory", False):
            return
        register = self.backend.register_region  # type: ignore[attr-defined]
        for address, nbytes in layout.memory_regions():
            if register(address, nbytes):
                self._registered.append(address)
            else:
                log.warning("registering %d bytes of KV memory at %#x with the pool failed", nbytes, address)

    # ---- per-step entry points -------------------------------------------------------------

    def handle_step(self, step: StepMetadata) -> None:
        """Before the step: forget preempted requests; empty the pool if the scheduler reset it; report
        the loads the scheduler could not arm as failed."""
        if step.preempted:
            self.preempt(step.preempted)
        # a weights change and a reset may arrive in one step: the reset's clear is kept either way
        clear = step.clear_epoch > self.cleared_epoch or not self.config.shared_pool
        if step.weights_tag != self.weights_tag:
            self.change_weights(step.weights_tag, step.reset_epoch, clear=clear)
        elif step.reset_epoch > self.saves.epoch:
            self.reset(step.reset_epoch, clear=clear)  # not reached directly by the scheduler
        for req_id in step.failed_loads:
            self.loads.fail(req_id)
        if step.pool_acks and isinstance(self.tracker, PoolTracker):
            # before this step's loads, armed without what the acknowledged reports withdrew
            self.tracker.acknowledge(step.pool_acks.get(self.tracker.rank, 0))

    def apply(self, deltas: Iterable[RequestDelta]) -> None:
        """Once per engine step, before its forward: record new hashes and blocks, and start the loads
        the step asks for."""
        for delta in deltas:
            with self._lock:
                self._planner.update(delta)
            if delta.load is not None:  # a request without a state here is reported failed by `load`
                self.loads.start(delta.req_id, delta.load.start_tokens, delta.load.hit_tokens, delta.load.in_step)

    def save(self, deltas: Iterable[RequestDelta]) -> None:
        """After the step's forward: save every request whose saveable length grew, as one batch.
        The engine's blocks are read before this returns and never again."""
        self.saves.save(deltas)

    def save_request(self, req_id: str, token_len: int, computed_before: int = 0) -> None:
        self.save([RequestDelta(req_id, save_tokens=token_len, computed_before=computed_before)])

    def preempt(self, req_ids: Iterable[str]) -> None:
        """Forget the requests (the engine frees their blocks now; captured saves still land)."""
        with self._lock:
            self._planner.preempt(req_ids)

    def finish(self, req_ids: Iterable[str]) -> None:
        """The requests are done; their state goes once their captured saves are put."""
        with self._lock:
            self._planner.finish(req_ids)

    def reset(self, epoch: int, wait_s: float = RESET_WAIT_S, *, clear: bool = True) -> int:
        """Empty the pool (vLLM `reset_prefix_cache(reset_connector=True)`, maybe for new weights) so
        that no save taken before lands after: queued ones are dropped (their epoch is old), a put
        already running is waited for, then the pool is emptied. The live requests' KV was computed
        before the reset, so they never save again. Every load still reading is reported failed as a
        whole (recomputed), and a tiered pool drops what its disk reads bring back after the clear: no
        read that started before the reset stores, promotes or reports what it read. Returns how many
        chunks went (-1: failed). `clear=False`: the pool keeps its chunks (a shared pool whose chunks
        this engine no longer names: `change_weights`).

        The scheduler calls it directly when it can reach the worker (same process); other workers
        run it at their next step, before any load of that step."""
        with self._lock:
            self.stats.resets += 1
            self.saves.begin_reset(epoch, wait_s)
        fenced = self.loads.loader.fence()  # before the clear: what they read is from before the reset
        if fenced:
            log.info("reset: %d loads still reading were reported failed (recomputed)", fenced)
        if clear:
            self.cleared_epoch = max(self.cleared_epoch, epoch)
        try:
            return self.backend.clear() if clear else 0
        except Exception:
            log.exception("could not empty the pool after a reset")
            return -1
        finally:
            if self.tracker is not None:
                self.tracker.reset(epoch)

    def change_weights(self, tag: str, epoch: int, *, clear: bool | None = None) -> None:
        """The engine's weights changed in place: every key this rank builds from now on names `tag`, and
        the change is a reset for what was taken before it (queued saves dropped, loads still reading
        reported failed, live requests never saved again). An embedded pool is emptied as by a reset; a
        shared one keeps the old weights' chunks for the engines that still run them (no key of this
        engine names them again); `clear=True` empties it anyway (a reset of the pool came in the same step)."""
        for placement in self.placements:
            placement.keys.retag(tag)
        if self.tracker is not None:
            self.tracker.rename([placement.keys for placement in self.placements])
        self.weights_tag = tag
        self.reset(max(epoch, self.saves.epoch), clear=not self.config.shared_pool if clear is None else clear)

    @property
    def under_pressure(self) -> bool:
        return self.saves.under_pressure

    def _layout(self) -> KVLayout:
        if self.layout is None:
            raise LayoutError("save or load before register_layout: the engine's KV memory is unknown")
        return self.layout

    # ---- loads --------------------------------------------------------------------------------

    def load(self, req_id: str, start_tokens: int, hit_tokens: int) -> None:
        """Load the chunks of a hit of `hit_tokens` from `start_tokens` on into the request's blocks; the
        engine waits until `take_finished_loads` names the request."""
        self.loads.start(req_id, start_tokens, hit_tokens)

    # ---- results for the engine ---------------------------------------------------------------

    def take_finished_loads(self) -> set[str]:
        """Requests whose load ended (loaded or failed) since the last call."""
        return self.loads.take_finished()

    def take_load_failures(self) -> LoadFailures:
        """Failed loads since the last call, in the form the engine can recompute from."""
        return self.loads.take_failures()

    def active_requests(self) -> int:
        with self._lock:
            return self._planner.active_requests()

    def stored_tokens(self, req_id: str) -> int:
        with self._lock:
            return self._planner.stored_tokens(req_id)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued save and load has run; False on timeout."""
        deadline = time.monotonic() + timeout_s
        return self.saves.sender.drain(timeout_s) and self.loads.loader.drain(max(0.0, deadline - time.monotonic()))

    def close(self, timeout_s: float = 10.0) -> None:
        self.saves.sender.close(timeout_s)
        self.loads.loader.close(timeout_s)
        while self._registered:  # after the last transfer that may read or write it
            self.backend.unregister_region(self._registered.pop())  # type: ignore[attr-defined]
