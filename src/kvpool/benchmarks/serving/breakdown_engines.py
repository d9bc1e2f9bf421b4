"""The engines a breakdown runs: a fresh Mooncake pool, each connector's kv_transfer_config on it, an
in-process engine that drains its saves and stops vLLM's lookup thread before it goes, and a fill of
the pool. Shared by the step breakdown (`breakdown.py`) and its py-spy profile (`breakdown_profile.py`).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

SEGMENT_BYTES = 512 << 20


def pool() -> contextlib.AbstractContextManager[Any]:
    """A fresh master and one segment holder: no system sees another's (or an earlier round's) chunks."""
    from kvpool.benchmarks.serving.serve_systems import mooncake_pool

    return mooncake_pool(SEGMENT_BYTES)


@contextlib.contextmanager
def connector(system: str, master: Any, wait_ms: float | None) -> Iterator[dict[str, Any]]:
    """The kv_transfer_config of `system` on the master (as `kvpool bench serve` lays them out); vLLM's
    store config file set for the duration."""
    from kvpool.backends.mooncake.master import free_port

    if system == "kvpool-mooncake":
        options = {**master.backend_options(), "global_segment_size": 0}
        extra: dict[str, Any] = {"backend": "mooncake", "mooncake": options}
        if wait_ms is not None:
            extra["lookup_wait_ms"] = wait_ms
        yield {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        return
    from kvpool.benchmarks.per_step.vllm_store_reference import store_config

    previous = os.environ.get("MOONCAKE_CONFIG_PATH")
    with tempfile.TemporaryDirectory(prefix="kvpool-breakdown-") as folder:
        path = os.path.join(folder, "mooncake.json")
        with open(path, "w") as sink:
            json.dump(store_config(master.address, "standalone-store", 0, 64 << 20), sink)
        os.environ["MOONCAKE_CONFIG_PATH"] = path
        try:
            yield {
                "kv_connector": "MooncakeStoreConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"lookup_rpc_port": free_port()},
            }
        finally:
            if previous is None:
                os.environ.pop("MOONCAKE_CONFIG_PATH", None)
            else:
                os.environ["MOONCAKE_CONFIG_PATH"] = previous


@contextlib.contextmanager
def engine(model: str, config: dict[str, Any], settings: dict[str, Any]) -> Iterator[Any]:
    """An in-process engine; vLLM's connector's lookup thread is stopped before the engine goes (it
    has no stop of its own, and a second engine in the process would otherwise hang)."""
    from kvpool.testing import engine as testing_engine

    fresh = {**config, "kv_connector_extra_config": dict(config["kv_connector_extra_config"])}
    if "lookup_rpc_port" in fresh["kv_connector_extra_config"]:
        from kvpool.backends.mooncake.master import free_port

        fresh["kv_connector_extra_config"]["lookup_rpc_port"] = free_port()
    with testing_engine.engine(model, kv_transfer_config=fresh, **settings) as llm:
        try:
            yield llm
        finally:
            drain(llm)
            stop_vllm_lookup(llm)


def drain(llm: Any, timeout_s: float = 60.0) -> None:
    """Every save of the engine reached the pool (bounded)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvpool.integrations.vllm import local_worker

    worker = get_kv_transfer_group()
    deadline = time.monotonic() + timeout_s
    core = getattr(worker, "connector_worker", None)
    if core is None:
        kvpool_worker = local_worker()
        if kvpool_worker is not None:
            kvpool_worker.drain(timeout_s)
    else:
        thread = core.kv_send_thread
        while thread is not None and thread.request_queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
    for _ in range(3):  # deliver finished saves (delayed frees) to the scheduler
        llm.llm_engine.step()


def stop_vllm_lookup(llm: Any) -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = getattr(get_kv_transfer_group(), "connector_worker", None)
    server = getattr(worker, "lookup_server", None)
    if server is None:
        return
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler
    client = scheduler.client
    server.running = False
    if server.thread.is_alive():
        client.socket.send(b"kvpool-bench-stop")  # its answer to an unknown message ends the loop
        if client.socket.poll(5000):
            client.socket.recv()
    server.thread.join(5.0)
    if not server.thread.is_alive():
        server.close()
    client.close()


def fill(model: str, config: dict[str, Any], workload: Any, settings: dict[str, Any]) -> None:
    from kvpool.testing.engine import generate_greedy

    with engine(model, config, settings) as llm:
        generate_greedy(llm, workload.sources, 2, logprobs=0)
