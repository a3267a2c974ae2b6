"""Optimizers and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.config import OptimConfig

NamedParams = list[tuple[str, torch.Tensor, int]]
"""(name, tensor to optimise, dimensions of the parameter it stands for): a slice of a matrix stays a matrix."""


def named_params(model: nn.Module) -> NamedParams:
    return [(name, p, p.ndim) for name, p in model.named_parameters() if p.requires_grad]


def param_groups(params: NamedParams, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms (1-D) and embeddings keep their scale (as in GPT-2, Llama, nanoGPT).

    Parameters are also grouped by the mesh they are DTensors on (or none): the foreach kernels of torch's
    optimizers cannot mix plain tensors and DTensors of different meshes in one group.
    """
    groups: dict[tuple, dict] = {}
    for name, p, ndim in params:
        decay = ndim >= 2 and "tok_embeddings" not in name
        key = (decay, id(p.device_mesh) if isinstance(p, DTensor) else None)
        group = groups.setdefault(key, {"params": [], "weight_decay": weight_decay if decay else 0.0})
        group["params"].append(p)
    return list(groups.values())


def effective_lr(cfg: OptimConfig, global_batch: int) -> float:
    """Peak lr, scaled linearly with the global batch when asked (lr * B / B_base)."""
    if cfg.lr_scaling == "linear":
        return cfg.lr * global_batch / cfg.base_global_batch
    return cfg.lr


def build_optimizer(params: nn.Module | NamedParams, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    if isinstance(params, nn.Module):
        params = named_params(params)
    groups = param_groups(params, cfg.weight_decay)
    if cfg.name == "adamw":
        # foreach is torch's fast path on CPU and GPU and works on DTensor parameters; fused is CUDA-first
        return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)
    momentum = cfg.momentum if cfg.name == "momentum" else 0.0
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, foreach=True)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup, then cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_schedule(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    )
