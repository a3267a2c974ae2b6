"""The parallel engine: every layout trains like one device; bad layouts stop before any process starts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

CONFIG = str(Path(__file__).parent / "configs" / "parity.toml")


def _shardwise(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True, text=True,
                          timeout=timeout)


INVALID = [
    # (overrides, nproc, field named in the message)
    (["parallel.tp=3"], 3, "parallel.tp"),  # heads 8 not divisible by 3
    (["model.n_kv_heads=2", "parallel.tp=4"], 4, "parallel.tp"),  # KV heads vs tp
    (["parallel.pp=4", "parallel.pp_schedule='interleaved-1f1b'", "parallel.virtual_stages=4"], 4,
     "model.n_layers"),  # 8 layers < 16 stages
    (["parallel.pp=2", "parallel.pp_microbatches=3"], 2, "train.micro_batch"),  # 8 not divisible by 3
    (["parallel.cp=4", "data.seq_len=60"], 4, "data.seq_len"),  # 60 not divisible by 2 x 4
    (["parallel.tp=4", "parallel.sequence_parallel=true", "parallel.cp=2", "data.seq_len=36"], 8,
     "data.seq_len"),  # 36 / cp 2 = 18 tokens not divisible by tp 4
    (["parallel.tp=2"], 4, "parallel"),  # the world has 4 ranks, the degrees 2
    (["parallel.dp_shard=2", "parallel.zero_stage=1"], 2, "parallel.dp_shard"),  # sharding needs ZeRO-2/3
    (["parallel.sequence_parallel=true"], 1, "parallel.sequence_parallel"),  # no tp
    (["parallel.pp=2", "parallel.pp_schedule='interleaved-1f1b'"], 2, "parallel.virtual_stages"),
]


@pytest.mark.parametrize("overrides, nproc, field", INVALID, ids=[i[2] + f"-{n}" for n, i in enumerate(INVALID)])
def test_invalid_layout_rejected_before_any_process(tmp_path, capsys, monkeypatch, overrides, nproc, field):
    """`shardwise train --nproc N` with a bad layout: exit 2 and one line naming the field, before torchrun is
    started or anything is written (the command runs in this process; starting a launcher fails the test)."""
    import shardwise.distributed
    from shardwise.cli import main

    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started for an invalid layout")

    monkeypatch.setattr(shardwise.distributed, "launch_local", no_launch)
    code = main(["train", "--config", CONFIG, *[f"--set={o}" for o in overrides],
                 f"--set=metrics.out_dir='{tmp_path / 'run'}'", "--nproc", str(nproc)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"shardwise: error: {field}"), lines
    assert not (tmp_path / "run").exists()


# Each group runs in one `shardwise verify` call: the single-device reference is computed once per global
# batch and every layout of the group is compared with it (losses at every step, parameters at the end).
PARITY = {
    "zero-dp2": ["dp=2", "dp=2,zero_stage=1", "dp_shard=2,zero_stage=2", "dp_shard=2,zero_stage=3"],
    "zero-dp4": ["dp=4", "dp=4,zero_stage=1", "dp_shard=4,zero_stage=2", "dp_shard=4,zero_stage=3",
                 "dp_replicate=2,dp_shard=2"],
    "tp": ["tp=2", "tp=2,sequence_parallel=true", "tp=4", "tp=4,sequence_parallel=true"],
    "cp": ["cp=2", "cp=4"],
    "multi-axis": ["dp_shard=2,tp=2", "dp=2,tp=2,zero_stage=1", "dp_shard=2,cp=2,tp=2,sequence_parallel=true",
                   "dp_shard=2,tp=2,grad_accum=2", "dp_shard=2,tp=2,activation_checkpoint=selective",
                   "dp_shard=2,cp=2,activation_checkpoint=full"],
}


# AdamW at a realistic learning rate, with clipping: the sharded optimizer states of ZeRO-1/2/3 under TP
ADAMW = ["--set=optim.name='adamw'", "--set=optim.lr=3e-4", "--set=optim.grad_clip=1.0"]
PARITY["adamw"] = ["dp=2,zero_stage=1", "dp_shard=2,tp=2,zero_stage=2"]


@pytest.mark.parametrize("group", sorted(PARITY))
def test_layouts_match_single_device(group):
    args = ["verify", "--config", CONFIG, "--steps", "3", "--json", *(ADAMW if group == "adamw" else [])]
    for layout in PARITY[group]:
        args += ["--layout", layout]
    proc = _shardwise(*args)
    assert proc.stdout, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    for row in report["layouts"]:
        assert max(row["loss_rel"], row["grad_norm_rel"], row["param_rel"]) <= 1e-5, row
    assert proc.returncode == 0
