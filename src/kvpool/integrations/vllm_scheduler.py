"""The scheduler role of kvpool's vLLM connector: vLLM's requests and scheduler output, translated
for the scheduler core (`kvpool.scheduler.SchedulerCore`) into one step's metadata for the workers;
the workers' output translated back into the core's failed loads and the index's reports.

Invariants: a step's metadata costs O(what changed): block ids come from the scheduler output, and
only a request that starts a load has its whole table read from the KV cache manager. A request's
lookup remembers the tokens vLLM computed itself, so its load starts there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.config import KVPoolConfig
from kvpool.index import PoolEvent
from kvpool.integrations import registry
from kvpool.integrations.vllm_metadata import KVPoolWorkerMetadata
from kvpool.integrations.vllm_metrics import SchedulerStatsSampler
from kvpool.load_watch import LoadWatch
from kvpool.metadata import StepMetadata
from kvpool.plan import ModelPlan
from kvpool.roles import scheduler_role

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class SchedulerSide:
    """The scheduler connector's calls, translated for its core (`SchedulerCore`)."""

    def __init__(self, config: KVPoolConfig, plan: ModelPlan, engine_id: str, vllm_config: VllmConfig) -> None:
        self.engine_id = engine_id
        self.kv_cache_manager: KVCacheManager | None = None
        self.requests: dict[str, Request] = {}
        self._local_tokens: dict[str, int] = {}  # request → tokens vLLM had computed itself at its lookup
        self._pending_loads: dict[str, Request] = {}  # loads allocated, not yet in a step's metadata
        kv_events = getattr(vllm_config, "kv_events_config", None)
        local = registry.worker_entry(engine_id)
        self.role = scheduler_role(
            config,
            plan,
            track_events=bool(kv_events and kv_events.enable_kv_cache_events),
            local_tracker=local.tracker if local is not None else None,
        )
        self.core = self.role.core
        self.index = self.role.index
        self._own_backend = self.role.backend
        self._block_sizes = [kind.block_size for kind in plan.coordinator.kinds]
        self._loads = LoadWatch(self._block_sizes, in_step=self.role.loads_in_step)
        self.metrics = SchedulerStatsSampler(self.core.stats)
        registry.register_scheduler(engine_id, self)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        hit = self.core.lookup(request.request_id, request.block_hashes, request.num_tokens)
        if hit is None:
            return None, False
        self._local_tokens[request.request_id] = num_computed_tokens
        return self._loads.offer(hit, num_computed_tokens)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        req_id = request.request_id
        local = self._local_tokens.get(req_id, 0)
        self.core.on_allocated(
            req_id, request.num_prompt_tokens, local, num_external_tokens, in_step=self._loads.in_step
        )
        self._pending_loads[req_id] = request
        self._loads.allocated(req_id)
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
            self._loads.preempted(req_id)
        for req_id, pending in self._pending_loads.items():
            table = self._table(req_id, so)
            if table is None:
                continue
            delta = core.request_delta(
                req_id,
                num_prompt_tokens=pending.num_prompt_tokens,
                block_hashes=pending.block_hashes,
                computed_before=self._local_tokens.get(req_id, 0),
                new_tokens=0,
                new_blocks=table,
                whole_table=True,
            )
            if delta is not None:
                step.requests.append(delta)
                if delta.load is not None:
                    self._loads.started(req_id, table, delta.load)
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

    def absorb(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if self.index is not None and isinstance(meta, KVPoolWorkerMetadata):
            for report in meta.reports:
                self.index.apply(report)
        failed = self._loads.absorb(
            output.invalid_block_ids or set(), output.failed_recving or set(), output.finished_recving or ()
        )
        for req_id in failed:
            self.core.mark_load_failed(req_id)

    def finished(self, request: Request) -> bool:
        """True (vLLM keeps the blocks) only while a load still writes them: vLLM frees them once the
        load is reported in finished_recving. Saves never hold blocks: they copy out within their step."""
        req_id = request.request_id
        self.requests.pop(req_id, None)
        self._local_tokens.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        self.core.finish(req_id)
        return self._loads.finish(req_id)

    def reset(self) -> bool:
        return self.role.reset()

    def take_events(self) -> list[KVCacheEvent]:
        if self.index is None or not self.index.track_events:
            return []
        return [self._event(event) for event in self.index.take_events()]

    def _event(self, event: PoolEvent) -> KVCacheEvent:
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

        block_hash = maybe_convert_block_hash(BlockHash(event.chunk_hash))
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
        registry.unregister_scheduler(self.engine_id, self)
        self.role.close()
