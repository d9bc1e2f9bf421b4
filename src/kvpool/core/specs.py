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
from fractions import Fraction
from typing import TypeVar

from kvpool.core.errors import LayoutError
from kvpool.core.masks import AttentionKind, ChunkedLocal, FullAttention, SlidingWindow, StateSpace

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
    # state-space (vLLM `MambaSpec`) settings; None / defaults for attention specs
    state_cache_mode: str | None = None
    num_speculative_blocks: int = 0
    # tokens one stored state covers: 1 (or -1, a spec without the field) one state per token; an int
    # > 1 compressed KV (DeepSeek V4's c4 / c128 attention and indexer); a Fraction < 1 several states
    # per token (vLLM's Whisper block pooling). `block_size` counts tokens either way: a block holds
    # block_size / tokens_per_state states (vLLM's `get_num_kernel_states`)
    tokens_per_state: int | Fraction = -1


# Every `MambaSpec` setting of vLLM 0.32, served or refused, and why (docs/correctness.md: hybrid models). The
# start-up error of a refused one repeats its reason.
STATE_SETTINGS: dict[str, str] = {
    "mamba_type": (
        "served, every type (Mamba1, Mamba2, GDN, short conv, linear attention): a state block is opaque bytes "
        "copied whole; the type, shapes and dtypes are in the key's fingerprint"
    ),
    "mamba_cache_mode": (
        "served only as 'align': only then does vLLM hand kvpool the exact block holding a boundary's state "
        "(`boundary_state_offloads`); 'none' caches no prefix state and 'all' hands nothing over, so both are refused"
    ),
    "num_speculative_blocks": (
        "served only as 0; > 0 (speculative decoding with Mamba) is refused: the drafter's accepted-token "
        "shifts relocate state blocks in place, and kvpool has not shown a loaded state exact under them"
    ),
    "num_prefill_checkpoint_blocks / prefill_checkpoint_alignment": (
        "served: a prefill checkpoint is re-keyed by vLLM at its exact boundary before it is handed over; kvpool "
        "stores the handed-over whole-block boundaries and drops sub-block ones"
    ),
    "page_size_padded": (
        "served: the whole padded page is one chunk (the padding is never read by the engine); the page size "
        "is in the key's fingerprint"
    ),
    "tokens_per_state": (
        "served as -1 or 1 (one state per sequence); > 1 (a compressed state per several tokens, sparse "
        "attention indexers) is refused: it is not a prefix's recurrent state"
    ),
}


def _state(facts: SpecFacts) -> AttentionKind:
    mode = facts.state_cache_mode
    if mode != "align":
        raise LayoutError(
            f"KV cache spec {facts.type_name}(mamba_cache_mode={mode!r}) is not supported by kvpool: "
            f"{STATE_SETTINGS['mamba_cache_mode']}. Run with prefix caching on (vLLM then picks 'align' "
            "for hybrid models), or without the connector"
        )
    if facts.num_speculative_blocks:
        raise LayoutError(
            f"KV cache spec {facts.type_name}(num_speculative_blocks={facts.num_speculative_blocks}) is not "
            f"supported by kvpool: {STATE_SETTINGS['num_speculative_blocks']}. Run without speculative "
            "decoding, or without the connector"
        )
    if facts.tokens_per_state > 1:
        raise LayoutError(
            f"KV cache spec {facts.type_name}(tokens_per_state={facts.tokens_per_state}) is not supported by "
            f"kvpool: {STATE_SETTINGS['tokens_per_state']}. Run this model without the connector"
        )
    return StateSpace(facts.block_size)


