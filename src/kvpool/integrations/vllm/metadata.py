"""What kvpool's connector roles send each other through vLLM: the scheduler's step metadata to the
workers, and the workers' pool reports back.

Invariants: both pickle (vLLM sends them across processes every step), and `aggregate` builds a new
object holding the reports of both sides in order, never changing either (vLLM folds the ranks'
metadata left to right).
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from kvpool.core.metadata import StepMetadata
from kvpool.core.pool_reports import PoolReport


class KVPoolMetadata(KVConnectorMetadata):
    """Scheduler -> workers, every step: the core's step metadata."""

    def __init__(self, step: StepMetadata) -> None:
        self.step = step


class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, every step: what the ranks' embedded pools gained and lost."""

    def __init__(self, reports: list[PoolReport]) -> None:
        self.reports = reports

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVPoolWorkerMetadata)
        return KVPoolWorkerMetadata(self.reports + other.reports)
