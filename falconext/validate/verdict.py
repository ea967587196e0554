"""Verdicts from validation benchmarks: which ranks compute slowly, which links are slow.

Both compare each measurement with a median of its peers rather than with a nominal
speed: the job's own hardware, dtype and message size set the baseline, and a median is
not dragged by the very outlier it has to expose (a mean would be, with few ranks).
A measurement is slow when it takes more than ``factor`` times the reference.
"""

from __future__ import annotations

import math
import numbers
from typing import Mapping, Sequence

import numpy as np

from falconext.config import FalconConfig
from falconext.medians import lower_half_median, median, upper_half_median

#: the defaults of the configuration, the one source of thresholds
_DEFAULT = FalconConfig()


def _check_factor(factor: float, who: str) -> None:
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not math.isfinite(factor) or factor < 1:
        raise ValueError(f"{who}: factor must be a finite number >= 1, got {factor!r}")


def _positive(value: object) -> bool:
    """Whether ``value`` is a finite number > 0 (a bool is not a number here)."""
    if type(value) is float:  # the usual case, without the abstract-class checks (100k links)
        return math.isfinite(value) and value > 0
    return (
        not isinstance(value, bool)
        and isinstance(value, numbers.Real)
        and math.isfinite(value)
        and value > 0
    )


def slow_ranks(
    flops: Mapping[int, float],
    factor: float = _DEFAULT.validation_slow_factor,
    suspects: Sequence[int] = (),
    confirm_factor: float | None = None,
    compute_rise: Mapping[int, float] | None = None,
) -> list[int]:
    """Ranks whose FLOP/s is below reference / factor, sorted.

    The reference is the median of the faster half of the ranks (those at or above the
    median): several stragglers at once must not drag it down. With half the validated
    ranks slow (two slow GPUs among four, the case S3's consolidation is for), the plain
    median sits between slow and fast, and a 2x straggler measured at 0.73 of it was
    missed on the test bed. Healthy devices agree closely, so their upper half is no
    harder to meet than their median.

    A profiled compute suspect (the rank the others waited for) needs less to be
    confirmed: below the same reference over the *other* ranks / ``confirm_factor``
    (default halfway between 1 and ``factor``), and below every unsuspected rank that is
    not itself slow (by ``factor``) by that same margin: two independent measurements
    agree on it. (In CI a link-fault job's last arriver read 121 GFLOP/s against 177
    and 178, with an unsuspected rank at 119: noise, not a straggler.)

    When most ranks are slow, no median of the readings is a healthy speed (three 2x
    stragglers among four read 1.0, 1.0, 1.0 against 2.0: the upper half's median is a
    slow one). ``compute_rise`` (each rank's compute time per micro-batch now over its own
    before the fail-slow's onset, from the heartbeats) settles it: a rank is also slow when
    its GEMM is below the fastest reading / ``confirm_factor`` (interference only ever
    lowers a reading, so the fastest is the nearest to a healthy device's speed) and its
    own compute rose by at least ``confirm_factor``: two independent measurements agree on
    it. The same rule names a mild straggler (1.3x-1.5x) that the GEMM alone, held to
    ``factor``, lets pass: in a pipeline every stage of its replica finishes late, so
    profiling names no suspect to confirm (table7's 1.3x and 1.4x GPUs).

    Fewer than two ranks give no verdict: a lone rank has nothing to be compared with,
    and there is no nominal speed to fall back on.
    """
    _check_factor(factor, "slow_ranks")
    for rank, value in flops.items():
        if not _positive(value):
            raise ValueError(f"slow_ranks: FLOP/s of rank {rank} is {value!r}; expected a finite positive number")
    if len(flops) < 2:
        return []
    confirm = 1.0 + (factor - 1.0) / 2.0 if confirm_factor is None else confirm_factor
    _check_factor(confirm, "slow_ranks (confirm_factor)")
    reference = upper_half_median(flops.values())
    slow = {rank for rank, value in flops.items() if value * factor < reference}
    # the GEMM must also single the suspect out: if a rank nobody suspected reads as slow
    # (a shared host's noise), the suspect's reading tells nothing apart
    unsuspected = [v for r, v in flops.items() if r not in suspects and r not in slow]
    floor = min(unsuspected) if unsuspected else math.inf
    for rank in suspects:
        if rank in flops:
            others = upper_half_median(v for r, v in flops.items() if r != rank)
            if flops[rank] * confirm < min(others, floor):
                slow.add(rank)
    if compute_rise:
        fastest = max(flops.values())
        slow.update(rank for rank, value in flops.items()
                    if value * confirm < fastest and compute_rise.get(rank, 0.0) >= confirm)
    return sorted(slow)


def _key(a: int, b: int) -> str:
    return f"{a}-{b}"


