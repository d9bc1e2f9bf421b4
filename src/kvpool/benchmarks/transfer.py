"""Save/load throughput through a kvpool Backend, next to raw Mooncake and a plain memcpy, in one run.

For every chunk size and piece count, one batch of `keys_per_batch` chunks is
* put with `Backend.put` and read back with `Backend.get_into` (kvpool),
* put with `batch_put_from` and read with `batch_get_into` on the same native Mooncake client, same
  placement, one contiguous buffer per key (raw; mooncake only),
* copied with `np.copyto` piece by piece into contiguous per-key buffers (memcpy: the same bytes).

Values look like an engine's chunks: `pieces` equal pieces per chunk, each a row of its own "layer"
array (4 pieces = a chunk spanning 4 layers; 1 = a single contiguous block).

Steady state: one untimed warm-up round first; every timed put writes fresh keys and the keys are
removed after each round, outside the timed window. The embedded pool reuses a freed array of the same
size, so its timed puts land in recycled (already faulted-in) memory, as in a warm serving process.
Gets read the same stored keys every round. Kvpool and raw alternate who goes first each round.
Figures are medians over `reps` rounds; bytes are counted once per batch (GB/s = 1e9 bytes/s).

Mooncake placements: `local` = the bench's client owns the only segment (puts prefer it: Mooncake's
memcpy path); `remote` = a child process owns the segment and the bench's client has none, so every
byte crosses TCP on 127.0.0.1 (where per-piece costs show). The bench starts its own master on
loopback and stops it, and its child.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.backends.base import Backend, Status

KiB = 1 << 10
MiB = 1 << 20
CHUNK_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
PIECES = (4, 1)
KEYS_PER_BATCH = 32
REPS = 9
PLACEMENTS = ("local", "remote")
MEMORY_TARGET = 0.60  # embedded pool: kvpool >= 60% of memcpy
MOONCAKE_TARGET = 0.80  # distributed pool: kvpool >= 80% of raw Mooncake
_SEGMENT_SLACK = 2  # pool = slack x the bytes kept stored at once (the get keys of every path)
_HOLDER_READY_S = 60.0

_HOLDER = """
import sys
from kvpool.backends.mooncake import MooncakeBackend
backend = MooncakeBackend.from_options(
    {"master": sys.argv[1], "global_segment_size": int(sys.argv[2]), "staging_bytes": 0}
)
print("ready", flush=True)
sys.stdin.read()
backend.close()
"""


@dataclass
class _Data:
    """One batch: per-layer source and destination arrays, and contiguous ones for raw and memcpy."""

    chunk_bytes: int
    pieces: int
    keys: int

    def __post_init__(self) -> None:
        piece = self.chunk_bytes // self.pieces
        rng = np.random.default_rng(self.chunk_bytes * 10 + self.pieces)
        self.src_layers = [rng.integers(0, 256, (self.keys, piece), dtype=np.uint8) for _ in range(self.pieces)]
        self.dst_layers = [np.zeros((self.keys, piece), dtype=np.uint8) for _ in range(self.pieces)]
        self.src_flat = np.concatenate(self.src_layers, axis=1)  # key k = its pieces back to back
        self.dst_flat = np.zeros_like(self.src_flat)
        self.values = [[layer[k] for layer in self.src_layers] for k in range(self.keys)]
        self.dests = [[layer[k] for layer in self.dst_layers] for k in range(self.keys)]
        self.src_ptrs = [self.src_flat[k].ctypes.data for k in range(self.keys)]
        self.dst_ptrs = [self.dst_flat[k].ctypes.data for k in range(self.keys)]
        self.sizes = [self.chunk_bytes] * self.keys
        # the same pieces kvpool is given, for Mooncake's multi-buffer calls
        self.src_piece_ptrs = [[piece.ctypes.data for piece in value] for value in self.values]
        self.dst_piece_ptrs = [[piece.ctypes.data for piece in dest] for dest in self.dests]
        self.piece_sizes = [[piece.size for piece in value] for value in self.values]

    @property
    def batch_bytes(self) -> int:
        return self.chunk_bytes * self.keys

    def memcpy_put(self) -> None:
        """What a put moves, by plain copies: every piece into its place in a contiguous buffer."""
        dst = self.dst_flat
        piece = self.chunk_bytes // self.pieces
        for k, value in enumerate(self.values):
            row = dst[k]
            for p, src in enumerate(value):
                np.copyto(row[p * piece : (p + 1) * piece], src)

    def memcpy_get(self) -> None:
        """What a get moves, by plain copies: a contiguous buffer scattered into the pieces."""
        src = self.src_flat
        piece = self.chunk_bytes // self.pieces
        for k, dest in enumerate(self.dests):
            row = src[k]
            for p, dst in enumerate(dest):
                np.copyto(dst, row[p * piece : (p + 1) * piece])

    def check(self, raw_read: bool) -> None:
        for layer_src, layer_dst in zip(self.src_layers, self.dst_layers):
            if not np.array_equal(layer_src, layer_dst):
                raise RuntimeError(f"kvpool read back wrong bytes ({self.chunk_bytes} B x {self.pieces} pieces)")
        if raw_read and not np.array_equal(self.src_flat, self.dst_flat):
            raise RuntimeError(f"raw Mooncake read back wrong bytes ({self.chunk_bytes} B)")
        for layer in self.dst_layers:
            layer.fill(0)
        self.dst_flat.fill(0)


class _Raw:
    """Raw Mooncake calls on the backend's own native client (same connection, same placement)."""

    def __init__(self, backend: Any) -> None:
        self.store = backend._store
        self.config = backend._replicate

    def put(self, keys: list[str], data: _Data) -> None:
        codes = self.store.batch_put_from(keys, data.src_ptrs, data.sizes, self.config)
        if any(code != 0 for code in codes):
            raise RuntimeError(f"raw batch_put_from failed: {sorted(set(codes))}")

    def get(self, keys: list[str], data: _Data) -> None:
        codes = self.store.batch_get_into(keys, data.dst_ptrs, data.sizes)
        if any(code != data.chunk_bytes for code in codes):
            raise RuntimeError(f"raw batch_get_into failed: {sorted(set(codes))}")

    def put_multi(self, keys: list[str], data: _Data) -> None:
        codes = self.store.batch_put_from_multi_buffers(keys, data.src_piece_ptrs, data.piece_sizes, self.config)
        if any(code != 0 for code in codes):
            raise RuntimeError(f"raw batch_put_from_multi_buffers failed: {sorted(set(codes))}")

    def get_multi(self, keys: list[str], data: _Data) -> None:
        codes = self.store.batch_get_into_multi_buffers(keys, data.dst_piece_ptrs, data.piece_sizes)
        if any(code != data.chunk_bytes for code in codes):
            raise RuntimeError(f"raw batch_get_into_multi_buffers failed: {sorted(set(codes))}")

    def remove(self, keys: list[str]) -> None:
        self.store.batch_remove(keys, True)


