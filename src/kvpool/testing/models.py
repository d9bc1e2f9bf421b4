"""Tiny random Hugging Face checkpoints for real-engine tests, written locally (no download).

``make_tiny_model(kind, directory)`` writes a ~1M-parameter bf16 checkpoint that vLLM's CPU
backend can load. The configs are chosen so that a test on them can fail:

* ``llama``  -- ``LlamaForCausalLM``; ``initializer_range=0.1`` (HF's default 0.02 makes a tiny
  Llama collapse into a few repeated tokens that ignore the context, so a load test could not
  fail).
* ``gemma2`` -- ``Gemma2ForCausalLM``; sliding/full attention alternating, ``sliding_window=64``.
* ``gemma3`` -- ``Gemma3ForCausalLM`` (``Gemma3TextConfig``), ``sliding_window_pattern=2``
  (layers 0, 2 sliding; 1, 3 full), ``sliding_window=64``.
* ``mistral`` -- ``MistralForCausalLM`` with ``sliding_window=64`` on every layer: one
  sliding-window group, whose out-of-window blocks vLLM frees (null blocks in the table).
* ``granite-hybrid`` -- ``GraniteMoeHybridForCausalLM`` (Granite 4 family): Mamba2 layers 0 and 2,
  attention layers 1 and 3, no experts (a dense shared MLP), no position embedding. vLLM models
  it as one ``MambaSpec`` group and one full-attention group (hybrid attention + state space).
* ``llama-bench`` -- a ~100M-parameter Llama (hidden 1024, 8 layers) for end-to-end serving
  benchmarks, large enough that prefill dominates a request, with a tokenizer saved beside it
  (``tokenizer.json``): a word-level vocabulary of ``vocab_size`` words made with the
  ``tokenizers`` library, so that vLLM's benchmark client can generate text prompts with no
  download, and so that decoding random token ids and encoding the text again gives the same ids.
  ``llama-bench-tiny`` is the ``llama`` model with that tokenizer, for tests of the benchmark.

Gemma models tie the embeddings (vLLM has no ``lm_head`` for them otherwise) and keep the 0.02
init, at which they are context-sensitive (they collapse at 0.1). ``head_dim`` is 64: the CPU
attention backend supports only a fixed set of head sizes. Prompt token ids should be >= 3
(0/1/2 are bos/eos/pad).

Writing is idempotent and crash-safe: the checkpoint is written into a temporary sibling
directory and renamed into place, and an existing complete model is reused as is.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["MODEL_KINDS", "default_model_dir", "is_complete_model", "make_tiny_model", "model_config"]

MODEL_KINDS = (
    "llama",
    "gemma2",
    "gemma3",
    "mistral",
    "granite-hybrid",
    "llama-demo",
    "llama-bench",
    "llama-bench-tiny",
)
WITH_TOKENIZER = ("llama-bench", "llama-bench-tiny")

# Bumped whenever the generated weights/config change, so cached models are rebuilt.
_FORMAT_VERSION = 1
_MARKER = "kvpool_tiny_model.json"

_COMMON: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}
_GEMMA: dict[str, Any] = {  # hybrid: sliding-window and full-attention layers
    **_COMMON,
    "sliding_window": 64,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "query_pre_attn_scalar": 64,
}


def default_model_dir() -> Path:
    """Where tiny models are cached: ``$KVPOOL_MODEL_DIR`` or ``~/.cache/kvpool/models``."""
    env = os.environ.get("KVPOOL_MODEL_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvpool" / "models"


def model_config(kind: str) -> tuple[str, dict[str, Any]]:
    """(transformers config class name, config kwargs) for a tiny model ``kind``."""
    if kind == "llama":
        return "LlamaConfig", {**_COMMON, "initializer_range": 0.1, "tie_word_embeddings": False}
    if kind == "gemma2":
        return "Gemma2Config", {**_GEMMA}
    if kind == "gemma3":
        return "Gemma3TextConfig", {**_GEMMA, "sliding_window_pattern": 2}
    if kind == "mistral":
        return "MistralConfig", {
            **_COMMON,
            "sliding_window": 64,
            "initializer_range": 0.1,
            "tie_word_embeddings": False,
        }
    if kind == "granite-hybrid":
        return "GraniteMoeHybridConfig", {
            **_COMMON,
            "num_local_experts": 0,
            "shared_intermediate_size": 256,
            "layer_types": ["mamba", "attention", "mamba", "attention"],
            "position_embedding_type": "nope",
            "mamba_n_heads": 4,
            "mamba_d_head": 64,
            "mamba_d_state": 16,
            "mamba_n_groups": 1,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 64,
            "initializer_range": 0.1,
            "tie_word_embeddings": False,
        }
    if kind == "llama-demo":
        # larger, so prefill costs enough time for the demo's TTFT to show what a pool hit saves
        return "LlamaConfig", {
            **_COMMON,
            "hidden_size": 512,
            "intermediate_size": 1536,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "initializer_range": 0.05,
            "tie_word_embeddings": False,
        }
    if kind == "llama-bench":
        return "LlamaConfig", {
            **_COMMON,
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "vocab_size": 4096,
            "initializer_range": 0.05,
            "tie_word_embeddings": False,
        }
    if kind == "llama-bench-tiny":
        return model_config("llama")[0], model_config("llama")[1]
    raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {MODEL_KINDS}")


def _marker_payload(kind: str, seed: int) -> dict[str, Any]:
    return {"kind": kind, "seed": seed, "format": _FORMAT_VERSION}


def is_complete_model(path: Path, kind: str | None = None, seed: int | None = None) -> bool:
    """True if ``path`` holds a checkpoint written completely by :func:`make_tiny_model`
    (optionally for this ``kind`` / ``seed``)."""
    marker = path / _MARKER
    if not (marker.is_file() and (path / "config.json").is_file()):
        return False
    if not any(path.glob("*.safetensors")):
        return False
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if meta.get("format") != _FORMAT_VERSION:
        return False
    if kind is not None and meta.get("kind") != kind:
        return False
    return seed is None or meta.get("seed") == seed


def make_tiny_model(kind: str, directory: Path | str, *, seed: int = 0) -> Path:
    """Write (or reuse) a tiny random ``kind`` checkpoint at ``directory/<kind>-s<seed>``.

    Returns the model directory, loadable with ``vllm.LLM(model=str(path))``. Takes ~3-4 s the
    first time; later calls with the same arguments return immediately.
    """
    _, cfg_kwargs = model_config(kind)  # validates kind before any heavy import
    directory = Path(directory).expanduser()
    target = directory / f"{kind}-s{seed}"
    if is_complete_model(target, kind, seed):
        return target

    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{kind}-s{seed}.", suffix=".tmp", dir=directory))
    try:
        _write_checkpoint(kind, cfg_kwargs, tmp, seed)
        (tmp / _MARKER).write_text(json.dumps(_marker_payload(kind, seed)))
        tmp.chmod(0o755)  # mkdtemp creates 0700; the cache may be shared
        if target.exists():
            if is_complete_model(target, kind, seed):  # a concurrent writer finished first
                return target
            shutil.rmtree(target)  # stale or half-written by an older version
        try:
            os.rename(tmp, target)
        except OSError:
            if is_complete_model(target, kind, seed):  # lost a rename race to another writer
                return target
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_checkpoint(kind: str, cfg_kwargs: dict[str, Any], out: Path, seed: int) -> None:
    import torch
    import transformers

    cfg_cls_name, _ = model_config(kind)
    config = getattr(transformers, cfg_cls_name)(**cfg_kwargs)
    model_cls: Any = {
        "llama": transformers.LlamaForCausalLM,
        "llama-demo": transformers.LlamaForCausalLM,
        "llama-bench": transformers.LlamaForCausalLM,
        "llama-bench-tiny": transformers.LlamaForCausalLM,
        "gemma2": transformers.Gemma2ForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "granite-hybrid": transformers.GraniteMoeHybridForCausalLM,
    }[kind]
    torch.manual_seed(seed)
    model: Any = model_cls(config)
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    if kind in WITH_TOKENIZER:
        _write_word_tokenizer(out, int(cfg_kwargs["vocab_size"]))


def _write_word_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer: ids 0-2 are <s>, </s>, <pad>; every other id one distinct word.

    Words are split on whitespace and joined with one space, so any sequence of non-special ids
    decodes to a text that encodes back to the same ids (vLLM's prompt generators rely on that)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<s>", "</s>", "<pad>"]
    vocab = {token: i for i, token in enumerate(special)}
    vocab.update({f"w{i}": i for i in range(len(special), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(special)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>"
    )
    wrapped.save_pretrained(str(out))
