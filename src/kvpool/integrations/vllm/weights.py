"""A running vLLM engine's weight changes, told to kvpool's scheduler connector before they happen.

vLLM changes a running engine's weights only through its engine core, between engine steps: the utility
calls `collective_rpc` of `reload_weights`, the RL weight transfer (`start_weight_update`,
`update_weights`, `finish_weight_update` and their draft-model forms), `update_config` and `load_model`,
`apply_model` (a function run on the model), or any function a caller sends; and `set_weight_version`
labels the weights (`finish_weight_update(weight_version=...)` ends with it). Every entry point reaches
`EngineCore.collective_rpc` or `EngineCore.set_weight_version` in the process that runs the scheduler:
the offline `LLM`, `AsyncLLM`, `vllm serve`'s dev endpoints, in-process or multiprocess.

Invariants:
- kvpool hears of a change before the call runs (a call that fails partway may have changed weights), so
  the next step's metadata renames every key space (`weights_tag`): nothing stored before the change is
  found after it, and everything stored after it carries the new name. A worker runs calls in the order
  the engine sent them, so a step scheduled before the change runs on the old weights and saves under the
  old name; one scheduled after runs on the new weights (see `SchedulerRole.change_weights`).
- A new name is never reused for other weights: an unlabelled change gets a random one (KV stored after it
  is this engine's alone, never a restarted engine's), a label from `set_weight_version` becomes the name
  (engines that label the same weights alike share a pool: RL rollouts at one policy version).
- A call that cannot change weights (a string method not in `WEIGHT_METHODS`) changes nothing.
- The wrap is installed once per process, only where a kvpool scheduler connector runs, and calls vLLM's
  own method unchanged.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvpool.vllm")

# the worker methods through which vLLM 0.32 and 0.33 change the weights of a running engine
WEIGHT_METHODS = frozenset(
    {
        "reload_weights",
        "load_model",
        "update_config",
        "start_weight_update",
        "start_draft_weight_update",
        "update_weights",
        "finish_weight_update",
        "apply_model",
        "checkpoint_restore",
    }
)
_WRAPPED = "_kvpool_wraps"


def changes_weights(method: object) -> bool:
    """A call's method may change the weights: a named weight method, or any function a caller sends."""
    return method in WEIGHT_METHODS if isinstance(method, str) else callable(method)


def unlabelled_tag() -> str:
    return f"n{uuid.uuid4().hex[:16]}"


def labelled_tag(version: str) -> str:
    return f"v{version}"


def watch_engine_core() -> None:
    """Wrap vLLM's `EngineCore.collective_rpc` and `set_weight_version` once in this process."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # a vLLM without the V1 engine core: nothing to watch
        return
    _wrap(EngineCore, "collective_rpc", lambda args, kwargs: _rpc_tag(args, kwargs))
    _wrap(EngineCore, "set_weight_version", lambda args, kwargs: _version_tag(args, kwargs))


def _rpc_tag(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    method = args[0] if args else kwargs.get("method")
    return unlabelled_tag() if changes_weights(method) else None


def _version_tag(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    version = args[0] if args else kwargs.get("weight_version")
    return labelled_tag(str(version))


def _wrap(cls: type, name: str, tag_of: Callable[[tuple[Any, ...], dict[str, Any]], str | None]) -> None:
    original = getattr(cls, name, None)
    if original is None or getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        tag = tag_of(args, kwargs)
        if tag is not None:
            for connector in kvpool_connectors(self):
                connector.weights_changed(tag)
        return original(self, *args, **kwargs)

    setattr(wrapped, _WRAPPED, True)
    setattr(cls, name, wrapped)


def kvpool_connectors(engine_core: Any) -> list[Any]:
    """The kvpool scheduler connectors of an engine core (also inside vLLM's MultiConnector); by duck type,
    as the connector module imports this one."""
    scheduler = getattr(engine_core, "scheduler", None)
    top = scheduler.get_kv_connector() if scheduler is not None else None
    candidates = [top, *getattr(top, "_connectors", ())]
    return [c for c in candidates if type(c).__module__.startswith("kvpool.") and hasattr(c, "weights_changed")]
