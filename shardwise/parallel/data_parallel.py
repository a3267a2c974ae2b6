"""Data parallelism, ZeRO stages 0-3 and HSDP, on FSDP2.

- ZeRO-0 (DDP semantics): FSDP2's replicate: parameters replicated, gradients all-reduced in buckets (groups
  of consecutive blocks of about `bucket_mb`) as soon as a bucket's backward is done, overlapping the rest.
- ZeRO-1: as ZeRO-0, plus `ShardedOptimizer`: each data-parallel rank keeps the optimizer state of 1/N of
  every parameter, updates that slice, and all-gathers the slices (Megatron's distributed optimizer, here on
  the local tensors so it composes with tensor parallelism). torch's ZeroRedundancyOptimizer broadcasts whole
  parameters and does not take DTensors, hence our own.
- ZeRO-2: `fully_shard(reshard_after_forward=False)`: gradients and optimizer state sharded, parameters
  gathered once per step and kept through backward.
- ZeRO-3: `fully_shard(reshard_after_forward=True)`: parameters too, gathered again in backward.
- HSDP: ZeRO-2/3 with dp_replicate > 1: shard inside a group of dp_shard ranks, replicate across groups.

Context-parallel ranks hold the same parameters and see different tokens, so they join the gradient
reduction (and FSDP's sharding), as in torchtitan.

FSDP averages gradients over the ranks it reduces over; each rank's loss is divided by the token count of
the global batch, so the trainer multiplies it by that rank count to make the average the gradient of the
global mean loss (rather than setting FSDP's divide factor to 1: that uses PREMUL_SUM, which gloo lacks).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from shardwise.config import ParallelConfig
from shardwise.parallel.compat import replicate
from shardwise.parallel.mesh import MeshView


def _buckets(blocks: list[nn.Module], bucket_mb: float) -> list[list[nn.Module]]:
    """Consecutive blocks grouped until a group's parameters reach bucket_mb (one all-reduce per group)."""
    groups, current, size = [], [], 0.0
    for block in blocks:
        current.append(block)
        size += sum(p.numel() * p.element_size() for p in block.parameters()) / 2**20
        if size >= bucket_mb:
            groups.append(current)
            current, size = [], 0.0
    if current:
        groups.append(current)
    return groups


def apply_data_parallel(model: nn.Module, mesh: MeshView, p: ParallelConfig) -> None:
    """Wrap blocks (bottom-up) and then the root, so each block's gradients reduce as soon as they exist."""
    blocks = list(model.layers.values())
    if p.zero_stage <= 1:
        dp_mesh = mesh.grad_reduce
        if dp_mesh.size() == 1:
            return
        for group in _buckets(blocks, p.bucket_mb):
            replicate(group if len(group) > 1 else group[0], mesh=dp_mesh)
        replicate(model, mesh=dp_mesh)
    else:
        shard_mesh = mesh.fsdp
        if shard_mesh.size() == 1:
            return
        for block in blocks:
            fully_shard(block, mesh=shard_mesh, reshard_after_forward=p.zero_stage == 3)
        # the root's parameters (embedding, final norm, head) are needed first in backward: keep them
        fully_shard(model, mesh=shard_mesh, reshard_after_forward=False)


def reshard_after_evaluation(model: nn.Module) -> None:
    """Put FSDP2 modules back in their sharded state after a forward without backward (evaluation).

    FSDP2 reshards a module kept unsharded after forward (the root, every block under ZeRO-2) in its backward.
    A forward under no_grad has none, so the gathered parameters would stay registered on the module: memory
    ZeRO-3 meant to free, and parameters that are no longer the optimizer's, which breaks the next checkpoint
    (get_optimizer_state_dict maps optimizer parameters to module names by identity).
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient reduction on all but the last micro-batch of an accumulation."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


class ShardedOptimizer:
    """ZeRO-1: an optimizer over this rank's 1/N slice of every parameter, then an all-gather of the slices.

    The slices are views of the parameters' local tensors, so the inner optimizer updates the model in place
    and its state (Adam's two moments) covers only the slice. Gradients must already be reduced (replicated).
    """

    def __init__(self, model: nn.Module, build_inner, group: dist.ProcessGroup):
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params: list[tuple[nn.Parameter, nn.Parameter, int]] = []
        named_slices = []
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            chunk = math.ceil(local.numel() / self.world)
            lo, hi = min(self.rank * chunk, local.numel()), min((self.rank + 1) * chunk, local.numel())
            piece = nn.Parameter(local.detach().view(-1)[lo:hi])  # shares storage with the parameter
            self.params.append((param, piece, chunk))
            named_slices.append((name, piece, param.ndim))
        self.inner: torch.optim.Optimizer = build_inner(named_slices)

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, piece, _ in self.params:
            param.grad = None
            piece.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for param, piece, chunk in self.params:
            if param.grad is None:
                continue
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            lo = min(self.rank * chunk, grad.numel())
            piece.grad = grad.reshape(-1)[lo:lo + piece.numel()]
        self.inner.step()
        for param, piece, chunk in self.params:
            local = param.to_local() if isinstance(param, DTensor) else param
            mine = torch.zeros(chunk, dtype=local.dtype, device=local.device)
            mine[: piece.numel()] = piece
            gathered = torch.empty(chunk * self.world, dtype=local.dtype, device=local.device)
            dist.all_gather_into_tensor(gathered, mine, group=self.group)
            local.view(-1).copy_(gathered[: local.numel()])

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
