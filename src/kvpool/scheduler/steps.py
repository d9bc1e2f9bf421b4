"""The scheduler role's policy per engine step, engine-neutral: what it answers a lookup, which loads
it arms, and the metadata each step hands the workers. The vLLM adapter only translates vLLM's
requests and scheduler output into these calls.

Invariants:
- A load is async (see `load_watch`): the engine waits for it, and a failed chunk never reaches an
  output, another request or a save. Except a contract hit (`SchedulerConfig.in_step_bytes`): the
  embedded DRAM pools keep every chunk the index lists readable until its withdrawal is acknowledged
  (`backends/memory.py`, `StepMetadata.pool_acks`), so its load cannot miss, and it loads before the
  forward of the step that schedules it, within a byte budget per step. Only models vLLM recomputes
  from a failed block (one full-attention group) take them: a broken contract stays recoverable.
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
        config = core.config
        self._in_step = config.in_step_bytes > 0 and config.in_step_bytes_per_token > 0
        self._in_step_left = float(config.in_step_bytes)  # this step's budget, what is left of it
        self._in_step_offers: set[str] = set()  # answered "in-step" by `matched`, not yet allocated
        self._in_step_pending: set[str] = set()  # allocated in-step loads not yet in a step's metadata
        self._admitted: dict[str, tuple[int, str]] = {}  # before its first token: (admission step, kind of hit)
        self._first_token: set[str] = set()  # live requests whose first token was counted

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
        external, wait = self.loads.offer(hit, computed_tokens)
        if wait and self._in_step and self._fits_in_step(external):
            self._in_step_offers.add(req_id)
            return external, False
        self._in_step_offers.discard(req_id)
        return external, wait

    def _fits_in_step(self, external_tokens: int) -> bool:
        """Take the hit's bytes from this step's in-step budget, if they fit (a hit the engine then does not
        admit keeps its share until the next step: the budget errs on the side of fewer in-step loads)."""
        cost = external_tokens * self.core.config.in_step_bytes_per_token
        if cost > self._in_step_left or not self.core.coordinator.resumes_at_failed_chunk:
            return False
        self._in_step_left -= cost
        return True

    def allocated(
        self, req_id: str, num_prompt_tokens: int, block_hashes: Sequence[bytes], external_tokens: int
    ) -> None:
        """The engine allocated blocks for the request; `external_tokens` > 0: for a load of that many."""
        if external_tokens <= 0:
            return
        local = self._local_tokens.get(req_id, 0)
        in_step = req_id in self._in_step_offers
        self._in_step_offers.discard(req_id)
        self.core.on_allocated(req_id, num_prompt_tokens, local, external_tokens, in_step)
        self._pending[req_id] = _Pending(num_prompt_tokens, block_hashes)
        self._admitted.setdefault(req_id, (self._steps + 1, "in_step" if in_step else "async"))
        if in_step:  # the engine computes on it in this step: nothing waits, nothing is watched
            self._in_step_pending.add(req_id)
            return
        self.loads.allocated(req_id)
        self._allocated_at[req_id] = self._steps + 1

    def begin(self, preempted: Iterable[str], table: Callable[[str], Table | None]) -> StepMetadata:
        """A step's metadata with its preemptions and the loads allocated since the last step; the
        scheduled requests follow through `add`. `table(req_id)` resolves a request's current blocks."""
        core = self.core
        self._steps += 1
        self._in_step_left = float(core.config.in_step_bytes)  # the next schedule()'s budget
        self._in_step_offers.clear()
        step = StepMetadata(reset_epoch=core.reset_epoch, weights_tag=core.weights_tag, clear_epoch=core.clear_epoch)
        if core.index is not None and core.index.acked:
            step.pool_acks = dict(core.index.acked)
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
            if blocks is None and req_id in self._in_step_pending:
                # cannot happen (vLLM allocated its blocks in this very schedule()); nothing can be reported:
                # vLLM waits for no in-step load
                log.error("request %s: no block table for its in-step load; its blocks are computed unloaded", req_id)
                continue
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
                if delta.load is not None and not delta.load.in_step:
                    self.loads.started(req_id, blocks, delta.load)
        self._pending.clear()
        self._in_step_pending.clear()
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
        if new_tokens > 0:
            self._count_first_token(req_id, num_prompt_tokens, computed_before, computed_before + new_tokens)
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

    def _count_first_token(self, req_id: str, num_prompt_tokens: int, computed_before: int, computed: int) -> None:
        """Steps to first token, per kind of hit: the step whose computation reaches the prompt's end
        samples the first token."""
        if req_id in self._first_token:
            return  # decoding, or recomputed after a preemption: its first token was counted
        admitted = self._admitted.get(req_id)
        if admitted is None:
            if computed_before >= num_prompt_tokens:
                return  # a step of a request no step of ours saw start
            # first computed now: the engine's own hit, or none (a pool hit was admitted by `allocated`)
            admitted = self._admitted[req_id] = (self._steps, "local" if computed_before else "miss")
        if computed < num_prompt_tokens:
            return
        del self._admitted[req_id]
        self._first_token.add(req_id)
        first_at, kind = admitted
        stats = self.core.stats
        steps = f"first_token_steps_{kind}"
        setattr(stats, steps, getattr(stats, steps) + self._steps - first_at + 1)
        setattr(stats, f"first_tokens_{kind}", getattr(stats, f"first_tokens_{kind}") + 1)

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
        if self._pending.pop(req_id, None) is not None and req_id not in self._in_step_pending:
            self._cancelled.append(req_id)  # reported finished and failed, so the engine frees its blocks
        self._in_step_pending.discard(req_id)
        self._retired.discard(req_id)
        self._allocated_at.pop(req_id, None)
        self._admitted.pop(req_id, None)
        self._first_token.discard(req_id)
        self.core.finish(req_id)
        return self.loads.finish(req_id)
