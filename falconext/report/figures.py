"""``falconext report DIR``: a run's pictures and one HTML page to see them in.

From the files every run leaves (``iterations.csv``, ``estimates.csv``, ``events.jsonl``,
``run.json``, ``summary.json``) it draws, with matplotlib (no display needed):

- ``iterations.png``: the loop's iteration time (median over ranks) with each injected
  fault's window shaded and the decisions marked: fail-slow detected, localized, each
  mitigation applied;
- ``scores.png``: every rank's straggler score per iteration, a heat map (which rank is
  slow, at a glance);
- ``plan.png``: the micro-batches each data-parallel replica runs, over iterations;

and ``report.html`` with the summary's key figures in a table and the three pictures.
Reading is strict: a folder that is not a run is an :class:`InputError` naming what is
missing.
"""

from __future__ import annotations

import csv
import html
import json
import os
from statistics import median
from typing import Any

from falconext.inputs import InputError
from falconext.report.summary import read_events

FIGURES = ("iterations.png", "scores.png", "plan.png")


def _rows(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_run(out: str) -> dict[str, Any]:
    """The run's files as plain data; an :class:`InputError` naming the first one missing."""
    if not os.path.isdir(out):
        raise InputError(f"{out}: not a directory")
    need = ("run.json", "iterations.csv", "events.jsonl")
    missing = [n for n in need if not os.path.exists(os.path.join(out, n))]
    if missing:
        raise InputError(f"{out}: not a falconext run (no {', '.join(missing)})")
    try:
        with open(os.path.join(out, "run.json")) as f:
            run = json.load(f)
        events = read_events(out)
        summary = {}
        if os.path.exists(os.path.join(out, "summary.json")):
            with open(os.path.join(out, "summary.json")) as f:
                summary = json.load(f)
        est = os.path.join(out, "estimates.csv")
        return {"run": run, "events": events, "summary": summary,
                "iterations": _rows(os.path.join(out, "iterations.csv")),
                "estimates": _rows(est) if os.path.exists(est) else []}
    except (OSError, ValueError) as exc:
        raise InputError(f"{out}: unreadable run file: {exc}") from None


def loop_times(iterations: list[dict[str, str]]) -> tuple[list[int], list[float]]:
    """Iterations and the median over ranks of their measured time."""
    by_it: dict[int, list[float]] = {}
    for r in iterations:
        by_it.setdefault(int(r["iteration"]), []).append(float(r["iter_time_s"]))
    its = sorted(by_it)
    return its, [median(by_it[i]) for i in its]


def score_matrix(estimates: list[dict[str, str]]) -> tuple[list[int], list[int], list[list[float]]]:
    """(ranks, iterations, scores[rank][iteration]) from estimates.csv (NaN where none)."""
    cells: dict[tuple[int, int], float] = {}
    for r in estimates:
        if r.get("score"):
            cells[(int(r["rank"]), int(r["iteration"]))] = float(r["score"])
    ranks = sorted({k[0] for k in cells})
    its = sorted({k[1] for k in cells})
    return ranks, its, [[cells.get((rk, it), float("nan")) for it in its] for rk in ranks]


def plan_steps(events: list[dict[str, Any]], iterations: list[int], dp: int,
               total: int) -> list[tuple[int, list[int]]]:
    """(from iteration, micro-batches per replica) at the start (``total`` micro-batches per
    global batch, even) and at each applied plan."""
    steps: list[tuple[int, list[int]]] = []
    for e in events:
        if e.get("type") == "plan_applied" and isinstance(e.get("plan"), list) and e.get("rank", 0) == 0:
            steps.append((int(e["iteration"]), [int(x) for x in e["plan"]]))
    first = iterations[0] if iterations else 0
    if not steps or steps[0][0] > first:
        steps.insert(0, (first, [total // dp] * dp if dp else []))
    return sorted(steps)


def marks(events: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(iteration, label) of the decisions: detection, localization, mitigations."""
    out: list[tuple[int, str]] = []
    detected = [e for e in events if e.get("type") == "fail_slow" and e.get("detected_at") is not None]
    if detected:
        out.append((min(int(e["detected_at"]) for e in detected), "detected"))
    sessions = {e.get("session"): e.get("iteration") for e in events if e.get("type") == "suspended"}
    for e in events:
        if e.get("type") == "localized" and (e.get("gpus") or e.get("links")):
            it = sessions.get((e.get("evidence") or {}).get("session"))
            if it is not None:
                out.append((int(it), "localized"))
                break
    for e in events:
        if e.get("type") == "mitigation" and e.get("iteration") is not None:
            out.append((int(e["iteration"]), str(e.get("strategy", "mitigation"))))
    return sorted(out)


def write_report(out: str) -> str:
    """Draw the run's figures and write ``report.html`` beside them; returns its path."""
    data = read_run(out)
    import matplotlib  # lazy: start-up time (matplotlib only where a figure is drawn)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: run-time order (after matplotlib.use("Agg"))

    run, events = data["run"], data["events"]
    its, times = loop_times(data["iterations"])
    topo = run.get("topology") or {}
    dp = int(topo.get("dp") or 0) or max(1, int(topo.get("world", 1) or 1))

    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.plot(its, times, lw=1.2, color="#1f4e79", label="iteration time (median over ranks)")
    for f in run.get("faults") or []:
        end = f.get("end") if f.get("end") is not None else (its[-1] + 1 if its else f["start"] + 1)
        ax.axvspan(f["start"], end, color="#f4b183", alpha=0.35, lw=0,
                   label=f"injected {f.get('kind', 'fault')} x{f.get('factor', '?')}")
    if times:  # suspensions are seconds long: keep the scale on the iterations
        typical = sorted(times)[int(0.95 * (len(times) - 1))]
        ax.set_ylim(0, 2.5 * typical)
        for it in sorted({int(e["iteration"]) for e in events if e.get("type") == "suspended"}):
            ax.axvline(it, color="#a6a6a6", lw=0.8)
    colors = {"detected": "#c00000", "localized": "#7030a0"}
    for it, label in marks(events):
        ax.axvline(it, color=colors.get(label, "#548235"), ls="--", lw=1)
        ax.annotate(label, (it, ax.get_ylim()[1]), rotation=90, va="top", ha="right", fontsize=8)
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "iterations.png"), dpi=110)
    plt.close(fig)

    ranks, s_its, matrix = score_matrix(data["estimates"])
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.35 * max(1, len(ranks))))
    if ranks:
        im = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="magma_r", vmin=-0.05,
                       vmax=max(0.3, max((v for row in matrix for v in row if v == v), default=0.3)),
                       extent=(s_its[0] - 0.5, s_its[-1] + 0.5, len(ranks) - 0.5, -0.5))
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
        fig.colorbar(im, ax=ax, label="score")
    else:
        ax.text(0.5, 0.5, "no scores in estimates.csv", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("iteration")
    ax.set_title("which rank keeps the others waiting (score = late_s / iteration time)", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "scores.png"), dpi=110)
    plt.close(fig)

    args = run.get("args") or {}
    total = int(args.get("global_batch_size") or dp) // max(1, int(args.get("micro_batch_size") or 1))
    steps = plan_steps(events, its, dp, total)
    fig, ax = plt.subplots(figsize=(9, 2.6))
    last = its[-1] + 1 if its else 1
    for replica in range(len(steps[0][1]) if steps else 0):
        xs, ys = [], []
        for k, (start, plan) in enumerate(steps):
            stop = steps[k + 1][0] if k + 1 < len(steps) else last
            xs += [start, stop]
            ys += [plan[replica], plan[replica]] if replica < len(plan) else [0, 0]
        ax.plot(xs, ys, lw=1.5, label=f"replica {replica}")
    ax.set_xlabel("iteration")
    ax.set_ylabel("micro-batches")
    ax.legend(loc="upper left", fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "plan.png"), dpi=110)
    plt.close(fig)

    path = os.path.join(out, "report.html")
    with open(path, "w") as f:
        f.write(_page(out, data["summary"]))
    return path


