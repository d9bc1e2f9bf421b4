import time
import uuid

import pytest

from kvpool.lookup_channel import LookupClient, LookupServer, channel_address


def test_round_trip_and_fail_open_timeout():
    address = channel_address(f"test-{uuid.uuid4().hex}")
    server = LookupServer(address, lambda keys: [key.endswith("1") for key in keys])
    client = LookupClient(address, timeout_s=1.0)
    try:
        assert client.exists(["a/1", "a/2", "b/1"]) == [True, False, True]
        assert client.exists([]) == []
    finally:
        server.close()
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        client.exists(["a/1"])
    assert time.monotonic() - began < 3.0
    # a restarted server is reached again by the same client
    server = LookupServer(address, lambda keys: [True] * len(keys))
    try:
        assert client.exists(["x"]) == [True]
    finally:
        server.close()
        client.close()


def test_server_answers_miss_when_the_pool_raises():
    address = channel_address(f"test-{uuid.uuid4().hex}")

    def broken(keys):
        raise RuntimeError("pool down")

    server = LookupServer(address, broken)
    client = LookupClient(address, timeout_s=2.0)
    try:
        assert client.exists(["a", "b"]) == [False, False]
    finally:
        server.close()
        client.close()


def test_reset_command_reaches_the_worker_with_its_epoch():
    address = channel_address(f"test-{uuid.uuid4().hex}")
    resets = []
    server = LookupServer(address, lambda keys: [True] * len(keys), lambda epoch: resets.append(epoch) or 7)
    client = LookupClient(address, timeout_s=2.0)
    try:
        assert client.reset(3) == 7
        assert resets == [3]
        assert client.exists(["a"]) == [True]
    finally:
        server.close()
        client.close()


def test_one_client_is_safe_from_two_threads():
    """The scheduler thread (reset) and the lookup thread share the client; every answer must belong to
    its own question."""
    import threading

    address = channel_address(f"test-{uuid.uuid4().hex}")
    server = LookupServer(address, lambda keys: [key.endswith("1") for key in keys], lambda epoch: epoch)
    client = LookupClient(address, timeout_s=5.0)
    errors: list[BaseException] = []

    def lookups() -> None:
        try:
            for i in range(300):
                keys = [f"{i}/1", f"{i}/2"] * (1 + i % 3)
                assert client.exists(keys) == [True, False] * (1 + i % 3)
        except BaseException as exc:
            errors.append(exc)

    def resets() -> None:
        try:
            for epoch in range(300):
                assert client.reset(epoch) == epoch
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=lookups), threading.Thread(target=resets)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        server.close()
        client.close()
    assert errors == []
