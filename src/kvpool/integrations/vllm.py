"""vLLM KV connector. Load it with

    --kv-transfer-config '{"kv_connector": "KVPoolConnector",
                           "kv_connector_module_path": "kvpool.integrations.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

A thin adapter: it turns vLLM's requests, block tables, KV cache config and tensors into the
core's plain data (kvpool.scheduler / kvpool.worker) and back. No pool logic lives here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvpool.backends.base import Backend
from kvpool.backends.factory import create_backend
from kvpool.backends.memory import MemoryBackend
from kvpool.config import KVPoolConfig
from kvpool.errors import LayoutError
from kvpool.index import PoolEvent, PoolIndex, PoolReport, PoolTracker
from kvpool.integrations.vllm_metrics import (
    KVPoolPromMetrics,
    KVPoolStats,
    SchedulerStatsSampler,
    WorkerStatsSampler,
)
from kvpool.integrity import Integrity
from kvpool.keys import LayoutFingerprint
from kvpool.layout import KVLayout
from kvpool.masks import MaskCoordinator
from kvpool.metadata import StepMetadata
from kvpool.plan import ModelPlan
from kvpool.scheduler import SchedulerConfig, SchedulerEngine
from kvpool.specs import SpecFacts, attention_kind
from kvpool.worker import WorkerConfig, WorkerEngine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.vllm")

# In-process engines, for tests and the demo (local_worker / local_scheduler)
_LOCAL_WORKERS: dict[str, _WorkerSide] = {}
_LOCAL_SCHEDULERS: dict[str, _SchedulerSide] = {}
_LOCAL_LOCK = threading.Lock()


def group_spec(spec: Any) -> Any:
    """The spec both roles see for a group. vLLM hands the scheduler the first layer's spec where the
    workers get a `UniformTypeKVCacheSpecs` (layers of one kind whose sizes differ), so both roles
    derive kinds and keys from that first layer; a wrapper whose layers differ in kind is refused."""
    layers = getattr(spec, "kv_cache_specs", None)
    if not layers:
        return spec
    first = next(iter(layers.values()))
    kinds = {attention_kind(spec_facts(layer)) for layer in layers.values()}
    if len(kinds) > 1:
        raise LayoutError(f"KV cache group {type(spec).__name__} mixes attention kinds {sorted(map(repr, kinds))}")
    return first


def spec_facts(spec: Any) -> SpecFacts:
    return SpecFacts(
        type_name=type(spec).__name__,
        block_size=spec.block_size,
        sliding_window=getattr(spec, "sliding_window", None),
        extra_retained_tokens=getattr(spec, "extra_retained_tokens", 0) or 0,
        attention_chunk_size=getattr(spec, "attention_chunk_size", None),
        non_causal=bool(getattr(spec, "non_causal", False)),
    )


def weights_digest(vllm_config: VllmConfig) -> str:
    """What decides the KV bytes besides the path and the layout: the weights' revision and load
    format (dummy weights follow the seed), quantization, the model dtype and the model's config
    after `hf_overrides` (rope scaling, head sizes, ...). LoRA adapters, multimodal inputs and
    `cache_salt` already reach vLLM's block hashes."""
    model = vllm_config.model_config
    load_format = str(vllm_config.load_config.load_format)
    hf_config = model.hf_config.to_dict()
    config = {k: v for k, v in hf_config.items() if not k.startswith("_") and k != "transformers_version"}
    facts = {
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "revision": model.revision,
        "code_revision": model.code_revision,
        "quantization": model.quantization,
        "dtype": str(model.dtype),
        "load_format": load_format,
        "seed": model.seed if "dummy" in load_format else None,
        "hf_config": config,
    }
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _cpu_isa() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return "unknown"
    for isa in ("amx_bf16", "avx512f", "avx2"):
        if f" {isa}" in flags:
            return isa
    return "base"


