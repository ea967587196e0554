"""The one integer check that the planners, the solvers and the simulator share."""

from __future__ import annotations

import numbers


def is_int(x: object) -> bool:
    """True for Python and numpy integers; False for everything else, bools included
    (``True`` processes or micro-batches is always a caller's bug, though ``bool`` is an
    ``Integral``; numpy's ``bool_`` is not one)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
