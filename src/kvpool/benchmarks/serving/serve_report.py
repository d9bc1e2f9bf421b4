"""`kvpool bench serve`'s verdicts, tables and plot, from its interleaved rounds.

Every figure is a median across rounds with its 95% interval (`stats.spread`); every comparison is a
ratio paired round by round (`stats.ratio`: the geometric mean with a t interval), and its verdict
comes from the whole interval (PASS, FAIL or INCONCLUSIVE). Targets, for each kvpool system:
* like for like: against vLLM's `MooncakeStoreConnector` in the same placement
  (`serve_systems.LIKE_FOR_LIKE`), on the reuse workload at every concurrency: TTFT mean and p50
  <= 1.0, output throughput >= 1.0 and CPU seconds per request <= 1.0 (TTFT p99 reported); the hit
  probe's full hit <= 0.9;
* the 0%-reuse control against `local` (vLLM's default: prefix caching on, no connector): TTFT mean
  <= 1.05 and output throughput >= 0.95 at every concurrency;
* the reuse workload against `local`: TTFT mean < 1.0 (a pool that loses to the engine's own cache
  under pressure is not worth running);
* for `kvpool` (whose DRAM hits are contract hits, loaded in-step): the probe's full pool hit against
  `local`'s own hit of the same prompt (`again_ms`) with the whole interval <= 1.05 and the estimate
  <= 1.02 (`IN_STEP_HIT_VS_LOCAL`), and, in steps that do not drift with the machine, a contract hit's
  steps to first token against the engine's own hit's in the same server: <= 1.0.
For `kvpool-disk` (`serve_systems.TIER_SYSTEMS`): against `kvpool` with the same DRAM, the reuse
workload's TTFT mean < 1.0 (a tier that does not beat DRAM alone when the working set outgrows it is
not worth running) and the 0%-reuse control's output throughput >= 0.97 (writing behind costs the
engine next to nothing). Every other system's ratios to `local` are references, without a verdict.
A run with failed requests counts as missing: a comparison with no paired round has no verdict
(INCONCLUSIVE).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.benchmarks.measure.report import figure, markdown_table
from kvpool.benchmarks.measure.stats import Interval, Verdict, ratio, spread, verdict
from kvpool.benchmarks.serving.serve_systems import KVPOOL_SYSTEMS, LIKE_FOR_LIKE, TIER_SYSTEMS

FULL_HIT_VS_PEER_MAX = 0.9
IN_STEP_HIT_VS_LOCAL = (1.02, 1.05)  # the estimate's limit, the interval's
PROBE_FIGURES = ("miss_ms", "again_ms", "evicted_ms", "evicted_cached_tokens", "evicted_pool_tokens")
STEP_FIGURES = ("steps_miss", "steps_local", "steps_in_step", "steps_async")  # mean steps to first token per kind
CONTROL_TTFT_VS_LOCAL_MAX = 1.05
CONTROL_THROUGHPUT_VS_LOCAL_MIN = 0.95
TIER_CONTROL_THROUGHPUT_MIN = 0.97
METRICS = {  # row key -> (label, a lower figure is better)
    "ttft_mean_ms": ("TTFT mean", True),
    "ttft_p50_ms": ("TTFT p50", True),
    "ttft_p99_ms": ("TTFT p99", True),
    "tpot_mean_ms": ("TPOT mean", True),
    "output_tok_s": ("output throughput", False),
    "cpu_s_per_request": ("CPU s / request", True),
}

LABELS = {"evicted_ms": ("full hit TTFT", True), "duration_s": ("wall time", True)}  # targets' other figures


@dataclass(frozen=True)
class Target:
    system: str
    against: str
    why: str  # what makes the comparison fair, or what it asks
    dataset: str  # "reuse", "random" or "probe"
    concurrency: int | None
    metric: str
    limit: float | None  # None: a reference, no verdict
    at_most: bool = True
    against_metric: str | None = None  # the baseline's figure, when not `metric` itself
    estimate_limit: float | None = None  # a tighter bound on the estimate alone (PASS needs both)

    def measure(self, result: dict[str, Any]) -> dict[str, Any]:
        mine, theirs = _paired(result, self)
        interval = ratio(mine, theirs) if mine else None
        judged = Verdict.INCONCLUSIVE if interval is None else None
        if interval is not None and self.limit is not None:
            judged = verdict(interval, self.limit, self.at_most)
            if judged is Verdict.PASS and self.estimate_limit is not None:
                gap = interval.estimate - self.estimate_limit
                within = gap <= 0 if self.at_most else gap >= 0
                judged = Verdict.PASS if within else Verdict.FAIL  # the interval meets its limit, the estimate not
        return {
            "system": self.system,
            "against": self.against,
            "why": self.why,
            "dataset": self.dataset,
            "concurrency": self.concurrency,
            "metric": self.metric,
            "against_metric": self.against_metric or self.metric,
            "limit": self.limit,
            "estimate_limit": self.estimate_limit,
            "at_most": self.at_most,
            "ratio": None if interval is None else interval.as_dict(),
            "verdict": None if self.limit is None else (judged or Verdict.INCONCLUSIVE).value,
        }


def targets(result: dict[str, Any]) -> list[Target]:
    systems = set(result["systems"])
    concurrencies = list(result["workload"]["concurrencies"])
    out: list[Target] = []
    for system in KVPOOL_SYSTEMS:
        if system not in systems:
            continue
        peer, placement = LIKE_FOR_LIKE[system]
        if peer in systems:
            for c in concurrencies:
                out += [
                    Target(system, peer, placement, "reuse", c, "ttft_mean_ms", 1.0),
                    Target(system, peer, placement, "reuse", c, "ttft_p50_ms", 1.0),
                    Target(system, peer, placement, "reuse", c, "ttft_p99_ms", None),
                    Target(system, peer, placement, "reuse", c, "output_tok_s", 1.0, at_most=False),
                    Target(system, peer, placement, "reuse", c, "cpu_s_per_request", 1.0),
                ]
            out.append(Target(system, peer, placement, "probe", None, "evicted_ms", FULL_HIT_VS_PEER_MAX))
        if system == "kvpool":  # DRAM on every rank: its hits are contract hits, loaded in-step
            estimate, whole = IN_STEP_HIT_VS_LOCAL
            if "local" in systems:
                out.append(
                    Target(
                        system, "local", "a pool hit costs what the engine's own hit costs", "probe", None,
                        "evicted_ms", whole, against_metric="again_ms", estimate_limit=estimate,
                    )
                )  # fmt: skip
            out.append(
                Target(
                    system, system, "a contract hit takes the engine's own hit's steps", "probe", None,
                    "steps_in_step", 1.0, against_metric="steps_local",
                )
            )  # fmt: skip
        if "local" in systems:
            for c in concurrencies:
                control = "the 0%-reuse control costs next to nothing"
                out += [
                    Target(system, "local", control, "random", c, "ttft_mean_ms", CONTROL_TTFT_VS_LOCAL_MAX),
                    Target(
                        system, "local", control, "random", c, "output_tok_s", CONTROL_THROUGHPUT_VS_LOCAL_MIN, False
                    ),
                    Target(system, "local", "a pool beats the engine's own cache", "reuse", c, "ttft_mean_ms", 1.0),
                ]
    for system in TIER_SYSTEMS:
        if system in systems and "kvpool" in systems:
            for c in concurrencies:
                out += [
                    Target(system, "kvpool", "the same DRAM, a disk tier below it", "reuse", c, "ttft_mean_ms", 1.0),
                    Target(
                        system, "kvpool", "writing behind costs the engine", "random", c, "output_tok_s",
                        TIER_CONTROL_THROUGHPUT_MIN, False,
                    ),
                ]  # fmt: skip
    for system in result["systems"]:
        if system not in (*KVPOOL_SYSTEMS, *TIER_SYSTEMS) and system != "local" and "local" in systems:
            out += [Target(system, "local", "reference", "reuse", c, "ttft_mean_ms", None) for c in concurrencies]
    return out


def _complete(row: dict[str, Any]) -> bool:
    return bool(row["failed"] == 0 and row["completed"] == row.get("sent", row["completed"]))


def _series(
    result: dict[str, Any], system: str, dataset: str, concurrency: int | None, metric: str
) -> dict[int, float]:
    """Per round, the system's figure (complete runs only; the probe's medians for dataset "probe")."""
    if dataset == "probe":
        return {p["round"]: p[metric] for p in result["probe"] if p["system"] == system and p.get(metric)}
    return {
        r["round"]: r[metric]
        for r in result["results"]
        if (r["system"], r["dataset"], r["concurrency"]) == (system, dataset, concurrency)
        and _complete(r)
        and r.get(metric) is not None
    }


def _paired(result: dict[str, Any], target: Target) -> tuple[list[float], list[float]]:
    mine = _series(result, target.system, target.dataset, target.concurrency, target.metric)
    theirs = _series(result, target.against, target.dataset, target.concurrency, target.against_metric or target.metric)
    rounds = sorted(set(mine) & set(theirs))
    rounds = [r for r in rounds if mine[r] > 0 and theirs[r] > 0]
    return [mine[r] for r in rounds], [theirs[r] for r in rounds]


def cells(result: dict[str, Any]) -> dict[str, Any]:
    """Per system, dataset and concurrency: each figure's median across rounds with its interval."""
    out: dict[str, Any] = {}
    keys = [*METRICS, "local_hit_rate", "pool_hit_rate"]
    for row in result["results"]:
        cell = out.setdefault(row["system"], {}).setdefault(row["dataset"], {})
        if str(row["concurrency"]) in cell:
            continue
        series = {k: _series(result, row["system"], row["dataset"], row["concurrency"], k) for k in keys}
        cell[str(row["concurrency"])] = {k: spread(list(v.values())).as_dict() for k, v in series.items() if v}
    return out


