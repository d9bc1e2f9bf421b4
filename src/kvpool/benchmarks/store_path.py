"""CPU cost per engine step of the save path: incremental store vs the full re-check it replaces.

`requests` concurrent requests decode one token per step at a given context length; each step every
request saves its KV up to its new length, against the embedded MemoryBackend.

* `incremental`: the real `WorkerCore` path (deltas → `apply` → `save` → sender thread), drained
  every step so the sender's work is inside the timed window. Each save examines only the chunks
  past the request's high-water mark.
* `full`: a faithful re-creation of vLLM's reference store path: every save runs `process_tokens`
  from token 0, builds a key for every chunk, asks `exists` for all of them and puts the missing
  ones. Run inline (the reference runs it on a sender thread: same CPU, measured the same way).
* `full_on_block`: the same full save, issued only on the steps where a request completes a block
  (how vLLM's reference scheduler gates save jobs): the per-step average of the baseline as shipped.

KV blocks are small (2 layers x 256 B) so the figures are the store path's CPU, not memcpy.
CPU time is `time.process_time` (every thread of the process, sender included), wall time is
`time.perf_counter`; both are divided by the steps measured.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvpool.backends.memory import MemoryBackend
from kvpool.chunks import process_tokens
from kvpool.keys import KeySpace, LayoutFingerprint, chunk_hashes
from kvpool.layout import KVLayout
from kvpool.masks import FullAttention, MaskCoordinator
from kvpool.metadata import RequestDelta
from kvpool.plan import GroupPlacement
from kvpool.worker import WorkerConfig, WorkerCore

LAYERS = 2
LAYER_BLOCK_BYTES = 256
HASH_BYTES = 32  # sha256-sized block hashes, like vLLM's default
MODES = ("incremental", "full", "full_on_block")
TARGET_SCALING_MAX = 1.5  # incremental: largest context vs smallest, per step
TARGET_SPEEDUP_MIN = 50.0  # full vs incremental at the largest context, per step
FULL_KEYS_BUDGET = 1_500_000  # keys one full-mode cell may examine in its timed steps
MIN_FULL_STEPS = 4
WINDOWS = 5  # incremental cells: timed windows, the fastest is reported (noise only adds time)


@dataclass
class _Request:
    req_id: str
    hashes: list[bytes]  # every hash this request will ever have
    first_block: int
    length: int = 0
    known_hashes: list[bytes] = field(default_factory=list)  # what the engine knows so far
    table: list[int] = field(default_factory=list)


class _Cell:
    """One (context, block size) setting: KV tensors, requests and their hashes."""

    def __init__(self, context: int, block_size: int, requests: int, max_steps: int, seed: int) -> None:
        self.block_size = block_size
        self.coordinator = MaskCoordinator([FullAttention(block_size)])
        fingerprint = LayoutFingerprint("bench/model", "uint8", block_size, "bench", chunk_bytes=LAYERS * 256)
        self.space = KeySpace(fingerprint)
        blocks_per_request = -(-(context + max_steps) // block_size) + 1
        num_blocks = requests * blocks_per_request + 1
        self.tensors = {f"layer{i}": np.zeros((num_blocks, LAYER_BLOCK_BYTES), dtype=np.uint8) for i in range(LAYERS)}
        for tensor in self.tensors.values():
            tensor[:, 0] = np.arange(num_blocks) % 251  # distinct, cheap content
        self.layout = KVLayout(self.tensors, dict.fromkeys(self.tensors, 0), num_blocks)
        rng = np.random.default_rng(seed)
        self.requests: list[_Request] = []
        for r in range(requests):
            count = blocks_per_request
            raw = rng.bytes(HASH_BYTES * count)
            hashes = [raw[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(count)]
            self.requests.append(_Request(f"req-{r}", hashes, 1 + r * blocks_per_request))
        # stagger the requests inside a block so block completions spread over the steps
        self.start_lengths = [context - (r * block_size // requests) for r in range(requests)]
        self.capacity = int(num_blocks * LAYERS * LAYER_BLOCK_BYTES * 1.25) + (1 << 20)

    def grow(self, request: _Request, length: int) -> tuple[list[bytes], list[int]]:
        """Advance a request to `length` tokens: the hashes and block ids that became known."""
        b = self.block_size
        new_hashes = request.hashes[len(request.known_hashes) : length // b]
        new_blocks = list(range(request.first_block + len(request.table), request.first_block + -(-length // b)))
        request.known_hashes.extend(new_hashes)
        request.table.extend(new_blocks)
        request.length = length
        return new_hashes, new_blocks


# ---- the reference (full re-check) store path ---------------------------------------------------


def _full_save(cell: _Cell, backend: MemoryBackend, request: _Request, token_len: int) -> int:
    """One save job of vLLM's reference store path, from token 0. Returns the keys examined."""
    coord = cell.coordinator
    token_len = coord.align(token_len)
    masks = coord.store_masks(token_len, 0, token_len)
    keys: list[str] = []
    blocks: list[int] = []
    prefix = cell.space.prefix
    for group, kind in enumerate(coord.kinds):
        hashes = chunk_hashes(request.known_hashes, coord.hash_block_size, kind.block_size)
        for start, _end, chunk_hash in process_tokens(token_len, hashes, 0, masks[group], block_size=kind.block_size):
            keys.append(prefix + chunk_hash.hex())
            blocks.append(request.table[start // kind.block_size])
    present = backend.exists(keys)
    missing = [i for i, there in enumerate(present) if not there]
    if missing:
        backend.put([keys[i] for i in missing], cell.layout.save_rows(0, [blocks[i] for i in missing]))
    return len(keys)


def _measure_full(cell: _Cell, steps: int, on_block: bool) -> dict[str, float]:
    backend = MemoryBackend(cell.capacity)
    for request, length in zip(cell.requests, cell.start_lengths):
        cell.grow(request, length)
        _full_save(cell, backend, request, length)  # pre-fill, untimed
    b = cell.block_size
    examined = 0
    gc.collect()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        for request in cell.requests:
            length = request.length + 1
            cell.grow(request, length)
            if not on_block or length % b == 0:
                examined += _full_save(cell, backend, request, length)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    backend.clear()
    return {"cpu_s": cpu, "wall_s": wall, "examined": examined, "steps": steps}


# ---- the incremental store path (the real WorkerCore) -----------------------------------------


class _IncrementalRun:
    """A WorkerCore over one cell, pre-filled to the context; `window` times decode steps."""

    def __init__(self, cell: _Cell) -> None:
        self.cell = cell
        self.backend = MemoryBackend(cell.capacity)
        self.engine = WorkerCore(
            self.backend,
            cell.coordinator,
            [GroupPlacement(cell.space)],
            cell.layout,
            WorkerConfig(sync_saves=True),
        )
        prefill = []
        for request, length in zip(cell.requests, cell.start_lengths):
            new_hashes, new_blocks = cell.grow(request, length)
            prefill.append(
                RequestDelta(
                    request.req_id,
                    new_hashes=new_hashes,
                    new_blocks=(new_blocks,),
                    num_prompt_tokens=length,
                    save_tokens=length,
                )
            )
        self.engine.apply(prefill)
        self.engine.save(prefill)
        if not self.engine.drain(600):
            raise RuntimeError("pre-fill saves did not finish")

    def window(self, steps: int) -> tuple[float, float, int]:
        engine, cell = self.engine, self.cell
        examined0 = engine.stats.chunks_examined
        gc.collect()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            deltas = []
            for request in cell.requests:
                before = request.length
                new_hashes, new_blocks = cell.grow(request, before + 1)
                deltas.append(
                    RequestDelta(
                        request.req_id,
                        new_hashes=new_hashes,
                        new_blocks=(new_blocks,) if new_blocks else None,
                        save_tokens=before + 1,  # every step saves; the worker finds what is new
                        computed_before=before,
                    )
                )
            engine.apply(deltas)
            engine.save(deltas)
            engine.drain()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        return cpu, wall, engine.stats.chunks_examined - examined0

    def close(self) -> None:
        stats = self.engine.stats
        self.engine.close()
        self.backend.clear()
        if stats.chunks_put_failed or stats.save_jobs_dropped:
            raise RuntimeError(f"incremental saves failed: {stats}")


def _measure_incremental(cells: dict[int, _Cell], steps: int, windows: int) -> dict[int, dict[str, float]]:
    """Windows of every context in turn (a burst of machine noise hits all contexts alike); the
    fastest window of each context is its figure."""
    runs = {context: _IncrementalRun(cell) for context, cell in cells.items()}
    try:
        samples: dict[int, list[tuple[float, float, int]]] = {context: [] for context in cells}
        for _ in range(windows):
            for context, incremental in runs.items():
                samples[context].append(incremental.window(steps))
    finally:
        for incremental in runs.values():
            incremental.close()
    out = {}
    for context, measured in samples.items():
        cpu, wall, examined = min(measured)
        out[context] = {"cpu_s": cpu, "wall_s": wall, "examined": examined, "steps": steps}
    return out


# ---- driver ---------------------------------------------------------------------------------------


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def run(contexts: list[int], block_sizes: list[int], requests: int, steps: int) -> dict[str, Any]:
    if not contexts or not block_sizes or requests <= 0 or steps <= 0:
        raise ValueError("store-path bench needs contexts, block sizes, requests > 0 and steps > 0")
    contexts = sorted(set(contexts))
    for block_size in block_sizes:
        if block_size <= 0 or contexts[0] < block_size:
            raise ValueError(f"context {contexts[0]} is shorter than block size {block_size}")
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    # warm up (imports, first threads, allocator) so the first measured cell is not penalised
    _measure_incremental({1024: _Cell(1024, 16, 2, 64 * 2, 0)}, 64, 2)
    _measure_full(_Cell(1024, 16, 2, 8, 0), 8, on_block=False)
    for block_size in block_sizes:
        # every request completes the same number of blocks inside an incremental window
        incremental_steps = _round_up(max(steps, block_size), block_size)
        measured: dict[tuple[str, int], dict[str, float]] = {}
        cells = {
            c: _Cell(c, block_size, requests, incremental_steps * WINDOWS, c * 1000 + block_size) for c in contexts
        }
        for context, m in _measure_incremental(cells, incremental_steps, WINDOWS).items():
            measured["incremental", context] = m
        del cells
        for context in contexts:
            seed = context * 1000 + block_size
            full_steps = max(MIN_FULL_STEPS, min(steps, FULL_KEYS_BUDGET // max(1, requests * context // block_size)))
            cell = _Cell(context, block_size, requests, full_steps, seed)
            measured["full", context] = _measure_full(cell, full_steps, on_block=False)
            cell = _Cell(context, block_size, requests, incremental_steps, seed)
            measured["full_on_block", context] = _measure_full(cell, incremental_steps, on_block=True)
            del cell
        for mode in MODES:
            for context in contexts:
                m = measured[mode, context]
                results.append(
                    {
                        "mode": mode,
                        "context_tokens": context,
                        "block_size": block_size,
                        "requests": requests,
                        "steps": int(m["steps"]),
                        "cpu_us_per_step": round(m["cpu_s"] / m["steps"] * 1e6, 2),
                        "wall_us_per_step": round(m["wall_s"] / m["steps"] * 1e6, 2),
                        "keys_examined_per_step": round(m["examined"] / m["steps"], 4),
                    }
                )
    return {
        "bench": "store-path",
        "backend": "memory",
        "requests": requests,
        "steps": steps,
        "chunk_bytes": LAYERS * LAYER_BLOCK_BYTES,
        "results": results,
        "summary": _summary(results, contexts, block_sizes),
        "elapsed_s": round(time.perf_counter() - started, 2),
        "notes": [
            "cpu_us_per_step: process CPU time (all threads, the sender's included) per decode step of all requests",
            "incremental: the real WorkerCore path, drained every step; fastest of "
            f"{WINDOWS} windows (contexts interleaved) of `steps` steps rounded up to a multiple of the block size",
            "full: process_tokens from token 0 + a key per chunk + exists for all + put missing, every step; "
            f"fewer steps (>= {MIN_FULL_STEPS}) where a cell would examine over {FULL_KEYS_BUDGET} keys",
            "full_on_block: the same full save, only on steps where a request completes a block "
            "(vLLM's reference scheduler emits save jobs that way)",
        ],
    }


def _cost(results: Sequence[dict[str, Any]], mode: str, context: int, block_size: int) -> float:
    for row in results:
        if (row["mode"], row["context_tokens"], row["block_size"]) == (mode, context, block_size):
            return float(row["cpu_us_per_step"])
    raise KeyError((mode, context, block_size))


def _ratio(a: float, b: float) -> float:
    return round(a / b, 2) if b > 0 else math.inf


def _summary(results: Sequence[dict[str, Any]], contexts: list[int], block_sizes: list[int]) -> dict[str, Any]:
    small, large = contexts[0], contexts[-1]
    per_block: dict[str, Any] = {}
    for block_size in block_sizes:
        inc_small = _cost(results, "incremental", small, block_size)
        inc_large = _cost(results, "incremental", large, block_size)
        scaling = _ratio(inc_large, inc_small)
        speedup = _ratio(_cost(results, "full", large, block_size), inc_large)
        speedup_on_block = _ratio(_cost(results, "full_on_block", large, block_size), inc_large)
        per_block[str(block_size)] = {
            "incremental_large_vs_small": scaling,
            "incremental_scaling_pass": scaling <= TARGET_SCALING_MAX,
            "full_vs_incremental_at_large": speedup,
            "full_speedup_pass": speedup >= TARGET_SPEEDUP_MIN,
            "full_on_block_vs_incremental_at_large": speedup_on_block,
        }
    return {
        "small_context": small,
        "large_context": large,
        "targets": {
            "incremental_large_vs_small_max": TARGET_SCALING_MAX,
            "full_vs_incremental_at_large_min": TARGET_SPEEDUP_MIN,
        },
        "per_block_size": per_block,
        "pass": all(v["incremental_scaling_pass"] and v["full_speedup_pass"] for v in per_block.values()),
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"store path: CPU per decode step, {result['requests']} requests, memory pool")
    for column in ("mode", "context", "block", "steps", "CPU µs/step", "wall µs/step", "keys examined/step"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for row in result["results"]:
        table.add_row(
            row["mode"],
            f"{row['context_tokens']:,}",
            str(row["block_size"]),
            str(row["steps"]),
            f"{row['cpu_us_per_step']:,.1f}",
            f"{row['wall_us_per_step']:,.1f}",
            f"{row['keys_examined_per_step']:,.2f}",
        )
    console.print(table)
    summary = result["summary"]
    small, large = summary["small_context"], summary["large_context"]
    targets = summary["targets"]
    for block_size, v in summary["per_block_size"].items():
        scaling = "PASS" if v["incremental_scaling_pass"] else "FAIL"
        speedup = "PASS" if v["full_speedup_pass"] else "FAIL"
        console.print(
            f"block {block_size}: incremental {large:,} vs {small:,} tokens = {v['incremental_large_vs_small']}x "
            f"(target <= {targets['incremental_large_vs_small_max']}x) {scaling}; "
            f"full vs incremental at {large:,} = {v['full_vs_incremental_at_large']}x "
            f"(target >= {targets['full_vs_incremental_at_large_min']}x) {speedup}; "
            f"full saving only on block completion = {v['full_on_block_vs_incremental_at_large']}x"
        )
    for note in result.get("notes", []):
        console.print(f"[dim]{note}[/dim]")
