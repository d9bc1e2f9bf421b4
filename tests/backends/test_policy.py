"""The embedded pool's policies (core/policy/): whatever a policy admits and evicts, the scheduler's
index and the KV events equal what the pool holds, a chain never keeps its tail without its head, and
each policy does what its rule says."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.backends.base import Rows, Status
from kvpool.backends.memory import MemoryBackend
from kvpool.backends.shared_pools import drop_shared_memory_pools, policy_name, shared_memory_pool
from kvpool.core.config import KVPoolConfig
from kvpool.core.errors import ConfigError
from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.core.policy import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    AdaptivePolicy,
    ChainPolicy,
    LRUPolicy,
    make_policy,
    parent_key,
)
from kvpool.scheduler.index import PoolIndex
from kvpool.worker.pool_tracker import PoolTracker

SPACE = KeySpace(LayoutFingerprint("m", "u8", 16, "t"))
CHUNK_BYTES = 16
CHAIN_POLICIES = tuple(name for name in POLICY_NAMES if name != "lru")  # lru: kvpool's order, kept for comparison


def chunk(node: int) -> bytes:
    return hashlib.blake2b(str(node).encode(), digest_size=16).digest()


class Forest:
    """Prompts as paths in a forest of chunks: node i's parent is `parents[i]` (-1: a chain's first)."""

    def __init__(self, parents: list[int]) -> None:
        self.parents = parents

    def chain(self, node: int) -> list[int]:
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def parent_hash(self, node: int) -> bytes:
        parent = self.parents[node]
        return b"" if parent < 0 else chunk(parent)


class Rank:
    """One rank as kvpool drives it: a pool, its tracker (listener), the scheduler's index and the KV
    events it announces."""

    def __init__(self, pool: MemoryBackend) -> None:
        self.pool = pool
        self.tracker = PoolTracker(0, [SPACE], [])
        pool.add_listener(self.tracker.dropped)
        self.index = PoolIndex([[SPACE]])
        self.index.track_events = True
        self.announced: set[bytes] = set()
        self.buffer = np.zeros((64, CHUNK_BYTES), dtype=np.uint8)

    def request(self, forest: Forest, node: int) -> list[Status]:
        """The prompt ending at `node`: its hit loaded, the chunks the pool lacks saved with their parents."""
        nodes = forest.chain(node)
        keys = [SPACE.key(chunk(n)) for n in nodes]
        present = self.pool.exists(keys)
        hit = next((i for i, there in enumerate(present) if not there), len(keys))
        if hit:
            statuses = self.pool.get_into(keys[:hit], Rows((self.buffer,), np.arange(hit)))
            assert all(status is Status.OK for status in statuses)
        missing = [i for i, there in zip(range(hit, len(keys)), self.pool.exists(keys[hit:])) if not there]
        if not missing:
            return []
        parents = [forest.parent_hash(nodes[i]) for i in missing]
        statuses = self.pool.put_linked(
            [keys[i] for i in missing], Rows((self.buffer,), np.arange(len(missing))), parents
        )
        stored = [(keys[i], parent) for i, parent, status in zip(missing, parents, statuses) if status is Status.OK]
        self.tracker.stored([key for key, _ in stored], [parent for _, parent in stored])
        return statuses

    def report(self) -> None:
        report = self.tracker.take_report()
        if report is not None:
            self.index.apply(report)
        for event in self.index.take_events():
            (self.announced.add if event.stored else self.announced.discard)(event.chunk_hash)

    def check(self, forest: Forest, chain_whole: bool) -> None:
        held = {bytes.fromhex(key[len(SPACE.prefix) :]) for key in self.pool.keys()}  # noqa: SIM118 (a pool, not a dict)
        every = [chunk(n) for n in range(len(forest.parents))]
        assert self.index.present(0, every) == [h in held for h in every], "the index is not the pool"
        assert self.announced == held, "the KV events are not the pool"
        if chain_whole:
            for n in range(len(forest.parents)):
                if chunk(n) in held and forest.parents[n] >= 0:
                    assert chunk(forest.parents[n]) in held, f"chunk {n} kept without its parent"


forests = st.integers(2, 40).flatmap(
    lambda size: st.lists(st.integers(-1, size - 1), min_size=size, max_size=size).map(
        lambda raw: Forest([p if p < i else -1 for i, p in enumerate(raw)])
    )
)


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(POLICY_NAMES),
    forest=forests,
    capacity=st.integers(1, 12),
    steps=st.lists(
        st.tuples(st.sampled_from(["request"] * 8 + ["remove", "clear"]), st.integers(0, 10**6)), max_size=60
    ),
)
def test_the_index_and_the_kv_events_equal_the_pool_and_chains_keep_their_heads(
    policy: str, forest: Forest, capacity: int, steps: list[tuple[str, int]]
) -> None:
    pool = MemoryBackend(capacity * CHUNK_BYTES, make_policy(policy, capacity * CHUNK_BYTES))
    rank = Rank(pool)
    chain_whole = policy != "lru"
    for op, pick in steps:
        node = pick % len(forest.parents)
        if op == "request":
            rank.request(forest, node)
        elif op == "clear":
            pool.clear()
        else:  # a whole chain removed (a head alone removed would leave its tail by the caller's choice)
            below = {n for n in range(len(forest.parents)) if node in forest.chain(n)}
            pool.remove([SPACE.key(chunk(n)) for n in below])
        rank.report()
        rank.check(forest, chain_whole)


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(POLICY_NAMES),
    forest=forests,
    capacity=st.integers(1, 8),
    steps=st.lists(st.integers(0, 10**6), max_size=50),
)
def test_the_pool_never_holds_more_than_its_capacity_and_refuses_only_a_chain_longer_than_itself(
    policy: str, forest: Forest, capacity: int, steps: list[int]
) -> None:
    pool = MemoryBackend(capacity * CHUNK_BYTES, make_policy(policy, capacity * CHUNK_BYTES))
    rank = Rank(pool)
    for pick in steps:
        node = pick % len(forest.parents)
        statuses = rank.request(forest, node)
        assert set(statuses) <= {Status.OK, Status.DECLINED, Status.FULL}
        if Status.FULL in statuses:  # refused rather than cut a chain: only a chain longer than the pool
            assert len(forest.chain(node)) > capacity
        assert pool.stats().used_bytes <= pool.capacity_bytes
        if policy in ("lru", "chain-lru", "weighted"):
            assert Status.DECLINED not in statuses  # these admit every chunk


def test_second_sight_declines_a_chain_seen_once_when_full_and_stores_it_when_seen_again() -> None:
    forest = Forest([-1, 0, 1, -1, 3, 4, -1, 6, 7])  # three chains of three
    pool = MemoryBackend(3 * CHUNK_BYTES, make_policy("second-sight", 3 * CHUNK_BYTES))
    rank = Rank(pool)
    assert rank.request(forest, 2) == [Status.OK] * 3  # room: stored whatever the policy
    assert rank.request(forest, 5) == [Status.DECLINED] * 3  # full, never seen: not copied
    assert set(pool.keys()) == {SPACE.key(chunk(n)) for n in (0, 1, 2)}
    assert rank.request(forest, 5) == [Status.OK] * 3  # seen before: stored (the first chain evicted)
    assert set(pool.keys()) == {SPACE.key(chunk(n)) for n in (3, 4, 5)}
    rank.report()
    rank.check(forest, chain_whole=True)
    counters = pool.policy.counters()  # type: ignore[union-attr]
    assert counters.declined == 3 and counters.admitted == 6 and counters.evicted == 3
    stats = pool.stats()  # what /metrics reads (vllm:kvpool_pool_admissions_declined, _pool_evictions)
    assert (stats.admissions_declined, stats.evictions) == (3, 3)


def test_eviction_takes_a_leaf_never_a_head_whose_tail_is_held() -> None:
    """Chain 0-1-2 read again, then a new chunk: a chain policy takes the chain's tail, so its head
    still hits."""
    forest = Forest([-1, 0, 1, -1])
    for name in CHAIN_POLICIES:
        pool = MemoryBackend(3 * CHUNK_BYTES, make_policy(name, 3 * CHUNK_BYTES))
        rank = Rank(pool)
        rank.request(forest, 2)
        rank.request(forest, 2)
        rank.request(forest, 3)
        rank.request(forest, 3)  # seen again: stored under second-sight too
        held = set(pool.keys())
        assert SPACE.key(chunk(3)) in held, name
        assert SPACE.key(chunk(0)) in held and SPACE.key(chunk(2)) not in held, name


def test_weighted_eviction_keeps_what_is_read_again_over_what_never_was() -> None:
    """Two classes at the same age: chunks read again and again, chunks put once and never read. Once
    the weights are learned, new chunks push out the never-read ones first."""
    policy = ChainPolicy(weighted=True)
    pool = MemoryBackend(40 * CHUNK_BYTES, policy)
    buffer = np.zeros((40, CHUNK_BYTES), dtype=np.uint8)
    hot = [SPACE.key(chunk(n)) for n in range(20)]
    pool.put(hot, Rows((buffer,), np.arange(20)))
    for round_ in range(60):
        pool.get_into(hot, Rows((buffer,), np.arange(20)))
        cold = [SPACE.key(chunk(1000 + round_ * 20 + n)) for n in range(20)]
        pool.put(cold, Rows((buffer,), np.arange(20)))
    assert set(hot) <= set(pool.keys())


def test_adaptive_follows_the_ledger_that_hits_most() -> None:
    """A stream where every chain is seen twice in a row then never again, through a pool that holds one
    chain: admitting everything keeps the second sight's hit, declining first sights keeps nothing. The
    adaptive policy stays with (or comes back to) admitting."""
    policy = AdaptivePolicy(4 * CHUNK_BYTES)
    pool = MemoryBackend(4 * CHUNK_BYTES, policy)
    rank = Rank(pool)
    forest = Forest([(-1 if n % 4 == 0 else n - 1) for n in range(4 * 300)])
    hits = 0
    for chain in range(300):
        for _ in range(2):
            before = set(pool.keys())
            rank.request(forest, chain * 4 + 3)
            hits += sum(SPACE.key(chunk(chain * 4 + i)) in before for i in range(4))
    counters = policy.counters()
    assert counters.choice in ("chain-lru", "weighted") and counters.declined < 40
    assert hits >= 4 * 280


def test_parent_keys_follow_the_chunk_hash_in_the_key() -> None:
    key = SPACE.key(chunk(2))
    assert parent_key(key, chunk(1)) == SPACE.key(chunk(1))
    assert parent_key(key, b"") == "" and parent_key(key, None) is None
    assert parent_key("ab", chunk(1)) is None  # a key too short to hold a hash: not known


def test_a_pool_policy_is_a_setting_validated_by_name() -> None:
    assert KVPoolConfig().pool_policy == DEFAULT_POLICY
    assert KVPoolConfig.from_dict({"pool_policy": "lru"}).backend_options()["pool_policy"] == "lru"
    with pytest.raises(ConfigError, match="pool_policy"):
        KVPoolConfig.from_dict({"pool_policy": "lfu"})
    with pytest.raises(ConfigError, match="pool_policy"):
        make_policy("lfu", 1 << 20)
    assert isinstance(make_policy("lru", 1 << 20), LRUPolicy)
    assert isinstance(make_policy("adaptive", 1 << 20), AdaptivePolicy)
    assert make_policy("second-sight", 1 << 20, admission=False).second_sight is False  # type: ignore[union-attr]


def test_a_shared_pool_keeps_the_policy_it_was_created_with() -> None:
    drop_shared_memory_pools()
    try:
        pool = shared_memory_pool("t-policy", 1 << 20, "adaptive")
        assert policy_name(pool) == "adaptive"
        assert shared_memory_pool("t-policy", 1 << 20) is pool  # no policy named: whatever it has
        with pytest.raises(ConfigError, match="pool_policy"):
            shared_memory_pool("t-policy", 1 << 20, "lru")
        assert policy_name(shared_memory_pool("t-plain", 1 << 20)) == "lru"
        assert shared_memory_pool("t-plain", 1 << 20).policy is None  # plain LRU costs nothing
    finally:
        drop_shared_memory_pools()
