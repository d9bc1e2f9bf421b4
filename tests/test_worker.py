"""WorkerEngine: incremental saves, pressure gate, retries, fences, lifecycle, loads."""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.backends.base import BackendStats, Status, Value
from kvpool.backends.memory import MemoryBackend
from kvpool.errors import LayoutError
from kvpool.keys import KeySpace, LayoutFingerprint, chunk_hashes
from kvpool.layout import KVLayout
from kvpool.masks import (
    AttentionKind,
    ChunkedLocal,
    FullAttention,
    MaskCoordinator,
    SlidingWindow,
    StateSpace,
)
from kvpool.metadata import LoadSpec, RequestDelta, StepMetadata
from kvpool.worker import GroupPlacement, WorkerConfig, WorkerEngine

LAYERS = 2
BLOCK_BYTES = 8  # per layer: chunk values are LAYERS * BLOCK_BYTES bytes
POISON = 0xEE

# ---- fakes ----------------------------------------------------------------------------------------


class RecordingBackend:
    """A MemoryBackend that records every key passed to exists and put, with scripted faults."""

    name = "recording"

    def __init__(self, inner: MemoryBackend | None = None) -> None:
        self.inner = inner or MemoryBackend(64 << 20)
        self._lock = threading.Lock()
        self.exists_keys: list[str] = []
        self.put_keys: list[str] = []
        self.put_statuses: list[Status | None] = []  # next put calls answer this for every key
        self.gate: threading.Event | None = None  # puts wait for it (while not None)
        self.put_entered = threading.Event()
        self.put_delay_s = 0.0
        self.get_calls = 0
        self.get_raises_on: set[int] = set()  # 1-based get_into call numbers that raise
        self.is_healthy = True

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            self.exists_keys.extend(keys)
        return self.inner.exists(keys)

    def put(self, keys: Sequence[str], values: Sequence[Value]) -> list[Status]:
        with self._lock:
            self.put_keys.extend(keys)
            scripted = self.put_statuses.pop(0) if self.put_statuses else None
        self.put_entered.set()
        gate = self.gate
        if gate is not None:
            assert gate.wait(10), "test gate never opened"
        if self.put_delay_s:
            time.sleep(self.put_delay_s)
        if scripted is not None:
            return [scripted] * len(keys)
        return self.inner.put(keys, values)

    def get_into(self, keys: Sequence[str], dests: Sequence[Value]) -> list[Status]:
        with self._lock:
            self.get_calls += 1
            call = self.get_calls
        if call in self.get_raises_on:
            raise ConnectionError("scripted get failure")
        return self.inner.get_into(keys, dests)

    def remove(self, keys: Sequence[str]) -> int:
        return self.inner.remove(keys)

    def clear(self) -> int:
        return self.inner.clear()

    def stats(self) -> BackendStats:
        return self.inner.stats()

    def healthy(self) -> bool:
        return self.is_healthy

    def close(self) -> None:
        self.inner.close()

    def stored(self, key: str, size: int) -> bytes | None:
        dest = np.zeros(size, dtype=np.uint8)
        status = self.inner.get_into([key], [[dest]])
        return dest.tobytes() if status[0] is Status.OK else None


def block_content(tag: str, layer: int) -> np.ndarray:
    return np.frombuffer(hashlib.blake2b(f"{tag}/{layer}".encode(), digest_size=BLOCK_BYTES).digest(), np.uint8)


