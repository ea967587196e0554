"""Medians of short windows, as the detector and the verdicts use them.

Plain sorts over Python floats: at the window sizes here (tens of values) they beat
numpy's overhead, and they take any iterable, generators included.
"""

from __future__ import annotations

from typing import Iterable


def median(values: Iterable[float]) -> float:
    """The median of ``values``: the middle one, or the mean of the two middle ones for
    an even count. Raises ValueError for no values."""
    s = sorted(values)
    n = len(s)
    if n == 0:
        raise ValueError("median of an empty window")
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def low_median(values: Iterable[float]) -> float:
    """The lower of the two middle values for an even count (the middle one for an odd
    count): always one of ``values``, never an average of a spike and a healthy value.
    Raises ValueError for no values."""
    s = sorted(values)
    if not s:
        raise ValueError("median of an empty window")
    return s[(len(s) - 1) // 2]


def upper_half_median(values: Iterable[float]) -> float:
    """The median of the values at or above the median: the centre of the faster half
    when larger is faster (FLOP/s). Raises ValueError for no values."""
    vals = list(values)
    mid = median(vals)
    return median(v for v in vals if v >= mid)


def lower_half_median(values: Iterable[float]) -> float:
    """The median of the values at or below the median: the centre of the faster half
    when smaller is faster (seconds). Raises ValueError for no values."""
    return -upper_half_median(-v for v in values)
