"""The connector-step bench's result as Markdown (a table of CPU per step per cell, one line per target)
and a PNG (CPU per step against context, log-log, a line per backend; a panel per block size and
request count)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpool.benchmarks.measure.report import figure, markdown_table, verdict
from kvpool.benchmarks.per_step.connector_step import TARGET_FLATNESS_MAX, TARGET_SPEEDUP_MIN

_POOLS = {"memory": "embedded pool", "mooncake": "Mooncake"}


def _panels(result: dict[str, Any]) -> list[tuple[int, int]]:
    return list(dict.fromkeys((cell["block_size"], cell["requests"]) for cell in result["cells"]))


def to_markdown(result: dict[str, Any]) -> str:
    """Per (block size, requests): both roles' CPU µs per step by context and backend; then one line per
    target: vLLM's connector ÷ kvpool at every context, and kvpool's largest ÷ smallest context."""
    cells = result["cells"]
    backends = list(dict.fromkeys(cell["backend"] for cell in cells))
    parts = [
        f"The whole connector's CPU per engine step (scheduler + worker roles, µs), {result['steps']} decode "
        "steps per window, the cheapest of its windows; `vllm` is vLLM's `MooncakeStoreConnector`:"
    ]
    for block, count in _panels(result):
        by_context: dict[int, dict[str, float]] = {}
        for cell in cells:
            if (cell["block_size"], cell["requests"]) == (block, count):
                by_context.setdefault(cell["context"], {})[cell["backend"]] = cell["total_us"]
        table = [[context, *(costs.get(name, "") for name in backends)]
                 for context, costs in sorted(by_context.items())]
        parts.append(f"**block {block}, {count} requests**\n\n" + markdown_table(("context", *backends), table))
    lines = [
        verdict(
            f"block {r['block_size']}, {r['requests']} requests, {r['context']:,} tokens: vllm / kvpool "
            f"({_POOLS.get(r['pool'], r['pool'])}) CPU/step",
            r["vllm_over_kvpool"],
            f">= {TARGET_SPEEDUP_MIN:g}x",
            r["vllm_over_kvpool"] >= TARGET_SPEEDUP_MIN,
        )
        for r in result["ratios"]
    ]
    for f in result["flatness"]:
        what = f"{f['backend']}, block {f['block_size']}, {f['requests']} requests: largest / smallest context"
        if f["backend"] == "vllm":
            lines.append(f"- {what}: {f['largest_over_smallest']:.3g} (reference)")
        else:
            passed = f["largest_over_smallest"] <= TARGET_FLATNESS_MAX
            lines.append(verdict(what, f["largest_over_smallest"], f"<= {TARGET_FLATNESS_MAX:g}x", passed))
    lines.append(f"- all targets: {'PASS' if result['pass'] else 'FAIL'}")
    parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    panels = _panels(result)
    with figure(path, ncols=len(panels), width=4.2) as (_fig, axes):
        for ax, (block, count) in zip(axes, panels):
            cells = [c for c in result["cells"] if (c["block_size"], c["requests"]) == (block, count)]
            for name in dict.fromkeys(c["backend"] for c in cells):
                line = sorted((c["context"], c["total_us"]) for c in cells if c["backend"] == name)
                ax.plot([x for x, _ in line], [max(us, 1e-3) for _, us in line], marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"block {block}, {count} requests")
            ax.set_xlabel("context tokens")
            ax.set_ylabel("connector CPU µs per step")
            ax.legend()
