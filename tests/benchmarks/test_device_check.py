"""`scripts/device_check.sh`: the GPU check's plan, checked on the CPU with the GPU's shapes (without
allocating them), its phases run small on the CPU (`--dry-run`), each phase on its own with its JSON
written as it goes, and a watchdog that dumps stacks and exits before the outer budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpool.benchmarks.device import check as device_check
from kvpool.benchmarks.device import phases as device_phases
from kvpool.benchmarks.device.plan import BandwidthRow, Plan, RoundTripPlan, Shape, check_plan, dry_plan, gpu_plan
from kvpool.benchmarks.device.rig import SyncCounter
from kvpool.worker.cuda_runtime import InlineRuntime

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "device_check.sh")
ENV = {**os.environ, "PYTHON": sys.executable}


def _script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, env=ENV, timeout=timeout)


def test_the_gpu_plan_passes_its_check_every_phase_inside_its_cache_and_the_time_budget():
    plan = gpu_plan()
    checked = check_plan(plan)
    assert checked["ok"], checked["problems"]
    assert set(checked["phases"]) == {"round_trip", "engine_thread", "bandwidth", "overlap"}
    assert checked["estimate_s"] < plan.watchdog_s < plan.budget_s <= 240
    assert {row.shape.chunk_bytes for row in plan.bandwidth} == {256 << 10, 2 << 20, 4 << 20}
    assert plan.round_trip.caches == ("backing", "per_layer") and plan.round_trip.stall_cycles > 0
    assert plan.overlap.rounds >= 1 and plan.engine_thread.integrity == ("off", "full")


def test_the_plan_check_catches_the_bandwidth_row_that_crashed_the_first_gpu_run():
    plan = gpu_plan()
    old = BandwidthRow(Shape(layers=4, blocks=1024), batch=1024, reps=8)  # blocks 1..1024 of 1024
    broken = Plan(**{**plan.__dict__, "bandwidth": (old, *plan.bandwidth[1:])})
    checked = check_plan(broken)
    assert not checked["ok"]
    assert any("blocks 1..1024 are outside 1..1023" in problem for problem in checked["problems"])


def test_the_plan_check_catches_an_engine_thread_load_larger_than_the_ring():
    plan = gpu_plan()
    small_ring = 512 << 20  # 128 MiB for loads, 384 MiB for saves
    trip = RoundTripPlan(plan.round_trip.shape, chunks=256)  # 512 MiB and ids: more than the whole ring
    broken = Plan(**{**plan.__dict__, "staging_bytes": small_ring, "round_trip": trip})
    problems = check_plan(broken)["problems"]
    assert any("engine-thread load(s) of 256 chunks" in problem for problem in problems), problems


def test_plan_only_checks_every_phase_of_the_gpu_plan_on_the_cpu_without_allocating_it():
    done = _script("--plan-only")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["verdict"] == "PASS" and result["check"]["ok"] and result["dry_check"]["ok"]
    assert result["plan"]["device"] == "cuda" and result["plan"]["round_trip"]["shape"]["blocks"] == 2048
    assert set(result["check"]["phases"]) == set(result["plan"]["phases"])


def test_the_dry_run_passes_every_phase_and_writes_the_same_json_to_out(tmp_path):
    out = tmp_path / "device_check.json"
    done = _script("--dry-run", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["verdict"] == "PASS" and done.stderr.strip().endswith("PASS")
    assert json.loads(out.read_text())["phases"].keys() == result["phases"].keys()
    phases = result["phases"]
    for cache in ("backing", "per_layer"):  # vLLM 0.32's backing buffer and per-layer tensors
        for order in ("v1", "v2"):  # saved blocks reused right after the save, as each runner does
            for scenario in ("forward", "reuse"):  # on a GPU: device sleeps exposing each missing wait
                entry = phases["round_trip"][f"{cache}/{order}/{scenario}"]
                assert entry["exact"] and entry["loads_failed"] == 0
    assert phases["round_trip"]["backing/v1/forward"]["gather_runs"] == [1]  # all layers in one gather
    for mode in ("off", "full"):
        calls = phases["engine_thread"][mode]
        assert calls["ok"] and all(calls[call]["syncs"] == 0 for call in ("save", "load", "partial_load"))
        assert len(calls["partial_load"]["failed_blocks"]) == 1
    assert {row["chunk_bytes"] for row in phases["bandwidth"]["rows"]} == {8192, 16384}
    assert all(value > 0 for row in phases["bandwidth"]["rows"] for value in row["gbps"].values())
    assert phases["overlap"]["traffic_ran"] and phases["overlap"]["loads"] > 0
    assert phases["bandwidth"]["pass"] is None and phases["overlap"]["pass"] is None  # not judged on a CPU


def test_a_failing_phase_leaves_every_other_phase_json_written_after_each(tmp_path, monkeypatch):
    real = device_phases.run_phase
    seen: list[set[str]] = []
    out = tmp_path / "out.json"

    def flaky(name, plan):
        if out.exists():
            seen.append(set(json.loads(out.read_text())["phases"]))
        if name == "engine_thread":
            raise RuntimeError("boom")
        return {"pass": True} if name != "round_trip" else real(name, plan)

    monkeypatch.setattr(device_phases, "run_phase", flaky)
    report = device_check.Report(out, {"dry_run": True})
    verdict = device_check.run(dry_plan(), report, ["round_trip", "engine_thread", "bandwidth", "overlap"])
    assert verdict == "FAIL"
    phases = json.loads(out.read_text())["phases"]
    assert phases["engine_thread"]["pass"] is False and "boom" in phases["engine_thread"]["error"]
    assert phases["round_trip"]["pass"] is True and phases["overlap"]["pass"] is True
    assert seen == [
        set(),
        {"round_trip"},
        {"round_trip", "engine_thread"},
        {"round_trip", "engine_thread", "bandwidth"},
    ]


def test_the_watchdog_dumps_stacks_and_exits_with_the_finished_phases_json_needing_only_torch_and_numpy(tmp_path):
    out = tmp_path / "out.json"
    args = ["--dry-run", "--phases", "round_trip,hang", "--watchdog-s", "2.5", "--out", str(out)]
    code = (  # the check imports nothing but torch, numpy and kvpool's core: the rest is blocked
        "import sys, runpy\n"
        "for name in ('vllm', 'rich', 'typer', 'prometheus_client', 'hypothesis', 'mooncake'):\n"
        "    sys.modules[name] = None\n"
        f"sys.argv = ['device_check', *{args!r}]\n"
        "runpy.run_module('kvpool.benchmarks.device.check', run_name='__main__')\n"
    )
    env = {**ENV, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "watchdog" in done.stderr and "Thread 0x" in done.stderr and "in wait" in done.stderr
    result = json.loads(out.read_text())
    assert result["verdict"] == "TIMEOUT" and result["phases"]["round_trip"]["pass"] is True


def test_isolated_phases_a_hung_phase_is_ended_with_its_stacks_and_the_next_phase_still_runs(tmp_path, capfd):
    out = tmp_path / "out.json"
    report = device_check.Report(out, {"dry_run": True})
    monkey = pytest.MonkeyPatch()
    monkey.setenv("PYTHONPATH", str(ROOT / "src"))  # the phase processes import kvpool from the tree
    try:
        verdict = device_check.run_isolated(True, report, ["hang", "round_trip"], budget_s=60, phase_limit_s=3)
    finally:
        monkey.undo()
    assert verdict == "FAIL"
    err = capfd.readouterr().err
    assert "Timeout" in err and "in wait" in err  # the hung phase process's stacks
    phases = json.loads(out.read_text())["phases"]
    assert phases["hang"]["pass"] is False and "time limit" in phases["hang"]["error"]
    assert phases["round_trip"]["pass"] is True  # in a fresh process


def test_without_cuda_the_full_check_says_to_use_the_dry_run(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert device_check.main([]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_without_a_venv_the_script_runs_python3_from_the_path(tmp_path):
    import shutil

    for part in ("scripts", "src"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {key: value for key, value in ENV.items() if key != "PYTHON"}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        [str(tmp_path / "scripts" / "device_check.sh"), "--plan-only"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["verdict"] == "PASS"


def test_the_engine_thread_counter_counts_host_waits_on_its_thread_only():
    import threading

    runtime = InlineRuntime()
    with SyncCounter(torch, runtime) as counter:
        runtime.new_event().synchronize()  # the engine's thread waits: counted
        other = threading.Thread(target=lambda: runtime.new_event().synchronize(), name="kvpool-sender")
        other.start()
        other.join()
    assert counter.count == 1 and counter.kinds == {"event.synchronize": 1}


def test_on_cuda_the_counter_counts_explicit_and_implicit_syncs_of_the_engine_thread_only(monkeypatch):
    import threading
    import warnings

    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    real_sync, shown = torch.cuda.synchronize, warnings.showwarning

    def elsewhere():
        torch.cuda.synchronize()
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    with SyncCounter(torch, None) as counter:
        torch.cuda.synchronize()  # explicit, on the engine's thread
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)  # implicit
        other = threading.Thread(target=elsewhere)
        other.start()
        other.join()
    assert counter.count == 2 and counter.kinds == {"device.synchronize": 1, "implicit": 1}
    assert modes == ["warn", 0] and torch.cuda.synchronize is real_sync and warnings.showwarning is shown


def test_the_engine_thread_phase_fails_when_a_load_waits_for_the_gpu_on_that_thread(monkeypatch):
    from kvpool.worker.device_copy import DeviceCopier

    real = DeviceCopier.load

    def waiting(self, *args, **kwargs):
        done = real(self, *args, **kwargs)
        done.synchronize()  # the stall the phase exists to catch
        return done

    monkeypatch.setattr(DeviceCopier, "load", waiting)
    result = device_phases.engine_thread(dry_plan(), dry_plan().engine_thread)
    assert result["pass"] is False
    for mode in ("off", "full"):
        assert result[mode]["save"]["syncs"] == 0
        assert result[mode]["load"]["syncs"] >= 1 and result[mode]["partial_load"]["syncs"] >= 1
