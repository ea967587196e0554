"""Regenerate README.md's "Measured highlights" from one run of this script.

Each row of the table is measured here, by the command the row names, and dated: no
figure in the table is edited by hand. The rows:

- ``bash .ci/run`` from a fresh clone: read from that run's output (``--ci-log FILE``, the
  script does not rerun CI): the main suite's count and time, each leg's line;
- the main job (the README's first command), run here: detection, localization, S2, S4,
  the slowdown removed beside what any plan can reach (on the emulated devices' time, the
  wall clock's beside it), and falconext's own CPU per iteration;
- real Megatron-LM's ``pretrain_gpt.py`` with a slow GPU, per ``--megatron
  VERSION=PATH[,PYTHON]`` (the slow-GPU test's job: tests/megatron_lm/test_pretrain_gpt.py);
- ``python3 examples/bench_ctl.py``: how fast ``falconext ctl status`` answers;
- ``python3 examples/soak_tracker.py``: the per-rank tracker's cost per call and memory.

The table goes between the ``<!-- highlights:begin -->`` and ``<!-- highlights:end -->``
lines of README.md (``--readme``), or to stdout with ``--print``. Run it on a quiet machine,
never beside another job (the figures are timings):

    python3 examples/highlights.py --ci-log ci.log \\
        --megatron core_v0.16.1=/tmp/mlm/016 --megatron core_v0.19.0=/tmp/mlm/019,/tmp/py312/bin/python
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- highlights:begin -->", "<!-- highlights:end -->"

#: the README's first command's job (``bash launch/setup.sh &&`` aside)
MAIN_JOB = ["--nproc", "4", "--iters", "220", "--global-batch-size", "32", "--micro-batch-size", "1",
            "--inject", "examples/faults/compute_rank1.json"]


@dataclass(frozen=True)
class Row:
    """One line of the table: what was measured, the figures, the command that measured them."""

    what: str
    measured: str
    command: str


class Failed(Exception):
    """A row's command failed or printed nothing to read: the one-line reason."""


def run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[str, float]:
    """Run ``cmd`` in the repository; its stdout and stderr together, and its wall seconds.
    Raises :class:`Failed` on a non-zero exit or past ``timeout``."""
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env=None if env is None else {**os.environ, **env})
    except subprocess.TimeoutExpired:
        raise Failed(f"{' '.join(cmd[:4])} ...: still running after {timeout:.0f} s") from None
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise Failed(f"{' '.join(cmd[:4])} ...: exit {proc.returncode}: {out.strip().splitlines()[-1:] or ''}")
    return out, time.monotonic() - started


def shown(cmd: list[str]) -> str:
    """``cmd`` as the table shows it: the program and its arguments, the scratch folder as DIR."""
    text = " ".join(Path(c).name if c == sys.executable else c for c in cmd)
    return re.sub(r"/tmp/highlights-[^/ ]+", "DIR", text)


def removal(s: dict) -> str:
    """The slowdown removed as the summary reports it: beside its ceiling, and on which clock."""
    text = f"slowdown removed {s['slowdown_removed']}"
    if s.get("slowdown_removed_ceiling") is not None:
        text += f" of at most {s['slowdown_removed_ceiling']}"
    if s.get("timing") == "device":
        wall, ceiling = (s.get("wall_clock") or {}).get("slowdown_removed"), s.get("slowdown_removed_ceiling")
        text += " on the emulated devices' time"
        if wall is not None and ceiling is not None and wall > ceiling + 1e-3:  # never print a figure above it
            text += " (the wall clock's figure passes the ceiling: the host's own work, a measuring error)"
        elif wall is not None:
            text += f" ({wall} by the wall clock)"
    return text


def ci_rows(log: str) -> list[Row]:
    """The CI run's figures, from its output: the main suite's pytest line and time, each
    counted leg's line, the whole run's time."""
    suite = re.findall(r"^=*\s*(\d+ passed(?:, \d+ \w+)*) in ([\d.]+)s", log, re.M)
    main_s = re.search(r"^ci: main suite (\d+) s$", log, re.M)
    total = re.search(r"^ci: all legs (\d+) s, status (\d+)$", log, re.M)
    legs = re.findall(r"^((?:long|megatron-lm) tests: .*)$", log, re.M)
    if not (suite and main_s and total):
        raise Failed("the CI log has no main suite line, no 'ci: main suite' or no 'ci: all legs' line")
    status = "passed" if total.group(2) == "0" else f"FAILED (status {total.group(2)})"
    return [
        Row("test suite (the README's command, in CI)", f"{suite[0][0]} in {main_s.group(1)} s (limit 10 min)",
            "python3 -m pytest -q"),
        Row("`bash .ci/run` from a fresh clone", f"{status} in {total.group(1)} s (limit 60 min): " + "; ".join(legs),
            "CI=true bash .ci/run"),
    ]


