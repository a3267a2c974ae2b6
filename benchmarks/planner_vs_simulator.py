"""The planner's peak memory against the simulator's, on plans drawn at random from the search space.

For each of --plans plans drawn (seeded) from the plans `shardwise plan` would search for the job (Llama 3 8B cut to
--layers blocks on --gpus H100s, sequence 2,048, two sequences per GPU per step, bf16), every rank the simulator
checks (one per pipeline stage) is simulated (`shardwise simulate`: the engine's real step on fake tensors) and
its measured peak compared with the planner's prediction for that stage. Prints one line per plan, the ratio
measured / predicted per stage, and a summary; the planner's allowances (fragmentation, fixed overhead) are off,
as in the tests that hold it to the simulator.

    .venv/bin/python benchmarks/planner_vs_simulator.py --seed 7 --plans 12     # ~8 minutes on 2 cores
    .venv/bin/python benchmarks/planner_vs_simulator.py --mixed-precision fsdp  # FSDP2's bf16 policy only
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import tempfile
import time

from shardwise.config import load_config
from shardwise.hardware import Cluster, accelerator
from shardwise.model_args import preset
from shardwise.planner import Training, stage_memory
from shardwise.planner.config_out import write_config
from shardwise.planner.memory import simulator_categories
from shardwise.planner.search import plan_space
from shardwise.simulate import ranks_to_simulate, simulate_rank


def describe(p) -> str:
    pipe = f" {p.pp_schedule} v{p.virtual_stages}" if p.pp > 1 else ""
    return (f"tp{p.tp} pp{p.pp} cp{p.cp} ep{p.ep} dp{p.dp_replicate}x{p.dp_shard} z{p.zero_stage} mb{p.micro_batch} "
            f"ga{p.grad_accum} {p.activation_checkpoint}{pipe}{' sp' if p.sequence_parallel else ''}"
            f"{' bf16-fsdp' if p.mixed_precision == 'fsdp' else ''}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--plans", type=int, default=12)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--mixed-precision", choices=["any", "autocast", "fsdp"], default="any",
                    help="draw only plans with this parallel.mixed_precision (fsdp: FSDP2's bf16 policy)")
    args = ap.parse_args()

    random.seed(args.seed)
    model = dataclasses.replace(preset(args.model), n_layers=args.layers)
    training = Training(seq_len=2048, global_batch=2 * args.gpus, precision="bf16",
                        fragmentation=0.0, fixed_overhead_gib=0.0)
    fixed = {} if args.mixed_precision == "any" else {"mixed_precision": args.mixed_precision}
    plans = random.sample(list(plan_space(model, training, Cluster(accelerator("h100"), args.gpus), fixed)),
                          args.plans)
    ratios = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for plan in plans:
            path = os.path.join(tmp, "plan.toml")
            write_config(path, model, training, plan)
            cfg = load_config(path)
            cfg.model = model
            cells = []
            for rank in ranks_to_simulate(cfg.parallel, args.gpus):
                stage = rank // (args.gpus // plan.pp)
                measured = simulate_rank(cfg, args.gpus, rank).peak_step.peak_bytes
                predicted = simulator_categories(stage_memory(model, training, plan, stage))["total"]
                ratios.append(measured / predicted)
                cells.append(f"stage {stage}: {measured / predicted:.3f}")
            print(f"{describe(plan):60s} {'  '.join(cells)}", flush=True)
    inside = sum(abs(r - 1) <= 0.10 for r in ratios)
    print(f"\n{len(ratios)} ranks of {len(plans)} plans, measured / predicted {min(ratios):.3f} to {max(ratios):.3f}; "
          f"{inside} within 10%, {sum(abs(r - 1) <= 0.05 for r in ratios)} within 5% "
          f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
