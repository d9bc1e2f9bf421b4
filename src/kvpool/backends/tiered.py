"""The embedded pool with a disk tier below it: DRAM for speed, local files for capacity and restarts.

Invariants:
- The engine's thread never touches the disk. A put stores into DRAM (the copy, as without a tier)
  and hands the stored array to a writer thread of its own: the array is pinned, so an eviction
  meanwhile drops it instead of reusing it for another value, and the file always holds the bytes
  the key was put with. The queue is bounded in bytes (`write_queue_bytes`); a put finding it full is
  not written (counted: `writes_skipped`), never waited for. The writer runs at the lowest CPU
  priority (nice 19, its own thread's on Linux): it takes only CPU the engine leaves idle, so a write
  load beyond that fills the queue and skips writes instead of slowing the engine's steps.
- The disk tier holds a superset of what the writer got through (write-behind of every put, not only
  of evictions): a DRAM eviction costs nothing, and an engine that stops (or is killed) leaves its
  pool on disk up to the writes still queued.
- A lookup sees both tiers. A read takes DRAM first; what DRAM lacks is read from disk on the tier's
  read threads into buffers they own, checked, then copied into the destination: a read that has not
  returned by `read_timeout_s` answers UNAVAILABLE (a failed load, recomputed) and can never write
  into the destination later. A disk hit is promoted into DRAM.
- Keys leave the pool (the listeners hear of them) only when neither tier holds them, nor is a write
  of them pending. Keys that move between the tiers (DRAM evicted them and the disk holds them, or
  will once their write lands; a disk hit promoted into DRAM) are told to the tier listeners.
- Both tiers age a chain tail first (DRAM's order of a put is kept by the writer; reads touch the
  disk tail first), so neither drops a prefix's head before its tail.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np

from kvpool.backends.base import BackendStats, Rows, Status, Values
from kvpool.backends.disk import DiskStats, DiskTier
from kvpool.backends.memory import MemoryBackend
from kvpool.backends.memory_values import value_pieces, value_writer

log = logging.getLogger("kvpool.tiered")

READ_THREADS = 4
WRITE_QUEUE_BYTES = 256 << 20  # arrays DRAM evicted before their write still hold memory: at most this
DEFAULT_READ_TIMEOUT_S = 2.0


@dataclass
class TierStats:
    """What the tiering itself did, beside each tier's own counts."""

    writes_queued: int = 0
    writes_skipped: int = 0  # the queue was full: the chunk stays in DRAM only
    write_queue_bytes: int = 0
    disk_hits: int = 0
    disk_late: int = 0  # reads that missed their deadline
    promoted: int = 0


