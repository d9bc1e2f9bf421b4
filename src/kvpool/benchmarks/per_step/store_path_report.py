"""The store-path bench's result as a console table, Markdown (tables + one line per target) and a PNG
(CPU per step against context, log-log, a line per mode; one panel per case and block size)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpool.benchmarks.measure.report import figure, markdown_table, verdict

KVPOOL_MODES = ("incremental", "incremental_mooncake")
TARGET_SCALING_MAX = 1.5  # kvpool modes: largest context vs smallest, per step
TARGET_VLLM_MIN = 3.0  # vllm vs each kvpool mode at the largest context, per step

_HEADERS = ("mode", "case", "block", "context", "steps", "CPU µs/step", "wall µs/step", "keys examined/step")


def _panels(result: dict[str, Any]) -> list[tuple[str, int]]:
    """(case, block size) pairs in the order measured."""
    return list(dict.fromkeys((row["case"], row["block_size"]) for row in result["results"]))


def _stored(row: dict[str, Any]) -> str:
    return f"{row['chunks_stored']}/{row['chunks_expected']}" if "chunks_stored" in row else ""


def _calls(row: dict[str, Any]) -> str:
    """Pool put calls per step: kvpool's counted, vLLM's its save jobs (one batch put each)."""
    calls = row.get("put_calls_per_step", row.get("save_jobs_per_step"))
    return "" if calls is None else f"{calls:.3f}"


def _cells(row: dict[str, Any]) -> list[object]:
    return [
        row["mode"],
        row["case"],
        row["block_size"],
        row["context_tokens"],
        row["steps"],
        row["cpu_us_per_step"],
        row["wall_us_per_step"],
        row["keys_examined_per_step"],
        _calls(row),
        _stored(row),
    ]


def _verdicts(result: dict[str, Any]) -> list[tuple[str, float | None, str, bool | None]]:
    """(what, measured ratio, target, pass) for every target the run measured."""
    summary = result["summary"]
    small, large, targets = summary["small_context"], summary["large_context"], summary["targets"]
    lines: list[tuple[str, float | None, str, bool | None]] = []
    for case, per_block in summary["per_case"].items():
        for block, entry in per_block.items():
            where = f"{case}, block {block}"
            for mode in ("incremental", "incremental_mooncake"):
                if f"{mode}_large_vs_small" in entry:
                    lines.append(
                        (
                            f"{where}: {mode} CPU/step, {large:,} vs {small:,} tokens",
                            entry[f"{mode}_large_vs_small"],
                            f"<= {targets['kvpool_large_vs_small_max']}x",
                            entry[f"{mode}_scaling_pass"],
                        )
                    )
                if f"vllm_vs_{mode}_at_large" in entry:
                    lines.append(
                        (
                            f"{where}: vllm / {mode} CPU/step at {large:,} tokens",
                            entry[f"vllm_vs_{mode}_at_large"],
                            f">= {targets['vllm_vs_kvpool_at_large_min']}x",
                            entry[f"vllm_vs_{mode}_pass"],
                        )
                    )
    return lines


def _references(result: dict[str, Any]) -> list[str]:
    """Figures with no target: the re-check baselines against kvpool's incremental path. A target on
    them could not fail (the `full` baseline re-checks every key on every step), so they are shown as
    what they are: the cost of not being incremental, per step and on the steps that complete a block."""
    summary = result["summary"]
    large = summary["large_context"]
    lines = []
    for case, per_block in summary["per_case"].items():
        for block, entry in per_block.items():
            for mode, what in (("full", "full re-check every step"), ("full_on_block", "full re-check per block")):
                ratio = entry.get(f"{mode}_vs_incremental_at_large")
                if ratio is not None:
                    lines.append(
                        f"- {case}, block {block}: {what} / incremental CPU/step at {large:,} tokens: "
                        f"{ratio:.3g} (reference)"
                    )
    return lines


def to_markdown(result: dict[str, Any]) -> str:
    """Per (case, block size): CPU µs per step by context and mode; then every row in full and one line
    per target with its measured ratio."""
    rows = result["results"]
    modes = list(dict.fromkeys(row["mode"] for row in rows))
    parts = [
        f"Save path CPU per decode step of {result['requests']} requests (µs, all threads of the process), "
        f"fastest of {result.get('windows', '?')} windows:"
    ]
    for case, block in _panels(result):
        by_context: dict[int, dict[str, float]] = {}
        for row in rows:
            if (row["case"], row["block_size"]) == (case, block):
                by_context.setdefault(row["context_tokens"], {})[row["mode"]] = row["cpu_us_per_step"]
        table = [[context, *(costs.get(mode, "") for mode in modes)] for context, costs in sorted(by_context.items())]
        parts.append(f"**{case}, block {block}**\n\n" + markdown_table(("context", *modes), table))
    parts.append(
        "Every cell (stored: chunks of the decode steps found in the pool / expected):\n\n"
        + markdown_table((*_HEADERS, "put calls/step", "stored"), [_cells(row) for row in rows])
    )
    lines = [verdict(what, measured, target, passed) for what, measured, target, passed in _verdicts(result)]
    mark = "PASS" if result["summary"]["pass"] else "FAIL"
    parts.append("\n".join([*lines, f"- all targets: {mark}"]))
    references = _references(result)
    if references:
        parts.append("References (no target):\n\n" + "\n".join(references))
    parts.append("\n".join(f"- {note}" for note in result.get("notes", [])))
    return "\n\n".join(parts) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """CPU µs per step against context, log-log, a line per mode; a panel per (case, block size)."""
    rows = result["results"]
    panels = _panels(result)
    with figure(path, ncols=len(panels), width=4.8) as (_fig, axes):
        for ax, (case, block) in zip(axes, panels):
            cells = [row for row in rows if (row["case"], row["block_size"]) == (case, block)]
            for mode in dict.fromkeys(row["mode"] for row in cells):
                line = sorted((r["context_tokens"], r["cpu_us_per_step"]) for r in cells if r["mode"] == mode)
                ax.plot([c for c, _ in line], [max(us, 1e-3) for _, us in line], marker="o", label=mode)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context tokens")
            ax.set_ylabel("CPU µs per decode step")
            ax.set_title(f"{case}, block {block}, {result['requests']} requests")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 132))
    table = Table(title=f"store path: CPU per decode step, {result['requests']} requests")
    for column in (*_HEADERS, "put calls/step", "stored"):
        table.add_column(column, justify="left" if column in ("mode", "case") else "right")
    for row in result["results"]:
        table.add_row(
            row["mode"],
            row["case"],
            str(row["block_size"]),
            f"{row['context_tokens']:,}",
            str(row["steps"]),
            f"{row['cpu_us_per_step']:,.1f}",
            f"{row['wall_us_per_step']:,.1f}",
            f"{row['keys_examined_per_step']:,.2f}",
            _calls(row),
            _stored(row),
        )
    console.print(table)
    for what, measured, target, passed in _verdicts(result):
        mark = "n/a" if passed is None else ("PASS" if passed else "FAIL")
        console.print(f"{what} = {measured}x (target {target}) {mark}")
    console.print(f"all targets: {'PASS' if result['summary']['pass'] else 'FAIL'}")
    for note in result.get("notes", []):
        console.print(f"[dim]{note}[/dim]")


def _cost(results: Sequence[dict[str, Any]], mode: str, case: str, context: int, block_size: int) -> float | None:
    for row in results:
        if (row["mode"], row["case"], row["context_tokens"], row["block_size"]) == (mode, case, context, block_size):
            return float(row["cpu_us_per_step"])
    return None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return round(a / b, 2) if b > 0 else math.inf


def summarize(
    results: Sequence[dict[str, Any]],
    contexts: list[int],
    block_sizes: list[int],
    cases: Sequence[str],
    modes: Sequence[str],
) -> dict[str, Any]:
    """Per (case, block size): each kvpool mode's flatness (largest / smallest context), the full
    baseline's and vLLM's cost over each kvpool mode's at the largest context; `pass` over every
    ratio measured. A missing mode leaves its ratios None and its checks out."""
    small, large = contexts[0], contexts[-1]
    per_case: dict[str, dict[str, Any]] = {}
    checks: list[bool] = []
    for case in cases:
        per_block: dict[str, Any] = {}
        for block_size in block_sizes:

            def cost(mode: str, context: int, case: str = case, block_size: int = block_size) -> float | None:
                return _cost(results, mode, case, context, block_size)

            entry: dict[str, Any] = {}
            for mode in KVPOOL_MODES:
                if mode not in modes:
                    continue
                scaling = _ratio(cost(mode, large), cost(mode, small))
                entry[f"{mode}_large_vs_small"] = scaling
                entry[f"{mode}_scaling_pass"] = scaling is not None and scaling <= TARGET_SCALING_MAX
                checks.append(entry[f"{mode}_scaling_pass"])
                if "vllm" in modes:
                    speedup = _ratio(cost("vllm", large), cost(mode, large))
                    entry[f"vllm_vs_{mode}_at_large"] = speedup
                    entry[f"vllm_vs_{mode}_pass"] = speedup is not None and speedup >= TARGET_VLLM_MIN
                    checks.append(entry[f"vllm_vs_{mode}_pass"])
            if "full" in modes and "incremental" in modes:
                entry["full_vs_incremental_at_large"] = _ratio(cost("full", large), cost("incremental", large))
            if "full_on_block" in modes and "incremental" in modes:
                entry["full_on_block_vs_incremental_at_large"] = _ratio(
                    cost("full_on_block", large), cost("incremental", large)
                )
            if "vllm" in modes:
                entry["vllm_large_vs_small"] = _ratio(cost("vllm", large), cost("vllm", small))
            per_block[str(block_size)] = entry
        per_case[case] = per_block
    return {
        "small_context": small,
        "large_context": large,
        "targets": {
            "kvpool_large_vs_small_max": TARGET_SCALING_MAX,
            "vllm_vs_kvpool_at_large_min": TARGET_VLLM_MIN,
        },
        "per_case": per_case,
        "pass": bool(checks) and all(checks),
    }