def mitigation_parts(s: dict) -> list[str]:
    """What a run's summary says of its mitigation: each strategy and where it applied, a
    restart's downtime, the slowdown removed beside its ceiling, and S2's own share where
    another strategy followed it."""
    applied = (s.get("mitigation") or {}).get("applied") or []
    restarts = (s.get("mitigation") or {}).get("restarts") or []
    steps = [f"S2 {r['plan']} from {r['iteration']}" if r["strategy"] == "S2" else f"{r['strategy']} from {r['iteration']}"
             for r in applied]
    parts = [", ".join(steps) or "no mitigation"]
    if restarts:
        parts.append(f"{restarts[0]['downtime_s']:.1f} s down")
    parts.append(removal(s))
    if s.get("s2_slowdown_removed") is not None and {r["strategy"] for r in applied} != {"S2"}:
        parts.append(f"S2 alone {s['s2_slowdown_removed']} of at most {s['slowdown_removed_max']}")
    return parts


def main_job_rows(scratch: str) -> list[Row]:
    """The README's first command, run here."""
    out = os.path.join(scratch, "demo")
    cmd = [sys.executable, "-m", "falconext.cli", "train", *MAIN_JOB[:8], "--out", out, *MAIN_JOB[8:]]
    _, secs = run(cmd, timeout=900)
    s = json.loads(Path(out, "summary.json").read_text())
    det = [f for f in s["detection"]["faults"] if f["detected"] or f.get("suspected_after") is not None]
    loc = (s.get("localization") or {}).get("localized") or []
    parts = [f"{secs:.0f} s",
             f"detected after {det[0]['first_alarm_delay']} iterations" if det else "NOT detected",
             f"GPU {loc[0]['gpus']} {loc[0]['after_event_s']} s after the event" if loc else "not localized",
             *mitigation_parts(s)]
    rows = [Row("main job (the README's first command)", "; ".join(parts), shown(cmd))]
    if s.get("overhead"):
        from falconext.report.summary import format_overhead

        rows.append(Row("falconext's own CPU, main job", format_overhead(s["overhead"]).split(": ", 1)[1], shown(cmd)))
    return rows


def megatron_row(version: str, path: str, python: str, scratch: str) -> Row:
    """The slow-GPU test's job inside ``path``'s pretrain_gpt.py under ``python``."""
    for folder in (ROOT / "tests", ROOT / "tests" / "megatron_lm"):  # once, however many versions
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    from test_pretrain_gpt import JOB_SHAPE, LONG_ITERS, TINY_GPT, device_gflops  # the test's own job, not a copy of it

    faults = Path(scratch, f"fault-{version}.json")
    faults.write_text(json.dumps([{"kind": "compute", "rank": 1, "factor": 2.0, "start": 60}]))
    out = os.path.join(scratch, f"mlm-{version}")
    gflops = device_gflops(version.removeprefix("core_v"))
    cmd = [python, "-m", "falconext.cli", "launch", "--nproc-per-node", "2", os.path.join(path, "pretrain_gpt.py"),
           *TINY_GPT, "--global-batch-size", JOB_SHAPE, "--train-iters", str(LONG_ITERS), "--log-interval", "10", "--falcon",
           "--falcon-out", out, "--falcon-inject", str(faults), "--falcon-device-gflops", gflops]
    run(cmd, timeout=900)
    events = [json.loads(x) for x in Path(out, "events.jsonl").read_text().splitlines() if x.strip()]
    s = json.loads(Path(out, "summary.json").read_text())
    # the first naming from the calls: the ranks' detector (fail_slow) or the fast path's suspicion
    alarms = sorted([(e["detected_at"], e["onset"], "the ranks' detector") for e in events if e["type"] == "fail_slow"]
                    + [(e["iteration"], e["onset"], f"the {e.get('by', 'scores')} path") for e in events
                       if e["type"] == "straggler_suspected"])
    at = {e["session"]: e["iteration"] for e in events if e["type"] == "controller_state" and e["new"] == "validating"}
    loc = [e for e in events if e["type"] == "localized"]
    parts = [f"onset {alarms[0][1]} named at iteration {alarms[0][0]} by {alarms[0][2]}" if alarms else "NOT detected",
             (f"localized {loc[0]['gpus']} in the suspension at {at.get(loc[0]['evidence'].get('session'), '?')}"
              if loc else "not localized"), *mitigation_parts(s)]
    py = run([python, "-c", "import platform; print(platform.python_version())"], 60)[0].strip()
    command = shown(cmd).replace(path, "$MEGATRON_LM_PATH")
    if python != sys.executable:  # another interpreter: named by its version, not its path
        command = command.replace(python, "python" + ".".join(py.split(".")[:2]), 1)
    return Row(f"real Megatron-LM {version} (Python {py}), 2x on rank 1 from 60", "; ".join(parts), command)


