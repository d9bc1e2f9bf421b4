"""The `vllm` mode of `bench store-path`: vLLM 0.32's own MooncakeStoreConnector save path on the
bench's cells (same block hashes, same KV bytes, same mooncake_master as kvpool's modes).

vLLM's code, unchanged, does the work:
* the connector's worker role (`MooncakeStoreConnector` → `MooncakeStoreWorker`, built by
  `vllm_store_reference.VllmStorePair` with its own `MooncakeDistributedStore` client) registers the
  pool's tensors (one connector for all contexts of a case and block size) and starts its real
  `KVCacheStoreSendingThread`;
* save jobs are emitted as `MooncakeStoreScheduler.build_connector_meta` emits them for a running
  request: a vLLM `RequestTracker` per request, advanced every step as there (`token_len` grows by the
  step's token, `update(new_block_ids)`), and `ReqMeta.from_request_tracker` deciding whether the step
  has a save job. It has one only when a block completes (`num_tokens_to_save` reaches the next block
  boundary past `num_saved_tokens`): a request saves once every `block_size` steps, never in between.
  A job gets a `store_job_id`, as `_reference_save_blocks` gives it. The tracker updates and the
  decisions are timed, as kvpool's `SchedulerCore.quiet` / `request_delta` are in its modes;
* each step the jobs go through `MooncakeStoreWorker.wait_for_save(metadata)` to the sending thread's
  queue, and the thread runs `_handle_request`: `is_live_store_job`, `store_mask` from its per-request
  `_saved_offset`, `process_tokens`, `key_for`, `batch_is_exist`, `prepare_values`,
  `batch_put_from_multi_buffers`, `_record_saved`. After the step the bench harvests
  `get_kv_connector_stats()` and `take_completed_saves()`, as the engine does every step.

vLLM 0.32's sending thread resumes each request from `_saved_offset`, its own high-water mark, so it
examines only the new chunks too: its cost is flat in context, and per job it is the handler plus a
`batch_is_exist` and a put round trip to the master.

Reconstructed, because this machine has no GPU and no torch.distributed group: the TP rank lookups
and the CUDA event (`vllm_store_reference.cpu_only_patches`), and for `put_step2` a TP size of twice
the model's KV heads at rank 0 (vLLM's replication factor 2, so `group_put_steps` is 2). Left out (the
scheduler's side, like kvpool's, which `bench connector-step` measures): the scheduler's per-job
`_apply_current_save_block_ids` (a fresh block table from the KV cache manager) and the block pinning
of `_reference_save_blocks`, both O(context) per job; the job carries the tracker's own table, which
holds the same block ids. vLLM's client owns the master's only segment while it runs (kvpool's client
is closed by then), so its puts are local memcpy, as kvpool's are.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import itertools
import os
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from kvpool.benchmarks.per_step import vllm_store_reference as reference

if TYPE_CHECKING:
    from kvpool.benchmarks.per_step.store_path_cells import _Cell, _Pool

DRAIN_TIMEOUT_S = 120.0
HEAD_SIZE = 4  # the specs' nominal shape; vLLM's store layout reads the tensors' own strides


@contextlib.contextmanager
def _tensor_parallel(size: int) -> Iterator[None]:
    """TP world size `size` (rank 0) for the worker module's lookups while a worker is built."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as worker_module

    saved = worker_module.get_tensor_model_parallel_world_size
    worker_module.get_tensor_model_parallel_world_size = lambda: size
    try:
        yield
    finally:
        worker_module.get_tensor_model_parallel_world_size = saved


