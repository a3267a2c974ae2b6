"""Activation checkpointing: trade recompute in backward for the memory of saved activations.

- full: a block keeps only its input; backward re-runs the whole block.
- selective: a block keeps the outputs of its matmuls and attention (expensive to recompute) and re-runs
  the cheap element-wise ops (norms, rotary, SiLU, products), in the spirit of Korthikanti et al. 2022.
- every k: only every k-th block is checkpointed, a dial between the two extremes.

The transform edits blocks in place (their forward is wrapped) so parameter names do not change.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shardwise.model import cpu_causal_attention

# Ops whose outputs selective checkpointing keeps: the matmuls and the attention kernels of every backend.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._grouped_mm.default,  # a mixture of experts' expert matmuls
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    cpu_causal_attention._opoverload,  # the engine's own on a CPU (shardwise.model)
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(model: nn.Module, policy: str, every: int = 1) -> None:
    """Checkpoint every `every`-th transformer block of `model.layers` with `policy` ('full' or 'selective')."""
    if policy == "none":
        return
    if policy not in ("full", "selective"):
        raise ValueError(f"unknown activation checkpoint policy {policy!r}")
    for layer_id, block in model.layers.items():
        if int(layer_id) % every == 0:
            _wrap_forward(block, selective=policy == "selective")


def _wrap_forward(block: nn.Module, selective: bool) -> None:
    inner = block.forward
    kwargs = {"use_reentrant": False}
    if selective:
        kwargs["context_fn"] = _selective_context

    @functools.wraps(inner)
    def forward(*args, **kw):
        return checkpoint(inner, *args, **kw, **kwargs)

    block.forward = forward
