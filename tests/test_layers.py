"""The house rules, checked.

- The protocol, the cost model, the pure algorithms (detect, profile, mitigate's solvers and
  planner, validate's verdicts and schedules) and the controller import neither torch nor
  redis, so they run and are tested anywhere.
- The house as drawn from its imports: each package imports only from layers below its own
  (or its own layer, without a cycle), so the flow stays one-way. Layers, bottom up: the
  protocol and the plain helpers; the tracer; the pipeline's phases (detect, profile,
  validate, mitigate) with the models and the simulators' generators; the control plane; the
  rank runtime, the run's report, the elastic launch and the emulated device; then what users
  run (the test bed, the Megatron-LM adapter, the experiments, the command line). Read from
  the source with ``ast`` (every import, also those inside functions).
- Imports sit at the top of their module. One inside a function says why it waits, in a
  ``# lazy: REASON (...)`` comment on its line or on the comment lines just above it (or above
  the imports right before it), REASON one of :data:`LAZY_REASONS`.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PURE = [
    "falconext.protocol.codec", "falconext.protocol.eventlog", "falconext.protocol.rank_side",
    "falconext.model.itertime", "falconext.model.roles",
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


PKG = Path(__file__).resolve().parent.parent / "falconext"

LAYERS: dict[str, int] = {
    "protocol": 0, "inputs": 0, "integers": 0, "medians": 0, "ports": 0, "config": 0,
    "trace": 1,
    "detect": 2, "profile": 2, "validate": 2, "mitigate": 2, "model": 2, "sim": 2,
    "control": 3,
    "runtime": 4, "report": 4, "elastic": 4, "emulation": 4,
    "testbed": 5, "megatron_lm": 5, "experiments": 5,
    "cli": 6,
}
#: pairs that the layers allow but the design rules out
FORBIDDEN = {("megatron_lm", "testbed")}


def package_imports() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the files that import it (``falconext.X`` only)."""
    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        src = rel.parts[0].removesuffix(".py")
        if src == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + ([f"{node.module}.{a.name}" for a in node.names] if node.module == "falconext" else [])
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "falconext" and len(parts) > 1 and parts[1] != src:
                    out[src][parts[1]].append(str(rel))
    return out


def test_every_package_has_a_layer() -> None:
    packages = {p.name.removesuffix(".py") for p in PKG.iterdir() if (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert packages - {"__init__", "__pycache__"} <= set(LAYERS), sorted(packages - set(LAYERS) - {"__init__"})


def test_no_package_imports_a_higher_layer_or_a_forbidden_one() -> None:
    wrong = []
    for src, targets in package_imports().items():
        for dst, files in targets.items():
            if dst not in LAYERS or src not in LAYERS:
                continue
            if LAYERS[dst] > LAYERS[src] or (src, dst) in FORBIDDEN:
                wrong.append(f"{src} (layer {LAYERS[src]}) -> {dst} (layer {LAYERS[dst]}): {sorted(set(files))}")
    assert not wrong, "\n".join(wrong)


def test_the_protocol_imports_no_other_falconext_package() -> None:
    assert not dict(package_imports().get("protocol", {}))


def test_no_import_cycle_between_packages() -> None:
    graph = {src: set(t) for src, t in package_imports().items()}
    cycles = []
    for start in graph:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    cycles.append(" -> ".join(path + [start]))
                elif nxt not in path:
                    stack.append((nxt, path + [nxt]))
    assert not cycles, cycles[:5]


#: why an import may wait inside a function: a dependency that is not installed everywhere
#: (or is found at run time); start-up time (what the command line, a launcher or a
#: torch-free module must not import); an import cycle that cannot be removed; something
#: that must happen first at run time (sys.path set, a fork server started, megatron-core
#: imported the cheap way)
LAZY_REASONS = ("optional dependency", "start-up time", "import cycle", "run-time order")
_LAZY = re.compile(r"#\s*lazy:\s*(.*)")


def _lazy_reason(line: str) -> str | None:
    m = _LAZY.search(line)
    return m.group(1) if m else None


def lazy_imports_without_reason(source: str) -> list[tuple[int, str]]:
    """(line, why) of each import inside a function of ``source`` that does not say why it is
    there, in a ``# lazy:`` comment naming one of LAZY_REASONS."""
    lines = source.splitlines()
    bad: list[tuple[int, str]] = []

    def check(stmt: ast.stmt, run_start: int) -> None:
        reasons = [r for n in range(stmt.lineno, stmt.end_lineno + 1) if (r := _lazy_reason(lines[n - 1])) is not None]
        n = stmt.lineno - 1
        while not reasons and n >= 1:
            text = lines[n - 1].strip()
            if text.startswith("#"):
                r = _lazy_reason(text)
                if r is not None:
                    reasons.append(r)
            elif n < run_start:  # above the imports right before this one: nothing said
                break
            n -= 1
        if not reasons:
            bad.append((stmt.lineno, "no '# lazy: REASON' comment"))
        elif not reasons[0].startswith(LAZY_REASONS):
            bad.append((stmt.lineno, f"reason {reasons[0]!r} is none of {LAZY_REASONS}"))

    def visit(node: ast.AST, in_function: bool) -> None:
        for field in ("body", "orelse", "finalbody", "handlers"):
            body = getattr(node, field, None)
            if not isinstance(body, list):
                continue
            run_start = 0
            for k, stmt in enumerate(body):
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    if k == 0 or not isinstance(body[k - 1], (ast.Import, ast.ImportFrom)):
                        run_start = stmt.lineno
                    if in_function:
                        check(stmt, run_start)
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(source), False)
    return bad


def test_every_import_inside_a_function_says_why() -> None:
    bad = [f"{path.relative_to(PKG.parent)}:{line}: {why}"
           for path in sorted(PKG.rglob("*.py")) for line, why in lazy_imports_without_reason(path.read_text())]
    assert not bad, "imports go at the top of the module, unless:\n" + "\n".join(bad)


def test_the_lazy_import_check_finds_a_missing_reason() -> None:
    source = """
import os


def f():
    import torch  # lazy: start-up time (no torch at import)

    # lazy: optional dependency (pynvml)
    import pynvml
    import pynvml.smi
    # lazy: run-time order (after sys.path)
    import megatron.training

    x = 1
    import json
    try:
        import triton  # lazy: for speed
    except ImportError:
        pass
    return x
"""
    assert lazy_imports_without_reason(source) == [
        (15, "no '# lazy: REASON' comment"),
        (17, "reason 'for speed' is none of " + repr(LAZY_REASONS)),
    ]
