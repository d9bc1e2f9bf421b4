"""Chunk seals: written with each chunk, checked on load; a chunk that fails loads as failed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.backends.base import Rows, Status
from kvpool.backends.memory import MemoryBackend
from kvpool.core.chunks import ChunkRef
from kvpool.core.config import Integrity
from kvpool.core.errors import LayoutError
from kvpool.worker.host_buffers import HostBuffers
from kvpool.worker.integrity import SAMPLE_PAGE_BYTES, SEAL_BYTES, Sealer
from kvpool.worker.layout import KVLayout
from kvpool.worker.loader import Loader
from kvpool.worker.stats import WorkerStats

SEALED = [Integrity.SAMPLED, Integrity.FULL]
NUM_BLOCKS = 6


def _sealed_values(sealer: Sealer, payload: np.ndarray) -> np.ndarray:
    """Each row of `payload` followed by its seal, as a pool would hold it."""
    rows = Rows((payload,), np.arange(len(payload)))
    return np.concatenate([payload, sealer.seal_column(rows)], axis=1)


def _verdicts(sealer: Sealer, stored: np.ndarray) -> list[Status]:
    return sealer.verify(Rows((stored,), np.arange(len(stored))), [Status.OK] * len(stored))


@settings(max_examples=60, deadline=None)
@given(
    words=st.lists(st.integers(1, 1300), min_size=1, max_size=5),
    mode=st.sampled_from(SEALED),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_seal_is_the_same_however_the_chunk_is_split_into_arrays(words, mode, seed):
    rng = np.random.default_rng(seed)
    widths = [8 * count for count in words]
    arrays = tuple(rng.integers(0, 256, (4, width), dtype=np.uint8) for width in widths)
    ids = np.array([2, 0, 3])
    sealer = Sealer(sum(widths), mode)
    whole = np.concatenate(arrays, axis=1)
    assert np.array_equal(sealer.seals(Rows(arrays, ids)), sealer.seals(Rows((whole,), ids)))
    # and with the seal column after the bytes, as loads read them back
    stored = np.concatenate([whole, np.zeros((4, SEAL_BYTES), np.uint8)], axis=1)
    assert np.array_equal(sealer.seals(Rows((stored,), ids)), sealer.seals(Rows((whole,), ids)))


@settings(max_examples=60, deadline=None)
@given(words=st.integers(1, 3000), byte=st.integers(0, 10**9), flip=st.integers(1, 255))
def test_a_full_seal_catches_any_changed_byte(words, byte, flip):
    sealer = Sealer(8 * words, Integrity.FULL)
    stored = _sealed_values(sealer, np.random.default_rng(words).integers(0, 256, (2, 8 * words), dtype=np.uint8))
    stored[1, byte % stored.shape[1]] ^= flip  # the seal itself included
    assert _verdicts(sealer, stored) == [Status.OK, Status.CORRUPT]


@pytest.mark.parametrize("mode", SEALED)
@pytest.mark.parametrize(
    "damage",
    ["zeroed_page", "stale_page", "truncated_tail", "all_zero", "wrong_value", "seal_only"],
)
def test_a_seal_catches_what_goes_wrong_a_page_at_a_time(mode, damage):
    payload = 5 * SAMPLE_PAGE_BYTES + 200  # the last page is partial
    sealer = Sealer(payload, mode)
    rng = np.random.default_rng(7)
    stored = _sealed_values(sealer, rng.integers(0, 256, (3, payload), dtype=np.uint8))
    other = _sealed_values(sealer, rng.integers(0, 256, (3, payload), dtype=np.uint8))
    page = slice(2 * SAMPLE_PAGE_BYTES, 3 * SAMPLE_PAGE_BYTES)
    if damage == "zeroed_page":
        stored[1, page] = 0
    elif damage == "stale_page":
        stored[1, page] = other[1, page]
    elif damage == "truncated_tail":
        stored[1, payload - 100 : payload] = 0  # a transfer that stopped short
    elif damage == "all_zero":
        stored[1] = 0  # memory nobody wrote, seal included
    elif damage == "wrong_value":
        stored[1] = other[2]  # a whole sealed chunk under another chunk's key
        stored[1, -SEAL_BYTES:] = other[1, -SEAL_BYTES:]
    else:
        stored[1, -1] ^= 1
    assert _verdicts(sealer, stored) == [Status.OK, Status.CORRUPT, Status.OK]


def test_chunks_that_are_not_whole_words_cannot_be_sealed():
    with pytest.raises(LayoutError, match="12 bytes"):
        Sealer(12, Integrity.SAMPLED)
    Sealer(12, Integrity.OFF)  # nothing to seal


def _layout(mode: Integrity) -> tuple[KVLayout, dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    tensors = {f"layer{i}": rng.integers(0, 256, (NUM_BLOCKS, 2 * SAMPLE_PAGE_BYTES), dtype=np.uint8) for i in range(3)}
    return KVLayout(tensors, dict.fromkeys(tensors, 0), NUM_BLOCKS, integrity=mode), tensors


@pytest.mark.parametrize("mode", SEALED)
@pytest.mark.parametrize("path", ["in_place", "copied", "owned"])
def test_a_sealed_chunk_round_trips_and_a_damaged_one_fails_and_leaves_its_block_alone(mode, path):
    layout, tensors = _layout(mode)
    pool = MemoryBackend(1 << 24)
    rows = layout.copy_rows(0, [1, 2]) if path == "copied" else layout.save_rows(0, [1, 2])
    assert pool.put(["a", "b"], rows) == [Status.OK, Status.OK]
    assert pool.nbytes_of("a") == layout.stored_nbytes(0) == layout.chunk_nbytes(0) + SEAL_BYTES
    damaged = np.frombuffer(bytearray(bytes(pool._items["b"])), dtype=np.uint8)
    damaged[SAMPLE_PAGE_BYTES * 3 : SAMPLE_PAGE_BYTES * 4] ^= 0xFF
    pool.remove(["b"])
    pool.put(["b"], [[damaged]])
    expected = {name: tensor[[1, 2]].copy() for name, tensor in tensors.items()}
    for tensor in tensors.values():
        tensor[[3, 4]] = 0
    target = layout.load_rows(0, [3, 4], owned=path == "owned")
    statuses = layout.verify(0, target, pool.get_into(["a", "b"], target))
    assert statuses == [Status.OK, Status.CORRUPT]
    layout.commit_rows(0, [3, 4], target, [status is Status.OK for status in statuses])
    for name, tensor in tensors.items():
        assert np.array_equal(tensor[3], expected[name][0])
        if path == "owned":  # an owned read never writes a block whose chunk failed
            assert not tensor[4].any()


def test_an_unsealed_layout_stores_the_bare_blocks():
    layout, _ = _layout(Integrity.OFF)
    pool = MemoryBackend(1 << 24)
    pool.put(["a"], layout.save_rows(0, [1]))
    assert pool.nbytes_of("a") == layout.chunk_nbytes(0) == layout.stored_nbytes(0)


def test_a_corrupt_chunk_is_a_failed_load_counted_and_dropped_from_the_pool():
    layout, _ = _layout(Integrity.SAMPLED)
    pool = MemoryBackend(1 << 24)
    pool.put(["k1", "k2"], layout.save_rows(0, [1, 2]))
    stored = pool._items["k2"]  # bit rot in the pool's own memory
    stored[10] ^= 0x40
    failed: list[list[ChunkRef]] = []
    stats = WorkerStats()
    loader = Loader(pool, lambda: layout, stats, 64, sync=True, on_done=lambda _req, chunks: failed.append(chunks))
    chunks = [ChunkRef(0, 0, 3, "k1"), ChunkRef(0, 1, 4, "k2")]
    loader.start("r", chunks, [])
    assert [chunk.key for chunk in failed[0]] == ["k2"]
    assert (stats.chunks_loaded, stats.chunks_load_failed, stats.chunks_corrupt) == (1, 1, 1)
    assert pool.exists(["k1", "k2"]) == [True, False]
    loader.close()


@pytest.mark.parametrize("mode", SEALED)
def test_a_reused_host_buffer_never_passes_its_last_chunk_off_as_a_row_the_pool_did_not_write(mode):
    """A host buffer kept for the next load still holds the last load's sealed chunks: were a pool to
    answer OK for a row it never wrote, that stale chunk must fail its seal, not load as the one asked."""
    layout, _ = _layout(mode)
    pool = MemoryBackend(1 << 24)
    pool.put(["a", "b"], layout.save_rows(0, [1, 2]))
    buffers = HostBuffers()
    first = buffers.take(2, layout.stored_nbytes(0))
    rows = Rows((first,), np.arange(2))
    assert layout.verify(0, rows, pool.get_into(["a", "b"], rows)) == [Status.OK, Status.OK]
    buffers.give(first)
    again = buffers.take(2, layout.stored_nbytes(0))
    assert buffers.reused == 1 and np.shares_memory(again, first)
    assert layout.verify(0, Rows((again,), np.arange(2)), [Status.OK, Status.OK]) == [Status.CORRUPT] * 2
