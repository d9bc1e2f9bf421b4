"""A hybrid attention + Mamba2 model (tiny GraniteMoeHybrid) on vLLM's CPU engine: pool hits through
vLLM's boundary-state hand-off (`SchedulerOutput.kv_connector_block_state.boundary_state_offloads`).

The CPU build hands the states over: with prefix caching on, vLLM picks Mamba "align" mode, a 128-token
state block and a 256-token attention block (LCM 256), and offers each cached 256-token boundary's state
block in the step whose forward writes it. kvpool copies it out in that step, and a fresh engine loads it
(with the attention chunks up to the boundary) into the state block vLLM allocates; vLLM's model runner then
copies the loaded state into the request's running block before the forward.
"""

from __future__ import annotations

import pytest

from kvpool.backends.shared_pools import shared_memory_pool
from kvpool.integrations.vllm import local_scheduler, local_worker
from kvpool.testing.engine import assert_same_greedy, engine, generate_greedy

from .conftest import connector_config, random_prompts

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
BOUNDARY = 256  # vLLM's LCM of the Mamba (128) and attention (256) blocks on this model
SETTINGS = {"block_size": 128, "max_num_batched_tokens": 128, "enable_prefix_caching": True, "max_model_len": 1024}
STATE_GROUP = "/g0/"  # vLLM's group 0 is the Mamba group on this model


def _run(llm, prompts, max_tokens=MAX_TOKENS):
    results = generate_greedy(llm, prompts, max_tokens)
    worker, scheduler = local_worker(), local_scheduler()
    assert worker is not None and scheduler is not None
    assert worker.drain(30.0), "saves did not finish"
    for _ in range(3):  # the worker hears of finished requests on the next step
        llm.llm_engine.step()
        assert worker.drain(30.0)
    return results, worker.stats, scheduler.stats, worker.active_requests() + scheduler.active_requests()


def _state_keys(pool_name: str) -> list[str]:
    stored = shared_memory_pool(pool_name, 256 << 20).keys()
    return [key for key in stored if STATE_GROUP in key]


def _rewrite_states(pool_name: str, *, resize: bool) -> int:
    """Replace every stored state with random bytes (or bytes of the wrong size); how many."""
    import numpy as np

    pool = shared_memory_pool(pool_name, 256 << 20)
    rng = np.random.default_rng(0)
    keys = _state_keys(pool_name)
    for key in keys:
        size = pool.nbytes_of(key) or 1
        pool.remove([key])
        pool.put([key], [[rng.integers(0, 255, size=1 if resize else size, dtype=np.uint8)]])
    return len(keys)


@pytest.fixture(scope="module")
def hybrid(model_dir):
    return model_dir("granite-hybrid")


def test_a_fresh_engine_hits_the_states_another_stored_and_a_failed_state_load_recomputes(hybrid, pool_name):
    base = random_prompts(1, 300, seed=31)[0]
    tail = random_prompts(1, 60, seed=32)[0]
    prompts = [base, base[:BOUNDARY] + tail]  # the second shares the first's boundary, not its tail
    config = connector_config(pool_name, integrity="off")  # the rewrite below must reach the engine
    with engine(hybrid, **SETTINGS) as llm:
        baseline = generate_greedy(llm, prompts, MAX_TOKENS)
    with engine(hybrid, kv_transfer_config=config, **SETTINGS) as llm:
        stored, _, sched_stats, live = _run(llm, prompts[:1])
    assert live == 0, "per-request state leaked"
    assert sched_stats.states_taken == 1 and sched_stats.states_partial == 0
    assert len(_state_keys(pool_name)) == 1, "exactly the handed-over boundary state is stored"
    assert stored[0].token_ids == baseline[0].token_ids
    with engine(hybrid, kv_transfer_config=config, **SETTINGS) as llm:
        loaded, load_stats, _, _ = _run(llm, prompts)
    assert [r.num_cached_tokens for r in loaded] == [BOUNDARY, BOUNDARY]
    assert load_stats.chunks_loaded > 0 and load_stats.chunks_load_failed == 0
    assert_same_greedy(baseline, loaded)

    # the loaded states are what the engine computes from: random states change the outputs
    assert _rewrite_states(pool_name, resize=False) == 1
    with engine(hybrid, kv_transfer_config=config, **SETTINGS) as llm:
        poisoned, _, _, _ = _run(llm, prompts)
    assert [r.num_cached_tokens for r in poisoned] == [BOUNDARY, BOUNDARY]
    assert [r.token_ids for r in poisoned] != [r.token_ids for r in baseline], "the loaded state had no effect"

    # a state load that fails (the stored value has the wrong size) recomputes the whole hit: the attention
    # chunks loaded beside it are never computed on, and nothing reaches an output or the pool
    assert _rewrite_states(pool_name, resize=True) == 1
    with engine(hybrid, kv_transfer_config=config, **SETTINGS) as llm:
        failed, fail_stats, _, live = _run(llm, prompts)
    assert fail_stats.chunks_load_failed > 0
    # the first recomputes its whole prompt; the second then hits what the first recomputed (the engine's
    # own cache, or the pool the first saved into again)
    assert [r.num_cached_tokens for r in failed] == [0, BOUNDARY]
    assert [r.token_ids for r in failed] == [r.token_ids for r in baseline]
    assert live == 0


