"""KVLayout over padded and strided KV tensors (issue 46): vLLM pads DeepSeek V4's 64 x 584 B = 37,376 B
block to a 37,440 B page, so every per-layer block tensor is strided. A chunk is the block's real bytes,
read in place through the strides, stored and loaded byte-exact; the page padding is never stored and
never written by a load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool.backends.base import Rows, Status
from kvpool.backends.memory import MemoryBackend
from kvpool.backends.mooncake.batch import _Batch
from kvpool.core.config import Integrity
from kvpool.core.masks import FullAttention
from kvpool.core.metadata import LoadSpec, RequestDelta
from kvpool.worker.layout import KVLayout
from kvpool.worker.worker_core import WorkerCore
from worker_fakes import FakeModel, RecordingBackend, start

PAGE, BLOCK = 37_440, 64 * 584  # DeepSeek V4's fp8_ds_mla page and block (576 B alignment)
PAD = 0xA5  # what the padding holds; no save may read it into a chunk, no load may overwrite it


def padded(num_blocks: int, seed: int, dtype: torch.dtype = torch.uint8) -> tuple[torch.Tensor, torch.Tensor]:
    """(the padded backing buffer, the engine's strided (num_blocks, 1, 64, 584 B) view of it)."""
    storage = torch.full((num_blocks * PAGE,), PAD, dtype=torch.uint8)
    element = torch.empty(0, dtype=dtype).element_size()
    typed = storage.view(dtype)
    row = 584 // element
    view = typed.as_strided((num_blocks, 1, 64, row), (PAGE // element, BLOCK // element, row, 1))
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (num_blocks, BLOCK), dtype=torch.uint8, generator=generator)
    for block in range(num_blocks):
        storage[block * PAGE : block * PAGE + BLOCK] = noise[block]
    return storage, view


def block_bytes(view: torch.Tensor, block: int) -> bytes:
    return view[block].contiguous().view(torch.uint8).numpy().tobytes()


def padding_intact(storage: torch.Tensor, num_blocks: int) -> bool:
    pages = storage.view(num_blocks, PAGE)
    return bool((pages[:, BLOCK:] == PAD).all())


def joined(rows: Rows, index: int) -> bytes:
    return b"".join(piece.tobytes() for piece in rows.value(index))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16])  # bf16 has no numpy dtype
def test_a_padded_page_is_one_row_of_the_blocks_bytes_read_in_place(dtype: torch.dtype) -> None:
    num_blocks = 6
    storage, view = padded(num_blocks, 1, dtype)
    assert not view.is_contiguous() and view.stride(0) * view.element_size() == PAGE
    layout = KVLayout({"model.layers.0.attn.swa_cache": view}, {"model.layers.0.attn.swa_cache": 0}, num_blocks)
    assert not layout.staged
    assert layout.chunk_nbytes(0) == BLOCK, "the padding is not part of a chunk"
    rows = layout.save_rows(0, [4, 1, 3])
    assert rows.row_bytes == [BLOCK]
    assert np.shares_memory(rows.arrays[0], storage.numpy()), "a host save reads the engine's memory, no copy"
    assert rows.arrays[0].strides == (PAGE, 1)
    assert [joined(rows, index) for index in range(3)] == [block_bytes(view, b) for b in (4, 1, 3)]
    # a copy the caller owns holds the same bytes, block by block and for many blocks at once
    for blocks in ([2], [5, 1, 2, 4]):
        copied = layout.copy_rows(0, blocks)
        assert [joined(copied, index) for index in range(len(blocks))] == [block_bytes(view, b) for b in blocks]


def test_a_load_in_place_writes_the_blocks_bytes_and_never_the_padding() -> None:
    num_blocks = 6
    storage, view = padded(num_blocks, 2)
    source_storage, source = padded(num_blocks, 3)
    layout = KVLayout({"swa": view}, {"swa": 0}, num_blocks)
    other = KVLayout({"swa": source}, {"swa": 0}, num_blocks)
    backend = MemoryBackend(16 << 20)
    keys = ["k1", "k2", "k3"]
    assert backend.put(keys, other.save_rows(0, [1, 2, 5])) == [Status.OK] * 3
    untouched = {block: block_bytes(view, block) for block in (1, 4)}
    dest = layout.load_rows(0, [3, 2, 5])  # in place: the pool writes the engine's rows
    assert backend.get_into(keys, dest) == [Status.OK] * 3
    layout.commit_rows(0, [3, 2, 5], dest, [True] * 3)
    assert [block_bytes(view, b) for b in (3, 2, 5)] == [block_bytes(source, b) for b in (1, 2, 5)]
    assert {block: block_bytes(view, block) for block in (1, 4)} == untouched
    assert padding_intact(storage, num_blocks) and padding_intact(source_storage, num_blocks)


