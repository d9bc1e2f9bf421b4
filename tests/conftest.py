from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.worker import WorkerEngine


@pytest.fixture
def closing() -> Iterator[list[WorkerEngine]]:
    """Worker engines a test starts; closed at its end."""
    engines: list[WorkerEngine] = []
    yield engines
    for engine in engines:
        engine.close()
