"""What both connector roles derive from vLLM's own config objects: kinds, keys, TP placement.
Real vLLM specs and configs, no engine."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvpool.core.config import KVPoolConfig
from kvpool.core.errors import LayoutError
from kvpool.core.masks import FullAttention, SlidingWindow, StateSpace
from kvpool.core.specs import attention_kind
from kvpool.integrations.vllm.plan import group_spec, plan_model, spec_facts, weights_digest

vllm_cache = pytest.importorskip("vllm.v1.kv_cache_interface")
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager  # noqa: E402

ATTENTION = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}


def kind_of(spec: Any) -> Any:
    return attention_kind(spec_facts(group_spec(spec)))


def test_vllm_specs_map_to_kinds_or_are_refused_by_name() -> None:
    assert kind_of(vllm_cache.FullAttentionSpec(block_size=64, **ATTENTION)) == FullAttention(64)
    assert kind_of(vllm_cache.MLAAttentionSpec(block_size=64, **ATTENTION)) == FullAttention(64)
    swa = vllm_cache.SlidingWindowSpec(block_size=32, sliding_window=64, **ATTENTION)
    assert kind_of(swa) == SlidingWindow(32, 64)
    refused = [
        vllm_cache.RSWASpec(block_size=64, rswa_window=128, **ATTENTION),
        vllm_cache.FullAttentionSpec(block_size=64, non_causal=True, **ATTENTION),
        vllm_cache.MambaSpec(block_size=64, shapes=((2, 4),), dtypes=(torch.float32,)),
        vllm_cache.CrossAttentionSpec(block_size=64, **ATTENTION),
    ]
    for spec in refused:
        with pytest.raises(LayoutError, match=type(spec).__name__):
            kind_of(spec)


def test_vllm_mamba_specs_are_served_in_align_mode_and_refused_by_setting_otherwise() -> None:
    state = {"block_size": 64, "shapes": ((2, 4),), "dtypes": (torch.float32,)}
    assert kind_of(vllm_cache.MambaSpec(**state, mamba_cache_mode="align")) == StateSpace(64)
    checkpoints = vllm_cache.MambaSpec(
        **state, mamba_cache_mode="align", num_prefill_checkpoint_blocks=1, page_size_padded=4096
    )
    assert kind_of(checkpoints) == StateSpace(64)
    for setting, spec in [
        ("mamba_cache_mode='none'", vllm_cache.MambaSpec(**state)),
        ("mamba_cache_mode='all'", vllm_cache.MambaSpec(**state, mamba_cache_mode="all")),
        ("num_speculative_blocks=1", vllm_cache.MambaSpec(**state, mamba_cache_mode="align", num_speculative_blocks=1)),
        ("tokens_per_state=4", vllm_cache.MambaSpec(**state, mamba_cache_mode="align", tokens_per_state=4)),
    ]:
        with pytest.raises(LayoutError, match="MambaSpec") as raised:
            kind_of(spec)
        assert setting in str(raised.value)


@pytest.mark.parametrize("extra", [0, 31, 64])
def test_extra_retained_blocks_are_what_vllm_keeps(extra: int) -> None:
    spec = vllm_cache.SlidingWindowSpec(block_size=32, sliding_window=64, extra_retained_tokens=extra, **ATTENTION)
    kind = kind_of(spec)
    manager = SimpleNamespace(sliding_window=64, extra_retained_tokens=extra)
    for hit in range(32, 1024, 32):
        skipped = SlidingWindowManager.get_num_skipped_tokens(manager, hit)  # type: ignore[arg-type]
        assert kind.required(hit) == range(skipped // 32, hit // 32)


@pytest.fixture(scope="module")
def vllm_config(model_dir: Any) -> Any:
    return engine_config(model_dir("llama"))


def engine_config(model: Any, **extra: Any) -> Any:
    return EngineArgs(
        model=str(model), skip_tokenizer_init=True, block_size=64, kv_cache_memory_bytes=1 << 27, **extra
    ).create_engine_config()


def kv_cache_config(spec: Any, layers: list[str]) -> Any:
    return vllm_cache.KVCacheConfig(
        num_blocks=16,
        kv_cache_tensors=[],
        kv_cache_groups=[vllm_cache.KVCacheGroupSpec(layers, spec)],
    )


def key_prefixes(plan: Any) -> list[list[str]]:
    return [[space.prefix for space in spaces] for spaces in plan.lookup_namespaces()]


def test_both_roles_derive_the_same_keys_for_layers_of_different_sizes(vllm_config: Any) -> None:
    """A group whose layers differ in head size is a UniformTypeKVCacheSpecs on the workers, but vLLM
    hands the scheduler only its first layer's spec: lookups must still use the keys saves write."""
    layers = {
        "model.layers.0.self_attn.attn": vllm_cache.FullAttentionSpec(block_size=64, **ATTENTION),
        "model.layers.1.self_attn.attn": vllm_cache.FullAttentionSpec(
            block_size=64, num_kv_heads=2, head_size=128, dtype=torch.bfloat16
        ),
    }
    uniform = vllm_cache.UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs=layers)
    worker_config = kv_cache_config(uniform, list(layers))
    scheduler_config = generate_scheduler_kv_cache_config([copy.deepcopy(worker_config)])
    assert type(scheduler_config.kv_cache_groups[0].kv_cache_spec).__name__ == "FullAttentionSpec"
    config = KVPoolConfig()
    worker = plan_model(vllm_config, worker_config, config)
    scheduler = plan_model(vllm_config, scheduler_config, config)
    assert key_prefixes(worker) == key_prefixes(scheduler)
    assert [p.keys.prefix for p in worker.placements()] == [spaces[0] for spaces in key_prefixes(scheduler)]


