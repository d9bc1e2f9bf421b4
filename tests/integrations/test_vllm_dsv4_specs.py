"""DeepSeek V4's KV-cache groups (issue 46), from vLLM's own spec classes and per-spec managers, no
engine: every group is classified, `tokens_per_state` is modelled (compressed KV served when whole
states fill every block, fractions and states across blocks refused by name), and for every group and
hit boundary kvpool's required chunks are the blocks vLLM's manager keeps, over which vLLM's own
`find_longest_cache_hit` returns the whole hit."""

from __future__ import annotations

import copy
import math
from fractions import Fraction
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpool.core.config import KVPoolConfig
from kvpool.core.errors import LayoutError
from kvpool.core.masks import ChunkedLocal, FullAttention, MaskCoordinator, SlidingWindow
from kvpool.core.specs import COMPRESSION_SETTINGS, SpecFacts, attention_kind
from kvpool.integrations.vllm.plan import group_spec, plan_model, spec_facts

vllm_cache = pytest.importorskip("vllm.v1.kv_cache_interface")
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    KVCacheBlock,
    generate_scheduler_kv_cache_config,
    resolve_block_hashes,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry  # noqa: E402

HASH_BLOCK = 4  # vLLM's hash block size for DSv4: the GCD of the groups' block sizes 64, 256, 4, 8
FP8_DS_MLA = {"cache_dtype_str": "fp8_ds_mla", "model_version": "deepseek_v4", "alignment": 576}


def swa_cache(block_size: int = 64, window: int = 128) -> Any:
    """A per-layer SWA cache (vLLM's DeepseekV4SWACache, fp8_ds_mla): 584 B a token, 576 B page alignment."""
    return vllm_cache.SlidingWindowMLASpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=512,
        dtype=torch.uint8,
        sliding_window=window,
        state_content_bytes=584,
        **FP8_DS_MLA,
    )


def compressed(ratio: int, head_size: int = 512, content: int | None = 584) -> Any:
    """A compressed attention cache (DeepseekV4's MLA `compress_ratio` > 1) or its indexer cache."""
    return vllm_cache.MLAAttentionSpec(
        block_size=256,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=head_size,
        dtype=torch.uint8,
        tokens_per_state=ratio,
        state_content_bytes=content,
        **FP8_DS_MLA,
    )


def compressor_state(ratio: int) -> Any:
    """A compressor's state (vLLM's DeepseekV4 CompressorStateCache): block 4 / window 8 for c4, 8 / 128 for c128."""
    block_size, window = (4, 8) if ratio == 4 else (8, 128)
    return vllm_cache.SlidingWindowMLASpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=2048 if ratio == 4 else 1024,
        dtype=torch.float32,
        sliding_window=window,
        alignment=512,
    )


def dsv4_groups() -> list[tuple[list[str], Any]]:
    """vLLM's six KV-cache groups for a 3-layer DeepSeek V4 with compress_ratios [0, 4, 128] (issue 46)."""
    compressed_layers = {
        "model.layers.1.attn.mla_attn": compressed(4),
        "model.layers.1.attn.indexer.k_cache": compressed(4, head_size=132, content=None),
        "model.layers.2.attn.mla_attn": compressed(128),
    }
    return [
        *[([f"model.layers.{layer}.attn.swa_cache"], swa_cache()) for layer in range(3)],
        (list(compressed_layers), vllm_cache.UniformTypeKVCacheSpecs(block_size=256, kv_cache_specs=compressed_layers)),
        (["model.layers.1.attn.compressor.state_cache"], compressor_state(4)),
        (["model.layers.2.attn.compressor.state_cache"], compressor_state(128)),
    ]


def worker_config() -> Any:
    return vllm_cache.KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[vllm_cache.KVCacheGroupSpec(layers, spec) for layers, spec in dsv4_groups()],
    )


def kinds_of(config: Any) -> list[Any]:
    return [attention_kind(spec_facts(group_spec(group.kv_cache_spec))) for group in config.kv_cache_groups]


DSV4_KINDS = [SlidingWindow(64, 128)] * 3 + [FullAttention(256), SlidingWindow(4, 8), SlidingWindow(8, 128)]


