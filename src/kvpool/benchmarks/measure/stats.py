"""Figures over interleaved rounds: an estimate with a 95% interval, and verdicts that can fail.

A bench runs every system once per round, in an order that rotates from round to round, so drift of
the machine (a 2-core host drifts 15-30% over one `vllm serve` run) lands on every system alike.

* `spread(values)`: one system's figure across rounds: the median, with the distribution-free 95%
  interval of the median (order statistics of the binomial; below 6 rounds no such interval reaches
  95%, so the range of the rounds stands in, and `exact` says so).
* `ratio(values, baseline)`: a system against a baseline measured in the same rounds: the per-round
  ratios, their geometric mean, and a Student-t 95% interval on their logarithms (paired: the round's
  drift cancels in its ratio). Ratios are what targets are stated in.
* `verdict(interval, limit, at_most)`: PASS when the whole interval is on the target's side of the
  limit, FAIL when it is wholly on the other side, INCONCLUSIVE otherwise: never a verdict the data
  cannot support.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

# two-sided 95% quantiles of Student's t, by degrees of freedom (1..30); beyond 30 the normal's 1.96
# is within 4%
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
    2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


class Verdict(enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    INCONCLUSIVE = "INCONCLUSIVE"


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    rounds: int
    exact: bool = True  # False: too few rounds for a 95% interval; low..high is the rounds' range

    def as_dict(self, digits: int = 4) -> dict[str, Any]:
        out = asdict(self)
        for name in ("estimate", "low", "high"):
            out[name] = round(out[name], digits)
        return out

    def __str__(self) -> str:
        mark = "" if self.exact else " (range)"
        return f"{self.estimate:.3g} [{self.low:.3g}, {self.high:.3g}]{mark}"


def t95(degrees: int) -> float:
    if degrees < 1:
        raise ValueError(f"degrees of freedom {degrees}: a t interval needs at least 2 rounds")
    return _T95[degrees - 1] if degrees <= len(_T95) else 1.96


def spread(values: Sequence[float]) -> Interval:
    """The median of `values` with its distribution-free 95% interval (the range below 6 rounds)."""
    if not values:
        raise ValueError("spread of no rounds: every cell needs at least one round")
    ordered = sorted(values)
    n = len(ordered)
    median = statistics.median(ordered)
    if n < 6:
        return Interval(median, ordered[0], ordered[-1], n, exact=False)
    # the largest k with P(Binomial(n, 1/2) < k) <= 2.5%: [x_(k), x_(n+1-k)] covers the median >= 95%
    k, below = 0, 0.0
    while True:
        below_next = below + math.comb(n, k) / 2**n
        if below_next > 0.025:
            break
        below, k = below_next, k + 1
    return Interval(median, ordered[k - 1], ordered[n - k], n)


def ratio(values: Sequence[float], baseline: Sequence[float]) -> Interval:
    """`values` ÷ `baseline`, paired round by round: the geometric mean ratio with a t interval."""
    if len(values) != len(baseline) or not values:
        raise ValueError(f"ratio of {len(values)} rounds to {len(baseline)}: rounds must pair one to one")
    if min(values) <= 0 or min(baseline) <= 0:
        raise ValueError(f"ratio of {list(values)} to {list(baseline)}: every figure must be > 0")
    logs = [math.log(value / base) for value, base in zip(values, baseline)]
    mean = statistics.fmean(logs)
    if len(logs) == 1:
        return Interval(math.exp(mean), math.exp(mean), math.exp(mean), 1, exact=False)
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return Interval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(logs))


def verdict(interval: Interval, limit: float, at_most: bool) -> Verdict:
    """Is the target (`<= limit` when `at_most`, else `>= limit`) met by the whole interval?"""
    if interval.rounds < 2:
        return Verdict.INCONCLUSIVE  # one round has no interval
    good_side = interval.high <= limit if at_most else interval.low >= limit
    bad_side = interval.low > limit if at_most else interval.high < limit
    if good_side:
        return Verdict.PASS
    if bad_side:
        return Verdict.FAIL
    return Verdict.INCONCLUSIVE


def rotation(systems: Sequence[str], round_index: int) -> list[str]:
    """The order of `systems` in a round: rotated by one each round, so each runs first as often."""
    shift = round_index % len(systems) if systems else 0
    return list(systems[shift:]) + list(systems[:shift])


def median_ms(seconds: Sequence[float]) -> float:
    """The median of `seconds` in milliseconds, to 0.01 ms (0.0: none)."""
    return round(statistics.median(seconds) * 1000, 2) if seconds else 0.0
