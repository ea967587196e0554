"""falconext's change-point detector on the Turing change-point dataset (TCPD).

TCPD (van den Burg and Williams, 2020; github.com/alan-turing-institute/TCPD) holds 42
real series, each annotated by several people. This script runs falconext's BOCD
(falconext/detect/bocd.py) on every univariate series of a TCPD checkout as a general
change-point method and scores it with the benchmark's F1 (margin 5) and cover
(falconext/detect/cpmetrics.py). Nothing of TCPD is part of this repository: point
``--tcpd`` at a checkout (its datasets/*/NAME.json and annotations.json; series that
need a download script are left out, and named).

falconext's BOCD models positive iteration times on a log scale; a general series is
standardised (mean 0, standard deviation 1) and given to it as exp(z), so its model is a
Normal with unknown mean and variance on z, with the noise prior at one standard
deviation (``--prior-scale``) instead of the 3% of iteration times. A change point is
reported each time the posterior mass of a run started within the last
``--window`` points passes ``--threshold`` (the detector's own rule: falconext.config),
at that run's most probable start.

With ``--published DIR`` (TCPDBench's analysis/output/scores, holding
default_f1_scores.json and default_cover_scores.json) the published default BOCPD is
averaged over the same series beside it.

    python3 examples/eval_tcpd.py --tcpd /path/to/TCPD [--published /path/to/scores]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from falconext.config import FalconConfig
from falconext.detect.bocd import BOCD
from falconext.detect.cpmetrics import cover, f1


def change_points(values: list[float], hazard: float, prior_scale: float, window: int, threshold: float,
                  warmup: int) -> list[int]:
    """falconext's BOCD change points of a standardised series (module docstring)."""
    bocd = BOCD(hazard=hazard, max_run_length=max(len(values) + 2, window + 2), prior_scale=prior_scale,
                prior_kappa=1.0)
    found: list[int] = []
    last = None
    for t, z in enumerate(values):
        bocd.update(math.exp(z))
        if t + 1 < warmup or bocd.recent_mass(window) <= threshold:
            continue
        start = bocd.recent_start(window)
        if start is not None and start != last and start > 0:
            last = start
            found.append(start)
    return sorted(set(found))


def load(tcpd: Path) -> tuple[dict[str, list[float]], dict[str, dict], list[str]]:
    """Univariate series with finite values, their annotations, and the names left out
    (and why)."""
    annotations = json.loads((tcpd / "annotations.json").read_text())
    series, skipped = {}, []
    for name in sorted(annotations):
        path = tcpd / "datasets" / name / f"{name}.json"
        if not path.exists():
            skipped.append(f"{name} (needs its download script)")
            continue
        data = json.loads(path.read_text())
        if data.get("n_dim") != 1:
            skipped.append(f"{name} (multivariate)")
            continue
        raw = data["series"][0]["raw"]
        if any(v is None or not math.isfinite(float(v)) for v in raw):
            skipped.append(f"{name} (missing values)")
            continue
        series[name] = [float(v) for v in raw]
    return series, annotations, skipped


def standardise(values: list[float]) -> list[float]:
    mu = statistics.fmean(values)
    sd = statistics.pstdev(values) or 1.0
    return [(v - mu) / sd for v in values]


def main(argv: list[str] | None = None) -> int:
    cfg = FalconConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tcpd", required=True, help="a TCPD checkout (datasets/ and annotations.json)")
    p.add_argument("--published", default=None, help="TCPDBench's analysis/output/scores folder (optional)")
    p.add_argument("--hazard", type=float, default=1.0 / 100.0, help="change-point hazard (default 1/100)")
    p.add_argument("--prior-scale", type=float, default=1.0, help="noise prior, in standard deviations")
    p.add_argument("--window", type=int, default=cfg.bocd_recent_window)
    p.add_argument("--threshold", type=float, default=cfg.bocd_threshold)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print JSON per series instead of a table")
    args = p.parse_args(argv)
    tcpd = Path(args.tcpd)
    if not (tcpd / "annotations.json").is_file() or not (tcpd / "datasets").is_dir():
        print(f"eval_tcpd: {tcpd} is not a TCPD checkout (no annotations.json and datasets/)", file=sys.stderr)
        return 2
    if not (0 < args.hazard < 1 and args.prior_scale > 0 and args.window >= 1 and 0 < args.threshold < 1):
        print("eval_tcpd: --hazard and --threshold must be in (0, 1), --prior-scale > 0, --window >= 1", file=sys.stderr)
        return 2
    published: dict[str, dict] = {}
    if args.published:
        try:
            published = {m: json.loads((Path(args.published) / f"default_{m}_scores.json").read_text())
                         for m in ("f1", "cover")}
        except (OSError, ValueError) as exc:
            print(f"eval_tcpd: --published {args.published}: {exc}", file=sys.stderr)
            return 2
    series, annotations, skipped = load(tcpd)
    if not series:
        print(f"eval_tcpd: no univariate series with finite values under {tcpd / 'datasets'}", file=sys.stderr)
        return 2
    rows = []
    for name, values in series.items():
        cps = change_points(standardise(values), args.hazard, args.prior_scale, args.window, args.threshold,
                            args.warmup)
        n = len(values)
        row = {"series": name, "n": n, "predicted": len(cps), "f1": f1(annotations[name], cps, n),
               "cover": cover(annotations[name], cps, n)}
        for m in ("f1", "cover"):
            row[f"bocpd_{m}"] = published.get(m, {}).get(name, {}).get("bocpd") if published else None
        rows.append(row)
    if args.json:
        print(json.dumps({"rows": rows, "skipped": skipped}))
        return 0
    print(f"{'series':<22}{'n':>6}{'cps':>5}{'F1':>8}{'cover':>8}" + (f"{'BOCPD F1':>10}{'cover':>8}" if published else ""))
    for r in rows:
        extra = ""
        if published:
            extra = "".join(f"{'-' if r[k] is None else f'{r[k]:.3f}':>{w}}" for k, w in (("bocpd_f1", 10), ("bocpd_cover", 8)))
        print(f"{r['series']:<22}{r['n']:>6}{r['predicted']:>5}{r['f1']:>8.3f}{r['cover']:>8.3f}{extra}")
    both = [r for r in rows if r["bocpd_f1"] is not None and r["bocpd_cover"] is not None] if published else rows
    mean = lambda k, rs: statistics.fmean(r[k] for r in rs)  # noqa: E731
    print(f"mean over {len(rows)} series: F1 {mean('f1', rows):.3f}, cover {mean('cover', rows):.3f}")
    if published and both:
        print(f"on the {len(both)} series the published default BOCPD ran on: falconext F1 {mean('f1', both):.3f}, "
              f"cover {mean('cover', both):.3f}; BOCPD F1 {mean('bocpd_f1', both):.3f}, cover {mean('bocpd_cover', both):.3f}")
    print("left out: " + (", ".join(skipped) if skipped else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