def slow_links(
    pairs: Sequence[tuple[int, int, float]] | np.ndarray,
    node_of: Mapping[int, int],
    factor: float = _DEFAULT.validation_slow_factor,
    min_excess_s: float = 0.0,
    baseline: Mapping[tuple[int, int], float] | None = None,
) -> tuple[list[tuple[int, int]], dict]:
    """Slow inter-node links as sorted node pairs (a, b), a < b, plus the evidence.
    ``pairs``: (src, dst, seconds) measurements, or a :func:`measurement_array` of them.

    Each measured (src, dst, seconds) maps to the unordered node pair of its ranks; a
    link's value is the median of its measurements (both directions, several rank pairs),
    robust to one noisy sample. Pairs within one node are intra-node measurements: they
    are never judged (mitigation acts on node links) but may serve as reference.

    Reference: the median of the faster half (at or below the median) of the inter-node
    link values, so that two congested links among four do not drag it up and hide each
    other (x8 and x3 links read 96 and 29 ms, healthy ones under 1 ms: the plain median sat
    between them and let the x3 pass). Only inter-node links are compared with each other:
    intra-node links (NVLink on a cluster, the emulated device's fast links on the test
    bed) are far faster, and comparing with them made every healthy network link look
    slow. Links, not raw measurements, are the unit of the median, so a link measured more
    often does not weigh more.

    With a single inter-node link (a two-node job) there is nothing like it to compare
    with. Then ``baseline`` -- the same link measured healthy, by the same passes, earlier
    in the job (:func:`link_baseline`) -- is its reference; without one no link is named
    (the evidence says so).

    Evidence (JSON-friendly): {"links": {"a-b": s}, "intra": {"a-a": s}, "reference": s or
    None, "reference_from": "inter-node links" | "baseline" | "no peer link", "baseline":
    {"a-b": s} (when used), "factor": f, "slow": ["a-b"]}.
    """
    _check_factor(factor, "slow_links")
    value = _link_values_at_once(pairs, node_of)
    if value is None:
        value = _link_values(_as_tuples(pairs) if isinstance(pairs, np.ndarray) else pairs, node_of)
    inter = {link: v for link, v in value.items() if link[0] != link[1]}
    intra = {link: v for link, v in value.items() if link[0] == link[1]}
    own = {link: float(baseline[link]) for link in inter if baseline and _positive(baseline.get(link))}
    refs: dict[tuple[int, int], float] = {}
    if len(inter) >= 2:
        basis, reference = "inter-node links", lower_half_median(inter.values())
        refs = {link: reference for link in inter}
    elif own:
        basis, reference = "baseline", None
        refs = own
    else:
        basis, reference = "no peer link", None

    # ``min_excess_s``: a sub-millisecond message on a shared host can take 2x its peers'
    # time from scheduling alone; a congested link costs far more than that in absolute terms
    slow = [link for link, v in inter.items() if link in refs and v > factor * refs[link] and v - refs[link] > min_excess_s]
    evidence = {
        "links": {_key(*link): v for link, v in inter.items()},
        "intra": {_key(*link): v for link, v in intra.items()},
        "reference": reference,
        "reference_from": basis,
        "factor": float(factor),
        "min_excess_s": float(min_excess_s),
        "slow": [_key(*link) for link in slow],
    }
    if basis == "baseline":
        evidence["baseline"] = {_key(*link): v for link, v in own.items()}
    return slow, evidence


def _as_tuples(table: np.ndarray) -> list[tuple[int, int, float]]:
    """A :func:`measurement_array`'s rows as the (src, dst, seconds) tuples they were."""
    return [(int(a), int(b), float(t)) for a, b, t in table.tolist()]


def _link_values(pairs: Sequence[tuple[int, int, float]], node_of: Mapping[int, int]) -> dict[tuple[int, int], float]:
    """Each node pair's median of the measurements ``pairs`` (see :func:`slow_links`), by
    node pair in order; ValueError naming the first measurement that is not right."""
    samples: dict[tuple[int, int], list[float]] = {}
    for item in pairs:
        if len(item) != 3:
            raise ValueError(f"slow_links: {item!r} is not a (src, dst, seconds) measurement")
        src, dst, seconds = item
        for r in (src, dst):
            if r not in node_of:
                raise ValueError(f"slow_links: rank {r} (in pair {src}->{dst}) has no node in node_of")
        if not _positive(seconds):
            raise ValueError(f"slow_links: time of pair {src}->{dst} is {seconds!r}; expected a finite positive number")
        a, b = sorted((node_of[src], node_of[dst]))
        samples.setdefault((a, b), []).append(float(seconds))
    return {link: float(median(s)) for link, s in sorted(samples.items())}


