"""The lookup bench: JSON shape, and that every path it times finds the prefix it should."""

from __future__ import annotations

import json

from kvpool.benchmarks.per_step import lookup


def test_lookup_bench_times_the_index_next_to_vllms_own_lookup() -> None:
    result = lookup.run(contexts=[1024, 32768], block_sizes=[64], reps=10, mooncake=False)
    json.dumps(result)
    paths = {(r["path"], r["tokens"], r["case"]) for r in result["rows"]}
    for path in ("embedded", "vllm_local"):
        for tokens in (1024, 32768):
            assert {(path, tokens, "all-hit"), (path, tokens, "all-miss")} <= paths
    assert all(r["p99_us"] >= r["p50_us"] > 0 for r in result["rows"])
    assert {(r["block_size"], r["case"]) for r in result["embedded_p99_vs_vllm_local"]} == {
        (64, "all-hit"),
        (64, "all-miss"),
    }
    assert isinstance(result["pass"], bool)


def test_a_lookup_that_finds_the_wrong_prefix_fails_the_bench() -> None:
    try:
        lookup._expect("embedded", 64, 128)
    except AssertionError as error:
        assert "embedded" in str(error) and "128" in str(error)
    else:
        raise AssertionError("a wrong hit went unnoticed")
