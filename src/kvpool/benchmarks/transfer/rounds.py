"""The transfer bench's timed rounds over one batch: every path's puts and gets, in a shuffled order.

Steady state: one untimed warm-up round first; every timed put writes fresh keys and the keys are
removed after each round, outside the timed window. The embedded pool reuses a freed array of the same
size, so its timed puts land in recycled (already faulted-in) memory, as in a warm serving process.
Gets read the same stored keys every round. Paths go in a shuffled order each round, and before each
timed call a 16 MiB sweep leaves the caches as cold as an engine's forward pass leaves them between
two connector calls (so no path inherits a warmer cache from the path before it).
Figures are medians over at least `reps` rounds, more for cheap cells (until every path has 0.2 s of
samples, at most 200 rounds); bytes are counted once per batch (GB/s = 1e9 bytes/s).
"""

from __future__ import annotations

import random
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvpool.backends.base import Backend
from kvpool.benchmarks.transfer.batch import _calls, _Data, _Raw

MAX_REPS = 200
_SWEEP_BYTES = 16 << 20  # larger than the L2 caches of the machines we run on; a share of L3


class _Rounds:
    """The order of the paths in each round, shuffled (a fixed cyclic order would give every path the
    same predecessor, and with it the same cache state, round after round), and the engine's work
    between two calls: a sweep over a buffer larger than the CPU's caches, so every timed call starts
    as cold as a connector call between two forward passes does."""

    def __init__(self, paths: list[str], seed: int) -> None:
        self._paths = paths
        self._random = random.Random(seed)
        self._sweep = np.ones(_SWEEP_BYTES, dtype=np.uint8)
        self._sink = np.empty_like(self._sweep)

    def order(self) -> list[str]:
        order = list(self._paths)
        self._random.shuffle(order)
        return order

    def timed(self, call: Callable[[list[str]], Any], keys: list[str]) -> float:
        np.copyto(self._sink, self._sweep)
        began = time.perf_counter()
        call(keys)
        return time.perf_counter() - began


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return round(nbytes / statistics.median(seconds) / 1e9, 3)


def _rounds(reps: int, min_sample_s: float, samples: dict[str, list[float]]) -> Iterator[int]:
    """Round numbers, 0 being the warm-up: at least `reps` timed rounds, more while some path has
    under `min_sample_s` of samples (cheap cells get many rounds; the median settles), at most MAX_REPS."""
    rep = 0
    while rep <= reps or (rep <= MAX_REPS and min(sum(times) for times in samples.values()) < min_sample_s):
        yield rep
        rep += 1


def _measure(
    backend: Backend, raw: _Raw | None, data: _Data, reps: int, min_sample_s: float
) -> dict[str, dict[str, float]]:
    """GB/s per op ("put", "get") and per path (see _calls), and the timed rounds per op ("rounds")."""
    prefix = f"bench/{uuid.uuid4().hex[:8]}/{data.chunk_bytes}x{data.pieces}"

    def fresh(path: str, rep: int) -> list[str]:
        return [f"{prefix}/{path}/{rep}/{k}" for k in range(data.keys)]

    calls = _calls(backend, raw, data)
    paths = list(calls)
    rounds = _Rounds(paths, seed=data.chunk_bytes + data.pieces)
    times: dict[str, dict[str, list[float]]] = {op: {path: [] for path in paths} for op in ("put", "get")}
    # puts: round 0 is the warm-up (not recorded); fresh keys every round, removed afterwards
    for rep in _rounds(reps, min_sample_s, times["put"]):
        for path in rounds.order():
            keys = fresh(path, rep)
            took = rounds.timed(calls[path].put, keys)
            calls[path].remove(keys)
            if rep:
                times["put"][path].append(took)
    # gets: the same stored keys every round
    stored = {path: fresh(f"{path}-get", 0) for path in paths}
    for path in paths:
        calls[path].put(stored[path])
    try:
        for rep in _rounds(reps, min_sample_s, times["get"]):
            for path in rounds.order():
                took = rounds.timed(calls[path].get, stored[path])
                if rep:
                    times["get"][path].append(took)
            if rep == 0:
                data.check(paths)  # the warm-up reads must return the bytes written
    finally:
        for path in paths:
            calls[path].remove(stored[path])
    figures = {
        op: {path: _gbps(data.batch_bytes, samples) for path, samples in paths_.items() if samples}
        for op, paths_ in times.items()
    }
    figures["rounds"] = {op: float(len(times[op]["kvpool"])) for op in times}
    return figures
