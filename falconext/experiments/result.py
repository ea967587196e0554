"""What an experiment measures, as plain data: CSV rows, paper-vs-measured lines, notes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

#: one CSV row: column name -> a number or a short string
Row = dict[str, Any]


@dataclass(frozen=True)
class Comparison:
    """One line of an experiment's table.md: a quantity, the paper's value and ours."""

    quantity: str
    paper: str
    measured: str
    note: str = ""


@dataclass(frozen=True)
class ExperimentResult:
    """Everything an experiment measured; the runner turns it into files.

    ``rows`` become results.csv (columns in the order of first appearance), ``comparisons``
    the table in table.md, ``notes`` the lines under it (set-up, caveats, what differs from
    the paper's set-up), ``data`` whatever the figure needs beyond the rows.
    """

    rows: list[Row]
    comparisons: list[Comparison]
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


#: ``measure(quick) -> ExperimentResult``: pure apart from reading the clock where timing
#: is what it measures
Measure = Callable[[bool], ExperimentResult]
#: ``draw(result, png_path)``: writes the figure
Draw = Callable[[ExperimentResult, str], None]


def pct(x: float | None) -> str:
    """A share as a percentage with one decimal, or "-" when missing."""
    return "-" if x is None else f"{100 * x:.1f}%"


def times(x: float | None) -> str:
    """A slowdown with two decimals ("1.23x"), or "-" when missing."""
    return "-" if x is None else f"{x:.2f}x"
