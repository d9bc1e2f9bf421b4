"""One py-spy profile of the in-process engine on the hit phase, per connector, for `kvpool bench breakdown`.

py-spy (`pip install py-spy`) attaches to this very process (`--pid`, `--nonblocking`: the engine is
never paused) while a fresh engine serves the hit prompts of a pool filled by a first engine; the
samples are reduced to a short table: the frames of the connector's own code (kvpool's package, or
vLLM's `mooncake/store/` package) by own time (the frame on top of the Python stack, which includes
the native calls it makes, e.g. a Mooncake RPC), and by `under` time (the deepest connector frame of
every sample whose stack passes through connector code). Idle threads (waiting on a lock, a queue or
a socket) are not sampled.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

RATE_HZ = 100
TOP = 10
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def py_spy() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


def connector_file(path: str) -> bool:
    """kvpool's own code (not its benches or test helpers), or vLLM's Mooncake store connector."""
    if "/kvpool/" in path:
        return not any(part in path for part in ("/kvpool/benchmarks/", "/kvpool/testing/", "/kvpool/ops/cli.py"))
    return "/mooncake/store/" in path and "/vllm/" in path


def _frame(text: str) -> tuple[str, str]:
    match = _FRAME.match(text)
    if match is None:
        return text, ""
    path = match["file"]
    short = path.split("site-packages/")[-1].split("/src/")[-1]
    return f"{match['func']} ({short})", path


def reduce(raw: str, rate_hz: int = RATE_HZ, top: int = TOP) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks → top connector frames by own and by under time."""
    own: Counter[str] = Counter()
    under: Counter[str] = Counter()
    total = in_connector = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_frame(part) for part in stack.split(";")]
        mine = [name for name, path in frames if connector_file(path)]
        if not mine:
            continue
        in_connector += count
        under[mine[-1]] += count
        if connector_file(frames[-1][1]):
            own[frames[-1][0]] += count

    def table(counter: Counter[str]) -> list[dict[str, Any]]:
        return [
            {
                "frame": name,
                "samples": n,
                "ms": round(n * 1000 / rate_hz, 1),
                "percent": round(100 * n / total, 2),
                "percent_of_connector": round(100 * n / in_connector, 1),
            }
            for name, n in counter.most_common(top)
        ]

    return {
        "samples": total,
        "rate_hz": rate_hz,
        "connector_samples": in_connector,
        "connector_percent": round(100 * in_connector / total, 2) if total else 0.0,
        "own": table(own),
        "under": table(under),
    }


def profile_hits(model: str, name: str, system: str, wait_ms: float | None, workload: Any, settings: dict[str, Any],
                 concurrencies: tuple[int, ...], max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """Fill a fresh pool, then profile a fresh engine on the hit prompts (every concurrency)."""
    from kvpool.benchmarks.serving.breakdown_engines import connector, engine, fill, pool
    from kvpool.benchmarks.serving.breakdown_probe import Probe, drive

    binary = py_spy()
    if binary is None:
        return {"error": "py-spy not installed (pip install py-spy)"}
    with tempfile.TemporaryDirectory(prefix="kvpool-breakdown-spy-") as folder:
        out = os.path.join(folder, "stacks.txt")
        with pool() as (master, _pids), connector(system, master, wait_ms) as config:
            fill(model, config, workload, settings)
            with engine(model, config, settings) as llm:
                probe = Probe(llm)  # the same wrappers as the timed runs
                command = [binary, "record", "--pid", str(os.getpid()), "--nonblocking", "--function"]
                command += ["--full-filenames", "-r", str(RATE_HZ), "-f", "raw", "-o", out]
                spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                try:
                    per = len(workload.hit) // len(concurrencies)
                    for index, concurrency in enumerate(concurrencies):
                        label = f"spy/c{concurrency}"
                        probe.phase = label
                        drive(probe, workload.hit[index * per : (index + 1) * per], max_tokens, concurrency, label)
                finally:
                    spy.send_signal(signal.SIGINT)
                    try:
                        _, err = spy.communicate(timeout=30)
                    except subprocess.TimeoutExpired:
                        spy.kill()
                        _, err = spy.communicate()
                    probe.close()
        if not os.path.exists(out):
            return {"error": f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}"}
        return reduce(Path(out).read_text())
