"""Periods and step times recovered from real jobs' collective calls (``../shared/realdata``).

The HTA (PyTorch profiler) traces of ``hta-kineto/`` hold the calls of four real ranks and,
in ``truth.json``, the profiler's steps: start, duration and calls per step. What the
period finder and the batch tracker must get from the calls alone:

- ``dlrm8`` (8-rank DLRM, two runs): 10 calls per step although the all-to-all sizes change
  every step (a size class straddles a power of two), so sizes are only a soft feature;
- ``ws16`` (16 ranks, mixed collectives): 17;
- ``ddp2`` (2-rank DDP): 404 identical, size-less all-reduces per step; only the long pause
  of the optimizer step and the next batch shows where a step ends;
- every step time within 2% of the profiler's, matched to the profiler step it overlaps most.

Skipped, with the reason, where the shared folder is absent (it is never copied here); an error in
CI (tests/realdata.py).
"""

from __future__ import annotations

import json

import pytest

from falconext.detect.itertime import iteration_times_by_rank
from falconext.trace.logfile import read_call_log
from realdata import REALDATA, needs

HTA = REALDATA / "hta-kineto"
pytestmark = needs(HTA / "truth.json")

CASES = [("dlrm8-rank3", 10), ("dlrm8-rank1-test", 10), ("ws16-rank0", 17), ("ddp2-rank1", 404)]


@pytest.mark.parametrize("name, calls_per_step", CASES)
def test_period_and_step_times_match_the_profiler(name: str, calls_per_step: int) -> None:
    truth = json.loads((HTA / "truth.json").read_text())[name]
    assert truth["calls_per_step"][0] == calls_per_step  # the label this test stands on
    ((_, (period, its)),) = iteration_times_by_rank(read_call_log(HTA / f"calls-{name}.jsonl")).items()
    assert period == calls_per_step
    assert all(it.period == calls_per_step for it in its)
    steps = [(s["start_s"], s["start_s"] + s["dur_s"]) for s in truth["steps"]]
    # every step but the first and the last lies between two boundaries seen in the calls
    assert len(its) >= len(steps) - 2
    for it in its:
        overlap = [min(it.t_end, b) - max(it.t_begin, a) for a, b in steps]
        a, b = steps[max(range(len(steps)), key=overlap.__getitem__)]
        assert it.duration == pytest.approx(b - a, rel=0.02), (name, it, b - a)


def test_the_period_command_reads_a_real_log(capsys: pytest.CaptureFixture[str]) -> None:
    from falconext.cli import main

    assert main(["period", str(HTA / "calls-ddp2-rank1.jsonl")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["1"]["period"] == 404 and len(result["1"]["iter_times"]) == 4
