"""The `mooncake` settings of kvpool's config: a Mooncake client's options, validated at start-up.

Invariants: user options become a `MooncakeOptions` through `parse` only, which rejects every unknown
key and bad value with a ConfigError naming the key, before any native call. Plain data: the client
that takes them is `kvpool.backends.mooncake`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvpool.core.errors import ConfigError
from kvpool.core.sizes import parse_size

_METADATA_SCHEMES = ("http://", "https://", "etcd://", "redis://")
MAX_SEGMENT_BYTES = 1 << 40  # Mooncake's MAX_SEGMENT_SIZE
MIN_SEGMENT_BYTES = 16 << 20  # smaller segments fail setup() with INVALID_PARAMS (client_buffer_allocation.cpp)


def master_endpoint(value: Any) -> tuple[str, int]:
    allowed = 'a master RPC address "host:port", e.g. "127.0.0.1:50051"'
    if not isinstance(value, str):
        raise ConfigError("master", value, allowed)
    host, sep, port = value.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError("master", value, allowed)
    return host, int(port)


@dataclass(frozen=True)
class MooncakeOptions:
    master: str = "127.0.0.1:50051"
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 1 << 30  # memory this client adds to the pool; 0 = pure client
    local_buffer_size: int = 16 << 20  # only Mooncake's bytes API uses it; kvpool moves data zero-copy
    protocol: str = "tcp"
    rdma_devices: str = ""
    setup_retries: int = 1  # x ~4.4 s when no master answers (Mooncake's own default is 20)
    prefer_local_segment: bool = True
    replica_num: int = 1
    breaker_cooldown_s: float = 2.0
    staging_bytes: int = 64 << 20
    # register the engine's KV memory (and kvpool's host staging ring) with the transfer engine; None:
    # when the protocol needs it (RDMA moves only registered memory; TCP reads any address)
    register_kv_memory: bool | None = None

    @property
    def registers_kv_memory(self) -> bool:
        return self.protocol == "rdma" if self.register_kv_memory is None else self.register_kv_memory

    @classmethod
    def allowed_keys(cls) -> list[str]:
        return [field.name for field in fields(cls)]

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> MooncakeOptions:
        """Validate user options; every bad value raises ConfigError naming the key."""
        unknown = sorted(set(options) - set(cls.allowed_keys()))
        if unknown:
            raise ConfigError(unknown[0], options[unknown[0]], f"one of the mooncake options {cls.allowed_keys()}")
        merged = {**{f.name: f.default for f in fields(cls)}, **options}
        master_endpoint(merged["master"])
        metadata = merged["metadata_server"]
        if not (isinstance(metadata, str) and (metadata == "P2PHANDSHAKE" or metadata.startswith(_METADATA_SCHEMES))):
            raise ConfigError("metadata_server", metadata, f'"P2PHANDSHAKE" or a URL starting with {_METADATA_SCHEMES}')
        if not isinstance(merged["local_hostname"], str) or not merged["local_hostname"].strip():
            raise ConfigError("local_hostname", merged["local_hostname"], "this host's address, e.g. 127.0.0.1")
        segment = parse_size("global_segment_size", merged["global_segment_size"], allow_zero=True)
        if segment and not MIN_SEGMENT_BYTES <= segment <= MAX_SEGMENT_BYTES:
            raise ConfigError(
                "global_segment_size", merged["global_segment_size"], "0 (a pure client) or between 16 MiB and 1 TiB"
            )
        if merged["protocol"] not in ("tcp", "rdma"):
            raise ConfigError("protocol", merged["protocol"], '"tcp" or "rdma"')
        if not isinstance(merged["rdma_devices"], str):
            raise ConfigError("rdma_devices", merged["rdma_devices"], 'a comma-separated device list, or "" for auto')
        for key in ("setup_retries", "replica_num"):
            if not isinstance(merged[key], int) or isinstance(merged[key], bool) or merged[key] < 1:
                raise ConfigError(key, merged[key], "an integer >= 1")
        if not isinstance(merged["prefer_local_segment"], bool):
            raise ConfigError("prefer_local_segment", merged["prefer_local_segment"], "true or false")
        if merged["register_kv_memory"] is not None and not isinstance(merged["register_kv_memory"], bool):
            raise ConfigError("register_kv_memory", merged["register_kv_memory"], "true, false or null (for RDMA)")
        cooldown = merged["breaker_cooldown_s"]
        if not isinstance(cooldown, (int, float)) or isinstance(cooldown, bool) or not 0 < cooldown <= 3600:
            raise ConfigError("breaker_cooldown_s", cooldown, "seconds, > 0 and <= 3600")
        return cls(
            master=merged["master"].strip(),
            metadata_server=metadata,
            local_hostname=merged["local_hostname"].strip(),
            global_segment_size=segment,
            local_buffer_size=parse_size("local_buffer_size", merged["local_buffer_size"], allow_zero=True),
            protocol=merged["protocol"],
            rdma_devices=merged["rdma_devices"],
            setup_retries=merged["setup_retries"],
            prefer_local_segment=merged["prefer_local_segment"],
            replica_num=merged["replica_num"],
            breaker_cooldown_s=float(cooldown),
            staging_bytes=parse_size("staging_bytes", merged["staging_bytes"], allow_zero=True),
            register_kv_memory=merged["register_kv_memory"],
        )
