"""The systems `kvpool bench serve` puts behind vLLM's OpenAI server, each with what it needs running.

One system, one server: `start(name, capacity_bytes)` yields the `kv_transfer_config`, environment
and server flags for `openai_server`, with the system's own services (a mooncake_master, a segment
holder, LMCache's server) running until the context exits. Every pool gets the same capacity.

* `none`: no connector and vLLM's prefix caching off: every request computes its whole prompt (the
  baseline every ratio divides by).
* `local`: no connector, vLLM's own prefix cache on (vLLM's default): what the engine gives alone;
  its hit on a prompt sent again at once is the floor for any hit.
* `example`: vLLM's `ExampleConnector` (whole requests as files in a temporary folder).
* `vllm-mooncake`: vLLM's `MooncakeStoreConnector` on a real mooncake_master, its client giving no
  memory (its `standalone-store` mode) and a standalone segment holder giving the pool's.
* `vllm-mooncake-embedded`: the same connector in its documented default, `embedded` mode: the
  server's worker gives the pool's memory (its segment, and a local transfer buffer of the same size),
  so puts and gets on one host are copies inside the server's process.
* `lmcache`: vLLM's `LMCacheMPConnector` to LMCache's multi-process server (`lmcache_peer`).
* `kvpool`: kvpool, embedded pool (like for like with `vllm-mooncake-embedded`). `kvpool-mooncake`:
  kvpool on a real master and segment holder, laid out as for `vllm-mooncake`.
* `kvpool-disk`: `kvpool` with the same DRAM and a disk tier (`TIER_DISK_FACTOR` times it, in a
  temporary folder on the working directory's disk) below it: what the tier adds when the working set
  outgrows DRAM (it does: every pool is a third of it). Not in `kvpool bench all` (`--long` has it).

`SystemSetup.pids`: the system's own processes outside the server (master, segment holder, LMCache's
server), whose CPU time is the system's too. `start_shared(name, capacity_bytes, servers)`: the same
master and segment holder of `vllm-mooncake` or `kvpool-mooncake`, with settings for several servers
that share the pool (`kvpool bench shared`).

vLLM's `OffloadingConnector` and `SimpleCPUOffloadConnector` are in `UNSUPPORTED`: they refuse to
start on vLLM's CPU build (CUDA/XPU only). So is `LMCacheConnectorV1` (LMCache in the server, its
local CPU backend, as LMCache's CPU-offloading guide sets it up): it starts, but lmcache 0.5.6 finds no
CPU transfer path ("No supported cpu connector found"), runs "in degraded mode (recompute)", and every
lookup then times out (3 s) with no hit. The bench tries each and reports how it failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

SYSTEMS = (
    "none", "local", "example", "vllm-mooncake", "vllm-mooncake-embedded", "lmcache", "kvpool", "kvpool-mooncake",
    "kvpool-disk",
)  # fmt: skip
TIER_SYSTEMS = ("kvpool-disk",)  # kvpool with a tier below its DRAM, measured against `kvpool`
TIER_DISK_FACTOR = 4
PEERS = ("vllm-mooncake", "vllm-mooncake-embedded", "lmcache")  # the connectors kvpool is measured against
# kvpool system -> the peer in the same placement: (peer, what they share)
LIKE_FOR_LIKE = {
    "kvpool-mooncake": ("vllm-mooncake", "both on one mooncake_master and one standalone segment holder"),
    "kvpool": ("vllm-mooncake-embedded", "both pools in the server's own process"),
}
KVPOOL_SYSTEMS = ("kvpool", "kvpool-mooncake")
SHARED_SYSTEMS = ("kvpool-mooncake", "vllm-mooncake")  # one master and segment holder for several servers
POOL_SHARING = (*SHARED_SYSTEMS, "lmcache")  # the systems whose one pool several servers can use
UNSUPPORTED = {
    "OffloadingConnector": {"cpu_bytes_to_use": 256 << 20},
    "SimpleCPUOffloadConnector": {},
    "LMCacheConnectorV1": {},  # LMCache in the server's worker, its local CPU backend (`lmcache_peer.in_process_setup`)
}
KVPOOL_MODULE = "kvpool.integrations.vllm"


@dataclass
class SystemSetup:
    """What `openai_server` needs for one system."""

    kv_transfer_config: dict[str, Any] | None
    env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)  # the system's processes outside the server
    master_admin: str = ""  # the admin HTTP address of the system's mooncake_master, if it has one


@contextlib.contextmanager
def start(name: str, capacity_bytes: int) -> Iterator[SystemSetup]:
    """Run `name`'s services for the duration; yields the server settings that reach them."""
    if name == "none":
        yield SystemSetup(None, extra_args=["--no-enable-prefix-caching"])
    elif name == "local":
        yield SystemSetup(None)
    elif name == "example":
        with tempfile.TemporaryDirectory(prefix="kvpool-bench-example-") as folder:
            yield SystemSetup(
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": folder},
                }
            )
    elif name == "kvpool":
        yield SystemSetup(_kvpool({"capacity_bytes": capacity_bytes}))
    elif name == "kvpool-disk":
        with tempfile.TemporaryDirectory(prefix="kvpool-bench-disk-", dir=os.getcwd()) as folder:
            disk = {"disk_path": folder, "disk_capacity_bytes": TIER_DISK_FACTOR * capacity_bytes}
            yield SystemSetup(_kvpool({"capacity_bytes": capacity_bytes, **disk}))
    elif name in SHARED_SYSTEMS:
        with start_shared(name, capacity_bytes, servers=1) as (setup,):
            yield setup
    elif name == "vllm-mooncake-embedded":
        from kvpool.backends.mooncake.master import start_master

        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        with start_master() as master, _vllm_mooncake_config(master.address, "embedded", capacity_bytes) as path:
            yield _vllm_mooncake(path, [master.pid], _free_port())
    elif name == "lmcache":
        from kvpool.benchmarks.serving import lmcache_peer

        with lmcache_peer.lmcache_mp_server(capacity_bytes=capacity_bytes) as peer:
            yield SystemSetup(dict(peer.kv_transfer_config), env=dict(peer.env), pids=[peer.process.pid])
    else:
        raise ValueError(f"system {name!r}: expected one of {', '.join(SYSTEMS)}")


