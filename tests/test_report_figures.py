"""What the report's figures draw follows the job's real state (falconext/report/figures.py),
checked as data (figures.json, the functions it is drawn from), not as pixels: a DP2 run
with S2, a revert and an S4 restart, written as the files a run leaves, and the pure
pieces (the plan in force, who started a localization, label rows)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from falconext.report import figures

ITERS = 120
S2_AT, REVERT_AT, S2_AGAIN_AT, S4_AT, RESUME_AT = 40, 55, 62, 70, 68


def events() -> list[dict]:
    """A DP2 job (24 micro-batches): S2 [16, 8] at 40, reverted at 55, S2 again at 62 (a
    plan the restart must undo from 68 on), an S4 restart resuming at 68; a detector's
    localization, and a score trigger's before it."""
    t = iter(range(1000, 2000))
    return [
        {"time": next(t), "type": "straggler_suspected", "action": "localize", "rank": 1},
        {"time": next(t) - 0.5, "type": "controller_state", "new": "profiling", "session": 1, "trigger": "fail_slow"},
        {"time": next(t), "type": "suspended", "session": 1, "iteration": 33},
        {"time": next(t), "type": "localized", "gpus": [1], "links": [], "evidence": {"session": 1, "trigger": "fail_slow"}},
        {"time": next(t), "type": "fail_slow", "rank": 0, "onset": 30, "detected_at": 36},
        {"time": next(t), "type": "controller_state", "new": "profiling", "session": 2, "trigger": "fail_slow"},
        {"time": next(t), "type": "suspended", "session": 2, "iteration": 38},
        {"time": next(t), "type": "localized", "gpus": [1], "links": [], "evidence": {"session": 2, "trigger": "fail_slow"}},
        {"time": next(t), "type": "mitigation", "strategy": "S2", "iteration": S2_AT, "plan": [16, 8]},
        {"time": next(t), "type": "plan_applied", "iteration": S2_AT, "plan": [16, 8], "strategy": "S2"},
        {"time": next(t), "type": "plan_applied", "iteration": REVERT_AT, "plan": [12, 12], "strategy": "revert"},
        {"time": next(t), "type": "plan_applied", "iteration": S2_AGAIN_AT, "plan": [15, 9], "strategy": "S2"},
        {"time": next(t), "type": "mitigation", "strategy": "S4", "iteration": S4_AT, "exclude_nodes": [0]},
        {"time": next(t), "type": "restarted", "iteration": RESUME_AT, "attempt": 1},
    ]


def expected_plan(it: int) -> list[int]:
    """The plan in force at ``it``, written out from the story above."""
    if S2_AT <= it < REVERT_AT:
        return [16, 8]
    if S2_AGAIN_AT <= it < RESUME_AT:
        return [15, 9]
    return [12, 12]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({
        "args": {"global_batch_size": 24, "micro_batch_size": 1}, "topology": {"dp": 2, "world": 2},
        "faults": [{"kind": "compute", "rank": 1, "start": 30, "factor": 2.0}]}))
    with open(out / "iterations.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rank", "iteration", "iter_time_s", "loss"])
        for it in range(ITERS):
            slow = 30 <= it < RESUME_AT and not S2_AT <= it < REVERT_AT
            for rank in (0, 1):
                w.writerow([rank, it, 1.0 if slow else 0.5, ""])
    (out / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events()))
    return out


def test_the_plan_figure_follows_s2_a_revert_and_a_restart(run_dir: Path) -> None:
    figures.write_report(str(run_dir))
    drawn = json.loads((run_dir / "figures.json").read_text())["plan"]
    assert drawn["iterations"] == list(range(ITERS))
    for k, it in enumerate(drawn["iterations"]):
        assert [drawn["replicas"][r][k] for r in (0, 1)] == expected_plan(it), it
    assert drawn["restarts"] == [RESUME_AT]


def test_the_marks_name_their_trigger_and_no_two_labels_overlap(run_dir: Path) -> None:
    figures.write_report(str(run_dir))
    drawn = json.loads((run_dir / "figures.json").read_text())["iterations"]
    labels = [(m["iteration"], m["label"]) for m in drawn["marks"]]
    assert labels == [(33, "localized (score trigger)"), (36, "detected"), (38, "localized (detector)"),
                      (S2_AT, "S2"), (RESUME_AT, "restart 1"), (S4_AT, "S4")]
    boxes = [tuple(m["bbox"]) for m in drawn["marks"]]
    assert figures.overlaps(boxes) == [], boxes
    # the scale is the data's (the slow iterations are 1.0 s), not twice it
    assert 1.0 <= drawn["ylim"][1] <= 1.2


