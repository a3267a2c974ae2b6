"""QLoRA: NF4 base weights (torchao) under LoRA, on one device and under FSDP2, ZeRO-0/1 and pipeline parallelism;
the shapes and layouts NF4 cannot take; the planner's bytes per NF4 weight against what torchao stores."""

import json
from pathlib import Path

import pytest
import torch
from test_checkpoint import _build, _steps
from test_parallel import _shardwise
from test_train import _batch
from torch.distributed.tensor import DTensor

from shardwise.checkpoint import Checkpointer, _read_metadata, latest_checkpoint
from shardwise.config import LoraConfig, OptimConfig, load_config
from shardwise.errors import ConfigError
from shardwise.hf import export_hf, import_hf
from shardwise.lora import LoRALinear, apply_lora, dense, full_value, is_adapter
from shardwise.model import build_model, materialize
from shardwise.model_args import ModelArgs
from shardwise.nf4 import CONSTANT_PARTS, SHARDED_PARTS, is_nf4, storage_bytes
from shardwise.optim import build_optimizer
from shardwise.parallel.runtime import Runtime
from shardwise.planner.memory import model_state_bytes
from shardwise.planner.workload import QLORA_BITS, Training
from shardwise.train import build_grad_scaler, build_training_model, train_step

from distributed import run_distributed

CPU = torch.device("cpu")
CONFIG = str(Path(__file__).parent / "configs" / "qlora.toml")
# every projection a multiple of 64 x 256 weights (wq 128 x 128)
ARGS = ModelArgs(name="qlora", dim=128, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=256, vocab_size=320)


def _to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """torchao's NF4 of `weight`, straight from its public API (the reference, not shardwise's path)."""
    from torchao.quantization import to_nf4

    return to_nf4(weight, block_size=64, scaler_block_size=256)


def _qlora_model(seed=0, rank=4):
    model = build_model(ARGS)
    apply_lora(model, LoraConfig(rank=rank, qlora=True))
    materialize(model, ARGS, CPU, seed)
    return model


def test_qlora_with_zero_adapters_is_the_model_with_dequantised_base_weights():
    model = _qlora_model()
    reference = build_model(ARGS)
    materialize(reference, ARGS, CPU, 0)
    adapted = [n for n, m in model.named_modules() if isinstance(m, LoRALinear)]
    assert len(adapted) == 7 * ARGS.n_layers
    with torch.no_grad():
        for name in adapted:
            weight = reference.get_submodule(name).weight
            assert is_nf4(model.get_submodule(name).weight)
            dequantised = _to_nf4(weight.detach().clone()).get_original_weight()
            # 4 bits: close to the weight (NF4's largest gap is 0.28 of a block's absmax), not equal to it
            assert 0 < (dequantised - weight).norm() / weight.norm() < 0.15
            weight.copy_(dequantised)
    tokens = _batch(2, vocab=ARGS.vocab_size).inputs
    assert torch.equal(model(tokens), reference(tokens))


def test_qlora_training_moves_only_adapters_and_only_they_have_optimizer_state():
    model = _qlora_model()
    nf4_parts = {n: [getattr(p, a).clone() for a in SHARDED_PARTS + CONSTANT_PARTS]
                 for n, p in model.named_parameters() if is_nf4(p)}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad and n not in nf4_parts}
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=1e-2), 1e-2)
    scaler = build_grad_scaler(load_config().train, CPU)
    losses = [train_step(model, optimizer, scaler, [_batch(4, vocab=ARGS.vocab_size, seed=s)], device=CPU,
                         grad_clip=1.0).loss for s in range(4)]
    assert losses[-1] < losses[0]
    params = dict(model.named_parameters())
    for name, parts in nf4_parts.items():  # bitwise, every part torchao stores
        assert all(torch.equal(getattr(params[name], a), v) for a, v in zip(SHARDED_PARTS + CONSTANT_PARTS, parts))
    for name, value in frozen.items():
        assert torch.equal(params[name], value), name
    adapters = {id(p) for n, p in params.items() if n.endswith(("lora_a", "lora_b"))}
    assert {id(p) for p in optimizer.state} == adapters
    assert model.layers["0"].feed_forward.w2.lora_b.detach().abs().sum() > 0


def test_qlora_from_hugging_face_quantises_the_imported_weights(tmp_path):
    source = build_model(ARGS)
    materialize(source, ARGS, CPU, seed=1)
    export_hf([source], ARGS, tmp_path)
    model = _qlora_model(seed=0)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter(n)}
    import_hf([model], tmp_path)
    imported = dict(source.named_parameters())
    for name, param in model.named_parameters():
        if is_adapter(name):  # not in the base model: they keep their start
            assert torch.equal(param, adapters[name]), name
        elif is_nf4(param):
            expected = _to_nf4(imported[name].detach()).get_original_weight()
            assert torch.equal(param.get_original_weight(), expected), name
        else:
            assert torch.equal(param, imported[name]), name


