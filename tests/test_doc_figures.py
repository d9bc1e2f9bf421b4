"""Every figure in README.md, docs/ and BENCHMARKS.md's readings is in the result file its paragraph names.

A paragraph (or a table row) that names a result file of `benchmarks/results/` (a link to it, or its
name in backticks) is checked: each number in it written with a decimal point or a thousands
separator (what a measured figure looks like; plain integers are counts and sizes, too common to
check) must be a value of one of the files it names, as printed: rounded half up or as Python formats
it, possibly as a percentage, or converted between s, ms and µs; a number with trailing zeros
(`2,800`) may be a value rounded to its significant digits. Numbers inside a file's strings count
(the targets are written there). Targets in the text itself are numbers too, so they come from
the file. What a paragraph names but no bench measures is listed in `NOT_MEASURED`, each with where
the number does come from; an entry no paragraph uses any more fails, so the list cannot go stale.

The generated parts of BENCHMARKS.md (between `<!-- generated:… -->` markers) are written from the
result files by `kvpool bench all` and checked by the benches' own tests; only the readings around
them are checked here, each against the files its paragraph names or, naming none, against those its
`##` section names (in its text or as a generated part: `<!-- generated:NAME -->` is `NAME.json`).
A table the report shows but the suite does not generate is rendered from its result by its bench
(`RENDERED`) and must appear in the report as rendered."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from decimal import ROUND_HALF_UP, Decimal
from functools import cache
from pathlib import Path
from typing import Any

from kvpool.benchmarks.serving import breakdown
from kvpool.core import checkpoint

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ("README.md", "BENCHMARKS.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
GENERATED = re.compile(r"<!-- generated:[^>]*-->.*?<!-- /generated[^>]*-->", re.S)
PARAGRAPHS = re.compile(r"\n\s*\n|\n(?=\|)")  # blank lines; each table row on its own
FILE_NAMES = re.compile(r"results/([\w.-]+\.json)|`([\w.-]+\.json)`")
# 1,093 or 0.70; not part of a word, a version (0.33.1), a path or a code span's text
FIGURE = re.compile(r"(?<![\w.\-/`])(\d{1,3}(?:,\d{3})+|\d+\.\d+)(?![\w.]*`)(?!\.\d)")
SECTIONS = re.compile(r"\n(?=## )")
MARKERS = re.compile(r"<!-- generated:([\w-]+) -->")
SCALES = (Decimal(1), Decimal(100), Decimal(1000), Decimal("0.001"))  # as is, a percentage, s/ms/µs

# (doc, figure, words of its paragraph): where it comes from, when not from a bench's result file
NOT_MEASURED: dict[tuple[str, str, str], str] = {
    ("docs/correctness.md", "4,096", "tensors a file"):
        f"checkpoint.SAMPLED_TENSORS_PER_FILE = {checkpoint.SAMPLED_TENSORS_PER_FILE:,}",
    ("docs/measurements.md", "11.5", "XXH3 at ~11.5 GB/s"): "XXH3-64 on one core of the machine, timed apart",
    ("BENCHMARKS.md", "11.5", "XXH3 runs at ~11.5 GB/s"): "XXH3-64 on one core of the machine, timed apart",
    ("BENCHMARKS.md", "15.6", "(memcpy 15.6)"): "memcpy on one core of the machine, timed apart",
    ("BENCHMARKS.md", "0.98", "6 in the run before gave 0.98"): "the shared bench's run before (6 rounds)",
    ("BENCHMARKS.md", "1.07", "6 in the run before gave 0.98 [0.90, 1.07]"): "the shared bench's run before",
}  # fmt: skip

# a report table no generated part holds: (report, result file) -> the bench's renderer
RENDERED: dict[tuple[str, str], Callable[[dict[str, Any]], str]] = {
    ("BENCHMARKS.md", "breakdown.json"): breakdown.to_markdown,
}


def _numbers(value: Any, out: set[Decimal]) -> None:
    if isinstance(value, bool):
        return
    if isinstance(value, str):
        out.update(Decimal(t) for t in re.findall(r"\d+(?:\.\d+)?", value))
    elif isinstance(value, int | float):
        out.add(Decimal(repr(value)))
    elif isinstance(value, dict):
        for item in value.values():
            _numbers(item, out)
    elif isinstance(value, list):
        for item in value:
            _numbers(item, out)


@cache
def values_of(name: str) -> frozenset[Decimal]:
    out: set[Decimal] = set()
    _numbers(json.loads((RESULTS / name).read_text()), out)
    return frozenset(out)


def printed_as(value: Decimal, text: str) -> bool:
    digits = text.replace(",", "")
    if "." in digits:
        places = len(digits.split(".")[1])
        rounded = value.quantize(Decimal(1).scaleb(-places), ROUND_HALF_UP)
        return rounded == Decimal(digits) or f"{float(value):.{places}f}" == digits
    zeros = len(digits) - len(digits.rstrip("0"))
    return value.quantize(Decimal(1).scaleb(zeros), ROUND_HALF_UP) == Decimal(digits)


def unmatched(paragraph: str, files: list[str]) -> list[str]:
    values = frozenset().union(*(values_of(name) for name in files))
    return [
        m.group(1)
        for m in FIGURE.finditer(paragraph)
        if not any(printed_as(v * scale, m.group(1)) for v in values for scale in SCALES)
    ]


@cache
def checked_paragraphs() -> list[tuple[str, list[str], str]]:
    """(doc, the result files it names, paragraph) for every paragraph naming a result file."""
    out = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for (report, name), render in RENDERED.items():
            if report == doc:
                text = text.replace(render(json.loads((RESULTS / name).read_text())), "")
        for section in SECTIONS.split(text) if doc == "BENCHMARKS.md" else [text]:
            readings = GENERATED.sub("", section)
            inherited = _named(readings) | {f"{name}.json" for name in MARKERS.findall(section)}
            for paragraph in PARAGRAPHS.split(readings):
                named = _named(paragraph) | (inherited if doc == "BENCHMARKS.md" else set())
                files = sorted(name for name in named if (RESULTS / name).is_file())
                if files:
                    out.append((doc, files, paragraph))
    return out


def _named(text: str) -> set[str]:
    return {a or b for a, b in FILE_NAMES.findall(text)}


@cache
def misses() -> list[tuple[str, str, str]]:
    """(doc, figure, paragraph) for every figure in none of its paragraph's files."""
    return [
        (doc, figure, paragraph)
        for doc, files, paragraph in checked_paragraphs()
        for figure in unmatched(paragraph, files)
    ]


