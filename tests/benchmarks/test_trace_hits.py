"""The trace hit-rate simulation: the prefix rule, each policy's eviction order, and the figures the
trace's own README states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.benchmarks import trace_hits
from kvpool.benchmarks.trace_hits import hits_kvpool, hits_lru, hits_min, hits_tiered


def test_a_hit_is_the_leading_run_of_stored_blocks() -> None:
    chains = [[1, 2, 3], [1, 9, 3], [1, 2, 3, 4]]
    for hits in (hits_kvpool, hits_lru, hits_min, hits_tiered):
        # 1 (second request: block 3 is stored but follows a miss), then 1, 2, 3
        assert hits(chains, 100) == 1 + 3, hits.__name__


def test_the_embedded_pool_evicts_a_chain_tail_first_where_plain_lru_loses_its_head() -> None:
    # room for 3 blocks: after [1, 2, 3] and [7], one block of the first chain goes
    chains = [[1, 2, 3], [7], [1, 2, 3]]
    assert hits_kvpool(chains, 3) == 2  # the tail (3) went: 1 and 2 still hit
    assert hits_lru(chains, 3) == 0  # the head (1) went: nothing after it is reachable


def test_a_disk_tier_below_dram_brings_back_what_dram_evicted() -> None:
    chains = [[1, 2, 3], [7, 8, 9], [1, 2, 3]]
    assert hits_kvpool(chains, 3) == 0  # DRAM holds one chain: the second pushed the first out
    assert hits_tiered(chains, 3, disk_factor=2) == 3  # the disk still has it


def test_belady_keeps_what_is_used_next() -> None:
    chains = [[1, 2], [5, 6], [1, 2], [5, 6], [1, 2]]
    assert hits_min(chains, 2) >= hits_lru(chains, 2)
    assert hits_min(chains, 2) == 4  # keeps [1, 2] throughout (no room for both pairs)


def test_a_capacity_outside_zero_to_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"capacity 1\.5"):
        trace_hits.run(capacities=[1.5], trace=tmp_path / "none.jsonl")


def test_run_reports_every_policy_on_a_small_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    requests = [[0, 1, 2], [0, 1, 3], [0, 4], [0, 1, 2, 5], [6, 7], [0, 1, 3, 8]]
    trace.write_text(
        "".join(json.dumps({"timestamp": i, "hash_ids": chain}) + "\n" for i, chain in enumerate(requests))
    )
    result = trace_hits.run(capacities=[0.5, 1.0], trace=trace)
    assert result["requests"] == 6 and result["distinct_blocks"] == 9
    assert result["unlimited"] == 9 / 18  # hits: none | 0 1 | 0 | 0 1 2 | none | 0 1 3
    full = result["rows"][-1]
    assert full["kvpool"] == full["lru"] == full["min"] == full["kvpool+disk"] == result["unlimited"]
    assert "kvpool hit rate" in trace_hits.to_markdown(result)


@pytest.mark.skipif(not trace_hits.TRACE.is_file(), reason="the Mooncake trace is not beside the checkout")
def test_the_real_trace_gives_the_hit_rates_its_readme_states() -> None:
    result = trace_hits.run(capacities=[0.01], tiered=False)
    assert result["requests"] == 12_031 and result["distinct_blocks"] == 182_790
    assert result["unlimited"] == pytest.approx(0.366, abs=0.001)
    row = result["rows"][0]
    assert row["lru"] == pytest.approx(0.052, abs=0.001) and row["min"] == pytest.approx(0.243, abs=0.001)
    assert result["pass"]
