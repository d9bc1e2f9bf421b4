"""KV memory registration: a backend whose transport moves only registered memory (Mooncake over RDMA,
or `register_kv_memory: true`) gets every region a transfer touches registered when the layout is, and
unregistered at close. On TCP registering is legal, so the real call path runs here."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvpool.backends.memory import MemoryBackend
from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.core.masks import FullAttention, MaskCoordinator
from kvpool.core.metadata import LoadSpec, RequestDelta
from kvpool.core.plan import GroupPlacement
from kvpool.worker.layout import KVLayout
from kvpool.worker.worker_core import WorkerConfig, WorkerCore

BLOCKS = 8


class Registering(MemoryBackend):
    registers_kv_memory = True

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.regions: dict[int, int] = {}
        self.calls: list[str] = []

    def register_region(self, address: int, nbytes: int) -> bool:
        self.calls.append("register")
        self.regions[address] = nbytes
        return True

    def unregister_region(self, address: int) -> bool:
        self.calls.append("unregister")
        return self.regions.pop(address, None) is not None


def _engine(backend: Any, layout: KVLayout) -> WorkerCore:
    space = KeySpace(LayoutFingerprint("m", "u8", 16, "test"))
    engine = WorkerCore(backend, MaskCoordinator([FullAttention(16)]), [GroupPlacement(space)], config=WorkerConfig())
    engine.register_layout(layout)
    return engine


def _layout() -> tuple[KVLayout, dict[str, np.ndarray]]:
    tensors = {f"l{i}": np.random.default_rng(i).integers(0, 256, (BLOCKS, 512), dtype=np.uint8) for i in range(2)}
    return KVLayout(tensors, dict.fromkeys(tensors, 0), BLOCKS), tensors


def test_the_kv_memory_is_registered_with_the_layout_and_unregistered_at_close():
    layout, tensors = _layout()
    backend = Registering()
    engine = _engine(backend, layout)
    assert backend.regions == {t.ctypes.data: t.nbytes for t in tensors.values()}
    engine.close()
    assert backend.regions == {} and backend.calls == ["register"] * 2 + ["unregister"] * 2


def test_a_backend_that_needs_no_registration_is_never_asked():
    layout, _ = _layout()
    engine = _engine(MemoryBackend(1 << 20), layout)  # no registers_kv_memory: nothing to call
    engine.close()


@pytest.mark.mooncake
def test_registered_kv_memory_moves_over_mooncake_and_is_unregistered(mooncake_master: Any, client_options: Any):
    from kvpool.backends.mooncake import MooncakeBackend

    backend = MooncakeBackend.from_options(client_options(mooncake_master, register_kv_memory=True))
    assert backend.registers_kv_memory
    layout, tensors = _layout()
    engine = _engine(backend, layout)
    try:
        hashes = [bytes([i]) * 16 for i in range(2)]
        engine.apply([RequestDelta("a", new_hashes=hashes, new_blocks=([1, 2],), num_prompt_tokens=40)])
        engine.save([RequestDelta("a", save_tokens=32)])
        assert engine.drain(10)
        assert engine.stats.chunks_put == 2
        load = RequestDelta("b", new_hashes=hashes, new_blocks=([5, 6],), num_prompt_tokens=40)
        load.load = LoadSpec(0, 32)
        engine.apply([load])
        assert engine.loads.loader.drain(10) and engine.stats.chunks_loaded == 2
        for tensor in tensors.values():
            assert np.array_equal(tensor[[5, 6]], tensor[[1, 2]])
        registered = list(engine._registered)
        assert len(registered) == 2  # both layer tensors
    finally:
        engine.close()
        backend.clear()
    try:
        assert engine._registered == []
        assert not any(backend.unregister_region(address) for address in registered)  # already unregistered
    finally:
        backend.close()
