"""The device copy path's layouts and costs, on the CPU (host tensors stand in for CUDA): vLLM 0.32's
backing buffer with strided per-layer views in several layouts, kernel-block splitting, float8, raw
buffers refused, contiguous whole-row copies, loads from whole pinned slots with rows picked on the
device and ring space of their own, bounded device buffers, and every host wait on the GPU made on
kvpool's threads bound to the KV tensors' device."""

from __future__ import annotations

import gc
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvpool.backends.base import Status
from kvpool.backends.memory import MemoryBackend
from kvpool.benchmarks.device.cache import backing_cache, fill_random, per_layer_cache
from kvpool.benchmarks.device.plan import Shape
from kvpool.benchmarks.device.rig import Rig, staged_layout
from kvpool.core.config import Integrity
from kvpool.core.errors import LayoutError
from kvpool.worker.cuda_runtime import InlineRuntime, TorchCuda, pinned_bytes
from kvpool.worker.device_copy import DEVICE_BUFFER_BYTES, DeviceCopier, StagingFull
from kvpool.worker.layout import KVLayout
from kvpool.worker.staging import StagingRing

BLOCKS = 12


def _cache(kind: str, dtype=torch.bfloat16, layout: str = "LBNHC", ratio: int = 1, layers: int = 3):
    if kind == "backing":
        _, tensors = backing_cache(torch, layers, BLOCKS, 16, 2, 8, dtype, "cpu", layout, ratio)
    else:
        tensors = per_layer_cache(torch, layers, BLOCKS, 16, 2, 8, dtype, "cpu")
    fill_random(torch, tensors, 7)
    return tensors


def _staged(tensors, integrity=Integrity.OFF, staging=1 << 20, device_bytes=DEVICE_BUFFER_BYTES, runtime=None):
    return staged_layout(tensors, BLOCKS, integrity, staging, runtime or InlineRuntime(), device_bytes)


def _bits(tensors, blocks, dim):
    index = torch.as_tensor(blocks)
    return [t.index_select(dim, index).view(torch.uint8) for t in tensors.values()]


def _round_trip(tensors, layout, dim, source=(1, 5, 2), target=(7, 8, 9), arrived=None):
    pool = MemoryBackend(1 << 22)
    keys = [f"k{i}" for i in range(len(source))]
    rows, staged = layout.capture_rows(0, list(source))
    assert staged is not None
    staged.wait()
    assert pool.put(keys, rows) == [Status.OK] * len(keys)
    before = _bits(tensors, list(source), dim)
    untouched = _bits(tensors, list(target), dim)
    dest = layout.load_rows(0, list(target))
    statuses = layout.verify(0, dest, pool.get_into(keys, dest))
    assert statuses == [Status.OK] * len(keys)
    arrived = arrived or [True] * len(keys)
    layout.commit_rows(0, list(target), dest, arrived)
    after = _bits(tensors, list(target), dim)
    for b, a, u in zip(before, after, untouched):
        for k, ok in enumerate(arrived):
            expected = b.select(dim, k) if ok else u.select(dim, k)
            assert torch.equal(a.select(dim, k), expected)


@pytest.mark.parametrize("layout_name", ["LBNHC", "LBHNC", "BLNHC", "LHBNC"])
@pytest.mark.parametrize("integrity", [Integrity.OFF, Integrity.FULL])
def test_vllm_032_backing_buffer_views_round_trip_byte_exact(layout_name, integrity):
    tensors = _cache("backing", layout=layout_name)
    layout = _staged(tensors, integrity)
    runs = len(layout._runs[0])
    # all layers of the backing buffer in one gather (LHBNC: every layer's heads step evenly, one run too)
    assert runs == 1
    _round_trip(tensors, layout, 0)


def test_per_layer_tensors_gather_one_run_per_layer_and_partial_loads_write_only_what_arrived():
    tensors = _cache("per_layer")
    layout = _staged(tensors, Integrity.FULL)
    assert len(layout._runs[0]) == 3  # K and V of a layer: one strided view
    _round_trip(tensors, layout, 1, arrived=[True, False, True])


