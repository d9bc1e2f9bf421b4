"""kvpool's KV events read by a KV-aware router's own indexer (NVIDIA Dynamo's standalone KV indexer)
behind `vllm serve`: for every prompt, the overlap the router computes from the events equals what the
engine then serves from its caches, the engine's own and the pool, while the pool evicts.

The router hashes a prompt's tokens itself and attaches each announced block under its parent, so the
events must carry each block's tokens and its parent: kvpool's used to carry neither, and a router saw
every pool block as a root it could never match.
"""

from __future__ import annotations

import itertools
import json
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from kvpool.testing.router_indexer import IndexerError, dynamo_indexer, ensure_installed
from kvpool.testing.server import openai_server

from .conftest import random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 64
PROMPT_TOKENS = 400  # 6 full blocks
TOKEN_BYTES = 4 * 2 * 2 * 64 * 4  # tiny llama, float32
CHUNK_BYTES = BLOCK * TOKEN_BYTES
INSTANCE = 1
SETTLE_S = 1.0  # the server publishes a step's events as it ends; the indexer applies them on its thread
SUBSCRIBE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def indexer_install():
    try:
        return ensure_installed()
    except IndexerError as exc:  # offline: the wheel cannot be fetched
        pytest.skip(f"Dynamo's indexer cannot be installed here: {exc}")


def test_a_routers_overlap_score_equals_what_the_engine_then_serves(model_dir, indexer_install):
    model = model_dir("llama")
    prompts = random_prompts(8, PROMPT_TOKENS, seed=80)
    pushers = random_prompts(4, PROMPT_TOKENS, seed=81)
    endpoint = f"ipc://{Path(tempfile.gettempdir()) / f'kvpool-router-{uuid.uuid4().hex[:8]}'}"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    connector = {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.integrations.vllm",
        "kv_role": "kv_both",
        # 56 chunks of the 72 the prompts store: the pool evicts (chain tails first), so some prompts
        # come back whole, some in part, some not at all
        "kv_connector_extra_config": {"capacity_bytes": 56 * CHUNK_BYTES + (1 << 16)},
    }
    settings = {
        "block_size": BLOCK,
        "max_model_len": PROMPT_TOKENS + 2 * BLOCK,
        "kv_cache_memory_bytes": 1024 * TOKEN_BYTES,  # the engine's own cache holds two prompts
        "extra_args": ["--kv-events-config", json.dumps(events)],
        "env": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1"},
    }
    with (
        dynamo_indexer(block_size=BLOCK, install_dir=indexer_install) as indexer,
        openai_server(model, kv_transfer_config=connector, **settings) as server,  # type: ignore[arg-type]
    ):
        indexer.register(INSTANCE, endpoint)
        _until_subscribed(indexer, server)
        for prompt in prompts + pushers:
            server.complete(prompt, 4)
        scored, served = [], []
        for prompt in reversed(prompts):  # newest first: whole, then in part, then gone
            time.sleep(SETTLE_S)
            scored.append(indexer.query(prompt).get(INSTANCE, {}))
            served.append(server.complete(prompt, 4)["cached_tokens"])
        metrics = server.metrics()
    assert metrics.get("vllm:external_prefix_cache_hits_total", 0) > 0, "no pool hit: the test lost its point"
    assert [tiers.get("longest_matched", 0) for tiers in scored] == served, (scored, served)
    # the router learned the pool's blocks from kvpool's events alone: beyond what the engine's cache holds
    assert any(tiers["cpu"] > tiers["gpu"] for tiers in scored), scored
    full = PROMPT_TOKENS // BLOCK * BLOCK
    assert full in served and any(0 < tokens < full for tokens in served), served  # whole and in part


def _until_subscribed(indexer, server) -> None:
    """Return once the indexer hears the engine's events. A ZMQ subscriber misses whatever is published
    before its subscription reaches the publisher, and on a loaded machine that can take seconds after
    `/register` answers (the likely cause of a CI run whose router knew none of the first five prompts and
    every later one): send one-block probes, each new, until one is scored."""
    deadline = time.monotonic() + SUBSCRIBE_TIMEOUT_S
    for attempt in itertools.count():
        probe = random_prompts(1, BLOCK + 8, seed=900 + attempt)[0]
        server.complete(probe, 1)
        for _ in range(10):
            if indexer.query(probe).get(INSTANCE, {}).get("longest_matched", 0) > 0:
                return
            time.sleep(0.2)
        if time.monotonic() > deadline:
            break
    pytest.fail(f"the indexer heard no event in {SUBSCRIBE_TIMEOUT_S:.0f} s: {indexer.log_tail()}")
