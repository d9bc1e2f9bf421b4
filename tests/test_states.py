"""State-space (Mamba) groups through vLLM's boundary-state hand-off, in the core: which `MambaSpec`
settings are served, which boundary states the scheduler takes, and how a worker saves exactly the blocks
handed over, in their step, under the key of the boundary's token prefix."""

from __future__ import annotations

import dataclasses

import pytest

from kvpool.backends.base import Status
from kvpool.core.config import KVPoolConfig
from kvpool.core.errors import LayoutError
from kvpool.core.fingerprints import GroupFacts
from kvpool.core.masks import FullAttention, MaskCoordinator, StateSpace
from kvpool.core.metadata import RequestDelta
from kvpool.core.plan import Parallelism, build_plan
from kvpool.core.specs import STATE_SETTINGS, SpecFacts, attention_kind
from kvpool.scheduler.scheduler_core import SchedulerConfig, SchedulerCore
from kvpool.scheduler.steps import SchedulerSteps
from kvpool.worker.worker_core import WorkerConfig, WorkerCore
from test_plan import FULL, engine
from test_scheduler import Pool, hashes_for, space
from worker_fakes import LAYERS, FakeModel, RecordingBackend, block_content

ALIGN = SpecFacts("MambaSpec", 64, state_cache_mode="align")
STATE = GroupFacts(ALIGN, dtype="torch.bfloat16,torch.float32", kv_quant_mode="MAMBA2:((3, 288), (4, 64, 16))")

# ---- specs: every MambaSpec setting served or refused by name -------------------------------------------


