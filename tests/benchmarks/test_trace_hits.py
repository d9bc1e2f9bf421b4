"""The trace hit-rate simulation: the prefix rule, each policy's eviction order through the real pool,
the engine cache in front, the derived traces, the ratios and verdicts, and the figures the trace's own
README states."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpool.benchmarks.policy import trace_hits
from kvpool.benchmarks.policy.trace_hits_report import target_ratio
from kvpool.benchmarks.policy.trace_replay import (
    Trace,
    derive,
    engine_hits,
    hits_kvpool,
    hits_lru,
    hits_min,
    hits_pool,
    hits_tiered,
)
from kvpool.benchmarks.policy.trace_reuse import analyze, doc_blocks
from kvpool.core.policy import POLICY_NAMES
from kvpool.ops.cli import app

ROOT = Path(__file__).resolve().parents[2]
REAL = pytest.mark.skipif(not trace_hits.TRACE.is_file(), reason="the Mooncake trace is not beside the checkout")


def write_trace(path: Path, chains: list[list[int]], times: list[float] | None = None) -> Path:
    stamps = times if times is not None else list(range(len(chains)))
    path.write_text("".join(json.dumps({"timestamp": t, "hash_ids": chain}) + "\n" for t, chain in zip(stamps, chains)))
    return path


def conversations(seed: int, requests: int = 160) -> list[list[int]]:
    """Multi-turn chats behind one shared system-prompt block (0): a turn repeats its conversation's
    last prompt and adds blocks; one-off requests in between, as in the Mooncake trace."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    chains = []
    fresh = iter(range(1, 1 << 30))
    for _ in range(requests):
        if prompts and rng.random() < 0.6:
            index = rng.randrange(len(prompts))
            prompts[index] = prompts[index] + [next(fresh) for _ in range(rng.randint(1, 3))]
            chains.append(prompts[index])
        else:
            prompt = [0] + [next(fresh) for _ in range(rng.randint(1, 6))]
            if rng.random() < 0.5:
                prompts.append(prompt)
            chains.append(prompt)
    return chains


def test_a_hit_is_the_leading_run_of_stored_blocks() -> None:
    chains = [[1, 2, 3], [1, 9, 3], [1, 2, 3, 4]]
    for hits in (hits_kvpool, hits_lru, hits_min, hits_tiered):
        # 1 (second request: block 3 is stored but follows a miss), then 1, 2, 3
        assert hits(chains, 100) == 1 + 3, hits.__name__
    for policy in POLICY_NAMES:
        assert hits_pool(chains, 100, policy) == 1 + 3, policy


def test_the_embedded_pool_evicts_a_chain_tail_first_where_plain_lru_loses_its_head() -> None:
    # room for 3 blocks: after [1, 2, 3] and [7], one block of the first chain goes
    chains = [[1, 2, 3], [7], [1, 2, 3]]
    assert hits_kvpool(chains, 3) == 2  # the tail (3) went: 1 and 2 still hit
    assert hits_lru(chains, 3) == 0  # the head (1) went: nothing after it is reachable
    for policy in ("chain-lru", "weighted"):  # a chain's leaf goes first there too
        assert hits_pool(chains, 3, policy) == 2, policy


def test_a_disk_tier_below_dram_brings_back_what_dram_evicted() -> None:
    chains = [[1, 2, 3], [7, 8, 9], [1, 2, 3]]
    assert hits_kvpool(chains, 3) == 0  # DRAM holds one chain: the second pushed the first out
    assert hits_tiered(chains, 3, disk_factor=2) == 3  # the disk still has it


def test_belady_keeps_what_is_used_next() -> None:
    chains = [[1, 2], [5, 6], [1, 2], [5, 6], [1, 2]]
    assert hits_min(chains, 2) >= hits_lru(chains, 2)
    assert hits_min(chains, 2) == 4  # keeps [1, 2] throughout (no room for both pairs)


def test_the_pool_is_not_asked_for_what_the_engine_hit() -> None:
    chains = [[1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]]
    assert engine_hits(chains, 100) == [0, 3, 4]
    assert engine_hits(chains, 0) == [0, 0, 0]
    # behind an engine holding everything the pool serves nothing: it never sees a block it holds asked for
    assert hits_pool(chains, 100, starts=engine_hits(chains, 100)) == 0
    # an engine of 2 blocks keeps the last request's head (tail first): the pool is asked from block 3 on
    starts = engine_hits(chains, 2)
    assert starts == [0, 2, 2]
    assert hits_pool(chains, 100, starts=starts) == 1 + 2  # block 3; then 3 and 4


def test_a_capacity_outside_zero_to_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"capacity 1\.5"):
        trace_hits.run(capacities=[1.5], trace=tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match="nope"):
        trace_hits.run(capacities=[0.5], policies=["nope"], trace=tmp_path / "none.jsonl")


