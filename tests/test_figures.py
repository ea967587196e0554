"""``falconext report``: a run's figures and report.html (falconext/report/figures.py),
drawn at the end of the S2 job (tests/jobs.py s2_job) and on demand."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from falconext.report import figures

from jobs import S2_FAULT_START, events, s2_job

#: the jobs this module reads, run ahead by the session (conftest.py)
AHEAD = (s2_job,)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(jobs):
    return s2_job(jobs)


def test_the_run_draws_its_report_at_the_end(run):
    page = (run / "report.html").read_text()
    for name in figures.FIGURES:
        assert (run / name).read_bytes().startswith(PNG), name
        assert f'src="{name}"' in page
    assert "slowdown_removed" in page and "report: " in (run / "stdout.txt").read_text()


def test_the_figures_show_the_runs_decisions(run):
    data = figures.read_run(str(run))
    placed = figures.marks(data["events"])
    marked: dict[str, int] = {}
    for it, label in placed:
        marked.setdefault(label, it)
    # the first naming: the ranks' detector's, or the fast path's (whose S2 may cut the
    # slowdown before the detector's min_duration, CI 2026-12-03); each marked where it came
    detected = [e["detected_at"] for e in events(run, "fail_slow")]
    named = [e["iteration"] for e in events(run, "straggler_suspected") if e.get("by") == "fast"]
    assert detected or named, placed
    if detected:
        assert marked["detected"] == min(detected) and min(detected) > S2_FAULT_START
    if named:
        assert marked["named (fast path)"] == min(named) and min(named) > S2_FAULT_START
    s2 = events(run, "mitigation")[0]
    assert marked["S2"] == s2["iteration"]
    # the first localization, before S2, was started by the detector, the fast path or the
    # score trigger;
    # a later one (host noise lifting the level after S2) names who started it too
    localized = [(it, label) for it, label in placed if label.startswith("localized")]
    assert localized[0][1] in ("localized (detector)", "localized (fast path)", "localized (score trigger)"), placed
    assert localized[0][0] < s2["iteration"]
    assert all(label in ("localized (detector)", "localized (fast path)", "localized (score trigger)",
                         "localized (re-localization)")
               for _, label in localized[1:]), placed
    its, _ = figures.loop_times(data["iterations"])
    steps = figures.plan_in_force(data["events"], its[0], 4, 32)
    assert steps[0] == (0, [8, 8, 8, 8])
    applied = [e for e in events(run, "plan_applied")]
    assert steps[1:] == [(e["iteration"], e["plan"]) for e in applied] and steps[1][1][1] < 8
    # what plan.png drew (figures.json) is that plan at every iteration
    drawn = json.loads((run / "figures.json").read_text())
    assert drawn["plan"]["iterations"] == its
    assert drawn["plan"]["replicas"] == figures.plan_series(steps, its)
    ranks, s_its, scores = figures.score_matrix(data["estimates"])
    assert ranks == [0, 1, 2, 3]
    after = [k for k, it in enumerate(s_its) if S2_FAULT_START + 2 <= it < s2["iteration"]]
    # the straggler (rank 1) has the highest score in most iterations before S2 rebalances
    top = [max(ranks, key=lambda r: scores[r][k]) for k in after]
    assert top.count(1) >= 0.8 * len(top), top


def test_report_on_demand_and_bad_folders(run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("*.png", "report.html", "calls", "ranks"))
    out = subprocess.run([sys.executable, "-m", "falconext.cli", "report", str(copy)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == str(copy / "report.html")
    assert all((copy / n).exists() for n in figures.FIGURES)
    (tmp_path / "empty").mkdir()
    (copy / "run.json").write_text("{not json")
    for bad, says in ((tmp_path / "missing", "not a directory"), (tmp_path / "empty", "not a falconext run"),
                      (copy, "unreadable run file")):
        out = subprocess.run([sys.executable, "-m", "falconext.cli", "report", str(bad)], capture_output=True,
                             text=True)
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian package chromium)")
def test_the_report_page_loads_its_figures_in_a_browser(run, tmp_path):
    probe = run / "probe.html"
    script = "".join(
        f"<script>var i{k}=new Image();i{k}.onload=function(){{document.title+='{n} '}};i{k}.src='{n}';</script>"
        for k, n in enumerate(figures.FIGURES))
    probe.write_text(f"<html><head><title></title></head><body>{script}</body></html>")
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000",
                          "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=60)
    assert all(n in out.stdout for n in figures.FIGURES), out.stdout[-1000:]
    page = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'profile2'}", "--dump-dom", (run / "report.html").as_uri()],
                          capture_output=True, text=True, timeout=60)
    assert "<img" in page.stdout and "falconext run" in page.stdout
