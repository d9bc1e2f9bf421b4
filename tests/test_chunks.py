"""process_tokens / chunk_range against a brute-force reference, and lazy hash reads."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import overload

import pytest

from kvpool.core.chunks import chunk_range, process_tokens
from kvpool.core.errors import LayoutError
from kvpool.core.keys import ChunkHashes, chunk_hashes
from kvpool.core.masks import Mask


def reference_chunks(
    token_len: int, num_hashes: int, start: int, mask: Mask, put_step: int, rank: int, block: int
) -> list[int]:
    """Chunk c is handled when it starts at or after `start` (rounded up to a block), ends within
    ceil(token_len / block) chunks, has a hash, is set in the mask (relative to the first chunk)
    and is owned by `rank` (absolute id)."""
    first = -(-max(start, 0) // block)
    out = []
    for c in range(0, 200):
        if c < first or c >= -(-token_len // block) or c >= num_hashes:
            continue
        if mask is not None and (c - first >= len(mask) or not mask[c - first]):
            continue
        if c % put_step != rank:
            continue
        out.append(c)
    return out


def masks_for(length: int) -> list[Mask]:
    """None, plus a few patterns of several lengths around the range length."""
    out: list[Mask] = [None]
    for n in {0, max(0, length - 1), length, length + 2}:
        out.append([True] * n)
        out.append([i % 2 == 0 for i in range(n)])
        out.append([i % 3 == 2 for i in range(n)])
    return out


class RecordingHashes(Sequence[bytes]):
    """A hash list that records every index read."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.reads: list[int] = []

    def __len__(self) -> int:
        return self.count

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[bytes]: ...
    def __getitem__(self, index: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(index, slice):
            raise AssertionError("process_tokens must not slice the hash list")
        if not 0 <= index < self.count:
            raise IndexError(index)
        self.reads.append(index)
        return b"h%d" % index


@pytest.mark.parametrize("block", [1, 4])
def test_chunk_range_matches_brute_force(block: int) -> None:
    checked = 0
    for token_len in range(0, 6 * block + 2, max(1, block // 2) if block > 1 else 1):
        for start in range(0, token_len + block + 1, max(1, block // 2) if block > 1 else 1):
            first = -(-start // block)
            span = max(0, -(-token_len // block) - first)
            for num_hashes in (0, 2, 5, 9):
                for mask in masks_for(span):
                    for put_step in (1, 2, 3):
                        for rank in range(put_step):
                            got = list(
                                chunk_range(
                                    token_len,
                                    num_hashes,
                                    start,
                                    mask,
                                    block_size=block,
                                    put_step=put_step,
                                    put_step_rank=rank,
                                )
                            )
                            want = reference_chunks(token_len, num_hashes, start, mask, put_step, rank, block)
                            assert got == want, (token_len, num_hashes, start, mask, put_step, rank, block)
                            checked += 1
    assert checked > 1000


def test_process_tokens_spans_and_hashes() -> None:
    hashes = [b"a", b"b", b"c", b"d", b"e"]
    got = list(process_tokens(70, hashes, 16, None, block_size=16))
    # chunks 1..4, the last one partial (64..70), each named by its own hash
    assert got == [(16, 32, b"b"), (32, 48, b"c"), (48, 64, b"d"), (64, 70, b"e")]
    # a start inside a block rounds up to the next chunk
    assert [s for s, _, _ in process_tokens(64, hashes, 17, None, block_size=16)] == [32, 48]
    # striding uses the absolute chunk id: rank 1 of 2 gets the odd chunks whatever the start
    assert [s // 16 for s, _, _ in process_tokens(80, hashes, 0, None, block_size=16, put_step=2, put_step_rank=1)] == [
        1,
        3,
    ]
    assert [
        s // 16 for s, _, _ in process_tokens(80, hashes, 32, None, block_size=16, put_step=2, put_step_rank=1)
    ] == [3]
    assert [
        s // 16 for s, _, _ in process_tokens(80, hashes, 48, None, block_size=16, put_step=2, put_step_rank=1)
    ] == [3]
    # the mask is relative to the first chunk of the range
    assert [s // 16 for s, _, _ in process_tokens(80, hashes, 32, [False, True, True], block_size=16)] == [3, 4]
    # a mask shorter than the range caps it
    assert [s // 16 for s, _, _ in process_tokens(80, hashes, 0, [True, True], block_size=16)] == [0, 1]
    # no hash, no chunk
    assert list(process_tokens(80, hashes[:2], 0, None, block_size=16)) == [(0, 16, b"a"), (16, 32, b"b")]


@pytest.mark.parametrize("block", [2, 4])
def test_process_tokens_reads_only_yielded_hashes(block: int) -> None:
    for token_len, start in itertools.product(range(0, 8 * block + 1, block), range(0, 8 * block + 1, 3)):
        first = -(-start // block)
        span = max(0, -(-token_len // block) - first)
        for mask in masks_for(span):
            for put_step in (1, 2, 3):
                for rank in range(put_step):
                    hashes = RecordingHashes(7)
                    out = list(
                        process_tokens(
                            token_len, hashes, start, mask, block_size=block, put_step=put_step, put_step_rank=rank
                        )
                    )
                    chunks = [s // block for s, _, _ in out]
                    assert hashes.reads == chunks
                    assert [h for _, _, h in out] == [b"h%d" % c for c in chunks]
                    assert chunks == reference_chunks(token_len, 7, start, mask, put_step, rank, block)


def test_block_size_larger_than_hash_block_uses_last_constituent_hash() -> None:
    # hash block 16, group block 64: chunk i is named by hash 4i + 3, which chains the whole prefix
    raw = RecordingHashes(18)  # 18 hash blocks → 4 whole chunks of 64 tokens (the last 2 are a partial chunk)
    hashes = chunk_hashes(raw, 16, 64)
    assert isinstance(hashes, ChunkHashes)
    assert len(hashes) == 4
    out = list(process_tokens(18 * 16, hashes, 64, [True, False, True], block_size=64))
    assert out == [(64, 128, b"h7"), (192, 256, b"h15")]
    assert raw.reads == [7, 15]
    # striding over chunk ids, not hash ids
    raw.reads.clear()
    out = list(process_tokens(256, hashes, 0, None, block_size=64, put_step=2, put_step_rank=1))
    assert [h for _, _, h in out] == [b"h7", b"h15"]
    assert raw.reads == [7, 15]
    # a partial last chunk (no whole-chunk hash) is never yielded
    assert [s for s, _, _ in process_tokens(18 * 16, hashes, 0, None, block_size=64)] == [0, 64, 128, 192]


def test_same_block_size_passes_hashes_through() -> None:
    raw = [b"x", b"y"]
    assert chunk_hashes(raw, 16, 16) is raw


@pytest.mark.parametrize(
    ("put_step", "rank", "block"),
    [(0, 0, 16), (2, 2, 16), (2, -1, 16), (1, 0, 0), (1, 0, -16)],
)
def test_chunk_range_rejects_bad_striding(put_step: int, rank: int, block: int) -> None:
    with pytest.raises(LayoutError):
        list(chunk_range(64, 4, 0, None, block_size=block, put_step=put_step, put_step_rank=rank))
