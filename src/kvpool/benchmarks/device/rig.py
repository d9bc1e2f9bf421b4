"""The device check's rig: a synthetic vLLM-shaped KV cache, the layout over it, an embedded pool and a
worker core driven as vLLM drives it (apply before the forward, save after it), plus the probes the
phases need: long device work queued on every stream (`stall`), and a count of every host wait on
the GPU made on the engine's thread (`SyncCounter`)."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
import warnings
from typing import Any

from kvpool.backends.memory import MemoryBackend
from kvpool.benchmarks.device.cache import backing_cache, fill_random, per_layer_cache
from kvpool.benchmarks.device.plan import Shape
from kvpool.core.config import Integrity
from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.core.masks import FullAttention, MaskCoordinator
from kvpool.core.metadata import LoadSpec, RequestDelta
from kvpool.core.plan import GroupPlacement
from kvpool.worker.cuda_runtime import InlineRuntime, Runtime
from kvpool.worker.device_copy import DEVICE_BUFFER_BYTES
from kvpool.worker.layout import DEFAULT_STAGING_BYTES, KVLayout
from kvpool.worker.worker_core import WorkerConfig, WorkerCore


def staged_layout(
    tensors: dict[str, Any],
    num_blocks: int,
    integrity: Integrity = Integrity.OFF,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    runtime: Runtime | None = None,
    device_bytes: int = DEVICE_BUFFER_BYTES,
) -> KVLayout:
    """The layout over `tensors` (one KV cache group) through the device copy path, host tensors too."""
    return KVLayout(
        tensors,
        dict.fromkeys(tensors, 0),
        num_blocks,
        staged=True,
        integrity=integrity,
        staging_bytes=staging_bytes,
        runtime=runtime,
        device_bytes=device_bytes,
    )


class Rig:
    """One synthetic KV cache (`cache`: "backing", vLLM 0.32's one int8 buffer with strided per-layer
    views, or "per_layer", one tensor per layer), the layout over it, an embedded pool, a worker core."""

    def __init__(
        self,
        shape: Shape,
        device: str,
        pool_bytes: int,
        *,
        cache: str = "backing",
        integrity: Integrity = Integrity.OFF,
        sync_loads: bool = True,
        staging_bytes: int | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        import torch

        self.torch, self.shape, self.device = torch, shape, device
        self.block_dim = 1 if cache == "per_layer" else 0  # where the block index is in a layer's tensor
        if runtime is None and device == "cpu":
            runtime = InlineRuntime()
        self.runtime = runtime
        args = (torch, shape.layers, shape.blocks, shape.block, shape.heads, shape.head_dim, torch.bfloat16, device)
        if cache == "backing":
            _, self.tensors = backing_cache(*args)
        elif cache == "per_layer":
            self.tensors = per_layer_cache(*args)
        else:
            raise ValueError(f"cache {cache!r}: expected 'backing' or 'per_layer'")
        fill_random(torch, self.tensors, shape.layers)
        staging = staging_bytes if staging_bytes is not None else pool_bytes
        self.layout = staged_layout(self.tensors, shape.blocks, integrity, staging, runtime)
        self.pool = MemoryBackend(pool_bytes)
        kind = FullAttention(shape.block)
        space = KeySpace(LayoutFingerprint("device-check", "bf16", shape.block, device, chunk_bytes=shape.chunk_bytes))
        self.engine = WorkerCore(
            self.pool,
            MaskCoordinator([kind]),
            [GroupPlacement(space)],
            config=WorkerConfig(sync_saves=True, sync_loads=sync_loads, save_buffer_bytes=pool_bytes),
        )
        self.engine.register_layout(self.layout)
        self._requests = 0

    def blocks(self, first: int, count: int) -> list[int]:
        return list(range(first, first + count))

    def snapshot(self, blocks: list[int]) -> list[Any]:
        """Per layer, `blocks` of its tensor as the engine sees them (a copy, compared bitwise)."""
        index = self.torch.as_tensor(blocks, device=self.device)
        return [t.index_select(self.block_dim, index).view(self.torch.int16) for t in self.tensors.values()]

    def same(self, before: list[Any], after: list[Any]) -> bool:
        return all(bool(self.torch.equal(a, b)) for a, b in zip(before, after))

    def overwrite(self, blocks: list[int], value: float) -> None:
        index = self.torch.as_tensor(blocks, device=self.device)
        for tensor in self.tensors.values():
            tensor.index_fill_(self.block_dim, index, value)

    def hashes(self, count: int, tag: str) -> list[bytes]:
        return [hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest() for i in range(count)]

    def save(self, blocks: list[int], order: str | None = None) -> tuple[str, list[bytes]]:
        """One request's prompt of len(blocks) chunks saved in one step; with an `order`, the blocks are
        overwritten right after (a preemption), as that runner does. Returns the request and its hashes."""
        self._requests += 1
        req = f"r{self._requests}"
        hashes = self.hashes(len(blocks), req)
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

    def start_load(self, hashes: list[bytes], blocks: list[int]) -> str:
        """A request whose prompt hits `hashes` in the pool, loaded into `blocks` (async: see `finished`)."""
        self._requests += 1
        req = f"r{self._requests}"
        tokens = len(blocks) * self.shape.block
        delta = RequestDelta(req, new_hashes=hashes, new_blocks=([*blocks],), num_prompt_tokens=tokens + 1)
        delta.load = LoadSpec(0, tokens)
        self.engine.apply([delta])
        return req

    def wait_loaded(self, req: str, timeout_s: float = 60.0) -> None:
        """Until the engine is told the load finished (as vLLM polls `take_finished_loads` each step)."""
        deadline = time.monotonic() + timeout_s
        while req not in self.engine.take_finished_loads():
            if time.monotonic() > deadline:
                raise TimeoutError(f"load {req} was not reported finished in {timeout_s} s")
            time.sleep(0.001)

    def load(self, hashes: list[bytes], blocks: list[int]) -> None:
        self.wait_loaded(self.start_load(hashes, blocks))

    def synchronize(self) -> None:
        if self.device != "cpu":
            self.torch.cuda.synchronize()

    def stall(self, cycles: int, *streams: str) -> None:
        """Queue `cycles` of device sleep on the named streams ("compute": the engine's current stream;
        "gather", "copy", "load": kvpool's): work queued after it on that stream runs late, so a copy
        that misses a wait on it reads or writes too early, every time."""
        if self.device == "cpu" or not cycles:
            return
        copier = self.layout._copier
        assert copier is not None
        named = {
            "compute": self.torch.cuda.current_stream(),
            "gather": copier.gather_stream,
            "copy": copier.copy_stream,
            "load": copier.load_stream,
        }
        for name in streams:
            with self.torch.cuda.stream(named[name]):
                self.torch.cuda._sleep(cycles)

    def payload(self, blocks: list[int], seed: int) -> list[Any]:
        """Per layer, fresh random values for `blocks` (what a forward would write), ready on the device."""
        index = self.torch.as_tensor(blocks, device=self.device)
        generator = self.torch.Generator(device=self.device).manual_seed(seed)
        values = []
        for tensor in self.tensors.values():
            like = tensor.index_select(self.block_dim, index)
            values.append(self.torch.randn(like.shape, generator=generator, device=self.device, dtype=like.dtype))
        self.synchronize()
        return values

    def write(self, blocks: list[int], values: list[Any]) -> None:
        """The forward writing `blocks`, on the current stream."""
        index = self.torch.as_tensor(blocks, device=self.device)
        for tensor, value in zip(self.tensors.values(), values):
            tensor.index_copy_(self.block_dim, index, value)

    def close(self) -> None:
        self.engine.close()


class SyncCounter:
    """Every host wait on the GPU made on one thread (the engine's) while active: explicit event, stream
    and device synchronizations, and (on CUDA) the implicit ones torch's sync debug mode reports (a copy
    to or from pageable memory, `.item()`), with the time spent in the explicit ones."""

    def __init__(self, torch: Any, runtime: Runtime | None, thread: int | None = None) -> None:
        self.torch, self.runtime = torch, runtime
        self.thread = thread if thread is not None else threading.get_ident()
        self.count = 0
        self.seconds = 0.0
        self.kinds: dict[str, int] = {}
        self._undo: list[Any] = []

    def _note(self, kind: str, seconds: float = 0.0) -> None:
        if threading.get_ident() == self.thread:
            self.count += 1
            self.seconds += seconds
            self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def _wrap(self, owner: Any, name: str, kind: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            # vLLM's CPU worker swaps torch.cuda.Event for a placeholder without it (vllm.v1.worker.cpu.shm):
            # nothing to count in a process that imported it, and a GPU check imports no vLLM
            return
        counter = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                counter._note(kind, time.perf_counter() - began)

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def __enter__(self) -> SyncCounter:
        torch = self.torch
        if isinstance(self.runtime, InlineRuntime):
            self._mark = len(self.runtime.calls)
        elif torch.cuda.is_available():
            self._wrap(torch.cuda.Event, "synchronize", "event.synchronize")
            self._wrap(torch.cuda.Stream, "synchronize", "stream.synchronize")
            self._wrap(torch.cuda, "synchronize", "device.synchronize")
            self._debug = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            self._warnings = warnings.catch_warnings()
            self._warnings.__enter__()
            warnings.simplefilter("always")
            shown = warnings.showwarning

            def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
                # torch warns on the thread that synchronized: only the engine thread's count
                if "synchroniz" in str(message).lower():
                    self._note("implicit")
                else:
                    shown(message, category, *args, **kwargs)

            warnings.showwarning = show
        return self

    def __exit__(self, *exc: object) -> None:
        torch = self.torch
        if isinstance(self.runtime, InlineRuntime):
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            name = names.get(self.thread)
            for thread_name, call, _ in self.runtime.calls[self._mark :]:
                if thread_name == name and call == "synchronize":
                    self.count += 1
                    self.kinds["event.synchronize"] = self.kinds.get("event.synchronize", 0) + 1
            return
        if not torch.cuda.is_available():
            return
        for undo in reversed(self._undo):
            undo()
        torch.cuda.set_sync_debug_mode(self._debug)
        self._warnings.__exit__(None, None, None)  # showwarning back as it was


@contextlib.contextmanager
def timed() -> Any:
    began = time.perf_counter()
    box = [0.0]
    try:
        yield box
    finally:
        box[0] = time.perf_counter() - began
