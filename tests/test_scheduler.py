"""SchedulerCore: lookups, per-step deltas, finish/preempt bookkeeping."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.backends.memory import MemoryBackend
from kvpool.core.errors import LayoutError
from kvpool.core.keys import KeySpace, LayoutFingerprint, chunk_hashes
from kvpool.core.masks import AttentionKind, FullAttention, MaskCoordinator, SlidingWindow
from kvpool.core.metadata import RequestDelta
from kvpool.scheduler.scheduler_core import SchedulerConfig, SchedulerCore


def hashes_for(tag: str, count: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest() for i in range(count)]


def space(kind: AttentionKind, group: int = 0, shard: int = 0) -> KeySpace:
    return KeySpace(LayoutFingerprint("m", "bf16", kind.block_size, "test", tp_shard=shard, group_id=group))


class Pool:
    """A memory pool plus helpers to store chunks of a group under given namespaces."""

    def __init__(self) -> None:
        self.backend = MemoryBackend(16 << 20)
        self.calls = 0

    def exists(self, keys: list[str]) -> list[bool]:
        self.calls += 1
        return self.backend.exists(keys)

    def store(self, spaces: Sequence[KeySpace], hashes: Sequence[bytes], chunks: range | list[int]) -> None:
        for space_ in spaces:
            keys = [space_.key(hashes[c]) for c in chunks]
            self.backend.put(keys, [[b"x"]] * len(keys))


def full_scheduler(pool: Pool, config: SchedulerConfig | None = None, block: int = 16) -> SchedulerCore:
    kind = FullAttention(block)
    return SchedulerCore(MaskCoordinator([kind]), [[space(kind)]], pool.exists, config)


# ---- lookup -------------------------------------------------------------------------------------------


def test_lookup_is_strictly_below_the_prompt() -> None:
    pool = Pool()
    sched = full_scheduler(pool)
    hashes = hashes_for("p", 8)
    pool.store(sched.namespaces[0], hashes, range(8))
    assert sched.lookup("a", hashes, 129) == 128
    assert sched.lookup("b", hashes, 128) == 112  # a full-prompt hit is lowered: one token is recomputed
    assert sched.lookup("c", hashes, 113) == 112
    assert sched.lookup("d", hashes, 112) == 96
    assert sched.lookup("e", hashes, 16) == 0
    assert sched.lookup("f", hashes[:3], 500) == 48  # no hashes, no hit
    assert sched.stats.lookup_hit_tokens == 128 + 112 + 112 + 96 + 48


def test_lookup_is_aligned_to_the_lcm() -> None:
    pool = Pool()
    kinds = [FullAttention(16), SlidingWindow(32, 100)]  # lcm 32, hash block 16
    coord = MaskCoordinator(kinds)
    namespaces = [[space(kinds[0], 0)], [space(kinds[1], 1)]]
    sched = SchedulerCore(coord, namespaces, pool.exists)
    hashes = hashes_for("p", 16)
    pool.store(namespaces[0], hashes, range(7))  # full attention up to 112 tokens
    pool.store(namespaces[1], chunk_hashes(hashes, 16, 32), range(8))
    assert sched.lookup("a", hashes, 257) == 96


def test_lookup_needs_every_namespace() -> None:
    pool = Pool()
    kind = FullAttention(16)
    shards = [space(kind, shard=0), space(kind, shard=1)]
    sched = SchedulerCore(MaskCoordinator([kind]), [shards], pool.exists)
    hashes = hashes_for("p", 8)
    pool.store(shards, hashes, range(8))
    assert sched.lookup("a", hashes, 200) == 128
    pool.backend.remove([shards[1].key(hashes[5])])
    assert sched.lookup("b", hashes, 200) == 80
    assert sched.stats.lookup_keys == 2 * 16


def test_lookup_hybrid_window_needs_its_tail() -> None:
    pool = Pool()
    kinds = [FullAttention(32), SlidingWindow(8, 8)]
    namespaces = [[space(kinds[0], 0)], [space(kinds[1], 1)]]
    sched = SchedulerCore(MaskCoordinator(kinds), namespaces, pool.exists)
    hashes = hashes_for("p", 16)  # hash block 8 → 128 tokens
    pool.store(namespaces[0], chunk_hashes(hashes, 8, 32), range(4))
    pool.store(namespaces[1], hashes, [3, 7, 11])  # tails before 32, 64, 96 — not before 128
    assert sched.lookup("a", hashes, 200) == 96
    # only the reachable window chunks are asked for: 4 full + 4 window keys
    assert sched.stats.lookup_keys == 8


def test_lookup_result_is_cached_per_request() -> None:
    pool = Pool()
    sched = full_scheduler(pool, SchedulerConfig(lookup_cache_s=60))
    hashes = hashes_for("p", 8)
    pool.store(sched.namespaces[0], hashes, range(4))
    assert sched.lookup("a", hashes, 200) == 64
    pool.store(sched.namespaces[0], hashes, range(8))
    assert sched.lookup("a", hashes, 200) == 64  # cached
    assert pool.calls == 1
    assert sched.lookup("a", [*hashes, b"more"], 200) == 128  # new hashes: asked again
    assert pool.calls == 2


def test_async_lookup_answers_none_then_the_hit() -> None:
    pool = Pool()
    gate = threading.Event()
    entered = threading.Event()

    def slow_exists(keys: list[str]) -> list[bool]:
        entered.set()
        assert gate.wait(5)
        return pool.backend.exists(keys)

    kind = FullAttention(16)
    sched = SchedulerCore(MaskCoordinator([kind]), [[space(kind)]], slow_exists, SchedulerConfig(lookup_async=True))
    try:
        hashes = hashes_for("p", 8)
        pool.store(sched.namespaces[0], hashes, range(6))
        assert sched.lookup("a", hashes, 200) is None
        assert entered.wait(5)
        assert sched.lookup("a", hashes, 200) is None  # still running
        gate.set()
        deadline = time.monotonic() + 5
        answer = None
        while answer is None and time.monotonic() < deadline:
            answer = sched.lookup("a", hashes, 200)
            time.sleep(0.005)
        assert answer == 96
        assert sched.lookup("a", hashes, 200) == 96
    finally:
        gate.set()
        sched.close()


def test_an_async_lookup_a_healthy_pool_answers_within_the_wait_is_answered_in_the_same_call() -> None:
    """A lookup that leaves the process runs on a thread; the call that starts it waits `lookup_wait_s`
    for it, so a healthy pool's request is admitted in that scheduler step, not the next."""
    pool = Pool()
    kind = FullAttention(16)
    config = SchedulerConfig(lookup_async=True, lookup_wait_s=1.0)
    sched = SchedulerCore(MaskCoordinator([kind]), [[space(kind)]], pool.exists, config)
    try:
        hashes = hashes_for("p", 8)
        pool.store(sched.namespaces[0], hashes, range(6))
        assert sched.lookup("a", hashes, 200) == 96
        assert sched.lookup("b", hashes_for("q", 8), 200) == 0
    finally:
        sched.close()