def test_qlora_base_is_quantised_from_fp32_under_mixed_precision():
    model = build_model(ARGS)
    apply_lora(model, LoraConfig(rank=4, qlora=True), frozen_dtype=torch.bfloat16)
    wq = model.layers["0"].attention.wq.weight
    # the 4-bit numbers of an fp32 run, with fp32 scaler factors (the planner's QLORA_BITS)
    assert is_nf4(wq) and wq.dtype == torch.float32 and wq.quantization_factor.dtype == torch.float32
    assert model.output.weight.dtype == torch.bfloat16  # LoRA's other frozen matmul weight, as before


def test_qlora_resume_rebuilds_the_nf4_base_and_continues_exactly(tmp_path):
    cfg = load_config(CONFIG, ["optim.name='adamw'", "optim.lr=3e-3", "train.steps=4"])
    runtime = Runtime.create(cfg)
    checkpointer = Checkpointer(tmp_path, cfg.model)
    state = _build(cfg, runtime)
    losses = _steps(state, cfg, runtime, 2)
    checkpointer.save(2, state)
    losses += _steps(state, cfg, runtime, 2)
    fresh = _build(cfg, runtime)  # base quantised again from its seed, adapters at their start
    assert checkpointer.resume(fresh) == 2
    assert _steps(fresh, cfg, runtime, 2) == losses[2:]  # identical floats
    keys = _read_metadata(latest_checkpoint(tmp_path)).state_dict_metadata
    assert {k for k in keys if k.startswith("model/") and not is_adapter(k)} == set()  # no NF4 base in it
    runtime.close()


def test_a_qlora_checkpoint_resumes_only_as_qlora(tmp_path):
    """The adapters were trained against the NF4-rounded base: resumed onto the unquantised one they adapt other
    weights, which a resume without lora.qlora did without a word. A checkpoint written before meta.json recorded
    it (no "qlora" key) still resumes."""
    from shardwise.checkpoint import CheckpointError

    cfg = load_config(CONFIG, ["train.steps=2"])
    runtime = Runtime.create(cfg)
    state = _build(cfg, runtime)
    _steps(state, cfg, runtime, 1)
    Checkpointer(tmp_path, cfg.model).save(1, state)
    meta_path = latest_checkpoint(tmp_path) / "meta.json"
    assert json.loads(meta_path.read_text())["lora"]["qlora"] is True
    plain = load_config(CONFIG, ["train.steps=2", "lora.qlora=false"])
    with pytest.raises(CheckpointError) as e:
        Checkpointer(tmp_path, plain.model).resume(_build(plain, runtime))
    assert "on an NF4 base (QLoRA)" in str(e.value) and "lora.qlora = true" in str(e.value)
    assert Checkpointer(tmp_path, cfg.model).resume(_build(cfg, runtime)) == 1
    meta = json.loads(meta_path.read_text())
    del meta["lora"]["qlora"]  # as written before 2026-11-28
    meta_path.write_text(json.dumps(meta))
    assert Checkpointer(tmp_path, plain.model).resume(_build(plain, runtime)) == 1
    runtime.close()


def test_planner_bits_per_nf4_weight_are_what_torchao_stores():
    weight = torch.randn(512, 256)
    stored = _to_nf4(weight)
    per_tensor = sum(getattr(stored, a).nbytes for a in CONSTANT_PARTS)  # scalers' mean, 16-entry code table
    assert storage_bytes(stored) - per_tensor == weight.numel() * QLORA_BITS / 8
    assert per_tensor == 4 * (1 + 16)
    # the planner's frozen-weight bytes for a fully quantised model of that size (no adapters, one rank)
    planned = model_state_bytes(weight.numel(), Training(lora_rank=1, qlora=True), zero_stage=0, shard=1,
                                n_trainable=0, n_quantizable=weight.numel())["params"]
    assert planned == storage_bytes(stored) - per_tensor
    # FSDP's dim-0 chunk of it holds half of the sharded parts
    half = torch.chunk(stored, 2, dim=0)[0]
    assert sum(getattr(half, a).nbytes for a in SHARDED_PARTS) == planned / 2