def _rotated(paths: list[str], rep: int) -> list[str]:
    """Each round starts with the next path, so drift and cache state hit every path alike."""
    shift = rep % len(paths)
    return paths[shift:] + paths[:shift]


def _timed(call: Callable[[], Any]) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return round(nbytes / statistics.median(seconds) / 1e9, 3)


def _put_call(path: str, backend: Backend, raw: _Raw | None, keys: list[str], data: _Data) -> Callable[[], None]:
    if path == "kvpool":
        return lambda: _kvpool_put(backend, keys, data)
    if path == "memcpy":
        return data.memcpy_put
    assert raw is not None
    if path == "raw":
        return lambda: raw.put(keys, data)
    return lambda: raw.put_multi(keys, data)


def _kvpool_put(backend: Backend, keys: list[str], data: _Data) -> None:
    statuses = backend.put(keys, data.values)
    if any(status is not Status.OK for status in statuses):
        raise RuntimeError(f"kvpool put failed: {sorted({s.name for s in statuses})}")


def _kvpool_get(backend: Backend, keys: list[str], data: _Data) -> None:
    statuses = backend.get_into(keys, data.dests)
    if any(status is not Status.OK for status in statuses):
        raise RuntimeError(f"kvpool get_into failed: {sorted({s.name for s in statuses})}")


