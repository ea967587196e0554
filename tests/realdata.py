"""Where the shared real data lives (``shared/realdata`` beside the checkout, never copied
into it) and what its absence means: a skip with the reason on a developer's machine, an
error in CI (``CI=true``), which always runs beside the shared folder, so that a moved
folder cannot turn the real-data tests into silent skips."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REALDATA = Path(__file__).resolve().parents[2] / "shared" / "realdata"


def needs(path: Path) -> pytest.MarkDecorator:
    """The module mark for tests that read ``path``: none where it exists, a skip naming it
    where it does not; in CI its absence raises (a collection error that fails the run)."""
    if path.is_file():
        return pytest.mark.skipif(False, reason=f"{path} exists")
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"{path} is absent: CI runs beside the shared real-data folder, and these tests must run")
    return pytest.mark.skip(reason=f"{path} is absent (the shared real-data folder)")
