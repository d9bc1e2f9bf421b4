"""A reset nothing resurrects, and DRAM that counts what it holds: the worker and the tiered pool fence
every read in flight at a reset (a read that started before it never stores, promotes or reports what it
read), and a disk hit promoted into DRAM holds no more than DRAM counts (real files, real threads)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvpool.backends.base import Status
from kvpool.backends.disk import DiskTier
from kvpool.backends.memory import MemoryBackend
from kvpool.backends.tiered import TieredPool
from kvpool.core.metadata import LoadSpec, RequestDelta
from test_loads import failed_blocks, saved_prefix, start_held_load
from worker_fakes import POISON

PREFIX = "kvp1/tiny/0123456789abcdef/s0/p0/g0/"


def key(i: int) -> str:
    return f"{PREFIX}{i:032x}"


def value(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def _written(directory: Path, count: int, size: int, pools: list[TieredPool], direct: bool = False) -> TieredPool:
    """A tier whose disk holds `count` chunks and whose DRAM holds none (an engine restarted on it)."""
    first = TieredPool(MemoryBackend(64 << 20), DiskTier(str(directory), 64 << 20, direct=direct))
    pools.append(first)
    assert first.put([key(i) for i in range(count)], [[value(i, size)] for i in range(count)]) == [Status.OK] * count
    assert first.flush(10.0)
    first.shutdown(5.0)
    disk = DiskTier(str(directory), 64 << 20, direct=direct)
    if direct and not disk.direct:
        pytest.skip(f"{directory} is on a file system that refuses O_DIRECT (tmpfs?)")
    pool = TieredPool(MemoryBackend(64 << 20), disk)
    pools.append(pool)
    assert len(pool.disk.keys()) == count and pool.memory.keys() == []
    return pool


def test_a_disk_read_overtaken_by_a_clear_promotes_nothing_and_reports_no_hit(tmp_path, pools) -> None:
    """The race of issue 42 item 3: a load reads disk files, the pool is emptied (a reset), then the reads
    return. They must answer as failed (recomputed) and leave nothing in DRAM, on disk, or in the
    directory a restart scans; before the fence they were promoted back into DRAM and written to disk."""
    pool = _written(tmp_path / "kv", 4, 4096, pools)
    entered, release = threading.Event(), threading.Event()
    read = pool.disk.read

    def slow_read(k: str) -> np.ndarray | Status:
        got = read(k)  # the file is read; the reply is slow to come back
        entered.set()
        assert release.wait(10)
        return got

    pool.disk.read = slow_read  # type: ignore[method-assign]
    dests = [[np.zeros(4096, dtype=np.uint8)] for _ in range(4)]
    results: list[list[Status]] = []
    reader = threading.Thread(target=lambda: results.append(pool.get_into([key(i) for i in range(4)], dests)))
    reader.start()
    assert entered.wait(5)
    time.sleep(0.05)  # the other reads have read their files too
    assert pool.clear() == 4  # the reset, while every read is still on its way back
    release.set()
    reader.join(10)
    assert results == [[Status.UNAVAILABLE] * 4]
    assert pool.flush(10.0)
    assert pool.memory.keys() == [] and pool.disk.keys() == [] and pool.keys() == []
    assert pool.tier_stats().writes_queued == 0, "a read from before the reset was queued for the disk"
    restarted = DiskTier(str(tmp_path / "kv"), 64 << 20)
    assert restarted.keys() == []


def test_a_reset_reports_every_load_still_reading_failed_and_its_bytes_never_land(closing) -> None:
    """WorkerCore.reset while a load's read is in the pool: the load is reported finished at once, every
    block failed (the engine recomputes them), and when the read returns, its bytes (from before the
    reset) reach no engine block."""
    model, _, engine, tables, release = start_held_load(closing)
    engine.reset(1, wait_s=0.5)
    began = time.monotonic()
    while not engine.take_finished_loads():
        assert time.monotonic() - began < 2.0, "a load from before the reset kept running"
        time.sleep(0.01)
    assert failed_blocks(engine) == set(tables[0][:8])
    for block_id in tables[0][:8]:
        model.poison(block_id)
    release.set()
    assert engine.drain(5)
    time.sleep(0.1)
    assert all(model.read(0, block_id) == bytes([POISON]) * 16 for block_id in tables[0][:8])


def test_a_load_read_before_a_reset_but_not_yet_reported_is_reported_failed(closing) -> None:
    """A load whose reads all returned before the reset, still waiting for the engine's thread to commit
    and report it: its bytes are as old, so it too is reported failed as a whole."""
    model, _, engine, hashes, _ = saved_prefix(closing)
    tables = model.tables(144)
    delta = RequestDelta("reader", new_hashes=hashes, new_blocks=tables, num_prompt_tokens=144)
    delta.load = LoadSpec(0, 128)
    engine.apply([delta])
    began = time.monotonic()
    while not engine.loads.loader._to_commit and not engine.loads.loader._finished:
        assert time.monotonic() - began < 5.0
        time.sleep(0.005)
    engine.reset(1, wait_s=0.5)
    assert engine.take_finished_loads() == {"reader"}
    assert failed_blocks(engine) == set(tables[0][:8])


@pytest.mark.parametrize("disk_io", ["buffered", "direct"])
def test_promoted_disk_hits_hold_no_more_than_dram_counts(tmp_path, pools, disk_io) -> None:
    """Small chunks (1000 bytes: a 4 KiB page each with O_DIRECT, plus the header and the alignment) read
    from disk into a DRAM of 10 chunks: the arrays DRAM keeps, counted by the memory they keep alive,
    never exceed its capacity by more than one chunk, and each holds exactly its value."""
    size, count = 1000, 40
    pool = _written(tmp_path / "kv", count, size, pools, direct=disk_io == "direct")
    pool.memory.capacity_bytes = 10 * size  # DRAM as small as the test needs, set before any hit
    for i in range(count):
        dest = np.zeros(size, dtype=np.uint8)
        assert pool.get_into([key(i)], [[dest]]) == [Status.OK]
        assert np.array_equal(dest, value(i, size))
        held = sum(held_nbytes(array) for array in pool.memory._items.values())
        assert held <= pool.memory.capacity_bytes + size, (i, held)
    assert pool.tier_stats().promoted == count
    assert len(pool.memory.keys()) == 10
    assert all(held_nbytes(array) == size for array in pool.memory._items.values())


def held_nbytes(array: np.ndarray) -> int:
    """The memory an array keeps alive: the allocation at the root of its views."""
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    return int(root.nbytes)
