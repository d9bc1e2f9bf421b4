"""Real vLLM CPU engines for tests and the demo, plus tie-aware greedy comparison.

The settings, the shutdown order and the tie handling below are what vLLM's CPU build needs.

* :func:`engine` -- context manager yielding a ``vllm.LLM`` built with the CPU-safe settings
  (``kv_cache_memory_bytes`` set, block size a multiple of 32, ``enforce_eager``,
  ``skip_tokenizer_init``) and **always** shut down on exit, in-process by default or with
  ``multiprocess=True``.
* :func:`generate_greedy` -- greedy generation from token-id prompts that also returns
  ``num_cached_tokens`` and the per-step top-2 (log)probs.
* :func:`assert_same_greedy` -- compares two runs exactly, tolerating a divergence only at a
  step where both runs had a near-tie (see the function for the tie rule).

Per-engine multiprocessing switch (what vLLM 0.32 reads, and when):

* ``LLMEngine.from_engine_args`` reads ``vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING`` at
  construction time, and the CPU platform reads
  ``os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]`` directly in ``check_and_update_config``
  (and switches the executor to ``mp``). Both happen inside
  ``LLM(...)``, so the variable only has to be right *while the engine is constructed*.
* But ``vllm.envs`` values are memoised: an in-process ``EngineCore.__init__`` calls
  ``enable_envs_cache()``, which freezes every ``envs.*`` read
  for the rest of the process. After one in-process engine, flipping ``os.environ`` alone would
  no longer switch the next engine to multi-process (and vice versa). :func:`engine` therefore
  calls ``vllm.envs.disable_envs_cache()`` before each construction (the teardown's
  ``cleanup_dist_env_and_memory`` does too), sets the variable for the construction only, and
  restores the previous value afterwards. In- and multi-process engines can thus alternate in
  one process (verified: in-process -> multi-process -> in-process in one Python process gives
  ``InprocClient`` / ``SyncMPClient`` / ``InprocClient`` engine cores and identical outputs).

Teardown (reference §5): ``engine_core.shutdown()`` (calls both connectors' ``shutdown``;
multi-process: stops the EngineCore and worker processes), ``ensure_kv_transfer_shutdown()``
(clears the process-global worker connector that the next in-process engine would otherwise
silently reuse), drop the reference, ``cleanup_dist_env_and_memory()`` (which ``gc.unfreeze()``s
and collects: an in-process EngineCore ``gc.freeze()``s the whole heap at startup, so without it
the old engine's reference cycles would never be collected). RSS stays flat over repeated
in-process engines. The ``with`` target still names the dead ``LLM`` after the block: do not use it.

Garbage collection is most of an in-process engine's start and stop here: a full collection walks
every object of torch, vLLM and transformers (~0.5 s a collection on the 2-core machine), and vLLM
collects five times while it starts and twice while it stops. :func:`engine` therefore
``gc.freeze()``s the heap just before it builds the engine, so the start's collections walk only
the new engine's objects. It changes nothing an engine would not do itself: its EngineCore freezes
the whole heap (everything alive then, garbage included) at the end of its start, and its shutdown
unfreezes and collects it all. After a shutdown that ran to its end the teardown collects no more
(vLLM's shutdown has); after a failed one it runs ``cleanup_dist_env_and_memory`` itself.
"""

from __future__ import annotations

import gc
import math
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLM

__all__ = [
    "DEFAULT_KV_CACHE_MEMORY_BYTES",
    "DEFAULT_TIE_EPS",
    "DEFAULT_TIE_ULPS",
    "GreedyResult",
    "TieSummary",
    "assert_same_greedy",
    "dtype_ulp",
    "engine",
    "generate_greedy",
    "shutdown_engine",
]

DEFAULT_KV_CACHE_MEMORY_BYTES = 128 * 2**20
_MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# Engine construction mutates process-global state (env vars, the worker connector global,
# torch.distributed); serialise it.
_CONSTRUCT_LOCK = threading.Lock()
# In-process engines currently alive (at most one: vLLM's worker connector is process-global).
_live_inprocess = 0


