"""The serve bench at a tiny size: vLLM's own benchmark client against real servers, and figures that
say what each system really did (hits where they should be, none where they cannot be)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.benchmarks import serve, serve_report, serve_systems

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    ticks: list[str] = []
    measured = serve.run(**serve.TINY_ARGS, progress=ticks.append)
    args = serve.TINY_ARGS
    assert len(ticks) == serve.steps(args["systems"], args["workload"], args["try_unsupported"])
    return measured


def rows(result: dict[str, Any], system: str, dataset: str) -> list[dict[str, Any]]:
    return [r for r in result["results"] if (r["system"], r["dataset"]) == (system, dataset)]


CONNECTORS = ("example", "vllm-mooncake", "lmcache", "kvpool", "kvpool-mooncake")


def test_every_system_serves_every_request_of_every_run(result: dict[str, Any]) -> None:
    json.loads(json.dumps(result))
    workload = serve.TINY_ARGS["workload"]
    assert not result["failed"]
    assert len(result["results"]) == len(serve_systems.SYSTEMS) * 2 * len(workload.concurrencies)
    for row in result["results"]:
        reuse = workload.num_prefixes * workload.prompts_per_prefix
        wanted = reuse if row["dataset"] == "reuse" else workload.random_prompts
        assert (row["sent"], row["completed"], row["failed"]) == (wanted, wanted, 0), row
        assert row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0 and row["output_tok_s"] > 0


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
    probe = result["probe"]
    workload = serve.TINY_ARGS["workload"]
    whole_blocks = (workload.prompt_len - 1) // workload.block_size * workload.block_size  # the last token computes
    assert probe["none"]["again_cached_tokens"] == probe["none"]["evicted_cached_tokens"] == 0
    assert probe["local"]["again_cached_tokens"] == whole_blocks
    assert probe["local"]["evicted_cached_tokens"] == probe["local"]["evicted_pool_tokens"] == 0  # really evicted
    for system in CONNECTORS:
        wanted = 256 if system == "lmcache" else whole_blocks  # LMCache: whole 256-token chunks
        assert probe[system]["evicted_cached_tokens"] == probe[system]["evicted_pool_tokens"] == wanted, system


def test_the_summary_judges_each_target_on_measured_ratios(result: dict[str, Any]) -> None:
    entry = result["summary"]["per_system"]["kvpool"]
    for key in ("reuse_ttft_p50_vs_none", "control_throughput_vs_none", "control_ttft_p50_vs_none"):
        assert set(entry[key]["per_concurrency"]) == {"1", "4"}
        assert isinstance(entry[key]["pass"], bool) and entry[key]["worst"] > 0
    assert entry["full_hit_vs_local_hit"]["every_probe_served_from_pool"] is True
    assert entry["full_hit_vs_local_hit"]["ratio"] > 0
    assert isinstance(result["summary"]["pass"], bool)


def test_the_report_has_tables_targets_and_a_plot(result: dict[str, Any], tmp_path: Path) -> None:
    text = serve.to_markdown(result)
    for needle in ("**Reuse workload**", "**0%-reuse control**", "**Hit probe**", "full hit vs local hit"):
        assert needle in text
    assert text.count("| kvpool |") == 2 * 2 + 1  # a row per run, and the probe's
    serve.plot(result, tmp_path / "serve.png")
    assert (tmp_path / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_figure_fails_its_target_instead_of_passing() -> None:
    measured = {
        "workload": {"concurrencies": [1]},
        "systems": ["kvpool", "example"],
        "results": [
            {
                "system": "kvpool",
                "dataset": "reuse",
                "concurrency": 1,
                "ttft_p50_ms": 10.0,
                "output_tok_s": 5.0,
                "sent": 4,
                "completed": 4,
                "failed": 0,
            },
            # every request failed: vLLM's client reports a TTFT of 0, which must not pass for a fast run
            {
                "system": "example",
                "dataset": "reuse",
                "concurrency": 1,
                "ttft_p50_ms": 0.0,
                "output_tok_s": 0.0,
                "sent": 4,
                "completed": 0,
                "failed": 4,
            },
        ],
        "probe": {},
        "failed": {},
    }
    summary = serve_report.summarize(measured)
    entry = summary["per_system"]["kvpool"]
    assert entry["reuse_ttft_p50_vs_none"]["pass"] is None  # no `none` run: not measured
    assert entry["vs_peers"]["example"]["worst"] is None  # its run failed every request: not measured
    assert summary["pass"] is False


def test_an_unknown_system_is_named() -> None:
    with pytest.raises(ValueError, match=r"'nope'.*kvpool-mooncake"):
        serve.run(systems=["nope"])
    with pytest.raises(ValueError, match="'nope'"), serve_systems.start("nope", 1 << 20):
        pass
