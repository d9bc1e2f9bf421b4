"""`kvpool bench ...`: each measurement, printed as a table or JSON (`--json`); exit 1 when a target
is missed (unless `--no-fail`)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kvpool.ops.cli_common import AsJson, NoFail, emit, ints

DEFAULT_CONTEXTS = "1024,4096,16384,32768,65536,131072"
TRACE_DTYPES = ("bfloat16", "float32")  # what vLLM's CPU build serves the bench model in

bench_app = typer.Typer(no_args_is_help=True, help="Measurements, printed as a table or JSON.")


@bench_app.command("store-path")
def bench_store_path(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    requests: Annotated[int, typer.Option(help="concurrent requests")] = 8,
    steps: Annotated[int, typer.Option(help="decode steps measured per cell")] = 64,
    contexts: Annotated[str, typer.Option(help="context lengths in tokens, comma separated")] = DEFAULT_CONTEXTS,
    block_sizes: Annotated[str, typer.Option(help="block sizes, comma separated")] = "16,128",
    modes: Annotated[
        str, typer.Option(help="incremental, incremental_mooncake, vllm, full, full_on_block (comma separated)")
    ] = "incremental,incremental_mooncake,vllm,full,full_on_block",
    cases: Annotated[str, typer.Option(help="full, hybrid, put_step2 (comma separated)")] = "full,hybrid,put_step2",
) -> None:
    """CPU cost per engine step of the save path: kvpool's incremental store vs vLLM's own Mooncake store
    connector and the full re-check, in the same cells."""
    from kvpool.benchmarks.per_step import store_path

    chosen = {}
    for option, text, allowed in (("--modes", modes, store_path.MODES), ("--cases", cases, store_path.CASES)):
        names = [name.strip() for name in text.split(",") if name.strip()]
        if not names or set(names) - set(allowed):
            raise typer.BadParameter(f"{text!r}: expected some of {', '.join(allowed)}", param_hint=option)
        chosen[option] = names
    result = store_path.run(
        contexts=ints("--contexts", contexts),
        block_sizes=ints("--block-sizes", block_sizes),
        requests=requests,
        steps=steps,
        modes=chosen["--modes"],
        cases=chosen["--cases"],
    )
    emit(result, as_json, store_path.print_table, no_fail)


@bench_app.command("connector-step")
def bench_connector_step(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    requests: Annotated[str, typer.Option(help="concurrent requests per cell, comma separated")] = "8,64",
    contexts: Annotated[str, typer.Option(help="context lengths in tokens, comma separated")] = "1024,16384,131072",
    block_sizes: Annotated[str, typer.Option(help="block sizes, comma separated")] = "16,64",
    steps: Annotated[int, typer.Option(help="decode steps per timed window", min=1)] = 64,
    backends: Annotated[str, typer.Option(help="memory, mooncake (kvpool) and/or vllm (its own connector)")] = (
        "memory,mooncake,vllm"
    ),
) -> None:
    """CPU per engine step of the whole connector (scheduler + worker side): kvpool vs vLLM's Mooncake store."""
    from kvpool.benchmarks.per_step import connector_step

    try:
        result = connector_step.run(
            requests=ints("--requests", requests),
            contexts=ints("--contexts", contexts),
            block_sizes=ints("--block-sizes", block_sizes),
            steps=steps,
            backends=[part.strip() for part in backends.split(",") if part.strip()],
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    emit(result, as_json, connector_step.print_table, no_fail)


@bench_app.command("transfer")
def bench_transfer(
    backend: Annotated[str, typer.Option(help="memory, mooncake or disk (the embedded pool's disk tier)")] = "memory",
    as_json: AsJson = False,
    no_fail: NoFail = False,
    pieces: Annotated[str, typer.Option(help="pieces per chunk (layers), comma separated")] = "4,1",
    keys: Annotated[int, typer.Option(help="chunks per batch", min=1)] = 32,
    reps: Annotated[int, typer.Option(help="timed rounds per cell (the median is reported)", min=1)] = 15,
    directory: Annotated[
        str | None, typer.Option("--dir", help="disk: where to write (default: the working directory's disk)")
    ] = None,
) -> None:
    """Save/load throughput per chunk size next to raw Mooncake and memcpy; the disk tier next to the
    disk's own sequential bandwidth."""
    from kvpool.benchmarks.transfer import backends

    if backend == "disk":
        from kvpool.benchmarks.transfer import disk

        if reps < 2:
            raise typer.BadParameter(f"--reps {reps}: the disk bench needs at least 2 rounds for an interval")
        emit(disk.run(keys=keys, rounds=reps, directory=directory), as_json, disk.print_table, no_fail)
        return

    counts = ints("--pieces", pieces)
    try:
        backends.check_arguments(backend, backends.CHUNK_SIZES, counts, keys, reps)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    result = backends.run(backend=backend, pieces=counts, keys_per_batch=keys, reps=reps)
    emit(result, as_json, backends.print_table, no_fail)


@bench_app.command("lookup")
def bench_lookup(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    contexts: Annotated[str, typer.Option(help="prompt lengths in tokens, comma separated")] = DEFAULT_CONTEXTS,
    block_sizes: Annotated[str, typer.Option(help="block sizes, comma separated")] = "16,64",
    reps: Annotated[int, typer.Option(help="lookups per cell", min=10)] = 200,
    mooncake: Annotated[bool, typer.Option(help="also ask a real mooncake_master (started on 127.0.0.1)")] = True,
) -> None:
    """Lookup latency on the scheduler's thread: embedded index vs Mooncake vs raw batch_is_exist."""
    from kvpool.benchmarks.per_step import lookup

    result = lookup.run(
        contexts=ints("--contexts", contexts),
        block_sizes=ints("--block-sizes", block_sizes),
        reps=reps,
        mooncake=mooncake,
    )
    emit(result, as_json, lookup.print_table, no_fail)


@bench_app.command("scale")
def bench_scale(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    concurrency: Annotated[str, typer.Option(help="concurrent requests per step, comma separated")] = "1,4,16,64,256",
    pool_requests: Annotated[int, typer.Option(help="requests of the pool-at-capacity workload", min=1)] = 20_000,
) -> None:
    """Store-path and lookup cost per request vs concurrency; the embedded pool at capacity, before and after
    chain-aware eviction."""
    from kvpool.benchmarks.per_step import scale

    args = {**scale.ALL_ARGS, "concurrency": ints("--concurrency", concurrency), "pool_requests": pool_requests}
    emit(scale.run(**args), as_json, scale.print_table, no_fail)


@bench_app.command("serve-overhead")
def bench_serve_overhead(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    prompts: Annotated[int, typer.Option(help="prompts per round", min=1)] = 12,
    rounds: Annotated[int, typer.Option(help="rounds", min=1)] = 2,
) -> None:
    """Per-request latency behind vLLM's OpenAI server, with and without kvpool (misses, hits)."""
    from kvpool.benchmarks.serving import serve_overhead

    result = serve_overhead.run(prompts=prompts, rounds=rounds)
    emit(result, as_json, serve_overhead.print_table, no_fail)


@bench_app.command("serve")
def bench_serve(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    systems: Annotated[str, typer.Option(help="systems, comma separated (default: all)")] = "",
    concurrencies: Annotated[str, typer.Option(help="client concurrencies, comma separated")] = "1,4,16",
    rounds: Annotated[int, typer.Option(help="interleaved rounds (intervals need >= 2; 95% ones >= 6)", min=1)] = 3,
    min_pool_mib: Annotated[
        int, typer.Option(help="every pool's capacity at least this (default: a third of the working set)", min=0)
    ] = 0,
) -> None:
    """End to end behind vLLM's OpenAI server with vLLM's serving benchmark client: kvpool next to the peers."""
    from kvpool.benchmarks.serving import serve, serve_systems, serve_workload

    names = [part.strip() for part in systems.split(",") if part.strip()] or list(serve_systems.SYSTEMS)
    try:
        wanted = tuple(ints("--concurrencies", concurrencies))
        least = min_pool_mib << 20 if min_pool_mib else serve_workload.Workload().min_pool_bytes
        result = serve.run(systems=names, concurrencies=wanted, rounds=rounds, min_pool_bytes=least)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--systems") from exc
    emit(result, as_json, serve.print_table, no_fail)


@bench_app.command("trace-hits")
def bench_trace_hits(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    capacities: Annotated[
        str, typer.Option(help="pool capacities as shares of the trace's distinct blocks, comma separated")
    ] = "0.01,0.02,0.05,0.1,0.2",
    limit: Annotated[int, typer.Option(help="the trace's first requests only (0: all of them)", min=0)] = 0,
    trace: Annotated[
        str | None, typer.Option("--trace", help="a trace in the Mooncake format (default: the shared one)")
    ] = None,
    policies: Annotated[
        str, typer.Option(help="the pool's policies replayed, comma separated (lru always)")
    ] = "adaptive,lru,chain-lru,weighted,second-sight",
    engine_share: Annotated[
        float, typer.Option(help="the engine's prefix cache in front, a share of the distinct blocks (0: none)")
    ] = 0.01,
    derived: Annotated[
        str, typer.Option(help="derived traces also replayed: second-half, alternate (comma separated; '' none)")
    ] = "second-half,alternate",
    disk: Annotated[bool, typer.Option("--disk/--no-disk", help="the default policy with its disk tier below")] = True,
    workers: Annotated[int, typer.Option(help="replays at once, in processes (0: one per CPU core)", min=0)] = 0,
) -> None:
    """Hit rates over a trace (by default the Mooncake conversation trace): the embedded pool under each of
    its policies, plain LRU, Belady's MIN; alone, behind an engine cache, on derived traces."""
    from pathlib import Path

    from kvpool.benchmarks.policy import trace_hits

    path = Path(trace) if trace else trace_hits.TRACE
    if not path.is_file():
        raise typer.BadParameter(f"{path}: no such file", param_hint="--trace")
    try:
        shares = [float(part) for part in capacities.split(",") if part.strip()]
        result = trace_hits.run(
            capacities=shares,
            limit=limit or None,
            trace=path,
            tiered=disk,
            policies=[part.strip() for part in policies.split(",") if part.strip()],
            engine_share=engine_share,
            derived=[part.strip() for part in derived.split(",") if part.strip()],
            workers=workers,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    emit(result, as_json, trace_hits.print_table, no_fail)


@bench_app.command("trace")
def bench_trace(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    systems: Annotated[str, typer.Option(help="systems, comma separated (default: local and the pools)")] = "",
    concurrencies: Annotated[str, typer.Option(help="client concurrencies, comma separated")] = "4",
    rounds: Annotated[int, typer.Option(help="interleaved rounds (intervals need >= 2; 95% ones >= 6)", min=1)] = 3,
    requests: Annotated[int, typer.Option(help="requests of the trace per round", min=1)] = 60,
    pool_fraction: Annotated[
        float, typer.Option(help="every pool's capacity, as a share of a round's distinct blocks", min=0.01)
    ] = 0.25,
    speedup: Annotated[
        float, typer.Option(help="replay the trace's arrival times this many times faster (0: closed loop)", min=0)
    ] = 0.0,
    dtype: Annotated[
        str, typer.Option(help="the engine's dtype: bfloat16, or float32 on a CPU without AVX-512 (bf16 ~15x slower)")
    ] = "bfloat16",
    engine_cache_tokens: Annotated[
        int, typer.Option(help="the engine's own KV cache (default: 4 of the longest prompts, or the concurrency's)")
    ] = 0,
) -> None:
    """The Mooncake conversation trace replayed behind vLLM's OpenAI server: kvpool next to the peers."""
    from kvpool.benchmarks.serving import trace

    names = [part.strip() for part in systems.split(",") if part.strip()] or list(trace.SYSTEMS)
    if dtype not in TRACE_DTYPES:
        raise typer.BadParameter(f"--dtype {dtype!r}: expected one of {', '.join(TRACE_DTYPES)}")
    try:
        wanted = tuple(ints("--concurrencies", concurrencies))
        default = trace.Workload()  # the engine's cache holds the most requests at once, and 8 blocks more
        least = max(wanted) * default.max_model_len + 8 * default.block_size
        cache = engine_cache_tokens or max(default.engine_cache_tokens, least)  # too small: `trace.check` says so
        result = trace.run(
            systems=names,
            concurrencies=wanted,
            rounds=rounds,
            requests=requests,
            pool_fraction=pool_fraction,
            speedup=speedup or None,
            engine_cache_tokens=cache,
            dtype=dtype,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    emit(result, as_json, trace.print_table, no_fail)


@bench_app.command("shared")
def bench_shared(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    systems: Annotated[str, typer.Option(help="systems, comma separated (default: both pools and local)")] = "",
    rounds: Annotated[int, typer.Option(help="interleaved rounds (intervals need >= 2; 95% ones >= 6)", min=1)] = 6,
    prompts: Annotated[int, typer.Option(help="A's prompts per round (and as many misses on B)", min=1)] = 8,
) -> None:
    """Two vLLM servers sharing one Mooncake master: B's TTFT and pool hit rate on A's prompts, kvpool
    next to vLLM's MooncakeStoreConnector, with B's misses and no connector as controls."""
    from kvpool.benchmarks.serving import shared

    names = [part.strip() for part in systems.split(",") if part.strip()] or list(shared.SYSTEMS)
    try:
        result = shared.run(systems=names, rounds=rounds, prompts=prompts)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    emit(result, as_json, shared.print_table, no_fail)


@bench_app.command("all")
def bench_all(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    only: Annotated[str, typer.Option(help="benches to run, comma separated (default: all)")] = "",
    out: Annotated[
        str, typer.Option(help="folder for the results [default: benchmarks/results, with --tiny -tiny]")
    ] = "",
    report: Annotated[
        str, typer.Option(help="the report to regenerate [default: BENCHMARKS.md; none with --tiny]")
    ] = "",
    tiny: Annotated[bool, typer.Option("--tiny", help="tiny sizes: checks the suite runs, gives no figures")] = False,
    long: Annotated[
        bool, typer.Option("--long", help="10 rounds where a bench has rounds: the committed report")
    ] = False,
    quick: Annotated[
        bool, typer.Option("--quick", help="2 rounds and fewer cells: a first look in about half the time")
    ] = False,
    report_only: Annotated[
        bool,
        typer.Option("--report-only", help="run nothing: rewrite the report from the results in --out"),
    ] = False,
) -> None:
    """Every bench of the report: results, tables and plots into --out, and BENCHMARKS.md's generated parts."""
    if long and quick:
        raise typer.BadParameter("--long and --quick: pick one (10 rounds, or 2)", param_hint="--quick")
    from pathlib import Path

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvpool.benchmarks import suite

    if report_only:
        if tiny or long or quick or only:
            raise typer.BadParameter("--report-only runs nothing: no --tiny, --long, --quick or --only with it")
        suite.regenerate(Path(report or "BENCHMARKS.md"), Path(out or "benchmarks/results"))
        return

    try:
        benches = suite.select([part.strip() for part in only.split(",") if part.strip()])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--only") from exc
    with Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
        transient=as_json,
    ) as bar:  # fmt: skip
        task = bar.add_task("kvpool bench all", total=suite.units(benches, tiny, long and not tiny, quick))
        result = suite.run(
            benches,
            out_dir=Path(out or ("benchmarks/results-tiny" if tiny else "benchmarks/results")),
            report=Path(report) if report else (None if tiny else Path("BENCHMARKS.md")),
            tiny=tiny,
            long=long and not tiny,
            quick=quick and not tiny,
            progress=lambda what, done: bar.update(task, advance=done, description=what),
        )
    emit(result, as_json, lambda r: typer.echo(json.dumps(r["verdicts"], indent=2)), no_fail)


@bench_app.command("hang")
def bench_hang(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    prompts: Annotated[int, typer.Option(help="prompts per pass", min=1)] = 8,
    prompt_tokens: Annotated[int, typer.Option(help="tokens per prompt", min=64)] = 512,
    hung_passes: Annotated[int, typer.Option(help="passes while the master is stopped", min=1)] = 2,
) -> None:
    """Per-request latency while the Mooncake master is hung (SIGSTOP), next to no connector."""
    from kvpool.benchmarks.serving import hang

    result = hang.run(prompts=prompts, prompt_tokens=prompt_tokens, hung_passes=hung_passes)
    emit(result, as_json, hang.print_table, no_fail)


@bench_app.command("breakdown")
def bench_breakdown(
    as_json: AsJson = False,
    rounds: Annotated[int, typer.Option(help="rounds, systems interleaved (medians are reported)", min=1)] = 3,
    requests: Annotated[int, typer.Option(help="requests per phase and concurrency", min=1)] = 24,
    concurrencies: Annotated[str, typer.Option(help="requests added together, comma separated")] = "1,4",
    prompt_tokens: Annotated[int, typer.Option(help="tokens per prompt", min=128)] = 512,
    max_tokens: Annotated[int, typer.Option(help="tokens generated per request", min=1)] = 8,
    model: Annotated[str, typer.Option(help="tiny model kind (kvpool.testing.models)")] = "llama-demo",
    profile: Annotated[bool, typer.Option(help="also one py-spy profile per connector on the hit phase")] = True,
    gil_diagnostic: Annotated[
        bool, typer.Option("--gil-diagnostic", help="also both connectors with a 0.5 ms GIL switch interval")
    ] = False,
) -> None:
    """Where a request's time goes, in scheduler steps and ms, on a hit and a miss: kvpool on Mooncake
    (lookup_wait_ms 0 and default) next to vLLM's MooncakeStoreConnector, same master and placement."""
    from kvpool.benchmarks.serving import breakdown
    from kvpool.testing.models import MODEL_KINDS

    if model not in MODEL_KINDS:
        raise typer.BadParameter(f"{model!r}: expected one of {', '.join(MODEL_KINDS)}", param_hint="--model")
    result = breakdown.run(
        rounds=rounds,
        requests=requests,
        concurrencies=tuple(ints("--concurrencies", concurrencies)),
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        model_kind=model,
        profile=profile,
        rows=breakdown.ROWS + (breakdown.GIL_ROWS if gil_diagnostic else ()),
    )
    emit(result, as_json, breakdown.print_table)
