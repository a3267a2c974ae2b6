"""Tensor parallelism (Megatron column/row) with optional sequence parallelism, as a plan of data.

Inside a block: wq/wk/wv and w1/w3 are column-parallel (each rank computes a slice of the heads or of the
MLP width), wo and w2 are row-parallel (each rank holds the matching input slice, the partial outputs are
summed). That is one all-reduce per attention and one per MLP in forward, and the same in backward.

With sequence parallelism the all-reduce becomes a reduce-scatter to a 1/tp slice of the sequence, on which
the norms and residual adds run, and an all-gather before the next column-parallel matmul: the same bytes
moved, but the activations outside the matmuls are 1/tp the size.

A LoRA-adapted projection (shardwise.lora.LoRALinear) is split like its base, and its adapters so that the
low-rank path needs no communication of its own: a column-parallel base (W split by output rows) keeps A whole
and splits B by the same rows, so x A^T is computed on every rank and B's rows give this rank's output slice;
a row-parallel base (W split by input columns) splits A by the same columns and keeps B whole, so x_i A_i^T is
a partial sum of the rank-r activation, B maps it to a partial sum of the output, and that is added to the
base's partial sum before the one reduction the row-parallel linear does anyway (as torchtitan's LoRA).
"""

from __future__ import annotations

from collections.abc import Collection
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardwise.lora import LoRALinear
from shardwise.loss import first_row


def _place_parameters(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement],
                      src_data_rank: int | None) -> None:
    """Distribute `module`'s own parameters, each as `placements[name]` says (frozen ones stay frozen)."""
    for name, param in list(module.named_parameters(recurse=False)):
        placed = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))


class ColwiseLoRA(ColwiseParallel):
    """ColwiseParallel for a LoRALinear: W and B split by output rows (Shard(0)), A replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        # distribute_module calls this for every submodule too (the adapter's dropout), which owns nothing
        _place_parameters(module, device_mesh, {"weight": Shard(0), "lora_a": Replicate(), "lora_b": Shard(0)},
                          self.src_data_rank)


class RowwiseLoRA(RowwiseParallel):
    """RowwiseParallel for a LoRALinear: W and A split by input columns (Shard(1)), B replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        _place_parameters(module, device_mesh, {"weight": Shard(1), "lora_a": Shard(1), "lora_b": Replicate()},
                          self.src_data_rank)


def block_plan(sequence_parallel: bool, adapted: Collection[str] = (), moe: bool = False) -> dict[str, ParallelStyle]:
    """Module path inside a TransformerBlock -> how it is split across the tp group. `adapted`: the paths that
    are LoRALinear, whose adapters are placed after their base; `moe`: the block has a mixture of experts."""
    residual = Shard(1) if sequence_parallel else Replicate()

    def colwise(path: str) -> ParallelStyle:
        return ColwiseLoRA() if path in adapted else ColwiseParallel()

    def rowwise(path: str) -> ParallelStyle:
        style = RowwiseLoRA if path in adapted else RowwiseParallel
        return style(output_layouts=residual)

    plan: dict[str, ParallelStyle] = {
        "attention.wq": colwise("attention.wq"),
        "attention.wk": colwise("attention.wk"),
        "attention.wv": colwise("attention.wv"),
        "attention.wo": rowwise("attention.wo"),
    }
    if not moe:
        plan |= {
            "feed_forward.w1": colwise("feed_forward.w1"),
            "feed_forward.w3": colwise("feed_forward.w3"),
            "feed_forward.w2": rowwise("feed_forward.w2"),
            "feed_forward": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
        }
    else:
        # The mixture of experts is not split (no expert tensor parallelism): every tp rank runs all of it on the
        # whole sequence, gathered, with plain-tensor weights, and keeps its slice of the output
        plan["moe"] = PrepareModuleInputOutput(
            input_layouts=(residual,), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(residual,), use_local_output=True)
    # The input of attention and MLP enters as one (replicated) DTensor, so the input gradients of the three
    # (two) column-parallel projections add up as partial sums and are reduced once, not once per projection
    # (Megatron fuses wq/wk/wv into one matmul for the same reason). With sequence parallelism that entry is
    # also where the sequence slices are all-gathered (and, in backward, reduce-scattered).
    plan["attention"] = PrepareModuleInput(input_layouts=(residual, None), desired_input_layouts=(Replicate(), None))
    if sequence_parallel:
        plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
    return plan


