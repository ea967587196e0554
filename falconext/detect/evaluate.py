"""Scoring detectors on labelled traces, as in the paper's Tables 4 and 5.

The paper scores per job; its denominators are not fully consistent, so we fix ours:
- a detected event *matches* a label when its onset lies in
  ``[label.onset - tolerance, label.end)``; each label takes at most one detection, and
  every further detection inside the same label (an event split in two) is a false alarm;
- **accuracy**: traces judged entirely right (every label detected, no false alarm) over
  all traces;
- **FPR**: healthy traces (no label) with at least one alarm over healthy traces;
- **FNR**: labels never detected over all labels;
- plus false alarms counted over every trace, and the median detection delay
  (``detected_at - label.onset`` over matched labels) and onset error.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Iterable, Sequence

from falconext.detect.events import FailSlowEvent

Label = tuple[int, "int | None", float]


@dataclass(frozen=True)
class TraceScore:
    """One detector's result on one labelled trace: how many labels it had and detected, its
    false alarms, and per matched label the detection delay and the onset error
    (iterations)."""

    labels: int
    detected: int
    false_alarms: int
    delays: tuple[int, ...]
    onset_errors: tuple[int, ...]

    @property
    def correct(self) -> bool:
        """True when every label was detected and nothing else was (the trace counts for accuracy)."""
        return self.detected == self.labels and self.false_alarms == 0


def score_trace(events: Sequence[FailSlowEvent], labels: Sequence[Label], tolerance: int = 10) -> TraceScore:
    """Match ``events`` to ``labels`` (onset, end or None, slowdown) as the module docstring
    says: an event matches the first label whose ``[onset - tolerance, end)`` holds its
    onset; each label takes one event, every other event is a false alarm."""
    matched: dict[int, FailSlowEvent] = {}
    false_alarms = 0
    for ev in sorted(events, key=lambda e: e.onset):
        hit = None
        for k, (onset, end, _) in enumerate(labels):
            stop = end if end is not None else float("inf")
            if onset - tolerance <= ev.onset < stop:
                hit = k
                break
        if hit is None or hit in matched:
            false_alarms += 1
        else:
            matched[hit] = ev
    delays = tuple(matched[k].detected_at - labels[k][0] for k in sorted(matched))
    errors = tuple(abs(matched[k].onset - labels[k][0]) for k in sorted(matched))
    return TraceScore(len(labels), len(matched), false_alarms, delays, errors)


@dataclass(frozen=True)
class Summary:
    """The scores of many traces together (module docstring): counts and medians, with the rates as
    properties."""

    traces: int
    correct: int
    healthy: int
    healthy_alarmed: int
    labels: int
    missed: int
    false_alarms: int
    median_delay: float | None
    median_onset_error: float | None

    @property
    def accuracy(self) -> float:
        """Share of traces judged entirely right; NaN for no traces."""
        return self.correct / self.traces if self.traces else float("nan")

    @property
    def fpr(self) -> float:
        """Share of healthy traces with at least one alarm; 0.0 when there is no healthy trace."""
        return self.healthy_alarmed / self.healthy if self.healthy else 0.0

    @property
    def fnr(self) -> float:
        """Share of labels never detected; 0.0 when there is no label."""
        return self.missed / self.labels if self.labels else 0.0

    def to_dict(self) -> dict:
        """The summary as JSON-able values, rates in percent (2 decimals) with their ``n/total`` beside
        them."""
        return {
            "accuracy": round(100 * self.accuracy, 2),
            "accuracy_n": f"{self.correct}/{self.traces}",
            "fpr": round(100 * self.fpr, 2),
            "fpr_n": f"{self.healthy_alarmed}/{self.healthy}",
            "fnr": round(100 * self.fnr, 2),
            "fnr_n": f"{self.missed}/{self.labels}",
            "false_alarms": self.false_alarms,
            "median_delay": self.median_delay,
            "median_onset_error": self.median_onset_error,
        }


def summarize(scores: Iterable[TraceScore]) -> Summary:
    """Add up per-trace scores into one :class:`Summary`; medians are None when nothing was matched."""
    scores = list(scores)
    delays = [d for s in scores for d in s.delays]
    errors = [e for s in scores for e in s.onset_errors]
    healthy = [s for s in scores if s.labels == 0]
    return Summary(
        traces=len(scores),
        correct=sum(s.correct for s in scores),
        healthy=len(healthy),
        healthy_alarmed=sum(s.false_alarms > 0 for s in healthy),
        labels=sum(s.labels for s in scores),
        missed=sum(s.labels - s.detected for s in scores),
        false_alarms=sum(s.false_alarms for s in scores),
        median_delay=float(median(delays)) if delays else None,
        median_onset_error=float(median(errors)) if errors else None,
    )
