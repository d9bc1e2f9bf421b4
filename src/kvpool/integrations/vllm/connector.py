"""vLLM KV connector. Load it with

    --kv-transfer-config '{"kv_connector": "KVPoolConnector",
                           "kv_connector_module_path": "kvpool.integrations.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

A thin adapter: it turns vLLM's requests, block tables, KV cache config and tensors into the core's
plain data and back, and holds no pool logic. This module dispatches vLLM's hooks to the connector's
role: `scheduler.SchedulerSide` or `worker.WorkerSide`, each around its core. The plan both
roles share is read from vLLM's configs by `plan` and built by `kvpool.core.plan`; what each role runs
is `kvpool.connector.roles`'. Invariant: a connector has exactly one role, and a call for the other role fails
loudly instead of reaching a core it does not have.
"""

from __future__ import annotations

import logging
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

from kvpool.core.config import KVPoolConfig
from kvpool.core.metadata import StepMetadata
from kvpool.integrations.vllm.metadata import KVPoolMetadata
from kvpool.integrations.vllm.metrics import KVPoolPromMetrics, KVPoolStats
from kvpool.integrations.vllm.plan import plan_model
from kvpool.integrations.vllm.scheduler import SchedulerSide
from kvpool.integrations.vllm.weights import watch_engine_core
from kvpool.integrations.vllm.worker import WorkerSide

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

# re-exported where they were: the in-process registry (tests, the demo, `explain`), the plan readers

log = logging.getLogger("kvpool.vllm")


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    """kvpool as a vLLM KV connector (scheduler and worker roles)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config  # vLLM's base class refuses a config without one
        self.config = KVPoolConfig.from_dict(transfer.kv_connector_extra_config)
        self.engine_id = transfer.engine_id or "default"
        if self.config.load_failure_policy == "recompute" and transfer.kv_load_failure_policy != "recompute":
            # a pool is a cache: a chunk that cannot be loaded is recomputed, never a failed request
            log.info("kvpool sets kv_load_failure_policy=recompute (load_failure_policy=engine keeps vLLM's)")
            transfer.kv_load_failure_policy = "recompute"
        self.plan = plan_model(vllm_config, kv_cache_config, self.config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.config, self.plan, self.engine_id, vllm_config)
            self._scheduler.describe_groups(kv_cache_config)
            watch_engine_core()  # in-place weight changes reach `weights_changed` before they run
        else:
            events = getattr(vllm_config, "kv_events_config", None)
            self._worker = WorkerSide(
                self.config,
                self.plan,
                self.engine_id,
                kv_cache_config,
                report_puts=bool(events and events.enable_kv_cache_events),
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, never an error

    # ---- sleep mode (vLLM 0.33's contract; vLLM 0.32 asks none of it) ---------------------------

    @classmethod
    def supports_sleep_mode(cls, *args: Any, **kwargs: Any) -> bool:
        """False: vLLM refuses sleep mode with kvpool (`--enable-sleep-mode`). Sleep unmaps the KV cache
        (and weights) under kvpool's Mooncake memory registrations, its device staging and any save
        or load in flight, and a wake-up may bring other weights, whose keys would still find what the
        old ones stored. (Any arguments: vLLM versions differ on whether the config is passed.)"""
        return False

    def unregister_kv_caches(self) -> None:
        _refuse_sleep("unregister_kv_caches")

    def release_kv_caches(self) -> None:  # the same hook under the name some vLLM versions call it
        _refuse_sleep("release_kv_caches")

    def restore_kv_caches(self) -> None:
        _refuse_sleep("restore_kv_caches")

    # ---- worker role ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert type(kv_connector_metadata) is KVPoolMetadata  # not isinstance: an ABC's check, every step
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
        assert type(meta) is KVPoolMetadata  # twice a step: isinstance against vLLM's ABC costs several times more
        return meta.step

    @property
    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("worker-side call on the scheduler connector")
        return self._worker

    @property
    def _scheduler_side(self) -> SchedulerSide:
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

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """vLLM's `prompt_tokens_cached_by_source`: host (the embedded pool's DRAM), disk (its disk tier),
        external_unspecified (a Mooncake pool: a remote store). Keys are vLLM's `CacheHitSource`."""
        return self._scheduler_side.hit_sources(request, num_external_tokens)

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

    def weights_changed(self, tag: str) -> None:
        """Called by kvpool's wrap of vLLM's engine core before a call that may change the weights."""
        self._scheduler_side.weights_changed(tag)

    def take_events(self) -> list[KVCacheEvent]:
        return self._scheduler_side.take_events()

    # ---- stats (both roles) → vLLM's /metrics and stats log; see kvpool.integrations.vllm.metrics

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


def _refuse_sleep(hook: str) -> None:
    """Reached only by a vLLM that ignored `supports_sleep_mode() == False`: stopping the sleep is safer
    than letting the pool's registrations and staging outlive the memory under them."""
    raise RuntimeError(
        f"kvpool: vLLM called {hook}() for sleep mode, which kvpool does not support "
        "(supports_sleep_mode() is False); run the engine without --enable-sleep-mode"
    )
