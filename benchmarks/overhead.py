"""shardwise's training step against a plain hand-written PyTorch loop: same model, batch, seed.

The two are alternated step by step in one process so that both see the same machine state (thermal,
caches, other load); each reports the median of its step times. The ratio is shardwise / plain.

    python benchmarks/overhead.py [--model debug] [--micro-batch 16] [--seq-len 256] [--steps 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from shardwise.config import OptimConfig, TrainConfig
from shardwise.data import Batch
from shardwise.model import build_model, materialize
from shardwise.model_args import preset
from shardwise.optim import build_lr_schedule, build_optimizer
from shardwise.train import build_grad_scaler, train_step


def plain_step(model, optimizer, inputs, targets):
    """What one writes by hand: forward, mean cross-entropy, backward, AdamW step."""
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="debug")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    margs = preset(args.model)
    models = []
    for _ in range(2):
        model = build_model(margs)
        materialize(model, margs, device, seed=0)
        models.append(model)
    ours, plain = models
    optim_cfg = OptimConfig()
    ours_opt = build_optimizer(ours, optim_cfg, optim_cfg.lr)
    ours_schedule = build_lr_schedule(ours_opt, optim_cfg, args.steps + args.warmup)
    scaler = build_grad_scaler(TrainConfig(), device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=optim_cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, margs.vocab_size, (args.micro_batch, args.seq_len + 1), generator=g)
    batch = Batch(tokens[:, :-1].to(device), tokens[:, 1:].to(device), list(range(args.micro_batch)))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = {"shardwise": [], "plain": []}
    for step in range(args.warmup + args.steps):
        for name in ("shardwise", "plain") if step % 2 == 0 else ("plain", "shardwise"):
            sync()
            start = time.perf_counter()
            if name == "shardwise":
                train_step(ours, ours_opt, scaler, [batch], device=device, grad_clip=optim_cfg.grad_clip)
                ours_schedule.step()
            else:
                plain_step(plain, plain_opt, batch.inputs, batch.targets)
            sync()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)

    ours_ms = statistics.median(times["shardwise"]) * 1e3
    plain_ms = statistics.median(times["plain"]) * 1e3
    tokens_per_step = args.micro_batch * args.seq_len
    print(f"model {args.model}, batch {args.micro_batch} x {args.seq_len} tokens, {device}, "
          f"median of {args.steps} alternated steps, {torch.get_num_threads()} threads")
    print(f"{'loop':<12}{'step ms':>10}{'tokens/s':>12}")
    print(f"{'plain':<12}{plain_ms:>10.1f}{tokens_per_step / plain_ms * 1e3:>12.0f}")
    print(f"{'shardwise':<12}{ours_ms:>10.1f}{tokens_per_step / ours_ms * 1e3:>12.0f}")
    print(f"ratio shardwise / plain: {ours_ms / plain_ms:.3f}")


if __name__ == "__main__":
    main()
