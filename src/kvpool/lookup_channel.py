"""Lookups from the scheduler process to a pool that lives in a worker process.

The embedded pool lives in the worker; with vLLM's multi-process engine the scheduler sits in
another process, so it asks the worker over a ZMQ IPC socket. The server thread only touches
`backend.exists` (a dict lookup per key), so it holds the worker's GIL for microseconds.
Timeouts fail open: the client raises, the scheduler counts a miss.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable

import zmq

log = logging.getLogger("kvpool.lookup")

Exists = Callable[[list[str]], list[bool]]
Reset = Callable[[int], int]  # (reset epoch) -> chunks removed, -1 on failure
RESET = b"\x00reset:"  # + epoch; keys never contain NUL, so a command cannot look like a lookup


def channel_address(engine_id: str) -> str:
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in engine_id)
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'kvpool-lookup-{safe}.sock')}"


class LookupServer:
    def __init__(self, address: str, exists: Exists, reset: Reset | None = None) -> None:
        self.address = address
        self._exists = exists
        self._reset = reset
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvpool-lookup-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                payload = self._socket.recv()
                if payload.startswith(RESET):
                    epoch = int(payload[len(RESET) :])
                    self._socket.send(str(self._reset(epoch) if self._reset else -1).encode())
                    continue
                keys = payload.decode().split("\n") if payload else []
                try:
                    found = self._exists(keys)
                    reply = bytes(1 if hit else 0 for hit in found)
                except Exception:
                    log.exception("lookup of %d keys failed; answering miss", len(keys))
                    reply = bytes(len(keys))
                self._socket.send(reply)
            except zmq.ZMQError:
                if not self._stop.is_set():
                    log.exception("lookup server socket error")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._socket.close(0)
        self._context.term()
        if self.address.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(self.address[len("ipc://") :])


class LookupClient:
    """Thread-safe: the scheduler thread (reset) and the lookup thread share it. A ZMQ socket must
    never be used by two threads at once, so the socket has one owner at a time: whoever holds the
    lock, for a whole request and its reply."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = None
        self._lock = threading.Lock()

    def _connect(self) -> zmq.Socket:
        socket = self._context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVTIMEO, self._timeout_ms)
        socket.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        socket.connect(self.address)
        return socket

    def exists(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        reply = self._ask("\n".join(keys).encode())
        if len(reply) != len(keys):
            raise RuntimeError(f"lookup answer has {len(reply)} entries for {len(keys)} keys")
        return [bool(b) for b in reply]

    def reset(self, epoch: int) -> int:
        """Reset the remote pool to `epoch`; returns how many chunks went (-1: the server cannot)."""
        return int(self._ask(RESET + str(epoch).encode()).decode())

    def _ask(self, payload: bytes) -> bytes:
        with self._lock:
            if self._socket is None:
                self._socket = self._connect()
            try:
                self._socket.send(payload)
                return bytes(self._socket.recv())
            except zmq.Again as exc:
                # a REQ socket that missed its reply is stuck: start a new one next time
                self._socket.close(0)
                self._socket = None
                raise TimeoutError(f"no lookup answer from {self.address} within {self._timeout_ms} ms") from exc

    def close(self) -> None:
        with self._lock:
            if self._socket is not None:
                self._socket.close(0)
                self._socket = None
        self._context.term()