def test_a_stuck_lookup_costs_the_call_at_most_its_wait() -> None:
    gate = threading.Event()

    def stuck(keys: list[str]) -> list[bool]:
        gate.wait(5)
        return [True] * len(keys)

    kind = FullAttention(16)
    config = SchedulerConfig(lookup_async=True, lookup_wait_s=0.02, lookup_timeout_s=0.05)
    sched = SchedulerCore(MaskCoordinator([kind]), [[space(kind)]], stuck, config)
    try:
        began = time.monotonic()
        assert sched.lookup("a", hashes_for("p", 4), 100) is None
        assert time.monotonic() - began < 1.0  # the wait, not the stuck call
        time.sleep(0.1)
        assert sched.lookup("a", hashes_for("p", 4), 100) == 0  # past the deadline: a miss
    finally:
        gate.set()
        sched.close()


def test_async_lookup_timeout_is_a_miss() -> None:
    gate = threading.Event()

    def stuck(keys: list[str]) -> list[bool]:
        gate.wait(5)
        return [True] * len(keys)

    kind = FullAttention(16)
    sched = SchedulerCore(
        MaskCoordinator([kind]), [[space(kind)]], stuck, SchedulerConfig(lookup_async=True, lookup_timeout_s=0.05)
    )
    try:
        hashes = hashes_for("p", 4)
        assert sched.lookup("a", hashes, 100) is None
        time.sleep(0.1)
        assert sched.lookup("a", hashes, 100) == 0
        assert sched.stats.lookup_failures == 1
    finally:
        gate.set()
        sched.close()


