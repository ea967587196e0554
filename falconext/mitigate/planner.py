"""The adaptive multi-level mitigation planner (Falcon section 5.2, Algorithm 1).

Strategies, cheapest and least effective first in the paper's order:

* ``S1`` do nothing (wait for the straggler to recover by itself),
* ``S2`` rebalance micro-batches across data-parallel replicas,
* ``S3`` change the parallel topology (move congested links / consolidate stragglers),
* ``S4`` checkpoint-and-restart without the bad node.

A computation fail-slow can be treated by S2, S3 or S4; a communication fail-slow only
by S3 or S4 (moving work between replicas does not unclog a link). S1 is implicit: it is
what the planner does while it is waiting.

Why ski rental. How long a fail-slow will last is unknown in advance (tens of seconds to
hours). Every slow iteration costs ``t_iter - t_healthy`` seconds: that is the *rent*.
Applying a strategy costs a one-off overhead (solver time, parameter shuffling, a
restart): that is the *buy*. The classical deterministic ski-rental rule -- keep renting
until the rent paid so far equals the purchase price, then buy -- is never worse than
twice the cost of the (clairvoyant) optimum, whatever the duration turns out to be. The
planner therefore keeps the accumulated slow impact and applies the next candidate (sorted
by overhead) as soon as that impact reaches the candidate's overhead.

Why accumulate since onset, including before and during mitigation. The rent is what the
job has already lost to this fail-slow, whichever strategy was in effect while it was
lost; so the impact counts from the event's onset (not from detection, nor from the last
strategy applied). An escalation to a costlier strategy is then justified by the total
loss so far: S4 is bought once the whole fail-slow has cost as much as a restart. Iterations
that are fed in jumps (every k-th iteration) count ``k`` times their excess.

Judging. A strategy that was applied is given ``settle_iterations`` to take effect, then
judged on the median of the next ``judge_iterations`` observations: it is *enough* if that
median is within ``enough_margin`` of the healthy time. While the strategy in effect is
enough the planner never escalates; the verdict is kept up to date on the rolling median of
the last ``judge_iterations`` observations, so escalation resumes if the iteration time
rises above the margin again. No escalation happens before the strategy in effect has been
judged, nor while a decision is pending (issued but not yet ``applied``/``failed``); a
candidate that a widening added (below) is not an escalation: it treats the fault that
joined, so the rent may buy it before the strategy in effect has been judged.

Re-localizing a rise. A strategy judged enough that stops being enough, or an iteration
time that rises by ``rise_margin`` over the lowest level seen in this fail-slow (the
rolling median of ``judge_iterations`` observations, outside settle periods), means
something changed: the localized fault got worse, or a second fault began (a GPU that
slows while S3 carries a congested link's traffic elsewhere, or while no strategy has
helped yet). Escalating would charge the new fault to the old culprits (S4 would leave
out the wrong node), so the planner asks the caller to localize again (a ``relocalize``
Decision, once per rise) and makes no decision until :meth:`relocalized` says what was
found. A fault found then may widen the candidates (:meth:`widen`: a slow GPU under a
communication fail-slow makes S2 a candidate). The rent so far is kept: it is what the
job lost to this fail-slow, whichever fault caused which part.

No flapping. When the caller reports that the fail-slow is over (``recovered``), the planner
asks once to revert a reversible strategy (S2, S3: go back to the even/original plan) and
finishes. A finished planner never issues another decision, whatever it is fed: a new
fail-slow gets a new planner. S4 is never reverted (the bad node is gone), and S4 is
terminal: once it is in effect nothing is escalated to after it.

The planner is pure: it measures nothing and applies nothing. Overheads are measured by
the caller and may be updated at any time with :meth:`Planner.set_overhead`; an
unavailable strategy (overhead ``None``) is skipped until it gets one.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

STRATEGIES = ("S1", "S2", "S3", "S4")
CANDIDATES = {
    "computation": ("S2", "S3", "S4"),
    "communication": ("S3", "S4"),
}
REVERSIBLE = frozenset({"S2", "S3"})
TERMINAL = frozenset({"S4"})


@dataclass(frozen=True)
class Rise:
    """A rise the planner asked to localize again (a ``relocalize`` Decision): at
    ``iteration`` the level read ``level_s`` against the ``reference_s`` it held from
    ``reference_iteration``; the rise began at ``rise_iteration``; ``was_enough``: the
    strategy in effect had been judged enough."""

    iteration: int
    level_s: float
    reference_s: float
    reference_iteration: int
    rise_iteration: int
    was_enough: bool


@dataclass(frozen=True)
class Candidate:
    """One strategy for the planner's root cause, and where it stands: ``state`` is
    "applied", "failed", "unavailable" (no overhead measured) or "remaining"."""

    strategy: str
    overhead_s: float | None
    state: str


@dataclass(frozen=True)
class PlannerState:
    """Everything the planner holds that a caller may read, typed (:meth:`Planner.state`);
    :meth:`Planner.status` is the same as a plain dict, for events."""

    root_cause: str
    healthy_s: float
    onset: int
    last_iteration: int
    impact_s: float
    current: str
    pending: str | None
    finished: bool
    next: str | None
    candidates: tuple[Candidate, ...]
    applied: tuple[str, ...]
    failed: dict[str, str]
    judged: tuple[dict[str, Any], ...]
    #: the lowest level (rolling median) seen since the last settling, or None
    reference_s: float | None
    relocalizing: Rise | None


@dataclass(frozen=True)
class Decision:
    """What the planner asks the caller to do."""

    action: str  # "apply" | "revert" | "relocalize" (localize again before escalating)
    strategy: str
    iteration: int
    impact_s: float
    overhead_s: float | None
    reason: str


def _seconds(name: str, value: Any, *, positive: bool = False) -> float:
    """A finite, non-negative (or positive) number of seconds, or ValueError naming it."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if x < 0 or (positive and x == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return x


