"""kvpool's counters on vLLM's Prometheus ``/metrics`` and in its periodic stats log.

How the numbers travel in vLLM 0.32:

1. Every engine step the worker connector's ``get_kv_connector_stats()`` is called
   (the model runner's KV-connector mixin) and its result rides in
   ``KVConnectorOutput.kv_connector_stats``. Multi-process executors combine the workers' objects
   with ``aggregate`` (the KV-connector output aggregator).
2. The scheduler calls the scheduler connector's ``get_kv_connector_stats()`` after every step and,
   unless it ``is_empty()``, merges it into the worker's object with
   ``worker_stats.aggregate(scheduler_stats)`` (in the scheduler's ``update_from_output``).
3. With stat logging on (``LLM(disable_log_stats=False)``; ``vllm serve`` has it on) the payload
   ``to_dict()`` (= ``data``) goes to the front-end in ``SchedulerStats.kv_connector_stats``
   as a plain dict (msgpack across processes).
4. The front-end's ``PrometheusStatLogger`` hands the dict to the object built by the connector
   class's ``build_prom_metrics``; the logging stat logger rebuilds a stats object with
   ``build_kv_connector_stats(data)``, accumulates with ``aggregate`` and logs ``reduce()``
   every ``VLLM_LOG_STATS_INTERVAL``.

So a payload holds *deltas* (what happened since the previous step), never running totals, and
``aggregate`` must work both across workers (same step) and across steps (log interval). Counters
add up; pool gauges are snapshots per worker rank, so the later snapshot of a rank replaces the
earlier one and the Prometheus side sums the ranks it has seen.

Payload (``KVPoolStats.data``, plain JSON-able types only)::

    {"counters": {"chunks_saved": 3, "bytes_saved": 786432, ...},   # only the non-zero deltas
     "pools": {"tp0-pp0": {"pool_used_bytes": ..., "pool_keys": ..., "pool_capacity_bytes": ...}}}

Prometheus names (vLLM only keeps / reports collectors whose name starts with ``vllm:``): counter ``key`` is
``vllm:kvpool_<key>`` (exposed as ``vllm:kvpool_<key>_total``), gauges ``vllm:kvpool_<key>``,
labelled with vLLM's engine labels (``model_name``, ``engine``).

Cost: a sampler reads a fixed set of integer attributes and compares them with the previous values
(O(number of counters), independent of requests and context length) and returns ``None`` when
nothing changed. The embedded pool's gauges are read only when the worker's counters moved or at
most once per ``POOL_SAMPLE_INTERVAL_S`` otherwise.
"""

from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvpool.scheduler.scheduler_core import FIRST_TOKEN_KINDS

__all__ = [
    "ALL_GAUGES",
    "BACKEND_COUNTERS",
    "COUNTERS",
    "DISK_GAUGES",
    "POOL_GAUGES",
    "POOL_SAMPLE_INTERVAL_S",
    "SCHEDULER_COUNTERS",
    "WORKER_COUNTERS",
    "KVPoolPromMetrics",
    "KVPoolStats",
    "MetricSpec",
    "SchedulerStatsSampler",
    "WorkerStatsSampler",
    "prometheus_name",
]

POOL_SAMPLE_INTERVAL_S = 1.0
_COUNTERS = "counters"
_POOLS = "pools"
PREFIX = "vllm:kvpool_"


@dataclass(frozen=True)
class MetricSpec:
    key: str  # key in the payload; Prometheus name vllm:kvpool_<key>
    source: str  # attribute of the core's stats object it is read from
    doc: str