# `tokens_per_state` on an attention spec (vLLM 0.32's `AttentionSpec`), served or refused, and why
# (docs/correctness.md: model families). The start-up error of a refused one repeats its reason.
COMPRESSION_SETTINGS: dict[str, str] = {
    "tokens_per_state = 1": "served: one state per token, the plain paged KV cache",
    "tokens_per_state > 1, a divisor of block_size": (
        "served by the spec's own kind (full, or sliding window in tokens): a block holds block_size / "
        "tokens_per_state whole compressed states, so every block boundary, and so every hit boundary (a "
        "multiple of the LCM of the groups' block sizes), ends a state: a stored block's states are final, "
        "and vLLM's managers keep and free blocks by token position whatever the compression"
    ),
    "tokens_per_state > 1, not a divisor of block_size": (
        "refused: a block would end inside a compressed state, whose bytes are written only when its last "
        "token is computed, so a block stored at a hit boundary would hold a state a later token changes"
    ),
    "tokens_per_state < 1": (
        "refused: several states per token (vLLM's Whisper block pooling) is not a causal token prefix "
        "kvpool has shown exact"
    ),
}


def _compression(facts: SpecFacts, kind: str) -> None:
    """LayoutError naming the spec and its `tokens_per_state` when kvpool cannot serve that compression
    with `kind` (the kind the spec's class maps to)."""
    ratio = facts.tokens_per_state
    if ratio in (-1, 1):
        return
    what = f"KV cache spec {facts.type_name}(block_size={facts.block_size}, tokens_per_state={ratio})"
    if not (isinstance(ratio, int) or (isinstance(ratio, Fraction) and ratio.denominator == 1)) or ratio < 1:
        raise LayoutError(
            f"{what} is not supported by kvpool: {COMPRESSION_SETTINGS['tokens_per_state < 1']}. Run this model "
            "without the connector"
        )
    if facts.block_size % int(ratio):
        raise LayoutError(
            f"{what} is not supported by kvpool: "
            f"{COMPRESSION_SETTINGS['tokens_per_state > 1, not a divisor of block_size']}. Choose a block size "
            f"that is a multiple of {ratio}, or run without the connector"
        )
    if kind == ChunkedLocal.name:
        raise LayoutError(
            f"{what} is not supported by kvpool: no vLLM model compresses chunked local attention, and kvpool "
            "has not shown it exact. Run this model without the connector"
        )


def _full(facts: SpecFacts) -> AttentionKind:
    _compression(facts, FullAttention.name)
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
    _compression(facts, SlidingWindow.name)
    return SlidingWindow(facts.block_size, facts.sliding_window, extra_retained=facts.extra_retained_tokens)


def _chunked(facts: SpecFacts) -> AttentionKind:
    if facts.attention_chunk_size is None:
        raise LayoutError(f"KV cache spec {facts.type_name} has no attention_chunk_size")
    _compression(facts, ChunkedLocal.name)
    return ChunkedLocal(facts.block_size, facts.attention_chunk_size)


# exact class names (vLLM 0.32) → kind; MLA variants differ only in the bytes of a block
SUPPORTED_SPECS: dict[str, Callable[[SpecFacts], AttentionKind]] = {
    "FullAttentionSpec": _full,
    "MLAAttentionSpec": _full,
    "SlidingWindowSpec": _sliding,
    "SlidingWindowMLASpec": _sliding,
    "ChunkedLocalAttentionSpec": _chunked,
    # served through vLLM's boundary-state hand-off only (`StateSpace`); see STATE_SETTINGS
    "MambaSpec": _state,
}

# known specs kvpool refuses, and why (the start-up error says it)
REFUSED_SPECS: dict[str, str] = {
    "RSWASpec": "the engine frees the decode gap blocks between the prompt and the window",
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
    naming `wrapper` (the engine's class for the group) when the layers differ in attention kind.

    Every layer is classified, so a layer the scheduler never sees is still refused by name at the
    workers' start-up: e.g. layers that differ in `tokens_per_state` (DeepSeek V4's group of the indexer
    and the c4 and c128 compressed caches: 4 and 128 at block size 256) are served, with the first
    layer's kind, only when every layer's compression divides the block size (`_compression`): then the
    kind does not depend on it and every hit boundary ends every layer's states."""
    if not layers:
        raise LayoutError(f"KV cache group {wrapper} lists no layers")
    kinds = {attention_kind(facts(layer)) for layer in layers}
    if len(kinds) > 1:
        raise LayoutError(f"KV cache group {wrapper} mixes attention kinds {sorted(map(repr, kinds))}")
    return layers[0]
