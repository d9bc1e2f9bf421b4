"""How kvpool scales: per-request cost against concurrency, and the embedded pool at capacity.

Concurrency (1 ... 256 requests in one engine step). Two costs must grow linearly with the
requests, never faster, so the cost *per request* stays flat:
* `store`: the worker's save path per decode step: the real `WorkerCore` over the embedded
  `MemoryBackend`, driven exactly as the store-path bench drives it (`store_path._IncrementalRun`:
  deltas -> `apply` -> `save` -> drain, every request saving every step). CPU time
  (`time.process_time`) per step, fastest of `windows` windows with the concurrencies interleaved.
  Windows run at least `min_request_steps` request-steps so one request is timed over as many saves.
* `lookup`: N requests arriving in one step, each asking the scheduler's `SchedulerCore.lookup` for
  its longest stored prefix, answered by the `PoolIndex` of the workers' pools, as the lookup bench
  does. The index holds the chains of the largest concurrency whatever N is (half of every prompt
  stored), so only the concurrency changes, and each step's arrivals are the next N of those prompts
  (at N = 1 too: no prompt is looked up hot from the cache). Wall time (`time.perf_counter`) per
  step, median of reps.
Target: per-request cost at the largest concurrency <= 1.5x that at the smallest.

Capacity (`scale_pool.py`): an embedded pool of fixed capacity fed a prefix-reuse workload whose
working set is several times larger (shared Zipf-popular prefixes, each request with a unique
suffix; lookup, load, then save of what the pool lacks, as the engine does), once as plain LRU in
forward order (`scale_pool.PlainLRU`, a chain's head evicted first: the pool before chains aged tail
first) and once as `MemoryBackend` is (tail first). Eviction rate, hit rate, reachable prefix length
and unreachable bytes, before and after. Targets: chain-aware hit rate >= plain LRU's, and its
unreachable bytes lower.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.benchmarks.measure.report import figure, markdown_table, verdict
from kvpool.benchmarks.per_step.scale_pool import POLICIES, capacity_row
from kvpool.benchmarks.per_step.store_path import _Cell, _IncrementalRun
from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.core.masks import FullAttention, MaskCoordinator
from kvpool.core.pool_reports import PoolReport
from kvpool.scheduler.index import PoolIndex
from kvpool.scheduler.scheduler_core import SchedulerCore
from kvpool.worker.worker_core import WorkerConfig

TARGET_PER_REQUEST_MAX = 1.5  # per-request cost, largest concurrency vs smallest
TARGET_HIT_MIN = 1.0  # chain-aware token hit rate vs plain LRU's

ALL_ARGS: dict[str, Any] = {  # `kvpool bench all` (and the CLI's defaults): about 15 s on 2 cores
    "concurrency": [1, 4, 16, 64, 256],
    "steps": 64,
    "windows": 7,
    "min_request_steps": 8192,
    "prompt_tokens": 4096,
    "lookup_requests": 50_000,
    "pool_requests": 20_000,
}
TINY_ARGS: dict[str, Any] = {  # the tests: well under a second
    "concurrency": [1, 4, 16],
    "steps": 16,
    "windows": 2,
    "min_request_steps": 64,
    "prompt_tokens": 512,
    "lookup_requests": 256,
    "min_reps": 10,
    "prefixes": 16,
    "prefix_chunks": 16,
    "suffix_chunks": 4,
    "capacity_chunks": 64,
    "pool_requests": 600,
}


# ---- concurrency ----------------------------------------------------------------------------------


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _store_rows(
    concurrency: list[int], context: int, block_size: int, steps: int, windows: int, min_request_steps: int
) -> list[dict[str, Any]]:
    # every request completes the same number of blocks per window: steps are a multiple of the block
    window_steps = {n: _round_up(max(steps, -(-min_request_steps // n)), block_size) for n in concurrency}
    runs = {n: _IncrementalRun(_Cell(context, block_size, n, window_steps[n] * windows, n)) for n in concurrency}
    samples: dict[int, list[tuple[float, float, int]]] = {n: [] for n in concurrency}
    try:
        for _ in range(windows):  # interleaved: a burst of machine noise hits every concurrency alike
            for n, incremental in runs.items():
                samples[n].append(incremental.window(window_steps[n]))
    finally:
        for incremental in runs.values():
            incremental.close()
    rows = []
    for n in concurrency:
        cpu, wall, examined = min(samples[n])  # noise only adds time
        per_step = cpu / window_steps[n] * 1e6
        rows.append(
            {
                "part": "store",
                "requests": n,
                "steps": window_steps[n],
                "us_per_step": round(per_step, 2),
                "us_per_request": round(per_step / n, 3),
                "wall_us_per_step": round(wall / window_steps[n] * 1e6, 2),
                "keys_per_request": round(examined / (window_steps[n] * n), 4),
            }
        )
    return rows


def _unused(keys: list[str]) -> list[bool]:
    raise AssertionError("the index answers")


def _lookup_rows(
    concurrency: list[int], prompt_tokens: int, block_size: int, lookup_requests: int, min_reps: int
) -> list[dict[str, Any]]:
    coord = MaskCoordinator([FullAttention(block_size)])
    space = KeySpace(LayoutFingerprint("bench/scale", "bf16", block_size, "bench"))
    chunks, stored = prompt_tokens // block_size, prompt_tokens // block_size // 2
    raw = np.random.default_rng(7).bytes(32 * chunks * max(concurrency))
    hashes = [raw[i : i + 32] for i in range(0, len(raw), 32)]
    prompts = [hashes[first : first + chunks] for first in range(0, len(hashes), chunks)]
    index = PoolIndex([[space]])  # as the workers report a save: each chunk with its parent in the chain
    held = [h for prompt in prompts for h in prompt[:stored]]
    parents = {h: prompt[i - 1] if i else b"" for prompt in prompts for i, h in enumerate(prompt[:stored])}
    index.apply(PoolReport(0, 0, stored={space.prefix: held}, parents={space.prefix: parents}))
    core = SchedulerCore(coord, [[space]], _unused, index=index)
    rows = []
    for n in concurrency:
        reps = max(min_reps, -(-lookup_requests // n))
        keys0, hits0, lookups0 = core.stats.lookup_keys, core.stats.lookup_hit_tokens, core.stats.lookups
        samples = []
        for rep in range(reps + 1):  # each step's arrivals are the next n prompts: no prompt stays hot in cache
            arriving = [prompts[(rep * n + r) % len(prompts)] for r in range(n)]
            samples.append(_lookup_step(core, arriving, prompt_tokens + 1, f"{n}-{rep}"))
        samples = samples[1:]  # the first step warms up
        lookups = core.stats.lookups - lookups0
        if core.stats.lookup_hit_tokens - hits0 != lookups * stored * block_size:
            raise AssertionError(f"{n} requests: the lookups did not find the {stored * block_size} stored tokens")
        ordered = sorted(samples)
        p50 = statistics.median(ordered) * 1e6
        rows.append(
            {
                "part": "lookup",
                "requests": n,
                "steps": reps,
                "us_per_step": round(p50, 2),
                "p99_us_per_step": round(ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1e6, 2),
                "us_per_request": round(p50 / n, 3),
                "keys_per_request": round((core.stats.lookup_keys - keys0) / lookups, 4),
            }
        )
    return rows


def _lookup_step(core: SchedulerCore, prompts: list[list[bytes]], num_tokens: int, step: str) -> float:
    """One step's arrivals, looked up one after another on the scheduler's thread; seconds."""
    ids = [f"{step}-{r}" for r in range(len(prompts))]
    began = time.perf_counter()
    for req_id, hashes in zip(ids, prompts):
        core.lookup(req_id, hashes, num_tokens)
    elapsed = time.perf_counter() - began
    for req_id in ids:  # the requests end: no cached answer is reused by the next step
        core.finish(req_id)
    return elapsed


# ---- driver ---------------------------------------------------------------------------------------


def run(
    *,
    concurrency: Sequence[int] = (1, 4, 16, 64, 256),
    context: int = 1024,
    block_size: int = 16,
    steps: int = 64,
    windows: int = 7,
    min_request_steps: int = 8192,
    prompt_tokens: int = 4096,
    lookup_requests: int = 50_000,
    min_reps: int = 200,
    prefixes: int = 64,
    prefix_chunks: int = 32,
    suffix_chunks: int = 8,
    capacity_chunks: int = 512,
    pool_requests: int = 20_000,
    zipf: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Both halves in one run, so the ratios compare figures taken on the same machine state. The
    defaults are the full run (`ALL_ARGS`); `seed` fixes the capacity workload's requests."""
    levels = sorted(set(concurrency))
    if not levels or levels[0] < 1 or min(steps, windows, min_reps, pool_requests) < 1:
        raise ValueError("scale bench needs concurrency >= 1, steps, windows, reps and pool requests > 0")
    if context < block_size or prompt_tokens < 2 * block_size:
        raise ValueError(f"context {context} and prompt {prompt_tokens} tokens: too short for block size {block_size}")
    if min(prefixes, prefix_chunks, suffix_chunks) < 1 or capacity_chunks < prefix_chunks + suffix_chunks:
        raise ValueError(f"capacity {capacity_chunks} chunks cannot hold one request's chain")
    started = time.perf_counter()
    _store_rows([1, 2], context, block_size, block_size, 1, block_size)  # warm-up: imports, allocator, first saves
    gc.collect()
    rows = _store_rows(levels, context, block_size, steps, windows, min_request_steps)
    rows += _lookup_rows(levels, prompt_tokens, block_size, lookup_requests, min_reps)
    workload: dict[str, Any] = {
        "prefixes": prefixes,
        "prefix_chunks": prefix_chunks,
        "suffix_chunks": suffix_chunks,
        "capacity_chunks": capacity_chunks,
        "pool_requests": pool_requests,
        "zipf": zipf,
        "batch_chunks": WorkerConfig().put_batch_chunks,
    }
    rows += [capacity_row(policy, seed=seed, **workload) for policy in POLICIES]
    return {
        "bench": "scale",
        "backend": "memory",
        "context_tokens": context,
        "block_size": block_size,
        "prompt_tokens": prompt_tokens,
        "workload": {**workload, "working_set_vs_capacity": round(prefixes * prefix_chunks / capacity_chunks, 2)},
        "results": rows,
        "summary": _summary(rows),
        "elapsed_s": round(time.perf_counter() - started, 2),
        "notes": [
            "store: CPU µs per decode step of all requests (WorkerCore, sync saves, drained every step); "
            f"fastest of {windows} interleaved windows",
            "lookup: wall µs per step for N requests arriving at once (SchedulerCore over PoolIndex), median",
            "capacity: plain_lru = PlainLRU (batches touched head to tail); chain_aware = MemoryBackend as it is "
            "(tail first); at capacity every put evicts a chunk, so eviction_rate is ~1 for both",
        ],
    }


