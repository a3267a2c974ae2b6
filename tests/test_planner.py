"""The planner against references computed another way: the ZeRO paper's tables, the ring all-reduce and bubble
formulas, the bytes our real model saves for backward (saved-tensor hooks), Hugging Face's parameter count,
closed-form schedules, the engine's counted collectives, the simulator, and published training runs."""

import argparse
import dataclasses
import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch
from torch import nn

from shardwise.config import LORA_TARGETS, ConfigError, fit_world, load_config
from shardwise.hardware import GiB
from shardwise.layout import parse_layout
from shardwise.model import build_model, materialize
from shardwise.model_args import ModelArgs, num_params, preset
from shardwise.planner import (
    Cluster,
    Plan,
    PlannerError,
    Training,
    accelerator,
    evaluate,
    from_hf_config,
    model_state_bytes,
    plan_space,
    search,
    stage_memory,
    state_bytes_per_param,
)
from shardwise.planner.cli import add_plan_arguments, run_plan
from shardwise.planner.comm import Link, all_reduce, ring_all_reduce
from shardwise.planner.explain import knob_reasons
from shardwise.planner.memory import (
    bf16_optimizer_segments,
    embedding_activation_bytes,
    head_activation_bytes,
    layer_activation_bytes,
    nanotron_split,
    reserved_bytes,
    stage_shape,
    weight_copy_bytes,
)
from shardwise.planner.timing import bubble_fraction

from probes import MatmulFlops, block_op_calls, engine_loss, measure_saved

GB = 1e9

# ---------------------------------------------------------------------------------------------------
# Model state: the ZeRO paper's formulas and tables


def test_mixed_precision_adam_is_16_bytes_per_param_with_12_in_the_optimizer():
    # ZeRO (Rajbhandari et al. 2020): mixed-precision Adam is 16 bytes per parameter, 12 of them in the optimizer
    b = state_bytes_per_param(Training(precision="bf16", optimizer="adamw", layout="zero"))
    assert b.params + b.grads + b.master + b.optimizer == 16
    assert b.master + b.optimizer == 12
    # the torch layout (fp32 weights that are their own master, fp32 grads, two fp32 moments) is also 16
    b = state_bytes_per_param(Training(precision="bf16", optimizer="adamw", layout="torch"))
    assert b.params + b.grads + b.master + b.optimizer == 16


