"""Typed exceptions: every failure kvpool raises is a KVPoolError."""

from __future__ import annotations

from typing import Any


class KVPoolError(Exception):
    """Base class of every error raised by kvpool."""


class ConfigError(KVPoolError, ValueError):
    """A configuration value is not allowed. Names the key, the value and what is allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        super().__init__(f"kvpool config {key!r} = {value!r} is not allowed: expected {allowed}")


class LayoutError(KVPoolError, ValueError):
    """Engine data (block sizes, hashes, tensors) does not fit what kvpool was told."""


class BackendError(KVPoolError):
    """A pool backend failed."""


class BackendUnavailableError(BackendError):
    """The backend cannot be reached or is not installed; kvpool treats it as a miss."""
