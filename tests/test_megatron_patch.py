"""falconext's Megatron-LM patches and ``falconext megatron-patch``, without Megatron-LM.

The shipped patch files are checked as diffs (which files, only added lines, hunk counts
that add up, the hook calls falconext implements). The check/apply flow runs on fake
checkouts: one holding exactly the lines each hunk expects (rebuilt from the patch
itself), so ``git apply`` really applies, and one whose files lack them.
"""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from falconext.cli import main
from falconext.megatron_lm.patching import (
    SUPPORTED,
    PatchError,
    first_failing_file,
    megatron_version,
    parse_version,
    patch_for,
    patch_name_for,
)

PATCHED_FILES = {
    "megatron/training/arguments.py",
    "megatron/training/training.py",
    "megatron/training/datasets/data_samplers.py",
}
#: hook -> number of parameters the patched Megatron-LM passes it
HOOK_CALLS = {
    "add_arguments": 1,
    "on_initialized": 1,
    "forward_backward": 1,
    "loop_start": 1,
    "loop_end": 0,
    "train_sampler": 2,
}
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


# --- helpers ---------------------------------------------------------------------------


def package_info(major: int, minor: int, patch: int, pre: str = "") -> str:
    return f"MAJOR = {major}\nMINOR = {minor}\nPATCH = {patch}\nPRE_RELEASE = {pre!r}\n"


def fake_tree(root: Path, version_text: str, files: dict[str, str] | None = None) -> Path:
    """A directory with megatron/core/package_info.py holding ``version_text``, plus ``files``."""
    info = root / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text(version_text)
    for rel, text in (files or {}).items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def file_diffs(patch_text: str) -> dict[str, list[list[str]]]:
    """``b/`` path -> its hunks (body lines with their ' ', '+', '-' prefix)."""
    diffs: dict[str, list[list[str]]] = {}
    current: list[list[str]] | None = None
    for line in patch_text.splitlines():
        if line.startswith("+++ "):
            assert line.startswith("+++ b/"), line
            current = diffs.setdefault(line[len("+++ b/"):], [])
        elif line.startswith("@@ "):
            assert current is not None, "hunk before any +++ header"
            current.append([line])
        elif current and line[:1] in (" ", "+", "-") and not line.startswith("--- "):
            current[-1].append(line)
    return diffs


def preimages(patch_text: str) -> dict[str, str]:
    """Each patched file as just the lines its hunks expect (context and removed lines),
    hunk after hunk: ``git apply`` finds every hunk there, at an offset."""
    return {
        path: "".join(line[1:] + "\n" for hunk in hunks for line in hunk[1:] if line[0] in " -")
        for path, hunks in file_diffs(patch_text).items()
    }


