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

from kvpool.core.errors import ConfigError
from kvpool.core.policy.adaptive import AdaptivePolicy
from kvpool.core.policy.base import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    ROOT,
    LRUPolicy,
    PolicyCounters,
    PoolPolicy,
    parent_key,
)
from kvpool.core.policy.chain import GHOST_FACTOR, ChainPolicy

__all__ = [
    "DEFAULT_POLICY",
    "GHOST_FACTOR",
    "POLICY_NAMES",
    "ROOT",
    "AdaptivePolicy",
    "ChainPolicy",
    "LRUPolicy",
    "PolicyCounters",
    "PoolPolicy",
    "make_policy",
    "parent_key",
]


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
