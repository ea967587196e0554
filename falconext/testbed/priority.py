"""The emulated device's processes ahead of the host's other work.

An emulated device keeps a GPU's time only while its rank's real CPU work fits inside
the device windows (:mod:`falconext.emulation.emulator`). On a host busy with other work
(two CPU-bound processes on the 2-core test host), a rank woken at a window's end waits
for a core behind them, and every window overruns: healthy ranks then read up to twice
their device time, and what S2 balances on is the host's load, not the devices' speed.
A real GPU is not slowed by its host's other processes; so the test bed runs a job's
processes (the control plane, torchrun and the ranks) at a raised CPU priority, which
the kernel's scheduler honours at every wake-up, and the job keeps its device time
beside other work (measured: the S2 job's plan exact and its mitigation at the optimum
with two CPU hogs beside it, as on the quiet host). The CPU bed (``--device cpu``), whose
times are the host's own, is raised the same way.

Priority is not isolation: two CPU-bound Python processes beside a job leave its device
time alone, but another training job beside it (torch's kernels on the same cores and
caches, even at nice 19) stretched the S2 job's healthy iteration from 0.49 to 0.67 s
and delayed its detection from 12 to 21 iterations (2026-11-27): the test suite runs one
job at a time (tests/jobs.py).
"""

from __future__ import annotations

import os

#: the nice value of a test-bed job's processes (lower runs first; 0 is normal)
DEVICE_NICE = -10


def raise_priority(target: int = DEVICE_NICE) -> str | None:
    """Set this process's nice value to ``target`` when it is higher (the processes it
    starts inherit it). Returns None when done or not needed, otherwise the one-line
    reason it could not be done (lowering a nice value needs root or CAP_SYS_NICE); the
    process then keeps its priority."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if current <= target:
        return None
    try:
        os.setpriority(os.PRIO_PROCESS, 0, target)
    except OSError as exc:
        return (f"the job's processes keep nice {current} (raising them to {target} "
                f"needs root or CAP_SYS_NICE: {exc.strerror}); other work on this host will stretch their times")
    return None
