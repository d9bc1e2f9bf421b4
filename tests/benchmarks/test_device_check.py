"""`scripts/device_check.sh --dry-run`: the GPU check's CPU self-test runs everything but CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_device_check_dry_run_passes_its_round_trips_in_both_runner_orders():
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        [str(ROOT / "scripts" / "device_check.sh"), "--dry-run"], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["verdict"] == "PASS" and done.stderr.strip().endswith("PASS")
    for order in ("v1", "v2"):  # saved blocks reused right after the save, as each runner does
        assert result["round_trip"][order]["exact"] and result["round_trip"][order]["loads_failed"] == 0
    assert {row["chunk_bytes"] for row in result["bandwidth"]["rows"]} == {8192, 16384}
    assert all(value > 0 for row in result["bandwidth"]["rows"] for value in row["gbps"].values())
    assert result["overlap"]["bytes_moved"] > 0
    assert result["bandwidth"]["pass"] is None and result["overlap"]["pass"] is None  # not judged on a CPU


def test_without_cuda_the_full_check_says_to_use_the_dry_run():
    import torch

    if torch.cuda.is_available():
        return
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        [str(ROOT / "scripts" / "device_check.sh")], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode != 0 and "--dry-run" in done.stderr
