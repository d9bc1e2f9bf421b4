"""A fake vLLM drives the real SchedulerCore and WorkerCore over the embedded pool, and a bytes
oracle checks every block the engine computes on and every chunk the pool holds.

Block bytes are a deterministic function of (group, layer, chunk hash, weights version), the chunk
hash naming the whole token prefix. A chunk stored from a reused, zeroed, partial or stale block, a
block loaded with the wrong chunk, or a window block a hit left null, shows up as bytes that its key
(or the engine's position) does not name. The interleavings are random: new requests, chunked
prefill, decode, preemption and resume, abort and finish, loads that fail or race an eviction,
pool resets (a weights change), and block reuse with either model runner's order of zeroing new
blocks and calling the connector's pre-forward hook.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.backends.base import Status, Values
from kvpool.backends.memory import MemoryBackend
from kvpool.keys import KeySpace, LayoutFingerprint
from kvpool.layout import KVLayout
from kvpool.masks import AttentionKind, ChunkedLocal, FullAttention, MaskCoordinator, SlidingWindow
from kvpool.metadata import RequestDelta, StepMetadata
from kvpool.plan import GroupPlacement
from kvpool.scheduler import SchedulerConfig, SchedulerCore
from kvpool.worker import WorkerConfig, WorkerCore

B = 16  # every group's block size and the hash block size
LAYERS = 2
ROW = 8  # bytes of one block in one layer
NUM_BLOCKS = 40  # block 0 is the null block
VOCAB = 4  # few distinct tokens: prompts share prefixes, so chunks are reused across requests


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


@dataclass
class Req:
    rid: str
    tokens: list[int]  # prompt and every output it will produce (greedy, fixed up front)
    prompt: int
    known: int  # tokens known so far: the prompt, then one more per decode step
    computed: int = 0
    tables: list[list[int]] = field(default_factory=list)
    status: str = "waiting"  # waiting | loading | running
    hit: int = 0
    restart: bool = True  # its next scheduling sends the whole block table (new or resumed)
    sent: list[int] = field(default_factory=list)  # per group, the table length its last step saw
    aborted: bool = False
    loaded_in_step: bool = False  # admitted this step with a sync (in-step) load
    tainted: bool = False  # this step computed on a block that did not hold its chunk


class FlakyPool(MemoryBackend):
    """The embedded pool, with gets that can be told to fail. The worker's own threads (sender, loader)
    wait at a gate the engine opens at fixed points of a step: they lag behind the engine as far as
    they can, yet every run of a test case sees the same pool, so hypothesis can replay it."""

    fail_gets = 0

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.gate = threading.Event()
        self.gated_threads: set[str] = set()  # name prefixes of the threads that wait at the gate

    def _wait(self) -> None:
        if threading.current_thread().name.startswith(tuple(self.gated_threads)):
            assert self.gate.wait(10), "the engine never let the worker's thread through"

    def put(self, keys: Sequence[str], values: Values) -> list[Status]:
        self._wait()
        return super().put(keys, values)

    def get_into(self, keys: Sequence[str], dests: Values) -> list[Status]:
        self._wait()
        if self.fail_gets:
            self.fail_gets -= 1
            raise ConnectionError("scripted get failure")
        return super().get_into(keys, dests)


class EngineOracle(RuleBasedStateMachine):
    kinds: Sequence[AttentionKind] = (FullAttention(B),)

    @initialize(
        sync_saves=st.booleans(),
        sync_loads=st.booleans(),
        runner=st.sampled_from(["v1", "v2"]),
        reset_reaches_worker=st.booleans(),
    )
    def setup(self, sync_saves: bool, sync_loads: bool, runner: str, reset_reaches_worker: bool) -> None:
        self.runner = runner
        self.reset_reaches_worker = reset_reaches_worker  # the worker told at once, or at its next step
        self.coord = MaskCoordinator(list(self.kinds))
        self.in_step = False  # every kvpool load is async: the engine waits for it
        self.spaces = [
            KeySpace(LayoutFingerprint("oracle", "u8", kind.block_size, "numpy", group_id=g))
            for g, kind in enumerate(self.kinds)
        ]
        self.tensors = {
            f"g{g}.l{layer}": np.zeros((NUM_BLOCKS, ROW), dtype=np.uint8)
            for g in range(len(self.kinds))
            for layer in range(LAYERS)
        }
        layout = KVLayout(self.tensors, {name: int(name[1 : name.index(".")]) for name in self.tensors}, NUM_BLOCKS)
        self.pool = FlakyPool(LAYERS * ROW * 48)  # smaller than the engine: the pool evicts
        self.pool.gated_threads = {"kvpool-sender", "kvpool-load"}
        self.scheduler = SchedulerCore(
            self.coord, [[space] for space in self.spaces], self.pool.exists, SchedulerConfig(save_decode=True)
        )
        self.worker = WorkerCore(
            self.pool,
            self.coord,
            [GroupPlacement(space) for space in self.spaces],
            layout,
            WorkerConfig(put_batch_chunks=4, sync_saves=sync_saves, sync_loads=sync_loads),
        )
        self.version = 0  # the weights: a reset may change them
        self.worker_epoch = 0  # the last reset the worker has seen
        self.key_names: dict[str, tuple[int, bytes]] = {}  # pool key -> (group, chunk hash)
        self.free = list(range(1, NUM_BLOCKS))
        self.requests: dict[str, Req] = {}
        self.count = 0
        self.preempted: list[str] = []
        self.history: list[list[int]] = []  # every request's tokens: later prompts share their prefixes
        self.loads_started: Counter[str] = Counter()
        self.loads_reported: Counter[str] = Counter()

    # ---- the engine's memory ----------------------------------------------------------------------

    def expected(self, group: int, req: Req, chunk: int, upto: int) -> list[bytes]:
        """Per layer: the bytes of `chunk` once `upto` tokens are computed (full or still partial)."""
        end = (chunk + 1) * B
        if end <= upto:
            name: object = chain(req.tokens[:end])[-1].hex()
        else:
            name = "partial:" + hashlib.blake2b(bytes(req.tokens[:upto])).hexdigest()
        return [digest(group, layer, name, self.version) for layer in range(LAYERS)]

    def block(self, group: int, block_id: int) -> list[bytes]:
        return [self.tensors[f"g{group}.l{layer}"][block_id].tobytes() for layer in range(LAYERS)]

    def hashes(self, req: Req) -> list[bytes]:
        hashes = chain(req.tokens[: req.known])
        for g, space in enumerate(self.spaces):
            for h in hashes:
                self.key_names[space.key(h)] = (g, h)
        return hashes

    def allocate(self, req: Req, upto: int, skip_below: int = 0) -> list[int] | None:
        """Blocks for every chunk below ceil(upto / B); a freeing group gets null below its first live
        chunk at `skip_below` tokens. None: not enough free blocks (nothing taken)."""
        plan = []
        for g, kind in enumerate(self.kinds):
            table = req.tables[g]
            first_live = kind.first_live_chunk(skip_below) if kind.frees_blocks else 0
            for chunk in range(len(table), -(-upto // B)):
                plan.append((g, chunk < first_live))
        if sum(not null for _, null in plan) > len(self.free):
            return None
        new = []
        for g, null in plan:
            block_id = 0 if null else self.free.pop()
            req.tables[g].append(block_id)
            if block_id:
                new.append(block_id)
        return new

    def release(self, req: Req) -> None:
        for table in req.tables:
            self.free.extend(block_id for block_id in table if block_id)
        req.tables = [[] for _ in self.kinds]

    def slide(self, req: Req) -> None:
        """vLLM frees a window's blocks once no future token can attend to them."""
        for g, kind in enumerate(self.kinds):
            if kind.frees_blocks:
                table = req.tables[g]
                for chunk in range(min(len(table), kind.first_live_chunk(req.computed))):
                    if table[chunk]:
                        self.free.append(table[chunk])
                        table[chunk] = 0

    # ---- rules ------------------------------------------------------------------------------------

    @rule(data=st.data())
    def new_request(self, data: st.DataObject) -> None:
        prompt = data.draw(st.integers(8, 144), label="prompt")
        total = prompt + data.draw(st.integers(1, 40), label="outputs")
        tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=total, max_size=total), label="tokens")
        if self.history and data.draw(st.sampled_from([True, True, False]), label="shares a prefix"):
            other = data.draw(st.sampled_from(self.history), label="with")
            most = min(len(other), total)
            shared = data.draw(st.integers(min(B, most), most), label="shared")
            tokens[:shared] = other[:shared]
        self.history.append(tokens)
        rid = f"r{self.count}"
        self.count += 1
        self.requests[rid] = Req(rid, tokens, prompt, prompt, tables=[[] for _ in self.kinds])

    @rule(
        budgets=st.lists(st.integers(8, 96), min_size=1, max_size=4),
        evict_before_load=st.sampled_from([False, False, True]),
        fail_gets=st.sampled_from([0, 0, 0, 1]),
        reset_after=st.sampled_from([False] * 7 + [True]),
    )
    def steps(self, budgets: list[int], evict_before_load: bool, fail_gets: int, reset_after: bool) -> None:
        for budget in budgets:
            self.step(budget, evict_before_load, fail_gets)
        if reset_after and all(r.status != "loading" for r in self.requests.values()):
            self.reset()

    def step(self, budget: int, evict_before_load: bool, fail_gets: int) -> None:
        deltas: list[RequestDelta] = []
        scheduled: list[tuple[Req, int]] = []
        new_blocks: list[int] = []
        running = [r for r in self.requests.values() if r.status == "running"]
        for req in running:
            self.slide(req)
        for req in running:
            if req.status != "running" or budget <= 0:
                continue
            n = min(budget, req.known - req.computed)
            blocks = self.allocate(req, req.computed + n)
            while blocks is None:
                victim = [r for r in running if r.status == "running"][-1]
                self._preempt(victim)
                if victim is req:
                    break
                blocks = self.allocate(req, req.computed + n)
            if blocks is None:
                continue
            budget -= n
            new_blocks += blocks
            scheduled.append((req, n))
        for req in [r for r in self.requests.values() if r.status == "waiting"]:
            if budget <= 0:
                break
            hashes = self.hashes(req)
            hit = self.scheduler.lookup(req.rid, hashes, req.known)
            assert hit is not None
            n = min(budget, req.known - hit) if not hit or self.in_step else 0
            blocks = self.allocate(req, hit + n, skip_below=hit)
            if blocks is None:
                break  # vLLM admits a request only when its blocks fit
            new_blocks += blocks
            if hit and self.in_step:
                self.scheduler.on_allocated(req.rid, req.prompt, 0, hit)
                self._delta(deltas, req, 0)  # the load, then the request runs in this very step
                req.status, req.hit, req.computed, req.loaded_in_step = "running", hit, hit, True
                budget -= n
                scheduled.append((req, n))
            elif hit:
                req.status, req.hit = "loading", hit
                self.scheduler.on_allocated(req.rid, req.prompt, 0, hit)
                self._delta(deltas, req, 0)
                self.loads_started[req.rid] += 1
            else:
                req.status = "running"
                budget -= n
                scheduled.append((req, n))
        for req, n in scheduled:
            self._delta(deltas, req, n)
        if evict_before_load:
            for delta in deltas:
                if delta.load is not None:  # lost between the lookup and the load
                    req = self.requests[delta.req_id]
                    self.pool.remove([self.spaces[-1].key(chain(req.tokens[: delta.load.hit_tokens])[-1])])
        self.pool.fail_gets = fail_gets
        step = StepMetadata(deltas, self.preempted, self.scheduler.reset_epoch)
        self.preempted = []
        if step.reset_epoch > self.worker_epoch:
            # this step empties the pool after the puts in flight: a remote pool answers them meanwhile
            self._let_through()
            self.worker_epoch = step.reset_epoch
        if self.runner == "v2":  # Model Runner V2 zeroes new blocks before the connector's pre-forward hook
            self._zero(new_blocks)
            self.worker.handle_step(step)
        else:
            self.worker.handle_step(step)
            self._zero(new_blocks)
        self._let_through()  # the previous step's async saves land only now: after their blocks' reuse
        self.worker.apply(deltas)
        for req, n in scheduled:
            self._forward(req, n)
        self.worker.save(deltas)
        for req, _ in scheduled:
            if req.known >= len(req.tokens) and req.computed >= req.known - 1 and not req.loaded_in_step:
                self._finish(req)
        self._let_through(loads_only=True)
        self.pool.fail_gets = 0
        self._collect_loads()
        self._check_pool()

    def _let_through(self, loads_only: bool = False) -> None:
        self.pool.gate.set()
        done = self.worker.loader.drain(10) if loads_only else self.worker.drain(10)
        self.pool.gate.clear()
        assert done

    def _delta(self, deltas: list[RequestDelta], req: Req, n: int) -> None:
        delta = self.scheduler.request_delta(
            req.rid,
            num_prompt_tokens=req.prompt,
            block_hashes=self.hashes(req),
            computed_before=req.computed,
            new_tokens=n,
            # as vLLM's scheduler output: the whole table on a (re)start, else the blocks appended since
            new_blocks=req.tables if req.restart else [t[s:] for t, s in zip(req.tables, req.sent)],
            whole_table=req.restart,
        )
        req.restart = False
        req.sent = [len(table) for table in req.tables]
        if delta is not None:
            deltas.append(delta)

    def _zero(self, blocks: list[int]) -> None:
        for tensor in self.tensors.values():
            tensor[blocks] = 0

    def _forward(self, req: Req, n: int) -> None:
        """The oracle: every block this step attends to holds its chunk's bytes; then write the new KV."""
        c = req.computed
        for g, kind in enumerate(self.kinds):
            first = 0
            if isinstance(kind, SlidingWindow):
                first = max(0, c - kind.window + 1) // B
            elif isinstance(kind, ChunkedLocal):
                first = c // kind.attention_chunk_size * kind.attention_chunk_size // B
            for chunk in range(first, -(-c // B)):
                block_id = req.tables[g][chunk]
                assert block_id, f"{req.rid}: group {g} attends to chunk {chunk}, a null block (computed {c})"
                if self.block(g, block_id) != self.expected(g, req, chunk, c):
                    # only a sync load that failed in this step leaves that: vLLM drops the step's output
                    assert req.loaded_in_step, (
                        f"{req.rid}: group {g} chunk {chunk} (block {block_id}) holds the wrong bytes at {c} tokens"
                    )
                    req.tainted = True
        end = c + n
        for g in range(len(self.kinds)):
            for chunk in range(c // B, -(-end // B)):
                block_id = req.tables[g][chunk]
                values = self.expected(g, req, chunk, end)
                if req.tainted:  # computed on a wrong block: wrong bytes, which no save may store
                    values = [digest("tainted", g, layer, chunk, self.version) for layer in range(LAYERS)]
                for layer, value in enumerate(values):
                    self.tensors[f"g{g}.l{layer}"][block_id] = np.frombuffer(value, np.uint8)
        req.computed = end
        if req.computed == req.known and req.known < len(req.tokens) and not req.tainted:
            req.known += 1  # sampled

    def _preempt(self, req: Req) -> None:
        event("preemption")
        self.release(req)
        req.status, req.computed, req.restart = "waiting", 0, True
        self.preempted.append(req.rid)
        self.scheduler.preempt(req.rid)

    def _finish(self, req: Req) -> None:
        self.release(req)
        del self.requests[req.rid]
        self.worker.finish([req.rid])
        self.scheduler.finish(req.rid)

    def _collect_loads(self) -> None:
        done = self.worker.take_finished_loads()
        failures = self.worker.take_load_failures()
        assert failures.failed_requests <= done
        if failures.invalid_blocks:
            assert len(self.kinds) == 1, "vLLM refuses block-level load failures for several groups"
        for req in [r for r in self.requests.values() if r.loaded_in_step]:
            req.loaded_in_step = req.tainted = False
            bad = [c for c, b in enumerate(req.tables[0][: req.hit // B]) if b in failures.invalid_blocks]
            if bad:
                event("in-step load failed: recompute from the failed chunk")
                req.computed = bad[0] * B  # vLLM truncates at the first invalid block, drops the step's output
                self.scheduler.mark_load_failed(req.rid)
            elif req.known >= len(req.tokens) and req.computed >= req.known - 1:
                self._finish(req)
        for rid in done:
            event("load")
            self.loads_reported[rid] += 1
            req = self.requests[rid]
            assert req.status == "loading"
            if req.aborted:
                self._finish(req)
                continue
            req.status, req.restart = "running", True
            req.computed = req.hit
            bad = [c for c, block_id in enumerate(req.tables[0][: req.hit // B]) if block_id in failures.invalid_blocks]
            if rid in failures.failed_requests:
                event("load failed: recompute the request")
                self.release(req)
                req.status, req.computed = "waiting", 0
                self.scheduler.mark_load_failed(rid)
            elif bad:
                event("load failed: recompute from the failed chunk")
                req.computed = bad[0] * B  # vLLM truncates at the first invalid block
                self.scheduler.mark_load_failed(rid)

    def _check_pool(self) -> None:
        """Every chunk in the pool holds exactly the bytes its key names, for the current weights."""
        for key in list(self.pool.keys()):
            assert key in self.key_names, f"{key}: a key no request ever named"
            group, chunk_hash = self.key_names[key]
            value = np.zeros(LAYERS * ROW, dtype=np.uint8)
            if MemoryBackend.get_into(self.pool, [key], [[value]])[0] is not Status.OK:
                continue  # evicted meanwhile
            want = b"".join(digest(group, layer, chunk_hash.hex(), self.version) for layer in range(LAYERS))
            assert value.tobytes() == want, f"{key}: the pool holds bytes its key does not name"

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        req = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        if req.status == "loading":
            req.aborted = True  # vLLM keeps the blocks until the load is reported (kvpool asks it to)
        else:
            self._finish(req)

    def reset(self) -> None:
        """`reset_prefix_cache(reset_running_requests=True, reset_connector=True)` around a weights update."""
        event("reset")
        for req in [r for r in self.requests.values() if r.status == "running"]:
            self._preempt(req)
        self.scheduler.reset()
        if self.reset_reaches_worker:
            # a put held at the gate is not waited for: it is removed once it lands
            self.worker.reset(self.scheduler.reset_epoch, wait_s=0.01)
            self.worker_epoch = self.scheduler.reset_epoch
        else:
            self.pool.clear()  # the worker learns it at its next step, before that step's loads
        self.version += 1

    @rule()
    def settle(self) -> None:
        self._let_through()
        self._collect_loads()

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        if not hasattr(self, "free"):
            return
        held = [b for r in self.requests.values() for table in r.tables for b in table if b]
        assert len(held) == len(set(held)) and not set(held) & set(self.free)
        assert len(held) + len(self.free) == NUM_BLOCKS - 1

    def teardown(self) -> None:
        if not hasattr(self, "worker"):
            return
        try:
            self.pool.gated_threads = set()
            self.pool.gate.set()  # for a thread already waiting
            self.worker.handle_step(StepMetadata(reset_epoch=self.scheduler.reset_epoch))  # the next step
            assert self.worker.drain(10)
            self._collect_loads()
            for req in list(self.requests.values()):
                self._finish(req)
            self.worker.finish(self.preempted)
            assert self.worker.drain(10)
            self._check_pool()
            assert self.worker.active_requests() == 0
            assert self.scheduler.active_requests() == 0
            assert not self.pool._pending, "a reservation leaked"
            assert self.loads_reported == self.loads_started, "every load is reported finished exactly once"
        finally:
            self.worker.close()


# CI runs 120 examples per model; KVPOOL_ORACLE_EXAMPLES=5000 for a long local run
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
