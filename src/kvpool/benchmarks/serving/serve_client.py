"""What a round measures of one system behind its server: vLLM's serving benchmark client on each
dataset at each concurrency (its seeds, its arguments, the run's latencies, hit rates and CPU), and the
hit probe (a miss, a hit in the engine's own cache, a hit only a pool can serve), with kvpool's own
counters and the pool's log lines over it.
"""

from __future__ import annotations

import contextlib
import io
import random
import re
import time
from pathlib import Path
from typing import Any

from kvpool.benchmarks.measure.stats import median_ms
from kvpool.benchmarks.serving.serve_workload import Workload
from kvpool.benchmarks.serving.servers import LOG_BYTES, _prompt, _Running, cpu_seconds
from kvpool.scheduler.scheduler_core import FIRST_TOKEN_KINDS
from kvpool.testing.server import OpenAIServer

POOL_HITS = "vllm:external_prefix_cache_hits_total"  # prompt tokens a connector supplied
KVPOOL_METRICS = "vllm:kvpool_"  # kvpool's own counters and gauges (kvpool.integrations.vllm.metrics.PREFIX)
# lines of a server's log that say why a pool missed: kvpool's and Mooncake's warnings (the Mooncake
# client's breaker among them), the native client's own (glog: E1206 12:00:00...) and tracebacks;
# vLLM's own INFO lines name kvpool too, and are left out
POOL_LOG_SIGNS = re.compile(r"breaker|mooncake|kvpool|traceback|^[EWF]\d{4} \d\d:", re.IGNORECASE)
POOL_LOG_LINES = 20


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
        "miss_ms": median_ms(times["miss"]),
        "again_ms": median_ms(times["again"]),
        "again_cached_tokens": min(cached["again"]),
        "evicted_ms": median_ms(times["evicted"]),
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
