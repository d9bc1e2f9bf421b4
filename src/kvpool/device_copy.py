"""Blocks between device KV memory and the host, without stalling the model.

One copy stream per direction, a host staging ring allocated once (pinned on CUDA), and events for
every ordering; the engine's thread never waits for the device:

- **save** (after the step's forward): the save stream waits for an event recorded on the compute
  stream, gathers the blocks into one device buffer (device to device, fast), and records
  `gathered`; the compute stream waits for `gathered` on the device, so nothing the engine runs
  later (Model Runner V2 zeroing a reused block, a copy-on-write copy, the next forward) can touch
  the blocks before they are read. The device-to-host copy into the ring then overlaps compute, and
  `done` says when the host bytes are valid: the sender waits for it on its own thread.
- **load**: the host-to-device copy and the scatter into the blocks run on the load stream; the
  calling thread's current stream waits for `done` on the device (an in-step load: the forward runs
  after it), and a load on the loader's thread waits for `done` before it is reported finished.

The ring hands out slots at its head and reuses space once the oldest slots are back; a slot goes
back when the host array over it is freed (so every path, dropped or put or failed, returns it). A
batch larger than the whole ring is a clear error; a ring full of in-flight saves answers None and
the caller drops that save (a later miss), as for any full save buffer.

`Runtime` is what the copier needs from a device runtime: torch's CUDA streams and events, or
`InlineRuntime` (host tensors, the CPU self-test: every operation completes at once, in order).
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvpool.errors import LayoutError


class Event(Protocol):
    def record(self, stream: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


class Runtime(Protocol):
    def current_stream(self) -> Any: ...
    def new_stream(self) -> Any: ...
    def new_event(self) -> Event: ...
    def use(self, stream: Any) -> Any:
        """A context manager making `stream` current on this thread."""
        ...

    def wait(self, stream: Any, event: Event) -> None:
        """`stream` runs nothing queued after this until `event` has happened (no host wait)."""
        ...

    def host_buffer(self, nbytes: int) -> Any:
        """A host byte tensor allocated once (pinned on CUDA)."""
        ...


class TorchCuda:
    """The CUDA runtime through torch."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def current_stream(self) -> Any:
        return self.torch.cuda.current_stream()

    def new_stream(self) -> Any:
        return self.torch.cuda.Stream()

    def new_event(self) -> Event:
        event: Event = self.torch.cuda.Event()
        return event

    def use(self, stream: Any) -> Any:
        return self.torch.cuda.stream(stream)

    def wait(self, stream: Any, event: Event) -> None:
        stream.wait_event(event)

    def host_buffer(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)


class _DoneEvent:
    def record(self, stream: Any) -> None:
        if hasattr(stream, "log"):
            stream.log.append(("record", stream.name, id(self)))

    def synchronize(self) -> None:
        return

    def query(self) -> bool:
        return True


class InlineRuntime:
    """Host tensors: operations run at once, in program order, so every event has happened when
    recorded. Streams keep a log of the waits and records (what the unit tests check)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, int]] = []
        self._streams = 0

    def current_stream(self) -> Any:
        return _Stream("compute", self.log)

    def new_stream(self) -> Any:
        self._streams += 1
        return _Stream(f"copy{self._streams}", self.log)

    def new_event(self) -> Event:
        return _DoneEvent()

    def use(self, stream: Any) -> Any:
        return _Using(stream, self.log)

    def wait(self, stream: Any, event: Event) -> None:
        self.log.append(("wait", stream.name, id(event)))

    def host_buffer(self, nbytes: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8)


@dataclass(frozen=True)
class _Stream:
    name: str
    log: list[tuple[str, str, int]]


class _Using:
    def __init__(self, stream: _Stream, log: list[tuple[str, str, int]]) -> None:
        self.stream, self.log = stream, log

    def __enter__(self) -> None:
        self.log.append(("use", self.stream.name, 0))

    def __exit__(self, *exc: object) -> None:
        self.log.append(("leave", self.stream.name, 0))


class StagingRing:
    """Slots of one host buffer, taken at the head, reused once every older slot is back."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer  # a 1-D uint8 tensor (pinned on CUDA)
        self.capacity = int(buffer.numel())
        self._lock = threading.Lock()
        self._slots: deque[list[int]] = deque()  # [start, end, returned] in the order taken
        self._head = 0

    def take(self, nbytes: int, setting: str = "save_buffer_bytes") -> tuple[int, Any] | None:
        """(start, 1-D view of nbytes) or None while in-flight slots fill the ring."""
        if nbytes > self.capacity:
            raise LayoutError(
                f"a batch of {nbytes} bytes does not fit the {self.capacity}-byte host staging ring "
                f"({setting}): raise {setting}, or lower put_batch_chunks"
            )
        with self._lock:
            start = self._place(nbytes)
            if start is None:
                return None
            self._slots.append([start, start + nbytes, 0])
            self._head = start + nbytes
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

    def _place(self, nbytes: int) -> int | None:
        if not self._slots:
            return 0
        tail = self._slots[0][0]  # the oldest slot still out
        head = self._head
        if self._slots[-1][0] >= tail:  # not wrapped: free is [head, capacity) and [0, tail)
            if head + nbytes <= self.capacity:
                return head
            return 0 if nbytes <= tail else None
        return head if head + nbytes <= tail else None  # wrapped: free is [head, tail)


