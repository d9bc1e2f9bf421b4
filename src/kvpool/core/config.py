"""kvpool settings, read from vLLM's `kv_connector_extra_config` and validated at start-up."""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from kvpool.core.errors import ConfigError
from kvpool.core.mooncake_options import MooncakeOptions
from kvpool.core.policy import DEFAULT_POLICY, POLICY_NAMES
from kvpool.core.sizes import parse_size

if TYPE_CHECKING:
    from kvpool.core.keys import KeySpace

__all__ = ["BACKEND_NAMES", "ConfigError", "Integrity", "KVPoolConfig", "parse_size"]

BACKEND_NAMES = ("memory", "mooncake")
DEFAULT_LOOKUP_TIMEOUT_S = 0.1  # a healthy pool answers a 32k-token lookup in 1-2 ms (Mooncake, loopback)
DISK_IO_MODES = ("buffered", "direct")  # the disk tier through the page cache, or O_DIRECT (backends/disk.py)
DEFAULT_LOOKUP_WAIT_MS = 5.0  # how long a lookup may wait for the pool's answer in the engine's call
# the longest a load may read before it is reported failed (recomputed). A healthy load must fit: a
# whole 128k-token prompt of an 8B model (16 GiB on one rank) takes 29 s at 0.6 GB/s, the low end of
# the slowest healthy tier measured (O_DIRECT disk reads, 0.56-0.90 GB/s; Mooncake over TCP 1.1-2.7).
# A stuck load holds its blocks (and its request) no longer than this
DEFAULT_LOAD_DEADLINE_S = 30.0
MAX_LOAD_DEADLINE_S = 3600.0
# the bytes (per rank) a step may load in-step, before its forward: a hit within it costs no engine step.
# On a GPU the copy runs on the engine's stream before the forward, delaying the whole batch: 64 MiB is
# ~2.5 ms at 25 GB/s (pinned host to device, PCIe 4), under a tenth of a loaded step; 512 tokens of an
# 8B-class model (128 KiB a token), or every prefix hit of a small model
DEFAULT_LOAD_IN_STEP_BYTES = 64 << 20


class Integrity(str, enum.Enum):
    """What a chunk's seal covers: nothing, sampled lines of every page, or every byte (worker/integrity.py)."""

    OFF = "off"
    SAMPLED = "sampled"
    FULL = "full"


