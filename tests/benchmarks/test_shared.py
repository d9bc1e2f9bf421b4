"""`kvpool bench shared` at a tiny size: two real vLLM servers on one real mooncake_master (or one LMCache
MP server), B hits what A stored; and the bench's pure parts (prompts, the settle barrier, the summary)
without a server."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from kvpool.benchmarks.serving import shared
from kvpool.testing.mooncake import mooncake_or_skip

TINY = shared.TINY_ARGS["workload"]
SYSTEMS = shared.TINY_ARGS["systems"]


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    mooncake_or_skip()
    ticks: list[str] = []
    measured = shared.run(**shared.TINY_ARGS, progress=ticks.append)
    assert len(ticks) == shared.steps(shared.TINY_ARGS["systems"], TINY)
    return measured


@pytest.mark.vllm
@pytest.mark.mooncake
@pytest.mark.timeout(600)
def test_b_hits_what_a_stored_through_one_shared_pool(result: dict[str, Any], tmp_path: Path) -> None:
    json.loads(json.dumps(result))
    assert not result["failed"]
    assert len(result["results"]) == len(SYSTEMS) * TINY.rounds
    whole = TINY.prompts * TINY.prompt_len  # every token of A's prompts, the tails computed
    for row in result["results"]:
        assert row["hit_ms"] > 0 and row["miss_ms"] > 0 and len(row["hit_ms_each"]) == TINY.prompts, row
        assert row["hit_local_tokens"] == row["miss_cached_tokens"] == 0, row  # B's own cache was cold
        assert row["a_keys"] > 0 and row["evicted"] == 0, row  # A's stores reached the master, nothing evicted
    rows = [r for r in result["results"] if r["system"] == "kvpool-mooncake"]
    assert all(r["hit_pool_tokens"] == whole for r in rows), rows
    summary = result["summary"]
    assert not summary["no_hit"], summary["no_hit"]
    for system in SYSTEMS:
        for key in ("hit_ms", "miss_ms", "pool_hit_rate", "hit_vs_miss"):
            cell = summary["cells"][system][key]
            assert cell["low"] <= cell["estimate"] <= cell["high"] and cell["rounds"] == TINY.rounds
    tails = TINY.prompts * TINY.suffix_len
    assert summary["cells"]["kvpool-mooncake"]["pool_hit_rate"]["estimate"] == round(whole / (whole + tails), 4)
    assert {(t["system"], t["against"], t["metric"]) for t in summary["targets"]} == {
        (s, a, m) for s, a, m, _, _ in shared.TARGETS if {s, a} <= set(SYSTEMS)
    }
    assert result["pass"] == summary["pass"]
    text = shared.to_markdown(result)
    assert "B pool hit rate" in text and "`kvpool-mooncake` B's hit TTFT vs `vllm-mooncake`" in text
    shared.plot(result, tmp_path / "shared.png")
    assert (tmp_path / "shared.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_round_gives_every_system_the_same_fresh_prompts_and_b_hits_share_all_of_a_source() -> None:
    first, again, second = shared.round_prompts(TINY, 0), shared.round_prompts(TINY, 0), shared.round_prompts(TINY, 1)
    assert first == again and first != second
    for source, hit, miss in zip(first.sources, first.hits, first.misses):
        assert len(source) == TINY.prompt_len and len(hit) == len(miss) == TINY.request_len
        assert hit[: TINY.prompt_len] == source
    block = TINY.block_size
    heads = [tuple(p[:block]) for r in (first, second) for p in (*r.sources, *r.misses)]
    assert len(set(heads)) == len(heads)  # a miss shares no block with anything A sent


def test_the_workload_refuses_what_would_make_hits_partial_or_prompts_too_long() -> None:
    with pytest.raises(ValueError, match="whole blocks"):
        replace(TINY, prompt_len=100).check()
    with pytest.raises(ValueError, match="max_model_len"):
        replace(TINY, suffix_len=512).check()
    with pytest.raises(ValueError, match=">= 1"):
        replace(TINY, rounds=0).check()
    assert shared.Workload().pool_tokens > shared.Workload().rounds * 8 * 1152


def test_settle_waits_until_the_count_holds_still_and_gives_up_at_the_timeout() -> None:
    now = [0.0]
    counts = iter([1, 2, 3, 3, 3, 3, 3])

    def sleep(seconds: float) -> None:
        now[0] += seconds

    count, waited = shared.settle(lambda: next(counts), 1.0, 10.0, poll_s=0.25, clock=lambda: now[0], sleep=sleep)
    assert (count, waited) == (3, 1.5)  # last grew at 0.5 s, still at 1.5 s
    rising = iter(range(1000))
    count, waited = shared.settle(lambda: next(rising), 1.0, 2.0, poll_s=0.25, clock=lambda: now[0], sleep=sleep)
    assert (count, waited) == (8, 2.0)  # never still: gives up at the timeout


def _row(system: str, round_index: int, hit: float, miss: float, pool: int, keys: int | None = 5) -> dict[str, Any]:
    return {
        "system": system, "round": round_index, "hit_ms": hit, "miss_ms": miss, "hit_pool_tokens": pool,
        "pool_hit_rate": pool / 1000, "a_keys": None if system == "local" else keys, "a_ttft_ms": 1.0,
    }  # fmt: skip


def _result(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"systems": list(shared.SYSTEMS), "results": rows, "failed": {}}


def test_the_summary_pairs_rounds_and_judges_kvpool_against_vllm_and_local() -> None:
    drift = [1.0, 1.2, 0.9, 1.1, 1.0, 0.95]
    rows = [
        row
        for r, d in enumerate(drift)
        for row in (
            _row("kvpool-mooncake", r, 40 * d, 200 * d, 800),
            _row("vllm-mooncake", r, 50 * d, 200 * d, 800),
            _row("local", r, 200 * d, 200 * d, 0),
        )
    ]
    summary = shared.summarize(_result(rows))
    judged = {(t["against"], t["metric"]): t for t in summary["targets"] if t["system"] == "kvpool-mooncake"}
    assert judged["vllm-mooncake", "hit_ms"]["ratio"]["estimate"] == pytest.approx(0.8)
    assert judged["vllm-mooncake", "hit_ms"]["verdict"] == "PASS"
    assert judged["vllm-mooncake", "pool_hit_rate"]["verdict"] == "PASS"  # equal rates meet ">= 1.0"
    assert judged["vllm-mooncake", "miss_ms"]["verdict"] is None  # the control is a reference
    assert judged["local", "hit_ms"]["ratio"]["estimate"] == pytest.approx(0.2)
    assert summary["pass"] and not summary["no_hit"]
    assert summary["cells"]["local"]["hit_vs_miss"]["estimate"] == pytest.approx(1.0)
    assert summary["cells"]["kvpool-mooncake"]["hit_ms"]["exact"]  # 6 rounds: a real 95% interval


def test_a_system_b_never_hit_through_is_reported_with_the_reason_and_fails_its_targets() -> None:
    rows = [
        row
        for r in range(3)
        for row in (
            _row("kvpool-mooncake", r, 200, 200, 0, keys=0),
            _row("vllm-mooncake", r, 200, 200, 0, keys=7),
            _row("local", r, 200, 200, 0),
        )
    ]
    result = _result(rows)
    summary = shared.summarize(result)
    assert "stored nothing" in summary["no_hit"]["kvpool-mooncake"]
    assert "found none of them" in summary["no_hit"]["vllm-mooncake"]
    hit_targets = [t for t in summary["targets"] if t["metric"] != "miss_ms"]
    assert all(t["ratio"] is None for t in hit_targets)
    assert {t["verdict"] for t in hit_targets if t["system"] == "kvpool-mooncake"} == {"FAIL"}
    assert not summary["pass"]
    result.update(summary=summary, workload={**asdict(TINY), "pool_bytes": 64 << 20}, model="m", hash_seed="0")
    result["elapsed_s"] = 1.0
    text = shared.to_markdown(result)
    assert "B never hit through the pool: A stored nothing" in text and "none: see below" in text