class FakeModel:
    """Engine-side state for a model: KV tensors (numpy), per-group key spaces, a block allocator."""

    def __init__(self, kinds: Sequence[AttentionKind], retention: int | None = None, num_blocks: int = 512) -> None:
        self.coord = MaskCoordinator(kinds, retention_interval=retention)
        self.h = self.coord.hash_block_size
        self.tensors = {
            f"g{g}.l{layer}": np.zeros((num_blocks, BLOCK_BYTES), dtype=np.uint8)
            for g in range(len(kinds))
            for layer in range(LAYERS)
        }
        groups = {name: int(name[1 : name.index(".")]) for name in self.tensors}
        self.layout = KVLayout(self.tensors, groups, num_blocks)
        self.spaces = [
            KeySpace(LayoutFingerprint("test/model", "uint8", kind.block_size, "numpy", group_id=g))
            for g, kind in enumerate(kinds)
        ]
        self.num_blocks = num_blocks
        self.next_block = 1

    @property
    def kinds(self) -> list[AttentionKind]:
        return self.coord.kinds

    def hashes(self, prefix: str, tokens: int) -> list[bytes]:
        return [hashlib.blake2b(f"{prefix}:{i}".encode(), digest_size=16).digest() for i in range(tokens // self.h)]

    def allocate(self, count: int) -> list[int]:
        if self.next_block + count > self.num_blocks:
            self.next_block = 1  # wrap: tests that need distinct blocks stay well below num_blocks
        ids = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        return ids

    def tables(self, tokens: int) -> tuple[list[int], ...]:
        return tuple(self.allocate(-(-tokens // kind.block_size)) for kind in self.kinds)

    def write(self, group: int, block_id: int, tag: str) -> None:
        for layer in range(LAYERS):
            self.tensors[f"g{group}.l{layer}"][block_id] = block_content(tag, layer)

    def poison(self, block_id: int) -> None:
        for tensor in self.tensors.values():
            tensor[block_id] = POISON

    def read(self, group: int, block_id: int) -> bytes:
        return b"".join(self.tensors[f"g{group}.l{layer}"][block_id].tobytes() for layer in range(LAYERS))

    def fill(self, prefix: str, tables: tuple[list[int], ...], hashes: list[bytes]) -> dict[str, bytes]:
        """Write every block with content named by its chunk; return key → expected bytes."""
        expected = {}
        for group, (kind, table) in enumerate(zip(self.kinds, tables)):
            named = chunk_hashes(hashes, self.h, kind.block_size)
            for chunk, block_id in enumerate(table):
                if block_id == 0:
                    continue
                tag = f"{prefix}/{group}/{chunk}"
                self.write(group, block_id, tag)
                if chunk < len(named):
                    expected[self.spaces[group].key(named[chunk])] = b"".join(
                        block_content(tag, layer).tobytes() for layer in range(LAYERS)
                    )
        return expected

    def engine(
        self, backend: Any, put_step: int = 1, rank: int = 0, config: WorkerConfig | None = None
    ) -> WorkerEngine:
        placements = [GroupPlacement(space, put_step, (rank + g) % put_step) for g, space in enumerate(self.spaces)]
        return WorkerEngine(backend, self.coord, placements, self.layout, config)

    def key(self, group: int, hashes: list[bytes], chunk: int) -> str:
        return self.spaces[group].key(chunk_hashes(hashes, self.h, self.kinds[group].block_size)[chunk])


def start(engine: WorkerEngine, req: str, hashes: list[bytes], tables: tuple[list[int], ...], prompt: int = 0) -> None:
    engine.apply([RequestDelta(req, new_hashes=list(hashes), new_blocks=tables, num_prompt_tokens=prompt or 1 << 20)])


@pytest.fixture
def closing() -> Iterator[list[WorkerEngine]]:
    engines: list[WorkerEngine] = []
    yield engines
    for engine in engines:
        engine.close()


def simple(
    closing: list[WorkerEngine], config: WorkerConfig | None = None, kinds: Sequence[AttentionKind] | None = None
) -> tuple[FakeModel, RecordingBackend, WorkerEngine]:
    model = FakeModel(kinds or [FullAttention(16)])
    backend = RecordingBackend()
    engine = model.engine(backend, config=config)
    closing.append(engine)
    return model, backend, engine


def add_request(model: FakeModel, engine: WorkerEngine, req: str, tokens: int) -> tuple[list[bytes], tuple, dict]:  # type: ignore[type-arg]
    hashes = model.hashes(req, tokens)
    tables = model.tables(tokens)
    expected = model.fill(req, tables, hashes)
    start(engine, req, hashes, tables)
    return hashes, tables, expected


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
    """The keys one save of `tokens` must store, straight from the masks."""
    end = model.coord.align(tokens)
    keys = set()
    for group, kind in enumerate(model.kinds):
        mask = model.coord.store_mask(group, end, 0, prompt)
        for chunk in range(end // kind.block_size):
            if (mask is None or mask[chunk]) and chunk % put_step == (rank + group) % put_step:
                keys.add(model.key(group, hashes, chunk))
    return keys


def drive(
    engine: WorkerEngine,
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
    hashes = model.hashes("p", final)
    tables = model.tables(final)
    expected_bytes = model.fill("p", tables, hashes)

    incremental, one_shot = RecordingBackend(), RecordingBackend()
    a = model.engine(incremental, put_step, rank)
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


def test_incremental_save_examines_only_new_chunks(closing: list[WorkerEngine]) -> None:
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


def test_save_skips_null_and_freed_blocks(closing: list[WorkerEngine]) -> None:
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


def test_pressure_gate_drops_queued_saves_then_clears(closing: list[WorkerEngine]) -> None:
    model, backend, engine = simple(closing)
    add_request(model, engine, "r", 256)
    backend.gate = threading.Event()
    backend.put_statuses = [Status.FULL]
    engine.save_request("r", 32)
    assert backend.put_entered.wait(5)  # the first job is inside put
    engine.save_request("r", 64)
    engine.save_request("r", 96)
    backend.gate.set()
    assert engine.drain(5)
    assert engine.under_pressure
    assert engine.stats.pressure_events == 1
    assert engine.stats.save_jobs_dropped == 2
    assert len(backend.put_keys) == 2  # only the first job reached the pool
    assert engine.stored_tokens("r") == 0
    put_before = len(backend.put_keys)
    engine.save_request("r", 128)  # re-plans from the stored mark: chunks 0..7
    assert engine.drain(5)
    assert not engine.under_pressure
    assert len(backend.put_keys) - put_before == 8
    assert engine.stored_tokens("r") == 128


def test_pressure_gates_only_the_full_request(closing: list[WorkerEngine]) -> None:
    model, backend, engine = simple(closing)
    add_request(model, engine, "r", 256)
    add_request(model, engine, "other", 256)
    backend.gate = threading.Event()
    backend.put_statuses = [Status.FULL]
    engine.save_request("r", 32)
    assert backend.put_entered.wait(5)
    engine.save_request("r", 64)
    engine.save_request("other", 32)
    backend.gate.set()
    assert engine.drain(5)
    assert engine.stats.save_jobs_dropped == 1
    assert engine.stored_tokens("other") == 32
    assert engine.stored_tokens("r") == 0
    assert not engine.under_pressure  # other's later put succeeded: the gate is off again
    assert engine.stats.pressure_events == 1


def test_success_clears_pressure_for_other_requests(closing: list[WorkerEngine]) -> None:
    model, backend, engine = simple(closing)
    add_request(model, engine, "a", 64)
    add_request(model, engine, "b", 64)
    backend.put_statuses = [Status.FULL]
    engine.save_request("a", 64)
    assert engine.drain(5)
    assert engine.under_pressure and engine.stats.pressure_events == 1
    engine.save_request("b", 64)
    assert engine.drain(5)
    assert not engine.under_pressure
    assert engine.stored_tokens("b") == 64 and engine.stored_tokens("a") == 0


def test_failed_put_is_retried_by_the_next_save(closing: list[WorkerEngine]) -> None:
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


def test_partial_put_failure_keeps_the_mark(closing: list[WorkerEngine]) -> None:
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


def test_exists_exception_fails_the_job_not_the_sender(closing: list[WorkerEngine]) -> None:
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


def test_queue_limit_drops_and_retries(closing: list[WorkerEngine]) -> None:
    model, backend, engine = simple(closing, config=WorkerConfig(queue_limit=1))
    add_request(model, engine, "r", 128)
    backend.gate = threading.Event()
    engine.save_request("r", 32)
    assert backend.put_entered.wait(5)
    engine.save_request("r", 64)  # over the limit: dropped, range stays unplanned
    assert engine.stats.save_jobs_dropped == 1
    backend.gate.set()
    assert engine.drain(5)
    engine.save_request("r", 96)
    assert engine.drain(5)
    assert engine.stored_tokens("r") == 96
    assert len(set(backend.put_keys)) == 6


# ---- finish / preempt while saving ------------------------------------------------------------


def test_finish_while_a_save_runs_reports_after_it(closing: list[WorkerEngine]) -> None:
    model, backend, engine = simple(closing)
    add_request(model, engine, "r", 64)
    backend.gate = threading.Event()
    engine.save_request("r", 64)
    assert backend.put_entered.wait(5)
    engine.finish(["r"])
    assert engine.take_finished() == (set(), set())
    assert engine.active_requests() == 1
    backend.gate.set()
    assert engine.drain(5)
    assert engine.take_finished() == ({"r"}, set())
    assert engine.active_requests() == 0
    assert engine.take_finished() == (set(), set())  # reported once
    assert len(set(backend.put_keys)) == 4


def test_finish_while_queued_runs_the_save(closing: list[WorkerEngine]) -> None:
    model, backend, engine = simple(closing)
    add_request(model, engine, "a", 64)
    hashes_b, _, expected_b = add_request(model, engine, "b", 64)
    backend.gate = threading.Event()
    engine.save_request("a", 64)
    assert backend.put_entered.wait(5)
    engine.save_request("b", 64)  # queued behind a
    engine.finish(["b"])
    assert engine.take_finished()[0] == set()
    backend.gate.set()
    assert engine.drain(5)
    assert engine.take_finished()[0] == {"b"}
    key = model.key(0, hashes_b, 3)
    assert backend.stored(key, 16) == expected_b[key]
    engine.finish(["a"])
    assert engine.take_finished()[0] == {"a"}
    assert engine.active_requests() == 0


def test_finish_without_saves_is_not_reported(closing: list[WorkerEngine]) -> None:
    model, _, engine = simple(closing)
    add_request(model, engine, "r", 64)
    engine.finish(["r", "never-seen"])
    assert engine.take_finished() == (set(), set())
    assert engine.active_requests() == 0


def test_preempt_while_queued_cancels_the_save(closing: list[WorkerEngine]) -> None:
    model, backend, engine = simple(closing)
    add_request(model, engine, "a", 64)
    _, tables_b, _ = add_request(model, engine, "b", 64)
    backend.gate = threading.Event()
    engine.save_request("a", 64)
    assert backend.put_entered.wait(5)
    engine.save_request("b", 64)
    engine.preempt(["b"])
    assert engine.active_requests() == 1
    began = time.monotonic()
    engine.fence(tables_b[0])  # b's queued save is cancelled: nothing reads its blocks any more
    assert time.monotonic() - began < 0.5
    backend.gate.set()
    assert engine.drain(5)
    assert all(not k.startswith(model.spaces[0].prefix) or k in set(backend.put_keys) for k in backend.put_keys)
    assert engine.stats.save_jobs_dropped == 1
    assert len(set(backend.put_keys)) == 4  # only a's chunks
    engine.finish(["b"])  # the engine may still finish a preempted request: never reported
    saving, _ = engine.take_finished()
    assert "b" not in saving
    engine.finish(["a"])
    assert engine.take_finished()[0] == {"a"}
    assert engine.active_requests() == 0


def test_preempt_while_running_waits_in_fence(closing: list[WorkerEngine]) -> None:
    model, backend, engine = simple(closing)
    _, tables, expected = add_request(model, engine, "r", 64)
    backend.gate = threading.Event()
    engine.save_request("r", 64)
    assert backend.put_entered.wait(5)
    engine.preempt(["r"])
    assert engine.active_requests() == 0
    fenced = threading.Event()
    waiter = threading.Thread(target=lambda: (engine.fence([tables[0][2]]), fenced.set()))
    waiter.start()
    assert not fenced.wait(0.2)  # the running save still reads the block
    began = time.monotonic()
    engine.fence([tables[0][-1] + 100])  # unrelated block: immediate
    assert time.monotonic() - began < 0.5  # no waiting (generous for loaded CI machines)
    backend.gate.set()
    assert fenced.wait(5)
    waiter.join()
    assert engine.drain(5)
    assert engine.take_finished() == (set(), set())  # preempted: never reported
    for key, value in expected.items():  # what the running save read is intact
        assert backend.stored(key, 16) == value


def test_fence_waits_for_running_save_and_ignores_unrelated_blocks(closing: list[WorkerEngine]) -> None:
    model, backend, engine = simple(closing)
    _, tables, _ = add_request(model, engine, "r", 64)
    backend.gate = threading.Event()
    engine.save_request("r", 64)
    assert backend.put_entered.wait(5)
    began = time.monotonic()
    engine.fence([tables[0][-1] + 1, 0])
    assert time.monotonic() - began < 0.5  # no waiting (generous for loaded CI machines)
    assert engine.stats.fence_waits == 0
    fenced = threading.Event()
    threading.Thread(target=lambda: (engine.fence([tables[0][1]]), fenced.set()), daemon=True).start()
    assert not fenced.wait(0.2)
    backend.gate.set()
    assert fenced.wait(5)
    assert engine.stats.fence_waits == 1


def test_fence_timeout_cancels_unstarted_saves(closing: list[WorkerEngine]) -> None:
    model, backend, engine = simple(closing, config=WorkerConfig(fence_timeout_s=0.1))
    add_request(model, engine, "a", 64)
    _, tables_b, _ = add_request(model, engine, "b", 64)
    backend.gate = threading.Event()
    engine.save_request("a", 64)
    assert backend.put_entered.wait(5)
    engine.save_request("b", 64)
    began = time.monotonic()
    engine.fence(tables_b[0])  # b's save has not started: cancelled after the timeout
    assert 0.05 < time.monotonic() - began < 2
    assert engine.stats.fence_cancelled_jobs == 1
    backend.gate.set()
    assert engine.drain(5)
    assert engine.stored_tokens("b") == 0
    engine.save_request("b", 64)  # the cancelled range is saved again
    assert engine.drain(5)
    assert engine.stored_tokens("b") == 64


def test_handle_step_preempts_then_fences(closing: list[WorkerEngine]) -> None:
    model, backend, engine = simple(closing)
    _, tables, _ = add_request(model, engine, "r", 64)
    backend.gate = threading.Event()
    engine.save_request("r", 32)
    assert backend.put_entered.wait(5)
    engine.save_request("r", 64)  # queued
    threading.Timer(0.2, backend.gate.set).start()
    engine.handle_step(StepMetadata(preempted=["r"], written_blocks=list(tables[0])))
    assert backend.gate.is_set()  # the fence waited for the running save
    assert engine.drain(5)
    assert len(backend.put_keys) == 2  # the queued save was cancelled


@pytest.mark.parametrize("fenced", [True, False])
def test_no_save_reads_a_block_after_fence(closing: list[WorkerEngine], fenced: bool) -> None:
    """The engine poisons and reuses blocks right after fence(); no stored chunk may hold poison.
    With the fence disabled the same schedule must store poison: the test can fail."""
    model = FakeModel([FullAttention(16)], num_blocks=64)
    backend = RecordingBackend()
    backend.put_delay_s = 0.002
    engine = model.engine(backend)
    closing.append(engine)
    if not fenced:
        engine.fence = lambda block_ids: None  # type: ignore[method-assign]
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
            engine.save_request(req, length)
        if rng.random() < 0.5:
            engine.preempt([req])
        else:
            engine.finish([req])
        engine.fence(tables[0])  # the next step writes these blocks
        for block_id in tables[0]:
            model.poison(block_id)
    assert engine.drain(10)
    stored = [backend.stored(key, 16) for key in expected]
    poisoned = sum(1 for value in stored if value == bytes([POISON]) * 16)
    wrong = sum(1 for key, value in zip(expected, stored) if value is not None and value != expected[key])
    if fenced:
        assert poisoned == 0 and wrong == 0
        assert any(value is not None for value in stored)
    else:
        assert poisoned > 0


# ---- a stateful model of the request lifecycle -----------------------------------------------


class WorkerLifecycle(RuleBasedStateMachine):
    """Random saves, finishes, aborts, preemptions (with resumes under the same id), fences and pool
    faults. Reports must match: a request is reported once iff it finished while running with saves."""

    def __init__(self) -> None:
        super().__init__()
        self.model = FakeModel([FullAttention(16), SlidingWindow(16, 24)], num_blocks=4096)
        self.backend = RecordingBackend()
        self.engine = self.model.engine(self.backend, config=WorkerConfig(fence_timeout_s=0.05))
        self.count = 0
        self.length: dict[str, int] = {}  # running requests → tokens so far
        self.waiting: set[str] = set()  # preempted, may resume under the same id
        self.done: set[str] = set()  # finished or aborted: the id is never used again
        self.tables: dict[str, tuple[list[int], ...]] = {}
        self.had_save: set[str] = set()  # saves since the request (re)started
        self.expect_report: set[str] = set()
        self.reported: Counter[str] = Counter()

    def _collect(self) -> None:
        saving, _ = self.engine.take_finished()
        assert not saving & self.waiting, "a preempted request was reported"
        assert saving <= self.expect_report, "a request was reported that did not finish with saves"
        self.reported.update(saving)

    def _begin(self, req: str) -> None:
        hashes = self.model.hashes(req, 160)
        tables = self.model.tables(160)
        self.model.fill(req, tables, hashes)
        self.engine.apply(
            [RequestDelta(req, new_hashes=hashes, new_blocks=tables, replace_blocks=True, num_prompt_tokens=1 << 20)]
        )
        self.length[req] = 0
        self.tables[req] = tables

    @rule()
    def new_request(self) -> None:
        self._begin(f"r{self.count}")
        self.count += 1

    @precondition(lambda self: self.length)
    @rule(data=st.data(), grow=st.integers(1, 48))
    def save(self, data: st.DataObject, grow: int) -> None:
        req = data.draw(st.sampled_from(sorted(self.length)))
        previous = self.length[req]
        self.length[req] = min(160, previous + grow)
        self.engine.save_request(req, self.length[req], computed_before=previous)
        self.had_save.add(req)

    @precondition(lambda self: self.length)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.length)))
        self.engine.finish([req])
        del self.length[req]
        self.done.add(req)
        if req in self.had_save:
            self.expect_report.add(req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data: st.DataObject) -> None:
        """An abort of a preempted request: the engine finishes it, nothing to report."""
        req = data.draw(st.sampled_from(sorted(self.waiting)))
        self.engine.finish([req])
        self.waiting.discard(req)
        self.done.add(req)

    @precondition(lambda self: self.length)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.length)))
        self.engine.preempt([req])
        del self.length[req]
        self.had_save.discard(req)
        self.waiting.add(req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.waiting)))
        self.waiting.discard(req)
        self._begin(req)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fence(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.tables)))
        self.engine.fence(self.tables[req][0][:3] + self.tables[req][1][-2:])

    @rule(status=st.sampled_from([Status.FULL, Status.ERROR]))
    def fault(self, status: Status) -> None:
        self.backend.put_statuses.append(status)

    @rule(delay=st.sampled_from([0.0, 0.0005]))
    def slow(self, delay: float) -> None:
        self.backend.put_delay_s = delay

    @rule()
    def collect(self) -> None:
        self._collect()

    @rule()
    def drain(self) -> None:
        assert self.engine.drain(10)

    @invariant()
    def no_more_state_than_requests(self) -> None:
        # running requests, plus finished ones whose saves are still in flight
        assert self.engine.active_requests() <= len(self.length) + len(self.done)

    def teardown(self) -> None:
        try:
            for req in sorted(self.length):
                self.engine.finish([req])
                self.done.add(req)
                if req in self.had_save:
                    self.expect_report.add(req)
            self.length.clear()
            for req in sorted(self.waiting):  # preempted requests stay preempted: never reported
                self.engine.finish([req])
            assert self.engine.drain(10)
            self._collect()
            assert self.engine.active_requests() == 0
            assert set(self.reported) == self.expect_report
            assert all(count == 1 for count in self.reported.values())
        finally:
            self.engine.close()


