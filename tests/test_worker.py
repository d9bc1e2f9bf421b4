"""WorkerCore saves: incremental == one-shot, blocks read only inside the step, pressure, retries,
lifecycle, resets."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.backends.base import Status
from kvpool.backends.memory import MemoryBackend
from kvpool.core.errors import LayoutError
from kvpool.core.masks import AttentionKind, ChunkedLocal, FullAttention, SlidingWindow, StateSpace
from kvpool.core.metadata import RequestDelta, StepMetadata
from kvpool.core.plan import GroupPlacement
from kvpool.worker.layout import KVLayout
from kvpool.worker.save_put import FULL_RETRY_S
from kvpool.worker.worker_core import WorkerConfig, WorkerCore
from worker_fakes import (
    BLOCK_BYTES,
    LAYERS,
    FakeModel,
    RecordingBackend,
    add_request,
    simple,
    start,
)

# ---- incremental == one-shot --------------------------------------------------------------------


@st.composite
def models(draw: st.DrawFn) -> tuple[list[AttentionKind], int | None]:
    groups = draw(st.integers(1, 3))
    kinds: list[AttentionKind] = []
    for g in range(groups):
        name = draw(st.sampled_from(["full", "swa", "swa", "local", "state"]))
        block = draw(st.sampled_from([4, 8, 16]))
        if name == "full" or (g == 0 and draw(st.booleans())):
            kinds.append(FullAttention(block))
        elif name == "swa":
            kinds.append(SlidingWindow(block, draw(st.integers(1, 40))))
        elif name == "local":
            kinds.append(ChunkedLocal(block, block * draw(st.integers(1, 4))))
        else:
            kinds.append(StateSpace(block))
    lcm = math.lcm(*(k.block_size for k in kinds))
    mult = draw(st.sampled_from([None, None, 0, 1, 2, 3]))
    return kinds, None if mult is None else mult * lcm


def expected_one_shot(
    model: FakeModel, hashes: list[bytes], tokens: int, prompt: int, put_step: int, rank: int
) -> set[str]:
    """The keys one save of `tokens` must store, straight from the masks. A state group's chunks are
    never saved from its block table (only from the blocks the engine hands over: test_states.py)."""
    end = model.coord.align(tokens)
    keys = set()
    for group, kind in enumerate(model.kinds):
        if isinstance(kind, StateSpace):
            continue
        mask = model.coord.store_mask(group, end, 0, prompt)
        for chunk in range(end // kind.block_size):
            if (mask is None or mask[chunk]) and chunk % put_step == (rank + group) % put_step:
                keys.add(model.key(group, hashes, chunk))
    return keys


def drive(
    engine: WorkerCore,
    model: FakeModel,
    req: str,
    hashes: list[bytes],
    tables: tuple,
    prompt: int,  # type: ignore[type-arg]
    lengths: list[int],
    drains: list[bool],
) -> None:
    """Grow a request through `lengths`, delivering hashes and blocks as they appear, like the scheduler."""
    sent_hashes, sent_blocks, previous = 0, [0] * len(tables), 0
    for i, (length, drain) in enumerate(zip(lengths, drains)):
        new_hashes = hashes[sent_hashes : length // model.h]
        want = [min(len(t), -(-length // k.block_size)) for t, k in zip(tables, model.kinds)]
        new_blocks = tuple(list(t[s:w]) for t, s, w in zip(tables, sent_blocks, want))
        engine.apply(
            [
                RequestDelta(
                    req,
                    new_hashes=new_hashes,
                    new_blocks=new_blocks,
                    num_prompt_tokens=prompt if i == 0 else 0,
                    computed_before=previous,
                )
            ]
        )
        sent_hashes += len(new_hashes)
        sent_blocks = [max(s, w) for s, w in zip(sent_blocks, want)]
        engine.save_request(req, length, computed_before=previous)
        previous = max(previous, length)
        if drain:
            assert engine.drain(10)
    assert engine.drain(10)


@given(
    model_spec=models(),
    data=st.data(),
    put_step=st.integers(1, 3),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_incremental_saves_store_what_one_save_stores(model_spec, data, put_step) -> None:  # type: ignore[no-untyped-def]
    kinds, retention = model_spec
    model = FakeModel(kinds, retention)
    lcm = model.coord.lcm
    final = data.draw(st.integers(0, 12 * lcm), label="final")
    prompt = data.draw(st.integers(1, max(1, final)), label="prompt")
    steps = data.draw(st.lists(st.integers(0, final), max_size=8), label="steps")
    lengths = [*sorted(steps), final]
    drains = data.draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)), label="drains")
    rank = data.draw(st.integers(0, put_step - 1), label="rank")
    linger = data.draw(st.sampled_from([0, 0, 3]), label="linger steps")  # the sender puts several saves as one
    hashes = model.hashes("p", final)
    tables = model.tables(final)
    expected_bytes = model.fill("p", tables, hashes)

    incremental, one_shot = RecordingBackend(), RecordingBackend()
    a = model.engine(incremental, put_step, rank, WorkerConfig(save_linger_steps=linger, save_linger_s=10.0))
    b = model.engine(one_shot, put_step, rank)
    try:
        drive(a, model, "r", hashes, tables, prompt, lengths, drains)
        drive(b, model, "r", hashes, tables, prompt, [final], [True])
        assert a.stored_tokens("r") == b.stored_tokens("r") == model.coord.align(final)
    finally:
        a.close()
        b.close()
    want = expected_one_shot(model, hashes, final, prompt, put_step, rank)
    assert set(one_shot.put_keys) == want
    assert set(incremental.put_keys) == want
    # every chunk key was examined exactly once, however the saves were split
    examined = Counter(incremental.exists_keys)
    assert set(examined) == set(one_shot.exists_keys) == want
    assert max(examined.values(), default=1) == 1
    assert a.stats.chunks_examined == len(want)
    for key in want:
        assert incremental.stored(key, LAYERS * BLOCK_BYTES) == expected_bytes[key]


@given(model_spec=models(), data=st.data())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_two_ranks_cover_the_one_shot_set_once(model_spec, data) -> None:  # type: ignore[no-untyped-def]
    kinds, retention = model_spec
    model = FakeModel(kinds, retention)
    final = data.draw(st.integers(0, 12 * model.coord.lcm), label="final")
    prompt = data.draw(st.integers(1, max(1, final)), label="prompt")
    lengths = [*sorted(data.draw(st.lists(st.integers(0, final), max_size=6), label="steps")), final]
    hashes = model.hashes("p", final)
    tables = model.tables(final)
    model.fill("p", tables, hashes)
    shared = RecordingBackend()
    ranks = [model.engine(shared, 2, rank) for rank in (0, 1)]
    try:
        for engine in ranks:
            drive(engine, model, "r", hashes, tables, prompt, lengths, [False] * len(lengths))
    finally:
        for engine in ranks:
            engine.close()
    written = Counter(shared.put_keys)
    assert set(written) == expected_one_shot(model, hashes, final, prompt, 1, 0)
    assert max(written.values(), default=1) == 1


def test_incremental_save_examines_only_new_chunks(closing: list[WorkerCore]) -> None:
    model, backend, engine = simple(closing)
    hashes, _, _ = add_request(model, engine, "r", 256)
    for length in range(16, 257, 16):
        before = len(backend.exists_keys)
        engine.save_request("r", length)
        assert engine.drain(5)
        assert backend.exists_keys[before:] == [model.key(0, hashes, length // 16 - 1)]
    engine.save_request("r", 256)  # nothing new: nothing examined, no job
    assert engine.drain(5)
    assert len(backend.exists_keys) == 16 and engine.stats.save_jobs == 16
    assert engine.stored_tokens("r") == 256


def test_save_skips_null_and_freed_blocks(closing: list[WorkerCore]) -> None:
    model, backend, engine = simple(closing, kinds=[FullAttention(16), SlidingWindow(16, 17)])
    hashes = model.hashes("r", 128)
    tables = model.tables(128)
    tables[1][0] = 0  # the engine's null block
    model.fill("r", tables, hashes)
    start(engine, "r", hashes, tables)
    engine.save_request("r", 128, computed_before=100)  # window blocks below (100 - 16) // 16 = 5 are freed
    assert engine.drain(5)
    swa = {k for k in backend.put_keys if k.startswith(model.spaces[1].prefix)}
    assert swa == {model.key(1, hashes, c) for c in range(5, 8)}
    assert engine.stats.chunks_unreadable == 5
    assert len(backend.put_keys) == 8 + 3


# ---- pressure gate and retries ------------------------------------------------------------------


def test_small_saves_of_several_steps_go_out_in_one_put(closing: list[WorkerCore]) -> None:
    model, backend, engine = simple(closing, config=WorkerConfig(save_linger_steps=8, save_linger_s=10.0))
    _, _, expected = add_request(model, engine, "a", 96)
    _, _, expected_b = add_request(model, engine, "b", 32)
    engine.save_request("a", 32)
    engine.save_request("b", 32)
    engine.save_request("a", 96)
    time.sleep(0.05)
    assert backend.put_calls == 0  # held: three steps of one or four chunks are not worth a call each
    assert engine.stored_tokens("a") == 0
    assert engine.drain(5)  # a drain sends what is held
    assert backend.put_calls == 1
    assert engine.stored_tokens("a") == 96 and engine.stored_tokens("b") == 32
    for key, value in {**expected, **expected_b}.items():
        assert backend.stored(key, len(value)) == value  # each chunk's own bytes, whatever it was merged with


@pytest.mark.parametrize("sync", [True, False])
def test_a_step_whose_chunks_are_all_another_ranks_makes_no_put_and_still_moves_the_mark(
    closing: list[WorkerCore], sync: bool
) -> None:
    """Striped puts (TP 2, rank 0 of the shard): chunk 1 is rank 1's, so the step that completes it
    plans a range of no chunk here: no put call, and the request's mark still passes it."""
    model = FakeModel([FullAttention(16)])
    backend = RecordingBackend()
    engine = model.engine(backend, put_step=2, rank=0, config=WorkerConfig(sync_saves=sync))
    closing.append(engine)
    hashes, _, expected = add_request(model, engine, "a", 48)
    engine.save_request("a", 16)  # chunk 0: this rank's
    assert engine.drain(5) and backend.put_calls == 1
    engine.save_request("a", 32)  # chunk 1: rank 1's
    assert engine.drain(5) and backend.put_calls == 1
    assert engine.stored_tokens("a") == 32
    engine.save_request("a", 48)  # chunk 2: this rank's again
    assert engine.drain(5) and backend.put_calls == 2
    assert engine.stored_tokens("a") == 48
    assert backend.put_keys == [model.key(0, hashes, 0), model.key(0, hashes, 2)]
    for key in backend.put_keys:
        assert backend.stored(key, len(expected[key])) == expected[key]


