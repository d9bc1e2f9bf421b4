"""The worker role of kvpool's vLLM connector: vLLM's KV tensors and per-step hooks, translated for
the worker core (`kvpool.worker.worker_core.WorkerCore`), and its results translated back.

Invariants: a step's metadata reaches the core's `apply` once, whichever of vLLM's hooks (start of
the load, end of the forward) hands it over first; saves run after the forward, so device tensors
are read in order after it; block ids that failed to load are held until vLLM asks for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvpool.connector import registry
from kvpool.connector.roles import worker_role
from kvpool.core.config import Integrity, KVPoolConfig
from kvpool.core.errors import LayoutError
from kvpool.core.metadata import StepMetadata
from kvpool.core.plan import ModelPlan
from kvpool.integrations.vllm.metadata import KVPoolWorkerMetadata
from kvpool.integrations.vllm.metrics import WorkerStatsSampler
from kvpool.worker.layout import KVLayout

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


def state_pages(name: str, tensor: torch.Tensor | list[torch.Tensor], num_blocks: int) -> torch.Tensor:
    """A state (Mamba) layer's blocks as whole pages, (num_blocks, page bytes) uint8: vLLM views each
    state of a block (conv, ssm) inside a page padded to the attention page, so the block's bytes are
    one page, copied whole (the padding is never read by the engine)."""
    pieces = list(tensor) if isinstance(tensor, (list, tuple)) else [tensor]
    element = pieces[0].element_size()
    page = pieces[0].stride(0) * element
    base = min(piece.storage_offset() * piece.element_size() for piece in pieces)
    storage = pieces[0].untyped_storage()
    if (
        any(
            piece.stride(0) * piece.element_size() != page or piece.untyped_storage().data_ptr() != storage.data_ptr()
            for piece in pieces
        )
        or base + num_blocks * page > storage.nbytes()
    ):
        raise LayoutError(f"state layer {name!r}: its blocks are not pages of one buffer; kvpool cannot copy them")
    flat = torch.empty(0, dtype=torch.uint8, device=pieces[0].device).set_(storage)
    return flat.as_strided((num_blocks, page), (page, 1), base)


class WorkerSide:
    """The worker connector's calls, translated for its core (`WorkerCore`)."""

    def __init__(
        self,
        config: KVPoolConfig,
        plan: ModelPlan,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
        *,
        report_puts: bool = False,
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.kv_cache_config = kv_cache_config
        self.role = worker_role(config, plan, report_puts=report_puts)
        self.core = self.role.core
        self.tracker = self.role.tracker
        self._invalid_blocks: set[int] = set()
        self._applied: StepMetadata | None = None
        self.metrics = WorkerStatsSampler(self.core.stats, self.role.backend, f"tp{plan.tp_rank}-pp{plan.pp_rank}")
        registry.register_worker(engine_id, self)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        kv_config = self.kv_cache_config
        layer_groups = {
            name: group for group, spec in enumerate(kv_config.kv_cache_groups) for name in spec.layer_names
        }
        state_groups = {
            group for group, spec in enumerate(kv_config.kv_cache_groups) if hasattr(spec.kv_cache_spec, "shapes")
        }
        tensors = {
            name: state_pages(name, tensor, kv_config.num_blocks) if layer_groups[name] in state_groups else tensor
            for name, tensor in kv_caches.items()
            if name in layer_groups
        }
        self.core.register_layout(
            KVLayout(
                tensors,
                layer_groups,
                kv_config.num_blocks,
                integrity=Integrity(self.config.integrity),
                staging_bytes=self.config.save_buffer_bytes,  # device KV: the pinned staging ring
            )
        )

    def before_step(self, step: StepMetadata) -> None:
        self.core.handle_step(step)

    def apply(self, step: StepMetadata) -> None:
        if self._applied is not step:
            self._applied = step
            self.core.apply(step.requests)

    def save(self, step: StepMetadata) -> None:
        self.apply(step)
        if any(delta.save_tokens or delta.states for delta in step.requests):
            # after the forward: device tensors are copied on the current stream, so in order after it
            self.core.save(step.requests)

    def transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if finished_req_ids:
            self.core.finish(finished_req_ids)
        results = KVConnectorTransferResults(finished_recving=self.core.take_finished_loads())
        failures = self.core.take_load_failures()
        # vLLM asks for the invalid blocks in a call of its own, after this one
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
        registry.unregister_worker(self.engine_id, self)
        self.role.close()
