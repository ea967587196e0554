"""The validation plan on the bus: the suspend command carries what every rank needs alike
and each rank's own work comes in shares of bounded size, so no message grows with the
world (at 16,384 ranks the whole plan was about 500 KB, past the bus's 64 KiB cap); and a
rank runs exactly the transfers and barriers the whole plan gave it before."""

from __future__ import annotations

import json
import time

import pytest

from falconext.config import FalconConfig
from falconext.control.controller import Controller
from falconext.protocol.codec import MAX_MESSAGE_BYTES, decode, encode
from falconext.protocol.commands import Share, Suspend
from falconext.protocol.messages import ValidationResult
from falconext.validate.p2p import run_passes
from falconext.validate.passes import split_rounds
from falconext.validate.plan import rank_work, split_plan, validation_plan
from falconext.validate.suspension import Bench, Suspension


def layout_groups(world: int, tp: int, pp: int) -> dict[str, tuple[str, list[int]]]:
    """Megatron's groups of a TP x DP x PP job (TP fastest, then DP, then PP)."""
    dp = world // (tp * pp)
    groups: dict[str, tuple[str, list[int]]] = {}
    for s in range(pp):
        for d in range(dp):
            if tp > 1:
                groups[f"tp-{s}-{d}"] = ("tp", [s * tp * dp + d * tp + t for t in range(tp)])
        for t in range(tp):
            groups[f"dp-{s}-{t}"] = ("dp", [s * tp * dp + d * tp + t for d in range(dp)])
    for d in range(dp):
        for t in range(tp):
            groups[f"pp-{d}-{t}"] = ("pp", [s * tp * dp + d * tp + t for s in range(pp)])
    return groups


def suspend_outputs(plan: dict, world: int) -> list:
    """What the controller posts to suspend every rank for ``plan``: the shares, then the suspend."""
    ctl = Controller(FalconConfig(), world=world)
    ctl.localizer.plan, ctl.localizer.plan_ranks = plan, list(range(world))
    return [o.message for o in ctl._suspend(100.0) if o.kind == "command"]


