"""The localizer alone (control/localizer.py): profiles -> validation plan -> verdict ->
Localized, the link baseline, and the verdict's bus form (no Redis, no controller)."""

from __future__ import annotations

import collections

from falconext.config import FalconConfig
from falconext.control.localizer import Localizer, compute_rise, for_bus
from falconext.protocol.codec import MAX_MESSAGE_BYTES, encode
from falconext.protocol.messages import Heartbeat, Localized, NodeHealth, ProfileData, ValidationResult

CFG = FalconConfig()
NODES = {0: 0, 1: 0, 2: 1, 3: 1}
DP = "dp:0,1,2,3"


def profile(rank: int, late_rank: int | None = 1, n: int = 20, fabric: str = "", algo: str | None = None):
    """Rank ``rank``'s calls on one DP all-reduce: ``late_rank`` enters each one late."""
    rows = []
    for k in range(n):
        t0 = 10.0 + k * 0.3 + (0.03 if rank == late_rank else 0.001 * ((rank + k) % 4))
        t_last = 10.0 + k * 0.3 + (0.03 if late_rank is not None else 0.003)
        rows.append([k, t0, t_last + 0.002, 4096])
    return ProfileData(rank, 1, {DP: "dp", "pp:0": "pp"}, {DP: [0, 1, 2, 3]}, {DP: rows},
                       fabric=fabric, nccl_algo=algo)


def beats(it: int = 60, mb: dict[int, float] | None = None) -> dict[int, Heartbeat]:
    mb = mb or {}
    return {r: Heartbeat(r, n, it, 0.3, 100.0, replica=r, mb_s=mb.get(r, 0.05), micro=4) for r, n in NODES.items()}


def planned(late_rank: int | None = 1) -> Localizer:
    loc = Localizer()
    loc.begin()
    for r in NODES:
        loc.profiles[r] = profile(r, late_rank)
    assert loc.plan_validation(CFG, set(NODES), NODES) is None
    return loc


def test_the_profiles_name_the_late_rank_and_the_plan_validates_it():
    loc = planned()
    assert loc.findings.compute_suspects == [1]
    assert loc.plan["scope"] == "suspects" and loc.plan_ranks == [0, 1, 2, 3]
    validation, shares = loc.split()
    assert validation.gemm_rounds >= 1 and {r for sh in shares for r in range(sh.first, sh.last + 1)} == set(NODES)
    fields = loc.profiled(listed=4)
    assert fields["ranks"] == [0, 1, 2, 3] and fields["profiles"] == 4 and fields["compute_suspects"] == [1]
    assert "ranks" not in loc.profiled(listed=3) and loc.profiled(listed=3)["profiles"] == 4  # a large job: the count
    assert set(fields["last_share"]) == {"1"}  # only the ranks ever last: the others' shares are 0
    # the baseline session measures links only
    links_only = Localizer()
    links_only.profiles = dict(loc.profiles)
    assert links_only.plan_validation(CFG, set(NODES), NODES, links_only=True) is None
    assert links_only.plan["gemm"] == []
    # a new session forgets the last one's work
    loc.begin()
    assert loc.plan is None and loc.findings is None and not loc.profiles


def test_a_profile_that_cannot_be_analysed_is_a_reason_not_a_crash():
    loc = Localizer()
    short = ProfileData(0, 1, {DP: "dp"}, {DP: [0, 1, 2, 3]}, {DP: [[0, 1.0, 2.0]]})  # a row without its bytes
    loc.profiles = {0: short}
    assert loc.plan_validation(CFG, set(NODES), NODES).startswith("bad profile data")
    assert loc.plan is None


def test_the_verdict_names_the_slow_gemm_and_the_missing_ranks():
    loc = planned()
    for r in (0, 1, 2):  # rank 3's result never came
        loc.results[r] = ValidationResult(r, 1, 5e9 if r == 1 else 1e10, [])
    loc.health[0] = NodeHealth(0, 1, [{"index": 0, "sm_clock_mhz": 1980}])
    v = loc.verdict(CFG, set(NODES), beats(), {}, None)
    assert v.gpus == [1] and v.links == [] and v.missing == [3] and v.flops[1] == 5e9
    found = loc.localize(v, 9, "fail_slow")
    assert found.gpus == [1] and loc.localizations == [found]
    ev = found.evidence
    assert ev["session"] == 9 and ev["trigger"] == "fail_slow" and ev["missing"] == [3]
    assert ev["gemm_gflops"] == {"0": 10.0, "1": 5.0, "2": 10.0} and ev["health"]["0"][0]["sm_clock_mhz"] == 1980
    loc.clear_results()
    assert not loc.results and not loc.health


