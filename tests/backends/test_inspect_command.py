"""`kvpool inspect master` and `inspect engine`: what a running pool holds, from the HTTP endpoints the
master and vLLM already serve; exit 1 when the address does not answer like one."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from kvpool.backends.base import Status
from kvpool.backends.mooncake.master import free_port
from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.ops.cli import app
from kvpool.ops.inspection import namespaces_of

A = KeySpace(LayoutFingerprint("org/Model-A", "bf16", 64, "cpu", group_id=0))
B = KeySpace(LayoutFingerprint("org/Model-A", "bf16", 64, "cpu", group_id=1, tp_shard=1))


def test_keys_group_by_namespace_and_other_keys_are_counted_apart():
    keys = [A.key(bytes([i]) * 16) for i in range(3)] + [B.key(b"\x01" * 16), "someone/else", "kvp1/short/x"]
    spaces, other = namespaces_of(keys)
    assert [(s.prefix, s.model, s.shard, s.group, s.keys) for s in spaces] == [
        (A.prefix, "Model-A", "0", "0", 3),
        (B.prefix, "Model-A", "1", "1", 1),
    ]
    assert other == 2


@pytest.mark.mooncake
def test_inspect_master_shows_keys_and_bytes_per_namespace(mooncake_master: Any, mooncake_client: Any) -> None:
    mooncake_client.clear()  # the session's client: start from an empty pool
    chunk = np.arange(4096, dtype=np.uint8)
    a_keys = [A.key(bytes([i]) * 16) for i in range(5)]
    b_keys = [B.key(bytes([i]) * 16) for i in range(2)]
    assert mooncake_client.put(a_keys + b_keys + ["not-kvpool"], [[chunk]] * 8) == [Status.OK] * 8
    url = f"http://127.0.0.1:{mooncake_master.metrics_port}"
    outcome = CliRunner().invoke(app, ["inspect", "master", url, "--json"])
    assert outcome.exit_code == 0, outcome.output
    report = json.loads(outcome.output)
    found = {(space["prefix"], space["keys"], space["bytes"]) for space in report["namespaces"]}
    assert found == {(A.prefix, 5, 5 * 4096), (B.prefix, 2, 2 * 4096)}
    assert report["other_keys"] == 1
    assert report["metrics"]["master_key_count"] == 8
    table = CliRunner().invoke(app, ["inspect", "master", url])
    assert table.exit_code == 0 and "Model-A" in table.output and "evicted keys" in table.output
    # the master's port is no vLLM server with kvpool
    assert CliRunner().invoke(app, ["inspect", "engine", url]).exit_code == 1


@pytest.mark.parametrize("command", ["master", "engine"])
def test_inspect_exits_1_naming_an_address_that_does_not_answer(command: str) -> None:
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    outcome = CliRunner().invoke(app, ["inspect", command, url])
    assert outcome.exit_code == 1
    assert url in outcome.output
