"""The store-path bench's cells: requests, their block hashes and block tables, and the KV tensors every
mode of a (case, block size) reads.

Cases: `full` (one full-attention group), `hybrid` (a full-attention group and a sliding-window group
of `SLIDING_WINDOW_BLOCKS` blocks; at one block size for both groups both kvpool's and vLLM's store
masks are dense: every sliding-window chunk is reachable from some block boundary), `put_step2` (one TP
rank of two that hold identical KV heads and stripe their puts by absolute chunk id).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.core.masks import AttentionKind, FullAttention, MaskCoordinator, SlidingWindow
from kvpool.core.plan import GroupPlacement
from kvpool.worker.layout import KVLayout

LAYERS = 2
LAYER_BLOCK_BYTES = 256  # small blocks: the figures are the store path's CPU, not memcpy
HASH_BYTES = 32  # sha256-sized block hashes, like vLLM's default
CASES = ("full", "hybrid", "put_step2")
SLIDING_WINDOW_BLOCKS = 4  # the hybrid case's window, in blocks


@dataclass
class _Request:
    req_id: str
    hashes: list[bytes]  # every hash this request will ever have
    first_blocks: list[int]  # per group
    length: int = 0
    prompt_tokens: int = 0
    known_hashes: list[bytes] = field(default_factory=list)  # what the engine knows so far
    tables: list[list[int]] = field(default_factory=list)  # per group


@dataclass
class _Step:
    """One request's decode step: its length before the step and what the step made known."""

    request: _Request
    before: int
    new_hashes: list[bytes]
    new_blocks: tuple[list[int], ...]


class _Pool:
    """The KV tensors of one (case, block size), shared by its cells: each context owns a fixed range of
    block ids, so every mode's cell of a context reads the same blocks, and vLLM's connector registers
    the tensors once for all contexts. Hybrid: every group's layers live in the same tensors (one per
    layer slot, as vLLM's hybrid allocation has them); a block id belongs to one group."""

    def __init__(self, case: str, block_size: int, contexts: Sequence[int], requests: int, max_steps: int) -> None:
        if case not in CASES:
            raise ValueError(f"case {case!r}: expected one of {', '.join(CASES)}")
        self.case, self.block_size, self.requests, self.max_steps = case, block_size, requests, max_steps
        self.kinds: list[AttentionKind] = [FullAttention(block_size)]
        if case == "hybrid":
            self.kinds.append(SlidingWindow(block_size, SLIDING_WINDOW_BLOCKS * block_size))
        self.put_step = 2 if case == "put_step2" else 1
        self.first_block: dict[int, int] = {}
        next_block = 1  # block 0: the engine's null block
        for context in sorted(set(contexts)):
            self.first_block[context] = next_block
            next_block += requests * len(self.kinds) * self.table_blocks(context)
        self.num_blocks = next_block
        self.tensors = {
            f"layer{i}": np.zeros((self.num_blocks, LAYER_BLOCK_BYTES), dtype=np.uint8) for i in range(LAYERS)
        }
        for tensor in self.tensors.values():
            tensor[:, 0] = np.arange(self.num_blocks) % 251  # distinct, cheap content
        self.layer_tensors = {f"g{g}.{name}": name for g in range(len(self.kinds)) for name in self.tensors}
        self.layout = KVLayout(
            {layer: self.tensors[name] for layer, name in self.layer_tensors.items()},
            {layer: int(layer[1 : layer.index(".")]) for layer in self.layer_tensors},
            self.num_blocks,
        )

    def table_blocks(self, context: int) -> int:
        return -(-(context + self.max_steps) // self.block_size) + 1

    def cell(self, context: int, seed: int) -> _Cell:
        return _Cell(context, self.block_size, self.requests, self.max_steps, seed, self.case, self)


class _Cell:
    """One (case, context, block size) setting: groups and their placements, requests and their hashes,
    the KV tensors (a pool's, or its own)."""

    def __init__(
        self,
        context: int,
        block_size: int,
        requests: int,
        max_steps: int,
        seed: int,
        case: str = "full",
        pool: _Pool | None = None,
    ) -> None:
        pool = pool or _Pool(case, block_size, [context], requests, max_steps)
        if (pool.case, pool.block_size, pool.requests) != (case, block_size, requests) or pool.max_steps < max_steps:
            raise ValueError(f"pool {pool.case}/{pool.block_size}/{pool.requests} does not fit this cell")
        self.case, self.context, self.block_size, self.put_step = case, context, block_size, pool.put_step
        self.coordinator = MaskCoordinator(pool.kinds)
        self.placements = [
            GroupPlacement(
                KeySpace(
                    LayoutFingerprint(
                        "bench/model", "uint8", block_size, "bench", LAYERS * LAYER_BLOCK_BYTES, group_id=g
                    )
                ),
                put_step=self.put_step,
                put_step_rank=g % self.put_step,  # the rank's phase rotates per group, as in kvpool and vLLM
            )
            for g in range(len(pool.kinds))
        ]
        self.num_blocks, self.tensors, self.layout = pool.num_blocks, pool.tensors, pool.layout
        self.layer_tensors = pool.layer_tensors
        groups, table_blocks = len(pool.kinds), pool.table_blocks(context)
        rng = np.random.default_rng(seed)
        self.requests: list[_Request] = []
        for r in range(requests):
            raw = rng.bytes(HASH_BYTES * table_blocks)
            hashes = [raw[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(table_blocks)]
            first = [pool.first_block[context] + (r * groups + g) * table_blocks for g in range(groups)]
            tables: list[list[int]] = [[] for _ in range(groups)]
            self.requests.append(_Request(f"c{context}-req-{r}", hashes, first, tables=tables))
        # stagger the requests inside a block so block completions spread over the steps
        self.start_lengths = [context - (r * block_size // requests) for r in range(requests)]
        self.capacity = int(requests * groups * table_blocks * LAYERS * LAYER_BLOCK_BYTES * 1.25) + (1 << 20)

    def grow(self, request: _Request, length: int) -> tuple[list[bytes], tuple[list[int], ...]]:
        """Advance a request to `length` tokens: the hashes and, per group, the block ids that became known."""
        b = self.block_size
        new_hashes = request.hashes[len(request.known_hashes) : length // b]
        new_blocks = tuple(
            list(range(first + len(table), first + -(-length // b)))
            for first, table in zip(request.first_blocks, request.tables)
        )
        request.known_hashes.extend(new_hashes)
        for table, blocks in zip(request.tables, new_blocks):
            table.extend(blocks)
        if not request.prompt_tokens:
            request.prompt_tokens = length
        request.length = length
        return new_hashes, new_blocks

    def advance(self, steps: int) -> list[list[_Step]]:
        """`steps` decode steps of every request, done before a timed window (the engine's own work, not
        a connector's): per step and request, its length before and what became known."""
        plan = []
        for _ in range(steps):
            step = []
            for request in self.requests:
                before = request.length
                new_hashes, new_blocks = self.grow(request, before + 1)
                step.append(_Step(request, before, new_hashes, new_blocks))
            plan.append(step)
        return plan

    def owned_chunks(self, group: int, first_token: int, last_token: int) -> list[int]:
        """Chunk ids this rank stores of the chunks completed in [first_token, last_token) (masks are dense)."""
        placement = self.placements[group]
        b = self.block_size
        chunks = range(first_token // b, last_token // b)
        return [c for c in chunks if c % placement.put_step == placement.put_step_rank]
