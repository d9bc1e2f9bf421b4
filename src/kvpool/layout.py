"""The engine's KV memory: per-layer tensors (possibly sharing storage), layer → group, and for a
block the memory pieces that make up its chunk. Whole blocks only: some backends pack K/V inside a
block (the CPU backend per instruction set), so bytes are copied block-wise, never token-wise."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.buffers import as_u8
from kvpool.errors import LayoutError

NULL_BLOCK_ID = 0  # the engine's placeholder block: never stored from, never loaded into


@dataclass(frozen=True)
class LayerSpec:
    name: str
    group: int
    kv_outer: bool  # (2, num_blocks, ...) instead of (num_blocks, ...)


class KVLayout:
    """Maps (group, block id) to the byte pieces of that block in every layer of the group.

    Host tensors are addressed in place (zero copy). Device tensors go through a host staging copy,
    so the same code serves CUDA: `save_pieces` copies the block out before returning."""

    def __init__(
        self,
        tensors: Mapping[str, Any],
        layer_groups: Mapping[str, int],
        num_blocks: int,
        *,
        staged: bool | None = None,
    ) -> None:
        if not tensors:
            raise LayoutError("no KV tensors were registered")
        missing = sorted(set(tensors) - set(layer_groups))
        if missing:
            raise LayoutError(f"layers {missing} have no KV cache group")
        self.num_blocks = num_blocks
        self.num_groups = max(layer_groups.values()) + 1
        self.layers: list[LayerSpec] = []
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
            self.layers.append(LayerSpec(name, group, kv_outer))
            halves = [tensor[0], tensor[1]] if kv_outer else [tensor]
            for half in halves:
                try:
                    view = half if self.staged else as_u8(half).reshape(num_blocks, -1)
                except TypeError as exc:  # not contiguous or not host memory: say which layer
                    raise LayoutError(f"layer {name!r}: {exc}") from exc
                self._views[group].append(view)
        self._block_bytes = [sum(_block_nbytes(v) for v in views) for views in self._views]
        self._storages = _distinct_storages(tensors.values())

    def chunk_nbytes(self, group: int) -> int:
        return self._block_bytes[group]

    def storages(self) -> list[tuple[int, int]]:
        """(address, bytes) of each distinct storage, for backends that register memory."""
        return self._storages

    def save_pieces(self, group: int, block_id: int) -> list[Any]:
        """Host buffers holding the block's bytes for every layer of the group, in layer order."""
        self._check(group, block_id)
        if not self.staged:
            return [view[block_id] for view in self._views[group]]
        import torch

        staging = torch.empty(self._block_bytes[group], dtype=torch.uint8)
        offset = 0
        for view in self._views[group]:
            block = view[block_id].reshape(-1).view(torch.uint8)
            staging[offset : offset + block.numel()].copy_(block)
            offset += block.numel()
        return [staging.numpy()]

    def load_pieces(self, group: int, block_id: int) -> list[Any]:
        """Host buffers to receive the block's bytes; call `commit_load` after filling them."""
        self._check(group, block_id)
        if not self.staged:
            return [view[block_id] for view in self._views[group]]
        return [np.empty(self._block_bytes[group], dtype=np.uint8)]

    def commit_load(self, group: int, block_id: int, pieces: Sequence[Any]) -> None:
        if not self.staged:
            return
        import torch

        staging = torch.from_numpy(pieces[0])
        offset = 0
        for view in self._views[group]:
            block = view[block_id].reshape(-1).view(torch.uint8)
            block.copy_(staging[offset : offset + block.numel()].to(block.device))
            offset += block.numel()

    def _check(self, group: int, block_id: int) -> None:
        if not 0 < block_id < self.num_blocks:
            raise LayoutError(f"block id {block_id} of group {group} is outside 1..{self.num_blocks - 1}")


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
