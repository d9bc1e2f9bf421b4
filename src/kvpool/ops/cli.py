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
from kvpool.ops.bench_cli import bench_app
from kvpool.ops.cli_common import AsJson, emit

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


app.add_typer(bench_app, name="bench")


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
    emit(result, as_json, demo_module.print_table)
    if not result["identical_outputs"]:
        raise typer.Exit(1)


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