class TieredPool:
    """An embedded `MemoryBackend` over a `DiskTier`; the backend protocol of both at once."""

    name = "memory+disk"

    def __init__(
        self,
        memory: MemoryBackend,
        disk: DiskTier,
        *,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        write_queue_bytes: int | None = None,
    ) -> None:
        self.memory = memory
        self.disk = disk
        self.read_timeout_s = read_timeout_s
        self.write_queue_limit = WRITE_QUEUE_BYTES if write_queue_bytes is None else write_queue_bytes
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[tuple[str, np.ndarray, bytes | None]] = deque()  # (key, array, its link)
        self._links: dict[str, bytes] = {}  # keys being put -> their parent hash, until queued
        self._pending: set[str] = set()  # queued or being written
        self._cancelled: set[str] = set()  # removed while pending: not written, or removed once written
        self._queued_bytes = 0
        self._writing = 0
        self._closed = False
        self._stats = TierStats()
        self._listeners: list[Callable[[list[str]], None]] = []
        self._tier_listeners: list[Callable[[list[str], bool], None]] = []
        self._reads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvpool-disk-read")
        self._read_blocked_until = 0.0
        # reads fence on clears: a read that started before one never fills, promotes or reports
        self._generation = 0  # clears so far
        self._fence = threading.Lock()  # a clear against a read's check-and-promote; taken before _lock
        disk.on_evicted = self._disk_dropped
        memory.on_stored = self._offer
        memory.add_listener(self._memory_dropped)
        self.writer_nice: int | None = None  # the writer's CPU priority once it runs (None: left as it was)
        self._writer = threading.Thread(target=self._write_behind, name="kvpool-disk-write", daemon=True)
        self._writer.start()

    # --- the backend protocol ------------------------------------------------------------------

    def exists(self, keys: Sequence[str]) -> list[bool]:
        contains = self.disk.contains
        return [held or contains(key) for key, held in zip(keys, self.memory.exists(keys))]

    def put(self, keys: Sequence[str], values: Values) -> list[Status]:
        """Into DRAM, whence the writer takes it to disk. A batch larger than half of DRAM goes in
        slices, tail first, each queued for the disk before the next evicts it: DRAM alone would
        refuse what does not fit, and the head of the batch ends in DRAM."""
        sizes, _ = value_writer(values)
        limit = max(1, self.memory.capacity_bytes // 2)
        if sum(sizes) <= limit:
            return self.memory.put(keys, values)
        results: list[Status] = [Status.OK] * len(keys)
        end = len(keys)
        while end > 0:
            start, total = end - 1, sizes[end - 1]
            while start > 0 and total + sizes[start - 1] <= limit:
                start -= 1
                total += sizes[start]
            part = Rows.checked(values.arrays, values.ids[start:end]) if isinstance(values, Rows) else values[start:end]
            results[start:end] = self.memory.put(keys[start:end], part)
            end = start
        return results

    def put_linked(self, keys: Sequence[str], values: Values, parents: Sequence[bytes | None]) -> list[Status]:
        """`put`, each chunk's file keeping its parent's hash (the links a restart announces); DRAM's
        policy is told them too (its chains)."""
        self.memory.link(keys, parents)
        with self._lock:
            for key, parent in zip(keys, parents):
                if parent is not None:
                    self._links[key] = parent
        try:
            return self.put(keys, values)
        finally:
            with self._lock:
                for key in keys:
                    self._links.pop(key, None)  # taken by `_offer` when queued; otherwise not needed

    def get_into(self, keys: Sequence[str], dests: Values) -> list[Status]:
        """DRAM first, then the disk. A clear while this runs (a reset) fails every chunk it read: the
        bytes are from before it (the caller recomputes them), and none of them is promoted."""
        generation = self._generation
        results = self.memory.get_into(keys, dests)
        contains = self.disk.contains
        wanted = [i for i, status in enumerate(results) if status is Status.MISSING and contains(keys[i])]
        if wanted:
            self._read_disk(keys, dests, wanted, results, generation)
        if self._generation != generation:
            return [Status.UNAVAILABLE if status is Status.OK else status for status in results]
        self.disk.touch([keys[i] for i in reversed(range(len(keys))) if results[i] is Status.OK])
        return results

    def remove(self, keys: Sequence[str]) -> int:
        with self._lock:
            self._cancelled.update(key for key in keys if key in self._pending)
        on_disk = self.disk.remove(keys)
        in_memory = self.memory.remove(keys)
        return max(on_disk, in_memory)

    def clear(self) -> int:
        """Empty both tiers; a disk read still running answers UNAVAILABLE and promotes nothing."""
        with self._fence:
            self._generation += 1
            return self._clear()

    def _clear(self) -> int:
        with self._lock:
            dropped = list(self._queue)
            self._queue.clear()
            self._cancelled.update(self._pending)
            self._queued_bytes = 0
        for _, array, _ in dropped:
            self.memory.unpin(array)
        keys = set(self.disk.keys()) | set(self.memory.keys())
        self.disk.clear()
        self.memory.clear()
        return len(keys)

    def keys(self) -> list[str]:
        """Every key either tier holds, least recently used first (disk-only keys before DRAM's)."""
        in_memory = self.memory.keys()
        held = set(in_memory)
        on_disk = self.disk.keys()
        return [key for key in on_disk if key not in held] + in_memory

    def nbytes_of(self, key: str) -> int | None:
        return self.memory.nbytes_of(key)

    def add_listener(self, listener: Callable[[list[str]], None]) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[list[str]], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def add_tier_listener(self, listener: Callable[[list[str], bool], None]) -> None:
        """Call `listener(keys, on_disk)` when keys move to the disk tier only (`on_disk`) or back into DRAM."""
        with self._lock:
            self._tier_listeners.append(listener)

    def remove_tier_listener(self, listener: Callable[[list[str], bool], None]) -> None:
        with self._lock:
            if listener in self._tier_listeners:
                self._tier_listeners.remove(listener)

    def disk_only_keys(self) -> list[str]:
        """The keys the disk tier holds that DRAM does not (all of them, right after a restart)."""
        on_disk = self.disk.keys()
        return [key for key, held in zip(on_disk, self.memory.exists(on_disk)) if not held]

    def stats(self) -> BackendStats:
        """DRAM's counts (capacity, used bytes and evictions are DRAM's), `keys` of both tiers, and the disk's."""
        stats = self.memory.stats()
        disk, tier = self.disk.stats(), self.tier_stats()
        stats.name = self.name
        stats.keys = len(self.keys())
        stats.disk_capacity_bytes, stats.disk_used_bytes, stats.disk_keys = (
            disk.capacity_bytes,
            disk.used_bytes,
            disk.files,
        )
        stats.disk_write_errors, stats.disk_corrupt = disk.write_errors, disk.corrupt
        stats.disk_hits, stats.disk_writes_skipped, stats.disk_late_reads = (
            tier.disk_hits,
            tier.writes_skipped,
            tier.disk_late,
        )
        return stats

    def disk_stats(self) -> DiskStats:
        return self.disk.stats()

    def tier_stats(self) -> TierStats:
        with self._lock:
            self._stats.write_queue_bytes = self._queued_bytes
            return TierStats(**vars(self._stats))

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        """The embedded pool lives as long as the process; close keeps its contents (see `shutdown`)."""

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued write is on disk; False if that took longer than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._wake:
            while self._queue or self._writing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._wake.wait(min(remaining, 0.05))
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (bounded), then stop the writer and the readers."""
        self.flush(timeout_s)
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        self._writer.join(timeout_s)
        self._reads.shutdown(wait=False)
        self.memory.on_stored = None
        self.memory.remove_listener(self._memory_dropped)
        self.disk.close()  # the directory's lock: another process may own it from now on

    # --- write-behind --------------------------------------------------------------------------

    def _offer(self, stored: list[tuple[str, np.ndarray]]) -> None:
        """Under the DRAM pool's lock, on the putting thread: queue the new arrays for the disk."""
        contains = self.disk.contains
        with self._wake:
            if self._closed:
                return
            queued = False
            for key, array in stored:
                if key in self._pending or contains(key):
                    continue
                if self._queued_bytes + array.size > self.write_queue_limit:
                    self._stats.writes_skipped += 1
                    continue
                self.memory.pin(array)
                self._queue.append((key, array, self._links.pop(key, None)))
                self._pending.add(key)
                self._queued_bytes += array.size
                self._stats.writes_queued += 1
                queued = True
            if queued:
                self._wake.notify_all()

    def _write_behind(self) -> None:
        self.writer_nice = _lowest_priority()
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed and not self._queue:
                    return
                key, array, link = self._queue.popleft()
                self._queued_bytes -= array.size
                skip = key in self._cancelled
                self._writing += 1
            status = Status.ERROR
            try:
                if not skip:
                    status = self.disk.write(key, [array], link)
            except Exception:
                log.exception("disk tier: writing a chunk failed")
            finally:
                self.memory.unpin(array)
                with self._wake:
                    self._pending.discard(key)
                    cancelled = key in self._cancelled
                    self._cancelled.discard(key)
                    self._writing -= 1
                    self._wake.notify_all()
            if cancelled and status is Status.OK:
                self.disk.remove([key])
            elif status is not Status.OK and not self.memory.exists([key])[0]:
                self._announce([key])  # evicted from DRAM while its write was pending, and never landed

    # --- reads ---------------------------------------------------------------------------------

    def _read_disk(
        self, keys: Sequence[str], dests: Values, wanted: list[int], results: list[Status], generation: int
    ) -> None:
        """Read `keys[i]` for each i in `wanted` from disk into `dests[i]`, within the read deadline;
        promoted into DRAM unless the pool was cleared since `generation` (the caller's start)."""
        if time.monotonic() < self._read_blocked_until:
            for i in wanted:
                results[i] = Status.UNAVAILABLE
            return
        pieces_of, sizes_of = value_pieces(dests, writable=True)
        deadline = time.monotonic() + self.read_timeout_s
        futures = [(i, self._reads.submit(self.disk.read, keys[i])) for i in wanted]
        promote: list[tuple[str, np.ndarray]] = []
        late = hits = 0
        for i, future in futures:
            try:
                value = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                results[i] = Status.UNAVAILABLE
                late += 1
                continue
            except Exception:
                log.exception("disk tier: reading a chunk failed")
                results[i] = Status.ERROR
                continue
            if isinstance(value, Status):
                results[i] = value
                continue
            sizes = sizes_of(i)
            if sum(sizes) != value.size:
                results[i] = Status.SIZE_MISMATCH
                continue
            offset = 0
            for piece, size in zip(pieces_of(i), sizes):
                piece[:] = value[offset : offset + size]
                offset += size
            results[i] = Status.OK
            hits += 1
            promote.append((keys[i], value))
        if late:
            # a disk that stopped answering: give its reads up for a while rather than wait each time
            self._read_blocked_until = time.monotonic() + self.read_timeout_s
            log.warning("disk tier: %d reads missed their %.1f s deadline (recomputed)", late, self.read_timeout_s)
        with self._lock:
            self._stats.disk_hits += hits
            self._stats.disk_late += late
            self._stats.promoted += len(promote)
        with self._fence:
            if self._generation != generation:
                # the pool was cleared while these files were read: their bytes are from before the
                # reset, so the destinations count as unwritten and nothing is promoted
                for i in wanted:
                    results[i] = Status.UNAVAILABLE
                log.info("disk tier: %d reads overtaken by a clear were dropped (recomputed)", len(wanted))
                return
            if not promote:
                return
            # head to tail, as the caller asked: DRAM's put touches them tail first; under the fence, so
            # no clear comes between the check above and what lands in DRAM (and, by it, on disk)
            promoted = [key for key, _ in promote]
            statuses = self.memory.adopt(promoted, [value for _, value in promote])
        self._moved([key for key, status in zip(promoted, statuses) if status is Status.OK], on_disk=False)

    # --- what leaves the pool ------------------------------------------------------------------

    def _memory_dropped(self, keys: list[str]) -> None:
        contains = self.disk.contains
        with self._lock:
            pending = self._pending
            below = [key in pending or contains(key) for key in keys]
        self._announce([key for key, kept in zip(keys, below) if not kept])
        self._moved([key for key, kept in zip(keys, below) if kept], on_disk=True)

    def _moved(self, keys: list[str], on_disk: bool) -> None:
        if not keys:
            return
        with self._lock:
            listeners = list(self._tier_listeners)
        for listener in listeners:
            listener(keys, on_disk)

    def _disk_dropped(self, keys: list[str]) -> None:
        self._announce([key for key, held in zip(keys, self.memory.exists(keys)) if not held])

    def _announce(self, keys: list[str]) -> None:
        if not keys:
            return
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            listener(keys)


def _lowest_priority() -> int | None:
    """Give the calling thread the lowest CPU priority (nice 19; on Linux a thread's own): the writer
    then only takes CPU the engine leaves idle. Under a write load the engine leaves no room for, the
    queue fills and writes are skipped (counted), rather than steps slowed."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 19)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except (AttributeError, OSError):
        log.debug("disk tier: the writer keeps its CPU priority (setpriority is not available here)")
        return None
