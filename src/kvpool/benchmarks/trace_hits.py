"""Hit rates over a trace in the Mooncake format: the embedded pool under each of its policies
(`kvpool.core.policy`) beside plain LRU and Belady's MIN, at several capacities; DRAM alone, DRAM with
its disk tier, and behind an engine's own prefix cache.

The trace (by default `../shared/data/mooncake-traces/conversation_trace.jsonl`, one hour of real chat
requests from Mooncake's serving system; `trace=` any file of the format) names each request's prompt
as a chain of 512-token block hashes; two requests that share their first k hashes share their first k
blocks. Every request, in arrival order: its hit is the leading run of its blocks the pool holds (the
prefix rule every connector follows: a block is only usable after all blocks before it); then its
blocks are stored. Hit rate: blocks hit over prompt blocks, as the trace's README counts them (every
hash id, the last partial block too, so the figures compare with the README's). `part`: the whole
trace, or its first or second half in time (capacities are shares of that part's distinct blocks).

Rows, each at a capacity given as a share of the trace's distinct blocks:
- `pool[policy]`: the embedded pool itself (`MemoryBackend` with that policy), driven as kvpool drives
  it: `exists` for the lookup, `get_into` for the hit's blocks (a load), then the save as the worker
  makes it: `exists` on the rest and `put_linked` (each block's parent told) of those missing. `kvpool`:
  the same with `lru` (kvpool's eviction before policies; it ages a chain tail first).
- `lru`: plain LRU over blocks, each block touched head to tail: a chain's head ages first, and a chain
  that lost its head is unreachable however recent its tail.
- `min`: Belady's MIN (evict the block whose next use is farthest away; a block never used again
  first; a block is not cached when it is itself the farthest): the offline reference, near the limit
  but not an optimum under the prefix rule.
- `ratio[policy]`: `pool[policy]` over `lru`: the issue's measure.
- `disk[policy]` (and `kvpool+disk`: `lru`'s): the pool at the same DRAM with its disk tier below
  (`TieredPool`, real files in a temporary folder, `DISK_FACTOR` times DRAM's capacity), every write
  flushed before the next request so that the figure does not depend on the writer's timing. DRAM
  admits every put there (the disk is written from DRAM's copies); the policy picks DRAM's evictions.
- `engine`: an engine prefix cache in front (LRU over `engine_share` of the distinct blocks, tail first,
  holding every block of each request it served): the pool sees only what the engine missed, as in a
  server. `engine.total[policy]`: blocks hit in either; `engine.pool[policy]`: blocks the pool served;
  `engine.ratio[policy]`: the pool's blocks over the `lru` policy's.
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
from kvpool.backends.tiered import TieredPool, dram_policy
from kvpool.core.policy import DEFAULT_POLICY, POLICY_NAMES, make_policy

TRACE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "mooncake-traces" / "conversation_trace.jsonl"
POLICIES = ("kvpool", "lru", "min", "kvpool+disk")  # the columns of results from before policies
POOL_POLICIES = POLICY_NAMES
DISK_POLICIES = ("lru", DEFAULT_POLICY)  # a disk replay writes real files: the baseline and the default
PARTS = ("all", "first", "second")
DISK_FACTOR = 4
ENGINE_SHARE = 0.005  # the engine's own prefix cache in front, as a share of the distinct blocks
BLOCK_BYTES = 8  # what the embedded pool stores per block here: only the count matters
# the targets of issue 44: the default policy's hit rate over plain LRU's, per capacity (at most the share)
TARGETS = ((0.02, 1.5), (0.05, 1.15), (1.0, 1.0))

ALL_ARGS: dict[str, Any] = {"capacities": [0.01, 0.02, 0.05, 0.10, 0.20]}
TINY_ARGS: dict[str, Any] = {"capacities": [0.05, 0.25], "limit": 600, "policies": ["lru", DEFAULT_POLICY]}


def load_trace(path: Path = TRACE, limit: int | None = None, part: str = "all") -> list[list[int]]:
    """Each request's block hashes, in arrival order (the first `limit` requests; `part`: all of them, or
    the first or second half)."""
    if part not in PARTS:
        raise ValueError(f"part {part!r}: expected one of {', '.join(PARTS)}")
    if not path.is_file():
        raise FileNotFoundError(f"trace {path}: not found (the Mooncake conversation trace, see its README)")
    chains: list[list[int]] = []
    with path.open() as lines:
        for line in lines:
            if limit is not None and len(chains) >= limit:
                break
            if line.strip():
                chains.append([int(h) for h in json.loads(line)["hash_ids"]])
    half = len(chains) // 2
    return chains if part == "all" else chains[:half] if part == "first" else chains[half:]


def _leading(present: Sequence[bool]) -> int:
    for index, there in enumerate(present):
        if not there:
            return index
    return len(present)


def block_key(block: int) -> str:
    """A block's pool key: a namespace and the block's hash in hex, as kvpool's keys are."""
    return f"trace/{block:016x}"


