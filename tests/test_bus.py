"""The control bus against a real redis-server: round trips, hostile entries, a dying
and restarted server, liveness keys, and a private server that only its owner can use."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from falconext.control.bus import Bus
from falconext.protocol.base import MessageError
from falconext.protocol.codec import MAX_MESSAGE_BYTES, encode, looks_like_report, pack_batch
from falconext.protocol.commands import Suspend
from falconext.protocol.messages import FailSlowReport, Localized, SessionAck
from falconext.control.redis_client import redis_client
from falconext.control.redis_server import RedisServer, RedisUnavailable, start_redis
from wallclock import LOADED_HOST_SLACK_S

REPORT = FailSlowReport(rank=3, onset=150, detected_at=164, slowdown=1.4, baseline_s=0.34, time=1795338456.5)
SUSPEND = Suspend(1, 200, 5.0)
LOCALIZED = Localized([1], [[0, 1]], {"pause_s": 1.2})

#: run first, before any job runs ahead (conftest.py: RUN_FIRST):
#: it times blocking reads and restarts on the wall clock
RUN_FIRST = True


def wait_for(predicate: Callable[[], Any], timeout_s: float = 3.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


def read_until(bus: Bus, streams: list[str], n: int, timeout_s: float = 3.0) -> list[tuple[str, Any]]:
    got: list[tuple[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += bus.read(streams, block_ms=100)
    return got


class States:
    """Records on_state calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, str]] = []

    def __call__(self, up: bool, reason: str) -> None:
        self.calls.append((up, reason))


# --- the private server ----------------------------------------------------------------


def test_server_wants_its_password_and_listens_on_loopback_only(redis_server: RedisServer):
    with socket.create_connection((redis_server.host, redis_server.port), timeout=1) as sock:
        sock.sendall(b"PING\r\n")
        assert sock.recv(100).startswith(b"-NOAUTH")
    for auth in ("", ":guess@"):  # redis_client: redis-py's default would retry a refused AUTH for seconds
        stranger = redis_client(f"redis://{auth}{redis_server.host}:{redis_server.port}/0", 2.0)
        with pytest.raises(redis.AuthenticationError):
            stranger.ping()
    client = redis.Redis.from_url(redis_server.url)
    assert client.ping()
    assert client.config_get("bind") == {"bind": "127.0.0.1"}
    assert client.config_get("save") == {"save": ""} and client.config_get("appendonly") == {"appendonly": "no"}
    client.close()
    # Bound to 127.0.0.1 itself, not the wildcard: another loopback address is refused.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", redis_server.port), timeout=1).close()
    assert redis_server.url == f"redis://:{redis_server.password}@127.0.0.1:{redis_server.port}/0"
    assert len(redis_server.password) >= 32
    assert redis_server.password not in redis_server.log_tail(1000)


def test_missing_binary_and_early_exit_are_named(redis_server: RedisServer, tmp_path, monkeypatch):
    with pytest.raises(RedisUnavailable, match="port"):  # port taken: exits at start
        start_redis(port=redis_server.port)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RedisUnavailable, match="redis-server not found on PATH; run launch/setup.sh"):
        start_redis()


def test_stop_kill_restart():
    server = start_redis(password="pw with \"quotes\" and \\")
    pid = server.pid
    server.kill()
    assert not server.alive()
    server.restart()
    assert server.alive() and server.pid != pid
    assert redis.Redis.from_url(server.url).ping()
    server.stop()
    server.stop()  # idempotent
    assert not server.alive()
    with pytest.raises(ValueError, match="control characters"):
        start_redis(password="two\nlines")


# --- round trips -----------------------------------------------------------------------


