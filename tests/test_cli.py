"""The ``falconext`` command line, driven in-process through ``falconext.cli.main``.

Every subcommand either prints JSON on stdout and exits 0, or prints exactly one line
on stderr naming the problem and exits 2, with nothing on stdout and no traceback.
One test runs the installed console script in a subprocess to prove the entry point.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from falconext.cli import main
from falconext.sim.calllog import dp_only_spec, generate, tp_pp_spec
from falconext.trace.logfile import write_call_log

N = 600
ONSET, END, SLOWDOWN = 200, 450, 1.5
METHOD_NAMES = ("bocd+v", "bocd", "slide-window", "persistence")


# --- helpers -------------------------------------------------------------------------


def slowed_series(seed: int = 0) -> list[float]:
    """600 iterations of ~0.5 s, 2% log-normal noise, 1.5x slower in [200, 450)."""
    rng = np.random.default_rng(seed)
    x = 0.5 * rng.lognormal(0.0, 0.02, N)
    x[ONSET:END] *= SLOWDOWN
    return x.tolist()


def healthy_series(seed: int = 1) -> list[float]:
    rng = np.random.default_rng(seed)
    return (0.5 * rng.lognormal(0.0, 0.02, N)).tolist()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``falconext argv...`` in-process; argparse errors exit via SystemExit."""
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


