"""The `kvpool` command tells the truth in its exit code: 1 for a missed target or differing outputs, 2 for
a bad option value (named, before any work), 0 otherwise."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

import kvpool
from kvpool.benchmarks.per_step import lookup
from kvpool.ops import demo
from kvpool.ops.cli import app


def fake_lookup(passed: bool) -> Any:
    def run(**_: Any) -> dict[str, Any]:
        return {"reps": 1, "rows": [], "embedded_p99_vs_vllm_local": [], "target": "t", "pass": passed}

    return run


@pytest.mark.parametrize(("passed", "flags", "code"), [(True, [], 0), (False, [], 1), (False, ["--no-fail"], 0)])
def test_a_bench_that_prints_fail_exits_1_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, passed: bool, flags: list[str], code: int
) -> None:
    monkeypatch.setattr(lookup, "run", fake_lookup(passed))
    outcome = CliRunner().invoke(app, ["bench", "lookup", "--json", "--no-mooncake", *flags])
    assert outcome.exit_code == code, outcome.output
    assert json.loads(outcome.output)["pass"] is passed  # printed either way
    table = CliRunner().invoke(app, ["bench", "lookup", "--no-mooncake", *flags])
    assert table.exit_code == code and ("PASS" if passed else "FAIL") in table.output


@pytest.mark.parametrize(("identical", "code"), [(True, 0), (False, 1)])
def test_the_demo_exits_1_when_outputs_differ(monkeypatch: pytest.MonkeyPatch, identical: bool, code: int) -> None:
    seen: list[str] = []

    def run(backend: str, quiet: bool) -> dict[str, Any]:
        seen.append(backend)
        return {"identical_outputs": identical}

    monkeypatch.setattr(demo, "run", run)
    outcome = CliRunner().invoke(app, ["demo", "--json", "--backend", "mooncake"])
    assert outcome.exit_code == code, outcome.output
    assert seen == ["mooncake"]


def test_a_bad_demo_backend_is_a_usage_error_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "run", lambda **_: pytest.fail("the demo ran with a bad backend"))
    outcome = CliRunner().invoke(app, ["demo", "--backend", "redis"])
    assert outcome.exit_code == 2
    assert "redis" in outcome.output and "memory" in outcome.output and "mooncake" in outcome.output


def test_a_bad_trace_dtype_is_a_usage_error_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.benchmarks.serving import trace

    monkeypatch.setattr(trace, "run", lambda **_: pytest.fail("the trace ran with a bad dtype"))
    outcome = CliRunner().invoke(app, ["bench", "trace", "--dtype", "float16"])
    assert outcome.exit_code == 2
    assert "float16" in outcome.output and "bfloat16" in outcome.output and "float32" in outcome.output


def test_the_trace_dtype_reaches_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.benchmarks.serving import trace

    seen: dict[str, Any] = {}

    def run(**kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs)
        return {"targets": []}

    monkeypatch.setattr(trace, "run", run)
    monkeypatch.setattr(trace, "print_table", lambda result: None)
    outcome = CliRunner().invoke(app, ["bench", "trace", "--dtype", "float32", "--systems", "kvpool,kvpool-disk"])
    assert outcome.exit_code == 0, outcome.output
    assert seen["dtype"] == "float32" and seen["systems"] == ["kvpool", "kvpool-disk"]


def test_version() -> None:
    outcome = CliRunner().invoke(app, ["--version"])
    assert outcome.exit_code == 0 and outcome.output.strip() == f"kvpool {kvpool.__version__}"
