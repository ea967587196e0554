"""Fast unit tests of falconext.megatron_lm's pure parts (no Megatron-LM checkout needed).

Never imports ``megatron.training``; only ``megatron.core`` (installed) is touched, by one
contract test.
"""

from __future__ import annotations

import argparse
import sys
import types

import numpy as np
import pytest

from falconext.detect.period import inner_period
from falconext.inputs import InputError
from falconext.megatron_lm import contract, launcher
from falconext.megatron_lm.contract import HookPoint, MegatronLMChanged, s2_refusal
from falconext.megatron_lm.hooks import ROLES_ENV, FlagError, add_arguments, parse_flags, roles_from_env
from falconext.megatron_lm.sampler import PlanError, PlannedSampler, PlanSchedule, replica_microbatches

# ----------------------------------------------------------------------------- sampler


def test_even_plan_is_megatrons_interleaved_order() -> None:
    start, mbs, dp, mb = 16, 2, 2, 8
    assert replica_microbatches(start, mbs, dp, 0, None, mb) == [[16, 17], [20, 21], [24, 25], [28, 29]]
    assert replica_microbatches(start, mbs, dp, 1, None, mb) == [[18, 19], [22, 23], [26, 27], [30, 31]]
    # the formula of Megatron's MegatronPretrainingSampler, for another shape
    start, mbs, dp, mb = 48, 3, 4, 8
    for r in range(dp):
        got = replica_microbatches(start, mbs, dp, r, None, mb)
        assert got == [list(range(start + (k * dp + r) * mbs, start + (k * dp + r + 1) * mbs))
                       for k in range(mb // dp)]


def test_uneven_plan_gives_contiguous_runs_over_the_same_samples() -> None:
    start, mbs, dp, mb = 16, 2, 2, 8
    r0 = replica_microbatches(start, mbs, dp, 0, [3, 5], mb)
    r1 = replica_microbatches(start, mbs, dp, 1, [3, 5], mb)
    assert r0 == [[16, 17], [18, 19], [20, 21]]
    assert r1 == [[22, 23], [24, 25], [26, 27], [28, 29], [30, 31]]
    assert all(len(m) == mbs for m in r0 + r1)
    planned = [s for m in r0 + r1 for s in m]
    even = [s for r in range(dp) for m in replica_microbatches(start, mbs, dp, r, None, mb) for s in m]
    assert len(planned) == len(set(planned))  # none twice
    assert sorted(planned) == sorted(even) == list(range(start, start + mb * mbs))


def test_uneven_plan_three_replicas_partition_the_global_batch() -> None:
    start, mbs, dp, mb, plan = 120, 4, 3, 10, [1, 6, 3]
    runs = [replica_microbatches(start, mbs, dp, r, plan, mb) for r in range(dp)]
    assert [len(run) for run in runs] == plan
    flat = [s for run in runs for m in run for s in m]
    assert flat == list(range(start, start + mb * mbs))


def test_plan_schedule_set_plan_at_count() -> None:
    s = PlanSchedule(dp=2, microbatches=8)
    assert s.plan_at(0) is None and s.count(0, 0) == 4 and s.count(0, 1) == 4
    s.set(5, [3, 5])
    s.set(10, [6, 2])
    assert s.plan_at(4) is None
    assert s.plan_at(5) == [3, 5] and s.plan_at(9) == [3, 5]
    assert s.plan_at(10) == [6, 2] and s.plan_at(1000) == [6, 2]
    assert (s.count(4, 1), s.count(5, 0), s.count(5, 1), s.count(10, 0)) == (4, 3, 5, 6)
    # a later set drops the entries from its iteration on
    s.set(7, [2, 6])
    assert s.plan_at(6) == [3, 5]
    assert s.plan_at(7) == [2, 6] and s.plan_at(10) == [2, 6] and s.plan_at(50) == [2, 6]
    # setting the same iteration again replaces it
    s.set(7, [5, 3])
    assert s.plan_at(7) == [5, 3] and s.plan_at(6) == [3, 5]
    # the even plan normalises to None (Megatron's own order)
    s.set(12, [4, 4])
    assert s.plan_at(12) is None and s.plan_at(11) == [5, 3]
    assert s.count(12, 0) == 4
    # an explicit None restores the even split from there
    s.set(20, [1, 7])
    s.set(15, None)
    assert s.plan_at(15) is None and s.plan_at(25) is None


@pytest.mark.parametrize("bad", [[8], [2, 3, 3], [0, 8], [-1, 9], [3, 4], [4, 5], [True, 7], [3.0, 5],
                                 "3,5"])
def test_plan_schedule_refuses_bad_plans(bad) -> None:
    s = PlanSchedule(dp=2, microbatches=8)
    s.set(3, [3, 5])
    with pytest.raises(PlanError):
        s.set(5, bad)
    # a refused plan changes nothing
    assert s.plan_at(5) == [3, 5] and s.plan_at(2) is None


def test_plan_error_messages_say_what_is_wrong() -> None:
    s = PlanSchedule(dp=2, microbatches=8)
    with pytest.raises(PlanError, match=r"\(2\)"):
        s.set(0, [8])
    with pytest.raises(PlanError, match=">= 1"):
        s.set(0, [0, 8])
    with pytest.raises(PlanError, match="sum 7"):
        s.set(0, [3, 4])


def _by_iteration(batches: list[list[int]], gbs: int) -> dict[int, list[list[int]]]:
    out: dict[int, list[list[int]]] = {}
    for m in batches:
        its = {i // gbs for i in m}
        assert len(its) == 1, f"a micro-batch spans global batches: {m}"
        out.setdefault(its.pop(), []).append(m)
    return out


def test_planned_sampler_follows_the_schedule_lazily() -> None:
    mbs, gbs, mb, dp = 2, 16, 8, 2
    sched = PlanSchedule(dp, mb)
    sched.set(3, [3, 5])
    consumed = 2 * gbs
    total = 6 * gbs + 5  # a trailing partial global batch is not yielded
    sampler = PlannedSampler(total, consumed, mbs, gbs, replica=1, schedule=sched)
    assert len(sampler) == total
    it = iter(sampler)
    first = next(it)  # iteration 2 has begun; iteration 4's plan is not set yet
    assert first == [consumed + 2, consumed + 3]
    sched.set(4, [6, 2])
    rest = [first] + list(it)
    got = _by_iteration(rest, gbs)
    assert sorted(got) == [2, 3, 4, 5]
    assert {g: len(v) for g, v in got.items()} == {2: 4, 3: 5, 4: 2, 5: 2}
    for g, batches in got.items():
        assert len(batches) == sched.count(g, 1)
        assert batches == replica_microbatches(g * gbs, mbs, dp, 1, sched.plan_at(g), mb)


def test_planned_sampler_replicas_cover_each_global_batch_once() -> None:
    mbs, gbs, mb, dp = 2, 16, 8, 2
    sched = PlanSchedule(dp, mb)
    sched.set(1, [3, 5])
    sched.set(2, [7, 1])
    per_replica = [list(PlannedSampler(4 * gbs, 0, mbs, gbs, r, sched)) for r in range(dp)]
    for g in range(4):
        samples = [s for r in range(dp) for m in _by_iteration(per_replica[r], gbs).get(g, []) for s in m]
        assert sorted(samples) == list(range(g * gbs, (g + 1) * gbs))
        assert len(samples) == len(set(samples))
    assert len(per_replica[0]) == 4 + 3 + 7 + 7
    assert len(per_replica[1]) == 4 + 5 + 1 + 1


def test_planned_sampler_refuses_bad_start_or_shape() -> None:
    sched = PlanSchedule(2, 8)
    with pytest.raises(PlanError, match="global batches"):
        PlannedSampler(1000, 24, 2, 16, 0, sched)  # 24 is not a multiple of 16
    with pytest.raises(PlanError):
        PlannedSampler(1000, 0, 2, 32, 0, sched)  # 32 != 8 micro-batches x 2
    PlannedSampler(1000, 48, 2, 16, 0, sched)  # a whole number of global batches: fine


# ----------------------------------------------------------------------------- contract


def _ok_args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"calculate_per_token_loss": True, "dataloader_type": "single", **kw})


def test_s2_refusal_none_for_exact_settings() -> None:
    assert s2_refusal(_ok_args()) is None
    assert s2_refusal(_ok_args(dataloader_type=None)) is None
    # a local CUDA graph that is not full-iteration is fine
    assert s2_refusal(_ok_args(cuda_graph_impl="local", cuda_graph_scope=["attn"])) is None
    assert s2_refusal(_ok_args(virtual_pipeline_model_parallel_size=None, rampup_batch_size=None)) is None


@pytest.mark.parametrize("args, words", [
    (argparse.Namespace(dataloader_type="single"), ["--calculate-per-token-loss"]),
    (_ok_args(calculate_per_token_loss=False), ["--calculate-per-token-loss"]),
    (_ok_args(dataloader_type="cyclic"), ["--dataloader-type", "cyclic"]),
    (_ok_args(rampup_batch_size=["16", "16", "1000"]), ["--rampup-batch-size"]),
    (_ok_args(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]), ["full-iteration", "CUDA graph"]),
    (_ok_args(virtual_pipeline_model_parallel_size=2), ["interleaved pipeline"]),
    (_ok_args(hybrid_context_parallel=True), ["hybrid context parallel", "its own micro-batch count"]),
    (_ok_args(rl_use_sequence_packing=True), ["--rl-use-sequence-packing", "its own micro-batch count"]),
])
def test_s2_refusal_names_the_reason(args, words) -> None:
    why = s2_refusal(args)
    assert isinstance(why, str) and why.startswith("S2")
    for w in words:
        assert w in why


