"""The load path of one worker rank, stage after stage: the hit's chunks → read → retire → report.

`start` takes the chunks of a hit from the planner (`SavePlanner.load_chunks`: the request's keys and
blocks), and the `Loader` reads them into the engine's blocks (in the caller's thread for an
in-process pool, on its own threads for a remote one). When a load ends, `_retire` lowers the
request's marks to its first failed chunk (`SavePlanner.load_failed`), so what the pool did not give
back is saved again. `take_failures` reports what failed in the form the engine recomputes from.

Thread-safety: planner calls hold the worker's one lock, shared with the save path.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.backends.base import Backend
from kvpool.core.chunks import ChunkRef
from kvpool.core.config import DEFAULT_LOAD_DEADLINE_S
from kvpool.worker.layout import KVLayout
from kvpool.worker.loader import Loader
from kvpool.worker.save_plan import SavePlanner
from kvpool.worker.stats import WorkerStats

log = logging.getLogger("kvpool.worker")


@dataclass(frozen=True)
class LoadFailures:
    """What to tell the engine about failed loads: blocks to recompute from, or requests to redo."""

    invalid_blocks: set[int]
    failed_requests: set[str]


class LoadPath:
    """The stages of a rank's loads, called in order by `start` (engine thread) and the loader's end."""

    def __init__(
        self,
        planner: SavePlanner,
        lock: threading.Lock,
        backend: Backend,
        layout: Callable[[], KVLayout | None],
        stats: WorkerStats,
        *,
        batch_chunks: int,
        sync: bool,
        deadline_s: float = DEFAULT_LOAD_DEADLINE_S,
    ) -> None:
        self.planner = planner
        self.stats = stats
        self._lock = lock
        self._in_step_invalid: set[int] = set()  # blocks an in-step load did not fill (a broken contract)
        self.loader = Loader(
            backend, layout, stats, batch_chunks, sync=sync, on_done=self._retire, deadline_s=deadline_s
        )

    def start(self, req_id: str, start_tokens: int, hit_tokens: int, in_step: bool = False) -> None:
        with self._lock:
            chunks = self.planner.load_chunks(req_id, start_tokens, hit_tokens)
        if in_step:
            self._start_in_step(req_id, chunks)
            return
        if chunks is None:
            log.error("request %s: a load for a request this worker holds no table of; reported failed", req_id)
            self.loader.fail(req_id)
            return
        items, missing = chunks
        self.loader.start(req_id, items, missing)

    def _start_in_step(self, req_id: str, chunks: tuple[list[ChunkRef], list[ChunkRef]] | None) -> None:
        """A contract hit: loaded now, before the forward. It cannot fail while the contract holds; if it
        does, its blocks are reported invalid (vLLM recomputes a running request from the first one: one
        full-attention group only takes in-step loads) and counted as a broken contract."""
        if chunks is None:
            log.error("request %s: an in-step load for a request this worker holds no table of", req_id)
            self.stats.in_step_load_failures += 1
            return
        failed = self.loader.load_in_step(req_id, *chunks)
        self.stats.loads_in_step += 1
        if failed:
            log.error("request %s: %d chunks of its in-step load did not load (a broken contract)", req_id, len(failed))
            self.stats.in_step_load_failures += 1
            self._in_step_invalid.update(item.block_id for item in failed if item.block_id)

    def fail(self, req_id: str) -> None:
        """The scheduler could not arm this request's load: it is reported failed."""
        self.loader.fail(req_id)

    def _retire(self, req_id: str, failed: list[ChunkRef]) -> None:
        """A load ended; the chunks from the first failed one on are not in the pool: save them again."""
        if not failed:
            return
        with self._lock:
            self.planner.load_failed(req_id, failed)

    def take_finished(self) -> set[str]:
        return self.loader.take_finished()

    def take_failures(self) -> LoadFailures:
        failed = self.loader.take_failed()
        blocks, self._in_step_invalid = self._in_step_invalid, set()
        if not failed:
            return LoadFailures(blocks, set())
        requests: set[str] = set()
        for req_id, items in failed.items():
            if items and self.planner.coordinator.resumes_at_failed_chunk:
                blocks.update(item.block_id for item in items)
            else:
                requests.add(req_id)
        return LoadFailures(blocks, requests)
