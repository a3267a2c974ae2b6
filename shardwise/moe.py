"""Mixture of experts: the MLP of a block replaced by routed SwiGLU experts, written once for one device.

Token choice (Shazeer et al. 2017; GShard; Switch Transformer): a linear router scores every expert for every
token (softmax over experts as Mixtral and Qwen3-MoE, or a sigmoid each as DeepSeek-V3), each token goes to its
top_k experts, and their outputs are summed with the token's (optionally renormalised and scaled) scores. Shared
experts (DeepSeekMoE) see every token. Dropless by default: every (token, expert) pair is computed once; with a
capacity factor an expert takes only its first tokens and the others are counted as dropped.

Load balancing, two ways:
- the auxiliary loss alpha x E x sum_i f_i P_i (Switch Transformer eq. 4, with f_i the share of a token's k
  choices that go to expert i and P_i the mean routing probability), computed per sequence (DeepSeek-V3's
  sequence-wise form): a sequence is whole on one rank under data, tensor, pipeline and expert parallelism, so
  the loss is the same however the batch is split. Context parallelism splits sequences: its ranks sum their
  choice counts (`MoE.sequence_group`, as Megatron-LM reduces the balancing loss's statistics over its sequence
  partition group), and each adds its own tokens' share of P_i, so the ranks' losses sum to the sequence's and
  each rank's gradient is its tokens' exact share. It joins the gradient through `_AuxLossGradient`
  (Megatron-LM's MoEAuxLossAutoScaler): no change to the loss a pipeline's last stage computes;
- auxiliary-loss-free (DeepSeek-V3 section 2.1.2): a per-expert bias added to the scores for the choice only,
  moved after each step towards the mean load (`update_expert_bias`).

The experts run as one grouped GEMM (`torch._grouped_mm`) where its alignment rules hold, else as an exact loop
over experts. Expert parallelism (shardwise.parallel.expert_parallel) swaps `GroupedExperts.dispatch` for an
all-to-all exchange; the rest of this file does not know about it.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.model_args import ModelArgs


class Router(nn.Module):
    """Scores (tokens, experts), and each token's top_k experts with their combine weights: the logits' matmul in
    the compute dtype or in fp32 (ModelArgs.router_dtype), the scores and what follows in fp32."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.n_experts, args.dim))
        self.top_k, self.score_func = args.top_k, args.score_func
        self.route_norm, self.route_scale = args.route_norm, args.route_scale
        self.fp32 = args.router_dtype == "fp32"

    def forward(self, x: torch.Tensor, bias: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores (T, E) fp32, weights (T, k), experts (T, k), logits (T, E) fp32) for x of (T, dim)."""
        if self.fp32:  # outside autocast, on fp32 copies (the weight is bf16 under FSDP2's mixed-precision policy)
            with torch.autocast(x.device.type, enabled=False):
                logits = F.linear(x.float(), self.weight.float())
        else:
            logits = F.linear(x, self.weight).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        # the balancing bias steers which experts are chosen, never how much they weigh (DeepSeek-V3 eq. 16)
        chosen = torch.topk(scores + bias, self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(-1, chosen)
        if self.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.score_func == "sigmoid" else 0.0))
        return scores, weights * self.route_scale, chosen, logits


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm(x, weight^T)` runs: rows 16-byte aligned, and on CUDA bf16 on sm90 or later."""
    size = x.element_size()
    aligned = all((n * size) % 16 == 0 for n in weight.shape[1:])
    if x.device.type == "cuda":
        return aligned and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    return aligned and x.device.type == "cpu"


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class GroupedExperts(nn.Module):
    """n SwiGLU experts stored as 3-D weights, laid out as Hugging Face's Mixtral stores them:
    w1 (gate) and w3 (up) (n, hidden, dim), w2 (down) (n, dim, hidden)."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))
        self.use_grouped_mm = True
        """False: always the loop (the grouped GEMM's reference)."""
        self.stated_load = False
        """True when the counts are the simulator's stated load, the same on every rank (MoE.stated_load)."""
        # expert parallelism replaces this with an all-to-all exchange around `compute`
        self.dispatch: Callable[[GroupedExperts, torch.Tensor, list[int]], torch.Tensor] = GroupedExperts.compute

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's experts' weights as plain tensors (expert parallelism makes them DTensors)."""
        return tuple(w.to_local() if hasattr(w, "to_local") else w for w in (self.w1, self.w3, self.w2))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: (tokens, dim) sorted by expert, `counts[i]` of them for expert i (of all n); same shape out, in the
        compute dtype (cast before expert parallelism's dispatch: half the bytes under bf16 autocast)."""
        return self.dispatch(self, x.to(_compute_dtype(x)), counts)

    def compute(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The local experts over x sorted by local expert, `counts[i]` rows for local expert i."""
        w1, w3, w2 = self.weights()
        dtype = _compute_dtype(x)
        x, w1, w3, w2 = (t.to(dtype) for t in (x, w1, w3, w2))
        if self.use_grouped_mm and x.shape[0] > 0 and grouped_mm_supported(x, w1):
            offsets = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=x.device)
            h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
            h = h * torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)
        outs = []
        for i, chunk in enumerate(torch.split(x, counts)):
            outs.append(F.linear(F.silu(F.linear(chunk, w1[i])) * F.linear(chunk, w3[i]), w2[i]))
        return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


class _AuxLossGradient(torch.autograd.Function):
    """Identity on the block's output whose backward also starts the auxiliary loss's gradient, with the factor
    that puts it on the scale of the main loss's (Megatron-LM's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, device=grad.device), None


def _in_backward() -> bool:
    """True while autograd runs a backward pass: activation checkpointing re-runs forwards then, whose routing
    must not be counted twice."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """Router + routed experts (+ shared experts) in place of a block's MLP."""

    def __init__(self, args: ModelArgs, shared: nn.Module | None = None):
        super().__init__()
        self.n_experts, self.top_k = args.n_experts, args.top_k
        self.capacity_factor, self.aux_loss_coeff = args.capacity_factor, args.aux_loss_coeff
        self.z_loss_coeff = args.z_loss_coeff
        self.router = Router(args)
        self.experts = GroupedExperts(args.n_experts, args.dim, args.expert_hidden)
        self.shared = shared
        # the balancing bias is state (checkpointed); the step's statistics are not
        self.register_buffer("expert_bias", torch.zeros(args.n_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(args.n_experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        self.register_buffer("aux_loss", torch.zeros(()), persistent=False)
        self.register_buffer("z_loss", torch.zeros(()), persistent=False)
        self.aux_grad_scale = 0.0
        """d(objective)/d(sum of this micro-batch's per-sequence aux losses (balancing and z)), set by the trainer
        each step."""
        self.stated_load: Callable[[int], list[int]] | None = None
        """The simulator's: (token, expert) pairs -> pairs per expert, in place of the router's choices."""
        self.sequence_group: dist.ProcessGroup | None = None
        """The ranks holding the other pieces of this rank's sequences (context parallelism's), or None."""

    def reset_buffers(self) -> None:
        for buffer in (self.expert_bias, self.tokens_per_expert, self.dropped, self.aux_loss, self.z_loss):
            buffer.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        scores, weights, chosen, logits = self.router(tokens, self.expert_bias)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert, tokens in order
        counts = self._load(flat)
        kept, kept_counts = self._capacity(order, counts, tokens.shape[0])
        routed = self.experts(tokens[kept // self.top_k], kept_counts)
        out = torch.zeros(flat.shape[0], dim, dtype=routed.dtype, device=x.device)
        out = out.index_copy(0, kept, routed).view(-1, self.top_k, dim)
        out = (out * weights.unsqueeze(-1).to(out.dtype)).sum(1).view(bsz, seq, dim)
        if self.shared is not None:
            out = out + self.shared(x)
        counting = self.training and torch.is_grad_enabled() and not _in_backward()
        if counting:
            self.tokens_per_expert += torch.tensor(counts, dtype=self.tokens_per_expert.dtype, device=x.device)
            self.dropped += flat.shape[0] - kept.shape[0]
        losses = []  # the router's own losses, which join the gradient beside the block's output
        if self.aux_loss_coeff > 0 and torch.is_grad_enabled():
            losses.append(self.aux_loss_coeff * sequence_aux_loss(scores.view(bsz, seq, -1),
                                                                  chosen.view(bsz, seq, -1), self.sequence_group))
            if counting:
                self.aux_loss += losses[-1].detach()
        if self.z_loss_coeff > 0 and torch.is_grad_enabled():
            losses.append(self.z_loss_coeff * sequence_z_loss(logits.view(bsz, seq, -1), self.sequence_group))
            if counting:
                self.z_loss += losses[-1].detach()
        if losses:
            out = _AuxLossGradient.apply(out, functools.reduce(torch.add, losses), self.aux_grad_scale)
        return out

    def _load(self, flat: torch.Tensor) -> list[int]:
        """(token, expert) pairs per expert: the router's, or the simulator's stated load (fake tensors hold no
        routing). A list: the experts' shapes and the all-to-all's splits are sizes, known on the host."""
        if self.stated_load is not None:
            return self.stated_load(flat.shape[0])
        return torch.bincount(flat, minlength=self.n_experts).tolist()

    def _capacity(self, order: torch.Tensor, counts: list[int], n_tokens: int) -> tuple[torch.Tensor, list[int]]:
        """The (token, choice) pairs each expert computes, by expert, and how many each: all of them (dropless, and
        outside training: evaluation and generation see every choice), or each expert's first
        ceil(capacity_factor x tokens x top_k / n_experts)."""
        if self.capacity_factor <= 0 or not self.training:
            return order, counts
        capacity = math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)
        starts = itertools.accumulate(counts, initial=0)
        kept = [min(c, capacity) for c in counts]
        return torch.cat([order[start:start + k] for start, k in zip(starts, kept)]), kept


def sequence_aux_loss(scores: torch.Tensor, chosen: torch.Tensor, group: dist.ProcessGroup | None = None
                      ) -> torch.Tensor:
    """sum over sequences of E x sum_i f_i P_i, for scores (batch, seq, E) and chosen (batch, seq, k).

    f_i: the share of the sequence's seq x k choices that went to expert i (no gradient); P_i: the mean over the
    sequence of expert i's score normalised over experts (the softmax itself; a sigmoid's scores divided by their
    sum, as DeepSeek-V3 eq. 18-20). Perfect balance gives 1 per sequence.

    `group`: the ranks that each hold a piece of every sequence (context parallelism). Their counts are summed,
    so f is the whole sequence's; each rank's P_i sums its own tokens over the whole sequence's length, so the
    group's results sum to the loss of the whole sequences.
    """
    n_experts, k = scores.shape[-1], chosen.shape[-1]
    counts = torch.zeros_like(scores[:, 0]).scatter_add_(1, chosen.flatten(1), torch.ones_like(chosen.flatten(1),
                                                                                                dtype=scores.dtype))
    pieces = 1 if group is None else dist.get_world_size(group)
    if pieces > 1:
        dist.all_reduce(counts, group=group)
    f = counts / (chosen.shape[1] * pieces * k)
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)
    if pieces > 1:
        p = p / pieces  # this rank's tokens' sum over the whole sequence's length
    return n_experts * (f.detach() * p).sum()


def sequence_z_loss(logits: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """sum over sequences of the mean over the sequence's tokens of logsumexp(logits)^2, for router logits (batch,
    seq, E) (ST-MoE's z-loss, eq. 5). `group`: the ranks holding pieces of every sequence (context parallelism):
    each sums its own tokens over the whole sequence's length, so the group's results sum to the whole loss."""
    pieces = 1 if group is None else dist.get_world_size(group)
    return torch.logsumexp(logits, dim=-1).square().sum() / (logits.shape[1] * pieces)


def moe_layers(parts: Iterable[nn.Module]) -> list[MoE]:
    return [m for part in parts for m in part.modules() if isinstance(m, MoE)]


def set_aux_grad_scale(parts: Iterable[nn.Module], scale: float) -> None:
    """The factor the trainer gives its main loss's backward, per sequence (see MoE.aux_grad_scale)."""
    for moe in moe_layers(parts):
        moe.aux_grad_scale = scale


@torch.no_grad()
def max_load(parts: Iterable[nn.Module], group=None) -> torch.Tensor:
    """The step's busiest expert over the mean, the largest over this rank's MoE layers (0 without any): each layer's
    (token, expert) pairs per expert, summed over `group` (the ranks that route other tokens). 1 is perfect balance,
    n_experts / top_k every token on the same experts. Read before `end_of_step` clears the counts."""
    layers = moe_layers(parts)
    if not layers:
        return torch.zeros(())
    counts = torch.stack([m.tokens_per_expert for m in layers])
    if group is not None:
        dist.all_reduce(counts, group=group)
    return (counts.amax(-1) / counts.mean(-1).clamp_min(torch.finfo(counts.dtype).tiny)).amax()


@torch.no_grad()
def end_of_step(parts: Iterable[nn.Module], rate: float, group=None) -> torch.Tensor | None:
    """After an optimizer step: move each expert's bias towards the mean load (rate > 0) from the step's routing
    counts, summed over `group` (the ranks that see other tokens), and clear the step's statistics.

    Returns this rank's sums over its layers [aux loss, dropped pairs, routed pairs, z-loss] (None without MoE
    layers).
    """
    layers = moe_layers(parts)
    if not layers:
        return None
    counts = torch.stack([m.tokens_per_expert for m in layers])
    stats = torch.stack([torch.stack([m.aux_loss, m.dropped, m.tokens_per_expert.sum(), m.z_loss])
                         for m in layers]).sum(0)
    if rate > 0:
        if group is not None:
            torch.distributed.all_reduce(counts, group=group)
        for moe, load in zip(layers, counts):
            moe.expert_bias += rate * torch.sign(load.mean() - load)
    for moe in layers:
        moe.tokens_per_expert.zero_()
        moe.dropped.zero_()
        moe.aux_loss.zero_()
        moe.z_loss.zero_()
    return stats