FAKE = "fake_megatron_hooks"


@pytest.fixture
def fake_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = types.ModuleType(FAKE)

    def build_loader(dataset, consumed_samples, extra=None):
        return None

    def initialize(extra_args_provider=None, *, allow_no_cuda=False, other=1):
        return None

    def step(forward_step_func, data_iterator, model, **kwargs):
        return None

    class Sampler:
        def __init__(self, total_samples, consumed_samples, micro_batch_size, data_parallel_rank):
            pass

    mod.build_loader = build_loader
    mod.initialize = initialize
    mod.step = step
    mod.Sampler = Sampler
    mod.not_a_function = 3
    monkeypatch.setitem(sys.modules, FAKE, mod)
    return mod


GOOD = (
    HookPoint(FAKE, "build_loader", ("dataset", "consumed_samples")),
    HookPoint(FAKE, "initialize", accepts=("extra_args_provider", "allow_no_cuda")),
    HookPoint(FAKE, "step", ("forward_step_func",)),
    HookPoint(FAKE, "Sampler", ("total_samples",), accepts=("data_parallel_rank", "micro_batch_size")),
)


def test_contract_problems_all_hold(fake_module) -> None:
    assert contract.problems(GOOD) == []


def test_contract_problems_one_message_each(fake_module) -> None:
    def renamed(ds, consumed_samples):
        return None

    def init_without(extra_args_provider=None):
        return None

    fake_module.build_loader = renamed
    fake_module.initialize = init_without
    points = GOOD + (HookPoint(FAKE, "gone"), HookPoint(FAKE, "not_a_function"),
                     HookPoint("fake_megatron_no_such_module_xyz", "f"))
    found = contract.problems(points)
    assert len(found) == 5, found
    by_name = {p.split(" ", 1)[0]: p for p in found}
    assert set(by_name) == {f"{FAKE}.build_loader", f"{FAKE}.initialize", f"{FAKE}.gone",
                            f"{FAKE}.not_a_function", "fake_megatron_no_such_module_xyz.f"}
    assert "ds, consumed_samples" in by_name[f"{FAKE}.build_loader"]
    assert "dataset, consumed_samples" in by_name[f"{FAKE}.build_loader"]
    assert "allow_no_cuda" in by_name[f"{FAKE}.initialize"]
    assert "extra_args_provider" not in by_name[f"{FAKE}.initialize"].split("takes", 1)[1]
    assert "missing" in by_name[f"{FAKE}.gone"]
    assert "not callable" in by_name[f"{FAKE}.not_a_function"]
    assert "missing" in by_name["fake_megatron_no_such_module_xyz.f"]


