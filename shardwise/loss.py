"""The step's arithmetic, defined once for the plain path (`shardwise.train`), the pipeline schedule
(`shardwise.parallel.pipeline`) and the operator count (`shardwise.planner.opcount`): the precision's autocast,
the token cross-entropy, and the scaling that makes data-parallel gradients a sum.

Every parallel layout is checked against the single-device run (`shardwise verify`), and the operator count
prices the engine's step: both hold only while every path runs the same operators in the same order, which one
definition keeps so.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype autocast runs matmuls in, so the dtype of the logits: fp32, or the low precision of bf16/fp16."""
    if precision == "fp32":
        return torch.float32
    return torch.bfloat16 if precision == "bf16" else torch.float16


def autocast_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16/fp16 autocast: matmuls in low precision, weights and optimizer stay fp32 (the master copy)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=compute_dtype(precision))


def autocast_forward(module: nn.Module, precision: str, device: torch.device) -> None:
    """`autocast_context` around `module`'s forward only, for a pipeline stage: the schedule calls the stage's
    forward and runs the backward itself, so there is no call site to put a `with` block around."""
    if precision == "fp32":
        return  # the forward stays the module's own
    module.forward = autocast_context(precision, device)(module.forward)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) token cross-entropy of one micro-batch, in fp32 whatever the logits' dtype.

    Summed so that micro-batches and ranks add up: the caller divides by the global batch's token count.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


def scale_for_gradient_sum(loss: torch.Tensor, grad_reduce_size: int) -> torch.Tensor:
    """The loss to run backward on: x the data-parallel rank count, for the backward only.

    Data-parallel wrappers average gradients over the ranks that see different tokens; the loss is already a
    share of the global batch's mean, so the gradients must be summed: the multiplication undoes the average.
    """
    return loss * grad_reduce_size if grad_reduce_size > 1 else loss
