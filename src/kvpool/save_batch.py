"""One engine step's save: the new chunks of every request that step, as one batch.

A batch is captured out of the engine's blocks inside the step (`capture`: host copies the batch
owns), or, for an in-process pool, put straight from them inside the step. `put` then moves it into
the pool in as few backend calls as the pool allows: one existence check for the whole batch, and one
put per KV-cache group and `batch_chunks` chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.backends.base import Backend, Rows, Status
from kvpool.chunks import ChunkRef
from kvpool.device_copy import Staged
from kvpool.layout import KVLayout

if TYPE_CHECKING:
    from kvpool.worker import WorkerStats


@dataclass
class SaveRange:
    """One request's share of a batch: `count` consecutive items, covering tokens [start, end)."""

    state: Any  # the worker's per-request state, whose marks the outcome moves
    start: int
    end: int
    count: int
    # False: boundary states (vLLM's hand-off), put once from the block handed over in their step and
    # never re-planned, so their outcome moves no mark
    moves_marks: bool = True


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

    def put(
        self, backend: Backend, layout: KVLayout, *, check_exists: bool, batch_chunks: int, stats: WorkerStats
    ) -> list[Status]:
        """Store every item the pool does not hold; per item OK, or why not. A failed call leaves the
        items after it untried (ERROR): the worker retries their ranges as a whole."""
        self.wait_copied()
        items = self.items
        results = [Status.OK] * len(items)
        stats.chunks_examined += len(items)
        todo = list(range(len(items)))
        if todo and check_exists:
            present = backend.exists([item.key for item in items])
            stats.chunks_already_present += sum(present)
            todo = [index for index, there in zip(todo, present) if not there]
        together: Callable[[int], int] | None = None  # groups whose chunks one put call can take
        if self.captured is None:
            together = layout.row_group  # in place: groups sharing arrays
        elif self.one_array:
            anyone = next(iter(self.captured))
            together = lambda group: anyone  # noqa: E731 (every group's copies are in one array)
        for offset in range(0, len(todo), batch_chunks):
            part = todo[offset : offset + batch_chunks]
            statuses = per_group(
                items, part, lambda group, members: self._put(backend, layout, group, members, stats), together
            )
            for index, status in zip(part, statuses):
                results[index] = status
            if any(status is not Status.OK for status in statuses):
                for index in todo[offset + batch_chunks :]:
                    results[index] = Status.ERROR
                break
        return results

    def _put(
        self, backend: Backend, layout: KVLayout, group: int, members: list[int], stats: WorkerStats
    ) -> list[Status]:
        items = self.items
        keys = [items[index].key for index in members]
        if self.captured is None:
            rows = layout.save_rows(group, [items[index].block_id for index in members])
        else:
            captured = self.captured[group]
            rows = Rows(captured.arrays, np.asarray([self.rows[index] for index in members], dtype=np.int64))
        statuses = backend.put(keys, rows)
        stats.put_calls += 1
        ok = statuses.count(Status.OK)
        stats.chunks_put += ok
        stats.bytes_put += ok * layout.chunk_nbytes(group)
        stats.chunks_put_failed += len(statuses) - ok
        return statuses


def per_group(
    items: Sequence[ChunkRef],
    members: list[int],
    call: Callable[[int, list[int]], list[Status]],
    key: Callable[[int], int] | None = None,
) -> list[Status]:
    """`call` once per KV cache group with that group's members, in order; the statuses in member order.
    `key`: groups with the same key go together, to `call` with the key as their group."""
    if not members:
        return call(0, members)
    groups = {items[index].group for index in members}
    if key is not None:
        groups = {key(group) for group in groups}
    if len(groups) == 1:
        return call(groups.pop(), members)  # one group: the common case
    by_group: dict[int, list[int]] = {}
    for position, index in enumerate(members):
        group = items[index].group
        by_group.setdefault(group if key is None else key(group), []).append(position)
    results = [Status.ERROR] * len(members)
    for group, positions in by_group.items():
        for position, status in zip(positions, call(group, [members[p] for p in positions])):
            results[position] = status
    return results
