"""The beat readers (control/beat_reader.py): many node heartbeats decoded at once exactly as
one at a time (protocol/codec.py ``decode_heartbeats``), the frames they pass the controller
and their refusals, and real reader processes on a real 3-shard Redis Cluster feeding the
real controller loop, one of them killed and started again."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from falconext.config import FalconConfig
from falconext.control.beat_reader import MAGIC, FrameError, frame, read_frame, run_reader
from falconext.control.client import BEATS_STREAM, STATUS_KEY, node_copy
from falconext.control.ctl import MAX_STATUS_BYTES
from falconext.control.shards import open_bus
from falconext.protocol.base import MessageError
from falconext.protocol.codec import _heartbeats_at_once, decode, decode_heartbeats, encode, pack_heartbeats
from falconext.protocol.messages import HEARTBEAT_FIELDS, Heartbeat, heartbeat_block

JOB = "readers"


def beat(rank: int, node: int, it: int = 100, **kw) -> Heartbeat:
    return Heartbeat(rank, node, it, 0.5 + rank / 1e4, 1795000000.123456 + rank, replica=rank % 4, mb_s=0.0625,
                     micro=8, role=rank, stage=rank // 4, tp=2, pp=4, grad_bytes=50_000_000, score_iteration=it - 1,
                     est_iter_s=0.49, compute_s=0.4, wait_s=0.09, **kw)


def node_texts(nodes: range, it: int = 100, per_node: int = 8) -> list[str]:
    return [encode(m) for n in nodes for m in pack_heartbeats(n, [beat(n * per_node + i, n, it)
                                                                  for i in range(per_node)])]


def one_at_a_time(raws: list) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """The reference: decode each, keep the heartbeats, name the rest."""
    msgs, errors = [], []
    for i, raw in enumerate(raws):
        try:
            msgs.append(decode(raw, accept={"NodeHeartbeats", "Heartbeat"}))
        except MessageError as exc:
            errors.append((i, str(exc)))
    return heartbeat_block(msgs), errors


# --- decoding at once (pure) -----------------------------------------------------------------


def test_a_read_of_node_heartbeats_decodes_at_once_to_the_rows_decode_gives():
    raws = node_texts(range(40)) + [encode(m) for m in pack_heartbeats(40, [Heartbeat(320, 40, 7, 0.3, 1.0)])]
    assert _heartbeats_at_once(raws) is not None  # one way for the whole read
    block, errors = decode_heartbeats([r.encode() for r in raws])
    want, _ = one_at_a_time(raws)
    assert errors == [] and block.shape == (321, len(HEARTBEAT_FIELDS)) and np.array_equal(block, want)
    assert decode_heartbeats([])[0].shape == (0, len(HEARTBEAT_FIELDS))
    lone = [encode(Heartbeat(3, 0, 5, 0.3, 1.0))] + node_texts(range(2))  # a rank without an agent: its own row
    assert np.array_equal(decode_heartbeats(lone)[0], one_at_a_time(lone)[0])


BAD = [
    ("rank", "7"), ("rank", True), ("rank", -1), ("rank", 1.5), ("rank", None), ("iteration", 2**60),
    ("iter_s", "fast"), ("micro", 2.5), ("time", [1.0]), ("rank", 1e400),
]


def _spoiled(raw: str, how: tuple) -> str:
    obj = json.loads(raw)
    if how[0] == "twice":
        obj["body"]["rows"][1][0] = obj["body"]["rows"][0][0]
    elif how[0] == "node":
        obj["body"]["node"] = how[1]
    elif how[0] == "v":
        obj["v"] = how[1]
    else:
        col, value = how
        obj["body"]["rows"][3][obj["body"]["columns"].index(col)] = value
    return json.dumps(obj)


@pytest.mark.parametrize("how,right", [(b, False) for b in BAD + [("twice",), ("node", -1), ("node", True), ("v", True)]]
                         + [(("v", 1.0), True), (("iteration", 2**53), True), (("role", 3.0), True)])
def test_one_bad_value_in_a_read_is_judged_as_decode_judges_it(how, right):
    raws: list = node_texts(range(6))
    raws[2] = _spoiled(raws[2], how)
    block, errors = decode_heartbeats(raws)
    want, want_errors = one_at_a_time(raws)
    assert errors == want_errors and np.array_equal(block, want)
    assert bool(errors) is not right  # the last three are right, though not the fast way's


@pytest.mark.parametrize("seed", range(6))
def test_a_read_with_bad_messages_keeps_the_rest_and_names_each_as_decode_does(seed):
    rng = random.Random(seed)
    raws: list = node_texts(range(12))
    for _ in range(4):
        i = rng.randrange(len(raws))
        obj = json.loads(raws[i])
        kind = rng.randrange(5)
        if kind == 0:
            col, value = rng.choice(BAD)
            j = obj["body"]["columns"].index(col)
            obj["body"]["rows"][rng.randrange(8)][j] = value
        elif kind == 1:
            obj["body"]["rows"][1][0] = obj["body"]["rows"][0][0]  # a rank twice
        elif kind == 2:
            obj["body"]["columns"][0] = "ranks"
        elif kind == 3:
            obj["v"] = 2
        else:
            obj = {"v": 1, "type": "FailSlowReport", "body": {}}
        raws[i] = json.dumps(obj).replace("Infinity", "1e400")
    raws.insert(rng.randrange(len(raws)), b"{not json")
    block, errors = decode_heartbeats(raws)
    want, want_errors = one_at_a_time(raws)
    assert errors and errors == want_errors and np.array_equal(block, want)
    assert all("\n" not in why for _, why in errors)


# --- frames (pure) ---------------------------------------------------------------------------


def test_frames_carry_blocks_and_notes_and_refuse_what_is_not_one():
    block, _ = decode_heartbeats(node_texts(range(3)))
    stream = io.BytesIO(frame(block, 0) + frame(None, 2, "dropped beats entry 1-0: bad") + frame(block[:0], 2))
    got = [read_frame(stream) for _ in range(4)]
    assert np.array_equal(got[0].block, block) and got[0].dropped == 0
    assert got[1].block is None and got[1].note.endswith("bad") and got[1].dropped == 2
    assert got[2].block.shape == (0, len(HEARTBEAT_FIELDS)) and got[3] is None
    bad_rank, nan = block.copy(), block.copy()
    bad_rank[0, 0], nan[1, 3] = -1.0, np.nan
    cases = [
        (b"XXXX" + frame(block, 0)[4:], "bad magic"),
        (frame(block, 0)[:-8], f"8 of {block.size * 8} bytes missing"),
        (frame(block, 0)[:16], "cut off"),
        (frame(block, 0)[:10], "missing"),
        (MAGIC + (9).to_bytes(4, "little") + bytes(8), "unknown kind"),
        (MAGIC + (1).to_bytes(4, "little") + (1 << 21).to_bytes(4, "little") + bytes(4), r"rows \(at most"),
        (frame(nan, 0), "not finite"),
        (frame(bad_rank, 0), "rank"),
    ]
    for data, word in cases:
        with pytest.raises(FrameError, match=word) as exc:
            read_frame(io.BytesIO(data))
        assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="rows of"):
        frame(block[:, :5], 0)


# --- real processes on a real cluster ---------------------------------------------------------




def test_a_reader_passes_its_shard_s_heartbeats_on_and_counts_what_it_dropped(url):
    nodes = open_bus(url, JOB)
    r, w = os.pipe()
    out = os.fdopen(w, "wb")
    stop = [False]
    thread = threading.Thread(target=run_reader, args=(url, JOB, 1, out, stop, 100), daemon=True)
    thread.start()
    try:
        time.sleep(0.3)
        for n in range(6):  # nodes 1 and 4 are shard 1's
            for m in pack_heartbeats(n, [beat(n * 8 + i, n) for i in range(8)]):
                assert nodes.post(node_copy(BEATS_STREAM, n), m)
        nodes.post_raw(node_copy(BEATS_STREAM, 4), {"m": '{"v": 1, "type": "NodeHeartbeats", "body": {}}'})
        src = os.fdopen(r, "rb")
        rows, notes = [], []
        deadline = time.monotonic() + 10
        while (len(rows) < 16 or not notes) and time.monotonic() < deadline:
            got = read_frame(src)
            if got.block is not None:
                rows += got.block[:, 0].astype(int).tolist()
            else:
                notes.append(got)
        assert sorted(rows) == list(range(8, 16)) + list(range(32, 40))
        assert notes[-1].dropped == 1 and "NodeHeartbeats" in notes[-1].note
        own = nodes.buses[1]
        assert own._client.xlen(own.key(BEATS_STREAM)) == 0  # trimmed as read
    finally:
        stop[0] = True
        thread.join(5)
        nodes.close()


def _status(bus) -> dict | None:
    raw = bus.get(STATUS_KEY)
    return None if raw is None else decode(raw, accept={"StatusSnapshot"}, max_bytes=MAX_STATUS_BYTES).summary


def test_the_controller_takes_the_heartbeats_its_readers_decode_and_starts_a_killed_one_again(url, tmp_path: Path):
    from falconext.control.service import run_controller

    events = tmp_path / "events.jsonl"
    stop = [False]
    thread = threading.Thread(target=run_controller, args=(url, JOB + "c", 24, str(events), FalconConfig(
        link_baseline_iteration=0, status_interval_s=0.2), stop), daemon=True)
    thread.start()
    bus = open_bus(url, JOB + "c")

    def post(it: int) -> None:
        for n in range(3):  # one node on each shard
            for m in pack_heartbeats(n, [beat(n * 8 + i, n, it) for i in range(8)]):
                bus.post(node_copy(BEATS_STREAM, n), m)

    def until(ok, what: str, timeout_s: float = 20.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = ok()
            if got:
                return got
            time.sleep(0.1)
        raise AssertionError(f"no {what} in {timeout_s} s: {events.read_text() if events.exists() else ''}")

    def evs() -> list[dict]:
        return [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []

    try:
        until(lambda: any(e["type"] == "controller_started" for e in evs()), "start")
        time.sleep(1.0)  # the readers fix their start points
        post(100)
        s = until(lambda: (_status(bus) or {}).get("ranks") == 24 and _status(bus), "status of 24 ranks")
        assert s["iteration_min"] == s["iteration_max"] == 100
        readers = [int(p) for task in Path(f"/proc/{os.getpid()}/task").iterdir()
                   for p in (task / "children").read_text().split()]  # the controller's thread started them
        readers = [p for p in readers if b"beat-reader" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(readers) == 3
        os.kill(readers[1], signal.SIGKILL)
        until(lambda: any(e["type"] == "beat_reader_exited" and e["shard"] == 1 for e in evs()), "exit event")
        post(101)  # while shard 1 has no reader: read by the one started again, from the stream's start
        until(lambda: (_status(bus) or {}).get("iteration_min") == 101, "every node's new heartbeats")
        assert len([e for e in evs() if e["type"] == "beat_reader_exited"]) == 1
        assert not [e for e in evs() if e["type"] in ("controller_error", "beat_reader_error")]
    finally:
        stop[0] = True
        thread.join(10)
        bus.close()
