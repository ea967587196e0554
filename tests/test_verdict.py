"""Slow-rank and slow-link verdicts: median references, like-with-like links, bad input named."""

from __future__ import annotations

import json
import math
import statistics
import random

import pytest

from falconext.config import FalconConfig
from falconext.validate import verdict
from falconext.validate.verdict import link_baseline

#: the factor these cases are drawn for; the functions' own default is the config's
FACTOR = 1.3


def slow_ranks(flops, factor=FACTOR, *args, **kwargs):
    return verdict.slow_ranks(flops, factor, *args, **kwargs)


def slow_links(pairs, node_of, factor=FACTOR, *args, **kwargs):
    return verdict.slow_links(pairs, node_of, factor, *args, **kwargs)


def test_the_verdicts_default_factor_is_the_configs():
    cfg = FalconConfig()
    flops = {0: 100.0, 1: 100.0, 2: 100.0 / 1.4}  # slow by 1.3, not by the config's 1.5
    assert verdict.slow_ranks(flops) == verdict.slow_ranks(flops, cfg.validation_slow_factor) == []
    assert verdict.slow_ranks(flops, 1.3) == [2]

# ------------------------------------------------------------------------------ slow_ranks


def test_one_slow_rank_among_four():
    assert slow_ranks({0: 100.0, 1: 98.0, 2: 50.0, 3: 103.0}) == [2]


def test_one_slow_rank_among_two():
    assert slow_ranks({4: 100.0, 9: 50.0}) == [9]


def test_two_ranks_compare_with_the_faster():
    # the reference is the faster half: 0.7 of the other is below it / 1.3, 0.8 is not
    assert slow_ranks({0: 100.0, 1: 70.0}) == [1]
    assert slow_ranks({0: 100.0, 1: 80.0}) == []
    assert slow_ranks({0: 100.0, 1: 70.0, 2: 100.0}) == [1]


def test_half_the_ranks_slow_do_not_hide_each_other():
    # the test bed's consolidation case: GEMMs of two slow ranks among four, measured
    # concurrently on 2 cores; the plain median (90) would only catch rank 3
    flops = {0: 66.2, 1: 114.9, 2: 137.0, 3: 58.1}
    assert slow_ranks(flops, factor=1.5) == [0, 3]
    assert slow_ranks({0: 50.0, 1: 100.0, 2: 50.0, 3: 100.0, 4: 100.0, 5: 50.0}) == [0, 2, 5]


def test_threshold_is_median_over_factor():
    base = {0: 100.0, 1: 100.0, 2: 100.0}
    assert slow_ranks({**base, 3: 100.0 / 1.3 + 1e-6}) == []  # the median stays 100
    assert slow_ranks({**base, 3: 100.0 / 1.3 - 1e-3}) == [3]
    assert slow_ranks({**base, 3: 70.0}, factor=1.5) == []


@pytest.mark.parametrize("seed", range(10))
def test_healthy_ranks_with_ten_percent_noise(seed):
    rng = random.Random(seed)
    assert slow_ranks({r: 100.0 * rng.uniform(0.9, 1.1) for r in range(16)}) == []


def test_fewer_than_two_ranks_give_no_verdict():
    assert slow_ranks({}) == [] and slow_ranks({3: 1.0}) == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -5.0, True, "fast"])
def test_bad_flops_name_the_rank(bad):
    with pytest.raises(ValueError, match="rank 7"):
        slow_ranks({0: 100.0, 7: bad, 2: 100.0})
    with pytest.raises(ValueError, match="rank 7"):
        slow_ranks({7: bad})  # checked even when there is nothing to compare


def test_a_suspect_must_stand_out_from_the_unsuspected_ranks():
    flops = {0: 177.1, 1: 177.9, 2: 118.8, 3: 121.2}  # measured in CI, link fault, suspect 3
    assert slow_ranks(flops, 1.5, suspects=[3]) == []
    flops[2] = 175.0  # now only the suspect reads slow
    assert slow_ranks(flops, 1.5, suspects=[3]) == [3]


