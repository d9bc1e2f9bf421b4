"""Masks: reachability per attention kind, prefix stability, suffix consistency, longest common hit."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.errors import ConfigError, LayoutError
from kvpool.core.masks import (
    AttentionKind,
    ChunkedLocal,
    FullAttention,
    MaskCoordinator,
    SlidingWindow,
    StateSpace,
    ceil_div,
)

F, T = False, True

# ---- an independent, token-level model of what a hit needs -----------------------------------


def needed_chunks(kind: AttentionKind, boundary: int) -> set[int]:
    """Chunks holding the tokens a hit ending at `boundary` must load, derived from token positions."""
    b = kind.block_size
    if isinstance(kind, FullAttention):
        lo = 0
    elif isinstance(kind, SlidingWindow):
        lo = max(0, boundary - (kind.window - 1))  # the window's last window-1 tokens before L
    elif isinstance(kind, ChunkedLocal):
        lo = boundary // kind.attention_chunk_size * kind.attention_chunk_size
    elif isinstance(kind, StateSpace):
        return {boundary // b - 1} if boundary >= b else set()
    else:  # pragma: no cover
        raise AssertionError(kind)
    return {c for c in range(boundary // b) if (c + 1) * b > lo}


def reachable(coord: MaskCoordinator, num_prompt_tokens: int, limit: int) -> list[int]:
    lcm = coord.lcm
    replay = max(0, num_prompt_tokens - 1) // lcm * lcm
    out = []
    for boundary in range(lcm, limit + 1, lcm):
        every = coord.retention_interval
        if every is None or boundary == replay or (every and boundary % every == 0):
            out.append(boundary)
    return out


def brute_store_mask(coord: MaskCoordinator, group: int, token_len: int, start: int, prompt: int) -> list[bool]:
    kind = coord.kinds[group]
    b = kind.block_size
    if isinstance(kind, FullAttention):
        # full attention stores every chunk whatever the retention (the reference design's choice:
        # its chunks are needed by every later boundary)
        return [True] * (ceil_div(token_len, b) - ceil_div(start, b))
    stored: set[int] = set()
    for boundary in reachable(coord, prompt, token_len + 4 * coord.lcm + 2 * b + 256):
        stored |= needed_chunks(kind, boundary)
    return [c in stored for c in range(ceil_div(start, b), ceil_div(token_len, b))]


def expand(mask: list[bool] | None, count: int) -> list[bool]:
    return [True] * count if mask is None else mask


def brute_longest_hit(coord: MaskCoordinator, max_tokens: int, present: list[set[int]]) -> int:
    best = 0
    for boundary in range(coord.lcm, max_tokens + 1, coord.lcm):
        if all(needed_chunks(kind, boundary) <= have for kind, have in zip(coord.kinds, present)):
            best = boundary
    return best


# ---- reference examples -------------------------------------------------------------------------


def test_reference_sliding_window_masks() -> None:
    coord = MaskCoordinator([FullAttention(32), SlidingWindow(8, 8)])
    assert coord.lcm == 32
    assert coord.store_mask(0, 64, 0, 64) is None
    assert coord.store_mask(1, 64, 0, 64) == [F, F, F, T, F, F, F, T]
    coord16 = MaskCoordinator([FullAttention(32), SlidingWindow(8, 16)])
    assert coord16.store_mask(1, 64, 0, 64) == [F, F, T, T, F, F, T, T]


def test_reference_retention_masks() -> None:
    replay_only = MaskCoordinator([FullAttention(32), SlidingWindow(8, 8)], retention_interval=0)
    mask = replay_only.store_mask(1, 128, 0, 100)
    assert mask is not None and [c for c, bit in enumerate(mask) if bit] == [11]
    every64 = MaskCoordinator([FullAttention(32), SlidingWindow(8, 8)], retention_interval=64)
    mask = every64.store_mask(1, 128, 0, 100)
    assert mask is not None and [c for c, bit in enumerate(mask) if bit] == [7, 11, 15]
    # the full-attention group still stores everything
    assert every64.store_mask(0, 128, 0, 100) is None


def test_dense_window_gives_no_mask() -> None:
    # a window covering a whole LCM stride stores every chunk: no per-chunk work
    coord = MaskCoordinator([FullAttention(32), SlidingWindow(8, 33)])
    assert coord.store_mask(1, 256, 0, 256) is None
    assert coord.lookup_masks(256) == [None, None]


# ---- prefix stability and suffix consistency ----------------------------------------------------

KIND_FACTORIES = [
    lambda: [SlidingWindow(16, 16)],
    lambda: [FullAttention(32), SlidingWindow(8, 8)],
    lambda: [FullAttention(32), SlidingWindow(8, 20)],
    lambda: [FullAttention(16), SlidingWindow(16, 40)],
    lambda: [FullAttention(64), ChunkedLocal(16, 32)],
    lambda: [FullAttention(16), ChunkedLocal(16, 64)],
    lambda: [ChunkedLocal(8, 8)],
    lambda: [FullAttention(32), StateSpace(32)],
    lambda: [FullAttention(16), StateSpace(32)],
    lambda: [FullAttention(32), SlidingWindow(8, 8), SlidingWindow(16, 50), StateSpace(32)],
]


def retention_choices(lcm: int) -> list[int | None]:
    return [None, 0, lcm, 3 * lcm]


@pytest.mark.parametrize("factory", KIND_FACTORIES)
def test_masks_are_prefix_stable_and_suffix_consistent(factory) -> None:  # type: ignore[no-untyped-def]
    lcm = math.lcm(*(k.block_size for k in factory()))
    for retention in retention_choices(lcm):
        coord = MaskCoordinator(factory(), retention_interval=retention)
        for prompt in (1, lcm, lcm + 1, 3 * lcm + 5, 7 * lcm):
            for group, kind in enumerate(coord.kinds):
                b = kind.block_size
                longest = coord.store_mask(group, 8 * lcm, 0, prompt)
                full = expand(longest, 8 * lcm // b)
                assert full == brute_store_mask(coord, group, 8 * lcm, 0, prompt), (kind, retention, prompt)
                for aligned in range(0, 8 * lcm + 1, lcm):
                    mask = coord.store_mask(group, aligned, 0, prompt)
                    assert (mask is None) == (longest is None)
                    assert expand(mask, aligned // b) == full[: aligned // b]
                    for start in range(0, aligned + 1, max(1, b // 2)):
                        tail = coord.store_mask(group, aligned, start, prompt)
                        first = ceil_div(start, b)
                        assert expand(tail, aligned // b - first) == full[first : aligned // b]


@pytest.mark.parametrize("factory", KIND_FACTORIES)
def test_lookup_and_load_masks_cover_what_hits_need(factory) -> None:  # type: ignore[no-untyped-def]
    coord = MaskCoordinator(factory())
    for aligned in range(coord.lcm, 6 * coord.lcm + 1, coord.lcm):
        lookup = coord.lookup_masks(aligned)
        load = coord.load_masks(aligned)
        for group, kind in enumerate(coord.kinds):
            count = aligned // kind.block_size
            need = needed_chunks(kind, aligned)
            assert [c in need for c in range(count)] == expand(load[group], count)
            asked = {c for c, bit in enumerate(expand(lookup[group], count)) if bit}
            for boundary in range(coord.lcm, aligned + 1, coord.lcm):
                assert needed_chunks(kind, boundary) <= asked


@given(
    factory=st.sampled_from(KIND_FACTORIES),
    retention_mult=st.sampled_from([None, 0, 1, 2, 3]),
    prompt=st.integers(1, 400),
    start=st.integers(0, 400),
    lengths=st.lists(st.integers(0, 400), min_size=2, max_size=2),
)
@settings(max_examples=150, deadline=None)
def test_mask_bits_depend_only_on_position(factory, retention_mult, prompt, start, lengths) -> None:  # type: ignore[no-untyped-def]
    kinds = factory()
    lcm = math.lcm(*(k.block_size for k in kinds))
    retention = None if retention_mult is None else retention_mult * lcm
    coord = MaskCoordinator(kinds, retention_interval=retention)
    short, long = sorted(lengths)
    for group, kind in enumerate(kinds):
        b = kind.block_size
        whole = expand(coord.store_mask(group, long, 0, prompt), ceil_div(long, b))
        assert whole == brute_store_mask(coord, group, long, 0, prompt)
        part = coord.store_mask(group, short, min(start, short), prompt)
        first = ceil_div(min(start, short), b)
        assert expand(part, ceil_div(short, b) - first) == whole[first : ceil_div(short, b)]


# ---- longest common hit -----------------------------------------------------------------------------


def present_fns(present: list[set[int]]) -> list:  # type: ignore[type-arg]
    return [have.__contains__ for have in present]


def test_longest_hit_full_attention() -> None:
    coord = MaskCoordinator([FullAttention(16)])
    assert coord.longest_hit(100, present_fns([set(range(10))])) == 96  # aligned down, bounded by max
    assert coord.longest_hit(160, present_fns([set(range(10))])) == 160
    assert coord.longest_hit(160, present_fns([{0, 1, 2, 4, 5}])) == 48  # stops at the first gap
    assert coord.longest_hit(160, present_fns([set()])) == 0


def test_longest_hit_full_plus_window() -> None:
    coord = MaskCoordinator([FullAttention(32), SlidingWindow(8, 8)])
    everything = [set(range(100)), set(range(100))]
    assert coord.longest_hit(128, present_fns(everything)) == 128
    # full chunks are 32 tokens, window tails are chunks 3, 7, 11, 15 (boundaries 32, 64, 96, 128)
    assert coord.longest_hit(128, present_fns([set(range(4)), {3, 7, 11}])) == 96
    assert coord.longest_hit(128, present_fns([{0, 1}, {3, 7, 11}])) == 64
    assert coord.longest_hit(128, present_fns([set(range(4)), {3, 11, 15}])) == 128
    assert coord.longest_hit(127, present_fns([set(range(4)), {3, 11, 15}])) == 96
    assert coord.longest_hit(128, present_fns([set(range(4)), {3, 15}])) == 128
    assert coord.longest_hit(120, present_fns([set(range(4)), {3, 15}])) == 32
    assert coord.longest_hit(120, present_fns([set(range(4)), {15}])) == 0


def test_longest_hit_iterates_to_a_fixed_point() -> None:
    # lcm 16; group 1 = window 17 at block 16 (a hit at L needs chunk L/16 - 1),
    # group 2 = window 33 at block 8 (a hit at L needs chunks L/8 - 4 .. L/8 - 1)
    coord = MaskCoordinator([FullAttention(16), SlidingWindow(16, 17), SlidingWindow(8, 33)])
    full = set(range(20))
    swa16 = {c for c in range(20) if c != 7}  # no tail for 128: group 1 lowers the hit to 112
    swa8 = {12, 13, 14, 15} | {6, 7, 8, 9}  # fine at 128, but 112 and 96 need chunks 10 and 11
    present = [full, swa16, swa8]
    first_round = min(kind.longest_hit(128, coord.lcm, fn) for kind, fn in zip(coord.kinds, present_fns(present)))
    assert first_round == 112  # one pass would answer 112, where group 2 lacks chunks 10 and 11
    got = coord.longest_hit(128, present_fns(present))
    assert got == brute_longest_hit(coord, 128, present) == 80


def test_longest_hit_state_space_and_chunked_local() -> None:
    coord = MaskCoordinator([FullAttention(16), StateSpace(32)])
    assert coord.longest_hit(160, present_fns([set(range(10)), {1, 3}])) == 128
    assert coord.longest_hit(160, present_fns([set(range(10)), {0}])) == 32
    local = MaskCoordinator([FullAttention(16), ChunkedLocal(16, 64)])
    # a hit exactly at a local-chunk edge needs no local chunk
    assert local.longest_hit(128, present_fns([set(range(8)), set()])) == 128
    assert local.longest_hit(112, present_fns([set(range(8)), {4, 5}])) == 96
    assert local.longest_hit(112, present_fns([set(range(8)), {5, 6}])) == 64


def test_longest_hit_checks_group_count() -> None:
    coord = MaskCoordinator([FullAttention(16), SlidingWindow(16, 32)])
    with pytest.raises(LayoutError, match="2 groups"):
        coord.longest_hit(64, present_fns([set()]))


HIT_FACTORIES = [
    lambda: [FullAttention(16)],
    lambda: [FullAttention(32), SlidingWindow(8, 8)],
    lambda: [FullAttention(16), SlidingWindow(16, 17), SlidingWindow(8, 33)],
    lambda: [FullAttention(16), ChunkedLocal(16, 64)],
    lambda: [FullAttention(16), StateSpace(32)],
    lambda: [SlidingWindow(8, 30), StateSpace(16)],
]


@given(
    factory=st.sampled_from(HIT_FACTORIES),
    max_tokens=st.integers(0, 200),
    data=st.data(),
)
@settings(max_examples=200, deadline=None)
def test_longest_hit_matches_brute_force(factory, max_tokens, data) -> None:  # type: ignore[no-untyped-def]
    coord = MaskCoordinator(factory())
    present = []
    for kind in coord.kinds:
        count = 200 // kind.block_size + 1
        density = data.draw(st.sampled_from([0.5, 0.8, 0.95, 1.0]))
        bits = data.draw(st.lists(st.floats(0, 1), min_size=count, max_size=count))
        present.append({c for c, x in enumerate(bits) if x < density})
    assert coord.longest_hit(max_tokens, present_fns(present)) == brute_longest_hit(coord, max_tokens, present)


# ---- bad configuration --------------------------------------------------------------------------


def test_bad_kinds_and_coordinators() -> None:
    with pytest.raises(LayoutError, match="block_size"):
        FullAttention(0)
    with pytest.raises(LayoutError, match="block_size"):
        FullAttention(16.0)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="window"):
        SlidingWindow(16, 0)
    with pytest.raises(LayoutError, match="attention_chunk_size"):
        ChunkedLocal(16, 24)
    with pytest.raises(LayoutError, match="at least one"):
        MaskCoordinator([])
    with pytest.raises(LayoutError, match="hash_block_size=16"):
        MaskCoordinator([FullAttention(32), SlidingWindow(24, 32)], hash_block_size=16)
    assert MaskCoordinator([FullAttention(32), SlidingWindow(24, 32)]).hash_block_size == 8


@pytest.mark.parametrize("retention", [16, 48, -32, 1.5, "64"])
def test_retention_interval_must_be_a_multiple_of_the_lcm(retention: object) -> None:
    with pytest.raises(ConfigError, match="retention_interval") as info:
        MaskCoordinator([FullAttention(32), SlidingWindow(8, 8)], retention_interval=retention)  # type: ignore[arg-type]
    assert info.value.key == "retention_interval"
    assert "32" in str(info.value)


def test_kind_equality_and_description() -> None:
    assert SlidingWindow(16, 64) == SlidingWindow(16, 64)
    assert SlidingWindow(16, 64) != SlidingWindow(16, 32)
    assert hash(SlidingWindow(16, 64)) == hash(SlidingWindow(16, 64))
    assert FullAttention(16) != StateSpace(16)
    assert SlidingWindow(16, 64).describe() == "sliding_window:64"
    assert ChunkedLocal(16, 64).describe() == "chunked_local:64"
