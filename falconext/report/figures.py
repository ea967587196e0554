"""``falconext report DIR``: a run's pictures and one HTML page to see them in.

From the files every run leaves (``iterations.csv``, ``estimates.csv``, ``events.jsonl``,
``run.json``, ``summary.json``) it draws, with matplotlib (no display needed):

- ``iterations.png``: the loop's iteration time (median over ranks) with each injected
  fault's window shaded and the decisions marked, each label with its iteration and
  on a row above the plot where it overlaps no other: fail-slow detected, each
  localization with who started it (detector, score trigger, operator), each mitigation
  applied, each restart (a solid line: an attempt's boundary);
- ``scores.png``: every rank's straggler score per iteration, a heat map (which rank is
  slow, at a glance);
- ``plan.png``: the micro-batches each data-parallel replica runs, over iterations: the
  plan in force from the events of each attempt (an S4 restart runs the even plan
  again), every replica visible where plans are equal;

``figures.json`` with what was drawn (the plan series, the marks and their labels'
boxes), and ``report.html`` with the summary's key figures in a table and the three
pictures.
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
from falconext.report.plans import plan_in_force, plan_shape
from falconext.report.summary import read_events

FIGURES = ("iterations.png", "scores.png", "plan.png")
#: the figures' resolution, the figure's own and the saved picture's alike (so that the
#: pixel boxes in figures.json are the picture's)
DPI = 110


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


def plan_series(steps: list[tuple[int, list[int]]], iterations: list[int]) -> list[list[int]]:
    """Per replica, the micro-batches it ran at each of ``iterations`` under ``steps``."""
    replicas = len(steps[0][1]) if steps else 0
    out: list[list[int]] = [[] for _ in range(replicas)]
    k = 0
    for it in iterations:
        while k + 1 < len(steps) and steps[k + 1][0] <= it:
            k += 1
        plan = steps[k][1]
        for r in range(replicas):
            out[r].append(plan[r] if r < len(plan) else 0)
    return out


#: who started a localization: the controller's trigger (controller_state's ``trigger``)
WHO = {"fail_slow": "detector", "operator": "operator", "relocalize": "re-localization", "baseline": "link baseline"}
#: a score-trigger episode is a ``straggler_suspected`` event written this close before its
#: session starts (the controller writes both in one round)
SAME_ROUND_S = 1.0


def localization_trigger(localized: dict[str, Any], events: list[dict[str, Any]]) -> str:
    """Who started the session that made ``localized``: "detector" (a rank's fail-slow
    report), "fast path" (one rank's compute stepped up alone), "score trigger" (the
    controller's per-rank scores, before any detector), "operator" (``ctl validate``),
    "re-localization", or "unknown"."""
    session = (localized.get("evidence") or {}).get("session")
    started = [e for e in events if e.get("type") == "controller_state" and e.get("new") == "profiling"
               and e.get("session") == session]
    if not started:
        return "unknown"
    t, trigger = float(started[0].get("time", 0.0)), str(started[0].get("trigger"))
    suspects = [e for e in events if e.get("type") == "straggler_suspected" and e.get("action") == "localize"
                and 0 <= t - float(e.get("time", -1e18)) <= SAME_ROUND_S]
    if trigger == "fail_slow" and suspects:
        return "fast path" if suspects[-1].get("by") == "fast" else "score trigger"
    return WHO.get(trigger, "unknown")


def marks(events: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(iteration, label) of the decisions and boundaries: fail-slow detected, the fast
    path's first naming, each localization with its trigger (at its suspension's
    iteration), each mitigation, each restart."""
    out: list[tuple[int, str]] = []
    detected = [e for e in events if e.get("type") == "fail_slow" and e.get("detected_at") is not None]
    if detected:
        out.append((min(int(e["detected_at"]) for e in detected), "detected"))
    named = [e for e in events if e.get("type") == "straggler_suspected" and e.get("by") == "fast"
             and e.get("iteration") is not None]
    if named:
        out.append((min(int(e["iteration"]) for e in named), "named (fast path)"))
    sessions = {e.get("session"): e.get("iteration") for e in events if e.get("type") == "suspended"}
    for e in events:
        if e.get("type") == "localized" and (e.get("gpus") or e.get("links")):
            it = sessions.get((e.get("evidence") or {}).get("session"))
            if it is not None:
                out.append((int(it), f"localized ({localization_trigger(e, events)})"))
    for e in events:
        if e.get("type") == "mitigation" and e.get("iteration") is not None:
            out.append((int(e["iteration"]), str(e.get("strategy", "mitigation"))))
        elif e.get("type") == "restarted" and e.get("iteration") is not None:
            out.append((int(e["iteration"]), f"restart {int(e.get('attempt', 0))}"))
    return sorted(out)


def stagger(spans: list[tuple[float, float]]) -> list[int]:
    """A level for each label of horizontal extent ``(x0, x1)`` (in any one unit) such that
    no two labels on one level overlap: each takes the lowest level free over its extent,
    in order of x0 (pure)."""
    levels: list[list[tuple[float, float]]] = []
    out = [0] * len(spans)
    for k in sorted(range(len(spans)), key=lambda k: spans[k][0]):
        x0, x1 = spans[k]
        for level, taken in enumerate(levels):
            if all(x1 < a or x0 > b for a, b in taken):
                taken.append((x0, x1))
                out[k] = level
                break
        else:
            levels.append([(x0, x1)])
            out[k] = len(levels) - 1
    return out


def overlaps(boxes: list[tuple[float, float, float, float]]) -> list[tuple[int, int]]:
    """Pairs of boxes ``(x0, y0, x1, y1)`` that overlap (pure)."""
    return [(i, j) for i in range(len(boxes)) for j in range(i + 1, len(boxes))
            if boxes[i][0] < boxes[j][2] and boxes[j][0] < boxes[i][2]
            and boxes[i][1] < boxes[j][3] and boxes[j][1] < boxes[i][3]]


def write_report(out: str) -> str:
    """Draw the run's figures and write ``report.html`` beside them; returns its path."""
    data = read_run(out)
    import matplotlib  # lazy: start-up time (matplotlib only where a figure is drawn)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: run-time order (after matplotlib.use("Agg"))
    from matplotlib.lines import Line2D  # lazy: run-time order (after matplotlib.use("Agg"))

    run, events = data["run"], data["events"]
    its, times = loop_times(data["iterations"])
    topo = run.get("topology") or {}
    dp = int(topo.get("dp") or 0) or max(1, int(topo.get("world", 1) or 1))

    drawn: dict[str, Any] = {}
    restarts = sorted({int(e["iteration"]) for e in events if e.get("type") == "restarted"
                       and e.get("iteration") is not None})
    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=DPI)
    ax.plot(its, times, lw=1.2, color="#1f4e79", label="iteration time (median over ranks)")
    for f in run.get("faults") or []:
        end = f.get("end") if f.get("end") is not None else (its[-1] + 1 if its else f["start"] + 1)
        ax.axvspan(f["start"], end, color="#f4b183", alpha=0.35, lw=0,
                   label=f"injected {f.get('kind', 'fault')} x{f.get('factor', '?')}")
    if times:  # suspensions are seconds long: keep the scale on the iterations
        typical = sorted(times)[int(0.98 * (len(times) - 1))]
        ax.set_ylim(0, 1.15 * typical)
        for it in sorted({int(e["iteration"]) for e in events if e.get("type") == "suspended"}):
            ax.axvline(it, color="#a6a6a6", lw=0.8)
    for it in restarts:
        ax.axvline(it, color="#000000", lw=1.6)
    colors = {"detected": "#c00000", "localized": "#7030a0", "restart": "#000000"}
    placed = marks(events)
    labels = []
    right = its[0] + 0.7 * (its[-1] - its[0]) if its else 0
    for it, label in placed:
        ax.axvline(it, color=colors.get(label.split(" ")[0], "#548235"), ls="--", lw=1)
        labels.append(ax.text(it, 1.02, f"{label} @{it}", transform=ax.get_xaxis_transform(), fontsize=8,
                              ha="right" if it > right else "left", va="bottom", clip_on=False))
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    # labels above the plot, each on the lowest row where it overlaps none (measured extents)
    renderer = fig.canvas.get_renderer()
    spans = [(t.get_window_extent(renderer).x0 - 2, t.get_window_extent(renderer).x1 + 2) for t in labels]
    rows = stagger(spans)
    row_h = 0.075
    for t, row in zip(labels, rows):
        t.set_y(1.02 + row_h * row)
    fig.subplots_adjust(top=min(0.88, 0.9 - row_h * 0.8 * max(rows, default=0)))
    fig.canvas.draw()
    boxes = [tuple(round(v, 1) for v in t.get_window_extent(renderer).extents) for t in labels]
    drawn["iterations"] = {"marks": [{"iteration": it, "label": label, "bbox": list(box)}
                                     for (it, label), box in zip(placed, boxes)],
                           "ylim": [round(v, 6) for v in ax.get_ylim()], "restarts": restarts}
    fig.savefig(os.path.join(out, "iterations.png"), dpi=DPI)
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
    fig.savefig(os.path.join(out, "scores.png"), dpi=DPI)
    plt.close(fig)

    dp, total = plan_shape(run)
    steps = plan_in_force(events, its[0] if its else 0, dp, total)
    series = plan_series(steps, its)
    fig, ax = plt.subplots(figsize=(9, 2.6), dpi=DPI)
    for replica, ys in enumerate(series):
        # equal plans draw on top of each other: each replica's dashes fill its own share
        # of the pattern, so every replica stays visible where the lines coincide
        n = max(1, len(series))
        ax.plot(its, ys, lw=1.8, drawstyle="steps-post", label=f"replica {replica}",
                linestyle=(3.0 * replica, (3.0, 3.0 * (n - 1))) if n > 1 else "-")
    # the legend's samples solid: a dash phase could leave a replica's sample blank
    handles = [Line2D([0], [0], color=line.get_color(), lw=2) for line in ax.get_lines()]
    for it in restarts:
        ax.axvline(it, color="#000000", lw=1.2)
        ax.text(it, 1.01, f"restart @{it}", transform=ax.get_xaxis_transform(), fontsize=7, ha="left", va="bottom")
    ax.set_xlabel("iteration")
    ax.set_ylabel("micro-batches")
    ax.legend(handles, [f"replica {r}" for r in range(len(series))], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=8)  # outside: the plot holds only the plan
    fig.tight_layout()
    fig.savefig(os.path.join(out, "plan.png"), dpi=DPI)
    drawn["plan"] = {"iterations": its, "replicas": series, "steps": [[it, plan] for it, plan in steps],
                     "restarts": restarts, "xlim": list(ax.get_xlim()),
                     "axes_px": [round(v, 1) for v in ax.get_window_extent().extents]}
    plt.close(fig)
    with open(os.path.join(out, "figures.json"), "w") as f:
        json.dump(drawn, f)

    path = os.path.join(out, "report.html")
    with open(path, "w") as f:
        f.write(_page(out, data["summary"]))
    return path


