"""What a stored chunk's KV event says beside its hash: the tokens the hash covers, from the step that
computed them, however the request's computation was split into steps."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvpool.core.masks import FullAttention, MaskCoordinator, SlidingWindow
from kvpool.scheduler.chunk_origins import ChunkOrigins

HASH_BLOCK = 8


def hashes_of(tokens: list[int]) -> list[bytes]:
    """One hash per full hash block, naming the whole prefix up to its end (as vLLM's are chained)."""
    return [bytes(repr(tokens[: (i + 1) * HASH_BLOCK]), "ascii") for i in range(len(tokens) // HASH_BLOCK)]


def coordinator() -> MaskCoordinator:
    return MaskCoordinator([FullAttention(16), SlidingWindow(8, 16)], hash_block_size=HASH_BLOCK)


@given(
    length=st.integers(0, 100),
    splits=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    computed_first=st.integers(0, 40),
)
def test_every_chunk_a_request_computes_is_recorded_with_exactly_the_tokens_its_hash_names(
    length: int, splits: list[int], computed_first: int
) -> None:
    tokens = [1000 + i * 7 % 97 for i in range(length)]
    block_hashes = hashes_of(tokens)
    origins = ChunkOrigins(coordinator())
    position = min(computed_first, length)  # tokens before: the engine's own prefix hits, never recorded here
    for step in splits:
        origins.record(block_hashes, tokens, position, step)
        position += step
    computed = min(position, length)
    for group, size in enumerate((16, 8)):
        for chunk in range(length // size):
            start, end = chunk * size, (chunk + 1) * size
            origin = origins.take(group, block_hashes[end // HASH_BLOCK - 1])
            if start >= min(computed_first, length) // size * size and end <= computed:
                assert origin is not None and list(origin.token_ids) == tokens[start:end]
            elif end <= min(computed_first, length):
                assert origin is None  # computed before: its event came from the step that computed it


def test_a_record_is_taken_once_and_the_oldest_go_first_past_the_limit() -> None:
    tokens = list(range(64))
    block_hashes = hashes_of(tokens)
    origins = ChunkOrigins(MaskCoordinator([FullAttention(8)], hash_block_size=HASH_BLOCK), limit=4)
    origins.record(block_hashes, tokens, 0, 64, extra_keys=lambda start, end: ("salt",) if start == 0 else None)
    assert len(origins) == 4
    assert origins.take(0, block_hashes[0]) is None  # dropped: announced without tokens, never wrong ones
    last = origins.take(0, block_hashes[7])
    assert last is not None and last.token_ids == tuple(range(56, 64)) and last.extra_keys is None
    assert origins.take(0, block_hashes[7]) is None
