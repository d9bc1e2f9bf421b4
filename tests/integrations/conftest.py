from __future__ import annotations

import os
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

pytest.importorskip("vllm")

from kvpool.backends.shared_pools import drop_shared_memory_pools, shared_memory_pool
from kvpool.testing.models import default_model_dir, make_tiny_model

BLOCK = 64


@pytest.fixture(scope="session")
def model_dir() -> Any:
    def build(kind: str) -> Path:
        return make_tiny_model(kind, default_model_dir() / kind)

    return build


@pytest.fixture
def pool_name() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:8]}"
    yield name
    drop_shared_memory_pools()


def connector_config(pool_name: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"pool_name": pool_name, "capacity_bytes": "256MiB", **extra},
    }


def random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(count)]


def damage(value: Any) -> Any:
    """A copy of a stored chunk with every other 4 KiB page inverted: damage a transfer or a bad page of
    memory leaves, big enough to change the outputs of an engine that used it."""
    import numpy as np

    damaged = np.array(value, dtype=np.uint8, copy=True).reshape(-1)
    for start in range(0, damaged.size - 8, 2 * 4096):  # the seal (last 8 bytes) is left as it was
        damaged[start : min(start + 4096, damaged.size - 8)] ^= 0xFF
    return damaged


def damage_pool(pool_name: str) -> int:
    """Damage every chunk of the embedded pool (see `damage`); how many there were."""
    pool = shared_memory_pool(pool_name, 256 << 20)
    keys = pool.keys()
    for key in keys:
        stored = pool._items[key]  # the pool's own memory, as bit rot would find it
        stored[:] = damage(stored)
    return len(keys)


def poison_pool(pool_name: str, *, resize: bool = False) -> int:
    """Overwrite every stored chunk with random bytes (or bytes of the wrong size)."""
    import numpy as np

    pool = shared_memory_pool(pool_name, 256 << 20)
    rng = np.random.default_rng(0)
    keys = pool.keys()
    for key in keys:
        size = pool.nbytes_of(key) or 1
        pool.remove([key])
        value = rng.integers(0, 255, size=1 if resize else size, dtype=np.uint8)
        pool.put([key], [[value]])
    return len(keys)
