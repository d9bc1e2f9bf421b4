"""Fakes for the worker tests: a recording backend with scripted faults, and a fake engine model
(numpy KV tensors, key spaces, a block allocator) whose block bytes are named by their chunk."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.backends.base import BackendStats, Status, Value
from kvpool.backends.memory import MemoryBackend
from kvpool.core.keys import KeySpace, LayoutFingerprint, chunk_hashes
from kvpool.core.masks import AttentionKind, FullAttention, MaskCoordinator
from kvpool.core.metadata import RequestDelta
from kvpool.core.plan import GroupPlacement
from kvpool.worker.layout import KVLayout
from kvpool.worker.worker_core import WorkerConfig, WorkerCore

LAYERS = 2
BLOCK_BYTES = 8  # per layer: chunk values are LAYERS * BLOCK_BYTES bytes
POISON = 0xEE

class RecordingBackend:
    """A MemoryBackend that records every key passed to exists and put, with scripted faults."""

    name = "recording"

    def __init__(self, inner: MemoryBackend | None = None) -> None:
        self.inner = inner or MemoryBackend(64 << 20)
        self._lock = threading.Lock()
        self.exists_keys: list[str] = []
        self.put_keys: list[str] = []
        self.put_calls = 0
        self.put_statuses: list[Status | None] = []  # next put calls answer this for every key
        self.gate: threading.Event | None = None  # puts wait for it (while not None)
        self.put_entered = threading.Event()
        self.put_delay_s = 0.0
        self.get_calls = 0
        self.get_raises_on: set[int] = set()  # 1-based get_into call numbers that raise
        self.is_healthy = True

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            self.exists_keys.extend(keys)
        return self.inner.exists(keys)

    def put(self, keys: Sequence[str], values: Sequence[Value]) -> list[Status]:
        with self._lock:
            self.put_keys.extend(keys)
            self.put_calls += 1
            scripted = self.put_statuses.pop(0) if self.put_statuses else None
        self.put_entered.set()
        gate = self.gate
        if gate is not None:
            assert gate.wait(10), "test gate never opened"
        if self.put_delay_s:
            time.sleep(self.put_delay_s)
        if scripted is not None:
            return [scripted] * len(keys)
        return self.inner.put(keys, values)

    def get_into(self, keys: Sequence[str], dests: Sequence[Value]) -> list[Status]:
        with self._lock:
            self.get_calls += 1
            call = self.get_calls
        if call in self.get_raises_on:
            raise ConnectionError("scripted get failure")
        return self.inner.get_into(keys, dests)

    def remove(self, keys: Sequence[str]) -> int:
        return self.inner.remove(keys)

    def clear(self) -> int:
        return self.inner.clear()

    def stats(self) -> BackendStats:
        return self.inner.stats()

    def healthy(self) -> bool:
        return self.is_healthy

    def close(self) -> None:
        self.inner.close()

    def stored(self, key: str, size: int) -> bytes | None:
        dest = np.zeros(size, dtype=np.uint8)
        status = self.inner.get_into([key], [[dest]])
        return dest.tobytes() if status[0] is Status.OK else None


def block_content(tag: str, layer: int) -> np.ndarray:
    return np.frombuffer(hashlib.blake2b(f"{tag}/{layer}".encode(), digest_size=BLOCK_BYTES).digest(), np.uint8)


class FakeModel:
    """Engine-side state for a model: KV tensors (numpy), per-group key spaces, a block allocator."""

    def __init__(self, kinds: Sequence[AttentionKind], retention: int | None = None, num_blocks: int = 512) -> None:
        self.coord = MaskCoordinator(kinds, retention_interval=retention)
        self.h = self.coord.hash_block_size
        self.tensors = {
            f"g{g}.l{layer}": np.zeros((num_blocks, BLOCK_BYTES), dtype=np.uint8)
            for g in range(len(kinds))
            for layer in range(LAYERS)
        }
        groups = {name: int(name[1 : name.index(".")]) for name in self.tensors}
        self.layout = KVLayout(self.tensors, groups, num_blocks)
        self.spaces = [
            KeySpace(LayoutFingerprint("test/model", "uint8", kind.block_size, "numpy", group_id=g))
            for g, kind in enumerate(kinds)
        ]
        self.num_blocks = num_blocks
        self.next_block = 1

    @property
    def kinds(self) -> list[AttentionKind]:
        return self.coord.kinds

    def hashes(self, prefix: str, tokens: int) -> list[bytes]:
        return [hashlib.blake2b(f"{prefix}:{i}".encode(), digest_size=16).digest() for i in range(tokens // self.h)]

    def allocate(self, count: int) -> list[int]:
        if self.next_block + count > self.num_blocks:
            self.next_block = 1  # wrap: tests that need distinct blocks stay well below num_blocks
        ids = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        return ids

    def tables(self, tokens: int) -> tuple[list[int], ...]:
        return tuple(self.allocate(-(-tokens // kind.block_size)) for kind in self.kinds)

    def write(self, group: int, block_id: int, tag: str) -> None:
        for layer in range(LAYERS):
            self.tensors[f"g{group}.l{layer}"][block_id] = block_content(tag, layer)

    def poison(self, block_id: int) -> None:
        for tensor in self.tensors.values():
            tensor[block_id] = POISON

    def read(self, group: int, block_id: int) -> bytes:
        return b"".join(self.tensors[f"g{group}.l{layer}"][block_id].tobytes() for layer in range(LAYERS))

    def fill(self, prefix: str, tables: tuple[list[int], ...], hashes: list[bytes]) -> dict[str, bytes]:
        """Write every block with content named by its chunk; return key → expected bytes."""
        expected = {}
        for group, (kind, table) in enumerate(zip(self.kinds, tables)):
            named = chunk_hashes(hashes, self.h, kind.block_size)
            for chunk, block_id in enumerate(table):
                if block_id == 0:
                    continue
                tag = f"{prefix}/{group}/{chunk}"
                self.write(group, block_id, tag)
                if chunk < len(named):
                    expected[self.spaces[group].key(named[chunk])] = b"".join(
                        block_content(tag, layer).tobytes() for layer in range(LAYERS)
                    )
        return expected

    def engine(
        self, backend: Any, put_step: int = 1, rank: int = 0, config: WorkerConfig | None = None
    ) -> WorkerCore:
        placements = [GroupPlacement(space, put_step, (rank + g) % put_step) for g, space in enumerate(self.spaces)]
        return WorkerCore(backend, self.coord, placements, self.layout, config)

    def key(self, group: int, hashes: list[bytes], chunk: int) -> str:
        return self.spaces[group].key(chunk_hashes(hashes, self.h, self.kinds[group].block_size)[chunk])


def start(engine: WorkerCore, req: str, hashes: list[bytes], tables: tuple[list[int], ...], prompt: int = 0) -> None:
    engine.apply([RequestDelta(req, new_hashes=list(hashes), new_blocks=tables, num_prompt_tokens=prompt or 1 << 20)])


def simple(
    closing: list[WorkerCore], config: WorkerConfig | None = None, kinds: Sequence[AttentionKind] | None = None
) -> tuple[FakeModel, RecordingBackend, WorkerCore]:
    model = FakeModel(kinds or [FullAttention(16)])
    backend = RecordingBackend()
    engine = model.engine(backend, config=config)
    closing.append(engine)
    return model, backend, engine


def add_request(model: FakeModel, engine: WorkerCore, req: str, tokens: int) -> tuple[list[bytes], tuple, dict]:  # type: ignore[type-arg]
    hashes = model.hashes(req, tokens)
    tables = model.tables(tokens)
    expected = model.fill(req, tables, hashes)
    start(engine, req, hashes, tables)
    return hashes, tables, expected

