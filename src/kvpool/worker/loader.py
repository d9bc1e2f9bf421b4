"""Loads: pool chunks into the blocks the engine allocated for a hit, in the caller or on a thread.

A load writes only blocks the engine holds for the loading request until the load is reported
finished (vLLM keeps a request's blocks while it waits for remote KV, and frees an aborted one's
only once `finished_recving` names it). Every chunk that did not arrive is reported failed, in a
`finally`, so the engine never waits forever and never computes on a block nobody wrote.

Off the engine's thread a call thread reads each batch into a host buffer the load owns, in one
native call that releases the GIL. Where the engine's blocks are host memory, the batches read are
then checked and committed by the engine's own thread at its next step (`take_finished`, a memcpy)
and the load reported there: a commit on the call thread is a dozen numpy calls, each of which gives
up the GIL and waits up to a switch interval (5 ms) to get it back from the engine's thread, which
spins steps while it waits for the load (measured: 40-50 ms a load, against 1 ms on the engine's
thread). Device memory is committed on the call thread (an async copy it waits for).

A remote pool can hang (a stopped master answers nothing, for up to 30 s). So a watchdog asks the
pool whether it is healthy while loads run; once a call overruns its deadline the pool's breaker
opens and the watchdog reports every running load's uncommitted chunks failed (the engine recomputes
them). A load is settled exactly once, under its lock, by whichever of the two gets there first: a
late read, if it ever returns, finds its load settled and lands only in its own buffer, never in a
block the engine has reused.

No load on the call threads waits without bound (a stuck disk, a backend without a breaker, loads
queued behind calls that never return): one still reading `deadline_s` after it started is settled
by the watchdog the same way, its uncommitted chunks failed (counted: `loads_timed_out`). Each rank
times out on its own; the engine unions every rank's failed blocks and requests and waits for every
rank's finish, so a rank that timed out alone still gets the request recomputed on all of them.
Loads in the engine's own call (`sync`: an in-process pool's memcpy) never wait for anything.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvpool.backends.base import Backend, Rows, Status
from kvpool.core.chunks import ChunkRef
from kvpool.core.config import DEFAULT_LOAD_DEADLINE_S
from kvpool.worker.cuda_runtime import Event
from kvpool.worker.host_buffers import HostBuffers
from kvpool.worker.layout import KVLayout

if TYPE_CHECKING:
    from kvpool.worker.stats import WorkerStats

log = logging.getLogger("kvpool.loader")

LoadDone = Callable[[str, list[ChunkRef]], None]  # (request, chunks that failed)
Reads = list[tuple[int, list[int], Rows, list[Status]]]  # per group: (group, positions, rows, statuses)
Batch = tuple[list[ChunkRef], Reads, list[np.ndarray]]  # a batch read: its chunks, reads, buffers taken
HEALTH_POLL_S = 0.005  # how often the watchdog asks the pool whether a running load's call is stuck
CALL_THREADS = 4


@dataclass(eq=False)  # one per load, kept in a set by identity
class _Load:
    """One load's progress, shared by the thread running it and the watchdog."""

    req_id: str
    items: list[ChunkRef]
    missing: list[ChunkRef]
    after: Event | None
    deadline: float = float("inf")  # time.monotonic() past which a load still reading is settled failed
    lock: threading.Lock = field(default_factory=threading.Lock)
    committed: int = 0  # items[:committed] are settled (loaded or failed, in `failed`)
    failed: list[ChunkRef] = field(default_factory=list)
    settled: bool = False  # reported: nothing of this load may touch the engine's blocks any more
    read: list[Batch] = field(default_factory=list)  # batches read, to commit in order
    reading: bool = True  # False: no more batches will be read; commit `read`, then settle

    def remaining_failed(self) -> list[ChunkRef]:
        return self.failed + self.items[self.committed :] + self.missing


