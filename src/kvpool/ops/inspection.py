"""`kvpool inspect`: what a running pool holds, read through the channels it already exposes.

- A Mooncake master: its admin HTTP port (`--metrics_port`, 9003 by default) lists every key
  (`/get_all_keys`, which leases nothing) and serves its counters (`/metrics`). Keys are grouped by
  kvpool namespace: `kvp1/<model>/<layout digest>/s<shard>/p<pp rank>/g<group>/<chunk hash>`.
- A vLLM server running kvpool: its `/metrics` carries kvpool's counters and each engine's embedded
  pool gauges (an embedded pool lives inside its engine's worker process; nothing else can read it).

Only loopback or operator-given addresses are contacted, with a timeout on every request.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvpool.core.keys import KEY_SCHEMA

HTTP_TIMEOUT_S = 5.0
MASTER_METRICS = (
    "master_key_count",
    "master_allocated_bytes",
    "master_total_capacity_bytes",
    "master_active_clients",
    "master_evicted_key_count",
    "master_attempted_evictions_total",
)


class Unreachable(Exception):
    """The address did not answer like the service it should be; the message says what was tried."""


@dataclass(frozen=True)
class Namespace:
    """One kvpool key namespace: the chunks of one model layout, TP shard, PP rank and group."""

    prefix: str
    model: str
    layout: str  # the fingerprint digest: dtype, block size, layout, attention, hash seed, weights, tenant
    shard: str
    pp_rank: str
    group: str
    keys: int
    chunk_bytes: int = 0  # what one stored chunk takes (its bytes and seal); 0: not known
    sample: str = ""  # one key of the namespace

    @property
    def nbytes(self) -> int:
        return self.keys * self.chunk_bytes


@dataclass
class MasterReport:
    url: str
    namespaces: list[Namespace]
    other_keys: int  # keys not written by kvpool
    metrics: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for space, entry in zip(self.namespaces, data["namespaces"]):
            entry["bytes"] = space.nbytes
        return data


def fetch(url: str, timeout_s: float = HTTP_TIMEOUT_S) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body: bytes = response.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise Unreachable(f"{url}: {getattr(exc, 'reason', exc)}") from exc
    return body.decode("utf-8", "replace")


def namespaces_of(keys: list[str]) -> tuple[list[Namespace], int]:
    """kvpool namespaces with their key counts (most keys first), and how many keys are not kvpool's."""
    counts: Counter[str] = Counter()
    samples: dict[str, str] = {}
    other = 0
    for key in keys:
        prefix, _, chunk = key.rpartition("/")
        parts = prefix.split("/")
        if len(parts) == 6 and parts[0] == KEY_SCHEMA and chunk:
            counts[prefix] += 1
            samples.setdefault(prefix, key)
        else:
            other += 1
    spaces = []
    for prefix, count in counts.most_common():
        _, model, layout, shard, pp_rank, group = prefix.split("/")
        spaces.append(
            Namespace(prefix + "/", model, layout, shard[1:], pp_rank[1:], group[1:], count, sample=samples[prefix])
        )
    return spaces, other


def chunk_sizes(base: str, keys: list[str], timeout_s: float = HTTP_TIMEOUT_S) -> dict[str, int]:
    """The stored size of each key, from the master's replica list (one call; it may lease these keys,
    so callers ask for one key per namespace: every chunk of a namespace has the same size)."""
    if not keys:
        return {}
    query = urllib.parse.urlencode({"keys": ",".join(keys)}, safe="/")
    try:
        answer = json.loads(fetch(f"{base}/batch_query_keys?{query}", timeout_s))
    except ValueError:
        return {}
    sizes: dict[str, int] = {}
    for key, entry in (answer.get("data") or {}).items():
        values = (entry or {}).get("values") or []
        if entry.get("ok") and values:
            sizes[key] = int(values[0].get("size_", 0))
    return sizes


def inspect_master(url: str, timeout_s: float = HTTP_TIMEOUT_S) -> MasterReport:
    """What a Mooncake master holds, from its admin HTTP endpoint (e.g. http://127.0.0.1:9003)."""
    base = url.rstrip("/")
    metrics = _samples(fetch(f"{base}/metrics", timeout_s), MASTER_METRICS)
    if not metrics:
        raise Unreachable(f"{base}/metrics answered without master_* metrics: is this a Mooncake master's admin port?")
    keys = [line.strip() for line in fetch(f"{base}/get_all_keys", timeout_s).splitlines() if line.strip()]
    spaces, other = namespaces_of(keys)
    sizes = chunk_sizes(base, [space.sample for space in spaces], timeout_s)
    spaces = [replace(space, chunk_bytes=sizes.get(space.sample, 0)) for space in spaces]
    return MasterReport(base, spaces, other, metrics)


def inspect_engine(url: str, timeout_s: float = HTTP_TIMEOUT_S) -> dict[str, dict[str, float]]:
    """kvpool's metrics on a vLLM server (e.g. http://127.0.0.1:8000), per engine: name -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = fetch(f"{url.rstrip('/')}/metrics", timeout_s)
    engines: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:kvpool_") and not sample.name.endswith("_created"):
                engine = engines.setdefault(sample.labels.get("engine", "0"), {})
                name = sample.name.removeprefix("vllm:kvpool_")
                engine[name] = engine.get(name, 0.0) + sample.value
    if not engines:
        raise Unreachable(f"{url.rstrip('/')}/metrics has no vllm:kvpool_ metrics: is kvpool this server's connector?")
    return engines


def _samples(text: str, names: tuple[str, ...]) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return found
    for family in families:
        for sample in family.samples:
            if sample.name in names:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


def print_master(report: MasterReport) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    metrics = report.metrics
    used, capacity = metrics.get("master_allocated_bytes", 0.0), metrics.get("master_total_capacity_bytes", 0.0)
    table = Table(title=f"Mooncake master {report.url}: {int(metrics.get('master_key_count', 0))} keys")
    for column in ("model", "layout", "shard", "pp", "group", "keys", "MiB"):
        table.add_column(column, justify="left" if column in ("model", "layout") else "right")
    for space in report.namespaces:
        size = f"{space.nbytes / 2**20:.1f}" if space.chunk_bytes else "?"
        table.add_row(space.model, space.layout, space.shard, space.pp_rank, space.group, str(space.keys), size)
    if report.other_keys:
        table.add_row("(not kvpool)", "", "", "", "", str(report.other_keys), "")
    console.print(table)
    share = f" ({used / capacity:.0%})" if capacity else ""
    console.print(
        f"memory {used / 2**20:.1f} / {capacity / 2**20:.1f} MiB{share}; "
        f"{int(metrics.get('master_active_clients', 0))} clients; "
        f"evicted keys {int(metrics.get('master_evicted_key_count', 0))}"
    )


def print_engines(url: str, engines: dict[str, dict[str, float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    names = sorted({name for values in engines.values() for name in values})
    table = Table(title=f"kvpool on {url}")
    table.add_column("metric")
    for engine in engines:
        table.add_column(f"engine {engine}", justify="right")
    for name in names:
        table.add_row(name, *(_number(values.get(name)) for values in engines.values()))
    Console().print(table)


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{int(value):,}" if value == int(value) else f"{value:.3g}"
