"""The hit contract on a real vLLM CPU engine: a pool hit the embedded DRAM pool guarantees loads in the
step that schedules it, so it reaches its first token in as many engine steps as the engine's own
prefix-cache hit, with outputs equal to a run without kvpool; a hit over the step's budget waits a step."""

from __future__ import annotations

import pytest

from kvpool.integrations.vllm import local_scheduler, local_worker
from kvpool.testing.engine import engine, generate_greedy

from .conftest import BLOCK, connector_config, random_prompts

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8


def _first_token_steps(kind: str) -> tuple[int, int]:
    """(steps summed, requests) to first token for one kind of hit, from the scheduler's counters."""
    scheduler = local_scheduler()
    assert scheduler is not None
    stats = scheduler.stats
    return getattr(stats, f"first_token_steps_{kind}"), getattr(stats, f"first_tokens_{kind}")


def _run(llm, prompts):
    results = generate_greedy(llm, prompts, MAX_TOKENS)
    worker = local_worker()
    assert worker is not None and worker.drain(30.0)
    for _ in range(3):  # the worker hears of finished requests at the next step
        llm.llm_engine.step()
    return results


def test_a_contract_hit_takes_the_steps_of_a_local_hit_and_an_async_one_a_step_more(model_dir, pool_name):
    model = model_dir("llama")
    prompts = random_prompts(3, 300, seed=41)
    with engine(model, block_size=BLOCK) as llm:
        baseline = [r.token_ids for r in generate_greedy(llm, prompts, MAX_TOKENS)]
    with engine(model, block_size=BLOCK, kv_transfer_config=connector_config(pool_name)) as llm:
        assert [r.token_ids for r in _run(llm, prompts)] == baseline  # misses: stored
        # the engine's own hits (its prefix cache still holds the prompts)
        local = [r.token_ids for r in _run(llm, prompts)]
        steps_local, local_requests = _first_token_steps("local")
        assert llm.reset_prefix_cache()  # now only the pool has them: contract hits
        loaded = _run(llm, prompts)
        steps_in_step, in_step_requests = _first_token_steps("in_step")
        worker = local_worker()
        assert worker is not None
        in_step_loads, broken = worker.stats.loads_in_step, worker.stats.in_step_load_failures
    assert local == baseline and [r.token_ids for r in loaded] == baseline
    assert [r.num_cached_tokens for r in loaded] == [256] * 3
    assert in_step_loads == 3 and broken == 0
    assert (local_requests, in_step_requests) == (3, 3)
    assert steps_in_step == steps_local == 3, "a contract hit reaches its first token in a local hit's steps"

    # the same hits over the step's budget (0: every hit waits a step, as vLLM's Mooncake connector's)
    with engine(model, block_size=BLOCK, kv_transfer_config=connector_config(pool_name, load_in_step_bytes=0)) as llm:
        assert [r.token_ids for r in _run(llm, prompts)] == baseline
        steps_async, async_requests = _first_token_steps("async")
    assert async_requests == 3 and steps_async == 2 * 3, "an async hit waits one engine step"


def test_a_hit_over_the_step_budget_is_loaded_async_with_the_same_outputs(model_dir, pool_name):
    model = model_dir("llama")
    prompts = random_prompts(2, 300, seed=42)
    # a budget below one prompt's hit (256 tokens of the tiny model): the first hit of a step fits whole or
    # not at all, so both wait a step
    config = connector_config(pool_name, load_in_step_bytes=1024)
    with engine(model, block_size=BLOCK) as llm:
        baseline = [r.token_ids for r in generate_greedy(llm, prompts, MAX_TOKENS)]
    with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
        _run(llm, prompts)
        assert llm.reset_prefix_cache()
        loaded = _run(llm, prompts)
        worker = local_worker()
        assert worker is not None
        assert worker.stats.loads_in_step == 0 and worker.stats.chunks_loaded > 0
        assert _first_token_steps("async")[1] == 2
    assert [r.token_ids for r in loaded] == baseline


def test_a_chunk_evicted_between_lookup_and_in_step_load_still_loads(model_dir, pool_name, monkeypatch):
    """Issue 21's route 2 under the contract: two prompts sharing a prefix arrive in one `generate`; the
    pool evicts a chunk of the first one's hit after the lookup offered it. The in-step load still reads
    it (withdrawn, held until the scheduler acknowledged the withdrawal), vLLM caches the loaded blocks at
    allocation and the second prompt takes a local hit on them in the same pass: every output equals a
    run without kvpool, and nothing failed. (Without the contract the same loss is tested on the async
    path: test_vllm.py::test_a_chunk_lost_from_one_load_never_reaches_a_request_sharing_its_prefix.)"""
    from kvpool.backends.shared_pools import shared_memory_pool

    from .conftest import BLOCK as block

    model = model_dir("llama")
    shared = random_prompts(1, 2 * block, seed=21)[0]
    first, second = (shared + tail for tail in random_prompts(2, 300 - 2 * block, seed=22))
    with engine(model, block_size=block) as llm:
        baseline = [r.token_ids for r in generate_greedy(llm, [first, second], MAX_TOKENS)]
    config = connector_config(pool_name)
    with engine(model, block_size=block, kv_transfer_config=config) as llm:
        _run(llm, [first])
    pool = shared_memory_pool(pool_name, 256 << 20)
    get_into = pool.get_into
    evicted: list[str] = []

    def evict_one_chunk_of_the_first_load(keys, dests):
        if not evicted:
            evicted.append(keys[1])
            pool.remove([keys[1]])  # gone from the pool after the lookup found it
        return get_into(keys, dests)

    monkeypatch.setattr(pool, "get_into", evict_one_chunk_of_the_first_load)
    with engine(model, block_size=block, kv_transfer_config=config) as llm:
        both = _run(llm, [first, second])
        worker = local_worker()
        assert worker is not None
        stats = worker.stats
        assert stats.loads_in_step >= 1 and stats.chunks_load_failed == 0 and stats.in_step_load_failures == 0
        assert pool.retired_bytes == 0, "acknowledged and freed a step or two later"
    assert evicted and [r.token_ids for r in both] == baseline
