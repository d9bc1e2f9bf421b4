"""Sanity of the tiny random models on a real vLLM CPU engine (no connector).

Load tests can only fail if the model's greedy output depends on the KV of the prompt, so this
checks that the output reacts to the prompt -- to its last token, to its first block (KV a
prefix load would supply) and to an entirely different prompt -- and that the engine is
deterministic (recomputing the batch after a prefix-cache reset, and a prefix-cache hit, reproduce
it).
"""

from __future__ import annotations

import random

import pytest

from kvpool.testing.engine import GreedyResult, assert_same_greedy, dtype_ulp, engine, generate_greedy
from kvpool.testing.models import default_model_dir, make_tiny_model

PROMPT_LEN = 300
MAX_TOKENS = 16
BLOCK = 64


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(1234)
    a = [rng.randrange(3, 1024) for _ in range(PROMPT_LEN)]
    b = [rng.randrange(3, 1024) for _ in range(PROMPT_LEN)]
    a_head = [rng.randrange(3, 1024) for _ in range(32)] + a[32:]  # first block's KV differs
    a_tail = [*a[:-1], (a[-1] + 1 - 3) % 1021 + 3]  # only the last token differs
    return {"a": a, "b": b, "a_head": a_head, "a_tail": a_tail}


@pytest.mark.vllm
@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_tiny_model_is_context_sensitive_and_deterministic(kind: str) -> None:
    pytest.importorskip("vllm")
    model = make_tiny_model(kind, default_model_dir())
    prompts = _prompts()
    names = list(prompts)
    batch = [prompts[n] for n in names]

    with engine(model, block_size=BLOCK) as llm:
        first = dict(zip(names, generate_greedy(llm, batch, MAX_TOKENS)))
        # Empty the prefix cache: the same batch is recomputed from scratch.
        assert llm.reset_prefix_cache()
        fresh = dict(zip(names, generate_greedy(llm, batch, MAX_TOKENS)))
        # Again without a reset: vLLM's own prefix cache serves the block-aligned prefix.
        again = dict(zip(names, generate_greedy(llm, batch, MAX_TOKENS)))

    out = {n: r.token_ids for n, r in first.items()}
    aligned = PROMPT_LEN // BLOCK * BLOCK
    # "a_tail" is admitted in the same step as "a" and already hits a's blocks (vLLM caches a
    # block's hash at allocation, before the forward that fills it).
    assert {n: r.num_cached_tokens for n, r in first.items()} == {"a": 0, "b": 0, "a_head": 0, "a_tail": aligned}
    for n, r in first.items():
        assert len(r.token_ids) == MAX_TOKENS, (n, r.token_ids)
        assert len(r.top) == MAX_TOKENS and all(len(step) == 2 for step in r.top), n
        assert r.top[0][0][0] == r.token_ids[0]  # greedy picks the top-1
    # Context sensitivity: a different prompt, a different first block, a different last token.
    assert out["a"] != out["b"], out
    assert out["a"] != out["a_head"], f"{kind}: output ignores the first block of the prompt: {out}"
    assert out["a"] != out["a_tail"], f"{kind}: output ignores the last prompt token: {out}"

    # Determinism: recomputing the same batch reproduces everything bit-exactly.
    assert [fresh[n].num_cached_tokens for n in names] == [first[n].num_cached_tokens for n in names]
    for n in names:
        assert fresh[n].token_ids == first[n].token_ids, (n, first[n].token_ids, fresh[n].token_ids)
        assert fresh[n].top == first[n].top, n

    # Prefix-cache hit in the same engine: block-aligned prefix reused, output unchanged
    # (tie-aware: the prefill chunk differs, decode logits may move by an ulp).
    assert [again[n].num_cached_tokens for n in names] == [aligned] * len(names)
    for n in names:
        assert again[n].top[0] == first[n].top[0], n  # prefill is exact across prefix hits
    summary = assert_same_greedy([first[n] for n in names], [again[n] for n in names])
    assert summary.num_tie_divergences <= 1, summary


# --- assert_same_greedy on synthetic results (no engine) ----------------------------------------


def _res(tokens: list[int], gaps: list[float], top1: float = 3.0) -> GreedyResult:
    """Result whose step i has top-1 ``tokens[i]`` at ``top1`` and a runner-up ``gaps[i]`` lower."""
    top = [[(t, top1), (t + 1, top1 - g)] for t, g in zip(tokens, gaps)]
    return GreedyResult(token_ids=tokens, num_cached_tokens=0, top=top)


def test_dtype_ulp() -> None:
    assert dtype_ulp(3.0) == 2.0**-6
    assert dtype_ulp(-4.5) == 2.0**-5
    assert dtype_ulp(0.7) == 2.0**-8
    assert dtype_ulp(3.0, "float32") == 2.0**-22


def test_same_greedy_accepts_identical_and_tie_divergence() -> None:
    ulp = dtype_ulp(3.0)
    a = [_res([5, 6, 7, 8], [1.0] * 4), _res([9, 10, 11, 12], [1.0, 1.0, 2 * ulp, 1.0])]
    b = [_res([5, 6, 7, 8], [1.0] * 4), _res([9, 10, 99, 98], [1.0, 1.0, 0.0, 1.0])]
    summary = assert_same_greedy(a, b)
    assert summary.num_identical == 1
    assert [(i, step) for i, step, *_ in summary.tie_divergences] == [(1, 2)]
    assert summary.num_steps == 4 + 3
    with pytest.raises(AssertionError, match="diverged at near-ties"):
        assert_same_greedy(a, b, max_tie_fraction=0.4)


def test_same_greedy_rejects_divergence_without_tie_in_both_runs() -> None:
    ulp = dtype_ulp(3.0)
    a = [_res([1, 2, 3], [1.0, 1.0, 7 * ulp])]  # 7 ulps > default 6: not a near-tie
    b = [_res([1, 2, 4], [1.0, 1.0, 0.0])]
    with pytest.raises(AssertionError, match="without a near-tie"):
        assert_same_greedy(a, b)
    assert assert_same_greedy(a, b, tie_ulps=8).num_tie_divergences == 1


def test_same_greedy_first_token_and_lengths_are_exact() -> None:
    with pytest.raises(AssertionError, match="first tokens differ"):
        assert_same_greedy([_res([1, 2], [0.0, 0.0])], [_res([3, 2], [0.0, 0.0])])
    with pytest.raises(AssertionError, match="lengths differ"):
        assert_same_greedy([_res([1, 2], [1.0, 1.0])], [_res([1, 2, 3], [1.0, 1.0, 1.0])])


def test_same_greedy_logprob_values_use_absolute_eps() -> None:
    a = [_res([1, 2, 3], [1.0, 1.0, 0.05])]
    b = [_res([1, 2, 4], [1.0, 1.0, 0.01])]
    for r in (*a, *b):
        r.value_kind = "raw_logprobs"
    assert assert_same_greedy(a, b).num_tie_divergences == 1  # 0.05 <= 2^-4
    with pytest.raises(AssertionError):
        assert_same_greedy(a, b, tie_eps=0.02)