WORKER_COUNTERS: tuple[MetricSpec, ...] = (
    MetricSpec("chunks_saved", "chunks_put", "KV chunks stored in the pool."),
    MetricSpec("bytes_saved", "bytes_put", "Bytes of KV stored in the pool."),
    MetricSpec(
        "chunks_already_present", "chunks_already_present", "Chunks not stored because the pool already held them."
    ),
    MetricSpec("chunks_save_failed", "chunks_put_failed", "Chunks whose store failed (pool full or backend error)."),
    MetricSpec("chunks_examined", "chunks_examined", "Chunks the store path examined (only new chunks)."),
    MetricSpec(
        "save_jobs_dropped", "save_jobs_dropped", "Save batches dropped (save buffer full, pool unavailable, reset)."
    ),
    MetricSpec("chunks_loaded", "chunks_loaded", "KV chunks loaded from the pool into engine blocks."),
    MetricSpec("bytes_loaded", "bytes_loaded", "Bytes of KV loaded from the pool."),
    MetricSpec("chunks_load_failed", "chunks_load_failed", "Chunks whose load failed (recomputed by the engine)."),
    MetricSpec(
        "loads_timed_out", "loads_timed_out", "Loads still reading past load_deadline_s: reported failed, recomputed."
    ),
    MetricSpec(
        "chunks_corrupt", "chunks_corrupt", "Loaded chunks whose seal did not match their bytes (failed, recomputed)."
    ),
    MetricSpec("bytes_captured", "bytes_captured", "Bytes copied out of engine blocks in the step, for async puts."),
    MetricSpec(
        "save_full_retries", "full_retries", "Puts asked again because the pool had no room (it evicts meanwhile)."
    ),
    MetricSpec(
        "pressure_events", "pressure_events", "Times the pool still had no room (after retries off the engine thread)."
    ),
)
BACKEND_COUNTERS: tuple[MetricSpec, ...] = (
    MetricSpec("pool_evictions", "evictions", "Chunks the embedded pool evicted (by its pool_policy)."),
    MetricSpec(
        "pool_admissions_declined", "admissions_declined", "Chunks the embedded pool's pool_policy chose not to store."
    ),
    MetricSpec("disk_hits", "disk_hits", "Chunks read from the embedded pool's disk tier (not in DRAM any more)."),
    MetricSpec("disk_write_errors", "disk_write_errors", "Disk tier writes that failed (full disk, read-only, I/O)."),
    MetricSpec("disk_writes_skipped", "disk_writes_skipped", "Chunks not written to disk: the write queue was full."),
    MetricSpec("disk_corrupt", "disk_corrupt", "Disk tier files that failed their checks (removed, recomputed)."),
    MetricSpec("disk_late_reads", "disk_late_reads", "Disk tier reads past disk_read_timeout_ms (recomputed)."),
)
SCHEDULER_COUNTERS: tuple[MetricSpec, ...] = (
    MetricSpec("lookups", "lookups", "Pool lookups made for new or preempted requests."),
    MetricSpec("lookup_hit_tokens", "lookup_hit_tokens", "Prompt tokens the pool lookups found."),
    MetricSpec("lookup_failures", "lookup_failures", "Lookups that failed or timed out (counted as a miss)."),
    MetricSpec("lookups_skipped", "lookups_skipped", "Lookups answered miss at once: the pool's breaker was open."),
    MetricSpec("load_requests", "loads", "Requests scheduled to load a prefix from the pool."),
    MetricSpec("load_tokens", "load_tokens", "Tokens scheduled to be loaded from the pool instead of computed."),
    MetricSpec("preemptions", "preemptions", "Requests preempted by the engine while tracked by kvpool."),
    MetricSpec(
        "lookup_wait_steps", "lookup_waits", "Scheduler steps requests waited for an async lookup (ask-again answers)."
    ),
    MetricSpec("loads_finished", "loads_finished", "Pool loads the workers reported finished (loaded or failed)."),
    MetricSpec(
        "load_wait_steps", "load_wait_steps", "Scheduler steps from a load's allocation to its reported finish, summed."
    ),
    MetricSpec(
        "weight_changes", "weight_changes", "In-place weight changes of the engine: each one renamed every key."
    ),
    MetricSpec("load_requests_in_step", "loads_in_step", "Of load_requests: contract hits loaded in-step (no wait)."),
    *(
        spec
        for kind, what in FIRST_TOKEN_KINDS.items()
        for spec in (
            MetricSpec(
                f"first_token_steps_{kind}",
                f"first_token_steps_{kind}",
                f"Engine steps from admission to first token, summed over requests with {what}.",
            ),
            MetricSpec(f"first_tokens_{kind}", f"first_tokens_{kind}", f"Requests with {what} at their first token."),
        )
    ),
)
COUNTERS: tuple[MetricSpec, ...] = WORKER_COUNTERS + BACKEND_COUNTERS + SCHEDULER_COUNTERS
POOL_GAUGES: tuple[MetricSpec, ...] = (
    MetricSpec("pool_used_bytes", "used_bytes", "Bytes held by the embedded pool (summed over worker ranks)."),
    MetricSpec("pool_keys", "keys", "Chunks held by the embedded pool (summed over worker ranks)."),
    MetricSpec("pool_capacity_bytes", "capacity_bytes", "Capacity of the embedded pool (summed over worker ranks)."),
)
DISK_GAUGES: tuple[MetricSpec, ...] = (  # sent only by a pool with a disk tier
    MetricSpec("pool_disk_used_bytes", "disk_used_bytes", "Bytes on the disk tier (summed over worker ranks)."),
    MetricSpec("pool_disk_keys", "disk_keys", "Chunks on the embedded pool's disk tier (summed over ranks)."),
    MetricSpec("pool_disk_capacity_bytes", "disk_capacity_bytes", "Capacity of the disk tier (summed over ranks)."),
)
ALL_GAUGES = POOL_GAUGES + DISK_GAUGES
_COUNTER_ORDER = {spec.key: i for i, spec in enumerate(COUNTERS)}


