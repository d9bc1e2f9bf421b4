"""What the engine's embedded pools hold, known by the scheduler: lookups without leaving its thread.

Each worker rank owns an embedded pool in its own process. A `PoolTracker` on the worker
(`kvpool.worker.pool_tracker`) follows
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
it does, in every namespace of its group, and withdrawn when any of them drops it. With a disk tier,
each event says whether some rank holds the chunk on disk only (`on_disk`); a chunk whose tier
changes while it is present is withdrawn from the old tier and announced in the new one.

Chains. A chunk hash names its whole prefix, so each chunk has one parent (the chunk before it; b""
for a first chunk), and the workers report it with each save. Per namespace the index keeps the set
of *chained* chunks: present, with every ancestor present too. Invariant: a chunk is chained iff it
is present and its parent is b"" or chained. Along any prompt, chained chunks are therefore a prefix,
so a full-attention lookup binary-searches them (11 probes for 2048 chunks) and scans on from there
only through chunks whose chain is not known (a pool that held them before this index existed). The
chained set only has to be sound, never complete: the scan finds the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import islice

from kvpool.core.keys import KeySpace
from kvpool.core.pool_reports import PoolEvent, PoolReport


class _Chains:
    """One namespace's chains: parent links of the chunks some rank holds, and the chained set."""

    __slots__ = ("chained", "children", "parent")

    def __init__(self) -> None:
        self.parent: dict[bytes, bytes] = {}
        self.children: dict[bytes, list[bytes]] = {}
        self.chained: set[bytes] = set()

    def link(self, chunk_hash: bytes, parent: bytes) -> bool:
        """Learn a chunk's parent; True when it was not known."""
        if chunk_hash in self.parent:
            return False
        self.parent[chunk_hash] = parent
        self.children.setdefault(parent, []).append(chunk_hash)
        return True

    def unlink(self, chunk_hash: bytes) -> None:
        """No rank holds the chunk any more: forget its link (its children keep theirs to it)."""
        parent = self.parent.pop(chunk_hash, None)
        if parent is not None:
            siblings = self.children[parent]
            siblings.remove(chunk_hash)
            if not siblings:
                del self.children[parent]

    def extend(self, chunk_hash: bytes, present: Callable[[bytes], bool]) -> None:
        """The chunk became present or learned its parent: chain it, and the present descendants it
        was the missing link of."""
        stack = [chunk_hash]
        chained, parent_of, children = self.chained, self.parent, self.children
        while stack:
            h = stack.pop()
            if h in chained or not present(h):
                continue
            parent = parent_of.get(h)
            if parent is None or (parent and parent not in chained):
                continue
            chained.add(h)
            stack.extend(children.get(h, ()))

    def cut(self, chunk_hash: bytes) -> None:
        """The chunk stopped being present: it and every chained descendant stop being chained."""
        stack = [chunk_hash]
        chained, children = self.chained, self.children
        while stack:
            h = stack.pop()
            if h in chained:
                chained.discard(h)
                stack.extend(children.get(h, ()))

    def clear(self) -> None:
        self.parent.clear()
        self.children.clear()
        self.chained.clear()


