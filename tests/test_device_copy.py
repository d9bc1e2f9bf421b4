"""The device copy path, on the CPU: the staging ring's accounting, the order of stream waits and
event records, and device-layout saves and loads through the worker (host tensors stand in for CUDA)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.backends.base import Status
from kvpool.backends.memory import MemoryBackend
from kvpool.benchmarks.device.rig import staged_layout
from kvpool.core.config import Integrity
from kvpool.core.errors import LayoutError
from kvpool.worker.cuda_runtime import InlineRuntime
from kvpool.worker.device_copy import DeviceCopier, StagingFull
from kvpool.worker.staging import StagingRing

NUM_BLOCKS = 8


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 10**6)), max_size=60))
def test_the_ring_never_hands_out_overlapping_slots_and_reuses_space_once_returned(ops):
    ring = StagingRing(torch.empty(100, dtype=torch.uint8))
    out: dict[int, int] = {}  # start -> end of slots taken and not given back
    for take, size, pick in ops:
        if take or not out:
            got = ring.take(size)
            if got is None:
                # full: no free run of `size` bytes at the head or after wrapping
                assert out
                continue
            start, view = got
            assert view.numel() == size and start >= 0 and start + size <= 100
            assert all(start + size <= s or e <= start for s, e in out.items()), "overlapping slots"
            out[start] = start + size
        else:
            start = sorted(out)[pick % len(out)]
            ring.give_back(start)
            del out[start]
        assert ring.in_use == sum(e - s for s, e in out.items())
    for start in list(out):
        ring.give_back(start)
    assert ring.in_use == 0 and ring.take(100) is not None  # all of it, once everything is back


def test_a_batch_larger_than_the_ring_is_a_clear_error_naming_the_setting():
    ring = StagingRing(torch.empty(64, dtype=torch.uint8))
    with pytest.raises(LayoutError, match=r"100 bytes .* 64-byte host staging ring \(save_buffer_bytes\)"):
        ring.take(100)


def _layout(runtime: InlineRuntime | None = None, integrity: Integrity = Integrity.OFF, staging: int = 1 << 20):
    rng = np.random.default_rng(1)
    tensors = {
        f"layer{i}": torch.from_numpy(rng.integers(0, 256, (2, NUM_BLOCKS, 256), dtype=np.uint8)) for i in range(2)
    }
    return staged_layout(tensors, NUM_BLOCKS, integrity, staging, runtime), tensors


def test_a_save_gathers_after_the_forward_and_copies_on_another_stream_the_engine_waits_only_for_the_gather():
    runtime = InlineRuntime()
    layout, _ = _layout(runtime)
    runtime.log.clear()
    _, staged = layout.capture_rows(0, [1, 2])
    assert staged is not None
    log = [(op, stream) for op, stream, _ in runtime.log]
    assert log == [
        ("record", "compute"),  # the forward wrote the blocks
        ("use", "copy1"),  # the gather stream
        ("wait", "copy1"),  # starts after the forward, on the device
        ("record", "copy1"),  # gathered
        ("leave", "copy1"),
        ("use", "copy2"),  # the copy stream: the next step's gather never queues behind this copy
        ("wait", "copy2"),  # the device-to-host copy starts once gathered
        ("record", "copy2"),  # done
        ("leave", "copy2"),
        ("wait", "compute"),  # later engine work waits for the gather on the device, not for the copy
    ]
    ids = [event for op, _, event in runtime.log if op in ("record", "wait")]
    forward, gathered = ids[0], ids[2]
    assert ids[1] == forward and ids[3] == gathered and ids[-1] == gathered and ids[4] == id(staged.done)


def test_a_load_into_device_memory_waits_for_the_engine_before_it_and_the_forward_waits_for_it():
    runtime = InlineRuntime()
    layout, tensors = _layout(runtime)
    host = layout.load_rows(0, [3, 4])
    host.arrays[0][:] = 7
    started = layout.engine_point()  # taken on the engine's thread when the load starts
    assert started is not None
    runtime.log.clear()
    done = layout.commit_rows(0, [3, 4], host, [True, False], after=started)
    assert done is not None and done.query()
    ops = [(op, stream, event) for op, stream, event in runtime.log]
    inner = done.event  # type: ignore[attr-defined]
    assert ops == [
        ("use", "copy3", 0),
        ("wait", "copy3", id(started.event)),  # never under the engine's own writes to these blocks (V2 zeroing)
        ("record", "copy3", id(inner)),
        ("leave", "copy3", 0),
        ("wait", "compute", id(inner)),  # the forward runs after the load, on the device
    ]
    for tensor in tensors.values():
        assert (tensor[:, 3] == 7).all() and not (tensor[:, 4] == 7).all()  # only what arrived


@pytest.mark.parametrize("integrity", [Integrity.OFF, Integrity.SAMPLED])
def test_device_layout_round_trip_through_the_pool_with_seals(integrity):
    layout, tensors = _layout(integrity=integrity)
    pool = MemoryBackend(1 << 22)
    rows, staged = layout.capture_rows(0, [1, 5])
    assert staged is not None
    staged.wait()
    assert pool.put(["a", "b"], rows) == [Status.OK] * 2
    expected = {name: tensor[:, [1, 5]].clone() for name, tensor in tensors.items()}
    dest = layout.load_rows(0, [6, 7])
    statuses = layout.verify(0, dest, pool.get_into(["a", "b"], dest))
    assert statuses == [Status.OK] * 2
    layout.commit_rows(0, [6, 7], dest, [True, True])
    for name, tensor in tensors.items():
        assert torch.equal(tensor[:, [6, 7]], expected[name])


def test_a_ring_full_of_copies_in_flight_raises_staging_full_and_frees_once_they_are_dropped():
    layout, _ = _layout(staging=8192)  # a 4 KiB save share: room for one slot of three 1 KiB blocks
    first = layout.capture_rows(0, [1, 2, 3])
    with pytest.raises(StagingFull):
        layout.capture_rows(0, [4])
    del first
    gc.collect()
    _, staged = layout.capture_rows(0, [4])
    assert staged is not None


def test_host_slots_stay_out_of_the_ring_until_their_copy_is_done():
    class Pending:
        def __init__(self) -> None:
            self.finished = False

        def query(self) -> bool:
            return self.finished

        def synchronize(self) -> None:
            self.finished = True

        def record(self, stream: object) -> None:
            return

    copier = DeviceCopier(InlineRuntime(), 4096)
    slot = copier.host_slot(1, 2048)
    assert slot is not None
    pending = Pending()
    copier._hold(pending, slot)  # a copy the device still runs into these rows
    del slot
    gc.collect()
    assert copier.host_slot(1, 2048) is None  # dropped by every caller, but the device still writes there
    pending.synchronize()
    assert copier.host_slot(1, 2048) is not None


def test_a_load_committed_on_the_loaders_thread_makes_no_stream_of_that_thread_wait():
    import threading

    runtime = InlineRuntime()
    layout, _ = _layout(runtime)
    host = layout.load_rows(0, [3])
    started = layout.engine_point()  # on the engine's thread
    runtime.log.clear()
    worker = threading.Thread(target=layout.commit_rows, args=(0, [3], host, [True], started))
    worker.start()
    worker.join()
    # the loader's current stream may be the legacy default stream vLLM's forward runs on: never made to
    # wait; the load is reported finished once done, and the engine waits for that
    assert [(op, stream) for op, stream, _ in runtime.log if stream == "compute"] == []
