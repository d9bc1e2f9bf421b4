"""The embedded pool's second tier: chunks as files in one rank's directory, each sealed.

The chunk file (its path, its header with the chunk's parent link, its checks, padding for `O_DIRECT`)
and the file I/O the tier does are `disk_file`'s; this module is the tier: the index of the files, their
capacity and eviction, the writes, the reads and the start-up scan.

Invariants:
- Nothing wrong is ever served. A file is written under a temporary name and renamed into place once
  whole, so a process killed mid-write leaves only a `.tmp` file (removed at the next start); every
  read checks the magic, the version, the key, the length and both digests (XXH3-64: ~40 GB/s a core
  here, against ~3 GB/s for CRC32, so the check costs a few percent of a read), and a file that fails
  any of them is a miss and is removed. The seal is the tier's own, whatever the DRAM tier's
  `integrity` (the value may end with that seal too: the tier stores it as bytes). No fsync: a crash
  of the process keeps what the kernel holds; a crash of the machine may leave a renamed file with
  bytes that never reached the disk (its digest refuses them) or, where a reused file's overwrite
  reached the disk and its renames did not, another chunk's whole file under a chunk's name (its key,
  checked on every read, refuses it).
- No file-system fault reaches the caller: a full disk, a read-only or vanished directory, an
  unreadable file answer a status (FULL, ERROR, MISSING, CORRUPT) and are counted; after a failed
  write the tier stops writing for `WRITE_BACKOFF_S` (a full disk is not retried per chunk).
- Capacity is the sum of the files' sizes. Eviction takes the least recently used file; callers touch
  a prefix chain tail first, so its head ages last and a chain never loses its head before its tail.
  A write that evicts reuses the evicted chunk's file: renamed to the new chunk's temporary name,
  overwritten, renamed into place. A read that had the old file open then fails the key or digest
  check; it answers MISSING (its file is no longer at its path), not CORRUPT.
- Start-up rebuilds the index with one scan of the directory (the files are the record, so no
  second one can disagree with them), oldest modification first; files beyond the capacity are
  removed, and files of keys outside the opening engine's namespaces (other weights or layouts: the
  key's prefix says) are reclaimed unread. The directory is one process's (`disk_owner`). Measured
  here: 13.5 µs a file (100,000 files in 1.3 s); files are at least a chunk each, so
  a tier of C bytes of chunks of c bytes scans in C / c × 13.5 µs (1 TiB of 2 MiB chunks: ~7 s). The
  scheduler of a restarted engine reads each file's header too (`disk_file.stored_links`), about as
  long again.

One file per chunk rather than slots in large files: a chunk is a block of every layer (hundreds of
KiB to MiB at real sizes), so an open and a rename cost little against its bytes, eviction is an
unlink with nothing to compact, and a rename gives an atomic publish without a journal. What a file of
its own did cost is the allocation: a new file's pages and blocks, freed again by the evicted file's
unlink (a full tier writing 256 KiB chunks here: 94 µs a new file and 26 µs an unlink, against 51 µs
overwriting an evicted file and 32 µs for the same bytes written in place into one file). Reusing the
evicted file gives a full tier what slots would, and keeps the publish by rename.

Two I/O modes (`direct`). Buffered (the default, the page cache): a chunk re-read soon after it
spilled comes from memory at several times the device's speed, and files need no padding. `O_DIRECT`:
reads and writes go to the device past the page cache (which then holds no second copy of what DRAM
evicted, and takes no memory the host's other work wants), from page-aligned buffers, each file padded
to whole pages (`disk_file`: a file of either mode reads in the other). A file system that refuses
`O_DIRECT` (tmpfs) gets the buffered mode, with a warning. What each mode costs against the device in
the same mode: `kvpool bench transfer --backend disk`.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvpool.backends.base import Buffer, Status
from kvpool.backends.disk_file import (
    HEADER_BYTES,
    MAX_LINK_BYTES,
    O_DIRECT,
    SUFFIX,
    TMP_SUFFIX,
    aligned,
    checked_value,
    direct_works,
    key_of,
    open_for_write,
    pack_header,
    pages,
    path_of,
    read_all,
    same_file,
    unlink,
    walk,
    write_all,
)
from kvpool.backends.disk_owner import Ownership, own, prune, write_manifest
from kvpool.core.errors import DiskInUseError
from kvpool.core.keys import KeySpace

log = logging.getLogger("kvpool.disk")

WRITE_BACKOFF_S = 5.0


@dataclass
class DiskStats:
    capacity_bytes: int = 0
    used_bytes: int = 0
    files: int = 0
    writes: int = 0
    write_bytes: int = 0
    write_errors: int = 0
    reads: int = 0
    read_bytes: int = 0
    read_errors: int = 0
    corrupt: int = 0
    evictions: int = 0
    scan_s: float = 0.0
    removed_at_scan: int = 0
    reclaimed_at_scan: int = 0  # files of namespaces the tier was not opened for (other weights, layouts)


class DiskTier:
    """Sealed chunk files under one directory, LRU by bytes. Thread-safe (writes take turns: one
    reuses the file another evicted, so two at once could rename each other's files); every method may
    block on the file system, so none runs on an engine's thread (the tiered pool calls it from threads
    of its own: one writer, several readers).

    The directory is this process's while the tier is open (`disk_owner`: another process's tier on it
    raises DiskInUseError here, before the scan touches anything). `namespaces`: the key spaces the
    opening engine reads; files of any other prefix are reclaimed at the scan, never indexed (None: every
    key is kept)."""

    def __init__(
        self,
        directory: str,
        capacity_bytes: int,
        *,
        on_evicted: Callable[[list[str]], None] | None = None,
        direct: bool = False,
        namespaces: Sequence[KeySpace] | None = None,
    ):
        self.directory = os.path.abspath(directory)
        self._spaces = list(namespaces or ())
        self._prefixes = None if namespaces is None else tuple(space.prefix for space in namespaces)
        self.capacity_bytes = capacity_bytes
        self.on_evicted = on_evicted  # called with the keys the tier dropped (evicted, removed)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # one write at a time (uncontended: the tier has one writer)
        self._files: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._used = 0
        self._stats = DiskStats(capacity_bytes=capacity_bytes)
        self._write_blocked_until = 0.0
        self._folders: set[str] = set()  # folders the writer made or found (one per model, layout and group)
        self._owner = self._own()
        self._release = weakref.finalize(self, self._owner.release) if self._owner is not None else None
        self._scan()
        if namespaces is not None and self._owner is not None:
            write_manifest(self.directory, self._spaces)
        self.direct_asked = direct
        self.direct = direct and direct_works(self.directory)  # O_DIRECT reads and writes (see the module)
        self._flags = O_DIRECT if self.direct else 0
        self._scratch = np.empty(0, dtype=np.uint8)  # direct writes: the page-aligned file image, reused

    def _own(self) -> Ownership | None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            return own(self.directory)
        except DiskInUseError:
            raise
        except OSError as error:
            log.warning("disk tier %s: cannot create the directory (%s); the tier holds nothing", self.directory, error)
            return None

    def adopt(self, namespaces: Sequence[KeySpace] | None) -> None:
        """Another engine of this process opens the tier (the named pool outlived the previous one):
        its namespaces join the manifest. Nothing is reclaimed now: the first engine may still run."""
        if namespaces is None or self._prefixes is None:
            return
        known = set(self._prefixes)
        new = [space for space in namespaces if space.prefix not in known]
        if new:
            self._spaces += new
            self._prefixes += tuple(space.prefix for space in new)
            write_manifest(self.directory, self._spaces)

    def close(self) -> None:
        """Give the directory up (this process's last tier on it releases its lock); files stay."""
        if self._release is not None:
            self._release()

    # --- the index ---------------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        return key in self._files  # a dict probe: atomic under the GIL

    def keys(self) -> list[str]:
        """Every key on disk, least recently used first."""
        with self._lock:
            return list(self._files)

    def touch(self, keys: Sequence[str]) -> None:
        """Mark the keys used, in order (the last one ends most recently used)."""
        with self._lock:
            files = self._files
            for key in keys:
                if key in files:
                    files.move_to_end(key)

    def stats(self) -> DiskStats:
        with self._lock:
            self._stats.used_bytes = self._used
            self._stats.files = len(self._files)
            return DiskStats(**vars(self._stats))

    # --- writes --------------------------------------------------------------------------------

    def write(self, key: str, pieces: Sequence[Buffer], link: bytes | None = None) -> Status:
        """Store the concatenation of `pieces` under `key`, evicting older files to make room. `link`:
        the chunk's parent hash (b"": the first chunk of its chain; None: not known)."""
        with self._write_lock:
            return self._write(key, pieces, link)

    def _write(self, key: str, pieces: Sequence[Buffer], link: bytes | None) -> Status:
        if key in self._files:
            return Status.OK
        if link is not None and len(link) > MAX_LINK_BYTES:
            link = None  # not a chunk hash: the chunk is kept, its link is not
        size = sum(memoryview(piece).nbytes for piece in pieces)
        file_bytes = HEADER_BYTES + len(key.encode()) + len(link or b"") + size
        if self.direct:
            file_bytes = pages(file_bytes)
        if file_bytes > self.capacity_bytes:
            return Status.FULL
        if time.monotonic() < self._write_blocked_until:
            return Status.UNAVAILABLE
        try:
            path = self._path(key)
        except ValueError:
            log.warning("disk tier %s: key %r cannot name a file; not stored", self.directory, key)
            return Status.ERROR
        recycled = self._make_room(file_bytes)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
        folder = os.path.dirname(path)
        try:
            if folder not in self._folders:  # a makedirs per write cost ~9 us here, a 256 KiB chunk ~130
                os.makedirs(folder, exist_ok=True)
                self._folders.add(folder)
            digest = xxhash.xxh3_64()
            for piece in pieces:
                digest.update(piece)
            header = pack_header(key, link, size, digest.intdigest())
            try:
                fd = open_for_write(tmp, recycled, self._flags)
            except FileNotFoundError:  # the folder was removed under a running tier: made again, once
                os.makedirs(folder, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self._flags, 0o644)
            try:
                if self.direct:
                    write_all(fd, [self._file_image(header, pieces, file_bytes)])
                else:
                    write_all(fd, [header, *pieces])
                if recycled is not None and os.fstat(fd).st_size > file_bytes:  # its real size, not the index's
                    os.ftruncate(fd, file_bytes)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as error:
            unlink(tmp)
            if recycled is not None:
                unlink(recycled[0])
            with self._lock:
                self._stats.write_errors += 1
            self._write_blocked_until = time.monotonic() + WRITE_BACKOFF_S
            log.warning(
                "disk tier %s: could not write a chunk (%s); writes pause for %.0f s",
                self.directory,
                errno.errorcode.get(error.errno or 0, error),
                WRITE_BACKOFF_S,
            )
            return Status.FULL if error.errno in (errno.ENOSPC, errno.EDQUOT) else Status.ERROR
        with self._lock:
            if key not in self._files:
                self._files[key] = file_bytes
                self._used += file_bytes
            self._stats.writes += 1
            self._stats.write_bytes += size
        return Status.OK

    def _file_image(self, header: bytes, pieces: Sequence[Buffer], file_bytes: int) -> np.ndarray:
        """The whole file in a page-aligned buffer (O_DIRECT writes from one), zero-padded to its pages."""
        if self._scratch.nbytes < file_bytes:
            self._scratch = aligned(file_bytes)
        image = self._scratch[:file_bytes]
        image[: len(header)] = np.frombuffer(header, dtype=np.uint8)
        at = len(header)
        for piece in pieces:
            flat = np.frombuffer(memoryview(piece).cast("B"), dtype=np.uint8)
            image[at : at + flat.size] = flat
            at += flat.size
        image[at:] = 0
        return image

    def _make_room(self, file_bytes: int) -> tuple[str, int] | None:
        """Evict least recently used files until `file_bytes` fit; the first of them is not removed
        but handed back (its path and size) for the write to reuse."""
        gone: list[tuple[str, int]] = []
        with self._lock:
            while self._files and self._used + file_bytes > self.capacity_bytes:
                key, size = self._files.popitem(last=False)
                self._used -= size
                self._stats.evictions += 1
                gone.append((key, size))
        if not gone:
            return None
        for key, _ in gone[1:]:
            unlink(self._path(key))
        if self.on_evicted is not None:
            self.on_evicted([key for key, _ in gone])
        return self._path(gone[0][0]), gone[0][1]

    # --- reads ---------------------------------------------------------------------------------

    def read(self, key: str) -> np.ndarray | Status:
        """The value stored under `key` (a new array the caller owns), or why not. A file that fails
        its checks is removed."""
        if key not in self._files:
            return Status.MISSING
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY | self._flags)
            try:
                opened = os.fstat(fd)
                if self.direct:  # whole pages into a page-aligned buffer; the file's own length counts
                    data = aligned(pages(opened.st_size))
                    data = data[: read_all(fd, data, opened.st_size)]
                else:
                    data = np.empty(opened.st_size, dtype=np.uint8)
                    data = data[: read_all(fd, data)]
                value = checked_value(data, key)
                # asked while the file is open: once closed, its inode number may name a new file
                reused = value is None and not same_file(path, opened)
            finally:
                os.close(fd)
        except FileNotFoundError:
            self._forget([key], count_corrupt=False)
            return Status.MISSING
        except OSError as error:
            with self._lock:
                self._stats.read_errors += 1
            log.warning("disk tier %s: could not read a chunk (%s)", self.directory, error)
            return Status.ERROR
        if reused:
            return Status.MISSING  # evicted while read, its file reused for another chunk: not damage
        if value is None:
            log.warning("disk tier %s: a chunk file failed its checks and was removed", self.directory)
            self._forget([key], count_corrupt=True)
            return Status.CORRUPT
        with self._lock:
            self._stats.reads += 1
            self._stats.read_bytes += value.size
        return value

    # --- removal -------------------------------------------------------------------------------

    def remove(self, keys: Sequence[str]) -> int:
        return self._forget(keys, count_corrupt=False)

    def clear(self) -> int:
        with self._lock:
            keys = list(self._files)
        return self._forget(keys, count_corrupt=False)

    def _forget(self, keys: Sequence[str], *, count_corrupt: bool) -> int:
        removed: list[str] = []
        with self._lock:
            for key in keys:
                size = self._files.pop(key, None)
                if size is not None:
                    self._used -= size
                    removed.append(key)
            if count_corrupt:
                self._stats.corrupt += len(removed)
        for key in removed:
            unlink(self._path(key))
        if removed and self.on_evicted is not None:
            self.on_evicted(removed)
        return len(removed)

    # --- start-up ------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Rebuild the index from the files: leftovers of interrupted writes are removed, files beyond
        the capacity too (oldest first)."""
        start = time.perf_counter()
        found: list[tuple[float, str, int]] = []
        removed = 0
        reclaimed: set[str] = set()  # folders files were reclaimed from
        for entry in walk(self.directory):
            name = entry.name
            if name.endswith(TMP_SUFFIX):
                removed += unlink(entry.path)
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                status = entry.stat()
            except OSError:
                continue
            key = key_of(self.directory, entry.path)
            if self._prefixes is not None and not key.startswith(self._prefixes):
                if unlink(entry.path):  # never indexed, so never read: another layout's or weights' file
                    self._stats.reclaimed_at_scan += 1
                    reclaimed.add(os.path.dirname(entry.path))
                continue
            found.append((status.st_mtime, key, status.st_size))
        found.sort()
        kept: list[tuple[str, int]] = []
        total = 0
        for _, key, size in reversed(found):  # newest first: they are kept
            if total + size > self.capacity_bytes:
                removed += unlink(self._path(key))
                continue
            total += size
            kept.append((key, size))
        with self._lock:
            for key, size in reversed(kept):
                self._files[key] = size
            self._used = total
            self._stats.removed_at_scan = removed
            self._stats.scan_s = time.perf_counter() - start
        prune(self.directory, reclaimed)
        if self._stats.reclaimed_at_scan:
            log.info(
                "disk tier %s: %d files of other namespaces (weights or layouts) reclaimed at start-up",
                self.directory,
                self._stats.reclaimed_at_scan,
            )

    def _path(self, key: str) -> str:
        return path_of(self.directory, key)
