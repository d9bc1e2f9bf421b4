"""roles: what each connector role runs for a config: the scheduler's lookup source and load mode,
the worker's pool and threads. No engine, no Mooncake (a remote pool is a recording fake)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from kvpool.backends.memory import MemoryBackend
from kvpool.backends.shared_pools import drop_shared_memory_pools
from kvpool.connector.roles import scheduler_role, worker_config, worker_role
from kvpool.core.config import KVPoolConfig
from kvpool.core.fingerprints import GroupFacts, ModelFacts
from kvpool.core.plan import EngineFacts, ModelPlan, Parallelism, build_plan
from kvpool.core.specs import SpecFacts
from kvpool.worker.pool_tracker import PoolTracker
from test_scheduler import hashes_for
from worker_fakes import RecordingBackend

MODEL = ModelFacts(model="m", device="cuda", torch_version="t")
FULL = GroupFacts(SpecFacts("FullAttentionSpec", 16), dtype="bf16")
SLIDING = GroupFacts(SpecFacts("SlidingWindowSpec", 16, sliding_window=32), dtype="bf16")
MOONCAKE = {"backend": "mooncake", "mooncake": {"master": "127.0.0.1:50051"}}


def plan_for(config: KVPoolConfig, *groups: GroupFacts, parallel: Parallelism | None = None) -> ModelPlan:
    return build_plan(EngineFacts(MODEL, groups or (FULL,), parallel or Parallelism()), config)


class RemotePool(RecordingBackend):
    """Stands in for a remote pool (not a MemoryBackend): records how it was made and what was asked."""

    def __init__(self, name: str, options: dict[str, Any]) -> None:
        super().__init__()
        self.made = (name, options)
        self.closed = False
        self.clear_raises = False

    def clear(self) -> int:
        if self.clear_raises:
            raise ConnectionError("pool unreachable")
        return super().clear()

    def close(self) -> None:
        self.closed = True
        super().close()


def remote_pools() -> tuple[list[RemotePool], Any]:
    made: list[RemotePool] = []

    def make(name: str, options: dict[str, Any]) -> RemotePool:
        made.append(RemotePool(name, options))
        return made[-1]

    return made, make


# ---- scheduler --------------------------------------------------------------------------------


def test_embedded_pools_are_looked_up_in_the_index_synchronously() -> None:
    config = KVPoolConfig()
    role = scheduler_role(config, plan_for(config))
    assert role.index is not None and role.backend is None
    assert role.core.index is role.index
    assert not role.core.config.lookup_async
    assert role.core.lookup("r", hashes_for("p", 8), 129) == 0  # answered by the index: exists would raise
    with pytest.raises(AssertionError, match="index"):
        role.core.exists(["k"])
    role.close()


def test_the_index_counts_a_chunk_once_every_replica_holds_it() -> None:
    config = KVPoolConfig()
    plan = plan_for(config, parallel=Parallelism(tp_size=2, kv_tp_replicas=2))
    role = scheduler_role(config, plan)
    assert role.index is not None
    hashes = hashes_for("p", 8)
    space = plan.placements()[0].keys
    for rank, hit in ((0, 0), (1, 128)):
        report = PoolTracker(rank, [space], [space.key(h) for h in hashes]).take_report()
        assert report is not None
        role.index.apply(report)
        assert role.core.longest_hit(hashes, 129) == hit


def test_the_local_workers_pool_counts_from_the_first_lookup() -> None:
    """Same process: an earlier engine's saves in the embedded pool hit at once."""
    config = KVPoolConfig()
    plan = plan_for(config)
    hashes = hashes_for("p", 8)
    space = plan.placements()[0].keys
    tracker = PoolTracker(plan.rank, [space], [space.key(h) for h in hashes])
    role = scheduler_role(config, plan, track_events=True, local_tracker=tracker)
    assert role.index is not None and role.index.track_events
    assert role.core.lookup("r", hashes, 129) == 128
    assert tracker.take_report() is None  # taken by the scheduler


def test_a_remote_pool_is_asked_through_the_schedulers_own_zero_segment_client() -> None:
    config = KVPoolConfig.from_dict(MOONCAKE)
    made, make = remote_pools()
    role = scheduler_role(config, plan_for(config), make_backend=make)
    (pool,) = made
    assert pool.made == ("mooncake", {**config.backend_options(), "global_segment_size": 0})
    assert role.backend is pool and role.index is None
    assert role.core.config.lookup_async  # lookups leave the process
    assert role.core.longest_hit(hashes_for("p", 8), 129) == 0
    assert len(pool.exists_keys) == 8  # one key per chunk, asked of the pool
    role.close()
    assert pool.closed


@pytest.mark.parametrize("backend", ["memory", "mooncake"])
@pytest.mark.parametrize("lookup_async", [True, False])
def test_lookup_async_may_be_set_either_way(backend: str, lookup_async: bool) -> None:
    config = KVPoolConfig.from_dict({**MOONCAKE, "backend": backend, "lookup_async": lookup_async})
    role = scheduler_role(config, plan_for(config), make_backend=remote_pools()[1])
    assert role.core.config.lookup_async is lookup_async
    role.close()


