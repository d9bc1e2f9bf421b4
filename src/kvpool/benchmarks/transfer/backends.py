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

Targets, per row: the embedded pool >= 60% of memcpy; the mooncake backend >= 80% of raw Mooncake
moving the same pieces: the contiguous raw call for one-piece values, the better of raw_multi and
raw_gather for several (no raw call moves pieces that are apart without either a copy or a transfer
per piece). The ratio to the contiguous raw call is reported for every row as well.

The batch and its paths are `batch.py`'s; the timed rounds (warm-up, fresh keys, shuffled order,
cache sweeps, medians) are `rounds.py`'s; the targets and the table are `report.py`'s.

Mooncake placements: `local` = the bench's client owns the only segment (puts prefer it: Mooncake's
memcpy path); `remote` = a child process owns the segment and the bench's client has none, so every
byte crosses TCP on 127.0.0.1 (where per-piece costs show). The bench starts its own master on
loopback and stops it, and its child.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from kvpool.backends.base import Backend
from kvpool.backends.mooncake.segment_holder import SegmentHolder
from kvpool.benchmarks.transfer.batch import _Data, _Raw
from kvpool.benchmarks.transfer.report import (
    MEMORY_TARGET,
    MOONCAKE_TARGET,
    SEAL_COST_TARGET,
    print_table,
    summarize,
)
from kvpool.benchmarks.transfer.rounds import MAX_REPS, _measure

__all__ = ["MEMORY_TARGET", "MOONCAKE_TARGET", "SEAL_COST_TARGET", "check_arguments", "print_table", "run"]

KiB = 1 << 10
MiB = 1 << 20
CHUNK_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
PIECES = (4, 1)
KEYS_PER_BATCH = 32
REPS = 15  # at least; cheap cells run more rounds, up to MIN_SAMPLE_S of samples per path
MIN_SAMPLE_S = 0.2
PLACEMENTS = ("local", "remote")
_SEGMENT_SLACK = 2  # pool = slack x the bytes kept stored at once (the get keys of every path)


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