def plan_model(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: KVPoolConfig) -> ModelPlan:
    specs = [group_spec(group.kv_cache_spec) for group in kv_cache_config.kv_cache_groups]
    kinds = [attention_kind(spec_facts(spec)) for spec in specs]
    hash_block = kv_cache_config.hash_block_size or min(kind.block_size for kind in kinds)
    retention = config.retention_interval
    if retention == "engine":
        retention = kv_cache_config.prefix_cache_retention_interval
    assert retention is None or isinstance(retention, int)
    coordinator = MaskCoordinator(kinds, retention_interval=retention, hash_block_size=hash_block)
    parallel = vllm_config.parallel_config
    tp_size, pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    rank = getattr(parallel, "rank", 0)
    model_config = vllm_config.model_config
    device = vllm_config.device_config.device_type
    layout = kv_cache_config.kv_cache_layout or "default"
    isa = _cpu_isa() if device == "cpu" else torch.__version__
    hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
    if hash_algo.startswith("xxhash") and "PYTHONHASHSEED" not in os.environ:
        log.warning(
            "prefix_caching_hash_algo=%s without PYTHONHASHSEED seeds block hashes per process: "
            "other engines will never hit what this one stores",
            hash_algo,
        )
    weights = weights_digest(vllm_config)
    fingerprints = [
        LayoutFingerprint(
            model=config.model_id or model_config.model,
            dtype=str(getattr(spec, "dtype", model_config.dtype)),
            block_size=kind.block_size,
            kv_layout=(
                f"{device}:{layout}:{isa}:{getattr(spec, 'num_kv_heads', 0)}x{getattr(spec, 'head_size', 0)}"
                f":{getattr(spec, 'kv_quant_mode', '')}"
            ),
            chunk_bytes=spec.page_size_bytes,  # per layer; the layers come from pp_rank of pp_size
            pp_size=pp_size,
            group_id=group_id,
            attention=f"{type(spec).__name__}:{kind.describe()}",
            hash_algo=f"{hash_algo}:{os.environ.get('PYTHONHASHSEED', '')}",
            weights=weights,
            tenant=config.tenant,
            integrity="" if config.integrity == Integrity.OFF else config.integrity,
        )
        for group_id, (spec, kind) in enumerate(zip(specs, kinds))
    ]
    replicas = max(1, int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1))
    return ModelPlan(
        coordinator,
        fingerprints,
        rank % tp_size,
        tp_size,
        replicas,
        rank // tp_size,
        pp_size,
        shared_pool=config.backend != "memory",
    )


class KVPoolMetadata(KVConnectorMetadata):
    def __init__(self, step: StepMetadata) -> None:
        self.step = step