class Loader:
    def __init__(
        self,
        backend: Backend,
        layout: Callable[[], KVLayout | None],
        stats: WorkerStats,
        batch_chunks: int,
        *,
        sync: bool,
        on_done: LoadDone,
        deadline_s: float = DEFAULT_LOAD_DEADLINE_S,
    ) -> None:
        self.backend = backend
        self.deadline_s = deadline_s
        self._layout = layout
        self.stats = stats
        self.batch_chunks = batch_chunks
        self.sync = sync
        self._on_done = on_done
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._finished: set[str] = set()
        self._failed: dict[str, list[ChunkRef]] = {}
        self._running: set[_Load] = set()  # started and not settled
        self._reported: dict[str, list[ChunkRef]] = {}  # settled, not yet taken: every chunk of the load
        self._to_commit: list[_Load] = []  # read on a call thread, committed by the engine's at its next step
        self._closed = False
        self._calls: ThreadPoolExecutor | None = None
        self._watchdog: threading.Thread | None = None
        self.buffers = HostBuffers()  # the host buffers reads own, touched once and reused
        if not sync:
            self._calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="kvpool-load-call")
            self._watchdog = threading.Thread(target=self._watch, name="kvpool-load-watch", daemon=True)
            self._watchdog.start()

    def start(self, req_id: str, items: list[ChunkRef], missing: list[ChunkRef]) -> None:
        """Load `items`; `missing` (chunks without a key) fail at once. Reported finished either way."""
        self.stats.loads += 1
        layout = self._layout()
        # device memory: the load's copy runs after everything the engine queued until now (Model
        # Runner V2 zeroing these very blocks, for one), whichever thread runs it
        after = layout.engine_point() if layout is not None and items else None
        load = _Load(req_id, items, missing, after, deadline=time.monotonic() + self.deadline_s)
        with self._idle:
            self._running.add(load)
            self._idle.notify_all()  # wakes the watchdog
        if self._calls is None:
            self._run(load)
        elif not self.backend.healthy():
            # fail now, in the engine's thread: never queue behind a call stuck in the pool's client
            self._settle(load)
        else:
            self._calls.submit(self._run, load)

    def load_in_step(self, req_id: str, items: list[ChunkRef], missing: list[ChunkRef]) -> list[ChunkRef]:
        """A contract hit's load (the pool keeps every chunk it offered readable): read and committed in
        the engine's call, before the forward that computes on it, never reported finished (the engine
        does not wait for it). Returns the chunks that did not load: empty unless the contract broke."""
        if self._calls is not None:
            raise RuntimeError("an in-step load needs an in-process pool read in the engine's call (sync loads)")
        self.stats.loads += 1
        failed = list(missing)
        offset = 0
        try:
            layout = self._layout()
            if layout is None:
                raise RuntimeError("load before register_layout: the engine's KV memory is unknown")
            after = layout.engine_point() if items else None
            while offset < len(items):
                part = items[offset : offset + self.batch_chunks]
                reads = self._read(layout, part, [])
                failed += self._commit(layout, part, reads, after)
                offset += len(part)
        except Exception:
            log.exception("in-step load of request %s failed; its blocks will be recomputed", req_id)
            failed += items[offset:]
        with self._lock:
            self.stats.chunks_load_failed += len(failed)
        self._on_done(req_id, failed)
        return failed

    def fail(self, req_id: str) -> None:
        """A load the engine waits for that cannot run (nothing to load it into): reported finished and
        failed as a whole, so the engine recomputes the request instead of waiting for it forever."""
        with self._lock:
            self._failed[req_id] = []
            self._finished.add(req_id)

    def _run(self, load: _Load) -> None:
        """Read, check and commit the load batch by batch, then report it (unless the watchdog did).
        Host blocks: the batches read are left to the engine's thread to commit and report."""
        on_engine_thread = False
        try:
            layout = self._layout()
            if layout is None:
                raise RuntimeError("load before register_layout: the engine's KV memory is unknown")
            on_engine_thread = self._calls is not None and not layout.staged
            items = load.items
            offset = 0
            while offset < len(items) and not load.settled:
                if not self.backend.healthy():
                    break
                part = items[offset : offset + self.batch_chunks]
                taken: list[np.ndarray] = []
                try:
                    reads = self._read(layout, part, taken)
                except Exception:
                    # this batch and the ones not tried are unloaded; earlier batches did load
                    log.exception("get of %d chunks failed; their blocks will be recomputed", len(part))
                    self._give(taken)  # the call returned (it raised): nothing writes them any more
                    break
                offset += len(part)
                with load.lock:
                    if load.settled:
                        log.warning("the pool stopped answering a read of %d chunks; they were recomputed", len(part))
                        self._give(taken)
                        return
                    if on_engine_thread:
                        load.read.append((part, reads, taken))
                    else:
                        try:
                            load.failed += self._commit(layout, part, reads, load.after)
                            load.committed += len(part)
                        finally:
                            self._give(taken)
        except Exception:
            log.exception("load of request %s failed; its blocks will be recomputed", load.req_id)
        finally:
            if on_engine_thread:
                with load.lock:
                    load.reading = False
                with self._idle:
                    self._to_commit.append(load)
                    self._idle.notify_all()  # a drain waiting on the engine's thread commits it
            else:
                self._settle(load)

    def _commit_read(self) -> None:
        """On the engine's thread: commit and report every load whose reads have all returned."""
        if not self._to_commit:
            return
        with self._lock:
            loads, self._to_commit = self._to_commit, []
        layout = self._layout()
        for load in loads:
            with load.lock:
                batches, load.read = load.read, []
                if load.settled:
                    for _, _, taken in batches:
                        self._give(taken)
                    continue
                try:
                    assert layout is not None
                    for part, reads, _ in batches:
                        load.failed += self._commit(layout, part, reads, load.after)
                        load.committed += len(part)
                except Exception:
                    log.exception("commit of request %s's load failed; its blocks will be recomputed", load.req_id)
                finally:
                    for _, _, taken in batches:
                        self._give(taken)
            self._settle(load)

    def _read(self, layout: KVLayout, part: list[ChunkRef], taken: list[np.ndarray]) -> Reads:
        """One batch read, one backend call per KV cache group: (group, positions, rows, statuses).
        Off the engine's thread into host buffers the load owns (host memory: from `buffers`, each
        appended to `taken`); in the caller, into the blocks."""
        by_group: dict[int, list[int]] = {}
        for position, item in enumerate(part):
            by_group.setdefault(item.group, []).append(position)
        owned = self._calls is not None
        if owned and not layout.staged and len(by_group) > 1 and len({layout.stored_nbytes(g) for g in by_group}) == 1:
            return self._read_together(layout, part, by_group, taken)
        reads = []
        for group, positions in by_group.items():
            if owned and not layout.staged:
                buffer = self.buffers.take(len(positions), layout.stored_nbytes(group))
                taken.append(buffer)
                rows = Rows((buffer,), np.arange(len(positions)))
            else:
                rows = layout.load_rows(group, [part[p].block_id for p in positions], owned=owned)
            statuses = self.backend.get_into([part[p].key for p in positions], rows)
            reads.append((group, positions, rows, statuses))
        return reads

    def _read_together(
        self, layout: KVLayout, part: list[ChunkRef], by_group: dict[int, list[int]], taken: list[np.ndarray]
    ) -> Reads:
        """Every group's chunks in one backend call (host buffers, one chunk size: a hybrid model's
        groups): one host buffer, each group's reads a slice of it."""
        order = [position for positions in by_group.values() for position in positions]
        buffer = self.buffers.take(len(order), layout.stored_nbytes(part[0].group))
        taken.append(buffer)
        statuses = self.backend.get_into([part[p].key for p in order], Rows.checked((buffer,), np.arange(len(order))))
        reads = []
        start = 0
        for group, positions in by_group.items():
            end = start + len(positions)
            reads.append(
                (group, positions, Rows.checked((buffer[start:end],), np.arange(len(positions))), statuses[start:end])
            )
            start = end
        return reads

    def _commit(
        self,
        layout: KVLayout,
        part: list[ChunkRef],
        reads: Reads,
        after: Event | None,
    ) -> list[ChunkRef]:
        """Move a batch's checked reads into their blocks; the chunks that failed."""
        failed: list[ChunkRef] = []
        unusable: list[str] = []
        loaded = loaded_bytes = corrupt = 0
        for group, positions, rows, statuses in reads:
            statuses = layout.verify(group, rows, statuses)
            block_ids = [part[p].block_id for p in positions]
            copied = layout.commit_rows(group, block_ids, rows, [status is Status.OK for status in statuses], after)
            if copied is not None and self._calls is not None:
                copied.synchronize()  # off the engine's thread: reported finished only once on the device
            for position, status in zip(positions, statuses):
                item = part[position]
                if status is Status.OK:
                    loaded += 1
                    loaded_bytes += layout.chunk_nbytes(item.group)
                    continue
                failed.append(item)
                corrupt += status is Status.CORRUPT
                if status in (Status.SIZE_MISMATCH, Status.CORRUPT):
                    unusable.append(item.key)
        with self._lock:  # call threads run loads side by side
            self.stats.chunks_loaded += loaded
            self.stats.bytes_loaded += loaded_bytes
            self.stats.chunks_corrupt += corrupt
        if unusable:
            # such a chunk can never load: drop it so lookups stop offering it (a pool call: never on the
            # engine's thread when a call thread can take it)
            log.warning("removing %d pool chunks whose size or seal does not match this engine's blocks", len(unusable))
            if self._calls is None:
                self.backend.remove(unusable)
            else:
                self._calls.submit(self.backend.remove, unusable)
        return failed

    def _give(self, taken: list[np.ndarray]) -> None:
        for buffer in taken:
            self.buffers.give(buffer)
        taken.clear()

    def _settle(self, load: _Load, whole: bool = False, *, timed_out: bool = False) -> bool:
        """Report the load finished, its uncommitted chunks failed (`whole`: every chunk); only the first
        call does anything (True: this one did; `timed_out`: counted as a load past its deadline)."""
        with load.lock:
            if load.settled:
                return False
            load.settled = True
            failed = load.items + load.missing if whole else load.remaining_failed()
        with self._lock:
            self.stats.chunks_load_failed += len(failed)
            self.stats.loads_timed_out += timed_out
        try:
            self._on_done(load.req_id, failed)
        finally:
            with self._idle:
                if failed:
                    self._failed.setdefault(load.req_id, []).extend(failed)
                self._finished.add(load.req_id)
                self._reported[load.req_id] = load.items + load.missing
                self._running.discard(load)
                self._idle.notify_all()
        return True

    def fence(self) -> int:
        """A pool reset: every load still running is reported failed as a whole, now, so nothing it read
        (from before the reset) is used: the engine recomputes those blocks. A read that returns later
        finds its load settled and lands only in its own buffer. Returns how many loads were fenced."""
        with self._lock:
            running = list(self._running)
        for load in running:
            self._settle(load, whole=True)  # waits for a batch being committed, then fails it too
        with self._lock:
            # loads that ended before the reset but are not yet reported: their bytes are as old
            for req_id in self._finished:
                self._failed[req_id] = list(self._reported.get(req_id, ()))
        return len(running)

    def _watch(self) -> None:
        """While loads run, give up those of a pool that stopped answering (its breaker opened) and those
        still reading past their deadline, as `fence` gives up loads at a reset."""
        while True:
            with self._idle:
                while not self._running and not self._closed:
                    self._idle.wait()
                if self._closed:
                    return
            time.sleep(HEALTH_POLL_S)
            healthy = self.backend.healthy()
            now = time.monotonic()
            with self._lock:
                # the loads not reading wait for the engine's thread to commit them, at its next step
                running = [load for load in self._running if load.reading and (not healthy or now >= load.deadline)]
            late = 0
            for load in running:
                timed_out = now >= load.deadline
                # waits for a batch being committed: those chunks did load
                if self._settle(load, timed_out=timed_out) and timed_out:
                    late += 1
            if late:
                log.warning(
                    "%d loads still reading after load_deadline_s=%.3g s were reported failed (recomputed)",
                    late,
                    self.deadline_s,
                )

    def take_finished(self) -> set[str]:
        """The loads finished since the last call. Call on the engine's thread: it commits the loads
        read into host buffers first."""
        self._commit_read()
        if not self._finished:  # most steps; one that lands meanwhile is taken at the next step
            return set()
        with self._lock:
            finished, self._finished = self._finished, set()
            for req_id in finished:
                self._reported.pop(req_id, None)
        return finished

    def take_failed(self) -> dict[str, list[ChunkRef]]:
        """Per request, the chunks that did not load since the last call; none listed: the whole load."""
        if not self._failed:
            return {}
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed

    def drain(self, timeout_s: float) -> bool:
        """Wait for every load to finish; on the engine's thread (it commits loads read meanwhile)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._commit_read()
            with self._idle:
                if not self._running:
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                if not self._to_commit:
                    self._idle.wait(min(remaining, 0.01))

    def close(self, timeout_s: float = 10.0) -> None:
        with self._idle:
            self._closed = True
            self._idle.notify_all()
        if self._watchdog is not None and self._watchdog.is_alive():
            self._watchdog.join(timeout_s)
        if self._calls is not None:
            self._calls.shutdown(wait=False)  # a call stuck in a hung pool's client is left to it