def test_the_page_is_padded_past_the_block_as_the_layout_tests_assume() -> None:
    """64 tokens x 584 B = 37,376 B of KV in a 37,440 B page: the strided tensors of test_layout_strided."""
    assert swa_cache().real_page_size_bytes == 64 * 584 and swa_cache().page_size_bytes == 37_440
    # a compressed block holds block_size / tokens_per_state states: vLLM's block size counts tokens
    assert compressed(4).num_states == 64 and compressed(128).num_states == 2
    assert compressed(4).real_page_size_bytes == 64 * 584


def test_every_dsv4_group_is_served_by_its_kind_on_both_roles() -> None:
    workers = worker_config()
    scheduler = generate_scheduler_kv_cache_config([copy.deepcopy(workers)])
    assert type(scheduler.kv_cache_groups[3].kv_cache_spec).__name__ == "MLAAttentionSpec"  # the first layer only
    assert kinds_of(workers) == kinds_of(scheduler) == DSV4_KINDS


@pytest.fixture(scope="module")
def vllm_config(model_dir: Any) -> Any:
    return EngineArgs(
        model=str(model_dir("llama")), skip_tokenizer_init=True, block_size=64, kv_cache_memory_bytes=1 << 27
    ).create_engine_config()


def test_both_roles_derive_the_same_keys_for_dsv4s_groups(vllm_config: Any) -> None:
    """The workers see group 3 as a UniformTypeKVCacheSpecs (tokens_per_state 4 and 128), the scheduler
    its first layer's spec: lookups must use the keys saves write."""
    workers = worker_config()
    scheduler = generate_scheduler_kv_cache_config([copy.deepcopy(workers)])
    plans = [plan_model(vllm_config, config, KVPoolConfig()) for config in (workers, scheduler)]
    prefixes = [[[space.prefix for space in spaces] for spaces in plan.lookup_namespaces()] for plan in plans]
    assert prefixes[0] == prefixes[1]
    assert plans[0].coordinator.kinds == DSV4_KINDS and plans[0].coordinator.lcm == 256
    assert len({spaces[0] for spaces in prefixes[0]}) == 6, "every group has keys of its own"


def test_every_hit_boundary_ends_every_layers_compressed_states() -> None:
    """kvpool's hits land on the LCM of the groups' block sizes (as vLLM's scheduler's do); a served
    compression divides its block size, so every boundary is a multiple of every layer's tokens_per_state,
    which vLLM's own resolve_kv_cache_block_sizes requires too."""
    config = worker_config()
    coordinator = MaskCoordinator(kinds_of(config))
    ratios = {
        spec.tokens_per_state
        for group in config.kv_cache_groups
        for spec in getattr(group.kv_cache_spec, "kv_cache_specs", {"": group.kv_cache_spec}).values()
    }
    assert ratios == {1, 4, 128}
    assert all(coordinator.lcm % ratio == 0 for ratio in ratios)
    vllm = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=64, enable_prefix_caching=True, prefix_match_unit=None),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        kv_transfer_config=object(),
    )
    assert resolve_kv_cache_block_sizes(config, vllm) == (coordinator.lcm, HASH_BLOCK)  # type: ignore[arg-type]


class CachedBlocks:
    """Just what vLLM's managers' `find_longest_cache_hit` reads of a BlockPool: the blocks cached per
    block hash (here: exactly the chunks kvpool loads), the null block and the hash granularity."""

    def __init__(self, cached: dict[Any, int]) -> None:
        self.hash_block_size = HASH_BLOCK
        self.null_block = KVCacheBlock(0)
        self._cached = {block_hash: KVCacheBlock(block_id) for block_hash, block_id in cached.items()}

    def get_cached_block(self, block_hash: Any, group_ids: list[int]) -> list[KVCacheBlock] | None:
        block = self._cached.get(block_hash)
        return None if block is None else [block] * len(group_ids)