def measurement_array(rows: Sequence[Sequence[float]]) -> np.ndarray | None:
    """Validation measurements ``[src, dst, seconds]`` as one ``(n, 3)`` float array,
    for :func:`slow_links` (a 131,072-rank validation measures about 300,000: making a
    tuple of each took a tenth of a second, and taking them apart again twice that);
    None when any is in doubt (not three numbers, a rank not a whole number from 0 to
    2**53, a time not finite and positive): the caller then takes the tuples' way, which
    names it."""
    if not rows or not set(map(type, rows)) <= {list, tuple} or set(map(len, rows)) != {3}:
        return None
    try:
        table = np.array(rows, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        return None
    ranks, secs = table[:, :2], table[:, 2]
    with np.errstate(invalid="ignore"):
        if not ((ranks >= 0) & (ranks <= 2.0**53) & (ranks == np.floor(ranks))).all() \
                or not (np.isfinite(secs) & (secs > 0)).all():
            return None
    return table


def _node_lookup(node_of: Mapping[int, int], most: int) -> np.ndarray | None:
    """Node of every rank 0..``most`` (-1: none), or None when ``node_of`` is in doubt."""
    if not node_of or not set(map(type, node_of)) | set(map(type, node_of.values())) <= {int}:
        return None
    try:
        at = np.fromiter(node_of.keys(), dtype=np.int64, count=len(node_of))
        nodes = np.fromiter(node_of.values(), dtype=np.int64, count=len(node_of))
    except OverflowError:  # a number past 64 bits: the loop's way
        return None
    if at.min() < 0 or nodes.min() < 0:
        return None
    lookup = np.full(most + 1, -1, dtype=np.int64)
    inside = at <= most
    lookup[at[inside]] = nodes[inside]
    return lookup


def with_nodes(table: np.ndarray, node_of: Mapping[int, int]) -> np.ndarray | None:
    """The rows of a :func:`measurement_array` both of whose ranks have a node in
    ``node_of`` (None: ``node_of`` in doubt)."""
    if not len(table):
        return table
    lookup = _node_lookup(node_of, int(table[:, :2].max()))
    if lookup is None:
        return None
    ends = lookup[table[:, :2].astype(np.int64)]
    return table[(ends >= 0).all(axis=1)]


def _link_values_at_once(pairs: Sequence[tuple[int, int, float]] | np.ndarray,
                         node_of: Mapping[int, int]) -> dict[tuple[int, int], float] | None:
    """:func:`_link_values` over arrays (a 131,072-rank validation measures about 300,000
    pairs: 1.1 s a pair at a time): exactly its figures, or None when any measurement is
    in doubt (the caller then takes the way that names it). ``pairs`` may be a
    :func:`measurement_array`."""
    if isinstance(pairs, np.ndarray):
        if not len(pairs) or pairs.ndim != 2 or pairs.shape[1] != 3:
            return None
        ranks = np.concatenate([pairs[:, 0], pairs[:, 1]]).astype(np.int64)
        seconds = pairs[:, 2]
    else:
        if not pairs or not set(map(type, pairs)) <= {tuple} or set(map(len, pairs)) != {3}:
            return None
        src, dst, secs = zip(*pairs)
        if not set(map(type, src)) | set(map(type, dst)) <= {int} or not set(map(type, secs)) <= {float}:
            return None
        try:
            ranks = np.array(src + dst, dtype=np.int64)
        except OverflowError:  # a number past 64 bits: the loop's way
            return None
        seconds = np.array(secs, dtype=np.float64)
    if ranks.min() < 0:
        return None
    lookup = _node_lookup(node_of, int(ranks.max()))
    if lookup is None:
        return None
    ends = lookup[ranks]
    if (ends < 0).any() or not (np.isfinite(seconds) & (seconds > 0)).all():
        return None
    n = len(seconds)
    a, b = np.minimum(ends[:n], ends[n:]), np.maximum(ends[:n], ends[n:])
    width = int(b.max()) + 1
    key = a * width + b
    order = np.lexsort((seconds, key))  # by node pair, each pair's times ascending
    key, seconds = key[order], seconds[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    counts = np.diff(np.r_[starts, len(key)])
    mid = starts + counts // 2
    odd = counts % 2 == 1
    values = np.where(odd, seconds[mid], 0.5 * (seconds[mid - 1 + odd] + seconds[mid]))
    return {(int(k) // width, int(k) % width): v for k, v in zip(key[starts].tolist(), values.tolist())}


def link_baseline(evidence: Mapping, known: Mapping[tuple[int, int], float] | None = None) -> dict[tuple[int, int], float]:
    """Healthy link times from the evidence of a :func:`slow_links` verdict that named no
    link: ``known`` updated with the inter-node links measured (a link measured again
    replaces its older value; a verdict that named a link adds nothing, it is not healthy)."""
    out = dict(known or {})
    if evidence.get("slow"):
        return out
    for key, value in (evidence.get("links") or {}).items():
        a, _, b = str(key).partition("-")
        if a.isdigit() and b.isdigit() and _positive(value):
            out[(int(a), int(b))] = float(value)
    return out
