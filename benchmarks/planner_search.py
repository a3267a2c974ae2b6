"""How long `shardwise plan`'s search takes, against evaluating every plan of the same space, side by side.

For each job the search (memory floors, dominance, offload only when nothing fits without it) and an exhaustive
walk (`evaluate` on every plan of `plan_space`, offload the same way) run in this process, one after the other.
The table gives the plans each evaluated, CPU seconds (one thread; wall time would also count whatever else the
machine runs), the exhaustive walk's CPU time over the search's, and whether both found a plan of the same
predicted step time: the pruning must never change the answer. Target: the largest job (Llama 3 405B on 16,384
GPUs) under 5 CPU seconds here. Exits 1 when a job's best differs or the target is missed.

    python benchmarks/planner_search.py [--quick]
"""

from __future__ import annotations

import argparse
import time

from shardwise.model_args import preset
from shardwise.planner import Cluster, Training, accelerator, evaluate, plan_space, search

JOBS = [
    # model, GPUs, accelerator, sequence, global batch (sequences)
    ("llama3-8b", 16, "h100", 4096, 64),
    ("llama3-8b", 16, "l4", 8192, 16),
    ("mixtral-8x7b", 32, "h100", 4096, 256),
    ("llama3-70b", 64, "h100", 4096, 256),
    ("deepseek-v3-like", 256, "h100", 4096, 256),
    ("llama3-405b", 1024, "h100", 8192, 2048),
    ("llama3-405b", 16384, "h100", 8192, 2048),
]


def exhaustive(args, training, cluster):
    """(fastest fitting evaluation or None, plans evaluated): every plan without offload, then with if none fit."""
    count = 0
    for offload in ("none", "full"):
        fitting = []
        for plan in plan_space(args, training, cluster, offload=offload):
            count += 1
            ev = evaluate(args, training, plan, cluster)
            if ev.fits:
                fitting.append(ev)
        if fitting:
            return min(fitting, key=lambda e: (e.time.step_time_s, e.memory["total"])), count
    return None, count


TARGET_CPU_S = 5.0
"""CPU seconds the largest job's search may take."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first two jobs only")
    jobs = JOBS[:2] if parser.parse_args().quick else JOBS
    print(f"{'job':<40}{'searched':>10}{'CPU s':>8}{'every plan':>12}{'CPU s':>8}{'ratio':>8}  same best")
    failed = []
    for model, gpus, gpu, seq_len, batch in jobs:
        args, training = preset(model), Training(seq_len=seq_len, global_batch=batch)
        cluster = Cluster(accelerator(gpu), gpus)
        start = time.process_time()
        # (every block checkpointed or none, as plan_space walks: the search's checkpointing of one block in k,
        # tried only where a faster policy did not fit, is not in the exhaustive space)
        result = search(args, training, cluster, {"activation_checkpoint_every": 1}, top_k=1)
        search_s = time.process_time() - start
        start = time.process_time()
        best, count = exhaustive(args, training, cluster)
        every_s = time.process_time() - start
        found = result.ranked[0].time.step_time_s if result.ranked else None
        same = (best is None) == (found is None) and (best is None or abs(found - best.time.step_time_s)
                                                      <= 1e-12 * best.time.step_time_s)
        job = f"{model} x {gpus} {gpu} s{seq_len} b{batch}"
        print(f"{job:<40}{result.evaluated:>10}{search_s:>8.2f}{count:>12}{every_s:>8.2f}"
              f"{every_s / search_s:>8.1f}  {'yes' if same else 'NO'}", flush=True)
        if not same:
            failed.append(f"{job}: the search's best differs from the exhaustive best")
        if gpus == max(j[1] for j in JOBS) and search_s > TARGET_CPU_S:
            failed.append(f"{job}: {search_s:.2f} CPU s > the {TARGET_CPU_S} s target")
    for line in failed:
        print("FAILED", line)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
