"""What this rank's pool holds, or what its puts stored, as one report per engine step for the scheduler.

`PoolTracker` follows an embedded pool (chunks its saves stored; chunks the pool evicted, removed or
cleared) for the scheduler's index (`kvpool.scheduler.index`); `PutTracker` reports a shared pool's
puts for its KV events (`kvpool.scheduler.remote_events`). Both hand over a `PoolReport` of the net
change since the previous one, with each chunk's parent when known.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvpool.core.keys import KeySpace
from kvpool.core.pool_reports import PoolReport


class PoolTracker:
    """Worker side: what this rank's pool holds in the rank's namespaces, as reports for the scheduler.

    A report is the net change since the previous one (a key stored and evicted in between is not in
    it): the index counts ranks per chunk, so it must see each rank's transitions exactly.
    Thread-safe: saves report from the engine thread or the sender, the pool reports removals from
    whichever thread evicts."""

    def __init__(
        self,
        rank: int,
        spaces: Sequence[KeySpace],
        pool_keys: Sequence[str],
        disk_only: Sequence[str] = (),
        parents: Sequence[bytes | None] | None = None,
    ) -> None:
        self.rank = rank
        self.rename(spaces)
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._changed: dict[str, bool] = {}  # key -> whether it was held at the previous report
        self._links: dict[str, bytes] = {}  # key -> its chunk's parent hash, learned since that report
        self._disk_only: set[str] = set()  # held keys a tiered pool holds on its disk tier only
        self._tier_changed: dict[str, bool] = {}  # key -> whether it was disk-only at the previous report
        self.epoch = 0
        self._first = True
        # the hit contract (backends/memory.py): the pool keeps what leaves it readable until the report
        # withdrawing it is acknowledged; key -> the sequence number of that report
        self._seq = 0  # reports taken so far
        self._retiring: dict[str, int] = {}
        self._holding: tuple[Any, int] | None = None  # (the pool, this tracker's holder token)
        # what the pool already holds (a pool outliving an earlier engine, its disk tier), with the parents
        # its files name
        self.stored(pool_keys, parents)
        self.moved(disk_only, on_disk=True)

    def rename(self, spaces: Sequence[KeySpace]) -> None:
        """Follow the spaces under their current names (the engine's weights changed; a reset follows)."""
        self.prefixes = sorted({space.prefix for space in spaces}, key=len, reverse=True)

    def _split(self, key: str) -> tuple[str, bytes] | None:
        for prefix in self.prefixes:
            if key.startswith(prefix):
                return prefix, bytes.fromhex(key[len(prefix) :])
        return None

    def hold(self, pool: Any, token: int) -> None:
        """Hold what leaves `pool` (a `MemoryBackend` that gave this tracker holder `token`) until the
        scheduler acknowledges the report that withdrew it (`acknowledge`)."""
        self._holding = (pool, token)

    def unhold(self) -> None:
        """This rank stops holding (its worker closes; the named pool outlives it)."""
        if self._holding is not None:
            pool, token = self._holding
            self._holding = None
            pool.drop_holder(token)

    def acknowledge(self, seq: int) -> int:
        """The scheduler absorbed this rank's reports up to `seq`: no load armed from now on names what
        they withdrew, and every load armed before has run (steps reach a worker in order). Frees those
        chunks; returns how many."""
        if self._holding is None or not self._retiring:
            return 0
        with self._lock:
            done = [key for key, reported_in in self._retiring.items() if reported_in <= seq]
            for key in done:
                del self._retiring[key]
        pool, token = self._holding
        return int(pool.release(token, done)) if done else 0

    def stored(self, keys: Sequence[str], parents: Sequence[bytes | None] | None = None) -> None:
        """These keys are now in the pool (put, or found there); `parents[i]`, when known, is the chunk
        hash before key i's chunk in its chain (b"": the first chunk)."""
        with self._lock:
            for index, key in enumerate(keys):
                self._retiring.pop(key, None)  # back in the pool (a retired key's put revives it)
                if key not in self._held:
                    if self._split(key) is None:
                        continue  # another engine's namespace
                    self._changed.setdefault(key, False)
                    self._held.add(key)
                elif key in self._disk_only:  # put again: in DRAM
                    self._tier_changed.setdefault(key, True)
                    self._disk_only.discard(key)
                parent = parents[index] if parents is not None else None
                if parent is not None:
                    self._links[key] = parent

    def dropped(self, keys: Sequence[str]) -> None:
        """These keys left the pool (evicted, removed, cleared). Held ones retire until the report that
        withdraws them is acknowledged; another engine's are no index's of this engine: freed now."""
        foreign: list[str] = []
        with self._lock:
            for key in keys:
                if self._holding is not None:
                    if self._split(key) is None:
                        foreign.append(key)
                    else:
                        self._retiring[key] = self._seq + 1  # the next report withdraws it
                if key in self._held:
                    self._changed.setdefault(key, True)
                    self._held.discard(key)
                    if key in self._disk_only:
                        self._tier_changed.setdefault(key, True)
                        self._disk_only.discard(key)
        if foreign and self._holding is not None:
            self._holding[0].release(self._holding[1], foreign)

    def moved(self, keys: Sequence[str], on_disk: bool) -> None:
        """A tiered pool moved these keys between its tiers: now on disk only (`on_disk`), or in DRAM."""
        with self._lock:
            for key in keys:
                if key not in self._held or (key in self._disk_only) == on_disk:
                    continue
                self._tier_changed.setdefault(key, not on_disk)
                if on_disk:
                    self._disk_only.add(key)
                else:
                    self._disk_only.discard(key)

    def reset(self, epoch: int) -> None:
        """The pool was emptied for a reset: what is held from now on belongs to `epoch` (whose index
        starts empty)."""
        with self._lock:
            self.epoch = epoch
            self._retiring.clear()  # the pool was emptied: nothing is retired any more
            self._held.clear()
            self._changed.clear()
            self._links.clear()
            self._disk_only.clear()
            self._tier_changed.clear()

    def take_report(self) -> PoolReport | None:
        """The changes since the previous report; the first one is always made (`full`: it lists all the
        rank holds, which replaces what the scheduler assumed from the rank's disk files)."""
        with self._lock:
            first, self._first = self._first, False
            if not (self._changed or self._links or self._tier_changed or first):
                return None
            report = PoolReport(self.rank, self.epoch, full=first)
            for key, was_held in self._changed.items():
                if (key in self._held) != was_held:
                    prefix, chunk_hash = self._split(key)  # type: ignore[misc]
                    (report.dropped if was_held else report.stored).setdefault(prefix, []).append(chunk_hash)
            for key, parent in self._links.items():
                if key in self._held:
                    prefix, chunk_hash = self._split(key)  # type: ignore[misc]
                    report.parents.setdefault(prefix, {})[chunk_hash] = parent
            if first:  # a full report: every disk-only key, as the index starts from nothing for this rank
                self._tier_changed = {key: False for key in self._disk_only}
            for key, was_on_disk in self._tier_changed.items():
                if (key in self._disk_only) != was_on_disk:
                    prefix, chunk_hash = self._split(key)  # type: ignore[misc]
                    (report.promoted if was_on_disk else report.demoted).setdefault(prefix, []).append(chunk_hash)
            self._changed, self._links, self._tier_changed = {}, {}, {}
            if not (report.stored or report.dropped or report.parents or report.demoted or report.promoted or first):
                return None
            self._seq += 1
            report.seq = self._seq
        return report


class PutTracker:
    """Worker side: the chunks this rank's puts stored since its last report, with their parents. It keeps
    nothing beyond the next report (a shared pool's contents are not this rank's to know). Thread-safe:
    the sender's thread reports puts, the engine's thread takes the report."""

    def __init__(self, rank: int, spaces: Sequence[KeySpace]) -> None:
        self.rank = rank
        self.rename(spaces)
        self.epoch = 0
        self._lock = threading.Lock()
        self._put: dict[str, bytes | None] = {}

    def rename(self, spaces: Sequence[KeySpace]) -> None:
        self.prefixes = sorted({space.prefix for space in spaces}, key=len, reverse=True)

    def stored(self, keys: Sequence[str], parents: Sequence[bytes | None] | None = None) -> None:
        with self._lock:
            for index, key in enumerate(keys):
                self._put[key] = parents[index] if parents is not None else None

    def dropped(self, keys: Sequence[str]) -> None:
        """A shared pool's removals are not this rank's to report (see the module docstring)."""

    def reset(self, epoch: int) -> None:
        with self._lock:
            self.epoch = epoch
            self._put.clear()

    def take_report(self) -> PoolReport | None:
        with self._lock:
            if not self._put:
                return None
            put, self._put = self._put, {}
            report = PoolReport(self.rank, self.epoch)
        for key, parent in put.items():
            for prefix in self.prefixes:
                if key.startswith(prefix):
                    chunk_hash = bytes.fromhex(key[len(prefix) :])
                    report.stored.setdefault(prefix, []).append(chunk_hash)
                    if parent is not None:
                        report.parents.setdefault(prefix, {})[chunk_hash] = parent
                    break
        return report if report.stored else None