def test_a_hybrid_models_groups_go_out_in_one_put_per_call_not_one_per_group(closing: list[WorkerCore]) -> None:
    """vLLM gives a hybrid model's groups one page size: their captured chunks share one array, so a
    remote pool (whose cost is per call) takes a step's chunks, or several steps' merged, in one put."""
    kinds = [FullAttention(16), SlidingWindow(16, 1000)]
    model, backend, engine = simple(closing, config=WorkerConfig(save_linger_steps=8, save_linger_s=10.0), kinds=kinds)
    _, _, expected = add_request(model, engine, "a", 64)
    _, _, expected_b = add_request(model, engine, "b", 32)
    engine.save_request("a", 64)
    assert engine.drain(5)
    assert backend.put_calls == 1 and len(backend.put_keys) == 8  # 4 chunks of each group
    engine.save_request("b", 16)
    engine.save_request("b", 32)
    assert engine.drain(5)
    assert backend.put_calls == 2 and len(backend.put_keys) == 12  # two steps of both groups, merged
    assert engine.stored_tokens("a") == 64 and engine.stored_tokens("b") == 32
    for key, value in {**expected, **expected_b}.items():
        assert backend.stored(key, len(value)) == value  # each chunk's own bytes, whatever group it shared with


def test_held_saves_go_after_the_linger_steps_or_time(closing: list[WorkerCore]) -> None:
    model, backend, engine = simple(closing, config=WorkerConfig(save_linger_steps=2, save_linger_s=10.0))
    add_request(model, engine, "a", 64)
    engine.save_request("a", 32)
    engine.save([])  # an engine step with nothing to save
    engine.save([])
    deadline = time.monotonic() + 5
    while backend.put_calls == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert backend.put_calls == 1  # two steps later, without a drain
    other, timed, idle = simple(closing, config=WorkerConfig(save_linger_steps=1000, save_linger_s=0.05))
    add_request(other, idle, "a", 64)
    began = time.monotonic()
    idle.save_request("a", 64)  # then the engine stops stepping: the last chunks still go out
    while timed.put_calls == 0 and time.monotonic() - began < 5:
        time.sleep(0.005)
    assert timed.put_calls == 1 and time.monotonic() - began >= 0.05


