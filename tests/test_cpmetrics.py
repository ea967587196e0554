"""Change-point scores against several annotators (falconext/detect/cpmetrics.py) and the TCPD
script (examples/eval_tcpd.py) on a series made here in TCPD's format. (On a TCPD checkout
the metrics give the published scores of the benchmark's "zero" method exactly, 8 series
checked, 2026-11-27; TCPD itself is not part of this repository.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from falconext.detect.cpmetrics import cover, covering, f1, true_positives

ROOT = Path(__file__).resolve().parents[1]


def test_the_same_change_points_score_one():
    ann = {"a": [30, 70], "b": [30, 70]}
    assert f1(ann, [30, 70], 100) == 1.0 and cover(ann, [30, 70], 100) == 1.0


def test_no_prediction_is_the_start_alone():
    # P = 1/1 (0 matches 0), R = 1/2 -> F1 2/3; the one segment covers each half by half
    assert f1({"a": [50]}, [], 100) == pytest.approx(2 / 3)
    assert covering([50], [], 100) == pytest.approx(0.5)
    assert f1({"a": []}, [], 100) == 1.0 and cover({"a": []}, [], 100) == 1.0


def test_a_prediction_matches_one_annotation_within_the_margin():
    assert true_positives([0, 100], [0, 105]) == {0, 100}
    assert true_positives([0, 100], [0, 106]) == {0}
    assert true_positives([0, 100, 102], [0, 101]) == {0, 100}  # 101 is used once
    # two annotators 2 apart, one prediction between: precision counts it once (<= 1)
    assert f1({"a": [100], "b": [102]}, [101], 200) == 1.0
    # a prediction that matches nothing: precision 2/3 (0 and 101 of 0, 101 and 150)
    assert f1({"a": [100]}, [101, 150], 200) == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))


def test_covering_weights_each_true_segment_by_its_length():
    # truth [0,20) [20,100); prediction [0,50) [50,100): J = 20/50 and 50/80
    assert covering([20], [50], 100) == pytest.approx((20 * 20 / 50 + 80 * 50 / 80) / 100)


def test_bad_points_are_refused():
    with pytest.raises(ValueError, match="outside the series"):
        f1({"a": [5]}, [10], 10)
    with pytest.raises(ValueError, match="no annotator"):
        cover({}, [], 10)


def _tcpd(tmp_path: Path) -> Path:
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.normal(0.0, 1.0, 80), rng.normal(4.0, 1.0, 80), rng.normal(-1.0, 1.0, 80)])
    d = tmp_path / "tcpd" / "datasets" / "steps"
    d.mkdir(parents=True)
    (d / "steps.json").write_text(json.dumps({"name": "steps", "n_obs": 240, "n_dim": 1,
                                              "series": [{"label": "V1", "type": "float", "raw": x.tolist()}]}))
    (tmp_path / "tcpd" / "annotations.json").write_text(json.dumps(
        {"steps": {"1": [80, 160], "2": [81, 159]}, "gone": {"1": [3]}}))
    return tmp_path / "tcpd"


def test_the_tcpd_script_finds_the_steps_of_a_series_in_tcpd_s_format(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "eval_tcpd.py"), "--tcpd", str(_tcpd(tmp_path)),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    (row,) = out["rows"]
    assert row["series"] == "steps" and row["f1"] == 1.0 and row["cover"] > 0.95, row
    assert out["skipped"] == ["gone (needs its download script)"]


def test_the_tcpd_script_refuses_a_folder_that_is_not_a_checkout(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "eval_tcpd.py"), "--tcpd", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is not a TCPD checkout" in proc.stderr
