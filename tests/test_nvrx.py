"""NVRx beside falconext (falconext/testbed/nvrx.py, examples/compare_nvrx.py): without the
``nvrx`` extra, one line says what is missing before anything starts; with it, NVRx's own
scoring names a rank whose kernels and train step are slower, from the timings the harness
feeds it (a one-process group: the report's collectives run for real)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from falconext.cli import main

ROOT = Path(__file__).resolve().parents[1]
HAVE_NVRX = importlib.util.find_spec("nvidia_resiliency_ext") is not None


@pytest.mark.skipif(HAVE_NVRX, reason="nvidia-resiliency-ext is installed here")
def test_train_with_nvrx_but_without_the_extra_is_one_line_before_anything_starts(tmp_path, capsys):
    code = main(["train", "--nproc", "2", "--iters", "5", "--nvrx-report-s", "5", "--out", str(tmp_path / "run")])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "needs nvidia-resiliency-ext" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(HAVE_NVRX, reason="nvidia-resiliency-ext is installed here")
def test_the_comparison_without_the_extra_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_nvrx.py"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "needs nvidia-resiliency-ext" in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--cases", "compute-1.5x,nope"], "unknown case 'nope'"),
    (["--iters", "70"], "--iters must be more than 80"),
])
def test_bad_comparison_input_is_one_line(tmp_path, argv, message):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_nvrx.py"), "--out", str(tmp_path / "o"),
                           *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


def test_a_bad_report_interval_is_refused(capsys, tmp_path):
    code = main(["train", "--nproc", "2", "--iters", "5", "--nvrx-report-s", "nan", "--out", str(tmp_path / "r")])
    assert code == 2 and "--nvrx-report-s must be a finite number > 0" in capsys.readouterr().err


@pytest.mark.skipif(not HAVE_NVRX, reason="needs the nvrx extra (pip install -e '.[nvrx]')")
def test_nvrx_scoring_names_the_rank_whose_kernels_are_slower(tmp_path):
    """Two steps of reports in a world of one: NVRx's relative scores need peers, so the
    check is on its individual score, which falls when the same rank's kernels and step
    slow down 2x after its first report."""
    import torch.distributed as dist

    from falconext.ports import free_port
    from falconext.testbed.nvrx import ESTIMATION_STEPS, NvrxBeside

    (tmp_path / "ranks").mkdir()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        nv = NvrxBeside(str(tmp_path), 0, 0, report_s=0.1)
        for it in range(ESTIMATION_STEPS + 20):
            slow = 2.0 if it >= ESTIMATION_STEPS + 10 else 1.0
            nv.window("forward", 0.01 * slow)
            nv.window("backward", 0.02 * slow)
            nv.step(it, 0.05 * slow)
        nv.close()
    finally:
        dist.destroy_process_group()
    assert nv.interval == 2  # 0.1 s / 0.05 s per step
    reports = [json.loads(x) for x in (tmp_path / "nvrx.jsonl").read_text().splitlines()]
    assert reports and all(r["gpu_relative"] == {"0": 1.0} for r in reports)
    assert reports[0]["stragglers"]["gpu_individual"] == []
    assert reports[-1]["gpu_individual"]["0"] == pytest.approx(0.5, abs=0.01)
    assert reports[-1]["stragglers"]["gpu_individual"] == [0]
    cost = json.loads((tmp_path / "ranks" / "nvrx-rank0.json").read_text())
    assert cost["steps"] == ESTIMATION_STEPS + 20 and cost["reports"] == len(reports) and cost["per_step_ms"] > 0


def test_several_report_intervals_reach_every_rank_as_given():
    """``--nvrx-report-s 60,5`` (one NVRx detector per interval): the launcher hands the
    ranks the list as the user wrote it (a tuple's repr once made every rank refuse it)."""
    from falconext.cli import build_parser
    from falconext.testbed.launch import rank_argv

    args = build_parser().parse_args(["train", "--nproc", "2", "--nvrx-report-s", "60,5"])
    argv = rank_argv(args)
    assert argv[argv.index("--nvrx-report-s") + 1] == "60,5"
    assert args.nvrx_report_s == (60.0, 5.0)