class PoolIndex:
    """Scheduler side: per namespace and chunk, how many ranks hold it; present once all that need it do.

    `namespaces[g]` lists the key spaces a chunk of group g must be present in (every TP shard and
    PP stage); `ranks_per_namespace` says how many ranks load from (so must hold) each of them."""

    def __init__(self, namespaces: Sequence[Sequence[KeySpace]], ranks_per_namespace: int = 1) -> None:
        self.rename(namespaces)
        self.needed = ranks_per_namespace
        self.epoch = 0
        self.track_events = False
        self._events: list[PoolEvent] = []
        self._assumed: dict[int, dict[str, set[bytes]]] = {}  # rank -> what `assume` counted for it
        # rank -> the last of its reports absorbed: the step metadata tells the rank, which then frees
        # what those reports withdrew (the hit contract, backends/memory.py); kept across resets
        self.acked: dict[int, int] = {}

    def present(self, group: int, chunk_hashes: Sequence[bytes]) -> list[bool]:
        """Whether each chunk of the group is held by every rank that loads it, in every namespace."""
        needed = self.needed
        counts = [self._counts[prefix] for prefix in self.group_prefixes[group]]
        if len(counts) == 1:
            (held,) = counts
            return [held.get(h, 0) >= needed for h in chunk_hashes]
        return [all(held.get(h, 0) >= needed for held in counts) for h in chunk_hashes]

    def leading(self, group: int, chunk_hashes: Sequence[bytes]) -> int:
        """How many chunks from the first on are present (full attention's whole question): a binary
        search of the chained chunks, then a scan in C from there while chunks are present (chunks whose
        chain is not known); Python only from the first miss."""
        needed = self.needed
        run = len(chunk_hashes)
        for prefix in self.group_prefixes[group]:
            chained = self._chains[prefix].chained
            lo, hi = 0, run
            while lo < hi:  # the first chunk that is not chained; chained chunks are a prefix of any prompt
                mid = (lo + hi) // 2
                if chunk_hashes[mid] in chained:
                    lo = mid + 1
                else:
                    hi = mid
            present = _holder(self._counts[prefix], needed)
            if not all(map(present, islice(chunk_hashes, lo, run))):
                run = next(i for i, h in enumerate(islice(chunk_hashes, lo, run), lo) if not present(h))
        return run

    def assume(self, report: PoolReport) -> None:
        """Count what a rank holds as read from outside it (its disk tier's files, before it runs), until
        the rank's own first report (`full`) replaces it: so the first lookups after a restart hit."""
        self._assumed[report.rank] = {prefix: set(hashes) for prefix, hashes in report.stored.items()}
        self._apply(replace(report, full=False))

    def apply(self, report: PoolReport) -> None:
        """A rank's report, absorbed: it is acknowledged (`acked`) whether or not it still counts."""
        if report.seq > self.acked.get(report.rank, 0):
            self.acked[report.rank] = report.seq
        self._apply(report)

    def _apply(self, report: PoolReport) -> None:
        if report.epoch != self.epoch:
            return  # from before a reset (its chunks were dropped with the pool), or not yet
        if report.full:
            assumed = self._assumed.pop(report.rank, None)
            if assumed is not None:
                report = _reconciled(report, assumed)
        needed = self.needed
        moving = self._tiers_before(report) if self.track_events else {}
        for prefix, hashes in report.dropped.items():
            held = self._counts.get(prefix)
            if held is None:
                continue
            chains = self._chains[prefix]
            for h in hashes:
                count = held.get(h, 0)
                if count <= 0:
                    continue
                if count == needed:
                    chains.cut(h)
                    if self.track_events and self._complete(prefix, h):
                        group = self._group_of[prefix]
                        self._events.append(PoolEvent(group, h, False, on_disk=self._on_disk(group, h)))
                if count == 1:
                    del held[h]
                    chains.unlink(h)
                else:
                    held[h] = count - 1
        self._count_disk(report.promoted, -1)
        announced: list[tuple[str, bytes]] = []  # chunks now complete: announced once their links are in
        for prefix, hashes in report.stored.items():
            held = self._counts.get(prefix)
            if held is None:
                continue
            for h in hashes:
                count = held[h] = held.get(h, 0) + 1
                if self.track_events and count == needed and self._complete(prefix, h):
                    announced.append((prefix, h))
        self._count_disk(report.demoted, +1)
        fresh = set(announced)
        for prefix in {*report.stored, *report.parents}:  # chains, once every count above has moved
            held = self._counts.get(prefix)
            if held is None:
                continue
            chains, present = self._chains[prefix], _holder(held, needed)
            for h, parent in report.parents.get(prefix, {}).items():
                if h not in held:
                    continue
                unknown_elsewhere = self.track_events and self._link_unknown(prefix, h)
                if chains.link(h, parent):
                    chains.extend(h, present)
                    if unknown_elsewhere and (prefix, h) not in fresh and present(h) and self._complete(prefix, h):
                        # present before without a known parent, so never announced: it is now (a file of
                        # the previous format, saved again by a request)
                        announced.append((prefix, h))
            for h in report.stored.get(prefix, ()):
                if present(h):
                    chains.extend(h, present)
        for prefix, h in _parents_first(announced, self._group_of.__getitem__, self._link):
            # a chunk whose parent is not known (found in a pool an earlier engine filled) is not announced:
            # without its parent a router would take it for the start of a prompt
            group = self._group_of[prefix]
            link = self._link(group, h)
            if link is not None:
                self._events.append(PoolEvent(group, h, True, link or None, on_disk=self._on_disk(group, h)))
        just_announced = {(self._group_of[prefix], h) for prefix, h in announced}
        for (group, h), was_on_disk in moving.items():
            link = self._link(group, h)
            if was_on_disk is None or link is None or (group, h) in just_announced or not self.present(group, [h])[0]:
                continue  # announced (or withdrawn) above, or never announced
            if self._on_disk(group, h) != was_on_disk:
                self._events.append(PoolEvent(group, h, False, on_disk=was_on_disk))
                self._events.append(PoolEvent(group, h, True, link or None, on_disk=not was_on_disk))

    def _link_unknown(self, prefix: str, chunk_hash: bytes) -> bool:
        """No namespace of the chunk's group knows its parent (so no event has announced it)."""
        return self._link(self._group_of[prefix], chunk_hash) is None

    def _link(self, group: int, chunk_hash: bytes) -> bytes | None:
        """The chunk's parent as any namespace of its group knows it (b"": a chain's first chunk; None:
        none knows it). Ranks learn links apart (one may hold a file of the previous format), so each
        namespace may know a link the others do not."""
        for prefix in self.group_prefixes[group]:
            link = self._chains[prefix].parent.get(chunk_hash)
            if link is not None:
                return link
        return None

    def _count_disk(self, changes: dict[str, list[bytes]], step: int) -> None:
        for prefix, hashes in changes.items():
            counts = self._disk.get(prefix)
            if counts is None:
                continue
            for h in hashes:
                count = counts.get(h, 0) + step
                if count > 0:
                    counts[h] = count
                else:
                    counts.pop(h, None)

    def _on_disk(self, group: int, chunk_hash: bytes) -> bool:
        return any(self._disk[prefix].get(chunk_hash, 0) > 0 for prefix in self.group_prefixes[group])

    def any_on_disk(self, group: int) -> bool:
        """Does some rank hold any chunk of the group on its disk tier only? (O(namespaces): a pool
        without a disk tier, or with everything in DRAM, answers a hit's tier without a chunk probe.)"""
        return any(self._disk[prefix] for prefix in self.group_prefixes[group])

    def on_disk(self, group: int, chunk_hashes: Sequence[bytes]) -> list[bool]:
        """Whether some rank holds each chunk on its disk tier only: a load of it reads that disk."""
        disk = [self._disk[prefix] for prefix in self.group_prefixes[group]]
        if len(disk) == 1:
            return list(map(disk[0].__contains__, chunk_hashes))  # counts are > 0 or absent
        return [any(h in held for held in disk) for h in chunk_hashes]

    def _tiers_before(self, report: PoolReport) -> dict[tuple[int, bytes], bool | None]:
        """The chunks whose tier the report moves, with their tier before it (None: not present then)."""
        before: dict[tuple[int, bytes], bool | None] = {}
        for changes in (report.demoted, report.promoted):
            for prefix, hashes in changes.items():
                group = self._group_of.get(prefix)
                if group is None:
                    continue
                for h in hashes:
                    if (group, h) not in before:
                        present = self.present(group, [h])[0]
                        before[group, h] = self._on_disk(group, h) if present else None
        return before

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
                        self._events.append(PoolEvent(group, h, False, on_disk=self._on_disk(group, h)))
        for held in (*self._counts.values(), *self._disk.values()):
            held.clear()
        for chains in self._chains.values():
            chains.clear()
        self._assumed.clear()
        self.epoch = epoch

    def rename(self, namespaces: Sequence[Sequence[KeySpace]]) -> None:
        """Index the spaces under their current names, holding nothing (at start-up, or once `reset` has
        emptied the index for the engine's new weights)."""
        self.group_prefixes = [[space.prefix for space in spaces] for spaces in namespaces]
        self._group_of = {prefix: group for group, prefixes in enumerate(self.group_prefixes) for prefix in prefixes}
        self._counts: dict[str, dict[bytes, int]] = {prefix: {} for prefix in self._group_of}
        self._disk: dict[str, dict[bytes, int]] = {prefix: {} for prefix in self._group_of}  # ranks: disk only
        self._chains: dict[str, _Chains] = {prefix: _Chains() for prefix in self._group_of}

    def take_events(self) -> list[PoolEvent]:
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return sum(len(held) for held in self._counts.values())