def test_contract_param_order_matters(fake_module) -> None:
    def swapped(consumed_samples, dataset):
        return None

    fake_module.build_loader = swapped
    found = contract.problems(GOOD[:1])
    assert len(found) == 1 and found[0].startswith(f"{FAKE}.build_loader takes (consumed_samples, dataset)")


def test_contract_check_names_version_and_first_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contract, "megatron_version", lambda: "core_v9.9.9")
    monkeypatch.setattr(contract, "problems", lambda points=None: ["a.b is missing (AttributeError)"])
    with pytest.raises(MegatronLMChanged) as exc:
        contract.check()
    msg = str(exc.value)
    assert "core_v9.9.9" in msg and "a.b is missing" in msg and "\n" not in msg
    for v in contract.RUN_TESTED:
        assert v in msg
    assert "more)" not in msg
    monkeypatch.setattr(contract, "problems", lambda points=None: ["a.b is missing", "c.d is missing"])
    with pytest.raises(MegatronLMChanged, match=r"a\.b is missing \(and 1 more\)"):
        contract.check()
    monkeypatch.setattr(contract, "problems", lambda points=None: [])
    assert contract.check() is None


def test_contract_megatron_core_hook_point_holds() -> None:
    # megatron.core is installed in CI: its part of the contract must hold
    core = tuple(hp for hp in contract.HOOK_POINTS if hp.module.startswith("megatron.core"))
    assert core
    assert contract.problems(core) == []
    assert contract.megatron_version().startswith("core_v")


