"""Backend fixtures: the same contract runs on the embedded pool and on a real Mooncake master.

One mooncake_master per session on free loopback ports, one client contributing a POOL_BYTES segment
(so the Mooncake pool and the memory pool have the same capacity); cleared before every test.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvpool.backends.base import Backend
from kvpool.backends.memory import MemoryBackend
from kvpool.testing.mooncake import mooncake_or_skip

POOL_BYTES = 64 << 20
STAGING_BYTES = 4 << 20  # small, so batches of small-piece values need several staging rounds

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")




def mooncake_options(master: Any, **overrides: Any) -> dict[str, Any]:
    return {**master.backend_options(), "global_segment_size": POOL_BYTES, "staging_bytes": STAGING_BYTES, **overrides}


@pytest.fixture(scope="session")
def mooncake_available() -> None:
    """Depend on this to skip when Mooncake is not installed."""
    mooncake_or_skip()


@pytest.fixture
def client_options() -> Callable[..., dict[str, Any]]:
    """Options for a client of a given master: the contract's pool size, plus overrides."""
    return mooncake_options


@pytest.fixture(scope="session")
def mooncake_master(mooncake_available: None) -> Iterator[Any]:
    from kvpool.backends.mooncake.master import start_master

    master = start_master()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture(scope="session")
def mooncake_client(mooncake_master: Any) -> Iterator[Any]:
    from kvpool.backends.mooncake import MooncakeBackend

    client = MooncakeBackend.from_options(mooncake_options(mooncake_master))
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(params=["memory", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "memory":
        yield MemoryBackend(capacity_bytes=POOL_BYTES)
        return
    client = request.getfixturevalue("mooncake_client")
    client.clear()  # forced: also drops objects a previous test left leased
    yield client


@pytest.fixture
def pool_bytes() -> int:
    return POOL_BYTES
