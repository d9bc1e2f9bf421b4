"""The save sender: one thread that puts captured save batches into a remote pool, in order.

A batch reaches the sender only as host memory the worker owns (captured inside the engine step),
so the sender never touches the engine's blocks and may run as late as it likes. Memory is bounded
by `buffer_bytes`: a batch that does not fit beside the ones queued is refused, and the worker
re-plans its range later (one batch is always taken when nothing is queued, so a step larger than
the buffer is still saved).
When the pool answers "full", the batches queued behind that put are dropped instead of hammering a
pool with no room; the next put that succeeds ends the pressure.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

log = logging.getLogger("kvpool.sender")


class Batch(Protocol):
    seq: int
    nbytes: int


B = TypeVar("B", bound=Batch)


class Sender(Generic[B]):
    """Runs `store(batch)` for each submitted batch on its own thread; `drop(batch)` for batches it
    skips (pressure, close). Both are called exactly once per accepted batch."""

    def __init__(
        self,
        store: Callable[[B], None],
        drop: Callable[[B], None],
        buffer_bytes: int,
        name: str = "kvpool-sender",
    ) -> None:
        self._store = store
        self._drop = drop
        self.buffer_bytes = buffer_bytes
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: queue.Queue[B | None] = queue.Queue()
        self._buffered = 0
        self._in_flight = 0
        self._dropped_through = -1  # queued batches up to this seq are dropped (pool pressure)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, batch: B) -> bool:
        """Queue the batch; False (nothing queued) when its bytes do not fit beside the queued ones."""
        with self._lock:
            if self._closed or (self._buffered and self._buffered + batch.nbytes > self.buffer_bytes):
                return False
            self._buffered += batch.nbytes
            self._in_flight += 1
        self._queue.put(batch)
        return True

    def drop_queued(self, through_seq: int) -> None:
        """Batches with seq <= through_seq that have not started are dropped, not stored."""
        with self._lock:
            self._dropped_through = max(self._dropped_through, through_seq)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every accepted batch is done; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(min(remaining, 0.05))
        return True

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            with self._lock:
                skip = batch.seq <= self._dropped_through
            try:
                if skip:
                    self._drop(batch)
                else:
                    self._store(batch)
            except Exception:
                log.exception("save batch %d failed", batch.seq)
            finally:
                with self._idle:
                    self._buffered -= batch.nbytes
                    self._in_flight -= 1
                    self._idle.notify_all()
