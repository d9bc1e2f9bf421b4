"""KVLayout: block pieces per group, shared storages, staging, bad shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool.core.errors import LayoutError
from kvpool.worker.layout import KVLayout


def joined(pieces: list) -> bytes:  # type: ignore[type-arg]
    return b"".join(np.asarray(p).reshape(-1).view(np.uint8).tobytes() for p in pieces)


def saved(layout: KVLayout, group: int, block: int) -> bytes:
    return joined(layout.save_rows(group, [block]).value(0))


def test_blocks_first_and_kv_outer_layers() -> None:
    num_blocks = 6
    first = np.arange(num_blocks * 8, dtype=np.uint16).reshape(num_blocks, 2, 4)  # 16 B per block
    outer = np.arange(2 * num_blocks * 3, dtype=np.float32).reshape(2, num_blocks, 3)  # 2 × 12 B per block
    other = np.full((num_blocks, 5), 7, dtype=np.uint8)
    layout = KVLayout({"a": first, "b": outer, "c": other}, {"a": 0, "b": 0, "c": 1}, num_blocks)
    assert layout.num_groups == 2
    assert layout.chunk_nbytes(0) == 16 + 24
    assert layout.chunk_nbytes(1) == 5
    assert not layout.staged
    rows = layout.save_rows(0, [3, 1])
    assert len(rows) == 2 and rows.row_bytes == [16, 12, 12]
    assert joined(rows.value(0)) == first[3].tobytes() + outer[0, 3].tobytes() + outer[1, 3].tobytes()
    assert joined(rows.value(1)) == first[1].tobytes() + outer[0, 1].tobytes() + outer[1, 1].tobytes()
    assert saved(layout, 1, 2) == other[2].tobytes()
    # host rows are views: writing a loaded row writes the engine's tensor
    dest = layout.load_rows(0, [5])
    for piece in dest.value(0):
        piece[:] = 0xAB
    layout.commit_rows(0, [5], dest, [True])
    assert (first[5] == 0xABAB).all()
    assert (outer[:, 5].view(np.uint8) == 0xAB).all()
    assert (first[4] != 0xABAB).any()


def test_staged_copy_matches_zero_copy() -> None:
    num_blocks = 5
    torch.manual_seed(0)
    k = torch.randn(2, num_blocks, 4, 3)  # K/V outermost
    v = torch.randn(num_blocks, 6, dtype=torch.float64)
    direct = KVLayout({"k": k, "v": v}, {"k": 0, "v": 0}, num_blocks)
    staged = KVLayout({"k": k, "v": v}, {"k": 0, "v": 0}, num_blocks, staged=True)
    assert staged.staged and not direct.staged
    assert direct.chunk_nbytes(0) == staged.chunk_nbytes(0) == 2 * 4 * 3 * 4 + 6 * 8
    blocks = list(range(1, num_blocks))
    staged_rows = staged.save_rows(0, blocks)
    for index, block in enumerate(blocks):
        assert joined(staged_rows.value(index)) == saved(direct, 0, block)
    # a staged load lands in the tensors only at commit, and only for the blocks that arrived
    want = saved(direct, 0, 1)
    before = saved(direct, 0, 2)
    dest = staged.load_rows(0, [4, 2])
    assert len(dest.arrays) == 1 and dest.row_bytes == [len(want)]
    dest.value(0)[0][:] = np.frombuffer(want, dtype=np.uint8)
    dest.value(1)[0][:] = 0
    assert saved(direct, 0, 4) != want
    staged.commit_rows(0, [4, 2], dest, [True, False])
    assert saved(direct, 0, 4) == want
    assert saved(direct, 0, 2) == before, "a block that did not arrive is left as it was"
    assert torch.equal(k[:, 4], k[:, 1]) and torch.equal(v[4], v[1])


@pytest.mark.parametrize("width", [8, 16 << 10])  # narrow rows, and rows wide enough to copy block by block
@pytest.mark.parametrize("count", [1, 2, 5])  # one or two blocks go block by block, more by numpy's gather
def test_a_host_copy_holds_each_block_in_layer_order_whatever_the_copy_route(width: int, count: int) -> None:
    num_blocks = 8
    rng = np.random.default_rng(width + count)
    k = rng.integers(0, 255, (num_blocks, width), dtype=np.uint8)
    v = rng.integers(0, 255, (2, num_blocks, width // 2), dtype=np.uint8)  # K/V outermost
    layout = KVLayout({"k": k, "v": v}, {"k": 0, "v": 0}, num_blocks)
    blocks = [7, 2, 5, 1, 3][:count]
    want = [k[block].tobytes() + v[0, block].tobytes() + v[1, block].tobytes() for block in blocks]
    copied = layout.copy_rows(0, blocks)
    k[:] = 0  # the engine reuses the blocks: the copy keeps what they held
    v[:] = 0
    assert [joined(copied.value(index)) for index in range(count)] == want
    dest = layout.load_rows(0, blocks, owned=True)  # and back, all blocks in one commit, by the same route
    dest.arrays[0][:] = copied.arrays[0]
    layout.commit_rows(0, blocks, dest, [True] * count)
    assert [saved(layout, 0, block) for block in blocks] == want
    assert not k[[b for b in range(1, num_blocks) if b not in blocks]].any(), "no other block is written"


@pytest.mark.parametrize("arrived", [[True, True, True], [True, False, True], [False, True, False]])
def test_owned_host_rows_commit_exactly_the_blocks_that_arrived(arrived: list[bool]) -> None:
    num_blocks = 6
    first = np.arange(num_blocks * 8, dtype=np.uint16).reshape(num_blocks, 2, 4)
    outer = np.arange(2 * num_blocks * 3, dtype=np.float32).reshape(2, num_blocks, 3)
    layout = KVLayout({"a": first, "b": outer}, {"a": 0, "b": 0}, num_blocks)
    blocks = [4, 1, 3]
    before = {block: saved(layout, 0, block) for block in range(1, num_blocks)}
    dest = layout.load_rows(0, blocks, owned=True)  # a buffer the caller owns: nothing lands before commit
    sources = [2, 5, 2]  # each target gets another block's bytes, told apart by where they come from
    for index, source in enumerate(sources):
        dest.value(index)[0][:] = np.frombuffer(before[source], dtype=np.uint8)
    assert all(saved(layout, 0, block) == before[block] for block in blocks)
    layout.commit_rows(0, blocks, dest, arrived)
    for block, source, ok in zip(blocks, sources, arrived):
        assert saved(layout, 0, block) == (before[source] if ok else before[block])
    untouched = set(range(1, num_blocks)) - set(blocks)
    assert all(saved(layout, 0, block) == before[block] for block in untouched)


def test_staged_save_is_a_copy() -> None:
    tensor = torch.zeros(3, 4, dtype=torch.uint8)
    layout = KVLayout({"x": tensor}, {"x": 0}, 3, staged=True)
    tensor[1] = 5
    rows = layout.save_rows(0, [1])
    tensor[1] = 9  # the engine overwrites the block after the copy
    assert joined(rows.value(0)) == bytes([5] * 4)


def test_shared_storage_is_listed_once() -> None:
    big = np.zeros((4, 2, 8), dtype=np.uint8)
    layer0, layer1 = big[:, 0], big[:, 1]  # two layers interleaved in one storage: strided, read in place
    interleaved = KVLayout({"l0": layer0, "l1": layer1}, {"l0": 0, "l1": 1}, 4)
    assert interleaved.storages() == [(big.ctypes.data, big.nbytes)]
    big[2, 1] = 9
    assert saved(interleaved, 1, 2) == bytes([9] * 8) and saved(interleaved, 0, 2) == bytes(8)
    whole = np.zeros(2 * 4 * 8, dtype=np.uint8)
    a, b = whole[:32].reshape(4, 8), whole[32:].reshape(4, 8)
    layout = KVLayout({"a": a, "b": b}, {"a": 0, "b": 1}, 4)
    assert layout.storages() == [(whole.ctypes.data, whole.nbytes)]
    t = torch.zeros(2, 4, 8)
    torch_layout = KVLayout({"x": t[0], "y": t[1]}, {"x": 0, "y": 0}, 4)
    assert torch_layout.storages() == [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())]


def test_bad_layouts() -> None:
    with pytest.raises(LayoutError, match="no KV tensors"):
        KVLayout({}, {}, 4)
    with pytest.raises(LayoutError, match=r"\['b'\]"):
        KVLayout({"a": np.zeros((4, 2)), "b": np.zeros((4, 2))}, {"a": 0}, 4)
    with pytest.raises(LayoutError, match="expected"):
        KVLayout({"a": np.zeros((3, 2))}, {"a": 0}, 4)
    layout = KVLayout({"a": np.zeros((4, 2), dtype=np.uint8)}, {"a": 0}, 4)
    for block in (0, 4, -1):  # block 0 is the null block: never saved from or loaded into
        with pytest.raises(LayoutError, match=rf"\[{block}\] of group 0 are outside 1..3"):
            layout.save_rows(0, [1, block])
        with pytest.raises(LayoutError, match="outside"):
            layout.load_rows(0, [block])
