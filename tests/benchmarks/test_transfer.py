"""`kvpool bench transfer`: a tiny run of each backend, checking the JSON shape (no timing assertions)."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from kvpool.benchmarks.transfer import backends
from kvpool.testing.mooncake import mooncake_or_skip

KiB = 1 << 10
TINY = {"chunk_sizes": (64 * KiB,), "pieces": (4, 1), "keys_per_batch": 4, "reps": 1, "min_sample_s": 0.0}
COMMON = {
    "backend",
    "op",
    "chunk_bytes",
    "pieces",
    "keys_per_batch",
    "rounds",
    "kvpool_gbps",
    "kvpool_pieces_gbps",
    "memcpy_gbps",
}


def check_shape(result: dict[str, Any], backend: str, placements: tuple[str, ...] = ()) -> None:
    json.dumps(result)  # plain JSON all the way down
    rows = result["results"]
    cells = {(r.get("placement"), r["op"], r["chunk_bytes"], r["pieces"]) for r in rows}
    expected = {
        (placement, op, 64 * KiB, pieces)
        for placement in (placements or (None,))
        for op in ("put", "get")
        for pieces in (4, 1)
    }
    assert cells == expected and len(rows) == len(expected)
    for row in rows:
        assert row["backend"] == backend
        assert set(row) >= COMMON
        assert row["kvpool_gbps"] > 0 and row["kvpool_pieces_gbps"] > 0 and row["memcpy_gbps"] > 0
        assert row["rounds"] >= result["config"]["reps"]
        if backend == "mooncake":
            assert row["raw_gbps"] > 0
            for path in ("raw_multi_gbps", "raw_gather_gbps"):
                assert (row[path] is None) == (row["pieces"] == 1)
        else:
            assert "raw_gbps" not in row and "placement" not in row
    summary = result["summary"]
    assert summary["baseline"] == ("memcpy" if backend == "memory" else "raw_same_pieces")
    assert summary["threshold"] == (backends.MEMORY_TARGET if backend == "memory" else backends.MOONCAKE_TARGET)
    assert len(summary["ratios"]) == len(rows)
    assert all(isinstance(check["pass"], bool) and check["ratio"] >= 0 for check in summary["ratios"])
    for row, check in zip(rows, summary["ratios"]):
        if backend == "memory":
            assert check["baseline"] == "memcpy"
        elif row["pieces"] == 1:
            assert check["baseline"] == "raw" and check["ratio"] == check["raw_ratio"]
        else:  # measured against the faster raw way of moving the same pieces
            faster = max(row["raw_multi_gbps"], row["raw_gather_gbps"])
            assert row[check["baseline"] + "_gbps"] == faster
            assert check["ratio"] == round(row["kvpool_gbps"] / faster, 3)
    assert summary["pass"] == all(check["pass"] for check in summary["ratios"])
    for row in rows:  # the seals' cost, each way, as a share of kvpool's own time; and the sealed path works
        assert row["kvpool_sealed_gbps"] > 0 and min(row["seal_cost"].values()) > 0
    integrity = summary["integrity"]
    loads = [row["seal_cost"]["sampled"] for row in rows if row["op"] == "get"]
    assert integrity["worst_load_cost"] == max(loads)
    assert integrity["pass"] == (max(loads) < backends.SEAL_COST_TARGET)
    assert summary["min_ratio"] == min(check["ratio"] for check in summary["ratios"])
    assert summary["failed"] == [check for check in summary["ratios"] if not check["pass"]]


def test_memory(capsys: pytest.CaptureFixture[str]) -> None:
    result = backends.run("memory", **TINY)
    check_shape(result, "memory")
    backends.print_table(result)
    assert "kvpool >= 60% of memcpy" in capsys.readouterr().out


@pytest.mark.mooncake
def test_mooncake_local_and_remote(capsys: pytest.CaptureFixture[str]) -> None:
    """Both placements: `remote` moves the 4-piece values through the staging buffer over TCP, and the
    bench checks every path read back the bytes it wrote."""
    mooncake_or_skip()
    result = backends.run("mooncake", placements=("local", "remote"), **TINY)
    check_shape(result, "mooncake", ("local", "remote"))
    backends.print_table(result)
    out = capsys.readouterr().out
    assert "kvpool >= 80% of raw Mooncake moving the same pieces" in out
    assert "vs the contiguous raw call" in out


def test_cli_json(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from kvpool.ops.cli import app

    monkeypatch.setattr(backends, "run", functools.partial(backends.run, **TINY))
    outcome = CliRunner().invoke(app, ["bench", "transfer", "--backend", "memory", "--json", "--no-fail"])
    assert outcome.exit_code == 0, outcome.output
    check_shape(json.loads(outcome.output), "memory")


def test_cli_options_reach_the_run_and_bad_ones_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from kvpool.ops.cli import app

    seen: dict[str, Any] = {}
    real_run = backends.run

    def fake_run(**kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs)
        return real_run(chunk_sizes=(64 * KiB,), **{**kwargs, "reps": 1, "min_sample_s": 0.0})

    monkeypatch.setattr(backends, "run", fake_run)
    flags = ["--json", "--no-fail", "--pieces", "16,2", "--keys", "3", "--reps", "2"]
    outcome = CliRunner().invoke(app, ["bench", "transfer", *flags])
    assert outcome.exit_code == 0, outcome.output
    assert seen == {"backend": "memory", "pieces": [16, 2], "keys_per_batch": 3, "reps": 2}
    assert {row["pieces"] for row in json.loads(outcome.output)["results"]} == {16, 2}

    for bad, hint in [
        (["--pieces", "4,x"], "--pieces"),
        (["--pieces", "3"], "does not split"),
        (["--keys", "0"], "--keys"),
    ]:
        outcome = CliRunner().invoke(app, ["bench", "transfer", *bad])
        assert outcome.exit_code == 2 and hint in outcome.output, outcome.output


def test_cheap_cells_run_rounds_until_each_path_has_enough_samples() -> None:
    result = backends.run("memory", **{**TINY, "pieces": (1,), "reps": 2, "min_sample_s": 0.02})
    rounds = [row["rounds"] for row in result["results"]]
    assert all(2 < count <= backends.MAX_REPS for count in rounds), rounds


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="backend"):
        backends.run("disk")
    with pytest.raises(ValueError, match="pieces"):
        backends.run("memory", chunk_sizes=(1000,), pieces=(3,), keys_per_batch=1, reps=1)

