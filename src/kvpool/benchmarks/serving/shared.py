"""Two vLLM servers sharing one pool: what B gets from what A stored (`kvpool bench shared`).

The experiment. Per system, two engines, A and B (each vLLM's OpenAI server), are clients of one pool:
one `mooncake_master` on 127.0.0.1 and one standalone segment holder, the `standalone-store` placement
of `serve_systems` (`start_shared`). Each round, A serves `prompts` fresh prompts, so it stores their KV
in the pool; once the master's key count has held still for `settle_s` (A's stores have landed), B
serves each of them again with a unique tail of `suffix_len` tokens (a hit: B's own prefix cache never
saw these tokens, so whatever B does not compute came through the pool), alternating with a prompt of
the same length that A never sent (a miss: the control, so a reader sees the hit's gain). Measured on
B, one request at a time: the time to the first token (one output token), and the prompt tokens the
connector supplied (the server's `vllm:external_prefix_cache_hits_total`, read before and after each
request) over the prompt tokens: B's pool hit rate.

Systems: `kvpool-mooncake` (kvpool) and `vllm-mooncake` (vLLM's `MooncakeStoreConnector`), each with its
own fresh master and holder; `lmcache` (vLLM's `LMCacheMPConnector`, both servers clients of one LMCache
MP server, which shows no key count: A's stores get `unwatched_settle_s` to land); and `local`: B alone,
with no connector (vLLM's prefix cache on, cold for these prompts), which computes everything: the
baseline.

Why it is fair. Every server runs the same model, weights, engine settings and cores
(`SAME_CORES_ENV`); both connectors get the same placement and capacity, which holds every round (no
eviction: this measures sharing, not a pool under pressure; `evicted` says so); every system serves
the same prompts in a round, fresh ones each round; the systems run interleaved, their order rotated
round by round (`stats.rotation`), so the machine's drift lands on all alike, and hits and misses
alternate on B for the same reason; A's stores get the same barrier for both connectors.

Keys across engines. Both connectors name a chunk by vLLM's block hashes and the model: vLLM's connector
by the model directory's name, the ranks and the block hash; kvpool by the model, its layout
fingerprint, a digest of the weights' config and the hash algorithm with its seed. vLLM chains its
block hashes from a seed (`init_none_hash` in `vllm/v1/core/kv_cache_utils.py`): fixed for the default
sha256 (`--prefix-caching-hash-algo`), random per process for xxhash, and `PYTHONHASHSEED` overrides it
for every algorithm. So every server here gets the same `PYTHONHASHSEED` (`HASH_SEED`) and vLLM's
default sha256: A's keys are B's for both connectors.

Figures: per round, medians over B's requests; across rounds, medians with 95% intervals
(`stats.spread`) and ratios paired round by round with verdicts (`stats.ratio`, `stats.verdict`):
kvpool ÷ vLLM's connector on B's hit TTFT (target <= 1.0) and pool hit rate (>= 1.0), kvpool's hit
TTFT ÷ `local` (< 1.0: the shared pool pays); references: the misses ÷ vLLM's connector, vLLM's hit ÷
`local`, and each system's hit ÷ miss. A system whose B never hit through the pool is reported with the
reason, never with a figure.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvpool.benchmarks.measure.report import figure, markdown_table
from kvpool.benchmarks.measure.stats import Interval, Verdict, median_ms, ratio, rotation, spread, verdict
from kvpool.benchmarks.serving import serve_client, serve_systems, serve_workload, servers
from kvpool.benchmarks.serving.serve_report import _error_bars, _shown
from kvpool.testing.models import default_model_dir, make_tiny_model
from kvpool.testing.server import SAME_CORES_ENV, OpenAIServer, openai_server

__all__ = ["ALL_ARGS", "LONG_ARGS", "TINY_ARGS", "Workload", "plot", "print_table", "run", "summarize", "to_markdown"]

SYSTEMS = ("kvpool-mooncake", "vllm-mooncake", "lmcache", "local")
HASH_SEED = "0"  # every server's PYTHONHASHSEED: vLLM's block hashes, and so both connectors' keys, agree
# (system, against, figure, limit or None for a reference, the target is "at most")
TARGETS: tuple[tuple[str, str, str, float | None, bool], ...] = (
    ("kvpool-mooncake", "vllm-mooncake", "hit_ms", 1.0, True),
    ("kvpool-mooncake", "vllm-mooncake", "pool_hit_rate", 1.0, False),
    ("kvpool-mooncake", "vllm-mooncake", "miss_ms", None, True),
    ("kvpool-mooncake", "local", "hit_ms", 1.0, True),
    ("vllm-mooncake", "local", "hit_ms", None, True),
    ("kvpool-mooncake", "lmcache", "hit_ms", None, True),
    ("lmcache", "local", "hit_ms", None, True),
)
LABELS = {"hit_ms": "B's hit TTFT", "miss_ms": "B's miss TTFT", "pool_hit_rate": "B's pool hit rate"}


@dataclass(frozen=True)
class Workload:
    model_kind: str = "llama-bench"
    prompt_len: int = 512  # A's prompts, whole blocks: B's hit can cover all of them
    suffix_len: int = 64  # B's unique tail on each of A's prompts
    prompts: int = 8  # per round: A's prompts, and as many misses on B
    rounds: int = 6
    block_size: int = 64
    max_model_len: int = 1024
    engine_cache_tokens: int = 4096
    dtype: str = "bfloat16"
    settle_s: float = 0.5  # A's stores have landed once the master's key count holds still this long
    settle_timeout_s: float = 30.0
    unwatched_settle_s: float = 2.0  # a pool with no key count to watch (LMCache's MP server): a fixed wait

    @property
    def request_len(self) -> int:
        return self.prompt_len + self.suffix_len

    @property
    def pool_tokens(self) -> int:
        """Twice what a pool receives in the whole run (A's prompts, B's tails and misses, per round and
        the warm-up): Mooncake evicts once 95% full, and nothing here may be evicted."""
        return 2 * (self.rounds + 1) * self.prompts * (self.prompt_len + self.suffix_len + self.request_len)

    def check(self) -> None:
        if self.rounds < 1 or self.prompts < 1 or self.suffix_len < 1:
            raise ValueError(f"rounds {self.rounds}, prompts {self.prompts}, suffix_len {self.suffix_len}: each >= 1")
        if self.prompt_len % self.block_size or self.request_len > self.max_model_len:
            raise ValueError(
                f"prompt_len {self.prompt_len}: whole blocks of {self.block_size}, and with suffix_len "
                f"{self.suffix_len} within max_model_len {self.max_model_len}"
            )


# on 2 cores: five servers start in ~3-4 min, a round takes ~15 s (ALL ~5-6 min, LONG ~7 min)
ALL_ARGS: dict[str, Any] = {"workload": Workload(rounds=3), "systems": SYSTEMS}  # `kvpool bench all`: ~6.5 min
LONG_ARGS: dict[str, Any] = {**ALL_ARGS, "workload": Workload(rounds=10)}
QUICK_ARGS: dict[str, Any] = {**ALL_ARGS, "workload": Workload(rounds=2, prompts=4)}
# checks the bench, not the figures: the two Mooncake connectors, each with its pair of servers on one master
# (LMCache's MP server serving a second server is `test_lmcache_peer`'s; `local` is one server, no pool)
TINY_ARGS: dict[str, Any] = {
    "workload": Workload(
        model_kind="llama-bench-tiny", prompt_len=256, prompts=2, rounds=2, engine_cache_tokens=1024,
        max_model_len=512, dtype="float32",
    ),
    "systems": ("kvpool-mooncake", "vllm-mooncake"),
}  # fmt: skip


@dataclass(frozen=True)
class RoundPrompts:
    sources: list[list[int]]  # A's
    hits: list[list[int]]  # B's: each of A's, then a unique tail
    misses: list[list[int]]  # B's: A never sent them


def round_prompts(workload: Workload, round_index: int) -> RoundPrompts:
    """A round's prompts, the same for every system (round -1: the warm-up's)."""
    rng = random.Random(5000 + round_index)
    sources = [servers._prompt(rng, workload.prompt_len) for _ in range(workload.prompts)]
    hits = [source + servers._prompt(rng, workload.suffix_len) for source in sources]
    misses = [servers._prompt(rng, workload.request_len) for _ in range(workload.prompts)]
    return RoundPrompts(sources, hits, misses)


def settle(
    count: Callable[[], int],
    steady_s: float,
    timeout_s: float,
    poll_s: float = 0.05,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[int, float]:
    """Wait until `count()` has held still for `steady_s` (at most `timeout_s`): the count, seconds waited."""
    began = clock()
    last, since = count(), began
    while clock() - since < steady_s and clock() - began < timeout_s:
        sleep(poll_s)
        now = count()
        if now != last:
            last, since = now, clock()
    return last, round(clock() - began, 3)


@dataclass
class _Pair:
    a: OpenAIServer | None  # None for `local`: B alone
    b: OpenAIServer
    master_admin: str


def _master_counts(admin: str) -> tuple[int, int]:
    """The master's keys now, and the keys it has evicted."""
    from kvpool.testing.server import scrape

    samples = scrape(f"{admin}/metrics")
    return int(samples.get("master_key_count", 0)), int(samples.get("master_evicted_key_count", 0))


