"""The house rules, checked: the protocol, the cost model, the pure algorithms (detect,
profile, mitigate's solvers and planner, validate's verdicts and schedules) and the
controller import neither torch nor redis, so they run and are tested anywhere."""

from __future__ import annotations

import subprocess
import sys

import pytest

PURE = [
    "falconext.protocol.codec", "falconext.protocol.eventlog", "falconext.model.itertime", "falconext.model.roles",
    "falconext.detect.bocd", "falconext.detect.verify", "falconext.detect.baselines", "falconext.detect.itertime",
    "falconext.detect.period", "falconext.detect.tracking", "falconext.detect.scores", "falconext.detect.evaluate",
    "falconext.profile.analysis", "falconext.profile.window",
    "falconext.mitigate.planner", "falconext.mitigate.microbatch", "falconext.mitigate.topology",
    "falconext.mitigate.mitigation",
    "falconext.validate.verdict", "falconext.validate.passes", "falconext.validate.plan",
    "falconext.control.controller",
]


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_neither_torch_nor_redis(module):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'redis') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"{module} pulls in {out.stdout.strip()}"
