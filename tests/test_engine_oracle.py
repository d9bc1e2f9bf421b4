"""A fake vLLM drives the real scheduler policy (`SchedulerSteps` around `SchedulerCore`) and one
`WorkerCore` per rank over embedded pools, in the orders vLLM 0.32 calls them, and a bytes oracle
checks every block the engine computes on, every token it delivers and every chunk the pools hold.

Block bytes are a deterministic function of (rank, group, layer, chunk hash, weights version), the
chunk hash naming the whole token prefix. A chunk stored from a reused, zeroed, partial or stale
block, a block loaded with the wrong chunk, or a window block a hit left null, shows up as bytes that
its key (or the engine's position) does not name. A forward that attends to such a block computes
"tainted" KV, on every rank (tensor parallelism all-reduces, a pipeline's next stage consumes it):
the oracle fails when a tainted token reaches an output vLLM delivers, or a tainted chunk a pool.

What the fake engine models of vLLM (`Scheduler`, `KVCacheManager`, `EngineCore`,
`KVOutputAggregator`), so that each way a failed load can leak is reachable:
- the answer of `get_num_new_matched_tokens`, honoured as vLLM does: an async load waits
  (WAITING_FOR_REMOTE_KVS) until every rank reported it, its blocks neither cached nor read before,
  then only the valid prefix is cached; a sync load (kvpool no longer answers one) is cached at
  allocation and computed on in the same step;
- a local prefix cache (one full-attention group): full blocks keyed by the chain hash, cached when
  allocated, hit by later requests of the same `schedule()` pass and of later steps, ref counted,
  evicted only on reuse; under the recompute policy an invalid block of a sync load stays cached;
- the batch queue: async scheduling (step N+1 scheduled before step N's output is absorbed, with
  placeholder tokens) or pipeline parallelism of depth 2; failed loads recompute from the first
  invalid block (`_update_requests_with_invalid_blocks`) or the whole request (`failed_recving`);
- tensor parallelism 2: a pool per rank, per-rank load outcomes, invalid blocks unioned and a load
  finished once both ranks reported it;
- `reset_prefix_cache(reset_running_requests=True)`: every running request preempted and re-admitted
  in the next `schedule()` (whose output also lists it preempted), refused (vLLM raises) while a
  request holds blocks waiting for a load; with or without `reset_connector`.
The interleavings are random: new requests, chunked prefill, decode, preemption and resume, abort
and finish, loads that fail or race an eviction on one rank or both, resets, and block reuse with
either model runner's order of zeroing new blocks and calling the connector's pre-forward hook.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.backends.base import Status, Values
from kvpool.backends.memory import MemoryBackend
from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.core.masks import AttentionKind, ChunkedLocal, FullAttention, MaskCoordinator, SlidingWindow
from kvpool.core.metadata import StepMetadata
from kvpool.core.plan import GroupPlacement
from kvpool.core.pool_reports import PoolReport
from kvpool.scheduler.index import PoolIndex
from kvpool.scheduler.scheduler_core import SchedulerConfig, SchedulerCore
from kvpool.scheduler.steps import SchedulerSteps
from kvpool.worker.layout import KVLayout
from kvpool.worker.pool_tracker import PoolTracker
from kvpool.worker.worker_core import WorkerConfig, WorkerCore

B = 16  # every group's block size and the hash block size
LAYERS = 2
ROW = 8  # bytes of one block in one layer
NUM_BLOCKS = 40  # block 0 is the null block
VOCAB = 4  # few distinct tokens: prompts share prefixes, so chunks are reused across requests
TEARDOWN_STEPS = 24  # engine steps at teardown for every pending load to be reported
# the hit contract's second phase: a rank frees what it withdrew only once the scheduler acknowledged the
# report; a mutation that frees at eviction (False) must make the oracle fail
HOLD_EVICTIONS = True


def digest(*parts: object) -> bytes:
    return hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=ROW).digest()


def chain(tokens: Sequence[int]) -> list[bytes]:
    """vLLM-style chained block hashes: hash i names tokens [0, (i + 1) * B)."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - B + 1, B):
        parent = hashlib.blake2b(parent + bytes(tokens[start : start + B]), digest_size=16).digest()
        hashes.append(parent)
    return hashes


@dataclass(eq=False)
class Req:
    rid: str
    tokens: list[int]  # prompt and every output it will produce (greedy, fixed up front)
    prompt: int
    known: int  # tokens the scheduler knows: the prompt, then one more per delivered output
    tables: list[list[int]]
    computed: int = 0  # vLLM's num_computed_tokens: advanced when a step is scheduled
    placeholders: int = 0  # async scheduling: tokens sampled by steps not absorbed yet
    status: str = "waiting"  # waiting | loading (WAITING_FOR_REMOTE_KVS) | running | finishing
    load_done: bool = False  # its async load was reported finished by every rank
    load_failed: bool = False  # vLLM's failed_recving_kv_req_ids
    restart: bool = True  # its next scheduling sends the whole block table (new or resumed)
    scheduled_before: bool = False  # vLLM lists it in scheduled_new_reqs until its first step
    sent: list[int] = field(default_factory=list)  # per group, the table length its last step saw
    in_flight: int = 0  # steps scheduled for it whose output is not absorbed yet
    stale: int = 0  # of those, scheduled before its last preemption
    drop_stale: bool = False  # preempted by a reset: its stale outputs are dropped, not delivered
    preemptions: int = 0
    load_start: int = 0  # its async load's first token (what the engine had computed itself)
    hash_memo: tuple[int, list[bytes]] = (-1, [])


@dataclass
class Run:
    """One request's share of a step, as scheduled."""

    req: Req
    start: int
    n: int
    tables: list[list[int]]  # its block table when scheduled (the worker executes on that)
    samples: bool  # the step reaches its last token: it samples the next one
    tainted: bool = False


@dataclass
class Step:
    number: int
    meta: StepMetadata
    runs: list[Run]
    scheduled: dict[str, int]  # vLLM's num_scheduled_tokens
    new_blocks: list[int]
    finished: list[str]  # vLLM's finished_req_ids: the workers forget these after the step
    sync_loads: bool  # has_sync_kv_loads: loads start before the forward
    finished_loads: set[str] = field(default_factory=set)  # aggregated over the ranks
    invalid_blocks: set[int] = field(default_factory=set)
    failed_requests: set[str] = field(default_factory=set)
    reports: list[PoolReport] = field(default_factory=list)  # the ranks' pool reports (build_connector_worker_meta)


SENDER, LOADER = "kvpool-sender", "kvpool-load"  # the worker's thread names, by prefix


