"""Pool keys: chained block hashes become chunk hashes at a group's block size, and a key is a
prebuilt namespace prefix plus the chunk hash in hex. The prefix carries a layout fingerprint, so
two engines whose KV bytes differ never share a key."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import overload

from kvpool.core.errors import LayoutError

KEY_SCHEMA = "kvp1"


@dataclass(frozen=True)
class LayoutFingerprint:
    """Everything that decides the bytes of one chunk. Any difference gives a different key prefix."""

    model: str
    dtype: str
    block_size: int
    kv_layout: str  # tensor layout and packing, e.g. "cpu:LBHNC:amx" (CPU packs K/V per ISA)
    chunk_bytes: int = 0
    tp_shard: int = 0  # tp_rank // ranks holding identical bytes
    pp_rank: int = 0
    pp_size: int = 1  # a pipeline split decides which layers a rank's chunk holds
    group_id: int = 0
    attention: str = ""  # attention kind of the group, e.g. "full" or "sliding_window:64"
    hash_algo: str = ""  # the engine's block-hash function and seed policy
    weights: str = ""  # digest of what else decides the KV bytes: revision, quantization, model config
    tenant: str = ""  # optional salt: tenants never share chunks
    integrity: str = ""  # what a chunk's seal covers ("" and "off": no seal is stored)

    def digest(self) -> str:
        text = "|".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def key_prefix(self) -> str:
        model = re.sub(r"[^A-Za-z0-9._-]+", "_", self.model.rstrip("/").rsplit("/", 1)[-1]) or "model"
        return f"{KEY_SCHEMA}/{model}/{self.digest()}/s{self.tp_shard}/p{self.pp_rank}/g{self.group_id}/"


class KeySpace:
    """Builds key strings for one group: one string per chunk, no per-key objects.

    `retag` renames the space in place when the engine's weights change while it runs (an in-place
    update): every holder of the space builds the new keys from then on, and what was stored under the old
    ones is never found again."""

    __slots__ = ("base", "fingerprint", "prefix")

    def __init__(self, fingerprint: LayoutFingerprint) -> None:
        self.base = fingerprint  # as the engine started
        self.fingerprint = fingerprint
        self.prefix = fingerprint.key_prefix()

    def retag(self, weights_tag: str) -> None:
        """Name the weights loaded since the engine started ("": the ones it started with)."""
        weights = f"{self.base.weights}@{weights_tag}" if weights_tag else self.base.weights
        self.fingerprint = replace(self.base, weights=weights)
        self.prefix = self.fingerprint.key_prefix()

    def key(self, chunk_hash: bytes) -> str:
        return self.prefix + chunk_hash.hex()

    def keys(self, chunk_hashes: Iterable[bytes]) -> list[str]:
        prefix = self.prefix
        return [prefix + h.hex() for h in chunk_hashes]


class ChunkHashes(Sequence[bytes]):
    """Chunk hashes at `block_size` over the engine's block hashes at `hash_block_size`, read lazily.

    Engine hashes are chained (hash i covers the whole prefix up to block i), so the last
    constituent hash of a chunk names the chunk and everything before it."""

    __slots__ = ("_hashes", "_ratio")

    def __init__(self, block_hashes: Sequence[bytes], hash_block_size: int, block_size: int) -> None:
        if hash_block_size <= 0 or block_size <= 0 or block_size % hash_block_size:
            raise LayoutError(
                f"block_size={block_size} must be a positive multiple of hash_block_size={hash_block_size}"
            )
        self._hashes = block_hashes
        self._ratio = block_size // hash_block_size

    def __len__(self) -> int:
        return len(self._hashes) // self._ratio

    @overload
    def __getitem__(self, index: int) -> bytes: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[bytes]: ...
    def __getitem__(self, index: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"chunk {index} out of range for {len(self)} chunks")
        return self._hashes[(index + 1) * self._ratio - 1]


def chunk_hashes(block_hashes: Sequence[bytes], hash_block_size: int, block_size: int) -> Sequence[bytes]:
    if block_size == hash_block_size:
        return block_hashes
    return ChunkHashes(block_hashes, hash_block_size, block_size)
