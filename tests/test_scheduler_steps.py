"""SchedulerSteps: the scheduler role's policy in the exact order vLLM 0.32 calls it.

The orders under test are vLLM's (its scheduler's `schedule()` and `reset_prefix_cache`): a waiting
request is looked up (`get_num_new_matched_tokens`), then allocated (`update_state_after_alloc`),
both before the step's metadata is built (`build_connector_meta`); a reset with
`reset_running_requests=True` preempts between steps, so the next `schedule()` both lists a request
preempted and re-admits it, with its load armed before the step is built.
"""

from __future__ import annotations

from kvpool.core.metadata import StepMetadata
from kvpool.scheduler.scheduler_core import SchedulerConfig
from kvpool.scheduler.steps import SchedulerSteps
from test_scheduler import Pool, full_scheduler, hashes_for

TABLE = ([11, 12, 13, 14, 15, 16, 17, 18, 19],)


def stored_prefix(config: SchedulerConfig | None = None) -> tuple[SchedulerSteps, list[bytes]]:
    pool = Pool()
    core = full_scheduler(pool, config)
    hashes = hashes_for("p", 9)
    pool.store(core.namespaces[0], hashes, range(8))
    return SchedulerSteps(core), hashes


def run(
    steps: SchedulerSteps, req: str, hashes: list[bytes], table: tuple[list[int], ...], computed_before: int = 128
) -> StepMetadata:
    """The request's first scheduled step after its load: its whole table, computing the rest of 144."""
    step = steps.begin([], lambda _: None)
    steps.add(
        step,
        req,
        num_prompt_tokens=144,
        block_hashes=hashes,
        new_blocks=table,
        whole_table=True,
        computed_before=computed_before,
        new_tokens=144 - computed_before,
    )
    return step


def running_after_its_load() -> tuple[SchedulerSteps, list[bytes]]:
    """Request "r" loaded its 128-token hit into TABLE and runs: the state a reset finds it in."""
    steps, hashes = stored_prefix()
    steps.matched("r", hashes, 144, 0)
    steps.allocated("r", 144, hashes, 128)
    steps.begin([], {"r": TABLE}.get)
    steps.absorb(set(), set(), ["r"])
    run(steps, "r", hashes, TABLE)
    return steps, hashes


def test_every_hit_is_answered_as_a_load_the_engine_waits_for() -> None:
    steps, hashes = stored_prefix()
    assert steps.matched("r", hashes, 144, 0) == (128, True)
    assert steps.matched("other", hashes, 144, 128) == (0, False)  # the engine's own cache has it all


def test_a_load_reaches_the_workers_in_the_step_after_its_allocation() -> None:
    steps, hashes = stored_prefix()
    steps.matched("r", hashes, 144, 32)
    steps.allocated("r", 144, hashes, 96)
    step = steps.begin([], {"r": TABLE}.get)
    (delta,) = step.requests
    assert delta.load is not None and (delta.load.start_tokens, delta.load.hit_tokens) == (32, 128)
    assert delta.replace_blocks and delta.new_blocks == TABLE
    assert steps.finished("r")  # still loading: vLLM keeps the blocks until the load is reported


def test_a_reset_that_preempts_and_readmits_in_one_pass_keeps_the_load() -> None:
    """`reset_prefix_cache(reset_running_requests=True)`: the running request is preempted between steps;
    the next schedule() looks it up, allocates its load, then builds a step listing it preempted. The
    workers drop the old state first (preempted), then get the new state's first delta with its load."""
    steps, hashes = running_after_its_load()
    # the reset preempts "r"; the next schedule() re-admits it before building the step
    assert steps.matched("r", hashes, 144, 0) == (128, True)
    new_table = ([21, 22, 23, 24, 25, 26, 27, 28, 29],)
    steps.allocated("r", 144, hashes, 128)
    step = steps.begin(["r"], {"r": new_table}.get)
    assert step.preempted == ["r"]
    (delta,) = step.requests
    assert delta.load is not None and delta.load.hit_tokens == 128, "the re-admission's load was lost"
    assert delta.new_blocks == new_table and delta.num_prompt_tokens == 144
    assert steps.finished("r"), "its blocks are written by a load: vLLM must hold them"


def test_a_readmitted_request_that_does_not_fit_is_preempted_once() -> None:
    steps, hashes = running_after_its_load()
    steps.matched("r", hashes, 144, 0)  # re-admitted by the reset, but no blocks were free
    step = steps.begin(["r"], lambda _: None)
    assert step.preempted == ["r"] and step.requests == []
    assert steps.core.stats.preemptions == 1


def test_a_load_without_a_block_table_is_reported_failed_not_dropped() -> None:
    """Never silently: vLLM waits for every async load it allocated; an unarmed one would be a hang."""
    steps, hashes = stored_prefix()
    steps.matched("r", hashes, 144, 0)
    steps.allocated("r", 144, hashes, 128)
    step = steps.begin([], lambda _: None)
    assert step.failed_loads == ["r"] and step.requests == []
    steps.absorb(set(), {"r"}, ["r"])  # the workers report it finished and failed
    assert steps.matched("r", hashes, 144, 0) == (0, False)  # recomputed, never offered that hit again


def test_a_request_aborted_before_its_load_was_armed_gets_its_blocks_back() -> None:
    steps, hashes = stored_prefix()
    steps.matched("r", hashes, 144, 0)
    steps.allocated("r", 144, hashes, 128)
    assert steps.finished("r")  # vLLM keeps the blocks until the load is reported...
    step = steps.begin([], {"r": TABLE}.get)
    assert step.failed_loads == ["r"] and step.requests == []  # ...which every worker now does


def test_a_failed_load_is_recomputed_and_saved_again_from_its_start() -> None:
    steps, hashes = stored_prefix()
    steps.matched("r", hashes, 144, 0)
    steps.allocated("r", 144, hashes, 128)
    steps.begin([], {"r": TABLE}.get)
    steps.absorb({13}, set(), ["r"])  # chunk 2 did not load
    (delta,) = run(steps, "r", hashes, TABLE, computed_before=32).requests
    assert delta.save_tokens == 144 and delta.load is None


def test_an_eagle_drafter_drops_the_last_block_of_a_pool_hit() -> None:
    """vLLM drops a local hit's last block for EAGLE / MTP (the drafter's KV there depends on the next
    token, which no key names): a pool hit must end one boundary earlier too."""
    steps, hashes = stored_prefix(SchedulerConfig(drop_last_hit_block=True))
    assert steps.matched("r", hashes, 144, 0) == (112, True)
    assert steps.matched("s", hashes[:1], 17, 0) == (0, False)


def test_the_steps_a_request_waits_are_counted() -> None:
    """The per-request breakdown on /metrics: a load reported in the output of the step it was armed in
    costs the request one step (vLLM schedules it in the next); a lookup answered later, a step each."""
    steps, hashes = stored_prefix()
    steps.matched("r", hashes, 144, 0)
    steps.allocated("r", 144, hashes, 128)
    steps.begin([], {"r": TABLE}.get)
    steps.absorb(set(), set(), [])  # not yet
    steps.begin([], lambda _: None)
    steps.absorb(set(), set(), ["r"])
    stats = steps.core.stats
    assert (stats.loads_finished, stats.load_wait_steps, stats.lookup_waits) == (1, 2, 0)
