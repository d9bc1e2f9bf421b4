"""The reset guidance of docs/correctness.md under vLLM's real async scheduling and sync scheduling, in both orders:
a reset while requests run and a pool load is awaited (refused, and retrying is no fix), and a drain
first, then a reset with the connector (accepted, the pool emptied, outputs equal vLLM's own).

How async scheduling runs on the CPU build. vLLM resolves `scheduler_config.async_scheduling` in
`VllmConfig.__post_init__` (an explicit True is checked against the executor: `UniProcExecutor`
supports it), then calls the platform hook; `CpuPlatform.check_and_update_config` sets it back to
False ("not required on CPU"), and everything after reads the field: `get_scheduler_cls` picks
`AsyncScheduler`, `max_concurrent_batches` is 2, so `EngineCore` builds a batch queue and steps with
`step_with_batch_queue`, and the model runner (`CPUModelRunner`, a `GPUModelRunner`) returns an
`AsyncGPUModelRunnerOutput`. `_async_scheduling` keeps the value vLLM resolved across that one hook,
for the engine built inside it; nothing else is changed. `_engine` checks what the engine then runs
(scheduler class, batch queue, step function, the runner's flag) and records the order of
`schedule()` and `update_from_output()`: under async scheduling step N+1 is scheduled before step
N's output is absorbed, under sync never. Outputs equal a run without kvpool in both modes.

The orderings the assertions rely on (vLLM 0.32):

* `Scheduler.reset_prefix_cache(reset_running_requests=True)` preempts every running request first
  (`_preempt_request`, which frees or defers its blocks), then resets the KV cache manager, and
  raises `RuntimeError` if that reset fails (`BlockPool.reset_prefix_cache` fails while any block but
  the null one is held). A request in `WAITING_FOR_REMOTE_KVS` is not running: its blocks stay held.
* A pool hit is such a request from the `schedule()` that allocates its load until the `schedule()`
  after the step whose output reported the load finished (`_update_waiting_for_remote_kv`). kvpool's
  embedded pool loads in the engine's thread within the step, so without async scheduling the load
  is awaited exactly between that step and the next one.
* With async scheduling (or PP) and a KV-consumer connector (kvpool is `kv_both`) vLLM defers freeing
  a request's blocks while a step that scheduled it is still in flight (`Scheduler.defer_block_free`,
  `_free_request_blocks`, `deferred_frees`): they return to the pool only once that step's output is
  absorbed (`update_from_output` advances `processed_step_seq`). `step_with_batch_queue` returns
  after scheduling a step while the queue has room, so between two engine steps a step is in flight
  while requests run: every request the reset preempts keeps its blocks, and the reset is refused
  even when no load is awaited. The same holds for a request that finished (a stop token) while the
  step scheduled after it is in flight: `generate` has returned, but the blocks return only at the
  engine's next step (the async scheduler does not schedule past `max_tokens`, so a request that
  runs to its length leaves nothing behind).
* A server's `pause_generation(mode="wait", clear_cache=True)` (EngineCoreProc.pause_scheduler)
  stops admitting requests (`PAUSED_NEW`), keeps stepping until the engine has no work (no request,
  empty batch queue: `has_work`), then runs `_finish_pause(clear_cache=True)`, i.e.
  `reset_prefix_cache(reset_running_requests=True, reset_connector=True)`. The in-process engine
  refuses mode "wait", so `test_draining_then_resetting_empties_the_pool` runs those same steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from kvpool.backends.shared_pools import shared_memory_pool
from kvpool.integrations.vllm import local_worker
from kvpool.testing.engine import GreedyResult, assert_same_greedy, engine, generate_greedy

from .conftest import BLOCK, connector_config, random_prompts

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16
PROMPT = 300
HIT = PROMPT // BLOCK * BLOCK  # 256: the block-aligned prefix a pool hit loads
RETRIES = 8  # resets tried while requests run, one engine step apart
MAX_STEPS = 500
SCHEDULING = ["async", "sync"]
# every hit a load vLLM awaits (WAITING_FOR_REMOTE_KVS), as with a disk tier, Mooncake or integrity checks:
# the embedded pool's in-step loads off
AWAITED_LOADS = {"load_in_step_bytes": 0}


@contextmanager
def _async_scheduling(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Keep the `async_scheduling` vLLM resolved across the CPU platform's hook (see the module doc)."""
    from vllm.platforms.cpu import CpuPlatform

    hook = CpuPlatform.check_and_update_config  # bound to the class

    def keep_async_scheduling(cls: Any, vllm_config: Any) -> None:
        resolved = vllm_config.scheduler_config.async_scheduling
        hook(vllm_config)
        vllm_config.scheduler_config.async_scheduling = resolved

    with monkeypatch.context() as patch:
        patch.setattr(CpuPlatform, "check_and_update_config", classmethod(keep_async_scheduling))
        yield