def _parents(chain: Sequence[int]) -> list[bytes]:
    return [b""] + [block.to_bytes(8, "big") for block in chain[:-1]]


class _Engine:
    """An engine's prefix cache: LRU over blocks, a request's blocks touched tail first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def serve(self, chain: Sequence[int]) -> int:
        """Blocks of `chain` the engine holds (its leading run); then it holds all of them."""
        blocks = self.blocks
        hit = _leading([block in blocks for block in chain])
        for block in reversed(chain):
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        return hit


def _replay(
    pool: MemoryBackend | TieredPool,
    chains: list[list[int]],
    settle: Callable[[], object],
    engine: _Engine | None = None,
) -> tuple[int, int]:
    """(blocks hit in all, blocks the pool served) driving `pool` as kvpool drives it: `exists` for the
    lookup of what the engine lacks, `get_into` for the hit's blocks (a load), `exists` then `put_linked`
    for the rest (the save of what the pool lacks); `settle` after each request."""
    blocks = np.zeros((max(map(len, chains), default=0), BLOCK_BYTES), dtype=np.uint8)
    hits = served = 0
    for chain in chains:
        local = engine.serve(chain) if engine is not None else 0
        keys = [block_key(block) for block in chain]
        parents = _parents(chain)
        hit = _leading(pool.exists(keys[local:]))
        if hit:
            pool.get_into(keys[local : local + hit], Rows((blocks,), np.arange(hit)))
        rest = local + hit
        if rest < len(keys):
            missing = [i for i, there in zip(range(rest, len(keys)), pool.exists(keys[rest:])) if not there]
            if missing:
                pool.put_linked(
                    [keys[i] for i in missing], Rows((blocks,), np.arange(len(missing))), [parents[i] for i in missing]
                )
        settle()
        hits += local + hit
        served += hit
    return hits, served


def hits_pool(chains: list[list[int]], capacity: int, policy: str = "lru", engine: int = 0) -> tuple[int, int]:
    """(blocks hit, blocks the pool served) with the embedded pool holding `capacity` blocks under
    `policy`; `engine`: an engine cache of that many blocks in front (0: none)."""
    pool = MemoryBackend(capacity * BLOCK_BYTES, make_policy(policy, capacity * BLOCK_BYTES))
    return _replay(pool, chains, lambda: None, _Engine(engine) if engine else None)


def hits_kvpool(chains: list[list[int]], capacity: int) -> int:
    """Blocks hit with the embedded pool holding `capacity` blocks (its LRU: kvpool before policies)."""
    return hits_pool(chains, capacity)[0]


def hits_tiered(chains: list[list[int]], capacity: int, disk_factor: int = DISK_FACTOR, policy: str = "lru") -> int:
    """Blocks hit with the embedded pool holding `capacity` blocks in DRAM (`policy`'s evictions) and at
    least `disk_factor` times as many on its disk tier (sized for the longest key's file), every write on
    disk before the next request."""
    with tempfile.TemporaryDirectory(prefix="kvpool-trace-disk-") as folder:
        file_bytes = HEADER_BYTES + len(block_key(0)) + BLOCK_BYTES
        disk = DiskTier(folder, disk_factor * capacity * file_bytes)
        memory = MemoryBackend(capacity * BLOCK_BYTES, dram_policy(policy, capacity * BLOCK_BYTES))
        pool = TieredPool(memory, disk, write_queue_bytes=1 << 30)
        try:
            return _replay(pool, chains, lambda: pool.flush(60.0))[0]
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


def target_ratio(share: float) -> float:
    """The least `DEFAULT_POLICY` ÷ LRU the issue asks at a capacity share."""
    return next(ratio for upto, ratio in TARGETS if share <= upto + 1e-9)


def run(
    *,
    capacities: Sequence[float] = (0.01, 0.02, 0.05, 0.10, 0.20),
    limit: int | None = None,
    trace: Path = TRACE,
    tiered: bool = True,
    policies: Sequence[str] = POOL_POLICIES,
    engine_share: float = ENGINE_SHARE,
    part: str = "all",
) -> dict[str, Any]:
    """`tiered`: also the disk tier's rows (real files: about a minute a policy over the whole trace);
    `engine_share`: the engine cache in front, as a share of the distinct blocks (0: no such rows)."""
    for share in capacities:
        if not 0 < share <= 1:
            raise ValueError(f"capacity {share}: expected a share of the distinct blocks in (0, 1]")
    if not 0 <= engine_share <= 1:
        raise ValueError(f"engine share {engine_share}: expected a share of the distinct blocks in [0, 1]")
    for policy in policies:
        if policy not in POOL_POLICIES:
            raise ValueError(f"policy {policy!r}: expected one of {', '.join(POOL_POLICIES)}")
    policies = list(dict.fromkeys(["lru", *policies]))  # the baseline always, first
    started = time.perf_counter()
    chains = load_trace(trace, limit, part)
    blocks = sum(map(len, chains))
    distinct = len({block for chain in chains for block in chain})
    unlimited = hits_lru(chains, distinct)
    engine = max(1, round(engine_share * distinct)) if engine_share else 0
    rows = []
    for share in capacities:
        capacity = max(1, round(share * distinct))
        lru = hits_lru(chains, capacity)
        row: dict[str, Any] = {
            "capacity_share": share,
            "capacity_blocks": capacity,
            "lru": _rate(lru, blocks),
            "min": _rate(hits_min(chains, capacity), blocks),
        }
        pool = {policy: hits_pool(chains, capacity, policy)[0] for policy in policies}
        row["pool"] = {policy: _rate(hits, blocks) for policy, hits in pool.items()}
        row["kvpool"] = row["pool"]["lru"]
        row["ratio"] = {policy: round(hits / max(1, lru), 3) for policy, hits in pool.items()}
        if tiered:
            row["disk"] = {
                policy: _rate(hits_tiered(chains, capacity, policy=policy), blocks)
                for policy in policies
                if policy in DISK_POLICIES
            }
            row["kvpool+disk"] = row["disk"]["lru"]
        if engine:
            both = {policy: hits_pool(chains, capacity, policy, engine) for policy in policies}
            row["engine"] = {
                "total": {policy: _rate(total, blocks) for policy, (total, _) in both.items()},
                "pool": {policy: _rate(served, blocks) for policy, (_, served) in both.items()},
                "ratio": {policy: round(served / max(1, both["lru"][1]), 3) for policy, (_, served) in both.items()},
            }
        rows.append(row)
    result: dict[str, Any] = {
        "bench": "trace-hits",
        "trace": str(trace.name),
        "part": part,
        "requests": len(chains),
        "prompt_blocks": blocks,
        "distinct_blocks": distinct,
        "unlimited": _rate(unlimited, blocks),
        "policies": policies,
        "default_policy": DEFAULT_POLICY,
        "engine_blocks": engine,
        "rows": rows,
        "target": (
            f"{DEFAULT_POLICY} hit rate / plain LRU's >= 1.5 at capacities up to 2%, >= 1.15 up to 5%, >= 1.0 above; "
            "behind the engine cache, the pool's hits at least the lru policy's"
        ),
        "disk_factor": DISK_FACTOR,
        "pass": _passed(rows),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    return result


def _rate(hits: int, blocks: int) -> float:
    return round(hits / max(1, blocks), 4)


def _passed(rows: Sequence[dict[str, Any]]) -> bool | None:
    """Each row's default over LRU against its target, and not below the lru policy behind the engine."""
    if not rows or DEFAULT_POLICY not in rows[0].get("ratio", {}):
        return None
    for row in rows:
        if row["ratio"][DEFAULT_POLICY] < target_ratio(row["capacity_share"]):
            return False
        if "engine" in row and row["engine"]["ratio"][DEFAULT_POLICY] < 1.0:
            return False
    return True


def print_table(result: dict[str, Any]) -> None:
    print(to_markdown(result))


def to_markdown(result: dict[str, Any]) -> str:
    from kvpool.benchmarks.report import markdown_table, verdict

    rows = result["rows"]
    if rows and "pool" in rows[0]:
        return _policy_markdown(result)
    # results from before policies: the embedded pool's LRU beside plain LRU, MIN and the disk tier
    headers = ["capacity (share of distinct blocks)", "blocks", *[f"{policy} hit rate" for policy in POLICIES]]
    table = [
        [
            f"{row['capacity_share']:.0%}",
            f"{row['capacity_blocks']:,}",
            *[f"{row[p]:.1%}" if p in row else "-" for p in POLICIES],
        ]
        for row in rows
    ]
    worst = min((row["kvpool"] - row["lru"] for row in rows), default=0.0)
    lines = [
        f"- {result['requests']:,} requests, {result['prompt_blocks']:,} prompt blocks, {result['distinct_blocks']:,} "
        f"distinct; unlimited capacity hits {result['unlimited']:.1%}",
        f"- kvpool+disk: the same DRAM, a disk tier of {result.get('disk_factor', DISK_FACTOR)}x its capacity below",
        verdict(
            "kvpool hit rate - plain LRU's, worst capacity (points)", round(100 * worst, 2), ">= 0", result["pass"]
        ),
    ]
    return markdown_table(headers, table) + "\n\n" + "\n".join(lines) + "\n"


def _policy_markdown(result: dict[str, Any]) -> str:
    from kvpool.benchmarks.report import markdown_table, verdict

    rows = result["rows"]
    policies = result["policies"]
    default = result.get("default_policy", DEFAULT_POLICY)
    headers = ["capacity", "blocks", "LRU", "MIN", *[f"pool: {policy}" for policy in policies], f"{default} / LRU"]
    table = [
        [
            f"{row['capacity_share']:.0%}",
            f"{row['capacity_blocks']:,}",
            f"{row['lru']:.1%}",
            f"{row['min']:.1%}",
            *[f"{row['pool'][policy]:.1%}" for policy in policies],
            f"{row['ratio'][default]:.2f}",
        ]
        for row in rows
    ]
    text = markdown_table(headers, table)
    if "disk" in rows[0]:
        disk_policies = list(rows[0]["disk"])
        text += "\n\nWith the disk tier below the same DRAM:\n\n" + markdown_table(
            ["capacity", *[f"pool+disk: {policy}" for policy in disk_policies]],
            [[f"{row['capacity_share']:.0%}", *[f"{row['disk'][p]:.1%}" for p in disk_policies]] for row in rows],
        )
    if "engine" in rows[0]:
        text += (
            f"\n\nBehind an engine cache of {result['engine_blocks']:,} blocks (hit in either; the pool's "
            "own share):\n\n"
        ) + markdown_table(
            ["capacity", *[f"{policy}" for policy in policies], f"{default} / lru (pool's blocks)"],
            [
                [
                    f"{row['capacity_share']:.0%}",
                    *[f"{row['engine']['total'][p]:.1%} ({row['engine']['pool'][p]:.1%})" for p in policies],
                    f"{row['engine']['ratio'][default]:.2f}",
                ]
                for row in rows
            ],
        )
    worst = min(row["ratio"][default] / target_ratio(row["capacity_share"]) for row in rows)
    lines = [
        f"- {result['trace']} ({result.get('part', 'all')}): {result['requests']:,} requests, "
        f"{result['prompt_blocks']:,} prompt blocks, {result['distinct_blocks']:,} distinct; unlimited capacity hits "
        f"{result['unlimited']:.1%}",
        verdict(f"{default} / LRU over its target, worst capacity", round(worst, 3), ">= 1", result["pass"]),
    ]
    return text + "\n\n" + "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Any) -> None:
    """Hit rate against capacity, one line per policy, the unlimited ceiling dotted."""
    from kvpool.benchmarks.report import figure

    rows = result["rows"]
    shares = [row["capacity_share"] for row in rows]
    lines: dict[str, list[float]] = {}
    if rows and "pool" in rows[0]:
        lines["LRU"] = [row["lru"] for row in rows]
        lines["MIN"] = [row["min"] for row in rows]
        for policy in result["policies"]:
            lines[f"pool: {policy}"] = [row["pool"][policy] for row in rows]
    else:
        for policy in POLICIES:
            if all(policy in row for row in rows):
                lines[policy] = [row[policy] for row in rows]
    with figure(path, ncols=1) as (_fig, axes):
        axis = axes[0]
        for label, values in lines.items():
            axis.plot(shares, values, "-o", label=label)
        axis.axhline(result["unlimited"], color="gray", ls=":", label="unlimited")
        axis.set(
            title=f"{result['trace']}: block hit rate", xlabel="capacity (share of distinct blocks)", ylabel="hit rate"
        )
        axis.set_xscale("log")
        axis.legend(fontsize=7)
