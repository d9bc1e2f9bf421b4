"""The transfer bench's batch and the paths that move it.

Values look like an engine's chunks: `pieces` equal pieces per chunk, each a row (a block) of its own
"layer" array (4 pieces = a chunk spanning 4 layers; 1 = a single contiguous block); the batch's
blocks are scattered, sorted with gaps, over layer arrays twice the batch's size, as a block table has them.

`_calls` gives every path its put, get and remove on one batch: kvpool's `Backend.put` /
`Backend.get_into` on `Rows` (kvpool), on lists of pieces (kvpool_pieces) and with sampled seals
(kvpool_sealed); the seals alone (seal_sampled, seal_full); raw Mooncake on the backend's own native
client, contiguous (raw), one transfer per piece (raw_multi) and gathered (raw_gather); and memcpy.
`rounds.py` times them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvpool.backends.base import Backend, Rows, Status
from kvpool.core.config import Integrity
from kvpool.worker.integrity import SEAL_BYTES, Sealer


@dataclass
class _Data:
    """One batch of `keys` chunks of `pieces` equal pieces: the chunks are blocks of a paged cache, rows
    `ids` (sorted, with gaps, as a block table has them) of "layer" arrays twice the batch's size, plus
    contiguous copies for the raw calls. Every path that reads has destinations of its own, so the
    check after the warm-up round sees each path's bytes, not another's."""

    chunk_bytes: int
    pieces: int
    keys: int

    def __post_init__(self) -> None:
        piece = self.piece_bytes = self.chunk_bytes // self.pieces
        rng = np.random.default_rng(self.chunk_bytes * 10 + self.pieces)
        blocks = 2 * self.keys
        self.src_layers = tuple(rng.integers(0, 256, (blocks, piece), dtype=np.uint8) for _ in range(self.pieces))
        self.ids = np.sort(rng.choice(blocks, self.keys, replace=False))
        self.values = Rows(self.src_layers, self.ids).values()  # the same chunks as lists of pieces
        self.src_flat = np.concatenate([layer[self.ids] for layer in self.src_layers], axis=1)  # pieces back to back
        self.dst_flat = np.zeros_like(self.src_flat)  # raw
        self.gather_flat = np.zeros_like(self.src_flat)  # raw_gather
        self.memcpy_flat = np.zeros_like(self.src_flat)
        self.dst = {path: tuple(np.zeros_like(layer) for layer in self.src_layers) for path in _LAYERED_READS}
        self.src_ptrs = [self.src_flat[k].ctypes.data for k in range(self.keys)]
        self.dst_ptrs = [self.dst_flat[k].ctypes.data for k in range(self.keys)]
        self.gather_ptrs = [self.gather_flat[k].ctypes.data for k in range(self.keys)]
        self.sizes = [self.chunk_bytes] * self.keys
        # the pieces kvpool is given, as Mooncake's multi-buffer calls take them
        self.src_piece_ptrs = [[piece.ctypes.data for piece in value] for value in self.values]
        self.dst_piece_ptrs = [[piece.ctypes.data for piece in dest] for dest in self.rows("raw_multi").values()]
        self.piece_sizes = [[piece] * self.pieces for _ in range(self.keys)]

    @property
    def batch_bytes(self) -> int:
        return self.chunk_bytes * self.keys

    def rows(self, path: str | None = None) -> Rows:
        """The batch as Rows: the sources, or the destinations of a reading path."""
        return Rows(self.src_layers if path is None else self.dst[path], self.ids)

    def gather(self, into: np.ndarray) -> None:
        """Every piece copied into its place in a contiguous buffer, one np.copyto a piece."""
        piece = self.piece_bytes
        for k, block in enumerate(self.ids.tolist()):
            row = into[k]
            for p, layer in enumerate(self.src_layers):
                np.copyto(row[p * piece : (p + 1) * piece], layer[block])

    def scatter(self, source: np.ndarray, path: str) -> None:
        """A contiguous buffer copied out into the pieces of `path`'s destinations, one np.copyto a piece."""
        piece = self.piece_bytes
        for k, block in enumerate(self.ids.tolist()):
            row = source[k]
            for p, layer in enumerate(self.dst[path]):
                np.copyto(layer[block], row[p * piece : (p + 1) * piece])

    def check(self, paths: Sequence[str]) -> None:
        """Every reading path got back the bytes written; then the destinations are cleared."""
        for path in paths:
            if path in self.dst:
                got: Sequence[np.ndarray] = [layer[self.ids] for layer in self.dst[path]]
                want: Sequence[np.ndarray] = [layer[self.ids] for layer in self.src_layers]
            elif path == "raw":
                got, want = (self.dst_flat,), (self.src_flat,)
            else:
                continue
            if not all(np.array_equal(g, w) for g, w in zip(got, want)):
                raise RuntimeError(f"{path} read back wrong bytes ({self.chunk_bytes} B x {self.pieces} pieces)")
        for layers in self.dst.values():
            for layer in layers:
                layer.fill(0)
        self.dst_flat.fill(0)


_LAYERED_READS = (
    "kvpool",
    "kvpool_sealed",
    "kvpool_pieces",
    "seal_sampled",
    "seal_full",
    "raw_multi",
    "raw_gather",
    "memcpy",
)


