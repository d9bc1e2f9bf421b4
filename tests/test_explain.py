"""`explain`: the hit a lookup would find, per group what is present, and the reason the hit stops."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.keys import chunk_hashes
from kvpool.core.masks import FullAttention, MaskCoordinator, SlidingWindow
from kvpool.scheduler.explain import StopReason, explain
from kvpool.scheduler.scheduler_core import SchedulerCore
from test_scheduler import Pool, full_scheduler, hashes_for, space


def hybrid(pool: Pool, retention: int | None = None) -> SchedulerCore:
    kinds = [FullAttention(16), SlidingWindow(32, 40)]  # lcm 32; the window needs the 2 chunks before a hit
    namespaces = [[space(kinds[0], 0)], [space(kinds[1], 1)]]
    return SchedulerCore(MaskCoordinator(kinds, retention_interval=retention), namespaces, pool.exists)


@pytest.mark.parametrize(
    ("num_tokens", "hashes", "stored", "hit", "reason"),
    [
        (129, 8, 8, 128, StopReason.LAST_TOKEN),  # token 128 is the last: recomputed
        (128, 8, 8, 112, StopReason.LAST_TOKEN),
        (200, 8, 8, 128, StopReason.PARTIAL_BLOCK),  # tokens 128..199 never filled a block
        (129, 8, 5, 80, StopReason.MISSING_CHUNK),
        (129, 8, 0, 0, StopReason.MISSING_CHUNK),
        (10, 0, 0, 0, StopReason.PARTIAL_BLOCK),
    ],
)
def test_a_full_attention_hit_stops_where_a_lookup_does_and_says_why(num_tokens, hashes, stored, hit, reason):
    pool = Pool()
    sched = full_scheduler(pool)
    block_hashes = hashes_for("p", hashes)
    pool.store(sched.namespaces[0], block_hashes, range(stored))
    explanation = explain(sched, block_hashes, num_tokens)
    assert (explanation.hit_tokens, explanation.reason) == (hit, reason)
    assert explanation.hit_tokens == sched.lookup("r", block_hashes, num_tokens)
    assert explanation.groups[0].present == [chunk < stored for chunk in range(hashes)]
    assert explanation.groups[0].loads == list(range(hit // 16))
    if reason is StopReason.MISSING_CHUNK:
        assert f"chunk {stored} " in explanation.detail
    assert explanation.to_dict()["reason"] == reason.value


def test_a_hybrid_hit_stops_at_alignment_or_at_a_missing_window_chunk():
    pool = Pool()
    sched = hybrid(pool)
    block_hashes = hashes_for("p", 10)  # 160 tokens of full blocks
    windows = chunk_hashes(block_hashes, 16, 32)
    pool.store(sched.namespaces[0], block_hashes, range(10))
    pool.store(sched.namespaces[1], windows, range(5))
    assert explain(sched, block_hashes, 161).hit_tokens == 160
    # 9 full blocks: full attention alone could hit 144, but boundaries are multiples of 32
    aligned = explain(sched, block_hashes[:9], 150)
    assert (aligned.hit_tokens, aligned.reason) == (128, StopReason.ALIGNMENT)
    pool.backend.remove([sched.namespaces[1][0].key(windows[4])])
    missing = explain(sched, block_hashes, 161)
    assert (missing.hit_tokens, missing.reason) == (128, StopReason.MISSING_CHUNK)
    assert "group 1 (sliding_window" in missing.detail and "chunk 4 " in missing.detail
    assert missing.hit_tokens == sched.lookup("r", block_hashes, 161)
    assert missing.groups[1].loads == [2, 3]  # the window before 128 tokens
    assert missing.groups[0].loads == list(range(8))


def test_with_the_replay_only_retention_a_window_chunk_off_the_mask_is_named_as_such():
    pool = Pool()
    sched = hybrid(pool, retention=0)  # window tails kept only at the prompt's own replay boundary
    block_hashes = hashes_for("p", 10)
    windows = chunk_hashes(block_hashes, 16, 32)
    pool.store(sched.namespaces[0], block_hashes, range(10))
    pool.store(sched.namespaces[1], windows, [3, 4])  # what a save of this prompt keeps: the replay tail
    assert explain(sched, block_hashes, 161).hit_tokens == 160
    shorter = explain(sched, block_hashes, 129)  # replay boundary 128 needs chunks 2 and 3: 2 was never kept
    assert (shorter.hit_tokens, shorter.reason) == (0, StopReason.MASK)


@settings(max_examples=80, deadline=None)
@given(
    num_tokens=st.integers(1, 400),
    hashes=st.integers(0, 24),
    full=st.sets(st.integers(0, 23)),
    window=st.sets(st.integers(0, 11)),
)
def test_the_explained_hit_is_the_lookup_hit(num_tokens, hashes, full, window):
    pool = Pool()
    sched = hybrid(pool)
    block_hashes = hashes_for("p", hashes)
    pool.store(sched.namespaces[0], block_hashes, sorted(c for c in full if c < hashes))
    windows = chunk_hashes(block_hashes, 16, 32)
    pool.store(sched.namespaces[1], windows, sorted(c for c in window if c < len(windows)))
    explanation = explain(sched, block_hashes, num_tokens)
    assert explanation.hit_tokens == sched.longest_hit(block_hashes, num_tokens)
    assert explanation.hit_tokens <= explanation.aligned_tokens <= explanation.limit_tokens < max(num_tokens, 1)
