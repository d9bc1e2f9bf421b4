"""kvpool's counters on vLLM's Prometheus registry (what `/metrics` serves) and stats log.

The stats classes are tested without an engine; one in-process pair of engines (save, then load)
and one multi-process engine check that the numbers really travel through vLLM.
"""

from __future__ import annotations

import functools
import json
import pickle
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.backends.memory import MemoryBackend
from kvpool.integrations.vllm import KVPoolConnector, local_scheduler, local_worker
from kvpool.integrations.vllm.metrics import (
    ALL_GAUGES,
    COUNTERS,
    SCHEDULER_COUNTERS,
    WORKER_COUNTERS,
    KVPoolPromMetrics,
    KVPoolStats,
    SchedulerStatsSampler,
    WorkerStatsSampler,
)
from kvpool.scheduler.scheduler_core import SchedulerStats
from kvpool.testing.engine import engine, generate_greedy
from kvpool.worker.stats import WorkerStats

from .conftest import BLOCK, connector_config, random_prompts

MAX_TOKENS = 16


def _stats(counters: dict[str, Any] | None = None, pools: dict[str, Any] | None = None) -> KVPoolStats:
    return KVPoolStats({"counters": counters or {}, "pools": pools or {}})


# ---- the stats payload (no engine) -----------------------------------------------------------


def test_empty_stats():
    assert KVPoolStats().is_empty()
    assert KVPoolStats({}).is_empty()
    assert KVPoolConnector.build_kv_connector_stats(None).is_empty()
    assert KVPoolConnector.build_kv_connector_stats({"counters": {}, "pools": {}}).is_empty()
    assert not _stats({"chunks_saved": 1}).is_empty()
    assert not _stats(pools={"tp0-pp0": {"pool_keys": 0}}).is_empty()
    assert KVPoolStats().reduce() == {}
    stats = _stats({"chunks_saved": 1}, {"tp0-pp0": {"pool_keys": 1}})
    stats.reset()
    assert stats.is_empty()


def test_aggregate_sums_counters_and_keeps_latest_pool_snapshot_per_rank():
    older = _stats(
        {"chunks_saved": 2, "bytes_captured": 250},
        {"tp0-pp0": {"pool_used_bytes": 100, "pool_keys": 1, "pool_capacity_bytes": 1000}},
    )
    newer = _stats(
        {"chunks_saved": 3, "chunks_loaded": 4, "bytes_captured": 500},
        {"tp0-pp0": {"pool_used_bytes": 300, "pool_keys": 3, "pool_capacity_bytes": 1000}},
    )
    other_rank = _stats(pools={"tp1-pp0": {"pool_used_bytes": 50, "pool_keys": 1, "pool_capacity_bytes": 1000}})
    merged = older.aggregate(newer).aggregate(other_rank).aggregate(KVPoolStats())
    assert merged is older
    assert merged.counters == {"chunks_saved": 5, "chunks_loaded": 4, "bytes_captured": 750}
    assert merged.pools["tp0-pp0"]["pool_used_bytes"] == 300
    assert merged.reduce() == {
        "chunks_saved": 5,
        "chunks_loaded": 4,
        "bytes_captured": 750,
        "pool_used_bytes": 350,
        "pool_keys": 4,
        "pool_capacity_bytes": 2000,
    }
    assert list(merged.reduce())[:3] == ["chunks_saved", "chunks_loaded", "bytes_captured"]  # spec order
    # the scheduler merges its own (counter-only) stats into the worker's: names never collide
    assert not {s.key for s in WORKER_COUNTERS} & {s.key for s in SCHEDULER_COUNTERS}
    assert _stats({"chunks_saved": 1}).aggregate(_stats({"lookups": 2})).counters == {"chunks_saved": 1, "lookups": 2}


def test_payload_is_copied_and_serialisable():
    payload = {"counters": {"chunks_saved": 1}, "pools": {"tp0-pp0": {"pool_keys": 1}}}
    stats = KVPoolConnector.build_kv_connector_stats(payload)
    stats.aggregate(_stats({"chunks_saved": 2}, {"tp0-pp0": {"pool_keys": 9}}))
    assert payload == {"counters": {"chunks_saved": 1}, "pools": {"tp0-pp0": {"pool_keys": 1}}}, "caller's dict mutated"
    # worker -> EngineCore is pickled, EngineCore -> front-end is msgpack: plain types only
    assert pickle.loads(pickle.dumps(stats)).to_dict() == stats.to_dict()
    assert json.loads(json.dumps(stats.to_dict())) == stats.to_dict()


# ---- samplers (engine side, no engine) -------------------------------------------------------


