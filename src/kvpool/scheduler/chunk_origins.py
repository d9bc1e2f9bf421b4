"""Where a stored chunk's tokens came from: what its KV event says beside its hash.

A KV-aware router (Dynamo's KV router, llm-d's KV-cache manager) hashes a prompt's tokens itself and
attaches each announced block under its parent, so an event needs the chunk's token ids and the extra
keys vLLM hashed with them (LoRA name, multimodal items, cache salt), not only the hash. The pool knows
a chunk only by its key; the request that computed it knows its tokens. So, while events are published,
the scheduler records each chunk a step completes, from the request that computes it, and the chunk's
stored event takes that record when the workers report the chunk held.

Invariants: a record names exactly the tokens its chunk hash covers (the chunk `[c·B, (c+1)·B)` of its
group, keyed by the hash that ends there); a record is taken once, by its chunk's stored event. The map
is bounded (`limit` records, oldest dropped first): a chunk whose record is gone (stored long after it
was computed, or by an earlier engine) is announced without tokens, never with another chunk's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.core.masks import MaskCoordinator

DEFAULT_LIMIT = 1 << 16  # records: about a second of a busy engine's new chunks, ~1 KiB each

# (start, end) token range -> the extra keys vLLM hashed the block with (None: none)
ExtraKeys = Callable[[int, int], tuple[object, ...] | None]


@dataclass(frozen=True)
class ChunkOrigin:
    token_ids: tuple[int, ...]
    extra_keys: tuple[object, ...] | None


class ChunkOrigins:
    """Per (group, chunk hash): the tokens and extra keys of the chunk, recorded when a step completes it."""

    def __init__(self, coordinator: MaskCoordinator, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"chunk origins limit {limit}: expected at least 1 record")
        self.coordinator = coordinator
        self.limit = limit
        self._records: OrderedDict[tuple[int, bytes], ChunkOrigin] = OrderedDict()

    def record(
        self,
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        computed_before: int,
        new_tokens: int,
        extra_keys: ExtraKeys | None = None,
    ) -> None:
        """A step computes tokens `[computed_before, computed_before + new_tokens)` of a request whose
        tokens are `token_ids`: record every group's chunk that ends in that range and has a hash."""
        coord = self.coordinator
        end = min(computed_before + new_tokens, len(token_ids), len(block_hashes) * coord.hash_block_size)
        if end <= computed_before:
            return
        records, per_hash = self._records, coord.hash_block_size
        for group, kind in enumerate(coord.kinds):
            size = kind.block_size
            for chunk in range(computed_before // size, end // size):
                start = chunk * size
                origin = ChunkOrigin(
                    tuple(token_ids[start : start + size]),
                    extra_keys(start, start + size) if extra_keys is not None else None,
                )
                key = (group, block_hashes[(start + size) // per_hash - 1])
                records[key] = origin
                records.move_to_end(key)
        while len(records) > self.limit:
            records.popitem(last=False)

    def take(self, group: int, chunk_hash: bytes) -> ChunkOrigin | None:
        return self._records.pop((group, chunk_hash), None)

    def clear(self) -> None:
        self._records.clear()

    def __len__(self) -> int:
        return len(self._records)