def test_held_saves_from_before_a_reset_are_never_stored(closing: list[WorkerCore]) -> None:
    model, backend, engine = simple(closing, config=WorkerConfig(save_linger_steps=8, save_linger_s=10.0))
    add_request(model, engine, "a", 64)
    engine.save_request("a", 32)  # held by the sender
    engine.handle_step(StepMetadata(reset_epoch=1))
    add_request(model, engine, "b", 32)
    engine.save_request("b", 32)  # after the reset: kept
    assert engine.drain(5)
    assert backend.put_calls == 1
    assert sorted(backend.inner.keys()) == sorted(model.key(0, model.hashes("b", 32), c) for c in range(2))
    assert engine.stored_tokens("b") == 32


def test_chunks_a_full_pool_refused_are_put_again_once_it_had_time_to_evict(closing: list[WorkerCore]) -> None:
    """Mooncake refuses a put into a full pool at once and evicts a moment later: the newest chunks of a
    request that is already finished (no later save would retry them) still land."""
    model, backend, engine = simple(closing)
    _, _, expected = add_request(model, engine, "r", 64)
    backend.put_statuses = [Status.FULL, Status.FULL]
    engine.save_request("r", 64)
    engine.finish(["r"])
    assert engine.drain(5)
    assert backend.put_calls == 3 and engine.stats.full_retries == 2
    assert engine.stats.chunks_put_failed == engine.stats.pressure_events == 0
    assert not engine.under_pressure
    for key, value in expected.items():
        assert backend.stored(key, len(value)) == value


