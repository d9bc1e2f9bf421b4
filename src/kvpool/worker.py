"""Worker side: save queue with an incremental high-water mark, pressure gate, retries, loads.

Block safety: a save never reads a block after the engine may reuse it. Every queued or running
save registers the blocks it will read; before the engine writes blocks (each step's forward and
loads), `fence(blocks)` waits until no pending save reads any of them, cancelling saves that have
not started if they outlast `fence_timeout_s`. The engine therefore never needs to hold blocks for
us, and preempted, aborted or finished requests are safe by construction.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.backends.base import Backend, Status
from kvpool.chunks import chunk_range
from kvpool.errors import LayoutError
from kvpool.keys import KeySpace, chunk_hashes
from kvpool.layout import NULL_BLOCK_ID, KVLayout
from kvpool.masks import MaskCoordinator
from kvpool.metadata import RequestDelta, StepMetadata

log = logging.getLogger("kvpool.worker")

Fence = Callable[[], None]  # blocks until the engine's writes to the saved blocks are done


@dataclass(frozen=True)
class GroupPlacement:
    """This rank's share of a group: its key namespace and which chunks it writes."""

    keys: KeySpace
    put_step: int = 1
    put_step_rank: int = 0


@dataclass
class WorkerConfig:
    put_batch_chunks: int = 64
    check_exists_before_put: bool = True
    fence_timeout_s: float = 5.0
    queue_limit: int = 4096
    # load in the caller's thread: right for an in-process pool, where a load is a memcpy and a loader
    # thread would only wait for the GIL while the engine loop spins; remote pools load on a thread
    sync_loads: bool = False


@dataclass
class WorkerStats:
    save_jobs: int = 0
    save_jobs_dropped: int = 0
    chunks_examined: int = 0
    chunks_already_present: int = 0
    chunks_put: int = 0
    chunks_put_failed: int = 0
    chunks_unreadable: int = 0  # null or freed blocks: nothing to save
    bytes_put: int = 0
    loads: int = 0
    chunks_loaded: int = 0
    chunks_load_failed: int = 0
    bytes_loaded: int = 0
    fence_waits: int = 0
    fence_wait_s: float = 0.0
    fence_cancelled_jobs: int = 0
    pressure_events: int = 0


@dataclass
class _Item:
    group: int
    block_id: int
    key: str


@dataclass
class _SaveJob:
    seq: int
    state: _RequestState
    start: int
    end: int
    items: list[_Item]
    fence: Fence | None
    blocks: Counter[int]
    started: bool = False
    cancelled: bool = False


@dataclass
class _RequestState:
    req_id: str
    num_prompt_tokens: int
    hashes: list[bytes] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)
    stored_mark: int = 0  # tokens this rank knows are stored (advances on full success only)
    planned_mark: int = 0  # tokens covered by queued jobs
    computed_before: int = 0
    jobs: list[_SaveJob] = field(default_factory=list)
    finished: bool = False
    dropped: bool = False
    gated_through_seq: int = -1  # queued jobs up to this seq are dropped (pool pressure)


