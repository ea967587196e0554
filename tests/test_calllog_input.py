"""Bad call logs given to ``falconext period``: one line on stderr naming the problem and
its line, exit status 2, nothing on stdout, never a traceback or a silently wrong period.

Each case starts from a log the command accepts (a rank repeating a 2-call iteration) and
breaks one thing in it, so the error can only come from that one thing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from falconext.cli import main

GOOD_CALLS = 60  # 30 iterations of 2 calls: enough for the tracker to lock (32 calls)


def record(k: int, **changes: object) -> dict:
    """Call ``k`` of rank 0: an all-reduce and an all-gather per iteration, 0.1 s apart."""
    obj: dict = {"rank": 0, "op": ("all_reduce", "all_gather")[k % 2], "group": "dp", "bytes": 1024,
                 "t_issue": 1.0 + 0.1 * k}
    obj.update(changes)
    return {key: value for key, value in obj.items() if value is not ...}


def lines(records: list[dict]) -> list[str]:
    return [json.dumps(r) for r in records]


def good_lines(n: int = GOOD_CALLS, **changes: object) -> list[str]:
    return lines([record(k, **changes) for k in range(n)])


def write(tmp_path: Path, text: str, name: str = "calls.jsonl") -> str:
    path = tmp_path / name
    path.write_bytes(text.encode("utf-8"))
    return str(path)


def period(path: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(["period", path])
    except SystemExit as exc:  # argparse
        rc = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(path: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``falconext period path``; assert the bad-input contract; return the line."""
    rc, out, err = period(path, capsys)
    assert rc == 2, (rc, out, err)
    assert out == ""
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("falconext period: error: "), err
    return err.rstrip("\n")


