"""LoadWatch: which requests a failed load names, and when a finished request's blocks are still held."""

from __future__ import annotations

from kvpool.core.metadata import LoadSpec
from kvpool.scheduler.load_watch import LoadWatch, load_targets

TABLE = ([0, 11, 12, 13, 14], [21, 22, 23])  # group 0: 16-token blocks (block 0 null), group 1: 32-token


def test_targets_are_the_blocks_of_the_loaded_range_in_every_group() -> None:
    assert load_targets(TABLE, [16, 32], 16, 64) == {11, 12, 13, 22, 21}
    assert load_targets(TABLE, [16, 32], 20, 40) == {11, 12, 21, 22}  # partly covered blocks count
    assert load_targets(TABLE, [16, 32], 64, 64) == set()
    assert load_targets(TABLE, [16, 32], 0, 16) == {21}  # the null block never names a request


def test_an_async_load_waits_and_holds_its_blocks_until_reported_finished() -> None:
    watch = LoadWatch([16, 32])
    assert watch.offer(64, 16) == (48, True)
    assert watch.offer(16, 16) == (0, False)
    assert watch.offer(16, 32) == (0, False)  # the engine computed more than the pool holds
    watch.allocated("a")
    assert watch.absorb(set(), set(), ["other"]) == []
    watch.started("a", TABLE, LoadSpec(16, 64))
    assert watch.absorb(set(), set(), []) == []
    watch.allocated("b")
    assert watch.absorb(set(), set(), ["b"]) == []  # finished: its blocks are free again
    assert not watch.finish("b")
    assert watch.finish("a")  # still loading: vLLM keeps the blocks
    assert not watch.finish("a")


def test_a_preempted_request_holds_no_blocks() -> None:
    watch = LoadWatch([16])
    watch.allocated("a")
    watch.preempted("a")
    assert not watch.finish("a")


def test_a_failure_names_the_requests_whose_load_writes_an_invalid_block() -> None:
    watch = LoadWatch([16, 32])
    watch.allocated("a")
    watch.started("a", TABLE, LoadSpec(16, 32))  # blocks 11 and 21
    watch.allocated("b")
    watch.started("b", ([31, 32, 33], [41]), LoadSpec(0, 32))  # 31, 32, 41
    assert watch.absorb({32}, set(), []) == ["b"]
    assert watch.absorb({0, 12, 99}, set(), []) == []  # the null block and blocks no load writes
    assert watch.absorb(set(), {"a"}, []) == ["a"]
    assert watch.absorb({11, 41}, set(), []) == ["a", "b"]
    assert watch.absorb({11}, set(), ["a"]) == ["a"]  # failed and finished in one output
    assert watch.absorb({11}, set(), []) == []


def test_every_hit_is_an_async_load() -> None:
    """The engine waits for every load: it never computes on, caches or shares blocks a load writes
    before the load is reported (so a failed chunk never reaches an output, another request or a save)."""
    for hit, computed in ((64, 0), (64, 16), (16, 0)):
        assert LoadWatch.offer(hit, computed) == (hit - computed, True)
    assert LoadWatch.offer(16, 16) == (0, False)


def test_a_failure_reported_with_its_finish_still_names_the_request() -> None:
    """Outputs come in step order; a load is forgotten only by the output that reports it finished."""
    watch = LoadWatch([16])
    watch.allocated("a")
    watch.started("a", ([5, 6, 7],), LoadSpec(0, 48))
    watch.allocated("b")
    watch.started("b", ([8],), LoadSpec(0, 16))
    assert watch.absorb(set(), set(), ["b"]) == []
    assert watch.absorb({6}, set(), ["a"]) == ["a"]
    assert watch.absorb({6, 8}, set(), []) == []  # both reported: later outputs name other loads