# ----------------------------------------------------------------------------- launcher


def test_split_command_separates_everything() -> None:
    plan = launcher.split_command([
        "--nproc_per_node=2", "--nnodes", "1", "--standalone", "--master_addr", "h0",
        "pretrain_gpt.py", "--num-layers", "2", "--falcon", "--lr", "1e-4",
        "--falcon-out", "out dir", "--falcon-min-duration=20", "--falcon_force_microbatches", "3,5",
        "--calculate-per-token-loss",
    ])
    assert plan.torchrun == ["--nproc-per-node=2", "--nnodes", "1", "--standalone", "--master-addr", "h0"]
    assert plan.script == "pretrain_gpt.py"
    assert plan.script_args == ["--num-layers", "2", "--lr", "1e-4", "--calculate-per-token-loss"]
    assert plan.falcon_args == ["--falcon", "--falcon-out", "out dir", "--falcon-min-duration=20",
                                "--falcon_force_microbatches", "3,5"]
    assert plan.falcon


@pytest.mark.parametrize("spelling", [["--nproc-per-node", "2"], ["--nproc_per_node", "2"]])
def test_split_command_canonicalises_separate_values(spelling) -> None:
    plan = launcher.split_command(spelling + ["train.py", "--x", "1"])
    assert plan.torchrun == ["--nproc-per-node", "2"]
    assert plan.script == "train.py" and plan.script_args == ["--x", "1"]
    assert plan.falcon_args == [] and not plan.falcon


def test_split_command_falcon_flags_without_falcon_switch() -> None:
    plan = launcher.split_command(["train.py", "--falcon-out", "o"])
    assert plan.falcon_args == ["--falcon-out", "o"] and not plan.falcon
    assert plan.torchrun == [] and plan.script_args == []


@pytest.mark.parametrize("argv, words", [
    (["-m", "pkg.train"], "-m"),
    (["--module", "pkg.train"], "--module"),
    (["--no-python", "train.sh"], "--no-python"),
    (["--no_python", "train.sh"], "--no-python"),
    (["--bogus", "1", "train.py"], "--bogus"),
    (["--nnodes", "1", "--frobnicate=3", "train.py"], "--frobnicate"),
    ([], "no training script"),
    (["--nnodes", "1"], "no training script"),
    (["--nproc-per-node"], "needs a value"),
    (["train.py", "--lr", "1", "--falcon", "--falcon-x"], "--falcon-x needs a value"),
])
def test_split_command_refusals(argv, words) -> None:
    with pytest.raises(InputError) as exc:
        launcher.split_command(argv)
    msg = str(exc.value)
    assert words in msg and "\n" not in msg


def test_option_last_one_wins() -> None:
    args = ["--save", "a", "--lr=0.1", "--save", "b", "--exit-signal-handler"]
    assert launcher.option(args, "--save") == "b"
    assert launcher.option(args, "--lr") == "0.1"
    assert launcher.option(args, "--load") is None
    assert launcher.option(["--save"], "--save") is None  # no value follows
    assert launcher.option(["--save-interval", "5"], "--save") is None  # a prefix is another flag


