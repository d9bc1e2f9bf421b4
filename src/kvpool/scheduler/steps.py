"""The scheduler role's policy per engine step, engine-neutral: what it answers a lookup, which loads
it arms, and the metadata each step hands the workers. The vLLM adapter only translates vLLM's
requests and scheduler output into these calls.

Invariants:
- Every load is async (see `load_watch`): the engine waits for it, and a failed chunk never reaches
  an output, another request or a save.
- A load the engine waits for always reaches the workers, who report it finished: armed into the
  step after its allocation, or, when its block table cannot be resolved, named in `failed_loads`
  (reported finished and failed, so the engine recomputes) and logged. A lost load is a hang.
- A request the engine re-admits before any step listed its preemption (vLLM's
  `reset_prefix_cache(reset_running_requests=True)` preempts between steps, and the next
  `schedule()` both lists the request preempted and re-admits it, with a load armed before the step
  is built) has its old tracker retired at the lookup: the step that lists the preemption then
  leaves the new tracker and its load alone, and the workers drop the old state before the new
  one's first delta.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvpool.core.metadata import StepMetadata
from kvpool.scheduler.load_watch import LoadWatch
from kvpool.scheduler.scheduler_core import SchedulerCore

log = logging.getLogger("kvpool.scheduler")

Table = Sequence[Sequence[int]]  # per group, a request's block ids


@dataclass
class _Pending:
    """A load allocated by the engine, not yet in a step's metadata."""

    num_prompt_tokens: int
    block_hashes: Sequence[bytes]


