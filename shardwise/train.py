"""The training loop, one for every layout; with no parallel degree set it is the single-device run that every
parallel layout is proven equal to.

Read top to bottom: build the data, build the model (meta -> transforms -> materialise), build the optimizer,
then loop over steps. One optimizer step = `train_step` over the step's micro-batches (`pipeline_train_step`,
where a pipeline schedule runs them, with pp > 1).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise import data
from shardwise.checkpoint import (
    Checkpointer,
    StopSignal,
    TrainState,
    scan_checkpoints,
    set_aside,
)
from shardwise.config import (
    STOPPED_FILE,
    ConfigError,
    JobConfig,
    LoraConfig,
    TrainConfig,
    autocast_precision,
    run_record,
    to_dict,
)
from shardwise.distributed import explain_failure, keep_host_memory
from shardwise.errors import TrainingError
from shardwise.hf import import_hf, import_peft
from shardwise.lora import apply_lora, full_value
from shardwise.loss import autocast_context, compute_dtype, token_loss_sum
from shardwise.metrics import MetricsWriter, SampleLog, peak_flops, peak_memory_bytes
from shardwise.model import Transformer, build_model, canonical_name, materialize
from shardwise.model_args import adapter_params, flops_per_token, num_params
from shardwise.moe import end_of_step, max_load, set_aux_grad_scale
from shardwise.optim import build_lr_schedule, build_optimizer, effective_lr
from shardwise.parallel import parallelize
from shardwise.parallel.comm import CommCounter, uncounted
from shardwise.parallel.data_parallel import (
    ShardedOptimizer,
    materialize_on_host,
    reshard_after_evaluation,
    set_gradient_sync,
)
from shardwise.parallel.pipeline import Pipeline, build_pipeline, evaluate_sums, forward_backward, model_parts
from shardwise.parallel.runtime import Runtime
from shardwise.run_folder import check_steps, lora_base_identity

log = logging.getLogger("shardwise.train")


@dataclass
class StepResult:
    loss: float
    """Mean token loss over the global batch."""
    grad_norm: float
    """Global gradient norm before clipping (of the unscaled gradients)."""
    skipped: bool
    """True when the optimizer step was skipped: inf/nan gradients (fp16 loss scaling, or a non-finite step)."""
    nonfinite: bool = False
    """The loss or the gradient norm was inf/nan (without fp16 loss scaling, which handles its own)."""


class GradScaler(torch.amp.GradScaler):
    """torch's dynamic loss scaler, whose unscale reads the gradients of the parameters `optimizer_step` names
    (`params`), however they are split, and agrees on inf/nan across all ranks.

    torch's reads the optimizer's parameters and unscales each device's gradients in one foreach call: under tensor
    parallelism without a data-parallel wrapper the list mixed DTensors with plain tensors (DTensor refuses it),
    and ZeRO-1's ShardedOptimizer holds slices whose gradients are only set inside its step (no inf check was
    recorded, torch's step asserted). Each gradient is unscaled as its local tensor here, and one all-reduce (max)
    of the found inf/nan makes every rank skip, or step, together. It overrides torch's private `_unscale_grads_`
    (its signature and the per-device dict it returns as in torch 2.13; tests/test_train.py's fp16 tests under tp
    and ZeRO-1 fail if that changes): torch's public scaler has no hook for the gradients it unscales."""

    params: list[torch.Tensor] = []

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        groups: dict = {}
        for p in self.params:
            if p.grad is None:
                continue
            grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            if not allow_fp16 and grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients.")
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, _), grads in groups.items():
            found = torch.zeros_like(found_inf, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device))
            found_inf.copy_(torch.maximum(found_inf, found.to(found_inf.device)))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return {found_inf.device: found_inf}


def build_grad_scaler(cfg: TrainConfig, device: torch.device) -> torch.amp.GradScaler:
    """Dynamic loss scaling for fp16 (disabled otherwise): an inf/nan step is skipped and the scale halves."""
    return GradScaler(
        device.type,
        init_scale=cfg.loss_scale_init,
        growth_interval=cfg.loss_scale_growth_interval,
        enabled=cfg.precision == "fp16",
    )




