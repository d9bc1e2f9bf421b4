"""The store-path bench: JSON shape, and the counts that make incremental O(new chunks)."""

from __future__ import annotations

import json

import pytest

from kvpool.benchmarks import store_path


@pytest.fixture(scope="module")
def result() -> dict:  # type: ignore[type-arg]
    windows, store_path.WINDOWS = store_path.WINDOWS, 2  # counts, not times: two windows are plenty
    try:
        return store_path.run(contexts=[1024, 256], block_sizes=[16, 32], requests=2, steps=8)
    finally:
        store_path.WINDOWS = windows


def rows(result: dict, mode: str, block_size: int) -> list[dict]:  # type: ignore[type-arg]
    return sorted(
        (r for r in result["results"] if r["mode"] == mode and r["block_size"] == block_size),
        key=lambda r: r["context_tokens"],
    )


def test_json_shape(result: dict) -> None:  # type: ignore[type-arg]
    json.loads(json.dumps(result))  # plain JSON
    assert len(result["results"]) == len(store_path.MODES) * 2 * 2
    for row in result["results"]:
        assert {"mode", "context_tokens", "block_size", "cpu_us_per_step", "keys_examined_per_step"} <= set(row)
        assert row["mode"] in store_path.MODES
        assert row["cpu_us_per_step"] >= 0 and row["steps"] > 0
    summary = result["summary"]
    assert (summary["small_context"], summary["large_context"]) == (256, 1024)
    assert set(summary["per_block_size"]) == {"16", "32"}
    for entry in summary["per_block_size"].values():
        assert isinstance(entry["incremental_scaling_pass"], bool)
        assert isinstance(entry["full_speedup_pass"], bool)
        assert entry["incremental_large_vs_small"] > 0 and entry["full_vs_incremental_at_large"] > 0
    assert isinstance(summary["pass"], bool)


@pytest.mark.parametrize("block_size", [16, 32])
def test_incremental_examines_only_new_chunks(result: dict, block_size: int) -> None:  # type: ignore[type-arg]
    small, large = rows(result, "incremental", block_size)
    # one new chunk per request every block_size steps, whatever the context
    assert small["keys_examined_per_step"] == large["keys_examined_per_step"] == pytest.approx(2 / block_size)
    assert small["steps"] % block_size == 0


@pytest.mark.parametrize("block_size", [16, 32])
def test_full_recheck_grows_with_context(result: dict, block_size: int) -> None:  # type: ignore[type-arg]
    small, large = rows(result, "full", block_size)
    # every step, every request re-examines its whole prefix
    assert small["keys_examined_per_step"] == pytest.approx(2 * 256 / block_size, rel=0.1)
    assert large["keys_examined_per_step"] == pytest.approx(2 * 1024 / block_size, rel=0.1)
    on_block_small, on_block_large = rows(result, "full_on_block", block_size)
    assert on_block_large["keys_examined_per_step"] > 3 * on_block_small["keys_examined_per_step"]


def test_table_prints(result: dict, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[type-arg]
    store_path.print_table(result)
    out = capsys.readouterr().out
    assert "incremental" in out and "full" in out and "block 16" in out


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        store_path.run(contexts=[], block_sizes=[16], requests=1, steps=1)
    with pytest.raises(ValueError, match="shorter than block size"):
        store_path.run(contexts=[8], block_sizes=[16], requests=1, steps=1)
