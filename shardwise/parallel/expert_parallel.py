"""Expert parallelism: each of the ep ranks holds n_experts / ep experts and computes them for the tokens of all
ep ranks that chose them (GShard, Lepikhin et al. 2020; Switch Transformer).

Per MoE layer and micro-batch, each rank routes its own tokens, sends every routed copy to the rank holding
its expert and gets the results back: two all-to-alls in forward (dispatch, combine) and two in backward, plus
one of the per-expert counts so that every rank knows what it receives. `all_to_all_single` runs on gloo and NCCL.

The ep ranks are drawn from dp_shard x cp (see mesh.py): they see different tokens, as data-parallel ranks do.
Expert weights become DTensors sharded by expert (Shard(0)) over the ep mesh, so checkpoints hold every expert
under its own index whatever the degree, and FSDP shards them further over the dp_shard x cp / ep ranks left.

Gradient scale: the trainer multiplies each rank's loss by the dp x cp rank count because FSDP averages
gradients over those ranks (see data_parallel.py). An expert's gradient already holds the tokens of its ep ranks
(they came to it), and FSDP averages it over only dp x cp / ep ranks, so it would come out ep times too large:
the expert weights enter the computation through a 1/ep gradient scale.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from shardwise.moe import GroupedExperts


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every MoE layer's experts by expert index over `ep_mesh` and route tokens to them by all-to-all."""
    if ep_mesh.size() == 1:
        return
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for name, param in list(module.named_parameters(recurse=False)):
                placed = distribute_tensor(param, ep_mesh, [Shard(0)], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))
            module.grad_scale = 1.0 / ep_mesh.size()
            module.dispatch = functools.partial(exchange, group=ep_mesh.get_group())


def exchange(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The experts' outputs for x (this rank's routed tokens, sorted by expert; counts (n_experts,)), computed on
    the ranks that hold the experts."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    by_source = received.view(ep, -1)  # [source rank, local expert]: tokens each rank sends each of my experts
    send = counts.view(ep, -1).sum(1).tolist()
    recv = by_source.sum(1).tolist()
    tokens = dist_fn.all_to_all_single(x.new_empty(sum(recv), x.shape[1]), x, recv, send, group=group)
    order = _expert_major(by_source)
    out = experts.compute(tokens[order], by_source.sum(0))
    back = torch.empty_like(out).index_copy(0, order, out)
    return dist_fn.all_to_all_single(back.new_empty(sum(send), back.shape[1]), back, send, recv, group=group)


def _expert_major(by_source: torch.Tensor) -> torch.Tensor:
    """The permutation taking received tokens from (source rank, local expert) order to (local expert, source)."""
    lengths = by_source.flatten()
    starts = torch.cumsum(lengths, 0) - lengths  # where each (source, expert) block starts as received
    blocks = torch.arange(lengths.numel(), device=lengths.device).view(by_source.shape).t().flatten()
    lengths, starts = lengths[blocks], starts[blocks]
    out_starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum()), device=lengths.device) + torch.repeat_interleave(starts - out_starts,
                                                                                             lengths)
