"""Save/load throughput through a kvpool Backend, next to raw Mooncake and a plain memcpy, in one run.

For every chunk size and piece count, one batch of `keys_per_batch` chunks is
* put with `Backend.put` and read back with `Backend.get_into`, given as `Rows` of the layer arrays as
  the worker gives them (kvpool) and as lists of pieces (kvpool_pieces, the general form; no target),
* put with `batch_put_from` and read with `batch_get_into` on the same native Mooncake client, same
  placement, one contiguous buffer per key (raw; mooncake only),
* for values of several pieces, moved the two ways raw Mooncake can move those same pieces:
  `batch_*_multi_buffers`, one transfer per piece, as vLLM's own Mooncake store connector does
  (raw_multi), and the plain-way gather (as memcpy below) into a contiguous buffer around
  `batch_put_from` / `batch_get_into` (raw_gather),
* copied with `np.copyto` piece by piece into and out of contiguous per-key buffers (memcpy: the
  same bytes, moved the plain way).

Values look like an engine's chunks: `pieces` equal pieces per chunk, each a row (a block) of its own
"layer" array (4 pieces = a chunk spanning 4 layers; 1 = a single contiguous block); the batch's
blocks are scattered, sorted with gaps, over layer arrays twice the batch's size, as a block table has them.

Targets, per row: the embedded pool >= 60% of memcpy; the mooncake backend >= 80% of raw Mooncake
moving the same pieces: the contiguous raw call for one-piece values, the better of raw_multi and
raw_gather for several (no raw call moves pieces that are apart without either a copy or a transfer
per piece). The ratio to the contiguous raw call is reported for every row as well.

Steady state: one untimed warm-up round first; every timed put writes fresh keys and the keys are
removed after each round, outside the timed window. The embedded pool reuses a freed array of the same
size, so its timed puts land in recycled (already faulted-in) memory, as in a warm serving process.
Gets read the same stored keys every round. Paths go in a shuffled order each round, and before each
timed call a 16 MiB sweep leaves the caches as cold as an engine's forward pass leaves them between
two connector calls (so no path inherits a warmer cache from the path before it).
Figures are medians over at least `reps` rounds, more for cheap cells (until every path has 0.2 s of
samples, at most 200 rounds); bytes are counted once per batch (GB/s = 1e9 bytes/s).

Mooncake placements: `local` = the bench's client owns the only segment (puts prefer it: Mooncake's
memcpy path); `remote` = a child process owns the segment and the bench's client has none, so every
byte crosses TCP on 127.0.0.1 (where per-piece costs show). The bench starts its own master on
loopback and stops it, and its child.
"""

from __future__ import annotations

import os
import random
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from kvpool.backends.base import Backend, Rows, Status
from kvpool.backends.mooncake.segment_holder import SegmentHolder
from kvpool.benchmarks.transfer_report import (
    MEMORY_TARGET,
    MOONCAKE_TARGET,
    SEAL_COST_TARGET,
    print_table,
    summarize,
)
from kvpool.core.config import Integrity
from kvpool.worker.integrity import SEAL_BYTES, Sealer

__all__ = ["MEMORY_TARGET", "MOONCAKE_TARGET", "SEAL_COST_TARGET", "check_arguments", "print_table", "run"]

KiB = 1 << 10
MiB = 1 << 20
CHUNK_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
PIECES = (4, 1)
KEYS_PER_BATCH = 32
REPS = 15  # at least; cheap cells run more rounds, up to MIN_SAMPLE_S of samples per path
MIN_SAMPLE_S = 0.2
MAX_REPS = 200
PLACEMENTS = ("local", "remote")
_SWEEP_BYTES = 16 << 20  # larger than the L2 caches of the machines we run on; a share of L3
_SEGMENT_SLACK = 2  # pool = slack x the bytes kept stored at once (the get keys of every path)


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


