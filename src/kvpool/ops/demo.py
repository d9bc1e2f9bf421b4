"""`kvpool demo`: a multi-turn chat workload through a real vLLM CPU engine, without and with kvpool.

Several conversations share system prompts; every turn extends the previous prompt with the model's
answer and a new user message (the pool stores answers too: `save_decode`). The engine's own KV
cache holds only a few conversations, so without the pool most turns recompute their history; with
it, the history comes back from the pool. The run without the pool fixes the workload (its answers
build the later prompts), and the run with the pool must produce the same tokens for every turn.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

DEMO_MODEL_KIND = "llama-demo"
BLOCK_SIZE = 64


@dataclass
class Workload:
    system_prompts: int = 2
    conversations: int = 8
    turns: int = 5
    system_tokens: int = 256
    user_tokens: int = 128
    answer_tokens: int = 32
    kv_cache_tokens: int = 2048  # the engine's own cache: about two conversations, not all eight
    seed: int = 0
    model_kind: str = DEMO_MODEL_KIND


@dataclass
class RunResult:
    outputs: list[list[int]] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # per request: prompt tokens not computed
    pool_tokens: int = 0
    seconds: float = 0.0


def run(backend: str = "memory", quiet: bool = False, workload: Workload | None = None) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the table (or JSON) readable
    workload = workload or Workload()
    from kvpool.testing.models import default_model_dir, make_tiny_model

    model = make_tiny_model(workload.model_kind, default_model_dir() / workload.model_kind)
    rounds = workload.conversations * workload.turns
    with _progress(quiet, total=2 * rounds) as advance, _pool(backend) as extra_config:
        without, prompts = _run_without(model, workload, advance)
        with_pool = _run_with(model, workload, prompts, extra_config, advance)
    prompt_tokens = sum(len(p) for p in prompts)
    identical = without.outputs == with_pool.outputs
    hits = [i for i, (a, b) in enumerate(zip(without.cached, with_pool.cached)) if b > a]
    return {
        "backend": backend,
        "requests": len(prompts),
        "conversations": workload.conversations,
        "turns": workload.turns,
        "prompt_tokens": prompt_tokens,
        "tokens_loaded_from_pool": with_pool.pool_tokens,
        "pool_hit_rate": round(with_pool.pool_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
        "engine_cache_tokens_without": sum(without.cached),
        "engine_cache_tokens_with": sum(with_pool.cached) - with_pool.pool_tokens,
        "requests_with_pool_hits": len(hits),
        "ttft_p50_ms_without": _percentile(without.ttft_ms, 50),
        "ttft_p90_ms_without": _percentile(without.ttft_ms, 90),
        "ttft_p50_ms_with": _percentile(with_pool.ttft_ms, 50),
        "ttft_p90_ms_with": _percentile(with_pool.ttft_ms, 90),
        # the same requests both ways: those the pool served (TTFT is what a hit saves)
        "ttft_p50_ms_pool_hits_without": _percentile([without.ttft_ms[i] for i in hits], 50),
        "ttft_p50_ms_pool_hits_with": _percentile([with_pool.ttft_ms[i] for i in hits], 50),
        "seconds_without": round(without.seconds, 2),
        "seconds_with": round(with_pool.seconds, 2),
        "identical_outputs": identical,
        "mismatched_requests": sum(a != b for a, b in zip(without.outputs, with_pool.outputs)),
    }


def _engine_kwargs(workload: Workload) -> dict[str, Any]:
    from kvpool.testing.models import model_config

    _, config = model_config(workload.model_kind)
    # float32: prefill in bf16 is not bit-exact when a prefix hit splits it differently (near-ties flip),
    # so "identical outputs" would measure rounding, not kvpool. In float32 it is exact.
    token_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    max_prompt = workload.system_tokens + workload.turns * (workload.user_tokens + workload.answer_tokens)
    return {
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": workload.kv_cache_tokens * token_bytes,
        "max_model_len": max_prompt + 2 * BLOCK_SIZE,
        "disable_log_stats": False,  # per-request first-token latency
    }


def _conversation_rounds(workload: Workload) -> Iterator[tuple[int, int]]:
    for turn in range(workload.turns):
        for conversation in range(workload.conversations):
            yield turn, conversation


def _run_without(model: Any, workload: Workload, advance: Any) -> tuple[RunResult, list[list[int]]]:
    from kvpool.testing.engine import engine

    rng = random.Random(workload.seed)
    systems = [_tokens(rng, workload.system_tokens) for _ in range(workload.system_prompts)]
    histories = [list(systems[c % workload.system_prompts]) for c in range(workload.conversations)]
    result, prompts = RunResult(), []
    with engine(model, **_engine_kwargs(workload)) as llm:
        began = time.perf_counter()
        for _, conversation in _conversation_rounds(workload):
            prompt = histories[conversation] + _tokens(rng, workload.user_tokens)
            answer = _turn(llm, prompt, workload, result)
            prompts.append(prompt)
            histories[conversation] = prompt + answer
            advance()
        result.seconds = time.perf_counter() - began
    return result, prompts


def _run_with(
    model: Any, workload: Workload, prompts: list[list[int]], extra_config: dict[str, Any], advance: Any
) -> RunResult:
    from kvpool.integrations.vllm import local_scheduler
    from kvpool.testing.engine import engine

    connector = {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra_config,
    }
    result = RunResult()
    with engine(model, kv_transfer_config=connector, **_engine_kwargs(workload)) as llm:
        scheduler = local_scheduler()
        began = time.perf_counter()
        for prompt in prompts:
            _turn(llm, prompt, workload, result)
            advance()
        result.seconds = time.perf_counter() - began
        result.pool_tokens = scheduler.stats.load_tokens if scheduler is not None else 0
    return result


def _turn(llm: Any, prompt: list[int], workload: Workload, result: RunResult) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=workload.answer_tokens, ignore_eos=True, detokenize=False)
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    answer = list(output.outputs[0].token_ids)
    result.outputs.append(answer)
    result.cached.append(int(output.num_cached_tokens or 0))
    if output.metrics is not None:
        result.ttft_ms.append(output.metrics.first_token_latency * 1000)
    return answer


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(count)]


def _percentile(values: list[float], q: int) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return round(values[0], 2)
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 2)


@contextmanager
def _pool(backend: str) -> Iterator[dict[str, Any]]:
    """The connector's extra config; for mooncake, a local master for the run's duration."""
    if backend == "memory":
        yield {"pool_name": "demo", "capacity_bytes": "1GiB", "save_decode": True}
        return
    if backend != "mooncake":
        from kvpool.core.errors import ConfigError

        raise ConfigError("backend", backend, "memory or mooncake")
    from kvpool.backends.mooncake.master import start_master

    with start_master() as master:
        options = dict(master.backend_options(), global_segment_size="512MiB")
        yield {"backend": "mooncake", "mooncake": options, "save_decode": True}


@contextmanager
def _progress(quiet: bool, total: int) -> Iterator[Any]:
    if quiet:
        yield lambda: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("chat turns"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task("turns", total=total)
        yield lambda: progress.advance(task)


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvpool demo: multi-turn chat on a vLLM CPU engine ({result['backend']} pool)")
    table.add_column("")
    table.add_column("without kvpool", justify="right")
    table.add_column("with kvpool", justify="right")
    table.add_row("requests", str(result["requests"]), str(result["requests"]))
    table.add_row("prompt tokens", str(result["prompt_tokens"]), str(result["prompt_tokens"]))
    table.add_row("tokens from the engine's own cache", str(result["engine_cache_tokens_without"]),
                  str(result["engine_cache_tokens_with"]))
    table.add_row("tokens loaded from the pool", "-", str(result["tokens_loaded_from_pool"]))
    table.add_row("pool hit rate", "-", f"{result['pool_hit_rate']:.1%}")
    table.add_row("TTFT p50 (ms)", f"{result['ttft_p50_ms_without']:.1f}", f"{result['ttft_p50_ms_with']:.1f}")
    table.add_row("TTFT p90 (ms)", f"{result['ttft_p90_ms_without']:.1f}", f"{result['ttft_p90_ms_with']:.1f}")
    table.add_row(
        f"TTFT p50 of the {result['requests_with_pool_hits']} requests the pool served (ms)",
        f"{result['ttft_p50_ms_pool_hits_without']:.1f}",
        f"{result['ttft_p50_ms_pool_hits_with']:.1f}",
    )
    table.add_row("wall time (s)", f"{result['seconds_without']:.1f}", f"{result['seconds_with']:.1f}")
    identical = "yes" if result["identical_outputs"] else f"NO ({result['mismatched_requests']} differ)"
    table.add_row("identical outputs", "", identical)
    Console().print(table)
