"""A hung Mooncake master: per-request latency before, during and after, next to no connector.

A master that is stopped (SIGSTOP), swapping or deadlocked keeps its port open, so nothing fails
fast: every call to it blocks. One in-process vLLM CPU engine on a Mooncake pool serves the same
prompts, one at a time, in passes:

1. `before`: the pool is filled (the engine's own cache is reset before every pass, so hits would
   have to come from the pool);
2. the master is SIGSTOPped; `hung` passes run;
3. SIGCONT; `after` passes run until the pool serves hits again (or a bound passes).

The same prompts through an engine without the connector give `none`. Reported: p50/p99 of each
phase, the hung p99 counted from `settle_s` after the stop (target <= 1.1x `none`), how long after
SIGCONT the first pool hit came, and whether every output equals the no-connector output.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

from kvpool.benchmarks.measure.report import figure, markdown_table, verdict
from kvpool.testing.models import default_model_dir, make_tiny_model

TARGET_HUNG_P99_RATIO = 1.1
PHASES = ("none", "before", "warm_pool_hits", "hung_all", "hung_settled", "after")
ALL_ARGS: dict[str, Any] = {"prompts": 8, "prompt_tokens": 512, "hung_passes": 2}
TINY_ARGS: dict[str, Any] = {"prompts": 2, "prompt_tokens": 128, "hung_passes": 2, "model_kind": "llama",
             "settle_s": 0.1}


class Timed(NamedTuple):
    began: float  # monotonic
    seconds: float
    tokens: list[int]
    cached: int  # prompt tokens not computed (vLLM's num_cached_tokens: local or pool hits)

RECOVERY_BOUND_S = 30.0


def run(
    *,
    prompts: int = 8,
    prompt_tokens: int = 512,
    hung_passes: int = 2,
    settle_s: float = 1.0,
    model_kind: str = "llama-demo",
    block_size: int = 64,
) -> dict[str, Any]:
    from kvpool.backends.mooncake.master import start_master
    from kvpool.testing.engine import engine

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the table (or JSON) readable
    model = make_tiny_model(model_kind, default_model_dir() / model_kind)
    rng = random.Random(0)
    batch = [[rng.randrange(3, 1000) for _ in range(prompt_tokens)] for _ in range(prompts)]
    settings: dict[str, Any] = {"block_size": block_size, "max_model_len": prompt_tokens + 64}

    none: list[Timed] = []
    with engine(model, **settings) as llm:
        for _ in range(1 + hung_passes):
            llm.reset_prefix_cache()
            none += _pass(llm, batch)
    baseline = {tuple(prompt): timing.tokens for prompt, timing in zip(batch * (1 + hung_passes), none)}

    master = start_master()
    try:
        connector = {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "backend": "mooncake",
                "mooncake": {**master.backend_options(), "global_segment_size": "256MiB", "breaker_cooldown_s": 1.0},
            },
        }
        identical = True
        with engine(model, kv_transfer_config=connector, **settings) as llm:
            before = _pass(llm, batch)
            llm.reset_prefix_cache()
            warm = _pass(llm, batch)  # pool hits on a healthy master
            os.kill(master.pid, signal.SIGSTOP)
            stopped = time.monotonic()
            hung: list[Timed] = []
            try:
                for _ in range(hung_passes):
                    llm.reset_prefix_cache()
                    hung += _pass(llm, batch)
            finally:
                os.kill(master.pid, signal.SIGCONT)
            resumed = time.monotonic()
            after: list[Timed] = []
            first_hit_s = None
            while first_hit_s is None and time.monotonic() - resumed < RECOVERY_BOUND_S:
                llm.reset_prefix_cache()
                for timing in _pass(llm, batch):
                    after.append(timing)
                    if timing.cached > 0 and first_hit_s is None:
                        first_hit_s = round(timing.began - resumed, 2)
            for prompt, timing in zip(batch * 1000, before + warm + hung + after):
                identical &= timing.tokens == baseline[tuple(prompt)]
    finally:
        master.stop()

    hung_settled = [timing.seconds for timing in hung if timing.began - stopped >= settle_s]
    none_s = [timing.seconds for timing in none]
    ratio = _summary(hung_settled)["p99_ms"] / max(_summary(none_s)["p99_ms"], 1e-9)
    result: dict[str, Any] = {
        "prompts": prompts,
        "prompt_tokens": prompt_tokens,
        "model": model_kind,
        "none": _summary(none_s),
        "before": _summary([timing.seconds for timing in before]),
        "warm_pool_hits": _summary([timing.seconds for timing in warm]),
        "hung_all": _summary([timing.seconds for timing in hung]),
        "hung_settled": _summary(hung_settled),
        "after": _summary([timing.seconds for timing in after]),
        "first_hit_after_resume_s": first_hit_s,
        "tokens_from_pool_while_hung": sum(timing.cached for timing in hung),
        "identical_outputs": identical,
    }
    result["hung_p99_vs_none"] = round(ratio, 3)
    result["target"] = f"hung p99 (from {settle_s:.0f} s after the stop) <= {TARGET_HUNG_P99_RATIO}x none p99"
    # no request after the settle time measures nothing: that is no pass
    settled = bool(hung_settled)
    result["pass"] = bool(settled and ratio <= TARGET_HUNG_P99_RATIO and identical and first_hit_s is not None)
    return result


def _timed(llm: Any, prompt: list[int]) -> Timed:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    began = time.monotonic()
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return Timed(began, time.monotonic() - began, list(output.outputs[0].token_ids), int(output.num_cached_tokens or 0))


def _pass(llm: Any, batch: list[list[int]]) -> list[Timed]:
    return [_timed(llm, prompt) for prompt in batch]


def _summary(seconds: list[float]) -> dict[str, Any]:
    if not seconds:
        return {"requests": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "requests": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1000, 1),
        "p99_ms": round(p99 * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvpool bench hang: {result['prompts']} prompts of {result['prompt_tokens']} tokens")
    for column in ("phase", "requests", "p50 ms", "p99 ms", "max ms"):
        table.add_column(column, justify="right" if column != "phase" else "left")
    for phase in PHASES:
        row = result[phase]
        table.add_row(phase, str(row["requests"]), str(row["p50_ms"]), str(row["p99_ms"]), str(row["max_ms"]))
    Console().print(table)
    verdict = "PASS" if result["pass"] else "FAIL"
    Console().print(
        f"hung p99 / none p99 = {result['hung_p99_vs_none']} ({result['target']}); first pool hit "
        f"{result['first_hit_after_resume_s']} s after SIGCONT; identical outputs: {result['identical_outputs']}: "
        f"{verdict}"
    )


def _target_line(result: dict[str, Any]) -> str:
    return verdict(
        "hung master: request p99 from the settle time after the stop / no connector's p99",
        result["hung_p99_vs_none"],
        f"<= {TARGET_HUNG_P99_RATIO}x, outputs identical, hits back after SIGCONT",
        bool(result["pass"]),
    )


def to_markdown(result: dict[str, Any]) -> str:
    rows = [[phase, *(result[phase][k] for k in ("requests", "p50_ms", "p99_ms", "max_ms"))] for phase in PHASES]
    return (
        f"{result['prompts']} prompts of {result['prompt_tokens']} tokens, one at a time, model `{result['model']}`; "
        "per phase the request latency (ms):\n\n"
        + markdown_table(("phase", "requests", "p50", "p99", "max"), rows)
        + f"\n\nFirst pool hit {result['first_hit_after_resume_s']} s after SIGCONT; tokens served from the pool "
        f"while hung: {result['tokens_from_pool_while_hung']}; outputs identical to no connector: "
        f"{'yes' if result['identical_outputs'] else 'no'}.\n\n{_target_line(result)}\n"
    )


def plot(result: dict[str, Any], path: Path) -> None:
    with figure(path) as (_fig, (ax,)):
        positions = range(len(PHASES))
        ax.bar([p - 0.2 for p in positions], [result[ph]["p50_ms"] for ph in PHASES], width=0.4, label="p50")
        ax.bar([p + 0.2 for p in positions], [result[ph]["p99_ms"] for ph in PHASES], width=0.4, label="p99")
        ax.set_xticks(list(positions), PHASES, rotation=20)
        ax.set_ylabel("request latency, ms")
        ax.set_title("a hung Mooncake master (SIGSTOP)")
        ax.legend()
