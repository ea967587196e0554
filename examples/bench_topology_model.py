"""How well S3's iteration-time model (falconext/model/itertime.py) predicts the test bed.

Runs the S3 acceptance jobs (TP1 x DP2 x PP2, four virtual nodes, S3 only) and
prints, for each, the model's prediction before and after the topology switch (as the
controller computed it when it decided) against the measured median iteration times in
the fail-slow before and after the switch (``slow_iter_s``/``mitigated_iter_s`` of the
summary). The target is within 15%.

    python examples/bench_topology_model.py [--out runs/bench-topology] [--iters 130]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

#: case -> (faults, extra job arguments). Consolidation gains only where one stage is
#: lighter (tests/test_consolidation_e2e.py), so that job has the heavier output layer.
CASES: dict[str, tuple[list, list[str]]] = {
    "links 0-1 x8 (DP path) and 0-2 x3 (PP path)": ([
        {"kind": "link", "nodes": [0, 1], "factor": 8.0, "start": 45},
        {"kind": "link", "nodes": [0, 2], "factor": 3.0, "start": 45},
    ], []),
    "link 0-1 x4 on stage 0's DP all-reduce": ([{"kind": "link", "nodes": [0, 1], "factor": 4.0, "start": 45}], []),
    "compute x3 on processes 0 and 3 (stages 0 and 1), vocab 4096": (
        [{"kind": "compute", "rank": r, "factor": 3.0, "start": 45} for r in (0, 3)], ["--vocab", "4096"]),
}


def run(out: Path, faults: list, iters: int, extra: list[str]) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    inject = out.parent / f"{out.name}-faults.json"
    inject.write_text(json.dumps(faults))
    cmd = [sys.executable, "-m", "falconext.cli", "train", "--nproc", "4", "--pp", "2", "--iters", str(iters),
           "--global-batch-size", "16", "--ranks-per-node", "1", "--out", str(out), "--inject", str(inject),
           "--falcon-mitigation-strategies", "S3", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    summary = json.loads((out / "summary.json").read_text())
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]
    applied = [e for e in events if e["type"] == "mitigation" and e.get("strategy") == "S3"]
    return {"summary": summary, "s3": applied[0] if applied else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench-topology")
    parser.add_argument("--iters", type=int, default=130)
    args = parser.parse_args()
    print(f"{'case':52} {'predicted (s/iter)':>20} {'measured (s/iter)':>20} {'error':>14}")
    for k, (name, (faults, extra)) in enumerate(CASES.items()):
        got = run(Path(args.out) / f"case{k}", faults, args.iters, extra)
        s, s3 = got["summary"], got["s3"]
        if s3 is None or s.get("mitigated_iter_s") is None:
            print(f"{name:52} S3 was not applied: {s['mitigation']['failed']}")
            continue
        before, after = s3["predicted_s"]
        slow, mitigated = s["slow_iter_s"], s["mitigated_iter_s"]
        err = [(before - slow) / slow, (after - mitigated) / mitigated]
        print(f"{name:52} {before:9.3f} -> {after:6.3f} {slow:9.3f} -> {mitigated:6.3f} "
              f"{err[0]:+6.1%} {err[1]:+6.1%}")
        print(f"{'':52} healthy {s['healthy_iter_s']}, slowdown removed {s['slowdown_removed']}, "
              f"roles {s3['roles']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