@pytest.mark.parametrize("stage, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_table(stage, expected_gb):
    # the ZeRO paper's example (Rajbhandari et al. 2020): Psi = 7.5B, N_d = 64, K = 12
    items = model_state_bytes(7.5e9, Training(layout="zero"), zero_stage=stage, shard=64)
    assert round(sum(items.values()) / GB, 1) == expected_gb


@pytest.mark.parametrize("stage, expected_gb", [(0, 112.0), (1, 38.5), (2, 26.25), (3, 14.0)])
def test_7b_on_8_gpus(stage, expected_gb):
    # ZeRO's stages with fp16 weights and gradients: 4P + 12P/N, 2P + 14P/N, 16P/N for P = 7B, N = 8
    items = model_state_bytes(7e9, Training(layout="zero"), zero_stage=stage, shard=8)
    assert sum(items.values()) / GB == pytest.approx(expected_gb, rel=1e-12)


@pytest.mark.parametrize("layout", ["zero", "megatron"])
def test_zero2_outside_fsdp_holds_whole_weights_once(layout):
    # DeepSpeed's ZeRO-2 (and Megatron's, whose distributed optimizer shards no weights) keeps the whole 16-bit
    # weights on every rank and gathers nothing: the peak holds them once (they used to be counted again as a
    # gathered FSDP copy); FSDP's ZeRO-2 (layouts torch, fsdp-mp) shards them and gathers a copy
    args = preset("llama2-7b")
    psi = num_params(args)
    plan = Plan(dp_shard=8, zero_stage=2, micro_batch=1, grad_accum=1, activation_checkpoint="full")
    cluster = Cluster(accelerator("a100-80gb"), 8)
    mem = evaluate(args, Training(seq_len=2048, global_batch=8, layout=layout), plan, cluster).memory
    assert mem["params"] == pytest.approx(2 * psi)
    assert mem["fsdp_buffers"] < 0.1 * 2 * psi
    fsdp = evaluate(args, Training(seq_len=2048, global_batch=8, layout="fsdp-mp"), plan, cluster).memory
    assert fsdp["params"] == pytest.approx(4 * psi / 8) and fsdp["fsdp_buffers"] > 2 * psi


def test_optimizers_and_offload_change_the_state_bill():
    # torch.optim's state: SGD keeps none, momentum one tensor (momentum_buffer), Adam two (exp_avg, exp_avg_sq)
    per = {o: state_bytes_per_param(Training(optimizer=o, precision="fp32")).optimizer
           for o in ("sgd", "momentum", "adamw")}
    assert per == {"sgd": 0, "momentum": 4, "adamw": 8}
    # torchao's low-bit moments: codes plus an fp32 scale per block (256 for 8-bit, 128 for 4-bit), two moments
    assert state_bytes_per_param(Training(optimizer="adamw8bit")).optimizer == 2 * (1 + 4 / 256)
    assert state_bytes_per_param(Training(optimizer="adamw4bit")).optimizer == 2 * (0.5 + 4 / 128)
    off = model_state_bytes(1e9, Training(), 0, 1, offload="optimizer")
    assert off["optimizer_state"] == off["master_weights"] == 0 and off["params"] > 0
    assert sum(model_state_bytes(1e9, Training(), 0, 1, offload="full").values()) == 0


def test_lora_and_qlora_keep_state_only_for_adapters():
    args = preset("llama2-7b")
    full = stage_memory(args, Training(seq_len=512, global_batch=1), Plan(activation_checkpoint="full"), 0)
    lora = stage_memory(args, Training(seq_len=512, global_batch=1, lora_rank=8), Plan(activation_checkpoint="full"), 0)
    qlora = stage_memory(args, Training(seq_len=512, global_batch=1, lora_rank=8, qlora=True),
                         Plan(activation_checkpoint="full"), 0)
    n = num_params(args)
    d, kv, f = args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden
    linears = args.n_layers * (2 * d * d + 2 * d * kv + 3 * d * f)
    adapters = args.n_layers * 8 * (2 * (d + d) + 2 * (d + kv) + 3 * (d + f))
    head = args.vocab_size * d
    rest = n - linears - head  # embedding and norms
    # frozen projections and head in bf16 (the compute dtype), embedding and norms fp32 as stored, fp32 adapters
    assert lora["params"] == pytest.approx(2 * (linears + head) + 4 * rest + 4 * adapters, rel=1e-9)
    # QLoRA: the blocks' linears in NF4 with double-quantised constants (4.127 bits)
    assert qlora["params"] == pytest.approx(linears * 4.127 / 8 + 2 * head + 4 * rest + 4 * adapters, rel=1e-3)
    assert lora["optimizer_state"] < full["optimizer_state"] / 100


@pytest.mark.parametrize("name", ["llama3.2-1b", "llama3-8b"])
def test_lora_prices_no_gradient_for_the_frozen_head(name):
    """LoRA freezes the head: a backward makes gradients of the adapters only. With the state offloaded (one GPU,
    where the adapters' gradients are on the host) the planner's peak held an fp32 vocabulary x dim gradient
    (0.98 GiB for Llama 3.2 1B, 1.96 for Llama 3 8B, 3.91 for 70B)."""
    args = preset(name)
    adapters = args.n_layers * 16 * (2 * (2 * args.dim) + 2 * (args.dim + args.n_kv_heads * args.head_dim)
                                     + 3 * (args.dim + args.ffn_hidden))
    plan = Plan(zero_stage=2, offload="full", micro_batch=1, grad_accum=4, activation_checkpoint="full")
    mem = stage_memory(args, Training(seq_len=2048, global_batch=4, lora_rank=16), plan, 0)
    assert mem["grads"] <= 4 * adapters, mem["grads"] / GiB


def test_hugging_face_config_maps_to_the_same_parameter_count(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)
    path = tmp_path / "config.json"
    cfg.to_json_file(path)
    from shardwise.planner import resolve_model

    args = resolve_model(str(path))
    with torch.device("meta"):
        hf_model = transformers.LlamaForCausalLM(cfg)
    assert num_params(args) == sum(p.numel() for p in hf_model.parameters())
    assert from_hf_config(json.loads(path.read_text())).n_kv_heads == 2
    # the folder, as from_pretrained and checkpoint.init_from_hf take it, was refused as "neither a preset nor a
    # config file"
    assert resolve_model(str(tmp_path)) == args


def test_a_plan_of_a_hugging_face_folder_writes_a_config_that_fine_tunes_it(tmp_path):
    """Planned from a folder with weights, the written config starts from them (checkpoint.init_from_hf) and reads
    text with the folder's tokenizer; it wrote neither, and `train` trained a random init of that shape."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from shardwise.config import load_config
    from shardwise.planner.cli import main as plan_main

    folder = tmp_path / "base"
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=320, max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train_from_iterator([Path(json.__file__).read_text()], vocab_size=300, show_progress=False)
    tok.save(str(folder / "tokenizer.json"))
    out = tmp_path / "plan.toml"
    assert plan_main(["--model", str(folder), "--gpus", "1", "--seq-len", "128", "--global-batch", "4",
                      "--lora-rank", "8", "--write-config", str(out)]) == 0
    job = load_config(out)
    assert job.checkpoint.init_from_hf == str(folder.resolve())
    assert job.data.tokenizer == str(folder.resolve() / "tokenizer.json")
    assert job.lora.rank == 8
    (folder / "model.safetensors").unlink()  # a config alone (no weights): a shape to plan, nothing to start from
    assert plan_main(["--model", str(folder / "config.json"), "--gpus", "1", "--seq-len", "128", "--global-batch",
                      "4", "--write-config", str(out)]) == 0
    assert load_config(out).checkpoint.init_from_hf == ""


# ---------------------------------------------------------------------------------------------------
# Activations: predicted vs the bytes our model really saves for backward



def _small():
    # dims unlike each other so a term with the wrong size cannot hide: d=128, d_kv=32, f=352, 8 heads
    return preset("debug", dim=128, n_layers=3, n_heads=8, n_kv_heads=2, ffn_hidden=352, vocab_size=320)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activation_memory_matches_saved_tensors(mode):
    args, b, s = _small(), 2, 96
    model = build_model(args)
    materialize(model, args, "cpu", 0)
    tokens = torch.randint(0, args.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, args.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))

    def run():
        engine_loss(model, tokens, targets)

    measured = measure_saved(model, run, mode)
    # the engine's RMSNorm saves (input, rstd), on a CPU as torch's fused kernel does on a GPU
    training = Training(seq_len=s, global_batch=b, precision="fp32")
    plan = Plan(micro_batch=b, activation_checkpoint=mode)
    predicted = (args.n_layers * layer_activation_bytes(args, training, plan)
                 + head_activation_bytes(args, training, plan) + embedding_activation_bytes(args, training, plan))
    assert predicted == pytest.approx(measured, rel=0.10)


def test_selective_checkpointing_keeps_loras_matmul_outputs():
    """The engine's selective policy keeps every matmul's output, LoRA's two on each adapted linear too: x A^T (rank
    wide) and its product with B^T (as wide as the base's output). The planner left them out: Mistral 7B QLoRA at
    micro-batch 4 x 4,096 tokens was 62 GiB to it and 103 GiB to the simulator. By hand, per token and block:
    7 r + (3 d + 2 d_kv + 2 f) elements, and what the blocks save on the engine's model says the same."""
    from shardwise.config import LoraConfig
    from shardwise.lora import apply_lora

    args, b, s, r = _small(), 2, 48, 6
    d, kv, f = args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden
    by_hand = args.n_layers * b * s * 4 * (7 * r + 3 * d + 2 * kv + 2 * f)
    h = torch.randn(b, s, args.dim, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def saved(rank):
        model = build_model(args)
        apply_lora(model, LoraConfig(rank=rank))
        materialize(model, args, "cpu", 0)

        def run():
            x = h
            for layer in model.layers.values():
                x = layer(x, model.rope[:, :s])
        return measure_saved(model, run, "selective", exclude=[h])

    assert saved(r) - saved(0) == pytest.approx(by_hand, rel=0.01)
    plan = Plan(micro_batch=b, activation_checkpoint="selective")
    full, lora = (Training(seq_len=s, global_batch=b, precision="fp32", lora_rank=rank) for rank in (0, r))
    extra = args.n_layers * (layer_activation_bytes(args, lora, plan) - layer_activation_bytes(args, full, plan))
    assert extra == pytest.approx(by_hand)


def test_activation_memory_under_autocast_matches_saved_tensors():
    # 'torch' layout: fp32 weights and residual stream, bf16 matmuls; autocast saves one bf16 copy of each
    # matmul weight (compute_copies) and one bf16 copy of a norm output per consuming linear
    args, b, s = _small(), 2, 64
    model = build_model(args)
    materialize(model, args, "cpu", 0)
    tokens = torch.randint(0, args.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine_loss(model, tokens, tokens + 0)

    measured = measure_saved(model, run, "none")
    training = Training(seq_len=s, global_batch=b, precision="bf16", layout="torch")
    plan = Plan(micro_batch=b)
    predicted = (args.n_layers * layer_activation_bytes(args, training, plan)
                 + head_activation_bytes(args, training, plan) + embedding_activation_bytes(args, training, plan)
                 + weight_copy_bytes(args, training, plan, 0))
    assert predicted == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_rank_activations(tp):
    """One tp rank runs the block with 1/tp of the heads and MLP columns (no sequence parallelism): build exactly
    that rank's linears on one device and measure what its blocks save."""
    args, b, s = preset("debug", dim=128, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=352), 2, 64
    model = build_model(args)
    kv = args.n_kv_heads * args.head_dim
    for layer in model.layers.values():
        att, ffn = layer.attention, layer.feed_forward
        att.wq, att.wk, att.wv = nn.Linear(128, 128 // tp, bias=False), nn.Linear(128, kv // tp, bias=False), \
            nn.Linear(128, kv // tp, bias=False)
        att.wo = nn.Linear(128 // tp, 128, bias=False)
        ffn.w1, ffn.w3 = nn.Linear(128, 352 // tp, bias=False), nn.Linear(128, 352 // tp, bias=False)
        ffn.w2 = nn.Linear(352 // tp, 128, bias=False)
    model.to_empty(device="cpu")
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    model.rope = torch.zeros(2, args.max_seq_len, args.head_dim)
    h = torch.randn(b, s, args.dim, requires_grad=True)

    def run():
        x = h
        for layer in model.layers.values():
            x = layer(x, model.rope[:, :s])
        x.sum()

    measured = measure_saved(model, run, "none")
    training = Training(seq_len=s, global_batch=b, precision="fp32")
    predicted = args.n_layers * layer_activation_bytes(args, training, Plan(tp=tp, micro_batch=b))
    assert predicted == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("layout, sharded_per_token", [
    # torch (fp32 stream at every ZeRO stage: no FSDP mixed-precision policy): SP shards the residual-stream
    # tensors x and h (2 d, fp32) and two fp32 rstd; the linears keep their all-gathered input. Megatron (bf16)
    # also keeps the two norm outputs sharded (4 d).
    ("torch", lambda d: 2 * d * 4 + 2 * 4),
    ("megatron", lambda d: 4 * d * 2 + 2 * 4),
])
def test_sequence_parallel_and_context_parallel_shrink_the_right_terms(layout, sharded_per_token):
    args, tokens, tp = preset("llama3-8b"), 4096, 4
    tr = Training(seq_len=tokens, global_batch=8, precision="bf16", layout=layout)
    base = layer_activation_bytes(args, tr, Plan(tp=tp, micro_batch=1, zero_stage=3, dp_shard=2))
    sp = layer_activation_bytes(args, tr, Plan(tp=tp, micro_batch=1, zero_stage=3, dp_shard=2,
                                               sequence_parallel=True))
    cp = layer_activation_bytes(args, tr, Plan(tp=tp, cp=2, micro_batch=1, zero_stage=3, dp_shard=2))
    assert base - sp == pytest.approx(tokens * sharded_per_token(args.dim) * (1 - 1 / tp))
    assert cp == pytest.approx(base / 2, rel=1e-3)  # every saved tensor is per token; cp halves the tokens


# ---------------------------------------------------------------------------------------------------
# Time: collectives and bubbles


def test_ring_all_reduce_matches_reference_formula():
    # ring all-reduce (Sergeev & Balso 2018), 2(N-1)X/(NB): N = 8, X = 2 GB, B = 25 GB/s -> 0.14 s; 12.5 -> 0.28 s
    assert ring_all_reduce(2e9, 8, Link(25e9, 0.0, "intra")) == pytest.approx(0.14)
    assert ring_all_reduce(2e9, 8, Link(12.5e9, 0.0, "intra")) == pytest.approx(0.28)
    for n in (2, 16, 1024):
        assert ring_all_reduce(1e8, n, Link(1e10, 0.0, "inter")) == pytest.approx(2 * (n - 1) * 1e8 / (n * 1e10))
    # small messages are latency-bound: the tree beats the ring's 2(N-1) latencies
    slow = Link(1e10, 1e-5, "inter")
    assert all_reduce(1e3, 1024, slow) < ring_all_reduce(1e3, 1024, slow)


def _makespan_gpipe(p: int, m: int, tf: float, tb: float) -> float:
    """Longest path through the GPipe dependency graph: F(s, i) after F(s-1, i) and F(s, i-1); all backwards
    after the stage's forwards, B(s, i) after B(s+1, i) and B(s, i-1)."""
    f = [[0.0] * m for _ in range(p)]
    for s in range(p):
        for i in range(m):
            f[s][i] = max(f[s - 1][i] if s else 0.0, f[s][i - 1] if i else 0.0) + tf
    bw = [[0.0] * m for _ in range(p)]
    for s in reversed(range(p)):
        for i in range(m):
            ready = max(bw[s + 1][i] if s < p - 1 else f[p - 1][m - 1], bw[s][i - 1] if i else f[s][m - 1])
            bw[s][i] = ready + tb
    return bw[0][m - 1]


@pytest.mark.parametrize("p, m", [(4, 4), (4, 16), (8, 3), (2, 32)])
def test_bubble_fraction_matches_reference_and_a_schedule_simulation(p, m):
    expected = (p - 1) / (m + p - 1)  # GPipe's bubble (Huang et al. 2019)
    for schedule in ("gpipe", "1f1b"):
        assert bubble_fraction(Plan(pp=p, grad_accum=m, pp_schedule=schedule)) == pytest.approx(expected)
    tf, tb = 1.0, 2.0
    makespan = _makespan_gpipe(p, m, tf, tb)
    assert 1 - m * (tf + tb) / makespan == pytest.approx(expected)


@pytest.mark.parametrize("p, m", [(4, 8), (8, 3), (6, 6)])
def test_1f1b_timeline_gives_the_bubble_and_the_micro_batches_in_flight(p, m):
    from shardwise.planner.memory import in_flight
    from shardwise.planner.timeline import makespan, simulate

    tf, tb = 1.0, 2.0
    ops = simulate("1f1b", p, m, tf, tb)
    assert makespan(ops) == pytest.approx((m + p - 1) * (tf + tb))
    assert bubble_fraction(Plan(pp=p, grad_accum=m, pp_schedule="1f1b")) == pytest.approx(
        1 - m * (tf + tb) / makespan(ops))
    for rank in range(p):
        # activations held = forwards started minus backwards finished, at its highest
        held, peak = 0, 0
        for op in sorted((o for o in ops if o.rank == rank), key=lambda o: o.start):
            held += 1 if op.kind == "F" else -1
            peak = max(peak, held)
        assert in_flight(Plan(pp=p, grad_accum=m, pp_schedule="1f1b"), rank) == peak
        gpipe = simulate("gpipe", p, m, tf, tb)
        held, peak = 0, 0
        for op in sorted((o for o in gpipe if o.rank == rank), key=lambda o: o.start):
            held += 1 if op.kind == "F" else -1
            peak = max(peak, held)
        assert in_flight(Plan(pp=p, grad_accum=m, pp_schedule="gpipe"), rank) == peak


@pytest.mark.parametrize("p, m", [(4, 8), (2, 16), (8, 8)])
def test_zero_bubble_v_holds_the_first_ranks_micro_batches_on_every_rank(p, m):
    """The engine's zero-bubble is the V schedule (ZBV), which balances activation memory: every rank holds what
    1F1B's first rank holds (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"), not 1F1B's P - i.
    (The engine's middle ranks hold more still: docs/planner.md, "Known gaps".)"""
    from shardwise.planner.memory import in_flight

    first = in_flight(Plan(pp=p, grad_accum=m, pp_schedule="1f1b"), 0)
    assert first == min(p, m)
    for rank in range(p):
        assert in_flight(Plan(pp=p, grad_accum=m, pp_schedule="zero-bubble"), rank) == first


def test_interleaving_divides_the_bubble_by_v_and_zero_bubble_shrinks_it():
    p, m = 4, 8
    one = bubble_fraction(Plan(pp=p, grad_accum=m, pp_schedule="1f1b"))
    for v in (2, 3):
        inter = bubble_fraction(Plan(pp=p, grad_accum=m, pp_schedule="interleaved-1f1b", virtual_stages=v))
        assert inter == pytest.approx((p - 1) / (v * m + p - 1))
        # bubble time (P-1) t / v: the ratio of bubble to work is 1/v of 1F1B's
        assert inter / (1 - inter) == pytest.approx(one / (1 - one) / v)
    assert bubble_fraction(Plan(pp=p, grad_accum=m, pp_schedule="zero-bubble")) < one / 2


def test_zero_bubble_prices_a_second_rebuild_in_the_weight_pass():
    """Under full recompute the engine rebuilds each block in the input pass and again in the weight pass (three
    forwards per block and micro-batch: test_pipeline's count), except the first stage's blocks, whose backward
    is one pass; 1F1B rebuilds once. The weight pass's time grows by the rebuilt blocks' forward."""
    from shardwise.hardware import Cluster, accelerator
    from shardwise.planner.memory import zero_bubble_chunks
    from shardwise.planner.timing import _stage_cost

    args = preset("llama3-8b")
    training = Training(seq_len=4096, global_batch=64, precision="bf16")
    cluster = Cluster(accelerator("h100"), 32)
    zb = Plan(pp=4, dp_shard=8, zero_stage=2, grad_accum=8, pp_schedule="zero-bubble", activation_checkpoint="full")
    for rank in (0, 1):
        cost = _stage_cost(args, training, zb, cluster, rank)
        plain = _stage_cost(args, training, dataclasses.replace(zb, activation_checkpoint="none"), cluster, rank)
        first, last = zero_bubble_chunks(args, zb, rank, 4096)
        twice = len(last) / (len(first) + len(last)) if rank == 0 else 1.0
        assert cost.backward_weight - plain.backward_weight == pytest.approx(twice * cost.recompute)
        assert cost.recompute > 0


def test_zero_bubble_weight_pass_replays_its_collectives_in_its_own_slot():
    """Under tp the weight pass's rebuild replays the forward's collectives too (_tp_comm's full-recompute replay,
    once more on every rank but the first stage's share); ZB-H1's bubble, (P-1)(F + B - W) (Qi et al. 2024),
    counts them in W's slot, where the pass runs them, not in F's and B's."""
    from shardwise.hardware import Cluster, accelerator
    from shardwise.planner.memory import stage_shape
    from shardwise.planner.timing import _stage_cost, _tp_comm, pipeline_time

    args = preset("llama3-8b")
    training = Training(seq_len=4096, global_batch=64, precision="bf16")
    cluster = Cluster(accelerator("h100"), 64)
    zb = Plan(pp=4, tp=2, dp_shard=8, zero_stage=2, grad_accum=8, pp_schedule="zero-bubble",
              activation_checkpoint="full", sequence_parallel=True)
    cost = _stage_cost(args, training, zb, cluster, 1)  # a middle stage: its blocks rebuilt twice
    layers = stage_shape(args, zb, 1, 4096).layers
    replay = (_tp_comm(args, training, zb, cluster, layers, False, False)
              - _tp_comm(args, training, dataclasses.replace(zb, activation_checkpoint="none"), cluster, layers,
                         False, False))
    assert replay > 0 and cost.tp_comm_weight == pytest.approx(replay)
    f = cost.forward + (cost.tp_comm - cost.tp_comm_weight + cost.pp_p2p + cost.cp_exposed + cost.ep_comm) / 2
    b = cost.backward_input + cost.recompute + (cost.tp_comm - cost.tp_comm_weight + cost.pp_p2p
                                                 + cost.cp_exposed + cost.ep_comm) / 2
    w = cost.backward_weight + cost.tp_comm_weight
    assert pipeline_time(cost, zb) == pytest.approx(8 * cost.total + 3 * max(0.0, f + b - w))
    assert pipeline_time(cost, zb) < pipeline_time(dataclasses.replace(cost, tp_comm_weight=0.0), zb)


# ---------------------------------------------------------------------------------------------------
# Plans, search, CLI


def test_matmul_time_counts_the_flops_our_model_runs():
    """With attention and elementwise work made free, compute time x peak must be the matmul FLOPs of a real
    forward + backward, as torch's FlopCounterMode counts them."""
    from shardwise.planner import Accelerator, step_time

    args, b, s = _small(), 2, 96
    model = build_model(args)
    materialize(model, args, "cpu", 0)
    tokens = torch.randint(0, args.vocab_size, (b, s))
    with MatmulFlops() as counter:
        engine_loss(model, tokens, tokens).backward()
    measured = counter.flops
    ideal = Accelerator("ideal", 1e12, {"fp32": 1e12}, mem_bandwidth=math.inf, intra_node_bw=1e9, inter_node_bw=1e9,
                        host_bw=1e9, matmul_efficiency=1.0, attention_efficiency=math.inf)
    t = step_time(args, Training(seq_len=s, global_batch=b, precision="fp32"), Plan(micro_batch=b),
                  Cluster(ideal, 1))
    assert t.compute_s * 1e12 == pytest.approx(measured, rel=1e-9)


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("targets", [("wq", "wk", "wv", "wo", "w1", "w3", "w2"), ("wq", "wv", "w2"), ("w2",),
                                     ("wo", "w3")])
def test_lora_matmul_time_counts_the_flops_our_lora_model_runs(targets, recompute):
    """The same under LoRA: the frozen linears' forward and input-gradient matmuls, and each adapter's six (x A and
    (x A) B forward; the gradients through B and A, and B's and A's own), as the engine's LoRALinear runs them; in
    the first block no input gradient before its first adapter (the embedding is frozen)."""
    from shardwise.config import LoraConfig
    from shardwise.lora import apply_lora
    from shardwise.planner import Accelerator, step_time

    args, b, s, rank = _small(), 2, 96, 8
    model = build_model(args)
    apply_lora(model, LoraConfig(rank=rank, targets=list(targets)))
    materialize(model, args, "cpu", 0)
    if recompute == "full":
        from shardwise.activation_checkpoint import apply_activation_checkpointing

        apply_activation_checkpointing(model, "full")
    tokens = torch.randint(0, args.vocab_size, (b, s))
    with MatmulFlops() as counter:
        engine_loss(model, tokens, tokens).backward()
    ideal = Accelerator("ideal", 1e12, {"fp32": 1e12}, mem_bandwidth=math.inf, intra_node_bw=1e9, inter_node_bw=1e9,
                        host_bw=1e9, matmul_efficiency=1.0, attention_efficiency=math.inf)
    training = Training(seq_len=s, global_batch=b, precision="fp32", lora_rank=rank, lora_targets=targets)
    t = step_time(args, training, Plan(micro_batch=b, activation_checkpoint=recompute), Cluster(ideal, 1))
    assert (t.compute_s + t.recompute_s) * 1e12 == pytest.approx(counter.flops, rel=1e-9)


@pytest.mark.parametrize("every, lora", [(2, False), (3, False), (2, True)])
def test_recompute_of_every_kth_block_counts_the_flops_the_engine_runs(every, lora):
    """Checkpointing one block in k (parallel.activation_checkpoint_every): the engine replays the blocks whose
    index is a multiple of k, 3 of 5 at k = 2 and 2 of 5 at k = 3 (not 2 and 1, as counting from the first block
    after k would), and the planner's recompute time is theirs: compute plus recompute times the peak is the
    matmul FLOPs of the engine's forward and backward, LoRA's first block (which needs no input gradient) too."""
    from shardwise.activation_checkpoint import apply_activation_checkpointing
    from shardwise.config import LoraConfig
    from shardwise.lora import apply_lora
    from shardwise.planner import Accelerator, step_time

    args, b, s, rank = dataclasses.replace(_small(), n_layers=5), 2, 96, 8
    model = build_model(args)
    if lora:
        apply_lora(model, LoraConfig(rank=rank, targets=["w2"]))
    materialize(model, args, "cpu", 0)
    apply_activation_checkpointing(model, "full", every)
    tokens = torch.randint(0, args.vocab_size, (b, s))
    with MatmulFlops() as counter:
        engine_loss(model, tokens, tokens).backward()
    ideal = Accelerator("ideal", 1e12, {"fp32": 1e12}, mem_bandwidth=math.inf, intra_node_bw=1e9, inter_node_bw=1e9,
                        host_bw=1e9, matmul_efficiency=1.0, attention_efficiency=math.inf)
    training = Training(seq_len=s, global_batch=b, precision="fp32", lora_rank=rank if lora else 0,
                        lora_targets=("w2",))
    plan = Plan(micro_batch=b, activation_checkpoint="full", activation_checkpoint_every=every)
    t = step_time(args, training, plan, Cluster(ideal, 1))
    assert (t.compute_s + t.recompute_s) * 1e12 == pytest.approx(counter.flops, rel=1e-9)
    full = step_time(args, training, dataclasses.replace(plan, activation_checkpoint_every=1), Cluster(ideal, 1))
    assert 0 < t.recompute_s < full.recompute_s
    if lora and every == 2:
        # a system counting from 1 (torchtitan's) replays blocks 1 and 3: two whole replays, block 0's skip none
        from shardwise.planner.timing import lora_first_block_replay_skipped

        skipped = lora_first_block_replay_skipped(args, training, plan, ideal)  # (one micro-batch a step)
        last = step_time(args, dataclasses.replace(training, partial_checkpoint="last"), plan, Cluster(ideal, 1))
        assert skipped > 0 and last.recompute_s == pytest.approx(2 * (full.recompute_s + skipped) / 5, rel=1e-9)



@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_lora_pipeline_cost_is_the_slowest_rank(schedule):
    """Under LoRA rank 0's first block skips input gradients, so another rank with its blocks can be slower: the
    stage cost is the slowest of every rank (Llama 2 70B over 3 stages: 27, 27 and 26 blocks, the last with a head
    of 32,000 rows, lighter than a block: rank 1 is the slowest)."""
    from shardwise.planner.timing import _stage_cost, stage_cost

    args = preset("llama2-70b")
    training = Training(seq_len=4096, global_batch=12, lora_rank=16, state_dtype="bf16", layout="fsdp-mp")
    plan = Plan(pp=3, micro_batch=1, grad_accum=12, pp_schedule=schedule,
                virtual_stages=2 if schedule != "1f1b" else 1)
    cluster = Cluster(accelerator("h100"), 3)
    costs = [_stage_cost(args, training, plan, cluster, rank).total for rank in range(3)]
    assert max(costs) == costs[1] > costs[0]
    assert stage_cost(args, training, plan, cluster).total == pytest.approx(costs[1], rel=1e-12)


def test_evaluate_reports_consistent_itemised_memory_and_time():
    args = preset("llama3-8b")
    tr = Training(seq_len=8192, global_batch=64)
    ev = evaluate(args, tr, Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=8, activation_checkpoint="full"),
                  Cluster(accelerator("h100"), 8))
    total = ev.memory.pop("total")
    assert total == pytest.approx(sum(ev.memory.values()))
    # ZeRO-3 over 8 ranks: weights + Adam state are 12 bytes / param / 8 (ZeRO-3's 16P/N less the
    # gradients); at the peak (the last micro-batch's backward) the gradients are not yet reduce-scattered:
    # accumulation without synchronisation keeps them unsharded, fp32, among FSDP's buffers
    states = ev.memory["params"] + ev.memory["optimizer_state"] + ev.memory["master_weights"]
    assert states == pytest.approx(12 * num_params(args) / 8, rel=1e-6)
    assert ev.memory["grads"] == 0 and ev.memory["fsdp_buffers"] >= 4 * num_params(args)
    t = ev.time
    assert t.step_time_s >= t.compute_s + t.recompute_s
    assert t.tokens_per_s == pytest.approx(64 * 8192 / t.step_time_s)
    assert 0 < t.mfu < 1


def test_search_405b_on_16384_gpus_prunes_and_is_valid():
    # how long the search takes is benchmarks/planner_search.py's (timing in a unit test fails on a loaded
    # machine); here: its plans are valid and its pruning skips most of the space (23% of it is sized)
    args = preset("llama3-405b")
    tr = Training(seq_len=8192, global_batch=2048)
    cluster = Cluster(accelerator("h100"), 16384)
    result = search(args, tr, cluster, top_k=5)
    assert result.ranked
    assert result.evaluated < sum(1 for _ in plan_space(args, tr, cluster)) / 2
    # by step time, except that plans within 0.1% of the fastest lead by memory
    times = [ev.time.step_time_s for ev in result.ranked]
    n = sum(t <= min(times) * 1.001 for t in times)
    assert all(t <= min(times) * 1.001 for t in times[:n]) and times[n:] == sorted(times[n:])
    assert [ev.memory["total"] for ev in result.ranked[:n]] == sorted(ev.memory["total"] for ev in result.ranked[:n])
    for ev in result.ranked:
        assert ev.plan.world == 16384 and ev.fits
        assert ev.plan.micro_batch * ev.plan.grad_accum * ev.plan.dp == 2048


def _exhaustive_best(args, tr, cluster):
    """The best plan by evaluating every plan of the space (offload only when nothing fits without it, as search),
    ranked as search ranks: of the plans within TIE of the fastest step time, the least memory."""
    from shardwise.planner.search import TIE

    for offload in ("none", "full"):
        fitting = [ev for plan in plan_space(args, tr, cluster, offload=offload)
                   if (ev := evaluate(args, tr, plan, cluster)).fits]
        if fitting:
            fastest = min(e.time.step_time_s for e in fitting) * (1 + TIE)
            return min((e for e in fitting if e.time.step_time_s <= fastest),
                       key=lambda e: (e.memory["total"], e.time.step_time_s))
    return None


@pytest.mark.parametrize("model,gpus,gpu,seq_len,batch", [
    ("llama3-8b", 16, "h100", 4096, 64),
    # FSDP that accumulates without synchronising keeps every gradient unsharded, so one micro-batch of the whole
    # local batch can need less memory than one sequence per micro-batch: the best plans here (cp x FSDP, one
    # micro-batch) were pruned while the search took one sequence as every layout's memory floor
    ("llama3-8b", 16, "l4", 8192, 16),
    # offloaded (on 2 GPUs its 16 bytes a parameter outgrow the host's 256 GiB a GPU: no plan)
    ("mixtral-8x7b", 4, "h100", 2048, 8),
])
def test_pruned_search_finds_the_exhaustive_best(model, gpus, gpu, seq_len, batch):
    """(Every block checkpointed or none, as plan_space walks: checkpointing one block in k is the next test's.)"""
    args, tr, cluster = preset(model), Training(seq_len=seq_len, global_batch=batch), Cluster(accelerator(gpu), gpus)
    best = _exhaustive_best(args, tr, cluster)
    ranked = search(args, tr, cluster, {"activation_checkpoint_every": 1}, top_k=1).ranked
    assert best is not None and ranked
    assert ranked[0].time.step_time_s == pytest.approx(best.time.step_time_s, rel=1e-12)


def test_the_search_checkpoints_the_fewest_blocks_that_fit():
    """Where a policy had to checkpoint (the faster one did not fit), the search took it for every block; now it
    checkpoints one block in k for the largest k that fits (torchtitan's selective_ac_option "k", fms-fsdp's
    fraction): IBM's 13B job (128 A100, FSDP, micro-batch 2), which ran one block in 2, is faster so than with
    every block, and one block fewer does not fit. Nowhere it cannot be priced (a mixture of experts), nor where
    --plan fixes k."""
    args = dataclasses.replace(preset("llama2-7b"), name="llama2-13b", dim=5120, n_layers=40, n_heads=40,
                               n_kv_heads=40, ffn_hidden=13824)
    # (a system with whole-block checkpointing only, as fms-fsdp's: none, then full)
    tr = Training(seq_len=4096, global_batch=256, selective="none")
    cluster = Cluster(accelerator("a100-80gb"), 128)
    fixed = {"dp_shard": 128, "zero_stage": 3, "micro_batch": 2, "mixed_precision": "autocast"}
    best = search(args, tr, cluster, fixed, top_k=1).ranked[0]
    k = best.plan.activation_checkpoint_every
    assert best.fits and best.plan.activation_checkpoint != "none" and 1 < k < args.n_layers
    every = evaluate(args, tr, dataclasses.replace(best.plan, activation_checkpoint_every=1), cluster)
    fewer = evaluate(args, tr, dataclasses.replace(best.plan, activation_checkpoint_every=k + 1), cluster)
    assert best.time.step_time_s < every.time.step_time_s and not fewer.fits
    assert not evaluate(args, tr, dataclasses.replace(best.plan, activation_checkpoint="none"), cluster).fits
    fixed_one = search(args, tr, cluster, {**fixed, "activation_checkpoint_every": 1}, top_k=1).ranked[0]
    assert fixed_one.plan.activation_checkpoint_every == 1
    moe = search(preset("mixtral-8x7b"), Training(seq_len=4096, global_batch=64), Cluster(accelerator("h100"), 16),
                 top_k=3).ranked
    assert moe and all(ev.plan.activation_checkpoint_every == 1 for ev in moe)


def test_search_notes_no_memory_for_a_tp_the_model_cannot_split():
    # gpt3-175b's 50,257-token vocabulary has no even divisor, so the engine refuses every tp > 1 (config.tp_error)
    # and so does --plan tp=8; the search used to size those layouts anyway and explained the choice of tp=1 as
    # "tp=8: out of memory (least 82.6 GiB > 80.0)", a reason that is not why
    args = preset("gpt3-175b")
    tr = Training(seq_len=2048, global_batch=1536)
    cluster = Cluster(accelerator("a100-80gb"), 1024)
    result = search(args, tr, cluster, top_k=1)
    assert result.ranked and result.ranked[0].plan.tp == 1
    assert [v for k, v in result.min_memory_by_knob if k == "tp"] == [1]
    assert [v for k, v in result.best_by_knob if k == "tp"] == [1]


def test_search_prefers_no_parallel_model_split_when_the_model_fits():
    # a 1B model fits one H100 (16 bytes/param = 20 GB): the search should not pay for tp or pp
    args = preset("llama3.2-1b")
    result = search(args, Training(seq_len=2048, global_batch=64), Cluster(accelerator("h100"), 8))
    best = result.ranked[0].plan
    assert best.tp == 1 and best.pp == 1


def test_plans_that_tie_on_step_time_rank_by_memory_and_the_explanation_says_so():
    # the debug model on one H100: micro-batches of 32 and more cost the same step time to within 1e-6 s, and
    # the fastest by a hair was micro_batch=1024 at 30 times the activations of the least-memory tie
    args, cluster = preset("debug"), Cluster(accelerator("h100"), 1)
    result = search(args, Training(seq_len=2048, global_batch=2048), cluster, top_k=1000)
    best = result.ranked[0]
    tied = [e for e in result.ranked if e.time.step_time_s <= min(e.time.step_time_s for e in result.ranked) * 1.001]
    assert len(tied) > 1 and best.memory["total"] == min(e.memory["total"] for e in tied)
    reasons = knob_reasons(best, result)["micro_batch"]
    assert reasons.startswith(f"micro_batch={best.plan.micro_batch} because ")
    assert "the same step time (within 0.1%), no less memory" in reasons


def test_fixed_knobs_are_respected():
    args = preset("llama3-70b")
    result = search(args, Training(seq_len=4096, global_batch=256), Cluster(accelerator("h100"), 64),
                    fixed=parse_layout("tp=8,pp=4,activation_checkpoint=full", "--plan"))
    assert result.ranked and all(e.plan.tp == 8 and e.plan.pp == 4 and e.plan.activation_checkpoint == "full"
                                 for e in result.ranked)


def _ns(*argv):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_json(capsys):
    rc = run_plan(_ns("--model", "llama3-8b", "--gpus", "16", "--gpu", "h100", "--seq-len", "4096",
                      "--global-batch-tokens", str(2**20), "--json"))
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    plan = out["plans"][0]
    for key in ("dp", "tp", "pp", "cp", "zero_stage", "micro_batch", "grad_accum", "activation_checkpoint",
                "pp_schedule", "virtual_stages", "sequence_parallel", "memory_gib", "step_time_s", "tokens_per_s",
                "mfu", "bubble_fraction", "exposed_comm_s"):
        assert key in plan
    assert plan["memory_gib"]["total"] == pytest.approx(
        sum(v for k, v in plan["memory_gib"].items() if k != "total"), abs=0.01)
    assert plan["dp"] * plan["tp"] * plan["pp"] * plan["cp"] == 16
    assert out["explanation"]["single_device"]["failure"] == "model too big"


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100"]])
def test_help_and_plan_import_no_torch(argv):
    """`shardwise plan` and `shardwise --help` answer without importing torch (seconds on a laptop). The command
    list built every command's arguments, and bench's and simulate's modules import torch: `shardwise --help`
    took 5.7 s where `shardwise plan --help` took 0.2."""
    code = (f"import contextlib, sys\nfrom shardwise.cli import main\nwith contextlib.suppress(SystemExit): "
            f"main({argv!r})\nprint('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "False", (proc.stdout[-500:], proc.stderr[-2000:])


def test_cli_unfused_attention_reaches_the_model(capsys):
    """`--attention unfused --dropout` evaluates a plan as Megatron-LM ran it in 2021-22: the same plan as
    `evaluate` with Training(fused_attention=False, dropout=True) gives, slower and larger than fused."""
    argv = ("--model", "llama3-8b", "--gpus", "8", "--gpu", "a100-80gb", "--seq-len", "2048", "--global-batch",
            "16", "--layout", "megatron", "--plan", "tp=8,pp=1,cp=1,dp=1,micro_batch=1,activation_checkpoint=none,"
            "sequence_parallel=true", "--json")
    results = {}
    for flags in ((), ("--attention", "unfused", "--dropout")):
        assert run_plan(_ns(*argv, *flags)) == 0
        results[flags] = json.loads(capsys.readouterr().out)["plans"][0]
    fused, unfused = results[()], results[("--attention", "unfused", "--dropout")]
    training = Training(seq_len=2048, global_batch=16, layout="megatron", fused_attention=False, dropout=True)
    plan = Plan(tp=8, micro_batch=1, grad_accum=16, activation_checkpoint="none", sequence_parallel=True)
    ev = evaluate(preset("llama3-8b"), training, plan, Cluster(accelerator("a100-80gb"), 8))
    assert unfused["step_time_s"] == pytest.approx(ev.time.step_time_s, rel=1e-6)
    assert unfused["step_time_s"] > fused["step_time_s"]
    assert unfused["memory_gib"]["total"] > fused["memory_gib"]["total"]


def test_cli_given_plan_that_does_not_fit_is_still_reported(capsys):
    rc = run_plan(_ns("--model", "llama3-70b", "--gpus", "8", "--global-batch", "8", "--seq-len", "4096",
                      "--plan", "dp=8,tp=1,pp=1,zero_stage=0,micro_batch=1,activation_checkpoint=none", "--json"))
    assert rc == 1
    plan = json.loads(capsys.readouterr().out)["plans"][0]
    assert plan["fits"] is False and plan["memory_gib"]["total"] > 1000


def test_cli_table(capsys):
    assert run_plan(_ns("--model", "llama3.2-1b", "--gpus", "8", "--global-batch", "64", "--seq-len", "2048")) == 0
    out = capsys.readouterr().out
    assert "step s" in out and "Decision sequence" in out


# Citations of documents users do not have: "reference doc 001", "docs 001, 002", "(ref 002)", "reference documents"
_PRIVATE_CITATION = re.compile(r"reference doc|\bdocs? 0\d\d\b|\(ref\.? ?\d+\)|reference/0\d\d|\b0\d\d_[0-9a-f]{16}\b",
                               re.IGNORECASE)


def test_plan_output_and_package_text_cite_public_sources(capsys):
    assert run_plan(_ns("--model", "llama3-8b", "--gpus", "8", "--seq-len", "4096", "--global-batch", "16",
                        "--plan", "tp=2,pp=2,dp=2,pp_schedule=1f1b")) == 0
    out = capsys.readouterr().out
    assert "Decision sequence (LoRA -> BF16 + checkpointing -> DDP -> ZeRO-1/2 -> FSDP -> TP -> PP -> 3D)" in out
    assert not _PRIVATE_CITATION.search(out), _PRIVATE_CITATION.search(out)
    root = Path(__file__).parent.parent
    texts = [*(root / "shardwise").rglob("*.py"), *(root / "docs").rglob("*.md"), root / "README.md"]
    assert len(texts) > 10
    cited = [f"{path.relative_to(root)}:{n}: {line.strip()}" for path in texts
             for n, line in enumerate(path.read_text().splitlines(), 1) if _PRIVATE_CITATION.search(line)]
    assert not cited, "\n".join(cited)


@pytest.mark.parametrize("argv, flag", [
    (["--model", "nope", "--gpus", "8"], "--model"),
    (["--model", "llama3-8b", "--gpus", "8", "--gpu", "tpu9"], "--gpu"),
    (["--model", "llama3-8b", "--gpus", "12"], "--gpus"),
    (["--model", "llama3-8b", "--gpus", "8", "--plan", "tp=3"], "--plan"),
    (["--model", "llama3-8b", "--gpus", "8", "--plan", "bogus=1"], "--plan"),
    # a dp that does not divide the GPUs, with a batch it does not divide either, was blamed on micro_batch
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "32", "--plan", "dp=3"], "--plan dp: dp=3"),
    (["--model", "llama3-8b", "--gpus", "8", "--global-batch-tokens", "1000"], "--global-batch-tokens"),
    (["--model", "llama3-8b", "--gpus", "8", "--gpu", "v100", "--precision", "bf16"], "--precision"),
    (["--model", "llama3-8b", "--gpus", "8", "--plan", "offload=optimizer", "--write-config", "x.toml"],
     "--plan offload"),  # the engine has no optimizer-only offload: the search does not offer it
    # layouts the engine refuses are neither searched nor reported as the given plan (they were, as fitting)
    (["--model", "llama3-70b", "--gpus", "32", "--seq-len", "8192", "--global-batch", "8", "--plan", "pp=16,tp=2"],
     "--plan pp"),
    (["--model", "llama3-70b", "--gpus", "32", "--seq-len", "8192", "--global-batch", "8", "--plan",
      "pp=2,tp=2,dp_shard=8,pp_schedule=zero-bubble,zero_stage=3"], "--plan (parallel.zero_stage)"),
    (["--model", "llama3-8b", "--gpus", "8", "--lora-rank", "16", "--qlora", "--plan", "tp=2"],
     "--plan (lora.qlora)"),
    # a shape NF4 cannot block in any layout (debug's wk: 64 x 128 weights, under one 64 x 256 block of blocks)
    # was a search that left every plan out, reported as activations too large for one sequence
    (["--model", "debug", "--gpus", "1", "--lora-rank", "8", "--qlora"], "--qlora: wk's weight"),
    (["--model", "llama3-8b", "--gpus", "8", "--lora-rank", "16", "--lora-dropout", "1"], "--lora-dropout: 1.0 is"),
    (["--model", "llama3-8b", "--gpus", "8", "--lora-dropout", "0.05"], "--lora-dropout: it drops"),
])
def test_cli_bad_inputs_name_the_flag(argv, flag, capsys):
    assert run_plan(_ns(*argv)) == 2
    assert flag in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    assert run_plan(_ns("--model", "llama3-70b", "--gpus", "64", "--seq-len", "4096", "--global-batch", "128",
                        "--plan", "tp=8,pp=4,pp_schedule=1f1b", "--plot", str(out))) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flags, flag", [
    (["--matmul-size", "0"], "--matmul-size"),  # ZeroDivisionError
    (["--iters", "0"], "--iters"),  # IndexError
    (["--threads", "-2"], "--threads"),
    (["--comm-mb", "-1"], "--comm-mb"),  # wrote a profile of 0 GB/s
    (["--base", "nosuchgpu"], "--base"),  # named --gpu
    (["--out", "{tmp}"], "--out"),  # a folder: a traceback after the whole measurement
    (["--out", "{tmp}/no/such/p.json"], "--out"),
])
def test_bad_bench_flags_are_one_line_before_anything_is_measured(tmp_path, capsys, monkeypatch, flags, flag):
    from shardwise import cli
    from shardwise.planner import bench

    monkeypatch.setattr(bench, "compute_rates", lambda *a, **k: pytest.fail("measured"))
    argv = ["bench", "--world", "1", "--out", str(tmp_path / "p.json"), *(f.format(tmp=tmp_path) for f in flags)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"shardwise: error: {flag}: ") and "\n" not in err, err


@pytest.mark.parametrize("base", [None, "h100"])
def test_bench_memory_is_the_hosts_share_or_the_base_datasheets(tmp_path, monkeypatch, base):
    """On a CPU the ranks share the host's memory (RAM / world); with --base the datasheet entry is kept, its memory
    too (an H100 profile of 2 ranks read 40 GiB, half the card's)."""
    from shardwise.planner import bench

    rates = {"matmul_fp32": 1e11, "matmul_bf16": 1e11, "attention": 5e10, "mem_bandwidth": 1e10,
             **{f"attention_{seq}_{hd}": 5e10 for seq, hd in bench.ATTENTION_SHAPES}}
    coll = {op: {4: 1e-4, 2**16: 1e-3} for op in ("all_reduce", "all_gather", "reduce_scatter")}
    monkeypatch.setattr(bench, "compute_rates", lambda *a, **k: dict(rates))
    monkeypatch.setattr(bench, "collectives", lambda *a, **k: {**coll, "overlap": {"overlap": 0.5},
                                                               "sync": {"sync_s": 0.0}})
    monkeypatch.setattr(bench, "_device_memory", lambda device: 64 * GiB)
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    ns = parser.parse_args(["--out", str(tmp_path / "p.json"), "--world", "2", "--device", "cpu",
                            *(["--base", base] if base else [])])
    profile = bench.measure(ns)
    assert profile["memory_bytes"] == (accelerator(base).memory_bytes if base else 32 * GiB)
    # its measured comm_overlap holds NCCL's SMs already: the base's channels are not kept to count them again
    assert profile["comm_overlap"] == 0.5 and profile["nccl_channels"] == 0


@pytest.mark.multiprocess
def test_bench_profile_is_accepted_by_the_planner(tmp_path, capfd):
    from shardwise.planner.bench import add_bench_arguments, run_bench

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    out = tmp_path / "profile.json"
    ns = parser.parse_args(["--out", str(out), "--world", "2", "--matmul-size", "256", "--comm-mb", "1",
                            "--iters", "2", "--device", "cpu", "--matmul-grid", "64,256"])
    assert run_bench(ns) == 0
    # where it is, from rank 0 (it printed nothing for minutes on a CPU): here not a terminal, a line a phase
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("shardwise bench:")]
    from shardwise.planner.bench import ATTENTION_SHAPES, OVERHEADS

    # fp32 and bf16 matmuls, attention, memory, the attention shapes, the grid's 2^3 GEMMs, the host-side costs;
    # 4 bytes, 64 and 256 KiB (each a factor of 4, up to --comm-mb) and the overlap with compute
    compute = 2 + 1 + 1 + len(ATTENTION_SHAPES) + 2**3 + len(OVERHEADS)
    assert said == [f"shardwise bench: measuring compute ({compute} measurements)",
                    "shardwise bench: measuring collectives (4 measurements)"], said
    profile = json.loads(out.read_text())
    m = profile["measurements"]
    assert m["matmul_flops"]["fp32"] > 0 and m["all_reduce_busbw"] > 0 and m["latency_s"] > 0
    assert 0.0 <= profile["comm_overlap"] <= 1.0 and m["threads_per_rank"] >= 1
    # the 2 ranks share this machine's memory (test_bench_memory_is_the_hosts_share_or_the_base_datasheets: --base)
    assert profile["memory_bytes"] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2
    # every host-side cost is measured on a CPU, each a difference that a wrapper or DTensor only adds to
    assert all(profile[k] > 0 for k in OVERHEADS), {k: profile[k] for k in OVERHEADS}
    # busbw is the per-link B of the ring formula: the measured all-reduce time is reproduced by it
    n, t = 2, m["collective_times_s"]["all_reduce"]
    biggest = max(t, key=int)
    assert ring_all_reduce(int(biggest), n, Link(m["all_reduce_busbw"], 0.0, "intra")) == pytest.approx(t[biggest])
    from shardwise.planner import load_profile
    from shardwise.planner.comm import all_gather, all_reduce, group_link, reduce_scatter

    acc = load_profile(out)
    # the planner prices every measured collective at its measured time (the curves in the profile), plus the
    # measured sync when the ranks come to it from compute
    sync = m["sync"]
    assert acc.collective_sync_s == sync["sync_s"] == max(0.0, sync["both_s"] - sync["compute_s"] - sync["comm_s"])
    link = group_link(2, 1, Cluster(acc, 2, gpus_per_node=2))
    for name, op in (("all_reduce", all_reduce), ("all_gather", all_gather), ("reduce_scatter", reduce_scatter)):
        for size, seconds in m["collective_times_s"][name].items():
            assert op(int(size), 2, link, after_compute=False) == pytest.approx(seconds), (name, size)
            assert op(int(size), 2, link) == pytest.approx(seconds + sync["sync_s"]), (name, size)
    # each measured GEMM shape is priced at its measured rate
    assert len(m["matmul_flops_by_shape"]) == 8
    for key, rate in m["matmul_flops_by_shape"].items():
        assert acc.matmul_eff(*map(int, key.split(",")), "fp32") * acc.peak("fp32") == pytest.approx(rate), key
    ev = evaluate(preset("tiny"), Training(seq_len=128, global_batch=4, precision="fp32"),
                  Plan(dp_shard=2, zero_stage=3, micro_batch=2), Cluster(acc, 2, gpus_per_node=2))
    assert ev.fits and ev.time.step_time_s > 0


@pytest.mark.parametrize("plan", [Plan(dp_replicate=8, micro_batch=1, grad_accum=4),
                                  Plan(dp_replicate=8, zero_stage=1, micro_batch=1, grad_accum=4),
                                  Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=4),
                                  Plan(dp_shard=4, tp=2, zero_stage=2, micro_batch=1, grad_accum=8)])
def test_without_overlap_step_time_is_compute_plus_communication(plan):
    """comm_overlap = 0 (gloo on a CPU: collectives use the cores the matmuls use) leaves nothing hidden:
    T = compute + recompute + every collective + optimizer + the sharding copies; with full overlap a ZeRO-0
    all-reduce much shorter than the backward is exposed only for its last bucket, one block's share (and the
    step's scalar all-reduces)."""
    import dataclasses

    args, tr = preset("llama3-8b"), Training(seq_len=4096, global_batch=32)
    serial = Cluster(dataclasses.replace(accelerator("h100"), comm_overlap=0.0), 8)
    t = evaluate(args, tr, plan, serial).time
    assert t.step_time_s == pytest.approx(t.compute_s + t.recompute_s + t.comm_total_s + t.optimizer_s
                                          + t.detail["sharding_copies_s"], rel=1e-12)
    assert t.exposed_comm_s == pytest.approx(t.comm_total_s, rel=1e-12)
    if plan.zero_stage == 0:  # NCCL's SMs left out: what they add to hidden traffic is tested on its own
        overlapped = evaluate(args, tr, plan, Cluster(dataclasses.replace(accelerator("h100"), nccl_channels=0),
                                                      8)).time
        # the step's scalar all-reduces (loss, gradient norm) wait for the backward: exposed either way
        scalars = t.detail["step_scalars_s"]
        assert scalars > 0
        assert overlapped.exposed_comm_s == pytest.approx((t.comm_total_s - scalars) / args.n_layers + scalars,
                                                          rel=1e-12)


@pytest.mark.parametrize("model,gpus,seq_len,batch,recipe", [
    ("llama3-70b", 32, 8192, 32, {}),  # pipelines with fewer micro-batches than stages were offered
    ("tiny", 8, 64, 16, {}),  # tp=4 and 8 with 2 KV heads were offered
    ("deepseek-v3-like", 64, 4096, 64, {}),
    ("llama3-8b", 8, 2048, 16, {"lora_rank": 16, "qlora": True}),  # QLoRA under tp was offered
    ("llama3-8b", 1024, 2048, 1024, {"lora_rank": 16, "qlora": True}),  # NF4 blocks split over 512 ranks
    ("llama3-8b", 8, 2048, 16, {"optimizer": "adamw8bit"}),
])
def test_every_plan_the_search_may_return_is_a_config_the_engine_accepts(tmp_path, model, gpus, seq_len, batch,
                                                                          recipe):
    """The search walks plan_space: a sample of it, with and without offload, written as configs that the
    engine's own validation accepts (write_config loads what it wrote)."""
    import random

    from shardwise.planner.config_out import write_config

    args, tr = preset(model), Training(seq_len=seq_len, global_batch=batch, **recipe)
    cluster = Cluster(accelerator("h100"), gpus)
    plans = [p for offload in ("none", "full") for p in plan_space(args, tr, cluster, offload=offload)]
    for plan in random.Random(0).sample(plans, min(300, len(plans))):
        write_config(tmp_path / "plan.toml", args, tr, plan)


@pytest.mark.parametrize("flags, flag", [
    (["--lora-rank", "-4"], "--lora-rank"),
    (["--lora-rank", "8", "--lora-targets", "q_proj,v_proj"], "--lora-targets"),  # the engine's names: wq, wv
    (["--lora-targets", "wq"], "--lora-targets"),  # without --lora-rank it would be dropped
    (["--seq-len", "4098", "--global-batch", "16", "--plan", "cp=2"], "--plan cp"),  # 2 cp chunks per sequence
    (["--plan", ",".join(("tp=2", "tp=4"))], "--plan tp"),  # joined: tests/test_layout.py reads quoted layouts
    (["--plan", "zero_stage=-1"], "--plan zero_stage"),
    (["--global-batch-tokens", "-4096"], "--global-batch-tokens"),
    (["--seq-len", "0"], "--seq-len"),
    (["--intra-node-gbs", "0"], "--intra-node-gbs"),
    (["--gpu-memory-gib", "nan"], "--gpu-memory-gib"),
    (["--write-config", "{tmp}"], "--write-config"),  # a folder
    (["--write-config", ""], "--write-config"),  # wrote nothing, silently
    (["--write-config", "{tmp}/no/such/folder/plan.toml"], "--write-config"),
    (["--plot", "{tmp}/plan.txt"], "--plot"),
    (["--model", "{tmp}/config.json"], "--model"),  # not JSON
    (["--gpus", "100000000000000000000"], "--gpus"),  # more than any plan can use: was a hang
    (["--gpus", "2048", "--global-batch", "1", "--plan", "cp=1"], "--gpus"),  # 32 heads x 32 layers x cp 1
    (["--plan", "sequence_parallel=true,tp=1"], "--plan sequence_parallel"),  # the engine refuses it
    (["--seq-len", "2048", "--global-batch", "64", "--plan", "pp_microbatches=1,pp=2"], "--plan pp_microbatches"),
])
def test_bad_plan_flags_are_one_line_naming_the_flag(tmp_path, capsys, flags, flag):
    (tmp_path / "config.json").write_text("{bad")
    argv = {"--model": "llama3-8b", "--gpus": "8"}
    argv.update(zip(flags[::2], flags[1::2]))
    assert run_plan(_ns(*(a.format(tmp=tmp_path) for kv in argv.items() for a in kv))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"shardwise: error: {flag}") and "fix:" in err and "\n" not in err
    assert not (tmp_path / "plan.toml").exists()


@pytest.mark.parametrize("change, problem", [
    ({"hidden_size": "4096"}, "hidden_size = '4096' is not a positive whole number"),
    ({"num_attention_heads": 0}, "num_attention_heads = 0 is not"),
    ({"num_hidden_layers": 32.5}, "num_hidden_layers = 32.5 is not"),
    ({"max_position_embeddings": 0}, "max_position_embeddings = 0 is not"),
    ({"num_key_value_heads": 5}, "num_key_value_heads = 5 does not divide"),
    ({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 10}, "num_experts_per_tok = 10 >"),
])
def test_a_bad_hugging_face_config_is_refused_naming_its_key(tmp_path, change, problem):
    from shardwise.planner import resolve_model

    config = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 14336,
              "vocab_size": 128256, "num_key_value_heads": 8, **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlannerError, match=f"--model: {re.escape(problem)}"):
        resolve_model(str(tmp_path / "config.json"))


def test_fixed_pipeline_micro_batches_and_sequence_parallelism_are_kept():
    # both used to be dropped: plans with another accumulation, and sequence parallelism on tp=1 (the engine
    # refuses that)
    from shardwise.planner import search

    args, tr = preset("llama3-8b"), Training(seq_len=2048, global_batch=64)
    cluster = Cluster(accelerator("h100"), 8)
    ranked = search(args, tr, cluster, fixed={"pp": 2, "pp_microbatches": 8}, top_k=20).ranked
    assert ranked and all(ev.plan.grad_accum == 8 for ev in ranked)
    ranked = search(args, tr, cluster, fixed={"pp_microbatches": 8}, top_k=20).ranked  # pp left to the search
    assert ranked and all(ev.plan.pp > 1 and ev.plan.grad_accum == 8 for ev in ranked)
    space = list(plan_space(args, tr, cluster, fixed={"pp_microbatches": 8}))  # the unpruned walk reads it alike
    assert space and all(p.pp > 1 and p.grad_accum == 8 for p in space)
    ranked = search(args, tr, cluster, fixed={"sequence_parallel": True}, top_k=20).ranked
    assert ranked and all(ev.plan.tp > 1 and ev.plan.sequence_parallel for ev in ranked)


def test_zero_bubble_states_saturate_past_four_micro_batches_per_stage():
    # what lets the planner walk 4p micro-batches for any m (a tiny --seq-len made millions)
    from shardwise.planner.memory import ZB_MOMENTS_SATURATE, _zero_bubble_moments

    for p in range(1, 7):
        for rank in range(p):
            saturated = _zero_bubble_moments(p, ZB_MOMENTS_SATURATE * p, rank)
            assert all(_zero_bubble_moments(p, m, rank) == saturated
                       for m in range(ZB_MOMENTS_SATURATE * p, 10 * p + 7)), (p, rank)


def test_no_layout_is_not_reported_as_no_memory(capsys):
    # 2^24 GPUs cannot split 1024 sequences: no layout exists, which is not a memory problem
    assert run_plan(_ns("--model", "llama3-8b", "--gpus", str(2**24))) == 1
    out = capsys.readouterr().out
    assert "No layout divides 16777216 GPUs and the global batch of 1024 sequences" in out
    assert "No plan fits in memory" not in out


def test_no_plan_the_engine_runs_is_not_reported_as_no_memory(capsys):
    # one sequence on 256 GPUs: tp x cp reach 128 at most, so every layout needs a pipeline, and a pipeline needs
    # a micro-batch per stage; nothing is sized, and "try more GPUs" would make it worse
    assert run_plan(_ns("--model", "llama3-8b", "--gpus", "256", "--global-batch", "1")) == 1
    out = capsys.readouterr().out
    assert "No plan the engine runs divides 256 GPUs and the global batch of 1 sequences" in out
    assert "No plan fits in memory" not in out
    # a memory problem is still one
    assert run_plan(_ns("--model", "llama3-8b", "--gpus", "8", "--gpu-memory-gib", "1")) == 1
    assert "No plan fits in memory" in capsys.readouterr().out


def test_max_tp_below_a_fixed_tp_is_refused(capsys):
    """--plan tp=2 --max-tp 1 planned tp=2 and dropped --max-tp without a word."""
    assert run_plan(_ns("--model", "llama3-8b", "--gpus", "8", "--plan", "tp=2", "--max-tp", "1")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardwise: error: --max-tp: 1 is below the tp=2 that --plan fixes") and "\n" not in err
    assert run_plan(_ns("--model", "llama3-8b", "--gpus", "8", "--plan", "tp=2", "--max-tp", "2", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["plans"][0]["tp"] == 2


def test_write_config_leaves_no_file_the_engine_refuses(tmp_path, monkeypatch):
    from shardwise.planner.config_out import write_config

    args, tr = preset("llama3-8b"), Training(seq_len=2048, global_batch=8)
    path = tmp_path / "plan.toml"
    monkeypatch.setattr("shardwise.planner.config_out.load_config", lambda p: (_ for _ in ()).throw(
        ConfigError("train.steps", "refused", "fix")))
    with pytest.raises(ConfigError):
        write_config(path, args, tr, Plan(dp_shard=8, zero_stage=3, micro_batch=1))
    assert list(tmp_path.iterdir()) == []


def test_plan_validation_names_the_key():
    with pytest.raises(PlannerError, match="--plan"):
        evaluate(preset("llama3-8b"), Training(global_batch=8), Plan(tp=2, micro_batch=1, grad_accum=2),
                 Cluster(accelerator("h100"), 8))
    assert math.isclose(bubble_fraction(Plan()), 0.0)


def test_more_pipeline_stages_than_layers_is_rejected_or_skipped():
    """A fixed pp x virtual_stages (or zero-bubble's two per rank) above the layer count names the key; with pp
    left to the search, the pipeline degrees it would overflow are skipped, not priced (both used to raise
    ValueError from the layer split)."""
    from shardwise.planner import search

    args, tr = preset("llama3-8b"), Training(seq_len=2048, global_batch=64)
    cluster = Cluster(accelerator("h100"), 64)
    with pytest.raises(PlannerError, match="--plan virtual_stages.*34 pipeline stages, more than the 32 layers"):
        search(args, tr, cluster, fixed={"pp": 2, "pp_schedule": "interleaved-1f1b", "virtual_stages": 17})
    with pytest.raises(PlannerError, match="--plan virtual_stages.*64 pipeline stages"):
        search(args, tr, cluster, fixed={"pp": 32, "pp_schedule": "zero-bubble"})
    ranked = search(args, tr, cluster, fixed={"pp_schedule": "interleaved-1f1b", "virtual_stages": 8},
                    top_k=50).ranked
    assert ranked and {ev.plan.pp for ev in ranked} <= {2, 4} and all(ev.plan.virtual_stages == 8 for ev in ranked)


@pytest.mark.parametrize("plan", [None, "dp=2,tp=2,pp=2,pp_schedule=1f1b"])
def test_write_config_is_what_train_runs(tmp_path, plan, capsys):
    """The written config passes the engine's own validation and carries the plan's degrees and knobs."""
    from shardwise.config import load_config

    path = tmp_path / "plan.toml"
    argv = ["--model", "llama3-8b", "--gpus", "8", "--json", "--write-config", str(path)]
    assert run_plan(_ns(*argv, *(["--plan", plan] if plan else []))) == 0
    printed = capsys.readouterr()
    best = json.loads(printed.out)["plans"][0]
    cfg = load_config(path)
    p = cfg.parallel
    assert (p.dp, p.tp, p.pp, p.cp, p.zero_stage) == tuple(best[k] for k in ("dp", "tp", "pp", "cp", "zero_stage"))
    assert p.world_size == 8 and cfg.model.dim == 4096
    assert cfg.parallel.activation_checkpoint == best["activation_checkpoint"]
    sequences = cfg.train.micro_batch * cfg.train.grad_accum * p.dp
    assert sequences == best["micro_batch"] * best["grad_accum"] * best["dp"]
    # a run of its own that keeps what it trains (it wrote into the demo's runs/demo and saved nothing), and the
    # command that runs it
    assert cfg.metrics.out_dir == "runs/plan" and cfg.checkpoint.enabled
    assert f"run it with: shardwise train --config {path} --nproc 8" in printed.err


# ---------------------------------------------------------------------------------------------------
# Memory vs the simulator: the real engine's step, one rank of a large world, on fake tensors

# (model, world, plan): Llama 3 70B's and Llama 2 7B's shapes cut to 4 blocks (the simulator's cost grows with
# the blocks, the per-rank shapes do not depend on them), at 1,024 ranks. The 70B layouts peak inside the fused
# head's forward (a block of its vocabulary-parallel logits, autocast's cached weight copies under recompute,
# FSDP's last all-gather buffer), the 7B one inside the first block's backward; ZeRO-3 with full recompute in the
# second block's FFN norm backward (the first block's reduce-scatter buffer, every MLP weight's gradient).
SIMULATED = [
    ("llama3-70b", "tp=8,dp=128,zero_stage=3"),
    ("llama3-70b", "tp=8,dp=128,zero_stage=3,activation_checkpoint=full"),
    ("llama2-7b", "tp=2,dp=512,zero_stage=3,activation_checkpoint=full"),
    ("llama3-70b", "tp=8,dp=128,zero_stage=1,activation_checkpoint=full"),
    ("llama3-70b", "tp=4,dp=256,zero_stage=2,sequence_parallel=true,activation_checkpoint=selective"),
    ("llama3-70b", "tp=8,dp=64,cp=2,zero_stage=3"),
    ("llama2-7b", "dp=1024,zero_stage=3"),
    # heads of 128 on a residual of 5120: the queries and the attention's output 4096 wide
    ("mistral-nemo-12b", "tp=4,dp=256,zero_stage=3"),
    ("mistral-nemo-12b", "tp=8,dp=128,zero_stage=2,sequence_parallel=true,activation_checkpoint=selective"),
]


@pytest.mark.parametrize("plan", ["dp_shard=8,zero_stage=3,activation_checkpoint=full,mixed_precision=fsdp",
                                  "dp_shard=8,zero_stage=3,mixed_precision=fsdp", "dp_shard=8,zero_stage=3",
                                  "dp_shard=4,tp=2,zero_stage=2,activation_checkpoint=full,mixed_precision=fsdp"])
def test_no_item_of_the_planners_peak_is_negative(plan):
    """Under FSDP2's mixed-precision policy the fused head's fp32 weight gradient is cast to bf16 and freed when its
    backward hands it over; the planner kept it among the saved tensors and took it from the temporaries, which
    came out at -0.12 GiB for Llama 3 8B on 8 ranks with full recompute (found verifying the docs' commands)."""
    from shardwise.simulate import config_from_plan, planner_prediction

    cfg = config_from_plan("llama3-8b", plan, 8, seq_len=4096, micro_batch=1, precision="bf16")
    items = planner_prediction(cfg, 0)
    assert all(value >= 0 for value in items.values()), items


@pytest.mark.parametrize("model, plan", SIMULATED)
def test_memory_matches_the_simulator_at_1024_ranks(model, plan):
    import dataclasses

    from shardwise.planner.memory import simulator_categories
    from shardwise.simulate import CATEGORIES, config_from_plan, simulate_rank

    world = 1024
    cfg = config_from_plan(model, plan, world, seq_len=4096, micro_batch=1, precision="bf16")
    cfg.model = dataclasses.replace(cfg.model, n_layers=4)
    measured = simulate_rank(cfg, world, 0).peak_step
    p = cfg.parallel
    # the tracker counts tensors: no fragmentation or CUDA-context allowance
    training = Training(seq_len=4096, global_batch=p.dp, precision="bf16",
                        ddp_bucket_mb=p.bucket_mb, fragmentation=0.0, fixed_overhead_gib=0.0)
    layout = Plan(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, cp=p.cp, zero_stage=p.zero_stage,
                  activation_checkpoint=p.activation_checkpoint, sequence_parallel=p.sequence_parallel)
    predicted = simulator_categories(stage_memory(cfg.model, training, layout, 0))
    assert predicted["total"] == pytest.approx(measured.peak_bytes, rel=0.10)
    for category in CATEGORIES:  # every category that holds at least 5% of the peak
        if max(measured.peak[category], predicted[category]) >= 0.05 * measured.peak_bytes:
            assert predicted[category] == pytest.approx(measured.peak[category], rel=0.10), category


# (model, plan, blocks, world, sequence): checkpointing one block in k, the peak where the first block's backward
# replays nothing and the second's replays its block (FSDP's ZeRO-3 under autocast and under FSDP2's policy, k = 2),
# where the first replays (k = 3 on 4 blocks: blocks 0 and 3), under DDP, with selective recompute under tp, on
# every rank of a pipeline; where the gradients of the blocks done outweigh the saved tensors (FSDP over 2 ranks,
# a short sequence: the peak in block 4's replay, k = 4, and under FSDP2's replicate, whose working copies go as
# the gradients come); and an interleaved rank whose chunk 0 ends in a replayed block and chunk 1 does not
PARTIAL = [
    ("llama2-7b", "dp=1024,zero_stage=3,activation_checkpoint=full,activation_checkpoint_every=2", 4, 1024, 4096),
    ("llama2-7b", "dp=1024,zero_stage=3,activation_checkpoint=full,activation_checkpoint_every=2,"
                  "mixed_precision=fsdp", 4, 1024, 4096),
    ("llama2-7b", "dp=1024,zero_stage=3,activation_checkpoint=full,activation_checkpoint_every=3", 4, 1024, 4096),
    ("llama2-7b", "dp_replicate=1024,zero_stage=0,activation_checkpoint=full,activation_checkpoint_every=3", 4,
     1024, 4096),
    ("llama3-70b", "tp=4,dp=256,zero_stage=2,sequence_parallel=true,activation_checkpoint=selective,"
                   "activation_checkpoint_every=2", 4, 1024, 4096),
    ("llama2-7b", "pp=2,dp=512,zero_stage=1,activation_checkpoint=full,activation_checkpoint_every=2,grad_accum=4", 8,
     1024, 4096),
    ("llama2-7b", "dp_shard=2,zero_stage=3,activation_checkpoint=full,activation_checkpoint_every=4", 8, 2, 256),
    ("llama2-7b", "dp_replicate=2,zero_stage=0,activation_checkpoint=full,activation_checkpoint_every=3", 8, 2, 256),
    ("llama3-8b", "pp=2,pp_schedule=interleaved-1f1b,virtual_stages=2,dp_shard=4,zero_stage=2,"
                  "activation_checkpoint=full,activation_checkpoint_every=3,grad_accum=8", 16, 8, 2048),
]


@pytest.mark.parametrize("model, plan, blocks, world, seq", PARTIAL)
def test_checkpointing_every_kth_block_matches_the_simulator(model, plan, blocks, world, seq):
    """The planner priced checkpointing of every block only and refused activation_checkpoint_every; now a rank's
    checkpointed blocks keep what the policy keeps and the others what they keep without recompute, and the
    backward of each later block (replayed or not, the gradients of those done made) is a moment. Every rank
    within 5% of the simulator (the engine's step on fake tensors), each category holding 5% of the peak within
    10% outside a pipeline."""
    from shardwise.simulate import CATEGORIES, config_from_plan, planner_prediction, simulate_rank

    cfg = config_from_plan(model, plan, world, seq_len=seq, micro_batch=1, precision="bf16")
    cfg.model = dataclasses.replace(cfg.model, n_layers=blocks)
    pp = cfg.parallel.pp
    for stage in range(pp):
        measured = simulate_rank(cfg, world, stage * world // pp).peak_step
        predicted = planner_prediction(cfg, stage)
        assert predicted["total"] == pytest.approx(measured.peak_bytes, rel=0.05), stage
        for category in CATEGORIES if pp == 1 else ():
            if max(measured.peak[category], predicted[category]) >= 0.05 * measured.peak_bytes:
                assert predicted[category] == pytest.approx(measured.peak[category], rel=0.10), category


def test_a_later_replayed_block_holds_the_peak():
    """Under FSDP over 2 ranks at a short sequence the gradients of the blocks done outweigh the saved tensors:
    with one block in 4 checkpointed the simulator's peak is in block 4's replay, above every block's (17.45
    against 17.31 GiB); the planner priced only the first two blocks' backwards and the next-to-last's, and put the
    two level (17.17 and 17.17, 1.6% low); now within 1% (17.31 and 17.17)."""
    from shardwise.simulate import config_from_plan, planner_prediction, simulate_rank

    peaks = {}
    for every in (1, 4):
        cfg = config_from_plan("llama2-7b", f"dp_shard=2,zero_stage=3,activation_checkpoint=full,"
                               f"activation_checkpoint_every={every}", 2, seq_len=256, micro_batch=1, precision="bf16")
        cfg.model = dataclasses.replace(cfg.model, n_layers=8)
        measured = simulate_rank(cfg, 2, 0).peak_step
        peaks[every] = (measured.peak_bytes, planner_prediction(cfg, 0)["total"])
        assert peaks[every][1] == pytest.approx(peaks[every][0], rel=0.01), every
    assert "layers.4" in measured.modules[0]
    assert peaks[4][0] > peaks[1][0] and peaks[4][1] > peaks[1][1]


def test_systems_checkpoint_their_own_blocks_one_in_k(capsys):
    """Which blocks one in k are is the system's: shardwise's engine wraps model indices 0, k, 2k, ...;
    torchtitan's apply_ac counts the blocks each process wraps from 1 (`_count += 1; if _count % ac_freq == 0`), so
    on a pipeline rank its own k-th, 2k-th, ... (the last block of a rank of 2k blocks replayed: the engine's not);
    systems without the knob refuse it, naming it."""
    from shardwise.planner.memory import checkpointed_order, pipeline_layers
    from shardwise.planner.system import SYSTEMS

    def titan(blocks: list[int], every: int) -> set[int]:  # torchtitan's wrapper, as its code counts
        count, wrapped = 0, set()
        for block in blocks:
            count += 1
            if count % every == 0:
                wrapped.add(block)
        return wrapped

    args = preset("llama3-8b")
    plan = Plan(pp=2, micro_batch=1, grad_accum=8, activation_checkpoint="full", activation_checkpoint_every=3)
    for system in ("shardwise", "torchtitan"):
        training = Training(seq_len=4096, global_batch=8, **SYSTEMS[system].training_fields())
        first = 0
        for stage, n in enumerate(pipeline_layers(args, plan, 4096)):
            blocks = list(range(first, first + n))
            expected = {b for b in blocks if b % 3 == 0} if system == "shardwise" else titan(blocks, 3)
            order = checkpointed_order(args, training, plan, stage)
            assert {b for b, kept in zip(reversed(blocks), order) if kept} == expected, (system, stage)
            first += n
    for system in ("megatron-core", "deepspeed", "torchtune"):
        argv = ["--model", "llama3-8b", "--gpus", "8", "--global-batch", "64", "--system", system,
                "--plan", "activation_checkpoint=full,activation_checkpoint_every=2"]
        assert run_plan(_ns(*argv)) == 2
        err = capsys.readouterr().err
        assert "--plan activation_checkpoint_every" in err and "partial_checkpoint = none" in err, err


def test_accumulated_gradients_match_the_simulator_at_1024_ranks():
    """Accumulation without synchronisation: FSDP2 keeps every gradient unsharded from the first micro-batch's
    backward to the last. The simulator's peak (the second micro-batch's loss, beside the kept gradients: 12.11
    GiB, against 8.33 with one micro-batch) is the planner's within 5%; the planner's own largest moment is the
    first block's backward, 1.4% above."""
    import dataclasses

    from shardwise.planner.memory import simulator_categories
    from shardwise.simulate import config_from_plan, simulate_rank

    world = 1024
    cfg = config_from_plan("llama2-7b", "dp=1024,zero_stage=3,grad_accum=2", world, seq_len=4096, micro_batch=1,
                           precision="bf16")
    cfg.model = dataclasses.replace(cfg.model, n_layers=4)
    assert cfg.train.grad_accum == 2
    measured = simulate_rank(cfg, world, 0).peak_step
    training = Training(seq_len=4096, global_batch=2 * world, precision="bf16",
                        fragmentation=0.0, fixed_overhead_gib=0.0)
    plan = Plan(dp_shard=world, zero_stage=3, grad_accum=2)
    predicted = simulator_categories(stage_memory(cfg.model, training, plan, 0))
    assert predicted["total"] == pytest.approx(measured.peak_bytes, rel=0.05)
    # the kept gradients: every parameter's, in fp32, among the communication buffers
    kept = 4 * num_params(cfg.model)
    assert measured.peak["communication_buffers"] >= kept


# zero-bubble (ZB-V) on Llama 3 8B cut to 2 blocks per pipeline stage (4 per rank), tp 2 with SP x FSDP 4 at
# ZeRO-2 (the engine runs zero-bubble with ZeRO-2 at most): (pp, cp, pipeline micro-batches, micro-batch size,
# recompute); M = 2 is fewer micro-batches than the V's warm-up, so a rank's first stage has made no gradient yet
# at its fullest moment
ZERO_BUBBLE = [(2, 4, 4, 2, "none"), (2, 4, 4, 2, "full"), (4, 1, 8, 2, "full"), (2, 2, 2, 8, "full")]


@pytest.mark.parametrize("pp, cp, m, mb, recompute", ZERO_BUBBLE)
def test_zero_bubble_memory_matches_the_simulator(pp, cp, m, mb, recompute):
    """Every pipeline rank of a zero-bubble job within 10% of the simulator, as the other jobs above (the weight
    pass's rebuild under full recompute is the least certain term: 8.3% high on the small-M job's rank 1,
    within 3.3% elsewhere). The V puts the first and last stage
    on rank 0, whose last-stage micro-batch runs its forward, input and weight pass back to back (one in flight,
    not the P that 1F1B's count gives the head); the other ranks keep each micro-batch's graph from its input
    pass to its deferred weight pass, with the gradients the weight pass starts from, and the later ranks defer
    more of them; under full recompute a weight pass rebuilds its blocks once more. (Before the simulator's module
    tracker dropped its hooks, the graphs were not freed before the step's end and the middle ranks measured up
    to 1.75x this; before the planner counted a chunk's gradients from its first weight pass, the small-M job's
    rank 1 came out 19% low.)"""
    import dataclasses

    from shardwise.planner.memory import ranks_to_check, simulator_categories
    from shardwise.simulate import config_from_plan, simulate_rank

    world, tp, dp = 8 * pp * cp, 2, 4
    plan = Plan(tp=tp, pp=pp, cp=cp, dp_shard=dp, zero_stage=2, sequence_parallel=True, pp_schedule="zero-bubble",
                activation_checkpoint=recompute, micro_batch=mb, grad_accum=m)
    cfg = config_from_plan("llama3-8b", f"tp={tp},pp={pp},cp={cp},dp={dp},zero_stage=2,sequence_parallel=true,"
                           f"pp_schedule=zero-bubble,grad_accum={m},activation_checkpoint={recompute}", world,
                           seq_len=2048, micro_batch=mb, precision="bf16")
    cfg.model = dataclasses.replace(cfg.model, n_layers=4 * pp)
    assert cfg.parallel.n_microbatches == m
    training = Training(seq_len=2048, global_batch=mb * m * dp, precision="bf16",
                        fragmentation=0.0, fixed_overhead_gib=0.0)
    peaks = []
    for rank in range(pp):
        measured = simulate_rank(cfg, world, rank * world // pp).peak_step.peak_bytes
        predicted = simulator_categories(stage_memory(cfg.model, training, plan, rank))["total"]
        assert predicted == pytest.approx(measured, rel=0.10), rank
        peaks.append(predicted)
    # the ranks the planner checks hold the fullest one
    assert max(peaks[r] for r in ranks_to_check(cfg.model, plan, 2048)) == max(peaks)


# (schedule, pp, micro-batches, ZeRO stage): FSDP2 stages under torch.distributed.pipelining, full recompute
PIPELINED_FSDP = [("interleaved-1f1b", 2, 8, 2), ("interleaved-1f1b", 4, 8, 2), ("1f1b", 2, 8, 2)]


@pytest.mark.parametrize("schedule, pp, m, zero", PIPELINED_FSDP)
def test_pipelined_fsdp_memory_matches_the_simulator_on_every_rank(schedule, pp, m, zero):
    """Every rank of an FSDP2 pipeline within 3% of the simulator (Llama 3 8B cut to 4 blocks a rank, sequence
    2048, dp_shard 2). Two counts made that so (2026-11-27): an interleaved schedule's last rank holds the head of one
    micro-batch, not of every one in flight (torch's ScheduleInterleaved1F1B runs the last stage's backward after
    each of its forwards: the fused head's fp32 weight gradient was counted 2.5 times at pp 4, 0.87 of the
    simulator); and between a pipeline's micro-batches no sharded gradient exists yet at ZeRO-2 either (the first
    rank's embedding backward counted them: 0.90)."""
    from shardwise.planner.memory import simulator_categories
    from shardwise.simulate import config_from_plan, simulate_rank

    world, v = 2 * pp, 2 if schedule == "interleaved-1f1b" else 1
    cfg = config_from_plan("llama3-8b", f"pp={pp},dp_shard=2,zero_stage={zero},pp_schedule={schedule},"
                           f"virtual_stages={v},grad_accum={m},activation_checkpoint=full", world, seq_len=2048,
                           micro_batch=1, precision="bf16")
    cfg.model = dataclasses.replace(cfg.model, n_layers=4 * pp)
    plan = Plan(pp=pp, dp_shard=2, zero_stage=zero, pp_schedule=schedule, virtual_stages=v, micro_batch=1,
                grad_accum=m, activation_checkpoint="full")
    training = Training(seq_len=2048, global_batch=2 * m, precision="bf16", fragmentation=0.0, fixed_overhead_gib=0.0)
    for rank in range(pp):
        measured = simulate_rank(cfg, world, rank * 2).peak_step.peak_bytes
        predicted = simulator_categories(stage_memory(cfg.model, training, plan, rank))["total"]
        assert predicted == pytest.approx(measured, rel=0.03), rank


def test_first_stage_adds_a_whole_embedding_gradient_under_accumulation():
    """torch's dense embedding backward makes a gradient of the whole table and adds it to the one earlier
    micro-batches made: on Llama 3's 128K vocabulary, 2 GiB in fp32 on the first pipeline stage at the end of each
    micro-batch's backward (1F1B, tp 1 x pp 4 x cp 4, ZeRO-1, selective recompute, 32 micro-batches). That rank
    was 17% low before the planner counted it."""
    import dataclasses

    from shardwise.planner.memory import peak_moment, simulator_categories
    from shardwise.simulate import config_from_plan, simulate_rank

    world = 64
    cfg = config_from_plan("llama3-8b", "tp=1,pp=4,cp=4,dp=4,zero_stage=1,grad_accum=32,"
                           "activation_checkpoint=selective", world, seq_len=2048, micro_batch=1, precision="bf16")
    cfg.model = dataclasses.replace(cfg.model, n_layers=4)
    plan = Plan(pp=4, cp=4, dp_replicate=4, zero_stage=1, micro_batch=1, grad_accum=32,
                activation_checkpoint="selective")
    training = Training(seq_len=2048, global_batch=128, precision="bf16", fragmentation=0.0,
                        fixed_overhead_gib=0.0)
    measured = simulate_rank(cfg, world, 0).peak_step
    assert measured.modules == ["ReplicateTransformer.tok_embeddings"]
    predicted = simulator_categories(stage_memory(cfg.model, training, plan, 0))
    assert predicted["total"] == pytest.approx(measured.peak_bytes, rel=0.05)
    assert peak_moment(cfg.model, training, plan, 0) == "embedding_backward"


@pytest.mark.parametrize("precision, recompute", [("bf16", "none"), ("bf16", "selective"), ("bf16", "full"),
                                                  ("fp32", "none")])
def test_a_middle_stage_peaks_in_the_down_projections_backward_under_accumulation(precision, recompute):
    """A middle pipeline rank (1F1B, pp 3, 8 micro-batches, Llama 3 8B cut to 3 blocks) peaks inside its block's
    first matmul backward, w2's, once the gradients exist: w2's new weight gradient is made beside the one it is
    added to (fp32, 224 MiB), under autocast first in bf16 and then cast, and a recomputed block has cast all its
    weights again (416 MiB in bf16). Within 2% of the simulator; before the planner counted them (it took the
    gradients as added in place and the recast copies as free), 1.04 (fp32), 1.03 (bf16, no recompute) and 1.18
    (bf16, selective and full recompute) of it."""
    import dataclasses

    from shardwise.planner.memory import peak_moment, simulator_categories
    from shardwise.simulate import config_from_plan, simulate_rank

    world = 3
    cfg = config_from_plan("llama3-8b", f"pp=3,grad_accum=8,activation_checkpoint={recompute},pp_schedule=1f1b",
                           world, seq_len=2048, micro_batch=1, precision=precision)
    cfg.model = dataclasses.replace(cfg.model, n_layers=3)
    plan = Plan(pp=3, micro_batch=1, grad_accum=8, activation_checkpoint=recompute, pp_schedule="1f1b")
    training = Training(seq_len=2048, global_batch=8, precision=precision, fragmentation=0.0,
                        fixed_overhead_gib=0.0)
    measured = simulate_rank(cfg, world, 1).peak_step
    assert measured.modules == ["Transformer.layers.1.feed_forward.w2"] and measured.phase == "backward"
    predicted = simulator_categories(stage_memory(cfg.model, training, plan, 1))
    assert predicted["total"] == pytest.approx(measured.peak_bytes, rel=0.02)
    assert peak_moment(cfg.model, training, plan, 1) == "first_block_backward"


def test_an_fsdp_pipeline_keeps_its_stage_gathered_between_backwards():
    """ZeRO-3 under a pipeline (1F1B, pp 3 of one block each, FSDP over 2 ranks, full recompute, 8 micro-batches):
    a stage of one block gathers that block alone (no next block to prefetch), and torch's PipelineStage keeps the
    stage gathered after every backward but the step's last, so the first stage's embedding backward has its block
    there beside the root. Every rank within 3% of the simulator (the middle rank was 0.86 of the planner, the
    others 0.96-0.97, before)."""
    import dataclasses

    from shardwise.planner.memory import simulator_categories
    from shardwise.simulate import config_from_plan, simulate_rank

    world = 6
    cfg = config_from_plan("llama3-8b", "pp=3,dp_shard=2,zero_stage=3,grad_accum=8,activation_checkpoint=full,"
                           "pp_schedule=1f1b", world, seq_len=2048, micro_batch=1, precision="bf16")
    cfg.model = dataclasses.replace(cfg.model, n_layers=3)
    plan = Plan(pp=3, dp_shard=2, zero_stage=3, micro_batch=1, grad_accum=8, activation_checkpoint="full",
                pp_schedule="1f1b")
    training = Training(seq_len=2048, global_batch=16, precision="bf16", fragmentation=0.0,
                        fixed_overhead_gib=0.0)
    for stage in range(3):
        measured = simulate_rank(cfg, world, stage * 2).peak_step.peak_bytes
        predicted = simulator_categories(stage_memory(cfg.model, training, plan, stage))["total"]
        assert predicted == pytest.approx(measured, rel=0.03), stage


def test_zero_bubble_order_is_the_engines():
    """The planner's copy of ZB-V's order (timeline.zbv_order) is the one torch's schedule runs, rank by rank."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, _ComputationType

    from shardwise.planner.timeline import zbv_order

    kinds = {_ComputationType.FORWARD: "F", _ComputationType.BACKWARD_INPUT: "I",
             _ComputationType.BACKWARD_WEIGHT: "W"}
    for p in range(1, 6):
        for m in range(1, 13):
            # the order is computed before the schedule needs its stages (private: no public way to ask for it)
            schedule = object.__new__(ScheduleZBVZeroBubble)
            schedule.pp_group_size, schedule._n_microbatches, schedule.num_stages = p, m, 2 * p
            for rank in range(p):
                torch_order = [(kinds[a.computation_type], int(a.stage_index != rank), a.microbatch_index)
                               for a in schedule._calculate_single_rank_operations(rank) if a is not None]
                assert zbv_order(p, m, rank) == torch_order, (p, m, rank)


# LoRA and QLoRA recipes on a tiny model under FSDP (ZeRO-3 over 2 ranks): (config, overrides)
CONFIGS = Path(__file__).parent / "configs"
ADAPTED = [
    (CONFIGS / "parity.toml", ["lora.rank=4", "optim.name='adamw'"]),
    (CONFIGS / "qlora.toml", []),  # the NF4 base: each rank stores half of the 4-bit codes, scalers and factors
]
# some projections adapted (peft's default for Llama is q_proj and v_proj): the others frozen in the compute dtype,
# and under QLoRA not in NF4
SOME_TARGETS = "lora.targets=['wq', 'wv', 'w2']"


@pytest.mark.parametrize("config, overrides", [*ADAPTED, (ADAPTED[0][0], [*ADAPTED[0][1], SOME_TARGETS]),
                                               (ADAPTED[1][0], [SOME_TARGETS])],
                         ids=["lora", "qlora", "lora-some-targets", "qlora-some-targets"])
def test_adapter_model_state_matches_the_simulator_under_fsdp(config, overrides):
    """Bytes per rank of weights (frozen base, NF4 storage, adapters), adapter gradients and optimizer state,
    as the simulator's tracker sees the engine keep them between steps, against the planner's model state."""
    from shardwise.config import load_config
    from shardwise.planner.memory import moment_memory
    from shardwise.simulate import simulate_rank

    cfg = load_config(str(config), [*overrides, "parallel.dp_shard=2", "parallel.zero_stage=3"])
    measured = simulate_rank(cfg, 2, 0).peak_step.model_state
    t = cfg.train
    training = Training(seq_len=cfg.data.seq_len, global_batch=t.micro_batch * 2, precision=t.precision,
                        optimizer=cfg.optim.name, layout="torch", lora_rank=cfg.lora.rank,
                        qlora=cfg.lora.qlora, lora_targets=tuple(cfg.lora.targets), fragmentation=0.0,
                        fixed_overhead_gib=0.0)
    layout = Plan(**dataclasses.asdict(cfg.parallel), micro_batch=t.micro_batch, grad_accum=t.grad_accum)
    state = moment_memory(cfg.model, training, layout, 0)["optimizer_step"]  # model state and nothing else
    predicted = {"parameters": state["params"], "gradients": state["grads"],
                 "optimizer_state": state["master_weights"] + state["optimizer_state"]}
    for category, value in predicted.items():
        assert value > 0 and measured[category] == pytest.approx(value, rel=0.05), category


@pytest.mark.parametrize("config, overrides, zero", [(*ADAPTED[0], 2), (*ADAPTED[0], 3), (*ADAPTED[1], 2),
                                                   (ADAPTED[1][0], [SOME_TARGETS], 2)],
                         ids=["lora-zero2", "lora-zero3", "qlora-zero2", "qlora-some-targets-zero2"])
def test_adapter_fsdp_buffers_match_the_simulator_under_autocast(config, overrides, zero):
    """What FSDP gathers of a LoRA model under bf16 autocast: the frozen projections as the engine stores them
    (bf16, or QLoRA's NF4 codes), the embedding, norms and adapters in fp32. The planner priced every gathered
    weight at fp32: 1.6x (LoRA, ZeRO-2), 1.5x (ZeRO-3) and 4.8x (QLoRA) the simulator's buffers, and a Llama 3.2
    1B LoRA plan's total at 1.39x. Compared at the simulator's peak (ZeRO-2 keeps the whole stage gathered; at
    ZeRO-3's the root and the running block are)."""
    from shardwise.config import load_config
    from shardwise.simulate import planner_prediction, simulate_rank

    cfg = load_config(str(config), [*overrides, "parallel.dp_shard=2", f"parallel.zero_stage={zero}",
                                    "train.precision='bf16'"])
    measured = simulate_rank(cfg, 2, 0).peak_step.peak["communication_buffers"]
    # the head's forward, the simulator's peak (QLoRA's own is the NF4 rebuild of a w2 in backward, where the last
    # block's buffer is gone)
    predicted = planner_prediction(cfg, 0, "loss_backward")["communication_buffers"]
    assert measured > 0 and predicted == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("model, sets", [("llama3-8b", []), ("llama3-8b", ["lora.qlora=true"]),
                                         ("llama3.2-1b", []), ("llama3-8b", ["lora.qlora=true", SOME_TARGETS])],
                         ids=["lora", "qlora", "lora-tied-head", "qlora-some-targets"])
def test_an_adapted_models_peak_matches_the_simulator(model, sets):
    """LoRA under bf16 autocast on one device, two blocks of the model: the peak's activations and temporaries, and
    the total, within 5% of the simulator. The planner counted a frozen head's weight-gradient product and its
    compute-dtype copy (LoRA stores the head in that dtype; a tied head is the fp32 embedding's, which is cast):
    Llama 3 8B's activations were 2.7x the simulator's; and none of QLoRA's NF4 rebuild of w2 in its backward
    (NF4_DEQUANT_BYTES), 1.16 GiB of temporaries."""
    import dataclasses

    from shardwise.config import with_overrides
    from shardwise.simulate import config_from_plan, planner_prediction, simulate_rank

    cfg = with_overrides(config_from_plan(model, "dp=1", 1, seq_len=2048, micro_batch=1, precision="bf16"),
                         ["lora.rank=16", *sets])
    cfg.model = dataclasses.replace(cfg.model, n_layers=2)
    measured, predicted = simulate_rank(cfg, 1, 0).peak_step, planner_prediction(cfg, 0)
    assert predicted["total"] == pytest.approx(measured.peak_bytes, rel=0.05)
    for category in ("activations", "temporaries"):
        assert predicted[category] == pytest.approx(measured.peak[category], rel=0.05, abs=0.02 * 2**30), category


@pytest.mark.multiprocess
def test_pipeline_memory_matches_the_simulator_with_few_blocks_per_stage():
    """Llama 3 70B cut to 8 blocks on tp 8 x pp 4 x FSDP 32, 8 micro-batches of 4096 tokens (1F1B): two blocks
    per stage, so the per-stage terms (the pipeline's receive buffers, one per micro-batch; the embedding and
    the head) weigh as much as the blocks. First, a middle and the last stage within 10% of the simulator."""
    from shardwise.simulate import config_from_plan, simulate

    cfg = config_from_plan("llama3-70b", "tp=8,pp=4,dp=32,zero_stage=3,grad_accum=8", 1024, seq_len=4096,
                           micro_batch=1, precision="bf16")
    cfg.model = dataclasses.replace(cfg.model, n_layers=8)
    assert cfg.parallel.n_microbatches == 8 and cfg.train.micro_batch == 8
    reports = simulate(cfg, 1024, processes=2)
    assert sorted(r.coordinates["pp"] for r in reports) == [0, 2, 3]
    for r in reports:  # simulate attaches the planner's prediction for the rank's stage
        assert r.peak_step.peak_bytes == pytest.approx(r.planner["total"], rel=0.10), r.coordinates


# ---------------------------------------------------------------------------------------------------
# Pipeline stages: the planner sizes the stages the engine builds


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble"])
def test_pipeline_ranks_hold_the_engines_cost_balanced_stages(schedule):
    """A 2,048-token vocabulary makes the output head cost about 2.3 blocks, so the engine's split is uneven
    (1f1b: 4 + 2 blocks where an even cut gives 3 + 3; zero-bubble's V: 1, 2, 2, 1 with the first and last stage
    on rank 0). Each rank's parameters, as the planner counts them, are those of the stage modules the engine
    builds for it (deep copies of the meta model with the other layers deleted)."""
    from shardwise.layout import layer_costs, split_layers, stages_of_rank
    from shardwise.model_args import ModelArgs
    from shardwise.parallel.pipeline import build_stage_module
    from shardwise.planner.memory import stage_layers, stage_params

    args = ModelArgs(dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=2048)
    seq, pp = 64, 2
    plan = Plan(pp=pp, micro_batch=1, grad_accum=4, pp_schedule=schedule)
    training = Training(seq_len=seq, global_batch=4, precision="fp32", fragmentation=0.0, fixed_overhead_gib=0.0)
    per_rank = 2 if schedule == "zero-bubble" else 1
    split = split_layers(layer_costs(args, seq), pp * per_rank)  # as pipeline.build_pipeline cuts the model
    meta = build_model(args)
    layers = []
    for rank in range(pp):
        stages = stages_of_rank(schedule, pp, rank, per_rank)
        modules = [build_stage_module(meta, split[s], s == 0, s == len(split) - 1) for s in stages]
        built = sum(p.numel() for m in modules for p in m.parameters())
        layers.append(sum(len(m.layers) for m in modules))
        assert stage_layers(args, plan, rank, seq) == layers[-1]
        assert stage_params(args, plan, rank, seq) == built
        assert stage_memory(args, training, plan, rank)["params"] == 4 * built  # fp32 weights, no ZeRO
    assert sorted(layers) == [2, 4]  # uneven: an even split would have put 3 blocks on each rank


def test_pipeline_time_follows_the_rank_with_the_most_blocks():
    """With a 1,024-token vocabulary (head ~1.2 blocks) the engine cuts 6 blocks over 3 stages as 2, 3, 1 + head:
    the middle rank, neither the first nor the one with the head, sets the pipeline's pace."""
    from shardwise.model_args import ModelArgs
    from shardwise.planner.memory import pipeline_layers
    from shardwise.planner.timing import _stage_cost, stage_cost

    args = ModelArgs(dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=1024)
    plan = Plan(pp=3, micro_batch=1, grad_accum=4, pp_schedule="1f1b")
    training = Training(seq_len=64, global_batch=4, precision="fp32")
    cluster = Cluster(accelerator("h100"), 3, gpus_per_node=3)
    assert pipeline_layers(args, plan, 64) == (2, 3, 1)
    per_rank = [_stage_cost(args, training, plan, cluster, r).total for r in range(3)]
    assert per_rank[1] > max(per_rank[0], per_rank[2])
    assert stage_cost(args, training, plan, cluster).total == per_rank[1]


# ---------------------------------------------------------------------------------------------------
# Per-operator overhead and per-collective bandwidths


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_block_operator_count_is_the_blocks_own_forward_and_backward(precision):
    # opcount takes a block's operators as the difference between a 2-block and a 1-block model; counted here on
    # a lone block instead (its input needs a gradient, as inside the model), at another size; under bf16's
    # autocast the block casts its weights and its fp32 matmul inputs, and backward their gradients
    from shardwise.model import TransformerBlock
    from shardwise.model_args import ModelArgs
    from shardwise.planner.operators import op_counts

    args = ModelArgs(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=32)
    block = TransformerBlock(args)
    assert block_op_calls(block, args, precision=precision) == op_counts(args, precision != "fp32").block
    if precision != "fp32":
        # 7 weights and 5 norm outputs cast and their gradients cast back, RoPE's 2 tables, and the gradients of
        # wo's and w2's bf16 outputs, added into the fp32 residual stream, cast to bf16
        assert op_counts(args, True).block == op_counts(args).block + 2 * 7 + 2 * 5 + 2 + 2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_operator_counts_are_what_the_lora_model_dispatches(dropout, precision):
    """LoRA's operator counts are read from a table (operators.LORA_OPS), counted on one and seven adapters a block;
    counted again they are the table's, and they give the operators of a LoRA block with another number of
    adapters, at another size, counted on that block alone (its input needs a gradient, as inside the model)
    exactly, and of a whole LoRA model within what its first block's backward may skip (LoraOps.rest). The
    planner charges them: a LoRA step's per-operator time is its blocks' and the rest's count times the cost per
    operator, and its optimizer steps over the adapters' tensors only. Under bf16's autocast an adapter on a
    norm's fp32 output (wq, wk, wv, w1, w3) casts that input again, forward and backward."""
    from shardwise.config import LoraConfig
    from shardwise.lora import apply_lora
    from shardwise.model import Transformer
    from shardwise.planner.opcount import OpCounter, lora_op_counts, micro_batch
    from shardwise.planner.operators import LORA_OPS, op_counts, optimizer_ops

    autocast = precision != "fp32"
    lora = LORA_OPS[dropout > 0, autocast]
    assert lora_op_counts(dropout > 0, precision) == lora
    assert lora.input_cast == (2 if autocast else 0)
    # counted on a lone module (an fp32 input), an adapted linear is a frozen one plus what an adapter on an fp32
    # input adds to a whole block
    assert lora.adapted_linear == lora.frozen_linear + lora.per_adapter + lora.input_cast
    args = ModelArgs(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, vocab_size=128, max_seq_len=32)
    dense = op_counts(args, autocast)
    for targets, casts in ((("wk", "wo", "w3"), 2), (("w2",), 0)):
        model = Transformer(dataclasses.replace(args, n_layers=3))
        apply_lora(model, LoraConfig(rank=4, dropout=dropout, targets=list(targets)), torch.float32)
        materialize(model, model.args, "cpu", 0)
        block = dense.block - lora.frozen_block + len(targets) * lora.per_adapter + casts * lora.input_cast
        assert block_op_calls(model.layers["1"], args, precision=precision) == block
        micro_batch(model, model.args, precision)  # warm-up
        with OpCounter() as whole:
            micro_batch(model, model.args, precision)
        assert abs(whole.calls - (3 * block + dense.rest + lora.rest)) <= 60

    model, plan = preset("tiny"), Plan(micro_batch=8)
    base = dataclasses.replace(accelerator("h100"), op_overhead_s=0.0, optimizer_op_overhead_s=0.0,
                               launch_async=False)
    targets = ("wq", "wv")
    train = Training(seq_len=128, global_batch=8, precision=precision, lora_rank=8, lora_targets=targets,
                     lora_dropout=dropout)

    def time(**kw):
        return evaluate(model, train, plan, Cluster(dataclasses.replace(base, **kw), 1)).time

    per_op = 1e-5
    # wq and wv take the attention norm's output
    ops = (model.n_layers * (dense.block - lora.frozen_block + 2 * (lora.per_adapter + lora.input_cast))
           + dense.rest + lora.rest)
    assert time(op_overhead_s=per_op).step_time_s - time().step_time_s == pytest.approx(ops * per_op)
    extra = time(optimizer_op_overhead_s=per_op).optimizer_s - time().optimizer_s
    assert extra == pytest.approx(optimizer_ops(dense, model.n_layers * 2 * len(targets), looped=True) * per_op)
    # under tp each projection runs on DTensors: the two adapted ones with their adapters, the five others frozen
    tp = Plan(tp=2, micro_batch=8)
    step = [evaluate(model, train, tp, Cluster(dataclasses.replace(base, dtensor_op_overhead_s=s), 2)).time
            for s in (0.0, per_op)]
    projections = 2 * lora.adapted_linear + 5 * lora.frozen_linear
    assert step[1].step_time_s - step[0].step_time_s == pytest.approx(model.n_layers * projections * per_op)


def test_optimizer_traffic_per_parameter_holds_at_another_size():
    """opcount counts the bytes the engine's optimizer step (gradient norm, clipping, fused AdamW, zero_grad)
    reads and writes per parameter on one extra tiny block; a whole model of another shape, counted directly,
    moves the same per parameter. By hand, in fp32 words per parameter (read + written): norm 1, clip 1+1, and
    torch 2.13's fused AdamW 4+4 (weights, gradients and both moments read; weights, both moments and, as its
    schema marks them mutable for its in-place unscaling, the gradients written): 11 words, 44 bytes (a foreach
    AdamW, a pass per operation, moved 96)."""
    from shardwise.config import OptimConfig
    from shardwise.model import Transformer
    from shardwise.model_args import ModelArgs
    from shardwise.optim import build_optimizer
    from shardwise.planner.opcount import OpCounter, micro_batch, optimizer_step
    from shardwise.planner.operators import op_counts

    args = ModelArgs(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, vocab_size=128, n_layers=3, max_seq_len=16)
    model = Transformer(args)
    optimizer = build_optimizer(model, OptimConfig(), lr=1e-3)
    for _ in range(2):  # the first step creates the moments
        micro_batch(model, args)
        with OpCounter() as step:
            optimizer_step(model, optimizer)
    per_param = step.bytes / sum(p.numel() for p in model.parameters())
    assert per_param == pytest.approx(op_counts(args).optimizer_bytes_per_param, rel=0.05)
    assert per_param == pytest.approx(44, rel=0.02)  # the scalars (norms, step counts) are the 2%


def test_attention_efficiency_by_shape_interpolates_the_measured_grid():
    acc = dataclasses.replace(accelerator("h100"), attention_efficiency=0.5,
                              attention_by_shape={"128,32": 0.2, "128,128": 0.4, "2048,32": 0.6, "2048,128": 0.8})
    assert acc.attention_eff(128, 32) == pytest.approx(0.2) and acc.attention_eff(2048, 128) == pytest.approx(0.8)
    assert acc.attention_eff(512, 64) == pytest.approx(0.5 * (0.2 + 0.4) / 2 + 0.5 * (0.6 + 0.8) / 2)
    assert acc.attention_eff(64, 16) == pytest.approx(0.2) and acc.attention_eff(8192, 256) == pytest.approx(0.8)
    # without a measured table: the kernel's published share on that GPU generation, else attention_efficiency
    h100, a100 = accelerator("h100"), accelerator("a100-80gb")
    # FlashAttention-2 on an H100, causal, head dim 128, 8K (flash-attention PR #1791): 284.1 TFLOP/s forward and
    # 287.1 backward, the backward 2.5 x the forward's FLOPs, against the SXM's 989.4
    assert 3.5 / (1 / 284.1 + 2.5 / 287.1) / 989.4 == pytest.approx(0.289, abs=5e-4)
    assert h100.attention_eff(512, 64) == 0.289
    assert h100.attention_eff(512, 64, "flash1") == pytest.approx(0.325 * 0.289 / 0.615)  # 0.153
    assert a100.attention_eff(512, 64, "flash1") == pytest.approx((0.25 + 0.40) / 2)  # FlashAttention-2's paper
    assert a100.attention_eff(512, 64, "flash2") == pytest.approx((0.50 + 0.73) / 2)
    # FlashAttention-3 on an H100, causal, head dim 128, 8K, batch 4 x 48 heads (TritonBench PR #1267): 4,817.44 us
    # forward, 15,308.16 us backward; causal forward FLOPs 2 B H s^2 d, backward 2.5 x that
    forward_flops = 2 * 4 * 48 * 8192 ** 2 * 128
    assert 3.5 * forward_flops / ((4817.44 + 15308.16) * 1e-6) / 989.4e12 == pytest.approx(0.580, abs=5e-4)
    assert h100.attention_eff(512, 64, "flash3") == accelerator("h200").attention_eff(512, 64, "flash3") == 0.58
    assert a100.attention_eff(512, 64, "flash3") == a100.attention_efficiency  # Hopper's kernel: no Ampere figure
    # cuDNN's fused attention on an H100 (Transformer Engine's attention tutorial, benchmark_attention.py test_3,
    # cuDNN 9.3): batch 2 x 32 heads, head dim 128, 8K, causal, 7.4875 ms forward + backward; flash-attn 2.4.2 took
    # 11.8879 ms in the same run, within 13% of the share above
    cudnn_flops = 3.5 * 2 * 2 * 32 * 8192 ** 2 * 128
    assert cudnn_flops / 7.4875e-3 / 989.4e12 == pytest.approx(0.519, abs=5e-4)
    assert h100.attention_eff(512, 64, "cudnn") == accelerator("h200").attention_eff(512, 64, "cudnn") == 0.519
    assert cudnn_flops / 11.8879e-3 / 989.4e12 == pytest.approx(0.289, rel=0.14)
    assert a100.attention_eff(512, 64, "cudnn") == a100.attention_efficiency


def test_op_overhead_adds_on_a_cpu_and_hides_behind_kernels_on_a_gpu():
    from shardwise.planner.operators import op_counts

    model, train = preset("tiny"), Training(seq_len=128, global_batch=8, precision="fp32")
    plan = Plan(micro_batch=8)
    c = op_counts(model)
    base = dataclasses.replace(accelerator("h100"), op_overhead_s=0.0, optimizer_op_overhead_s=0.0,
                               launch_async=False)

    def step(**kw):
        return evaluate(model, train, plan, Cluster(dataclasses.replace(base, **kw), 1)).time.step_time_s

    per_op = 1e-5
    ops = model.n_layers * c.block + c.rest
    assert step(op_overhead_s=per_op) - step() == pytest.approx(ops * per_op)
    # asynchronous launches: only the part beyond the micro-batch's compute shows (a GPU's compute: its norms are
    # torch's fused kernel, a CPU's the engine's own)
    compute = evaluate(model, train, plan, Cluster(dataclasses.replace(base, launch_async=True), 1)).time.compute_s
    assert step(op_overhead_s=per_op, launch_async=True) - step(launch_async=True) == pytest.approx(
        max(0.0, ops * per_op - compute))
    assert step(op_overhead_s=2 * compute / ops, launch_async=True) - step(launch_async=True) == pytest.approx(
        compute)


@pytest.mark.parametrize("plan, dtensors", [
    (Plan(micro_batch=8), False), (Plan(pp=2, micro_batch=4, grad_accum=2, pp_schedule="1f1b"), False),
    (Plan(dp_replicate=2, micro_batch=4), True), (Plan(dp_shard=2, zero_stage=3, micro_batch=4), True),
    (Plan(tp=2, micro_batch=8), True)])
def test_dtensor_overheads_are_paid_where_the_engine_makes_dtensors(plan, dtensors):
    """FSDP2's replicate and fully_shard and tensor parallelism make every parameter a DTensor: the optimizer step
    pays the measured extra per operator over all its operators (a CPU's foreach loops: one per tensor); a pure
    pipeline's parameters stay plain. Forward and backward pay theirs only under tp, on its 7 projections a
    block."""
    from shardwise.planner.operators import op_counts, optimizer_ops

    model, train = preset("tiny"), Training(seq_len=128, global_batch=8, precision="fp32")
    base = dataclasses.replace(accelerator("h100"), launch_async=False)
    c = op_counts(model)

    def time(**kw):
        return evaluate(model, train, plan, Cluster(dataclasses.replace(base, **kw), plan.world)).time

    per_op = 1e-5
    tensors = model.n_layers // plan.pp * c.tensors_per_block + c.tensors_rest
    extra = time(dtensor_optimizer_op_overhead_s=per_op).optimizer_s - time().optimizer_s
    assert extra == pytest.approx(optimizer_ops(c, tensors, looped=True) * per_op if dtensors else 0.0)
    step = time(dtensor_op_overhead_s=per_op).step_time_s - time().step_time_s
    assert step == pytest.approx(model.n_layers * 7 * c.linear * per_op if plan.tp > 1 else 0.0)


def test_data_parallel_units_pay_their_measured_host_cost():
    """Per micro-batch, each unit the engine wraps: fully_shard a unit per block and the root; replicate a unit
    per bucket of blocks (grouped as `data_parallel._buckets` groups them, by global fp32 bytes) and the root;
    nothing without data parallelism, for the other stacks, or where the host runs ahead of the device."""
    from shardwise.parallel.data_parallel import _buckets
    from shardwise.planner.timing import dp_unit_overhead

    args = ModelArgs(name="small", dim=256, n_layers=16, n_heads=8, n_kv_heads=4, ffn_hidden=768, vocab_size=320,
                     max_seq_len=128)
    train = Training(seq_len=128, global_batch=64)
    acc = dataclasses.replace(accelerator("h100"), launch_async=False, replicate_unit_overhead_s=1.0,
                              zero2_unit_overhead_s=10.0, zero3_unit_overhead_s=100.0)
    blocks = list(build_model(args).layers.values())
    buckets = len(_buckets(blocks, train.ddp_bucket_mb))
    assert 1 < buckets < args.n_layers  # several blocks a bucket, several buckets
    for tp in (1, 2):
        assert dp_unit_overhead(args, train, Plan(dp_replicate=8, tp=tp), acc) == buckets + 1
    assert dp_unit_overhead(args, train, Plan(dp_shard=8, zero_stage=2), acc) == 10.0 * (args.n_layers + 1)
    assert dp_unit_overhead(args, train, Plan(dp_shard=8, zero_stage=3, pp=2, pp_schedule="1f1b"), acc) == (
        100.0 * (args.n_layers // 2 + 1))
    assert dp_unit_overhead(args, train, Plan(tp=8), acc) == 0.0
    assert dp_unit_overhead(args, dataclasses.replace(train, layout="zero"), Plan(dp_shard=8, zero_stage=3), acc) == 0
    assert dp_unit_overhead(args, train, Plan(dp_shard=8, zero_stage=3),
                            dataclasses.replace(acc, launch_async=True)) == 0.0
    # and it reaches the step, once per micro-batch
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=2, grad_accum=4)
    base = dataclasses.replace(acc, zero3_unit_overhead_s=0.0)
    with_hooks, without = (evaluate(args, train, plan, Cluster(a, 8)).time for a in (acc, base))
    assert with_hooks.step_time_s - without.step_time_s == pytest.approx(4 * 100.0 * (args.n_layers + 1))


@pytest.mark.parametrize("layout", ["torch", "zero", "megatron"])
def test_zero3_traffic_per_step_follows_each_stack(layout):
    """ZeRO-3 over 8 ranks with 4 micro-batches, on a link of 1 byte/s without latency (seconds = bytes a rank
    sends): weights gathered for every micro-batch's forward and backward; gradients reduce-scattered once per
    step by shardwise's engine (FSDP2 without gradient sync until the last micro-batch; its root, embedding +
    norm + head, is not gathered again in backward), in every backward by DeepSpeed and by Megatron-FSDP (whose
    gradient buffer holds only the shard)."""
    args = preset("llama3-8b")
    unit = dataclasses.replace(accelerator("h100"), intra_node_bw=1.0, comm_efficiency=1.0, intra_node_latency=0.0)
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=4)
    training = Training(seq_len=4096, global_batch=32, layout=layout)
    t = evaluate(args, training, plan, Cluster(unit, 8)).time
    psi, ring = num_params(args), 7 / 8
    # as stored: the engine's weights and gradients are fp32 (autocast casts per use), the ZeRO paper's bf16,
    # Megatron's bf16 weights with fp32 gradients
    weight_bytes, grad_bytes = (4, 4) if layout == "torch" else (2, 2 if layout == "zero" else 4)
    root = 2 * args.vocab_size * args.dim + args.dim
    gathers = 4 * (2 * psi - (root if layout == "torch" else 0)) * weight_bytes
    reductions = (1 if layout == "torch" else 4) * psi * grad_bytes
    assert t.comm_total_s == pytest.approx((gathers + reductions) * ring, rel=1e-9)


# (ZeRO stage, blocks per stage, pp, micro-batches)
PIPELINED_GATHERS = [(3, 4, 2, 8), (2, 4, 2, 8), (3, 2, 4, 8)]


@pytest.mark.parametrize("zero, blocks, pp, m", PIPELINED_GATHERS)
def test_pipelined_fsdp_traffic_is_the_simulators(zero, blocks, pp, m):
    """FSDP2 stages in a pipeline keep their blocks gathered after each backward (torch.distributed.pipelining):
    ZeRO-2 gathers every unit once per step, ZeRO-3 every unit for the step's first forward and the blocks again
    for each micro-batch's backward. On a link of 1 byte/s (seconds = bytes a rank sends) the planner's
    data-parallel traffic is the simulator's on its busiest rank, the one the planner prices, within 10% (exact at
    pp 2; at pp 4 the busiest rank gathers a block a micro-batch less than the planner's count). Until 2026-11-27
    the planner gathered every unit for every micro-batch's forward and the blocks again in backward: about twice
    the engine's traffic."""
    from shardwise.simulate import config_from_plan, simulate_rank

    world = 4 * pp
    cfg = config_from_plan("llama3-8b", f"pp={pp},dp_shard=4,zero_stage={zero},grad_accum={m},pp_schedule=1f1b",
                           world, seq_len=1024, micro_batch=m, precision="bf16")
    cfg.model = dataclasses.replace(cfg.model, n_layers=pp * blocks)
    unit = dataclasses.replace(accelerator("h100"), intra_node_bw=1.0, inter_node_bw=1.0, comm_efficiency=1.0,
                               intra_node_latency=0.0, inter_node_latency=0.0)
    plan = Plan(pp=pp, dp_shard=4, zero_stage=zero, pp_schedule="1f1b", micro_batch=1, grad_accum=m)
    planned = evaluate(cfg.model, Training(seq_len=1024, global_batch=4 * m), plan,
                       Cluster(unit, world, gpus_per_node=world)).time.detail["dp_comm_s"]
    measured = []
    for rank in range(pp):
        c = simulate_rank(cfg, world, rank * 4).steps[-1].collectives
        measured.append(c["all_gather"]["wire_bytes"] + c["reduce_scatter"]["wire_bytes"])
    assert planned == pytest.approx(max(measured), rel=0.10)
    assert planned >= max(measured) * 0.999


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_deepspeed_2021_zero3_traffic_module_by_module(recompute):
    """DeepSpeed's first ZeRO-3 (v0.3.13: Training.zero3_fetch 'module-sync') on a GPT-3 175B block, 8 ranks, 2
    micro-batches, a link of 1 byte/s without latency (seconds = bytes a rank sends): every micro-batch gathers
    the four linears' weights for forward; with full recompute again for the recomputed forward, and again in
    backward all but the last one (QKV, out and fc1 are used again more than stage3_max_reuse_distance = 1e9
    elements later: 2 x (4 + 4) h^2 = 1.2e9 for fc1; fc2's backward follows its recomputed forward at once);
    without recompute all four again in backward. Gradients are reduce-scattered in every backward, and the
    embedding is gathered for forward and backward. The blocks' norms stay whole (DeepSpeed's
    param_persistence_threshold, 1e5 elements)."""
    h, layers, vocab = 12288, 4, 51200
    args = ModelArgs(dim=h, n_heads=96, n_kv_heads=96, n_layers=layers, vocab_size=vocab, ffn_hidden=4 * h,
                     mlp="gelu", tie_embeddings=True)
    unit = dataclasses.replace(accelerator("a100-80gb"), intra_node_bw=1.0, comm_efficiency=1.0,
                               intra_node_latency=0.0, intra_node_fabric="")
    training = Training(seq_len=2048, global_batch=16, layout="zero", zero3_fetch="module-sync")
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=2, activation_checkpoint=recompute)
    t = evaluate(args, training, plan, Cluster(unit, 8)).time
    linears = 12 * h * h
    gathered = linears * (3 - 4 / 12 if recompute == "full" else 2)
    rest = num_params(args) - layers * (linears + 2 * h)  # the embedding (tied) and the final norm
    per_micro_batch = 2 * (layers * (gathered + linears) + 3 * rest)  # bf16 weights and gradients
    assert t.comm_total_s == pytest.approx(2 * per_micro_batch * 7 / 8, rel=1e-9)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_deepspeed_2021_zero3_holds_two_modules_gathered(recompute):
    """DeepSpeed's first ZeRO-3 gathers module by module, one ahead, and releases each after use (v0.3.13's
    stage3.py; fc2 kept from its recomputation to its backward is the running module then): the largest gathered
    set is two neighbouring linears in bf16, fc1 and fc2 of a GELU MLP (4h^2 each), and nothing of the root stays
    gathered. FSDP's ZeRO-3 (prefetch) holds the running block and the next, and the root."""
    h, layers, vocab = 12288, 4, 51200
    args = ModelArgs(dim=h, n_heads=96, n_kv_heads=96, n_layers=layers, vocab_size=vocab, ffn_hidden=4 * h,
                     mlp="gelu", tie_embeddings=True)
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=2, activation_checkpoint=recompute)
    held = {fetch: evaluate(args, Training(seq_len=2048, global_batch=16, layout="zero", zero3_fetch=fetch), plan,
                            Cluster(accelerator("a100-80gb"), 8)).memory["fsdp_buffers"]
            for fetch in ("module-sync", "prefetch")}
    assert held["module-sync"] == pytest.approx(2 * 4 * h * h * 2)
    assert held["prefetch"] == pytest.approx((2 * (12 * h * h + 2 * h) + vocab * h + h) * 2, rel=1e-9)


def test_engine_collectives_are_one_per_fsdp_unit_or_bucket():
    """On a link with latency only (seconds = collectives x steps x 1 s): FSDP2's ZeRO-3 gathers each block and the
    root in forward, each block again in backward, and reduce-scatters each block and the root, (N-1) ring steps
    each; replicate (ZeRO-0) all-reduces one bucket per block here (a Llama 3 8B block's gradients exceed the
    25 MB bucket) and the root, each a tree of 2 log2 N steps (cheaper than the ring's 2(N-1) at this size). Then
    the loss's all-reduce, and the gradient norm's where the gradients are sharded."""
    args = preset("llama3-8b")
    alpha = dataclasses.replace(accelerator("h100"), intra_node_bw=math.inf, intra_node_latency=1.0,
                                intra_node_fabric="")  # the alpha-beta model, not NCCL's latencies
    training, blocks = Training(seq_len=4096, global_batch=8), args.n_layers
    zero3 = evaluate(args, training, Plan(dp_shard=8, zero_stage=3, micro_batch=1), Cluster(alpha, 8)).time
    # and the step's scalar all-reduces, trees of 2 log2 N steps: the loss, and under ZeRO-3 the gradient norm
    assert zero3.comm_total_s == pytest.approx(((blocks + 1) + blocks + (blocks + 1)) * 7 + 2 * 2 * 3)
    zero0 = evaluate(args, training, Plan(dp_replicate=8, micro_batch=1), Cluster(alpha, 8)).time
    assert zero0.comm_total_s == pytest.approx((blocks + 1) * 2 * 3 + 2 * 3)


def test_megatron_pipeline_sends_scatter_over_tensor_parallel_ranks():
    """Megatron's scatter/gather (Narayanan et al. 2021, 4.1): without sequence parallelism each tp rank sends
    1/t of the activations across stages and the stage all-gathers them over tp; shardwise's engine sends them
    whole from every tp rank."""
    from shardwise.planner.timing import stage_cost

    args = preset("llama3-70b")
    unit = dataclasses.replace(accelerator("h100"), intra_node_bw=1.0, inter_node_bw=1.0, comm_efficiency=1.0,
                               intra_node_latency=0.0, inter_node_latency=0.0)
    plan = Plan(tp=8, pp=4, micro_batch=1, grad_accum=8, pp_schedule="1f1b")
    x = 4096 * args.dim  # one micro-batch's residual stream: fp32 in the engine (autocast), bf16 in Megatron
    sent = {layout: stage_cost(args, Training(seq_len=4096, global_batch=8, layout=layout), plan,
                               Cluster(unit, 32)).pp_p2p for layout in ("torch", "megatron")}
    assert sent["torch"] == pytest.approx(2 * 4 * x)
    assert sent["megatron"] == pytest.approx(2 * (2 * x / 8 + 2 * x * 7 / 8))


@pytest.mark.parametrize("fuse_head, loss_parallel, gathers", [(None, False, False), (False, False, True),
                                                                 (False, True, False)])
def test_tensor_parallel_traffic_per_micro_batch(fuse_head, loss_parallel, gathers):
    """tp 8 on a link of 1 byte/s without latency (seconds = bytes a rank sends): 4 all-reduces of the hidden
    activations per block, one for the embedding's partial lookups, one for the head's input gradient, and,
    unless the loss runs on vocabulary-parallel logits (loss_parallel, or the engine's fused head), the logits
    all-gathered to every rank (the engine's output head does where it runs its own forward:
    `ColwiseParallel(output_layouts=Replicate())`)."""
    from shardwise.planner.timing import stage_cost

    args = preset("llama3-8b")
    unit = dataclasses.replace(accelerator("h100"), intra_node_bw=1.0, comm_efficiency=1.0, intra_node_latency=0.0)
    training = Training(seq_len=4096, global_batch=1, fuse_head=fuse_head, loss_parallel=loss_parallel)
    cost = stage_cost(args, training, Plan(tp=8, micro_batch=1), Cluster(unit, 8))
    x = 4096 * args.dim * 2  # bf16 activations of one micro-batch
    logits = 4096 * args.vocab_size * 2 * 7 / 8 if gathers else 0.0
    assert cost.tp_comm == pytest.approx((4 * args.n_layers + 2) * 2 * x * 7 / 8 + logits)


def test_measured_bus_bandwidth_curves_price_each_collective_by_size():
    """A profile's curves (bus bandwidth by message size, per collective) reproduce the measured times at the
    measured sizes, interpolate the time linearly between them, keep the smallest's time below it and the
    largest's bandwidth beyond it; other group sizes follow nccl-tests' bus factors; the network tier keeps the
    curve's shape at its own bandwidth."""
    from shardwise.planner.comm import all_gather, all_reduce, group_link, reduce_scatter

    curves = {"all_reduce": {2**20: 1e9, 2**24: 3e9}, "all_gather": {2**20: 0.5e9, 2**24: 2e9},
              "reduce_scatter": {2**20: 0.25e9, 2**24: 1e9}}
    acc = dataclasses.replace(accelerator("h100"), comm_efficiency=1.0, intra_node_bw=3e9, inter_node_bw=1e9,
                              busbw_curves=curves)
    link = group_link(2, 1, Cluster(acc, 2, gpus_per_node=2))
    # at the measured sizes, over 2 ranks: time = factor x X / busbw (factor 1 for all-reduce, 1/2 for the others)
    for op, fn, factor in ((all_reduce, "all_reduce", 1.0), (all_gather, "all_gather", 0.5),
                           (reduce_scatter, "reduce_scatter", 0.5)):
        for size, busbw in curves[fn].items():
            assert op(size, 2, link) == pytest.approx(factor * size / busbw)
    small, big = 2**20 / 1e9, 2**24 / 3e9  # all-reduce seconds at the two sizes, 2 ranks
    mid = (2**20 + 2**24) / 2
    assert all_reduce(mid, 2, link) == pytest.approx((small + big) / 2)
    assert all_reduce(16, 2, link) == pytest.approx(small)
    assert all_reduce(2**26, 2, link) == pytest.approx(4 * big)
    # 8 ranks: bus factor 2 x 7/8 instead of 1
    assert all_reduce(2**24, 8, group_link(8, 1, Cluster(acc, 8, gpus_per_node=8))) == pytest.approx(1.75 * big)
    # across nodes: the same curve at inter/intra = 1/3 of the bandwidth
    inter = group_link(2, 4, Cluster(acc, 16, gpus_per_node=4))
    assert inter.tier == "inter" and all_gather(2**24, 2, inter) == pytest.approx(3 * 0.5 * 2**24 / 2e9)


# ---------------------------------------------------------------------------------------------------
# Published runs (benchmarks/planner_published.py holds the figures, each quoted from its source)


def _published(prefix: str):
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import planner_published

    return planner_published, [run for run in planner_published.RUNS if run.name.startswith(prefix)]


def test_korthikanti_measured_iterations_within_15_percent():
    """Korthikanti et al. 2022, table 5 and section 6.3: seconds per iteration measured on A100s for 22B to 1T
    with sequence parallelism and selective recompute (and with full recompute), against the planner's
    prediction for the stated layout on catalogue hardware (nothing fitted; unfused attention with dropout, as
    Megatron-LM ran it then)."""
    published, runs = _published("K22")
    timed = [run for run in runs if run.step_s is not None]
    assert len(timed) == 9
    for run in timed:
        ev, fits = published.given_plan(run)
        assert fits, run.name
        assert ev.time.step_time_s == pytest.approx(run.step_s, rel=0.15), run.name


def test_narayanan_ptd_p_throughput_within_10_percent():
    """Narayanan et al. 2021, tables 1 and 2 (PTD-P rows): achieved teraFLOP/s per GPU, 1.7B on 32 GPUs to 1T on
    3,072, as the step time their eq. 3 implies, against the planner's for the stated tp, pp and dp (the search
    completes micro-batch and virtual stages; catalogue A100s, nothing fitted)."""
    published, runs = _published("N21")
    ptd = [run for run in runs if "ZeRO-3" not in run.name]
    assert len(ptd) == 16
    for run in ptd:
        ev, fits = published.given_plan(run)
        assert fits, run.name
        assert ev.time.step_time_s == pytest.approx(run.published_step(), rel=0.10), run.name


@pytest.mark.parametrize("prefix, rows", [("MLPerf 3.1", 8), ("MLPerf 4.1 GPT-3", 5)])
def test_mlperf_gpt3_step_times_within_10_percent_and_in_order(prefix, rows):
    """MLPerf Training v3.1 and v4.1, gpt3 (held out on 2026-12-06 and 2026-12-07): GPT-3 175B in FP8 on 256 to
    10,752 H100s (v4.1 also 64 B200s), each step's time from the submissions' MLLOG logs (NeMo's
    train_step_timing), the layout from their configs (TP 4, PP 8; v3.1 12 virtual stages at micro-batch 1, v4.1 4
    or 6 at micro-batch 2; 8 to 512 micro-batches a step in all), against the planner's for that layout described as
    Megatron-Core in FP8: every row fits, within 10%, and the H100 rows' per-GPU rates rank as the runs' (Spearman
    >= 0.9)."""
    published, runs = _published(prefix)
    assert len(runs) == rows
    predicted, measured = [], []
    for run in runs:
        ev, fits = published.given_plan(run)
        assert fits, run.name
        assert ev.time.step_time_s == pytest.approx(run.step_s, rel=0.10), run.name
        if run.gpu == "h100":
            predicted.append(run.batch / run.gpus / ev.time.step_time_s)
            measured.append(run.batch / run.gpus / run.step_s)
    assert published.spearman(predicted, measured) >= 0.9


@pytest.mark.parametrize("version, rows", [("4.0", 9), ("4.1", 5)])
def test_mlperf_llama2_lora_runs_fit_and_come_within_10_percent_but_v40s_cp(version, rows):
    """MLPerf Training v4.0 and v4.1, llama2_70b_lora (held out on 2026-12-07): Llama 2 70B LoRA in FP8 (NeMo 24.04
    and 24.09, TE's float8 under the adapters, the frozen weights in float8) on 4 to 1,024 H100s, 8 H200s, 8 B200s
    and 64 and 384 L40S, the throughput from the submissions' MLLOG logs, the layout from their configs. As the
    planner stood it refused FP8 under LoRA (v4.0), and in bf16 it put the single-node runs out of memory (81 and
    161 GiB); v4.1's H200 run at TP 1 x CP 2 came out at 162 GiB before NeMo's one adapter on linear_qkv and
    Megatron's float8 SwiGLU input were described. Every row fits; the H100 rows come within 10% but v4.0's with
    context parallelism (27-38% optimistic; v4.1's same layouts took 15-19% less: docs/planner.md, "MLPerf Training
    v4.0's Llama 2 70B LoRA"); and per GPU, TP alone outruns TP x CP, in the planner as in the runs."""
    published, runs = _published(f"MLPerf {version}")
    runs = [run for run in runs if "LoRA" in run.name]
    assert len(runs) == rows
    rates = []
    for run in runs:
        ev, fits = published.given_plan(run)
        assert fits, run.name
        if run.gpu == "h100" and (version == "4.1" or "cp=1," in run.plan):
            assert ev.time.step_time_s == pytest.approx(run.step_s, rel=0.10), run.name
        if run.gpu == "h100":
            rates.append((run.batch / run.gpus / ev.time.step_time_s, run.batch / run.gpus / run.step_s,
                          "cp=1," in run.plan))
    for i in (0, 1):  # predicted, published
        assert min(r[i] for r in rates if r[2]) > max(r[i] for r in rates if not r[2])


def _fitting_within(published, runs, low: float, high: float) -> list:
    """Each run's given plan fits, as it ran, its predicted over published throughput within [low, high], and the
    upper median of |ratio - 1| under 10%: the (run, evaluation) pairs."""
    pairs, errors = [], []
    for run in runs:
        ev, fits = published.given_plan(run)
        assert fits, run.name
        ratio = run.published_step() / ev.time.step_time_s
        assert low <= ratio <= high, (run.name, ratio)
        errors.append(abs(ratio - 1))
        pairs.append((run, ev))
    assert sorted(errors)[len(errors) // 2] < 0.10
    return pairs


def test_nemo_2407_finetuning_rows_fit_and_come_within_18_percent_pessimistic():
    """NeMo 24.07's fine-tuning benchmark (its launcher's examples/README.md, held out on 2026-12-07): Llama 2 7B,
    13B and 70B, SFT and LoRA in FP8 on 8 and 16 H100s, SQuAD packed to 4,096 tokens, each row's knobs from the
    script beside it. Every row fits, as it ran, and every one is pessimistic by at most 18% (median 7.0%; the
    upper median, 8.8%, is what is held under 10%): the
    planner prices causal attention over the 4,096 tokens where the runs attend within each packed sample, and
    with the attention nearly free every row turns optimistic, so the truth lies between (docs/planner.md, "NeMo
    24.07's fine-tuning rows, held out"). The LoRA rows keep their frozen weights in float8."""
    published, runs = _published("NeMoFT")
    assert len(runs) == 6
    for run, ev in _fitting_within(published, runs, 0.82, 1.0):
        training = published.training_of(run)
        assert training.float8_frozen_weights == bool(run.lora_rank), run.name
        cluster = published.cluster_of(run)
        acc = cluster.accelerator
        nearly_free = dataclasses.replace(acc, attention_by_kernel={
            **acc.attention_by_kernel, "flash2": 20 * acc.attention_by_kernel["flash2"]})
        fast = evaluate(run.model, training, ev.plan, dataclasses.replace(cluster, accelerator=nearly_free))
        assert run.published_step() / fast.time.step_time_s > 1.0, run.name


def test_bridge_2606_finetuning_rows_fit_and_come_within_15_percent():
    """Megatron Bridge 26.06's fine-tuning tables (held out on 2026-12-07): Llama 3 70B SFT on 32 and LoRA on 8 GPUs
    in FP8 with current scaling, on DGX-H100 and DGX-GB200, each as v0.5.0's recipe runs it (4,096-token sequences;
    LoRA of rank 16 on linear_qkv alone, the perf configs' override of Bridge's default targets; expandable segments,
    as every job of that release's Slurm executor). Every row fits, as it ran, within 0.93 to 1.14 (median 5.6%):
    the GB200 LoRA row the optimistic one at 1.13, as the GB200's pre-training rows are (1.09 since the GB200's
    matmul rate is its MAMF figure, 2026-12-07). The bounds are where the held-out rows came out, a band to hold."""
    published, runs = _published("BridgeFT")
    assert len(runs) == 4 and {run.gpu for run in runs} == {"h100", "gb200"}
    for run, ev in _fitting_within(published, runs, 0.93, 1.14):
        training = published.training_of(run)
        assert training.expandable_segments and ev.memory["fragmentation"] == 0.0, run.name
        lora = " LoRA " in run.name
        assert training.lora_rank == (16 if lora else 0), run.name
        assert not lora or set(training.lora_targets) == {"wq", "wk", "wv"}, run.name
        assert training.float8 == "te-current" and not training.grads_in_fp32, run.name


def test_nemo_launcher_2024_rows_fit_and_come_within_16_percent():
    """NeMo's launcher, its benchmark tables of March 2024 (NeMo 24.01) and April 2024 (held out on 2026-12-07):
    GPT-3 5B and 20B, Llama 2 7B to 70B and Nemotron-8B and -22B pre-training, and Llama 2 fine-tuning, in FP8 on 8
    to 64 H100s, described as NeMo 24.07's rows are. Every row fits, as it ran, within 0.85 to 1.16 (median 6.7%; the
    planner cannot tell NeMo 24.01 from later releases, whose rows of the same layouts in the launcher's June and July
    tables ran 2-18% faster). Nemotron-22B's
    printed layout (TP 1, PP 4, micro-batch 2 on 16 GPUs) fits only with recompute: its global batch of 32 gives each
    pipeline 4 micro-batches, as many as its stages, so the interleaved schedule runs every forward before the first
    backward, over 51 GiB of model state; the layout of the script beside it (TP 2, micro-batch 1) fits without."""
    published, runs = _published("NeMoL")
    assert len(runs) == 18
    _fitting_within(published, runs, 0.85, 1.16)
    nemotron = next(r for r in runs if "nemotron-22b" in r.name)
    as_printed = dataclasses.replace(nemotron, plan=nemotron.plan + ",activation_checkpoint=none")
    ev, fits = published.given_plan(as_printed)
    assert not fits and ev.memory["grads"] + ev.memory["params"] + ev.memory["optimizer_state"] > 45 * 2**30
    script = dataclasses.replace(nemotron, plan="tp=2,pp=4,cp=1,dp_replicate=2,zero_stage=1,micro_batch=1,"
                                                "pp_schedule=interleaved-1f1b,virtual_stages=10,activation_checkpoint=none")
    assert published.given_plan(script)[1]


def test_bridge_gb200_rows_as_their_recipes_run_them():
    """Megatron Bridge on DGX-GB200 (releases 25.09 to 26.02, held out on 2026-12-07), each row as its release's
    scripts/performance recipe runs it: no recompute, the 70B's first 40 blocks' activations and the 128-GPU 405B's
    first 95 offloaded to the Grace host (Training.offload_layers), which holds them. The planner is optimistic on
    every row (1.05 to 1.26 as held out; 1.00 to 1.20 since the GB200's matmul rate is its own MAMF figure, 72.9% of
    its peak, where it had been the B200's share), and puts none more than 6% over the 185 GiB board they ran on;
    the ones it puts over it
    (the three 70B rows, 4-5%) are over by its 10% fragmentation allowance alone (docs/planner.md, "Megatron Bridge
    on GB200"). The 405B's jobs ran the allocator with expandable segments (the perf scripts set it for them alone),
    which sizes the fit without the allowance: each fits. The bounds are where the held-out rows came out, a band to
    hold, not a target."""
    from shardwise.planner.memory import host_bytes

    published, runs = _published("Bridge 2")
    assert len(runs) == 8
    refused = []
    for run in runs:
        ev, fits = published.given_plan(run)
        cluster = published.cluster_of(run)
        board = cluster.accelerator.memory_bytes
        assert ev.memory["total"] < 1.06 * board, run.name
        if not fits:
            refused.append(run.name)
            bare = evaluate(run.model, dataclasses.replace(published.training_of(run), fragmentation=0.0), ev.plan,
                            cluster)
            assert bare.memory["total"] < board, run.name
        assert 1.0 < run.published_step() / ev.time.step_time_s < 1.21, run.name
        training = published.training_of(run)
        if "70b" in run.name:
            assert training.offload_layers == 40
        assert training.expandable_segments is ("405b" in run.name), run.name
        if "405b" in run.name:
            assert fits and ev.memory["fragmentation"] == 0.0, run.name
        assert host_bytes(run.model, training, ev.plan) < cluster.accelerator.host_memory_bytes, run.name
    assert sorted(refused) == sorted(r.name for r in runs if "70b" in r.name)


def test_mlperf_v50_llama31_405b_rows_fit_and_come_within_13_percent():
    """MLPerf Training v5.0's Llama 3.1 405B pre-training (held out on 2026-12-07): NVIDIA's NeMo recipe on 512 to
    8,192 H100s (TP 8), 512 and 1,024 H200s (TP 4) and 256 to 2,496 GB200s (TP 4), each with PP 8 x CP 2 x VP 8,
    micro-batch 1, FP8 with delayed scaling and expandable segments, over the Mixtral tokenizer's 32,768-token
    vocabulary. Every row fits, as it ran. As held out: H100 0.93, H200 1.02, GB200 1.14 to 1.17 (median 10.9%);
    with the GB200's MAMF figure in place of the B200's share (found while reading why), GB200 1.10 to 1.12 and the
    family's median 8.6%. The H100 rows are pessimistic by the TP 8 collectives the planner leaves exposed
    (TP_COMM_OVERLAP overlaps them with the GEMMs through userbuffers, not priced). The ratio holds across a 16x
    range of GPU counts for each GPU, and the H100 rows keep their published order. Bounds: where the rows came
    out, a band to hold."""
    published, runs = _published("MLPerf 5.0 405B")
    assert len(runs) == 14 and {run.gpu for run in runs} == {"h100", "h200", "gb200"}
    by_gpu = {}
    for run, ev in _fitting_within(published, runs, 0.90, 1.13):
        training = published.training_of(run)
        assert run.model.vocab_size == 32768 and run.model.n_layers == 126, run.name
        assert training.expandable_segments and training.float8 == "te-delayed" and not training.grads_in_fp32
        assert (ev.plan.pp, ev.plan.cp, ev.plan.virtual_stages, ev.plan.micro_batch) == (8, 2, 8, 1), run.name
        by_gpu.setdefault(run.gpu, []).append(run.published_step() / ev.time.step_time_s)
    assert max(by_gpu["h100"]) < 0.95 and min(by_gpu["gb200"]) > 1.05
    for ratios in by_gpu.values():  # each GPU's rows within 3% of each other, 2 to 16x apart in GPU count
        assert max(ratios) / min(ratios) < 1.03
    h100 = sorted((r for r in runs if r.gpu == "h100"), key=lambda r: r.gpus)
    published_rate = [r.tflops for r in h100]
    assert published_rate == sorted(published_rate, reverse=True)  # per-GPU throughput falls with the GPU count
    predicted = [r.batch * r.seq * published.flops_per_token(r.model, r.seq) / (published.given_plan(r)[0]
                 .time.step_time_s * r.gpus) for r in h100]
    assert predicted == sorted(predicted, reverse=True)


def test_mlperf_v50_llama2_70b_lora_memory_within_4_percent_and_the_cp_rows_optimistic():
    """MLPerf Training v5.0's Llama 2 70B LoRA, NVIDIA's five submissions (held out on 2026-12-07): a DGX B200 and two
    GB200 trays at TP 1 x CP 1, one to eight NVL72 racks at CP 8, each log carrying its peak allocated memory. The
    planner's active bytes come within 4% of every one (168.8 GiB at CP 1, 82.3 at CP 8). The CP 1 rows are put
    over their boards by the 10% fragmentation allowance alone (they ran without expandable segments, 168.8 GiB
    allocated on 179.1 and 185.0): a fit verdict that disagrees, held here as found. The CP 8 rows were 1.31 to 1.41
    optimistic as held out, as every NeMo LoRA row with CP has been (docs/planner.md, "MLPerf Training v5.0's Llama
    2 70B LoRA, held out"); with their exchange priced as the all-to-all it is (cp_comm_type a2a, since the same
    day), 1.15 to 1.25; the CP 1 rows 1.08 and 1.11. Bounds: where the rows came out, a band to hold (each CP 8 row
    priced with the ring again would fall outside it)."""
    published, runs = _published("MLPerf 5.0 NVIDIA 70B LoRA")
    assert len(runs) == 5
    for run in runs:
        ev, fits = published.given_plan(run)
        training = published.training_of(run)
        assert training.lora_rank == 16 and training.float8_frozen_weights and not training.expandable_segments
        assert training.cp_exchange == "a2a", run.name
        assert published.published_memory(ev, run) / 2**30 == pytest.approx(run.mem_gib, rel=0.04), run.name
        ratio = run.published_step() / ev.time.step_time_s
        board = published.cluster_of(run).accelerator.memory_bytes
        if ev.plan.cp == 1:
            assert not fits and 1.05 < ratio < 1.14, (run.name, ratio)
            assert ev.memory["total"] - ev.memory["fragmentation"] < board, run.name
        else:
            assert fits and 1.12 < ratio < 1.28, (run.name, ratio)


def test_mlperf_v51_llama31_8b_rows_fit_and_miss_the_same_fraction_of_a_second_a_step():
    """MLPerf Training v5.1's Llama 3.1 8B pre-training in FP8 (held out on 2026-12-07): NVIDIA's NeMo recipe on 8 to
    256 B200s, 64 H200s and 72 and 512 GB200s, Cisco's older copy on 64 and 128 H100s. Every row fits, as it ran;
    Cisco's logged peaks (max_memory_allocated) within 7%. Every row is optimistic, and by about the same time a
    step where it spans nodes or splits the sequence: the runs take 0.03-0.09 s a step more than the planner's
    whether its step is 0.54 s, 0.14 s or 0.04 s (the CUDA-graphed recipe's rows), where one 8-GPU node comes within
    0.02 s (docs/planner.md, "MLPerf Training v5.1's Llama 3.1 8B, held out": not explained, held here as found).
    Bounds: where the rows came out, a band to hold."""
    published, runs = _published("MLPerf 5.1 8B")
    assert len(runs) == 15 and {run.gpu for run in runs} == {"h100", "h200", "b200", "gb200"}
    for run in runs:
        ev, fits = published.given_plan(run)
        training = published.training_of(run)
        cisco = run.name.startswith("MLPerf 5.1 8B Cisco")
        assert fits and run.model.vocab_size == 128256 and run.model.n_layers == 32, run.name
        assert training.float8 == ("te-delayed" if cisco else "te-current") and not training.grads_in_fp32
        assert training.expandable_segments == (" UF " in run.name), run.name
        if run.mem_gib:
            assert published.published_memory(ev, run) / 2**30 == pytest.approx(run.mem_gib, rel=0.07), run.name
        ratio = run.published_step() / ev.time.step_time_s
        gap = run.published_step() - ev.time.step_time_s
        if run.gpus == 8:
            assert 0.97 < ratio < 1.07 and gap < 0.02, (run.name, ratio, gap)
        elif not cisco:
            assert 1.05 < ratio < 2.2 and 0.03 < gap < 0.09, (run.name, ratio, gap)
        else:  # no CUDA graphs, TP 2 at 16 nodes
            assert 1.2 < ratio < 1.65 and gap < 0.21, (run.name, ratio, gap)


def test_mlperf_v51_llama2_70b_lora_cp_rows_within_6_percent_and_cp1_over_by_the_allowance():
    """MLPerf Training v5.1's Llama 2 70B LoRA on NVIDIA's NeMo 2 recipe of the round (held out on 2026-12-07): the
    rows with CP 4 or 8 (B200s, GB200 racks) and Dell's H200 at TP 2 fit and come within 6%, where v5.0's CP 8 rows
    of the same benchmark were 15-25% optimistic (its recipe's steps were slower: 0.24 s on one rack, 0.20 s now).
    The eleven B200 rows at TP 1 x CP 1 are put over their boards by the 10% fragmentation allowance alone, as v5.0's
    two were (they ran without expandable segments): a fit verdict that disagrees, held here as found; their
    untimed ratio 0.92-0.99 (FP8 attention, which they ran, is priced in bf16). Bounds: where the rows came out, a
    band to hold."""
    published, runs = _published("MLPerf 5.1 70B LoRA")
    assert len(runs) == 20
    planned = [(run, *published.given_plan(run)) for run in runs]
    assert sum(not fits for _, _, fits in planned) == 11  # the docs' count
    for run, ev, fits in planned:
        training = published.training_of(run)
        assert training.float8_frozen_weights and training.cp_exchange == "a2a" and not training.expandable_segments
        ratio = run.published_step() / ev.time.step_time_s
        if ev.plan.cp == 1 and run.gpu == "b200":
            board = published.cluster_of(run).accelerator.memory_bytes
            assert not fits and ev.memory["total"] - ev.memory["fragmentation"] < board, run.name
            assert 0.90 < ratio < 1.0, (run.name, ratio)
        else:
            assert fits and 0.94 < ratio < 1.06, (run.name, ratio)


def test_mlperf_v51_llama31_405b_b200_rows_fit_and_come_out_optimistic_as_v50s_blackwell_rows():
    """MLPerf Training v5.1's Llama 3.1 405B in FP8 (held out on 2026-12-07): the University of Florida's 256 and 448
    B200s on NVIDIA's NeMo recipe of the round (TP 4 x PP 8 x CP 2 x VP 8, micro-batch 1, 144 micro-batches a
    data-parallel rank, per-tensor current scaling, expandable segments, TP communication not overlapped). Both fit,
    as they ran, and come out 15-16% optimistic, within 2% of each other at 1.75x the GPUs: more so than v5.0's
    GB200 rows of the benchmark (1.10-1.12), and unlike its H100 and H200 rows (0.93, 1.02), the Blackwell rows run
    slower than the planner prices them (docs/planner.md, "MLPerf Training v5.1's Llama 3.1 405B, held out": not
    explained, held here as found). Bounds: where the rows came out, a band to hold."""
    published, runs = _published("MLPerf 5.1 405B")
    assert len(runs) == 2 and {run.gpu for run in runs} == {"b200"}
    ratios = []
    for run in runs:
        ev, fits = published.given_plan(run)
        training = published.training_of(run)
        assert fits and run.model.vocab_size == 32768 and run.model.n_layers == 126, run.name
        assert training.expandable_segments and training.float8 == "te-current" and not training.grads_in_fp32
        plan = ev.plan
        assert (plan.tp, plan.pp, plan.cp, plan.virtual_stages, plan.micro_batch, plan.grad_accum) == (
            4, 8, 2, 8, 1, 144), run.name
        # TP's collectives priced exposed, as these runs left them (the planner prices no TP overlap)
        assert ev.time.detail["tp_comm_s"] > 0.1 * ev.time.step_time_s
        ratios.append(run.published_step() / ev.time.step_time_s)
    assert all(1.12 < r < 1.19 for r in ratios) and max(ratios) / min(ratios) < 1.02, ratios
    _, v50 = _published("MLPerf 5.0 405B")
    by_gpu = {}
    for run in v50:
        by_gpu.setdefault(run.gpu, []).append(run.published_step() / published.given_plan(run)[0].time.step_time_s)
    assert max(by_gpu["h100"] + by_gpu["h200"]) < 1.05 < min(by_gpu["gb200"]) < max(by_gpu["gb200"]) < min(ratios)


def _ultrascale():
    """benchmarks/planner_ultrascale.py, and planner_published.py beside it (the Run machinery it uses)."""
    published, _ = _published("")
    import planner_ultrascale

    return planner_ultrascale, published


def test_the_ultrascale_playbook_sweep_is_transcribed_as_its_figure_prints_it():
    """The Ultra-Scale Playbook's benchmark figure (benchmarks/data/ultrascale_playbook.csv): 3,257 distinct layouts,
    1,751 measured, every measured one at the 256 sequences of 4,096 tokens the text states but twelve whose DP x MBS
    x GradAcc says otherwise (left out by the benchmark). Its model sizes are nanotron's estimate_num_params of the
    shapes in scaling_benchmarks.py (1.34, 3.57, 8.86 and 80.0 B: embeddings tied below an intermediate size of
    10,000), which the planner's parameter count reproduces; and without a pipeline the figure's MFU column is its
    tok/s/gpu column times nanotron's get_flops count (attention over the whole s x s) over 989.5 TFLOP/s, within
    the printing's rounding, the vocabulary's matmul counted twice for the two untied models (8B, 80B; once in
    get_flops at 67c5ebb6): a column misread or shifted would not agree."""
    ultrascale, _ = _ultrascale()
    rows = ultrascale.rows()
    measured = [r for r in rows if not math.isnan(r["tok_s_gpu"])]
    assert (len(rows), len(measured)) == (3257, 1751)
    assert sum(int(r["dp"] * r["mbs"] * r["grad_acc"]) != 256 for r in measured) == 12
    assert all(r["gbs"] == 256 and r["dp"] * r["tp"] * r["pp"] == 8 * r["nodes"] for r in measured)
    sizes = {name: num_params(ultrascale.model(name)) / 1e9 for name in ultrascale.SHAPES}
    assert [round(sizes[n], 2) for n in ("1B", "3B", "8B")] == [1.34, 3.57, 8.86] and round(sizes["80B"], 1) == 80.0

    def nanotron_model_flops_per_token(name: str) -> float:  # models/llama.py get_flops, forward x 3
        layers, h, heads, ffn = ultrascale.SHAPES[name]
        s, v = 4096, 131072
        vocab_matmuls = 1 if ultrascale.model(name).tie_embeddings else 2
        forward = 2 * layers * (3 * h * h + 2 * s * h + h * h + 3 * h * ffn) + vocab_matmuls * 2 * h * v
        return 3 * forward

    for r in measured:
        if r["pp"] == 1 and r["mfu_pct"] >= 5:
            implied = r["tok_s_gpu"] * nanotron_model_flops_per_token(r["model"]) / 989.5e12 * 100
            assert abs(implied - r["mfu_pct"]) <= 0.06 + 0.006 * r["mfu_pct"], r


def test_nanotron_cuts_its_pipeline_greedily_at_equal_shares_of_its_block_costs():
    """nanotron's build_model (models/base.py at its benchmark branch, 67c5ebb6) walks its pipeline blocks (embedding,
    the decoder layers, final norm, head, fp32 cast, loss) at get_block_compute_costs' costs and moves to the next
    stage after the block whose cumulative cost exceeds the stage's share. By hand, for the Playbook's 1B (a layer
    4 x 2048^2 + 3 x 8192 x 2048 = 67,108,864, the head 131,072 x 2048 = 4 layers, 20 in all): at pp 4 each share is
    5 layers, and 5 layers equal it without exceeding it, so stage 0 takes 6, stages 1 and 2 five each, and the head
    lands on stage 3 with no layer. For the 3B (a layer 113,246,208, the head 3.56 layers, shares of 1.97 layers at
    pp 16) every stage to 13 takes 2, the head stage 14 alone and stage 15 only the cast and the loss. The
    engine's cost split ('cost') puts one layer fewer on stage 0 and the head on the last."""
    ultrascale, _ = _ultrascale()
    stages, head = nanotron_split(ultrascale.model("1B"), 4)
    assert [len(s) for s in stages] == [6, 5, 5, 0] and head == 3 and stages[1] == range(6, 11)
    stages, head = nanotron_split(ultrascale.model("3B"), 16)
    assert [len(s) for s in stages] == [2] * 14 + [0, 0] and head == 14
    args = ultrascale.model("3B")
    plan = Plan(dp_replicate=2, pp=16, pp_schedule="1f1b", micro_batch=1, grad_accum=128)
    shapes = [stage_shape(args, plan, r, 4096, "nanotron") for r in range(16)]
    assert [s.last for s in shapes].index(True) == 14 and shapes[15].params == 0 and shapes[0].layers == 2
    assert stage_shape(args, plan, 0, 4096, "cost").layers == 1

    # nanotron's loop as build_model writes it (numpy's cumsum, each share rounded as (rank + 1) / pp_size first),
    # on a stage count where that rounding decides a tie
    def build_model_ranks(layers: int, h: int, heads: int, ffn: int, vocab: int, pp: int) -> list[int]:
        costs = [0] + [4 * heads * (h // heads) * h + 3 * ffn * h] * layers + [0, vocab * h, 0, 0]
        cumulative = numpy.cumsum(costs)
        thresholds = [cumulative[-1] * ((rank + 1) / pp) for rank in range(pp)]
        rank, ranks = 0, []
        for c in cumulative:
            ranks.append(rank)
            if c > thresholds[rank]:
                rank += 1
        return ranks

    wide = ModelArgs(dim=2048, n_heads=16, n_kv_heads=16, n_layers=40, vocab_size=131072, ffn_hidden=8192)
    ranks = build_model_ranks(40, 2048, 16, 8192, 131072, 22)
    stages, head = nanotron_split(wide, 22)
    assert [len(s) for s in stages] == [ranks[1:41].count(r) for r in range(22)] and head == ranks[42]
    # priced only beside what nanotron runs: refused with schedules, recompute or offload it does not have
    ran = {"pp_schedules": ("gpipe", "1f1b"), "partial_checkpoint": "none", "layout": "megatron"}
    for beyond in ({"pp_schedules": ("1f1b", "interleaved-1f1b")}, {"partial_checkpoint": "first"},
                   {"offload_layers": 1}):
        with pytest.raises(PlannerError, match="pipeline_split"):
            Training(pipeline_split="nanotron", **(ran | beyond))
    Training(pipeline_split="nanotron", **ran)


def test_the_ultrascale_playbooks_deep_pipelines_hold_nanotrons_first_stage_in_memory():
    """The memory nanotron logs (world rank 0: pipeline stage 0) for the Playbook's pipelines of 8 and 16 stages
    on one or two data-parallel ranks: with nanotron's own cut (stage 0 takes the block that crosses its share, the
    system's pipeline_split) the planner's reserved bytes come within 10% of the published figure; with the engine's
    cost split, one block fewer on stage 0, 19-43% short (docs/planner.md, "The Ultra-Scale Playbook's sweep, held
    out")."""
    ultrascale, planner_published = _ultrascale()

    names = {"Ultrascale 1B n=8 d1 t1 p8 mb1 ga256 z0", "Ultrascale 8B n=16 d2 t1 p8 mb1 ga128 z1",
             "Ultrascale 3B n=32 d2 t1 p16 mb1 ga128 z1", "Ultrascale 8B n=32 d2 t1 p16 mb1 ga128 z1"}
    runs = [run for run in map(ultrascale.run_of, ultrascale.rows()) if run.name in names]
    assert len(runs) == 4
    for run in runs:
        ev, fits = planner_published.given_plan(run)
        training = planner_published.training_of(run)
        assert fits and training.pipeline_split == "nanotron" and ev.plan.pp_schedule == "1f1b"
        ours = reserved_bytes(run.model, training, ev.plan, 0) / GiB
        engine = reserved_bytes(run.model, dataclasses.replace(training, pipeline_split="cost"), ev.plan,
                                           0) / GiB
        assert abs(ours / run.mem_gib - 1) <= 0.10 and engine / run.mem_gib < 0.82, (run.name, ours, engine)


def test_the_ultrascale_playbooks_zero0_rows_hold_ddps_bucket_copy():
    """The Playbook's rows without a pipeline at ZeRO-0 over more than one data-parallel rank, tp 1-2 and micro-batch
    1 (the 1B and 3B: 19 rows, 18.5 to 45.5 GiB as nanotron logged them): with DDP's resident copy of the gradients
    (nanotron wraps in torch's DDP without gradient_as_bucket_view) and its loss's out-of-place shift, the planner's
    allocated bytes come within 5%; with neither (bucket views, Megatron's in-place shift) 7-13% short. The copy is
    most of it here (at micro-batch 1 the logits are small beside the weights)."""
    ultrascale, planner_published = _ultrascale()

    runs = [ultrascale.run_of(r) for r in ultrascale.rows() if not math.isnan(r["tok_s_gpu"]) and r["pp"] == 1
            and r["tp"] <= 2 and r["zero"] == 0 and r["mbs"] == 1 and r["dp"] > 1 and r["model"] != "8B"]
    assert len(runs) == 19
    for run in runs:
        ev, _ = planner_published.given_plan(run)
        training = planner_published.training_of(run)

        def allocated(t: Training) -> float:
            items = stage_memory(run.model, t, ev.plan, 0)
            return (items["total"] - items["fragmentation"] - items["fixed_overhead"]) / GiB / run.mem_gib

        megatron = dataclasses.replace(training, ddp_bucket_view=True, ce_shift_in_place=True)
        assert abs(allocated(training) - 1) <= 0.05 and allocated(megatron) < 0.935, run.name


def test_the_ultrascale_playbooks_pipelined_rows_mix_two_versions_of_nanotrons_pipeline():
    """The bench branch's last commit (67c5ebb6) polls each p2p metadata message with 0.1-s sleeps, so stage 0 takes
    at least 0.4 s a micro-batch under it (four of its six polled messages): of the 1,258 pipelined rows the
    benchmark evaluates, 575 ran faster (40 of 41 on one node) and none of the 207 on 64 nodes did, so the figure
    holds two versions of nanotron's pipeline.
    And 29 of 84 groups of ZeRO-0 layouts holding the same rank state on several node counts span more than 10%,
    which no per-rank model can meet (docs/planner.md, "The Ultra-Scale Playbook's sweep, held out")."""
    ultrascale, _ = _ultrascale()

    assert ultrascale.POLL_FLOOR_S == pytest.approx(0.4)
    blocks = {name: shape[0] for name, shape in ultrascale.SHAPES.items()}
    rows = [r for r in ultrascale.rows() if not math.isnan(r["tok_s_gpu"]) and r["pp"] <= blocks[r["model"]]
            and r["dp"] * r["mbs"] * r["grad_acc"] == ultrascale.BATCH]
    below, pipelined = ultrascale.polling_floor_counts(rows)
    assert (sum(below.values()), sum(pipelined.values())) == (575, 1258)
    assert (below[1], pipelined[1]) == (40, 41) and (below[64], pipelined[64]) == (0, 207)
    groups, spans = ultrascale.same_rank_memory(rows)
    assert (groups, sum(s > 1.1 for s in spans), sum(s > 1.2 for s in spans)) == (84, 29, 17)


def test_plan_output_says_when_only_the_fragmentation_allowance_is_over_the_device():
    """The published set's runs that ran and are predicted not to fit are over the device by no more than the 10%
    allowance for the caching allocator's fragmentation (17 of 22: not Llama 3 405B's four, far over, nor NeMo 22.08's
    5B on 8 GPUs, 0.2 GiB over without it): `shardwise plan` keeps
    its verdict but says that the tensors fit without it, and what would size them so. Not said where the tensors
    alone are over, nor where the plan fits."""
    from shardwise.planner.cli import _table

    published, runs = _published("")
    by_name = {run.name: run for run in runs}
    note = "over the device only by the 10% fragmentation allowance"
    for name, fits_, said in (("MLPerf 5.1 70B LoRA UF B200 n=8", False, True),
                              ("Bridge 25.09 GB200 llama3-70b n=64", False, True),
                              ("Llama3 405B 8K n=8192 megatron", False, False),
                              ("MLPerf 5.1 8B UF B200 n=8", True, False)):
        run = by_name[name]
        ev, fits = published.given_plan(run)
        training, cluster = published.training_of(run), published.cluster_of(run)
        out = _table(run.model, training, cluster, [ev], 0.1, 1, 1)
        assert fits == fits_ and (note in out) == said, name
        bare = evaluate(run.model, dataclasses.replace(training, expandable_segments=True), ev.plan, cluster)
        assert bare.fits == (fits or said), name
        if said:
            assert f"({bare.memory['total'] / GiB:.1f} GiB without it, of {ev.budget / GiB:.1f})" in out


def test_nanotrons_zero1_all_reduces_its_whole_gradient_buffer_after_the_backward():
    """nanotron runs ZeRO-1 without DDP (trainer.py make_ddp) and all-reduces the whole fp32 gradient buffer once
    the backward is done (sync_gradients_across_dp, reduce_scatter=False): under Training.zero1_all_reduce nothing
    of the data-parallel traffic hides, and it is an all-reduce of the stage's fp32 gradients over the data-parallel
    group, twice a reduce-scatter's bytes; Megatron's distributed optimizer reduce-scatters behind the backward."""
    ultrascale, planner_published = _ultrascale()

    name = "Ultrascale 1B n=64 d64 t1 p1 mb1 ga4 z1"
    run = next(r for r in map(ultrascale.run_of, ultrascale.rows()) if r.name == name)
    training = planner_published.training_of(run)
    cluster = planner_published.cluster_of(run)
    assert training.zero1_all_reduce
    plan = planner_published.given_plan(run)[0].plan
    nanotron = evaluate(run.model, training, plan, cluster).time.detail
    megatron = evaluate(run.model, dataclasses.replace(training, zero1_all_reduce=False), plan, cluster).time.detail
    assert nanotron["dp_exposed_s"] == pytest.approx(nanotron["dp_comm_s"])
    assert megatron["dp_exposed_s"] < 0.7 * megatron["dp_comm_s"]
    # an all-reduce moves twice a reduce-scatter's bytes, and both are followed by the same all-gather of the bf16
    # weights (half the fp32 gradients' bytes): (2 x 4 + 2) / (4 + 2) = 1.67 at large messages
    assert 1.55 < nanotron["dp_comm_s"] / megatron["dp_comm_s"] < 1.75
    with pytest.raises(PlannerError, match="zero1_all_reduce"):
        Training(layout="fsdp-mp", zero1_all_reduce=True)


def test_bf16_grad_transients_are_deepspeeds_and_nanotron_makes_none():
    """keeps_bf16_grads priced DeepSpeed's BF16_Optimizer with its two transient copies, each a segment of its own
    (memory.bf16_optimizer_segments: an fp32 copy of the largest parameter, a bf16 copy of the larger weight-decay
    group); nanotron keeps the bf16 gradients without them (its accumulation adds into the fp32 buffer in place):
    bf16_grad_transients = false leaves them out and nothing else."""
    args = preset("llama3-8b")
    plan = Plan(dp_replicate=4, pp=2, pp_schedule="1f1b", micro_batch=1, grad_accum=8, zero_stage=1)
    deepspeed = Training(layout="megatron", keeps_bf16_grads=True, seq_len=4096, global_batch=32)
    nanotron = dataclasses.replace(deepspeed, bf16_grad_transients=False)
    emb = args.vocab_size * args.dim
    assert bf16_optimizer_segments(args, deepspeed, plan, 0) > 4 * emb
    assert bf16_optimizer_segments(args, nanotron, plan, 0) == 0
    with_, without = stage_memory(args, deepspeed, plan, 0), stage_memory(args, nanotron, plan, 0)
    assert with_["grads"] == without["grads"] and with_["total"] - without["total"] == pytest.approx(
        bf16_optimizer_segments(args, deepspeed, plan, 0))


def test_megatron_bridge_moe_rows_fit_and_come_within_15_percent_but_the_pipelined_30b():
    """Megatron Bridge's performance summary, Qwen3 30B-A3B and 235B-A22B in FP8 on DGX-H100, releases 25.09 to
    26.06 (held out on 2026-12-07): as the planner stood every row was refused (its ep was FSDP's, these runs put it
    on the distributed optimizer's ranks, the 235B's folded over tp 2), and described with the engine's MoE tensors
    the 235B rows and 25.09's 30B came out at 107-112 GiB. With Megatron-Core's MoE layer (its ranks, its saved
    tensors, its all-to-all overlap) every row fits, the 235B rows come within 15% and the 30B on EP 16 within 5%;
    the 30B's pipelined rows, host-bound (docs/planner.md, "Megatron Bridge's MoE rows, held out"), are not held
    to it."""
    published, runs = _published("Bridge MoE")
    assert len(runs) == 11
    for run in runs:
        ev, fits = published.given_plan(run)
        assert fits, run.name
        ratio = run.published_step() / ev.time.step_time_s  # predicted / published throughput
        if "235B" in run.name:
            assert ratio == pytest.approx(1.0, abs=0.15), run.name
        if "ep=16" in run.plan:
            assert ratio == pytest.approx(1.0, abs=0.05), run.name


def test_unfused_attention_and_dropout_add_korthikantis_terms():
    """Korthikanti et al. 2022, table 2: per layer, sbh(10 + 24/t + 5as/(ht)) bytes with tensor parallelism,
    sbh(34/t + 5as/(ht)) with sequence parallelism, the 5as/(ht) (softmax output, dropout mask and output) gone
    under selective recompute. Our block's own tensors differ from the GPT block's (SwiGLU, rotary); what
    unfused attention and dropout add to them must be exactly the two terms our fused, dropout-free block
    lacks: 5 a s^2 b / t, and the two hidden dropout masks, 2 s b h (/ t with SP)."""
    args = preset("llama3-8b")
    s, b, t, a, h = 2048, 2, 8, args.n_heads, args.dim
    for sp in (False, True):
        for recompute in ("none", "selective"):
            plan = Plan(tp=t, micro_batch=b, sequence_parallel=sp, activation_checkpoint=recompute)
            gpt = Training(seq_len=s, global_batch=b, layout="megatron", fused_attention=False, dropout=True)
            ours = dataclasses.replace(gpt, fused_attention=True, dropout=False)
            # Korthikanti's selective recompute keeps every tensor but the attention core's
            base = layer_activation_bytes(args, ours, plan, "none")
            masks = 2 * s * b * h / (t if sp else 1)
            scores = 5 * a * s * s * b / t if recompute == "none" else 0.0
            assert layer_activation_bytes(args, gpt, plan) == pytest.approx(base + masks + scores, rel=1e-12)
    # full recompute keeps the block's input only, either way
    full = Plan(tp=t, micro_batch=b, activation_checkpoint="full")
    assert layer_activation_bytes(args, gpt, full) == layer_activation_bytes(args, ours, full)


def test_unfused_attention_has_no_context_parallelism():
    """Ring attention runs a fused kernel per block: with unfused attention the search keeps cp = 1, and a plan
    asking for cp > 1 is rejected naming the key."""
    from shardwise.planner import search

    args, cluster = preset("llama3-8b"), Cluster(accelerator("a100-80gb"), 64)
    unfused = Training(seq_len=8192, global_batch=64, layout="megatron", fused_attention=False, dropout=True)
    ranked = search(args, unfused, cluster, top_k=20).ranked
    assert ranked and all(ev.plan.cp == 1 for ev in ranked)
    assert any(ev.plan.cp > 1 for ev in search(args, dataclasses.replace(unfused, fused_attention=True), cluster,
                                                top_k=50).ranked)
    with pytest.raises(PlannerError, match="--plan cp"):
        search(args, unfused, cluster, fixed={"cp": 2})


def test_published_out_of_memory_layouts_do_not_fit():
    """The layouts the sources report out of memory: Korthikanti's 22B, 175B, 530B and 1T with tensor
    parallelism and selective recompute but without sequence parallelism (section 6.1) and Narayanan's 530B
    under ZeRO-3 on 560 GPUs (table 2's caption)."""
    published, runs = _published("")
    oom = [run for run in runs if not run.fitted and not run.name.startswith("BigScience")]
    assert len(oom) == 5
    for run in oom:
        assert not published.given_plan(run)[1], run.name


_BLOOM_SEARCH_FITS_WRONGLY = ("the planner predicts it fits (64.0 GiB) where BLOOM's layout search ran out of "
                              "memory, 0.1 GiB above 13312x94 a128, which ran (docs/planner.md, \"BLOOM's layout "
                              "search\")")


@pytest.mark.parametrize("name", [
    "BigScience 12288x100 a64 d16 t4 p6 mb2 OOM",
    "BigScience 12288x100 a64 d16 t4 p6 mb1 OOM",
    pytest.param("BigScience 14336x82 a128 d8 t4 p12 mb2 OOM",
                 marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=_BLOOM_SEARCH_FITS_WRONGLY)),
])
def test_bloom_layout_search_out_of_memory_rows_do_not_fit(name):
    """BLOOM's layout search (chronicles-prequel.md, 2022-02-28) ran out of memory in three layouts. With
    DeepSpeed's stage split (each embedding a block's slot), the embedding norm's saved input and the BF16
    optimizer's two large transients, the two on dp 16 are predicted not to fit (84 and 90 GiB on the first stage);
    until then the one at micro-batch 1 was predicted to fit (76.3 GiB), and the other only through the planner's
    own split. The third is an expected failure (strict: fixing it flags it)."""
    published, runs = _published(name)
    (run,) = runs
    assert not run.fitted
    assert not published.given_plan(run)[1]


def _deepspeed_partition_balanced(weights: list[int], num_parts: int) -> list[int]:
    """DeepSpeed's runtime/utils.py partition_balanced as of 2022 (the smallest bottleneck by bisection over the
    prefix sums, then `_lprobe`'s greedy cut from the left), written out for this test: part boundaries."""
    prefix = list(itertools.accumulate(weights, initial=0))

    def lprobe(bottleneck):
        parts, start = [0], 0
        for _ in range(num_parts):
            end = start
            while end < len(weights) and prefix[end + 1] - prefix[start] <= bottleneck:
                end += 1
            parts.append(end)
            start = end
        return parts, start == len(weights)

    low, high = max(weights), prefix[-1]
    while low < high:  # integer weights: the smallest bottleneck that fits
        mid = (low + high) // 2
        low, high = (low, mid) if lprobe(mid)[1] else (mid + 1, high)
    return lprobe(low)[0]


@pytest.mark.parametrize("layers, stages", [(106, 12), (70, 12), (82, 12), (94, 12), (100, 6), (10, 4), (7, 3)])
def test_deepspeeds_split_gives_each_embedding_a_blocks_slot(layers, stages):
    """Training.pipeline_split 'slots' cuts the blocks as DeepSpeed's partition_balanced over
    `type:transformer|embedding` does (the input embedding, the blocks and the tied output embedding, each of
    weight 1): BLOOM's 106 blocks on 12 stages put the embedding and 8 blocks on the first."""
    from shardwise.planner.memory import pipeline_layers, slot_split

    bounds = _deepspeed_partition_balanced([1] * (layers + 2), stages)
    expected = [range(max(a - 1, 0), min(b - 1, layers)) for a, b in zip(bounds, bounds[1:])]
    assert slot_split(layers, stages) == expected
    assert sum(map(len, expected)) == layers
    if (layers, stages) == (106, 12):
        assert [len(r) for r in expected] == [8] + [9] * 10 + [8]
    # the planner's stages follow the system's split: a large vocabulary makes the engine's cost split put 7 of 8
    # blocks on the first stage, DeepSpeed's 4; the first stage's fp32 weights are the embedding and its blocks
    from shardwise.planner.memory import layer_params

    args = ModelArgs(dim=64, n_layers=8, n_heads=4, n_kv_heads=4, ffn_hidden=256, vocab_size=32000, max_seq_len=128)
    plan = Plan(pp=2, micro_batch=1, grad_accum=8)
    assert pipeline_layers(args, plan, 128) == (7, 1)
    assert pipeline_layers(args, plan, 128, "slots") == tuple(map(len, slot_split(args.n_layers, 2))) == (4, 4)
    for split, blocks in (("cost", 7), ("slots", 4)):
        training = Training(seq_len=128, global_batch=8, pipeline_split=split)
        held = stage_memory(args, training, plan, 0)["params"]
        assert held == 4 * (args.vocab_size * args.dim + blocks * layer_params(args)), split


def test_bf16_optimizer_segments_are_the_largest_parameter_and_group():
    """Under DeepSpeed's BF16_Optimizer (keeps_bf16_grads), the first stage of BLOOM's 12288 x 106 layout (tp 4, pp
    12, DeepSpeed's split: the embedding, its norm's weight and 8 blocks) keeps two segments: an fp32 copy of its
    largest gradient, the embedding's, and a bf16 copy of the larger of Megatron-DeepSpeed's two weight-decay
    halves (17 tensors each: the embedding, the norm's weight and 15 of the blocks' 32 matrices). By hand."""
    from shardwise.planner.memory import bf16_optimizer_segments

    h, v, t = 12288, 250880, 4
    args = ModelArgs(name="bloom-12288x106", dim=h, n_layers=106, n_heads=64, n_kv_heads=64, ffn_hidden=4 * h,
                     vocab_size=v, mlp="gelu", tie_embeddings=True)
    plan = Plan(tp=4, pp=12, dp_replicate=8, zero_stage=1, micro_batch=2, grad_accum=128,
                activation_checkpoint="full")
    training = Training(seq_len=2048, global_batch=2048, layout="megatron", keeps_bf16_grads=True,
                        pipeline_split="slots", embedding_norm=True, dropout=True, fused_attention=False)
    emb, block = v * h / t, [3 * h * h / t, h * h / t, 4 * h * h / t, 4 * h * h / t]
    first_half = emb + h + 3 * sum(block) + sum(block[:3])
    assert bf16_optimizer_segments(args, training, plan, 0) == pytest.approx(4 * emb + 2 * first_half)
    middle = 9 * block  # 36 tensors: halves of 18, each 4 1/2 blocks
    assert bf16_optimizer_segments(args, training, plan, 5) == pytest.approx(
        4 * 4 * h * h / t + 2 * max(sum(middle[:18]), sum(middle[18:])))
    # without the BF16 optimizer, nothing
    assert bf16_optimizer_segments(args, dataclasses.replace(training, keeps_bf16_grads=False), plan, 0) == 0
    # the embedding norm's bf16 input, its fp32 statistics and the dropout's mask, beside the token ids
    assert embedding_activation_bytes(args, training, plan) == 2 * 2048 * (8 + h * 3 + 8)
    plain = dataclasses.replace(training, embedding_norm=False)
    assert embedding_activation_bytes(args, plain, plan) == 2 * 2048 * 8


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_pinned_operator_counts_are_what_the_model_dispatches(gqa, tied, precision):
    """The planner reads operator counts from a table (it imports no torch); counted again on the real model and
    optimizer step under this torch (and the precision's autocast), they are the table's; the planner counts the
    engine's casts (layout 'torch') in bf16 and fp16 only, and another system's bf16 weights need none."""
    from shardwise.planner.opcount import live_op_counts
    from shardwise.planner.operators import op_counts

    args = ModelArgs(n_heads=4, n_kv_heads=2 if gqa else 4, tie_embeddings=tied)
    assert live_op_counts(args, precision) == op_counts(args, precision != "fp32")
    assert Training(precision=precision).autocasts == (precision != "fp32")
    assert not Training(precision=precision, layout="fsdp-mp").autocasts


def test_the_attentions_flops_are_as_wide_as_its_queries():
    """QK^T and AV are n_heads x head_dim wide, not dim (Mistral NeMo: heads of 128, queries 4096 wide on a residual
    of 5120): the fused kernel's time is 0.5 x 4 x tokens x s x d_q / tp at its share of the peak (2.5 x that in
    backward); the unfused batched GEMMs' matmul part is twice that at the matmul rate, the s x s element passes
    (one per head) unchanged."""
    from shardwise.planner.timing import layer_times

    nemo, acc = preset("mistral-nemo-12b"), accelerator("h100")
    plan = Plan(tp=2, micro_batch=2, grad_accum=1)
    training = Training(seq_len=4096, global_batch=2)
    t = layer_times(nemo, training, plan, acc)
    peak = acc.peak(training.compute_dtype)
    share = acc.attention_eff(4096, 128, training.attention_kernel)
    assert t["attention"] == pytest.approx(0.5 * 4 * 8192 * 4096 * 4096 / 2 / (peak * share), rel=1e-12)
    assert t["attention_bwd"] == pytest.approx(2.5 * t["attention"], rel=1e-12)
    unfused = dataclasses.replace(training, fused_attention=False)
    as_wide = dataclasses.replace(nemo, attn_head_dim=160)  # queries as wide as the residual, the same heads
    gemms = [layer_times(m, unfused, plan, acc)["attention"] for m in (nemo, as_wide)]
    assert gemms[1] - gemms[0] == pytest.approx(4 * 8192 * 4096 * 1024 / 2 / (peak * acc.matmul_efficiency),
                                                rel=1e-9)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_eager_elementwise_traffic_is_what_the_engines_block_reads_and_writes(precision):
    """The eager elementwise traffic is read from a table; counted again on the engine's block it is the table's;
    the table's coefficients give the traffic of blocks of other shapes exactly (counted on each); its ffn
    coefficients and the forward of both norm forms are hand counts; and the time model charges those bytes at
    the elementwise bandwidth: the engine's norms on a CPU, torch's fused kernel in their place on a GPU, or
    torch's composite form."""
    from shardwise.planner.opcount import block_elementwise_bytes, elementwise_traffic
    from shardwise.planner.operators import ELEMENTWISE
    from shardwise.planner.timing import eager_elementwise_bytes, layer_times

    table = ELEMENTWISE[precision]
    assert elementwise_traffic(precision) == table
    for dim, heads, kv_heads, ffn, head in ((96, 6, 3, 224, 0), (256, 16, 4, 768, 0), (64, 2, 1, 96, 0),
                                             (64, 4, 2, 96, 24), (96, 12, 4, 160, 16)):
        head = head or dim // heads
        widths = (dim, heads * head, kv_heads * head, ffn, head, 1)
        predicted = [sum(c * w for c, w in zip(coefficients, widths)) for coefficients in (table.forward,
                                                                                           table.backward)]
        assert list(block_elementwise_bytes(precision, dim, heads, kv_heads, ffn, head)) == pytest.approx(
            predicted, rel=1e-9)
    # forward: silu reads h1 and writes its output, the product reads both operands and writes one (5 passes);
    # backward: the product's two gradients (read g and an operand, write one: 6), silu_backward (read g and h1,
    # write one: 3); every one of these tensors in the matmuls' output dtype
    size = 4 if precision == "fp32" else 2
    assert table.forward[3] == 5 * size and table.backward[3] == 9 * size
    # each RMSNorm's forward on the fp32 residual, two norms a block. The engine's: the norm reads x, x * rstd
    # reads x and writes, * weight reads and writes in place: 5 fp32 passes per element. torch's composite: pow
    # (read, write), mean (read), x * rstd (read, write), * weight (read, write): 7
    assert table.norm_forward == 2 * 5 * 4 and table.composite_forward == 2 * 7 * 4

    args = preset("llama3-8b")
    gpu = accelerator("h100")
    cpu = dataclasses.replace(gpu, name="cpu-bench", launch_async=False)  # what shardwise bench writes on a CPU
    bandwidth = gpu.mem_bandwidth * gpu.bandwidth_efficiency
    plan = Plan(micro_batch=1, grad_accum=1)
    for acc, fused_norm in ((gpu, False), (gpu, True), (cpu, True)):
        training = Training(seq_len=2048, global_batch=1, precision=precision, elementwise="eager",
                            fused_rmsnorm=fused_norm)
        t = layer_times(args, training, plan, acc)
        forward = sum(c * w for c, w in zip(table.forward, (4096, 4096, 1024, 14336, 128, 1)))
        backward = sum(c * w for c, w in zip(table.backward, (4096, 4096, 1024, 14336, 128, 1)))
        if not fused_norm:  # torch's composite norms in place of the engine's
            forward += 4096 * (table.composite_forward - table.norm_forward)
            backward += 4096 * (table.composite_backward - table.norm_backward)
        elif acc is gpu:  # fp32 residual stream: 2 norms x (read + write), and x (read 2, write 1) in backward
            forward += 4096 * (2 * 2 * 4 - table.norm_forward)
            backward += 4096 * (2 * 3 * 4 - table.norm_backward)
        assert eager_elementwise_bytes(args, training, plan, cpu=acc is cpu) == pytest.approx(
            (forward, backward), rel=1e-12)
        assert (t["elementwise"], t["elementwise_bwd"]) == pytest.approx((2048 * forward / bandwidth,
                                                                          2048 * backward / bandwidth), rel=1e-12)
    # heads of 128 on a residual of 5120 (queries 4096 wide), under tp 2: the query, KV and ffn widths are
    # split, the residual's only with sequence parallelism
    nemo = preset("mistral-nemo-12b")
    training = Training(seq_len=2048, global_batch=1, precision=precision, elementwise="eager", fused_rmsnorm=True)
    for sp in (False, True):
        split = Plan(tp=2, micro_batch=1, grad_accum=1, sequence_parallel=sp)
        widths = (5120 / (2 if sp else 1), 4096 / 2, 1024 / 2, 14336 / 2, 128, 1)
        forward = sum(c * w for c, w in zip(table.forward, widths)) + widths[0] * (2 * 2 * 4 - table.norm_forward)
        backward = sum(c * w for c, w in zip(table.backward, widths)) + widths[0] * (2 * 3 * 4 - table.norm_backward)
        assert eager_elementwise_bytes(nemo, training, split) == pytest.approx((forward, backward), rel=1e-12)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pinned_qlora_dequantisation_is_what_the_engines_block_dispatches(precision):
    """QLoRA's dequantisation cost is read from a table; counted again on the engine's QLoRA block against its LoRA
    block under this torch and torchao, it is the table's; and it is priced: QLoRA's step is the LoRA step plus
    those bytes at the elementwise bandwidth, three passes per micro-batch with recompute."""
    from shardwise.planner.opcount import qlora_dequant_counts
    from shardwise.planner.operators import QLORA_DEQUANT
    from shardwise.planner.timing import stage_cost

    cost = QLORA_DEQUANT[precision]
    assert qlora_dequant_counts(precision) == (cost.forward_ops, cost.forward_bytes, cost.backward_ops,
                                               cost.backward_bytes)
    args, cluster = preset("llama3-8b"), Cluster(accelerator("h100"), 1)
    plan = Plan(micro_batch=1, grad_accum=1, activation_checkpoint="full")
    lora, qlora = (stage_cost(args, Training(seq_len=2048, global_batch=1, precision=precision, lora_rank=16,
                                             qlora=q), plan, cluster) for q in (False, True))
    weights = args.n_layers * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    acc = cluster.accelerator
    seconds = weights * (2 * cost.forward_bytes + cost.backward_bytes) / (acc.mem_bandwidth * acc.bandwidth_efficiency)
    assert qlora.compute + qlora.recompute - lora.compute - lora.recompute == pytest.approx(seconds, rel=1e-9)


@pytest.mark.parametrize("extra", [[], ["--lora-rank", "16"], ["--lora-rank", "16", "--qlora"],
                                   ["--lora-rank", "16", "--lora-targets", "wq,wv"], ["--optimizer", "adamw8bit"]])
def test_one_gpu_plans_are_written_with_every_knob_and_train_accepts_them(tmp_path, extra, capsys):
    """Llama 3 8B on one H100: the plan the search picks (offload, LoRA, QLoRA, 8-bit state) is written as a config
    that the engine's validation accepts unchanged, with the recipe's knobs in it, not silently dropped."""
    from shardwise.config import load_config

    path = tmp_path / "plan.toml"
    argv = ["--model", "llama3-8b", "--gpus", "1", "--gpu", "h100", "--json", "--write-config", str(path), *extra]
    assert run_plan(_ns(*argv)) == 0, capsys.readouterr().err
    best = json.loads(capsys.readouterr().out)["plans"][0]
    cfg = load_config(path)
    assert cfg.parallel.offload == best["offload"] and cfg.parallel.world_size == 1
    assert cfg.lora.rank == (16 if extra[:1] == ["--lora-rank"] else 0)
    assert cfg.lora.qlora == ("--qlora" in extra)
    assert cfg.lora.targets == (["wq", "wv"] if "--lora-targets" in extra else list(LORA_TARGETS))
    assert cfg.optim.name == (extra[1] if extra[:1] == ["--optimizer"] else "adamw")
    # planned again from the written config (a new user's round trip): the same job, so the same plan; its
    # sequence length, adapters and optimizer came from [model] alone before (full fine-tuning at the default
    # length, with AdamW)
    again = ["--model", str(path), "--gpus", "1", "--gpu", "h100", "--json"]
    assert run_plan(_ns(*again)) == 0
    out = capsys.readouterr()
    keys = ("dp", "tp", "pp", "zero_stage", "micro_batch", "grad_accum", "activation_checkpoint", "offload")
    assert {k: json.loads(out.out)["plans"][0][k] for k in keys} == {k: best[k] for k in keys}
    assert f"--model {path}: its [model], data.seq_len 4096" in out.err
    assert ("lora.rank 16" in out.err) == (extra[:1] == ["--lora-rank"])
    assert ("lora.targets wq,wv (--lora-targets)" in out.err) == ("--lora-targets" in extra)
    assert "optim.name adamw" in out.err


def test_a_jobs_lora_targets_and_dropout_are_planned(tmp_path, capsys):
    """`plan --model job.toml` takes lora.targets (adapters, NF4 and activations on those projections alone) and
    lora.dropout (its masks and dropped copies); it took lora.rank alone and priced every projection, silently, and
    until 2026-12-03 said that dropout was not priced."""
    from shardwise.planner.memory import lora_params

    path = tmp_path / "job.toml"
    path.write_text('[model]\nname = "llama3-8b"\n[lora]\nrank = 16\ndropout = 0.05\ntargets = ["wq", "wv"]\n')
    assert run_plan(_ns("--model", str(path), "--gpus", "1", "--gpu", "h100", "--json")) == 0
    out = capsys.readouterr()
    assert "lora.targets wq,wv (--lora-targets), lora.dropout 0.05 (--lora-dropout)" in out.err
    assert json.loads(out.out)["training"]["lora_dropout"] == 0.05
    # the table's first line says the recipe (it said "bf16 adamw", as for full training)
    assert run_plan(_ns("--model", str(path), "--gpus", "1", "--gpu", "h100")) == 0
    assert "bf16 adamw, LoRA r16 on wq,wv, dropout 0.05;" in capsys.readouterr().out.splitlines()[0]
    some = Training(seq_len=4096, global_batch=1, lora_rank=16, lora_targets=("wq", "wv"))
    every = Training(seq_len=4096, global_batch=1, lora_rank=16)
    args = preset("llama3-8b")
    assert lora_params(args, some) == 16 * (2 * 4096 + 4096 + 1024) < lora_params(args, every) / 5
    assert run_plan(_ns("--model", str(path), "--gpus", "1", "--gpu", "h100", "--json", "--lora-targets",
                        ",".join(LORA_TARGETS))) == 0
    # the adapters' fp32 bytes with the frozen base (one GPU: nothing sharded)
    some_gib, every_gib = (json.loads(text)["plans"][0]["memory_gib"]["params"] for text in
                           (out.out, capsys.readouterr().out))
    assert every_gib - some_gib == pytest.approx(32 * (lora_params(args, every) - lora_params(args, some)) * 4 / GiB,
                                                 abs=0.002)


@pytest.mark.parametrize("targets, sets", [(LORA_TARGETS, []), (["w1"], []),
                                           (["wq", "wv", "w2"], ["lora.dropout=0.05"])],
                         ids=["every-projection", "w1-alone", "qv2-dropout"])
def test_an_adapted_models_activations_equal_the_simulators(targets, sets):
    """LoRA under bf16 autocast, Llama 3 8B cut to one and two blocks, 2,048 tokens: the step's activations and peak
    equal the simulator's to 1.5 MiB, and so does what a block adds. The planner priced the first block as every
    other (under LoRA it keeps nothing upstream of its first adapter: 17% high on activations with w1 alone), left
    out x A^T and the adapters' compute-dtype copies (2.9 MiB a block) and the fused head's input through the
    loss's forward (32 MiB)."""
    from shardwise.config import with_overrides
    from shardwise.simulate import config_from_plan, planner_prediction, simulate_rank

    figures = []
    for layers in (1, 2):
        cfg = with_overrides(config_from_plan("llama3-8b", "dp=1", 1, seq_len=2048, micro_batch=1, precision="bf16"),
                             ["lora.rank=16", f"lora.targets={list(targets)!r}", *sets])
        cfg.model = dataclasses.replace(cfg.model, n_layers=layers)
        measured, predicted = simulate_rank(cfg, 1, 0).peak_step, planner_prediction(cfg, 0)
        assert predicted["activations"] == pytest.approx(measured.peak["activations"], abs=1.5 * 2**20), layers
        assert predicted["total"] == pytest.approx(measured.peak_bytes, abs=1.5 * 2**20), layers
        figures.append((measured.peak["activations"], predicted["activations"]))
    assert figures[1][1] - figures[0][1] == pytest.approx(figures[1][0] - figures[0][0], abs=2**17)


@pytest.mark.parametrize("precision, targets, plan", [
    ("bf16", LORA_TARGETS, "dp=1"), ("fp32", LORA_TARGETS, "dp=1"), ("bf16", ["wq", "wv", "w2"], "dp=1"),
    ("bf16", ["wo"], "dp=1"), ("fp32", ["w2"], "dp=1"), ("bf16", LORA_TARGETS, "tp=2,sequence_parallel=true")],
    ids=["all-bf16", "all-fp32", "qv2", "wo", "w2-fp32", "tp-sp"])
def test_lora_dropout_adds_what_the_simulator_measures(precision, targets, plan):
    """What lora.dropout = 0.05 adds to a step's peak activations, planner against simulator (the engine's LoRA
    step on fake tensors, dropout as a GPU runs it: simulate.gpu_dropout), Llama 3 8B cut to 2 blocks, 2,048
    tokens: each adapter keeps a one-byte mask of its input and its own dropped copy (under bf16 autocast a cast it
    kept anyway; in fp32 the norm's output, shared before, once per adapter; wo's beside the attention's output),
    none of it where the input needs no gradient (the first block's q, k and v: its input comes from the frozen
    embedding). Equal to the byte but for the fake process group's rounding (within 0.5 MiB)."""
    from shardwise.config import with_overrides
    from shardwise.simulate import config_from_plan, planner_prediction, simulate_rank

    world = 2 if "tp" in plan else 1
    added = []
    for dropout in (0.0, 0.05):
        cfg = with_overrides(config_from_plan("llama3-8b", plan, world, seq_len=2048, micro_batch=1,
                                              precision=precision),
                             ["lora.rank=16", f"lora.targets={list(targets)!r}", f"lora.dropout={dropout}"])
        cfg.model = dataclasses.replace(cfg.model, n_layers=2)
        measured = simulate_rank(cfg, world, 0).peak_step
        added.append((measured.peak["activations"], planner_prediction(cfg, 0)["activations"]))
    simulator, planner = (added[1][i] - added[0][i] for i in (0, 1))
    assert simulator > 0 and planner == pytest.approx(simulator, abs=2**19)


def test_a_written_config_plans_again_with_the_batch_it_holds(tmp_path, capsys):
    """--write-config writes micro_batch x grad_accum (no train.global_batch): planned again from that file, the
    job's batch (32 sequences here) is the batch, not the 4M-token default (2048 sequences at 2K), also on a world
    other than the one it was written for; a job that sets no degree runs data parallel over --gpus."""
    path = tmp_path / "plan.toml"
    argv = ["--model", "llama3-8b", "--gpus", "8", "--seq-len", "2048", "--global-batch", "32", "--json",
            "--write-config", str(path)]
    assert run_plan(_ns(*argv)) == 0, capsys.readouterr().err
    capsys.readouterr()
    for gpus in ("8", "16"):
        assert run_plan(_ns("--model", str(path), "--gpus", gpus, "--json")) == 0
        out = capsys.readouterr()
        assert json.loads(out.out)["training"]["global_batch"] == 32, out.err
        assert "= 32 sequences (--global-batch)" in out.err
    # a flag given wins
    assert run_plan(_ns("--model", str(path), "--gpus", "8", "--global-batch", "64", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["training"]["global_batch"] == 64
    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "debug"\n\n[train]\nmicro_batch = 4\ngrad_accum = 2\n')
    assert run_plan(_ns("--model", str(job), "--gpus", "2", "--json")) == 0
    training = json.loads(capsys.readouterr().out)["training"]
    # a job trains at its precision, the engine's fp32 where it sets none (it was planned at bf16)
    assert (training["global_batch"], training["precision"]) == (4 * 2 * 2, "fp32")
    # a [model] table alone sets neither: the flags' defaults, as for a preset (min(4096, max_seq_len) tokens, 4M
    # tokens a step), not the config's own (256 tokens, 16 sequences a rank)
    job.write_text('[model]\nname = "mine"\ndim = 256\nn_layers = 2\nn_heads = 4\nvocab_size = 1000\n'
                   'max_seq_len = 1024\n')
    assert run_plan(_ns("--model", str(job), "--gpus", "2", "--json")) == 0
    training = json.loads(capsys.readouterr().out)["training"]
    assert (training["seq_len"], training["global_batch"]) == (1024, 4 * 2**20 // 1024)


JOB = """[model]
name = "llama3-8b"

[data]
paths = ["/no/such/corpus \\"v2\\".jsonl"]
seq_len = 2048

[optim]
name = "adamw8bit"
lr = 2e-4
warmup_steps = 100

[train]
steps = 5000
micro_batch = 2
global_batch = 64
precision = "fp16"
compile = true
val_every = 250

[lora]
rank = 16
alpha = 32.0
dropout = 0.05
targets = ["wq", "wv"]

[metrics]
out_dir = "runs/my-lora"
"""


def test_a_config_written_from_a_job_keeps_the_jobs_settings(tmp_path, capsys):
    """`plan --model job.toml --write-config` writes the job with the plan's layout, batch split, precision, compile,
    sequence length, optimizer and adapter shape put in: it wrote a config of its own, which trained the defaults'
    learning rate, schedule, steps, data and lora.alpha/dropout (0.0: the job's 0.05 dropped without a word). The job
    is planned at its own precision, optimizer and compile (it was planned at bf16 AdamW whatever it trained), and
    its data, on the cluster it runs on, is said not to be here."""
    job, out = tmp_path / "job.toml", tmp_path / "planned.toml"
    job.write_text(JOB)
    assert run_plan(_ns("--model", str(job), "--gpus", "8", "--json", "--write-config", str(out))) == 0
    printed = capsys.readouterr()
    planned = json.loads(printed.out)
    assert {k: planned["training"][k] for k in ("precision", "optimizer", "compile", "seq_len", "global_batch")} == \
        {"precision": "fp16", "optimizer": "adamw8bit", "compile": True, "seq_len": 2048, "global_batch": 64}
    assert "data.paths is not on this machine" in printed.err
    with pytest.raises(ConfigError, match="data.paths"):
        load_config(out)
    ours, theirs = load_config(out, sizing=True), load_config(job, sizing=True)
    plan = planned["plans"][0]
    assert {k: getattr(ours.parallel, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "zero_stage")} == \
        {k: plan[k] for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "zero_stage")}
    # all but the layout is the job's: its batch as it gave it (global_batch, the accumulation it decides)
    assert dataclasses.replace(ours, parallel=theirs.parallel, checkpoint=theirs.checkpoint,
                               train=dataclasses.replace(ours.train, micro_batch=2)) == theirs
    assert ours.checkpoint.enabled and ours.train.global_batch == 64
    # planned again, the written config is the same job and the same plan
    assert run_plan(_ns("--model", str(out), "--gpus", "8", "--json")) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["training"] == planned["training"] and again["plans"][0] == plan
    # a flag given wins, and writes what it planned
    assert run_plan(_ns("--model", str(job), "--gpus", "8", "--precision", "bf16", "--no-compile",
                        "--write-config", str(out))) == 0
    capsys.readouterr()
    ours = load_config(out, sizing=True)
    assert (ours.train.precision, ours.train.compile, ours.lora.dropout) == ("bf16", False, 0.05)
    assert run_plan(_ns("--model", str(job), "--gpus", "8", "--lora-dropout", "0", "--write-config", str(out))) == 0
    assert load_config(out, sizing=True).lora.dropout == 0.0


@pytest.mark.parametrize("parallel, train", [
    ("tp = 2\ndp_shard = 4\nzero_stage = 3\n", "micro_batch = 2\ngrad_accum = 4\n"),
    ("pp = 2\ntp = 2\npp_microbatches = 4\nactivation_checkpoint = \"full\"\n", "micro_batch = 8\n")],
    ids=["fsdp-tp", "pipeline"])
def test_a_jobs_own_layout_is_named_for_plan(tmp_path, parallel, train, capsys):
    """A job's [parallel] is searched over (the planner's job), and plan says so with the --plan that sizes the
    job's own layout (it searched silently): passed back, that --plan is the job's degrees and batch split, a
    pipeline's micro-batches as its accumulation."""
    job = tmp_path / "job.toml"
    job.write_text(f'[model]\nname = "llama3-8b"\n[data]\nseq_len = 2048\n[train]\n{train}[parallel]\n{parallel}')
    assert run_plan(_ns("--model", str(job), "--gpus", "8", "--json")) == 0
    hint = re.search(r'its own layout: --plan "([^"]+)"', capsys.readouterr().err)
    assert hint, "no --plan named"
    assert run_plan(_ns("--model", str(job), "--gpus", "8", "--json", "--plan", hint[1])) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]
    cfg = load_config(job)
    fit_world(cfg, 8)
    degrees = ("dp_replicate", "dp_shard", "tp", "pp", "zero_stage", "activation_checkpoint")
    assert {k: best[k] for k in degrees} == {k: getattr(cfg.parallel, k) for k in degrees}
    micro = cfg.parallel.n_microbatches if cfg.parallel.pp > 1 else 1
    assert (best["micro_batch"] * best["grad_accum"], best["grad_accum"]) == \
        (cfg.train.micro_batch * cfg.train.grad_accum, cfg.train.grad_accum * micro)


def test_a_job_whose_files_live_elsewhere_is_planned(tmp_path, capsys):
    """A job's data, tokenizer and Hugging Face folder are the run's, on its cluster: plan sizes the job without them
    (it refused the config for data.paths until 2026-12-02), while train still refuses it in one line."""
    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "debug"\n\n[data]\npaths = ["/no/such/corpus.jsonl"]\n'
                   'tokenizer = "/no/such/tokenizer.json"\n\n[checkpoint]\ninit_from_hf = "/no/such/base"\n')
    assert run_plan(_ns("--model", str(job), "--gpus", "2", "--json")) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["parameters"]["total"] == num_params(preset("debug"))
    with pytest.raises(ConfigError, match="data.paths"):
        load_config(job)


def test_a_gelu_model_in_a_toml_is_planned(tmp_path, capsys):
    """model.mlp = "gelu" is the planner's (GPT-style blocks); a TOML describing one was refused by the engine's check
    with "that is for `shardwise plan` only", by `shardwise plan` itself. Its parameters by hand: per block
    4 d^2 (MHA) + 2 d f + 2 d norms, the final norm, one tied vocabulary matrix."""
    d, layers, f, vocab = 256, 2, 1024, 1000
    job = tmp_path / "gpt.toml"
    job.write_text(f'[model]\nname = "gpt-like"\ndim = {d}\nn_layers = {layers}\nn_heads = 4\nn_kv_heads = 4\n'
                   f'ffn_hidden = {f}\nvocab_size = {vocab}\nmlp = "gelu"\ntie_embeddings = true\n')
    assert run_plan(_ns("--model", str(job), "--gpus", "2", "--json")) == 0, capsys.readouterr().err
    total = layers * (4 * d * d + 2 * d * f + 2 * d) + d + vocab * d
    assert json.loads(capsys.readouterr().out)["parameters"]["total"] == total == 1_830_144
    assert run_plan(_ns("--model", str(job), "--gpus", "2", "--write-config", str(tmp_path / "x.toml"))) == 2
    assert "model.mlp" in capsys.readouterr().err and not (tmp_path / "x.toml").exists()


def test_qlora_is_priced_under_every_precision_the_planner_takes(capsys):
    """fp32, bf16 and fp16 are priced; fp8, torchao's float8 training of the linears, which nothing here runs on an
    NF4 base (or under LoRA), is refused in one line naming --precision."""
    for precision in ("fp32", "bf16", "fp16", "fp8"):
        argv = ["--model", "llama3-8b", "--gpus", "1", "--gpu", "h100", "--precision", precision,
                "--lora-rank", "16", "--qlora"]
        assert run_plan(_ns(*argv)) == (2 if precision == "fp8" else 0), capsys.readouterr().err
    err = capsys.readouterr().err
    assert "--precision" in err and "QLoRA" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag, value", [("--layout", "zero"), ("--attention", "unfused"), ("--dropout", None)])
def test_write_config_refuses_a_recipe_the_engine_does_not_run(tmp_path, flag, value, capsys):
    argv = ["--model", "llama3-8b", "--gpus", "8", "--write-config", str(tmp_path / "x.toml"), flag,
            *([value] if value else [])]
    assert run_plan(_ns(*argv)) == 2
    assert f"--write-config {flag}" in capsys.readouterr().err


def test_write_config_names_the_knob_for_the_fsdp_policy(tmp_path, capsys):
    """--layout fsdp-mp is the recipe the engine runs under parallel.mixed_precision = 'fsdp'; refused as "the
    engine stores state as torch does, not as fsdp-mp; fix: plan with --layout torch", the user was not told that
    the engine runs it, nor how to ask for it."""
    argv = ["--model", "llama3-8b", "--gpus", "8", "--write-config", str(tmp_path / "x.toml"), "--layout", "fsdp-mp"]
    assert run_plan(_ns(*argv)) == 2
    err = capsys.readouterr().err
    assert "--write-config --layout" in err and "--plan mixed_precision=fsdp" in err, err
    assert not (tmp_path / "x.toml").exists()
    argv = ["--model", "llama3-8b", "--gpus", "8", "--write-config", str(tmp_path / "x.toml"), "--plan",
            "mixed_precision=fsdp"]
    assert run_plan(_ns(*argv)) == 0
    assert 'mixed_precision = "fsdp"' in (tmp_path / "x.toml").read_text()


def test_fsdp_mixed_precision_is_a_searched_knob_the_engine_runs(tmp_path, capsys):
    """parallel.mixed_precision = 'fsdp' (the engine's FSDP2 MixedPrecisionPolicy) is a plan knob: the search tries it
    where FSDP shards, in bf16 under the system shardwise, and prices it as the layout 'fsdp-mp' (bf16 gathers, bf16
    residual stream: less memory and traffic than autocast's fp32 gathers; the head still fused with the loss);
    --write-config writes it and the engine's validation takes it. Where it cannot run, --plan's key is refused in
    one line: fp32, another system's recipe, ZeRO-1."""
    from shardwise.config import load_config
    from shardwise.planner.workload import recipe_for

    args, cluster = preset("llama3-8b"), Cluster(accelerator("h100"), 8)
    training = Training(seq_len=4096, global_batch=64)
    # the search tries both where FSDP shards, in bf16 only; --plan fixes one
    space = list(plan_space(args, training, cluster, {"dp_shard": 8, "zero_stage": 3}))
    assert {p.mixed_precision for p in space} == {"autocast", "fsdp"}
    fixed = list(plan_space(args, training, cluster, {"dp_shard": 8, "zero_stage": 3, "mixed_precision": "fsdp"}))
    assert 2 * len(fixed) == len(space) and {p.mixed_precision for p in fixed} == {"fsdp"}
    fp32_space = plan_space(args, dataclasses.replace(training, precision="fp32"), cluster, {"dp_shard": 8})
    assert {p.mixed_precision for p in fp32_space} == {"autocast"}
    unsharded = plan_space(args, training, cluster, {"dp_replicate": 8})
    assert {p.mixed_precision for p in unsharded} == {"autocast"}
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=1, grad_accum=8, activation_checkpoint="full")
    fsdp = dataclasses.replace(plan, mixed_precision="fsdp")
    priced = recipe_for(training, fsdp)
    assert priced.layout == "fsdp-mp" and priced.fuses_head and recipe_for(training, plan) is training
    autocast_ev, fsdp_ev = (evaluate(args, training, p, cluster) for p in (plan, fsdp))
    assert fsdp_ev.memory["total"] < autocast_ev.memory["total"]
    assert fsdp_ev.time.comm_total_s < autocast_ev.time.comm_total_s

    path = tmp_path / "plan.toml"
    argv = ["--model", "llama3-8b", "--gpus", "8", "--plan", "dp_shard=8,zero_stage=3,mixed_precision=fsdp",
            "--json", "--write-config", str(path)]
    assert run_plan(_ns(*argv)) == 0, capsys.readouterr().err
    best = json.loads(capsys.readouterr().out)["plans"][0]
    cfg = load_config(path)
    assert cfg.parallel.mixed_precision == best["mixed_precision"] == "fsdp" and cfg.train.precision == "bf16"
    for extra, problem in ((["--precision", "fp32"], "--precision is fp32"), (["--system", "torchtitan"], "torchtitan"),
                           (["--plan", "dp=8,zero_stage=1,mixed_precision=fsdp"], "zero_stage is 1")):
        plan_flag = [] if extra[0] == "--plan" else ["--plan", "dp_shard=8,zero_stage=3,mixed_precision=fsdp"]
        assert run_plan(_ns("--model", "llama3-8b", "--gpus", "8", *plan_flag, *extra)) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--plan mixed_precision" in err[0] and problem in err[0], err


def test_opt_175b_fits_as_it_ran_and_its_throughput_is_the_chronicles():
    """OPT-175B (benchmarks/planner_published.py): the paper's 147 TFLOP/s per GPU is what the team's chronicle
    planned, 300B tokens in 33 days on 1,024 A100s, counted with Narayanan's eq. 3; and metaseq's layout (tp 8,
    ZeRO-2 over 124 ranks, 8 sequences each, distributed checkpoints) fits the 80 GB it ran on."""
    pp, runs = _published("OPT")
    (run,) = runs
    tokens_per_gpu_s = 300e9 / (33 * 86400 * 1024)
    assert pp.eq3_flops(run.model, 1, run.seq) * tokens_per_gpu_s / run.seq / 1e12 == pytest.approx(147, rel=0.01)
    ev, fits = pp.given_plan(run)
    assert fits and ev.plan.zero_stage == 2 and ev.plan.tp == 8 and ev.plan.micro_batch == 8


def test_bloom_layout_search_rows_agree_with_the_production_log():
    """BLOOM's layout search (benchmarks/planner_published.py, chronicles-prequel.md, 2022-02-28) timed the layout
    BLOOM then trained with (NHIDDEN 14336, 70 layers, 112 heads, DP 8 TP 4 PP 12 MBS 2) at 104.50 s/it; the
    production log's iteration, an independent source, is 104.70 s. Every search row holds 384 GPUs and a batch of
    2,048 sequences, and the OOM rows have no time."""
    pp, runs = _published("BigScience")
    (bloom,) = [r for r in runs if r.name.startswith("BigScience 14336x70 a112 d8 t4 p12 mb2")]
    (log,) = _published("BLOOM 176B")[1]
    assert bloom.step_s == pytest.approx(log.step_s, rel=0.01)
    assert all(r.gpus == 384 and r.batch == 2048 and (r.step_s is None) == (not r.fitted) for r in runs)
    assert sum(not r.fitted for r in runs) == 3
    # each row's seconds per iteration and TFLOPs, transcribed apart, agree through Narayanan's eq. 3 (the count
    # BigScience used from 2022-02-21: Megatron-DeepSpeed PR 251)
    for r in (r for r in runs if r.fitted):
        assert pp.eq3_flops(r.model, r.batch, r.seq) / (r.step_s * r.gpus) / 1e12 == pytest.approx(r.tflops,
                                                                                                      rel=5e-4), r.name


def test_one_device_diagnosis_names_the_largest_micro_batch_that_fits():
    """Llama 3 8B with LoRA on one H100: the fastest plan runs micro-batch 1 (no recompute), but micro-batch 16
    fits with full recompute; the diagnosis said "at most 1 sequence(s) per pass". It names the largest that
    `evaluate` fits, and the next power of two does not fit."""
    from shardwise.planner.explain import single_device

    args, cluster = preset("llama3-8b"), Cluster(gpus=1, accelerator=accelerator("h100"))
    training = Training(seq_len=4096, global_batch=1024, lora_rank=16, precision="bf16")
    out = single_device(args, training, cluster)

    def fits(mb):
        return evaluate(args, training, Plan(micro_batch=mb, grad_accum=1024 // mb, activation_checkpoint="full"),
                        cluster).fits

    largest = out["max_micro_batch"]
    assert largest > 1 and fits(largest) and not fits(2 * largest)
    assert out["failure"] == "batch too small" and f"at most {largest} of" in out["reason"]


def test_one_device_diagnosis_says_its_model_state_holds_the_fixed_overhead():
    """Llama 3 8B on one H100: 16 bytes x 8,030,261,248 parameters is 119.7 GiB; the reason said "model state alone
    is 120.7 GiB" without saying that the 1 GiB fixed overhead was in it."""
    from shardwise.planner.explain import single_device

    args, cluster = preset("llama3-8b"), Cluster(gpus=1, accelerator=accelerator("h100"))
    out = single_device(args, Training(seq_len=4096, global_batch=1024, precision="bf16"), cluster)
    assert out["failure"] == "model too big"
    assert out["model_state_gib"] == pytest.approx(16 * num_params(args) / 2**30 + 1.0)
    assert "model state alone is 119.7 GiB (8.03B parameters), 120.7 with the 1 GiB fixed overhead, against 79.6 GiB" \
        in out["reason"], out["reason"]


def test_decision_sequence_names_the_offload_a_plan_fits_by(capsys):
    """Llama 3 8B on one H100 fits only with its state in host memory (offload=full, ZeRO-2 over a mesh of one); the
    decision sequence said "used: 2 BF16, 4 ZeRO-1/2", which on one GPU shards nothing, and never named offload."""
    assert run_plan(_ns("--model", "llama3-8b", "--gpus", "1", "--gpu", "h100")) == 0
    out = capsys.readouterr().out
    table_first = out.split("\n")[3]
    assert " full " in table_first, table_first
    line = next(s for s in out.splitlines() if s.startswith("Decision sequence"))
    # (ZeRO-3 since 2026-12-02: on one GPU ZeRO-2 keeps all of the model's gathered weights on the device)
    assert "5 FSDP (ZeRO-3) + full CPU offload" in line and line.endswith("it stops at step 5."), line
    assert run_plan(_ns("--model", "llama3-8b", "--gpus", "8", "--gpu", "h100")) == 0
    assert "offload" not in next(s for s in capsys.readouterr().out.splitlines() if s.startswith("Decision sequence"))


@pytest.mark.parametrize("gpus", [1, 8])
def test_offload_on_one_gpu_still_holds_fsdps_gathered_weights_and_gradients(gpus):
    """Offload on one GPU is FSDP2 over a mesh of one, which still copies each shard into a gathered buffer of its
    own (_fsdp_param_group's world_size == 1 path) and accumulates unsharded gradients across micro-batches. The
    planner counted no FSDP buffer there, and offered Mistral-sized ZeRO-2 plans with 55 GiB left out. ZeRO-2
    keeps every block gathered from forward to backward: with accumulation, 4 + 4 bytes a parameter (fp32 weights
    and gradients under autocast) on any number of ranks."""
    args = preset("llama3.2-1b")
    plan = Plan(dp_shard=gpus, zero_stage=2, offload="full", micro_batch=1, grad_accum=2, activation_checkpoint="full")
    ev = evaluate(args, Training(seq_len=2048, global_batch=2 * gpus), plan, Cluster(accelerator("h100"), gpus))
    assert ev.memory["params"] == 0 and ev.memory["fsdp_buffers"] >= 8 * num_params(args)


@pytest.mark.parametrize("zero, gathers", [(2, 1), (3, 2)])
def test_full_offload_moves_the_shards_as_stored_for_each_gather(zero, gathers):
    """FSDP2's CPUOffloadPolicy copies a shard to the device as it is stored, fp32 under autocast, before any cast
    (_fsdp_param.all_gather_inputs), once per micro-batch under ZeRO-2 and twice under ZeRO-3 (backward gathers
    again), and the reduced fp32 gradients back once per step. With compute that hides nothing, by hand:
    (4 + accum x gathers x 4) bytes a parameter over the host link. The planner moved 2 bytes (the compute dtype)
    twice and the weights once more per step."""
    from shardwise.planner import Accelerator, step_time

    args, accum, host = preset("llama3.2-1b"), 4, 1e9
    instant = Accelerator("instant", 1e15, {"bf16": 1e30, "fp32": 1e30}, mem_bandwidth=math.inf,
                          intra_node_bw=1e9, inter_node_bw=1e9, host_bw=host, attention_efficiency=math.inf)
    plan = Plan(zero_stage=zero, offload="full", micro_batch=1, grad_accum=accum, activation_checkpoint="full")
    t = step_time(args, Training(seq_len=512, global_batch=accum), plan, Cluster(instant, 1))
    assert t.offload_s == pytest.approx(num_params(args) * (4 + accum * gathers * 4) / host)


def test_replicates_working_copy_of_a_lora_model_is_its_weights_as_stored():
    """ZeRO-0/1 is FSDP2's replicate, FSDP over one rank: its working copy of the weights is what it gathers, a
    LoRA model's frozen projections in the compute dtype, not 4 bytes a parameter. Qwen2.5-7B-like LoRA r16 over
    cp 8 (a written plan) was 48.7 GiB to the planner and 37.4 in the simulator, parameters 40.7 against 28.7. By
    hand, Llama 3.2 1B (its head the fp32 embedding) under bf16 autocast: 2 bytes a projection weight, 4 for the
    embedding, the norms and the adapters."""
    from shardwise.planner.memory import moment_memory

    args, r = preset("llama3.2-1b"), 16
    d, kv, f, layers = args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden, args.n_layers
    projections = layers * (2 * d * d + 2 * d * kv + 3 * d * f)
    adapters = layers * r * (2 * (d + d) + 2 * (d + kv) + 3 * (d + f))
    by_hand = 2 * projections + 4 * (args.vocab_size * d + (2 * layers + 1) * d + adapters)
    tr = Training(seq_len=1024, global_batch=8, precision="bf16", lora_rank=r)
    plan = Plan(dp_replicate=2, zero_stage=0, micro_batch=1, grad_accum=4, activation_checkpoint="full")
    moments = moment_memory(args, tr, plan, 0)
    assert moments["loss_backward"]["replica_params"] == pytest.approx(by_hand)
    assert moments["end_of_backward"]["replica_params"] == pytest.approx(4 * (args.vocab_size * d + d))


def test_decision_sequence_names_the_precision_the_plan_trains_in(capsys):
    """A V100 has no bf16: its plan trains in fp16, and the decision sequence said "used: 2 BF16"."""
    argv = ["--model", "llama3.2-1b", "--gpus", "1", "--gpu", "v100", "--seq-len", "2048", "--global-batch", "8",
            "--precision", "fp16"]
    assert run_plan(_ns(*argv)) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("Decision sequence"))
    assert line.split("used: ")[1].startswith("2 FP16"), line


@pytest.mark.parametrize("key, value", [("bucket_mb", "100")])
def test_plan_refuses_a_layout_key_it_does_not_price(tmp_path, key, value, capsys):
    """--plan bucket_mb=100 was parsed, priced as 25 MB and written by --write-config as bucket_mb = 25.0: the knob
    dropped without a word. (activation_checkpoint_every was refused so too until the planner priced it.)"""
    out = tmp_path / "x.toml"
    argv = ["--model", "llama3-8b", "--gpus", "8", "--global-batch", "64", "--write-config", str(out),
            "--plan", f"dp_shard=8,activation_checkpoint=full,{key}={value}"]
    assert run_plan(_ns(*argv)) == 2
    err = capsys.readouterr().err
    assert f"--plan {key}" in err and f"parallel.{key}" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    # the defaults themselves are taken
    default = {"bucket_mb": "25"}[key]
    assert run_plan(_ns(*argv[:-1], f"dp_shard=8,activation_checkpoint=full,{key}={default}")) == 0


def test_plan_prices_and_writes_checkpointing_every_kth_block(tmp_path, capsys):
    """--plan activation_checkpoint_every=2 is priced (between every block checkpointed and none, in memory and
    time), shown in the table ('full/2') and written by --write-config; the search then tries the policies that
    checkpoint. What the planner does not price of it is refused naming the key, before any search: a mixture of
    experts, and (activation_checkpoint = none) what the engine's config refuses too."""
    out = tmp_path / "x.toml"
    argv = ["--model", "llama3-8b", "--gpus", "8", "--global-batch", "64", "--json"]
    rows = {}
    for every, recompute in ((1, "full"), (2, "full"), (1, "none")):
        assert run_plan(_ns(*argv, "--plan", f"dp_shard=8,zero_stage=3,mixed_precision=autocast,offload=none,"
                                             f"micro_batch=1,activation_checkpoint={recompute},"
                                             f"activation_checkpoint_every={every}")) in (0, 1)
        rows[every, recompute] = json.loads(capsys.readouterr().out)["plans"][0]
    mem = {k: r["memory_gib"]["total"] for k, r in rows.items()}
    step = {k: r["step_time_s"] for k, r in rows.items()}
    assert mem[1, "full"] < mem[2, "full"] < mem[1, "none"] and step[1, "none"] < step[2, "full"] < step[1, "full"]
    assert run_plan(_ns(*argv[:-1], "--write-config", str(out),
                        "--plan", "dp_shard=8,micro_batch=1,activation_checkpoint_every=2")) == 0
    table = capsys.readouterr().out
    assert re.search(r"\b(full|selective)/2\b", table), table
    assert "activation_checkpoint_every = 2" in out.read_text() and \
        load_config(out).parallel.activation_checkpoint_every == 2
    for model, keys, problem in (("mixtral-8x7b", "ep=8,activation_checkpoint_every=2", "mixture of experts"),
                                 ("llama3-8b", "activation_checkpoint=none,activation_checkpoint_every=2",
                                  "activation_checkpoint = none")):
        assert run_plan(_ns("--model", model, "--gpus", "8", "--global-batch", "64", "--plan", keys)) == 2
        err = capsys.readouterr().err
        assert "--plan activation_checkpoint_every" in err and problem in err and len(err.strip().splitlines()) == 1


def test_another_systems_table_shows_no_shardwise_knob_and_names_whose_adapters_it_priced(capsys):
    """Under --system torchtitan the bf16 column showed shardwise's knob ('autocast') beside a system line naming
    FSDP2's policy, and LoRA/QLoRA were priced as shardwise runs them without a word."""
    argv = ["--model", "llama3-8b", "--gpus", "1", "--gpu", "h100", "--lora-rank", "16", "--qlora"]
    assert run_plan(_ns(*argv, "--system", "torchtitan")) == 0
    head, table = capsys.readouterr().out.split("\n", 2)[1:3]
    assert "the adapters as shardwise runs them, whatever torchtitan has" in head and "NF4" in head
    rows = [line.split() for line in table.splitlines()[:3]]
    column = rows[0].index("bf16") - 1  # the header's "dp(rep x shard)" is three words, a row's "1 (1x1)" two
    assert rows[1][column] == rows[2][column] == "-"
    assert run_plan(_ns(*argv)) == 0
    assert "whatever" not in capsys.readouterr().out.split("\n", 2)[1]


def test_offload_is_offered_only_where_the_host_holds_what_it_moves(capsys, tmp_path):
    """The planner checked only the device: it answered Llama 3 405B on one 8-GPU node with an offload plan that
    keeps 16 bytes of each of 405B parameters (fp32 shards, gradients, AdamW's moments) in that node's RAM."""
    from shardwise.hardware import GiB
    from shardwise.planner.memory import host_bytes

    args, h100 = preset("llama3-405b"), accelerator("h100")
    assert h100.host_memory_bytes == 2048 * GiB / 8  # NVIDIA's DGX H100: 2 TB for 8 GPUs
    # a batch of 8: with accumulation FSDP would keep the whole unsharded gradients on the device (4 bytes a
    # parameter of the rank's tp shard), which no 8-GPU plan of 405B holds
    tr = Training(seq_len=4096, global_batch=8)
    # FSDP over 8 ranks with everything offloaded: each rank's host holds 1/8 of 4 + 4 + 8 bytes per parameter
    plan = Plan(dp_shard=8, zero_stage=3, offload="full", activation_checkpoint="full", micro_batch=1,
                grad_accum=1)
    assert host_bytes(args, tr, plan) == pytest.approx(16 * num_params(args) / 8, rel=1e-3)
    assert host_bytes(args, tr, dataclasses.replace(plan, offload="none")) == 0
    one_node = Cluster(h100, gpus=8)
    result = search(args, tr, one_node)
    assert not result.ranked and result.least_host == pytest.approx(16 * num_params(args) / 8, rel=0.01)
    big_hosts = Cluster(dataclasses.replace(h100, host_memory_bytes=1024 * GiB), gpus=8)
    best = search(args, tr, big_hosts).ranked[0]
    assert best.plan.offload == "full"
    ev = evaluate(args, tr, best.plan, one_node)
    assert ev.memory["total"] <= ev.budget and not ev.fits  # the device holds it, the host does not
    assert search(args, tr, Cluster(h100, gpus=32), top_k=1).ranked[0].fits  # 4 nodes hold a quarter each
    # the command line: a note under the table, --host-memory-gib per node, --write-config refusing the host's OOM
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    assert run_plan(parser.parse_args(["--model", "llama3-405b", "--gpus", "8", "--global-batch", "8"])) == 1
    assert "6,048 GiB per node of 2,048 (--host-memory-gib)" in capsys.readouterr().out
    assert run_plan(parser.parse_args(["--model", "llama3-405b", "--gpus", "8", "--global-batch", "8",
                                       "--host-memory-gib", "8192"])) == 0
    assert " full " in capsys.readouterr().out
    out = tmp_path / "job.toml"
    assert run_plan(parser.parse_args(["--model", "llama3-405b", "--gpus", "8", "--global-batch", "8",
                                       "--plan", "offload=full,tp=8,zero_stage=3", "--write-config", str(out)])) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: --write-config: the plan's offload needs") and not out.exists()


@pytest.mark.parametrize("argv", [["--model", "llama3-8b", "--gpus", "8"], ["--model", "llama3-70b", "--gpus", "64"],
                                  ["--model", "llama3-8b", "--gpus", "1", "--lora-rank", "16", "--qlora"]])
def test_plan_prints_its_best_plan_as_keys_that_pin_it(argv, capsys):
    """`plan` prints #1 as a layout string (the same string simulate --plan and verify --layout take): read back it
    is #1's layout and batch split, and `plan --plan` with it has no key left to search (the helper who asked found
    the same string meaning another layout in plan and in simulate, which fill the keys left out differently)."""
    from shardwise.layout import LAYOUT_KEYS, complete_layout, parse_layout

    argv = [*argv, "--gpu", "h100", "--json"]
    assert run_plan(_ns(*argv)) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]
    assert run_plan(_ns(*argv[:-1])) == 0
    keys = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("#1 as keys")).split(": ")[1]
    fixed = parse_layout(keys, "--plan")
    layout = complete_layout(fixed, world=int(argv[argv.index("--gpus") + 1]))
    for key in ("tp", "pp", "cp", "zero_stage", "activation_checkpoint", "offload"):
        assert getattr(layout, key) == best[key], key
    assert (fixed["micro_batch"], fixed["grad_accum"]) == (best["micro_batch"], best["grad_accum"])
    assert run_plan(_ns(*argv, "--plan", keys)) == 0
    pinned = json.loads(capsys.readouterr().out)["plans"]
    assert len(pinned) == 1 and pinned[0]["step_time_s"] == best["step_time_s"]
    assert set(LAYOUT_KEYS) >= set(fixed) - {"micro_batch", "grad_accum"}


def test_the_next_to_last_blocks_backward_under_fsdp_matches_the_simulator():
    """Llama 2 7B, FSDP over 8, full recompute, FSDP2's mixed-precision policy: each block adds more sharded gradient
    than it frees in saved tensors, so the peak is in the last blocks' backward ("in layers.1"), with their working
    set and FSDP's buffers beside nearly every sharded gradient. The planner's moments ended at the end of backward,
    which holds no working set: 13.53 GiB predicted against 15.39 measured (a helper's trial, 2026-12-02)."""
    from shardwise.planner.memory import peak_moment, simulator_categories
    from shardwise.simulate import config_from_plan, simulate_rank

    keys = "dp_shard=8,zero_stage=3,micro_batch=1,activation_checkpoint=full,mixed_precision=fsdp"
    cfg = config_from_plan("llama2-7b", keys, 8, seq_len=4096, micro_batch=1, precision="bf16")
    measured = simulate_rank(cfg, 8, 0).peak_step
    training = Training(seq_len=4096, global_batch=8, precision="bf16", fragmentation=0.0, fixed_overhead_gib=0.0)
    plan = Plan(dp_shard=8, zero_stage=3, micro_batch=1, activation_checkpoint="full", mixed_precision="fsdp")
    predicted = simulator_categories(stage_memory(cfg.model, training, plan, 0))
    assert peak_moment(cfg.model, training, plan, 0) == "late_block_backward"
    assert predicted["total"] == pytest.approx(measured.peak_bytes, rel=0.03)
    assert predicted["gradients"] == pytest.approx(measured.peak["gradients"], rel=0.03)


def test_a_tied_head_is_planned_without_a_pipeline_for_the_engine_only():
    """shardwise's engine refuses tie_embeddings with pp > 1 (config.tied_pipeline_error); the search ranked such
    plans first for Llama 3.2 1B (tied) on 16 small GPUs, and --write-config then refused plan 1. Megatron, which
    keeps the two copies in step, still gets them."""
    args = preset("llama3.2-1b")
    assert args.tie_embeddings
    cluster = Cluster(dataclasses.replace(accelerator("h100"), memory_bytes=8 * GiB), 16)
    training = Training(seq_len=8192, global_batch=64)
    ranked = search(args, training, cluster, top_k=50).ranked
    assert ranked and all(ev.plan.pp == 1 for ev in ranked)
    assert not search(args, training, cluster, fixed={"pp": 2}).ranked
    megatron = dataclasses.replace(training, layout="megatron")
    assert search(args, megatron, cluster, fixed={"pp": 2}, top_k=1).ranked


@pytest.mark.parametrize("precision,recompute", [("bf16", "none"), ("bf16", "full"), ("bf16", "selective"),
                                                 ("fp32", "none")])
def test_weight_traffic_is_what_the_engines_step_does_to_weights(precision, recompute):
    """What a micro-batch moves over weights and their gradients (timing.weight_traffic_bytes), counted on the
    engine's own step of two accumulated micro-batches: autocast casts each block matmul weight once a forward
    (again in a recompute, full or selective: the cast is not a saved operator) and casts its gradient back once;
    the fused head makes its fp32 weight gradient as zeros, adds to it once per block of rows (head_gradient_blocks:
    3 here) and scales it in backward; the second micro-batch adds every gradient into .grad. The planner's bytes
    are those operators' tensors, at the sizes of the elements."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardwise.activation_checkpoint import apply_activation_checkpointing
    from shardwise.loss import autocast_context
    from shardwise.model import fuse_head_loss
    from shardwise.planner.timing import head_gradient_blocks, weight_traffic_bytes

    args = ModelArgs(name="traffic", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, vocab_size=256,
                     max_seq_len=150)
    model = build_model(args)
    materialize(model, args, "cpu", 0)
    fuse_head_loss(model)
    if recompute != "none":
        apply_activation_checkpointing(model, recompute)
    params = dict(model.named_parameters())
    matrices = {tuple(p.shape) for n, p in params.items() if n.startswith("layers.") and p.dim() == 2}
    head = tuple(params["output.weight"].shape)

    class Weights(TorchDispatchMode):
        """(operator, [(shape, dtype) of its tensor arguments], [(shape, dtype) of its outputs])"""
        seen: list = []

        def __torch_dispatch__(self, func, types, a=(), kwargs=None):
            out = func(*a, **(kwargs or {}))
            tensors = [(tuple(t.shape), t.dtype) for t in a if isinstance(t, torch.Tensor)]
            outs = [(tuple(t.shape), t.dtype) for t in (out if isinstance(out, (list, tuple)) else (out,))
                    if isinstance(t, torch.Tensor)]
            self.seen.append((func.overloadpacket.__name__, tensors, outs))
            return out

    low = torch.bfloat16 if precision == "bf16" else torch.float32
    torch.manual_seed(0)
    with Weights():
        for _ in range(2):
            tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len))
            with autocast_context(precision, torch.device("cpu")):
                loss = model(tokens, targets=tokens)
            loss.backward()
    seen = Weights.seen

    def count(name, inputs, outputs=None):
        return sum(1 for op, ins, outs in seen if op == name and ins == inputs and (outputs is None or outs == outputs))

    f32 = torch.float32
    casts = sum(count("_to_copy", [(s, f32)], [(s, low)]) for s in matrices) if precision == "bf16" else 0
    grad_casts = sum(count("_to_copy", [(s, low)], [(s, f32)]) for s in matrices) if precision == "bf16" else 0
    block_weights = args.n_layers * 7
    plan = Plan(micro_batch=2, grad_accum=2, activation_checkpoint=recompute)
    training = Training(seq_len=args.max_seq_len, global_batch=4, precision=precision)
    blocks = head_gradient_blocks(args, training, plan)
    assert blocks == 3
    if precision == "bf16":
        # the forward's casts and the recompute's (the head's is counted apart: no block weight has its shape)
        assert casts == 2 * block_weights * (2 if recompute != "none" else 1)
        assert grad_casts == 2 * block_weights
        assert count("_to_copy", [(head, f32)], [(head, low)]) == 2
        head_adds = count("add_", [(head, f32), (head, low)])
    else:
        head_adds = sum(1 for op, ins, _ in seen if op == "addmm_" and ins[:1] == [(head, f32)])
    assert head_adds == 2 * blocks
    # made as zeros in each forward, scaled in place by the loss's gradient in each backward
    assert count("zeros_like", [(head, f32)], [(head, f32)]) == 2
    assert count("mul_", [(head, f32), ((), f32)]) == 2
    # the second micro-batch's accumulation: one fp32 add of each parameter's gradient
    shapes = {tuple(p.shape) for p in params.values()}
    accumulated = sum(1 for op, ins, _ in seen if op == "add_" and len(ins) == 2 and ins[0] == ins[1]
                      and ins[0][1] == f32 and ins[0][0] in shapes)
    assert accumulated == len(params)

    n_block_matrix = sum(p.numel() for n, p in params.items() if n.startswith("layers.") and p.dim() == 2)
    n_head, n_all = params["output.weight"].numel(), sum(p.numel() for p in params.values())
    mixed = precision == "bf16"
    forward = (n_block_matrix * 6 if mixed else 0) + n_head * (4 + blocks * (12 if mixed else 8) + (6 if mixed else 0))
    again = n_block_matrix * 6 if mixed and recompute != "none" else 0
    backward = (n_block_matrix * 6 if mixed else 0) + n_head * 8 + n_all * 12 / 2
    assert weight_traffic_bytes(args, training, plan, 0) == pytest.approx((forward, again, backward), rel=1e-12)