def hashes(tokens: int) -> list[bytes]:
    return [f"dsv4/{index}".encode() for index in range(tokens // HASH_BLOCK)]


def vllm_hit(spec: Any, required: range, boundary: int) -> tuple[list[int], int]:
    """vLLM's manager's longest hit for `spec` with exactly the `required` chunks cached: the chunk
    indices of the real blocks it returns, and the hit length."""
    manager = KVCacheSpecRegistry.get_manager_class(spec)
    assert manager is not None
    request = hashes(boundary)
    view = resolve_block_hashes(request, HASH_BLOCK, spec.block_size)
    pool = CachedBlocks({view[chunk]: chunk + 1 for chunk in required})
    blocks, hit = manager.find_longest_cache_hit(
        request,
        boundary,
        [0],
        pool,
        spec,
        drop_eagle_block=False,
        alignment_tokens=256,  # type: ignore[arg-type]
    )
    return [block.block_id - 1 for block in blocks[0] if block.block_id], hit


def kept_chunks(spec: Any, boundary: int) -> range:
    """The blocks vLLM's manager keeps for a request of `boundary` computed tokens: those at or past its
    skipped tokens (all of them for full attention)."""
    manager_class = KVCacheSpecRegistry.get_manager_class(spec)
    assert manager_class is not None
    manager = SimpleNamespace(
        sliding_window=getattr(spec, "sliding_window", None),
        extra_retained_tokens=getattr(spec, "extra_retained_tokens", 0),
    )
    skipped = manager_class.get_num_skipped_tokens(manager, boundary)  # type: ignore[arg-type]
    return range(skipped // spec.block_size, boundary // spec.block_size)


@pytest.mark.parametrize("group", range(6))
def test_kvpools_chunks_are_the_blocks_vllm_keeps_and_vllm_hits_all_of_them(group: int) -> None:
    config = worker_config()
    coordinator = MaskCoordinator(kinds_of(config))
    spec = group_spec(config.kv_cache_groups[group].kv_cache_spec)
    kind = coordinator.kinds[group]
    for boundary in range(coordinator.lcm, 16 * coordinator.lcm + 1, coordinator.lcm):
        required = kind.required(boundary)
        assert required == kept_chunks(spec, boundary), (group, boundary)
        mask = coordinator.load_masks(boundary)[group]
        loaded = range(boundary // kind.block_size) if mask is None else [i for i, bit in enumerate(mask) if bit]
        assert list(loaded) == list(required)
        blocks, hit = vllm_hit(spec, required, boundary)
        assert (blocks, hit) == (list(required), boundary), (group, boundary)
        if len(required) > 1:  # and each of them is needed: one fewer and vLLM's hit is shorter
            _, shorter = vllm_hit(spec, range(required.start + 1, required.stop), boundary)
            assert shorter < boundary


@pytest.mark.parametrize("first", [4, 128])
def test_a_group_whose_layers_differ_in_tokens_per_state_is_served_by_its_first_layer(first: int) -> None:
    """Whichever compression the scheduler's first layer has, both roles model the group as full attention
    at 256 tokens: every layer's states end on every block boundary."""
    layers = {"a": compressed(first), "b": compressed(4 if first == 128 else 128)}
    uniform = vllm_cache.UniformTypeKVCacheSpecs(block_size=256, kv_cache_specs=layers)
    assert attention_kind(spec_facts(group_spec(uniform))) == FullAttention(256)
    assert spec_facts(group_spec(uniform)).tokens_per_state == first


def test_a_layer_whose_states_cross_blocks_is_refused_by_name_on_the_workers() -> None:
    """The scheduler sees only a group's first layer; the workers classify every layer, so a layer whose
    compression does not divide the block size stops the engine at start-up, by name."""
    layers = {"a": compressed(4), "b": vllm_cache.MLAAttentionSpec(**{**vars_of(compressed(4)), "tokens_per_state": 3})}
    uniform = vllm_cache.UniformTypeKVCacheSpecs(block_size=256, kv_cache_specs=layers)
    with pytest.raises(LayoutError, match=r"MLAAttentionSpec\(block_size=256, tokens_per_state=3\)") as raised:
        group_spec(uniform)
    assert "inside a compressed state" in str(raised.value)


def vars_of(spec: Any) -> dict[str, Any]:
    from dataclasses import fields

    return {f.name: getattr(spec, f.name) for f in fields(spec) if f.init and f.name != "page_size_padded"}


def test_what_breaks_when_a_boundary_ends_inside_a_state() -> None:
    """A 128-token state in 64-token blocks: a hit at 64 tokens would load a block whose only state is
    half written (its last token is 64 tokens later), and a block holds no whole state at all (vLLM:
    num_states 0). vLLM's scheduler refuses the alignment; kvpool refuses the spec, by name."""
    full = vllm_cache.FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    crossing = vllm_cache.MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=512, dtype=torch.uint8, tokens_per_state=128
    )
    assert crossing.num_states == 0
    config = vllm_cache.KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[vllm_cache.KVCacheGroupSpec(["a"], full), vllm_cache.KVCacheGroupSpec(["b"], crossing)],
    )
    vllm = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=64, enable_prefix_caching=True, prefix_match_unit=None),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        kv_transfer_config=object(),
    )
    with pytest.raises(ValueError, match="per-state compression"):
        resolve_kv_cache_block_sizes(config, vllm)  # type: ignore[arg-type]
    assert MaskCoordinator([FullAttention(64), FullAttention(64)]).lcm % 128, "the boundary kvpool would hit at"
    with pytest.raises(LayoutError, match=r"tokens_per_state=128\)") as raised:
        attention_kind(spec_facts(crossing))
    assert COMPRESSION_SETTINGS["tokens_per_state > 1, not a divisor of block_size"] in str(raised.value)


