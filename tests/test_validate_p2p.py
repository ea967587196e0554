"""P2P pass runner over real gloo process groups (4 processes on 127.0.0.1), and merge_passes.

One spawn runs three scenarios so the test pays process start-up once: the ring of all
four ranks with one link slowed by a send wrapper (as the harness's injected link delay
would), the merged rings of two disjoint pairs, and a ring inside a subgroup (src/dst
stay global ranks).
"""

from __future__ import annotations

import json
import statistics
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from falconext.ports import free_port
from falconext.validate.p2p import run_passes
from falconext.validate.passes import merge_passes, ring_passes

WORLD = 4
SLOW_SRC, SLOW_DST, DELAY_S = 1, 2, 0.060
NBYTES, REPEATS = 65536, 5


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        barriers = []

        def slow_send(tensor, dst, group=None):
            if rank == SLOW_SRC and dst == SLOW_DST:
                time.sleep(DELAY_S)
            dist.send(tensor, dst, group=group)

        def counted_barrier(group=None):
            barriers.append(group)
            dist.barrier(group=group)

        ring = run_passes(ring_passes([0, 1, 2, 3]), rank, NBYTES, REPEATS, send=slow_send, barrier=counted_barrier)
        merged = run_passes(merge_passes([ring_passes([0, 1]), ring_passes([2, 3])]), rank, NBYTES, REPEATS)
        sub = dist.new_group([1, 3])  # collective: every rank creates it
        grouped = run_passes(ring_passes([1, 3]), rank, NBYTES, REPEATS, group=sub) if rank in (1, 3) else []
        Path(out_dir, f"{rank}.json").write_text(
            json.dumps({"ring": ring, "merged": merged, "grouped": grouped, "barriers": len(barriers)})
        )
    finally:
        dist.destroy_process_group()


def test_ring_passes_find_the_slow_link(tmp_path):
    t0 = time.monotonic()
    ctx = mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 90
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("p2p workers did not finish in 90 s")
    elapsed = time.monotonic() - t0
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]

    ring = {(s, d): t for r in res for s, d, t in r["ring"]}
    measured = [(s, d) for r in res for s, d, _ in r["ring"]]
    assert sorted(measured) == [(0, 1), (1, 2), (2, 3), (3, 0)], "each ring link exactly once"
    for rank, r in enumerate(res):  # a pair is reported by its receiver only
        assert all(d == rank for _, d, _ in r["ring"])
        assert r["barriers"] == 2 + 1, "one barrier per pass and a final one"
    slow = ring[(SLOW_SRC, SLOW_DST)]
    others = [t for pair, t in ring.items() if pair != (SLOW_SRC, SLOW_DST)]
    assert slow >= 0.8 * DELAY_S, ring
    # 2 cores, 4 processes: a healthy link's median reaches a few ms under load (one CI
    # host showed 20 ms), so the margin is set against the typical link, and the slow one
    # must still top them all
    assert slow > 3 * statistics.median(others) and slow > max(others), ring

    merged = sorted((s, d) for r in res for s, d, _ in r["merged"])
    assert merged == [(0, 1), (1, 0), (2, 3), (3, 2)]
    assert all(t < DELAY_S for r in res for _, _, t in r["merged"]), "the slow send wrapper was not used"
    grouped = sorted((s, d) for r in res for s, d, _ in r["grouped"])
    assert grouped == [(1, 3), (3, 1)]
    print(f"p2p spawn + 3 scenarios: {elapsed:.1f} s; ring medians {ring}")


def test_merge_two_disjoint_rings():
    merged = merge_passes([ring_passes([0, 1]), ring_passes([2, 3])])
    assert merged == [[(0, 1), (2, 3)], [(1, 0), (3, 2)]]


def test_merge_uneven_schedules_keeps_the_longest():
    merged = merge_passes([ring_passes([0, 1, 2]), ring_passes([3, 4])])
    assert len(merged) == 3
    assert sorted(p for m in merged for p in m) == sorted(
        [(0, 1), (1, 2), (2, 0), (3, 4), (4, 3)]
    )
    assert merge_passes([]) == []


def test_merge_overlapping_groups_names_the_rank():
    with pytest.raises(ValueError, match="rank 2 appears twice in merged pass 0"):
        merge_passes([ring_passes([1, 2]), ring_passes([2, 3])])


@pytest.mark.parametrize(
    "passes, kwargs, word",
    [
        ([[(0, 1), (1, 2)]], {}, "rank 1 appears twice in pass 0"),
        ([[(0, 1)], [(2, 2)]], {}, "pass 1 has rank 2 sending to itself"),
        ([[(0, 1, 2)]], {}, "not a (src, dst) pair"),
        ([[(0, 1)]], {"nbytes": 0}, "nbytes must"),
        ([[(0, 1)]], {"repeats": 0}, "repeats must"),
    ],
)
def test_bad_input_fails_before_any_collective(passes, kwargs, word):
    # no process group exists here: reaching a barrier would raise a different error
    args = {"nbytes": 8, **kwargs}
    with pytest.raises(ValueError, match=word.replace("(", r"\(").replace(")", r"\)")):
        run_passes(passes, 0, **args)


def test_split_rounds_keeps_every_pair_once_and_bounds_concurrency():
    from falconext.validate.p2p import split_rounds
    from falconext.validate.passes import ring_passes

    passes = ring_passes(list(range(9)))
    for conc in (0, 1, 2, 4):
        rounds = split_rounds(passes, conc)
        assert [p for r in rounds for p in r] == [p for ps in passes for p in ps]
        assert all(len(r) <= (conc or 9) for r in rounds)
    assert len(split_rounds(passes, 0)) == len(passes) == 3
    assert split_rounds([[]], 2) == [[]]
