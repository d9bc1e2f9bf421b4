"""What `kvpool bench serve` runs: its workload (prompt lengths, datasets, concurrencies, rounds, the
engine's cache and every pool's size), and `Served`, what starting a system's server and warming it
read of a workload (`Workload` here, `trace.Workload` too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvpool.benchmarks.serving import serve_systems

DATASETS = ("reuse", "random")
MIN_POOL_BYTES = 16 << 20  # a smaller Mooncake segment fails its setup


@dataclass(frozen=True)
class Workload:
    model_kind: str = "llama-bench"
    prefix_len: int = 512
    suffix_len: int = 128  # a unique tail of whole blocks: a connector keyed on whole prompts cannot hit
    output_len: int = 8
    num_prefixes: int = 12
    prompts_per_prefix: int = 3
    random_prompts: int = 18
    concurrencies: tuple[int, ...] = (1, 4, 16)
    rounds: int = 3
    # the engine's own KV cache: the prefixes hold twice it, and 4 requests fit at once (below that, preemption
    # thrash at concurrency 4 made runs of one system differ by 30%)
    engine_cache_tokens: int = 3072
    block_size: int = 64
    max_model_len: int = 1024
    pool_fraction: float = 1 / 3  # every pool's capacity, as a share of one round's reuse working set
    probe_prompts: int = 3
    dtype: str = "bfloat16"
    min_pool_bytes: int = MIN_POOL_BYTES

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.suffix_len

    @property
    def working_set_tokens(self) -> int:
        """The tokens one round's reuse runs at one concurrency store: the prefixes and every suffix."""
        return self.num_prefixes * self.prefix_len + self.num_prefixes * self.prompts_per_prefix * self.suffix_len

    @property
    def filler_len(self) -> int:
        return min(self.max_model_len - 8, 2 * self.prompt_len)

    @property
    def fillers(self) -> int:
        """Prompts that push a probe prompt out of the engine's own cache."""
        return -(-(self.engine_cache_tokens + self.prompt_len) // self.filler_len)

    @property
    def pool_tokens(self) -> int:
        """Every pool's capacity: `pool_fraction` of the working set, and never less than 1.5x a probe
        prompt with its fillers (the probe measures a pool hit, not the pool's eviction: Mooncake evicts
        a share of its objects once 95% full, and at 1.0x it lost probe prompts)."""
        probe = self.prompt_len + self.fillers * self.filler_len + self.block_size
        return max(round(self.working_set_tokens * self.pool_fraction), round(1.5 * probe))

    def steps(self, systems: int, try_unsupported: bool) -> int:
        """How many times `run` calls `progress`: per system its start, each run and each probe."""
        per_round = len(DATASETS) * len(self.concurrencies) + 1
        return systems * (1 + self.rounds * per_round) + (len(serve_systems.UNSUPPORTED) if try_unsupported else 0)


class Served(Protocol):
    """What `servers.start_all` reads of a workload (`Workload` here, `trace.Workload` too): the engine's settings,
    every pool's size, and the warm-up's prompt and fillers."""

    @property
    def dtype(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def engine_cache_tokens(self) -> int: ...
    @property
    def concurrencies(self) -> tuple[int, ...]: ...
    @property
    def pool_tokens(self) -> int: ...
    @property
    def min_pool_bytes(self) -> int: ...
    @property
    def prompt_len(self) -> int: ...
    @property
    def filler_len(self) -> int: ...
    @property
    def fillers(self) -> int: ...
