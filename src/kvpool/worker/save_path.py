"""The save path of one worker rank, stage after stage: plan → capture → put → retire.

`save` runs on the engine's thread once per step, after its forward: it plans the step's new chunks
(`SavePlanner.plan`, marks advanced past them), then either puts them straight from the engine's
blocks (an in-process pool: the put is the copy) or captures host copies (`SaveBatch.capture`) and
queues them for the sender thread. `store` runs the remaining stages on whichever thread puts: the
put (`save_put.put_batch`), the report of what landed (the rank's tracker), and the retirement of
every batch's ranges (`SavePlanner.end_ranges`), which moves their requests' marks. Nothing here reads
an engine block after `save` returns (DESIGN invariant 1).

Resets and pressure live here because they gate the stages: a batch carries the epoch it was taken
in and is never stored after a reset; a put that finds the pool full is asked again after short
pauses (`save_put.FULL_RETRY_S`: the pool may evict meanwhile), and one still refused sets the
pressure gate: until a batch lands whole again, puts are tried once each, without the pauses (the
sender must not fall behind a pool that stays full), and nothing queued is dropped (it holds the
newest chunks, which a pool that evicts oldest first has room for first).

Thread-safety: every planner call and every epoch or pressure change holds the worker's one lock
(`lock`, shared with the load path, which reads the same request states).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from kvpool.backends.base import Backend, Status
from kvpool.core.chunks import ChunkRef
from kvpool.core.metadata import RequestDelta
from kvpool.worker.device_copy import StagingFull
from kvpool.worker.layout import KVLayout
from kvpool.worker.pool_tracker import PoolTracker, PutTracker
from kvpool.worker.save_batch import SaveBatch
from kvpool.worker.save_plan import SavePlanner
from kvpool.worker.save_put import FULL_RETRY_S, put_batch
from kvpool.worker.sender import Sender
from kvpool.worker.stats import WorkerStats

log = logging.getLogger("kvpool.worker")

RESET_WAIT_S = 10.0  # a reset waits this long for a put from before it (a remote pool bounds its calls)


class SavePath:
    """The stages of a rank's saves, called in order by `save` (engine thread) and `store` (putting thread)."""

    def __init__(
        self,
        planner: SavePlanner,
        lock: threading.Lock,
        backend: Backend,
        layout: Callable[[], KVLayout],
        registered: Callable[[], bool],
        stats: WorkerStats,
        *,
        sync: bool,
        check_exists: bool,
        batch_chunks: int,
        buffer_bytes: int,
        linger_steps: int,
        linger_s: float,
        tracker: PoolTracker | PutTracker | None,
    ) -> None:
        self.planner = planner
        self.backend = backend
        self.layout = layout  # the engine's KV memory; raises LayoutError before the engine registered it
        self.registered = registered
        self.stats = stats
        self.tracker = tracker
        self.sync = sync
        self.check_exists = check_exists
        self.batch_chunks = batch_chunks
        self._lock = lock
        self._puts_done = threading.Condition(lock)
        self._seq = 0
        self.epoch = 0
        self._putting_epoch: int | None = None  # epoch of the batch inside the backend's put, if any
        self._pressure = False
        self.sender: Sender[SaveBatch] = Sender(
            self.store,
            buffer_bytes,
            enough_chunks=batch_chunks,
            linger_steps=linger_steps,
            linger_s=linger_s,
        )

    @property
    def under_pressure(self) -> bool:
        return self._pressure

    # ---- engine thread: plan, then put in place or capture ------------------------------------

    def save(self, deltas: Iterable[RequestDelta]) -> None:
        with self._lock:
            batch = self._plan(deltas)
        self.sender.step()
        if batch is None:
            return
        if self.sync and not (self.registered() and self.layout().staged):
            self.store([batch])  # the embedded pool's put is the copy; device memory is copied on a stream
            return
        if not self.backend.healthy():
            self._drop(batch)  # copying out for a pool that refuses calls is wasted; re-planned later
            return
        try:
            layout = self.layout()
            if not self.sender.has_room(sum(layout.chunk_nbytes(item.group) for item in batch.items)):
                self._drop(batch)  # no device->host copy started for a batch the sender cannot take
                return
            batch.capture(layout)
        except StagingFull:
            self._drop(batch)  # the host staging ring is full of copies in flight: re-planned later
            return
        except Exception:
            log.exception("copying %d chunks out of the engine failed; they are not saved", len(batch.items))
            self._retire(batch, [Status.ERROR] * len(batch.items))
            return
        self.stats.bytes_captured += batch.nbytes
        if not self.sender.submit(batch):
            self._drop(batch)  # the buffer is full: the ranges are re-planned by later saves

    def _plan(self, deltas: Iterable[RequestDelta]) -> SaveBatch | None:
        """Under the lock: the step's new ranges as this epoch's next batch (None: nothing new)."""
        ranges, items = self.planner.plan(deltas)
        if not ranges:
            return None
        self._seq += 1
        self.stats.save_jobs += 1
        return SaveBatch(self._seq, self.epoch, ranges, items)

    # ---- putting thread (the sender's, or the engine's with sync saves): put, report, retire ------

    def store(self, batches: list[SaveBatch]) -> None:
        """Put the batches as one (the pool's fixed cost per call is paid once: the sender takes several
        small ones together); each batch's outcome then retires its own ranges."""
        with self._lock:
            epoch = self.epoch
        current = [batch for batch in batches if batch.epoch == epoch]
        for batch in batches:
            if batch.epoch != epoch:  # captured before a reset: never stored
                self._retire(batch, [Status.ERROR] * len(batch.items))
        if not current:
            return
        results = [Status.ERROR] * sum(len(batch.items) for batch in current)
        # a batch of no chunk (every chunk of its ranges another rank's, with striped puts) only moves marks:
        # no put, and it does not keep the others from merging as one array
        carrying = [batch for batch in current if batch.items]
        try:
            if carrying:
                whole = carrying[0] if len(carrying) == 1 else SaveBatch.merge(carrying)
                results = self._put(whole)
                self._report(whole.items, results)
        except Exception:
            log.exception("save of %d chunks failed", len(results))
        finally:
            # every batch retires, whatever raised: a range left in flight would keep its request forever
            first = 0
            for batch in current:
                self._retire(batch, results[first : first + len(batch.items)])
                first += len(batch.items)
            self._note_pressure(results)

    def _put(self, batch: SaveBatch) -> list[Status]:
        with self._lock:
            if batch.epoch != self.epoch:
                return [Status.ERROR] * len(batch.items)  # captured before a reset: never stored
            self._putting_epoch = batch.epoch
        try:
            results = put_batch(
                batch,
                self.backend,
                self.layout(),
                check_exists=self.check_exists,
                batch_chunks=self.batch_chunks,
                stats=self.stats,
                # pauses only off the engine's thread (host copies), and not for a pool that stayed full
                full_retry_s=FULL_RETRY_S if batch.captured is not None and not self._pressure else (),
            )
        finally:
            with self._lock:
                self._putting_epoch = None
                self._puts_done.notify_all()
                stale = batch.epoch != self.epoch
        if stale:
            # a reset gave up waiting for this put: what landed holds KV from before it
            self.backend.remove([item.key for item, status in zip(batch.items, results) if status is Status.OK])
            return [Status.ERROR] * len(batch.items)
        return results

    def _report(self, items: list[ChunkRef], results: list[Status]) -> None:
        if self.tracker is not None:
            stored = [item for item, status in zip(items, results) if status is Status.OK]
            self.tracker.stored([item.key for item in stored], [item.parent for item in stored])

    def _drop(self, batch: SaveBatch) -> None:
        self.stats.save_jobs_dropped += 1
        self._retire(batch, [Status.ERROR] * len(batch.items))

    def _retire(self, batch: SaveBatch, results: list[Status]) -> None:
        batch.captured = None  # the host copies are done with
        with self._lock:
            self.planner.end_ranges(batch.ranges, results)

    def _note_pressure(self, results: list[Status]) -> None:
        """One call's outcome as a whole sets or ends the pressure (a call that stored some chunks and
        was refused others is still pressure)."""
        with self._lock:
            if Status.FULL in results:
                if not self._pressure:
                    self.stats.pressure_events += 1
                self._pressure = True
            elif self._pressure and results and all(status in (Status.OK, Status.DECLINED) for status in results):
                self._pressure = False

    # ---- resets ---------------------------------------------------------------------------------

    def begin_reset(self, epoch: int, wait_s: float = RESET_WAIT_S) -> None:
        """Under the lock: no save taken before `epoch` lands after it. Queued ones are dropped when
        they reach `store` (their epoch is old), the live requests never save again (their KV was
        computed before the reset), and a put already running is waited for up to `wait_s`."""
        self.epoch = epoch
        self.planner.freeze_all()
        deadline = time.monotonic() + wait_s
        while self._putting_epoch is not None and self._putting_epoch < epoch:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.warning("a save from before the reset is still running; it is removed once it ends")
                break
            self._puts_done.wait(remaining)
