"""What the trace shows: the reuse the eviction policies' rules rest on (docs/eviction-policy.md), and
the doc's generated parts from a trace-hits result file.

`analyze` measures reuse distance by a block's position in its chain, by its number of children, by how
often it was named before, and by the time since its chain was last extended (`trace_hits.run` puts it
in the result's `analysis`). `doc_blocks` turns a result into the doc's generated parts (the analysis'
tables; each policy's hits over the lru policy's with the verdicts) and `update_doc` writes them between
the doc's `<!-- generated:NAME -->` markers (`python -m kvpool.benchmarks.policy.trace_hits doc`).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

from kvpool.benchmarks.measure.report import markdown_table
from kvpool.benchmarks.policy.trace_hits_report import cell, to_markdown
from kvpool.benchmarks.policy.trace_replay import common_head

# --- what the trace shows: the reuse the policies' rules rest on -------------------------------------

POSITION_BINS = ((0, 0), (1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 1 << 30))
CHILDREN_BINS = ((0, 0), (1, 1), (2, 3), (4, 1 << 30))
SEEN_BINS = ((0, 0), (1, 1), (2, 3), (4, 1 << 30))
IDLE_BINS = ((-1, -1), (0, 99), (100, 999), (1000, 2999), (3000, 1 << 30))  # -1: a block's first sighting


def analyze(chains: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Each block sighting (a request naming it; the blocks of the trace's common head, a system prompt
    every request starts with, left out) grouped four ways: by the block's position in its chain (0: the
    first); by how many children it has by then (distinct blocks that followed it in some request); by
    how often it was named before; by the requests since its chain was last extended below it (a request
    brought it a child it had not had; "first": the block's first sighting). Per group: the share of
    sightings whose block is named again later, and how far that is: in requests (median, 90th
    percentile) and in new blocks (median: distinct blocks first named in between, what an LRU pool has
    to hold beside it to keep it)."""
    head = common_head(chains)
    next_use: list[list[int]] = [[] for _ in chains]
    seen: dict[int, int] = {}
    for index in range(len(chains) - 1, -1, -1):
        next_use[index] = [seen.get(block, -1) for block in chains[index]]
        for block in chains[index]:
            seen[block] = index
    new_before: list[int] = []  # per request, the distinct blocks first named before it
    known: set[int] = set()
    for chain in chains:
        new_before.append(len(known))
        known.update(chain)
    children: dict[int, set[int]] = {}
    named: Counter[int] = Counter()
    extended_at: dict[int, int] = {}  # block -> the request that last brought it a new child (or named it first)
    binned = (("position", POSITION_BINS), ("children", CHILDREN_BINS), ("seen", SEEN_BINS), ("idle", IDLE_BINS))
    distances: dict[str, dict[tuple[int, int], list[tuple[int, int]]]] = {
        name: {b: [] for b in bins} for name, bins in binned
    }
    counts: dict[str, Counter[tuple[int, int]]] = {name: Counter() for name, _ in binned}
    for index, chain in enumerate(chains):
        for position in range(head, len(chain)):
            block = chain[position]
            kids = children.get(block)
            last = extended_at.get(block)
            values = {
                "position": position,
                "children": len(kids) if kids else 0,
                "seen": named[block],
                "idle": -1 if last is None else index - last,
            }
            later = next_use[index][position]
            for name, bins in binned:
                where = next(b for b in bins if b[0] <= values[name] <= b[1])
                counts[name][where] += 1
                if later >= 0:
                    distances[name][where].append((later - index, new_before[later] - new_before[index]))
        for block in chain:
            named[block] += 1
            extended_at.setdefault(block, index)
        for parent, block in pairwise(chain):
            kids = children.setdefault(parent, set())
            if block not in kids:
                kids.add(block)
                extended_at[parent] = index
    return {
        "common_head": head,
        "sightings": sum(max(0, len(chain) - head) for chain in chains),
        "distinct_blocks": len(known),
        "by": {name: [_reuse(b, counts[name][b], distances[name][b]) for b in bins] for name, bins in binned},
    }


def _reuse(bins: tuple[int, int], count: int, reuses: list[tuple[int, int]]) -> dict[str, Any]:
    requests = sorted(distance for distance, _ in reuses)
    blocks = sorted(new for _, new in reuses)
    low, high = bins
    label = "first" if low < 0 else str(low) if low == high else f"{low}+" if high >= 1 << 29 else f"{low}-{high}"
    return {
        "bin": label,
        "sightings": count,
        "reused": round(len(reuses) / count, 3) if count else None,
        "median_requests": requests[len(requests) // 2] if requests else None,
        "p90_requests": requests[int(len(requests) * 0.9)] if requests else None,
        "median_new_blocks": blocks[len(blocks) // 2] if blocks else None,
    }


# --- docs/eviction-policy.md: its generated parts, from a result file ----------------------------------

DOC = Path("docs") / "eviction-policy.md"
RESULT = Path("benchmarks") / "results" / "trace-hits.json"
_DISTANCES = ("median_requests", "p90_requests", "median_new_blocks")
ANALYSIS_TITLES = {
    "position": "by the block's position in its chain (0: a chain's first block)",
    "children": "by the children the block had by then (distinct blocks that followed it)",
    "seen": "by how often the block was named before",
    "idle": "by the requests since the block's chain was last extended below it",
}


def doc_blocks(result: dict[str, Any], source: str = str(RESULT)) -> dict[str, str]:
    """The generated parts of docs/eviction-policy.md from a trace-hits result: the trace's reuse
    (`analysis`), and each policy's hits over the lru policy's with the verdicts."""
    named = f"From `{source}` ({result['trace']}, commit `{result.get('commit', 'not recorded')}`)."
    analysis = result.get("analysis")
    parts = [named]
    if analysis:
        parts.append(
            f"{analysis['sightings']:,} block sightings (a request naming a block; the common head of "
            f"{analysis['common_head']} block(s) every request starts with left out). Reused: the share of sightings "
            "whose block is named again later; how far: in requests, and in new blocks (distinct blocks first "
            "named in between: what an LRU pool holds beside it to keep it)."
        )
        for name, title in ANALYSIS_TITLES.items():
            parts.append(
                f"Reuse {title}:\n\n"
                + markdown_table(
                    [
                        name,
                        "sightings",
                        "reused",
                        "median distance (requests)",
                        "p90 (requests)",
                        "median (new blocks)",
                    ],
                    [
                        [
                            row["bin"],
                            f"{row['sightings']:,}",
                            cell(row["reused"]),
                            *["-" if row[k] is None else f"{row[k]:,}" for k in _DISTANCES],
                        ]
                        for row in analysis["by"][name]
                    ],
                )
            )
    markdown = to_markdown(result)
    ratios = markdown[markdown.index("Each policy's hits / the lru policy's") :]
    return {"trace-analysis": "\n\n".join(parts), "policy-ratios": named + "\n\n" + ratios.strip()}


def update_doc(doc: Path = DOC, result_path: Path = RESULT) -> None:
    """Rewrite the generated parts of `doc` (between `<!-- generated:NAME -->` and `<!-- /generated:NAME -->`)
    from the result at `result_path`; the rest is written by people and kept."""
    text = doc.read_text()
    for name, body in doc_blocks(json.loads(result_path.read_text()), str(result_path)).items():
        start, end = f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"
        found = re.search(re.escape(start) + r".*?" + re.escape(end), text, re.DOTALL)
        if found is None:
            raise ValueError(f"{doc}: no {start} ... {end} block")
        text = text[: found.start()] + f"{start}\n{body}\n{end}" + text[found.end() :]
    doc.write_text(text)
