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
