"""Enumerate the chunks one rank must handle in a token range."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from kvpool.core.errors import LayoutError
from kvpool.core.masks import Mask, ceil_div


class ChunkRef(NamedTuple):
    """One chunk a rank saves or loads: its group, its index, the engine block holding it, its pool key."""

    group: int
    chunk: int
    block_id: int
    key: str
    parent: bytes | None = None  # saves: the chunk hash before it in its chain (b"": the first); loads: None


def chunk_range(
    token_len: int,
    num_hashes: int,
    start: int,
    chunk_mask: Mask,
    *,
    block_size: int,
    put_step: int = 1,
    put_step_rank: int = 0,
) -> Iterable[int]:
    """Chunk ids from ceil(start / block) to min(num_hashes, ceil(token_len / block)), skipping masked
    chunks and chunks whose absolute id % put_step != put_step_rank (so a chunk's owner never
    depends on where a save starts). Without a mask a plain `range`: a decode step's save takes a chunk
    or two, where a generator's set-up is most of the cost."""
    if block_size <= 0:
        raise LayoutError(f"block_size={block_size}: expected a positive integer")
    if put_step <= 0 or not 0 <= put_step_rank < put_step:
        raise LayoutError(f"put_step_rank={put_step_rank} must lie in [0, put_step={put_step})")
    first = ceil_div(max(start, 0), block_size)
    end = min(num_hashes, ceil_div(token_len, block_size))
    owned_first = first + (put_step_rank - first) % put_step
    if chunk_mask is None:
        return range(owned_first, end, put_step)
    end = min(end, first + len(chunk_mask))
    return _masked(range(owned_first, end, put_step), chunk_mask, first)


def _masked(chunks: range, chunk_mask: list[bool], first: int) -> Iterator[int]:
    for chunk in chunks:
        if chunk_mask[chunk - first]:
            yield chunk


def process_tokens(
    token_len: int,
    block_hashes: Sequence[bytes],
    start: int,
    chunk_mask: Mask,
    *,
    block_size: int,
    put_step: int = 1,
    put_step_rank: int = 0,
) -> Iterator[tuple[int, int, bytes]]:
    """Yield (start_token, end_token, chunk_hash) for the chunks this rank must handle.

    `block_hashes` holds one hash per chunk of `block_size` tokens; only yielded chunks are read."""
    chunks = chunk_range(
        token_len,
        len(block_hashes),
        start,
        chunk_mask,
        block_size=block_size,
        put_step=put_step,
        put_step_rank=put_step_rank,
    )
    for chunk in chunks:
        begin = chunk * block_size
        yield begin, min(begin + block_size, token_len), block_hashes[chunk]
