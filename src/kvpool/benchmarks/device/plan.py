"""The device check's plan: every phase's shapes, block ranges, sizes and a time estimate, built by one
function for the GPU and for the CPU dry run, and checked without allocating anything
(`check_plan`: what `--plan-only` prints, and what the tests run with the GPU's plan).

Memory model (what `check_plan` bounds): the device holds at most one phase's caches at a time
(`Shape.cache_bytes`, twice for the round trip, which builds both cache layouts in turn) plus kvpool's
two device buffers and the phase's own buffers; the host holds the pinned staging ring (rounded up to
a power of two), the embedded pool, and the bandwidth phase's pinned reference buffer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvpool.worker.cuda_runtime import pinned_bytes
from kvpool.worker.device_copy import DEVICE_BUFFER_BYTES, LOAD_SHARE

GiB = 1 << 30
MiB = 1 << 20
H200_DEVICE_BYTES = 139 * GiB
LENT_HOST_BYTES = 128 * GiB
BUDGET_S = 240.0  # the bound for one run on one H200 (so a second try fits the lease)
WATCHDOG_S = 220.0  # stacks dumped and the run ended before the bound, JSON of finished phases kept
PCIE_GBPS_FLOOR = 10.0  # for the time estimate: a slow PCIe link, to stay inside the bound anyway


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    block: int = 16
    heads: int = 8
    head_dim: int = 128
    blocks: int = 2048

    @property
    def chunk_bytes(self) -> int:
        return self.layers * 2 * self.block * self.heads * self.head_dim * 2  # bf16, K and V

    @property
    def cache_bytes(self) -> int:
        return self.chunk_bytes * self.blocks


@dataclass(frozen=True)
class RoundTripPlan:
    shape: Shape
    chunks: int
    caches: tuple[str, ...] = ("backing", "per_layer")
    orders: tuple[str, ...] = ("v1", "v2")
    stall_cycles: int = 0  # device sleep queued on every stream before each save and load

    def ranges(self) -> list[tuple[int, int]]:
        return [(1, self.chunks), (1 + self.chunks, self.chunks)]  # saved from, loaded into


@dataclass(frozen=True)
class BandwidthRow:
    shape: Shape
    batch: int
    reps: int

    def ranges(self) -> list[tuple[int, int]]:
        return [(1, self.batch)]

    @property
    def nbytes(self) -> int:
        return self.batch * self.shape.chunk_bytes


@dataclass(frozen=True)
class OverlapPlan:
    shape: Shape
    size: int  # the forward: a size x size bf16 matmul
    forwards: int  # per engine step
    steps: int  # per window
    rounds: int  # of ABC CBA windows: A alone, B with the step's saves, C with saves and async loads
    batch: int  # chunks saved per step (and loaded per load)

    def ranges(self) -> list[tuple[int, int]]:
        return [(1, self.batch), (1 + self.batch, self.batch)]


@dataclass(frozen=True)
class EngineThreadPlan:
    shape: Shape
    chunks: int
    integrity: tuple[str, ...] = ("off", "full")

    def ranges(self) -> list[tuple[int, int]]:
        return [(1, self.chunks), (1 + self.chunks, self.chunks), (1 + 2 * self.chunks, self.chunks)]


@dataclass(frozen=True)
class Plan:
    device: str
    pool_bytes: int
    staging_bytes: int
    round_trip: RoundTripPlan
    engine_thread: EngineThreadPlan
    bandwidth: tuple[BandwidthRow, ...]
    pcie_bytes: int
    overlap: OverlapPlan
    budget_s: float = BUDGET_S
    watchdog_s: float = WATCHDOG_S
    phase_limit_s: float = 80.0  # an isolated phase's process is ended (stacks dumped) after this
    phases: tuple[str, ...] = field(default=("round_trip", "engine_thread", "bandwidth", "overlap"))

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def gpu_plan() -> Plan:
    """One H200: 32 layers, block 16, 8 KV heads x 128 (a 2 MiB chunk), 2048 blocks (4 GiB a cache)."""
    main = Shape()
    rows = []
    for shape in (Shape(layers=4, blocks=1024), Shape(layers=32, blocks=1024), Shape(layers=64, blocks=512)):
        batch = min(256 * MiB // shape.chunk_bytes, shape.blocks - 1)  # 256 MiB a batch, inside the cache
        rows.append(BandwidthRow(shape, batch, reps=8))
    return Plan(
        device="cuda",
        pool_bytes=4 * GiB,
        staging_bytes=2 * GiB,
        round_trip=RoundTripPlan(main, chunks=256, stall_cycles=100_000_000),  # ~60 ms of sleep a stream
        engine_thread=EngineThreadPlan(main, chunks=64),
        bandwidth=tuple(rows),
        pcie_bytes=GiB,
        overlap=OverlapPlan(main, size=8192, forwards=4, steps=8, rounds=3, batch=32),
    )


def dry_plan() -> Plan:
    """The same phases on the CPU, small: `--dry-run` (in `make test`)."""
    main = Shape(layers=4, block=16, heads=2, head_dim=32, blocks=64)
    small = Shape(layers=2, heads=2, head_dim=32, blocks=64)
    return Plan(
        device="cpu",
        pool_bytes=64 * MiB,
        staging_bytes=16 * MiB,
        round_trip=RoundTripPlan(main, chunks=8),
        engine_thread=EngineThreadPlan(main, chunks=4),
        bandwidth=(BandwidthRow(small, 8, 2), BandwidthRow(main, 8, 2)),
        pcie_bytes=8 * MiB,
        overlap=OverlapPlan(main, size=64, forwards=2, steps=2, rounds=1, batch=4),
    )


def _ring_shares(staging_bytes: int, largest_chunk: int) -> tuple[int, int]:
    total = pinned_bytes(staging_bytes)
    load = min(total // 2, max(total // LOAD_SHARE, largest_chunk * 8))
    return total - load, load


def check_plan(plan: Plan, load_batch_chunks: int = 64) -> dict[str, Any]:
    """Every phase's plan against its shapes and the machine, without allocating: block ranges inside
    1..blocks-1, batches that fit the staging ring's shares and the pool, memory on both sides, and the
    time estimate inside the budget. {"ok": bool, "problems": [...], per-phase figures}."""
    problems: list[str] = []
    phases: dict[str, Any] = {}

    def ranges_fit(name: str, shape: Shape, ranges: list[tuple[int, int]]) -> None:
        used: set[int] = set()
        for first, count in ranges:
            last = first + count - 1
            if count <= 0 or first < 1 or last > shape.blocks - 1:
                problems.append(f"{name}: blocks {first}..{last} are outside 1..{shape.blocks - 1}")
            span = set(range(first, last + 1))
            if used & span:
                problems.append(f"{name}: blocks {first}..{last} overlap another range of the phase")
            used |= span

    def batch_fits(name: str, shape: Shape, chunks: int, sealed: bool = False, inline_loads: int = 1) -> None:
        """`inline_loads`: loads of `chunks` run on the engine's thread, whose pinned slots may all be in
        flight at once (that thread never waits for one to free), in the load share and the free save
        share (the phases drain their saves before loading); 0: loads on the loader's thread."""
        save_share, load_share = _ring_shares(plan.staging_bytes, shape.chunk_bytes)
        row = shape.chunk_bytes + (8 if sealed else 0) + 16
        if chunks * row > save_share:
            problems.append(f"{name}: a save of {chunks} chunks ({chunks * row} B) exceeds the ring's save share")
        if min(chunks, load_batch_chunks) * row > load_share:
            problems.append(f"{name}: a load batch exceeds the ring's load share ({load_share} B)")
        if inline_loads * chunks * row > load_share + save_share:
            problems.append(
                f"{name}: {inline_loads} engine-thread load(s) of {chunks} chunks ({inline_loads * chunks * row} B)"
                f" exceed the ring ({load_share + save_share} B): the last chunks would fail"
            )
        if chunks * row > plan.pool_bytes:
            problems.append(f"{name}: {chunks} chunks do not fit the {plan.pool_bytes}-byte pool")

    device_extra = 2 * min(DEVICE_BUFFER_BYTES, pinned_bytes(plan.staging_bytes))
    host_base = pinned_bytes(plan.staging_bytes) + plan.pool_bytes

    trip = plan.round_trip
    ranges_fit("round_trip", trip.shape, trip.ranges())
    batch_fits("round_trip", trip.shape, trip.chunks)
    trip_bytes = trip.chunks * trip.shape.chunk_bytes
    trips = len(trip.caches) * len(trip.orders) * 2  # two scenarios, each with two device sleeps
    sleeps = trips * 2 * trip.stall_cycles / 1.5e9  # a GPU clock >= 1.5 GHz
    phases["round_trip"] = {
        "device_bytes": trip.shape.cache_bytes + device_extra,
        "estimate_s": round(
            len(trip.caches) * (2.0 + len(trip.orders) * 3 * trip_bytes / (PCIE_GBPS_FLOOR * 1e9)) + sleeps, 1
        ),
    }

    engine = plan.engine_thread
    ranges_fit("engine_thread", engine.shape, engine.ranges())
    batch_fits("engine_thread", engine.shape, engine.chunks, sealed=True, inline_loads=2)
    engine_bytes = engine.chunks * engine.shape.chunk_bytes
    phases["engine_thread"] = {
        "device_bytes": engine.shape.cache_bytes + device_extra,
        "estimate_s": round(len(engine.integrity) * (2.0 + 4 * engine_bytes / (PCIE_GBPS_FLOOR * 1e9)), 1),
    }

    seconds = 0.0
    device_bytes = 0
    for index, row in enumerate(plan.bandwidth):
        name = f"bandwidth[{index}]"
        ranges_fit(name, row.shape, row.ranges())
        batch_fits(name, row.shape, row.batch)
        device_bytes = max(device_bytes, row.shape.cache_bytes + row.nbytes + device_extra)
        seconds += 2.0 + (4 * row.reps + 2 * max(1, row.reps // 2)) * row.nbytes / (PCIE_GBPS_FLOOR * 1e9)
    seconds += 2 * 4 * plan.pcie_bytes / (PCIE_GBPS_FLOOR * 1e9)
    phases["bandwidth"] = {
        "device_bytes": device_bytes,
        "host_pinned_extra": max(r.nbytes for r in plan.bandwidth),
        "estimate_s": round(seconds, 1),
    }

    over = plan.overlap
    ranges_fit("overlap", over.shape, over.ranges())
    batch_fits("overlap", over.shape, over.batch, inline_loads=0)
    windows = over.rounds * 6
    step_bytes = 2 * over.batch * over.shape.chunk_bytes
    forward_s = 2 * over.size**3 / 300e12  # bf16 at a conservative 300 TFLOP/s on a GPU
    over_s = windows * over.steps * (over.forwards * forward_s + step_bytes / (PCIE_GBPS_FLOOR * 1e9)) + 3.0
    phases["overlap"] = {
        "device_bytes": over.shape.cache_bytes + 3 * over.size**2 * 2 + device_extra,
        "estimate_s": round(over_s, 1),
    }

    if plan.device == "cuda":
        for name, figures in phases.items():
            if figures["device_bytes"] > H200_DEVICE_BYTES // 2:
                problems.append(f"{name}: {figures['device_bytes']} device bytes exceed half of one H200")
        host = host_base + phases["bandwidth"]["host_pinned_extra"]
        if host > LENT_HOST_BYTES // 2:
            problems.append(f"host memory {host} B exceeds half of the lent machine's")
        # + the parent's start, and per phase its own process (torch import, CUDA context, pinned ring)
        estimate = sum(figures["estimate_s"] for figures in phases.values()) + 10.0 + 8.0 * len(phases)
        if estimate > plan.watchdog_s:
            problems.append(f"estimated {estimate:.0f} s exceeds the watchdog's {plan.watchdog_s:.0f} s")
    else:
        estimate = 0.0
    if plan.watchdog_s >= plan.budget_s:
        problems.append("the watchdog must fire before the outer budget")
    for name, figures in phases.items():
        if plan.device == "cuda" and figures["estimate_s"] + 15.0 > plan.phase_limit_s:  # + process start, caches
            problems.append(f"{name}: estimated {figures['estimate_s']} s does not fit the phase limit")
    return {"ok": not problems, "problems": problems, "phases": phases, "estimate_s": round(estimate, 1)}
