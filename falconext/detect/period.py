"""Recover the recurring period (calls per training iteration) from a call sequence alone.

Falcon (section 4.2) finds the iteration boundary without framework cooperation: the
collective calls of a training loop repeat, so the first lag whose autocorrelation reaches
M = 0.95 is the period. Two changes to the paper's formula make it usable here:

* Calls are categorical. A numeric ACF over integer symbol codes depends on the arbitrary
  order in which codes were handed out, so we take the ACF of the one-hot encoding. Its
  numerator summed over channels is the number of equal pairs, which reduces the ACF to a
  chance-corrected match rate (see :func:`acf`).
* Each lag is normalised by its own number of pairs. The paper's biased ``1/N``
  normalisation shrinks the ACF by ``(N - k) / N``; with three repetitions in the buffer a
  perfect period scores only 0.67 and 0.95 is out of reach for long periods.

The first lag reaching the threshold can be a unit repeated inside the iteration (a
layer, a micro-batch), broken once per iteration by the calls issued once per step;
:func:`sharpen_period` moves to the longer lag that is exact. A symbolic period can also
be a fraction of the iteration when an iteration issues several identical calls
(gradient buckets of equal size); :func:`refine_by_gaps` uses the inter-call gaps, which
do differ by phase, to find the multiple that is the iteration.

:func:`search_period` chains the three: find, sharpen, refine; :func:`detect_period` runs it
on a rank's records.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from falconext.config import DetectConfig, FalconConfig, detect_config
from falconext.trace.records import CallRecord

Symbol = tuple[str, str, int]

#: gaps are floored here before taking logs: two calls with the same timestamp (or a
#: clock step backwards) must not produce -inf and swamp the variance
MIN_GAP_SECONDS = 1e-9

#: a sum of squared symbol shares this close to 1 means a single symbol
_ONE_SYMBOL = 1.0 - 1e-12


def symbol_of(record: CallRecord) -> Symbol:
    """Identity of a call for pattern matching.

    Byte counts are coarsened to their bit length so that sizes that differ by a few
    bytes of padding still match, while a gradient bucket and a loss scalar do not.
    """
    return (record.op, record.group, int(record.bytes).bit_length())


def coarse_symbol_of(record: CallRecord) -> tuple[str, str]:
    """A call's identity without its size: operation and group (which holds the role).

    For jobs whose message sizes change from step to step (dynamic shapes: an
    embedding all-to-all carries however many ids the batch has), the size is only a
    soft feature; see :func:`size_agreement`."""
    return (record.op, record.group)


def size_agreement(bits: Sequence[int] | np.ndarray, k: int) -> float:
    """Share of the pairs (t, t + k) whose sizes are within a factor of 4 (bit lengths
    at most 2 apart): 1.0 when the sizes repeat with lag ``k`` up to small changes."""
    b = np.asarray(bits, dtype=np.int64)
    if not 1 <= k < b.size:
        raise ValueError(f"lag must be in [1, {b.size - 1}], got {k}")
    return float(np.count_nonzero(np.abs(b[:-k] - b[k:]) <= 2) / (b.size - k))


class SymbolTable:
    """Stable small-int codes for symbols, in order of first appearance.

    A streaming tracker must give a call the same code across the whole run; a code
    assigned per buffer would change whenever the buffer is trimmed.
    """

    def __init__(self) -> None:
        self._codes: dict[Hashable, int] = {}

    def code_of(self, symbol: Hashable) -> int:
        """The code of ``symbol``: its existing one, or the next free integer (0, 1, ...) on first sight."""
        code = self._codes.get(symbol)
        if code is None:
            code = len(self._codes)
            self._codes[symbol] = code
        return code

    def code(self, record: CallRecord) -> int:
        """The code of ``record``'s symbol (:func:`symbol_of`), assigned on first sight."""
        return self.code_of(symbol_of(record))

    def symbols(self) -> list[Hashable]:
        """The symbols seen so far, in code order (the code is the index)."""
        return list(self._codes)

    def __len__(self) -> int:
        return len(self._codes)


def symbolize(records: Iterable[CallRecord], table: SymbolTable | None = None) -> np.ndarray:
    """Integer codes of ``records``; pass ``table`` to keep codes stable across calls."""
    table = SymbolTable() if table is None else table
    return np.fromiter((table.code(r) for r in records), dtype=np.int64)


