"""torchrun whose ranks are forks of a process that has imported torch already.

``python -m falconext.testbed.forkrun <torchrun options> -m falconext.testbed.train <rank args>``
is ``torchrun`` (the same parser, rendezvous, elastic agent, environment per worker and
failure handling: :func:`torch.distributed.run.config_from_args` and
:func:`torch.distributed.launcher.api.elastic_launch`) with one difference: the workers are
not fresh interpreters that each import torch and megatron-core (about 2.6 s of CPU a rank,
which four ranks on the test bed's two cores pay in turn), but forks of a process that
imported them once (:mod:`falconext.testbed.rankimports`). The agent's function entrypoint
with torch's own ``fork`` or ``forkserver`` start method runs :func:`falconext.testbed.train.main`
on the rank arguments in each worker, exactly what ``-m falconext.testbed.train`` would run.

Forks and threads. The agent runs threads (its rendezvous store's server among them) that
call into glibc: a reverse name lookup for every connection a rank makes. A fork taken while
one of them holds glibc's resolver lock hands the child a lock no thread will release, and
that rank hangs at its first connection (seen once: one rank of a 16-rank job, the other
15 waiting for it in gloo's rendezvous). So:

* one node (every test-bed job on loopback): the agent forks the ranks, and each rank waits
  until all of this node's ranks exist before it connects anywhere (:func:`_all_forked`);
  the only connections the agent's threads serve come from these ranks, so none is served
  while a fork is taken;
* several nodes (``--net netns``): another node's ranks connect whenever they start, so the
  ranks are forks of a fork server instead, a fresh single-threaded interpreter that
  imported the same modules (about 0.4 s more per job).

Only the test bed's own ``falconext.testbed.train`` runs this way (the launcher of
:mod:`falconext.testbed.launch`); ``falconext launch`` runs Megatron-LM's scripts under
plain torchrun.
"""

from __future__ import annotations

import gc

gc.disable()  # as falconext.testbed.train: no collections while torch imports

import importlib  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from multiprocessing import forkserver  # noqa: E402

#: the one script this runner starts
MODULE = "falconext.testbed.train"
#: what the ranks' parent (the agent, or the fork server) imports before it forks them
PRELOAD = "falconext.testbed.rankimports"
#: the longest a rank waits for its node's other ranks to be forked
FORK_WAIT_S = 60.0
#: the folder where this node's forked ranks say they exist (set before the forks)
_forks_dir: str | None = None


def _all_forked(folder: str, local_rank: str, local_world: int, deadline_s: float = FORK_WAIT_S) -> bool:
    """Say this rank exists (a file named after its local rank in ``folder``), then wait
    until ``local_world`` ranks have: the agent has taken its last fork. False when the
    deadline came first (a sibling that died before it started: the agent handles that)."""
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, local_rank), "w").close()
    end = time.monotonic() + deadline_s
    while len(os.listdir(folder)) < local_world:
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def _rank(*argv: str) -> int:
    """One worker: ``falconext.testbed.train`` on ``argv`` (forked by the agent: once every rank of
    this node has been forked)."""
    if _forks_dir is not None:
        _all_forked(os.path.join(_forks_dir, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    os.environ["LOCAL_RANK"], int(os.environ["LOCAL_WORLD_SIZE"]))
    from falconext.testbed import train  # lazy: run-time order (no torch before main() starts the fork server)

    return train.main(list(argv))


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` cut at ``-m falconext.testbed.train``: (torchrun's options, the rank's arguments).
    Raises ValueError when the module is missing or is another one."""
    for i, arg in enumerate(argv[:-1]):
        if arg in ("-m", "--module") and argv[i + 1] == MODULE:
            return argv[:i], argv[i + 2:]
        if arg in ("-m", "--module"):
            raise ValueError(f"forkrun runs {MODULE} only, not {argv[i + 1]!r}")
    raise ValueError(f"forkrun: no '-m {MODULE}' on the command line")


def _nodes(launcher_args: list[str]) -> str:
    """torchrun's ``--nnodes`` as given (``--nnodes N`` or ``--nnodes=N``; "1" without it),
    read before torch is imported: it chooses how the ranks are forked."""
    for i, arg in enumerate(launcher_args):
        if arg == "--nnodes" and i + 1 < len(launcher_args):
            return launcher_args[i + 1]
        if arg.startswith("--nnodes="):
            return arg.split("=", 1)[1]
    return "1"


def main(argv: list[str] | None = None) -> int:
    """Run the ranks as torchrun would, forked; returns 0 when every rank returned 0
    (a failed rank raises torch's ChildFailedError, whose report names it)."""
    launcher_args, rank_args = split_argv(list(sys.argv[1:] if argv is None else argv))
    method = "fork" if _nodes(launcher_args) == "1" else "forkserver"
    if method == "forkserver":
        # started now: its imports run while this process imports torch for the agent
        multiprocessing.get_context("forkserver").set_forkserver_preload([PRELOAD])
        forkserver.ensure_running()

    # lazy: run-time order (torch after the fork server has started)
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    # lazy: import cycle (this module by its name: run as -m, it is __main__)
    from falconext.testbed import forkrun

    # torchrun's own parser needs a script: ours is the module's, whose arguments are ours
    args = parse_args([*launcher_args, "--start-method", method, "-m", MODULE])
    if args.rdzv_backend == "static" and args.master_port is None:
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    if method == "fork":
        importlib.import_module(PRELOAD)  # shared with the forks, frozen out of their collections
        forkrun._forks_dir = tempfile.mkdtemp(prefix="falconext-forks-")
    try:
        elastic_launch(config=config, entrypoint=forkrun._rank)(*rank_args)
    finally:
        if forkrun._forks_dir is not None:
            shutil.rmtree(forkrun._forks_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
