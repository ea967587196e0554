"""The house rules of shared/ARCHITECTURE.md, checked: the pure algorithms (detect, profile,
mitigate's solvers and planner, validate's verdicts and schedules) and the controller
import neither torch nor redis, so they run and are tested anywhere."""

from __future__ import annotations

import subprocess
import sys

import pytest

PURE = [
    "falconext.detect.bocd", "falconext.detect.verify", "falconext.detect.baselines", "falconext.detect.itertime",
    "falconext.detect.period", "falconext.detect.tracking", "falconext.detect.scores", "falconext.detect.evaluate",
    "falconext.profile.analysis", "falconext.profile.window",
    "falconext.mitigate.planner", "falconext.mitigate.microbatch", "falconext.mitigate.topology",
    "falconext.mitigate.mitigation",
    "falconext.validate.verdict", "falconext.validate.passes", "falconext.validate.plan",
    "falconext.control.controller", "falconext.control.episodes", "falconext.control.heartbeats",
    "falconext.control.localizer", "falconext.control.mitigation_driver", "falconext.control.operator",
    "falconext.control.outputs", "falconext.control.snapshot", "falconext.control.stragglers",
    "falconext.control.suspension",
]


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_neither_torch_nor_redis(module):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'redis') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"{module} pulls in {out.stdout.strip()}"
