"""The hit contract's two phases, piece by piece: the embedded pool retires what leaves it while a holder
holds, the rank's tracker frees it once the scheduler acknowledged the report that withdrew it, and the
pool's live and retired bytes together never exceed its capacity."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.backends.base import Status
from kvpool.backends.memory import MemoryBackend
from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.scheduler.index import PoolIndex
from kvpool.worker.pool_tracker import PoolTracker

CHUNK = 64
SPACE = KeySpace(LayoutFingerprint("contract", "u8", 16, "numpy"))


def _key(i: int) -> str:
    return SPACE.key(i.to_bytes(16, "big"))


def _value(i: int) -> np.ndarray:
    return np.full(CHUNK, i % 251, dtype=np.uint8)


def _read(pool: MemoryBackend, key: str) -> tuple[Status, bytes]:
    out = np.zeros(CHUNK, dtype=np.uint8)
    status = pool.get_into([key], [[out]])[0]
    return status, out.tobytes()


def _held_pool(chunks: int) -> tuple[MemoryBackend, PoolTracker]:
    pool = MemoryBackend(CHUNK * chunks)
    tracker = PoolTracker(0, [SPACE], [])
    pool.add_listener(tracker.dropped)
    tracker.hold(pool, pool.hold_evictions())
    return pool, tracker


def _put(pool: MemoryBackend, tracker: PoolTracker, i: int) -> Status:
    status = pool.put([_key(i)], [[_value(i)]])[0]
    if status is Status.OK:
        tracker.stored([_key(i)])  # as the worker's save path reports it
    return status


def test_an_evicted_chunk_stays_readable_until_its_withdrawal_is_acknowledged() -> None:
    pool, tracker = _held_pool(16)
    tracker.take_report()  # seq 1: the empty start
    for i in range(14):  # 14 of the 14 live slots (16 less the reserve of 2)
        assert _put(pool, tracker, i) is Status.OK
    assert tracker.take_report().seq == 2  # type: ignore[union-attr]
    assert _put(pool, tracker, 14) is Status.OK  # evicts chunk 0, the least recently used
    assert pool.exists([_key(0)]) == [False]
    assert _read(pool, _key(0)) == (Status.OK, _value(0).tobytes())  # retired, still readable
    assert tracker.acknowledge(2) == 0, "report 2 did not withdraw it"
    report = tracker.take_report()
    assert report is not None and report.seq == 3 and report.dropped
    assert _read(pool, _key(0))[0] is Status.OK
    assert tracker.acknowledge(3) == 1
    assert _read(pool, _key(0))[0] is Status.MISSING
    assert pool.retired_bytes == 0


def test_a_retired_chunk_put_again_comes_back_and_is_not_freed_by_the_old_acknowledgement() -> None:
    pool, tracker = _held_pool(16)
    for i in range(15):
        _put(pool, tracker, i)  # chunk 0 retired
    report = tracker.take_report()
    assert report is not None
    assert _put(pool, tracker, 0) is Status.OK  # revived without a copy (it evicts chunk 1)
    assert pool.exists([_key(0)]) == [True]
    tracker.acknowledge(report.seq)
    assert _read(pool, _key(0)) == (Status.OK, _value(0).tobytes())


def test_another_engines_chunks_are_not_held() -> None:
    pool, _ = _held_pool(16)
    other = KeySpace(LayoutFingerprint("other", "u8", 16, "numpy"))
    pool.put([other.key(b"x" * 16)], [[_value(1)]])
    pool.remove([other.key(b"x" * 16)])
    assert pool.retired_bytes == 0


def test_a_closed_holder_holds_nothing() -> None:
    pool, tracker = _held_pool(16)
    for i in range(15):
        _put(pool, tracker, i)
    assert pool.retired_bytes == CHUNK
    tracker.unhold()
    assert pool.retired_bytes == 0 and _read(pool, _key(0))[0] is Status.MISSING


def test_the_scheduler_acknowledges_every_report_it_absorbs_even_from_before_a_reset() -> None:
    index = PoolIndex([[SPACE]])
    pool, tracker = _held_pool(16)
    _put(pool, tracker, 1)
    first = tracker.take_report()
    assert first is not None
    index.reset(1)  # the report's epoch (0) is stale now
    index.apply(first)
    assert index.acked == {0: first.seq}


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["put", "remove", "report", "ack"]), st.integers(0, 40)), max_size=120))
def test_live_and_retired_bytes_never_exceed_capacity(ops: list[tuple[str, int]]) -> None:
    pool, tracker = _held_pool(10)
    sent = 0
    for op, i in ops:
        if op == "put":
            _put(pool, tracker, i)
        elif op == "remove":
            pool.remove([_key(i)])
        elif op == "report":
            report = tracker.take_report()
            sent = report.seq if report is not None else sent
        else:
            tracker.acknowledge(sent)
        stats = pool.stats()
        assert stats.used_bytes <= pool.capacity_bytes, "live and retired chunks beyond the capacity"
        assert pool.retire_floor_bytes <= pool.retire_limit_bytes <= pool.retire_cap_bytes
    tracker.take_report()
    tracker.acknowledge(10**9)
    assert pool.retired_bytes == 0, "every withdrawal acknowledged: nothing stays held"


def test_the_reserve_grows_to_what_a_step_retires_so_saves_under_pressure_are_not_refused() -> None:
    """A full pool, every step a prefill of 15 chunks (it evicts 15), acknowledged a step later (the
    report leaves with the step's output): 30 chunks retired at once, against a reserve that starts at
    an eighth of 112 (14). A fixed reserve refused 55% of these puts behind `vllm serve`."""
    pool, tracker = _held_pool(112)
    sent = [tracker.take_report().seq]  # type: ignore[union-attr]
    refused = [0] * 40
    for step in range(40):
        for i in range(15):
            refused[step] += _put(pool, tracker, 15 * step + i) is not Status.OK
        assert pool.stats().used_bytes <= pool.capacity_bytes
        report = tracker.take_report()
        sent.append(report.seq if report is not None else sent[-1])
        tracker.acknowledge(sent[-2])  # the step after: the scheduler absorbed the previous step's report
    # while it grows, a few (memory is live or retired: nothing free until an acknowledgement), then none
    assert sum(refused) <= 30 and not any(refused[10:]), f"refused per step {refused}: the reserve did not grow"
    grown = pool.retire_limit_bytes
    assert pool.retire_floor_bytes < grown <= pool.retire_cap_bytes
    for _ in range(200):  # the pressure stops: every report acknowledged, the reserve gives back its growth
        report = tracker.take_report()
        tracker.acknowledge(report.seq if report is not None else sent[-1])
        pool.release(0, [])
    assert pool.retire_limit_bytes < grown
