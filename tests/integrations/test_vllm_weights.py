"""New weights never meet old KV, under a real vLLM CPU engine: a checkpoint rewritten at the same path
(with a disk tier that outlives the engine), and the engine's own in-place weight reload."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from kvpool.backends.factory import create_backend
from kvpool.backends.shared_pools import drop_shared_tiered_pools
from kvpool.backends.tiered import TieredPool
from kvpool.core.config import KVPoolConfig
from kvpool.integrations.vllm import local_worker
from kvpool.testing.engine import engine, generate_greedy
from kvpool.testing.models import default_model_dir, make_tiny_model

from .conftest import BLOCK, connector_config, random_prompts

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
PROMPTS = random_prompts(2, 300, seed=11)  # 4 pool chunks each


@pytest.fixture(scope="module")
def other_weights() -> Path:
    """The tiny llama's architecture with other values (another seed): the "new weights"."""
    return make_tiny_model("llama", default_model_dir() / "llama", seed=1)


@pytest.fixture(scope="module")
def new_baseline(other_weights: Path) -> list[list[int]]:
    with engine(other_weights, block_size=BLOCK) as llm:
        return [r.token_ids for r in generate_greedy(llm, PROMPTS, MAX_TOKENS)]


def _loaded() -> int:
    worker = local_worker()
    assert worker is not None and worker.drain(30.0)
    return int(worker.stats.chunks_loaded)


def test_a_checkpoint_rewritten_at_its_path_is_never_served_the_old_weights_kv(
    model_dir: Any, other_weights: Path, new_baseline: list[list[int]], pool_name: str, tmp_path: Path
) -> None:
    """A redeploy writes new weights over the old checkpoint; the engine restarts onto its disk tier."""
    model = tmp_path / "model"
    shutil.copytree(model_dir("llama"), model)
    extra = {
        "pool_name": pool_name, "capacity_bytes": "256MiB", "disk_path": str(tmp_path / "kv"),
        "disk_capacity_bytes": "64MiB",
    }
    config = connector_config(**extra)
    try:
        with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
            generate_greedy(llm, PROMPTS, MAX_TOKENS)  # stores the old weights' KV
        pool = create_backend("memory", KVPoolConfig.from_dict(extra).backend_options(rank=0))
        assert isinstance(pool, TieredPool) and pool.flush(30.0)
        assert len(pool.disk.keys()) == 8
        drop_shared_tiered_pools()  # the engine process restarts: DRAM is gone, the directory stays

        shutil.copy(other_weights / "model.safetensors", model / "model.safetensors")  # same path and shapes
        with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
            first = generate_greedy(llm, PROMPTS, MAX_TOKENS)
            assert _loaded() == 0, "a chunk of the old weights was loaded"
            assert [r.token_ids for r in first] == new_baseline
            llm.reset_prefix_cache()  # the engine's own cache forgets: the next hits come from the pool
            again = generate_greedy(llm, PROMPTS, MAX_TOKENS)
            assert [r.num_cached_tokens for r in again] == [256, 256]
            assert _loaded() == 8, "the pool serves the new weights' KV"
            assert [r.token_ids for r in again] == new_baseline
    finally:
        drop_shared_tiered_pools()


def test_an_in_place_weight_reload_renames_every_key(
    model_dir: Any, other_weights: Path, new_baseline: list[list[int]], pool_name: str
) -> None:
    """vLLM's `reload_weights` (the RL weight update's in-place path) in a running engine: nothing stored
    before it is loaded after it, and what is stored after it is served again."""
    with engine(model_dir("llama"), block_size=BLOCK, kv_transfer_config=connector_config(pool_name)) as llm:
        generate_greedy(llm, PROMPTS, MAX_TOKENS)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(other_weights)})
        llm.reset_prefix_cache()  # what an RL loop does after an update: the engine's cache holds old KV
        before = _loaded()
        reloaded = generate_greedy(llm, PROMPTS, MAX_TOKENS)
        assert _loaded() == before, "a chunk of the old weights was loaded"
        assert [r.num_cached_tokens for r in reloaded] == [0, 0]
        assert [r.token_ids for r in reloaded] == new_baseline
        llm.reset_prefix_cache()
        again = generate_greedy(llm, PROMPTS, MAX_TOKENS)
        assert [r.num_cached_tokens for r in again] == [256, 256]
        assert _loaded() == before + 8
        assert [r.token_ids for r in again] == new_baseline
