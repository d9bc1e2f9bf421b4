"""The scheduler's watch over loads in flight: the engine blocks each load writes, so that a failure
the engine reports by block id names its request, and whether a finished request's blocks are still
being written.

Every load is async (the engine waits steps for it): vLLM then neither caches the loading request's
blocks nor runs a forward on them until every rank reported the load finished, and it caches only the
prefix that loaded. A failed chunk so never reaches an output, another request's local hit or a save,
in any configuration (async scheduling, TP, PP, either model runner).

Invariants:
- A load holds its request's blocks from allocation until the engine reports it finished or
  preempts the request: only then may the engine free them, so `finish` answers True (keep the
  blocks) exactly while one is in flight.
- A load fails its request when the engine names the request failed or names invalid any block the
  load writes. Block 0 is the engine's null block, shared by every request: it names none.
- Outputs arrive in step order, and a load is forgotten only once an output reports it finished:
  a failure reported with (or before) its finish always names its request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvpool.core.masks import ceil_div
from kvpool.core.metadata import LoadSpec

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
    """One per scheduler."""

    def __init__(self, block_sizes: Sequence[int]) -> None:
        self.block_sizes = list(block_sizes)
        self._loads: dict[str, set[int]] = {}  # request → blocks its pending load writes

    @staticmethod
    def offer(hit_tokens: int, computed_tokens: int) -> tuple[int, bool]:
        """What to answer the engine for a lookup hit: the tokens to load beyond what it computed
        itself, and whether it must wait for them (always, when there is something to load)."""
        external = max(0, hit_tokens - computed_tokens)
        return external, external > 0

    def allocated(self, req_id: str) -> None:
        """The engine allocated blocks for a load of this request: they are held from now."""
        self._loads[req_id] = set()

    def started(self, req_id: str, table: Sequence[Sequence[int]], load: LoadSpec) -> None:
        """The workers are told to start `load` into the request's `table` (per group, its block ids)."""
        self._loads[req_id] = load_targets(table, self.block_sizes, load.start_tokens, load.hit_tokens)

    def preempted(self, req_id: str) -> None:
        self._loads.pop(req_id, None)

    def absorb(self, invalid_blocks: set[int], failed_requests: set[str], finished: Iterable[str]) -> list[str]:
        """One step's output from the workers: the requests whose load failed (in the order they were
        watched). Loads in `finished` release their blocks."""
        failed: list[str] = []
        if invalid_blocks or failed_requests:
            for req_id, targets in self._loads.items():
                if req_id in failed_requests or not targets.isdisjoint(invalid_blocks):
                    failed.append(req_id)
        for req_id in finished:
            self._loads.pop(req_id, None)
        return failed

    def finish(self, req_id: str) -> bool:
        """The request ended: True when a load still writes its blocks (the engine keeps them until
        that load is reported finished)."""
        return self._loads.pop(req_id, None) is not None

    def loading(self, req_id: str) -> bool:
        return req_id in self._loads