@contextmanager
def engine(
    model_dir: str | Path,
    *,
    kv_transfer_config: Mapping[str, Any] | Any | None = None,
    block_size: int = 64,
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES,
    max_model_len: int = 2048,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    multiprocess: bool = False,
    dtype: str = "bfloat16",
    seed: int = 0,
    logprobs_mode: str = "raw_logits",
    **extra: Any,
) -> Iterator[LLM]:
    """Build a ``vllm.LLM`` on the CPU backend and shut it down on exit, whatever happens.

    ``kv_transfer_config`` is a ``KVTransferConfig`` or a dict of its fields, e.g.
    ``{"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.integrations.vllm",
    "kv_role": "kv_both", "kv_connector_extra_config": {...}}``. ``extra`` is passed to
    ``LLM(...)`` unchanged (e.g. ``enable_prefix_caching=False``, ``disable_hybrid_kv_cache_manager``).

    ``logprobs_mode`` defaults to ``"raw_logits"`` (vLLM's own default is ``"raw_logprobs"``):
    the per-step values returned as "logprobs" are then the model's logits, whose magnitude lets
    :func:`assert_same_greedy` express near-ties in ulps of the model dtype. Greedy tokens do
    not depend on the mode.

    ``multiprocess=False`` (default) runs EngineCore, scheduler and worker in this process; only
    one such engine may be alive at a time (RuntimeError otherwise). ``True`` spawns EngineCore
    and worker processes (12-16 s startup on 2 cores) and may overlap an in-process engine.
    Scripts using ``multiprocess=True`` need an ``if __name__ == "__main__":`` guard (spawn);
    pytest does not.
    """
    if block_size % 32:
        raise ValueError(f"block_size must be a multiple of 32 on the CPU backend, got {block_size}")
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "enforce_eager": True,
        "skip_tokenizer_init": True,
        "seed": seed,
        "block_size": block_size,
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
        "logprobs_mode": logprobs_mode,
    }
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    kwargs.update(extra)

    global _live_inprocess
    with _CONSTRUCT_LOCK:
        if not multiprocess and _live_inprocess:
            raise RuntimeError(
                "another in-process vLLM engine is still running in this process; vLLM keeps "
                "process-global state (the worker KV connector, torch.distributed groups), so exit "
                "its `with engine(...)` block first or use multiprocess=True"
            )
        previous = os.environ.get(_MP_ENV)
        os.environ[_MP_ENV] = "1" if multiprocess else "0"
        try:
            import vllm.envs as vllm_envs

            # An earlier in-process EngineCore memoised every envs.* read; re-read os.environ.
            vllm_envs.disable_envs_cache()
            from vllm import LLM
            from vllm.config import KVTransferConfig

            if kv_transfer_config is not None:
                if isinstance(kv_transfer_config, Mapping):
                    kv_transfer_config = KVTransferConfig(**dict(kv_transfer_config))
                kwargs["kv_transfer_config"] = kv_transfer_config
            if not multiprocess:
                # Never reuse a worker connector left behind by an engine not shut down properly.
                _drop_worker_connector()
                gc.freeze()  # the start's collections walk the new engine only (see the module docstring)
            llm = LLM(**kwargs)
            if not multiprocess:
                _live_inprocess += 1
        except BaseException:
            _teardown_process_state(multiprocess)
            raise
        finally:
            if previous is None:
                os.environ.pop(_MP_ENV, None)
            else:
                os.environ[_MP_ENV] = previous
            try:
                import vllm.envs as vllm_envs

                vllm_envs.disable_envs_cache()
            except ImportError:  # pragma: no cover - vllm missing: LLM import already failed
                pass
    shut_down = False
    try:
        yield llm
    finally:
        try:
            shutdown_engine(llm)
            shut_down = not multiprocess
        finally:
            del llm
            with _CONSTRUCT_LOCK:
                if not multiprocess:
                    _live_inprocess -= 1
                _teardown_process_state(multiprocess, shut_down)


def shutdown_engine(llm: LLM) -> None:
    """Shut an engine's core down (reference §5, first step); safe to call twice.

    In-process this runs the scheduler's shutdown (scheduler connector ``shutdown``) and the
    worker's (worker connector ``shutdown``); multi-process it stops the EngineCore and worker
    processes. :func:`engine` does this and the process-global cleanup for you.
    """
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()


def _drop_worker_connector() -> None:
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()


def _teardown_process_state(multiprocess: bool = False, shut_down: bool = False) -> None:
    """Process-global cleanup after an engine is gone (reference §5, remaining steps).

    `shut_down`: an in-process EngineCore's shutdown ran to its end, and with it vLLM's own
    `cleanup_dist_env_and_memory` (unfreeze, distributed state destroyed, a full collection): only
    the worker connector is left to drop; what it leaves in cycles goes at the next collection."""
    if multiprocess and _live_inprocess:
        # The process-global state belongs to a live in-process engine: leave it alone.
        gc.collect()
        return
    try:
        _drop_worker_connector()
    finally:
        import vllm.envs as vllm_envs
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        if shut_down:
            gc.unfreeze()  # already done by the shutdown; cheap, and what the next engine assumes
            vllm_envs.disable_envs_cache()
        else:
            # Also disables the envs cache and gc.unfreeze()s what EngineCore froze at startup
            # (freeze_gc_heap), so the old engine's reference cycles can actually be collected.
            cleanup_dist_env_and_memory()