def _part(rows: Sequence[dict[str, Any]], part: str) -> list[dict[str, Any]]:
    """The rows of one part: by concurrency; the pools in `POLICIES` order (before, then after)."""
    return sorted((r for r in rows if r["part"] == part), key=lambda r: r["requests"])


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b > 0 else (1.0 if a == 0 else math.inf)


def _summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "targets": {
            "per_request_largest_vs_smallest_max": TARGET_PER_REQUEST_MAX,
            "chain_aware_vs_plain_lru_hit_rate_min": TARGET_HIT_MIN,
            "chain_aware_unreachable_bytes": "lower than plain_lru's",
        }
    }
    for part in ("store", "lookup"):
        cells = _part(rows, part)
        ratio = _ratio(cells[-1]["us_per_request"], cells[0]["us_per_request"])
        out[f"{part}_per_request_{cells[-1]['requests']}_vs_{cells[0]['requests']}"] = ratio
        out[f"{part}_pass"] = ratio <= TARGET_PER_REQUEST_MAX
    pools = {r["policy"]: r for r in _part(rows, "capacity")}
    before, after = pools["plain_lru"], pools["chain_aware"]
    out["hit_rate_chain_aware_vs_plain_lru"] = _ratio(after["token_hit_rate"], before["token_hit_rate"])
    out["hit_pass"] = after["token_hit_rate"] >= TARGET_HIT_MIN * before["token_hit_rate"]
    out["unreachable_chain_aware_vs_plain_lru"] = _ratio(after["unreachable_bytes"], before["unreachable_bytes"])
    lost_after, lost_before = after["unreachable_bytes"], before["unreachable_bytes"]
    out["unreachable_pass"] = lost_after < lost_before or lost_after == 0
    out["pass"] = all(out[f"{name}_pass"] for name in ("store", "lookup", "hit", "unreachable"))
    return out


