"""The GPU check: falconext inside real Megatron-LM on one CUDA device (``launch/gpu_check.sh``).

One short job: Megatron-LM's own ``pretrain_gpt.py`` (world size 1, NCCL, a small GPT) under
``falconext launch --falcon``, with a 2x compute fault on the GPU from an iteration on (a busy
kernel on the rank's stream, :mod:`falconext.emulation.gpu_fault`). Checked from the run's own
files (events.jsonl, summary.json, the calls file) and Megatron's log:

- the collective hooks sit on NCCL groups (``tracking_started``: backend nccl, calls traced);
- iteration times are taken with CUDA events and the estimates from the calls agree with the
  loop's iteration times within 2% (median), and the loop's with Megatron's own log;
- the detector reports the injected slowdown (``fail_slow``, onset near the fault's start);
- the suspension's GEMM validation ran on the device (``localized`` evidence, GFLOP/s);
- pynvml readings of the GPU reach the events (``localized`` evidence ``health``).

What needs two GPUs (NCCL refuses two ranks on one device) is listed as not run.
Without a CUDA device it checks its prerequisites, prints one line saying "no GPU" and
exits 0. ``--cpu-rehearsal`` runs the same job on CPU with the emulated device, so the script
itself can be exercised where there is no GPU (its GPU rows then say so).
Prints one table; writes it, with the run's events and summary, under ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's falconext, installed or not
#: the fault: rank 0's GPU twice as slow from this iteration on
FAULT_START = 80
FACTOR = 2.0
ITERATIONS = 200
#: a small GPT that keeps a GPU busy for some milliseconds per micro-batch
GPT = (
    "--num-layers 4 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 "
    "--micro-batch-size 4 --global-batch-size 32 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 8192 --eval-iters 0 --eval-interval 100000 --calculate-per-token-loss --attention-dropout 0 "
    "--hidden-dropout 0 --split 100,0,0 --bf16 --transformer-impl local --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-bias-swiglu-fusion --no-rope-fusion "
    "--no-persist-layer-norm"
).split()
#: on CPU (the rehearsal) the test suite's tiny GPT
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 1 --global-batch-size 8 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 1024 --eval-iters 0 --eval-interval 100000 --calculate-per-token-loss --attention-dropout 0 "
    "--hidden-dropout 0 --use-cpu-initialization --split 100,0,0"
).split()
MEGATRON_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")
NEEDS_TWO_GPUS = [
    ("S2 across DP replicas on NCCL (exact losses)", "two ranks: NCCL refuses two ranks on one device"),
    ("link validation (send/recv passes over NCCL)", "two ranks on two devices"),
    ("S3 restart (CUDA_VISIBLE_DEVICES re-mapped)", "two GPUs to re-map"),
]


class Table:
    """The check's rows: (check, result, detail)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def add(self, check: str, ok: bool | None, detail: str) -> None:
        self.rows.append((check, {True: "ok", False: "FAIL", None: "not run"}[ok], detail))

    def failed(self) -> bool:
        return any(r[1] == "FAIL" for r in self.rows)

    def text(self, title: str) -> str:
        out = [title, "", "| check | result | detail |", "|---|---|---|"]
        out += [f"| {c} | {r} | {d} |" for c, r, d in self.rows]
        return "\n".join(out) + "\n"


def prerequisites() -> list[str]:
    """What this check needs and lacks: Python modules, programs. Quiet: what the modules
    say as they import (megatron-core's warnings without a GPU) is not printed."""
    missing = []
    for mod in ("torch", "falconext", "megatron.core", "cvxpy", "redis", "pynvml", "numpy", "scipy"):
        try:
            with quiet():
                importlib.import_module(mod)
        except Exception as exc:  # noqa: BLE001 (any import failure is a missing prerequisite)
            missing.append(f"{mod} ({type(exc).__name__})")
    for prog in ("redis-server",):
        if shutil.which(prog) is None:
            missing.append(prog)
    return missing