@contextlib.contextmanager
def _pair(name: str, model: Path, workload: Workload, token_bytes: int) -> Iterator[_Pair]:
    capacity = max(workload.pool_tokens * token_bytes, serve_workload.MIN_POOL_BYTES)
    with contextlib.ExitStack() as stack:
        if name == "local":
            setups = [stack.enter_context(serve_systems.start(name, capacity))]
        else:
            setups = stack.enter_context(serve_systems.start_shared(name, capacity, servers=2))
        managers = [
            openai_server(
                model, kv_transfer_config=setup.kv_transfer_config, extra_args=setup.extra_args,
                env={**setup.env, **SAME_CORES_ENV, "PYTHONHASHSEED": HASH_SEED}, dtype=workload.dtype,
                block_size=workload.block_size, max_model_len=workload.max_model_len,
                kv_cache_memory_bytes=workload.engine_cache_tokens * token_bytes,
                ready_timeout_s=servers.START_TIMEOUT_S,
            )
            for setup in setups
        ]  # fmt: skip
        with ThreadPoolExecutor(len(managers)) as threads:  # A and B start at once: a start mostly waits
            entered = [threads.submit(manager.__enter__) for manager in managers]
        for manager, future in zip(managers, entered):
            if future.exception() is None:
                stack.push(manager)  # stopped with the pool
        started = [future.result() for future in entered]  # the first failure, once every started one is held
        yield _Pair(started[0] if len(started) == 2 else None, started[-1], setups[0].master_admin)