# ---- output ---------------------------------------------------------------------------------------

_COST_HEADERS = ("part", "requests", "steps", "µs/step", "µs/request", "keys/request")
_POOL_HEADERS = (
    "pool", "evicted/put", "puts/req", "token hit", "unbounded", "req hit", "reach chunks", "lost KiB", "lost share",
)


def _cost_cells(row: dict[str, Any]) -> list[object]:
    keys = ("part", "requests", "steps", "us_per_step", "us_per_request", "keys_per_request")
    return [row[key] for key in keys]


_LABELS = {"plain_lru": "plain LRU", "chain_aware": "chain-aware"}  # before, after


def _pool_cells(row: dict[str, Any]) -> list[object]:
    keys = ("eviction_rate", "puts_per_request", "token_hit_rate", "ideal_token_hit_rate")
    cells: list[object] = [_LABELS[row["policy"]], *(row[key] for key in keys)]
    return [*cells, row["request_hit_fraction"], row["reachable_prefix_chunks"],
            round(row["unreachable_bytes"] / 1024, 2), row["unreachable_fraction"]]


def _verdicts(result: dict[str, Any]) -> list[str]:
    s = result["summary"]
    lines = []
    for part, what in (("store", "store path"), ("lookup", "lookup")):
        key = next(k for k in s if k.startswith(f"{part}_per_request_"))
        largest, smallest = key.removeprefix(f"{part}_per_request_").split("_vs_")
        lines.append(
            verdict(
                f"{what} cost per request, {largest} vs {smallest} requests", s[key],
                f"<= {TARGET_PER_REQUEST_MAX}x", s[f"{part}_pass"],
            )
        )
    lines.append(
        verdict("chain-aware vs plain-LRU token hit rate", s["hit_rate_chain_aware_vs_plain_lru"],
                f">= {TARGET_HIT_MIN}x", s["hit_pass"])
    )
    lines.append(
        verdict("chain-aware vs plain-LRU unreachable bytes", s["unreachable_chain_aware_vs_plain_lru"], "< 1x",
                s["unreachable_pass"])
    )
    return lines


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    rows = result["results"]
    table = Table(title=f"scale: cost per engine step vs concurrent requests ({result['context_tokens']:,}-token "
                  f"contexts, {result['prompt_tokens']:,}-token lookups, block {result['block_size']})")
    for column in _COST_HEADERS:
        table.add_column(column, justify="left" if column == "part" else "right")
    for row in _part(rows, "store") + _part(rows, "lookup"):
        table.add_row(*(f"{v:,}" if isinstance(v, int | float) else str(v) for v in _cost_cells(row)))
    console.print(table)
    w = result["workload"]
    table = Table(title=f"scale: embedded pool of {w['capacity_chunks']} chunks, working set "
                  f"{w['working_set_vs_capacity']}x, {w['prefixes']} prefixes, Zipf {w['zipf']}, "
                  f"{w['pool_requests']:,} requests")
    for column in _POOL_HEADERS:
        table.add_column(column, justify="left" if column == "pool" else "right", overflow="fold")
    for row in _part(rows, "capacity"):
        table.add_row(*(f"{v:,}" if isinstance(v, int | float) else str(v) for v in _pool_cells(row)))
    console.print(table)
    for line in _verdicts(result):
        console.print(line.removeprefix("- ").replace("**", ""))
    for note in result.get("notes", []):
        console.print(f"[dim]{note}[/dim]")