def loss_sum(
    model: nn.Module, batch: data.Batch, device: torch.device, precision: str, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """One micro-batch through `model` under the precision's autocast: its summed fp32 token cross-entropy over the
    targets that count (Batch.masked), the head fused with the loss when the model allows it
    (Transformer.fused_loss)."""
    tokens = batch.inputs.to(device, non_blocking=True)
    targets = batch.targets.to(device, non_blocking=True)
    fused = getattr(model, "fused_loss", False)
    with autocast_context(precision, device):
        if fused:
            return model(tokens, positions, targets=targets, ignored=batch.masked)
        out = model(tokens, positions)
    return token_loss_sum(out, targets)


def grads_by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The parameters' gradients grouped by the mesh they are DTensors on (plain tensors together): a foreach
    operator takes one group (DTensor runs it once per list, not once per tensor)."""
    by_mesh: dict = {}
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        by_mesh.setdefault(key, []).append(p.grad)
    return list(by_mesh.values())


class _WithoutMessage(logging.Filter):
    """Drops the records whose message contains `text`."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def _without_message(logger_name: str, text: str):
    """The logger `logger_name` drops records containing `text` for the block (its other records pass)."""
    logger, drop = logging.getLogger(logger_name), _WithoutMessage(text)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def total_grad_norm(params: list[torch.Tensor], pp_group=None) -> torch.Tensor:
    """The 2-norm of all gradients of the model, however they are split.

    DTensor gradients (tensor parallel, FSDP) are reduced per mesh by DTensor itself; pipeline stages hold
    disjoint parameters, so their squared norms are summed across the pipeline group.
    """
    squares = []
    for grads in grads_by_mesh(params):
        # norms partial over FSDP's and TP's dims are reduced by one all-reduce per dim, for which DTensor logs a
        # warning on every rank (flatten the dims for one collective); for a few scalars, two all-reduces cost
        # nothing worth a line, and each gives every rank the same value
        with _without_message("torch.distributed.tensor._redistribute", "sequential all_reduce"):
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm ** 2)
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    batches: list[data.Batch],
    *,
    device: torch.device,
    precision: str = "fp32",
    grad_clip: float = 0.0,
    global_tokens: int | None = None,
    runtime: Runtime | None = None,
) -> StepResult:
    """Forward/backward every micro-batch, then one optimizer step.

    Each micro-batch's summed loss is divided by the counted targets of the whole global batch (all micro-batches
    and all data-parallel ranks: `global_tokens`, or the batches' step_targets where a loss mask leaves some out),
    so the accumulated gradient is that of the mean loss over the global batch however it is split: k
    micro-batches of b/k give the gradient of one batch of b, and data-parallel gradients are summed, not averaged.
    """
    global_tokens = loss_divisor(batches, global_tokens)
    total = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        positions = None
        if runtime is not None:
            # reduce gradients across data-parallel ranks only once, after the last micro-batch
            set_gradient_sync(model, i == len(batches) - 1)
            batch, positions = runtime.shard_sequence(batch)
        loss = loss_sum(model, batch, device, precision, positions) / global_tokens
        scaler.scale(loss).backward()
        total += loss.detach()
    if runtime is not None:
        runtime.sum_over_data_ranks(total)
    return optimizer_step(model.parameters(), optimizer, scaler, grad_clip, total,
                          pp_group=runtime.pp_group if runtime else None)


def loss_divisor(batches: list[data.Batch], global_tokens: int | None = None) -> int:
    """What a step's summed token loss is divided by: its counted targets (the loader's step_targets, where a loss
    mask leaves a prompt's tokens out; at least 1, for a step of prompts alone), else `global_tokens`, else every
    target of `batches` (one rank's step)."""
    if batches and batches[0].step_targets is not None:
        return max(batches[0].step_targets, 1)
    return global_tokens or sum(b.targets.numel() for b in batches)


def pipeline_train_step(
    pipe: Pipeline, optimizer, scaler: torch.amp.GradScaler, batches: list[data.Batch], *, grad_clip: float,
    global_tokens: int, runtime: Runtime,
) -> StepResult:
    """`train_step` for a pipeline: the schedule runs every micro-batch of the step, then one optimizer step."""
    total = forward_backward(pipe, batches, global_tokens=loss_divisor(batches, global_tokens), runtime=runtime)
    return optimizer_step(pipe.parameters(), optimizer, scaler, grad_clip, total, pp_group=runtime.pp_group)


def training_step(model: nn.Module | Pipeline, optimizer, scaler, batches: list[data.Batch], cfg: JobConfig,
                  runtime: Runtime, global_tokens: int) -> StepResult:
    """One optimizer step of whatever the model is: one module, or this rank's pipeline stages."""
    if cfg.model.aux_loss_coeff or cfg.model.z_loss_coeff:
        # the balancing loss's gradient on the main loss's scale: per sequence of the global batch, x the fp16 loss
        # scale, as the token loss's backward gets them
        loss_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        set_aux_grad_scale(model_parts(model), cfg.data.seq_len / global_tokens * loss_scale)
    if isinstance(model, Pipeline):
        return pipeline_train_step(model, optimizer, scaler, batches, grad_clip=cfg.optim.grad_clip,
                                   global_tokens=global_tokens, runtime=runtime)
    return train_step(model, optimizer, scaler, batches, device=runtime.device, precision=autocast_precision(cfg),
                      grad_clip=cfg.optim.grad_clip, global_tokens=global_tokens, runtime=runtime)


def moe_after_step(parts: list[nn.Module], cfg: JobConfig, runtime: Runtime, global_tokens: int,
                   logged: bool) -> dict[str, float]:
    """Move the experts' balancing biases (model.bias_update_rate); on a `logged` step also return its routing
    metrics: the mean balancing loss per MoE layer and sequence, the share of (token, expert) pairs capacity
    dropped, and the busiest expert's pairs over the mean (moe.max_load; collectives over every rank: each pipeline
    stage holds other layers)."""
    group = runtime.mesh.grad_reduce.get_group() if runtime.mesh and runtime.grad_reduce_size > 1 else None
    # the global batch's load per expert (the counts summed over the data-parallel ranks), the largest over every
    # rank's layers (pipeline stages hold other layers)
    load = max_load(parts, group).to(runtime.device) if logged else None
    stats = end_of_step(parts, cfg.model.bias_update_rate, group)
    if not logged:
        return {}
    stats = torch.zeros(4, device=runtime.device) if stats is None else stats
    if runtime.world_size > 1:
        dist.all_reduce(stats)
        dist.all_reduce(load, op=dist.ReduceOp.MAX)
    aux, dropped, routed, z = (stats / cfg.parallel.tp).tolist()  # tp ranks route the same tokens
    per_layer_sequence = global_tokens / cfg.data.seq_len * max(cfg.model.n_moe_layers, 1)
    return {"moe/aux_loss": aux / per_layer_sequence, "moe/dropped": dropped / max(routed, 1),
            "moe/max_load": load.item(), **({"moe/z_loss": z / per_layer_sequence} if cfg.model.z_loss_coeff else {})}


