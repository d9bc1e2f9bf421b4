"""kvpool behind vLLM's OpenAI server (`vllm serve`), TP 1 and TP 2, on the embedded pool.

Each worker rank is its own process with its own embedded pool; the scheduler (in the EngineCore
process) knows what they hold from their per-step reports. Requests go by token ids over HTTP:
prompts, then other prompts that push them out of the engine's own cache, then the first prompts
again, whose prefix must now come from the pool. Outputs must equal a server without kvpool; hits
show in `usage.prompt_tokens_details.cached_tokens`, on /metrics, and as KV events (medium CPU) that
name exactly the blocks vLLM itself announced for those prompts. The pools have a disk tier: a server
restarted onto its directory serves the first prompts from disk on its first requests. A disk tier puts
every hit on the async path (the engine waits a step for it); beside the restart, a server whose pool is
DRAM only takes the same prompts back as contract hits (issue 43), loaded in the step that schedules them.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvpool.ops.cli import app
from kvpool.testing.server import openai_server

from .conftest import random_prompts

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 64
PROMPT_TOKENS = 400  # 6 full blocks: a pool hit serves 384 tokens
MAX_TOKENS = 8
TOKEN_BYTES = 4 * 2 * 2 * 64 * 4  # tiny llama, float32: 4 layers x 2 KV heads x K,V x 64 dims x 4 bytes
CACHE_TOKENS = 1024  # the engine's own cache holds two of the prompts, not all six
BLOCKS_STORED = 10 * 6  # the ten distinct prompts' full blocks


class EventSubscriber:
    """Collects vLLM's KV events from its ZMQ publisher (msgpack batches) on a thread.

    A SUB socket misses what its publisher sent before the subscription reached it (ZMQ's slow
    joiner): an engine that starts fast publishes its first batches (a restarted disk tier's
    announcement among them) before that. With `replay_endpoint` (the publisher's, in its
    `kv_events_config`), `catch_up()`, called while the engine still runs, asks the publisher's replay
    buffer for every batch from the first, as a router's indexer does, and keeps those it missed."""

    END_SEQ = -1  # the replay's last frame

    @classmethod
    def on_ipc(cls, path: str) -> tuple[EventSubscriber, dict[str, Any]]:
        """A subscriber of the ipc endpoints at `path` (and `path`-replay), and the engine's
        `kv_events_config` that publishes there."""
        endpoint, replay = f"ipc://{path}", f"ipc://{path}-replay"
        config = {
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay,
            "topic": "kv",
        }  # fmt: skip
        return cls(endpoint, "kv", replay), config

    def __init__(self, endpoint: str, topic: str, replay_endpoint: str | None = None) -> None:
        import zmq

        self._batches: dict[int, list[dict[str, Any]]] = {}  # by sequence number
        self._lock = threading.Lock()
        self._replay_endpoint = replay_endpoint
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._socket.setsockopt(zmq.RCVTIMEO, 100)
        self._socket.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return [event for seq in sorted(self._batches) for event in self._batches[seq]]

    def _keep(self, seq_bytes: bytes, payload: bytes) -> None:
        import msgspec

        _, events, *_ = msgspec.msgpack.decode(payload)
        with self._lock:
            self._batches.setdefault(int.from_bytes(seq_bytes, "big", signed=True), list(events))

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            try:
                _, seq_bytes, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            self._keep(seq_bytes, payload)

    def catch_up(self, timeout_s: float = 10.0) -> None:
        """Every batch the publisher still buffers, from the first: what the SUB socket missed is kept."""
        import zmq

        assert self._replay_endpoint is not None, "catch_up needs the publisher's replay_endpoint"
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        try:
            socket.connect(self._replay_endpoint)
            socket.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:  # bounded: each receive waits at most timeout_s, and the publisher ends the replay
                _, _, seq_bytes, payload = socket.recv_multipart()
                if int.from_bytes(seq_bytes, "big", signed=True) == self.END_SEQ:
                    return
                self._keep(seq_bytes, payload)
        finally:
            socket.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(0)
        self._context.term()

    def of(self, kind: str, medium: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event.get("type") == kind and event.get("medium") == medium]

    def hashes(self, kind: str, medium: str) -> set[int]:
        return {
            h
            for event in self.events
            if event.get("type") == kind and event.get("medium") == medium
            for h in event["block_hashes"]
        }