def _page(out: str, summary: dict[str, Any]) -> str:
    keys = ("iterations", "healthy_iter_s", "slow_iter_s", "mitigated_iter_s", "slowdown_removed",
            "slowdown_removed_max", "final_loss")
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(summary.get(k)))}</td></tr>"
                   for k in keys if k in summary)
    det = summary.get("detection") or {}
    for k, v in (det.items() if isinstance(det, dict) else []):
        if not isinstance(v, (dict, list)):
            rows += f"<tr><th>detection {html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
    figs = "".join(f'<figure><img src="{name}" alt="{name}"><figcaption>{name}</figcaption></figure>'
                   for name in FIGURES)
    title = html.escape(os.path.basename(os.path.abspath(out)))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>falconext run {title}</title>"
            "<style>body{font-family:sans-serif;max-width:960px;margin:2em auto}"
            "th{text-align:left;padding-right:1em}img{max-width:100%}</style></head><body>"
            f"<h1>falconext run {title}</h1><table>{rows}</table>{figs}</body></html>\n")


def report_at_end(out: str) -> str:
    """For the end of a run: write the report and say where, or say in one line why not
    (a report is never worth failing a finished run for)."""
    try:
        return f"report: {write_report(out)}"
    except Exception as exc:  # noqa: BLE001 - matplotlib, a disk, a half-written run
        return f"report not written: {type(exc).__name__}: {exc}"


__all__ = ["FIGURES", "read_run", "report_at_end", "write_report"]
