"""The store-path bench's kvpool modes: the real `WorkerCore` over a cell, fed the deltas kvpool's own
`SchedulerCore` builds for it (as the vLLM adapter drives both), on the embedded pool or on kvpool's
`MooncakeBackend`. `bench scale` drives the same run with a delta for every request every step."""

from __future__ import annotations

import gc
import time

from kvpool.backends.base import Backend
from kvpool.backends.memory import MemoryBackend
from kvpool.benchmarks.per_step.store_path_cells import _Cell, _Step
from kvpool.core.metadata import RequestDelta, StepMetadata
from kvpool.scheduler.scheduler_core import SchedulerConfig, SchedulerCore
from kvpool.worker.worker_core import WorkerConfig, WorkerCore

DRAIN_TIMEOUT_S = 120.0


class _IncrementalRun:
    """A WorkerCore over one cell, pre-filled to the context; `window` times decode steps. Default: the
    embedded pool with the adapter's in-process settings (saves in the step), drained every step, and a
    delta for every request every step. `scheduled`: the deltas kvpool's own `SchedulerCore` builds, as
    the vLLM adapter drives it (`quiet` skips a request with no new block and no block completed;
    `request_delta` otherwise), and the worker calls of the adapter (`save` only when a delta saves)."""

    def __init__(
        self,
        cell: _Cell,
        backend: Backend | None = None,
        config: WorkerConfig | None = None,
        drain_each_step: bool = True,
        scheduled: bool = False,
    ) -> None:
        self.cell = cell
        self.owns_backend = backend is None
        self.backend: Backend = backend if backend is not None else MemoryBackend(cell.capacity)
        self.drain_each_step = drain_each_step
        self.put_calls = 0  # the pool's put calls in the last window
        self.engine = WorkerCore(
            self.backend, cell.coordinator, cell.placements, cell.layout, config or WorkerConfig(sync_saves=True)
        )
        self.scheduler: SchedulerCore | None = None
        if scheduled:
            namespaces = [[placement.keys] for placement in cell.placements]
            self.scheduler = SchedulerCore(
                cell.coordinator, namespaces, lambda keys: [False] * len(keys), SchedulerConfig(save_decode=True)
            )
        prefill = []
        for request, length in zip(cell.requests, cell.start_lengths):
            new_hashes, new_blocks = cell.grow(request, length)
            if self.scheduler is None:
                prefill.append(
                    RequestDelta(
                        request.req_id,
                        new_hashes=new_hashes,
                        new_blocks=new_blocks,
                        num_prompt_tokens=length,
                        save_tokens=length,
                    )
                )
                continue
            delta = self.scheduler.request_delta(
                request.req_id,
                num_prompt_tokens=length,
                block_hashes=request.known_hashes,
                computed_before=0,
                new_tokens=length,
                new_blocks=new_blocks,
                whole_table=True,
            )
            assert delta is not None and delta.save_tokens
            prefill.append(delta)
        self.engine.apply(prefill)
        self.engine.save(prefill)
        if not self.engine.drain(600):
            raise RuntimeError("pre-fill saves did not finish")

    def _deltas(self, step: list[_Step] | None) -> list[RequestDelta]:
        """One decode step of every request (`step`: advanced already): the deltas the workers get."""
        cell, scheduler, deltas = self.cell, self.scheduler, []
        if scheduler is None:
            for request in cell.requests:
                before = request.length
                new_hashes, new_blocks = cell.grow(request, before + 1)
                deltas.append(
                    RequestDelta(
                        request.req_id,
                        new_hashes=new_hashes,
                        new_blocks=new_blocks if any(new_blocks) else None,
                        save_tokens=before + 1,  # every step saves; the worker finds what is new
                        computed_before=before,
                    )
                )
            return deltas
        for item in step or ():
            grew = any(item.new_blocks)
            if grew or not scheduler.quiet(item.request.req_id, item.before + 1):
                delta = scheduler.request_delta(
                    item.request.req_id,
                    num_prompt_tokens=item.request.prompt_tokens,
                    block_hashes=item.request.known_hashes,
                    computed_before=item.before,
                    new_tokens=1,
                    new_blocks=item.new_blocks if grew else None,
                )
                if delta is not None:
                    deltas.append(delta)
        return deltas

    def window(self, steps: int) -> tuple[float, float, int]:
        engine = self.engine
        examined0, calls0 = engine.stats.chunks_examined, engine.stats.put_calls
        # scheduled: the requests advance before the window (the engine's work), as in vLLM's mode
        plan: list[list[_Step] | None] = list(self.cell.advance(steps)) if self.scheduler else [None] * steps
        gc.collect()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for step in plan:
            deltas = self._deltas(step)
            if self.scheduler is None:
                engine.apply(deltas)
                engine.save(deltas)
            else:  # the adapter's worker: apply every step, save when a delta saves
                engine.handle_step(StepMetadata(deltas))
                engine.apply(deltas)
                if any(delta.save_tokens for delta in deltas):
                    engine.save(deltas)
            if self.drain_each_step:
                engine.drain()
        if not self.drain_each_step and not engine.drain(DRAIN_TIMEOUT_S):
            raise TimeoutError(f"kvpool's saves did not finish within {DRAIN_TIMEOUT_S:.0f} s")
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        self.put_calls = engine.stats.put_calls - calls0
        return cpu, wall, engine.stats.chunks_examined - examined0

    def stored(self) -> tuple[int, int]:
        """(stored, expected): the chunks of every group this rank owns from the context on."""
        keys: list[str] = []
        for request, start in zip(self.cell.requests, self.cell.start_lengths):
            for group, placement in enumerate(self.cell.placements):
                chunks = self.cell.owned_chunks(group, start, request.length)
                keys += placement.keys.keys(request.hashes[c] for c in chunks)
        return (sum(self.backend.exists(keys)) if keys else 0), len(keys)

    def close(self) -> None:
        stats = self.engine.stats
        self.engine.close()
        if self.owns_backend:
            self.backend.clear()
        if stats.chunks_put_failed or stats.save_jobs_dropped:
            raise RuntimeError(f"incremental saves failed: {stats}")


def _measure_incremental(
    cells: dict[int, _Cell], steps: int, windows: int, backend: Backend | None = None
) -> dict[int, dict[str, float]]:
    """Windows of every context in turn (a burst of machine noise hits all contexts alike); the
    fastest window of each context is its figure. `backend`: kvpool's Mooncake client (shared by the
    cells, as by an engine's requests), with the adapter's settings for a remote pool."""
    config = None
    if backend is not None:
        from kvpool.connector.roles import worker_config
        from kvpool.core.config import KVPoolConfig

        config = worker_config(KVPoolConfig(backend="mooncake"))
    runs: dict[int, _IncrementalRun] = {}
    try:
        for context, cell in cells.items():
            runs[context] = _IncrementalRun(cell, backend, config, drain_each_step=False, scheduled=True)
        samples: dict[int, list[tuple[float, float, int, int]]] = {context: [] for context in cells}
        for _ in range(windows):
            for context, incremental in runs.items():
                samples[context].append((*incremental.window(steps), incremental.put_calls))
        stored = {context: incremental.stored() for context, incremental in runs.items()}
    finally:
        for incremental in runs.values():
            incremental.close()
    out = {}
    for context, measured in samples.items():
        cpu, wall, examined, calls = min(measured)
        out[context] = {"cpu_s": cpu, "wall_s": wall, "examined": examined, "steps": steps, "put_calls": calls}
        out[context]["stored"], out[context]["expected"] = stored[context]
    return out