def _request(server: OpenAIServer, prompt: list[int]) -> tuple[float, int, int]:
    """One request of one output token: seconds, cached prompt tokens, of which a connector supplied."""
    before = server.metrics().get(serve_client.POOL_HITS, 0.0)
    seconds, cached = serve_client._ttft(server, prompt)
    return seconds, cached, int(server.metrics().get(serve_client.POOL_HITS, 0.0) - before)


def _round(pair: _Pair, workload: Workload, prompts: RoundPrompts) -> dict[str, Any]:
    """A serves the sources (when there is an A), then B the hits and the misses, alternating."""
    row: dict[str, Any] = {"a_ttft_ms": None, "a_keys": None, "settle_s": None, "evicted": None}
    if pair.a is not None and not pair.master_admin:
        # LMCache's MP server: no key count to watch, so A's stores get a fixed time to land
        row["a_ttft_ms"] = median_ms([serve_client._ttft(pair.a, p)[0] for p in prompts.sources])
        time.sleep(workload.unwatched_settle_s)
        row["settle_s"] = workload.unwatched_settle_s
    elif pair.a is not None:
        keys, evicted = _master_counts(pair.master_admin)
        row["a_ttft_ms"] = median_ms([serve_client._ttft(pair.a, p)[0] for p in prompts.sources])
        settled, row["settle_s"] = settle(
            lambda: _master_counts(pair.master_admin)[0], workload.settle_s, workload.settle_timeout_s
        )
        row["a_keys"] = settled - keys
    measured: dict[str, list[tuple[float, int, int]]] = {"hit": [], "miss": []}
    for i, (hit, miss) in enumerate(zip(prompts.hits, prompts.misses)):
        order = [("hit", hit), ("miss", miss)] if i % 2 == 0 else [("miss", miss), ("hit", hit)]
        for kind, prompt in order:
            measured[kind].append(_request(pair.b, prompt))
    if pair.a is not None and pair.master_admin:
        row["evicted"] = _master_counts(pair.master_admin)[1] - evicted
    hits, misses = measured["hit"], measured["miss"]
    hit_tokens = sum(pool for _, _, pool in hits)
    return {
        **row,
        "hit_ms": median_ms([s for s, _, _ in hits]),
        "miss_ms": median_ms([s for s, _, _ in misses]),
        "hit_ms_each": [round(s * 1000, 2) for s, _, _ in hits],
        "miss_ms_each": [round(s * 1000, 2) for s, _, _ in misses],
        "hit_pool_tokens": hit_tokens,
        "hit_local_tokens": sum(cached - pool for _, cached, pool in hits),  # B's own cache: 0 expected
        "hit_prompt_tokens": len(hits) * workload.request_len,
        "pool_hit_rate": round(hit_tokens / (len(hits) * workload.request_len), 4),
        "miss_cached_tokens": sum(cached for _, cached, _ in misses),  # 0 expected
    }


