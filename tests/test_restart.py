"""S4's pieces: per-rank checkpoint shards, the restart request, the test bed's node
replacement, and the pure mitigation helpers the controller uses."""

from __future__ import annotations

import copy
import json
import os
import random

import numpy as np
import pytest
import torch

from falconext.protocol.messages import Heartbeat
from falconext.mitigate import restart
from falconext.mitigate.mitigation import exclude_nodes, replica_view, replicas_of, straggler_recovered
from falconext.mitigate.restart import (
    RESTART_FILE,
    CheckpointError,
    RestartRequest,
    faults_without_nodes,
    load_shard,
    read_request,
    save_shard,
    shard_path,
    write_request,
)

LAYOUT = {"world": 4, "tp": 1, "pp": 1}


# --- a small training job ----------------------------------------------------------------


def make_job(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model, opt) -> float:
    """One step that draws from every RNG stream a training loop uses."""
    x = torch.randn(16, 4)
    y = torch.randn(16, 1)
    scale = 1.0 + random.random() + float(np.random.rand())
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x) * scale, y)  # dropout draws from torch's RNG
    loss.backward()
    opt.step()
    return loss.item()


def next_draws(gauss: bool = False):
    out = {
        "torch": torch.rand(5).tolist(),
        "python": [random.random() for _ in range(3)],
        "numpy": np.random.rand(3).tolist(),
    }
    if gauss:
        out["python_gauss"] = [random.gauss(0.0, 1.0) for _ in range(3)]
        out["numpy_gauss"] = np.random.randn(3).tolist()
    return out


def continuation(model, opt, gauss: bool = False):
    draws = next_draws(gauss)
    loss = train_step(model, opt)
    return draws, loss, [p.detach().clone() for p in model.parameters()]


def scramble_rngs() -> None:
    torch.manual_seed(12345)
    random.seed(12345)
    np.random.seed(12345)
    random.gauss(0.0, 1.0)
    np.random.randn(1)


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)




def _round_trip(tmp_path, gauss: bool):
    seed_all(3)
    model, opt = make_job(0)
    for _ in range(3):
        train_step(model, opt)
    if gauss:  # an odd number of normal draws leaves a cached gaussian in both generators
        random.gauss(0.0, 1.0)
        np.random.randn(1)
    directory = str(tmp_path / "ckpt")
    seconds = save_shard(directory, 2, LAYOUT, 3, model, opt, extra={"requested_at": 12.5})
    assert seconds >= 0 and os.path.exists(shard_path(directory, 2))
    assert not [f for f in os.listdir(directory) if ".tmp" in f]
    saved_state = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())  # the live one moves on with the next step
    expected = continuation(model, opt, gauss)  # the uninterrupted job

    fresh, fresh_opt = make_job(1)  # another process: other weights, other RNG positions
    assert not torch.equal(fresh[0].weight, saved_state["0.weight"])
    scramble_rngs()
    return directory, saved_state, saved_opt, expected, fresh, fresh_opt