def test_a_group_mixing_attention_kinds_is_refused(vllm_config: Any) -> None:
    layers = {
        "a": vllm_cache.FullAttentionSpec(block_size=64, **ATTENTION),
        "b": vllm_cache.SlidingWindowSpec(block_size=64, sliding_window=64, **ATTENTION),
    }
    spec = vllm_cache.UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs=layers)
    with pytest.raises(LayoutError, match="mixes attention kinds"):
        plan_model(vllm_config, kv_cache_config(spec, list(layers)), KVPoolConfig())


def test_keys_name_the_weights_not_only_the_path(vllm_config: Any, model_dir: Any) -> None:
    spec = vllm_cache.FullAttentionSpec(block_size=64, **ATTENTION)
    base = key_prefixes(plan_model(vllm_config, kv_cache_config(spec, ["x"]), KVPoolConfig()))
    overridden = engine_config(model_dir("llama"), hf_overrides={"rope_theta": 1234.0})
    assert key_prefixes(plan_model(overridden, kv_cache_config(spec, ["x"]), KVPoolConfig())) != base
    # what an engine config can change without touching the path
    digest = weights_digest(vllm_config)
    for change in (
        {"revision": "v2"},
        {"code_revision": "v2"},
        {"quantization": "fp8"},
        {"dtype": torch.float16},
    ):
        model = copy.copy(vllm_config.model_config)
        for key, value in change.items():
            object.__setattr__(model, key, value)
        assert weights_digest(SimpleNamespace(**{**vars_of(vllm_config), "model_config": model})) != digest, change
    dummy = SimpleNamespace(**{**vars_of(vllm_config), "load_config": SimpleNamespace(load_format="dummy")})
    reseeded = copy.copy(vllm_config.model_config)
    object.__setattr__(reseeded, "seed", 1234)
    assert weights_digest(dummy) != weights_digest(SimpleNamespace(**{**vars_of(dummy), "model_config": reseeded}))


def vars_of(config: Any) -> dict[str, Any]:
    return {
        "model_config": config.model_config,
        "load_config": config.load_config,
        "cache_config": config.cache_config,
    }


