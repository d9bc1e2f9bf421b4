from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.backends.tiered import TieredPool
from kvpool.worker.worker_core import WorkerCore


@pytest.fixture
def closing() -> Iterator[list[WorkerCore]]:
    """Worker engines a test starts; closed at its end."""
    engines: list[WorkerCore] = []
    yield engines
    for engine in engines:
        engine.close()


@pytest.fixture
def pools() -> Iterator[list[TieredPool]]:
    """Tiered pools a test starts; shut down at its end."""
    made: list[TieredPool] = []
    yield made
    for pool in made:
        pool.shutdown(5.0)
