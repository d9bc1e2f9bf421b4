"""kvpool: a KV-cache pool for LLM serving (incremental store, hybrid-attention masks, embedded or
Mooncake pool). The vLLM connector is `kvpool.integrations.vllm.KVPoolConnector`; the core below
imports neither vLLM nor Mooncake."""

from kvpool.backends.base import Backend, BackendStats, Rows, Status
from kvpool.backends.factory import create_backend
from kvpool.backends.memory import MemoryBackend, shared_memory_pool
from kvpool.chunks import process_tokens
from kvpool.config import KVPoolConfig
from kvpool.errors import (
    BackendError,
    BackendUnavailableError,
    ConfigError,
    KVPoolError,
    LayoutError,
)
from kvpool.keys import ChunkHashes, KeySpace, LayoutFingerprint, chunk_hashes
from kvpool.layout import KVLayout
from kvpool.masks import AttentionKind, ChunkedLocal, FullAttention, MaskCoordinator, SlidingWindow, StateSpace
from kvpool.metadata import LoadSpec, RequestDelta, StepMetadata
from kvpool.plan import GroupPlacement
from kvpool.scheduler import SchedulerConfig, SchedulerCore
from kvpool.worker import WorkerConfig, WorkerCore

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
