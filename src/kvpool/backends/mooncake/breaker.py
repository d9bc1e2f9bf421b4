"""The gate every native call passes: the client's lifecycle and a circuit breaker over the master.

Invariants: no native call runs unless admitted (the client segfaults before setup() and after
close()), and each admitted call is released once; closing refuses new calls, then waits (bounded) for
those in flight; while the breaker is open every call is refused at once, and only a probe on its own
thread - never a caller's call - closes it again; `epoch` moves each time the breaker opens.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

STALL_GRACE_S = 0.5  # metadata RPCs take < 10 ms; a call past this (plus its transfer time) is stuck
PROBE_DEADLINE_S = 0.25  # a healthy master answers batch_is_exist of one key in ~0.1 ms
STALL_MIN_BYTES_PER_S = 100e6  # 8x below TCP loopback: a slow but moving transfer is not a stall


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