def added_lines(patch_text: str) -> list[str]:
    return [line[1:] for hunks in file_diffs(patch_text).values() for h in hunks for line in h[1:] if line[0] == "+"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- versions --------------------------------------------------------------------------


def test_version_is_read_from_package_info(tmp_path: Path) -> None:
    assert megatron_version(fake_tree(tmp_path, package_info(0, 16, 1))) == "core_v0.16.1"


def test_pre_release_is_appended() -> None:
    assert parse_version(package_info(0, 19, 0, "rc2")) == "core_v0.19.0rc2"


def test_package_info_is_parsed_not_run(tmp_path: Path) -> None:
    text = "raise SystemExit('imported!')\n" + package_info(0, 19, 0) + "import does_not_exist\n"
    assert megatron_version(fake_tree(tmp_path, text)) == "core_v0.19.0"


def test_missing_package_info_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(PatchError) as err:
        megatron_version(tmp_path)
    assert str(err.value) == f"{tmp_path} is not a Megatron-LM checkout: no megatron/core/package_info.py"


@pytest.mark.parametrize(
    "text, names",
    [
        ("MAJOR = 0\nMINOR = (\n", "not valid Python"),
        ("MAJOR = 0\nMINOR = 16\n", "PATCH"),
        ("MAJOR = 0\nMINOR = '16'\nPATCH = 1\n", "MINOR"),
        (package_info(0, 16, 1).replace("''", "None"), "PRE_RELEASE"),
    ],
)
def test_malformed_package_info_is_one_line_naming_the_file(tmp_path: Path, text: str, names: str) -> None:
    fake_tree(tmp_path, text)
    with pytest.raises(PatchError) as err:
        megatron_version(tmp_path)
    message = str(err.value)
    assert "\n" not in message and names in message and "package_info.py" in message


# --- picking a patch -------------------------------------------------------------------


def test_supported_versions_pick_their_own_patch() -> None:
    for version in SUPPORTED:
        assert patch_name_for(version) == version
        assert patch_for(version).name == f"{version}.patch"


def test_a_later_patch_release_uses_its_series_patch() -> None:
    assert patch_name_for("core_v0.19.1") == "core_v0.19.0"
    assert patch_name_for("core_v0.16.0rc1") == "core_v0.16.1"


@pytest.mark.parametrize("version", ["core_v0.17.0", "core_v1.16.1", "nonsense"])
def test_unknown_version_is_refused_naming_the_supported_ones(version: str) -> None:
    with pytest.raises(PatchError) as err:
        patch_for(version)
    message = str(err.value)
    assert version in message and all(s in message for s in SUPPORTED)


# --- the shipped patch files -----------------------------------------------------------


@pytest.mark.parametrize("version", SUPPORTED)
def test_patch_touches_exactly_the_three_megatron_files(version: str) -> None:
    text = patch_for(version).read_text()
    assert set(file_diffs(text)) == PATCHED_FILES
    olds = {line[len("--- a/"):] for line in text.splitlines() if line.startswith("--- ")}
    assert olds == PATCHED_FILES


@pytest.mark.parametrize("version", SUPPORTED)
def test_patch_only_adds_a_few_lines_and_hunk_counts_add_up(version: str) -> None:
    for path, hunks in file_diffs(patch_for(version).read_text()).items():
        assert hunks, path
        for hunk in hunks:
            m = re.match(r"@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@", hunk[0])
            assert m, hunk[0]
            old, new = int(m.group(1) or 1), int(m.group(2) or 1)
            body = hunk[1:]
            assert not [line for line in body if line[0] == "-"], f"{path}: the patch removes Megatron-LM lines"
            assert sum(line[0] == " " for line in body) == old, f"{path} {hunk[0]}"
            assert len(body) == new, f"{path} {hunk[0]}"
    assert len(added_lines(patch_for(version).read_text())) <= 30


@pytest.mark.parametrize("version", SUPPORTED)
def test_patch_calls_each_hook_once_and_falls_back_to_no_ops(version: str) -> None:
    added = "\n".join(added_lines(patch_for(version).read_text()))
    calls = re.findall(r"_falcon(?:_hooks)?\.(\w+)\(", added)
    assert sorted(calls) == sorted(HOOK_CALLS)
    fallback = re.search(r"_falcon_hooks = _NS\((.*)\)$", added, re.M)
    assert fallback, "no fallback namespace for a Megatron-LM without falconext"
    namespace = eval(f"dict({fallback.group(1)})")  # noqa: S307 - our own patch text
    assert set(namespace) == set(HOOK_CALLS) - {"add_arguments"}
    for name, fn in namespace.items():
        assert len(inspect.signature(fn).parameters) == HOOK_CALLS[name], name


def test_hooks_module_has_what_the_patches_call() -> None:
    from falconext.megatron_lm import hooks

    for name, n in HOOK_CALLS.items():
        fn = getattr(hooks, name)
        inspect.signature(fn).bind(*range(n))  # raises TypeError if it cannot take n arguments


# --- git's stderr ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "stderr, expected",
    [
        ("error: patch failed: megatron/training/training.py:193\nerror: megatron/training/training.py: patch does not apply\n",
         "megatron/training/training.py:193"),
        ("error: megatron/training/arguments.py: No such file or directory\n", "megatron/training/arguments.py"),
        ("fatal: corrupt patch at line 7\n", None),
    ],
)
def test_first_failing_file(stderr: str, expected: str | None) -> None:
    assert first_failing_file(stderr) == expected