@pytest.mark.parametrize("qlora", [True, False])
@pytest.mark.parametrize("zero, gathers", [(2, 1), (3, 2)])
def test_planned_offload_moves_the_adapted_models_shards_as_the_engine_stores_them(qlora, zero, gathers):
    """Under full offload FSDP2 copies a rank's parameter shards to the device as stored before each all-gather
    (once per micro-batch under ZeRO-2, twice under ZeRO-3) and the reduced gradients back once a step. The planner
    priced every frozen weight at the compute dtype (QLoRA's NF4 base is ~0.52 bytes a weight) and a gradient for
    every parameter (the frozen base has none): 2.0-2.4x these bytes. The reference is the engine's model under bf16
    (torchao's NF4 parts, the head and LoRA's frozen linears in bf16, the rest fp32) and its adapters' fp32
    gradients, halved over 2 ranks, on an accelerator whose compute hides no copy."""
    import math

    from shardwise.planner import Accelerator, Cluster, Plan, step_time

    model = build_model(ARGS)
    apply_lora(model, LoraConfig(rank=4, qlora=qlora), frozen_dtype=torch.bfloat16)
    materialize(model, ARGS, CPU, 0)
    stored = sum(sum(getattr(p, a).nbytes for a in SHARDED_PARTS) if is_nf4(p) else p.numel() * p.element_size()
                 for p in model.parameters())
    grads = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    host, accum = 1e9, 4
    instant = Accelerator("instant", 1e15, {"bf16": 1e30, "fp32": 1e30}, mem_bandwidth=math.inf,
                          intra_node_bw=1e9, inter_node_bw=1e9, host_bw=host, attention_efficiency=math.inf)
    plan = Plan(dp_shard=2, zero_stage=zero, offload="full", micro_batch=1, grad_accum=accum,
                activation_checkpoint="full")
    training = Training(seq_len=64, global_batch=2 * accum, lora_rank=4, qlora=qlora)
    t = step_time(ARGS, training, plan, Cluster(instant, 2))
    assert t.offload_s == pytest.approx((stored / 2 * accum * gathers + grads / 2) / host, rel=1e-9)


def test_qlora_model_stores_the_planned_bytes():
    model = _qlora_model()
    quantized = [p for p in model.parameters() if is_nf4(p)]
    n = sum(p.numel() for p in quantized)
    measured = sum(storage_bytes(p) for p in quantized)
    assert n == ARGS.n_layers * (4 * 128 * 128 + 3 * 256 * 128)  # wq wk wv wo, w1 w3 w2
    assert measured - n * QLORA_BITS / 8 == 68 * len(quantized)  # + each tensor's constants


@pytest.mark.parametrize("overrides, problem", [
    (["parallel.tp=2"], "tensor parallelism"),
    (["model.name='tiny'", "model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=192"],
     "not a multiple of 16384"),
    # wq is 128 x 128 = one scaler block: it cannot be cut in two
    (["model.dim=128", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_hidden=256", "parallel.dp_shard=2",
      "parallel.zero_stage=3"], "FSDP cuts wq"),
])
def test_qlora_rejects_what_nf4_cannot_hold_before_anything_runs(overrides, problem):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, overrides)
    assert e.value.field == "lora.qlora" and problem in e.value.problem