def test_an_align_mode_state_is_served_as_a_state_space_kind() -> None:
    assert attention_kind(ALIGN) == StateSpace(64)
    plan = build_plan(engine(FULL, STATE), KVPoolConfig())
    assert plan.coordinator.kinds == [FullAttention(64), StateSpace(64)]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"state_cache_mode": "none"}, "mamba_cache_mode='none'"),
        ({"state_cache_mode": "all"}, "mamba_cache_mode='all'"),
        ({"state_cache_mode": None}, "mamba_cache_mode=None"),
        ({"num_speculative_blocks": 2}, "num_speculative_blocks=2"),
        ({"tokens_per_state": 4}, "tokens_per_state=4"),
    ],
)
def test_a_state_setting_kvpool_cannot_serve_exactly_is_refused_by_name(change: dict, named: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(LayoutError, match="MambaSpec") as raised:
        attention_kind(dataclasses.replace(ALIGN, **change))
    assert named in str(raised.value)


def test_every_mamba_spec_setting_is_classified() -> None:
    """vLLM 0.32's MambaSpec fields that decide whether a state is exact; docs/correctness.md lists these."""
    named = " ".join(STATE_SETTINGS)
    for setting in (
        "mamba_type",
        "mamba_cache_mode",
        "num_speculative_blocks",
        "num_prefill_checkpoint_blocks",
        "prefill_checkpoint_alignment",
        "page_size_padded",
        "tokens_per_state",
    ):
        assert setting in named
    assert all(reason.startswith("served") for reason in STATE_SETTINGS.values())


def test_state_shards_that_differ_from_attention_replicas_are_refused() -> None:
    with pytest.raises(LayoutError, match="kv_tp_replicas=2 with a state-space"):
        build_plan(engine(FULL, STATE, parallel=Parallelism(tp_size=4, kv_tp_replicas=2)), KVPoolConfig())


def test_the_state_layout_is_in_its_key() -> None:
    a = build_plan(engine(FULL, STATE), KVPoolConfig())
    b = build_plan(engine(FULL, dataclasses.replace(STATE, kv_quant_mode="GDN:((3, 288),)")), KVPoolConfig())
    assert a.placements()[0].keys.prefix == b.placements()[0].keys.prefix
    assert a.placements()[1].keys.prefix != b.placements()[1].keys.prefix


# ---- the scheduler: which handed-over states it takes -------------------------------------------------------

B = 16


def hybrid_scheduler(pool: Pool, retention: int | None = None, **config: object) -> SchedulerCore:
    kinds = [FullAttention(B), StateSpace(2 * B)]  # LCM 32: every state block ends on a boundary
    coord = MaskCoordinator(kinds, retention_interval=retention)
    return SchedulerCore(
        coord,
        [[space(kinds[0], 0)], [space(kinds[1], 1)]],
        pool.exists,
        SchedulerConfig(**config),  # type: ignore[arg-type]
    )


def started(core: SchedulerCore, req: str, hashes: list[bytes], prompt: int) -> None:
    core.request_delta(
        req,
        num_prompt_tokens=prompt,
        block_hashes=hashes,
        computed_before=0,
        new_tokens=0,
        new_blocks=[[], []],
        whole_table=True,
    )


def test_only_whole_state_blocks_at_reachable_boundaries_within_the_prompt_are_taken() -> None:
    core = hybrid_scheduler(Pool())
    hashes = hashes_for("p", 12)  # 192 tokens known
    started(core, "r", hashes, 160)
    delta = core.boundary_states(
        "r",
        [
            (1, 7, 64),  # taken: chunk 1 of the state group
            (1, 8, 48),  # a sub-block boundary (vLLM's partial hash hits): no chunk, never stored
            (1, 0, 96),  # the null block
            (0, 9, 64),  # not a state group
            (1, 10, 192),  # past the aligned prompt (decode KV is not saved)
            (1, 11, 160),  # taken: the prompt's last whole boundary
        ],
        hashes,
    )
    assert delta is not None and delta.states == [(1, 1, 7), (1, 4, 11)]
    assert delta.new_hashes == hashes[:10]  # the workers can key the chunks: hashes up to the last boundary
    assert (core.stats.states_offered, core.stats.states_taken, core.stats.states_partial) == (6, 2, 1)
    assert core.stats.states_dropped == 3


def test_a_request_the_workers_do_not_hold_takes_no_state() -> None:
    core = hybrid_scheduler(Pool())
    hashes = hashes_for("p", 4)
    assert core.boundary_states("unknown", [(1, 7, 64)], hashes) is None
    started(core, "r", hashes, 64)
    core.finish("r")
    assert core.boundary_states("r", [(1, 7, 64)], hashes) is None


def test_retention_keeps_only_the_replay_boundary_state() -> None:
    core = hybrid_scheduler(Pool(), retention=0)
    hashes = hashes_for("p", 10)
    started(core, "r", hashes, 150)  # replay boundary: 149 // 32 * 32 = 128
    delta = core.boundary_states("r", [(1, 5, 64), (1, 6, 128)], hashes)
    assert delta is not None and delta.states == [(1, 3, 6)]


def test_decode_states_are_taken_when_decode_kv_is_saved() -> None:
    core = hybrid_scheduler(Pool(), save_decode=True)
    hashes = hashes_for("p", 12)
    started(core, "r", hashes, 100)
    delta = core.boundary_states("r", [(1, 10, 192)], hashes)
    assert delta is not None and delta.states == [(1, 5, 10)]


def test_the_states_ride_the_requests_delta_of_the_step() -> None:
    steps = SchedulerSteps(hybrid_scheduler(Pool()))
    hashes = hashes_for("p", 8)
    step = steps.begin([], lambda _: None)
    steps.add(
        step,
        "r",
        num_prompt_tokens=128,
        block_hashes=hashes,
        new_blocks=[[1, 2], [0, 3]],
        whole_table=True,
        computed_before=0,
        new_tokens=64,
    )
    steps.states(step, "r", [(1, 3, 64)], hashes)
    (delta,) = step.requests
    assert delta.save_tokens == 64 and delta.states == [(1, 1, 3)]
    assert delta.new_hashes == hashes[:4]
    # a request with no delta of its own this step gets one for its states
    step = steps.begin([], lambda _: None)
    steps.states(step, "r", [(1, 4, 128)], hashes)
    (delta,) = step.requests
    assert delta.states == [(1, 3, 4)] and delta.new_hashes == hashes[4:8] and not delta.save_tokens


def test_a_hit_needs_the_state_at_the_boundary_and_every_attention_chunk_below_it() -> None:
    pool = Pool()
    core = hybrid_scheduler(pool)
    hashes = hashes_for("p", 10)
    pool.store(core.namespaces[0], hashes, range(10))  # attention chunks up to 160 tokens
    full = MaskCoordinator([FullAttention(B), StateSpace(2 * B)])
    state_hashes = [hashes[i] for i in range(1, 10, 2)]  # state chunk c is named by hash 2c + 1
    pool.store(core.namespaces[1], state_hashes, [1])  # the state at 64 only
    assert full.lcm == 32
    assert core.lookup("r", hashes, 161) == 64


# ---- the worker: saves exactly the blocks handed over, in their step --------------------------------------


def state_model() -> FakeModel:
    return FakeModel([FullAttention(B), StateSpace(B)])


def test_a_handed_over_state_is_saved_from_its_block_under_its_boundary_key(closing: list[WorkerCore]) -> None:
    model = state_model()
    backend = RecordingBackend()
    worker = model.engine(backend, config=WorkerConfig(sync_saves=True))
    closing.append(worker)
    hashes = model.hashes("p", 64)
    # the state table as vLLM's align mode leaves it: nulls, and the running block (never read)
    worker.apply([RequestDelta("r", new_hashes=hashes, new_blocks=([1, 2, 3, 4], [0, 0, 0, 9]), num_prompt_tokens=64)])
    model.write(1, 9, "running")
    model.write(1, 20, "state@32")
    worker.save([RequestDelta("r", save_tokens=64, states=[(1, 1, 20)])])
    assert worker.drain(10)
    state_keys = [key for key in backend.put_keys if "/g1/" in key]
    assert state_keys == [model.key(1, hashes, 1)], "only the handed-over state, never a table block"
    assert backend.stored(state_keys[0], LAYERS * 8) == b"".join(
        block_content("state@32", layer).tobytes() for layer in range(LAYERS)
    )
    assert worker.stored_tokens("r") == 64


def test_a_failed_state_put_is_never_retried_and_moves_no_mark(closing: list[WorkerCore]) -> None:
    model = state_model()
    backend = RecordingBackend()
    worker = model.engine(backend, config=WorkerConfig(sync_saves=True))
    closing.append(worker)
    hashes = model.hashes("p", 64)
    worker.apply([RequestDelta("r", new_hashes=hashes, new_blocks=([1, 2, 3, 4], [0, 0, 0, 9]), num_prompt_tokens=64)])
    worker.save([RequestDelta("r", save_tokens=32)])
    backend.put_statuses = [Status.ERROR]
    worker.save([RequestDelta("r", states=[(1, 1, 20)])])
    assert worker.stored_tokens("r") == 32
    puts = len(backend.put_keys)
    worker.save([RequestDelta("r", save_tokens=64)])
    new = backend.put_keys[puts:]
    assert new == [model.key(0, hashes, 2), model.key(0, hashes, 3)], "the state's block is the engine's again"


def test_states_of_a_finished_request_are_dropped(closing: list[WorkerCore]) -> None:
    model = state_model()
    backend = RecordingBackend()
    worker = model.engine(backend, config=WorkerConfig(sync_saves=True))
    closing.append(worker)
    hashes = model.hashes("p", 32)
    worker.apply([RequestDelta("r", new_hashes=hashes, new_blocks=([1, 2], [0, 9]), num_prompt_tokens=32)])
    worker.finish({"r"})
    worker.save([RequestDelta("r", states=[(1, 1, 9)])])
    assert backend.put_keys == []


def test_explain_names_the_state_group_and_its_boundary() -> None:
    from kvpool.scheduler.explain import StopReason, explain

    pool = Pool()
    core = hybrid_scheduler(pool)
    hashes = hashes_for("p", 10)
    pool.store(core.namespaces[0], hashes, range(10))
    pool.store(core.namespaces[1], [hashes[i] for i in range(1, 10, 2)], [1])
    explanation = explain(core, hashes, 161)
    assert explanation.hit_tokens == 64 and explanation.reason is StopReason.MISSING_CHUNK
    assert "group 1 (state_space) chunk 2" in explanation.detail
    assert "the state at 96 tokens is not in the pool" in explanation.detail
