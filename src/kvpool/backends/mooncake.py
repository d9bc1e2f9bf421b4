"""The distributed pool: kvpool's Backend protocol over a real Mooncake Store (`mooncake.store`).

Three things shape this file (measured facts in shared/reference/mooncake-store.md):
- The native client segfaults when used before setup() or after close(), so every native call passes
  a gate (state + in-flight count) and close() waits for in-flight calls before closing the client.
- A dead master makes every RPC block ~4.3 s (a hung one: 30 s). A circuit breaker (health_check before
  each batch, trip on RPC_FAIL or on any call overrunning its deadline) answers "unavailable" at once,
  for everyone, until a probe - a real RPC with a short deadline on its own thread - is answered in time.
  No call ever queues behind one stuck in the client.
- Mooncake charges ~25 µs per buffer piece over TCP, so values made of many small pieces are staged into
  one registered contiguous buffer and moved as one piece per key.
"""

from __future__ import annotations

import ctypes
import enum
import ipaddress
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import numpy as np

from kvpool.backends.base import BackendStats, Rows, Status, Value, Values
from kvpool.buffers import as_u8
from kvpool.errors import BackendUnavailableError, ConfigError
from kvpool.mooncake_master import INSTALL_HINT, port_open
from kvpool.sizes import parse_size

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Over TCP each buffer piece costs ~25 µs (under load; less on an idle host), so values made of small
# pieces are staged: one extra local copy, one piece per key on the wire. Measured on loopback, 4-piece
# values vs Mooncake's multi-buffer calls: 16-32 KiB pieces move 1.2-1.4x faster staged, 64 KiB pieces
# 1.1x faster unstaged. Local transfers (own segment) are never staged (see _Batch).
SMALL_PIECE_BYTES = 64 << 10
# Staging Rows: a fancy-index gather costs one numpy call per layer but passes over the bytes twice;
# copying row by row costs ~0.4 µs of Python a piece and one pass. Measured crossover: ~4 KiB rows.
FANCY_GATHER_BYTES = 4 << 10
MASTER_PROBE_TIMEOUT_S = 0.5
_U8 = np.dtype(np.uint8)
CLOSE_DRAIN_TIMEOUT_S = 70.0  # longer than two 30 s RPC timeouts of a hung master
STALL_GRACE_S = 0.5  # metadata RPCs take < 10 ms; a call past this (plus its transfer time) is stuck
PROBE_DEADLINE_S = 0.25  # a healthy master answers batch_is_exist of one key in ~0.1 ms
PROBE_KEY = "kvpool/probe"  # never stored: the probe only needs an answer
STALL_MIN_BYTES_PER_S = 100e6  # 8x below TCP loopback: a slow but moving transfer is not a stall