@pytest.mark.parametrize("args", [
    # FSDP2 over a mesh of one (offload on one device, or per pipeline stage) gathered only NF4's first part: the
    # first forward was a ValueError from torchao's fsdp_post_all_gather
    ["--set", "parallel.zero_stage=2", "--set", "parallel.offload='full'"],
    ["--nproc", "2", "--set", "parallel.pp=2", "--set", "parallel.zero_stage=3", "--set", "parallel.offload='full'"],
])
def test_qlora_with_full_offload_over_a_mesh_of_one_is_refused_before_any_rank_starts(args, capsys):
    from shardwise.cli import main

    assert main(["train", "--config", CONFIG, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise: error: lora.qlora: ") and "mesh of one" in err[0], err


def test_qlora_with_full_offload_over_the_ranks_nproc_fills_in_is_accepted():
    """`train --nproc 2 --set parallel.zero_stage=3 --set parallel.offload='full'` shards the NF4 base over the 2
    ranks fit_world fills in (dp_shard 2), as the mesh-of-one refusal's own fix says to; the config refused it,
    checked before --nproc had filled in dp_shard (a mesh of one)."""
    from shardwise.config import fit_nodes

    cfg = load_config(CONFIG, ["parallel.zero_stage=3", "parallel.offload='full'"])
    fit_nodes(cfg, 2, (1, 1))
    assert (cfg.parallel.dp_shard, cfg.parallel.offload) == (2, "full")


def test_qlora_on_the_world_that_nproc_fills_in_is_refused_before_any_rank_starts(capsys):
    """`train --nproc 3` with zero_stage 3 and no degree set shards the NF4 base over 3 ranks (fit_world), which the
    config had checked as 1: each rank's FSDP failed on the 128-row wk with a traceback."""
    from shardwise.cli import main

    assert main(["train", "--config", CONFIG, "--nproc", "3", "--set", "parallel.zero_stage=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise: error: lora.qlora: FSDP cuts") and "3 dim-0" in err[0], err
    # every degree that fits all the adapted weights: wq (256 x 256, four scaler blocks) alone would allow 4, and
    # 4 was then refused for wk (128 x 256, two)
    assert "fix: use dp_shard x cp = 1 or 2 (what every adapted weight cuts into)" in err[0], err


def test_qlora_sharding_fix_names_degrees_that_fit():
    """With debug's shape (wk 64 x 128: not whole NF4 blocks at all) and dp_shard 2, wq's FSDP cut was named first
    with the fix "use dp_shard x cp =  (what every adapted weight cuts into)": no degree, as wk fits none. And with
    wk not adapted, the degrees were sought among the sizes of every projection, wk's too: none again."""
    debug = ["model.name='debug'", "lora.rank=4", "lora.qlora=true", "parallel.dp_shard=2", "parallel.zero_stage=3"]
    with pytest.raises(ConfigError) as e:
        load_config(None, debug)
    assert e.value.problem.startswith("wk's weight (64 x 128 = 8192) is not a multiple of 16384"), e.value
    with pytest.raises(ConfigError) as e:
        load_config(None, [*debug, "lora.targets=['w1', 'w3', 'w2']"])
    assert "FSDP cuts" in e.value.problem and e.value.fix.startswith("use dp_shard x cp = 1 (what"), e.value


def test_qlora_accepts_the_same_shape_where_the_base_is_not_sharded():
    small = ["model.dim=128", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_hidden=256"]
    load_config(CONFIG, [*small, "parallel.dp_replicate=2", "parallel.zero_stage=1"])
    load_config(CONFIG, [*small, "lora.targets=['w1', 'w3', 'w2']", "parallel.dp_shard=2", "parallel.zero_stage=3"])


@pytest.mark.multiprocess
def test_qlora_layouts_match_single_device_qlora():
    # ZeRO-3 (FSDP2 shards the NF4 storage), ZeRO-1 (replicate leaves it out), a pipeline of two stages
    layouts = ["dp_shard=2,zero_stage=3", "dp=2,zero_stage=1", "pp=2"]
    proc = _shardwise("verify", "--config", CONFIG, "--steps", "3", "--json",
                      *[arg for layout in layouts for arg in ("--layout", layout)])
    assert proc.stdout, proc.stderr[-3000:]
    for row in json.loads(proc.stdout)["layouts"]:
        assert max(row["loss_rel"], row["grad_norm_rel"], row["param_rel"]) <= 1e-5, row
    assert proc.returncode == 0


def _nf4_and_merged(model) -> tuple[dict, dict]:
    """Where `model` keeps NF4 weights, and every adapted projection's merged weight, B set to 0.01 first."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                (p.to_local() if isinstance(p, DTensor) else p).fill_(0.01)
    merged = {n: m.merged_weight() for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    return {n: p for n, p in model.named_parameters() if is_nf4(p)}, merged


def _gather_nf4_base(rounds: int) -> tuple[dict, dict]:
    """On each of 2 ranks: the QLoRA model under ZeRO-3, every NF4 weight gathered `rounds` times (what a final
    save and an export do); the last round's values, and the merged weights an export writes."""
    cfg = load_config(CONFIG, ["parallel.dp_shard=2", "parallel.zero_stage=3"])
    model = build_training_model(cfg, Runtime.create(cfg))
    sharded, merged = _nf4_and_merged(model)
    assert all(isinstance(p, DTensor) for p in sharded.values())
    for _ in range(rounds):
        gathered = {n: full_value(p) for n, p in sharded.items()}
    return gathered, merged


@pytest.mark.multiprocess
def test_sharded_nf4_base_gathers_to_the_single_device_weights_bit_for_bit():
    # gathered as NF4 (DTensor.full_tensor through torchao's all-gather of its parts), this loop corrupted the
    # heap within a few hundred gathers on gloo ("malloc(): unaligned tcache chunk detected", a final save's
    # SIGABRT in CI); shard by shard dequantised, then gathered, it is the same bits
    reference = load_config(CONFIG).model
    model = build_model(reference)
    apply_lora(model, LoraConfig(rank=4, qlora=True))
    materialize(model, reference, CPU, 0)
    nf4_weights, expected_merged = _nf4_and_merged(model)
    expected = {n: dense(p) for n, p in nf4_weights.items()}
    for gathered, merged in run_distributed(_gather_nf4_base, 2, 50):
        assert gathered.keys() == expected.keys() and merged.keys() == expected_merged.keys()
        assert all(torch.equal(gathered[n], expected[n]) for n in expected)
        for name, weight in expected_merged.items():  # B A: a matmul of gathered pieces, to fp32 rounding
            torch.testing.assert_close(merged[name], weight, rtol=1e-6, atol=1e-6)
