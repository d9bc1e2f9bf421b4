"""Which tier a pool hit's tokens come from, from the scheduler's index (no engine): a token is disk
when a chunk it needs is on some rank's disk tier only; a state chunk covers the whole load."""

from __future__ import annotations

import hashlib

from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.core.masks import FullAttention, MaskCoordinator, StateSpace
from kvpool.core.pool_reports import PoolReport
from kvpool.scheduler.hit_tiers import disk_tokens
from kvpool.scheduler.index import PoolIndex

B = 16


def space(group: int, shard: int = 0) -> KeySpace:
    return KeySpace(LayoutFingerprint("m", "u8", B, "t", tp_shard=shard, group_id=group))


def hashes(n: int) -> list[bytes]:
    return [hashlib.blake2b(str(i).encode(), digest_size=16).digest() for i in range(n)]


def held(index: PoolIndex, rank: int, prefix: str, chunks: list[bytes], disk_only: list[bytes]) -> None:
    index.apply(PoolReport(rank, 0, stored={prefix: chunks}, demoted={prefix: disk_only}))


def test_dram_disk_and_a_mixed_hit_split_by_token():
    coord = MaskCoordinator([FullAttention(B)])
    ns = space(0)
    index = PoolIndex([[ns]])
    chunks = hashes(8)
    held(index, 0, ns.prefix, chunks, [])
    assert disk_tokens(coord, index, chunks, 0, 8 * B) == 0  # all in DRAM: no chunk probed
    index.apply(PoolReport(0, 0, demoted={ns.prefix: chunks[5:7]}))
    assert disk_tokens(coord, index, chunks, 0, 8 * B) == 2 * B  # chunks 5 and 6 read from disk
    assert disk_tokens(coord, index, chunks, 6 * B, 8 * B) == B  # the engine holds chunks 0-5 itself
    assert disk_tokens(coord, index, chunks, 0, 5 * B) == 0
    index.apply(PoolReport(0, 0, promoted={ns.prefix: chunks[5:7]}))  # loaded back into DRAM
    assert disk_tokens(coord, index, chunks, 0, 8 * B) == 0


def test_any_rank_reading_disk_makes_the_token_disk():
    """TP 2: shard 1 holds chunk 2 on disk only, shard 0 in DRAM; the load waits on shard 1's disk."""
    coord = MaskCoordinator([FullAttention(B)])
    shards = [space(0, 0), space(0, 1)]
    index = PoolIndex([shards])
    chunks = hashes(4)
    held(index, 0, shards[0].prefix, chunks, [])
    held(index, 1, shards[1].prefix, chunks, chunks[2:3])
    assert disk_tokens(coord, index, chunks, 0, 4 * B) == B


def test_a_state_chunk_on_disk_covers_the_whole_load_and_overlaps_count_once():
    coord = MaskCoordinator([FullAttention(B), StateSpace(2 * B)])
    attention, state = space(0), space(1)
    index = PoolIndex([[attention], [state]])
    blocks = hashes(8)
    state_chunks = blocks[1::2]  # a state chunk's hash is its last block's
    held(index, 0, attention.prefix, blocks, blocks[0:2])
    held(index, 0, state.prefix, state_chunks, [])
    assert disk_tokens(coord, index, blocks, 0, 8 * B) == 2 * B  # attention chunks 0, 1
    index.apply(PoolReport(0, 0, demoted={state.prefix: state_chunks[3:4]}))  # the state at 8 blocks
    assert disk_tokens(coord, index, blocks, 0, 8 * B) == 8 * B
    assert disk_tokens(coord, index, blocks, 0, 6 * B) == 2 * B  # a hit at 6 blocks needs another state