@pytest.mark.parametrize("lookup_async", [False, True])
def test_backend_exception_is_a_miss(lookup_async: bool) -> None:
    def broken(keys: list[str]) -> list[bool]:
        raise ConnectionError("pool down")

    kind = FullAttention(16)
    sched = SchedulerCore(
        MaskCoordinator([kind]), [[space(kind)]], broken, SchedulerConfig(lookup_async=lookup_async)
    )
    try:
        hashes = hashes_for("p", 4)
        answer = sched.lookup("a", hashes, 100)
        deadline = time.monotonic() + 5
        while answer is None and time.monotonic() < deadline:
            time.sleep(0.005)
            answer = sched.lookup("a", hashes, 100)
        assert answer == 0
        assert sched.stats.lookup_failures == 1
    finally:
        sched.close()


# ---- per-step deltas --------------------------------------------------------------------------------


class WorkerMirror:
    """What a worker rebuilds from the deltas."""

    def __init__(self) -> None:
        self.hashes: list[bytes] = []
        self.tables: list[list[int]] | None = None
        self.prompt = 0

    def apply(self, delta: RequestDelta) -> None:
        if delta.num_prompt_tokens:
            self.prompt = delta.num_prompt_tokens
            self.hashes = []
        self.hashes.extend(delta.new_hashes)
        if delta.new_blocks is not None:
            if delta.replace_blocks or self.tables is None:
                self.tables = [list(t) for t in delta.new_blocks]
            else:
                for table, new in zip(self.tables, delta.new_blocks):
                    table.extend(new)


