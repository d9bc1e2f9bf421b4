"""Shared by the test suites that need a real Mooncake install."""

from __future__ import annotations


def mooncake_or_skip() -> None:
    """Skip when Mooncake is not installed; a broken install still fails loudly in the backend tests."""
    import pytest

    from kvpool.backends.mooncake import load_store_module
    from kvpool.backends.mooncake.master import find_master_binary
    from kvpool.core.errors import BackendUnavailableError

    try:
        load_store_module()
        find_master_binary()
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
