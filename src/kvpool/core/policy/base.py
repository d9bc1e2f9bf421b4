"""What every policy shares: the protocol the pool calls, its counters, a chunk's parent key, and plain
LRU (the pool's own order). The rules of the other policies and the invariants they keep: `__init__.py`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

POLICY_NAMES = ("adaptive", "lru", "chain-lru", "weighted", "second-sight")
# plain LRU until the adaptive policy passes the real-engine tests: with it the default, hybrid-model,
# disk-tier and Mooncake-TP tests missed hits they had (clean-clone run of e22ec9a); the cause is open
DEFAULT_POLICY = "lru"
ROOT = ""  # the parent of a chain's first chunk


@dataclass
class PolicyCounters:
    """What a policy decided, for operators and benches."""

    policy: str
    admitted: int = 0
    declined: int = 0  # chunks a put did not store: the admission said no
    evicted: int = 0
    reads: int = 0
    choice: str = ""  # adaptive: the ledger the pool follows now
    switches: int = 0  # adaptive: how often it changed
    ledger_hits: dict[str, float] = field(default_factory=dict)


def _nothing(key: str) -> bool:
    """No key: the default `writing` (no put is copying)."""
    return False


@runtime_checkable
class PoolPolicy(Protocol):
    """Admission and eviction for one pool. Every method runs under the pool's lock."""

    name: str

    def link(self, keys: Sequence[str], parents: Sequence[bytes | None]) -> None:
        """Each key's parent chunk hash (b"": the first chunk of its chain; None: not known)."""
        ...

    def read(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        """A load read these held chunks, head to tail."""
        ...

    def put(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        present: Sequence[bool],
        free_bytes: int,
        held: Callable[[str], bool],
        admit_all: bool = False,
    ) -> list[bool]:
        """A save of `keys`, head to tail; `present[i]`: the pool holds key i (a touch). Which keys to
        store (True for every present one); `free_bytes`: room before an eviction; `held`: whether the
        pool holds a key (a parent); `admit_all`: the pool stores every key whatever the admission (a disk
        hit promoted: it was read)."""
        ...

    def victim(self, held: Callable[[str], bool], writing: Callable[[str], bool] = _nothing) -> str | None:
        """The key to evict now, one `held` says the pool holds; None: none can go without cutting a chain
        (the put is refused, FULL). `writing`: whether a put reserved a key and is still copying it (not in
        the pool yet, not gone: it cannot go now and stays in the record; by default none). The `lru`
        policy's None: the pool's own least recently used."""
        ...

    def evicted(self, key: str) -> None:
        """The pool evicted `key` (what `victim` named)."""
        ...

    def clear(self) -> None:
        """The pool was emptied."""
        ...

    def counters(self) -> PolicyCounters: ...


def parent_key(key: str, parent: bytes | None) -> str | None:
    """The key of `key`'s parent chunk, from its hash: the same namespace prefix (a key is a prefix and its
    chunk hash in hex; a parent's hash is as long as the chunk's). ROOT for a chain's first chunk, None
    when not known."""
    if parent is None:
        return None
    if not parent:
        return ROOT
    digits = parent.hex()
    if len(key) <= len(digits):
        return None
    return key[: len(key) - len(digits)] + digits


class LRUPolicy:
    """The pool's own order (least recently used first, a put's and a load's chunks touched tail first),
    every chunk admitted: kvpool's behaviour before policies, at no cost."""

    name = "lru"

    def __init__(self) -> None:
        self._counters = PolicyCounters(self.name)

    def link(self, keys: Sequence[str], parents: Sequence[bytes | None]) -> None:
        return None

    def read(self, keys: Sequence[str], sizes: Sequence[int]) -> None:
        return None

    def put(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        present: Sequence[bool],
        free_bytes: int,
        held: Callable[[str], bool],
        admit_all: bool = False,
    ) -> list[bool]:
        return [True] * len(keys)

    def victim(self, held: Callable[[str], bool], writing: Callable[[str], bool] = _nothing) -> str | None:
        return None

    def evicted(self, key: str) -> None:
        return None

    def clear(self) -> None:
        return None

    def counters(self) -> PolicyCounters:
        return PolicyCounters(**vars(self._counters))
