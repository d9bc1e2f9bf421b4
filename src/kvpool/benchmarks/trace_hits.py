"""Hit rates over the Mooncake conversation trace: the embedded pool's real eviction beside plain LRU and
Belady's MIN, at several capacities.

The trace (`../shared/data/mooncake-traces/conversation_trace.jsonl`, one hour of real chat requests
from Mooncake's serving system) names each request's prompt as a chain of 512-token block hashes; two
requests that share their first k hashes share their first k blocks. Every request, in arrival order:
its hit is the leading run of its blocks the pool holds (the prefix rule every connector follows: a
block is only usable after all blocks before it); then its blocks are stored. Hit rate: blocks hit over
prompt blocks, as the trace's README counts them (every hash id, the last partial block too, so the
figures compare with the README's).

Policies, each at a capacity given as a share of the trace's distinct blocks:
- `kvpool`: the embedded pool itself (`MemoryBackend`), driven as kvpool drives it: `exists` for the
  lookup, `get_into` for the hit's blocks (a load), `put` for the rest (the save). Its LRU ages a
  chain tail first, so a prefix loses its tail before its head.
- `lru`: plain LRU over blocks, each block touched head to tail: a chain's head ages first, and a chain
  that lost its head is unreachable however recent its tail.
- `min`: Belady's MIN (evict the block whose next use is farthest away; a block never used again
  first; a block is not cached when it is itself the farthest): the offline reference, near the limit
  but not an optimum under the prefix rule.
- `kvpool+disk`: the embedded pool at the same DRAM with its disk tier below (`TieredPool`, real
  files in a temporary folder, `DISK_FACTOR` times DRAM's capacity), every write flushed before the
  next request so that the figure does not depend on the writer's timing.
- `unlimited`: no eviction: the trace's own reuse, the ceiling.
"""

from __future__ import annotations

import heapq
import json
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.backends.base import Rows
from kvpool.backends.disk import HEADER_BYTES, DiskTier
from kvpool.backends.memory import MemoryBackend
from kvpool.backends.tiered import TieredPool

TRACE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "mooncake-traces" / "conversation_trace.jsonl"
POLICIES = ("kvpool", "lru", "min", "kvpool+disk")
DISK_FACTOR = 4
BLOCK_BYTES = 8  # what the embedded pool stores per block here: only the count matters

ALL_ARGS: dict[str, Any] = {"capacities": [0.01, 0.05, 0.10, 0.25]}
TINY_ARGS: dict[str, Any] = {"capacities": [0.05, 0.25], "limit": 600}


def load_trace(path: Path = TRACE, limit: int | None = None) -> list[list[int]]:
    """Each request's block hashes, in arrival order (the first `limit` requests)."""
    if not path.is_file():
        raise FileNotFoundError(f"trace {path}: not found (the Mooncake conversation trace, see its README)")
    chains: list[list[int]] = []
    with path.open() as lines:
        for line in lines:
            if limit is not None and len(chains) >= limit:
                break
            if line.strip():
                chains.append([int(h) for h in json.loads(line)["hash_ids"]])
    return chains


def _leading(present: Sequence[bool]) -> int:
    for index, there in enumerate(present):
        if not there:
            return index
    return len(present)


def _replay(pool: MemoryBackend | TieredPool, chains: list[list[int]], settle: Callable[[], object]) -> int:
    """Blocks hit driving `pool` as kvpool drives it: `exists` for the lookup, `get_into` for the hit's
    blocks (a load), `put` for the rest (the save); `settle` after each request."""
    blocks = np.zeros((max(map(len, chains), default=0), BLOCK_BYTES), dtype=np.uint8)
    hits = 0
    for chain in chains:
        keys = [str(block) for block in chain]
        hit = _leading(pool.exists(keys))
        if hit:
            pool.get_into(keys[:hit], Rows((blocks,), np.arange(hit)))
        if hit < len(keys):
            pool.put(keys[hit:], Rows((blocks,), np.arange(len(keys) - hit)))
        settle()
        hits += hit
    return hits


def hits_kvpool(chains: list[list[int]], capacity: int) -> int:
    """Blocks hit with the embedded pool holding `capacity` blocks."""
    return _replay(MemoryBackend(capacity * BLOCK_BYTES), chains, lambda: None)


def hits_tiered(chains: list[list[int]], capacity: int, disk_factor: int = DISK_FACTOR) -> int:
    """Blocks hit with the embedded pool holding `capacity` blocks in DRAM and at least `disk_factor`
    times as many on its disk tier (sized for the longest key's file), every write on disk before the
    next request."""
    with tempfile.TemporaryDirectory(prefix="kvpool-trace-disk-") as folder:
        file_bytes = HEADER_BYTES + len(str(max((max(c) for c in chains if c), default=0))) + BLOCK_BYTES
        disk = DiskTier(folder, disk_factor * capacity * file_bytes)
        pool = TieredPool(MemoryBackend(capacity * BLOCK_BYTES), disk, write_queue_bytes=1 << 30)
        try:
            return _replay(pool, chains, lambda: pool.flush(60.0))
        finally:
            pool.shutdown(5.0)


