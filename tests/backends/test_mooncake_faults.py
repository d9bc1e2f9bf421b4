"""Faults against a real mooncake_master: dead master, restart, no master, use after close, dead peer.

Each test starts its own master (the session master of the contract tests must stay up).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvpool.backends.base import Status
from kvpool.backends.factory import create_backend
from kvpool.backends.mooncake import MooncakeBackend, MooncakeErrorCode, MooncakeOptions, status_of
from kvpool.core.errors import BackendUnavailableError, ConfigError
from kvpool.core.sizes import parse_size

pytestmark = pytest.mark.timeout(90)  # every wait below is bounded; this catches a native hang

KiB = 1 << 10
FAST_S = 1.0  # no call may take longer than this once the breaker is open
RECOVERY_S = 30.0


@pytest.fixture
def master(mooncake_available: None) -> Iterator[Any]:
    from kvpool.backends.mooncake.master import start_master

    # client_ttl=2: a SIGKILLed client's segment is dropped after ~3 s instead of ~11 s
    running = start_master(extra_args=["--client_ttl=2"])
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def client(client_options: Callable[..., dict[str, Any]]) -> Iterator[Callable[..., MooncakeBackend]]:
    """Makes clients of a master (16 MiB segment by default); all closed at teardown."""
    made: list[MooncakeBackend] = []

    def make(master: Any, **overrides: Any) -> MooncakeBackend:
        overrides = {"global_segment_size": 16 << 20, "staging_bytes": 1 << 20, **overrides}
        made.append(MooncakeBackend.from_options(client_options(master, **overrides)))
        return made[-1]

    yield make
    for backend in made:
        backend.close()


def value(seed: int, sizes: tuple[int, ...] = (4 * KiB, 4 * KiB)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]


def timed(call: Any, *args: Any) -> tuple[Any, float]:
    started = time.monotonic()
    result = call(*args)
    return result, time.monotonic() - started


# --- configuration: fails at start-up, naming the key (no master needed)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"bogus": 1}, "bogus"),
        ({"master": "localhost"}, "master"),
        ({"master": "127.0.0.1:99999"}, "master"),
        ({"metadata_server": "ftp://x"}, "metadata_server"),
        ({"global_segment_size": "lots"}, "global_segment_size"),
        ({"global_segment_size": -1}, "global_segment_size"),
        ({"global_segment_size": 10}, "global_segment_size"),
        ({"local_buffer_size": True}, "local_buffer_size"),
        ({"protocol": "udp"}, "protocol"),
        ({"setup_retries": 0}, "setup_retries"),
        ({"replica_num": "2"}, "replica_num"),
        ({"prefer_local_segment": "yes"}, "prefer_local_segment"),
        ({"breaker_cooldown_s": 0}, "breaker_cooldown_s"),
        ({"staging_bytes": "1 parsec"}, "staging_bytes"),
    ],
)
def test_bad_options_name_the_key(options: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as raised:
        MooncakeOptions.parse(options)
    assert raised.value.key == key
    assert key in str(raised.value)


def test_unknown_option_lists_the_allowed_keys() -> None:
    with pytest.raises(ConfigError, match="global_segment_size"):
        create_backend("mooncake", {"master_server_address": "127.0.0.1:50051"})


def test_mooncake_sizes_use_the_packages_units_and_allow_zero() -> None:
    assert parse_size("x", 123, allow_zero=True) == 123
    assert MooncakeOptions.parse({"global_segment_size": "256MB"}).global_segment_size == 256 * 10**6
    assert MooncakeOptions.parse({"global_segment_size": "1 GiB"}).global_segment_size == 1 << 30
    assert MooncakeOptions.parse({"global_segment_size": "0"}).global_segment_size == 0  # a pure client
    with pytest.raises(ConfigError, match="global_segment_size"):
        MooncakeOptions.parse({"global_segment_size": "3g"})


def test_error_codes_map_to_statuses() -> None:
    assert status_of(0) is Status.OK and status_of(4096, reading=True) is Status.OK
    assert status_of(-200) is Status.FULL
    assert status_of(-704, reading=True) is Status.MISSING
    assert status_of(-600, reading=True) is Status.SIZE_MISMATCH
    assert status_of(-600) is Status.ERROR
    assert {status_of(code) for code in (-800, -707, -706, -1, -12345)} == {Status.ERROR}
    assert status_of(-900) is Status.UNAVAILABLE and status_of(-901) is Status.UNAVAILABLE
    assert MooncakeErrorCode.describe(-200) == "NO_AVAILABLE_HANDLE (-200)"
    assert "-12345" in MooncakeErrorCode.describe(-12345)


def test_missing_mooncake_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)  # makes `import mooncake` raise ImportError
    with pytest.raises(BackendUnavailableError) as raised:
        create_backend("mooncake", {})
    assert "pip install 'kvpool[mooncake]'" in str(raised.value)
    assert "apt-get install libibverbs1" in str(raised.value)


# --- real master faults


@pytest.mark.mooncake
def test_master_helper_serves_loopback_and_prints_its_config(master: Any) -> None:
    assert master.healthy()
    assert master.host == "127.0.0.1" and master.address == f"127.0.0.1:{master.rpc_port}"
    config = json.loads(master.config_line())
    assert config["backend"] == "mooncake"
    assert MooncakeOptions.parse(config["mooncake"]).master == master.address


@pytest.mark.mooncake
def test_setup_without_a_master_fails_fast(mooncake_available: None) -> None:
    from kvpool.backends.mooncake.master import free_port

    started = time.monotonic()
    with pytest.raises(BackendUnavailableError, match="kvpool master"):
        create_backend("mooncake", {"master": f"127.0.0.1:{free_port()}", "global_segment_size": "16MiB"})
    assert time.monotonic() - started < 10.0


@pytest.mark.mooncake
def test_use_after_close_answers_unavailable(master: Any, client: Callable[..., MooncakeBackend]) -> None:
    backend = client(master)
    key = "closing/k"
    assert backend.put([key], [value(1)]) == [Status.OK]
    backend.close()
    backend.close()  # idempotent
    assert backend.closed and not backend.healthy()
    assert backend.exists([key]) == [False]
    assert backend.put([key], [value(1)]) == [Status.UNAVAILABLE]
    assert backend.put(["other"], [value(1, (100 * KiB,))]) == [Status.UNAVAILABLE]
    assert backend.get_into([key], [value(2)]) == [Status.UNAVAILABLE]
    assert backend.remove([key]) == 0
    assert backend.clear() == 0
    assert backend.stats().puts == 1


@pytest.mark.mooncake
def test_dead_master_trips_the_breaker_and_a_restart_closes_it(
    master: Any, client: Callable[..., MooncakeBackend]
) -> None:
    from kvpool.backends.mooncake.master import start_master

    backend = client(master, breaker_cooldown_s=0.5)
    old = "before-restart"
    assert backend.put([old], [value(1)]) == [Status.OK]
    epoch = backend.epoch
    master.kill()

    # the first call may stall in Mooncake's reconnect loop; it must trip the breaker
    statuses, first_s = timed(backend.put, ["during-outage"], [value(2)])
    assert statuses == [Status.UNAVAILABLE] and first_s < 10.0
    assert backend.epoch == epoch + 1, "a trip must tell callers to forget what they stored"
    assert not backend.healthy()

    slowest = 0.0
    outage_end = time.monotonic() + 2.5  # spans several cooldowns, so probes run too
    while time.monotonic() < outage_end:
        for call, args, miss in (
            (backend.exists, (["x", old],), [False, False]),
            (backend.put, (["y"], [value(3)]), [Status.UNAVAILABLE]),
            (backend.get_into, ([old], [value(4)]), [Status.UNAVAILABLE]),
        ):
            result, took = timed(call, *args)
            assert result == miss
            slowest = max(slowest, took)
        time.sleep(0.05)
    assert slowest < FAST_S, f"a call took {slowest:.2f} s while the breaker was open"

    restarted = start_master(rpc_port=master.rpc_port, metrics_port=master.metrics_port, extra_args=["--client_ttl=2"])
    try:
        new = "after-restart"
        started = time.monotonic()
        while backend.put([new], [value(5)]) != [Status.OK]:
            assert time.monotonic() - started < RECOVERY_S, "puts must work again after the master restarts"
            time.sleep(0.2)
        assert backend.healthy()
        assert backend.exists([new, old]) == [True, False], "a restarted master has lost every old object"
        dest = [np.zeros(4 * KiB, np.uint8), np.zeros(4 * KiB, np.uint8)]
        assert backend.get_into([new], [dest]) == [Status.OK]
        assert all(np.array_equal(got, want) for got, want in zip(dest, value(5)))
    finally:
        backend.close()  # before its master goes away, or close() waits on the dead master
        restarted.stop()


@pytest.mark.mooncake
def test_a_hung_master_costs_no_caller_more_than_one_deadline(
    master: Any, client: Callable[..., MooncakeBackend]
) -> None:
    """SIGSTOP: the master's port stays open and nothing answers. The call in flight is the only one that
    waits; once it overruns its deadline the breaker opens for everyone, and the probes - real round trips,
    not TCP connects, which a stopped process still accepts - keep it open until the master answers."""
    from kvpool.backends.mooncake import STALL_GRACE_S

    backend = client(master, breaker_cooldown_s=0.3)
    assert backend.put(["hung"], [value(1)]) == [Status.OK]
    stuck_answers: list[list[bool]] = []
    os.kill(master.pid, signal.SIGSTOP)
    try:
        stuck = threading.Thread(target=lambda: stuck_answers.append(backend.exists(["hung"])))
        stuck.start()
        time.sleep(STALL_GRACE_S + 0.2)  # past the call's deadline
        assert stuck.is_alive(), "an RPC to a stopped master should hang"
        slowest = 0.0
        hung_until = time.monotonic() + 2.0  # several cooldowns: probes run against the stopped master
        while time.monotonic() < hung_until:
            assert not backend.healthy(), "a probe of a stopped master closed the breaker"
            for call, args, miss in (
                (backend.exists, (["hung"],), [False]),
                (backend.put, (["other"], [value(2)]), [Status.UNAVAILABLE]),
                (backend.get_into, (["hung"], [value(3)]), [Status.UNAVAILABLE]),
            ):
                result, took = timed(call, *args)
                assert result == miss
                slowest = max(slowest, took)
            time.sleep(0.05)
        assert slowest < 0.05, f"a refused call took {slowest * 1000:.0f} ms"
    finally:
        os.kill(master.pid, signal.SIGCONT)
    stuck.join(timeout=40)
    assert not stuck.is_alive() and stuck_answers == [[True]], "the held call completes once the master resumes"
    started = time.monotonic()
    while not backend.healthy():
        assert time.monotonic() - started < RECOVERY_S, "the breaker must close once the master answers probes"
        time.sleep(0.05)
    assert backend.exists(["hung"]) == [True]


OWNER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    from kvpool.backends.mooncake import MooncakeBackend
    backend = MooncakeBackend.from_options({
        "master": sys.argv[1], "global_segment_size": 16 << 20, "staging_bytes": 1 << 20})
    keys = [f"owned/{i}" for i in range(8)]
    values = [[np.full(64 << 10, i + 1, np.uint8)] for i in range(8)]
    assert backend.put(keys, values) == [0] * 8
    print("ready", flush=True)
    time.sleep(120)
    """
)


@pytest.mark.mooncake
def test_killed_segment_owner_reads_fail_instead_of_returning_garbage(
    master: Any, client: Callable[..., MooncakeBackend]
) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, master.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    reader = client(master, global_segment_size=0)  # a pure client: every object lives in the owner's segment
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
        keys = [f"owned/{i}" for i in range(8)]
        dests = [[np.zeros(64 << 10, np.uint8)] for _ in keys]
        assert reader.get_into(keys, dests) == [Status.OK] * 8
        assert all((dest[0] == i + 1).all() for i, dest in enumerate(dests))

        owner.kill()
        owner.wait(10)
        dests = [[np.zeros(64 << 10, np.uint8)] for _ in keys]
        statuses, took = timed(reader.get_into, keys, dests)
        assert set(statuses) <= {Status.ERROR, Status.MISSING}, statuses
        assert took < 10.0
        # once the master drops the dead client's segment the keys are simply gone
        deadline = time.monotonic() + 15.0
        while reader.exists(keys) != [False] * 8:
            assert time.monotonic() < deadline, "the dead owner's objects must disappear"
            time.sleep(0.25)
        assert set(reader.get_into(keys, dests)) == {Status.MISSING}
        assert reader.healthy()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
