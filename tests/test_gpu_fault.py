"""The GPU's compute fault (a busy kernel per iteration), the GPU settings of ``falconext
launch``, and the GPU check's behaviour where there is no GPU (this machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from falconext.elastic import rendezvous
from falconext.megatron_lm import launcher
from falconext.model.faults import Fault
from falconext.emulation.gpu_fault import BusyKernel, busy_seconds, healthy_reference

ROOT = Path(__file__).resolve().parent.parent


def test_busy_seconds_is_the_faults_extra_share_of_a_healthy_iteration() -> None:
    assert busy_seconds(2.0, 0.25) == pytest.approx(0.25)
    assert busy_seconds(1.5, 0.4) == pytest.approx(0.2)
    assert busy_seconds(1.0, 0.4) == 0.0
    assert busy_seconds(0.5, 0.4) == 0.0  # a "faster" factor adds nothing, never a negative wait


def test_healthy_reference_is_the_median_before_the_fault_without_start_up() -> None:
    loop = [(0, 2.0), (1, 0.9), (2, 0.5)] + [(i, 0.2 + 0.001 * (i % 3)) for i in range(3, 80)] + [(80, 0.4)]
    ref = healthy_reference(loop, 80)
    assert ref == pytest.approx(0.201)  # start-up iterations and the faulty one left out
    assert healthy_reference(loop, 0) is None


def test_busy_kernel_queues_factor_minus_one_healthy_iterations_only_while_the_fault_lasts() -> None:
    queued: list[int] = []
    faults = [Fault("compute", 2.0, start=10, end=12, rank=1), Fault("compute", 3.0, start=0, end=None, rank=0)]
    busy = BusyKernel(faults, process=1, sleep=queued.append, cycles_per_s=1e9)
    loop = [(i, 0.1) for i in range(10)]
    for it in range(10):
        assert busy.at(it, loop) == 0.0
    assert busy.at(10, loop) == pytest.approx(0.1)
    assert busy.at(11, loop + [(10, 0.2)]) == pytest.approx(0.1)  # the reference stays the healthy one
    assert busy.at(12, loop) == 0.0
    assert queued == [100_000_000, 100_000_000]  # 0.1 s at 1e9 cycles/s, once per faulty iteration
    assert busy.queued == {10: pytest.approx(0.1), 11: pytest.approx(0.1)}
    # another process's fault is not this one's
    other = BusyKernel(faults, process=2, sleep=queued.append, cycles_per_s=1e9)
    assert other.at(10, loop) == 0.0


def test_a_fault_from_the_first_iteration_has_nothing_to_scale_and_queues_nothing() -> None:
    queued: list[int] = []
    busy = BusyKernel([Fault("compute", 2.0, start=0, end=None, rank=0)], 0, sleep=queued.append, cycles_per_s=1e9)
    assert busy.at(0, []) == 0.0 and queued == []


def _job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cuda: bool, falcon: list[str]) -> list[str]:
    monkeypatch.setattr(launcher, "_has_cuda", lambda: cuda)
    monkeypatch.chdir(tmp_path)
    plan = launcher.split_command(["--nproc-per-node", "1", "train.py", "--calculate-per-token-loss", "--falcon",
                                   "--falcon-out", str(tmp_path / "out"), *falcon])
    return launcher._prepare(plan, rendezvous.parse(plan.torchrun)).flags


def test_launch_on_a_gpu_validates_with_a_gemm_the_gpu_cannot_hide_behind_its_launch(monkeypatch, tmp_path) -> None:
    flags = _job(monkeypatch, tmp_path, True, [])
    assert flags[flags.index("--falcon-gemm-size") + 1] == str(launcher.CUDA_GEMM_SIZE)
    given = _job(monkeypatch, tmp_path, True, ["--falcon-gemm-size", "1024"])
    assert [given[i + 1] for i, a in enumerate(given) if a == "--falcon-gemm-size"] == ["1024"]
    cpu = _job(monkeypatch, tmp_path, False, [])
    assert "--falcon-gemm-size" not in cpu  # the emulated device keeps the config's


def test_gpu_check_without_a_gpu_says_so_in_one_line_and_exits_0() -> None:
    proc = subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh")], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "HOME": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and "no GPU" in lines[0], proc.stdout
    assert "prerequisites" in lines[0]
    assert proc.stderr.strip() == ""  # megatron-core's import warnings without a GPU: not printed (issue 52)


def test_gpu_check_finds_the_release_of_the_installed_megatron_core_in_the_shared_archives(tmp_path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "launch" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    for name in ("Megatron-LM-core_v0.16.1.tar.gz", "Megatron-LM-core_v0.19.0.tar.gz"):
        (tmp_path / name).write_bytes(b"")
    assert gpu_check.default_archive("0.16.1", tmp_path) == tmp_path / "Megatron-LM-core_v0.16.1.tar.gz"
    assert gpu_check.default_archive("0.19.2", tmp_path) == tmp_path / "Megatron-LM-core_v0.19.0.tar.gz"
    assert gpu_check.default_archive("0.17.0", tmp_path) is None
    assert gpu_check.SHARED_ARCHIVES == ROOT.parent / "shared" / "megatron-lm"
