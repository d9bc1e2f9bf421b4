"""The distributed pool: kvpool's Backend protocol over a real Mooncake Store (`mooncake.store`).

Three measured facts of Mooncake 0.3.13 shape this package:
- The native client segfaults when used before setup() or after close(), so every native call passes
  a gate (state + in-flight count) and close() waits for in-flight calls before closing the client.
- A dead master makes every RPC block ~4.3 s (a hung one: 30 s). A circuit breaker (health_check before
  each batch, trip on RPC_FAIL or on any call overrunning its deadline) answers "unavailable" at once,
  for everyone, until a probe - a real RPC with a short deadline on its own thread - is answered in time.
  No call ever queues behind one stuck in the client.
- Mooncake charges ~25 µs per buffer piece over TCP, so values made of many small pieces are staged into
  one registered contiguous buffer and moved as one piece per key.

One concept per module: errors.py (return codes → Status), native.py (the native module; the
settings are `kvpool.core.mooncake_options`), batch.py (routes and staging), breaker.py (the gate),
local_keys.py (which keys live in this client's segment), backend.py (`MooncakeBackend`, tying them
together), and the pool's own processes: master.py (a `mooncake_master`'s one lifecycle) and
segment_holder.py (a process that only lends memory to the pool). This file only re-exports: the
names below are the package's public surface, importable as `kvpool.backends.mooncake.X`.
"""

from kvpool.backends.mooncake.backend import CLOSE_DRAIN_TIMEOUT_S, MASTER_PROBE_TIMEOUT_S, PROBE_KEY, MooncakeBackend
from kvpool.backends.mooncake.batch import FANCY_GATHER_BYTES, SMALL_PIECE_BYTES
from kvpool.backends.mooncake.breaker import PROBE_DEADLINE_S, STALL_GRACE_S, STALL_MIN_BYTES_PER_S
from kvpool.backends.mooncake.errors import MooncakeErrorCode, status_of
from kvpool.backends.mooncake.native import load_store_module
from kvpool.core.mooncake_options import MAX_SEGMENT_BYTES, MIN_SEGMENT_BYTES, MooncakeOptions

__all__ = [
    "CLOSE_DRAIN_TIMEOUT_S",
    "FANCY_GATHER_BYTES",
    "MASTER_PROBE_TIMEOUT_S",
    "MAX_SEGMENT_BYTES",
    "MIN_SEGMENT_BYTES",
    "PROBE_DEADLINE_S",
    "PROBE_KEY",
    "SMALL_PIECE_BYTES",
    "STALL_GRACE_S",
    "STALL_MIN_BYTES_PER_S",
    "MooncakeBackend",
    "MooncakeErrorCode",
    "MooncakeOptions",
    "load_store_module",
    "status_of",
]
