"""`kvpool bench transfer --backend disk` at tiny sizes: every move runs, ratios pair by round, and the
files it wrote are gone afterwards."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvpool.benchmarks.transfer import disk
from kvpool.ops.cli import app


def test_the_full_tier_row_evicts_a_chunk_with_every_write_and_reuses_its_file(tmp_path) -> None:
    cell = disk._Cell(str(tmp_path), 64 << 10, 4)
    try:
        for _ in range(3):
            cell.prepare("tier_write_full")
            cell.tier_write_full()
        stats = cell.full_tier.stats()
        assert stats.files == 4 and stats.writes == 16 and stats.evictions == 12  # a fill, then 3 batches
        assert len(list((tmp_path / "full").rglob("*.kvc"))) == 4
    finally:
        cell.close()


def test_the_disk_bench_times_every_move_and_states_each_target(tmp_path) -> None:
    result = disk.run(chunk_sizes=(64 << 10,), keys=4, rounds=2, directory=str(tmp_path))
    (row,) = result["results"]
    direct = set(disk.DIRECT) if result["config"]["direct"] else set()  # tmpfs refuses O_DIRECT
    assert set(row["gbps"]) == {*disk.SYSTEMS} - set(disk.DIRECT) | direct
    assert all(figure["estimate"] > 0 and figure["rounds"] == 2 for figure in row["gbps"].values())
    pairs = {name: of for name, of in disk.PAIRS if name in row["gbps"]}
    assert {name: entry["of"] for name, entry in row["ratios"].items()} == pairs
    assert {name for name, entry in row["ratios"].items() if "verdict" in entry} == disk.TARGETED & set(pairs)
    if direct:  # the tier's own O_DIRECT mode, against the device in the same mode
        assert {"direct_tier_write", "direct_tier_write_full", "direct_tier_read"} <= set(row["ratios"])
    assert list(tmp_path.iterdir()) == [], "the bench leaves no files behind"


def test_the_command_line_runs_the_disk_bench(tmp_path) -> None:
    args = ["bench", "transfer", "--backend", "disk", "--keys", "2", "--reps", "2", "--dir", str(tmp_path), "--json"]
    done = CliRunner().invoke(app, [*args, "--no-fail"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["backend"] == "disk"
    assert CliRunner().invoke(app, ["bench", "transfer", "--backend", "disk", "--reps", "1"]).exit_code == 2
