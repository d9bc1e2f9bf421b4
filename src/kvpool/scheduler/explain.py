"""Why a prompt hits the pool where it does: per group, which chunks are present, and what stops the hit.

A hit is the longest boundary (a multiple of the groups' LCM block size) at which every group holds
the chunks it needs, below two limits: the last prompt token is always recomputed (the engine needs
its logits), and only full blocks have hashes. So a hit stops for one of these reasons:

- `last_token`: the prompt's last token sits in the next chunk;
- `partial_block`: the tokens past the hit do not fill a block (no hash, never stored);
- `alignment`: the limit falls inside an LCM boundary of a hybrid model's block sizes;
- `missing_chunk`: a chunk the next boundary needs is not in the pool (never stored, evicted, or
  stored under another namespace: model, layout, seed or tenant);
- `mask`: the chunk the next boundary needs is one the store mask never keeps for this prompt (the
  retention policy of a sliding-window or chunked-local group: only some boundaries are reachable).

A state-space (Mamba) group needs only its state at the boundary itself, which the pool holds only if
the engine handed it over there; a missing one is named as the group's state at that boundary.

`explain` answers with the same presence the scheduler's lookups use (the embedded pools' index, or
the pool's `exists`), without counting a lookup.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvpool.core.keys import chunk_hashes
from kvpool.core.masks import StateSpace
from kvpool.scheduler.scheduler_core import SchedulerCore


class StopReason(str, enum.Enum):
    LAST_TOKEN = "last_token"
    PARTIAL_BLOCK = "partial_block"
    ALIGNMENT = "alignment"
    MISSING_CHUNK = "missing_chunk"
    MASK = "mask"


@dataclass(frozen=True)
class GroupPresence:
    group: int
    kind: str  # e.g. "full", "sliding_window:64"
    block_size: int
    present: list[bool]  # per chunk of the prompt's full blocks: in the pool, in every namespace it needs
    loads: list[int]  # the chunks a hit at `hit_tokens` loads


@dataclass(frozen=True)
class Explanation:
    prompt_tokens: int
    hashed_tokens: int  # tokens in full blocks: only those have hashes
    limit_tokens: int  # min(prompt - 1, hashed): no hit goes past this
    aligned_tokens: int  # the limit rounded down to the LCM block size
    hit_tokens: int
    reason: StopReason
    detail: str
    groups: list[GroupPresence]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["reason"] = self.reason.value
        return data


def explain(scheduler: SchedulerCore, block_hashes: Sequence[bytes], num_tokens: int) -> Explanation:
    """Where a lookup of this prompt (its engine block hashes, its length) hits, and why it stops there."""
    coord = scheduler.coordinator
    hashed = len(block_hashes) * coord.hash_block_size
    limit = max(0, min(num_tokens - 1, hashed))
    aligned = coord.align(limit)
    picked = [list(chunk_hashes(block_hashes, coord.hash_block_size, kind.block_size)) for kind in coord.kinds]
    found = scheduler.presence(picked)
    hit = coord.longest_hit(limit, [flags.__getitem__ for flags in found]) if aligned else 0
    reason, detail = _stop(scheduler, found, num_tokens, hashed, limit, aligned, hit)
    groups = []
    for group, (kind, flags, mask) in enumerate(zip(coord.kinds, found, coord.load_masks(hit))):
        count = hit // kind.block_size
        loads = list(range(count)) if mask is None else [chunk for chunk in range(count) if mask[chunk]]
        groups.append(GroupPresence(group, kind.describe(), kind.block_size, list(flags), loads))
    return Explanation(num_tokens, hashed, limit, aligned, hit, reason, detail, groups)


def _stop(
    scheduler: SchedulerCore,
    found: list[list[bool]],
    num_tokens: int,
    hashed: int,
    limit: int,
    aligned: int,
    hit: int,
) -> tuple[StopReason, str]:
    coord = scheduler.coordinator
    if hit == aligned:
        finest = min(kind.block_size for kind in coord.kinds)
        if limit // finest * finest > aligned:  # a group alone could go further: the LCM stops it
            return StopReason.ALIGNMENT, (
                f"the next boundary, {aligned + coord.lcm}, is past the limit of {limit} tokens "
                f"(boundaries are multiples of {coord.lcm}, the LCM of the groups' block sizes)"
            )
        if num_tokens - 1 <= hashed:
            return StopReason.LAST_TOKEN, (
                f"the last prompt token (token {num_tokens - 1}) is always recomputed: the next chunk holds it"
            )
        return StopReason.PARTIAL_BLOCK, (
            f"the {num_tokens - hashed} tokens after token {hashed} do not fill a block: no hash, never stored"
        )
    boundary = hit + coord.lcm
    boundaries = coord.boundaries(num_tokens)
    for group, (kind, flags) in enumerate(zip(coord.kinds, found)):
        for chunk in kind.required(boundary):
            if chunk < len(flags) and not flags[chunk]:
                where = f"group {group} ({kind.describe()}) chunk {chunk} (tokens {chunk * kind.block_size}-"
                where += f"{(chunk + 1) * kind.block_size - 1}), needed by a hit at {boundary}"
                if not kind.stores(chunk, boundaries):
                    return StopReason.MASK, f"{where}: the store mask never keeps it for this prompt (retention policy)"
                if isinstance(kind, StateSpace):
                    return StopReason.MISSING_CHUNK, (
                        f"{where}: the state at {boundary} tokens is not in the pool (a state is stored only "
                        "when the engine hands it over at that boundary: vLLM's boundary_state_offloads)"
                    )
                return StopReason.MISSING_CHUNK, f"{where}: not in the pool"
    return StopReason.MISSING_CHUNK, f"a chunk needed by a hit at {boundary} is not in the pool"


def print_explanation(explanation: Explanation) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"pool hit: {explanation.hit_tokens} of {explanation.prompt_tokens} prompt tokens")
    for column in ("group", "kind", "block", "chunks present", "loaded at the hit"):
        table.add_column(column, justify="left" if column in ("kind", "chunks present") else "right")
    for group in explanation.groups:
        cells = "".join("#" if there else "." for there in group.present)
        table.add_row(str(group.group), group.kind, str(group.block_size), cells or "-", str(len(group.loads)))
    console.print(table)
    console.print(
        f"limit {explanation.limit_tokens} tokens (full blocks: {explanation.hashed_tokens}), "
        f"aligned {explanation.aligned_tokens}; '#' present, '.' missing"
    )
    console.print(f"stops at {explanation.hit_tokens}: [bold]{explanation.reason.value}[/bold]: {explanation.detail}")
