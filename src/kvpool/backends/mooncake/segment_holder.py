"""A Mooncake segment holder: a process whose client contributes memory to the pool and nothing else.

Engines' own clients can contribute zero bytes (`global_segment_size: 0`), so what they store outlives
them only where some other client mounted a segment: on a cluster, `kvpool segment` on each memory
host. Objects placed on a segment vanish when its owner closes (a clean stop) and read as errors until
the master's `client_ttl` expires when the owner dies without closing (~11 s measured).

* `serve_segment`: the `kvpool segment` command: mount, print "ready" and the segment, hold until
  SIGTERM, SIGINT or (`until_stdin_closes`) the end of standard input, then close.
* `SegmentHolder`: the same command as a child process (tests, benchmarks): `stop()` is the clean
  close, `kill()` the owner dying.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


def serve_segment(
    master: str,
    segment_bytes: int | str,
    *,
    local_hostname: str = "127.0.0.1",
    protocol: str = "tcp",
    until_stdin_closes: bool = False,
    out: IO[str] | None = None,
) -> int:
    """Mount a segment of `segment_bytes` on the pool at `master` and hold it until told to stop."""
    from kvpool.backends.mooncake import MooncakeBackend

    out = out or sys.stdout
    options = {
        "master": master,
        "local_hostname": local_hostname,
        "protocol": protocol,
        "global_segment_size": segment_bytes,
        "staging_bytes": 0,
    }
    backend = MooncakeBackend.from_options(options)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        print(f"segment of {segment_bytes} bytes mounted on the pool at {master} from {local_hostname}", file=out)
        print("ready", file=out, flush=True)
        while not stop.is_set():
            if until_stdin_closes:
                readable, _, _ = select.select([sys.stdin], [], [], 0.5)
                if readable and not sys.stdin.readline():
                    break
            else:
                stop.wait(0.5)
        return 0
    finally:
        backend.close()  # a clean close: the segment and every object on it leave the pool
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class SegmentHolder:
    """`kvpool segment` as a child process; a context manager that stops it cleanly."""

    def __init__(
        self,
        master: str,
        segment_bytes: int,
        ready_timeout_s: float = READY_TIMEOUT_S,
        env: dict[str, str] | None = None,
    ) -> None:
        child_env = {**os.environ, **(env or {})}
        child_env.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        child_env.setdefault("MC_LOG_LEVEL", "WARNING")
        command = [sys.executable, "-c", "from kvpool.ops.cli import main; main()", "segment", master]
        command += ["--size", str(segment_bytes), "--until-stdin-closes"]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=child_env,
        )
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        seen = b""
        while b"ready\n" not in seen:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"the segment holder was not ready after {timeout_s:.0f} s: {seen[-2000:]!r}")
            readable, _, _ = select.select([fd], [], [], min(remaining, 0.5))
            if readable:
                data = os.read(fd, 4096)
                if not data:
                    code = self.process.wait(10)
                    raise RuntimeError(f"the segment holder exited with {code} before it was ready: {seen[-2000:]!r}")
                seen += data

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Clean close: the segment (and every object on it) leaves the pool. Returns the exit code."""
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: the owner dies without unmounting its segment."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)

    def __enter__(self) -> SegmentHolder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
