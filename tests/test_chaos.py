"""Chaos mode (falconext/testbed/chaos.py): the control plane is broken on purpose and
training does not care; falconext comes back and still finds the fault."""

from __future__ import annotations

import pytest

from falconext.control.messages import Heartbeat, MessageError, decode, encode
from falconext.testbed.chaos import BusChaos, ChaosError, ChaosSpec, Kill, parse_chaos

from jobs import launch


def test_a_spec_reads_every_action():
    spec = parse_chaos("kill-redis@20, kill-controller@30,kill-agent:1@40,drop:0.1,delay:50ms,corrupt:0.02",
                       world=4, nodes=2)
    assert spec.kills == (Kill("redis", 20), Kill("controller", 30), Kill("agent", 40, 1))
    assert (spec.drop, spec.delay_ms, spec.corrupt) == (0.1, 50.0, 0.02) and spec.bus
    assert parse_chaos(spec.to_text()) == spec
    assert parse_chaos(None) == ChaosSpec() and parse_chaos("") == ChaosSpec() and not ChaosSpec().bus


@pytest.mark.parametrize("text, says", [
    ("kill-gpu@3", "expected kill-redis@I"),
    ("kill-redis", "expected kill-redis@I"),
    ("kill-agent@3", "kill-agent:N@I"),
    ("kill-redis:1@3", "kill-agent only"),
    ("kill-agent:5@3", r"2 node\(s\)"),
    ("drop:1.5", "probability"),
    ("corrupt:-0.1", "probability"),
    ("drop:lots", "not a number"),
    ("delay:99999", "0 to 10000"),
])
def test_a_bad_spec_is_one_line_naming_the_part(text, says):
    with pytest.raises(ChaosError, match=says) as exc:
        parse_chaos(text, world=4, nodes=2)
    assert "\n" not in str(exc.value) and text.split(":")[0] in str(exc.value)


def test_damaged_messages_are_refused_by_every_reader_and_each_action_is_an_event():
    seen = []
    chaos = BusChaos(ChaosSpec(drop=0.2, corrupt=0.3), 1, lambda type_, **f: seen.append((type_, f)))
    fates = [chaos.fate("Heartbeat") for _ in range(2000)]
    assert 0.15 < fates.count("drop") / 2000 < 0.25
    assert 0.2 < fates.count("corrupt") / 2000 < 0.3  # of what was not dropped: 0.8 x 0.3
    assert len(seen) == fates.count("drop") + fates.count("corrupt")
    assert all(t == "chaos" and f["rank"] == 1 for t, f in seen)
    data = encode(Heartbeat(1, 0, 10, 0.3, 1.0))
    for _ in range(300):
        with pytest.raises(MessageError):
            decode(chaos.damage(data))


def test_a_delay_is_recorded_once_per_rank():
    seen = []
    chaos = BusChaos(ChaosSpec(delay_ms=50.0), 2, lambda type_, **f: seen.append((type_, f)))
    assert [chaos.fate("Heartbeat") for _ in range(100)] == ["post"] * 100
    assert seen == [("chaos", {"rank": 2, "action": "delay", "delay_ms": 50.0})]


def test_the_launcher_refuses_a_bad_spec_before_anything_starts(tmp_path):
    proc = launch(tmp_path / "run", "--iters", "5", "--chaos", "kill-agent:9@3", nproc=2)
    assert proc.returncode != 0
    assert "kill-agent:9@3" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "events.jsonl").exists()


# The whole run (Redis, controller and an agent killed, 8% of the ranks' messages lost or
# damaged, a 2x fault after the restarts, S2 applied) is README's chaos command; it is not
# in the suite, whose 10 minutes it would overrun: tests/test_control_e2e.py kills the
# controller and Redis under a real job, and the parts are tested here and in
# test_reliability, test_suspension and test_mitigation_controller (a lost ack).
