"""What several real Megatron-LM test files share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def uninterrupted_dp4() -> str:
    """The restart tests' job (tests/megatron_lm/test_multinode.py: RESTART_JOB) without a
    fault or falconext, uninterrupted, on one launcher of 4 ranks (the same DP4 training as
    two nodes of two): what every restarted multi-node job (the nodes bed's, Slurm's) must
    have trained. Run once a session."""
    from test_multinode import RESTART_JOB
    from test_pretrain_gpt import launch, pretrain_script

    return launch(pretrain_script(), [*RESTART_JOB], nproc=4)
