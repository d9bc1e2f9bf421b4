"""What the engine's embedded pools hold, known by the scheduler: lookups without leaving its thread.

Each worker rank owns an embedded pool in its own process. A `PoolTracker` on the worker follows
what its pool holds in the rank's namespaces (chunks its saves stored; chunks the pool evicted,
removed or cleared) and hands the scheduler one `PoolReport` per engine step through vLLM's
worker -> scheduler metadata. The scheduler's `PoolIndex` counts, per namespace and chunk, the
ranks holding it; a chunk counts as present once every rank that loads from its namespace holds it
(the TP ranks of one shard each keep a copy in their own pool). A lookup is then a few dict reads on
the scheduler's thread: no socket, no thread hop, no GIL shared with a worker.

The index lags the pools by the steps in flight, so a load can still race an eviction; it then
fails and is recomputed, as any load does. Reports carry the pool's reset epoch: those from before
a reset are ignored.

The same transitions are the pool's KV events: a chunk is announced once every rank that must hold
it does, in every namespace of its group, and withdrawn when any of them drops it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice

from kvpool.keys import KeySpace


@dataclass
class PoolReport:
    """One rank's changes since its previous report. Flat and small: it is pickled every step."""

    rank: int
    epoch: int
    stored: dict[str, list[bytes]] = field(default_factory=dict)  # namespace prefix -> chunk hashes now held
    dropped: dict[str, list[bytes]] = field(default_factory=dict)  # namespace prefix -> chunk hashes gone


@dataclass(frozen=True)
class PoolEvent:
    """A chunk of a group became present in every namespace it needs (`stored`), or stopped being."""

    group: int
    chunk_hash: bytes
    stored: bool


class PoolTracker:
    """Worker side: what this rank's pool holds in the rank's namespaces, as reports for the scheduler.

    Thread-safe: saves report from the engine thread or the sender, the pool reports removals from
    whichever thread evicts."""

    def __init__(self, rank: int, spaces: Sequence[KeySpace], pool_keys: Sequence[str]) -> None:
        self.rank = rank
        self.prefixes = sorted({space.prefix for space in spaces}, key=len, reverse=True)
        self._lock = threading.Lock()
        self._held: set[str] = set()
        self._stored: dict[str, list[bytes]] = {}
        self._dropped: dict[str, list[bytes]] = {}
        self.epoch = 0
        self.stored(pool_keys)  # what the pool already holds (a pool outliving an earlier engine)

    def _split(self, key: str) -> tuple[str, bytes] | None:
        for prefix in self.prefixes:
            if key.startswith(prefix):
                return prefix, bytes.fromhex(key[len(prefix) :])
        return None

    def stored(self, keys: Sequence[str]) -> None:
        """These keys are now in the pool (put, or found there)."""
        with self._lock:
            for key in keys:
                if key not in self._held:
                    named = self._split(key)
                    if named is not None:
                        self._held.add(key)
                        self._stored.setdefault(named[0], []).append(named[1])

    def dropped(self, keys: Sequence[str]) -> None:
        """These keys left the pool (evicted, removed, cleared)."""
        with self._lock:
            for key in keys:
                if key in self._held:
                    self._held.discard(key)
                    prefix, chunk_hash = self._split(key)  # type: ignore[misc]
                    self._dropped.setdefault(prefix, []).append(chunk_hash)

    def reset(self, epoch: int) -> None:
        """The pool was emptied for a reset: what is held from now on belongs to `epoch`."""
        with self._lock:
            self.epoch = epoch
            self._held.clear()
            self._stored.clear()
            self._dropped.clear()

    def take_report(self) -> PoolReport | None:
        with self._lock:
            if not (self._stored or self._dropped):
                return None
            report = PoolReport(self.rank, self.epoch, self._stored, self._dropped)
            self._stored, self._dropped = {}, {}
        return report


