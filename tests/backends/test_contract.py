"""The backend contract: every test runs on the embedded pool and on a real Mooncake store."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvpool.backends.base import Backend, Rows, Status

KiB = 1 << 10
MiB = 1 << 20
EVICTION_WAIT_S = 15.0  # Mooncake evicts within ~10 ms of a failed put; leases can hold objects 10 s

LAYOUTS = {
    "one piece": [64 * KiB],
    "small pieces": [2 * KiB] * 16,  # staged through one contiguous buffer on Mooncake
    "large pieces": [64 * KiB] * 4,  # moved piece by piece on Mooncake
    "mixed pieces": [100, 64 * KiB, 3, 0, 5 * KiB],
}


def unique_keys(count: int, tag: str = "k") -> list[str]:
    prefix = uuid.uuid4().hex[:8]
    return [f"{prefix}/{tag}/{i}" for i in range(count)]


def random_value(sizes: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]


def empty_like(value: list[np.ndarray]) -> list[np.ndarray]:
    return [np.zeros_like(piece) for piece in value]


def same(left: list[np.ndarray], right: list[np.ndarray]) -> bool:
    return b"".join(p.tobytes() for p in left) == b"".join(p.tobytes() for p in right)


def read_back(backend: Backend, keys: list[str], values: list[list[np.ndarray]]) -> list[Status]:
    dests = [empty_like(value) for value in values]
    statuses = backend.get_into(keys, dests)
    for status, dest, value in zip(statuses, dests, values):
        if status is Status.OK:
            assert same(dest, value), "a read that answers OK must return the stored bytes"
    return statuses


def wait_until(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_round_trip_of_multi_piece_values(backend: Backend, layout: str) -> None:
    keys = unique_keys(5)
    values = [random_value(LAYOUTS[layout], seed) for seed in range(5)]
    assert backend.put(keys, values) == [Status.OK] * 5
    assert read_back(backend, keys, values) == [Status.OK] * 5


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_read_only_sources_are_stored(backend: Backend, layout: str) -> None:
    keys = unique_keys(3)
    values = [random_value(LAYOUTS[layout], seed) for seed in range(3)]
    for value in values:
        for piece in value:
            piece.flags.writeable = False
    assert backend.put(keys, values) == [Status.OK] * 3
    assert read_back(backend, keys, values) == [Status.OK] * 3


def layer_arrays(sizes: list[int], blocks: int, seed: int) -> tuple[np.ndarray, ...]:
    """One (blocks, size) byte array per piece size: the layers of a paged KV cache."""
    rng = np.random.default_rng(seed)
    return tuple(rng.integers(0, 256, (blocks, size), dtype=np.uint8) for size in sizes)


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_rows_round_trip_both_ways(backend: Backend, layout: str) -> None:
    """Values given as rows of layer arrays store the same bytes as lists of pieces, in both directions."""
    sizes = LAYOUTS[layout]
    arrays = layer_arrays(sizes, blocks=12, seed=3)
    saved = Rows(arrays, np.array([9, 2, 5, 11]))
    keys = unique_keys(4)
    assert backend.put(keys, saved) == [Status.OK] * 4
    assert read_back(backend, keys, saved.values()) == [Status.OK] * 4

    into = tuple(np.zeros_like(array) for array in arrays)
    assert backend.get_into(keys, Rows(into, np.array([1, 0, 7, 3]))) == [Status.OK] * 4
    for source, target in zip(arrays, into):
        assert np.array_equal(target[[1, 0, 7, 3]], source[[9, 2, 5, 11]])
        untouched = [row for row in range(12) if row not in (1, 0, 7, 3)]
        assert not target[untouched].any(), "rows outside the batch stay as they were"

    listed = [random_value(sizes, seed) for seed in range(2)]
    other = unique_keys(2)
    assert backend.put(other, listed) == [Status.OK] * 2
    into = tuple(np.zeros_like(array) for array in arrays)
    assert backend.get_into(other, Rows(into, np.array([4, 6]))) == [Status.OK] * 2
    assert same(Rows(into, np.array([4, 6])).value(1), listed[1])


def test_rows_reads_fill_only_what_arrived(backend: Backend) -> None:
    arrays = layer_arrays([2 * KiB] * 8, blocks=6, seed=4)
    keys = unique_keys(3)
    assert backend.put([keys[0], keys[2]], Rows(arrays, np.array([1, 2]))) == [Status.OK] * 2
    into = tuple(np.zeros_like(array) for array in arrays)
    assert backend.get_into(keys, Rows(into, np.array([3, 4, 5]))) == [Status.OK, Status.MISSING, Status.OK]
    assert same(Rows(into, np.array([3, 5])).values()[0], Rows(arrays, np.array([1])).values()[0])
    assert same(Rows(into, np.array([5])).value(0), Rows(arrays, np.array([2])).value(0))
    assert not any(array[4].any() for array in into), "a missing key leaves its block as it was"
    narrow = tuple(np.zeros((6, 2 * KiB - 1), np.uint8) for _ in range(8))
    assert backend.get_into(keys[:1], Rows(narrow, np.array([0]))) == [Status.SIZE_MISMATCH]


def test_rows_batches_larger_than_the_staging_buffer(backend: Backend) -> None:
    arrays = layer_arrays([8 * KiB] * 32, blocks=40, seed=5)  # 10 MiB of small pieces
    keys = unique_keys(40)
    ids = np.arange(40)[::-1].copy()
    assert backend.put(keys, Rows(arrays, ids)) == [Status.OK] * 40
    into = tuple(np.zeros_like(array) for array in arrays)
    assert backend.get_into(keys, Rows(into, ids)) == [Status.OK] * 40
    assert all(np.array_equal(source, target) for source, target in zip(arrays, into))


def test_bad_rows_raise_before_the_pool_is_touched(backend: Backend) -> None:
    arrays = layer_arrays([KiB] * 2, blocks=4, seed=6)
    with pytest.raises(TypeError, match="2-D uint8"):
        Rows((arrays[0].view(np.uint16),), np.array([0]))
    with pytest.raises(TypeError, match="contiguous"):
        Rows((np.zeros((4, 8), np.uint8)[:, ::2],), np.array([0]))
    with pytest.raises(ValueError, match=r"0\.\.3"):
        Rows(arrays, np.array([4]))
    with pytest.raises(TypeError, match="integer"):
        Rows(arrays, np.array([0.5]))
    keys = unique_keys(2)
    with pytest.raises(ValueError):
        backend.put(keys, Rows(arrays, np.array([0])))
    assert backend.put(keys, Rows(arrays, np.array([0, 1]))) == [Status.OK] * 2
    frozen = tuple(np.zeros_like(array) for array in arrays)
    frozen[1].flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        backend.get_into(keys, Rows(frozen, np.array([2, 3])))
    assert not frozen[0].any()


def test_round_trip_of_tensors_and_memoryviews(backend: Backend) -> None:
    keys = unique_keys(2)
    tensor_value = [torch.arange(4096, dtype=torch.float32), torch.ones(8, 16, dtype=torch.bfloat16)]
    bytes_value = [memoryview(b"header"), bytearray(b"x" * 40000)]
    assert backend.put(keys, [tensor_value, bytes_value]) == [Status.OK, Status.OK]

    tensor_dest = [torch.zeros(4096, dtype=torch.float32), torch.zeros(8, 16, dtype=torch.bfloat16)]
    bytes_dest = [bytearray(6), memoryview(bytearray(40000))]
    assert backend.get_into(keys, [tensor_dest, bytes_dest]) == [Status.OK, Status.OK]
    assert all(torch.equal(got, put) for got, put in zip(tensor_dest, tensor_value))
    assert bytes(bytes_dest[0]) == b"header" and bytes(bytes_dest[1]) == b"x" * 40000


def test_reads_scatter_into_any_split_of_the_stored_bytes(backend: Backend) -> None:
    (key,) = unique_keys(1)
    value = random_value([96 * KiB], seed=1)
    assert backend.put([key], [value]) == [Status.OK]
    whole = value[0]
    for split in ([32 * KiB] * 3, [KiB] * 96, [95 * KiB, KiB]):
        dest = [np.zeros(size, np.uint8) for size in split]
        assert backend.get_into([key], [dest]) == [Status.OK]
        assert np.array_equal(np.concatenate(dest), whole)


def test_batches_larger_than_the_staging_buffer(backend: Backend) -> None:
    keys = unique_keys(40)
    values = [random_value([8 * KiB] * 32, seed) for seed in range(40)]  # 10 MiB of small pieces
    assert backend.put(keys, values) == [Status.OK] * 40
    assert read_back(backend, keys, values) == [Status.OK] * 40


def test_exists_answers_each_key_in_order(backend: Backend) -> None:
    present = unique_keys(3, "present")
    absent = unique_keys(3, "absent")
    assert backend.put(present, [random_value([KiB], i) for i in range(3)]) == [Status.OK] * 3
    query = [absent[0], present[0], present[1], absent[1], present[0], present[2], absent[2]]
    assert backend.exists(query) == [False, True, True, False, True, True, False]
    assert backend.exists([]) == []


def test_missing_keys_answer_missing_without_failing_the_batch(backend: Backend) -> None:
    stored, missing = unique_keys(2)
    value = random_value([4 * KiB] * 2, seed=3)
    assert backend.put([stored], [value]) == [Status.OK]
    dest_missing = empty_like(value)
    assert read_back(backend, [missing, stored, missing], [value, value, value]) == [
        Status.MISSING,
        Status.OK,
        Status.MISSING,
    ]
    assert backend.get_into([missing], [dest_missing]) == [Status.MISSING]


def test_duplicate_puts_keep_the_first_value(backend: Backend) -> None:
    (key,) = unique_keys(1)
    first, second = random_value([8 * KiB] * 4, 1), random_value([8 * KiB] * 4, 2)
    assert backend.put([key], [first]) == [Status.OK]
    assert backend.put([key], [second]) == [Status.OK]
    assert read_back(backend, [key], [first]) == [Status.OK]

    (batch_key,) = unique_keys(1, "same-batch")
    assert backend.put([batch_key, batch_key], [first, second]) == [Status.OK, Status.OK]
    assert read_back(backend, [batch_key], [first]) == [Status.OK]


@pytest.mark.parametrize("layout", ["one piece", "small pieces", "large pieces"])
def test_reading_into_the_wrong_size_is_a_mismatch(backend: Backend, layout: str) -> None:
    (key,) = unique_keys(1)
    value = random_value(LAYOUTS[layout], seed=4)
    assert backend.put([key], [value]) == [Status.OK]
    too_small = [np.zeros(piece.size - 1 if i == 0 else piece.size, np.uint8) for i, piece in enumerate(value)]
    too_large = [*empty_like(value), np.zeros(KiB, np.uint8)]
    assert backend.get_into([key, key], [too_small, too_large]) == [Status.SIZE_MISMATCH] * 2
    assert read_back(backend, [key], [value]) == [Status.OK], "a mismatched read must not damage the value"


ODD_KEYS = [
    "with spaces in it",
    "a/b/c//d/",
    "back\\slash",
    "ünïcödé-键-🔑",
    "new\nline\ttab",
    "quotes'\"%*?[.]+(regex)$^",
    "nul\0inside",
    "nul",
    "k" * 10_000,
]


def test_odd_key_characters_round_trip(backend: Backend) -> None:
    prefix = uuid.uuid4().hex[:8]
    keys = [prefix + key for key in ODD_KEYS]
    values = [random_value([KiB + i], seed=i) for i in range(len(keys))]
    assert backend.put(keys, values) == [Status.OK] * len(keys)
    assert backend.exists(keys) == [True] * len(keys)
    assert read_back(backend, keys, values) == [Status.OK] * len(keys)


@pytest.mark.parametrize("pieces", [1, 2], ids=["one piece", "two pieces"])
def test_values_larger_than_the_pool_are_full(backend: Backend, pool_bytes: int, pieces: int) -> None:
    earlier, oversized, fitting = unique_keys(3)
    earlier_value, fitting_value = random_value([64 * KiB], 5), random_value([64 * KiB], 6)
    assert backend.put([earlier], [earlier_value]) == [Status.OK]
    huge = [np.full(pool_bytes // pieces + MiB, 7, np.uint8) for _ in range(pieces)]
    assert backend.put([oversized, fitting], [huge, fitting_value]) == [Status.FULL, Status.OK]
    assert backend.exists([oversized]) == [False]
    assert read_back(backend, [fitting], [fitting_value]) == [Status.OK]
    # the failed allocation may make Mooncake evict older objects, but never hand back wrong bytes
    assert read_back(backend, [earlier], [earlier_value])[0] in (Status.OK, Status.MISSING)


def test_remove_and_clear(backend: Backend) -> None:
    keys = unique_keys(4)
    values = [random_value([2 * KiB] * 2, i) for i in range(4)]
    assert backend.put(keys, values) == [Status.OK] * 4
    assert read_back(backend, keys[:1], values[:1]) == [Status.OK]  # a read (Mooncake: a lease) must not block removal
    assert backend.remove([keys[0], keys[1], "never-stored-" + keys[0]]) == 2
    assert backend.exists(keys) == [False, False, True, True]
    assert read_back(backend, keys[:1], values[:1]) == [Status.MISSING]
    assert backend.remove([]) == 0
    assert backend.clear() >= 2
    assert backend.exists(keys) == [False] * 4


def test_stats_counters_move(backend: Backend) -> None:
    before = backend.stats()
    keys = unique_keys(3)
    values = [random_value([4 * KiB], i) for i in range(2)]
    assert backend.put(keys[:2], values) == [Status.OK] * 2
    assert read_back(backend, keys, [*values, values[0]]) == [Status.OK, Status.OK, Status.MISSING]
    after = backend.stats()
    assert after.name == backend.name
    assert after.capacity_bytes > 0
    assert after.puts - before.puts == 2
    assert after.put_bytes - before.put_bytes == 8 * KiB
    assert after.hits - before.hits == 2
    assert after.gets - before.gets == 2
    assert after.get_bytes - before.get_bytes == 8 * KiB
    assert after.misses - before.misses == 1


def test_filling_past_capacity_evicts_and_stays_correct(backend: Backend, pool_bytes: int) -> None:
    count = pool_bytes // MiB * 5 // 4
    keys = unique_keys(count)
    values = [[np.full(MiB, i % 251, np.uint8)] for i in range(count)]
    statuses: list[Status] = []
    for start in range(0, count, 8):
        statuses += backend.put(keys[start : start + 8], values[start : start + 8])
    assert set(statuses) <= {Status.OK, Status.FULL}
    assert statuses[-1] is Status.OK or wait_until(
        lambda: backend.put(unique_keys(1, "late"), [values[0]]) == [Status.OK], EVICTION_WAIT_S
    ), "puts must succeed again once eviction made room"
    readable = read_back(backend, keys, values)
    assert set(readable) <= {Status.OK, Status.MISSING}
    assert Status.MISSING in readable[: count // 4], "the oldest values must have been evicted"
    assert readable[-1] is Status.OK or statuses[-1] is not Status.OK


def test_concurrent_threads_each_read_their_own_bytes(backend: Backend) -> None:
    errors: list[str] = []

    def worker(seed: int) -> None:
        for round_ in range(10):
            keys = unique_keys(4, f"t{seed}")
            sizes = [2 * KiB] * 8 if round_ % 2 else [48 * KiB] * 2
            values = [random_value(sizes, seed * 100 + round_ * 10 + i) for i in range(4)]
            if backend.put(keys, values) != [Status.OK] * 4:
                errors.append(f"put failed in thread {seed}")
            if backend.get_into(keys, [empty_like(v) for v in values]) != [Status.OK] * 4:
                errors.append(f"get failed in thread {seed}")
            dests = [empty_like(v) for v in values]
            backend.get_into(keys, dests)
            if not all(same(d, v) for d, v in zip(dests, values)):
                errors.append(f"wrong bytes in thread {seed}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []


def test_empty_batches_and_bad_arguments(backend: Backend) -> None:
    assert backend.put([], []) == []
    assert backend.get_into([], []) == []
    assert backend.healthy()
    with pytest.raises(ValueError):
        backend.put(["a", "b"], [[np.zeros(4, np.uint8)]])
    with pytest.raises(ValueError):
        backend.get_into(["a"], [])


def test_unusable_buffers_raise_before_the_pool_is_touched(backend: Backend) -> None:
    keys = unique_keys(2)
    good = random_value([4 * KiB], seed=1)
    strided = [np.zeros(8 * KiB, np.uint8)[::2]]
    with pytest.raises(TypeError, match="not contiguous"):
        backend.put(keys, [good, strided])
    assert backend.exists(keys) == [False, False], "nothing of a rejected batch is stored"

    assert backend.put(keys, [good, good]) == [Status.OK, Status.OK]
    read_only = np.zeros(4 * KiB, np.uint8)
    read_only.flags.writeable = False
    target = np.zeros(4 * KiB, np.uint8)
    with pytest.raises(TypeError, match="read-only"):
        backend.get_into(keys, [[target], [read_only]])
    assert not target.any(), "nothing of a rejected batch is read"


def test_empty_values_are_rejected(backend: Backend) -> None:
    (key,) = unique_keys(1)
    assert backend.put([key], [[]]) == [Status.ERROR]
    assert backend.put([key], [[np.zeros(0, np.uint8)]]) == [Status.ERROR]
    assert backend.exists([key]) == [False]


# --- where the two pools differ by design


def test_memory_pool_evicts_least_recently_used(pool_bytes: int) -> None:
    from kvpool.backends.memory import MemoryBackend

    pool = MemoryBackend(capacity_bytes=pool_bytes)
    count = pool_bytes // MiB
    keys = unique_keys(count + 4)
    values = [[np.full(MiB, i % 251, np.uint8)] for i in range(count + 4)]
    assert pool.put(keys[:count], values[:count]) == [Status.OK] * count  # a chain: it ages tail first
    assert read_back(pool, keys[count - 1 : count], values[count - 1 : count]) == [Status.OK]  # the tail: now newest
    assert pool.put(keys[count:], values[count:]) == [Status.OK] * 4
    assert pool.exists(keys[count - 6 : count]) == [True, False, False, False, False, True]
    assert pool.stats().evictions == 4


@pytest.mark.mooncake
def test_mooncake_pool_full_answers_full_then_recovers(mooncake_client: Backend, pool_bytes: int) -> None:
    mooncake_client.clear()
    count = pool_bytes // MiB + 16
    keys = unique_keys(count)
    values = [[np.full(MiB, i % 251, np.uint8)] for i in range(count)]
    started = time.monotonic()
    statuses = mooncake_client.put(keys, values)  # one batch: no time for eviction in between
    assert time.monotonic() - started < 5.0, "a full pool must answer at once, not block"
    assert statuses[0] is Status.OK and Status.FULL in statuses
    assert set(statuses) <= {Status.OK, Status.FULL}
    assert wait_until(
        lambda: mooncake_client.put(unique_keys(1, "late"), [values[0]]) == [Status.OK], EVICTION_WAIT_S
    ), "background eviction must make room again"
    readable = read_back(mooncake_client, keys, values)
    assert set(readable) <= {Status.OK, Status.MISSING}
