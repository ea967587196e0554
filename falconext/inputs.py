"""Reading input files given on the command line: one error type, one message shape.

Every input the tools accept (iteration-time series, call logs, labelled traces, fault
plans) comes from another tool or a person, so a problem is reported as an
:class:`InputError` that names the file and what is wrong, never as a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class InputError(ValueError):
    """An input file is unusable; the message says where and why."""


def read_text(path: str | Path) -> str:
    """The text of ``path`` as UTF-8 (a leading BOM dropped). Raises InputError with one line
    naming the file for a missing file, a directory, a non-UTF-8 file, an empty (or blank)
    file or any other read error."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # tolerate a spreadsheet BOM
    except FileNotFoundError:
        raise InputError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{p}: is a directory, not a file") from None
    except UnicodeDecodeError:
        raise InputError(f"{p}: not a UTF-8 text file") from None
    except OSError as exc:
        raise InputError(f"{p}: cannot read ({exc.strerror})") from None
    if not text.strip():
        raise InputError(f"{p}: file is empty")
    return text


def loads_strict(text: str, where: str) -> Any:
    """JSON from a file or line: NaN and Infinity literals (which Python's json accepts)
    are rejected, and every problem names ``where``."""

    def no_constant(name: str) -> float:
        raise InputError(f"{where}: {name} is not valid JSON (numbers must be finite)")

    try:
        return json.loads(text, parse_constant=no_constant)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: malformed JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None


def option(args: list[str], name: str) -> str | None:
    """The value of ``name`` in a Megatron-style argument list (last one wins), or None."""
    value = None
    for k, a in enumerate(args):
        if a == name and k + 1 < len(args):
            value = args[k + 1]
        elif a.startswith(name + "="):
            value = a.partition("=")[2]
    return value


def set_option(args: list[str], name: str, value: str | None) -> list[str]:
    """``args`` with ``name`` set to ``value`` (a switch when None), replacing any earlier."""
    out: list[str] = []
    skip = False
    for k, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == name:
            skip = value is not None and k + 1 < len(args) and not args[k + 1].startswith("--")
            continue
        if a.startswith(name + "="):
            continue
        out.append(a)
    return out + ([name] if value is None else [name, value])
