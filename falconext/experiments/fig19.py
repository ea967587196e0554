"""Fig. 19: the pause of a topology switch, state handed over in memory vs through disk.

Each model size runs as ``falconext train`` jobs (1T2D2P) forced to switch topology at
iteration ``SWITCH_AT`` (``--falcon-force-topology``): roles 2,3,0,1, so every process
takes over the other pipeline stage and its whole state (model, optimizer, RNG: the
payload of an S4 shard) moves in memory over the existing world group, then groups,
model and optimizer are rebuilt. The job records the pause of the slowest process and
its phases (serialize, transfer, regroup, rebuild, load). Each size runs twice: on one
virtual node (the hand-over crosses the emulated 2 GB/s intra-node links) and on two
(it crosses the emulated 50 MB/s inter-node links, the test bed's default network).

The disk baseline is measured here, outside the job, on the same file system the job
used: a state of the same size as the hand-over payload (float32 tensors of at most 4 MB
each) is written with ``torch.save`` and ``fsync``, dropped from the page cache and read
back with ``torch.load(weights_only=True)``, ``DISK_REPEATS`` times (median). Two
baselines are reported:

* **D (disk hand-over)**, the paper's baseline: the same switch with the state moved
  through disk, i.e. the measured regroup + rebuild phases plus the disk save and load
  (M's own load phase, which also applies the state to the rebuilt model, is left out:
  D is, if anything, underestimated);
* **checkpoint-restart** (falconext's S4 way): disk save + a new process's start-up to
  its first iteration (measured in the job) + disk load.

What differs from the paper: the paper varied GPU memory use of real jobs (GBs per GPU,
NVMe or network disks); here the states are megabytes to a few hundred megabytes per
rank, on a 2-core VM's virtual disk, and the in-memory transfer is gloo over loopback,
not NVLink or InfiniBand; on two nodes the test bed's 50 MB/s network (slowed, as its
devices are, so that communication keeps a GPU cluster's share of an iteration) is much
slower than the VM's real disk, which nothing slows.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from falconext.experiments.result import Comparison, ExperimentResult, Row
from falconext.experiments.training import Job, JobResult, jobs_folder, run_job

SWITCH_AT = 5
#: the forced switch: each process takes over the other pipeline stage (1T2D2P)
ROLES = "2,3,0,1"
DISK_REPEATS = 3
#: the largest tensor of the stand-in state, in float32 elements (4 MB)
CHUNK_ELEMENTS = 1 << 20
PAPER_MAX_RATIO = 6.72
#: each size runs on one virtual node and on two
NODES = (1, 2)


@dataclass(frozen=True)
class ModelSize:
    """The test bed's GPT at one size: hidden width, layers, attention heads."""

    hidden: int
    layers: int
    heads: int = 4

    def __post_init__(self) -> None:
        for k in ("hidden", "layers", "heads"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"model {k} = {v!r}: expected a positive integer")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.layers % 2:
            raise ValueError(f"layers {self.layers}: must split into the 2 pipeline stages")

    @property
    def label(self) -> str:
        """e.g. h256-L8."""
        return f"h{self.hidden}-L{self.layers}"

    def device_gflops(self) -> float:
        """Emulated device speed: the default 2 GFLOP/s for the default model, faster for
        larger ones so a job's device time stays small (this experiment times the switch,
        not iterations; larger models run at the host's CPU speed)."""
        return 2.0 * max(1.0, (self.hidden / 64) ** 2 * self.layers / 4)


QUICK_SIZES = (ModelSize(64, 4), ModelSize(256, 4))
FULL_SIZES = (ModelSize(64, 4), ModelSize(256, 8), ModelSize(512, 8), ModelSize(1024, 4))


