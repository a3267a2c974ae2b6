"""Measured pipeline idle time per stage against the bubble formulas.

Each schedule runs real training steps of a pipeline on local gloo processes (one core each). A rank's busy
time is the wall time its stage modules spend in forward and backward (module hooks); its idle fraction is
1 - busy / step time. Theory, for P stages, M micro-batches per step and v stages per rank, with equal
stages and backward = 2 x forward (GPipe, Huang et al. 2019; 1F1B and interleaving, Narayanan et al. 2021):

    gpipe, 1f1b:        (P - 1) / (M + P - 1)
    interleaved-1f1b:   (P - 1) / (v M + P - 1)

Point-to-point transfers and the loss are inside the step time and outside the stages' busy time, so
measured idle sits a little above theory. Use as many processes as cores (2 here) for clean figures.

    python benchmarks/pipeline_bubble.py [--pp 2] [--microbatches 2 4 8] [--steps 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from shardwise.config import load_config
from shardwise.data import Batch
from shardwise.distributed import run_distributed
from shardwise.parallel.pipeline import build_pipeline, forward_backward
from shardwise.parallel.runtime import Runtime


def _model(dim: int, seq: int) -> list[str]:
    return [f"model.dim={dim}", "model.n_heads=8", "model.n_kv_heads=4", f"model.ffn_hidden={3 * dim}",
            "model.vocab_size=320", f"model.max_seq_len={seq}", f"data.seq_len={seq}", "optim.name='sgd'"]


class BusyTimer:
    """Wall time a stage module spends in forward and backward.

    Forward: forward pre-hook to forward hook. Backward: from the backward pre-hook (the output gradient has
    arrived) to the last parameter gradient accumulated after it; parameter hooks rather than the module's
    full backward hook, which fires at once on the first stage (its token-id input needs no gradient).
    """

    def __init__(self, module: torch.nn.Module):
        self.busy, self._start, self._backward = 0.0, 0.0, None
        module.register_forward_pre_hook(self._begin_forward)
        module.register_forward_hook(self._end_forward)
        module.register_full_backward_pre_hook(self._begin_backward)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _begin_forward(self, *_):
        self.flush()
        self._start = time.perf_counter()

    def _end_forward(self, *_):
        self.busy += time.perf_counter() - self._start

    def _begin_backward(self, *_):
        self.flush()
        self._backward = [time.perf_counter(), None]

    def _grad_ready(self, _):
        if self._backward is not None:
            self._backward[1] = time.perf_counter()

    def flush(self) -> None:
        if self._backward is not None and self._backward[1] is not None:
            self.busy += self._backward[1] - self._backward[0]
        self._backward = None


def _run(schedule: str, pp: int, m: int, v: int, layers: int, steps: int, model: list[str]) -> dict:
    cfg = load_config(None, [*model, f"model.n_layers={layers}", f"parallel.pp={pp}",
                             f"parallel.pp_schedule='{schedule}'", f"parallel.virtual_stages={v}",
                             f"parallel.pp_microbatches={m}", f"train.micro_batch={m}"])
    runtime = Runtime.create(cfg)
    pipe = build_pipeline(cfg, runtime)
    timers = [BusyTimer(stage) for stage in pipe.stages]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (m, cfg.data.seq_len + 1), generator=g)
    batch = Batch(tokens[:, :-1], tokens[:, 1:], list(range(m)))
    forward_backward(pipe, [batch], global_tokens=tokens[:, 1:].numel(), runtime=runtime)  # warm-up + shapes
    elapsed = 0.0
    for timer in timers:
        timer.flush()
        timer.busy = 0.0
    for _ in range(steps):
        torch.distributed.barrier()
        start = time.perf_counter()
        forward_backward(pipe, [batch], global_tokens=tokens[:, 1:].numel(), runtime=runtime)
        elapsed += time.perf_counter() - start
        for timer in timers:
            timer.flush()
    busy = sum(timer.busy for timer in timers)
    return {"idle": 1 - busy / elapsed, "step_s": elapsed / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    p = args.pp
    print(f"pp={p}, d={args.dim}, 4 layers per rank, seq {args.seq_len}, one micro-batch = 1 sequence")
    print(f"{'schedule':<18}{'M':>4}{'v':>3}{'step s':>9}{'idle per stage':>24}{'mean':>8}{'theory':>8}")
    for m in args.microbatches:
        for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)):
            if schedule != "gpipe" and m < p:
                continue
            ranks = run_distributed(_run, p, schedule, p, m, v, 4 * p, args.steps, _model(args.dim, args.seq_len))
            idle = [r["idle"] for r in ranks]
            theory = (p - 1) / (v * m + p - 1)
            print(f"{schedule:<18}{m:>4}{v:>3}{ranks[0]['step_s']:>9.3f}"
                  f"{' '.join(f'{x:.3f}' for x in idle):>24}{sum(idle) / p:>8.3f}{theory:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