TestWorkerLifecycle = WorkerLifecycle.TestCase
TestWorkerLifecycle.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---- loads --------------------------------------------------------------------------------------


def saved_prefix(
    closing: list[WorkerEngine],
    kinds: Sequence[AttentionKind] | None = None,
    tokens: int = 128,
    config: WorkerConfig | None = None,
) -> tuple[FakeModel, RecordingBackend, WorkerEngine, list[bytes], dict[str, bytes]]:
    model, backend, engine = simple(closing, config=config, kinds=kinds)
    hashes = model.hashes("prefix", tokens)
    tables = model.tables(tokens)
    expected = model.fill("prefix", tables, hashes)
    start(engine, "writer", hashes, tables)
    engine.save_request("writer", tokens)
    assert engine.drain(5)
    engine.finish(["writer"])
    engine.take_finished()
    return model, backend, engine, hashes, expected


def load_request(
    engine: WorkerEngine,
    model: FakeModel,
    req: str,
    hashes: list[bytes],
    start_tokens: int,
    hit: int,
    tables: tuple[list[int], ...] | None = None,
) -> tuple[list[int], ...]:
    tables = tables or model.tables(hit + 16)
    engine.apply(
        [
            RequestDelta(
                req,
                new_hashes=hashes,
                new_blocks=tables,
                num_prompt_tokens=hit + 16,
                stored_tokens=hit,
                load=LoadSpec(start_tokens, hit),
            )
        ]
    )
    assert engine.drain(5)
    return tables


