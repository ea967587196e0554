"""Apply falconext's patch to a Megatron-LM checkout: pick it by version, check, apply.

The patches live in ``patches/megatron-lm/<version>.patch`` at the top of the falconext
source tree (the one source of truth; an editable install finds them there). Each adds
``--falcon``/``--falcon-*`` to Megatron-LM's parser and the calls into
:mod:`falconext.megatron_lm.hooks`.

Pure helpers (:func:`parse_version`, :func:`patch_for`, :func:`first_failing_file`) and
an I/O edge (:func:`megatron_version`, :func:`check`, :func:`apply`) that reads the tree
and runs ``git apply``. Every problem is a :class:`PatchError` with a one-line message.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from falconext.inputs import InputError

#: Megatron-LM releases a patch is shipped for (``patches/megatron-lm/<version>.patch``)
SUPPORTED = ("core_v0.16.1", "core_v0.19.0")

#: where the patches are, relative to the falconext source tree
PATCH_SUBDIR = Path("patches") / "megatron-lm"

#: the file holding Megatron-LM's version, relative to the checkout
PACKAGE_INFO = Path("megatron") / "core" / "package_info.py"

_VERSION = re.compile(r"core_v(\d+)\.(\d+)\.(\d+)(.*)")
_GIT_TIMEOUT_S = 120


class PatchError(InputError):
    """A checkout, version or patch falconext cannot work with; the message says which."""


@dataclass(frozen=True)
class Outcome:
    """What :func:`check` found or :func:`apply` did, for one checkout."""

    version: str  #: the checkout's version, e.g. ``core_v0.16.1``
    patch: Path  #: the patch file used
    state: str  #: ``"applies"``, ``"applied"`` (by this call) or ``"already applied"``

    def line(self) -> str:
        """One line for a person, e.g. ``core_v0.16.1: patch applies cleanly (PATCH)``."""
        what = {
            "applies": "patch applies cleanly",
            "applied": "patch applied",
            "already applied": "patch already applied",
        }[self.state]
        return f"{self.version}: {what} ({_shown(self.patch)})"


# --- pure helpers ----------------------------------------------------------------------


def parse_version(source: str, where: str = str(PACKAGE_INFO)) -> str:
    """``core_vMAJOR.MINOR.PATCH<PRE_RELEASE>`` from the text of ``package_info.py``,
    read without running it (only top-level ``NAME = literal`` lines count).

    Raises PatchError naming ``where`` when the text is not Python or lacks an integer
    MAJOR, MINOR or PATCH (PRE_RELEASE is optional and must be a string).
    """
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise PatchError(f"{where}: cannot read the version (not valid Python: {exc.msg}, line {exc.lineno})") from None
    values: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values[target.id] = node.value.value
    parts = []
    for name in ("MAJOR", "MINOR", "PATCH"):
        value = values.get(name)
        if type(value) is not int or value < 0:
            raise PatchError(f"{where}: cannot read the version (no integer {name} = ...)")
        parts.append(str(value))
    pre = values.get("PRE_RELEASE", "")
    if not isinstance(pre, str):
        raise PatchError(f"{where}: cannot read the version (PRE_RELEASE is not a string)")
    return "core_v" + ".".join(parts) + pre


def patch_name_for(version: str, supported: tuple[str, ...] = SUPPORTED) -> str:
    """The supported release whose patch fits ``version``: itself, or else the supported
    release of the same MAJOR.MINOR series (``core_v0.19.1`` -> ``core_v0.19.0``; whether
    it really applies is for ``git apply --check`` to say).

    Raises PatchError naming the version and the supported ones when no series matches.
    """
    if version in supported:
        return version
    series = _series(version)
    same = [s for s in supported if series is not None and _series(s) == series]
    if not same:
        raise PatchError(
            f"Megatron-LM {version} is not supported by falconext's patch (supported: {', '.join(supported)})"
        )
    return same[-1]


def first_failing_file(stderr: str) -> str | None:
    """The first file ``git apply`` names as failing in its stderr (``path`` or
    ``path:line``), or None when it names none."""
    for raw in stderr.splitlines():
        line = raw.strip()
        m = re.match(r"error: patch failed: (.+:\d+)$", line)
        if m:
            return m.group(1)
        m = re.match(r"error: (.+?): (patch does not apply|No such file or directory|does not exist in index|already exists.*)$", line)
        if m:
            return m.group(1)
    return None


def same_series(version: str, installed: str | None) -> bool:
    """Whether a checkout of ``version`` (``core_vX.Y.Z``) and an installed megatron-core of
    ``installed`` (``X.Y.Z``; None: none installed) are of one MAJOR.MINOR series."""
    ours = _series(version)
    return installed is not None and ours is not None and ours == _series("core_v" + installed)


def _series(version: str) -> tuple[int, int] | None:
    m = _VERSION.fullmatch(version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when under it, else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# --- I/O edge ----------------------------------------------------------------------------


def patch_dir() -> Path:
    """The folder holding the shipped patches (falconext's source tree)."""
    return Path(__file__).resolve().parents[2] / PATCH_SUBDIR


def patch_for(version: str) -> Path:
    """The shipped patch file for ``version`` (see :func:`patch_name_for`).

    Raises PatchError for an unsupported version, or when the file is missing (an
    installation without falconext's source tree).
    """
    path = patch_dir() / f"{patch_name_for(version)}.patch"
    if not path.is_file():
        raise PatchError(f"{path}: patch file not found (install falconext from its source tree: pip install -e .)")
    return path


def megatron_version(tree: str | os.PathLike[str]) -> str:
    """``core_vX.Y.Z`` of the Megatron-LM checkout at ``tree`` (its package_info.py is
    read, never imported). Raises PatchError when ``tree`` is not such a checkout."""
    info = Path(tree) / PACKAGE_INFO
    try:
        source = info.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise PatchError(f"{tree} is not a Megatron-LM checkout: no {PACKAGE_INFO.as_posix()}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PatchError(f"{info}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    return parse_version(source, str(info))


def check(tree: str | os.PathLike[str]) -> Outcome:
    """Whether falconext's patch for the checkout's version applies (state ``applies``) or
    is already applied (``already applied``); changes nothing.

    Raises PatchError when neither holds, naming the first file that does not match.
    """
    version = megatron_version(tree)
    patch = patch_for(version)
    forward = _git_apply(tree, patch, "--check")
    if forward.returncode == 0:
        return Outcome(version, patch, "applies")
    if _git_apply(tree, patch, "--check", "--reverse").returncode == 0:
        return Outcome(version, patch, "already applied")
    failing = first_failing_file(forward.stderr)
    detail = f"{failing} differs from what the patch expects" if failing else _last_line(forward.stderr)
    raise PatchError(f"{version}: patch does not apply to {tree}: {detail} ({_shown(patch)})")


def apply(tree: str | os.PathLike[str]) -> Outcome:
    """Apply the patch to the checkout (state ``applied``), or do nothing when it is
    already applied (``already applied``). Raises PatchError when it does not apply; the
    checkout is then unchanged (``git apply`` is all or nothing)."""
    found = check(tree)
    if found.state == "already applied":
        return found
    done = _git_apply(tree, found.patch)
    if done.returncode != 0:
        raise PatchError(f"{found.version}: git apply failed in {tree}: {_last_line(done.stderr)}")
    if _git_apply(tree, found.patch, "--check", "--reverse").returncode != 0:
        raise PatchError(f"{found.version}: git apply reported success but {tree} is not patched")
    return Outcome(found.version, found.patch, "applied")


def _git_apply(tree: str | os.PathLike[str], patch: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """``git apply OPTIONS PATCH`` run in ``tree``, never inside an enclosing repository.

    Outside its own repository, a checkout under some other repository's work tree would
    make git take paths relative to that repository and silently skip every file; the
    ceiling stops git from looking above ``tree``.
    """
    root = Path(tree).resolve()
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent))
    try:
        return subprocess.run(
            ["git", "apply", *options, str(patch.resolve())],
            cwd=root, env=env, capture_output=True, text=True, timeout=_GIT_TIMEOUT_S,
        )
    except FileNotFoundError:
        raise PatchError("git not found: applying the Megatron-LM patch needs git on PATH") from None
    except subprocess.TimeoutExpired:
        raise PatchError(f"git apply did not finish within {_GIT_TIMEOUT_S} s in {tree}") from None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(git printed nothing)"