def test_kernel_block_splitting_is_viewed_as_whole_blocks():
    tensors = _cache("backing", ratio=2)  # dim 0 = num_blocks x 2 kernel blocks of 8 tokens
    assert next(iter(tensors.values())).shape[0] == 2 * BLOCKS
    layout = _staged(tensors)
    assert layout.chunk_nbytes(0) == 3 * 2 * 16 * 2 * 8 * 2  # the whole 16-token block of every layer
    pool = MemoryBackend(1 << 20)
    rows, staged = layout.capture_rows(0, [3])
    assert staged is not None
    staged.wait()
    pool.put(["a"], rows)
    dest = layout.load_rows(0, [10])
    pool.get_into(["a"], dest)
    layout.commit_rows(0, [10], dest, [True])
    for tensor in tensors.values():
        assert torch.equal(tensor[6:8].view(torch.uint8), tensor[20:22].view(torch.uint8))  # both kernel blocks


def test_float8_caches_move_as_bytes():
    tensors = _cache("backing", dtype=torch.float8_e4m3fn)
    _round_trip(tensors, _staged(tensors), 0)


def test_a_raw_buffer_spec_is_refused_by_name():
    raw = torch.zeros(4096, dtype=torch.int8)
    with pytest.raises(LayoutError, match=r"layer 'state' is a raw KV buffer of 4096 bytes .* does not support"):
        KVLayout({"state": raw}, {"state": 0}, BLOCKS, staged=True, runtime=InlineRuntime())


def test_a_sealed_save_copies_whole_contiguous_rows_into_the_pinned_ring():
    tensors = _cache("backing")
    layout = _staged(tensors, Integrity.FULL)
    rows, staged = layout.capture_rows(0, [1, 2, 3])
    assert staged is not None
    blocks, seals = rows.arrays
    assert blocks.flags.c_contiguous and blocks.shape == (3, layout.chunk_nbytes(0))  # no strided destination
    assert seals.shape == (3, 8)
    ring = layout._copier.host_buffer
    start = ring.data_ptr()
    assert start <= blocks.ctypes.data and blocks.ctypes.data + blocks.nbytes <= start + ring.numel()
    staged.wait()  # the seal is computed on the host once the bytes are there
    assert layout.verify(0, rows, [Status.OK] * 3) == [Status.OK] * 3


def test_loads_use_whole_pinned_slots_of_their_own_share_and_pick_rows_on_the_device(monkeypatch):
    tensors = _cache("backing")
    layout = _staged(tensors, Integrity.FULL, staging=64 << 10)
    copier = layout._copier
    held = []
    with pytest.raises(StagingFull):
        while True:  # saves fill their share of the ring
            held.append(layout.capture_rows(0, [1, 2]))
    dest = layout.load_rows(0, [4, 5, 6])  # loads still have theirs
    ring = copier.host_buffer
    for array in dest.arrays:  # pinned ring memory, never a pageable copy
        assert ring.data_ptr() <= array.ctypes.data < ring.data_ptr() + ring.numel()
    selects = []
    real = DeviceCopier._index_select

    def spy(source, index, out):
        selects.append((source.data_ptr(), tuple(out.shape)))
        real(source, index, out)

    monkeypatch.setattr(DeviceCopier, "_index_select", staticmethod(spy))
    dest.arrays[0][:] = 1
    layout.commit_rows(0, [4, 5, 6], dest, [True, False, True])
    device_rows = copier.loads.buffer.data_ptr()
    assert selects == [(device_rows, (2, layout.chunk_nbytes(0)))]  # the arrived rows, picked on the device


def test_on_the_engine_thread_a_full_load_share_fails_the_load_instead_of_waiting():
    tensors = _cache("backing")
    layout = _staged(tensors, staging=64 << 10)
    held = []
    with pytest.raises(StagingFull, match="no room for a load"):
        for _ in range(1000):
            held.append(layout.load_rows(0, [1, 2, 3, 4]))
    del held
    gc.collect()
    assert layout.load_rows(0, [1, 2, 3, 4]) is not None


class _Pending:
    """An event the fake device has not reached until a host waits for it."""

    def __init__(self, runtime):
        self.runtime, self.finished = runtime, False

    def record(self, stream):
        stream.log.append(("record", stream.name, id(self)))

    def synchronize(self):
        self.finished = True

    def query(self):
        return self.finished


class _SlowRuntime(InlineRuntime):
    def new_event(self):
        return _Pending(self)


