"""Child processes of the Mooncake end-to-end tests (run as a script; also imported by the tests).

    python mooncake_driver.py engine SPEC_JSON OUT_JSON
        One in-process vLLM CPU engine with the kvpool connector: greedy-decodes the prompts of the
        spec and writes the results and the worker's stats.

    python mooncake_driver.py tp-rank MASTER RANK PUT_STEP OUT_JSON
        One tensor-parallel rank at the core level: a WorkerCore over its own zero-segment Mooncake
        client saves the chunk set of `tp_requests()` with put_step/put_step_rank, and records every
        key it handed to the backend.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

# ---------------------------------------------------------------------------------------- TP ranks

TP_BLOCK = 32
TP_LAYERS = 2
TP_LAYER_BYTES = 16 << 10  # per layer and block: a chunk is TP_LAYERS pieces of this
TP_NUM_BLOCKS = 256
TP_REQUESTS = 6
TP_TOKENS = 320  # per request: 10 chunks per group
TP_STEPS = (40, 130, 200, 320)  # the prompt's saveable length grows through these (incremental saves)


class CountingBackend:
    """Wraps a backend and records every key passed to put (with its status)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self._lock = threading.Lock()
        self.put_keys: list[str] = []
        self.put_statuses: list[str] = []

    def put(self, keys: Sequence[str], values: Sequence[Any]) -> Any:
        statuses = self.inner.put(keys, values)
        with self._lock:
            self.put_keys.extend(keys)
            self.put_statuses.extend(status.name for status in statuses)
        return statuses

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)  # AttributeError where the inner pool lacks it
        if name != "put_linked":
            return attribute

        def put_linked(keys: Sequence[str], values: Sequence[Any], parents: Sequence[bytes | None]) -> Any:
            """The save path's put where the pool takes chains (the embedded pool's policy): counted too."""
            statuses = attribute(keys, values, parents)
            with self._lock:
                self.put_keys.extend(keys)
                self.put_statuses.extend(status.name for status in statuses)
            return statuses

        return put_linked


def tp_model(namespace: str) -> tuple[Any, list[Any]]:
    """(coordinator, key spaces) of a two-group hybrid model: full attention + a sliding window."""
    from kvpool.core.keys import KeySpace, LayoutFingerprint
    from kvpool.core.masks import FullAttention, MaskCoordinator, SlidingWindow

    kinds = [FullAttention(TP_BLOCK), SlidingWindow(TP_BLOCK, 2 * TP_BLOCK)]
    coordinator = MaskCoordinator(kinds, retention_interval=None)
    spaces = [
        KeySpace(LayoutFingerprint("tp-test", "uint8", TP_BLOCK, "numpy", group_id=g, tenant=namespace))
        for g in range(len(kinds))
    ]
    return coordinator, spaces


def tp_requests(namespace: str) -> list[tuple[str, list[bytes], tuple[list[int], ...]]]:
    """(request id, block hashes, block table per group); both groups get disjoint blocks."""
    chunks = TP_TOKENS // TP_BLOCK
    requests = []
    for r in range(TP_REQUESTS):
        hashes = [hashlib.blake2b(f"{namespace}/{r}/{i}".encode(), digest_size=16).digest() for i in range(chunks)]
        base = 1 + r * 2 * chunks
        tables = (list(range(base, base + chunks)), list(range(base + chunks, base + 2 * chunks)))
        requests.append((f"req-{r}", hashes, tables))
    return requests


