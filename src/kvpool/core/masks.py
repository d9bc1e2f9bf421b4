"""Which chunks a future prefix hit can reach, one class per attention kind.

A prefix hit ends at a *boundary*: a token count aligned to the LCM of the groups' block sizes.
Each kind says which of its chunks a hit at a boundary needs (`required`); a chunk is worth storing
when some reachable boundary needs it. Retention policies narrow the reachable boundaries.
Every bit depends only on the chunk's absolute position, so masks are prefix-stable and the mask
of a suffix equals the tail of the full mask: incremental saves store what a one-shot save would.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvpool.core.errors import ConfigError, LayoutError

Mask = list[bool] | None  # None: every chunk in the range
Present = Callable[[int], bool]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Boundaries:
    """The token counts at which a future hit may end.

    `retention_interval`: None → every LCM multiple; 0 → only the replay boundary (where this
    request's own prompt would hit again); > 0 → every multiple of the interval plus the replay boundary.
    """

    lcm: int
    retention_interval: int | None = None
    replay: int = 0

    def any_in(self, lo: int, hi: int) -> bool:
        """Is there a reachable boundary L with lo <= L <= hi (L > 0)?"""
        lo = max(lo, 1)
        if lo > hi:
            return False
        if self.retention_interval is None:
            return ceil_div(lo, self.lcm) * self.lcm <= hi
        if self.replay and lo <= self.replay <= hi:
            return True
        step = self.retention_interval
        return step > 0 and ceil_div(lo, step) * step <= hi


class AttentionKind(ABC):
    """One attention kind's reachability rules, at its own block size."""

    name: ClassVar[str]
    frees_blocks: ClassVar[bool] = False  # the engine may free its out-of-range blocks mid-request

    def __init__(self, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise LayoutError(f"block_size={block_size!r}: expected a positive integer")
        self.block_size = block_size

    @abstractmethod
    def required(self, boundary: int) -> range:
        """Chunks a hit ending at `boundary` tokens needs."""

    @abstractmethod
    def stores(self, chunk: int, boundaries: Boundaries) -> bool:
        """Is the chunk needed by some reachable boundary?"""

    def dense(self, boundaries: Boundaries) -> bool:
        """True when every chunk is stored (lets masks be None and skip per-chunk work)."""
        return False

    def first_live_chunk(self, num_computed_tokens: int) -> int:
        """Chunks below this may already be freed by the engine; never read them."""
        return 0

    def describe(self) -> str:
        return self.name

    def longest_hit(self, max_tokens: int, lcm: int, present: Present) -> int:
        """Largest boundary <= max_tokens (a multiple of lcm) whose required chunks are all present."""
        boundary = max_tokens // lcm * lcm
        while boundary > 0:
            if all(present(chunk) for chunk in self.required(boundary)):
                return boundary
            boundary -= lcm
        return 0

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v}' for k, v in vars(self).items())})"


class FullAttention(AttentionKind):
    name = "full"

    def required(self, boundary: int) -> range:
        return range(boundary // self.block_size)

    def stores(self, chunk: int, boundaries: Boundaries) -> bool:
        return True

    def dense(self, boundaries: Boundaries) -> bool:
        return True

    def longest_hit(self, max_tokens: int, lcm: int, present: Present) -> int:
        # presence of a usable prefix is monotone: stop at the first missing chunk
        limit = max_tokens // self.block_size
        chunk = 0
        while chunk < limit and present(chunk):
            chunk += 1
        return chunk * self.block_size // lcm * lcm


class SlidingWindow(AttentionKind):
    """A hit at L needs the blocks holding the last `window - 1 + extra_retained` tokens before L.

    `extra_retained` tokens below the window are never attended, but the engine keeps their blocks
    (vLLM: multi-token prediction re-prefills them), so a hit must fill them like the window's own:
    a block the engine holds and kvpool did not load would hold another request's bytes."""

    name = "sliding_window"
    frees_blocks = True

    def __init__(self, block_size: int, window: int, *, extra_retained: int = 0) -> None:
        super().__init__(block_size)
        if not isinstance(window, int) or window <= 0:
            raise LayoutError(f"sliding window={window!r}: expected a positive number of tokens")
        if not isinstance(extra_retained, int) or extra_retained < 0:
            raise LayoutError(f"extra_retained_tokens={extra_retained!r}: expected a token count >= 0")
        self.window = window
        self.extra_retained = extra_retained

    @property
    def retained_tokens(self) -> int:
        """Tokens before the next position whose blocks the engine keeps."""
        return self.window - 1 + self.extra_retained

    @property
    def tail_chunks(self) -> int:
        return ceil_div(self.retained_tokens, self.block_size)

    def required(self, boundary: int) -> range:
        end = boundary // self.block_size
        return range(max(0, end - self.tail_chunks), end)

    def stores(self, chunk: int, boundaries: Boundaries) -> bool:
        b = self.block_size
        return boundaries.any_in((chunk + 1) * b, (chunk + self.tail_chunks) * b)

    def dense(self, boundaries: Boundaries) -> bool:
        return boundaries.retention_interval is None and self.tail_chunks * self.block_size >= boundaries.lcm

    def first_live_chunk(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.retained_tokens) // self.block_size

    def describe(self) -> str:
        extra = f"+{self.extra_retained}" if self.extra_retained else ""
        return f"{self.name}:{self.window}{extra}"


class ChunkedLocal(AttentionKind):
    """Attention within fixed local chunks: a hit at L needs the blocks of L's local chunk before L."""

    name = "chunked_local"
    frees_blocks = True

    def __init__(self, block_size: int, attention_chunk_size: int) -> None:
        super().__init__(block_size)
        if not isinstance(attention_chunk_size, int) or attention_chunk_size <= 0 or attention_chunk_size % block_size:
            raise LayoutError(
                f"attention_chunk_size={attention_chunk_size!r}: "
                f"expected a positive multiple of block_size={block_size}"
            )
        self.attention_chunk_size = attention_chunk_size

    def required(self, boundary: int) -> range:
        local_start = boundary // self.attention_chunk_size * self.attention_chunk_size
        return range(local_start // self.block_size, boundary // self.block_size)

    def stores(self, chunk: int, boundaries: Boundaries) -> bool:
        b, size = self.block_size, self.attention_chunk_size
        local_end = (chunk * b // size + 1) * size
        return boundaries.any_in((chunk + 1) * b, local_end - 1)

    # never dense: a hit needs no block of the local chunk it ends on the edge of, so the last block of
    # every local chunk is unreachable (storing it, and asking the pool for it, is pure waste)

    def first_live_chunk(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size // self.block_size

    def describe(self) -> str:
        return f"{self.name}:{self.attention_chunk_size}"


class StateSpace(AttentionKind):
    """Mamba-like recurrent state: a hit at L needs only the state block ending at L."""

    name = "state_space"
    frees_blocks = True

    def required(self, boundary: int) -> range:
        end = boundary // self.block_size
        return range(max(0, end - 1), end)

    def stores(self, chunk: int, boundaries: Boundaries) -> bool:
        end = (chunk + 1) * self.block_size
        return end % boundaries.lcm == 0 and boundaries.any_in(end, end)

    def first_live_chunk(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens // self.block_size - 1)


class MaskCoordinator:
    """The groups of one model together: LCM alignment, per-group masks, the longest common hit."""

    def __init__(
        self,
        kinds: Sequence[AttentionKind],
        *,
        retention_interval: int | None = None,
        hash_block_size: int | None = None,
    ) -> None:
        if not kinds:
            raise LayoutError("a model needs at least one KV cache group")
        self.kinds = list(kinds)
        self.lcm = math.lcm(*(kind.block_size for kind in kinds))
        self.hash_block_size = hash_block_size or math.gcd(*(kind.block_size for kind in kinds))
        for group, kind in enumerate(kinds):
            if kind.block_size % self.hash_block_size:
                raise LayoutError(
                    f"group {group} block_size={kind.block_size} is not a multiple of "
                    f"hash_block_size={self.hash_block_size}"
                )
        if retention_interval is not None and (
            not isinstance(retention_interval, int) or retention_interval < 0 or retention_interval % self.lcm
        ):
            raise ConfigError(
                "retention_interval",
                retention_interval,
                f"None, 0, or a positive multiple of the LCM block size {self.lcm}",
            )
        self.retention_interval = retention_interval
        self._dense_boundaries = Boundaries(self.lcm)
        # store masks without a retention policy: the same for every request, so whether a group's is
        # dense is known once
        self._always_dense = [retention_interval is None and kind.dense(self._dense_boundaries) for kind in self.kinds]

    def align(self, tokens: int) -> int:
        return max(0, tokens) // self.lcm * self.lcm

    @property
    def resumes_at_failed_chunk(self) -> bool:
        """Can the engine recompute a failed load from its first failed chunk on, keeping the chunks
        before it? Only for one group that keeps every block: resuming inside a sliding window (or a
        local chunk, or after a state block) needs blocks below the hit that were never loaded. Any
        other model recomputes the whole request."""
        return len(self.kinds) == 1 and not self.kinds[0].frees_blocks

    def boundaries(self, num_prompt_tokens: int) -> Boundaries:
        if self.retention_interval is None:
            return self._dense_boundaries
        replay = max(0, num_prompt_tokens - 1) // self.lcm * self.lcm
        return Boundaries(self.lcm, self.retention_interval, replay)

    def store_mask(self, group: int, token_len: int, start_token: int, num_prompt_tokens: int) -> Mask:
        """Bits for chunks ceil(start/B) .. ceil(token_len/B) - 1 of one group (relative to the start chunk)."""
        if self._always_dense[group]:
            return None
        kind = self.kinds[group]
        boundaries = self.boundaries(num_prompt_tokens)
        if kind.dense(boundaries):
            return None
        b = kind.block_size
        stores = kind.stores
        return [stores(chunk, boundaries) for chunk in range(ceil_div(start_token, b), ceil_div(token_len, b))]

    def store_masks(self, token_len: int, start_token: int, num_prompt_tokens: int) -> list[Mask]:
        return [self.store_mask(g, token_len, start_token, num_prompt_tokens) for g in range(len(self.kinds))]

    def lookup_masks(self, aligned_len: int) -> list[Mask]:
        """Chunks worth asking the pool about: those some dense boundary could need."""
        return [self._reachable_dense(g, aligned_len) for g in range(len(self.kinds))]

    def load_masks(self, hit_tokens: int) -> list[Mask]:
        """Chunks to load for a hit of `hit_tokens` (a boundary): exactly the required ones."""
        masks: list[Mask] = []
        for kind in self.kinds:
            need = kind.required(hit_tokens)
            count = hit_tokens // kind.block_size
            if len(need) == count:
                masks.append(None)
            else:
                masks.append([need.start <= chunk < need.stop for chunk in range(count)])
        return masks

    def longest_hit(self, max_tokens: int, present: Sequence[Present]) -> int:
        """The longest boundary <= max_tokens at which every group has what it needs.

        Hybrid models iterate to a fixed point: a shorter hit for one group may need other
        chunks of another group (sliding windows move with the boundary)."""
        if len(present) != len(self.kinds):
            raise LayoutError(f"longest_hit got {len(present)} presence maps for {len(self.kinds)} groups")
        hit = self.align(max_tokens)
        while hit > 0:
            lowest = min(kind.longest_hit(hit, self.lcm, has) for kind, has in zip(self.kinds, present))
            if lowest == hit:
                return hit
            hit = lowest
        return 0

    def _reachable_dense(self, group: int, aligned_len: int) -> Mask:
        kind = self.kinds[group]
        if kind.dense(self._dense_boundaries):
            return None
        return [kind.stores(chunk, self._dense_boundaries) for chunk in range(aligned_len // kind.block_size)]