@pytest.mark.parametrize("arrived", [[True, True, True], [True, False, True]])
@pytest.mark.parametrize("staged", [False, True])  # the host path, and the device path's staging ring
def test_an_owned_or_staged_load_commits_exactly_the_blocks_that_arrived(staged: bool, arrived: list[bool]) -> None:
    num_blocks = 6
    storage, view = padded(num_blocks, 4)
    _, source = padded(num_blocks, 5)
    layout = KVLayout({"swa": view}, {"swa": 0}, num_blocks, staged=staged)
    assert layout.staged is staged and layout.chunk_nbytes(0) == BLOCK
    saved = layout.save_rows(0, [1, 2])
    assert [joined(saved, 0), joined(saved, 1)] == [block_bytes(view, 1), block_bytes(view, 2)]
    before = {block: block_bytes(view, block) for block in range(1, num_blocks)}
    blocks = [4, 1, 3]
    dest = layout.load_rows(0, blocks, owned=True)
    for index, block in enumerate([2, 5, 3]):
        dest.value(index)[0][:] = np.frombuffer(block_bytes(source, block), dtype=np.uint8)
    layout.commit_rows(0, blocks, dest, arrived)
    for block, src, ok in zip(blocks, [2, 5, 3], arrived):
        assert block_bytes(view, block) == (block_bytes(source, src) if ok else before[block])
    assert block_bytes(view, 2) == before[2] and block_bytes(view, 5) == before[5]
    assert padding_intact(storage, num_blocks)


def test_sealed_rows_cover_the_blocks_bytes_only() -> None:
    num_blocks = 5
    storage, view = padded(num_blocks, 6)
    layout = KVLayout({"swa": view}, {"swa": 0}, num_blocks, integrity=Integrity.FULL)
    rows = layout.save_rows(0, [2, 3])
    assert layout.stored_nbytes(0) == BLOCK + 8 and rows.row_bytes == [BLOCK, 8]
    backend = MemoryBackend(8 << 20)
    assert backend.put(["a", "b"], rows) == [Status.OK] * 2
    dest = layout.load_rows(0, [4, 1])
    statuses = layout.verify(0, dest, backend.get_into(["a", "b"], dest))
    assert statuses == [Status.OK] * 2
    layout.commit_rows(0, [4, 1], dest, [True, True])
    assert [block_bytes(view, 4), block_bytes(view, 1)] == [block_bytes(view, 2), block_bytes(view, 3)]
    assert padding_intact(storage, num_blocks)


def test_kv_outer_padded_numpy_halves_and_narrow_rows_by_every_copy_route() -> None:
    """(2, num_blocks, ...) K/V outermost, each block padded, as a numpy view: the numpy gather and
    scatter (many narrow blocks) and the block-by-block route give the same bytes."""
    num_blocks, width, page = 8, 24, 32
    backing = np.full((2, num_blocks, page), PAD, dtype=np.uint8)
    rng = np.random.default_rng(7)
    backing[:, :, :width] = rng.integers(0, 255, (2, num_blocks, width), dtype=np.uint8)
    kv = np.lib.stride_tricks.as_strided(backing, (2, num_blocks, 3, 8), (num_blocks * page, page, 8, 1))
    layout = KVLayout({"kv": kv}, {"kv": 0}, num_blocks)
    assert layout.chunk_nbytes(0) == 2 * width
    for blocks in ([3], [7, 2, 5, 1, 3]):
        want = [backing[0, b, :width].tobytes() + backing[1, b, :width].tobytes() for b in blocks]
        copied = layout.copy_rows(0, blocks)
        assert [joined(copied, index) for index in range(len(blocks))] == want
        dest = layout.load_rows(0, [6, 4, 1, 2, 5][: len(blocks)], owned=True)
        dest.arrays[0][:] = copied.arrays[0]
        layout.commit_rows(0, [6, 4, 1, 2, 5][: len(blocks)], dest, [True] * len(blocks))
        assert [joined(layout.save_rows(0, [b]), 0) for b in [6, 4, 1, 2, 5][: len(blocks)]] == want
    assert (backing[:, :, width:] == PAD).all()
    # as_strided hides the owning array: the storage listed is what the view spans (its last page's
    # padding lies past it), every byte kvpool reads or writes
    assert layout.storages() == [(backing.ctypes.data, backing.nbytes - (page - width))]


