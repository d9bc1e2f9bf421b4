"""Typed exceptions: every failure kvpool raises is a KVPoolError."""

from __future__ import annotations

import time
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


class DiskInUseError(ConfigError):
    """A disk tier's directory is owned by another process (backends/disk_owner.py): refused at start-up."""

    def __init__(self, directory: str, holder: dict[str, Any] | None) -> None:
        self.directory = directory
        self.holder = holder
        who = (
            f"pid {holder.get('pid')} on host {holder.get('host')!r} (since {_when(holder.get('started'))})"
            if holder
            else "another process (it has not recorded itself yet)"
        )
        super().__init__(
            "disk_path",
            directory,
            f"a directory no other process holds, but {directory} is held by {who}; give each engine a "
            "disk_path of its own, or stop that process first",
        )


def _when(started: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
