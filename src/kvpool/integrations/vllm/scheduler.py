"""The scheduler role of kvpool's vLLM connector: vLLM's requests and scheduler output, translated
for the scheduler core (`kvpool.scheduler.scheduler_core.SchedulerCore`) into one step's metadata for the workers;
the workers' output translated back into the core's failed loads and the index's reports.

Invariants: a step's metadata costs O(what changed): block ids come from the scheduler output, and
only a request that starts a load has its whole table read from the KV cache manager. The policy
(which loads are armed, in which step, preemptions and re-admissions) is `SchedulerSteps`'.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvpool.connector import registry
from kvpool.connector.roles import scheduler_role
from kvpool.core.config import KVPoolConfig
from kvpool.core.metadata import StepMetadata
from kvpool.core.plan import ModelPlan
from kvpool.core.pool_reports import PoolEvent
from kvpool.integrations.vllm.metadata import KVPoolWorkerMetadata
from kvpool.integrations.vllm.metrics import SchedulerStatsSampler
from kvpool.scheduler.chunk_origins import ChunkOrigins
from kvpool.scheduler.hit_tiers import disk_tokens
from kvpool.scheduler.steps import SchedulerSteps
from kvpool.worker.pool_tracker import PoolTracker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


LOCAL = "LOCAL"  # vLLM's `locality`: the bytes are on this engine's host
REMOTE = "REMOTE"
DISK_MEDIUM = "DISK"  # an embedded pool's chunk that some rank holds on its disk tier only

log = logging.getLogger("kvpool.scheduler")


class SchedulerSide:
    """The scheduler connector's calls, translated for its core (`SchedulerSteps` around `SchedulerCore`)."""

    def __init__(self, config: KVPoolConfig, plan: ModelPlan, engine_id: str, vllm_config: VllmConfig) -> None:
        self.engine_id = engine_id
        self.kv_cache_manager: KVCacheManager | None = None
        self.requests: dict[str, Request] = {}
        kv_events = getattr(vllm_config, "kv_events_config", None)
        local = registry.worker_entry(engine_id)
        self.role = scheduler_role(
            config,
            plan,
            track_events=bool(kv_events and kv_events.enable_kv_cache_events),
            local_tracker=local.tracker if local is not None and isinstance(local.tracker, PoolTracker) else None,
        )
        self.core = self.role.core
        self.steps = SchedulerSteps(self.core)
        self.index = self.role.index
        self.remote_events = self.role.events  # a shared pool's KV events: from what the workers put
        self._own_backend = self.role.backend
        self._block_sizes = [kind.block_size for kind in plan.coordinator.kinds]
        # each stored chunk's event carries its tokens and extra keys, recorded as steps complete it
        publishing = self.remote_events is not None or (self.index is not None and self.index.track_events)
        self.origins = ChunkOrigins(plan.coordinator) if publishing else None
        # where the bytes are: the embedded pool in this engine's memory; a shared pool's storage, in this
        # engine's own segment only when it gives the pool memory (a setting, never asked per chunk)
        self._medium, self._locality = ("CPU", LOCAL) if config.backend == "memory" else ("STORAGE", _locality(config))
        self._group_kinds: list[tuple[str | None, int | None]] = [(None, None)] * len(self._block_sizes)
        self._pool_source, self._disk_source = _hit_sources(config)
        self.metrics = SchedulerStatsSampler(self.core.stats)
        registry.register_scheduler(engine_id, self)

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.steps.matched(request.request_id, request.block_hashes, request.num_tokens, num_computed_tokens)

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """vLLM's split of a request's pool hit by the tier that supplies it (asked once per admitted hit,
        after `after_alloc` armed its load): the embedded pool's DRAM or a shared pool, and the tokens
        whose chunks some rank reads from its disk tier (`kvpool.scheduler.hit_tiers`)."""
        if num_external_tokens <= 0:
            return {}
        disk = 0
        load = self.core.armed_load(request.request_id)
        if self.index is not None and load is not None:
            hashes, start, end = request.block_hashes, load.start_tokens, load.hit_tokens
            disk = min(num_external_tokens, disk_tokens(self.core.coordinator, self.index, hashes, start, end))
        sources: dict[Any, int] = {}
        if num_external_tokens > disk:
            sources[self._pool_source] = num_external_tokens - disk
        if disk:
            sources[self._disk_source] = disk
        return sources

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        self.steps.allocated(request.request_id, request.num_prompt_tokens, request.block_hashes, num_external_tokens)
        self.requests.setdefault(request.request_id, request)

    def build_step(self, so: SchedulerOutput) -> StepMetadata:
        """O(what changed): block ids come from the scheduler output, as vLLM's own workers take them
        (a whole table for a request's first step or a resume, else the blocks appended since); only a
        request that starts a load has its table read from the KV cache manager."""
        state = so.kv_connector_block_state
        manager = self.kv_cache_manager

        def table(req_id: str) -> tuple[list[int], ...] | None:
            blocks = state.get_block_ids(req_id) if state is not None else None
            if blocks is None and manager is not None:
                blocks = manager.get_block_ids(req_id)
            return blocks

        core, steps = self.core, self.steps
        step = steps.begin(so.preempted_req_ids or (), table)
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
                blocks, whole = table(req_id), True
            new_tokens = scheduled.get(req_id, 0) - len(spec_tokens.get(req_id, ()))
            self._add(step, request, blocks, whole, computed, new_tokens)
        offloads = state.boundary_state_offloads if state is not None else None
        for req_id, offers in (offloads or {}).items():
            # Mamba "align" states at exact boundaries, in blocks valid until this step ends
            request = requests.get(req_id)
            if request is not None:
                steps.states(step, req_id, offers, request.block_hashes)
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
        self.steps.add(
            step,
            request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            block_hashes=request.block_hashes,
            new_blocks=new_blocks,
            whole_table=whole_table,
            computed_before=computed_before,
            new_tokens=new_tokens,
        )
        if self.origins is not None:
            self.origins.record(
                request.block_hashes, request.all_token_ids, computed_before, new_tokens, _extra_keys(request)
            )

    def absorb(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if meta is not None and isinstance(meta, KVPoolWorkerMetadata):  # most steps carry no report
            for report in meta.reports:
                if self.index is not None:
                    self.index.apply(report)
                elif self.remote_events is not None:
                    self.remote_events.apply(report)
        self.steps.absorb(
            output.invalid_block_ids or set(), output.failed_recving or set(), output.finished_recving or ()
        )

    def finished(self, request: Request) -> bool:
        """True (vLLM keeps the blocks) only while a load still writes them: vLLM frees them once the
        load is reported in finished_recving. Saves never hold blocks: they copy out within their step."""
        self.requests.pop(request.request_id, None)
        return self.steps.finished(request.request_id)

    def reset(self) -> bool:
        """`reset_prefix_cache(reset_connector=True)`, which calls this right after the KV cache manager's
        own reset, on the same thread. That reset succeeds only when no block is held (vLLM's
        `BlockPool.reset_prefix_cache`: every block free but the null one); a refused one leaves them
        held. kvpool follows vLLM's decision: while requests hold blocks it keeps its pools and returns
        False (the caller retries once they finished), so a pool is never emptied under requests that
        still read or save it."""
        if not _engine_cache_reset(self.kv_cache_manager):
            log.warning("reset_prefix_cache(reset_connector=True) refused by vLLM (blocks held): the pool is kept")
            return False
        if self.origins is not None:
            self.origins.clear()
        return self.role.reset()

    def weights_changed(self, tag: str) -> None:
        """vLLM is about to change the engine's weights in place (`weights.watch_engine_core`): `tag` names
        the new ones in every key from the next step on."""
        log.info("kvpool: the engine's weights change in place; keys now name weights %r", tag)
        if self.origins is not None:
            self.origins.clear()
        self.role.change_weights(tag)

    def describe_groups(self, kv_cache_config: KVCacheConfig) -> None:
        """Each group's spec kind and window, as vLLM's own events and its OffloadingConnector's name them:
        a consumer tells a sliding-window or state group's blocks from a contiguous prefix."""
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

        self._group_kinds = [
            (get_kv_cache_spec_kind(group.kv_cache_spec).value, get_kv_cache_spec_sliding_window(group.kv_cache_spec))
            for group in kv_cache_config.kv_cache_groups
        ]

    def take_events(self) -> list[KVCacheEvent]:
        if self.remote_events is not None:
            return [self._event(event) for event in self.remote_events.take_events()]
        if self.index is None or not self.index.track_events:
            return []
        return [self._event(event) for event in self.index.take_events()]

    def _event(self, event: PoolEvent) -> KVCacheEvent:
        """A pool's chunk as vLLM's own event names a block: where it is (the embedded pool: medium CPU,
        local, or DISK while some rank holds it on its disk tier only; a shared pool: STORAGE), its
        parent, tokens and extra keys (the tokens only while the record of the step that computed it
        lasts: see `kvpool.scheduler.chunk_origins`), its group's spec kind and window."""
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash, to_event_extra_keys

        block_hash = maybe_convert_block_hash(BlockHash(event.chunk_hash))
        medium = DISK_MEDIUM if event.on_disk else self._medium
        if not event.stored:
            return BlockRemoved(
                block_hashes=[block_hash], medium=medium, group_idx=event.group, locality=self._locality
            )
        origin = self.origins.take(event.group, event.chunk_hash) if self.origins is not None else None
        kind, window = self._group_kinds[event.group]
        return BlockStored(
            block_hashes=[block_hash],
            parent_block_hash=maybe_convert_block_hash(BlockHash(event.parent)) if event.parent else None,
            token_ids=list(origin.token_ids) if origin is not None else [],
            block_size=self._block_sizes[event.group],
            lora_id=None,
            medium=medium,
            lora_name=_lora_name(origin.extra_keys) if origin is not None else None,
            extra_keys=to_event_extra_keys([origin.extra_keys]) if origin is not None and origin.extra_keys else None,
            group_idx=event.group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            locality=self._locality,
        )

    def close(self) -> None:
        registry.unregister_scheduler(self.engine_id, self)
        self.role.close()


def _extra_keys(request: Request) -> Callable[[int, int], tuple[object, ...] | None] | None:
    """The extra keys vLLM hashes a block of this request with, by token range; None when it hashes none
    (no LoRA, multimodal input, cache salt or prompt embeddings: most requests)."""
    if not (request.lora_request or request.mm_features or request.cache_salt or request.prompt_embeds is not None):
        return None
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    return lambda start, end: generate_block_hash_extra_keys(request, start, end, 0)[0]


def _engine_cache_reset(manager: KVCacheManager | None) -> bool:
    """Did the KV cache manager's reset just succeed? It does iff each of its block pools holds no block
    but the null one, and nothing runs between that reset and the connector's. No manager bound (a
    vLLM that does not bind it): True, the pool is reset as asked."""
    if manager is None:
        return True
    pools = {id(m.block_pool): m.block_pool for m in manager.coordinator.single_type_managers}
    return all(pool.num_gpu_blocks - pool.get_num_free_blocks() <= 1 for pool in pools.values())


def _lora_name(extra_keys: tuple[object, ...] | None) -> str | None:
    """vLLM's events name the LoRA beside the keys; in the keys it is the ("lora", name) entry."""
    for key in extra_keys or ():
        if isinstance(key, tuple) and len(key) == 2 and key[0] == "lora" and isinstance(key[1], str):
            return key[1]
    return None


def _hit_sources(config: KVPoolConfig) -> tuple[Any, Any]:
    """vLLM's names (`CacheHitSource`) for a hit from the pool and from the disk tier. The embedded pool
    is this engine's host DRAM ("host"). A shared Mooncake pool is a remote store: its objects sit in
    some client's segment (this engine's, another's, a segment holder's), which a lookup never learns,
    and vLLM's enum names a remote store "external_unspecified" (so does vLLM's own Mooncake store
    connector); "p2p" is KV sent by another vLLM instance, which a pool is not."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:  # a vLLM without per-source hit metrics: nothing asks
        return ("host" if config.backend == "memory" else "external_unspecified"), "disk"
    pool = CacheHitSource.HOST if config.backend == "memory" else CacheHitSource.EXTERNAL_UNSPECIFIED
    return pool, CacheHitSource.DISK


def _locality(config: KVPoolConfig) -> str:
    """A shared pool's chunks are local to this engine only if it gives the pool a segment of its own
    memory: Mooncake places each object in some segment, so with one it may be here or not (a router's
    hint either way); without one (the standalone segment holder), never."""
    from kvpool.core.mooncake_options import MooncakeOptions

    return LOCAL if MooncakeOptions.parse(config.backend_options()).global_segment_size > 0 else REMOTE
