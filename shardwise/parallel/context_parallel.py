"""Context parallelism: the sequence split across cp ranks, attention over all of it.

Every layer except attention works token by token, so a rank can run the model on its slice of the
sequence as long as attention sees the keys and values of every earlier token. Each attention layer
all-gathers K and V from the cp ranks (one collective of both) and attends its local queries to them; the
backward reduce-scatters the K/V gradients back to the ranks that own them.

Causal load balancing: the sequence is cut into 2*cp chunks and rank r holds chunks r and 2*cp-1-r. An early
chunk has few keys to attend to and a late one many, so the pairs even out and every rank does the same
attention work (Llama 3, Dubey et al. 2024, section 3.3.2, which also all-gathers K/V: under GQA they are small).

Why our own: torch 2.13's experimental `torch.distributed.tensor.experimental.context_parallel` has no
sharding rule for the CPU attention kernel, so it does not run on gloo. This file uses only torch's public
collectives (`all_gather_single`, `reduce_scatter_single`), which work on gloo and NCCL alike.

The layout contract: a rank's local sequence is `load_balanced_positions(...)` of the global one, in that
order (the trainer shards with `cp_positions` + `shard_sequence` and passes the same positions to the
model for rotary). The attention derives the positions from the local length, so it needs no extra input.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.model import Attention
from shardwise.moe import MoE


def _chunks_of(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of 2*cp_size chunks a rank holds: an early one (cheap under the causal mask) and its mirror."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def load_balanced_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.LongTensor:
    """Global positions rank `cp_rank` holds: chunks cp_rank and 2*cp_size-1-cp_rank of 2*cp_size chunks."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"sequence length {seq_len} must be divisible by 2 * cp = {2 * cp_size} for context "
                         f"parallelism (each rank takes two of 2*cp equal chunks); change seq_len or cp")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    chunk = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in _chunks_of(cp_size, cp_rank)])


def cp_positions(seq_len: int, cp_mesh: DeviceMesh) -> torch.LongTensor:
    """This rank's global positions on the 1-D cp mesh (all of them when cp is 1)."""
    return load_balanced_positions(seq_len, cp_mesh.size(), cp_mesh.get_local_rank())


def shard_sequence(x: torch.Tensor, positions: torch.LongTensor, dim: int = 1) -> torch.Tensor:
    """The elements of `x` at `positions` along `dim` (the sequence dim of (batch, seq, ...) by default)."""
    return x.index_select(dim, positions.to(x.device))


class _GatherFromGroup(torch.autograd.Function):
    """All-gather stacked on a new dim 0; backward reduce-scatters, summing each rank's gradient to its owner.

    `torch.distributed.nn.functional.all_gather` gets this right (on gloo it emulates the reduce-scatter with
    an all-to-all), but it is deprecated in torch 2.13 and its replacement lives in a private module; gloo
    now has reduce-scatter, so the public single-tensor collectives do it in a dozen lines.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        # concatenated on dim 0 then viewed as stacked: gloo takes only the concatenated form
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out.view(world, *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_x = grad.new_empty(grad.shape[1:])
        grad = grad.contiguous().flatten(0, 1)
        dist.reduce_scatter_single(grad_x, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad_x, None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(..., s_local, d) from every cp rank -> (..., cp * s_local, d) in global position order."""
    cp = dist.get_world_size(group)
    seq = x.shape[-2] * cp
    stacked = _GatherFromGroup.apply(x, group)  # (cp, ..., s_local, d), rank-major
    by_rank = stacked.movedim(0, -3).flatten(-3, -2)  # (..., cp * s_local, d): rank 0's positions, rank 1's ...
    gathered_positions = torch.cat([load_balanced_positions(seq, cp, r) for r in range(cp)])
    order = torch.argsort(gathered_positions).to(x.device)
    return by_rank.index_select(-2, order)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of local queries (b, h, s_local, hd) over the K/V (b, h_kv, s_local, hd) of all cp ranks.

    Heads may be a tensor-parallel slice; only the sequence dim is cp-sharded. Each of the two local chunks
    attends to the keys up to its end (a prefix of the global sequence) under a mask key_pos <= query_pos,
    so no rank computes scores for the keys past its last query.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if q.shape[-2] % 2 != 0:
        raise ValueError(f"the local sequence ({q.shape[-2]}) must hold two equal chunks; shard it with cp_positions")
    chunk = q.shape[-2] // 2
    kv = gather_sequence(torch.stack([k, v]), group)  # one collective for both
    k_all, v_all = kv[0], kv[1]
    outs = []
    # chunk bounds are Python ints: no device sync, no graph break under torch.compile
    for q_chunk, index in zip(q.split(chunk, dim=-2), _chunks_of(cp, rank)):
        start, end = index * chunk, (index + 1) * chunk
        mask = torch.arange(end, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None]
        outs.append(F.scaled_dot_product_attention(q_chunk, k_all[..., :end, :], v_all[..., :end, :],
                                                   attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]))
    return torch.cat(outs, dim=-2)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Make every attention layer of `model` attend across the 1-D `cp_mesh`, and every mixture of experts count its
    balancing loss's choices over it (in place; nothing when cp is 1).

    The caller feeds each rank `shard_sequence(tokens, cp_positions(seq_len, cp_mesh))` and passes the same
    positions to the model, so rotary embedding uses the global positions.
    """
    if cp_mesh.ndim != 1:
        raise ValueError(f"context parallelism needs a 1-D mesh, got {cp_mesh.ndim} dims {cp_mesh.mesh_dim_names}")
    if cp_mesh.size() == 1:
        return
    attention_fn = functools.partial(context_parallel_attention, group=cp_mesh.get_group())
    for module in model.modules():
        if isinstance(module, Attention):
            module.attention_fn = attention_fn
        elif isinstance(module, MoE):
            module.sequence_group = cp_mesh.get_group()  # the balancing loss's counts are the whole sequence's