class MooncakeErrorCode(enum.IntEnum):
    """Mooncake's ErrorCode (mooncake-store/include/types.h); calls return these as negative ints."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SHARD_INDEX_OUT_OF_RANGE = -100
    SEGMENT_NOT_FOUND = -101
    SEGMENT_ALREADY_EXISTS = -102
    CLIENT_NOT_FOUND = -103
    NO_AVAILABLE_HANDLE = -200
    INVALID_VERSION = -300
    INVALID_KEY = -400
    WRITE_FAIL = -500
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    INVALID_WRITE = -700
    INVALID_READ = -701
    INVALID_REPLICA = -702
    REPLICA_IS_NOT_READY = -703
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    OBJECT_HAS_REPLICATION_TASK = -708
    OBJECT_NO_REPLICATION_TASK = -709
    REPLICA_NOT_FOUND = -710
    REPLICA_ALREADY_EXISTS = -711
    REPLICA_IS_GONE = -712
    TRANSFER_FAIL = -800
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    ETCD_OPERATION_ERROR = -1000
    UNAVAILABLE_IN_CURRENT_STATUS = -1010
    UNAVAILABLE_IN_CURRENT_MODE = -1011

    @classmethod
    def describe(cls, code: int) -> str:
        try:
            return f"{cls(code).name} ({code})"
        except ValueError:
            return f"mooncake error {code}"


_RPC_FAILURES = frozenset({MooncakeErrorCode.RPC_FAIL, MooncakeErrorCode.RPC_TIMEOUT})
_CODE_STATUS: dict[int, Status] = {
    MooncakeErrorCode.NO_AVAILABLE_HANDLE: Status.FULL,
    MooncakeErrorCode.OBJECT_NOT_FOUND: Status.MISSING,
    MooncakeErrorCode.RPC_FAIL: Status.UNAVAILABLE,
    MooncakeErrorCode.RPC_TIMEOUT: Status.UNAVAILABLE,
}


def status_of(code: int, *, reading: bool = False) -> Status:
    """The kvpool status of one Mooncake return code. INVALID_PARAMS on a read means the destination
    does not match the stored size; on a write it is a rejected value."""
    if code >= 0:
        return Status.OK
    if reading and code == MooncakeErrorCode.INVALID_PARAMS:
        return Status.SIZE_MISMATCH
    return _CODE_STATUS.get(code, Status.ERROR)


# ---------------------------------------------------------------------------------------------- options

_METADATA_SCHEMES = ("http://", "https://", "etcd://", "redis://")
MAX_SEGMENT_BYTES = 1 << 40  # Mooncake's MAX_SEGMENT_SIZE
MIN_SEGMENT_BYTES = 16 << 20  # smaller segments fail setup() with INVALID_PARAMS (client_buffer_allocation.cpp)


def _master_endpoint(value: Any) -> tuple[str, int]:
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
        _master_endpoint(merged["master"])
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
        )


def load_store_module() -> Any:
    """`mooncake.store`, imported on first use so kvpool works without Mooncake installed."""
    try:
        from mooncake import store
    except (ImportError, OSError) as exc:  # OSError: libibverbs.so.1 missing on some loaders
        raise BackendUnavailableError(
            f"the mooncake backend needs the Mooncake store client: {INSTALL_HINT}; "
            f"importing mooncake.store failed: {exc}"
        ) from exc
    return store


# ---------------------------------------------------------------------------------------------- batches


class _Route(enum.Enum):
    SINGLE = "single"  # one piece: moved in place with batch_put_from / batch_get_into
    STAGED = "staged"  # small pieces: packed into the staging buffer, one piece per key
    MULTI = "multi"  # large pieces: batch_*_multi_buffers, one transfer per piece


_from_buffer = ctypes.c_char.from_buffer
_addressof = ctypes.addressof
_FAST_PATH_ERRORS = (TypeError, ValueError, AttributeError, BufferError)


class _Batch:
    """Every value of one call as the byte sizes of its pieces, split by route, with what each route
    needs: the pieces of staged values (packed into or scattered from the staging area by `pack` and
    `unpack`) and the addresses of the others (Mooncake reads or writes those in place; the caller's
    values keep that memory alive for the call). All are taken before any native call, so an unusable
    buffer raises before the pool is touched.

    Costs: a `Rows` batch takes a few Python steps per array and per value, not per piece. Lists of
    pieces take ~0.3 µs a piece on the common case (contiguous numpy arrays), and their staging copies
    go view to view (a memoryview slice assignment is a plain memcpy with ~0.15 µs of overhead, a fifth
    of a ctypes.memmove call); anything else (torch tensors, bytes, read-only, non-contiguous or empty
    pieces) takes the general path (as_u8).

    `local`: keys whose transfer stays in this process (Mooncake's memcpy path). Pieces cost next to
    nothing there, so their values are never staged: staging would add a copy to a copy."""

    __slots__ = ("invalid", "ptrs", "routes", "rows", "sizes", "totals", "views")

    def __init__(
        self,
        keys: Sequence[str],
        values: Values,
        writable: bool,
        staging_bytes: int,
        local: Callable[[str], bool] | None = None,
    ) -> None:
        single: list[int] = []
        staged: list[int] = []
        multi: list[int] = []
        self.routes: dict[_Route, list[int]] = {_Route.SINGLE: single, _Route.STAGED: staged, _Route.MULTI: multi}
        self.invalid: list[int] = []  # empty key or empty value
        self.views: list[list[memoryview]] = []  # per value; filled for staged values of a list batch
        self.ptrs: list[list[int]] = []  # per value; filled for the values moved in place
        self.rows: Rows | None = None
        if isinstance(values, Rows):
            self._init_rows(keys, values, writable, staging_bytes, local)
            return
        try:  # the whole batch at once: comprehensions cost far less per piece than a loop
            self.sizes = [[piece.nbytes for piece in value] for value in values]
        except AttributeError:  # bytes and other plain buffers
            self.sizes = [[as_u8(piece).size for piece in value] for value in values]
        self.totals = totals = [sum(sizes) for sizes in self.sizes]
        for index, (key, sizes, total) in enumerate(zip(keys, self.sizes, totals)):
            if not key or not total:
                self.invalid.append(index)
            elif len(sizes) == 1:
                single.append(index)
            elif total <= staging_bytes and _stageable(sizes) and not (local and local(key)):
                staged.append(index)
            else:
                multi.append(index)
        self.views = [[] for _ in keys]
        self.ptrs = [[] for _ in keys]
        try:
            self._prepare(values, writable)
        except _FAST_PATH_ERRORS:
            self._prepare_general(values, writable)

    def _init_rows(
        self,
        keys: Sequence[str],
        rows: Rows,
        writable: bool,
        staging_bytes: int,
        local: Callable[[str], bool] | None,
    ) -> None:
        arrays = rows.arrays
        if writable and not all(array.flags.writeable for array in arrays):
            raise TypeError("a destination array is read-only")
        sizes = [array.shape[1] for array in arrays]
        if 0 in sizes:  # Mooncake skips empty pieces: drop them
            arrays = tuple(array for array in arrays if array.shape[1])
            sizes = [size for size in sizes if size]
            rows = Rows(arrays, rows.ids) if arrays else rows
        total = sum(sizes)
        count = len(keys)
        self.rows = rows
        self.sizes = [sizes] * count
        self.totals = [total] * count
        if not total:
            self.invalid.extend(range(count))
            return
        single, staged, multi = self.routes.values()
        if len(sizes) == 1:
            route = single
        elif total <= staging_bytes and _stageable(sizes):
            route = staged
        else:
            route = multi
        self.ptrs = [[] for _ in keys]
        if all(keys) and (route is not staged or local is None):
            route.extend(range(count))  # the common case: one route for the whole batch
        else:
            for index, key in enumerate(keys):
                if not key:
                    self.invalid.append(index)
                elif route is staged and local is not None and local(key):
                    multi.append(index)
                else:
                    route.append(index)
        self._fill_addresses(single if route is single else multi)

    def _prepare(self, values: Sequence[Value], writable: bool) -> None:
        views, ptrs, sizes = self.views, self.ptrs, self.sizes
        staged = self.routes[_Route.STAGED]
        for index in staged:
            views[index] = [memoryview(piece).cast("B") for piece in values[index]]
        if staged and (
            True in [0 in sizes[i] for i in staged]
            or (writable and True in [view.readonly for i in staged for view in views[i]])
        ):
            raise ValueError("empty or read-only pieces")  # the general path drops or names them
        address, from_buffer = _addressof, _from_buffer  # from_buffer refuses read-only and empty pieces
        for index in (*self.routes[_Route.SINGLE], *self.routes[_Route.MULTI]):
            ptrs[index] = [address(from_buffer(piece)) for piece in values[index]]

    def _prepare_general(self, values: Sequence[Value], writable: bool) -> None:
        staged = set(self.routes[_Route.STAGED])
        for indices in self.routes.values():
            for index in indices:
                u8 = _u8_views(values[index], writable)
                self.sizes[index] = [view.size for view in u8]
                self.views[index] = [view.data for view in u8] if index in staged else []
                self.ptrs[index] = [] if index in staged else [int(view.ctypes.data) for view in u8]

    def single_args(self, keys: Sequence[str], indices: list[int]) -> tuple[list[str], list[int], list[int]]:
        """Keys, addresses and sizes of one-piece values, as batch_put_from / batch_get_into take them."""
        whole = len(indices) == len(keys)
        return _pick(keys, indices, whole), [self.ptrs[i][0] for i in indices], _pick(self.totals, indices, whole)

    def multi_args(
        self, keys: Sequence[str], indices: list[int], route: _Route
    ) -> tuple[list[str], list[list[int]], list[list[int]]]:
        """Keys, piece addresses and piece sizes, as the multi-buffer calls take them. Staged values that go
        in place after all (another call holds the staging area) get their addresses taken here."""
        if route is _Route.STAGED:
            self._fill_addresses(indices)
        whole = len(indices) == len(keys)
        ptrs = self.ptrs
        addresses = ptrs if len(indices) == len(ptrs) else [ptrs[index] for index in indices]
        return _pick(keys, indices, whole), addresses, _pick(self.sizes, indices, whole)

    def _fill_addresses(self, indices: list[int]) -> None:
        if not indices:
            return
        ptrs = self.ptrs
        if self.rows is not None:
            columns = [(_base_address(array), array.strides[0]) for array in self.rows.arrays]
            ids = self.rows.ids.tolist()
            if len(indices) == len(ptrs):  # the whole batch: one comprehension
                self.ptrs = [[base + row * stride for base, stride in columns] for row in ids]
                return
            for index in indices:
                row = ids[index]
                ptrs[index] = [base + row * stride for base, stride in columns]
        else:  # staged list values: from their byte views
            for index in indices:
                ptrs[index] = [_base_address(view) for view in self.views[index]]

    def pack(self, indices: list[int], staging: _Staging) -> list[int]:
        """Copy the values at `indices` back to back into the staging area; their addresses there."""
        starts = self.starts(indices)
        if self.rows is not None:
            region = self._region(len(indices), staging)
            ids = self.rows.ids[indices]
            area, blocks = staging.view, ids.tolist()
            offset = 0
            for array in self.rows.arrays:
                width = array.shape[1]
                if width < FANCY_GATHER_BYTES:
                    region[:, offset : offset + width] = array[ids]  # one numpy op, but two passes
                else:
                    for start, block in zip(starts, blocks):
                        area[start + offset : start + offset + width] = array[block].data
                offset += width
        else:
            area, views, sizes = staging.view, self.views, self.sizes
            for index, start in zip(indices, starts):
                for view, size in zip(views[index], sizes[index]):
                    area[start : start + size] = view
                    start += size
        return [staging.base + start for start in starts]

    def unpack(self, indices: list[int], arrived: list[bool], staging: _Staging) -> None:
        """Scatter the values at `indices`, laid out as `pack` lays them, from the staging area into
        their pieces: only those that `arrived` whole."""
        if self.rows is not None:
            region = self._region(len(indices), staging)
            ids = self.rows.ids[indices]
            if not all(arrived):
                region, ids = region[arrived], ids[arrived]
            offset = 0
            for array in self.rows.arrays:
                width = array.shape[1]
                array[ids] = region[:, offset : offset + width]
                offset += width
            return
        area, views, sizes = staging.view, self.views, self.sizes
        for index, start, ok in zip(indices, self.starts(indices), arrived):
            if ok:
                for view, size in zip(views[index], sizes[index]):
                    view[:] = area[start : start + size]
                    start += size

    def starts(self, indices: list[int]) -> list[int]:
        """Offsets of the values at `indices` laid back to back, as `pack` lays them."""
        starts = []
        offset = 0
        totals = self.totals
        for index in indices:
            starts.append(offset)
            offset += totals[index]
        return starts

    def _region(self, count: int, staging: _Staging) -> np.ndarray:
        total = self.totals[0]
        return staging.array[: count * total].reshape(count, total)


def _base_address(array: Any) -> int:
    try:
        return _addressof(_from_buffer(array))  # a quarter of the cost of .ctypes.data
    except TypeError:  # read-only
        return int(np.frombuffer(array, dtype=np.uint8).ctypes.data)


def _pick(items: Sequence[_T], indices: list[int], whole: bool) -> list[_T]:
    """items[i] for i in indices; `whole`: indices are every index in order (the common case)."""
    return list(items) if whole else [items[i] for i in indices]


def _u8_views(value: Value, writable: bool) -> list[np.ndarray]:
    views = []
    for piece in value:
        view = as_u8(piece)
        if writable and not view.flags.writeable:
            raise TypeError("a destination piece is read-only")
        if view.size:  # Mooncake skips empty pieces; drop them before they reach a pointer list
            views.append(view)
    return views


def _duplicates(keys: Sequence[str], batch: _Batch) -> dict[int, int]:
    """Later occurrences of a key -> the index of its first one, whose status they share.
    Mooncake lets the last duplicate win within a batch; kvpool's contract is the first, as across calls."""
    if len(set(keys)) == len(keys):
        return {}
    first: dict[str, int] = {}
    duplicates: dict[int, int] = {}
    for index in sorted(i for indices in batch.routes.values() for i in indices):
        seen = first.setdefault(keys[index], index)
        if seen != index:
            duplicates[index] = seen
    return duplicates


def _pack(totals: list[int], indices: list[int], capacity: int) -> list[list[int]]:
    """Split indices into consecutive rounds whose totals fit the staging buffer."""
    rounds: list[list[int]] = [[]]
    used = 0
    for index in indices:
        if used + totals[index] > capacity and rounds[-1]:
            rounds.append([])
            used = 0
        rounds[-1].append(index)
        used += totals[index]
    return [r for r in rounds if r]


class _Staging:
    """One contiguous area that small pieces are packed into (puts) or scattered from (gets); the lock
    keeps one call at a time on it (another takes the multi-buffer route meanwhile)."""

    __slots__ = ("array", "base", "lock", "size", "view")

    def __init__(self, area: np.ndarray) -> None:
        self.array = area
        self.view = area.data
        self.base = int(area.ctypes.data)
        self.size = int(area.size)
        self.lock = threading.Lock()


class _LocalKeys:
    """Keys this client stored in its own segment, newest last, bounded by the segment's bytes (it
    cannot hold more) and an entry cap. A hint only: a key wrongly taken for local (evicted, then
    stored elsewhere by another client) is still read correctly, just without staging."""

    MAX_ENTRIES = 1 << 18

    def __init__(self, capacity_bytes: int) -> None:
        self._capacity = capacity_bytes
        self._sizes: OrderedDict[str, int] = OrderedDict()  # popitem(last=False) stays O(1)
        self._bytes = 0
        self._epoch = 0
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def add(self, keys: Sequence[str], sizes: Sequence[int], epoch: int) -> None:
        with self._lock:
            self._check_epoch(epoch)
            entries = self._sizes
            fresh = [(key, size) for key, size in zip(keys, sizes) if key not in entries]
            if fresh:
                entries.update(fresh)
                self._bytes += sum(size for _, size in fresh)
            while entries and (self._bytes > self._capacity or len(entries) > self.MAX_ENTRIES):
                self._bytes -= entries.popitem(last=False)[1]

    def discard(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._bytes -= self._sizes.pop(key, 0)

    def check_epoch(self, epoch: int) -> None:
        """The breaker tripped since the last call: the master may have restarted and lost everything."""
        if epoch != self._epoch:
            with self._lock:
                self._check_epoch(epoch)

    def clear(self) -> None:
        with self._lock:
            self._sizes.clear()
            self._bytes = 0

    def _check_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            self._epoch = epoch
            self._sizes.clear()
            self._bytes = 0


# ---------------------------------------------------------------------------------------------- gate


class _State(enum.Enum):
    READY = "ready"
    CLOSING = "closing"
    CLOSED = "closed"


class _Gate:
    """Decides whether a native call may run: the client's lifecycle state and a circuit breaker, plus
    the calls in flight (close() waits for them; one that overruns its deadline trips the breaker).

    A hung master (stopped, swapping, deadlocked) keeps its port open and answers nothing, so every RPC
    to it blocks for seconds. The breaker opens, for everyone, when health_check() is not 0, when a call
    returns an RPC failure, or when a call in flight overruns its deadline. While open, every call is
    refused at once. After each cooldown a probe - a real RPC with a short deadline, on its own thread,
    never a caller's call - decides: an answer in time closes the breaker; silence or a failure keeps it
    open for another cooldown. A probe stuck in the client stays stuck alone, and no other starts.
    """

    REFUSED = 0  # admit()'s answer when the call must not run

    def __init__(self, cooldown_s: float, master_reachable: Callable[[], bool]) -> None:
        self._cooldown_s = cooldown_s
        self._master_reachable = master_reachable
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._health: Callable[[], int] = lambda: 1
        self._probe_call: Callable[[], str | None] = lambda: "not started"
        self.state = _State.CLOSED
        self._deadlines: dict[int, float] = {}  # ticket of each call in flight -> when it counts as stuck
        self._next_ticket = 1
        self._open_until = 0.0  # 0 = breaker closed, else the monotonic time its cooldown ends
        self._probing = False
        self.epoch = 0

    def start(self, health: Callable[[], int], probe: Callable[[], str | None]) -> None:
        """`probe`: one cheap RPC; returns why the master looks gone, or None when it answered."""
        with self._lock:
            self._health = health
            self._probe_call = probe
            self.state = _State.READY

    def admit(self, nbytes: int = 0) -> int:
        """A ticket for one native call (release it!), or REFUSED."""
        with self._lock:
            if not self._usable(time.monotonic()):
                return self.REFUSED
            return self._ticket(STALL_GRACE_S + nbytes / STALL_MIN_BYTES_PER_S)

    def release(self, ticket: int, failure: str | None, finished: bool = True) -> None:
        """`failure`: why the master looks gone (trips the breaker); `finished` False: the call raised."""
        with self._lock:
            self._deadlines.pop(ticket, None)
            if failure is not None:
                self._trip(failure)
            if not self._deadlines and self.state is _State.CLOSING:
                self._drained.notify_all()

    def healthy(self) -> bool:
        with self._lock:
            return self._usable(time.monotonic())

    def begin_close(self, drain_timeout_s: float) -> bool | None:
        """Refuse new calls and wait for those in flight. None: already closing or closed; else whether
        every call finished (closing the client under a running call would crash it)."""
        with self._lock:
            if self.state is not _State.READY:
                return None
            self.state = _State.CLOSING
            return self._drained.wait_for(lambda: not self._deadlines, drain_timeout_s)

    def end_close(self) -> None:
        with self._lock:
            self.state = _State.CLOSED
            self._health = lambda: 1

    def in_flight(self) -> int:
        with self._lock:
            return len(self._deadlines)

    # -- under the lock

    def _usable(self, now: float) -> bool:
        """May a call run now? Trips the breaker on a stuck call or a failed health check, and starts
        the probe once an open breaker's cooldown has passed."""
        if self.state is not _State.READY:
            return False
        stuck = [ticket for ticket, deadline in self._deadlines.items() if now > deadline]
        if stuck:
            for ticket in stuck:
                self._deadlines[ticket] = math.inf  # still in flight (close waits for it), counted once
            self._trip("a call to the master ran past its deadline")
        elif not self._open_until and self._health() != 0:
            self._trip("health_check reports the master unreachable")
        if self._open_until:
            if now >= self._open_until and not self._probing:
                self._start_probe()
            return False
        return True

    def _ticket(self, deadline_s: float) -> int:
        ticket = self._next_ticket
        self._next_ticket += 1
        self._deadlines[ticket] = time.monotonic() + deadline_s
        return ticket

    def _start_probe(self) -> None:
        self._probing = True
        ticket = self._ticket(PROBE_DEADLINE_S)
        threading.Thread(target=self._probe, args=(ticket,), name="kvpool-mooncake-probe", daemon=True).start()

    def _probe(self, ticket: int) -> None:
        began = time.monotonic()
        failure: str | None = "the master's port is closed"
        try:
            if self._master_reachable():  # a dead master: skip the RPC that would stall in reconnects
                failure = self._probe_call()
        except Exception as exc:
            failure = f"the probe raised {exc!r}"
        took = time.monotonic() - began
        if failure is None and took > PROBE_DEADLINE_S:
            failure = f"the master took {took:.2f} s to answer a probe"
        with self._lock:
            self._probing = False
            self._deadlines.pop(ticket, None)
            if failure is not None:
                self._trip(failure)
            elif self._open_until:
                self._open_until = 0.0
                log.warning("mooncake: the master answers again within %.0f ms; breaker closed", took * 1000)
            if not self._deadlines and self.state is _State.CLOSING:
                self._drained.notify_all()

    def _trip(self, reason: str) -> None:
        if not self._open_until:
            self.epoch += 1
            log.warning("mooncake: breaker open, probing every %.1f s: %s", self._cooldown_s, reason)
        self._open_until = time.monotonic() + self._cooldown_s


# ---------------------------------------------------------------------------------------------- backend


class MooncakeBackend:
    """Backend over one MooncakeDistributedStore client. Thread-safe; every fault answers as a miss."""

    name = "mooncake"

    def __init__(self, options: MooncakeOptions | None = None) -> None:
        self.options = options or MooncakeOptions()
        self._master_host, self._master_port = _master_endpoint(self.options.master)
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
        self._guarded(lambda: self._put_admitted(keys, batch, results), _identity, sum(batch.totals))
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
        self._guarded(lambda: self._get_admitted(keys, batch, results), _identity, sum(batch.totals))
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
        code = self._guarded(lambda: self._store.register_buffer(view.ctypes.data, view.size), lambda _: None)
        return code == 0

    def __repr__(self) -> str:
        state = self._gate.state.value
        return f"MooncakeBackend(master={self.options.master!r}, segment={self.segment_name!r}, {state})"

    # -- transfers (only called while admitted)

    def _put_admitted(self, keys: Sequence[str], batch: _Batch, results: list[Status]) -> str | None:
        store, config = self._store, self._replicate
        duplicates = _duplicates(keys, batch)
        failure: str | None = None
        for route, indices in batch.routes.items():
            unique = [i for i in indices if i not in duplicates] if duplicates else indices
            if not unique or failure is not None:
                continue
            if route is _Route.STAGED and self._put_staging.lock.acquire(blocking=False):
                try:
                    failure = self._put_staged(keys, batch, unique, results)
                finally:
                    self._put_staging.lock.release()
            elif route is _Route.SINGLE:
                codes = store.batch_put_from(*batch.single_args(keys, unique), config)
                failure = self._record(codes, unique, results, reading=False)
            else:  # multi, or staged while another thread holds the staging buffer
                codes = store.batch_put_from_multi_buffers(*batch.multi_args(keys, unique, route), config)
                failure = self._record(codes, unique, results, reading=False)
        for index, first in duplicates.items():
            results[index] = results[first]
        return failure

    def _put_staged(self, keys: Sequence[str], batch: _Batch, indices: list[int], results: list[Status]) -> str | None:
        staging = self._put_staging
        for round_indices in _pack(batch.totals, indices, staging.size):
            addresses = batch.pack(round_indices, staging)
            codes = self._store.batch_put_from(
                [keys[i] for i in round_indices], addresses, [batch.totals[i] for i in round_indices], self._replicate
            )
            failure = self._record(codes, round_indices, results, reading=False)
            if failure is not None:
                return failure
        return None

    def _get_admitted(self, keys: Sequence[str], batch: _Batch, results: list[Status]) -> str | None:
        store = self._store
        failure: str | None = None
        for route, indices in batch.routes.items():
            if not indices or failure is not None:
                continue
            if route is _Route.STAGED and self._get_staging.lock.acquire(blocking=False):
                try:
                    failure = self._get_staged(keys, batch, indices, results)
                finally:
                    self._get_staging.lock.release()
            elif route is _Route.SINGLE:
                codes = store.batch_get_into(*batch.single_args(keys, indices))
                failure = self._record_reads(codes, batch, indices, results)
            else:  # multi, or staged while another thread holds the staging buffer
                codes = store.batch_get_into_multi_buffers(*batch.multi_args(keys, indices, route))
                failure = self._record_reads(codes, batch, indices, results)
                if MooncakeErrorCode.TRANSFER_FAIL in codes:
                    self._explain_transfer_failures(keys, batch, indices, codes, results)
        return failure

    def _get_staged(self, keys: Sequence[str], batch: _Batch, indices: list[int], results: list[Status]) -> str | None:
        staging = self._get_staging
        for round_indices in _pack(batch.totals, indices, staging.size):
            starts = batch.starts(round_indices)
            codes = self._store.batch_get_into(
                [keys[i] for i in round_indices],
                [staging.base + start for start in starts],
                [batch.totals[i] for i in round_indices],
            )
            failure = self._record_reads(codes, batch, round_indices, results)
            batch.unpack(round_indices, [results[i] is Status.OK for i in round_indices], staging)
            if failure is not None:
                return failure
        return None

    def _explain_transfer_failures(
        self, keys: Sequence[str], batch: _Batch, indices: list[int], codes: list[int], results: list[Status]
    ) -> None:
        # multi-buffer reads report destinations larger than the object as TRANSFER_FAIL, like a dead peer
        for index, code in zip(indices, codes):
            if code == MooncakeErrorCode.TRANSFER_FAIL:
                size = self._store.get_size(keys[index])
                if size >= 0 and size != batch.totals[index]:
                    results[index] = Status.SIZE_MISMATCH

    @staticmethod
    def _record(codes: list[int], indices: list[int], results: list[Status], reading: bool) -> str | None:
        if not any(codes):  # every put stored (0 = OK): the common case, without a call per key
            _all_ok(indices, results)
            return None
        for index, code in zip(indices, codes):
            results[index] = status_of(code, reading=reading)
        return _rpc_failure(codes)

    @staticmethod
    def _record_reads(codes: list[int], batch: _Batch, indices: list[int], results: list[Status]) -> str | None:
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


def _stageable(sizes: list[int]) -> bool:
    """Whether a value of pieces of these sizes may take the staged route (size limits aside)."""
    return len(sizes) > 1 and min(sizes) < SMALL_PIECE_BYTES


def _all_ok(indices: list[int], results: list[Status]) -> None:
    if len(indices) == len(results):  # the whole batch: indices are 0..n-1
        results[:] = [Status.OK] * len(results)
    else:
        for index in indices:
            results[index] = Status.OK


def _identity(failure: str | None) -> str | None:
    return failure


def _rpc_failure(codes: Sequence[int]) -> str | None:
    for code in codes:
        if code in _RPC_FAILURES:
            return f"a call returned {MooncakeErrorCode.describe(code)}"
    return None


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
