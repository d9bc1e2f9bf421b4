"""What kvpool costs a request behind vLLM's OpenAI server, next to the same server without it.

Three servers, same model and settings, run in turns (one round each: without a connector, with a
connector that does nothing, with kvpool); requests one at a time by token ids:
* `miss`: prompts neither the engine nor the pool has seen (0% reuse): with kvpool ÷ without
  (target <= 1.05: the connector's whole cost on a request it cannot help), and ÷ a server with a
  connector that does nothing (`NoopConnector`: what vLLM's connector machinery itself costs);
* `local hit` (without kvpool): a prompt sent again at once, served by the engine's own prefix cache;
* `pool hit` (with kvpool): a prompt sent again after other prompts pushed it out of the engine's
  cache, so its prefix comes from the pool: ÷ the local hit (target <= 1.2); and ÷ the local hit of
  the same prompt sent once more at once to the kvpool server (the load's own cost, without what any
  connector costs every step).
Medians over all requests of a kind; both servers run the same prompts. A hybrid attention + Mamba
model (`model_kind="granite-hybrid"`, `block_size=128`, 300-token prompts) gives the hybrid row: its
pool hit loads the state at the 256-token boundary and the attention chunks below it.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from kvpool.benchmarks.measure.report import figure, markdown_table, verdict
from kvpool.benchmarks.measure.stats import median_ms
from kvpool.testing.models import default_model_dir, make_tiny_model
from kvpool.testing.server import SAME_CORES_ENV, OpenAIServer, openai_server

TARGET_MISS_RATIO = 1.05
NOOP_CONNECTOR = {
    "kv_connector": "NoopConnector",
    "kv_connector_module_path": "kvpool.testing.noop_connector",
    "kv_role": "kv_both",
}
TARGET_HIT_RATIO = 1.2
ALL_ARGS: dict[str, Any] = {"prompts": 12, "rounds": 2}
TINY_ARGS: dict[str, Any] = {"prompts": 2, "rounds": 1, "prompt_tokens": 200}
TOKEN_BYTES = 4 * 2 * 2 * 64 * 4  # the tiny llama in float32: 4 layers x 2 KV heads x K,V x 64 dims x 4 B
# a hybrid attention + Mamba2 model (`--model-kind granite-hybrid --block-size 128`): vLLM's CPU build needs
# max_num_batched_tokens=128 for it, and picks a 128-token state block and a 256-token attention block
# (a pool hit ends on a 256-token boundary); 8 blocks of 256 KiB hold about two prompts' cached blocks
HYBRID_SETTINGS: dict[str, dict[str, Any]] = {
    "granite-hybrid": {
        "kv_cache_memory_bytes": 2 << 20,
        "max_model_len": 512,
        "extra_args": ["--max-num-batched-tokens", "128", "--enable-prefix-caching"],
    },
}


def run(
    *, prompts: int = 12, prompt_tokens: int = 400, rounds: int = 2, model_kind: str = "llama", block_size: int = 64
) -> dict[str, Any]:
    model = make_tiny_model(model_kind, default_model_dir() / model_kind)
    rng = random.Random(0)

    def batch(count: int) -> list[list[int]]:
        return [[rng.randrange(3, 1000) for _ in range(prompt_tokens)] for _ in range(count)]

    rounds_prompts = [(batch(prompts), batch(4)) for _ in range(rounds)]
    settings: dict[str, Any] = {
        "block_size": block_size,
        "max_model_len": prompt_tokens + 2 * block_size,
        "kv_cache_memory_bytes": 1024 * TOKEN_BYTES,  # the engine's own cache holds two prompts
        "env": SAME_CORES_ENV,  # the same cores for the forward with and without a connector
    }
    if model_kind in HYBRID_SETTINGS:
        settings.update(HYBRID_SETTINGS[model_kind])
    connector = {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"capacity_bytes": "256MiB"},
    }
    without: dict[str, list[float]] = {"miss": [], "local_hit": []}
    noop: dict[str, list[float]] = {"miss": []}
    with_pool: dict[str, list[float]] = {"miss": [], "pool_hit": [], "local_hit": []}
    pool_tokens = 0
    # one server at a time (two would fight over the 2 cores), in turns, so that slow phases of a noisy
    # machine fall on all of them
    for first, others in rounds_prompts:
        with openai_server(model, **settings) as plain:
            _warm(plain, prompt_tokens)
            for prompt in first:
                without["miss"].append(_timed(plain, prompt)[0])
                seconds, cached = _timed(plain, prompt)  # at once: the engine's own cache has it
                if cached:
                    without["local_hit"].append(seconds)
        with openai_server(model, kv_transfer_config=NOOP_CONNECTOR, **settings) as idle:
            _warm(idle, prompt_tokens)
            noop["miss"] += [_timed(idle, prompt)[0] for prompt in first]
        with openai_server(model, kv_transfer_config=connector, **settings) as pool:
            _warm(pool, prompt_tokens)
            with_pool["miss"] += [_timed(pool, prompt)[0] for prompt in first]
            for prompt in others:  # push the first prompts out of the engine's own cache
                _timed(pool, prompt)
            for prompt in first:
                seconds, cached = _timed(pool, prompt)
                if cached:
                    with_pool["pool_hit"].append(seconds)
                    pool_tokens += cached
                    seconds, cached = _timed(pool, prompt)  # at once: now this engine's own cache has it
                    if cached:
                        with_pool["local_hit"].append(seconds)
    medians = {
        "miss_ms_without": median_ms(without["miss"]),
        "miss_ms_noop_connector": median_ms(noop["miss"]),
        "miss_ms_with": median_ms(with_pool["miss"]),
        "local_hit_ms_without": median_ms(without["local_hit"]),
        "pool_hit_ms_with": median_ms(with_pool["pool_hit"]),
        "local_hit_ms_with": median_ms(with_pool["local_hit"]),
    }
    miss_ratio = medians["miss_ms_with"] / max(medians["miss_ms_without"], 1e-9)
    hit_ratio = medians["pool_hit_ms_with"] / max(medians["local_hit_ms_without"], 1e-9)
    return {
        "model": model_kind,
        "prompt_tokens": prompt_tokens,
        "requests_per_kind": prompts * rounds,
        **medians,
        "pool_hits": len(with_pool["pool_hit"]),
        "pool_tokens": pool_tokens,
        "miss_ratio": round(miss_ratio, 3),
        "miss_ratio_vs_noop_connector": round(
            medians["miss_ms_with"] / max(medians["miss_ms_noop_connector"], 1e-9), 3
        ),
        "pool_hit_vs_local_hit": round(hit_ratio, 3),
        # the same two hits on one server (kvpool's): the load's own cost, without the connector machinery's
        "pool_hit_vs_local_hit_same_server": round(
            medians["pool_hit_ms_with"] / max(medians["local_hit_ms_with"], 1e-9), 3
        ),
        "targets": f"miss ratio <= {TARGET_MISS_RATIO}; pool hit <= {TARGET_HIT_RATIO}x local hit",
        "pass": bool(
            miss_ratio <= TARGET_MISS_RATIO
            and hit_ratio <= TARGET_HIT_RATIO
            and len(with_pool["pool_hit"]) == prompts * rounds
        ),
    }


def _warm(server: OpenAIServer, prompt_tokens: int) -> None:
    rng = random.Random(1)
    for _ in range(3):
        server.complete([rng.randrange(3, 1000) for _ in range(prompt_tokens)], 8)


def _timed(server: OpenAIServer, prompt: list[int]) -> tuple[float, int]:
    began = time.perf_counter()
    result = server.complete(prompt, 8)
    return time.perf_counter() - began, result["cached_tokens"]


def _rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(request, baseline figure, kvpool figure, ratio) per row of the table."""
    return [
        ("miss (0% reuse)", "miss_ms_without", "miss_ms_with", "miss_ratio"),
        ("miss, next to a connector that does nothing", "miss_ms_noop_connector", "miss_ms_with",
         "miss_ratio_vs_noop_connector"),
        ("hit: engine's own cache / the pool", "local_hit_ms_without", "pool_hit_ms_with", "pool_hit_vs_local_hit"),
        ("hit, both on the kvpool server: its own cache / the pool", "local_hit_ms_with", "pool_hit_ms_with",
         "pool_hit_vs_local_hit_same_server"),
    ]  # fmt: skip