def test_round_trip_from_reader_start_in_order(redis_server: RedisServer):
    writer = Bus(redis_server.url, "job1")
    assert writer.post("reports", FailSlowReport(0, 1, 2, 1.1, 0.3, 5.0))  # before the reader exists
    # a reader starts at the server's millisecond of its first contact, and one entry of
    # the millisecond before may slip in (the safe side of the race, bus.py): this one is
    # posted well before it, or it is delivered in the rare run where both share a ms
    time.sleep(0.01)
    reader = Bus(redis_server.url, "job1")
    other_job = Bus(redis_server.url, "job2")
    for i in range(3):
        assert writer.post("reports", FailSlowReport(i, 10 + i, 20 + i, 1.5, 0.3, 6.0))
    assert writer.post("commands", SUSPEND)
    assert writer.post("commands", LOCALIZED)

    got = reader.read(["reports", "commands"])
    reports = [m for s, m in got if s == "reports"]
    assert [r.rank for r in reports] == [0, 1, 2] and all(r.onset >= 10 for r in reports)
    assert [m for s, m in got if s == "commands"] == [SUSPEND, LOCALIZED]
    assert reader.read(["reports", "commands"]) == []  # each entry once
    assert other_job.read(["reports", "commands"]) == []  # namespaced per job
    assert reader.dropped == 0

    reader.seek("reports", "0-0")  # a reader can start from any id
    assert [m.onset for _, m in reader.read(["reports"])] == [1, 10, 11, 12]
    with pytest.raises(ValueError, match="not a stream id"):
        reader.seek("reports", "$")


def test_blocking_read_wakes_on_a_post_and_times_out_empty(redis_server: RedisServer):
    reader, writer = Bus(redis_server.url, "j"), Bus(redis_server.url, "j")
    t0 = time.monotonic()
    assert reader.read(["commands"], block_ms=200) == []
    assert 0.15 < time.monotonic() - t0 < 0.2 + LOADED_HOST_SLACK_S
    assert writer.post("commands", SUSPEND)
    assert reader.read(["commands"], block_ms=1500) == [("commands", SUSPEND)]
    assert reader.connected
    stats = redis.Redis.from_url(redis_server.url)
    before = stats.info("stats")["total_connections_received"]
    for _ in range(5):
        assert reader.read(["commands"], block_ms=20) == []
    for _ in range(5):
        assert reader.read(["commands"]) == []
    assert stats.info("stats")["total_connections_received"] - before <= 1  # connections are reused
    stats.close()


def test_accept_filters_types_and_logs_the_rest(redis_server: RedisServer):
    reader, writer = Bus(redis_server.url, "j"), Bus(redis_server.url, "j")
    writer.post("s", REPORT)
    writer.post("s", SUSPEND)
    assert reader.read(["s"], accept={"Command"}) == [("s", SUSPEND)]
    assert reader.dropped == 1
    assert "not accepted" in reader.errors[-1] and reader.errors[-1].startswith("dropped s entry ")


def test_post_refuses_what_no_reader_could_take(redis_server: RedisServer):
    bus = Bus(redis_server.url, "j")
    with pytest.raises(MessageError, match="not a message type"):
        bus.post("s", {"rank": 1})
    with pytest.raises(MessageError, match="exceeds"):
        bus.post("s", Localized([1], [], {"blob": "x" * MAX_MESSAGE_BYTES}))
    with pytest.raises(ValueError, match="job name"):
        Bus(redis_server.url, "a:b")



def test_commands_go_in_one_round_trip_in_order_and_one_too_large_is_said(redis_server: RedisServer):
    """The controller's consecutive commands (a 100k-rank plan's 179 shares, then the
    suspend) are posted in one pipeline, in order; one over the cap refuses the batch
    before anything is posted, so each goes alone and the too-large one is said."""
    from falconext.control.service import post_in_order

    bus, reader = Bus(redis_server.url, "j"), Bus(redis_server.url, "j")
    assert bus.post_many("c", [Suspend(s, 100 + s, 5.0) for s in range(1, 6)]) and bus.post_many("c", [])
    assert [m.session for _, m in reader.read(["c"])] == [1, 2, 3, 4, 5]
    said: list[tuple[str, dict]] = []
    big = Localized([1], [], {"blob": "x" * MAX_MESSAGE_BYTES})
    post_in_order(bus, "c", [Suspend(6, 106, 5.0), big, Suspend(7, 107, 5.0)], lambda t, **f: said.append((t, f)))
    assert [m.session for _, m in reader.read(["c"])] == [6, 7]
    assert [(t, f["what"]) for t, f in said] == [("post_failed", "Localized")] and "exceeds" in said[0][1]["error"]
    redis_server.stop()
    assert not bus.post_many("c", [SUSPEND])  # Redis gone: False, never raised
    bus.close()

# --- hostile entries -------------------------------------------------------------------


