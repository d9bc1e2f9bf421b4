"""The embedded pool: LRU eviction, byte capacity, thread safety, shared pools, bad settings."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from kvpool.backends.base import Status
from kvpool.backends.factory import BACKEND_NAMES, create_backend
from kvpool.backends.memory import MemoryBackend
from kvpool.backends.shared_pools import drop_shared_memory_pools, shared_memory_pool
from kvpool.core.errors import ConfigError


def value(tag: str, size: int) -> list[np.ndarray]:
    seed = int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=8).digest(), "little")
    return [np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)]


def read(pool: MemoryBackend, key: str, size: int) -> tuple[Status, bytes]:
    dest = np.zeros(size, dtype=np.uint8)
    status = pool.get_into([key], [[dest]])[0]
    return status, dest.tobytes()


def stored_keys(pool: MemoryBackend, candidates: list[str]) -> list[str]:
    return [k for k, there in zip(candidates, pool.exists(candidates)) if there]


def test_put_get_round_trip_with_pieces() -> None:
    pool = MemoryBackend(1 << 20)
    pieces = [np.arange(10, dtype=np.uint8), np.arange(6, dtype=np.float32), bytearray(b"xyz")]
    assert pool.put(["k"], [pieces]) == [Status.OK]
    dests = [np.zeros(10, dtype=np.uint8), np.zeros(6, dtype=np.float32), bytearray(3)]
    assert pool.get_into(["k"], [dests]) == [Status.OK]
    assert (dests[0] == pieces[0]).all() and (dests[1] == pieces[1]).all() and dests[2] == b"xyz"
    assert pool.get_into(["k"], [[np.zeros(5, dtype=np.uint8)]]) == [Status.SIZE_MISMATCH]
    assert pool.get_into(["nope"], [[np.zeros(37, dtype=np.uint8)]]) == [Status.MISSING]
    assert pool.put(["k"], [[np.zeros(37, dtype=np.uint8)]]) == [Status.OK]  # existing key: left as is
    assert read(pool, "k", 37)[1][:10] == bytes(range(10))
    stats = pool.stats()
    assert stats.keys == 1 and stats.used_bytes == 37 and stats.puts == 1


def test_lru_eviction_takes_a_chain_tail_first() -> None:
    """A batch is a prefix chain, head first: it ages tail first, so what eviction leaves is a prefix."""
    pool = MemoryBackend(400)
    keys = ["a", "b", "c", "d"]  # head ... tail
    assert pool.put(keys, [value(k, 100) for k in keys]) == [Status.OK] * 4
    assert pool.put(["e"], [value("e", 100)]) == [Status.OK]
    assert stored_keys(pool, [*keys, "e"]) == ["a", "b", "c", "e"]  # the tail went, the prefix a-b-c stays
    assert read(pool, "b", 100)[0] is Status.OK  # b is now the most recent
    assert pool.put(["c"], [value("c", 100)]) == [Status.OK]  # a put of a present key refreshes it
    assert pool.put(["f"], [value("f", 150)]) == [Status.OK]  # needs two victims: a, then e
    assert stored_keys(pool, ["a", "b", "c", "d", "e", "f"]) == ["b", "c", "f"]
    assert pool.stats().evictions == 3
    for key in ("b", "c", "f"):
        size = 150 if key == "f" else 100
        assert read(pool, key, size) == (Status.OK, np.concatenate(value(key, size)).tobytes())


def test_a_read_chain_keeps_its_head_longest() -> None:
    pool = MemoryBackend(400)
    assert pool.put(["x", "y"], [value(k, 100) for k in "xy"]) == [Status.OK] * 2
    assert pool.put(["a", "b"], [value(k, 100) for k in "ab"]) == [Status.OK] * 2
    dests = [[np.zeros(100, np.uint8)] for _ in range(4)]
    assert pool.get_into(["x", "y", "a", "b"], dests) == [Status.OK] * 4  # a load reads head to tail
    assert pool.put(["n"], [value("n", 100)]) == [Status.OK]
    assert stored_keys(pool, ["x", "y", "a", "b", "n"]) == ["x", "y", "a", "n"]  # the read's tail went first


def test_capacity_is_never_exceeded() -> None:
    rng = np.random.default_rng(0)
    capacity = 5000
    pool = MemoryBackend(capacity)
    sizes: dict[str, int] = {}
    for i in range(400):
        size = int(rng.integers(1, 1500))
        key = f"k{i}"
        assert pool.put([key], [value(key, size)]) == [Status.OK]
        sizes[key] = size
        if i % 7 == 1:
            pool.remove([f"k{int(rng.integers(0, i))}"])
        present = stored_keys(pool, list(sizes))
        used = sum(sizes[k] for k in present)
        assert used <= capacity
        assert pool.stats().used_bytes == used
        assert key in present  # the newest value always fits
    assert pool.put(["huge"], [value("huge", capacity + 1)]) == [Status.FULL]
    assert pool.put(["empty"], [[np.zeros(0, dtype=np.uint8)]]) == [Status.ERROR]
    assert pool.stats().put_failures == 2


def test_values_survive_array_reuse() -> None:
    """Evicted arrays are reused for new values: a read never sees another key's bytes."""
    pool = MemoryBackend(1000)
    for i in range(200):
        key = f"k{i}"
        pool.put([key], [value(key, 100)])
        for j in range(max(0, i - 12), i + 1):
            status, data = read(pool, f"k{j}", 100)
            if status is Status.OK:
                assert data == value(f"k{j}", 100)[0].tobytes()
    assert pool.stats().used_bytes == 1000


