"""Expert parallelism: each of the ep ranks holds n_experts / ep experts and computes them for the tokens of all
ep ranks that chose them (GShard, Lepikhin et al. 2020; Switch Transformer).

Per MoE layer and micro-batch, each rank routes its own tokens, sends every routed copy to the rank holding
its expert and gets the results back: two all-to-alls in forward (dispatch, combine) and two in backward, plus
one of the per-expert counts so that every rank knows what it receives. `all_to_all_single` runs on gloo and NCCL.

The ep ranks are drawn from dp_shard x cp (see mesh.py): they see different tokens, as data-parallel ranks do.
Expert weights become DTensors sharded by expert (Shard(0)) over the ep mesh, so checkpoints hold every expert
under its own index whatever the degree, and FSDP shards them further over the dp_shard x cp / ep ranks left.

Gradient: an expert's gradient on its rank already holds the tokens of all its ep ranks (they came to it), and
FSDP sums it over the dp x cp / ep ranks that hold the same expert (data_parallel.sum_gradients): together every
token of the global batch, each rank's loss being its share of the global mean. (Until 2026-12-02 FSDP averaged,
each rank's loss was multiplied by dp x cp to undo it, and the expert weights took a 1/ep gradient scale.)
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from shardwise.moe import GroupedExperts
from shardwise.parallel.compat import all_to_all_single_autograd


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Split every MoE layer's experts by expert index over `ep_mesh` and route tokens to them by all-to-all."""
    if ep_mesh.size() == 1:
        return
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for name, param in list(module.named_parameters(recurse=False)):
                placed = distribute_tensor(param, ep_mesh, [Shard(0)], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(placed, requires_grad=param.requires_grad))
            module.dispatch = functools.partial(exchange, group=ep_mesh.get_group())


def exchange(experts: GroupedExperts, x: torch.Tensor, counts: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """The experts' outputs for x (this rank's routed tokens, sorted by expert; counts[i] for expert i of all),
    computed on the ranks that hold the experts. Sizes travel as host lists: they are the all-to-all's splits."""
    ep, rank = dist.get_world_size(group), dist.get_rank(group)
    n_local = len(counts) // ep
    mine = torch.tensor(counts, device=x.device)
    received = torch.empty_like(mine)
    dist.all_to_all_single(received, mine, group=group)
    # received[s * n_local + j]: tokens rank s sends my local expert j. A simulated run (fake tensors, no values)
    # states one load for every rank, so each receives what its own routing gives its experts, from each rank
    received = counts[rank * n_local:(rank + 1) * n_local] * ep if experts.stated_load else received.tolist()
    send = [sum(counts[s * n_local:(s + 1) * n_local]) for s in range(ep)]
    recv = [sum(received[s * n_local:(s + 1) * n_local]) for s in range(ep)]
    tokens = all_to_all_single_autograd(x, recv, send, group)
    order = _expert_major(received, ep, x.device)
    out = experts.compute(tokens[order], [sum(received[j::n_local]) for j in range(n_local)])
    back = torch.empty_like(out).index_copy(0, order, out)
    return all_to_all_single_autograd(back, send, recv, group)


def _expert_major(received: list[int], ep: int, device: torch.device) -> torch.Tensor:
    """The permutation taking received tokens from (source rank, local expert) order to (local expert, source)."""
    n_local = len(received) // ep
    starts = list(itertools.accumulate(received, initial=0))  # where each (source, expert) block starts
    blocks = [s * n_local + j for j in range(n_local) for s in range(ep)]
    lengths = [received[b] for b in blocks]
    shifts = [starts[b] - out for b, out in zip(blocks, itertools.accumulate(lengths, initial=0))]
    total = sum(lengths)
    return torch.arange(total, device=device) + torch.repeat_interleave(
        torch.tensor(shifts, device=device), torch.tensor(lengths, device=device), output_size=total)