def test_a_pool_full_through_every_retry_engages_the_gate_and_what_is_queued_behind_is_still_put(
    closing: list[WorkerCore],
) -> None:
    """The batches queued behind hold the newest chunks, which a pool evicting oldest first has room for
    first: none is dropped; the first that lands whole ends the pressure."""
    model, backend, engine = simple(closing)
    add_request(model, engine, "a", 64)
    _, _, expected_b = add_request(model, engine, "b", 32)
    backend.gate = threading.Event()
    backend.put_statuses = [Status.FULL] * (1 + len(FULL_RETRY_S))
    engine.save_request("a", 64)
    assert backend.put_entered.wait(5)  # a is inside its put
    engine.save_request("b", 32)
    backend.gate.set()
    assert engine.drain(5)
    assert engine.stats.full_retries == len(FULL_RETRY_S) and engine.stats.pressure_events == 1
    assert engine.stats.save_jobs_dropped == 0 and engine.stats.chunks_put_failed == 4
    assert engine.stored_tokens("a") == 0 and engine.stored_tokens("b") == 32
    assert not engine.under_pressure  # b landed whole: the pressure is over
    for key, value in expected_b.items():
        assert backend.stored(key, len(value)) == value
    engine.save_request("a", 64)  # a's range was re-planned from what is stored: retried
    assert engine.drain(5)
    assert engine.stored_tokens("a") == 64


