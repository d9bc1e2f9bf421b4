"""A shared pool's KV events: announced from what the workers put, once every namespace of the group has
the chunk, once, with its parent; nothing kept beyond what is still waiting."""

from __future__ import annotations

import hashlib
import pickle

from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.core.pool_reports import PoolEvent
from kvpool.scheduler.remote_events import RemoteEvents
from kvpool.worker.pool_tracker import PutTracker


def space(group: int, shard: int = 0) -> KeySpace:
    return KeySpace(LayoutFingerprint("m", "u8", 16, "t", tp_shard=shard, group_id=group))


def chunk(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def test_a_chunk_is_announced_once_both_shards_put_it_and_only_once() -> None:
    """TP 2: each rank puts its own shard's chunk (striped ranks put different chunks of one shard)."""
    shards = [space(0, 0), space(0, 1)]
    events = RemoteEvents([shards])
    ranks = [PutTracker(rank, [shards[rank]]) for rank in (0, 1)]
    ranks[0].stored([shards[0].key(chunk(1)), shards[0].key(chunk(2))], [b"", chunk(1)])
    events.apply(pickle.loads(pickle.dumps(ranks[0].take_report())))  # it crosses processes every step
    assert events.take_events() == []  # shard 1 has not put them yet
    ranks[1].stored([shards[1].key(chunk(1)), shards[1].key(chunk(2))], [b"", chunk(1)])
    events.apply(ranks[1].take_report())  # type: ignore[arg-type]
    assert events.take_events() == [PoolEvent(0, chunk(1), True, None), PoolEvent(0, chunk(2), True, chunk(1))]
    ranks[0].stored([shards[0].key(chunk(2))], [chunk(1)])  # a put again (a no-op in Mooncake)
    ranks[1].stored([shards[1].key(chunk(2))], [chunk(1)])
    events.apply(ranks[0].take_report())  # type: ignore[arg-type]
    events.apply(ranks[1].take_report())  # type: ignore[arg-type]
    assert events.take_events() == []
    assert ranks[0].take_report() is None  # nothing is kept past a report


def test_reports_from_before_a_reset_and_chunks_without_a_parent_announce_nothing() -> None:
    ns = space(0)
    events = RemoteEvents([[ns]])
    tracker = PutTracker(0, [ns])
    tracker.stored([ns.key(chunk(1))])  # no parent known: a router would take it for a prompt's start
    tracker.stored([space(1).key(chunk(5))], [b""])  # another group's namespace: not this rank's
    events.apply(tracker.take_report())  # type: ignore[arg-type]
    assert events.take_events() == []
    tracker.stored([ns.key(chunk(2))], [b""])
    late = tracker.take_report()
    events.reset(1)
    tracker.reset(1)
    events.apply(late)  # type: ignore[arg-type]
    assert events.take_events() == []


def test_what_waits_for_other_namespaces_is_bounded() -> None:
    shards = [space(0, 0), space(0, 1)]
    events = RemoteEvents([shards], limit=2)
    tracker = PutTracker(0, [shards[0]])
    tracker.stored([shards[0].key(chunk(i)) for i in range(5)], [b""] * 5)
    events.apply(tracker.take_report())  # type: ignore[arg-type]
    other = PutTracker(1, [shards[1]])
    other.stored([shards[1].key(chunk(i)) for i in range(5)], [b""] * 5)
    events.apply(other.take_report())  # type: ignore[arg-type]
    # the three oldest were forgotten while they waited: they are not announced, the last two are
    assert events.take_events() == [PoolEvent(0, chunk(i), True, None) for i in (3, 4)]
