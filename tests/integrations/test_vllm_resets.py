"""Resets on a real vLLM CPU engine: a reset vLLM refuses leaves the pool as it was (kvpool follows vLLM's
decision), one it accepts leaves nothing a disk load in flight could bring back, in DRAM or after a
restart; a shared pool's reset withdraws every block it announced."""

from __future__ import annotations

import tempfile
import time
import uuid

import numpy as np
import pytest

from kvpool.backends.base import Status
from kvpool.backends.factory import create_backend
from kvpool.backends.shared_pools import drop_shared_tiered_pools
from kvpool.backends.tiered import TieredPool
from kvpool.core.config import KVPoolConfig
from kvpool.integrations.vllm import local_worker
from kvpool.testing.engine import engine, generate_greedy

from .conftest import BLOCK, connector_config, random_prompts
from .test_vllm_mooncake import masters, mooncake_available, mooncake_connector, settle  # noqa: F401

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16
SLOW_READ_S = 0.3  # each disk read of the load in flight: the reset lands while it reads


def _tiered(config: dict) -> TieredPool:
    """The engine's own tiered pool (process-wide, by its name)."""
    options = KVPoolConfig.from_dict(config["kv_connector_extra_config"]).backend_options(rank=0)
    pool = create_backend("memory", options)
    assert isinstance(pool, TieredPool)
    return pool


def _idle(llm) -> None:
    worker = local_worker()
    assert worker is not None and worker.drain(30.0)
    for _ in range(3):  # finished requests release their blocks at the next step
        llm.llm_engine.step()
        assert worker.drain(30.0)


def test_a_reset_during_a_disk_load_resurrects_nothing(model_dir, pool_name, tmp_path, monkeypatch):
    """Issue 42 item 3. A restarted engine loads prompt P from disk, each read slowed; while it reads,
    `reset_prefix_cache(reset_connector=True)`. vLLM refuses (P holds blocks): kvpool keeps its pools
    (before: it emptied them, the load promoted P back into DRAM and onto disk, and Q, not being read,
    was lost). Once P finished, the same reset is accepted: from then on neither P nor Q is served
    from the pool, in this engine nor after a restart on the same directory; outputs equal vLLM's."""
    from vllm import SamplingParams

    model = model_dir("llama")
    extra = {"pool_name": pool_name, "disk_path": str(tmp_path / "kv"), "disk_capacity_bytes": "64MiB"}
    config = connector_config(**extra)
    p, q = random_prompts(2, 300, seed=42)
    try:
        with engine(model, block_size=BLOCK) as llm:
            baseline = [r.token_ids for r in generate_greedy(llm, [p, q], MAX_TOKENS)]
        with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
            generate_greedy(llm, [p, q], MAX_TOKENS)
            _idle(llm)
        pool = _tiered(config)
        assert pool.flush(30.0)
        drop_shared_tiered_pools()  # a restart: DRAM is empty, the disk holds P and Q

        with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
            pool = _tiered(config)
            assert pool.memory.keys() == []
            read = pool.disk.read

            def slow_read(key: str) -> np.ndarray | Status:
                got = read(key)
                time.sleep(SLOW_READ_S)
                return got

            monkeypatch.setattr(pool.disk, "read", slow_read)
            core = llm.llm_engine
            core.add_request("p", {"prompt_token_ids": p}, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
            core.step()  # P's load is armed and reading the disk
            assert llm.reset_prefix_cache(reset_connector=True) is False  # vLLM refuses: P holds blocks
            outputs: dict[str, list[int]] = {}
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline:
                for out in core.step():
                    if out.finished:
                        outputs[out.request_id] = list(out.outputs[0].token_ids)
                if outputs:
                    break
            monkeypatch.undo()
            assert outputs == {"p": baseline[0]}
            kept = generate_greedy(llm, [q], MAX_TOKENS)
            assert kept[0].num_cached_tokens == 256, "a reset vLLM refused emptied kvpool's pools"
            _idle(llm)
            assert llm.reset_prefix_cache(reset_connector=True)  # nothing runs: accepted
            worker = local_worker()
            assert worker is not None
            loaded_before = worker.stats.chunks_loaded
            after = generate_greedy(llm, [p], MAX_TOKENS)
            assert after[0].num_cached_tokens == 0 and worker.stats.chunks_loaded == loaded_before
            assert [r.token_ids for r in after] == baseline[:1]
            _idle(llm)
            assert pool.flush(30.0)
            # the worker emptied its pool at P's first step, before its loads: only P's new save is held
            assert len(pool.keys()) == 300 // BLOCK and len(pool.disk.keys()) == 300 // BLOCK
        drop_shared_tiered_pools()
        with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
            restarted = generate_greedy(llm, [q], MAX_TOKENS)  # Q was stored only before the reset
            worker = local_worker()
            assert worker is not None and worker.stats.chunks_loaded == 0
        assert restarted[0].num_cached_tokens == 0 and [r.token_ids for r in restarted] == baseline[1:]
    finally:
        drop_shared_tiered_pools()


def test_a_shared_pools_reset_withdraws_every_block_it_announced(model_dir, masters, monkeypatch):  # noqa: F811
    """Issue 42 item 4: with Mooncake and KV events on, `reset_prefix_cache(reset_connector=True)` empties
    the shared pool and publishes a BlockRemoved (medium STORAGE) for every block kvpool had announced
    stored there, so a router's indexer forgets them (before: nothing was published)."""
    from .test_vllm_serve import EventSubscriber

    master = masters()
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    subscriber, events = EventSubscriber.on_ipc(f"{tempfile.gettempdir()}/kvpool-mc-reset-{uuid.uuid4().hex[:8]}")
    prompts = random_prompts(2, 300, seed=43)
    try:
        config = mooncake_connector(master)
        with engine(model_dir("llama"), block_size=BLOCK, kv_transfer_config=config, kv_events_config=events) as llm:
            generate_greedy(llm, prompts, MAX_TOKENS)
            settle(llm)
            time.sleep(0.5)
            subscriber.catch_up()  # what went out before the subscription reached the publisher
            stored = subscriber.hashes("BlockStored", "STORAGE")
            assert len(stored) == 2 * (300 // BLOCK), stored
            assert llm.reset_prefix_cache(reset_connector=True)
            llm.llm_engine.step()  # the events of the reset go out with the next step's batch
            time.sleep(0.5)
            after = generate_greedy(llm, prompts, MAX_TOKENS)
    finally:
        subscriber.close()
    assert [r.num_cached_tokens for r in after] == [0, 0]
    assert subscriber.hashes("BlockRemoved", "STORAGE") == stored
