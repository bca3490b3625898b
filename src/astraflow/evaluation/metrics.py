"""avg@k and pass@k from ``n`` scored samples per task.

pass@k is the unbiased estimator of "at least one of k samples solves the task" from ``n >= k``
samples of which ``c`` are correct: ``1 - C(n-c, k) / C(n, k)``, averaged over tasks. The
binomial ratio is evaluated as the product ``prod_{i=n-c+1}^{n} (1 - k/i)``, which never forms
the (astronomically large) binomial coefficients and stays accurate for any ``n``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["default_pass_at", "pass_at_k", "sampled_metrics"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with ``c`` correct samples out of ``n``.

    Raises ``ValueError`` unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: correct count {c} is outside 0..{n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: k={k} is outside 1..n={n}")
    if n - c < k:  # every draw of k samples holds a correct one
        return 1.0
    none_correct = 1.0
    for i in range(n - c + 1, n + 1):
        none_correct *= 1.0 - k / i
    return 1.0 - none_correct


def default_pass_at(k: int) -> list[int]:
    """The k values reported by default for ``k`` samples: 1, 2, 4, ... below k, and k."""
    values = []
    j = 1
    while j < k:
        values.append(j)
        j *= 2
    return [*values, k] if k >= 1 else []


def sampled_metrics(
    rewards: Sequence[Sequence[float]], *, threshold: float, pass_at: Sequence[int]
) -> dict[str, float]:
    """``avg@n`` (mean reward) and ``pass@j`` for each j in ``pass_at`` over tasks with ``n``
    rewards each; a sample with reward >= ``threshold`` counts as correct."""
    if not rewards:
        raise ValueError("sampled metrics need at least one task")
    n = len(rewards[0])
    if n == 0 or any(len(r) != n for r in rewards):
        raise ValueError("every task needs the same, non-zero number of samples")
    out = {f"avg@{n}": statistics.fmean(statistics.fmean(r) for r in rewards)}
    correct = [sum(1 for x in r if x >= threshold) for r in rewards]
    for j in pass_at:
        out[f"pass@{j}"] = statistics.fmean(pass_at_k(n, c, j) for c in correct)
    return out
