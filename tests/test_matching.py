"""Collectives matched across members over arrays (profile/matching.py): exactly what the
per-collective functions of profile/analysis.py give, on random windows with repeated
rows, tied arrivals, incomplete collectives, reporters outside the group and spans."""

from __future__ import annotations

import random
from statistics import median

import pytest

from falconext.profile.analysis import last_arrivers, transfer_median
from falconext.profile.matching import match
from falconext.profile.window import analyze_window, group_members
from falconext.protocol.codec import decode, encode, pack_batch
from falconext.protocol.messages import ProfileData


def reference(windows):
    """The plain matching: (group, k) -> {rank: row}, complete when every member reported
    it (members read from the first window with calls on the group), a later row of a rank
    replacing its earlier one in place."""
    seen, members = {}, {}
    for w in windows:
        groups = group_members(w)
        for gid in w.calls:
            members.setdefault(gid, set(groups.get(gid, ())))
        for gid, rows in w.calls.items():
            for k, t0, t1, nbytes in rows:
                seen.setdefault((gid, int(k)), {})[w.rank] = (float(t0), float(t1), int(nbytes))
    complete = {key: inst for key, inst in seen.items() if members.get(key[0]) and set(inst) >= members[key[0]]}
    transfers, arrivals_in = {}, []
    for (gid, _k), inst in complete.items():
        if len(inst) < 2:
            continue
        arrivals_in.append({r: v[0] for r, v in inst.items()})
        transfers.setdefault((gid, max(v[2] for v in inst.values())), []).append(transfer_median(inst))
    return len(complete), last_arrivers(arrivals_in), transfers


def random_windows(seed: int) -> list[ProfileData]:
    rng = random.Random(seed)
    world = rng.randint(2, 24)
    size = rng.choice([2, 3, 4])
    groups = {f"g{i}": list(range(i * size, min(world, (i + 1) * size))) for i in range((world + size - 1) // size)}
    groups["all"] = list(range(world))
    groups["odd"] = sorted(rng.sample(range(world), min(world, 3)))
    out = []
    for r in rng.sample(range(world), world):  # ranks in any order
        mine = {g: m for g, m in groups.items() if r in m}
        calls = {}
        for g in mine:
            rows = []
            for k in range(rng.randint(0, 6)):
                if rng.random() < 0.15:
                    continue  # a call this rank does not report: its collective is incomplete
                t0 = round(rng.choice([1.0, 1.5, rng.uniform(0, 3)]) + k, 3)  # ties
                rows.append([k, t0, round(t0 + rng.choice([0.0, 0.25, rng.uniform(0, 1)]), 3),
                             rng.choice([4, 1 << 20])])
                if rng.random() < 0.1:  # the same collective twice: the later row counts
                    rows.append([k, t0 + 0.5, t0 + 0.75, 8])
            calls[g] = rows
        if rng.random() < 0.2 and groups["odd"] and r not in groups["odd"]:
            calls["odd"] = [[0, 2.0, 2.5, 4]]  # a reporter outside the group
        make = ProfileData.compact if rng.random() < 0.5 else ProfileData
        out.append(make(r, 1, {g: "dp" for g in mine}, mine, calls))
    return out


@pytest.mark.parametrize("seed", range(60))
def test_matching_over_arrays_is_the_plain_matching(seed):
    windows = random_windows(seed)
    count, arrivals, transfers = reference(windows)
    got = match(windows, group_members)
    assert got.count == count
    assert got.arrivals == arrivals and list(got.arrivals) == list(arrivals)  # the same order too
    assert got.transfers == transfers


@pytest.mark.parametrize("seed", range(12))
def test_decoded_profiles_are_matched_as_the_ones_made(seed):
    """A node's profiles decoded from its batch carry their rows as one checked array
    (ProfileData.call_array): the matching over them is the matching over the messages made."""
    windows = random_windows(seed)
    by_node = {}
    for w in windows:
        by_node.setdefault(w.rank // 4, []).append(w)
    windows = [w for mine in by_node.values() for w in mine]  # in the order the batches bring them
    decoded = [m for node, mine in by_node.items() for b in pack_batch(node, mine)
               for m in decode(encode(b)).messages()]
    assert all("_call_array" in vars(m) for m in decoded) and decoded == windows
    made, got = match(windows, group_members), match(decoded, group_members)
    assert (got.count, got.arrivals, got.transfers) == (made.count, made.arrivals, made.transfers)
    for w, m in zip(windows, decoded):
        assert m.call_array().tolist() == w.call_array().tolist()


def test_a_collective_counts_only_when_every_member_reported_it():
    rows = {0: [[0, 1.0, 2.0, 4], [1, 3.0, 4.0, 4]], 1: [[0, 1.5, 2.0, 4]], 2: [[0, 1.2, 2.0, 4], [1, 3.5, 4.0, 4]]}
    windows = [ProfileData(r, 1, {"g": "dp"}, {"g": [0, 1, 2]}, {"g": rows[r]}) for r in (0, 1, 2)]
    got = match(windows, group_members)
    assert got.count == 1  # k=1 lacks rank 1
    assert got.arrivals[1].last == 1 and got.arrivals[1].lateness_s == pytest.approx(0.3)
    assert got.transfers == {("g", 4): [0.5]}


def test_bad_rows_are_named():
    bad = [ProfileData(0, 1, {"g": "dp"}, {"g": [0, 1]}, {"g": [[0, 1.0, 2.0]]})]
    with pytest.raises(ValueError, match="rank 0, group g: a call row needs"):
        match(bad, group_members)
    back = [ProfileData(r, 1, {"g": "dp"}, {"g": [0, 1]}, {"g": [[0, 1.0, 0.5 if r else 2.0, 4]]}) for r in (0, 1)]
    with pytest.raises(ValueError, match="rank 1: t_end 0.5 precedes t_issue 1.0"):
        analyze_window(back)


def test_a_large_window_is_matched_as_the_plain_way_does():
    """4096 ranks in DP groups of 1024 (spans), rank 1 late: the same findings."""
    world, size = 4096, 1024
    rng = random.Random(3)
    windows = []
    for r in range(world):
        g = f"dp{r // size}"
        rows = [[k, k + (0.2 if r == 1 else rng.uniform(0, 0.01)), k + 0.3, 1 << 20] for k in range(4)]
        windows.append(ProfileData.compact(r, 1, {g: "dp"}, {g: range(r // size * size, (r // size + 1) * size)},
                                           {g: rows}))
    count, arrivals, transfers = reference(windows)
    got = match(windows, group_members)
    assert (got.count, got.arrivals, got.transfers) == (count, arrivals, transfers)
    assert analyze_window(windows).compute_suspects == [1]
    assert median(transfers[("dp0", 1 << 20)]) == pytest.approx(0.1)