def test_set_option_replaces_and_adds() -> None:
    assert launcher.set_option(["--load", "old", "--lr", "1"], "--load", "new") == ["--lr", "1", "--load", "new"]
    assert launcher.set_option(["--load=old", "--lr", "1"], "--load", "new") == ["--lr", "1", "--load", "new"]
    assert launcher.set_option(["--lr", "1"], "--load", "ck") == ["--lr", "1", "--load", "ck"]
    # a switch: added once, and it never swallows the next flag
    assert launcher.set_option(["--lr", "1"], "--exit-signal-handler", None) == ["--lr", "1", "--exit-signal-handler"]
    assert launcher.set_option(["--exit-signal-handler", "--lr", "1"], "--exit-signal-handler", None) == \
        ["--lr", "1", "--exit-signal-handler"]
    # a value after a bare flag that is followed by another flag: the other flag is kept
    assert launcher.set_option(["--load", "--lr", "1"], "--load", "x") == ["--lr", "1", "--load", "x"]
    # a flag sharing a prefix is left alone
    assert launcher.set_option(["--save-interval", "5"], "--save", "d") == ["--save-interval", "5", "--save", "d"]


def test_script_namespace_reads_the_s2_settings() -> None:
    ns = launcher.script_namespace([])
    assert ns.calculate_per_token_loss is False
    assert ns.dataloader_type == "single" and ns.rampup_batch_size is None
    assert s2_refusal(ns) is not None and "--calculate-per-token-loss" in s2_refusal(ns)

    ns = launcher.script_namespace(["--num-layers", "2", "--calculate-per-token-loss"])
    assert ns.calculate_per_token_loss is True and s2_refusal(ns) is None

    ns = launcher.script_namespace(["--calculate-per-token-loss", "--dataloader-type", "cyclic"])
    assert ns.dataloader_type == "cyclic" and "--dataloader-type" in s2_refusal(ns)
    assert launcher.script_namespace(["--dataloader-type=external"]).dataloader_type == "external"

    ns = launcher.script_namespace(["--calculate-per-token-loss", "--rampup-batch-size", "16", "16", "1000"])
    assert ns.rampup_batch_size == "16" and "--rampup-batch-size" in s2_refusal(ns)

    ns = launcher.script_namespace(["--calculate-per-token-loss", "--cuda-graph-impl", "local",
                                    "--cuda-graph-scope", "full_iteration"])
    assert "CUDA graph" in s2_refusal(ns)

    ns = launcher.script_namespace(["--calculate-per-token-loss", "--num-layers-per-virtual-pipeline-stage", "2"])
    assert s2_refusal(ns) is not None


def test_restart_roles_none_for_s4_and_checked_for_s3() -> None:
    assert launcher.restart_roles({}, 4) is None
    assert launcher.restart_roles({"strategy": "S4"}, 4) is None
    assert launcher.restart_roles({"roles": [1, 0, 3, 2]}, 4) == [1, 0, 3, 2]
    for bad, words in (([0, 0, 1, 2], "played twice"), ([0, 1], "expected world = 4"), ("0123", "string"),
                       ([0, 1, 2, 9], "roles[3] = 9")):
        with pytest.raises(InputError) as exc:
            launcher.restart_roles({"roles": bad}, 4)
        assert words in str(exc.value) and "\n" not in str(exc.value)


def test_roles_env_without_gpus_names_the_roles_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "_has_cuda", lambda: False)
    assert launcher.roles_env([1, 0], {"CUDA_VISIBLE_DEVICES": "4,5"}) == {ROLES_ENV: "[1, 0]"}


def test_roles_env_gives_each_local_rank_the_gpu_of_the_process_playing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "_has_cuda", lambda: True)  # this machine has no GPU: say it has
    # process 0 plays rank 2, process 1 rank 0, process 2 rank 1: rank 0 runs on process 1's GPU
    env = launcher.roles_env([2, 0, 1], {})
    assert env == {ROLES_ENV: "[2, 0, 1]", "CUDA_VISIBLE_DEVICES": "1,2,0"}
    # the GPUs as the job listed them, not their indices
    assert launcher.roles_env([2, 0, 1], {"CUDA_VISIBLE_DEVICES": "5, 6, 7"})["CUDA_VISIBLE_DEVICES"] == "6,7,5"
    with pytest.raises(InputError) as exc:
        launcher.roles_env([2, 0, 1], {"CUDA_VISIBLE_DEVICES": "5,6"})
    assert "lists 2 GPUs" in str(exc.value)


