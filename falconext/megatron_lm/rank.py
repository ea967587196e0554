"""One rank of a Megatron-LM job under ``falconext launch``: ``python -m falconext.megatron_lm.rank SCRIPT ...``.

torchrun starts this in place of the training script. It reads the launcher's ``--falcon*``
flags from the environment (:data:`falconext.megatron_lm.hooks.FLAGS_ENV`), applies the CPU
mode where there is no CUDA, checks Megatron-LM's hook points (:mod:`.contract`) and, only
if all hold, puts falconext's wrappers in place of them; then it runs the script as
``__main__`` with its own arguments, as ``python SCRIPT ...`` would. No file of Megatron-LM
is changed. A Megatron-LM whose hook points changed is refused before training starts,
with one line naming its version.
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from falconext.elastic.hosts import node_name
from falconext.inputs import set_option
from falconext.megatron_lm import contract, cpu, hooks
from falconext.megatron_lm.patching import PatchError, megatron_version, same_series
from falconext.mitigate import restart
from falconext.model.roles import check_roles

EXIT_REFUSED = 2


def use_compiled_helpers() -> bool:
    """Import the installed megatron-core (where there is one) before the script's folder joins
    the path, and where its dataset helpers come compiled (the wheel ships them, and no
    Makefile), turn Megatron-LM's ``compile_helpers`` (``make`` in that folder, which would
    fail) into nothing. True when the compiled helpers are used."""
    try:
        # lazy: run-time order (the installed megatron-core, before the script's folder joins sys.path)
        import megatron.core.datasets.helpers_cpp  # noqa: F401
        from megatron.core.datasets import utils
    except ImportError:  # none installed, or not compiled: Megatron-LM compiles them as usual
        return False
    utils.compile_helpers = lambda: None
    return True


def own_core_first(script: str) -> str | None:
    """Where the script's checkout brings a megatron/core of another MAJOR.MINOR series than
    the installed megatron-core (Megatron-LM main: 0.20 against 0.19.2), or where none is
    installed, put the checkout first on the path, so that Megatron-LM's training code runs
    on its own core. Returns a line saying so, or None when the installed one is used."""
    root = os.path.dirname(os.path.abspath(script))
    try:
        theirs = megatron_version(root)
    except PatchError:  # not a checkout's root: the installed megatron-core, as always
        return None
    try:
        installed = version("megatron-core")
    except PackageNotFoundError:
        installed = None
    if same_series(theirs, installed):
        return None
    sys.path.insert(0, root)
    return f"Megatron-LM {theirs} runs on its own megatron/core (installed megatron-core: {installed or 'none'})"


def main(argv: list[str] | None = None) -> int:
    """Run one rank of a Megatron-LM script, ``argv`` = SCRIPT and its arguments (default
    ``sys.argv[1:]``), with falconext installed first when the launcher's flags say
    ``--falcon`` (CPU mode where there is no CUDA). Returns the script's status, 0 when
    it ends normally, or 2 with one line on stderr for missing arguments, bad flags or a
    Megatron-LM whose hook points changed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("falconext.megatron_lm.rank: usage: SCRIPT [script arguments]", file=sys.stderr)
        return EXIT_REFUSED
    script, script_args = argv[0], argv[1:]

    try:
        flags = hooks.parse_flags(json.loads(os.environ.get(hooks.FLAGS_ENV, "[]")))
    except (hooks.FlagError, json.JSONDecodeError, TypeError) as exc:
        print(f"falconext launch: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    said = own_core_first(script)
    if said and os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"falconext: {said}", file=sys.stderr, flush=True)

    cpu_mode = not torch.cuda.is_available()
    if cpu_mode:
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

        cpu.enable()  # megatron.core comes from the installed megatron-core from here on
        script_args = cpu.script_flags(script_args)
    # on either device megatron.core is the installed megatron-core where there is one (or
    # the checkout's own, see own_core_first): its compiled helpers spare Megatron's make
    use_compiled_helpers()
    # the script's folder, as ``python SCRIPT`` would put it: Megatron-LM's ``megatron``
    # namespace joins the installed megatron-core's
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    if not flags.falcon:  # CPU mode only: Megatron-LM as it is
        if cpu_mode:
            cpu.patch_training_modules()
        return _run(script, script_args)

    try:
        contract.check()
    except contract.MegatronLMChanged as exc:
        print(f"falconext launch: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    if cpu_mode:
        cpu.patch_training_modules()
    install(flags)
    if os.environ.get(hooks.MULTI_NODE_ENV) == "1":  # a TorchElastic round after a restart resumes
        script_args = resumed_args(flags.falcon_out or "falcon-out", script_args, os.environ)
    code = _run(script, script_args)
    return hooks.exit_status(code)


def resumed_args(out: str, script_args: list[str], environ: Any) -> list[str]:
    """In a job of several launchers, the ranks of a round that follows a restart (the
    job's ``restart.json`` names it) resume from its checkpoint: ``--load`` set, and the
    attempt and the restart's request time in ``environ`` (S4's cost is measured from
    it). Unchanged when the job has not restarted."""
    path = os.path.join(out, restart.RESTART_FILE)
    if not os.path.exists(path):
        return script_args
    try:
        req = restart.read_request(path)
    except restart.CheckpointError as exc:
        print(f"falconext: {exc}; this round starts without --load", file=sys.stderr)
        return script_args
    environ[hooks.ATTEMPT_ENV] = str(req.attempt)
    environ[restart.LAUNCH_TIME_ENV] = repr(req.requested_at)
    said = resumed_roles(req.extra, environ)
    if said:
        print(f"falconext: {said}", file=sys.stderr, flush=True)
    return set_option(script_args, "--load", req.checkpoint)


def resumed_roles(extra: dict, environ: Any) -> str | None:
    """After an S3 restart of a job of several launchers, this process plays the torch rank
    the plan gives it: ``RANK`` becomes ``roles[process]`` (process = the rank torchrun gave,
    ``GROUP_RANK x LOCAL_WORLD_SIZE + LOCAL_RANK``: node by node, in rendezvous order) and
    :data:`~falconext.megatron_lm.hooks.ROLES_ENV` is set. Ranks move between nodes this
    way because a process cannot move: its node's GPUs are its own (within one launcher,
    ``CUDA_VISIBLE_DEVICES`` moves them instead). Every process decides from what all share
    (the request and ``WORLD_SIZE``), so all agree: the roles apply when the round has the
    world they were planned for, by node index, even when another host now has that index
    (then a line says so). ``LOCAL_RANK``, the process's device, is left alone. Returns a
    line to print, or None."""
    roles = extra.get("roles")
    if roles is None:
        return None
    try:
        world, process = int(environ["WORLD_SIZE"]), int(environ["RANK"])
        checked = list(check_roles(roles, len(roles) if isinstance(roles, list) else 0, "the restart request's roles"))
    except (KeyError, ValueError, TypeError) as exc:
        return f"S3 roles not applied: {exc}"
    if world != len(checked):
        return None if process else f"S3 roles not applied: planned for {len(checked)} ranks, this round has {world}"
    environ[hooks.ROLES_ENV] = json.dumps(checked)
    environ["RANK"] = str(checked[process])
    hosts = extra.get("hosts")
    group = int(environ.get("GROUP_RANK", "0") or 0)
    if int(environ.get("LOCAL_RANK", "0") or 0) == 0 and isinstance(hosts, list) and group < len(hosts) \
            and hosts[group] != node_name(environ):
        return f"node {node_name(environ)} plays the S3 roles planned for node index {group} (host {hosts[group]})"
    return None


def _run(script: str, script_args: list[str]) -> int:
    """The script as ``__main__`` with its arguments, as ``python SCRIPT ARGS`` runs it."""
    sys.argv = [script, *script_args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:  # Megatron's own exit (sys.exit after its exit signal's checkpoint)
        if exc.code is None or isinstance(exc.code, int):
            return int(exc.code or 0)
        raise
    return 0


def install(flags: Any) -> None:
    """falconext's wrappers in place of the hook points (all checked by :func:`contract.check`)."""
    # lazy: run-time order (megatron.training: once the script's folder is on sys.path)
    import megatron.training.ft_integration as ft
    import megatron.training.training as training
    from megatron.training.global_vars import get_args

    get_fb = training.get_forward_backward_func

    @functools.wraps(get_fb)
    def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
        return hooks.forward_backward(get_fb(*args, **kwargs))

    training.get_forward_backward_func = get_forward_backward_func

    start, end = ft.on_training_step_start, ft.on_training_step_end

    @functools.wraps(start)
    def on_training_step_start() -> None:  # Megatron's ft hook first, then falconext's
        start()
        hooks.loop_start(get_args().curr_iteration)

    @functools.wraps(end)
    def on_training_step_end() -> None:
        hooks.loop_end()
        end()

    ft.on_training_step_start = on_training_step_start
    ft.on_training_step_end = on_training_step_end

    init = training.initialize_megatron

    @functools.wraps(init)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        result = init(*args, **kwargs)
        hooks.on_initialized(get_args(), flags)
        return result

    training.initialize_megatron = initialize_megatron

    build = training.build_pretraining_data_loader

    @functools.wraps(build)
    def build_pretraining_data_loader(dataset: Any, consumed_samples: int) -> Any:
        loader = build(dataset, consumed_samples)
        sampler = getattr(loader, "batch_sampler", None)
        if sampler is None:
            return loader
        planned = hooks.train_sampler(sampler, dataset)
        return loader if planned is sampler else _reloader(loader, dataset, planned)

    training.build_pretraining_data_loader = build_pretraining_data_loader


def _reloader(loader: Any, dataset: Any, batch_sampler: Any) -> Any:
    """``loader`` again, with ``batch_sampler`` (a DataLoader's sampler is fixed once built)."""
    extra = {"prefetch_factor": loader.prefetch_factor} if loader.num_workers > 0 else {}
    return torch.utils.data.DataLoader(
        dataset, batch_sampler=batch_sampler, num_workers=loader.num_workers, pin_memory=loader.pin_memory,
        collate_fn=loader.collate_fn, worker_init_fn=loader.worker_init_fn,
        persistent_workers=loader.persistent_workers, **extra)


if __name__ == "__main__":
    sys.exit(main())
