"""CPU per engine step of a whole KV connector, both roles, on vLLM's own objects: kvpool vs vLLM's
MooncakeStoreConnector.

A cell: `requests` requests at `context` tokens (staggered inside a block, so block completions spread
over the steps) decode one token per step, decode KV saved (`save_decode` in kvpool,
`save_decode_cache` in vLLM), for `WINDOWS` windows of `steps` timed steps (the cheapest window is
reported: noise only adds). Each step is driven the way vLLM 0.32 drives a connector:

* scheduler side (`scheduler_us`): `build_connector_meta(SchedulerOutput)` and, after the step,
  `update_connector_output(KVConnectorOutput)`, `get_kv_connector_stats()`, `take_events()`. The
  `SchedulerOutput` is vLLM's own dataclass: `CachedRequestData` with the step's `new_block_ids`
  from a real `KVCacheManager.allocate_slots`, and `KVConnectorBlockState` whose `resolve_block_ids`
  is that manager's `get_block_ids` (a fresh table per call, as in vLLM). Requests are real
  `vllm.v1.request.Request`s whose `block_hashes` grow through vLLM's own block hasher (the engine's
  `prefix_caching_hash_algo`, a distinct `cache_salt` per request).
* worker side (`worker_us`): `handle_preemptions`, `bind_connector_metadata`, `start_load_kv`,
  `wait_for_save`, `get_transfer_results`, `get_block_ids_with_load_errors`, `get_kv_connector_stats`,
  `get_kv_connector_kv_cache_events`, `build_connector_worker_meta`, `clear_connector_metadata`; plus
  all CPU of the connectors' own threads (vLLM's sending thread, kvpool's sender, the Mooncake
  clients' threads) until a bounded drain at the end of the window has stored every chunk its steps
  saved. A sender may put several steps' chunks in one call (kvpool's does, `save_linger_steps`).

Untimed: vLLM's own scheduler and model-runner work (allocation, hashing, building the
`SchedulerOutput` and `KVConnectorOutput`), and admission: `on_new_request`,
`get_num_new_matched_tokens`, `update_state_after_alloc` and a prefill step that stores each prompt.
CPU: the main thread's `time.thread_time` per side, and the rest of `time.process_time` over the
window for the worker side (the mooncake_master's own CPU is not in it; its latency is in `wall_us`).
KV tensors are vLLM's CPU layout shrunk to 1 KV head of size 4 and 2 layers (32 B per token), so the
figures are connector CPU, not memcpy. `meta_bytes`: the pickled
scheduler → worker metadata per step, what a multi-process engine ships to every worker.

Backends: `memory` (kvpool, embedded pool), `mooncake` (kvpool, real mooncake_master on 127.0.0.1),
`vllm` (vLLM's connector on its own master; see `vllm_store_reference` for what of it is driven).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import pickle
import time
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import torch

from kvpool.benchmarks.per_step.vllm_workload import ConnectorPair, Workload

BACKENDS = ("memory", "mooncake", "vllm")
WARMUP_STEPS = 4
WINDOWS = 3  # consecutive timed windows of `steps` steps per cell; the cheapest is reported (noise only adds)
DRAIN_TIMEOUT_S = 60.0
TARGET_SPEEDUP_MIN = 3.0
TARGET_FLATNESS_MAX = 1.5
# `kvpool bench all`: the CLI's defaults; tiny: every backend at two short contexts (checks the bench only)
ALL_ARGS: dict[str, Any] = {
    "requests": [8, 64], "contexts": [1024, 16384, 131072], "block_sizes": [16, 64], "steps": 64,
}
TINY_ARGS: dict[str, Any] = {"requests": [3], "contexts": [64, 256], "block_sizes": [16], "steps": 40}


class _KVPoolPair:
    """kvpool's connector, worker role first (the scheduler role reads the local pool's index)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvpool.integrations.vllm import KVPoolConnector, local_worker

        self.worker = KVPoolConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        self.scheduler: Any = None
        try:
            self.worker.register_kv_caches(kv_caches)
            self.scheduler = KVPoolConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        except BaseException:
            self.close()
            raise
        engine = local_worker(self.worker.engine_id)
        assert engine is not None
        self.engine = engine

    def drain(self, timeout_s: float) -> None:
        if not self.engine.drain(timeout_s):
            raise TimeoutError(f"kvpool's saves did not finish within {timeout_s:.0f} s")

    def stored(self, hashes: list[bytes]) -> int:
        keys = self.worker.plan.placements()[0].keys.keys(hashes)
        return sum(self.engine.backend.exists(keys)) if keys else 0

    def close(self) -> None:
        backend = getattr(getattr(self, "engine", None), "backend", None)
        self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if backend is not None and self.worker.config.backend == "memory":
            backend.clear()  # the named pool outlives the connector: free its bytes now


