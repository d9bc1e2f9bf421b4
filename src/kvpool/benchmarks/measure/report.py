"""What every bench's result becomes in `benchmarks/results/`: a Markdown table and a PNG plot.

A bench module that takes part in `kvpool bench all` offers, beside `run` and `print_table`:
* `to_markdown(result) -> str`: its tables and one line per target with the measured ratio;
* `plot(result, path) -> None`: one PNG.
matplotlib is imported only here, and only when a plot is drawn (the `bench` extra), so the core and
the benches' `run` import without it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub Markdown table; numbers right-aligned, floats with at most 3 significant decimals."""

    def cell(value: object) -> str:
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, float):
            return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
        if isinstance(value, int):
            return f"{value:,}"
        return str(value).replace("|", "\\|")

    numeric = [bool(rows) and all(isinstance(row[i], int | float) for row in rows) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join("---:" if numeric[i] else "---" for i in range(len(headers))) + " |",
    ]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(name: str, measured: float | None, target: str, passed: bool | None) -> str:
    """One target line: `name: measured (target) PASS|FAIL|n/a`."""
    shown = "not measured" if measured is None else f"{measured:.3g}"
    mark = "n/a" if passed is None else ("PASS" if passed else "FAIL")
    return f"- {name}: **{shown}** (target {target}) {mark}"


@contextmanager
def figure(path: Path, *, ncols: int = 1, width: float = 6.0, height: float = 4.0) -> Iterator[Any]:
    """A matplotlib figure with `ncols` axes, saved to `path` (PNG, 110 dpi) and closed on exit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    try:
        yield fig, list(axes[0])
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