def test_worker_sampler_reports_deltas_and_nothing_when_idle():
    stats = WorkerStats()
    pool = MemoryBackend(1000)
    chunk = [np.zeros(400, dtype=np.uint8)]
    pool.put(["a", "b", "c"], [chunk] * 3)  # "a" evicted before this engine started: not counted
    sampler = WorkerStatsSampler(stats, pool, "tp0-pp0", pool_sample_interval_s=3600)
    first = sampler.take()  # the pool's gauges once at start-up
    assert first is not None and first.counters == {}
    assert first.pools == {"tp0-pp0": {"pool_used_bytes": 800, "pool_keys": 2, "pool_capacity_bytes": 1000}}
    assert sampler.take() is None
    pool.put(["d"], [[np.zeros(300, dtype=np.uint8)]])  # evicts "b"; re-read only with worker activity (interval 1 h)
    assert sampler.take() is None
    stats.chunks_put += 1
    stats.bytes_put += 400
    stats.bytes_captured += 500
    delta = sampler.take()
    assert delta is not None
    assert delta.counters == {"chunks_saved": 1, "bytes_saved": 400, "bytes_captured": 500, "pool_evictions": 1}
    assert delta.pools == {"tp0-pp0": {"pool_used_bytes": 700, "pool_keys": 2, "pool_capacity_bytes": 1000}}
    assert sampler.take() is None
    stats.chunks_loaded += 1
    assert sampler.take().to_dict() == {"counters": {"chunks_loaded": 1}, "pools": {}}  # pool unchanged
    # a counter that went down (a replaced source) never yields a negative delta
    stats.chunks_loaded = 0
    assert sampler.take() is None
    stats.chunks_loaded = 2
    assert sampler.take().counters == {"chunks_loaded": 2}


def test_worker_sampler_rereads_pool_gauges_when_idle_after_the_interval():
    pool = MemoryBackend(1000)
    sampler = WorkerStatsSampler(WorkerStats(), pool, "tp0-pp0", pool_sample_interval_s=0.0)
    assert sampler.take() is not None
    assert sampler.take() is None  # unchanged
    pool.put(["a"], [[np.zeros(10, dtype=np.uint8)]])  # e.g. another engine sharing the pool
    assert sampler.take().pools["tp0-pp0"]["pool_keys"] == 1


def test_worker_sampler_skips_pool_gauges_of_remote_backends():
    stats = WorkerStats()
    sampler = WorkerStatsSampler(stats, SimpleNamespace(name="mooncake"))
    assert sampler.take() is None
    stats.chunks_put += 1
    assert sampler.take().to_dict() == {"counters": {"chunks_saved": 1}, "pools": {}}


def test_scheduler_sampler():
    stats = SchedulerStats()
    sampler = SchedulerStatsSampler(stats)
    assert sampler.take() is None
    stats.lookups += 2
    stats.lookup_hit_tokens += 256
    assert sampler.take().counters == {"lookups": 2, "lookup_hit_tokens": 256}
    assert sampler.take() is None


def test_sampling_cost_does_not_depend_on_requests():
    """A step reads a fixed set of attributes: O(number of counters), never per request."""
    reads: list[str] = []

    class Recording(WorkerStats):
        def __getattribute__(self, name: str) -> Any:
            reads.append(name)
            return object.__getattribute__(self, name)

    sampler = WorkerStatsSampler(Recording(), None)
    sampler.take()
    assert len(reads) == len(WORKER_COUNTERS)


# ---- Prometheus and the stats log (no engine) --------------------------------------------------


def _prom(registry: CollectorRegistry) -> KVPoolPromMetrics:
    metric_types = {cls: functools.partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    built = KVPoolConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        metric_types,
        ["model_name", "engine"],
        {0: ["m", "0"], 1: ["m", "1"]},
    )
    assert isinstance(built, KVPoolPromMetrics)
    return built


def test_prom_metrics_record_counters_and_pool_gauges():
    registry = CollectorRegistry()
    prom = _prom(registry)
    names = {m.name for m in registry.collect()}
    assert names == {f"vllm:kvpool_{s.key}" for s in COUNTERS + ALL_GAUGES}
    prom.observe({}, 0)
    prom.observe(_stats({"chunks_saved": 3, "bytes_saved": 30, "unknown_key": 1}).to_dict(), 0)
    prom.observe(_stats({"chunks_saved": 2, "lookup_hit_tokens": 64}).to_dict(), 0)
    prom.observe(_stats({"chunks_saved": 5}).to_dict(), 1)
    prom.observe(_stats(pools={"tp0-pp0": {"pool_used_bytes": 10, "pool_keys": 1}}).to_dict(), 0)
    prom.observe(_stats(pools={"tp1-pp0": {"pool_used_bytes": 20, "pool_keys": 2}}).to_dict(), 0)
    prom.observe(_stats(pools={"tp0-pp0": {"pool_used_bytes": 15, "pool_keys": 1}}).to_dict(), 0)

    def value(name: str, engine_idx: str = "0") -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "engine": engine_idx})

    assert value("vllm:kvpool_chunks_saved_total") == 5
    assert value("vllm:kvpool_chunks_saved_total", "1") == 5
    assert value("vllm:kvpool_bytes_saved_total") == 30
    assert value("vllm:kvpool_lookup_hit_tokens_total") == 64
    assert value("vllm:kvpool_chunks_loaded_total") == 0
    assert value("vllm:kvpool_pool_used_bytes") == 35  # rank 0's latest + rank 1's
    assert value("vllm:kvpool_pool_keys") == 3


