"""LoadWatch: which requests a failed load names, and when a finished request's blocks are still held."""

from __future__ import annotations

from kvpool.load_watch import LoadWatch, load_targets
from kvpool.metadata import LoadSpec

TABLE = ([0, 11, 12, 13, 14], [21, 22, 23])  # group 0: 16-token blocks (block 0 null), group 1: 32-token


def test_targets_are_the_blocks_of_the_loaded_range_in_every_group() -> None:
    assert load_targets(TABLE, [16, 32], 16, 64) == {11, 12, 13, 22, 21}
    assert load_targets(TABLE, [16, 32], 20, 40) == {11, 12, 21, 22}  # partly covered blocks count
    assert load_targets(TABLE, [16, 32], 64, 64) == set()
    assert load_targets(TABLE, [16, 32], 0, 16) == {21}  # the null block never names a request


def test_an_async_load_waits_and_holds_its_blocks_until_reported_finished() -> None:
    watch = LoadWatch([16, 32], in_step=False)
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
    watch = LoadWatch([16], in_step=False)
    watch.allocated("a")
    watch.preempted("a")
    assert not watch.finish("a")


def test_a_failure_names_the_requests_whose_load_writes_an_invalid_block() -> None:
    watch = LoadWatch([16, 32], in_step=False)
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


def test_an_in_step_load_never_waits_and_is_forgotten_after_its_steps_output() -> None:
    watch = LoadWatch([16], in_step=True)
    assert watch.offer(64, 16) == (48, False)
    watch.allocated("a")
    assert not watch.finish("a")  # nothing held: the engine computes on the blocks in the load's step
    watch.started("a", ([5, 6, 7],), LoadSpec(0, 48, in_step=True))
    assert watch.absorb({6}, set(), []) == ["a"]
    watch.started("b", ([8],), LoadSpec(0, 16, in_step=True))
    assert watch.absorb(set(), set(), []) == []
    assert watch.absorb({8}, {"b"}, []) == []  # a later output is about other loads
