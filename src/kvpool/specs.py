"""Which attention kind models an engine's KV-cache spec, decided from plain values.

Every spec kvpool stores is named here *exactly*; anything else is refused at start-up with a
message naming it. A subclass never inherits its parent's kind: vLLM's `RSWASpec` subclasses
`FullAttentionSpec` but frees the decode "gap" blocks, so a class-hierarchy match would load and
store it as full attention and serve blocks that were never written.

The adapter turns an engine spec into `SpecFacts` (its class name and the fields that decide
reachability); nothing here imports the engine. A group whose layers the engine describes one by
one (vLLM's `UniformTypeKVCacheSpecs` on the workers) is modelled by its first layer, as the
engine's scheduler sees it, and only when every layer has that layer's kind (`group_layer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvpool.errors import LayoutError
from kvpool.masks import AttentionKind, ChunkedLocal, FullAttention, SlidingWindow

Layer = TypeVar("Layer")  # the engine's own spec object for one layer


@dataclass(frozen=True)
class SpecFacts:
    """What decides a KV-cache group's reachability rules, engine-neutral."""

    type_name: str
    block_size: int
    sliding_window: int | None = None
    extra_retained_tokens: int = 0  # real blocks kept below the window (vLLM: multi-token prediction)
    attention_chunk_size: int | None = None
    non_causal: bool = False


def _full(facts: SpecFacts) -> AttentionKind:
    if facts.non_causal:
        raise LayoutError(
            f"KV cache spec {facts.type_name}(non_causal=True) is not supported by kvpool: a prefix-LM "
            "layer's KV depends on tokens after it, so a stored prefix is not reusable (vLLM turns its own "
            "prefix caching off for it); run this model without the connector"
        )
    # sliding_window / attention_chunk_size on a full-attention spec (hybrid allocator off): the engine
    # keeps every block, so every chunk is stored and loaded
    return FullAttention(facts.block_size)


def _sliding(facts: SpecFacts) -> AttentionKind:
    if facts.sliding_window is None:
        raise LayoutError(f"KV cache spec {facts.type_name} has no sliding_window")
    return SlidingWindow(facts.block_size, facts.sliding_window, extra_retained=facts.extra_retained_tokens)


def _chunked(facts: SpecFacts) -> AttentionKind:
    if facts.attention_chunk_size is None:
        raise LayoutError(f"KV cache spec {facts.type_name} has no attention_chunk_size")
    return ChunkedLocal(facts.block_size, facts.attention_chunk_size)


# exact class names (vLLM 0.32) → kind; MLA variants differ only in the bytes of a block
SUPPORTED_SPECS: dict[str, Callable[[SpecFacts], AttentionKind]] = {
    "FullAttentionSpec": _full,
    "MLAAttentionSpec": _full,
    "SlidingWindowSpec": _sliding,
    "SlidingWindowMLASpec": _sliding,
    "ChunkedLocalAttentionSpec": _chunked,
}

# known specs kvpool refuses, and why (the start-up error says it)
REFUSED_SPECS: dict[str, str] = {
    "RSWASpec": "the engine frees the decode gap blocks between the prompt and the window",
    "MambaSpec": (
        "vLLM rewrites a request's Mamba state block in place until the sequence crosses its boundary, "
        "then nulls, frees or moves it, so its block table cannot be read by position like attention KV; "
        "only vLLM's boundary-state hand-off names blocks holding a boundary's state, and kvpool does not "
        "take it yet"
    ),
    "SinkFullAttentionSpec": "attention sinks keep extra per-request state outside the paged blocks",
    "HiddenStateCacheSpec": "it caches hidden states for speculative decoding, not attention KV",
    "CircularBufferSpec": "one ring block per request is overwritten in place",
    "EncoderOnlyAttentionSpec": "encoder KV is not a reusable prefix",
    "CrossAttentionSpec": "cross-attention KV belongs to the encoder input, not the prompt prefix",
    "HiSparseHotSpec": "sparse hot/resident caches are not plain paged KV",
    "HiSparseResidentSpec": "sparse hot/resident caches are not plain paged KV",
}


def attention_kind(facts: SpecFacts) -> AttentionKind:
    """The kind that models `facts` exactly; LayoutError naming the spec when there is none."""
    make = SUPPORTED_SPECS.get(facts.type_name)
    if make is not None:
        return make(facts)
    why = REFUSED_SPECS.get(facts.type_name, "kvpool does not model it")
    raise LayoutError(
        f"KV cache spec {facts.type_name} is not supported by kvpool ({why}); supported specs: "
        f"{', '.join(SUPPORTED_SPECS)}. Run this model without the connector"
    )


def group_layer(wrapper: str, layers: Sequence[Layer], facts: Callable[[Layer], SpecFacts]) -> Layer:
    """The layer that stands for a group the engine describes layer by layer: the first, since that is
    the spec the engine's scheduler is handed, so both roles derive the same kind and keys. LayoutError
    naming `wrapper` (the engine's class for the group) when the layers differ in attention kind."""
    if not layers:
        raise LayoutError(f"KV cache group {wrapper} lists no layers")
    kinds = {attention_kind(facts(layer)) for layer in layers}
    if len(kinds) > 1:
        raise LayoutError(f"KV cache group {wrapper} mixes attention kinds {sorted(map(repr, kinds))}")
    return layers[0]
