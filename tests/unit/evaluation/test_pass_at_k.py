"""The pass@k estimator against the closed form, avg@k, and the scoring settings' checks."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest

from astraflow.config import validate
from astraflow.errors import ConfigError
from astraflow.evaluation.config import ScoringSettings
from astraflow.evaluation.metrics import default_pass_at, pass_at_k, sampled_metrics


def closed_form(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(comb(n - c, k), comb(n, k))


def test_pass_at_k_equals_the_closed_form_on_every_small_count() -> None:
    for n in range(1, 17):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(closed_form(n, c, k)), abs=1e-12)


def test_pass_at_k_on_known_counts() -> None:
    assert pass_at_k(8, 1, 4) == pytest.approx(0.5)  # half of the 4-subsets hold the one
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(4, 2, 3) == 1.0  # any 3 of 4 include a correct one
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)


def test_pass_at_k_stays_exact_where_the_binomials_overflow_a_float() -> None:
    n, c, k = 2000, 7, 400
    with pytest.raises(OverflowError):
        float(comb(n, k))
    exact = float(closed_form(n, c, k))
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    assert 0.7 < exact < 0.9


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_rejects_impossible_counts(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        pass_at_k(n, c, k)


def test_sampled_metrics_average_tasks() -> None:
    rewards = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    got = sampled_metrics(rewards, threshold=1.0, pass_at=[1, 2, 4])
    assert got["avg@4"] == pytest.approx(5 / 12)
    assert got["pass@1"] == pytest.approx(5 / 12)
    assert got["pass@2"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert got["pass@4"] == pytest.approx(2 / 3)
    # partial rewards count in avg@k; only those at the threshold count as solved
    got = sampled_metrics([[0.5, 1.0]], threshold=1.0, pass_at=[1])
    assert got == {"avg@2": pytest.approx(0.75), "pass@1": pytest.approx(0.5)}
    with pytest.raises(ValueError, match="same"):
        sampled_metrics([[1.0], [1.0, 0.0]], threshold=1.0, pass_at=[1])


def test_default_pass_at_and_settings_checks() -> None:
    assert default_pass_at(8) == [1, 2, 4, 8]
    assert default_pass_at(6) == [1, 2, 4, 6]
    assert default_pass_at(1) == [1] and default_pass_at(0) == []
    with pytest.raises(ConfigError, match=r"pass_at values \[16\] must lie in 1..k"):
        validate(ScoringSettings, {"k": 8, "pass_at": [1, 16]}, source="eval")
    with pytest.raises(ConfigError, match="nothing to measure"):
        validate(ScoringSettings, {"greedy": False}, source="eval")
