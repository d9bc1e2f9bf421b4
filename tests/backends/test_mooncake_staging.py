"""The staged route against a remote segment: small-piece values packed into the staging buffer, moved
one piece per key over TCP, in several rounds when a batch outgrows the buffer.

The contract tests' client owns a segment, so its puts go local and are never staged; here a pure client
(no segment) writes into another client's segment, as a serving process does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvpool.backends.base import Rows, Status
from kvpool.backends.mooncake import MooncakeBackend
from kvpool.backends.mooncake.batch import _Batch, _pack, _Route

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(90)]

KiB = 1 << 10
STAGING_BYTES = 512 * KiB  # 256 KiB per direction: the batches below need several rounds


class _CountingStore:
    """The native store with its batch calls counted (the rest passes through)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls: dict[str, list[int]] = {}

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if not name.startswith("batch_"):
            return attribute

        def counted(keys: list[str], *args: Any) -> Any:
            self.calls.setdefault(name, []).append(len(keys))
            return attribute(keys, *args)

        return counted


@pytest.fixture
def pair(
    mooncake_master: Any, client_options: Callable[..., dict[str, Any]]
) -> Iterator[tuple[MooncakeBackend, _CountingStore]]:
    """A segment owner and a pure client of it; the client's native calls are counted."""
    owner = MooncakeBackend.from_options(client_options(mooncake_master, staging_bytes=0))
    reader = MooncakeBackend.from_options(
        client_options(mooncake_master, global_segment_size=0, staging_bytes=STAGING_BYTES)
    )
    counting = _CountingStore(reader._store)
    reader._store = counting
    try:
        yield reader, counting
    finally:
        reader._store = counting._store
        reader.close()
        owner.clear()
        owner.close()


def _values(count: int, sizes: list[int], seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 256, size, dtype=np.uint8) for size in sizes] for _ in range(count)]


@pytest.mark.parametrize(
    "sizes",
    [[16 * KiB] * 4, [3, 20 * KiB, 1, 7 * KiB + 5]],
    ids=["equal pieces", "odd pieces"],
)
def test_staged_remote_round_trips_are_byte_exact_over_several_rounds(
    pair: tuple[MooncakeBackend, _CountingStore], sizes: list[int]
) -> None:
    client, counting = pair
    keys = [f"staged/{len(sizes)}/{sum(sizes)}/{i}" for i in range(24)]
    values = _values(len(keys), sizes, seed=sum(sizes))
    batch = _Batch(keys, values, writable=False, staging_bytes=client._put_staging.size)
    assert batch.routes[_Route.STAGED] == list(range(len(keys))), "every value takes the staged route"
    packed = _pack(batch.totals, batch.routes[_Route.STAGED], client._put_staging.size)
    assert len(packed) >= 3

    assert client.put(keys, values) == [Status.OK] * len(keys)
    assert counting.calls == {"batch_put_from": [len(round_) for round_ in packed]}

    dests = [[np.zeros_like(piece) for piece in value] for value in values]
    assert client.get_into(keys, dests) == [Status.OK] * len(keys)
    assert len(counting.calls["batch_get_into"]) == len(packed)
    for value, dest in zip(values, dests):
        for piece, got in zip(value, dest):
            assert np.array_equal(piece, got)


def test_staged_remote_batch_keeps_per_key_results(pair: tuple[MooncakeBackend, _CountingStore]) -> None:
    """Misses, wrong sizes and duplicates in a multi-round staged batch answer per key; hits are exact."""
    client, _ = pair
    values = _values(12, [16 * KiB] * 4, seed=7)
    stored = [f"mixed/{i}" for i in range(12)]
    assert client.put(stored, values) == [Status.OK] * 12
    again = _values(1, [16 * KiB] * 4, seed=8)[0]
    assert client.put(["mixed/0", "mixed/0"], [again, again]) == [Status.OK, Status.OK]

    keys = [*stored, "mixed/absent", "mixed/3"]
    dests = [[np.zeros(16 * KiB, np.uint8) for _ in range(4)] for _ in keys]
    dests[5] = [np.zeros(16 * KiB, np.uint8) for _ in range(3)] + [np.zeros(16 * KiB - 1, np.uint8)]
    statuses = client.get_into(keys, dests)
    assert statuses[12] is Status.MISSING
    assert statuses[5] is Status.SIZE_MISMATCH
    ok = [i for i in range(len(keys)) if i not in (5, 12)]
    assert [statuses[i] for i in ok] == [Status.OK] * len(ok)
    for i in ok:
        expected = values[int(keys[i].rsplit("/", 1)[1])]
        assert all(np.array_equal(piece, got) for piece, got in zip(expected, dests[i]))