def per_block(event: dict[str, Any]) -> list[tuple[int, int | None, list[int]]]:
    """A BlockStored event as (hash, parent, tokens) per block (vLLM announces several blocks in one)."""
    hashes, size = event["block_hashes"], event["block_size"]
    parents = [event["parent_block_hash"], *hashes[:-1]]
    tokens = event["token_ids"]
    return [(h, parent, tokens[i * size : (i + 1) * size]) for i, (h, parent) in enumerate(zip(hashes, parents))]


def serve(
    model: Path, tp: int, prompts: list[list[int]], until: Callable[[], bool] | None = None, **extra: Any
) -> list[dict[str, Any]]:
    """Each prompt's completion, then the server's metrics (and `kvpool inspect`'s view); `until`: what
    to wait for (60 s at most) before the server stops."""
    settings = {
        "tensor_parallel_size": tp,
        "block_size": BLOCK,
        "max_model_len": PROMPT_TOKENS + 2 * BLOCK,
        "kv_cache_memory_bytes": CACHE_TOKENS * TOKEN_BYTES // tp,
    }
    with openai_server(model, **settings, **extra) as server:
        results = [server.complete(prompt, MAX_TOKENS) for prompt in prompts]
        tail: dict[str, Any] = {"metrics": server.metrics()}
        if "kv_transfer_config" in extra:  # what an operator's `kvpool inspect engine` reads
            tail["inspect"] = CliRunner().invoke(app, ["inspect", "engine", server.url, "--json"])
        results.append(tail)
        deadline = time.monotonic() + 60
        while until is not None and not until() and time.monotonic() < deadline:
            time.sleep(0.1)
    return results


def steps_to_first_token(metrics: dict[str, float], kind: str) -> float:
    """Engine steps from admission to first token per request with this kind of hit (in_step, async,
    local, miss), from the scheduler's counters on /metrics."""
    requests = metrics.get(f"vllm:kvpool_first_tokens_{kind}_total", 0)
    assert requests > 0, f"no request with a hit of kind {kind!r}: {metrics}"
    return metrics.get(f"vllm:kvpool_first_token_steps_{kind}_total", 0) / requests


