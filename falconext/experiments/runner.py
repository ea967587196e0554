"""Running experiments and writing their files: the I/O edge of ``falconext experiment``.

For each experiment run, ``OUT/NAME/`` gets ``results.csv`` (the measured rows),
``figure.png`` (matplotlib, Agg) and ``table.md`` (the paper's number beside ours);
``run all`` adds ``OUT/summary.md`` joining every table and naming what was skipped and why.
"""

from __future__ import annotations

import csv
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from falconext.experiments.registry import EXPERIMENTS, Experiment, UnknownExperiment, lookup
from falconext.experiments.result import ExperimentResult
from falconext.inputs import InputError

#: exit status of ``run NAME`` for an experiment that is registered but not implemented
EXIT_PENDING = 1
#: exit status of ``run all`` when an implemented experiment failed
EXIT_FAILED = 1


@dataclass(frozen=True)
class Outcome:
    """How one experiment of a run went: 'done', 'skipped' (pending) or 'failed'."""

    name: str
    status: str
    seconds: float = 0.0
    detail: str = ""
    table_md: str = ""


def output_folder(out: str) -> Path:
    """``out`` as a folder, created if missing. Raises InputError if it cannot be one."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise InputError(f"--out {out}: is a file, not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"--out {out}: cannot create the folder ({exc.strerror or exc})") from None
    return p


def write_csv(rows: list[dict], path: Path) -> None:
    """Rows as CSV; the columns are every key, in the order first seen."""
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=columns, restval="")
        w.writeheader()
        for row in rows:
            w.writerow(row)


def render_table(exp: Experiment, result: ExperimentResult, quick: bool, seconds: float) -> str:
    """table.md: title, the paper's headline, the comparison table and the notes."""
    lines = [
        f"# {exp.title}",
        "",
        f"Paper: {exp.paper}. Run: {exp.name}, {'quick' if quick else 'full'} "
        f"(`falconext experiment run {exp.name}{' --quick' if quick else ''}`), {seconds:.1f} s.",
        "",
        "| quantity | paper | measured | note |",
        "|---|---|---|---|",
    ]
    for c in result.comparisons:
        cells = [c.quantity, c.paper, c.measured, c.note]
        lines.append("| " + " | ".join(s.replace("|", "\\|") for s in cells) + " |")
    if result.notes:
        lines.append("")
        lines.extend(f"- {n}" for n in result.notes)
    lines += ["", "![figure](figure.png)", ""]
    return "\n".join(lines)


def draw_figure(exp: Experiment, result: ExperimentResult, path: Path) -> None:
    """The experiment's figure as a PNG (no display needed)."""
    import matplotlib  # lazy: start-up time (matplotlib only where a figure is drawn)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: run-time order (after matplotlib.use("Agg"))

    try:
        exp.load().draw(result, str(path))
    finally:
        plt.close("all")


