"""What ``falconext eval-detect --sweep`` writes: every setting's point as CSV, each
method's curve as CSV, and the delay/false-alarm figure (:mod:`falconext.detect.sweep`)."""

from __future__ import annotations

import csv
import os
from typing import Mapping, Sequence

from falconext.detect.sweep import CurvePoint, Point

POINT_COLUMNS = ("method", "setting", "fpr_pct", "fnr_pct", "median_delay", "false_alarms", "healthy",
                 "labels", "default")
CURVE_COLUMNS = ("method", "fpr_pct", "median_delay", "setting")


def _cell(v: object) -> object:
    return "" if v is None else round(v, 4) if isinstance(v, float) else v


def write_points(path: str, points: Sequence[Point]) -> None:
    """One row per setting (:data:`POINT_COLUMNS`); an unreachable delay is an empty cell."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(POINT_COLUMNS)
        for p in points:
            w.writerow([p.setting.method, p.setting.label(), _cell(p.fpr_pct), _cell(p.fnr_pct),
                        _cell(p.median_delay), p.false_alarms, p.healthy, p.labels, int(p.default)])


def write_curves(path: str, curves: Mapping[str, Sequence[CurvePoint]]) -> None:
    """One row per method and rate (:data:`CURVE_COLUMNS`): the curve the figure draws."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CURVE_COLUMNS)
        for method, cps in curves.items():
            for c in cps:
                w.writerow([method, _cell(c.fpr_pct), _cell(c.median_delay), c.setting.label() if c.setting else ""])


def draw(path: str, points: Sequence[Point], curves: Mapping[str, Sequence[CurvePoint]], title: str) -> None:
    """Median delay (iterations) against the false-positive rate: each method's settings as
    dots, its lower envelope over all of them as a step line (the curve at the rates of
    ``curves`` is that line read there), its default setting ringed, and the rates the
    curves are read at shaded."""
    import matplotlib  # lazy: start-up time (matplotlib only where a figure is drawn)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: run-time order (after matplotlib.use("Agg"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (method, cps) in enumerate(curves.items()):
        color = f"C{k}"
        mine = [p for p in points if p.setting.method == method and p.median_delay is not None]
        ax.scatter([p.fpr_pct for p in mine], [p.median_delay for p in mine], s=12, color=color, alpha=0.35)
        xs, ys, best = [], [], float("inf")
        for p in sorted(mine, key=lambda p: (p.fpr_pct, p.median_delay)):
            if p.median_delay < best:
                best = p.median_delay
                xs.append(p.fpr_pct)
                ys.append(best)
        if xs:
            ax.step(xs + [100.0], ys + ys[-1:], where="post", color=color, linewidth=2, label=method)
        for p in mine:
            if p.default:
                ax.scatter([p.fpr_pct], [p.median_delay], s=90, facecolors="none", edgecolors=color, linewidths=1.5)
    rates = [c.fpr_pct for cps in curves.values() for c in cps]
    if rates:
        ax.axvspan(min(rates), max(rates), color="0.85", zorder=0, label=f"read at {min(rates):g}-{max(rates):g}%")
    ax.set_xlabel("false-positive rate (% of healthy traces with an alarm)")
    ax.set_ylabel("median detection delay (iterations; a miss counts as never)")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(left=-0.1)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(out_dir: str, points: Sequence[Point], curves: Mapping[str, Sequence[CurvePoint]],
              title: str) -> list[str]:
    """``sweep.csv``, ``curves.csv`` and ``sweep.png`` in ``out_dir`` (created); returns
    their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("sweep.csv", "curves.csv", "sweep.png")]
    write_points(paths[0], points)
    write_curves(paths[1], curves)
    draw(paths[2], points, curves, title)
    return paths
