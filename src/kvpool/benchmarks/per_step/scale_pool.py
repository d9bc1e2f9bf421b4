"""The embedded pool at capacity, before and after chain-aware eviction (part of `kvpool bench scale`).

A `MemoryBackend` of `capacity_chunks` chunks serves a prefix-reuse workload whose working set is
several times larger: `prefixes` shared prefixes of `prefix_chunks` chunks, drawn with a Zipf(`zipf`)
popularity, each request that prefix plus `suffix_chunks` chunks of its own. Each request does what
the engine does: looks up its longest stored prefix, loads it (`get_into`), then saves the rest of
its chain, putting only the chunks the pool lacks (the worker's `exists` before `put`); loads and
puts go in batches of the worker's `put_batch_chunks`, head to tail, as the loader and the sender
split them. The pool's eviction decides what stays. Two pools serve the same seeded requests:
* `chain_aware`: `MemoryBackend` as it is: a batch is put and read in reverse, so a chain's head is its
  most recently used chunk and eviction takes tails first (commit a844ce1);
* `plain_lru`: `PlainLRU`, a bench-only subclass handing every batch to `MemoryBackend` reversed, so
  its touches run head to tail: plain LRU in forward order, the pool before that commit. A chain's
  head is then its oldest chunk; evicting it leaves a tail no lookup can reach.

Measured after a warm-up (the first fifth of the requests): eviction rate (chunks evicted per chunk
put: ~1 for any pool kept full, so the policies differ in what they evict, not how much), token hit
rate (chunks hit / prompt chunks, next to what an unbounded pool would hit), the fraction of requests
with a hit, chunks put per request, and, sampled 20 times over the run, the popularity-weighted
reachable prefix length (the hit the next request expects) and the bytes stored that no lookup can
reach (an earlier chunk of their chain is gone).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.backends.base import Rows, Status, Values
from kvpool.backends.memory import MemoryBackend

CHUNK_BYTES = 512
POLICIES = ("plain_lru", "chain_aware")


class PlainLRU(MemoryBackend):
    """The embedded pool as plain LRU in forward order (bench only): every batch reaches
    `MemoryBackend` reversed, so its tail-first put and read touch the caller's chain head to tail and
    the head ends least recently used, as before chains aged tail first."""

    def put(self, keys: Sequence[str], values: Values) -> list[Status]:
        return super().put(list(keys)[::-1], _reversed(values))[::-1]

    def get_into(self, keys: Sequence[str], dests: Values) -> list[Status]:
        return super().get_into(list(keys)[::-1], _reversed(dests))[::-1]


def _reversed(values: Values) -> Values:
    if isinstance(values, Rows):
        return Rows(values.arrays, values.ids[::-1].copy())
    return list(values)[::-1]



def capacity_row(
    policy: str,
    *,
    prefixes: int,
    prefix_chunks: int,
    suffix_chunks: int,
    capacity_chunks: int,
    pool_requests: int,
    zipf: float,
    batch_chunks: int,
    seed: int,
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)  # the same seed: both pools serve the same requests
    popularity = 1.0 / np.arange(1, prefixes + 1) ** zipf
    popularity /= popularity.sum()
    draws = rng.choice(prefixes, size=pool_requests, p=popularity).tolist()
    pool = (PlainLRU if policy == "plain_lru" else MemoryBackend)(capacity_chunks * CHUNK_BYTES)
    value, dest = np.zeros(CHUNK_BYTES, np.uint8), np.empty(CHUNK_BYTES, np.uint8)
    heads = [[f"p{p}/{i}" for i in range(prefix_chunks)] for p in range(prefixes)]
    parent: dict[str, str] = {key: chain[i - 1] for chain in heads for i, key in enumerate(chain) if i}
    warmup = pool_requests // 5
    sample_every = max(1, (pool_requests - warmup) // 20)
    seen: set[int] = set()
    prompt = hit_chunks = hit_requests = ideal = 0
    reach: list[float] = []
    unreachable: list[int] = []
    used: list[int] = []
    for r, p in enumerate(draws):
        if r == warmup:
            start = pool.stats()
        chain = heads[p] + [f"r{r}/{i}" for i in range(suffix_chunks)]
        parent.update(zip(chain[prefix_chunks:], chain[prefix_chunks - 1 :]))
        present = pool.exists(chain)  # the lookup: the longest stored prefix
        hit = present.index(False) if False in present else len(chain)
        for first in range(0, hit, batch_chunks):  # the load
            part = chain[first : min(hit, first + batch_chunks)]
            pool.get_into(part, [[dest]] * len(part))
        rest = chain[hit:]
        missing = [key for key, there in zip(rest, pool.exists(rest)) if not there]
        for first in range(0, len(missing), batch_chunks):  # the save: only what the pool lacks
            part = missing[first : first + batch_chunks]
            pool.put(part, [[value]] * len(part))
        if r >= warmup:
            prompt += len(chain)
            hit_chunks += hit
            hit_requests += hit > 0
            ideal += prefix_chunks if p in seen else 0
            if (r - warmup) % sample_every == 0:
                reachable_len, lost = _reachability(pool, heads, parent)
                reach.append(float(np.dot(popularity, reachable_len)))
                unreachable.append(lost)
                used.append(len(pool.keys()))
        seen.add(p)
    end = pool.stats()
    puts, evictions = end.puts - start.puts, end.evictions - start.evictions
    return {
        "part": "capacity",
        "policy": policy,
        "requests": pool_requests - warmup,
        "eviction_rate": round(evictions / puts, 4) if puts else 0.0,
        "token_hit_rate": round(hit_chunks / prompt, 4),
        "ideal_token_hit_rate": round(ideal / prompt, 4),
        "request_hit_fraction": round(hit_requests / (pool_requests - warmup), 4),
        "puts_per_request": round(puts / (pool_requests - warmup), 2),
        "reachable_prefix_chunks": round(statistics.fmean(reach), 2),
        "unreachable_bytes": round(statistics.fmean(unreachable) * CHUNK_BYTES),
        "unreachable_fraction": round(sum(unreachable) / max(1, sum(used)), 4),
    }


def _reachability(pool: MemoryBackend, heads: list[list[str]], parent: dict[str, str]) -> tuple[list[int], int]:
    """Per shared prefix its reachable length in chunks; and how many stored chunks no lookup reaches
    (a chunk is reachable when it and every chunk before it in its chain are stored)."""
    stored = set(pool.keys())
    lengths = []
    for chain in heads:
        run = 0
        while run < len(chain) and chain[run] in stored:
            run += 1
        lengths.append(run)
    memo: dict[str, bool] = {}
    lost = 0
    for key in stored:
        path = []
        while key not in memo:
            up = parent.get(key)
            if key not in stored or up is None:
                memo[key] = key in stored
            else:
                path.append(key)
                key = up
        answer = memo[key]
        memo.update(dict.fromkeys(path, answer))
        lost += not answer
    return lengths, lost
