"""The Mooncake store client module, imported on first use so kvpool works without Mooncake installed.

Invariant: `mooncake.store` is imported here only, and a failed import is a BackendUnavailableError
that says how to install it.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from kvpool.backends.mooncake.master import INSTALL_HINT
from kvpool.core.errors import BackendUnavailableError


def load_store_module() -> Any:
    """`mooncake.store`, imported on first use so kvpool works without Mooncake installed."""
    try:
        from mooncake import store
    except (ImportError, OSError) as exc:  # OSError: libibverbs.so.1 missing on some loaders
        raise BackendUnavailableError(
            f"the mooncake backend needs the Mooncake store client: {INSTALL_HINT}; "
            f"importing mooncake.store failed: {exc}"
        ) from exc
    return store


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