def test_concurrent_puts_and_gets_keep_data_intact() -> None:
    pool = MemoryBackend(64 * 1000)  # small enough to evict while threads read
    errors: list[str] = []
    start = threading.Barrier(8)

    def worker(t: int) -> None:
        rng = np.random.default_rng(t)
        start.wait()
        for i in range(300):
            key = f"t{t}/{i}"
            status = pool.put([key], [value(key, 1000)])[0]
            if status is not Status.OK:
                errors.append(f"put {key}: {status}")
            other = f"t{int(rng.integers(0, 8))}/{int(rng.integers(0, i + 1))}"
            got, data = read(pool, other, 1000)
            if got is Status.OK and data != value(other, 1000)[0].tobytes():
                errors.append(f"corrupt {other}")
            elif got not in (Status.OK, Status.MISSING):
                errors.append(f"get {other}: {got}")
            # everyone also writes one shared key: concurrent puts of the same content-addressed key
            pool.put(["shared"], [value("shared", 1000)])

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    stats = pool.stats()
    assert stats.used_bytes <= 64 * 1000
    assert stats.used_bytes == 1000 * stats.keys
    shared = (Status.OK, value("shared", 1000)[0].tobytes())
    assert read(pool, "shared", 1000) in (shared, (Status.MISSING, bytes(1000)))


def test_clear_during_a_put_keeps_the_accounting() -> None:
    """A put still copying when the pool is cleared keeps its reservation: capacity holds."""
    entered, release = threading.Event(), threading.Event()

    class SlowPublish(MemoryBackend):
        def _publish(self, published: list[tuple[str, np.ndarray]], reserved: list[str]) -> None:
            if "slow" in reserved:
                entered.set()
                assert release.wait(5)
            super()._publish(published, reserved)

    pool = SlowPublish(300)
    pool.put(["old"], [value("old", 100)])
    writer = threading.Thread(target=lambda: pool.put(["slow"], [value("slow", 100)]))
    writer.start()
    assert entered.wait(5)
    assert pool.clear() == 1
    release.set()
    writer.join(5)
    assert pool.put(["x", "y", "z"], [value(k, 100) for k in "xyz"]) == [Status.OK] * 3
    present = stored_keys(pool, ["old", "slow", "x", "y", "z"])
    assert len(present) * 100 <= 300
    assert pool.stats().used_bytes == len(present) * 100


def test_adopted_arrays_are_stored_as_they_are_and_evict_like_puts() -> None:
    """A disk hit promoted into DRAM keeps the read's own buffer: no copy, the same capacity and order."""
    pool = MemoryBackend(capacity_bytes=300)
    given = [np.full(100, i, dtype=np.uint8) for i in range(4)]
    assert pool.adopt(["a", "b", "c"], given[:3]) == [Status.OK] * 3
    assert pool.adopt(["d", "a"], [given[3], given[0]]) == [Status.OK, Status.OK]  # "a" was held: kept
    assert stored_keys(pool, ["a", "b", "c", "d"]) == ["a", "b", "d"], "a chain tail went to make room"
    dest = np.zeros(100, dtype=np.uint8)
    assert pool.get_into(["d"], [[dest]]) == [Status.OK] and (dest == 3).all()
    assert pool.stats().used_bytes == 300
    assert pool.adopt(["huge"], [np.zeros(301, dtype=np.uint8)]) == [Status.FULL]
    with pytest.raises(TypeError, match="1-D contiguous uint8"):
        pool.adopt(["e"], [np.zeros((2, 50), dtype=np.uint8)])
    given[3][:] = 9  # adopted, not copied: the pool holds this very buffer
    assert pool.get_into(["d"], [[dest]]) == [Status.OK] and (dest == 9).all()
    # adopting into a full pool whose evictions freed arrays: what it holds, used and idle, stays within it
    assert pool.adopt(["x", "y"], [np.zeros(100, dtype=np.uint8), np.zeros(100, dtype=np.uint8)]) == [Status.OK] * 2
    assert pool.stats().used_bytes + pool._free_bytes <= pool.capacity_bytes