def _check_resumed(state, directory, saved_state, saved_opt, expected, fresh, fresh_opt, gauss):
    assert state == {"iteration": 3, "extra": {"requested_at": 12.5}}
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved_state[k]), k
    got_opt = fresh_opt.state_dict()
    assert got_opt["param_groups"] == saved_opt["param_groups"]
    assert set(got_opt["state"]) == set(saved_opt["state"]) and len(got_opt["state"]) == 4
    for i, st in saved_opt["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got_opt["state"][i][key], st[key]), (i, key)
    draws, loss, params = continuation(fresh, fresh_opt, gauss)
    assert draws == expected[0]
    assert loss == expected[1]
    for a, b in zip(params, expected[2]):
        assert torch.equal(a, b)


def test_round_trip_continues_the_job_exactly(tmp_path):
    """Parameters, Adam state and the torch/python/numpy streams continue as if the job
    had never stopped, loaded with torch's default (weights_only) loader."""
    directory, saved_state, saved_opt, expected, fresh, fresh_opt = _round_trip(tmp_path, gauss=False)
    state = load_shard(directory, 2, LAYOUT, fresh, fresh_opt)
    _check_resumed(state, directory, saved_state, saved_opt, expected, fresh, fresh_opt, gauss=False)


def test_round_trip_keeps_cached_gaussians(tmp_path):
    directory, saved_state, saved_opt, expected, fresh, fresh_opt = _round_trip(tmp_path, gauss=True)
    state = load_shard(directory, 2, LAYOUT, fresh, fresh_opt)
    _check_resumed(state, directory, saved_state, saved_opt, expected, fresh, fresh_opt, gauss=True)


def test_python_cached_gaussian_survives(tmp_path):
    seed_all(5)
    model, opt = make_job(0)
    random.gauss(0.0, 1.0)  # caches the pair's second value
    save_shard(str(tmp_path), 0, LAYOUT, 1, model, opt)
    expected = [random.gauss(0.0, 1.0) for _ in range(3)]
    scramble_rngs()
    load_shard(str(tmp_path), 0, LAYOUT, model, opt)
    assert [random.gauss(0.0, 1.0) for _ in range(3)] == expected


# --- load_shard refuses what it cannot trust ---------------------------------------------------


def test_missing_shard(tmp_path):
    model, opt = make_job(0)
    with pytest.raises(CheckpointError, match="no checkpoint shard for rank 3"):
        load_shard(str(tmp_path), 3, LAYOUT, model, opt)


def test_corrupted_shard(tmp_path):
    model, opt = make_job(0)
    with open(shard_path(str(tmp_path), 0), "wb") as f:
        f.write(b"\x80\x04garbage, not a checkpoint" * 10)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match="unreadable checkpoint shard"):
        load_shard(str(tmp_path), 0, LAYOUT, model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_truncated_shard(tmp_path):
    model, opt = make_job(0)
    save_shard(str(tmp_path), 0, LAYOUT, 1, model, opt)
    path = shard_path(str(tmp_path), 0)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable"):
        load_shard(str(tmp_path), 0, LAYOUT, model, opt)


@pytest.mark.parametrize("layout,rank", [
    ({"world": 2, "tp": 1, "pp": 1}, 0),   # fewer ranks after the restart
    ({"world": 4, "tp": 2, "pp": 1}, 0),   # another split
    ({"world": 4, "tp": 1}, 0),            # another kind of layout
    (LAYOUT, 1),                           # another rank's shard under this rank's name
])
def test_layout_or_rank_mismatch(tmp_path, layout, rank):
    model, opt = make_job(0)
    save_shard(str(tmp_path), 0, LAYOUT, 1, model, opt)
    if rank != 0:
        os.replace(shard_path(str(tmp_path), 0), shard_path(str(tmp_path), rank))
    other, other_opt = make_job(1)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(CheckpointError, match=f"cannot resume rank {rank} with layout") as err:
        load_shard(str(tmp_path), rank, layout, other, other_opt)
    assert "saved by rank 0" in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))  # nothing half-loaded


_side_effects: list[str] = []


def _mark(what: str) -> str:
    _side_effects.append(what)
    return what


class Payload:
    """Unpickling this would run code (_mark): weights_only must refuse it."""

    def __reduce__(self):
        return (_mark, ("unpickled",))


def test_a_pickled_object_is_refused_without_running_it(tmp_path):
    model, opt = make_job(0)
    torch.save({"format": restart.FORMAT, "rank": 0, "layout": LAYOUT, "model": Payload()},
               shard_path(str(tmp_path), 0))
    _side_effects.clear()
    with pytest.raises(CheckpointError, match="unreadable checkpoint shard"):
        load_shard(str(tmp_path), 0, LAYOUT, model, opt)
    assert _side_effects == []


@pytest.mark.parametrize("payload", [[1, 2, 3], {"format": 2, "rank": 0, "layout": LAYOUT}, {"rank": 0}])
def test_not_a_shard_of_this_format(tmp_path, payload):
    model, opt = make_job(0)
    torch.save(payload, shard_path(str(tmp_path), 0))
    with pytest.raises(CheckpointError, match="not a falconext checkpoint shard of format 1"):
        load_shard(str(tmp_path), 0, LAYOUT, model, opt)


# --- restart.json -------------------------------------------------------------------------


