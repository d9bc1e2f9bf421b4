"""The scale bench at tiny size: costs per request that stay per request, and a pool at capacity whose
chain-aware eviction keeps more reachable prefix than plain LRU (counts on a seeded workload, not times)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from kvpool.backends.base import Status
from kvpool.backends.memory import MemoryBackend
from kvpool.benchmarks.per_step import scale
from kvpool.benchmarks.per_step.scale_pool import CHUNK_BYTES, PlainLRU, capacity_row
from kvpool.ops.cli import app


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    return scale.run(**scale.TINY_ARGS)


def part(result: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [row for row in result["results"] if row["part"] == name]


def test_json_shape(result: dict[str, Any]) -> None:
    json.loads(json.dumps(result))  # plain JSON
    assert result["bench"] == "scale"
    levels = sorted(scale.TINY_ARGS["concurrency"])
    for name in ("store", "lookup"):
        rows = part(result, name)
        assert [row["requests"] for row in rows] == levels
        assert all(row["us_per_step"] > 0 and row["us_per_request"] > 0 for row in rows)
    assert [row["policy"] for row in part(result, "capacity")] == ["plain_lru", "chain_aware"]
    summary = result["summary"]
    for name in ("store", "lookup", "hit", "unreachable"):
        assert isinstance(summary[f"{name}_pass"], bool)
    assert summary[f"store_per_request_{levels[-1]}_vs_{levels[0]}"] > 0
    assert summary["pass"] == all(summary[f"{name}_pass"] for name in ("store", "lookup", "hit", "unreachable"))


def test_keys_examined_per_request_do_not_grow_with_concurrency(result: dict[str, Any]) -> None:
    block, levels = result["block_size"], scale.TINY_ARGS["concurrency"]
    # the store path: one new chunk per request every block_size steps, however many requests share a step
    assert [row["keys_per_request"] for row in part(result, "store")] == pytest.approx([1 / block] * len(levels))
    # a lookup reads its own prompt's chunks, whatever else arrives in the step
    assert {row["keys_per_request"] for row in part(result, "lookup")} == {result["prompt_tokens"] // block}


def test_the_pool_at_capacity_evicts_and_chain_aware_eviction_keeps_more_reachable(result: dict[str, Any]) -> None:
    before, after = part(result, "capacity")
    for row in (before, after):
        assert 0.9 <= row["eviction_rate"] <= 1.0  # kept full: nearly every chunk put evicts one
        assert 0 < row["token_hit_rate"] < row["ideal_token_hit_rate"]  # capacity costs hits
    assert after["token_hit_rate"] >= before["token_hit_rate"]
    assert after["request_hit_fraction"] >= before["request_hit_fraction"]
    assert after["unreachable_bytes"] < before["unreachable_bytes"]
    assert result["summary"]["hit_pass"] and result["summary"]["unreachable_pass"]


@pytest.mark.parametrize(("pool_type", "head_oldest"), [(PlainLRU, True), (MemoryBackend, False)])
def test_plain_lru_ages_a_chain_head_first_and_the_pool_tail_first(pool_type: type, head_oldest: bool) -> None:
    pool = pool_type(4 * CHUNK_BYTES)
    chain = [f"c{i}" for i in range(4)]
    value = [np.zeros(CHUNK_BYTES, np.uint8)]
    assert pool.put(chain, [value] * 4) == [Status.OK] * 4
    oldest = chain[0] if head_oldest else chain[-1]
    assert pool.keys()[0] == oldest
    pool.put(["other"], [value])  # full: the least recently used chunk goes
    assert pool.exists(chain) == [key != oldest for key in chain]
    rest = [key for key in chain if key != oldest]
    dests = [[np.empty(CHUNK_BYTES, np.uint8)] for _ in rest]
    assert pool.get_into(rest, dests) == [Status.OK] * 3  # statuses in the caller's order
    assert pool.keys()[1] == (rest[0] if head_oldest else rest[-1])  # a read ages the chain the same way


def test_the_same_seed_serves_the_same_requests() -> None:
    kwargs: dict[str, Any] = {
        "prefixes": 8, "prefix_chunks": 8, "suffix_chunks": 2, "capacity_chunks": 24, "pool_requests": 200,
        "zipf": 1.0, "batch_chunks": 64, "seed": 3,
    }  # fmt: skip
    assert capacity_row("chain_aware", **kwargs) == capacity_row("chain_aware", **kwargs)


def test_markdown_names_every_target(result: dict[str, Any]) -> None:
    text = scale.to_markdown(result)
    assert text.count("(target ") == 4
    for name in ("store path cost per request", "lookup cost per request", "token hit rate", "unreachable bytes"):
        assert name in text
    assert "plain LRU" in text and "chain-aware" in text and "| ---: |" in text


def test_table_prints(result: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    scale.print_table(result)
    out = capsys.readouterr().out
    assert "store" in out and "lookup" in out and "chain" in out  # rich may fold the pool's name
    assert ("PASS" in out) or ("FAIL" in out)


def test_plot_writes_a_png(result: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "scale.png"
    scale.plot(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def test_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scale, "ALL_ARGS", scale.TINY_ARGS)
    outcome = CliRunner().invoke(app, ["bench", "scale", "--json", "--no-fail", "--concurrency", "1,4"])
    assert outcome.exit_code == 0, outcome.output
    assert [r["requests"] for r in json.loads(outcome.output)["results"] if r["part"] == "store"] == [1, 4]
    bad = CliRunner().invoke(app, ["bench", "scale", "--concurrency", "0,4"])
    assert bad.exit_code == 2 and "--concurrency" in bad.output


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        scale.run(**{**scale.TINY_ARGS, "concurrency": []})
    with pytest.raises(ValueError, match="cannot hold"):
        scale.run(**{**scale.TINY_ARGS, "capacity_chunks": 4})
