"""`kvpool bench hang` at tiny size, as `kvpool bench all` runs it: a hung master costs a request one short
deadline, outputs stay identical and hits come back after it resumes. `kvpool bench serve-overhead`'s
report from a result of its shape (its three servers are the serve bench's systems, tested there)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm")

from kvpool.benchmarks import suite
from kvpool.benchmarks.serving import serve_overhead
from kvpool.testing.mooncake import mooncake_or_skip


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mooncake_or_skip()
    out = tmp_path_factory.mktemp("results")
    suite.run(suite.select(["hang"]), out_dir=out, report=None, tiny=True)
    return out


def read(results: Path, name: str) -> dict[str, Any]:
    return json.loads((results / f"{name}.json").read_text())


@pytest.mark.timeout(600)
def test_a_hung_master_costs_a_request_one_deadline_and_never_an_output(results: Path) -> None:
    result = read(results, "hang")
    assert result["identical_outputs"] and result["first_hit_after_resume_s"] is not None
    assert result["hung_settled"]["requests"] > 0, "no request ran while the master was hung: nothing measured"
    # a lookup deadline is 0.1 s; a request that waited out the master's own 4 s stalls would show here
    assert result["hung_settled"]["max_ms"] < 2000, result["hung_settled"]
    assert result["tokens_from_pool_while_hung"] == 0
    assert result["commit"] and result["size"] == "tiny"
    text = (results / "hang.md").read_text()
    assert "| hung_settled |" in text and "hung master: request p99" in text
    assert (results / "hang.png").read_bytes()[:4] == b"\x89PNG"


def test_the_serve_overhead_report_names_every_ratio_and_its_verdict(tmp_path: Path) -> None:
    result = {
        "model": "llama", "prompt_tokens": 200, "requests_per_kind": 2, "miss_ms_without": 20.0,
        "miss_ms_noop_connector": 21.0, "miss_ms_with": 22.0, "local_hit_ms_without": 10.0, "pool_hit_ms_with": 13.0,
        "local_hit_ms_with": 9.0, "pool_hits": 2, "pool_tokens": 384, "miss_ratio": 1.1,
        "miss_ratio_vs_noop_connector": 1.048, "pool_hit_vs_local_hit": 1.3, "pool_hit_vs_local_hit_same_server": 1.444,
        "targets": "", "pass": False,
    }  # fmt: skip
    text = serve_overhead.to_markdown(result)
    assert "| miss (0% reuse) | 20 | 22 | 1.1 |" in text
    assert "miss with kvpool / without: **1.1** (target <= 1.05) FAIL" in text
    assert "pool hit / the engine's own hit: **1.3** (target <= 1.2) FAIL" in text
    serve_overhead.plot(result, tmp_path / "overhead.png")
    assert (tmp_path / "overhead.png").read_bytes()[:4] == b"\x89PNG"