def test_a_save_larger_than_the_device_buffer_goes_in_segments_that_wait_on_the_device():
    tensors = _cache("backing")
    runtime = _SlowRuntime()
    chunk = 3 * 2 * 16 * 2 * 8 * 2
    layout = _staged(tensors, device_bytes=2 * chunk + 1024, runtime=runtime)
    copier = layout._copier
    assert copier.gather.capacity <= 2 * chunk + 1024 + 256  # bounded, allocated once
    layout.capture_rows(0, [1])  # still in flight when the big save comes
    runtime.log.clear()
    _round_trip(tensors, layout, 0, source=(1, 2, 3, 4, 5), target=(6, 7, 8, 9, 10))
    assert copier.gather.device_waits > 0
    gather = copier.gather_stream.name
    assert sum(1 for op, stream, _ in runtime.log if op == "wait" and stream == gather) > 1


def test_the_ring_lock_is_reentrant_for_a_finalizer_running_under_it():
    ring = StagingRing(torch.empty(1024, dtype=torch.uint8))
    start, _ = ring.take(100)
    done = threading.Event()

    def under_lock():
        with ring._lock:
            ring.give_back(start)  # what a slot's finalizer does when collected inside a take
        done.set()

    worker = threading.Thread(target=under_lock)
    worker.start()
    worker.join(5)
    assert done.is_set() and ring.in_use == 0


def test_pinned_allocations_round_up_to_a_power_of_two_and_the_ring_uses_all_of_it():
    assert [pinned_bytes(n) for n in (1, 1000, 1 << 20, (1 << 20) + 1)] == [1, 1024, 1 << 20, 2 << 20]


def _fake_torch():
    calls = []

    class Event:
        def __init__(self, **kwargs):
            calls.append(("Event", kwargs))

    class Stream:
        def __init__(self, device=None):
            calls.append(("Stream", device))

    class DeviceContext:
        def __init__(self, device):
            calls.append(("device", device))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    def empty(n, dtype=None, pin_memory=False, device=None):
        calls.append(("empty", n, pin_memory, device))
        return torch.empty(0)

    cuda = SimpleNamespace(
        Event=Event,
        Stream=Stream,
        device=DeviceContext,
        stream=lambda stream: DeviceContext(("stream", stream)),
        current_stream=lambda device: calls.append(("current_stream", device)),
        current_device=lambda: 0,
    )
    return SimpleNamespace(cuda=cuda, device=torch.device, empty=empty, uint8=torch.uint8), calls


def test_torch_cuda_binds_every_call_to_the_kv_device_with_blocking_events():
    fake, calls = _fake_torch()
    runtime = TorchCuda("cuda:1", torch=fake)
    device = torch.device("cuda:1")
    runtime.new_event()
    runtime.new_stream()
    with runtime.bind():
        pass
    with runtime.use("s"):
        pass
    runtime.current_stream()
    runtime.host_buffer(3 << 20)
    assert calls == [
        ("Event", {"blocking": True}),  # a host wait sleeps instead of spinning a core
        ("Stream", device),
        ("device", device),
        ("device", device),
        ("device", ("stream", "s")),
        ("current_stream", device),
        ("empty", 4 << 20, True, None),  # the power of two torch's pinned allocator takes anyway
    ]


def test_host_waits_on_kvpool_threads_run_bound_to_the_kv_device():
    runtime = InlineRuntime(device="cuda:1")  # a fake CUDA: records the device bound when a thread waits
    shape = Shape(layers=2, block=16, heads=2, head_dim=8, blocks=BLOCKS)
    rig = Rig(shape, "cpu", 1 << 22, sync_loads=False, staging_bytes=1 << 20, runtime=runtime)
    try:
        _, hashes = rig.save([1, 2])  # the sender thread waits for the copy
        assert rig.engine.drain(30.0)
        rig.load(hashes, [3, 4])  # the loader thread waits for the copy before reporting it
    finally:
        rig.close()
    elsewhere = [(thread, call, bound) for thread, call, bound in runtime.calls if thread != "MainThread"]
    calls = {call for _, call, _ in elsewhere}
    assert {"synchronize", "current_stream", "new_event", "wait"} <= calls, calls  # sender's and loader's
    assert all(bound == "cuda:1" for _, _, bound in elsewhere), [entry for entry in elsewhere if entry[2] != "cuda:1"]
    assert ("MainThread", "host_buffer", "cuda:1") in runtime.calls  # the pinned ring, on the KV's device
    assert np.all(rig.snapshot([1, 2])[0].numpy() == rig.snapshot([3, 4])[0].numpy())


