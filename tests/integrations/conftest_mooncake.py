"""Helpers for the end-to-end tests on a real Mooncake master: segment holders, engine processes,
connector configs. Every process started here is stopped by its owner (context managers / fixtures);
every wait is bounded."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpool.testing.engine import GreedyResult

DRIVER = Path(__file__).with_name("mooncake_driver.py")
READY_TIMEOUT_S = 60.0
ENGINE_PROCESS_TIMEOUT_S = 240.0  # import vllm + engine + generate + shutdown: 15-30 s on 2 busy cores




def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    env.setdefault("MC_LOG_LEVEL", "WARNING")
    # PYTHONHASHSEED is inherited as is: it seeds vLLM's block hashes and is part of kvpool's key
    # fingerprint, so every engine process must see the same value (or none, with sha256 hashes)
    return env


def read_ready(process: subprocess.Popen[str], what: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait (bounded) for the child to print its "ready" line."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    seen = b""
    while b"ready\n" not in seen:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            process.kill()
            process.wait(10)
            raise RuntimeError(f"{what} was not ready after {timeout_s:.0f} s: {seen[-2000:]!r}")
        readable, _, _ = select.select([fd], [], [], min(remaining, 0.5))
        if readable:
            data = os.read(fd, 4096)  # raw reads: the text wrapper's buffer stays empty
            if not data:
                process.wait(10)
                raise RuntimeError(f"{what} exited with {process.returncode} before it was ready: {seen[-2000:]!r}")
            seen += data


def mooncake_connector(master: Any, **mooncake: Any) -> dict[str, Any]:
    """kv_transfer_config for the kvpool connector on `master` (extra kvpool keys via `kvpool=`)."""
    extra = mooncake.pop("kvpool", {})
    options = {**master.backend_options(), "staging_bytes": 4 << 20, **mooncake}
    return {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"backend": "mooncake", "mooncake": options, **extra},
    }


def run_engine_process(
    tmp_path: Path, model: Path, prompts: list[list[int]], max_tokens: int, kv_transfer_config: dict[str, Any], **engine
) -> tuple[list[GreedyResult], dict[str, Any]]:
    """Run one engine in a fresh process; returns its greedy results and worker stats."""
    spec = tmp_path / "engine-spec.json"
    out = tmp_path / "engine-out.json"
    spec.write_text(
        json.dumps(
            {
                "model": str(model),
                "prompts": prompts,
                "max_tokens": max_tokens,
                "kv_transfer_config": kv_transfer_config,
                "engine": engine,
            }
        )
    )
    log = tmp_path / "engine.log"
    with log.open("w") as sink:
        try:
            completed = subprocess.run(
                [sys.executable, str(DRIVER), "engine", str(spec), str(out)],
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=child_env(),
                timeout=ENGINE_PROCESS_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:  # run() has killed it
            raise AssertionError(f"engine process timed out; log tail:\n{log.read_text()[-4000:]}") from None
    assert completed.returncode == 0, f"engine process failed ({completed.returncode}):\n{log.read_text()[-4000:]}"
    data = json.loads(out.read_text())
    results = [
        GreedyResult(**{**r, "top": [[tuple(entry) for entry in step] for step in r["top"]]}) for r in data["results"]
    ]
    assert data["drained"], "the engine process's saves did not finish"
    return results, data["stats"]


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.1) -> float:
    """Poll `condition` until true; returns the seconds it took, fails after `timeout_s`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(poll_s)
    return time.monotonic() - started