def test_load_fills_blocks_with_stored_bytes(closing: list[WorkerEngine]) -> None:
    model, _, engine, hashes, expected = saved_prefix(closing)
    tables = load_request(engine, model, "reader", hashes, 0, 128)
    assert engine.take_failed_blocks() == set()
    assert engine.take_finished() == (set(), {"reader"})
    for chunk in range(8):
        assert model.read(0, tables[0][chunk]) == expected[model.key(0, hashes, chunk)]
    assert model.read(0, tables[0][8]) == bytes(16)  # beyond the hit: untouched
    assert engine.stats.chunks_loaded == 8


def test_load_skips_the_locally_cached_prefix(closing: list[WorkerEngine]) -> None:
    model, _, engine, hashes, expected = saved_prefix(closing)
    tables = load_request(engine, model, "reader", hashes, 48, 96)
    for chunk in range(6):
        value = model.read(0, tables[0][chunk])
        assert value == (expected[model.key(0, hashes, chunk)] if chunk >= 3 else bytes(16))
    assert engine.take_failed_blocks() == set()


def test_load_of_a_missing_chunk_reports_its_block(closing: list[WorkerEngine]) -> None:
    model, backend, engine, hashes, _ = saved_prefix(closing)
    backend.remove([model.key(0, hashes, 2)])
    tables = load_request(engine, model, "reader", hashes, 0, 128)
    assert engine.take_failed_blocks() == {tables[0][2]}
    assert engine.take_finished()[1] == {"reader"}
    assert engine.take_failed_blocks() == set()


