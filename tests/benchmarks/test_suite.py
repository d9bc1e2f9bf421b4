"""`kvpool bench all`: results, tables and plots for each bench, and a report whose hand-written
readings survive a regeneration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpool.benchmarks import suite
from kvpool.ops.cli import app


def test_the_suite_writes_results_tables_plots_and_the_reports_generated_parts(tmp_path: Path) -> None:
    report = tmp_path / "BENCHMARKS.md"
    report.write_text(
        "# Benchmarks\n\n## Lookup\n\nA reading written by a person.\n\n"
        "<!-- generated:lookup -->\nold figures\n<!-- /generated:lookup -->\n\nMore reading.\n"
    )
    out = tmp_path / "results"
    ticks: list[tuple[str, int]] = []
    summary = suite.run(
        suite.select(["lookup", "transfer-memory"]),
        out_dir=out,
        report=report,
        tiny=True,
        progress=lambda what, done: ticks.append((what, done)),
    )
    assert sum(done for _, done in ticks) == suite.units(suite.select(["lookup", "transfer-memory"]), True) == 2
    for name in ("lookup", "transfer-memory"):
        assert json.loads((out / f"{name}.json").read_text())
        assert "|" in (out / f"{name}.md").read_text()
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    text = report.read_text()
    assert "A reading written by a person." in text and "More reading." in text
    assert "old figures" not in text and "embedded lookup p99" in text
    assert "![Lookup on the scheduler's thread](results/lookup.png)" in text
    assert "<!-- generated:machine -->" in text and "cores" in text
    assert "kvpool bench serve --json" in text  # every command, whichever benches ran
    assert set(summary["verdicts"]) == {"lookup", "transfer-memory"}


def test_a_report_brought_together_from_several_runs_names_each_results_run(tmp_path: Path) -> None:
    """Results of runs made apart (a `--long` serve run in one session, the rest in another, even on
    another machine) make one report: each result records its commit, size and machine, and
    `--report-only` rewrites the report from them, running nothing."""
    out = tmp_path / "results"
    report = tmp_path / "BENCHMARKS.md"
    suite.run(suite.select(["lookup"]), out_dir=out, report=report, tiny=True)
    measured = json.loads((out / "lookup.json").read_text())["measured"]
    assert set(measured) == set(suite.MEASURED) and measured["cores"] >= 1
    other = json.loads((out / "lookup.json").read_text())
    assert measured["vector"] in ("AVX-512", "AVX2", "AVX", "none known") and measured["python_ns"] > 0
    other.update(
        commit="abc1234",
        size="long",
        measured={**measured, "cpu": "Another CPU", "date": "2026-01-02", "vector": "AVX-512", "python_ns": 31.5},
    )
    (out / "lookup.json").write_text(json.dumps(other))
    done = CliRunner().invoke(app, ["bench", "all", "--report-only", "--out", str(out), "--report", str(report)])
    assert done.exit_code == 0, done.output
    text = report.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `lookup.json`"))
    assert "2026-01-02" in row and "`abc1234`" in row and "--long" in row and "Another CPU" in row, row
    assert "AVX-512, Python loop 31.5 ns" in row, "two machines of one CPU name are told apart"
    assert "embedded lookup p99" in text, "the bench's own tables are kept"
    refused = CliRunner().invoke(app, ["bench", "all", "--report-only", "--long"])
    assert refused.exit_code == 2 and "runs nothing" in refused.output


def test_a_result_whose_rounds_came_from_two_runs_names_each_run_with_its_rounds(tmp_path: Path) -> None:
    out = tmp_path / "results"
    report = tmp_path / "BENCHMARKS.md"
    suite.run(suite.select(["lookup"]), out_dir=out, report=report, tiny=True)
    result = json.loads((out / "lookup.json").read_text())
    measured = result["measured"]
    result["runs"] = [
        {**measured, "commit": "aaa1111", "date": "2026-12-04", "first_round": 0, "last_round": 5},
        {
            **measured,
            "commit": "bbb2222",
            "date": "2026-12-05",
            "cpu": "Another CPU",
            "first_round": 6,
            "last_round": 9,
        },
    ]
    (out / "lookup.json").write_text(json.dumps(result))
    suite.regenerate(report, out)
    row = next(line for line in report.read_text().splitlines() if line.startswith("| `lookup.json`"))
    assert "2026-12-04, 2026-12-05" in row and "`aaa1111` (rounds 1-6), `bbb2222` (rounds 7-10)" in row, row
    assert "Another CPU" in row and measured["cpu"] in row, row


def test_an_unknown_bench_is_named_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'nope'.*store-path"):
        suite.select(["nope"])
    outcome = CliRunner().invoke(app, ["bench", "all", "--only", "nope"])
    assert outcome.exit_code == 2 and "nope" in outcome.output


def test_every_bench_of_the_suite_has_its_report_functions_and_tiny_arguments() -> None:
    for bench in suite.BENCHES:
        module, reporter = bench.load()
        assert callable(module.run) and callable(reporter.to_markdown) and callable(reporter.plot)
        assert bench.arguments(tiny=True) != bench.arguments(tiny=False), bench.name


def test_a_result_from_before_the_machines_speed_was_recorded_still_names_its_machine() -> None:
    old = {"date": "2026-12-03", "cpu": "AMD EPYC", "cores": 2, "memory_gib": 23.5}
    assert suite._where(old) == "AMD EPYC, 2 cores, 23.5 GiB"
    recorded = {**old, "vector": "AVX2", "python_ns": 94.0}
    assert suite._where(recorded) == "AMD EPYC, 2 cores, 23.5 GiB, AVX2, Python loop 94.0 ns"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"sse2", "avx", "avx2", "avx512f"}, "AVX-512"),
        ({"avx", "avx2"}, "AVX2"),
        ({"avx"}, "AVX"),
        (set(), "none known"),
    ],
)
def test_the_widest_vector_extension_is_named(flags: set[str], expected: str) -> None:
    assert suite.vector_extensions(flags) == expected
