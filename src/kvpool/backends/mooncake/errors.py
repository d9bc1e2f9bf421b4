"""Mooncake's return codes and what they mean to kvpool.

Invariants: a code >= 0 is success (a put's 0, a get's byte count); every negative code maps to one
`Status`, ERROR for codes kvpool has no better name for. Only RPC_FAIL and RPC_TIMEOUT say the master
looks gone, so only they trip the circuit breaker (see breaker.py).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kvpool.backends.base import Status


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


def _rpc_failure(codes: Sequence[int]) -> str | None:
    for code in codes:
        if code in _RPC_FAILURES:
            return f"a call returned {MooncakeErrorCode.describe(code)}"
    return None
