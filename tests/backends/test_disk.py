"""The embedded pool's disk tier: write-behind, reads from both tiers, restarts, and every file-system
fault answered by a miss, never a wrong byte (real files; faults injected at the file-system calls,
and on a real full or read-only mount where this machine lets a test mount one)."""

from __future__ import annotations

import errno
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvpool.backends.base import Status
from kvpool.backends.disk import DiskTier
from kvpool.backends.disk_file import HEADER_BYTES, MAGIC, PAGE, SUFFIX, stored_links
from kvpool.backends.factory import create_backend
from kvpool.backends.memory import MemoryBackend
from kvpool.backends.shared_pools import drop_shared_tiered_pools
from kvpool.backends.tiered import TieredPool
from kvpool.core.config import KVPoolConfig
from kvpool.core.errors import ConfigError
from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.scheduler.index import PoolIndex
from kvpool.worker.pool_tracker import PoolTracker

CHUNK = 4096
PREFIX = "kvp1/tiny/0123456789abcdef/s0/p0/g0/"


def key(i: int) -> str:
    return f"{PREFIX}{i:032x}"


def value(i: int, size: int = CHUNK) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def read(pool: TieredPool | DiskTier, i: int, size: int = CHUNK) -> tuple[Status, np.ndarray]:
    if isinstance(pool, DiskTier):
        got = pool.read(key(i))
        return (got, np.empty(0, np.uint8)) if isinstance(got, Status) else (Status.OK, got)
    dest = np.zeros(size, dtype=np.uint8)
    return pool.get_into([key(i)], [[dest]])[0], dest


def tiered(directory: Path, dram_chunks: int, disk_chunks: int = 64, **kwargs: float) -> TieredPool:
    disk = DiskTier(str(directory), disk_chunks * (CHUNK + HEADER_BYTES + len(key(0))))
    return TieredPool(MemoryBackend(dram_chunks * CHUNK), disk, **kwargs)  # type: ignore[arg-type]


def files(directory: Path, suffix: str = SUFFIX) -> list[Path]:
    return [path for path in directory.rglob(f"*{suffix}")]


def test_chunks_evicted_from_dram_are_read_back_from_disk_byte_for_byte(tmp_path, pools) -> None:
    pool = tiered(tmp_path, dram_chunks=2)
    pools.append(pool)
    dropped: list[str] = []
    pool.add_listener(dropped.extend)
    for i in range(8):
        assert pool.put([key(i)], [[value(i)]]) == [Status.OK]
    assert pool.flush(10.0)
    assert len(files(tmp_path)) == 8
    assert pool.memory.exists([key(0)]) == [False], "DRAM holds 2 chunks"
    assert pool.exists([key(i) for i in range(9)]) == [True] * 8 + [False]
    for i in range(8):
        status, got = read(pool, i)
        assert status is Status.OK and np.array_equal(got, value(i))
    assert pool.tier_stats().disk_hits >= 6
    assert dropped == [], "nothing left both tiers"
    assert read(pool, 99)[0] is Status.MISSING


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_the_writer_runs_at_the_lowest_cpu_priority_and_the_engine_thread_keeps_its_own(tmp_path, pools) -> None:
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pool = tiered(tmp_path, dram_chunks=4)
    pools.append(pool)
    pool.put([key(0)], [[value(0)]])
    assert pool.flush(10.0)
    assert pool.writer_nice == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own, "only the writer's thread"


def test_a_put_never_waits_for_the_disk_and_a_full_queue_skips_the_write(tmp_path, pools, monkeypatch) -> None:
    disk = DiskTier(str(tmp_path), 1 << 30)
    gate = threading.Event()
    real_write = disk.write
    monkeypatch.setattr(disk, "write", lambda k, p, link=None: (gate.wait(10), real_write(k, p, link))[1])
    pool = TieredPool(MemoryBackend(64 * CHUNK), disk, write_queue_bytes=3 * CHUNK)
    pools.append(pool)
    start = time.perf_counter()
    for i in range(10):
        pool.put([key(i)], [[value(i)]])
    assert time.perf_counter() - start < 5.0
    stats = pool.tier_stats()
    assert stats.writes_skipped >= 6 and stats.writes_queued <= 4
    gate.set()
    assert pool.flush(10.0)
    assert 1 <= len(files(tmp_path)) <= 4


