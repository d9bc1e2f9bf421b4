"""Where a request's time goes, per connector on Mooncake: `kvpool bench breakdown`.

kvpool on Mooncake (`backend: "mooncake"`, with `lookup_wait_ms` 0, the old "ask again" lookups, and
its default) and vLLM's own `MooncakeStoreConnector`, in the same placement (a mooncake_master on
127.0.0.1 and one standalone segment holder; the engine's client gives no memory: vLLM's
`standalone-store` mode), on the same workload, measured from the engine's side by the same timers
(`breakdown_probe`): in-process vLLM CPU engines driven with `add_request` + `step()`, so steps are
explicit.

Per system and round, on a fresh master and segment holder:
1. a fill engine computes the source prompts (the pool now holds their KV) and is shut down;
2. a fresh engine runs `hit` prompts (each shares all but its last block with a source prompt, and
   none shares a block with another: hits come from the pool only), then `miss` prompts (0% reuse),
   each at every concurrency (requests added together, the next group once all have finished).

Systems run interleaved, their order rotated round by round; every figure is the median over rounds
of the per-round mean over requests (per step: over the phase's steps). The machine is shared
(2 cores): timings are noisy, steps are not.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
from dataclasses import dataclass
from typing import Any

from kvpool.benchmarks.serving import breakdown_engines as engines
from kvpool.benchmarks.serving.breakdown_probe import SAVE_HOOKS, Probe, Record, drive

# (row name, system, kvpool's lookup_wait_ms or None, Python's GIL switch interval in ms or None: unchanged)
Row = tuple[str, str, float | None, float | None]
ROWS: tuple[Row, ...] = (
    ("kvpool-mooncake wait=0ms", "kvpool-mooncake", 0.0, None),
    ("kvpool-mooncake wait=5ms", "kvpool-mooncake", 5.0, None),
    ("vllm-mooncake", "vllm-mooncake", None, None),
)
# a diagnostic: the same with a 0.5 ms GIL switch interval (Python's default is 5 ms), how long a thread
# that wants the GIL waits while the engine's thread runs Python (its empty steps while a load is awaited)
GIL_ROWS: tuple[Row, ...] = (
    ("kvpool-mooncake wait=5ms gil=0.5ms", "kvpool-mooncake", 5.0, 0.5),
    ("vllm-mooncake gil=0.5ms", "vllm-mooncake", None, 0.5),
)
KVPOOL_COUNTERS = ("lookups", "lookup_waits", "loads", "load_tokens", "loads_finished", "load_wait_steps")
TINY_ARGS: dict[str, Any] = {
    "rounds": 1,
    "requests": 2,
    "concurrencies": (1, 2),
    "prompt_tokens": 192,
    "max_tokens": 3,
    "model_kind": "llama",
    "profile": False,
    # the mechanism, not the speed: a master on a loaded 2-core test machine can take over 5 ms to answer
    # (the longest wait allowed is the lookup's deadline, lookup_timeout_s: 100 ms)
    "rows": (ROWS[0], ("kvpool-mooncake wait=100ms", "kvpool-mooncake", 100.0, None), ROWS[2]),
}


@dataclass(frozen=True)
class Workload:
    sources: list[list[int]]  # the fill engine's prompts
    hit: list[list[int]]  # the measured engine's pool hits: a source's prefix, a new last block
    miss: list[list[int]]  # 0% reuse

    @classmethod
    def make(cls, requests: int, concurrencies: tuple[int, ...], prompt_tokens: int, block: int) -> Workload:
        rng = random.Random(25)

        def tokens(count: int) -> list[int]:
            return [rng.randrange(3, 1000) for _ in range(count)]

        cells = requests * len(concurrencies)
        sources = [tokens(prompt_tokens) for _ in range(cells)]
        keep = prompt_tokens - block
        hit = [source[:keep] + tokens(block) for source in sources]
        return cls(sources, hit, [tokens(prompt_tokens) for _ in range(cells)])


def run(
    *,
    rounds: int = 3,
    requests: int = 24,
    concurrencies: tuple[int, ...] = (1, 4),
    prompt_tokens: int = 512,
    max_tokens: int = 8,
    model_kind: str = "llama-demo",
    block_size: int = 64,
    profile: bool = True,
    rows: tuple[Row, ...] = ROWS,
) -> dict[str, Any]:
    from kvpool.testing.models import default_model_dir, make_tiny_model

    _quiet_env()
    model = str(make_tiny_model(model_kind, default_model_dir() / model_kind))
    workload = Workload.make(requests, concurrencies, prompt_tokens, block_size)
    settings = {"block_size": block_size, "max_model_len": prompt_tokens + 64, "max_num_seqs": max(concurrencies)}
    per_round: dict[str, list[list[dict[str, Any]]]] = {row[0]: [] for row in rows}
    outputs: dict[str, dict[str, Any]] = {}
    for index in range(rounds):
        order = rows[index % len(rows) :] + rows[: index % len(rows)]
        for name, system, wait_ms, switch_ms in order:
            default_switch = sys.getswitchinterval()
            with engines.pool() as (master, _pids), engines.connector(system, master, wait_ms) as config:
                engines.fill(model, config, workload, settings)
                try:
                    if switch_ms is not None:
                        sys.setswitchinterval(switch_ms / 1000)
                    probe_result = _measure(model, config, workload, settings, concurrencies, max_tokens, system)
                finally:
                    sys.setswitchinterval(default_switch)
            per_round[name].append(probe_result["cells"])
            outputs.setdefault(name, probe_result["outputs"])
    result: dict[str, Any] = {
        "bench": "breakdown",
        "settings": {
            "rounds": rounds,
            "requests_per_cell": requests,
            "concurrencies": list(concurrencies),
            "prompt_tokens": prompt_tokens,
            "hit_tokens_expected": prompt_tokens - block_size,
            "max_tokens": max_tokens,
            "gil_switch_interval_ms": sys.getswitchinterval() * 1000,
            "model": model_kind,
            "block_size": block_size,
            "placement": "mooncake_master + one standalone segment holder on 127.0.0.1; engine clients give "
            "no memory (vLLM's standalone-store mode)",
        },
        "rows": [cell for name, *_ in rows for cell in _medians(name, per_round[name])],
        "outputs_equal": _outputs_equal(outputs),
        "notes": [
            "a step is one Scheduler.schedule() call; ms are perf_counter on the calling thread",
            "figures are medians over rounds of per-round means; the 2-core machine was shared, so ms are "
            "noisy and steps are not",
            "ttft = lookup_wait (added -> lookup answered) + load_wait (answered -> first scheduled to "
            "compute) + compute (scheduled -> first token out)",
        ],
    }
    if profile:
        from kvpool.benchmarks.serving.breakdown_profile import profile_hits

        result["profile"] = {
            name: profile_hits(model, name, system, wait_ms, workload, settings, concurrencies, max_tokens)
            for name, system, wait_ms, switch_ms in rows
            if wait_ms != 0.0 and switch_ms is None
        }
    return result


def _quiet_env() -> None:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _measure(model: str, config: dict[str, Any], workload: Workload, settings: dict[str, Any],
             concurrencies: tuple[int, ...], max_tokens: int, system: str) -> dict[str, Any]:  # fmt: skip
    from kvpool.integrations.vllm import local_scheduler

    cells: list[dict[str, Any]] = []
    outputs: dict[str, Any] = {}
    with engines.engine(model, config, settings) as llm:
        probe = Probe(llm)
        try:
            per = len(workload.hit) // len(concurrencies)
            for phase, prompts in (("hit", workload.hit), ("miss", workload.miss)):
                for index, concurrency in enumerate(concurrencies):
                    label = f"{phase}/c{concurrency}"
                    core = local_scheduler() if system == "kvpool-mooncake" else None
                    before = _counters(core)
                    probe.phase = label
                    drive(probe, prompts[index * per : (index + 1) * per], max_tokens, concurrency, label)
                    probe.phase = ""
                    cell = _cell(probe, label, phase, concurrency)
                    if core is not None:
                        after = _counters(core)
                        cell["kvpool_counters"] = {key: after[key] - before[key] for key in KVPOOL_COUNTERS}
                    cells.append(cell)
            outputs = {record.name: _greedy(record) for record in probe.requests}
        finally:
            probe.close()
    return {"cells": cells, "outputs": outputs}


def _counters(core: Any) -> dict[str, int]:
    return {key: getattr(core.stats, key) for key in KVPOOL_COUNTERS} if core is not None else {}


def _ms(ns: int | None) -> float:
    return (ns or 0) / 1e6


def _cell(probe: Probe, label: str, phase: str, concurrency: int) -> dict[str, Any]:
    """One round's figures for a phase and concurrency: means over its requests and steps."""
    records: list[Record] = [r for r in probe.requests if r.phase == label]
    assert records and all(r.finished and r.token_ns and r.sched_ns and r.lookup_done_ns for r in records), label
    loads = [r for r in records if r.alloc_step is not None]
    steps = max(probe.steps[label], 1)

    def mean(values: list[float]) -> float:
        return statistics.fmean(values) if values else 0.0

    hooks = {key: cell[0] / steps / 1e6 for key, cell in probe.hook_ns[label].items()}
    calls = {key: cell[1] / steps for key, cell in probe.hook_ns[label].items()}
    return {
        "phase": phase,
        "concurrency": concurrency,
        "requests": len(records),
        "steps": probe.steps[label],
        "lookup_wait_steps": mean([len(r.ask_again_steps) for r in records]),
        "answered_first_call": mean([0.0 if r.ask_again_steps else 1.0 for r in records]),
        "lookup_calls": mean([r.lookup_calls for r in records]),
        "lookup_ms": mean([_ms(r.lookup_ns) for r in records]),
        "loads": len(loads),
        "loaded_tokens": mean([r.load_tokens for r in records]),
        "loaded_tokens_min": min(r.load_tokens for r in records),
        "loaded_tokens_max": max(r.load_tokens for r in records),
        "cached_tokens": mean([r.cached_tokens for r in records]),
        "load_wait_steps": mean([(r.sched_step or 0) - (r.alloc_step or 0) for r in loads]),
        "load_recv_steps": mean([(r.recv_step or 0) - (r.alloc_step or 0) for r in loads if r.recv_step]),
        "load_ms": mean([_ms((r.recv_ns or 0) - (r.alloc_ns or 0)) for r in loads if r.recv_ns]),
        "ttft_steps": mean([(r.token_step or 0) - r.arrived_step + 1 for r in records]),
        "ttft_ms": mean([_ms((r.token_ns or 0) - r.arrived_ns) for r in records]),
        "ttft_lookup_wait_ms": mean([_ms((r.lookup_done_ns or 0) - r.arrived_ns) for r in records]),
        "ttft_load_wait_ms": mean([_ms((r.sched_ns or 0) - (r.lookup_done_ns or 0)) for r in records]),
        "ttft_compute_ms": mean([_ms((r.token_ns or 0) - (r.sched_ns or 0)) for r in records]),
        "step_ms": _ms(probe.step_ns[label]) / steps,
        "scheduler_ms_per_step": sum(v for k, v in hooks.items() if k.startswith("scheduler.")),
        "worker_ms_per_step": sum(v for k, v in hooks.items() if k.startswith("worker.")),
        "save_path_ms_per_step": sum(hooks.get(f"worker.{name}", 0.0) for name in SAVE_HOOKS),
        "hooks_ms_per_step": dict(sorted(hooks.items())),
        "hook_calls_per_step": dict(sorted(calls.items())),
    }


