"""What several real Megatron-LM test files share."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Where the Slurm bed runs, the nodes-bed jobs marked ``slurm_covers`` are deselected:
    tests/megatron_lm/test_slurm.py holds their assertions under a real Slurm. Said once
    at the end of the run (the terminal summary's deselected count, and this line)."""
    covered = [item for item in items if item.get_closest_marker("slurm_covers")]
    if not covered:
        return
    from falconext.testbed import slurm_bed

    if slurm_bed.missing() is not None:
        return
    config.hook.pytest_deselected(items=covered)
    items[:] = [item for item in items if not item.get_closest_marker("slurm_covers")]
    names = ", ".join(item.name for item in covered)
    config.add_cleanup(lambda: print(f"\nnot collected, held under a real Slurm by test_slurm.py: {names}"))


@pytest.fixture(scope="session")
def uninterrupted_dp4() -> str:
    """The restart tests' job (tests/megatron_lm/test_multinode.py: RESTART_JOB) without a
    fault or falconext, uninterrupted, on one launcher of 4 ranks (the same DP4 training as
    two nodes of two): what every restarted multi-node job (the nodes bed's, Slurm's) must
    have trained. Run once a session."""
    from test_multinode import RESTART_JOB
    from test_pretrain_gpt import launch, pretrain_script

    return launch(pretrain_script(), [*RESTART_JOB], nproc=4)
