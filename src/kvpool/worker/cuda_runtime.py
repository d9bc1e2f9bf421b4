"""The device runtime the copier drives: torch's CUDA, or a host stand-in for the CPU self-test.

`Runtime` is what `device_copy.DeviceCopier` needs from a device runtime (streams, events, a stream
made to wait for an event on the device, buffers allocated once). Two implementations:

- `TorchCuda`: torch's CUDA streams and events, bound to the KV tensors' device. Events are blocking
  (a host wait sleeps instead of spinning a core); `bind` and `use` make that device current, so every
  CUDA call kvpool makes on its own threads (the loader's, the sender's) lands on the KV tensors'
  device and no rank creates a context on GPU 0. Pinned host buffers take the whole power-of-two
  allocation torch's pinned allocator rounds a request up to (`pinned_bytes`).
- `InlineRuntime`: host tensors; every operation completes at once, in program order, so every event
  has happened when recorded. It logs waits and records per stream and notes every host-side event
  call with its thread and bound device: what the CPU tests check.

`EnginePoint` (an event on the engine's stream and the thread that took it) and `BoundEvent` (an event
whose host waits run bound to the device) wrap any `Event`.

Invariants: nothing here waits on the host but `synchronize`; this module imports nothing of kvpool's
(the staging rings and the copier import it, never the reverse).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class Event(Protocol):
    def record(self, stream: Any) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...


class Runtime(Protocol):
    device: Any

    def current_stream(self) -> Any: ...
    def new_stream(self) -> Any: ...
    def new_event(self) -> Event: ...
    def use(self, stream: Any) -> Any:
        """A context manager making `stream` (and its device) current on this thread."""
        ...

    def bind(self) -> Any:
        """A context manager making the KV tensors' device current on this thread."""
        ...

    def wait(self, stream: Any, event: Event) -> None:
        """`stream` runs nothing queued after this until `event` has happened (no host wait)."""
        ...

    def host_buffer(self, nbytes: int) -> Any:
        """A host byte tensor allocated once (pinned on CUDA)."""
        ...

    def device_buffer(self, nbytes: int) -> Any:
        """A device byte tensor allocated once."""
        ...


def pinned_bytes(nbytes: int) -> int:
    """What torch's pinned (CachingHostAllocator) allocation of `nbytes` really takes: the next power of two."""
    return 1 << max(0, (int(nbytes) - 1).bit_length())


class TorchCuda:
    """The CUDA runtime through torch, bound to the KV tensors' device."""

    def __init__(self, device: Any = None, torch: Any = None) -> None:
        if torch is None:
            import torch
        self.torch = torch
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def current_stream(self) -> Any:
        return self.torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return self.torch.cuda.Stream(device=self.device)

    def new_event(self) -> Event:
        # blocking: a host wait on it sleeps instead of spinning a core
        event: Event = self.torch.cuda.Event(blocking=True)
        return event

    def use(self, stream: Any) -> Any:
        stack = contextlib.ExitStack()
        stack.enter_context(self.torch.cuda.device(self.device))
        stack.enter_context(self.torch.cuda.stream(stream))
        return stack

    def bind(self) -> Any:
        return self.torch.cuda.device(self.device)

    def wait(self, stream: Any, event: Event) -> None:
        stream.wait_event(event)

    def host_buffer(self, nbytes: int) -> Any:
        # the pinned allocator rounds up to a power of two: use all of what is taken anyway
        return self.torch.empty(pinned_bytes(nbytes), dtype=self.torch.uint8, pin_memory=True)

    def device_buffer(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device=self.device)


class _DoneEvent:
    def __init__(self, runtime: InlineRuntime) -> None:
        self.runtime = runtime

    def record(self, stream: Any) -> None:
        if hasattr(stream, "log"):
            stream.log.append(("record", stream.name, id(self)))

    def synchronize(self) -> None:
        self.runtime.note("synchronize")

    def query(self) -> bool:
        self.runtime.note("query")
        return True


class InlineRuntime:
    """Host tensors: operations run at once, in program order, so every event has happened when
    recorded. Streams keep a log of the waits and records (what the unit tests check); `bound` says,
    per thread, which device `bind`/`use` made current, and `calls` notes (thread, call, bound device)
    for every host-side event call (what the device-binding and engine-thread tests check)."""

    def __init__(self, device: str = "cpu") -> None:
        import torch

        self.torch = torch
        self.device = device
        self.log: list[tuple[str, str, int]] = []
        self.calls: list[tuple[str, str, str | None]] = []
        self._bound = threading.local()
        self._streams = 0

    @property
    def bound(self) -> str | None:
        return getattr(self._bound, "device", None)

    def note(self, call: str) -> None:
        self.calls.append((threading.current_thread().name, call, self.bound))

    def current_stream(self) -> Any:
        self.note("current_stream")
        return _Stream("compute", self.log)

    def new_stream(self) -> Any:
        self._streams += 1
        return _Stream(f"copy{self._streams}", self.log)

    def new_event(self) -> Event:
        self.note("new_event")
        return _DoneEvent(self)

    def use(self, stream: Any) -> Any:
        return _Using(stream, self.log, self)

    @contextlib.contextmanager
    def bind(self) -> Any:
        before = self.bound
        self._bound.device = self.device
        try:
            yield
        finally:
            self._bound.device = before

    def wait(self, stream: Any, event: Event) -> None:
        self.note("wait")
        self.log.append(("wait", stream.name, id(event)))

    def host_buffer(self, nbytes: int) -> Any:
        self.note("host_buffer")
        return self.torch.empty(nbytes, dtype=self.torch.uint8)

    def device_buffer(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8)


@dataclass(frozen=True)
class _Stream:
    name: str
    log: list[tuple[str, str, int]]


class _Using:
    def __init__(self, stream: _Stream, log: list[tuple[str, str, int]], runtime: InlineRuntime) -> None:
        self.stream, self.log, self.runtime = stream, log, runtime
        self._binding: Any = None

    def __enter__(self) -> None:
        self._binding = self.runtime.bind()
        self._binding.__enter__()
        self.log.append(("use", self.stream.name, 0))

    def __exit__(self, *exc: object) -> None:
        self.log.append(("leave", self.stream.name, 0))
        self._binding.__exit__(*exc)


class EnginePoint:
    """An event recorded on the engine's current stream, and the thread that recorded it."""

    def __init__(self, event: Event, thread: int) -> None:
        self.event, self.thread = event, thread

    def record(self, stream: Any) -> None:
        self.event.record(stream)

    def synchronize(self) -> None:
        self.event.synchronize()

    def query(self) -> bool:
        return self.event.query()


class BoundEvent:
    """An event whose host waits run with the KV tensors' device current (the loader's thread waits on it)."""

    def __init__(self, event: Event, bind: Callable[[], Any]) -> None:
        self.event, self._bind = event, bind

    def record(self, stream: Any) -> None:
        self.event.record(stream)

    def synchronize(self) -> None:
        with self._bind():
            self.event.synchronize()

    def query(self) -> bool:
        with self._bind():
            return self.event.query()
