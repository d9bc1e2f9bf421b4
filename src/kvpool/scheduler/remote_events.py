"""KV events for a pool other engines share (Mooncake): announced from what this engine's workers put.

The scheduler holds no index of a shared pool (other engines write it too, and its master evicts without
telling any client), so its stored events come from the only place that knows a chunk landed: the
worker that put it. Each worker's `PutTracker` reports the chunks its puts stored, with their parents,
through vLLM's worker -> scheduler metadata (the same `PoolReport` an embedded pool's tracker sends);
the scheduler's `RemoteEvents` announces a chunk once it has been put in every namespace its group
needs (TP shards stripe their puts, so the ranks of a shard put different chunks), once.

Invariants: a chunk is announced only after a put of it succeeded in every namespace of its group, and
never twice while it is remembered; what waits for its other namespaces is bounded (`limit` chunks,
oldest forgotten first: a chunk forgotten there is simply not announced). Evictions are not learned, so
none is published: a consumer must treat these events as hints that can go stale (their `locality`
says whether the bytes are in this engine's own segment). A reset empties the pool and withdraws every
chunk still remembered as announced (a removal each), then forgets all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvpool.core.keys import KeySpace
from kvpool.core.pool_reports import PoolEvent, PoolReport

DEFAULT_LIMIT = 1 << 16


class RemoteEvents:
    """Scheduler side: a chunk's stored event once every namespace of its group has had it put."""

    def __init__(self, namespaces: Sequence[Sequence[KeySpace]], limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"remote events limit {limit}: expected at least 1 chunk")
        self.rename(namespaces)
        self.limit = limit
        self.epoch = 0
        # (group, chunk) -> the namespaces it was put in so far, and its parent once known
        self._waiting: OrderedDict[tuple[int, bytes], tuple[set[str], bytes | None]] = OrderedDict()
        self._announced: OrderedDict[tuple[int, bytes], None] = OrderedDict()
        self._events: list[PoolEvent] = []

    def apply(self, report: PoolReport) -> None:
        if report.epoch != self.epoch:
            return  # from before a reset: what it put went with the pool
        for prefix, hashes in report.stored.items():
            group = self._group_of.get(prefix)
            if group is None:
                continue
            parents = report.parents.get(prefix, {})
            needed = self.group_prefixes[group]
            for chunk_hash in hashes:
                key = (group, chunk_hash)
                if key in self._announced:
                    continue
                spaces, parent = self._waiting.pop(key, (set(), None))
                spaces.add(prefix)
                parent = parents.get(chunk_hash, parent)
                if len(spaces) < len(needed):
                    self._waiting[key] = (spaces, parent)
                    continue
                if parent is None:
                    continue  # a router would take a chunk without its parent for a prompt's start
                self._events.append(PoolEvent(group, chunk_hash, True, parent or None))
                self._announced[key] = None
        for table in (self._waiting, self._announced):
            while len(table) > self.limit:
                table.popitem(last=False)

    def rename(self, namespaces: Sequence[Sequence[KeySpace]]) -> None:
        """Follow the spaces under their current names (the engine's weights changed: see `reset`)."""
        self.group_prefixes = [[space.prefix for space in spaces] for spaces in namespaces]
        self._group_of = {prefix: group for group, prefixes in enumerate(self.group_prefixes) for prefix in prefixes}

    def take_events(self) -> list[PoolEvent]:
        events, self._events = self._events, []
        return events

    def reset(self, epoch: int) -> None:
        """The pool was emptied (or this engine's keys renamed): every chunk announced is withdrawn, a
        `BlockRemoved` each, so a router's indexer forgets what it scored this engine for. (vLLM's own
        `AllBlocksCleared` names the engine's cache, and a consumer may read it as that medium only.)"""
        self._events.extend(PoolEvent(group, chunk_hash, False) for group, chunk_hash in self._announced)
        self.epoch = epoch
        self._waiting.clear()
        self._announced.clear()