def to_markdown(result: dict[str, Any]) -> str:
    rows = [[what, result[base], result[ours], result[ratio]] for what, base, ours, ratio in _rows(result)]
    lines = [
        verdict("miss with kvpool / without", result["miss_ratio"], f"<= {TARGET_MISS_RATIO}",
                result["miss_ratio"] <= TARGET_MISS_RATIO),
        verdict("pool hit / the engine's own hit", result["pool_hit_vs_local_hit"], f"<= {TARGET_HIT_RATIO}",
                result["pool_hit_vs_local_hit"] <= TARGET_HIT_RATIO),
    ]
    mark = "PASS" if result["pass"] else "FAIL"
    return (
        f"Model `{result['model']}`, {result['prompt_tokens']}-token prompts, {result['requests_per_kind']} requests "
        "a kind, one at a time, servers in turns; medians (ms). One run: no interval (the serve bench's hit "
        "probe and control give the same comparisons over interleaved rounds).\n\n"
        + markdown_table(("request", "baseline", "with kvpool", "ratio"), rows)
        + f"\n\nPool hits {result['pool_hits']} of {result['requests_per_kind']}, {result['pool_tokens']:,} tokens "
        f"from the pool.\n\n" + "\n".join([*lines, f"- all targets: {mark}"]) + "\n"
    )


