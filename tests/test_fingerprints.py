"""fingerprints: what names a model's KV bytes, from plain facts (weights digest, kernel build, hash seed)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from kvpool.core.config import KVPoolConfig
from kvpool.core.fingerprints import (
    GroupFacts,
    ModelFacts,
    WeightsFacts,
    cpu_isa,
    group_fingerprints,
    isa_from_flags,
    weights_digest,
)
from kvpool.core.masks import FullAttention
from kvpool.core.specs import SpecFacts

WEIGHTS = WeightsFacts(
    kv_cache_dtype="auto",
    revision=None,
    code_revision=None,
    quantization=None,
    dtype="torch.bfloat16",
    load_format="auto",
    seed=0,
    hf_config={"hidden_size": 64, "rope_theta": 10000.0},
)
GROUP = GroupFacts(SpecFacts("FullAttentionSpec", 16), dtype="torch.bfloat16")


def test_the_weights_digest_is_stable_and_short() -> None:
    assert weights_digest(WEIGHTS) == weights_digest(replace(WEIGHTS, hf_config=dict(WEIGHTS.hf_config)))
    assert len(weights_digest(WEIGHTS)) == 16


@pytest.mark.parametrize(
    "change",
    [
        {"kv_cache_dtype": "fp8"},
        {"revision": "v2"},
        {"code_revision": "v2"},
        {"quantization": "fp8"},
        {"dtype": "torch.float16"},
        {"load_format": "safetensors"},
        {"hf_config": {"hidden_size": 64, "rope_theta": 1234.0}},  # an hf_overrides change
    ],
)
def test_what_decides_the_kv_bytes_changes_the_digest(change: dict[str, object]) -> None:
    assert weights_digest(replace(WEIGHTS, **change)) != weights_digest(WEIGHTS)  # type: ignore[arg-type]


def test_the_seed_counts_only_for_dummy_weights() -> None:
    assert weights_digest(replace(WEIGHTS, seed=1234)) == weights_digest(WEIGHTS)
    dummy = replace(WEIGHTS, load_format="dummy")
    assert weights_digest(replace(dummy, seed=1234)) != weights_digest(dummy)


def test_private_config_keys_and_the_library_version_do_not_count() -> None:
    noisy = {**WEIGHTS.hf_config, "_name_or_path": "/elsewhere", "transformers_version": "9.9"}
    assert weights_digest(replace(WEIGHTS, hf_config=noisy)) == weights_digest(WEIGHTS)


def test_the_best_isa_the_cpu_has_names_the_packing(tmp_path: Path) -> None:
    assert isa_from_flags("flags\t: fpu avx2 avx512f amx_bf16") == "amx_bf16"
    assert isa_from_flags("flags\t: fpu avx2 avx512f") == "avx512f"
    assert isa_from_flags("flags\t: fpu avx2") == "avx2"
    assert isa_from_flags("flags\t: fpu sse4_2") == "base"
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert cpu_isa(str(cpuinfo)) == "avx512f"
    assert cpu_isa(str(tmp_path / "missing")) == "unknown"


def test_a_cpu_engine_names_its_isa_others_their_torch_build() -> None:
    cpu = ModelFacts("m", "cpu", torch_version="2.9.0")
    (fingerprint,) = group_fingerprints(cpu, [GROUP], [FullAttention(16)], KVPoolConfig())
    assert fingerprint.kv_layout.split(":")[2] == cpu_isa()
    gpu = replace(cpu, device="cuda", kv_layout="NHD")
    (fingerprint,) = group_fingerprints(gpu, [GROUP], [FullAttention(16)], KVPoolConfig())
    assert fingerprint.kv_layout == "cuda:NHD:2.9.0:0x0:"


def test_a_per_process_hash_seed_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """xxhash without PYTHONHASHSEED seeds vLLM's block hashes per process: no other engine can hit."""
    unseeded = ModelFacts("m", "cuda", hash_algo="xxhash")
    with caplog.at_level(logging.WARNING, logger="kvpool.fingerprints"):
        (fingerprint,) = group_fingerprints(unseeded, [GROUP], [FullAttention(16)], KVPoolConfig())
    assert "PYTHONHASHSEED" in caplog.text
    assert fingerprint.hash_algo == "xxhash:"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvpool.fingerprints"):
        for model in (replace(unseeded, hash_seed="0"), replace(unseeded, hash_algo="sha256")):
            group_fingerprints(model, [GROUP], [FullAttention(16)], KVPoolConfig())
    assert caplog.text == ""
    seeded = group_fingerprints(replace(unseeded, hash_seed="0"), [GROUP], [FullAttention(16)], KVPoolConfig())
    assert seeded[0].hash_algo == "xxhash:0"
