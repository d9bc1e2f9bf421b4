"""The in-process connector registry: exact lookups by engine id, the only one without, and a closing
connector never removes the newer one that replaced it. No engine needed."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvpool.connector import registry


@dataclass(eq=False)
class Side:
    core: Any
    tracker: Any = None


@pytest.fixture(autouse=True)
def empty_registry() -> Iterator[None]:
    saved = dict(registry._LOCAL_WORKERS), dict(registry._LOCAL_SCHEDULERS)
    registry._LOCAL_WORKERS.clear()
    registry._LOCAL_SCHEDULERS.clear()
    yield
    registry._LOCAL_WORKERS.clear()
    registry._LOCAL_SCHEDULERS.clear()
    registry._LOCAL_WORKERS.update(saved[0])
    registry._LOCAL_SCHEDULERS.update(saved[1])


def test_lookups_by_engine_id_are_exact_and_without_one_answer_the_only_one() -> None:
    assert registry.local_worker() is None and registry.local_scheduler() is None
    registry.register_worker("a", Side("worker-a"))
    registry.register_scheduler("a", Side("scheduler-a"))
    assert (registry.local_worker(), registry.local_scheduler()) == ("worker-a", "scheduler-a")
    registry.register_worker("b", Side("worker-b"))
    assert registry.local_worker() is None  # several: none is "the" worker
    assert (registry.local_worker("a"), registry.local_worker("b"), registry.local_worker("c")) == (
        "worker-a",
        "worker-b",
        None,
    )
    assert registry.local_scheduler("b") is None


def test_a_closing_connector_removes_only_itself() -> None:
    old, new = Side("old"), Side("new")
    registry.register_worker("e", old)
    registry.register_worker("e", new)  # the engine id's newer connector replaces the older
    registry.unregister_worker("e", old)
    assert registry.worker_entry("e") is new
    registry.unregister_worker("e", new)
    assert registry.worker_entry("e") is None
    scheduler = Side("s")
    registry.register_scheduler("e", scheduler)
    registry.unregister_scheduler("e", Side("other"))
    assert registry.local_scheduler("e") == "s"
    registry.unregister_scheduler("e", scheduler)
    assert registry.local_scheduler("e") is None


def test_the_adapter_re_exports_the_registry() -> None:
    vllm_adapter = pytest.importorskip("kvpool.integrations.vllm")
    assert vllm_adapter._LOCAL_SCHEDULERS is registry._LOCAL_SCHEDULERS
    assert vllm_adapter._LOCAL_WORKERS is registry._LOCAL_WORKERS
    assert vllm_adapter.local_worker is registry.local_worker
    assert vllm_adapter.local_scheduler is registry.local_scheduler
