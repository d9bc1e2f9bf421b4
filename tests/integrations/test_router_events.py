"""kvpool's KV events read by a KV-aware router's own indexer (NVIDIA Dynamo's standalone KV indexer)
behind `vllm serve`: for every prompt, the overlap the router computes from the events equals what the
engine then serves from its caches, the engine's own and the pool, while the pool evicts.

The router hashes a prompt's tokens itself and attaches each announced block under its parent, so the
events must carry each block's tokens and its parent: kvpool's used to carry neither, and a router saw
every pool block as a root it could never match.

A shared (Mooncake) pool's reset: the router forgets the pool's blocks (issue 42).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.testing.router_indexer import IndexerError, dynamo_indexer, ensure_installed
from kvpool.testing.server import openai_server

from .conftest import random_prompts
from .conftest_mooncake import mooncake_connector
from .test_vllm_mooncake import masters, mooncake_available  # noqa: F401

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


@pytest.mark.mooncake
def test_a_shared_pools_reset_leaves_a_router_nothing_to_score(model_dir, indexer_install, masters):  # noqa: F811
    """Issue 42: kvpool on Mooncake announces its blocks (medium STORAGE, a router's disk tier); a
    connector reset (`POST /reset_prefix_cache?reset_external=true`) withdraws them, a BlockRemoved each.

    vLLM's own reset publishes AllBlocksCleared with it. It names no medium: Dynamo 1.6.1's indexer
    (instance 1, the engine's events as they are) clears every tier of the worker on it, so there the
    pool's blocks go whatever kvpool publishes; a router that reads it as the engine's own cache only
    (instance 2: the same events through `_gpu_only_clears`, AllBlocksCleared made the GPU removals it
    stands for) forgets the pool's blocks by kvpool's removals alone, the check that fails without them."""
    model = model_dir("llama")
    master = masters()
    both = (INSTANCE, INSTANCE + 1)
    prompts = random_prompts(2, PROMPT_TOKENS, seed=82)
    pushers = random_prompts(4, PROMPT_TOKENS, seed=83)  # out of the engine's cache: the pool alone holds prompts
    run = uuid.uuid4().hex[:8]
    endpoint, relayed = (f"ipc://{Path(tempfile.gettempdir()) / f'kvpool-router-{name}-{run}'}" for name in "ab")
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    settings = {
        "block_size": BLOCK,
        "max_model_len": PROMPT_TOKENS + 2 * BLOCK,
        "kv_cache_memory_bytes": 1024 * TOKEN_BYTES,  # the engine's own cache holds two prompts
        "extra_args": ["--kv-events-config", json.dumps(events)],
        # the dev routes serve /reset_prefix_cache; MC_*: as the Mooncake tests' engine processes
        "env": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1", "VLLM_SERVER_DEV_MODE": "1",
                "MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": "WARNING"},
    }  # fmt: skip
    # a segment of the engine's own: kvpool's events say LOCAL (the indexer drops REMOTE ones)
    connector = mooncake_connector(master, global_segment_size=64 << 20)
    with (
        dynamo_indexer(block_size=BLOCK, install_dir=indexer_install) as indexer,
        openai_server(model, kv_transfer_config=connector, **settings) as server,  # type: ignore[arg-type]
        _gpu_only_clears(endpoint, relayed),
    ):
        indexer.register(INSTANCE, endpoint)
        indexer.register(INSTANCE + 1, relayed)
        _until_subscribed(indexer, server, both)
        for prompt in prompts + pushers:
            server.complete(prompt, 4)
        time.sleep(SETTLE_S)
        before = [indexer.query(prompt) for prompt in prompts]
        _reset_with_the_connector(server)
        _until_subscribed(indexer, server, both, seed=950)  # a step: the reset's events go out
        time.sleep(SETTLE_S)
        after = [indexer.query(prompt) for prompt in prompts]
        served = [server.complete(prompt, 4)["cached_tokens"] for prompt in prompts]
    full = PROMPT_TOKENS // BLOCK * BLOCK
    for scored in before:  # both routers score each prompt whole from kvpool's STORAGE events alone
        for instance in both:
            tiers = scored.get(instance, {})
            assert tiers.get("longest_matched") == full > tiers["gpu"] == tiers["cpu"], before
    for scored in after:  # neither router scores them any more, from any tier
        assert all(scored.get(instance, {}).get("longest_matched", 0) == 0 for instance in both), after
    assert served == [0, 0], served  # and the engine indeed serves neither from a cache


def _reset_with_the_connector(server, timeout_s: float = 30.0) -> None:
    """vLLM 0.32's dev route (VLLM_SERVER_DEV_MODE=1); `reset_external` is its `reset_connector`. vLLM
    refuses while blocks are held (a save in flight): retried, bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        url = server.url + "/reset_prefix_cache?reset_external=true"
        with urllib.request.urlopen(urllib.request.Request(url, b"", method="POST"), timeout=30) as reply:
            if json.loads(reply.read()).get("success"):
                return
        if time.monotonic() > deadline:
            pytest.fail(f"vLLM refused the reset for {timeout_s:.0f} s")
        time.sleep(0.5)


@contextlib.contextmanager
def _gpu_only_clears(source: str, target: str) -> Iterator[None]:
    """Relay vLLM's KV event batches from `source` to `target`, each AllBlocksCleared replaced by a
    BlockRemoved (medium GPU) of every block the engine's own cache announced and did not remove: what
    a router that reads AllBlocksCleared as the engine's own cache does with it."""
    import msgspec
    import zmq

    context = zmq.Context()
    sub, pub = context.socket(zmq.SUB), context.socket(zmq.PUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 100)
    sub.connect(source)
    pub.bind(target)
    stop = threading.Event()
    on_gpu: dict[int, int | None] = {}  # block hash -> its group

    def relay() -> None:
        while not stop.is_set():
            try:
                topic, seq, payload = sub.recv_multipart()
            except zmq.Again:
                continue
            batch = msgspec.msgpack.decode(payload)
            events = []
            for event in batch[1]:
                gpu = event.get("medium") in (None, "GPU")
                if event["type"] == "BlockStored" and gpu:
                    on_gpu.update(dict.fromkeys(event["block_hashes"], event.get("group_idx")))
                elif event["type"] == "BlockRemoved" and gpu:
                    for block_hash in event["block_hashes"]:
                        on_gpu.pop(block_hash, None)
                elif event["type"] == "AllBlocksCleared":
                    for group in set(on_gpu.values()):
                        hashes = [block_hash for block_hash, of in on_gpu.items() if of == group]
                        events.append({"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU",
                                       **({} if group is None else {"group_idx": group})})  # fmt: skip
                    on_gpu.clear()
                    continue
                events.append(event)
            pub.send_multipart([topic, seq, msgspec.msgpack.encode([batch[0], events, *batch[2:]])])

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        sub.close(0)
        pub.close(0)
        context.term()


def _until_subscribed(indexer, server, instances: tuple[int, ...] = (INSTANCE,), seed: int = 900) -> None:
    """Return once the indexer hears the engine's events. A ZMQ subscriber misses whatever is published
    before its subscription reaches the publisher, and on a loaded machine that can take seconds after
    `/register` answers (the likely cause of a CI run whose router knew none of the first five prompts and
    every later one): send one-block probes, each new, until one is scored (by every instance named)."""
    deadline = time.monotonic() + SUBSCRIBE_TIMEOUT_S
    for attempt in itertools.count():
        probe = random_prompts(1, BLOCK + 8, seed=seed + attempt)[0]
        server.complete(probe, 1)
        for _ in range(10):
            scored = indexer.query(probe)
            if all(scored.get(instance, {}).get("longest_matched", 0) > 0 for instance in instances):
                return
            time.sleep(0.2)
        if time.monotonic() > deadline:
            break
    pytest.fail(f"the indexer heard no event in {SUBSCRIBE_TIMEOUT_S:.0f} s: {indexer.log_tail()}")