@contextlib.contextmanager
def quiet():
    """Python's warnings, logging and both output streams (file descriptors 1 and 2, so a
    C extension's prints too) silenced for the block."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.CRITICAL)
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for fd in saved:
                    os.close(fd)
                logging.disable(logging.NOTSET)


#: the release each installed megatron-core series runs (falconext's hook points are checked on it)
RELEASE_OF_SERIES = {"0.16": "core_v0.16.1", "0.19": "core_v0.19.0"}
#: where the project's machines keep the Megatron-LM archives (beside the repository)
SHARED_ARCHIVES = Path(__file__).resolve().parents[1].parent / "shared" / "megatron-lm"


def default_archive(core_version: str, shared: Path = SHARED_ARCHIVES) -> Path | None:
    """The archive in ``shared`` of the release that matches megatron-core ``core_version``
    (``Megatron-LM-core_v0.16.1.tar.gz`` for 0.16.x), or None."""
    release = RELEASE_OF_SERIES.get(".".join(core_version.split(".")[:2]))
    path = shared / f"Megatron-LM-{release}.tar.gz" if release else None
    return path if path is not None and path.is_file() else None


def megatron_lm(scratch: Path) -> Path:
    """A Megatron-LM tree: ``MEGATRON_LM_PATH``, else the archive ``MEGATRON_LM_ARCHIVE`` (a
    Megatron-LM release tarball), else the release of the installed megatron-core's series
    in ``../shared/megatron-lm``, extracted into ``scratch``."""
    path = os.environ.get("MEGATRON_LM_PATH")
    if path:
        return Path(path)
    archive = Path(os.environ.get("MEGATRON_LM_ARCHIVE", ""))
    if not archive.is_file():
        from importlib.metadata import version as installed

        found = default_archive(installed("megatron-core"))
        if found is None:
            raise SystemExit(f"gpu_check: no Megatron-LM: set MEGATRON_LM_PATH (a tree of the installed megatron-core's "
                             f"release) or MEGATRON_LM_ARCHIVE (its tarball); {str(archive) or 'neither'} is set, and "
                             f"{SHARED_ARCHIVES} has none")
        archive = found
    dest = scratch / "megatron-lm"
    dest.mkdir()
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/", 1)
            if len(parts) == 2 and parts[1]:
                m.name = parts[1]
                members.append(m)
        tar.extractall(dest, members=members, filter="data")
    return dest


def run_job(mlm: Path, out: Path, cpu: bool, timeout: float) -> tuple[int, str, float]:
    """``falconext launch`` of ``pretrain_gpt.py`` with the fault; (exit status, output, seconds)."""
    fault = out.parent / "fault.json"
    fault.write_text(json.dumps([{"kind": "compute", "rank": 0, "factor": FACTOR, "start": FAULT_START}]))
    args = (TINY if cpu else GPT) + ["--train-iters", str(ITERATIONS), "--log-interval", "10"]
    falcon = ["--falcon", "--falcon-out", str(out), "--falcon-inject", str(fault), "--falcon-mitigation", "false"]
    if not cpu:
        falcon += ["--falcon-device", "cuda"]
    cmd = [sys.executable, "-m", "falconext.cli", "launch", "--nproc-per-node", "1", str(mlm / "pretrain_gpt.py"),
           *args, *falcon]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=out.parent, env=env)
        return proc.returncode, proc.stdout + proc.stderr, time.time() - t0
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return 124, text + f"\ngpu_check: the job ran past {timeout:.0f} s", time.time() - t0


def read_events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def loop_times(out: Path) -> dict[int, float]:
    """The loop hooks' iteration times by iteration (iterations.csv: rank, iteration, seconds, loss)."""
    path = out / "iterations.csv"
    times: dict[int, float] = {}
    if not path.is_file():
        return times
    for line in path.read_text().splitlines()[1:]:
        cells = line.split(",")
        try:
            times[int(cells[1])] = float(cells[2])
        except (ValueError, IndexError):
            continue
    return times


