"""Scheduler side: lookups of the longest stored prefix, request trackers, per-step deltas."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from kvpool.core.config import DEFAULT_LOOKUP_TIMEOUT_S
from kvpool.core.errors import LayoutError
from kvpool.core.keys import KeySpace, chunk_hashes
from kvpool.core.masks import FullAttention, MaskCoordinator, StateSpace
from kvpool.core.metadata import LoadSpec, RequestDelta
from kvpool.scheduler.index import PoolIndex

log = logging.getLogger("kvpool.scheduler")

Exists = Callable[[list[str]], list[bool]]
Healthy = Callable[[], bool]

QUIET_ALWAYS = 1 << 62  # above any token count
# DEFAULT_LOOKUP_WAIT_MS: an async lookup is waited for this long in the call that starts it: a healthy pool
# answers within it, so the request is admitted in that very scheduler step (vLLM's own Mooncake connector
# looks up in the call)


@dataclass
class SchedulerConfig:
    save_decode: bool = False  # also store KV of generated tokens
    lookup_async: bool = False  # answer "ask again" while a lookup runs on a thread
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S  # an async lookup older than this counts as a miss
    lookup_cache_s: float = 2.0  # how long a lookup result is reused for the same request
    lookup_wait_s: float = 0.0  # async: how long the call that starts a lookup waits for its answer
    # EAGLE / MTP drafters: the drafter's KV at a hit's last position depends on the next token, which no
    # key names, so a hit ends one aligned boundary earlier (vLLM drops a local hit's last block alike)
    drop_last_hit_block: bool = False
    # the hit contract (every rank holds what the index lists until its withdrawal is acknowledged): hits
    # load in-step up to this many bytes a step per rank; 0: every load is async
    in_step_bytes: int = 0
    in_step_bytes_per_token: float = 0.0  # one rank's KV bytes a token, all groups (for the budget)


# the kinds of hit a request's steps to first token are counted under (`SchedulerStats.first_token_steps_*`)
FIRST_TOKEN_KINDS = {
    "in_step": "a pool hit loaded in-step",
    "async": "a pool hit the engine waited a step for",
    "local": "the engine's own prefix-cache hit",
    "miss": "no hit",
}


@dataclass
class SchedulerStats:
    lookups: int = 0
    lookup_keys: int = 0
    lookup_hit_tokens: int = 0
    lookup_failures: int = 0
    lookups_skipped: int = 0  # answered "miss" at once: the pool reported itself unhealthy
    loads: int = 0
    load_tokens: int = 0
    loads_in_step: int = 0  # of `loads`: contract hits, loaded in the step that schedules them
    preemptions: int = 0
    # where a request's time goes, in engine steps (per request: divide by lookups, loads_finished)
    lookup_waits: int = 0  # "ask again" answers: a step a request waited for its lookup
    loads_finished: int = 0
    load_wait_steps: int = 0  # steps from a load's allocation to the output that reported it finished
    # boundary states the engine handed over (vLLM `boundary_state_offloads`): taken to save, and dropped
    states_offered: int = 0
    states_taken: int = 0
    states_partial: int = 0  # sub-block boundaries (vLLM's partial hash hits): not a chunk, never stored
    states_dropped: int = 0  # not a reachable boundary, past the save limit, null, or no live request
    weight_changes: int = 0  # in-place weight changes: each renamed every key space
    # engine steps from a request's admission (the schedule() that gave it blocks) to the step that samples
    # its first token, inclusive, summed per kind of hit, and the requests counted (`kvpool.scheduler.steps`):
    # steps do not drift with the machine as milliseconds do
    first_token_steps_in_step: int = 0  # a contract hit, loaded in-step
    first_token_steps_async: int = 0  # a pool hit the engine waited a step for
    first_token_steps_local: int = 0  # the engine's own prefix-cache hit, nothing from the pool
    first_token_steps_miss: int = 0  # nothing cached anywhere
    first_tokens_in_step: int = 0
    first_tokens_async: int = 0
    first_tokens_local: int = 0
    first_tokens_miss: int = 0


@dataclass
class _Lookup:
    num_hashes: int
    at: float
    hit: int = 0
    future: Future[int] | None = None


@dataclass
class _Tracker:
    req_id: str
    num_prompt_tokens: int
    stored_tokens: int
    sent_hashes: int = 0
    saved_tokens: int = 0
    save_limit: int = 1 << 62  # saves never go past this (the aligned prompt unless decode KV is saved)
    started: bool = False
    load: LoadSpec | None = None
    # `quiet` is `computed_tokens < quiet_below`: kept by `_settle` after every change of the fields above
    quiet_below: int = -QUIET_ALWAYS


def _settle(tracker: _Tracker, lcm: int) -> None:
    """Quiet (no delta needed) while started, no load armed, and saved up to the limit or below the next
    aligned boundary: one threshold, so the per-step check of a running request is a single compare."""
    if not tracker.started or tracker.load is not None:
        tracker.quiet_below = -QUIET_ALWAYS
    elif tracker.saved_tokens >= tracker.save_limit:
        tracker.quiet_below = QUIET_ALWAYS
    else:
        tracker.quiet_below = tracker.saved_tokens + lcm


class SchedulerCore:
    """Engine-neutral scheduler half. `namespaces[g]` lists the key spaces a chunk of group g must be
    present in (one per TP shard / PP rank) to count as a hit."""

    def __init__(
        self,
        coordinator: MaskCoordinator,
        namespaces: Sequence[Sequence[KeySpace]],
        exists: Exists,
        config: SchedulerConfig | None = None,
        healthy: Healthy | None = None,
        index: PoolIndex | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.namespaces = [list(spaces) for spaces in namespaces]
        if len(self.namespaces) != len(coordinator.kinds) or not all(self.namespaces):
            # a group without key spaces would count every chunk as present: refuse it at start-up
            raise LayoutError(
                f"lookup namespaces: {[len(spaces) for spaces in self.namespaces]} key spaces per group "
                f"for {len(coordinator.kinds)} groups; expected at least one key space for every group"
            )
        self.exists = exists
        self.healthy = healthy  # cheap, no I/O: False while a remote pool's breaker is open
        self.index = index  # embedded pools: what they hold, known here; lookups never leave the thread
        self.config = config or SchedulerConfig()
        self.stats = SchedulerStats()
        self._lookups: dict[str, _Lookup] = {}
        self._trackers: dict[str, _Tracker] = {}
        self._load_failed: set[str] = set()  # never offer these requests a pool hit again
        self.reset_epoch = 0  # pool resets so far
        self.clear_epoch = 0  # the last of them that emptied the pool (a weights change may not)
        self.weights_tag = ""  # the weights loaded since start-up ("": the ones it started with)
        self._lcm = coordinator.lcm
        self._executor: ThreadPoolExecutor | None = None

    # ---- lookup -------------------------------------------------------------------------------

    def lookup(self, req_id: str, block_hashes: Sequence[bytes], num_tokens: int) -> int | None:
        """Longest pool hit in tokens, strictly below `num_tokens` (at least one token is recomputed).
        None: not known yet, ask again (async mode)."""
        if req_id in self._load_failed:
            return 0
        if self.healthy is not None and not self.healthy():
            # no wait, no thread hop, and no queue behind a call stuck in the pool's client
            self.stats.lookups_skipped += 1
            self._lookups.pop(req_id, None)
            return 0
        now = time.monotonic()
        cached = self._lookups.get(req_id)
        if cached is not None and cached.num_hashes == len(block_hashes):
            if cached.future is None:
                if now - cached.at <= self.config.lookup_cache_s:
                    return cached.hit
            elif cached.future.done():
                cached.hit = self._result(cached.future)
                cached.future = None
                cached.at = now
                return cached.hit
            elif now - cached.at > self.config.lookup_timeout_s:
                self.stats.lookup_failures += 1
                cached.future, cached.hit, cached.at = None, 0, now
                return 0
            else:
                return None
        hashes = list(block_hashes)
        if self.config.lookup_async:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvpool-lookup")
            entry = _Lookup(len(hashes), now, future=self._executor.submit(self.longest_hit, hashes, num_tokens))
            self._lookups[req_id] = entry
            assert entry.future is not None
            if self.config.lookup_wait_s > 0:
                wait([entry.future], timeout=self.config.lookup_wait_s)
            if not entry.future.done():
                return None  # ask again: later calls poll it, up to lookup_timeout_s
            entry.hit, entry.future = self._result(entry.future), None
            return entry.hit
        hit = self._safe_hit(hashes, num_tokens)
        self._lookups[req_id] = _Lookup(len(hashes), now, hit)
        return hit

    def _result(self, future: Future[int]) -> int:
        try:
            return future.result()
        except Exception:
            self.stats.lookup_failures += 1
            log.exception("lookup failed; treating it as a miss")
            return 0

    def _safe_hit(self, hashes: Sequence[bytes], num_tokens: int) -> int:
        try:
            return self.longest_hit(hashes, num_tokens)
        except Exception:
            self.stats.lookup_failures += 1
            log.exception("lookup failed; treating it as a miss")
            return 0

    def longest_hit(self, block_hashes: Sequence[bytes], num_tokens: int) -> int:
        hit = self._longest_hit(block_hashes, num_tokens)
        if self.config.drop_last_hit_block and hit > 0:
            # one whole LCM step: at least the last block of every group, as vLLM drops for a local hit
            hit = self.coordinator.align(hit - 1)
        return hit

    def _longest_hit(self, block_hashes: Sequence[bytes], num_tokens: int) -> int:
        coord = self.coordinator
        max_tokens = min(num_tokens - 1, len(block_hashes) * coord.hash_block_size)
        aligned = coord.align(max_tokens)
        if aligned <= 0:
            return 0
        if self.index is not None and all(type(kind) is FullAttention for kind in coord.kinds):
            return self._leading_hit(block_hashes, aligned)
        groups: list[list[int]] = []  # per group: the chunk ids worth asking about
        picked: list[list[bytes]] = []
        for kind, mask in zip(coord.kinds, coord.lookup_masks(aligned)):
            hashes = chunk_hashes(block_hashes, coord.hash_block_size, kind.block_size)
            count = aligned // kind.block_size
            chunks = list(range(count)) if mask is None else [c for c in range(count) if mask[c]]
            groups.append(chunks)
            picked.append([hashes[c] for c in chunks])
        found = self._presence(picked)
        self.stats.lookups += 1
        present: list[Callable[[int], bool]] = [
            {chunk for chunk, there in zip(chunks, flags) if there}.__contains__ for chunks, flags in zip(groups, found)
        ]
        hit = coord.longest_hit(max_tokens, present)
        self.stats.lookup_hit_tokens += hit
        return hit

    def _leading_hit(self, block_hashes: Sequence[bytes], aligned: int) -> int:
        """Full attention only: the hit is the run of present chunks from the first, the same in every group."""
        assert self.index is not None
        coord = self.coordinator
        hit = aligned
        for group, kind in enumerate(coord.kinds):
            hashes = chunk_hashes(block_hashes, coord.hash_block_size, kind.block_size)
            count = hit // kind.block_size
            run = min(count, self.index.leading(group, hashes))
            hit = coord.align(run * kind.block_size)
        self.stats.lookups += 1
        self.stats.lookup_keys += aligned // coord.lcm
        self.stats.lookup_hit_tokens += hit
        return hit

    def _presence(self, picked: list[list[bytes]]) -> list[list[bool]]:
        if self.index is not None:
            self.stats.lookup_keys += sum(map(len, picked))
        else:
            self.stats.lookup_keys += sum(len(hashes) * len(spaces) for hashes, spaces in zip(picked, self.namespaces))
        return self.presence(picked)

    def presence(self, picked: Sequence[Sequence[bytes]]) -> list[list[bool]]:
        """Per group, whether each of its chunks (by chunk hash) is present in every namespace the group
        needs: the embedded pools' index, or one `exists` call."""
        if self.index is not None:
            return [self.index.present(group, hashes) for group, hashes in enumerate(picked)]
        keys: list[str] = []
        for hashes, spaces in zip(picked, self.namespaces):
            for space in spaces:
                keys.extend(space.keys(hashes))
        found = self.exists(keys) if keys else []
        result: list[list[bool]] = []
        first = 0
        for hashes, spaces in zip(picked, self.namespaces):
            n = len(hashes)
            result.append([all(found[first + s * n + i] for s in range(len(spaces))) for i in range(n)])
            first += n * len(spaces)
        return result

    # ---- request lifecycle --------------------------------------------------------------------

    def on_allocated(
        self, req_id: str, num_prompt_tokens: int, local_tokens: int, external_tokens: int, in_step: bool = False
    ) -> None:
        """The engine allocated blocks; `external_tokens` > 0 arms a load of [local, local + external)
        (`in_step`: loaded before the forward of the step that computes on it)."""
        tracker = self._tracker(req_id, num_prompt_tokens)
        if external_tokens > 0:
            tracker.load = LoadSpec(local_tokens, local_tokens + external_tokens, in_step)
            _settle(tracker, self._lcm)
            self.stats.loads += 1
            self.stats.loads_in_step += in_step
            self.stats.load_tokens += external_tokens

    def _tracker(self, req_id: str, num_prompt_tokens: int) -> _Tracker:
        tracker = self._trackers.get(req_id)
        if tracker is None:
            cached = self._lookups.get(req_id)
            stored = cached.hit if cached is not None and cached.future is None else 0
            tracker = self._trackers[req_id] = _Tracker(req_id, num_prompt_tokens, stored)
            if not self.config.save_decode:
                tracker.save_limit = self.coordinator.align(num_prompt_tokens)
            _settle(tracker, self._lcm)
        return tracker

    def request_delta(
        self,
        req_id: str,
        *,
        num_prompt_tokens: int,
        block_hashes: Sequence[bytes],
        computed_before: int,
        new_tokens: int,
        new_blocks: Sequence[Sequence[int]] | None = None,
        whole_table: bool = False,
    ) -> RequestDelta | None:
        """What the workers need to learn about this request this step (None: nothing).

        `new_blocks`, per group, are the block ids the engine appended to the request's table since it
        last ran (vLLM's `new_block_ids`), or its whole table when `whole_table` (its first step, and a
        resume after preemption). The cost is O(what changed): no table is read in full on a step that
        does not replace it."""
        coord = self.coordinator
        tracker = self._tracker(req_id, num_prompt_tokens)
        delta = RequestDelta(req_id, computed_before=computed_before)
        if not tracker.started:
            if not whole_table:
                raise ValueError(
                    f"request {req_id!r}: its first step passed appended block ids; expected its whole block "
                    "table (whole_table=True), since the workers hold no table for it yet"
                )
            tracker.started = True
            delta.num_prompt_tokens = num_prompt_tokens
            delta.stored_tokens = tracker.stored_tokens
            tracker.saved_tokens = tracker.stored_tokens
        if whole_table:
            delta.new_blocks = tuple(list(table) for table in new_blocks or [[] for _ in coord.kinds])
            delta.replace_blocks = True
        elif new_blocks is not None and any(new_blocks):
            delta.new_blocks = tuple(list(table) for table in new_blocks)
        saveable = computed_before + new_tokens
        if not self.config.save_decode:
            saveable = min(saveable, num_prompt_tokens)
        saveable = coord.align(min(saveable, len(block_hashes) * coord.hash_block_size))
        if saveable > tracker.saved_tokens:
            delta.save_tokens = tracker.saved_tokens = saveable
        if tracker.load is not None:
            delta.load, tracker.load = tracker.load, None
        needed = max(delta.save_tokens, delta.load.hit_tokens if delta.load else 0) // coord.hash_block_size
        if needed > tracker.sent_hashes:
            delta.new_hashes = list(block_hashes[tracker.sent_hashes : needed])
            tracker.sent_hashes = needed
        _settle(tracker, self._lcm)
        if delta.new_blocks is None and not delta.save_tokens and delta.load is None and not delta.num_prompt_tokens:
            return None
        return delta

    def boundary_states(
        self, req_id: str, offers: Sequence[tuple[int, int, int]], block_hashes: Sequence[bytes]
    ) -> RequestDelta | None:
        """The boundary states the engine hands over for a request this step, as `(group, block id,
        boundary tokens)`, each a block holding the state after exactly `boundary` tokens until the
        step ends: the delta that saves the ones worth storing (None: none is).

        A state is taken only when its boundary is a whole chunk of its group (a sub-block boundary of
        the engine's partial hash hits is no chunk: never stored), one a future hit can end at (an LCM
        multiple the retention policy keeps), within what the request saves (the aligned prompt unless
        decode KV is saved), its block is not the null block, and the workers hold the request. The
        workers copy each out in this step, so the engine need not keep the block any longer."""
        coord = self.coordinator
        self.stats.states_offered += len(offers)
        tracker = self._trackers.get(req_id)
        if tracker is None or not tracker.started:
            self.stats.states_dropped += len(offers)
            return None
        boundaries = coord.boundaries(tracker.num_prompt_tokens)
        hashed = len(block_hashes) * coord.hash_block_size
        taken: list[tuple[int, int, int]] = []
        for group, block_id, boundary in offers:
            kind = coord.kinds[group] if 0 <= group < len(coord.kinds) else None
            if kind is not None and boundary % kind.block_size:
                self.stats.states_partial += 1
                continue
            if (
                not isinstance(kind, StateSpace)
                or block_id == 0
                or boundary <= 0
                or boundary > min(tracker.save_limit, hashed)
                or not kind.stores(boundary // kind.block_size - 1, boundaries)
            ):
                self.stats.states_dropped += 1
                continue
            taken.append((group, boundary // kind.block_size - 1, block_id))
        if not taken:
            return None
        self.stats.states_taken += len(taken)
        delta = RequestDelta(req_id, states=taken)
        needed = max((chunk + 1) * coord.kinds[group].block_size for group, chunk, _ in taken)
        needed //= coord.hash_block_size
        if needed > tracker.sent_hashes:
            delta.new_hashes = list(block_hashes[tracker.sent_hashes : needed])
            tracker.sent_hashes = needed
        return delta

    def quiet(self, req_id: str, computed_tokens: int) -> bool:
        """True when `request_delta` would return None for a step that appends no blocks and leaves the
        request at most `computed_tokens` computed: the per-step check of a running request is one dict
        read and two comparisons (most decode steps neither complete a chunk nor allocate a block)."""
        tracker = self._trackers.get(req_id)
        return tracker is not None and computed_tokens < tracker.quiet_below

    def started(self, req_id: str) -> bool:
        """Whether the workers hold this request's table (its first delta has been built)."""
        tracker = self._trackers.get(req_id)
        return tracker is not None and tracker.started

    def armed_load(self, req_id: str) -> LoadSpec | None:
        """The load `on_allocated` armed for the request, until its step's delta takes it."""
        tracker = self._trackers.get(req_id)
        return tracker.load if tracker is not None else None

    def mark_load_failed(self, req_id: str) -> None:
        """A load for the request failed: it recomputes, and later lookups must not offer the same hit
        (the pool still lists the chunks, so the engine would load and fail forever). What failed is
        not in the pool: the request saves again from its start once recomputed (the worker knows
        which chunks did arrive, and skips them)."""
        self._load_failed.add(req_id)
        self._lookups.pop(req_id, None)
        tracker = self._trackers.get(req_id)
        if tracker is not None:
            tracker.saved_tokens = 0
            _settle(tracker, self._lcm)

    def finish(self, req_id: str) -> None:
        """The request ended: forget it."""
        self._load_failed.discard(req_id)
        self._lookups.pop(req_id, None)
        self._trackers.pop(req_id, None)

    def preempt(self, req_id: str) -> None:
        self.stats.preemptions += 1
        self.forget(req_id)

    def forget(self, req_id: str) -> None:
        """Drop the request's tracker and cached lookup: it starts over (a failed load is remembered)."""
        self._lookups.pop(req_id, None)
        self._trackers.pop(req_id, None)

    def reset(self, *, empties: bool = True) -> None:
        """The pool was emptied: no cached answer may be reused, and the workers must drop every save
        taken before (the next step's `reset_epoch` tells them) and empty their pools (`clear_epoch`;
        `empties=False`: a weights change, whose clearing each worker decides)."""
        self._lookups.clear()
        self.reset_epoch += 1
        if empties:
            self.clear_epoch = self.reset_epoch
        if self.index is not None:
            self.index.reset(self.reset_epoch)

    def change_weights(self, tag: str) -> None:
        """The engine's weights change in place (before its next step): every key space takes the new
        name, so nothing stored under the old weights is found, and the change is a reset for everything
        cached or in flight (the next step's `reset_epoch` and `weights_tag` tell the workers). A shared
        pool is not emptied: other engines' KV of the old weights stays theirs."""
        self.weights_tag = tag
        self.stats.weight_changes += 1
        for spaces in self.namespaces:
            for space in spaces:
                space.retag(tag)
        self.reset(empties=False)  # the index forgets (and announces) what it held under the old names first
        if self.index is not None:
            self.index.rename(self.namespaces)

    def active_requests(self) -> int:
        return len(self._trackers) + len(self._lookups) + len(self._load_failed)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
