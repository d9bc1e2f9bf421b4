"""Issue 43 item 4: no unbounded wait for a load. A load on the loader's threads still reading
`load_deadline_s` after it started is reported finished and failed once (its blocks recomputed), and
nothing it reads reaches an engine block after that report, whether its read returns late or never;
loads queued behind stuck calls are failed at their own deadline; a healthy load is untouched."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from kvpool.backends.base import Status, Value
from kvpool.core.config import DEFAULT_LOAD_DEADLINE_S, KVPoolConfig
from kvpool.core.errors import ConfigError
from kvpool.core.metadata import LoadSpec, RequestDelta
from kvpool.worker.loader import CALL_THREADS
from kvpool.worker.worker_core import WorkerConfig, WorkerCore
from test_loads import failed_blocks, hold_reads, saved_prefix
from worker_fakes import POISON, RecordingBackend

DEADLINE_S = 0.2
BOUND_S = 5.0  # generous: a failed load is reported within the deadline plus a watchdog poll, not this


def slow_reads(backend: RecordingBackend, delay_s: float, entered: threading.Event) -> None:
    """Every read of `backend` returns its bytes, but only after `delay_s` (a slow disk)."""
    original = backend.get_into

    def slow(keys: Sequence[str], dests: Value) -> list[Status]:
        entered.set()
        time.sleep(delay_s)
        return original(keys, dests)

    backend.get_into = slow  # type: ignore[method-assign]


def start_load(engine: WorkerCore, tables: tuple[list[int], ...], hashes: list[bytes], req: str) -> None:
    delta = RequestDelta(req, new_hashes=hashes, new_blocks=tables, num_prompt_tokens=144)
    delta.load = LoadSpec(0, 128)
    engine.apply([delta])


def wait_finished(engine: WorkerCore, requests: set[str]) -> float:
    """Steps the engine's side until every request's load is reported; the seconds it took."""
    began = time.monotonic()
    finished: set[str] = set()
    while finished != requests:
        assert time.monotonic() - began < BOUND_S, f"still waiting for {requests - finished}: no deadline"
        got = engine.take_finished_loads()
        assert not got & finished, f"reported twice: {got & finished}"
        finished |= got
        time.sleep(0.005)
    return time.monotonic() - began


def test_a_read_stuck_past_the_deadline_is_failed_once_and_never_lands(closing) -> None:
    """The pool stays healthy (no breaker trips), its read never returns until released: at the deadline
    the load is reported finished, every block failed, counted once; the read that returns afterwards
    writes none of the blocks the engine has meanwhile recomputed into."""
    model, backend, engine, hashes, _ = saved_prefix(closing, config=WorkerConfig(load_deadline_s=DEADLINE_S))
    release, entered = threading.Event(), threading.Event()
    hold_reads(backend, release, entered)
    tables = model.tables(144)
    start_load(engine, tables, hashes, "stuck")
    assert entered.wait(5)
    waited = wait_finished(engine, {"stuck"})
    assert waited >= DEADLINE_S * 0.5  # not failed before its deadline (the start took part of it)
    assert failed_blocks(engine) == set(tables[0][:8])
    assert engine.stats.loads_timed_out == 1 and engine.stats.chunks_load_failed == 8
    for block_id in tables[0][:8]:
        model.poison(block_id)  # the engine recomputes into these blocks (or hands them to another request)
    release.set()
    assert engine.drain(5)
    time.sleep(0.1)  # the abandoned read has returned by now
    assert engine.take_finished_loads() == set() and failed_blocks(engine) == set()  # reported once
    assert all(model.read(0, block_id) == bytes([POISON]) * 16 for block_id in tables[0][:8])
    assert engine.stats.loads_timed_out == 1 and engine.stats.chunks_loaded == 0


def test_a_slow_read_that_completes_after_the_deadline_writes_nothing(closing) -> None:
    """A slowed backend whose reads do return, 3x the deadline late: reported failed at the deadline, and
    the late completion lands nowhere (its bytes are not even counted loaded)."""
    model, backend, engine, hashes, _ = saved_prefix(closing, config=WorkerConfig(load_deadline_s=DEADLINE_S))
    entered = threading.Event()
    slow_reads(backend, 3 * DEADLINE_S, entered)
    tables = model.tables(144)
    start_load(engine, tables, hashes, "slow")
    wait_finished(engine, {"slow"})
    assert failed_blocks(engine) == set(tables[0][:8])
    for block_id in tables[0][:8]:
        model.poison(block_id)
    began = time.monotonic()
    while backend.get_calls == 0 or time.monotonic() - began < 4 * DEADLINE_S:
        assert engine.take_finished_loads() == set()
        time.sleep(0.01)
    assert engine.drain(5)
    assert all(model.read(0, block_id) == bytes([POISON]) * 16 for block_id in tables[0][:8])
    assert engine.stats.loads_timed_out == 1 and engine.stats.chunks_loaded == 0


def test_loads_queued_behind_stuck_calls_fail_at_their_deadline(closing) -> None:
    """More loads than call threads, every read stuck in a pool that still looks healthy: the loads in a
    call and those queued behind them are each reported failed by their deadline, and none lands when
    the reads return."""
    model, backend, engine, hashes, _ = saved_prefix(closing, config=WorkerConfig(load_deadline_s=DEADLINE_S))
    release = threading.Event()
    hold_reads(backend, release)
    requests = {f"r{index}" for index in range(CALL_THREADS + 2)}
    tables = {req: model.tables(144) for req in sorted(requests)}
    for req in sorted(requests):
        start_load(engine, tables[req], hashes, req)
    wait_finished(engine, requests)
    loading = {block for req in requests for block in tables[req][0][:8]}
    assert failed_blocks(engine) == loading
    assert engine.stats.loads_timed_out == len(requests)
    for block in loading:
        model.poison(block)
    release.set()
    assert engine.drain(5)
    time.sleep(0.2)  # the abandoned reads (and the queued loads they held up) have run by now
    assert all(model.read(0, block) == bytes([POISON]) * 16 for block in loading)
    assert engine.take_finished_loads() == set()


def test_a_healthy_load_inside_the_deadline_loads_and_counts_no_timeout(closing) -> None:
    model, backend, engine, hashes, expected = saved_prefix(closing, config=WorkerConfig(load_deadline_s=2.0))
    entered = threading.Event()
    slow_reads(backend, 0.05, entered)  # slow, but well inside the deadline
    tables = model.tables(144)
    start_load(engine, tables, hashes, "ok")
    wait_finished(engine, {"ok"})
    assert failed_blocks(engine) == set()
    assert all(model.read(0, tables[0][c]) == expected[model.key(0, hashes, c)] for c in range(8))
    assert engine.stats.loads_timed_out == 0 and engine.stats.chunks_loaded == 8


def test_a_reset_after_a_timeout_reports_nothing_twice(closing) -> None:
    """The deadline and the reset fence settle through the same once-only step: a load the deadline
    failed is not fenced (nor counted) again."""
    model, backend, engine, hashes, _ = saved_prefix(closing, config=WorkerConfig(load_deadline_s=DEADLINE_S))
    release = threading.Event()
    hold_reads(backend, release)
    tables = model.tables(144)
    start_load(engine, tables, hashes, "stuck")
    wait_finished(engine, {"stuck"})
    assert failed_blocks(engine) == set(tables[0][:8])
    assert engine.loads.loader.fence() == 0
    assert engine.take_finished_loads() == set() and failed_blocks(engine) == set()
    release.set()
    assert engine.drain(5)


def test_the_setting_reaches_the_loader_and_its_count_reaches_metrics() -> None:
    pytest.importorskip("vllm")
    from kvpool.connector.roles import worker_config
    from kvpool.integrations.vllm.metrics import WORKER_COUNTERS, WorkerStatsSampler, prometheus_name

    assert KVPoolConfig().load_deadline_s == DEFAULT_LOAD_DEADLINE_S == WorkerConfig().load_deadline_s
    assert worker_config(KVPoolConfig.from_dict({"load_deadline_s": 1.5})).load_deadline_s == 1.5
    assert "loads_timed_out" in {spec.key for spec in WORKER_COUNTERS}
    assert prometheus_name("loads_timed_out") == "vllm:kvpool_loads_timed_out"

    class Stats:
        pass

    stats = Stats()
    for spec in WORKER_COUNTERS:
        setattr(stats, spec.source, 0)
    sampler = WorkerStatsSampler(stats)
    stats.loads_timed_out = 2  # type: ignore[attr-defined]
    taken = sampler.take()
    assert taken is not None and taken.counters == {"loads_timed_out": 2}


@pytest.mark.parametrize("value", [0, -1, "30", True, None, 3601, float("nan")])
def test_a_bad_load_deadline_is_refused_naming_key_value_and_range(value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        KVPoolConfig.from_dict({"load_deadline_s": value})
    message = str(caught.value)
    assert "'load_deadline_s'" in message and repr(value) in message and "above 0, at most 3600" in message


@pytest.mark.parametrize("value", [0.05, 1, 30.0, 3600])
def test_a_good_load_deadline_is_kept(value: float) -> None:
    assert KVPoolConfig.from_dict({"load_deadline_s": value}).load_deadline_s == value