def chance_match(codes: np.ndarray) -> float:
    """Probability that two calls drawn at random have the same symbol (sum of p_s^2)."""
    codes = np.asarray(codes)
    if codes.size == 0:
        return 1.0
    _, counts = np.unique(codes, return_counts=True)
    p = counts / codes.size
    return float(np.dot(p, p))


def acf(codes: Sequence[int] | np.ndarray, k: int) -> float:
    """Autocorrelation at lag ``k`` of the one-hot encoding of ``codes``.

    With x_t the one-hot vector of symbol t and p the symbol shares, summing the paper's
    covariance over channels gives ``sum_t [x_t == x_{t+k}] - (N - k) sum_s p_s^2`` and the
    variance ``N (1 - sum_s p_s^2)``. Normalising each by its own count of terms:

        acf(k) = (match_rate(k) - sum_s p_s^2) / (1 - sum_s p_s^2)

    where match_rate(k) is the share of the N - k pairs (t, t + k) with equal symbols.
    It is 1 for an exact period and about 0 when symbols are independent, whatever codes
    the symbols were given. A sequence of one symbol has no variance; every pair matches,
    so we call its ACF 1 rather than divide by zero.
    """
    codes = np.asarray(codes)
    n = codes.size
    if not 1 <= k < n:
        raise ValueError(f"lag must be in [1, {n - 1}], got {k}")
    chance = chance_match(codes)
    if chance >= _ONE_SYMBOL:
        return 1.0
    match_rate = np.count_nonzero(codes[:-k] == codes[k:]) / (n - k)
    return float((match_rate - chance) / (1.0 - chance))


def mismatch_rate(codes: Sequence[int] | np.ndarray, k: int) -> float:
    """Share of the pairs (t, t + k) whose symbols differ."""
    codes = np.asarray(codes)
    if not 1 <= k < codes.size:
        raise ValueError(f"lag must be in [1, {codes.size - 1}], got {k}")
    return float(np.count_nonzero(codes[:-k] != codes[k:]) / (codes.size - k))


