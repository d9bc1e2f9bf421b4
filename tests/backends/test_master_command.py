"""`kvpool master`: the flags an operator needs reach mooncake_master, the config to paste is printed,
and SIGTERM stops both processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvpool.backends.mooncake import master as mooncake_master
from kvpool.backends.mooncake.master import free_port, port_open
from kvpool.ops.cli import app, master_flags


def test_master_options_become_mooncake_flags_and_bad_values_are_usage_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake(**kwargs: Any) -> int:
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(mooncake_master, "run_master_forever", fake)
    flags = ["--rpc-port", "50123", "--eviction-high-watermark", "0.8", "--lease-ttl-ms", "1000", "--client-ttl-s", "3"]
    outcome = CliRunner().invoke(app, ["master", *flags])
    assert outcome.exit_code == 0, outcome.output
    assert seen == {
        "rpc_port": 50123,
        "metrics_port": 0,
        "host": "127.0.0.1",
        "extra_args": master_flags(0.8, 0.05, 1000, 3),
    }
    assert "--default_kv_lease_ttl=1000" in seen["extra_args"]
    bad = CliRunner().invoke(app, ["master", "--eviction-high-watermark", "2"])
    assert bad.exit_code == 2 and "--eviction-high-watermark" in bad.output


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def test_kvpool_master_serves_prints_its_config_and_stops_on_sigterm(mooncake_available: None) -> None:
    port = free_port()
    command = [sys.executable, "-c", "from kvpool.ops.cli import main; main()", "master", "--rpc-port", str(port)]
    command += ["--lease-ttl-ms", "1000", "--client-ttl-s", "3"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 60
        assert process.stdout is not None
        while not any(line.startswith("kvpool config:") for line in lines) and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
        config = json.loads(next(line for line in lines if line.startswith("kvpool config:")).split(":", 1)[1])
        assert config["mooncake"]["master"] == f"127.0.0.1:{port}"
        assert any("--default_kv_lease_ttl=1000" in line and "--client_ttl=3" in line for line in lines)
        assert port_open("127.0.0.1", port)
        children = _children(process.pid)
        cmdlines = [Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode() for child in children]
        assert any("mooncake_master" in c and "--default_kv_lease_ttl=1000" in c for c in cmdlines), cmdlines
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert not port_open("127.0.0.1", port)
        for child in children:
            assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(10)
