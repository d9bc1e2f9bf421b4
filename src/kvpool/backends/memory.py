"""The embedded pool: bytes in this process, byte capacity, LRU eviction, thread-safe.

The hit contract (a chunk the scheduler offers is still readable when its load runs): a holder
(`hold_evictions`, the rank's pool tracker) makes every chunk that leaves the pool by eviction or
removal *retire* instead of being freed. A retired chunk is gone for `exists`, `keys` and the
listeners, but `get_into` still reads it. Live and retired chunks together never exceed
`capacity_bytes`: with a holder, live chunks stay below capacity minus `retire_limit_bytes`, the
reserve retired chunks live in. The reserve follows what the engine retires between acknowledgements
(a step's saves evict as much as they store): it starts at an eighth of capacity, grows at once when a
put would retire past it (to at most half: past that a put is refused, FULL, a miss later), and shrinks
back a sixteenth of its excess at each release that leaves it mostly empty. A fixed reserve smaller
than a step's saves refused most puts under pressure (one 15-chunk prefill a step against a 14-chunk
reserve: 55% refused). Every holder frees a chunk with `release` once the scheduler acknowledged the
report that withdrew it; `clear` frees everything (a reset fences loads). A put of a retired key
revives it without a copy (same key, same bytes).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.backends.base import BackendStats, Status, Values
from kvpool.backends.memory_values import held_nbytes, value_pieces, value_writer
from kvpool.core.errors import ConfigError
from kvpool.core.policy import LRUPolicy, PoolPolicy

DEFAULT_CAPACITY_BYTES = 4 << 30
# under the hit contract, the reserve for chunks awaiting acknowledgement (what the engine's saves evict
# while their reports travel to the scheduler and its acknowledgement back): at least capacity // 8, at most
# capacity // 2, sized in between by what was retired
RETIRE_LIMIT_FRACTION = 8
RETIRE_CAP_FRACTION = 2
RETIRE_GROWTH = 1.25  # the reserve's growth when a put would retire past it
RETIRE_SHRINK = 16  # at a release that leaves the reserve mostly empty, it gives back 1/16 of its excess


class MemoryBackend:
    """LRU pool of byte arrays. Freed arrays are reused for values of the same size, so a warm pool
    puts at memcpy speed instead of paying page faults on fresh memory.

    Chains age tail first: a batch (the chunks of a prompt, head to tail) is put and read in reverse,
    so its head ends up the most recently used. Eviction then takes a prefix's tail before its head,
    as vLLM's own cache does: a prefix chain that lost its head is unreachable, however recent its tail."""

    name = "memory"

    def __init__(self, capacity_bytes: int = DEFAULT_CAPACITY_BYTES, policy: PoolPolicy | None = None) -> None:
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes <= 0:
            raise ConfigError("capacity_bytes", capacity_bytes, "a positive integer number of bytes")
        self.capacity_bytes = capacity_bytes
        # admission and eviction (core/policy/), called under the lock; None: every chunk stored, the
        # least recently used evicted (so is `LRUPolicy`: the pool's own order, at no cost)
        self.policy = None if isinstance(policy, LRUPolicy) else policy
        self._lock = threading.Lock()
        self._items: OrderedDict[str, np.ndarray] = OrderedDict()
        self._pending: dict[str, int] = {}  # key → bytes reserved by a put still copying
        self._free: dict[int, list[np.ndarray]] = {}
        self._free_bytes = 0
        self._used = 0
        self._stats = BackendStats(name=self.name, capacity_bytes=capacity_bytes)
        self._listeners: list[Callable[[list[str]], None]] = []
        self._gone: list[str] = []  # keys evicted under the lock, announced to the listeners after it
        # called under the lock with each put's newly stored (key, array), tail first: a tier below may
        # pin arrays there (read them later, outside the lock) before any eviction could reuse them
        self.on_stored: Callable[[list[tuple[str, np.ndarray]]], None] | None = None
        self._pinned: set[int] = set()  # ids of stored arrays a reader outside the lock still holds
        # the hit contract: chunks out of the pool, readable until every holder released them
        self._retired: dict[str, tuple[np.ndarray, set[int]]] = {}
        self._holders: set[int] = set()
        self._next_holder = 0
        self.retired_bytes = 0
        # the reserve for retired bytes, inside `capacity_bytes`: between its floor and cap, grown by puts
        # that would retire past it (`_make_room`), shrunk at releases (`_shrink_reserve`)
        self.retire_limit_bytes = self.retire_floor_bytes = max(1, capacity_bytes // RETIRE_LIMIT_FRACTION)
        self.retire_cap_bytes = max(self.retire_floor_bytes, capacity_bytes // RETIRE_CAP_FRACTION)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            items = self._items
            return [key in items for key in keys]

    def put(self, keys: Sequence[str], values: Values) -> list[Status]:
        if len(keys) != len(values):
            raise ValueError(f"put got {len(keys)} keys and {len(values)} values")
        sizes, write = value_writer(values)  # bad buffers raise before any store
        try:
            targets = self._reserve(keys, sizes)
        finally:
            self._announce()
        published: list[tuple[str, np.ndarray]] = []
        results: list[Status] = []
        try:
            for index, (key, target) in enumerate(zip(keys, targets)):
                if not isinstance(target, np.ndarray):
                    results.append(target)
                    continue
                write(index, target)
                published.append((key, target))
                results.append(Status.OK)
        finally:
            self._publish(published, [key for key, target in zip(keys, targets) if isinstance(target, np.ndarray)])
        return results

    def adopt(self, keys: Sequence[str], arrays: Sequence[np.ndarray]) -> list[Status]:
        """`put` of arrays the caller hands over, stored without a copy where an array holds exactly its
        own bytes. The caller never writes them again; each is 1-D uint8.

        A view into a larger buffer (a disk read's file buffer: its header, and with O_DIRECT the page
        padding and alignment) is copied into an array of the value's size: capacity counts each
        stored array's size, so keeping the whole buffer alive would hold more than it counts."""
        if len(keys) != len(arrays):
            raise ValueError(f"adopt got {len(keys)} keys and {len(arrays)} arrays")
        for array in arrays:
            if array.ndim != 1 or array.dtype != np.uint8 or not array.flags.c_contiguous:
                raise TypeError(f"adopt takes 1-D contiguous uint8 arrays, got {array.dtype} {array.shape}")
        try:
            targets = self._reserve_slots(keys, [array.size for array in arrays], take_free=False)
        finally:
            self._announce()
        taken: list[tuple[str, np.ndarray]] = []
        try:
            for key, array, target in zip(keys, arrays, targets):
                if isinstance(target, Status):
                    continue
                taken.append((key, array if held_nbytes(array) == array.size else np.array(array, copy=True)))
        finally:
            reserved = [key for key, target in zip(keys, targets) if not isinstance(target, Status)]
            self._publish(taken, reserved)
        return [target if isinstance(target, Status) else Status.OK for target in targets]

    def get_into(self, keys: Sequence[str], dests: Values) -> list[Status]:
        if len(keys) != len(dests):
            raise ValueError(f"get_into got {len(keys)} keys and {len(dests)} destinations")
        pieces_of, sizes_of = value_pieces(dests, writable=True)  # bad buffers raise before any read
        results: list[Status] = [Status.MISSING] * len(keys)
        stats = self._stats
        for index in reversed(range(len(keys))):  # tail first: the head ends most recently used
            key = keys[index]
            pieces, sizes = pieces_of(index), sizes_of(index)
            with self._lock:
                stored = self._items.get(key)
                if stored is not None:
                    self._items.move_to_end(key)
                elif key in self._retired:
                    stored = self._retired[key][0]  # withdrawn, not yet released: a load armed before still reads it
                else:
                    stats.misses += 1
                    continue
                if sum(sizes) != stored.size:
                    results[index] = Status.SIZE_MISMATCH
                    continue
                offset = 0
                for piece, size in zip(pieces, sizes):
                    piece[:] = stored[offset : offset + size]
                    offset += size
                stats.hits += 1
                stats.gets += 1
                stats.get_bytes += stored.size
            results[index] = Status.OK
        if self.policy is not None:
            self._note_reads(keys, results)
        return results

    def remove(self, keys: Sequence[str]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                stored = self._items.pop(key, None)
                if stored is not None:
                    self._retire(key, stored)
                    self._gone.append(key)
                    removed += 1
        self._announce()
        return removed

    def nbytes_of(self, key: str) -> int | None:
        with self._lock:
            stored = self._items.get(key)
            return None if stored is None else int(stored.size)

    def keys(self) -> list[str]:
        """Every stored key, least recently used first."""
        with self._lock:
            return list(self._items)

    def clear(self) -> int:
        with self._lock:
            count = len(self._items)
            self._gone.extend(self._items)
            self._items.clear()
            if self.policy is not None:
                self.policy.clear()
            self._retired.clear()
            self.retired_bytes = 0
            self._free.clear()
            self._free_bytes = 0
            self._used = sum(self._pending.values())  # puts still copying keep their reservation
        self._announce()
        return count

    def add_listener(self, listener: Callable[[list[str]], None]) -> None:
        """Call `listener(keys)` with the keys that leave the pool (evicted, removed, cleared)."""
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[list[str]], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def _announce(self) -> None:
        if not self._gone:
            # read without the lock: whoever appends to it (under the lock) announces right after
            return
        with self._lock:
            if not self._gone:
                return
            gone, self._gone = self._gone, []
            listeners = list(self._listeners)
        for listener in listeners:
            listener(gone)

    def stats(self) -> BackendStats:
        with self._lock:
            self._stats.used_bytes = self._used + self.retired_bytes  # held for acknowledgement: still memory
            self._stats.retired_bytes = self.retired_bytes
            self._stats.keys = len(self._items)
            return BackendStats(**vars(self._stats))

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        """The embedded pool lives as long as the process; close keeps its contents."""

    def link(self, keys: Sequence[str], parents: Sequence[bytes | None]) -> None:
        """Tell the policy each chunk's parent hash (b"": a chain's first chunk; None: not known) before a put."""
        if self.policy is not None:
            with self._lock:
                self.policy.link(keys, parents)

    def put_linked(self, keys: Sequence[str], values: Values, parents: Sequence[bytes | None]) -> list[Status]:
        """`put`, the policy told each chunk's parent (its chains: eviction keeps them whole)."""
        self.link(keys, parents)
        return self.put(keys, values)

    def _note_reads(self, keys: Sequence[str], results: list[Status]) -> None:
        """The policy hears of a load's hits, head to tail."""
        with self._lock:
            items = self._items
            read = [key for key, status in zip(keys, results) if status is Status.OK and key in items]
            if read and self.policy is not None:
                self.policy.read(read, [int(items[key].size) for key in read])

    def _admit(self, keys: Sequence[str], sizes: list[int], admit_all: bool) -> list[bool] | None:
        """Under the lock: which keys of a put the policy stores (None: every one); a key the pool holds
        or is writing is always True."""
        if self.policy is None:
            return None
        items, pending = self._items, self._pending
        present = [key in items or key in pending for key in keys]
        return self.policy.put(keys, sizes, present, self.capacity_bytes - self._used, items.__contains__, admit_all)

    def _victim(self) -> str | None:
        """Under the lock, the pool not empty: the key eviction takes next (None: the policy has none it
        may take without cutting a chain; the put is refused)."""
        if self.policy is None:
            return next(iter(self._items))
        key = self.policy.victim(self._items.__contains__, self._pending.__contains__)
        return key if key is None or key in self._items else next(iter(self._items))

    def _reserve_slots(
        self, keys: Sequence[str], sizes: list[int], take_free: bool = True
    ) -> list[np.ndarray | Status | None]:
        """Room for each key (evicting): a free array to copy into (`take_free`), None (room, no array
        taken), or the key's status when there is nothing to store."""
        stats = self._stats
        with self._lock:
            admit = self._admit(keys, sizes, admit_all=not take_free)  # `adopt`: a disk hit promoted, stored
            targets = [
                self._reserve_one(key, size, stats, take_free) if admit is None or admit[index] else Status.DECLINED
                for index, (key, size) in enumerate(zip(keys, sizes))
            ]
            if admit is not None:
                stats.admissions_declined += admit.count(False)
            items = self._items
            for key in reversed(keys):  # tail first, like every touch: the batch's head ends most recently used
                if key in items:
                    items.move_to_end(key)
        return targets

    def _reserve(self, keys: Sequence[str], sizes: list[int]) -> list[np.ndarray | Status]:
        """A target array per key to copy into, or the key's status when there is nothing to copy."""
        targets = self._reserve_slots(keys, sizes)
        try:
            return [
                np.empty(size, dtype=np.uint8) if target is None else target for target, size in zip(targets, sizes)
            ]
        except BaseException:
            # an allocation failed: no key of this batch may stay reserved, or later puts of it would
            # answer OK and store nothing
            self._publish([], [key for key, target in zip(keys, targets) if not isinstance(target, Status)])
            raise

    def _reserve_one(
        self, key: str, size: int, stats: BackendStats, take_free: bool = True
    ) -> np.ndarray | Status | None:
        """Under the lock. None: `size` bytes are reserved; the caller allocates them outside the lock."""
        if key in self._items:
            self._items.move_to_end(key)
            return Status.OK
        if key in self._pending:
            return Status.OK  # another put is writing the same content-addressed bytes
        retired = self._retired.get(key)
        if retired is not None and retired[0].size == size:
            # withdrawn, not released: the same content-addressed bytes come back without a copy (one of
            # another size was removed as unusable: a fresh copy is stored beside it)
            array, _ = self._retired.pop(key)
            self.retired_bytes -= array.size
            self._used += array.size
            self._items[key] = array
            return Status.OK
        if size == 0 or not self._make_room(size, stats):
            stats.put_failures += 1
            return Status.FULL if size else Status.ERROR  # held by puts still copying, or awaiting acknowledgement
        self._used += size
        self._pending[key] = size
        reusable = self._free.get(size) if take_free else None
        if reusable:
            self._free_bytes -= size
            return reusable.pop()
        if self._used + self.retired_bytes + self._free_bytes > self.capacity_bytes:
            self._free.clear()
            self._free_bytes = 0
        return None

    def _make_room(self, size: int, stats: BackendStats) -> bool:
        """Under the lock: evict until `size` more live bytes fit. Under the hit contract a reserve holds
        the retired chunks (live + retired <= capacity; retired bytes past the reserve, from explicit
        removals, shrink the live share further); a put that would retire past the reserve grows it."""
        while True:
            reserve = max(self.retire_limit_bytes, self.retired_bytes) if self._holders else 0
            live_limit = self.capacity_bytes - reserve
            if size > live_limit:
                return False
            while self._used + size > live_limit and self._items:
                key_out = self._victim()
                if key_out is None:
                    return False  # nothing the policy may evict: refused (FULL)
                if self._holders and self.retired_bytes + self._items[key_out].size > self.retire_limit_bytes:
                    break  # the reserve is full of chunks awaiting acknowledgement
                evicted = self._items.pop(key_out)
                if self.policy is not None:
                    self.policy.evicted(key_out)
                self._retire(key_out, evicted)
                self._gone.append(key_out)
                stats.evictions += 1
            if self._used + size <= live_limit:
                return True
            if not self._holders or self.retire_limit_bytes >= self.retire_cap_bytes:
                return False  # held by puts still copying, or the reserve can grow no more
            limit = self.retire_limit_bytes
            grown = max(int(limit * RETIRE_GROWTH), self.retired_bytes + size, limit + 1)
            self.retire_limit_bytes = min(self.retire_cap_bytes, grown)

    def _shrink_reserve(self) -> None:
        """Under the lock, after a release: a reserve mostly empty gives back part of what it grew by."""
        excess = self.retire_limit_bytes - self.retire_floor_bytes
        if excess > 0 and self.retired_bytes * 4 < self.retire_limit_bytes:
            self.retire_limit_bytes -= max(1, excess // RETIRE_SHRINK)

    def hold_evictions(self) -> int:
        """Register a holder: from now on a chunk leaving the pool retires until this holder (and every
        other) `release`s it. Returns the holder's token."""
        with self._lock:
            self._next_holder += 1
            self._holders.add(self._next_holder)
            return self._next_holder

    def release(self, token: int, keys: Sequence[str]) -> int:
        """Holder `token` no longer needs these retired chunks (the scheduler absorbed their withdrawal);
        each is freed once no holder needs it. Keys not retired (revived, cleared) are skipped. Returns
        how many were freed."""
        freed = 0
        with self._lock:
            for key in keys:
                entry = self._retired.get(key)
                if entry is not None and self._unhold(key, entry, token):
                    freed += 1
            self._shrink_reserve()
        return freed

    def drop_holder(self, token: int) -> None:
        """The holder is gone (its engine closed): it holds nothing from now on."""
        with self._lock:
            self._holders.discard(token)
            for key, entry in list(self._retired.items()):
                self._unhold(key, entry, token)

    def _unhold(self, key: str, entry: tuple[np.ndarray, set[int]], token: int) -> bool:
        """Under the lock: True when that was the last holder of the retired `key` (freed)."""
        entry[1].discard(token)
        if entry[1]:
            return False
        del self._retired[key]
        self.retired_bytes -= entry[0].size
        self._recycle(entry[0])
        return True

    def _retire(self, key: str, array: np.ndarray) -> None:
        """Under the lock: `array` left the pool; kept readable while a holder needs it."""
        self._used -= array.size
        if not self._holders:
            self._recycle(array)
            return
        older = self._retired.pop(key, None)
        if older is not None:  # a copy stored beside an unusable retired one: a load finds the newer
            self.retired_bytes -= older[0].size
            self._recycle(older[0])
        self._retired[key] = (array, set(self._holders))
        self.retired_bytes += array.size

    def pin(self, array: np.ndarray) -> None:
        """Under the lock (from `on_stored`): `array` is read outside the lock until `unpin`; evicted
        meanwhile, it is dropped rather than reused for another value."""
        self._pinned.add(id(array))

    def unpin(self, array: np.ndarray) -> None:
        with self._lock:
            self._pinned.discard(id(array))

    def _publish(self, published: list[tuple[str, np.ndarray]], reserved: list[str]) -> None:
        """Make the copied values visible; drop the reservations of those never copied (a copy raised)."""
        with self._lock:
            for key, array in reversed(published):
                self._pending.pop(key, None)
                self._items[key] = array
                self._stats.puts += 1
                self._stats.put_bytes += array.size
            for key in reserved:
                size = self._pending.pop(key, None)
                if size is not None:
                    self._used -= size
            if published and self.on_stored is not None:
                self.on_stored(published[::-1])

    def _recycle(self, array: np.ndarray) -> None:
        """Under the lock: a freed array (no longer counted) kept for a later value of its size while
        memory allows."""
        if self._pinned and id(array) in self._pinned:
            return  # its reader drops it
        if self._used + self.retired_bytes + self._free_bytes + array.size <= self.capacity_bytes:
            self._free.setdefault(array.size, []).append(array)
            self._free_bytes += array.size
        elif self._free:
            # memory is tight: drop the idle arrays instead of keeping them around
            self._free.clear()
            self._free_bytes = 0