def _overhead(name: str, value: Any) -> float | None:
    return None if value is None else _seconds(name, value)


def _iteration(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer iteration number, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer iteration number, got {value!r}") from None


def _strategy(value: Any) -> str:
    if value not in STRATEGIES:
        raise ValueError(f"unknown strategy {value!r}; expected one of {', '.join(STRATEGIES)}")
    return value


def slowdown_removed(healthy_s: float, slow_s: float, mitigated_s: float) -> float | None:
    """Fraction of the slowdown a mitigation removed: (slow - mitigated) / (slow - healthy).

    1.0 means back to healthy, 0.0 no effect; a value below 0 means the mitigation made it
    worse and above 1 that it ran faster than the healthy baseline (not clamped). None if
    there was no slowdown to remove (``slow_s <= healthy_s``).
    """
    h = _seconds("healthy_s", healthy_s)
    s = _seconds("slow_s", slow_s)
    m = _seconds("mitigated_s", mitigated_s)
    if s <= h:
        return None
    return (s - m) / (s - h)


class Planner:
    """Ski-rental escalation S1 -> (S2) -> (S3) -> S4 for one fail-slow event.

    Usage: feed ``observe(iteration, iter_s)``; when it returns an ``apply`` Decision, apply
    the strategy and call ``applied(...)`` (or ``failed(...)``); call ``recovered(iteration)``
    when the fail-slow is over and perform the ``revert`` it may return.
    """

    def __init__(
        self,
        root_cause: str,
        healthy_s: float,
        overheads: dict[str, float | None],
        onset: int,
        *,
        enough_margin: float = 0.10,
        settle_iterations: int = 5,
        judge_iterations: int = 5,
        rise_margin: float | None = None,
    ) -> None:
        """``rise_margin``: ask for a re-localization when the level rises by this
        fraction over the lowest seen, or a strategy judged enough no longer is (None:
        never; the caller escalates whatever caused the rise)."""
        if root_cause not in CANDIDATES:
            raise ValueError(
                f"unknown root_cause {root_cause!r}; expected one of {', '.join(CANDIDATES)}"
            )
        self._root_cause = root_cause
        self._healthy = _seconds("healthy_s", healthy_s, positive=True)
        self._onset = _iteration("onset", onset)
        self._margin = _seconds("enough_margin", enough_margin)
        self._settle = _iteration("settle_iterations", settle_iterations)
        if self._settle < 0:
            raise ValueError(f"settle_iterations must be >= 0, got {settle_iterations!r}")
        self._judge_n = _iteration("judge_iterations", judge_iterations)
        if self._judge_n < 1:
            raise ValueError(f"judge_iterations must be >= 1, got {judge_iterations!r}")
        if overheads is None:
            overheads = {}
        if not isinstance(overheads, dict):
            raise ValueError(f"overheads must be a dict of strategy -> seconds, got {overheads!r}")
        self._overheads: dict[str, float | None] = {s: None for s in STRATEGIES[1:]}
        for name, value in overheads.items():
            _strategy(name)
            if name == "S1":  # S1 is implicit and free; accept and ignore it
                _overhead("overhead of S1", value)
                continue
            self._overheads[name] = _overhead(f"overhead of {name}", value)
        # Remaining (not yet applied or failed) candidates for this root cause.
        self._remaining: list[str] = list(CANDIDATES[root_cause])
        # candidates a widening added: they treat another fault than the strategy in
        # effect does, so they need not wait for its judgement
        self._complements: set[str] = set()
        self._applied: list[str] = []
        self._failed: dict[str, str] = {}
        self._impact = 0.0
        self._last_iteration = self._onset - 1
        self._current = "S1"
        self._pending: Decision | None = None
        self._cancelled: str | None = None  # pending at recovery time
        self._finished = False
        # Judging of the strategy in effect.
        self._applied_at: int | None = None
        self._window: deque[float] = deque(maxlen=self._judge_n)
        self._verdict: bool | None = None  # None: not judged yet
        self._judged: list[dict[str, Any]] = []
        self._history: list[dict[str, Any]] = []
        # Watching the level for a rise (re-localization).
        self._rise = None if rise_margin is None else _seconds("rise_margin", rise_margin, positive=True)
        self._levels: deque[tuple[int, float]] = deque(maxlen=self._judge_n)
        self._reference: tuple[int, float] | None = None  # (iteration, lowest rolling median)
        self._relocalizing: Rise | None = None  # the rise being localized
        self._quiet_until = -1  # no level recorded up to this iteration (after a re-localization)

    # -- read-only views --------------------------------------------------------------

    @property
    def impact_s(self) -> float:
        """Accumulated slow impact since onset, in seconds."""
        return self._impact

    @property
    def current(self) -> str:
        """The strategy currently in effect ("S1" until one has been applied)."""
        return self._current

    @property
    def finished(self) -> bool:
        """True once the fail-slow has recovered: the planner makes no further decision."""
        return self._finished

    @property
    def history(self) -> list[dict[str, Any]]:
        """Decisions, applications, failures and judgements, as plain dicts, in order."""
        return [dict(h) for h in self._history]

    def pending(self) -> str | None:
        """The strategy of the decision awaiting ``applied``/``failed``, or None."""
        return None if self._pending is None else self._pending.strategy

    def candidates(self) -> list[str]:
        """Remaining available candidates, in the order they would be escalated to."""
        order = {s: i for i, s in enumerate(STRATEGIES)}
        avail = [s for s in self._remaining if self._overheads[s] is not None]
        return sorted(avail, key=lambda s: (self._overheads[s], order[s]))

    def state(self) -> PlannerState:
        """The planner's state now, typed (a snapshot: later inputs do not change it)."""
        rows = []
        for s in CANDIDATES[self._root_cause]:
            if s in self._applied:
                state = "applied"
            elif s in self._failed:
                state = "failed"
            elif self._overheads[s] is None:
                state = "unavailable"
            else:
                state = "remaining"
            rows.append(Candidate(s, self._overheads[s], state))
        return PlannerState(
            root_cause=self._root_cause,
            healthy_s=self._healthy,
            onset=self._onset,
            last_iteration=self._last_iteration,
            impact_s=self._impact,
            current=self._current,
            pending=self.pending(),
            finished=self._finished,
            next=(self.candidates() or [None])[0],
            candidates=tuple(rows),
            applied=tuple(self._applied),
            failed=dict(self._failed),
            judged=tuple(dict(j) for j in self._judged),
            reference_s=None if self._reference is None else self._reference[1],
            relocalizing=self._relocalizing,
        )

    def status(self) -> dict[str, Any]:
        """:meth:`state` as a plain dict, for events and summaries (callers that decide
        read :meth:`state`)."""
        st = self.state()
        return {
            "root_cause": st.root_cause,
            "healthy_s": st.healthy_s,
            "onset": st.onset,
            "last_iteration": st.last_iteration,
            "impact_s": st.impact_s,
            "current": st.current,
            "pending": st.pending,
            "finished": st.finished,
            "next": st.next,
            "candidates": [asdict(c) for c in st.candidates],
            "applied": list(st.applied),
            "failed": dict(st.failed),
            "judged": [dict(j) for j in st.judged],
            "reference_s": st.reference_s,
            "relocalizing": None if st.relocalizing is None else asdict(st.relocalizing),
        }

    # -- inputs -----------------------------------------------------------------------

    def set_overhead(self, strategy: str, overhead_s: float | None) -> None:
        """Update a measured overhead (None: unavailable); the remaining order re-sorts."""
        _strategy(strategy)
        value = _overhead(f"overhead of {strategy}", overhead_s)
        if strategy == "S1" or self._overheads.get(strategy, "missing") == value:
            return  # unchanged: nothing to re-sort, and the history stays bounded
        self._overheads[strategy] = value
        self._history.append({"kind": "overhead", "strategy": strategy, "overhead_s": value})

    def observe(self, iteration: int, iter_s: float) -> Decision | None:
        """Account one observation; return an ``apply`` Decision when it is time to escalate."""
        it = _iteration("iteration", iteration)
        t = _seconds("iter_s", iter_s)
        if it < self._onset:
            raise ValueError(f"iteration {it} is before the onset {self._onset}")
        if it <= self._last_iteration:
            raise ValueError(
                f"iteration went backwards: {it} after {self._last_iteration} "
                "(iterations must strictly increase)"
            )
        if self._finished:
            self._last_iteration = it
            return None
        self._impact += (it - self._last_iteration) * max(0.0, t - self._healthy)
        self._last_iteration = it
        was_enough = self._verdict is True and self._applied_at is not None
        self._judge(it, t)
        if self._pending is not None:
            return None
        rise = self._watch_level(it, t, was_enough)
        if rise is not None or self._relocalizing is not None:
            return rise
        nxt = self.candidates()
        complement = bool(nxt) and nxt[0] in self._complements
        if self._applied_at is not None and self._verdict is None and not complement:
            return None  # the strategy in effect has not been judged yet
        if self._verdict is True:
            return None  # enough: keep it
        if self._current in TERMINAL:
            return None
        if not nxt:
            return None
        s = nxt[0]
        ov = self._overheads[s]
        assert ov is not None
        if self._impact < ov:
            return None
        why = f"impact {self._impact:.3f}s >= overhead {ov:.3f}s of {s}"
        if self._current != "S1":
            why += f" ({self._current} judged not enough)"
        if complement:
            why += f" (for the fault that joined; {self._current} not judged yet)"
        self._complements.discard(s)
        d = Decision("apply", s, it, self._impact, ov, why)
        self._pending = d
        self._history.append({"kind": "decision", **asdict(d)})
        return d

    def applied(
        self, strategy: str, iteration: int, overhead_s: float | None = None
    ) -> Decision | None:
        """The pending strategy has taken effect at ``iteration`` (its measured overhead).

        Returns None, except after a recovery that arrived while the strategy was in flight:
        then a reversible strategy gets a ``revert`` Decision right away.
        """
        s = _strategy(strategy)
        it = _iteration("iteration", iteration)
        ov = _overhead(f"overhead of {s}", overhead_s)
        if self._finished and self._cancelled == s:
            self._cancelled = None
            self._history.append(
                {"kind": "applied", "strategy": s, "iteration": it, "overhead_s": ov,
                 "impact_s": self._impact, "after_recovery": True}
            )
            if s in REVERSIBLE:
                d = Decision("revert", s, it, self._impact, None,
                             f"{s} took effect after the fail-slow recovered; "
                             "back to the original plan")
                self._history.append({"kind": "decision", **asdict(d)})
                return d
            return None
        p = self._check_pending(s)
        if it < p.iteration:
            raise ValueError(f"{s} cannot take effect at iteration {it}, before it was "
                             f"decided at iteration {p.iteration}")
        if ov is not None:
            self._overheads[s] = ov
        self._pending = None
        self._remaining.remove(s)
        self._applied.append(s)
        self._current = s
        self._applied_at = it
        self._window.clear()
        self._verdict = None
        self._history.append({"kind": "applied", "strategy": s, "iteration": it,
                              "overhead_s": self._overheads[s], "impact_s": self._impact})
        return None

    def failed(self, strategy: str, reason: str) -> None:
        """The pending strategy could not be applied: drop it from the candidates."""
        s = _strategy(strategy)
        if self._finished and self._cancelled == s:
            self._cancelled = None
            self._history.append({"kind": "failed", "strategy": s, "reason": str(reason),
                                  "impact_s": self._impact, "after_recovery": True})
            return
        self._check_pending(s)
        self._pending = None
        self._remaining.remove(s)
        self._failed[s] = str(reason)
        self._history.append({"kind": "failed", "strategy": s, "reason": str(reason),
                              "impact_s": self._impact})

    def relocalize(self, iteration: int, rise_iteration: int, reason: str) -> Decision | None:
        """The caller saw a fault the level does not show yet (a rank computing far slower
        than its peers): a ``relocalize`` Decision, as a rise would give, with the fault
        taken to begin at ``rise_iteration``. None while a decision is pending, a
        re-localization runs or the planner has finished."""
        it = _iteration("iteration", iteration)
        if self._finished or self._pending is not None or self._relocalizing is not None:
            return None
        ref_it, ref = self._reference if self._reference is not None else (self._onset, self._healthy)
        level = statistics.median(x for _, x in self._levels) if self._levels else ref
        return self._ask_relocalize(it, level, ref, min(ref_it, rise_iteration), rise_iteration,
                                    self._verdict is True and self._applied_at is not None, reason)

    def relocalized(self, found_new: bool) -> None:
        """The re-localization a ``relocalize`` Decision asked for is over (``found_new``:
        it named faults this fail-slow had not; widen the candidates first if they need
        other strategies). Decisions resume; the level, once settled, is the new reference:
        only a further rise asks again."""
        if self._relocalizing is None:
            raise ValueError("no re-localization was asked for")
        self._history.append({"kind": "relocalized", "iteration": self._last_iteration, "found_new": bool(found_new),
                              "impact_s": self._impact})
        self._relocalizing = None
        # the heartbeats' level lags the fault (each is a median of recent iterations):
        # let it settle, as after a strategy, before it is the reference again
        self._levels.clear()
        self._reference = None
        self._quiet_until = self._last_iteration + self._settle

    def widen(self, root_cause: str) -> list[str]:
        """A fault of another kind joined this fail-slow (a slow GPU under a congested
        link): the strategies for ``root_cause`` that were not applied or failed become
        candidates too, and one of them may be applied before the strategy in effect has
        been judged: it treats the fault that joined, not the one that strategy is for.
        Returns those added (none when the root cause adds nothing)."""
        if root_cause not in CANDIDATES:
            raise ValueError(f"unknown root_cause {root_cause!r}; expected one of {', '.join(CANDIDATES)}")
        added = [s for s in CANDIDATES[root_cause]
                 if s not in self._remaining and s not in self._applied and s not in self._failed]
        self._remaining += added
        self._complements.update(added)
        if set(CANDIDATES[root_cause]) >= set(CANDIDATES[self._root_cause]):
            self._root_cause = root_cause
        if added:
            self._history.append({"kind": "widened", "root_cause": root_cause, "added": list(added)})
        return added

    def recovered(self, iteration: int) -> Decision | None:
        """The fail-slow is over: revert S2/S3 if one is in effect, and finish for good."""
        it = _iteration("iteration", iteration)
        if self._finished:
            return None
        self._finished = True
        self._relocalizing = None
        if self._pending is not None:
            self._cancelled = self._pending.strategy
            self._pending = None
        d = None
        if self._current in REVERSIBLE:
            d = Decision("revert", self._current, it, self._impact, None,
                         f"fail-slow recovered; {self._current} reverted to the original plan")
        self._history.append({"kind": "recovered", "iteration": it, "impact_s": self._impact,
                              "current": self._current, "cancelled": self._cancelled,
                              "revert": None if d is None else d.strategy})
        if d is not None:
            self._history.append({"kind": "decision", **asdict(d)})
        return d

    # -- internals --------------------------------------------------------------------

    def _check_pending(self, s: str) -> Decision:
        if self._pending is None:
            raise ValueError(f"no decision is pending; {s} was not asked for")
        if self._pending.strategy != s:
            raise ValueError(f"{s} is not the pending strategy ({self._pending.strategy})")
        return self._pending

    def _watch_level(self, it: int, t: float, was_enough: bool) -> Decision | None:
        """A ``relocalize`` Decision when the level rose (see the module docstring), else None."""
        if self._rise is None or self._relocalizing is not None:
            return None
        if (self._applied_at is not None and it <= self._applied_at + self._settle) or it <= self._quiet_until:
            self._levels.clear()  # a strategy is taking effect, or the rise settling: the level is moving
            return None
        self._levels.append((it, t))
        if len(self._levels) < self._judge_n:
            return None
        level = statistics.median(x for _, x in self._levels)
        if self._reference is None or level < self._reference[1]:
            self._reference = (it, level)
            return None
        line = self._reference[1] * (1.0 + self._rise)
        no_longer = was_enough and self._verdict is False
        if level < line and not no_longer:
            return None
        # the first observation over the line (or the judged window's start): the rise's
        # onset as the heartbeats show it, at most a window late
        rise_at = next((i for i, x in self._levels if x >= min(line, level)), self._levels[0][0])
        why = (f"{self._current} was judged enough and no longer is (median {level:.3f}s)" if no_longer else
               f"level {level:.3f}s rose {self._rise:.0%} over the lowest seen, {self._reference[1]:.3f}s")
        return self._ask_relocalize(it, level, self._reference[1], self._reference[0], rise_at, was_enough, why)

    def _ask_relocalize(self, it: int, level: float, reference: float, reference_it: int, rise_it: int,
                        was_enough: bool, why: str) -> Decision:
        """Hold decisions for a re-localization of the rise at ``rise_it`` (the level then,
        the reference before it) and return the ``relocalize`` Decision that asks for it."""
        self._relocalizing = Rise(it, level, reference, reference_it, rise_it, was_enough)
        d = Decision("relocalize", self._current, it, self._impact, None, why + "; localize again before escalating")
        self._history.append({"kind": "decision", **asdict(d)})
        return d

    def _judge(self, it: int, t: float) -> None:
        if self._applied_at is None or self._pending is not None:
            return
        if it <= self._applied_at + self._settle:
            return  # still settling
        self._window.append(t)
        if len(self._window) < self._judge_n:
            return
        med = statistics.median(self._window)
        threshold = self._healthy * (1.0 + self._margin)
        enough = med <= threshold
        if enough == self._verdict:
            return
        first = self._verdict is None
        self._verdict = enough
        rec = {
            "kind": "judgement", "strategy": self._current, "iteration": it,
            "enough": enough, "median_s": med, "threshold_s": threshold,
            "impact_s": self._impact,
            "reason": "first judgement" if first else
                      ("back within the margin" if enough else "rose above the margin"),
        }
        self._judged.append({k: v for k, v in rec.items() if k != "kind"})
        self._history.append(rec)