def test_tp_placement_follows_the_replica_count_vllm_publishes(vllm_config: Any) -> None:
    """kv_tp_replicas consecutive TP ranks hold identical KV: one shard. Into a shared pool they stride
    their puts; with a pool per rank (embedded) each stores the whole shard, since each loads from its own."""
    spec = vllm_cache.FullAttentionSpec(block_size=64, **ATTENTION)
    config = copy.deepcopy(vllm_config)
    config.parallel_config.tensor_parallel_size = 4
    shared = KVPoolConfig.from_dict({"backend": "mooncake", "mooncake": {"master": "127.0.0.1:50051"}})
    for pool_config, put_steps, put_ranks in ((shared, 2, [0, 1, 0, 1]), (KVPoolConfig(), 1, [0, 0, 0, 0])):
        plans = []
        for rank in range(4):
            config.parallel_config.rank = rank
            kv_config = kv_cache_config(spec, ["x"])
            kv_config.kv_tp_replicas = 2
            plans.append(plan_model(config, kv_config, pool_config))
        assert [plan.shard for plan in plans] == [0, 0, 1, 1]
        assert [plan.placements()[0].put_step for plan in plans] == [put_steps] * 4
        assert [plan.placements()[0].put_step_rank for plan in plans] == put_ranks
        assert len(plans[0].lookup_namespaces()[0]) == 2
        assert plans[0].placements()[0].keys.prefix == plans[1].placements()[0].keys.prefix
        assert plans[0].placements()[0].keys.prefix != plans[2].placements()[0].keys.prefix


def test_worker_reports_pickle_and_aggregate_over_ranks() -> None:
    """vLLM folds the ranks' metadata left to right and, across processes, pickles it every step."""
    import pickle

    from kvpool.core.pool_reports import PoolReport
    from kvpool.integrations.vllm.metadata import KVPoolWorkerMetadata

    ranks = [KVPoolWorkerMetadata([PoolReport(rank, 0, stored={"p/": [bytes([rank])]})]) for rank in range(4)]
    combined = ranks[0]
    for other in ranks[1:]:
        combined = combined.aggregate(pickle.loads(pickle.dumps(other)))
    assert isinstance(combined, KVPoolWorkerMetadata)
    assert [report.rank for report in combined.reports] == [0, 1, 2, 3]
    assert [len(meta.reports) for meta in ranks] == [1, 1, 1, 1]  # aggregating builds a new object


def test_a_pool_hit_drops_its_last_block_exactly_when_vllm_drops_a_local_hits() -> None:
    """vLLM's scheduler drops a prefix hit's last block when `use_eagle_block_drop()` (EAGLE / MTP
    drafting, unless disabled): the plan reads the same switch, and no speculative config means none."""
    from vllm.config import SpeculativeConfig

    from kvpool.integrations.vllm.plan import drops_eagle_block

    def speculative(method: str, disabled: bool = False) -> SpeculativeConfig:
        spec = SpeculativeConfig.__new__(SpeculativeConfig)  # its validation needs a model to draft with
        spec.method, spec.disable_eagle_block_drop = method, disabled  # type: ignore[assignment]
        return spec

    assert not drops_eagle_block(SimpleNamespace(speculative_config=None))
    assert drops_eagle_block(SimpleNamespace(speculative_config=speculative("eagle3")))
    assert drops_eagle_block(SimpleNamespace(speculative_config=speculative("mtp")))
    assert not drops_eagle_block(SimpleNamespace(speculative_config=speculative("eagle", disabled=True)))
    assert not drops_eagle_block(SimpleNamespace(speculative_config=speculative("ngram")))


def test_new_weights_at_the_same_path_change_every_key(model_dir: Any, tmp_path: Any) -> None:
    """A checkpoint rewritten in place with other values (a redeploy, a fine-tune saved over the old one)
    keeps its path and config: the keys must still change. The same bytes written again (a new mtime)
    keep them, and `weights_version` changes them for weights kvpool cannot read."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "llama"
    shutil.copytree(model_dir("llama"), model)
    spec = vllm_cache.FullAttentionSpec(block_size=64, **ATTENTION)

    def prefixes(config: KVPoolConfig | None = None) -> list[list[str]]:
        return key_prefixes(plan_model(engine_config(model), kv_cache_config(spec, ["x"]), config or KVPoolConfig()))

    before = prefixes()
    original = (model / "model.safetensors").read_bytes()
    weights = load_file(str(model / "model.safetensors"))
    rescaled = {name: tensor * 1.5 for name, tensor in weights.items()}
    save_file(rescaled, str(model / "model.safetensors"), metadata={"format": "pt"})
    assert len((model / "model.safetensors").read_bytes()) == len(original)  # same sizes, same header
    assert prefixes() != before
    (model / "model.safetensors").write_bytes(original)
    assert prefixes() == before
    assert prefixes(KVPoolConfig(weights_version="rl-step-7")) != before