@pytest.mark.timeout(900)
def test_served_hybrid_prompts_come_back_from_the_pool_with_identical_outputs(hybrid):
    """Behind `vllm serve` at TP 1: prompts, others that push them out of the engine's own cache (8
    blocks of 256 KiB in float32), then the first prompts again, whose boundary states and attention
    chunks now come from the pool (loaded by kvpool, not the engine's own cache)."""
    from kvpool.testing.server import openai_server

    first = random_prompts(2, 300, seed=35)
    others = random_prompts(4, 300, seed=36)
    workload = first + others + first
    settings = {
        "block_size": 128,
        "max_model_len": 512,
        "kv_cache_memory_bytes": 2 << 20,
        "extra_args": ["--max-num-batched-tokens", "128", "--enable-prefix-caching"],
    }
    connector = {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"capacity_bytes": "64MiB"},
    }
    # the baseline from an in-process engine of the same settings (a second server costs a minute more)
    with engine(hybrid, dtype="float32", kv_cache_memory_bytes=2 << 20, **{**SETTINGS, "max_model_len": 512}) as llm:
        baseline = generate_greedy(llm, workload, MAX_TOKENS)
    with openai_server(hybrid, kv_transfer_config=connector, **settings) as server:  # type: ignore[arg-type]
        served = [server.complete(prompt, MAX_TOKENS) for prompt in workload]
        metrics = server.metrics()
    assert [r["token_ids"] for r in served] == [list(r.token_ids) for r in baseline]
    assert [r["cached_tokens"] for r in served[-len(first) :]] == [BOUNDARY] * len(first)
    pool = {name: value for name, value in metrics.items() if "kvpool" in name or "prefix_cache" in name}
    assert metrics.get("vllm:external_prefix_cache_hits_total", 0) >= len(first) * BOUNDARY, pool
    assert metrics.get("vllm:kvpool_chunks_loaded_total", 0) >= 2 * len(first), pool


def test_requests_preempted_under_a_tiny_cache_come_back_from_the_pool_with_identical_outputs(hybrid, pool_name):
    """A fresh engine whose KV cache (16 blocks) cannot hold four hybrid requests decoding 300 tokens:
    vLLM preempts some (their blocks, state block included, freed at once) and re-admits them later;
    each admission loads the boundary state and the attention chunk below it from the pool, and every
    output equals a run without kvpool (float32: no near-ties to excuse)."""
    prompts = random_prompts(4, 260, seed=41)  # 260 tokens: a 256-token boundary hit, 4 tokens computed
    tiny = {**SETTINGS, "dtype": "float32", "kv_cache_memory_bytes": 2 << 20, "max_num_seqs": 4}
    config = connector_config(pool_name)
    with engine(hybrid, **tiny) as llm:
        baseline = generate_greedy(llm, prompts, 300)
    with engine(hybrid, kv_transfer_config=config, **{**SETTINGS, "dtype": "float32"}) as llm:
        _run(llm, prompts, max_tokens=4)  # stores each prompt's boundary state and attention chunk
    with engine(hybrid, kv_transfer_config=config, **tiny) as llm:
        served, stats, sched_stats, live = _run(llm, prompts, max_tokens=300)
    assert sched_stats.preemptions >= 1, "the tiny cache preempted nothing: the test lost its point"
    assert [r.num_cached_tokens for r in served] == [BOUNDARY] * len(prompts)
    # a preempted request's re-admission is a pool hit again (the engine freed its own blocks)
    assert sched_stats.loads > len(prompts) and stats.chunks_load_failed == 0
    assert [r.token_ids for r in served] == [r.token_ids for r in baseline]
    assert live == 0
