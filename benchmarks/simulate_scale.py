"""How long simulating one rank of a very large job takes here, and how much memory it needs.

Each job runs in a fresh process (so its peak RSS is the simulation's alone): Llama 3 70B on 1,024 ranks and
Llama 3 405B on 16,384 ranks (ZeRO-3, seq 8192, bf16), as tp 8 x FSDP and as pipelines (tp 8 x pp x FSDP, 1f1b,
pp micro-batches; three stages simulated: the first, a middle and the last), and a DeepSeek-V3-like mixture of
experts on 2,048 ranks (pp 16 x ep 64 within FSDP over 128, full recompute, seq 4096). CPU seconds are what the
simulation costs (one thread); wall seconds also count whatever else the machine runs. Target: under 60 s
and 8 GiB each. The peak printed is the highest of the simulated ranks.

    python benchmarks/simulate_scale.py
"""

from __future__ import annotations

from shardwise.simulate import measured_run

JOBS = [
    ("llama3-70b", 1024, "tp=8,dp=128,zero_stage=3", 8192),
    ("llama3-70b", 1024, "tp=8,pp=4,dp=32,zero_stage=3", 8192),
    ("llama3-405b", 16384, "tp=8,dp=2048,zero_stage=3", 8192),
    ("llama3-405b", 16384, "tp=8,pp=16,dp=128,zero_stage=3", 8192),
    ("deepseek-v3-like", 2048, "pp=16,dp_shard=128,ep=64,zero_stage=2,activation_checkpoint=full", 4096),
]


def main() -> None:
    print(f"{'job':<50}{'CPU s':>8}{'wall s':>8}{'RSS GiB':>9}{'simulated peak GiB':>20}")
    for model, world, plan, seq_len in JOBS:
        out = measured_run(model, world, plan, seq_len)
        peak = max(r["peak_bytes"] for r in out["ranks"]) / 2**30
        print(f"{model + ' x ' + str(world) + ' (' + plan + ')':<50}{out['cpu_s']:>8.1f}{out['wall_s']:>8.1f}"
              f"{out['max_rss_gib']:>9.2f}{peak:>20.1f}", flush=True)


if __name__ == "__main__":
    main()
