"""`explain` for a prompt on a live in-process vLLM engine with kvpool: the engine's own block hasher
(model, LoRA, cache salt, hash seed: exactly what its requests get) and its scheduler connector's
lookup presence, without running a step or touching the pool."""

from __future__ import annotations

from collections.abc import Sequence

from vllm import LLM, SamplingParams
from vllm.v1.request import Request

from kvpool.integrations.vllm import local_scheduler
from kvpool.scheduler.explain import Explanation, explain


def explain_prompt(llm: LLM, token_ids: Sequence[int]) -> Explanation:
    """Where this engine's next request with `token_ids` would hit the pool, and why it stops there."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    scheduler = local_scheduler()
    if core is None or scheduler is None:
        raise RuntimeError(
            "explain needs an in-process engine running kvpool (VLLM_ENABLE_V1_MULTIPROCESSING=0 and the "
            "KVPoolConnector as its kv_connector)"
        )
    request = Request(
        "kvpool-explain",
        list(token_ids),
        SamplingParams(max_tokens=1),
        None,
        block_hasher=core.request_block_hasher,
    )
    return explain(scheduler, request.block_hashes, len(token_ids))