class WorkerEngine:
    """One per engine worker (rank). Thread-safe; the sender and loader run on their own threads."""

    def __init__(
        self,
        backend: Backend,
        coordinator: MaskCoordinator,
        placements: Sequence[GroupPlacement],
        layout: KVLayout | None = None,
        config: WorkerConfig | None = None,
    ) -> None:
        if len(placements) != len(coordinator.kinds):
            raise LayoutError(f"{len(placements)} group placements for {len(coordinator.kinds)} groups")
        self.backend = backend
        self.coordinator = coordinator
        self.placements = list(placements)
        self.layout = layout
        self.config = config or WorkerConfig()
        self.stats = WorkerStats()
        self._lock = threading.Lock()
        self._reads_done = threading.Condition(self._lock)
        self._states: dict[str, _RequestState] = {}
        self._pending_reads: Counter[int] = Counter()
        self._queued: int = 0
        self._seq = 0
        self._pressure = False
        self._saving: set[str] = set()  # saves requested since the last preemption: report when done
        self._finished_saving: set[str] = set()
        self._finished_loading: set[str] = set()
        self._failed_loads: dict[str, set[int]] = {}
        self._save_queue: queue.Queue[_SaveJob | None] = queue.Queue()
        self._load_queue: queue.Queue[tuple[str, list[_Item]] | None] = queue.Queue()
        self._loads_pending = 0
        self._idle = threading.Condition(threading.Lock())
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, name="kvpool-sender", daemon=True)
        self._loader = threading.Thread(target=self._load_loop, name="kvpool-loader", daemon=True)
        self._sender.start()
        self._loader.start()

    def register_layout(self, layout: KVLayout) -> None:
        if layout.num_groups != len(self.placements):
            raise LayoutError(f"layout has {layout.num_groups} groups, the model {len(self.placements)}")
        self.layout = layout

    # ---- per-step entry points -------------------------------------------------------------

    def handle_step(self, step: StepMetadata) -> None:
        """Before the engine writes anything this step: drop preempted work, then fence."""
        self.preempt(step.preempted)
        self.fence(step.written_blocks)

    def apply(self, deltas: Iterable[RequestDelta]) -> None:
        """Record new hashes and blocks, and start the loads the step asks for."""
        for delta in deltas:
            state = self._update_state(delta)
            if delta.load is not None:
                self.load(state, delta.load.start_tokens, delta.load.hit_tokens)

    def save(self, deltas: Iterable[RequestDelta], fence: Fence | None = None) -> None:
        """Queue saves for every request whose saveable length grew (after the forward is launched)."""
        for delta in deltas:
            if delta.save_tokens > 0:
                self.save_request(delta.req_id, delta.save_tokens, delta.computed_before, fence)

    # ---- request state -----------------------------------------------------------------------

    def _update_state(self, delta: RequestDelta) -> _RequestState:
        with self._lock:
            state = self._states.get(delta.req_id)
            if state is None or state.dropped:
                state = _RequestState(
                    delta.req_id,
                    delta.num_prompt_tokens,
                    blocks=[[] for _ in self.placements],
                    stored_mark=delta.stored_tokens,
                    planned_mark=delta.stored_tokens,
                )
                self._states[delta.req_id] = state
            if delta.new_hashes:
                state.hashes.extend(delta.new_hashes)
            if delta.new_blocks is not None:
                if len(delta.new_blocks) != len(self.placements):
                    raise LayoutError(
                        f"request {delta.req_id!r}: {len(delta.new_blocks)} block lists "
                        f"for {len(self.placements)} groups"
                    )
                for table, new in zip(state.blocks, delta.new_blocks):
                    if delta.replace_blocks:
                        table.clear()
                    table.extend(new)
            state.computed_before = max(state.computed_before, delta.computed_before)
            return state

    def save_request(self, req_id: str, token_len: int, computed_before: int = 0, fence: Fence | None = None) -> None:
        with self._lock:
            # the scheduler holds the request's blocks until it hears this save is done: always report it
            self._saving.add(req_id)
            state = self._states.get(req_id)
            if state is None or state.dropped or state.finished:
                return
            state.computed_before = max(state.computed_before, computed_before)
            hashed = len(state.hashes) * self.coordinator.hash_block_size
            end = self.coordinator.align(min(token_len, hashed))
            if end <= state.planned_mark:
                return
            if self._queued >= self.config.queue_limit:
                self.stats.save_jobs_dropped += 1
                return  # the range stays unplanned and is retried by the next save
            items = self._plan(state, state.planned_mark, end)
            self._seq += 1
            job = _SaveJob(self._seq, state, state.planned_mark, end, items, fence, Counter(i.block_id for i in items))
            state.planned_mark = end
            state.jobs.append(job)
            self._pending_reads.update(job.blocks)
            self._queued += 1
            self.stats.save_jobs += 1
        self._save_queue.put(job)

    def _plan(self, state: _RequestState, start: int, end: int) -> list[_Item]:
        items: list[_Item] = []
        coord = self.coordinator
        for group, (kind, placement) in enumerate(zip(coord.kinds, self.placements)):
            hashes = chunk_hashes(state.hashes, coord.hash_block_size, kind.block_size)
            table = state.blocks[group]
            mask = coord.store_mask(group, end, start, state.num_prompt_tokens)
            first_live = kind.first_live_chunk(state.computed_before)
            chunks = chunk_range(
                end, len(hashes), start, mask, placement.put_step, placement.put_step_rank, kind.block_size
            )
            for chunk in chunks:
                block_id = table[chunk] if chunk < len(table) else NULL_BLOCK_ID
                if block_id == NULL_BLOCK_ID or chunk < first_live:
                    self.stats.chunks_unreadable += 1
                    continue
                items.append(_Item(group, block_id, placement.keys.key(hashes[chunk])))
        return items

    def preempt(self, req_ids: Iterable[str]) -> None:
        """Forget the requests: their queued saves are cancelled (the engine frees their blocks now)."""
        with self._lock:
            for req_id in req_ids:
                self._saving.discard(req_id)
                state = self._states.pop(req_id, None)
                if state is not None:
                    self._drop(state)

    def finish(self, req_ids: Iterable[str]) -> None:
        """The requests are done; their state goes once their queued saves end."""
        with self._lock:
            for req_id in req_ids:
                state = self._states.get(req_id)
                if state is None:
                    self._report_saved(req_id)
                    continue
                state.finished = True
                if not state.jobs:
                    self._retire(state)

    def _retire(self, state: _RequestState) -> None:
        if self._states.get(state.req_id) is state:
            del self._states[state.req_id]
            self._report_saved(state.req_id)
        state.dropped = True

    def _report_saved(self, req_id: str) -> None:
        if req_id in self._saving:
            self._saving.discard(req_id)
            self._finished_saving.add(req_id)

    def _drop(self, state: _RequestState) -> None:
        state.dropped = True
        for job in state.jobs:
            if not job.started:
                self._cancel(job)

    def _cancel(self, job: _SaveJob) -> None:
        if not job.cancelled:
            job.cancelled = True
            self._release_reads(job)

    def _release_reads(self, job: _SaveJob) -> None:
        self._pending_reads.subtract(job.blocks)
        for block_id in job.blocks:
            if self._pending_reads[block_id] <= 0:
                del self._pending_reads[block_id]
        job.blocks = Counter()
        self._reads_done.notify_all()

    def fence(self, block_ids: Iterable[int]) -> None:
        """Return once no pending save will read any of these blocks."""
        with self._lock:
            if not self._pending_reads:
                return
            wanted = [b for b in block_ids if b in self._pending_reads]
            if not wanted:
                return
            began = time.monotonic()
            deadline = began + self.config.fence_timeout_s
            self.stats.fence_waits += 1
            while any(b in self._pending_reads for b in wanted):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._cancel_unstarted_reading(set(wanted))
                    remaining = 0.05  # started reads finish on their own; keep waiting for them
                self._reads_done.wait(remaining)
            self.stats.fence_wait_s += time.monotonic() - began

    def _cancel_unstarted_reading(self, blocks: set[int]) -> None:
        for state in list(self._states.values()):
            for job in state.jobs:
                if not job.started and not job.cancelled and blocks.intersection(job.blocks):
                    self._cancel(job)
                    state.planned_mark = min(state.planned_mark, state.stored_mark)
                    self.stats.fence_cancelled_jobs += 1

    # ---- sender -------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            job = self._save_queue.get()
            if job is None:
                return
            try:
                self._run_save(job)
            except Exception:
                log.exception("save of request %s failed", job.state.req_id)
                with self._lock:
                    self._end_job(job, success=False)

    def _run_save(self, job: _SaveJob) -> None:
        state = job.state
        with self._lock:
            if job.cancelled or state.dropped or job.seq <= state.gated_through_seq:
                self.stats.save_jobs_dropped += 1
                self._end_job(job, success=False)
                return
            job.started = True
        if job.fence is not None and job.items:
            job.fence()
        items = job.items
        self.stats.chunks_examined += len(items)
        status = Status.OK
        if items and self.config.check_exists_before_put:
            present = self.backend.exists([item.key for item in items])
            self.stats.chunks_already_present += sum(present)
            items = [item for item, there in zip(items, present) if not there]
        batch = self.config.put_batch_chunks
        for offset in range(0, len(items), batch):
            status = self._put(items[offset : offset + batch])
            if status is not Status.OK:
                break
        with self._lock:
            if status is Status.FULL:
                self._enter_pressure(state)
            elif status is Status.OK and items and self._pressure:
                self._leave_pressure()
            self._end_job(job, success=status is Status.OK)

    def _put(self, items: list[_Item]) -> Status:
        layout = self.layout
        if layout is None:
            raise LayoutError("save before register_layout: the engine's KV memory is unknown")
        results = _per_group(
            items,
            lambda group, part: self.backend.put(
                [item.key for item in part], layout.save_rows(group, [item.block_id for item in part])
            ),
        )
        ok = results.count(Status.OK)
        self.stats.chunks_put += ok
        self.stats.bytes_put += sum(
            layout.chunk_nbytes(item.group) for item, r in zip(items, results) if r is Status.OK
        )
        self.stats.chunks_put_failed += len(results) - ok
        if ok == len(results):
            return Status.OK
        return Status.FULL if Status.FULL in results else Status.ERROR

    def _end_job(self, job: _SaveJob, *, success: bool) -> None:
        state = job.state
        self._release_reads(job)
        self._queued -= 1
        if job in state.jobs:
            state.jobs.remove(job)
        if not state.dropped:
            if success and state.stored_mark >= job.start:
                state.stored_mark = max(state.stored_mark, job.end)
            elif not success:
                # re-plan from what is really stored: the next save of the request retries the range
                state.planned_mark = state.stored_mark
        if state.finished and not state.jobs:
            self._retire(state)
        with self._idle:
            self._idle.notify_all()

    def _enter_pressure(self, state: _RequestState) -> None:
        self._pressure = True
        self.stats.pressure_events += 1
        state.gated_through_seq = self._seq
        state.planned_mark = state.stored_mark

    def _leave_pressure(self) -> None:
        self._pressure = False
        for state in self._states.values():
            state.gated_through_seq = -1

    @property
    def under_pressure(self) -> bool:
        return self._pressure

    # ---- loads --------------------------------------------------------------------------------

    def load(self, state: _RequestState, start_tokens: int, hit_tokens: int) -> None:
        coord = self.coordinator
        items: list[_Item] = []
        failed: list[int] = []
        masks = coord.load_masks(hit_tokens)
        for group, (kind, placement) in enumerate(zip(coord.kinds, self.placements)):
            hashes = chunk_hashes(state.hashes, coord.hash_block_size, kind.block_size)
            table = state.blocks[group]
            for chunk in chunk_range(
                hit_tokens,
                hit_tokens // kind.block_size,
                start_tokens,
                _tail(masks[group], start_tokens, kind.block_size),
                1,
                0,
                kind.block_size,
            ):
                block_id = table[chunk] if chunk < len(table) else NULL_BLOCK_ID
                if block_id == NULL_BLOCK_ID:
                    continue
                if chunk >= len(hashes):  # no hash, no key: only blocks this load was to fill fail
                    failed.append(block_id)
                    continue
                items.append(_Item(group, block_id, placement.keys.key(hashes[chunk])))
        with self._lock:
            if failed:
                self._failed_loads.setdefault(state.req_id, set()).update(failed)
            # loads write blocks: a later step that reuses them (abort) must wait like for a save
            self._pending_reads.update(item.block_id for item in items)
            self._loads_pending += 1
        self.stats.loads += 1
        if self.config.sync_loads:
            self._execute_load(state.req_id, items)
        else:
            self._load_queue.put((state.req_id, items))

    def _load_loop(self) -> None:
        while True:
            entry = self._load_queue.get()
            if entry is None:
                return
            self._execute_load(*entry)

    def _execute_load(self, req_id: str, items: list[_Item]) -> None:
        failed: set[int] = {item.block_id for item in items}
        try:
            failed = self._run_load(items)
        except Exception:
            log.exception("load of request %s failed; its blocks will be recomputed", req_id)
        finally:
            with self._lock:
                if failed:
                    self._failed_loads.setdefault(req_id, set()).update(failed)
                self._finished_loading.add(req_id)
                self._pending_reads.subtract(item.block_id for item in items)
                self._pending_reads = +self._pending_reads
                self._loads_pending -= 1
                self._reads_done.notify_all()
            with self._idle:
                self._idle.notify_all()

    def _run_load(self, items: list[_Item]) -> set[int]:
        layout = self.layout
        if layout is None:
            raise LayoutError("load before register_layout: the engine's KV memory is unknown")
        failed: set[int] = set()
        batch = self.config.put_batch_chunks
        for offset in range(0, len(items), batch):
            part = items[offset : offset + batch]
            if not self.backend.healthy():
                failed.update(item.block_id for item in items[offset:])
                break
            try:
                results = self._get_part(layout, part)
            except Exception:
                # this batch and the ones not tried are unloaded; earlier batches did load
                log.exception("get of %d chunks failed; their blocks will be recomputed", len(part))
                failed.update(item.block_id for item in items[offset:])
                break
            corrupt: list[str] = []
            for item, result in zip(part, results):
                if result is Status.OK:
                    self.stats.chunks_loaded += 1
                    self.stats.bytes_loaded += layout.chunk_nbytes(item.group)
                else:
                    failed.add(item.block_id)
                    if result is Status.SIZE_MISMATCH:
                        corrupt.append(item.key)
            if corrupt:
                # a chunk of the wrong size can never load: drop it so lookups stop offering it
                log.warning("removing %d pool chunks whose size does not match this engine's blocks", len(corrupt))
                self.backend.remove(corrupt)
        self.stats.chunks_load_failed += len(failed)
        return failed

    def _get_part(self, layout: KVLayout, part: list[_Item]) -> list[Status]:
        """Read one batch into its blocks, one backend call per KV cache group."""

        def read(group: int, items: list[_Item]) -> list[Status]:
            block_ids = [item.block_id for item in items]
            rows = layout.load_rows(group, block_ids)
            statuses = self.backend.get_into([item.key for item in items], rows)
            layout.commit_rows(group, block_ids, rows, [status is Status.OK for status in statuses])
            return statuses

        return _per_group(part, read)

    # ---- results for the engine ---------------------------------------------------------------

    def take_finished(self) -> tuple[set[str], set[str]]:
        """(finished saving, finished loading) since the last call."""
        with self._lock:
            saving, self._finished_saving = self._finished_saving, set()
            loading, self._finished_loading = self._finished_loading, set()
        return saving, loading

    def take_failed_blocks(self) -> set[int]:
        return set().union(*self.take_failed_loads().values())

    def take_failed_loads(self) -> dict[str, set[int]]:
        """Blocks that could not be loaded, per request, since the last call."""
        with self._lock:
            failed, self._failed_loads = self._failed_loads, {}
        return failed

    def active_requests(self) -> int:
        with self._lock:
            return len(self._states)

    def stored_tokens(self, req_id: str) -> int:
        with self._lock:
            state = self._states.get(req_id)
            return state.stored_mark if state else 0

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued save and load has run; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._queued or self._loads_pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(min(remaining, 0.05))
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._save_queue.put(None)
        self._load_queue.put(None)
        self._sender.join(timeout_s)
        self._loader.join(timeout_s)


def _tail(mask: Any, start_tokens: int, block_size: int) -> Any:
    if mask is None:
        return None
    return mask[-(-start_tokens // block_size) :]


def _per_group(items: list[_Item], call: Callable[[int, list[_Item]], list[Status]]) -> list[Status]:
    """`call` once per KV cache group with that group's items, in order; the statuses in item order."""
    first = items[0].group if items else 0
    if all(item.group == first for item in items):
        return call(first, items)  # one group: the common case
    positions: dict[int, list[int]] = {}
    for position, item in enumerate(items):
        positions.setdefault(item.group, []).append(position)
    results = [Status.ERROR] * len(items)
    for group, members in positions.items():
        for position, status in zip(members, call(group, [items[p] for p in members])):
            results[position] = status
    return results