class _Order:
    """The order of the engine core's `schedule()` (S, with its token count) and `update_from_output()`
    (U) calls."""

    def __init__(self, scheduler: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int]] = []
        schedule, update = scheduler.schedule, scheduler.update_from_output

        def scheduled(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)
            self.calls.append(("S", output.total_num_scheduled_tokens))
            return output

        def absorbed(scheduler_output: Any, model_output: Any) -> Any:
            self.calls.append(("U", scheduler_output.total_num_scheduled_tokens))
            return update(scheduler_output, model_output)

        monkeypatch.setattr(scheduler, "schedule", scheduled)
        monkeypatch.setattr(scheduler, "update_from_output", absorbed)

    def overlapped(self) -> bool:
        """Was a step scheduled while an earlier step that computed tokens was not absorbed yet?"""
        pending = 0
        for kind, tokens in self.calls:
            if kind == "S":
                if pending:
                    return True
                pending += tokens > 0
            else:
                pending = max(0, pending - (tokens > 0))
        return False


@contextmanager
def _engine(model: Any, scheduling: str, monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> Iterator[Any]:
    """An in-process engine under `scheduling`, checked to run what it claims; yields (llm, core, order)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    asynchronous = scheduling == "async"
    with (
        _async_scheduling(monkeypatch) if asynchronous else _nothing(),
        engine(model, block_size=BLOCK, async_scheduling=asynchronous, **kwargs) as llm,
    ):
        core = llm.llm_engine.engine_core.engine_core  # InprocClient's EngineCore
        runner = core.model_executor.driver_worker.worker.model_runner
        assert core.vllm_config.scheduler_config.async_scheduling is asynchronous
        assert runner.use_async_scheduling is asynchronous
        if asynchronous:
            assert type(core.scheduler) is AsyncScheduler
            assert core.batch_queue is not None and core.batch_queue.maxlen == 2
            assert core.step_fn == core.step_with_batch_queue
        else:
            assert type(core.scheduler) is Scheduler
            assert core.batch_queue is None and core.step_fn == core.step
        with monkeypatch.context() as patch:
            order = _Order(core.scheduler, patch)
            yield llm, core, order
            assert order.overlapped() is asynchronous, order.calls


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _baseline(model: Any, prompts: list[list[int]]) -> list[GreedyResult]:
    """A run without kvpool (the CPU engine's own sync scheduling)."""
    with engine(model, block_size=BLOCK) as llm:
        return generate_greedy(llm, prompts, MAX_TOKENS)


def _settle(llm: Any, core: Any) -> None:
    """Step until the engine has no work: no request, no step in flight (the server's `has_work`)."""
    for _ in range(MAX_STEPS):
        if not core.scheduler.has_requests() and not core.batch_queue:
            return
        llm.llm_engine.step()
    raise AssertionError("the engine did not settle")


def _awaited(core: Any) -> list[str]:
    from vllm.v1.request import RequestStatus

    return [r.request_id for r in core.scheduler.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]


def _result(output: Any) -> GreedyResult:
    completion = output.outputs[0]
    top = [
        sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda e: (-e[1], e[0]))[:2]
        for step in completion.logprobs or ()
    ]
    return GreedyResult(
        token_ids=list(completion.token_ids), num_cached_tokens=int(output.num_cached_tokens or 0), top=top
    )


def _add(llm: Any, name: str, prompt: list[int]) -> None:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, logprobs=2)
    llm.llm_engine.add_request(name, {"prompt_token_ids": prompt}, params)


