"""The one allowance for tests that must time the wall clock.

Most durations in the suite are read from the code's own clocks (the emulated device's
records, Suspension's and the controller's injected or logical time). What is left times
something only the host can: a Redis server's blocking read, a thread woken from a wait, a
real transfer or kernel. Their upper bounds add this allowance, named here once, so that a
test stays meaningful (the failure it catches is longer than the allowance, or is caught
by a lower bound) and passes on the 2-core machine running the suite beside two CPU hogs.
"""

from __future__ import annotations

#: seconds a loaded host may add to a wait or a wake-up; on the 2-core machine with two
#: CPU hogs beside the suite, the wakes these tests time were late by tens of milliseconds
LOADED_HOST_SLACK_S = 1.0
