"""The embedded pool's disk tier under a real vLLM CPU engine: hits beyond DRAM, hits after a restart,
damaged files recomputed, and loaded bytes that really reach the outputs."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from kvpool.backends.disk import DiskTier
from kvpool.backends.disk_file import SUFFIX
from kvpool.backends.factory import create_backend
from kvpool.backends.shared_pools import drop_shared_tiered_pools
from kvpool.backends.tiered import TieredPool
from kvpool.core.config import KVPoolConfig
from kvpool.integrations.vllm import local_worker
from kvpool.testing.engine import engine, generate_greedy

from .conftest import BLOCK, connector_config, random_prompts
from .test_vllm_serve import EventSubscriber, per_block

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16
CHUNK_BYTES = BLOCK * 4 * 2 * 2 * 64 * 2  # tokens x layers x (K, V) x KV heads x head dim x bf16


def _pool(extra: dict) -> TieredPool:
    pool = create_backend("memory", KVPoolConfig.from_dict(extra).backend_options(rank=0))
    assert isinstance(pool, TieredPool)
    return pool


def _run(
    model: Path,
    prompts: list[list[int]],
    config: dict,
    subscriber: EventSubscriber | None = None,
    **engine_args: object,
) -> tuple[list, object]:
    with engine(model, block_size=BLOCK, kv_transfer_config=config, **engine_args) as llm:
        results = generate_greedy(llm, prompts, MAX_TOKENS)
        worker = local_worker()
        assert worker is not None and worker.drain(30.0)
        stats = worker.stats
        if subscriber is not None:
            time.sleep(0.5)  # the last batch in flight
            subscriber.catch_up()  # the start's batches, published before the subscription arrived
    return results, stats


@pytest.mark.parametrize("disk_io", ["buffered", "direct"])
def test_hits_beyond_dram_and_after_a_restart_come_from_disk_with_identical_outputs(
    model_dir, pool_name, tmp_path, monkeypatch, disk_io
):
    """...and a restarted engine announces what its disk holds in its KV events, medium DISK, as the
    chains vLLM's own events name (each file keeps its chunk's parent), a parent before its children.
    In both I/O modes (`direct`: O_DIRECT, files padded to pages; the poisoned files below are written
    buffered, so a direct tier reads the other mode's files too)."""
    model = model_dir("llama")
    extra = {
        "pool_name": pool_name,
        "capacity_bytes": 5 * CHUNK_BYTES,  # DRAM: 5 of the 12 chunks the prompts make
        "disk_path": str(tmp_path / "kv"),
        "disk_capacity_bytes": "64MiB",
        "disk_io": disk_io,
    }
    config = connector_config(**extra)
    prompts = random_prompts(3, 300, seed=7)
    try:
        with engine(model, block_size=BLOCK) as llm:
            baseline = [r.token_ids for r in generate_greedy(llm, prompts, MAX_TOKENS)]

        saved, _ = _run(model, prompts, config)
        assert [r.token_ids for r in saved] == baseline
        pool = _pool(extra)
        assert pool.flush(30.0)
        assert len(pool.disk.keys()) == 12 and len(pool.memory.keys()) <= 5
        if disk_io == "direct" and not pool.disk.direct:
            pytest.skip(f"{tmp_path} is on a file system that refuses O_DIRECT (tmpfs?)")

        beyond_dram, stats = _run(model, prompts, config)
        assert [r.num_cached_tokens for r in beyond_dram] == [256, 256, 256]
        assert stats.chunks_loaded == 12 and stats.chunks_load_failed == 0  # type: ignore[attr-defined]
        assert pool.tier_stats().disk_hits >= 7, "what DRAM had evicted came from disk"
        assert [r.token_ids for r in beyond_dram] == baseline

        drop_shared_tiered_pools()  # the engine process restarts: DRAM is gone, the directory stays
        monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
        subscriber, events = EventSubscriber.on_ipc(str(tmp_path / "events"))
        try:
            restarted, stats = _run(model, prompts, config, subscriber, kv_events_config=events)
        finally:
            subscriber.close()
        assert [r.num_cached_tokens for r in restarted] == [256, 256, 256]
        assert stats.chunks_loaded == 12  # type: ignore[attr-defined]
        assert _pool(extra).tier_stats().disk_hits == 12
        assert [r.token_ids for r in restarted] == baseline
        on_disk = [block for event in subscriber.of("BlockStored", "DISK") for block in per_block(event)]
        own = {h: parent for event in subscriber.of("BlockStored", "GPU") for h, parent, _ in per_block(event)}
        assert all(own[h] == parent for h, parent, _ in on_disk), (on_disk, own)
        # the start's announcement comes first; chunks DRAM evicts again after their promotion follow it
        start = on_disk[:12]
        order = [h for h, _, _ in start]
        assert len(set(order)) == 12 and set(order) == {h for h, _, _ in on_disk}
        assert all(parent is None or order.index(parent) < order.index(h) for h, parent, _ in start)
        assert sum(parent is None for _, parent, _ in start) == 3

        # random bytes under valid seals must change the outputs: the loads above really were used
        drop_shared_tiered_pools()
        disk = DiskTier(str(tmp_path / "kv" / "rank0"), 64 << 20)
        rng = np.random.default_rng(0)
        on_disk = disk.keys()
        for key in on_disk:
            disk.remove([key])
            disk.write(key, [rng.integers(0, 256, CHUNK_BYTES, dtype=np.uint8)])
        poisoned, stats = _run(model, prompts, config)
        assert stats.chunks_loaded == 12  # type: ignore[attr-defined]
        assert [r.token_ids for r in poisoned] != baseline, "loaded KV had no effect"

        # a file damaged on disk fails its seal: recomputed, the outputs stay right
        drop_shared_tiered_pools()
        for path in (tmp_path / "kv").rglob(f"*{SUFFIX}"):
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x40  # inside the value whatever the padding
            path.write_bytes(bytes(data))
        damaged, stats = _run(model, [prompts[0]], config)
        assert stats.chunks_loaded == 0 and stats.chunks_corrupt == 4  # type: ignore[attr-defined]
        assert [damaged[0].token_ids] == baseline[:1]
        assert _pool(extra).disk.stats().corrupt == 4
    finally:
        drop_shared_tiered_pools()
