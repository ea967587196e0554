"""falconext's patch on a real Megatron-LM checkout (a copy of it): check, apply, check.

Skipped unless ``MEGATRON_LM_PATH`` (and/or ``MEGATRON_LM_019_PATH``, a core_v0.19
checkout) names a checkout. After ``apply`` the patched files must compile and hold each
hook call in the function it belongs to, in the order ``train()`` runs them.
"""

from __future__ import annotations

import ast
import os
import py_compile
import shutil
from pathlib import Path

import pytest

from falconext.cli import main
from falconext.megatron_lm.patching import SUPPORTED, megatron_version, patch_name_for

PATCHED_FILES = (
    "megatron/training/arguments.py",
    "megatron/training/training.py",
    "megatron/training/datasets/data_samplers.py",
)
#: environment variable -> the shipped patch its checkout must use (None: any supported)
CHECKOUTS = {"MEGATRON_LM_PATH": None, "MEGATRON_LM_019_PATH": "core_v0.19.0"}


@pytest.fixture(params=sorted(CHECKOUTS))
def checkout(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, str | None]:
    """A copy of the checkout the parameter's variable names (without .git), and the patch
    it must use."""
    source = os.environ.get(request.param)
    if not source:
        pytest.skip(f"{request.param} is not set")
    if not Path(source, "megatron", "core", "package_info.py").is_file():
        pytest.fail(f"{request.param}={source} is not a Megatron-LM checkout")
    tree = tmp_path / "Megatron-LM"
    shutil.copytree(source, tree, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    return tree, CHECKOUTS[request.param]


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """stdout of a ``falconext`` command that must succeed silently on stderr."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert (code, err) == (0, ""), err
    assert out.count("\n") == 1
    return out


def calls_in(path: Path, function: str) -> dict[str, int]:
    """``name`` -> first line where ``function`` (a top-level def) calls ``x.name(...)`` or ``name(...)``."""
    module = ast.parse(path.read_text(), str(path))
    (fn,) = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == function]
    found: dict[str, int] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name is not None and (name not in found or node.lineno < found[name]):
                found[name] = node.lineno
    return found


def test_check_apply_check(checkout: tuple[Path, str | None], capsys: pytest.CaptureFixture[str]) -> None:
    tree, expected_patch = checkout
    version = megatron_version(tree)
    used = patch_name_for(version)
    assert used in SUPPORTED
    if expected_patch is not None:
        assert used == expected_patch
    before = {rel: (tree / rel).read_text() for rel in PATCHED_FILES}

    out = cli(capsys, "megatron-patch", "check", str(tree))
    assert out.startswith(f"{version}: patch applies cleanly (") and f"{used}.patch" in out
    assert {rel: (tree / rel).read_text() for rel in PATCHED_FILES} == before

    out = cli(capsys, "megatron-patch", "apply", str(tree))
    assert out.startswith(f"{version}: patch applied (")
    for rel in PATCHED_FILES:
        assert (tree / rel).read_text() != before[rel], f"{rel} unchanged"
        py_compile.compile(str(tree / rel), cfile=str(tree / (rel + "c")), doraise=True)

    out = cli(capsys, "megatron-patch", "check", str(tree))
    assert out.startswith(f"{version}: patch already applied (")
    out = cli(capsys, "megatron-patch", "apply", str(tree))
    assert out.startswith(f"{version}: patch already applied (")

    training = tree / "megatron/training/training.py"
    pretrain = calls_in(training, "pretrain")
    assert pretrain["initialize_megatron"] < pretrain["on_initialized"]
    train = calls_in(training, "train")
    assert train["get_forward_backward_func"] < train["forward_backward"] < train["train_step"]
    assert train["on_training_step_start"] < train["loop_start"] < train["train_step"]
    assert train["train_step"] < train["on_training_step_end"] < train["loop_end"]
    assert "forward_backward" not in calls_in(training, "evaluate")
    assert "add_arguments" in calls_in(tree / "megatron/training/arguments.py", "parse_args")
    loader = calls_in(tree / "megatron/training/datasets/data_samplers.py", "build_pretraining_data_loader")
    assert loader["MegatronPretrainingSampler"] < loader["train_sampler"] < loader["DataLoader"]