def test_an_array_evicted_while_its_write_is_pending_is_never_reused_for_another_value(tmp_path, pools) -> None:
    disk = DiskTier(str(tmp_path), 1 << 30)
    gate = threading.Event()
    real_write = disk.write
    disk.write = lambda k, p, link=None: (gate.wait(10), real_write(k, p, link))[1]  # type: ignore[method-assign]
    pool = TieredPool(MemoryBackend(2 * CHUNK), disk, write_queue_bytes=64 * CHUNK)
    pools.append(pool)
    for i in range(12):  # each put evicts an older chunk whose write still waits
        pool.put([key(i)], [[value(i)]])
    gate.set()
    assert pool.flush(10.0)
    fresh = DiskTier(str(tmp_path), 1 << 30)
    for i in range(12):
        status, got = read(fresh, i)
        assert status is Status.OK and np.array_equal(got, value(i)), f"chunk {i} holds another value's bytes"


def test_a_restarted_pool_finds_what_the_previous_one_left_and_drops_interrupted_writes(tmp_path, pools) -> None:
    pool = tiered(tmp_path, dram_chunks=64)
    for i in range(6):
        pool.put([key(i)], [[value(i)]])
    pool.shutdown(10.0)
    (tmp_path / "kvp1" / "left.123.456.tmp").write_bytes(b"half a chunk")
    again = tiered(tmp_path, dram_chunks=64)
    pools.append(again)
    assert sorted(again.keys()) == [key(i) for i in range(6)]
    assert files(tmp_path, ".tmp") == []
    assert again.disk.stats().removed_at_scan == 1
    for i in range(6):
        status, got = read(again, i)
        assert status is Status.OK and np.array_equal(got, value(i))
    assert sorted(stored_links(str(tmp_path))) == [key(i) for i in range(6)]


def _file_of(directory: Path, i: int) -> Path:
    return directory.joinpath(*key(i).split("/")).with_suffix(SUFFIX)


@pytest.mark.parametrize(
    "harm",
    ["truncated", "one byte flipped", "header edited", "link edited", "another chunk's file", "empty"],
)
def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path, harm) -> None:
    disk = DiskTier(str(tmp_path), 1 << 20)
    for i in range(2):
        assert disk.write(key(i), [value(i)], link=bytes([i]) * 8) is Status.OK
    path, data = _file_of(tmp_path, 0), bytearray(_file_of(tmp_path, 0).read_bytes())
    if harm == "truncated":
        data = data[: len(data) - 100]
    elif harm == "one byte flipped":
        data[HEADER_BYTES + len(key(0)) + 8 + 1000] ^= 0x01
    elif harm == "header edited":
        data[14] ^= 0xFF  # the value's length
    elif harm == "link edited":
        data[HEADER_BYTES + len(key(0))] ^= 0x01  # a router would be told another parent
    elif harm == "another chunk's file":
        data = bytearray(_file_of(tmp_path, 1).read_bytes())
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    if harm not in ("truncated", "one byte flipped"):  # the header itself is damaged: its link is not used
        assert key(0) not in stored_links(str(tmp_path))
    assert disk.read(key(0)) is Status.CORRUPT
    assert not path.exists() and not disk.contains(key(0))
    assert disk.stats().corrupt == 1
    assert read(disk, 1)[0] is Status.OK


def _newest(directory: Path) -> int:
    return max((int(path.name[: -len(SUFFIX)], 16) for path in files(directory)), default=-1)


