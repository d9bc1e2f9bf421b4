"""The disk tier's throughput against the disk's own sequential bandwidth, in one run, one I/O mode.

Per chunk size, each round times, in an order rotating from round to round, one batch of `keys`
chunks moved five ways through the same directory:
* `raw_write`: the batch's bytes written into one file, chunk after chunk (buffered, no fsync): the
  disk's sequential write bandwidth in the mode the tier writes (the page cache);
* `tier_write`: `DiskTier.write` of each chunk (a file each: header, XXH3-64 of the bytes, a temporary
  name renamed into place) into an empty tier, a new file each;
* `tier_write_full`: the same into a tier at its capacity, each write evicting the least recently used
  chunk and writing over its file (the state a tier stays in once it has filled);
* `raw_read`: that one file read back sequentially, a chunk's bytes a read, each into a new buffer
  (as the tier reads: a read owns its buffer);
* `tier_read`: `DiskTier.read` of each chunk (magic, key, length and both checksums checked);
* `tier_read_unchecked`: the same files read whole without the checks: what the seal check costs;
* `pool_read`: the batch as a load takes it from the embedded pool with DRAM empty
  (`TieredPool.get_into`): the files read and checked on the pool's read threads side by side, copied
  into the load's buffer (one used before, as the loader's are), promoted into DRAM (arrays DRAM freed,
  as in a pool at capacity). No target: the whole path, on every core;
* `direct_write`, `direct_read`: the raw moves with `O_DIRECT` (page-aligned buffers): the device's
  own bandwidth, past the page cache;
* `direct_tier_write`, `direct_tier_write_full`, `direct_tier_read`: the tier's own moves in its
  `O_DIRECT` mode (`disk_io: direct`: files padded to whole pages, written from and read into
  page-aligned buffers, every read checked), against the direct raw moves: the same I/O mode.
Buffered reads come from the page cache for both (it cannot be dropped on this machine): cached
against cached. Files are removed between rounds, outside the timed calls. Where the file system
refuses `O_DIRECT`, or a chunk is not whole pages, the direct rows are left out.

Targets: `tier_write` and `tier_write_full` ÷ `raw_write`, `tier_read` ÷ `raw_read` >= 0.8, and the same
three of the direct mode ÷ `direct_write` / `direct_read`, as ratios paired by round with a 95% interval
(`stats.ratio`); a verdict fails only when the whole interval misses.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvpool.backends.base import Rows, Status
from kvpool.backends.disk import DiskTier
from kvpool.backends.disk_file import HEADER_BYTES, SUFFIX, read_all
from kvpool.backends.memory import MemoryBackend
from kvpool.backends.tiered import TieredPool
from kvpool.benchmarks.measure.stats import Verdict, ratio, rotation, spread, verdict

CHUNK_SIZES = (256 << 10, 2 << 20, 4 << 20)
KEYS = 32
ROUNDS = 7
TARGET = 0.8
SYSTEMS = (
    "raw_write", "tier_write", "tier_write_full", "raw_read", "tier_read", "tier_read_unchecked", "pool_read",
    "direct_write", "direct_read", "direct_tier_write", "direct_tier_write_full", "direct_tier_read",
)  # fmt: skip
DIRECT = ("direct_write", "direct_read", "direct_tier_write", "direct_tier_write_full", "direct_tier_read")
PAGE = 4096  # O_DIRECT wants buffers, lengths and offsets in multiples of the logical block: a page is enough
PAIRS = (
    ("tier_write", "raw_write"), ("tier_write_full", "raw_write"), ("tier_read", "raw_read"),
    ("tier_read_unchecked", "raw_read"), ("pool_read", "raw_read"),
    ("direct_tier_write", "direct_write"), ("direct_tier_write_full", "direct_write"),
    ("direct_tier_read", "direct_read"),
)  # fmt: skip
TARGETED = {"tier_write", "tier_write_full", "tier_read", "direct_tier_write", "direct_tier_write_full",
            "direct_tier_read"}  # fmt: skip
ALL_ARGS: dict[str, Any] = {"keys": KEYS, "rounds": 15}
TINY_ARGS: dict[str, Any] = {"chunk_sizes": (64 << 10,), "keys": 4, "rounds": 2}


def _key(size: int, i: int) -> str:
    return f"kvp1/bench/0000000000000000/s0/p0/g0/{size:08x}{i:024x}"


class _Cell:
    """One chunk size's batch and the five timed moves of it."""

    def __init__(self, directory: str, chunk_bytes: int, keys: int, direct: bool = False) -> None:
        self.directory = directory
        rng = np.random.default_rng(chunk_bytes)
        self.values = [rng.integers(0, 256, chunk_bytes, dtype=np.uint8) for _ in range(keys)]
        self.keys = [_key(chunk_bytes, i) for i in range(keys)]
        self.raw_path = os.path.join(directory, "raw.bin")
        self.direct_path = os.path.join(directory, "direct.bin")
        self.aligned = [_aligned(chunk_bytes) for _ in range(keys)]
        for copy, original in zip(self.aligned, self.values):
            copy[:] = original
        self.chunk_bytes = chunk_bytes
        self.tier = DiskTier(os.path.join(directory, "tier"), 1 << 40)
        # holds one batch exactly; two key sets take turns, so each timed write evicts a chunk of the other
        file_bytes = HEADER_BYTES + len(self.keys[0].encode()) + chunk_bytes
        self.full_tier = DiskTier(os.path.join(directory, "full"), keys * file_bytes)
        self.full_sets = ([_key(chunk_bytes, keys + i) for i in range(keys)], self.keys)
        self.direct_tier = self.direct_full_tier = None
        if direct:  # the same two tiers in the O_DIRECT mode: each file padded to whole pages
            self.direct_tier = DiskTier(os.path.join(directory, "dtier"), 1 << 40, direct=True)
            padded = -(-file_bytes // PAGE) * PAGE
            self.direct_full_tier = DiskTier(os.path.join(directory, "dfull"), keys * padded, direct=True)
            self.direct_full_sets = self.full_sets
        # a read deadline no loaded machine misses: the bench times reads, it does not fail them
        self.pool = TieredPool(MemoryBackend(2 * keys * chunk_bytes), self.tier, read_timeout_s=60.0)
        self.load_buffer = np.zeros((keys, chunk_bytes), dtype=np.uint8)

    def prepare(self, system: str) -> None:
        """Untimed: what the move needs on disk (the reads read what the writes left)."""
        if system.startswith("tier_read") or system == "pool_read":
            if not self.tier.contains(self.keys[0]):
                for key, value in zip(self.keys, self.values):
                    self.tier.write(key, [value])
            # what the last pool read promoted leaves DRAM as an eviction would: its arrays are reused
            self.pool.memory.remove(self.keys)
        if system == "raw_read" and not os.path.exists(self.raw_path):
            self.raw_write()
        if system == "tier_write":
            self.tier.clear()
        if system == "tier_write_full" and not self.full_tier.contains(self.full_sets[1][0]):
            for key, value in zip(self.full_sets[1], self.values):
                self.full_tier.write(key, [value])
        if system == "raw_write" and os.path.exists(self.raw_path):
            os.unlink(self.raw_path)
        if system == "direct_read" and not os.path.exists(self.direct_path):
            self.direct_write()
        if system == "direct_write" and os.path.exists(self.direct_path):
            os.unlink(self.direct_path)
        if system == "direct_tier_read" and self.direct_tier and not self.direct_tier.contains(self.keys[0]):
            for key, value in zip(self.keys, self.values):
                self.direct_tier.write(key, [value])
        if system == "direct_tier_write" and self.direct_tier:
            self.direct_tier.clear()
        full = self.direct_full_tier
        if system == "direct_tier_write_full" and full and not full.contains(self.direct_full_sets[1][0]):
            for key, value in zip(self.direct_full_sets[1], self.values):
                full.write(key, [value])

    def raw_write(self) -> None:
        fd = os.open(self.raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for value in self.values:
                os.write(fd, value.data)
        finally:
            os.close(fd)

    def tier_write(self) -> None:
        for key, value in zip(self.keys, self.values):
            self.tier.write(key, [value])

    def tier_write_full(self) -> None:
        for key, value in zip(self.full_sets[0], self.values):
            self.full_tier.write(key, [value])
        self.full_sets = self.full_sets[::-1]

    def raw_read(self) -> None:
        fd = os.open(self.raw_path, os.O_RDONLY)
        try:
            for _ in self.keys:
                read_all(fd, np.empty(self.chunk_bytes, dtype=np.uint8))  # on from where the last read stopped
        finally:
            os.close(fd)

    def tier_read(self) -> None:
        for key in self.keys:
            if isinstance(self.tier.read(key), int):
                raise RuntimeError(f"disk tier read of {key} failed")

    def pool_read(self) -> None:
        # into one buffer used before, as the loader reads (`HostBuffers`): fresh memory would time page faults
        dests = Rows((self.load_buffer,), np.arange(len(self.keys)))
        if any(status is not Status.OK for status in self.pool.get_into(self.keys, dests)):
            raise RuntimeError("a pool read from the disk tier failed")

    def close(self) -> None:
        self.pool.shutdown(5.0)

    def tier_read_unchecked(self) -> None:
        root = self.tier.directory
        for key in self.keys:
            path = os.path.join(root, *key.split("/")) + SUFFIX
            fd = os.open(path, os.O_RDONLY)
            try:
                read_all(fd, np.empty(os.fstat(fd).st_size, dtype=np.uint8))
            finally:
                os.close(fd)

    def direct_write(self) -> None:
        fd = os.open(self.direct_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            for value in self.aligned:
                os.write(fd, value.data)
        finally:
            os.close(fd)

    def direct_read(self) -> None:
        fd = os.open(self.direct_path, os.O_RDONLY | os.O_DIRECT)
        try:
            for _ in self.keys:
                read_all(fd, _aligned(self.chunk_bytes))
        finally:
            os.close(fd)

    def direct_tier_write(self) -> None:
        assert self.direct_tier is not None
        for key, value in zip(self.keys, self.values):
            self.direct_tier.write(key, [value])

    def direct_tier_write_full(self) -> None:
        assert self.direct_full_tier is not None
        for key, value in zip(self.direct_full_sets[0], self.values):
            self.direct_full_tier.write(key, [value])
        self.direct_full_sets = self.direct_full_sets[::-1]

    def direct_tier_read(self) -> None:
        assert self.direct_tier is not None
        for key in self.keys:
            if isinstance(self.direct_tier.read(key), int):
                raise RuntimeError(f"disk tier read of {key} (O_DIRECT) failed")

    def move(self, system: str) -> Callable[[], None]:
        move: Callable[[], None] = getattr(self, system)
        return move


def run(
    *,
    chunk_sizes: Sequence[int] = CHUNK_SIZES,
    keys: int = KEYS,
    rounds: int = ROUNDS,
    directory: str | None = None,
) -> dict[str, Any]:
    """Measure in `directory` (default: a temporary one beside the working directory, on its disk)."""
    if keys < 1 or rounds < 2:
        raise ValueError(f"keys {keys}, rounds {rounds}: keys must be >= 1 and rounds >= 2 (an interval)")
    base = tempfile.mkdtemp(prefix="kvpool-disk-bench-", dir=directory or os.getcwd())
    direct = _direct_supported(base)
    rows: list[dict[str, Any]] = []
    try:
        for chunk_bytes in chunk_sizes:
            with_direct = direct and chunk_bytes % PAGE == 0
            cell = _Cell(base, chunk_bytes, keys, direct=with_direct)
            systems = SYSTEMS if with_direct else tuple(s for s in SYSTEMS if s not in DIRECT)
            seconds: dict[str, list[float]] = {system: [] for system in systems}
            try:
                for system in systems:  # one untimed warm-up round
                    cell.prepare(system)
                    cell.move(system)()
                for index in range(rounds):
                    for system in rotation(systems, index):
                        cell.prepare(system)
                        start = time.perf_counter()
                        cell.move(system)()
                        seconds[system].append(time.perf_counter() - start)
            finally:
                cell.close()
            batch = chunk_bytes * keys
            gbps = {system: [batch / s / 1e9 for s in values] for system, values in seconds.items()}
            row: dict[str, Any] = {
                "chunk_bytes": chunk_bytes,
                "keys": keys,
                "gbps": {system: spread(values).as_dict() for system, values in gbps.items()},
                "ratios": {},
            }
            for system, base_system in PAIRS:
                if system not in gbps:
                    continue
                interval = ratio(gbps[system], gbps[base_system])
                entry = {"of": base_system, **interval.as_dict()}
                if system in TARGETED:
                    entry["target"] = TARGET
                    entry["verdict"] = verdict(interval, TARGET, at_most=False).value
                row["ratios"][system] = entry
            rows.append(row)
            shutil.rmtree(base, ignore_errors=True)
            os.makedirs(base, exist_ok=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    failed = any(entry.get("verdict") == Verdict.FAIL.value for row in rows for entry in row["ratios"].values())
    return {
        "bench": "transfer",
        "backend": "disk",
        "config": {
            "chunk_sizes": list(chunk_sizes),
            "keys": keys,
            "rounds": rounds,
            "io": "buffered (page cache); the direct rows O_DIRECT",
            "direct": direct,
        },
        "results": rows,
        "pass": not failed,
    }


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned buffer of `nbytes` (what O_DIRECT reads into and writes from)."""
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start : start + nbytes]


def _direct_supported(directory: str) -> bool:
    path = os.path.join(directory, "probe.direct")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.write(fd, _aligned(PAGE).data)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):  # EINVAL on tmpfs; no O_DIRECT outside Linux
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def to_markdown(result: dict[str, Any]) -> str:
    from kvpool.benchmarks.measure.report import markdown_table

    def shown(entry: dict[str, Any]) -> str:
        mark = f" **{entry['verdict']}**" if "verdict" in entry else ""
        return f"{entry['estimate']:.2f} [{entry['low']:.2f}, {entry['high']:.2f}]{mark}"

    def device(row: dict[str, Any], system: str) -> str:
        entry = row["gbps"].get(system)
        return f"{entry['estimate']:.2f}" if entry else "-"

    def either(row: dict[str, Any], system: str) -> str:
        return shown(row["ratios"][system]) if system in row["ratios"] else "-"

    headers = [
        "chunk", "raw write GB/s", "tier write ÷ raw", "full tier write ÷ raw", "raw read GB/s", "tier read ÷ raw",
        "unchecked ÷ raw", "pool read ÷ raw", "O_DIRECT write GB/s", "O_DIRECT read GB/s",
        "O_DIRECT tier write ÷ O_DIRECT", "O_DIRECT full tier write ÷ O_DIRECT", "O_DIRECT tier read ÷ O_DIRECT",
    ]  # fmt: skip
    rows = [
        [
            f"{row['chunk_bytes'] >> 10} KiB",
            f"{row['gbps']['raw_write']['estimate']:.2f}",
            shown(row["ratios"]["tier_write"]),
            either(row, "tier_write_full"),
            f"{row['gbps']['raw_read']['estimate']:.2f}",
            shown(row["ratios"]["tier_read"]),
            shown(row["ratios"]["tier_read_unchecked"]),
            shown(row["ratios"]["pool_read"]),
            device(row, "direct_write"),
            device(row, "direct_read"),
            either(row, "direct_tier_write"),
            either(row, "direct_tier_write_full"),
            either(row, "direct_tier_read"),
        ]
        for row in result["results"]
    ]
    config = result["config"]
    note = (
        f"- {config['keys']} chunks a batch, {config['rounds']} interleaved rounds, {config['io']}; ratios paired by "
        f"round (geometric mean, 95% interval); target tier ÷ raw >= {TARGET} for writes and checked reads; "
        "full tier: each write evicts a chunk and writes over its file; "
        "pool read: a load's whole path from disk (read threads, copy, promotion); "
        "O_DIRECT: the same raw moves past the page cache (the device's own bandwidth), and the tier's in its "
        f"`disk_io: direct` mode against them (target >= {TARGET})"
    )
    return markdown_table(headers, rows) + "\n\n" + note + "\n"


def plot(result: dict[str, Any], path: Any) -> None:
    from kvpool.benchmarks.measure.report import figure

    sizes = [row["chunk_bytes"] >> 10 for row in result["results"]]
    with figure(path, ncols=1) as (_fig, axes):
        axis = axes[0]
        for system in SYSTEMS:
            points = [(size, row["gbps"][system]["estimate"]) for size, row in zip(sizes, result["results"])
                      if system in row["gbps"]]  # fmt: skip
            if points:
                axis.plot(*zip(*points), "-o", label=system)
        axis.set(title="disk tier vs sequential I/O (page cache, and O_DIRECT)", xlabel="chunk KiB", ylabel="GB/s")
        axis.set_xscale("log")
        axis.legend(fontsize=7)


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="disk tier ÷ the disk's sequential bandwidth (same run, same I/O mode)")
    columns = (
        "chunk", "raw write GB/s", "tier write", "full tier write", "raw read GB/s", "tier read", "unchecked",
        "pool read", "O_DIRECT w / r", "O_DIRECT tier write", "O_DIRECT tier read",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    def cell(ratios: dict[str, Any], system: str) -> str:
        entry = ratios.get(system)
        if entry is None:
            return "-"
        mark = f" {entry['verdict']}" if "verdict" in entry else ""
        return f"{entry['estimate']:.2f} [{entry['low']:.2f}, {entry['high']:.2f}]{mark}"

    for row in result["results"]:
        gbps, ratios = row["gbps"], row["ratios"]

        table.add_row(
            f"{row['chunk_bytes'] >> 10} KiB",
            f"{gbps['raw_write']['estimate']:.2f}",
            cell(ratios, "tier_write"),
            cell(ratios, "tier_write_full"),
            f"{gbps['raw_read']['estimate']:.2f}",
            cell(ratios, "tier_read"),
            cell(ratios, "tier_read_unchecked"),
            cell(ratios, "pool_read"),
            " / ".join(f"{gbps[system]['estimate']:.2f}" if system in gbps else "-" for system in DIRECT[:2]),
            cell(ratios, "direct_tier_write"),
            cell(ratios, "direct_tier_read"),
        )
    Console().print(table)