def to_markdown(result: dict[str, Any]) -> str:
    rows = result["results"]
    w = result["workload"]
    parts = [
        f"Cost per engine step against concurrent requests ({result['context_tokens']}-token contexts, "
        f"{result['prompt_tokens']}-token lookups, block {result['block_size']}):",
        markdown_table(_COST_HEADERS, [_cost_cells(r) for r in _part(rows, "store") + _part(rows, "lookup")]),
        f"Embedded pool at capacity: {w['capacity_chunks']} chunks, {w['prefixes']} prefixes of "
        f"{w['prefix_chunks']} chunks + {w['suffix_chunks']} unique, Zipf {w['zipf']}, working set "
        f"{w['working_set_vs_capacity']}x capacity, {w['pool_requests']} requests (the first fifth a warm-up); "
        "lost: stored chunks no lookup reaches (an earlier chunk of their chain is gone), mean of 20 samples:",
        markdown_table(_POOL_HEADERS, [_pool_cells(r) for r in _part(rows, "capacity")]),
        "\n".join(_verdicts(result)),
    ]
    return "\n\n".join(parts) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    rows = result["results"]
    with figure(path, ncols=2) as (_fig, (cost, pool)):
        for part, label in (("store", "store path (CPU)"), ("lookup", "lookup (wall)")):
            cells = _part(rows, part)
            cost.plot([r["requests"] for r in cells], [r["us_per_request"] for r in cells], marker="o", label=label)
        cost.set_xscale("log", base=2)
        levels = [r["requests"] for r in _part(rows, "store")]
        cost.set_xticks(levels, [str(n) for n in levels])
        cost.set_xlabel("concurrent requests per step")
        cost.set_ylabel("µs per request per step")
        cost.set_ylim(bottom=0)
        cost.set_title("cost per request vs concurrency")
        cost.legend()
        metrics = ("token_hit_rate", "request_hit_fraction", "eviction_rate", "unreachable_fraction")
        x = np.arange(len(metrics))
        for offset, row in zip((-0.2, 0.2), _part(rows, "capacity")):
            pool.bar(x + offset, [row[m] for m in metrics], width=0.4, label=_LABELS[row["policy"]])
        pool.set_xticks(x, ["token hit", "requests hit", "evictions/put", "unreachable"])
        pool.set_ylim(0, 1.05)
        pool.set_title("embedded pool at capacity: before / after chain-aware eviction")
        pool.legend()
