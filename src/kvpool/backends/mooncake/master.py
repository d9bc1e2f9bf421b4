"""Start and stop a local `mooncake_master` for tests, demos and `kvpool master`.

The master is bound to one address (loopback by default) with its HTTP metadata server off, so clients
use `metadata_server="P2PHANDSHAKE"` and nothing listens beyond the chosen address except the clients'
own data ports (Mooncake hard-codes INADDR_ANY for those).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from kvpool.core.errors import BackendUnavailableError

BINARY_NAME = "mooncake_master"
INSTALL_HINT = (
    "pip install 'kvpool[mooncake]' (Mooncake's CUDA build; 'kvpool[mooncake-cpu]' on hosts without CUDA), "
    "and on Debian/Ubuntu: apt-get install libibverbs1"
)
DEFAULT_RPC_PORT = 50051
READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0
_POLL_S = 0.02
_PORT_ATTEMPTS = 3  # an auto-picked port can be taken between picking and binding it
_PR_SET_PDEATHSIG = 1
_LOG_PREFIX = "kvpool-mooncake-master-"


def find_master_binary() -> str:
    """The `mooncake_master` of this interpreter's environment, else the first on PATH."""
    beside_python = Path(sys.executable).parent / BINARY_NAME
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return str(beside_python)
    on_path = shutil.which(BINARY_NAME)
    if on_path:
        return on_path
    raise BackendUnavailableError(f"{BINARY_NAME} was not found next to {sys.executable} or on PATH; {INSTALL_HINT}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (another process may still take it before we bind it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """A running `mooncake_master` child process. Use as a context manager or call stop()."""

    def __init__(
        self, process: subprocess.Popen[bytes], host: str, rpc_port: int, metrics_port: int, log_path: Path | None
    ) -> None:
        self.process = process
        self.host = host
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port
        self.log_path = log_path

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def backend_options(self) -> dict[str, Any]:
        """Options for `create_backend("mooncake", ...)` that reach this master."""
        return {"master": self.address, "metadata_server": "P2PHANDSHAKE", "local_hostname": self.host}

    def config_line(self) -> str:
        """The kvpool config JSON snippet that points a pool at this master."""
        return json.dumps({"backend": "mooncake", "mooncake": self.backend_options()})

    def running(self) -> bool:
        return self.process.poll() is None

    def healthy(self, timeout_s: float = 0.5) -> bool:
        """The admin server answers /health with status ok and the RPC port accepts connections."""
        if not self.running():
            return False
        url = f"http://{self._url_host()}:{self.metrics_port}/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                body = json.loads(response.read() or b"{}")
        except (OSError, ValueError, urllib.error.URLError):
            return False
        return bool(body.get("status") == "ok") and port_open(self.host, self.rpc_port, timeout_s)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if not self.running():
                raise BackendUnavailableError(
                    f"{BINARY_NAME} exited with code {self.process.returncode} before it was ready{self._log_hint()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise BackendUnavailableError(
                    f"{BINARY_NAME} at {self.address} was not ready after {timeout_s:.0f} s{self._log_hint()}"
                )
            time.sleep(_POLL_S)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within timeout_s. Returns the exit code."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._drop_log()
        return self.process.returncode

    def kill(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGKILL: the master gets no chance to clean up (fault tests)."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout_s)

    def log_tail(self, max_bytes: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        data = self.log_path.read_bytes()
        return data[-max_bytes:].decode(errors="replace")

    def __enter__(self) -> MooncakeMaster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"MooncakeMaster(address={self.address!r}, metrics_port={self.metrics_port}, pid={self.pid})"

    def _url_host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    def _log_hint(self) -> str:
        tail = self.log_tail()
        return f"; log {self.log_path}:\n{tail}" if tail else ""

    def _drop_log(self) -> None:
        if self.log_path is not None and self.log_path.name.startswith(_LOG_PREFIX):
            with contextlib.suppress(OSError):
                self.log_path.unlink()


def start_master(
    rpc_port: int = 0,
    metrics_port: int = 0,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = READY_TIMEOUT_S,
    log: Path | IO[Any] | None = None,
    die_with_parent: bool = True,
) -> MooncakeMaster:
    """Start a master on `host` (ports 0 = pick free ones) and wait until it serves.

    `extra_args` are passed through (e.g. "--client_ttl=3", "--default_kv_lease_ttl=1000"); later flags win.
    `log`: a path or open file for the master's output; None = a temporary file removed by stop().
    `die_with_parent`: the master gets SIGTERM when the thread that started it exits (Linux), so a crashed
    test run leaves no master behind; pass False when starting it from a short-lived thread.
    """
    binary = find_master_binary()
    attempts_left = _PORT_ATTEMPTS if (rpc_port == 0 or metrics_port == 0) else 1
    while True:
        attempts_left -= 1
        master = _spawn(
            binary, rpc_port or free_port(host), metrics_port or free_port(host), host, extra_args, log, die_with_parent
        )
        try:
            master.wait_ready(ready_timeout_s)
            return master
        except BackendUnavailableError:
            master.kill()
            if attempts_left == 0:
                raise
            master._drop_log()


def run_master_forever(
    rpc_port: int = DEFAULT_RPC_PORT,
    metrics_port: int = 0,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    out: IO[str] | None = None,
) -> int:
    """`kvpool master`: start a master, print the config line to use, serve until Ctrl-C or SIGTERM."""
    out = out or sys.stdout
    master = start_master(rpc_port, metrics_port, host, extra_args, log=sys.stderr)
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        print(
            f"mooncake_master serving at {master.address} (admin http://{master._url_host()}:{master.metrics_port})",
            file=out,
        )
        if extra_args:
            print(f"mooncake_master flags: {' '.join(extra_args)}", file=out)
        print(f"kvpool config: {master.config_line()}", file=out, flush=True)
        while master.running():
            time.sleep(0.5)
        print(f"mooncake_master exited with code {master.process.returncode}", file=out)
        return master.process.returncode or 1
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        master.stop()


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _spawn(
    binary: str,
    rpc_port: int,
    metrics_port: int,
    host: str,
    extra_args: Sequence[str],
    log: Path | IO[Any] | None,
    die_with_parent: bool,
) -> MooncakeMaster:
    args = [
        binary,
        f"--rpc_address={host}",
        f"--rpc_port={rpc_port}",
        f"--metrics_host={host}",
        f"--metrics_port={metrics_port}",
        "--enable_http_metadata_server=false",
        "--logtostderr",
        *extra_args,
    ]
    log_path: Path | None
    if log is None:
        fd, name = tempfile.mkstemp(prefix=_LOG_PREFIX, suffix=".log")
        log_path = Path(name)
        sink: Any = os.fdopen(fd, "wb")
    elif isinstance(log, Path):
        log_path = log
        sink = log.open("ab")
    else:
        log_path, sink = None, log
    try:
        # its own session: a Ctrl-C meant for the caller does not kill the master behind its back
        process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent and _prctl is not None else None,
        )
    except OSError as exc:
        raise BackendUnavailableError(f"could not run {binary}: {exc}; {INSTALL_HINT}") from exc
    finally:
        if log is None or isinstance(log, Path):
            sink.close()
    return MooncakeMaster(process, host, rpc_port, metrics_port, log_path)


def _die_with_parent() -> None:
    # runs in the child between fork and exec, so it only calls a function resolved beforehand;
    # the flag survives the mooncake_master shim's execv into the real binary
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _resolve_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _resolve_prctl() if sys.platform == "linux" else None