@pytest.mark.parametrize("capacity_chunks", [4096, 8], ids=["filling", "full: each write reuses an evicted file"])
def test_a_process_killed_in_the_middle_of_writes_leaves_only_whole_chunks(tmp_path, capacity_chunks) -> None:
    capacity = capacity_chunks * ((1 << 20) + 4096)
    script = textwrap.dedent(
        f"""
        import numpy as np, sys
        from kvpool.backends.disk import DiskTier
        disk = DiskTier({str(tmp_path)!r}, {capacity})
        print("ready", flush=True)
        i = 0
        while True:
            disk.write({PREFIX!r} + f"{{i:032x}}", [np.random.default_rng(i).integers(0, 256, 1 << 20, dtype=np.uint8)])
            i += 1
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while _newest(tmp_path) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    disk = DiskTier(str(tmp_path), capacity)
    written = disk.keys()
    assert len(written) >= min(20, capacity_chunks - 1)
    assert files(tmp_path, ".tmp") == []
    for name in written:
        i = int(name.rsplit("/", 1)[1], 16)
        got = disk.read(name)
        assert not isinstance(got, Status), f"chunk {i}: {got!r}"
        assert np.array_equal(got, value(i, 1 << 20))


def test_a_full_tier_writes_each_chunk_over_the_file_it_evicts(tmp_path) -> None:
    """The evicted file's pages and blocks are reused, not freed and allocated again; a shorter chunk
    leaves no bytes of the longer one behind."""
    file_bytes = HEADER_BYTES + len(key(0)) + CHUNK
    tier = tmp_path / "tier"
    disk = DiskTier(str(tier), 2 * file_bytes)
    assert disk.write(key(0), [value(0)]) is Status.OK and disk.write(key(1), [value(1)]) is Status.OK
    witness = tmp_path / "witness"  # a second name for key 0's file: it sees what is written into that file
    os.link(disk._path(key(0)), witness)
    assert disk.write(key(2), [value(2, CHUNK // 2)]) is Status.OK
    assert witness.read_bytes() == Path(disk._path(key(2))).read_bytes()
    assert os.path.getsize(disk._path(key(2))) == file_bytes - CHUNK // 2
    assert read(disk, 0)[0] is Status.MISSING
    status, got = read(disk, 2)
    assert status is Status.OK and np.array_equal(got, value(2, CHUNK // 2))
    assert sorted(disk.keys()) == [key(1), key(2)] and len(files(tier)) == 2
    assert files(tier, ".tmp") == []


def test_a_folder_removed_under_a_running_tier_is_made_again_by_the_next_write(tmp_path) -> None:
    import shutil

    disk = DiskTier(str(tmp_path / "tier"), 1 << 20)
    assert disk.write(key(0), [value(0)]) is Status.OK
    shutil.rmtree(tmp_path / "tier")  # an operator's wipe while the engine runs
    assert disk.write(key(1), [value(1)]) is Status.OK
    status, got = read(disk, 1)
    assert status is Status.OK and np.array_equal(got, value(1))
    assert read(disk, 0)[0] is Status.MISSING and disk.stats().write_errors == 0


def test_a_read_that_meets_its_file_reused_for_another_chunk_is_a_miss_not_damage(tmp_path, monkeypatch) -> None:
    from kvpool.backends import disk as disk_module

    file_bytes = HEADER_BYTES + len(key(0)) + CHUNK
    disk = DiskTier(str(tmp_path), 2 * file_bytes)
    disk.write(key(0), [value(0)])
    disk.write(key(1), [value(1)])
    real_read_all = disk_module.read_all

    def evicted_while_open(fd: int, data: np.ndarray) -> int:
        monkeypatch.setattr(disk_module, "read_all", real_read_all)
        assert disk.write(key(2), [value(2)]) is Status.OK  # evicts key 0: its open file now holds key 2
        return real_read_all(fd, data)

    monkeypatch.setattr(disk_module, "read_all", evicted_while_open)
    assert read(disk, 0)[0] is Status.MISSING
    assert disk.stats().corrupt == 0
    status, got = read(disk, 2)
    assert status is Status.OK and np.array_equal(got, value(2))


def test_a_write_that_reuses_an_evicted_file_never_takes_one_another_write_just_put_in_place(
    tmp_path, monkeypatch
) -> None:
    """A write that evicts chunk 0 reuses its file; a second write storing chunk 0 anew meanwhile must
    not have its fresh file renamed away under it (the tier would list chunk 0 with no file): writes
    take turns."""
    from kvpool.backends import disk as disk_module

    file_bytes = HEADER_BYTES + len(key(0)) + CHUNK
    disk = DiskTier(str(tmp_path), 2 * file_bytes)
    disk.write(key(0), [value(0)])
    disk.write(key(1), [value(1)])
    real_open = disk_module.open_for_write
    second = threading.Thread(target=lambda: disk.write(key(0), [value(0)]))

    def another_write_meanwhile(tmp: str, recycled: tuple[str, int] | None, flags: int = 0) -> int:
        monkeypatch.setattr(disk_module, "open_for_write", real_open)
        second.start()  # stores chunk 0 again, evicted a moment ago: it waits for this write to end
        second.join(0.5)
        return real_open(tmp, recycled, flags)

    monkeypatch.setattr(disk_module, "open_for_write", another_write_meanwhile)
    assert disk.write(key(2), [value(2)]) is Status.OK  # evicts chunk 0, reusing its file
    second.join(5)
    assert not second.is_alive()
    index = {key(i): i for i in range(3)}
    for listed in sorted(disk.keys()):
        status, got = read(disk, index[listed])
        assert status is Status.OK and np.array_equal(got, value(index[listed])), listed
    assert len(files(tmp_path)) == len(disk.keys()) and files(tmp_path, ".tmp") == []


def test_a_full_disk_leaves_the_pool_serving_from_dram(tmp_path, pools, monkeypatch) -> None:
    pool = tiered(tmp_path, dram_chunks=2)
    pools.append(pool)
    dropped: list[str] = []
    pool.add_listener(dropped.extend)

    def no_space(fd: int, buffers: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", no_space)
    for i in range(4):
        assert pool.put([key(i)], [[value(i)]]) == [Status.OK]
    assert pool.flush(10.0)
    assert pool.disk.stats().write_errors >= 1 and files(tmp_path) == []
    assert files(tmp_path, ".tmp") == [], "a failed write leaves nothing behind"
    for i in (2, 3):
        status, got = read(pool, i)
        assert status is Status.OK and np.array_equal(got, value(i))
    assert read(pool, 0)[0] is Status.MISSING
    assert set(dropped) == {key(0), key(1)}, "what left DRAM unwritten left the pool"


def _mounted(tmp_path: Path, options: str) -> Path | None:
    target = tmp_path / f"mnt-{uuid.uuid4().hex[:6]}"
    target.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True)
    return target if done.returncode == 0 else None


def test_a_real_full_file_system_and_a_read_only_one_only_cost_their_writes(tmp_path, pools) -> None:
    small = _mounted(tmp_path, "size=64k")
    if small is None:
        pytest.skip("this machine does not let a test mount a file system (the injected faults above still run)")
    try:
        pool = TieredPool(MemoryBackend(64 * CHUNK), DiskTier(str(small), 1 << 30))
        for i in range(40):
            pool.put([key(i)], [[value(i)]])
        assert pool.flush(10.0)
        assert pool.disk.stats().write_errors >= 1
        assert all(read(pool, i)[0] is Status.OK for i in range(40))
        assert files(small, ".tmp") == []
        pool.shutdown(5.0)
        subprocess.run(["mount", "-o", "remount,ro", str(small)], check=True)
        again = TieredPool(MemoryBackend(64 * CHUNK), DiskTier(str(small), 1 << 30))
        pools.append(again)
        on_disk = again.keys()
        assert on_disk, "the read-only tier still serves what it holds"
        i = int(on_disk[0].rsplit("/", 1)[1], 16)
        status, got = read(again, i)
        assert status is Status.OK and np.array_equal(got, value(i))
        assert again.put([key(100)], [[value(100)]]) == [Status.OK]
        assert again.flush(10.0) and again.disk.stats().write_errors == 1
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_a_read_past_its_deadline_is_a_miss_and_never_lands_later(tmp_path, pools) -> None:
    pool = tiered(tmp_path, dram_chunks=1, read_timeout_s=0.2)
    pools.append(pool)
    for i in range(3):
        pool.put([key(i)], [[value(i)]])
    assert pool.flush(10.0)
    release = threading.Event()
    real_read = pool.disk.read
    pool.disk.read = lambda k: (release.wait(10), real_read(k))[1]  # type: ignore[method-assign]
    dest = np.zeros(CHUNK, dtype=np.uint8)
    start = time.perf_counter()
    assert pool.get_into([key(0)], [[dest]]) == [Status.UNAVAILABLE]
    assert time.perf_counter() - start < 2.0
    release.set()
    time.sleep(0.3)
    assert not dest.any(), "a late read wrote into the destination"
    assert pool.tier_stats().disk_late == 1


def test_the_disk_evicts_a_chain_tail_first(tmp_path, pools) -> None:
    pool = tiered(tmp_path, dram_chunks=4, disk_chunks=4)
    pools.append(pool)
    chain = [key(i) for i in range(4)]
    pool.put(chain, [[value(i)] for i in range(4)])  # one prompt's chunks, head to tail
    assert pool.flush(10.0)
    pool.put([key(10)], [[value(10)]])
    assert pool.flush(10.0)
    assert pool.exists(chain) == [True, True, True, False], "the tail went first"


def test_the_scheduler_counts_each_ranks_disk_files_until_the_rank_reports(tmp_path) -> None:
    space = KeySpace(LayoutFingerprint("m", "f16", 64, "cpu"))
    hashes = [bytes([i]) * 8 for i in range(3)]
    index = PoolIndex([[space]])
    index.assume(PoolTracker(0, [space], [space.key(h) for h in hashes]).take_report())  # type: ignore[arg-type]
    assert index.present(0, hashes) == [True, True, True]
    worker = PoolTracker(0, [space], [space.key(h) for h in hashes[:2]])  # the rank's scan refused one
    index.apply(worker.take_report())  # type: ignore[arg-type]
    assert index.present(0, hashes) == [True, True, False]
    worker.dropped([space.key(hashes[0])])
    index.apply(worker.take_report())  # type: ignore[arg-type]
    assert index.present(0, hashes) == [False, True, False], "counted once, not twice"


def test_config_keys_of_the_disk_tier(tmp_path) -> None:
    with pytest.raises(ConfigError, match="disk_capacity_bytes"):
        KVPoolConfig.from_dict({"disk_path": str(tmp_path)})
    with pytest.raises(ConfigError, match="disk_path"):
        KVPoolConfig.from_dict({"disk_path": str(tmp_path), "disk_capacity_bytes": "1GiB", "backend": "mooncake"})
    with pytest.raises(ConfigError, match="disk_read_timeout_ms"):
        KVPoolConfig.from_dict({"disk_path": str(tmp_path), "disk_capacity_bytes": "1GiB", "disk_read_timeout_ms": 0})
    config = KVPoolConfig.from_dict({"disk_path": str(tmp_path), "disk_capacity_bytes": "1MiB", "pool_name": "disk-t"})
    try:
        pool = create_backend("memory", config.backend_options(rank=1))
        assert isinstance(pool, TieredPool) and pool.disk.directory == str(tmp_path / "rank1")
        assert pool.disk.capacity_bytes == 1 << 20
    finally:
        drop_shared_tiered_pools()


def test_events_name_the_tier_a_chunk_is_in_and_follow_it_between_dram_and_disk(tmp_path, pools) -> None:
    """A chunk DRAM evicts but the disk holds is withdrawn from DRAM and announced on disk; a disk hit
    promoted into DRAM moves it back; after a restart every chunk is on disk only, and the rank's first
    report agrees with what the scheduler assumed from its files (no tier moves out of nothing)."""
    space = KeySpace(LayoutFingerprint("m", "f16", 64, "cpu"))
    hashes = [bytes([i]) * 8 for i in range(3)]
    keys = [space.key(h) for h in hashes]

    def attach(pool: TieredPool, index: PoolIndex) -> PoolTracker:
        tracker = PoolTracker(0, [space], pool.keys(), pool.disk_only_keys())
        pool.add_listener(tracker.dropped)
        pool.add_tier_listener(tracker.moved)
        index.apply(tracker.take_report())  # type: ignore[arg-type]
        return tracker

    def load(pool: TieredPool, i: int) -> Status:
        return pool.get_into([keys[i]], [[np.zeros(CHUNK, np.uint8)]])[0]

    def events(index: PoolIndex, tracker: PoolTracker) -> list[tuple[int, bool, bool]]:
        report = tracker.take_report()
        if report is not None:
            index.apply(report)
        return [(hashes.index(e.chunk_hash), e.stored, e.on_disk) for e in index.take_events()]

    pool = tiered(tmp_path, dram_chunks=2)
    pools.append(pool)
    index = PoolIndex([[space]])
    index.track_events = True
    tracker = attach(pool, index)
    pool.put(keys[:2], [[value(0)], [value(1)]])
    tracker.stored(keys[:2], [b"", hashes[0]])
    assert events(index, tracker) == [(0, True, False), (1, True, False)]
    assert pool.flush(10.0)
    pool.put(keys[2:], [[value(2)]])  # DRAM holds two: the first chain's tail goes to disk only
    tracker.stored(keys[2:], [hashes[1]])
    assert pool.memory.exists(keys) == [True, False, True]
    assert events(index, tracker) == [(2, True, False), (1, False, False), (1, True, True)]
    assert pool.flush(10.0)
    assert load(pool, 1) is Status.OK  # a disk hit, promoted: DRAM evicts another
    held = pool.memory.exists(keys)
    assert held[1] and held.count(True) == 2
    out = held.index(False)
    moves = [(1, False, True), (1, True, False), (out, False, False), (out, True, True)]
    assert sorted(events(index, tracker)) == sorted(moves)
    assert pool.flush(10.0)
    pool.shutdown(5.0)

    restarted = tiered(tmp_path, dram_chunks=2)
    pools.append(restarted)
    assert sorted(restarted.disk_only_keys()) == sorted(keys)
    index = PoolIndex([[space]])
    index.track_events = True
    index.assume(PoolTracker(0, [space], keys, disk_only=keys).take_report())  # type: ignore[arg-type]
    assert index.present(0, hashes) == [True, True, True]
    tracker = attach(restarted, index)  # the rank's first report: the same three, on disk only
    assert index.take_events() == []
    assert [index._on_disk(0, h) for h in hashes] == [True, True, True]
    assert load(restarted, 2) is Status.OK
    report = tracker.take_report()
    assert report is not None and report.promoted == {space.prefix: [hashes[2]]} and not report.demoted
    index.apply(report)
    assert [index._on_disk(0, h) for h in hashes] == [True, True, False]
    assert [(e.stored, e.on_disk) for e in index.take_events()] == [], "links unknown after a restart: not announced"
    # (the chunks above were put without their links: see the next test for a restart announced as chains)


def test_a_restarted_tier_is_announced_as_chains_parents_first_from_the_links_its_files_keep(tmp_path, pools) -> None:
    """Each file keeps its chunk's parent, so the scheduler of a restarted engine announces what the tier
    holds before any request: every linked chunk, on disk, its parent before it whatever order the files
    are found in; a chunk written without its link counts for lookups but is not announced (a router
    would take it for the start of a prompt). Then the rank's own report moves nothing, and a disk hit
    promoted into DRAM moves its announced chunk between the tiers."""
    space = KeySpace(LayoutFingerprint("m", "f16", 64, "cpu"))
    hashes = [bytes([i]) * 8 for i in range(4)]
    parents = [b"", hashes[0], hashes[1], hashes[0]]  # two prompts sharing a first chunk: 0-1-2 and 0-3
    keys = [space.key(h) for h in hashes]
    unlinked = space.key(b"\x09" * 8)
    pool = tiered(tmp_path, dram_chunks=8)
    pools.append(pool)
    assert pool.put_linked(keys, [[value(i)] for i in range(4)], parents) == [Status.OK] * 4
    assert pool.put([unlinked], [[value(9)]]) == [Status.OK]
    assert pool.flush(10.0)
    pool.shutdown(5.0)

    links = stored_links(str(tmp_path))
    assert links == {**dict(zip(keys, parents)), unlinked: None}
    index = PoolIndex([[space]])
    index.track_events = True
    found = sorted(links, reverse=True)  # the files come in no particular order: children first here
    assumed = PoolTracker(0, [space], found, disk_only=found, parents=[links[k] for k in found])  # as at start
    index.assume(assumed.take_report())  # type: ignore[arg-type]
    announced = [(e.chunk_hash, e.parent, e.on_disk) for e in index.take_events() if e.stored]
    assert sorted(announced) == sorted((h, p or None, True) for h, p in zip(hashes, parents))
    order = [h for h, _, _ in announced]
    assert all(order.index(p) < order.index(h) for h, p in zip(hashes, parents) if p), order
    assert index.present(0, [b"\x09" * 8]) == [True], "unannounced, yet a lookup still hits it"

    restarted = tiered(tmp_path, dram_chunks=8)
    pools.append(restarted)
    rank = PoolTracker(0, [space], restarted.keys(), restarted.disk_only_keys())
    restarted.add_tier_listener(rank.moved)
    index.apply(rank.take_report())  # type: ignore[arg-type]
    assert index.take_events() == []
    assert restarted.get_into([keys[2]], [[np.zeros(CHUNK, np.uint8)]]) == [Status.OK]
    index.apply(rank.take_report())  # type: ignore[arg-type]
    moved = [(e.chunk_hash, e.stored, e.on_disk, e.parent) for e in index.take_events()]
    assert moved == [(hashes[2], False, True, None), (hashes[2], True, False, hashes[1])]
    rank.stored([unlinked], [hashes[3]])  # the chunk without a link is saved again: now its parent is known
    index.apply(rank.take_report())  # type: ignore[arg-type]
    assert [(e.chunk_hash, e.stored, e.parent) for e in index.take_events()] == [(b"\x09" * 8, True, hashes[3])]
    rank.stored([unlinked], [hashes[3]])
    index.apply(rank.take_report())  # type: ignore[arg-type]
    assert index.take_events() == [], "announced once"


def test_files_of_the_previous_format_are_still_read_with_no_link(tmp_path) -> None:
    """An upgrade keeps the tier: version 2 files (before links) read back whole and name no parent."""
    data = value(3)
    encoded = key(3).encode()
    head = struct.pack("<4sHHIQQ", MAGIC, 2, 36, len(encoded), data.size, xxhash.xxh3_64_intdigest(data.data))
    path = _file_of(tmp_path, 3)
    path.parent.mkdir(parents=True)
    path.write_bytes(head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head + encoded)) + encoded + data.tobytes())
    disk = DiskTier(str(tmp_path), 1 << 20)
    status, got = read(disk, 3)
    assert status is Status.OK and np.array_equal(got, data)
    assert stored_links(str(tmp_path)) == {key(3): None}


# -- O_DIRECT -----------------------------------------------------------------------------------------


def direct_tier(directory: Path, capacity: int = 1 << 30) -> DiskTier:
    disk = DiskTier(str(directory), capacity, direct=True)
    if not disk.direct:
        pytest.skip(f"{directory} is on a file system that refuses O_DIRECT")
    return disk


def test_direct_io_files_are_whole_pages_and_read_back_in_either_mode(tmp_path) -> None:
    sizes = {i: size for i, size in enumerate((1, 4095, 4096, 5000, CHUNK * 3 + 7))}
    disk = direct_tier(tmp_path / "direct")
    for i, size in sizes.items():
        assert disk.write(key(i), [value(i, size)], link=b"") is Status.OK
    for path in files(tmp_path / "direct"):
        assert path.stat().st_size % PAGE == 0, path
    assert disk.stats().used_bytes == sum(path.stat().st_size for path in files(tmp_path / "direct"))
    for reader in (disk, DiskTier(str(tmp_path / "direct"), 1 << 30)):  # itself, then a buffered tier
        for i, size in sizes.items():
            status, got = read(reader, i)
            assert status is Status.OK and np.array_equal(got, value(i, size)), (reader.direct, i)
    assert set(stored_links(str(tmp_path / "direct")).values()) == {b""}
    buffered = DiskTier(str(tmp_path / "buffered"), 1 << 30)  # and the other way round
    for i, size in sizes.items():
        buffered.write(key(i), [value(i, size)])
    again = direct_tier(tmp_path / "buffered")
    for i, size in sizes.items():
        status, got = read(again, i)
        assert status is Status.OK and np.array_equal(got, value(i, size)), i


def test_direct_io_damage_is_refused_and_padding_is_never_served(tmp_path) -> None:
    disk = direct_tier(tmp_path)
    for i in range(4):
        disk.write(key(i), [value(i, 5000)])
    path = {i: next(p for p in files(tmp_path) if p.name.startswith(key(i).rsplit("/", 1)[1])) for i in range(4)}
    data = bytearray(path[0].read_bytes())
    data[len(data) - PAGE + 100] ^= 0x01  # a byte of the value in the last page
    path[0].write_bytes(bytes(data))
    path[1].write_bytes(path[1].read_bytes()[:-1])  # neither exact nor whole pages
    path[2].write_bytes(path[2].read_bytes() + bytes(PAGE))  # a page more than the value needs
    fresh = direct_tier(tmp_path)
    assert [read(fresh, i)[0] for i in range(3)] == [Status.CORRUPT] * 3
    status, got = read(fresh, 3)
    assert status is Status.OK and got.size == 5000 and np.array_equal(got, value(3, 5000))
    assert fresh.stats().corrupt == 3 and len(files(tmp_path)) == 1


def test_a_full_direct_tier_reuses_evicted_files_and_serves_only_whole_chunks(tmp_path) -> None:
    file_bytes = -(-(HEADER_BYTES + len(key(0)) + CHUNK + 5) // PAGE) * PAGE
    disk = direct_tier(tmp_path, 3 * file_bytes)
    for i in range(10):
        size = CHUNK + 5 if i % 2 else 100  # a smaller file reuses a larger one's: cut to its own pages
        assert disk.write(key(i), [value(i, size)]) is Status.OK
        held = disk.keys()
        for listed in held:
            j = int(listed.rsplit("/", 1)[1], 16)
            status, got = read(disk, j)
            assert status is Status.OK and np.array_equal(got, value(j, CHUNK + 5 if j % 2 else 100)), (i, j)
    on_disk = files(tmp_path)
    assert len(on_disk) == len(disk.keys()) >= 3 and disk.stats().evictions >= 6
    assert sum(path.stat().st_size for path in on_disk) == disk.stats().used_bytes <= 3 * file_bytes
    assert all(path.stat().st_size % PAGE == 0 for path in on_disk)


def test_a_file_system_that_refuses_o_direct_gets_buffered_io(tmp_path, caplog, monkeypatch) -> None:
    """As tmpfs did before Linux 6.6 (EINVAL at open): injected at the open, since this kernel's tmpfs
    takes O_DIRECT."""
    from kvpool.backends import disk_file

    real_open = os.open

    def refusing(path: str, flags: int, *args: int) -> int:
        if flags & disk_file.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(disk_file.os, "open", refusing)
    disk = DiskTier(str(tmp_path), 1 << 20, direct=True)
    assert disk.direct_asked and not disk.direct
    assert "O_DIRECT refused" in caplog.text
    assert disk.write(key(0), [value(0, 5000)]) is Status.OK
    assert files(tmp_path)[0].stat().st_size == HEADER_BYTES + len(key(0)) + 5000  # unpadded: buffered
    status, got = read(disk, 0)
    assert status is Status.OK and np.array_equal(got, value(0, 5000))
    assert files(tmp_path, ".tmp") == []  # the probe left nothing


def test_disk_io_is_checked_at_start_up_and_reaches_the_tier(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"disk_io.*'odirect'.*buffered, direct"):
        KVPoolConfig.from_dict({"disk_path": str(tmp_path), "disk_capacity_bytes": "1MiB", "disk_io": "odirect"})
    config = {"pool_name": f"t-{uuid.uuid4().hex[:8]}", "disk_path": str(tmp_path), "disk_capacity_bytes": "1MiB"}
    try:
        pool = create_backend("memory", KVPoolConfig.from_dict({**config, "disk_io": "direct"}).backend_options())
        assert isinstance(pool, TieredPool) and pool.disk.direct_asked
        with pytest.raises(ConfigError, match=r"disk_io.*'buffered'.*'direct'"):
            create_backend("memory", KVPoolConfig.from_dict(config).backend_options())  # the same pool, another mode
    finally:
        drop_shared_tiered_pools()
