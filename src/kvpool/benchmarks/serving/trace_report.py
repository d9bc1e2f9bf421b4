"""`kvpool bench trace`'s verdicts, tables and plot, from its interleaved rounds.

Figures and comparisons are those of `serve_report`: every figure a median across rounds with its 95%
interval, every comparison a ratio paired round by round with a verdict from its whole interval (PASS,
FAIL or INCONCLUSIVE; a run with a failed request counts as missing). Targets, for each kvpool system
at every concurrency:
* like for like: against vLLM's `MooncakeStoreConnector` in the same placement
  (`serve_systems.LIKE_FOR_LIKE`): TTFT mean and p50 <= 1.0, output throughput >= 1.0 (TTFT p99 and
  CPU seconds per request reported);
* against `local` (vLLM's default: its own prefix cache, no connector): TTFT mean and p50 <= 1.0,
  output throughput >= 1.0: on a real chat workload a pool must pay for itself.
* the wall time of the replay against `local` (the same engine without a connector) <= 0.9
  (`WALL_VS_LOCAL_MAX`), and against the like-for-like peer and vLLM's embedded one <= 1.0: a hit, on
  Mooncake too, must save more prefill than its lookup, wait and read cost.
For `kvpool-disk` (`serve_systems.TIER_SYSTEMS`): against `kvpool` with the same DRAM, TTFT mean < 1.0
(the trace's working set outgrows the DRAM: a tier that does not turn its evictions into faster first
tokens is not worth running), TTFT p50 and output throughput reported; the hit rates are in the table.
Every other system's ratios to `local` are references, without a verdict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpool.benchmarks.measure.report import figure, markdown_table
from kvpool.benchmarks.measure.stats import spread
from kvpool.benchmarks.serving.serve_client import POOL_HITS
from kvpool.benchmarks.serving.serve_report import Target, _error_bars, _lines, _series, _shown, judge
from kvpool.benchmarks.serving.serve_systems import KVPOOL_SYSTEMS, LIKE_FOR_LIKE, TIER_SYSTEMS

WALL_VS_LOCAL_MAX = 0.9
EMBEDDED_PEER = "vllm-mooncake-embedded"
DATASET = "trace"  # every row's dataset, for `serve_report`'s pairing
JUDGED = (("ttft_mean_ms", True), ("ttft_p50_ms", True), ("output_tok_s", False))  # (metric, lower is better)
REFERENCES = ("ttft_p99_ms", "cpu_s_per_request")
COLUMNS = {  # row key -> table header
    "ttft_mean_ms": "TTFT mean ms",
    "ttft_p50_ms": "TTFT p50 ms",
    "ttft_p99_ms": "TTFT p99 ms",
    "e2el_mean_ms": "E2E mean ms",
    "output_tok_s": "output tok/s",
    "cpu_s_per_request": "CPU s / request",
}
HITS = ("local_hit_rate", "pool_hit_rate")
WINDOW_COLUMNS = [
    "round",
    "first request",
    "span (min)",
    "mean prompt",
    "distinct blocks",
    "ideal hit",
    "LRU hit at pool",
]


def run_figures(
    measured: dict[str, Any], before: dict[str, float], after: dict[str, float], cpu: float
) -> dict[str, Any]:
    """A run's figures from vLLM's client's per-request lists and the server's counters before and after."""
    import numpy as np

    ok = [not error for error in measured["errors"]]
    ttfts = [t for t, good in zip(measured["ttfts"], ok) if good]
    latencies = [t for t, good in zip(measured["latencies"], ok) if good]
    outputs = [n for n, good in zip(measured["output_lens"], ok) if good]
    tpots = [(e - t) / (n - 1) for t, e, n in zip(ttfts, latencies, outputs) if n > 1]
    prompt_tokens = sum(measured["input_lens"])
    completed = int(measured["completed"])

    def ms(values: list[float], q: float | None = None) -> float:
        if not values:
            return 0.0
        return round(float(np.mean(values) if q is None else np.percentile(values, q)) * 1000, 2)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    return {
        "sent": len(ok),
        "completed": completed,
        "failed": int(measured["failed"]),
        "ttft_mean_ms": ms(ttfts),
        "ttft_p50_ms": ms(ttfts, 50),
        "ttft_p99_ms": ms(ttfts, 99),
        "e2el_mean_ms": ms(latencies),
        "e2el_p50_ms": ms(latencies, 50),
        "tpot_mean_ms": ms(tpots),
        "output_tok_s": round(float(measured["output_throughput"]), 2),
        "duration_s": round(float(measured["duration"]), 2),
        "cpu_s_per_request": round(cpu / max(1, completed), 4),
        "prompt_tokens": prompt_tokens,
        "local_hit_tokens": int(delta("vllm:prefix_cache_hits_total")),
        "pool_hit_tokens": int(delta(POOL_HITS)),
        "local_hit_rate": round(delta("vllm:prefix_cache_hits_total") / max(1, prompt_tokens), 4),
        "pool_hit_rate": round(delta(POOL_HITS) / max(1, prompt_tokens), 4),
        "preemptions": int(delta("vllm:num_preemptions_total")),
        "ttft_ms": [round(t * 1000, 2) for t in measured["ttfts"]],  # per request, in trace order
    }


def targets(result: dict[str, Any]) -> list[Target]:
    systems = set(result["systems"])
    out: list[Target] = []
    for c in result["workload"]["concurrencies"]:
        for system in KVPOOL_SYSTEMS:
            if system not in systems:
                continue
            peer, placement = LIKE_FOR_LIKE[system]
            if peer in systems:
                out += [Target(system, peer, placement, DATASET, c, m, 1.0, lower) for m, lower in JUDGED]
                out += [Target(system, peer, placement, DATASET, c, m, None) for m in REFERENCES]
            for against in {peer, EMBEDDED_PEER} & systems:  # and vLLM's connector at its best, in-process
                why = placement if against == peer else "vLLM's connector at its best: its pool in-process"
                out.append(Target(system, against, why, DATASET, c, "duration_s", 1.0))
            if "local" in systems:
                why = "a hit saves more than it costs"
                out.append(Target(system, "local", why, DATASET, c, "duration_s", WALL_VS_LOCAL_MAX))
                why = "a pool pays for itself on real reuse"
                out += [Target(system, "local", why, DATASET, c, m, 1.0, lower) for m, lower in JUDGED]
        for system in TIER_SYSTEMS:
            if system in systems and "kvpool" in systems:
                why = "the same DRAM, a disk tier below it"
                out.append(Target(system, "kvpool", why, DATASET, c, "ttft_mean_ms", 1.0))
                out += [Target(system, "kvpool", why, DATASET, c, m, None) for m, _ in JUDGED[1:]]
        for system in result["systems"]:
            if system not in (*KVPOOL_SYSTEMS, *TIER_SYSTEMS) and system != "local" and "local" in systems:
                out += [Target(system, "local", "reference", DATASET, c, m, None) for m, _ in JUDGED]
    return out


def cells(result: dict[str, Any]) -> dict[str, Any]:
    """Per system and concurrency: each figure's median across rounds with its interval."""
    out: dict[str, Any] = {}
    for system in result["systems"]:
        for c in result["workload"]["concurrencies"]:
            series = {key: _series(result, system, DATASET, c, key) for key in (*COLUMNS, *HITS)}
            cell = {key: spread(list(values.values())).as_dict() for key, values in series.items() if values}
            if cell:
                out.setdefault(system, {})[str(c)] = cell
    return out


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    measured = [target.measure(result) for target in targets(result)]
    counts, passed = judge(measured)
    return {"targets": measured, "verdicts": counts, "cells": cells(result), "pass": passed}


