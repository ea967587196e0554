"""The controller's heartbeat table (control/beat_table.py) against a plain reference:
the latest heartbeat per rank in a dict and a deque of its heartbeats, one per loop
iteration and role (what JobView kept before the table), fed the same random heartbeats
one at a time and as blocks of several nodes' messages."""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest

from falconext.config import FalconConfig
from falconext.control.beat_table import BeatTable, KeptReadings, LatestBeats, columns, heartbeats_of
from falconext.control.heartbeats import JobView
from falconext.control.suspension import placement
from falconext.mitigate.mitigation import healthy_mb_s
from falconext.protocol.codec import decode, encode, pack_heartbeats
from falconext.protocol.messages import Heartbeat, heartbeat_block

KEEP = 5


class Plain:
    """The reference: what JobView kept before the table, in plain containers."""

    def __init__(self) -> None:
        self.beats: dict[int, Heartbeat] = {}
        self.history: dict[int, collections.deque] = {}
        self.first_beat: dict[int, int] = {}

    def record(self, b: Heartbeat) -> None:
        kept = self.history.setdefault(b.rank, collections.deque(maxlen=KEEP))
        self.first_beat.setdefault(b.rank, b.iteration)
        self.beats[b.rank] = b
        if kept and kept[-1].iteration == b.iteration and kept[-1].role == b.role:
            kept[-1] = b
        else:
            kept.append(b)


def rounds(seed: int, nodes: int = 4, per_node: int = 3, n: int = 30) -> list[list[Heartbeat]]:
    """``n`` rounds of every rank's heartbeat: iterations that sometimes stay (a
    heartbeat of the same iteration again), roles that sometimes change, random figures."""
    rng = random.Random(seed)
    it = {r: rng.randint(0, 3) for r in range(nodes * per_node)}
    role = dict(enumerate(range(nodes * per_node)))
    out = []
    for k in range(n):
        beats = []
        for r in rng.sample(sorted(it), len(it)):  # any order of ranks
            it[r] += rng.choice((0, 0, 1, 2))
            if rng.random() < 0.1:
                role[r] = rng.randint(0, 20)
            beats.append(Heartbeat(r, r // per_node, it[r], round(rng.uniform(0.2, 0.6), 6), 100.0 + k,
                                   replica=r % 2, mb_s=round(rng.uniform(0.0, 0.1), 6) if rng.random() > 0.1 else 0.0,
                                   micro=8, role=role[r], stage=r % 2, tp=1, pp=2, grad_bytes=50_000_000,
                                   score_iteration=it[r] - 1, est_iter_s=0.4, compute_s=0.3, wait_s=0.1,
                                   into_s=round(rng.uniform(-1.0, 0.3), 3), step_iteration=it[r] - rng.choice((1, 1, 2)),
                                   step_run=rng.randint(0, 6), step_ratio=round(rng.uniform(0.9, 2.0), 4)))
        out.append(beats)
    return out


def same_as(job: JobView, ref: Plain) -> None:
    assert dict(job.beats.items()) == ref.beats
    assert set(job.history) == set(ref.history)
    for r, kept in ref.history.items():
        assert [(b.iteration, b.role, b.mb_s, b.iter_s) for b in kept] == [tuple(x) for x in job.history[r]]
    assert job.first_beat == ref.first_beat and job.first_rank == min(ref.beats)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_table_keeps_what_the_plain_dict_and_deques_kept(seed):
    ref, one, blocks = Plain(), JobView(world=None, keep=KEEP), JobView(world=None, keep=KEEP)
    msgs = []
    for beats in rounds(seed):
        for b in beats:
            ref.record(b)
            one.record(b, clean=True)
        by_node = collections.defaultdict(list)
        for b in beats:
            by_node[b.node].append(b)
        msgs += [decode(encode(m)) for node, bs in sorted(by_node.items()) for m in pack_heartbeats(node, bs)]
        if len(msgs) >= 10:  # two or three rounds' node messages at once: a rank twice in a block
            blocks.record_block(heartbeat_block(msgs), clean=True)
            msgs = []
        same_as(one, ref)
    blocks.record_block(heartbeat_block(msgs), clean=True)
    same_as(blocks, ref)
    # the first rank's clean readings alike, whichever way they came
    assert list(one.clean) == list(blocks.clean) and one.clean


