"""The backend protocol every pool implements: exists / put / get_into / remove / stats / health.

A value is a sequence of buffer pieces (numpy uint8 arrays, memoryviews, anything with the buffer
protocol). A put stores the concatenation of its pieces; a get scatters the stored bytes into the
pieces, whose sizes must add up to the stored size.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvpool.errors import ConfigError

Buffer = Any  # anything exposing the buffer protocol (numpy array, memoryview, bytearray)
Value = Sequence[Buffer]


class Status(enum.IntEnum):
    """Outcome of one key in a batch call."""

    OK = 0
    FULL = 1  # no room: the put was not stored; drives the pressure gate
    MISSING = 2  # the key is not in the pool
    SIZE_MISMATCH = 3  # the destination pieces do not add up to the stored size
    UNAVAILABLE = 4  # the backend is down or unhealthy; counts as a miss
    ERROR = 5  # any other failure


@dataclass
class BackendStats:
    name: str
    capacity_bytes: int = 0
    used_bytes: int = 0
    keys: int = 0
    puts: int = 0
    put_bytes: int = 0
    put_failures: int = 0
    gets: int = 0
    get_bytes: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0


@runtime_checkable
class Backend(Protocol):
    name: str

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key; a backend fault answers False (a miss), never raises."""
        ...

    def put(self, keys: Sequence[str], values: Sequence[Value]) -> list[Status]:
        """Store each value (the concatenation of its pieces). An existing key is left as is (OK)."""
        ...

    def get_into(self, keys: Sequence[str], dests: Sequence[Value]) -> list[Status]:
        """Copy each stored value into its destination pieces."""
        ...

    def remove(self, keys: Sequence[str]) -> int:
        """Remove the keys; returns how many were removed."""
        ...

    def clear(self) -> int:
        """Remove every key; returns how many were removed."""
        ...

    def stats(self) -> BackendStats: ...

    def healthy(self) -> bool:
        """Cheap check (no I/O): False means skip the backend for now."""
        ...

    def close(self) -> None: ...


BACKEND_NAMES = ("memory", "mooncake")


def create_backend(name: str, options: dict[str, Any] | None = None) -> Backend:
    """Build a backend by name; options are the backend's own settings (already validated)."""
    options = dict(options or {})
    if name == "memory":
        from kvpool.backends.memory import shared_memory_pool

        return shared_memory_pool(**options)
    if name == "mooncake":
        from kvpool.backends.mooncake import MooncakeBackend

        return MooncakeBackend.from_options(options)
    raise ConfigError("backend", name, f"one of {', '.join(BACKEND_NAMES)}")
