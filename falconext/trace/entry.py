"""The layout of one call's entry in the tracer's ring.

The training thread builds a plain list per intercepted call (the cheapest thing it can
build); these are the indices of its fields. The tracer (:mod:`falconext.trace.hooks`),
the wrappers (:mod:`falconext.trace.wrappers`) and the CUDA timing
(:mod:`falconext.trace.cuda_timing`) read and write entries through them.
"""

from __future__ import annotations

#: sequence number, op, GroupInfo, bytes, peer process, issue time, start time,
#: end time, done flag, start event, end event
SEQ, OP, INFO, BYTES, PEER, T_ISSUE, T_START, T_END, DONE, EV0, EV1 = range(11)