def optimizer_step(params, optimizer, scaler, grad_clip: float, loss: torch.Tensor, pp_group=None) -> StepResult:
    """Unscale (fp16), measure and clip the gradient norm, step unless inf/nan, clear gradients."""
    params = [p for p in params if p.grad is not None]
    scaler.params = params  # what GradScaler unscales
    scaler.unscale_(optimizer)  # no-op unless fp16; clipping must see true gradients
    grad_norm = total_grad_norm(params, pp_group)
    if grad_clip > 0:
        # the coefficient as a Python number: gradients may be a mix of DTensors on several meshes and tensors
        coef = min(1.0, grad_clip / (float(grad_norm) + 1e-6))
        if coef < 1.0:
            for grads in grads_by_mesh(params):
                torch._foreach_mul_(grads, coef)  # what torch.nn.utils.clip_grads_with_norm_ runs, per mesh
    if not scaler.is_enabled() and not (math.isfinite(float(grad_norm)) and math.isfinite(loss.item())):
        optimizer.zero_grad(set_to_none=True)  # no update from a broken step; the loop decides what next
        return StepResult(loss=loss.item(), grad_norm=float(grad_norm), skipped=True, nonfinite=True)
    scale_before = scaler.get_scale() if scaler.is_enabled() else None
    # skips the update when unscale_ found inf/nan; a torch optimizer's step is elementwise (no collective to
    # count), ZeRO-1's all-gathers are counted inside ShardedOptimizer.step
    with contextlib.nullcontext() if isinstance(optimizer, ShardedOptimizer) else uncounted():
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    skipped = scale_before is not None and scaler.get_scale() < scale_before
    return StepResult(loss=loss.item(), grad_norm=float(grad_norm), skipped=skipped)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[data.Batch], device: torch.device, precision: str,
             runtime: Runtime | None = None) -> float:
    """Mean token loss over the validation micro-batches' counted targets (each data-parallel rank evaluates its
    share)."""
    if isinstance(model, Pipeline):
        total, tokens = evaluate_sums(model, batches, runtime)
        for stage in model_parts(model):
            reshard_after_evaluation(stage)
        runtime.sum_over_data_ranks(total)
        runtime.sum_over_data_ranks(tokens)
        return (total / tokens).item()
    model.eval()
    total = torch.zeros((), device=device)
    tokens = torch.zeros((), device=device)
    for batch in batches:
        positions = None
        if runtime is not None:
            batch, positions = runtime.shard_sequence(batch)
        total += loss_sum(model, batch, device, precision, positions)
        tokens += data.counted_targets(batch.targets)
    reshard_after_evaluation(model)
    model.train()
    if runtime is not None:
        runtime.sum_over_data_ranks(total)
        runtime.sum_over_data_ranks(tokens)
    return (total / tokens).item()


def build_data(cfg: JobConfig, runtime: Runtime) -> tuple[data.TokenDataset, data.DataLoader, list[data.Batch]]:
    """Tokenizer, cached token shards, this rank's loader and validation batches (rank 0 fills the cache)."""
    dp_rank, dp_size = runtime.dp_rank, runtime.dp_size
    dataset = runtime.main_first(lambda: data.prepare(cfg, dp_size))
    loader = data.DataLoader(
        dataset, micro_batch=cfg.train.micro_batch, grad_accum=cfg.train.grad_accum, seed=cfg.train.seed,
        dp_rank=dp_rank, dp_size=dp_size,
    )
    # train.val_batches global batches, as Megatron's --eval-iters counts them: the same samples on every layout
    # of the same global batch (micro_batch x grad_accum x dp)
    val = data.val_batches(dataset, micro_batch=cfg.train.micro_batch, n=cfg.train.val_batches * cfg.train.grad_accum,
                           dp_rank=dp_rank, dp_size=dp_size)
    return dataset, loader, val


def build_training_model(cfg: JobConfig, runtime: Runtime,
                         materialize: Callable = materialize) -> Transformer | Pipeline:
    """Meta model -> parallelize (TP, CP, activation checkpointing, compile, DP) -> materialise.

    With pp > 1: this rank's pipeline stages, each built that way, and the schedule that runs them.
    `materialize(module, model_args, device, seed)` gives the parallelised meta modules their storage and
    values; the simulator passes one that makes fake tensors.
    """
    if cfg.parallel.offload == "full":
        materialize = materialize_on_host(materialize, runtime.device)
    if runtime.pp_size > 1:
        return build_pipeline(cfg, runtime, materialize=materialize)
    model = build_model(cfg.model)
    # QLoRA: apply_lora makes the adapted base weights NF4 while still on meta, parallelize's FSDP2 then shards
    # their 4-bit storage, and materialize quantises each full value before cutting this rank's piece (nf4.py)
    apply_lora(model, cfg.lora, compute_dtype(cfg.train.precision))
    parallelize(model, runtime.mesh, cfg)
    materialize(model, cfg.model, runtime.device, cfg.train.seed)
    return model


