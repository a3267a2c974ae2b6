"""Optimizers and the learning-rate schedule."""

from __future__ import annotations

import functools
import logging
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

    Parameters are also grouped by the mesh they are DTensors on (or none): the fused and foreach kernels of
    torch's optimizers cannot mix plain tensors and DTensors of different meshes in one group.
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
        # torch's fused kernel (torchtitan's default): one pass over each parameter's weight, gradient and two
        # moments, on CPU and GPU and on DTensor parameters, where foreach makes a pass per operation
        return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    if cfg.name in ("adamw8bit", "adamw4bit"):
        # by name component: a pipeline's optimizer sees "<stage>.tok_embeddings.weight"
        full = {id(p) for name, p, _ in params if set(name.split(".")) & set(FULL_PRECISION_STATE)}
        return _low_bit_adamw(cfg, groups, lr, full)
    if cfg.name == "adafactor":
        # torch's Adafactor (Shazeer & Stern 2018) keeps no first moment and factors the second into row and
        # column means; beta2 follows its own schedule (1 - t^-0.8), so optim.beta1/beta2/eps do not apply
        return torch.optim.Adafactor(groups, lr=lr, foreach=True)
    momentum = cfg.momentum if cfg.name == "momentum" else 0.0
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, foreach=True)


FULL_PRECISION_STATE = ("tok_embeddings", "output")
"""Parameters (by name) whose moments stay fp32 under the low-bit AdamWs: the vocabulary matrices. Rows of rare
tokens get gradients orders of magnitude below their block's largest, their second moment rounds to 0 while the
first does not, and the update m / (sqrt(v) + eps) blows those rows up (Dettmers et al. 2022, section 2.3, keep
32-bit state for the embedding; the head's rows of rare tokens are the same case)."""


def _low_bit_adamw(cfg: OptimConfig, groups: list[dict], lr: float, full_precision: set[int]) -> torch.optim.Optimizer:
    """torchao's AdamW with block-quantised moments (Dettmers et al. 2022 for 8 bits, Li et al. 2023 for 4):
    8-bit keeps both moments as one byte plus an fp32 scale per 256 values, 4-bit as half a byte plus one per
    128. Tensors under 4096 values (or not a multiple of the block) keep fp32 moments, as bitsandbytes does, and
    so do the parameters in `full_precision` (ids). torchao compiles its per-tensor update (torch.compile): the
    first step of each new shape pays for that."""
    optimizers = _torchao_optimizers()
    cls = _with_full_precision(optimizers.AdamW8bit if cfg.name == "adamw8bit" else optimizers.AdamW4bit)
    optimizer = cls(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    optimizer.full_precision = full_precision
    return optimizer


@functools.cache
def _with_full_precision(cls: type) -> type:
    """torchao's `cls` with fp32 moments for the parameters in its `full_precision` (ids); torchao allocates the
    moments in `_new_buffer`, which it has no option for. Same class name: checkpoints record the optimizer by it."""

    def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
        if id(p) in self.full_precision:
            return torch.zeros_like(p)  # placed like p: a DTensor stays one
        return cls._new_buffer(self, p, signed)

    def step(self, closure=None):
        # torch's AOT autograd cache (on disk, across processes) keys a DTensor argument by its shape, not by the
        # tensor inside it: an update compiled for quantised moments was reused for fp32 ones of the same local
        # shape (and failed: "'Tensor' object has no attribute 'codes'"); compile this step without that cache
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return cls.step(self, closure)

    return type(cls.__name__, (cls,), {"_new_buffer": _new_buffer, "step": step, "full_precision": frozenset()})


def _torchao_optimizers():
    """torchao.optim, imported on first use: on a machine without CUDA its import logs the CUDA kernels it could
    not load, which concern its quantised matmuls, not the optimizers."""
    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import torchao.optim
    finally:
        logger.setLevel(level)
    return torchao.optim


DECAY_SHAPES = {
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "linear": lambda p: 1.0 - p,
    "sqrt": lambda p: 1.0 - math.sqrt(p),
    "constant": lambda p: 1.0,
}
"""optim.decay: the share of (peak - minimum) left at progress p in [0, 1] through the decay."""


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay: str = "cosine",
              decay_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr at optimizer step `step` (0-based): linear warmup, the peak, then the decay's
    shape down to min_lr_ratio at the last step over its last round(decay_ratio x total_steps) steps (0: every
    step after warmup, the decay starting at the peak)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_ratio > 0:
        decay_steps = max(1, round(decay_ratio * total_steps))
        start = total_steps - 1 - decay_steps
    else:
        decay_steps, start = max(1, total_steps - warmup_steps - 1), warmup_steps
    progress = min(1.0, max(0.0, (step - start) / decay_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * DECAY_SHAPES[decay](progress)


def build_lr_schedule(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.warmup_steps, total_steps, cfg.min_lr_ratio, cfg.decay,
                                          cfg.decay_ratio)
    )