@pytest.mark.parametrize("seed", [4, 5, 6, 7])
def test_every_rank_s_compute_before_the_onset_is_the_plain_function_s(seed):
    ref, job = Plain(), JobView(world=None, keep=KEEP)
    for beats in rounds(seed, n=12):
        for b in beats:
            ref.record(b)
            job.record(b, clean=False)
    rng = random.Random(seed)
    its = sorted({b.iteration for kept in ref.history.values() for b in kept})
    for _ in range(20):
        onset, lookback = rng.randint(its[0] - 2, its[-1] + 2), rng.randint(0, 6)
        plain = healthy_mb_s({r: list(k) for r, k in ref.history.items()}, onset, lookback)
        assert job.history.healthy_mb_s(onset, lookback) == plain
        assert healthy_mb_s(job.history, onset, lookback) == plain  # the function takes the table's way
        # some ranks only (the verdict's GEMM ranks), a rank never heard from among them
        some = set(rng.sample(sorted(ref.history), max(1, len(ref.history) // 3))) | {10**6}
        only = {r: v for r, v in plain.items() if r in some}
        assert healthy_mb_s({r: list(k) for r, k in ref.history.items()}, onset, lookback, some) == only
        assert job.history.healthy_mb_s(onset, lookback, some) == only


@pytest.mark.parametrize("seed", [9, 10])
def test_every_rank_s_step_ratio_as_of_an_iteration_is_the_plain_reading_s(seed):
    """The fast path's aligned reading (control/stragglers.py: step_ratios): from the table
    at once, exactly what each rank's kept heartbeats give, found or not."""
    from falconext.control.stragglers import step_ratios

    ref, job = Plain(), JobView(world=None, keep=KEEP)
    for beats in rounds(seed, n=12):
        for b in beats:
            ref.record(b)
            job.record(b, clean=False)
    plain_beats = {r: job.beats[r] for r in job.beats}  # the table's order, as plain heartbeats
    its = sorted({b.step_iteration for kept in ref.history.values() for b in kept})
    for at in range(its[0] - 1, its[-1] + 2):
        got, found = step_ratios(job.beats, job.history, at)
        want, want_found = step_ratios(plain_beats, {r: list(k) for r, k in ref.history.items()}, at)
        assert found.tolist() == want_found.tolist() and got[found].tolist() == want[want_found].tolist()
    assert not step_ratios(job.beats, job.history, its[-1] + 1)[1].any()


def test_a_rank_s_heartbeat_is_made_once_until_its_next():
    table = BeatTable(3)
    beats = [Heartbeat(r, 0, 10, 0.3, 1.0, mb_s=0.05) for r in range(4)]
    table.record(np.array([[float(getattr(b, f)) for f in Heartbeat.__dataclass_fields__] for b in beats]))
    latest = LatestBeats(table)
    first = latest[2]
    assert first == beats[2] and latest[2] is first and list(latest.values())[2] is first
    table.record(np.array([[float(getattr(beats[0], f)) for f in Heartbeat.__dataclass_fields__]]))
    assert latest[2] is first and latest[0] == beats[0]
    kept = KeptReadings(table)
    once = kept[0]  # its readings likewise: every fail-slow report reads the first rank's
    assert kept[0] is once and [(x.iteration, x.iter_s) for x in once] == [(10, 0.3)]
    table.record(np.array([[float(getattr(b, f)) for f in Heartbeat.__dataclass_fields__]
                           for b in [Heartbeat(0, 0, 11, 0.4, 2.0, mb_s=0.05)]]))
    assert [(x.iteration, x.iter_s) for x in kept[0]] == [(10, 0.3), (11, 0.4)] and kept[2] is kept[2]
    with pytest.raises(KeyError):
        latest[9]
    assert 9 not in latest and "2" not in latest and list(latest) == [0, 1, 2, 3] and len(latest) == 4
    with pytest.raises(ValueError, match="keep"):
        BeatTable(0)


def test_columns_placement_and_the_made_heartbeats_agree_with_plain_heartbeats():
    job, ref = JobView(world=None, keep=KEEP), Plain()
    for beats in rounds(8, n=6):
        for b in beats:
            job.record(b, clean=True)
            ref.record(b)
    for names in (("iteration", "iter_s"), ("node", "into_s", "time")):
        got, want = columns(job.beats, *names), columns(ref.beats, *names)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
        assert all(np.array_equal(a, b) for a, b in zip(columns(ref.beats.values(), *names), want))
    cfg = FalconConfig()
    for now, tries in ((105.0, 1), (106.5, 2), (104.0, 3)):
        assert placement(job.beats, now, tries, cfg) == placement(list(ref.beats.values()), now, tries, cfg)
    assert heartbeats_of(np.zeros((0, 21))) == []
    made = heartbeats_of(job.table._rows[:2])
    assert made == [ref.beats[r] for r in job.table.ranks()[:2]]
    assert all(type(m.iteration) is int and type(m.iter_s) is float for m in made)