def test_a_part_full_through_the_pauses_leaves_the_later_parts_of_the_call_tried(closing: list[WorkerCore]) -> None:
    """One call puts several requests' chunks in parts; a part the pool still refuses does not cost the
    parts after it (newer chunks, other requests, maybe finished), and each is counted once."""
    model, backend, engine = simple(closing, config=WorkerConfig(put_batch_chunks=4))
    add_request(model, engine, "a", 64)
    _, _, expected_b = add_request(model, engine, "b", 64)
    backend.put_statuses = [Status.FULL] * (1 + len(FULL_RETRY_S))
    engine.save([RequestDelta("a", save_tokens=64), RequestDelta("b", save_tokens=64)])
    assert engine.drain(5)
    assert engine.stats.full_retries == len(FULL_RETRY_S) and engine.stats.chunks_put_failed == 4
    assert engine.stored_tokens("a") == 0 and engine.stored_tokens("b") == 64
    assert engine.under_pressure and engine.stats.pressure_events == 1  # the call was refused chunks
    for key, value in expected_b.items():
        assert backend.stored(key, len(value)) == value


def test_a_call_of_many_parts_pauses_for_a_full_pool_no_longer_than_one_part_would(closing: list[WorkerCore]) -> None:
    """The pauses are one budget per call: a merged backlog never waits them once per part."""
    model, backend, engine = simple(closing, config=WorkerConfig(put_batch_chunks=4))
    add_request(model, engine, "r", 256)  # 16 chunks: four parts
    backend.put_statuses = [Status.FULL, None] * len(FULL_RETRY_S) + [Status.FULL]  # each part refused once
    began = time.monotonic()
    engine.save_request("r", 256)
    assert engine.drain(5)
    assert engine.stats.full_retries == len(FULL_RETRY_S) and backend.put_calls == 2 * len(FULL_RETRY_S) + 1
    assert engine.stats.chunks_put_failed == 4  # the last part found the budget spent
    assert time.monotonic() - began < sum(FULL_RETRY_S) + 1.0


def test_under_pressure_a_refused_put_is_not_asked_again(closing: list[WorkerCore]) -> None:
    """A pool that stayed full through the pauses gets one try per batch until a put lands whole: the
    sender does not fall behind the engine by the pauses of every batch."""
    model, backend, engine = simple(closing)
    add_request(model, engine, "a", 64)
    add_request(model, engine, "b", 64)
    backend.put_statuses = [Status.FULL] * (2 + len(FULL_RETRY_S))
    engine.save_request("a", 64)
    assert engine.drain(5)
    assert engine.under_pressure and engine.stats.pressure_events == 1
    calls = backend.put_calls
    engine.save_request("b", 64)
    assert engine.drain(5)
    assert backend.put_calls == calls + 1 and engine.stats.full_retries == len(FULL_RETRY_S)
    assert engine.under_pressure and engine.stats.pressure_events == 1  # one episode, counted once
    engine.save_request("b", 64)
    assert engine.drain(5)
    assert not engine.under_pressure
    assert engine.stored_tokens("b") == 64 and engine.stored_tokens("a") == 0


def test_a_put_inside_the_engine_step_is_never_paused_for_a_full_pool(closing: list[WorkerCore]) -> None:
    """An in-process pool's put runs on the engine's thread (and such a pool evicts as it puts): a
    refusal is final there, the engine never waits for room."""
    model, backend, _ = simple(closing)
    engine = model.engine(backend, config=WorkerConfig(sync_saves=True))
    closing.append(engine)
    add_request(model, engine, "r", 64)
    backend.put_statuses = [Status.FULL]
    engine.save_request("r", 64)
    assert backend.put_calls == 1 and engine.stats.full_retries == 0
    assert engine.under_pressure and engine.stats.chunks_put_failed == 4