def build_optimizer_for(model: nn.Module | Pipeline, cfg: JobConfig, runtime: Runtime, lr: float):
    """The optimizer, sharded across data-parallel ranks for ZeRO-1; and the optimizer the lr schedule drives."""
    if isinstance(model, Pipeline):
        model = model.stages  # one optimizer over all of this rank's stages, as one module
    if cfg.parallel.zero_stage == 1 and runtime.mesh is not None and runtime.grad_reduce_size > 1:
        sharded = ShardedOptimizer(model, lambda named: build_optimizer(named, cfg.optim, lr),
                                   runtime.mesh.grad_reduce.get_group())
        return sharded, sharded.inner
    optimizer = build_optimizer(model, cfg.optim, lr)
    return optimizer, optimizer


def train(cfg: JobConfig, save_final: str | None = None, *, process_exits: bool = False,
          stopped_before: list[int] = ()) -> dict:
    """Run a job from a validated config; returns a summary (losses, final validation loss). `process_exits`: this
    process ends with the run (the command line's), so after a stop it ignores further stop signals (StopSignal).
    `stopped_before`: stop signals the caller caught before this (while it imported torch)."""
    # from the start: a stop signal while the rank was still being built (process groups, data, model: a minute on
    # a busy machine) killed it, and the job ended with torchrun's traceback and nothing saved. It now stops after
    # the first step, as one during training does
    stop = StopSignal(process_exits=process_exits)
    if stopped_before:  # read once StopSignal's handlers are in: a signal between the two is in one or the other
        stop.request()
    try:
        runtime = Runtime.create(cfg)
    except BaseException:
        stop.close()  # the handlers as they were: the process may go on (verify's reference run)
        raise
    lock = None
    try:
        lock = lock_run_folder(cfg.metrics.out_dir, runtime)
        return _train(cfg, runtime, save_final, stop)
    except RuntimeError as e:
        explained = explain_failure(e, runtime.env, runtime.step) if runtime.world_size > 1 else None
        if explained is None:
            raise
        raise TrainingError(explained) from e
    finally:
        if lock is not None:
            lock.close()  # releases it
        stop.close()
        runtime.close()


RUN_RECORDS = ("job_config.json", "metrics.jsonl", "tb", data.RUN_TOKENIZER, "samples", "profile", STOPPED_FILE)
"""What a run writes of itself beside its checkpoints: moved with them when a run starts over (checkpoint.set_aside)."""
RUN_LOCK = ".lock"
"""The file in a run folder whose lock rank 0 of the run training there holds (lock_run_folder)."""


def lock_run_folder(out_dir: str, runtime: Runtime):
    """One run per folder: rank 0 takes an exclusive lock on <out_dir>/.lock before the run touches the folder,
    and holds it until the run ends (the system drops it when the process dies, so a killed run's restart finds it
    free). Two runs in one folder each cleared the other's unfinished checkpoint writes and mixed their logs.
    A folder the run cannot write is refused here too (it failed at the first checkpoint, steps later, in a
    traceback). Returns the open lock file (close it to release), or None on the other ranks. Every rank raises
    the one-line error together. On a filesystem without locks (some Lustre mounts) the run goes on unguarded,
    with a warning."""
    held, error = _claim(Path(out_dir)) if runtime.is_main else (None, None)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error:
        raise ConfigError("metrics.out_dir", *error)
    return held


_UNWRITABLE_FIX = "make it writable, or give this run another metrics.out_dir"