# ---------------------------------------------------------------------------------------------
# Greedy generation
# ---------------------------------------------------------------------------------------------

_LOGIT_MODES = ("raw_logits", "processed_logits")


@dataclass
class GreedyResult:
    """One prompt's greedy output.

    ``top[i]`` is step i's top-k as ``[(token_id, value), ...]``, best first (ties by token id).
    ``value_kind`` is the engine's ``logprobs_mode``: with ``raw_logits`` (the :func:`engine`
    default) values are logits, otherwise log-probabilities. ``dtype`` is the model dtype.
    """

    token_ids: list[int]
    num_cached_tokens: int
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    value_kind: str = "raw_logits"
    dtype: str = "bfloat16"

    @property
    def first_token(self) -> int:
        return self.token_ids[0]


def _engine_model_config(llm: LLM) -> Any:
    eng = llm.llm_engine
    cfg = getattr(eng, "model_config", None)
    if cfg is None:
        cfg = eng.vllm_config.model_config
    return cfg


def generate_greedy(
    llm: LLM,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    logprobs: int = 2,
) -> list[GreedyResult]:
    """Greedy-decode token-id ``prompts`` (``ignore_eos``, no detokenisation), in input order.

    All prompts go into one ``generate`` call (the scheduler batches them as it admits them).
    ``logprobs`` top entries are recorded per step (0 records none).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
        logprobs=logprobs if logprobs > 0 else None,
    )
    model_config = _engine_model_config(llm)
    value_kind = str(getattr(model_config, "logprobs_mode", "raw_logprobs"))
    dtype = str(getattr(model_config, "dtype", "bfloat16")).removeprefix("torch.")
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    results = []
    for out in outs:
        completion = out.outputs[0]
        top: list[list[tuple[int, float]]] = []
        for step in completion.logprobs or ():
            entries = sorted(((tok, lp.logprob) for tok, lp in step.items()), key=lambda e: (-e[1], e[0]))
            top.append(entries[:logprobs])
        results.append(
            GreedyResult(
                token_ids=list(completion.token_ids),
                num_cached_tokens=int(out.num_cached_tokens or 0),
                top=top,
                value_kind=value_kind,
                dtype=dtype,
            )
        )
    return results


# ---------------------------------------------------------------------------------------------
# Tie-aware comparison
# ---------------------------------------------------------------------------------------------

# Explicit mantissa bits per model dtype: one ulp of x is 2**(floor(log2|x|) - bits).
_MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}
# Default near-tie width in ulps of the dtype (see assert_same_greedy for the measurements).
DEFAULT_TIE_ULPS = {"bfloat16": 6.0, "float16": 48.0, "float32": 128.0}
# Fallback width when values are log-probabilities (logit magnitude unknown).
DEFAULT_TIE_EPS = 2.0**-4


def dtype_ulp(x: float, dtype: str = "bfloat16") -> float:
    """One unit in the last place of ``x`` in ``dtype`` (bf16: 8 significant bits)."""
    bits = _MANTISSA_BITS.get(dtype, 7)
    if x == 0 or not math.isfinite(x):
        return 0.0 if x == 0 else math.inf
    return 2.0 ** (math.floor(math.log2(abs(x))) - bits)


@dataclass
class TieSummary:
    """What :func:`assert_same_greedy` compared and accepted."""

    num_sequences: int
    num_identical: int = 0
    # Decode steps compared (token positions up to and including the first divergence).
    num_steps: int = 0
    # (sequence index, step, gap_a, gap_b, tie width) per divergence accepted at a near-tie.
    tie_divergences: list[tuple[int, int, float, float, float]] = field(default_factory=list)

    @property
    def num_tie_divergences(self) -> int:
        return len(self.tie_divergences)

    @property
    def tie_fraction(self) -> float:
        """Fraction of sequences that diverged (at a near-tie)."""
        return self.num_tie_divergences / self.num_sequences if self.num_sequences else 0.0

    @property
    def tie_step_rate(self) -> float:
        """Accepted divergences per compared decode step."""
        return self.num_tie_divergences / self.num_steps if self.num_steps else 0.0


def _gap_and_width(res: GreedyResult, step: int, tie_ulps: float | None, tie_eps: float) -> tuple[float, float]:
    if step >= len(res.top) or len(res.top[step]) < 2:
        return math.inf, 0.0  # no top-2 recorded: a divergence here cannot be excused
    (_, v1), (_, v2) = res.top[step][0], res.top[step][1]
    gap = v1 - v2
    if res.value_kind in _LOGIT_MODES:
        ulps = tie_ulps if tie_ulps is not None else DEFAULT_TIE_ULPS.get(res.dtype, DEFAULT_TIE_ULPS["bfloat16"])
        width = ulps * dtype_ulp(max(abs(v1), abs(v2)), res.dtype)
    else:
        width = tie_eps
    return gap, width


def assert_same_greedy(
    a: Sequence[GreedyResult],
    b: Sequence[GreedyResult],
    *,
    tie_ulps: float | None = None,
    tie_eps: float = DEFAULT_TIE_EPS,
    max_tie_fraction: float = 1.0,
) -> TieSummary:
    """Assert two greedy runs of the same prompts agree, tie-aware (reference §11).

    Per sequence:

    1. The first generated token must be equal: prefill is bit-exact across batch composition,
       chunking and prefix hits (verified: first-step top-2 logits bit-identical), so no
       tolerance at step 0.
    2. Every later token must be equal, except that a divergence is accepted at a step where
       **both** runs had a near-tie between their top-2 candidates and all earlier tokens agreed.
       After an accepted divergence the rest of that sequence is not compared (the contexts
       differ from there on).
    3. Lengths must be equal unless an accepted divergence came first.

    Near-tie width. vLLM computes logits in the model dtype and the CPU sampler upcasts them,
    so with ``logprobs_mode="raw_logits"`` (the :func:`engine` default) each value is a bf16
    number and the top-2 gap is a whole number of ulps (one bf16 ulp = 2^(floor(log2|l|) - 7):
    2^-6 for the tiny Llama's |logit| in [2, 4), 2^-8..2^-7 for Gemma2's [0.5, 2)). Measured on
    the tiny models, 24 prompts x 64 tokens, batch of 24 vs one-by-one vs
    ``max_num_batched_tokens=96`` vs ``max_num_seqs=5``, no connector: matching logits drift by at
    most 3 ulps between batch compositions, and the 24+ observed flips had gaps of 0-4 ulps in
    the run with the larger gap (0-2 in the other). A flip of two candidates needs
    gap_a + gap_b <= their combined drift (<= 6 ulps), so the default width is **6 ulps** of
    the larger of the two logits (``tie_ulps``; fp32 128 ulps: measured drift <= 34 fp32 ulps,
    no flips at all). A fixed 1e-3 would only excuse exact ties (1 ulp >= 2^-8 here) and make
    batch-sensitive tests flaky; anything much wider would start excusing real KV errors.
    With log-probabilities (other ``logprobs_mode``) the logit scale is unknown and the
    absolute ``tie_eps`` (default 2^-4 = 4 ulps at |logit| in [2, 4)) is used instead.

    Near-ties are not rare in tiny random models (Llama: 6% of steps within 1 ulp, 10% within
    2), so long generations under different batching diverge often (19/24 sequences at 64
    tokens, one-by-one vs batched). Compare 16-token outputs, or bound ``max_tie_fraction``,
    and use :attr:`TieSummary.tie_step_rate` to assert divergences stay rare.
    """
    assert len(a) == len(b), f"different number of sequences: {len(a)} vs {len(b)}"
    summary = TieSummary(num_sequences=len(a))
    for i, (ra, rb) in enumerate(zip(a, b)):
        ta, tb = ra.token_ids, rb.token_ids
        assert ta and tb, f"sequence {i}: empty output ({len(ta)} vs {len(tb)} tokens)"
        assert ta[0] == tb[0], (
            f"sequence {i}: first tokens differ ({ta[0]} vs {tb[0]}); prefill must be exact. "
            f"top a={ra.top[:1]} b={rb.top[:1]}"
        )
        if ta == tb:
            summary.num_identical += 1
            summary.num_steps += len(ta)
            continue
        for step in range(1, min(len(ta), len(tb))):
            if ta[step] == tb[step]:
                continue
            summary.num_steps += step + 1
            gap_a, width_a = _gap_and_width(ra, step, tie_ulps, tie_eps)
            gap_b, width_b = _gap_and_width(rb, step, tie_ulps, tie_eps)
            width = max(width_a, width_b)
            assert gap_a <= width and gap_b <= width, (
                f"sequence {i}: tokens diverge at step {step} ({ta[step]} vs {tb[step]}) without a "
                f"near-tie in both runs (top-2 gaps {gap_a:.6g} / {gap_b:.6g}, tie width {width:.3g}); "
                f"a={ta} b={tb} top_a={ra.top[step]} top_b={rb.top[step]}"
            )
            summary.tie_divergences.append((i, step, gap_a, gap_b, width))
            break
        else:
            raise AssertionError(f"sequence {i}: lengths differ ({len(ta)} vs {len(tb)}) with equal prefix")
    assert summary.tie_fraction <= max_tie_fraction, (
        f"{summary.num_tie_divergences}/{summary.num_sequences} sequences diverged at near-ties "
        f"(allowed fraction {max_tie_fraction}): {summary.tie_divergences}"
    )
    return summary
