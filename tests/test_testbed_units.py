"""Pure parts of the training test bed: data order, fault files, the link model, CLI checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from falconext.cli import main
from falconext.inputs import InputError
from falconext.testbed import data
from falconext.model.faults import crossing_senders, link_bytes, parse_faults


def test_samples_depend_only_on_seed_batch_and_index():
    a = data.sample_tokens(1, 3, 5, 16, 97)
    assert torch.equal(a, data.sample_tokens(1, 3, 5, 16, 97))
    assert not torch.equal(a, data.sample_tokens(1, 3, 6, 16, 97))
    assert not torch.equal(a, data.sample_tokens(1, 4, 5, 16, 97))
    assert a.shape == (17,) and int(a.max()) < 97


@pytest.mark.parametrize("plan", [[4, 4], [3, 5], [1, 7], [2, 2, 2, 2], [1, 3, 1, 3]])
def test_any_plan_covers_the_global_batch_exactly_once(plan):
    mbs = 2
    seen = []
    for replica in range(len(plan)):
        for mb in data.microbatches(7, 11, plan, replica, mbs, 8, 50):
            seen.extend(tuple(row.tolist()) for row in mb.tokens)
    even = data.even_plan(sum(plan) * mbs, mbs, 2)
    expected = [
        tuple(row.tolist())
        for replica in range(2)
        for mb in data.microbatches(7, 11, even, replica, mbs, 8, 50)
        for row in mb.tokens
    ]
    assert seen == expected  # same samples, same order, whoever computes them


def test_even_plan_rejects_indivisible_batches():
    assert data.even_plan(32, 2, 2) == [8, 8]
    with pytest.raises(ValueError, match="not divisible"):
        data.even_plan(30, 4, 2)


def test_parse_faults_accepts_and_names_problems():
    faults = parse_faults(
        [{"kind": "compute", "rank": 1, "factor": 2.0, "start": 5, "end": 9},
         {"kind": "link", "nodes": [0, 1], "factor": 4, "start": 0}],
        world_size=4, ranks_per_node=2,
    )
    assert faults[0].active(5) and not faults[0].active(9) and faults[1].end is None
    bad = [
        ({"kind": "disk", "factor": 2}, "kind"),
        ({"kind": "compute", "rank": 9, "factor": 2}, "rank"),
        ({"kind": "compute", "rank": 0, "factor": 0.5}, "factor"),
        ({"kind": "compute", "rank": 0, "factor": float("nan")}, "factor"),
        ({"kind": "compute", "rank": 0, "factor": 2, "start": 5, "end": 5}, "end"),
        ({"kind": "link", "nodes": [0, 0], "factor": 2}, "nodes"),
        ({"kind": "link", "nodes": [0, 7], "factor": 2}, "nodes"),
        ({"kind": "compute", "rank": 0, "factor": 2, "when": 3}, "unknown field"),
    ]
    for fault, word in bad:
        with pytest.raises(InputError, match=word):
            parse_faults([fault], world_size=4, ranks_per_node=2)
    with pytest.raises(InputError, match="list"):
        parse_faults({"kind": "compute"}, 4, 2)


def test_link_model():
    # ring 0-1-2-3-0 over nodes {0,1} {2,3}: the link 0-1 is crossed by 1->2 and 3->0
    assert crossing_senders([0, 1, 2, 3], 2, (0, 1)) == [1, 3]
    assert crossing_senders([0, 1], 2, (0, 1)) == []  # both in node 0
    assert crossing_senders([0, 2], 2, (1, 0)) == [0, 2]
    assert link_bytes("all_reduce", 100, 4) == pytest.approx(150.0)
    assert link_bytes("all_gather", 100, 4) == pytest.approx(75.0)
    assert link_bytes("broadcast", 100, 1) == 0.0


def _fails(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(list(argv)))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_train_rejects_bad_layouts_and_fault_files_before_starting(tmp_path: Path, capsys):
    out = str(tmp_path / "run")
    assert "TP 3" in _fails(capsys, "train", "--nproc", "4", "--tp", "3", "--out", out)
    assert "--global-batch-size" in _fails(capsys, "train", "--nproc", "4", "--global-batch-size", "30", "--out", out)
    bad = tmp_path / "faults.json"
    bad.write_text(json.dumps([{"kind": "compute", "rank": 8, "factor": 2}]))
    assert "rank" in _fails(capsys, "train", "--nproc", "4", "--inject", str(bad), "--out", out)
    bad.write_text("[{")
    assert "malformed JSON" in _fails(capsys, "train", "--nproc", "4", "--inject", str(bad), "--out", out)
    for flag, value in (("--device-gflops", "0"), ("--device-gflops", "-2"), ("--link-bandwidth", "nan")):
        assert flag in _fails(capsys, "train", "--nproc", "4", flag, value, "--out", out)
    assert not (tmp_path / "run" / "events.jsonl").exists()  # nothing was started


def test_healthy_cv_leaves_out_warm_up_faults_and_falconexts_own_pauses():
    from falconext.report.summary import WARMUP, healthy_cv, paused_iterations

    steady = {it: (0.2 if it % 2 else 0.3) for it in range(1, 60)}
    steady.update({3: 9.0, 15: 1.4, 40: 0.9})  # a probe (warm-up), a suspension, a fault

    def in_fault(it):
        return it == 40

    events = [{"type": "suspension", "rank": 0, "iteration": 15}, {"type": "topology_switch", "iteration": 3},
              {"type": "fail_slow", "iteration": 20}]
    assert paused_iterations(events) == {3, 15}
    cv = healthy_cv(steady, in_fault, paused_iterations(events))
    assert cv == pytest.approx(0.2, abs=0.01)  # 0.2 and 0.3 alternating: std 0.05 over mean 0.25
    assert healthy_cv(steady, in_fault) > 0.5  # the suspension counted
    assert healthy_cv({WARMUP: 0.2}, in_fault) is None


def test_a_fault_the_scores_suspected_first_counts_as_found_when_suspected():
    """The controller's score trigger is the job's second detector: its suspicion of a
    fault counts from the iteration it was raised (a mitigation it leads to may cut the
    step short of the ranks' detectors' confirmation); a suspicion outside the fault, or a
    re-localization inside a mitigated episode, does not."""
    from falconext.report.summary import detection_figures

    fault = {"kind": "compute", "rank": 1, "factor": 2.0, "start": 45, "end": None}
    late = {"type": "fail_slow", "rank": 0, "onset": 56, "detected_at": 67, "slowdown": 1.17}
    early = {"type": "straggler_suspected", "action": "localize", "rank": 1, "onset": 47, "iteration": 54}
    f = detection_figures([late], [fault], [early])["faults"][0]
    assert (f["detected"], f["first_detection_delay"], f["suspected_after"], f["first_alarm_delay"]) == (True, 22, 9, 9)
    f = detection_figures([], [fault], [early])["faults"][0]
    assert (f["detected"], f["first_detection_delay"], f["first_alarm_delay"]) == (False, None, 9)
    before = dict(early, onset=30, iteration=38)
    again = dict(early, action="relocalize", iteration=50)
    f = detection_figures([late], [fault], [before, again])["faults"][0]
    assert (f["suspected_after"], f["first_alarm_delay"]) == (None, 22)
    assert detection_figures([], [fault])["faults"][0]["first_alarm_delay"] is None


def test_validation_messages_last_20_ms_at_the_networks_rate():
    import argparse

    from falconext.testbed.launch import testbed_knobs

    def knobs(device, net="emulated", bw=None):
        return testbed_knobs(argparse.Namespace(device=device, net=net, link_bandwidth=bw))

    assert knobs("emulated")["falcon_p2p_bytes"] == 1_000_000  # 50 MB/s by default
    assert knobs("emulated", bw=10e6)["falcon_p2p_bytes"] == 200_000
    assert knobs("cpu", net="netns", bw=5e6)["falcon_p2p_bytes"] == 100_000
    assert "falcon_p2p_bytes" not in knobs("cpu")  # loopback: the config's default


def test_forkrun_splits_torchruns_options_from_the_ranks_arguments():
    from falconext.testbed.forkrun import split_argv

    assert split_argv(["--nproc_per_node", "4", "-m", "falconext.testbed.train", "--iters", "3", "-m", "x"]) == (
        ["--nproc_per_node", "4"], ["--iters", "3", "-m", "x"])
    with pytest.raises(ValueError, match="runs falconext.testbed.train only, not 'other'"):
        split_argv(["--nproc_per_node", "4", "-m", "other", "--iters", "3"])
    with pytest.raises(ValueError, match="no '-m falconext.testbed.train'"):
        split_argv(["--nproc_per_node", "4"])


def test_forkrun_reads_the_node_count_that_chooses_how_ranks_are_forked():
    """One node: forks of the agent; any other count (either spelling): a fork server."""
    from falconext.testbed.forkrun import _nodes

    assert _nodes(["--nproc_per_node", "4"]) == "1"
    assert _nodes(["--nnodes", "2", "--node_rank", "1"]) == "2"
    assert _nodes(["--nnodes=2", "--node_rank", "0"]) == "2"
    assert _nodes(["--nnodes", "1"]) == "1"


def test_a_ranks_heartbeat_says_how_long_its_iteration_has_been_running():
    """FalconRuntime.into_s: since the start of the current loop iteration (the loop's own
    perf_counter starts, a resumed job's first iteration at index 0); -1 when it cannot
    know (no loop hooks, or before the loop's first iteration)."""
    import time
    from types import SimpleNamespace

    from falconext.runtime.runtime import FalconRuntime as Runtime

    now = time.perf_counter()
    rt = SimpleNamespace(loop_starts=[now - 9.0, now - 5.0, now - 2.0], _iteration=42, _first_iteration=40)
    assert 2.0 <= Runtime.into_s(rt) < 2.5
    rt._iteration = 41
    assert 5.0 <= Runtime.into_s(rt) < 5.5
    for bad in (SimpleNamespace(loop_starts=None, _iteration=42, _first_iteration=40),
                SimpleNamespace(loop_starts=[now], _iteration=-1, _first_iteration=0),
                SimpleNamespace(loop_starts=[now], _iteration=3, _first_iteration=0)):
        assert Runtime.into_s(bad) == -1.0


def test_a_heartbeats_medians_span_the_configured_windows():
    """The heartbeat's iteration time is the median of the latest beat_iter_window loop
    iterations, its compute per micro-batch the upper median of the latest
    beat_compute_window steps: a step in either shows once half the window holds it."""
    from types import SimpleNamespace

    from falconext.config import FalconConfig
    from falconext.protocol.rank_side import beat_mb_s
    from falconext.runtime.runtime import FalconRuntime

    cfg = FalconConfig(beat_iter_window=5, beat_compute_window=4)
    starts = [0.0]
    for d in [1.0] * 10 + [2.0] * 3:
        starts.append(starts[-1] + d)
    rt = SimpleNamespace(_enabled=True, hooked=True, loop_starts=starts, cfg=cfg)
    assert FalconRuntime.iter_s(rt) == 2.0  # 3 of the latest 5 are slow
    rt.loop_starts = starts[:-1]
    assert FalconRuntime.iter_s(rt) == 1.0  # 2 of 5
    assert FalconRuntime.iter_s(SimpleNamespace(_enabled=True, hooked=True, loop_starts=starts,
                                                cfg=FalconConfig(beat_iter_window=12))) == 1.0
    import collections
    mb = collections.deque(maxlen=cfg.beat_compute_window)
    resteps: list[int] = []  # the monitor told to learn the rank's compute level again
    fake = SimpleNamespace(_mb_s=mb, _micro=0, monitor=SimpleNamespace(restep=lambda: resteps.append(1)))
    for f in [0.1] * 6 + [0.2] * 2:
        FalconRuntime.after_step(fake, 4, [f, f + 0.05, f, f + 0.3])  # host stalls only add
    assert beat_mb_s(mb) == 0.2  # the upper median: 2 of the latest 4 are slow
    assert list(mb) == [0.1, 0.1, 0.2, 0.2]  # each step read at its fastest forward
    FalconRuntime.after_step(fake, 4, [0.1, float("nan")])  # no reading from a broken timer
    assert resteps == []  # 4 micro-batches a step from the first: no change of plan
    FalconRuntime.after_step(fake, 0, [])
    assert list(mb) == [0.1, 0.1, 0.2, 0.2] and resteps == [1]


def test_a_forked_rank_waits_until_its_node_has_all_its_ranks(tmp_path):
    """forkrun's ranks, forked by the agent, connect nowhere until every rank of the node
    exists (the agent's threads then serve no connection while it forks): a rank returns
    once local_world ranks have said so, and gives up at its deadline."""
    import threading
    import time

    from falconext.testbed.forkrun import _all_forked

    folder = str(tmp_path / "0")
    done: list[bool] = []
    first = threading.Thread(target=lambda: done.append(_all_forked(folder, "0", 2, deadline_s=10.0)))
    first.start()
    time.sleep(0.1)
    assert first.is_alive() and not done  # waits for rank 1
    assert _all_forked(folder, "1", 2, deadline_s=10.0)
    first.join(5.0)
    assert done == [True]
    t0 = time.monotonic()
    assert _all_forked(str(tmp_path / "1"), "0", 3, deadline_s=0.2) is False  # a sibling never came
    assert time.monotonic() - t0 < 2.0


def test_an_emulated_job_raises_its_priority_or_says_why_not():
    """raise_priority sets the process's nice value (children inherit it) and leaves one
    already at or below it alone; without the right to (an unprivileged account) it keeps
    the priority and names the reason."""
    import os
    import subprocess
    import sys

    code = ("import os; from falconext.testbed.priority import raise_priority as r; "
            "a = r(-3); b = r(5); print(repr(a), repr(b), os.getpriority(os.PRIO_PROCESS, 0))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    privileged = os.geteuid() == 0
    if privileged:
        assert run.stdout.split() == ["None", "None", "-3"], run.stdout + run.stderr
    else:  # an unprivileged account: the reason, priority unchanged
        assert "needs root or CAP_SYS_NICE" in run.stdout, run.stdout + run.stderr


def test_the_zygote_parses_strictly_and_refuses_what_it_cannot_serve_as_a_fresh_process_would():
    """Requests: exactly argv, env, cwd and nice, each checked; a job whose start-up
    settings differ from the zygote's is refused (its launcher then starts a fresh process)."""
    import json

    import pytest

    from falconext.testbed.zygote import ZygoteError, parse_request, startup_mismatch

    good = {"argv": ["--nproc-per-node", "2"], "env": {"A": "1"}, "cwd": "/tmp", "nice": -10}
    assert parse_request(json.dumps(good).encode()) == good
    for bad, word in [(b"\xff", "JSON"), (b"[1]", "exactly"), ({**good, "x": 1}, "exactly"),
                      ({**good, "argv": "a b"}, "argv"), ({**good, "env": {"A": 1}}, "env"),
                      ({**good, "cwd": "rel"}, "cwd"), ({**good, "nice": True}, "nice"),
                      ({**good, "nice": -21}, "nice")]:
        raw = bad if isinstance(bad, bytes) else json.dumps(bad).encode()
        with pytest.raises(ZygoteError, match=word):
            parse_request(raw)
    assert startup_mismatch({"OMP_NUM_THREADS": "1", "X": "a"}, {"OMP_NUM_THREADS": "1"}) is None
    assert "OMP_NUM_THREADS" in startup_mismatch({"OMP_NUM_THREADS": "4"}, {"OMP_NUM_THREADS": "1"})


def test_a_zygote_runs_forkrun_with_the_callers_streams_and_exit_status(zygote, tmp_path, capfd):
    """The session's zygote runs forkrun on the request's arguments in the caller's
    working directory and streams, and reports its exit status: forkrun's refusal of
    another module is its traceback on the caller's stderr and status 1, as from a fresh
    ``python -m falconext.testbed.forkrun``; a caller whose start-up settings differ is
    refused (None). ``zygote`` may still be importing: the call is retried until served."""
    import os
    import time

    from falconext.testbed.zygote import run_job

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    end = time.monotonic() + 60
    code = None
    while code is None and time.monotonic() < end:
        code = run_job(["--nproc-per-node", "1", "-m", "json.tool"], env, zygote)
        if code is None:
            time.sleep(0.2)
    assert code == 1
    assert "forkrun runs falconext.testbed.train only, not 'json.tool'" in capfd.readouterr().err
    assert run_job(["-m", "json.tool"], dict(env, OMP_NUM_THREADS="3"), zygote) is None