class VocabParallelEmbedding(ParallelStyle):
    """nn.Embedding split by vocabulary rows, whose backward stays on each rank's own rows (Megatron's
    VocabParallelEmbedding).

    Written here because torch's RowwiseParallel, which splits the forward the same way, has no such backward:
    DTensor (torch 2.13) shards the embedding's backward (`embedding_dense_backward`) by columns, by batch or as
    a partial sum, never by vocabulary rows, so every rank builds a gradient for the whole vocabulary (V x d,
    4 GiB for Llama 3 70B in fp32) and reduce-scatters it to the rows it owns. Here each rank looks up only the
    ids in its own range of rows, the others masked to zero as in the forward Megatron runs; the partial sums
    are reduced to `output_layout` (an all-reduce, or a reduce-scatter over the sequence with sequence
    parallelism) exactly as RowwiseParallel's are, and the backward writes the rank's V/t rows only. The weight
    stays a Shard(0) DTensor, so checkpoints, optimizers and a tied output head see what RowwiseParallel gives.
    """

    def __init__(self, output_layout: Placement):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding splits an nn.Embedding, not {type(module).__name__}")
        _place_parameters(module, device_mesh, {"weight": Shard(0)}, src_data_rank=0)
        module.forward = partial(_vocab_parallel_lookup, module, device_mesh, self.output_layout)
        return module


def _vocab_parallel_lookup(module: nn.Embedding, mesh: DeviceMesh, output_layout: Placement,
                           ids: torch.Tensor) -> torch.Tensor:
    weight = module.weight.to_local()  # its gradient comes back as this rank's Shard(0) rows
    first = first_row(module.num_embeddings, mesh)
    local = ids - first
    elsewhere = (local < 0) | (local >= weight.shape[0])
    rows = F.embedding(local.masked_fill(elsewhere, 0), weight).masked_fill(elsewhere.unsqueeze(-1), 0.0)
    summed = DTensor.from_local(rows, mesh, [Partial()], run_check=False)
    return summed.redistribute(mesh, [output_layout]).to_local()


def top_plan(sequence_parallel: bool, has_embedding: bool, has_head: bool) -> dict[str, ParallelStyle]:
    """Embedding (split by vocabulary rows), final norm and output head (split by vocabulary columns)."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if has_embedding:
        plan["tok_embeddings"] = VocabParallelEmbedding(residual)
    if has_head:
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
        # the head's weight split by vocabulary rows: the fused loss runs vocabulary-parallel on it
        # (shardwise.loss.head_loss_sum); where the head's own forward runs (LoRA or NF4 on the head, a pipeline's
        # last stage), the logits are gathered to every tp rank and the loss runs as on one device
        plan["output"] = ColwiseParallel(input_layouts=residual, output_layouts=Replicate(), use_local_output=True)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split the model's matmuls over `tp_mesh` in place (parameters become DTensors); nothing on a 1-rank mesh."""
    if tp_mesh.size() > 1:
        split_model(model, tp_mesh, sequence_parallel)


def split_model(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """`apply_tensor_parallel` on a mesh of any size, one rank included (`shardwise bench` times DTensor's
    host-side cost that way when it has a single process)."""
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    has_embedding = getattr(model, "tok_embeddings", None) is not None
    has_head = getattr(model, "output", None) is not None
    parallelize_module(model, tp_mesh, top_plan(sequence_parallel, has_embedding, has_head))
    for block in model.layers.values():
        adapted = [path for path, module in block.named_modules() if isinstance(module, LoRALinear)]
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel, adapted, moe=hasattr(block, "moe")))
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # both are Shard(0) over the vocabulary: re-share the one DTensor
    # torch's SequenceParallel makes the norms' new DTensor parameters trainable: a LoRA run's stay frozen
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