def test_equal_plans_keep_every_replica_visible(run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.image import imread

    figures.write_report(str(run_dir))
    drawn = json.loads((run_dir / "figures.json").read_text())["plan"]
    picture = imread(str(run_dir / "plan.png"))
    height = picture.shape[0]
    x0, y0, x1, y1 = drawn["axes_px"]
    lo, hi = drawn["xlim"]
    column = lambda it: int(x0 + (it - lo) / (hi - lo) * (x1 - x0))  # noqa: E731
    # the even stretch before S2 (both replicas at 12, the lines coincide), inside the plot
    crop = picture[int(height - y1) + 2:int(height - y0) - 2, column(2):column(S2_AT - 2)]
    colours = {tuple(round(float(c), 1) for c in px[:3]) for row in crop for px in row}
    # matplotlib's first two colours: C0 blue (replica 0), C1 orange (replica 1)
    assert (0.1, 0.5, 0.7) in colours and (1.0, 0.5, 0.1) in colours, colours


def test_plan_in_force_is_pure_and_handles_no_events() -> None:
    assert figures.plan_in_force([], 0, 4, 32) == [(0, [8, 8, 8, 8])]
    assert figures.plan_in_force([], 5, 3, 10) == [(5, [4, 3, 3])]
    steps = figures.plan_in_force(events(), 0, 2, 24)
    assert steps == [(0, [12, 12]), (S2_AT, [16, 8]), (REVERT_AT, [12, 12]), (S2_AGAIN_AT, [15, 9]),
                     (RESUME_AT, [12, 12])]
    assert figures.plan_series(steps, [0, S2_AT, REVERT_AT - 1, RESUME_AT]) == [[12, 16, 16, 12], [12, 8, 8, 12]]


def test_stagger_puts_overlapping_labels_on_separate_rows() -> None:
    assert figures.stagger([(0, 10), (5, 15), (20, 30), (12, 18)]) == [0, 1, 0, 0]
    assert figures.stagger([(0, 10), (5, 15), (8, 12)]) == [0, 1, 2]
    assert figures.stagger([]) == []
    assert figures.overlaps([(0, 0, 10, 10), (5, 5, 15, 15), (20, 0, 30, 10)]) == [(0, 1)]


def test_a_localization_whose_session_is_unknown_says_so() -> None:
    loc = {"type": "localized", "gpus": [1], "evidence": {"session": 99}}
    assert figures.localization_trigger(loc, events()) == "unknown"
    op = [{"time": 1, "type": "controller_state", "new": "profiling", "session": 5, "trigger": "operator"}]
    assert figures.localization_trigger({"evidence": {"session": 5}}, op) == "operator"


def test_the_fast_path_s_naming_and_its_localization_are_marked_as_its() -> None:
    """A fast-path suspicion (``by: fast``) is marked where it named the rank, and the
    localization it started says so; a score-trigger suspicion stays the score trigger's."""
    evs = [{"time": 10.0, "type": "straggler_suspected", "action": "localize", "rank": 1, "iteration": 34, "by": "fast"},
           {"time": 10.0, "type": "controller_state", "new": "profiling", "session": 7, "trigger": "fail_slow"},
           {"time": 11.0, "type": "suspended", "session": 7, "iteration": 37},
           {"time": 12.0, "type": "localized", "gpus": [1], "links": [], "evidence": {"session": 7}}]
    assert figures.localization_trigger(evs[3], evs) == "fast path"
    assert figures.marks(evs) == [(34, "named (fast path)"), (37, "localized (fast path)")]
    scores = [dict(evs[0], by="scores"), *evs[1:]]
    assert figures.localization_trigger(scores[3], scores) == "score trigger"
    assert figures.marks(scores) == [(37, "localized (score trigger)")]


def test_each_attempt_lists_the_plans_it_ran_under() -> None:
    from falconext.report.plans import plans_by_attempt

    assert plans_by_attempt(events(), 0, 2, 24) == [
        {"attempt": 0, "from_iteration": 0,
         "plans": [[0, [12, 12]], [S2_AT, [16, 8]], [REVERT_AT, [12, 12]], [S2_AGAIN_AT, [15, 9]]]},
        {"attempt": 1, "from_iteration": RESUME_AT, "plans": [[RESUME_AT, [12, 12]]]},
    ]
    assert plans_by_attempt([], 3, 2, 24) == [{"attempt": 0, "from_iteration": 3, "plans": [[3, [12, 12]]]}]


def test_the_page_names_each_restart_and_each_attempts_plan(run_dir: Path) -> None:
    s = {"mitigation": {"restarts": [{"iteration": RESUME_AT, "downtime_s": 12.5}],
                        "attempts": [{"attempt": 0, "from_iteration": 0, "plans": [[0, [12, 12]], [S2_AT, [16, 8]]]},
                                     {"attempt": 1, "from_iteration": RESUME_AT, "plans": [[RESUME_AT, [12, 12]]]}]}}
    page = figures._page(str(run_dir), s)
    assert f"<th>restart</th><td>at iteration {RESUME_AT} after 12.5 s down</td>" in page
    assert f"<th>attempt 1</th><td>from iteration {RESUME_AT}: plan [12, 12] from {RESUME_AT}</td>" in page
