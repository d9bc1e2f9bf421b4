"""Key namespace and chunk hashes."""

from __future__ import annotations

import dataclasses

import pytest

from kvpool.core.errors import LayoutError
from kvpool.core.keys import KEY_SCHEMA, ChunkHashes, KeySpace, LayoutFingerprint, chunk_hashes

BASE = LayoutFingerprint(model="org/Model-7B", dtype="bfloat16", block_size=16, kv_layout="cpu:LBHNC:amx")


def test_every_fingerprint_field_changes_the_prefix() -> None:
    changes = {
        "model": "org/Other",
        "dtype": "float16",
        "block_size": 32,
        "kv_layout": "cuda:NHD",
        "chunk_bytes": 1,
        "tp_shard": 1,
        "pp_rank": 1,
        "pp_size": 2,
        "group_id": 1,
        "attention": "sliding_window:64",
        "hash_algo": "sha256",
        "weights": "0123abcd",
        "tenant": "acme",
        "integrity": "sampled",
    }
    assert set(changes) == {f.name for f in dataclasses.fields(LayoutFingerprint)}
    prefixes = {BASE.key_prefix()}
    for name, value in changes.items():
        prefixes.add(dataclasses.replace(BASE, **{name: value}).key_prefix())
    assert len(prefixes) == len(changes) + 1


def test_prefix_shape_and_determinism() -> None:
    prefix = BASE.key_prefix()
    assert prefix == LayoutFingerprint(**dataclasses.asdict(BASE)).key_prefix()
    assert prefix.startswith(f"{KEY_SCHEMA}/Model-7B/")
    assert prefix.endswith("/s0/p0/g0/")
    # odd characters in a model path never leak into the key
    odd = dataclasses.replace(BASE, model="/models/my model@v1/")
    assert "/my_model_v1/" in odd.key_prefix()
    shard = dataclasses.replace(BASE, tp_shard=3, pp_rank=2, group_id=1)
    assert shard.key_prefix().endswith("/s3/p2/g1/")


def test_keyspace_builds_hex_keys() -> None:
    space = KeySpace(BASE)
    assert space.key(b"\x00\xab") == space.prefix + "00ab"
    assert space.keys([b"\x01", b"\xff\x10"]) == [space.prefix + "01", space.prefix + "ff10"]
    assert space.keys([]) == []


def test_chunk_hashes_view() -> None:
    raw = [bytes([i]) for i in range(10)]
    view = ChunkHashes(raw, 16, 48)  # 3 hash blocks per chunk
    assert len(view) == 3
    assert [view[i] for i in range(3)] == [raw[2], raw[5], raw[8]]
    assert view[-1] == raw[8]
    assert view[1:] == [raw[5], raw[8]]
    assert list(view) == [raw[2], raw[5], raw[8]]
    with pytest.raises(IndexError):
        view[3]
    with pytest.raises(IndexError):
        view[-4]
    # the view follows a growing list (the worker appends hashes)
    raw.extend([b"\x0a", b"\x0b"])
    assert len(view) == 4 and view[3] == b"\x0b"
    assert chunk_hashes(raw, 16, 16) is raw


@pytest.mark.parametrize(("hash_block", "block"), [(16, 24), (16, 8), (0, 16), (16, 0), (-16, 32)])
def test_chunk_hashes_rejects_bad_block_sizes(hash_block: int, block: int) -> None:
    with pytest.raises(LayoutError, match="hash_block_size"):
        ChunkHashes([b"x"], hash_block, block)
    if hash_block != block:
        with pytest.raises(LayoutError):
            chunk_hashes([b"x"], hash_block, block)
