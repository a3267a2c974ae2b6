"""Optimizers and the learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from shardwise.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms (1-D) and embeddings keep their scale (as in GPT-2, Llama, nanoGPT)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or "tok_embeddings" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def effective_lr(cfg: OptimConfig, global_batch: int) -> float:
    """Peak lr, scaled linearly with the global batch when asked (lr * B / B_base)."""
    if cfg.lr_scaling == "linear":
        return cfg.lr * global_batch / cfg.base_global_batch
    return cfg.lr


def build_optimizer(model: nn.Module, cfg: OptimConfig, lr: float) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
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
