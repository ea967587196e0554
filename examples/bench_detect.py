"""Per-iteration cost of the detectors: microseconds per fed iteration time.

The detector runs once per training iteration (hundreds of milliseconds or more), so
tens of microseconds is negligible; this script is where that figure comes from.
Run: python examples/bench_detect.py [--n 20000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from falconext.detect import METHODS, make_detector


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    x = 0.5 * np.exp(np.random.default_rng(0).normal(0.0, 0.02, args.n))
    x[args.n // 2 :] *= 1.3
    for method in METHODS:
        det = make_detector(method)
        t0 = time.perf_counter()
        for v in x:
            det.feed(float(v))
        us = (time.perf_counter() - t0) / args.n * 1e6
        print(f"{method:<13} {us:7.1f} us per iteration  ({len(det.events)} event(s))")


if __name__ == "__main__":
    main()
