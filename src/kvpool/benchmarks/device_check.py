"""The device check: kvpool's worker core and embedded pool on a synthetic vLLM-shaped paged KV
cache on CUDA, with no vLLM (a lent GPU machine has torch and no network). `--dry-run` runs the same
code on the CPU, small, so `make test` exercises everything but CUDA.

The cache: per layer one tensor (2, num_blocks, block_size, kv_heads, head_dim) in bf16, vLLM's GPU
layout (K and V outermost); 32 layers, block 16, 8 KV heads x 128: a 2 MiB chunk. Checks:

1. **round trip**: save -> load is byte-exact, with the saved blocks overwritten right after the save
   (a preemption: the engine reuses them), in both runners' orders: V1 (the next step's pre-forward
   hook runs, then the engine writes the blocks) and Model Runner V2 (the engine zeroes the blocks
   before that hook).
2. **bandwidth**: save and load GB/s through kvpool's copy path (copy streams, pinned staging ring)
   against raw pinned `cudaMemcpyAsync` of the same bytes in the same run, for 256 KiB, 2 MiB and
   4 MiB chunks (target >= 0.8); also through the embedded pool (its put is a host memcpy) and the
   PCIe peak (1 GiB pinned copies).
3. **overlap**: a matmul loop on the compute stream slows by <= 3% while saves and loads run.

Prints one JSON object; exit 0 on PASS, 1 on FAIL. `scripts/device_check.sh` runs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvpool.backends.memory import MemoryBackend
from kvpool.keys import KeySpace, LayoutFingerprint
from kvpool.layout import KVLayout
from kvpool.masks import FullAttention, MaskCoordinator
from kvpool.metadata import LoadSpec, RequestDelta
from kvpool.plan import GroupPlacement
from kvpool.worker import WorkerConfig, WorkerCore

BANDWIDTH_TARGET = 0.8
OVERLAP_TARGET = 1.03
GiB = 1 << 30


@dataclass(frozen=True)
class Shape:
    layers: int = 32
    block: int = 16
    heads: int = 8
    head_dim: int = 128
    blocks: int = 2048

    @property
    def chunk_bytes(self) -> int:
        return self.layers * 2 * self.block * self.heads * self.head_dim * 2  # bf16


FULL = Shape()
BANDWIDTH_SHAPES = (Shape(layers=4, blocks=1024), Shape(layers=32, blocks=1024), Shape(layers=64, blocks=512))
DRY = Shape(layers=4, block=16, heads=2, head_dim=32, blocks=64)
DRY_BANDWIDTH = (Shape(layers=2, heads=2, head_dim=32, blocks=64), DRY)


class Rig:
    """One synthetic KV cache, the layout over it, an embedded pool and a worker core."""

    def __init__(self, shape: Shape, device: str, pool_bytes: int) -> None:
        import torch

        self.torch, self.shape, self.device = torch, shape, device
        generator = torch.Generator(device=device).manual_seed(shape.layers)
        dims = (2, shape.blocks, shape.block, shape.heads, shape.head_dim)
        self.tensors = {
            f"layer{i}": torch.randn(dims, generator=generator, device=device, dtype=torch.bfloat16)
            for i in range(shape.layers)
        }
        self.layout = KVLayout(
            self.tensors, dict.fromkeys(self.tensors, 0), shape.blocks, staged=True, staging_bytes=pool_bytes
        )
        self.pool = MemoryBackend(pool_bytes)
        kind = FullAttention(shape.block)
        space = KeySpace(LayoutFingerprint("device-check", "bf16", shape.block, device, chunk_bytes=shape.chunk_bytes))
        self.engine = WorkerCore(
            self.pool,
            MaskCoordinator([kind]),
            [GroupPlacement(space)],
            config=WorkerConfig(sync_saves=True, sync_loads=True, save_buffer_bytes=pool_bytes),
        )
        self.engine.register_layout(self.layout)
        self._requests = 0

    def blocks(self, first: int, count: int) -> list[int]:
        return list(range(first, first + count))

    def snapshot(self, blocks: list[int]) -> list[Any]:
        index = self.torch.as_tensor(blocks, device=self.device)
        return [tensor.index_select(1, index).clone() for tensor in self.tensors.values()]

    def overwrite(self, blocks: list[int], value: float) -> None:
        index = self.torch.as_tensor(blocks, device=self.device)
        for tensor in self.tensors.values():
            tensor.index_fill_(1, index, value)

    def save(self, blocks: list[int], order: str | None = None) -> tuple[str, list[bytes]]:
        """One request's prompt of len(blocks) chunks saved in one step; with an `order`, the blocks are
        overwritten right after (a preemption), as that runner does. Returns the request and its hashes."""
        self._requests += 1
        req = f"r{self._requests}"
        hashes = [hashlib.blake2b(f"{req}:{i}".encode(), digest_size=16).digest() for i in range(len(blocks))]
        tokens = len(blocks) * self.shape.block
        self.engine.apply([RequestDelta(req, new_hashes=hashes, new_blocks=([*blocks],), num_prompt_tokens=tokens + 1)])
        self.engine.save([RequestDelta(req, save_tokens=tokens, computed_before=0)])
        if order == "v2":
            self.overwrite(blocks, 0.0)  # Model Runner V2 zeroes reused blocks before the pre-forward hook
            self.engine.apply([])
        elif order == "v1":
            self.engine.apply([])  # V1: the next step's hook first, then the engine writes the blocks
            self.overwrite(blocks, -1.0)
        return req, hashes

    def load(self, hashes: list[bytes], blocks: list[int]) -> None:
        self._requests += 1
        tokens = len(blocks) * self.shape.block
        delta = RequestDelta(
            f"r{self._requests}", new_hashes=hashes, new_blocks=([*blocks],), num_prompt_tokens=tokens + 1
        )
        delta.load = LoadSpec(0, tokens)
        self.engine.apply([delta])
        self.engine.take_finished_loads()  # loads are reported finished, as the engine waits for them

    def synchronize(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def close(self) -> None:
        self.engine.close()


def round_trip(rig: Rig, chunks: int) -> dict[str, Any]:
    """Bytes loaded back equal the bytes saved, though the saved blocks were reused right after."""
    results: dict[str, Any] = {}
    for order in ("v1", "v2"):
        source = rig.blocks(1, chunks)
        target = rig.blocks(1 + chunks, chunks)
        original = rig.snapshot(source)
        _, hashes = rig.save(source, order)
        assert rig.engine.drain(60.0), "saves did not finish"
        rig.overwrite(target, 3.0)
        rig.load(hashes, target)
        rig.synchronize()
        loaded = rig.snapshot(target)
        exact = all(
            bool(rig.torch.equal(a.view(rig.torch.int16), b.view(rig.torch.int16))) for a, b in zip(original, loaded)
        )
        results[order] = {"chunks": chunks, "exact": exact, "loads_failed": rig.engine.stats.chunks_load_failed}
    results["pass"] = all(entry["exact"] for entry in results.values() if isinstance(entry, dict))
    return results


def _timed(rig: Rig, call: Any, reps: int) -> float:
    """Median seconds of `call()` (the device synchronized around each)."""
    samples = []
    for _ in range(reps + 1):
        rig.synchronize()
        began = time.perf_counter()
        call()
        rig.synchronize()
        samples.append(time.perf_counter() - began)
    return float(np.median(samples[1:]))


def bandwidth(rig: Rig, batch: int, reps: int) -> dict[str, Any]:
    torch, layout = rig.torch, rig.layout
    shape = rig.shape
    nbytes = batch * shape.chunk_bytes
    blocks = rig.blocks(1, batch)
    pinned = rig.device == "cuda"
    device_rows = torch.empty(nbytes, dtype=torch.uint8, device=rig.device)
    host_rows = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def raw_d2h() -> None:
        host_rows.copy_(device_rows, non_blocking=True)

    def raw_h2d() -> None:
        device_rows.copy_(host_rows, non_blocking=True)

    def kvpool_save() -> None:
        _, staged = layout.capture_rows(0, blocks)
        if staged is not None:
            staged.wait()

    loading = layout.load_rows(0, blocks)

    def kvpool_load() -> None:
        layout.commit_rows(0, blocks, loading, [True] * batch)

    def through_pool() -> None:
        rig.save(blocks)
        assert rig.engine.drain(60.0)

    times = {
        "raw_d2h": _timed(rig, raw_d2h, reps),
        "raw_h2d": _timed(rig, raw_h2d, reps),
        "save": _timed(rig, kvpool_save, reps),
        "load": _timed(rig, kvpool_load, reps),
        "save_through_pool": _timed(rig, through_pool, max(1, reps // 2)),
    }
    gbps = {name: nbytes / seconds / 1e9 for name, seconds in times.items()}
    return {
        "chunk_bytes": shape.chunk_bytes,
        "batch": batch,
        "gbps": {name: round(value, 2) for name, value in gbps.items()},
        "save_ratio": round(gbps["save"] / gbps["raw_d2h"], 3),
        "load_ratio": round(gbps["load"] / gbps["raw_h2d"], 3),
    }


def pcie_peak(device: str, nbytes: int) -> dict[str, float]:
    import torch

    pinned = device == "cuda"
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    result = {}
    for name, (dst, src) in {"d2h": (host, device_buffer), "h2d": (device_buffer, host)}.items():
        samples = []
        for _ in range(4):
            if pinned:
                torch.cuda.synchronize()
            began = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            if pinned:
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - began)
        result[f"{name}_gbps"] = round(nbytes / float(np.median(samples[1:])) / 1e9, 2)
    return result


def overlap(rig: Rig, size: int, iterations: int, batch: int) -> dict[str, Any]:
    """The compute stream's matmul loop alone, then while another thread saves and loads."""
    torch = rig.torch
    a = torch.randn(size, size, device=rig.device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=rig.device, dtype=torch.bfloat16)

    def loop() -> float:
        rig.synchronize()
        began = time.perf_counter()
        for _ in range(iterations):
            torch.matmul(a, b)
        rig.synchronize()
        return time.perf_counter() - began

    loop()
    alone = min(loop() for _ in range(3))
    stop = threading.Event()
    moved = [0]

    def traffic() -> None:
        blocks = rig.blocks(1, batch)
        target = rig.blocks(1 + batch, batch)
        while not stop.is_set():
            _, hashes = rig.save(blocks)
            rig.engine.drain(60.0)
            rig.load(hashes, target)
            moved[0] += 2 * batch * rig.shape.chunk_bytes

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()
    time.sleep(0.2)
    busy = min(loop() for _ in range(3))
    stop.set()
    worker.join(120)
    slowdown = busy / alone
    return {
        "alone_s": round(alone, 4),
        "with_transfers_s": round(busy, 4),
        "slowdown": round(slowdown, 4),
        "bytes_moved": moved[0],
        "pass": slowdown <= OVERLAP_TARGET,
    }


