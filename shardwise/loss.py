"""The step's arithmetic, defined once for the plain path (`shardwise.train`), the pipeline schedule
(`shardwise.parallel.pipeline`) and the operator count (`shardwise.planner.opcount`): the precision's autocast,
the token cross-entropy, and the scaling that makes data-parallel gradients a sum.

Every parallel layout is checked against the single-device run (`shardwise verify`), and the operator count
prices the engine's step: both hold only while every path runs the same operators in the same order, which one
definition keeps so.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from shardwise.data import IGNORE_INDEX
from shardwise.model_args import head_rows


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype autocast runs matmuls in, so the dtype of the logits: fp32, or the low precision of bf16/fp16."""
    if precision == "fp32":
        return torch.float32
    return torch.bfloat16 if precision == "bf16" else torch.float16


def autocast_context(precision: str, device: torch.device, cache: bool = True) -> contextlib.AbstractContextManager:
    """bf16/fp16 autocast: matmuls in low precision, weights and optimizer stay fp32 (the master copy). `cache`:
    autocast's cache of the weights' low-precision copies until the context exits (see autocast_forward)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=compute_dtype(precision), cache_enabled=cache)


def autocast_forward(module: nn.Module, precision: str, device: torch.device) -> None:
    """`autocast_context` around `module`'s forward only, for a pipeline stage: the schedule calls the stage's
    forward and runs the backward itself, so there is no call site to put a `with` block around.

    Without autocast's weight cache: nothing in a stage's forward uses a weight twice, and its loss runs after the
    forward has returned, so the cache only held, under recompute, a low-precision copy of every block's weights
    of the stage until the forward returned, which a recomputed block casts again in backward regardless. A
    helper's trial found it in the simulator (2026-12-02): the last stage of Llama 3 70B at tp 8 x pp 2 with full
    recompute peaked at 73.85 GiB "during forward in layers.79" where the planner, which counts no cache in a
    pipeline, said 67.50; Llama 3 8B at pp 2, 63.38 against 61.20, and 61.23 without the cache."""
    if precision == "fp32":
        return  # the forward stays the module's own
    module.forward = autocast_context(precision, device, cache=False)(module.forward)


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) token cross-entropy of one micro-batch, in fp32 whatever the logits' dtype; targets of
    IGNORE_INDEX (a prompt's tokens) count in neither the sum nor the gradient.

    Summed so that micro-batches and ranks add up: the caller divides by the global batch's counted targets.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


def head_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignored: bool = False
                  ) -> torch.Tensor:
    """`token_loss_sum(hidden @ weight.T, targets)` without the logits: the output head and the cross-entropy
    fused, a block of tokens at a time (Liger-Kernel's fused linear cross-entropy, in PyTorch operators).

    The logits of the whole micro-batch (tokens x vocabulary, fp32) are the step's largest tensors, and the plain
    path writes four of them (logits, log-probabilities, and in backward the gradients of both). Here each block
    of rows is made, turned into its gradient (softmax minus the one-hot target) and multiplied out into the
    gradients of `hidden` and `weight` while it is in cache, in the forward; the backward only scales them. One
    log-softmax pass instead of three, and no vocabulary-wide tensor outlives its block. Under autocast the
    matmuls run in its dtype and the softmax in fp32, as on the plain path; the weight gradient is accumulated
    in fp32 over the blocks. `hidden` (..., dim), `targets` (...); `weight` (vocab, dim).

    Under tensor parallelism `weight` is a DTensor split by vocabulary rows (the column-parallel head), and the
    loss is vocabulary-parallel as well (Megatron's vocab-parallel cross-entropy): each rank makes the logits of
    its own rows only, the ranks exchange one log-sum-exp per token and block, and each adds the loss of the
    tokens whose target it holds; the loss is then summed over the ranks, so every rank returns the whole of it.
    The input is gathered whole to every rank (from its sequence slices under sequence parallelism), and its
    gradient, a partial sum over each rank's rows, is reduced back by DTensor on the way.

    `ignored`: some targets may be IGNORE_INDEX (a prompt's tokens), which count in neither the loss nor the
    gradient (F.cross_entropy's ignore_index). Said by the caller, who knows it from the data without asking the
    device; False keeps the plain path (such a target then has no loss, but its row's softmax still reaches the
    gradient).
    """
    device = hidden.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
    vocab = None
    if isinstance(weight, DTensor):
        hidden, weight, vocab = _vocab_parallel(hidden, weight)
    with torch.autocast(device.type, enabled=False):
        return _HeadLoss.apply(hidden.flatten(0, -2), weight, targets.flatten(), dtype, torch.is_grad_enabled(),
                               vocab, ignored)


@dataclass(frozen=True)
class _VocabShard:
    """This rank's rows of a vocabulary split over `group`: ids first .. first + len(weight) - 1."""

    group: dist.ProcessGroup
    size: int
    first: int


def _vocab_parallel(hidden: torch.Tensor, weight: DTensor) -> tuple[torch.Tensor, torch.Tensor, _VocabShard]:
    """The local operands of a vocabulary-parallel head: the whole input (its gradient marked a partial sum, which
    DTensor reduces: an all-reduce, or a reduce-scatter to the sequence slices), this rank's weight rows."""
    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements != (Shard(0),):
        raise ValueError(f"a vocabulary-parallel head needs its weight split by rows over one mesh dimension, "
                         f"not {weight.placements} over {mesh.ndim}")
    if isinstance(hidden, DTensor):
        whole = hidden.redistribute(mesh, [Replicate()])
    else:
        whole = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    return (whole.to_local(grad_placements=[Partial()]), weight.to_local(),
            _VocabShard(mesh.get_group(), mesh.size(), first_row(weight.shape[0], mesh)))


def first_row(rows: int, mesh) -> int:
    """The first of `rows` that this rank holds when they are split as DTensor's Shard(0) over a 1-D `mesh`:
    ceil-sized pieces, the last ones shorter or empty."""
    return min(mesh.get_local_rank() * -(-rows // mesh.size()), rows)


def _log_softmax(logits: torch.Tensor, vocab: _VocabShard | None) -> torch.Tensor:
    """Log-probabilities of each row (a new tensor, as log_softmax makes: planner.memory.logits_bytes); where the
    vocabulary is split, with the rows' log-sum-exp over every rank's columns (each rank's own, gathered,
    combined)."""
    if vocab is None:
        return torch.log_softmax(logits, dim=1)
    local = torch.logsumexp(logits, dim=1)
    every = local.new_empty(vocab.size * local.shape[0])  # gloo gathers into a flat tensor only
    dist.all_gather_single(every, local, group=vocab.group)
    return logits - torch.logsumexp(every.view(vocab.size, -1), dim=0)[:, None]


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, dtype, with_grad, vocab, ignored):
        h, w = hidden.to(dtype), weight.to(dtype)
        grad_h = torch.empty_like(hidden) if with_grad and hidden.requires_grad else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if with_grad and weight.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        rows = head_rows(h.shape[0], h.shape[1], w.shape[0])
        for start in range(0, h.shape[0], rows):
            h_c, t_c = h[start:start + rows], targets[start:start + rows, None]
            log_p = _log_softmax(torch.mm(h_c, w.t()).float(), vocab)
            if vocab is None and not ignored:
                total -= log_p.gather(1, t_c).sum()
                one_hot = torch.full(t_c.shape, -1.0, device=t_c.device)
            else:  # the targets among this rank's rows (the others' loss is another rank's) that count in the loss
                counted = t_c != IGNORE_INDEX
                t_c = t_c - (vocab.first if vocab is not None else 0)
                held = (t_c >= 0) & (t_c < w.shape[0])
                t_c = t_c.masked_fill(~held, 0)
                total -= log_p.gather(1, t_c).masked_fill(~held, 0.0).sum()
                one_hot = -held.float()
            if grad_h is None and grad_w is None:
                continue
            grad = log_p.exp_()  # d(-log p_t)/d logits = softmax - one_hot(t)
            if ignored:
                grad.mul_(counted)  # none for a target that counts in no loss
            grad.scatter_add_(1, t_c, one_hot)
            grad = grad.to(dtype)
            if grad_h is not None:
                if grad.dtype == grad_h.dtype:
                    torch.mm(grad, w, out=grad_h[start:start + rows])
                else:
                    grad_h[start:start + rows] = torch.mm(grad, w)
            if grad_w is not None:
                if grad.dtype == grad_w.dtype:
                    grad_w.addmm_(grad.t(), h_c)
                else:
                    grad_w += torch.mm(grad.t(), h_c)
        if vocab is not None:
            dist.all_reduce(total, group=vocab.group)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype, ctx.scaled_by = weight.dtype, None
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        # scaled in place, as Liger-Kernel does, so no second copy of the weight gradient is made. The zero-bubble
        # schedule runs this backward twice (its input-gradient pass, then its weight-gradient pass, on the graph
        # the first retains) with the same grad_total: the second returns what the first scaled
        grad_h, grad_w = ctx.saved_tensors
        if ctx.scaled_by is None:
            ctx.scaled_by = grad_total
            for grad in (grad_h, grad_w):
                if grad is not None:  # through .data, whose version counter is its own: the saved tensors stay valid
                    grad.data.mul_(grad_total)
        else:  # checked on the device, without waiting for it
            torch._assert_async(ctx.scaled_by == grad_total, "the fused head's backward ran twice with different "
                                "output gradients")
        return grad_h, grad_w.to(ctx.weight_dtype) if grad_w is not None else None, None, None, None, None, None