def test_load_with_a_wrong_stored_size_reports_its_block(closing: list[WorkerEngine]) -> None:
    model, backend, engine, hashes, _ = saved_prefix(closing)
    key = model.key(0, hashes, 5)
    backend.remove([key])
    backend.inner.put([key], [[np.zeros(3, dtype=np.uint8)]])
    tables = load_request(engine, model, "reader", hashes, 0, 128)
    assert engine.take_failed_blocks() == {tables[0][5]}
    assert engine.take_finished()[1] == {"reader"}


def test_load_backend_exception_reports_exactly_the_unloaded_blocks(closing: list[WorkerEngine]) -> None:
    model, backend, engine, hashes, expected = saved_prefix(closing, config=WorkerConfig(put_batch_chunks=2))
    backend.get_raises_on = {2}  # the second batch (chunks 2, 3) raises; later batches are not tried
    tables = load_request(engine, model, "reader", hashes, 0, 128)
    assert engine.take_failed_blocks() == set(tables[0][2:8])
    assert engine.take_finished()[1] == {"reader"}
    for chunk in (0, 1):
        assert model.read(0, tables[0][chunk]) == expected[model.key(0, hashes, chunk)]


def test_load_from_an_unhealthy_backend_fails_every_block(closing: list[WorkerEngine]) -> None:
    model, backend, engine, hashes, _ = saved_prefix(closing)
    backend.is_healthy = False
    tables = load_request(engine, model, "reader", hashes, 32, 128)
    assert engine.take_failed_blocks() == set(tables[0][2:8])
    assert engine.take_finished()[1] == {"reader"}


