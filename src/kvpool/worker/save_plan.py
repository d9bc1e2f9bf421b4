"""What a worker rank knows of each request, and the save ranges it plans from that with two marks.

Each request keeps two high-water marks: `planned_mark` (tokens covered by captured saves) and
`stored_mark` (tokens known stored; advances only when a whole range succeeded). A failed range
re-plans from `stored_mark`, so the next save of the request retries it while its blocks live. A
range's success moves `stored_mark` only if `stored_mark` had reached the range's start: a success
after an earlier range failed never claims the gap. A load that fails from some chunk on lowers both
marks to that chunk, so the chunks the pool did not give back are saved again.

A state lives from a request's first delta (the only one whose hashes start at token 0) until the
request is preempted, or finishes and its last in-flight range ends; a later delta then starts a new
state. A state alive across a pool reset is frozen: its KV mixes old and new weights, never saved again.

Not thread-safe: the worker calls every method under its one lock, as batch and load outcomes arrive
on the sender's and loader's threads.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvpool.backends.base import Status
from kvpool.core.chunks import ChunkRef, chunk_range
from kvpool.core.errors import LayoutError
from kvpool.core.keys import chunk_hashes
from kvpool.core.masks import MaskCoordinator, StateSpace
from kvpool.core.metadata import RequestDelta
from kvpool.core.plan import GroupPlacement
from kvpool.worker.layout import NULL_BLOCK_ID
from kvpool.worker.stats import WorkerStats


@dataclass
class SaveRange:
    """One request's share of a batch: `count` consecutive items, covering tokens [start, end)."""

    state: _RequestState  # whose marks the outcome moves
    start: int
    end: int
    count: int
    # False: boundary states (vLLM's hand-off), put once from the block handed over in their step and
    # never re-planned, so their outcome moves no mark
    moves_marks: bool = True


@dataclass
class _RequestState:
    req_id: str
    num_prompt_tokens: int
    hashes: list[bytes] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)
    stored_mark: int = 0  # tokens this rank knows are stored (advances on full success only)
    planned_mark: int = 0  # tokens covered by captured saves
    computed_before: int = 0
    in_flight: int = 0  # save batches holding a range of this request
    finished: bool = False
    dropped: bool = False  # preempted or retired: a later delta starts a new state
    frozen: bool = False  # alive across a pool reset: its KV mixes old and new, never saved again


