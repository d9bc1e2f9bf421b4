"""The save sender: one thread that puts captured save batches into a remote pool, in order.

A batch reaches the sender only as host memory the worker owns (captured inside the engine step),
so the sender never touches the engine's blocks and may run as late as it likes. Memory is bounded
by `buffer_bytes`: a batch that does not fit beside the ones queued is refused, and the worker
re-plans its range later (one batch is always taken when nothing is queued, so a step larger than
the buffer is still saved).

Small batches are coalesced: a remote put has a fixed cost far above its per-chunk cost (Mooncake:
~175 µs of client CPU for a put of one small chunk, ~300 µs for 16), and a decode step usually
completes a chunk or two. So the sender holds what is queued until it is worth a call (`enough`),
for at most `linger_steps` calls of `step` (one per worker save; vLLM's adapter makes no save call in
a step that gives the worker nothing to save, so there these are saving steps) and `linger_s`
seconds (an engine that stops stepping still gets its last chunks stored), or until `drain` or
`close` asks for everything. Each call stores the batches taken together (`store(batches)`).

When the pool answers "full", the batches queued behind that put are still put: they hold the newest
chunks, a pool that evicts in the background (Mooncake) may have room for them, and one that has none
refuses a put at once (Mooncake: ~20 µs). Whatever fails is retired as failed and re-planned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

log = logging.getLogger("kvpool.sender")


class Batch(Protocol):
    seq: int
    nbytes: int

    def __len__(self) -> int: ...


B = TypeVar("B", bound=Batch)
T = TypeVar("T")


class Sender(Generic[B]):
    """Runs `store(batches)` on its own thread for the batches it takes together, in submission order;
    each accepted batch reaches it exactly once."""

    def __init__(
        self,
        store: Callable[[list[B]], None],
        buffer_bytes: int,
        name: str = "kvpool-sender",
        *,
        enough_chunks: int = 64,
        enough_bytes: int = 4 << 20,
        linger_steps: int = 0,
        linger_s: float = 0.0,
    ) -> None:
        self._store = store
        self.buffer_bytes = buffer_bytes
        self.enough_chunks = enough_chunks  # a call of this many chunks, or bytes, is not held back
        self.enough_bytes = enough_bytes
        self.linger_steps = linger_steps
        self.linger_s = linger_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the sender thread waits here
        self._idle = threading.Condition(self._lock)  # drain waits here
        self._queued: deque[B] = deque()
        self._queued_chunks = 0
        self._queued_bytes = 0
        self._buffered = 0
        self._in_flight = 0
        self._step = 0
        self._held_since = (0, 0.0)  # engine step and time the oldest queued batch came
        self._flush = 0  # drains waiting: send what is queued at once
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def has_room(self, nbytes: int) -> bool:
        """Whether a batch of `nbytes` would be queued now (only the submitting thread adds bytes)."""
        with self._lock:
            return not self._closed and not (self._buffered and self._buffered + nbytes > self.buffer_bytes)

    def submit(self, batch: B) -> bool:
        """Queue the batch; False (nothing queued) when its bytes do not fit beside the queued ones."""
        with self._lock:
            if self._closed or (self._buffered and self._buffered + batch.nbytes > self.buffer_bytes):
                return False
            self._buffered += batch.nbytes
            self._in_flight += 1
            first = not self._queued
            if first:  # the linger counts from the oldest batch held
                self._held_since = (self._step, time.monotonic())
            self._queued.append(batch)
            self._queued_chunks += len(batch)
            self._queued_bytes += batch.nbytes
            # a wake-up is a thread switch: only when the thread waits for a first batch (to start its
            # linger), or when this batch ends the linger; a thread in its linger wakes when it ends anyway
            if first or self._queued_chunks >= self.enough_chunks or self._queued_bytes >= self.enough_bytes:
                self._wake.notify()
        return True

    def step(self) -> None:
        """A save went by (once per engine step that saves): batches held for `linger_steps` of them go."""
        if self.linger_steps:
            with self._lock:
                self._step += 1
                if self._queued and self._step - self._held_since[0] == self.linger_steps:
                    self._wake.notify()  # only when it ends a linger: a wake-up is a thread switch

    def drain(self, timeout_s: float) -> bool:
        """Send what is queued now, and wait until every accepted batch is done; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._flush += 1
            self._wake.notify()
            try:
                while self._in_flight:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self._idle.wait(min(remaining, 0.05))
            finally:
                self._flush -= 1
        return True

    @property
    def buffered_bytes(self) -> int:
        return self._buffered

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout_s)

    def _ready(self, first_step: int, give_up_at: float) -> bool:
        return bool(
            self._closed
            or self._flush
            or self._queued_chunks >= self.enough_chunks
            or self._queued_bytes >= self.enough_bytes
            or self._step - first_step >= self.linger_steps
            or time.monotonic() >= give_up_at
        )

    def _take(self) -> list[B] | None:
        """Under the lock: wait for batches worth a call; None once closed and empty."""
        while not self._queued:
            if self._closed:
                return None
            self._wake.wait()
        first_step, first_at = self._held_since
        give_up_at = first_at + self.linger_s
        while not self._ready(first_step, give_up_at):
            self._wake.wait(max(0.0, give_up_at - time.monotonic()))
        taken = list(self._queued)
        self._queued.clear()
        self._queued_chunks = self._queued_bytes = 0
        return taken

    def _run(self) -> None:
        while True:
            with self._lock:
                taken = self._take()
                if taken is None:
                    return
            try:
                self._safely(self._store, taken)
            finally:
                self._done(taken)

    @staticmethod
    def _safely(call: Callable[[T], None], arg: T) -> None:
        """One call for the batches taken: what it raises is logged, and the batches after them still get
        theirs (each accepted batch reaches store once, or its ranges stay in flight forever)."""
        try:
            call(arg)
        except Exception:
            log.exception("the save sender's %s failed", getattr(call, "__name__", "call"))

    def _done(self, batches: Sequence[B]) -> None:
        with self._lock:
            self._buffered -= sum(batch.nbytes for batch in batches)
            self._in_flight -= len(batches)
            self._idle.notify_all()