def _step(pair: ConnectorPair, workload: Workload, output: Any, acc: dict[str, float] | None) -> None:
    """One engine step through both roles; `acc` adds the main thread's CPU of each side (None: untimed).
    The connectors' own threads (senders, pool clients) are counted by the window (`_window`)."""
    from vllm.v1.outputs import KVConnectorOutput

    scheduler, worker = pair.scheduler, pair.worker
    gc.disable()  # a collection lands in whichever phase it hits: keep it out of both
    try:
        c0, w0 = time.thread_time(), time.perf_counter()
        meta = scheduler.build_connector_meta(output)
        c1, w1 = time.thread_time(), time.perf_counter()
        meta_bytes = len(pickle.dumps(meta)) if acc is not None else 0
        output.kv_connector_block_state = None  # vLLM strips it before dispatch
        c2, w2 = time.thread_time(), time.perf_counter()
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)  # neither connector reads the forward context
        worker.wait_for_save()
        results = worker.get_transfer_results(output.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        stats = worker.get_kv_connector_stats()
        events = worker.get_kv_connector_kv_cache_events()
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        c3, w3 = time.thread_time(), time.perf_counter()
        connector_output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=invalid,
            kv_connector_stats=stats,
            kv_cache_events=events,
            kv_connector_worker_meta=worker_meta,
        )
        c4, w4 = time.thread_time(), time.perf_counter()
        scheduler.update_connector_output(connector_output)
        scheduler.get_kv_connector_stats()
        list(scheduler.take_events() or ())
        c5, w5 = time.thread_time(), time.perf_counter()
    finally:
        gc.enable()
    if acc is not None:
        acc["scheduler_cpu"] += (c1 - c0) + (c5 - c4)
        acc["scheduler_wall"] += (w1 - w0) + (w5 - w4)
        acc["worker_cpu"] += c3 - c2
        acc["worker_wall"] += w3 - w2
        acc["meta_bytes"] += meta_bytes
    workload.advance(output)


def _window(pair: ConnectorPair, workload: Workload, steps: int) -> dict[str, float]:
    """`steps` timed steps, then a drain of the connector's threads. What they used (process CPU beyond
    the main thread's) is worker-side work: vLLM's sending thread and kvpool's sender both serve
    `wait_for_save`. A sender may put several steps' chunks in one call; the drain makes the window pay
    for every chunk its steps saved."""
    acc = dict.fromkeys(("scheduler_cpu", "scheduler_wall", "worker_cpu", "worker_wall", "meta_bytes"), 0.0)
    process0, thread0 = time.process_time(), time.thread_time()
    for _ in range(steps):
        _step(pair, workload, workload.schedule(), acc)
    w0 = time.perf_counter()
    pair.drain(DRAIN_TIMEOUT_S)
    acc["worker_wall"] += time.perf_counter() - w0
    process1, thread1 = time.process_time(), time.thread_time()
    acc["worker_cpu"] += max(0.0, (process1 - process0) - (thread1 - thread0))  # the other threads
    return acc


