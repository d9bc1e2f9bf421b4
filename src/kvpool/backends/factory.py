"""Backends by name, as configuration names them.

Invariants: this module sits above every backend and nothing in backends/ imports it, so base.py (the
protocol) imports no backend and no backend imports back up: no import circle. Each backend's module
is imported only when asked for, so kvpool works without Mooncake installed.
"""

from __future__ import annotations

from typing import Any

from kvpool.backends.base import Backend
from kvpool.core.config import BACKEND_NAMES
from kvpool.core.errors import ConfigError


def create_backend(name: str, options: dict[str, Any] | None = None) -> Backend:
    """Build a backend by name; options are the backend's own settings (already validated)."""
    options = dict(options or {})
    if name == "memory" and "disk_dir" in options:
        from kvpool.backends.shared_pools import shared_tiered_pool

        return shared_tiered_pool(**options)
    if name == "memory":
        from kvpool.backends.shared_pools import shared_memory_pool

        return shared_memory_pool(**options)
    if name == "mooncake":
        from kvpool.backends.mooncake import MooncakeBackend

        return MooncakeBackend.from_options(options)
    raise ConfigError("backend", name, f"one of {', '.join(BACKEND_NAMES)}")
