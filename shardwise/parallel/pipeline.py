"""Pipeline parallelism: the model cut into stages of consecutive layers, run by a torch.distributed.pipelining
schedule.

1. Split. The layers are cut into pp x stages_per_rank contiguous stages so that the slowest stage (the
   pipeline runs at its pace) is as fast as possible; the embedding rides on the first stage, the final
   norm and output head on the last. See `shardwise.layout.layer_costs` for what a stage costs.
2. Place. Stage -> rank: one stage per rank for gpipe and 1f1b; a loop for interleaved-1f1b (rank r holds
   stages r, r + pp, r + 2pp, ...; Narayanan et al. 2021); a V for zero-bubble (rank r holds r and 2pp-1-r,
   ZB-V of Qi et al. 2024, so the first and last stage share rank 0).
3. Build. Each stage is the meta model with what the stage does not own deleted, so parameter names stay
   those of the full model and `materialize` gives them the single-device values; then `parallelize()`
   (TP, CP, activation checkpointing, compile, DP) is applied to each stage on its own, as torchtitan does.
4. Run. All the micro-batches of an optimizer step go through one `schedule.step`: the step's grad_accum
   micro-batches are concatenated and cut into grad_accum x n_microbatches pipeline micro-batches. The
   schedule then turns off data-parallel gradient sync for every backward but the last of each stage
   (FSDP's set_requires_gradient_sync), so gradients are reduced once per optimizer step, and the larger
   number of micro-batches M shrinks the bubble (P-1)/(M+P-1). (GPipe then keeps the activations of all M.)

Context parallelism: every rank sees the same slice of positions every step, so each stage's rotary table is
re-indexed once to this rank's positions; the stages then pass only hidden states and the schedules need no
per-micro-batch keyword arguments.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import GraphExecGroup

from shardwise.config import JobConfig, autocast_precision
from shardwise.data import Batch, counted_targets
from shardwise.layout import fsdp_mixed_precision, layer_costs, split_layers, stages_of_rank
from shardwise.lora import apply_lora
from shardwise.loss import (
    autocast_context,
    autocast_forward,
    compute_dtype,
    head_loss_sum,
    token_loss_sum,
)
from shardwise.model import Transformer, build_model, materialize
from shardwise.parallel import parallelize
from shardwise.parallel.runtime import Runtime

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "zero-bubble": ScheduleZBVZeroBubble,
}


# ---------------------------------------------------------------------------------------------------
# Build


class Stage(PipelineStage):
    """torch's PipelineStage, whose deferred weight pass (zero-bubble's W) recomputes a checkpointed block once.

    torch's weight pass (pipelining._backward.stage_backward_weight) calls autograd once per parameter group, and
    non-reentrant activation checkpointing recomputes a block at every backward call that reaches it, keeping
    what that call does not unpack until the stage's graph is freed. A block of Llama has about ten parameter
    groups: each micro-batch's W rebuilt the block about ten times and held what each rebuild left (on the
    simulator, rank 1 of Llama 3 8B cut to 8 blocks, tp 2 x pp 2 x cp 4, 16 micro-batches: a 33.6 GiB peak
    against 10.6 with one rebuild per pass).
    The groups' regions of the graph are disjoint, which is what torch's GraphExecGroup asks for its calls to
    share one recomputation (torch PR 166536, made for zero-bubble and DualPipeV). The input pass is one
    autograd call and needs no group; the first stage runs its W as one full backward."""

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        with GraphExecGroup():
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    # schedule.eval() (validation) runs the schedule's backward actions as no-ops, but torch 2.13's runtime still
    # hands a V's input gradients from one stage to the other on the same rank (zero-bubble), which asserts that the
    # stage has a backward: without one there is nothing to hand over
    def get_local_bwd_output(self, mb_index):
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


def build_stage_module(meta: Transformer, layers: range, first: bool, last: bool) -> Transformer:
    """A copy of the meta model with only `layers` (names kept), the embedding if first, norm + head if last."""
    stage = copy.deepcopy(meta)
    for key in list(stage.layers.keys()):
        if int(key) not in layers:
            del stage.layers[key]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


def pipeline_loss(output: torch.Tensor, targets: torch.Tensor, global_tokens: int,
                  head: FusedHead | None = None, ignored: bool = False) -> torch.Tensor:
    """The schedule's loss_fn, per pipeline micro-batch: summed fp32 token cross-entropy / global token count.

    The schedule is built with scale_grads=False since the division by the global count is done here (the
    data-parallel wrappers sum the ranks' gradients: data_parallel.sum_gradients).
    `output` is the last stage's logits, or with `head` (its output head, fused with the loss here:
    Transformer.head_in_loss) its normalised hidden states. `ignored`: some targets count in no loss (a prompt's:
    shardwise.loss.head_loss_sum).
    """
    loss = token_loss_sum(output, targets) if head is None else head(output, targets, ignored)
    return loss / global_tokens


@dataclass
class FusedHead:
    """The last stage's output head fused with the loss (shardwise.loss.head_loss_sum), run as the stage's forward
    runs it on one device: under its autocast, and under sequence parallelism on the hidden states as the
    sequence-split DTensor the final norm made (the stage returns its local slice, which the schedule carries)."""

    module: nn.Linear
    precision: str
    device: torch.device
    sequence_parallel: bool

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor, ignored: bool = False) -> torch.Tensor:
        weight = self.module.weight  # read at each call: FSDP puts the gathered weight there for the forward
        if self.sequence_parallel and isinstance(weight, DTensor):
            hidden = DTensor.from_local(hidden, weight.device_mesh, [Shard(1)], run_check=False)
        with autocast_context(self.precision, self.device):
            return head_loss_sum(hidden, weight, targets, ignored)


@dataclass
class Pipeline:
    """This rank's share of a pipeline: its stage modules and the schedule that runs them."""

    stages: nn.ModuleList
    """This rank's stage modules (each a Transformer with only its layers), in pipeline order."""
    schedule: PipelineScheduleSingle | PipelineScheduleMulti
    """The torch.distributed.pipelining schedule that runs every micro-batch of a step."""
    stage_ids: list[int]
    """Global index of each of `stages`."""
    has_first: bool
    """This rank holds stage 0 (it feeds the token ids)."""
    has_last: bool
    """This rank holds the last stage (it computes the loss)."""
    n_microbatches: int
    """Pipeline micro-batches per schedule step: n_microbatches x grad_accum."""
    accum: int
    """Training micro-batches (train.grad_accum) that one schedule step consumes."""

    def parameters(self):
        return self.stages.parameters()