def test_request_round_trip(tmp_path):
    req = RestartRequest(iteration=120, exclude_nodes=[1, 3], checkpoint=str(tmp_path / "checkpoint"), session=7,
                         requested_at=1712.5, save_s=0.25, attempt=2, reason="impact 3s >= overhead 2s of S4",
                         extra={"note": [1, 2]})
    write_request(str(tmp_path), req)
    assert sorted(os.listdir(tmp_path)) == [RESTART_FILE]  # no temporary left behind
    assert read_request(str(tmp_path / RESTART_FILE)) == req
    minimal = {"iteration": 0, "exclude_nodes": [], "checkpoint": "ck"}
    (tmp_path / "min.json").write_text(json.dumps(minimal))
    assert read_request(str(tmp_path / "min.json")) == RestartRequest(0, [], "ck")


def _write(tmp_path, obj=None, text=None) -> str:
    path = tmp_path / RESTART_FILE
    path.write_text(text if text is not None else json.dumps(obj))
    return str(path)


GOOD = {"iteration": 10, "exclude_nodes": [0], "checkpoint": "/ck"}


@pytest.mark.parametrize("text", ["", "{", "{'iteration': 1}", "[1, 2", "NaN?"])
def test_request_malformed_json(tmp_path, text):
    with pytest.raises(CheckpointError, match="cannot read the restart request"):
        read_request(_write(tmp_path, text=text))


def test_request_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read the restart request"):
        read_request(str(tmp_path / "nope.json"))


@pytest.mark.parametrize("obj", [
    {**GOOD, "surprise": 1},                               # unknown field
    {"iteration": 10, "exclude_nodes": [0]},               # missing checkpoint
    {"exclude_nodes": [0], "checkpoint": "/ck"},           # missing iteration
    {"iteration": 10, "checkpoint": "/ck"},                # missing exclude_nodes
    [GOOD],                                                # not an object
    "restart",
])
def test_request_fields(tmp_path, obj):
    with pytest.raises(CheckpointError, match="expected an object with fields") as err:
        read_request(_write(tmp_path, obj))
    assert "exclude_nodes" in str(err.value) and "iteration" in str(err.value)


@pytest.mark.parametrize("it", [True, False, -1, 1.5, 10.0, "10", None])
def test_request_bad_iteration(tmp_path, it):
    with pytest.raises(CheckpointError, match=r"iteration must be an integer >= 0, got"):
        read_request(_write(tmp_path, {**GOOD, "iteration": it}))


@pytest.mark.parametrize("nodes", ["0", 0, {"0": 1}, None, [0.0], [True], [-1], ["1"], [None], [[1]]])
def test_request_bad_exclude_nodes(tmp_path, nodes):
    with pytest.raises(CheckpointError, match="exclude_nodes must be a list of node numbers"):
        read_request(_write(tmp_path, {**GOOD, "exclude_nodes": nodes}))


@pytest.mark.parametrize("ck", [None, 1, ["/ck"]])
def test_request_bad_checkpoint(tmp_path, ck):
    with pytest.raises(CheckpointError, match="checkpoint must be a path"):
        read_request(_write(tmp_path, {**GOOD, "checkpoint": ck}))


@pytest.mark.parametrize("field,value", [
    ("attempt", "2"), ("attempt", True), ("session", "7"), ("requested_at", "now"),
    ("save_s", None), ("reason", 3), ("extra", [1]),
])
def test_request_bad_optional_fields(tmp_path, field, value):
    with pytest.raises(CheckpointError, match=field):
        read_request(_write(tmp_path, {**GOOD, field: value}))


# --- the test bed's node replacement --------------------------------------------------------


FAULTS = [
    {"kind": "compute", "rank": 1, "factor": 3.0, "start": 10, "end": 100},   # node 0
    {"kind": "compute", "rank": 2, "factor": 2.0, "start": 10, "end": 100},   # node 1
    {"kind": "link", "nodes": [0, 1], "factor": 4.0, "start": 0, "end": 50},  # touches node 0
    {"kind": "link", "nodes": [1, 2], "factor": 4.0, "start": 0, "end": 50},
    {"kind": "compute", "rank": 0, "factor": 1.5, "start": 60, "end": 70},    # node 0
]