class PoolIndex:
    """Scheduler side: per namespace and chunk, how many ranks hold it; present once all that need it do.

    `namespaces[g]` lists the key spaces a chunk of group g must be present in (every TP shard and
    PP stage); `ranks_per_namespace` says how many ranks load from (so must hold) each of them."""

    def __init__(self, namespaces: Sequence[Sequence[KeySpace]], ranks_per_namespace: int = 1) -> None:
        self.group_prefixes = [[space.prefix for space in spaces] for spaces in namespaces]
        self._group_of = {prefix: group for group, prefixes in enumerate(self.group_prefixes) for prefix in prefixes}
        self.needed = ranks_per_namespace
        self._counts: dict[str, dict[bytes, int]] = {prefix: {} for prefix in self._group_of}
        self.epoch = 0
        self.track_events = False
        self._events: list[PoolEvent] = []

    def present(self, group: int, chunk_hashes: Sequence[bytes]) -> list[bool]:
        """Whether each chunk of the group is held by every rank that loads it, in every namespace."""
        needed = self.needed
        counts = [self._counts[prefix] for prefix in self.group_prefixes[group]]
        if len(counts) == 1:
            (held,) = counts
            return [held.get(h, 0) >= needed for h in chunk_hashes]
        return [all(held.get(h, 0) >= needed for held in counts) for h in chunk_hashes]

    def leading(self, group: int, chunk_hashes: Sequence[bytes]) -> int:
        """How many chunks from the first on are present (full attention's whole question). One pass in C
        while they are present; Python only from the first miss, which an all-miss finds at once."""
        needed = self.needed
        run = len(chunk_hashes)
        for prefix in self.group_prefixes[group]:
            present = _holder(self._counts[prefix], needed)
            if not all(map(present, islice(chunk_hashes, run))):
                run = next(i for i, h in enumerate(islice(chunk_hashes, run)) if not present(h))
        return run

    def apply(self, report: PoolReport) -> None:
        if report.epoch != self.epoch:
            return  # from before a reset (its chunks were dropped with the pool), or not yet
        for prefix, hashes in report.dropped.items():
            held = self._counts.get(prefix)
            if held is None:
                continue
            for h in hashes:
                count = held.get(h, 0)
                if count <= 0:
                    continue
                if self.track_events and count == self.needed and self._complete(prefix, h):
                    self._events.append(PoolEvent(self._group_of[prefix], h, False))
                if count == 1:
                    del held[h]
                else:
                    held[h] = count - 1
        for prefix, hashes in report.stored.items():
            held = self._counts.get(prefix)
            if held is None:
                continue
            for h in hashes:
                count = held[h] = held.get(h, 0) + 1
                if self.track_events and count == self.needed and self._complete(prefix, h):
                    self._events.append(PoolEvent(self._group_of[prefix], h, True))

    def _complete(self, prefix: str, chunk_hash: bytes) -> bool:
        """Is the chunk held by every rank in every namespace of its group (counting `prefix` as full)?"""
        needed = self.needed
        return all(
            other == prefix or self._counts[other].get(chunk_hash, 0) >= needed
            for other in self.group_prefixes[self._group_of[prefix]]
        )

    def reset(self, epoch: int) -> None:
        """The pools were emptied: nothing is held; reports from before `epoch` are ignored."""
        if self.track_events:
            for group, prefixes in enumerate(self.group_prefixes):
                for h in list(self._counts[prefixes[0]]):
                    if self._complete(prefixes[0], h) and self._counts[prefixes[0]][h] >= self.needed:
                        self._events.append(PoolEvent(group, h, False))
        for held in self._counts.values():
            held.clear()
        self.epoch = epoch

    def take_events(self) -> list[PoolEvent]:
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return sum(len(held) for held in self._counts.values())


def _holder(held: dict[bytes, int], needed: int) -> Callable[[bytes], bool]:
    """`chunk_hash -> held by enough ranks`; a dict probe in C when one rank suffices (counts >= 1 or absent)."""
    if needed == 1:
        return held.__contains__
    return lambda chunk_hash: held.get(chunk_hash, 0) >= needed