def _reset_running(llm: Any) -> bool:
    """`reset_prefix_cache(reset_running_requests=True)`: True accepted, False refused (RuntimeError)."""
    try:
        assert llm.reset_prefix_cache(reset_running_requests=True)
    except RuntimeError as refusal:
        assert "waiting for remote KV transfer" in str(refusal)
        return False
    return True


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_a_reset_while_a_load_is_awaited_is_refused_and_retrying_is_no_fix(
    scheduling, model_dir, pool_name, monkeypatch
):
    """Two requests decode, two others wait for their pool loads: `reset_prefix_cache(
    reset_running_requests=True)` raises, after it preempted both running requests, under both
    schedulings. Then one try per engine step while the requests run: each try preempts every running
    request again, and each preempted request comes back as a pool hit of what kvpool saved of it (a
    new awaited load). Without async scheduling a try is refused exactly when a load is awaited, which
    recurs (some tries refused, some accepted); under async scheduling every try is refused, also when
    no load is awaited (the step in flight holds the preempted requests' blocks). Once left alone the
    requests finish with the outputs of a run without kvpool."""
    from vllm.v1.request import RequestStatus

    model = model_dir("llama")
    hits, runs = random_prompts(2, PROMPT, seed=61), random_prompts(2, PROMPT, seed=62)
    baseline = _baseline(model, hits + runs)
    config = connector_config(pool_name, **AWAITED_LOADS)
    with _engine(model, scheduling, monkeypatch, kv_transfer_config=config) as (llm, core, _):
        scheduler = core.scheduler
        generate_greedy(llm, hits, MAX_TOKENS)  # the pool holds the hits' prompts
        _settle(llm, core)
        assert llm.reset_prefix_cache()  # vLLM's own cache only: the hits now come from the pool
        worker = local_worker()
        assert worker is not None
        loaded_before = worker.stats.chunks_loaded

        for i, prompt in enumerate(runs):
            _add(llm, f"run-{i}", prompt)
        for _ in range(MAX_STEPS):  # both decode
            llm.llm_engine.step()
            if len(scheduler.running) == 2 and all(r.num_output_tokens > 0 for r in scheduler.running):
                break
        running = list(scheduler.running)
        assert len(running) == 2
        for i, prompt in enumerate(hits):
            _add(llm, f"hit-{i}", prompt)
        for _ in range(MAX_STEPS):
            llm.llm_engine.step()
            if _awaited(core):
                break
        assert len(_awaited(core)) == 2 and len(scheduler.running) == 2

        with pytest.raises(RuntimeError, match="waiting for remote KV transfer"):
            llm.reset_prefix_cache(reset_running_requests=True)
        assert not scheduler.running, "the refused reset left requests running"
        assert all(r.status == RequestStatus.PREEMPTED and r.num_preemptions == 1 for r in running)

        tries: list[tuple[bool, bool]] = []  # (a load was awaited, accepted)
        deferred_at_refusal_without_load: list[int] = []
        for _ in range(RETRIES):
            llm.llm_engine.step()
            awaited, was_running = bool(_awaited(core)), list(scheduler.running)
            accepted = _reset_running(llm)
            tries.append((awaited, accepted))
            assert not scheduler.running, "a try left requests running"
            assert all(r.status == RequestStatus.PREEMPTED for r in was_running)
            if not accepted and not awaited:
                deferred_at_refusal_without_load.append(len(scheduler.deferred_frees))
        assert worker.stats.chunks_loaded > loaded_before  # the preempted requests came back as pool hits
        if scheduling == "async":
            assert scheduler.defer_block_free
            assert not any(accepted for _, accepted in tries), tries
            assert deferred_at_refusal_without_load and all(deferred_at_refusal_without_load), tries
        else:
            assert not scheduler.defer_block_free
            assert all(accepted is not awaited for awaited, accepted in tries), tries
            assert any(accepted for _, accepted in tries) and not all(accepted for _, accepted in tries), tries

        outputs: dict[str, GreedyResult] = {}
        for _ in range(MAX_STEPS):
            for out in llm.llm_engine.step():
                if out.finished:
                    outputs[out.request_id] = _result(out)
            if len(outputs) == 4:
                break
    names = [f"hit-{i}" for i in range(len(hits))] + [f"run-{i}" for i in range(len(runs))]
    assert_same_greedy(baseline, [outputs[name] for name in names])