@contextlib.contextmanager
def start_shared(name: str, capacity_bytes: int, servers: int = 2) -> Iterator[list[SystemSetup]]:
    """One pool for `servers` servers: `name`'s master and segment holder (`SHARED_SYSTEMS`), and the
    settings of each server, every one a client of that pool (what one stores, another finds)."""
    if name not in POOL_SHARING:
        raise ValueError(f"system {name!r}: a shared pool is one of {', '.join(POOL_SHARING)}")
    if name == "lmcache":  # one LMCache MP server, every server's LMCacheMPConnector its client
        from kvpool.benchmarks.serving import lmcache_peer

        with lmcache_peer.lmcache_mp_server(capacity_bytes=capacity_bytes) as peer:
            setup = SystemSetup(dict(peer.kv_transfer_config), env=dict(peer.env), pids=[peer.process.pid])
            yield [replace(setup) for _ in range(servers)]
        return
    with mooncake_pool(capacity_bytes) as (master, pids):
        admin = f"http://{master.host}:{master.metrics_port}"
        if name == "kvpool-mooncake":
            options = {**master.backend_options(), "global_segment_size": 0}
            config = _kvpool({"backend": "mooncake", "mooncake": options})
            yield [SystemSetup(config, env=_mooncake_env(), pids=pids, master_admin=admin) for _ in range(servers)]
        else:
            with _vllm_mooncake_config(master.address, "standalone-store", 0, 64 << 20) as path:
                ports: set[int] = set()
                while len(ports) < servers:  # each server's lookup socket is named by its port
                    ports.add(_free_port())
                yield [_vllm_mooncake(path, pids, port, admin) for port in sorted(ports)]


def unsupported_setup(connector: str) -> SystemSetup:
    """The server settings for a connector of `UNSUPPORTED` (expected to fail at start, or to start unable
    to serve a hit)."""
    if connector == "LMCacheConnectorV1":
        from kvpool.benchmarks.serving import lmcache_peer

        config, env = lmcache_peer.in_process_setup(capacity_bytes=256 << 20)
        return SystemSetup(config, env=env)
    return SystemSetup(
        {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": UNSUPPORTED[connector]}
    )


def _kvpool(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": KVPOOL_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def _mooncake_env() -> dict[str, str]:
    return {"MC_TCP_BIND_ADDRESS": "127.0.0.1", "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}


def _free_port() -> int:
    from kvpool.backends.mooncake.master import free_port

    return free_port()


@contextlib.contextmanager
def mooncake_pool(capacity_bytes: int) -> Iterator[tuple[Any, list[int]]]:
    """A master on 127.0.0.1 and one segment holder giving the pool `capacity_bytes`; with their pids."""
    from kvpool.backends.mooncake.master import start_master
    from kvpool.backends.mooncake.segment_holder import SegmentHolder

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    master = start_master()
    try:
        with SegmentHolder(master.address, capacity_bytes) as holder:
            yield master, [master.pid, holder.process.pid]
    finally:
        master.stop()


def _vllm_mooncake(config_path: str, pids: list[int], lookup_port: int, admin: str = "") -> SystemSetup:
    return SystemSetup(
        {
            "kv_connector": "MooncakeStoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lookup_rpc_port": lookup_port},
        },
        env={**_mooncake_env(), "MOONCAKE_CONFIG_PATH": config_path},
        pids=pids,
        master_admin=admin,
    )


@contextlib.contextmanager
def _vllm_mooncake_config(
    master_address: str, mode: str, segment_bytes: int, local_buffer_bytes: int | None = None
) -> Iterator[str]:
    """The file vLLM's Mooncake store reads from MOONCAKE_CONFIG_PATH. `standalone-store`: a client that
    gives no memory; `embedded`: the client gives the segment, and a local buffer of the same size."""
    from kvpool.benchmarks.per_step.vllm_store_reference import store_config

    local = segment_bytes if local_buffer_bytes is None else local_buffer_bytes
    config = store_config(master_address, mode, segment_bytes, local)
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-vllm-mooncake-") as folder:
        path = os.path.join(folder, "mooncake.json")
        with open(path, "w") as sink:
            json.dump(config, sink)
        yield path
