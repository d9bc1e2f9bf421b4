"""What names the weights an engine loads: a digest of the checkpoint's files, read at start-up.

A pool that outlives the engine (the disk tier, a shared Mooncake pool) must never serve KV computed
with other weights, and the model's path names no weights: a checkpoint rewritten in place (a redeploy,
a fine-tune saved over the old one) or a hub model whose `main` moved keeps its path. So keys carry
this digest beside the config facts of `fingerprints.WeightsFacts`.

Invariants:
- Other values give another digest: every weight file's name and size, a safetensors file's header
  (tensor names, dtypes, shapes, offsets), the index file's bytes, and a sample of every tensor's bytes
  (`SAMPLE_BYTES` at its start and at its middle). Training changes every value of a tensor it updates
  (a merged LoRA too: B·A is dense), so a rewrite that keeps the shapes changes the samples. What a
  sample cannot see (a few values edited by hand) is the `weights_version` setting's case.
- The same weights give the same digest on every host: no modification times, no absolute paths.
  Engines on two machines with copies of one checkpoint share a Mooncake pool (a copy's mtime differs).
- Cheap for any size: the reads are O(tensors), a few small ranges each (`SAMPLED_TENSORS_PER_FILE`
  caps them), never a whole file; read-ahead is turned off for them (`POSIX_FADV_RANDOM`).
- A hub model names its resolved snapshot commit (the revision it was downloaded at) and the snapshot's
  files; one that is not in the local cache, or a checkpoint with no weight file kvpool can read (a custom
  loader, a remote object store), gives no digest: `checkpoint_digest` returns None and the caller says so.
- No engine and no hub client is needed to import this module (huggingface_hub only when asked for).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path

log = logging.getLogger("kvpool.checkpoint")

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")
INDEX_SUFFIX = ".index.json"  # model.safetensors.index.json, pytorch_model.bin.index.json
SAMPLE_BYTES = 64  # read at a tensor's start and middle
SAMPLED_TENSORS_PER_FILE = 4096  # evenly spread over the file's tensors beyond this
PAGES_PER_OPAQUE_FILE = 64  # a file kvpool cannot parse (pickle, GGUF): pages sampled evenly over it
PAGE = 4096
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


def checkpoint_digest(model: str, revision: str | None = None) -> str | None:
    """The digest of the checkpoint `model` names: a local directory (or weight file), else a hub model
    in the local cache at `revision`. None: nothing kvpool can read names these weights."""
    path = Path(model)
    if path.is_dir() or path.is_file():
        return directory_digest(path)
    snapshot = _hub_snapshot(model, revision)
    if snapshot is None:
        return None
    digest = directory_digest(snapshot)
    return None if digest is None else _blake(f"hub:{snapshot.name}:{digest}".encode())


def directory_digest(path: Path) -> str | None:
    """Every weight file of the directory (top level: what vLLM's loaders read), or one weight file."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    weights = [p for p in files if p.name.endswith(WEIGHT_SUFFIXES)]
    if not weights:
        return None
    h = hashlib.blake2b(digest_size=16)
    for index in (p for p in files if p.name.endswith(INDEX_SUFFIX)):
        h.update(b"index\0" + index.name.encode() + b"\0" + index.read_bytes())
    for file in weights:
        h.update(b"file\0" + file.name.encode() + b"\0")
        _digest_file(file, h)
    return h.hexdigest()


def _digest_file(file: Path, h: hashlib.blake2b) -> None:
    fd = os.open(file, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        h.update(struct.pack("<Q", size))
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # small ranges: no read-ahead of megabytes
        if file.suffix == ".safetensors" and _digest_safetensors(fd, size, h):
            return
        _digest_pages(fd, size, h)
    finally:
        os.close(fd)


def _digest_safetensors(fd: int, size: int, h: hashlib.blake2b) -> bool:
    """The header and a sample of every tensor; False: not a readable safetensors file."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        return False
    (header_bytes,) = struct.unpack("<Q", head)
    if header_bytes > min(MAX_HEADER_BYTES, size - 8):
        return False
    header = os.pread(fd, header_bytes, 8)
    try:
        tensors = json.loads(header)
    except ValueError:
        return False
    h.update(header)
    start = 8 + header_bytes
    spans = sorted(
        (int(t["data_offsets"][0]), int(t["data_offsets"][1]))
        for name, t in tensors.items()
        if name != "__metadata__" and isinstance(t, dict) and "data_offsets" in t
    )
    step = max(1, -(-len(spans) // SAMPLED_TENSORS_PER_FILE))
    for begin, end in spans[::step]:
        for offset in (begin, (begin + end) // 2):
            h.update(os.pread(fd, min(SAMPLE_BYTES, max(0, end - offset)), start + offset))
    return True


def _digest_pages(fd: int, size: int, h: hashlib.blake2b) -> None:
    pages = max(1, size // PAGE)
    count = min(pages, PAGES_PER_OPAQUE_FILE)
    for i in range(count):
        h.update(os.pread(fd, PAGE, (i * (pages - 1) // max(1, count - 1)) * PAGE))
    if size > PAGE:
        h.update(os.pread(fd, PAGE, size - PAGE))


def _hub_snapshot(model: str, revision: str | None) -> Path | None:
    """The local snapshot directory of a hub model (its name is the resolved commit), without a network
    call; None when huggingface_hub is absent or the model is not cached."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not a hub id, not cached, an offline hub: nothing names the weights
        return None


def _blake(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()