class Session:
    """vLLM set up once per bench run: the tiny model's engine config per block size, the CPU-only
    patches and the Mooncake config file naming the bench's master."""

    def __init__(self) -> None:
        # imported now, so that the bench's heap freeze (gc.freeze) covers vLLM's modules
        import vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector
        import vllm.engine.arg_utils  # noqa: F401

        from kvpool.testing.models import default_model_dir, make_tiny_model

        self.model = make_tiny_model("llama", default_model_dir() / "llama")
        self._configs: dict[int, Any] = {}

    def _config(self, pool: _Pool) -> Any:
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs

        b = pool.block_size
        if b not in self._configs:
            self._configs[b] = EngineArgs(
                model=str(self.model), skip_tokenizer_init=True, block_size=b, kv_cache_memory_bytes=1 << 27
            ).create_engine_config()
        config = copy.copy(self._configs[b])
        config.cache_config = copy.copy(config.cache_config)
        config.cache_config.num_gpu_blocks = pool.num_blocks
        port = 40000 + uuid.uuid4().int % 20000  # names this connector's lookup socket: no clash with others
        config.kv_transfer_config = KVTransferConfig(
            **reference.transfer_config(port), engine_id=f"bench-{uuid.uuid4().hex[:8]}"
        )
        return config

    def measure(self, pool: _Pool, cells: dict[int, _Cell], steps: int, windows: int) -> dict[int, dict[str, float]]:
        """One vLLM connector over the pool's tensors; every cell pre-filled, then `windows` rounds of one
        timed window of `steps` decode steps per cell (contexts interleaved, as kvpool's); the fastest."""
        config = self._config(pool)
        tp_size = 2 * config.model_config.get_total_num_kv_heads() if pool.put_step == 2 else 1
        with _tensor_parallel(tp_size):
            pair = reference.VllmStorePair(config, _kv_cache_config(pool), _kv_caches(pool))
        try:
            saves = {context: _VllmSaves(pair, cell) for context, cell in cells.items()}
            samples: dict[int, list[dict[str, float]]] = {context: [] for context in cells}
            for _ in range(windows):
                for context, cell_saves in saves.items():
                    samples[context].append(cell_saves.window(steps))
            stored = {context: cell_saves.stored() for context, cell_saves in saves.items()}
        finally:
            pair.close()
        out = {}
        for context, measured in samples.items():
            best = min(measured, key=lambda s: s["cpu_s"])
            out[context] = {**best, "steps": steps, "stored": stored[context][0], "expected": stored[context][1]}
        return out


@contextlib.contextmanager
def session(master_address: str) -> Iterator[Session]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout: keep the table (or JSON) readable
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    with reference.cpu_only_patches(), reference.mooncake_config_file(master_address):
        yield Session()


def _layer_names(pool: _Pool) -> dict[str, str]:
    """vLLM layer name → the pool's tensor it uses (hybrid: each tensor is shared by one layer per group)."""
    return {f"model.layers.{i}.self_attn.attn": tensor for i, (_layer, tensor) in enumerate(pool.layer_tensors.items())}


def _kv_caches(pool: _Pool) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(pool.tensors[tensor]) for name, tensor in _layer_names(pool).items()}