def test_corrupted_entries_are_dropped_counted_and_named(redis_server: RedisServer):
    reader, writer = Bus(redis_server.url, "j"), Bus(redis_server.url, "j")
    good = json.loads(encode(REPORT))
    bad_type = dict(good, body=dict(good["body"], rank="3"))
    corrupt: list[tuple[dict[str, Any], str]] = [
        ({"m": "{not json"}, "malformed JSON"),
        ({"m": encode(REPORT).replace("1.4", "NaN")}, "NaN"),
        ({"m": json.dumps(dict(good, type="os.system"))}, "unknown message type"),
        ({"m": json.dumps(bad_type)}, "FailSlowReport.rank"),
        ({"msg": encode(REPORT)}, "expected exactly field 'm'"),
        ({"m": encode(REPORT), "x": "1"}, "expected exactly field 'm'"),
        ({"m": b"\xff\xfe\x00"}, "not UTF-8"),
        ({"m": "x" * (MAX_MESSAGE_BYTES + 1)}, "exceeds"),
    ]
    assert writer.post("s", SUSPEND)
    ids = [writer.post_raw("s", fields) for fields, _ in corrupt]
    assert all(ids)
    assert writer.post("s", REPORT)

    assert reader.read(["s"]) == [("s", SUSPEND), ("s", REPORT)]
    assert reader.dropped == len(corrupt)
    for error, entry_id, (_, word) in zip(reader.errors, ids, corrupt):
        assert error.startswith(f"dropped s entry {entry_id}: ") and word in error, error
    assert reader.position("s") is not None and reader.read(["s"]) == []


def test_reports_put_aside_wait_in_order_and_are_checked_when_taken(redis_server: RedisServer):
    # the controller's reading while it localizes: reports (a rank's, a node's batch) are
    # put aside undecoded, the rest is read in order; taken later, oldest first, and a
    # text that only looked like a report is dropped and named then
    reader, writer = Bus(redis_server.url, "j"), Bus(redis_server.url, "j")
    (batch,) = pack_batch(1, [FailSlowReport(r, 150, 164, 1.4, 0.34, 5.0) for r in (8, 9)])
    fake = encode(REPORT).replace("1.4", "NaN")
    assert writer.post("s", REPORT) and writer.post("s", SUSPEND) and writer.post("s", batch)
    bad_id = writer.post_raw("s", {"m": fake})
    assert writer.post("s", LOCALIZED)
    assert reader.read(["s"], later=looks_like_report) == [("s", SUSPEND), ("s", LOCALIZED)]
    assert reader.deferred == 3 and reader.deferred_since() is not None and reader.dropped == 0
    assert reader.take_later(2) == [("s", REPORT), ("s", batch)]
    assert reader.take_later(5) == [] and reader.deferred == 0 and reader.deferred_since() is None
    assert reader.dropped == 1 and reader.errors[-1].startswith(f"dropped s entry {bad_id}: ") \
        and "NaN" in reader.errors[-1]
    assert writer.post("s", REPORT) and reader.read(["s"]) == [("s", REPORT)]  # without later: read at once


def test_only_reports_look_like_reports():
    (batch,) = pack_batch(1, [FailSlowReport(r, 150, 164, 1.4, 0.34, 5.0) for r in (8, 9)])
    for text in (encode(REPORT), encode(batch)):
        assert looks_like_report(text) and looks_like_report(text.encode())
    (others,) = pack_batch(1, [SessionAck(r, 1, "held", 5, 2.0) for r in (8, 9)])
    for text in (encode(SUSPEND), encode(LOCALIZED), encode(others), "{not json", "", '"FailSlowReport"'):
        assert not looks_like_report(text) and not looks_like_report(text.encode())


# --- a dying Redis ---------------------------------------------------------------------