def _reconciled(report: PoolReport, assumed: dict[str, set[bytes]]) -> PoolReport:
    """A rank's first (full) report as changes to what was assumed for it."""
    stored: dict[str, list[bytes]] = {}
    dropped: dict[str, list[bytes]] = {}
    demoted: dict[str, list[bytes]] = {}
    promoted: dict[str, list[bytes]] = {}
    for prefix in {*report.demoted, *assumed}:  # everything assumed was on disk only
        on_disk, before = report.demoted.get(prefix, []), assumed.get(prefix, set())
        if new := [h for h in on_disk if h not in before]:
            demoted[prefix] = new
        now = set(on_disk)
        if back := [h for h in before if h not in now]:
            promoted[prefix] = back
    for prefix in {*report.stored, *assumed}:
        held = report.stored.get(prefix, [])
        before = assumed.get(prefix, set())
        now = set(held)
        if new := [h for h in held if h not in before]:
            stored[prefix] = new
        if gone := [h for h in before if h not in now]:
            dropped[prefix] = gone
    return PoolReport(report.rank, report.epoch, stored, dropped, report.parents, demoted=demoted, promoted=promoted)


def _parents_first(
    chunks: list[tuple[str, bytes]], group_of: Callable[[str], int], link: Callable[[int, bytes], bytes | None]
) -> list[tuple[str, bytes]]:
    """`chunks` (namespace, hash) with each one after its parent when both are among them (a router
    reading the events needs a chunk's parent first): a restarted tier's files come in no order. A
    parent is the group's (`link`: any namespace of it may be the one that knows). O(len(chunks))."""
    if len(chunks) < 2:
        return chunks
    entries: dict[tuple[int, bytes], list[tuple[str, bytes]]] = {}
    for entry in chunks:
        entries.setdefault((group_of(entry[0]), entry[1]), []).append(entry)
    pending = set(entries)
    ordered: list[tuple[str, bytes]] = []
    for prefix, chunk_hash in chunks:
        node = (group_of(prefix), chunk_hash)
        line: list[tuple[int, bytes]] = []
        while node in pending:  # up through the ancestors not placed yet
            pending.discard(node)
            line.append(node)
            parent = link(*node)
            if not parent:
                break
            node = (node[0], parent)
        for placed in reversed(line):
            ordered.extend(entries[placed])
    return ordered


def _holder(held: dict[bytes, int], needed: int) -> Callable[[bytes], bool]:
    """`chunk_hash -> held by enough ranks`; a dict probe in C when one rank suffices (counts >= 1 or absent)."""
    if needed == 1:
        return held.__contains__
    return lambda chunk_hash: held.get(chunk_hash, 0) >= needed
