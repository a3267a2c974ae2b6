"""Tensor parallelism (Megatron column/row) with optional sequence parallelism, as a plan of data.

Inside a block: wq/wk/wv and w1/w3 are column-parallel (each rank computes a slice of the heads or of the
MLP width), wo and w2 are row-parallel (each rank holds the matching input slice, the partial outputs are
summed). That is one all-reduce per attention and one per MLP in forward, and the same in backward.

With sequence parallelism the all-reduce becomes a reduce-scatter to a 1/tp slice of the sequence, on which
the norms and residual adds run, and an all-gather before the next column-parallel matmul: the same bytes
moved, but the activations outside the matmuls are 1/tp the size.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Module path inside a TransformerBlock -> how it is split across the tp group."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=residual),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=residual),
    }
    # The input of attention and MLP enters as one (replicated) DTensor, so the input gradients of the three
    # (two) column-parallel projections add up as partial sums and are reduced once, not once per projection
    # (Megatron fuses wq/wk/wv into one matmul for the same reason). With sequence parallelism that entry is
    # also where the sequence slices are all-gathered (and, in backward, reduce-scattered).
    plan |= {
        "attention": PrepareModuleInput(input_layouts=(residual, None), desired_input_layouts=(Replicate(), None)),
        "feed_forward": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
    }
    if sequence_parallel:
        plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    return plan


def top_plan(sequence_parallel: bool, has_embedding: bool, has_head: bool) -> dict[str, ParallelStyle]:
    """Embedding (split by vocabulary rows), final norm and output head (split by vocabulary columns)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if has_embedding:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if has_head:
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        # logits gathered to every tp rank: the loss then runs as on one device
        plan["output"] = ColwiseParallel(input_layouts=residual, output_layouts=Replicate(), use_local_output=True)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split the model's matmuls over `tp_mesh` in place (parameters become DTensors)."""
    if tp_mesh.size() == 1:
        return
    has_embedding = getattr(model, "tok_embeddings", None) is not None
    has_head = getattr(model, "output", None) is not None
    parallelize_module(model, tp_mesh, top_plan(sequence_parallel, has_embedding, has_head))
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel))
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # both are Shard(0) over the vocabulary: re-share the one DTensor
