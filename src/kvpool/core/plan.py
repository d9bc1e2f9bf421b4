"""Where a rank's chunks go: key namespaces per TP shard and PP stage, and which rank writes what.

Both connector roles derive the same plan from the engine config (`build_plan`, from the plain
`EngineFacts` an adapter reads): the scheduler to know which namespaces a hit must be present in,
each worker to know its own namespace and the chunks it puts. Invariants: only the rank differs
between the plans of one engine's roles and ranks, so every rank's namespace is one the scheduler
looks up; a chunk of a shard is put into a shared pool by exactly one rank, which never changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpool.core.config import KVPoolConfig
from kvpool.core.errors import LayoutError
from kvpool.core.fingerprints import GroupFacts, ModelFacts, group_fingerprints
from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.core.masks import MaskCoordinator, StateSpace
from kvpool.core.specs import attention_kind


@dataclass(frozen=True)
class GroupPlacement:
    """This rank's share of a group: its key namespace and which chunks it writes."""

    keys: KeySpace
    put_step: int = 1
    put_step_rank: int = 0

# the hit contract needs a DRAM pool of at least this many engine steps of saves (`ModelPlan.holds_contract`)
CONTRACT_STEPS = 8


@dataclass
class ModelPlan:
    """`replicas` consecutive TP ranks hold identical bytes (one shard). Into a shared pool they stride
    their puts by the absolute chunk id, so each chunk of a shard is written once, by a rank that never
    changes; with a pool per rank (embedded) each rank stores its shard whole, since it loads from its own."""

    coordinator: MaskCoordinator
    fingerprints: list[LayoutFingerprint]  # per group, shard 0, PP stage 0
    tp_rank: int = 0
    tp_size: int = 1
    replicas: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    shared_pool: bool = True  # False: each rank has a pool of its own (embedded), which it must fill itself
    drop_last_hit_block: bool = False  # a pool hit ends one boundary earlier, as the engine's own hits do
    dp_rank: int = 0  # the data-parallel engine: each has its own disk tier directories
    bytes_per_token: float = 0.0  # one rank's KV bytes a token, every group (the in-step budget's unit)
    step_tokens: int = 0  # the most tokens an engine step computes (vLLM's max_num_batched_tokens; 0: unknown)

    def holds_contract(self, capacity_bytes: int) -> bool:
        """Whether a rank's DRAM pool is large enough for the hit contract: its reserve holds what saves
        evict between a report and its acknowledgement, up to two or three engine steps of saves, so
        a pool under `CONTRACT_STEPS` steps of the engine's largest saves would give the contract a
        large share of its capacity (behind `vllm serve`, a 56 MiB pool beside 16 MiB steps lost half
        its live capacity and its hits to it). Such a pool loads every hit async. Unknown sizes: yes."""
        step_bytes = self.step_tokens * self.bytes_per_token
        return step_bytes <= 0 or capacity_bytes >= CONTRACT_STEPS * step_bytes

    @property
    def shard(self) -> int:
        return self.tp_rank // self.replicas

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    def placements(self) -> list[GroupPlacement]:
        stride = self.replicas if self.shared_pool else 1
        position = self.tp_rank % stride
        return [
            GroupPlacement(
                KeySpace(replace(fp, tp_shard=self.shard, pp_rank=self.pp_rank)),
                put_step=stride,
                put_step_rank=(position + group) % stride,
            )
            for group, fp in enumerate(self.fingerprints)
        ]

    def lookup_namespaces(self) -> list[list[KeySpace]]:
        shards = max(1, self.tp_size // self.replicas)
        return [
            [KeySpace(replace(fp, tp_shard=s, pp_rank=p)) for s in range(shards) for p in range(self.pp_size)]
            for fp in self.fingerprints
        ]


@dataclass(frozen=True)
class Parallelism:
    """A rank's place in its engine's TP x PP grid, numbered as the engine numbers it."""

    rank: int = 0  # pp_rank * tp_size + tp_rank
    tp_size: int = 1
    pp_size: int = 1
    kv_tp_replicas: int = 1  # consecutive TP ranks holding identical KV, as the engine publishes it; < 1: 1
    dp_rank: int = 0  # which data-parallel engine: no key names it (DP ranks' KV is alike), its disk tier does


@dataclass(frozen=True)
class EngineFacts:
    """Everything a plan depends on, as plain values an adapter reads from its engine's config."""

    model: ModelFacts
    groups: tuple[GroupFacts, ...]
    parallel: Parallelism = Parallelism()
    hash_block_size: int | None = None  # the engine's block-hash granularity; None: the smallest block size
    retention_interval: int | None = None  # the engine's own; kvpool's "engine" setting takes it
    drop_last_hit_block: bool = False  # EAGLE / MTP drafting: the engine drops a prefix hit's last block


def build_plan(engine: EngineFacts, config: KVPoolConfig) -> ModelPlan:
    """This rank's plan. LayoutError / ConfigError at start-up for a spec or setting kvpool refuses."""
    kinds = [attention_kind(group.spec) for group in engine.groups]
    hash_block = engine.hash_block_size or min(kind.block_size for kind in kinds)
    retention = engine.retention_interval if config.retention_interval == "engine" else config.retention_interval
    assert retention is None or isinstance(retention, int)  # validated by KVPoolConfig
    coordinator = MaskCoordinator(kinds, retention_interval=retention, hash_block_size=hash_block)
    parallel = engine.parallel
    if parallel.kv_tp_replicas > 1 and any(isinstance(kind, StateSpace) for kind in kinds):
        raise LayoutError(
            f"kv_tp_replicas={parallel.kv_tp_replicas} with a state-space (Mamba) group is not supported by "
            "kvpool: TP ranks that hold identical attention KV hold different shards of a state, so one "
            "shard key cannot name both; run with tensor_parallel_size <= the number of KV heads, or "
            "without the connector"
        )
    fingerprints = group_fingerprints(engine.model, engine.groups, kinds, config, pp_size=parallel.pp_size)
    return ModelPlan(
        coordinator,
        fingerprints,
        tp_rank=parallel.rank % parallel.tp_size,
        tp_size=parallel.tp_size,
        replicas=max(1, parallel.kv_tp_replicas),
        pp_rank=parallel.rank // parallel.tp_size,
        pp_size=parallel.pp_size,
        shared_pool=config.backend != "memory",  # each embedded pool belongs to one rank
        drop_last_hit_block=engine.drop_last_hit_block,
        dp_rank=parallel.dp_rank,
    )
