"""Worker side: incremental saves captured inside the engine step, an async sender, loads.

Block safety (DESIGN invariant 1): kvpool reads the engine's blocks only inside `save`, which the
engine calls once per step after that step's forward (vLLM: `wait_for_save`). There a save either
puts the blocks into the pool (an in-process pool: the put is the copy) or copies them into host
memory it owns and queues that copy for the sender thread. Once `save` returns, nothing of kvpool
reads an engine block again, so whatever the engine does with it next - free it on preemption,
abort or finish, slide it out of a window, zero it or copy into it (vLLM's Model Runner V2 does both
*before* the connector's pre-forward hook, V1 after it) - cannot reach a stored chunk. No fence, no
delayed frees, the same guarantee in every runner order.

`WorkerCore` is the facade the engine calls. What it knows of each request, and the save ranges
planned from that with two high-water marks, is `SavePlanner`'s (`save_plan.py`); the captured batch
is `save_batch.py`'s, its async put `sender.py`'s, loads `loader.py`'s. One lock guards the planner,
the reset epoch and the pressure gate: the sender's and the loader's threads end batches and loads
while the engine's thread plans the next.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpool.backends.base import Backend, Status
from kvpool.chunks import ChunkRef
from kvpool.device_copy import StagingFull
from kvpool.errors import LayoutError
from kvpool.index import PoolTracker
from kvpool.layout import KVLayout
from kvpool.loader import Loader
from kvpool.masks import MaskCoordinator
from kvpool.metadata import RequestDelta, StepMetadata
from kvpool.plan import GroupPlacement
from kvpool.remote_events import PutTracker
from kvpool.save_batch import SaveBatch
from kvpool.save_plan import SavePlanner
from kvpool.sender import Sender

log = logging.getLogger("kvpool.worker")

RESET_WAIT_S = 10.0  # a reset waits this long for a put from before it (a remote pool bounds its calls)


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


@dataclass
class WorkerStats:
    save_jobs: int = 0  # save batches: one per engine step with new chunks
    save_jobs_dropped: int = 0
    chunks_examined: int = 0
    chunks_already_present: int = 0
    chunks_put: int = 0
    put_calls: int = 0  # backend put calls: a remote pool's cost is mostly per call
    chunks_put_failed: int = 0
    chunks_unreadable: int = 0  # null or freed blocks: nothing to save
    bytes_put: int = 0
    bytes_captured: int = 0  # copied out of the engine's blocks for the sender
    loads: int = 0
    chunks_loaded: int = 0
    chunks_load_failed: int = 0
    chunks_corrupt: int = 0  # loaded chunks whose seal did not match (failed, recomputed, dropped)
    bytes_loaded: int = 0
    pressure_events: int = 0
    resets: int = 0


@dataclass(frozen=True)
class LoadFailures:
    """What to tell the engine about failed loads: blocks to recompute from, or requests to redo."""

    invalid_blocks: set[int]
    failed_requests: set[str]


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
        self.stats = WorkerStats()
        self._lock = threading.Lock()
        self._puts_done = threading.Condition(self._lock)
        self._planner = SavePlanner(coordinator, self.placements, self.stats)
        self._seq = 0
        self._epoch = 0
        self._putting_epoch: int | None = None  # epoch of the batch inside the backend's put, if any
        self._pressure = False
        self._sender: Sender[SaveBatch] = Sender(
            self._store_batches,
            self._drop_batch,
            self.config.save_buffer_bytes,
            enough_chunks=self.config.put_batch_chunks,
            linger_steps=self.config.save_linger_steps,
            linger_s=self.config.save_linger_s,
        )
        self.loader = Loader(
            backend,
            lambda: self.layout,
            self.stats,
            self.config.put_batch_chunks,
            sync=self.config.sync_loads,
            on_done=self._load_done,
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
        if step.reset_epoch > self._epoch:
            self.reset(step.reset_epoch)  # not reached directly by the scheduler
        for req_id in step.failed_loads:
            self.loader.fail(req_id)

    def apply(self, deltas: Iterable[RequestDelta]) -> None:
        """Once per engine step, before its forward: record new hashes and blocks, and start the loads
        the step asks for."""
        for delta in deltas:
            with self._lock:
                self._planner.update(delta)
            if delta.load is not None:  # a request without a state here is reported failed by `load`
                self.load(delta.req_id, delta.load.start_tokens, delta.load.hit_tokens)

    def save(self, deltas: Iterable[RequestDelta]) -> None:
        """After the step's forward: save every request whose saveable length grew, as one batch.
        The engine's blocks are read before this returns and never again."""
        with self._lock:
            batch = self._plan_batch(deltas)
        self._sender.step()
        if batch is None:
            return
        if self.config.sync_saves and not (self.layout is not None and self.layout.staged):
            self._store(batch)  # the embedded pool's put is the copy; device memory is copied on a stream
            return
        if not self.backend.healthy():
            self._drop_batch(batch)  # copying out for a pool that refuses calls is wasted; re-planned later
            return
        try:
            layout = self._layout()
            if not self._sender.has_room(sum(layout.chunk_nbytes(item.group) for item in batch.items)):
                self._drop_batch(batch)  # no device->host copy started for a batch the sender cannot take
                return
            batch.capture(layout)
            self.stats.bytes_captured += batch.nbytes
        except StagingFull:
            self._drop_batch(batch)  # the host staging ring is full of copies in flight: re-planned later
            return
        except Exception:
            log.exception("copying %d chunks out of the engine failed; they are not saved", len(batch.items))
            self._end_batch(batch, [Status.ERROR] * len(batch.items))
            return
        if not self._sender.submit(batch):
            self._drop_batch(batch)  # the buffer is full: the ranges are re-planned by later saves

    def save_request(self, req_id: str, token_len: int, computed_before: int = 0) -> None:
        self.save([RequestDelta(req_id, save_tokens=token_len, computed_before=computed_before)])

    def _plan_batch(self, deltas: Iterable[RequestDelta]) -> SaveBatch | None:
        """Under the lock: the step's new ranges as this epoch's next batch (None: nothing new)."""
        ranges, items = self._planner.plan(deltas)
        if not ranges:
            return None
        self._seq += 1
        self.stats.save_jobs += 1
        return SaveBatch(self._seq, self._epoch, ranges, items)

    def preempt(self, req_ids: Iterable[str]) -> None:
        """Forget the requests (the engine frees their blocks now; captured saves still land)."""
        with self._lock:
            self._planner.preempt(req_ids)

    def finish(self, req_ids: Iterable[str]) -> None:
        """The requests are done; their state goes once their captured saves are put."""
        with self._lock:
            self._planner.finish(req_ids)

    def reset(self, epoch: int, wait_s: float = RESET_WAIT_S) -> int:
        """Empty the pool (vLLM `reset_prefix_cache(reset_connector=True)`, maybe for new weights) so
        that no save taken before lands after: queued ones are dropped (their epoch is old), a put
        already running is waited for, then the pool is emptied. The live requests' KV was computed
        before the reset, so they never save again. Returns how many chunks went (-1: failed).

        The scheduler calls it directly when it can reach the worker (same process); other workers
        run it at their next step, before any load of that step."""
        with self._lock:
            self._epoch = epoch
            self._planner.freeze_all()
            self.stats.resets += 1
            deadline = time.monotonic() + wait_s
            while self._putting_epoch is not None and self._putting_epoch < epoch:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.warning("a save from before the reset is still running; it is removed once it ends")
                    break
                self._puts_done.wait(remaining)
        try:
            return self.backend.clear()
        except Exception:
            log.exception("could not empty the pool after a reset")
            return -1
        finally:
            if self.tracker is not None:
                self.tracker.reset(epoch)

    # ---- storing a batch (the sender thread, or the engine thread with sync_saves) ------------

    def _store(self, batch: SaveBatch) -> None:
        self._store_batches([batch])

    def _store_batches(self, batches: list[SaveBatch]) -> None:
        """Put the batches as one (the pool's fixed cost per call is paid once: the sender takes several
        small ones together); each batch's outcome then moves its own requests' marks."""
        with self._lock:
            epoch = self._epoch
        current = [batch for batch in batches if batch.epoch == epoch]
        for batch in batches:
            if batch.epoch != epoch:  # captured before a reset: never stored
                self._end_batch(batch, [Status.ERROR] * len(batch.items))
        if not current:
            return
        results = [Status.ERROR] * sum(len(batch.items) for batch in current)
        try:
            whole = current[0] if len(current) == 1 else SaveBatch.merge(current)
            results = self._put_batch(whole)
            self._track_stored(whole.items, results)
        except Exception:
            log.exception("save of %d chunks failed", len(results))
        finally:
            # every batch ends, whatever raised: a range left in flight would keep its request forever
            first = 0
            for batch in current:
                self._end_batch(batch, results[first : first + len(batch.items)])
                first += len(batch.items)

    def _track_stored(self, items: list[ChunkRef], results: list[Status]) -> None:
        if self.tracker is not None:
            stored = [item for item, status in zip(items, results) if status is Status.OK]
            self.tracker.stored([item.key for item in stored], [item.parent for item in stored])

    def _put_batch(self, batch: SaveBatch) -> list[Status]:
        with self._lock:
            if batch.epoch != self._epoch:
                return [Status.ERROR] * len(batch.items)  # captured before a reset: never stored
            self._putting_epoch = batch.epoch
        try:
            results = batch.put(
                self.backend,
                self._layout(),
                check_exists=self.config.check_exists_before_put,
                batch_chunks=self.config.put_batch_chunks,
                stats=self.stats,
            )
        finally:
            with self._lock:
                self._putting_epoch = None
                self._puts_done.notify_all()
                stale = batch.epoch != self._epoch
        if stale:
            # a reset gave up waiting for this put: what landed holds KV from before it
            self.backend.remove([item.key for item, status in zip(batch.items, results) if status is Status.OK])
            return [Status.ERROR] * len(batch.items)
        return results

    def _drop_batch(self, batch: SaveBatch) -> None:
        self.stats.save_jobs_dropped += 1
        self._end_batch(batch, [Status.ERROR] * len(batch.items))

    def _end_batch(self, batch: SaveBatch, results: list[Status]) -> None:
        batch.captured = None  # the host copies are done with
        with self._lock:
            self._planner.end_ranges(batch.ranges, results)
            if Status.FULL in results:
                if not self._pressure:
                    self.stats.pressure_events += 1
                self._pressure = True
                self._sender.drop_queued(self._seq)  # what is queued now would find no room either
            elif self._pressure and batch.items and all(status is Status.OK for status in results):
                self._pressure = False

    @property
    def under_pressure(self) -> bool:
        return self._pressure

    def _layout(self) -> KVLayout:
        if self.layout is None:
            raise LayoutError("save or load before register_layout: the engine's KV memory is unknown")
        return self.layout

    # ---- loads --------------------------------------------------------------------------------

    def load(self, req_id: str, start_tokens: int, hit_tokens: int) -> None:
        """Load the chunks of a hit of `hit_tokens` from `start_tokens` on into the request's blocks; the
        engine waits until `take_finished_loads` names the request."""
        with self._lock:
            chunks = self._planner.load_chunks(req_id, start_tokens, hit_tokens)
        if chunks is None:
            log.error("request %s: a load for a request this worker holds no table of; reported failed", req_id)
            self.loader.fail(req_id)
            return
        items, missing = chunks
        self.loader.start(req_id, items, missing)

    def _load_done(self, req_id: str, failed: list[ChunkRef]) -> None:
        """A load ended; the chunks from the first failed one on are not in the pool: save them again."""
        if not failed:
            return
        with self._lock:
            self._planner.load_failed(req_id, failed)

    # ---- results for the engine ---------------------------------------------------------------

    def take_finished_loads(self) -> set[str]:
        """Requests whose load ended (loaded or failed) since the last call."""
        return self.loader.take_finished()

    def take_load_failures(self) -> LoadFailures:
        """Failed loads since the last call, in the form the engine can recompute from."""
        failed = self.loader.take_failed()
        if not failed:
            return LoadFailures(set(), set())
        blocks: set[int] = set()
        requests: set[str] = set()
        for req_id, items in failed.items():
            if items and self.coordinator.resumes_at_failed_chunk:
                blocks.update(item.block_id for item in items)
            else:
                requests.add(req_id)
        return LoadFailures(blocks, requests)

    def active_requests(self) -> int:
        with self._lock:
            return self._planner.active_requests()

    def stored_tokens(self, req_id: str) -> int:
        with self._lock:
            return self._planner.stored_tokens(req_id)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued save and load has run; False on timeout."""
        deadline = time.monotonic() + timeout_s
        return self._sender.drain(timeout_s) and self.loader.drain(max(0.0, deadline - time.monotonic()))

    def close(self, timeout_s: float = 10.0) -> None:
        self._sender.close(timeout_s)
        self.loader.close(timeout_s)
        while self._registered:  # after the last transfer that may read or write it
            self.backend.unregister_region(self._registered.pop())  # type: ignore[attr-defined]