def test_failed_put_is_retried_by_the_next_save(closing: list[WorkerCore]) -> None:
    model, backend, engine = simple(closing)
    hashes, _, expected = add_request(model, engine, "r", 128)
    backend.put_statuses = [Status.ERROR]
    engine.save_request("r", 64)
    assert engine.drain(5)
    assert engine.stored_tokens("r") == 0
    assert engine.stats.chunks_put_failed == 4
    assert not engine.under_pressure  # an error is not pool pressure
    examined = len(backend.exists_keys)
    engine.save_request("r", 96)  # re-covers [0, 96)
    assert engine.drain(5)
    assert backend.exists_keys[examined:] == [model.key(0, hashes, c) for c in range(6)]
    assert engine.stored_tokens("r") == 96
    for c in range(6):
        key = model.key(0, hashes, c)
        assert backend.stored(key, 16) == expected[key]


def test_partial_put_failure_keeps_the_mark(closing: list[WorkerCore]) -> None:
    model, backend, engine = simple(closing, config=WorkerConfig(put_batch_chunks=2))
    hashes, _, _ = add_request(model, engine, "r", 128)
    backend.put_statuses = [None, Status.ERROR]  # second batch of two chunks fails
    engine.save_request("r", 128)
    assert engine.drain(5)
    assert engine.stored_tokens("r") == 0
    assert engine.stats.chunks_put == 2
    engine.save_request("r", 128)  # same length: the range is still unplanned, so it is retried
    assert engine.drain(5)
    assert engine.stored_tokens("r") == 128
    assert backend.inner.exists([model.key(0, hashes, c) for c in range(8)]) == [True] * 8


def test_exists_exception_fails_the_job_not_the_sender(closing: list[WorkerCore]) -> None:
    model, backend, engine = simple(closing)
    add_request(model, engine, "r", 64)
    original = backend.exists
    calls = []

    def broken(keys: Sequence[str]) -> list[bool]:
        calls.append(len(keys))
        if len(calls) == 1:
            raise ConnectionError("scripted")
        return original(keys)

    backend.exists = broken  # type: ignore[method-assign]
    engine.save_request("r", 32)
    assert engine.drain(5)
    assert engine.stored_tokens("r") == 0
    engine.save_request("r", 64)
    assert engine.drain(5)
    assert engine.stored_tokens("r") == 64
    assert calls == [2, 4]



def test_save_buffer_limit_drops_and_retries(closing: list[WorkerCore]) -> None:
    chunk = LAYERS * BLOCK_BYTES
    model, backend, engine = simple(closing, config=WorkerConfig(save_buffer_bytes=2 * chunk))
    add_request(model, engine, "r", 128)
    backend.gate = threading.Event()
    engine.save_request("r", 32)  # two chunks: fills the buffer while its put waits
    assert backend.put_entered.wait(5)
    engine.save_request("r", 64)  # no room for its copies: dropped, the range stays unplanned
    assert engine.stats.save_jobs_dropped == 1
    backend.gate.set()
    assert engine.drain(5)
    engine.save_request("r", 96)
    assert engine.drain(5)
    assert engine.stored_tokens("r") == 96
    assert len(set(backend.put_keys)) == 6


# ---- the engine's blocks are read only inside save() -----------------------------------------------