class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, every step: what the ranks' embedded pools gained and lost."""

    def __init__(self, reports: list[PoolReport]) -> None:
        self.reports = reports

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVPoolWorkerMetadata)
        return KVPoolWorkerMetadata(self.reports + other.reports)


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    """kvpool as a vLLM KV connector (scheduler and worker roles)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.config = KVPoolConfig.from_dict(transfer.kv_connector_extra_config)
        self.engine_id = transfer.engine_id or "default"
        if self.config.load_failure_policy == "recompute" and transfer.kv_load_failure_policy != "recompute":
            # a pool is a cache: a chunk that cannot be loaded is recomputed, never a failed request
            log.info("kvpool sets kv_load_failure_policy=recompute (load_failure_policy=engine keeps vLLM's)")
            transfer.kv_load_failure_policy = "recompute"
        self.plan = plan_model(vllm_config, kv_cache_config, self.config)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self)
        else:
            self._worker = _WorkerSide(self)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, never an error

    # ---- worker role ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVPoolMetadata)
        self._worker_side.before_step(kv_connector_metadata.step)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker_side.apply(self._step())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        self._worker_side.save(self._step())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker_side.transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side.take_invalid_blocks()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker_side.pool_report()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def _step(self) -> StepMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata)
        return meta.step

    @property
    def _worker_side(self) -> _WorkerSide:
        if self._worker is None:
            raise RuntimeError("worker-side call on the scheduler connector")
        return self._worker

    @property
    def _scheduler_side(self) -> _SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("scheduler-side call on the worker connector")
        return self._scheduler

    # ---- scheduler role ------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler_side.kv_cache_manager = kv_cache_manager

    def on_new_request(self, request: Request) -> None:
        self._scheduler_side.requests[request.request_id] = request

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler_side.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVPoolMetadata(self._scheduler_side.build_step(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_side.absorb(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side.finished(request), None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side.finished(request), None

    def reset_cache(self) -> bool | None:
        """`reset_prefix_cache(reset_connector=True)`: empty the pool."""
        return self._scheduler_side.reset()

    def take_events(self) -> list[KVCacheEvent]:
        return self._scheduler_side.take_events()

    # ---- stats (both roles) → vLLM's /metrics and stats log; see kvpool.integrations.vllm_metrics

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This role's counter deltas since the previous call; None when nothing changed."""
        side = self._worker if self._worker is not None else self._scheduler
        return side.metrics.take() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVPoolStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class _WorkerSide:
    def __init__(self, connector: KVPoolConnector) -> None:
        self.connector = connector
        config = connector.config
        plan = connector.plan
        self.backend: Backend = create_backend(config.backend, config.backend_options())
        in_process_pool = config.backend == "memory"
        placements = plan.placements()
        self.tracker: PoolTracker | None = None
        if isinstance(self.backend, MemoryBackend):
            self.tracker = PoolTracker(plan.rank, [p.keys for p in placements], self.backend.keys())
            self.backend.add_listener(self.tracker.dropped)
        self.engine = WorkerEngine(
            self.backend,
            plan.coordinator,
            placements,
            config=WorkerConfig(
                put_batch_chunks=config.put_batch_chunks,
                check_exists_before_put=config.exists_before_put(),
                sync_saves=in_process_pool,
                save_buffer_bytes=config.save_buffer_bytes,
                save_linger_steps=config.save_linger_steps,
                save_linger_s=config.save_linger_ms / 1000,
                sync_loads=in_process_pool,
            ),
            tracker=self.tracker,
        )
        self._invalid_blocks: set[int] = set()
        self._applied: StepMetadata | None = None
        self.metrics = WorkerStatsSampler(self.engine.stats, self.backend, f"tp{plan.tp_rank}-pp{plan.pp_rank}")
        with _LOCAL_LOCK:
            _LOCAL_WORKERS[connector.engine_id] = self

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kv_config = self.connector._kv_cache_config
        layer_groups = {
            name: group for group, spec in enumerate(kv_config.kv_cache_groups) for name in spec.layer_names
        }
        tensors = {name: tensor for name, tensor in kv_caches.items() if name in layer_groups}
        self.engine.register_layout(
            KVLayout(
                tensors,
                layer_groups,
                kv_config.num_blocks,
                integrity=Integrity(self.connector.config.integrity),
                staging_bytes=self.connector.config.save_buffer_bytes,  # device KV: the pinned staging ring
            )
        )

    def before_step(self, step: StepMetadata) -> None:
        self.engine.handle_step(step)

    def apply(self, step: StepMetadata) -> None:
        if self._applied is not step:
            self._applied = step
            self.engine.apply(step.requests)

    def save(self, step: StepMetadata) -> None:
        self.apply(step)
        if any(delta.save_tokens for delta in step.requests):
            # after the forward: device tensors are copied on the current stream, so in order after it
            self.engine.save(step.requests)

    def transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if finished_req_ids:
            self.engine.finish(finished_req_ids)
        results = KVConnectorTransferResults(finished_recving=self.engine.take_finished_loads())
        failures = self.engine.take_load_failures()
        # one full-attention group: vLLM recomputes from the first bad block; any other model: the whole
        # request (block ids are per group, and resuming inside a window needs blocks never loaded)
        self._invalid_blocks |= failures.invalid_blocks
        if failures.failed_requests:
            results.failed_recving = failures.failed_requests
        return results

    def take_invalid_blocks(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def pool_report(self) -> KVPoolWorkerMetadata | None:
        report = self.tracker.take_report() if self.tracker is not None else None
        return KVPoolWorkerMetadata([report]) if report is not None else None

    def close(self) -> None:
        with _LOCAL_LOCK:
            if _LOCAL_WORKERS.get(self.connector.engine_id) is self:
                del _LOCAL_WORKERS[self.connector.engine_id]
        if self.tracker is not None and isinstance(self.backend, MemoryBackend):
            self.backend.remove_listener(self.tracker.dropped)
        self.engine.drain(timeout_s=10.0)
        self.engine.close()
        self.backend.close()


class _SchedulerSide:
    def __init__(self, connector: KVPoolConnector) -> None:
        self.connector = connector
        config = connector.config
        plan = connector.plan
        self.kv_cache_manager: KVCacheManager | None = None
        self.requests: dict[str, Request] = {}
        self._local_tokens: dict[str, int] = {}
        self._pending_loads: dict[str, Request] = {}
        self._loading: dict[str, set[int]] = {}  # request → blocks its pending (async) load writes
        self._loaded_in_step: dict[str, set[int]] = {}  # the same for loads the engine computed on at once
        self._own_backend: Backend | None = None
        self.index: PoolIndex | None = None
        if config.backend == "mooncake":
            # a pool other engines write too: ask it, with a zero-segment client of our own
            options = dict(config.backend_options(), global_segment_size=0)
            self._own_backend = create_backend("mooncake", options)
            exists, healthy = self._own_backend.exists, self._own_backend.healthy
        else:
            # the workers' embedded pools: their reports keep this index, so lookups stay on this thread
            self.index = PoolIndex(plan.lookup_namespaces(), ranks_per_namespace=plan.replicas)
            kv_events = getattr(connector._vllm_config, "kv_events_config", None)
            self.index.track_events = bool(kv_events and kv_events.enable_kv_cache_events)
            exists, healthy = self._no_exists, None
            with _LOCAL_LOCK:
                local = _LOCAL_WORKERS.get(connector.engine_id)
            if local is not None and local.tracker is not None:
                # same process: what the pool already holds (an earlier engine's saves) counts from the first lookup
                report = local.tracker.take_report()
                if report is not None:
                    self.index.apply(report)
        remote = self._own_backend is not None
        # An embedded pool loads in the step that computes on the blocks (vLLM's sync load: no waiting
        # steps) when a failed chunk can be recomputed on its own, i.e. one full-attention group: vLLM then
        # truncates at the first bad block and drops that step's output. Any other model needs the async
        # path, whose failures recompute the whole request before it runs.
        self._loads_in_step = not remote and plan.coordinator.resumes_at_failed_chunk
        self.core = SchedulerEngine(
            plan.coordinator,
            plan.lookup_namespaces(),
            exists,
            SchedulerConfig(
                save_decode=config.save_decode,
                lookup_async=remote if config.lookup_async is None else config.lookup_async,
                lookup_timeout_s=config.lookup_timeout_s,
            ),
            healthy=healthy,
            index=self.index,
        )
        self._block_sizes = [kind.block_size for kind in plan.coordinator.kinds]
        self.metrics = SchedulerStatsSampler(self.core.stats)
        with _LOCAL_LOCK:
            _LOCAL_SCHEDULERS[connector.engine_id] = self

    @staticmethod
    def _no_exists(keys: list[str]) -> list[bool]:
        raise AssertionError("embedded pools are looked up in the index")

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        hit = self.core.lookup(request.request_id, request.block_hashes, request.num_tokens)
        if hit is None:
            return None, False
        self._local_tokens[request.request_id] = num_computed_tokens
        external = max(0, hit - num_computed_tokens)
        # in-step loads (sync for vLLM) skip the steps an async load waits; see _loads_in_step
        return external, external > 0 and not self._loads_in_step

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        req_id = request.request_id
        local = self._local_tokens.get(req_id, 0)
        self.core.on_allocated(
            req_id, request.num_prompt_tokens, local, num_external_tokens, in_step=self._loads_in_step
        )
        self._pending_loads[req_id] = request
        if not self._loads_in_step:
            self._loading[req_id] = set()
        self.requests.setdefault(req_id, request)

    def _table(self, req_id: str, scheduler_output: SchedulerOutput) -> tuple[list[int], ...] | None:
        state = scheduler_output.kv_connector_block_state
        table = state.get_block_ids(req_id) if state is not None else None
        if table is None and self.kv_cache_manager is not None:
            table = self.kv_cache_manager.get_block_ids(req_id)
        return table

    def build_step(self, so: SchedulerOutput) -> StepMetadata:
        """O(what changed): block ids come from the scheduler output, as vLLM's own workers take them
        (a whole table for a request's first step or a resume, else the blocks appended since); only a
        request that starts a load has its table read from the KV cache manager."""
        core = self.core
        step = StepMetadata(reset_epoch=core.reset_epoch)
        for req_id in so.preempted_req_ids or ():
            core.preempt(req_id)
            step.preempted.append(req_id)
            self._loading.pop(req_id, None)
        for req_id, request in self._pending_loads.items():
            table = self._table(req_id, so)
            if table is None:
                continue
            delta = core.request_delta(
                req_id,
                num_prompt_tokens=request.num_prompt_tokens,
                block_hashes=request.block_hashes,
                computed_before=self._local_tokens.get(req_id, 0),
                new_tokens=0,
                new_blocks=table,
                whole_table=True,
            )
            if delta is not None:
                step.requests.append(delta)
                if delta.load is not None:
                    targets = self._load_targets(table, delta.load.start_tokens, delta.load.hit_tokens)
                    (self._loaded_in_step if delta.load.in_step else self._loading)[req_id] = targets
        self._pending_loads.clear()
        spec_tokens = so.scheduled_spec_decode_tokens
        scheduled = so.num_scheduled_tokens
        requests = self.requests
        for new in so.scheduled_new_reqs:
            request = requests.get(new.req_id)
            if request is not None:
                new_tokens = scheduled.get(new.req_id, 0) - len(spec_tokens.get(new.req_id, ()))
                self._add(step, request, new.block_ids, True, new.num_computed_tokens, new_tokens)
        cached = so.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for req_id, blocks, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            if blocks is None and core.quiet(req_id, computed + scheduled.get(req_id, 0)) and req_id not in resumed:
                continue  # most decode steps: nothing to save, no block to add
            request = requests.get(req_id)
            if request is None:
                continue
            whole = req_id in resumed
            if not whole and not core.started(req_id):
                # no step of ours saw it start (not a path vLLM takes today): its workers need the whole table
                blocks, whole = self._table(req_id, so), True
            new_tokens = scheduled.get(req_id, 0) - len(spec_tokens.get(req_id, ()))
            self._add(step, request, blocks, whole, computed, new_tokens)
        return step

    def _add(
        self,
        step: StepMetadata,
        request: Request,
        new_blocks: tuple[list[int], ...] | None,
        whole_table: bool,
        computed_before: int,
        new_tokens: int,
    ) -> None:
        delta = self.core.request_delta(
            request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            block_hashes=request.block_hashes,
            computed_before=computed_before,
            new_tokens=max(0, new_tokens),
            new_blocks=new_blocks,
            whole_table=whole_table,
        )
        if delta is not None:
            step.requests.append(delta)

    def _load_targets(self, table: tuple[list[int], ...], start_tokens: int, hit_tokens: int) -> set[int]:
        """The blocks a load of [start, hit) may write: the invalid ones among them name its request."""
        targets: set[int] = set()
        for blocks, block_size in zip(table, self._block_sizes):
            targets.update(blocks[start_tokens // block_size : -(-hit_tokens // block_size)])
        targets.discard(0)
        return targets

    def absorb(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if self.index is not None and isinstance(meta, KVPoolWorkerMetadata):
            for report in meta.reports:
                self.index.apply(report)
        invalid = output.invalid_block_ids or set()
        failed = output.failed_recving or set()
        if invalid or failed:
            for loads in (self._loading, self._loaded_in_step):
                for req_id, targets in loads.items():
                    if req_id in failed or not targets.isdisjoint(invalid):
                        self.core.mark_load_failed(req_id)
        for req_id in output.finished_recving or ():
            self._loading.pop(req_id, None)
        self._loaded_in_step.clear()  # in-step loads report failures in their own step's output, or never

    def finished(self, request: Request) -> bool:
        """True (vLLM keeps the blocks) only while a load still writes them: vLLM frees them once the
        load is reported in finished_recving. Saves never hold blocks: they copy out within their step."""
        req_id = request.request_id
        self.requests.pop(req_id, None)
        self._local_tokens.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        self.core.finish(req_id)
        return self._loading.pop(req_id, None) is not None

    def reset(self) -> bool:
        """Lookups miss from now on; the workers empty their pools at their next step, before its loads,
        dropping every save taken before (see WorkerEngine.reset). A shared pool is emptied now too."""
        self.core.reset()
        try:
            if self._own_backend is not None:
                self._own_backend.clear()
            return True
        except Exception:
            log.exception("could not empty the pool")
            return False

    def take_events(self) -> list[KVCacheEvent]:
        if self.index is None or not self.index.track_events:
            return []
        return [self._event(event) for event in self.index.take_events()]

    def _event(self, event: PoolEvent) -> KVCacheEvent:
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        block_hash = maybe_convert_block_hash(event.chunk_hash)
        if not event.stored:
            return BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_CPU, group_idx=event.group)
        return BlockStored(
            block_hashes=[block_hash],
            parent_block_hash=None,
            token_ids=[],
            block_size=self._block_sizes[event.group],
            lora_id=None,
            medium=MEDIUM_CPU,
            lora_name=None,
            group_idx=event.group,
        )

    def close(self) -> None:
        with _LOCAL_LOCK:
            if _LOCAL_SCHEDULERS.get(self.connector.engine_id) is self:
                del _LOCAL_SCHEDULERS[self.connector.engine_id]
        self.core.close()
        if self._own_backend is not None:
            self._own_backend.close()


def local_worker(engine_id: str | None = None) -> WorkerEngine | None:
    """The in-process worker engine (tests, demo): by engine id, or the only one."""
    side = _only(_LOCAL_WORKERS, engine_id)
    return side.engine if side is not None else None


def local_scheduler(engine_id: str | None = None) -> SchedulerEngine | None:
    """The in-process scheduler engine (tests, demo): by engine id, or the only one."""
    side = _only(_LOCAL_SCHEDULERS, engine_id)
    return side.core if side is not None else None


def _only(registry: dict[str, Any], engine_id: str | None) -> Any:
    with _LOCAL_LOCK:
        if engine_id is not None:
            return registry.get(engine_id)
        return next(iter(registry.values())) if len(registry) == 1 else None