def test_the_derived_traces_are_the_second_half_in_time_and_every_other_conversation() -> None:
    chains = [[0, 1], [0, 2], [0, 1, 3], [0], [0, 4], [0, 2, 5]]
    trace = Trace("t", chains, [0.0, 10.0, 20.0, 30.0, 40.0, 60.0])
    assert derive(trace, "second-half").chains == [[0], [0, 4], [0, 2, 5]]  # from t = 30 (the middle) on
    # conversations after the common head [0]: 1, 2, (none), 4 in order of arrival; kept: the 1st and 3rd
    assert derive(trace, "alternate").chains == [[0, 1], [0, 1, 3], [0]]
    assert derive(trace, "alternate") == derive(trace, "alternate")  # deterministic
    with pytest.raises(ValueError, match="nope"):
        derive(trace, "nope")


def test_the_trace_analysis_counts_reuse_by_position_children_and_sightings() -> None:
    analysis = analyze([[0, 1], [0, 2], [0, 1], [3]])
    assert analysis["sightings"] == 7 and analysis["common_head"] == 0
    first = analysis["by"]["position"][0]  # block 0 three times (reused twice, 1 request on), block 3 once
    assert first["bin"] == "0" and first["sightings"] == 4 and first["reused"] == 0.5
    assert first["median_requests"] == first["p90_requests"] == 1
    assert first["median_new_blocks"] == 2  # blocks first named in between: 1 and 2 (r0 to r1), 2 (r1 to r2)
    children = {row["bin"]: row["sightings"] for row in analysis["by"]["children"]}
    assert children == {"0": 5, "1": 1, "2-3": 1, "4+": 0}  # block 0 had 0, 1 then 2 children
    seen = {row["bin"]: row["sightings"] for row in analysis["by"]["seen"]}
    assert seen == {"0": 4, "1": 2, "2-3": 1, "4+": 0}
    idle = {row["bin"]: row["sightings"] for row in analysis["by"]["idle"]}
    assert idle["first"] == 4 and sum(idle.values()) == 7
    shared = analyze([[0, 1], [0, 2]])  # every request starts with block 0: left out
    assert shared["common_head"] == 1 and shared["sightings"] == 2


def test_run_reports_every_policy_both_variants_and_the_derived_traces(tmp_path: Path) -> None:
    chains = conversations(seed=3)
    trace = write_trace(tmp_path / "chats.jsonl", chains)
    result = trace_hits.run(
        capacities=[0.05, 0.2, 1.0], trace=trace, engine_share=0.05, derived_variants=["pool", "engine"], workers=1
    )
    assert result["trace"] == "chats.jsonl" and result["requests"] == len(chains)
    assert result["policies"][0] == "lru" and set(result["policies"]) == set(POLICY_NAMES)
    assert [entry["derived"] for entry in result["traces"]] == [None, "second-half", "alternate"]
    blocks = result["prompt_blocks"]
    for entry in result["traces"]:
        assert set(entry["variants"]) == {"pool", "engine"}
        for variant, rows in entry["variants"].items():
            for row in rows:
                for policy in result["policies"]:
                    hits = row["hits"][policy]
                    # nothing beats no eviction (MIN may lose to a policy under the prefix rule: not asserted)
                    assert row["pool"][policy] <= row["unlimited"], (entry["name"], variant, policy)
                    assert row["min"] <= row["unlimited"] and row["plain_lru"] <= row["unlimited"]
                    base = row["hits"]["lru"]
                    assert row["ratio"][policy] == (round(hits / base, 3) if base else (None if hits else 1.0))
                    if entry["derived"] is None:
                        assert row["pool"][policy] == round(hits / blocks, 4)
            full = rows[-1]  # room for every distinct block: nothing is evicted, every policy hits all it can
            assert set(full["pool"].values()) == {full["unlimited"]} == {full["min"]} == {full["plain_lru"]}
    main = result["traces"][0]["variants"]
    for alone, behind in zip(main["pool"], main["engine"]):
        assert behind["lookups"] < alone["lookups"] == blocks  # the engine's hits are not asked of the pool
        assert behind["engine_hits"] > 0 and alone["engine_hits"] == 0
        for policy in result["policies"]:
            assert abs(behind["total"][policy] - behind["engine_hits"] - behind["pool"][policy]) <= 1.5e-4
    assert all("disk" in row for row in main["pool"]) and not any("disk" in row for row in main["engine"])
    markdown = trace_hits.to_markdown(result)
    assert "pool: adaptive" in markdown and "engine in front" in markdown and "second-half" in markdown