def _measure(backend: Backend, raw: _Raw | None, data: _Data, reps: int) -> dict[str, dict[str, float]]:
    """GB/s per op ("put", "get") and per path ("kvpool", "raw", "raw_multi", "memcpy")."""
    prefix = f"bench/{uuid.uuid4().hex[:8]}/{data.chunk_bytes}x{data.pieces}"

    def fresh(path: str, rep: int) -> list[str]:
        return [f"{prefix}/{path}/{rep}/{k}" for k in range(data.keys)]

    paths = ["kvpool", "memcpy"]
    if raw is not None:
        paths += ["raw", "raw_multi"] if data.pieces > 1 else ["raw"]
    times: dict[str, dict[str, list[float]]] = {op: {path: [] for path in paths} for op in ("put", "get")}
    # puts: round 0 is the warm-up (not recorded); fresh keys every round, removed afterwards
    for rep in range(reps + 1):
        for path in _rotated(paths, rep):
            keys = fresh(path, rep)
            took = _timed(_put_call(path, backend, raw, keys, data))
            if path == "kvpool":
                backend.remove(keys)
            elif raw is not None and path != "memcpy":
                raw.remove(keys)
            if rep:
                times["put"][path].append(took)
    # gets: the same stored keys every round
    stored = {path: fresh(f"{path}-get", 0) for path in paths}
    _kvpool_put(backend, stored["kvpool"], data)
    if raw is not None:
        raw.put(stored["raw"], data)
        if "raw_multi" in paths:
            raw.put_multi(stored["raw_multi"], data)
    try:
        for rep in range(reps + 1):
            for path in _rotated(paths, rep):
                if path == "kvpool":
                    took = _timed(lambda: _kvpool_get(backend, stored["kvpool"], data))
                elif path == "raw":
                    assert raw is not None
                    took = _timed(lambda: raw.get(stored["raw"], data))
                elif path == "raw_multi":
                    assert raw is not None
                    took = _timed(lambda: raw.get_multi(stored["raw_multi"], data))
                else:
                    continue
                if rep:
                    times["get"][path].append(took)
            if rep == 0:
                data.check(raw_read=raw is not None)  # the warm-up reads must return the bytes written
            took = _timed(data.memcpy_get)  # after the check: it writes the destinations too
            if rep:
                times["get"]["memcpy"].append(took)
    finally:
        backend.remove(stored["kvpool"])
        if raw is not None:
            raw.remove(stored["raw"])
            if "raw_multi" in paths:
                raw.remove(stored["raw_multi"])
    return {
        op: {path: _gbps(data.batch_bytes, samples) for path, samples in paths.items() if samples}
        for op, paths in times.items()
    }


@contextmanager
def _segment_holder(master_address: str, segment_bytes: int) -> Iterator[None]:
    """A child process owning the pool's only segment (stopped on exit, killed if it does not stop)."""
    env = dict(os.environ)
    env.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    env.setdefault("MC_LOG_LEVEL", "WARNING")
    process = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, master_address, str(segment_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + _HOLDER_READY_S
        line = ""
        while line.strip() != "ready":
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"the segment holder did not start (exit code {process.poll()})")
            line = process.stdout.readline()
        yield
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _rows(
    backend_name: str,
    placement: str | None,
    backend: Backend,
    raw: _Raw | None,
    chunk_sizes: Sequence[int],
    pieces: Sequence[int],
    keys_per_batch: int,
    reps: int,
) -> list[dict[str, Any]]:
    rows = []
    for chunk_bytes in chunk_sizes:
        for count in pieces:
            if chunk_bytes % count:
                raise ValueError(f"chunk size {chunk_bytes} does not split into {count} pieces")
            data = _Data(chunk_bytes, count, keys_per_batch)
            figures = _measure(backend, raw, data, reps)
            for op in ("put", "get"):
                row: dict[str, Any] = {
                    "backend": backend_name,
                    "op": op,
                    "chunk_bytes": chunk_bytes,
                    "pieces": count,
                    "keys_per_batch": keys_per_batch,
                    "kvpool_gbps": figures[op]["kvpool"],
                }
                if placement is not None:
                    row["placement"] = placement
                if raw is not None:
                    row["raw_gbps"] = figures[op]["raw"]
                    # Mooncake's own multi-buffer call on the same pieces (what kvpool uses for them)
                    row["raw_multi_gbps"] = figures[op].get("raw_multi")
                row["memcpy_gbps"] = figures[op]["memcpy"]
                rows.append(row)
    return rows


def run(
    backend: str = "memory",
    *,
    chunk_sizes: Sequence[int] = CHUNK_SIZES,
    pieces: Sequence[int] = PIECES,
    keys_per_batch: int = KEYS_PER_BATCH,
    reps: int = REPS,
    placements: Sequence[str] = PLACEMENTS,
) -> dict[str, Any]:
    """Measure `backend` ("memory" or "mooncake"); returns {"results": [...], "summary": {...}}."""
    if backend not in ("memory", "mooncake"):
        raise ValueError(f"backend {backend!r}: expected memory or mooncake")
    if keys_per_batch < 1 or reps < 1:
        raise ValueError("keys_per_batch and reps must be >= 1")
    live = 3 * keys_per_batch * max(chunk_sizes)  # the get keys of kvpool, raw and raw multi, stored at once
    if backend == "memory":
        from kvpool.backends.memory import MemoryBackend

        pool = MemoryBackend(capacity_bytes=_SEGMENT_SLACK * live)
        rows = _rows("memory", None, pool, None, chunk_sizes, pieces, keys_per_batch, reps)
        pool.close()
    else:
        rows = _run_mooncake(chunk_sizes, pieces, keys_per_batch, reps, placements, _SEGMENT_SLACK * live)
    config = {
        "chunk_sizes": list(chunk_sizes),
        "pieces": list(pieces),
        "keys_per_batch": keys_per_batch,
        "reps": reps,
        "statistic": "median",
    }
    if backend == "mooncake":
        config["placements"] = list(placements)
    return {"backend": backend, "config": config, "results": rows, "summary": _summary(backend, rows)}


