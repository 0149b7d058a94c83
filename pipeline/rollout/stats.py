"""Confidence bounds of binomial proportions and of their difference (pure, no state).

Sources: E. B. Wilson (1927), the score interval; R. G. Newcombe (1998), "Interval estimation for
the difference between independent proportions", method 10 (the hybrid score interval built from
the two arms' Wilson intervals).
"""

from __future__ import annotations

import math


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% two-sided for ``z`` = 1.96), as
    ``(low, high)`` in [0, 1].

    The interval holds every p with ``|successes/n - p| <= z * sqrt(p (1 - p) / n)`` (E. B.
    Wilson, 1927): unlike the normal approximation it stays inside [0, 1] and is not empty at
    0 or n successes. ``n`` = 0 gives ``(0, 1)``. Raises ValueError if ``successes`` is not in
    [0, n] or ``z`` < 0.
    """
    if z < 0:
        raise ValueError(f"z must be >= 0, got {z}")
    if n == 0:
        return 0.0, 1.0
    if not 0 <= successes <= n:
        raise ValueError(f"successes {successes} not in [0, {n}]")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_difference(s1: int, n1: int, s2: int, n2: int, z: float) -> tuple[float, float]:
    """Bounds ``(low, high)`` on ``p1 - p2`` (arm 1 minus arm 2, in [-1, 1]) from the two arms'
    Wilson intervals at ``z`` (Newcombe 1998, method 10)::

        low  = d - sqrt((p1 - l1)^2 + (u2 - p2)^2)
        high = d + sqrt((u1 - p1)^2 + (p2 - l2)^2)

    with ``d = p1 - p2``. Each bound read alone is one-sided at the level of ``z`` (``z`` =
    1.645: ``P(p1 - p2 < low) ~ 5%``). An arm with ``n`` = 0 gives ``(-1, 1)``. Raises
    ValueError as :func:`wilson_interval`.
    """
    if n1 == 0 or n2 == 0:
        return -1.0, 1.0
    l1, u1 = wilson_interval(s1, n1, z)
    l2, u2 = wilson_interval(s2, n2, z)
    p1, p2 = s1 / n1, s2 / n2
    d = p1 - p2
    return (max(-1.0, d - math.hypot(p1 - l1, u2 - p2)), min(1.0, d + math.hypot(u1 - p1, p2 - l2)))