class FlakyPool(MemoryBackend):
    """The embedded pool, with gets that can be told to fail. The worker's own threads (sender, loader)
    wait at a gate the engine opens, for one kind of thread at a time, at fixed points of a step: they
    lag behind the engine as far as they can, yet every run of a test case sees the same pool, so
    hypothesis can replay it (a sender let through while the engine waits only for loads would put a
    timing-dependent share of its batch)."""

    fail_gets = 0

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._gate = threading.Condition()
        self._open: tuple[str, ...] = ()  # name prefixes of the threads let through now
        self.gated_threads: tuple[str, ...] = (SENDER, LOADER)  # name prefixes of the threads that wait

    def let_through(self, threads: tuple[str, ...]) -> None:
        with self._gate:
            self._open = threads
            self._gate.notify_all()

    def _wait(self) -> None:
        name = threading.current_thread().name
        if name.startswith(self.gated_threads):
            with self._gate:
                opened = self._gate.wait_for(lambda: not self.gated_threads or name.startswith(self._open), 10)
            assert opened, "the engine never let the worker's thread through"

    def put(self, keys: Sequence[str], values: Values) -> list[Status]:
        self._wait()
        return super().put(keys, values)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._wait()  # a save's check before its put: not racing the engine's evictions either
        return super().exists(keys)

    def get_into(self, keys: Sequence[str], dests: Values) -> list[Status]:
        self._wait()
        if self.fail_gets:
            self.fail_gets -= 1
            raise ConnectionError("scripted get failure")
        return super().get_into(keys, dests)


@dataclass
class Rank:
    """One TP rank (or PP stage): its own KV tensors, embedded pool and worker."""

    index: int
    pool: FlakyPool
    tensors: dict[str, np.ndarray]
    worker: WorkerCore
    epoch: int = 0  # the last reset this rank's worker has seen
    # what this rank's get_finished / get_block_ids_with_load_errors report later than the other's
    held: tuple[set[str], set[int], set[str]] = field(default_factory=lambda: (set(), set(), set()))


