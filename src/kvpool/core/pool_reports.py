"""What a worker rank tells the scheduler of its pool, and what the scheduler tells routers.

A `PoolReport` crosses processes every engine step (vLLM's worker -> scheduler metadata), so it is
flat and small; a `PoolEvent` is one transition of the scheduler's view (a chunk present in every
namespace it needs, or no longer), from which KV events are made. Plain data: the worker's trackers
(`kvpool.worker.pool_tracker`) make reports, the scheduler's index and remote events read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PoolReport:
    """One rank's changes since its previous report. Flat and small: it is pickled every step."""

    rank: int
    epoch: int
    stored: dict[str, list[bytes]] = field(default_factory=dict)  # namespace prefix -> chunk hashes now held
    dropped: dict[str, list[bytes]] = field(default_factory=dict)  # namespace prefix -> chunk hashes gone
    parents: dict[str, dict[bytes, bytes]] = field(default_factory=dict)  # prefix -> chunk -> its parent
    full: bool = False  # the rank's first report: `stored` is everything it holds
    # a tiered pool: chunks held now on disk only (`demoted`), and chunks that were on disk only at the
    # previous report and are not now (back in DRAM, or dropped: then also in `dropped`)
    demoted: dict[str, list[bytes]] = field(default_factory=dict)
    promoted: dict[str, list[bytes]] = field(default_factory=dict)
    # the rank's reports so far, this one included: the scheduler acknowledges the highest it absorbed
    # (`StepMetadata.pool_acks`), and the rank frees what this report withdrew (the hit contract)
    seq: int = 0


@dataclass(frozen=True)
class PoolEvent:
    """A chunk of a group became present in every namespace it needs (`stored`), or stopped being.
    A stored chunk's `parent` is the chunk before it in its chain (None: it is the first). `on_disk`:
    some rank holds it on its disk tier only (a router's cost to reach it is a disk read)."""

    group: int
    chunk_hash: bytes
    stored: bool
    parent: bytes | None = None
    on_disk: bool = False