def run(
    *,
    workload: Workload | None = None,
    systems: Sequence[str] = SYSTEMS,
    progress: Callable[[str], None] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    workload = replace(workload or Workload(), **overrides)
    workload.check()
    unknown = [name for name in systems if name not in SYSTEMS]
    if unknown:
        raise ValueError(f"system {unknown[0]!r}: expected some of {', '.join(SYSTEMS)}")
    tick = progress or (lambda _: None)
    model = make_tiny_model(workload.model_kind, default_model_dir() / workload.model_kind)
    token_bytes = servers._token_bytes(model, workload.dtype)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        running: dict[str, _Pair] = {}
        for name in systems:
            try:
                with contextlib.ExitStack() as own:  # a system that fails its warm-up stops at once
                    pair = own.enter_context(_pair(name, model, workload, token_bytes))
                    _round(pair, workload, round_prompts(workload, -1))  # every path has run once
                    stack.push(own.pop_all())
                running[name] = pair
            except Exception as exc:  # a system that cannot run is reported, the others still are
                failed[name] = f"{type(exc).__name__}: {servers._last_error_line(str(exc))}"
            tick(f"{name}: started")
        for round_index in range(workload.rounds):
            prompts = round_prompts(workload, round_index)
            for name in rotation(list(running), round_index):
                try:
                    rows.append({"system": name, "round": round_index, **_round(running[name], workload, prompts)})
                except Exception as exc:
                    failed[name] = f"round {round_index + 1}: {type(exc).__name__}: {exc}"[:300]
            for name in [name for name in running if name in failed]:
                del running[name]
            tick(f"round {round_index + 1} of {workload.rounds}")
    result: dict[str, Any] = {
        "bench": "shared",
        "workload": {
            **asdict(workload),
            "pool_bytes": max(workload.pool_tokens * token_bytes, serve_workload.MIN_POOL_BYTES),
        },
        "model": str(model),
        "hash_seed": HASH_SEED,
        "systems": list(systems),
        "results": rows,
        "failed": failed,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    result["summary"] = summarize(result)
    result["pass"] = result["summary"]["pass"]
    return result


def steps(systems: Sequence[str], workload: Workload) -> int:
    """How many times `run` calls `progress`."""
    return len(systems) + workload.rounds


def _series(result: dict[str, Any], system: str, key: str) -> dict[int, float]:
    return {r["round"]: r[key] for r in result["results"] if r["system"] == system and r.get(key) is not None}


def no_hit(result: dict[str, Any]) -> dict[str, str]:
    """Each pooled system whose B never got a token through the pool, with the likely reason."""
    out: dict[str, str] = {}
    for system in serve_systems.POOL_SHARING:
        rows = [r for r in result["results"] if r["system"] == system]
        if not rows or any(r["hit_pool_tokens"] > 0 for r in rows):
            continue
        stored = sum(r["a_keys"] or 0 for r in rows)
        out[system] = (
            "B's lookups found nothing A stored in the LMCache server"
            if system == "lmcache"
            else "A stored nothing in the pool (no key reached the master)"
            if stored == 0
            else f"A stored {stored} keys, and B's lookups found none of them: B keys the same prompts otherwise "
            "(its model name, layout or block-hash seed differs from A's)"
        )
    return out


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    systems = [s for s in result["systems"] if _series(result, s, "hit_ms")]
    missing = no_hit(result)
    cells: dict[str, Any] = {}
    for system in systems:
        hit, miss = _series(result, system, "hit_ms"), _series(result, system, "miss_ms")
        cells[system] = {key: spread(list(_series(result, system, key).values())).as_dict() for key in LABELS}
        both = sorted(set(hit) & set(miss))
        cells[system]["hit_vs_miss"] = ratio([hit[r] for r in both], [miss[r] for r in both]).as_dict()
    targets = []
    for system, against, key, limit, at_most in TARGETS:
        if system not in systems or against not in systems:
            continue
        mine, theirs = _series(result, system, key), _series(result, against, key)
        rounds = [r for r in sorted(set(mine) & set(theirs)) if mine[r] > 0 and theirs[r] > 0]
        unusable = key != "miss_ms" and (system in missing or against in missing)
        interval = None if unusable or not rounds else ratio([mine[r] for r in rounds], [theirs[r] for r in rounds])
        judged = None if limit is None else Verdict.INCONCLUSIVE
        if limit is not None and interval is not None:
            judged = verdict(interval, limit, at_most)
        if limit is not None and key != "miss_ms" and system in missing:
            judged = Verdict.FAIL  # a pool B cannot hit misses every target on hits
        targets.append({
            "system": system, "against": against, "metric": key, "limit": limit, "at_most": at_most,
            "ratio": None if interval is None else interval.as_dict(), "verdict": judged and judged.value,
        })  # fmt: skip
    verdicts = [t["verdict"] for t in targets if t["verdict"] is not None]
    return {
        "cells": cells,
        "no_hit": missing,
        "targets": targets,
        "verdicts": {v.value: verdicts.count(v.value) for v in Verdict},
        "pass": bool(verdicts) and all(v == Verdict.PASS.value for v in verdicts),
    }


def to_markdown(result: dict[str, Any]) -> str:
    w, summary = result["workload"], result["summary"]
    parts = [
        f"Model `{Path(result['model']).name}` ({w['dtype']}), block {w['block_size']}. Per round: A serves "
        f"{w['prompts']} fresh prompts of {w['prompt_len']} tokens; B then serves each again with {w['suffix_len']} "
        f"unique tokens (hit), alternating with {w['prompts']} prompts of {w['prompt_len'] + w['suffix_len']} tokens "
        f"A never sent (miss), one at a time, 1 output token. A and B: vLLM OpenAI servers sharing one "
        f"mooncake_master and one segment holder of {w['pool_bytes'] / 2**20:.0f} MiB (a fresh pair per "
        f"system); `local`: B alone, no connector. PYTHONHASHSEED={result['hash_seed']} on every server. "
        f"{w['rounds']} interleaved rounds (order rotated); each figure: median [95% interval] across rounds "
        f'("(range)": too few rounds for a 95% interval); {result["elapsed_s"]:.0f} s.'
    ]
    rows = []
    for system, cell in summary["cells"].items():
        a = _series(result, system, "a_ttft_ms")
        keys = _series(result, system, "a_keys")
        hit_rate = summary["no_hit"].get(system) and "none: see below"
        rows.append([
            system, hit_rate or _shown(cell["hit_ms"]), _shown(cell["miss_ms"]),
            hit_rate or _shown(cell["hit_vs_miss"]), hit_rate or _shown(cell["pool_hit_rate"], percent=True),
            _shown(spread(list(a.values())).as_dict()) if a else "-",
            _shown(spread(list(keys.values())).as_dict()) if keys else "-",
        ])  # fmt: skip
    headers = ["system", "B hit TTFT ms", "B miss TTFT ms", "hit ÷ miss", "B pool hit rate", "A TTFT ms", "A keys"]
    parts.append(markdown_table(headers, rows))
    notes = [f"- `{name}`: B never hit through the pool: {why}" for name, why in summary["no_hit"].items()]
    notes += [f"- `{name}` did not run: {why}" for name, why in result["failed"].items()]
    if notes:
        parts.append("\n".join(notes))
    lines = []
    for t in summary["targets"]:
        shown = "not measured" if t["ratio"] is None else str(Interval(**t["ratio"]))
        name = f"`{t['system']}` {LABELS[t['metric']]} vs `{t['against']}`"
        if t["limit"] is None:
            lines.append(f"- {name}: {shown} (reference)")
        else:
            lines.append(f"- {name}: **{shown}** (target {'<=' if t['at_most'] else '>='} {t['limit']}) {t['verdict']}")
    parts.append("**Targets** (ratios paired by round: geometric mean [95% t interval])\n" + "\n".join(lines))
    return "\n\n".join(parts) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    """B's hit and miss TTFT per system, and B's pool hit rate, with intervals."""
    cells = result["summary"]["cells"]
    names = list(cells)
    with figure(path, ncols=2, width=5.0) as (_fig, (ttft, rate)):
        for offset, (key, label) in enumerate((("hit_ms", "hit"), ("miss_ms", "miss"))):
            shown = [cells[n][key] for n in names]
            xs = [i + 0.4 * offset for i in range(len(names))]
            ttft.bar(xs, [c["estimate"] for c in shown], width=0.4, yerr=_error_bars(shown), capsize=3, label=label)
        ttft.set_xticks([i + 0.2 for i in range(len(names))], names)
        ttft.set(title="B's TTFT: A's prompts (hit) and new ones (miss)", ylabel="ms")
        ttft.legend(fontsize=7)
        shown = [cells[n]["pool_hit_rate"] for n in names]
        rate.bar(names, [c["estimate"] for c in shown], yerr=_error_bars(shown), capsize=3)
        rate.set(title="B's pool hit rate on A's prompts", ylim=(0, 1))


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console

    Console().print(to_markdown(result), markup=False)
