"""Profiling analysis: waiting vs transfer, last arrivers, the 1.1x suspicious-group rule."""

from __future__ import annotations

import random

import pytest

from falconext.profile.analysis import (
    GroupTiming,
    compute_suspects,
    last_arrivers,
    split_wait_transfer,
    suspicious_groups,
)


def test_split_wait_transfer():
    s = split_wait_transfer({0: (1.0, 1.5), 1: (1.3, 1.5), 2: (1.1, 1.5)})
    assert s[0].wait_s == pytest.approx(0.3) and s[1].wait_s == 0.0
    assert all(x.transfer_s == pytest.approx(0.2) for x in s.values())
    with pytest.raises(ValueError, match="rank 1"):
        split_wait_transfer({0: (1.0, 1.5), 1: (2.0, 1.5)})
    assert split_wait_transfer({}) == {}


def test_the_straggler_is_the_last_arriver():
    rng = random.Random(0)
    instances = []
    for k in range(200):
        arrivals = {r: k + rng.gauss(0.0, 0.002) for r in range(8)}
        arrivals[5] += 0.03  # rank 5 computes 30 ms longer each time
        instances.append(arrivals)
    stats = last_arrivers(instances)
    assert stats[5].last_share > 0.95 and stats[5].lateness_s > 0.02
    assert compute_suspects(stats) == [5]
    healthy = [{r: k + rng.gauss(0.0, 0.002) for r in range(8)} for k in range(200)]
    assert compute_suspects(last_arrivers(healthy)) == []


def test_suspicious_groups_compare_only_comparable_groups():
    dp = [GroupTiming(f"dp:{i}", "dp", 4, 1 << 20, 0.010) for i in range(6)]
    dp.append(GroupTiming("dp:slow", "dp", 4, 1 << 20, 0.013))
    tp = [GroupTiming(f"tp:{i}", "tp", 2, 4096, 0.001) for i in range(3)]
    pp_single = [GroupTiming("pp:0", "pp", 2, 1 << 15, 9.0)]  # nothing comparable: no verdict
    assert suspicious_groups(dp + tp + pp_single) == ["dp:slow"]
    assert suspicious_groups(dp[:6] + tp) == []
    barely = dp[:6] + [GroupTiming("dp:x", "dp", 4, 1 << 20, 0.0109)]  # under 1.1x: jitter
    assert suspicious_groups(barely) == []
    with pytest.raises(ValueError, match="dp:bad"):
        suspicious_groups([GroupTiming("dp:bad", "dp", 4, 1, float("nan"))])


# --- wait_causers: the rank that imposes the waiting -----------------------------------------------

from falconext.profile.analysis import ArrivalStats, wait_causers  # noqa: E402


def _caused(**by_rank: float) -> dict[int, ArrivalStats]:
    return {int(r[1:]): ArrivalStats(100, 10, 0.01, s) for r, s in by_rank.items()}


def test_wait_causers_names_the_rank_that_imposes_most_of_the_wait():
    assert wait_causers(_caused(r0=0.1, r1=3.0, r2=0.2, r3=0.1)) == [1]


def test_wait_causers_names_nobody_when_two_ranks_impose_alike():
    # 2.0 and 1.5: neither is 3x the other (two stragglers, or noise)
    assert wait_causers(_caused(r0=0.1, r1=2.0, r2=1.5, r3=0.1)) == []
    assert wait_causers(_caused(r0=0.1, r1=2.0, r2=1.5, r3=0.1), dominance=1.2) == [1]


def test_wait_causers_needs_a_share_of_all_the_wait():
    # rank 1 is 3x every other rank, yet only 1.0 of 2.4 (42%) of all the waiting
    stats = _caused(r0=0.3, r1=1.0, r2=0.3, r3=0.3, r4=0.25, r5=0.25)
    assert wait_causers(stats) == []
    assert wait_causers(stats, min_share=0.4) == [1]


def test_wait_causers_without_waiting_names_nobody():
    assert wait_causers(_caused(r0=0.0, r1=0.0)) == [] and wait_causers({}) == []


def test_a_profile_names_only_the_groups_called_in_its_window():
    """After a topology switch (fig17: S3 moved processes 1 and 3) the old DP group is never
    called again; naming it beside the new one made the validation groups overlap and
    localization fail ("rank 0 appears twice in merged pass 0")."""
    from falconext.profile.window import RecentCollectives
    from falconext.trace.records import CallRecord

    recent = RecentCollectives()
    for k in range(5):  # before the switch: dp:0,1 and a pipeline send
        recent.feed(CallRecord(0, "all_reduce", "dp:0,1", 64, 10.0 + k, t_end=10.1 + k, group_ranks=(0, 1), role="dp"))
        recent.feed(CallRecord(0, "send", "pp:0,2", 8, 10.05 + k, t_end=10.06 + k, group_ranks=(0, 2), role="pp",
                               peer=2))
    for k in range(5):  # after it: dp:0,3
        recent.feed(CallRecord(0, "all_reduce", "dp:0,3", 64, 30.0 + k, t_end=30.1 + k, group_ranks=(0, 3), role="dp"))
    snap = recent.snapshot(3.0)
    assert snap["members"] == {"dp:0,3": [0, 3]} and snap["roles"] == {"dp:0,3": "dp"}
    assert set(snap["calls"]) == {"dp:0,3"}
    # a long window still sees the old groups, P2P ones included
    assert set(recent.snapshot(60.0)["members"]) == {"dp:0,1", "pp:0,2", "dp:0,3"}


def test_the_transfer_median_is_the_median_of_the_splits_transfers():
    import random
    from statistics import median as med
    from falconext.profile.analysis import transfer_median
    rng = random.Random(3)
    for n in (1, 2, 5, 64):
        inst = {r: (t0 := rng.uniform(0, 1), t0 + rng.uniform(0, 0.5), 4096) for r in range(n)}
        want = med(s.transfer_s for s in split_wait_transfer({r: v[:2] for r, v in inst.items()}).values())
        assert transfer_median(inst) == pytest.approx(want)
    with pytest.raises(ValueError, match="rank 1: t_end"):
        transfer_median({0: (1.0, 2.0), 1: (3.0, 2.5)})


def test_the_last_arriver_of_equal_arrivals_is_the_one_a_stable_sort_puts_last():
    from falconext.profile.analysis import last_and_second
    for inst in ({0: 1.0, 1: 3.0, 2: 2.0}, {0: 3.0, 1: 3.0, 2: 1.0}, {5: 2.0, 4: 2.0, 3: 2.0}, {0: 1.0, 1: 0.5}):
        ordered = sorted(inst.items(), key=lambda kv: kv[1])
        assert last_and_second(inst) == (ordered[-1][0], ordered[-1][1], ordered[-2][1])
