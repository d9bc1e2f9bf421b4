"""The capture stage of a save: one engine step's new chunks, as one batch, copied out of the engine.

A batch holds the ranges the planner made (`save_plan.py`) and their chunks. It is captured out of the
engine's blocks inside the step (`capture`: host copies the batch owns), or, for an in-process pool,
left in place to be put straight from them inside the step (`save_put.py`). Small captured batches
queued for the sender are merged into one (`merge`), so the pool's fixed cost per call is paid once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpool.backends.base import Rows
from kvpool.core.chunks import ChunkRef
from kvpool.worker.device_copy import Staged
from kvpool.worker.layout import KVLayout
from kvpool.worker.save_plan import SaveRange


@dataclass
class SaveBatch:
    seq: int
    epoch: int  # pool resets before it was taken: a batch from an older epoch is never stored
    ranges: list[SaveRange]
    items: list[ChunkRef]
    captured: dict[int, Rows] | None = None  # per group: host copies, rows in item order; None: engine memory
    rows: list[int] = field(default_factory=list)  # per item: its row in captured[item.group]
    nbytes: int = 0
    copying: list[Staged] = field(default_factory=list)  # device copies into `captured` still running
    # every group's copies are rows of one array (their chunks have one size): one put call for all groups
    one_array: bool = False

    def wait_copied(self) -> None:
        """The captured bytes are valid once this returns (device memory: on the caller's thread)."""
        for staged in self.copying:
            staged.wait()
        self.copying.clear()

    def __len__(self) -> int:
        return len(self.items)

    @classmethod
    def merge(cls, batches: Sequence[SaveBatch]) -> SaveBatch:
        """One batch holding the captured items of `batches`, in order (their host copies are joined:
        merging pays off for small batches, whose put costs far more than their bytes)."""
        if all(batch.one_array or len(batch.captured or ()) == 1 for batch in batches):
            joined = cls._merge_arrays(batches)
            if joined is not None:
                return joined
        groups = sorted({group for batch in batches for group in batch.captured or {}})
        base: dict[int, int] = dict.fromkeys(groups, 0)  # per group: rows of the batches before
        rows: list[int] = []
        for batch in batches:
            batch.wait_copied()
            if batch.captured is None:
                raise ValueError(f"save batch {batch.seq} was not captured: only host copies can be merged")
            rows.extend(base[item.group] + row for item, row in zip(batch.items, batch.rows))
            for group, copies in batch.captured.items():
                base[group] += copies.arrays[0].shape[0]
        captured: dict[int, Rows] = {}
        for group in groups:
            parts = [b.captured[group].arrays for b in batches if b.captured is not None and group in b.captured]
            captured[group] = Rows(tuple(np.concatenate(layers) for layers in zip(*parts)), np.arange(base[group]))
        return cls(
            seq=batches[-1].seq,
            epoch=batches[-1].epoch,
            ranges=[part for batch in batches for part in batch.ranges],
            items=[item for batch in batches for item in batch.items],
            captured=captured,
            rows=rows,
            nbytes=sum(batch.nbytes for batch in batches),
        )

    @classmethod
    def _merge_arrays(cls, batches: Sequence[SaveBatch]) -> SaveBatch | None:
        """`merge` of batches each captured as one array of one row width, as one array (one put call);
        None when their widths differ."""
        arrays = []
        for batch in batches:
            batch.wait_copied()
            assert batch.captured is not None
            arrays.append(next(iter(batch.captured.values())).arrays)
        if any(len(layers) != 1 for layers in arrays) or len({layers[0].shape[1] for layers in arrays}) != 1:
            return None
        rows: list[int] = []
        base = 0
        for batch, layers in zip(batches, arrays):
            rows.extend(base + row for row in batch.rows)
            base += layers[0].shape[0]
        whole = Rows.checked((np.concatenate([layers[0] for layers in arrays]),), np.arange(base))
        groups = {group for batch in batches for group in batch.captured or {}}
        return cls(
            seq=batches[-1].seq,
            epoch=batches[-1].epoch,
            ranges=[part for batch in batches for part in batch.ranges],
            items=[item for batch in batches for item in batch.items],
            captured=dict.fromkeys(groups, whole),
            rows=rows,
            nbytes=sum(batch.nbytes for batch in batches),
            one_array=True,
        )

    def capture(self, layout: KVLayout) -> None:
        """Copy the batch's blocks out of the engine into host memory the batch owns. On the host, when
        every group's chunks have one size (vLLM gives a hybrid model's groups one page size), all go
        into one array, so a remote pool takes the batch in one call instead of one per group."""
        groups: dict[int, list[int]] = {}
        self.rows = []
        for item in self.items:
            ids = groups.setdefault(item.group, [])
            self.rows.append(len(ids))
            ids.append(item.block_id)
        self.captured, self.copying = {}, []
        self.nbytes = sum(layout.chunk_nbytes(group) * len(ids) for group, ids in groups.items())
        widths = {layout.stored_nbytes(group) for group in groups}
        if len(groups) > 1 and len(widths) == 1 and not layout.staged:
            shared = np.empty((len(self.items), widths.pop()), dtype=np.uint8)
            first: dict[int, int] = {}  # per group: the row of its first block
            start = 0
            for group, ids in groups.items():
                first[group] = start
                layout.copy_rows(group, ids, out=shared[start : start + len(ids)])
                start += len(ids)
            whole = Rows.checked((shared,), np.arange(len(self.items)))
            self.captured = dict.fromkeys(groups, whole)
            self.rows = [first[item.group] + row for item, row in zip(self.items, self.rows)]
            self.one_array = True
            return
        for group, ids in groups.items():
            self.captured[group], staged = layout.capture_rows(group, ids)
            if staged is not None:
                self.copying.append(staged)
