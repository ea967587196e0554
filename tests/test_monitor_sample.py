"""The straggler sample a rank's heartbeat carries (falconext/runtime/monitor.py:
RankMonitor.score_sample) is the median over the rank's newest ``score_window`` loop
iterations, one estimate each, the same ones estimates.csv gets: Prometheus pairs the two."""

from __future__ import annotations

import statistics
from pathlib import Path

from falconext.config import FalconConfig
from falconext.protocol.eventlog import EventLog
from falconext.runtime.monitor import RankMonitor
from falconext.trace.records import CallRecord

#: a data-parallel iteration's calls: (op, bytes)
PATTERN = [("all_reduce", 4096), ("all_gather", 8192), ("all_reduce", 4096), ("reduce_scatter", 8192),
           ("all_reduce", 1 << 20), ("all_reduce", 4)]


def _calls(computes: list[float], merged: set[int] = frozenset()) -> tuple[list[CallRecord], list[float]]:
    """A rank's calls and loop starts: iteration ``i`` computes ``computes[i]`` seconds, then
    calls. The loop starts of ``merged`` iterations are left out: the loop iteration before
    each then holds two iterations of calls (a loop that runs an extra pass, as a switch's does)."""
    recs, starts = [], []
    t, seq = 1.0, 0
    for it, compute in enumerate(computes):
        if it not in merged:
            starts.append(t)
        t += compute
        for op, nbytes in PATTERN:
            recs.append(CallRecord(0, op, "dp:0,1", nbytes, t, None, t + 0.004, seq))
            seq += 1
            t += 0.01
    starts.append(t)
    return recs, starts


def _job(iterations: int, merged: set[int]) -> tuple[list[CallRecord], list[float]]:
    """Iterations that slow down by 3% each (so a window one iteration off has another median)."""
    return _calls([0.2 * 1.03 ** it for it in range(iterations)], merged)


def test_the_heartbeat_sample_is_the_median_of_the_newest_window_of_estimates(tmp_path: Path) -> None:
    cfg = FalconConfig()
    recs, starts = _job(60, merged={30, 41})
    batches = [recs[i:i + len(PATTERN)] for i in range(0, len(recs), len(PATTERN))]
    mon = RankMonitor(lambda: batches.pop(0) if batches else [], cfg, 0, starts,
                      EventLog(str(tmp_path / "events.jsonl")), None)
    checked = 0
    while batches:
        mon._process()
        if mon.score_sample is None:
            continue
        n, sample = mon.score_sample
        window = sorted(i for i in mon.estimates if i <= n)[-cfg.score_window:]
        assert sample.iter_s == statistics.median(mon.estimates[i] for i in window), n
        checked += 1
    # the two merged loop iterations each got a second estimate, which replaced the first
    assert len(mon.estimates) < 58 and checked >= 40, (len(mon.estimates), checked)


def _stepped_job(iterations: int, onset: int, factor: float) -> tuple[list[CallRecord], list[float]]:
    """0.2 s of compute an iteration, ``factor`` x from iteration ``onset`` on."""
    return _calls([0.2 * (factor if it >= onset else 1.0) for it in range(iterations)])


def test_the_heartbeat_carries_the_run_of_iterations_whose_compute_stepped_up(tmp_path: Path) -> None:
    """The fast path's reading (step_sample) comes from the rank's own calls: a 2x compute
    step at iteration 30 reads as a run that began at 30, at the ratio of the time outside
    calls after and before; restep() (a new plan)
    makes the rank learn its level again."""
    cfg = FalconConfig()
    recs, starts = _stepped_job(40, 30, 2.0)
    batches = [recs[i:i + len(PATTERN)] for i in range(0, len(recs), len(PATTERN))]
    mon = RankMonitor(lambda: batches.pop(0) if batches else [], cfg, 0, starts,
                      EventLog(str(tmp_path / "events.jsonl")), None)
    seen: dict[int, tuple[int, float]] = {}
    while batches:
        mon._process()
        if mon.step_sample is not None:
            n, run, ratio = mon.step_sample
            seen[n] = (run, ratio)
    assert all(run == 0 for n, (run, _) in seen.items() if n < 30), seen
    last = max(seen)
    assert last >= 36 and seen[last][0] == last - 30 + 1, seen
    gaps = len(PATTERN) * 0.006  # between the calls: time outside them too
    assert abs(seen[last][1] - (0.4 + gaps) / (0.2 + gaps)) < 0.01
    mon.restep()
    mon._feed_step(last + 1, 0.4)
    assert mon.step_sample == (last + 1, 0, 1.0)