def test_dead_redis_fails_open_then_reconnects(redis_server: RedisServer):
    states = States()
    reader = Bus(redis_server.url, "j", on_state=states)
    writer = Bus(redis_server.url, "j")
    assert writer.post("s", SUSPEND) and reader.read(["s"]) == [("s", SUSPEND)]

    redis_server.kill()
    t0 = time.monotonic()
    assert writer.post("s", REPORT) is False
    assert time.monotonic() - t0 < writer.socket_timeout_s + LOADED_HOST_SLACK_S  # at most one socket timeout
    t0 = time.monotonic()
    assert reader.read(["s"], block_ms=300) == []
    assert time.monotonic() - t0 < 0.3 + reader.socket_timeout_s + LOADED_HOST_SLACK_S
    assert not reader.connected and not writer.connected
    assert reader.alive("agent") is None and reader.beat("agent", 1.0) is False and not reader.ping()
    t0 = time.monotonic()
    assert reader.read(["s"], block_ms=50) == []  # in backoff: waits out the block, no spin
    assert 0.04 < time.monotonic() - t0 < 0.05 + LOADED_HOST_SLACK_S
    assert len(states.calls) == 1 and states.calls[0][0] is False and "read s" in states.calls[0][1]

    redis_server.restart()  # empty: nothing persisted
    assert wait_for(lambda: writer.post("s", LOCALIZED))
    assert read_until(reader, ["s"], 1) == [("s", LOCALIZED)]
    assert reader.connected and states.calls[1:] == [(True, "reconnected")]
    assert writer.post("s", SUSPEND) and reader.read(["s"], block_ms=500) == [("s", SUSPEND)]


@pytest.mark.parametrize("reader_noticed", [False, True], ids=["idle-reader", "reader-saw-failure"])
def test_restart_does_not_strand_a_reader_ahead_of_the_new_server(redis_server: RedisServer, reader_noticed: bool):
    """A restarted server hands out ids from its clock; if this reader's position lies
    beyond them (clock behind, simulated here by an entry with a future id), it must
    move back rather than skip the new server's entries for good."""
    reader, writer = Bus(redis_server.url, "j"), Bus(redis_server.url, "j")
    raw = redis.Redis.from_url(redis_server.url)
    future_ms = int(time.time() * 1000) + 10**9
    raw.xadd(reader.key("s"), {"m": encode(SUSPEND)}, id=f"{future_ms}-0")
    raw.close()
    assert reader.read(["s"]) == [("s", SUSPEND)] and reader.position("s") == f"{future_ms}-0"

    redis_server.kill()
    if reader_noticed:
        assert reader.read(["s"]) == [] and not reader.connected
    redis_server.restart()
    assert wait_for(lambda: writer.post("s", REPORT))
    if reader_noticed:
        assert read_until(reader, ["s"], 1) == [("s", REPORT)]
    else:
        assert reader.read(["s"]) == [("s", REPORT)]  # one read: it reconnects, rewinds, reads again
    assert reader.position("s") != f"{future_ms}-0"
    assert writer.post("s", LOCALIZED) and reader.read(["s"]) == [("s", LOCALIZED)]


def test_bus_created_while_redis_is_down_starts_at_first_contact(redis_server: RedisServer):
    url, port, password = redis_server.url, redis_server.port, redis_server.password
    redis_server.kill()
    states = States()
    t0 = time.monotonic()
    reader = Bus(url, "j", on_state=states)
    assert time.monotonic() - t0 < reader.socket_timeout_s + LOADED_HOST_SLACK_S
    assert not reader.connected and states.calls[0][0] is False and reader.position("s") is None
    assert reader.read(["s"]) == []
    redis_server.restart()
    writer = Bus(url, "j")
    assert wait_for(reader.ping) and reader.position("s") is not None
    assert writer.post("s", SUSPEND)
    assert reader.read(["s"]) == [("s", SUSPEND)]
    assert [up for up, _ in states.calls] == [False, True]
    assert (redis_server.port, redis_server.password) == (port, password)


def test_a_raising_on_state_callback_does_not_break_the_bus(redis_server: RedisServer):
    def boom(up: bool, reason: str) -> None:
        raise RuntimeError("callback bug")

    bus = Bus(redis_server.url, "j", on_state=boom)
    redis_server.kill()
    assert bus.post("s", SUSPEND) is False
    assert "callback bug" in bus.errors[-1]


# --- liveness --------------------------------------------------------------------------


def test_beat_expires_after_its_ttl(redis_server: RedisServer):
    bus = Bus(redis_server.url, "j")
    assert bus.alive("agent-0") is False
    assert bus.beat("agent-0", 0.15)
    assert bus.alive("agent-0") is True and bus.alive("agent-1") is False
    assert wait_for(lambda: bus.alive("agent-0") is False, timeout_s=1.0)
    with pytest.raises(ValueError, match="ttl_s"):
        bus.beat("agent-0", 0)