def _run_cell(
    factory: Any, vllm_config: Any, block_size: int, context: int, requests: int, steps: int, seed: int
) -> dict[str, Any]:
    workload = Workload(vllm_config, block_size, context, requests, WARMUP_STEPS + WINDOWS * steps, seed)
    pair: ConnectorPair = factory(vllm_config, workload.kv_cache_config, workload.kv_caches)
    try:
        pair.scheduler.bind_kv_cache_manager(workload.manager)
        _step(pair, workload, workload.admit(pair), None)  # prefill: stores every prompt
        pair.drain(DRAIN_TIMEOUT_S)
        workload.mark_saved()
        for _ in range(WARMUP_STEPS):
            _step(pair, workload, workload.schedule(), None)
        pair.drain(DRAIN_TIMEOUT_S)
        windows = [_window(pair, workload, steps) for _ in range(WINDOWS)]
        acc = min(windows, key=lambda w: w["scheduler_cpu"] + w["worker_cpu"])
        expected = workload.hashes_since_mark()
        stored = pair.stored(expected)
    finally:
        pair.close()
    per_step = {k: v / steps * (1e6 if not k.startswith("meta") else 1) for k, v in acc.items()}
    return {
        "block_size": block_size,
        "context": context,
        "requests": requests,
        "steps": steps,
        "scheduler_us": round(per_step["scheduler_cpu"], 1),
        "worker_us": round(per_step["worker_cpu"], 1),
        "total_us": round(per_step["scheduler_cpu"] + per_step["worker_cpu"], 1),
        "wall_us": round(per_step["scheduler_wall"] + per_step["worker_wall"], 1),
        "meta_bytes": round(per_step["meta_bytes"]),
        "chunks_stored": stored,
        "chunks_expected": len(expected),
    }


@contextlib.contextmanager
def _backend(name: str, base_config: Any) -> Iterator[tuple[Any, Any]]:
    """(vllm_config for the cell, connector-pair factory) for one backend; its master lives as long."""
    from vllm.config import KVTransferConfig

    def configure(transfer: dict[str, Any]) -> Any:
        config = copy.copy(base_config)
        config.cache_config = copy.copy(base_config.cache_config)
        config.kv_transfer_config = KVTransferConfig(**transfer, engine_id=f"bench-{uuid.uuid4().hex[:8]}")
        return config

    kvpool = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.integrations.vllm"}
    if name == "memory":
        extra = {"pool_name": f"bench-{uuid.uuid4().hex[:8]}", "capacity_bytes": "2GiB", "save_decode": True}
        yield configure({**kvpool, "kv_role": "kv_both", "kv_connector_extra_config": extra}), _KVPoolPair
        return
    from kvpool.backends.mooncake.master import start_master

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    master = start_master()
    try:
        if name == "mooncake":
            options = {**master.backend_options(), "global_segment_size": "1GiB", "staging_bytes": "16MiB"}
            extra = {"backend": "mooncake", "mooncake": options, "save_decode": True}
            yield configure({**kvpool, "kv_role": "kv_both", "kv_connector_extra_config": extra}), _KVPoolPair
            return
        from kvpool.benchmarks.per_step import vllm_store_reference as reference

        with reference.cpu_only_patches(), reference.mooncake_config_file(master.address):
            port = 40000 + uuid.uuid4().int % 20000  # names this run's lookup socket: no clash with others
            yield configure(reference.transfer_config(port)), reference.VllmStorePair
    finally:
        master.stop()


def run(
    *,
    requests: list[int],
    contexts: list[int],
    block_sizes: list[int],
    steps: int = 64,
    backends: list[str] | None = None,
) -> dict[str, Any]:
    backends = list(backends or BACKENDS)
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown or not requests or not contexts or not block_sizes or steps <= 0:
        raise ValueError(f"connector-step needs backends from {BACKENDS} (got {unknown or backends}), steps > 0")
    contexts = sorted(set(contexts))
    for block_size in block_sizes:
        if contexts[0] < 2 * block_size or block_size % 16:
            raise ValueError(f"block size {block_size}: a multiple of 16, at most half the smallest context")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout: keep the table (or JSON) readable
    from vllm.engine.arg_utils import EngineArgs

    from kvpool.testing.models import default_model_dir, make_tiny_model

    model = make_tiny_model("llama", default_model_dir() / "llama")
    started = time.perf_counter()
    cells: list[dict[str, Any]] = []
    for block_size in block_sizes:
        base = EngineArgs(
            model=str(model), skip_tokenizer_init=True, block_size=block_size, kv_cache_memory_bytes=1 << 27
        ).create_engine_config()
        for name in backends:
            with _backend(name, base) as (vllm_config, factory):
                for count in requests:
                    for context in contexts:
                        seed = zlib.crc32(f"{name}:{block_size}:{count}:{context}".encode()) & 0xFFFF
                        cell = _run_cell(factory, vllm_config, block_size, context, count, steps, seed)
                        cells.append({"backend": name, **cell})
    return _summarise(cells, steps, started)