def prometheus_name(key: str) -> str:
    """The metric name of a payload key (counters are exposed with a ``_total`` suffix)."""
    return PREFIX + key


# ---- the payload ------------------------------------------------------------------------------


@dataclass
class KVPoolStats(KVConnectorStats):
    """One step's (or one log interval's) kvpool deltas; see the module docstring for ``data``."""

    def __post_init__(self) -> None:
        # own copies: vLLM may hand the same dict to several observers (in-process there is no
        # serialisation), and aggregate() mutates in place
        data = self.data or {}
        self.data = {
            _COUNTERS: dict(data.get(_COUNTERS) or {}),
            _POOLS: {rank: dict(values) for rank, values in (data.get(_POOLS) or {}).items()},
        }

    @property
    def counters(self) -> dict[str, int | float]:
        return self.data[_COUNTERS]

    @property
    def pools(self) -> dict[str, dict[str, int | float]]:
        return self.data[_POOLS]

    def reset(self) -> None:
        self.data = {_COUNTERS: {}, _POOLS: {}}

    def is_empty(self) -> bool:
        return not self.data[_COUNTERS] and not self.data[_POOLS]

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Counters add up; a pool snapshot of a rank replaces the earlier one (``other`` is newer,
        or another rank of the same step)."""
        if other is None or other is self or other.is_empty():
            return self
        counters = self.data[_COUNTERS]
        for key, value in (other.data.get(_COUNTERS) or {}).items():
            counters[key] = counters.get(key, 0) + value
        pools = self.data[_POOLS]
        for rank, values in (other.data.get(_POOLS) or {}).items():
            pools[rank] = dict(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        """Flat summary for vLLM's periodic log line: counters in a fixed order, then pool gauges
        summed over ranks."""
        counters = self.data[_COUNTERS]
        reduced: dict[str, int | float] = {}
        for key in sorted(counters, key=lambda k: (_COUNTER_ORDER.get(k, len(_COUNTER_ORDER)), k)):
            value = counters[key]
            reduced[key] = round(value, 3) if isinstance(value, float) else value
        pools = self.data[_POOLS]
        if pools:
            for spec in ALL_GAUGES:
                if any(spec.key in values for values in pools.values()):
                    reduced[spec.key] = sum(values.get(spec.key, 0) for values in pools.values())
        return reduced


# ---- samplers (engine side) -------------------------------------------------------------------


class _Deltas:
    """Delta of selected numeric attributes of a stats object since the previous ``take``."""

    __slots__ = ("_keys", "_last", "_read")

    def __init__(self, specs: tuple[MetricSpec, ...], baseline: Any = None) -> None:
        self._keys = tuple(spec.key for spec in specs)
        sources = [spec.source for spec in specs]
        # every counter in one C call, so a step where none moved costs one tuple comparison
        read = operator.attrgetter(*sources)
        self._read: Any = read if len(sources) > 1 else (lambda source: (read(source),))
        self._last: tuple[Any, ...] = (
            tuple(getattr(baseline, source, 0) for source in sources) if baseline is not None else (0,) * len(sources)
        )

    def take(self, source: Any, into: dict[str, int | float]) -> None:
        values = self._read(source)
        last = self._last
        if values == last:
            return
        self._last = values
        for key, value, previous in zip(self._keys, values, last):
            if value != previous:
                # a counter that went down was replaced (new source object): count it from zero
                delta = value - previous if value > previous else value
                if delta:
                    into[key] = delta


class WorkerStatsSampler:
    """Turns a worker's live ``WorkerStats`` (and the embedded pool's ``BackendStats``) into
    per-step ``KVPoolStats`` deltas."""

    def __init__(
        self,
        worker_stats: Any,
        backend: Any = None,
        rank: str = "tp0-pp0",
        pool_sample_interval_s: float = POOL_SAMPLE_INTERVAL_S,
    ) -> None:
        self._stats = worker_stats
        self._worker = _Deltas(WORKER_COUNTERS)
        # only the embedded pool knows its size without I/O (Mooncake's lives on the master)
        self._backend = backend if getattr(backend, "name", None) in ("memory", "memory+disk") else None
        self._gauges = POOL_GAUGES + (DISK_GAUGES if getattr(backend, "name", None) == "memory+disk" else ())
        self._pool_deltas: _Deltas | None = None
        if self._backend is not None:
            # the embedded pool outlives engines: count only what happens from now on
            self._pool_deltas = _Deltas(BACKEND_COUNTERS, self._backend.stats())
        self._rank = rank
        self._interval = pool_sample_interval_s
        self._sampled_at = -math.inf
        self._snapshot: dict[str, int | float] | None = None

    def take(self) -> KVPoolStats | None:
        counters: dict[str, int | float] = {}
        self._worker.take(self._stats, counters)
        pools: dict[str, dict[str, int | float]] = {}
        backend = self._backend
        if backend is not None:
            now = time.monotonic()
            if counters or now - self._sampled_at >= self._interval:
                self._sampled_at = now
                stats = backend.stats()
                assert self._pool_deltas is not None
                self._pool_deltas.take(stats, counters)
                snapshot = {spec.key: getattr(stats, spec.source) for spec in self._gauges}
                if snapshot != self._snapshot:
                    self._snapshot = snapshot
                    pools[self._rank] = snapshot
        if not counters and not pools:
            return None
        return KVPoolStats({_COUNTERS: counters, _POOLS: pools})


class SchedulerStatsSampler:
    """Turns the scheduler's live ``SchedulerStats`` into per-step ``KVPoolStats`` deltas."""

    def __init__(self, scheduler_stats: Any) -> None:
        self._stats = scheduler_stats
        self._deltas = _Deltas(SCHEDULER_COUNTERS)

    def take(self) -> KVPoolStats | None:
        counters: dict[str, int | float] = {}
        self._deltas.take(self._stats, counters)
        return KVPoolStats({_COUNTERS: counters}) if counters else None


