"""kvpool: a KV-cache pool for LLM serving (incremental store, hybrid-attention masks, embedded or
Mooncake pool). The vLLM connector is `kvpool.integrations.vllm.KVPoolConnector`; the core below
imports neither vLLM nor Mooncake."""

from kvpool.backends.base import Backend, BackendStats, Rows, Status
from kvpool.backends.factory import create_backend
from kvpool.backends.memory import MemoryBackend
from kvpool.backends.shared_pools import shared_memory_pool
from kvpool.core.chunks import process_tokens
from kvpool.core.config import KVPoolConfig
from kvpool.core.errors import (
    BackendError,
    BackendUnavailableError,
    ConfigError,
    KVPoolError,
    LayoutError,
)
from kvpool.core.keys import ChunkHashes, KeySpace, LayoutFingerprint, chunk_hashes
from kvpool.core.masks import AttentionKind, ChunkedLocal, FullAttention, MaskCoordinator, SlidingWindow, StateSpace
from kvpool.core.metadata import LoadSpec, RequestDelta, StepMetadata
from kvpool.core.plan import GroupPlacement
from kvpool.scheduler.scheduler_core import SchedulerConfig, SchedulerCore
from kvpool.worker.layout import KVLayout
from kvpool.worker.worker_core import WorkerConfig, WorkerCore

__version__ = "0.1.0"

__all__ = [
    "AttentionKind",
    "Backend",
    "BackendError",
    "BackendStats",
    "BackendUnavailableError",
    "ChunkHashes",
    "ChunkedLocal",
    "ConfigError",
    "FullAttention",
    "GroupPlacement",
    "KVLayout",
    "KVPoolConfig",
    "KVPoolError",
    "KeySpace",
    "LayoutError",
    "LayoutFingerprint",
    "LoadSpec",
    "MaskCoordinator",
    "MemoryBackend",
    "RequestDelta",
    "Rows",
    "SchedulerConfig",
    "SchedulerCore",
    "SlidingWindow",
    "StateSpace",
    "Status",
    "StepMetadata",
    "WorkerConfig",
    "WorkerCore",
    "chunk_hashes",
    "create_backend",
    "process_tokens",
    "shared_memory_pool",
]