def _kv_cache_config(pool: _Pool) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from kvpool.core.masks import SlidingWindow

    names = list(_layer_names(pool))
    per_group = len(names) // len(pool.kinds)
    groups = []
    for g, kind in enumerate(pool.kinds):
        shape: dict[str, Any] = {
            "block_size": kind.block_size,
            "num_kv_heads": 1,
            "head_size": HEAD_SIZE,
            "dtype": torch.uint8,
        }
        spec = (
            SlidingWindowSpec(**shape, sliding_window=kind.window)
            if isinstance(kind, SlidingWindow)
            else FullAttentionSpec(**shape)
        )
        groups.append(KVCacheGroupSpec(names[g * per_group : (g + 1) * per_group], spec))
    return KVCacheConfig(num_blocks=pool.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


class _VllmSaves:
    """One cell's requests saved through vLLM's worker, pre-filled to the context on construction."""

    def __init__(self, pair: reference.VllmStorePair, cell: _Cell) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import RequestTracker

        self.pair, self.cell = pair, cell
        worker = pair.worker.connector_worker
        assert worker is not None and worker.kv_send_thread is not None
        self.worker, self.thread = worker, worker.kv_send_thread
        assert pair.scheduler is not None and pair.scheduler.connector_scheduler is not None
        self.partial_tail = bool(pair.scheduler.connector_scheduler.enable_partial_hash_hits)
        self.job_ids = itertools.count()
        self.trackers = []
        for request, length in zip(cell.requests, cell.start_lengths):
            cell.grow(request, length)
            self.trackers.append(
                RequestTracker(
                    req_id=request.req_id,
                    token_len=length,
                    allocated_block_ids=tuple(list(table) for table in request.tables),
                    prefill_end_tokens=length,
                )
            )
        self.unfinished = {request.req_id for request in cell.requests}
        self._issue(self._jobs())  # the prefill's save: the whole prompt, one job per request
        self.pair.drain(DRAIN_TIMEOUT_S)
        self.worker.get_kv_connector_stats()

    def _jobs(self) -> list[Any]:
        """This step's save jobs, decided by vLLM's `ReqMeta.from_request_tracker`."""
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import ReqMeta

        jobs = []
        for request, tracker in zip(self.cell.requests, self.trackers):
            job = ReqMeta.from_request_tracker(
                tracker,
                self.cell.block_size,
                block_hashes=request.known_hashes,  # type: ignore[arg-type]  # BlockHash is bytes
                num_prompt_tokens=request.prompt_tokens,
                save_partial_tail=self.partial_tail,
            )
            if job is not None:
                job.store_job_id = next(self.job_ids)
                jobs.append(job)
        return jobs

    def _issue(self, jobs: list[Any]) -> list[Any]:
        """The worker's side of one step: jobs to the sending thread, then the per-step harvests."""
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            MooncakeStoreConnectorMetadata,
        )

        metadata = MooncakeStoreConnectorMetadata(self.unfinished, set())
        for job in jobs:
            metadata.add_request(job)
        self.worker.wait_for_save(metadata)
        stats = self.worker.get_kv_connector_stats()
        self.thread.take_completed_saves()
        return [stats] if stats is not None else []

    def window(self, steps: int) -> dict[str, float]:
        harvested, jobs = [], 0
        plan = self.cell.advance(steps)  # the engine's work (hashes, block ids), before the window
        gc.collect()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for step in plan:
            for item, tracker in zip(step, self.trackers):  # the scheduler's per-step tracker update
                tracker.token_len += 1
                tracker.update(item.new_blocks)
            step_jobs = self._jobs()
            jobs += len(step_jobs)
            harvested += self._issue(step_jobs)
        self.pair.drain(DRAIN_TIMEOUT_S)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        late = self.worker.get_kv_connector_stats()  # what the thread recorded after the last step
        examined = put = 0
        for stats in [*harvested, *([late] if late is not None else [])]:
            reduced = stats.reduce()
            examined += int(reduced.get("save_exists_total_keys", 0))
            put += int(reduced.get("save_put_total_keys", 0))
            if reduced.get("save_put_failed_keys") or reduced.get("save_exists_error_count"):
                raise RuntimeError(f"vLLM's saves failed: {reduced}")
        return {"cpu_s": cpu, "wall_s": wall, "examined": examined, "put": put, "jobs": jobs}

    def stored(self) -> tuple[int, int]:
        """(stored, expected): the chunks of every group this rank owns from the context on, counted
        with vLLM's own keys and `batch_is_exist`."""
        from vllm.v1.core.kv_cache_utils import BlockHash

        keys: list[str] = []
        for request, start in zip(self.cell.requests, self.cell.start_lengths):
            for group, db in enumerate(self.worker.token_dbs):
                layout = db.store_layout
                for chunk in self.cell.owned_chunks(group, start, request.length):
                    chunk_hash = BlockHash(request.hashes[chunk])
                    keys += [layout.key_for(shard, chunk_hash) for shard in layout.local_shard_ids]
        if not keys:
            return 0, 0
        return sum(1 for flag in self.worker.store.batch_is_exist(keys) if flag == 1), len(keys)