def test_a_block_spread_over_its_storage_is_several_rows_in_address_order() -> None:
    """Heads outside blocks ((H, num_blocks, N, C) viewed as (num_blocks, H, N, C)): a block is H runs;
    the host rows hold them in address order, as the device path's staged copy does."""
    num_blocks, heads = 5, 3
    torch.manual_seed(0)
    backing = torch.randn(heads, num_blocks, 4, 2)
    view = backing.permute(1, 0, 2, 3)
    direct = KVLayout({"x": view}, {"x": 0}, num_blocks)
    staged = KVLayout({"x": view}, {"x": 0}, num_blocks, staged=True)
    assert direct.chunk_nbytes(0) == staged.chunk_nbytes(0) == heads * 4 * 2 * 4
    rows = direct.save_rows(0, [1, 4])
    assert len(rows.arrays) == heads
    staged_rows = staged.save_rows(0, [1, 4])
    for index, block in enumerate([1, 4]):
        assert joined(rows, index) == joined(staged_rows, index) == view[block].contiguous().numpy().tobytes()


def test_strides_that_repeat_or_overlap_blocks_are_refused_by_layer() -> None:
    from kvpool.core.errors import LayoutError

    base = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(LayoutError, match=r"layer 'x'.*zero stride"):
        KVLayout({"x": base.as_strided((4, 2, 8), (8, 0, 1))}, {"x": 0}, 4)
    with pytest.raises(LayoutError, match=r"layer 'y'.*overlap"):
        KVLayout({"y": base.as_strided((4, 16), (8, 1))}, {"y": 0}, 4)


def test_mooncake_addresses_of_padded_rows_step_by_the_page() -> None:
    """Mooncake moves a Rows batch in place from each row's address: row stride, not row width."""
    num_blocks = 4
    storage, view = padded(num_blocks, 8)
    rows = KVLayout({"swa": view}, {"swa": 0}, num_blocks).save_rows(0, [1, 3])
    batch = _Batch(["a", "b"], rows, writable=False, staging_bytes=0)
    base = int(storage.data_ptr())
    assert batch.ptrs == [[base + PAGE], [base + 3 * PAGE]]
    assert batch.totals == [BLOCK, BLOCK]


def test_worker_core_saves_and_loads_padded_blocks_byte_exact(closing: list[WorkerCore]) -> None:
    """Through the whole worker: saves store each block's bytes, a load of the prefix into other blocks
    fills exactly them, and no padding byte is ever stored or written."""
    num_blocks, width, page = 64, 8, 24
    model = FakeModel([FullAttention(16)], num_blocks=num_blocks)
    backings = {name: np.full((num_blocks, page), PAD, dtype=np.uint8) for name in model.tensors}
    for backing in backings.values():
        backing[:, :width] = 0
    model.tensors = {name: backing[:, :width] for name, backing in backings.items()}  # rows 24 B apart
    model.layout = KVLayout(model.tensors, {name: 0 for name in model.tensors}, num_blocks)
    backend = RecordingBackend()
    engine = model.engine(backend)
    closing.append(engine)
    tokens = 128
    hashes = model.hashes("prefix", tokens)
    tables = model.tables(tokens)
    expected = model.fill("prefix", tables, hashes)
    start(engine, "writer", hashes, tables)
    engine.save_request("writer", tokens)
    assert engine.drain(5)
    engine.finish(["writer"])
    for chunk in range(8):
        key = model.key(0, hashes, chunk)
        assert backend.stored(key, 2 * width) == expected[key]
    reader = model.tables(tokens + 16)
    delta = RequestDelta(
        "reader",
        new_hashes=hashes,
        new_blocks=reader,
        num_prompt_tokens=tokens + 16,
        stored_tokens=tokens,
        load=LoadSpec(0, tokens),
    )
    engine.apply([delta])
    assert engine.drain(5)
    assert engine.take_finished_loads() == {"reader"}
    for chunk in range(8):
        assert model.read(0, reader[0][chunk]) == expected[model.key(0, hashes, chunk)]
    assert model.read(0, reader[0][8]) == bytes(2 * width)
    assert all((backing[:, width:] == PAD).all() for backing in backings.values())
