"""The rank side's message builders: what a rank sends the controller, made in one place.

The real ranks (``runtime/runtime.py`` and ``runtime/monitor.py``, ``control/client.py``,
``validate/suspension.py``) and the simulated ones (``experiments/des.py``,
``experiments/scale.py``) build their Heartbeat, FailSlowReport, ProfileData, SessionAck
and ValidationResult here, so a change to what a rank says is made once and the
simulators send what the ranks send:

- heartbeats: :func:`beat_iter_s` and :func:`beat_mb_s` (the windowed iteration time and
  compute per micro-batch), :func:`beat_fields` (what a heartbeat carries besides where
  the loop is), :func:`heartbeat` (none until the rank has an iteration time);
- fail-slow reports: :class:`EventReports` (which changes of a detector's events are
  reported, under ids unique over the run) and :func:`fail_slow_report`;
- :func:`profile_data` (groups as spans where evenly spaced);
- the suspension's acks, :func:`held_ack`, :func:`missed_ack`, :func:`resumed_ack`, and
  :func:`validation_result`.

Why in ``protocol/`` (the bottom layer, see tests/test_layers.py): the builders' users
sit at every layer from ``validate/`` (layer 2: a suspension's acks and result) and
``control/`` (layer 3: the client's heartbeat, profile and missed ack) up to ``runtime/``
(4) and ``experiments/`` (5), and a module imports only from its own layer or lower
ones, so the builders live below all of them, beside the messages they build. Like the
rest of ``protocol/`` they import no other falconext package (nor torch, nor redis) and
do no I/O: every time is an argument, nothing reads a clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from falconext.protocol.messages import FailSlowReport, Heartbeat, ProfileData, SessionAck, ValidationResult

# --- heartbeats ---------------------------------------------------------------------------


def beat_iter_s(starts: Sequence[float], window: int) -> float:
    """The heartbeat's iteration time from the loop's iteration start times (oldest
    first): the median of the gaps between the latest ``window`` + 1 starts (the
    configuration's ``beat_iter_window`` iterations); 0.0 (no heartbeat yet) with fewer
    than min(3, ``window`` + 1) starts. Reads only the last ``window`` + 1 entries."""
    recent = starts[-(window + 1):]
    if len(recent) < min(3, window + 1):
        return 0.0
    return statistics.median(b - a for a, b in zip(recent, recent[1:]))


def beat_mb_s(readings: Iterable[float]) -> float:
    """The heartbeat's compute seconds per micro-batch: the upper median of the rank's
    latest readings (it keeps the configuration's ``beat_compute_window`` of them), so a
    step in compute shows once half the window holds it; 0.0 (not measured yet) with none."""
    mb = sorted(readings)
    return mb[len(mb) // 2] if mb else 0.0


def beat_fields(*, replica: int, mb_s: float, micro: int, restart_s: float, switch_s: float,
                role: Mapping[str, int], score_iteration: int | None = None, est_iter_s: float = 0.0,
                compute_s: float = 0.0, wait_s: float = 0.0, into_s: float = -1.0,
                step: tuple[int, int, float] | None = None) -> dict[str, Any]:
    """A heartbeat's fields besides rank, node, iteration, iteration time and time (the
    keyword arguments of :class:`Heartbeat`): the rank's DP ``replica``, compute per
    micro-batch (:func:`beat_mb_s`), micro-batches per global batch, its S4 and S3 costs,
    its ``role`` (keys ``role``, ``stage``, ``tp``, ``pp``, ``grad_bytes``, ``act_bytes``;
    empty: not known yet), seconds into its current iteration (-1: unknown), and the
    latest straggler sample (the loop iteration ``score_iteration`` it ends at, the
    iteration, compute and waiting seconds estimated from calls) where there is one
    (``score_iteration`` None: none yet, the heartbeat's defaults stand), and the fast
    path's reading (``step``: the newest loop iteration judged, the run of iterations whose
    compute stepped up to it, the run's ratio over the rank's level; None: none yet)."""
    fields: dict[str, Any] = {
        "into_s": into_s,
        "replica": replica,
        "mb_s": mb_s,
        "restart_s": restart_s,
        "switch_s": switch_s,
        **role,
        "micro": micro,
    }
    if score_iteration is not None:
        fields.update(score_iteration=score_iteration, est_iter_s=est_iter_s, compute_s=compute_s, wait_s=wait_s)
    if step is not None:
        fields.update(step_iteration=step[0], step_run=step[1], step_ratio=step[2])
    return fields


def heartbeat(rank: int, node: int, iteration: int, iter_s: float, now: float,
              fields: Mapping[str, Any]) -> Heartbeat | None:
    """Rank ``rank``'s heartbeat at loop ``iteration`` with iteration time ``iter_s``
    (:func:`beat_iter_s`) and ``fields`` (:func:`beat_fields`), made at ``now``; None
    while the rank has no iteration or no iteration time yet (``iteration`` < 0,
    ``iter_s`` <= 0, e.g. falconext off): a rank that cannot say how fast it goes sends
    no heartbeat."""
    if iteration < 0 or iter_s <= 0:
        return None
    return Heartbeat(rank, node, iteration, iter_s, now, **fields)


# --- fail-slow reports --------------------------------------------------------------------

#: the kinds of change of a detector's event (also its event-log record's type)
FAIL_SLOW = "fail_slow"
FAIL_SLOW_UPDATE = "fail_slow_update"
FAIL_SLOW_END = "fail_slow_end"


class EventReports:
    """Which changes of one rank's detector events it reports, and under which id.

    A detector answers an iteration with the events whose state changed: a first
    sighting, a ladder step (the same fail-slow got slower) or its end. The rank reports
    the first sighting (:data:`FAIL_SLOW`) and the end (:data:`FAIL_SLOW_END`), not the
    ladder steps (:data:`FAIL_SLOW_UPDATE`: its event log has them). Ids are unique over
    the run: a detector started afresh (a longer period, a new role) numbers its events
    from 0 again, and its first event must not pass for a ladder step of an earlier one.
    """

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}  # (detector generation, its event id) -> reported id
        self._first: set[int] = set()  # reported ids whose first sighting was reported

    def event_id(self, generation: int, detector_id: int) -> int:
        """The run-wide id of event ``detector_id`` of the rank's ``generation``-th
        detector: the same pair always gets the same id, a new pair the next one."""
        key = (generation, detector_id)
        if key not in self._ids:
            self._ids[key] = len(self._ids)
        return self._ids[key]

    def kind(self, event_id: int, ended: bool) -> str:
        """What this change of event ``event_id`` is: :data:`FAIL_SLOW_END` if it
        ``ended``, else :data:`FAIL_SLOW` the first time (recorded as reported), and
        :data:`FAIL_SLOW_UPDATE` after."""
        if ended:
            return FAIL_SLOW_END
        if event_id in self._first:
            return FAIL_SLOW_UPDATE
        self._first.add(event_id)
        return FAIL_SLOW


def fail_slow_report(rank: int, kind: str, event_id: int, onset: int | None, detected_at: int | None,
                     slowdown: float, baseline_s: float, now: float, end: int | None = None,
                     ended_at: int | None = None) -> FailSlowReport | None:
    """Rank ``rank``'s report of a change of ``kind`` (:meth:`EventReports.kind`) to its
    event ``event_id`` (:meth:`EventReports.event_id`), its iterations already mapped
    to the training loop's: None where the rank says nothing (a ladder step, or an event
    whose onset has no loop iteration). ``detected_at`` falls back to the onset; an end
    report's end is ``end``, else ``ended_at`` (when the recovery was confirmed), else
    the onset; any other report has no end. Made at ``now``."""
    if kind == FAIL_SLOW_UPDATE or onset is None:
        return None
    stop = (end or ended_at or onset) if kind == FAIL_SLOW_END else None
    return FailSlowReport(rank, int(onset), int(detected_at or onset), float(slowdown), float(baseline_s), now,
                          int(event_id), None if stop is None else int(stop))


# --- profiles -----------------------------------------------------------------------------


def profile_data(rank: int, session: int, roles: Mapping[str, str], members: Mapping[str, Sequence[int]],
                 calls: Mapping[str, list[list[float]]], fabric: str = "", nccl_algo: str | None = None) -> ProfileData:
    """Rank ``rank``'s profile for session ``session``: its groups (id -> role, id ->
    members in group order), its calls on them (``[k, t_issue, t_end, bytes]`` rows, k
    the call's index among its calls on the group) and what its collectives run on;
    every group of three or more evenly spaced ascending ranks travels as a span
    (:meth:`ProfileData.compact`)."""
    return ProfileData.compact(rank, session, dict(roles),
                               {g: m if isinstance(m, range) else list(m) for g, m in members.items()}, dict(calls),
                               fabric, nccl_algo)


# --- a suspension: acks and the validation's result ------------------------------------------


def held_ack(rank: int, session: int, iteration: int, now: float) -> SessionAck:
    """Rank ``rank`` is trapped at ``iteration``, the one agreed for ``session``, and
    waits for go (a rank says so again while it waits: one lost ack must not cost the
    suspension)."""
    return SessionAck(rank, session, "held", iteration, now)


def missed_ack(rank: int, session: int, iteration: int, now: float) -> SessionAck:
    """Rank ``rank`` will not hold for ``session``: its loop is already at ``iteration``,
    past the agreed one (or it dropped the suspension, e.g. falconext turned off)."""
    return SessionAck(rank, session, "missed", iteration, now)


def resumed_ack(rank: int, session: int, iteration: int, now: float, pause_s: float, expired: bool,
                committed: bool) -> SessionAck:
    """Rank ``rank`` trains on after holding ``pause_s`` seconds at ``iteration`` for
    ``session``: ``expired`` when go never came before its deadline, ``committed`` when
    the session's action is applied from ``iteration`` + 1 (every rank agreed)."""
    return SessionAck(rank, session, "resumed", iteration, now, pause_s, expired, committed)


def validation_result(rank: int, session: int, gemm_flops: float | None, links: Iterable[Sequence[float]],
                      error: str = "") -> ValidationResult:
    """Rank ``rank``'s validation result for ``session``: its GEMM FLOP/s (None: it ran
    no GEMM), one ``[src, dst, seconds]`` row per link it received on (``links``: (src,
    dst, seconds) triples, in order), and ``error`` saying why it is partial or what
    failed (empty: complete)."""
    return ValidationResult(rank, session, gemm_flops, [[int(s), int(d), float(sec)] for s, d, sec in links], error)