def model_parts(model: nn.Module | Pipeline) -> list[nn.Module]:
    """The modules this rank trains (torchtitan's model_parts): the model, or its pipeline stages in order.
    Checkpoints, weight import and export, evaluation's reshard and the simulator's tracker work on these."""
    return list(model.stages) if isinstance(model, Pipeline) else [model]


def stage_io(cfg: JobConfig, stage: int, n_stages: int,
             head_in_loss: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """What stage `stage` takes and returns for one pipeline micro-batch, as meta tensors (shapes, no data).

    Given to `PipelineStage` up front, so the schedule's first step infers no shapes (a forward and backward
    on dummies plus metadata sent between the pipeline ranks, which a fake process group cannot carry). The
    first stage takes token ids (batch, seq / cp); the others take the residual stream, which is fp32 (the
    embedding is, and autocast's bf16 block outputs are added to it) and, under sequence parallelism, a 1/tp
    slice of the sequence (the blocks' row-parallel outputs are reduce-scattered to it). The last stage
    returns the logits (batch, seq / cp, vocab), gathered over tp, in the autocast dtype, or where its head runs
    in the loss (`head_in_loss`) its normalised hidden states, shaped as the residual stream (fp32: RMSNorm
    keeps its input's dtype under autocast).
    """
    p, t = cfg.parallel, cfg.train
    batch, seq = t.micro_batch // p.n_microbatches, cfg.data.seq_len // p.cp
    residual_seq = seq // p.tp if p.sequence_parallel and p.tp > 1 else seq
    # the residual stream is fp32 under autocast, bf16 under FSDP2's mixed-precision policy (its weights are)
    residual = torch.bfloat16 if fsdp_mixed_precision(p) else torch.float32
    hidden = torch.empty(batch, residual_seq, cfg.model.dim, dtype=residual, device="meta", requires_grad=True)
    if stage == 0:
        inputs = torch.empty(batch, seq, dtype=torch.long, device="meta")
    else:
        inputs = hidden
    if stage == n_stages - 1 and not head_in_loss:
        return inputs, torch.empty(batch, seq, cfg.model.vocab_size, dtype=compute_dtype(t.precision), device="meta",
                                   requires_grad=True)
    return inputs, hidden


def build_pipeline(cfg: JobConfig, runtime: Runtime, materialize: Callable = materialize) -> Pipeline:
    """Split, place and build this rank's stages (meta -> parallelize -> materialise), and the schedule.

    `materialize(module, model_args, device, seed)` gives a parallelised meta stage its storage and values;
    the simulator passes one that makes fake tensors.
    """
    p = cfg.parallel
    n_stages = p.pp * p.stages_per_rank
    split = split_layers(layer_costs(cfg.model, cfg.data.seq_len), n_stages)
    ids = stages_of_rank(p.pp_schedule, p.pp, runtime.pp_rank, p.stages_per_rank)
    meta = build_model(cfg.model)
    apply_lora(meta, cfg.lora, compute_dtype(cfg.train.precision))
    modules, stages = [], []
    for s in ids:
        module = build_stage_module(meta, split[s], s == 0, s == n_stages - 1)
        parallelize(module, runtime.mesh, cfg)
        module.head_in_loss = module.fused_loss  # only the last stage has a head to fuse
        materialize(module, cfg.model, runtime.device, cfg.train.seed)
        if runtime.positions is not None:
            # context parallel: this rank always holds these positions; Attention takes rope[:, :local_len]
            module.rope = module.rope[:, runtime.positions]
        autocast_forward(module, autocast_precision(cfg), runtime.device)
        modules.append(module)
        inputs, outputs = stage_io(cfg, s, n_stages, module.head_in_loss)
        stages.append(Stage(module, s, n_stages, runtime.device, input_args=inputs, output_args=outputs,
                                    group=runtime.pp_group))
    last = next((module for module, s in zip(modules, ids) if s == n_stages - 1), None)
    head = None
    if last is not None and last.head_in_loss:
        head = FusedHead(last.output, autocast_precision(cfg), runtime.device, p.sequence_parallel and p.tp > 1)
    n_micro = p.n_microbatches * cfg.train.grad_accum
    cls = SCHEDULES[p.pp_schedule]
    schedule = cls(stages[0] if len(stages) == 1 else stages, n_micro, loss_fn=partial(pipeline_loss, head=head),
                   scale_grads=False)
    return Pipeline(nn.ModuleList(modules), schedule, ids, 0 in ids, n_stages - 1 in ids, n_micro,
                    cfg.train.grad_accum)


# ---------------------------------------------------------------------------------------------------
# Run


def _step_inputs(pipe: Pipeline, batches: list[Batch], runtime: Runtime) -> tuple[tuple, torch.Tensor | None]:
    """The step's micro-batches concatenated (and cut to this rank's sequence slice under context parallel)."""
    batches = [runtime.shard_sequence(b)[0] for b in batches]
    args = (torch.cat([b.inputs for b in batches]).to(runtime.device),) if pipe.has_first else ()
    target = torch.cat([b.targets for b in batches]).to(runtime.device) if pipe.has_last else None
    return args, target


def _known_to_all(pipe: Pipeline, losses: list[torch.Tensor], runtime: Runtime) -> torch.Tensor:
    """Sum of the last stage's micro-batch losses, on every pipeline rank (the others contribute 0)."""
    total = torch.stack([loss.detach() for loss in losses]).sum() if pipe.has_last else torch.zeros(())
    total = total.to(runtime.device)
    if runtime.pp_group is not None:
        dist.all_reduce(total, group=runtime.pp_group)
    return total


def forward_backward(pipe: Pipeline, batches: list[Batch], *, global_tokens: int, runtime: Runtime) -> torch.Tensor:
    """Forward and backward of one optimizer step's micro-batches; returns the global mean loss on every rank.

    The loss contract is the non-pipeline one (see `train_step`): each micro-batch's summed cross-entropy
    over the global token count.
    """
    if len(batches) != pipe.accum:
        raise ValueError(f"the schedule takes {pipe.accum} micro-batches per step, got {len(batches)}")
    args, target = _step_inputs(pipe, batches, runtime)
    losses: list[torch.Tensor] = []
    pipe.schedule.step(*args, target=target, losses=losses, return_outputs=False,
                       loss_kwargs={"global_tokens": global_tokens, "ignored": batches[0].masked})
    total = _known_to_all(pipe, losses, runtime)
    runtime.sum_over_data_ranks(total)
    return total


@torch.no_grad()
def evaluate_sums(pipe: Pipeline, batches: list[Batch], runtime: Runtime) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed token loss, token count) of this data rank's validation micro-batches, on every pipeline rank.

    The schedule takes `accum` micro-batches per step, so the batches go in groups of that many; a short last
    group is padded with copies of its last batch whose losses are dropped.
    """
    total = torch.zeros((), device=runtime.device)
    tokens = 0
    per_batch = pipe.n_microbatches // pipe.accum
    for start in range(0, len(batches), pipe.accum):
        group = batches[start:start + pipe.accum]
        real = len(group)
        args, target = _step_inputs(pipe, group + group[-1:] * (pipe.accum - real), runtime)
        losses: list[torch.Tensor] = []
        pipe.schedule.eval(*args, target=target, losses=losses, return_outputs=False,
                           loss_kwargs={"global_tokens": 1, "ignored": group[0].masked})
        total += _known_to_all(pipe, losses[: real * per_batch], runtime)
        tokens += sum(int(counted_targets(runtime.shard_sequence(b)[0].targets)) for b in group)
    return total, torch.tensor(float(tokens), device=runtime.device)
