"""vLLM's own scheduler-side objects driven step by step, for benches of a KV connector's per-step cost.

One `Workload` is a cell's engine state: a real `KVCacheManager` and `BlockPool`, real `Request`s
whose block hashes grow through vLLM's block hasher, vLLM-layout CPU KV tensors shrunk to 1 KV head
of `HEAD_SIZE` and two layers, and each step's `SchedulerOutput` built as vLLM's scheduler builds it
(`allocate_slots` gives the step's `new_block_ids`; `KVConnectorBlockState` resolves tables through
the manager's own `get_block_ids`).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np
import torch

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEAD_SIZE = 4
LOOKUP_TIMEOUT_S = 10.0


class ConnectorPair(Protocol):
    """A connector's two roles, as one engine holds them."""

    scheduler: Any
    worker: Any

    def drain(self, timeout_s: float) -> None: ...
    def stored(self, hashes: list[bytes]) -> int: ...
    def close(self) -> None: ...


class Workload:
    """One cell's engine state: a real KVCacheManager, real Requests, vLLM-layout CPU KV tensors."""

    def __init__(self, vllm_config: Any, block_size: int, context: int, requests: int, max_steps: int, seed: int):
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        self.block_size = block_size
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=HEAD_SIZE, dtype=torch.bfloat16)
        total = context + max_steps + 1  # tokens a request reaches (max_steps: every step the cell runs)
        num_blocks = requests * (-(-total // block_size) + 1) + 1  # block 0 is vLLM's null block
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)]
        )
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.manager = KVCacheManager(
            self.kv_cache_config, max_model_len=total, scheduler_block_size=block_size, hash_block_size=block_size
        )
        self.kv_caches = {
            name: torch.zeros((num_blocks, 1, block_size, 2 * HEAD_SIZE), dtype=torch.bfloat16) for name in LAYERS
        }
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(block_size, hash_fn)
        rng = np.random.default_rng(seed)
        params = SamplingParams(max_tokens=total)
        self.requests = [
            Request(
                f"req-{seed}-{r}",
                rng.integers(3, 250, size=context - r * block_size // requests).tolist(),
                params,
                None,
                cache_salt=f"{seed}-{r}",
                block_hasher=hasher,
            )
            for r in range(requests)
        ]
        self.saved_from = [0] * requests

    def admit(self, pair: ConnectorPair) -> Any:
        """A waiting request's path through vLLM's scheduler, for every request; the prefill's output."""
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData

        new_reqs = []
        for request in self.requests:
            pair.scheduler.on_new_request(request)
            computed, num_computed, _ = self.manager.get_computed_blocks(request)
            deadline = time.monotonic() + LOOKUP_TIMEOUT_S
            while (matched := pair.scheduler.get_num_new_matched_tokens(request, num_computed))[0] is None:
                if time.monotonic() > deadline:  # an async lookup: vLLM asks again next step
                    raise TimeoutError(f"no lookup answer for {request.request_id}")
                time.sleep(0.001)
            external = matched[0] or 0
            blocks = self.manager.allocate_slots(
                request,
                request.num_tokens - num_computed - external,
                num_new_computed_tokens=num_computed,
                new_computed_blocks=computed,
                num_external_computed_tokens=external,
            )
            assert blocks is not None, "the KV cache was sized for every request"
            pair.scheduler.update_state_after_alloc(request, self.manager.get_blocks(request.request_id), external)
            new_reqs.append(NewRequestData.from_request(request, blocks.get_block_ids()))
        scheduled = {r.request_id: r.num_tokens - r.num_computed_tokens for r in self.requests}
        return self._output(new_reqs, CachedRequestData.make_empty(), scheduled)

    def schedule(self) -> Any:
        """One decode step's SchedulerOutput: a token per request, blocks allocated as vLLM does."""
        from vllm.v1.core.sched.output import CachedRequestData

        new_block_ids = []
        for request in self.requests:
            blocks = self.manager.allocate_slots(request, 1)
            assert blocks is not None
            new_block_ids.append(blocks.get_block_ids(allow_none=True))
        cached = CachedRequestData(
            req_ids=[r.request_id for r in self.requests],
            resumed_req_ids=set(),
            new_token_ids=[],
            all_token_ids={},
            new_block_ids=new_block_ids,
            num_computed_tokens=[r.num_computed_tokens for r in self.requests],
            num_output_tokens=[r.num_output_tokens for r in self.requests],
        )
        return self._output([], cached, {r.request_id: 1 for r in self.requests})

    def _output(self, new_reqs: list[Any], cached: Any, scheduled: dict[str, int]) -> Any:
        from vllm.v1.core.sched.output import KVConnectorBlockState, SchedulerOutput

        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            finished_req_ids=set(),
            free_encoder_mm_hashes=[],
            kv_connector_block_state=KVConnectorBlockState(
                req_ids=set(scheduled), resolve_block_ids=self.manager.get_block_ids, boundary_state_offloads={}
            ),
        )

    def advance(self, output: Any) -> None:
        """After the model step: computed tokens move on and each request samples one token."""
        for request in self.requests:
            request.num_computed_tokens += output.num_scheduled_tokens[request.request_id]
            request.append_output_token_ids(int(request.num_tokens % 200) + 3)

    def mark_saved(self) -> None:
        self.saved_from = [len(r.block_hashes) for r in self.requests]

    def hashes_since_mark(self) -> list[bytes]:
        """Block hashes of the blocks whose KV was computed since `mark_saved` (the decode steps)."""
        out: list[bytes] = []
        for request, first in zip(self.requests, self.saved_from):
            out.extend(request.block_hashes[first : request.num_computed_tokens // self.block_size])
        return out