def test_most_ranks_slow_are_named_when_their_own_compute_rose():
    """Three 2x stragglers among four (fig14's three slow replicas): the readings' median
    is a slow one, so the GEMM alone names nobody; each one's own compute time, which
    doubled since before the onset, agrees with the GEMM against the fastest reading."""
    flops = {0: 1.991e9, 1: 0.997e9, 2: 0.997e9, 3: 0.997e9}
    assert slow_ranks(flops, 1.5) == []
    rise = {0: 1.01, 1: 2.0, 2: 1.98, 3: 2.02}
    assert slow_ranks(flops, 1.5, compute_rise=rise) == [1, 2, 3]
    # all four slow: nothing stands below the fastest, nothing to name (no room anyway)
    assert slow_ranks({r: 0.997e9 for r in range(4)}, 1.5, compute_rise=rise) == []


def test_a_mild_straggler_is_named_when_its_gemm_and_its_compute_agree():
    """table7's 1.3x GPU: below the fastest GEMM / 1.25 and its compute rose 1.3x; the GEMM
    alone (held to 1.5x) names nobody, nor does a 1.2x reading or a 1.2x rise."""
    flops = {0: 100.0, 1: 100.5, 2: 76.9, 3: 99.8}
    assert slow_ranks(flops, 1.5) == []
    assert slow_ranks(flops, 1.5, compute_rise={0: 1.0, 1: 1.01, 2: 1.3, 3: 0.99}) == [2]
    assert slow_ranks(flops, 1.5, compute_rise={0: 1.0, 1: 1.01, 2: 1.2, 3: 0.99}) == []
    assert slow_ranks({**flops, 2: 83.3}, 1.5, compute_rise={0: 1.0, 1: 1.01, 2: 1.3, 3: 0.99}) == []


def test_a_rise_without_a_slow_gemm_or_a_slow_gemm_without_a_rise_names_nobody():
    flops = {0: 177.1, 1: 177.9, 2: 118.8, 3: 121.2}  # CI noise on a link-fault job
    assert slow_ranks(flops, 1.5, compute_rise={0: 1.0, 1: 1.0, 2: 1.05, 3: 1.1}) == []
    # compute rose everywhere (e.g. waits counted by a loaded host), GEMMs agree: nobody
    assert slow_ranks({r: 100.0 for r in range(4)}, 1.5, compute_rise={r: 2.0 for r in range(4)}) == []


@pytest.mark.parametrize("factor", [0.9, math.nan, -1.0])
def test_bad_factor(factor):
    with pytest.raises(ValueError, match="factor"):
        slow_ranks({0: 1.0, 1: 1.0}, factor=factor)


# ------------------------------------------------------------------------------ slow_links


def test_slow_link_among_node_ring():
    node_of = {r: r for r in range(4)}  # one rank per node
    pairs = [(0, 1, 1.0e-3), (1, 2, 1.1e-3), (2, 3, 3.0e-3), (3, 0, 0.95e-3)]
    slow, ev = slow_links(pairs, node_of)
    assert slow == [(2, 3)]
    assert ev["reference_from"] == "inter-node links"
    assert ev["reference"] == pytest.approx((1.0e-3 + 0.95e-3) / 2)  # the faster half
    assert ev["links"] == {"0-1": 1.0e-3, "1-2": 1.1e-3, "2-3": 3.0e-3, "0-3": 0.95e-3}
    assert ev["slow"] == ["2-3"] and ev["factor"] == 1.3
    json.dumps(ev)  # JSON-friendly


def test_two_congested_links_do_not_hide_each_other():
    """A 4x and a 2.5x link among four: the plain median (1.75 ms) sits between the
    2.5x link and the healthy ones and would let it pass; the faster half would not."""
    node_of = {r: r for r in range(4)}
    pairs = [(0, 1, 4.0e-3), (0, 2, 2.5e-3), (1, 3, 1.0e-3), (2, 3, 1.05e-3)]
    slow, ev = slow_links(pairs, node_of, 1.5)
    assert slow == [(0, 1), (0, 2)] and ev["reference"] == pytest.approx(1.025e-3)
    assert not 2.5e-3 > 1.5 * statistics.median(t for _, _, t in pairs)


def test_a_slow_link_must_also_lose_real_time():
    """2.9x of a 1 ms message is scheduling noise on a shared host; 40 ms is congestion."""
    node_of = {r: r for r in range(4)}
    noisy = [(0, 1, 1.0e-3), (1, 2, 1.1e-3), (2, 3, 2.9e-3), (3, 0, 0.95e-3)]
    assert slow_links(noisy, node_of, 1.5, min_excess_s=0.002)[0] == []
    congested = [(0, 1, 1.0e-3), (1, 2, 1.1e-3), (2, 3, 40e-3), (3, 0, 0.95e-3)]
    slow, ev = slow_links(congested, node_of, 1.5, min_excess_s=0.002)
    assert slow == [(2, 3)] and ev["min_excess_s"] == 0.002


