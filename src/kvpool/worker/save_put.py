"""The put stage of a save: a batch into the pool, in as few backend calls as the pool allows.

One existence check for the whole batch (when the pool's `exists` is cheaper than a put it spares),
then one put per KV-cache group and `batch_chunks` chunks, from the batch's host copies or straight
from the engine's blocks (an in-process pool, inside the step). A failed call leaves the items after
it untried (ERROR): the planner re-plans their ranges as a whole when they are retired.

A pool that answers "full" may have room a moment later: Mooncake's master evicts in the background
(every 10 ms it frees about 15 % of the pool, oldest first), so a put that lands while it is full is
refused at once although its chunks are the newest, the ones most worth keeping. Their request may be
finished by then, so no later save retries them: the put itself asks again, after `full_retry_s`
pauses, for the chunks refused as full (only off the engine's thread; the caller passes none under
pressure, where the pool stayed full through them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from kvpool.backends.base import Backend, Rows, Status
from kvpool.core.chunks import ChunkRef
from kvpool.worker.layout import KVLayout
from kvpool.worker.save_batch import SaveBatch
from kvpool.worker.stats import WorkerStats

FULL_RETRY_S = (0.01, 0.04, 0.1)  # pauses before asking a full pool again: Mooncake's eviction polls every 10 ms


def put_batch(
    batch: SaveBatch,
    backend: Backend,
    layout: KVLayout,
    *,
    check_exists: bool,
    batch_chunks: int,
    stats: WorkerStats,
    full_retry_s: Sequence[float] = (),
) -> list[Status]:
    """Store every item the pool does not hold; per item OK, or why not. Chunks refused as full are
    put again after each pause of `full_retry_s` (one budget for the call) while any is refused. A
    failed call leaves the items after it untried (ERROR): the worker retries their ranges as a whole."""
    batch.wait_copied()
    items = batch.items
    results = [Status.OK] * len(items)
    stats.chunks_examined += len(items)
    todo = list(range(len(items)))
    if todo and check_exists:
        present = backend.exists([item.key for item in items])
        stats.chunks_already_present += sum(present)
        todo = [index for index, there in zip(todo, present) if not there]
    together: Callable[[int], int] | None = None  # groups whose chunks one put call can take
    if batch.captured is None:
        together = layout.row_group  # in place: groups sharing arrays
    elif batch.one_array:
        anyone = next(iter(batch.captured))
        together = lambda group: anyone  # noqa: E731 (every group's copies are in one array)

    def put(members: list[int]) -> None:
        statuses = per_group(
            items, members, lambda group, some: _put(batch, backend, layout, group, some, stats), together
        )
        for index, status in zip(members, statuses):
            results[index] = status

    pauses = iter(full_retry_s)  # one budget for the whole call: a backlog never waits once per part
    for offset in range(0, len(todo), batch_chunks):
        part = todo[offset : offset + batch_chunks]
        put(part)
        while full := [index for index in part if results[index] is Status.FULL]:
            pause = next(pauses, None)
            if pause is None:
                break
            stats.full_retries += 1
            time.sleep(pause)
            put(full)
        if any(results[index] not in (Status.OK, Status.FULL, Status.DECLINED) for index in part):
            # a failed call (not a full pool): the items after it are left untried, failed
            for index in todo[offset + batch_chunks :]:
                results[index] = Status.ERROR
            break
        # a part still refused as full: the later parts are tried once each (newer chunks; the pool evicts)
    stats.chunks_put_failed += sum(status not in (Status.OK, Status.DECLINED) for status in results)
    return results


def _put(
    batch: SaveBatch, backend: Backend, layout: KVLayout, group: int, members: list[int], stats: WorkerStats
) -> list[Status]:
    items = batch.items
    keys = [items[index].key for index in members]
    if batch.captured is None:
        rows = layout.save_rows(group, [items[index].block_id for index in members])
    else:
        captured = batch.captured[group]
        rows = Rows(captured.arrays, np.asarray([batch.rows[index] for index in members], dtype=np.int64))
    # a pool that keeps links (`KeepsLinks`: a disk tier, whose files a restart announces as chains);
    # not `isinstance` of the protocol, which costs ~12 µs a call here
    put_linked = getattr(backend, "put_linked", None)
    if put_linked is not None:
        statuses = put_linked(keys, rows, [items[index].parent for index in members])
    else:
        statuses = backend.put(keys, rows)
    stats.put_calls += 1
    ok = statuses.count(Status.OK)
    stats.chunks_put += ok
    stats.bytes_put += ok * layout.chunk_nbytes(group)
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
