"""The device check's phases. Each builds its own rig from its plan and returns one JSON-able dict with
"pass" (True, False, or None when not judged: CPU figures say nothing about a GPU)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from kvpool.benchmarks.device.plan import BandwidthRow, EngineThreadPlan, OverlapPlan, Plan, RoundTripPlan
from kvpool.benchmarks.device.rig import Rig, SyncCounter
from kvpool.core.config import Integrity

BANDWIDTH_TARGET = 0.8
OVERLAP_TARGET = 1.03


def round_trip(plan: Plan, trip: RoundTripPlan) -> dict[str, Any]:
    """Bytes loaded back equal the bytes the forward wrote, though the saved blocks were reused right
    after the save, in both runners' orders, for both cache layouts. Long device work is queued before
    each save and load so that every missing wait gives wrong bytes, every time:

    - "forward": the forward's write runs late on the compute stream (a gather that does not wait for
      it reads stale blocks), the device->host copy runs late (a sender that does not wait for it puts
      stale bytes), the engine's zeroing of the load's blocks runs late (a load that does not wait for
      the engine's queued work is zeroed after landing);
    - "reuse": the gather runs late (engine work after the save that does not wait for it overwrites
      the blocks first), the load's copy runs late (a forward that does not wait for it reads stale)."""
    results: dict[str, Any] = {}
    late = trip.stall_cycles
    for cache in trip.caches:
        rig = Rig(trip.shape, plan.device, plan.pool_bytes, cache=cache, staging_bytes=plan.staging_bytes)
        try:
            runs = [len(runs) for runs in rig.layout._runs]
            for order in trip.orders:
                for scenario in ("forward", "reuse"):
                    source, target = (rig.blocks(first, count) for first, count in trip.ranges())
                    values = rig.payload(source, len(results))
                    expected = [value.view(rig.torch.int16) for value in values]
                    rig.stall(late if scenario == "forward" else 0, "compute", "copy")
                    rig.write(source, values)  # the step's forward
                    rig.stall(late if scenario == "reuse" else 0, "gather")
                    _, hashes = rig.save(source, order)
                    assert rig.engine.drain(120.0), "saves did not finish"
                    rig.synchronize()
                    rig.stall(late if scenario == "forward" else 0, "compute")
                    rig.overwrite(target, 0.0)  # Model Runner V2 zeroes the load's new blocks
                    rig.stall(late if scenario == "reuse" else 0, "load")
                    rig.load(hashes, target)
                    seen = rig.snapshot(target)  # the next forward reads them, on the compute stream
                    rig.synchronize()
                    results[f"{cache}/{order}/{scenario}"] = {
                        "chunks": trip.chunks,
                        "exact": rig.same(expected, seen),
                        "loads_failed": rig.engine.stats.chunks_load_failed,
                        "gather_runs": runs,
                    }
        finally:
            rig.close()
    results["pass"] = all(entry["exact"] and not entry["loads_failed"] for entry in results.values())
    return results


def engine_thread(plan: Plan, phase: EngineThreadPlan) -> dict[str, Any]:
    """On the engine's thread, as vLLM calls it with the embedded pool (loads run inline): a save, a
    load and a partial load (one chunk missing from the pool), integrity off and on. Counts every host
    wait on the GPU made on that thread (target: none) apart from the calls' own host work."""
    results: dict[str, Any] = {}
    for mode in phase.integrity:
        rig = Rig(
            phase.shape, plan.device, plan.pool_bytes, integrity=Integrity(mode), staging_bytes=plan.staging_bytes
        )
        try:
            source, target, partial = (rig.blocks(first, count) for first, count in phase.ranges())
            rig.stall(1)  # CUDA initialized and streams warm before counting
            rig.synchronize()
            calls: dict[str, Any] = {}
            hashes: list[bytes] = []
            for call in ("save", "load", "partial_load"):
                with SyncCounter(rig.torch, rig.runtime) as counter:
                    began = time.perf_counter()
                    if call == "save":
                        _, hashes = rig.save(source)
                    elif call == "load":
                        req = rig.start_load(hashes, target)
                    else:
                        missing = rig.hashes(1, "never-saved")
                        middle = len(hashes) // 2
                        req = rig.start_load([*hashes[:middle], *missing, *hashes[middle + 1 :]], partial)
                    seconds = time.perf_counter() - began
                calls[call] = {
                    "syncs": counter.count,
                    "sync_kinds": counter.kinds,
                    "sync_s": round(counter.seconds, 6),
                    "host_work_s": round(seconds - counter.seconds, 6),  # the call's own memcpy, hashing, ...
                }
                if call == "save":
                    assert rig.engine.drain(120.0), "saves did not finish"
                else:
                    rig.wait_loaded(req)
            failures = rig.engine.take_load_failures()
            calls["partial_load"]["failed_blocks"] = sorted(failures.invalid_blocks)
            rig.synchronize()
            gone = len(source) // 2  # the partial load's missing chunk: every other block arrived
            arrived = [index for index in range(len(source)) if index != gone]
            expected, seen = rig.snapshot(source), rig.snapshot(target)
            expected_part = rig.snapshot([source[index] for index in arrived])
            seen_part = rig.snapshot([partial[index] for index in arrived])
            rig.synchronize()
            partial_ok = rig.same(expected_part, seen_part)
            calls["partial_load"]["arrived_exact"] = partial_ok
            calls["ok"] = rig.same(expected, seen) and partial_ok and failures.invalid_blocks == {partial[gone]}
            results[mode] = calls
        finally:
            rig.close()
    results["pass"] = all(
        entry["ok"] and all(entry[call]["syncs"] == 0 for call in ("save", "load", "partial_load"))
        for entry in results.values()
    )
    return results


def _timed(rig: Rig, call: Any, reps: int) -> float:
    """Median seconds of `call()` (the device synchronized around each)."""
    samples = []
    for _ in range(reps + 1):
        rig.synchronize()
        began = time.perf_counter()
        call()
        rig.synchronize()
        samples.append(time.perf_counter() - began)
    return float(np.median(samples[1:]))


def bandwidth_row(plan: Plan, row: BandwidthRow) -> dict[str, Any]:
    rig = Rig(row.shape, plan.device, plan.pool_bytes, staging_bytes=plan.staging_bytes)
    try:
        torch, layout = rig.torch, rig.layout
        blocks = rig.blocks(*row.ranges()[0])
        pinned = plan.device != "cpu"
        device_rows = torch.empty(row.nbytes, dtype=torch.uint8, device=plan.device)
        host_rows = torch.empty(row.nbytes, dtype=torch.uint8, pin_memory=pinned)

        def kvpool_save() -> None:
            _, staged = layout.capture_rows(0, blocks)
            if staged is not None:
                staged.wait()

        def kvpool_load() -> None:
            loading = layout.load_rows(0, blocks)
            layout.commit_rows(0, blocks, loading, [True] * row.batch)

        def through_pool() -> None:
            rig.save(blocks)
            assert rig.engine.drain(120.0)

        times = {
            "raw_d2h": _timed(rig, lambda: host_rows.copy_(device_rows, non_blocking=True), row.reps),
            "raw_h2d": _timed(rig, lambda: device_rows.copy_(host_rows, non_blocking=True), row.reps),
            "save": _timed(rig, kvpool_save, row.reps),
            "load": _timed(rig, kvpool_load, row.reps),
            "save_through_pool": _timed(rig, through_pool, max(1, row.reps // 2)),
        }
    finally:
        rig.close()
    gbps = {name: row.nbytes / seconds / 1e9 for name, seconds in times.items()}
    return {
        "chunk_bytes": row.shape.chunk_bytes,
        "batch": row.batch,
        "gbps": {name: float(f"{value:.3g}") for name, value in gbps.items()},
        "save_ratio": round(gbps["save"] / gbps["raw_d2h"], 3),
        "load_ratio": round(gbps["load"] / gbps["raw_h2d"], 3),
    }


def pcie_peak(device: str, nbytes: int) -> dict[str, float]:
    import torch

    pinned = device != "cpu"
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    result = {}
    for name, (dst, src) in {"d2h": (host, device_buffer), "h2d": (device_buffer, host)}.items():
        samples = []
        for _ in range(4):
            if pinned:
                torch.cuda.synchronize()
            began = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            if pinned:
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - began)
        result[f"{name}_gbps"] = round(nbytes / float(np.median(samples[1:])) / 1e9, 2)
    return result


def bandwidth(plan: Plan) -> dict[str, Any]:
    rows = [bandwidth_row(plan, row) for row in plan.bandwidth]
    judged = plan.device != "cpu"
    ok = all(min(r["save_ratio"], r["load_ratio"]) >= BANDWIDTH_TARGET for r in rows)
    return {
        "rows": rows,
        "pcie_peak": pcie_peak(plan.device, plan.pcie_bytes),
        "target": BANDWIDTH_TARGET,
        "pass": ok if judged else None,
    }


def overlap(plan: Plan, phase: OverlapPlan) -> dict[str, Any]:
    """The engine's pattern on a dedicated compute stream: per step `forwards` matmuls, then that step's
    save; in C windows a load is also started each step and runs on the loader's thread (a remote
    pool's path). Windows ABC CBA interleaved, timed with CUDA events on the compute stream, judged on
    medians; FAIL when the traffic did not run."""
    rig = Rig(phase.shape, plan.device, plan.pool_bytes, sync_loads=False, staging_bytes=plan.staging_bytes)
    torch, cuda = rig.torch, plan.device != "cpu"
    try:
        a = torch.randn(phase.size, phase.size, device=plan.device, dtype=torch.bfloat16)
        b = torch.randn(phase.size, phase.size, device=plan.device, dtype=torch.bfloat16)
        out = torch.empty_like(a)
        compute = torch.cuda.Stream() if cuda else None
        source, target = (rig.blocks(first, count) for first, count in phase.ranges())
        _, seed_hashes = rig.save(source)  # what the loads read
        assert rig.engine.drain(120.0)
        stats = rig.engine.stats
        before = (stats.bytes_put, stats.bytes_loaded, stats.chunks_load_failed, stats.save_jobs_dropped)
        moved = {"loads": 0}
        pending: list[str] = []

        def step(kind: str) -> None:
            for _ in range(phase.forwards):
                torch.matmul(a, b, out=out)
            if kind in "BC":
                rig.save(source)  # after the forward, on the compute stream, as the worker's save hook
            if kind == "C":
                finished = rig.engine.take_finished_loads()
                if pending and pending[0] in finished:
                    pending.pop()
                    moved["loads"] += 1
                if not pending:
                    pending.append(rig.start_load(seed_hashes, target))  # copied on the loader's thread

        def window(kind: str) -> float:
            context = torch.cuda.stream(compute) if compute is not None else _null()
            with context:
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                began = time.perf_counter()
                for _ in range(phase.steps):
                    step(kind)
                if cuda:
                    end.record()
                    end.synchronize()
                    return float(start.elapsed_time(end)) / 1000.0
                return time.perf_counter() - began

        window("A")  # warm-up
        samples: dict[str, list[float]] = {"A": [], "B": [], "C": []}
        for _ in range(phase.rounds):
            for kind in "ABCCBA":
                samples[kind].append(window(kind))
                assert rig.engine.drain(120.0)
        if pending:
            rig.wait_loaded(pending.pop())
            moved["loads"] += 1
        after = (stats.bytes_put, stats.bytes_loaded, stats.chunks_load_failed, stats.save_jobs_dropped)
    finally:
        rig.close()
    medians = {kind: float(np.median(values)) for kind, values in samples.items()}
    slow_saves = medians["B"] / medians["A"]
    slow_both = medians["C"] / medians["A"]
    saved, loaded, failed, dropped = (now - then for now, then in zip(after, before))
    ran = saved > 0 and loaded > 0 and moved["loads"] > 0 and failed == 0
    judged = cuda
    return {
        "median_s": {kind: round(value, 5) for kind, value in medians.items()},
        "slowdown_saves": round(slow_saves, 4),
        "slowdown_saves_and_loads": round(slow_both, 4),
        "bytes_saved": saved,  # put into the pool during the windows
        "bytes_loaded": loaded,
        "loads": moved["loads"],
        "chunks_load_failed": failed,
        "saves_dropped": dropped,  # steps whose save found the ring or the sender full
        "traffic_ran": ran,
        "target": OVERLAP_TARGET,
        "pass": (ran and max(slow_saves, slow_both) <= OVERLAP_TARGET) if judged else (None if ran else False),
    }


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def run_phase(name: str, plan: Plan) -> dict[str, Any]:
    if name == "round_trip":
        return round_trip(plan, plan.round_trip)
    if name == "engine_thread":
        return engine_thread(plan, plan.engine_thread)
    if name == "bandwidth":
        return bandwidth(plan)
    if name == "overlap":
        return overlap(plan, plan.overlap)
    if name == "hang":  # a phase that never ends: what the watchdog test runs
        threading.Event().wait()
    raise ValueError(f"unknown phase {name!r}")