def test_the_scheduler_passes_its_settings_to_the_core() -> None:
    config = KVPoolConfig.from_dict({"save_decode": True, "lookup_timeout_s": 0.5})
    role = scheduler_role(config, plan_for(config))
    assert (role.core.config.save_decode, role.core.config.lookup_timeout_s) == (True, 0.5)


def test_a_reset_empties_a_remote_pool_at_once_and_says_when_it_could_not() -> None:
    config = KVPoolConfig.from_dict(MOONCAKE)
    made, make = remote_pools()
    role = scheduler_role(config, plan_for(config), make_backend=make)
    made[0].put(["k"], [[b"x"]])
    assert role.reset()
    assert made[0].inner.keys() == [] and role.core.reset_epoch == 1
    made[0].clear_raises = True
    assert not role.reset()
    assert role.core.reset_epoch == 2  # lookups miss from now on all the same
    embedded = KVPoolConfig()
    assert scheduler_role(embedded, plan_for(embedded)).reset()  # the workers empty theirs at their next step


# ---- worker -----------------------------------------------------------------------------------


def test_an_embedded_pool_is_put_and_loaded_on_the_engine_thread() -> None:
    config = worker_config(KVPoolConfig.from_dict({"save_linger_ms": 5, "save_linger_steps": 3}))
    assert config.sync_saves and config.sync_loads and config.check_exists_before_put
    assert (config.save_linger_s, config.save_linger_steps) == (0.005, 3)
    remote = worker_config(KVPoolConfig.from_dict({**MOONCAKE, "put_batch_chunks": 8, "save_buffer_bytes": "1MiB"}))
    assert not (remote.sync_saves or remote.sync_loads or remote.check_exists_before_put)
    assert (remote.put_batch_chunks, remote.save_buffer_bytes) == (8, 1 << 20)


def test_an_embedded_worker_tracks_its_pool_for_the_scheduler(pool_name: str) -> None:
    config = KVPoolConfig.from_dict({"pool_name": pool_name, "capacity_bytes": "1MiB"})
    plan = plan_for(config)
    role = worker_role(config, plan)
    assert isinstance(role.backend, MemoryBackend) and role.tracker is not None
    assert role.core.backend is role.backend and role.core.tracker is role.tracker
    key = plan.placements()[0].keys.key(b"\x01" * 16)
    role.backend.put([key], [[b"x"]])
    role.tracker.stored([key])
    role.tracker.take_report()
    role.backend.remove([key])  # the pool's removals reach the tracker
    report = role.tracker.take_report()
    assert report is not None and report.dropped
    role.close()
    role.backend.put([key], [[b"x"]])
    role.backend.remove([key])  # closed: the pool outlives the worker, the tracker no longer listens
    assert role.tracker.take_report() is None


def test_a_remote_worker_keeps_no_tracker() -> None:
    config = KVPoolConfig.from_dict(MOONCAKE)
    made, make = remote_pools()
    role = worker_role(config, plan_for(config), make_backend=make)
    (pool,) = made
    assert pool.made == ("mooncake", config.backend_options())  # the worker's client lends its segment
    assert role.tracker is None and role.core.tracker is None and not role.core.config.sync_saves
    role.close()
    assert pool.closed


@pytest.fixture
def pool_name() -> Iterator[str]:
    yield "test-roles"
    drop_shared_memory_pools()


def test_the_core_modules_import_no_engine() -> None:
    code = (
        "import sys, kvpool.core.plan, kvpool.core.fingerprints, kvpool.connector.roles, kvpool.scheduler.load_watch,"
        " kvpool.connector.registry;"
        "bad = [m for m in ('vllm', 'mooncake', 'torch') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_pool_under_eight_engine_steps_of_saves_loads_every_hit_async_on_every_role() -> None:
    """The hit contract's reserve holds what two or three steps of saves evict: a pool smaller than
    eight of the engine's largest steps loads every hit async (scheduler: no in-step budget; worker: no
    holder), a larger one takes in-step hits and holds what leaves it."""
    step_tokens, token_bytes = 2048, 8192  # 16 MiB a step: vllm serve's CPU default, the serve bench's model
    for capacity, contract in ((56 << 20, False), (128 << 20, True)):
        config = KVPoolConfig(capacity_bytes=capacity, pool_name=f"contract-{capacity}")
        plan = replace(plan_for(config), step_tokens=step_tokens, bytes_per_token=token_bytes)
        assert plan.holds_contract(capacity) is contract
        scheduler = scheduler_role(config, plan)
        assert (scheduler.core.config.in_step_bytes > 0) is contract
        worker = worker_role(config, plan)
        try:
            assert isinstance(worker.backend, MemoryBackend)
            assert bool(worker.backend._holders) is contract
        finally:
            worker.close()
            drop_shared_memory_pools()
    unknown = plan_for(KVPoolConfig())  # no engine sizes known (a plan built without vLLM): the settings decide
    assert unknown.holds_contract(1 << 20)