def not_measured(doc: str, figure: str, paragraph: str) -> tuple[str, str, str] | None:
    return next((k for k in NOT_MEASURED if k[:2] == (doc, figure) and k[2] in " ".join(paragraph.split())), None)


def test_every_figure_is_in_the_result_file_its_paragraph_names() -> None:
    paragraphs = checked_paragraphs()
    assert len(paragraphs) >= 30 and {doc for doc, _, _ in paragraphs} >= {"README.md", "docs/measurements.md"}
    wrong = [
        f"{doc}: {figure} is in none of the result files its paragraph names: {paragraph[:160]!r}"
        for doc, figure, paragraph in misses()
        if not_measured(doc, figure, paragraph) is None
    ]
    assert not wrong, "\n".join(wrong)


def test_the_report_shows_each_rendered_table_as_its_bench_renders_it() -> None:
    for (report, name), render in RENDERED.items():
        table = render(json.loads((RESULTS / name).read_text()))
        assert table.count("\n") > 2 and table in (ROOT / report).read_text(), (report, name, table)


def test_every_figure_not_measured_is_still_in_its_doc() -> None:
    used = {not_measured(doc, figure, paragraph) for doc, figure, paragraph in misses()}
    assert set(NOT_MEASURED) <= used, set(NOT_MEASURED) - used


def test_the_check_refuses_a_figure_typed_wrong() -> None:
    _, files, paragraph = next(p for p in checked_paragraphs() if p[0] == "README.md" and "hang.json" in p[1])
    assert not unmatched(paragraph, files)
    assert unmatched(paragraph.replace("0.70", "0.60"), files) == ["0.60"]
    assert unmatched("1,093", ["lookup.json"]) == [] and unmatched("1,094", ["lookup.json"]) == ["1,094"]
    assert printed_as(Decimal("2824.81"), "2,800") and not printed_as(Decimal("2824.81"), "2,900")
    assert printed_as(Decimal("0.695"), "0.70") and printed_as(Decimal("1.115"), "1.11")  # half up; Python's
