"""The engine's KV memory: per-layer tensors (possibly sharing storage), layer → group, and for a
block the memory pieces that make up its chunk. Whole blocks only: some backends pack K/V inside a
block (the CPU backend per instruction set), so bytes are copied block-wise, never token-wise."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from math import prod
from typing import Any

import numpy as np
from numpy.lib.array_utils import byte_bounds

from kvpool.backends.base import Rows, Status, _bounds
from kvpool.core.buffers import as_u8
from kvpool.core.config import Integrity
from kvpool.core.errors import LayoutError
from kvpool.worker.cuda_runtime import Event, InlineRuntime, Runtime, TorchCuda
from kvpool.worker.device_copy import (
    DEVICE_BUFFER_BYTES,
    DeviceCopier,
    HostSlot,
    RunView,
    Staged,
    StagingFull,
    byte_runs,
)
from kvpool.worker.integrity import SEAL_BYTES, Sealer

DEFAULT_STAGING_BYTES = 64 << 20

NULL_BLOCK_ID = 0  # the engine's placeholder block: never stored from, never loaded into
# Host copies between the engine's blocks and a row per block go one of two routes: a slice copy per block
# and layer (a cheap call each), or numpy per layer (a dearer call; its gather `rows[:, layer] = view[ids]`
# also writes a temporary it copies again, its scatter `view[ids] = rows[:, layer]` does not). Block by
# block wins both ways for one or two blocks (a decode step's), and a save's copy from rows this wide on;
# numpy wins for many narrow blocks, and its scatter from three blocks on (measured 2026-12-06).
PER_BLOCK_MAX_BLOCKS = 2
PER_BLOCK_MIN_BYTES = 16 << 10


class KVLayout:
    """Maps (group, block id) to the byte pieces of that block in every layer of the group.

    Host tensors are addressed in place (zero copy), through their strides: a row is a block's bytes
    wherever the tensor's strides put them, e.g. a page padded past its block (vLLM pads DeepSeek V4's
    37,376 B block to a 37,440 B page) is a row of the block's bytes whose padding is never stored
    and never written by a load (`_host_views`). Device tensors go through a host staging ring on
    copy streams (device_copy.py): `capture_rows` starts a copy out and returns at once; its bytes are
    valid after `Staged.wait` (the sender's thread waits, never the engine's).

    With `integrity` on, every value this layout hands out ends with the chunk's seal: saves compute
    it, loads read it, and `verify` checks it before `commit_rows` (integrity.py).

    Shapes: per layer (num_blocks, ...) or (2, num_blocks, ...) (K and V outermost), in any strides
    (vLLM 0.32 on GPU views one int8 backing buffer per layer, [B, H, N, C] in the layout's order), and
    (num_blocks * r, ...) where vLLM split each block into r kernel blocks (viewed as (num_blocks, r,
    ...)). A 1-D raw buffer (a spec without per-layer views) is refused by name."""

    def __init__(
        self,
        tensors: Mapping[str, Any],
        layer_groups: Mapping[str, int],
        num_blocks: int,
        *,
        staged: bool | None = None,
        integrity: Integrity = Integrity.OFF,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        runtime: Runtime | None = None,
        device_bytes: int = DEVICE_BUFFER_BYTES,
    ) -> None:
        if not tensors:
            raise LayoutError("no KV tensors were registered")
        missing = sorted(set(tensors) - set(layer_groups))
        if missing:
            raise LayoutError(f"layers {missing} have no KV cache group")
        self.num_blocks = num_blocks
        self.num_groups = max(layer_groups.values()) + 1
        self._views: list[list[Any]] = [[] for _ in range(self.num_groups)]
        first = next(iter(tensors.values()))
        self.staged = staged if staged is not None else not _is_host(first)
        pieces: list[list[tuple[Any, Any, int, int, int]]] = [[] for _ in range(self.num_groups)]
        for name, tensor in tensors.items():
            shape = tuple(tensor.shape)
            kv_outer = False
            if len(shape) == 1 and shape[0] != num_blocks:
                raise LayoutError(
                    f"layer {name!r} is a raw KV buffer of {shape[0]} bytes (a vLLM KV cache spec without "
                    "per-layer views, laid out by the spec itself): kvpool does not support such specs"
                )
            if shape and shape[0] == num_blocks:
                pass
            elif len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks:
                kv_outer = True
            elif len(shape) > 1 and num_blocks and shape[0] > num_blocks and shape[0] % num_blocks == 0:
                tensor = (
                    tensor.reshape(num_blocks, shape[0] // num_blocks, *shape[1:])
                    if isinstance(tensor, np.ndarray)
                    else tensor.unflatten(0, (num_blocks, shape[0] // num_blocks))
                )  # kernel blocks
            else:
                raise LayoutError(
                    f"layer {name!r} has shape {shape}: expected ({num_blocks}, ...), (2, {num_blocks}, ...) "
                    f"or ({num_blocks} x kernel blocks per block, ...)"
                )
            group = layer_groups[name]
            halves = [tensor[0], tensor[1]] if kv_outer else [tensor]
            for half in halves:
                try:
                    if self.staged:
                        pieces[group].extend(_block_pieces(half))
                        self._views[group].append(half)
                    else:  # one view per dense byte run of a block: one unless a block's bytes are spread
                        self._views[group].extend(_host_views(half, num_blocks))
                except TypeError as exc:  # strides kvpool cannot address, or not host memory: say which layer
                    raise LayoutError(f"layer {name!r}: {exc}") from exc
        self._view_tuples = [tuple(views) for views in self._views]
        # per group: a save's copy goes block by block whatever the count (host rows this wide or wider)
        self._wide_rows = [
            not self.staged and min((_block_nbytes(view) for view in views), default=0) >= PER_BLOCK_MIN_BYTES
            for views in self._views
        ]
        self._runs: list[list[RunView]] = [
            [RunView(*run, num_blocks) for run in byte_runs(group_pieces)] for group_pieces in pieces
        ]
        self._block_bytes = [sum(_block_nbytes(v) for v in views) for views in self._views]
        if self.staged:
            self._block_bytes = [sum(run.nbytes for run in runs) for runs in self._runs]
        self._storages = _distinct_storages(tensors.values())
        self._sealers = [Sealer(nbytes, integrity) for nbytes in self._block_bytes]
        self.sealed = integrity is not Integrity.OFF
        # the seal column of in-place values, one per direction: a save and a load never share a block
        self._save_seals = [np.zeros((num_blocks, SEAL_BYTES), np.uint8) for _ in self._sealers] if self.sealed else []
        self._load_seals = [np.zeros((num_blocks, SEAL_BYTES), np.uint8) for _ in self._sealers] if self.sealed else []
        # groups whose blocks are rows of the very same arrays (vLLM's hybrid allocation gives each layer
        # slot one tensor that every group's layer in it shares): their values travel as one `Rows`
        self._row_groups = list(range(self.num_groups))
        if not self.staged and not self.sealed:
            first_of: dict[tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...], int] = {}
            for group, views in enumerate(self._views):
                signature = tuple((int(view.ctypes.data), view.shape, view.strides) for view in views)
                self._row_groups[group] = first_of.setdefault(signature, group)
        self._copier: DeviceCopier | None = None
        if self.staged:
            largest = max(self._block_bytes) if self._block_bytes else 0
            if runtime is None:
                runtime = InlineRuntime() if _is_host(first) else TorchCuda(first.device)
            self._copier = DeviceCopier(runtime, staging_bytes, device_bytes, min_load_bytes=largest * 8)
        # the pinned slot under each load's rows (the loader's thread and the engine's both load)
        self._loading: weakref.WeakKeyDictionary[Rows, HostSlot] = weakref.WeakKeyDictionary()
        self._loading_lock = threading.Lock()

    def chunk_nbytes(self, group: int) -> int:
        """The bytes of one block of the group in every layer (without its seal)."""
        return self._block_bytes[group]

    def row_group(self, group: int) -> int:
        """The lowest group whose `save_rows` address the same arrays as this group's: blocks of both can
        go in one `save_rows` of it (the group itself unless it shares every array with an earlier one)."""
        return self._row_groups[group]

    def stored_nbytes(self, group: int) -> int:
        """What the pool holds per chunk of the group: its bytes, then its seal when sealed."""
        return self._sealers[group].stored_bytes

    def storages(self) -> list[tuple[int, int]]:
        """(address, bytes) of each distinct storage of the engine's KV tensors."""
        return self._storages

    def memory_regions(self) -> list[tuple[int, int]]:
        """(address, bytes) of every region a pool transfer reads or writes: the KV storages and, for
        device memory, the host staging ring (for backends that register memory, e.g. RDMA)."""
        regions = list(self._storages)
        if self._copier is not None:
            ring = self._copier.host_buffer
            regions.append((int(ring.data_ptr()), int(ring.numel())))
        return regions

    def save_rows(self, group: int, block_ids: Sequence[int]) -> Rows:
        """The blocks' bytes in every layer of the group, as one value per block. Host memory is
        addressed in place; device memory is copied out to the host before this returns."""
        ids = self._ids(group, block_ids)
        views = self._views[group]
        if not self.staged:
            if not self.sealed and views:
                # the views are 2-D uint8 arrays of num_blocks contiguous rows, ids in 1..num_blocks - 1
                return Rows.checked(self._view_tuples[group], ids)
            rows = Rows(tuple(views), ids)
            seals = self._save_seals[group]
            seals[ids] = self._sealers[group].seal_column(rows)
            return Rows((*views, seals), ids)
        rows, staged = self.capture_rows(group, block_ids)
        if staged is not None:
            staged.wait()
        return rows

    def capture_rows(self, group: int, block_ids: Sequence[int]) -> tuple[Rows, Staged | None]:
        """A host copy of the blocks the caller owns, and for device memory the copy still running:
        the bytes are valid after `Staged.wait()`. Raises StagingFull when the staging ring is full."""
        if not self.staged:
            return self.copy_rows(group, block_ids), None
        assert self._copier is not None
        ids = self._ids(group, block_ids)
        sealer = self._sealers[group]
        seal_bytes = sealer.stored_bytes - self._block_bytes[group]
        staged = self._copier.save(self._runs[group], ids, self._block_bytes[group], seal_bytes)
        if staged is None:
            raise StagingFull(f"{len(ids)} blocks of group {group}: the host staging ring is full of copies in flight")
        blocks, seals = staged.host, staged.seals
        if seals is not None:
            staged.then = lambda: seals.__setitem__(
                slice(None), sealer.seal_column(Rows((blocks,), np.arange(len(blocks))))
            )
            return Rows((blocks, seals), np.arange(len(ids))), staged
        return Rows((blocks,), np.arange(len(ids))), staged

    def copy_rows(self, group: int, block_ids: Sequence[int], out: np.ndarray | None = None) -> Rows:
        """Like `save_rows`, but always a host copy the caller owns: the engine may reuse the blocks
        as soon as this returns. Host memory only: `out`, a C-contiguous uint8 array of one row per
        block and `stored_nbytes(group)` columns, receives the copy (several groups' blocks can share
        one array, and so one pool call)."""
        if self.staged:
            if out is not None:
                raise ValueError("copy_rows(out=...): device memory is copied through the staging ring")
            return self.save_rows(group, block_ids)  # copied out of device memory, waited for
        ids = self._ids(group, block_ids)
        # one contiguous row per chunk, seal included: Mooncake moves it as one piece (batch_put_from), not
        # as a piece per layer, and the copy is cheaper than a fresh array per layer
        shape = (len(ids), self.stored_nbytes(group))
        if out is not None and (out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous):
            raise ValueError(
                f"copy_rows out: shape {out.shape}, dtype {out.dtype}: expected a C-contiguous uint8 array of shape "
                f"{shape} (a row per block of group {group})"
            )
        copies = np.empty(shape, dtype=np.uint8) if out is None else out
        views = self._views[group]
        if len(ids) <= PER_BLOCK_MAX_BLOCKS or self._wide_rows[group]:
            for row, block in zip(copies, ids.tolist()):
                _gather_block(row, views, block)
        else:
            offset = 0
            for view in views:
                copies[:, offset : offset + view.shape[1]] = view[ids]
                offset += view.shape[1]
        rows = Rows.checked((copies,), np.arange(len(ids)))
        if self.sealed:  # seals cover the block's bytes, before them in the row
            copies[:, self._block_bytes[group] :] = self._sealers[group].seal_column(rows)
        return rows

    def load_rows(self, group: int, block_ids: Sequence[int], *, owned: bool = False) -> Rows:
        """Where the blocks' bytes go, one value per block; call `commit_rows` once they are filled.
        Host memory is filled in place unless `owned`: then (as always for device memory) a host buffer
        the caller owns, so a read that never returns can never write the engine's blocks."""
        ids = self._ids(group, block_ids)
        if not self.staged and not owned:
            views = tuple(self._views[group])
            return Rows((*views, self._load_seals[group]) if self.sealed else views, ids)
        if self._copier is None:
            return Rows((np.empty((len(ids), self.stored_nbytes(group)), dtype=np.uint8),), np.arange(len(ids)))
        seal_bytes = self.stored_nbytes(group) - self._block_bytes[group]
        for _ in range(100):
            slot = self._copier.host_slot(len(ids), self._block_bytes[group], seal_bytes, load=True)
            if slot is not None:
                rows = Rows(slot.arrays, np.arange(len(ids)))
                with self._loading_lock:
                    self._loading[rows] = slot
                return rows
            if not owned:  # the engine's thread never waits for the device: this load is not done
                break
            self._copier.wait_for_load_room()  # the loader's thread: wait for the oldest load copy
        raise StagingFull(
            f"{len(ids)} blocks of group {group}: the host staging ring has no room for a load among its copies in "
            "flight (loads on the engine's thread never wait for it: these chunks are recomputed; loads have a "
            "reserved quarter of save_buffer_bytes and any free save space)"
        )

    def verify(self, group: int, rows: Rows, statuses: Sequence[Status]) -> list[Status]:
        """`statuses` of a read into `rows` (from `load_rows`), with every chunk whose seal does not
        match its bytes made CORRUPT. Call before `commit_rows`."""
        return self._sealers[group].verify(rows, statuses)

    def engine_point(self) -> Event | None:
        """For device memory, an event marking the engine's work queued so far on this thread's stream
        (take it on the engine's thread when a load starts, pass it to `commit_rows`); None on the host."""
        return self._copier.engine_point() if self._copier is not None else None

    def commit_rows(
        self,
        group: int,
        block_ids: Sequence[int],
        rows: Rows,
        arrived: Sequence[bool],
        after: Event | None = None,
    ) -> Event | None:
        """Move the blocks that `arrived` from a `load_rows` host buffer into the engine's memory. For
        device memory the copy runs on the load stream, the calling thread's current stream waits for
        it on the device, and the returned event says when it is done (a load reported finished to the
        engine from another thread must wait for it first)."""
        views = self._views[group]
        if not self.staged and rows.arrays[0] is views[0]:
            return None  # filled in place
        keep = [index for index, ok in enumerate(arrived) if ok]
        if not keep:
            return None
        if not self.staged:
            # scattered from the read's own rows: a gathered copy of them first (`host[keep]`) cost 3x the
            # scatter (a hit's whole bytes copied twice on the engine's thread)
            whole = len(keep) == len(arrived) == rows.arrays[0].shape[0]
            targets = self._ids(group, block_ids if whole else [block_ids[index] for index in keep])
            if len(keep) <= PER_BLOCK_MAX_BLOCKS:
                for index, block in zip(keep, targets.tolist()):
                    _scatter_block(views, block, rows.arrays[0][index])
                return None
            host = rows.arrays[0] if whole else rows.arrays[0][np.asarray(keep, dtype=np.int64)]
            offset = 0
            for view in views:
                view[targets] = host[:, offset : offset + view.shape[1]]
                offset += view.shape[1]
            return None
        assert self._copier is not None
        with self._loading_lock:
            slot = self._loading.get(rows)
        if slot is None:
            raise LayoutError("commit_rows: these rows did not come from load_rows of this layout")
        blocks = self._ids(group, [block_ids[index] for index in keep]).tolist()
        picks = keep if len(keep) < len(arrived) else None
        return self._copier.load(self._runs[group], slot, blocks, picks, after)

    def _ids(self, group: int, block_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if len(ids) and ((bounds := _bounds(ids))[0] <= NULL_BLOCK_ID or bounds[1] >= self.num_blocks):
            bad = [int(i) for i in ids if not 0 < i < self.num_blocks]
            raise LayoutError(f"block ids {bad} of group {group} are outside 1..{self.num_blocks - 1}")
        return ids


def _gather_block(row: np.ndarray, views: Sequence[np.ndarray], block: int) -> None:
    """One block's bytes in every layer, in layer order, into the front of `row`."""
    offset = 0
    for view in views:
        width = view.shape[1]
        row[offset : offset + width] = view[block]
        offset += width


def _scatter_block(views: Sequence[np.ndarray], block: int, row: np.ndarray) -> None:
    """The inverse of `_gather_block`: the front of `row` into the block in every layer."""
    offset = 0
    for view in views:
        width = view.shape[1]
        view[block] = row[offset : offset + width]
        offset += width


def _is_host(tensor: Any) -> bool:
    device = getattr(tensor, "device", None)
    return device is None or getattr(device, "type", "cpu") == "cpu"


def _block_nbytes(view: Any) -> int:
    if isinstance(view, np.ndarray):
        return int(view.shape[1])
    return int(view[0].numel() * view.element_size())


def _block_pieces(half: Any) -> list[tuple[Any, Any, int, int, int]]:
    """(storage key, tensor, byte offset of block 0, block stride, width) of every dense byte run that
    makes up one block of `half` (num_blocks, ...), in address order: one for a contiguous block in
    any dim order, several when a block is spread (e.g. heads outside blocks)."""
    element = half.element_size()
    strides = [stride * element for stride in half.stride()]
    runs = _block_runs(tuple(half.shape), strides, element)
    key = half.untyped_storage().data_ptr()
    start = half.storage_offset() * element
    return [(key, half, start + offset, strides[0], width) for offset, width in runs]


def _host_views(half: Any, num_blocks: int) -> list[np.ndarray]:
    """The blocks of one (num_blocks, ...) host tensor as 2-D uint8 views (num_blocks, width) of its
    memory, one per dense byte run of a block, in address order. Zero copy: a row is the block's bytes
    read through the tensor's strides. A contiguous tensor is one view of C-contiguous rows; a padded
    page (vLLM pads DeepSeek V4's 37,376 B block to a 37,440 B page, so stride(0) is wider than the
    block) is one view whose rows stand `stride(0)` bytes apart: the padding lies outside every row, so
    no save reads it and no load writes it."""
    contiguous = half.flags.c_contiguous if isinstance(half, np.ndarray) else half.is_contiguous()
    if contiguous or not half.shape:
        return [as_u8(half).reshape(num_blocks, -1)]
    if isinstance(half, np.ndarray):
        element, strides, address = half.itemsize, list(half.strides), int(half.ctypes.data)
        readonly = not half.flags.writeable
    else:
        if half.device.type != "cpu":
            raise TypeError(f"buffer on {half.device} is not host memory; stage it first")
        element = half.element_size()
        strides, address, readonly = [stride * element for stride in half.stride()], int(half.data_ptr()), False
    runs = _block_runs(tuple(half.shape), strides, element)
    return [
        np.asarray(_ByteRows(half, address + offset, (num_blocks, width), (strides[0], 1), readonly))
        for offset, width in runs
    ]


class _ByteRows:
    """A 2-D uint8 array interface over host memory `owner` holds (numpy keeps this object, and so
    `owner`, alive as the view's base): numpy's own `as_strided` in the one form kvpool needs, for
    numpy arrays and torch tensors alike (bfloat16 and fp8 tensors have no numpy dtype)."""

    def __init__(self, owner: Any, address: int, shape: tuple[int, int], strides: tuple[int, int], readonly: bool):
        self.owner = owner
        self.__array_interface__ = {
            "version": 3,
            "typestr": "|u1",
            "data": (address, readonly),
            "shape": shape,
            "strides": strides,
        }


def _block_runs(shape: tuple[int, ...], strides: Sequence[int], element: int) -> list[tuple[int, int]]:
    """(byte offset from the block's start, width) of every dense byte run of one block of a tensor of
    `shape` (num_blocks, ...) and byte `strides`, in address order. TypeError for strides whose blocks
    overlap themselves or each other (negative, or zero on a dim of several elements)."""
    if any(stride < 0 for stride in strides):
        raise TypeError(f"tensor of byte strides {tuple(strides)} has negative strides")
    if any(stride == 0 and size > 1 for size, stride in zip(shape, strides)):
        raise TypeError(f"tensor of shape {shape} and byte strides {tuple(strides)} repeats elements (a zero stride)")
    out: list[tuple[int, int]] = []

    def split(offset: int, dims: list[tuple[int, int]]) -> None:
        dims = [(size, stride) for size, stride in dims if size != 1]
        if _dense(dims, element):
            out.append((offset, prod(size for size, _ in dims) * element))
            return
        outer = max(range(len(dims)), key=lambda index: dims[index][1])
        size, stride = dims[outer]
        for index in range(size):
            split(offset + index * stride, dims[:outer] + dims[outer + 1 :])

    split(0, list(zip(shape[1:], strides[1:])))
    width = sum(run_width for _, run_width in out)
    if shape[0] > 1 and len(out) == 1 and strides[0] < width:
        raise TypeError(
            f"tensor of shape {shape}: blocks of {width} bytes stand {strides[0]} bytes apart (they overlap)"
        )
    return out


def _dense(dims: list[tuple[int, int]], element: int) -> bool:
    """Do dims (size, byte stride) cover one run of elements without a gap?"""
    expected = element
    for size, stride in sorted(dims, key=lambda dim: dim[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _distinct_storages(tensors: Any) -> list[tuple[int, int]]:
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, np.ndarray):
            base = tensor  # the array owning the memory (a view made by as_strided has a non-array base)
            while isinstance(base.base, np.ndarray):
                base = base.base
            low, high = byte_bounds(base)
            address, size = low, high - low
        else:
            storage = tensor.untyped_storage()
            address, size = storage.data_ptr(), storage.nbytes()
        seen[address] = max(size, seen.get(address, 0))
    return sorted(seen.items())