def ok(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0, err
    assert err == ""
    return out


def fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Assert the one-line bad-input contract; return the error line."""
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2, (rc, out, err)
    assert out == ""
    assert "Traceback" not in err
    assert err.endswith("\n")
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("falconext"), lines[0]
    assert "error:" in lines[0]
    return lines[0]


def write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def csv_text(values: list[float], column: str = "iter_time") -> str:
    return column + "\n" + "".join(f"{v!r}\n" for v in values)


def check_slow_event(events: list[dict], onset_tol: int = 3, end_tol: int = 3) -> None:
    assert len(events) == 1, events
    (ev,) = events
    assert set(ev) == {"onset", "detected_at", "end", "slowdown"}
    assert abs(ev["onset"] - ONSET) <= onset_tol
    assert ev["detected_at"] >= ev["onset"]
    assert ev["end"] is not None and abs(ev["end"] - END) <= end_tol
    assert ev["slowdown"] == pytest.approx(SLOWDOWN, rel=0.05)


# --- detect: good inputs ---------------------------------------------------------------


def test_detect_csv_finds_the_injected_slowdown(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "series.csv", csv_text(slowed_series()))
    out = ok(capsys, "detect", f)
    assert out.count("\n") == 1
    result = json.loads(out)
    assert result["method"] == "bocd+v"
    assert result["iterations"] == N
    check_slow_event(result["events"])
    ev = result["events"][0]
    # online: confirmation comes after the onset, within the verification window
    assert ev["detected_at"] - ev["onset"] <= 60


def test_detect_csv_healthy_series_has_no_events(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "healthy.csv", csv_text(healthy_series()))
    result = json.loads(ok(capsys, "detect", f))
    assert result["iterations"] == N
    assert result["events"] == []


def test_detect_csv_iter_time_s_and_rank_split_into_one_line_per_rank(tmp_path: Path, capsys) -> None:
    slow, healthy = slowed_series(), healthy_series()
    rows = ["step,rank,iter_time_s,loss"]
    for i in range(N):  # ranks interleaved row by row
        rows.append(f"{i},0,{slow[i]!r},2.5")
        rows.append(f"{i},1,{healthy[i]!r},2.5")
    f = write(tmp_path / "ranks.csv", "\n".join(rows) + "\n")
    lines = ok(capsys, "detect", f).splitlines()
    assert len(lines) == 2
    by_id = {obj["id"]: obj for obj in map(json.loads, lines)}
    assert set(by_id) == {0, 1}
    assert set(by_id[0]) == {"id", "events"}
    check_slow_event(by_id[0]["events"])
    assert by_id[1]["events"] == []


def test_detect_json_list(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "series.json", json.dumps(slowed_series()))
    result = json.loads(ok(capsys, "detect", f))
    assert result["iterations"] == N
    check_slow_event(result["events"])


def test_detect_jsonl_one_output_line_per_input_line(tmp_path: Path, capsys) -> None:
    lines_in = [
        {"id": "job-a", "iter_times": slowed_series()},
        {"id": 7, "iter_times": healthy_series()},
        {"id": None, "iter_times": slowed_series(seed=5), "kind": "compute"},
    ]
    text = json.dumps(lines_in[0]) + "\n\n" + "\n".join(json.dumps(o) for o in lines_in[1:]) + "\n"
    f = write(tmp_path / "set.jsonl", text)
    out = [json.loads(line) for line in ok(capsys, "detect", f).splitlines()]
    assert [o["id"] for o in out] == ["job-a", 7, None]
    for o in out:
        assert set(o) == {"id", "events"}
    check_slow_event(out[0]["events"])
    assert out[1]["events"] == []
    check_slow_event(out[2]["events"])


def test_detect_single_jsonl_line_still_prints_id(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "one.jsonl", json.dumps({"id": "solo", "iter_times": healthy_series()}) + "\n")
    out = ok(capsys, "detect", f).splitlines()
    assert [json.loads(line) for line in out] == [{"id": "solo", "events": []}]


def test_detect_format_by_content_without_known_extension(tmp_path: Path, capsys) -> None:
    lst = write(tmp_path / "series.txt", "  " + json.dumps(slowed_series()))
    check_slow_event(json.loads(ok(capsys, "detect", lst))["events"])
    jl = write(tmp_path / "series.dat", json.dumps({"id": 1, "iter_times": slowed_series()}) + "\n")
    (line,) = ok(capsys, "detect", jl).splitlines()
    assert json.loads(line)["id"] == 1
    csv_ = write(tmp_path / "series", csv_text(slowed_series()))
    assert json.loads(ok(capsys, "detect", csv_))["iterations"] == N


@pytest.mark.parametrize("method", ["bocd", "slide-window", "persistence", "bocd+v"])
def test_detect_methods_are_accepted(tmp_path: Path, capsys, method: str) -> None:
    f = write(tmp_path / "series.csv", csv_text(slowed_series()))
    result = json.loads(ok(capsys, "detect", f, "--method", method))
    assert result["method"] == method
    # the baselines are rougher, but they see the same step
    check_slow_event(result["events"], onset_tol=10, end_tol=10)


def test_detect_accepts_falcon_config_flags(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "series.csv", csv_text(slowed_series()))
    # a slowdown threshold above the injected 50% hides it
    result = json.loads(ok(capsys, "detect", f, "--falcon-min-slowdown", "0.8"))
    assert result["events"] == []


# --- detect: bad inputs ----------------------------------------------------------------


def test_detect_missing_file(tmp_path: Path, capsys) -> None:
    f = str(tmp_path / "nope.csv")
    line = fails(capsys, "detect", f)
    assert f in line and "no such file" in line


def test_detect_directory(tmp_path: Path, capsys) -> None:
    line = fails(capsys, "detect", str(tmp_path))
    assert str(tmp_path) in line and "directory" in line


@pytest.mark.parametrize("content", ["", "   \n\t\n  "], ids=["empty", "whitespace"])
def test_detect_empty_file(tmp_path: Path, capsys, content: str) -> None:
    f = write(tmp_path / "e.csv", content)
    line = fails(capsys, "detect", f)
    assert f in line and "empty" in line


def test_detect_not_utf8(tmp_path: Path, capsys) -> None:
    p = tmp_path / "bin.csv"
    p.write_bytes(b"iter_time\n\xff\xfe\x00\n")
    line = fails(capsys, "detect", str(p))
    assert "UTF-8" in line


# (name, file name, content, words the one error line must contain)
BAD_DETECT = [
    ("csv-no-column", "s.csv", "step,time\n1,0.5\n2,0.5\n", ["iter_time", "step", "time"]),
    ("csv-header-only", "s.csv", "iter_time\n", ["header only"]),
    ("csv-non-numeric", "s.csv", "iter_time\n0.5\nabc\n0.5\n", ["s.csv:3", "'abc'", "not a number"]),
    ("csv-empty-cell", "s.csv", "rank,iter_time\n0,0.5\n0,\n", ["s.csv:3", "not a number"]),
    ("csv-nan", "s.csv", "iter_time\n0.5\n0.5\nnan\n", ["s.csv:4", "NaN", "iteration 2"]),
    ("csv-inf", "s.csv", "iter_time\n0.5\ninf\n", ["s.csv:3", "infinite"]),
    ("csv-negative", "s.csv", "iter_time\n0.5\n-0.5\n", ["s.csv:3", "> 0", "-0.5"]),
    ("csv-zero", "s.csv", "iter_time\n0.5\n0\n", ["s.csv:3", "> 0"]),
    ("csv-ragged-long", "s.csv", "step,iter_time\n1,0.5\n2,0.5,9\n", ["s.csv:3", "3 fields", "header has 2"]),
    ("csv-ragged-short", "s.csv", "step,iter_time\n1,0.5\n2\n", ["s.csv:3", "1 fields"]),
    ("json-dict", "s.json", '{"iter_times": [0.5]}', ["list", "dict"]),
    ("json-number", "s.json", "0.5", ["list", "float"]),
    ("json-empty-list", "s.json", "[]", ["empty"]),
    ("json-nan", "s.json", "[0.5, NaN, 0.5]", ["NaN"]),
    ("json-infinity", "s.json", "[0.5, Infinity]", ["Infinity"]),
    ("json-neg-infinity", "s.json", "[0.5, -Infinity]", ["Infinity"]),
    ("json-overflow", "s.json", "[0.5, 1e999]", ["iteration 1", "infinite"]),
    ("json-string", "s.json", '[0.5, "0.6"]', ["iteration 1", "not a number", "'0.6'"]),
    ("json-bool", "s.json", "[0.5, true]", ["iteration 1", "not a number", "True"]),
    ("json-null", "s.json", "[0.5, 0.5, null]", ["iteration 2", "not a number", "None"]),
    ("json-negative", "s.json", "[0.5, -1]", ["iteration 1", "> 0"]),
    ("json-malformed", "s.json", "[0.5, 0.6", ["malformed JSON"]),
    ("jsonl-missing-id", "s.jsonl", '{"id": 1, "iter_times": [0.5]}\n{"iter_times": [0.5]}\n', ["s.jsonl:2", "'id'"]),
    ("jsonl-missing-times", "s.jsonl", '{"id": 1, "iter_times": [0.5]}\n{"id": 2}\n', ["s.jsonl:2", "'iter_times'"]),
    ("jsonl-malformed", "s.jsonl", '{"id": 1, "iter_times": [0.5]}\n{"id": 2, "iter_times": [0.5\n', ["s.jsonl:2", "malformed JSON"]),
    ("jsonl-non-object", "s.jsonl", '{"id": 1, "iter_times": [0.5]}\n[0.5, 0.6]\n', ["s.jsonl:2", "object"]),
    ("jsonl-empty-times", "s.jsonl", '{"id": 1, "iter_times": []}\n', ["s.jsonl:1", "empty"]),
    ("jsonl-times-not-list", "s.jsonl", '{"id": 1, "iter_times": 0.5}\n', ["s.jsonl:1", "list"]),
    ("jsonl-nan", "s.jsonl", '{"id": 1, "iter_times": [0.5, NaN]}\n', ["s.jsonl:1", "NaN"]),
    ("jsonl-zero", "s.jsonl", '{"id": 1, "iter_times": [0.5, 0]}\n', ["s.jsonl:1", "iteration 1", "> 0"]),
]


@pytest.mark.parametrize("name,fname,content,words", BAD_DETECT, ids=[c[0] for c in BAD_DETECT])
def test_detect_bad_input_is_one_line_exit_2(tmp_path: Path, capsys, name, fname, content, words) -> None:
    f = write(tmp_path / fname, content)
    line = fails(capsys, "detect", f)
    assert f in line  # names the file
    for word in words:
        assert word in line, (word, line)


def test_detect_unknown_method(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "s.csv", csv_text(healthy_series()))
    line = fails(capsys, "detect", f, "--method", "magic")
    assert "--method" in line and "'magic'" in line and "bocd+v" in line


def test_detect_unknown_flag(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "s.csv", csv_text(healthy_series()))
    line = fails(capsys, "detect", f, "--bogus")
    assert "--bogus" in line


def test_detect_invalid_config(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "s.csv", csv_text(healthy_series()))
    line = fails(capsys, "detect", f, "--falcon-min-duration", "0")
    assert "min_duration" in line


def test_detect_non_finite_config_and_bad_config_type(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "s.csv", csv_text(healthy_series()))
    line = fails(capsys, "detect", f, "--falcon-bocd-hazard", "nan")
    assert "bocd_hazard" in line
    line = fails(capsys, "detect", f, "--falcon-min-duration", "ten")
    assert "--falcon-min-duration" in line


def test_missing_arguments(capsys) -> None:
    assert "command" in fails(capsys)
    assert "file" in fails(capsys, "detect")
    assert "no-such-command" in fails(capsys, "no-such-command")


# --- period ----------------------------------------------------------------------------


def write_log(path: Path, log) -> str:
    with open(path, "w", encoding="utf-8") as out:
        n = write_call_log(log.records, out)
    assert n == len(log.records)
    return str(path)


@pytest.mark.parametrize(
    "spec,seed,stages",
    [
        (tp_pp_spec(iterations=40, tp=2, pp=4), 0, 3),  # first, middle and last stage differ
        (dp_only_spec(iterations=60, n_ranks=4), 1, 1),
    ],
    ids=["tp2-pp4", "dp4"],
)
def test_period_recovers_period_and_iteration_times(tmp_path: Path, capsys, spec, seed, stages) -> None:
    log = generate(spec, seed)
    # the log really is interleaved across ranks
    first = [r.rank for r in log.records[: 4 * spec.n_ranks]]
    assert len(set(first)) == spec.n_ranks and first != sorted(first)
    f = write_log(tmp_path / "calls.jsonl", log)
    out = ok(capsys, "period", f)
    assert out.count("\n") == 1
    result = json.loads(out)
    assert set(result) == {str(r) for r in spec.patterns}
    periods = {}
    for key, entry in result.items():
        rank = int(key)
        assert set(entry) == {"period", "iterations", "iter_times"}
        # each estimate numbered with the iteration it measures, one apart (no insertions)
        numbers = entry["iterations"]
        assert len(numbers) == len(entry["iter_times"]) and numbers == list(range(numbers[0], numbers[0] + len(numbers)))
        # ground truth: calls one rank issues in one training iteration
        assert entry["period"] == len(spec.patterns[rank]), rank
        periods[rank] = entry["period"]
        its = entry["iter_times"]
        assert len(its) >= spec.iterations - 5
        assert all(isinstance(t, float) and t > 0 for t in its)
        true_median = float(np.median(log.durations[rank]))
        assert float(np.median(its)) == pytest.approx(true_median, rel=0.01), rank
    assert len(set(periods.values())) == stages


def test_period_pipeline_stages_have_different_periods(tmp_path: Path, capsys) -> None:
    spec = tp_pp_spec(iterations=30, tp=1, pp=4)
    log = generate(spec, 2)
    result = json.loads(ok(capsys, "period", write_log(tmp_path / "calls.jsonl", log)))
    # rank s is stage s (tp=1, dp=1): every stage's period from its own pattern
    stage_period = {s: len(spec.patterns[s]) for s in range(4)}
    assert {int(k): v["period"] for k, v in result.items()} == stage_period
    assert stage_period[0] != stage_period[1] != stage_period[3]
    assert stage_period[0] != stage_period[3]


GOOD_RECORD = {"rank": 0, "op": "all_reduce", "group": "dp", "bytes": 1024, "t_issue": 1.0}


def _rec(**changes) -> str:
    obj = {**GOOD_RECORD, **changes}
    return json.dumps({k: v for k, v in obj.items() if v is not ...})


BAD_LOGS = [
    ("missing-t_issue", _rec(t_issue=...), ["calls.jsonl:2", "t_issue"]),
    ("missing-rank", _rec(rank=...), ["calls.jsonl:2", "rank"]),
    ("missing-bytes", _rec(bytes=...), ["calls.jsonl:2", "bytes"]),
    ("t_issue-string", _rec(t_issue="soon"), ["calls.jsonl:2", "t_issue", "'soon'"]),
    ("t_issue-bool", _rec(t_issue=True), ["calls.jsonl:2", "t_issue"]),
    ("t_issue-negative", _rec(t_issue=-1.0), ["calls.jsonl:2", "t_issue", ">= 0"]),
    ("bytes-negative", _rec(bytes=-5), ["calls.jsonl:2", "bytes", ">= 0"]),
    ("bytes-fraction", _rec(bytes=1.5), ["calls.jsonl:2", "bytes", "integer"]),
    ("rank-negative", _rec(rank=-1), ["calls.jsonl:2", "rank"]),
    ("op-empty", _rec(op=""), ["calls.jsonl:2", "op"]),
    ("group-list", _rec(group=[1]), ["calls.jsonl:2", "group"]),
    ("nan-literal", _rec().replace('"t_issue": 1.0', '"t_issue": NaN'), ["calls.jsonl:2", "NaN"]),
    ("infinity-literal", _rec().replace('"t_issue": 1.0', '"t_issue": Infinity'), ["calls.jsonl:2", "Infinity"]),
    ("malformed", '{"rank": 0, "op": ', ["calls.jsonl:2", "malformed JSON"]),
    ("not-object", "[0, 1]", ["calls.jsonl:2", "object", "list"]),
]


@pytest.mark.parametrize("name,line2,words", BAD_LOGS, ids=[c[0] for c in BAD_LOGS])
def test_period_bad_log_is_one_line_exit_2(tmp_path: Path, capsys, name, line2, words) -> None:
    f = write(tmp_path / "calls.jsonl", _rec() + "\n" + line2 + "\n" + _rec(t_issue=2.0) + "\n")
    line = fails(capsys, "period", f)
    assert f in line
    for word in words:
        assert word in line, (word, line)


@pytest.mark.parametrize("content", ["", "\n  \n"], ids=["empty", "blank-lines"])
def test_period_empty_log(tmp_path: Path, capsys, content: str) -> None:
    f = write(tmp_path / "calls.jsonl", content)
    line = fails(capsys, "period", f)
    assert f in line and "empty" in line


def test_period_missing_file(tmp_path: Path, capsys) -> None:
    f = str(tmp_path / "absent.jsonl")
    line = fails(capsys, "period", f)
    assert f in line and "no such file" in line


def test_period_invalid_config(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "calls.jsonl", _rec() + "\n")
    assert "acf_threshold" in fails(capsys, "period", f, "--falcon-acf-threshold", "1.5")


# --- gen-traces and eval-detect ----------------------------------------------------------


def test_gen_traces_then_eval_detect_json(tmp_path: Path, capsys) -> None:
    out = ok(capsys, "gen-traces", "--count", "9", "--seed", "3")
    lines = out.splitlines()
    assert len(lines) == 9
    traces = [json.loads(line) for line in lines]
    assert [t["kind"] for t in traces] == ["compute", "comm", "healthy"] * 3
    for t in traces:
        assert set(t) == {"id", "kind", "iter_times", "events"}
        assert len(t["iter_times"]) == 2000
        assert (t["events"] == []) == (t["kind"] == "healthy")
    f = write(tmp_path / "traces.jsonl", out)

    report = json.loads(ok(capsys, "eval-detect", f, "--json"))
    assert set(report) == set(METHOD_NAMES)
    for method, entry in report.items():
        assert set(entry) == {"all", "compute", "comm", "healthy"}, method
        for group, summary in entry.items():
            assert {"accuracy", "fpr", "fnr", "median_delay"} <= set(summary), (method, group)
            assert 0.0 <= summary["accuracy"] <= 100.0
            assert 0.0 <= summary["fpr"] <= 100.0
            assert 0.0 <= summary["fnr"] <= 100.0
        assert entry["all"]["accuracy_n"].endswith("/9")
        assert entry["healthy"]["fpr_n"].endswith("/3")
        assert entry["healthy"]["median_delay"] is None  # nothing to detect there
    best = report["bocd+v"]["all"]["accuracy"]
    assert best >= report["bocd"]["all"]["accuracy"]
    assert best >= report["slide-window"]["all"]["accuracy"]


def test_gen_traces_is_seeded(capsys) -> None:
    a = ok(capsys, "gen-traces", "--count", "2", "--length", "400", "--seed", "11")
    b = ok(capsys, "gen-traces", "--count", "2", "--length", "400", "--seed", "11")
    c = ok(capsys, "gen-traces", "--count", "2", "--length", "400", "--seed", "12")
    assert a == b and a != c
    assert [json.loads(line)["kind"] for line in a.splitlines()] == ["compute", "comm"]
    one = ok(capsys, "gen-traces", "--count", "2", "--length", "400", "--kinds", "healthy")
    assert {json.loads(line)["kind"] for line in one.splitlines()} == {"healthy"}


def labelled(tmp_path: Path, name: str = "labelled.jsonl") -> str:
    rows = [
        {"id": "slow", "kind": "compute", "iter_times": slowed_series(), "events": [[ONSET, END, SLOWDOWN]]},
        {"id": "ok", "kind": "healthy", "iter_times": healthy_series(), "events": []},
    ]
    return write(tmp_path / name, "".join(json.dumps(r) + "\n" for r in rows))


def test_eval_detect_selected_methods_and_table(tmp_path: Path, capsys) -> None:
    f = labelled(tmp_path)
    report = json.loads(ok(capsys, "eval-detect", f, "--json", "--method", "bocd+v", "--method", "bocd"))
    assert set(report) == {"bocd+v", "bocd"}
    assert report["bocd+v"]["all"]["accuracy"] == 100.0
    assert report["bocd+v"]["compute"]["fnr"] == 0.0
    table = ok(capsys, "eval-detect", f, "--method", "bocd+v")
    assert table.splitlines()[0] == "2 traces"
    assert "bocd+v" in table and "accuracy" in table
    with pytest.raises(json.JSONDecodeError):
        json.loads(table)


def test_eval_detect_without_labels(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "unlabelled.jsonl", json.dumps({"id": "u1", "iter_times": healthy_series()}) + "\n")
    line = fails(capsys, "eval-detect", f)
    assert f in line and "events" in line and "u1" in line
    # a labelled line followed by an unlabelled one is still refused
    rows = json.dumps({"id": "a", "iter_times": [0.5] * 10, "events": []}) + "\n"
    rows += json.dumps({"id": "b", "iter_times": [0.5] * 10}) + "\n"
    line = fails(capsys, "eval-detect", write(tmp_path / "mixed.jsonl", rows))
    assert "events" in line and "'b'" in line


def test_eval_detect_refuses_csv_and_json(tmp_path: Path, capsys) -> None:
    assert "events" in fails(capsys, "eval-detect", write(tmp_path / "s.csv", csv_text([0.5] * 10)))
    assert "events" in fails(capsys, "eval-detect", write(tmp_path / "s.json", json.dumps([0.5] * 10)))


BAD_LABELS = [
    ("onset-out-of-range", [[10, None, 1.5]], ["events[0]", "onset"]),
    ("onset-negative", [[-1, None, 1.5]], ["events[0]", "onset"]),
    ("end-equals-onset", [[4, 4, 1.5]], ["events[0]", "end"]),
    ("end-before-onset", [[4, 2, 1.5]], ["events[0]", "end"]),
    ("end-past-trace", [[4, 11, 1.5]], ["events[0]", "end"]),
    ("second-label-bad", [[1, 3, 1.5], [5, 5, 2.0]], ["events[1]", "end"]),
    ("slowdown-string", [[4, 8, "x"]], ["events[0]", "slowdown"]),
    ("not-a-triple", [[4, 8]], ["events[0]"]),
    ("not-a-list", {"onset": 4}, ["events"]),
]


@pytest.mark.parametrize("name,events,words", BAD_LABELS, ids=[c[0] for c in BAD_LABELS])
def test_eval_detect_malformed_labels(tmp_path: Path, capsys, name, events, words) -> None:
    good = {"id": "g", "iter_times": [0.5] * 10, "events": []}
    bad = {"id": "b", "iter_times": [0.5] * 10, "events": events}
    f = write(tmp_path / "labels.jsonl", json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    line = fails(capsys, "eval-detect", f)
    assert f"{f}:2" in line
    for word in words:
        assert word in line, (word, line)


def test_eval_detect_negative_tolerance(tmp_path: Path, capsys) -> None:
    assert "--tolerance" in fails(capsys, "eval-detect", labelled(tmp_path), "--tolerance", "-1")


def test_gen_traces_unknown_kind(capsys) -> None:
    line = fails(capsys, "gen-traces", "--kinds", "compute,bogus", "--count", "2", "--length", "400")
    assert "'bogus'" in line


def test_gen_traces_bad_count_and_length(capsys) -> None:
    assert "--count" in fails(capsys, "gen-traces", "--count", "0")
    assert "--length" in fails(capsys, "gen-traces", "--length", "10")
    assert "--count" in fails(capsys, "gen-traces", "--count", "many")


# --- the installed entry point -------------------------------------------------------------


def test_console_script_entry_point(tmp_path: Path) -> None:
    exe = shutil.which("falconext")
    cmd = [exe] if exe else [sys.executable, "-m", "falconext.cli"]
    good = write(tmp_path / "series.csv", csv_text(slowed_series()))
    done = subprocess.run([*cmd, "detect", good], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    check_slow_event(json.loads(done.stdout)["events"])

    bad = write(tmp_path / "bad.csv", "iter_time\n0.5\nNaN\n")
    done = subprocess.run([*cmd, "detect", bad], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "bad.csv:3" in lines[0] and "NaN" in lines[0]


# -- regressions for input-handling bugs found in review ---------------------------------
def test_gen_traces_accepts_mixed(capsys) -> None:
    out = ok(capsys, "gen-traces", "--kinds", "mixed", "--count", "3", "--length", "400")
    assert sorted(json.loads(line)["kind"] for line in out.splitlines()) == ["comm", "compute", "healthy"]


def test_csv_line_numbers_count_physical_lines(tmp_path: Path, capsys) -> None:
    path = write(tmp_path / "q.csv", 'iter_time\n"0.5\n"\n0.5\nnan\n')
    assert "q.csv:5" in fails(capsys, "detect", path)


def test_csv_with_byte_order_mark(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + csv_text(healthy_series()).encode())
    assert json.loads(ok(capsys, "detect", str(path)))["events"] == []


def test_csv_single_rank_keeps_its_id(tmp_path: Path, capsys) -> None:
    rows = "rank,iter_time\n" + "".join(f"3,{v}\n" for v in healthy_series())
    out = ok(capsys, "detect", write(tmp_path / "r.csv", rows))
    assert json.loads(out) == {"id": 3, "events": []}


def test_eval_detect_names_the_format_problem(tmp_path: Path, capsys) -> None:
    msg = fails(capsys, "eval-detect", write(tmp_path / "l.json", "[0.5, 0.5]"))
    assert "JSONL" in msg and "json" in msg


def test_period_unordered_log_names_the_line(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "calls.jsonl", "\n".join([_rec(t_issue=2.0), _rec(t_issue=3.0), _rec(t_issue=1.5)]) + "\n")
    line = fails(capsys, "period", f)
    assert "calls.jsonl:3" in line and "rank 0" in line and "line 2" in line and "seq" in line
    # with seq, the order of the lines does not matter: the seq orders the calls
    ok_log = "\n".join(_rec(t_issue=1.0 + 0.1 * k, seq=k) for k in (1, 0, 2, 3, 5, 4)) + "\n"
    assert main(["period", write(tmp_path / "seq.jsonl", ok_log)]) == 0
    capsys.readouterr()


def test_period_repeated_seq_names_the_line(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "calls.jsonl", "\n".join(_rec(t_issue=1.0 + k, seq=s) for k, s in enumerate((0, 1, 1))) + "\n")
    line = fails(capsys, "period", f)
    assert "calls.jsonl:3" in line and "seq 1 again" in line and "line 2" in line


def test_period_log_with_one_call_is_one_line_exit_2(tmp_path: Path, capsys) -> None:
    f = write(tmp_path / "calls.jsonl", _rec() + "\n")
    line = fails(capsys, "period", f)
    assert f in line and "rank 0 has 1 call(s)" in line and "at least 6" in line


# --- falconext launch: what it takes and says before anything starts (issue 52) ---------------

def test_launch_help_lists_the_falcon_flags_by_concern_and_what_the_launcher_adds(capsys) -> None:
    from falconext.megatron_lm.launcher import ADDED

    assert main(["launch", "--help"]) == 0
    text = capsys.readouterr().out
    assert "unchanged" not in text  # it adds and rewrites several of torchrun's options
    for flag in ADDED:
        assert flag in text, flag
    for group in ("falconext (fail-slow detection and mitigation):", "falcon thresholds: detect",
                  "falcon thresholds: mitigate", "falconext launch only:"):
        assert group in text, group
    for flag in ("--falcon-on-exclude", "--falcon-bocd-threshold", "--falcon-redis-url-file"):
        assert flag in text, flag


def test_launch_takes_a_redis_url_file_and_names_a_bad_one(tmp_path: Path, capsys) -> None:
    """--falcon-redis-url-file is the launcher's (it was refused as an unknown flag); a file
    that holds no URL is one line naming it, before anything starts."""
    script = tmp_path / "train.py"
    script.write_text("")
    bad = tmp_path / "url"
    bad.write_text("not a url\n")
    assert main(["launch", "--nproc-per-node", "1", str(script), "--falcon", "--falcon-redis-url-file", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"falconext launch: error: --falcon-redis-url-file {bad}: expected a redis:// URL on its first line"]


def test_forced_microbatches_with_sequence_packing_is_one_line(tmp_path: Path, capsys) -> None:
    """S2 cannot be exact with --rl-use-sequence-packing: the launcher says so in one line
    (the ranks ended in a traceback)."""
    script = tmp_path / "train.py"
    script.write_text("")
    code = main(["launch", "--nproc-per-node", "2", str(script), "--calculate-per-token-loss",
                 "--rl-use-sequence-packing", "--falcon", "--falcon-out", str(tmp_path / "out"),
                 "--falcon-force-microbatches", "3,5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--falcon-force-microbatches: S2 does not compose with " \
        "--rl-use-sequence-packing" in err[0], err
