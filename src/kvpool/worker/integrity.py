"""Chunk integrity: an 8-byte seal stored after each chunk's bytes and checked when the chunk loads.

A seal is a linear hash of the chunk's bytes read as little-endian 64-bit words w[i]:
`SEAL_BASE + nbytes + sum(w[i] * m[i]) mod 2**64`, with a fixed odd multiplier m[i] per word
position (splitmix64 of i, the same on every host and process). Linear, so it is computed per array
of a `Rows` batch, a few numpy operations per array for the whole batch, and the pieces of a chunk
(one per layer) add up to the seal of their concatenation, whichever way the bytes are split. Odd
multipliers make any change to one covered word change the seal; `SEAL_BASE` makes an all-zero
value with an all-zero seal (memory nobody wrote) fail.

Which words the seal covers is the mode:
- `full`: every word. Detects any corruption, at about the cost of the copy it checks (a hash of
  every byte is memory-bound, like the copy itself);
- `sampled`: one 64-byte line per 4 KiB page of the chunk, and its last line. Detects what goes
  wrong a page at a time: a chunk stored under the wrong key, a page a transfer never wrote, stale or
  zeroed memory, a truncated value, at a few percent of the load's cost; a lone flipped bit outside
  the sampled lines passes.
- `off`: no seal is stored.

A chunk whose seal does not match loads as failed (`Status.CORRUPT`): the engine recomputes it and the
pool drops it, as for any failed load. Never a wrong token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvpool.backends.base import Rows, Status
from kvpool.core.config import Integrity
from kvpool.core.errors import LayoutError

SEAL_BYTES = 8
SEAL_BASE = np.uint64(0x6B7670_6F6F6C_31)  # "kvpool1": the seal of nothing is not zero
SAMPLE_PAGE_BYTES = 4096
SAMPLE_LINE_BYTES = 64
_WORD = np.dtype("<u8")


def _multipliers(positions: np.ndarray) -> np.ndarray:
    """splitmix64 of each word position, made odd."""
    with np.errstate(over="ignore"):
        z = positions.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) | np.uint64(1)


PAGE_WORDS = SAMPLE_PAGE_BYTES // 8
LINE_WORDS = SAMPLE_LINE_BYTES // 8


def sampled_words(payload_words: int) -> np.ndarray:
    """The word positions a sampled seal covers in a value of `payload_words` words: the first line of
    every page and the value's last line."""
    pages = np.arange(0, payload_words, PAGE_WORDS)[:, None] + np.arange(LINE_WORDS)[None, :]
    tail = np.arange(max(0, payload_words - LINE_WORDS), payload_words)
    words = np.union1d(pages.reshape(-1), tail)
    return words[words < payload_words]


class _Part:
    """How one array's rows add to the seals: the words of the value it holds that the seal covers."""

    __slots__ = ("columns", "lines", "multipliers", "start", "words")

    def __init__(self, first_word: int, words: int, covered: np.ndarray | None) -> None:
        self.words = words
        self.start = self.lines = 0
        self.columns: np.ndarray | None = None
        if covered is None:  # every word
            positions = np.arange(first_word, first_word + words)
        else:
            positions = covered[(covered >= first_word) & (covered < first_word + words)]
            local = positions - first_word
            if len(local):
                # the common case, in one strided gather: whole lines one page apart
                start, lines = int(local[0]), len(local) // LINE_WORDS
                regular = (start + PAGE_WORDS * np.arange(lines)[:, None] + np.arange(LINE_WORDS)[None, :]).reshape(-1)
                if len(local) == lines * LINE_WORDS and np.array_equal(regular, local):
                    self.start, self.lines = start, lines
                else:
                    self.columns = local
        self.multipliers = _multipliers(positions)

    def add(self, words: np.ndarray, ids: np.ndarray, seals: np.ndarray) -> None:
        """`words`: the array's rows as 64-bit words."""
        if not len(self.multipliers):
            return
        if self.lines:
            lines = as_strided(
                words[:, self.start :],
                shape=(words.shape[0], self.lines, LINE_WORDS),
                strides=(words.strides[0], SAMPLE_PAGE_BYTES, 8),
            )
            sample = lines[ids].reshape(len(ids), -1)
        elif self.columns is not None:
            sample = words[ids[:, None], self.columns]
        else:
            sample = words[ids, : self.words]
        with np.errstate(over="ignore"):
            seals += sample @ self.multipliers


class Sealer:
    """Seals for the values of one KV cache group: `payload_bytes` each, however arrays split them."""

    def __init__(self, payload_bytes: int, mode: Integrity) -> None:
        if mode is not Integrity.OFF and payload_bytes % 8:
            raise LayoutError(f"a chunk of {payload_bytes} bytes cannot be sealed: seals cover whole 64-bit words")
        self.mode = mode
        self.payload = payload_bytes
        words = payload_bytes // 8
        self._covered = sampled_words(words) if mode is Integrity.SAMPLED else None
        self._parts: dict[tuple[int, ...], list[_Part | None]] = {}

    @property
    def on(self) -> bool:
        return self.mode is not Integrity.OFF

    @property
    def stored_bytes(self) -> int:
        """What the pool holds per chunk: its bytes, then its seal."""
        return self.payload + (SEAL_BYTES if self.on else 0)

    def seals(self, rows: Rows) -> np.ndarray:
        """The seal of each value of `rows`, over its first `payload` bytes (wherever the arrays split it)."""
        widths = tuple(rows.row_bytes)
        parts = self._parts.get(widths)
        if parts is None:
            if any(width % 8 for width in widths):
                raise LayoutError(f"array widths {list(widths)}: seals need whole 64-bit words (multiples of 8 bytes)")
            parts, offset = [], 0
            for width in widths:
                inside = min(width, self.payload - offset)  # the last array may end with the seal
                parts.append(_Part(offset // 8, inside // 8, self._covered) if inside > 0 else None)
                offset += width
            self._parts[widths] = parts
        seals = np.full(len(rows), SEAL_BASE + np.uint64(self.payload), dtype=np.uint64)
        for part, array in zip(parts, rows.arrays):
            if part is not None:
                part.add(array.view(_WORD), rows.ids, seals)
        return seals

    def seal_column(self, rows: Rows) -> np.ndarray:
        """The seals of `rows` as an (n, 8) byte array: the column a put stores after each value."""
        return self.seals(rows).astype(_WORD, copy=False).view(np.uint8).reshape(-1, SEAL_BYTES)

    def verify(self, rows: Rows, statuses: Sequence[Status]) -> list[Status]:
        """`statuses` with each OK value whose stored seal (its last 8 bytes) is wrong made CORRUPT."""
        result = list(statuses)
        ok = [index for index, status in enumerate(result) if status is Status.OK]
        if not self.on or not ok:
            return result
        arrived = Rows(rows.arrays, rows.ids[ok])
        last = rows.arrays[-1]
        stored = np.ascontiguousarray(last[arrived.ids, last.shape[1] - SEAL_BYTES :]).view(_WORD).reshape(-1)
        for index, good in zip(ok, (self.seals(arrived) == stored).tolist()):
            if not good:
                result[index] = Status.CORRUPT
        return result
