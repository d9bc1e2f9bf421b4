"""WorkerCore loads: the stored bytes land in the hit's blocks; every chunk that does not arrive is
reported in the form the engine can recompute from; the marks drop to what is really stored."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from kvpool.backends.base import Status, Value
from kvpool.core.masks import AttentionKind, ChunkedLocal, FullAttention, SlidingWindow
from kvpool.core.metadata import LoadSpec, RequestDelta, StepMetadata
from kvpool.worker.loader import CALL_THREADS
from kvpool.worker.worker_core import WorkerConfig, WorkerCore
from worker_fakes import POISON, FakeModel, RecordingBackend, simple, start


def saved_prefix(
    closing: list[WorkerCore],
    kinds: Sequence[AttentionKind] | None = None,
    tokens: int = 128,
    config: WorkerConfig | None = None,
) -> tuple[FakeModel, RecordingBackend, WorkerCore, list[bytes], dict[str, bytes]]:
    model, backend, engine = simple(closing, config=config, kinds=kinds)
    hashes = model.hashes("prefix", tokens)
    tables = model.tables(tokens)
    expected = model.fill("prefix", tables, hashes)
    start(engine, "writer", hashes, tables)
    engine.save_request("writer", tokens)
    assert engine.drain(5)
    engine.finish(["writer"])
    return model, backend, engine, hashes, expected


def failed_blocks(engine: WorkerCore) -> set[int]:
    """The blocks to report invalid (one full-attention group: the engine recomputes from the first)."""
    failures = engine.take_load_failures()
    assert failures.failed_requests == set()
    return failures.invalid_blocks


def hold_reads(backend: RecordingBackend, release: threading.Event, entered: threading.Event | None = None) -> None:
    """Every read of `backend` waits for `release`, as in a pool whose master stopped answering."""
    original = backend.get_into

    def held(keys: Sequence[str], dests: Value) -> list[Status]:
        if entered is not None:
            entered.set()
        assert release.wait(10)
        return original(keys, dests)

    backend.get_into = held  # type: ignore[method-assign]


def start_held_load(
    closing: list[WorkerCore],
) -> tuple[FakeModel, RecordingBackend, WorkerCore, tuple[list[int], ...], threading.Event]:
    """A 128-token prefix saved, then a load of it started whose read waits in the pool for the event
    returned (set it to let the read return)."""
    model, backend, engine, hashes, _ = saved_prefix(closing)
    release, entered = threading.Event(), threading.Event()
    hold_reads(backend, release, entered)
    tables = model.tables(144)
    delta = RequestDelta("reader", new_hashes=hashes, new_blocks=tables, num_prompt_tokens=144)
    delta.load = LoadSpec(0, 128)
    engine.apply([delta])
    assert entered.wait(5)
    return model, backend, engine, tables, release


def load_request(
    engine: WorkerCore,
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


def test_load_fills_blocks_with_stored_bytes(closing: list[WorkerCore]) -> None:
    model, _, engine, hashes, expected = saved_prefix(closing)
    tables = load_request(engine, model, "reader", hashes, 0, 128)
    assert failed_blocks(engine) == set()
    assert engine.take_finished_loads() == {"reader"}
    for chunk in range(8):
        assert model.read(0, tables[0][chunk]) == expected[model.key(0, hashes, chunk)]
    assert model.read(0, tables[0][8]) == bytes(16)  # beyond the hit: untouched
    assert engine.stats.chunks_loaded == 8


def test_load_skips_the_locally_cached_prefix(closing: list[WorkerCore]) -> None:
    model, _, engine, hashes, expected = saved_prefix(closing)
    tables = load_request(engine, model, "reader", hashes, 48, 96)
    for chunk in range(6):
        value = model.read(0, tables[0][chunk])
        assert value == (expected[model.key(0, hashes, chunk)] if chunk >= 3 else bytes(16))
    assert failed_blocks(engine) == set()


def test_load_of_a_missing_chunk_reports_its_block(closing: list[WorkerCore]) -> None:
    model, backend, engine, hashes, _ = saved_prefix(closing)
    backend.remove([model.key(0, hashes, 2)])
    tables = load_request(engine, model, "reader", hashes, 0, 128)
    assert failed_blocks(engine) == {tables[0][2]}
    assert engine.take_finished_loads() == {"reader"}
    assert failed_blocks(engine) == set()


def test_load_with_a_wrong_stored_size_reports_its_block(closing: list[WorkerCore]) -> None:
    model, backend, engine, hashes, _ = saved_prefix(closing)
    key = model.key(0, hashes, 5)
    backend.remove([key])
    backend.inner.put([key], [[np.zeros(3, dtype=np.uint8)]])
    tables = load_request(engine, model, "reader", hashes, 0, 128)
    assert failed_blocks(engine) == {tables[0][5]}
    assert engine.take_finished_loads() == {"reader"}


def test_load_backend_exception_reports_exactly_the_unloaded_blocks(closing: list[WorkerCore]) -> None:
    model, backend, engine, hashes, expected = saved_prefix(closing, config=WorkerConfig(put_batch_chunks=2))
    backend.get_raises_on = {2}  # the second batch (chunks 2, 3) raises; later batches are not tried
    tables = load_request(engine, model, "reader", hashes, 0, 128)
    assert failed_blocks(engine) == set(tables[0][2:8])
    assert engine.take_finished_loads() == {"reader"}
    for chunk in (0, 1):
        assert model.read(0, tables[0][chunk]) == expected[model.key(0, hashes, chunk)]


def test_load_from_an_unhealthy_backend_fails_every_block(closing: list[WorkerCore]) -> None:
    model, backend, engine, hashes, _ = saved_prefix(closing)
    backend.is_healthy = False
    tables = load_request(engine, model, "reader", hashes, 32, 128)
    assert failed_blocks(engine) == set(tables[0][2:8])
    assert engine.take_finished_loads() == {"reader"}


def test_load_without_hashes_fails_the_uncovered_blocks(closing: list[WorkerCore]) -> None:
    model, _, engine, hashes, _ = saved_prefix(closing)
    tables = load_request(engine, model, "reader", hashes[:5], 32, 128)
    assert failed_blocks(engine) == set(tables[0][5:8])
    assert engine.take_finished_loads() == {"reader"}
    # fewer hashes than the local prefix: the locally computed blocks are not reported
    tables = load_request(engine, model, "reader2", hashes[:1], 32, 128)
    assert failed_blocks(engine) == set(tables[0][2:8])


def test_hybrid_load_uses_the_load_mask_and_skips_null_blocks(closing: list[WorkerCore]) -> None:
    kinds = [FullAttention(32), SlidingWindow(16, 17)]
    model, backend, engine, hashes, expected = saved_prefix(closing, kinds=kinds, tokens=128)
    tables = model.tables(160)
    tables[1][:6] = [0] * 6  # window blocks outside the window are null in the engine's table
    backend.remove([model.key(1, hashes, 7)])  # the one window chunk a hit at 128 needs
    tables = load_request(engine, model, "reader", hashes, 0, 128, tables)
    assert engine.stats.chunks_load_failed == 1  # only the removed window chunk
    # block ids are per group: the whole request is recomputed
    assert engine.take_load_failures().failed_requests == {"reader"}
    for chunk in range(4):
        assert model.read(0, tables[0][chunk]) == expected[model.key(0, hashes, chunk)]
    assert model.read(1, tables[1][6]) == bytes(16)  # not required by a hit at 128: not loaded
    assert engine.take_finished_loads() == {"reader"}


def test_a_hybrid_models_groups_load_in_one_get_per_batch(closing: list[WorkerCore]) -> None:
    """One chunk size for every group (vLLM's hybrid page size): a batch is one get, not one per group,
    and a chunk missing from one group fails only itself."""
    kinds = [FullAttention(16), SlidingWindow(16, 1000)]
    model, backend, engine, hashes, expected = saved_prefix(closing, kinds=kinds, tokens=64)
    backend.remove([model.key(1, hashes, 3)])
    calls = backend.get_calls
    tables = load_request(engine, model, "reader", hashes, 0, 64)
    assert backend.get_calls == calls + 1
    assert engine.stats.chunks_load_failed == 1 and engine.stats.chunks_loaded == 7
    for group in range(2):
        for chunk in range(4 - group):
            assert model.read(group, tables[group][chunk]) == expected[model.key(group, hashes, chunk)]
    assert model.read(1, tables[1][3]) == bytes(len(expected[model.key(1, hashes, 3)]))  # never written
    assert engine.take_finished_loads() == {"reader"}


@pytest.mark.parametrize(
    ("kind", "hit", "resumable"),
    [
        (FullAttention(16), 256, True),
        (SlidingWindow(16, 64), 256, False),
        (ChunkedLocal(16, 64), 240, False),  # a hit at 240 needs the local chunk's blocks 12-14
    ],
)
def test_a_failed_chunk_is_recomputed_from_where_every_earlier_block_is_real(
    closing: list[WorkerCore], kind: AttentionKind, hit: int, resumable: bool
) -> None:
    """The issue's worked case: window 64, block 16, a hit of 256 tokens, chunk 14 missing at load time.
    Resuming at token 224 needs blocks 10-13, but 10 and 11 were null at allocation and never loaded.
    Only a model that keeps every block may resume at the failed chunk; any other recomputes it all."""
    model, backend, engine, hashes, _ = saved_prefix(closing, kinds=[kind], tokens=256)
    tables = model.tables(272)
    first_live = kind.first_live_chunk(hit)
    tables[0][:first_live] = [0] * first_live  # what vLLM allocates for the hit: null below the window
    backend.remove([model.key(0, hashes, 14)])
    tables = load_request(engine, model, "reader", hashes, 0, hit, tables)
    failures = engine.take_load_failures()
    if resumable:
        assert failures == type(failures)({tables[0][14]}, set())
    else:
        assert failures == type(failures)(set(), {"reader"})
    assert engine.take_finished_loads() == {"reader"}


def test_a_failed_load_lowers_the_stored_mark(closing: list[WorkerCore]) -> None:
    """The request starts believing the pool holds its hit; what failed to load is not there, so its
    next save must cover it again (and skip what did arrive)."""
    model, backend, engine, hashes, _ = saved_prefix(closing, tokens=128)
    backend.remove([model.key(0, hashes, c) for c in (5, 6)])
    tables = load_request(engine, model, "reader", hashes, 0, 128)
    assert engine.stored_tokens("reader") == 80
    model.fill("reader", tables, hashes)  # the engine recomputes the failed chunks
    examined = len(backend.exists_keys)
    engine.save_request("reader", 128, computed_before=80)
    assert engine.drain(5)
    assert backend.exists_keys[examined:] == [model.key(0, hashes, c) for c in (5, 6, 7)]
    assert backend.inner.exists([model.key(0, hashes, c) for c in (5, 6)]) == [True, True]
    assert engine.stored_tokens("reader") == 128


def test_every_load_is_reported_finished_once(closing: list[WorkerCore]) -> None:
    model, backend, engine, hashes, _ = saved_prefix(closing)
    gate = threading.Event()
    hold_reads(backend, gate)
    for req in ("a", "b"):
        delta = RequestDelta(req, new_hashes=hashes, new_blocks=model.tables(144), num_prompt_tokens=144)
        delta.load = LoadSpec(0, 128)
        engine.apply([delta])
    assert engine.take_finished_loads() == set()  # still loading
    gate.set()
    assert engine.drain(5)
    assert engine.take_finished_loads() == {"a", "b"}
    assert engine.take_finished_loads() == set()


def test_sync_loads_finish_inside_apply(closing: list[WorkerCore]) -> None:
    model, _, engine, hashes, expected = saved_prefix(closing, config=WorkerConfig(sync_loads=True))
    engine.close()  # no loader thread: the load must run in the caller
    tables = model.tables(144)
    engine.apply(
        [RequestDelta("reader", new_hashes=hashes, new_blocks=tables, num_prompt_tokens=144, load=LoadSpec(0, 128))]
    )
    assert engine.take_finished_loads() == {"reader"}
    assert failed_blocks(engine) == set()
    for chunk in range(8):
        assert model.read(0, tables[0][chunk]) == expected[model.key(0, hashes, chunk)]


def test_a_read_stuck_in_a_hung_pool_is_given_up_and_never_lands(closing: list[WorkerCore]) -> None:
    """A remote pool's read blocks (a stopped master); once the pool reports itself unhealthy (its breaker
    tripped on the overrun) the load is reported failed at once, and when the read finally returns its
    bytes land in the load's own buffer, never in the engine's blocks, which it may have reused."""
    model, backend, engine, tables, release = start_held_load(closing)
    assert engine.take_finished_loads() == set()  # the pool still looks healthy: the load waits
    backend.is_healthy = False
    began = time.monotonic()
    while not engine.take_finished_loads():
        assert time.monotonic() - began < 2.0, "the load kept waiting on a pool that reported itself unhealthy"
        time.sleep(0.01)
    assert failed_blocks(engine) == set(tables[0][:8])
    for block_id in tables[0][:8]:
        model.poison(block_id)  # the engine recomputes into these blocks (or hands them to another request)
    release.set()
    assert engine.drain(5)
    time.sleep(0.1)  # the abandoned read has returned by now
    assert all(model.read(0, block_id) == bytes([POISON]) * 16 for block_id in tables[0][:8])


def test_a_loads_host_buffers_are_reused_by_the_next_load_once_committed(closing: list[WorkerCore]) -> None:
    """Fresh memory costs its page faults inside the read: the buffers a load read into are kept once its
    bytes are committed, and the next load reads into them, with the right bytes each time."""
    model, _, engine, hashes, expected = saved_prefix(closing)
    buffers = engine.loads.loader.buffers
    for reader in ("first", "second"):
        tables = load_request(engine, model, reader, hashes, 0, 128)
        assert engine.take_finished_loads() == {reader} and failed_blocks(engine) == set()
        assert all(model.read(0, tables[0][c]) == expected[model.key(0, hashes, c)] for c in range(8))
        assert buffers.kept_bytes > 0
        engine.finish([reader])
    assert buffers.reused >= 1


def test_a_buffer_a_hung_read_still_holds_is_kept_only_once_the_read_returns(closing: list[WorkerCore]) -> None:
    """A load given up while its read hangs leaves its buffer to the read: no other load is handed it
    until the read has returned (it would write that load's bytes)."""
    model, backend, engine, hashes, _ = saved_prefix(closing)
    buffers = engine.loads.loader.buffers
    release, entered = threading.Event(), threading.Event()
    hold_reads(backend, release, entered)
    tables = model.tables(144)
    engine.apply([RequestDelta("hung", new_hashes=hashes, new_blocks=tables, num_prompt_tokens=144)])
    engine.apply([RequestDelta("hung", load=LoadSpec(0, 128))])
    assert entered.wait(5)
    backend.is_healthy = False
    began = time.monotonic()
    while not engine.take_finished_loads():
        assert time.monotonic() - began < 2.0
        time.sleep(0.01)
    assert buffers.kept_bytes == 0, "given back while the read could still write it"
    release.set()
    began = time.monotonic()
    while buffers.kept_bytes == 0:
        assert time.monotonic() - began < 5.0, "the buffer was never kept after its read returned"
        time.sleep(0.01)


def test_loads_queued_behind_reads_stuck_in_a_hung_pool_are_failed_with_them(closing: list[WorkerCore]) -> None:
    """More loads than call threads, every read stuck: once the pool reports itself unhealthy, the
    running and the queued loads are all reported failed, and none lands when the reads return."""
    model, backend, engine, hashes, _ = saved_prefix(closing)
    release = threading.Event()
    hold_reads(backend, release)
    requests = [f"r{index}" for index in range(CALL_THREADS + 2)]
    tables = {}
    for req in requests:
        tables[req] = model.tables(144)
        delta = RequestDelta(req, new_hashes=hashes, new_blocks=tables[req], num_prompt_tokens=144)
        delta.load = LoadSpec(0, 128)
        engine.apply([delta])
    backend.is_healthy = False
    finished: set[str] = set()
    began = time.monotonic()
    while finished != set(requests):
        assert time.monotonic() - began < 2.0, f"still waiting for {set(requests) - finished}"
        finished |= engine.take_finished_loads()
        time.sleep(0.01)
    loading = {block for req in requests for block in tables[req][0][:8]}
    assert failed_blocks(engine) == loading
    for block in loading:
        model.poison(block)  # the engine recomputes into these blocks (or hands them to another request)
    release.set()
    time.sleep(0.2)  # the abandoned reads have returned by now
    assert all(model.read(0, block) == bytes([POISON]) * 16 for block in loading)


@pytest.mark.parametrize("sync_loads", [True, False])
def test_a_load_with_a_missing_chunk_is_reported_finished_with_its_failed_blocks(
    closing: list[WorkerCore], sync_loads: bool
) -> None:
    """Every load is one the engine waits for: it is reported finished whatever failed, in the same
    output as (or after) the failed blocks, so the engine never computes on a block nobody wrote."""
    model, backend, engine, hashes, _ = saved_prefix(closing, config=WorkerConfig(sync_loads=sync_loads))
    backend.remove([model.key(0, hashes, 5)])
    tables = load_request(engine, model, "r", hashes, 0, 128)
    assert failed_blocks(engine) == {tables[0][5]}
    assert engine.take_finished_loads() == {"r"}
    engine.save([RequestDelta("r", save_tokens=144, computed_before=80)])  # the recompute from chunk 5
    assert engine.drain(5)
    assert model.key(0, hashes, 5) in backend.put_keys


def test_a_load_for_a_request_the_worker_holds_no_table_of_is_reported_failed(closing: list[WorkerCore]) -> None:
    """Never silently: a dropped load is a request the engine waits for forever."""
    _, _, engine, _, _ = saved_prefix(closing)
    engine.apply([RequestDelta("stranger", load=LoadSpec(0, 128))])  # no first delta: no table here
    assert engine.take_finished_loads() == {"stranger"}
    assert engine.take_load_failures().failed_requests == {"stranger"}


def test_a_load_the_scheduler_could_not_arm_is_reported_finished_and_failed(closing: list[WorkerCore]) -> None:
    _, _, engine, _, _ = saved_prefix(closing)
    engine.handle_step(StepMetadata(failed_loads=["lost"]))
    assert engine.take_finished_loads() == {"lost"}
    failures = engine.take_load_failures()
    assert failures.failed_requests == {"lost"} and failures.invalid_blocks == set()


def test_an_exception_while_storing_ends_every_batch_so_no_request_is_kept(
    closing: list[WorkerCore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever raises between a batch's capture and its end, its ranges end: the request's state goes
    once it finishes, and its next save retries the range."""
    model, _, engine = simple(closing, config=WorkerConfig(sync_saves=False))
    hashes = model.hashes("p", 64)
    tables = model.tables(64)
    model.fill("p", tables, hashes)
    start(engine, "r", hashes, tables)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("scripted failure after the put")

    monkeypatch.setattr(engine.saves, "_report", broken)
    engine.save_request("r", 64)
    assert engine.drain(5)
    monkeypatch.undo()
    engine.save_request("r", 64)  # re-planned: the failed range was ended, not left in flight
    assert engine.drain(5)
    assert engine.stored_tokens("r") == 64
    engine.finish(["r"])
    assert engine.active_requests() == 0