def _claim(folder: Path):
    """(the locked file, None), or (None, (why the run cannot have the folder, the fix))."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        unwritable = [p for p in (folder, folder / "checkpoints", folder / "metrics.jsonl")
                      if p.exists() and not os.access(p, os.W_OK)]
        if unwritable:
            return None, (f"cannot write {unwritable[0]} (Permission denied)", _UNWRITABLE_FIX)
        file = open(folder / RUN_LOCK, "a+")
    except OSError as e:
        return None, (f"cannot write {e.filename or folder} ({e.strerror})", _UNWRITABLE_FIX)
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        owner = file.read().strip() or "its owner unknown"
        file.close()
        return None, (f"another run trains in {folder} ({owner})",
                      "wait for that run to end (or stop it), or give this run another metrics.out_dir")
    except OSError as e:
        log.warning("%s: the filesystem gives no file lock (%s); nothing stops a second run in this folder",
                    folder / RUN_LOCK, e.strerror)
        return file, None
    file.truncate(0)
    file.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    file.flush()
    return file, None


def _train(cfg: JobConfig, runtime: Runtime, save_final: str | None, stop: StopSignal) -> dict:
    device = runtime.device
    if device.type == "cpu":
        keep_host_memory()  # activations live in host memory: reuse their blocks instead of faulting them in again
    # what draws from torch's own generator (LoRA's dropout) follows train.seed: this torch seeds each process at
    # random, and two identical runs differed from step 2. Megatron's rule: the same seed on every rank of a
    # stage, another per pipeline stage (its stages hold other layers). A resume restores the saved states.
    torch.manual_seed(cfg.train.seed + 100 * runtime.pp_rank)
    dataset, loader, val = build_data(cfg, runtime)
    model = build_training_model(cfg, runtime)
    global_batch = cfg.train.micro_batch * cfg.train.grad_accum * runtime.dp_size
    optimizer, inner = build_optimizer_for(model, cfg, runtime, effective_lr(cfg.optim, global_batch))
    schedule = build_lr_schedule(inner, cfg.optim, cfg.train.steps)
    scaler = build_grad_scaler(cfg.train, device)
    parts = model_parts(model)
    checkpoints = Checkpoints.create(cfg, TrainState(parts, optimizer, schedule, scaler, loader), device, stop)
    if cfg.lora.rank and cfg.checkpoint.init_from_hf:
        import_hf(parts, cfg.checkpoint.init_from_hf)  # LoRA checkpoints hold adapters only: the base goes first
    if cfg.checkpoint.enabled and cfg.checkpoint.resume and scan_checkpoints(cfg.metrics.out_dir).complete:
        # the ids before the checkpoint: another tokenizer also gives another sample count, and the loader's refusal
        # of that named the data's size, not data.tokenizer
        data.keep_run_tokenizer(cfg.data, cfg.metrics.out_dir, resumed=True, write=False)
    first_step = checkpoints.resume() + 1
    check_steps(cfg, first_step - 1)
    # before anything of the run folder is rewritten (metrics, job_config.json); every rank refuses together
    data.keep_run_tokenizer(cfg.data, cfg.metrics.out_dir, resumed=first_step > 1, write=runtime.is_main)
    if not cfg.checkpoint.enabled and not save_final and cfg.lora.rank and runtime.is_main:
        # a LoRA fine-tune without checkpoints trained adapters that nothing kept: export and generate then had
        # nothing of it to read, and the run said nothing until export refused
        log.warning("checkpoint.enabled = false: the LoRA adapters this run trains are not saved (nothing to export "
                    "or generate from); set checkpoint.enabled = true to keep them")
    unused = [f"lora.{k}" for k in ("alpha", "dropout", "targets")
              if getattr(cfg.lora, k) != getattr(LoraConfig(), k)] if not cfg.lora.rank else []
    if unused and runtime.is_main:  # a [lora] table without its rank was full fine-tuning, without a word
        log.warning("lora.rank = 0: every weight trains, and %s %s not used; set lora.rank (e.g. 16) to train "
                    "LoRA adapters", ", ".join(unused), "is" if len(unused) == 1 else "are")
    if cfg.optim.warmup_steps >= cfg.train.steps and runtime.is_main:
        # the schedule's warmup spans the whole run: the lr never decays, and stays below optim.lr where it is longer
        reached = cfg.train.steps / cfg.optim.warmup_steps
        log.warning("optim.warmup_steps = %d >= train.steps = %d: the whole run is warmup, its lr rises to %d%% of "
                    "optim.lr and never decays; set optim.warmup_steps below train.steps (e.g. %d)",
                    cfg.optim.warmup_steps, cfg.train.steps, round(100 * reached), max(1, cfg.train.steps // 10))
    if first_step == 1 and cfg.checkpoint.init_from_hf and not cfg.lora.rank:
        import_hf(parts, cfg.checkpoint.init_from_hf)  # fine-tuning: the weights, not the optimizer state
    if first_step == 1 and cfg.lora.init_from:
        import_peft(parts, cfg.lora.init_from)  # an adapter trained elsewhere, in place of the seeded B = 0
    elif cfg.lora.init_from and runtime.is_main:  # its adapters are the run's own since: the setting went unread
        log.warning("lora.init_from is not read: the run in %s goes on from its checkpoint of step %d, whose adapters "
                    "replaced it; to start from %s, use another metrics.out_dir", cfg.metrics.out_dir,
                    first_step - 1, cfg.lora.init_from)

    writer = MetricsWriter(cfg.metrics, cfg.train.steps, enabled=runtime.is_main, first_step=first_step)
    samples = SampleLog(cfg.metrics.out_dir, runtime.dp_rank, cfg.metrics.log_samples and runtime.leads_data_rank,
                        first_step=first_step, dp_size=runtime.dp_size)
    if runtime.is_main:
        (Path(cfg.metrics.out_dir) / "job_config.json").write_text(json.dumps(run_record(cfg), indent=2))
        (Path(cfg.metrics.out_dir) / STOPPED_FILE).unlink(missing_ok=True)  # an earlier attempt's
    tokens_per_step = global_batch * cfg.data.seq_len
    writer.print(
        f"model {cfg.model.name}: {num_params(cfg.model) / 1e6:.2f}M params"
        + (f" ({num_params(cfg.model, active=True) / 1e6:.2f}M active)" if cfg.model.n_experts else "")
        + (f", {adapter_params(cfg.model, cfg.lora.rank, cfg.lora.targets) / 1e6:.2f}M trainable (LoRA rank "
           f"{cfg.lora.rank}{' on an NF4 base' if cfg.lora.qlora else ''})" if cfg.lora.rank else "") + " | "
        f"{dataset.num_samples('train')} train / {dataset.num_samples('val')} val samples of "
        f"{cfg.data.seq_len} tokens | "
        f"{tokens_per_step} tokens/step on {runtime.describe()}"
        + (f" | resumed after step {first_step - 1}" if first_step > 1 else "")
    )
    writer.advance(first_step - 1)

    summary: dict = {"losses": [], "comm": {}, "first_step": first_step}
    meter = Throughput(cfg, runtime, tokens_per_step)
    # the collectives of one step, counted once (the counter costs a Python call per op); the second step,
    # because the first also carries one-off traffic (pipeline shape probing)
    comm_step = min(first_step + 1, cfg.train.steps) if runtime.mesh else 0
    nonfinite = 0
    for step in range(first_step, cfg.train.steps + 1):
        start = time.perf_counter()
        runtime.step = step
        batches = loader.next_step()
        counter = CommCounter() if step == comm_step else None
        profiler = step_profiler(device) if step == cfg.metrics.profile_step else None
        with counter or contextlib.nullcontext(), profiler or contextlib.nullcontext():
            result = training_step(model, optimizer, scaler, batches, cfg, runtime, tokens_per_step)
        if counter is not None:
            summary["comm"] = counter.stats.as_metrics()
        if profiler is not None:
            write_profile(profiler, Path(cfg.metrics.out_dir) / "profile", runtime.env.rank, device)
        # a run's last step is logged, and so is the step train.stop_after ends it at: the loss the run's "done" line
        # reports was missing from metrics.jsonl (and from the resumed run's log) where log_every did not divide it
        logged = step % cfg.metrics.log_every == 0 or step in (cfg.train.steps, cfg.train.stop_after)
        routing = moe_after_step(parts, cfg, runtime, tokens_per_step, logged) if cfg.model.n_experts else {}
        # the lr this step ran at, as the optimizer held it (float(): torchao's optimizers keep lr as a tensor)
        lr = float(optimizer.param_groups[0]["lr"]) if logged else None
        schedule.step()
        meter.add(time.perf_counter() - start)
        samples.log(step, batches)
        summary["losses"].append(result.loss)
        writer.advance()
        nonfinite = nonfinite + 1 if result.nonfinite else 0
        if nonfinite > cfg.train.max_nonfinite_steps:
            raise TrainingError(
                f"step {step}: non-finite loss ({result.loss}) or gradient norm ({result.grad_norm}) on rank "
                f"{runtime.env.rank}; stopped with the last good checkpoint kept (train.max_nonfinite_steps = "
                f"{cfg.train.max_nonfinite_steps} allows skipping some)"
            )
        if logged:
            writer.log(step, meter.values(result, lr, scaler) | summary["comm"] | routing)
        if cfg.train.val_every and (step % cfg.train.val_every == 0 or step == cfg.train.steps):
            summary["val_loss"] = evaluate(model, val, device, autocast_precision(cfg), runtime)
            writer.log(step, {"val_loss": summary["val_loss"]})
            writer.print(f"step {step}: loss {result.loss:.4f}  val_loss {summary['val_loss']:.4f}")
        # a stop asked for during the last step is the run's end: it is not reported as a stop (a scheduler told
        # "stopped" would run the finished job again, or count it failed)
        if checkpoints.after_step(step) and step < cfg.train.steps:
            writer.print(f"step {step}: stopped as asked (a signal, or train.stop_after); "
                         + ("state saved" if cfg.checkpoint.enabled else "nothing saved (checkpoint.enabled = false)"))
            summary["stopped_at"] = step
            if runtime.env.local_rank == 0:
                # written on every machine, as its launcher reads it once its own ranks have ended: a signal that
                # reached one machine (a drained node) stopped all, and the others' launchers exited 0 (a Kubernetes
                # Job's index done), not --stopped-exit-code
                stop = {"step": step, "signal": step != cfg.train.stop_after}
                (Path(cfg.metrics.out_dir) / STOPPED_FILE).write_text(json.dumps(stop) + "\n")
            break
    checkpoints.close()
    writer.close()
    samples.close()
    if save_final:
        save_full_parameters(parts, save_final, runtime)
    return summary  # not the model: it holds the process groups, which runtime.close() destroys


def step_profiler(device: torch.device) -> torch.profiler.profile:
    """torch.profiler over one training step: host operators, and the accelerator's kernels where there is one.
    Every thread's operators: the CPU attention can run its slices on threads of its own (model.CpuAttention)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, record_shapes=True,
                                  experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True))


