"""One owner per disk-tier directory, a directory per engine and rank (data parallel included), and a
tier that keeps only its engine's namespaces: real processes (spawned, killed, forked), real files."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.backends.base import Status
from kvpool.backends.disk import DiskTier
from kvpool.backends.disk_file import SUFFIX
from kvpool.backends.disk_owner import MANIFEST_NAME, read_holder
from kvpool.backends.factory import create_backend
from kvpool.backends.shared_pools import drop_shared_tiered_pools
from kvpool.backends.tiered import TieredPool
from kvpool.connector.roles import scheduler_role, worker_role
from kvpool.core.config import KVPoolConfig
from kvpool.core.errors import ConfigError, DiskInUseError
from kvpool.core.fingerprints import GroupFacts, ModelFacts
from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.core.plan import EngineFacts, ModelPlan, Parallelism, build_plan
from kvpool.core.specs import SpecFacts

CHUNK = 4096
WAIT_S = 30.0
OURS = KeySpace(LayoutFingerprint("tiny", "bf16", 64, "cpu", weights="w-new"))
OTHER_WEIGHTS = KeySpace(LayoutFingerprint("tiny", "bf16", 64, "cpu", weights="w-old"))
FULL = GroupFacts(SpecFacts("FullAttentionSpec", 16), dtype="bf16")


def value(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, CHUNK, dtype=np.uint8)


@pytest.fixture(autouse=True)
def _drop_pools() -> Iterator[None]:
    yield
    drop_shared_tiered_pools()


def _holder_script(directory: Path) -> str:
    return textwrap.dedent(
        f"""
        import os, time
        from kvpool.backends.disk import DiskTier
        tier = DiskTier({str(directory)!r}, 1 << 20)
        print("ready", os.getpid(), flush=True)
        time.sleep({WAIT_S})
        """
    )


def _start(script: str) -> tuple[subprocess.Popen[str], list[str]]:
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline().split()  # bounded: the child sleeps WAIT_S at most, then exits
    if not line or line[0] != "ready":
        child.kill()
        child.wait(WAIT_S)
        raise AssertionError(f"the holder did not start: {line}")
    return child, line


def _try_in_child(directory: Path) -> subprocess.CompletedProcess[str]:
    """Another process opening a tier on `directory`: exit 3 and the error's message when refused."""
    script = textwrap.dedent(
        f"""
        import sys
        from kvpool.backends.disk import DiskTier
        from kvpool.core.errors import DiskInUseError
        try:
            DiskTier({str(directory)!r}, 1 << 20)
        except DiskInUseError as error:
            print(error)
            sys.exit(3)
        """
    )
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT_S)


def test_a_second_process_is_refused_naming_the_directory_and_the_holder_and_takes_over_once_it_is_killed(
    tmp_path,
) -> None:
    directory = tmp_path / "rank0"
    holder, line = _start(_holder_script(directory))
    try:
        with pytest.raises(DiskInUseError) as refused:
            DiskTier(str(directory), 1 << 20)
        message = str(refused.value)
        assert str(directory) in message and f"pid {holder.pid}" in message, message
        assert int(line[1]) == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up runs: only the kernel releases its lock
        holder.wait(WAIT_S)
    assert read_holder(str(directory))["pid"] == holder.pid  # what the dead one left in the file
    tier = DiskTier(str(directory), 1 << 20)  # the stale lock is taken over
    assert read_holder(str(directory))["pid"] == os.getpid()
    refused_child = _try_in_child(directory)  # and now this process refuses the next
    assert refused_child.returncode == 3, refused_child.stderr
    assert f"pid {os.getpid()}" in refused_child.stdout
    tier.close()
    assert _try_in_child(directory).returncode == 0  # released: a new process owns it


def test_one_process_may_open_its_directory_again_and_holds_it_until_the_last_tier_closes(tmp_path) -> None:
    directory = tmp_path / "rank0"
    first = DiskTier(str(directory), 1 << 20)
    assert first.write(OURS.key(b"\x01" * 8), [value(1)]) is Status.OK
    second = DiskTier(str(directory), 1 << 20)  # e.g. a tool beside the engine's pool, or a test's restart
    assert second.contains(OURS.key(b"\x01" * 8))
    first.close()
    first.close()  # idempotent: releases one reference, once
    assert _try_in_child(directory).returncode == 3, "the second tier still holds it"
    second.close()
    assert _try_in_child(directory).returncode == 0


