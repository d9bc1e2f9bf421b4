"""Connector-neutral timers on a live in-process vLLM engine, for `kvpool bench breakdown`.

`Probe(llm)` replaces bound methods on the live objects (the scheduler, both roles of the connector,
the engine's `step` and `add_request`) with timing wrappers; `close()` puts the originals back. What
it records depends only on vLLM's connector interface, so kvpool and vLLM's own Mooncake connector
are measured by the same code:

* a step is one `Scheduler.schedule()` call (in-process, no async scheduling: one `LLMEngine.step()`);
* per request (`Record`): the step and `perf_counter_ns` stamp it was added, each lookup answer
  (`get_num_new_matched_tokens`: None = "ask again", counted per step), the lookup calls' own time on
  the scheduler thread, the step its load was allocated (`update_state_after_alloc` with external
  tokens), the step `finished_recving` named it (`update_connector_output`), the step it was first
  scheduled to compute, the step its first token came out, and what it got (tokens, cached tokens);
* per phase and hook: the hook's own time (ns) and calls, on the thread that called it; a hook called
  from inside another wrapped hook of the same thread is counted in the outer one only.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "take_events",
    "get_kv_connector_stats",
)
WORKER_HOOKS = (
    "handle_preemptions",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
    "clear_connector_metadata",
)
# the engine thread's save path: where a put on the critical path would show
SAVE_HOOKS = ("start_load_kv", "save_kv_layer", "wait_for_save")


@dataclass
class Record:
    """One request, as the engine saw it."""

    name: str  # the caller's request id
    phase: str
    arrived_step: int
    arrived_ns: int
    lookup_calls: int = 0
    lookup_ns: int = 0  # the lookup calls' own time on the scheduler thread
    ask_again_steps: set[int] = field(default_factory=set)
    lookup_done_step: int | None = None
    lookup_done_ns: int | None = None
    hit_tokens: int = 0  # what the first real answer offered
    alloc_step: int | None = None
    alloc_ns: int | None = None
    load_tokens: int = 0
    recv_step: int | None = None
    recv_ns: int | None = None
    sched_step: int | None = None
    sched_ns: int | None = None
    token_step: int | None = None
    token_ns: int | None = None
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per output token, the top 2 (logits)
    finished: bool = False


class Probe:
    """Timers on one live in-process engine; `phase` labels what is recorded from now on."""

    def __init__(self, llm: Any) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.llm = llm
        engine = llm.llm_engine
        self.scheduler = engine.engine_core.engine_core.scheduler
        self.phase = ""
        self.step = 0
        self.records: dict[str, Record] = {}  # by the engine's internal id and by the caller's
        self.requests: list[Record] = []
        self.hook_ns: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        self.steps: dict[str, int] = defaultdict(int)
        self.step_ns: dict[str, int] = defaultdict(int)
        self._local = threading.local()
        self._undo: list[tuple[Any, str]] = []
        connector = self.scheduler.connector
        for name in SCHEDULER_HOOKS:
            self._wrap(connector, name, "scheduler")
        worker = get_kv_transfer_group()
        for name in WORKER_HOOKS:
            self._wrap(worker, name, "worker")
        self._patch(self.scheduler, "schedule", self._schedule)
        self._patch(engine, "step", self._engine_step)
        self._patch(engine, "add_request", self._add_request)

    # ---- patching -----------------------------------------------------------------------------

    def _patch(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._undo.append((owner, name))

    def _wrap(self, owner: Any, name: str, side: str) -> None:
        if not callable(getattr(owner, name, None)):
            return
        after = getattr(self, f"_after_{name}", None)
        key = f"{side}.{'request_finished' if name.startswith('request_finished') else name}"

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def timed(*args: Any, **kwargs: Any) -> Any:
                depth = getattr(self._local, "depth", 0)
                self._local.depth = depth + 1
                began = time.perf_counter_ns()
                try:
                    result = original(*args, **kwargs)
                finally:
                    spent = time.perf_counter_ns() - began
                    self._local.depth = depth
                if depth == 0:
                    cell = self.hook_ns[self.phase][key]
                    cell[0] += spent
                    cell[1] += 1
                    if after is not None:
                        after(args, kwargs, result, began, spent)
                return result

            return timed

        self._patch(owner, name, make)

    def close(self) -> None:
        """Put every original method back (instance attributes removed: the class's methods show)."""
        for owner, name in reversed(self._undo):
            with contextlib.suppress(AttributeError):  # already gone
                delattr(owner, name)
        self._undo.clear()

    # ---- engine and scheduler -----------------------------------------------------------------

    def _add_request(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def add_request(request_id: str, *args: Any, **kwargs: Any) -> Any:
            record = Record(request_id, self.phase, self.step + 1, time.perf_counter_ns())
            internal = original(request_id, *args, **kwargs)  # vLLM appends a suffix to the id
            self.records[internal] = self.records[request_id] = record
            self.requests.append(record)
            return internal

        return add_request

    def _schedule(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def schedule(*args: Any, **kwargs: Any) -> Any:
            self.step += 1
            self.steps[self.phase] += 1
            output = original(*args, **kwargs)
            now = time.perf_counter_ns()
            for req_id in output.num_scheduled_tokens:
                record = self.records.get(req_id)
                if record is not None and record.sched_step is None:
                    record.sched_step, record.sched_ns = self.step, now
            return output

        return schedule

    def _engine_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def step() -> Any:
            began = time.perf_counter_ns()
            outputs = original()
            now = time.perf_counter_ns()
            self.step_ns[self.phase] += now - began
            for output in outputs:
                record = self.records.get(output.request_id)
                if record is None:
                    continue
                completion = output.outputs[0]
                if completion.token_ids and record.token_step is None:
                    record.token_step, record.token_ns = self.step, now
                if output.finished:
                    record.finished = True
                    record.token_ids = list(completion.token_ids)
                    record.cached_tokens = int(output.num_cached_tokens or 0)
                    record.top = [_top2(step) for step in completion.logprobs or ()]
            return outputs

        return step

    # ---- connector hooks with per-request meaning ---------------------------------------------

    def _after_get_num_new_matched_tokens(self, args: tuple[Any, ...], kwargs: Any, result: Any, began: int,
                                          spent: int) -> None:  # fmt: skip
        record = self.records.get(args[0].request_id)
        if record is None:
            return
        record.lookup_calls += 1
        record.lookup_ns += spent
        if result[0] is None:
            record.ask_again_steps.add(self.step)
        elif record.lookup_done_step is None:
            record.lookup_done_step, record.lookup_done_ns = self.step, began + spent
            record.hit_tokens = int(result[0])

    def _after_update_state_after_alloc(self, args: tuple[Any, ...], kwargs: Any, result: Any, began: int,
                                        spent: int) -> None:  # fmt: skip
        record = self.records.get(args[0].request_id)
        external = args[2] if len(args) > 2 else kwargs.get("num_external_tokens", 0)
        if record is not None and external > 0 and record.alloc_step is None:
            record.alloc_step, record.alloc_ns, record.load_tokens = self.step, began, int(external)

    def _after_update_connector_output(self, args: tuple[Any, ...], kwargs: Any, result: Any, began: int,
                                       spent: int) -> None:  # fmt: skip
        output = args[0] if args else kwargs["connector_output"]
        for req_id in output.finished_recving or ():
            record = self.records.get(req_id)
            if record is not None and record.recv_step is None:
                record.recv_step, record.recv_ns = self.step, began


def _top2(step: dict[int, Any]) -> list[tuple[int, float]]:
    return sorted(((token, value.logprob) for token, value in step.items()), key=lambda e: (-e[1], e[0]))[:2]


def drive(probe: Probe, prompts: list[list[int]], max_tokens: int, concurrency: int, prefix: str) -> None:
    """Add `concurrency` requests together, step until all finish, repeat: explicit steps, greedy."""
    from vllm import SamplingParams

    engine = probe.llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, logprobs=2)
    for start in range(0, len(prompts), concurrency):
        for offset, prompt in enumerate(prompts[start : start + concurrency]):
            engine.add_request(f"{prefix}-{start + offset}", {"prompt_token_ids": prompt}, params)
        bound = time.monotonic() + 120.0
        while engine.has_unfinished_requests():
            if time.monotonic() > bound:
                raise TimeoutError(f"{prefix}: requests did not finish within 120 s")
            engine.step()