def write_profile(profiler: torch.profiler.profile, folder: Path, rank: int, device: torch.device) -> None:
    """rank<r>.txt: operators by self time (host, then accelerator where profiled); rank<r>.json: Chrome trace."""
    folder.mkdir(parents=True, exist_ok=True)
    table = profiler.key_averages()
    sorts = ["self_cpu_time_total"] + (["self_device_time_total"] if device.type == "cuda" else [])
    (folder / f"rank{rank}.txt").write_text("\n\n".join(table.table(sort_by=key, row_limit=40) for key in sorts))
    profiler.export_chrome_trace(str(folder / f"rank{rank}.json"))


class Throughput:
    """Tokens/s, step time, MFU and peak memory over the steps since the last report (training time only)."""

    def __init__(self, cfg: JobConfig, runtime: Runtime, tokens_per_step: int):
        self.tokens_per_step, self.runtime = tokens_per_step, runtime
        adapters = adapter_params(cfg.model, cfg.lora.rank, cfg.lora.targets) if cfg.lora.rank else None
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len, adapters)
        self.peak = peak_flops(cfg.metrics, cfg.train.precision, runtime.device)
        self.time, self.steps = 0.0, 0

    def add(self, seconds: float) -> None:
        self.time += seconds
        self.steps += 1

    def values(self, result: StepResult, lr: float, scaler) -> dict[str, float]:
        """`lr`: the learning rate the step ran at (read before the schedule moves on to the next step's)."""
        tokens_per_s = self.steps * self.tokens_per_step / self.time
        values = {
            "loss": result.loss, "grad_norm": result.grad_norm, "lr": lr,
            "tokens_per_s": tokens_per_s, "step_time_s": self.time / self.steps,
            "peak_memory_gib": self._peak_memory() / 2**30, "skipped": int(result.skipped),
        }
        if self.peak:
            values["mfu"] = tokens_per_s * self.flops_per_token / (self.peak * self.runtime.world_size)
        if scaler.is_enabled():
            values["loss_scale"] = scaler.get_scale()
        self.time, self.steps = 0.0, 0
        return values

    def _peak_memory(self) -> float:
        """The highest rank's peak memory (every rank calls this on a logged step): ranks differ, a pipeline's first
        stage most, and the log was rank 0's alone (torchtitan's is too)."""
        peak = float(peak_memory_bytes(self.runtime.device))
        if self.runtime.world_size > 1:
            highest = torch.tensor([peak], dtype=torch.float64, device=self.runtime.device)
            dist.all_reduce(highest, op=dist.ReduceOp.MAX)
            peak = highest.item()
        return peak


