"""What every protocol module shares: the error a bad message raises, and the check of a
whole number inside a list of numbers."""

from __future__ import annotations


class MessageError(ValueError):
    """A message that is malformed, of an unknown type or version, or too large."""


def is_rank(value: float) -> bool:
    """A whole number >= 0 (JSON lists of numbers decode as floats here)."""
    return value >= 0 and float(value).is_integer()
