"""The process's named embedded pools: a pool is built the first time its name is opened and handed to
whoever opens the name after, so it outlives the engine that opened it (a later engine in this process
hits what an earlier one saved) and is one object for every engine and rank of the process that opens it.

Two registries, one per kind: `shared_memory_pool` (DRAM only) and `shared_tiered_pool` (DRAM over a disk
tier); a name of one kind says nothing of the other.

Invariants:
- One pool per name and kind in a process. Each registry has its own lock, held while a pool is built
  (a tiered pool's build scans its directory), so two engines opening a name at once get the same pool,
  and opening a DRAM pool never waits for a disk scan.
- A pool is reopened only as it was made: a capacity, a disk directory, a disk capacity, an I/O mode
  (the one asked for, whatever the file system granted) or a policy other than the pool's raises
  ConfigError naming what it was created with; a policy not named takes whatever the pool has. A
  reopened tiered pool keeps its read deadline, and its disk tier adds the engine's namespaces to its
  manifest (`DiskTier.adopt`). An unknown policy name raises for a new pool too.
- A directory is one tiered pool's: a second name on a directory a pool of this process uses is refused
  (ConfigError: two tiers' indexes would evict each other's files); another process's pool on it is
  refused by the directory's lock (DiskInUseError, `disk_owner`).
- DRAM above a disk tier admits every put (`dram_policy`): the disk is written from DRAM's copies, so a
  chunk DRAM declined would reach neither tier.
- Dropping forgets: `drop_shared_memory_pools` only forgets its pools (an engine that still holds one
  keeps using it); `drop_shared_tiered_pools` writes what each pool has queued (bounded), stops its
  threads, gives its directory up and forgets it, so the next open scans anew. It runs at the process's
  exit too, so writes still queued then reach the disk.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvpool.backends.memory import DEFAULT_CAPACITY_BYTES, MemoryBackend
from kvpool.core.errors import ConfigError
from kvpool.core.keys import KeySpace
from kvpool.core.policy import PoolPolicy, make_policy

if TYPE_CHECKING:  # the disk tier is imported when a tiered pool is opened: `import kvpool` needs numpy only
    from kvpool.backends.tiered import TieredPool

_memory_pools: dict[str, MemoryBackend] = {}
_memory_lock = threading.Lock()
_tiered_pools: dict[str, TieredPool] = {}
_tiered_lock = threading.Lock()  # apart from DRAM's: a tiered pool's build scans its directory under it


def shared_memory_pool(
    name: str = "default", capacity_bytes: int = DEFAULT_CAPACITY_BYTES, pool_policy: str | None = None
) -> MemoryBackend:
    """The process-wide pool called `name`: it outlives engines, so a later engine in this process hits
    what an earlier one saved. `pool_policy`: its admission and eviction (core/policy/; None: "lru"
    for a new pool, whatever an existing one has)."""
    with _memory_lock:
        pool = _memory_pools.get(name)
        if pool is None:
            policy = make_policy(pool_policy or "lru", capacity_bytes)  # an unknown name raises here
            pool = _memory_pools[name] = MemoryBackend(capacity_bytes, None if pool_policy in (None, "lru") else policy)
        elif pool.capacity_bytes != capacity_bytes:
            raise ConfigError(
                "capacity_bytes", capacity_bytes, f"{pool.capacity_bytes} (the size pool {name!r} was created with)"
            )
        elif pool_policy is not None and policy_name(pool) != pool_policy:
            raise ConfigError(
                "pool_policy", pool_policy, f"{policy_name(pool)!r} (what pool {name!r} was created with)"
            )
        return pool


def policy_name(pool: MemoryBackend) -> str:
    """The name of the pool's policy ("lru" without one)."""
    return "lru" if pool.policy is None else pool.policy.name


def drop_shared_memory_pools() -> None:
    with _memory_lock:
        _memory_pools.clear()


def shared_tiered_pool(
    name: str,
    capacity_bytes: int,
    disk_dir: str,
    disk_capacity_bytes: int,
    read_timeout_s: float | None = None,
    direct: bool = False,
    namespaces: Sequence[KeySpace] | None = None,
    pool_policy: str | None = None,
) -> TieredPool:
    """The process-wide tiered pool called `name` (see `shared_memory_pool`): built once, its disk
    tier scanned then (its directory locked to this process: DiskInUseError if another holds it); later
    engines in the process share it. `direct`: O_DIRECT file I/O. `namespaces`: the key spaces the
    engine reads, whose files the tier keeps (the scan reclaims the rest; None: keeps every file).
    `pool_policy`: DRAM's evictions (core/policy/; None: "lru" for a new pool, whatever an existing
    one has); DRAM admits every put, since the disk is written from DRAM's copies (a chunk DRAM declined
    would reach neither tier). `read_timeout_s`: None, `tiered.DEFAULT_READ_TIMEOUT_S`."""
    from kvpool.backends.disk import DiskTier
    from kvpool.backends.tiered import DEFAULT_READ_TIMEOUT_S, TieredPool

    with _tiered_lock:
        pool = _tiered_pools.get(name)
        if pool is None:
            directory = os.path.abspath(disk_dir)
            for other, held in _tiered_pools.items():
                if held.disk.directory == directory:  # two tiers' indexes would evict each other's files
                    raise ConfigError("disk_path", disk_dir, f"a directory pool {other!r} of this process does not use")
            disk = DiskTier(disk_dir, disk_capacity_bytes, direct=direct, namespaces=namespaces)
            memory = MemoryBackend(capacity_bytes, dram_policy(pool_policy or "lru", capacity_bytes))
            timeout_s = DEFAULT_READ_TIMEOUT_S if read_timeout_s is None else read_timeout_s
            pool = _tiered_pools[name] = TieredPool(memory, disk, read_timeout_s=timeout_s)
            return pool
        for key, value, created in (
            ("capacity_bytes", capacity_bytes, pool.memory.capacity_bytes),
            ("disk_path", disk_dir, pool.disk.directory),
            ("disk_capacity_bytes", disk_capacity_bytes, pool.disk.capacity_bytes),
            ("disk_io", _io(direct), _io(pool.disk.direct_asked)),
            ("pool_policy", pool_policy, policy_name(pool.memory)),
        ):
            if key == "disk_path":
                value = os.path.abspath(disk_dir)
            if key == "pool_policy" and value is None:
                continue
            if value != created:
                raise ConfigError(key, value, f"{created!r} (what pool {name!r} was created with)")
        pool.disk.adopt(namespaces)
        return pool


def dram_policy(name: str, capacity_bytes: int) -> PoolPolicy | None:
    """DRAM's policy above a disk tier: `name`'s eviction, every put admitted (None: plain LRU)."""
    policy = make_policy(name, capacity_bytes, admission=False)  # an unknown name raises here
    return None if name == "lru" else policy


def _io(direct: bool) -> str:
    return "direct" if direct else "buffered"


def drop_shared_tiered_pools(timeout_s: float = 5.0) -> None:
    """Write what each pool has queued (bounded), stop it and forget it: the next engine scans anew."""
    with _tiered_lock:
        pools = list(_tiered_pools.values())
        _tiered_pools.clear()
    for pool in pools:
        pool.shutdown(timeout_s)


atexit.register(drop_shared_tiered_pools)