def test_load_without_hashes_fails_the_uncovered_blocks(closing: list[WorkerEngine]) -> None:
    model, _, engine, hashes, _ = saved_prefix(closing)
    tables = load_request(engine, model, "reader", hashes[:5], 32, 128)
    assert engine.take_failed_blocks() == set(tables[0][5:8])
    assert engine.take_finished()[1] == {"reader"}
    # fewer hashes than the local prefix: the locally computed blocks are not reported
    tables = load_request(engine, model, "reader2", hashes[:1], 32, 128)
    assert engine.take_failed_blocks() == set(tables[0][2:8])


def test_hybrid_load_uses_the_load_mask_and_skips_null_blocks(closing: list[WorkerEngine]) -> None:
    kinds = [FullAttention(32), SlidingWindow(16, 17)]
    model, backend, engine, hashes, expected = saved_prefix(closing, kinds=kinds, tokens=128)
    tables = model.tables(160)
    tables[1][:6] = [0] * 6  # window blocks outside the window are null in the engine's table
    backend.remove([model.key(1, hashes, 7)])  # the one window chunk a hit at 128 needs
    tables = load_request(engine, model, "reader", hashes, 0, 128, tables)
    assert engine.take_failed_blocks() == {tables[1][7]}
    for chunk in range(4):
        assert model.read(0, tables[0][chunk]) == expected[model.key(0, hashes, chunk)]
    assert model.read(1, tables[1][6]) == bytes(16)  # not required by a hit at 128: not loaded
    assert engine.take_finished()[1] == {"reader"}


