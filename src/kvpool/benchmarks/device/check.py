"""The device check: kvpool's worker core and embedded pool on synthetic vLLM-shaped paged KV caches on
CUDA, with no vLLM and no network (a lent GPU machine has torch and numpy). The plan (shapes, block
ranges, sizes, time) comes from `plan.py`; the phases from `phases.py`:

1. **round_trip**: save -> load is byte-exact with the saved blocks reused right after the save, in
   both runners' orders (V1: the next step's hook, then the engine writes the blocks; Model Runner V2:
   the engine zeroes them before that hook), for vLLM 0.32's cache (one int8 backing buffer with
   strided per-layer views) and per-layer tensors, with long device work queued on every stream
   before each save and load, so a missing event or stream wait gives wrong bytes every time.
2. **engine_thread**: a save, a load and a partial load on the engine's thread (the embedded pool's
   inline loads), integrity off and full: no host wait on the GPU on that thread (counted and timed),
   apart from the calls' own host work (reported).
3. **bandwidth**: save and load GB/s through kvpool's copy path against raw pinned copies of the same
   bytes in the same run (target >= 0.8), for 256 KiB, 2 MiB and 4 MiB chunks, and the PCIe peak.
4. **overlap**: the engine's pattern on a dedicated compute stream (forwards, then the step's save;
   async loads on the loader's thread), interleaved ABC/CBA windows timed with CUDA events, medians
   slowed by <= 3%; FAIL when the traffic did not run.

Every phase runs on its own: one that fails or raises still leaves every other phase's JSON, and on a
GPU each phase runs in a process of its own (`--isolate`), so a sticky CUDA error or a hang ends only
that phase (the child dumps its stacks and exits at its time limit). The JSON goes to stdout at the
end and to `--out` after every phase; a watchdog dumps every thread's stack and exits (code 3) before
the outer budget, with the finished phases' JSON written. `--dry-run` runs the
same phases small on the CPU; `--plan-only` checks the GPU plan on the CPU without allocating it.
Exit 0 on PASS, 1 on FAIL. `scripts/device_check.sh` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from kvpool.benchmarks.device.plan import Plan, check_plan, dry_plan, gpu_plan


class Report:
    """The check's JSON, written to `out` (atomically) after every phase."""

    def __init__(self, out: Path | None, head: dict[str, Any]) -> None:
        self.out = out
        self.data: dict[str, Any] = {**head, "phases": {}, "verdict": "RUNNING"}
        self._lock = threading.Lock()
        self.began = time.perf_counter()
        self.write()

    def phase(self, name: str, result: dict[str, Any]) -> None:
        with self._lock:
            self.data["phases"][name] = result
        self.write()

    def finish(self, verdict: str) -> None:
        with self._lock:
            self.data["verdict"] = verdict
        self.write()

    def write(self) -> None:
        with self._lock:
            self.data["seconds"] = round(time.perf_counter() - self.began, 1)
            text = json.dumps(self.data, indent=2, default=str)
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            partial = self.out.with_suffix(self.out.suffix + ".partial")
            partial.write_text(text)
            os.replace(partial, self.out)