def _first_lag_within(
    codes: np.ndarray, lo: int, hi: int, max_rate: float, chance: float
) -> int | None:
    """First lag in [lo, hi] whose mismatch rate is at most ``max_rate``.

    Lags are rejected on a prefix first, a block of lags at a time: a prefix that
    already holds more mismatches than the whole sequence may have rules the lag out
    exactly, not approximately. The prefix is long enough that a lag matching only by
    chance (mismatch rate about 1 - chance) fails it.
    """
    n = codes.size
    tolerance = 1e-9
    block = 32
    lag = lo
    # the prefix counts compare a block of lags x the prefix, which is memory-bound: on
    # the narrowest integer type that holds the codes they move a fraction of the bytes
    narrow = _narrowed(codes)
    while lag <= hi:
        last = min(hi, lag + block - 1)
        lags = np.arange(lag, last + 1)
        want = 3.0 * max_rate * n / max(1.0 - chance, 1e-3)
        probe = int(min(n - last, max(256, np.ceil(want))))
        allowed = max_rate * (n - lags) * (1.0 + tolerance) + tolerance
        for candidate in _within_on_prefix(narrow, lags, probe, allowed):
            k = int(candidate)
            mismatches = np.count_nonzero(codes[:-k] != codes[k:])
            if mismatches <= max_rate * (n - k) * (1.0 + tolerance) + tolerance:
                return k
        lag = last + 1
        block = min(2 * block, max(32, (1 << 21) // probe))
    return None


#: pairs of the prefix counted at a time by :func:`_within_on_prefix`
PREFIX_CHUNK = 1024


def _within_on_prefix(codes: np.ndarray, lags: np.ndarray, probe: int, allowed: np.ndarray) -> np.ndarray:
    """The ``lags`` (ascending, consecutive) whose first ``probe`` pairs (t, t + lag) hold
    at most ``allowed`` (one per lag) mismatches; needs ``probe + lags[-1] <= codes.size``.

    The prefix is counted a chunk at a time and a lag is dropped as soon as its count
    passes its allowance (a count only grows), so a lag that matches by chance is done
    after about allowed / (1 - chance) pairs rather than the whole prefix, which is
    three times that."""
    counts = np.zeros(lags.size, dtype=np.int64)
    first = int(lags[0])
    pos = 0
    while pos < probe and lags.size:
        step = min(PREFIX_CHUNK, probe - pos)
        # row j: codes[pos + j : pos + j + step], the partners of codes[pos : pos + step]
        windows = sliding_window_view(codes[pos:], step)
        if lags.size == int(lags[-1]) - first + 1:  # none dropped yet: a view, no copy
            rows = windows[first : first + lags.size]
        else:
            rows = windows[lags]
        counts += (rows != codes[pos : pos + step]).view(np.uint8).sum(axis=1, dtype=np.int64)
        keep = counts <= allowed
        if not keep.all():
            lags, counts, allowed = lags[keep], counts[keep], allowed[keep]
        pos += step
    return lags


def _narrowed(codes: np.ndarray) -> np.ndarray:
    """``codes`` as the narrowest signed integer type that holds them all (equal codes
    stay equal, different ones different)."""
    if codes.size == 0:
        return codes
    lo, hi = int(codes.min()), int(codes.max())
    for dtype in (np.int8, np.int16, np.int32):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return codes.astype(dtype)
    return codes


def find_period(
    codes: Sequence[int] | np.ndarray,
    threshold: float = 0.95,
    min_repeats: int = 3,
    max_period: int | None = None,
    min_period: int = 1,
) -> int | None:
    """First lag in [min_period, len / min_repeats] (and <= max_period) with acf >= threshold.

    There is no small fixed lag limit: the Falcon prototype missed periods longer than
    its limit, and a pipeline stage of a large model issues thousands of calls per
    iteration. Returns None when nothing repeats often enough; 1 for a sequence of one
    symbol (its ACF is undefined; see :func:`acf`).
    """
    codes = np.ascontiguousarray(codes, dtype=np.int64)
    n = codes.size
    limit = n // min_repeats
    if max_period is not None:
        limit = min(limit, max_period)
    lag = max(1, min_period)
    if n < 2 or limit < lag:
        return None
    chance = chance_match(codes)
    if chance >= _ONE_SYMBOL:
        return 1
    # acf >= threshold  <=>  mismatch rate <= (1 - threshold) * (1 - chance)
    return _first_lag_within(codes, lag, limit, (1.0 - threshold) * (1.0 - chance), chance)


def sharpen_period(
    codes: Sequence[int] | np.ndarray,
    period: int,
    min_repeats: int = 3,
    max_period: int | None = None,
) -> int:
    """Move from a near period to a longer exact one when the data shows it.

    The first lag reaching the ACF threshold is often a unit repeated inside the
    iteration: a layer, or a micro-batch of the last pipeline stage or of a job without
    pipelining, broken once per iteration by the few calls issued once per step
    (gradient buckets, gradient norm). A template of that unit breaks every iteration.
    So while the period is not exact, take the first longer lag with at most half its
    mismatch rate. Evaluation iterations inserted every E iterations also make the
    E-iteration cycle exact; it is preferred only if it fits in ``max_period`` and the
    data holds ``min_repeats`` of it, which for realistic evaluation intervals it does not.
    """
    codes = np.ascontiguousarray(codes, dtype=np.int64)
    n = codes.size
    limit = n // min_repeats
    if max_period is not None:
        limit = min(limit, max_period)
    chance = chance_match(codes)
    k = period
    while k < limit:
        rate = mismatch_rate(codes, k)
        if rate == 0.0:
            break
        longer = _first_lag_within(codes, k + 1, limit, rate / 2.0, chance)
        if longer is None:
            break
        k = longer
    return k


def _log_gaps(t_issue: Sequence[float] | np.ndarray) -> np.ndarray:
    t = np.asarray(t_issue, dtype=np.float64)
    return np.log(np.maximum(np.diff(t), MIN_GAP_SECONDS))


def phase_r2(values: np.ndarray, q: int) -> float:
    """Adjusted share of the variance of ``values`` explained by the phase ``i mod q``.

    Plain R^2 grows with the number of phases even on noise (its null mean is about
    (q - 1) / (n - 1)); the adjustment keeps a long candidate from winning on noise.
    q = 1 has a single phase and explains nothing: 0 by definition.
    """
    values = np.asarray(values, dtype=np.float64)
    n = values.size
    if q <= 1 or n <= q:
        return 0.0
    centred = values - values.mean()
    total = float(np.dot(centred, centred))
    if total <= 0.0:
        return 0.0
    phase = np.arange(n) % q
    sums = np.bincount(phase, weights=centred, minlength=q)
    counts = np.bincount(phase, minlength=q)
    between = float(np.sum(sums * sums / counts))
    r2 = between / total
    return 1.0 - (1.0 - r2) * (n - 1) / (n - q)


def gap_spacing(t_issue: Sequence[float] | np.ndarray, min_ratio: float = 20.0) -> int | None:
    """Calls from one long pause to the next, when the stream has long pauses; else None.

    A stream of identical calls (a DDP job's gradient buckets, sizes not recorded) shows
    its steps only in time: the optimizer step and the next batch are a pause hundreds
    of times longer than the gaps between buckets. Long pauses are the gaps above the
    geometric mean of the median and the longest gap, and only count when the longest
    is ``min_ratio`` times the median; the answer is the median distance between them.
    """
    gaps = np.maximum(np.diff(np.asarray(t_issue, dtype=np.float64)), MIN_GAP_SECONDS)
    if gaps.size < 3:
        return None
    median, top = float(np.median(gaps)), float(gaps.max())
    if top < min_ratio * median:
        return None
    long_at = np.flatnonzero(gaps >= np.sqrt(top * median))
    if long_at.size < 2:
        return None
    return int(np.median(np.diff(long_at)))


def refine_by_gaps(
    period: int,
    t_issue: Sequence[float] | np.ndarray,
    r2_threshold: float = 0.8,
    max_multiple: int = 256,
    min_repeats: int = 3,
    max_period: int | None = None,
    long_pause_ratio: float = 20.0,
) -> int:
    """Smallest multiple q = m * period whose phase explains the inter-call gaps, else period.

    Why gaps: when an iteration issues m identical calls the symbols repeat every
    ``period`` calls, but the time before the first call of an iteration (forward pass,
    optimizer step) is far longer than the time between buckets, so log-gaps repeat only
    every m * period calls. A candidate needs ``min_repeats`` repetitions in the data.
    """
    if period < 1:
        raise ValueError(f"period must be >= 1, got {period}")
    gaps = _log_gaps(t_issue)
    for m in range(1, max_multiple + 1):
        q = m * period
        if (max_period is not None and q > max_period) or gaps.size < min_repeats * q:
            return period
        if q > 1 and phase_r2(gaps, q) >= r2_threshold:
            return q
    # beyond max_multiple (hundreds of identical buckets per step): the long pauses'
    # spacing is the one candidate worth testing
    q = gap_spacing(t_issue, long_pause_ratio)
    if (q is not None and q > max_multiple * period and q % period == 0 and gaps.size >= min_repeats * q
            and (max_period is None or q <= max_period) and phase_r2(gaps, q) >= r2_threshold):
        return q
    return period


#: the ops of point-to-point calls (a pipeline's activations and gradients between stages)
P2P_OPS = frozenset({"send", "recv"})


def inner_period(template: Sequence[int] | np.ndarray, max_insert: int,
                 idle: Sequence[float] | np.ndarray | None = None,
                 collective: Sequence[bool] | np.ndarray | None = None) -> int | None:
    """The iteration inside a super-period: the shortest ``q`` such that one period
    ``template`` (any rotation) is ``N >= 2`` exact repeats of a block of ``q`` calls with
    runs of inserted calls between blocks (:func:`blocks_with_insertions`: each run of
    ``1 <= k <= max_insert`` calls, runs at least :data:`MIN_BLOCKS_BETWEEN_INSERTIONS`
    blocks apart, at most :data:`MAX_INSERTED_SHARE` of the calls); None when there is
    none (or ``max_insert`` is 0). A block may be a single call: a data-parallel job with
    the distributed optimizer issues two to four calls per iteration.

    ``idle`` (optional, aligned with ``template``): the host's idle time before each call.
    A block that is an iteration holds the step's longest pause (optimizer step, next
    data) in every repeat; a unit inside the iteration (a 1F1B micro-batch, whose
    remainder is the step's own call or two) holds it in one repeat only. With ``idle``,
    a split is kept only when there are at least 3 repeats and every one of them pauses
    at least half as long as the step's pause, read beside the inserted runs (see
    :func:`_every_block_pauses`; the blocks next to a run may take their pause from it).

    A job that adds a few calls every N iterations (Megatron-LM's ``--log-interval``
    timer calls, a periodic evaluation's or checkpoint's handful of collectives, several
    of them with different N) is exactly periodic only over the least common multiple of
    the N, and the lag-1-iteration autocorrelation sits near ``1 - 1/N``, below the
    threshold for N < 20. The block is the iteration; the inserted runs belong to the
    iterations they follow. A unit inside the iteration (a micro-batch) is not taken for
    it: the calls issued once per step make the remainder a large share of the unit,
    not a few calls, and they come at every iteration.

    ``collective`` (optional, aligned with ``template``): whether each call is a collective
    (not a point-to-point send or recv). A block of point-to-point calls alone with
    collectives among the inserted calls is a pipeline stage's micro-batch, not an
    iteration: an iteration ends with its step's collectives (gradient sync, gradient
    norm, loss), which a micro-batch never holds. Without this, a stage of 8 or more
    micro-batches of send/recv pairs and four step collectives read as a 2-call iteration.
    """
    t = np.asarray(template)
    if max_insert <= 0:
        return None
    for q in range(1, t.size // 2 + 1):
        if blocks_with_insertions(t, q, max_insert, idle, collective):
            return q
    return None


def blocks_with_insertions(template: Sequence[int] | np.ndarray, q: int, max_insert: int,
                           idle: Sequence[float] | np.ndarray | None = None,
                           collective: Sequence[bool] | np.ndarray | None = None) -> bool:
    """True when ``template`` (one exact period, any rotation) reads as repeats of one
    block of ``q`` calls with runs of at most ``max_insert`` inserted calls between them
    (:func:`inner_period`'s test for one ``q``; ``idle`` and ``collective`` as there). An
    exact multiple of the block (no insertion) is False: the period search chose it on
    purpose (gaps)."""
    t = np.asarray(template)
    n = t.size
    if not 1 <= q <= n // 2:
        return False
    match = t == np.roll(t, -q)  # cyclic: t[i] == t[i + q]
    if n % q == 0 and match.all():
        return False
    run, start = _longest_cyclic_run(match)
    if run < q:  # no two blocks in a row
        return False
    rot = np.roll(t, -start)
    blocks = _parse_blocks(rot, q, max_insert)
    if blocks is None:
        return False
    if collective is not None:  # point-to-point blocks between the step's collectives: micro-batches
        kinds = np.roll(np.asarray(collective, dtype=bool), -start)
        in_block = np.zeros(n, dtype=bool)
        for b in blocks:
            in_block[b : b + q] = True
        if not kinds[in_block].any() and kinds[~in_block].any():
            return False
    return idle is None or _every_block_pauses(np.roll(np.asarray(idle, dtype=float), -start), blocks, q)


#: fewest blocks between two runs of inserted calls (cyclically): insertions are rarer
#: than iterations (a --log-interval of 3 or more); a run after every block or two is
#: the iteration's own calls, and a one-call block between them is not an iteration
MIN_BLOCKS_BETWEEN_INSERTIONS = 3
#: most of a period that inserted calls may be: a one-call "block" between the calls of
#: a pipeline stage's micro-batches leaves a third of them over, an all-gather every
#: 10 iterations of 2 calls 5%
MAX_INSERTED_SHARE = 0.2


def _parse_blocks(rot: np.ndarray, q: int, max_run: int) -> list[int] | None:
    """Where the blocks of ``rot`` begin, reading it as repeats of its first ``q`` calls with
    runs of at most ``max_run`` other calls between them, at least
    :data:`MIN_BLOCKS_BETWEEN_INSERTIONS` blocks apart (the last run may close the circle)
    and at most :data:`MAX_INSERTED_SHARE` of the calls; None when it does not read so or
    has no inserted call."""
    n = rot.size
    block = rot[:q]
    starts: list[int] = []
    gaps: list[int] = []  # blocks before each run
    since = cur = 0
    i = 0
    while i < n:
        if i + q <= n and np.array_equal(rot[i : i + q], block):
            starts.append(i)
            since += 1
            i += q
            cur = 0
            continue
        if cur == 0:
            gaps.append(since)
            since = 0
        cur += 1
        if cur > max_run:
            return None
        i += 1
    if not gaps:
        return None
    gaps[0] += since  # the blocks after the last run come before the first (a circle)
    if min(gaps) < MIN_BLOCKS_BETWEEN_INSERTIONS or n - q * len(starts) > MAX_INSERTED_SHARE * n:
        return None
    return starts


def _every_block_pauses(idle: np.ndarray, starts: list[int], q: int) -> bool:
    """True when there are at least 3 blocks (at ``starts``, ``q`` calls each, in ``idle``'s
    order) and each holds a pause at least half the step's pause.

    The step's pause is read next to the inserted runs: the pause before each inserted
    call and the one after the run (before the next block's first call), the longest of
    each run, the median over the runs. A micro-batch unit taken for the iteration has
    the step's own call or two as its one "inserted" run, and the optimizer step's
    pause beside it, which the other units lack; an iteration with a log all-gather every
    10 and an evaluation every 50 has runs whose pauses are mostly the step's (the
    evaluation's longer one is one run of several). An inserted run's pauses count for
    the blocks on both sides of it."""
    n = idle.size
    if len(starts) < 3:
        return False
    block_max = np.array([idle[s : s + q].max() for s in starts])
    beside: list[float] = []
    for j, s in enumerate(starts):
        nxt = starts[j + 1] if j + 1 < len(starts) else n + starts[0]
        end = s + q
        if nxt > end:  # an inserted run between block j and the next (cyclic)
            ins = float(np.take(idle, np.arange(end, nxt + 1) % n).max())  # with the next block's first
            beside.append(ins)
            k = (j + 1) % len(starts)
            block_max[j] = max(block_max[j], ins)
            block_max[k] = max(block_max[k], ins)
    step = float(np.median(beside)) if beside else float(idle.max())
    return bool(np.all(block_max >= 0.5 * step))


def _longest_cyclic_run(flags: np.ndarray) -> tuple[int, int]:
    """(length, start) of the longest run of True in ``flags`` read as a circle."""
    n = flags.size
    if n == 0 or flags.all():
        return n, 0
    first_false = int(np.argmin(flags))
    rolled = np.roll(flags, -first_false)  # starts with a False: no run wraps
    best, best_start, cur, cur_start = 0, 0, 0, 0
    for i, f in enumerate(rolled):
        if f:
            if cur == 0:
                cur_start = i
            cur += 1
            if cur > best:
                best, best_start = cur, cur_start
        else:
            cur = 0
    return best, (best_start + first_false) % n


def detect_period(
    data: Sequence[CallRecord] | tuple[np.ndarray, np.ndarray],
    config: FalconConfig | DetectConfig | None = None,
) -> int | None:
    """Calls per iteration of one rank: symbolise, find, sharpen, refine by gaps.

    ``data`` is either the rank's records or a pair ``(codes, t_issue)``.
    """
    config = detect_config(config)
    if isinstance(data, tuple) and len(data) == 2 and not isinstance(data[0], CallRecord):
        codes, times = (np.asarray(a) for a in data)
    else:
        records = list(data)
        codes = symbolize(records)
        times = np.array([r.t_issue for r in records], dtype=np.float64)
    if codes.shape != times.shape:
        raise ValueError("codes and t_issue must have the same length")
    return search_period(codes, times, config)


def search_period(codes: np.ndarray, times: np.ndarray, config: DetectConfig) -> int | None:
    """The period of ``codes`` (symbol codes, with ``times`` their issue times): the first
    lag whose ACF reaches ``config.acf_threshold`` (:func:`find_period`), moved to the
    longer exact lag (:func:`sharpen_period`), then to the multiple the gaps show
    (:func:`refine_period`). None when no lag reaches the threshold."""
    period = find_period(codes, config.acf_threshold, config.acf_min_repeats, config.max_period_calls)
    if period is None:
        return None
    period = sharpen_period(codes, period, config.acf_min_repeats, config.max_period_calls)
    return refine_period(period, times, config)


def refine_period(period: int, times: np.ndarray, config: DetectConfig) -> int:
    """:func:`refine_by_gaps` with the thresholds of ``config``: ``period`` or the
    multiple of it that the inter-call gaps of ``times`` show to be the iteration."""
    return refine_by_gaps(
        period,
        times,
        config.gap_profile_r2,
        min_repeats=config.acf_min_repeats,
        max_period=config.max_period_calls,
        long_pause_ratio=config.long_pause_ratio,
    )