@pytest.mark.parametrize("suspects", [[], [1]], ids=["every-rank", "suspects"])
def test_no_suspend_message_exceeds_the_bus_cap_at_16384_ranks(suspects):
    world = 16384
    plan = validation_plan(layout_groups(world, 2, 4), list(range(world)), suspects)
    assert len(json.dumps(plan, separators=(",", ":")).encode()) > MAX_MESSAGE_BYTES  # the plan in one message: too large
    msgs = suspend_outputs(plan, world)
    assert [m.KIND for m in msgs] == ["share"] * (len(msgs) - 1) + ["suspend"]
    sizes = []
    for m in msgs:
        data = encode(m)
        sizes.append(len(data.encode()))
        assert decode(data) == m  # strictly valid
    assert max(sizes) <= MAX_MESSAGE_BYTES, max(sizes)
    assert sizes[-1] < 1024  # the suspend itself does not grow with the world
    # every rank's work, read back from the shares, is exactly its part of the whole plan
    sus = msgs[-1]
    shares = [m.share for m in msgs[:-1]]
    conc = plan["gemm_concurrency"] or len(plan["gemm"]) or 1
    assert sus.validation.gemm_rounds == -(-len(plan["gemm"]) // conc)
    expected = [(k, s, d) for k, rnd in enumerate(split_rounds(plan["passes"], plan["p2p_concurrency"]))
                for s, d in rnd]
    assert sus.validation.p2p_rounds == len(split_rounds(plan["passes"], plan["p2p_concurrency"]))
    got, gemm = set(), []
    for r in range(world):
        mine = [sh for sh in shares if sh.first <= r <= sh.last]
        assert len(mine) == 1  # every rank covered once
        work = rank_work(mine, r)
        assert all(r in (s, d) for _, s, d in work.pairs)
        got.update(work.pairs)
        if work.gemm_round is not None:
            gemm.append((r, work.gemm_round))
    assert got == set(expected)
    assert gemm == [(r, i // conc) for i, r in enumerate(sorted(plan["gemm"]))]


def test_the_split_takes_a_fraction_of_a_second_at_16384_ranks():
    world = 16384
    plan = validation_plan(layout_groups(world, 2, 4), list(range(world)))
    t0 = time.perf_counter()
    split_plan(plan, range(world))
    assert time.perf_counter() - t0 < 5.0


class Recorder:
    """A rank's collective calls in order, as run_passes makes them."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def send(self, buf, dst, group=None):
        self.calls.append(("send", dst))

    def recv(self, buf, src, group=None):
        self.calls.append(("recv", src))

    def barrier(self, group=None):
        self.calls.append(("barrier",))


@pytest.mark.parametrize("gemm_conc, p2p_conc, sweeps", [(0, 0, 1), (1, 1, 2), (2, 3, 1)])
@pytest.mark.parametrize("suspects", [[], [5]])
def test_a_small_job_runs_the_same_transfers_gemms_and_barriers_as_with_the_whole_plan(gemm_conc, p2p_conc, sweeps,
                                                                                        suspects):
    world = 12  # TP2 x DP3 x PP2 on nodes of 4: rings of 2, 3 (odd: three passes) and 2
    plan = validation_plan(layout_groups(world, 2, 2), list(range(world)), suspects, gemm_n=8, gemm_repeats=1,
                           gemm_concurrency=gemm_conc, validation_sweeps=sweeps, p2p_concurrency=p2p_conc,
                           p2p_bytes=4, p2p_repeats=1)
    msgs = suspend_outputs(plan, world)
    sus_cmd = decode(encode(msgs[-1]))
    shares = [decode(encode(m)).share for m in msgs[:-1]]
    for rank in range(world):
        # before: every rank ran the whole plan (validate/suspension.py as it was; sweeps of
        # every GEMM round, then every pass, since the first sweep runs whatever the budget)
        before = Recorder()
        gemm = sorted(plan["gemm"])
        conc = gemm_conc or len(gemm) or 1
        for _ in range(sweeps):
            for start in range(0, len(gemm), conc):
                if conc < len(gemm):
                    before.barrier()
                if rank in gemm[start:start + conc]:
                    before.calls.append(("gemm",))
            run_passes(plan["passes"], rank, 4, 1, send=before.send, recv=before.recv, barrier=before.barrier,
                       concurrency=p2p_conc)
        # now: the rank's share, through the real Suspension
        now = Recorder()

        def passes(schedule, nbytes, repeats, concurrency, now=now, rank=rank):
            run_passes(schedule, rank, nbytes, repeats, send=now.send, recv=now.recv, barrier=now.barrier,
                       concurrency=concurrency)
            return []

        bench = Bench(lambda n, r, now=now: now.calls.append(("gemm",)) or 1e9, passes, now.barrier)
        posted: list = []
        sus = Suspension(rank, 1, 40, sus_cmd.validation, bench, posted.append, lambda *a, **k: None,
                         work=rank_work(shares, rank))
        sus.go()
        sus.run(time.monotonic() + 5.0)
        (result,) = [m for m in posted if isinstance(m, ValidationResult)]
        assert result.error == ""
        assert now.calls == before.calls, rank


def test_a_rank_keeps_only_the_shares_that_cover_it_for_its_suspend(tmp_path):
    from falconext.control.client import RankClient
    from falconext.protocol.commands import ValidationShare

    class Runtime:
        def __init__(self) -> None:
            self.shares: list = []
            self.scheduled: list = []

        def share(self, session, share):
            self.shares.append((session, share))

        def schedule(self, cmd):
            self.scheduled.append(cmd)
            return None

    rt = Runtime()
    client = RankClient("redis://127.0.0.1:1/0", "job", 5, 1, FalconConfig(), rt, lambda *a, **k: None)
    mine, other = ValidationShare(4, 7, [[4, 7, 0]], [[0, 5, 6]]), ValidationShare(0, 3, [[0, 3, 0]], [])
    for share in (other, mine):
        client._command(Share(9, share))
    client._command(Suspend(9, 40, 1.0))
    assert rt.shares == [(9, mine)] and len(rt.scheduled) == 1
    assert rank_work([s for _, s in rt.shares], 5).gemm_round == 0


@pytest.mark.parametrize("bad, where", [(True, "pairs[1][2]"), (2.0, "pairs[1][2]"), ("7", "pairs[1][2]"),
                                        (None, "pairs[1][2]")])
def test_a_share_s_rows_are_whole_numbers_each_named_when_not(bad, where):
    """A share's rows take the fast way when every value is an integer; one that is not
    (a bool, a float, a string, null) is refused naming its place."""
    from falconext.protocol.base import MessageError

    from falconext.protocol.commands import ValidationShare

    text = encode(Share(session=5, share=ValidationShare(0, 9, [[0, 3, 0]], [[0, 1, 2], [1, 3, 7]])))
    got = decode(text)
    assert isinstance(got, Share) and got.share.pairs == [[0, 1, 2], [1, 3, 7]] and got.share.gemm == [[0, 3, 0]]
    body = json.loads(text)
    body["body"]["share"]["pairs"][1][2] = bad
    with pytest.raises(MessageError, match=rf"share\.{where.replace('[', '.').replace(']', '.')}"):
        decode(json.dumps(body))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_shares_worked_out_over_arrays_are_the_loop_s(seed, monkeypatch):
    """At 100k ranks the shares are cut over arrays: the same blocks, GEMM runs and rows in
    the same order as the loop (pairs listed twice, a pair within one rank, ranks outside
    the job), and a block too large for the cap takes the loop's way, which halves it."""
    import random

    import falconext.validate.plan as plan_mod

    rng = random.Random(seed)
    for _ in range(40):
        n = rng.choice([1, 3, 50, 400, 2000])
        ranks = list(range(n)) if rng.random() < 0.7 else sorted(rng.sample(range(3 * n), n))
        passes = [[(rng.choice(ranks), rng.choice(ranks + [3 * n + 5])) for _ in range(rng.randint(0, n))]
                  for _ in range(rng.randint(0, 4))]
        whole = {"gemm": rng.sample(ranks, rng.randint(0, n)), "passes": passes,
                 "gemm_concurrency": rng.choice([0, 1, 3]), "p2p_concurrency": rng.choice([0, 1, 7])}
        cap = rng.choice([1030, 1060, 1100, 4000, MAX_MESSAGE_BYTES])  # the first: blocks the loop halves
        fast = split_plan(whole, ranks, cap)
        with monkeypatch.context() as m:
            m.setattr(plan_mod, "_shares_at_once", lambda *a: None)
            assert split_plan(whole, ranks, cap) == fast
        assert all(len(encode(Share(2**62, sh))) <= cap for sh in fast[1] if sh.first != sh.last)