def test_several_states_per_token_are_refused_by_name() -> None:
    """vLLM's Whisper block pooling: tokens_per_state = Fraction(1, pool). Read as a Fraction, not truncated."""
    pooled = vllm_cache.FullAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, tokens_per_state=Fraction(1, 4)
    )
    assert spec_facts(pooled).tokens_per_state == Fraction(1, 4)
    with pytest.raises(LayoutError, match=r"FullAttentionSpec\(block_size=16, tokens_per_state=1/4\)") as raised:
        attention_kind(spec_facts(pooled))
    assert "several states per token" in str(raised.value)


@pytest.mark.parametrize(
    ("facts", "kind"),
    [
        (SpecFacts("MLAAttentionSpec", 256, tokens_per_state=4), FullAttention(256)),
        (SpecFacts("MLAAttentionSpec", 256, tokens_per_state=256), FullAttention(256)),
        (SpecFacts("FullAttentionSpec", 64, tokens_per_state=1), FullAttention(64)),
        (SpecFacts("SlidingWindowMLASpec", 64, sliding_window=128, tokens_per_state=4), SlidingWindow(64, 128)),
        (SpecFacts("SlidingWindowSpec", 16, sliding_window=64, tokens_per_state=-1), SlidingWindow(16, 64)),
    ],
)
def test_compressions_that_fill_blocks_with_whole_states_are_served(facts: SpecFacts, kind: Any) -> None:
    assert attention_kind(facts) == kind


@pytest.mark.parametrize(
    ("facts", "named"),
    [
        (SpecFacts("MLAAttentionSpec", 256, tokens_per_state=3), "tokens_per_state=3"),
        (SpecFacts("MLAAttentionSpec", 64, tokens_per_state=128), "tokens_per_state=128"),
        (SpecFacts("FullAttentionSpec", 16, tokens_per_state=Fraction(1, 2)), "tokens_per_state=1/2"),
        (SpecFacts("FullAttentionSpec", 16, tokens_per_state=0), "tokens_per_state=0"),
        (
            SpecFacts("ChunkedLocalAttentionSpec", 16, attention_chunk_size=64, tokens_per_state=4),
            "tokens_per_state=4",
        ),
    ],
)
def test_other_compressions_are_refused_by_name(facts: SpecFacts, named: str) -> None:
    with pytest.raises(LayoutError, match=facts.type_name) as raised:
        attention_kind(facts)
    assert named in str(raised.value) and "without the connector" in str(raised.value)


def test_chunked_local_kind_is_unchanged_without_compression() -> None:
    assert attention_kind(SpecFacts("ChunkedLocalAttentionSpec", 16, attention_chunk_size=64)) == ChunkedLocal(16, 64)
    assert math.lcm(*(kind.block_size for kind in DSV4_KINDS)) == 256
