"""Host buffers a rank's reads own, kept for the next read once it is done with them.

Memory a process has not touched costs a page fault (and the kernel zeroing the page) on first use:
a load that reads into a fresh buffer pays them inside its read, where a connector reading straight
into the engine's blocks (touched long ago) does not. Measured here, 9 chunks of 2 MiB from a
Mooncake segment holder over loopback: 47 ms into a fresh buffer, 37 ms into one used before
(medians of 12 interleaved reads on a loaded 2-core machine).

Invariant: a buffer is given back only once no read can still write it (the call that read into it
has returned) and its bytes are committed or dropped, so a buffer is never held by two loads at once:
a read that never returns (a hung pool) keeps its buffer for good. What is kept is bounded
(`limit_bytes`); beyond it, buffers given back are let go.

A kept buffer still holds the last load's chunks, each with its valid seal: were a pool ever to answer
OK for a row it never wrote, that chunk would pass its check as the one asked for. So a buffer taken
again has the last `SEAL_BYTES` of each row (where a seal is stored) zeroed: a stale row then fails
its seal, as memory nobody wrote does (a few bytes a row).
"""

from __future__ import annotations

import threading

import numpy as np

from kvpool.worker.integrity import SEAL_BYTES

DEFAULT_LIMIT_BYTES = 256 << 20


class HostBuffers:
    """Reusable `(rows, nbytes)` uint8 buffers, by row width. Thread-safe."""

    def __init__(self, limit_bytes: int = DEFAULT_LIMIT_BYTES) -> None:
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._kept: dict[int, list[np.ndarray]] = {}  # row width -> buffers, each (rows, width)
        self._kept_bytes = 0
        self.reused = 0  # takes served from a kept buffer (a test's and a profile's figure)

    def take(self, rows: int, nbytes: int) -> np.ndarray:
        """A `(rows, nbytes)` buffer: the first `rows` rows of a kept one that has enough, or a new one."""
        with self._lock:
            kept = self._kept.get(nbytes)
            if kept:
                for index, buffer in enumerate(kept):
                    if buffer.shape[0] >= rows:
                        del kept[index]
                        self._kept_bytes -= buffer.nbytes
                        self.reused += 1
                        taken = buffer[:rows]
                        taken[:, max(0, nbytes - SEAL_BYTES) :] = 0
                        return taken
        return np.empty((rows, nbytes), dtype=np.uint8)

    def give(self, buffer: np.ndarray) -> None:
        """Keep a buffer `take` returned, for a later take (see the module's invariant)."""
        whole = buffer.base if isinstance(buffer.base, np.ndarray) and buffer.base.ndim == 2 else buffer
        if whole.ndim != 2 or whole.dtype != np.uint8 or not whole.flags.c_contiguous:
            return
        with self._lock:
            if self._kept_bytes + whole.nbytes > self.limit_bytes:
                return
            kept = self._kept.setdefault(whole.shape[1], [])
            if any(other is whole for other in kept):
                return
            kept.append(whole)
            self._kept_bytes += whole.nbytes

    @property
    def kept_bytes(self) -> int:
        return self._kept_bytes
