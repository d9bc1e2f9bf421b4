"""build_plan: what both connector roles derive from an engine's plain facts (kinds, keys, TP/PP
placement), without the engine. The vLLM adapter's reading of its configs into these facts is
tested against real vLLM configs in tests/integrations/test_vllm_plan.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvpool.core.config import KVPoolConfig
from kvpool.core.errors import ConfigError, LayoutError
from kvpool.core.fingerprints import GroupFacts, ModelFacts
from kvpool.core.masks import ChunkedLocal, FullAttention, SlidingWindow
from kvpool.core.plan import EngineFacts, ModelPlan, Parallelism, build_plan
from kvpool.core.specs import SpecFacts, group_layer

MODEL = ModelFacts(model="/models/llama", device="cuda", torch_version="2.9.0", hash_algo="sha256", weights="w0")
FULL = GroupFacts(SpecFacts("FullAttentionSpec", 64), dtype="torch.bfloat16", num_kv_heads=2, head_size=64)
SLIDING = GroupFacts(SpecFacts("SlidingWindowSpec", 32, sliding_window=64), dtype="torch.bfloat16")
CHUNKED = GroupFacts(SpecFacts("ChunkedLocalAttentionSpec", 64, attention_chunk_size=128), dtype="torch.bfloat16")
SHARED = KVPoolConfig.from_dict({"backend": "mooncake", "mooncake": {"master": "127.0.0.1:50051"}})


def engine(
    *groups: GroupFacts,
    parallel: Parallelism | None = None,
    hash_block_size: int | None = None,
    retention_interval: int | None = None,
) -> EngineFacts:
    return EngineFacts(MODEL, groups or (FULL,), parallel or Parallelism(), hash_block_size, retention_interval)


def prefixes(plan: ModelPlan) -> list[list[str]]:
    return [[space.prefix for space in spaces] for spaces in plan.lookup_namespaces()]


def test_groups_become_kinds_and_the_hash_block_is_the_smallest_block() -> None:
    plan = build_plan(engine(FULL, SLIDING, CHUNKED), KVPoolConfig())
    assert plan.coordinator.kinds == [FullAttention(64), SlidingWindow(32, 64), ChunkedLocal(64, 128)]
    assert plan.coordinator.hash_block_size == 32
    assert build_plan(engine(FULL, hash_block_size=16), KVPoolConfig()).coordinator.hash_block_size == 16


def test_an_unsupported_spec_is_refused_by_name() -> None:
    with pytest.raises(LayoutError, match="MambaSpec"):
        build_plan(engine(GroupFacts(SpecFacts("MambaSpec", 64), dtype="f32")), KVPoolConfig())


def test_retention_is_the_engines_unless_kvpool_names_one() -> None:
    def retention(config: KVPoolConfig, engine_value: int | None) -> int | None:
        return build_plan(engine(retention_interval=engine_value), config).coordinator.retention_interval

    assert retention(KVPoolConfig(), 512) == 512  # "engine" is the default
    assert retention(KVPoolConfig(), None) is None
    assert retention(KVPoolConfig.from_dict({"retention_interval": 256}), 512) == 256
    assert retention(KVPoolConfig.from_dict({"retention_interval": None}), 512) is None
    with pytest.raises(ConfigError, match="retention_interval"):
        retention(KVPoolConfig(), 100)  # not a multiple of the block size


def test_rank_splits_into_tp_and_pp_rank() -> None:
    for rank in range(6):
        plan = build_plan(engine(parallel=Parallelism(rank=rank, tp_size=3, pp_size=2)), KVPoolConfig())
        assert (plan.tp_rank, plan.pp_rank, plan.rank) == (rank % 3, rank // 3, rank)
        assert plan.fingerprints[0].pp_size == 2


@pytest.mark.parametrize("published", [0, -1, 1])
def test_replicas_below_one_count_as_one(published: int) -> None:
    plan = build_plan(engine(parallel=Parallelism(tp_size=2, kv_tp_replicas=published)), KVPoolConfig())
    assert plan.replicas == 1


def test_tp_replicas_share_a_shard_and_stride_puts_only_into_a_shared_pool() -> None:
    """kv_tp_replicas consecutive TP ranks hold identical KV: one shard. Into a shared pool they stride
    their puts; with a pool per rank (embedded) each stores the whole shard, since each loads from its own."""
    for config, put_step, put_ranks in ((SHARED, 2, [0, 1, 0, 1]), (KVPoolConfig(), 1, [0, 0, 0, 0])):
        plans = [
            build_plan(engine(parallel=Parallelism(rank=rank, tp_size=4, kv_tp_replicas=2)), config)
            for rank in range(4)
        ]
        assert [plan.shared_pool for plan in plans] == [config is SHARED] * 4
        assert [plan.shard for plan in plans] == [0, 0, 1, 1]
        assert [plan.placements()[0].put_step for plan in plans] == [put_step] * 4
        assert [plan.placements()[0].put_step_rank for plan in plans] == put_ranks
        assert len(plans[0].lookup_namespaces()[0]) == 2
        assert plans[0].placements()[0].keys.prefix == plans[1].placements()[0].keys.prefix
        assert plans[0].placements()[0].keys.prefix != plans[2].placements()[0].keys.prefix


def test_every_ranks_namespace_is_one_the_scheduler_looks_up() -> None:
    """Both roles build the plan from the same facts; only the rank differs."""
    groups = (FULL, SLIDING)
    for tp, pp, replicas in ((1, 1, 1), (4, 1, 2), (2, 2, 1), (4, 2, 4)):
        scheduler = build_plan(engine(*groups, parallel=Parallelism(0, tp, pp, replicas)), SHARED)
        wanted = prefixes(scheduler)
        written: list[set[str]] = [set() for _ in groups]
        for rank in range(tp * pp):
            worker = build_plan(engine(*groups, parallel=Parallelism(rank, tp, pp, replicas)), SHARED)
            assert prefixes(worker) == wanted
            for group, placement in enumerate(worker.placements()):
                written[group].add(placement.keys.prefix)
        assert [set(spaces) for spaces in wanted] == written  # and every namespace looked up is written


def test_fingerprints_name_the_model_weights_layout_and_settings() -> None:
    base = build_plan(engine(FULL), KVPoolConfig()).fingerprints[0]
    assert base.model == "/models/llama"
    assert base.kv_layout == "cuda:default:2.9.0:2x64:"
    assert base.attention.startswith("FullAttentionSpec:")
    assert base.hash_algo == "sha256:"
    assert (base.weights, base.tenant, base.integrity, base.dtype) == ("w0", "", "", "torch.bfloat16")
    named = build_plan(
        engine(FULL),
        KVPoolConfig.from_dict({"model_id": "org/llama", "tenant": "t1", "integrity": "sampled"}),
    ).fingerprints[0]
    assert (named.model, named.tenant, named.integrity) == ("org/llama", "t1", "sampled")


@pytest.mark.parametrize(
    "change",
    [
        {"model": "/models/other"},
        {"device": "xpu"},
        {"kv_layout": "HND"},
        {"torch_version": "2.10.0"},
        {"hash_algo": "sha256_cbor"},
        {"hash_seed": "0"},
        {"weights": "w1"},
    ],
)
def test_any_model_fact_changes_every_key(change: dict[str, str]) -> None:
    before = prefixes(build_plan(engine(FULL, SLIDING), KVPoolConfig()))
    changed = EngineFacts(replace(MODEL, **change), (FULL, SLIDING))
    after = prefixes(build_plan(changed, KVPoolConfig()))
    assert all(a != b for a, b in zip(after, before))


@pytest.mark.parametrize(
    "group",
    [
        replace(FULL, dtype="torch.float16"),
        replace(FULL, num_kv_heads=4),
        replace(FULL, head_size=128),
        replace(FULL, kv_quant_mode="KVQuantMode.FP8"),
        replace(FULL, page_size_bytes=1),
        replace(FULL, spec=SpecFacts("MLAAttentionSpec", 64)),
        replace(FULL, spec=SpecFacts("FullAttentionSpec", 32)),
    ],
)
def test_any_group_fact_changes_that_groups_key(group: GroupFacts) -> None:
    assert prefixes(build_plan(engine(group), KVPoolConfig())) != prefixes(build_plan(engine(FULL), KVPoolConfig()))


def test_a_group_is_modelled_by_its_first_layer_only_when_every_layer_has_its_kind() -> None:
    """vLLM hands the scheduler the first layer's spec where the workers get every layer."""
    wide = SpecFacts("FullAttentionSpec", 64)
    assert group_layer("Uniform", ["a", "b"], lambda name: wide) == "a"
    facts = {"a": wide, "b": SpecFacts("SlidingWindowSpec", 64, sliding_window=64)}
    with pytest.raises(LayoutError, match="Uniform mixes attention kinds"):
        group_layer("Uniform", ["a", "b"], facts.__getitem__)
    with pytest.raises(LayoutError, match="RSWASpec"):
        group_layer("Uniform", ["a", "b"], lambda name: SpecFacts("RSWASpec", 64))
    with pytest.raises(LayoutError, match="no layers"):
        group_layer("Uniform", [], facts.__getitem__)