def test_link_is_unordered_and_takes_the_median_of_its_measurements():
    node_of = {0: 0, 1: 1, 2: 2, 3: 3}
    pairs = [
        (0, 1, 1.0e-3), (1, 0, 1.0e-3), (0, 1, 9.0e-3),  # one noisy sample of 0-1
        (1, 2, 1.0e-3), (2, 3, 1.0e-3), (3, 2, 1.2e-3),
    ]
    slow, ev = slow_links(pairs, node_of)
    assert slow == [] and ev["links"]["0-1"] == 1.0e-3 and ev["links"]["2-3"] == pytest.approx(1.1e-3)


def test_fast_intra_node_links_do_not_condemn_inter_node_ones():
    # 4 nodes x 2 ranks; intra-node (NVLink-like) transfers are 10x faster than the network
    node_of = {r: r // 2 for r in range(8)}
    ring = [(r, (r + 1) % 8) for r in range(8)]
    pairs = [(s, d, 0.1e-3 if node_of[s] == node_of[d] else 1.0e-3) for s, d in ring]
    slow, ev = slow_links(pairs, node_of)
    assert slow == [], ev
    assert ev["reference_from"] == "inter-node links" and ev["reference"] == 1.0e-3
    assert ev["intra"] == {f"{n}-{n}": 0.1e-3 for n in range(4)}
    # now one network link really is slow
    pairs = [(s, d, 5.0e-3 if (s, d) == (3, 4) else t) for s, d, t in pairs]
    assert slow_links(pairs, node_of)[0] == [(1, 2)]


def test_intra_node_links_are_no_reference_for_network_links():
    # 2 nodes x 2 ranks: one inter-node link, 40x slower than the intra-node ones by
    # design (NVLink vs network): nothing like it to compare with, so nothing is named
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    pairs = [(0, 1, 0.1e-3), (1, 2, 4.0e-3), (2, 3, 0.1e-3), (3, 0, 4.0e-3)]
    slow, ev = slow_links(pairs, node_of)
    assert slow == [] and ev["reference"] is None and ev["reference_from"] == "no peer link"


def test_a_lone_network_link_is_judged_against_its_own_healthy_baseline():
    # 2 nodes x 2 ranks: the one inter-node link measured healthy earlier is its reference
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    healthy = [(0, 1, 0.1e-3), (1, 2, 4.0e-3), (2, 3, 0.1e-3), (3, 0, 4.2e-3)]
    slow, ev = slow_links(healthy, node_of)
    base = link_baseline(ev)
    assert slow == [] and base == {(0, 1): pytest.approx(4.1e-3)}
    congested = [(s, d, t * 4 if node_of[s] != node_of[d] else t) for s, d, t in healthy]
    slow, ev = slow_links(congested, node_of, 1.5, baseline=base)
    assert slow == [(0, 1)] and ev["reference_from"] == "baseline" and ev["baseline"] == {"0-1": base[(0, 1)]}
    # as fast as it was: not slow; and a 1.3x link is not 1.5x
    assert slow_links(healthy, node_of, 1.5, baseline=base)[0] == []
    assert slow_links([(s, d, t * 1.3) for s, d, t in healthy], node_of, 1.5, baseline=base)[0] == []
    # the absolute floor holds against a baseline too
    assert slow_links(congested, node_of, 1.5, min_excess_s=0.1, baseline=base)[0] == []
    # a verdict that named a link is no healthy baseline; a new healthy one replaces the old
    assert link_baseline(slow_links(congested, node_of, 1.5, baseline=base)[1], base) == base
    assert link_baseline({"links": {"0-1": 2e-3}, "slow": []}, base) == {(0, 1): 2e-3}


def test_two_network_links_compare_with_each_other():
    node_of = {0: 0, 1: 1, 2: 2}
    pairs = [(0, 1, 1.0e-3), (1, 2, 4.0e-3), (2, 1, 4.0e-3), (1, 0, 1.0e-3)]
    slow, ev = slow_links(pairs, node_of)
    assert slow == [(1, 2)] and ev["reference"] == 1.0e-3
    assert slow_links([(0, 1, 1.0e-3), (1, 2, 1.1e-3)], node_of)[0] == []


def test_a_single_link_has_nothing_to_be_compared_with():
    slow, ev = slow_links([(0, 1, 5.0), (1, 0, 5.0)], {0: 0, 1: 1})
    assert slow == [] and ev["reference"] is None


def test_intra_node_links_are_never_flagged():
    node_of = {0: 0, 1: 0, 2: 0}
    slow, ev = slow_links([(0, 1, 1.0), (1, 2, 50.0), (2, 0, 1.0)], node_of)
    assert slow == [] and ev["links"] == {}


def test_no_measurements():
    slow, ev = slow_links([], {})
    assert slow == [] and ev["reference"] is None
    json.dumps(ev)


@pytest.mark.parametrize("bad", [math.nan, 0.0, -1.0, math.inf])
def test_bad_link_time_names_the_pair(bad):
    with pytest.raises(ValueError, match="pair 2->3"):
        slow_links([(0, 1, 1.0), (2, 3, bad)], {r: r for r in range(4)})


def test_rank_without_node_is_named():
    with pytest.raises(ValueError, match="rank 5"):
        slow_links([(0, 5, 1.0)], {0: 0, 1: 1})


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_link_values_over_arrays_are_the_loop_s(seed):
    """At 100k ranks the link medians are worked out over arrays: exactly the figures of
    the loop over the measurements (ties, even and odd counts, both directions, links
    inside a node), and the same verdict; anything in doubt takes the loop's way."""
    import random

    from falconext.validate.verdict import _link_values, _link_values_at_once

    rng = random.Random(seed)
    nodes = rng.randint(2, 9)
    node_of = {r: r // 4 for r in range(4 * nodes)}
    pairs = []
    for _ in range(rng.randint(1, 300)):
        src, dst = rng.sample(sorted(node_of), 2)
        pairs.append((src, dst, rng.choice([0.001, 0.002, round(rng.uniform(0.0005, 0.05), 6)])))
    fast = _link_values_at_once(pairs, node_of)
    assert fast is not None and fast == _link_values(pairs, node_of)
    assert list(fast) == sorted(fast)
    assert slow_links(pairs, node_of, 1.5) == slow_links([list(p) for p in pairs], node_of, 1.5)  # lists: the loop
    for bad in ([(0, 1, float("nan"))], [(0, 1, 0.0)], [(0, 99, 0.1)], [(0, 1, 1)], [(-1, 1, 0.1)], [(0, 1)]):
        assert _link_values_at_once(pairs + bad, node_of) is None
    huge = {**node_of, 2**70: 0}  # a rank past 64 bits: the loop's way, the same figures
    assert _link_values_at_once(pairs, huge) is None and slow_links(pairs, huge, 1.5) == slow_links(pairs, node_of, 1.5)


@pytest.mark.parametrize("seed", [1, 2])
def test_measurements_as_one_array_give_the_tuples_verdict(seed):
    """The controller hands slow_links the results' rows as one array (measurement_array),
    those of ranks without a node left out (with_nodes): the same links, figures and
    evidence as the tuples; a row in doubt gives no array (the tuples' way names it)."""
    import random

    from falconext.validate.verdict import measurement_array, with_nodes

    rng = random.Random(seed)
    node_of = {r: r // 4 for r in range(4 * rng.randint(2, 9))}
    rows = [[*rng.sample(sorted(node_of), 2), rng.choice([0.001, round(rng.uniform(0.0005, 0.05), 6)])]
            for _ in range(rng.randint(2, 300))]
    rows[0][2] = 8.0 * max(r[2] for r in rows)  # one slow measurement
    stranger = [max(node_of) + 5, 0, 0.001]  # a rank without a node: left out
    table = with_nodes(measurement_array(rows + [stranger]), node_of)
    assert table is not None and table.shape == (len(rows), 3)
    tuples = [(int(s), int(d), float(t)) for s, d, t in rows]
    assert slow_links(table, node_of, 1.5) == slow_links(tuples, node_of, 1.5)
    for bad in ([0, 1, float("nan")], [0, 1, 0.0], [0.5, 1, 0.1], [-1, 1, 0.1], [0, 1], [0, 1, "x"]):
        assert measurement_array(rows + [bad]) is None
    assert measurement_array([]) is None
