"""`explain` for a prompt on a live in-process vLLM engine with kvpool: the engine's own block hasher
(model, LoRA, cache salt, hash seed: exactly what its requests get) and its scheduler connector's
lookup presence, without running a step or touching the pool."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm import LLM, SamplingParams
from vllm.v1.request import Request

from kvpool.explain import Explanation, explain
from kvpool.integrations.vllm import local_scheduler


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


def explain_with_engine(
    model: str | Path, token_ids: Sequence[int], kvpool_config: Mapping[str, Any], **engine_args: Any
) -> Explanation:
    """Build an in-process CPU engine for `model` with kvpool configured as `kvpool_config`, explain, stop it."""
    from kvpool.testing.engine import engine

    transfer = {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": dict(kvpool_config),
    }
    with engine(model, kv_transfer_config=transfer, **engine_args) as llm:
        return explain_prompt(llm, token_ids)