def test_a_save_the_sender_has_no_room_for_starts_no_device_copy(monkeypatch):
    shape = Shape(layers=2, block=16, heads=2, head_dim=8, blocks=BLOCKS)
    rig = Rig(shape, "cpu", 1 << 22, staging_bytes=1 << 20)
    try:
        captures = []
        real = rig.layout.capture_rows
        monkeypatch.setattr(rig.layout, "capture_rows", lambda *a, **k: captures.append(a) or real(*a, **k))
        asked = []
        monkeypatch.setattr(rig.engine.saves.sender, "has_room", lambda nbytes: asked.append(nbytes) or False)
        rig.save([1, 2])
        assert asked == [2 * rig.layout.chunk_nbytes(0)] and captures == []  # checked before any copy starts
        assert rig.engine.stats.save_jobs_dropped == 1
        monkeypatch.undo()
        rig.save([3, 4])
        assert rig.engine.drain(30.0) and rig.engine.stats.chunks_put == 2
    finally:
        rig.close()


def test_a_finished_save_frees_its_slot_though_an_older_load_is_still_in_flight():
    tensors = _cache("backing")
    layout = _staged(tensors, runtime=_SlowRuntime())
    copier = layout._copier
    loading = layout.load_rows(0, [7])
    layout.commit_rows(0, [7], loading, [True])  # its copy is not done (nobody waited)
    del loading
    rows, staged = layout.capture_rows(0, [1, 2])
    staged.wait()  # the sender waited for the save's copy
    del rows, staged
    gc.collect()
    copier._prune()
    assert copier.ring.in_use == 0 and copier.load_ring.in_use > 0


def test_a_load_larger_than_its_share_uses_free_save_space_and_saves_never_take_the_load_share():
    tensors = _cache("backing")
    layout = _staged(tensors, staging=64 << 10)  # a 24 KiB load share (eight 3 KiB blocks), 40 KiB for saves
    copier = layout._copier
    chunk = layout.chunk_nbytes(0)
    assert copier.load_ring.capacity == 8 * chunk and copier.ring.capacity == (64 << 10) - 8 * chunk
    big = layout.load_rows(0, list(range(1, 12)))  # 11 blocks: more than the load share
    assert copier.ring.in_use > 0 and copier.load_ring.in_use == 0
    del big
    gc.collect()
    held = []
    with pytest.raises(StagingFull):
        while True:
            held.append(layout.capture_rows(0, [1, 2]))
    assert copier.load_ring.in_use == 0  # saves stopped at their share
    assert layout.load_rows(0, [1, 2, 3, 4]) is not None and 4 * chunk <= copier.load_ring.capacity


def test_loads_on_the_loaders_thread_and_the_engines_at_once_share_the_device_load_buffer_safely(monkeypatch):
    # the loader's thread has taken the device load buffer's slot and not yet queued its copy when the
    # engine's thread loads too and needs that room: it must not take the slot over (nor fail)
    tensors = _cache("backing")
    layout = _staged(tensors, device_bytes=4096)  # room for one block's load segment at a time
    copier = layout._copier
    pool = MemoryBackend(1 << 20)
    rows, staged = layout.capture_rows(0, [1, 2])
    staged.wait()
    pool.put(["a", "b"], rows)
    taken, engine_done = threading.Event(), threading.Event()
    real_take = copier.loads.take

    def take(nbytes, stream):
        start = real_take(nbytes, stream)
        if threading.current_thread().name == "loader":
            taken.set()
            engine_done.wait(1.5)  # the engine's load runs now, unless it has to wait for this one
        return start

    monkeypatch.setattr(copier.loads, "take", take)
    errors = []

    def load(key, block):
        try:
            dest = layout.load_rows(0, [block], owned=True)
            pool.get_into([key], dest)
            layout.commit_rows(0, [block], dest, [True]).synchronize()
        except Exception as exc:  # pragma: no cover - the failure this test is for
            errors.append(exc)

    loader = threading.Thread(target=load, args=("a", 7), name="loader")
    loader.start()
    assert taken.wait(10)
    load("b", 8)
    engine_done.set()
    loader.join(10)
    assert errors == []
    for got, want in zip(_bits(tensors, [7, 8], 0), _bits(tensors, [1, 2], 0)):
        assert torch.equal(got, want)