def test_faults_on_an_excluded_node_go_away():
    faults = json.loads(json.dumps(FAULTS))
    kept = faults_without_nodes(faults, [0], 2)
    assert kept == [FAULTS[1], FAULTS[3]]
    assert faults == FAULTS  # the input is not changed
    assert faults_without_nodes(FAULTS, [], 2) == FAULTS
    assert faults_without_nodes(FAULTS, [2], 2) == [FAULTS[0], FAULTS[1], FAULTS[2], FAULTS[4]]
    assert faults_without_nodes(FAULTS, [1], 2) == [FAULTS[0], FAULTS[4]]
    # 4 ranks per node: rank 2 is on node 0 too
    assert faults_without_nodes(FAULTS, [0], 4) == [FAULTS[3]]


# --- mitigation helpers ---------------------------------------------------------------------


def hb(rank, replica=None, mb_s=0.05, micro=4, node=None):
    return Heartbeat(rank, rank // 2 if node is None else node, 10, 0.3, 1.0,
                     replica=rank if replica is None else replica, mb_s=mb_s, micro=micro)


def test_replica_view_needs_every_replica():
    full = [hb(0), hb(1, mb_s=0.1), hb(2), hb(3)]
    view = replica_view(full)
    assert view is not None
    assert view.times == [0.05, 0.1, 0.05, 0.05] and view.plan == [4, 4, 4, 4] and view.total == 16
    assert replica_view([]) is None
    assert replica_view(full[:3] + [hb(3, mb_s=0.0)]) is None      # no compute time yet
    assert replica_view(full[:3] + [hb(3, micro=0)]) is None       # no micro-batch count yet
    assert replica_view(full[:3] + [hb(3, replica=-1)]) is None    # replica unknown
    assert replica_view([hb(0), hb(2)]) is None                    # replicas 0 and 2: where is 1?


def test_replica_view_slowest_member_and_total():
    # two ranks per replica (TP pairs): replica 0 = ranks 0, 1; replica 1 = ranks 2, 3
    beats = [hb(0, 0, 0.05, 6), hb(1, 0, 0.2, 6), hb(2, 1, 0.07, 2), hb(3, 1, 0.04, 2)]
    view = replica_view(beats)
    assert view.times == [0.2, 0.07]  # a replica is as fast as its slowest member
    assert view.plan == [6, 2]
    assert view.total == 8  # micro-batches per replica, not per rank
    assert replica_view(list(reversed(beats))) == view


def test_replicas_of():
    beats = {0: hb(0, 0), 1: hb(1, 0), 2: hb(2, 1), 3: hb(3, -1)}
    assert replicas_of([1], beats) == {0}
    assert replicas_of([1, 2], beats) == {0, 1}
    assert replicas_of([3, 7], beats) == set()  # unknown replica, unknown rank


def test_exclude_nodes():
    node_of = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2, 5: 2}
    assert exclude_nodes([1], [], node_of) == [0]
    assert exclude_nodes([5, 1, 0], [], node_of) == [0, 2]
    assert exclude_nodes([], [[0, 1]], node_of) == [1]          # the higher end of a slow link
    assert exclude_nodes([], [[2, 0]], node_of) == [2]
    assert exclude_nodes([1], [[0, 2]], node_of) == [0]         # already cut by node 0
    assert exclude_nodes([1], [[1, 2]], node_of) == [0, 2]
    assert exclude_nodes([], [[0, 1], [1, 2]], node_of) == [1]  # node 1 cuts both
    assert exclude_nodes([9], [], node_of) == []                # a rank nobody heard of


def test_straggler_recovered_margins():
    assert straggler_recovered([0.05, 0.054, 0.05, 0.05], {1}, 0.10)
    assert not straggler_recovered([0.05, 0.056, 0.05, 0.05], {1}, 0.10)
    assert straggler_recovered([0.05, 0.056, 0.05, 0.05], {1}, 0.15)
    # the others' median, not their mean: one slow healthy replica does not excuse the straggler
    assert not straggler_recovered([0.05, 0.06, 0.05, 1.0], {1}, 0.10)
    # every slow replica must be back
    assert not straggler_recovered([0.05, 0.05, 0.1, 0.05], {1, 2}, 0.10)
    assert straggler_recovered([0.05, 0.05, 0.051, 0.05], {1, 2}, 0.10)
    # nothing to compare with
    assert not straggler_recovered([0.05, 0.05], set(), 0.10)
    assert not straggler_recovered([0.05, 0.05], {0, 1}, 0.10)


# --- S4's cost without a save nobody asked for --------------------------------------------

