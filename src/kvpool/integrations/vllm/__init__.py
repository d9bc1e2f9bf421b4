"""The vLLM adapter: `KVPoolConnector` (`kv_connector_module_path: "kvpool.integrations.vllm"`).

Translation only: vLLM's configs become the core's plain facts (`plan.py`), scheduler output becomes
per-step deltas and worker hooks become worker calls (`scheduler.py`, `worker.py`, each around the
role `kvpool.connector` builds), the connector metadata crosses processes (`metadata.py`), stats reach
`/metrics` (`metrics.py`). What it decides lives below it, where it is testable without vLLM.
May import: vLLM, and every part of kvpool except `ops`, `benchmarks` and `testing`.
"""

from kvpool.connector.registry import _LOCAL_SCHEDULERS, _LOCAL_WORKERS, local_scheduler, local_worker
from kvpool.integrations.vllm.connector import KVPoolConnector
from kvpool.integrations.vllm.metadata import KVPoolMetadata, KVPoolWorkerMetadata
from kvpool.integrations.vllm.plan import group_spec, plan_model, spec_facts, weights_digest

__all__ = [
    "_LOCAL_SCHEDULERS",
    "_LOCAL_WORKERS",
    "KVPoolConnector",
    "KVPoolMetadata",
    "KVPoolWorkerMetadata",
    "group_spec",
    "local_scheduler",
    "local_worker",
    "plan_model",
    "spec_facts",
    "weights_digest",
]