def _summarise(cells: list[dict[str, Any]], steps: int, started: float) -> dict[str, Any]:
    total = {(c["backend"], c["block_size"], c["requests"], c["context"]): c["total_us"] for c in cells}
    ratios = []
    for (name, block_size, count, context), vllm_us in total.items():
        if name != "vllm":
            continue
        for pool in ("memory", "mooncake"):
            ours = total.get((pool, block_size, count, context))
            if ours:
                ratios.append(
                    {
                        "block_size": block_size,
                        "context": context,
                        "requests": count,
                        "pool": pool,
                        "vllm_over_kvpool": round(vllm_us / ours, 2),
                    }
                )
    flatness = []
    for name, block_size, count in sorted({(n, b, r) for n, b, r, _ in total}):
        by_context = sorted((c, us) for (n, b, r, c), us in total.items() if (n, b, r) == (name, block_size, count))
        if len(by_context) > 1 and by_context[0][1] > 0:
            flatness.append(
                {
                    "backend": name,
                    "block_size": block_size,
                    "requests": count,
                    "largest_over_smallest": round(by_context[-1][1] / by_context[0][1], 2),
                }
            )
    kvpool_flat = [f for f in flatness if f["backend"] != "vllm"]
    passed = bool(ratios) and all(r["vllm_over_kvpool"] >= TARGET_SPEEDUP_MIN for r in ratios)
    passed = passed and all(f["largest_over_smallest"] <= TARGET_FLATNESS_MAX for f in kvpool_flat)
    return {
        "bench": "connector-step",
        "steps": steps,
        "cells": cells,
        "ratios": ratios,
        "flatness": flatness,
        "targets": (
            f"vllm/kvpool >= {TARGET_SPEEDUP_MIN:g} at every context; "
            f"128k within {TARGET_FLATNESS_MAX:g}x of 1k (kvpool backends)"
        ),
        "pass": passed,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 132))
    table = Table(title=f"connector CPU per engine step (both roles), {result['steps']} decode steps per cell")
    columns = ("backend", "block", "context", "requests", "sched µs", "worker µs", "total µs", "wall µs")
    for column in (*columns, "meta B/step", "chunks stored"):
        table.add_column(column, justify="left" if column == "backend" else "right")
    for c in result["cells"]:
        table.add_row(
            c["backend"],
            str(c["block_size"]),
            f"{c['context']:,}",
            str(c["requests"]),
            f"{c['scheduler_us']:,.1f}",
            f"{c['worker_us']:,.1f}",
            f"{c['total_us']:,.1f}",
            f"{c['wall_us']:,.1f}",
            f"{c['meta_bytes']:,}",
            f"{c['chunks_stored']}/{c['chunks_expected']}",
        )
    console.print(table)
    for r in result["ratios"]:
        console.print(
            f"block {r['block_size']}, {r['requests']} requests, {r['context']:,} tokens: "
            f"vllm / kvpool-{r['pool']} = {r['vllm_over_kvpool']}x"
        )
    for f in result["flatness"]:
        console.print(
            f"{f['backend']}, block {f['block_size']}, {f['requests']} requests: "
            f"largest / smallest context = {f['largest_over_smallest']}x"
        )
    console.print(f"targets: {result['targets']}: {'PASS' if result['pass'] else 'FAIL'}")