@pytest.mark.parametrize("save_decode", [True, False])
def test_deltas_carry_only_what_changed(save_decode: bool) -> None:
    pool = Pool()
    sched = full_scheduler(pool, SchedulerConfig(save_decode=save_decode))
    prompt, budget, block = 300, 64, 16
    all_hashes = hashes_for("p", 100)
    known, computed = prompt, 0
    table: list[int] = []
    mirror = WorkerMirror()
    sent_hashes = sent_blocks = deltas = 0
    last_save = 0
    for step in range(100):
        new = min(budget, known - computed)
        appended = len(table)
        while len(table) * block < computed + new:
            table.append(len(table) + 1)
        block_hashes = all_hashes[: known // block]
        delta = sched.request_delta(
            "r",
            num_prompt_tokens=prompt,
            block_hashes=block_hashes,
            computed_before=computed,
            new_tokens=new,
            new_blocks=[table[appended:]],  # what vLLM's scheduler output carries: the blocks appended
            whole_table=step == 0,
        )
        if delta is not None:
            deltas += 1
            mirror.apply(delta)
            sent_hashes += len(delta.new_hashes)
            if delta.new_blocks is not None:
                sent_blocks += len(delta.new_blocks[0])
                assert not delta.replace_blocks or deltas == 1
            if delta.save_tokens:
                assert delta.save_tokens > last_save and delta.save_tokens % block == 0
                assert delta.save_tokens <= computed + new
                last_save = delta.save_tokens
            assert mirror.hashes == all_hashes[: len(mirror.hashes)]
            assert len(mirror.hashes) * block >= last_save
        assert mirror.tables == [table]
        computed += new
        if computed >= known:
            known += 1  # a token is sampled
    assert computed == 395
    want_save = 384 if save_decode else 288
    assert last_save == want_save
    assert sent_hashes == want_save // block  # each hash sent once, only when needed
    assert sent_blocks == len(table) == 25  # each block id sent once
    assert deltas <= 100


@settings(max_examples=150, deadline=None)
@given(
    save_decode=st.booleans(),
    prompt=st.integers(1, 200),
    hit_chunks=st.integers(0, 4),
    steps=st.lists(st.integers(1, 40), min_size=1, max_size=40),
)
def test_a_quiet_request_never_had_a_delta_to_send(
    save_decode: bool, prompt: int, hit_chunks: int, steps: list[int]
) -> None:
    """`quiet` lets the adapter skip a running request without building its delta: whenever it says so
    (and no block was appended), `request_delta` has nothing to send."""
    block = 16
    pool = Pool()
    sched = full_scheduler(pool, SchedulerConfig(save_decode=save_decode), block=block)
    all_hashes = hashes_for("q", 40)
    hit = min(hit_chunks * block, (prompt - 1) // block * block)
    pool.store(sched.namespaces[0], all_hashes, range(hit // block))
    assert sched.lookup("r", all_hashes[: prompt // block], prompt) == hit
    sched.on_allocated("r", prompt, 0, hit)
    computed, known, table = hit, prompt, list(range(1, -(-prompt // block) + 1))
    first = True
    for new in steps:
        new = min(new, known - computed) or 1
        appended = len(table)
        while len(table) * block < computed + new:
            table.append(len(table) + 1)
        blocks = table[appended:]
        quiet = not first and not blocks and sched.quiet("r", computed + new)
        delta = sched.request_delta(
            "r",
            num_prompt_tokens=prompt,
            block_hashes=all_hashes[: max(known, computed + new) // block],
            computed_before=computed,
            new_tokens=new,
            new_blocks=[table] if first else [blocks],
            whole_table=first,
        )
        if quiet:
            assert delta is None
        first = False
        computed += new
        known = max(known, computed + 1)


def test_no_change_no_delta() -> None:
    sched = full_scheduler(Pool())
    args = {"num_prompt_tokens": 40, "block_hashes": hashes_for("p", 2)}
    first = sched.request_delta("r", computed_before=0, new_tokens=40, new_blocks=[[1, 2, 3]], whole_table=True, **args)
    assert first is not None and first.save_tokens == 32 and first.num_prompt_tokens == 40
    assert sched.request_delta("r", computed_before=40, new_tokens=1, **args) is None
    assert sched.request_delta("r", computed_before=41, new_tokens=1, new_blocks=[[]], **args) is None


def test_the_first_step_must_carry_the_whole_table() -> None:
    sched = full_scheduler(Pool())
    with pytest.raises(ValueError, match=r"'r'.*whole block table"):
        sched.request_delta(
            "r", num_prompt_tokens=40, block_hashes=[], computed_before=0, new_tokens=8, new_blocks=[[1]]
        )
    assert not sched.started("r")


def test_chunked_prefill_saves_the_last_full_prompt_block() -> None:
    sched = full_scheduler(Pool(), block=32)
    hashes = hashes_for("p", 3)
    saves = []
    computed = 0
    table: list[int] = []
    while computed < 96:
        new = min(20, 96 - computed)
        appended = len(table)
        table = list(range(1, -(-(computed + new) // 32) + 1))
        delta = sched.request_delta(
            "r",
            num_prompt_tokens=96,
            block_hashes=hashes,
            computed_before=computed,
            new_tokens=new,
            new_blocks=[table[appended:]],
            whole_table=computed == 0,
        )
        saves.append(delta.save_tokens if delta else 0)
        computed += new
    assert saves == [0, 32, 0, 64, 96]
    # decode steps after the prompt save nothing more (save_decode off)
    grown = sched.request_delta(
        "r", num_prompt_tokens=96, block_hashes=hashes, computed_before=96, new_tokens=1, new_blocks=[[4]]
    )
    assert grown is not None and grown.new_blocks == ([4],)  # the new block id is sent
    assert (
        sched.request_delta("r", num_prompt_tokens=96, block_hashes=hashes, computed_before=97, new_tokens=1) is None
    )


def test_resumed_request_replaces_the_table() -> None:
    sched = full_scheduler(Pool())
    hashes = hashes_for("p", 4)
    common = {"num_prompt_tokens": 64, "block_hashes": hashes}
    first = sched.request_delta("r", new_blocks=[[1, 2]], whole_table=True, computed_before=0, new_tokens=32, **common)
    assert first is not None and first.replace_blocks and first.new_blocks == ([1, 2],)
    grown = sched.request_delta("r", new_blocks=[[3]], computed_before=32, new_tokens=16, **common)
    assert grown is not None and not grown.replace_blocks and grown.new_blocks == ([3],)
    resumed = sched.request_delta(
        "r", new_blocks=[[7, 8, 9]], whole_table=True, computed_before=48, new_tokens=16, **common
    )
    assert resumed is not None and resumed.replace_blocks and resumed.new_blocks == ([7, 8, 9],)
    assert resumed.new_hashes == [hashes[3]]  # hashes are not resent
    # after a preemption the tracker starts over: the worker dropped its state too
    sched.preempt("r")
    again = sched.request_delta("r", new_blocks=[[4, 5]], whole_table=True, computed_before=0, new_tokens=32, **common)
    assert again is not None and again.replace_blocks and again.num_prompt_tokens == 64
    assert again.new_hashes == hashes[:2] and again.save_tokens == 32


def test_first_delta_carries_the_hit_and_the_load() -> None:
    pool = Pool()
    sched = full_scheduler(pool)
    hashes = hashes_for("p", 8)
    pool.store(sched.namespaces[0], hashes, range(5))
    assert sched.lookup("r", hashes, 130) == 80
    sched.on_allocated("r", 130, local_tokens=32, external_tokens=48)
    delta = sched.request_delta(
        "r",
        num_prompt_tokens=130,
        block_hashes=hashes,
        computed_before=80,
        new_tokens=50,
        new_blocks=[list(range(1, 10))],
        whole_table=True,
    )
    assert delta is not None and delta.load is not None
    assert (delta.load.start_tokens, delta.load.hit_tokens) == (32, 80)
    assert delta.stored_tokens == 80
    assert delta.save_tokens == 128
    assert delta.new_hashes == hashes[:8]
    assert sched.stats.loads == 1 and sched.stats.load_tokens == 48
    later = sched.request_delta(
        "r",
        num_prompt_tokens=130,
        block_hashes=hashes,
        computed_before=130,
        new_tokens=1,
    )
    assert later is None  # the load is sent once


def test_a_failed_load_is_saved_again_once_recomputed() -> None:
    """The first delta says the pool holds the lookup hit; if that load fails, the chunks are not in the
    pool after all, so the request's saves must cover them again (the worker skips what did arrive)."""
    pool = Pool()
    sched = full_scheduler(pool)
    hashes = hashes_for("p", 8)
    pool.store(sched.namespaces[0], hashes, range(6))
    assert sched.lookup("r", hashes, 129) == 96
    sched.on_allocated("r", 129, 0, 96)
    table = [list(range(1, 10))]
    first = sched.request_delta(
        "r",
        num_prompt_tokens=129,
        block_hashes=hashes,
        computed_before=0,
        new_tokens=0,
        new_blocks=table,
        whole_table=True,
    )
    assert first is not None and first.stored_tokens == 96 and first.load is not None
    sched.mark_load_failed("r")
    assert sched.lookup("r", hashes, 129) == 0  # never offered the failed hit again
    # vLLM recomputes: the step that computes up to 128 saves from the start, not from the failed hit
    delta = sched.request_delta("r", num_prompt_tokens=129, block_hashes=hashes, computed_before=0, new_tokens=128)
    assert delta is not None and delta.save_tokens == 128


def test_reset_drops_cached_lookups_and_advances_the_epoch() -> None:
    pool = Pool()
    sched = full_scheduler(pool)
    hashes = hashes_for("p", 4)
    pool.store(sched.namespaces[0], hashes, range(4))
    assert sched.lookup("r", hashes, 65) == 64
    pool.backend.clear()
    sched.reset()
    assert sched.reset_epoch == 1
    assert sched.lookup("r", hashes, 65) == 0  # not the cached answer from before the reset


def test_finish_forgets_the_request() -> None:
    sched = full_scheduler(Pool())
    hashes = hashes_for("p", 4)
    sched.request_delta(
        "long",
        num_prompt_tokens=64,
        block_hashes=hashes,
        computed_before=0,
        new_tokens=64,
        new_blocks=[[2, 3, 4, 5]],
        whole_table=True,
    )
    sched.finish("long")
    sched.finish("unknown")
    assert sched.active_requests() == 0


def test_no_state_left_after_finish_or_preempt() -> None:
    pool = Pool()
    sched = full_scheduler(pool)
    hashes = hashes_for("p", 4)
    for i in range(10):
        req = f"r{i}"
        sched.lookup(req, hashes, 64)
        sched.on_allocated(req, 64, 0, 0)
        sched.request_delta(
            req,
            num_prompt_tokens=64,
            block_hashes=hashes,
            computed_before=0,
            new_tokens=64,
            new_blocks=[[1, 2, 3, 4]],
            whole_table=True,
        )
    assert sched.active_requests() == 20
    for i in range(10):
        (sched.finish if i % 2 else sched.preempt)(f"r{i}")
    assert sched.active_requests() == 0
    assert sched.stats.preemptions == 5


def test_namespaces_must_match_the_groups() -> None:
    kinds = [FullAttention(16), SlidingWindow(16, 32)]
    coord = MaskCoordinator(kinds)
    with pytest.raises(LayoutError, match="2 groups"):
        SchedulerCore(coord, [[space(kinds[0])]], Pool().exists)
    with pytest.raises(LayoutError, match="at least one key space"):
        SchedulerCore(coord, [[space(kinds[0])], []], Pool().exists)