def _page(out: str, summary: dict[str, Any]) -> str:
    keys = ("iterations", "timing", "healthy_iter_s", "slow_iter_s", "mitigated_iter_s", "slowdown_removed",
            "s2_slowdown_removed", "slowdown_removed_max", "slowdown_removed_ceiling", "final_loss")
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(summary.get(k)))}</td></tr>"
                   for k in keys if k in summary)
    mit = summary.get("mitigation") or {}
    for r in mit.get("restarts") or []:
        rows += (f"<tr><th>restart</th><td>at iteration {html.escape(str(r.get('iteration')))} after "
                 f"{html.escape(str(r.get('downtime_s')))} s down</td></tr>")
    for a in mit.get("attempts") or []:
        plans = ", ".join(f"{p} from {it}" for it, p in a.get("plans") or [])
        rows += (f"<tr><th>attempt {html.escape(str(a.get('attempt')))}</th><td>from iteration "
                 f"{html.escape(str(a.get('from_iteration')))}: plan {html.escape(plans)}</td></tr>")
    for k, v in (summary.get("wall_clock") or {}).items():  # beside the devices' figures
        rows += f"<tr><th>wall clock {html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
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


__all__ = ["FIGURES", "marks", "plan_in_force", "plan_series", "read_run", "report_at_end", "write_report"]