def test_the_summary_holds_a_verdict_per_target_from_the_ratios(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "chats.jsonl", conversations(seed=5))
    result = trace_hits.run(capacities=[0.02, 0.1], trace=trace, tiered=False, workers=1)
    summary = result["summary"]
    assert summary["candidate"] == trace_hits.CANDIDATE and result["pass"] == summary["pass"]
    assert len(summary["targets"]) == (2 + 1 + 1) * 2  # (the trace's 2 variants, each derived trace's 1) x capacities
    for target in summary["targets"]:
        held_out = target["trace"] != "chats.jsonl"
        assert target["target"] == (1.0 if held_out else target_ratio(target["capacity_share"]))
        for policy, ratio in target["ratio"].items():
            expected = "n/a" if ratio is None else "PASS" if ratio >= target["target"] else "FAIL"
            assert target["verdict"][policy] == expected
    for policy, mine in summary["policies"].items():
        verdicts = [target["verdict"][policy] for target in summary["targets"]]
        assert (mine["met"], mine["missed"]) == (verdicts.count("PASS"), verdicts.count("FAIL"))
        assert mine["verdict"] == ("FAIL" if "FAIL" in verdicts else "PASS")
    assert summary["pass"] == (summary["policies"][summary["candidate"]]["verdict"] == "PASS")
    assert target_ratio(0.01) == 1.5 and target_ratio(0.05) == 1.15
    assert target_ratio(0.2) == 1.0


def test_the_command_replays_another_trace_file(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "other.jsonl", [[7, 8], [7, 8, 9], [7, 8, 9], [5]])
    options = ["bench", "trace-hits", "--capacities", "0.5,1", "--json", "--no-fail", "--workers", "1", "--no-disk"]
    outcome = CliRunner().invoke(
        app,
        [*options, "--trace", str(trace), "--derived", ""],
    )
    assert outcome.exit_code == 0, outcome.output
    result = json.loads(outcome.stdout)
    assert result["trace"] == "other.jsonl" and result["trace_path"] == str(trace.resolve())
    assert result["requests"] == 4 and result["distinct_blocks"] == 4 and len(result["traces"]) == 1
    assert result["unlimited"] == round(5 / 9, 4)  # hits: none | 7 8 | 7 8 9 | none
    missing = CliRunner().invoke(app, ["bench", "trace-hits", "--trace", str(tmp_path / "none.jsonl")])
    assert missing.exit_code == 2


def test_replays_in_worker_processes_give_what_they_give_in_this_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = write_trace(tmp_path / "chats.jsonl", conversations(seed=11))
    jobs = [trace_hits._Job(str(trace), None, None, 0, 12, policy) for policy in ("lru", "adaptive")]
    here, _ = trace_hits._run_jobs(jobs, workers=1)
    spawn = trace_hits.ProcessPoolExecutor
    # one worker process beside this one (which only waits), through the same pickling as several
    monkeypatch.setattr(trace_hits, "ProcessPoolExecutor", lambda _workers, **options: spawn(1, **options))
    apart, cpu_s = trace_hits._run_jobs(jobs, workers=2)
    assert apart == here and cpu_s > 0


def test_the_policy_docs_and_the_reports_figures_are_the_committed_results() -> None:
    """docs/eviction-policy.md's and BENCHMARKS.md's trace-hits parts are generated from the result
    files (`python -m kvpool.benchmarks.policy.trace_hits doc`; `kvpool bench all --only trace-hits`), never typed."""
    result = ROOT / "benchmarks" / "results" / "trace-hits.json"
    blocks = doc_blocks(json.loads(result.read_text()), "benchmarks/results/trace-hits.json")
    doc = (ROOT / "docs" / "eviction-policy.md").read_text()
    for name, body in blocks.items():
        assert f"<!-- generated:{name} -->\n{body}\n<!-- /generated:{name} -->" in doc, name
    table = (ROOT / "benchmarks" / "results" / "trace-hits.md").read_text().strip()
    assert f"<!-- generated:trace-hits -->\n{table}\n" in (ROOT / "BENCHMARKS.md").read_text()
    assert table == trace_hits.to_markdown(json.loads(result.read_text())).strip()


@REAL
def test_the_real_trace_gives_the_hit_rates_its_readme_states() -> None:
    result = trace_hits.run(
        capacities=[0.01], tiered=False, policies=["lru"], engine_share=0, derived=[], analysis=False, workers=1
    )
    assert result["requests"] == 12_031 and result["distinct_blocks"] == 182_790
    assert result["unlimited"] == pytest.approx(0.366, abs=0.001)
    row = result["rows"][0]
    assert row["plain_lru"] == pytest.approx(0.052, abs=0.001) and row["min"] == pytest.approx(0.243, abs=0.001)
    assert row["pool"]["lru"] >= row["plain_lru"]  # a chain's tail ages first: its head stays reachable


@REAL
def test_the_suites_tiny_run_is_quick_and_complete(tmp_path: Path) -> None:
    began = time.perf_counter()
    result = trace_hits.run(**trace_hits.TINY_ARGS)
    assert time.perf_counter() - began < 60  # ~15 s on 2 idle cores; the suite's --tiny runs it
    assert [entry["derived"] for entry in result["traces"]] == [None, *trace_hits.DERIVED]
    assert set(result["traces"][0]["variants"]) == {"pool", "engine"}
    assert {"position", "children", "seen", "idle"} == set(result["analysis"]["by"])
    trace_hits.plot(result, tmp_path / "trace-hits.png")
    assert (tmp_path / "trace-hits.png").read_bytes()[:4] == b"\x89PNG"
