"""torchrun whose ranks are forked from one process that has imported torch already.

``python -m falconext.testbed.forkrun <torchrun options> -m falconext.train <rank args>``
is ``torchrun`` (the same parser, rendezvous, elastic agent, environment per worker and
failure handling: :func:`torch.distributed.run.config_from_args` and
:func:`torch.distributed.launcher.api.elastic_launch`) with one difference: the workers are
not fresh interpreters that each import torch and megatron-core (about 2.6 s of CPU a rank,
which four ranks on the test bed's two cores pay in turn), but ``fork``\\ s of this
process, which has imported them once. The agent's function entrypoint with the ``fork``
start method is torch's own; each worker runs :func:`falconext.train.main` on the rank
arguments, exactly what ``-m falconext.train`` would run.

Only the test bed's own ``falconext.train`` runs this way (the launcher of
:mod:`falconext.testbed.launch`); ``falconext launch`` runs Megatron-LM's scripts under
plain torchrun.
"""

from __future__ import annotations

import gc

gc.disable()  # as falconext.train: no collections while torch and megatron-core import

import sys  # noqa: E402

#: the one script this runner starts
MODULE = "falconext.train"


def _preload() -> None:
    """Import what every rank imports before its first iteration, so the forks share it."""
    import falconext.train  # noqa: F401  (torch)
    import falconext.testbed.emulator  # noqa: F401
    import falconext.testbed.trainer  # noqa: F401  (megatron-core)
    import falconext.runtime.runtime  # noqa: F401
    import falconext.control.client  # noqa: F401  (redis)
    import megatron.core.distributed.finalize_model_grads  # noqa: F401  (what model.build imports)
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.tensor_parallel.random  # noqa: F401


def _rank(*argv: str) -> int:
    """One worker: ``falconext.train`` on ``argv`` with a fresh garbage collector state."""
    from falconext import train

    return train.main(list(argv))


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` cut at ``-m falconext.train``: (torchrun's options, the rank's arguments).
    Raises ValueError when the module is missing or is another one."""
    for i, arg in enumerate(argv[:-1]):
        if arg in ("-m", "--module") and argv[i + 1] == MODULE:
            return argv[:i], argv[i + 2:]
        if arg in ("-m", "--module"):
            raise ValueError(f"forkrun runs {MODULE} only, not {argv[i + 1]!r}")
    raise ValueError(f"forkrun: no '-m {MODULE}' on the command line")


def main(argv: list[str] | None = None) -> int:
    """Run the ranks as torchrun would, forked; returns 0 when every rank returned 0
    (a failed rank raises torch's ChildFailedError, whose report names it)."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    launcher_args, rank_args = split_argv(list(sys.argv[1:] if argv is None else argv))
    # torchrun's own parser needs a script: ours is the module's, whose arguments are ours
    args = parse_args([*launcher_args, "--start-method", "fork", "-m", MODULE])
    if args.rdzv_backend == "static" and args.master_port is None:
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    _preload()
    gc.collect()
    gc.freeze()  # the imports' objects: shared with the forks, never touched by their collections
    elastic_launch(config=config, entrypoint=_rank)(*rank_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
