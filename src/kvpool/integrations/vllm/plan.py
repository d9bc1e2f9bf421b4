"""vLLM's config objects read into the plain facts kvpool plans from (`kvpool.core.plan.EngineFacts`).

Only reading lives here: which kind models a spec is `kvpool.core.specs`', what names the KV bytes
`kvpool.core.fingerprints`', where a rank's chunks go `kvpool.core.plan`'s. Both connector roles read the same
facts from the same engine, whichever shape vLLM hands each role its KV cache config in.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from fractions import Fraction
from typing import TYPE_CHECKING

import torch

from kvpool.core.checkpoint import checkpoint_digest
from kvpool.core.config import KVPoolConfig
from kvpool.core.fingerprints import GroupFacts, ModelFacts, WeightsFacts, weights_named
from kvpool.core.fingerprints import weights_digest as digest_of
from kvpool.core.plan import EngineFacts, ModelPlan, Parallelism, build_plan
from kvpool.core.specs import SpecFacts, attention_kind, group_layer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec


def group_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The spec both roles see for a group: vLLM hands the scheduler the first layer's spec where the
    workers get a `UniformTypeKVCacheSpecs` (layers of one kind whose sizes differ)."""
    layers: dict[str, KVCacheSpec] | None = getattr(spec, "kv_cache_specs", None)
    if not layers:
        return spec
    return group_layer(type(spec).__name__, list(layers.values()), spec_facts)


def spec_facts(spec: KVCacheSpec) -> SpecFacts:
    return SpecFacts(
        type_name=type(spec).__name__,
        block_size=spec.block_size,
        sliding_window=getattr(spec, "sliding_window", None),
        extra_retained_tokens=getattr(spec, "extra_retained_tokens", 0) or 0,
        attention_chunk_size=getattr(spec, "attention_chunk_size", None),
        non_causal=bool(getattr(spec, "non_causal", False)),
        state_cache_mode=getattr(spec, "mamba_cache_mode", None),
        num_speculative_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0),
        tokens_per_state=tokens_per_state(spec),
    )


def tokens_per_state(spec: KVCacheSpec) -> int | Fraction:
    """The spec's `tokens_per_state` as vLLM states it: an int, or a Fraction below 1 (never truncated:
    `int(Fraction(1, 4))` would read Whisper's several states per token as 0). -1 without the field."""
    value = getattr(spec, "tokens_per_state", -1)
    if isinstance(value, Fraction):
        return int(value) if value.denominator == 1 else value
    return int(value)


def group_facts(spec: KVCacheSpec, model_dtype: object) -> GroupFacts:
    # not every spec has a head shape or a dtype of its own; the model's dtype stands in
    shapes = getattr(spec, "shapes", None)
    if shapes is not None:
        # a state (MambaSpec): its type, shapes and dtypes decide the bytes of its block
        return GroupFacts(
            spec=spec_facts(spec),
            dtype=",".join(str(dtype) for dtype in getattr(spec, "dtypes", ())),
            kv_quant_mode=f"{getattr(spec, 'mamba_type', '')}:{tuple(map(tuple, shapes))}",
            page_size_bytes=spec.page_size_bytes,
        )
    return GroupFacts(
        spec=spec_facts(spec),
        dtype=str(getattr(spec, "dtype", model_dtype)),
        num_kv_heads=getattr(spec, "num_kv_heads", 0),
        head_size=getattr(spec, "head_size", 0),
        kv_quant_mode=f"{getattr(spec, 'kv_quant_mode', '')}",
        page_size_bytes=spec.page_size_bytes,
    )


log = logging.getLogger("kvpool.vllm")


def weights_facts(vllm_config: VllmConfig, version: str = "") -> WeightsFacts:
    """`version`: the `weights_version` setting. The checkpoint is read where the engine reads it: the
    model's directory, or the hub snapshot at its revision (dummy weights have none: the seed names them)."""
    model = vllm_config.model_config
    load_format = str(vllm_config.load_config.load_format)
    checkpoint = None if "dummy" in load_format else checkpoint_digest(model.model, model.revision)
    return WeightsFacts(
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        revision=model.revision,
        code_revision=model.code_revision,
        quantization=model.quantization,
        dtype=str(model.dtype),
        load_format=load_format,
        seed=model.seed,
        hf_config=model.hf_config.to_dict(),
        checkpoint=checkpoint,
        version=version,
    )


def weights_digest(vllm_config: VllmConfig, version: str = "") -> str:
    facts = weights_facts(vllm_config, version)
    if not weights_named(facts):
        log.warning(
            "kvpool cannot read the weights of %r (load_format=%s): its keys name the path and config only, "
            "so new weights at this path would be served KV of the old ones; set weights_version in "
            "kv_connector_extra_config and change it with the weights",
            vllm_config.model_config.model,
            facts.load_format,
        )
    return digest_of(facts)


def engine_facts(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, weights_version: str = "") -> EngineFacts:
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    specs = [group_spec(group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups]
    for spec in specs:
        # an unsupported spec is refused by name before its sizes are read (vLLM's base spec raises there)
        attention_kind(spec_facts(spec))
    groups = tuple(group_facts(spec, model_config.dtype) for spec in specs)
    model = ModelFacts(
        model=model_config.model,
        device=vllm_config.device_config.device_type,
        kv_layout=kv_cache_config.kv_cache_layout,
        torch_version=torch.__version__,
        hash_algo=vllm_config.cache_config.prefix_caching_hash_algo,
        hash_seed=os.environ.get("PYTHONHASHSEED"),  # vLLM seeds its block hashes from it
        weights=weights_digest(vllm_config, weights_version),
    )
    return EngineFacts(
        model,
        groups,
        Parallelism(
            rank=getattr(parallel, "rank", 0),
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            kv_tp_replicas=int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1),
            # the DP rank, in the engine core and its workers alike: vLLM resets data_parallel_rank to 0
            # for a dense model's DP engines (reconfigure_for_independent_dp_rank), never this one
            dp_rank=int(getattr(parallel, "data_parallel_index", getattr(parallel, "data_parallel_rank", 0)) or 0),
        ),
        hash_block_size=kv_cache_config.hash_block_size,
        retention_interval=kv_cache_config.prefix_cache_retention_interval,
        drop_last_hit_block=drops_eagle_block(vllm_config),
    )


def drops_eagle_block(vllm_config: VllmConfig) -> bool:
    """Whether vLLM's scheduler drops the last block of a prefix hit for an EAGLE / MTP drafter (its
    `use_eagle_block_drop`): the drafter's KV there depends on the next token, which no key names."""
    speculative = getattr(vllm_config, "speculative_config", None)
    drop = getattr(speculative, "use_eagle_block_drop", None)
    return bool(drop()) if callable(drop) else False


def plan_model(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: KVPoolConfig) -> ModelPlan:
    plan = build_plan(engine_facts(vllm_config, kv_cache_config, config.weights_version), config)
    step_tokens = int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 0)
    return dataclasses.replace(
        plan, bytes_per_token=rank_bytes_per_token(kv_cache_config, plan.pp_size), step_tokens=step_tokens
    )


def rank_bytes_per_token(kv_cache_config: KVCacheConfig, pp_size: int) -> float:
    """One rank's KV bytes a token over every group (a page is one layer's block on one TP rank; PP
    stages split the layers): what a hit's load copies, for the in-step budget."""
    total = 0.0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        total += spec.page_size_bytes * len(group.layer_names) / max(1, spec.block_size)
    return total / max(1, pp_size)
