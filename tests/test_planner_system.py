"""The planner's system descriptions (shardwise.planner.system): what each changes, checked against the bytes a
model really saves, hand counts, and published measurements of the system that ran them."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from shardwise.hardware import GiB
from shardwise.model import build_model, materialize
from shardwise.model_args import preset
from shardwise.planner import Cluster, Plan, PlannerError, Training, accelerator, evaluate
from shardwise.planner.cli import add_plan_arguments, run_plan
from shardwise.planner.memory import (
    block_terms,
    embedding_activation_bytes,
    gathered_weight_bytes,
    head_activation_bytes,
    layer_activation_bytes,
    term_bytes,
    weight_copy_bytes,
)
from shardwise.planner.system import SYSTEMS, resolve_system
from shardwise.planner.timing import recomputed_matmul_share

from probes import engine_loss, measure_saved


def _training(system: str, **kw) -> Training:
    return Training(**{"seq_len": 4096, "global_batch": 8, **kw, **SYSTEMS[system].training_fields()})


def test_shardwise_system_is_the_default_recipe():
    # every Training built without a system (tests, benchmarks, the simulator's checks) describes shardwise
    ours, default = _training("shardwise"), Training(seq_len=4096, global_batch=8)
    assert ours.fuses_head and default.fuses_head
    assert dataclasses.replace(ours, fuse_head=None) == default


def test_torchtitan_keeps_bf16_everywhere_and_gathers_bf16_weights():
    titan, ours = _training("torchtitan"), _training("shardwise")
    assert (titan.stream_bytes, titan.act_bytes, gathered_weight_bytes(titan)) == (2, 2, 2.0)
    assert (ours.stream_bytes, ours.act_bytes, gathered_weight_bytes(ours)) == (4, 2, 4.0)
    args = preset("llama3-8b")
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=1)
    assert weight_copy_bytes(args, titan, plan, 0) == 0.0  # FSDP2 hands the matmuls bf16 weights: no autocast copies
    assert weight_copy_bytes(args, ours, plan, 0) > 0.0


def test_torchtitan_selective_policy_keeps_every_second_matmul_by_hand():
    # kept per token: block input (d), wq (d), wv (kv), attention output (d) and its fp32 log-sum-exp (one per
    # head), w1 (f), w2 (d); in bf16
    args = preset("llama3-8b")
    d, kv, f, a = args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden, args.n_heads
    training = _training("torchtitan")
    plan = Plan(activation_checkpoint="selective")
    per_token = sum(term_bytes(t, args, training, plan) for t in block_terms(args, training, "selective", 3))
    assert per_token == 2 * (4 * d + kv + f) + 4 * a


def test_alternate_matmul_policy_matches_saved_tensors():
    # torchtitan's rule applied to our block with torch's selective checkpointing: what it really keeps
    args, b, s = preset("debug", dim=128, n_layers=3, n_heads=8, n_kv_heads=2, ffn_hidden=352, vocab_size=320), 2, 96
    model = build_model(args)
    materialize(model, args, "cpu", 0)
    tokens = torch.randint(0, args.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    measured = measure_saved(model, lambda: engine_loss(model, tokens, tokens + 0), "selective", alternate=True)
    training = Training(seq_len=s, global_batch=b, precision="fp32", fused_rmsnorm=False,
                        selective="alternate-matmuls")
    plan = Plan(micro_batch=b, activation_checkpoint="selective")
    predicted = (args.n_layers * layer_activation_bytes(args, training, plan)
                 + head_activation_bytes(args, training, plan) + embedding_activation_bytes(training, plan))
    assert predicted == pytest.approx(measured, rel=0.10)


def test_recomputed_matmul_share_by_hand():
    args = preset("llama3-8b")  # d 4096, kv 1024, f 14336
    d, kv, f = 4096, 1024, 14336
    assert recomputed_matmul_share(args, 1) == pytest.approx((d * kv + d * d + d * f) / (2 * d * d + 2 * d * kv
                                                                                         + 3 * d * f))


@pytest.mark.parametrize("gpus, published_gib", [(8, 82.4), (128, 67.0)])
def test_torchtitan_llama3_8b_fsdp_memory_against_its_published_benchmark(gpus, published_gib):
    # torchtitan benchmarks/llama3_h100_202412_torchtitan.md, tables 1 and 3, FSDP row: Llama 3.1 8B, local batch
    # 2, sequence 8192, selective (op) checkpointing, eager; peak reserved memory 82.4 GiB on 8 GPUs, 67.0 on 128
    args = preset("llama3-8b")
    training = _training("torchtitan", seq_len=8192, global_batch=2 * gpus)
    plan = Plan(dp_shard=gpus, zero_stage=3, micro_batch=2, activation_checkpoint="selective")
    ev = evaluate(args, training, plan, Cluster(accelerator("h100"), gpus))
    assert ev.memory["total"] / GiB == pytest.approx(published_gib, rel=0.10)
    # described as shardwise's engine (fp32 stream, every matmul kept) the same run is sized differently
    ours = evaluate(args, _training("shardwise", seq_len=8192, global_batch=2 * gpus), plan,
                    Cluster(accelerator("h100"), gpus))
    assert ours.memory["activations"] > 1.3 * ev.memory["activations"]


def _ns(*argv):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


def test_plan_output_names_the_system(capsys):
    argv = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16", "--top-k", "1"]
    assert run_plan(_ns(*argv, "--system", "torchtitan")) == 0
    assert "system: torchtitan - FSDP2 MixedPrecisionPolicy" in capsys.readouterr().out
    assert run_plan(_ns(*argv)) == 0
    assert "system: shardwise - fp32 weights" in capsys.readouterr().out
    assert run_plan(_ns(*argv, "--system", "torchtitan", "--layout", "zero")) == 0
    assert "system: torchtitan (layout zero) - layout zero, head materialised" in capsys.readouterr().out


def test_another_system_is_not_written_as_a_shardwise_config(tmp_path, capsys):
    argv = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "16", "--top-k", "1",
            "--system", "torchtitan", "--write-config", str(tmp_path / "job.toml")]
    assert run_plan(_ns(*argv)) == 2
    err = capsys.readouterr().err
    assert "--system" in err and "plan with --system shardwise" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "job.toml").exists()


def test_system_toml(tmp_path):
    path = tmp_path / "titan-full-sac.toml"
    path.write_text('base = "torchtitan"\nselective = "matmuls"\n')
    system = resolve_system(str(path))
    assert (system.name, system.layout, system.selective, system.fuse_head) == ("titan-full-sac", "fsdp-mp",
                                                                                 "matmuls", False)


@pytest.mark.parametrize("text, field", [('selective = "some"\n', "--system selective"),
                                         ('colour = "blue"\n', "--system"),
                                         ('dropout = "yes"\n', "dropout"),
                                         ('base = "jax"\n', "base")])
def test_bad_system_toml_names_the_field(tmp_path, text, field):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(PlannerError) as e:
        resolve_system(str(path))
    assert field in str(e.value) and "\n" not in str(e.value)


def test_unknown_system_is_refused(capsys):
    assert run_plan(_ns("--model", "llama3-8b", "--gpus", "8", "--system", "jax")) == 2
    assert "--system" in capsys.readouterr().err