def _run_mooncake(
    chunk_sizes: Sequence[int],
    pieces: Sequence[int],
    keys_per_batch: int,
    reps: int,
    placements: Sequence[str],
    segment_bytes: int,
) -> list[dict[str, Any]]:
    from kvpool.backends.mooncake import MooncakeBackend
    from kvpool.mooncake_master import start_master

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
            holder: AbstractContextManager[None] = (
                _segment_holder(master.address, segment_bytes) if placement == "remote" else nullcontext()
            )
            with holder:
                if placement == "remote":
                    options["global_segment_size"] = 0
                client = MooncakeBackend.from_options(options)
                try:
                    rows += _rows(
                        "mooncake", placement, client, _Raw(client), chunk_sizes, pieces, keys_per_batch, reps
                    )
                finally:
                    client.close()
    return rows


def _summary(backend: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    baseline, threshold = ("memcpy_gbps", MEMORY_TARGET) if backend == "memory" else ("raw_gbps", MOONCAKE_TARGET)
    checks = []
    for row in rows:
        ratio = row["kvpool_gbps"] / row[baseline] if row[baseline] else 0.0
        check: dict[str, Any] = {key: row[key] for key in ("op", "chunk_bytes", "pieces", "placement") if key in row}
        check["ratio"] = round(ratio, 3)
        check["pass"] = ratio >= threshold
        if backend == "mooncake":
            check["memcpy_ratio"] = round(row["kvpool_gbps"] / row["memcpy_gbps"], 3) if row["memcpy_gbps"] else 0.0
            if row.get("raw_multi_gbps"):
                check["raw_multi_ratio"] = round(row["kvpool_gbps"] / row["raw_multi_gbps"], 3)
        checks.append(check)
    worst = min(checks, key=lambda c: c["ratio"]) if checks else None
    return {
        "target": f"kvpool >= {threshold:.0%} of {'memcpy' if backend == 'memory' else 'raw Mooncake'}",
        "baseline": baseline.removesuffix("_gbps"),
        "threshold": threshold,
        "ratios": checks,
        "min_ratio": worst["ratio"] if worst else None,
        "worst": worst,
        "failed": [c for c in checks if not c["pass"]],
        "pass": all(c["pass"] for c in checks),
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    backend = result["backend"]
    config = result["config"]
    summary = result["summary"]
    title = (
        f"transfer: {backend}, {config['keys_per_batch']} chunks a batch, median of {config['reps']} rounds "
        f"(GB/s = 1e9 B/s)"
    )
    table = Table(title=title)
    mooncake = backend == "mooncake"
    columns = ["op", "chunk", "pieces", "kvpool GB/s"]
    if mooncake:
        columns = ["placement", *columns, "raw GB/s", "raw multi GB/s"]
    columns += ["memcpy GB/s", f"vs {summary['baseline']}", "target"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("op", "placement") else "right")
    for row, check in zip(result["results"], summary["ratios"]):
        cells = [row["op"], _size(row["chunk_bytes"]), str(row["pieces"]), f"{row['kvpool_gbps']:.2f}"]
        if mooncake:
            multi = row.get("raw_multi_gbps")
            cells = [row["placement"], *cells, f"{row['raw_gbps']:.2f}", "-" if multi is None else f"{multi:.2f}"]
        verdict = "[green]PASS[/green]" if check["pass"] else "[red]FAIL[/red]"
        cells += [f"{row['memcpy_gbps']:.2f}", f"{check['ratio']:.0%}", verdict]
        table.add_row(*cells)
    console.print(table)
    overall = "[green]PASS[/green]" if summary["pass"] else "[red]FAIL[/red]"
    console.print(f"target: {summary['target']} for every row; worst {summary['min_ratio']:.0%}: {overall}")


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB}M" if nbytes >= MiB else f"{nbytes // KiB}K"