def tp_block_bytes(group: int, block_id: int, layer: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(f"{group}/{block_id}/{layer}".encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, TP_LAYER_BYTES, dtype=np.uint8)


def tp_layout() -> Any:
    """KV memory whose every block holds bytes derived from (group, block id, layer): identical on every
    rank, as for TP ranks that hold replicated KV heads (the case put_step > 1 is for)."""
    from kvpool.worker.layout import KVLayout

    tensors = {}
    groups = {}
    for group in range(2):
        for layer in range(TP_LAYERS):
            name = f"g{group}.l{layer}"
            tensor = np.zeros((TP_NUM_BLOCKS, TP_LAYER_BYTES), dtype=np.uint8)
            for block_id in range(1, TP_NUM_BLOCKS):
                tensor[block_id] = tp_block_bytes(group, block_id, layer)
            tensors[name] = tensor
            groups[name] = group
    return KVLayout(tensors, groups, TP_NUM_BLOCKS)


def tp_expected_value(group: int, block_id: int) -> bytes:
    return b"".join(tp_block_bytes(group, block_id, layer).tobytes() for layer in range(TP_LAYERS))


def run_tp_rank(backend: Any, namespace: str, put_step: int, rank: int, layout: Any = None) -> CountingBackend:
    """Save every request of `tp_requests` incrementally, as this rank; returns the counting backend."""
    from kvpool.core.metadata import RequestDelta
    from kvpool.worker.worker_core import GroupPlacement, WorkerCore

    coordinator, spaces = tp_model(namespace)
    counting = CountingBackend(backend)
    placements = [GroupPlacement(space, put_step, (rank + g) % put_step) for g, space in enumerate(spaces)]
    engine = WorkerCore(counting, coordinator, placements, layout or tp_layout())
    try:
        for req_id, hashes, tables in tp_requests(namespace):
            sent, previous = 0, 0
            for length in TP_STEPS:
                count = length // TP_BLOCK
                new_blocks = tuple(list(table[sent:count]) for table in tables) if count > sent else None
                delta = RequestDelta(
                    req_id,
                    new_hashes=list(hashes[sent:count]),
                    new_blocks=new_blocks,
                    num_prompt_tokens=TP_TOKENS if not previous else 0,
                    computed_before=previous,
                )
                engine.apply([delta])
                engine.save([RequestDelta(req_id, save_tokens=length, computed_before=previous)])
                sent, previous = max(sent, count), length
            engine.finish([req_id])
        if not engine.drain(60.0):
            raise RuntimeError("saves did not finish within 60 s")
    finally:
        engine.close()
    return counting


def _tp_rank_main(master: str, rank: int, put_step: int, out: str) -> None:
    from kvpool.backends.mooncake import MooncakeBackend

    namespace = os.environ["KVPOOL_TP_NAMESPACE"]
    layout = tp_layout()
    backend = MooncakeBackend.from_options({"master": master, "global_segment_size": 0, "staging_bytes": 1 << 20})
    print("ready", flush=True)
    sys.stdin.readline()  # start together with the other rank
    try:
        counting = run_tp_rank(backend, namespace, put_step, rank, layout)
        stats = vars(backend.stats())
    finally:
        backend.close()
    with open(out, "w") as fh:
        json.dump({"put_keys": counting.put_keys, "put_statuses": counting.put_statuses, "stats": stats}, fh)


# ---------------------------------------------------------------------------------------- holder


# ---------------------------------------------------------------------------------------- engine


def _engine_main(spec_path: str, out: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from kvpool.integrations.vllm import local_worker
    from kvpool.testing.engine import engine, generate_greedy

    with open(spec_path) as fh:
        spec = json.load(fh)
    with engine(spec["model"], kv_transfer_config=spec["kv_transfer_config"], **spec.get("engine", {})) as llm:
        results = generate_greedy(llm, spec["prompts"], spec["max_tokens"])
        worker = local_worker()
        assert worker is not None, "no in-process kvpool worker"
        drained = worker.drain(60.0)
        for _ in range(3):  # deliver the finished requests to the worker
            llm.llm_engine.step()
            drained = worker.drain(60.0) and drained
        stats = asdict(worker.stats)
    with open(out, "w") as fh:
        json.dump({"results": [asdict(r) for r in results], "stats": stats, "drained": drained}, fh)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "engine":
        _engine_main(args[0], args[1])
    elif command == "tp-rank":
        _tp_rank_main(args[0], int(args[1]), int(args[2]), args[3])
    else:
        raise SystemExit(f"unknown command {command!r}")