@pytest.mark.parametrize("tp", [1, 2])
def test_served_prompts_come_back_from_the_pool_and_after_a_restart_from_its_disk_tier(tp, model_dir, tmp_path):
    """Each rank writes its pool behind to its own directory under `disk_path`; a new server on the same
    directory (a rolling restart) knows what every rank's files hold before its first request."""
    model = model_dir("llama")
    first = random_prompts(6, PROMPT_TOKENS, seed=70)
    others = random_prompts(4, PROMPT_TOKENS, seed=71)
    workload = first + others + first
    # the server without kvpool runs beside the first with it: a start mostly waits, and CI's time is short
    beside = ThreadPoolExecutor(1)
    baseline_run = beside.submit(serve, model, tp, workload)
    disk = tmp_path / "kv"

    def chunk_files() -> list[int]:
        return [len(list((disk / f"rank{rank}").rglob("*.kvc"))) for rank in range(tp)]
    endpoint = f"ipc://{Path(tempfile.gettempdir()) / f'kvpool-events-{uuid.uuid4().hex[:8]}'}"
    subscriber = EventSubscriber(endpoint, "kv")
    try:
        connector = {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "capacity_bytes": "64MiB", "disk_path": str(disk), "disk_capacity_bytes": "1GiB",
            },
        }  # fmt: skip
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
        served = serve(
            model,
            tp,
            workload,
            kv_transfer_config=connector,
            extra_args=["--kv-events-config", json.dumps(events)],
            env={"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1"},
            until=lambda: chunk_files() == [BLOCKS_STORED] * tp,  # written behind, off the engine's thread
        )
        time.sleep(0.5)  # the last batches in flight
    finally:
        subscriber.close()
        beside.shutdown(wait=True)
    *outputs, tail = served
    *base_outputs, _ = baseline_run.result()
    assert [r["token_ids"] for r in outputs] == [r["token_ids"] for r in base_outputs]
    again = outputs[len(first) + len(others) :]
    pool_hits = [r["cached_tokens"] for r in again]
    assert all(hit == 384 for hit in pool_hits), pool_hits  # every block but the partial last one
    metrics = tail["metrics"]
    assert metrics.get("vllm:external_prefix_cache_hits_total", 0) >= 6 * 384, metrics
    assert metrics.get("vllm:kvpool_chunks_loaded_total", 0) >= 6 * 6
    # a pool with a disk tier offers no hit contract (a disk read may time out): every hit loads async, and
    # reaches its first token at least a step later than a contract hit (the DRAM-only server below). Here
    # a call thread reads it and the engine's thread commits it at a later step: 3 steps measured, more
    # if the read outlasts a step (an in-process pool's async load with load_in_step_bytes 0 takes 2)
    assert metrics.get("vllm:kvpool_load_requests_in_step_total", 0) == 0, metrics
    assert metrics.get("vllm:kvpool_first_tokens_async_total", 0) == len(first), metrics
    assert steps_to_first_token(metrics, "async") >= 2
    inspected = tail["inspect"]
    assert inspected.exit_code == 0, inspected.output
    engines = json.loads(inspected.output)
    assert engines["0"]["chunks_loaded_total"] == metrics["vllm:kvpool_chunks_loaded_total"]
    assert engines["0"]["pool_keys"] >= 6 * 6 and engines["0"]["pool_used_bytes"] > 0
    # the pool announced exactly the blocks vLLM announced for the prompts' full blocks, never withdrew them
    stored = subscriber.hashes("BlockStored", "CPU")
    removed = subscriber.hashes("BlockRemoved", "CPU")
    engine_blocks = subscriber.hashes("BlockStored", "GPU")
    assert stored and stored <= engine_blocks
    assert len(stored - removed) >= 6 * 6
    # each pool event describes its block as vLLM's own event does: same parent, same tokens, so that a
    # router chains the pool's blocks under their prefixes (a root only for a prompt's first block)
    engine_blocks_by_hash = {
        block_hash: (parent, tokens) for event in subscriber.of("BlockStored", "GPU") for block_hash, parent, tokens in
        per_block(event)
    }  # fmt: skip
    pool_events = subscriber.of("BlockStored", "CPU")
    for event in pool_events:
        ((block_hash, parent, tokens),) = per_block(event)  # one chunk an event
        assert (parent, tokens) == engine_blocks_by_hash[block_hash], event
        assert len(tokens) == BLOCK, event
        assert event["locality"] == "LOCAL" and event["kv_cache_spec_kind"] == "full_attention", event
    assert sum(event["parent_block_hash"] is None for event in pool_events) == len(first) + len(others)

    # a restart onto the same directory: DRAM starts empty, every rank's files are known before the first request
    assert chunk_files() == [BLOCKS_STORED] * tp  # every rank keeps its shard of every full block
    # beside it, a server whose pool is DRAM only (default load_in_step_bytes): its hits are contract hits
    dram_only = {**connector, "kv_connector_extra_config": {"capacity_bytes": "64MiB"}}
    with ThreadPoolExecutor(1) as aside:
        in_step_run = aside.submit(serve, model, tp, workload, kv_transfer_config=dram_only)
        *restarted, tail = serve(model, tp, first, kv_transfer_config=connector)
    assert [r["token_ids"] for r in restarted] == [r["token_ids"] for r in base_outputs[: len(first)]]
    assert [r["cached_tokens"] for r in restarted] == [384] * len(first), "the restarted server missed"
    metrics = tail["metrics"]
    kvpool = {k: v for k, v in metrics.items() if k.startswith("vllm:kvpool") and not k.endswith("_created")}
    assert kvpool.get("vllm:kvpool_disk_hits_total", 0) >= len(first) * 6 * tp, kvpool  # every hit read the disk
    assert metrics.get("vllm:kvpool_pool_disk_keys", 0) == BLOCKS_STORED * tp

    # the DRAM-only server: the same outputs, every first prompt back from the pool and loaded in the step
    # that scheduled it, so it reaches its first token in one engine step (the disk-tier server's: 2 or more)
    *in_step_outputs, tail = in_step_run.result()
    assert [r["token_ids"] for r in in_step_outputs] == [r["token_ids"] for r in base_outputs]
    assert [r["cached_tokens"] for r in in_step_outputs[len(first) + len(others) :]] == [384] * len(first)
    metrics = tail["metrics"]
    kvpool = {k: v for k, v in metrics.items() if k.startswith("vllm:kvpool") and not k.endswith("_created")}
    assert kvpool.get("vllm:kvpool_load_requests_in_step_total", 0) == len(first), kvpool
    assert kvpool.get("vllm:kvpool_first_tokens_async_total", 0) == 0, kvpool
    assert steps_to_first_token(metrics, "in_step") == 1
    assert kvpool.get("vllm:kvpool_chunks_loaded_total", 0) == len(first) * 6 * tp, kvpool  # every rank its shard
    assert kvpool.get("vllm:kvpool_chunks_load_failed_total", 0) == 0, kvpool
