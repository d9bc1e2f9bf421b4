"""Two ways the chain policies' record of what the pool holds went wrong (core/policy/, found replaying
the Mooncake trace behind an engine cache, issue 44), each test the rule the module docstring gives:
a parent stored after its held child counts it (`ChainPolicy._orphans`), and a chunk another put is
still copying is passed over, not forgotten (the pool's `writing`, its pending reservations)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvpool.backends.base import Rows, Status
from kvpool.backends.memory import MemoryBackend
from kvpool.core.keys import KeySpace, LayoutFingerprint
from kvpool.core.policy import make_policy

SPACE = KeySpace(LayoutFingerprint("m", "u8", 16, "t"))
CHUNK = 16


def chunk(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def key(name: str) -> str:
    return SPACE.key(chunk(name))


def rows(count: int) -> Rows:
    return Rows((np.zeros((max(1, count), CHUNK), dtype=np.uint8),), np.arange(count))


@pytest.mark.parametrize("policy", ["chain-lru", "weighted"])
def test_a_parent_stored_after_its_child_is_not_evicted_while_the_child_is_held(policy: str) -> None:
    """ "Eviction only takes a chain's leaf (a chunk no held chunk names as parent)." Behind an engine
    cache the pool is asked for a prompt's suffix only: a request whose A-B the engine holds saves C
    (B not in the pool); a later request the engine misses saves A and B. B is then C's parent in the
    pool; when `_store` counted a chunk's held children only if the child came after it, B counted as
    a leaf, and once C was read more recently it was evicted before C, cutting the chain A-B-C."""
    pool = MemoryBackend(3 * CHUNK, make_policy(policy, 3 * CHUNK))
    a, b, c, z = (key(n) for n in "abcz")
    assert pool.put_linked([c], rows(1), [chunk("b")]) == [Status.OK]  # the engine held A-B
    assert pool.put_linked([a, b], rows(2), [b"", chunk("a")]) == [Status.OK] * 2  # the engine held nothing
    assert pool.get_into([c], rows(1)) == [Status.OK]  # the engine held A-B again: C read from the pool
    assert pool.put_linked([z], rows(1), [b""]) == [Status.OK]  # a new prompt: one chunk must go
    held = dict(zip("abc", pool.exists([a, b, c])))
    assert not (held["c"] and not held["b"]), f"{policy}: C kept, its parent B evicted ({held})"


@pytest.mark.parametrize("policy", ["chain-lru", "weighted"])
def test_a_parent_removed_and_stored_again_still_counts_its_held_child(policy: str) -> None:
    """The same rule when the parent left first: B removed while C is held, then B put again. B is C's
    parent once more, not a leaf (its held children are kept while it is not held)."""
    pool = MemoryBackend(3 * CHUNK, make_policy(policy, 3 * CHUNK))
    a, b, c, z = (key(n) for n in "abcz")
    assert pool.put_linked([a, b, c], rows(3), [b"", chunk("a"), chunk("b")]) == [Status.OK] * 3
    assert pool.remove([b]) == 1
    assert pool.put_linked([b], rows(1), [chunk("a")]) == [Status.OK]
    assert pool.get_into([c], rows(1)) == [Status.OK]
    assert pool.put_linked([z], rows(1), [b""]) == [Status.OK]
    held = dict(zip("abc", pool.exists([a, b, c])))
    assert not (held["c"] and not held["b"]), f"{policy}: C kept, its parent B evicted ({held})"


@pytest.mark.parametrize("policy", ["lru", "chain-lru", "adaptive"])
def test_a_chunk_being_copied_while_another_put_evicts_stays_in_the_policys_record(policy: str) -> None:
    """ "The pool, not the policy, is the record of what is stored": a key the pool no longer holds is
    dropped from the policy when met. A put reserves its room under the lock, copies outside it, then
    publishes; another thread's put meanwhile (kvpool's save thread beside a disk tier's promotion, or
    the engine thread's in-step save) may meet the reserved chunk as the oldest leaf of its class.
    `held` is `items.__contains__`, which a chunk still being copied is not, and `_fresh` protects only
    the latest put's chunks: before the pool told the policy what it is copying (`writing`), the policy
    forgot it, the pool published it, and no eviction ever named it again. Twice over in a pool of two
    chunks, and every later put was refused (FULL) for good. The pool's own LRU (no policy) keeps storing
    under the same interleaving."""
    pool = MemoryBackend(2 * CHUNK, make_policy(policy, 2 * CHUNK))
    publish = pool._publish
    copying, go_on = threading.Event(), threading.Event()

    def slow_publish(published: list[tuple[str, np.ndarray]], reserved: list[str]) -> None:
        if threading.current_thread().name == "copier":
            copying.set()
            assert go_on.wait(10)
        publish(published, reserved)

    pool._publish = slow_publish  # type: ignore[method-assign]

    def put_while_another_copies(slow: str, fast: str) -> list[Status]:
        """`slow`'s put copies (on thread "copier") while `fast` is put; then `slow` is published."""
        copying.clear()
        go_on.clear()
        copier = threading.Thread(target=pool.put_linked, args=([key(slow)], rows(1), [b""]), name="copier")
        copier.start()
        assert copying.wait(10)
        statuses = pool.put_linked([key(fast)], rows(1), [b""])
        go_on.set()
        copier.join(10)
        return statuses

    assert pool.put_linked([key("a")], rows(1), [b""]) == [Status.OK]
    assert pool.get_into([key("a")], rows(1)) == [Status.OK]  # read again: another class than new chunks
    put_while_another_copies("x1", "y1")
    put_while_another_copies("x2", "y2")
    later = [pool.put_linked([key(f"n{i}")], rows(1), [b""])[0] for i in range(5)]
    assert later == [Status.OK] * 5, f"new chunks refused while the pool holds two chunks nothing evicts: {later}"
