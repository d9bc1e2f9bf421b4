"""The serve bench at a tiny size: vLLM's own benchmark client against real servers, and figures that
say what each system really did (hits where they should be, none where they cannot be)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.benchmarks.serving import serve, serve_report, serve_systems

# the first test runs the whole tiny bench (its fixture): about 7 minutes on 2 slow cores, starts included
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    ticks: list[str] = []
    measured = serve.run(**serve.TINY_ARGS, progress=ticks.append)
    args = serve.TINY_ARGS
    assert len(ticks) == serve.steps(args["systems"], args["workload"], args["try_unsupported"])
    return measured


def rows(result: dict[str, Any], system: str, dataset: str) -> list[dict[str, Any]]:
    return [r for r in result["results"] if (r["system"], r["dataset"]) == (system, dataset)]


CONNECTORS = (
    "example", "vllm-mooncake", "vllm-mooncake-embedded", "lmcache", "kvpool", "kvpool-mooncake", "kvpool-disk",
)  # fmt: skip


def _nonzero(counters: dict[str, float]) -> dict[str, float]:
    return {name: value for name, value in counters.items() if value and not name.endswith("_created")}


def test_every_system_serves_every_request_of_every_run_of_every_round(result: dict[str, Any]) -> None:
    json.loads(json.dumps(result))
    workload = serve.TINY_ARGS["workload"]
    assert not result["failed"]
    runs = len(serve_systems.SYSTEMS) * 2 * len(workload.concurrencies) * workload.rounds
    assert len(result["results"]) == runs
    for row in result["results"]:
        reuse = workload.num_prefixes * workload.prompts_per_prefix
        wanted = reuse if row["dataset"] == "reuse" else workload.random_prompts
        assert (row["sent"], row["completed"], row["failed"]) == (wanted, wanted, 0), row
        assert row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0 and row["ttft_mean_ms"] > 0 and row["output_tok_s"] > 0
        assert row["cpu_s_per_request"] > 0, row  # the server's process tree did the work


def test_rounds_run_the_systems_in_rotated_order_on_the_same_prompts(result: dict[str, Any]) -> None:
    workload = serve.TINY_ARGS["workload"]
    firsts = []
    for round_index in range(workload.rounds):
        rows = [r for r in result["results"] if r["round"] == round_index]
        firsts.append(rows[0]["system"])
        seeds = {(r["system"], r["dataset"], r["concurrency"]): r["seed"] for r in rows}
        for (_, dataset, concurrency), seed in seeds.items():
            assert seed == seeds["local", dataset, concurrency]  # every system, the same prompts
    assert len(set(firsts)) == workload.rounds
    assert len({r["seed"] for r in result["results"] if r["system"] == "local"}) == len(result["results"]) // len(
        serve_systems.SYSTEMS
    )  # a fresh draw per run and round


def test_hits_come_only_from_where_they_can(result: dict[str, Any]) -> None:
    for row in result["results"]:
        if row["system"] == "none":  # prefix caching off, no pool
            assert row["local_hit_rate"] == row["pool_hit_rate"] == 0
        if row["system"] not in CONNECTORS:
            assert row["pool_hit_rate"] == 0
        if row["dataset"] == "random":  # the control reuses nothing (its seeds are chosen so)
            assert row["local_hit_rate"] == row["pool_hit_rate"] == 0, row
    # the embedded pool stores within the step; the others store in the background and, at this size, a
    # prompt's repeat may come before its store (or the engine's own cache still has it): the probe checks them
    assert max(r["pool_hit_rate"] for r in rows(result, "kvpool", "reuse")) > 0


def test_the_probe_pushes_prompts_out_of_the_engine_and_only_a_pool_brings_them_back(
    result: dict[str, Any],
) -> None:
    workload = serve.TINY_ARGS["workload"]
    whole_blocks = (workload.prompt_len - 1) // workload.block_size * workload.block_size  # the last token computes
    probes = {(p["system"], p["round"]): p for p in result["probe"]}
    assert len(probes) == len(serve_systems.SYSTEMS) * workload.rounds
    for round_index in range(workload.rounds):
        none, local = probes["none", round_index], probes["local", round_index]
        assert none["again_cached_tokens"] == none["evicted_cached_tokens"] == 0
        assert local["again_cached_tokens"] == whole_blocks
        assert local["evicted_cached_tokens"] == local["evicted_pool_tokens"] == 0  # really evicted
        for system in CONNECTORS:
            wanted = 256 if system == "lmcache" else whole_blocks  # LMCache: whole 256-token chunks
            probe = probes[system, round_index]
            # why a prompt came back short, when it does: each prompt's pool tokens, kvpool's counters, the log
            why = (
                system,
                round_index,
                probe["evicted_pool_tokens_each"],
                _nonzero(probe.get("kvpool_counters", {})),
                probe.get("pool_log", []),  # the pool's warnings in the server's log (a breaker opening)
            )
            assert probe["evicted_cached_tokens"] == probe["evicted_pool_tokens"] == wanted, why


def test_the_probe_counts_a_contract_hit_in_the_engine_s_own_hit_s_steps_and_an_async_one_a_step_more(
    result: dict[str, Any],
) -> None:
    for probe in result["probe"]:
        system = probe["system"]
        if system not in serve_systems.KVPOOL_SYSTEMS + serve_systems.TIER_SYSTEMS:
            assert not any(key.startswith("steps_") for key in probe), probe  # only kvpool's servers count steps
            continue
        why = (system, probe["round"], _nonzero(probe["kvpool_counters"]))
        assert probe["steps_local"] >= 1 and probe["steps_miss"] >= 1, why
        if system == "kvpool":  # DRAM on its one rank: every pool hit is a contract hit, loaded in-step
            assert probe["steps_in_step"] == probe["steps_local"] and "steps_async" not in probe, why
        else:  # Mooncake's reads and the disk tier's stay async: the engine waits a step for them
            assert probe["steps_async"] >= probe["steps_local"] + 1 and "steps_in_step" not in probe, why
    steps = [t for t in result["summary"]["targets"] if t["metric"] == "steps_in_step"]
    assert [t["verdict"] for t in steps] == ["PASS"], steps


def test_pools_are_smaller_than_the_working_set_yet_hold_a_probe_prompt(result: dict[str, Any]) -> None:
    workload = result["workload"]
    assert workload["pool_tokens"] < workload["working_set_tokens"]
    assert workload["pool_tokens"] >= workload["prefix_len"] + workload["suffix_len"]


def test_the_summary_judges_like_for_like_targets_on_paired_rounds(result: dict[str, Any]) -> None:
    summary = result["summary"]
    judged = [t for t in summary["targets"] if t["verdict"] is not None]
    pairs = {(t["system"], t["against"]) for t in judged}
    assert {
        ("kvpool-mooncake", "vllm-mooncake"), ("kvpool", "vllm-mooncake-embedded"), ("kvpool", "local"),
        ("kvpool-disk", "kvpool"),
    } <= pairs  # fmt: skip
    for target in judged:
        assert target["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE")
        interval = target["ratio"]
        assert interval["low"] <= interval["estimate"] <= interval["high"] and interval["rounds"] == 2, target
    assert sum(summary["verdicts"].values()) == len(judged)
    assert isinstance(summary["pass"], bool)
    cell = summary["cells"]["kvpool"]["reuse"]["2"]["ttft_mean_ms"]
    assert cell["low"] <= cell["estimate"] <= cell["high"] and cell["rounds"] == 2


def test_the_report_has_tables_targets_and_a_plot(result: dict[str, Any], tmp_path: Path) -> None:
    text = serve.to_markdown(result)
    for needle in ("**Reuse workload**", "**0%-reuse control**", "**Hit probe**", "interleaved rounds"):
        assert needle in text
    assert "`kvpool-mooncake` TTFT mean vs `vllm-mooncake`, reuse at concurrency 2" in text
    assert text.count("| kvpool |") == 2 + 1  # a row per dataset (one concurrency), and the probe's
    serve.plot(result, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _row(system: str, round_index: int, ttft: float, failed: int = 0) -> dict[str, Any]:
    return {
        "system": system,
        "dataset": "reuse",
        "concurrency": 1,
        "round": round_index,
        "ttft_mean_ms": ttft,
        "sent": 4,
        "completed": 4 - failed,
        "failed": failed,
    }


def test_a_missing_figure_leaves_its_target_inconclusive_instead_of_passing() -> None:
    measured = {
        "workload": {"concurrencies": [1]},
        "systems": ["kvpool-mooncake", "vllm-mooncake"],
        # every request of the peer's runs failed: vLLM's client reports a TTFT of 0, which must not pass
        "results": [_row("kvpool-mooncake", r, 10.0) for r in range(3)]
        + [_row("vllm-mooncake", r, 0.0, 4) for r in range(3)],
        "probe": [],
        "failed": {},
    }
    summary = serve_report.summarize(measured)
    mean = next(t for t in summary["targets"] if t["metric"] == "ttft_mean_ms")
    assert mean["ratio"] is None and mean["verdict"] == "INCONCLUSIVE"
    assert summary["pass"] is False


def test_a_target_passes_or_fails_only_when_the_whole_interval_says_so() -> None:
    def measured(factors: list[float]) -> dict[str, Any]:
        return {
            "workload": {"concurrencies": [1]},
            "systems": ["kvpool-mooncake", "vllm-mooncake"],
            "results": [_row("kvpool-mooncake", r, 100.0 * f) for r, f in enumerate(factors)]
            + [_row("vllm-mooncake", r, 100.0) for r in range(len(factors))],
            "probe": [],
            "failed": {},
        }

    def mean_verdict(factors: list[float]) -> str:
        summary = serve_report.summarize(measured(factors))
        return next(t["verdict"] for t in summary["targets"] if t["metric"] == "ttft_mean_ms")

    assert mean_verdict([0.80, 0.82, 0.79, 0.81]) == "PASS"
    assert mean_verdict([1.20, 1.22, 1.19, 1.21]) == "FAIL"
    assert mean_verdict([0.7, 1.3, 0.8, 1.2]) == "INCONCLUSIVE"


def test_a_pool_hit_is_judged_against_the_engine_s_own_hit_by_its_interval_and_its_estimate() -> None:
    def verdicts(shares: list[float], steps: float = 1.0) -> dict[str, str]:
        probe = [
            {"system": "local", "round": r, "again_ms": 60.0 + r, "evicted_ms": 400.0} for r in range(len(shares))
        ] + [
            {"system": "kvpool", "round": r, "again_ms": 60.0, "evicted_ms": (60.0 + r) * share,
             "steps_local": 1.0, "steps_in_step": steps}
            for r, share in enumerate(shares)
        ]  # fmt: skip
        result = {"workload": {"concurrencies": []}, "systems": ["local", "kvpool"], "results": [], "probe": probe}
        return {t["against_metric"]: t["verdict"] for t in serve_report.summarize(result)["targets"]}

    assert verdicts([1.00, 1.01, 1.00, 1.01]) == {"again_ms": "PASS", "steps_local": "PASS"}
    assert verdicts([1.03, 1.04, 1.03, 1.04])["again_ms"] == "FAIL"  # the interval under 1.05, the estimate over 1.02
    assert verdicts([0.95, 1.10, 0.97, 1.08])["again_ms"] == "INCONCLUSIVE"
    assert verdicts([1.0, 1.0, 1.0], steps=2.0)["steps_local"] == "FAIL"  # an async hit: a step more


def test_an_unknown_system_is_named() -> None:
    with pytest.raises(ValueError, match=r"'nope'.*kvpool-mooncake"):
        serve.run(systems=["nope"])
    with pytest.raises(ValueError, match="'nope'"), serve_systems.start("nope", 1 << 20):
        pass