def run(dry_run: bool = False) -> dict[str, Any]:
    import torch

    device = "cpu" if dry_run else "cuda"
    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run for the CPU self-test")
    began = time.perf_counter()
    main = DRY if dry_run else FULL
    pool_bytes = (64 << 20) if dry_run else 2 * GiB
    rig = Rig(main, device, pool_bytes)
    try:
        trips = round_trip(rig, chunks=8 if dry_run else 256)
        stalls = overlap(rig, 64 if dry_run else 8192, 3 if dry_run else 50, 4 if dry_run else 64)
    finally:
        rig.close()
    rows = []
    for shape in DRY_BANDWIDTH if dry_run else BANDWIDTH_SHAPES:
        batch = 8 if dry_run else max(16, (256 << 20) // shape.chunk_bytes)  # 256 MiB a batch
        rig = Rig(shape, device, pool_bytes)
        try:
            rows.append(bandwidth(rig, batch, reps=2 if dry_run else 8))
        finally:
            rig.close()
    peak = pcie_peak(device, (8 << 20) if dry_run else GiB)
    bandwidth_pass: bool | None = all(min(row["save_ratio"], row["load_ratio"]) >= BANDWIDTH_TARGET for row in rows)
    if dry_run:  # CPU figures say nothing about a GPU: only the round trip is judged
        bandwidth_pass = stalls["pass"] = None
    verdict = trips["pass"] and bandwidth_pass is not False and stalls["pass"] is not False
    return {
        "device": torch.cuda.get_device_name() if not dry_run else "cpu (dry run: targets not judged)",
        "dry_run": dry_run,
        "shape": asdict(main),
        "round_trip": trips,
        "bandwidth": {"rows": rows, "pcie_peak": peak, "target": BANDWIDTH_TARGET, "pass": bandwidth_pass},
        "overlap": {**stalls, "target": OVERLAP_TARGET},
        "seconds": round(time.perf_counter() - began, 1),
        "verdict": "PASS" if verdict else "FAIL",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dry-run", action="store_true", help="the CPU self-test: everything but CUDA, small")
    args = parser.parse_args(argv)
    result = run(dry_run=args.dry_run)
    print(json.dumps(result, indent=2))
    print(result["verdict"], file=sys.stderr)
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
