"""Loads: pool chunks into the blocks the engine allocated for a hit, in the caller or on a thread.

A load writes only blocks the engine holds for the loading request until the load is reported
finished (vLLM keeps a request's blocks while it waits for remote KV, and frees an aborted one's
only once `finished_recving` names it). Every chunk that did not arrive is reported failed, in a
`finally`, so the engine never waits forever and never computes on a block nobody wrote.

A remote pool can hang (a stopped master answers nothing, for up to 30 s). So off the engine's
thread a read goes into a host buffer the load owns, on a call thread, and the loader waits only
while the pool calls itself healthy: once the call overruns its deadline the pool's breaker opens,
the loader gives up and reports the chunks failed (the engine recomputes them), and the late read, if
it ever returns, lands in that buffer, never in a block the engine has reused.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from kvpool.backends.base import Backend, Rows, Status
from kvpool.chunks import ChunkRef
from kvpool.cuda_runtime import Event
from kvpool.layout import KVLayout

if TYPE_CHECKING:
    from kvpool.worker import WorkerStats

log = logging.getLogger("kvpool.loader")

LoadDone = Callable[[str, list[ChunkRef]], None]  # (request, chunks that failed)
HEALTH_POLL_S = 0.005  # how often a waiting load asks the pool whether its call is stuck


class Abandoned(Exception):
    """A read was given up: the pool stopped answering while it ran."""


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
    ) -> None:
        self.backend = backend
        self._layout = layout
        self.stats = stats
        self.batch_chunks = batch_chunks
        self.sync = sync
        self._on_done = on_done
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._finished: set[str] = set()
        self._failed: dict[str, list[ChunkRef]] = {}
        self._queue: queue.Queue[tuple[str, list[ChunkRef], list[ChunkRef], Event | None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._calls: ThreadPoolExecutor | None = None
        if not sync:
            self._calls = ThreadPoolExecutor(4, thread_name_prefix="kvpool-load-call")
            self._thread = threading.Thread(target=self._run, name="kvpool-loader", daemon=True)
            self._thread.start()

    def start(self, req_id: str, items: list[ChunkRef], missing: list[ChunkRef]) -> None:
        """Load `items`; `missing` (chunks without a key) fail at once. Reported finished either way."""
        with self._lock:
            self._pending += 1
        self.stats.loads += 1
        layout = self._layout()
        # device memory: the load's copy runs after everything the engine queued until now (Model
        # Runner V2 zeroing these very blocks, for one), whichever thread runs it
        after = layout.engine_point() if layout is not None and items else None
        if self.sync:
            self._execute(req_id, items, missing, after)
        elif not self.backend.healthy():
            # fail now, in the engine's thread: never queue behind a call stuck in the pool's client
            self._execute(req_id, [], items + missing)
        else:
            self._queue.put((req_id, items, missing, after))

    def fail(self, req_id: str) -> None:
        """A load the engine waits for that cannot run (nothing to load it into): reported finished and
        failed as a whole, so the engine recomputes the request instead of waiting for it forever."""
        with self._lock:
            self._failed[req_id] = []
            self._finished.add(req_id)

    def _run(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            self._execute(*entry)

    def _execute(
        self,
        req_id: str,
        items: list[ChunkRef],
        missing: list[ChunkRef],
        after: Event | None = None,
    ) -> None:
        failed: list[ChunkRef] = list(items)
        try:
            failed = self._load(items, after)
        except Exception:
            log.exception("load of request %s failed; its blocks will be recomputed", req_id)
        finally:
            failed += missing
            self.stats.chunks_load_failed += len(failed)
            try:
                self._on_done(req_id, failed)
            finally:
                with self._idle:
                    if failed:
                        self._failed.setdefault(req_id, []).extend(failed)
                    self._finished.add(req_id)
                    self._pending -= 1
                    self._idle.notify_all()

    def _load(self, items: list[ChunkRef], after: Event | None) -> list[ChunkRef]:
        layout = self._layout()
        if layout is None:
            raise RuntimeError("load before register_layout: the engine's KV memory is unknown")
        failed: list[ChunkRef] = []
        for offset in range(0, len(items), self.batch_chunks):
            part = items[offset : offset + self.batch_chunks]
            if not self.backend.healthy():
                return failed + items[offset:]
            try:
                results = self._get(layout, part, after)
            except Abandoned:
                log.warning("the pool stopped answering a read of %d chunks; they will be recomputed", len(part))
                return failed + items[offset:]
            except Exception:
                # this batch and the ones not tried are unloaded; earlier batches did load
                log.exception("get of %d chunks failed; their blocks will be recomputed", len(part))
                return failed + items[offset:]
            unusable: list[str] = []
            for item, result in zip(part, results):
                if result is Status.OK:
                    self.stats.chunks_loaded += 1
                    self.stats.bytes_loaded += layout.chunk_nbytes(item.group)
                else:
                    failed.append(item)
                    if result is Status.CORRUPT:
                        self.stats.chunks_corrupt += 1
                    if result in (Status.SIZE_MISMATCH, Status.CORRUPT):
                        unusable.append(item.key)
            if unusable:
                # such a chunk can never load: drop it so lookups stop offering it
                log.warning(
                    "removing %d pool chunks whose size or seal does not match this engine's blocks", len(unusable)
                )
                self.backend.remove(unusable)
        return failed

    def _get(self, layout: KVLayout, part: list[ChunkRef], after: Event | None) -> list[Status]:
        """Read one batch into its blocks, one backend call per KV cache group."""
        results = [Status.ERROR] * len(part)
        by_group: dict[int, list[int]] = {}
        for position, item in enumerate(part):
            by_group.setdefault(item.group, []).append(position)
        for group, positions in by_group.items():
            block_ids = [part[p].block_id for p in positions]
            keys = [part[p].key for p in positions]
            if self._calls is None:
                rows = layout.load_rows(group, block_ids)
                statuses = self.backend.get_into(keys, rows)
            else:
                rows = layout.load_rows(group, block_ids, owned=True)
                statuses = self._bounded_get(keys, rows)
            statuses = layout.verify(group, rows, statuses)
            copied = layout.commit_rows(group, block_ids, rows, [status is Status.OK for status in statuses], after)
            if copied is not None and self._calls is not None:
                copied.synchronize()  # off the engine's thread: reported finished only once on the device
            for position, status in zip(positions, statuses):
                results[position] = status
        return results

    def _bounded_get(self, keys: list[str], rows: Rows) -> list[Status]:
        """The read on a call thread; Abandoned once the pool reports itself unhealthy meanwhile."""
        assert self._calls is not None
        call = self._calls.submit(self.backend.get_into, keys, rows)
        while True:
            try:
                return call.result(timeout=HEALTH_POLL_S)
            except FutureTimeout:
                if not self.backend.healthy():
                    raise Abandoned from None

    def take_finished(self) -> set[str]:
        if not self._finished:  # most steps; one that lands meanwhile is taken at the next step
            return set()
        with self._lock:
            finished, self._finished = self._finished, set()
        return finished

    def take_failed(self) -> dict[str, list[ChunkRef]]:
        """Per request, the chunks that did not load since the last call; none listed: the whole load."""
        if not self._failed:
            return {}
        with self._lock:
            failed, self._failed = self._failed, {}
        return failed

    def drain(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(min(remaining, 0.05))
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)
        if self._calls is not None:
            self._calls.shutdown(wait=False)  # a call stuck in a hung pool's client is left to it