@dataclass
class Checkpoints:
    """The loop's view of checkpointing: resume at the start, save every N steps, at the end and on SIGTERM."""

    cfg: JobConfig
    state: TrainState
    device: torch.device
    checkpointer: Checkpointer | None
    stop: StopSignal
    """The run's stop signals (train() installs and closes them)."""

    @classmethod
    def create(cls, cfg: JobConfig, state: TrainState, device: torch.device, stop: StopSignal) -> Checkpoints:
        if not cfg.checkpoint.enabled:
            # a signal still stops the run cleanly after its step (SIGUSR1's default action killed it), unsaved
            return cls(cfg, state, device, None, stop)
        base = lora_base_identity(cfg.checkpoint.init_from_hf) if cfg.lora.rank else None
        checkpointer = Checkpointer(cfg.metrics.out_dir, cfg.model, layout=to_dict(cfg.parallel),
                                    keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save, lora_base=base)
        return cls(cfg, state, device, checkpointer, stop)

    def resume(self) -> int:
        """The step the newest complete checkpoint was saved at (its state loaded), or 0."""
        if self.checkpointer is None or not self.cfg.checkpoint.resume:
            # a run started over among an earlier run's checkpoints would leave the folder holding both, and a
            # later resume would go on from the newest, whichever run saved it; a run without checkpoints rewrote
            # the earlier run's records, and export --run wrote its checkpoints with the new run's config. The
            # earlier run is set aside
            why = "checkpoint.resume = false" if self.checkpointer else "checkpoint.enabled = false"
            set_aside(self.cfg.metrics.out_dir, RUN_RECORDS, read=(self.cfg.data.tokenizer,), why=why)
            return 0
        return self.checkpointer.resume(self.state)

    def after_step(self, step: int) -> bool:
        """Save when due; True when a stop was requested (the state is then saved, if checkpoints are on)."""
        stopping = self.stop.requested(self.device)  # collective: every rank stops after the same step
        stopping = stopping or step == self.cfg.train.stop_after
        if self.checkpointer is None:
            return stopping
        if step % self.cfg.checkpoint.every == 0 or step == self.cfg.train.steps or stopping:
            self.checkpointer.save(step, self.state)
        return stopping

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()


def model_from_checkpoint(cfg: JobConfig, runtime: Runtime) -> tuple[Transformer | Pipeline, Path]:
    """This rank's model (cfg's layout) with the weights of the newest complete checkpoint of cfg's run folder,
    and that checkpoint's path. No optimizer state is read.

    A LoRA checkpoint holds only the adapters: the frozen base is rebuilt first from where the run took it
    (the seeded init of build_training_model, then checkpoint.init_from_hf if set), the adapters go on top.
    """
    from shardwise.checkpoint import CheckpointError, latest_checkpoint, load

    path = latest_checkpoint(cfg.metrics.out_dir)
    if path is None:
        raise CheckpointError(Path(cfg.metrics.out_dir) / "checkpoints", "no complete checkpoint",
                              "train with checkpoint.enabled = true first, or point metrics.out_dir at the run")
    base = cfg.checkpoint.init_from_hf
    if cfg.lora.rank and base and not (Path(base) / "config.json").is_file():
        # the checkpoint holds adapters only; a base moved or deleted since training was a FileNotFoundError
        # traceback from inside the import (export --run, generate --run)
        raise ConfigError("checkpoint.init_from_hf", f"{base}, the base this run's LoRA adapters were trained on, "
                          "has no config.json (moved or deleted since?)",
                          "put the base back in that folder (a symlink will do): the checkpoint holds only adapters")
    model = build_training_model(cfg, runtime)
    parts = model_parts(model)
    if cfg.lora.rank and cfg.checkpoint.init_from_hf:
        import_hf(parts, cfg.checkpoint.init_from_hf)
    load(path, TrainState(parts), cfg.model,
         lora_base=lora_base_identity(cfg.checkpoint.init_from_hf) if cfg.lora.rank else None)
    return model, path