class _Rounds:
    """The order of the paths in each round, shuffled (a fixed cyclic order would give every path the
    same predecessor, and with it the same cache state, round after round), and the engine's work
    between two calls: a sweep over a buffer larger than the CPU's caches, so every timed call starts
    as cold as a connector call between two forward passes does."""

    def __init__(self, paths: list[str], seed: int) -> None:
        self._paths = paths
        self._random = random.Random(seed)
        self._sweep = np.ones(_SWEEP_BYTES, dtype=np.uint8)
        self._sink = np.empty_like(self._sweep)

    def order(self) -> list[str]:
        order = list(self._paths)
        self._random.shuffle(order)
        return order

    def timed(self, call: Callable[[list[str]], Any], keys: list[str]) -> float:
        np.copyto(self._sink, self._sweep)
        began = time.perf_counter()
        call(keys)
        return time.perf_counter() - began


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return round(nbytes / statistics.median(seconds) / 1e9, 3)


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


def _rounds(reps: int, min_sample_s: float, samples: dict[str, list[float]]) -> Iterator[int]:
    """Round numbers, 0 being the warm-up: at least `reps` timed rounds, more while some path has
    under `min_sample_s` of samples (cheap cells get many rounds; the median settles), at most MAX_REPS."""
    rep = 0
    while rep <= reps or (rep <= MAX_REPS and min(sum(times) for times in samples.values()) < min_sample_s):
        yield rep
        rep += 1


def _measure(
    backend: Backend, raw: _Raw | None, data: _Data, reps: int, min_sample_s: float
) -> dict[str, dict[str, float]]:
    """GB/s per op ("put", "get") and per path (see _calls), and the timed rounds per op ("rounds")."""
    prefix = f"bench/{uuid.uuid4().hex[:8]}/{data.chunk_bytes}x{data.pieces}"

    def fresh(path: str, rep: int) -> list[str]:
        return [f"{prefix}/{path}/{rep}/{k}" for k in range(data.keys)]

    calls = _calls(backend, raw, data)
    paths = list(calls)
    rounds = _Rounds(paths, seed=data.chunk_bytes + data.pieces)
    times: dict[str, dict[str, list[float]]] = {op: {path: [] for path in paths} for op in ("put", "get")}
    # puts: round 0 is the warm-up (not recorded); fresh keys every round, removed afterwards
    for rep in _rounds(reps, min_sample_s, times["put"]):
        for path in rounds.order():
            keys = fresh(path, rep)
            took = rounds.timed(calls[path].put, keys)
            calls[path].remove(keys)
            if rep:
                times["put"][path].append(took)
    # gets: the same stored keys every round
    stored = {path: fresh(f"{path}-get", 0) for path in paths}
    for path in paths:
        calls[path].put(stored[path])
    try:
        for rep in _rounds(reps, min_sample_s, times["get"]):
            for path in rounds.order():
                took = rounds.timed(calls[path].get, stored[path])
                if rep:
                    times["get"][path].append(took)
            if rep == 0:
                data.check(paths)  # the warm-up reads must return the bytes written
    finally:
        for path in paths:
            calls[path].remove(stored[path])
    figures = {
        op: {path: _gbps(data.batch_bytes, samples) for path, samples in paths_.items() if samples}
        for op, paths_ in times.items()
    }
    figures["rounds"] = {op: float(len(times[op]["kvpool"])) for op in times}
    return figures


@dataclass(frozen=True)
class _Plan:
    chunk_sizes: Sequence[int]
    pieces: Sequence[int]
    keys_per_batch: int
    reps: int
    min_sample_s: float


def _rows(
    backend_name: str, placement: str | None, backend: Backend, raw: _Raw | None, plan: _Plan
) -> list[dict[str, Any]]:
    rows = []
    keys_per_batch = plan.keys_per_batch
    for chunk_bytes in plan.chunk_sizes:
        for count in plan.pieces:
            data = _Data(chunk_bytes, count, keys_per_batch)
            figures = _measure(backend, raw, data, plan.reps, plan.min_sample_s)
            for op in ("put", "get"):
                row: dict[str, Any] = {
                    "backend": backend_name,
                    "op": op,
                    "chunk_bytes": chunk_bytes,
                    "pieces": count,
                    "keys_per_batch": keys_per_batch,
                    "rounds": int(figures["rounds"][op]),
                    "kvpool_gbps": figures[op]["kvpool"],
                    "kvpool_pieces_gbps": figures[op]["kvpool_pieces"],
                    "kvpool_sealed_gbps": figures[op]["kvpool_sealed"],
                    # the seal's cost, as a share of the time kvpool takes to move the same chunks
                    "seal_cost": {
                        mode: round(figures[op]["kvpool"] / figures[op][f"seal_{mode}"], 4)
                        for mode in ("sampled", "full")
                    },
                }
                if placement is not None:
                    row["placement"] = placement
                if raw is not None:
                    row["raw_gbps"] = figures[op]["raw"]
                    # the same pieces: Mooncake's multi-buffer call, and a gather around the contiguous call
                    row["raw_multi_gbps"] = figures[op].get("raw_multi")
                    row["raw_gather_gbps"] = figures[op].get("raw_gather")
                row["memcpy_gbps"] = figures[op]["memcpy"]
                rows.append(row)
    return rows


