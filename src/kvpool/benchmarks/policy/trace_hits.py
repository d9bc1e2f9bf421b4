"""`kvpool bench trace-hits`: hit rates over a trace in the Mooncake format: the embedded pool under
each of its policies (`kvpool.core.policy`) beside plain LRU, Belady's MIN and no eviction at all, at
several capacities; the pool alone, behind an engine's own prefix cache, and (the default policy) with
its disk tier below. This module is the bench's run, its arguments and its result; the replays are
`trace_replay`'s (the trace, the prefix rule, how the pool is driven), the verdicts, tables and plot
`trace_hits_report`'s, the trace's reuse analysis and docs/eviction-policy.md's generated parts
`trace_reuse`'s.

Hit rate: blocks hit over prompt blocks, as the trace's README counts them (every hash id, the last
partial block too, so the figures compare with the README's). Capacities are shares of a trace's
distinct blocks.

Variants (`variants`):
- `pool`: the pool sees every request.
- `engine`: an engine prefix cache in front (LRU over `engine_share` of the distinct blocks, a request's
  blocks touched tail first, holding every block of each request it served), as in a server: the pool
  is not asked for the engine's hit, it looks up what the engine missed, loads its hit and saves the
  rest. Its rates are the pool's own hits over all prompt blocks (`total`: engine's and pool's).

Columns, per capacity:
- `pool[policy]`: the embedded pool itself with that policy (`trace_replay.hits_pool`).
- `ratio[policy]`: `pool[policy]`'s hits over the `lru` policy's: the issue's measure, its targets and
  verdicts (the result's `summary`) in `trace_hits_report`.
- `plain_lru`: plain LRU over blocks, each block touched head to tail (`trace_replay.hits_lru`).
- `min`: Belady's MIN, the offline reference (`trace_replay.hits_min`).
- `unlimited`: no eviction: the trace's own reuse, the ceiling of every column.
- `disk[policy]` (`DISK_POLICIES`, the pool variant of the trace itself): the pool at the same DRAM with
  its disk tier below (`trace_replay.hits_tiered`).

Derived traces (`derived`, `trace_replay.derive`; by default the pool variant only, `derived_variants`):
`second-half` and `alternate`.

Run time: the replays are independent; `workers` processes run them (one per core by default), the
candidate's first (it keeps five policies: the longest). `replay_cpu_s` in the result is their CPU time
together.

`analysis` in the result: `trace_reuse.analyze`, what the rules of the policies rest on.
`python -m kvpool.benchmarks.policy.trace_hits doc` rewrites docs/eviction-policy.md's generated parts from
`benchmarks/results/trace-hits.json` (`trace_reuse.update_doc`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from kvpool.benchmarks.policy.trace_hits_report import CANDIDATE, HELD_OUT_TARGET, TARGETS, plot, summarize, to_markdown
from kvpool.benchmarks.policy.trace_replay import (
    BASELINE,
    DERIVED,
    DISK_FACTOR,
    DISK_POLICIES,
    TRACE,
    Trace,
    derive,
    engine_hits,
    hits_lru,
    hits_min,
    hits_pool,
    hits_tiered,
    load_requests,
)
from kvpool.benchmarks.policy.trace_reuse import analyze, update_doc
from kvpool.core.policy import DEFAULT_POLICY, POLICY_NAMES

__all__ = ["ALL_ARGS", "TINY_ARGS", "TRACE", "plot", "print_table", "run", "to_markdown"]

POOL_POLICIES = POLICY_NAMES
VARIANTS = ("pool", "engine")
ENGINE_SHARE = 0.01  # the engine's own prefix cache in front, as a share of the distinct blocks

ALL_ARGS: dict[str, Any] = {"capacities": [0.01, 0.02, 0.05, 0.10, 0.20]}
TINY_ARGS: dict[str, Any] = {"capacities": [0.05, 0.25], "limit": 600, "workers": 1}


# --- the replays, in worker processes where `workers` > 1 --------------------------------------------


@lru_cache(maxsize=4)
def _trace(path: str, limit: int | None, derived: str | None) -> Trace:
    trace = load_requests(Path(path), limit)
    return derive(trace, derived) if derived else trace


@lru_cache(maxsize=8)
def _starts(path: str, limit: int | None, derived: str | None, engine: int) -> tuple[int, ...]:
    return tuple(engine_hits(_trace(path, limit, derived).chains, engine))


@dataclass(frozen=True)
class _Job:
    path: str
    limit: int | None
    derived: str | None
    engine: int  # the engine cache's blocks in front (0: none)
    capacity: int
    policy: str
    disk: bool = False


def _work(job: _Job) -> tuple[_Job, int, float]:
    """(the job, blocks the pool served, CPU seconds)."""
    began = time.process_time()
    chains = _trace(job.path, job.limit, job.derived).chains
    if job.disk:
        served = hits_tiered(chains, job.capacity, policy=job.policy)
    else:
        starts = _starts(job.path, job.limit, job.derived, job.engine) if job.engine else None
        served = hits_pool(chains, job.capacity, job.policy, starts)
    return job, served, time.process_time() - began


def _run_jobs(jobs: Sequence[_Job], workers: int) -> tuple[dict[_Job, int], float]:
    """Each job's blocks served, and the CPU seconds they took together."""
    order = sorted(jobs, key=lambda job: (job.policy != CANDIDATE, not job.disk, -job.capacity))  # longest first
    if workers <= 1 or len(order) <= 1:
        done = [_work(job) for job in order]
    else:
        with ProcessPoolExecutor(min(workers, len(order)), mp_context=get_context("spawn")) as pool:
            done = list(pool.map(_work, order))
    return {job: served for job, served, _ in done}, sum(cpu for _, _, cpu in done)


