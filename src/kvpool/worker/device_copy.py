"""Blocks between device KV memory and the host, without stalling the model.

Three streams, one pinned host ring and two bounded device buffers, all allocated once, and events
for every ordering; the engine's thread never waits for the device:

- **save** (after the step's forward): the *gather* stream waits for an event recorded on the compute
  stream, uploads the block ids from the pinned slot, gathers every layer's blocks into one device
  buffer (device to device, one kernel per run of equally strided layer pieces: one for a vLLM 0.32
  backing buffer), and records `gathered`; the compute stream waits for `gathered` on the device, so
  nothing the engine runs later (Model Runner V2 zeroing a reused block, a copy-on-write copy, the
  next forward) can touch the blocks before they are read. The *copy* stream then waits for
  `gathered` and copies the gathered rows, contiguous, into a contiguous pinned slot (a strided or
  pageable destination would make the copy synchronous); `done` says when the host bytes are valid
  and the sender waits for it on its own thread. The gather and the copy are on separate streams, so
  the next step's gather (which the forward waits for) never queues behind this step's copy.
- **load**: the load stream waits for the engine's work queued when the load started (`after`),
  copies whole pinned rows to the device (contiguous), selects the rows that arrived on the device
  (a partial load), and scatters them into the blocks; on the engine's thread its current stream
  waits for `done` on the device (the next forward runs after the load), and a load on the loader's
  thread makes no stream of that thread wait (it may be the legacy default stream the forward runs
  on): it waits for `done` on the host before the load is reported finished.

Host memory: one pinned buffer (`save_buffer_bytes`; torch's pinned allocator rounds a request up to
a power of two, so the ring uses the whole rounded allocation), split into a save ring and a load
ring (a quarter, at least eight blocks): loads take their share first, then free save space, and
saves never take the loads' share, so loads never fall back to pageable memory because saves filled
the ring. A slot holds the blocks' bytes (one contiguous array), their seals (a column of its own)
and the int64 block ids the device uploads from it (a pinned index ring, in effect). Host waits use
blocking events (a waiting thread sleeps instead of spinning a core).

Device memory: a gather buffer for saves and one for loads, each at most `DEVICE_BUFFER_BYTES`
(and no larger than its host ring), allocated when the KV caches are registered, i.e. after vLLM
sized its KV cache to `gpu_memory_utilization`: they come out of the headroom vLLM leaves (on an
H200 at 0.9 that is about 14 GiB); lower `gpu_memory_utilization` by their share when that headroom
is used by something else. A batch larger than a device buffer goes in segments; when the buffer is
still being read by earlier copies, the gather stream waits for them on the device, never the host.

Every CUDA call kvpool makes on its own threads (the loader's, the sender's) runs with the KV
tensors' device current (`Runtime.bind`), so no rank creates a context on GPU 0.

Modules, imported one way: `cuda_runtime` (the `Runtime` the copier drives: torch's CUDA, or
`InlineRuntime`, host tensors for the CPU self-test) <- `staging` (the pinned `StagingRing` and the
`DeviceRing`) <- this module (slots, the KV byte runs and the `DeviceCopier`) <- `layout`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.worker.cuda_runtime import BoundEvent, EnginePoint, Event, Runtime
from kvpool.worker.staging import ALIGN, DeviceRing, StagingRing, align

DEVICE_BUFFER_BYTES = 128 << 20  # each of the two device buffers (gather, load), at most
LOAD_SHARE = 4  # loads get 1/LOAD_SHARE of the pinned ring
INDEX_BYTES = 8  # one int64 block id


class StagingFull(Exception):
    """The host staging ring is full of in-flight copies: this save is dropped (a later miss)."""


@dataclass
class Staged:
    """Host rows whose bytes are valid once `done` has happened; `then` runs once after that (a seal)."""

    host: np.ndarray  # (n, block bytes) over a ring slot
    done: Event
    then: Any = None
    bind: Callable[[], Any] = contextlib.nullcontext
    seals: np.ndarray | None = None  # (n, seal bytes) in the same slot, when sealed

    def wait(self) -> None:
        with self.bind():  # a host wait on the KV's device, whichever thread runs it
            self.done.synchronize()
        if self.then is not None:
            then, self.then = self.then, None
            then()


@dataclass
class HostSlot:
    """A pinned ring slot: blocks (n, block bytes), seals (n, seal bytes) or None, and room for int64 ids."""

    blocks: np.ndarray
    seals: np.ndarray | None
    blocks_tensor: Any
    index_tensor: Any  # int64 pinned, 2n: block ids, then rows picked (a partial load)

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.blocks,) if self.seals is None else (self.blocks, self.seals)


def byte_runs(pieces: Sequence[tuple[Any, Any, int, int, int]]) -> list[tuple[Any, int, int, int, int, int]]:
    """Pieces (storage key, tensor over it, byte offset of block 0, block stride, width) in row order,
    merged into runs (tensor, offset, block stride, count, step, width): consecutive pieces of one
    storage, width and block stride whose offsets step evenly are one strided view, gathered by one
    kernel (all layers of a vLLM 0.32 backing buffer: one run)."""
    runs: list[list[Any]] = []  # [key, tensor, offset, stride, count, step, width]
    for key, base, offset, stride, width in pieces:
        if runs:
            run = runs[-1]
            same = run[0] == key and run[3] == stride and run[6] == width
            if same and run[4] == 1 and offset - run[2] >= width:
                run[4], run[5] = 2, offset - run[2]
                continue
            if same and run[4] > 1 and offset == run[2] + run[4] * run[5]:
                run[4] += 1
                continue
        runs.append([key, base, offset, stride, 1, width, width])
    return [(base, offset, stride, count, step, width) for _, base, offset, stride, count, step, width in runs]


class RunView:
    """(num_blocks, count, width) uint8 view over one storage: `count` pieces of `width` bytes per block."""

    def __init__(self, base: Any, offset: int, stride: int, count: int, step: int, width: int, num_blocks: int) -> None:
        import torch

        self.count, self.width = count, width
        self.view = torch.empty(0, dtype=torch.uint8, device=base.device).set_(
            base.untyped_storage(), offset, (num_blocks, count, width), (stride, step, 1)
        )

    @property
    def nbytes(self) -> int:
        return self.count * self.width


class DeviceCopier:
    def __init__(
        self,
        runtime: Runtime,
        ring_bytes: int,
        device_bytes: int = DEVICE_BUFFER_BYTES,
        min_load_bytes: int = 0,
    ) -> None:
        self.runtime = runtime
        with runtime.bind():
            buffer = runtime.host_buffer(ring_bytes)
            total = int(buffer.numel())
            load = min(total // 2, max(total // LOAD_SHARE, align(min_load_bytes)))
            load -= load % ALIGN
            self.ring = StagingRing(buffer[: total - load])  # saves
            self.load_ring = StagingRing(buffer[total - load :])  # loads: never crowded out by saves
            self.host_buffer = buffer
            self.gather_stream = runtime.new_stream()
            self.copy_stream = runtime.new_stream()
            self.load_stream = runtime.new_stream()
            self.gather = DeviceRing(runtime, min(device_bytes, self.ring.capacity))
            self.loads = DeviceRing(runtime, min(device_bytes, self.load_ring.capacity))
        # copies the device may still be running, with the host rows they read or write: a slot goes
        # back to the ring only once its copy is done, even if every caller dropped it before
        self._inflight: deque[tuple[Event, Any]] = deque()
        self._inflight_lock = threading.Lock()
        # a device ring's slot gets its event only after its copies are queued: one thread at a time
        # per ring from `take` to `free_after` (the loader's thread and the engine's both load), or
        # another would take the slot over (only host work is done under these: never a host wait)
        self._gather_lock = threading.Lock()
        self._load_lock = threading.Lock()

    # ---- host slots --------------------------------------------------------------------------

    def host_slot(self, count: int, block_bytes: int, seal_bytes: int = 0, *, load: bool = False) -> HostSlot | None:
        """A ring slot for `count` blocks (their bytes contiguous, then their seals, then 2*count int64
        ids); it goes back once every array over it is freed. None: the ring is full of copies in flight."""
        import torch

        self._prune()
        blocks_at = 0
        seals_at = align(count * block_bytes)
        index_at = seals_at + align(count * seal_bytes)
        nbytes = index_at + 2 * count * INDEX_BYTES
        # loads: their reserved share first, then free space of the saves' share (a load's slot is back
        # as soon as its copy to the device is done); saves never take the loads' share
        rings = (self.load_ring, self.ring) if load else (self.ring,)
        taken, ring = None, rings[0]
        for ring in rings:
            if nbytes <= ring.capacity and (taken := ring.take(nbytes, "save_buffer_bytes")) is not None:
                break
        if taken is None:
            if all(nbytes > each.capacity for each in rings):
                rings[-1].take(nbytes, "save_buffer_bytes")  # raises: larger than the ring
            return None
        start, view = taken
        whole = view.numpy()
        weakref.finalize(whole, ring.give_back, start)
        blocks_tensor = view[blocks_at : blocks_at + count * block_bytes].view(count, block_bytes)
        blocks = whole[blocks_at : blocks_at + count * block_bytes].reshape(count, block_bytes)
        seals = whole[seals_at : seals_at + count * seal_bytes].reshape(count, seal_bytes) if seal_bytes else None
        index = view[index_at : index_at + 2 * count * INDEX_BYTES].view(torch.int64)
        return HostSlot(blocks, seals, blocks_tensor, index)

    def wait_for_load_room(self) -> None:
        """Off the engine's thread: wait until the oldest load copy still in flight is done."""
        with self._inflight_lock:
            oldest = self._inflight[0][0] if self._inflight else None
        if oldest is not None:
            with self.runtime.bind():
                oldest.synchronize()

    def _hold(self, event: Event, rows: Any) -> None:
        with self._inflight_lock:
            self._inflight.append((event, rows))

    def _prune(self) -> None:
        """Forget every copy the device has finished (a slow load never holds back a finished save)."""
        with self.runtime.bind(), self._inflight_lock:
            if self._inflight:
                self._inflight = deque(entry for entry in self._inflight if not entry[0].query())

    # ---- saves -------------------------------------------------------------------------------

    def save(self, runs: Sequence[RunView], ids: np.ndarray, block_bytes: int, seal_bytes: int = 0) -> Staged | None:
        """Copy blocks `ids` of every run out to host rows of `block_bytes` (and room for seals). None:
        the ring is full of in-flight saves."""
        with self.runtime.bind(), self._gather_lock:  # every CUDA call below on the KV tensors' device
            return self._save(runs, ids, block_bytes, seal_bytes)

    def _save(self, runs: Sequence[RunView], ids: np.ndarray, block_bytes: int, seal_bytes: int) -> Staged | None:
        import torch

        runtime = self.runtime
        count = len(ids)
        slot = self.host_slot(count, block_bytes, seal_bytes)
        if slot is None:
            return None
        compute = runtime.current_stream()
        written = runtime.new_event()
        written.record(compute)  # the step's forward has written the blocks
        slot.index_tensor[:count].numpy()[:] = ids
        per_segment = max(1, (self.gather.capacity - 2 * ALIGN) // (block_bytes + INDEX_BYTES))
        done = runtime.new_event()
        last_gathered: Event | None = None
        for first in range(0, count, per_segment):
            part = min(per_segment, count - first)
            gathered = runtime.new_event()
            with runtime.use(self.gather_stream):
                runtime.wait(self.gather_stream, written)
                start = self.gather.take(align(part * block_bytes) + part * INDEX_BYTES, self.gather_stream)
                rows = self.gather.view(start, part * block_bytes).view(part, block_bytes)
                index_at = start + align(part * block_bytes)
                index = self.gather.view(index_at, part * INDEX_BYTES).view(torch.int64)
                index.copy_(slot.index_tensor[first : first + part], non_blocking=True)  # from pinned memory
                for run, target in _run_columns(rows, runs):
                    self._index_select(run.view, index, target)
                gathered.record(self.gather_stream)
            last_gathered = gathered
            with runtime.use(self.copy_stream):
                runtime.wait(self.copy_stream, gathered)
                # whole contiguous rows into a contiguous pinned slot: an asynchronous copy
                slot.blocks_tensor[first : first + part].copy_(rows, non_blocking=True)
                self._free_after_queued(self.gather, start, self.copy_stream, done, first + part == count)
        if last_gathered is None:  # nothing to copy
            done.record(compute)
        else:
            runtime.wait(compute, last_gathered)  # later engine work on these blocks waits for the gather
        self._hold(done, slot)
        return Staged(slot.blocks, done, bind=runtime.bind, seals=slot.seals)

    def _free_after_queued(self, ring: DeviceRing, start: int, stream: Any, done: Event, last: bool) -> None:
        """The device slot at `start` is free once `stream` has run what it queued so far; the event
        recorded for that is `done` (the whole batch's) for its last segment."""
        event = done if last else self.runtime.new_event()
        event.record(stream)
        ring.free_after(start, event)

    @staticmethod
    def _index_select(source: Any, index: Any, out: Any) -> None:
        import torch

        torch.index_select(source, 0, index, out=out)

    # ---- loads -------------------------------------------------------------------------------

    def engine_point(self) -> Event:
        """An event on the calling thread's current stream: work the engine queued so far (Model Runner
        V2 zeroing the blocks a load is about to fill, for one) happens before what waits for it."""
        event = self.runtime.new_event()
        event.record(self.runtime.current_stream())
        return EnginePoint(event, threading.get_ident())

    def load(
        self,
        runs: Sequence[RunView],
        slot: HostSlot,
        targets: Sequence[int],
        picks: Sequence[int] | None = None,
        after: Event | None = None,
    ) -> Event:
        """Scatter rows of the pinned `slot` (all of them, or the rows `picks`, ascending) into blocks
        `targets`, after `after` (an `engine_point` taken on the engine's thread when the load started;
        default: now, on this thread). Whole runs of slot rows go to the device as contiguous copies
        (segments of the device buffer's size); the rows that arrived are picked there. The current
        stream waits for it on the device; the returned event says when it is done."""
        with self.runtime.bind(), self._load_lock:  # on the loader's thread too: every CUDA call bound
            return self._load(runs, slot, targets, picks, after)

    def _load(
        self,
        runs: Sequence[RunView],
        slot: HostSlot,
        targets: Sequence[int],
        picks: Sequence[int] | None,
        after: Event | None,
    ) -> Event:
        import torch

        runtime = self.runtime
        compute = runtime.current_stream()
        ready = after if after is not None else self.engine_point()
        count, block_bytes = slot.blocks.shape
        keep = len(targets)
        rows_picked = list(range(keep)) if picks is None else [int(row) for row in picks]
        partial = keep < count
        per_segment = max(1, (self.loads.capacity - 3 * ALIGN) // (2 * block_bytes + 2 * INDEX_BYTES))
        # per segment of slot rows [first, last): the kept rows in it, as positions in `targets`
        segments: list[tuple[int, int, int, int]] = []
        position = 0
        for first in range(0, count, per_segment):
            last = min(count, first + per_segment)
            begin = position
            while position < keep and rows_picked[position] < last:
                position += 1
            if position > begin:
                segments.append((first, last, begin, position))
        index_host = slot.index_tensor.numpy()
        index_host[:keep] = targets
        for first, _, begin, end in segments:  # rows picked, relative to their segment
            index_host[keep + begin : keep + end] = np.asarray(rows_picked[begin:end]) - first
        done = runtime.new_event()
        with runtime.use(self.load_stream):
            # never under the engine's own writes to these blocks
            runtime.wait(self.load_stream, ready.event if isinstance(ready, EnginePoint) else ready)
            for number, (first, last, begin, end) in enumerate(segments):
                span, kept = last - first, end - begin
                rows_bytes = align(span * block_bytes)
                picked_bytes = align(kept * block_bytes) if partial else 0
                start = self.loads.take(rows_bytes + picked_bytes + 2 * kept * INDEX_BYTES, self.load_stream)
                rows = self.loads.view(start, span * block_bytes).view(span, block_bytes)
                rows.copy_(slot.blocks_tensor[first:last], non_blocking=True)  # pinned, contiguous
                index_at = start + rows_bytes + picked_bytes
                index = self.loads.view(index_at, 2 * kept * INDEX_BYTES).view(torch.int64)
                index[:kept].copy_(slot.index_tensor[begin:end], non_blocking=True)
                index[kept:].copy_(slot.index_tensor[keep + begin : keep + end], non_blocking=True)
                if partial:
                    picked = self.loads.view(start + rows_bytes, kept * block_bytes).view(kept, block_bytes)
                    self._index_select(rows, index[kept:], picked)
                    rows = picked
                for run, part in _run_columns(rows, runs):
                    run.view.index_copy_(0, index[:kept], part)
                self._free_after_queued(self.loads, start, self.load_stream, done, number == len(segments) - 1)
            if not segments:
                done.record(self.load_stream)
        if not isinstance(ready, EnginePoint) or ready.thread == threading.get_ident():
            # on the engine's thread: its next forward waits for the load on the device. Another thread's
            # stream (the loader's: the legacy default stream, which vLLM's forward may run on) never
            # waits: that load is reported finished only once done, and the engine waits for that
            runtime.wait(compute, done)
        self._hold(done, slot)
        return BoundEvent(done, runtime.bind)


def _run_columns(rows: Any, runs: Sequence[RunView]) -> Iterator[tuple[RunView, Any]]:
    """Each run with its columns of `rows` (n, block bytes), viewed (n, count, width) like the run."""
    offset = 0
    for run in runs:
        yield run, rows[:, offset : offset + run.nbytes].unflatten(1, (run.count, run.width))
        offset += run.nbytes
