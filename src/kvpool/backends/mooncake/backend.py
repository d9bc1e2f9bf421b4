"""`MooncakeBackend`: kvpool's Backend protocol over one native Mooncake Store client.

Invariants: no native call runs unless the gate admits it (breaker.py); a fault of the pool (a dead or
hung master, a closed client) answers as a per-key status, never an exception; only a caller's mistake
(mismatched lengths, an unusable buffer) raises, and before the pool is touched. Puts and gets share
one route loop (`_transfer`): they differ in the native calls, in how codes read, in that a put's
repeated key takes its first occurrence's status, and in which way staged bytes are copied.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from kvpool.backends.base import BackendStats, Status, Values
from kvpool.backends.mooncake.batch import _Batch, _duplicates, _pack, _Route, _stageable, _Staging
from kvpool.backends.mooncake.breaker import _Gate, _State
from kvpool.backends.mooncake.errors import MooncakeErrorCode, _rpc_failure, status_of
from kvpool.backends.mooncake.local_keys import _LocalKeys
from kvpool.backends.mooncake.master import port_open
from kvpool.backends.mooncake.native import _is_ip_literal, load_store_module
from kvpool.core.buffers import as_u8
from kvpool.core.errors import BackendUnavailableError
from kvpool.core.mooncake_options import MooncakeOptions, master_endpoint

log = logging.getLogger(__name__)
_T = TypeVar("_T")

MASTER_PROBE_TIMEOUT_S = 0.5
CLOSE_DRAIN_TIMEOUT_S = 70.0  # longer than two 30 s RPC timeouts of a hung master
PROBE_KEY = "kvpool/probe"  # never stored: the probe only needs an answer


class MooncakeBackend:
    """Backend over one MooncakeDistributedStore client. Thread-safe; every fault answers as a miss."""

    name = "mooncake"

    def __init__(self, options: MooncakeOptions | None = None) -> None:
        self.options = options or MooncakeOptions()
        self._master_host, self._master_port = master_endpoint(self.options.master)
        self._gate = _Gate(self.options.breaker_cooldown_s, self._master_reachable)
        self._stats = BackendStats(name=self.name, capacity_bytes=self.options.global_segment_size)
        self._stats_lock = threading.Lock()
        # one staging area per direction, so a save and a load in flight together both get one
        self._put_staging = self._get_staging = _Staging(np.empty(0, dtype=np.uint8))
        self._puts_local = False  # puts land in this client's own segment (memcpy, no staging)
        self._local_keys = _LocalKeys(0)
        self._store: Any = None
        self._replicate: Any = None
        self.segment_name = ""
        self._connect()

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> MooncakeBackend:
        return cls(MooncakeOptions.parse(options))

    # -- lifecycle

    def _connect(self) -> None:
        store_module = load_store_module()
        opts = self.options
        os.environ["MC_STORE_CLIENT_SETUP_RETRIES"] = str(opts.setup_retries)  # read by setup(), not at import
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        if opts.protocol == "tcp" and _is_ip_literal(opts.local_hostname):
            # the address the client advertises to peers; without it Mooncake picks the first non-lo interface
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", opts.local_hostname)
        store = store_module.MooncakeDistributedStore()
        code = store.setup(
            opts.local_hostname,
            opts.metadata_server,
            opts.global_segment_size,
            opts.local_buffer_size,
            opts.protocol,
            opts.rdma_devices,
            opts.master,
        )
        if code != 0:
            hint = "" if self._master_reachable() else " (nothing listens there: start one with `kvpool master`)"
            raise BackendUnavailableError(
                f"mooncake client setup against master {opts.master}{hint} failed: {MooncakeErrorCode.describe(code)}"
            )
        self._store = store
        self.segment_name = store.get_hostname()
        self._replicate = store_module.ReplicateConfig()
        self._replicate.replica_num = opts.replica_num
        if opts.prefer_local_segment and opts.global_segment_size > 0:
            self._replicate.preferred_segment = self.segment_name  # memcpy instead of TCP, ~4x faster
            self._puts_local = True
            self._local_keys = _LocalKeys(opts.global_segment_size)
        if opts.staging_bytes:
            staging = np.empty(opts.staging_bytes, dtype=np.uint8)
            half = staging.size // 2
            self._put_staging, self._get_staging = _Staging(staging[:half]), _Staging(staging[half:])
            code = store.register_buffer(staging.ctypes.data, staging.size)
            if code != 0:  # optional on TCP; RDMA transfers from it would fail
                log.warning("mooncake: registering the staging buffer failed: %s", MooncakeErrorCode.describe(code))
        self._gate.start(store.health_check, lambda: _rpc_failure(store.batch_is_exist([PROBE_KEY])))

    def close(self) -> None:
        """Idempotent. Afterwards every call answers unavailable without touching the native client."""
        drained = self._gate.begin_close(CLOSE_DRAIN_TIMEOUT_S)
        if drained is None:
            return
        if drained:
            self._store.close()
        else:
            log.warning(
                "mooncake: %d calls still in flight after %.0f s; leaving the native client open",
                self._gate.in_flight(),
                CLOSE_DRAIN_TIMEOUT_S,
            )
        self._gate.end_close()

    @property
    def closed(self) -> bool:
        return self._gate.state is not _State.READY

    @property
    def epoch(self) -> int:
        """Bumped each time the breaker trips: the master may have restarted and lost every object, so
        anything a caller remembers as stored before the bump must not be trusted."""
        return self._gate.epoch

    @property
    def native_store(self) -> Any:
        """The native `MooncakeDistributedStore` client, for benchmarks that time raw Mooncake calls on
        the same connection. Calls on it bypass every kvpool guard: the gate (a call after close()
        crashes the process), the circuit breaker, staging, duplicate-key handling and the counters.
        Nothing but benchmarks should use it."""
        return self._store

    @property
    def replicate_config(self) -> Any:
        """The native `ReplicateConfig` kvpool's puts use (replicas, preferred segment), for benchmarks
        that make the same raw calls."""
        return self._replicate

    def healthy(self) -> bool:
        return self._gate.healthy()

    def _master_reachable(self) -> bool:
        return port_open(self._master_host, self._master_port, MASTER_PROBE_TIMEOUT_S)

    def _guarded(
        self, operation: Callable[[], _T], failure_of: Callable[[_T], str | None], nbytes: int = 0
    ) -> _T | None:
        """Run one native operation if the gate admits it; None if refused."""
        ticket = self._gate.admit(nbytes)
        if ticket == _Gate.REFUSED:
            return None
        try:
            result = operation()
        except BaseException:
            self._gate.release(ticket, None, finished=False)
            raise
        self._gate.release(ticket, failure_of(result))
        return result

    # -- protocol

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        keys = list(keys)
        codes = self._guarded(lambda: self._store.batch_is_exist(keys), _rpc_failure)
        if codes is None:
            return [False] * len(keys)
        return [code == 1 for code in codes]

    def put(self, keys: Sequence[str], values: Values) -> list[Status]:
        if len(keys) != len(values):
            raise ValueError(f"put got {len(keys)} keys and {len(values)} values")
        if not keys:
            return []
        batch = _Batch(keys, values, writable=False, staging_bytes=0 if self._puts_local else self._put_staging.size)
        results = [Status.UNAVAILABLE] * len(keys)
        for index in batch.invalid:
            results[index] = Status.ERROR
        self._guarded(lambda: self._transfer(keys, batch, results, reading=False), _identity, sum(batch.totals))
        self._count_puts(keys, batch, results)
        return results

    def get_into(self, keys: Sequence[str], dests: Values) -> list[Status]:
        if len(keys) != len(dests):
            raise ValueError(f"get_into got {len(keys)} keys and {len(dests)} destinations")
        if not keys:
            return []
        local = self._local_keys
        local.check_epoch(self._gate.epoch)
        batch = _Batch(keys, dests, writable=True, staging_bytes=self._get_staging.size, local=local.__contains__)
        results = [Status.UNAVAILABLE] * len(keys)
        for index in batch.invalid:
            # an empty destination cannot match a stored value; an empty key cannot name one
            results[index] = Status.MISSING if not keys[index] else Status.SIZE_MISMATCH
        self._guarded(lambda: self._transfer(keys, batch, results, reading=True), _identity, sum(batch.totals))
        self._count_gets(batch, results)
        return results

    def remove(self, keys: Sequence[str]) -> int:
        """Forced: a read lease (granted by every get or exists for 10 s) would otherwise block it."""
        keys = [key for key in keys if key]
        if not keys:
            return 0
        codes = self._guarded(lambda: self._store.batch_remove(keys, True), _rpc_failure)
        self._local_keys.discard(keys)
        return 0 if codes is None else sum(1 for code in codes if code == 0)

    def clear(self) -> int:
        count = self._guarded(lambda: self._store.remove_all(True), lambda count: _rpc_failure([count]))
        self._local_keys.clear()
        return max(count or 0, 0)

    def stats(self) -> BackendStats:
        """Counters of this client's calls. used_bytes / keys / evictions live on the master (its
        /metrics endpoint) and are not fetched here: stats() does no I/O."""
        with self._stats_lock:
            return BackendStats(**vars(self._stats))

    def register_memory(self, buffer: Any) -> bool:
        """Register caller memory (e.g. the engine's KV tensors) with the transfer engine. Optional on
        TCP; RDMA can only move single- and multi-piece values from registered memory."""
        view = as_u8(buffer)
        return self.register_region(view.ctypes.data, view.size)

    @property
    def registers_kv_memory(self) -> bool:
        """Whether the engine's KV memory should be registered (`register_kv_memory`, or RDMA)."""
        return self.options.registers_kv_memory

    def register_region(self, address: int, nbytes: int) -> bool:
        """Register [address, address + nbytes) (host or device memory) with the transfer engine."""
        code = self._guarded(lambda: self._store.register_buffer(address, nbytes), lambda _: None)
        return code == 0

    def unregister_region(self, address: int) -> bool:
        code = self._guarded(lambda: self._store.unregister_buffer(address), lambda _: None)
        return code == 0

    def __repr__(self) -> str:
        state = self._gate.state.value
        return f"MooncakeBackend(master={self.options.master!r}, segment={self.segment_name!r}, {state})"

    # -- transfers (only called while admitted)

    def _transfer(self, keys: Sequence[str], batch: _Batch, results: list[Status], reading: bool) -> str | None:
        """Move a batch route by route: puts (`reading` False) and gets share this loop. Returns why the
        master looks gone, or None; after such a failure the remaining routes are skipped, as they would
        only stall on the same master."""
        # Mooncake lets a batch's last duplicate win; kvpool's put keeps the first (see _duplicates). Every
        # read of a repeated key sees the same stored value, so gets pass repeats through as they come.
        duplicates = {} if reading else _duplicates(keys, batch)
        staging = self._get_staging if reading else self._put_staging
        record = _record_reads if reading else _record_puts
        failure: str | None = None
        for route, indices in batch.routes.items():
            unique = [i for i in indices if i not in duplicates] if duplicates else indices
            if not unique or failure is not None:
                continue
            if route is _Route.STAGED and staging.lock.acquire(blocking=False):
                try:
                    failure = self._staged(keys, batch, unique, results, reading)
                finally:
                    staging.lock.release()
            elif route is _Route.SINGLE:
                codes = self._single(reading, *batch.single_args(keys, unique))
                failure = record(codes, batch, unique, results)
            else:  # multi, or staged while another thread holds the staging area
                codes = self._multi(reading, *batch.multi_args(keys, unique, route))
                failure = record(codes, batch, unique, results)
                if reading and MooncakeErrorCode.TRANSFER_FAIL in codes:
                    self._explain_transfer_failures(keys, batch, unique, codes, results)
        for index, first in duplicates.items():
            results[index] = results[first]
        return failure

    def _staged(
        self, keys: Sequence[str], batch: _Batch, indices: list[int], results: list[Status], reading: bool
    ) -> str | None:
        """Staged values in rounds that fit the staging area, one piece per key: a put packs each round into
        the area before its call; a get reads into the area, then scatters the values that arrived whole."""
        staging = self._get_staging if reading else self._put_staging
        record = _record_reads if reading else _record_puts
        totals = batch.totals
        for round_indices in _pack(totals, indices, staging.size):
            if reading:
                addresses = [staging.base + start for start in batch.starts(round_indices)]
            else:
                addresses = batch.pack(round_indices, staging)
            codes = self._single(
                reading, [keys[i] for i in round_indices], addresses, [totals[i] for i in round_indices]
            )
            failure = record(codes, batch, round_indices, results)
            if reading:
                batch.unpack(round_indices, [results[i] is Status.OK for i in round_indices], staging)
            if failure is not None:
                return failure
        return None

    def _single(self, reading: bool, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        """One native call moving one piece per key; a code per key."""
        if reading:
            return self._store.batch_get_into(keys, addresses, sizes)
        return self._store.batch_put_from(keys, addresses, sizes, self._replicate)

    def _multi(self, reading: bool, keys: list[str], addresses: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """One native call moving each key's pieces in place, one transfer per piece; a code per key."""
        if reading:
            return self._store.batch_get_into_multi_buffers(keys, addresses, sizes)
        return self._store.batch_put_from_multi_buffers(keys, addresses, sizes, self._replicate)

    def _explain_transfer_failures(
        self, keys: Sequence[str], batch: _Batch, indices: list[int], codes: list[int], results: list[Status]
    ) -> None:
        # multi-buffer reads report destinations larger than the object as TRANSFER_FAIL, like a dead peer
        for index, code in zip(indices, codes):
            if code == MooncakeErrorCode.TRANSFER_FAIL:
                size = self._store.get_size(keys[index])
                if size >= 0 and size != batch.totals[index]:
                    results[index] = Status.SIZE_MISMATCH

    def _count_puts(self, keys: Sequence[str], batch: _Batch, results: list[Status]) -> None:
        ok = Status.OK
        if results.count(ok) == len(results):
            stored, stored_keys, stored_bytes = len(results), keys, batch.totals
        else:
            indices = [i for i, status in enumerate(results) if status is ok]
            stored = len(indices)
            stored_keys = [keys[i] for i in indices]
            stored_bytes = [batch.totals[i] for i in indices]
        # locality only steers reads of values that could be staged: skip a Rows batch of other shapes
        if self._puts_local and stored and (batch.rows is None or _stageable(batch.sizes[0])):
            self._local_keys.add(stored_keys, stored_bytes, self._gate.epoch)
        with self._stats_lock:
            self._stats.puts += stored
            self._stats.put_bytes += sum(stored_bytes)
            self._stats.put_failures += len(results) - stored

    def _count_gets(self, batch: _Batch, results: list[Status]) -> None:
        ok = Status.OK
        if results.count(ok) == len(results):
            hits, hit_bytes, mismatches = len(results), sum(batch.totals), 0
        else:
            indices = [i for i, status in enumerate(results) if status is ok]
            hits, hit_bytes = len(indices), sum(batch.totals[i] for i in indices)
            mismatches = results.count(Status.SIZE_MISMATCH)
        with self._stats_lock:
            self._stats.gets += hits
            self._stats.hits += hits
            self._stats.get_bytes += hit_bytes
            self._stats.misses += len(results) - hits - mismatches


def _all_ok(indices: list[int], results: list[Status]) -> None:
    if len(indices) == len(results):  # the whole batch: indices are 0..n-1
        results[:] = [Status.OK] * len(results)
    else:
        for index in indices:
            results[index] = Status.OK


def _record_puts(codes: list[int], batch: _Batch, indices: list[int], results: list[Status]) -> str | None:
    """Each put's status from its code (0: stored); why the master looks gone, or None."""
    if not any(codes):  # every put stored (0 = OK): the common case, without a call per key
        _all_ok(indices, results)
        return None
    for index, code in zip(indices, codes):
        results[index] = status_of(code, reading=False)
    return _rpc_failure(codes)


def _record_reads(codes: list[int], batch: _Batch, indices: list[int], results: list[Status]) -> str | None:
    """Each get's status from its code (the bytes it read); why the master looks gone, or None."""
    totals = batch.totals
    if len(indices) == len(totals) and codes == totals:  # every read whole: the common case
        _all_ok(indices, results)
        return None
    for index, code in zip(indices, codes):
        if code >= 0:
            # a destination larger than the object reads fine and returns the smaller byte count
            results[index] = Status.OK if code == batch.totals[index] else Status.SIZE_MISMATCH
        else:
            results[index] = status_of(code, reading=True)
    return _rpc_failure(codes)


def _identity(failure: str | None) -> str | None:
    return failure
