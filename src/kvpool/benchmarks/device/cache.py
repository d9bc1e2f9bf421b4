"""Synthetic paged KV caches shaped as vLLM allocates them, without vLLM (the lent GPU machine has none).

- `backing_cache`: vLLM 0.32 on GPU (`allocate_kv_cache` + `create_kv_cache_views`, no padding): one
  int8 backing buffer, and per layer a [B, H, N, C] view whose strides follow the KV cache layout
  (LBNHC by default: each layer a contiguous region, a block one dense page of N x H x C bytes), C
  holding K then V of one head and token; with kernel-block splitting dim 0 is num_blocks x ratio.
- `per_layer_cache`: the older layout, one (2, num_blocks, block, heads, head_dim) tensor per layer.

`tests/benchmarks/test_device_cache.py` checks `backing_cache` against vLLM's own functions on the CPU.
"""

from __future__ import annotations

from typing import Any

LAYOUTS = {  # vLLM's KVCacheLayout: the physical order of the logical axes [L, B, H, N, C]
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
}


def backing_strides(
    layers: int, num_blocks: int, block: int, heads: int, cell_bytes: int, layout: str = "LBNHC", ratio: int = 1
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(logical [L, B, H, N, C] shape in bytes, byte strides) as vLLM 0.32 places one KV cache tensor."""
    order = LAYOUTS[layout]
    page = heads * block * cell_bytes
    # kv_cache_utils: the tensor's strides for the manager block size
    shape = (layers, num_blocks, heads, block, cell_bytes)
    strides = [0] * 5
    current = 1
    for dim in reversed(order):
        strides[dim] = current
        current *= shape[dim]
    layer_stride, block_stride = strides[0], strides[1]
    if order[0] == 1:  # block-outermost: a block is every layer's page
        layer_stride, block_stride = page, page * layers
    if ratio > 1:  # create_kv_cache_views: kernel blocks of a dense page
        assert block_stride == page and block % ratio == 0, "kernel blocks need dense, unpadded pages"
        block_stride //= ratio
    shape = (layers, num_blocks * ratio, heads, block // ratio, cell_bytes)
    fixed = (layer_stride, block_stride, None, None, None)
    current = 1
    for dim in reversed(order):
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return shape, tuple(strides)


def backing_cache(
    torch: Any,
    layers: int,
    num_blocks: int,
    block: int,
    heads: int,
    head_dim: int,
    dtype: Any,
    device: Any,
    layout: str = "LBNHC",
    ratio: int = 1,
) -> tuple[Any, dict[str, Any]]:
    """(the int8 backing buffer, {layer name: its [B, H, N, 2 x head_dim] view in `dtype`})."""
    element = torch.empty(0, dtype=dtype).element_size()
    cell = 2 * head_dim * element
    shape, strides = backing_strides(layers, num_blocks, block, heads, cell, layout, ratio)
    raw = torch.zeros(layers * num_blocks * heads * block * cell, dtype=torch.int8, device=device)
    view5 = torch.as_strided(raw, shape, strides, raw.storage_offset())
    return raw, {f"layer{index}": view5[index].view(dtype) for index in range(layers)}


def per_layer_cache(
    torch: Any, layers: int, num_blocks: int, block: int, heads: int, head_dim: int, dtype: Any, device: Any
) -> dict[str, Any]:
    dims = (2, num_blocks, block, heads, head_dim)
    return {f"layer{index}": torch.zeros(dims, dtype=dtype, device=device) for index in range(layers)}


def fill_random(torch: Any, tensors: dict[str, Any], seed: int) -> None:
    """Random bytes in every layer (through byte views: float8 has no random kernel)."""
    generator = torch.Generator(device=next(iter(tensors.values())).device).manual_seed(seed)
    seen: set[int] = set()
    for tensor in tensors.values():
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        raw.random_(0, 256, generator=generator)  # in place: no second cache-sized buffer
