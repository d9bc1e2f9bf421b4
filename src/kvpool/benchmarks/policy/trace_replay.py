"""Replaying a trace in the Mooncake format through a pool or a cache: how many of its blocks hit.

A trace (one JSON object a line with `hash_ids`, and `timestamp` for the derived traces; by default
`../shared/data/mooncake-traces/conversation_trace.jsonl`, one hour of real chat requests from
Mooncake's serving system) names each request's prompt as a chain of block hashes; two requests that
share their first k hashes share their first k blocks. Every request, in arrival order: its hit is the
leading run of its blocks the pool holds (the prefix rule every connector follows: a block is only
usable after all blocks before it); then its blocks are stored.

The replays, each counting the blocks hit:
- `hits_pool`: the embedded pool (`MemoryBackend` under one of `kvpool.core.policy`'s policies), driven
  as kvpool drives it: `exists` for the lookup, `get_into` for the hit's blocks (a load), then the save
  as the worker makes it for the embedded pool: `exists` on the rest and `put_linked` of those missing,
  each told its chain parent (block i-1's hash; b"" for a chain's first block). A chunk the policy
  declines is not stored (`Status.DECLINED`). `starts`: per request, the blocks an engine prefix cache
  in front hit (`engine_hits`: LRU, a request's blocks touched tail first), which the pool is not asked
  for: it looks up what the engine missed, loads its hit and saves the rest.
- `hits_tiered`: the pool with its disk tier below (`TieredPool`, real files in a temporary folder,
  `DISK_FACTOR` times DRAM's capacity), every write flushed before the next request so that the figure
  does not depend on the writer's timing. DRAM admits every put there (the disk is written from DRAM's
  copies).
- `hits_lru`: plain LRU over blocks, each block touched head to tail: a chain's head ages first, and a
  chain that lost its head is unreachable however recent its tail. With room for every distinct block:
  no eviction, the trace's own reuse.
- `hits_min`: Belady's MIN (evict the block whose next use is farthest away; a block never used again
  first; a block is not cached when it is itself the farthest): the offline reference. Not an optimum
  under the prefix rule (it may keep a chain's tail and drop its head), so a policy may beat it.

`derive` makes a trace from another deterministically, to check a policy on streams it was not designed
on: `second-half`, the requests of the trace's second half in time; `alternate`, every other
conversation (a conversation: the requests whose first block after the trace's common head is the same;
the shared trace's every request starts with one block 0, a system prompt).
"""

from __future__ import annotations

import heapq
import json
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvpool.backends.base import Rows
from kvpool.backends.disk import DiskTier
from kvpool.backends.disk_file import HEADER_BYTES
from kvpool.backends.memory import MemoryBackend
from kvpool.backends.shared_pools import dram_policy
from kvpool.backends.tiered import TieredPool
from kvpool.core.policy import DEFAULT_POLICY, make_policy

TRACE = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "mooncake-traces" / "conversation_trace.jsonl"
BASELINE = "lru"  # the ratios' denominator: kvpool's own pool with its LRU order
DISK_POLICIES = (DEFAULT_POLICY,)  # a disk replay writes real files: the default policy's only
DERIVED = ("second-half", "alternate")
DISK_FACTOR = 4
BLOCK_BYTES = 8  # what the embedded pool stores per block here: only the count matters
LINK_BYTES = 8  # a block's parent hash, which its disk file keeps


@dataclass(frozen=True)
class Trace:
    """A trace's requests in arrival order: each one's block hashes and arrival time (ms)."""

    name: str
    chains: list[list[int]]
    times: list[float]


def load_requests(path: Path = TRACE, limit: int | None = None) -> Trace:
    """The trace's requests (the first `limit`)."""
    if not path.is_file():
        raise FileNotFoundError(f"trace {path}: not found (a trace in the Mooncake format, see the shared README)")
    chains: list[list[int]] = []
    times: list[float] = []
    with path.open() as lines:
        for line in lines:
            if limit is not None and len(chains) >= limit:
                break
            if line.strip():
                request = json.loads(line)
                chains.append([int(h) for h in request["hash_ids"]])
                times.append(float(request.get("timestamp", len(times))))
    return Trace(path.name, chains, times)


def load_trace(path: Path = TRACE, limit: int | None = None) -> list[list[int]]:
    """Each request's block hashes, in arrival order (the first `limit` requests)."""
    return load_requests(path, limit).chains


def derive(trace: Trace, how: str) -> Trace:
    """A trace made from `trace`: `second-half` (its requests from the middle of its time span on) or
    `alternate` (every other conversation, the first kept, in order of first arrival)."""
    if how == "second-half":
        middle = (trace.times[0] + trace.times[-1]) / 2 if trace.times else 0.0
        kept = [i for i, at in enumerate(trace.times) if at >= middle]
    elif how == "alternate":
        head = common_head(trace.chains)
        order: dict[int | None, int] = {}
        kept = []
        for index, chain in enumerate(trace.chains):
            conversation = chain[head] if len(chain) > head else None
            if order.setdefault(conversation, len(order)) % 2 == 0:
                kept.append(index)
    else:
        raise ValueError(f"derived trace {how!r}: expected one of {', '.join(DERIVED)}")
    return Trace(f"{trace.name} ({how})", [trace.chains[i] for i in kept], [trace.times[i] for i in kept])