class EngineOracle(RuleBasedStateMachine):
    kinds: Sequence[AttentionKind] = (FullAttention(B),)

    def make_steps(self, core: SchedulerCore) -> SchedulerSteps:
        """The scheduler role's per-step policy (what vLLM's connector adapter delegates to)."""
        return SchedulerSteps(core)

    @initialize(
        sync_saves=st.booleans(),
        sync_loads=st.booleans(),
        runner=st.sampled_from(["v1", "v2"]),
        reset_reaches_worker=st.booleans(),
        batching=st.sampled_from(["sync", "async", "async", "pp2"]),
        num_ranks=st.sampled_from([1, 2]),
        local_cache=st.sampled_from([True, True, False]),
        shared_pool=st.booleans(),
        in_step=st.sampled_from([False, True, True]),
        in_step_chunks=st.sampled_from([1, 3, 64]),
    )
    def setup(
        self,
        sync_saves: bool,
        sync_loads: bool,
        runner: str,
        reset_reaches_worker: bool,
        batching: str,
        num_ranks: int,
        local_cache: bool,
        shared_pool: bool = False,
        in_step: bool = False,
        in_step_chunks: int = 64,
    ) -> None:
        self.runner = runner
        self.reset_reaches_worker = reset_reaches_worker  # the worker told at once, or at its next step
        # vLLM's batch queue: async scheduling and PP both schedule step N+1 before absorbing step N;
        # only async scheduling schedules a decode on the placeholder of the token N samples
        self.depth = 1 if batching == "sync" else 2
        self.async_scheduling = batching == "async"
        event(f"batching: {batching}, {num_ranks} rank(s)")
        self.coord = MaskCoordinator(list(self.kinds))
        # vLLM's local prefix cache; one full-attention group (`_handle_invalid_blocks` refuses more)
        self.caching = local_cache and len(self.kinds) == 1 and type(self.kinds[0]) is FullAttention
        self.spaces = [
            KeySpace(LayoutFingerprint("oracle", "u8", kind.block_size, "numpy", group_id=g))
            for g, kind in enumerate(self.kinds)
        ]
        # the hit contract: lookups read the scheduler's index, made of the ranks' pool reports (as with the
        # embedded pool), and contract hits load in-step within a budget of `in_step_chunks` chunks a step
        self.in_step = in_step and not shared_pool  # an embedded pool (a shared one is Mooncake: async)
        self.index = (
            PoolIndex([[space] for space in self.spaces], ranks_per_namespace=num_ranks) if self.in_step else None
        )
        if self.in_step:
            event(f"in-step loads, {in_step_chunks} chunks a step")
        self.ranks: list[Rank] = []
        for index in range(num_ranks):
            tensors = {
                f"g{g}.l{layer}": np.zeros((NUM_BLOCKS, ROW), dtype=np.uint8)
                for g in range(len(self.kinds))
                for layer in range(LAYERS)
            }
            layout = KVLayout(tensors, {name: int(name[1 : name.index(".")]) for name in tensors}, NUM_BLOCKS)
            pool = FlakyPool(LAYERS * ROW * 48)  # smaller than the engine: the pool evicts
            tracker = None
            if self.in_step:
                tracker = PoolTracker(index, [KeySpace(space.fingerprint) for space in self.spaces], pool.keys())
                pool.add_listener(tracker.dropped)
                if HOLD_EVICTIONS:
                    tracker.hold(pool, pool.hold_evictions())
            worker = WorkerCore(
                pool,
                self.coord,
                # the worker's own key spaces, as in its own process: it learns a rename from the step's metadata
                [GroupPlacement(KeySpace(space.fingerprint)) for space in self.spaces],
                layout,
                # the sender takes its batches only when the engine lets it through (`_let_through` drains
                # it): taken whenever its thread happened to wake, the batches it merges into one put, and
                # so the pool's LRU order, would depend on timing, and hypothesis could not replay a case
                WorkerConfig(
                    # an in-step load reads in the engine's call: the embedded pool without a disk tier
                    put_batch_chunks=4, sync_saves=sync_saves, sync_loads=sync_loads or self.in_step,
                    save_linger_steps=1 << 30, save_linger_s=1e9,
                    # a shared pool keeps the old weights' chunks at an in-place update: only their names differ
                    shared_pool=shared_pool,
                ),
                tracker=tracker,
            )
            if tracker is not None:
                # the tracker's key spaces are the worker's own (a rename reaches both)
                tracker.rename([placement.keys for placement in worker.placements])
            worker.saves.sender.enough_chunks = worker.saves.sender.enough_bytes = 1 << 62
            if worker.loads.loader._calls is not None:
                # one call thread: loads let through together then read in the order they started, so
                # which one meets a scripted get failure does not depend on how threads are scheduled
                worker.loads.loader._calls.shutdown()
                worker.loads.loader._calls = ThreadPoolExecutor(1, thread_name_prefix="kvpool-load-call")
            self.ranks.append(Rank(index, pool, tensors, worker))
        chunk_bytes = LAYERS * ROW
        self.scheduler = SchedulerCore(
            self.coord,
            [[space] for space in self.spaces],
            self.exists,
            # a lookup's answer is reused for the request until it changes (never by the clock: replayable)
            SchedulerConfig(
                save_decode=True,
                lookup_cache_s=1e9,
                in_step_bytes=in_step_chunks * chunk_bytes if self.in_step else 0,
                in_step_bytes_per_token=chunk_bytes / B,
            ),
            index=self.index,
        )
        if self.index is not None:
            for rank in self.ranks:  # what the pools hold at start-up (the scheduler reads its own worker's)
                report = rank.worker.tracker.take_report()  # type: ignore[union-attr]
                if report is not None:
                    self.index.apply(report)
        self.policy = self.make_steps(self.scheduler)
        self.version = 0  # the weights: a reset with reset_connector may change them
        # pool key -> (group, chunk hash, the weights its name was built under)
        self.key_names: dict[str, tuple[int, bytes, int]] = {}
        # the engine's block pool: ref counts, the free queue (evicted from the front), cached hashes
        self.ref = [0] * NUM_BLOCKS
        self.free: list[int] = list(range(1, NUM_BLOCKS))
        self.block_hash: dict[int, bytes] = {}
        self.by_hash: dict[bytes, dict[int, None]] = {}
        self.cached_in_pass: dict[int, int] = {}  # block -> the schedule() pass that cached it
        self.loaded_blocks: set[int] = set()  # cached blocks a pool load filled
        self.requests: dict[str, Req] = {}
        self.running: list[Req] = []  # vLLM's running queue, in order
        self.waiting: list[Req] = []  # vLLM's waiting queues (blocks holders are drained first)
        self.queue: deque[Step] = deque()  # steps executed, their output not absorbed yet
        self.count = 0
        self.passes = 0
        self.preempted: list[str] = []  # listed in the next SchedulerOutput's preempted_req_ids
        self.finished_ids: list[str] = []  # the next SchedulerOutput's finished_req_ids
        self.recv_counts: Counter[str] = Counter()  # KVOutputAggregator: ranks that reported a load
        self.failed_pending: set[str] = set()
        self.history: list[list[int]] = []  # every request's tokens: later prompts share their prefixes
        self.loads_started: Counter[str] = Counter()
        self.loads_reported: Counter[str] = Counter()

    def exists(self, keys: list[str]) -> list[bool]:
        """A chunk is a hit only when every rank's pool holds its shard."""
        found = [rank.pool.exists(keys) for rank in self.ranks]
        return [all(flags) for flags in zip(*found)]

    # ---- the engine's memory ----------------------------------------------------------------------

    def expected(self, rank: int, group: int, req: Req, chunk: int, upto: int) -> list[bytes]:
        """Per layer: the bytes of `chunk` once `upto` tokens are computed (full or still partial)."""
        end = (chunk + 1) * B
        if end <= upto:
            name: object = chain(req.tokens[:end])[-1].hex()
        else:
            name = "partial:" + hashlib.blake2b(bytes(req.tokens[:upto])).hexdigest()
        return [digest(rank, group, layer, name, self.version) for layer in range(LAYERS)]

    def block(self, rank: Rank, group: int, block_id: int) -> list[bytes]:
        return [rank.tensors[f"g{group}.l{layer}"][block_id].tobytes() for layer in range(LAYERS)]

    def hashes(self, req: Req) -> list[bytes]:
        """vLLM's request.block_hashes: full blocks of the tokens the scheduler knows."""
        if req.hash_memo[0] != req.known:
            hashes = chain(req.tokens[: req.known])
            self._name(hashes)
            req.hash_memo = (req.known, hashes)
        return req.hash_memo[1]

    def _name(self, hashes: Sequence[bytes]) -> None:
        for g, space in enumerate(self.spaces):
            for h in hashes:
                self.key_names[space.key(h)] = (g, h, self.version)

    def table(self, req_id: str) -> tuple[list[int], ...] | None:
        """vLLM's kv_connector_block_state / KVCacheManager.get_block_ids."""
        req = self.requests.get(req_id)
        return None if req is None else tuple(list(t) for t in req.tables)

    def _take(self) -> int:
        block_id = self.free.pop(0)
        cached = self.block_hash.pop(block_id, None)
        if cached is not None:  # evicted from the prefix cache on reuse
            del self.by_hash[cached][block_id]
            if not self.by_hash[cached]:
                del self.by_hash[cached]
            self.loaded_blocks.discard(block_id)
        self.ref[block_id] = 1
        return block_id

    def _touch(self, block_id: int) -> None:
        if self.ref[block_id] == 0:
            self.free.remove(block_id)
        self.ref[block_id] += 1

    def _unref(self, block_id: int) -> None:
        self.ref[block_id] -= 1
        if self.ref[block_id] == 0:
            self.free.append(block_id)

    def allocate(self, req: Req, upto: int, skip_below: int = 0, local: Sequence[int] = ()) -> list[int] | None:
        """Blocks for every chunk below ceil(upto / B), after the `local` prefix-cache hit (group 0); a
        freeing group gets null below its first live chunk at `skip_below` tokens. None: not enough
        free blocks (nothing taken), as `allocate_slots` answers."""
        plan = []
        for g, kind in enumerate(self.kinds):
            have = len(req.tables[g]) + (len(local) if g == 0 else 0)
            first_live = kind.first_live_chunk(skip_below) if kind.frees_blocks else 0
            for chunk in range(have, -(-upto // B)):
                plan.append((g, chunk < first_live))
        touched_free = sum(1 for block_id in local if self.ref[block_id] == 0)
        if sum(not null for _, null in plan) > len(self.free) - touched_free:
            return None
        for block_id in local:
            self._touch(block_id)
            req.tables[0].append(block_id)
        new = []
        for g, null in plan:
            block_id = 0 if null else self._take()
            req.tables[g].append(block_id)
            if block_id:
                new.append(block_id)
        return new

    def cache(self, req: Req, upto: int, loaded_from: int | None = None) -> None:
        """KVCacheManager.cache_blocks: the full blocks below `upto` tokens become local hits."""
        if not self.caching:
            return
        hashes = self.hashes(req)
        table = req.tables[0]
        for chunk in range(min(upto // B, len(hashes), len(table))):
            block_id = table[chunk]
            if block_id and block_id not in self.block_hash:
                self.block_hash[block_id] = hashes[chunk]
                self.by_hash.setdefault(hashes[chunk], {})[block_id] = None
                self.cached_in_pass[block_id] = self.passes
                if loaded_from is not None and chunk * B >= loaded_from:
                    self.loaded_blocks.add(block_id)

    def local_hit(self, req: Req) -> list[int]:
        """KVCacheManager.get_computed_blocks: the longest run of cached blocks, below the last token."""
        if not self.caching:
            return []
        blocks: list[int] = []
        for h in self.hashes(req)[: (req.known - 1) // B]:
            cached = self.by_hash.get(h)
            if not cached:
                break
            blocks.append(next(iter(cached)))
        return blocks

    def release(self, req: Req) -> None:
        for table in req.tables:
            for block_id in reversed(table):  # vLLM frees the tail first: evicted first
                if block_id:
                    self._unref(block_id)
        req.tables = [[] for _ in self.kinds]

    def slide(self, req: Req) -> None:
        """vLLM frees a window's blocks once no future token can attend to them."""
        for g, kind in enumerate(self.kinds):
            if kind.frees_blocks:
                table = req.tables[g]
                for chunk in range(min(len(table), kind.first_live_chunk(req.computed))):
                    if table[chunk]:
                        self._unref(table[chunk])
                        table[chunk] = 0

    # ---- rules ------------------------------------------------------------------------------------

    @rule(data=st.data())
    def new_request(self, data: st.DataObject) -> None:
        """New requests: most share a prefix with an earlier one; a burst shares one long system prompt
        (admitted in one schedule() pass, they take local hits on each other's blocks)."""
        prompt = data.draw(st.integers(8, 144), label="prompt")
        total = prompt + data.draw(st.integers(1, 40), label="outputs")
        tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=total, max_size=total), label="tokens")
        if self.history and data.draw(st.sampled_from([True, True, False]), label="shares a prefix"):
            other = data.draw(st.sampled_from(self.history), label="with")
            most = min(len(other), total)
            shared = data.draw(st.one_of(st.just(most), st.integers(min(B, most), most)), label="shared")
            tokens[:shared] = other[:shared]
        for copy in range(data.draw(st.sampled_from([1, 1, 1, 2, 3]), label="burst")):
            if copy:
                tail = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40), label="its own")
                tokens = tokens[:prompt] + tail
            self.history.append(tokens)
            rid = f"r{self.count}"
            self.count += 1
            req = Req(rid, tokens, prompt, prompt, tables=[[] for _ in self.kinds])
            self.requests[rid] = req
            self.waiting.append(req)

    @rule(
        budgets=st.lists(st.integers(8, 96), min_size=1, max_size=4),
        evict_before_load=st.sampled_from([False, False, True]),
        fail_gets=st.sampled_from([0, 0, 1]),
        on_ranks=st.sampled_from(["all", "first", "last"]),
        lag=st.sampled_from([(), (), (0,), (1,)]),
        reset_after=st.sampled_from([None] * 5 + [False, False, True]),
    )
    def steps(
        self,
        budgets: list[int],
        evict_before_load: bool,
        fail_gets: int,
        on_ranks: str,
        lag: tuple[int, ...],
        reset_after: bool | None,
    ) -> None:
        """Engine steps; a load's chunk lost between lookup and load, or its get failing, on one rank
        or all; a rank reporting its loads a step after the other; then maybe a reset
        (`reset_after`: whether it resets the connector too)."""
        failing = self.ranks if on_ranks == "all" else [self.ranks[0 if on_ranks == "first" else -1]]
        for budget in budgets:
            self.engine_step(budget, failing if evict_before_load else [], fail_gets, failing, lag)
        if reset_after is not None:
            self.reset(reset_connector=reset_after)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        req = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        if req.status != "finishing":
            self.finish(req)

    def reset(self, reset_connector: bool) -> None:
        """`reset_prefix_cache(reset_running_requests=True, reset_connector=...)`, between steps (with a
        step in flight under async scheduling); with reset_connector, around a weights update."""
        if not self._reset_engine() or not reset_connector:
            return
        event("reset: connector too (new weights)")
        self.scheduler.reset()
        for rank in self.ranks:
            if self.reset_reaches_worker:
                # a put held at the gate is not waited for: it is removed once it lands
                rank.worker.reset(self.scheduler.reset_epoch, wait_s=0.01)
                rank.epoch = self.scheduler.reset_epoch
            else:
                rank.pool.clear()  # the worker learns it at its next step, before that step's loads
        self.version += 1
        self._rename_all()

    def _rename_all(self) -> None:
        """The weights changed: the names requests' hashes take under the new weights (the same keys after
        a reset of the connector, which emptied the pools; new ones after an in-place update)."""
        for req in self.requests.values():
            self._name(req.hash_memo[1])

    def _reset_engine(self) -> bool:
        """The engine's part of a reset with running requests; False: vLLM refused it."""
        event("reset: running requests preempted")
        while self.running:  # vLLM pops from the end, and prepends each to the waiting queue
            self.preempt(self.running[-1], drop_stale=True)
        if any(any(req.tables) for req in self.requests.values()):
            # KVCacheManager.reset_prefix_cache fails while blocks are held: vLLM raises RuntimeError
            event("reset refused: a request holds blocks waiting for its KV load")
            return False
        self.block_hash.clear()
        self.by_hash.clear()
        self.loaded_blocks.clear()
        return True

    @rule()
    def update_weights(self) -> None:
        """An in-place weight update (vLLM `reload_weights`, the RL weight transfer) with the engine's own
        `reset_prefix_cache(reset_running_requests=True)` an RL loop makes around it, without resetting the
        connector: kvpool hears of it from the engine core before the call (`SchedulerSide.weights_changed`),
        its workers at their next step; the pools keep the old weights' chunks under the old names."""
        if not self._reset_engine():
            return  # refused: the loop retries before it updates
        event("weights updated in place")
        self.version += 1
        self.scheduler.change_weights(f"w{self.version}")
        self._rename_all()

    @rule()
    def settle(self) -> None:
        """The workers' threads catch up; what they finished is reported at the next step."""
        for rank in self.ranks:
            self._let_through(rank)

    # ---- the engine loop (EngineCore.step / step_with_batch_queue) --------------------------------

    def has_work(self) -> bool:
        return bool(self.requests or self.finished_ids or self.preempted)

    def engine_step(
        self,
        budget: int,
        evict_on: Sequence[Rank] = (),
        fail_gets: int = 0,
        fail_on: Sequence[Rank] = (),
        lag: Sequence[int] = (),
    ) -> None:
        """Schedule and execute a step; absorb the oldest step's output once the batch queue is full."""
        if self.has_work():
            step = self.schedule(budget)
            self.execute(step, evict_on, fail_gets, fail_on, lag)
            self.queue.append(step)
            if len(self.queue) < self.depth:
                return
        if self.queue:
            self.absorb(self.queue.popleft())

    def schedule(self, budget: int) -> Step:
        """Scheduler.schedule: running requests first (preempting the last on a full cache), then, if
        none was preempted, waiting ones (those holding blocks first); then build_connector_meta."""
        self.passes += 1
        runs: list[Run] = []
        scheduled: dict[str, int] = {}
        new_blocks: list[int] = []
        sync_loads = False
        preempted_now = False
        for req in self.running:
            self.slide(req)
        for req in list(self.running):
            if req.status != "running":
                continue
            if budget <= 0:
                break
            if req.placeholders and req.computed + 2 - req.placeholders >= len(req.tokens):
                continue  # async scheduling: the step in flight samples its last token
            n = min(budget, req.known + req.placeholders - req.computed)
            if n <= 0:
                continue  # PP: its tokens are all in a step in flight
            blocks = self.allocate(req, req.computed + n)
            while blocks is None:
                victim = self.running[-1]
                self.preempt(victim)
                preempted_now = True
                if victim is req:
                    break
                blocks = self.allocate(req, req.computed + n)
            if blocks is None:
                continue
            budget -= n
            new_blocks += blocks
            self._run(req, n, runs, scheduled)
        holding = [r for r in self.waiting if r.status == "loading" or any(r.tables)]
        for req in [] if preempted_now else holding + [r for r in self.waiting if r not in holding]:
            if budget <= 0:
                break
            if req.status == "loading":
                if not req.load_done:
                    continue  # still WAITING_FOR_REMOTE_KVS
                self._loaded(req)
            if req.stale and not req.drop_stale:
                continue  # its in-flight output is delivered first
            admitted = self._admit(req, budget, runs, scheduled)
            if admitted is None:
                continue
            if admitted is False:
                break  # vLLM admits a request only when its blocks fit
            n, blocks, sync = admitted
            budget -= n
            new_blocks += blocks
            sync_loads |= sync
        meta = self.policy.begin(self.preempted, self.table)
        self.preempted = []
        new_first = [run for run in runs if not run.req.scheduled_before] + [
            run for run in runs if run.req.scheduled_before
        ]
        for run in new_first:
            req = run.req
            whole = req.restart or not self.scheduler.started(req.rid)
            self.policy.add(
                meta,
                req.rid,
                num_prompt_tokens=req.prompt,
                block_hashes=self.hashes(req),
                # as vLLM's scheduler output: the whole table on a (re)start, else the blocks appended since
                new_blocks=run.tables if whole else [t[s:] for t, s in zip(run.tables, req.sent)],
                whole_table=whole,
                computed_before=run.start,
                new_tokens=run.n,
            )
            req.restart, req.scheduled_before = False, True
            req.sent = [len(table) for table in run.tables]
        finished, self.finished_ids = self.finished_ids, []
        return Step(self.passes, meta, runs, scheduled, new_blocks, finished, sync_loads)

    def _admit(
        self, req: Req, budget: int, runs: list[Run], scheduled: dict[str, int]
    ) -> tuple[int, list[int], bool] | bool | None:
        """One waiting request: (tokens scheduled, new blocks, sync load?); None: skipped this pass;
        False: its blocks do not fit."""
        local_blocks: list[int] = []
        if req.computed == 0:
            local_blocks = self.local_hit(req)
            local = len(local_blocks) * B
            ext, load_async = self.policy.matched(req.rid, self.hashes(req), req.known, local)
            if ext is None:
                return None  # not known yet: asked again next pass
            assert not load_async or ext > 0, f"{req.rid}: an async load of nothing"
            computed = local + ext
        else:  # its async load finished: no lookup, no matched tokens
            ext, load_async, computed = 0, False, req.computed
        assert computed < req.known, f"{req.rid}: {computed} of {req.known} tokens offered: nothing left to compute"
        n = 0 if load_async else min(budget, req.known - computed)
        blocks = self.allocate(req, computed + n, skip_below=computed, local=local_blocks)
        if blocks is None:
            return False
        if any(self.cached_in_pass.get(block_id) == self.passes for block_id in local_blocks):
            event("route 2: a local hit on blocks cached earlier in the same schedule() pass")
        if any(block_id in self.loaded_blocks for block_id in local_blocks):
            event("route 3: a local hit on blocks a pool load filled in an earlier step")
        if ext and req.rid in self.preempted:
            event("reset: re-admitted with a pool load in the pass that lists its preemption")
        self.policy.allocated(req.rid, req.prompt, self.hashes(req), ext)
        req.computed = computed
        if load_async:
            event("async load")
            req.status, req.load_start = "loading", local
            self.loads_started[req.rid] += 1
            return 0, blocks, False
        if ext:
            event("sync load: computed on in the step that loads it")
        self.waiting.remove(req)
        self.running.append(req)
        req.status = "running"
        self._run(req, n, runs, scheduled)
        return n, blocks, bool(ext)

    def _loaded(self, req: Req) -> None:
        """Scheduler._update_waiting_for_remote_kv: cache the valid prefix, or free the blocks."""
        if req.load_failed:
            req.load_failed = False
            if req.computed:
                self.cache(req, req.computed, loaded_from=req.load_start)
            else:
                self.release(req)
                req.restart = True
        else:
            self.cache(req, req.computed, loaded_from=req.load_start)
        if req.computed == req.known:
            req.computed = req.known - 1
        req.status, req.load_done = "waiting", False

    def _run(self, req: Req, n: int, runs: list[Run], scheduled: dict[str, int]) -> None:
        samples = req.computed + n == req.known + req.placeholders
        runs.append(Run(req, req.computed, n, [list(table) for table in req.tables], samples))
        scheduled[req.rid] = n
        req.computed += n
        req.in_flight += 1
        if samples and self.async_scheduling:
            req.placeholders += 1
        self.cache(req, min(req.computed, req.known))  # allocate_slots caches the blocks it fills

    def preempt(self, req: Req, drop_stale: bool = False) -> None:
        """Scheduler._preempt_request: free the blocks (they stay cached), back to the waiting queue's front."""
        event("preemption")
        self.running.remove(req)
        self.release(req)
        req.status, req.computed, req.placeholders, req.restart = "waiting", 0, 0, True
        req.drop_stale = drop_stale or (req.drop_stale and req.stale > 0)
        req.stale = req.in_flight
        req.preemptions += 1
        self.waiting.insert(0, req)
        self.preempted.append(req.rid)

    def finish(self, req: Req) -> None:
        """Finished or aborted: the connector decides whether vLLM keeps the blocks for a load."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.finished_ids.append(req.rid)
        if self.policy.finished(req.rid):
            req.status = "finishing"  # vLLM frees the blocks once finished_recving names it
            return
        assert not (req.status == "loading" and not req.load_done), (
            f"{req.rid}: vLLM frees blocks that its load still writes"
        )
        self.release(req)
        del self.requests[req.rid]

    # ---- the workers ------------------------------------------------------------------------------

    def execute(
        self, step: Step, evict_on: Sequence[Rank], fail_gets: int, fail_on: Sequence[Rank], lag: Sequence[int]
    ) -> None:
        """Every rank runs the step in order; one forward over all ranks; outputs aggregated."""
        meta = step.meta
        for rank in self.ranks:
            if meta.reset_epoch > rank.epoch:
                # this step empties the pool after the puts in flight: a remote pool answers them meanwhile
                self._let_through(rank)
                rank.epoch = meta.reset_epoch
        for delta in meta.requests:
            if delta.load is not None and evict_on:  # lost between the lookup and the load
                req = self.requests.get(delta.req_id)
                if req is not None and delta.load.hit_tokens:
                    key = self.spaces[-1].key(chain(req.tokens[: delta.load.hit_tokens])[-1])
                    for rank in evict_on:
                        rank.pool.remove([key])
        for rank in fail_on:
            # an in-process pool's read cannot fail (no I/O): with the hit contract no get is scripted to
            rank.pool.fail_gets = 0 if self.in_step else fail_gets
        for rank in self.ranks:
            if self.runner == "v2":  # Model Runner V2 zeroes new blocks before the connector's pre-forward hook
                self._zero(rank, step.new_blocks)
                rank.worker.handle_step(meta)
            else:
                rank.worker.handle_step(meta)
                self._zero(rank, step.new_blocks)
            self._let_through(rank)  # the previous step's async saves land only now: after their blocks' reuse
            if step.sync_loads:  # start_load_kv before the forward
                rank.worker.apply(meta.requests)
        for run in step.runs:
            self._forward(run)
        outcomes = []
        for rank in self.ranks:
            if not step.sync_loads:  # start_load_kv after the forward is launched
                rank.worker.apply(meta.requests)
            rank.worker.save(meta.requests)
            rank.worker.finish(step.finished)
            self._let_through(rank, loads_only=True)
            rank.pool.fail_gets = 0
            done = rank.worker.take_finished_loads()
            failures = rank.worker.take_load_failures()
            if self.in_step:
                assert rank.worker.stats.in_step_load_failures == 0, (
                    f"rank {rank.index}: an in-step load missed a chunk the scheduler offered (the hit contract broke)"
                )
                report = rank.worker.tracker.take_report()  # type: ignore[union-attr]
                if report is not None:
                    step.reports.append(report)
            assert failures.failed_requests <= done
            if failures.invalid_blocks:
                assert len(self.kinds) == 1, "vLLM refuses block-level load failures for several groups"
            # a lagging rank reports its loads a step after the other (deterministic, unlike its thread)
            held = rank.held
            rank.held = (set(), set(), set())
            done, invalid, failed = (
                done | held[0],
                failures.invalid_blocks | held[1],
                failures.failed_requests | held[2],
            )
            if rank.index in lag:
                rank.held, done, invalid, failed = (done, invalid, failed), set(), set(), set()
            outcomes.append((done, invalid, failed))
            # KVOutputAggregator: a load is finished once every rank reported it
            for rid in done:
                self.recv_counts[rid] += 1
                if self.recv_counts[rid] == len(self.ranks):
                    del self.recv_counts[rid]
                    step.finished_loads.add(rid)
            step.invalid_blocks |= invalid
            self.failed_pending |= failed
        step.failed_requests = self.failed_pending & step.finished_loads
        self.failed_pending -= step.failed_requests
        if len(outcomes) > 1 and any(o[1:] != outcomes[0][1:] for o in outcomes):
            event("route 4: a load failed on one rank only")
        self._check_pool()

    def _let_through(self, rank: Rank, loads_only: bool = False) -> None:
        rank.pool.let_through((LOADER,) if loads_only else (SENDER, LOADER))
        done = rank.worker.loads.loader.drain(10) if loads_only else rank.worker.drain(10)
        rank.pool.let_through(())
        assert done

    def _zero(self, rank: Rank, blocks: list[int]) -> None:
        for tensor in rank.tensors.values():
            tensor[blocks] = 0

    def _forward(self, run: Run) -> None:
        """The oracle: does every block this step attends to, on every rank, hold its chunk's bytes? If
        not, the KV it writes and the token it samples are tainted (on every rank: all-reduce)."""
        req, c = run.req, run.start
        for g, kind in enumerate(self.kinds):
            first = 0
            if isinstance(kind, SlidingWindow):
                first = max(0, c - kind.window + 1) // B
            elif isinstance(kind, ChunkedLocal):
                first = c // kind.attention_chunk_size * kind.attention_chunk_size // B
            for chunk in range(first, -(-c // B)):
                block_id = run.tables[g][chunk]
                assert block_id, f"{req.rid}: group {g} attends to chunk {chunk}, a null block (computed {c})"
                for rank in self.ranks:
                    if self.block(rank, g, block_id) != self.expected(rank.index, g, req, chunk, c):
                        run.tainted = True
        if run.tainted:
            event("a forward attended to a block holding the wrong bytes")
        end = c + run.n
        for rank in self.ranks:
            for g in range(len(self.kinds)):
                for chunk in range(c // B, -(-end // B)):
                    block_id = run.tables[g][chunk]
                    values = self.expected(rank.index, g, req, chunk, end)
                    if run.tainted:  # computed on a wrong block: wrong bytes, which no save may store
                        values = [digest("tainted", rank.index, g, layer, chunk) for layer in range(LAYERS)]
                    for layer, value in enumerate(values):
                        rank.tensors[f"g{g}.l{layer}"][block_id] = np.frombuffer(value, np.uint8)

    # ---- the step's output (Scheduler.update_from_output) -----------------------------------------

    def absorb(self, step: Step) -> None:
        for report in step.reports:  # SchedulerSide.absorb: the index first, then the loads
            assert self.index is not None
            self.index.apply(report)
        if (step.invalid_blocks or step.failed_requests) and self.queue:
            event("route 1: a load failure absorbed after the next step was scheduled")
        for rid in step.failed_requests:  # _handle_failed_recving, recompute policy
            req = self.requests.get(rid)
            if req is not None and req.status == "loading":
                event("load failed: recompute the request")
                req.computed, req.load_failed = 0, True
        skipped: set[str] = set()
        if step.invalid_blocks:  # _handle_invalid_blocks, recompute policy: nothing evicted
            loading = [r for r in self.waiting if r.status == "loading"]
            for req in self._invalid(loading, step):
                event("load failed: recompute from the failed chunk")
                req.load_failed = True
            skipped = {req.rid for req in self._invalid(list(self.running), step)}
            if skipped:
                event("sync load failed: the step's output dropped")
        for run in step.runs:
            req = run.req
            if self.requests.get(req.rid) is not req or req.status == "finishing":
                continue  # finished (or aborted) while the step ran
            req.in_flight -= 1
            stale = req.stale > 0
            if stale:
                req.stale -= 1
            if req.rid in skipped or (stale and req.drop_stale) or not run.samples:
                continue
            assert not run.tainted, (
                f"{req.rid}: step {step.number} sampled a token on a block holding wrong bytes, and vLLM delivers it"
            )
            if not stale:
                req.placeholders = max(0, req.placeholders - 1)
            req.known = min(req.known + 1, len(req.tokens))
            if req.status == "running":
                self.cache(req, req.computed - req.placeholders)
            if req.known >= len(req.tokens):
                self.finish(req)
        self.policy.absorb(step.invalid_blocks, step.failed_requests, step.finished_loads)
        for rid in step.finished_loads:  # _update_from_kv_xfer_finished
            req = self.requests.get(rid)
            assert req is not None, f"{rid}: its load was reported finished after vLLM freed its blocks"
            event("load")
            self.loads_reported[rid] += 1
            if req.status == "loading":
                req.load_done = True
            else:
                assert req.status == "finishing", f"{rid}: a load reported finished for a {req.status} request"
                self.release(req)
                del self.requests[rid]

    def _invalid(self, reqs: list[Req], step: Step) -> list[Req]:
        """Scheduler._update_requests_with_invalid_blocks: truncate at the first invalid block; a block
        shared with an earlier request is recomputed by that one."""
        affected: list[Req] = []
        marked: set[int] = set()
        for req in reqs:
            prior = req.computed - step.scheduled.get(req.rid, 0)
            is_affected = marked_one = False
            for idx, block_id in enumerate(req.tables[0][: -(-prior // B)]):
                if block_id not in step.invalid_blocks:
                    continue
                is_affected = True
                if block_id in marked:
                    continue
                marked.add(block_id)
                if marked_one:
                    continue
                marked_one = True
                req.computed = idx * B
            if is_affected:
                if not marked_one:
                    req.computed = prior
                affected.append(req)
        return affected

    def _check_pool(self) -> None:
        """Every chunk in every rank's pool holds exactly the bytes its key names, for the current weights."""
        for rank in self.ranks:
            for key in list(rank.pool.keys()):
                assert key in self.key_names, f"{key}: a key no request ever named"
                group, chunk_hash, version = self.key_names[key]
                value = np.zeros(LAYERS * ROW, dtype=np.uint8)
                if MemoryBackend.get_into(rank.pool, [key], [[value]])[0] is not Status.OK:
                    continue  # evicted meanwhile
                want = b"".join(
                    digest(rank.index, group, layer, chunk_hash.hex(), version) for layer in range(LAYERS)
                )
                assert value.tobytes() == want, f"rank {rank.index}: {key}: the pool holds bytes its key does not name"

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        if not hasattr(self, "free"):
            return
        held = Counter(b for r in self.requests.values() for table in r.tables for b in table if b)
        assert all(self.ref[b] == held[b] for b in range(1, NUM_BLOCKS)), "a block's ref count is off"
        assert sorted(self.free) == [b for b in range(1, NUM_BLOCKS) if not held[b]], "the free queue is off"

    def teardown(self) -> None:
        if not hasattr(self, "ranks"):
            return
        try:
            for rank in self.ranks:
                rank.pool.gated_threads = ()
                rank.pool.let_through(())  # wakes a thread already waiting: nothing is gated now
            for _ in range(TEARDOWN_STEPS):  # every load the engine waits for is reported
                if not self.queue and not any(r.status == "loading" for r in self.requests.values()):
                    break
                self.engine_step(32)
            for req in list(self.requests.values()):
                if req.status != "finishing":
                    self.finish(req)
            for _ in range(TEARDOWN_STEPS):
                if not self.has_work() and not self.queue:
                    break
                self.engine_step(32)
            waiting = sorted(self.requests)
            assert not waiting, f"{waiting}: waiting forever for a load that is never reported"
            for rank in self.ranks:
                assert rank.worker.drain(10)
            self._check_pool()
            assert all(rank.worker.active_requests() == 0 for rank in self.ranks)
            assert self.scheduler.active_requests() == 0
            for name in ("_local_tokens", "_pending", "_retired", "_cancelled", "_allocated_at"):
                assert not getattr(self.policy, name, None), f"the scheduler's steps leaked {name}"
            assert not getattr(getattr(self.policy, "loads", None), "_loads", None), "a watched load leaked"
            assert all(not rank.pool._pending for rank in self.ranks), "a reservation leaked"
            assert self.loads_reported == self.loads_started, "every load is reported finished exactly once"
            assert not self.recv_counts and not self.failed_pending, "a rank reported a load the others did not"
            assert len(self.free) == NUM_BLOCKS - 1
        finally:
            for rank in self.ranks:
                rank.worker.close()


# CI runs 120 examples per model; KVPOOL_ORACLE_EXAMPLES=2000 for a long local run
ORACLE_SETTINGS = settings(
    max_examples=int(os.environ.get("KVPOOL_ORACLE_EXAMPLES", "120")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class FullAttentionOracle(EngineOracle):
    kinds = (FullAttention(B),)


class SlidingWindowOracle(EngineOracle):
    kinds = (SlidingWindow(B, 24),)


class ChunkedLocalOracle(EngineOracle):
    kinds = (ChunkedLocal(B, 32),)


class HybridOracle(EngineOracle):
    kinds = (FullAttention(B), SlidingWindow(B, 24))


TestFullAttention = FullAttentionOracle.TestCase
TestSlidingWindow = SlidingWindowOracle.TestCase
TestChunkedLocal = ChunkedLocalOracle.TestCase
TestHybrid = HybridOracle.TestCase
TestFullAttention.settings = TestSlidingWindow.settings = ORACLE_SETTINGS
TestChunkedLocal.settings = TestHybrid.settings = ORACLE_SETTINGS


# ---- each route of issue 21, scripted: red on 149e02e (in-step loads), green since every load is async ----


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., FullAttentionOracle]]:
    """A full-attention oracle driven step by step outside hypothesis: one 64-token system prompt
    stored in the pool by a first request, then the route's own requests."""
    monkeypatch.setattr(sys.modules[__name__], "event", lambda *args, **kwargs: None)
    machines: list[FullAttentionOracle] = []

    def build(num_ranks: int = 1, local_cache: bool = True, **drawn: Any) -> FullAttentionOracle:
        machine = FullAttentionOracle()
        setup: dict[str, Any] = dict(sync_saves=True, sync_loads=True, runner="v1", reset_reaches_worker=False)
        machine.setup(**{**setup, "batching": "sync", **drawn}, num_ranks=num_ranks, local_cache=local_cache)
        machines.append(machine)
        return machine

    yield build
    for machine in machines:
        for rank in machine.ranks:
            rank.worker.close()


SYSTEM_PROMPT = [(7 * i + 3) % VOCAB for i in range(64)]


def submit(machine: EngineOracle, tokens: list[int], prompt: int) -> Req:
    req = Req(f"r{machine.count}", tokens, prompt, prompt, tables=[[] for _ in machine.kinds])
    machine.count += 1
    machine.requests[req.rid] = req
    machine.waiting.append(req)
    return req


def store_system_prompt(machine: EngineOracle) -> None:
    submit(machine, [*SYSTEM_PROMPT, 1], 64)
    for _ in range(6):
        machine.engine_step(96)


def test_route_2_a_request_sharing_a_failed_load_in_the_same_pass_never_computes_on_it(scripted) -> None:
    machine = scripted()
    store_system_prompt(machine)
    machine.reset(reset_connector=False)  # the engine's cache forgets the prompt; the pool keeps it
    submit(machine, [*SYSTEM_PROMPT, *[2] * 30], 84)
    submit(machine, [*SYSTEM_PROMPT, *[3] * 30], 84)
    machine.engine_step(200, evict_on=machine.ranks)  # both admitted in one pass; the last chunk is lost
    for _ in range(8):
        machine.engine_step(96)
    machine.teardown()


def test_route_3_a_later_request_never_hits_a_block_a_failed_load_left_unwritten(scripted) -> None:
    machine = scripted()
    store_system_prompt(machine)
    machine.reset(reset_connector=False)
    first = submit(machine, [*SYSTEM_PROMPT, *[2] * 30], 84)
    machine.engine_step(20, evict_on=machine.ranks)  # its load loses the last chunk
    machine.finish(first)  # aborted before it recomputes
    submit(machine, [*SYSTEM_PROMPT, *[3] * 30], 84)
    for _ in range(8):
        machine.engine_step(96)
    machine.teardown()


def test_route_4_a_rank_whose_load_succeeded_stores_nothing_computed_with_a_failed_rank(scripted) -> None:
    machine = scripted(num_ranks=2, local_cache=False)
    store_system_prompt(machine)
    submit(machine, [*SYSTEM_PROMPT, *[2] * 30], 84)
    machine.engine_step(200, evict_on=[machine.ranks[1]])  # the load fails on rank 1 only
    for _ in range(8):
        machine.engine_step(96)
    machine.teardown()


def test_a_reset_that_preempts_and_readmits_in_one_pass_keeps_the_readmitted_load(scripted) -> None:
    machine = scripted()
    submit(machine, [*SYSTEM_PROMPT, *[1] * 40], 64)
    for _ in range(20):
        machine.engine_step(64)
    machine.reset(reset_connector=False)  # preempted; re-admitted with a pool load in the next pass
    for _ in range(8):
        machine.engine_step(96)
    machine.teardown()


def test_a_pool_reset_and_a_weights_change_in_one_step_still_empty_a_shared_pool(scripted) -> None:
    """Found by the oracle: a connector reset then an in-place update before the workers' next step. The
    worker saw one epoch change with a new weights tag, kept the shared pool (a weights change does), and
    a put running since before the reset landed under a name that by then meant the reset's weights."""
    machine = scripted(sync_saves=False, sync_loads=False, shared_pool=True)
    machine.update_weights()
    submit(machine, [0] * 18, 16)
    machine.engine_step(16)
    machine.reset(reset_connector=True)
    machine.update_weights()
    machine.teardown()


# ---- the hit contract (issue 43): an in-step load cannot miss; the mutation that frees at eviction does ----


def _evicted_before_its_in_step_load(machine: EngineOracle) -> Req:
    store_system_prompt(machine)
    machine.reset(reset_connector=False)  # the engine's cache forgets the prompt; the pool keeps it
    req = submit(machine, [*SYSTEM_PROMPT, *[2] * 30], 84)
    # the pool drops the hit's last chunk between the lookup and the load: withdrawn, not yet acknowledged
    machine.engine_step(200, evict_on=machine.ranks)
    return req


@pytest.mark.parametrize("batching", ["sync", "async", "pp2"])
def test_an_in_step_hit_loads_whole_though_its_chunk_was_evicted_after_the_lookup(scripted, batching) -> None:
    machine = scripted(num_ranks=2, local_cache=False, batching=batching, in_step=True, in_step_chunks=64)
    _evicted_before_its_in_step_load(machine)
    assert all(rank.worker.stats.loads_in_step == 1 for rank in machine.ranks)
    assert all(rank.pool.retired_bytes > 0 for rank in machine.ranks)  # held until acknowledged
    for _ in range(8):
        machine.engine_step(96)
    # acknowledged a step or two later: freed
    assert all(rank.pool.retired_bytes == 0 for rank in machine.ranks)
    machine.teardown()


def test_freeing_at_eviction_instead_of_at_acknowledgement_breaks_the_contract(scripted, monkeypatch) -> None:
    """The mutation the issue asks for: without the second phase the same interleaving misses."""
    monkeypatch.setattr(sys.modules[__name__], "HOLD_EVICTIONS", False)
    machine = scripted(num_ranks=2, local_cache=False, batching="async", in_step=True, in_step_chunks=64)
    with pytest.raises(AssertionError, match="the hit contract broke"):
        _evicted_before_its_in_step_load(machine)


def test_a_hit_over_the_step_budget_waits_a_step(scripted) -> None:
    machine = scripted(local_cache=False, in_step=True, in_step_chunks=3)  # the prompt's hit is 4 chunks
    store_system_prompt(machine)
    submit(machine, [*SYSTEM_PROMPT, *[2] * 30], 84)
    for _ in range(8):
        machine.engine_step(96)
    assert machine.ranks[0].worker.stats.loads_in_step == 0
    assert machine.loads_started and machine.loads_reported == machine.loads_started
    machine.teardown()
