"""The engine oracle (`test_engine_oracle.EngineOracle`) on a hybrid attention + state-space model, with
vLLM's Mamba "align" mode modelled: a state group's bytes are a function of the token prefix at the
moment they were written, and the engine hands kvpool its boundary states only through
`boundary_state_offloads`.

What the fake engine does for the state group, as vLLM 0.32 does (`MambaManager` in align mode, the model
runner's `preprocess_mamba` copy):
- a request's state table is position-indexed but holds a real block only where a state lives: a step
  computing [c, end) allocates the block at index ceil(end / B) - 1 (nulls below it), reads the state at
  exactly c from block ceil(c / B) - 1 (the copy into the new block), and writes the state at end there;
  decode steps rewrite that block in place until the sequence crosses the next boundary;
- once a state is superseded its block is freed (nulled in the table) and reused by other requests;
- a step whose end is a block boundary hands over `(group, block, end)`: that block holds the state at
  exactly `end` until the step ends, and is not pinned for kvpool (the worker copies it out in the step).

So a state stored from the wrong moment (read after an in-place rewrite, after the block's reuse, or
positionally from the table), or keyed at the wrong boundary, is a chunk whose bytes its key does not name
(`_check_pool`), and a state loaded into the wrong block, or a failed one computed on, taints an output.
"""

from __future__ import annotations

import numpy as np
from hypothesis import event

from kvpool.core.masks import FullAttention, StateSpace
from test_engine_oracle import LAYERS, ORACLE_SETTINGS, B, EngineOracle, Req, Run, Step, digest


def _ceil(a: int) -> int:
    return -(-a // B)


class StateOracle(EngineOracle):
    kinds = (FullAttention(B), StateSpace(B))

    def _is_state(self, group: int) -> bool:
        return isinstance(self.kinds[group], StateSpace)

    def allocate(
        self, req: Req, upto: int, skip_below: int = 0, local: tuple[int, ...] | list[int] = ()
    ) -> list[int] | None:
        """As the base engine, except that a state group gets a real block only at the last chunk of
        `upto` (align mode: the state after the step lives there; the ones between are never written)."""
        plan = []
        for g, kind in enumerate(self.kinds):
            have = len(req.tables[g])
            last = _ceil(upto) - 1
            for chunk in range(have, _ceil(upto)):
                if isinstance(kind, StateSpace):
                    plan.append((g, chunk != last))
                else:
                    plan.append((g, kind.frees_blocks and chunk < kind.first_live_chunk(skip_below)))
        if sum(not null for _, null in plan) > len(self.free):
            return None
        new = []
        for g, null in plan:
            block_id = 0 if null else self._take()
            req.tables[g].append(block_id)
            if block_id:
                new.append(block_id)
        return new

    def slide(self, req: Req) -> None:
        """A superseded state block is freed (nulled in the table): only the one holding the state at the
        request's computed tokens stays."""
        live = _ceil(req.computed) - 1
        for g in range(len(self.kinds)):
            if self._is_state(g):
                table = req.tables[g]
                for chunk in range(min(len(table), max(0, live))):
                    if table[chunk]:
                        self._unref(table[chunk])
                        table[chunk] = 0

    def schedule(self, budget: int) -> Step:
        """vLLM's schedule(), then the step's boundary-state hand-offs (`take_boundary_state_offloads`)
        before the metadata is complete: each run ending on a block boundary offers the block that its
        forward writes the boundary's state into."""
        step = super().schedule(budget)
        for run in step.runs:
            end = run.start + run.n
            if end % B or end == 0:
                continue
            offers = [(g, run.tables[g][end // B - 1], end) for g in range(len(self.kinds)) if self._is_state(g)]
            event("a boundary state handed over")
            taken = self.scheduler.stats.states_taken
            self.policy.states(step.meta, run.req.rid, offers, self.hashes(run.req))
            if self.scheduler.stats.states_taken > taken:
                event("a boundary state taken")
        return step

    def _forward(self, run: Run) -> None:
        """The oracle for both kinds: attention reads every block before c; a state group reads the state
        at exactly c and writes the state at the step's end, in place within a block."""
        req, c = run.req, run.start
        end = c + run.n
        for g in range(len(self.kinds)):
            if self._is_state(g):
                if c == 0:
                    continue
                block_id = run.tables[g][_ceil(c) - 1]
                assert block_id, f"{req.rid}: the state at {c} tokens is in a null block"
                for rank in self.ranks:
                    if self.block(rank, g, block_id) != self.expected(rank.index, g, req, _ceil(c) - 1, c):
                        run.tainted = True
                continue
            for chunk in range(_ceil(c)):
                block_id = run.tables[g][chunk]
                assert block_id, f"{req.rid}: group {g} attends to chunk {chunk}, a null block (computed {c})"
                for rank in self.ranks:
                    if self.block(rank, g, block_id) != self.expected(rank.index, g, req, chunk, c):
                        run.tainted = True
        if run.tainted:
            event("a forward read a block holding the wrong bytes")
        for rank in self.ranks:
            for g in range(len(self.kinds)):
                chunks = [_ceil(end) - 1] if self._is_state(g) else list(range(c // B, _ceil(end)))
                for chunk in chunks:
                    block_id = run.tables[g][chunk]
                    values = self.expected(rank.index, g, req, chunk, end)
                    if run.tainted:
                        values = [digest("tainted", rank.index, g, layer, chunk) for layer in range(LAYERS)]
                    for layer, value in enumerate(values):
                        rank.tensors[f"g{g}.l{layer}"][block_id] = np.frombuffer(value, np.uint8)


class StateSpaceOracle(StateOracle):
    pass


TestStateSpace = StateSpaceOracle.TestCase
TestStateSpace.settings = ORACLE_SETTINGS
