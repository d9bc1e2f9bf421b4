"""Which chunks the embedded pool keeps: admission (store a chunk or not) and eviction (which one goes),
as policies. Plain data and arithmetic on keys, no engine, no pool, no thread: the pool calls a policy
under its own lock (docs/eviction-policy.md says why each rule is there, from what the trace shows).

What a policy is told, all a pool sees of a prompt:
- `link(keys, parents)`: each chunk's parent in its prefix chain (the saves know it);
- `read(keys, sizes)`: the chunks a load read (a hit), head to tail;
- `put(keys, sizes, present, free_bytes)`: a save, head to tail; the pool asks which of the chunks it
  lacks to store (admission) and touches those it holds;
- `victim(held, writing)`: the chunk to evict next, and `evicted(key)` once the pool took it (a pool may
  keep the candidate after all: its reserve for chunks awaiting acknowledgement is full).

Invariants every policy here keeps:
- Chains stay whole. Eviction only takes a chain's leaf (a chunk no held chunk names as parent, whichever
  of the two was stored first), and admission never stores a chunk whose parent the same put declined:
  a prefix chain never loses its head while its tail stays. A parent the pool was never given binds
  nothing: a chunk whose parent is not stored by design (a sliding window's, a state group's, a TP
  rank's strided puts) is stored as any other. A put's chunk whose parent the pool holds keeps it: if
  only parents are left, the put is refused (FULL) rather than cut a chain.
- The pool, not the policy, is the record of what is stored: whatever a policy believes, `victim` only
  names a key `held` says the pool holds (a key the pool removed, cleared or retired meanwhile is
  dropped from the policy when met; a key a put reserved and is still copying, `writing`, is neither
  named nor dropped), and the pool announces every key that leaves it to its listeners (the
  scheduler's index and KV events) exactly as before, whatever the policy decided. A declined chunk is
  never stored, never reported stored.
- Bounded memory: a policy remembers chunks it does not hold (its ghost) up to `GHOST_FACTOR` times the
  chunks it holds, and the held children of chunks it does not hold (at most one count per held chunk).

Policies (`POLICY_NAMES`):
- `lru`: the pool's own least recently used order, every chunk admitted (kvpool before policies).
- `chain-lru`: least recently used among chain leaves, every chunk admitted.
- `weighted`: among chain leaves, the oldest after weighting each class's age by the hits per stored
  chunk and tick the class earned lately (class: seen once or more than once, extended by a later chunk
  or not), every chunk admitted.
- `second-sight`: chain-lru, and once the pool is full a chunk is stored only if it was seen before
  (held, or in the ghost) or extends a chunk this put stores: a chain seen once is not copied.
- `adaptive` (the default): four key-only ledgers of the same stream (chain-lru and weighted eviction,
  with and without second-sight admission) replay the pool at its capacity; the pool follows the one
  that hit most lately.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvpool.core.errors import ConfigError

POLICY_NAMES = ("adaptive", "lru", "chain-lru", "weighted", "second-sight")
# plain LRU until the adaptive policy passes the real-engine tests: with it the default, hybrid-model,
# disk-tier and Mooncake-TP tests missed hits they had (clean-clone run of e22ec9a); the cause is open
DEFAULT_POLICY = "lru"
GHOST_FACTOR = 4  # chunks remembered but not held, per chunk held
MIN_GHOST = 256
WEIGHT_DECAY = 0.5  # each class's hits and occupancy at every weight update
LEDGER_DECAY = 0.9  # each ledger's hits at every choice
SWITCH_MARGIN = 0.05  # the adaptive choice moves to another ledger only if it hit this much more
ROOT = ""  # the parent of a chain's first chunk

_SEEN_AGAIN = 2  # classes: seen at least this many times, or fewer
_CLASSES = 4  # (seen again) x (extended)


@dataclass
class PolicyCounters:
    """What a policy decided, for operators and benches."""

    policy: str
    admitted: int = 0
    declined: int = 0  # chunks a put did not store: the admission said no
    evicted: int = 0
    reads: int = 0
    choice: str = ""  # adaptive: the ledger the pool follows now
    switches: int = 0  # adaptive: how often it changed
    ledger_hits: dict[str, float] = field(default_factory=dict)


def _nothing(key: str) -> bool:
    """No key: the default `writing` (no put is copying)."""
    return False


@runtime_checkable
class PoolPolicy(Protocol):
    """Admission and eviction for one pool. Every method runs under the pool's lock."""

    name: str

    def link(self, keys: Sequence[str], parents: Sequence[bytes | None]) -> None:
        """Each key's parent chunk hash (b"": the first chunk of its chain; None: not known)."""
        ...

    def read(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        """A load read these held chunks, head to tail."""
        ...

    def put(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        present: Sequence[bool],
        free_bytes: int,
        held: Callable[[str], bool],
        admit_all: bool = False,
    ) -> list[bool]:
        """A save of `keys`, head to tail; `present[i]`: the pool holds key i (a touch). Which keys to
        store (True for every present one); `free_bytes`: room before an eviction; `held`: whether the
        pool holds a key (a parent); `admit_all`: the pool stores every key whatever the admission (a disk
        hit promoted: it was read)."""
        ...

    def victim(self, held: Callable[[str], bool], writing: Callable[[str], bool] = _nothing) -> str | None:
        """The key to evict now, one `held` says the pool holds; None: none can go without cutting a chain
        (the put is refused, FULL). `writing`: whether a put reserved a key and is still copying it (not in
        the pool yet, not gone: it cannot go now and stays in the record; by default none). The `lru`
        policy's None: the pool's own least recently used."""
        ...

    def evicted(self, key: str) -> None:
        """The pool evicted `key` (what `victim` named)."""
        ...

    def clear(self) -> None:
        """The pool was emptied."""
        ...

    def counters(self) -> PolicyCounters: ...


def parent_key(key: str, parent: bytes | None) -> str | None:
    """The key of `key`'s parent chunk, from its hash: the same namespace prefix (a key is a prefix and its
    chunk hash in hex; a parent's hash is as long as the chunk's). ROOT for a chain's first chunk, None
    when not known."""
    if parent is None:
        return None
    if not parent:
        return ROOT
    digits = parent.hex()
    if len(key) <= len(digits):
        return None
    return key[: len(key) - len(digits)] + digits


class LRUPolicy:
    """The pool's own order (least recently used first, a put's and a load's chunks touched tail first),
    every chunk admitted: kvpool's behaviour before policies, at no cost."""

    name = "lru"

    def __init__(self) -> None:
        self._counters = PolicyCounters(self.name)

    def link(self, keys: Sequence[str], parents: Sequence[bytes | None]) -> None:
        return None

    def read(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        return None

    def put(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        present: Sequence[bool],
        free_bytes: int,
        held: Callable[[str], bool],
        admit_all: bool = False,
    ) -> list[bool]:
        return [True] * len(keys)

    def victim(self, held: Callable[[str], bool], writing: Callable[[str], bool] = _nothing) -> str | None:
        return None

    def evicted(self, key: str) -> None:
        return None

    def clear(self) -> None:
        return None

    def counters(self) -> PolicyCounters:
        return PolicyCounters(**vars(self._counters))


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


class _Ledger:
    """A key-only replay of the pool's stream under one fixed policy, at the pool's capacity: what it
    would hit."""

    def __init__(self, policy: ChainPolicy, capacity_bytes: int) -> None:
        self.policy = policy
        self.capacity_bytes = capacity_bytes
        self.hits = 0.0
        self.score = 0.0

    def observe(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        """The chunks of a load or a save: each a hit here if this ledger holds it (and its parent),
        then taken in as the pool would."""
        policy = self.policy
        meta = policy._meta
        present = [(entry := meta.get(key)) is not None and entry.cls >= 0 for key in keys]
        if any(present):
            self.hits += sum(policy.chain_held(key) for key, there in zip(keys, present) if there)
        policy.put(keys, sizes, present, self.capacity_bytes - policy.held_bytes, policy.holds)
        while policy.held_bytes > self.capacity_bytes:
            key = policy.victim(policy.holds)
            if key is None:
                break
            policy.evicted(key)


class AdaptivePolicy:
    """The default: the pool's own `ChainPolicy` follows whichever of four ledgers (chain-lru, weighted,
    each with and without second-sight admission) hit most lately (hits decayed by `LEDGER_DECAY` at each
    choice, one per half of the pool's capacity in chunks sighted; a change needs `SWITCH_MARGIN` more).
    Eviction and admission switch at once: the four differ only in their rules, not in what they hold."""

    name = "adaptive"

    def __init__(self, capacity_bytes: int, *, admission: bool = True) -> None:
        variants = [
            (weighted, second) for weighted in (False, True) for second in ((False, True) if admission else (False,))
        ]
        self._main = ChainPolicy(name=self.name)
        self._ledgers = [
            _Ledger(ChainPolicy(weighted=weighted, second_sight=second), capacity_bytes)
            for weighted, second in variants
        ]
        self._choice = 0
        self._sighted = 0
        self._sighted_bytes = 0
        self._next_choice = 64
        self._counters = PolicyCounters(self.name, choice=self._ledgers[0].policy.name)
        self.capacity_bytes = capacity_bytes

    def link(self, keys: Sequence[str], parents: Sequence[bytes | None]) -> None:
        self._main.link(keys, parents)
        for ledger in self._ledgers:
            ledger.policy.link(keys, parents)

    def read(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        self._observe(keys, sizes)
        self._main.read(keys, sizes)

    def put(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        present: Sequence[bool],
        free_bytes: int,
        held: Callable[[str], bool],
        admit_all: bool = False,
    ) -> list[bool]:
        self._observe(keys, sizes)
        return self._main.put(keys, sizes, present, free_bytes, held, admit_all)

    def victim(self, held: Callable[[str], bool], writing: Callable[[str], bool] = _nothing) -> str | None:
        return self._main.victim(held, writing)

    def evicted(self, key: str) -> None:
        self._main.evicted(key)

    def clear(self) -> None:
        self._main.clear()

    def counters(self) -> PolicyCounters:
        main = self._main.counters()
        counters = PolicyCounters(**vars(self._counters))
        counters.admitted, counters.declined, counters.evicted, counters.reads = (
            main.admitted,
            main.declined,
            main.evicted,
            main.reads,
        )
        counters.ledger_hits = {ledger.policy.name: round(ledger.score, 1) for ledger in self._ledgers}
        return counters

    def _observe(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        if not keys:
            return
        for ledger in self._ledgers:
            ledger.observe(keys, sizes)
        self._sighted += len(keys)
        self._sighted_bytes += sum(sizes)
        if self._sighted >= self._next_choice:
            self._choose()

    def _choose(self) -> None:
        ledgers = self._ledgers
        for ledger in ledgers:
            ledger.score = ledger.score * LEDGER_DECAY + ledger.hits
            ledger.hits = 0.0
        best = max(range(len(ledgers)), key=lambda index: ledgers[index].score)
        if ledgers[best].score > ledgers[self._choice].score * (1 + SWITCH_MARGIN):
            self._choice = best
            self._counters.switches += 1
        chosen = ledgers[self._choice].policy
        self._main.weighted, self._main.second_sight = chosen.weighted, chosen.second_sight
        self._counters.choice = chosen.name
        chunk = max(1, self._sighted_bytes // max(1, self._sighted))  # mean chunk size seen
        self._next_choice = self._sighted + max(64, self.capacity_bytes // chunk // 2)


def make_policy(name: str, capacity_bytes: int, *, admission: bool = True) -> PoolPolicy:
    """The policy called `name` for a pool of `capacity_bytes`. `admission`: False for a pool whose every
    put must be stored (DRAM above a disk tier: the disk is written from DRAM's copies), where the
    policy decides evictions only."""
    if name == "lru":
        return LRUPolicy()
    if name == "chain-lru":
        return ChainPolicy(name=name)
    if name == "weighted":
        return ChainPolicy(weighted=True, name=name)
    if name == "second-sight":
        return ChainPolicy(second_sight=admission, name=name)
    if name == "adaptive":
        return AdaptivePolicy(capacity_bytes, admission=admission)
    raise ConfigError("pool_policy", name, f"one of {', '.join(POLICY_NAMES)}")