@dataclass
class KVPoolConfig:
    """Every key of `kv_connector_extra_config` kvpool understands (docs/configuration.md has the table)."""

    backend: str = "memory"
    pool_name: str = "default"
    capacity_bytes: int = 4 << 30
    mooncake: dict[str, Any] = field(default_factory=dict)
    save_decode: bool = False
    retention_interval: int | str | None = "engine"  # "engine": the engine's own; None: every boundary
    tenant: str = ""
    model_id: str = ""
    weights_version: str = ""  # names weights kvpool cannot read (a custom loader): change it with the weights
    lookup_async: bool | None = None  # None: async when lookups leave the process
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    lookup_wait_ms: float = DEFAULT_LOOKUP_WAIT_MS
    check_exists_before_put: bool | None = None  # None: for the embedded pool only (see exists_before_put)
    put_batch_chunks: int = 64
    save_buffer_bytes: int = 1 << 30
    save_linger_steps: int = 8
    save_linger_ms: float = 20.0
    integrity: str = "off"  # "sampled" or "full": store a seal with each chunk and check it on load (integrity.py)
    load_failure_policy: str = "recompute"  # "engine": keep the engine's own policy (vLLM's default fails the request)
    pool_policy: str = DEFAULT_POLICY  # the embedded pool's admission and eviction (core/policy/); "lru": plain LRU
    disk_path: str | None = None  # the embedded pool's disk tier: one directory per rank under it (backends/disk.py)
    disk_capacity_bytes: int | str | None = None  # required with disk_path: bytes of files per rank
    disk_read_timeout_ms: float = 2000.0  # a disk read not done by then is a failed load (recomputed)
    disk_io: str = "buffered"  # or "direct": the disk tier's reads and writes past the page cache (O_DIRECT)
    load_deadline_s: float = DEFAULT_LOAD_DEADLINE_S  # a load still reading by then is failed (recomputed)
    # hits the embedded DRAM pool guarantees load in the step that schedules them, up to these bytes a step
    # per rank (0: every hit waits a step, as with a disk tier, Mooncake or integrity checks)
    load_in_step_bytes: int | str = DEFAULT_LOAD_IN_STEP_BYTES

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> KVPoolConfig:
        raw = dict(raw or {})
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - allowed)
        if unknown:
            raise ConfigError(unknown[0], raw[unknown[0]], f"one of the keys {', '.join(sorted(allowed))}")
        config = cls()
        for key, value in raw.items():
            setattr(config, key, value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.backend not in BACKEND_NAMES:
            raise ConfigError("backend", self.backend, f"one of {', '.join(BACKEND_NAMES)}")
        if not isinstance(self.pool_name, str) or not self.pool_name:
            raise ConfigError("pool_name", self.pool_name, "a non-empty string")
        self.capacity_bytes = parse_size("capacity_bytes", self.capacity_bytes)
        if not isinstance(self.mooncake, dict):
            raise ConfigError("mooncake", self.mooncake, "an object of Mooncake settings")
        if self.backend == "mooncake":
            MooncakeOptions.parse(self.mooncake)
        if not isinstance(self.save_decode, bool):
            raise ConfigError("save_decode", self.save_decode, "true or false")
        for key in ("lookup_async", "check_exists_before_put"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), bool):
                raise ConfigError(key, getattr(self, key), "true, false or null (automatic)")
        if (
            isinstance(self.save_linger_steps, bool)
            or not isinstance(self.save_linger_steps, int)
            or not (0 <= self.save_linger_steps <= 1024)
        ):
            raise ConfigError("save_linger_steps", self.save_linger_steps, "an integer from 0 to 1024")
        if (
            isinstance(self.save_linger_ms, bool)
            or not isinstance(self.save_linger_ms, (int, float))
            or not (0 <= self.save_linger_ms <= 1000)
        ):
            raise ConfigError("save_linger_ms", self.save_linger_ms, "a number of milliseconds from 0 to 1000")
        if self.retention_interval not in (None, "engine") and (
            isinstance(self.retention_interval, bool)
            or not isinstance(self.retention_interval, int)
            or self.retention_interval < 0
        ):
            raise ConfigError(
                "retention_interval", self.retention_interval, '"engine", null, 0, or a positive token count'
            )
        for key in ("tenant", "model_id", "weights_version"):
            if not isinstance(getattr(self, key), str):
                raise ConfigError(key, getattr(self, key), "a string")
        if (
            isinstance(self.lookup_timeout_s, bool)
            or not isinstance(self.lookup_timeout_s, (int, float))
            or self.lookup_timeout_s <= 0
        ):
            raise ConfigError("lookup_timeout_s", self.lookup_timeout_s, "a positive number of seconds")
        if (
            isinstance(self.lookup_wait_ms, bool)
            or not isinstance(self.lookup_wait_ms, (int, float))
            or not 0 <= self.lookup_wait_ms <= self.lookup_timeout_s * 1000
        ):
            raise ConfigError(
                "lookup_wait_ms", self.lookup_wait_ms, "milliseconds from 0 up to lookup_timeout_s (0: never wait)"
            )
        self.save_buffer_bytes = parse_size("save_buffer_bytes", self.save_buffer_bytes)
        if (
            isinstance(self.put_batch_chunks, bool)
            or not isinstance(self.put_batch_chunks, int)
            or not (1 <= self.put_batch_chunks <= 65536)
        ):
            raise ConfigError("put_batch_chunks", self.put_batch_chunks, "an integer from 1 to 65536")
        modes = [mode.value for mode in Integrity]
        if self.integrity not in modes:
            raise ConfigError("integrity", self.integrity, " or ".join(modes))
        if self.load_failure_policy not in ("recompute", "engine"):
            raise ConfigError("load_failure_policy", self.load_failure_policy, "recompute or engine")
        if self.pool_policy not in POLICY_NAMES:
            raise ConfigError("pool_policy", self.pool_policy, f"one of {', '.join(POLICY_NAMES)}")
        if (
            isinstance(self.load_deadline_s, bool)
            or not isinstance(self.load_deadline_s, (int, float))
            or not 0 < self.load_deadline_s <= MAX_LOAD_DEADLINE_S
        ):
            raise ConfigError(
                "load_deadline_s", self.load_deadline_s, f"seconds above 0, at most {MAX_LOAD_DEADLINE_S:.0f}"
            )
        self.load_in_step_bytes = parse_size("load_in_step_bytes", self.load_in_step_bytes, allow_zero=True)
        self._validate_disk()

    def in_step_loads(self) -> bool:
        """Whether hits may load in the step that schedules them: only where a load cannot fail (the hit
        contract): the embedded pool's DRAM alone (a disk read may time out; a Mooncake read leaves the
        process), and no seal to check (a mismatch is a failed load)."""
        return (
            self.load_in_step_bytes > 0  # type: ignore[operator]
            and self.backend == "memory"
            and self.disk_path is None
            and self.integrity == Integrity.OFF.value
        )

    def _validate_disk(self) -> None:
        if self.disk_io not in DISK_IO_MODES:
            raise ConfigError("disk_io", self.disk_io, f"one of {', '.join(DISK_IO_MODES)}")
        if self.disk_path is None:
            if self.disk_capacity_bytes is not None:
                raise ConfigError("disk_capacity_bytes", self.disk_capacity_bytes, "unset unless disk_path is set")
            return
        if self.backend != "memory":
            raise ConfigError(
                "disk_path", self.disk_path, "unset with the mooncake backend (a tier of the embedded pool)"
            )
        if not isinstance(self.disk_path, str) or not self.disk_path:
            raise ConfigError("disk_path", self.disk_path, "a directory path")
        if self.disk_capacity_bytes is None:
            raise ConfigError("disk_capacity_bytes", None, "a size (e.g. 64GiB) when disk_path is set")
        self.disk_capacity_bytes = parse_size("disk_capacity_bytes", self.disk_capacity_bytes)
        if (
            isinstance(self.disk_read_timeout_ms, bool)
            or not isinstance(self.disk_read_timeout_ms, (int, float))
            or not 0 < self.disk_read_timeout_ms <= 60_000
        ):
            raise ConfigError("disk_read_timeout_ms", self.disk_read_timeout_ms, "milliseconds above 0, at most 60000")

    def exists_before_put(self) -> bool:
        """Whether saves ask the pool which chunks it holds before putting them. Automatic: yes for the
        embedded pool (a dict probe that spares a copy); no for Mooncake, where the put of a key the
        pool holds is a no-op, the check is a master round trip that chunks this rank has just computed
        almost never pass, and each key it finds is leased (pinned) for the lease TTL."""
        if self.check_exists_before_put is None:
            return self.backend == "memory"
        return self.check_exists_before_put

    def backend_options(
        self, rank: int = 0, *, dp_rank: int = 0, namespaces: Sequence[KeySpace] | None = None
    ) -> dict[str, Any]:
        """The backend's own settings; `rank`, `dp_rank`: whose directory of the disk tier (each rank of
        each engine has its own); `namespaces`: the rank's key spaces, whose files its disk tier keeps
        (None: every file, for tools that open a tier without an engine)."""
        if self.backend == "memory":
            options: dict[str, Any] = {
                "name": self.pool_name,
                "capacity_bytes": self.capacity_bytes,
                "pool_policy": self.pool_policy,
            }
            if self.disk_path is not None:
                options.update(
                    disk_dir=self.disk_dir(rank, dp_rank),
                    namespaces=namespaces,
                    disk_capacity_bytes=self.disk_capacity_bytes,
                    read_timeout_s=self.disk_read_timeout_ms / 1000,
                    direct=self.disk_io == "direct",
                )
            return options
        return dict(self.mooncake)

    def disk_dir(self, rank: int, dp_rank: int = 0) -> str:
        """A rank's directory: `rank<N>` on data-parallel rank 0 (what every engine had before DP ranks
        were told apart: an upgrade keeps its tier), `dp<D>-rank<N>` on DP rank D."""
        assert self.disk_path is not None
        return os.path.join(self.disk_path, f"rank{rank}" if dp_rank == 0 else f"dp{dp_rank}-rank{rank}")
