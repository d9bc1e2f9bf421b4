"""specs: every KV-cache spec kvpool stores is modelled exactly; every other is refused by name."""

from __future__ import annotations

import pytest

from kvpool.core.errors import LayoutError
from kvpool.core.masks import ChunkedLocal, FullAttention, SlidingWindow
from kvpool.core.specs import REFUSED_SPECS, SUPPORTED_SPECS, SpecFacts, attention_kind


def test_supported_specs_map_to_their_kind() -> None:
    assert attention_kind(SpecFacts("FullAttentionSpec", 16)) == FullAttention(16)
    assert attention_kind(SpecFacts("MLAAttentionSpec", 64)) == FullAttention(64)
    assert attention_kind(SpecFacts("SlidingWindowSpec", 16, sliding_window=64)) == SlidingWindow(16, 64)
    assert attention_kind(SpecFacts("ChunkedLocalAttentionSpec", 16, attention_chunk_size=64)) == ChunkedLocal(16, 64)
    # hybrid allocator off: a sliding-window layer in a full-attention group keeps every block
    assert attention_kind(SpecFacts("FullAttentionSpec", 16, sliding_window=64)) == FullAttention(16)


@pytest.mark.parametrize("name", [*sorted(REFUSED_SPECS), "SomeFutureSpec"])
def test_other_specs_are_refused_by_name(name: str) -> None:
    with pytest.raises(LayoutError, match=name) as info:
        attention_kind(SpecFacts(name, 16, sliding_window=64))
    assert "without the connector" in str(info.value)


def test_a_subclass_never_inherits_its_parents_kind() -> None:
    """RSWASpec subclasses FullAttentionSpec in vLLM, yet frees blocks full attention keeps."""
    with pytest.raises(LayoutError, match="RSWASpec"):
        attention_kind(SpecFacts("RSWASpec", 16))
    assert "RSWASpec" not in SUPPORTED_SPECS


def test_a_non_causal_full_attention_spec_is_refused() -> None:
    with pytest.raises(LayoutError, match=r"non_causal=True"):
        attention_kind(SpecFacts("FullAttentionSpec", 16, non_causal=True))


@pytest.mark.parametrize("extra", [0, 1, 16, 40])
@pytest.mark.parametrize("window", [1, 17, 64])
def test_extra_retained_tokens_widen_the_blocks_a_hit_fills(window: int, extra: int) -> None:
    """vLLM keeps `extra_retained_tokens` below the window as real blocks (it frees up to
    `num_computed - window + 1 - extra` tokens): a hit must fill exactly those blocks."""
    kind = attention_kind(SpecFacts("SlidingWindowSpec", 16, sliding_window=window, extra_retained_tokens=extra))
    assert isinstance(kind, SlidingWindow)
    for hit in range(16, 400, 16):
        skipped = max(0, hit - window + 1 - extra)  # vLLM's SlidingWindowManager.get_num_skipped_tokens
        assert kind.required(hit) == range(skipped // 16, hit // 16)
        assert kind.first_live_chunk(hit) == skipped // 16