def hits_lru(chains: list[list[int]], capacity: int) -> int:
    """Blocks hit with plain LRU over `capacity` blocks, each request's blocks touched head to tail."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for chain in chains:
        hits += _leading([block in cache for block in chain])
        for block in chain:
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def hits_min(chains: list[list[int]], capacity: int) -> int:
    """Blocks hit with Belady's MIN over `capacity` blocks (offline: it knows every next use)."""
    never = len(chains)
    following: list[list[int]] = [[] for _ in chains]  # per request, per block: the next request using it
    seen: dict[int, int] = {}
    for index in range(len(chains) - 1, -1, -1):
        following[index] = [seen.get(block, never) for block in chains[index]]
        for block in chains[index]:
            seen[block] = index
    cached: dict[int, int] = {}  # block -> its next use
    farthest: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    hits = 0
    for index, chain in enumerate(chains):
        hits += _leading([block in cached for block in chain])
        for block, next_use in zip(chain, following[index]):
            cached[block] = next_use
            heapq.heappush(farthest, (-next_use, block))
        while len(cached) > capacity:
            negative, block = heapq.heappop(farthest)
            if cached.get(block) == -negative:
                del cached[block]
    return hits


def run(
    *,
    capacities: Sequence[float] = (0.01, 0.05, 0.10, 0.25),
    limit: int | None = None,
    trace: Path = TRACE,
    tiered: bool = True,
) -> dict[str, Any]:
    """`tiered`: also the disk tier's row (real files: about a minute over the whole trace)."""
    for share in capacities:
        if not 0 < share <= 1:
            raise ValueError(f"capacity {share}: expected a share of the distinct blocks in (0, 1]")
    started = time.perf_counter()
    chains = load_trace(trace, limit)
    blocks = sum(map(len, chains))
    distinct = len({block for chain in chains for block in chain})
    unlimited = hits_lru(chains, distinct)
    rows = []
    for share in capacities:
        capacity = max(1, round(share * distinct))
        row: dict[str, Any] = {"capacity_share": share, "capacity_blocks": capacity}
        for policy, hits in (
            ("kvpool", hits_kvpool),
            ("lru", hits_lru),
            ("min", hits_min),
            ("kvpool+disk", hits_tiered),
        ):
            if policy == "kvpool+disk" and not tiered:
                continue
            row[policy] = round(hits(chains, capacity) / blocks, 4)
        rows.append(row)
    passed = all(row["kvpool"] >= row["lru"] for row in rows)
    return {
        "bench": "trace-hits",
        "trace": str(trace.name),
        "requests": len(chains),
        "prompt_blocks": blocks,
        "distinct_blocks": distinct,
        "unlimited": round(unlimited / blocks, 4),
        "rows": rows,
        "target": "kvpool's embedded pool hits at least as many blocks as plain LRU at every capacity",
        "disk_factor": DISK_FACTOR,
        "pass": passed,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


def print_table(result: dict[str, Any]) -> None:
    print(to_markdown(result))


def to_markdown(result: dict[str, Any]) -> str:
    from kvpool.benchmarks.report import markdown_table, verdict

    headers = ["capacity (share of distinct blocks)", "blocks", *[f"{policy} hit rate" for policy in POLICIES]]
    rows = [
        [
            f"{row['capacity_share']:.0%}",
            f"{row['capacity_blocks']:,}",
            *[f"{row[p]:.1%}" if p in row else "-" for p in POLICIES],  # results from before a policy existed
        ]
        for row in result["rows"]
    ]
    worst = min((row["kvpool"] - row["lru"] for row in result["rows"]), default=0.0)
    lines = [
        f"- {result['requests']:,} requests, {result['prompt_blocks']:,} prompt blocks, {result['distinct_blocks']:,} "
        f"distinct; unlimited capacity hits {result['unlimited']:.1%}",
        f"- kvpool+disk: the same DRAM, a disk tier of {result.get('disk_factor', DISK_FACTOR)}x its capacity below",
        verdict(
            "kvpool hit rate - plain LRU's, worst capacity (points)", round(100 * worst, 2), ">= 0", result["pass"]
        ),
    ]
    return markdown_table(headers, rows) + "\n\n" + "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Any) -> None:
    """Hit rate against capacity, one line per policy, the unlimited ceiling dotted."""
    from kvpool.benchmarks.report import figure

    shares = [row["capacity_share"] for row in result["rows"]]
    with figure(path, ncols=1) as (_fig, axes):
        axis = axes[0]
        for policy in POLICIES:
            if all(policy in row for row in result["rows"]):
                axis.plot(shares, [row[policy] for row in result["rows"]], "-o", label=policy)
        axis.axhline(result["unlimited"], color="gray", ls=":", label="unlimited")
        axis.set(
            title="Mooncake trace: block hit rate", xlabel="capacity (share of distinct blocks)", ylabel="hit rate"
        )
        axis.set_xscale("log")
        axis.legend(fontsize=7)
