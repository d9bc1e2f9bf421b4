"""`AdaptivePolicy`: the pool's own `ChainPolicy` follows whichever of four key-only ledgers (the chain
policies, replayed at the pool's capacity) hit most lately."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.core.policy.base import PolicyCounters, _nothing
from kvpool.core.policy.chain import ChainPolicy

LEDGER_DECAY = 0.9  # each ledger's hits at every choice
SWITCH_MARGIN = 0.05  # the adaptive choice moves to another ledger only if it hit this much more


class _Ledger:
    """A key-only replay of the pool's stream under one fixed policy, at the pool's capacity: what it
    would hit."""

    def __init__(self, policy: ChainPolicy, capacity_bytes: int) -> None:
        self.policy = policy
        self.capacity_bytes = capacity_bytes
        self.hits = 0.0
        self.score = 0.0

    def observe(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        """The chunks of a load or a save: each a hit here if this ledger holds it (and its parent),
        then taken in as the pool would."""
        policy = self.policy
        meta = policy._meta
        present = [(entry := meta.get(key)) is not None and entry.cls >= 0 for key in keys]
        if any(present):
            self.hits += sum(policy.chain_held(key) for key, there in zip(keys, present) if there)
        policy.put(keys, sizes, present, self.capacity_bytes - policy.held_bytes, policy.holds)
        while policy.held_bytes > self.capacity_bytes:
            key = policy.victim(policy.holds)
            if key is None:
                break
            policy.evicted(key)


class AdaptivePolicy:
    """The default: the pool's own `ChainPolicy` follows whichever of four ledgers (chain-lru, weighted,
    each with and without second-sight admission) hit most lately (hits decayed by `LEDGER_DECAY` at each
    choice, one per half of the pool's capacity in chunks sighted; a change needs `SWITCH_MARGIN` more).
    Eviction and admission switch at once: the four differ only in their rules, not in what they hold."""

    name = "adaptive"

    def __init__(self, capacity_bytes: int, *, admission: bool = True) -> None:
        variants = [
            (weighted, second) for weighted in (False, True) for second in ((False, True) if admission else (False,))
        ]
        self._main = ChainPolicy(name=self.name)
        self._ledgers = [
            _Ledger(ChainPolicy(weighted=weighted, second_sight=second), capacity_bytes)
            for weighted, second in variants
        ]
        self._choice = 0
        self._sighted = 0
        self._sighted_bytes = 0
        self._next_choice = 64
        self._counters = PolicyCounters(self.name, choice=self._ledgers[0].policy.name)
        self.capacity_bytes = capacity_bytes

    def link(self, keys: Sequence[str], parents: Sequence[bytes | None]) -> None:
        self._main.link(keys, parents)
        for ledger in self._ledgers:
            ledger.policy.link(keys, parents)

    def read(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        self._observe(keys, sizes)
        self._main.read(keys, sizes)

    def put(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        present: Sequence[bool],
        free_bytes: int,
        held: Callable[[str], bool],
        admit_all: bool = False,
    ) -> list[bool]:
        self._observe(keys, sizes)
        return self._main.put(keys, sizes, present, free_bytes, held, admit_all)

    def victim(self, held: Callable[[str], bool], writing: Callable[[str], bool] = _nothing) -> str | None:
        return self._main.victim(held, writing)

    def evicted(self, key: str) -> None:
        self._main.evicted(key)

    def clear(self) -> None:
        self._main.clear()

    def counters(self) -> PolicyCounters:
        main = self._main.counters()
        counters = PolicyCounters(**vars(self._counters))
        counters.admitted, counters.declined, counters.evicted, counters.reads = (
            main.admitted,
            main.declined,
            main.evicted,
            main.reads,
        )
        counters.ledger_hits = {ledger.policy.name: round(ledger.score, 1) for ledger in self._ledgers}
        return counters

    def _observe(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        if not keys:
            return
        for ledger in self._ledgers:
            ledger.observe(keys, sizes)
        self._sighted += len(keys)
        self._sighted_bytes += sum(sizes)
        if self._sighted >= self._next_choice:
            self._choose()

    def _choose(self) -> None:
        ledgers = self._ledgers
        for ledger in ledgers:
            ledger.score = ledger.score * LEDGER_DECAY + ledger.hits
            ledger.hits = 0.0
        best = max(range(len(ledgers)), key=lambda index: ledgers[index].score)
        if ledgers[best].score > ledgers[self._choice].score * (1 + SWITCH_MARGIN):
            self._choice = best
            self._counters.switches += 1
        chosen = ledgers[self._choice].policy
        self._main.weighted, self._main.second_sight = chosen.weighted, chosen.second_sight
        self._counters.choice = chosen.name
        chunk = max(1, self._sighted_bytes // max(1, self._sighted))  # mean chunk size seen
        self._next_choice = self._sighted + max(64, self.capacity_bytes // chunk // 2)