def test_roles_from_env_reads_and_checks_the_launchers_roles() -> None:
    assert roles_from_env(2, {}) is None
    assert roles_from_env(3, {ROLES_ENV: "[2, 0, 1]"}) == [2, 0, 1]
    for text, words in (("[0, 0]", "played twice"), ("{", "not a JSON list"), ('{"a": 1}', "not a JSON list"),
                        ("[0, 1, 2]", "expected world = 2")):
        with pytest.raises(ValueError) as exc:
            roles_from_env(2, {ROLES_ENV: text})
        assert words in str(exc.value) and ROLES_ENV in str(exc.value)


@pytest.mark.parametrize("roles, words", [("0,0", "played twice"), ("0,1,2", "expected world = 2"),
                                          ("x", "ITERATION:ROLES")])
def test_launch_refuses_a_forced_topology_that_is_not_a_permutation(tmp_path, roles, words) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    with pytest.raises(InputError) as exc:
        launcher.launch(["--nproc-per-node", "2", str(script), "--falcon", "--falcon-out", str(tmp_path / "o"),
                         "--falcon-force-topology", f"3:{roles}"])
    assert words in str(exc.value) and "\n" not in str(exc.value)


# ----------------------------------------------------------------------------- hooks


def test_parse_flags_accepts_known_flags() -> None:
    ns = parse_flags(["--falcon", "--falcon-out", "X", "--falcon-force-microbatches", "3,5",
                      "--falcon-min-duration", "20"])
    assert ns.falcon is True
    assert ns.falcon_out == "X"
    assert ns.falcon_force_microbatches == "3,5"
    assert ns.falcon_min_duration == 20
    empty = parse_flags([])
    assert empty.falcon is False and empty.falcon_out is None and empty.falcon_min_duration is None


def test_parse_flags_unknown_or_bad_value_is_flag_error() -> None:
    with pytest.raises(FlagError) as exc:
        parse_flags(["--falcon", "--falcon-bogus", "1"])
    assert "--falcon-bogus" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(FlagError):
        parse_flags(["--falcon-min-duration", "soon"])
    with pytest.raises(FlagError):
        parse_flags(["--falcon-device", "tpu"])


def test_add_arguments_extends_a_plain_parser() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-layers", type=int)
    assert add_arguments(parser) is parser
    ns = parser.parse_args(["--num-layers", "2", "--falcon", "--falcon-min-duration", "7"])
    assert ns.falcon is True and ns.num_layers == 2 and ns.falcon_min_duration == 7
    assert parser.parse_args([]).falcon is False


# ----------------------------------------------------------------------------- cpu


def test_cpu_script_flags_adds_missing() -> None:
    from falconext.megatron_lm.cpu import CPU_FLAGS, script_flags

    out = script_flags(["--num-layers", "2"])
    assert out[:2] == ["--num-layers", "2"]
    assert launcher.option(out, "--transformer-impl") == "local"
    assert launcher.option(out, "--distributed-backend") == "gloo"
    assert "--no-gradient-accumulation-fusion" in out
    for flag in CPU_FLAGS:
        assert out.count(flag) == 1


def test_cpu_script_flags_keeps_user_choices() -> None:
    from falconext.megatron_lm.cpu import script_flags

    argv = ["--transformer-impl", "transformer_engine", "--gradient-accumulation-fusion", "--clip-grad=1.0"]
    out = script_flags(argv)
    assert out[: len(argv)] == argv
    assert out.count("--transformer-impl") == 1 and launcher.option(out, "--transformer-impl") == "transformer_engine"
    assert "--gradient-accumulation-fusion" in out and "--no-gradient-accumulation-fusion" not in out
    assert launcher.option(out, "--clip-grad") == "1.0" and out.count("--clip-grad") == 0
    assert "--no-rope-fusion" in out  # the others are still added
    assert script_flags(out) == out  # idempotent


# ----------------------------------------------------------------------------- period.inner_period


def _with_insert(block: list[int], reps: int, insert: list[int], at: int) -> list[int]:
    seq = block * reps
    pos = at * len(block) + len(block) // 2  # in the middle of block ``at``
    return seq[:pos] + insert + seq[pos:]


