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


def test_clear_command_reaches_the_pool():
    address = channel_address(f"test-{uuid.uuid4().hex}")
    cleared = []
    server = LookupServer(address, lambda keys: [True] * len(keys), lambda: cleared.append(1) or 7)
    client = LookupClient(address, timeout_s=2.0)
    try:
        assert client.clear() == 7
        assert cleared == [1]
        assert client.exists(["a"]) == [True]
    finally:
        server.close()
        client.close()
