"""Sanity of the tiny random models on a real vLLM CPU engine (no connector).

Load tests can only fail if the model's greedy output depends on the KV of the prompt, so this
checks that the output reacts to the prompt -- to its last token, to its first block (KV a
prefix load would supply) and to an entirely different prompt -- and that the engine is
deterministic (a fresh engine, and a prefix-cache hit in the same engine, reproduce it).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines

import random

import pytest

pytest.importorskip("vllm")

from kvpool.testing.engine import assert_same_greedy, engine, generate_greedy
from kvpool.testing.models import default_model_dir, make_tiny_model

pytestmark = pytest.mark.vllm

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


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_tiny_model_is_context_sensitive_and_deterministic(kind: str) -> None:
    model = make_tiny_model(kind, default_model_dir())
    prompts = _prompts()
    names = list(prompts)
    batch = [prompts[n] for n in names]

    with engine(model, block_size=BLOCK) as llm:
        first = dict(zip(names, generate_greedy(llm, batch, MAX_TOKENS)))
        # Same engine again: vLLM's own prefix cache serves the block-aligned prefix.
        again = dict(zip(names, generate_greedy(llm, batch, MAX_TOKENS)))
    with engine(model, block_size=BLOCK) as llm:
        fresh = dict(zip(names, generate_greedy(llm, batch, MAX_TOKENS)))

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

    # Determinism: a fresh engine with the same batch reproduces everything bit-exactly.
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