def _medians(name: str, rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per cell, the median over rounds of every figure (nested dicts per key)."""
    rows = []
    for cells in zip(*rounds):
        row: dict[str, Any] = {"row": name, "phase": cells[0]["phase"], "concurrency": cells[0]["concurrency"]}
        for key, value in cells[0].items():
            if key in row:
                continue
            if isinstance(value, dict):
                keys = sorted({k for cell in cells for k in cell.get(key, {})})
                row[key] = {k: _round(statistics.median(c.get(key, {}).get(k, 0.0) for c in cells)) for k in keys}
            else:
                row[key] = _round(statistics.median(cell[key] for cell in cells))
        row["ttft_ms_rounds"] = [_round(cell["ttft_ms"]) for cell in cells]
        rows.append(row)
    return rows


def _round(value: float) -> float:
    return round(float(value), 4 if abs(value) < 1 else 2)


def _greedy(record: Record) -> Any:
    from kvpool.testing.engine import GreedyResult

    return GreedyResult(record.token_ids, record.cached_tokens, record.top)


def _outputs_equal(outputs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each system's tokens against the first system's, for every measured prompt of the first round,
    tie-aware (`assert_same_greedy`: first tokens exact; a later divergence only at a near-tie in both)."""
    from kvpool.testing.engine import assert_same_greedy

    names = list(outputs)
    verdict: dict[str, Any] = {"reference": names[0] if names else None, "equal": bool(names)}
    for name in names[1:]:
        prompts = sorted(outputs[names[0]])
        try:
            summary = assert_same_greedy([outputs[names[0]][p] for p in prompts], [outputs[name][p] for p in prompts])
            verdict[name] = {"prompts": len(prompts), "identical": summary.num_identical,
                             "near_tie_divergences": summary.num_tie_divergences}  # fmt: skip
        except AssertionError as exc:
            verdict[name] = {"prompts": len(prompts), "error": str(exc)[:300]}
            verdict["equal"] = False
    return verdict


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    settings = result["settings"]
    table = Table(
        title=f"kvpool bench breakdown: per request, median of {settings['rounds']} rounds, "
        f"{settings['requests_per_cell']} requests per cell, {settings['prompt_tokens']}-token prompts"
    )
    columns = (
        ("row", "row"), ("phase", "phase"), ("conc", "concurrency"), ("lookup wait steps", "lookup_wait_steps"),
        ("lookup ms (sched)", "lookup_ms"), ("load wait steps", "load_wait_steps"), ("load ms", "load_ms"),
        ("loaded tok", "loaded_tokens"), ("TTFT ms", "ttft_ms"), ("= lookup wait", "ttft_lookup_wait_ms"),
        ("+ load wait", "ttft_load_wait_ms"), ("+ compute", "ttft_compute_ms"),
        ("sched ms/step", "scheduler_ms_per_step"), ("worker ms/step", "worker_ms_per_step"),
        ("save ms/step", "save_path_ms_per_step"), ("step ms", "step_ms"),
    )  # fmt: skip
    for title, _ in columns:
        table.add_column(title, justify="left" if title in ("row", "phase") else "right")
    for row in result["rows"]:
        table.add_row(*(str(row[key]) for _, key in columns))
    console = Console(width=max(Console().width, 240))
    console.print(table)
    console.print(f"outputs equal across systems (tie-aware): {result['outputs_equal']}")
    for name, frames in result.get("profile", {}).items():
        console.print(f"py-spy, hit phase, {name}: top frames by own time in connector code")
        for frame in frames.get("own", [])[:8]:
            console.print(f"  {frame['percent']:5.1f}%  {frame['frame']}")


# BENCHMARKS.md's table: the default kvpool row and vLLM's connector, per request kind and concurrency
REPORTED_ROWS = {"kvpool-mooncake wait=5ms": "kvpool on Mooncake", "vllm-mooncake": "vLLM's MooncakeStoreConnector"}
REPORT_HEADER = (
    "| request | connector | lookup: steps / ms | load: alloc → finished_recving ms | compute ms | TTFT ms "
    "| save path on the engine thread ms/step | connector ms/step (scheduler + worker) |\n"
    "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n"
)


def to_markdown(result: dict[str, Any]) -> str:
    """The report's table of `result` (the lookup's wait as TTFT sees it; the connector's cost per step
    is its scheduler side plus its worker side)."""
    rows = sorted(
        (r for r in result["rows"] if r["row"] in REPORTED_ROWS),
        key=lambda r: (r["phase"], r["concurrency"], list(REPORTED_ROWS).index(r["row"])),
    )
    lines = [
        f"| {r['phase']}, concurrency {r['concurrency']} | {REPORTED_ROWS[r['row']]} "
        f"| {r['lookup_wait_steps']:.0f} / {r['ttft_lookup_wait_ms']:.1f} | {r['load_ms']:.1f} "
        f"| {r['ttft_compute_ms']:.1f} | {r['ttft_ms']:.1f} | {r['save_path_ms_per_step']:.3f} "
        f"| {r['scheduler_ms_per_step'] + r['worker_ms_per_step']:.3f} |\n"
        for r in rows
    ]
    return REPORT_HEADER + "".join(lines)
