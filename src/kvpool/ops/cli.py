"""The `kvpool` command: demo, bench, inspect, master, segment.

Exit codes: 0 success; 1 a bench that printed FAIL (unless `--no-fail`), a demo whose outputs
differ with the pool, or an inspect whose pool or server did not answer; 2 a usage error (a bad
option value, named)."""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from typing import Annotated, Any

import typer

from kvpool import __version__

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kvpool: a KV-cache pool for LLM serving.")


class DemoBackend(str, enum.Enum):
    memory = "memory"
    mooncake = "mooncake"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvpool {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    """kvpool: a KV-cache pool for LLM serving."""


DEFAULT_CONTEXTS = "1024,4096,16384,32768,65536,131072"
bench_app = typer.Typer(no_args_is_help=True, help="Measurements, printed as a table or JSON.")
app.add_typer(bench_app, name="bench")


def _ints(option: str, text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{text!r}: expected positive integers separated by commas", param_hint=option)
    return values


AsJson = Annotated[bool, typer.Option("--json", help="print JSON instead of a table")]
NoFail = Annotated[bool, typer.Option("--no-fail", help="exit 0 even when a target is missed")]


def _emit(result: dict[str, Any], as_json: bool, table: object, no_fail: bool = False) -> None:
    """Print the result; a missed target (`pass` false) exits 1 after printing, unless `no_fail`."""
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        table_fn = table
        assert callable(table_fn)
        table_fn(result)
    if result.get("pass") is False and not no_fail:
        raise typer.Exit(1)


@app.command()
def demo(
    backend: Annotated[
        DemoBackend, typer.Option(help="memory (embedded) or mooncake (a local master it starts)")
    ] = DemoBackend.memory,
    as_json: AsJson = False,
) -> None:
    """Multi-turn chat workload through a vLLM CPU engine, without and with kvpool (exit 1: outputs differ)."""
    from kvpool.ops import demo as demo_module

    result = demo_module.run(backend=backend.value, quiet=as_json)
    _emit(result, as_json, demo_module.print_table)
    if not result["identical_outputs"]:
        raise typer.Exit(1)


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
    from kvpool.benchmarks import store_path

    chosen = {}
    for option, text, allowed in (("--modes", modes, store_path.MODES), ("--cases", cases, store_path.CASES)):
        names = [name.strip() for name in text.split(",") if name.strip()]
        if not names or set(names) - set(allowed):
            raise typer.BadParameter(f"{text!r}: expected some of {', '.join(allowed)}", param_hint=option)
        chosen[option] = names
    result = store_path.run(
        contexts=_ints("--contexts", contexts),
        block_sizes=_ints("--block-sizes", block_sizes),
        requests=requests,
        steps=steps,
        modes=chosen["--modes"],
        cases=chosen["--cases"],
    )
    _emit(result, as_json, store_path.print_table, no_fail)


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
    from kvpool.benchmarks import connector_step

    try:
        result = connector_step.run(
            requests=_ints("--requests", requests),
            contexts=_ints("--contexts", contexts),
            block_sizes=_ints("--block-sizes", block_sizes),
            steps=steps,
            backends=[part.strip() for part in backends.split(",") if part.strip()],
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    _emit(result, as_json, connector_step.print_table, no_fail)


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
    from kvpool.benchmarks import transfer

    if backend == "disk":
        from kvpool.benchmarks import disk_transfer

        if reps < 2:
            raise typer.BadParameter(f"--reps {reps}: the disk bench needs at least 2 rounds for an interval")
        _emit(
            disk_transfer.run(keys=keys, rounds=reps, directory=directory), as_json, disk_transfer.print_table, no_fail
        )
        return

    counts = _ints("--pieces", pieces)
    try:
        transfer.check_arguments(backend, transfer.CHUNK_SIZES, counts, keys, reps)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    result = transfer.run(backend=backend, pieces=counts, keys_per_batch=keys, reps=reps)
    _emit(result, as_json, transfer.print_table, no_fail)


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
    from kvpool.benchmarks import lookup

    result = lookup.run(
        contexts=_ints("--contexts", contexts),
        block_sizes=_ints("--block-sizes", block_sizes),
        reps=reps,
        mooncake=mooncake,
    )
    _emit(result, as_json, lookup.print_table, no_fail)


@bench_app.command("scale")
def bench_scale(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    concurrency: Annotated[str, typer.Option(help="concurrent requests per step, comma separated")] = "1,4,16,64,256",
    pool_requests: Annotated[int, typer.Option(help="requests of the pool-at-capacity workload", min=1)] = 20_000,
) -> None:
    """Store-path and lookup cost per request vs concurrency; the embedded pool at capacity, before and after
    chain-aware eviction."""
    from kvpool.benchmarks import scale

    args = {**scale.ALL_ARGS, "concurrency": _ints("--concurrency", concurrency), "pool_requests": pool_requests}
    _emit(scale.run(**args), as_json, scale.print_table, no_fail)


@bench_app.command("serve-overhead")
def bench_serve_overhead(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    prompts: Annotated[int, typer.Option(help="prompts per round", min=1)] = 12,
    rounds: Annotated[int, typer.Option(help="rounds", min=1)] = 2,
) -> None:
    """Per-request latency behind vLLM's OpenAI server, with and without kvpool (misses, hits)."""
    from kvpool.benchmarks import serve_overhead

    result = serve_overhead.run(prompts=prompts, rounds=rounds)
    _emit(result, as_json, serve_overhead.print_table, no_fail)


@bench_app.command("serve")
def bench_serve(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    systems: Annotated[str, typer.Option(help="systems, comma separated (default: all)")] = "",
    concurrencies: Annotated[str, typer.Option(help="client concurrencies, comma separated")] = "1,4,16",
    rounds: Annotated[int, typer.Option(help="interleaved rounds (intervals need >= 2; 95% ones >= 6)", min=1)] = 3,
) -> None:
    """End to end behind vLLM's OpenAI server with vLLM's serving benchmark client: kvpool next to the peers."""
    from kvpool.benchmarks import serve, serve_systems

    names = [part.strip() for part in systems.split(",") if part.strip()] or list(serve_systems.SYSTEMS)
    try:
        wanted = tuple(_ints("--concurrencies", concurrencies))
        result = serve.run(systems=names, concurrencies=wanted, rounds=rounds)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--systems") from exc
    _emit(result, as_json, serve.print_table, no_fail)


@bench_app.command("trace-hits")
def bench_trace_hits(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    capacities: Annotated[
        str, typer.Option(help="pool capacities as shares of the trace's distinct blocks, comma separated")
    ] = "0.01,0.05,0.1,0.25",
    limit: Annotated[int, typer.Option(help="the trace's first requests only (0: all 12,031)", min=0)] = 0,
) -> None:
    """Hit rates over the whole Mooncake conversation trace: the embedded pool's eviction, plain LRU, Belady's MIN."""
    from kvpool.benchmarks import trace_hits

    try:
        shares = [float(part) for part in capacities.split(",") if part.strip()]
        result = trace_hits.run(capacities=shares, limit=limit or None)
    except ValueError as exc:
        raise typer.BadParameter(f"--capacities {capacities!r}: {exc}") from exc
    _emit(result, as_json, trace_hits.print_table, no_fail)


@bench_app.command("trace")
def bench_trace(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    systems: Annotated[str, typer.Option(help="systems, comma separated (default: local and the pools)")] = "",
    concurrencies: Annotated[str, typer.Option(help="client concurrencies, comma separated")] = "4",
    rounds: Annotated[int, typer.Option(help="interleaved rounds (intervals need >= 2; 95% ones >= 6)", min=1)] = 3,
    requests: Annotated[int, typer.Option(help="requests of the trace per round", min=1)] = 60,
    speedup: Annotated[
        float, typer.Option(help="replay the trace's arrival times this many times faster (0: closed loop)", min=0)
    ] = 0.0,
) -> None:
    """The Mooncake conversation trace replayed behind vLLM's OpenAI server: kvpool next to the peers."""
    from kvpool.benchmarks import trace

    names = [part.strip() for part in systems.split(",") if part.strip()] or list(trace.SYSTEMS)
    try:
        wanted = tuple(_ints("--concurrencies", concurrencies))
        default = trace.Workload()  # the engine's cache holds the most requests at once, and 8 blocks more
        cache = max(default.engine_cache_tokens, max(wanted) * default.max_model_len + 8 * default.block_size)
        result = trace.run(
            systems=names,
            concurrencies=wanted,
            rounds=rounds,
            requests=requests,
            speedup=speedup or None,
            engine_cache_tokens=cache,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    _emit(result, as_json, trace.print_table, no_fail)


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
    from kvpool.benchmarks import shared

    names = [part.strip() for part in systems.split(",") if part.strip()] or list(shared.SYSTEMS)
    try:
        result = shared.run(systems=names, rounds=rounds, prompts=prompts)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    _emit(result, as_json, shared.print_table, no_fail)


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
) -> None:
    """Every bench of the report: results, tables and plots into --out, and BENCHMARKS.md's generated parts."""
    if long and quick:
        raise typer.BadParameter("--long and --quick: pick one (10 rounds, or 2)", param_hint="--quick")
    from pathlib import Path

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvpool.benchmarks import suite

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
    _emit(result, as_json, lambda r: typer.echo(json.dumps(r["verdicts"], indent=2)), no_fail)


@bench_app.command("hang")
def bench_hang(
    as_json: AsJson = False,
    no_fail: NoFail = False,
    prompts: Annotated[int, typer.Option(help="prompts per pass", min=1)] = 8,
    prompt_tokens: Annotated[int, typer.Option(help="tokens per prompt", min=64)] = 512,
    hung_passes: Annotated[int, typer.Option(help="passes while the master is stopped", min=1)] = 2,
) -> None:
    """Per-request latency while the Mooncake master is hung (SIGSTOP), next to no connector."""
    from kvpool.benchmarks import hang

    result = hang.run(prompts=prompts, prompt_tokens=prompt_tokens, hung_passes=hung_passes)
    _emit(result, as_json, hang.print_table, no_fail)


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
    from kvpool.benchmarks import breakdown
    from kvpool.testing.models import MODEL_KINDS

    if model not in MODEL_KINDS:
        raise typer.BadParameter(f"{model!r}: expected one of {', '.join(MODEL_KINDS)}", param_hint="--model")
    result = breakdown.run(
        rounds=rounds,
        requests=requests,
        concurrencies=tuple(_ints("--concurrencies", concurrencies)),
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        model_kind=model,
        profile=profile,
        rows=breakdown.ROWS + (breakdown.GIL_ROWS if gil_diagnostic else ()),
    )
    _emit(result, as_json, breakdown.print_table)


@app.command()
def master(
    host: Annotated[str, typer.Option(help="address the master serves on (clients must reach it)")] = "127.0.0.1",
    rpc_port: Annotated[int, typer.Option(help="RPC port", min=1, max=65535)] = 50051,
    metrics_port: Annotated[int, typer.Option(help="admin/metrics HTTP port (0: a free one)", min=0, max=65535)] = 0,
    eviction_high_watermark: Annotated[
        float, typer.Option(help="pool usage that starts eviction, a fraction", min=0.05, max=1.0)
    ] = 0.9,
    eviction_ratio: Annotated[
        float, typer.Option(help="extra fraction of the pool freed by each eviction", min=0.0, max=0.5)
    ] = 0.05,
    lease_ttl_ms: Annotated[
        int, typer.Option(help="how long a read or existence check pins an object, in ms", min=1)
    ] = 10_000,
    client_ttl_s: Annotated[
        int, typer.Option(help="how long a silent client's segment is kept, in seconds", min=1)
    ] = 10,
) -> None:
    """Start a mooncake_master, print the kvpool config to paste, serve until Ctrl-C or SIGTERM."""
    from kvpool.backends.mooncake.master import run_master_forever

    raise typer.Exit(
        run_master_forever(
            rpc_port=rpc_port,
            metrics_port=metrics_port,
            host=host,
            extra_args=master_flags(eviction_high_watermark, eviction_ratio, lease_ttl_ms, client_ttl_s),
        )
    )


@app.command()
def segment(
    master: Annotated[str, typer.Argument(help="the master's HOST:PORT (as `kvpool master` prints it)")],
    size: Annotated[str, typer.Option(help="memory this host gives the pool: bytes, or '4GiB', '512MB'")] = "4GiB",
    local_hostname: Annotated[str, typer.Option(help="this host's address, as the other clients reach it")] = (
        "127.0.0.1"
    ),
    protocol: Annotated[str, typer.Option(help="Mooncake transfer protocol: tcp or rdma")] = "tcp",
    until_stdin_closes: Annotated[
        bool, typer.Option("--until-stdin-closes", help="also stop when standard input ends (for a parent process)")
    ] = False,
) -> None:
    """Hold a Mooncake segment: give the pool memory on this host until Ctrl-C or SIGTERM (a clean close
    takes the segment and its objects out of the pool)."""
    from kvpool.backends.mooncake.segment_holder import serve_segment
    from kvpool.core.errors import ConfigError

    try:
        code = serve_segment(
            master, size, local_hostname=local_hostname, protocol=protocol, until_stdin_closes=until_stdin_closes
        )
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from exc
    raise typer.Exit(code)


inspect_app = typer.Typer(no_args_is_help=True, help="What a running pool holds, and why a prompt hits where it does.")
app.add_typer(inspect_app, name="inspect")


def _inspect(
    read: Callable[[], Any], as_json: bool, to_json: Callable[[Any], Any], show: Callable[[Any], None]
) -> None:
    """Print what `read()` answers, as JSON or a table; exit 1 when the address did not answer."""
    from kvpool.ops.inspection import Unreachable

    try:
        answer = read()
    except Unreachable as exc:
        typer.echo(f"kvpool inspect: {exc}", err=True)
        raise typer.Exit(1) from exc
    if as_json:
        typer.echo(json.dumps(to_json(answer), indent=2))
    else:
        show(answer)


@inspect_app.command("master")
def inspect_master(
    url: Annotated[str, typer.Argument(help="the master's admin HTTP address, e.g. http://127.0.0.1:9003")],
    as_json: AsJson = False,
) -> None:
    """Keys and bytes per kvpool namespace, memory and evictions of a Mooncake master (exit 1: no answer)."""
    from kvpool.ops import inspection

    _inspect(lambda: inspection.inspect_master(url), as_json, lambda report: report.to_dict(), inspection.print_master)


@inspect_app.command("engine")
def inspect_engine(
    url: Annotated[str, typer.Argument(help="a vLLM server running kvpool, e.g. http://127.0.0.1:8000")],
    as_json: AsJson = False,
) -> None:
    """kvpool's counters and each engine's embedded pool, from the server's /metrics (exit 1: no answer)."""
    from kvpool.ops import inspection

    _inspect(
        lambda: inspection.inspect_engine(url),
        as_json,
        lambda engines: engines,
        lambda e: inspection.print_engines(url, e),
    )


@inspect_app.command("explain")
def inspect_explain(
    model: Annotated[str, typer.Argument(help="the model directory (or name) the engine serves")],
    prompt: Annotated[
        typer.FileText, typer.Option(help="token ids, as a JSON list or separated by spaces; '-' reads stdin")
    ],
    config: Annotated[str, typer.Option(help="kvpool's kv_connector_extra_config, as JSON")] = "{}",
    block_size: Annotated[int, typer.Option(help="the engine's block size", min=1)] = 64,
    max_model_len: Annotated[int, typer.Option(help="the engine's max model length", min=1)] = 2048,
    as_json: AsJson = False,
) -> None:
    """Which chunks of which group a prompt finds in the pool, where the hit stops and why. Builds the
    engine in this process (CPU): it reads pools this process reaches, so a Mooncake pool, or an
    embedded one only in-process (then call kvpool.integrations.vllm.explain.explain_prompt)."""
    from kvpool.core.errors import ConfigError
    from kvpool.scheduler.explain import print_explanation

    try:
        extra = json.loads(config)
        if not isinstance(extra, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        raise typer.BadParameter(f"{config!r}: expected a JSON object ({exc})", param_hint="--config") from exc
    from kvpool.core.config import KVPoolConfig

    try:
        KVPoolConfig.from_dict(extra)  # a bad key or value is named before an engine is built
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--config") from exc
    text = prompt.read().strip()
    try:
        tokens = [int(token) for token in (json.loads(text) if text.startswith("[") else text.split())]
    except (ValueError, TypeError) as exc:
        raise typer.BadParameter(
            "expected token ids: a JSON list or integers separated by spaces", param_hint="--prompt"
        ) from exc
    if not tokens:
        raise typer.BadParameter("the prompt has no tokens", param_hint="--prompt")
    from kvpool.ops.explain import explain_with_engine

    explanation = explain_with_engine(model, tokens, extra, block_size=block_size, max_model_len=max_model_len)
    if as_json:
        typer.echo(json.dumps(explanation.to_dict(), indent=2))
    else:
        print_explanation(explanation)


def master_flags(high_watermark: float, eviction_ratio: float, lease_ttl_ms: int, client_ttl_s: int) -> list[str]:
    """`kvpool master`'s pool settings as `mooncake_master` flags."""
    return [
        f"--eviction_high_watermark_ratio={high_watermark}",
        f"--eviction_ratio={eviction_ratio}",
        f"--default_kv_lease_ttl={lease_ttl_ms}",
        f"--client_ttl={client_ttl_s}",
    ]


def main() -> None:
    app()