def plot(result: dict[str, Any], path: Path) -> None:
    rows = _rows(result)
    with figure(path, width=7.0) as (_fig, (ax,)):
        positions = range(len(rows))
        ax.bar([p - 0.2 for p in positions], [result[base] for _, base, _, _ in rows], width=0.4, label="baseline")
        ax.bar([p + 0.2 for p in positions], [result[ours] for _, _, ours, _ in rows], width=0.4, label="with kvpool")
        ax.set_xticks(list(positions), ["miss", "miss vs no-op", "hit", "hit, same server"])
        ax.set_ylabel("request latency, ms (median)")
        ax.legend()


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvpool bench serve-overhead: {result['requests_per_kind']} requests a kind (medians)")
    table.add_column("request")
    table.add_column("without kvpool (ms)", justify="right")
    table.add_column("with kvpool (ms)", justify="right")
    table.add_column("ratio", justify="right")
    table.add_row(
        "miss (0% reuse)", str(result["miss_ms_without"]), str(result["miss_ms_with"]), str(result["miss_ratio"])
    )
    table.add_row(
        "miss, next to a connector that does nothing",
        str(result["miss_ms_noop_connector"]),
        str(result["miss_ms_with"]),
        str(result["miss_ratio_vs_noop_connector"]),
    )
    table.add_row(
        "hit: engine's own cache / the pool",
        str(result["local_hit_ms_without"]),
        str(result["pool_hit_ms_with"]),
        str(result["pool_hit_vs_local_hit"]),
    )
    table.add_row(
        "hit, both on the kvpool server: its own cache / the pool",
        str(result["local_hit_ms_with"]),
        str(result["pool_hit_ms_with"]),
        str(result["pool_hit_vs_local_hit_same_server"]),
    )
    Console().print(table)
    Console().print(f"targets: {result['targets']}: {'PASS' if result['pass'] else 'FAIL'}")
