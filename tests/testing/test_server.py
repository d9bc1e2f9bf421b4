"""A test server's log: removed when it stops, or kept where `KVPOOL_KEEP_SERVER_LOGS` says; and the lines
of it the serve bench reports when a pool missed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.benchmarks.serving import serve_client
from kvpool.testing.server import KEEP_LOGS_ENV, OpenAIServer


def _server(tmp_path: Path) -> OpenAIServer:
    log = tmp_path / "kvpool-vllm-server-x.log"
    log.write_text("served\n")
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    return OpenAIServer(process, 0, log)


def test_a_stopped_servers_log_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEEP_LOGS_ENV, raising=False)
    server = _server(tmp_path)
    server.stop(timeout_s=5)
    assert server.process.poll() is not None and not server.log_path.exists()


def test_a_stopped_servers_log_is_kept_where_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kept = tmp_path / "kept" / "logs"
    monkeypatch.setenv(KEEP_LOGS_ENV, str(kept))
    server = _server(tmp_path)
    server.stop(timeout_s=5)
    assert not server.log_path.exists()
    assert (kept / server.log_path.name).read_text() == "served\n"


class _Logged:
    def __init__(self, text: str) -> None:
        self.text = text

    def log_tail(self, max_bytes: int = 6000) -> str:
        return self.text[-max_bytes:]


def test_the_probe_reports_the_pools_warnings_not_vllms_info() -> None:
    log = "\n".join(
        [
            "(EngineCore pid=1) INFO 12-06 06:34:03 [factory.py:62] Creating v1 connector with name: KVPoolConnector",
            "(APIServer pid=1) WARNING 12-06 07:01:35 [system_utils.py:255] Found ulimit of 20000 (error)",
            "E1206 06:59:09.339511 22648 transfer_metadata.cpp:1098] Local segment descriptor not found",
            "mooncake: breaker open, probing every 2.0 s: a call to the master ran past its deadline",
            "Traceback (most recent call last):",
        ]
    )
    lines = serve_client._pool_log(_Logged(log))  # type: ignore[arg-type]
    assert lines == log.splitlines()[2:]
