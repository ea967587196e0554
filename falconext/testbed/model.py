"""Building a small megatron-core GPT for one rank: model chunk, DDP wrapper, optimizer.

Only megatron-core's own pieces are used (GPTModel with the local layer spec, its
DistributedDataParallel with contiguous grad buffers, its optimizer and
finalize_model_grads), so what the test bed trains is what a Megatron job trains. The
loss is returned per token (``calculate_per_token_loss``): gradients are normalised by
the global token count, which is what lets replicas run different numbers of
micro-batches and still produce the gradient of the same global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """The test bed GPT's size (layers, hidden, heads, vocabulary, sequence length) and learning rate."""

    layers: int = 4
    hidden: int = 64
    heads: int = 4
    vocab: int = 256
    seq_len: int = 64
    lr: float = 1e-3


def build(shape: ModelShape, device: str):
    """(ddp_model, optimizer, transformer_config) for this rank's pipeline stage."""
    # lazy: run-time order (megatron-core only in ranks, after cpu_compat)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    pp = ps.get_pipeline_model_parallel_world_size()
    if shape.layers % pp:
        raise ValueError(f"--layers {shape.layers} is not divisible by --pp {pp}")
    config = TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=pp,
        calculate_per_token_loss=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=shape.vocab,
        max_sequence_length=shape.seq_len,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=False,
    )
    if device == "cuda":
        model = model.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=False,
        overlap_grad_reduce=False,
        use_distributed_optimizer=False,
    )
    ddp_model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp_model.no_sync
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=shape.lr,
        weight_decay=0.0,
        bf16=False,
        fp16=False,
        params_dtype=torch.float32,
        use_distributed_optimizer=False,
        # megatron-core's grad clipping asserts CUDA tensors; the test bed's tiny model
        # trains stably without it, and on GPU it is on as usual
        clip_grad=1.0 if device == "cuda" else 0.0,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp_model])
    return ddp_model, optimizer, config
