"""Control-plane messages: round trip, and every corruption rejected with a named reason."""

from __future__ import annotations

import json

import pytest

from falconext.control.messages import (
    MAX_MESSAGE_BYTES,
    Command,
    FailSlowReport,
    Localized,
    MessageError,
    decode,
    encode,
)

REPORT = FailSlowReport(rank=3, onset=150, detected_at=164, slowdown=1.4, baseline_s=0.34, time=1795338456.5)


def test_round_trip():
    for msg in (REPORT, Localized([1], [[0, 1]], {"gemm_tflops": {"1": 0.5}, "pause_s": 1.2}), Command("suspend", 5.0, 200)):
        assert decode(encode(msg)) == msg
    assert decode(encode(Command("resume", 1.0))).args == {}  # optional fields default


def body(**changes):
    obj = json.loads(encode(REPORT))
    obj["body"].update(changes)
    return json.dumps(obj)


@pytest.mark.parametrize(
    "data, word",
    [
        ("not json", "malformed"),
        ("[1, 2]", "exactly v, type and body"),
        (json.dumps({"v": 2, "type": "Command", "body": {}}), "version"),
        (json.dumps({"v": 1, "type": "os.system", "body": {}}), "unknown message type"),
        (json.dumps({"v": 1, "type": "FailSlowReport", "body": []}), "body must be"),
        (body(rank="3"), "FailSlowReport.rank"),
        (body(rank=True), "FailSlowReport.rank"),
        (body(slowdown="NaN"), "FailSlowReport.slowdown"),
        (body(extra=1), "unknown field"),
        (body(onset=1.5), "FailSlowReport.onset"),
        ('{"v": 1, "type": "FailSlowReport", "body": {"rank": NaN}}', "NaN"),
        (json.dumps({"v": 1, "type": "FailSlowReport", "body": {"rank": 1}}), "missing field"),
        (json.dumps({"v": 1, "type": "Localized", "body": {"gpus": [1, "x"], "links": []}}), "Localized.gpus[1]"),
        ("x" * (MAX_MESSAGE_BYTES + 1), "exceeds"),
        (b"\xff\xfe", "UTF-8"),
    ],
)
def test_corrupted_messages_are_rejected_by_name(data, word):
    with pytest.raises(MessageError, match=word.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        decode(data)


def test_receiver_limits_types_and_encode_checks():
    with pytest.raises(MessageError, match="not accepted"):
        decode(encode(REPORT), accept={"Command"})
    with pytest.raises(MessageError, match="not a message type"):
        encode({"rank": 1})
