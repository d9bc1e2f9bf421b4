"""The connectors running in this process, by engine id. Tests, the demo and `explain` reach an
in-process engine's kvpool cores through them, and a scheduler connector finds its engine's worker
connector when both share the process (its embedded pool's contents count from the first lookup).

Invariants:
- A connector registers itself when built and unregisters only itself when closed: closing an
  older connector of an engine id never removes the newer one that replaced it.
- A lookup by engine id is exact; without one it answers the only connector of its role, and None
  when there is none or there are several.
- One lock guards both maps: engines start and stop on threads of their own.
- No engine is imported: a connector is anything holding its role's core.
"""

from __future__ import annotations

import threading
from typing import Protocol, TypeVar

from kvpool.scheduler.scheduler_core import SchedulerCore
from kvpool.worker.pool_tracker import PoolTracker, PutTracker
from kvpool.worker.worker_core import WorkerCore


class WorkerEntry(Protocol):
    """A worker connector: its core, and its embedded pool's tracker (a shared pool's: of its puts, or None)."""

    core: WorkerCore
    tracker: PoolTracker | PutTracker | None


class SchedulerEntry(Protocol):
    core: SchedulerCore


Entry = TypeVar("Entry", WorkerEntry, SchedulerEntry)

_LOCAL_WORKERS: dict[str, WorkerEntry] = {}
_LOCAL_SCHEDULERS: dict[str, SchedulerEntry] = {}
_LOCAL_LOCK = threading.Lock()


def register_worker(engine_id: str, entry: WorkerEntry) -> None:
    with _LOCAL_LOCK:
        _LOCAL_WORKERS[engine_id] = entry


def register_scheduler(engine_id: str, entry: SchedulerEntry) -> None:
    with _LOCAL_LOCK:
        _LOCAL_SCHEDULERS[engine_id] = entry


def unregister_worker(engine_id: str, entry: WorkerEntry) -> None:
    _unregister(_LOCAL_WORKERS, engine_id, entry)


def unregister_scheduler(engine_id: str, entry: SchedulerEntry) -> None:
    _unregister(_LOCAL_SCHEDULERS, engine_id, entry)


def _unregister(registry: dict[str, Entry], engine_id: str, entry: Entry) -> None:
    with _LOCAL_LOCK:
        if registry.get(engine_id) is entry:
            del registry[engine_id]


def worker_entry(engine_id: str) -> WorkerEntry | None:
    """This process's worker connector of the engine `engine_id`, if any."""
    with _LOCAL_LOCK:
        return _LOCAL_WORKERS.get(engine_id)


def local_worker(engine_id: str | None = None) -> WorkerCore | None:
    """The in-process worker core (tests, demo): by engine id, or the only one."""
    entry = _only(_LOCAL_WORKERS, engine_id)
    return entry.core if entry is not None else None


def local_scheduler(engine_id: str | None = None) -> SchedulerCore | None:
    """The in-process scheduler core (tests, demo): by engine id, or the only one."""
    entry = _only(_LOCAL_SCHEDULERS, engine_id)
    return entry.core if entry is not None else None


def _only(registry: dict[str, Entry], engine_id: str | None) -> Entry | None:
    with _LOCAL_LOCK:
        if engine_id is not None:
            return registry.get(engine_id)
        return next(iter(registry.values())) if len(registry) == 1 else None