def start_watchdog(seconds: float, report: Report) -> threading.Timer:
    """After `seconds`: every thread's stack to stderr, the JSON so far written, exit code 3."""

    def fire() -> None:
        print(f"device check: watchdog after {seconds:.0f} s; stacks follow", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for child in list(_CHILDREN):  # a phase process still running: its stacks, then it ends
            with contextlib.suppress(OSError):
                child.send_signal(signal.SIGABRT)  # faulthandler in the child dumps its stacks
                child.wait(5)
            with contextlib.suppress(OSError):
                child.kill()
        report.data["watchdog"] = f"fired after {seconds:.0f} s"
        report.finish("TIMEOUT")
        print(json.dumps(report.data, indent=2, default=str))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def run(plan: Plan, report: Report, phases: list[str]) -> str:
    from kvpool.benchmarks.device.phases import run_phase

    for name in phases:
        began = time.perf_counter()
        try:
            result = run_phase(name, plan)
        except Exception as exc:  # one failing phase never hides the others
            result = _raised(exc)
        _report_phase(report, name, result, began)
    return _verdict(report, phases)


def _raised(exc: Exception) -> dict[str, Any]:
    """A phase that raised: failed, with why."""
    return {"pass": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}


def _report_phase(report: Report, name: str, result: dict[str, Any], began: float) -> None:
    result["seconds"] = round(time.perf_counter() - began, 1)
    report.phase(name, result)
    print(f"device check: {name}: {result.get('pass')} in {result['seconds']} s", file=sys.stderr)


def _verdict(report: Report, phases: list[str]) -> str:
    results: dict[str, Any] = report.data["phases"]
    judged = [results[name]["pass"] for name in phases]
    return "PASS" if all(value is not False for value in judged) else "FAIL"


_CHILDREN: list[subprocess.Popen[bytes]] = []  # the phase process running now, if any
PHASE_RESERVE_S = 10.0  # kept back from a phase's limit for the ones after it and the report


def run_isolated(dry_run: bool, report: Report, phases: list[str], budget_s: float, phase_limit_s: float) -> str:
    """Each phase in a process of its own, so a sticky CUDA error or a hang in one phase ends only that
    phase: the child dumps its stacks and exits at its limit (the time left, less a reserve), and the
    next phase runs in a fresh process."""
    deadline = time.monotonic() + budget_s
    for index, name in enumerate(phases):
        began = time.perf_counter()
        after = len(phases) - index - 1  # each phase after this one keeps a reserve
        limit = min(phase_limit_s, deadline - time.monotonic() - PHASE_RESERVE_S * (1 + after))
        if limit < 1:
            report.phase(name, {"pass": False, "error": "no time left in the budget for this phase", "seconds": 0.0})
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "phase.json"
            command = [sys.executable, "-m", "kvpool.benchmarks.device.check", "--phase-child", name]
            command += ["--phase-out", str(out), "--phase-limit", f"{limit:.1f}"]
            command += ["--dry-run"] if dry_run else []
            child = subprocess.Popen(command, stdout=sys.stderr)
            _CHILDREN.append(child)
            try:
                code: int | str = child.wait(timeout=limit + 60)  # + the child's start and imports
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                code = "killed"
            finally:
                _CHILDREN.remove(child)
            if out.exists():
                result = json.loads(out.read_text())
            else:
                why = "hit its time limit (stacks above)" if code in (1, "killed") else "died"
                result = {"pass": False, "error": f"phase process {why}: exit {code}, limit {limit:.0f} s"}
        _report_phase(report, name, result, began)
    return _verdict(report, phases)


def phase_child(name: str, dry_run: bool, out: Path, limit_s: float) -> int:
    """One phase in this process: its JSON to `out`; at `limit_s`, every thread's stack and exit 1."""
    import torch  # noqa: F401  (the interpreter's start and imports are not the phase's time)

    from kvpool.benchmarks.device.phases import run_phase

    faulthandler.enable()  # stacks on a fatal signal (the parent's watchdog sends SIGABRT)
    faulthandler.dump_traceback_later(limit_s, exit=True)
    plan = dry_plan() if dry_run else gpu_plan()
    try:
        result = run_phase(name, plan)
    except Exception as exc:
        result = _raised(exc)
    faulthandler.cancel_dump_traceback_later()
    out.write_text(json.dumps(result, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dry-run", action="store_true", help="the CPU self-test: every phase, small")
    parser.add_argument("--plan-only", action="store_true", help="check the GPU plan on the CPU; allocate nothing")
    parser.add_argument("--out", type=Path, help="write the JSON here after every phase")
    parser.add_argument("--phases", help="comma-separated subset of the phases, in order")
    parser.add_argument("--watchdog-s", type=float, help="override the plan's watchdog (seconds)")
    parser.add_argument(
        "--isolate",
        choices=("auto", "yes", "no"),
        default="auto",
        help="each phase in a process of its own (auto: on a GPU, not in a dry run)",
    )
    parser.add_argument("--phase-limit-s", type=float, help="isolated phases: each one's limit (default: the plan's)")
    parser.add_argument("--phase-child", help=argparse.SUPPRESS)
    parser.add_argument("--phase-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--phase-limit", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase_child:
        assert args.phase_out is not None
        return phase_child(args.phase_child, args.dry_run, args.phase_out, args.phase_limit)

    plan = dry_plan() if args.dry_run else gpu_plan()
    checked = check_plan(plan)
    phases = args.phases.split(",") if args.phases else list(plan.phases)
    if args.plan_only:
        # the GPU plan, and the dry plan it mirrors, checked phase by phase without allocating anything
        dry_checked = check_plan(dry_plan())
        result: dict[str, Any] = {"plan_only": True, "plan": plan.as_json(), "check": checked, "dry_check": dry_checked}
        result["verdict"] = "PASS" if checked["ok"] and dry_checked["ok"] else "FAIL"
        text = json.dumps(result, indent=2, default=str)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        print(text)
        print(result["verdict"], file=sys.stderr)
        return 0 if result["verdict"] == "PASS" else 1

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU self-test, or --plan-only", file=sys.stderr)
        return 2
    head = {
        "device": torch.cuda.get_device_name() if not args.dry_run else "cpu (dry run: targets not judged)",
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "plan": plan.as_json(),
        "plan_check": checked,
    }
    report = Report(args.out, head)
    if not checked["ok"]:
        report.finish("FAIL")
        print(json.dumps(report.data, indent=2, default=str))
        print("FAIL (plan)", file=sys.stderr)
        return 1
    budget = args.watchdog_s or plan.watchdog_s
    isolate = args.isolate == "yes" or (args.isolate == "auto" and not args.dry_run)
    report.data["isolated"] = isolate
    watchdog = start_watchdog(budget, report)
    try:
        if isolate:
            limit = args.phase_limit_s or plan.phase_limit_s
            verdict = run_isolated(args.dry_run, report, phases, budget - 5, limit)
        else:
            verdict = run(plan, report, phases)
    finally:
        watchdog.cancel()
    report.finish(verdict)
    print(json.dumps(report.data, indent=2, default=str))
    print(verdict, file=sys.stderr)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
