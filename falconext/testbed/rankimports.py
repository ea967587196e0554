"""What every test-bed rank imports before its first iteration, imported once by the ranks'
parent in :mod:`falconext.testbed.forkrun` (the agent, or its fork server) so that its
forks (the ranks) share it.

Importing this module is the whole of its work: torch, megatron-core, redis and
falconext's rank side are imported with the garbage collector off (as
:mod:`falconext.testbed.train` does), then the objects they made are frozen out of every later
collection, in the fork server and in each fork.
"""

from __future__ import annotations

import gc

gc.disable()

import falconext.testbed.train  # noqa: E402,F401  (torch)
import falconext.emulation.emulator  # noqa: E402,F401
import falconext.testbed.trainer  # noqa: E402,F401  (megatron-core)
import falconext.runtime.runtime  # noqa: E402,F401
import falconext.control.client  # noqa: E402,F401  (redis)
import megatron.core.distributed.finalize_model_grads  # noqa: E402,F401  (what model.build imports)
import megatron.core.models.gpt.gpt_layer_specs  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401
import megatron.core.tensor_parallel.random  # noqa: E402,F401

gc.collect()
gc.freeze()
