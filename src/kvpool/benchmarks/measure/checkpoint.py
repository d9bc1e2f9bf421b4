"""Rounds kept across runs: a bench of interleaved rounds writes what its finished rounds measured
after each one, and a later run of the same bench, workload and systems goes on from there.

A `--long` serve run takes longer than a working session on a 2-core machine (about 18 minutes a
round for nine systems, ten rounds): cut short, it would lose every round. Each round stands on its own
(every system measured in it, back to back, the order rotated), and the verdicts pair systems within a
round, so rounds from two runs join without mixing what one system measured in one run with what
another measured in the other; the result lists each run that measured some of them (`runs`: commit,
date, machine and the rounds it ran), so a report says where every round came from.

Invariants: a checkpoint holds whole rounds only (written after a round ends, atomically: a run killed
while writing leaves the previous one); a checkpoint is joined only by a run whose key (bench,
workload, systems, model) is the one it was written for, and any other is refused with the field
that differs; a system that failed in an earlier run stays failed (its rounds so far are kept).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = 1


@dataclass
class Progress:
    """What earlier runs measured: the rounds done, their rows and probes, the systems that failed."""

    rounds_done: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)
    probes: list[dict[str, Any]] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)


class Checkpoint:
    """The checkpoint file of one bench run, `key` naming what its rounds must share to be joined."""

    def __init__(self, path: Path, key: dict[str, Any], stamp: dict[str, Any] | None = None) -> None:
        self.path = path
        self.key = json.loads(json.dumps(key, default=str))  # as it reads back from the file
        self.stamp = dict(stamp or {})  # this run's commit, date and machine
        self._first_round: int | None = None

    def load(self) -> Progress:
        """The rounds earlier runs left (none without a file); a file of another run is refused."""
        if not self.path.exists():
            return Progress()
        saved = json.loads(self.path.read_text())
        if saved.get("format") != FORMAT:
            raise ValueError(f"checkpoint {self.path}: format {saved.get('format')!r}, expected {FORMAT}")
        theirs = saved.get("key", {})
        for name in sorted(set(self.key) | set(theirs)):
            if self.key.get(name) != theirs.get(name):
                raise ValueError(
                    f"checkpoint {self.path}: its rounds were measured with another {name!r} "
                    f"({theirs.get(name)!r}, this run: {self.key.get(name)!r}); remove the file to start over"
                )
        return Progress(
            saved["rounds_done"], saved["rows"], saved["probes"], saved.get("failed", {}), saved.get("runs", [])
        )

    def save(self, progress: Progress, round_index: int) -> None:
        """Keep every round up to and including `round_index`, with this run named among the runs."""
        if self._first_round is None:
            self._first_round = round_index
        runs = [run for run in progress.runs if run.get("first_round") != self._first_round]
        runs.append({**self.stamp, "first_round": self._first_round, "last_round": round_index})
        progress.runs = runs
        progress.rounds_done = round_index + 1
        body = {
            "format": FORMAT,
            "key": self.key,
            "rounds_done": progress.rounds_done,
            "rows": [row for row in progress.rows if row["round"] <= round_index],
            "probes": [probe for probe in progress.probes if probe["round"] <= round_index],
            "failed": progress.failed,
            "runs": runs,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".tmp")
        partial.write_text(json.dumps(body, indent=1, default=str) + "\n")
        os.replace(partial, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
