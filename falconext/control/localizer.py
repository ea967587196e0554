"""Localizing a fail-slow: profile -> plan -> verdict (:class:`Localizer`).

The controller asks every rank for its recent collective calls (PROFILING); the
localizer analyses them into suspects and a validation plan (validate/plan.py); every
rank suspends at one agreed iteration to run it (VALIDATING: GEMMs and P2P passes, while
the training threads are trapped), and the localizer turns their results into a
:class:`Verdict` and the ``Localized`` message that names the slow GPUs and links.

On a job of exactly two nodes the one network link has no peer to be judged against:
the localizer measures it once, healthy, at ``link_baseline_iteration`` (the baseline
session) and judges it against itself later.

It does no I/O and holds no clock: the controller hands it the messages of the current
session and the heartbeats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from falconext.config import FalconConfig
from falconext.control.beat_table import columns
from falconext.protocol.codec import MAX_MESSAGE_BYTES, encode
from falconext.protocol.commands import ValidationPlan, ValidationShare
from falconext.protocol.messages import Heartbeat, Localized, NodeHealth, ProfileData, ValidationResult
from falconext.mitigate.mitigation import healthy_mb_s
from falconext.profile.window import Findings, analyze_window
from falconext.validate.plan import nccl_allows_trees, on_nccl, split_plan, validation_plan
from falconext.validate.verdict import link_baseline, measurement_array, slow_links, slow_ranks, with_nodes


@dataclass(frozen=True)
class Verdict:
    """What one validation found: the slow GPUs and links, the link evidence, each
    rank's GEMM speed (flop/s), the ranks' errors, and the ranks whose results never came."""

    gpus: list[int]
    links: list[tuple[int, int]]
    link_evidence: dict[str, Any]
    flops: dict[int, float]
    errors: dict[str, str]
    missing: list[int]


class Localizer:
    """The profiles, plan and results of the localization running now, the verdicts
    given, and the healthy link times of the baseline session."""

    def __init__(self) -> None:
        """Nothing profiled, planned or measured yet."""
        self.profiles: dict[int, ProfileData] = {}
        self.findings: Findings | None = None
        self.plan: dict[str, Any] | None = None  # the whole validation plan (validate/plan.py)
        self.plan_ranks: list[int] = []  # the ranks it was made for
        self.results: dict[int, ValidationResult] = {}
        self.health: dict[int, NodeHealth] = {}
        self.localizations: list[Localized] = []
        #: healthy inter-node link times (node pair -> s), from the baseline session
        self.link_baseline: dict[tuple[int, int], float] = {}
        self.baseline_started = False
        self.past_baseline: set[int] = set()  # ranks seen at or past link_baseline_iteration

    def begin(self) -> None:
        """A new profiling session: forget the last one's profiles, plan and results."""
        self.profiles.clear()
        self.results.clear()
        self.health.clear()
        self.findings = self.plan = None

    def clear_results(self) -> None:
        """The same plan is validated again in a new session: forget the results."""
        self.results.clear()
        self.health.clear()

    def plan_validation(self, cfg: FalconConfig, ranks: set[int], node_of: Mapping[int, int],
                        links_only: bool = False) -> str | None:
        """Analyse the profiles into findings and a validation plan for ``ranks`` (and any
        rank that sent a profile); ``links_only``: no GEMMs (the baseline is of the
        network). Returns why there is no plan (None: there is one)."""
        try:
            findings = analyze_window(list(self.profiles.values()), cfg.suspicious_factor, cfg.profile_min_bytes,
                                      cfg.wait_causer_share, cfg.wait_causer_dominance)
        except ValueError as exc:
            return f"bad profile data: {exc}"
        self.findings = findings
        self.plan_ranks = sorted(ranks | set(self.profiles))
        try:
            self.plan = validation_plan(
                findings.groups, self.plan_ranks, [r for r in findings.compute_suspects if r in self.plan_ranks],
                findings.suspicious_groups, gemm_n=cfg.gemm_size, gemm_repeats=cfg.gemm_repeats,
                gemm_concurrency=cfg.gemm_concurrency, validation_sweeps=cfg.validation_sweeps,
                p2p_concurrency=cfg.p2p_concurrency, p2p_bytes=cfg.p2p_bytes, p2p_repeats=cfg.p2p_repeats,
                node_of=dict(node_of), trees=cfg.validation_trees, **self.tree_inputs(),
            )
        except ValueError as exc:
            return f"no validation plan: {exc}"
        if links_only:
            self.plan["gemm"] = []
        return None

    def profiled(self, listed: int) -> dict[str, Any]:
        """The ``profiled`` event's fields: how many ranks sent profiles (and which, up to
        ``listed`` of them: a large job's event stays small) and the findings."""
        assert self.findings is not None
        ranks = {"ranks": sorted(self.profiles)} if len(self.profiles) <= listed else {}
        return {"profiles": len(self.profiles), **ranks, **self.findings.evidence()}

    def tree_inputs(self) -> dict[str, Any]:
        """The fabric and ``NCCL_ALGO`` the ranks reported with their profiles, for the
        plan's tree decision: those of the first rank (by rank) whose collectives may run as
        NCCL's trees, else the first rank's. NCCL needs every rank of a communicator to
        pick alike, and a tree validated in vain costs a few passes, a tree missed a
        congested link."""
        if not self.profiles:
            return {"fabric": "", "nccl_algo": None}
        first: dict[tuple[str, str | None], int] = {}  # each setting's lowest rank (few settings, 100k ranks)
        for r, p in self.profiles.items():
            key = (p.fabric, p.nccl_algo)
            if r < first.get(key, r + 1):
                first[key] = r
        trees = [r for (fabric, algo), r in first.items() if on_nccl(fabric) and nccl_allows_trees(algo)]
        pick = self.profiles[min(trees) if trees else min(first.values())]
        return {"fabric": pick.fabric, "nccl_algo": pick.nccl_algo}

    def split(self) -> tuple[ValidationPlan, list[ValidationShare]]:
        """The plan as the suspend command carries it, and each rank's share of the work
        in messages of a bounded size (validate/plan.py split_plan)."""
        return split_plan(self.plan or {}, self.plan_ranks)

    def p2p_bytes(self) -> int:
        """Bytes of one validation message of the plan now (0: none)."""
        return int((self.plan or {}).get("nbytes", 0) or 0)

    def verdict(self, cfg: FalconConfig, ranks: set[int], beats: Mapping[int, Heartbeat],
                history: Mapping[int, Iterable[Heartbeat]], onset: int | None) -> Verdict | str:
        """The slow GPUs and links the results show (validate/verdict.py), or why the
        results cannot be judged. A GPU's GEMM speed is judged with its compute rise since
        ``onset`` (:func:`compute_rise`); a link is judged against its peers, or against
        its baseline on a two-node job. ``ranks``: those whose results are awaited."""
        flops = {r.rank: r.gemm_flops for r in self.results.values() if r.gemm_flops is not None}
        ranks_in, nodes = columns(beats, "rank", "node")  # no Heartbeat made per rank
        node_of = dict(zip(ranks_in.astype(int).tolist(), nodes.astype(int).tolist()))
        errors = {str(r.rank): r.error for r in self.results.values() if r.error}
        try:
            # rows were checked when decoded; one handed in directly (a test, a bug) is too
            rows = [row for r in self.results.values() for row in r.links]
            table = measurement_array(rows)
            known = None if table is None else with_nodes(table, node_of)
            suspects = self.findings.compute_suspects if self.findings else []
            # the rise of the ranks that ran a GEMM only: no other is judged (a 100k-rank job
            # validates a few suspects' groups)
            gpus = slow_ranks(flops, cfg.validation_slow_factor, suspects,
                              compute_rise=compute_rise(beats, history, onset, cfg.min_duration, set(flops)))
            if known is None:  # a measurement in doubt: the tuples' way, which names it
                pairs = [(int(s), int(d), float(t)) for s, d, t in rows]
                known = [p for p in pairs if p[0] in node_of and p[1] in node_of]
            links, link_evidence = slow_links(
                known, node_of, cfg.validation_slow_factor,
                cfg.validation_min_link_excess_s, baseline=self.link_baseline,
            )
        except (ValueError, TypeError) as exc:
            return f"bad validation results: {exc}"
        return Verdict(list(gpus), list(links), link_evidence, flops, errors, sorted(ranks - set(self.results)))

    def localize(self, v: Verdict, session: int, trigger: str) -> Localized:
        """The ``Localized`` message for the verdict ``v`` of ``session`` (opened by
        ``trigger``), with its evidence: the plan's scope, the profile's findings, the GEMM
        speeds, the links, the ranks missing, the nodes' health and the ranks' errors. It
        is kept in :attr:`localizations`."""
        evidence: dict[str, Any] = {
            "session": session,
            "trigger": trigger,
            "scope": (self.plan or {}).get("scope"),
            "tree_groups": len((self.plan or {}).get("trees", [])),  # groups whose trees were validated
            "profile": self.findings.evidence() if self.findings else {},
            "gemm_gflops": {str(r): round(f / 1e9, 3) for r, f in sorted(v.flops.items())},
            "links": v.link_evidence,
            "missing": v.missing,
            "health": {str(n): h.gpus for n, h in sorted(self.health.items())},
        }
        if v.errors:
            evidence["errors"] = v.errors
        loc = Localized(gpus=list(v.gpus), links=[list(link) for link in v.links], evidence=evidence)
        self.localizations.append(loc)
        return loc

    def baseline_due(self, past: Iterable[int], at: int, idle: bool, expected: int,
                     beats: Mapping[int, Heartbeat], first_beat: Mapping[int, int]) -> bool:
        """Whether the link-baseline session starts now, on heartbeats in which the ranks
        ``past`` were at iteration ``at`` or later (it starts once): a
        job on exactly two nodes, every rank (``expected`` of them) past iteration ``at``
        (0: never), the controller ``idle``. A controller that joined the job late
        (restarted: some rank's first heartbeat it saw, ``first_beat``, was already past
        ``at``) measures no baseline: the link may be congested by then, and a suspension
        at an arbitrary time is not what a restart should cost. Constant work per
        heartbeat until every rank is past the iteration (thousands of ranks beat twice a
        second)."""
        if self.baseline_started or at <= 0:
            return False
        self.past_baseline.update(past)
        if not idle or len(self.past_baseline) < expected:
            return False
        self.baseline_started = True
        return len({b.node for b in beats.values()}) == 2 and max(first_beat.values()) <= at

    def keep_baseline(self, link_evidence: Mapping[str, Any]) -> bool:
        """The baseline session's links: kept as the healthy times if none was slow.
        Returns whether a baseline is kept."""
        self.link_baseline = link_baseline(link_evidence, self.link_baseline)
        return bool(self.link_baseline)


