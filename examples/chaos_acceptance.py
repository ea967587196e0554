"""Issue 15's acceptance, one chaos action at a time: training does not care.

For each action (``--chaos``: kill Redis, kill the controller, kill a node agent, drop,
delay or corrupt the ranks' messages) this runs the same emulated DP4 job with a 2x
compute fault on rank 1 that starts *after* the kill, and checks:

- **no hang**: the job ends by itself and every rank ran every iteration;
- **fail-open**: over the 10 iterations after the kill (the control plane is down or
  coming back) the median iteration time is within 5% of the same iterations of the
  job without falconext;
- **still works afterwards**: the fault, which starts after the restart, is detected,
  localized to GPU 1 and mitigated (a ``mitigation`` event);
- **learns the same**: the loss of every iteration equals the run without falconext
  (S2's plans are exact, so this holds with the plan changed too) within 1e-4.

It prints one row per action and exits 1 if any check failed. About 75 s a run, 8 runs
(one reference without falconext, one with falconext and no chaos, six actions):

    python3 examples/chaos_acceptance.py [--out runs/chaos] [--only kill-redis,drop]

Take it on a quiet machine: the fail-open check is a timing.
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

KILL_AT = 25
FAULT_START = 50
ITERS = 110
JOB = ["--nproc", "4", "--iters", str(ITERS), "--global-batch-size", "16", "--micro-batch-size", "1",
       "--device", "emulated", "--no-report"]
FAULT = [{"kind": "compute", "rank": 1, "factor": 2.0, "start": FAULT_START}]
ACTIONS = {
    "kill-redis": f"kill-redis@{KILL_AT}",
    "kill-controller": f"kill-controller@{KILL_AT}",
    "kill-agent": f"kill-agent:0@{KILL_AT}",
    "drop": "drop:0.2",
    "delay": "delay:50",
    "corrupt": "corrupt:0.1",
}


def run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    """One ``falconext train`` with the fault; its stdout is kept in the run directory."""
    out.mkdir(parents=True, exist_ok=True)
    inject = out.parent / f"{out.name}-faults.json"
    inject.write_text(json.dumps(FAULT))
    cmd = [sys.executable, "-m", "falconext.cli", "train", *JOB, "--out", str(out), "--inject", str(inject), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    (out / "stdout.txt").write_text(proc.stdout + proc.stderr)
    return proc


def per_iteration(out: Path) -> tuple[dict[int, float], dict[int, float], int]:
    """(iteration -> the slowest rank's loop time, iteration -> loss, rank-iterations)."""
    times: dict[int, float] = {}
    loss: dict[int, float] = {}
    n = 0
    with open(out / "iterations.csv", newline="") as f:
        for row in csv.DictReader(f):
            n += 1
            it = int(row["iteration"])
            times[it] = max(times.get(it, 0.0), float(row["iter_time_s"]))
            if row["loss"]:
                loss[it] = float(row["loss"])
    return times, loss, n


def events(out: Path, type_: str) -> list[dict]:
    lines = (out / "events.jsonl").read_text().splitlines() if (out / "events.jsonl").exists() else []
    return [e for e in map(json.loads, filter(None, lines)) if e.get("type") == type_]


def judge(name: str, out: Path, proc: subprocess.CompletedProcess, ref_times: dict[int, float],
          ref_loss: dict[int, float]) -> dict:
    """The four checks of one run (see the module docstring)."""
    row: dict = {"action": name, "exit": proc.returncode}
    if proc.returncode != 0 or not (out / "iterations.csv").exists():
        row["ok"] = False
        return row
    times, loss, n = per_iteration(out)
    row["all_iterations"] = n == 4 * ITERS
    window = range(KILL_AT, KILL_AT + 10)
    row["down_ratio"] = round(statistics.median(times[i] for i in window)
                              / statistics.median(ref_times[i] for i in window), 4)
    row["fail_open"] = row["down_ratio"] <= 1.05
    found = [e["detected_at"] - FAULT_START for e in events(out, "fail_slow")]
    loc = events(out, "localized")
    mit = events(out, "mitigation")
    row["detected_after"] = min(found) if found else None
    row["localized"] = bool(loc) and loc[0].get("gpus") == [1]
    row["mitigated"] = [e["strategy"] for e in mit]
    row["worst_loss_diff"] = max((abs(loss[i] - ref_loss[i]) / abs(ref_loss[i]) for i in ref_loss), default=None)
    row["same_losses"] = sorted(loss) == sorted(ref_loss) and row["worst_loss_diff"] <= 1e-4
    summary = json.loads((out / "summary.json").read_text())
    rel = summary.get("reliability", {})
    row["chaos_actions"] = rel.get("chaos_actions")
    row["restarts"] = rel.get("restarts")
    row["ok"] = bool(row["all_iterations"] and row["fail_open"] and found and row["localized"] and mit
                     and row["same_losses"])
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/chaos")
    p.add_argument("--only", default="", help="comma-separated actions (default: all): " + ",".join(ACTIONS))
    args = p.parse_args(argv)
    only = [a for a in args.only.split(",") if a] or list(ACTIONS)
    unknown = [a for a in only if a not in ACTIONS]
    if unknown:
        print(f"chaos_acceptance: unknown action(s) {unknown}; known: {', '.join(ACTIONS)}", file=sys.stderr)
        return 2
    base = Path(args.out)
    ref = base / "no-falcon"
    proc = run(ref, "--no-falcon")
    if proc.returncode != 0:
        print(f"chaos_acceptance: the reference run failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return 1
    ref_times, ref_loss, _ = per_iteration(ref)
    rows = [judge("none", base / "none", run(base / "none"), ref_times, ref_loss)]
    for name in only:
        out = base / name
        rows.append(judge(name, out, run(out, "--chaos", ACTIONS[name]), ref_times, ref_loss))
    cols = ["action", "ok", "exit", "all_iterations", "down_ratio", "fail_open", "detected_after", "localized",
            "mitigated", "same_losses", "worst_loss_diff", "chaos_actions", "restarts"]
    print("\t".join(cols))
    for row in rows:
        print("\t".join(str(row.get(c, "")) for c in cols))
    (base / "acceptance.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
