"""One training step of the test bed, per rank (the loop itself is in falconext/testbed/train.py).

A plain Megatron step: zero the DDP grad buffers, run megatron-core's forward-backward
function over this replica's micro-batches (1F1B when PP > 1), step the optimizer, and
on the last pipeline stage reduce the global-batch loss across data-parallel replicas.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Iterator

import torch

from falconext.emulation import cpu_compat
from falconext.model.device import gpt_forward_flops
from falconext.testbed import data
from falconext.testbed.model import ModelShape, build


@dataclass
class TrainOptions:
    """One rank's training setup: parallel sizes, batch sizes, iterations, model shape, device, seed and
    micro-batch plan."""

    tp: int = 1
    pp: int = 1
    micro_batch_size: int = 2
    global_batch_size: int = 16
    iters: int = 100
    shape: ModelShape = field(default_factory=ModelShape)
    device: str = "cpu"
    seed: int = 1234
    #: micro-batches per DP replica; None: the even plan
    plan: list[int] | None = None


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token loss: (sum over tokens, token count, report) as megatron-core expects."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1)
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), tokens.to(torch.float32).view(1)])
    return loss, tokens, {"lm loss": report}


class _ForwardTimer:
    """The forward step, timing this rank's model forwards within one step: the
    per-micro-batch compute time S2 balances on (a forward is a fixed share of a
    micro-batch's compute, so its ratio between replicas is the replicas' speed ratio;
    reading the data is left out, it is not what a slow GPU slows). Host time: right on
    the CPU test bed; with CUDA the forward returns at launch, so there the time would
    need CUDA events (not done yet)."""

    def __init__(self) -> None:
        #: seconds of each model forward of the current step, in order
        self.seconds: list[float] = []

    def __call__(self, data_iterator: Iterator[data.MicroBatch] | None, model: torch.nn.Module):
        batch = next(data_iterator) if data_iterator is not None else None
        t0 = time.perf_counter()
        if batch is None:  # a middle pipeline stage: input comes from the previous stage
            output = model(None, None, None)
            mask = torch.ones(1)
        else:
            output = model(batch.tokens, batch.position_ids, None, labels=batch.labels)
            mask = batch.loss_mask
        self.seconds.append(time.perf_counter() - t0)
        return output, partial(_loss_func, mask)


class Trainer:
    """Owns the model and optimizer of one rank; ``step(it)`` runs one iteration."""

    def __init__(self, opts: TrainOptions) -> None:
        # lazy: run-time order (megatron-core only in ranks, after cpu_compat)
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import random as mrandom

        self.opts = opts
        self.ps = ps
        world = torch.distributed.get_world_size()
        self.dp = world // (opts.tp * opts.pp)
        self.even = data.even_plan(opts.global_batch_size, opts.micro_batch_size, self.dp)
        self.plan = list(self.even)
        if opts.plan is not None:
            self.set_plan(opts.plan)
        self.timer = _ForwardTimer()
        mrandom.model_parallel_cuda_manual_seed(opts.seed)
        torch.manual_seed(opts.seed)
        self.model, self.optimizer, self.config = build(opts.shape, opts.device)
        self.forward_backward = get_forward_backward_func()
        self.replica = ps.get_data_parallel_rank()
        self.first_stage = ps.is_pipeline_first_stage()
        self.last_stage = ps.is_pipeline_last_stage()

    def set_plan(self, plan: list[int]) -> None:
        """Micro-batches per replica from the next step on. Every rank of the job must
        switch at the same iteration (falconext agrees on it in a suspension): the plan
        decides which samples each replica reads."""
        plan = [int(m) for m in plan]
        if len(plan) != self.dp or sum(plan) != sum(self.even) or min(plan) < 1:
            raise ValueError(
                f"micro-batch plan {plan} does not give {self.dp} replicas >= 1 each and "
                f"{sum(self.even)} in all"
            )
        self.plan = plan

    def traffic(self) -> tuple[int, int]:
        """(gradient bytes all-reduced over the DP group per iteration, bytes of one
        pipeline message): this role's weight on the links S3 chooses between."""
        grad = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        act = self.opts.micro_batch_size * self.opts.shape.seq_len * self.opts.shape.hidden * 4  # fp32 activations
        return int(grad), int(act) if self.opts.pp > 1 else 0

    def forward_flops(self) -> float:
        """Forward FLOPs of one micro-batch of this rank's pipeline stage (the emulated
        device's work; see falconext.model.device)."""
        sh = self.opts.shape
        return gpt_forward_flops(sh.layers // self.opts.pp, sh.hidden, sh.seq_len, self.opts.micro_batch_size,
                                 sh.vocab, self.opts.tp, self.last_stage)

    def forward_times(self) -> list[float]:
        """Seconds of each model forward of the last step (one per micro-batch)."""
        return list(self.timer.seconds)

    def step(self, it: int) -> float | None:
        """Train iteration ``it``: this replica's planned micro-batches through megatron-core's
        schedule, then the optimizer step. Returns the DP-averaged per-token loss on the
        last pipeline stage, None on the others."""
        opts = self.opts
        self.timer.seconds = []
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        n_micro = self.plan[self.replica]
        it_data = None
        if self.first_stage or self.last_stage:
            it_data = data.microbatches(
                opts.seed, it, self.plan, self.replica, opts.micro_batch_size, opts.shape.seq_len, opts.shape.vocab
            )
        losses = self.forward_backward(
            forward_step_func=self.timer,
            data_iterator=it_data,
            model=[self.model],
            num_microbatches=n_micro,
            seq_length=opts.shape.seq_len,
            micro_batch_size=opts.micro_batch_size,
            forward_only=False,
        )
        self.optimizer.step()
        if not self.last_stage:
            return None
        total = torch.stack([entry["lm loss"] for entry in losses]).sum(dim=0)
        torch.distributed.all_reduce(total, group=self.ps.get_data_parallel_group())
        return float(total[0] / total[1])


def init_distributed(opts: TrainOptions) -> None:
    """Initialise torch.distributed (gloo with the CPU stand-ins on cpu/emulated, NCCL on
    cuda) and megatron-core's parallel state for ``opts``. Raises ValueError when the
    world size is not a multiple of TP x PP."""
    if opts.device in ("cpu", "emulated"):
        cpu_compat.enable(fast=True)  # first: it imports megatron-core the cheap way on CPU
        backend = "gloo"
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    # lazy: run-time order (megatron-core only in ranks, after cpu_compat)
    from megatron.core import parallel_state as ps

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=backend)
    world = torch.distributed.get_world_size()
    if world % (opts.tp * opts.pp):
        raise ValueError(f"world size {world} is not divisible by TP {opts.tp} x PP {opts.pp}")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=opts.tp,
        pipeline_model_parallel_size=opts.pp,
    )