def switch_job(size: ModelSize, nodes: int = 2) -> Job:
    """The 1T2D2P job of ``size`` on ``nodes`` virtual nodes (1 or 2) that switches roles
    at ``SWITCH_AT`` and stops right after."""
    if nodes not in (1, 2):
        raise ValueError(f"nodes = {nodes!r}: 1T2D2P runs on 1 or 2 virtual nodes")
    return Job(f"{size.label}-{nodes}n", (
        "--iters", str(SWITCH_AT + 1), "--tp", "1", "--pp", "2", "--ranks-per-node", str(4 // nodes),
        "--global-batch-size", "8", "--micro-batch-size", "1",
        "--hidden", str(size.hidden), "--layers", str(size.layers), "--heads", str(size.heads),
        "--device-gflops", f"{size.device_gflops():g}",
        "--falcon-force-topology", f"{SWITCH_AT}:{ROLES}",
    ), nproc=4)


def forced_switch(summary: dict[str, Any]) -> dict[str, Any]:
    """The forced (not probe) switch of a job's summary. Raises ValueError if there is none."""
    found = [s for s in (summary.get("mitigation") or {}).get("switches", []) if not s.get("probe")]
    if not found:
        raise ValueError("the job made no forced topology switch (see its events.jsonl for 'topology not applied')")
    return found[0]


def handover_bytes(events: list[dict[str, Any]]) -> int:
    """The largest payload one process sent in the forced switch (its role's whole state)."""
    sent = [int(e.get("sent_bytes", 0)) for e in events
            if e.get("type") == "topology_switch" and not e.get("probe")]
    if not sent or max(sent) <= 0:
        raise ValueError("no forced topology_switch event with sent_bytes")
    return max(sent)


def startup_s(events: list[dict[str, Any]]) -> float | None:
    """The slowest process's start-up to its first iteration (restart_probe events)."""
    found = [float(e["startup_s"]) for e in events if e.get("type") == "restart_probe" and e.get("startup_s")]
    return max(found) if found else None


def stand_in_state(nbytes: int) -> dict[str, Any]:
    """A state of ``nbytes`` in float32 tensors of at most ``CHUNK_ELEMENTS`` elements."""
    import torch  # lazy: start-up time (torch only for the disk baseline)

    if nbytes < 4:
        raise ValueError(f"nbytes = {nbytes}: too small for a state")
    elements, tensors = nbytes // 4, {}
    i = 0
    while elements > 0:
        n = min(elements, CHUNK_ELEMENTS)
        tensors[f"t{i}"] = torch.randn(n)
        elements -= n
        i += 1
    return {"model": tensors}


def disk_roundtrip(nbytes: int, directory: Path, repeats: int = DISK_REPEATS,
                   clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """(save s, load s), medians over ``repeats``: a state of ``nbytes`` written with
    torch.save and fsync, dropped from the page cache, read back with torch.load."""
    import torch  # lazy: start-up time (torch only for the disk baseline)

    state = stand_in_state(nbytes)
    path = directory / f"disk-baseline-{nbytes}.pt"
    saves, loads = [], []
    try:
        for _ in range(repeats):
            t0 = clock()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            saves.append(clock() - t0)
            with open(path, "rb") as f:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                t0 = clock()
                torch.load(f, map_location="cpu", weights_only=True)
                loads.append(clock() - t0)
    finally:
        path.unlink(missing_ok=True)
    return statistics.median(saves), statistics.median(loads)


def _rate(nbytes: int, seconds: Any) -> float | str:
    return round(nbytes / 1e6 / float(seconds), 1) if seconds else ""


def rates_note(rows: list[Row]) -> str:
    """One line: the mean regroup phase, and how fast the state moved in memory (per node
    count) and through disk, which together decide D / M."""
    if not rows:
        raise ValueError("no model sizes measured")
    regroup = statistics.fmean(float(r["m_regroup_s"] or 0) for r in rows)
    parts = []
    for n in sorted({r["nodes"] for r in rows}):
        rates = [r["transfer_mb_s"] for r in rows if r["nodes"] == n and r["transfer_mb_s"] != ""]
        if rates:
            parts.append(f"{min(rates):.0f}-{max(rates):.0f} MB/s on {n} node(s)")
    write = [r["disk_write_mb_s"] for r in rows if r["disk_write_mb_s"] != ""]
    read = [r["disk_read_mb_s"] for r in rows if r["disk_read_mb_s"] != ""]
    disk = f"; disk: write {min(write):.0f}-{max(write):.0f} MB/s, read {min(read):.0f}-{max(read):.0f} MB/s" \
        if write and read else ""
    return (f"Regroup (re-creating the process groups) takes {regroup:.3f} s on average in every switch, whatever the "
            f"size; the in-memory hand-over moved {', '.join(parts) or 'no state'}{disk}.")


def switch_row(size: ModelSize, switch: dict[str, Any], payload_bytes: int, disk_save_s: float, disk_load_s: float,
               start_s: float | None, folder: str = "", nodes: int = 2) -> Row:
    """One results.csv row: the in-memory switch (M) and its phases, the disk hand-over (D)
    and checkpoint-restart built from the measured disk times, and their ratios to M."""
    phases = switch.get("phases_s") or {}
    pause = float(switch["pause_s"])
    if pause <= 0:
        raise ValueError(f"{size.label}: switch pause {pause} s")
    d = float(phases.get("regroup_s") or 0) + float(phases.get("rebuild_s") or 0) + disk_save_s + disk_load_s
    restart = disk_save_s + start_s + disk_load_s if start_s is not None else None
    return {
        "model": size.label, "nodes": nodes, "hidden": size.hidden, "layers": size.layers,
        "state_mb": round(payload_bytes / 1e6, 2),
        "m_pause_s": round(pause, 4),
        **{f"m_{k}": phases.get(k) for k in ("serialize_s", "transfer_s", "regroup_s", "rebuild_s", "load_s")},
        "disk_save_s": round(disk_save_s, 4), "disk_load_s": round(disk_load_s, 4),
        "d_pause_s": round(d, 4), "d_over_m": round(d / pause, 2),
        "startup_s": round(start_s, 3) if start_s is not None else "",
        "restart_s": round(restart, 3) if restart is not None else "",
        "restart_over_m": round(restart / pause, 2) if restart is not None else "",
        "transfer_mb_s": _rate(payload_bytes, phases.get("transfer_s")),
        "disk_write_mb_s": _rate(payload_bytes, disk_save_s), "disk_read_mb_s": _rate(payload_bytes, disk_load_s),
        "job_estimate_restart_s": switch.get("disk_restart_s", ""),
        "job": folder,
    }


def comparisons(rows: list[Row]) -> list[Comparison]:
    """Per size: M's pause beside the paper's "under a minute", and D / M and
    checkpoint-restart / M beside its "up to 6.72x"."""
    if not rows:
        raise ValueError("no model sizes measured")
    out = []
    for r in rows:
        restart = f"; restart {r['restart_s']:.2f} s ({r['restart_over_m']:.2f}x)" if r["restart_s"] != "" else ""
        out.append(Comparison(f"{r['model']}, {r['nodes']} node(s) ({r['state_mb']:.1f} MB/rank)",
                              "M < 1 min; D up to 6.72x M",
                              f"M {r['m_pause_s']:.3f} s; D {r['d_pause_s']:.3f} s ({r['d_over_m']:.2f}x){restart}",
                              f"disk save {r['disk_save_s']:.3f} s + load {r['disk_load_s']:.3f} s"))
    best = max(rows, key=lambda r: r["d_over_m"])
    out.append(Comparison("largest D / M", f"{PAPER_MAX_RATIO}x",
                          f"{best['d_over_m']:.2f}x ({best['model']}, {best['nodes']} node(s))",
                          "the paper's gain grows with memory use; see the rows"))
    return out


def measure(quick: bool) -> ExperimentResult:
    """Forced-switch jobs per model size on 1 and 2 virtual nodes (quick: h64-L4 and
    h256-L4; full: h64-L4, h256-L8, h512-L8, h1024-L4), each followed by the disk round trip of a
    state the size of its hand-over."""
    base = jobs_folder("fig19")
    rows = []
    for size in QUICK_SIZES if quick else FULL_SIZES:
        for nodes in NODES:
            res: JobResult = run_job(switch_job(size, nodes), base)
            nbytes = handover_bytes(res.events)
            save_s, load_s = disk_roundtrip(nbytes, base)
            rows.append(switch_row(size, forced_switch(res.summary), nbytes, save_s, load_s, startup_s(res.events),
                                   str(res.out), nodes))
    notes = [
        f"M: measured pause of the slowest process in a forced switch (roles {ROLES} at iteration {SWITCH_AT}, "
        "1T2D2P, every process takes over the other stage's state), with its phases; on 1 virtual node the "
        "state crosses the emulated 2 GB/s intra-node links, on 2 the emulated 50 MB/s network.",
        f"D: M's regroup + rebuild phases plus a real disk save (torch.save + fsync) and cold load (page cache "
        f"dropped, torch.load) of a state the size of the hand-over payload, median of {DISK_REPEATS}, on the "
        "jobs' file system; one rank's shard alone (ranks saving at once on one disk would take longer).",
        "restart: disk save + the job's measured process start-up to the first iteration + disk load "
        "(S4's checkpoint-restart); job_estimate_restart_s is the job's own start-up probe estimate.",
        rates_note(rows),
        "The paper varied GPU memory use (GBs per GPU); here states are MBs to hundreds of MBs per rank on a "
        "2-core VM's virtual disk, and the in-memory transfer is gloo over loopback.",
        f"Jobs kept under {base}.",
    ]
    return ExperimentResult(rows, comparisons(rows), notes, {"jobs": str(base)})


def draw(result: ExperimentResult, path: str) -> None:
    """Stacked bars per model size, M (memory) beside D (disk) and checkpoint-restart,
    broken down into phases as the paper's Fig. 19."""
    import matplotlib.pyplot as plt  # lazy: run-time order (after the runner's matplotlib.use("Agg"))

    rows = result.rows
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6.4, 1.6 * len(rows) + 2), 4.2))
    w = 0.27
    colours = {"dump": "tab:blue", "load": "tab:orange", "regroup": "tab:green", "rebuild": "tab:red",
               "start-up": "tab:grey"}
    used: set[str] = set()

    def stack(xs: float, parts: list[tuple[str, float]]) -> None:
        bottom = 0.0
        for name, v in parts:
            ax.bar(xs, v, w, bottom=bottom, color=colours[name], label=None if name in used else name)
            used.add(name)
            bottom += v

    for i, r in enumerate(rows):
        g = lambda k: float(r.get(k) or 0.0)  # noqa: E731
        stack(i - w, [("dump", g("m_serialize_s") + g("m_transfer_s")), ("load", g("m_load_s")),
                      ("regroup", g("m_regroup_s")), ("rebuild", g("m_rebuild_s"))])
        stack(i, [("dump", g("disk_save_s")), ("load", g("disk_load_s")), ("regroup", g("m_regroup_s")),
                  ("rebuild", g("m_rebuild_s"))])
        ax.annotate(f"{r['d_over_m']:.1f}x", (i, g("d_pause_s")), ha="center", va="bottom", fontsize=8)
        if r["restart_s"] != "":
            stack(i + w, [("dump", g("disk_save_s")), ("start-up", g("startup_s")), ("load", g("disk_load_s"))])
    ticks = []
    for i, r in enumerate(rows):
        ticks += [(i - w, "M"), (i, "D"), (i + w, "R")]
    ax.set_xticks([t for t, _ in ticks], [s for _, s in ticks], fontsize=7)
    for i, r in enumerate(rows):
        ax.text(i, -0.12, f"{r['model']}, {r['nodes']}n\n{r['state_mb']:.0f} MB/rank",
                transform=ax.get_xaxis_transform(), ha="center", va="top", fontsize=8)
    ax.set_yscale("log", nonpositive="clip")
    smallest = min((float(r.get(k) or 0) for r in rows for k in ("m_regroup_s", "m_rebuild_s", "disk_load_s")
                    if float(r.get(k) or 0) > 0), default=1e-3)
    ax.set_ylim(bottom=smallest / 2)
    ax.set_ylabel("pause (s), log scale")
    ax.set_title("Fig. 19: switch pause, M: memory, D: disk hand-over, R: checkpoint-restart")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
