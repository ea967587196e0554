"""Delay against false alarms (falconext/detect/sweep.py, ``falconext eval-detect --sweep``):
the settings grid, the delay that counts misses, the curve as a lower envelope, the
comparison of two curves, and the command's files and one-line errors."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from falconext.cli import main
from falconext.config import FalconConfig
from falconext.detect.evaluate import TraceScore
from falconext.detect.sweep import (Point, Setting, curve, delay_with_misses, operating_point, settings,
                                    worse_at)


def _score(labels: int, delays: tuple[int, ...], false_alarms: int = 0) -> TraceScore:
    return TraceScore(labels, len(delays), false_alarms, delays, tuple(0 for _ in delays))


def _point(method: str, value: float, fpr: float, delay: float | None, fnr: float = 0.0) -> Point:
    return Point(Setting(method, (("min_duration", value),)), fpr, fnr, delay, 0, 100, 100, False)


def test_the_grid_is_the_product_of_the_swept_values_and_each_setting_is_a_valid_config():
    grid = settings("persistence")
    assert len(grid) == 15 * 4
    assert grid[0].label() == "persistence_iterations=2 min_slowdown=0.1"
    cfg = grid[-1].config(FalconConfig())
    assert (cfg.persistence_iterations, cfg.min_slowdown) == (16, 0.3)
    assert [s.overrides for s in settings("bocd+v")][:2] == [(("min_duration", 5),), (("min_duration", 6),)]
    defaults = [s for s in settings("bocd+v") if s.is_default(FalconConfig())]
    assert [s.label() for s in defaults] == [f"min_duration={FalconConfig().min_duration}"]
    with pytest.raises(ValueError, match="no sensitivity sweep for method 'nope'"):
        settings("nope")
    with pytest.raises(ValueError, match="'not_a_field' is not a FalconConfig field"):
        settings("x", {"x": {"not_a_field": (1,)}})


def test_a_missed_fail_slow_counts_as_never_detected():
    # three labels: delays 4 and 6, one missed -> median of (4, 6, inf) is 6
    assert delay_with_misses([_score(2, (4, 6)), _score(1, ())]) == 6.0
    # half missed: the median is infinite, so the setting has no delay at all
    assert delay_with_misses([_score(2, (4,)), _score(1, (5,)), _score(1, ())]) is None
    assert delay_with_misses([_score(0, ())]) is None
    # misses move the median later: a quick detector that misses is not a fast one
    assert delay_with_misses([_score(1, (3,)), _score(1, (20,)), _score(1, ())]) == 20.0


def test_the_curve_is_the_lowest_delay_at_or_under_each_rate():
    pts = [_point("m", 11, 0.0, 10.0), _point("m", 9, 0.5, 8.0), _point("m", 7, 2.5, 5.0),
           _point("m", 5, 1.0, None, fnr=60.0), _point("m", 10, 1.5, 9.0)]
    got = [(c.fpr_pct, c.median_delay, c.setting and c.setting.label()) for c in curve(pts, (0.0, 1.0, 2.0, 3.0))]
    assert got == [(0.0, 10.0, "min_duration=11"), (1.0, 8.0, "min_duration=9"), (2.0, 8.0, "min_duration=9"),
                   (3.0, 5.0, "min_duration=7")]
    # no setting under a rate: no delay there
    assert curve([_point("m", 7, 2.5, 5.0)], (0.0,))[0].median_delay is None


def test_worse_at_names_the_rates_where_a_curve_is_later_or_missing():
    ours = curve([_point("a", 11, 0.0, 10.0), _point("a", 7, 1.0, 6.0)], (0.0, 1.0, 2.0))
    theirs = curve([_point("b", 12, 0.0, 12.0), _point("b", 6, 1.0, 5.0)], (0.0, 1.0, 2.0))
    assert worse_at(ours, theirs) == [1.0, 2.0]
    assert worse_at(theirs, ours) == [0.0]
    assert worse_at(ours, curve([], (0.0, 1.0, 2.0))) == []
    assert worse_at(curve([], (0.0, 1.0, 2.0)), ours) == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="different rates"):
        worse_at(curve([], (0.0,)), curve([], (1.0,)))


def test_the_operating_point_is_the_fastest_setting_under_the_rate():
    pts = [_point("m", 11, 0.0, 10.0), _point("m", 9, 0.0, 9.0), _point("m", 7, 1.0, 6.0)]
    assert operating_point(pts).setting.label() == "min_duration=9"
    assert operating_point(pts, 1.0).setting.label() == "min_duration=7"
    assert operating_point([_point("m", 7, 1.0, 6.0)]) is None
    assert not math.isnan(operating_point(pts).median_delay)


def _ok(capsys, *argv: str) -> str:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert (code, err) == (0, ""), err
    return out


def test_the_sweep_writes_its_points_curves_and_figure(tmp_path: Path, capsys):
    traces = tmp_path / "set.jsonl"
    traces.write_text(_ok(capsys, "gen-traces", "--count", "12", "--length", "600", "--seed", "5"))
    out = tmp_path / "sweep"
    summary = json.loads(_ok(capsys, "eval-detect", str(traces), "--sweep", "--out", str(out), "--json",
                             "--jobs", "1"))
    assert (summary["traces"], summary["healthy"]) == (12, 4)
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert len(rows) == len(settings("bocd+v")) + len(settings("persistence"))
    assert {r["method"] for r in rows} == {"bocd+v", "persistence"}
    assert sum(r["default"] == "1" for r in rows if r["method"] == "bocd+v") == 1
    for r in rows:
        assert 0.0 <= float(r["fpr_pct"]) <= 100.0 and r["healthy"] == "4" and r["labels"] == "8"
    curves = list(csv.DictReader(open(out / "curves.csv")))
    assert [(c["method"], float(c["fpr_pct"])) for c in curves] == [
        (m, f) for m in ("bocd+v", "persistence") for f in (0.0, 0.5, 1.0, 1.5, 2.0)]
    # the curve is the best point under each rate: recompute it from the points
    for c in curves:
        under = [float(r["median_delay"]) for r in rows if r["method"] == c["method"] and r["median_delay"]
                 and float(r["fpr_pct"]) <= float(c["fpr_pct"])]
        assert (float(c["median_delay"]) if c["median_delay"] else None) == (min(under) if under else None)
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["bocd+v_default"]["setting"] == f"min_duration={FalconConfig().min_duration}"


@pytest.mark.parametrize("lines, argv, message", [
    (["compute"], ["--out", "{out}"], "needs healthy traces"),
    (["healthy"], ["--out", "{out}"], "needs traces with fail-slows"),
    (["compute", "healthy"], [], "--sweep needs --out DIR"),
    (["compute", "healthy"], ["--out", "{file}"], "exists and is not a folder"),
    (["compute", "healthy"], ["--out", "{out}", "--method", "bocd", "--falcon-min-slowdown", "-1"], "min_slowdown"),
])
def test_bad_sweep_input_is_one_line(tmp_path: Path, capsys, lines, argv, message):
    from falconext.sim.traces import generate_traces

    traces = tmp_path / "set.jsonl"
    kinds = generate_traces(len(lines), lines, 1, 400)
    traces.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in kinds))
    (tmp_path / "a-file").write_text("x")
    argv = [a.format(out=tmp_path / "out", file=tmp_path / "a-file") for a in argv]
    code = main(["eval-detect", str(traces), "--sweep", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_out_without_sweep_is_refused(tmp_path: Path, capsys):
    traces = tmp_path / "set.jsonl"
    traces.write_text(_ok(capsys, "gen-traces", "--count", "2", "--length", "400"))
    assert main(["eval-detect", str(traces), "--out", str(tmp_path / "o")]) == 2
    assert "--out names the sweep's folder" in capsys.readouterr().err