@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_draining_then_resetting_empties_the_pool(scheduling, model_dir, pool_name, monkeypatch):
    """Requests load from the pool; instead of resetting under them, the caller lets them finish, then
    resets with the connector. Offline, once `generate` returned: `reset_prefix_cache(
    reset_connector=True)` is accepted at once without async scheduling; under async scheduling, when
    the last request stopped early (a stop token), it is refused (False, kvpool keeps its pool) until
    the engine's next step absorbed the step in flight, then accepted. A server's drain (its
    `pause_generation(mode="wait", clear_cache=True)` steps) is accepted as it is. After each accepted
    reset a lookup misses (nothing cached, nothing loaded), and the pool then serves hits again;
    every output equals a run without kvpool."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.sched.interface import PauseState

    model = model_dir("llama")
    prompts = random_prompts(2, PROMPT, seed=63)
    baseline = [r.token_ids for r in _baseline(model, prompts)]
    # stop tokens that end each prompt early, the second one later (it finishes last)
    stops = [
        next(k for k in range(first, MAX_TOKENS - 2) if ids[k] not in ids[:k]) for first, ids in zip((2, 6), baseline)
    ]
    stopped = [ids[: k + 1] for k, ids in zip(stops, baseline)]

    def generate(stop: bool = False) -> tuple[list[list[int]], list[int], int]:
        worker = local_worker()
        assert worker is not None
        before = worker.stats.chunks_loaded
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                detokenize=False,
                stop_token_ids=[ids[k]] if stop else None,
            )
            for k, ids in zip(stops, baseline)
        ]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        tokens = [list(out.outputs[0].token_ids) for out in outs]
        return tokens, [int(out.num_cached_tokens or 0) for out in outs], worker.stats.chunks_loaded - before

    config = connector_config(pool_name, **AWAITED_LOADS)
    with _engine(model, scheduling, monkeypatch, kv_transfer_config=config) as (llm, core, _):
        scheduler = core.scheduler
        assert generate() == (baseline, [0, 0], 0)  # saves both prompts
        _settle(llm, core)
        assert llm.reset_prefix_cache()  # vLLM's own cache only

        # offline: loads awaited, the requests stop early; generate returns; then the reset
        assert generate(stop=True)[:2] == (stopped, [HIT, HIT])
        if scheduling == "async":
            assert scheduler.deferred_frees, "the last request's blocks were not held by the step in flight"
            assert llm.reset_prefix_cache(reset_connector=True) is False
            assert _awaited(core) == [] and not scheduler.running
            assert len(shared_memory_pool(pool_name, 256 << 20).keys()) == 2 * (PROMPT // BLOCK), "pool not kept"
            llm.llm_engine.step()  # absorbs the step in flight
        assert llm.reset_prefix_cache(reset_connector=True)
        assert generate() == (baseline, [0, 0], 0), "a lookup hit after the reset"
        _settle(llm, core)
        assert llm.reset_prefix_cache()
        tokens, cached, loaded = generate()
        assert (tokens, cached) == (baseline, [HIT, HIT]) and loaded > 0, "the pool serves no hits after the reset"
        # requests that ran to max_tokens: nothing of theirs is in flight once generate returned
        assert llm.reset_prefix_cache(reset_connector=True)
        assert generate() == (baseline, [0, 0], 0), "a lookup hit after the reset"

        # a server's drain: loads armed, admissions paused, step until no work, then the reset it runs
        _settle(llm, core)
        assert llm.reset_prefix_cache()
        for i, prompt in enumerate(prompts):
            _add(llm, f"drained-{i}", prompt)
        for _ in range(MAX_STEPS):
            llm.llm_engine.step()
            if _awaited(core):
                break
        assert len(_awaited(core)) == 2
        scheduler.set_pause_state(PauseState.PAUSED_NEW)
        outputs: dict[str, list[int]] = {}
        for _ in range(MAX_STEPS):
            if not scheduler.has_requests() and not core.batch_queue:
                break
            for out in llm.llm_engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
        core._finish_pause(clear_cache=True)  # raises if the reset is refused
        scheduler.set_pause_state(PauseState.UNPAUSED)
        assert [outputs[f"drained-{i}"] for i in range(len(prompts))] == baseline
        assert generate() == (baseline, [0, 0], 0), "a lookup hit after the server's reset"
        _settle(llm, core)
        assert llm.reset_prefix_cache()
        tokens, cached, loaded = generate()
        assert (tokens, cached) == (baseline, [HIT, HIT]) and loaded > 0