def probe_cells(result: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system in result["systems"]:
        probes = [p for p in result["probe"] if p["system"] == system]
        if probes:
            figures = {key: [p[key] for p in probes if key in p] for key in (*PROBE_FIGURES, *STEP_FIGURES)}
            # steps: only kvpool's servers count them, a kind of hit only in the rounds that had one
            out[system] = {key: spread(values).as_dict() for key, values in figures.items() if values}
    return out


def judge(measured: list[dict[str, Any]]) -> tuple[dict[str, int], bool]:
    """The verdicts of measured targets counted, and whether there is one and every one is PASS."""
    judged = [m["verdict"] for m in measured if m["verdict"] is not None]
    counts = {v.value: judged.count(v.value) for v in Verdict}
    return counts, bool(judged) and counts[Verdict.PASS.value] == len(judged)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    measured = [target.measure(result) for target in targets(result)]
    counts, passed = judge(measured)
    return {
        "targets": measured,
        "verdicts": counts,
        "cells": cells(result),
        "probe": probe_cells(result),
        "pass": passed,
    }


def _shown(cell: dict[str, Any] | None, percent: bool = False) -> str:
    if not cell:
        return "-"
    interval = Interval(**cell)
    if percent:
        return f"{interval.estimate:.0%} [{interval.low:.0%}, {interval.high:.0%}]"
    return str(interval)


def to_markdown(result: dict[str, Any]) -> str:
    w = result["workload"]
    summary = result["summary"]
    parts = [
        f"Model `{Path(result['model']).name}` ({w['dtype']}), block {w['block_size']}; engine KV cache "
        f"{w['engine_cache_tokens']:,} tokens ({w['engine_cache_bytes'] / 2**20:.0f} MiB); every pool "
        f"{w['pool_tokens']:,} tokens ({w['pool_bytes'] / 2**20:.0f} MiB: "
        f"{w['pool_tokens'] / w['working_set_tokens']:.2f}x a round's reuse working set of {w['working_set_tokens']:,} "
        f"tokens). Reuse: vLLM's `prefix_repetition`, {w['num_prefixes']} prefixes of {w['prefix_len']} tokens x "
        f"{w['prompts_per_prefix']} prompts (+{w['suffix_len']} unique tokens); control: vLLM's `random`, "
        f"{w['random_prompts']} prompts of {w['prefix_len'] + w['suffix_len']} tokens; {w['output_len']} output "
        f"tokens. {w['rounds']} interleaved rounds (order rotated); each figure: median [95% interval] across "
        f'rounds ("(range)": too few rounds for a 95% interval, the rounds\' range); {result["elapsed_s"]:.0f} s.',
    ]
    headers = ["system", "concurrency", *(label for label, _ in METRICS.values()), "local hit", "pool hit"]
    for dataset, title in (("reuse", "Reuse workload"), ("random", "0%-reuse control")):
        rows = []
        for system, per_dataset in summary["cells"].items():
            for concurrency, cell in per_dataset.get(dataset, {}).items():
                hits = [_shown(cell.get("local_hit_rate"), True), _shown(cell.get("pool_hit_rate"), True)]
                rows.append([system, int(concurrency), *(_shown(cell.get(key)) for key in METRICS), *hits])
        parts += [f"**{title}**", markdown_table(headers, rows)]
    probe_rows = [
        [system, *(_shown(p.get(key)) for key in (*PROBE_FIGURES, *STEP_FIGURES))]
        for system, p in summary["probe"].items()
    ]
    parts += [
        "**Hit probe** (TTFT of 1 token, ms): sent once, again at once, again after the engine's cache lost it; "
        "then kvpool's mean engine steps to first token per kind of hit (admission to first token, inclusive)",
        markdown_table(
            ["system", "miss", "again", "after eviction", "after eviction: cached", "of which from a pool",
             "steps: miss", "steps: local hit", "steps: in-step pool hit", "steps: async pool hit"],
            probe_rows,
        ),
    ]  # fmt: skip
    notes = [f"- `{name}` did not run: {why}" for name, why in result["failed"].items()]
    notes += [f"- `{name}`: {why}" for name, why in result["unsupported"].items()]
    if notes:
        parts.append("\n".join(notes))
    parts.append("**Targets** (ratios paired by round: geometric mean [95% t interval])\n" + "\n".join(_lines(summary)))
    return "\n\n".join(parts) + "\n"


def _lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    for t in summary["targets"]:
        label = {**METRICS, **LABELS}.get(t["metric"], (t["metric"], True))[0]
        if t.get("against_metric", t["metric"]) != t["metric"]:
            label = f"{t['metric']} vs {t['against_metric']}"
        where = "hit probe" if t["dataset"] == "probe" else f"{t['dataset']} at concurrency {t['concurrency']}"
        shown = "not measured" if t["ratio"] is None else str(Interval(**t["ratio"]))
        name = f"`{t['system']}` {label} vs `{t['against']}`, {where} ({t['why']})"
        if t["limit"] is None:
            lines.append(f"- {name}: {shown} (reference)")
        else:
            sign = "<=" if t["at_most"] else ">="
            also = "" if t.get("estimate_limit") is None else f", estimate {sign} {t['estimate_limit']}"
            lines.append(f"- {name}: **{shown}** (target {sign} {t['limit']}{also}) {t['verdict']}")
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    """Reuse TTFT mean and control throughput vs concurrency per system, with intervals; the probe's hits."""
    summary = result["summary"]
    with figure(path, ncols=3, width=5.0) as (_fig, (ttft, throughput, probe)):
        for system, per_dataset in summary["cells"].items():
            for axis, dataset, key in ((ttft, "reuse", "ttft_mean_ms"), (throughput, "random", "output_tok_s")):
                points = sorted((int(c), cell[key]) for c, cell in per_dataset.get(dataset, {}).items() if key in cell)
                if points:
                    xs = [c for c, _ in points]
                    ys = [p["estimate"] for _, p in points]
                    errors = [
                        [p["estimate"] - p["low"] for _, p in points],
                        [p["high"] - p["estimate"] for _, p in points],
                    ]
                    style = "-o" if system in KVPOOL_SYSTEMS else "--."
                    axis.errorbar(xs, ys, yerr=errors, fmt=style, capsize=3, label=system)
        ttft.set(title="reuse: TTFT mean", xlabel="concurrency", ylabel="ms", xscale="log", yscale="log")
        throughput.set(title="0%-reuse control: output throughput", xlabel="concurrency", ylabel="tokens/s")
        throughput.set_xscale("log")
        ttft.legend(fontsize=7)
        names = list(summary["probe"])
        hits = [summary["probe"][n]["evicted_ms"] for n in names]
        errors = [[h["estimate"] - h["low"] for h in hits], [h["high"] - h["estimate"] for h in hits]]
        probe.bar(
            names, [h["estimate"] for h in hits], yerr=errors, capsize=3, color="tab:blue", label="after eviction"
        )
        if "local" in summary["probe"]:
            floor = summary["probe"]["local"]["again_ms"]["estimate"]
            probe.axhline(floor, color="tab:red", ls=":", label="local hit (floor)")
        probe.set(title="hit probe: TTFT once the engine lost it", ylabel="ms")
        probe.tick_params(axis="x", labelrotation=45, labelsize=7)
        probe.legend(fontsize=7)


def _error_bars(cells: list[dict[str, Any]]) -> list[list[float]]:
    return [[c["estimate"] - c["low"] for c in cells], [c["high"] - c["estimate"] for c in cells]]
