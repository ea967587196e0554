"""Every experiment of the paper's evaluation, in the paper's order, implemented or not.

An implemented experiment names the module holding its ``measure(quick)`` and
``draw(result, path)``; the module is imported only when the experiment runs, so listing
costs nothing (no cvxpy, no matplotlib). A pending one carries the reason it cannot run
yet, which ``experiment run`` prints instead of inventing numbers.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

NEEDS_TRAINING = "not implemented yet: needs training jobs on the emulated test bed"


@dataclass(frozen=True)
class Experiment:
    """One figure or table of the evaluation (or a study the paper does not do)."""

    name: str
    title: str
    #: the paper's headline result, one line
    paper: str
    #: module with measure(quick) and draw(result, path); None when pending
    module: str | None = None
    #: why it cannot run yet; None when implemented
    pending: str | None = None
    #: whether ``run NAME --layouts`` measures the given parallel layouts (measure's ``layouts``)
    takes_layouts: bool = False

    @property
    def implemented(self) -> bool:
        """Whether the experiment can run (it has a module; pending ones do not)."""
        return self.module is not None

    def load(self) -> ModuleType:
        """The experiment's module. Raises ValueError for a pending experiment."""
        if self.module is None:
            raise ValueError(f"{self.name} is {self.pending}")
        return importlib.import_module(self.module)


_PKG = "falconext.experiments."

EXPERIMENTS: tuple[Experiment, ...] = (
    Experiment("fig12", "Fig. 12: iteration-time estimation error across parallel layouts",
               "< 1.2% (1 node), 0.7% (2 nodes), 0.1% (4 nodes)", module=_PKG + "fig12",
               takes_layouts=True),
    Experiment("table4", "Table 4: detection algorithms on computation fail-slows",
               "BOCD+V 100% accuracy, FPR 0%, FNR 0%", module=_PKG + "table4"),
    Experiment("table5", "Table 5: detection algorithms on communication fail-slows",
               "BOCD+V 99.1% accuracy, FPR 0%, FNR 2.3%", module=_PKG + "table5"),
    Experiment("fig13", "Fig. 13: S2 under weak/medium/severe compute fail-slow, DP 2, 4, 8",
               "slowdown -55.3%, -77.8%, -64.9%; up to -82.9%", module=_PKG + "fig13"),
    Experiment("fig14", "Fig. 14: S2 with 0..4 slow replicas in DP4",
               "1.9x -> 1.2x (-79.7%) with one slow replica", module=_PKG + "fig14"),
    Experiment("fig15", "Fig. 15: S3 link reassignment under congestion, PP 4 and 8, 2 nodes",
               "slowdown -53.7% (PP4), -24.8% (PP8); up to -61.5%", module=_PKG + "fig15"),
    Experiment("fig16", "Fig. 16: straggler consolidation, 4DP x 4PP, 1..3 slow links",
               "1.6x -> 1.3x, 1.7x -> 1.3x, 1.9x -> 1.7x", module=_PKG + "fig16"),
    Experiment("fig17", "Fig. 17: compound computation + communication fail-slow, escalation to S4",
               "S3, then S2, then checkpoint-restart", module=_PKG + "fig17"),
    Experiment("fig18", "Fig. 18: detector overhead across layouts",
               "0.39% mean, 1.1% max", module=_PKG + "fig18", takes_layouts=True),
    Experiment("fig19", "Fig. 19: topology-switch pause, in-memory vs disk checkpoint",
               "up to 6.72x shorter", module=_PKG + "fig19"),
    Experiment("table6", "Table 6: S2 solve time for 16..8192 DP replicas",
               "35.93 s at 512 replicas", module=_PKG + "table6"),
    Experiment("table7", "Table 7 / Fig. 20: 16DP x 4PP job, 2 comm + 8 compute fail-slows",
               "slowdown -60.1% (1.15x -> 1.05x of optimal)", module=_PKG + "table7"),
    Experiment("scale", "Control plane at scale: simulated ranks, the real Redis and controller",
               "(not in the paper; Holmes localizes in 30.3 s at 8192 GPUs)", module=_PKG + "scale"),
    Experiment("ablations", "Ablations: each component off in turn on the fig17 trace",
               "(not in the paper)", module=_PKG + "ablations"),
)

NAMES: tuple[str, ...] = tuple(e.name for e in EXPERIMENTS)


class UnknownExperiment(ValueError):
    """A name that is not in the registry."""


def lookup(name: str) -> Experiment:
    """The experiment called ``name``. Raises UnknownExperiment naming the choices."""
    for e in EXPERIMENTS:
        if e.name == name:
            return e
    raise UnknownExperiment(f"unknown experiment {name!r} (choose from {', '.join(NAMES)}, all)")
