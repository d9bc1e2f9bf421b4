"""`kvpool bench serve`'s verdict, tables and plot: each target as a ratio measured in the one run.

Targets, for each kvpool system (embedded and on Mooncake), against systems of the same run:
* reuse workload: TTFT p50 <= 0.5x `none` at every concurrency;
* 0%-reuse control: output throughput >= 0.97x and TTFT p50 <= 1.05x `none` at every concurrency;
* a full hit (the probe's prompt after the engine's own cache lost it) within 1.2x of `local`'s hit
  in the engine's own cache, with every probe prompt served from the pool;
* ahead of every peer that runs: TTFT p50 on the reuse workload below the peer's at every concurrency.
A figure that could not be measured (a system that failed) leaves its target `None`, and `pass` false.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpool.benchmarks.report import figure, markdown_table, verdict
from kvpool.benchmarks.serve_systems import KVPOOL_SYSTEMS, PEERS

TARGET_REUSE_TTFT_MAX = 0.5
TARGET_CONTROL_THROUGHPUT_MIN = 0.97
TARGET_CONTROL_TTFT_MAX = 1.05
TARGET_FULL_HIT_MAX = 1.2
TARGETS = {
    "reuse_ttft_p50_vs_none_max": TARGET_REUSE_TTFT_MAX,
    "control_throughput_vs_none_min": TARGET_CONTROL_THROUGHPUT_MIN,
    "control_ttft_p50_vs_none_max": TARGET_CONTROL_TTFT_MAX,
    "full_hit_vs_local_hit_max": TARGET_FULL_HIT_MAX,
    "reuse_ttft_p50_vs_peer_max": 1.0,
}


def _rows(result: dict[str, Any]) -> dict[tuple[str, str, int], dict[str, Any]]:
    return {(r["system"], r["dataset"], r["concurrency"]): r for r in result["results"]}


def _ratios(
    rows: dict[tuple[str, str, int], dict[str, Any]], system: str, other: str, dataset: str, key: str, c: list[int]
) -> dict[str, float] | None:
    out = {}
    for concurrency in c:
        mine, theirs = rows.get((system, dataset, concurrency)), rows.get((other, dataset, concurrency))
        if mine is None or theirs is None or not (_complete(mine) and _complete(theirs)) or not theirs[key]:
            return None  # missing, or a run with failed requests: no TTFT worth comparing
        out[str(concurrency)] = round(mine[key] / theirs[key], 3)
    return out


def _complete(row: dict[str, Any]) -> bool:
    return bool(row["failed"] == 0 and row["completed"] == row.get("sent", row["completed"]))


def _target(ratios: dict[str, float] | None, limit: float, at_most: bool, strict: bool = False) -> dict[str, Any]:
    if ratios is None:
        return {"per_concurrency": None, "worst": None, "pass": None}
    worst = max(ratios.values()) if at_most else min(ratios.values())
    passed = (worst < limit if strict else worst <= limit) if at_most else worst >= limit
    return {"per_concurrency": ratios, "worst": worst, "pass": passed}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    rows = _rows(result)
    concurrencies = list(result["workload"]["concurrencies"])
    probes = result["probe"]
    per_system: dict[str, Any] = {}
    for system in KVPOOL_SYSTEMS:
        if system not in result["systems"]:
            continue
        entry: dict[str, Any] = {
            "reuse_ttft_p50_vs_none": _target(
                _ratios(rows, system, "none", "reuse", "ttft_p50_ms", concurrencies), TARGET_REUSE_TTFT_MAX, True
            ),
            "control_throughput_vs_none": _target(
                _ratios(rows, system, "none", "random", "output_tok_s", concurrencies),
                TARGET_CONTROL_THROUGHPUT_MIN,
                False,
            ),
            "control_ttft_p50_vs_none": _target(
                _ratios(rows, system, "none", "random", "ttft_p50_ms", concurrencies), TARGET_CONTROL_TTFT_MAX, True
            ),
        }
        mine, floor = probes.get(system), probes.get("local")
        if mine and floor and floor["again_ms"]:
            ratio = round(mine["evicted_ms"] / floor["again_ms"], 3)
            served = mine["evicted_pool_tokens"] > 0 and mine["evicted_pool_tokens"] == mine["evicted_cached_tokens"]
            entry["full_hit_vs_local_hit"] = {
                "ratio": ratio,
                "every_probe_served_from_pool": served,
                "pass": served and ratio <= TARGET_FULL_HIT_MAX,
            }
        else:
            entry["full_hit_vs_local_hit"] = {"ratio": None, "pass": None}
        entry["vs_peers"] = {
            peer: _target(_ratios(rows, system, peer, "reuse", "ttft_p50_ms", concurrencies), 1.0, True, strict=True)
            for peer in PEERS
            if peer in result["systems"] and peer not in result["failed"]
        }
        per_system[system] = entry
    verdicts = [
        target["pass"]
        for entry in per_system.values()
        for target in [*(v for k, v in entry.items() if k != "vs_peers"), *entry["vs_peers"].values()]
    ]
    return {
        "targets": TARGETS,
        "per_system": per_system,
        "pass": bool(per_system) and all(v is True for v in verdicts),
    }


def to_markdown(result: dict[str, Any]) -> str:
    w = result["workload"]
    parts = [
        f"Model `{Path(result['model']).name}` ({w['dtype']}), block {w['block_size']}; engine KV cache "
        f"{w['engine_cache_tokens']:,} tokens ({w['engine_cache_bytes'] / 2**20:.0f} MiB); every pool "
        f"{w['pool_bytes'] / 2**20:.0f} MiB. Reuse: vLLM's `prefix_repetition`, {w['num_prefixes']} prefixes "
        f"of {w['prefix_len']} tokens x {w['prompts_per_prefix']} prompts (+{w['suffix_len']} unique tokens), "
        f"{w['num_prefixes'] * w['prefix_len'] / w['engine_cache_tokens']:.1f}x the engine's cache; control: "
        f"vLLM's `random`, {w['random_prompts']} prompts of {w['prefix_len'] + w['suffix_len']} tokens; "
        f"{w['output_len']} output tokens; {result['elapsed_s']:.0f} s in all.",
    ]
    headers = ["system", "concurrency", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "output tok/s", "local hit"]
    headers += ["pool hit", "preemptions"]
    for dataset, title in (("reuse", "Reuse workload"), ("random", "0%-reuse control")):
        rows = [
            [r["system"], r["concurrency"], r["ttft_p50_ms"], r["ttft_p99_ms"], r["tpot_p50_ms"], r["output_tok_s"],
             f"{r['local_hit_rate']:.0%}", f"{r['pool_hit_rate']:.0%}", r["preemptions"]]
            for r in result["results"]
            if r["dataset"] == dataset
        ]  # fmt: skip
        parts += [f"**{title}**", markdown_table(headers, rows)]
    probe_rows = [
        [system, p["miss_ms"], p["again_ms"], p["again_cached_tokens"], p["evicted_ms"], p["evicted_cached_tokens"],
         p["evicted_pool_tokens"]]
        for system, p in result["probe"].items()
    ]  # fmt: skip
    parts += [
        "**Hit probe** (TTFT of 1 token, medians): sent once, again at once, again after the engine's cache lost it",
        markdown_table(
            [
                "system",
                "miss ms",
                "again ms",
                "again cached",
                "after eviction ms",
                "after eviction cached",
                "from a pool",
            ],
            probe_rows,
        ),
    ]
    notes = [f"- `{name}` did not run: {why}" for name, why in result["failed"].items()]
    notes += [f"- `{name}`: {why}" for name, why in result["unsupported"].items()]
    if notes:
        parts.append("\n".join(notes))
    parts.append("**Targets**\n" + "\n".join(_verdicts(result["summary"])))
    return "\n\n".join(parts) + "\n"


def _verdicts(summary: dict[str, Any]) -> list[str]:
    lines = []
    for system, entry in summary["per_system"].items():
        for key, name, target in (
            ("reuse_ttft_p50_vs_none", "reuse TTFT p50 vs none (worst concurrency)", f"<= {TARGET_REUSE_TTFT_MAX}"),
            ("control_throughput_vs_none", "control throughput vs none", f">= {TARGET_CONTROL_THROUGHPUT_MIN}"),
            ("control_ttft_p50_vs_none", "control TTFT p50 vs none", f"<= {TARGET_CONTROL_TTFT_MAX}"),
        ):
            lines.append(verdict(f"`{system}` {name}", entry[key]["worst"], target, entry[key]["pass"]))
        hit = entry["full_hit_vs_local_hit"]
        limit = f"<= {TARGET_FULL_HIT_MAX}"
        lines.append(verdict(f"`{system}` full hit vs local hit", hit["ratio"], limit, hit["pass"]))
        for peer, v in entry["vs_peers"].items():
            lines.append(verdict(f"`{system}` reuse TTFT p50 vs `{peer}`", v["worst"], "< 1", v["pass"]))
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    """Reuse TTFT p50 and control throughput vs concurrency per system; the probe's hits."""
    with figure(path, ncols=3, width=5.0) as (_fig, (ttft, throughput, probe)):
        for system in result["systems"]:
            for axis, dataset, key in ((ttft, "reuse", "ttft_p50_ms"), (throughput, "random", "output_tok_s")):
                points = sorted(
                    (r["concurrency"], r[key])
                    for r in result["results"]
                    if (r["system"], r["dataset"]) == (system, dataset)
                )
                if points:
                    style = "-o" if system in KVPOOL_SYSTEMS else "--."
                    axis.plot([c for c, _ in points], [v for _, v in points], style, label=system)
        ttft.set(title="reuse: TTFT p50", xlabel="concurrency", ylabel="ms", xscale="log", yscale="log")
        throughput.set(title="0%-reuse control: output throughput", xlabel="concurrency", ylabel="tokens/s")
        throughput.set_xscale("log")
        ttft.legend(fontsize=7)
        names = list(result["probe"])
        probe.bar(names, [result["probe"][n]["evicted_ms"] for n in names], color="tab:blue", label="after eviction")
        if "local" in result["probe"]:
            probe.axhline(result["probe"]["local"]["again_ms"], color="tab:red", ls=":", label="local hit (floor)")
        probe.set(title="hit probe: TTFT once the engine lost it", ylabel="ms")
        probe.tick_params(axis="x", labelrotation=45, labelsize=7)
        probe.legend(fontsize=7)
