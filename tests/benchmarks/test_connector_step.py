"""The connector-step bench at tiny size: every backend runs both roles on vLLM's objects, spends CPU
on both sides, and really stores the decode chunks in its pool."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm")

from kvpool.benchmarks.per_step import connector_step
from kvpool.testing.mooncake import mooncake_or_skip

CONTEXTS = [64, 256]
STEPS = 40  # with 4 warm-up steps every request completes at least two 16-token blocks


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    mooncake_or_skip()
    windows, connector_step.WINDOWS = connector_step.WINDOWS, 1  # figures are not asserted: one window
    try:
        return connector_step.run(requests=[3], contexts=CONTEXTS, block_sizes=[16], steps=STEPS)
    finally:
        connector_step.WINDOWS = windows


def test_every_backend_spends_cpu_on_both_roles(result: dict[str, Any]) -> None:
    json.loads(json.dumps(result))  # plain JSON
    cells = result["cells"]
    assert sorted((c["backend"], c["context"]) for c in cells) == sorted(
        (b, c) for b in connector_step.BACKENDS for c in CONTEXTS
    )
    for cell in cells:
        assert cell["scheduler_us"] > 0 and cell["worker_us"] > 0, cell
        assert cell["total_us"] == pytest.approx(cell["scheduler_us"] + cell["worker_us"], abs=0.2)
        assert cell["wall_us"] > 0 and cell["meta_bytes"] > 0 and cell["steps"] == STEPS


def test_decode_chunks_are_in_the_pool_after_the_run(result: dict[str, Any]) -> None:
    """kvpool's pools and vLLM's master hold every block the decode steps completed."""
    for cell in result["cells"]:
        assert cell["chunks_expected"] >= 3 * 2, cell  # staggered requests, >= 2 blocks each
        assert cell["chunks_stored"] == cell["chunks_expected"], cell


def test_ratios_and_flatness_cover_every_cell(result: dict[str, Any]) -> None:
    assert {(r["pool"], r["context"]) for r in result["ratios"]} == {
        (pool, c) for pool in ("memory", "mooncake") for c in CONTEXTS
    }
    assert all(r["vllm_over_kvpool"] > 0 for r in result["ratios"])
    assert {f["backend"] for f in result["flatness"]} == set(connector_step.BACKENDS)
    assert isinstance(result["pass"], bool)


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="backends"):
        connector_step.run(requests=[1], contexts=[64], block_sizes=[16], backends=["redis"])