def compute_rise(beats: Mapping[int, Heartbeat], history: Mapping[int, Iterable[Heartbeat]], onset: int | None,
                 lookback: int, ranks: set[int] | None = None) -> dict[int, float]:
    """Each rank's (of ``ranks``; None: every one) compute per micro-batch in its latest
    heartbeat over its own before ``onset``
    (:func:`~falconext.mitigate.mitigation.healthy_mb_s`, ``lookback`` iterations back);
    ranks without both are left out; no onset, no figures. Read as columns of the
    controller's table (every rank at once: the 32,768 ranks of a 131,072-rank job's
    suspect's DP group took 0.7 s a rank at a time)."""
    if onset is None:
        return {}
    before = healthy_mb_s(history, onset, lookback, ranks)
    ids, mb = columns(beats, "rank", "mb_s")
    now = dict(zip(ids.astype(int).tolist(), mb.tolist()))
    return {r: now[r] / t for r, t in before.items()
            if (ranks is None or r in ranks) and r in now and t > 0 and now[r] > 0}


def for_bus(loc: Localized) -> Localized:
    """``loc`` as it may travel on the bus: whole when it fits ``MAX_MESSAGE_BYTES``;
    otherwise (its evidence grows with the ranks: about 34 bytes each) the verdict with
    the evidence cut to what names it, the rest in the ``localized`` event only."""
    if len(encode(loc).encode("utf-8")) <= MAX_MESSAGE_BYTES:
        return loc
    ev = loc.evidence
    keep = {k: ev[k] for k in ("session", "trigger", "scope") if k in ev}
    small = Localized(gpus=loc.gpus, links=loc.links, evidence=dict(keep, truncated=True, full_in="events.jsonl"))
    if len(encode(small).encode("utf-8")) <= MAX_MESSAGE_BYTES:
        return small
    # thousands of slow components: the count, and the events log for the names
    return Localized(gpus=loc.gpus[:1000], links=loc.links[:500],
                     evidence=dict(keep, truncated=True, full_in="events.jsonl",
                                   gpus_total=len(loc.gpus), links_total=len(loc.links)))