def test_a_forked_child_holds_nothing_and_keeps_no_lock_alive_when_its_parent_dies(tmp_path) -> None:
    """A child forked from the owner shares the lock's open file: were it kept, a killed owner's lock
    would live on in its children (vLLM forks workers). The child closes its copies and is refused."""
    directory = tmp_path / "rank0"
    script = textwrap.dedent(
        f"""
        import os, time
        from kvpool.backends.disk import DiskTier
        from kvpool.core.errors import DiskInUseError
        tier = DiskTier({str(directory)!r}, 1 << 20)
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:
            try:
                DiskTier({str(directory)!r}, 1 << 20)
                answer = "child-owns"
            except DiskInUseError:
                answer = "child-refused"
            os.write(write_end, answer.encode())
            time.sleep({WAIT_S})
            os._exit(0)
        print("ready", child, os.read(read_end, 64).decode(), flush=True)
        time.sleep({WAIT_S})
        """
    )
    parent, line = _start(script)
    child_pid = int(line[1])
    try:
        assert line[2] == "child-refused", line
        parent.send_signal(signal.SIGKILL)
        parent.wait(WAIT_S)
        os.kill(child_pid, 0)  # the forked child still runs, its copy of the descriptor closed
        tier = DiskTier(str(directory), 1 << 20)  # so the dead parent's lock is gone
        tier.close()
    finally:
        for pid in (parent.pid, child_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait(WAIT_S)


def _fill(directory: Path, spaces: list[KeySpace], count: int) -> None:
    tier = DiskTier(str(directory), 1 << 30)
    for space in spaces:
        for i in range(count):
            assert tier.write(space.key(bytes([i]) * 8), [value(i)], link=b"" if i == 0 else bytes([i - 1]) * 8) is (
                Status.OK
            )
    tier.close()


def test_files_of_another_namespace_are_reclaimed_at_start_up_and_never_served(tmp_path) -> None:
    disk = tmp_path / "kv"
    _fill(disk / "rank0", [OURS, OTHER_WEIGHTS], 4)
    config = KVPoolConfig.from_dict({"disk_path": str(disk), "disk_capacity_bytes": "64MiB", "pool_name": "own-ns"})
    pool = create_backend("memory", config.backend_options(0, namespaces=[OURS]))
    assert isinstance(pool, TieredPool)
    theirs = [OTHER_WEIGHTS.key(bytes([i]) * 8) for i in range(4)]
    ours = [OURS.key(bytes([i]) * 8) for i in range(4)]
    assert pool.exists(theirs) == [False] * 4 and pool.exists(ours) == [True] * 4
    dests = [[np.zeros(CHUNK, np.uint8)] for _ in theirs]
    assert pool.get_into(theirs, dests) == [Status.MISSING] * 4
    assert pool.disk_stats().reclaimed_at_scan == 4 and pool.disk_stats().files == 4
    files = sorted(p.relative_to(disk / "rank0").as_posix() for p in (disk / "rank0").rglob(f"*{SUFFIX}"))
    assert files == sorted(key + SUFFIX for key in ours), "the other weights' files are gone, not just hidden"
    assert not (disk / "rank0" / OTHER_WEIGHTS.prefix).exists(), "their emptied folders too"
    manifest = json.loads((disk / "rank0" / MANIFEST_NAME).read_text())
    assert [(ns["prefix"], ns["layout"]["weights"]) for ns in manifest["namespaces"]] == [(OURS.prefix, "w-new")]
    assert manifest["writer"]["pid"] == os.getpid()
    # the named pool reused by a later engine of this process, of other weights: shared, nothing reclaimed
    again = create_backend("memory", config.backend_options(0, namespaces=[OTHER_WEIGHTS]))
    assert again is pool and pool.exists(ours) == [True] * 4
    manifest = json.loads((disk / "rank0" / MANIFEST_NAME).read_text())
    assert [ns["prefix"] for ns in manifest["namespaces"]] == [OURS.prefix, OTHER_WEIGHTS.prefix]


def test_two_named_pools_of_one_process_are_refused_one_directory(tmp_path) -> None:
    config = {"disk_path": str(tmp_path), "disk_capacity_bytes": "1MiB"}
    create_backend("memory", KVPoolConfig.from_dict({**config, "pool_name": "a"}).backend_options())
    with pytest.raises(ConfigError, match="pool 'a'"):
        create_backend("memory", KVPoolConfig.from_dict({**config, "pool_name": "b"}).backend_options())


def _plan(config: KVPoolConfig, parallel: Parallelism) -> ModelPlan:
    return build_plan(EngineFacts(ModelFacts(model="m", device="cpu", torch_version="t"), (FULL,), parallel), config)


def test_each_data_parallel_rank_has_its_own_directory_and_dp_rank_0_keeps_todays(tmp_path) -> None:
    config = KVPoolConfig.from_dict({"disk_path": str(tmp_path), "disk_capacity_bytes": "1MiB"})
    assert config.disk_dir(1) == str(tmp_path / "rank1")  # an upgrade keeps the tiers it wrote
    assert config.disk_dir(1, dp_rank=2) == str(tmp_path / "dp2-rank1")
    assert config.backend_options(1, dp_rank=2)["disk_dir"] == str(tmp_path / "dp2-rank1")
    plan = _plan(config, Parallelism(rank=1, tp_size=2, dp_rank=3))
    assert (plan.dp_rank, plan.tp_rank) == (3, 1)


def test_a_dp_rank_1_engine_writes_and_counts_its_own_directory_only(tmp_path) -> None:
    config = KVPoolConfig.from_dict(
        {"disk_path": str(tmp_path), "disk_capacity_bytes": "64MiB", "pool_name": "dp1", "capacity_bytes": "1MiB"}
    )
    plan = _plan(config, Parallelism(dp_rank=1))
    space = plan.placements()[0].keys
    hashes = [bytes([i]) * 8 for i in range(3)]
    _fill(tmp_path / "rank0", [space], 3)  # DP rank 0's files: not this engine's to count or reclaim
    _fill(tmp_path / "dp1-rank0", [space], 2)
    worker = worker_role(config, plan)
    try:
        assert isinstance(worker.backend, TieredPool)
        assert worker.backend.disk.directory == str(tmp_path / "dp1-rank0")
        scheduler = scheduler_role(config, plan)
        assert scheduler.index is not None
        assert scheduler.index.present(0, hashes) == [True, True, False]
        assert len(list((tmp_path / "rank0").rglob(f"*{SUFFIX}"))) == 3, "DP rank 0's tier is untouched"
        scheduler.close()
    finally:
        worker.close()


def test_the_scheduler_counts_no_file_its_rank_reclaims(tmp_path) -> None:
    """Rank 0 of TP 2 keeps shard 0's keys only: a shard-1 file in its directory (the rank order or the
    TP size changed) and another weights' file are reclaimed by the rank, so not counted before it reports."""
    config = KVPoolConfig.from_dict(
        {"disk_path": str(tmp_path), "disk_capacity_bytes": "64MiB", "pool_name": "tp2", "capacity_bytes": "1MiB"}
    )
    plans = [_plan(config, Parallelism(rank=rank, tp_size=2)) for rank in (0, 1)]
    shard0, shard1 = (plan.placements()[0].keys for plan in plans)
    old = KeySpace(LayoutFingerprint(**{**vars(shard0.fingerprint), "weights": "old"}))
    _fill(tmp_path / "rank0", [shard0], 1)
    _fill(tmp_path / "rank1", [shard1], 1)
    stray = [bytes([9]) * 8]
    tier = DiskTier(str(tmp_path / "rank0"), 1 << 30)
    for space in (shard0, shard1, old):  # a chunk of both shards and of old weights, all in rank 0's directory
        assert tier.write(space.key(stray[0]), [value(9)], link=b"") is Status.OK
    tier.close()
    scheduler = scheduler_role(config, plans[0])
    assert scheduler.index is not None
    assert scheduler.index.present(0, [bytes([0]) * 8]) == [True]
    # rank 1 holds no shard-1 copy: the one in rank 0's directory is reclaimed there, never served
    assert scheduler.index.present(0, stray) == [False]
    scheduler.close()
    worker = worker_role(config, plans[0])
    try:
        assert isinstance(worker.backend, TieredPool)
        assert worker.backend.disk_stats().reclaimed_at_scan == 2  # shard 1's and the old weights'
    finally:
        worker.close()