@pytest.mark.parametrize(
    "widths",
    [[16 * KiB] * 4, [2 * KiB] * 16, [1000, 20 * KiB, 3, 5000]],
    ids=["rows copied row by row", "rows gathered per layer", "both"],
)
def test_staged_remote_rows_round_trip_over_several_rounds(
    pair: tuple[MooncakeBackend, _CountingStore], widths: list[int]
) -> None:
    """A Rows batch (block ids into layer arrays) takes the same staged rounds as lists of pieces."""
    client, counting = pair
    rng = np.random.default_rng(11)
    layers = tuple(rng.integers(0, 256, (40, width), dtype=np.uint8) for width in widths)
    ids = rng.permutation(40)[:24]
    keys = [f"rows/{len(widths)}/{i}" for i in range(24)]
    batch = _Batch(keys, Rows(layers, ids), writable=False, staging_bytes=client._put_staging.size)
    assert batch.routes[_Route.STAGED] == list(range(24))
    packed = _pack(batch.totals, batch.routes[_Route.STAGED], client._put_staging.size)
    assert len(packed) >= 3

    assert client.put(keys, Rows(layers, ids)) == [Status.OK] * 24
    assert counting.calls == {"batch_put_from": [len(round_) for round_ in packed]}
    into = tuple(np.zeros_like(layer) for layer in layers)
    assert client.get_into([*keys[:5], "rows/absent", *keys[5:]], Rows(into, np.arange(25))) == (
        [Status.OK] * 5 + [Status.MISSING] + [Status.OK] * 19
    )
    read_rounds = _pack([batch.totals[0]] * 25, list(range(25)), client._get_staging.size)
    assert len(counting.calls["batch_get_into"]) == len(read_rounds)
    got = [np.concatenate([layer[row] for layer in into]) for row in (*range(5), *range(6, 25))]
    want = [np.concatenate([layer[row] for layer in layers]) for row in ids]
    assert len(got) == len(want) == 24
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    assert not any(layer[5].any() for layer in into), "the missing key's block is left as it was"


@pytest.mark.parametrize("form", ["pieces", "rows"])
def test_staged_values_go_in_place_while_the_staging_area_is_busy(
    pair: tuple[MooncakeBackend, _CountingStore], form: str
) -> None:
    """Another call holding the staging area (a save and a load on two threads) must not make this one
    wait or fail: its small-piece values take Mooncake's multi-buffer calls instead."""
    client, counting = pair
    rng = np.random.default_rng(12)
    layers = tuple(rng.integers(0, 256, (6, 16 * KiB), dtype=np.uint8) for _ in range(4))
    ids = np.array([5, 0, 3])
    keys = [f"busy/{form}/{i}" for i in range(3)]
    into = tuple(np.zeros_like(layer) for layer in layers)
    values = Rows(layers, ids) if form == "rows" else Rows(layers, ids).values()
    dests = Rows(into, ids) if form == "rows" else Rows(into, ids).values()
    with client._put_staging.lock, client._get_staging.lock:
        assert client.put(keys, values) == [Status.OK] * 3
        assert client.get_into(keys, dests) == [Status.OK] * 3
    assert set(counting.calls) == {"batch_put_from_multi_buffers", "batch_get_into_multi_buffers"}
    assert all(np.array_equal(source[ids], target[ids]) for source, target in zip(layers, into))


def test_values_in_the_own_segment_are_read_in_place_not_staged(mooncake_client: MooncakeBackend) -> None:
    """A client's own puts land in its own segment (Mooncake's memcpy path): reading them back through the
    staging area would add a copy, so small-piece values it stored are read piece by piece in place."""
    client = mooncake_client
    client.clear()
    rng = np.random.default_rng(13)
    layers = tuple(rng.integers(0, 256, (8, 16 * KiB), dtype=np.uint8) for _ in range(4))
    keys = [f"own/{i}" for i in range(4)]
    ids = np.array([1, 6, 2, 5])
    assert client.put(keys, Rows(layers, ids)) == [Status.OK] * 4
    counting = _CountingStore(client._store)
    client._store = counting
    try:
        into = tuple(np.zeros_like(layer) for layer in layers)
        assert client.get_into(keys, Rows(into, ids)) == [Status.OK] * 4
    finally:
        client._store = counting._store
        client.clear()
    assert counting.calls == {"batch_get_into_multi_buffers": [4]}
    assert all(np.array_equal(source[ids], target[ids]) for source, target in zip(layers, into))