def ctl_row() -> Row:
    cmd = [sys.executable, "examples/bench_ctl.py", "--runs", "20"]
    out, _ = run(cmd, timeout=300)
    lines = [x.split(", ", 1)[1] if ", " in x else x for x in out.splitlines() if x.startswith("ctl status")]
    if not lines:
        raise Failed("bench_ctl.py printed no 'ctl status' line")
    return Row("`falconext ctl status`", "; ".join(lines), shown(cmd))


def soak_row() -> Row:
    cmd = [sys.executable, "examples/soak_tracker.py", "--iterations", "200000", "--report-every", "200000"]
    out, _ = run(cmd, timeout=900)
    cost = re.search(r"^cost: ([\d.]+) us/call", out, re.M)
    memory = re.search(r"^memory: .*growth ([+-][\d.]+ MB)", out, re.M)
    if not (cost and memory):
        raise Failed("soak_tracker.py printed no 'cost:' or 'memory:' line")
    return Row("per-rank tracking, soak (200,000 iterations)",
               f"{cost.group(1)} us per call (budget 5), RSS growth {memory.group(1)} after warm-up", shown(cmd))


def table(rows: list[Row], when: str) -> str:
    """The markdown table of ``rows``, each dated ``when``."""
    lines = ["| what | measured | command | when, where |", "|---|---|---|---|"]
    for r in rows:
        cells = [r.what, r.measured, f"`{r.command}`" if "`" not in r.command else r.command, when]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def replace_table(readme: str, body: str) -> str:
    """``readme`` with the text between its highlights markers replaced by ``body``."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise Failed(f"README.md needs one '{BEGIN}' line before one '{END}' line")
    head, rest = readme.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{body}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ci-log", help="the output of a `bash .ci/run` from a fresh clone")
    ap.add_argument("--megatron", action="append", default=[], metavar="VERSION=PATH[,PYTHON]",
                    help="a Megatron-LM checkout to run the slow-GPU job in (repeatable)")
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    ap.add_argument("--print", action="store_true", help="print the table, leave README.md alone")
    args = ap.parse_args(argv)
    commit = run(["git", "rev-parse", "--short", "HEAD"], 30)[0].strip()
    when = f"{datetime.date.today().isoformat()} (at {commit}), {os.cpu_count()}-core"
    rows: list[Row] = []
    scratch = tempfile.mkdtemp(prefix="highlights-")
    steps = [("ci", lambda: ci_rows(Path(args.ci_log).read_text()) if args.ci_log else [])]
    steps.append(("main job", lambda: main_job_rows(scratch)))
    for spec in args.megatron:
        version, _, where = spec.partition("=")
        path, _, python = where.partition(",")
        if not (version and path):
            ap.error(f"--megatron {spec!r}: expected VERSION=PATH[,PYTHON]")
        steps.append((f"megatron {version}",
                      lambda v=version, p=path, py=python: [megatron_row(v, p, py or sys.executable, scratch)]))
    steps += [("ctl status", lambda: [ctl_row()]), ("soak", lambda: [soak_row()])]
    failed = 0
    for name, step in steps:
        try:
            got = step()
        except Failed as exc:
            print(f"highlights: {name}: {exc}", file=sys.stderr)
            failed += 1
            continue
        rows.extend(got)
        for r in got:
            print(f"highlights: {r.what}: {r.measured}", file=sys.stderr)
    body = table(rows, when)
    if args.print:
        print(body, end="")
    else:
        path = Path(args.readme)
        path.write_text(replace_table(path.read_text(), body))
        print(f"highlights: {len(rows)} rows written to {path}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
