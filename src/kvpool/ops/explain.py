"""`kvpool explain` with an engine of its own: build an in-process CPU engine with kvpool, ask where a
prompt would hit (`kvpool.integrations.vllm.explain`), stop the engine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpool.integrations.vllm.explain import explain_prompt
from kvpool.scheduler.explain import Explanation


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