def run(
    *,
    capacities: Sequence[float] = (0.01, 0.02, 0.05, 0.10, 0.20),
    limit: int | None = None,
    trace: Path = TRACE,
    tiered: bool = True,
    policies: Sequence[str] = POOL_POLICIES,
    engine_share: float = ENGINE_SHARE,
    derived: Sequence[str] = DERIVED,
    derived_variants: Sequence[str] = ("pool",),
    analysis: bool = True,
    workers: int = 0,
) -> dict[str, Any]:
    """`tiered`: also the disk tier's column (real files); `engine_share`: the engine cache in front, a
    share of each trace's distinct blocks (0: the pool variant only); `derived`: the derived traces also
    replayed, in `derived_variants`; `analysis`: the trace's reuse figures (`analyze`); `workers`:
    replays at once, in processes (0: one per CPU core)."""
    for share in capacities:
        if not 0 < share <= 1:
            raise ValueError(f"capacity {share}: expected a share of the distinct blocks in (0, 1]")
    if not 0 <= engine_share <= 1:
        raise ValueError(f"engine share {engine_share}: expected a share of the distinct blocks in [0, 1]")
    for policy in policies:
        if policy not in POOL_POLICIES:
            raise ValueError(f"policy {policy!r}: expected one of {', '.join(POOL_POLICIES)}")
    for made in derived:
        if made not in DERIVED:
            raise ValueError(f"derived trace {made!r}: expected one of {', '.join(DERIVED)}")
    policies = list(dict.fromkeys([BASELINE, *policies]))  # the baseline always, first
    workers = workers or os.cpu_count() or 1
    started = time.perf_counter()
    path = str(trace.resolve()) if trace.is_file() else str(trace)
    whole = _trace(path, limit, None)
    variants = VARIANTS if engine_share else ("pool",)
    plans: list[tuple[str | None, tuple[str, ...]]] = [(None, variants)]
    plans += [(how, tuple(v for v in derived_variants if v in variants)) for how in derived]
    # what each trace is, its capacities and the jobs of its replays
    shapes: list[dict[str, Any]] = []
    jobs: list[_Job] = []
    for how, wanted in plans:
        chains = _trace(path, limit, how).chains
        distinct = len({block for chain in chains for block in chain})
        engine = max(1, round(engine_share * distinct)) if engine_share else 0
        sizes = [max(1, round(share * distinct)) for share in capacities]
        shapes.append({"derived": how, "variants": wanted, "distinct": distinct, "engine": engine, "sizes": sizes})
        for variant in wanted:
            for size in sizes:
                jobs += [_Job(path, limit, how, engine if variant == "engine" else 0, size, p) for p in policies]
        if how is None and tiered:
            jobs += [_Job(path, limit, None, 0, size, p, disk=True) for size in sizes for p in DISK_POLICIES]
    served, cpu_s = _run_jobs(jobs, workers)
    traces = []
    for shape in shapes:
        how, engine = shape["derived"], shape["engine"]
        chains = _trace(path, limit, how).chains
        blocks = sum(map(len, chains))
        entry: dict[str, Any] = {
            "name": _trace(path, limit, how).name,
            "derived": how,
            "requests": len(chains),
            "prompt_blocks": blocks,
            "distinct_blocks": shape["distinct"],
            "unlimited": _rate(hits_lru(chains, shape["distinct"]), blocks),
            "engine_blocks": engine,
            "variants": {},
        }
        for variant in shape["variants"]:
            front = engine if variant == "engine" else 0
            starts = _starts(path, limit, how, front) if front else tuple([0] * len(chains))
            seen = [chain[start:] for chain, start in zip(chains, starts)]  # what the pool is asked
            local = sum(starts)
            rows = []
            for share, size in zip(capacities, shape["sizes"]):
                hits = {p: served[_Job(path, limit, how, front, size, p)] for p in policies}
                row: dict[str, Any] = {
                    "capacity_share": share,
                    "capacity_blocks": size,
                    "engine_hits": _rate(local, blocks),
                    "lookups": sum(map(len, seen)),
                    "plain_lru": _rate(hits_lru(seen, size), blocks),
                    "min": _rate(hits_min(seen, size), blocks),
                    "unlimited": _rate(hits_lru(seen, shape["distinct"]), blocks),
                    "hits": hits,
                    "pool": {p: _rate(h, blocks) for p, h in hits.items()},
                    "ratio": {p: _ratio(h, hits[BASELINE]) for p, h in hits.items()},
                }
                if front:
                    row["total"] = {p: _rate(local + h, blocks) for p, h in hits.items()}
                if how is None and variant == "pool" and tiered:
                    row["disk"] = {
                        p: _rate(served[_Job(path, limit, None, 0, size, p, disk=True)], blocks) for p in DISK_POLICIES
                    }
                rows.append(row)
            entry["variants"][variant] = rows
        traces.append(entry)
    main = traces[0]
    result: dict[str, Any] = {
        "bench": "trace-hits",
        "trace": whole.name,
        "trace_path": path,
        "limit": limit,
        "requests": main["requests"],
        "prompt_blocks": main["prompt_blocks"],
        "distinct_blocks": main["distinct_blocks"],
        "unlimited": main["unlimited"],
        "policies": policies,
        "baseline": BASELINE,
        "default_policy": DEFAULT_POLICY,
        "candidate": CANDIDATE,
        "engine_share": engine_share,
        "disk_factor": DISK_FACTOR,
        "rows": main["variants"]["pool"],
        "traces": traces,
        "target": (
            f"each policy's hits / the lru policy's >= {TARGETS[0][1]} at capacities up to {TARGETS[0][0]:.0%}, "
            f">= {TARGETS[1][1]} up to {TARGETS[1][0]:.0%}, >= {TARGETS[2][1]} above, alone and behind the engine "
            f"cache; >= {HELD_OUT_TARGET} at every capacity on the derived traces; the verdict: {CANDIDATE}'s"
        ),
    }
    if analysis:
        result["analysis"] = analyze(whole.chains)
    result["summary"] = summarize(result)
    result["pass"] = result["summary"]["pass"]
    result["workers"] = min(workers, len(jobs)) if jobs else 1
    result["replay_cpu_s"] = round(cpu_s, 1)
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    return result


def _rate(hits: int, blocks: int) -> float:
    return round(hits / max(1, blocks), 4)


def _ratio(hits: int, baseline: int) -> float | None:
    """`hits` over the baseline's; None where the baseline hit nothing (no ratio to speak of)."""
    if baseline == 0:
        return None if hits else 1.0
    return round(hits / baseline, 3)


def print_table(result: dict[str, Any]) -> None:
    print(to_markdown(result))


if __name__ == "__main__":  # python -m kvpool.benchmarks.policy.trace_hits doc: the doc's figures from the result
    import sys

    if sys.argv[1:] != ["doc"]:
        raise SystemExit("usage: python -m kvpool.benchmarks.policy.trace_hits doc")
    update_doc()
