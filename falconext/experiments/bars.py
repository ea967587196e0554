"""The figure shared by the mitigation experiments: iteration time over healthy, with the
fail-slow and after mitigation side by side, and a reference mark on the second bar."""

from __future__ import annotations

from typing import Sequence


def before_after_bars(path: str, labels: Sequence[str], before: Sequence[float], after: Sequence[float],
                      marks: Sequence[float | None], after_label: str, title: str, xlabel: str = "") -> None:
    """Write a PNG of grouped bars: ``before`` (red) and ``after`` (``after_label``) per
    label, a black line at each non-None ``marks`` value over the second bar, and the
    healthy level (1.0) dotted."""
    import matplotlib.pyplot as plt  # lazy: run-time order (after the runner's matplotlib.use("Agg"))

    fig, ax = plt.subplots(figsize=(max(4.5, 0.9 * len(labels) + 2.5), 3.2))
    xs = list(range(len(labels)))
    ax.bar([x - 0.2 for x in xs], before, 0.4, label="fail-slow", color="#d62728")
    ax.bar([x + 0.2 for x in xs], after, 0.4, label=after_label, color="#2ca02c")
    for x, y in zip(xs, marks):
        if y is not None:
            ax.plot([x + 0.02, x + 0.38], [y, y], color="black", lw=1)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xticks(xs, list(labels))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("iteration time / healthy")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
