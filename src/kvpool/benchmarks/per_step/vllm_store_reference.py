"""vLLM 0.32's own `MooncakeStoreConnector`, both roles in this process, for `bench connector-step`.

What is vLLM's code, unchanged: the connector class (`vllm.distributed.kv_transfer.kv_connector.v1.
mooncake.store.connector.MooncakeStoreConnector`) built through its real `__init__` for the scheduler
role (`MooncakeStoreScheduler`, its `LookupKeyClient`) and the worker role (`MooncakeStoreWorker`: its
own `MooncakeDistributedStore` client set up from `MOONCAKE_CONFIG_PATH`, `LookupKeyServer` on rank 0,
`register_kv_caches` registering the CPU tensors with the store and starting the real
`KVCacheStoreSendingThread` and receive thread). Every per-step call goes through the connector's
public methods; the sending thread runs its own `_handle_request` (store_mask, process_tokens, key_for,
batch_is_exist, prepare_values, batch_put_from_multi_buffers).

What is reconstructed, because this machine has no GPU and no torch.distributed group:
* TP/PCP/DCP rank lookups (`get_tensor_model_parallel_rank` & co., imported by the worker module) are
  answered as TP=1 rank 0 while the worker is constructed.
* `torch.cuda.Event` (recorded in `wait_for_save`, synchronized by the sending thread) is a no-op
  stand-in while the bench runs: on a GPU it costs a record (~µs) plus a wait for the forward.
* Nothing else: the Mooncake client, master and KV bytes are real (the master runs on 127.0.0.1 and
  the worker's client mounts the only segment, so puts are local memcpy as in vLLM's embedded mode).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import tempfile
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

CONNECTOR = "MooncakeStoreConnector"
SEGMENT_BYTES = 1 << 30  # this client's share of the pool (faulted in lazily)
LOCAL_BUFFER_BYTES = 16 << 20  # only Mooncake's bytes API uses it; vLLM's store path is zero-copy
STOP_TIMEOUT_S = 5.0


class _NoCudaEvent:
    """Stand-in for `torch.cuda.Event` on a machine without CUDA: the forward already ran."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def cpu_only_patches() -> Iterator[None]:
    """TP=1 rank 0 for the worker module's rank lookups, and a no-op CUDA event; restored on exit."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as worker_module

    single = SimpleNamespace(world_size=1, rank_in_group=0)
    replaced: dict[str, Any] = {
        "get_tensor_model_parallel_rank": lambda: 0,
        "get_tensor_model_parallel_world_size": lambda: 1,
        "get_pcp_group": lambda: single,
        "get_dcp_group": lambda: single,
    }
    saved = {name: getattr(worker_module, name) for name in replaced}
    saved_event = torch.cuda.Event
    try:
        for name, value in replaced.items():
            setattr(worker_module, name, value)
        torch.cuda.Event = _NoCudaEvent  # type: ignore[misc,assignment]
        yield
    finally:
        for name, value in saved.items():
            setattr(worker_module, name, value)
        torch.cuda.Event = saved_event  # type: ignore[misc]


def transfer_config(lookup_port: int) -> dict[str, Any]:
    """kv_transfer_config for vLLM's connector; `save_decode_cache` is its switch for decode KV."""
    return {
        "kv_connector": CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"save_decode_cache": True, "lookup_rpc_port": lookup_port},
    }


def store_config(master_address: str, mode: str, global_segment_size: int, local_buffer_size: int) -> dict[str, Any]:
    """What vLLM's Mooncake store reads from MOONCAKE_CONFIG_PATH, over TCP to `master_address`."""
    return {
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": master_address,
        "protocol": "tcp",
        "device_name": "",
        "mode": mode,
        "global_segment_size": global_segment_size,
        "local_buffer_size": local_buffer_size,
    }


@contextlib.contextmanager
def mooncake_config_file(master_address: str) -> Iterator[str]:
    """The store config vLLM's worker reads from MOONCAKE_CONFIG_PATH, set for the duration."""
    config = store_config(master_address, "embedded", SEGMENT_BYTES, LOCAL_BUFFER_BYTES)
    previous = os.environ.get("MOONCAKE_CONFIG_PATH")
    with tempfile.TemporaryDirectory(prefix="kvpool-vllm-mooncake-") as folder:
        path = os.path.join(folder, "mooncake.json")
        with open(path, "w") as sink:
            json.dump(config, sink)
        os.environ["MOONCAKE_CONFIG_PATH"] = path
        try:
            yield path
        finally:
            if previous is None:
                os.environ.pop("MOONCAKE_CONFIG_PATH", None)
            else:
                os.environ["MOONCAKE_CONFIG_PATH"] = previous


class VllmStorePair:
    """vLLM's MooncakeStoreConnector, scheduler and worker roles; call inside `cpu_only_patches()` and
    `mooncake_config_file()`."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import MooncakeStoreConnector

        self.worker = MooncakeStoreConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        self.scheduler: Any = None
        try:
            self.worker.register_kv_caches(kv_caches)
            self.scheduler = MooncakeStoreConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        except BaseException:
            self.close()
            raise
        assert self.worker.connector_worker is not None
        self._worker = self.worker.connector_worker

    def drain(self, timeout_s: float) -> None:
        """Wait (bounded, blocking) until the sending thread has handled every queued store job."""
        thread = self._worker.kv_send_thread
        if thread is not None:
            _join(thread.request_queue, timeout_s)

    def stored(self, hashes: list[bytes]) -> int:
        """How many of these chunk hashes have this rank's key in the store."""
        if not hashes:
            return 0
        from vllm.v1.core.kv_cache_utils import BlockHash

        layout = self._worker.token_dbs[0].store_layout
        keys = [layout.key_for(0, BlockHash(h)) for h in hashes]
        return sum(1 for flag in self._worker.store.batch_is_exist(keys) if flag == 1)

    def close(self) -> None:
        client = None
        if self.scheduler is not None and self.scheduler.connector_scheduler is not None:
            client = self.scheduler.connector_scheduler.client
        worker = self.worker.connector_worker
        server = worker.lookup_server if worker is not None else None
        if server is not None:
            # a zmq socket may not be closed under the thread blocked in its recv (libzmq aborts the
            # process): stop the server's loop with one last request, then close it from here
            server.running = False
            if client is not None and server.thread.is_alive():
                client.socket.send(b"kvpool-bench-stop")
                if client.socket.poll(int(STOP_TIMEOUT_S * 1000)):
                    client.socket.recv()
            server.thread.join(STOP_TIMEOUT_S)
            if not server.thread.is_alive():
                server.close()
        if client is not None:
            client.close()
        # joins the queues (5 s at most) and closes the store; vLLM's send/receive threads have no stop
        # signal and stay parked on their empty queues (daemon threads, no CPU)
        self.worker.shutdown()


def _join(jobs: queue.Queue[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with jobs.all_tasks_done:
        while jobs.unfinished_tasks:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"vLLM's store jobs did not finish within {timeout_s:.0f} s")
            jobs.all_tasks_done.wait(remaining)