def check(out: Path, output: str, rc: int, cpu: bool, table: Table) -> None:
    """Fill ``table`` from the run's files and log."""
    evs = read_events(out)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    table.add("Megatron-LM pretrain_gpt.py ran", rc == 0, f"exit {rc}, {summary.get('iterations', 0)} iterations")
    started = next((e for e in evs if e.get("type") == "tracking_started"), {})
    calls = out / "calls" / "rank0.jsonl"
    n_calls = sum(1 for _ in calls.open()) if calls.is_file() else 0
    groups = set()
    if calls.is_file():
        with calls.open() as f:
            for line in f:
                groups.add(json.loads(line).get("group"))
    want_backend = "gloo" if cpu else "nccl"
    table.add("collective hooks on the job's groups", started.get("backend") == want_backend and n_calls > 0,
              f"backend {started.get('backend')}, {n_calls} calls traced on {len(groups)} groups")
    timing = started.get("timing")
    est = summary.get("estimates") or {}
    err = est.get("median_rel_error")
    table.add("iteration times from CUDA events" if not cpu else "iteration times from the calls (host clock)",
              (timing == ("host" if cpu else "cuda_events")) and err is not None and err <= 0.02,
              f"timing {timing}; estimates for {est.get('count')} iterations, median error {err} against the loop's")
    loops = loop_times(out)
    logged = {int(m.group(1)): float(m.group(2)) / 1e3 for m in MEGATRON_ITER.finditer(output)}
    ratios = []
    for it, ms in logged.items():  # Megatron's "iteration N" line: the loop's iterations N-10 .. N-1
        window = [loops[i] for i in range(it - 10, it) if i in loops]
        if it > 10 and len(window) >= 8:
            ratios.append(statistics.mean(window) / ms)
    dev = max((abs(r - 1) for r in ratios), default=None)
    table.add("loop times match Megatron's log", dev is not None and dev <= 0.02,
              f"{len(ratios)} log intervals, largest deviation {dev if dev is None else round(dev, 4)}")
    healthy, slow = summary.get("healthy_iter_s"), summary.get("slow_iter_s")
    ratio = round(slow / healthy, 3) if healthy and slow else None
    table.add("injected slowdown stretches the iterations", ratio is not None and 1.6 <= ratio <= 2.4,
              f"healthy {healthy} s, slow {slow} s: {ratio}x (fault {FACTOR}x from {FAULT_START})")
    fails = [e for e in evs if e.get("type") == "fail_slow"]
    first = min(fails, key=lambda e: e.get("detected_at", 1e9)) if fails else None
    early = [e for e in fails if (e.get("onset") or 0) < FAULT_START - 5]
    table.add("the detector reports it", first is not None and not early
              and abs(first.get("onset", -99) - FAULT_START) <= 5 and first.get("detected_at", 1e9) - FAULT_START <= 15,
              f"onset {first.get('onset')}, detected at {first.get('detected_at')}" if first else "no fail_slow event")
    loc = next((e for e in evs if e.get("type") == "localized"), None)
    evidence = (loc or {}).get("evidence") or {}
    gflops = (evidence.get("gemm_gflops") or {}).get("0")
    table.add("GEMM validation on the device", gflops is not None and (cpu or gflops > 1000),
              f"localized {loc.get('gpus') if loc else None}, rank 0 GEMM {gflops} GFLOP/s")
    health = (evidence.get("health") or {}).get("0") or []
    names = sorted({g.get("name") for g in health if isinstance(g, dict)})
    table.add("pynvml readings in the events", None if cpu else bool(health),
              "CPU rehearsal: no GPU to read" if cpu else f"{len(health)} GPU(s): {', '.join(map(str, names))}; "
              + (json.dumps(health[0])[:160] if health else ""))
    for name, why in NEEDS_TWO_GPUS:
        table.add(name, None, f"needs {why}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-rehearsal", action="store_true", help="run the same job on CPU (emulated device)")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds the job may take (default 420)")
    args = parser.parse_args(argv)
    missing = prerequisites()
    with quiet():
        import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_rehearsal:
        print(f"gpu_check: no GPU (torch {torch.__version__} sees no CUDA device): nothing run; prerequisites "
              + (f"missing: {', '.join(missing)}" if missing else "all present"))
        return 0
    if missing:
        print(f"gpu_check: missing prerequisites: {', '.join(missing)}", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name(0) if cuda and not args.cpu_rehearsal else "CPU (rehearsal, emulated device)"
    table = Table()
    with tempfile.TemporaryDirectory(prefix="falconext-gpu-check-") as tmp:
        scratch = Path(tmp)
        mlm = megatron_lm(scratch)
        out = scratch / "run" / "falcon-out"
        out.parent.mkdir()
        rc, output, seconds = run_job(mlm, out, args.cpu_rehearsal, args.timeout)
        check(out, output, rc, args.cpu_rehearsal, table)
        from falconext.megatron_lm.patching import megatron_version

        title = (f"falconext GPU check: {device}, torch {torch.__version__}, Python {sys.version.split()[0]}, "
                 f"Megatron-LM {megatron_version(str(mlm))}, {datetime.date.today().isoformat()}, job {seconds:.0f} s")
        text = table.text(title)
        print(text)
        dest = os.environ.get("OUT")
        if dest:
            Path(dest).mkdir(parents=True, exist_ok=True)
            (Path(dest) / "gpu_check.md").write_text(text)
            (Path(dest) / "megatron.log").write_text(output[-400_000:])
            for name in ("events.jsonl", "summary.json", "iterations.csv", "estimates.csv"):
                if (out / name).is_file():
                    shutil.copy(out / name, Path(dest) / name)
        if table.failed():
            print("gpu_check: FAILED; the job's last lines:\n" + output[-3000:])
    return 1 if table.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
