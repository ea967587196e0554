"""Synthetic token data with an order defined per global batch.

Sample ``s`` of global batch ``g`` is a pure function of (seed, g, s), never of which
rank or replica reads it. A DP replica's share is a contiguous range of the global batch
given by the micro-batch plan (how many micro-batches each replica runs), so changing the
plan (falconext's S2 mitigation) changes who computes a sample, never which samples form
the batch: nothing is skipped or repeated, and TP peers of a replica read identical data
without a broadcast.

The sequences are learnable (arithmetic progressions modulo the vocabulary, with a
per-sample start and stride) so the loss falls and two runs can be compared step by step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as megatron-core's GPT takes it: tokens, next-token labels, loss mask and positions,
    each ``[b, s]``."""

    tokens: torch.Tensor  # [b, s] int64
    labels: torch.Tensor  # [b, s] int64
    loss_mask: torch.Tensor  # [b, s] float32
    position_ids: torch.Tensor  # [b, s] int64


def sample_tokens(seed: int, global_batch: int, index: int, seq_len: int, vocab: int) -> torch.Tensor:
    """seq_len + 1 tokens of sample ``index`` of global batch ``global_batch``."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + global_batch) * 1_000_033 + index)
    start = int(torch.randint(0, vocab, (1,), generator=g))
    stride = int(torch.randint(1, 4, (1,), generator=g))
    return (start + stride * torch.arange(seq_len + 1)) % vocab


def replica_range(plan: Sequence[int], replica: int, micro_batch_size: int) -> tuple[int, int]:
    """[first, last) sample indices of the global batch that ``replica`` computes."""
    if not 0 <= replica < len(plan):
        raise ValueError(f"replica {replica} outside plan of {len(plan)} replicas")
    first = sum(plan[:replica]) * micro_batch_size
    return first, first + plan[replica] * micro_batch_size


def microbatches(
    seed: int,
    global_batch: int,
    plan: Sequence[int],
    replica: int,
    micro_batch_size: int,
    seq_len: int,
    vocab: int,
) -> Iterator[MicroBatch]:
    """The micro-batches ``replica`` runs for ``global_batch`` under ``plan``."""
    first, last = replica_range(plan, replica, micro_batch_size)
    positions = torch.arange(seq_len).unsqueeze(0).expand(micro_batch_size, -1).contiguous()
    for lo in range(first, last, micro_batch_size):
        seqs = torch.stack([sample_tokens(seed, global_batch, i, seq_len, vocab) for i in range(lo, lo + micro_batch_size)])
        yield MicroBatch(
            tokens=seqs[:, :-1].contiguous(),
            labels=seqs[:, 1:].contiguous(),
            loss_mask=torch.ones(micro_batch_size, seq_len, dtype=torch.float32),
            position_ids=positions,
        )


def even_plan(global_batch_size: int, micro_batch_size: int, dp: int) -> list[int]:
    """Micro-batches per replica when every replica gets the same share."""
    if global_batch_size % (micro_batch_size * dp):
        raise ValueError(
            f"global batch {global_batch_size} is not divisible by micro-batch {micro_batch_size} x DP {dp}"
        )
    return [global_batch_size // (micro_batch_size * dp)] * dp
