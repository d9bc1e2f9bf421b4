"""What the scheduler side hands the workers each step: only what changed per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadSpec:
    """Load chunks for tokens [start_tokens, hit_tokens) into the request's blocks."""

    start_tokens: int
    hit_tokens: int
    # a hit the pool guarantees (the hit contract): loaded before this step's forward, which computes on
    # it; the engine does not wait for it, and it is never reported finished
    in_step: bool = False


@dataclass
class RequestDelta:
    req_id: str
    new_hashes: list[bytes] = field(default_factory=list)  # appended to the worker's copy
    new_blocks: tuple[list[int], ...] | None = None  # appended per group (replaces when replace_blocks)
    replace_blocks: bool = False  # resumed after preemption: the table starts over
    num_prompt_tokens: int = 0  # set on the first delta of a request
    stored_tokens: int = 0  # first delta: tokens already in the pool (the lookup hit)
    save_tokens: int = 0  # > 0: save up to this many tokens (a new high point)
    computed_before: int = 0  # tokens computed before this step (blocks below a window may be freed)
    load: LoadSpec | None = None
    # boundary states handed over this step, to save from exactly these blocks in this step only:
    # (group, chunk, block id); the chunk's key names the token prefix ending at the boundary
    states: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class StepMetadata:
    requests: list[RequestDelta] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    reset_epoch: int = 0  # pool resets so far: a worker that sees it grow drops every earlier save
    # names the weights loaded since the engine started ("": the ones it started with); it changes with a
    # reset epoch, and a worker that sees it change renames its key spaces before that step's loads
    weights_tag: str = ""
    # the last reset that empties the pool: a weights change merged into the same step (one epoch check)
    # must not skip a reset's clear, or a put running since before it lands under a name it no longer has
    clear_epoch: int = 0
    # the hit contract: rank -> the last of its pool reports the scheduler absorbed before building this
    # step (each rank frees what those reports withdrew; loads of this step and later were armed without it)
    pool_acks: dict[int, int] = field(default_factory=dict)
    # loads the engine waits for that the scheduler could not arm (no block table): every worker
    # reports them finished and failed, so the engine recomputes instead of waiting forever
    failed_loads: list[str] = field(default_factory=list)
