"""The device check's round trip on a simulated CUDA device (device_sim.py: writes queued per stream,
run in an adversarial order only when the host waits): it passes with kvpool's waits, and fails when
any one of them is left out, so on a GPU a missing wait gives wrong bytes, not a PASS."""

from __future__ import annotations

import dataclasses

import pytest

from device_sim import SimRig
from kvpool.benchmarks.device import phases
from kvpool.benchmarks.device.plan import Shape, dry_plan

PLAN = dry_plan()
TRIP = dataclasses.replace(
    PLAN.round_trip, shape=Shape(layers=2, block=16, heads=2, head_dim=8, blocks=16), chunks=3, stall_cycles=1
)

BACKING = dataclasses.replace(TRIP, caches=("backing",))  # vLLM 0.32's layout: enough for the mutations


def _round_trip(monkeypatch, drop=(), trip=TRIP):
    rigs = []

    def make(*args, **kwargs):
        rig = SimRig(*args, **kwargs)
        rig.sim.drop |= set(drop)
        rigs.append(rig)
        return rig

    monkeypatch.setattr(phases, "Rig", make)
    result = phases.round_trip(PLAN, trip)
    assert rigs
    return result


def test_the_round_trip_passes_on_a_simulated_device_with_every_wait():
    with pytest.MonkeyPatch.context() as monkeypatch:
        result = _round_trip(monkeypatch)
    assert result["pass"], result


@pytest.mark.parametrize(
    ("missing", "scenario"),
    [
        (("gather", "compute"), "forward"),  # the gather does not wait for the forward's write
        (("compute", "gather"), "reuse"),  # engine work after the save does not wait for the gather
        (("copy", "gather"), "reuse"),  # the device->host copy does not wait for the gather
        (("load", "compute"), "forward"),  # the load does not wait for the engine's queued zeroing
        (("compute", "load"), "reuse"),  # the next forward does not wait for the load
        (("copy", "host"), "forward"),  # the sender does not wait for the device->host copy
    ],
)
def test_the_round_trip_fails_when_any_one_wait_is_missing(missing, scenario):
    with pytest.MonkeyPatch.context() as monkeypatch:
        result = _round_trip(monkeypatch, drop=[missing], trip=BACKING)
    assert result["pass"] is False
    for cache in BACKING.caches:  # the scenario built for this wait catches it in every cache and order
        for order in BACKING.orders:
            assert not result[f"{cache}/{order}/{scenario}"]["exact"], (cache, order)


def _segmented(drop=()):
    import torch

    from device_sim import QueueWrites, SimRuntime
    from kvpool.backends.memory import MemoryBackend
    from kvpool.benchmarks.device.cache import backing_cache, fill_random
    from kvpool.worker.layout import KVLayout

    _, tensors = backing_cache(torch, 3, 12, 16, 2, 8, torch.bfloat16, "cpu")
    fill_random(torch, tensors, 3)
    sim = SimRuntime()
    sim.drop |= set(drop)
    chunk = 3 * 2 * 16 * 2 * 8 * 2
    layout = KVLayout(tensors, dict.fromkeys(tensors, 0), 12, staged=True, runtime=sim, device_bytes=2 * chunk + 1024)
    source, target = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    before = [t[source].clone() for t in tensors.values()]
    pool = MemoryBackend(1 << 22)
    keys = [f"k{i}" for i in source]
    with QueueWrites(sim):
        rows, staged = layout.capture_rows(0, source)  # three segments through a two-block buffer
        staged.wait()
        pool.put(keys, rows)
        dest = layout.load_rows(0, target)
        pool.get_into(keys, dest)
        layout.commit_rows(0, target, dest, [True] * 5)  # three segments too
        sim.run_all()
    return all(torch.equal(b.view(torch.int16), t[target].view(torch.int16)) for b, t in zip(before, tensors.values()))


def test_saves_and_loads_in_segments_reuse_the_device_buffer_only_after_its_copy():
    assert _segmented()
    assert not _segmented(drop=[("gather", "copy")])  # a gather into a slot the copy still reads
    # (a load's segments are all on the load stream: each waits for the one before by stream order)


def test_the_engine_thread_phase_on_the_simulated_device_loads_and_partially_loads_exactly():
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(phases, "Rig", SimRig)
        plan = dataclasses.replace(PLAN, engine_thread=dataclasses.replace(PLAN.engine_thread, shape=TRIP.shape))
        result = phases.engine_thread(plan, plan.engine_thread)
    for mode in ("off", "full"):
        assert result[mode]["ok"] and result[mode]["partial_load"]["arrived_exact"], result[mode]
