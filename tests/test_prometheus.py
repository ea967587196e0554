"""A real Prometheus (Debian's 2.42) scraping a live job: the S2 job of tests/jobs.py
(emulated DP4, rank 1 2x slow from iteration 45, S2 applied live) serves its
controller's metrics (``--falcon-metrics-port``), and a ``prometheus`` process started
before the job scrapes them every second (tests/promserver.py). What Prometheus stored is
checked against what the job wrote (``estimates.csv``, ``events.jsonl``), and every PromQL
expression of the Grafana dashboard is run against it: one that returns nothing is a
broken panel. Skipped, saying why, where Prometheus is not installed."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest

from falconext.config import FalconConfig
from jobs import S2_FAULT_START, S2_PROMETHEUS, events, s2_job
from promserver import JOB, Prometheus

#: the jobs this module reads, run ahead by the session (conftest.py)
AHEAD = (s2_job,)
DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "falconext-dashboard.json"
SLOW_RANK = 1


@pytest.fixture(scope="module")
def scraped(jobs) -> tuple[Path, Prometheus, tuple[float, float]]:
    out = s2_job(jobs)
    server = S2_PROMETHEUS.get("server")
    if S2_PROMETHEUS.get("error"):  # installed but it did not start: that fails (skip only where absent)
        pytest.fail(f"Prometheus is installed but did not start: {S2_PROMETHEUS['error']}", pytrace=False)
    if server is None:
        pytest.skip(S2_PROMETHEUS.get("why_not") or "Prometheus did not scrape the S2 job")
    return out, server, S2_PROMETHEUS["span"]


def by_rank(series: list[dict]) -> dict[int, dict[float, float]]:
    """rank -> {time: value} of a per-rank query's series."""
    return {int(s["metric"]["rank"]): {float(t): float(v) for t, v in s["values"]} for s in series}


def test_each_ranks_iteration_time_is_the_one_estimates_csv_has(scraped):
    """The per-rank iteration time Prometheus stored is the one estimates.csv has for that
    rank at the iteration stored with it: the median of the rank's estimated iteration
    times over the score window ending there (the heartbeat's straggler sample), within 5%."""
    out, prom, (start, end) = scraped
    window = FalconConfig().score_window
    secs = by_rank(prom.query_range(f'falconext_rank_estimated_iteration_seconds{{job="{JOB}"}}', start, end))
    its = by_rank(prom.query_range(f'falconext_rank_estimate_iteration{{job="{JOB}"}}', start, end))
    with open(out / "estimates.csv", newline="") as f:
        est = {(int(r["rank"]), int(r["iteration"])): float(r["iter_time_s"]) for r in csv.DictReader(f)}

    def expected(rank: int, it: int) -> float:
        mine = sorted(i for r, i in est if r == rank and i <= it)[-window:]
        return statistics.median(est[(rank, i)] for i in mine)

    pairs = [(rank, int(its[rank][t]), v, expected(rank, int(its[rank][t])))
             for rank, series in secs.items() for t, v in series.items()
             if t in its.get(rank, {}) and (rank, int(its[rank][t])) in est]
    assert {p[0] for p in pairs} == {0, 1, 2, 3} and len(pairs) >= 40, pairs[:10]
    off = [p for p in pairs if abs(p[2] - p[3]) > 0.05 * p[3]]
    assert off == [], off[:10]


def test_the_slowest_rank_by_score_is_the_faulty_one_and_the_mitigation_is_counted(scraped):
    out, prom, (start, end) = scraped
    window = FalconConfig().score_window
    (s2,) = events(out, "mitigation")
    # while the scores' window (medians of `window` iterations) holds more slow, unmitigated
    # iterations than not, on every rank: each rank's score is served with the iteration its
    # window ends at (falconext_rank_estimate_iteration; a job of four ranks is scored from
    # the heartbeats each status shows). The window ending at e holds the fault's iterations
    # from S2_FAULT_START to the one before S2's; the fast path names the GPU a few iterations
    # in and S2 follows at once, so this is a few iterations, a sample or two at 1 s
    its = by_rank(prom.query_range(f'falconext_rank_estimate_iteration{{job="{JOB}"}}', start, end))
    times = set.intersection(*(set(series) for series in its.values()))

    def slow_majority(e: float) -> bool:
        held = min(int(e), s2["iteration"] - 1) - max(int(e) - window + 1, S2_FAULT_START) + 1
        return 2 * held > window

    during = {t for t in times if all(slow_majority(its[r][t]) for r in its)}
    top: dict[float, int] = {}
    for s in prom.query_range(f'topk(1, falconext_rank_score{{job="{JOB}"}})', start, end):
        for t, _ in s["values"]:
            if float(t) in during:
                top[float(t)] = int(s["metric"]["rank"])
    print(f"fault {S2_FAULT_START}, S2 at {s2['iteration']}: {len(top)} samples of the top score, "
          f"{sum(r == SLOW_RANK for r in top.values())} of them rank {SLOW_RANK}")
    assert top and all(r == SLOW_RANK for r in top.values()), (sorted(during), top, s2["iteration"])
    counted = prom.query_range(f'falconext_events_total{{job="{JOB}",type="mitigation"}}', start, end)
    assert counted and max(float(v) for _, v in counted[0]["values"]) == len(events(out, "mitigation")), counted


def test_every_dashboard_panel_returns_data_from_the_job(scraped):
    """Each PromQL expression of examples/grafana/falconext-dashboard.json, its ``$job``
    the scrape job, returns at least one series over the job's span."""
    _, prom, (start, end) = scraped
    board = json.loads(DASHBOARD.read_text())
    exprs = [(panel["title"], t["expr"]) for panel in board["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 10
    empty = [(title, expr) for title, expr in exprs if not prom.query_range(expr.replace("$job", JOB), start, end)]
    assert empty == [], empty
