"""The statistics every comparison bench reports: intervals that cover, verdicts that can fail."""

from __future__ import annotations

import math
import random

import pytest

from kvpool.benchmarks.measure.stats import Interval, Verdict, ratio, rotation, spread, t95, verdict


def test_the_median_interval_is_the_range_below_six_rounds_and_order_statistics_from_then_on() -> None:
    assert spread([3.0, 1.0, 2.0]) == Interval(2.0, 1.0, 3.0, 3, exact=False)
    assert spread(list(range(1, 7))) == Interval(3.5, 1, 6, 6)
    ten = spread([float(v) for v in range(1, 11)])
    assert (ten.low, ten.high, ten.exact) == (2.0, 9.0, True)  # x(2), x(9): 97.9% coverage


def test_the_median_interval_covers_the_true_median_at_least_95_percent_of_the_time() -> None:
    rng = random.Random(3)
    misses = sum(
        not (interval.low <= 0.0 <= interval.high)
        for interval in (spread([rng.gauss(0, 1) for _ in range(12)]) for _ in range(2000))
    )
    assert misses / 2000 <= 0.05


def test_a_ratio_is_paired_so_drift_shared_by_a_round_cancels() -> None:
    drift = [1.0, 1.3, 0.8, 1.15, 0.9]
    interval = ratio([0.9 * d for d in drift], drift)
    assert interval.estimate == pytest.approx(0.9)
    assert interval.low == pytest.approx(0.9) and interval.high == pytest.approx(0.9)


def test_a_ratio_interval_covers_the_true_ratio_at_least_95_percent_of_the_time() -> None:
    rng = random.Random(5)
    misses = 0
    for _ in range(2000):
        base = [rng.lognormvariate(0, 0.2) for _ in range(5)]
        values = [b * 0.8 * rng.lognormvariate(0, 0.1) for b in base]
        interval = ratio(values, base)
        misses += not (interval.low <= 0.8 <= interval.high)
    assert misses / 2000 <= 0.06


def test_verdicts_pass_only_when_the_whole_interval_is_on_the_targets_side() -> None:
    assert verdict(Interval(0.8, 0.7, 0.89, 5), 0.9, at_most=True) is Verdict.PASS
    assert verdict(Interval(0.8, 0.7, 0.95, 5), 0.9, at_most=True) is Verdict.INCONCLUSIVE
    assert verdict(Interval(1.0, 0.95, 1.1, 5), 0.9, at_most=True) is Verdict.FAIL
    assert verdict(Interval(1.05, 1.01, 1.1, 5), 1.0, at_most=False) is Verdict.PASS
    assert verdict(Interval(0.9, 0.85, 0.99, 5), 1.0, at_most=False) is Verdict.FAIL
    assert verdict(Interval(0.5, 0.5, 0.5, 1, exact=False), 0.9, at_most=True) is Verdict.INCONCLUSIVE


def test_bad_input_is_refused_naming_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="rounds must pair"):
        ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="must be > 0"):
        ratio([0.0], [1.0])
    with pytest.raises(ValueError, match="at least one round"):
        spread([])
    with pytest.raises(ValueError, match="at least 2 rounds"):
        t95(0)


def test_t_quantiles_approach_the_normal() -> None:
    assert t95(1) == pytest.approx(12.706)
    assert t95(30) == pytest.approx(2.042)
    assert math.isclose(t95(1000), 1.96)


def test_each_system_runs_first_equally_often_across_rotations() -> None:
    systems = ["a", "b", "c"]
    firsts = [rotation(systems, r)[0] for r in range(6)]
    assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]
    assert all(sorted(rotation(systems, r)) == systems for r in range(6))


def test_median_ms_is_the_median_in_milliseconds_and_nothing_is_zero() -> None:
    from kvpool.benchmarks.measure.stats import median_ms

    assert median_ms([0.010, 0.0301234, 0.020]) == 20.0 and median_ms([0.0011111, 0.0022222]) == 1.67
    assert median_ms([]) == 0.0