def test_fence_waits_for_a_running_load(closing: list[WorkerEngine]) -> None:
    model, backend, engine, hashes, _ = saved_prefix(closing)
    gate = threading.Event()
    original = backend.get_into

    def slow_get(keys: Sequence[str], dests: Sequence[Value]) -> list[Status]:
        assert gate.wait(5)
        return original(keys, dests)

    backend.get_into = slow_get  # type: ignore[method-assign]
    tables = model.tables(144)
    engine.apply(
        [RequestDelta("reader", new_hashes=hashes, new_blocks=tables, num_prompt_tokens=144, load=LoadSpec(0, 128))]
    )
    fenced = threading.Event()
    threading.Thread(target=lambda: (engine.fence([tables[0][0]]), fenced.set()), daemon=True).start()
    assert not fenced.wait(0.2)
    gate.set()
    assert fenced.wait(5)
    assert engine.drain(5)


# ---- bad input ------------------------------------------------------------------------------------


def test_engine_rejects_mismatched_groups(closing: list[WorkerEngine]) -> None:
    model = FakeModel([FullAttention(16), SlidingWindow(16, 32)])
    with pytest.raises(LayoutError, match="1 group placements for 2 groups"):
        WorkerEngine(MemoryBackend(1 << 20), model.coord, [GroupPlacement(model.spaces[0])])
    engine = model.engine(RecordingBackend())
    closing.append(engine)
    one_group = KVLayout({"x": np.zeros((4, 8), dtype=np.uint8)}, {"x": 0}, 4)
    with pytest.raises(LayoutError, match="1 groups"):
        engine.register_layout(one_group)
    with pytest.raises(LayoutError, match="1 block lists for 2 groups"):
        engine.apply([RequestDelta("r", new_hashes=[b"x"], new_blocks=([1],), num_prompt_tokens=16)])


def test_save_before_layout_fails_the_job_only(closing: list[WorkerEngine]) -> None:
    model = FakeModel([FullAttention(16)])
    backend = RecordingBackend()
    engine = WorkerEngine(backend, model.coord, [GroupPlacement(model.spaces[0])])
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


def test_sync_loads_finish_inside_apply(closing: list[WorkerEngine]) -> None:
    model, _, engine, hashes, expected = saved_prefix(closing, config=WorkerConfig(sync_loads=True))
    engine.close()  # no loader thread: the load must run in the caller
    tables = model.tables(144)
    engine.apply([RequestDelta("reader", new_hashes=hashes, new_blocks=tables, load=LoadSpec(0, 128))])
    assert engine.take_finished() == (set(), {"reader"})
    assert engine.take_failed_blocks() == set()
    for chunk in range(8):
        assert model.read(0, tables[0][chunk]) == expected[model.key(0, hashes, chunk)]
