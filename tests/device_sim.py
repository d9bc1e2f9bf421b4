"""A simulated CUDA device on the CPU: every tensor write issued on a stream is queued there and runs
only when the host waits for the device, in an adversarial order (a stream holding a queued sleep runs
only once nothing else can), with CUDA's event semantics. What it shows: that the device check's round
trip catches every missing wait, which a device that runs work at once (InlineRuntime) never can.

Writes are intercepted with a TorchDispatchMode on the engine's thread: every mutating aten op
(`out=` and in-place) is queued on that thread's current stream; views and functional ops run at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvpool.benchmarks.device.plan import Shape
from kvpool.benchmarks.device.rig import Rig
from kvpool.core.config import Integrity


class SimEvent:
    def __init__(self, sim: SimRuntime) -> None:
        self.sim = sim
        self.recorded_on: str | None = None  # the stream of the last record queued
        self.fired = True  # never recorded: a wait on it waits for nothing (CUDA's semantics)

    def record(self, stream: SimStream) -> None:
        with self.sim.lock:
            self.recorded_on, self.fired = stream.name, False
            stream.queue.append(("record", self))

    def synchronize(self) -> None:
        if (self.recorded_on, "host") in self.sim.drop:
            return  # the mutation under test: a host that does not wait
        self.sim.run_until(lambda: self.fired)

    def query(self) -> bool:
        return self.fired


class SimStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: deque[tuple[str, Any]] = deque()


class SimRuntime:
    """The `Runtime` of a simulated device. `drop`: (waiting stream, recording stream) pairs whose
    device waits are left out, and (recording stream, "host") for host waits: the mutations tested."""

    def __init__(self) -> None:
        self.device = "sim"
        self.lock = threading.RLock()
        self.compute = SimStream("compute")
        self.streams = [self.compute]
        self.drop: set[tuple[str | None, str | None]] = set()
        self.changed = threading.Condition(self.lock)
        self.engine_thread = threading.get_ident()
        self._engine_waits = 0
        self._current = threading.local()
        self._executing = threading.local()

    # ---- Runtime ----------------------------------------------------------------------------------

    def current_stream(self) -> SimStream:
        return getattr(self._current, "stream", self.compute)

    def new_stream(self) -> SimStream:
        stream = SimStream(["gather", "copy", "load"][len(self.streams) - 1])
        self.streams.append(stream)
        return stream

    def new_event(self) -> SimEvent:
        return SimEvent(self)

    @contextlib.contextmanager
    def use(self, stream: SimStream) -> Any:
        before = self.current_stream()
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = before

    def bind(self) -> Any:
        return contextlib.nullcontext()

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        if (stream.name, event.recorded_on) in self.drop:
            return
        with self.lock:
            stream.queue.append(("wait", event))

    def host_buffer(self, nbytes: int) -> Any:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def device_buffer(self, nbytes: int) -> Any:
        return torch.zeros(nbytes, dtype=torch.uint8)

    # ---- the simulated device ---------------------------------------------------------------------

    @property
    def executing(self) -> bool:
        return getattr(self._executing, "on", False)

    def enqueue(self, op: Any) -> None:
        with self.lock:
            self.current_stream().queue.append(("op", op))

    def sleep(self, name: str) -> None:
        stream = next(stream for stream in self.streams if stream.name == name)
        with self.lock:
            stream.queue.append(("sleep", None))

    @contextlib.contextmanager
    def engine_waiting(self) -> Any:
        """The engine's thread waits on the host (a drain): everything it issues before has been issued,
        so another thread's host wait may now outlast a sleep (on a GPU: the sleep's time passes)."""
        with self.changed:
            self._engine_waits += 1
            self.changed.notify_all()
        try:
            yield
        finally:
            with self.changed:
                self._engine_waits -= 1

    def run_until(self, done: Any) -> None:
        """Run queued work until `done()`: streams without a sleep at their head first; a sleep ends only
        when no other stream can move, and, for a host wait off the engine's thread, only once the engine's
        thread waits too (a sleep lasts longer than the engine takes to issue the rest of its step)."""
        engine = threading.get_ident() == self.engine_thread
        with self.changed:
            self._executing.on = True
            try:
                while not done():
                    if self._step():
                        continue
                    sleepers = [s for s in self.streams if s.queue and s.queue[0][0] == "sleep"]
                    if not sleepers:
                        raise RuntimeError("simulated device deadlock: waits that never fire")
                    if not engine and not self._engine_waits:
                        self.changed.wait(0.05)
                        continue
                    sleepers[0].queue.popleft()
            finally:
                self._executing.on = False

    def run_all(self) -> None:
        self.run_until(lambda: not any(stream.queue for stream in self.streams))

    def _step(self) -> bool:
        moved = False
        for stream in self.streams:
            while stream.queue:
                kind, item = stream.queue[0]
                if kind == "sleep" or (kind == "wait" and not item.fired):
                    break
                stream.queue.popleft()
                if kind == "op":
                    item()
                elif kind == "record":
                    item.fired = True
                moved = True
        return moved


class QueueWrites(TorchDispatchMode):
    """Every mutating aten op on this thread goes on its current simulated stream; others run now."""

    def __init__(self, sim: SimRuntime) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.sim.executing or not func._schema.is_mutable:
            return func(*args, **kwargs)
        self.sim.enqueue(lambda: func(*args, **kwargs))
        if "out" in kwargs:
            return kwargs["out"]
        return args[0]  # in place: self


class SimRig(Rig):
    """The device check's rig on the simulated device: stalls queue sleeps, snapshots are queued reads."""

    sim: SimRuntime

    def __init__(self, shape: Shape, device: str, pool_bytes: int, **kwargs: Any) -> None:
        kwargs.pop("runtime", None)
        sim = SimRuntime()
        super().__init__(shape, "cpu", pool_bytes, runtime=sim, **kwargs)
        self.sim = sim
        self._mode = QueueWrites(sim)
        self._mode.__enter__()
        drain = self.engine.drain

        def waiting_drain(*args: Any, **kwargs: Any) -> bool:
            with sim.engine_waiting():
                return drain(*args, **kwargs)

        self.engine.drain = waiting_drain  # type: ignore[method-assign]

    def stall(self, cycles: int, *streams: str) -> None:
        if cycles:
            for name in streams:
                self.sim.sleep(name)

    def snapshot(self, blocks: list[int]) -> list[Any]:
        index = torch.as_tensor(blocks)
        out = []
        for tensor in self.tensors.values():
            shape = list(tensor.shape)
            shape[self.block_dim] = len(blocks)
            buffer = torch.empty(shape, dtype=tensor.dtype)
            torch.index_select(tensor, self.block_dim, index, out=buffer)  # queued on the current stream
            out.append(buffer.view(torch.int16))
        return out

    def synchronize(self) -> None:
        self.sim.run_all()

    def close(self) -> None:
        try:
            self.sim.run_all()
            super().close()
        finally:
            self._mode.__exit__(None, None, None)


__all__ = ["Integrity", "SimRig", "SimRuntime"]
