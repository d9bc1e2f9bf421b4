from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.worker.worker_core import WorkerCore


@pytest.fixture
def closing() -> Iterator[list[WorkerCore]]:
    """Worker engines a test starts; closed at its end."""
    engines: list[WorkerCore] = []
    yield engines
    for engine in engines:
        engine.close()
