"""A real chat workload, the Mooncake (Kimi) FAST'25 conversation trace, replayed behind vLLM's OpenAI
server on the systems of `serve_systems`, measured by vLLM's own serving client.

The trace (one hour, 12,031 requests) gives each request its arrival, input and output lengths, and
its prompt as prefix blocks of 512 tokens (`hash_ids`, chained: an id names its whole prefix). Replayed:

* Blocks: a trace block becomes one engine block (`block_size`, 64), so a hit on k trace blocks is a
  hit on k engine blocks. A hash id is a fixed run of token ids from an RNG seeded with the id (ids 3
  up to the model's vocabulary: no special token), the same in every round, process and run. A prompt
  is its blocks' runs cut to its input length scaled alike (1/8) and to the server's `max_model_len`
  (a cut keeps leading blocks: shared prefixes stay shared); its output is scaled alike and capped at
  `max_output` (8: pools act on prefill). vLLM's `timed_trace` dataset is not used: it seeds a block's
  tokens with Python's per-process salted `hash()`, and scales neither lengths nor blocks.
* The slice: whole conversations, 1 in `sample_every`. Every request starts with hash id 0 (a shared
  system prompt); its second id ties it to its conversation's earlier turns, and conversation `c` is
  in bucket `c % sample_every` (ids are numbered in order of first use: a bucket is a stratified
  sample of the hour). Round `r` replays bucket `r`: its first `requests` requests from `start_s`, in
  trace order. Consecutive requests would not do: a conversation's next turn comes minutes later, so
  the first 60 span 15 s and an unlimited cache hits 8% of their prompt tokens (mostly hash id 0),
  against 42% over the hour (prompts cut alike); the first 60 of a bucket of 40 span 11-14 minutes and
  hit 26-43%. Each window's ideal hit rate is in the result beside the hour's. Buckets share no block
  but id 0: every round is fresh prompts, and every system replays the same windows.
* Arrivals: closed loop by default: requests go in trace order as slots of a concurrency free (vLLM's
  client, `--max-concurrency`). Replaying the clock needs a speed-up fit to every system's capacity on
  this machine: above it the queue grows without bound and TTFT measures the run's length, below it
  throughput is the offered rate whatever the system does. A closed loop keeps the order, which
  decides the hits, and leaves TTFT and throughput to the system. With `speedup` the window's arrival
  times are replayed instead, that many times faster (open loop, vLLM's `self_timed`).
* Pools: each holds `pool_fraction` of a round's distinct blocks (the rounds' mean), so pools evict
  within a round; the engine's own KV cache holds `max(concurrencies)` of the longest prompts and a few
  blocks more, so a conversation's next turn is mostly gone from it.

Servers, rounds and figures are `kvpool bench serve`'s: every server started and warmed up front
(`servers.start_all`: same model, engine settings and cores), rounds interleaved in rotated order; per
run TTFT mean / p50 / p99 and end-to-end latency (streamed), output throughput, the engine's local and
the pool's hit tokens (the server's /metrics counters), and CPU seconds per request of the system's
whole process tree. `trace_report` gives medians with 95% intervals and paired ratios with verdicts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import json
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvpool.benchmarks.measure.stats import rotation
from kvpool.benchmarks.policy.trace_hits import TRACE
from kvpool.benchmarks.serving import serve_systems
from kvpool.benchmarks.serving.serve_workload import MIN_POOL_BYTES
from kvpool.benchmarks.serving.servers import Tally, _pool_bytes, _Running, _token_bytes, cpu_seconds, start_all
from kvpool.benchmarks.serving.trace_report import DATASET, plot, run_figures, summarize, to_markdown
from kvpool.testing.models import default_model_dir, make_tiny_model

__all__ = ["ALL_ARGS", "LONG_ARGS", "SYSTEMS", "TINY_ARGS", "Workload", "plot", "print_table", "run", "to_markdown"]

TRACE_BLOCK = 512  # tokens a hash id of the trace stands for
FIRST_TOKEN = 3  # 0, 1, 2 are the models' bos, eos and pad
DEFAULT_TRACE = str(TRACE)  # the shared data folder beside the checkout
SYSTEMS = ("local", "kvpool", "kvpool-disk", "vllm-mooncake-embedded", "kvpool-mooncake", "vllm-mooncake")
# the tiny size replays the trace through one pool and the engine alone: every system's server is started
# and served by `kvpool bench serve`'s tiny size already, and the replay is the same code for all of them
TINY_SYSTEMS = ("local", "kvpool")


@dataclass(frozen=True)
class TraceRequest:
    index: int  # its line in the trace
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def conversation(self) -> int:
        """The id after the one every request shares: what ties a request to its conversation's turns."""
        return self.hash_ids[1] if len(self.hash_ids) > 1 else -1 - self.index


