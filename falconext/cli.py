"""The ``falconext`` command line.

Every subcommand reads files strictly and prints JSON (or a table for people); any
problem with the input ends in one line on stderr naming it and exit status 2, never a
traceback, because these commands sit in scripts and pipelines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from typing import Sequence

from falconext.config import ConfigError, FalconConfig, add_config_arguments, config_from_args, field_value
from falconext.detect import METHOD_NAMES, UnknownMethod, detect, sweep
from falconext.detect.evaluate import TraceScore, score_trace, summarize
from falconext.detect.series_io import read_series
from falconext.detect.sweep_report import write_all
from falconext.experiments.runner import main as experiment_main
from falconext.inputs import InputError
from falconext.megatron_lm import patching
from falconext.model.device import DEFAULT_INTER_BANDWIDTH
from falconext.protocol.commands import (
    MitigateRequest,
    MuteRequest,
    OperatorCommand,
    SetRequest,
    TableRequest,
    UnmuteRequest,
    ValidateRequest,
)
from falconext.testbed.nodes import mbps_to_bytes, run_nodes
from falconext.testbed.options import add_train_arguments
from falconext.trace.logfile import read_call_log_lines
from falconext.trace.records import RecordError

# What needs numpy, scipy or redis (half a second each) is imported by the subcommands that
# use it, so that `falconext --help` answers quickly and without torch: the detectors'
# classes on first use (falconext.detect), the modules below where they are marked lazy.

EXIT_BAD_INPUT = 2


def _user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that are the user's input, not a bug (one line, exit 2)."""
    return (InputError, RecordError, ConfigError, UnknownMethod)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage problem in one line, like every other error here."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def _method(value: str) -> str:
    if value not in METHOD_NAMES:
        raise argparse.ArgumentTypeError(
            f"unknown method {value!r} (choose from {', '.join(METHOD_NAMES)})"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``falconext`` command line: every subcommand and its options (``launch`` is
    parsed apart, as torchrun's command line)."""
    parser = _Parser(prog="falconext", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("detect", help="find fail-slows in iteration-time series")
    p.add_argument("file", help="CSV with an iter_time column, JSON list, or JSONL with id + iter_times")
    p.add_argument("--method", type=_method, default="bocd+v", help="bocd+v (default), bocd or slide-window")
    add_config_arguments(p)

    p = sub.add_parser("period", help="recover the period and iteration times from a call log")
    p.add_argument("log", help="JSONL call records: rank, op, group, bytes, t_issue (seconds)")
    add_config_arguments(p)

    p = sub.add_parser("eval-detect", help="score the detection methods on labelled traces")
    p.add_argument("traces", nargs="?", help="JSONL with id, iter_times and events [[onset, end, slowdown], ...]")
    p.add_argument("--job-day", action="store_true",
                   help="count false alarms per job-day instead: the rank side's whole detection (tracker, "
                   "BOCD+V, the fast path) over generated healthy days of calls (sim/jobday.py)")
    p.add_argument("--seed", type=int, default=1000, help="with --job-day: the first day's seed")
    p.add_argument("--days", type=int, default=1, help="with --job-day: days, one seed each from --seed")
    p.add_argument("--ranks", type=int, default=8, help="with --job-day: data-parallel ranks")
    p.add_argument("--iterations", type=int, default=86_400, help="with --job-day: iterations per day (~1 s each)")
    p.add_argument("--method", type=_method, action="append", help="method(s) to score (default: all three)")
    p.add_argument("--tolerance", type=int, default=10, help="iterations a detected onset may precede the label")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    p.add_argument("--sweep", action="store_true",
                   help="sweep each method's sensitivity and write delay against false alarms to --out "
                   "(sweep.csv, curves.csv, sweep.png; methods: bocd+v and persistence unless --method)")
    p.add_argument("--out", default=None, help="folder for the sweep's files (with --sweep)")
    add_config_arguments(p)

    p = sub.add_parser("train", help="train a small megatron-core GPT on this machine (torchrun)")
    add_train_arguments(p, launcher=True)

    p = sub.add_parser("nodes", help="run a command once per emulated node (network namespaces, shaped links)")
    p.add_argument("--count", type=int, required=True, help="how many nodes")
    p.add_argument("--link-mbps", type=float, default=None,
                   help="each link between two nodes, megabits/s (default: the emulated network's 400)")
    p.add_argument("--out", default=None, help="keep each node's output in OUT/node<k>.log and OUT/nodes.json")
    p.add_argument("--timeout", type=float, default=None, help="stop every node after this many seconds")
    p.add_argument("cmd", nargs=argparse.REMAINDER,
                   help="-- CMD ...: {node}, {addr} and {head} are replaced per node")
    p = sub.add_parser("gen-traces", help="write a labelled trace set (JSONL) to stdout")
    p.add_argument("--count", type=int, default=300)
    p.add_argument("--kinds", default="compute,comm,healthy", help="comma-separated, drawn in turn")
    p.add_argument("--length", type=int, default=2000, help="iterations per trace")
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("experiment", help="reproduce the paper's evaluation: list or run its experiments")
    esub = p.add_subparsers(dest="action", required=True, parser_class=_Parser)
    esub.add_parser("list", help="every figure and table, and whether it runs yet")
    e = esub.add_parser("run", help="run one experiment (or all) and write OUT/NAME/{results.csv,figure.png,table.md}")
    e.add_argument("name", help="an experiment from `falconext experiment list`, or all")
    e.add_argument("--quick", action="store_true", help="the reduced version CI runs")
    e.add_argument("--out", required=True, help="folder for the results (created if missing)")
    e.add_argument("--layouts", help="fig12 and fig18: the parallel layouts to measure instead of the "
                   "experiment's own, comma-separated xTyDzP[@nodes] (e.g. 1T4D1P,2T2D2P@2)")

    p = sub.add_parser("report", help="draw a run's figures and report.html (iteration time, scores, plan)")
    p.add_argument("dir", help="a run's folder (--out of falconext train, --falcon-out of falconext launch)")
    _add_ctl_parser(sub)
    p = sub.add_parser("megatron-patch", help="check or apply falconext's patch to a Megatron-LM checkout")
    p.add_argument("action", choices=("check", "apply"), help="check: report only; apply: patch the checkout")
    p.add_argument("dir", help="the Megatron-LM checkout (holding megatron/core/package_info.py)")
    return parser


def _add_ctl_parser(sub) -> None:
    p = sub.add_parser("ctl", help="see and steer a running job (status, events, validate, force, mute, set)")
    p.add_argument("--run", required=True, metavar="DIR",
                   help="the job's run directory (--out of falconext train, --falcon-out of falconext launch)")
    cs = p.add_subparsers(dest="ctl_command", required=True, parser_class=_Parser)
    q = cs.add_parser("status", help="job shape, per-rank times and scores, controller state, plan, planner")
    q.add_argument("--json", action="store_true", help="the controller's snapshot as JSON")
    q.add_argument("--all", action="store_true",
                   help="every rank's row as CSV (a large job's status lists only the slowest listed_ranks); "
                        "the controller writes it to ranks.csv in the run directory")
    q = cs.add_parser("events", help="the run's events (human-readable; --json: one JSON object a line)")
    q.add_argument("--follow", action="store_true", help="keep printing new events until the job ends")
    q.add_argument("--json", action="store_true")
    q.add_argument("--timeout", type=float, default=None, help="stop following after this many seconds")
    q = cs.add_parser("validate", help="run the GEMM and P2P validation now and print the verdicts")
    q.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the verdict (0: do not wait)")
    q = cs.add_parser("force", help="apply a mitigation now: s2 --plan, s3 --roles, s4 [--exclude-nodes]")
    q.add_argument("strategy", choices=("s2", "s3", "s4"))
    q.add_argument("--plan", help="s2: micro-batches per DP replica, e.g. 3,5,4,4 (default: the balanced plan)")
    q.add_argument("--roles", help="s3: the torch rank each process plays, a permutation, e.g. 0,2,1,3")
    q.add_argument("--exclude-nodes", help="s4: nodes to restart without, e.g. 0")
    q.add_argument("--wait", type=float, default=60.0, help="seconds to wait until it is applied (0: do not wait)")
    q = cs.add_parser("revert", help="back to the even micro-batch plan")
    q.add_argument("--wait", type=float, default=60.0, help="seconds to wait until it is applied (0: do not wait)")
    cs.add_parser("mute", help="detection and mitigation off (tracking keeps running)")
    cs.add_parser("unmute", help="detection and mitigation on again")
    q = cs.add_parser("set", help="set a controller threshold (a FalconConfig field) at run time")
    q.add_argument("name")
    q.add_argument("value")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``falconext`` subcommand; returns its exit status (2 with one line on
    stderr for the user's bad input, never a traceback for it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # torchrun's command line, taken whole (see falconext.megatron_lm.launcher)
        return _cmd_launch(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except BrokenPipeError:  # `falconext ... | head`
        return 0
    except Exception as exc:
        if not isinstance(exc, _user_errors()):
            raise
        print(f"falconext {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _cmd_detect(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    data = read_series(args.file)
    if data.format == "jsonl" or any(s.id is not None for s in data.series):
        for s in data.series:
            events = detect(s.iter_times, args.method, cfg)
            print(json.dumps({"id": s.id, "events": [e.to_dict() for e in events]}))
    else:
        s = data.series[0]
        events = detect(s.iter_times, args.method, cfg)
        print(json.dumps({"method": args.method, "iterations": len(s.iter_times), "events": [e.to_dict() for e in events]}))
    return 0


def _cmd_period(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    from falconext.detect.itertime import iteration_numbers, iteration_times_by_rank  # lazy: start-up time (numpy)

    records, lines = read_call_log_lines(args.log)
    counts = Counter(r.rank for r in records)
    first_line: dict[int, int] = {}
    for record, line in zip(records, lines):
        first_line.setdefault(record.rank, line)
    need = 2 * cfg.acf_min_repeats
    short = sorted(rank for rank, n in counts.items() if n < need)
    if short:
        rank = short[0]
        raise InputError(f"{args.log}:{first_line[rank]}: rank {rank} has {counts[rank]} call(s), the first "
                         f"on this line; a period needs at least {need} (2 x acf_min_repeats)")
    result = {}
    for rank, (period, its) in iteration_times_by_rank(records, cfg).items():
        # the iteration each estimate measures, counted from the calls (iterations that
        # held an insertion, and the warm-up, are absent from both lists)
        entry: dict = {"period": period, "iterations": iteration_numbers(its),
                       "iter_times": [round(it.duration, 9) for it in its]}
        changes = [(k, it.period) for k, it in enumerate(its) if k == 0 or it.period != its[k - 1].period]
        if len(changes) > 1:  # the call pattern changed (e.g. re-planned micro-batches)
            entry["periods"] = [{"from": k, "period": p} for k, p in changes]
        result[str(rank)] = entry
    print(json.dumps(result))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if args.job_day:
        return _job_day(args, cfg)
    if args.traces is None:
        raise InputError("eval-detect needs a JSONL file of labelled traces (or --job-day)")
    if args.tolerance < 0:
        raise InputError(f"--tolerance must be >= 0, got {args.tolerance}")
    data = read_series(args.traces)
    if data.format != "jsonl":
        raise InputError(f"{args.traces}: eval-detect needs JSONL lines with id, iter_times and events (got {data.format})")
    unlabelled = [s.id for s in data.series if s.labels is None]
    if unlabelled:
        raise InputError(f"{args.traces}: every line needs 'events' labels (missing on id {unlabelled[0]!r})")
    if args.sweep:
        return _sweep(args, data.series, cfg)
    if args.out is not None:
        raise InputError("--out names the sweep's folder: give it with --sweep")
    methods = args.method or list(METHOD_NAMES)
    groups = sorted({s.kind for s in data.series if s.kind})
    report: dict[str, dict] = {}
    jobs = [(s.iter_times, m, cfg, s.labels or [], args.tolerance) for m in methods for s in data.series]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        all_scores = list(pool.map(_score_one, jobs, chunksize=8))
    for k, m in enumerate(methods):
        per = all_scores[k * len(data.series) : (k + 1) * len(data.series)]
        scores = [(s.kind, sc) for s, sc in zip(data.series, per)]
        entry = {"all": summarize(sc for _, sc in scores).to_dict()}
        for g in groups:
            entry[g] = summarize(sc for k, sc in scores if k == g).to_dict()
        report[m] = entry
    if args.json:
        print(json.dumps(report))
    else:
        print(_table(report, len(data.series)))
    return 0


def _job_day(args: argparse.Namespace, cfg: FalconConfig) -> int:
    """False alarms per job-day (detect/jobday.py): one healthy generated day per seed, a
    row each, and the rate per day over all of them."""
    # lazy: start-up time (scipy for BOCD+V; no other command needs them)
    from falconext.detect.jobday import DAY_S, run_day
    from falconext.sim.jobday import JobDaySpec  # lazy: start-up time

    if args.traces is not None:
        raise InputError("--job-day generates its own days: give no traces file")
    if args.days < 1 or args.iterations < 100:
        raise InputError(f"--job-day needs --days >= 1 and --iterations >= 100 (got {args.days}, {args.iterations})")
    try:
        spec = JobDaySpec(ranks=args.ranks, iterations=args.iterations, restart_at=args.iterations // 2)
    except ValueError as exc:
        raise InputError(f"--job-day: {exc}") from None
    results = [run_day(spec, args.seed + k, cfg, jobs=max(1, args.jobs)) for k in range(args.days)]
    days = sum(r.seconds for r in results) / DAY_S
    names = ("bocd+v", "fast")
    totals = {n: sum(len(r.alarms[n]) for r in results) for n in names}
    totals["whole"] = sum(len(r.whole) for r in results)
    if args.json:
        print(json.dumps({"ranks": spec.ranks, "iterations": spec.iterations, "days": round(days, 4),
                          "seeds": [r.seed for r in results],
                          "false_alarms": totals, "per_day": {n: round(v / days, 4) for n, v in totals.items()},
                          "by_seed": [{"seed": r.seed, "days": round(r.seconds / DAY_S, 4),
                                       **{n: len(r.alarms[n]) for n in names}, "whole": len(r.whole)}
                                      for r in results]}))
        return 0
    print(f"false alarms on healthy job-days: {spec.ranks} data-parallel ranks, {spec.iterations} iterations a day, "
          f"seeds {results[0].seed}-{results[-1].seed}")
    print(f"{'seed':>6} {'days':>6} {'bocd+v':>7} {'fast':>5} {'whole':>6}")
    for r in results:
        print(f"{r.seed:>6} {r.seconds / DAY_S:>6.3f} {len(r.alarms['bocd+v']):>7} {len(r.alarms['fast']):>5} "
              f"{len(r.whole):>6}")
    print("per day: " + ", ".join(f"{n} {v / days:.3f}" for n, v in totals.items()))
    return 0


def _sweep(args: argparse.Namespace, series: list, cfg: FalconConfig) -> int:
    """``eval-detect --sweep``: every setting of each method's sensitivity scored on the
    set, the curves and the operating point printed, the files written to ``--out``."""
    if args.out is None:
        raise InputError("--sweep needs --out DIR (the folder for sweep.csv, curves.csv and sweep.png)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise InputError(f"--out {args.out}: exists and is not a folder")
    healthy = sum(1 for s in series if not s.labels)
    if healthy == 0 or healthy == len(series):
        what = "healthy traces (no events) to count false alarms on" if healthy == 0 else \
            "traces with fail-slows to measure a delay on"
        raise InputError(f"{args.traces}: the sweep needs {what} (gen-traces --kinds mixed writes both)")
    methods = args.method or ["bocd+v", "persistence"]
    try:
        grid = [st for m in dict.fromkeys(methods) for st in sweep.settings(m)]
        configs = [st.config(cfg) for st in grid]
    except (ValueError, ConfigError) as exc:
        raise InputError(f"sweep: {exc}") from None
    jobs = [(s.iter_times, st.method, c, s.labels or [], args.tolerance) for st, c in zip(grid, configs) for s in series]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        scores = list(pool.map(_score_one, jobs, chunksize=8))
    n = len(series)
    points = [sweep.point(st, scores[k * n:(k + 1) * n], cfg) for k, st in enumerate(grid)]
    curves = {m: sweep.curve([p for p in points if p.setting.method == m]) for m in dict.fromkeys(methods)}
    paths = write_all(args.out, points, curves, f"{args.traces}: {n} traces, {healthy} healthy")
    best = sweep.operating_point([p for p in points if p.setting.method == "bocd+v"])
    default = [p for p in points if p.default and p.setting.method == "bocd+v"]
    summary = {
        "traces": n, "healthy": healthy, "files": paths,
        "curves": {m: [{"fpr_pct": c.fpr_pct, "median_delay": c.median_delay,
                        "setting": c.setting.label() if c.setting else None} for c in cps] for m, cps in curves.items()},
        "bocd+v_worse_than_persistence_at_fpr_pct": sweep.worse_at(curves["bocd+v"], curves["persistence"])
        if {"bocd+v", "persistence"} <= set(curves) else None,
        "bocd+v_at_fpr_0": None if best is None else {"setting": best.setting.label(), "median_delay": best.median_delay,
                                                      "fnr_pct": round(best.fnr_pct, 2)},
        "bocd+v_default": None if not default else {"setting": default[0].setting.label(), "fpr_pct": round(default[0].fpr_pct, 2),
                                                   "median_delay": default[0].median_delay, "fnr_pct": round(default[0].fnr_pct, 2)},
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    rates = [c.fpr_pct for c in next(iter(curves.values()))]
    lines = [f"{n} traces ({healthy} healthy): median delay (iterations, a miss counts as never) at each false-positive rate",
             f"{'method':<13}" + "".join(f"{f'FPR <= {r:g}%':>14}" for r in rates)]
    for m, cps in curves.items():
        lines.append(f"{m:<13}" + "".join(f"{'-' if c.median_delay is None else f'{c.median_delay:g}':>14}" for c in cps))
    if summary["bocd+v_default"]:
        d = summary["bocd+v_default"]
        lines.append(f"bocd+v as configured ({d['setting']}): FPR {d['fpr_pct']:g}%, median delay {d['median_delay']}, FNR {d['fnr_pct']:g}%")
    lines.append("wrote " + ", ".join(paths))
    print("\n".join(lines))
    return 0


def _score_one(job: tuple) -> TraceScore:
    times, method, cfg, labels, tolerance = job
    return score_trace(detect(times, method, cfg), labels, tolerance)


def _table(report: dict[str, dict], n: int) -> str:
    head = f"{'method':<13} {'set':<8} {'accuracy %':>20} {'FPR %':>16} {'FNR %':>16} {'false alarms':>12} {'median delay':>12}"
    lines = [f"{n} traces", head, "-" * len(head)]
    for method, entry in report.items():
        for group, s in entry.items():
            delay = "-" if s["median_delay"] is None else f"{s['median_delay']:.0f}"
            lines.append(
                f"{method:<13} {group:<8} {s['accuracy']:>7.2f} ({s['accuracy_n']:>10}) "
                f"{s['fpr']:>5.2f} ({s['fpr_n']:>7}) {s['fnr']:>5.2f} ({s['fnr_n']:>7}) "
                f"{s['false_alarms']:>12} {delay:>12}"
            )
    return "\n".join(lines)


def _cmd_gen_traces(args: argparse.Namespace) -> int:
    from falconext.sim.traces import KINDS, generate_traces  # lazy: start-up time (numpy)

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if kinds == ["mixed"]:
        kinds = list(KINDS)
    if args.count < 1 or args.length < 400:
        raise InputError("--count must be >= 1 and --length >= 400")
    try:
        traces = generate_traces(args.count, kinds, args.seed, args.length)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    for t in traces:
        print(json.dumps(t.to_dict()))
    return 0


def _cmd_experiment(args: argparse.Namespace) -> int:
    return experiment_main(args.action, getattr(args, "name", None), getattr(args, "quick", False),
                           getattr(args, "out", None), getattr(args, "layouts", None))


def _cmd_launch(argv: list[str]) -> int:
    """``falconext launch [torchrun options] SCRIPT [args]``: Megatron-LM with ``--falcon``."""
    from falconext.megatron_lm import launcher  # lazy: start-up time (numpy, redis)

    if not argv or argv[0] in ("-h", "--help"):
        print(launcher.launch_help(), end="")
        return 0
    try:
        return launcher.launch(argv)
    except Exception as exc:
        if not isinstance(exc, _user_errors()):
            raise
        print(f"falconext launch: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _cmd_nodes(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    rate = DEFAULT_INTER_BANDWIDTH if args.link_mbps is None else mbps_to_bytes(args.link_mbps)
    return run_nodes(args.count, cmd, rate, args.out, args.timeout)


def _cmd_train(args: argparse.Namespace) -> int:
    from falconext.testbed.launch import launch_training  # lazy: start-up time (redis)

    return launch_training(args)


def _cmd_report(args: argparse.Namespace) -> int:
    from falconext.report.figures import write_report  # lazy: start-up time (numpy)

    print(write_report(args.dir))
    return 0


def _await_outcome(tail, cmd: str, wait: float, late: str, failed_type: str, pred) -> dict | None:
    """The first event matching ``pred`` within ``wait`` seconds; None, with one line on
    stderr, when none came (``late``) or it is the ``failed_type`` event (with its reason)."""
    ev = tail.wait_for(pred, wait)
    if ev is None:
        print(f"falconext ctl {cmd}: {late} within {wait:g} s", file=sys.stderr)
        return None
    if ev["type"] == failed_type:
        print(f"falconext ctl {cmd}: failed: {ev.get('reason')}", file=sys.stderr)
        return None
    return ev


def _cmd_ctl(args: argparse.Namespace) -> int:
    """``falconext ctl``: 0 done, 1 refused by the controller or failed in the job, 2 bad
    input or a job that cannot be reached (one line on stderr either way)."""
    from falconext.control import ctl  # lazy: start-up time (redis)

    wait = getattr(args, "wait", None) or 0.0
    if wait < 0:
        raise InputError(f"--wait must be >= 0, got {wait}")
    cmd = args.ctl_command
    if cmd == "events":
        for ev in ctl.follow_events(args.run, args.follow, args.timeout):
            print(json.dumps(ev) if args.json else ctl.format_event(ev), flush=True)
        return 0
    run = ctl.open_run(args.run)
    if cmd == "set":
        value = field_value(args.name, args.value)  # ConfigError: exit 2, nothing sent
        request: OperatorCommand | None = SetRequest(args.name, value)
    elif cmd == "force":
        strategy = args.strategy.upper()
        given = {"s2": "plan", "s3": "roles", "s4": "exclude_nodes"}[args.strategy]
        for opt in ("plan", "roles", "exclude_nodes"):
            if getattr(args, opt) is not None and opt != given:
                raise InputError(f"--{opt.replace('_', '-')} does not go with force {args.strategy}")
        plan = ctl.parse_counts(args.plan, "--plan") if args.plan is not None else None
        roles = ctl.parse_counts(args.roles, "--roles") if args.roles is not None else None
        if roles is None and strategy == "S3":
            raise InputError("force s3 needs --roles (the torch rank each process plays)")
        nodes = ctl.parse_counts(args.exclude_nodes, "--exclude-nodes") if args.exclude_nodes is not None else None
        request = MitigateRequest(strategy, plan=plan, roles=roles, exclude_nodes=nodes)
    elif cmd == "revert":
        request = MitigateRequest("revert")
    else:
        # validate, mute, unmute (status sends no command)
        request = {"validate": ValidateRequest(), "mute": MuteRequest(), "unmute": UnmuteRequest()}.get(cmd)
    session = ctl.Session(run)
    try:
        if cmd == "status" and args.all:
            try:
                session.send(TableRequest())
            except ctl.Refused as exc:
                print(f"falconext ctl status --all: {exc}", file=sys.stderr)
                return 1
            print(ctl.read_table(run), end="", flush=True)
            return 0
        if cmd == "status":
            snap = session.status()
            if args.json:
                print(json.dumps(dataclasses.asdict(snap)))
            else:
                print(ctl.format_status(snap))
            return 0
        tail = ctl.EventTail(run.events_path, from_end=True)
        try:
            rep = session.send(request)
        except ctl.Refused as exc:
            print(f"falconext ctl {cmd}: {exc}", file=sys.stderr)
            return 1
        print(rep.text, flush=True)
        if cmd == "validate" and wait > 0:
            ev = _await_outcome(tail, cmd, wait, "no verdict", "localization_failed", lambda e: (
                e.get("type") == "localized" and e.get("evidence", {}).get("session", -1) >= rep.session)
                or (e.get("type") == "localization_failed" and e.get("session", -1) >= rep.session))
            if ev is None:
                return 1
            gflops = ev.get("evidence", {}).get("gemm_gflops", {})
            print(f"slow GPUs {ev['gpus']}, slow links {ev['links']}; GEMM GFLOP/s {json.dumps(gflops)}")
        elif isinstance(request, MitigateRequest) and wait > 0:
            ev = _await_outcome(tail, cmd, wait, "not applied", "mitigation_failed", lambda e: e.get("type") in (
                "mitigation", "mitigation_failed") and e.get("session", -1) >= rep.session)
            if ev is None:
                return 1
            what = {k: ev[k] for k in ("plan", "roles", "exclude_nodes") if k in ev}
            print(f"{ev['strategy']} applied from iteration {ev['iteration']} (paused {ev.get('pause_s')} s) "
                  f"{json.dumps(what)}")
        return 0
    finally:
        session.close()


def _cmd_megatron_patch(args: argparse.Namespace) -> int:
    # PatchError is an InputError: exit 2
    outcome = patching.check(args.dir) if args.action == "check" else patching.apply(args.dir)
    print(outcome.line())
    return 0


_COMMANDS = {
    "train": _cmd_train,
    "nodes": _cmd_nodes,
    "detect": _cmd_detect,
    "period": _cmd_period,
    "eval-detect": _cmd_eval,
    "gen-traces": _cmd_gen_traces,
    "experiment": _cmd_experiment,
    "megatron-patch": _cmd_megatron_patch,
    "report": _cmd_report,
    "ctl": _cmd_ctl,
}


if __name__ == "__main__":
    sys.exit(main())
