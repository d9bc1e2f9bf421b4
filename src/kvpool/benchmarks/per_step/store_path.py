"""CPU cost per engine step of the save path: kvpool's incremental store next to vLLM 0.32's own
`MooncakeStoreConnector` save path and the full re-check baseline, in the same cells.

A cell: `requests` concurrent requests at a context length decode one token per step. Every mode of a
(case, block size, context) cell gets the same block hashes (one seed per cell) and reads the same KV
tensors (2 layers x 256 B per block, so the figures are the store path's CPU, not memcpy); cases are
described in `store_path_cells`. Each connector is fed as its own scheduler feeds it, and both save
only what a step completed:

* `incremental`: kvpool's `WorkerCore` on the embedded MemoryBackend (saves in the step), fed the
  deltas kvpool's `SchedulerCore` builds: a request with no new block and no completed block costs one
  `quiet` check and is not sent (`store_path_kvpool`).
* `incremental_mooncake`: the same on kvpool's `MooncakeBackend`, configured as the vLLM adapter
  configures it (`roles.worker_config`: no existence check, a host copy in the step, puts on the sender
  thread lingering up to 8 steps), against a real mooncake_master on 127.0.0.1.
* `vllm`: vLLM's own connector worker and `KVCacheStoreSendingThread` on the same master, its save
  jobs emitted by vLLM's own `RequestTracker` / `ReqMeta.from_request_tracker`: one per request per
  completed block (`store_path_vllm`). vLLM 0.32's sender resumes from a per-request high-water mark
  (`_saved_offset`), so it too examines only new chunks; what it pays per job is its handler and a
  `batch_is_exist` and a put round trip to the master.
* `full`: the re-check baseline (vLLM's older store path): every save runs `process_tokens` from
  token 0, builds a key for every chunk, asks `exists` for all and puts the missing ones (memory).
* `full_on_block`: the same full save, only on the steps where a request completes a block.

Timed: the connector's calls and every thread they keep busy. Not timed: advancing the requests (the
engine's hashes and block ids, done before each window) and the pre-fill that stores each prompt. CPU
is `time.process_time` (all threads of the process: senders, vLLM's sending thread, the Mooncake
clients; not the master's process), wall `time.perf_counter`, both per decode step of all requests.
A window ends with a drain, so it pays for every chunk its steps saved; the fastest of `WINDOWS`
windows is reported (noise only adds), the contexts' windows interleaved. The Mooncake modes run one
after the other, each with the master's only segment: with two clients' segments, Mooncake places
objects at random and puts into the other client's segment go over TCP (and fail here).
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

from kvpool.backends.memory import MemoryBackend
from kvpool.benchmarks.per_step.store_path_cells import CASES, LAYER_BLOCK_BYTES, LAYERS, _Cell, _Pool, _Request
from kvpool.benchmarks.per_step.store_path_kvpool import _IncrementalRun, _measure_incremental
from kvpool.benchmarks.per_step.store_path_report import (
    TARGET_SCALING_MAX,
    TARGET_VLLM_MIN,
    plot,
    print_table,
    summarize,
    to_markdown,
)
from kvpool.core.chunks import process_tokens
from kvpool.core.keys import chunk_hashes

__all__ = [
    "ALL_ARGS",
    "CASES",
    "MODES",
    "TARGET_SCALING_MAX",
    "TARGET_VLLM_MIN",
    "TINY_ARGS",
    "_Cell",  # `bench scale` drives store-path's cells
    "_IncrementalRun",
    "plot",
    "print_table",
    "run",
    "to_markdown",
]

MODES = ("incremental", "incremental_mooncake", "vllm", "full", "full_on_block")
MOONCAKE_MODES = ("incremental_mooncake", "vllm")
FULL_KEYS_BUDGET = 600_000  # keys one full-mode cell may examine in its timed steps
MIN_FULL_STEPS = 4
WINDOWS = 5  # timed windows per cell, the fastest is reported (noise only adds time)
MOONCAKE_SEGMENT = "1GiB"  # each Mooncake client's share of the pool (faulted in lazily)

# `kvpool bench all`: every mode and case at the default size (~1.5-3 min on 2 cores)
ALL_ARGS: dict[str, Any] = {
    "contexts": [1024, 4096, 16384, 32768, 65536, 131072],
    "block_sizes": [16, 128],
    "requests": 8,
    "steps": 64,
    "modes": list(MODES),
    "cases": list(CASES),
}
# tests: a few seconds, the embedded pool only (no master, no vLLM)
TINY_ARGS: dict[str, Any] = {
    "contexts": [256, 1024],
    "block_sizes": [16],
    "requests": 2,
    "steps": 16,
    "windows": 1,
    "modes": ["incremental", "full", "full_on_block"],
    "cases": list(CASES),
}


# ---- the reference (full re-check) store path ---------------------------------------------------


def _full_save(cell: _Cell, backend: MemoryBackend, request: _Request, token_len: int) -> int:
    """One save job of the full re-check store path, from token 0. Returns the keys examined."""
    coord = cell.coordinator
    token_len = coord.align(token_len)
    masks = coord.store_masks(token_len, 0, request.prompt_tokens)
    examined = 0
    for group, (kind, placement) in enumerate(zip(coord.kinds, cell.placements)):
        hashes = chunk_hashes(request.known_hashes, coord.hash_block_size, kind.block_size)
        prefix, table = placement.keys.prefix, request.tables[group]
        keys: list[str] = []
        blocks: list[int] = []
        for start, _end, chunk_hash in process_tokens(
            token_len,
            hashes,
            0,
            masks[group],
            block_size=kind.block_size,
            put_step=placement.put_step,
            put_step_rank=placement.put_step_rank,
        ):
            keys.append(prefix + chunk_hash.hex())
            blocks.append(table[start // kind.block_size])
        examined += len(keys)
        missing = [i for i, there in enumerate(backend.exists(keys)) if not there]
        if missing:
            backend.put([keys[i] for i in missing], cell.layout.save_rows(group, [blocks[i] for i in missing]))
    return examined


def _measure_full(cell: _Cell, steps: int, on_block: bool) -> dict[str, float]:
    backend = MemoryBackend(cell.capacity)
    for request, length in zip(cell.requests, cell.start_lengths):
        cell.grow(request, length)
        _full_save(cell, backend, request, length)  # pre-fill, untimed
    b = cell.block_size
    examined = 0
    plan = cell.advance(steps)
    gc.collect()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for step in plan:
        for item in step:
            length = item.before + 1
            if not on_block or length % b == 0:
                examined += _full_save(cell, backend, item.request, length)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    backend.clear()
    return {"cpu_s": cpu, "wall_s": wall, "examined": examined, "steps": steps}


# ---- driver ---------------------------------------------------------------------------------------


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@contextlib.contextmanager
def _mooncake(modes: Sequence[str]) -> Iterator[Any]:
    """One real mooncake_master on 127.0.0.1 for every Mooncake-backed mode of the run (None: no such mode)."""
    if not set(modes) & set(MOONCAKE_MODES):
        yield None
        return
    from kvpool.backends.mooncake.master import start_master

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    master = start_master()
    try:
        yield master
    finally:
        master.stop()


def run(
    contexts: list[int],
    block_sizes: list[int],
    requests: int,
    steps: int,
    modes: Sequence[str] | None = None,
    cases: Sequence[str] | None = None,
    windows: int | None = None,
) -> dict[str, Any]:
    unknown = sorted(set(modes or ()) - set(MODES)) + sorted(set(cases or ()) - set(CASES))
    modes = [m for m in MODES if m in set(modes or MODES)]  # in MODES order
    cases = list(dict.fromkeys(cases or ("full",)))
    if unknown or not contexts or not block_sizes or requests <= 0 or steps <= 0:
        raise ValueError(
            f"store-path bench needs modes from {MODES} and cases from {CASES} (unknown: {unknown}), "
            "contexts, block sizes, requests > 0 and steps > 0"
        )
    windows = windows or WINDOWS
    contexts = sorted(set(contexts))
    for block_size in block_sizes:
        if block_size <= 0 or contexts[0] < block_size:
            raise ValueError(f"context {contexts[0]} is shorter than block size {block_size}")
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    # warm up (imports, first threads, allocator) so the first measured cell is not penalised
    _measure_incremental({1024: _Cell(1024, 16, 2, 64 * 2, 0)}, 64, 2)
    _measure_full(_Cell(1024, 16, 2, 8, 0), 8, on_block=False)
    with _mooncake(modes) as master, contextlib.ExitStack() as vllm_scope:
        vllm_session = None
        if "vllm" in modes:
            from kvpool.benchmarks.per_step import store_path_vllm

            vllm_session = vllm_scope.enter_context(store_path_vllm.session(master.address))
        vllm_scope.callback(gc.unfreeze)
        for case in cases:
            for block_size in block_sizes:
                # every request completes the same number of blocks inside an incremental window
                window_steps = _round_up(max(steps, block_size), block_size)
                # what lives on (vLLM's and torch's modules: ~1M objects) out of the collector's sight, so
                # the collection before each window takes milliseconds, not a fifth of a second
                gc.collect()
                gc.freeze()
                measured = _measure_cells(
                    case, block_size, contexts, requests, steps, window_steps, windows, modes, master, vllm_session
                )
                for mode in modes:
                    for context in contexts:
                        results.append(_row(mode, case, context, block_size, requests, measured[mode, context]))
    return {
        "bench": "store-path",
        "backend": "memory, mooncake (real mooncake_master on 127.0.0.1)" if master else "memory",
        "requests": requests,
        "steps": steps,
        "windows": windows,
        "modes": modes,
        "cases": cases,
        "chunk_bytes": LAYERS * LAYER_BLOCK_BYTES,
        "results": results,
        "summary": summarize(results, contexts, block_sizes, cases, modes),
        "elapsed_s": round(time.perf_counter() - started, 2),
        "notes": _notes(windows),
    }


def _measure_cells(
    case: str,
    block_size: int,
    contexts: list[int],
    requests: int,
    steps: int,
    window_steps: int,
    windows: int,
    modes: Sequence[str],
    master: Any,
    vllm_session: Any,
) -> dict[tuple[str, int], dict[str, float]]:
    """Every selected mode over the contexts of one (case, block size); the same seed per context."""
    measured: dict[tuple[str, int], dict[str, float]] = {}
    pool = _Pool(case, block_size, contexts, requests, window_steps * windows)

    def seed(context: int) -> int:
        return context * 1000 + block_size * 10 + CASES.index(case)

    def cells() -> dict[int, _Cell]:
        return {context: pool.cell(context, seed(context)) for context in contexts}

    if "incremental" in modes:
        for context, m in _measure_incremental(cells(), window_steps, windows).items():
            measured["incremental", context] = m
    if "incremental_mooncake" in modes:
        from kvpool.backends.mooncake import MooncakeBackend

        backend = MooncakeBackend.from_options(
            {**master.backend_options(), "global_segment_size": MOONCAKE_SEGMENT, "staging_bytes": "16MiB"}
        )
        try:
            for context, m in _measure_incremental(cells(), window_steps, windows, backend).items():
                measured["incremental_mooncake", context] = m
        finally:
            backend.close()  # its segment goes with it: the objects of these cells vanish
    if vllm_session is not None:
        for context, m in vllm_session.measure(pool, cells(), window_steps, windows).items():
            measured["vllm", context] = m
    for context in contexts:
        if "full" in modes:
            keys_per_step = requests * (context // block_size) * len(pool.kinds) // pool.put_step
            full_steps = max(MIN_FULL_STEPS, min(steps, FULL_KEYS_BUDGET // max(1, keys_per_step)))
            measured["full", context] = _measure_full(pool.cell(context, seed(context)), full_steps, on_block=False)
        if "full_on_block" in modes:
            measured["full_on_block", context] = _measure_full(
                pool.cell(context, seed(context)), window_steps, on_block=True
            )
    return measured


def _row(mode: str, case: str, context: int, block_size: int, requests: int, m: dict[str, float]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "mode": mode,
        "case": case,
        "context_tokens": context,
        "block_size": block_size,
        "requests": requests,
        "steps": int(m["steps"]),
        "cpu_us_per_step": round(m["cpu_s"] / m["steps"] * 1e6, 2),
        "wall_us_per_step": round(m["wall_s"] / m["steps"] * 1e6, 2),
        "keys_examined_per_step": round(m["examined"] / m["steps"], 4),
    }
    if "stored" in m:
        row["chunks_stored"], row["chunks_expected"] = int(m["stored"]), int(m["expected"])
    if "jobs" in m:
        row["save_jobs_per_step"] = round(m["jobs"] / m["steps"], 4)  # each one put call of its sending thread
    if "put_calls" in m:
        row["put_calls_per_step"] = round(m["put_calls"] / m["steps"], 4)
    return row


def _notes(windows: int) -> list[str]:
    return [
        "cpu_us_per_step: process CPU time (all threads: senders, vLLM's sending thread, Mooncake clients) "
        "per decode step of all requests; the mooncake_master's own CPU is not in it",
        f"incremental modes and vllm: fastest of {windows} windows of `steps` steps rounded up to a multiple of "
        "the block size, contexts interleaved; each window ends with a drain, so it pays for every chunk it saved",
        "incremental modes: deltas from kvpool's SchedulerCore (quiet requests are not sent), the adapter's "
        "worker calls; incremental_mooncake with the adapter's Mooncake settings (no exists, 8-step linger)",
        "vllm: save jobs emitted by vLLM's RequestTracker + ReqMeta.from_request_tracker (a job only when a block "
        "completes), handed to its worker's wait_for_save and handled by its KVCacheStoreSendingThread",
        "requests advance (hashes, block ids) before each window, untimed: the engine's work, not a connector's",
        "full: process_tokens from token 0 + a key per chunk + exists for all + put missing, every step; "
        f"fewer steps (>= {MIN_FULL_STEPS}) where a cell would examine over {FULL_KEYS_BUDGET} keys",
        "full_on_block: the same full save, only on steps where a request completes a block",
    ]
