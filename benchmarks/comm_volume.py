"""Measured communication per rank per step against the ring-collective formulas of DDP, ZeRO, TP and PP.

Each layout runs one real training step on N local gloo processes with every collective counted
(shardwise.parallel.comm.CommCounter: payload bytes of each call, turned into the bytes one rank sends with
ring algorithms). Theory, with Psi parameters of 4 bytes (fp32 gradients and weights on CPU):

- DDP (ZeRO-0): gradient all-reduce 2 Psi (N-1)/N            (ring all-reduce, Sergeev & Balso 2018)
- ZeRO-3: all-gather in forward and backward + reduce-scatter: 3 Psi (N-1)/N
- TP: per layer 4 all-reduces of b x s x d (2 forward, 2 backward): 8 bsd (N-1)/N; with sequence
  parallelism 4 all-gathers + 4 reduce-scatters of bsd, the same bytes
- PP: per micro-batch a stage sends one activation b_mb x s x d forward and one gradient backward

    python benchmarks/comm_volume.py [--world 2 4]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shardwise.config import load_config
from shardwise.distributed import run_distributed
from shardwise.model_args import num_params
from shardwise.train import counted_step

CONFIG = str(Path(__file__).resolve().parents[1] / "tests" / "configs" / "parity.toml")


def _measure(overrides: list[str]) -> dict:
    stats, model, _, _ = counted_step(load_config(CONFIG, overrides))
    parts = model.stages if hasattr(model, "stages") else [model]
    root = sum(p.numel() for part in parts for name, p in part.named_parameters() if not name.startswith("layers."))
    return {"wire": dict(stats.wire), "root": root}


def _row(name: str, measured: float, theory: float, note: str = "") -> None:
    print(f"{name:<34}{measured / 2**20:>12.3f}{theory / 2**20:>12.3f}{measured / theory:>8.3f}  {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    cfg = load_config(CONFIG)
    psi, fp32 = num_params(cfg.model), 4
    b, s, d = cfg.train.micro_batch, cfg.data.seq_len, cfg.model.dim
    print(f"model: {psi:,} parameters, {cfg.model.n_layers} layers, micro-batch {b} x {s} tokens, d={d}")
    print(f"{'layout':<34}{'MiB/rank':>12}{'theory':>12}{'ratio':>8}")
    for n in args.world:
        ring = (n - 1) / n
        ddp = run_distributed(_measure, n, [f"parallel.dp_replicate={n}"])[0]
        _row(f"DDP all-reduce, N={n}", ddp["wire"]["all_reduce"], 2 * psi * fp32 * ring,
             "includes the 4-byte loss all-reduce")
        z3 = run_distributed(_measure, n, [f"parallel.dp_shard={n}", "parallel.zero_stage=3"])[0]
        measured = z3["wire"]["all_gather"] + z3["wire"]["reduce_scatter"]
        _row(f"ZeRO-3 AG + RS, N={n}", measured, 3 * psi * fp32 * ring,
             f"root ({z3['root']:,} params) is not re-gathered in backward")
        for sp in (False, True):
            per_layer = {}
            for layers in (2, 4):
                run = run_distributed(_measure, n, [f"parallel.tp={n}", f"model.n_layers={layers}",
                                                    f"parallel.sequence_parallel={str(sp).lower()}"])[0]
                per_layer[layers] = sum(run["wire"].values())
            _row(f"TP{'+SP' if sp else ''} per layer, N={n}", (per_layer[4] - per_layer[2]) / 2,
                 8 * b * s * d * fp32 * ring)
        m = n  # pipeline micro-batches per step
        pp = run_distributed(_measure, n, [f"parallel.pp={n}", "parallel.pp_schedule='1f1b'"])
        for stage in (0, n - 1):  # the first stage sends activations, the last sends gradients back
            _row(f"PP p2p per micro-batch, stage {stage}/{n}", pp[stage]["wire"]["point_to_point"] / m,
                 b // m * s * d * fp32)


if __name__ == "__main__":
    main()
