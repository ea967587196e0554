"""The files a training run leaves behind, and its summary.

Each rank writes its own measured and estimated iteration times; rank 0 merges them into
``iterations.csv`` / ``estimates.csv`` (columns ``rank,iteration,iter_time_s,loss``) and
computes ``summary.json``. ``estimates.csv`` adds each estimated iteration's split into
compute and waiting (``compute_s``, ``wait_s``: time outside and inside calls) and the
rank's straggler score against its peers at that iteration (``late_s``, ``score``:
detect/scores.py). The summary scores detection against the injected faults of
``run.json``; that is evaluation after the fact, the detector never saw them.

With falconext on, each rank also leaves ``ranks/overhead-<rank>.json`` (what falconext
cost it in CPU seconds, from ``FalconRuntime.overhead()``); the summary's ``overhead``
object turns these into CPU seconds per iteration and a share of the iteration time.
"""

from __future__ import annotations

import csv
import glob
import json
import os
from statistics import fmean, median, pstdev
from typing import Any, Sequence

from falconext.detect.scores import RankSample, rank_scores
from falconext.mitigate.planner import slowdown_removed
from falconext.report.plans import plan_shape, plans_by_attempt
from falconext.report.device import ceiling_from_run, device_figures, device_iteration_times

HEADER = ["rank", "iteration", "iter_time_s", "loss"]
#: estimates.csv: the split of each estimated iteration, and the rank's score at it
SCORE_COLUMNS = ["compute_s", "wait_s", "late_s", "score"]


#: components of falconext's CPU time, as FalconRuntime.cpu_seconds() names them
OVERHEAD_PARTS = ("hooks", "monitor", "client", "suspension", "total")


class EstimatesFile:
    """A rank's ``ranks/estimates-<rank><suffix>.csv``, written in parts: a long job's
    monitor hands over its oldest estimates as it goes (memory stays bounded), and
    :func:`write_rank_files` adds the rest at the end."""

    def __init__(self, out: str, rank: int, suffix: str = "") -> None:
        self.path = os.path.join(out, "ranks", f"estimates-{rank}{suffix}.csv")
        self.rank = rank
        self._started = False

    def write(self, rows: list[tuple[int, float, tuple[float, float] | None]]) -> None:
        """Append (iteration, seconds, (compute, waiting) or None) rows; the first write
        starts the file afresh."""
        with open(self.path, "a" if self._started else "w", newline="") as f:
            w = csv.writer(f)
            for it, secs, split in rows:
                cells = ["", ""] if split is None else [f"{split[0]:.6f}", f"{split[1]:.6f}"]
                w.writerow([self.rank, it, f"{secs:.6f}", "", *cells])
        self._started = True


def write_rank_files(
    out: str, rank: int, measured: list[tuple[int, float, float | None]], estimates: dict[int, float], suffix: str = "",
    overhead: dict[str, Any] | None = None, splits: dict[int, tuple[float, float]] | None = None,
    estimates_file: EstimatesFile | None = None,
) -> None:
    """``suffix`` names a restarted attempt's files, so they add to the first attempt's;
    ``overhead`` (``FalconRuntime.overhead()``) goes to ``overhead-<rank><suffix>.json``;
    ``splits`` holds each estimated iteration's (compute, waiting) seconds;
    ``estimates_file``: where the monitor already wrote its older estimates."""
    if overhead is not None:
        with open(os.path.join(out, "ranks", f"overhead-{rank}{suffix}.json"), "w") as f:
            json.dump(dict(overhead, rank=rank), f)
    with open(os.path.join(out, "ranks", f"iterations-{rank}{suffix}.csv"), "w", newline="") as f:
        w = csv.writer(f)
        for it, secs, loss in measured:
            w.writerow([rank, it, f"{secs:.6f}", "" if loss is None else f"{loss:.6f}"])
    (estimates_file or EstimatesFile(out, rank, suffix)).write(
        [(it, estimates[it], (splits or {}).get(it)) for it in sorted(estimates)])