class SavePlanner:
    """The request states of one worker rank: their hashes and block tables, the chunks a save or a load
    of a token range maps to, and the two marks each save's outcome moves."""

    def __init__(self, coordinator: MaskCoordinator, placements: Sequence[GroupPlacement], stats: WorkerStats) -> None:
        self.coordinator = coordinator
        self.placements = placements
        self.stats = stats
        self._states: dict[str, _RequestState] = {}

    def update(self, delta: RequestDelta) -> bool:
        """Record the delta's new hashes and blocks. False: the request has no state (nothing to load into)."""
        state = self._states.get(delta.req_id)
        if state is None or state.dropped:
            if not delta.num_prompt_tokens:
                # only a request's first delta carries its hashes from 0: a state built from a later
                # one would pair chunks with the wrong hashes
                return False
            state = _RequestState(
                delta.req_id,
                delta.num_prompt_tokens,
                blocks=[[] for _ in self.placements],
                stored_mark=delta.stored_tokens,
                planned_mark=delta.stored_tokens,
            )
            self._states[delta.req_id] = state
        if delta.new_hashes:
            state.hashes.extend(delta.new_hashes)
        if delta.new_blocks is not None:
            if len(delta.new_blocks) != len(self.placements):
                raise LayoutError(
                    f"request {delta.req_id!r}: {len(delta.new_blocks)} block lists for {len(self.placements)} groups"
                )
            for table, new in zip(state.blocks, delta.new_blocks):
                if delta.replace_blocks:
                    table.clear()
                table.extend(new)
        state.computed_before = max(state.computed_before, delta.computed_before)
        return True

    # ---- saves --------------------------------------------------------------------------------

    def plan(self, deltas: Iterable[RequestDelta]) -> tuple[list[SaveRange], list[ChunkRef]]:
        """The new chunks of every request in `deltas`, marks advanced past them.
        Every range returned is in flight until `end_ranges` gets its outcome."""
        ranges: list[SaveRange] = []
        items: list[ChunkRef] = []
        coord = self.coordinator
        for delta in deltas:
            if delta.states:
                self._plan_states(delta, ranges, items)
            if delta.save_tokens <= 0:
                continue
            state = self._states.get(delta.req_id)
            if state is None or state.dropped or state.finished or state.frozen:
                continue
            state.computed_before = max(state.computed_before, delta.computed_before)
            hashed = len(state.hashes) * coord.hash_block_size
            end = coord.align(min(delta.save_tokens, hashed))
            if end <= state.planned_mark:
                continue
            planned = self._save_chunks(state, state.planned_mark, end)
            ranges.append(SaveRange(state, state.planned_mark, end, len(planned)))
            items.extend(planned)
            state.planned_mark = end
            state.in_flight += 1
        return ranges, items

    def _plan_states(self, delta: RequestDelta, ranges: list[SaveRange], items: list[ChunkRef]) -> None:
        """The boundary states handed over in this step, from exactly the blocks named: their own range,
        which moves no mark (a state is never re-planned: its block is the engine's again after the
        step, so a state that fails to land is simply not in the pool)."""
        state = self._states.get(delta.req_id)
        if state is None or state.dropped or state.finished or state.frozen:
            return
        coord = self.coordinator
        planned: list[ChunkRef] = []
        for group, chunk, block_id in delta.states:
            kind, placement = coord.kinds[group], self.placements[group]
            hashes = chunk_hashes(state.hashes, coord.hash_block_size, kind.block_size)
            if block_id == NULL_BLOCK_ID or chunk >= len(hashes):
                self.stats.chunks_unreadable += 1
                continue
            if chunk % placement.put_step != placement.put_step_rank:
                continue  # another rank of the shard writes it
            parent = hashes[chunk - 1] if chunk else b""
            planned.append(ChunkRef(group, chunk, block_id, placement.keys.key(hashes[chunk]), parent))
        if planned:
            end = max(ref.chunk + 1 for ref in planned) * coord.kinds[planned[0].group].block_size
            ranges.append(SaveRange(state, end, end, len(planned), moves_marks=False))
            items.extend(planned)
            state.in_flight += 1

    def _save_chunks(self, state: _RequestState, start: int, end: int) -> list[ChunkRef]:
        items: list[ChunkRef] = []
        coord = self.coordinator
        for group, (kind, placement) in enumerate(zip(coord.kinds, self.placements)):
            if isinstance(kind, StateSpace):
                continue  # states are saved only from the blocks the engine hands over (`_plan_states`)
            hashes = chunk_hashes(state.hashes, coord.hash_block_size, kind.block_size)
            table = state.blocks[group]
            mask = coord.store_mask(group, end, start, state.num_prompt_tokens)
            first_live = kind.first_live_chunk(state.computed_before)
            chunks = chunk_range(
                end,
                len(hashes),
                start,
                mask,
                block_size=kind.block_size,
                put_step=placement.put_step,
                put_step_rank=placement.put_step_rank,
            )
            for chunk in chunks:
                block_id = table[chunk] if chunk < len(table) else NULL_BLOCK_ID
                if block_id == NULL_BLOCK_ID or chunk < first_live:
                    self.stats.chunks_unreadable += 1
                    continue
                parent = hashes[chunk - 1] if chunk else b""
                items.append(ChunkRef(group, chunk, block_id, placement.keys.key(hashes[chunk]), parent))
        return items

    def end_ranges(self, ranges: Iterable[SaveRange], results: Sequence[Status]) -> None:
        """A batch's outcome (`results`: one per item, in range order) moves its requests' marks."""
        offset = 0
        for part in ranges:
            state: _RequestState = part.state
            # a chunk the pool's admission declined is settled as one stored (never retried), and is not
            # in the pool: the index hears only of stored chunks
            ok = all(status in (Status.OK, Status.DECLINED) for status in results[offset : offset + part.count])
            offset += part.count
            state.in_flight -= 1
            if not state.dropped and part.moves_marks:
                if ok and state.stored_mark >= part.start:
                    state.stored_mark = max(state.stored_mark, part.end)
                elif not ok:
                    # re-plan from what is really stored: the next save of the request retries the range
                    state.planned_mark = min(state.planned_mark, state.stored_mark)
            if state.finished and not state.in_flight:
                self._retire(state)

    # ---- loads --------------------------------------------------------------------------------

    def load_chunks(
        self, req_id: str, start_tokens: int, hit_tokens: int
    ) -> tuple[list[ChunkRef], list[ChunkRef]] | None:
        """The chunks a hit of `hit_tokens` loads from `start_tokens` on: those with a key, and those
        whose hash has not arrived (they cannot be loaded and fail). None: the request has no state."""
        state = self._states.get(req_id)
        if state is None:
            return None
        coord = self.coordinator
        items: list[ChunkRef] = []
        missing: list[ChunkRef] = []
        masks = coord.load_masks(hit_tokens)
        for group, (kind, placement) in enumerate(zip(coord.kinds, self.placements)):
            hashes = chunk_hashes(state.hashes, coord.hash_block_size, kind.block_size)
            table = state.blocks[group]
            mask = masks[group]
            if mask is not None:
                mask = mask[-(-start_tokens // kind.block_size) :]
            for chunk in chunk_range(
                hit_tokens, hit_tokens // kind.block_size, start_tokens, mask, block_size=kind.block_size
            ):
                block_id = table[chunk] if chunk < len(table) else NULL_BLOCK_ID
                if block_id == NULL_BLOCK_ID:
                    continue
                if chunk >= len(hashes):  # no hash, no key: only blocks this load was to fill fail
                    missing.append(ChunkRef(group, chunk, block_id, ""))
                    continue
                items.append(ChunkRef(group, chunk, block_id, placement.keys.key(hashes[chunk])))
        return items, missing

    def load_failed(self, req_id: str, failed: Sequence[ChunkRef]) -> None:
        """The chunks from the first of `failed` (not empty) on are not in the pool: save them again."""
        kinds = self.coordinator.kinds
        first = self.coordinator.align(min(item.chunk * kinds[item.group].block_size for item in failed))
        state = self._states.get(req_id)
        if state is not None:
            state.stored_mark = min(state.stored_mark, first)
            state.planned_mark = min(state.planned_mark, first)

    # ---- lifecycle ----------------------------------------------------------------------------

    def preempt(self, req_ids: Iterable[str]) -> None:
        """Forget the requests (the engine frees their blocks now; captured saves still land)."""
        for req_id in req_ids:
            state = self._states.pop(req_id, None)
            if state is not None:
                state.dropped = True

    def finish(self, req_ids: Iterable[str]) -> None:
        """The requests are done; their state goes once their in-flight ranges end."""
        for req_id in req_ids:
            state = self._states.get(req_id)
            if state is not None:
                state.finished = True
                if not state.in_flight:
                    self._retire(state)

    def _retire(self, state: _RequestState) -> None:
        if self._states.get(state.req_id) is state:
            del self._states[state.req_id]
        state.dropped = True

    def freeze_all(self) -> None:
        """A pool reset: every live request computed its KV before it, so none saves again."""
        for state in self._states.values():
            state.frozen = True

    def active_requests(self) -> int:
        return len(self._states)

    def stored_tokens(self, req_id: str) -> int:
        state = self._states.get(req_id)
        return state.stored_mark if state else 0