@pytest.mark.parametrize("sync_saves", [False, True])
def test_blocks_are_read_only_inside_save(closing: list[WorkerCore], sync_saves: bool) -> None:
    """Right after every save() the engine overwrites every block (reuse after preemption, abort, finish
    or a window slide; zeroing and copy-on-write of vLLM's Model Runner V2). No stored chunk may hold
    anything but the bytes its key names, whenever the sender gets to it."""
    model = FakeModel([FullAttention(16), SlidingWindow(16, 24)], num_blocks=64)
    backend = RecordingBackend()
    backend.put_delay_s = 0.002  # the sender lags behind the engine
    engine = model.engine(backend, config=WorkerConfig(sync_saves=sync_saves))
    closing.append(engine)
    rng = np.random.default_rng(7)
    expected: dict[str, bytes] = {}
    for i in range(24):
        req = f"r{i}"
        tokens = int(rng.integers(2, 6)) * 16
        hashes = model.hashes(req, tokens)
        tables = model.tables(tokens)
        expected.update(model.fill(req, tables, hashes))
        start(engine, req, hashes, tables)
        for length in range(32, tokens + 1, 32):
            engine.save_request(req, length, computed_before=length - 32)
            for table in tables:
                for block_id in table:
                    model.poison(block_id)
            model.fill(req, tables, hashes)  # the next step of this request finds its blocks intact
        (engine.preempt if rng.random() < 0.5 else engine.finish)([req])
        for table in tables:
            for block_id in table:
                model.poison(block_id)
    assert engine.drain(10)
    stored = {key: backend.stored(key, LAYERS * BLOCK_BYTES) for key in expected}
    assert sum(value is not None for value in stored.values()) > len(expected) // 2
    assert all(value is None or value == expected[key] for key, value in stored.items())


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("save_state", ["running", "queued"])
def test_a_block_zeroed_before_the_pre_forward_hook_is_never_stored(
    closing: list[WorkerCore], runner: str, save_state: str
) -> None:
    """vLLM's Model Runner V2 zeroes newly allocated blocks (and applies copy-on-write copies) in
    `update_requests`, before `pre_forward` calls the connector; V1 calls the connector first. A save
    from step N of a request preempted in step N+1 must not store the zeroed reuse of its blocks."""
    model, backend, engine = simple(closing)
    add_request(model, engine, "first", 32)
    hashes, tables, expected = add_request(model, engine, "a", 64)
    backend.gate = threading.Event()
    if save_state == "queued":
        engine.save_request("first", 32)
        assert backend.put_entered.wait(5)
    engine.save_request("a", 64)  # step N
    if save_state == "running":
        assert backend.put_entered.wait(5)  # a's put is inside the backend
    # step N+1: the scheduler preempts "a" and hands its blocks to another request; the runner zeroes them
    if runner == "v2":
        for block_id in tables[0]:
            model.poison(block_id)
        engine.handle_step(StepMetadata(preempted=["a"]))
    else:
        engine.handle_step(StepMetadata(preempted=["a"]))
        for block_id in tables[0]:
            model.poison(block_id)
    backend.gate.set()
    assert engine.drain(5)
    for chunk in range(4):
        key = model.key(0, hashes, chunk)
        assert backend.stored(key, LAYERS * BLOCK_BYTES) == expected[key]


# ---- finish / preempt while saving ------------------------------------------------------------


def test_finish_while_a_save_runs_retires_the_request_after_it(closing: list[WorkerCore]) -> None:
    model, backend, engine = simple(closing)
    add_request(model, engine, "r", 64)
    backend.gate = threading.Event()
    engine.save_request("r", 64)
    assert backend.put_entered.wait(5)
    engine.finish(["r"])
    assert engine.active_requests() == 1
    backend.gate.set()
    assert engine.drain(5)
    assert engine.active_requests() == 0
    assert len(set(backend.put_keys)) == 4


def test_finish_while_queued_runs_the_save(closing: list[WorkerCore]) -> None:
    model, backend, engine = simple(closing)
    add_request(model, engine, "a", 64)
    hashes_b, _, expected_b = add_request(model, engine, "b", 64)
    backend.gate = threading.Event()
    engine.save_request("a", 64)
    assert backend.put_entered.wait(5)
    engine.save_request("b", 64)  # queued behind a
    engine.finish(["b", "never-seen"])
    backend.gate.set()
    assert engine.drain(5)
    key = model.key(0, hashes_b, 3)
    assert backend.stored(key, 16) == expected_b[key]
    engine.finish(["a"])
    assert engine.active_requests() == 0


def test_preempt_while_queued_still_stores_what_was_captured(closing: list[WorkerCore]) -> None:
    model, backend, engine = simple(closing)
    add_request(model, engine, "a", 64)
    hashes_b, tables_b, expected_b = add_request(model, engine, "b", 64)
    backend.gate = threading.Event()
    engine.save_request("a", 64)
    assert backend.put_entered.wait(5)
    engine.save_request("b", 64)
    engine.preempt(["b"])
    for block_id in tables_b[0]:
        model.poison(block_id)  # the engine reuses b's blocks at once
    assert engine.active_requests() == 1
    backend.gate.set()
    assert engine.drain(5)
    for chunk in range(4):
        key = model.key(0, hashes_b, chunk)
        assert backend.stored(key, 16) == expected_b[key]
    engine.finish(["b", "a"])  # the engine may still finish a preempted request
    assert engine.active_requests() == 0