def check_arguments(
    backend: str, chunk_sizes: Sequence[int], pieces: Sequence[int], keys_per_batch: int, reps: int
) -> None:
    """ValueError naming the bad argument, before anything starts."""
    if backend not in ("memory", "mooncake"):
        raise ValueError(f"backend {backend!r}: expected memory or mooncake")
    if keys_per_batch < 1 or reps < 1:
        raise ValueError(f"keys_per_batch {keys_per_batch}, reps {reps}: both must be >= 1")
    for chunk_bytes in chunk_sizes:
        for count in pieces:
            if count < 1 or chunk_bytes % count:
                raise ValueError(f"pieces {count}: a chunk of {chunk_bytes} bytes does not split into {count} pieces")


def run(
    backend: str = "memory",
    *,
    chunk_sizes: Sequence[int] = CHUNK_SIZES,
    pieces: Sequence[int] = PIECES,
    keys_per_batch: int = KEYS_PER_BATCH,
    reps: int = REPS,
    min_sample_s: float = MIN_SAMPLE_S,
    placements: Sequence[str] = PLACEMENTS,
) -> dict[str, Any]:
    """Measure `backend` ("memory" or "mooncake"); returns {"results": [...], "summary": {...}}."""
    check_arguments(backend, chunk_sizes, pieces, keys_per_batch, reps)
    plan = _Plan(chunk_sizes, pieces, keys_per_batch, reps, min_sample_s)
    live = 5 * keys_per_batch * max(chunk_sizes)  # the get keys of both kvpool and the three raw paths, at once
    if backend == "memory":
        from kvpool.backends.memory import MemoryBackend

        pool = MemoryBackend(capacity_bytes=_SEGMENT_SLACK * live)
        rows = _rows("memory", None, pool, None, plan)
        pool.close()
    else:
        rows = _run_mooncake(plan, placements, _SEGMENT_SLACK * live)
    config = {
        "chunk_sizes": list(chunk_sizes),
        "pieces": list(pieces),
        "keys_per_batch": keys_per_batch,
        "reps": reps,
        "min_sample_s": min_sample_s,
        "max_reps": MAX_REPS,
        "statistic": "median",
    }
    if backend == "mooncake":
        config["placements"] = list(placements)
    return {"backend": backend, "config": config, "results": rows, "summary": summarize(backend, rows)}


def _run_mooncake(plan: _Plan, placements: Sequence[str], segment_bytes: int) -> list[dict[str, Any]]:
    from kvpool.backends.mooncake import MooncakeBackend
    from kvpool.backends.mooncake.master import start_master

    unknown = sorted(set(placements) - set(PLACEMENTS))
    if unknown or not placements:
        raise ValueError(f"placements {list(placements)}: expected some of {PLACEMENTS}")
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    segment_bytes = max(segment_bytes, 16 * MiB)
    rows: list[dict[str, Any]] = []
    with start_master() as master:
        for placement in placements:
            options = {**master.backend_options(), "global_segment_size": segment_bytes}
            holder: AbstractContextManager[Any] = (
                SegmentHolder(master.address, segment_bytes) if placement == "remote" else nullcontext()
            )
            with holder:
                if placement == "remote":
                    options["global_segment_size"] = 0
                client = MooncakeBackend.from_options(options)
                try:
                    rows += _rows("mooncake", placement, client, _Raw(client), plan)
                finally:
                    client.close()
    return rows