class StagingFull(Exception):
    """The host staging ring is full of in-flight copies: this save is dropped (a later miss)."""


@dataclass
class Staged:
    """Host rows whose bytes are valid once `done` has happened; `then` runs once after that (a seal)."""

    host: np.ndarray  # (n, row_bytes) over a ring slot
    done: Event
    then: Any = None

    def wait(self) -> None:
        self.done.synchronize()
        if self.then is not None:
            then, self.then = self.then, None
            then()


class DeviceCopier:
    def __init__(self, runtime: Runtime, ring_bytes: int) -> None:
        self.runtime = runtime
        self.ring = StagingRing(runtime.host_buffer(ring_bytes))
        self.save_stream = runtime.new_stream()
        self.load_stream = runtime.new_stream()
        # copies the device may still be running, with the host rows they read or write: a slot goes
        # back to the ring only once its copy is done, even if every caller dropped it before
        self._inflight: deque[tuple[Event, Any]] = deque()
        self._inflight_lock = threading.Lock()

    def host_rows(self, count: int, row_bytes: int) -> tuple[np.ndarray, Any] | None:
        """(count, row_bytes) host rows over a ring slot, as numpy and as a tensor; the slot goes back
        when both are freed. None: the ring is full of copies in flight."""
        self._prune()
        taken = self.ring.take(count * row_bytes)
        if taken is None:
            return None
        start, view = taken
        tensor = view.view(count, row_bytes)
        array = tensor.numpy()
        weakref.finalize(array, self.ring.give_back, start)
        return array, tensor

    def _hold(self, event: Event, rows: Any) -> None:
        with self._inflight_lock:
            self._inflight.append((event, rows))

    def _prune(self) -> None:
        with self._inflight_lock:
            while self._inflight and self._inflight[0][0].query():
                self._inflight.popleft()

    def save(self, views: Sequence[Any], ids: np.ndarray, row_bytes: int) -> Staged | None:
        """Copy blocks `ids` of every layer view out to host rows of `row_bytes` (the blocks' bytes
        first, room after them for a seal). None: the ring is full of in-flight saves."""
        import torch

        runtime = self.runtime
        rows = self.host_rows(len(ids), row_bytes)
        if rows is None:
            return None
        host, host_tensor = rows
        compute = runtime.current_stream()
        written = runtime.new_event()
        written.record(compute)  # the step's forward has written the blocks
        gathered, done = runtime.new_event(), runtime.new_event()
        with runtime.use(self.save_stream):
            runtime.wait(self.save_stream, written)
            index = torch.from_numpy(ids).to(views[0].device, non_blocking=True)
            parts = [view.index_select(0, index).reshape(len(ids), -1).view(torch.uint8) for view in views]
            gathered_rows = torch.cat(parts, dim=1)
            gathered.record(self.save_stream)
            host_tensor[:, : gathered_rows.shape[1]].copy_(gathered_rows, non_blocking=True)
            done.record(self.save_stream)
        runtime.wait(compute, gathered)  # later engine work on these blocks waits for the gather, on the device
        self._hold(done, (host, gathered_rows))
        return Staged(host, done)

    def engine_point(self) -> Event:
        """An event on the calling thread's current stream: work the engine queued so far (Model Runner
        V2 zeroing the blocks a load is about to fill, for one) happens before what waits for it."""
        event = self.runtime.new_event()
        event.record(self.runtime.current_stream())
        return event

    def load(self, views: Sequence[Any], ids: Sequence[int], host: np.ndarray, after: Event | None = None) -> Event:
        """Scatter host rows (the blocks' bytes, in view order) into blocks `ids`, after `after` (an
        `engine_point` taken on the engine's thread when the load started; default: now, on this
        thread). The current stream waits for it on the device; the returned event says when it is done."""
        import torch

        runtime = self.runtime
        compute = runtime.current_stream()
        ready = after if after is not None else self.engine_point()
        done = runtime.new_event()
        with runtime.use(self.load_stream):
            runtime.wait(self.load_stream, ready)  # never under the engine's own writes to these blocks
            device = views[0].device
            rows = torch.from_numpy(host).to(device, non_blocking=True)  # pinned when `host` is a ring slot
            index = torch.as_tensor(list(ids), dtype=torch.int64).to(device, non_blocking=True)
            offset = 0
            for view in views:
                width = view[0].numel() * view.element_size()
                part = rows[:, offset : offset + width].contiguous().view(view.dtype).reshape(len(ids), *view.shape[1:])
                view.index_copy_(0, index, part)
                offset += width
            done.record(self.load_stream)
        runtime.wait(compute, done)
        self._hold(done, (host, rows))
        return done
