"""The systems' servers, for the benches behind vLLM's OpenAI server (`serve`, `trace`, `shared`): every
system of `serve_systems` started behind one server, warmed, kept running until the bench's stack exits,
its process tree's CPU time, and how a server that fails or degrades at start says why.

Idle servers wait on their sockets: a server between its runs takes no measurable CPU.

Every server gets the same cores for its forward pass: vLLM's CPU build binds the model's threads to
all cores but those it reserves for the engine's other processes: one without a connector, one more
with any KV connector (for NIXL), and on a machine with as few cores as reserved it gives up the
reservation. On 2 cores a server with a connector would run its forward on twice the cores of one
without (misses measured 1.6x faster with a connector that does nothing), so every server here is
started with `VLLM_CPU_NUM_OF_RESERVED_CPU=1`, vLLM's own reservation without a connector.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvpool.benchmarks.serving import serve_systems
from kvpool.benchmarks.serving.serve_workload import MIN_POOL_BYTES, Served, Workload
from kvpool.testing.server import SAME_CORES_ENV, OpenAIServer, openai_server

START_TIMEOUT_S = 300.0
UNSUPPORTED_TIMEOUT_S = 120.0
STARTS_AT_ONCE = 2  # servers started together (`start_all`)
LOG_BYTES = 4 << 20  # how much of a server's log is read for why it degraded or missed


@dataclass
class _Running:
    server: OpenAIServer
    pids: list[int]  # the system's processes outside the server


class Tally:
    """Per system, the `progress` steps it has left and why it stopped: `done` ticks one step; `give_up`
    records the failure and ticks every step left, so the total comes out whatever fails."""

    def __init__(self, systems: Sequence[str], steps_each: int, progress: Callable[[str], None] | None) -> None:
        self.tick = progress or (lambda _: None)
        self.left = dict.fromkeys(systems, steps_each)
        self.failed: dict[str, str] = {}

    def done(self, name: str, what: str) -> None:
        self.left[name] -= 1
        self.tick(f"{name}: {what}")

    def started(self, name: str) -> None:
        self.done(name, "started")

    def give_up(self, name: str, exc: Exception) -> None:
        self.gave_up(name, f"{type(exc).__name__}: {_last_error_line(str(exc))}")

    def gave_up(self, name: str, why: str) -> None:
        self.failed[name] = why
        for _ in range(self.left[name]):
            self.done(name, "failed")


def start_all(
    stack: contextlib.ExitStack,
    systems: Sequence[str],
    model: Path,
    workload: Served,
    token_bytes: int,
    started: Callable[[str], None],
    failed: Callable[[str, Exception], None],
) -> dict[str, _Running]:
    """Start every system's server, warmed, until `stack` exits. A system that cannot run is passed to
    `failed` (its server stopped at once) and the others still start.

    `STARTS_AT_ONCE` start together: a start is mostly three processes importing vLLM, one core each
    (about 55 s a server on the 2-core machine, most of a tiny bench's time). The starting threads
    live until `stack` exits, after the servers stop: a Mooncake master dies with the thread that
    started it (`master.start_master`'s `die_with_parent`)."""

    def start(name: str) -> tuple[contextlib.ExitStack, _Running]:
        with contextlib.ExitStack() as own:  # a server that fails its warm-up stops at once
            system = own.enter_context(_served(name, model, workload, token_bytes))
            _warm(system.server, workload)
            return own.pop_all(), system

    starters = ThreadPoolExecutor(STARTS_AT_ONCE, thread_name_prefix="kvpool-start")
    stack.callback(starters.shutdown)  # pushed first: runs once every server has stopped
    futures = {name: starters.submit(start, name) for name in systems}
    running: dict[str, _Running] = {}
    try:
        for name, future in futures.items():  # in order: `running` and the ticks keep the systems' order
            try:
                own, system = future.result()
            except Exception as exc:  # a system that cannot run is reported, the others still are
                failed(name, exc)
                continue
            stack.push(own)
            running[name] = system
            started(name)
    finally:  # interrupted: what still starts is awaited and stopped with the rest
        for name, future in futures.items():
            if name not in running and not future.cancel():
                with contextlib.suppress(Exception):  # failed: reported above, or stopped already
                    stack.push(future.result()[0])
    return running


@contextlib.contextmanager
def _served(name: str, model: Path, workload: Served, token_bytes: int) -> Iterator[_Running]:
    with (
        serve_systems.start(name, _pool_bytes(workload, token_bytes)) as setup,
        openai_server(
            model,
            kv_transfer_config=setup.kv_transfer_config,
            env={**setup.env, **SAME_CORES_ENV},
            extra_args=setup.extra_args,
            text_prompts=True,
            dtype=workload.dtype,
            block_size=workload.block_size,
            max_model_len=workload.max_model_len,
            kv_cache_memory_bytes=workload.engine_cache_tokens * token_bytes,
            max_num_seqs=max(workload.concurrencies),
            ready_timeout_s=START_TIMEOUT_S,
        ) as server,
    ):
        yield _Running(server, setup.pids)


def _pool_bytes(workload: Served, token_bytes: int) -> int:
    return max(workload.pool_tokens * token_bytes, workload.min_pool_bytes, MIN_POOL_BYTES)


def _token_bytes(model: Path, dtype: str) -> int:
    """KV bytes per token of `model` in `dtype`: K and V of every layer's KV heads."""
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    itemsize = 4 if dtype == "float32" else 2
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * itemsize


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of each process and all its descendants, as they are now."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for process in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                times = process.cpu_times()
                total += times.user + times.system
    return total


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(length)]


def _warm(server: OpenAIServer, workload: Served) -> None:
    """A miss, then the same prompt once the engine's cache lost it: every path, a pool's load included,
    has run once before anything is measured."""
    rng = random.Random(7)
    tokens = _prompt(rng, workload.prompt_len)
    server.complete(tokens, 2)
    for _ in range(workload.fillers):
        server.complete(_prompt(rng, workload.filler_len), 1)
    server.complete(tokens, 2)


def _try_unsupported(connector: str, model: Path, workload: Workload, token_bytes: int) -> str:
    """Start a server with `connector`; returns how it failed (or that it started, unexpectedly)."""
    setup = serve_systems.unsupported_setup(connector)
    try:
        with openai_server(
            model,
            kv_transfer_config=setup.kv_transfer_config,
            env={**setup.env, **SAME_CORES_ENV},
            text_prompts=True,
            dtype=workload.dtype,
            block_size=workload.block_size,
            max_model_len=workload.max_model_len,
            kv_cache_memory_bytes=workload.engine_cache_tokens * token_bytes,
            ready_timeout_s=UNSUPPORTED_TIMEOUT_S,
        ) as server:
            degraded = _degraded(server.log_tail(LOG_BYTES))
            if degraded:
                return f"starts in degraded mode, recomputing every request: {degraded}"
            return "started (not expected on the CPU build): not measured"
    except Exception as exc:
        return f"fails at start: {_last_error_line(str(exc))}"


def _degraded(log: str) -> str:
    """The error a connector gave up on at start and then ran without (LMCache: "System will operate
    in degraded mode"); empty when it did not."""
    lines = log.splitlines()
    for index, line in enumerate(lines):
        if "degraded mode" in line:
            errors = [earlier for earlier in lines[:index] if "Error:" in earlier]
            return errors[-1].strip() if errors else line.strip()
    return ""


def _last_error_line(text: str) -> str:
    """The most telling line of a server's log tail: the first worker error, else the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if "Worker failed with error" in line:
            return line.split("Worker failed with error", 1)[1].split(", please check")[0].strip(" '")[:300]
    errors = [line for line in lines if "Error" in line]
    return (errors[-1] if errors else lines[-1] if lines else text)[:300]