class _Raw:
    """Raw Mooncake calls on the backend's own native client (same connection, same placement)."""

    def __init__(self, backend: Any) -> None:
        self.store = backend.native_store
        self.config = backend.replicate_config

    def put(self, keys: list[str], data: _Data) -> None:
        self._stored(self.store.batch_put_from(keys, data.src_ptrs, data.sizes, self.config), "batch_put_from")

    def get(self, keys: list[str], data: _Data) -> None:
        self._read(self.store.batch_get_into(keys, data.dst_ptrs, data.sizes), data, "batch_get_into")

    def put_multi(self, keys: list[str], data: _Data) -> None:
        codes = self.store.batch_put_from_multi_buffers(keys, data.src_piece_ptrs, data.piece_sizes, self.config)
        self._stored(codes, "batch_put_from_multi_buffers")

    def get_multi(self, keys: list[str], data: _Data) -> None:
        codes = self.store.batch_get_into_multi_buffers(keys, data.dst_piece_ptrs, data.piece_sizes)
        self._read(codes, data, "batch_get_into_multi_buffers")

    def put_gather(self, keys: list[str], data: _Data) -> None:
        data.gather(data.gather_flat)
        self._stored(self.store.batch_put_from(keys, data.gather_ptrs, data.sizes, self.config), "batch_put_from")

    def get_gather(self, keys: list[str], data: _Data) -> None:
        self._read(self.store.batch_get_into(keys, data.gather_ptrs, data.sizes), data, "batch_get_into")
        data.scatter(data.gather_flat, "raw_gather")

    def remove(self, keys: list[str]) -> None:
        self.store.batch_remove(keys, True)

    @staticmethod
    def _stored(codes: list[int], call: str) -> None:
        if any(code != 0 for code in codes):
            raise RuntimeError(f"raw {call} failed: {sorted(set(codes))}")

    @staticmethod
    def _read(codes: list[int], data: _Data, call: str) -> None:
        if any(code != data.chunk_bytes for code in codes):
            raise RuntimeError(f"raw {call} failed: {sorted(set(codes))}")


def _expect_ok(statuses: list[Status], call: str) -> None:
    if any(status is not Status.OK for status in statuses):
        raise RuntimeError(f"kvpool {call} failed: {sorted({s.name for s in statuses})}")


class _Path(NamedTuple):
    put: Callable[[list[str]], Any]  # store the batch under these keys
    get: Callable[[list[str]], Any]  # read those keys back into the path's destinations
    remove: Callable[[list[str]], Any]


def _calls(backend: Backend, raw: _Raw | None, data: _Data) -> dict[str, _Path]:
    calls = {
        "kvpool": _Path(
            lambda keys: _expect_ok(backend.put(keys, data.rows()), "put"),
            lambda keys: _expect_ok(backend.get_into(keys, data.rows("kvpool")), "get_into"),
            backend.remove,
        ),
        "kvpool_pieces": _Path(
            lambda keys: _expect_ok(backend.put(keys, data.values), "put"),
            lambda keys: _expect_ok(backend.get_into(keys, data.rows("kvpool_pieces").values()), "get_into"),
            backend.remove,
        ),
        "kvpool_sealed": _sealed_path(backend, data),
        # the seal's own cost, each way: computed over the sources (a save) and the destinations (a load)
        **{f"seal_{mode.value}": _seal_only(data, mode) for mode in (Integrity.SAMPLED, Integrity.FULL)},
        "memcpy": _Path(
            lambda keys: data.gather(data.memcpy_flat),
            lambda keys: data.scatter(data.src_flat, "memcpy"),
            lambda keys: None,
        ),
    }
    if raw is not None:
        calls["raw"] = _Path(lambda keys: raw.put(keys, data), lambda keys: raw.get(keys, data), raw.remove)
        if data.pieces > 1:
            calls["raw_multi"] = _Path(
                lambda keys: raw.put_multi(keys, data),
                lambda keys: raw.get_multi(keys, data),
                raw.remove,
            )
            calls["raw_gather"] = _Path(
                lambda keys: raw.put_gather(keys, data),
                lambda keys: raw.get_gather(keys, data),
                raw.remove,
            )
    return calls


def _sealed_path(backend: Backend, data: _Data) -> _Path:
    """kvpool with sampled seals, as an engine's layout moves them: the seal column after the layers."""
    sealer = Sealer(data.chunk_bytes, Integrity.SAMPLED)
    save_seals, load_seals = (np.zeros((2 * data.keys, SEAL_BYTES), np.uint8) for _ in range(2))

    def put(keys: list[str]) -> None:
        rows = data.rows()
        save_seals[rows.ids] = sealer.seal_column(rows)
        _expect_ok(backend.put(keys, Rows((*rows.arrays, save_seals), rows.ids)), "put")

    def get(keys: list[str]) -> None:
        rows = Rows((*data.dst["kvpool_sealed"], load_seals), data.ids)
        _expect_ok(sealer.verify(rows, backend.get_into(keys, rows)), "get_into (sealed)")

    return _Path(put, get, backend.remove)


def _seal_only(data: _Data, mode: Integrity) -> _Path:
    sealer = Sealer(data.chunk_bytes, mode)
    # the destinations hold the chunks' bytes, as after a read
    for source, dest in zip(data.src_layers, data.dst[f"seal_{mode.value}"]):
        np.copyto(dest, source)
    return _Path(
        lambda keys: sealer.seals(data.rows()),
        lambda keys: sealer.seals(data.rows(f"seal_{mode.value}")),
        lambda keys: None,
    )
