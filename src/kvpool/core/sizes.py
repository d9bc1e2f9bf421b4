"""Byte counts in settings: one parser for every size key, kvpool's and Mooncake's.

Units follow the common convention: kB/KB, MB, GB, TB are powers of 1000 and KiB, MiB, GiB, TiB
powers of 1024 (so "8GB" is 8 * 10**9 bytes and "8GiB" is 8 * 2**30). A bare letter (k, m, g, t) is
refused: it is read both ways in the wild. Units are case-insensitive; a space before them is fine.
"""

from __future__ import annotations

import re
from typing import Any

from kvpool.core.errors import ConfigError

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(key: str, value: Any, *, allow_zero: bool = False) -> int:
    """Bytes from an int or a string such as "512MiB", "4 GB" or "1048576"; zero only if `allow_zero`."""
    amount: float | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        amount = value
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if match and match.group(2).lower() in UNITS:
            amount = float(match.group(1)) * UNITS[match.group(2).lower()]
    if amount is not None and (amount > 0 or (allow_zero and amount == 0)):
        return int(amount)
    lowest = "a non-negative" if allow_zero else "a positive"
    raise ConfigError(
        key,
        value,
        f"{lowest} byte count: an integer or a string like '512MiB' or '4GB' "
        "(KB/MB/GB/TB = 1000^n, KiB/MiB/GiB/TiB = 1024^n)",
    )
