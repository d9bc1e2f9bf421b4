"""The connector on real vLLM CPU engines over a real Mooncake master.

Every test compares greedy tokens with a no-connector run of the same engine settings (one baseline
engine for the module) and checks where the tokens came from (num_cached_tokens, worker stats).
Engines run in-process unless the test is about processes; every process started here is stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.backends.base import Status
from kvpool.backends.mooncake.segment_holder import SegmentHolder
from kvpool.integrations.vllm import _LOCAL_SCHEDULERS, local_worker
from kvpool.testing.engine import GreedyResult, assert_same_greedy, engine, generate_greedy
from kvpool.testing.mooncake import mooncake_or_skip

from .conftest import BLOCK, random_prompts
from .conftest_mooncake import (
    DRIVER,
    child_env,
    mooncake_connector,
    read_ready,
    run_engine_process,
    wait_until,
)
from .mooncake_driver import TP_LAYER_BYTES, TP_LAYERS, run_tp_rank, tp_expected_value, tp_model, tp_requests

pytestmark = [pytest.mark.mooncake, pytest.mark.vllm, pytest.mark.timeout(300)]

MAX_TOKENS = 8
PROMPT_TOKENS = 300  # 4 full blocks of 64 are stored; a fresh engine hits 256 tokens
CHUNK_BYTES = 4 * 2 * 64 * 128 * 2  # tiny llama, block 64: 4 layers x [2 heads, 64 tokens, 2 x 64 dims] bf16
SHARED = random_prompts(2, PROMPT_TOKENS, seed=41)
DEAD_OWNER = random_prompts(2, PROMPT_TOKENS, seed=42)
OUTAGE = [random_prompts(3, PROMPT_TOKENS, seed=43 + i) for i in range(4)]
HUNG = random_prompts(6, 512, seed=60)
DAMAGED = random_prompts(2, PROMPT_TOKENS, seed=61)
BATCH_BOUND_S = 15.0  # see test_master_killed_mid_workload
# 9 chunks a prompt: a burst of 252 chunks (31.5 MiB), then batches of 72 (9 MiB)
PRESSURE = [random_prompts(count, 576, seed=50 + i) for i, count in enumerate((28, 8, 8, 8))]


@pytest.fixture(scope="module")
def llama(model_dir: Callable[[str], Path]) -> Path:
    return model_dir("llama")


@pytest.fixture(scope="module")
def baseline(llama: Path) -> dict[str, list[GreedyResult]]:
    """No-connector greedy outputs of every prompt batch used below, from one engine."""
    batches = {"shared": SHARED, "dead_owner": DEAD_OWNER, "hung": HUNG, "damaged": DAMAGED}
    batches.update({f"outage{i}": batch for i, batch in enumerate(OUTAGE)})
    batches.update({f"pressure{i}": batch for i, batch in enumerate(PRESSURE)})
    with engine(llama, block_size=BLOCK) as llm:
        return {name: generate_greedy(llm, prompts, MAX_TOKENS) for name, prompts in batches.items()}


@pytest.fixture
def masters(mooncake_available: None) -> Iterator[Callable[..., Any]]:
    """Starts mooncake_masters (loopback, free ports unless given); all stopped at teardown."""
    from kvpool.backends.mooncake.master import start_master

    started: list[Any] = []

    def start(*extra_args: str, **ports: int) -> Any:
        started.append(start_master(extra_args=list(extra_args), **ports))
        return started[-1]

    yield start
    for master in started:
        master.stop()


@pytest.fixture(scope="session")
def mooncake_available() -> None:
    mooncake_or_skip()


def settle(llm: Any) -> Any:
    """Let queued saves finish and deliver finished requests to the worker; returns the worker."""
    worker = local_worker()
    assert worker is not None
    assert worker.drain(60.0), "saves did not finish"
    for _ in range(3):
        llm.llm_engine.step()
        assert worker.drain(60.0)
    return worker


def record_lookups() -> dict[str, list[tuple[int | None, bool]]]:
    """Record every answer of the in-process scheduler connector's get_num_new_matched_tokens."""
    (side,) = _LOCAL_SCHEDULERS.values()
    assert side.core.config.lookup_async, "mooncake lookups must default to async"
    answers: dict[str, list[tuple[int | None, bool]]] = {}
    original = side.matched_tokens

    def recording(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        answer = original(request, num_computed_tokens)
        answers.setdefault(request.request_id, []).append(answer)
        return answer

    side.matched_tokens = recording  # type: ignore[method-assign]
    return answers


def timed_generate(
    llm: Any, prompts: list[list[int]], after_step: Callable[[int], None] | None = None
) -> tuple[list[GreedyResult], float, float]:
    """(results, wall seconds, longest single engine step in seconds); `after_step(i)` runs after step i."""
    steps: list[float] = []
    original = llm.llm_engine.step

    def step() -> Any:
        began = time.monotonic()
        try:
            return original()
        finally:
            steps.append(time.monotonic() - began)
            if after_step is not None:
                after_step(len(steps) - 1)

    llm.llm_engine.step = step
    try:
        began = time.monotonic()
        results = generate_greedy(llm, prompts, MAX_TOKENS)
        wall = time.monotonic() - began
    finally:
        del llm.llm_engine.step
    return results, wall, max(steps, default=0.0)


def complete(results: list[GreedyResult], prompts: list[list[int]]) -> None:
    """No request failed: every prompt got its full greedy output."""
    assert len(results) == len(prompts)
    assert all(len(r.token_ids) == MAX_TOKENS for r in results)


# ---------------------------------------------------------------------------------------------- a


def test_engine_processes_share_one_master(llama, baseline, masters, tmp_path):
    """Engine A (a child process) saves; engine B (this process) loads. A's own client holds no segment:
    the KV lives in a standalone holder's segment and so outlives A."""
    master = masters()
    with SegmentHolder(master.address, 64 << 20):
        config = mooncake_connector(master, global_segment_size=0)
        saved, stats_a = run_engine_process(tmp_path, llama, SHARED, MAX_TOKENS, config, block_size=BLOCK)
        assert stats_a["chunks_put"] == 2 * (PROMPT_TOKENS // BLOCK)
        assert_same_greedy(baseline["shared"], saved)
        assert [r.num_cached_tokens for r in saved] == [0, 0]

        with engine(llama, block_size=BLOCK, kv_transfer_config=config) as llm:
            answers = record_lookups()
            loaded = generate_greedy(llm, SHARED, MAX_TOKENS)
            stats_b = settle(llm).stats
    # lookups leave the process, so they run on a thread; a healthy master usually answers within
    # lookup_wait_ms, in the call that starts the lookup, else "ask again" (a hung master: its own test)
    assert len(answers) == 2
    for seen in answers.values():
        assert seen[-1] == (256, True) and set(seen) <= {(None, False), (256, True)}, seen
    assert [r.num_cached_tokens for r in loaded] == [256, 256]
    assert stats_b.chunks_loaded == 2 * (256 // BLOCK) and stats_b.chunks_load_failed == 0
    assert stats_b.chunks_put == 0  # B recomputed only the partial tail block, which is never stored
    assert [r.token_ids for r in loaded] == [r.token_ids for r in baseline["shared"]]


# ---------------------------------------------------------------------------------------------- b


def test_master_killed_mid_workload(llama, baseline, masters):
    """SIGKILL the master in the middle of a batch (right after its first engine step queued saves): no
    request fails, no batch stalls, outputs stay equal; a master restarted on the same port is used again
    (re-saved chunks hit).

    Bound per batch: BATCH_BOUND_S. What an outage can cost one batch: the first RPC to a dead master
    may block ~4.3 s in Mooncake's reconnect loop (a lookup in flight: the scheduler's async lookup waits at
    most lookup_timeout_s = 5 s for it; saves run on the sender thread from host copies, so they never hold a
    step), after which the breaker answers at once. Computing 3 prompts takes < 1 s (2-3 s on a
    loaded 2-core machine). 15 s covers the worst sum with margin, yet fails if the stall repeats per
    call (3+ lookups or saves each waiting 4.3 s) or a call hangs (30 s)."""
    master = masters()
    config = mooncake_connector(master, global_segment_size=64 << 20, breaker_cooldown_s=1.0)
    with engine(llama, block_size=BLOCK, kv_transfer_config=config) as llm:
        worker = local_worker()
        assert worker is not None
        timings: list[tuple[str, float, float]] = []

        def run(name: str, prompts: list[list[int]], expected: str, **kwargs: Any) -> list[GreedyResult]:
            results, wall, longest = timed_generate(llm, prompts, **kwargs)
            timings.append((name, wall, longest))
            complete(results, prompts)
            assert_same_greedy(baseline[expected], results)
            return results

        run("before", OUTAGE[0], "outage0")
        settle(llm)
        assert worker.stats.chunks_put == 3 * (PROMPT_TOKENS // BLOCK)

        run("killed mid-batch", OUTAGE[1], "outage1", after_step=lambda i: master.kill() if i == 0 else None)
        assert not master.running()
        settle(llm)  # finished requests hold their blocks until their saves end
        assert llm.reset_prefix_cache()
        during = run("repeat during outage", OUTAGE[0], "outage0")
        assert [r.num_cached_tokens for r in during] == [0, 0, 0], "a dead master's objects cannot hit"
        run("new during outage", OUTAGE[3], "outage3")
        settle(llm)
        put_during_outage = worker.stats.chunks_put

        restarted = masters(rpc_port=master.rpc_port, metrics_port=master.metrics_port)
        assert restarted.address == master.address
        # both of the engine's clients (the worker's and the scheduler's) reconnect by themselves
        (scheduler_side,) = _LOCAL_SCHEDULERS.values()
        scheduler_backend = scheduler_side._own_backend
        assert scheduler_backend is not None
        probe = f"probe/{uuid.uuid4().hex}"
        wait_until(
            lambda: worker.backend.put([probe], [[np.ones(4096, np.uint8)]]) == [Status.OK],
            30.0,
            "the worker's client stores again after the restart",
            poll_s=0.25,
        )
        wait_until(lambda: scheduler_backend.exists([probe]) == [True], 30.0, "lookups work again", poll_s=0.25)

        run("new after restart", OUTAGE[2], "outage2")
        settle(llm)
        assert worker.stats.chunks_put == put_during_outage + 3 * (PROMPT_TOKENS // BLOCK)
        loaded_before = worker.stats.chunks_loaded
        assert llm.reset_prefix_cache()
        again = run("repeat after restart", OUTAGE[2], "outage2")
        settle(llm)
        assert [r.num_cached_tokens for r in again] == [256] * 3, "hits resume on the restarted master"
        assert worker.stats.chunks_loaded == loaded_before + 3 * (256 // BLOCK)
        assert worker.stats.chunks_load_failed == 0
    print("batch wall / longest step (s):", [(name, round(wall, 2), round(step, 2)) for name, wall, step in timings])
    for name, wall, longest in timings:
        assert wall < BATCH_BOUND_S, f"batch {name!r} took {wall:.1f} s (longest step {longest:.1f} s): {timings}"


# ---------------------------------------------------------------------------------------------- c


def test_a_hung_master_costs_each_request_at_most_one_lookup_deadline(llama, baseline, masters):
    """SIGSTOP the master (its port stays open, nothing answers), then SIGCONT: requests sent one at a time
    keep their outputs, cost at most one lookup deadline more than computing once the breaker is open,
    and hits come back from the pool without a restart."""
    from kvpool.scheduler.scheduler_core import DEFAULT_LOOKUP_TIMEOUT_S

    master = masters()
    config = mooncake_connector(master, global_segment_size=64 << 20, breaker_cooldown_s=0.5)
    one_at_a_time = [[prompt] for prompt in HUNG]
    with engine(llama, block_size=BLOCK, kv_transfer_config=config) as llm:

        def run_pass() -> list[tuple[float, float, GreedyResult]]:
            llm.reset_prefix_cache()  # hits can only come from the pool
            timings = []
            for prompts in one_at_a_time:
                began = time.monotonic()
                (result,) = generate_greedy(llm, prompts, MAX_TOKENS)
                timings.append((began, time.monotonic() - began, result))
            return timings

        stored = run_pass()
        settle(llm)
        normal = max(seconds for _, seconds, _ in stored)
        os.kill(master.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        hung: list[tuple[float, float, GreedyResult]] = []
        try:
            while time.monotonic() - stopped < 2.5 or len(hung) < 2 * len(HUNG):
                hung += run_pass()  # well past the first call's deadline
        finally:
            os.kill(master.pid, signal.SIGCONT)
        resumed = time.monotonic()
        after: list[tuple[float, float, GreedyResult]] = []
        while not any(r.num_cached_tokens for _, _, r in after[-len(HUNG) :]):
            assert time.monotonic() - resumed < 30.0, "hits did not come back after the master resumed"
            after = run_pass()
    for first in range(0, len(hung), len(HUNG)):
        assert_same_greedy(baseline["hung"], [r for _, _, r in hung[first : first + len(HUNG)]])
    for timings in (stored, after):
        assert_same_greedy(baseline["hung"], [r for _, _, r in timings])
    assert all(r.num_cached_tokens == 0 for _, _, r in hung)
    # once the breaker is open (the first call past its deadline trips it), a request costs at most one lookup
    # deadline more than computing; the slack absorbs a loaded 2-core machine, not a stall of seconds
    bound = 1.5 * normal + DEFAULT_LOOKUP_TIMEOUT_S + 0.5
    settled = [seconds for began, seconds, _ in hung if began - stopped > 1.0]
    assert settled, "no request ran once the breaker was open"
    assert max(settled) < bound, f"requests took {max(settled):.2f} s while the master hung (bound {bound:.2f} s)"


def test_killed_segment_owner_loads_fail_and_are_recomputed(llama, baseline, masters):
    """A saves into a holder's segment; the holder is SIGKILLed; B's lookups still see the chunks (the
    master keeps a dead client's objects for client_ttl) but every get fails: B recomputes them."""
    master = masters("--client_ttl=30")  # a long window where exists says yes and gets fail
    config = mooncake_connector(master, global_segment_size=0)
    holder = SegmentHolder(master.address, 64 << 20)
    try:
        with engine(llama, block_size=BLOCK, kv_transfer_config=config) as llm:
            generate_greedy(llm, DEAD_OWNER, MAX_TOKENS)
            assert settle(llm).stats.chunks_put == 2 * (PROMPT_TOKENS // BLOCK)
        with engine(llama, block_size=BLOCK, kv_transfer_config=config) as llm:
            holder.kill()
            loaded, wall, _ = timed_generate(llm, DEAD_OWNER)
            stats = settle(llm).stats
    finally:
        holder.kill()
    complete(loaded, DEAD_OWNER)
    assert stats.loads == 2 and stats.chunks_load_failed == 2 * (256 // BLOCK) and stats.chunks_loaded == 0
    assert [r.token_ids for r in loaded] == [r.token_ids for r in baseline["dead_owner"]]
    assert wall < BATCH_BOUND_S, f"loads from a dead segment owner took {wall:.1f} s"


def test_a_chunk_damaged_in_mooncake_fails_its_seal_and_is_recomputed(llama, baseline, masters):
    """A saves with seals; each stored chunk is then replaced by a damaged copy, seal kept (a
    transfer or a segment gone bad); B's loads catch every one, recompute, count and drop them."""
    from kvpool.backends.mooncake import MooncakeBackend
    from kvpool.worker.integrity import SEAL_BYTES

    from .conftest import damage

    master = masters("--default_kv_lease_ttl=50")  # a read leases a key: let the damage replace it soon
    with SegmentHolder(master.address, 64 << 20):
        config = mooncake_connector(master, global_segment_size=0, kvpool={"integrity": "sampled"})
        with engine(llama, block_size=BLOCK, kv_transfer_config=config) as llm:
            worker = local_worker()
            assert worker is not None
            put_keys: list[str] = []
            put = worker.backend.put
            worker.backend.put = lambda keys, values: put_keys.extend(keys) or put(keys, values)  # type: ignore[method-assign]
            generate_greedy(llm, DAMAGED, MAX_TOKENS)
            settle(llm)
        assert len(put_keys) == 2 * (PROMPT_TOKENS // BLOCK)
        client = MooncakeBackend.from_options({**master.backend_options(), "global_segment_size": 0})
        try:
            for key in put_keys:
                value = np.zeros(CHUNK_BYTES + SEAL_BYTES, np.uint8)
                assert client.get_into([key], [[value]]) == [Status.OK]
                wait_until(lambda key=key: client.remove([key]) == 1, 10.0, f"removing {key}")
                assert client.put([key], [[damage(value)]]) == [Status.OK]
        finally:
            client.close()
        with engine(llama, block_size=BLOCK, kv_transfer_config=config) as llm:
            loaded = generate_greedy(llm, DAMAGED, MAX_TOKENS)
            stats = settle(llm).stats
    assert stats.chunks_corrupt == 2 * (256 // BLOCK) and stats.chunks_loaded == 0
    assert [r.token_ids for r in loaded] == [r.token_ids for r in baseline["damaged"]]
    assert stats.chunks_put == 2 * (256 // BLOCK), "the recomputed chunks were not stored again"


# ---------------------------------------------------------------------------------------------- d


def test_pool_much_smaller_than_the_workload(llama, baseline, masters):
    """A 16 MiB pool (Mooncake's smallest segment: 128 chunks) under 468 chunks (58.5 MiB) of saves, the first
    batch alone twice the pool: puts find it full (NO_AVAILABLE_HANDLE: Mooncake evicts every 10 ms, slower
    than a burst of puts fills it) and are asked again once it evicted: most chunks are stored (the first
    batch, twice the pool, cannot all be), and no request notices."""
    master = masters()
    segment = 16 << 20
    config = mooncake_connector(master, global_segment_size=segment)
    history = []
    with engine(llama, block_size=BLOCK, kv_transfer_config=config) as llm:
        for i, prompts in enumerate(PRESSURE):
            results = generate_greedy(llm, prompts, MAX_TOKENS)
            complete(results, prompts)
            assert_same_greedy(baseline[f"pressure{i}"], results)
            stats = settle(llm).stats
            history.append((stats.chunks_put, stats.chunks_put_failed, stats.full_retries, stats.pressure_events))
    chunks = sum(len(prompts) for prompts in PRESSURE) * (576 // BLOCK)
    assert history[0][2] > 0, f"the pool never refused a put: {history}"
    # a failed chunk of a running request is planned again by its next save: counted failed and stored
    assert history[-1][0] + history[-1][1] >= chunks, f"a chunk was neither stored nor failed: {history}"
    assert history[-1][0] * CHUNK_BYTES > 2 * segment, f"not even twice what the pool holds was stored: {history}"
    assert history[-1][0] >= chunks * 3 // 4, f"retried puts still lost a quarter of the chunks: {history}"


# ---------------------------------------------------------------------------------------------- TP


def test_tp_ranks_stride_puts_over_mooncake(masters, tmp_path):
    """Two client processes act as two TP ranks holding identical KV (put_step=2, ranks 0 and 1), saving
    the same requests incrementally: every chunk is put exactly once, by one rank, and the union is the
    one-rank set, stored with the right bytes."""
    from kvpool.backends.memory import MemoryBackend
    from kvpool.backends.mooncake import MooncakeBackend
    from kvpool.core.keys import chunk_hashes

    master = masters()
    namespace = uuid.uuid4().hex
    env = {**child_env(), "KVPOOL_TP_NAMESPACE": namespace}
    # this process holds the segment: the ranks are pure clients, their objects outlive them
    holder = MooncakeBackend.from_options({**master.backend_options(), "global_segment_size": 64 << 20})
    ranks: list[subprocess.Popen[str]] = []
    try:
        for rank in range(2):
            ranks.append(
                subprocess.Popen(
                    [sys.executable, str(DRIVER), "tp-rank", master.address, str(rank), "2", str(tmp_path / f"{rank}")],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
        for rank, process in enumerate(ranks):  # both set up, then both start saving at once
            read_ready(process, f"TP rank {rank}")
        for process in ranks:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        for process in ranks:
            _, err = process.communicate(timeout=120)
            assert process.returncode == 0, err[-3000:]
        outputs = [json.loads((tmp_path / f"{rank}").read_text()) for rank in range(2)]

        puts = Counter(key for out in outputs for key in out["put_keys"])
        assert puts and max(puts.values()) == 1, "a chunk was put twice (or by both ranks)"
        assert all(status == "OK" for out in outputs for status in out["put_statuses"])
        assert all(out["put_keys"] for out in outputs), "one rank stored nothing"
        one_rank = set(run_tp_rank(MemoryBackend(64 << 20), namespace, put_step=1, rank=0).put_keys)
        assert set(puts) == one_rank
        assert sum(out["stats"]["puts"] for out in outputs) == len(one_rank)

        # every chunk is in the pool with the bytes of its block
        coordinator, spaces = tp_model(namespace)
        where = {}
        for _, hashes, tables in tp_requests(namespace):
            for group, (kind, space, table) in enumerate(zip(coordinator.kinds, spaces, tables)):
                for chunk, chunk_hash in enumerate(chunk_hashes(hashes, coordinator.hash_block_size, kind.block_size)):
                    where[space.key(chunk_hash)] = (group, table[chunk])
        keys = sorted(one_rank)
        assert holder.exists(keys) == [True] * len(keys)
        # read back per layer, like a load: the holder did not write these keys, so small pieces are staged
        dests = [[np.zeros(TP_LAYER_BYTES, np.uint8) for _ in range(TP_LAYERS)] for _ in keys]
        assert holder.get_into(keys, dests) == [Status.OK] * len(keys)
        for key, dest in zip(keys, dests):
            assert b"".join(piece.tobytes() for piece in dest) == tp_expected_value(*where[key]), key
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        holder.close()


def test_kv_events_announce_what_this_engines_workers_put_into_mooncake(llama, masters, monkeypatch):
    """On Mooncake there is no index: each chunk's BlockStored comes from the worker's put, medium STORAGE,
    local (the engine gives the pool a segment of its own), chained and with its tokens exactly as vLLM's
    own event of that block; no removal is published (the master evicts without telling clients)."""
    import tempfile

    from kvpool.integrations.vllm import _LOCAL_WORKERS

    from .test_vllm_serve import EventSubscriber, per_block

    master = masters()
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    subscriber, events = EventSubscriber.on_ipc(f"{tempfile.gettempdir()}/kvpool-mc-events-{uuid.uuid4().hex[:8]}")
    try:
        config = mooncake_connector(master)
        with engine(llama, block_size=BLOCK, kv_transfer_config=config, kv_events_config=events) as llm:
            generate_greedy(llm, SHARED, MAX_TOKENS)
            settle(llm)
            assert _LOCAL_WORKERS  # the worker reported its puts from this process
            time.sleep(0.5)  # the last batches in flight
            subscriber.catch_up()  # what went out before the subscription reached the publisher
    finally:
        subscriber.close()
    stored = subscriber.of("BlockStored", "STORAGE")
    assert len(stored) == len(SHARED) * (PROMPT_TOKENS // BLOCK), stored
    gpu = subscriber.of("BlockStored", "GPU")
    own = {h: (parent, tokens) for event in gpu for h, parent, tokens in per_block(event)}
    for event in stored:
        ((block_hash, parent, tokens),) = per_block(event)
        assert (parent, tokens) == own[block_hash] and event["locality"] == "LOCAL", event
    assert sum(event["parent_block_hash"] is None for event in stored) == len(SHARED)
    assert not subscriber.of("BlockRemoved", "STORAGE")
