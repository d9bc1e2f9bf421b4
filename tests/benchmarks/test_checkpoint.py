"""Rounds kept across runs: a serve run cut short is taken up where it stopped by the next one of the
same workload and systems, every round measured once, each run named; another workload is refused.
The round loop is driven with its servers and client replaced (what a real round does is test_serve's)."""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from kvpool.benchmarks.measure.checkpoint import Checkpoint, Progress
from kvpool.benchmarks.serving import serve, servers
from kvpool.benchmarks.serving.serve_workload import DATASETS, Workload

SYSTEMS = ("local", "kvpool", "vllm-mooncake-embedded")


class Cut(BaseException):
    """The session ending under a run (not an Exception: no system gives up on it)."""


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    state: dict[str, Any] = {"measured": [], "cut_at": None, "started": []}

    def start_all(stack, systems, model, workload, token_bytes, started, failed):  # type: ignore[no-untyped-def]
        state["started"].append(list(systems))
        for name in systems:
            started(name)
        return {name: servers._Running(server=None, pids=[]) for name in systems}  # type: ignore[arg-type]

    def client_run(system, model, workload, name, dataset, concurrency, seed):  # type: ignore[no-untyped-def]
        round_index = seed  # the fake seeds name the round
        if state["cut_at"] == (round_index, name):
            raise Cut
        if name == "vllm-mooncake-embedded" and state.get("fail_peer") == round_index:
            raise RuntimeError("its master went away")
        state["measured"].append((round_index, name, dataset, concurrency))
        return {
            "system": name, "dataset": dataset, "concurrency": concurrency, "sent": 4, "completed": 4, "failed": 0,
            "ttft_mean_ms": 10.0 + round_index, "ttft_p50_ms": 10.0, "output_tok_s": 5.0,
        }  # fmt: skip

    def seeds(model: Path, workload: Workload) -> dict[tuple[str, int, int], int]:
        rounds = range(9)
        return defaultdict(int, {(d, c, r): r for d in DATASETS for c in workload.concurrencies for r in rounds})

    monkeypatch.setattr(serve, "make_tiny_model", lambda kind, directory: tmp_path)
    monkeypatch.setattr(serve, "_token_bytes", lambda model, dtype: 1024)
    monkeypatch.setattr(serve, "_seeds", seeds)
    monkeypatch.setattr(serve, "start_all", start_all)
    monkeypatch.setattr(serve, "_client_run", client_run)
    probe = dict.fromkeys(("miss_ms", "again_ms", "evicted_ms", "evicted_cached_tokens", "evicted_pool_tokens"), 5.0)
    monkeypatch.setattr(serve, "_probe", lambda server, workload, round_index: dict(probe))
    monkeypatch.setattr(servers, "_served", lambda *a: contextlib.nullcontext())
    return state


def run(path: Path, rounds: int = 3, commit: str = "aaa", **overrides: Any) -> dict[str, Any]:
    workload = Workload(rounds=rounds, concurrencies=(1, 4), **overrides)
    return serve.run(
        workload=workload, systems=SYSTEMS, try_unsupported=False, checkpoint=path, stamp={"commit": commit}
    )


def test_a_run_cut_short_is_taken_up_where_it_stopped_and_every_round_is_measured_once(rig, tmp_path) -> None:
    path = tmp_path / "serve.partial.json"
    rig["cut_at"] = (1, "kvpool")  # in the middle of round 2
    with pytest.raises(Cut):
        run(path)
    kept = json.loads(path.read_text())
    assert kept["rounds_done"] == 1 and {row["round"] for row in kept["rows"]} == {0}  # whole rounds only
    rig["cut_at"] = None
    rig["measured"].clear()
    result = run(path, commit="bbb")
    assert {r for r, *_ in rig["measured"]} == {1, 2}  # round 1 is not measured again
    per_round = {(row["round"], row["system"], row["dataset"], row["concurrency"]) for row in result["results"]}
    assert len(result["results"]) == len(per_round) == 3 * len(SYSTEMS) * len(DATASETS) * 2
    assert [(r["commit"], r["first_round"], r["last_round"]) for r in result["runs"]] == [("aaa", 0, 0), ("bbb", 1, 2)]
    assert len(result["probe"]) == 3 * len(SYSTEMS)


def test_a_system_that_failed_in_an_earlier_run_stays_failed_with_its_rounds_kept(rig, tmp_path) -> None:
    path = tmp_path / "serve.partial.json"
    rig["fail_peer"] = 0
    rig["cut_at"] = (1, "local")
    with pytest.raises(Cut):
        run(path)
    rig["cut_at"] = None
    result = run(path)
    assert rig["started"][-1] == ["local", "kvpool"]  # not started again
    assert "master went away" in result["failed"]["vllm-mooncake-embedded"]


def test_a_checkpoint_of_another_workload_is_refused_with_the_field_that_differs(rig, tmp_path) -> None:
    path = tmp_path / "serve.partial.json"
    rig["cut_at"] = (1, "local")
    with pytest.raises(Cut):
        run(path)
    rig["cut_at"] = None
    with pytest.raises(ValueError, match=r"'workload'.*remove the file"):
        run(path, output_len=9)


def test_a_checkpoint_keeps_whole_rounds_and_each_run_once(tmp_path) -> None:
    keeper = Checkpoint(tmp_path / "x.json", {"bench": "b"}, {"commit": "c1"})
    progress = Progress(rows=[{"round": 0}, {"round": 1}], probes=[{"round": 0}])
    keeper.save(progress, 0)
    keeper.save(progress, 0)
    loaded = Checkpoint(tmp_path / "x.json", {"bench": "b"}).load()
    assert loaded.rounds_done == 1 and loaded.rows == [{"round": 0}] and len(loaded.runs) == 1
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ValueError, match="'bench'"):
        Checkpoint(tmp_path / "x.json", {"bench": "other"}).load()