@dataclass(frozen=True)
class Prompt:
    """A request as replayed: its token ids, its output length, its arrival after the window's first (s)."""

    tokens: tuple[int, ...]
    output_len: int
    at_s: float


@dataclass(frozen=True)
class Workload:
    model_kind: str = "llama-bench"
    trace: str = DEFAULT_TRACE
    sample_every: int = 40  # conversations replayed: 1 in this many; round r replays bucket r
    requests: int = 60  # per round (5 systems x 3 rounds: 34 minutes on 2 cores, measured)
    start_s: float = 0.0  # where in the trace's hour the windows start
    block_size: int = 64  # one trace block (512 tokens) becomes one engine block
    max_model_len: int = 1024
    max_output: int = 8
    concurrencies: tuple[int, ...] = (4,)
    rounds: int = 3
    engine_cache_tokens: int = 4608  # 4 of the longest prompts, and 8 blocks
    pool_fraction: float = 0.25  # every pool's capacity, as a share of a round's distinct blocks
    speedup: float | None = None  # None: closed loop; else the trace's arrival times, this many times faster
    dtype: str = "bfloat16"
    min_pool_bytes: int = MIN_POOL_BYTES

    @property
    def scale(self) -> float:
        return self.block_size / TRACE_BLOCK

    @property
    def prompt_len(self) -> int:
        """The longest prompt (and the warm-up's)."""
        return self.max_model_len - self.max_output

    @property
    def filler_len(self) -> int:
        return self.max_model_len - 8

    @property
    def fillers(self) -> int:
        """The warm-up's prompts that push its prompt out of the engine's own cache."""
        return -(-(self.engine_cache_tokens + self.prompt_len) // self.filler_len)

    @property
    def distinct_blocks(self) -> int:
        """The blocks a round stores (its window's distinct full blocks), the mean over the rounds."""
        counts = [len(stored_blocks(window, self)) for window in windows(self)]
        return round(sum(counts) / len(counts))

    @property
    def pool_tokens(self) -> int:
        return max(1, round(self.pool_fraction * self.distinct_blocks)) * self.block_size

    def steps(self, systems: int) -> int:
        """How many times `run` calls `progress`: per system its start and each run."""
        return systems * (1 + self.rounds * len(self.concurrencies))


# `kvpool bench all`: 30 requests a round (3 rounds x 6 systems); `--long`, the committed report: 60 a round,
# 10 rounds; `--quick`: 2 rounds of 20
ALL_ARGS: dict[str, Any] = {"workload": Workload(requests=30), "systems": SYSTEMS}
LONG_ARGS: dict[str, Any] = {**ALL_ARGS, "workload": Workload(rounds=10)}
QUICK_ARGS: dict[str, Any] = {**ALL_ARGS, "workload": Workload(requests=20, rounds=2)}
TINY_ARGS: dict[str, Any] = {  # a size that checks the bench, not the figures
    "workload": Workload(
        model_kind="llama-bench-tiny",
        sample_every=80,
        requests=20,
        start_s=1200.0,  # 20 minutes in, a bucket's 20 requests hold later turns of conversations: reuse
        max_model_len=512,
        concurrencies=(2,),
        rounds=2,
        engine_cache_tokens=1152,  # its own cache keeps a conversation's turn for a request or two only
        dtype="float32",
    ),
    "systems": TINY_SYSTEMS,
}


def check(workload: Workload, systems: Sequence[str]) -> None:
    """Refuse, with a ValueError that names it, a workload or system the bench cannot run as described."""
    for name in systems:
        if name not in serve_systems.SYSTEMS:
            raise ValueError(f"system {name!r}: expected one of {', '.join(serve_systems.SYSTEMS)}")
    if not 1 <= workload.rounds <= workload.sample_every:
        raise ValueError(
            f"rounds {workload.rounds}: expected 1 to sample_every ({workload.sample_every}), a bucket each"
        )
    if workload.requests < 1 or not workload.concurrencies or min(workload.concurrencies) < 1:
        raise ValueError("requests and concurrencies: expected at least 1")
    if workload.prompt_len < workload.block_size:
        raise ValueError(f"max_model_len {workload.max_model_len}: holds no whole block of {workload.block_size}")
    if workload.engine_cache_tokens < max(workload.concurrencies) * workload.max_model_len:
        raise ValueError(  # below that, requests preempt each other and every system measures the thrash
            f"engine_cache_tokens {workload.engine_cache_tokens}: below {max(workload.concurrencies)} requests "
            f"of max_model_len {workload.max_model_len}"
        )
    if workload.pool_fraction <= 0 or (workload.speedup is not None and workload.speedup <= 0):
        raise ValueError("pool_fraction and speedup: expected > 0")


@functools.lru_cache(maxsize=2)
def load(path: str) -> tuple[TraceRequest, ...]:
    with open(path) as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return tuple(
        TraceRequest(i, int(r["timestamp"]), int(r["input_length"]), int(r["output_length"]), tuple(r["hash_ids"]))
        for i, r in enumerate(rows)
    )


@functools.lru_cache(maxsize=8)
def windows(workload: Workload) -> tuple[tuple[TraceRequest, ...], ...]:
    """Per round, its window: the first `requests` requests of bucket `round` from `start_s`, in trace order."""
    start_ms = workload.start_s * 1000
    out = []
    for bucket in range(workload.rounds):
        picked = [
            request
            for request in load(workload.trace)
            if request.timestamp_ms >= start_ms and request.conversation % workload.sample_every == bucket
        ][: workload.requests]
        if len(picked) < workload.requests:
            raise ValueError(
                f"bucket {bucket} of {workload.sample_every}: {len(picked)} requests from {workload.start_s} s"
            )
        out.append(tuple(picked))
    return tuple(out)


def prompt_len(request: TraceRequest, workload: Workload) -> int:
    return max(1, min(workload.prompt_len, math.ceil(request.input_length * workload.scale)))


def output_len(request: TraceRequest, workload: Workload) -> int:
    return max(1, min(workload.max_output, math.ceil(request.output_length * workload.scale)))


def block_tokens(hash_id: int, block_size: int, vocab_size: int) -> list[int]:
    """The token ids hash id `hash_id` stands for: the same for the same arguments, in any process."""
    rng = random.Random(hash_id)
    return [rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(block_size)]


def replay(window: Sequence[TraceRequest], workload: Workload, vocab_size: int) -> list[Prompt]:
    runs: dict[int, list[int]] = {}
    prompts = []
    for request in window:
        length = prompt_len(request, workload)
        tokens: list[int] = []
        for hash_id in request.hash_ids[: -(-length // workload.block_size)]:
            if hash_id not in runs:
                runs[hash_id] = block_tokens(hash_id, workload.block_size, vocab_size)
            tokens += runs[hash_id]
        at_s = (request.timestamp_ms - window[0].timestamp_ms) / 1000
        prompts.append(Prompt(tuple(tokens[:length]), output_len(request, workload), at_s))
    return prompts


def stored_blocks(window: Sequence[TraceRequest], workload: Workload) -> set[int]:
    """The hash ids of the whole blocks the window's prompts hold (what a cache stores of them)."""
    return {h for request in window for h in request.hash_ids[: prompt_len(request, workload) // workload.block_size]}


def hit_rate(window: Sequence[TraceRequest], workload: Workload, capacity_blocks: int | None = None) -> float:
    """The share of the window's prompt tokens a prefix cache of `capacity_blocks` blocks (LRU; None:
    unlimited) serves, by the engine's rules: whole blocks, the longest prefix held, never a prompt's last
    token. With no capacity limit: the most any system can hit on the window."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for request in window:
        length = prompt_len(request, workload)
        blocks = request.hash_ids[: length // workload.block_size]
        reachable = (length - 1) // workload.block_size
        held = 0
        while held < reachable and blocks[held] in cache:
            held += 1
        hit += held * workload.block_size
        total += length
        for hash_id in blocks:
            cache[hash_id] = None
            cache.move_to_end(hash_id)
        while capacity_blocks is not None and len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hit / total if total else 0.0


def describe_windows(workload: Workload, pool_blocks: int | None = None) -> list[dict[str, Any]]:
    """What each round replays, and the hit rates a cache could reach on it: unlimited, and LRU of
    `pool_blocks` (default: the pool's `pool_tokens`)."""
    pool_blocks = pool_blocks or workload.pool_tokens // workload.block_size
    out = []
    for bucket, window in enumerate(windows(workload)):
        lengths = [prompt_len(request, workload) for request in window]
        out.append(
            {
                "round": bucket,
                "bucket": bucket,
                "first_request": window[0].index,
                "span_s": (window[-1].timestamp_ms - window[0].timestamp_ms) / 1000,
                "prompt_tokens": sum(lengths),
                "mean_prompt_tokens": round(sum(lengths) / len(lengths), 1),
                "distinct_blocks": len(stored_blocks(window, workload)),
                "ideal_hit_rate": round(hit_rate(window, workload), 4),
                "lru_pool_hit_rate": round(hit_rate(window, workload, pool_blocks), 4),
            }
        )
    return out


def run(
    *,
    workload: Workload | None = None,
    systems: Sequence[str] = SYSTEMS,
    progress: Callable[[str], None] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    workload = replace(workload or Workload(), **overrides)
    check(workload, systems)
    tally = Tally(systems, workload.steps(1), progress)
    model = make_tiny_model(workload.model_kind, default_model_dir() / workload.model_kind)
    vocab_size = int(json.loads((model / "config.json").read_text())["vocab_size"])
    token_bytes = _token_bytes(model, workload.dtype)
    started = time.perf_counter()
    prompts = [replay(window, workload, vocab_size) for window in windows(workload)]
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        running = start_all(stack, systems, model, workload, token_bytes, tally.started, tally.give_up)
        for round_index, round_prompts in enumerate(prompts):
            for name in rotation([name for name in systems if name in running], round_index):
                try:
                    for concurrency in workload.concurrencies:
                        row = _replay_run(running[name], round_prompts, workload, round_index, concurrency)
                        rows.append({"system": name, **row})
                        tally.done(name, f"round {round_index + 1} at concurrency {concurrency}")
                except Exception as exc:  # a system that fails is reported, the others still run
                    tally.give_up(name, exc)
                    del running[name]
    whole = load(workload.trace)
    pool_bytes = _pool_bytes(workload, token_bytes)
    held = pool_bytes // token_bytes
    result: dict[str, Any] = {
        "bench": "trace",
        "workload": {
            **asdict(workload),
            "trace_requests": len(whole),
            "hour_ideal_hit_rate": round(hit_rate(whole, workload), 4),
            "distinct_blocks": workload.distinct_blocks,
            "pool_tokens": workload.pool_tokens,
            "pool_bytes": pool_bytes,
            "pool_held_tokens": held,  # more than pool_tokens where a pool's least size binds
            "pool_held_fraction": round(held / (workload.distinct_blocks * workload.block_size), 3),
            "engine_cache_bytes": workload.engine_cache_tokens * token_bytes,
            "windows": describe_windows(workload, held // workload.block_size),
        },
        "model": str(model),
        "systems": list(systems),
        "results": rows,
        "failed": tally.failed,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    result["summary"] = summarize(result)
    return result


def _replay_run(
    system: _Running, prompts: Sequence[Prompt], workload: Workload, round_index: int, concurrency: int
) -> dict[str, Any]:
    """One window through vLLM's serving client against the system's server, with the hits and CPU time."""
    from vllm.benchmarks import serve as vllm_serve
    from vllm.benchmarks.datasets.datasets import SampleRequest

    timed = workload.speedup is not None
    requests = [
        SampleRequest(
            prompt=list(p.tokens),
            prompt_len=len(p.tokens),
            expected_output_len=p.output_len,
            request_id=f"trace-{round_index}-{concurrency}-{i}",
            timestamp=p.at_s / workload.speedup if workload.speedup is not None else None,
        )
        for i, p in enumerate(prompts)
    ]
    server = system.server
    pids = [server.process.pid, *system.pids]
    before, cpu_before = server.metrics(), cpu_seconds(pids)
    with contextlib.redirect_stdout(io.StringIO()):
        measured = asyncio.run(
            vllm_serve.benchmark(
                task_type=vllm_serve.TaskType.GENERATION, endpoint_type="vllm", api_url=server.url + "/v1/completions",
                base_url=server.url, model_id="model", model_name="model", tokenizer=None, input_requests=requests,
                logprobs=None, request_rate=float("inf"), burstiness=1.0, disable_tqdm=True, num_warmups=0,
                profile=False, selected_percentile_metrics=["e2el"], selected_percentiles=[50.0, 99.0],
                ignore_eos=True, goodput_config_dict={}, max_concurrency=concurrency, lora_modules=None,
                extra_headers=None, extra_body={"temperature": 0.0}, ready_check_timeout_sec=0, self_timed=timed,
            )
        )  # fmt: skip
    cpu = cpu_seconds(pids) - cpu_before
    after = server.metrics()
    figures = run_figures(measured, before, after, cpu)
    return {"dataset": DATASET, "round": round_index, "concurrency": concurrency, **figures}


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console

    Console().print(to_markdown(result), markup=False)
