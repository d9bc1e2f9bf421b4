"""The connector on a real vLLM CPU engine with tiny random models (no download)."""

from __future__ import annotations

import pytest

from kvpool.backends.shared_pools import shared_memory_pool
from kvpool.integrations.vllm import local_scheduler, local_worker
from kvpool.testing.engine import assert_same_greedy, engine, generate_greedy

from .conftest import BLOCK, connector_config, damage_pool, poison_pool, random_prompts

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16


def _metric(name: str) -> float:
    """The sum of a sample over this process's Prometheus registry, as `/metrics` serves it."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(REGISTRY).decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _generate_with_stats(llm, prompts, max_tokens=MAX_TOKENS):
    results = generate_greedy(llm, prompts, max_tokens)
    worker, scheduler = local_worker(), local_scheduler()
    assert worker is not None and scheduler is not None
    assert worker.drain(30.0), "saves did not finish"
    # the worker hears about finished requests on the next engine step; run idle steps to deliver them
    for _ in range(3):
        llm.llm_engine.step()
        assert worker.drain(30.0)
    return results, worker.stats, scheduler.stats, worker.active_requests(), scheduler.active_requests()


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_fresh_engine_loads_what_another_saved(kind, model_dir, pool_name):
    model = model_dir(kind)
    config = connector_config(pool_name, integrity="off")  # the poison below must reach the engine
    prompts = random_prompts(2, 300, seed=1)
    with engine(model, block_size=BLOCK) as llm:
        baseline = generate_greedy(llm, prompts, MAX_TOKENS)
    with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
        saved, save_stats, _, live_workers, live_scheduler = _generate_with_stats(llm, prompts)
    assert save_stats.chunks_put > 0
    assert (live_workers, live_scheduler) == (0, 0), "per-request state leaked"
    assert_same_greedy(baseline, saved)
    with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
        loaded, load_stats, _, _, _ = _generate_with_stats(llm, prompts)
    assert [r.num_cached_tokens for r in loaded] == [256, 256]
    assert load_stats.chunks_loaded > 0 and load_stats.chunks_load_failed == 0
    assert [r.token_ids for r in loaded] == [r.token_ids for r in baseline]

    assert poison_pool(pool_name) > 0
    with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
        poisoned, poison_stats, _, _, _ = _generate_with_stats(llm, prompts)
    assert poison_stats.chunks_loaded > 0
    assert [r.token_ids for r in poisoned] != [r.token_ids for r in baseline], "loaded KV had no effect"


@pytest.mark.parametrize("integrity", ["off", "sampled", "full"])
def test_a_damaged_chunk_fails_its_seal_and_is_recomputed(integrity, model_dir, pool_name):
    """The same damage (half of each chunk's pages inverted) changes the outputs of an engine that reads
    it unchecked; with seals, every damaged chunk is caught, counted, recomputed and dropped."""
    model = model_dir("llama")
    prompts = random_prompts(2, 300, seed=12)
    config = connector_config(pool_name, integrity=integrity)
    with engine(model, block_size=BLOCK) as llm:
        baseline = generate_greedy(llm, prompts, MAX_TOKENS)
    with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
        _generate_with_stats(llm, prompts)
    damaged = damage_pool(pool_name)
    assert damaged == 2 * (256 // BLOCK)
    with engine(model, block_size=BLOCK, kv_transfer_config=config, disable_log_stats=False) as llm:
        loaded, stats, _, _, _ = _generate_with_stats(llm, prompts)
        counted = _metric("vllm:kvpool_chunks_corrupt_total")
    if integrity == "off":
        assert stats.chunks_loaded == damaged and stats.chunks_corrupt == 0
        assert [r.token_ids for r in loaded] != [r.token_ids for r in baseline], "the damage had no effect"
        return
    assert stats.chunks_corrupt > 0 and stats.chunks_loaded == 0
    assert counted == stats.chunks_corrupt
    assert [r.token_ids for r in loaded] == [r.token_ids for r in baseline]
    pool = shared_memory_pool(pool_name, 256 << 20)
    assert len(pool.keys()) == damaged, "the recomputed chunks were stored again"
    with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
        again, again_stats, _, _, _ = _generate_with_stats(llm, prompts)
    assert again_stats.chunks_loaded == damaged and again_stats.chunks_corrupt == 0
    assert [r.token_ids for r in again] == [r.token_ids for r in baseline]


@pytest.mark.parametrize(
    ("retention", "window_chunks", "shared_hit"),
    [
        ("engine", 1, 0),  # vLLM's own policy for this model (0): only the replay boundary's window tail
        (None, 9, 256),  # every boundary reachable: every window tail stored, shorter shared prefixes hit
    ],
)
def test_hybrid_model_stores_only_reachable_window_chunks(retention, window_chunks, shared_hit, model_dir, pool_name):
    model = model_dir("gemma3")
    stored = random_prompts(1, 600, seed=2)[0]
    shares_256 = stored[:256] + random_prompts(1, 344, seed=3)[0]
    with engine(model, block_size=BLOCK) as llm:
        baseline = generate_greedy(llm, [stored, shares_256], MAX_TOKENS)
    config = connector_config(pool_name, retention_interval=retention)
    # prefill in 128-token steps: vLLM frees (and reuses) window blocks as the prompt advances
    with engine(model, block_size=BLOCK, max_num_batched_tokens=128, kv_transfer_config=config) as llm:
        _, stats, _, _, _ = _generate_with_stats(llm, [stored])
    assert stats.chunks_put == 9 + window_chunks  # 9 full-attention chunks + the reachable window chunks
    with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
        loaded, load_stats, _, _, _ = _generate_with_stats(llm, [stored, shares_256])
    assert [r.num_cached_tokens for r in loaded] == [576, shared_hit]
    assert load_stats.chunks_load_failed == 0
    assert [r.token_ids for r in loaded] == [r.token_ids for r in baseline]


def test_chunked_prefill_saves_every_full_prompt_block(model_dir, pool_name):
    model = model_dir("llama")
    prompts = random_prompts(3, 500, seed=3)
    chunked = {"max_num_batched_tokens": 48, "block_size": BLOCK}
    with engine(model, **chunked) as llm:
        baseline = generate_greedy(llm, prompts, MAX_TOKENS)
    with engine(model, kv_transfer_config=connector_config(pool_name), **chunked) as llm:
        saved, stats, _, _, _ = _generate_with_stats(llm, prompts)
    assert stats.chunks_put == 3 * (448 // BLOCK)  # each chunk of the prompt saved once, incl. the last full one
    assert stats.chunks_examined == stats.chunks_put
    assert_same_greedy(baseline, saved)
    with engine(model, block_size=BLOCK, kv_transfer_config=connector_config(pool_name)) as llm:
        loaded, _, _, _, _ = _generate_with_stats(llm, prompts)
    assert [r.num_cached_tokens for r in loaded] == [448] * 3
    assert_same_greedy(baseline, loaded)


def test_preemption_under_a_tiny_kv_cache(model_dir, pool_name):
    model = model_dir("llama")
    prompts = random_prompts(8, 200, seed=4)
    tight = {"block_size": BLOCK, "kv_cache_memory_bytes": 3 << 20, "max_model_len": 512}
    with engine(model, **tight) as llm:
        baseline = generate_greedy(llm, prompts, 64)
    with engine(model, kv_transfer_config=connector_config(pool_name), **tight) as llm:
        first, _, sched_stats, live_workers, live_scheduler = _generate_with_stats(llm, prompts, 64)
    assert sched_stats.preemptions > 0, "the cache was not small enough to preempt"
    assert (live_workers, live_scheduler) == (0, 0)
    assert_same_greedy(baseline, first)
    with engine(model, kv_transfer_config=connector_config(pool_name), **tight) as llm:
        second, stats, _, _, _ = _generate_with_stats(llm, prompts, 64)
    assert stats.chunks_loaded > 0
    assert_same_greedy(baseline, second)


def test_prompt_shapes(model_dir, pool_name):
    model = model_dir("llama")
    base = random_prompts(1, 256, seed=5)[0]
    shared_half = base[:128] + random_prompts(1, 172, seed=6)[0]
    short = random_prompts(1, 40, seed=7)[0]
    prompts = [base, shared_half, short]
    with engine(model, block_size=BLOCK) as llm:
        baseline = generate_greedy(llm, prompts, MAX_TOKENS)
    with engine(model, block_size=BLOCK, kv_transfer_config=connector_config(pool_name)) as llm:
        first = generate_greedy(llm, [base], MAX_TOKENS)
    with engine(model, block_size=BLOCK, kv_transfer_config=connector_config(pool_name)) as llm:
        again, stats, _, _, _ = _generate_with_stats(llm, prompts)
    # whole 256-token prompt stored: the hit is lowered so one token is recomputed (192, block aligned);
    # the second prompt shares two blocks; the short prompt has no full block
    assert [r.num_cached_tokens for r in again] == [192, 128, 0]
    assert first[0].token_ids == baseline[0].token_ids
    assert [r.token_ids for r in again] == [r.token_ids for r in baseline]
    assert stats.chunks_load_failed == 0


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_failed_loads_are_recomputed(kind, model_dir, pool_name):
    model = model_dir(kind)
    prompts = random_prompts(2, 300, seed=8)
    with engine(model, block_size=BLOCK) as llm:
        baseline = generate_greedy(llm, prompts, MAX_TOKENS)
    with engine(model, block_size=BLOCK, kv_transfer_config=connector_config(pool_name)) as llm:
        generate_greedy(llm, prompts, MAX_TOKENS)
    poison_pool(pool_name, resize=True)  # every chunk now has the wrong size: each load fails
    with engine(model, block_size=BLOCK, kv_transfer_config=connector_config(pool_name)) as llm:
        loaded, stats, _, _, _ = _generate_with_stats(llm, prompts)
    assert stats.chunks_load_failed > 0 and stats.chunks_loaded == 0
    assert [r.token_ids for r in loaded] == [r.token_ids for r in baseline]


def test_multiprocess_engine_round_trip(model_dir, pool_name):
    model = model_dir("llama")
    prompts = random_prompts(2, 300, seed=9)
    with engine(model, block_size=BLOCK, multiprocess=True, kv_transfer_config=connector_config(pool_name)) as llm:
        first = generate_greedy(llm, prompts, MAX_TOKENS)
        assert llm.reset_prefix_cache()  # only the pool (in the worker process) still has the prefix
        second = generate_greedy(llm, prompts, MAX_TOKENS)
        assert llm.reset_prefix_cache(reset_connector=True)  # the worker empties its pool at its next step
        third = generate_greedy(llm, prompts, MAX_TOKENS)
    assert [r.num_cached_tokens for r in first] == [0, 0]
    assert [r.num_cached_tokens for r in second] == [256, 256]
    assert [r.num_cached_tokens for r in third] == [0, 0]
    assert [r.token_ids for r in second] == [r.token_ids for r in first] == [r.token_ids for r in third]


def test_reset_prefix_cache_with_the_connector_empties_the_pool(model_dir, pool_name):
    prompts = random_prompts(1, 300, seed=10)
    with engine(model_dir("llama"), block_size=BLOCK, kv_transfer_config=connector_config(pool_name)) as llm:
        _generate_with_stats(llm, prompts)  # also steps until finished requests release their blocks
        assert llm.reset_prefix_cache()
        again, _, _, _, _ = _generate_with_stats(llm, prompts)
        assert again[0].num_cached_tokens == 256  # from the pool
        assert llm.reset_prefix_cache(reset_connector=True)
        assert generate_greedy(llm, prompts, MAX_TOKENS)[0].num_cached_tokens == 0


def test_a_chunk_lost_between_lookup_and_load_never_leaves_a_window_unfilled(model_dir, pool_name, monkeypatch):
    """All-sliding-window model (one group; vLLM frees blocks below the window): a hit of 256 tokens at
    block 32, window 64, loads only chunks 6 and 7; the others are null blocks. If chunk 7 vanishes
    before the load, resuming at token 224 would attend to null block 5: kvpool must have vLLM
    recompute the whole request instead."""
    from kvpool.backends.shared_pools import shared_memory_pool

    model = model_dir("mistral")
    prompts = random_prompts(2, 300, seed=11)
    block = {"block_size": 32}
    with engine(model, **block) as llm:
        baseline = generate_greedy(llm, prompts, MAX_TOKENS)
    # the hit contract off (no in-step loads, nothing held for acknowledgement): a chunk can be lost between
    # lookup and load, as it can on Mooncake or the disk tier
    config = connector_config(pool_name, load_in_step_bytes=0)
    with engine(model, kv_transfer_config=config, **block) as llm:
        _, save_stats, _, _, _ = _generate_with_stats(llm, prompts)
    assert save_stats.chunks_put > 0
    pool = shared_memory_pool(pool_name, 256 << 20)
    get_into = pool.get_into
    lost: list[str] = []

    def lose_the_last_chunk(keys, dests):
        lost.append(keys[-1])
        pool.remove([keys[-1]])  # evicted after the lookup found it
        return get_into(keys, dests)

    monkeypatch.setattr(pool, "get_into", lose_the_last_chunk)
    with engine(model, kv_transfer_config=config, **block) as llm:
        loaded, stats, _, _, _ = _generate_with_stats(llm, prompts)
    assert len(lost) == 2 and stats.chunks_load_failed == 2
    assert stats.chunks_loaded == 2  # chunk 6 of each prompt did arrive
    assert [r.num_cached_tokens for r in loaded] == [0, 0]  # recomputed from the start
    assert_same_greedy(baseline, loaded)


def test_a_chunk_lost_from_one_load_never_reaches_a_request_sharing_its_prefix(model_dir, pool_name, monkeypatch):
    """Issue 21, route 2: two prompts share a 128-token prefix and arrive in one `generate` call; the
    pool holds the first prompt's 256 tokens and loses chunk 1 of its load. Had that load run in the
    step (vLLM's sync load), vLLM would cache its blocks at allocation, the second prompt would take a
    local hit on them in the same schedule() pass, compute its chunks 2 and 3 on the unwritten block,
    and kvpool would store them. Every load is async, so vLLM caches a loaded block only once the load
    is reported, and only the prefix that loaded: both outputs, and a later engine's load of the second
    prompt (its chunks 2 and 3 come from the pool), equal a run without kvpool."""
    model = model_dir("llama")
    shared = random_prompts(1, 2 * BLOCK, seed=21)[0]
    first, second = (shared + tail for tail in random_prompts(2, 300 - 2 * BLOCK, seed=22))
    with engine(model, block_size=BLOCK) as llm:
        baseline = generate_greedy(llm, [first, second], MAX_TOKENS)
    # the hit contract off: the async path, where a chunk can be lost between lookup and load (Mooncake,
    # the disk tier); with it on the same loss cannot happen (test_vllm_in_step.py)
    config = connector_config(pool_name, load_in_step_bytes=0)
    with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
        _generate_with_stats(llm, [first])  # the pool holds the first prompt's chunks 0-3
    pool = shared_memory_pool(pool_name, 256 << 20)
    get_into = pool.get_into
    lost: list[str] = []

    def lose_one_chunk_of_the_first_load(keys, dests):
        if not lost:
            lost.append(keys[1])
            pool.remove([keys[1]])  # evicted after the lookup found it
        return get_into(keys, dests)

    monkeypatch.setattr(pool, "get_into", lose_one_chunk_of_the_first_load)
    with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
        both, stats, _, live_workers, live_scheduler = _generate_with_stats(llm, [first, second])
    monkeypatch.undo()
    assert lost and stats.chunks_load_failed >= 1 and stats.chunks_loaded > 0
    assert (live_workers, live_scheduler) == (0, 0), "per-request state leaked"
    assert_same_greedy(baseline, both)
    assert pool.exists(lost) == [True], "the recompute stored the lost chunk again"
    with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
        again, later, _, _, _ = _generate_with_stats(llm, [second])
    assert again[0].num_cached_tokens == 4 * BLOCK and later.chunks_load_failed == 0
    assert_same_greedy([baseline[1]], again)


def test_reset_with_running_requests_while_a_load_is_awaited(model_dir, pool_name):
    """vLLM's `reset_prefix_cache(reset_running_requests=True)` raises while a request waiting for its KV
    load holds blocks (vLLM 0.32: "not supported yet"). Every pool hit is such a load for one engine
    step, between the step that loads it and the next `schedule()`: a reset landing there is refused
    loudly and the engine keeps serving, outputs unchanged. Retrying while requests run is no fix
    (each preempted request comes back as a new load); once the requests finished (drained), the
    same reset succeeds. Retries, async scheduling and the drain: `test_vllm_async_resets.py`."""
    from vllm import SamplingParams

    prompts = random_prompts(2, 300, seed=23)
    config = connector_config(pool_name, load_in_step_bytes=0)  # every hit an awaited load (no in-step hits)
    with engine(model_dir("llama"), block_size=BLOCK, kv_transfer_config=config) as llm:
        baseline, _, _, _, _ = _generate_with_stats(llm, prompts)
        assert llm.reset_prefix_cache()  # only the pool has the prefixes now
        core = llm.llm_engine
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        for i, prompt in enumerate(prompts):
            core.add_request(f"awaited-{i}", {"prompt_token_ids": prompt}, params)
        core.step()  # allocates both loads and runs them; the requests wait for the next schedule()
        with pytest.raises(RuntimeError, match="waiting for remote KV"):
            llm.reset_prefix_cache(reset_running_requests=True)
        outputs: dict[str, list[int]] = {}
        for _ in range(200):
            for out in core.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            if len(outputs) == len(prompts):
                break
        assert llm.reset_prefix_cache(reset_running_requests=True)
    assert [outputs[f"awaited-{i}"] for i in range(len(prompts))] == [r.token_ids for r in baseline]


@pytest.mark.parametrize("retention", ["engine", None])
def test_explain_says_what_the_engine_then_loads_on_a_hybrid_model(retention, model_dir, pool_name):
    """On a hybrid model (full + sliding window), the explanation of each prompt, taken on the engine that
    then runs it, names the hit the engine loads (local cache emptied first: every cached token is a
    pool hit) and the chunks it loads."""
    from kvpool.integrations.vllm.explain import explain_prompt
    from kvpool.scheduler.explain import StopReason

    model = model_dir("gemma3")
    first, other = random_prompts(2, 300, seed=13)
    prompts = {"same": first, "diverges": first[:200] + other[200:], "short": first[:100]}
    config = connector_config(pool_name, retention_interval=retention)
    with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
        _generate_with_stats(llm, [first])
    seen = {}
    with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
        worker = local_worker()
        assert worker is not None
        for name, prompt in prompts.items():
            assert llm.reset_prefix_cache()
            explanation = explain_prompt(llm, prompt)
            loaded_before = worker.stats.chunks_loaded
            (result,) = generate_greedy(llm, [prompt], MAX_TOKENS)
            assert worker.drain(30.0)
            loads = worker.stats.chunks_loaded - loaded_before
            assert result.num_cached_tokens == explanation.hit_tokens, (name, explanation)
            assert loads == sum(len(group.loads) for group in explanation.groups), (name, explanation)
            seen[name] = (explanation.hit_tokens, explanation.reason)
    # same prompt: the 44 tokens after the 4th block never fill one; the others stop on what the pool lacks
    expected = {
        "engine": {  # vLLM's policy for this model: window tails only at the saved prompt's replay boundary
            "same": (256, StopReason.PARTIAL_BLOCK),
            "diverges": (0, StopReason.MASK),  # a hit at 64 needs a window chunk no save of it keeps
            "short": (0, StopReason.MISSING_CHUNK),  # its own replay boundary needs one the 300-token save did not keep
        },
        None: {  # every boundary reachable: every window chunk stored
            "same": (256, StopReason.PARTIAL_BLOCK),
            "diverges": (192, StopReason.MISSING_CHUNK),  # full attention's chunk 3 holds the divergence
            "short": (64, StopReason.PARTIAL_BLOCK),
        },
    }
    assert seen == expected[retention]


def test_inspect_explain_on_the_command_line(model_dir, pool_name, tmp_path):
    import json

    from typer.testing import CliRunner

    from kvpool.ops.cli import app

    model = model_dir("llama")
    (prompt,) = random_prompts(1, 300, seed=14)
    with engine(model, block_size=BLOCK, kv_transfer_config=connector_config(pool_name)) as llm:
        _generate_with_stats(llm, [prompt])
    path = tmp_path / "prompt.txt"
    path.write_text(" ".join(map(str, prompt)))
    config = json.dumps(connector_config(pool_name)["kv_connector_extra_config"])
    args = ["inspect", "explain", str(model), "--prompt", str(path), "--config", config, "--block-size", str(BLOCK)]
    outcome = CliRunner().invoke(app, [*args, "--json"])
    assert outcome.exit_code == 0, outcome.output
    explanation = json.loads(outcome.output[outcome.output.index("{") :])
    assert (explanation["hit_tokens"], explanation["reason"]) == (256, "partial_block")
    assert explanation["groups"][0]["present"] == [True] * 4
    bad = CliRunner().invoke(app, [*args[:5], "--config", '{"capacity_bytes": "lots"}'])
    assert bad.exit_code == 2 and "capacity_bytes" in bad.output
    assert CliRunner().invoke(app, [*args[:3], "--prompt", str(tmp_path / "none.txt")]).exit_code == 2
