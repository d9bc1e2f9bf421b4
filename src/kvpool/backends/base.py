"""The backend protocol every pool implements: exists / put / get_into / remove / stats / health.

A value is a sequence of buffer pieces (numpy uint8 arrays, memoryviews, anything with the buffer
protocol). A put stores the concatenation of its pieces; a get scatters the stored bytes into the
pieces, whose sizes must add up to the stored size. A batch of values can also come as `Rows`: the
same rows of several 2-D byte arrays, which is how an engine's paged KV cache holds a chunk.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

Buffer = Any  # anything exposing the buffer protocol (numpy array, memoryview, bytearray)
Value = Sequence[Buffer]


@dataclass(frozen=True, eq=False)
class Rows:
    """A batch of values laid out as rows of 2-D byte arrays: value k is row `ids[k]` of every array, in
    array order, back to back (block `ids[k]` of every layer of a paged KV cache). Backends move such a
    batch with a few numpy operations per array instead of a Python step per piece.

    >>> Rows((k_cache, v_cache), np.array([7, 3]))  # two values: block 7 of K then V, block 3 of K then V
    """

    arrays: tuple[np.ndarray, ...]
    ids: np.ndarray = field(repr=False)

    def __post_init__(self) -> None:
        arrays = self.arrays
        if not arrays:
            raise ValueError("Rows needs at least one array")
        for index, array in enumerate(arrays):
            if not (
                isinstance(array, np.ndarray)
                and (array.dtype is _U8 or array.dtype == np.uint8)  # the identity test: no dtype coercion
                and array.ndim == 2
                and (array.shape[1] < 2 or array.strides[1] == 1)
            ):
                shape = getattr(array, "shape", None)
                raise TypeError(
                    f"Rows array {index} (type {type(array).__name__}, shape {shape}): "
                    "expected a 2-D uint8 numpy array whose rows are contiguous"
                )
        ids = self.ids
        if not (isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype.kind in "iu"):
            raise TypeError(f"Rows ids (type {type(ids).__name__}): expected a 1-D integer numpy array")
        if len(ids):
            rows = min(array.shape[0] for array in arrays)
            lo, hi = _bounds(ids)
            if lo < 0 or hi >= rows:
                raise ValueError(f"Rows ids {ids.tolist()}: every id must be in 0..{rows - 1}")

    @classmethod
    def checked(cls, arrays: tuple[np.ndarray, ...], ids: np.ndarray) -> Rows:
        """Rows whose arrays and ids the caller has checked already (a layout's own views, ids it
        bounds-checked against them): the checks of `__post_init__` are not repeated."""
        rows = object.__new__(cls)
        object.__setattr__(rows, "arrays", arrays)
        object.__setattr__(rows, "ids", ids)
        return rows

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def row_bytes(self) -> list[int]:
        return [array.shape[1] for array in self.arrays]

    def value(self, index: int) -> list[np.ndarray]:
        row = self.ids[index]
        return [array[row] for array in self.arrays]

    def values(self) -> list[list[np.ndarray]]:
        """One list of pieces per value, for code that takes the general form."""
        return [[array[row] for array in self.arrays] for row in self.ids.tolist()]


Values = Sequence[Value] | Rows

_U8 = np.dtype(np.uint8)
SMALL_IDS = 64  # below this many ids, Python's min / max beat numpy's reductions (~1.5 µs each)


def _bounds(ids: np.ndarray) -> tuple[int, int]:
    """(min, max) of a non-empty 1-D integer array: a decode step's batch holds a chunk or two, where a
    numpy reduction's fixed cost is most of a save."""
    if len(ids) <= SMALL_IDS:
        values = ids.tolist()
        return min(values), max(values)
    return int(ids.min()), int(ids.max())


class Status(enum.IntEnum):
    """Outcome of one key in a batch call."""

    OK = 0
    FULL = 1  # no room: the put was not stored; drives the pressure gate
    MISSING = 2  # the key is not in the pool
    SIZE_MISMATCH = 3  # the destination pieces do not add up to the stored size
    UNAVAILABLE = 4  # the backend is down or unhealthy; counts as a miss
    ERROR = 5  # any other failure
    CORRUPT = 6  # the bytes arrived but fail their seal (see integrity.py)
    # the pool's admission chose not to store it (core/policy/): not a failure, never retried, no pressure;
    # not stored, so never reported stored
    DECLINED = 7


@dataclass
class BackendStats:
    name: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    keys: int = 0
    puts: int = 0
    put_bytes: int = 0
    put_failures: int = 0
    gets: int = 0
    get_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    admissions_declined: int = 0  # the embedded pool: chunks its policy chose not to store (core/policy/)
    # the embedded pool's disk tier (tiered.py); 0 without one
    disk_capacity_bytes: int = 0
    disk_used_bytes: int = 0
    disk_keys: int = 0
    disk_hits: int = 0  # chunks read from disk because DRAM no longer held them
    disk_write_errors: int = 0
    disk_writes_skipped: int = 0  # the write-behind queue was full
    disk_corrupt: int = 0  # files that failed their checks (removed)
    disk_late_reads: int = 0
    retired_bytes: int = 0  # the embedded pool: chunks withdrawn, kept readable until acknowledged (memory.py)


@runtime_checkable
class Backend(Protocol):
    name: str

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key; a backend fault answers False (a miss), never raises."""
        ...

    def put(self, keys: Sequence[str], values: Values) -> list[Status]:
        """Store each value (the concatenation of its pieces). An existing key is left as is (OK)."""
        ...

    def get_into(self, keys: Sequence[str], dests: Values) -> list[Status]:
        """Copy each stored value into its destination pieces. Nothing writes `dests` once this returns
        (a read given up on lands in memory of its own): the loader reuses its buffers on that."""
        ...

    def remove(self, keys: Sequence[str]) -> int:
        """Remove the keys; returns how many were removed."""
        ...

    def clear(self) -> int:
        """Remove every key; returns how many were removed."""
        ...

    def stats(self) -> BackendStats: ...

    def healthy(self) -> bool:
        """Cheap check (no I/O): False means skip the backend for now."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class KeepsLinks(Protocol):
    """A pool that keeps each chunk's chain link beside it (the embedded pool's disk tier): what outlives
    the engine can then be announced as chains after a restart. Other pools have `put` only."""

    def put_linked(self, keys: Sequence[str], values: Values, parents: Sequence[bytes | None]) -> list[Status]:
        """`put`, with each chunk's parent hash (b"": the first chunk of its chain; None: not known)."""
        ...