def common_head(chains: Sequence[Sequence[int]]) -> int:
    """How many leading blocks every request shares (a system prompt)."""
    if not chains:
        return 0
    first = chains[0]
    depth = min(map(len, chains))
    for chain in chains:
        while depth and list(chain[:depth]) != list(first[:depth]):
            depth -= 1
    return depth


def _leading(present: Sequence[bool]) -> int:
    for index, there in enumerate(present):
        if not there:
            return index
    return len(present)


def block_key(block: int) -> str:
    """A block's pool key: a namespace and the block's hash in hex, as kvpool's keys are (the policies
    find a chunk's parent's key from its hash)."""
    return f"trace/{block:016x}"


def _parents(chain: Sequence[int]) -> list[bytes]:
    """Each block's parent hash: the block before it, b"" for the first."""
    return [b""] + [block.to_bytes(LINK_BYTES, "big") for block in chain[:-1]]


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


def engine_hits(chains: Sequence[Sequence[int]], capacity: int) -> list[int]:
    """Per request, the blocks an engine cache of `capacity` blocks hits (0 everywhere without one)."""
    if capacity <= 0:
        return [0] * len(chains)
    engine = _Engine(capacity)
    return [engine.serve(chain) for chain in chains]


def _replay(
    pool: MemoryBackend | TieredPool,
    chains: Sequence[Sequence[int]],
    settle: Callable[[], object] = lambda: None,
    starts: Sequence[int] | None = None,
) -> tuple[int, int]:
    """(blocks the pool served, blocks it was asked for), driving `pool` as kvpool drives it: `exists`
    for the lookup of what the engine lacks (`starts[i]`: request i's blocks the engine hit), `get_into`
    for the hit's blocks (a load), `exists` then `put_linked` of the rest the pool lacks (the save, each
    block told its parent); `settle` after each request."""
    blocks = np.zeros((max(map(len, chains), default=0), BLOCK_BYTES), dtype=np.uint8)
    served = asked = 0
    for index, chain in enumerate(chains):
        start = starts[index] if starts is not None else 0
        keys = [block_key(block) for block in chain]
        asked += len(keys) - start
        hit = _leading(pool.exists(keys[start:])) if start < len(keys) else 0
        if hit:
            pool.get_into(keys[start : start + hit], Rows((blocks,), np.arange(hit)))
        rest = start + hit
        if rest < len(keys):
            missing = [i for i, there in zip(range(rest, len(keys)), pool.exists(keys[rest:])) if not there]
            if missing:
                parents = _parents(chain)
                pool.put_linked(
                    [keys[i] for i in missing], Rows((blocks,), np.arange(len(missing))), [parents[i] for i in missing]
                )
        settle()
        served += hit
    return served, asked


def hits_pool(
    chains: Sequence[Sequence[int]], capacity: int, policy: str = BASELINE, starts: Sequence[int] | None = None
) -> int:
    """Blocks the embedded pool holding `capacity` blocks under `policy` served (`starts`: per request,
    the blocks an engine cache in front hit, which the pool is not asked for)."""
    pool = MemoryBackend(capacity * BLOCK_BYTES, make_policy(policy, capacity * BLOCK_BYTES))
    return _replay(pool, chains, starts=starts)[0]


def hits_kvpool(chains: list[list[int]], capacity: int) -> int:
    """Blocks hit with the embedded pool holding `capacity` blocks (the lru policy: kvpool before policies)."""
    return hits_pool(chains, capacity)


def hits_tiered(
    chains: Sequence[Sequence[int]], capacity: int, disk_factor: int = DISK_FACTOR, policy: str = DEFAULT_POLICY
) -> int:
    """Blocks hit with the embedded pool holding `capacity` blocks in DRAM (`policy`'s evictions) and at
    least `disk_factor` times as many on its disk tier (sized for a key's file), every write on disk
    before the next request."""
    with tempfile.TemporaryDirectory(prefix="kvpool-trace-disk-") as folder:
        file_bytes = HEADER_BYTES + len(block_key(0)) + LINK_BYTES + BLOCK_BYTES  # a file: header, key, link, value
        disk = DiskTier(folder, disk_factor * capacity * file_bytes)
        memory = MemoryBackend(capacity * BLOCK_BYTES, dram_policy(policy, capacity * BLOCK_BYTES))
        pool = TieredPool(memory, disk, write_queue_bytes=1 << 30)
        try:
            return _replay(pool, chains, lambda: pool.flush(60.0))[0]
        finally:
            pool.shutdown(5.0)


def hits_lru(chains: Iterable[Sequence[int]], capacity: int) -> int:
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


def hits_min(chains: Sequence[Sequence[int]], capacity: int) -> int:
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
