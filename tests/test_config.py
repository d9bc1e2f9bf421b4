import pytest

from kvpool.core.config import KVPoolConfig, parse_size
from kvpool.core.errors import ConfigError


def test_defaults_and_sizes():
    config = KVPoolConfig.from_dict({"capacity_bytes": "512MiB", "retention_interval": None})
    assert config.capacity_bytes == 512 << 20
    assert config.retention_interval is None
    assert KVPoolConfig.from_dict(None).backend == "memory"
    assert parse_size("x", 4096) == 4096


@pytest.mark.parametrize(
    ("text", "size"),
    [("8GB", 8 * 10**9), ("8GiB", 8 << 30), ("1.5 gb", 1_500_000_000), ("512MiB", 512 << 20), ("64kB", 64_000),
     ("2TiB", 2 << 40), ("1048576", 1 << 20), ("100b", 100)],
)
def test_sizes_follow_si_and_iec_units(text: str, size: int) -> None:
    """GB = 10**9, GiB = 2**30, as everyone but a few C++ flag parsers reads them."""
    assert parse_size("capacity_bytes", text) == size


@pytest.mark.parametrize("text", ["3g", "1.5k", "2 MBs", "GB", "-1GB", "1e9", "0"])
def test_ambiguous_or_bad_sizes_are_refused_naming_the_units(text: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_size("capacity_bytes", text)
    assert "'capacity_bytes'" in str(caught.value) and "KiB/MiB/GiB/TiB = 1024^n" in str(caught.value)


def test_exists_before_put_is_automatic_per_pool():
    assert KVPoolConfig.from_dict({}).exists_before_put()  # embedded: a dict probe that spares a copy
    mooncake = {"backend": "mooncake", "mooncake": {"master": "127.0.0.1:1"}}
    assert not KVPoolConfig.from_dict(mooncake).exists_before_put()  # a master round trip, and a lease
    assert KVPoolConfig.from_dict({**mooncake, "check_exists_before_put": True}).exists_before_put()
    assert not KVPoolConfig.from_dict({"check_exists_before_put": False}).exists_before_put()


@pytest.mark.parametrize(
    ("raw", "key", "allowed"),
    [
        ({"capacity": 1}, "capacity", "one of the keys"),
        ({"backend": "redis"}, "backend", "memory, mooncake"),
        ({"capacity_bytes": "lots"}, "capacity_bytes", "byte count"),
        ({"capacity_bytes": -1}, "capacity_bytes", "byte count"),
        ({"save_decode": "yes"}, "save_decode", "true or false"),
        ({"retention_interval": -64}, "retention_interval", "positive token count"),
        ({"lookup_timeout_s": 0}, "lookup_timeout_s", "positive number of seconds"),
        ({"lookup_wait_ms": -1}, "lookup_wait_ms", "0 up to lookup_timeout_s"),
        ({"lookup_wait_ms": 500}, "lookup_wait_ms", "0 up to lookup_timeout_s"),
        ({"lookup_wait_ms": "5"}, "lookup_wait_ms", "0 up to lookup_timeout_s"),
        ({"put_batch_chunks": 0}, "put_batch_chunks", "1 to 65536"),
        ({"check_exists_before_put": "yes"}, "check_exists_before_put", "true, false or null"),
        ({"save_linger_steps": -1}, "save_linger_steps", "0 to 1024"),
        ({"save_linger_steps": True}, "save_linger_steps", "0 to 1024"),
        ({"save_linger_ms": 5000}, "save_linger_ms", "0 to 1000"),
        ({"load_failure_policy": "ignore"}, "load_failure_policy", "recompute or engine"),
        ({"backend": "mooncake", "mooncake": {"master_server_address": "x"}}, "master_server_address", "mooncake"),
        ({"backend": "mooncake", "mooncake": {"global_segment_size": "huge"}}, "global_segment_size", ""),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(raw, key, allowed):
    with pytest.raises(ConfigError) as caught:
        KVPoolConfig.from_dict(raw)
    assert caught.value.key == key
    message = str(caught.value)
    assert repr(key) in message and allowed in message
    assert repr(caught.value.value) in message