BLOCK44 = list(range(44))


def test_inner_period_finds_the_iteration_under_an_insert() -> None:
    t = _with_insert(BLOCK44, 10, [100, 101], at=3)
    assert len(t) == 442
    assert inner_period(t, max_insert=8) == 44
    # any rotation of the template
    assert inner_period(t[100:] + t[:100], max_insert=8) == 44


def test_inner_period_with_idle_each_block_pausing() -> None:
    block_idle = [1.0] + [0.001] * 43  # the step's long pause before each iteration's first call
    t = _with_insert(BLOCK44, 10, [100, 101], at=3)
    idle = _with_insert(block_idle, 10, [0.002, 0.002], at=3)
    assert len(idle) == len(t)
    assert inner_period(t, max_insert=8, idle=idle) == 44
    assert inner_period(np.array(t), max_insert=8, idle=np.array(idle)) == 44


def test_inner_period_an_insertion_may_take_the_steps_pause() -> None:
    # a log all-gather issued right after the step's pause: the pause is before the
    # inserted call, and the iteration after it starts with a short idle
    t = [0, 1, 2, 3] * 3 + [9]
    idle = [0.001, 0.001, 0.001, 0.001] + [1.0, 0.001, 0.001, 0.001] * 2 + [1.0]
    assert inner_period(t, max_insert=2, idle=idle) == 4
    # and the pause before the inserted call taken by the block before it
    t = [9] + [0, 1, 2, 3] * 3
    idle = [1.0] + [0.001] * 4 + [1.0, 0.001, 0.001, 0.001] * 2
    assert inner_period(t, max_insert=2, idle=idle) == 4


def test_inner_period_rejects_a_1f1b_unit_with_idle() -> None:
    unit = [0, 1, 2, 3, 4, 5]
    t = unit * 16 + [9]
    idle = [0.001] * len(t)
    idle[0] = 1.0  # only one unit holds the step's pause
    assert inner_period(t, max_insert=4) == 6  # the symbols alone would take the unit
    assert inner_period(t, max_insert=4, idle=idle) is None


def test_inner_period_none_cases() -> None:
    exact = BLOCK44 * 10
    assert inner_period(exact, max_insert=8) is None  # k == 0: an exact multiple
    t = _with_insert(BLOCK44, 10, [100, 101], at=3)
    assert inner_period(t, max_insert=0) is None
    five = _with_insert(BLOCK44, 10, [100, 101, 102, 103, 104], at=5)
    assert inner_period(five, max_insert=4) is None  # longer than max_insert
    assert inner_period(five, max_insert=5) == 44
    # a block that differs between repeats is not an iteration
    broken = list(t)
    broken[10] = 77
    broken[200] = 78
    assert inner_period(broken, max_insert=8) is None


def test_same_series_compares_major_and_minor_only() -> None:
    from falconext.megatron_lm.patching import same_series

    assert same_series("core_v0.19.0", "0.19.2") and same_series("core_v0.16.1", "0.16.1")
    assert not same_series("core_v0.20.0", "0.19.2") and not same_series("core_v0.19.0", "0.1.9")
    assert not same_series("core_v0.19.0", None) and not same_series("unknown", "0.19.2")


def _checkout(root, major: int, minor: int) -> str:
    """A folder with a Megatron-LM package_info.py of MAJOR.MINOR.0 and a pretrain_gpt.py."""
    info = root / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = 0\nPRE_RELEASE = ''\n")
    (root / "pretrain_gpt.py").write_text("")
    return str(root / "pretrain_gpt.py")


def test_a_checkout_of_another_series_runs_on_its_own_core(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import version

    from falconext.megatron_lm.rank import own_core_first

    monkeypatch.setattr(sys, "path", list(sys.path))
    major, minor = (int(x) for x in version("megatron-core").split(".")[:2])
    same = _checkout(tmp_path / "same", major, minor)
    assert own_core_first(same) is None and str(tmp_path / "same") not in sys.path
    other = _checkout(tmp_path / "other", major, minor + 1)
    said = own_core_first(other)
    assert said is not None and f"core_v{major}.{minor + 1}.0 runs on its own megatron/core" in said
    assert sys.path[0] == str(tmp_path / "other")
    assert own_core_first(str(tmp_path / "not-a-checkout.py")) is None
