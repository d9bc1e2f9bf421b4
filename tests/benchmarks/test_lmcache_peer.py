"""vLLM's own LMCache connectors behind its OpenAI server: `LMCacheMPConnector` against LMCache's MP
server; and `LMCacheConnectorV1`, LMCache inside the server, which the CPU build cannot serve.

MP: a first server computes a prompt (its KV goes to LMCache); a fresh second server, with an empty
prefix cache of its own, must get the prompt's prefix from LMCache (`cached_tokens` > 0, counted
as external hits) and produce the same greedy tokens.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvpool.benchmarks.serving.lmcache_peer import InstallError, Peer, ensure_installed, lmcache_mp_server
from kvpool.benchmarks.serving.serve_workload import Workload
from kvpool.benchmarks.serving.servers import _token_bytes, _try_unsupported
from kvpool.testing.models import default_model_dir, make_tiny_model
from kvpool.testing.server import openai_server

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

BLOCK = 64
CHUNK = 256  # LMCache's default; a 300-token prompt is stored and served as one chunk


@pytest.fixture(scope="module")
def install_dir() -> Path:
    try:
        return ensure_installed()
    except InstallError as exc:
        pytest.skip(f"lmcache cannot be installed here (offline?): {exc}")


@pytest.fixture(scope="module")
def peer(install_dir: Path) -> Iterator[Peer]:
    with lmcache_mp_server(install_dir=install_dir, l1_size_gb=0.25, chunk_size=CHUNK) as running:
        yield running


def test_engine_start_survives_numba(peer: Peer) -> None:
    """The call that crashed with lmcache imported (`register_triton_kernel_overrides`) now passes."""
    code = (
        "import lmcache.integration.vllm.lmcache_mp_connector\n"
        "from vllm.platforms import current_platform\n"
        "current_platform.register_triton_kernel_overrides()\n"
        "print('started')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **peer.env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "started" in result.stdout


def test_fresh_server_loads_from_lmcache(peer: Peer) -> None:
    model = make_tiny_model("llama", default_model_dir() / "llama")
    rng = random.Random(7)
    prompt = [rng.randrange(3, 1000) for _ in range(300)]

    with openai_server(
        model, block_size=BLOCK, max_model_len=512, kv_transfer_config=peer.kv_transfer_config, env=peer.env
    ) as first:
        computed = first.complete(prompt, max_tokens=8)
    assert computed["cached_tokens"] == 0

    with openai_server(
        model, block_size=BLOCK, max_model_len=512, kv_transfer_config=peer.kv_transfer_config, env=peer.env
    ) as second:
        loaded = second.complete(prompt, max_tokens=8)
        external_hits = second.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
        log = second.log_tail()
    assert loaded["cached_tokens"] == CHUNK, log
    assert external_hits >= CHUNK, log
    assert loaded["token_ids"] == computed["token_ids"]


def test_the_in_process_connector_starts_unable_to_serve_on_the_cpu_build(install_dir: Path) -> None:
    """`LMCacheConnectorV1` finds no CPU transfer path in lmcache 0.5.6 and recomputes everything: the
    serve bench lists it as unable to run, with this reason. When a release serves the CPU build, this
    fails, and the connector becomes a peer of the bench."""
    workload = Workload()
    model = make_tiny_model(workload.model_kind, default_model_dir() / workload.model_kind)
    outcome = _try_unsupported("LMCacheConnectorV1", model, workload, _token_bytes(model, workload.dtype))
    assert outcome.startswith("starts in degraded mode"), outcome
    assert "No supported cpu connector found" in outcome, outcome
