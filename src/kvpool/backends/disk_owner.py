"""Who owns a disk tier's directory, and what it holds: one process per directory, held by a lock, and a
manifest naming the namespaces the tier was opened for.

Invariants:
- One process owns a rank directory: `own` takes an exclusive `fcntl.flock` on `<directory>/.kvpool-owner`
  before the tier scans (a scan removes `.tmp` files, which in another process's directory are its writes
  in flight, and evicts by a capacity that counts only its own files). A second process is refused with
  `DiskInUseError`, naming the directory and the holder (pid, host, start time) the lock file records.
- A dead holder never blocks: the kernel releases a flock when the last descriptor of its open file
  description closes, which a process's death does (SIGKILL included), so whoever asks next takes the
  lock; what the file still records is the previous holder's, logged and overwritten. The lock file is
  never removed (removing it would let two processes lock two different files of one name).
- Inside a process the lock is shared: every tier opened on a directory takes a reference on one held
  lock (the named pool that outlives an engine, tests reopening a directory), released with the last one.
- A forked child holds nothing: the descriptor it inherits shares the parent's lock, so the child closes
  its copies at once (closing, unlike LOCK_UN, leaves the parent's lock in place) and forgets the
  registry; the registry also records the pid that took each lock, and an entry of another pid is not
  this process's. Descriptors are close-on-exec, so a program started from the owner holds nothing either.
- The manifest (`.kvpool-manifest.json`) is for reading (an operator, `kvpool inspect`), never decided
  on: what a file is, its key says (its prefix is the layout fingerprint's digest, weights included), and
  the scan keeps only keys under the opening engine's namespaces (`DiskTier`). So no record can disagree
  with the files in a way that serves one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvpool.core.errors import DiskInUseError
from kvpool.core.keys import KeySpace

log = logging.getLogger("kvpool.disk")

LOCK_NAME = ".kvpool-owner"
MANIFEST_NAME = ".kvpool-manifest.json"
MANIFEST_FORMAT = 1


@dataclass
class _Held:
    fd: int
    pid: int
    count: int


_held: dict[str, _Held] = {}  # the directory's real path -> this process's lock on it
_held_lock = threading.Lock()


def _forget_in_child() -> None:
    """After a fork, in the child: its copies of the lock descriptors are the parent's lock; close them
    (without LOCK_UN, which would release the parent's) and hold nothing."""
    global _held_lock
    _held_lock = threading.Lock()  # another thread of the parent may have held it at the fork
    for held in _held.values():
        with contextlib.suppress(OSError):
            os.close(held.fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def holder_record() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}


def read_holder(directory: str) -> dict[str, Any] | None:
    """What the lock file records of its (last) holder; None when it records nothing readable."""
    try:
        with open(os.path.join(directory, LOCK_NAME), encoding="utf-8") as file:
            record = json.loads(file.read() or "null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


class Ownership:
    """This process's share of a directory's lock. `release` once done (idempotent; a tier's finalizer
    calls it too)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._released = False

    def release(self) -> None:
        with _held_lock:
            if self._released:
                return
            self._released = True
            held = _held.get(self.directory)
            if held is None or held.pid != os.getpid():
                return  # taken before a fork: the child never held it
            held.count -= 1
            if held.count > 0:
                return
            del _held[self.directory]
        try:
            fcntl.flock(held.fd, fcntl.LOCK_UN)
        finally:
            os.close(held.fd)

    @property
    def held(self) -> bool:
        with _held_lock:
            held = _held.get(self.directory)
            return not self._released and held is not None and held.pid == os.getpid()


def own(directory: str) -> Ownership:
    """Take (or share, in this process) the lock of `directory`, which must exist. DiskInUseError when
    another process holds it."""
    real = os.path.realpath(directory)
    with _held_lock:
        held = _held.get(real)
        if held is not None and held.pid == os.getpid():
            held.count += 1
            return Ownership(real)
        _held.pop(real, None)  # another pid's entry (a fork the hook missed): not ours, and not closed here
        path = os.path.join(real, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiskInUseError(real, read_holder(real)) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            previous = read_holder(real)
            record = json.dumps(holder_record()).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
        except OSError as error:  # the lock is held; the record is only for the refused
            log.warning("disk tier %s: could not record this process in its lock file (%s)", real, error)
        if previous is not None and previous.get("pid") != os.getpid():
            log.info(
                "disk tier %s: taken over from pid %s on %s (no longer holding it: its lock died with it)",
                real,
                previous.get("pid"),
                previous.get("host"),
            )
        _held[real] = _Held(fd, os.getpid(), 1)
        return Ownership(real)


def manifest(spaces: Sequence[KeySpace]) -> dict[str, Any]:
    """What a tier opened for `spaces` holds: each namespace's key prefix and the layout it names (the
    weights' digest among its fields), and who wrote it."""
    return {
        "format": MANIFEST_FORMAT,
        "writer": holder_record(),
        "namespaces": [{"prefix": space.prefix, "layout": asdict(space.fingerprint)} for space in spaces],
    }


def write_manifest(directory: str, spaces: Sequence[KeySpace]) -> None:
    """Replace the directory's manifest (a whole file or none: written aside, renamed into place)."""
    path = os.path.join(directory, MANIFEST_NAME)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as file:
            json.dump(manifest(spaces), file, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as error:
        log.warning("disk tier %s: could not write its manifest (%s)", directory, error)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def read_manifest(directory: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(directory, MANIFEST_NAME), encoding="utf-8") as file:
            record = json.load(file)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def prune(directory: str, folders: set[str]) -> None:
    """Remove the folders files were reclaimed from, and their parents up to `directory`, while empty."""
    for folder in sorted(folders, key=len, reverse=True):
        while folder.startswith(directory + os.sep):
            try:
                os.rmdir(folder)
            except OSError:
                break  # not empty (or gone): its parents are not either
            folder = os.path.dirname(folder)
