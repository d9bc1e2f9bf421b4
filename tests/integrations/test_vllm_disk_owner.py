"""Two real vLLM engines given one `disk_path`: the second, in a process of its own, is refused at
start-up by a message naming the directory and the first engine's process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from kvpool.backends.shared_pools import drop_shared_tiered_pools
from kvpool.testing.engine import engine, generate_greedy

from .conftest import BLOCK, connector_config, random_prompts

pytestmark = pytest.mark.vllm

START_LIMIT_S = 240.0


def test_a_second_engine_on_the_same_disk_path_is_refused_at_start_up(model_dir, pool_name, tmp_path) -> None:
    model = model_dir("llama")
    config = connector_config(pool_name, disk_path=str(tmp_path / "kv"), disk_capacity_bytes="64MiB")
    script = textwrap.dedent(
        f"""
        from kvpool.testing.engine import engine
        with engine({str(model)!r}, block_size={BLOCK}, kv_transfer_config={config!r}):
            print("second engine started")
        """
    )
    try:
        with engine(model, block_size=BLOCK, kv_transfer_config=config) as llm:
            assert generate_greedy(llm, random_prompts(1, 2 * BLOCK, seed=3), 4)
            start = time.monotonic()
            second = subprocess.run(
                [sys.executable, "-c", script],
                capture_output=True,
                text=True,
                timeout=START_LIMIT_S,
                env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            )
            took = time.monotonic() - start
        assert second.returncode != 0 and "second engine started" not in second.stdout, second.stdout
        directory = str(tmp_path / "kv" / "rank0")
        assert "DiskInUseError" in second.stderr, second.stderr[-3000:]
        assert f"{directory} is held by pid {os.getpid()}" in second.stderr, second.stderr[-3000:]
        print(f"the second engine was refused {took:.1f} s after its process started")
    finally:
        drop_shared_tiered_pools()