def test_a_request_state_starts_only_at_its_first_delta(closing: list[WorkerCore]) -> None:
    """A delta that is not a request's first (no prompt length) must not start a state: its hashes
    would pair with the wrong chunks. The save of such a request is skipped, never mis-keyed."""
    model, backend, engine = simple(closing)
    hashes = model.hashes("r", 64)
    tables = model.tables(64)
    model.fill("r", tables, hashes)
    engine.apply([RequestDelta("r", new_hashes=hashes[2:], new_blocks=tables)])
    engine.save_request("r", 64)
    assert engine.drain(5)
    assert backend.put_keys == [] and engine.active_requests() == 0


# ---- resets --------------------------------------------------------------------------------------


def test_a_reset_drops_queued_saves_and_freezes_live_requests(closing: list[WorkerCore]) -> None:
    model, backend, engine = simple(closing)
    add_request(model, engine, "a", 128)
    add_request(model, engine, "b", 64)
    backend.gate = threading.Event()
    engine.save_request("a", 32)
    assert backend.put_entered.wait(5)  # a's first save is inside the backend's put
    engine.save_request("b", 64)  # queued
    reset = threading.Thread(target=engine.handle_step, args=(StepMetadata(reset_epoch=1),))
    reset.start()
    reset.join(0.2)
    assert reset.is_alive()  # the reset waits for the running put before emptying the pool
    backend.gate.set()
    reset.join(5)
    assert engine.drain(5)
    assert backend.inner.keys() == []  # neither the running save nor the queued one survived
    engine.save_request("a", 128)  # a lived through the reset: its KV predates it
    assert engine.drain(5)
    assert backend.inner.keys() == []
    assert engine.stats.resets == 1


def test_a_reset_that_gives_up_waiting_removes_the_late_put(closing: list[WorkerCore]) -> None:
    model, backend, engine = simple(closing)
    add_request(model, engine, "a", 32)
    backend.gate = threading.Event()
    engine.save_request("a", 32)
    assert backend.put_entered.wait(5)
    engine.reset(1, wait_s=0.05)  # the put hangs past the wait
    backend.gate.set()
    assert engine.drain(5)
    assert backend.inner.keys() == []


# ---- bad input ------------------------------------------------------------------------------------


def test_engine_rejects_mismatched_groups(closing: list[WorkerCore]) -> None:
    model = FakeModel([FullAttention(16), SlidingWindow(16, 32)])
    with pytest.raises(LayoutError, match="1 group placements for 2 groups"):
        WorkerCore(MemoryBackend(1 << 20), model.coord, [GroupPlacement(model.spaces[0])])
    engine = model.engine(RecordingBackend())
    closing.append(engine)
    one_group = KVLayout({"x": np.zeros((4, 8), dtype=np.uint8)}, {"x": 0}, 4)
    with pytest.raises(LayoutError, match="1 groups"):
        engine.register_layout(one_group)
    with pytest.raises(LayoutError, match="1 block lists for 2 groups"):
        engine.apply([RequestDelta("r", new_hashes=[b"x"], new_blocks=([1],), num_prompt_tokens=16)])


def test_save_before_layout_fails_the_job_only(closing: list[WorkerCore]) -> None:
    model = FakeModel([FullAttention(16)])
    backend = RecordingBackend()
    engine = WorkerCore(backend, model.coord, [GroupPlacement(model.spaces[0])])
    closing.append(engine)
    hashes = model.hashes("r", 32)
    tables = model.tables(32)
    start(engine, "r", hashes, tables)
    engine.save_request("r", 32)
    assert engine.drain(5)
    assert engine.stored_tokens("r") == 0
    engine.register_layout(model.layout)
    engine.save_request("r", 32)
    assert engine.drain(5)
    assert engine.stored_tokens("r") == 32