# ---- Prometheus (front-end side) --------------------------------------------------------------


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """Registers ``vllm:kvpool_*`` counters and gauges and records payloads into them."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for spec in COUNTERS:
            counter = self._counter_cls(
                name=prometheus_name(spec.key), documentation=f"kvpool: {spec.doc}", labelnames=labelnames
            )
            self._counters[spec.key] = self._per_engine(counter)
        self._gauges: dict[str, dict[int, Any]] = {}
        for spec in ALL_GAUGES:
            # vLLM types _gauge_cls as any of its metric classes, though it is always metric_types[Gauge]
            gauge = self._gauge_cls(  # type: ignore[call-arg]
                name=prometheus_name(spec.key),
                documentation=f"kvpool: {spec.doc}",
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
            self._gauges[spec.key] = self._per_engine(gauge)
        # engine -> rank -> latest pool snapshot (payloads carry only the ranks that changed)
        self._pools: dict[int, dict[str, dict[str, int | float]]] = {}

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0) -> None:
        if not transfer_stats_data:
            return
        for key, value in (transfer_stats_data.get(_COUNTERS) or {}).items():
            children = self._counters.get(key)
            if children is not None and value > 0 and engine_idx in children:
                children[engine_idx].inc(value)
        pools = transfer_stats_data.get(_POOLS)
        if pools:
            known = self._pools.setdefault(engine_idx, {})
            known.update(pools)
            for spec in ALL_GAUGES:
                children = self._gauges[spec.key]
                if engine_idx in children and any(spec.key in values for values in known.values()):
                    children[engine_idx].set(sum(values.get(spec.key, 0) for values in known.values()))
