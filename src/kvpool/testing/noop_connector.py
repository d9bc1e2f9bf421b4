"""A vLLM KV connector that does nothing: what vLLM's own connector machinery costs a request.

`kvpool bench serve-overhead` runs it beside kvpool, so kvpool's share of a request's latency can be
told apart from what any connector costs (vLLM routes every step's output through its KV-connector
aggregation once a connector is configured). Load it with
``{"kv_connector": "NoopConnector", "kv_connector_module_path": "kvpool.testing.noop_connector"}``.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, SupportsHMA


class NoopConnector(KVConnectorBase_V1, SupportsHMA):
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return False, None
