"""`ChainPolicy`: eviction among chain leaves (oldest first, optionally weighted by class) and, optionally,
second-sight admission; the rules and their invariants: `__init__.py`."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvpool.core.policy.base import ROOT, PolicyCounters, _nothing, parent_key

GHOST_FACTOR = 4  # chunks remembered but not held, per chunk held
MIN_GHOST = 256
WEIGHT_DECAY = 0.5  # each class's hits and occupancy at every weight update

_SEEN_AGAIN = 2  # classes: seen at least this many times, or fewer
_CLASSES = 4  # (seen again) x (extended)


class _Meta:
    """What a policy knows of one chunk, held or in its ghost."""

    __slots__ = ("cls", "extended", "kids", "last", "parent", "seen", "size")

    def __init__(self, parent: str | None, size: int) -> None:
        self.seen = 0  # sightings: loads, puts (stored or declined)
        self.extended = False  # some chunk names it as parent
        self.last = 0  # tick of the last sighting
        self.parent = parent  # ROOT, a key, or None (not known)
        self.kids = 0  # held chunks naming it as parent, while it is held
        self.size = size
        self.cls = -1  # its class while held, -1 in the ghost


class ChainPolicy:
    """Eviction among chain leaves, oldest first, optionally weighted by class; admission of every chunk
    or only of chunks seen before (and their chain's extension) once the pool is full.

    Time is ticks: one a chunk sighted (loaded or put), so the policy is the same at any request rate.
    `weighted`: a candidate's age is divided by its class's weight, the hits its held chunks earned per
    held chunk and tick since the last updates (relative to the mean over classes): a class whose chunks
    are rarely read again goes first at a given age. `second_sight`: the admission above."""

    def __init__(self, *, weighted: bool = False, second_sight: bool = False, name: str | None = None) -> None:
        self.weighted = weighted
        self.second_sight = second_sight
        self.name = name or _variant_name(weighted, second_sight)
        self._meta: dict[str, _Meta] = {}
        # per class, its leaves by last sighting (oldest first; an entry is stale once its chunk was
        # sighted again, changed class, got a held child or left)
        self._heaps: list[list[tuple[int, str]]] = [[] for _ in range(_CLASSES)]
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self._links: dict[str, str | None] = {}  # parents told by `link`, taken by the next put of the key
        self._fresh: set[str] = set()  # what the latest put admitted: the pool is still writing it
        # per chunk not held, the held chunks naming it as parent (stored before it, or it left before
        # them): its `kids` once it is stored
        self._orphans: dict[str, int] = {}
        self._tick = 0
        self._held = 0  # chunks held, as this policy believes
        self._held_bytes = 0
        self._hits = [1.0] * _CLASSES
        self._occupancy = [1.0] * _CLASSES
        self._count = [0] * _CLASSES
        self._accrued_at = 0
        self._weights = [1.0] * _CLASSES
        self._reweigh_at = 0
        self._counters = PolicyCounters(self.name)

    # --- the policy protocol -----------------------------------------------------------------------

    def link(self, keys: Sequence[str], parents: Sequence[bytes | None]) -> None:
        links = self._links
        if len(links) > 1 << 16:  # links of puts that never came: forget them rather than grow
            links.clear()
        for key, parent in zip(keys, parents):
            links[key] = parent_key(key, parent)

    def read(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        self._counters.reads += len(keys)
        for key, size in zip(reversed(keys), reversed(sizes)):  # tail first: the head ends most recent
            self._sight_held(key, size)

    def put(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        present: Sequence[bool],
        free_bytes: int,
        held: Callable[[str], bool],
        admit_all: bool = False,
    ) -> list[bool]:
        admit = [True] * len(keys)
        meta = self._meta
        links = self._links
        stored_now: set[str] = set()
        declined_now: set[str] = set()
        self._fresh = fresh = set()
        room = free_bytes
        counters = self._counters
        for index, key in enumerate(keys):
            parent = links.pop(key, None) if links else None
            if present[index]:
                self._sight_held(key, sizes[index], parent)
                stored_now.add(key)
                continue
            size = sizes[index]
            entry = meta.get(key)
            if entry is not None and entry.cls >= 0:
                self._unhold(key)  # the pool no longer holds it (removed, cleared): seen, not held
            if parent is None and entry is not None:
                parent = entry.parent
            if admit_all:
                ok = True
            elif parent is not None and parent in declined_now:
                ok = False  # this put declined its parent: a tail is never stored behind a missing head
            elif room >= size or not self.second_sight:
                ok = True
            else:
                ok = (entry is not None and entry.seen > 0) or (parent is not None and parent in stored_now)
            if ok:
                room -= size
                stored_now.add(key)
                fresh.add(key)
                self._store(key, size, parent, entry)
                counters.admitted += 1
            else:
                admit[index] = False
                declined_now.add(key)
                counters.declined += 1
                self._remember(key, size, parent, entry)
            if parent:  # a key (not ROOT, not unknown): extended by this chunk
                up = meta.get(parent)
                if up is not None and not up.extended:
                    up.extended = True
                    if up.cls >= 0:
                        self._place(parent, up)
        self._tick += len(keys)
        return admit

    def victim(self, held: Callable[[str], bool], writing: Callable[[str], bool] = _nothing) -> str | None:
        self._accrue()
        if self._tick >= self._reweigh_at:
            self._reweigh()
        best: str | None = None
        best_score = -1.0
        now = self._tick
        for cls in range(_CLASSES):
            key = self._oldest_leaf(cls, held, writing)
            if key is None:
                continue
            age = now - self._meta[key].last + 1
            score = age / self._weights[cls] if self.weighted else float(age)
            if score > best_score:
                best, best_score = key, score
        return best

    def evicted(self, key: str) -> None:
        entry = self._meta.get(key)
        if entry is not None and entry.cls >= 0:
            self._unhold(key)
            self._counters.evicted += 1

    def clear(self) -> None:
        for heap in self._heaps:
            heap.clear()
        self._meta.clear()
        self._ghost.clear()
        self._links.clear()
        self._orphans.clear()
        self._count = [0] * _CLASSES
        self._held = self._held_bytes = 0

    def counters(self) -> PolicyCounters:
        return PolicyCounters(**vars(self._counters))

    # --- what a ledger asks ------------------------------------------------------------------------

    def holds(self, key: str) -> bool:
        return _held(self._meta.get(key))

    def chain_held(self, key: str) -> bool:
        """Held, and so is its parent when known: a hit under the prefix rule, as far as one link tells."""
        entry = self._meta.get(key)
        if entry is None or entry.cls < 0:
            return False
        parent = entry.parent
        return parent is None or parent == ROOT or _held(self._meta.get(parent))

    @property
    def held_bytes(self) -> int:
        return self._held_bytes

    # --- internals ---------------------------------------------------------------------------------

    def _sight_held(self, key: str, size: int, parent: str | None = None) -> None:
        """A held chunk was loaded or put again (one the policy did not know it held: taken in)."""
        entry = self._meta.get(key)
        if entry is None or entry.cls < 0:
            self._store(key, size, parent, entry)
            return
        self._hits[entry.cls] += 1
        entry.seen += 1
        entry.last = self._tick
        self._tick += 1
        self._place(key, entry)

    def _store(self, key: str, size: int, parent: str | None, entry: _Meta | None) -> None:
        if entry is None:
            entry = self._meta[key] = _Meta(parent, size)
        else:
            self._ghost.pop(key, None)
            if parent is not None:
                entry.parent = parent
            entry.size = size
        entry.seen += 1
        entry.last = self._tick
        entry.kids = self._orphans.pop(key, 0)  # children stored before it: not a leaf (not evictable)
        if entry.kids:
            entry.extended = True
        self._held += 1
        self._held_bytes += size
        self._place(key, entry)
        above = entry.parent
        if above is not None and above != ROOT:
            up = self._meta.get(above)
            if up is not None and up.cls >= 0:
                up.kids += 1  # no longer a leaf: not evictable until its last held child goes
            else:  # its parent is not held: counted for when it is stored
                self._orphans[above] = self._orphans.get(above, 0) + 1

    def _remember(self, key: str, size: int, parent: str | None, entry: _Meta | None) -> None:
        """Seen, not stored: into the ghost."""
        if entry is None:
            entry = self._meta[key] = _Meta(parent, size)
        elif parent is not None:
            entry.parent = parent
        entry.seen += 1
        entry.last = self._tick
        self._to_ghost(key)

    def _place(self, key: str, entry: _Meta) -> None:
        """Into its class and, a leaf (what eviction may take), its class's heap at its last sighting."""
        cls = (entry.seen >= _SEEN_AGAIN) * 2 + entry.extended
        if entry.cls != cls:
            if entry.cls >= 0:
                self._count[entry.cls] -= 1
            self._accrue()
            entry.cls = cls
            self._count[cls] += 1
        if entry.kids == 0:
            self._push(key, entry)

    def _push(self, key: str, entry: _Meta) -> None:
        heap = self._heaps[entry.cls]
        heapq.heappush(heap, (entry.last, key))
        if len(heap) > 2 * self._count[entry.cls] + 256:  # mostly stale: keep the live entries only
            meta = self._meta
            live = {}
            for last, name in heap:
                there = meta.get(name)
                if there is not None and there.cls == entry.cls and there.last == last and there.kids == 0:
                    live[name] = last
            heap[:] = [(last, name) for name, last in live.items()]
            heapq.heapify(heap)

    def _oldest_leaf(self, cls: int, held: Callable[[str], bool], writing: Callable[[str], bool]) -> str | None:
        """The class's least recently sighted leaf; a chunk the pool no longer holds is forgotten on the
        way, one another put is still copying (`writing`) passed over and kept. None when that is what the
        latest put admitted (not in the pool yet: being written)."""
        meta = self._meta
        heap = self._heaps[cls]
        fresh = self._fresh
        copying: list[tuple[int, str]] = []
        try:
            while heap:
                last, key = heap[0]
                entry = meta.get(key)
                if entry is None or entry.cls != cls or entry.last != last or entry.kids > 0:
                    heapq.heappop(heap)  # stale: sighted since, another class, a parent now, or gone
                    continue
                if key in fresh:
                    return None
                if writing(key):
                    copying.append(heapq.heappop(heap))  # reserved, not published: not evictable yet
                    continue
                if not held(key):
                    heapq.heappop(heap)
                    self._unhold(key)
                    continue
                return key
            return None
        finally:
            for item in copying:
                heapq.heappush(heap, item)

    def _unhold(self, key: str) -> None:
        entry = self._meta[key]
        if entry.cls >= 0:
            self._accrue()
            self._count[entry.cls] -= 1
            entry.cls = -1
            if entry.kids:  # left before its held children (removed): theirs again once it is stored
                self._orphans[key] = entry.kids
            entry.kids = 0
            self._held -= 1
            self._held_bytes -= entry.size
            above = entry.parent
            if above is not None and above != ROOT:
                up = self._meta.get(above)
                if up is not None and up.cls >= 0:
                    if up.kids > 0:
                        up.kids -= 1
                        if up.kids == 0:  # a leaf again
                            self._push(above, up)
                else:
                    orphans = self._orphans.get(above, 0)
                    if orphans > 1:
                        self._orphans[above] = orphans - 1
                    else:
                        self._orphans.pop(above, None)
        self._to_ghost(key)

    def _to_ghost(self, key: str) -> None:
        ghost = self._ghost
        ghost[key] = None
        ghost.move_to_end(key)
        limit = max(MIN_GHOST, GHOST_FACTOR * self._held)
        meta = self._meta
        while len(ghost) > limit:
            old, _ = ghost.popitem(last=False)
            entry = meta.get(old)
            if entry is not None and entry.cls < 0:
                del meta[old]

    def _accrue(self) -> None:
        """Occupancy: chunks held per class, times the ticks since the last accrual."""
        elapsed = self._tick - self._accrued_at
        if elapsed:
            occupancy, count = self._occupancy, self._count
            for cls in range(_CLASSES):
                occupancy[cls] += count[cls] * elapsed
            self._accrued_at = self._tick

    def _reweigh(self) -> None:
        """Each class's hits per held chunk and tick, against the mean: the weights of its ages."""
        density = [hits / occupancy for hits, occupancy in zip(self._hits, self._occupancy)]
        mean = sum(density) / _CLASSES or 1.0
        self._weights = [max(value / mean, 1e-3) for value in density]
        self._hits = [hits * WEIGHT_DECAY for hits in self._hits]
        self._occupancy = [occupancy * WEIGHT_DECAY for occupancy in self._occupancy]
        self._reweigh_at = self._tick + max(256, self._held // 2)


def _held(entry: _Meta | None) -> bool:
    return entry is not None and entry.cls >= 0


def _variant_name(weighted: bool, second_sight: bool) -> str:
    return ("weighted" if weighted else "chain-lru") + ("+second-sight" if second_sight else "")
