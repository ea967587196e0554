"""torchrun whose ranks are forked from a fork server that has imported torch already.

``python -m falconext.testbed.forkrun <torchrun options> -m falconext.train <rank args>``
is ``torchrun`` (the same parser, rendezvous, elastic agent, environment per worker and
failure handling: :func:`torch.distributed.run.config_from_args` and
:func:`torch.distributed.launcher.api.elastic_launch`) with one difference: the workers are
not fresh interpreters that each import torch and megatron-core (about 2.6 s of CPU a rank,
which four ranks on the test bed's two cores pay in turn), but forks of one fork server
that imported them once (:mod:`falconext.testbed.rankimports`). The agent's function
entrypoint with the ``forkserver`` start method is torch's own; each worker runs
:func:`falconext.train.main` on the rank arguments, exactly what ``-m falconext.train``
would run.

Why a fork server and not forks of this process: the agent here runs threads (its
rendezvous store's server among them) that call into glibc (a reverse name lookup for every
connection a rank makes), and a fork taken while one of them holds glibc's resolver lock
hands the child a lock no thread will release: that rank hangs at its first connection
(seen once in a 16-rank job: 15 ranks waiting 30 minutes for the 16th in gloo's
rendezvous). The fork server is a fresh single-threaded interpreter, so its forks inherit
no held lock.

Only the test bed's own ``falconext.train`` runs this way (the launcher of
:mod:`falconext.testbed.launch`); ``falconext launch`` runs Megatron-LM's scripts under
plain torchrun.
"""

from __future__ import annotations

import gc

gc.disable()  # as falconext.train: no collections while torch imports (the agent's)

import sys  # noqa: E402

#: the one script this runner starts
MODULE = "falconext.train"
#: what the fork server imports before it forks a rank
PRELOAD = "falconext.testbed.rankimports"


def _rank(*argv: str) -> int:
    """One worker: ``falconext.train`` on ``argv``."""
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
    import multiprocessing
    from multiprocessing import forkserver

    launcher_args, rank_args = split_argv(list(sys.argv[1:] if argv is None else argv))
    # the fork server starts now: its imports run while this process imports torch for the
    # agent (two cores, two imports at once), and its forks are taken from then on
    multiprocessing.get_context("forkserver").set_forkserver_preload([PRELOAD])
    forkserver.ensure_running()

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    from falconext.testbed import forkrun  # this module by its name: run as -m, it is __main__

    # torchrun's own parser needs a script: ours is the module's, whose arguments are ours
    args = parse_args([*launcher_args, "--start-method", "forkserver", "-m", MODULE])
    if args.rdzv_backend == "static" and args.master_port is None:
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    elastic_launch(config=config, entrypoint=forkrun._rank)(*rank_args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
