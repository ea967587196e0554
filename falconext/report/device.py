"""What the emulated device knows and the summary reports: what S2 could at best remove
(``slowdown_removed_max``), and how well the host kept up with the device (overruns).

The emulator knows each rank's device time per micro-batch and the factors it applied;
the best any micro-batch plan can do is the optimal integer plan on those true times
(:func:`falconext.mitigate.microbatch.plan_microbatches`, exact). Comparing the measured
``slowdown_removed`` with this ceiling makes every S2 figure comparable to what is
possible: with one 2x replica among four and 16 micro-batches each, the best plan
[9, 19, 18, 18] leaves the slowest replica at 19 units against 16 healthy and 32 slow,
so at most 0.81 of the slowdown can go.
"""

from __future__ import annotations

import json
import os
from typing import Any

from falconext.mitigate.microbatch import plan_microbatches
from falconext.model.faults import compute_factor, parse_faults


def device_record_path(out: str, process: int, suffix: str = "") -> str:
    """Where process ``process``'s emulated device record lies in run directory ``out``
    (``suffix``: an attempt's, after a restart)."""
    return os.path.join(out, "ranks", f"device{suffix}-rank{process}.json")


def write_device_record(out: str, process: int, record: dict[str, Any], suffix: str = "") -> None:
    """Write process ``process``'s emulated device record (``EmulatedDevice.record()``)."""
    with open(device_record_path(out, process, suffix), "w") as f:
        json.dump(record, f)


def device_iteration_times(out: str, world: int) -> dict[int, float] | None:
    """Each iteration's time on the run's emulated devices' own records: the device time
    (compute and links, faults included) of its slowest process, which every other waits
    for; a restarted attempt's records (``device-r<k>-rank<p>.json``) add the iterations it
    ran. Only iterations every process recorded; None without device records."""
    merged: list[dict[str, dict]] = []
    for p in range(world):
        path = device_record_path(out, p)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            its = dict(json.load(f)["iterations"])
        k = 1
        while os.path.exists(later := device_record_path(out, p, f"-r{k}")):
            with open(later) as f:
                its.update(json.load(f)["iterations"])
            k += 1
        merged.append(its)
    if not merged:
        return None
    return {int(it): max(float(rec[it]["compute_s"]) + float(rec[it].get("link_s", 0.0)) for rec in merged)
            for it in merged[0] if all(it in rec for rec in merged)}


def s2_ceiling(healthy_mb_s: list[float], slow_mb_s: list[float], total: int) -> dict[str, Any] | None:
    """The iteration compute time (max over replicas of micro-batches x time per
    micro-batch) healthy, slow under the even plan, and under the optimal plan, and the
    share of the slowdown the optimal plan removes. None when nothing is slow."""
    d = len(healthy_mb_s)
    if d == 0 or len(slow_mb_s) != d or total < d:
        raise ValueError(f"s2_ceiling: {d} healthy times, {len(slow_mb_s)} slow times, {total} micro-batches")
    even = [total // d + (1 if i < total % d else 0) for i in range(d)]
    slow_t = list(slow_mb_s)
    healthy = max(m * t for m, t in zip(even, healthy_mb_s))
    slow = max(m * t for m, t in zip(even, slow_t))
    if slow <= healthy * (1 + 1e-9):
        return None
    plan = plan_microbatches(slow_t, total)
    best = max(m * t for m, t in zip(plan, slow_t))
    return {"plan": plan, "healthy_s": healthy, "slow_s": slow, "best_s": best,
            "removed_max": (slow - best) / (slow - healthy)}


def ceiling_from_run(out: str, run: dict[str, Any]) -> dict[str, Any] | None:
    """:func:`s2_ceiling` for a finished emulated run: each replica's time per
    micro-batch is its slowest rank's (device files under ``ranks/``), slowed by the
    compute faults in force at the first fault's start. None without device records or
    without a compute fault."""
    topo = run.get("topology") or {}
    ranks = topo.get("ranks") or []
    raw = run.get("faults") or []
    if not ranks or not any(f.get("kind") == "compute" for f in raw):
        return None
    world = int(topo["world"])
    faults = parse_faults(raw, world, int(topo.get("ranks_per_node", 1)), "run.json")
    start = min(f.start for f in faults if f.kind == "compute")
    mb_s: dict[int, float] = {}
    for r in range(world):
        path = device_record_path(out, r)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            mb_s[r] = float(json.load(f)["microbatch_s"])
    dp = int(topo["dp"])
    healthy, slow = [0.0] * dp, [0.0] * dp
    for info in ranks:  # a replica is as slow as its slowest stage
        r, rep = int(info["rank"]), int(info["dp_rank"])
        healthy[rep] = max(healthy[rep], mb_s[r])
        slow[rep] = max(slow[rep], mb_s[r] * compute_factor(faults, r, start))
    args = run.get("args") or {}
    total = int(args.get("global_batch_size", 0)) // max(1, int(args.get("micro_batch_size", 1)))
    return s2_ceiling(healthy, slow, total)


def device_figures(out: str, world: int) -> dict[str, Any] | None:
    """The device records of all ranks, summed: device windows, overruns (real CPU work
    that outlasted its device time) and their share, worst rank. None when the run had no
    emulated device."""
    windows = overruns = closed = 0
    overrun_s = compute_s = 0.0
    worst: tuple[float, int] = (0.0, -1)
    gflops: set[float] = set()
    real_links = False
    for r in range(world):
        path = device_record_path(out, r)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            rec = json.load(f)
        gflops.add(float(rec.get("model", {}).get("gflops", 0.0)))
        real_links = real_links or bool(rec.get("real_links", False))
        windows += int(rec["windows"])
        overruns += int(rec["overruns"])
        closed += int(rec.get("closed", rec["windows"]))
        overrun_s += float(rec["overrun_s"])
        rank_compute = sum(float(i["compute_s"]) for i in rec["iterations"].values())
        compute_s += rank_compute
        share = float(rec["overrun_s"]) / rank_compute if rank_compute > 0 else 0.0
        worst = max(worst, (share, r))
    return {
        #: the emulated device's speed (one value when every rank ran the same)
        "gflops": sorted(gflops)[0] if len(gflops) == 1 else sorted(gflops),
        "windows": windows,
        "overruns": overruns,
        #: device windows no rank waited out (device time the job never spent)
        "unclosed": windows - closed,
        "overrun_s": round(overrun_s, 4),
        "overrun_share": round(overrun_s / compute_s, 5) if compute_s > 0 else 0.0,
        "worst_rank": worst[1],
        "worst_rank_overrun_share": round(worst[0], 5),
        #: the links were real (network namespaces): the records hold no link time
        "real_links": real_links,
    }
