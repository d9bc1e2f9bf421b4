"""Which keys this client stored in its own segment: reads of those are local memcpys, never staged.

Invariants: a hint, never a source of truth (a wrong answer costs speed, not correctness); bounded by
the segment's bytes and an entry cap; emptied at its first use after the breaker's epoch moves, since
the master may have restarted and lost every object.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence


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
