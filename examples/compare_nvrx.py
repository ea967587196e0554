"""falconext and NVIDIA nvidia-resiliency-ext's straggler detection on the same jobs.

Each case is one emulated-device DP4 job (``falconext train``, two nodes of two ranks,
8 micro-batches per replica) with both detectors on: falconext as a user runs it,
mitigation off so that nothing changes under NVRx's feet, and NVRx beside it
(``--nvrx-report-s``, falconext/testbed/nvrx.py: NVRx's own scoring, the train step as
its detection section, the emulated device's compute windows as the kernels CUPTI would
time on a GPU), once per report interval (default: its Detector's 60 s, and 5 s), each a
detector of its own in the same job. Cases: a compute fault on rank 2 of 1.25x, 1.5x, 2x
and 3x from iteration 60, the link between the two nodes 8x slower from 60 (4x made these
0.85 s iterations only 10% slower, 0.850 -> 0.936 s: at falconext's 10% line, which
neither detector reported), and a healthy job.

Per case and detector, ``DIR/comparison.csv`` holds: what was slow (``true_rank``, -1
for a link or nothing), whom it named (``named_rank``: -1 for none; a link as
``link 0-1``; several ranks joined by ``;``), how many iterations after the onset
(``detected_after``; empty if never) and roughly how many seconds, the iteration of the
validated localization naming it (``localized_at``, falconext only), its false alarms
(verdicts naming something else, or anything before the onset or in the healthy job),
and what it cost each rank per iteration (falconext: its threads' and hooks' CPU from
summary.json; NVRx: the time spent in its step hook, reports included). A Markdown table
is printed for docs/detection-accuracy.md.

falconext names a rank with its first event that does: the controller's suspicion
(``straggler_suspected``, at the iteration of the heartbeat that showed it: the fast path
or the score trigger) or a ``localized`` verdict (at its suspension's iteration; the only
way it names a link). NVRx names the ranks of its first report whose relative scores
(GPU, then section) fall under its default threshold; its individual scores (each rank
against its own best) name every rank of a job that slowed as a whole, so they are
reported but not taken as naming a straggler.

Needs the ``nvrx`` extra (``pip install -e '.[nvrx]'``); without it, one line says so.

    python3 examples/compare_nvrx.py --out runs/nvrx   (about 17 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ONSET = 60
SLOW_RANK = 2
#: case -> the faults injected (falconext/model/faults.py)
CASES: dict[str, list[dict]] = {
    "compute-1.25x": [{"kind": "compute", "rank": SLOW_RANK, "factor": 1.25, "start": ONSET}],
    "compute-1.5x": [{"kind": "compute", "rank": SLOW_RANK, "factor": 1.5, "start": ONSET}],
    "compute-2x": [{"kind": "compute", "rank": SLOW_RANK, "factor": 2.0, "start": ONSET}],
    "compute-3x": [{"kind": "compute", "rank": SLOW_RANK, "factor": 3.0, "start": ONSET}],
    "link-8x": [{"kind": "link", "nodes": [0, 1], "factor": 8.0, "start": ONSET}],
    "healthy": [],
}
COLUMNS = ("case", "detector", "true_rank", "named_rank", "detected_after", "detected_after_s", "localized_at",
           "false_alarms", "cost_ms_per_iteration")


def truth(faults: list[dict]) -> tuple[int, str]:
    """(true_rank, what) of a case: the slow rank, or -1 and the link or 'nothing'."""
    if not faults:
        return -1, "nothing"
    f = faults[0]
    if f["kind"] == "compute":
        return int(f["rank"]), f"gpu {f['rank']}"
    return -1, f"link {f['nodes'][0]}-{f['nodes'][1]}"


def run_case(name: str, faults: list[dict], out: Path, args: argparse.Namespace) -> Path:
    """One job with both detectors; its output folder."""
    run = out / name
    inject = out / f"{name}-faults.json"
    inject.write_text(json.dumps(faults))
    cmd = [sys.executable, "-m", "falconext.cli", "train", "--nproc", "4", "--out", str(run), "--device", "emulated",
           "--no-report", "--iters", str(args.iters), "--global-batch-size", "32", "--micro-batch-size", "1",
           "--device-gflops", str(args.device_gflops), "--falcon-mitigation", "false",
           "--nvrx-report-s", ",".join(f"{x:g}" for x in args.nvrx_report_s), "--inject", str(inject)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"compare_nvrx: case {name}: falconext train failed ({proc.returncode}): {tail[0]}")
    return run


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _seconds(run: Path, first: int, last: int) -> float:
    """Seconds rank 0 spent from the start of iteration ``first`` to the end of ``last``."""
    with open(run / "iterations.csv", newline="") as f:
        times = {int(r["iteration"]): float(r["iter_time_s"]) for r in csv.DictReader(f) if r["rank"] == "0"}
    return sum(t for it, t in times.items() if first <= it <= last)


def falconext_row(run: Path, faults: list[dict]) -> dict:
    """falconext's verdicts: its first event naming a rank (``straggler_suspected``, at the
    iteration of the heartbeat that showed it) and each ``localized`` naming something, at
    its suspension's iteration; ``localized_at``: the first localization naming the truth."""
    events = _lines(run / "events.jsonl")
    at = {e["session"]: e["iteration"] for e in events if e["type"] == "suspended"}
    verdicts, located = [], []
    for e in events:
        if e["type"] == "straggler_suspected":
            verdicts.append((e["iteration"], [f"gpu {e['rank']}"]))
        if e["type"] == "localized" and (e["gpus"] or e["links"]):
            names = [f"gpu {g}" for g in e["gpus"]] + [f"link {a}-{b}" for a, b in e["links"]]
            verdicts.append((at.get(e["evidence"].get("session"), -1), names))
            located.append(verdicts[-1])
    verdicts.sort(key=lambda v: v[0])
    summary = json.loads((run / "summary.json").read_text())
    total = (summary.get("overhead") or {}).get("per_iteration_s", {}).get("total", {}).get("mean")
    row = _row(run, faults, verdicts, None if total is None else 1e3 * total)
    what = truth(faults)[1]
    row["localized_at"] = next((it for it, names in located if it >= ONSET and names == [what]), "") if faults else ""
    return row


