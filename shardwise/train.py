"""The single-device training loop: every parallel layout is proven equal to this.

Read top to bottom: build the data, build the model (meta -> transforms -> materialise), build the optimizer,
then loop over steps. One optimizer step = `train_step` over the step's micro-batches.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shardwise import data
from shardwise.activation_checkpoint import apply_activation_checkpointing
from shardwise.config import ConfigError, JobConfig, TrainConfig, to_dict
from shardwise.metrics import MetricsWriter, peak_flops, peak_memory_bytes
from shardwise.model import Transformer, build_model, flops_per_token, materialize, num_params
from shardwise.optim import build_lr_schedule, build_optimizer, effective_lr


@dataclass
class StepResult:
    loss: float
    """Mean token loss over the global batch."""
    grad_norm: float
    """Global gradient norm before clipping (of the unscaled gradients)."""
    skipped: bool
    """True when fp16 loss scaling found inf/nan gradients and the optimizer step was skipped."""


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def autocast_context(precision: str, device: torch.device):
    """bf16/fp16 autocast: matmuls in low precision, weights and optimizer stay fp32 (the master copy)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device.type, dtype=dtype)


def build_grad_scaler(cfg: TrainConfig, device: torch.device) -> torch.amp.GradScaler:
    """Dynamic loss scaling for fp16 (disabled otherwise): an inf/nan step is skipped and the scale halves."""
    return torch.amp.GradScaler(
        device.type,
        init_scale=cfg.loss_scale_init,
        growth_interval=cfg.loss_scale_growth_interval,
        enabled=cfg.precision == "fp16",
    )


def build_training_model(cfg: JobConfig, device: torch.device) -> Transformer:
    """Meta model -> activation checkpointing -> compile -> materialise with the (seed, name) init."""
    model = build_model(cfg.model)
    apply_activation_checkpointing(model, cfg.train.activation_checkpoint, cfg.train.activation_checkpoint_every)
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()
    materialize(model, cfg.model, device, cfg.train.seed)
    return model


def loss_sum(model: nn.Module, batch: data.Batch, device: torch.device, precision: str) -> torch.Tensor:
    """Summed (not averaged) token cross-entropy of one micro-batch, computed in fp32."""
    with autocast_context(precision, device):
        logits = model(batch.inputs.to(device, non_blocking=True))
    targets = batch.targets.to(device, non_blocking=True)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


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
) -> StepResult:
    """Forward/backward every micro-batch, then one optimizer step.

    Each micro-batch's summed loss is divided by the token count of the whole global batch (all micro-batches,
    and later all data-parallel ranks), so the accumulated gradient is that of the mean loss over the global
    batch however it is split: k micro-batches of b/k give the gradient of one batch of b.
    """
    global_tokens = global_tokens or sum(b.targets.numel() for b in batches)
    total = torch.zeros((), device=device)
    for batch in batches:
        loss = loss_sum(model, batch, device, precision) / global_tokens
        scaler.scale(loss).backward()
        total += loss.detach()
    scaler.unscale_(optimizer)  # no-op unless fp16; clipping must see true gradients
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = grad_clip if grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    scale_before = scaler.get_scale() if scaler.is_enabled() else None
    scaler.step(optimizer)  # skips the update when unscale_ found inf/nan
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    skipped = scale_before is not None and scaler.get_scale() < scale_before
    return StepResult(loss=total.item(), grad_norm=float(grad_norm), skipped=skipped)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[data.Batch], device: torch.device, precision: str) -> float:
    model.eval()
    total = sum(loss_sum(model, b, device, precision).item() for b in batches)
    model.train()
    return total / sum(b.targets.numel() for b in batches)


def build_data(cfg: JobConfig) -> tuple[data.TokenDataset, data.DataLoader, list[data.Batch]]:
    tokenizer = data.build_tokenizer(cfg.data, data.resolve_cache_root(cfg.data))
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size", f"{cfg.model.vocab_size} < the tokenizer's {tokenizer.vocab_size} ids",
            f"set model.vocab_size >= {tokenizer.vocab_size}",
        )
    dataset = data.TokenDataset.build(cfg.data, tokenizer)
    loader = data.DataLoader(
        dataset, micro_batch=cfg.train.micro_batch, grad_accum=cfg.train.grad_accum, seed=cfg.train.seed
    )
    val = data.val_batches(dataset, micro_batch=cfg.train.micro_batch, n=cfg.train.val_batches)
    return dataset, loader, val


def train(cfg: JobConfig) -> dict:
    """Run a job from a validated config; returns a summary (first/last loss, final validation loss)."""
    device = resolve_device(cfg.train)
    dataset, loader, val = build_data(cfg)
    model = build_training_model(cfg, device)
    global_batch = cfg.train.micro_batch * cfg.train.grad_accum
    optimizer = build_optimizer(model, cfg.optim, effective_lr(cfg.optim, global_batch))
    schedule = build_lr_schedule(optimizer, cfg.optim, cfg.train.steps)
    scaler = build_grad_scaler(cfg.train, device)

    writer = MetricsWriter(cfg.metrics, cfg.train.steps)
    (Path(cfg.metrics.out_dir) / "job_config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    tokens_per_step = global_batch * cfg.data.seq_len
    flops_token = flops_per_token(cfg.model, cfg.data.seq_len)
    peak = peak_flops(cfg.metrics, cfg.train.precision, device)
    writer.print(
        f"model {cfg.model.name}: {num_params(cfg.model) / 1e6:.2f}M params | "
        f"{dataset.num_samples('train')} train / {dataset.num_samples('val')} val samples of {cfg.data.seq_len} tokens | "
        f"{tokens_per_step} tokens/step on {device}"
    )

    summary: dict = {"losses": []}
    window_time, window_steps = 0.0, 0  # training time only: validation is not throughput
    for step in range(1, cfg.train.steps + 1):
        start = time.perf_counter()
        batches = loader.next_step()
        result = train_step(
            model, optimizer, scaler, batches, device=device,
            precision=cfg.train.precision, grad_clip=cfg.optim.grad_clip,
        )
        schedule.step()
        window_time += time.perf_counter() - start
        window_steps += 1
        summary["losses"].append(result.loss)
        writer.advance()
        if step % cfg.metrics.log_every == 0 or step == cfg.train.steps:
            tokens_per_s = window_steps * tokens_per_step / window_time
            values = {
                "loss": result.loss, "grad_norm": result.grad_norm, "lr": schedule.get_last_lr()[0],
                "tokens_per_s": tokens_per_s, "step_time_s": window_time / window_steps,
                "peak_memory_gib": peak_memory_bytes(device) / 2**30, "skipped": int(result.skipped),
            }
            if peak:
                values["mfu"] = tokens_per_s * flops_token / peak
            if scaler.is_enabled():
                values["loss_scale"] = scaler.get_scale()
            writer.log(step, values)
            window_time, window_steps = 0.0, 0
        if cfg.train.val_every and (step % cfg.train.val_every == 0 or step == cfg.train.steps):
            summary["val_loss"] = evaluate(model, val, device, cfg.train.precision)
            writer.log(step, {"val_loss": summary["val_loss"]})
            writer.print(f"step {step}: loss {result.loss:.4f}  val_loss {summary['val_loss']:.4f}")
    writer.close()
    summary["model"] = model
    return summary