def export_hf_from_checkpoint(cfg: JobConfig, out: str, fmt: str = "merged") -> Path:
    """Load the newest complete checkpoint of cfg's run folder (weights only) and write it as a Hugging Face
    folder: `fmt` "merged" (the model; a LoRA run's adapters merged into its weights), "base" (a LoRA run's
    frozen base alone) or "peft" (a LoRA run's adapters, in peft's format); the CLI checks "base" and "peft"
    are asked of a LoRA run."""
    from shardwise.hf import export_hf, export_peft, write_tokenizer_files

    runtime = Runtime.create(cfg)
    try:
        model, path = model_from_checkpoint(cfg, runtime)
        parts = model_parts(model)
        if fmt == "peft":
            base = cfg.checkpoint.init_from_hf
            export_peft(parts, cfg.lora, out, runtime, base_model=str(Path(base).resolve()) if base else None)
        else:
            # a model folder carries its tokenizer and end-of-text id (generate --hf, transformers)
            tokenizer = data.run_tokenizer_json(cfg.data, cfg.metrics.out_dir)
            base = Path(cfg.checkpoint.init_from_hf) / "config.json" if cfg.checkpoint.init_from_hf else None
            if base is not None and base.is_file():  # fine-tuned: the base model's own framing
                theirs = json.loads(base.read_text())
                ids = {k: v for k, v in theirs.items() if k in ("bos_token_id", "eos_token_id")}
                # and its context, or the longer sequences it was fine-tuned on: a [model] written without max_seq_len
                # (2048 by default) fine-tunes the base at any length, and the exported config.json told
                # transformers the model's context was that
                if isinstance(theirs.get("max_position_embeddings"), int):
                    ids["max_position_embeddings"] = max(theirs["max_position_embeddings"], cfg.data.seq_len)
            else:
                # trained here: documents are packed between end-of-text tokens, so a text starts after one and
                # ends with one, the framing `shardwise generate --run` uses
                eos = data.run_tokenizer(cfg.data, cfg.metrics.out_dir).eos_id
                ids = {"bos_token_id": eos, "eos_token_id": eos}
            export_hf(parts, cfg.model, out, runtime, merge_lora=fmt == "merged", token_ids=ids)
            if runtime.is_main:
                write_tokenizer_files(out, tokenizer, ids, ids.get("max_position_embeddings", cfg.model.max_seq_len),
                                      cfg.checkpoint.init_from_hf)
    finally:
        runtime.close()
    return path


def save_full_parameters(parts: list[nn.Module], path: str, runtime: Runtime) -> None:
    """Write every parameter, unsharded, under its canonical name to safetensors (for parity checks).

    All ranks take part (gathering a DTensor is a collective); one rank per pipeline stage writes the
    stage's file, `path` itself for a single stage, else `path.stage<k>`.
    """
    from safetensors.torch import save_file

    tensors = {}
    for part in parts:
        for name, param in part.named_parameters():
            full = full_value(param)  # QLoRA: dequantised
            tensors[canonical_name(name)] = full.detach().to("cpu").contiguous()
    if runtime.writes_stage_files:
        target = path if runtime.pp_size == 1 else f"{path}.stage{runtime.pp_rank}"
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, target)


def counted_step(cfg, seed: int = 0):
    """Build the model under cfg's layout on the running process group and run two training steps on random
    tokens, the second under a CommCounter (the first carries one-off traffic such as pipeline shape
    probing). Returns (stats, model, optimizer, runtime), for tests and benchmarks."""
    runtime = Runtime.create(cfg)
    model = build_training_model(cfg, runtime)
    optimizer, _ = build_optimizer_for(model, cfg, runtime, lr=1e-3)
    scaler = build_grad_scaler(cfg.train, runtime.device)
    g = torch.Generator().manual_seed(seed * 1000 + runtime.dp_rank)
    b, s = cfg.train.micro_batch, cfg.data.seq_len
    counter = CommCounter()
    for step in range(2):
        tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=g)
        batch = data.Batch(tokens[:, :-1], tokens[:, 1:], list(range(b)))
        with counter if step == 1 else contextlib.nullcontext():
            training_step(model, optimizer, scaler, [batch] * cfg.train.grad_accum, cfg, runtime,
                          global_tokens=b * s * cfg.train.grad_accum * runtime.dp_size)
    return counter.stats, model, optimizer, runtime
