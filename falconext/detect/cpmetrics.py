"""Change-point scores against several annotators: F1 with a margin, and covering.

The two metrics of the Turing change-point benchmark (van den Burg and Williams, 2020),
written from their definitions, for judging a detector as a general change-point method:

- **F1**: every annotator's change points and the predictions both include the series'
  start (index 0). An annotation is a true positive when a prediction lies within
  ``margin`` of it, each prediction matching one annotation at most (the closest first).
  Precision is the share of predictions matched against the union of every annotator's
  change points (so at most 1); recall is the mean over annotators of the share of their
  annotations matched.
- **Cover**: a partition's covering of another is the mean, weighted by segment length,
  of each true segment's best Jaccard overlap with a predicted segment; the score is the
  mean over annotators of the prediction's covering of their partition.

Pure functions over index lists.
"""

from __future__ import annotations

from typing import Mapping, Sequence


def _points(cps: Sequence[int], n: int) -> list[int]:
    """Sorted distinct change points inside [0, n), with 0 added."""
    for c in cps:
        if not 0 <= int(c) < n:
            raise ValueError(f"change point {c} outside the series of {n} points")
    return sorted({0, *(int(c) for c in cps)})


def true_positives(truth: Sequence[int], predicted: Sequence[int], margin: int = 5) -> set[int]:
    """The annotations in ``truth`` that a prediction within ``margin`` matches, each
    prediction used once, the closest prediction first (ties: the earlier)."""
    left = sorted(set(predicted))
    hit: set[int] = set()
    for tau in sorted(set(truth)):
        close = [(abs(tau - x), x) for x in left if abs(tau - x) <= margin]
        if close:
            _, x = min(close)
            hit.add(tau)
            left.remove(x)
    return hit


def f1(annotations: Mapping[str, Sequence[int]], predicted: Sequence[int], n: int, margin: int = 5) -> float:
    """F1 of ``predicted`` against every annotator's change points (module docstring).
    Raises ValueError for no annotator or a point outside the series."""
    if not annotations:
        raise ValueError("no annotator")
    x = _points(predicted, n)
    union: set[int] = set()
    recalls = []
    for cps in annotations.values():
        t = _points(cps, n)
        union |= set(t)
        recalls.append(len(true_positives(t, x, margin)) / len(t))
    precision = len(true_positives(sorted(union), x, margin)) / len(x)
    recall = sum(recalls) / len(recalls)
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def _segments(cps: Sequence[int], n: int) -> list[tuple[int, int]]:
    bounds = _points(cps, n) + [n]
    return [(a, b) for a, b in zip(bounds, bounds[1:])]


def covering(truth: Sequence[int], predicted: Sequence[int], n: int) -> float:
    """How well the partition ``predicted`` makes covers the partition ``truth`` makes of a
    series of ``n`` points (1.0: the same partition)."""
    pred = _segments(predicted, n)
    total = 0.0
    for a, b in _segments(truth, n):
        best = 0.0
        for c, d in pred:
            inter = min(b, d) - max(a, c)
            if inter > 0:
                best = max(best, inter / (max(b, d) - min(a, c)))
        total += (b - a) * best
    return total / n


def cover(annotations: Mapping[str, Sequence[int]], predicted: Sequence[int], n: int) -> float:
    """The mean over annotators of ``predicted``'s covering of their partition."""
    if not annotations:
        raise ValueError("no annotator")
    return sum(covering(cps, predicted, n) for cps in annotations.values()) / len(annotations)