def _merge(out: str, kind: str, run: dict | None = None) -> list[list[str]]:
    """Every rank's ``kind`` rows in one file, by iteration then rank; estimates get
    their scores (``run``: the run's topology names the peers)."""
    rows: list[list[str]] = []
    for path in glob.glob(os.path.join(out, "ranks", f"{kind}-*.csv")):
        with open(path, newline="") as f:
            rows.extend(csv.reader(f))
    rows.sort(key=lambda r: (int(r[1]), int(r[0])))
    header = HEADER
    if kind == "estimates":
        rows, header = _scored(rows, (run or {}).get("topology") or {}), HEADER + SCORE_COLUMNS
    with open(os.path.join(out, f"{kind}.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return rows


def _scored(rows: list[list[str]], topology: dict[str, Any]) -> list[list[str]]:
    """Estimate rows with ``late_s`` and ``score`` added: each rank against its peers (same
    pipeline stage and tensor-parallel index) at the same iteration. Rows without a split
    (as older runs wrote them) get empty cells."""
    roles = {int(d["rank"]): (int(d["pp_rank"]), int(d["tp_rank"]))
             for d in topology.get("ranks") or [] if isinstance(d, dict) and {"rank", "pp_rank", "tp_rank"} <= set(d)}
    by_iter: dict[str, dict[int, RankSample]] = {}
    for r in rows:
        if len(r) >= 6 and r[4] and r[5]:
            by_iter.setdefault(r[1], {})[int(r[0])] = RankSample(float(r[2]), float(r[4]), float(r[5]))
    scores = {it: rank_scores(samples, roles) for it, samples in by_iter.items()}
    out = []
    for r in rows:
        score = scores.get(r[1], {}).get(int(r[0]))
        out.append((r + ["", ""])[:6] + (["", ""] if score is None else [f"{score.late_s:.6f}", f"{score.score:.4f}"]))
    return out


def read_events(out: str) -> list[dict[str, Any]]:
    """Every record of ``out``/events.jsonl in file order (blank lines skipped); an empty list when there
    is no such file."""
    path = os.path.join(out, "events.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_overheads(out: str) -> dict[int, dict[str, Any]]:
    """Each rank's overhead files, a restarted job's attempts added up: CPU seconds by
    component, iterations, hook calls and samples summed; every attempt's toggles."""
    merged: dict[int, dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(out, "ranks", "overhead-*.json"))):
        with open(path) as f:
            part = json.load(f)
        rank = int(part["rank"])
        into = merged.setdefault(rank, {"rank": rank, "cpu_s": {}, "cpu_off_s": {}, "iterations": 0,
                                        "hook_calls": 0, "hook_samples": 0, "toggles": []})
        for key in ("cpu_s", "cpu_off_s"):
            for k, v in part.get(key, {}).items():
                into[key][k] = into[key].get(k, 0.0) + float(v)
        for k in ("iterations", "hook_calls", "hook_samples"):
            into[k] += int(part.get(k, 0))
        into["toggles"].extend(part.get("toggles", []))
    return merged


def toggle_split(
    times: dict[int, float], toggles: list, skip: int = 1, first: int = 0
) -> tuple[list[float], list[float]]:
    """Iteration times with falconext on and with it off, in iteration order.

    ``toggles``: ``[iteration, on]`` as ``FalconRuntime.set_enabled`` recorded them
    (falconext is on before the first). Left out: iterations before ``first`` (warm-up)
    and the first ``skip`` of each phase after a toggle (a toggle's own iteration pays
    for installing or removing the tracer, which is no part of either state's cost).
    """
    changes = sorted((int(it), bool(on)) for it, on in toggles)
    on_times: list[float] = []
    off_times: list[float] = []
    for it in sorted(times):
        if it < first:
            continue
        state, since = True, None
        for t_it, t_on in changes:
            if t_it > it:
                break
            state, since = t_on, t_it
        if since is not None and it < since + skip:
            continue
        (on_times if state else off_times).append(times[it])
    return on_times, off_times


def overhead_figures(per_rank: dict[int, dict[str, Any]], steady: dict[int, float]) -> dict[str, Any] | None:
    """falconext's CPU seconds per iteration (with falconext on) by component, per rank
    and mean/max over ranks, and ``cpu_share``: the total per iteration over the median
    iteration time with falconext on (None where no rank ran an iteration with it on).
    Per rank also ``off_total_s``: CPU seconds its idle threads used while it was off.

    ``steady``: median measured seconds per loop iteration over ranks. When the run
    toggled falconext (``--bench-falcon-toggle``), ``toggle`` holds the median
    iteration time on and off (first iteration of each phase left out) and their ratio.
    """
    ranks = {r: o for r, o in sorted(per_rank.items()) if o.get("iterations", 0) > 0}
    if not ranks:
        return None
    per_iter = {
        r: {k: o["cpu_s"].get(k, 0.0) / o["iterations"] for k in OVERHEAD_PARTS} for r, o in ranks.items()
    }
    toggles = next(iter(ranks.values())).get("toggles") or []
    on_times, off_times = toggle_split(steady, toggles)
    iter_s = median(on_times) if on_times else None
    mean_total = sum(p["total"] for p in per_iter.values()) / len(per_iter)
    max_total = max(p["total"] for p in per_iter.values())
    figures: dict[str, Any] = {
        "per_iteration_s": {
            k: {"mean": round(sum(p[k] for p in per_iter.values()) / len(per_iter), 9),
                "max": round(max(p[k] for p in per_iter.values()), 9)}
            for k in OVERHEAD_PARTS
        },
        "ranks": {
            str(r): dict({k: round(v, 9) for k, v in per_iter[r].items()}, iterations=o["iterations"],
                         hook_calls=o.get("hook_calls", 0), hook_samples=o.get("hook_samples", 0),
                         off_total_s=round(o.get("cpu_off_s", {}).get("total", 0.0), 6))
            for r, o in ranks.items()
        },
        "iter_s": round(iter_s, 6) if iter_s else None,
        "cpu_share": {"mean": round(mean_total / iter_s, 6), "max": round(max_total / iter_s, 6)} if iter_s else None,
        "toggle": None,
    }
    if toggles:
        off_s = median(off_times) if off_times else None
        figures["toggle"] = {
            "on_iter_s": figures["iter_s"], "off_iter_s": round(off_s, 6) if off_s else None,
            "on_off_ratio": round(iter_s / off_s, 4) if iter_s and off_s else None,
            "on_iterations": len(on_times), "off_iterations": len(off_times),
        }
    return figures


def finalize(out: str) -> dict[str, Any]:
    """Merge the ranks' files of run ``out`` into ``summary.json`` (measured and estimated
    iteration times, events scored against the injected faults, overheads, control-plane
    restarts, device figures) and return the summary."""
    with open(os.path.join(out, "run.json")) as f:
        run = json.load(f)
    measured = _merge(out, "iterations")
    estimated = _merge(out, "estimates", run)
    events = read_events(out)
    summary = summarize(measured, estimated, events, run, overheads=read_overheads(out))
    control = os.path.join(out, "control.json")
    if os.path.exists(control):  # the supervisor's restarts of Redis, controller and agents
        with open(control) as f:
            summary["reliability"]["restarts"] = dict(json.load(f).get("restarts") or {})
    first = min((int(r[1]) for r in measured), default=0)  # rows: rank, iteration, ...
    summary["mitigation"]["attempts"] = plans_by_attempt(events, first, *plan_shape(run))
    _add_device_figures(out, run, summary, events)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


#: the figures of the slowdown and its removal, which an emulated run takes from its
#: devices' records (the wall clock's stay beside them, under ``wall_clock``)
TIMING_KEYS = ("healthy_iter_s", "slow_iter_s", "mitigated_iter_s", "slowdown_removed", "s2_iter_s",
               "s2_slowdown_removed")


def _add_device_figures(out: str, run: dict, summary: dict[str, Any], events: list[dict]) -> None:
    """With the emulated device: its accounting, S2's ceiling beside the measured share,
    and the slowdown's figures on the devices' own time. The device is the bed's GPU: the
    wall clock adds the host's own work, which four ranks on two cores do together while
    healthy and apart while one is slow, so its healthy time is inflated and its shares
    pass what any plan can reach (0.85 of a 0.75 ceiling, 2026-12-02); the wall clock's
    figures stay under ``wall_clock``. ``timing`` says which the figures are: the wall
    clock's where the run has no device records, or where its links were real and a link
    fault slowed them (the records hold no link time then; a constant real link time
    beside a compute fault changes no share), and in a pipeline (PP > 1), whose iteration
    is the schedule's critical path through the stages, bubbles included, which no one
    process's busy time holds (a consolidation read 0.178 s on the records where the
    planner's exact model and the wall clock said 0.28)."""
    topo = run.get("topology") or {}
    world = int(topo.get("world", 0))
    device = summary["device"] = device_figures(out, world) if world else None
    summary["timing"] = "wall_clock"
    blind = device is not None and (
        (device["real_links"] and any(f.get("kind") == "link" for f in run.get("faults") or []))
        or int(topo.get("pp", 1) or 1) > 1)
    times = device_iteration_times(out, world) if device is not None and not blind else None
    if times:
        on_device = summarize([[0, it, secs, ""] for it, secs in sorted(times.items())], [], events, run)
        summary["wall_clock"] = {k: summary.get(k) for k in TIMING_KEYS}
        summary.update({k: on_device[k] for k in TIMING_KEYS})
        summary["timing"] = "device"
    ceiling = ceiling_from_run(out, run) if device is not None else None
    summary["slowdown_removed_max"] = None if ceiling is None else round(ceiling["removed_max"], 4)
    summary["s2_best_plan"] = None if ceiling is None else ceiling["plan"]
    summary["slowdown_removed_ceiling"] = removal_ceiling(summary)


def summarize(measured: list[list[str]], estimated: list[list[str]], events: list[dict], run: dict,
              overheads: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The run's key figures from its rows, events and configuration; ``overhead`` from
    the ranks' overhead files (:func:`read_overheads`), None without them."""
    by_iter: dict[int, list[float]] = {}
    meas: dict[tuple[int, int], float] = {}
    for rank, it, secs, _loss in measured:
        by_iter.setdefault(int(it), []).append(float(secs))
        meas[(int(rank), int(it))] = float(secs)
    steady = {it: median(v) for it, v in by_iter.items() if it > 0}  # iteration 0 is warm-up
    faults = run.get("faults", [])

    def in_fault(it: int) -> bool:
        return any(f["start"] <= it and (f["end"] is None or it < f["end"]) for f in faults)

    healthy = [v for it, v in steady.items() if not in_fault(it)]
    applied = [e for e in events if e.get("type") == "mitigation" and e.get("strategy") in ("S2", "S3", "S4")]
    first_fix = min((int(e["iteration"]) for e in applied), default=None)
    slow = [v for it, v in steady.items() if in_fault(it) and (first_fix is None or it < first_fix)]
    mitigated = [v for it, v in steady.items() if in_fault(it) and first_fix is not None and it >= first_fix + SETTLE]
    errors = []
    for rank, it, secs, *_ in estimated:
        key = (int(rank), int(it))
        if key in meas and int(it) > 0:
            errors.append(abs(float(secs) - meas[key]) / meas[key])
    losses = [float(r[3]) for r in measured if r[3]]
    fail_slows = [e for e in events if e.get("type") == "fail_slow"]
    summary: dict[str, Any] = {
        "iterations": len(by_iter),
        "median_iter_s": round(median(steady.values()), 6) if steady else None,
        "healthy_iter_s": round(median(healthy), 6) if healthy else None,
        "slow_iter_s": round(median(slow), 6) if slow else None,
        "healthy_iter_cv": healthy_cv(steady, in_fault, paused_iterations(events)),
        "final_loss": round(losses[-1], 6) if losses else None,
        "falcon": run.get("falcon_config") is not None,
        "estimates": {
            "count": len(estimated),
            "coverage": round(len(estimated) / len(measured), 4) if measured else 0.0,
            "median_rel_error": round(median(errors), 6) if errors else None,
            "p90_rel_error": round(sorted(errors)[int(0.9 * (len(errors) - 1))], 6) if errors else None,
        },
        "detection": detection_figures(fail_slows, faults,
                                       [e for e in events if e.get("type") == "straggler_suspected"]),
        "suspicions": suspicion_figures(events),
        "localization": localization_figures(events),
        "reliability": reliability_figures(events),
    }
    summary["mitigated_iter_s"] = round(median(mitigated), 6) if mitigated else None
    summary["slowdown_removed"] = _share(healthy, slow, mitigated)
    # S2's own share: from the first S2 until the first mitigation that is not S2 (an S3 or
    # S4 restart's later speed is not S2's), or the run's end
    s2 = s2_window(applied)
    s2_times = [] if s2 is None else [v for it, v in steady.items() if in_fault(it) and s2[0] + SETTLE <= it
                                      and (s2[1] is None or it < s2[1])]
    summary["s2_iter_s"] = round(median(s2_times), 6) if s2_times else None
    summary["s2_slowdown_removed"] = _share(healthy, slow, s2_times)
    summary["mitigation"] = mitigation_figures(events, steady)
    summary["overhead"] = overhead_figures(overheads, steady) if overheads else None
    return summary


def _share(healthy: list[float], slow: list[float], mitigated: list[float]) -> float | None:
    """:func:`slowdown_removed` of the three spans' medians, to 4 decimals; None where a
    span is empty or nothing was slow."""
    if not (healthy and slow and mitigated):
        return None
    removed = slowdown_removed(median(healthy), median(slow), median(mitigated))
    return None if removed is None else round(removed, 4)


#: how far a share measured on the wall clock may pass its ceiling before the summary calls
#: it a measuring error (the host's own time in the healthy or slow iterations)
CEILING_SLACK = 0.05


def above_ceiling_note(share: float | None, ceiling: float | None) -> str:
    """The summary's note on a share above what any plan reaches (by more than
    :data:`CEILING_SLACK`), or "" where it is not."""
    if share is None or ceiling is None or share <= ceiling + CEILING_SLACK:
        return ""
    return (" (above what any plan can reach: a measuring error, the host's own time in the healthy "
            "or slow iterations; the device's overruns below say how much)")


def s2_window(applied: list[dict]) -> tuple[int, int | None] | None:
    """The iterations S2 alone was the mitigation in force: from the first S2 to the first
    later S3 or S4 (None: the run's end); None without an S2 before any other strategy."""
    order = sorted(applied, key=lambda e: int(e["iteration"]))
    if not order or order[0].get("strategy") != "S2":
        return None
    later = [int(e["iteration"]) for e in order if e.get("strategy") != "S2"]
    return int(order[0]["iteration"]), (later[0] if later else None)


def removal_ceiling(summary: dict[str, Any]) -> float | None:
    """The most of the slowdown the run's mitigations could remove: S2's best integer plan
    (``slowdown_removed_max``) where S2 alone mitigated, all of it (1.0) where a restart or
    topology change took the slow part out of the job's path; None where the ceiling is
    not known (no device records to compute S2's from)."""
    strategies = {row["strategy"] for row in (summary.get("mitigation") or {}).get("applied", [])}
    if strategies & {"S3", "S4"}:
        return 1.0
    if strategies == {"S2"}:
        return summary.get("slowdown_removed_max")
    return None


#: iterations at the start of a job whose times are not steady yet (imports, first
#: allocations, the S3 probe at iteration 3)
WARMUP = 10


def paused_iterations(events: list[dict]) -> set[int]:
    """Iterations in which falconext held training (a suspension, a topology switch or
    probe): their time is falconext's pause, reported on its own, not the device's."""
    kinds = ("suspension", "topology_switch")
    return {int(e["iteration"]) for e in events if e.get("type") in kinds and isinstance(e.get("iteration"), int)}


def healthy_cv(steady: dict[int, float], in_fault, paused: set[int] = frozenset()) -> float | None:
    """Coefficient of variation (std / mean) of the iteration time over the healthy
    iterations after the warm-up that falconext did not pause, or None with fewer than
    two of them."""
    vals = [v for it, v in steady.items() if it >= WARMUP and not in_fault(it) and it not in paused]
    if len(vals) < 2:
        return None
    return round(pstdev(vals) / fmean(vals), 6)


#: iterations after a mitigation takes effect that are not counted as "mitigated" (the
#: first ones after a plan switch or a restart carry its transient)
SETTLE = 5


def mitigation_figures(events: list[dict], steady: dict[int, float]) -> dict[str, Any]:
    """Each strategy applied: from which iteration, its plan, its cost, and the median
    iteration time while it was the one in effect."""
    applied = sorted((e for e in events if e.get("type") == "mitigation"), key=lambda e: int(e["iteration"]))
    rows = []
    for k, e in enumerate(applied):
        start = int(e["iteration"])
        end = int(applied[k + 1]["iteration"]) if k + 1 < len(applied) else None
        span = [v for it, v in steady.items() if it >= start + SETTLE and (end is None or it < end)]
        rows.append({
            "strategy": e["strategy"], "iteration": start, "trigger": e.get("trigger"),
            "plan": e.get("plan"), "exclude_nodes": e.get("exclude_nodes"), "roles": e.get("roles"),
            "overhead_s": e.get("overhead_s"), "pause_s": e.get("pause_s"), "impact_s": e.get("impact_s"),
            "iter_s": round(median(span), 6) if span else None,
        })
    restarts = [e for e in events if e.get("type") == "restarted"]
    return {
        "applied": rows,
        "decisions": [
            {k: e.get(k) for k in ("action", "strategy", "iteration", "impact_s", "overhead_s", "reason")}
            for e in events if e.get("type") == "mitigation_decision"
        ],
        "failed": [e.get("reason") for e in events if e.get("type") == "mitigation_failed"],
        "restarts": [{"iteration": e.get("iteration"), "downtime_s": e.get("downtime_s"), "load_s": e.get("load_s")}
                     for e in restarts],
        "switches": switch_figures(events),
    }


def switch_figures(events: list[dict]) -> list[dict[str, Any]]:
    """Each topology switch (S3, or the start-up probe that measures its cost): the pause
    (the slowest process's, which everyone waits for), its phases, and how it compares
    with a disk checkpoint-restart of the same job (the slowest process's measured save +
    load + start-up, from the restart probe)."""
    disk = [e["restart_s"] for e in events if e.get("type") == "restart_probe" and e.get("restart_s")]
    disk_s = max(disk) if disk else None
    by_epoch: dict[int, list[dict]] = {}
    for e in events:
        if e.get("type") == "topology_switch":
            by_epoch.setdefault(int(e["epoch"]), []).append(e)
    rows = []
    for epoch, evs in sorted(by_epoch.items()):
        slowest = max(evs, key=lambda e: e["pause_s"])
        row: dict[str, Any] = {
            "epoch": epoch, "iteration": slowest["iteration"], "probe": bool(slowest.get("probe")),
            "roles": slowest["roles"], "pause_s": slowest["pause_s"],
            "phases_s": {k: slowest.get(k) for k in ("serialize_s", "transfer_s", "regroup_s", "rebuild_s", "load_s")},
            "moved_bytes": sum(e.get("sent_bytes", 0) for e in evs if not e.get("probe")),
            "disk_restart_s": disk_s,
        }
        row["shorter_than_disk"] = round(disk_s / slowest["pause_s"], 2) if disk_s and slowest["pause_s"] > 0 else None
        rows.append(row)
    return rows


def reliability_figures(events: list[dict]) -> dict[str, Any]:
    """What went wrong inside falconext during the run, counted (every one of these left
    training alone): messages dropped (malformed, too large, or lost to chaos), control
    links lost, suspensions released by their deadline, localizations and plans given up,
    episodes closed by their deadline, errors caught in the monitor, the control thread
    and the controller, chaos actions (and :func:`finalize` adds the supervisor's restarts
    of Redis, the controller and the agents, from control.json)."""
    def count(type_: str, **match: Any) -> int:
        return sum(1 for e in events if e.get("type") == type_ and all(e.get(k) == v for k, v in match.items()))

    return {
        # a controller's event counts a round's drops (``count``); a rank's, one message
        "dropped_messages": sum(int(e.get("count", 1)) for e in events if e.get("type") == "message_dropped"),
        "bus_disconnects": count("control_lost", what="redis") + count("controller_redis", connected=False),
        "controller_lost": count("control_lost", what="controller"),
        "deadline_releases": sum(1 for e in events if e.get("type") == "suspension" and e.get("outcome") == "expired"),
        "localizations_failed": count("localization_failed"),
        "aborted_plans": sum(1 for e in events if e.get("type") == "suspension" and e.get("committed") is False),
        "episode_timeouts": count("episode_timeout"),
        "monitor_errors": count("monitor_error"),
        "control_errors": count("control_error"),
        "controller_errors": count("controller_error"),
        "controller_starts": count("controller_started"),
        "chaos_actions": count("chaos"),
        "restarts": {},
    }


def localization_figures(events: list[dict]) -> dict[str, Any]:
    """What the control plane named, how long after the event, and how long ranks paused."""
    found = [e for e in events if e.get("type") == "localized"]
    pauses = [e["pause_s"] for e in events if e.get("type") == "resumed" and e.get("pause_s") is not None]
    first = found[0] if found else None
    return {
        "localized": [
            {"gpus": e["gpus"], "links": e["links"], "after_event_s": e.get("after_event_s"),
             "trigger": e.get("evidence", {}).get("trigger")}
            for e in found
        ],
        "time_to_localization_s": first.get("after_event_s") if first else None,
        "pause_s": max(pauses) if pauses else None,
        "failed": [e.get("reason") for e in events if e.get("type") == "localization_failed"],
        "control_lost": sorted({(e.get("what"), e.get("rank")) for e in events if e.get("type") == "control_lost"}),
    }


def _in_fault(e: dict, start: int, end: int | None) -> bool:
    """An event's onset is the fault's: at most 5 iterations before its start, before its end."""
    return e.get("onset") is not None and start - 5 <= e["onset"] and (end is None or e["onset"] < end)


def suspicion_figures(events: Sequence[dict]) -> dict[str, Any]:
    """The controller's own suspicions (``straggler_suspected``), by the path that named the
    rank (``fast``, ``scores``), and how many the localization after them did not confirm
    (its ``localized`` did not name the suspect, or none came): each of those cost the job
    a suspension and nothing else."""
    by: dict[str, int] = {}
    unconfirmed = 0
    for k, e in enumerate(events):
        if e.get("type") != "straggler_suspected":
            continue
        by[e.get("by", "scores")] = by.get(e.get("by", "scores"), 0) + 1
        verdict = next((v for v in events[k + 1:] if v.get("type") == "localized"), None)
        if verdict is None or e.get("rank") not in (verdict.get("gpus") or []):
            unconfirmed += 1
    return {"count": sum(by.values()), "by": by, "not_confirmed": unconfirmed}


def detection_figures(fail_slows: list[dict], faults: list[dict], suspicions: Sequence[dict] = ()) -> dict[str, Any]:
    """Events per fault (detected by the ranks' detectors, the delay from the fault's
    start) and events outside faults. The controller's score trigger is a second detector
    (``straggler_suspected`` events, ``suspicions``): a fault it suspected first, whose
    mitigation then cut the step short before the ranks' detectors confirmed it, was still
    found by the job; ``suspected_after`` is its first suspicion's delay, and
    ``first_alarm_delay`` the earlier of the two paths' (None: neither)."""
    per_fault = []
    matched: set[int] = set()
    for f in faults:
        start, end = f["start"], f["end"]
        hits = [(k, e) for k, e in enumerate(fail_slows) if _in_fault(e, start, end)]
        matched.update(k for k, _ in hits)
        delays = [e["detected_at"] - start for _, e in hits if e.get("detected_at") is not None]
        suspected = [e["iteration"] - start for e in suspicions
                     if e.get("action") == "localize" and e.get("iteration") is not None and _in_fault(e, start, end)]
        alarms = delays + suspected
        per_fault.append(
            {
                "fault": f,
                "detected": bool(hits),
                "ranks": sorted({e["rank"] for _, e in hits}),
                "first_detection_delay": min(delays) if delays else None,
                "median_onset_error": median(abs(e["onset"] - start) for _, e in hits) if hits else None,
                "suspected_after": min(suspected) if suspected else None,
                "first_alarm_delay": min(alarms) if alarms else None,
            }
        )
    return {
        "events": len(fail_slows),
        "ranks_detecting": sorted({e["rank"] for e in fail_slows}),
        "faults": per_fault,
        "events_outside_faults": len(fail_slows) - len(matched),
    }


def format_summary(s: dict[str, Any]) -> str:
    """The summary of :func:`finalize` as the lines ``falconext train`` prints at the end."""
    est = s["estimates"]
    clock = s.get("wall_clock") or s  # the loop's own times first; the devices' below
    lines = [
        f"iterations {s['iterations']}, median {s['median_iter_s']} s/iter"
        + (f" (healthy {clock['healthy_iter_s']}, slow {clock['slow_iter_s']})" if clock.get("slow_iter_s") else "")
        + f", final loss {s['final_loss']}"
        + (f", healthy iteration time varies {100 * s['healthy_iter_cv']:.2f}% (CV after iteration {WARMUP})"
           if s.get("healthy_iter_cv") is not None else ""),
    ]
    if s["falcon"]:
        err = est["median_rel_error"]
        lines.append(
            f"estimated iteration times: {est['count']} ({100 * est['coverage']:.0f}% of rank-iterations), "
            f"median error {'n/a' if err is None else f'{100 * err:.2f}%'}"
        )
        d = s["detection"]
        lines.append(f"fail-slow events: {d['events']} on ranks {d['ranks_detecting']}, outside faults: {d['events_outside_faults']}")
        for pf in d["faults"]:
            f = pf["fault"]
            what = f"rank {f['rank']}" if f["kind"] == "compute" else f"link {f['nodes']}"
            lines.append(
                f"  {f['kind']} fault x{f['factor']} on {what} from iteration {f['start']}: "
                + (f"detected after {pf['first_detection_delay']} iterations on ranks {pf['ranks']}" if pf["detected"] else "NOT detected")
                + ("" if pf.get("suspected_after") is None
                   else f" (the controller suspected it after {pf['suspected_after']})")
            )
        sus = s.get("suspicions") or {}
        if sus.get("count"):
            by = ", ".join(f"{n} by {path}" for path, n in sorted(sus["by"].items()))
            lines.append(f"suspicions: {sus['count']} ({by}), {sus['not_confirmed']} not confirmed by validation "
                         "(a suspension each)")
        loc = s.get("localization") or {}
        for e in loc.get("localized", []):
            lines.append(
                f"localized ({e['trigger']}): GPUs {e['gpus']}, links {e['links']}, "
                f"{e['after_event_s']} s after the event (target < 10 s)"
            )
        if loc.get("pause_s") is not None:
            lines.append(f"training paused for validation: {loc['pause_s']} s at most (target < 5 s)")
        for reason in loc.get("failed", []):
            lines.append(f"localization failed: {reason}")
        mit = s.get("mitigation") or {}
        for row in mit.get("applied", []):
            what = (f"plan {row['plan']}" if row.get("plan") else f"roles {row['roles']}" if row.get("roles")
                    else f"without nodes {row.get('exclude_nodes')}")
            lines.append(
                f"mitigation {row['strategy']} ({row['trigger']}) from iteration {row['iteration']}: {what}, "
                f"cost {row['overhead_s']} s, then {row['iter_s']} s/iter"
            )
        for r in mit.get("restarts", []):
            lines.append(f"restarted at iteration {r['iteration']} after {r['downtime_s']} s down")
        if len(mit.get("attempts") or []) > 1:  # the plan each attempt ran under
            for a in mit["attempts"]:
                plans = ", ".join(f"{p} from {it}" for it, p in a["plans"])
                lines.append(f"attempt {a['attempt']} from iteration {a['from_iteration']}: plan {plans}")
        for w in mit.get("switches", []):
            vs = f", {w['shorter_than_disk']}x shorter than a disk checkpoint-restart ({w['disk_restart_s']} s)" \
                if w.get("shorter_than_disk") else ""
            lines.append(f"topology {'probe' if w['probe'] else 'switch'} at iteration {w['iteration']}: "
                         f"paused {w['pause_s']} s{vs}")
        if s.get("overhead"):
            lines.append(format_overhead(s["overhead"]))
        if s.get("mitigated_iter_s") is not None:
            ceiling = removal_ceiling(s)
            wall = s.get("wall_clock") if s.get("timing") == "device" else None
            lines.append(
                ("on the emulated devices' time: " if wall else "")
                + f"healthy {s['healthy_iter_s']} s/iter, slow {s['slow_iter_s']}, mitigated {s['mitigated_iter_s']}: "
                f"slowdown removed {s['slowdown_removed']}"
                + (f" of at most {ceiling}" if ceiling is not None else "")
                + above_ceiling_note(s["slowdown_removed"], ceiling)
            )
            if wall and wall.get("slowdown_removed") is not None:
                lines.append(
                    f"  by this host's wall clock: healthy {wall['healthy_iter_s']}, slow {wall['slow_iter_s']}, "
                    f"mitigated {wall['mitigated_iter_s']}: removed {wall['slowdown_removed']}"
                    + above_ceiling_note(wall["slowdown_removed"], ceiling)
                )
        if s.get("s2_slowdown_removed") is not None and {row["strategy"] for row in mit.get("applied", [])} != {"S2"}:
            lines.append(
                f"S2 alone (before any restart): {s['s2_iter_s']} s/iter, slowdown removed {s['s2_slowdown_removed']}"
                + (f" of at most {s['slowdown_removed_max']} (the best S2 plan on the true device times, "
                   f"{s['s2_best_plan']})" if s.get("slowdown_removed_max") is not None else "")
                + above_ceiling_note(s["s2_slowdown_removed"], s.get("slowdown_removed_max"))
            )
    rel = s.get("reliability") or {}
    troubles = {k: v for k, v in rel.items() if v and k != "controller_starts"}
    if troubles:
        lines.append("falconext's own troubles (training went on): "
                     + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in troubles.items()))
    dev = s.get("device")
    if dev:
        lines.append(f"emulated device{' at ' + str(dev['gflops']) + ' GFLOP/s' if 'gflops' in dev else ''}: "
                     f"{dev['windows']} device windows, {dev['overruns']} overran "
                     f"({100 * dev['overrun_share']:.2f}% of device time)")
        if dev.get("unclosed"):
            lines.append(f"WARNING: {dev['unclosed']} device windows were never waited out: the emulated "
                         "device lost that time (a model whose backward it cannot follow)")
        if dev["worst_rank_overrun_share"] > OVERRUN_WARN_SHARE:
            lines.append(
                f"WARNING: rank {dev['worst_rank']}'s real CPU work overran its device time by "
                f"{100 * dev['worst_rank_overrun_share']:.1f}%: the host is too loaded for the emulated device's "
                "speed, so its timings are not a GPU's (lower --device-gflops or use fewer ranks)"
            )
    return "\n".join(lines)


#: a rank whose overruns exceed this share of its device time gets a warning
OVERRUN_WARN_SHARE = 0.02


def format_overhead(o: dict[str, Any]) -> str:
    """One line: falconext's CPU per iteration (mean, max over ranks, by component) and
    its share of the iteration time."""
    per = o["per_iteration_s"]

    def ms(k: str, stat: str = "mean") -> str:
        return f"{1e3 * per[k][stat]:.3f}"

    share = o.get("cpu_share")
    line = (f"falconext CPU per iteration: {ms('total')} ms mean, {ms('total', 'max')} ms max over ranks "
            f"(hooks {ms('hooks')}, monitor {ms('monitor')}, client {ms('client')} ms mean)")
    if share:
        line += (f" = {100 * share['mean']:.2f}% mean, {100 * share['max']:.2f}% max of {o['iter_s']} s/iter "
                 f"(paper: 0.39% mean, 1.1% max)")
    t = o.get("toggle")
    if t and t.get("on_off_ratio"):
        line += f"; on/off iteration time {t['on_iter_s']} / {t['off_iter_s']} s = {t['on_off_ratio']}"
    return line