def test_the_good_log_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The base every case breaks: read, period 2, one time per iteration."""
    rc, out, err = period(write(tmp_path, "\n".join(good_lines()) + "\n"), capsys)
    assert rc == 0 and err == ""
    assert json.loads(out)["0"]["period"] == 2


# --- truncated --------------------------------------------------------------------------


def test_a_log_cut_mid_line_names_the_last_line_as_truncated(tmp_path: Path, capsys) -> None:
    text = "\n".join(good_lines()) + "\n" + json.dumps(record(GOOD_CALLS))[:30]
    f = write(tmp_path, text)
    line = one_line_error(f, capsys)
    assert f"{f}:{GOOD_CALLS + 1}:" in line and "truncated" in line, line


@pytest.mark.parametrize("cut", [1, 10, -1], ids=["after-brace", "inside-key", "before-closing-brace"])
def test_every_cut_of_the_last_record_is_an_error(tmp_path: Path, capsys, cut: int) -> None:
    whole = json.dumps(record(GOOD_CALLS))
    f = write(tmp_path, "\n".join(good_lines()) + "\n" + whole[:cut])
    assert f"{f}:{GOOD_CALLS + 1}:" in one_line_error(f, capsys)


def test_a_complete_last_line_without_newline_is_not_truncated(tmp_path: Path, capsys) -> None:
    rc, out, err = period(write(tmp_path, "\n".join(good_lines())), capsys)
    assert rc == 0 and err == "", err


def test_a_malformed_line_inside_the_log_is_not_called_truncated(tmp_path: Path, capsys) -> None:
    body = good_lines()
    body[5] = body[5][:20]  # a record cut short, then the log goes on
    line = one_line_error(write(tmp_path, "\n".join(body) + "\n"), capsys)
    assert "calls.jsonl:6:" in line and "malformed JSON" in line and "truncated" not in line, line


# --- order and seq ------------------------------------------------------------------------


def test_lines_out_of_order_without_seq_name_both_lines(tmp_path: Path, capsys) -> None:
    body = good_lines()
    body[7], body[8] = body[8], body[7]  # line 9 now holds call 7, issued before line 8's call 8
    line = one_line_error(write(tmp_path, "\n".join(body) + "\n"), capsys)
    assert "calls.jsonl:9:" in line and "rank 0" in line and "(line 8)" in line and "seq" in line, line


def test_lines_out_of_order_with_seq_are_ordered_by_it(tmp_path: Path, capsys) -> None:
    """The contrast: the same swap is no error when every record carries its seq."""
    body = lines([record(k, seq=k) for k in range(GOOD_CALLS)])
    body[7], body[8] = body[8], body[7]
    rc, out, err = period(write(tmp_path, "\n".join(body) + "\n"), capsys)
    assert rc == 0 and err == "" and json.loads(out)["0"]["period"] == 2


def test_a_repeated_seq_names_both_lines(tmp_path: Path, capsys) -> None:
    recs = [record(k, seq=k) for k in range(GOOD_CALLS)]
    recs[10]["seq"] = 4
    line = one_line_error(write(tmp_path, "\n".join(lines(recs)) + "\n"), capsys)
    assert "calls.jsonl:11:" in line and "seq 4 again" in line and "line 5" in line, line


# --- too few calls ---------------------------------------------------------------------------


def test_a_log_with_one_call_names_its_line(tmp_path: Path, capsys) -> None:
    f = write(tmp_path, good_lines(1)[0] + "\n")
    line = one_line_error(f, capsys)
    assert f"{f}:1:" in line and "rank 0 has 1 call(s)" in line and "at least 6" in line, line


def test_a_rank_with_too_few_calls_names_its_first_line(tmp_path: Path, capsys) -> None:
    """Rank 0 is fine; rank 1 has two calls, the first on line 4."""
    body = good_lines()
    body.insert(3, json.dumps(record(3, rank=1)))
    body.insert(10, json.dumps(record(9, rank=1)))
    line = one_line_error(write(tmp_path, "\n".join(body) + "\n"), capsys)
    assert "calls.jsonl:4:" in line and "rank 1 has 2 call(s)" in line, line


# --- fields -------------------------------------------------------------------------------------

def raw_line(k: int, key: str, raw: str | None) -> str:
    """Call ``k`` with ``key`` written as the JSON text ``raw`` (left out when None)."""
    obj = record(k, t_end=1.05 + 0.1 * k)
    if raw is None:
        del obj[key]
        return json.dumps(obj)
    obj[key] = "@@"
    return json.dumps(obj).replace('"@@"', raw)


BAD_FIELDS = [
    ("t_issue-string", "t_issue", '"abc"', ["t_issue", "'abc'"]),
    ("t_end-string", "t_end", '"abc"', ["t_end", "'abc'"]),
    ("bytes-string", "bytes", '"1k"', ["bytes", "integer", "'1k'"]),
    ("rank-string", "rank", '"zero"', ["rank", "integer"]),
    ("bytes-negative", "bytes", "-1024", ["bytes", ">= 0", "-1024"]),
    ("t_issue-negative", "t_issue", "-1.0", ["t_issue", ">= 0"]),
    # a number too large for a double: valid JSON, which json.loads reads as inf
    ("t_issue-overflows-to-inf", "t_issue", "1e999", ["t_issue", "not finite"]),
    ("t_end-overflows-to-inf", "t_end", "1e999", ["t_end", "not finite"]),
    ("t_issue-NaN", "t_issue", "NaN", ["NaN"]),
    ("t_end-NaN", "t_end", "NaN", ["NaN"]),
    ("t_issue-Infinity", "t_issue", "Infinity", ["Infinity"]),
    ("t_end--Infinity", "t_end", "-Infinity", ["-Infinity"]),
    ("missing-rank", "rank", None, ["missing", "rank"]),
    ("missing-op", "op", None, ["missing", "op"]),
    ("missing-group", "group", None, ["missing", "group"]),
    ("missing-bytes", "bytes", None, ["missing", "bytes"]),
    ("missing-t_issue", "t_issue", None, ["missing", "t_issue"]),
]


@pytest.mark.parametrize("name,key,raw,words", BAD_FIELDS, ids=[c[0] for c in BAD_FIELDS])
def test_a_bad_field_names_its_line_and_field(tmp_path: Path, capsys, name: str, key: str,
                                              raw: str | None, words: list[str]) -> None:
    body = [raw_line(k, "t_end", json.dumps(1.05 + 0.1 * k)) for k in range(GOOD_CALLS)]
    body[6] = raw_line(6, key, raw)
    line = one_line_error(write(tmp_path, "\n".join(body) + "\n"), capsys)
    assert "calls.jsonl:7:" in line, line
    for word in words:
        assert word in line, (word, line)


# --- not a call log ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["empty", "blank-lines"])
def test_an_empty_file(tmp_path: Path, capsys, text: str) -> None:
    f = write(tmp_path, text)
    line = one_line_error(f, capsys)
    assert f in line and "empty" in line, line


def test_a_file_that_is_not_json(tmp_path: Path, capsys) -> None:
    f = write(tmp_path, "iter_time\n0.5\n0.5\n", name="times.csv")
    line = one_line_error(f, capsys)
    assert f"{f}:1:" in line and "malformed JSON" in line, line


def test_a_json_document_that_is_not_jsonl(tmp_path: Path, capsys) -> None:
    """A JSON list of records on one line: the line is named, and what it holds."""
    f = write(tmp_path, json.dumps([record(k) for k in range(GOOD_CALLS)]) + "\n")
    line = one_line_error(f, capsys)
    assert f"{f}:1:" in line and "list" in line, line


def test_a_binary_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "calls.jsonl"
    path.write_bytes(b"\x00\xff\xfe\x80" * 8)
    line = one_line_error(str(path), capsys)
    assert "UTF-8" in line, line


def test_line_numbers_count_newlines_only(tmp_path: Path, capsys) -> None:
    """A raw U+2028 inside a JSON string is not a line break for JSON Lines: the log is
    read, and a later error names the line an editor shows."""
    body = lines([record(k, group="dp\u2028x") for k in range(GOOD_CALLS)])
    body = [json.dumps(json.loads(b), ensure_ascii=False) for b in body]
    assert "\u2028" in body[0]
    rc, out, err = period(write(tmp_path, "\n".join(body) + "\n"), capsys)
    assert rc == 0 and err == "", err
    body[9] = json.dumps(record(9, t_issue="abc"))
    line = one_line_error(write(tmp_path, "\n".join(body) + "\n"), capsys)
    assert "calls.jsonl:10:" in line, line


# --- the installed command -----------------------------------------------------------------


def test_the_console_script_prints_one_line_for_a_truncated_log(tmp_path: Path) -> None:
    """The whole process, not main(): exit 2 and one stderr line, no traceback."""
    exe = shutil.which("falconext")
    cmd = [exe] if exe else [sys.executable, "-m", "falconext.cli"]
    f = write(tmp_path, "\n".join(good_lines()) + "\n" + json.dumps(record(GOOD_CALLS))[:25])
    proc = subprocess.run([*cmd, "period", f], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{f}:{GOOD_CALLS + 1}:" in proc.stderr and "truncated" in proc.stderr
