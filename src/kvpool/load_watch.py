"""The scheduler's watch over loads in flight: the engine blocks each load writes, so that a failure
the engine reports by block id names its request, and whether a finished request's blocks are still
being written.

Invariants:
- An async load (the engine waits steps for it) holds its request's blocks from allocation until the
  engine reports it finished or preempts the request: only then may the engine free them, so `finish`
  answers True (keep the blocks) exactly while one is in flight.
- A load fails its request when the engine names the request failed or names invalid any block the
  load writes. Block 0 is the engine's null block, shared by every request: it names none.
- An in-step load (the engine computes on its blocks in the step that loads them) reports its
  failures in that step's output or never, so it is forgotten after the next output.
- A request's loads are either all in-step or all async, as decided once for the engine
  (`roles.scheduler_role`): the watch keeps them apart only to forget in-step ones sooner.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvpool.masks import ceil_div
from kvpool.metadata import LoadSpec

NULL_BLOCK = 0


def load_targets(
    table: Sequence[Sequence[int]], block_sizes: Sequence[int], start_tokens: int, hit_tokens: int
) -> set[int]:
    """The blocks a load of tokens [start, hit) may write, over every group's table (`table[g]` holds
    group g's block ids, `block_sizes[g]` tokens each)."""
    targets: set[int] = set()
    for blocks, block_size in zip(table, block_sizes):
        targets.update(blocks[start_tokens // block_size : ceil_div(hit_tokens, block_size)])
    targets.discard(NULL_BLOCK)
    return targets


class LoadWatch:
    """One per scheduler. `in_step`: loads run in the step that computes on them (see module doc)."""

    def __init__(self, block_sizes: Sequence[int], *, in_step: bool) -> None:
        self.block_sizes = list(block_sizes)
        self.in_step = in_step
        self._async: dict[str, set[int]] = {}  # request → blocks its pending async load writes
        self._in_step: dict[str, set[int]] = {}  # the same for loads the engine computes on at once

    def offer(self, hit_tokens: int, computed_tokens: int) -> tuple[int, bool]:
        """What to answer the engine for a lookup hit: the tokens to load beyond what it computed
        itself, and whether it must wait for them (an async load)."""
        external = max(0, hit_tokens - computed_tokens)
        return external, external > 0 and not self.in_step

    def allocated(self, req_id: str) -> None:
        """The engine allocated blocks for a load of this request: an async one holds them from now."""
        if not self.in_step:
            self._async[req_id] = set()

    def started(self, req_id: str, table: Sequence[Sequence[int]], load: LoadSpec) -> None:
        """The workers are told to start `load` into the request's `table` (per group, its block ids)."""
        targets = load_targets(table, self.block_sizes, load.start_tokens, load.hit_tokens)
        (self._in_step if load.in_step else self._async)[req_id] = targets

    def preempted(self, req_id: str) -> None:
        self._async.pop(req_id, None)

    def absorb(self, invalid_blocks: set[int], failed_requests: set[str], finished: Iterable[str]) -> list[str]:
        """One step's output from the workers: the requests whose load failed (in the order they were
        watched). Loads in `finished` release their blocks; in-step loads are forgotten."""
        failed: list[str] = []
        if invalid_blocks or failed_requests:
            for loads in (self._async, self._in_step):
                for req_id, targets in loads.items():
                    if req_id in failed_requests or not targets.isdisjoint(invalid_blocks):
                        failed.append(req_id)
        for req_id in finished:
            self._async.pop(req_id, None)
        self._in_step.clear()
        return failed

    def finish(self, req_id: str) -> bool:
        """The request ended: True when an async load still writes its blocks (the engine keeps them
        until that load is reported finished)."""
        return self._async.pop(req_id, None) is not None