class SchedulerSteps:
    """One per scheduler, around its core."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self.loads = LoadWatch([kind.block_size for kind in core.coordinator.kinds])
        self._local_tokens: dict[str, int] = {}  # request → tokens the engine had computed itself at lookup
        self._pending: dict[str, _Pending] = {}
        self._retired: set[str] = set()  # re-admitted before a step listed their preemption
        self._cancelled: list[str] = []  # ended with their load allocated, before any step armed it
        self._steps = 0  # steps built so far
        self._allocated_at: dict[str, int] = {}  # loading request → the step its allocation is in

    def matched(
        self, req_id: str, block_hashes: Sequence[bytes], num_tokens: int, computed_tokens: int
    ) -> tuple[int | None, bool]:
        """The engine asks, for a waiting request with `computed_tokens` of its own, how many more tokens
        the pool can load, and whether it must wait for them. None: not known yet, ask again."""
        if self.core.started(req_id) and not self.loads.loading(req_id):
            # looked up again with the workers holding its table: preempted (or its load failed whole)
            # and now re-admitted, possibly before the step that lists the preemption is built
            self.core.forget(req_id)
            self._retired.add(req_id)
        hit = self.core.lookup(req_id, block_hashes, num_tokens)
        if hit is None:
            self.core.stats.lookup_waits += 1
            return None, False
        self._local_tokens[req_id] = computed_tokens
        return self.loads.offer(hit, computed_tokens)

    def allocated(
        self, req_id: str, num_prompt_tokens: int, block_hashes: Sequence[bytes], external_tokens: int
    ) -> None:
        """The engine allocated blocks for the request; `external_tokens` > 0: for a load of that many."""
        if external_tokens <= 0:
            return
        local = self._local_tokens.get(req_id, 0)
        self.core.on_allocated(req_id, num_prompt_tokens, local, external_tokens)
        self._pending[req_id] = _Pending(num_prompt_tokens, block_hashes)
        self.loads.allocated(req_id)
        self._allocated_at[req_id] = self._steps + 1

    def begin(self, preempted: Iterable[str], table: Callable[[str], Table | None]) -> StepMetadata:
        """A step's metadata with its preemptions and the loads allocated since the last step; the
        scheduled requests follow through `add`. `table(req_id)` resolves a request's current blocks."""
        core = self.core
        self._steps += 1
        step = StepMetadata(reset_epoch=core.reset_epoch, weights_tag=core.weights_tag, clear_epoch=core.clear_epoch)
        for req_id in preempted:
            step.preempted.append(req_id)
            if req_id in self._retired:
                core.stats.preemptions += 1
                continue  # already retired at its re-admission: its new tracker and load stay
            core.preempt(req_id)
            self.loads.preempted(req_id)
            self._allocated_at.pop(req_id, None)
        # retired without a preemption the engine listed (a load that failed whole): the workers drop
        # the old state all the same, before the new state's first delta in this step
        if self._retired:
            step.preempted.extend(sorted(self._retired.difference(step.preempted)))
            self._retired.clear()
        for req_id, pending in self._pending.items():
            blocks = table(req_id)
            if blocks is None:
                log.error(
                    "request %s: the engine allocated blocks for its load but no block table was found; "
                    "the load is reported failed and the request recomputed",
                    req_id,
                )
                step.failed_loads.append(req_id)
                continue
            delta = core.request_delta(
                req_id,
                num_prompt_tokens=pending.num_prompt_tokens,
                block_hashes=pending.block_hashes,
                computed_before=self._local_tokens.get(req_id, 0),
                new_tokens=0,
                new_blocks=blocks,
                whole_table=True,
            )
            if delta is not None:
                step.requests.append(delta)
                if delta.load is not None:
                    self.loads.started(req_id, blocks, delta.load)
        self._pending.clear()
        step.failed_loads.extend(self._cancelled)  # reported finished, so the engine frees their blocks
        self._cancelled.clear()
        return step

    def add(
        self,
        step: StepMetadata,
        req_id: str,
        *,
        num_prompt_tokens: int,
        block_hashes: Sequence[bytes],
        new_blocks: Table | None,
        whole_table: bool,
        computed_before: int,
        new_tokens: int,
    ) -> None:
        """A request the step computes `new_tokens` for, from `computed_before` on."""
        delta = self.core.request_delta(
            req_id,
            num_prompt_tokens=num_prompt_tokens,
            block_hashes=block_hashes,
            computed_before=computed_before,
            new_tokens=max(0, new_tokens),
            new_blocks=new_blocks,
            whole_table=whole_table,
        )
        if delta is not None:
            step.requests.append(delta)

    def states(
        self,
        step: StepMetadata,
        req_id: str,
        offers: Sequence[tuple[int, int, int]],
        block_hashes: Sequence[bytes],
    ) -> None:
        """Boundary states the engine hands over for the request in this step (after its `add`):
        `(group, block id, boundary tokens)` each. The ones worth storing ride the request's delta of
        this step (a delta of their own when it has none), so the workers copy them out in this step."""
        found = self.core.boundary_states(req_id, offers, block_hashes)
        if found is None:
            return
        for delta in step.requests:
            if delta.req_id == req_id:
                delta.states.extend(found.states)
                delta.new_hashes.extend(found.new_hashes)
                return
        step.requests.append(found)

    def absorb(self, invalid_blocks: set[int], failed_requests: set[str], finished: Iterable[str]) -> None:
        """One step's output from the workers: failed loads are never offered again."""
        for req_id in self.loads.absorb(invalid_blocks, failed_requests, finished):
            self.core.mark_load_failed(req_id)
        stats = self.core.stats
        for req_id in finished:
            allocated_at = self._allocated_at.pop(req_id, None)
            if allocated_at is not None:
                stats.loads_finished += 1
                stats.load_wait_steps += self._steps - allocated_at + 1

    def finished(self, req_id: str) -> bool:
        """The request ended: True when the engine must keep its blocks until its load is reported."""
        self._local_tokens.pop(req_id, None)
        if self._pending.pop(req_id, None) is not None:
            self._cancelled.append(req_id)
        self._retired.discard(req_id)
        self._allocated_at.pop(req_id, None)
        self.core.finish(req_id)
        return self.loads.finish(req_id)
