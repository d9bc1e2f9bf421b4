"""The device check's synthetic caches are what vLLM 0.32 allocates: its own `create_kv_cache_views`
over the same backing buffer gives the same per-layer views (shape, strides, offset, dtype)."""

from __future__ import annotations

import pytest
import torch

from kvpool.benchmarks.device.cache import LAYOUTS, backing_cache

kv_cache_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
kv_cache_layout = pytest.importorskip("vllm.v1.kv_cache_layout")


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("ratio", [1, 2])
def test_backing_cache_matches_vllm_create_kv_cache_views(layout_name, ratio):
    layers, blocks, block, heads, head_dim = 3, 10, 16, 2, 8
    layout = kv_cache_layout.KVCacheLayout[layout_name]
    if ratio > 1 and layout_name not in ("LBNHC", "LBHNC"):
        pytest.skip("vLLM splits kernel blocks only where a block is one dense page")
    spec = kv_cache_interface.FullAttentionSpec(
        block_size=block, num_kv_heads=heads, head_size=head_dim, dtype=torch.bfloat16
    )
    page = spec.page_size_bytes
    fixed = page * layers if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = kv_cache_interface.compute_layout_strides(
        spec, blocks, layers, layout, fixed_strides=(None, fixed, None, None, None)
    )
    names = [f"layer{index}" for index in range(layers)]
    tensor = kv_cache_interface.KVCacheTensor(
        size=page * blocks * layers, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    raw, ours = backing_cache(torch, layers, blocks, block, heads, head_dim, torch.bfloat16, "cpu", layout_name, ratio)
    theirs = kv_cache_interface.create_kv_cache_views(
        raw, spec, blocks, layout, tensor, kernel_block_size=block // ratio if ratio > 1 else None
    )
    for name, view in zip(names, theirs):
        mine = ours[name]
        assert (mine.shape, mine.stride(), mine.storage_offset(), mine.dtype) == (
            view.shape,
            view.stride(),
            view.storage_offset(),
            view.dtype,
        )


def test_every_vllm_spec_without_per_layer_views_is_refused_at_start_up_by_name():
    """Specs whose raw backing buffer vLLM hands the connector as is (no per-layer view): refused by
    name at start-up (specs.py); a raw buffer that reaches the layout anyway is refused there too."""
    import inspect

    from kvpool.core.errors import LayoutError
    from kvpool.core.specs import REFUSED_SPECS, SUPPORTED_SPECS, SpecFacts, attention_kind

    raw = []
    for name, cls in inspect.getmembers(kv_cache_interface, inspect.isclass):
        if not issubclass(cls, kv_cache_interface.KVCacheSpec):
            continue
        prop = inspect.getattr_static(cls, "has_layer_views", None)
        try:
            views = prop.fget(None) if isinstance(prop, property) else True
        except Exception:
            views = True  # computed from the instance: a spec with views
        if views is False:
            raw.append(name)
    assert raw, "vLLM 0.32 has specs without per-layer views"
    for name in raw:
        assert name in REFUSED_SPECS and name not in SUPPORTED_SPECS
        with pytest.raises(LayoutError, match=name):
            attention_kind(SpecFacts(name, 16))