# --- check and apply on fake checkouts -------------------------------------------------


@needs_git
@pytest.mark.parametrize("version", SUPPORTED)
def test_check_apply_check_inside_another_repository(tmp_path: Path, capsys: pytest.CaptureFixture[str], version: str) -> None:
    """A checkout that is a plain folder under some other git work tree still gets patched
    (git must not take paths relative to the enclosing repository and skip them)."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    major, minor, patch = (int(x) for x in version.removeprefix("core_v").split("."))
    files = preimages(patch_for(version).read_text())
    tree = fake_tree(tmp_path / "Megatron-LM", package_info(major, minor, patch), files)

    code, out, err = run_cli(capsys, "megatron-patch", "check", str(tree))
    assert (code, err) == (0, "")
    assert out.startswith(f"{version}: patch applies cleanly (") and out.endswith(f"megatron-lm/{version}.patch)\n")
    assert (tree / "megatron/training/training.py").read_text() == files["megatron/training/training.py"]

    code, out, err = run_cli(capsys, "megatron-patch", "apply", str(tree))
    assert (code, err) == (0, "") and out.startswith(f"{version}: patch applied (")
    patched = {rel: (tree / rel).read_text() for rel in PATCHED_FILES}
    assert "_falcon_hooks.loop_start(iteration)" in patched["megatron/training/training.py"]
    assert "_falcon.add_arguments(parser)" in patched["megatron/training/arguments.py"]
    assert "_falcon_hooks.train_sampler(batch_sampler, dataset)" in patched["megatron/training/datasets/data_samplers.py"]

    code, out, err = run_cli(capsys, "megatron-patch", "apply", str(tree))
    assert (code, err) == (0, "") and out.startswith(f"{version}: patch already applied (")
    assert {rel: (tree / rel).read_text() for rel in PATCHED_FILES} == patched

    code, out, err = run_cli(capsys, "megatron-patch", "check", str(tree))
    assert (code, err) == (0, "") and out.startswith(f"{version}: patch already applied (")


@needs_git
def test_checkout_without_the_context_does_not_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = {rel: "# a Megatron-LM that changed\nx = 1\n" for rel in PATCHED_FILES}
    tree = fake_tree(tmp_path, package_info(0, 16, 1), files)
    for action in ("check", "apply"):
        code, out, err = run_cli(capsys, "megatron-patch", action, str(tree))
        assert (code, out) == (2, "")
        assert err.count("\n") == 1 and err.startswith("falconext megatron-patch: error: core_v0.16.1: ")
        assert "patch does not apply" in err and re.search(r"megatron/training/\S+\.py", err)
    assert all((tree / rel).read_text() == text for rel, text in files.items())


@needs_git
def test_checkout_missing_the_files_does_not_apply(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = fake_tree(tmp_path, package_info(0, 19, 0))
    code, out, err = run_cli(capsys, "megatron-patch", "check", str(tree))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "patch does not apply" in err and "megatron/training/" in err


def test_cli_refuses_an_unknown_version_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = fake_tree(tmp_path, package_info(0, 17, 2))
    code, out, err = run_cli(capsys, "megatron-patch", "apply", str(tree))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "core_v0.17.2" in err and all(s in err for s in SUPPORTED)


def test_cli_refuses_a_folder_that_is_no_checkout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "megatron-patch", "check", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == f"falconext megatron-patch: error: {tmp_path} is not a Megatron-LM checkout: no megatron/core/package_info.py\n"


def test_cli_usage_error_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["megatron-patch", "revert", "."])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