def nvrx_row(run: Path, faults: list[dict], report_s: float, several: bool) -> dict:
    """NVRx's verdicts (its detector reporting every ``report_s``): each report naming ranks
    by a relative score (GPU, else section)."""
    verdicts = []
    for rep in _lines(run / "nvrx.jsonl"):
        if rep.get("report_s", report_s) != report_s:
            continue
        s = rep["stragglers"]
        ranks = s["gpu_relative"] or s["section_relative"]
        if ranks:
            verdicts.append((rep["iteration"], [f"gpu {r}" for r in ranks]))
    name = f"nvrx-{report_s:g}s" if several else "nvrx"
    costs = [json.loads(p.read_text())["per_step_ms"] for p in sorted((run / "ranks").glob(f"{name}-rank*.json"))]
    costs = [c for c in costs if c is not None]
    return {**_row(run, faults, verdicts, statistics.mean(costs) if costs else None), "localized_at": ""}


def _row(run: Path, faults: list[dict], verdicts: list[tuple[int, list[str]]], cost_ms: float | None) -> dict:
    true_rank, what = truth(faults)
    hit = next(((it, names) for it, names in verdicts if it >= ONSET and names == [what]), None) if faults else None
    false_alarms = sum(1 for it, names in verdicts if not faults or it < ONSET or names != [what])
    first = hit or next(((it, n) for it, n in verdicts if not faults or it >= ONSET), None)
    if first is None:
        named = "-1"
    else:
        ranks = [n.split()[1] for n in first[1] if n.startswith("gpu ")]
        links = [n for n in first[1] if n.startswith("link ")]
        named = ";".join(ranks + links) if ranks or links else "-1"
    return {
        "true_rank": true_rank, "named_rank": named,
        "detected_after": "" if hit is None else hit[0] - ONSET,
        "detected_after_s": "" if hit is None else round(_seconds(run, ONSET, hit[0]), 1),
        "false_alarms": false_alarms,
        "cost_ms_per_iteration": "" if cost_ms is None else round(cost_ms, 3),
    }


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    head = ("| case | detector | slow | named | after (iterations) | after (s) | localized at | false alarms "
            "| cost ms/iteration |")
    out = [head, "|" + "---|" * 9]
    for r in rows:
        out.append(f"| {r['case']} | {r['detector']} | {r['true_rank']} | {r['named_rank']} | "
                   f"{r['detected_after'] if r['detected_after'] != '' else 'never'} | {r['detected_after_s']} | "
                   f"{r['localized_at']} | {r['false_alarms']} | {r['cost_ms_per_iteration']} |")
    return "\n".join(out)


def _intervals(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, comma-separated, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"intervals must be > 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the runs and comparison.csv")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--iters", type=int, default=170,
                   help="iterations per job (170: NVRx at its default 60 s reports at 86 and 156)")
    p.add_argument("--device-gflops", type=float, default=1.0)
    p.add_argument("--nvrx-report-s", type=_intervals, default=(60.0, 5.0),
                   help="NVRx's report intervals in seconds, one detector each, comma-separated (default 60,5: its "
                   "Detector's default, and a report every ~6 iterations of these ~0.85 s iterations)")
    p.add_argument("--timeout", type=int, default=900)
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        print(f"compare_nvrx: unknown case {unknown[0] if unknown else '(none)'!r} (choose from {', '.join(CASES)})",
              file=sys.stderr)
        return 2
    if args.iters <= ONSET + 20:
        print(f"compare_nvrx: --iters must be more than {ONSET + 20} (the faults start at {ONSET})", file=sys.stderr)
        return 2
    from falconext.inputs import InputError
    from falconext.testbed.nvrx import check_available

    try:
        check_available()
    except InputError as exc:  # the extra is missing
        print(f"compare_nvrx: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"compare_nvrx: --out {out} exists and is not a folder", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in cases:
        run = run_case(name, CASES[name], out, args)
        rows.append({"case": name, "detector": "falconext", **falconext_row(run, CASES[name])})
        several = len(args.nvrx_report_s) > 1
        for report_s in args.nvrx_report_s:
            rows.append({"case": name, "detector": f"nvrx-{report_s:g}s",
                         **nvrx_row(run, CASES[name], report_s, several)})
        print(f"{name}: done", file=sys.stderr)
    with open(out / "comparison.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print(table(rows))
    print(f"wrote {out / 'comparison.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
