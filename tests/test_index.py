"""The scheduler's index of the embedded pools: it equals what the ranks' pools hold."""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.backends.memory import MemoryBackend
from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.core.pool_reports import PoolEvent, PoolReport
from kvpool.scheduler.index import PoolIndex
from kvpool.worker.pool_tracker import PoolTracker


def space(group: int, shard: int = 0, pp: int = 0) -> KeySpace:
    return KeySpace(LayoutFingerprint("m", "u8", 16, "t", tp_shard=shard, pp_rank=pp, group_id=group))


def chunk(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def value() -> list[list[np.ndarray]]:
    return [[np.zeros(8, np.uint8)]]


def test_a_chunk_is_present_once_every_rank_of_every_namespace_holds_it() -> None:
    """TP 2 with two shards of two replicas each: a chunk needs both replicas of both shards."""
    shards = [space(0, s) for s in (0, 1)]
    index = PoolIndex([shards], ranks_per_namespace=2)
    index.track_events = True
    pools = {rank: MemoryBackend(1 << 20) for rank in range(4)}
    trackers = {rank: PoolTracker(rank, [shards[rank // 2]], []) for rank in range(4)}
    for rank, pool in pools.items():
        pool.add_listener(trackers[rank].dropped)
    for rank in (0, 1, 2):
        pools[rank].put([shards[rank // 2].key(chunk(7))], value())
        trackers[rank].stored([shards[rank // 2].key(chunk(7))], [b""])
        index.apply(trackers[rank].take_report())  # type: ignore[arg-type]
        assert index.present(0, [chunk(7)]) == [False]
    pools[3].put([shards[1].key(chunk(7))], value())
    trackers[3].stored([shards[1].key(chunk(7))], [b""])
    index.apply(trackers[3].take_report())  # type: ignore[arg-type]
    assert index.present(0, [chunk(7), chunk(8)]) == [True, False]
    assert index.take_events() == [PoolEvent(0, chunk(7), True, parent=None)]  # a first chunk: no parent
    pools[1].remove([shards[0].key(chunk(7))])  # any one rank dropping it withdraws it
    index.apply(trackers[1].take_report())  # type: ignore[arg-type]
    assert index.present(0, [chunk(7)]) == [False]
    assert index.take_events() == [PoolEvent(0, chunk(7), False)]


def test_a_stored_event_names_its_chunks_parent_and_a_chunk_of_unknown_parent_is_not_announced() -> None:
    """A router attaches each announced block under its parent: the index says which it is, and keeps
    quiet about a chunk it cannot place (found in a pool an earlier engine filled, parent unknown),
    which a router would otherwise take for the start of a prompt."""
    ns = space(0)
    index = PoolIndex([[ns]])
    index.track_events = True
    tracker = PoolTracker(0, [ns], [ns.key(chunk(9))])  # held before this engine: no parent known
    tracker.stored([ns.key(chunk(1)), ns.key(chunk(2))], [b"", chunk(1)])
    index.apply(tracker.take_report())  # type: ignore[arg-type]
    assert index.take_events() == [PoolEvent(0, chunk(1), True, None), PoolEvent(0, chunk(2), True, chunk(1))]
    assert index.present(0, [chunk(9)]) == [True]  # still a hit for lookups


def test_a_chunk_is_announced_with_the_link_any_rank_knows_when_the_rank_that_completes_it_does_not() -> None:
    """TP 2: rank 0 saves chunk 2 knowing its parent; rank 1 already held it (a file of the previous
    format: no parent) and reports it last. The chunk is announced, with the parent rank 0 knows."""
    shards = [space(0, s) for s in (0, 1)]
    index = PoolIndex([shards])
    index.track_events = True
    first = PoolTracker(0, [shards[0]], [])
    first.stored([shards[0].key(chunk(1)), shards[0].key(chunk(2))], [b"", chunk(1)])
    index.apply(first.take_report())  # type: ignore[arg-type]
    second = PoolTracker(1, [shards[1]], [shards[1].key(chunk(2))])  # held before: parent unknown here
    second.stored([shards[1].key(chunk(1))], [b""])
    index.apply(second.take_report())  # type: ignore[arg-type]
    assert index.present(0, [chunk(1), chunk(2)]) == [True, True]
    assert index.take_events() == [PoolEvent(0, chunk(1), True, None), PoolEvent(0, chunk(2), True, chunk(1))]


def test_a_tracker_reports_its_own_namespaces_once_and_what_the_pool_already_held() -> None:
    mine, other = space(0, 0), space(0, 1)
    pool = MemoryBackend(1 << 20)
    pool.put([mine.key(chunk(1)), other.key(chunk(1))], value() * 2)
    tracker = PoolTracker(3, [mine], pool.keys())
    pool.add_listener(tracker.dropped)
    tracker.stored([mine.key(chunk(1)), mine.key(chunk(2)), mine.key(chunk(2)), other.key(chunk(3))])
    report = tracker.take_report()
    assert report is not None and report.rank == 3
    assert report.stored == {mine.prefix: [chunk(1), chunk(2)]} and report.dropped == {}
    assert tracker.take_report() is None
    pool.clear()
    assert tracker.take_report().dropped == {mine.prefix: [chunk(1)]}  # type: ignore[union-attr]
    report = pickle.loads(pickle.dumps(report))  # it crosses processes every step
    assert report.stored[mine.prefix] == [chunk(1), chunk(2)]


def test_reports_from_before_a_reset_are_ignored() -> None:
    ns = space(0)
    index = PoolIndex([[ns]])
    tracker = PoolTracker(0, [ns], [])
    tracker.stored([ns.key(chunk(1))])
    late = tracker.take_report()
    index.reset(1)
    index.apply(late)  # type: ignore[arg-type]
    assert index.present(0, [chunk(1)]) == [False]
    tracker.reset(1)
    tracker.stored([ns.key(chunk(2))])
    index.apply(tracker.take_report())  # type: ignore[arg-type]
    assert index.present(0, [chunk(1), chunk(2)]) == [False, True]


@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "put", "remove", "clear", "report"]),
            st.integers(0, 2),
            st.integers(0, 11),
            st.booleans(),
        ),
        max_size=80,
    )
)
@settings(max_examples=300, deadline=None)
def test_the_index_equals_what_the_pools_hold(ops: list[tuple[str, int, int, bool]]) -> None:
    """Three ranks (one shard, replicated) with small LRU pools; after every report the index says a
    chunk is present exactly when every rank's pool holds it, and a prompt's leading run (the binary
    search over chained chunks, then the scan) is the run of chunks every pool holds. Chunks 0..11 are
    one chain; a put reports its parent or not (a chunk found in a pool has no known parent)."""
    ns = space(0)
    index = PoolIndex([[ns]], ranks_per_namespace=3)
    pools = [MemoryBackend(8 * 4) for _ in range(3)]  # 4 chunks each: puts evict
    trackers = [PoolTracker(rank, [ns], []) for rank in range(3)]
    for pool, tracker in zip(pools, trackers):
        pool.add_listener(tracker.dropped)

    def report_all() -> None:
        for tracker in trackers:
            report = tracker.take_report()
            if report is not None:
                index.apply(report)

    prompt = [chunk(c) for c in range(12)]
    for op, rank, i, linked in ops:
        key = ns.key(chunk(i))
        if op == "put":
            pools[rank].put([key], value())
            trackers[rank].stored([key], [(chunk(i - 1) if i else b"") if linked else None])
        elif op == "remove":
            pools[rank].remove([key])
        elif op == "clear":
            pools[rank].clear()
        else:
            report_all()
            truth = [all(pool.exists([ns.key(chunk(c))])[0] for pool in pools) for c in range(12)]
            assert index.present(0, prompt) == truth
            run = truth.index(False) if False in truth else len(truth)
            assert index.leading(0, prompt) == run
            for start in range(12):  # another prompt that shares the chain's first `start` chunks
                assert index.leading(0, [*prompt[:start], chunk(100 + start)]) == min(run, start)


@given(
    data=st.data(),
    blocks=st.sampled_from([(16,), (16, 32), (32, 16, 64)]),
)
@settings(max_examples=200, deadline=None)
def test_the_full_attention_fast_path_equals_the_general_lookup(data: st.DataObject, blocks: tuple[int, ...]) -> None:
    """All groups full attention: the index answers with one run of present chunks per group; the
    answer must be the one the general lookup (keys through exists) gives for the same contents."""
    from kvpool.core.masks import FullAttention, MaskCoordinator
    from kvpool.scheduler.scheduler_core import SchedulerCore

    kinds = [FullAttention(b) for b in blocks]
    coord = MaskCoordinator(kinds, hash_block_size=16)
    spaces = [[KeySpace(LayoutFingerprint("m", "u8", b, "t", group_id=g))] for g, b in enumerate(blocks)]
    tokens = data.draw(st.integers(1, 600), label="tokens")
    hashes = [chunk(i) for i in range(tokens // 16)]
    pool = MemoryBackend(1 << 20)
    index = PoolIndex(spaces)
    for g, kind in enumerate(kinds):
        from kvpool.core.keys import chunk_hashes

        named = chunk_hashes(hashes, 16, kind.block_size)
        held = data.draw(st.sets(st.integers(0, max(0, len(named) - 1))), label=f"group {g} holds")
        held = {c for c in held if c < len(named)}
        keys = [spaces[g][0].key(named[c]) for c in sorted(held)]
        if keys:
            pool.put(keys, value() * len(keys))
        index.apply(PoolReport(0, 0, stored={spaces[g][0].prefix: [named[c] for c in sorted(held)]}))
    fast = SchedulerCore(coord, spaces, pool.exists, index=index)
    general = SchedulerCore(coord, spaces, pool.exists)
    assert fast.longest_hit(hashes, tokens) == general.longest_hit(hashes, tokens)


def test_a_dropped_head_unchains_everything_after_it_and_its_return_rechains_them() -> None:
    ns = space(0)
    index = PoolIndex([[ns]])
    prompt = [chunk(c) for c in range(6)]
    parents = {h: (prompt[c - 1] if c else b"") for c, h in enumerate(prompt)}
    index.apply(PoolReport(0, 0, stored={ns.prefix: prompt}, parents={ns.prefix: parents}))
    assert index.leading(0, prompt) == 6
    index.apply(PoolReport(0, 0, dropped={ns.prefix: [prompt[2]]}))
    assert index.leading(0, prompt) == 2  # chunks 3..5 are held, but the search must not land past 2
    index.apply(PoolReport(0, 0, stored={ns.prefix: [prompt[2]]}, parents={ns.prefix: {prompt[2]: prompt[1]}}))
    assert index.leading(0, prompt) == 6
    index.apply(PoolReport(0, 0, dropped={ns.prefix: [prompt[0]]}))
    assert index.leading(0, prompt) == 0


@given(
    ops=st.lists(st.tuples(st.sampled_from(["put", "put", "put", "remove", "report"]), st.integers(0, 7)), max_size=60)
)
@settings(max_examples=300, deadline=None)
def test_one_rank_chains_follow_its_pool(ops: list[tuple[str, int]]) -> None:
    """One rank, a pool that holds the whole 8-chunk chain: heads come and go under the chunks after them."""
    ns = space(0)
    index = PoolIndex([[ns]])
    pool = MemoryBackend(8 * 8)
    tracker = PoolTracker(0, [ns], [])
    pool.add_listener(tracker.dropped)
    prompt = [chunk(c) for c in range(8)]
    for op, i in ops:
        key = ns.key(prompt[i])
        if op == "put":
            pool.put([key], value())
            tracker.stored([key], [prompt[i - 1] if i else b""])
        elif op == "remove":
            pool.remove([key])
        report = tracker.take_report()
        if report is not None:
            index.apply(report)
        truth = pool.exists(ns.keys(prompt))
        assert index.leading(0, prompt) == (truth.index(False) if False in truth else 8)
