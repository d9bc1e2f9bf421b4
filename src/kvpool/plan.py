"""Where a rank's chunks go: key namespaces per TP shard and PP stage, and which rank writes what.

Both connector roles derive the same plan from the engine config: the scheduler to know which
namespaces a hit must be present in, each worker to know its own namespace and the chunks it puts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvpool.keys import KeySpace, LayoutFingerprint
from kvpool.masks import MaskCoordinator


@dataclass(frozen=True)
class GroupPlacement:
    """This rank's share of a group: its key namespace and which chunks it writes."""

    keys: KeySpace
    put_step: int = 1
    put_step_rank: int = 0


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
