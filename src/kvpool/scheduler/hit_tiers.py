"""Which tier a pool hit's tokens come from: the embedded pool's DRAM, or some rank's disk tier.

An engine's metrics split a hit by the tier that supplied it (vLLM: `prompt_tokens_cached_by_source`,
asked once per admitted request with a hit, right after its load is armed). The scheduler's index
knows, per chunk, whether some rank holds it on its disk tier only (the workers report `demoted` /
`promoted` with every change), so the load of that chunk waits on a disk read there.

A token counts as *disk* when the KV it needs comes from a chunk some rank reads from disk: a chunk of
an attention group covers its own tokens; a state group's chunk (Mamba-like: the state after the
whole prefix) covers every token of the load. Where several groups or ranks cover a token, the tier
farthest from the engine wins (vLLM's rule too: a token needs all of them). Every other token of the
load counts as DRAM: the pool served it without a disk read.

Cost: one call per admitted hit, never per engine step; O(groups) while no chunk is on disk only,
else one dict probe per loaded chunk (in C) and one interval merge.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.core.keys import chunk_hashes
from kvpool.core.masks import MaskCoordinator, StateSpace
from kvpool.scheduler.index import PoolIndex


def disk_tokens(
    coordinator: MaskCoordinator, index: PoolIndex, block_hashes: Sequence[bytes], start: int, end: int
) -> int:
    """How many of the load's tokens `[start, end)` (a hit ending at the boundary `end`) need a chunk
    that some rank holds on its disk tier only."""
    if end <= start:
        return 0
    spans: list[tuple[int, int]] = []
    for group, kind in enumerate(coordinator.kinds):
        if not index.any_on_disk(group):
            continue
        size = kind.block_size
        needed = kind.required(end)
        first = max(needed.start, start // size)  # chunks below `start` are the engine's own: not loaded
        chunks = range(first, needed.stop)
        if not chunks:
            continue
        hashes = chunk_hashes(block_hashes, coordinator.hash_block_size, size)
        flags = index.on_disk(group, hashes[first : needed.stop])
        if isinstance(kind, StateSpace):
            if any(flags):
                return end - start  # the state after the whole prefix: every token waits on it
            continue
        spans.extend(
            (max(start, chunk * size), min(end, (chunk + 1) * size)) for chunk, disk in zip(chunks, flags) if disk
        )
    return _covered(spans)


def _covered(spans: list[tuple[int, int]]) -> int:
    """Tokens in the union of half-open spans."""
    total, reach = 0, -1
    for lo, hi in sorted(spans):
        lo = max(lo, reach)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total
