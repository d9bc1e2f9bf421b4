"""The embedded pool's view of a batch's values: each value's bytes, checked before anything is stored or
read, how they are copied into the pool's arrays, and what an array handed over keeps alive.

A batch's values (`Values`) are `Rows` (value k: row `ids[k]` of every array, back to back) or, per
value, a list of buffers (its pieces, in order). The pool stores each value as one 1-D uint8 array of
the value's size. `held_nbytes` says what an array the caller hands over (`MemoryBackend.adopt`) keeps
alive: a view into a larger buffer is copied, since capacity counts only the value's bytes.

Invariants:
- Every buffer is checked up front (`value_pieces`, `value_writer`): a bad one (not contiguous, not in
  host memory, a read-only destination) raises TypeError before the pool stores or reads any value of
  the batch.
- A value's bytes are its pieces' back to back, in order; its size is the sum of theirs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvpool.backends.base import Rows, Values
from kvpool.core.buffers import as_u8

_PiecesOf = Callable[[int], list[np.ndarray]]
_Write = Callable[[int, np.ndarray], None]
_SizesOf = Callable[[int], list[int]]


def value_pieces(values: Values, writable: bool) -> tuple[_PiecesOf, _SizesOf]:
    """The byte pieces of value i, and their sizes. Every buffer is checked up front."""
    if isinstance(values, Rows):
        if writable and not all(array.flags.writeable for array in values.arrays):
            raise TypeError("a destination array is read-only")
        arrays, ids = values.arrays, values.ids.tolist()
        row_bytes = values.row_bytes
        return (lambda index: [array[ids[index]] for array in arrays]), (lambda index: row_bytes)
    prepared = [[as_u8(piece) for piece in value] for value in values]
    if writable and not all(piece.flags.writeable for pieces in prepared for piece in pieces):
        raise TypeError("a destination piece is read-only")
    sizes = [[piece.size for piece in pieces] for pieces in prepared]
    return prepared.__getitem__, sizes.__getitem__


def value_writer(values: Values) -> tuple[list[int], _Write]:
    """Each value's total size, and `write(i, target)`: value i's bytes into `target` (a 1-D uint8 array of
    that size). Every buffer is checked up front. A `Rows` value is written piece by piece through one
    memoryview: a decode step puts a chunk or two, where `np.concatenate`'s fixed cost would dominate."""
    if isinstance(values, Rows):
        arrays, ids = values.arrays, values.ids.tolist()
        widths = values.row_bytes
        sizes = [sum(widths)] * len(ids)
        if len(arrays) == 1:
            (array,) = arrays

            def write_row(index: int, target: np.ndarray) -> None:
                target[:] = array[ids[index]]

            return sizes, write_row
        columns = list(zip(arrays, widths))

        def write_pieces(index: int, target: np.ndarray) -> None:
            row, view, offset = ids[index], target.data, 0
            for array, width in columns:
                view[offset : offset + width] = array[row]
                offset += width

        return sizes, write_pieces
    pieces_of, sizes_of = value_pieces(values, writable=False)

    def write(index: int, target: np.ndarray) -> None:
        pieces = pieces_of(index)
        if len(pieces) == 1:
            target[:] = pieces[0]
        else:
            np.concatenate(pieces, out=target)

    return [sum(sizes_of(index)) for index in range(len(values))], write


def held_nbytes(array: np.ndarray) -> int:
    """The bytes `array` keeps alive: those of the allocation it views (its own when it owns them)."""
    root: object = array
    while isinstance(root, np.ndarray) and root.base is not None:
        root = root.base
    if isinstance(root, np.ndarray):
        return int(root.nbytes)
    try:
        return memoryview(root).nbytes  # type: ignore[arg-type]
    except TypeError:
        return int(array.nbytes)
