"""The engine's KV memory: per-layer tensors (possibly sharing storage), layer → group, and for a
block the memory pieces that make up its chunk. Whole blocks only: some backends pack K/V inside a
block (the CPU backend per instruction set), so bytes are copied block-wise, never token-wise."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvpool.backends.base import Rows, Status, _bounds
from kvpool.buffers import as_u8
from kvpool.device_copy import DeviceCopier, Event, InlineRuntime, Runtime, Staged, StagingFull, TorchCuda
from kvpool.errors import LayoutError
from kvpool.integrity import SEAL_BYTES, Integrity, Sealer

DEFAULT_STAGING_BYTES = 64 << 20

NULL_BLOCK_ID = 0  # the engine's placeholder block: never stored from, never loaded into


class KVLayout:
    """Maps (group, block id) to the byte pieces of that block in every layer of the group.

    Host tensors are addressed in place (zero copy). Device tensors go through a host staging ring on
    copy streams (device_copy.py): `capture_rows` starts a copy out and returns at once; its bytes are
    valid after `Staged.wait` (the sender's thread waits, never the engine's).

    With `integrity` on, every value this layout hands out ends with the chunk's seal: saves compute
    it, loads read it, and `verify` checks it before `commit_rows` (integrity.py)."""

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
        for name, tensor in tensors.items():
            shape = tuple(tensor.shape)
            if shape and shape[0] == num_blocks:
                kv_outer = False
            elif len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks:
                kv_outer = True
            else:
                raise LayoutError(
                    f"layer {name!r} has shape {shape}: expected ({num_blocks}, ...) or (2, {num_blocks}, ...)"
                )
            group = layer_groups[name]
            halves = [tensor[0], tensor[1]] if kv_outer else [tensor]
            for half in halves:
                try:
                    view = half if self.staged else as_u8(half).reshape(num_blocks, -1)
                except TypeError as exc:  # not contiguous or not host memory: say which layer
                    raise LayoutError(f"layer {name!r}: {exc}") from exc
                self._views[group].append(view)
        self._view_tuples = [tuple(views) for views in self._views]
        self._block_bytes = [sum(_block_nbytes(v) for v in views) for views in self._views]
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
            if runtime is None:
                runtime = InlineRuntime() if _is_host(first) else TorchCuda()
            self._copier = DeviceCopier(runtime, staging_bytes)

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
            ring = self._copier.ring.buffer
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
        staged = self._copier.save(self._views[group], ids, self._sealers[group].stored_bytes)
        if staged is None:
            raise StagingFull(f"{len(ids)} blocks of group {group}: the host staging ring is full of copies in flight")
        host = staged.host
        if self.sealed:
            staged.then = lambda: self._sealed_copy(group, host)
        return Rows((host,), np.arange(len(ids))), staged

    def copy_rows(self, group: int, block_ids: Sequence[int]) -> Rows:
        """Like `save_rows`, but always a host copy the caller owns: the engine may reuse the blocks
        as soon as this returns."""
        if self.staged:
            return self.save_rows(group, block_ids)  # copied out of device memory, waited for
        ids = self._ids(group, block_ids)
        copies = tuple(np.take(view, ids, axis=0) for view in self._views[group])
        # fresh copies of the layout's views, a row per id
        rows = Rows.checked(copies, np.arange(len(ids))) if copies else Rows(copies, np.arange(len(ids)))
        return Rows((*copies, self._sealers[group].seal_column(rows)), rows.ids) if self.sealed else rows

    def _sealed_copy(self, group: int, host: np.ndarray) -> Rows:
        """`host`: one row per block, the block's bytes then room for its seal (filled here)."""
        rows = Rows((host,), np.arange(len(host)))
        if self.sealed:
            host[:, self._block_bytes[group] :] = self._sealers[group].seal_column(rows)
        return rows

    def load_rows(self, group: int, block_ids: Sequence[int], *, owned: bool = False) -> Rows:
        """Where the blocks' bytes go, one value per block; call `commit_rows` once they are filled.
        Host memory is filled in place unless `owned`: then (as always for device memory) a host buffer
        the caller owns, so a read that never returns can never write the engine's blocks."""
        ids = self._ids(group, block_ids)
        if not self.staged and not owned:
            views = tuple(self._views[group])
            return Rows((*views, self._load_seals[group]) if self.sealed else views, ids)
        ring = self._copier.host_rows(len(ids), self.stored_nbytes(group)) if self._copier is not None else None
        host = ring[0] if ring is not None else np.empty((len(ids), self.stored_nbytes(group)), dtype=np.uint8)
        return Rows((host,), np.arange(len(ids)))

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
            host = rows.arrays[0][keep]
            targets = self._ids(group, [block_ids[index] for index in keep])
            offset = 0
            for view in views:
                view[targets] = host[:, offset : offset + view.shape[1]]
                offset += view.shape[1]
            return None
        assert self._copier is not None
        arrived_rows = rows.arrays[0] if len(keep) == len(arrived) else rows.arrays[0][keep]
        blocks = self._ids(group, [block_ids[index] for index in keep]).tolist()
        return self._copier.load(views, blocks, arrived_rows[:, : self._block_bytes[group]], after)

    def _ids(self, group: int, block_ids: Sequence[int]) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if len(ids) and ((bounds := _bounds(ids))[0] <= NULL_BLOCK_ID or bounds[1] >= self.num_blocks):
            bad = [int(i) for i in ids if not 0 < i < self.num_blocks]
            raise LayoutError(f"block ids {bad} of group {group} are outside 1..{self.num_blocks - 1}")
        return ids


def _is_host(tensor: Any) -> bool:
    device = getattr(tensor, "device", None)
    return device is None or getattr(device, "type", "cpu") == "cpu"


def _block_nbytes(view: Any) -> int:
    if isinstance(view, np.ndarray):
        return int(view.shape[1])
    return int(view[0].numel() * view.element_size())


def _distinct_storages(tensors: Any) -> list[tuple[int, int]]:
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, np.ndarray):
            base = tensor.base if tensor.base is not None else tensor
            address, size = base.ctypes.data, base.nbytes
        else:
            storage = tensor.untyped_storage()
            address, size = storage.data_ptr(), storage.nbytes()
        seen[address] = max(size, seen.get(address, 0))
    return sorted(seen.items())
