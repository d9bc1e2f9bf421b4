"""Rings of slots over buffers allocated once: pinned host memory and device memory.

- `StagingRing` (host): slots taken at the head, each reused only once it and every older slot are
  back (a slot goes back when the last array over it is freed: the copier holds it until its copy is
  done). It refuses (None) while in-flight slots fill it; it never waits. Its lock is re-entrant: a
  slot's finalizer can run in any allocation, including one made under the lock.
- `DeviceRing` (device): slots each free again once the event it was given has happened. It never
  refuses: with no room, the stream that will write the new slot waits on the device (never the host)
  for the oldest slots' events, so a batch larger than the buffer goes in segments reusing it in turn.
  A slot must be given its event (`free_after`) before the ring is asked for another slot: callers
  sharing a ring across threads hold one lock from `take` to `free_after` (device_copy does).

Slot starts are aligned to `ALIGN` bytes (int64 index views and coalesced device copies need it).
Imports: cuda_runtime (types) and errors only.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from kvpool.core.errors import LayoutError
from kvpool.worker.cuda_runtime import Event, Runtime

ALIGN = 256  # slot starts, in bytes: int64 index views and coalesced device copies need alignment


def align(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ALIGN."""
    return -(-int(nbytes) // ALIGN) * ALIGN


def _place(slots: deque[list[Any]], head: int, capacity: int, nbytes: int) -> int | None:
    """Where a slot of `nbytes` goes in a ring whose slots still out are `slots` (oldest first)."""
    if not slots:
        return 0
    tail = slots[0][0]  # the oldest slot still out
    if slots[-1][0] >= tail:  # not wrapped: free is [head, capacity) and [0, tail)
        if head + nbytes <= capacity:
            return head
        return 0 if nbytes <= tail else None
    return head if head + nbytes <= tail else None  # wrapped: free is [head, tail)


class StagingRing:
    """Slots of one host buffer, taken at the head, reused once every older slot is back.

    The lock is re-entrant: a slot goes back when its array is freed, and a finalizer can run in any
    allocation, including one made while this thread holds the lock."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer  # a 1-D uint8 tensor (pinned on CUDA)
        self.capacity = int(buffer.numel())
        self._lock = threading.RLock()
        self._slots: deque[list[Any]] = deque()  # [start, end, returned] in the order taken
        self._head = 0

    def take(self, nbytes: int, setting: str = "save_buffer_bytes") -> tuple[int, Any] | None:
        """(start, 1-D view of nbytes) or None while in-flight slots fill the ring."""
        if nbytes > self.capacity:
            raise LayoutError(
                f"a batch of {nbytes} bytes does not fit the {self.capacity}-byte host staging ring "
                f"({setting}): raise {setting}, or lower put_batch_chunks"
            )
        with self._lock:
            start = _place(self._slots, self._head, self.capacity, nbytes)
            if start is None:
                return None
            self._slots.append([start, start + nbytes, 0])
            self._head = align(start + nbytes)
        return start, self.buffer[start : start + nbytes]

    def give_back(self, start: int) -> None:
        with self._lock:
            for slot in self._slots:
                if slot[0] == start and not slot[2]:
                    slot[2] = 1
                    break
            while self._slots and self._slots[0][2]:
                self._slots.popleft()
            if not self._slots:
                self._head = 0

    @property
    def in_use(self) -> int:
        with self._lock:
            return sum(end - start for start, end, returned in self._slots if not returned)


class DeviceRing:
    """Slots of one device buffer, each free again once the event it was given has happened. It never
    refuses: with no room, the stream that will write the new slot waits (on the device) for the oldest
    slots' events, so a batch larger than the buffer goes in segments that reuse it in turn."""

    def __init__(self, runtime: Runtime, nbytes: int) -> None:
        self.runtime = runtime
        self.capacity = align(max(ALIGN, nbytes))
        self.buffer = runtime.device_buffer(self.capacity)
        self._lock = threading.RLock()
        self._slots: deque[list[Any]] = deque()  # [start, end, event or None] in the order taken
        self._head = 0
        self.device_waits = 0  # times a writer had to wait on the device for room

    def take(self, nbytes: int, stream: Any) -> int:
        """The start of a slot of `nbytes`; `stream` (which writes it) waits for room on the device."""
        nbytes = align(nbytes)
        if nbytes > self.capacity:
            raise LayoutError(f"{nbytes} bytes do not fit the {self.capacity}-byte device buffer")
        with self._lock:
            while self._slots and self._slots[0][2] is not None and self._slots[0][2].query():
                self._slots.popleft()
            while (start := _place(self._slots, self._head if self._slots else 0, self.capacity, nbytes)) is None:
                _, _, event = self._slots.popleft()
                if event is None:  # pragma: no cover - a slot is given its event in the call that took it
                    raise LayoutError("a device buffer slot was reused before its copy was queued")
                self.runtime.wait(stream, event)  # the device waits for the copy reading it; never the host
                self.device_waits += 1
            self._slots.append([start, start + nbytes, None])
            self._head = start + nbytes
        return start

    def free_after(self, start: int, event: Event) -> None:
        """The slot at `start` is free once `event` has happened."""
        with self._lock:
            for slot in reversed(self._slots):
                if slot[0] == start and slot[2] is None:
                    slot[2] = event
                    return

    def view(self, start: int, nbytes: int) -> Any:
        return self.buffer[start : start + nbytes]
