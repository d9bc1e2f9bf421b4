"""What names a model's KV bytes: one layout fingerprint per KV-cache group, from plain facts an
adapter reads out of its engine's config.

Invariants:
- Whatever may change a chunk's bytes is in its group's fingerprint, so two engines whose bytes may
  differ never share a key: the model (or `model_id`), the weights digest (the checkpoint's own digest
  from `checkpoint.py`, the `weights_version` setting and the engine's in-place weight updates, revision,
  code revision, quantization, model dtype, load format, the seed of dummy weights, KV cache dtype, the
  model config less its private keys and library version), the group's dtype, block size, page size, head shape
  and KV quantization, the device, tensor layout and kernel build, the attention kind, the block-hash
  algorithm and its seed, the tenant and what a chunk's seal covers.
- Nothing here depends on the role, the rank or the process, so the scheduler and every worker of an
  engine build the same fingerprints. TP shard and PP rank stay 0: placement (`plan.py`) sets them.
- No engine is imported: the facts are plain values.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.core.config import Integrity, KVPoolConfig
from kvpool.core.keys import LayoutFingerprint
from kvpool.core.masks import AttentionKind
from kvpool.core.specs import SpecFacts

log = logging.getLogger("kvpool.fingerprints")

# CPU kernels pack K/V per instruction set, best first: the best one the CPU has names the packing
CPU_ISAS = ("amx_bf16", "avx512f", "avx2")


@dataclass(frozen=True)
class WeightsFacts:
    """What decides the KV bytes besides the model path and the tensor layout. LoRA adapters,
    multimodal inputs and cache salts are not here: they already reach the engine's block hashes."""

    kv_cache_dtype: str
    revision: str | None = None
    code_revision: str | None = None
    quantization: str | None = None
    dtype: str = ""
    load_format: str = "auto"
    seed: int | None = None  # counts only for dummy weights, which follow it
    hf_config: Mapping[str, Any] = field(default_factory=dict)  # after the engine's overrides
    checkpoint: str | None = None  # checkpoint.checkpoint_digest: the weight files' own digest
    version: str = ""  # the `weights_version` setting: what names weights nothing else can see


def weights_named(facts: WeightsFacts) -> bool:
    """Whether something names the weights' values, not only their path: the checkpoint's digest, the
    operator's `weights_version`, or dummy weights (their seed decides them)."""
    return facts.checkpoint is not None or bool(facts.version) or "dummy" in facts.load_format


def weights_digest(facts: WeightsFacts) -> str:
    config = {k: v for k, v in facts.hf_config.items() if not k.startswith("_") and k != "transformers_version"}
    named = {
        "kv_cache_dtype": facts.kv_cache_dtype,
        "revision": facts.revision,
        "code_revision": facts.code_revision,
        "quantization": facts.quantization,
        "dtype": facts.dtype,
        "load_format": facts.load_format,
        "seed": facts.seed if "dummy" in facts.load_format else None,
        "hf_config": config,
        "checkpoint": facts.checkpoint,
        "version": facts.version,
    }
    text = json.dumps(named, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class ModelFacts:
    """An engine's model and KV storage, engine-neutral; the same in every process of the engine."""

    model: str  # path or name; kvpool's `model_id` replaces it in keys
    device: str  # "cpu", "cuda", ...
    kv_layout: str | None = None  # the engine's KV tensor layout; None: its default
    torch_version: str = ""  # names the kernel build off the CPU
    hash_algo: str = ""  # the engine's block-hash function
    hash_seed: str | None = None  # the seed the engine's hash takes from the environment; None: unset
    weights: str = ""  # weights_digest(...)


@dataclass(frozen=True)
class GroupFacts:
    """One KV-cache group: its spec facts and the bytes of one block of one layer."""

    spec: SpecFacts
    dtype: str
    num_kv_heads: int = 0
    head_size: int = 0
    kv_quant_mode: str = ""
    page_size_bytes: int = 0  # per layer; which layers a rank holds comes from its PP stage


def isa_from_flags(flags: str) -> str:
    """The CPU_ISAS entry a /proc/cpuinfo `flags` line names first; "base" when none."""
    return next((isa for isa in CPU_ISAS if f" {isa}" in flags), "base")


def cpu_isa(cpuinfo: str = "/proc/cpuinfo") -> str:
    try:
        with open(cpuinfo) as lines:
            flags = next((line for line in lines if line.startswith("flags")), "")
    except OSError:
        return "unknown"
    return isa_from_flags(flags)


def group_fingerprints(
    model: ModelFacts,
    groups: Sequence[GroupFacts],
    kinds: Sequence[AttentionKind],
    config: KVPoolConfig,
    *,
    pp_size: int = 1,
) -> list[LayoutFingerprint]:
    """One fingerprint per group (`kinds[g]` models `groups[g]`), at TP shard 0 and PP rank 0."""
    if model.hash_algo.startswith("xxhash") and model.hash_seed is None:
        log.warning(
            "prefix_caching_hash_algo=%s without PYTHONHASHSEED seeds block hashes per process: "
            "other engines will never hit what this one stores",
            model.hash_algo,
        )
    layout = model.kv_layout or "default"
    kernels = cpu_isa() if model.device == "cpu" else model.torch_version
    return [
        LayoutFingerprint(
            model=config.model_id or model.model,
            dtype=group.dtype,
            block_size=kind.block_size,
            kv_layout=(
                f"{model.device}:{layout}:{kernels}:{group.num_kv_heads}x{group.head_size}:{group.kv_quant_mode}"
            ),
            chunk_bytes=group.page_size_bytes,
            pp_size=pp_size,
            group_id=group_id,
            attention=f"{group.spec.type_name}:{kind.describe()}",
            hash_algo=f"{model.hash_algo}:{model.hash_seed or ''}",
            weights=model.weights,
            tenant=config.tenant,
            integrity="" if config.integrity == Integrity.OFF else config.integrity,
        )
        for group_id, (group, kind) in enumerate(zip(groups, kinds))
    ]