def test_healthy_results_name_nothing_and_bad_rows_are_a_reason():
    loc = planned()
    for r in NODES:
        loc.results[r] = ValidationResult(r, 1, 1e10, [])
    v = loc.verdict(CFG, set(NODES), beats(), {}, None)
    assert v.gpus == [] and v.links == [] and v.missing == []
    loc.results[0] = ValidationResult(0, 1, 1e10, [["a", 1, 0.1]])  # handed in directly, never decoded
    assert loc.verdict(CFG, set(NODES), beats(), {}, None).startswith("bad validation results")


def test_the_compute_rise_is_each_rank_s_own_since_the_onset():
    history = {r: collections.deque([Heartbeat(r, n, it, 0.3, 90.0, replica=r, mb_s=0.05, micro=4)
                                     for it in (38, 39, 40)]) for r, n in NODES.items()}
    now = beats(mb={1: 0.1})
    assert compute_rise(now, history, 40, CFG.min_duration) == {0: 1.0, 1: 2.0, 2: 1.0, 3: 1.0}
    assert compute_rise(now, history, None, CFG.min_duration) == {}
    assert compute_rise(now, history, 30, CFG.min_duration) == {}  # nothing kept from before the onset


def test_the_link_baseline_starts_once_on_two_nodes_when_every_rank_is_past_it():
    loc = Localizer()
    bs = beats(it=10)
    first = {r: 1 for r in NODES}
    assert not loc.baseline_due([], 10, True, 4, bs, first)
    for r in (0, 1, 2):
        assert not loc.baseline_due([r], 10, True, 4, bs, first)
    assert not loc.baseline_due([3], 10, False, 4, bs, first)  # busy: not yet
    assert loc.baseline_due([3], 10, True, 4, bs, first)
    assert not loc.baseline_due([3], 10, True, 4, bs, first)  # once
    late = Localizer()  # a restarted controller saw the ranks first past the iteration
    for r in NODES:
        due = late.baseline_due([r], 10, True, 4, bs, {r: 30 for r in NODES})
    assert not due and late.baseline_started
    one_node = Localizer()
    for r in NODES:
        due = one_node.baseline_due([r], 10, True, 4,
                                    {q: Heartbeat(q, 0, 10, 0.3, 1.0) for q in NODES}, first)
    assert not due
    evidence = {"links": {"0-1": 0.01}}
    assert loc.keep_baseline(evidence) == bool(loc.link_baseline)


def test_the_tree_inputs_are_the_first_rank_s_that_may_run_nccl_trees():
    loc = Localizer()
    assert loc.tree_inputs() == {"fabric": "", "nccl_algo": None}
    loc.profiles = {0: profile(0, fabric="nccl", algo="Ring"), 1: profile(1, fabric="nccl", algo="Tree")}
    assert loc.tree_inputs() == {"fabric": "nccl", "nccl_algo": "Tree"}
    # the lowest rank that may run trees, whatever order the profiles came in
    loc.profiles = {7: profile(7, fabric="nccl", algo=None), 5: profile(5, fabric="nccl", algo="Tree"),
                    2: profile(2, fabric="gloo", algo=None), 6: profile(6, fabric="nccl", algo="Tree")}
    assert loc.tree_inputs() == {"fabric": "nccl", "nccl_algo": "Tree"}  # rank 5's (7's unset allows them too)
    loc.profiles[3] = profile(3, fabric="nccl", algo=None)
    assert loc.tree_inputs() == {"fabric": "nccl", "nccl_algo": None}  # rank 3's
    loc.profiles = {9: profile(9, fabric="nccl", algo="Ring"), 4: profile(4, fabric="gloo", algo=None)}
    assert loc.tree_inputs() == {"fabric": "gloo", "nccl_algo": None}  # none may: the lowest rank's


def test_a_verdict_too_big_for_the_bus_travels_cut_to_what_names_it():
    small = Localized(gpus=[1], links=[], evidence={"session": 1})
    assert for_bus(small) is small
    big = Localized(gpus=[1], links=[], evidence={"session": 1, "trigger": "fail_slow",
                                                  "gemm_gflops": {str(r): 1.0 for r in range(60000)}})
    cut = for_bus(big)
    assert cut.gpus == [1] and cut.evidence["truncated"] and "gemm_gflops" not in cut.evidence
    assert len(encode(cut).encode("utf-8")) <= MAX_MESSAGE_BYTES
    many = Localized(gpus=list(range(100000)), links=[], evidence={"session": 1})
    assert for_bus(many).evidence["gpus_total"] == 100000
