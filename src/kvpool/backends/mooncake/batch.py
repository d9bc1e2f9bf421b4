"""One call's values, split by the route each takes to Mooncake, and the staging area small pieces
are packed into.

Invariants: every buffer is checked (sizes, writability) when the batch is built, before any native
call, so an unusable buffer raises before the pool is touched; each valid value is on exactly one
route, invalid ones (empty key or value) on none; a value whose transfer stays in this process is never
staged; a staged value fits its staging area whole, and a round of them (`_pack`) never overfills it.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from kvpool.backends.base import Rows, Value, Values
from kvpool.core.buffers import as_u8

_T = TypeVar("_T")

# Over TCP each buffer piece costs ~25 µs (under load; less on an idle host), so values made of small
# pieces are staged: one extra local copy, one piece per key on the wire. Measured on loopback, 4-piece
# values vs Mooncake's multi-buffer calls: 16-32 KiB pieces move 1.2-1.4x faster staged, 64 KiB pieces
# 1.1x faster unstaged. Local transfers (own segment) are never staged (see _Batch).
SMALL_PIECE_BYTES = 64 << 10
# Staging Rows: a fancy-index gather costs one numpy call per layer but passes over the bytes twice;
# copying row by row costs ~0.4 µs of Python a piece and one pass. Measured crossover: ~4 KiB rows.
FANCY_GATHER_BYTES = 4 << 10


class _Route(enum.Enum):
    SINGLE = "single"  # one piece: moved in place with batch_put_from / batch_get_into
    STAGED = "staged"  # small pieces: packed into the staging buffer, one piece per key
    MULTI = "multi"  # large pieces: batch_*_multi_buffers, one transfer per piece


_from_buffer = ctypes.c_char.from_buffer
_addressof = ctypes.addressof
_FAST_PATH_ERRORS = (TypeError, ValueError, AttributeError, BufferError)


class _Batch:
    """Every value of one call as the byte sizes of its pieces, split by route, with what each route
    needs: the pieces of staged values (packed into or scattered from the staging area by `pack` and
    `unpack`) and the addresses of the others (Mooncake reads or writes those in place; the caller's
    values keep that memory alive for the call). All are taken before any native call, so an unusable
    buffer raises before the pool is touched.

    Costs: a `Rows` batch takes a few Python steps per array and per value, not per piece. Lists of
    pieces take ~0.3 µs a piece on the common case (contiguous numpy arrays), and their staging copies
    go view to view (a memoryview slice assignment is a plain memcpy with ~0.15 µs of overhead, a fifth
    of a ctypes.memmove call); anything else (torch tensors, bytes, read-only, non-contiguous or empty
    pieces) takes the general path (as_u8).

    `local`: keys whose transfer stays in this process (Mooncake's memcpy path). Pieces cost next to
    nothing there, so their values are never staged: staging would add a copy to a copy."""

    __slots__ = ("invalid", "ptrs", "routes", "rows", "sizes", "totals", "views")

    def __init__(
        self,
        keys: Sequence[str],
        values: Values,
        writable: bool,
        staging_bytes: int,
        local: Callable[[str], bool] | None = None,
    ) -> None:
        single: list[int] = []
        staged: list[int] = []
        multi: list[int] = []
        self.routes: dict[_Route, list[int]] = {_Route.SINGLE: single, _Route.STAGED: staged, _Route.MULTI: multi}
        self.invalid: list[int] = []  # empty key or empty value
        self.views: list[list[memoryview]] = []  # per value; filled for staged values of a list batch
        self.ptrs: list[list[int]] = []  # per value; filled for the values moved in place
        self.rows: Rows | None = None
        if isinstance(values, Rows):
            self._init_rows(keys, values, writable, staging_bytes, local)
            return
        try:  # the whole batch at once: comprehensions cost far less per piece than a loop
            self.sizes = [[piece.nbytes for piece in value] for value in values]
        except AttributeError:  # bytes and other plain buffers
            self.sizes = [[as_u8(piece).size for piece in value] for value in values]
        self.totals = totals = [sum(sizes) for sizes in self.sizes]
        for index, (key, sizes, total) in enumerate(zip(keys, self.sizes, totals)):
            if not key or not total:
                self.invalid.append(index)
            elif len(sizes) == 1:
                single.append(index)
            elif total <= staging_bytes and _stageable(sizes) and not (local and local(key)):
                staged.append(index)
            else:
                multi.append(index)
        self.views = [[] for _ in keys]
        self.ptrs = [[] for _ in keys]
        try:
            self._prepare(values, writable)
        except _FAST_PATH_ERRORS:
            self._prepare_general(values, writable)

    def _init_rows(
        self,
        keys: Sequence[str],
        rows: Rows,
        writable: bool,
        staging_bytes: int,
        local: Callable[[str], bool] | None,
    ) -> None:
        arrays = rows.arrays
        if writable and not all(array.flags.writeable for array in arrays):
            raise TypeError("a destination array is read-only")
        sizes = [array.shape[1] for array in arrays]
        if 0 in sizes:  # Mooncake skips empty pieces: drop them
            arrays = tuple(array for array in arrays if array.shape[1])
            sizes = [size for size in sizes if size]
            rows = Rows(arrays, rows.ids) if arrays else rows
        total = sum(sizes)
        count = len(keys)
        self.rows = rows
        self.sizes = [sizes] * count
        self.totals = [total] * count
        if not total:
            self.invalid.extend(range(count))
            return
        single, staged, multi = self.routes.values()
        if len(sizes) == 1:
            route = single
        elif total <= staging_bytes and _stageable(sizes):
            route = staged
        else:
            route = multi
        self.ptrs = [[] for _ in keys]
        if all(keys) and (route is not staged or local is None):
            route.extend(range(count))  # the common case: one route for the whole batch
        else:
            for index, key in enumerate(keys):
                if not key:
                    self.invalid.append(index)
                elif route is staged and local is not None and local(key):
                    multi.append(index)
                else:
                    route.append(index)
        self._fill_addresses(single if route is single else multi)

    def _prepare(self, values: Sequence[Value], writable: bool) -> None:
        views, ptrs, sizes = self.views, self.ptrs, self.sizes
        staged = self.routes[_Route.STAGED]
        for index in staged:
            views[index] = [memoryview(piece).cast("B") for piece in values[index]]
        if staged and (
            True in [0 in sizes[i] for i in staged]
            or (writable and True in [view.readonly for i in staged for view in views[i]])
        ):
            raise ValueError("empty or read-only pieces")  # the general path drops or names them
        address, from_buffer = _addressof, _from_buffer  # from_buffer refuses read-only and empty pieces
        for index in (*self.routes[_Route.SINGLE], *self.routes[_Route.MULTI]):
            ptrs[index] = [address(from_buffer(piece)) for piece in values[index]]

    def _prepare_general(self, values: Sequence[Value], writable: bool) -> None:
        staged = set(self.routes[_Route.STAGED])
        for indices in self.routes.values():
            for index in indices:
                u8 = _u8_views(values[index], writable)
                self.sizes[index] = [view.size for view in u8]
                self.views[index] = [view.data for view in u8] if index in staged else []
                self.ptrs[index] = [] if index in staged else [int(view.ctypes.data) for view in u8]

    def single_args(self, keys: Sequence[str], indices: list[int]) -> tuple[list[str], list[int], list[int]]:
        """Keys, addresses and sizes of one-piece values, as batch_put_from / batch_get_into take them."""
        whole = len(indices) == len(keys)
        return _pick(keys, indices, whole), [self.ptrs[i][0] for i in indices], _pick(self.totals, indices, whole)

    def multi_args(
        self, keys: Sequence[str], indices: list[int], route: _Route
    ) -> tuple[list[str], list[list[int]], list[list[int]]]:
        """Keys, piece addresses and piece sizes, as the multi-buffer calls take them. Staged values that go
        in place after all (another call holds the staging area) get their addresses taken here."""
        if route is _Route.STAGED:
            self._fill_addresses(indices)
        whole = len(indices) == len(keys)
        ptrs = self.ptrs
        addresses = ptrs if len(indices) == len(ptrs) else [ptrs[index] for index in indices]
        return _pick(keys, indices, whole), addresses, _pick(self.sizes, indices, whole)

    def _fill_addresses(self, indices: list[int]) -> None:
        if not indices:
            return
        ptrs = self.ptrs
        if self.rows is not None:
            columns = [(_base_address(array), array.strides[0]) for array in self.rows.arrays]
            ids = self.rows.ids.tolist()
            if len(indices) == len(ptrs):  # the whole batch: one comprehension
                self.ptrs = [[base + row * stride for base, stride in columns] for row in ids]
                return
            for index in indices:
                row = ids[index]
                ptrs[index] = [base + row * stride for base, stride in columns]
        else:  # staged list values: from their byte views
            for index in indices:
                ptrs[index] = [_base_address(view) for view in self.views[index]]

    def pack(self, indices: list[int], staging: _Staging) -> list[int]:
        """Copy the values at `indices` back to back into the staging area; their addresses there."""
        starts = self.starts(indices)
        if self.rows is not None:
            region = self._region(len(indices), staging)
            ids = self.rows.ids[indices]
            area, blocks = staging.view, ids.tolist()
            offset = 0
            for array in self.rows.arrays:
                width = array.shape[1]
                if width < FANCY_GATHER_BYTES:
                    region[:, offset : offset + width] = array[ids]  # one numpy op, but two passes
                else:
                    for start, block in zip(starts, blocks):
                        area[start + offset : start + offset + width] = array[block].data
                offset += width
        else:
            area, views, sizes = staging.view, self.views, self.sizes
            for index, start in zip(indices, starts):
                for view, size in zip(views[index], sizes[index]):
                    area[start : start + size] = view
                    start += size
        return [staging.base + start for start in starts]

    def unpack(self, indices: list[int], arrived: list[bool], staging: _Staging) -> None:
        """Scatter the values at `indices`, laid out as `pack` lays them, from the staging area into
        their pieces: only those that `arrived` whole."""
        if self.rows is not None:
            region = self._region(len(indices), staging)
            ids = self.rows.ids[indices]
            if not all(arrived):
                region, ids = region[arrived], ids[arrived]
            offset = 0
            for array in self.rows.arrays:
                width = array.shape[1]
                array[ids] = region[:, offset : offset + width]
                offset += width
            return
        area, views, sizes = staging.view, self.views, self.sizes
        for index, start, ok in zip(indices, self.starts(indices), arrived):
            if ok:
                for view, size in zip(views[index], sizes[index]):
                    view[:] = area[start : start + size]
                    start += size

    def starts(self, indices: list[int]) -> list[int]:
        """Offsets of the values at `indices` laid back to back, as `pack` lays them."""
        starts = []
        offset = 0
        totals = self.totals
        for index in indices:
            starts.append(offset)
            offset += totals[index]
        return starts

    def _region(self, count: int, staging: _Staging) -> np.ndarray:
        total = self.totals[0]
        return staging.array[: count * total].reshape(count, total)


def _base_address(array: Any) -> int:
    try:
        return _addressof(_from_buffer(array))  # a quarter of the cost of .ctypes.data
    except TypeError:  # read-only, or rows that stand apart (a padded KV page: not C-contiguous)
        if isinstance(array, np.ndarray):
            return int(array.ctypes.data)
        return int(np.frombuffer(array, dtype=np.uint8).ctypes.data)


def _pick(items: Sequence[_T], indices: list[int], whole: bool) -> list[_T]:
    """items[i] for i in indices; `whole`: indices are every index in order (the common case)."""
    return list(items) if whole else [items[i] for i in indices]


def _u8_views(value: Value, writable: bool) -> list[np.ndarray]:
    views = []
    for piece in value:
        view = as_u8(piece)
        if writable and not view.flags.writeable:
            raise TypeError("a destination piece is read-only")
        if view.size:  # Mooncake skips empty pieces; drop them before they reach a pointer list
            views.append(view)
    return views


def _duplicates(keys: Sequence[str], batch: _Batch) -> dict[int, int]:
    """Later occurrences of a key -> the index of its first one, whose status they share.
    Mooncake lets the last duplicate win within a batch; kvpool's contract is the first, as across calls."""
    if len(set(keys)) == len(keys):
        return {}
    first: dict[str, int] = {}
    duplicates: dict[int, int] = {}
    for index in sorted(i for indices in batch.routes.values() for i in indices):
        seen = first.setdefault(keys[index], index)
        if seen != index:
            duplicates[index] = seen
    return duplicates


def _pack(totals: list[int], indices: list[int], capacity: int) -> list[list[int]]:
    """Split indices into consecutive rounds whose totals fit the staging buffer."""
    rounds: list[list[int]] = [[]]
    used = 0
    for index in indices:
        if used + totals[index] > capacity and rounds[-1]:
            rounds.append([])
            used = 0
        rounds[-1].append(index)
        used += totals[index]
    return [r for r in rounds if r]


class _Staging:
    """One contiguous area that small pieces are packed into (puts) or scattered from (gets); the lock
    keeps one call at a time on it (another takes the multi-buffer route meanwhile)."""

    __slots__ = ("array", "base", "lock", "size", "view")

    def __init__(self, area: np.ndarray) -> None:
        self.array = area
        self.view = area.data
        self.base = int(area.ctypes.data)
        self.size = int(area.size)
        self.lock = threading.Lock()


def _stageable(sizes: list[int]) -> bool:
    """Whether a value of pieces of these sizes may take the staged route (size limits aside)."""
    return len(sizes) > 1 and min(sizes) < SMALL_PIECE_BYTES