def to_markdown(result: dict[str, Any]) -> str:
    w = result["workload"]
    summary = result["summary"]
    speed = "closed loop" if w["speedup"] is None else f"open loop at {w['speedup']}x the trace's clock"
    asked = (
        ""
        if w["pool_held_tokens"] <= w["pool_tokens"]
        else f" (asked {w['pool_fraction']:.2f}x: a pool's least size binds)"
    )
    parts = [
        f"The Mooncake conversation trace ({w['trace_requests']:,} requests, one hour): conversations 1 in "
        f"{w['sample_every']}, a bucket a round, {w['requests']} requests each from {w['start_s']:.0f} s, in "
        f"trace order, {speed} at concurrency {', '.join(map(str, w['concurrencies']))}. A trace block (512 "
        f"tokens) is one engine block of {w['block_size']}; prompts cut at {w['max_model_len'] - w['max_output']} "
        f"tokens, outputs at {w['max_output']}. Model `{Path(result['model']).name}` ({w['dtype']}); engine KV "
        f"cache {w['engine_cache_tokens']:,} tokens ({w['engine_cache_bytes'] / 2**20:.0f} MiB); every pool "
        f"{w['pool_bytes'] / 2**20:.0f} MiB, {w['pool_held_tokens']:,} tokens: {w['pool_held_fraction']:.2f}x a "
        f"round's {w['distinct_blocks']:,} distinct blocks{asked}. An unlimited cache would hit "
        f"{w['hour_ideal_hit_rate']:.0%} of the hour's prompt tokens (prompts cut alike). {w['rounds']} "
        f'interleaved rounds (order rotated); each figure: median [95% interval] across rounds ("(range)": too '
        f"few rounds for a 95% interval, the rounds' range); {result['elapsed_s']:.0f} s.",
    ]
    window_rows = [
        [d["round"] + 1, d["first_request"], round(d["span_s"] / 60, 1), d["mean_prompt_tokens"], d["distinct_blocks"],
         f"{d['ideal_hit_rate']:.0%}", f"{d['lru_pool_hit_rate']:.0%}"]
        for d in w["windows"]
    ]  # fmt: skip
    parts += [
        "**Windows** (hit rates of a prefix cache alone, by the engine's rules: unlimited, and LRU of a pool's size)",
        markdown_table(WINDOW_COLUMNS, window_rows),
    ]
    rows = []
    for system, per_concurrency in summary["cells"].items():
        for c, cell in per_concurrency.items():
            hits = [_shown(cell.get(key), True) for key in HITS]
            rows.append([system, int(c), *(_shown(cell.get(key)) for key in COLUMNS), *hits])
    parts += [
        "**Replay**",
        markdown_table(["system", "concurrency", *COLUMNS.values(), "local hit", "pool hit"], rows),
    ]
    notes = [f"- `{name}` did not run: {why}" for name, why in result["failed"].items()]
    if notes:
        parts.append("\n".join(notes))
    parts.append("**Targets** (ratios paired by round: geometric mean [95% t interval])\n" + "\n".join(_lines(summary)))
    return "\n\n".join(parts) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """Per system at the first concurrency: TTFT mean, output throughput, and the hit rates (local, pool)."""
    summary = result["summary"]
    concurrency = str(result["workload"]["concurrencies"][0])
    names = [name for name in summary["cells"] if concurrency in summary["cells"][name]]
    per = [summary["cells"][name][concurrency] for name in names]
    with figure(path, ncols=3, width=5.0) as (_fig, (ttft, throughput, hits)):
        for axis, key, title, unit in (
            (ttft, "ttft_mean_ms", "TTFT mean", "ms"),
            (throughput, "output_tok_s", "output throughput", "tokens/s"),
        ):
            shown = [cell[key] for cell in per]
            colors = ["tab:blue" if name in KVPOOL_SYSTEMS else "tab:gray" for name in names]
            axis.bar(names, [c["estimate"] for c in shown], yerr=_error_bars(shown), capsize=3, color=colors)
            axis.set(title=f"{title} (concurrency {concurrency})", ylabel=unit)
        local = [cell.get("local_hit_rate", {}).get("estimate", 0.0) for cell in per]
        pool = [cell.get("pool_hit_rate", {}).get("estimate", 0.0) for cell in per]
        hits.bar(names, local, color="tab:gray", label="engine's own cache")
        hits.bar(names, pool, bottom=local, color="tab:blue", label="pool")
        ideal = [d["ideal_hit_rate"] for d in result["workload"]["windows"]]
        hits.axhline(sum(ideal) / len(ideal), color="tab:red", ls=":", label="unlimited cache (mean of windows)")
        hits.set(title="prompt tokens hit", ylabel="share of prompt tokens")
        hits.legend(fontsize=7)
        for axis in (ttft, throughput, hits):
            axis.tick_params(axis="x", labelrotation=45, labelsize=7)
