"""The store-path bench at tiny size: JSON shape, the counts that make each save path O(new chunks), the
chunks really stored (counted back with `exists` / vLLM's own `batch_is_exist`), and the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvpool.benchmarks.per_step import store_path

REQUESTS, BLOCK = 2, 16
GROUPS = {"full": 1, "hybrid": 2, "put_step2": 1}
PUT_STEP = {"full": 1, "hybrid": 1, "put_step2": 2}


@pytest.fixture(scope="module")
def memory_result() -> dict[str, Any]:
    return store_path.run(**store_path.TINY_ARGS)


@pytest.fixture(scope="module")
def mooncake_result() -> dict[str, Any]:
    """kvpool on kvpool's Mooncake client and vLLM's own connector, on one real mooncake_master."""
    pytest.importorskip("vllm")
    from kvpool.testing.mooncake import mooncake_or_skip

    mooncake_or_skip()
    return store_path.run(
        contexts=[256, 1024],
        block_sizes=[BLOCK],
        requests=REQUESTS,
        steps=BLOCK,
        windows=1,  # counts, not times: one window
        modes=["incremental_mooncake", "vllm"],
        cases=list(store_path.CASES),
    )


def rows(result: dict[str, Any], mode: str, case: str) -> list[dict[str, Any]]:
    return sorted(
        (r for r in result["results"] if (r["mode"], r["case"]) == (mode, case)), key=lambda r: r["context_tokens"]
    )


def new_chunks_per_step(case: str) -> float:
    """Each request completes one block every BLOCK steps, in every group; a striped rank owns 1/put_step."""
    return REQUESTS * GROUPS[case] / BLOCK / PUT_STEP[case]


def test_json_shape(memory_result: dict[str, Any]) -> None:
    json.loads(json.dumps(memory_result))  # plain JSON
    modes, cases = store_path.TINY_ARGS["modes"], store_path.CASES
    assert len(memory_result["results"]) == len(modes) * len(cases) * 2
    for row in memory_result["results"]:
        assert {"mode", "case", "context_tokens", "block_size", "cpu_us_per_step", "keys_examined_per_step"} <= set(row)
        assert row["cpu_us_per_step"] >= 0 and row["steps"] > 0
    summary = memory_result["summary"]
    assert (summary["small_context"], summary["large_context"]) == (256, 1024)
    assert set(summary["per_case"]) == set(cases)
    for per_block in summary["per_case"].values():
        entry = per_block[str(BLOCK)]
        assert isinstance(entry["incremental_scaling_pass"], bool)
        assert entry["incremental_large_vs_small"] > 0 and entry["full_vs_incremental_at_large"] > 0
        assert entry["full_on_block_vs_incremental_at_large"] > 0
        assert "full_speedup_pass" not in entry  # a reference: the re-check baseline has no target to fail
        assert "vllm_vs_incremental_at_large" not in entry  # not measured: no ratio, no check
    assert isinstance(summary["pass"], bool)


@pytest.mark.parametrize("case", store_path.CASES)
def test_incremental_examines_and_stores_only_new_chunks(memory_result: dict[str, Any], case: str) -> None:
    small, large = rows(memory_result, "incremental", case)
    assert small["keys_examined_per_step"] == large["keys_examined_per_step"] == new_chunks_per_step(case)
    assert small["steps"] % BLOCK == 0
    for row in (small, large):
        assert 0 < row["chunks_stored"] == row["chunks_expected"]


@pytest.mark.parametrize("case", store_path.CASES)
def test_full_recheck_grows_with_context(memory_result: dict[str, Any], case: str) -> None:
    small, large = rows(memory_result, "full", case)
    per_token = REQUESTS * GROUPS[case] / PUT_STEP[case] / BLOCK  # every step re-examines the whole prefix
    assert small["keys_examined_per_step"] == pytest.approx(256 * per_token, rel=0.1)
    assert large["keys_examined_per_step"] == pytest.approx(1024 * per_token, rel=0.1)
    on_block_small, on_block_large = rows(memory_result, "full_on_block", case)
    assert on_block_large["keys_examined_per_step"] > 3 * on_block_small["keys_examined_per_step"]


def test_report(memory_result: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = store_path.to_markdown(memory_result)
    assert "| context | incremental | full | full_on_block |" in text
    # the re-check baselines are references: a figure, never a verdict (the baseline could not lose)
    reference = "- hybrid, block 16: full re-check every step / incremental CPU/step at 1,024 tokens: "
    assert reference in text and text.split(reference)[1].split("\n")[0].endswith("(reference)")
    assert "hybrid, block 16: full re-check per block / incremental CPU/step" in text
    assert "hybrid, block 16: incremental CPU/step, 1,024 vs 256 tokens" in text and "(target <= 1.5x)" in text
    assert "- all targets: " in text
    pytest.importorskip("matplotlib")
    png = tmp_path / "store_path.png"
    store_path.plot(memory_result, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    store_path.print_table(memory_result)
    out = capsys.readouterr().out
    assert "put_step2" in out and "full_on_block" in out and "all targets" in out


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        store_path.run(contexts=[], block_sizes=[16], requests=1, steps=1)
    with pytest.raises(ValueError, match="shorter than block size"):
        store_path.run(contexts=[8], block_sizes=[16], requests=1, steps=1)
    with pytest.raises(ValueError, match="unknown: \\['sliding'\\]"):
        store_path.run(contexts=[64], block_sizes=[16], requests=1, steps=1, cases=["sliding"])


def test_cli_options() -> None:
    from kvpool.ops.cli import app

    args = ["bench", "store-path", "--json", "--no-fail", "--contexts", "64,128", "--block-sizes", "16"]
    outcome = CliRunner().invoke(app, [*args, "--requests", "1", "--steps", "16", "--modes", "incremental"])
    assert outcome.exit_code == 0, outcome.output
    result = json.loads(outcome.output)
    assert result["modes"] == ["incremental"] and result["cases"] == list(store_path.CASES)
    bad = CliRunner().invoke(app, [*args, "--modes", "incremental,bogus"])
    assert bad.exit_code == 2 and "--modes" in bad.output


@pytest.mark.mooncake
@pytest.mark.parametrize("case", store_path.CASES)
def test_vllm_and_kvpool_on_mooncake_store_every_new_chunk(mooncake_result: dict[str, Any], case: str) -> None:
    for mode in ("incremental_mooncake", "vllm"):
        for row in rows(mooncake_result, mode, case):
            assert 0 < row["chunks_stored"] == row["chunks_expected"], row  # in the master, by batch_is_exist


@pytest.mark.mooncake
@pytest.mark.parametrize("case", store_path.CASES)
def test_both_save_paths_examine_only_new_chunks(mooncake_result: dict[str, Any], case: str) -> None:
    """vLLM 0.32's sending thread resumes from its own high-water mark (`_saved_offset`): like kvpool's
    save path it examines only the chunks a step completed, whatever the context."""
    for mode in ("incremental_mooncake", "vllm"):
        small, large = rows(mooncake_result, mode, case)
        assert small["keys_examined_per_step"] == large["keys_examined_per_step"] == new_chunks_per_step(case)
    for row in rows(mooncake_result, "vllm", case):
        # vLLM's scheduler emits a save job per request per completed block, also where the rank owns none
        assert row["save_jobs_per_step"] == REQUESTS / BLOCK


@pytest.mark.mooncake
def test_vllm_targets_reported(mooncake_result: dict[str, Any], tmp_path: Path) -> None:
    for case in store_path.CASES:
        entry = mooncake_result["summary"]["per_case"][case][str(BLOCK)]
        assert entry["vllm_vs_incremental_mooncake_at_large"] > 0
        assert isinstance(entry["vllm_vs_incremental_mooncake_pass"], bool)
        assert "full_vs_incremental_at_large" not in entry
    text = store_path.to_markdown(mooncake_result)
    assert "put_step2, block 16: vllm / incremental_mooncake CPU/step at 1,024 tokens" in text
    assert "(target >= 3.0x)" in text
    pytest.importorskip("matplotlib")
    store_path.plot(mooncake_result, tmp_path / "mooncake.png")
    assert (tmp_path / "mooncake.png").stat().st_size > 10_000
