"""The checkpoint digest names the weights' values, not their path or their files' times."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kvpool.core.checkpoint import SAMPLED_TENSORS_PER_FILE, checkpoint_digest, directory_digest


def _checkpoint(path: Path, seed: int = 0, tensors: int = 4) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    weights = {f"layers.{i}.w": rng.standard_normal((64, 32)).astype(np.float32) for i in range(tensors)}
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return path


def test_the_same_bytes_anywhere_give_the_same_digest(tmp_path: Path) -> None:
    a = _checkpoint(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b)  # a copy: other path, other modification times
    os.utime(b / "model.safetensors", (1, 1))
    assert checkpoint_digest(str(a)) == checkpoint_digest(str(b)) is not None


def test_other_values_in_the_same_shapes_give_another_digest(tmp_path: Path) -> None:
    """A fine-tune saved over the old checkpoint: same file names, sizes and header."""
    path = _checkpoint(tmp_path / "m")
    before = checkpoint_digest(str(path))
    size = (path / "model.safetensors").stat().st_size
    weights = load_file(str(path / "model.safetensors"))
    weights["layers.2.w"] = weights["layers.2.w"] * 1.01  # one tensor of four retrained
    save_file(weights, str(path / "model.safetensors"))
    assert (path / "model.safetensors").stat().st_size == size
    assert checkpoint_digest(str(path)) != before


def test_a_tensor_changed_past_its_sampled_bytes_only_is_the_weights_version_case(tmp_path: Path) -> None:
    """What the samples cannot see (values edited by hand in a tensor's unsampled bytes) keeps the digest:
    docs/correctness.md names `weights_version` for it. Pinned here so the limit stays known."""
    path = _checkpoint(tmp_path / "m")
    before = checkpoint_digest(str(path))
    weights = load_file(str(path / "model.safetensors"))
    weights["layers.0.w"][5, 3] += 1.0  # byte 5*32*4+12 = 652: neither the first 64 nor the middle 64
    save_file(weights, str(path / "model.safetensors"))
    assert checkpoint_digest(str(path)) == before


def test_every_file_and_the_index_count(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path / "m")
    before = checkpoint_digest(str(path))
    (path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with_index = checkpoint_digest(str(path))
    assert with_index != before
    (path / "extra.bin").write_bytes(os.urandom(3 * 4096 + 7))  # a file kvpool cannot parse: sampled pages
    with_bin = checkpoint_digest(str(path))
    assert with_bin != with_index
    (path / "extra.bin").write_bytes(os.urandom(3 * 4096 + 7))
    rewritten = checkpoint_digest(str(path))
    assert rewritten != with_bin
    (path / "notes.txt").write_text("not weights")
    assert checkpoint_digest(str(path)) == rewritten  # a file no loader reads names nothing
    assert directory_digest(path) == checkpoint_digest(str(path))


def test_nothing_readable_names_no_weights(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert checkpoint_digest(str(tmp_path / "empty")) is None
    assert checkpoint_digest("no-such-org/no-such-model-kvpool") is None  # not a path, not in the hub cache


def test_a_hub_model_names_its_snapshot_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id resolves to its cached snapshot (no network): the commit and the snapshot's files."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hub" / "models--org--tiny"
    for commit in ("a" * 40, "b" * 40):
        _checkpoint(repo / "snapshots" / commit)  # the same bytes at two commits
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    at_a = checkpoint_digest("org/tiny")
    assert at_a is not None and at_a != directory_digest(repo / "snapshots" / ("a" * 40))
    (repo / "refs" / "main").write_text("b" * 40)  # `main` moved
    assert checkpoint_digest("org/tiny") not in (None, at_a)
    assert checkpoint_digest("org/tiny", revision="a" * 40) == at_a


def test_many_tensors_are_sampled_evenly_and_boundedly(tmp_path: Path) -> None:
    path = tmp_path / "m"
    path.mkdir()
    n = SAMPLED_TENSORS_PER_FILE * 2 + 3
    weights = {f"t{i}": np.full((2,), i, dtype=np.float32) for i in range(n)}
    save_file(weights, str(path / "model.safetensors"))
    assert checkpoint_digest(str(path)) is not None