def test_s4_cost_is_estimated_without_writing_a_checkpoint(tmp_path, monkeypatch):
    model, opt = make_job(3)
    train_step(model, opt)  # the optimizer now holds its moments
    expected = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    expected += sum(t.numel() * t.element_size() for st in opt.state_dict()["state"].values()
                    for t in st.values() if isinstance(t, torch.Tensor))

    def no_save(*_a, **_k):
        raise AssertionError("a checkpoint was written to price S4")

    monkeypatch.setattr(torch, "save", no_save)
    cost = restart.estimate_cost(str(tmp_path / "probe"), 0, model, opt, probe_bytes=1 << 20)
    assert cost.state_bytes == expected > 0
    assert cost.write_bps > 0 and cost.read_bps > 0
    assert cost.save_load_s == pytest.approx(expected / cost.write_bps + expected / cost.read_bps)
    assert list((tmp_path / "probe").iterdir()) == []  # the scratch file is gone



def test_s3_roles_in_force_outlive_an_s4_restart(tmp_path):
    """fig17: S3 had moved a congested link's traffic, then S4 restarted without a slow
    GPU's node, and the job came back with the launch's roles, the link on DP traffic
    again (1.49x). The request carries the roles; the launcher forces them at the first
    resumed iteration; identity roles change nothing; bad roles are one line."""
    import argparse

    from falconext.inputs import InputError
    from falconext.testbed import launch

    req = restart.RestartRequest(iteration=188, exclude_nodes=[3], checkpoint=str(tmp_path), attempt=1,
                                 extra={"roles": [0, 3, 2, 1]})
    restart.write_request(str(tmp_path), req)
    back = restart.read_request(str(tmp_path / restart.RESTART_FILE))
    assert launch.restored_roles(back, 4) == [0, 3, 2, 1]
    args = argparse.Namespace(inject=None, out=str(tmp_path), ranks_per_node=1, nproc=4, resume=None, attempt=0,
                              falcon_force_topology=None)
    launch._prepare_restart(args, back)
    assert args.falcon_force_topology == "188:0,3,2,1" and args.resume == str(tmp_path) and args.attempt == 1
    same = restart.RestartRequest(iteration=5, exclude_nodes=[], checkpoint="c", extra={"roles": [0, 1, 2, 3]})
    assert launch.restored_roles(same, 4) is None
    assert launch.restored_roles(restart.RestartRequest(iteration=5, exclude_nodes=[], checkpoint="c"), 4) is None
    for bad in ([0, 1, 1, 3], [0, 1, 2], "0,1,2,3", [0, 1, 2, True]):
        with pytest.raises(InputError, match="roles must be a permutation"):
            launch.restored_roles(restart.RestartRequest(iteration=5, exclude_nodes=[], checkpoint="c",
                                                         extra={"roles": bad}), 4)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_replica_view_of_columns_is_the_plain_loop_s(seed):
    """The column form (numpy, for 100k heartbeats) gives exactly what a loop over the
    heartbeats gives: the slowest member's time, the last heartbeat's count, or None."""
    import random

    from falconext.mitigate.mitigation import replica_view_of

    def plain(replicas, mb_s, micros):
        times, micro = {}, {}
        for replica, mb, m in zip(replicas, mb_s, micros):
            if replica < 0 or mb <= 0 or m <= 0:
                return None
            times[replica] = max(times.get(replica, 0.0), mb)
            micro[replica] = m
        if not times or sorted(times) != list(range(len(times))):
            return None
        n = len(times)
        return ([times[r] for r in range(n)], [micro[r] for r in range(n)], sum(micro.values()))

    rng = random.Random(seed)
    for _ in range(300):
        n = rng.randint(0, 12)
        replicas = [rng.randint(-1 if rng.random() < 0.05 else 0, 4) for _ in range(n)]
        mb = [rng.choice([0.0, round(rng.uniform(0.01, 0.2), 4)]) if rng.random() < 0.1 else round(rng.uniform(0.01, 0.2), 4)
              for _ in range(n)]
        micros = [rng.choice([0, 4, 8]) if rng.random() < 0.1 else rng.choice([4, 8]) for _ in range(n)]
        got = replica_view_of(replicas, mb, micros)
        want = plain(replicas, mb, micros)
        assert (None if got is None else (got.times, got.plan, got.total)) == want, (replicas, mb, micros)