def test_remove_and_clear() -> None:
    pool = MemoryBackend(1000)
    pool.put(["a", "b"], [value("a", 10), value("b", 10)])
    assert pool.remove(["a", "zz"]) == 1
    assert pool.exists(["a", "b"]) == [False, True]
    assert pool.clear() == 1
    assert pool.stats().used_bytes == 0 and pool.stats().keys == 0
    assert pool.healthy()


def test_mismatched_batch_lengths() -> None:
    pool = MemoryBackend(1000)
    with pytest.raises(ValueError, match="2 keys and 1 values"):
        pool.put(["a", "b"], [value("a", 4)])
    with pytest.raises(ValueError, match="1 keys and 2 destinations"):
        pool.get_into(["a"], [value("a", 4), value("b", 4)])


@pytest.mark.parametrize("capacity", [0, -1, 1.5, "1GB", True, None])
def test_bad_capacity(capacity: object) -> None:
    with pytest.raises(ConfigError, match="capacity_bytes") as info:
        MemoryBackend(capacity)  # type: ignore[arg-type]
    assert info.value.key == "capacity_bytes" and "positive integer" in str(info.value)


def test_shared_pools_by_name() -> None:
    drop_shared_memory_pools()
    try:
        first = shared_memory_pool("t-shared", 1 << 20)
        assert shared_memory_pool("t-shared", 1 << 20) is first
        assert shared_memory_pool("t-other", 1 << 20) is not first
        first.put(["k"], [value("k", 8)])
        assert create_backend("memory", {"name": "t-shared", "capacity_bytes": 1 << 20}).exists(["k"]) == [True]
        with pytest.raises(ConfigError, match="capacity_bytes"):
            shared_memory_pool("t-shared", 2 << 20)
    finally:
        drop_shared_memory_pools()
    assert shared_memory_pool("t-shared", 1 << 20) is not first
    drop_shared_memory_pools()


def test_unknown_backend_names_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as info:
        create_backend("nope")
    assert info.value.key == "backend" and info.value.value == "nope"
    for name in BACKEND_NAMES:
        assert name in str(info.value)


def test_a_copy_that_fails_mid_batch_gives_back_what_it_reserved() -> None:
    """Keys copied before the failure are stored; the rest leave neither bytes nor a reservation."""

    class BrokenTarget(MemoryBackend):
        broken = True

        def _reserve(self, keys: Sequence[str], sizes: list[int]) -> list[np.ndarray | Status]:
            targets = super()._reserve(keys, sizes)
            if self.broken:
                targets[1] = np.empty(1, np.uint8)  # the second copy cannot fit: np.concatenate raises
            return targets

    pool = BrokenTarget(1000)
    with pytest.raises(ValueError):
        pool.put(["a", "b", "c"], [[np.ones(50, np.uint8), np.ones(50, np.uint8)] for _ in range(3)])
    assert pool.exists(["a", "b", "c"]) == [True, False, False]
    assert pool.stats().used_bytes == 100
    pool.broken = False
    assert pool.put(["b"], [[np.ones(100, np.uint8)]]) == [Status.OK]
    assert pool.stats().used_bytes == 200


def test_an_allocation_that_fails_gives_back_every_reservation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh value array is allocated after its key is reserved; if that allocation raises, no key of
    the batch may stay reserved: a reserved key answers later puts OK and stores nothing."""
    pool = MemoryBackend(10_000)
    values = [value("a", 100), value("b", 300)]
    empty = np.empty

    def failing_empty(shape: object, *args: object, **kwargs: object) -> np.ndarray:
        if shape == 300:
            raise MemoryError("scripted")
        return empty(shape, *args, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(np, "empty", failing_empty)
    with pytest.raises(MemoryError):
        pool.put(["a", "b"], values)
    monkeypatch.undo()
    assert pool.stats().used_bytes == 0
    assert pool.put(["a", "b"], values) == [Status.OK, Status.OK]
    assert pool.exists(["a", "b"]) == [True, True]
    assert read(pool, "b", 300) == (Status.OK, bytes(value("b", 300)[0]))