def run_experiment(exp: Experiment, quick: bool, out: Path, log: TextIO = sys.stderr,
                   layouts: tuple | None = None) -> Outcome:
    """Measure ``exp`` (on ``layouts`` instead of its own, where it takes them) and write
    its three files under ``out/exp.name``.

    Raises ValueError for a pending experiment; errors inside the measurement propagate.
    """
    module = exp.load()
    print(f"== {exp.name} ({'quick' if quick else 'full'}): {exp.title}", file=log, flush=True)
    t0 = time.perf_counter()
    result: ExperimentResult = module.measure(quick, layouts) if layouts else module.measure(quick)
    seconds = time.perf_counter() - t0
    folder = out / exp.name
    if folder.exists() and not folder.is_dir():
        raise InputError(f"{folder}: is a file, not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    write_csv(result.rows, folder / "results.csv")
    draw_figure(exp, result, folder / "figure.png")
    table = render_table(exp, result, quick, seconds)
    (folder / "table.md").write_text(table, encoding="utf-8")
    return Outcome(exp.name, "done", seconds, str(folder), table)


def render_summary(outcomes: list[Outcome], quick: bool) -> str:
    """summary.md: one status line per experiment, then every table, then what was skipped."""
    lines = [
        f"# Falcon evaluation reproduced ({'quick' if quick else 'full'} run)",
        "",
        "| experiment | status | seconds | detail |",
        "|---|---|---|---|",
    ]
    for o in outcomes:
        lines.append(f"| {o.name} | {o.status} | {o.seconds:.1f} | {o.detail} |")
    for o in outcomes:
        if o.status == "done":
            body = o.table_md.replace("](figure.png)", f"]({o.name}/figure.png)")
            lines += ["", "#" + body.rstrip()]  # each table one level down
    skipped = [o for o in outcomes if o.status != "done"]
    if skipped:
        lines += ["", "## Skipped or failed", ""]
        lines += [f"- {o.name}: {o.status}: {o.detail}" for o in skipped]
    return "\n".join(lines) + "\n"


def run_all(quick: bool, out: Path, log: TextIO = sys.stderr) -> list[Outcome]:
    """Every implemented experiment in the paper's order; pending ones are listed as
    skipped with their reason, and a failure is recorded and does not stop the rest.
    Writes ``out/summary.md``."""
    outcomes: list[Outcome] = []
    for exp in EXPERIMENTS:
        if not exp.implemented:
            print(f"== {exp.name}: skipped: {exp.pending}", file=log, flush=True)
            outcomes.append(Outcome(exp.name, "skipped", detail=str(exp.pending)))
            continue
        t0 = time.perf_counter()
        try:
            outcomes.append(run_experiment(exp, quick, out, log))
        except Exception as exc:  # noqa: BLE001 - one broken experiment must not lose the others
            traceback.print_exc(file=log)
            outcomes.append(Outcome(exp.name, "failed", time.perf_counter() - t0,
                                    f"{type(exc).__name__}: {exc}"))
    (out / "summary.md").write_text(render_summary(outcomes, quick), encoding="utf-8")
    return outcomes


def list_lines() -> list[str]:
    """One line per experiment: name, implemented or not, title, the paper's result."""
    width = max(len(e.name) for e in EXPERIMENTS)
    return [
        f"{e.name:<{width}}  {'ready  ' if e.implemented else 'pending'}  {e.title} (paper: {e.paper})"
        for e in EXPERIMENTS
    ]


def layouts_for(exp_name: str, text: str) -> tuple:
    """``--layouts`` of ``run NAME`` as fig12's layouts. Raises InputError (one line) for
    an experiment that takes none, and for a malformed or impossible layout."""
    takers = [e.name for e in EXPERIMENTS if e.takes_layouts]
    if exp_name == "all" or not lookup(exp_name).takes_layouts:
        raise InputError(f"--layouts: {exp_name} measures its own layouts; only {' and '.join(takers)} take them")
    from falconext.experiments.fig12 import parse_layouts  # lazy: start-up time (numpy; the CLI imports the runner)

    try:
        return parse_layouts(text)
    except ValueError as exc:
        raise InputError(f"--layouts: {exc}") from None


def main(action: str, name: str | None, quick: bool, out: str | None, layouts: str | None = None) -> int:
    """``falconext experiment list|run``: 0 when every requested experiment ran.

    Raises InputError for an unknown name, an unusable --out or --layouts (the CLI makes
    that one line and exit 2); a pending experiment run alone is one line and EXIT_PENDING.
    """
    if action == "list":
        print("\n".join(list_lines()))
        return 0
    assert name is not None and out is not None
    if name != "all":
        try:
            exp = lookup(name)
        except UnknownExperiment as exc:
            raise InputError(str(exc)) from None
    if name != "all" and not exp.implemented:
        print(f"falconext experiment: {exp.name} is {exp.pending}", file=sys.stderr)
        return EXIT_PENDING
    chosen = layouts_for(name, layouts) if layouts is not None else None
    folder = output_folder(out)
    if name == "all":
        outcomes = run_all(quick, folder)
        done = sum(o.status == "done" for o in outcomes)
        failed = [o.name for o in outcomes if o.status == "failed"]
        print(f"{done} experiments written, {sum(o.status == 'skipped' for o in outcomes)} skipped"
              + (f", failed: {', '.join(failed)}" if failed else "") + f"; see {folder / 'summary.md'}")
        return EXIT_FAILED if failed else 0
    outcome = run_experiment(exp, quick, folder, layouts=chosen)
    print(f"{exp.name}: {outcome.seconds:.1f} s; wrote {outcome.detail}/results.csv, figure.png, table.md")
    return 0
