"""Issue 43 item 4 on a real vLLM CPU engine: no request waits without bound for an async load. A tiny
KV cache (room for 4 requests), 8 concurrent prompts whose hits are on the disk tier only, every disk
read stuck (it returns only once the test ends; the tier's own read deadline is at its maximum, 60 s):
each load is reported failed at `load_deadline_s`, vLLM recomputes it, every request finishes with
vLLM's own tokens, `vllm:kvpool_loads_timed_out` counts them, and no load holds its request (and its
blocks) much past the deadline. Without the deadline the engine waits on the stuck reads (vLLM's
schedulers stuck with async loads under KV pressure, vLLM PR 57841 / issue 49829): the bounded loop
below then fails instead of hanging."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from kvpool.backends.base import Status
from kvpool.backends.factory import create_backend
from kvpool.backends.shared_pools import drop_shared_tiered_pools
from kvpool.backends.tiered import TieredPool
from kvpool.core.config import KVPoolConfig
from kvpool.integrations.vllm import _LOCAL_SCHEDULERS, local_worker
from kvpool.testing.engine import engine, generate_greedy

from .conftest import BLOCK, connector_config, random_prompts
from .test_vllm_metrics import _exposed

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
PROMPT = 200  # tokens: 3 full blocks stored, a hit of 192
CHUNKS = PROMPT // BLOCK
DEADLINE_S = 1.0
WAIT_LIMIT_S = DEADLINE_S + 5.0  # generous: the deadline, a watchdog poll, a few engine steps
RUN_LIMIT_S = 40.0  # the whole stuck phase; without a deadline it would wait 60 s per read
# 16 blocks of 64 tokens: 4 of these requests at once, so loads hold blocks others need
TIGHT = {"block_size": BLOCK, "kv_cache_memory_bytes": 2 << 20, "max_model_len": 512}


def _tiered(config: dict[str, Any]) -> TieredPool:
    options = KVPoolConfig.from_dict(config["kv_connector_extra_config"]).backend_options(rank=0)
    pool = create_backend("memory", options)
    assert isinstance(pool, TieredPool)
    return pool


def _watch_load_waits(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """Per request, the wall time from vLLM allocating blocks for its load to vLLM being told the load
    finished (the time it sits in WAITING_FOR_REMOTE_KVS); filled in as the engine steps."""
    assert len(_LOCAL_SCHEDULERS) == 1
    side: Any = next(iter(_LOCAL_SCHEDULERS.values()))
    allocated: dict[str, float] = {}
    waits: dict[str, float] = {}
    after_alloc, absorb = side.after_alloc, side.absorb

    def timed_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            allocated[request.request_id.rsplit("-", 1)[0]] = time.monotonic()  # vLLM suffixes the caller's id
        after_alloc(request, blocks, num_external_tokens)

    def timed_absorb(output: Any) -> None:
        now = time.monotonic()
        for req_id in output.finished_recving or ():
            req_id = req_id.rsplit("-", 1)[0]
            if req_id in allocated:
                waits[req_id] = now - allocated.pop(req_id)
        absorb(output)

    monkeypatch.setattr(side, "after_alloc", timed_after_alloc)
    monkeypatch.setattr(side, "absorb", timed_absorb)
    return waits


def test_loads_stuck_on_disk_under_kv_pressure_fail_at_the_deadline_and_every_request_finishes(
    model_dir, pool_name, tmp_path, monkeypatch
):
    from vllm import SamplingParams

    model = model_dir("llama")
    extra = {
        "pool_name": pool_name,
        "disk_path": str(tmp_path / "kv"),
        "disk_capacity_bytes": "64MiB",
        "disk_read_timeout_ms": 60_000,  # the tier's own deadline never rescues a stuck read here
        "load_deadline_s": DEADLINE_S,
    }
    config = connector_config(**extra)
    healthy, stuck = random_prompts(2, PROMPT, seed=91), random_prompts(8, PROMPT, seed=92)
    try:
        with engine(model, **TIGHT) as llm:
            baseline = [r.token_ids for r in generate_greedy(llm, healthy + stuck, MAX_TOKENS)]
        with engine(model, kv_transfer_config=config, **TIGHT) as llm:
            generate_greedy(llm, healthy + stuck, MAX_TOKENS)
            worker = local_worker()
            assert worker is not None and worker.drain(30.0)
        assert _tiered(config).flush(30.0)
        drop_shared_tiered_pools()  # a restart: DRAM is empty, every chunk is on disk only

        with engine(model, kv_transfer_config=config, disable_log_stats=False, **TIGHT) as llm:
            pool = _tiered(config)
            assert pool.memory.keys() == [] and len(pool.disk.keys()) == CHUNKS * (len(healthy) + len(stuck))
            worker = local_worker()
            assert worker is not None

            # the disk answers: hits from disk load, as without a deadline
            loaded = generate_greedy(llm, healthy, MAX_TOKENS)
            assert [r.num_cached_tokens for r in loaded] == [CHUNKS * BLOCK] * len(healthy)
            assert worker.stats.chunks_loaded == CHUNKS * len(healthy) and worker.stats.loads_timed_out == 0
            assert [r.token_ids for r in loaded] == baseline[: len(healthy)]

            # the disk stops answering: every read stays stuck until the test ends
            waits = _watch_load_waits(monkeypatch)
            gate = threading.Event()
            read = pool.disk.read

            def stuck_read(key: str) -> np.ndarray | Status:
                gate.wait(120)
                return read(key)

            monkeypatch.setattr(pool.disk, "read", stuck_read)
            core = llm.llm_engine
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
            try:
                for index, prompt in enumerate(stuck):
                    core.add_request(f"s{index}", {"prompt_token_ids": prompt}, params)
                outputs: dict[str, list[int]] = {}
                began = time.monotonic()
                while len(outputs) < len(stuck):
                    assert time.monotonic() - began < RUN_LIMIT_S, (
                        f"{len(stuck) - len(outputs)} requests unfinished after {RUN_LIMIT_S} s, their loads stuck; "
                        f"loads reported finished: {sorted(waits)}"
                    )
                    for out in core.step():
                        if out.finished:
                            outputs[out.request_id] = list(out.outputs[0].token_ids)
            finally:
                gate.set()  # the abandoned reads return (into the loads' own buffers) and their threads end
            assert [outputs[f"s{index}"] for index in range(len(stuck))] == baseline[len(healthy) :]
            assert worker.drain(30.0)
            assert set(waits) == {f"s{index}" for index in range(len(stuck))}, "every stuck prompt had a disk hit"
            assert max(waits.values()) < WAIT_LIMIT_S, waits
            assert min(waits.values()) >= DEADLINE_S * 0.5, waits  # failed by the deadline, not at once
            timed_out = worker.stats.loads_timed_out
            assert timed_out == len(stuck), timed_out
            for _ in range(3):
                core.step()  # the last counters ride the next steps' outputs
            exposed = _exposed(llm)
            assert exposed["vllm:kvpool_loads_timed_out_total"] == timed_out
            assert exposed["vllm:kvpool_chunks_loaded_total"] == CHUNKS * len(healthy)  # the stuck loads landed nowhere
    finally:
        drop_shared_tiered_pools()