def test_periodic_log_line():
    """vLLM's logging stat logger rebuilds our stats class, accumulates and logs ``reduce()``."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    logging_ = KVConnectorLogging(KVTransferConfig(**connector_config("unused")))
    logging_.observe(_stats({"chunks_saved": 2}).to_dict())
    logging_.observe(_stats({"chunks_saved": 1, "chunks_loaded": 4}).to_dict())
    lines: list[str] = []
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: chunks_saved=3, chunks_loaded=4"]
    logging_.log(lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1, "the accumulator is reset after each log line"


# ---- real engines ------------------------------------------------------------------------------


def _exposed(llm: Any) -> dict[str, float]:
    """kvpool samples of this engine as `/metrics` would serve them (same registry, same text)."""
    assert llm.get_metrics()  # vLLM's own reader of the in-memory registry works too
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if sample.name.startswith("vllm:kvpool_") and not sample.name.endswith("_created"):
                assert sample.labels.get("engine") == "0" and sample.labels.get("model_name")
                samples[sample.name] = sample.value
    return samples


def _settle(llm: Any) -> None:
    """Let in-process saves finish and run idle steps so their stats are reported."""
    worker = local_worker()
    assert worker is not None
    assert worker.drain(30.0)
    for _ in range(3):
        llm.llm_engine.step()
        assert worker.drain(30.0)


@pytest.mark.vllm
def test_in_process_engines_report_saves_and_loads(model_dir, pool_name):
    model = model_dir("llama")
    prompts = random_prompts(2, 300, seed=1)
    config = connector_config(pool_name)
    with engine(model, block_size=BLOCK, kv_transfer_config=config, disable_log_stats=False) as llm:
        generate_greedy(llm, prompts, MAX_TOKENS)
        _settle(llm)
        saved = _exposed(llm)
        worker, scheduler = local_worker().stats, local_scheduler().stats
    # the deltas add up to exactly what the core counted
    assert saved["vllm:kvpool_chunks_saved_total"] == worker.chunks_put > 0
    assert saved["vllm:kvpool_bytes_saved_total"] == worker.bytes_put > 0
    assert saved["vllm:kvpool_chunks_examined_total"] == worker.chunks_examined
    assert saved["vllm:kvpool_lookups_total"] == scheduler.lookups > 0
    assert saved["vllm:kvpool_chunks_loaded_total"] == 0
    assert saved["vllm:kvpool_pool_keys"] == worker.chunks_put  # a fresh pool holds what was saved
    assert saved["vllm:kvpool_pool_used_bytes"] == worker.bytes_put
    assert saved["vllm:kvpool_pool_capacity_bytes"] == 256 << 20

    with engine(model, block_size=BLOCK, kv_transfer_config=config, disable_log_stats=False) as llm:
        loaded_results = generate_greedy(llm, prompts, MAX_TOKENS)
        _settle(llm)
        loaded = _exposed(llm)
        worker = local_worker().stats
    assert [r.num_cached_tokens for r in loaded_results] == [256, 256]
    # a new engine registers fresh counters: only this engine's work shows
    assert loaded["vllm:kvpool_chunks_loaded_total"] == worker.chunks_loaded == 8
    assert loaded["vllm:kvpool_bytes_loaded_total"] == worker.bytes_loaded > 0
    assert loaded["vllm:kvpool_chunks_load_failed_total"] == 0
    assert loaded["vllm:kvpool_lookup_hit_tokens_total"] == 512
    assert loaded["vllm:kvpool_load_tokens_total"] == 512
    assert loaded["vllm:kvpool_chunks_saved_total"] == worker.chunks_put
    assert loaded["vllm:kvpool_pool_keys"] == saved["vllm:kvpool_pool_keys"]


@pytest.mark.vllm
def test_multi_process_engine_reports_worker_and_scheduler_stats(model_dir, pool_name):
    """Worker stats cross two process boundaries (worker -> EngineCore -> front-end)."""
    model = model_dir("llama")
    prompts = random_prompts(2, 300, seed=11)
    nudge = random_prompts(1, 40, seed=12)  # shorter than a block: never touches the pool
    # the embedded pool lives in the worker process: save and load in one engine, with vLLM's own
    # prefix cache off so the second pass loads from the pool
    with engine(
        model,
        block_size=BLOCK,
        kv_transfer_config=connector_config(pool_name),
        disable_log_stats=False,
        multiprocess=True,
        enable_prefix_caching=False,
    ) as llm:
        generate_greedy(llm, prompts, MAX_TOKENS)
        time.sleep(0.5)  # the saves run while the prompts decode; leave them a margin before the lookups
        generate_greedy(llm, prompts, MAX_TOKENS)
        # stats of steps after the last output wait in the output queue until the next call
        time.sleep(0.5)
        generate_greedy(llm, nudge, 1)
        exposed = _exposed(llm)
    assert exposed["vllm:kvpool_chunks_saved_total"] == 8
    assert exposed["vllm:kvpool_chunks_loaded_total"] == 8
    assert exposed["vllm:kvpool_lookup_hit_tokens_total"] == 512
    assert exposed["vllm:kvpool_pool_keys"] == 8
