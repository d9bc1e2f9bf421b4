"""`kvpool bench hang` and `kvpool bench serve-overhead` at tiny size, as `kvpool bench all` runs them: a
hung master costs a request one short deadline, outputs stay identical and hits come back after it
resumes; a server with kvpool serves pool hits of prompts its own cache lost."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm")

from kvpool.benchmarks import serve_overhead, suite
from kvpool.testing.mooncake import mooncake_or_skip


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mooncake_or_skip()
    out = tmp_path_factory.mktemp("results")
    suite.run(suite.select(["hang", "serve-overhead"]), out_dir=out, report=None, tiny=True)
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


@pytest.mark.timeout(600)
def test_a_server_with_kvpool_serves_the_prompts_its_own_cache_lost(results: Path) -> None:
    result = read(results, "serve-overhead")
    prompts = serve_overhead.TINY_ARGS["prompts"] * serve_overhead.TINY_ARGS["rounds"]
    assert result["pool_hits"] == result["requests_per_kind"] == prompts
    assert result["pool_tokens"] >= prompts * 128  # whole 64-token blocks of a 200-token prompt
    assert min(result[key] for key in ("miss_ms_without", "miss_ms_with", "pool_hit_ms_with")) > 0
    assert "| miss (0% reuse) |" in (results / "serve-overhead.md").read_text()

