"""LoRA on one device: the transform, its start (B = 0), what it trains and what it leaves alone."""

import dataclasses

import pytest
import torch
from test_train import _batch

from shardwise.config import LORA_TARGETS, LoraConfig, OptimConfig, load_config
from shardwise.errors import ConfigError
from shardwise.lora import LoRALinear, apply_lora
from shardwise.loss import compute_dtype
from shardwise.model import build_model, materialize
from shardwise.model_args import preset
from shardwise.nf4 import SHARDED_PARTS, is_nf4
from shardwise.optim import build_optimizer
from shardwise.train import build_grad_scaler, train_step

CPU = torch.device("cpu")


def _models(lora: LoraConfig, seed=0):
    args = preset("tiny")
    base, adapted = build_model(args), build_model(args)
    apply_lora(adapted, lora)
    materialize(base, args, CPU, seed)
    materialize(adapted, args, CPU, seed)
    return base, adapted


def test_adapters_start_at_zero_and_give_the_base_logits_exactly():
    base, adapted = _models(LoraConfig(rank=4))
    tokens = _batch(2).inputs
    assert torch.equal(adapted(tokens), base(tokens))
    wq = adapted.layers["0"].attention.wq
    assert isinstance(wq, LoRALinear) and wq.lora_a.abs().sum() > 0 and not wq.lora_b.any()


def test_targets_rank_and_names():
    _, adapted = _models(LoraConfig(rank=8, targets=["wq", "w2"]))
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 2 * adapted.args.n_layers
    assert "layers.0.attention.wq.lora_a" in trainable and "layers.0.feed_forward.w2.lora_b" in trainable
    assert adapted.layers["0"].attention.wq.lora_a.shape == (8, adapted.args.dim)
    assert not isinstance(adapted.layers["0"].attention.wk, LoRALinear)
    assert "layers.0.attention.wq.weight" in dict(adapted.named_parameters())  # the base keeps its name


def test_training_moves_only_adapters_and_only_they_have_optimizer_state():
    _, model = _models(LoraConfig(rank=4, alpha=8))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = build_optimizer(model, OptimConfig(name="adamw", lr=1e-2), 1e-2)
    scaler = build_grad_scaler(load_config().train, CPU)
    losses = [train_step(model, optimizer, scaler, [_batch(4, seed=s)], device=CPU, grad_clip=1.0).loss
              for s in range(5)]
    assert losses[-1] < losses[0]
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name  # bitwise
    with_state = {id(p) for p in optimizer.state}
    adapters = {id(p) for n, p in model.named_parameters() if n.endswith(("lora_a", "lora_b"))}
    assert with_state == adapters
    assert model.layers["0"].attention.wq.lora_b.detach().abs().sum() > 0


def test_merged_weight_computes_what_the_adapted_linear_computes():
    layer = LoRALinear(16, 8, rank=2, alpha=4.0, dropout=0.0)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.lora_a)
    torch.nn.init.normal_(layer.lora_b)
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), x @ layer.merged_weight().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("override, field", [
    ("lora.rank=-1", "lora.rank"),
    ("lora.targets=['wx']", "lora.targets"),
    ("lora.targets=[]", "lora.targets"),
    ("lora.qlora=true", "lora.qlora"),
    ("lora.dropout=1.0", "lora.dropout"),
])
def test_bad_lora_settings_name_their_field(override, field):
    extra = [] if override.startswith(("lora.qlora", "lora.rank")) else ["lora.rank=4"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*extra, override])
    assert e.value.field == field


def test_mixed_precision_stores_frozen_projections_in_the_compute_dtype_with_the_same_logits():
    """autocast casts an fp32 weight to bf16 at every matmul; storing the frozen projections in bf16 gives those
    matmuls the same numbers at half the bytes (the embedding and norms stay fp32)."""
    args = preset("tiny")
    kept, halved = build_model(args), build_model(args)
    apply_lora(kept, LoraConfig(rank=4))
    apply_lora(halved, LoraConfig(rank=4), frozen_dtype=torch.bfloat16)
    for model in (kept, halved):
        materialize(model, args, CPU, 0)
        model.layers["1"].attention.wq.lora_b.data.normal_(generator=torch.Generator().manual_seed(1))
    dtypes = {n: p.dtype for n, p in halved.named_parameters()}
    assert dtypes["layers.0.feed_forward.w2.weight"] == dtypes["output.weight"] == torch.bfloat16
    assert dtypes["tok_embeddings.weight"] == dtypes["norm.weight"] == dtypes["layers.0.attention.wq.lora_a"] \
        == torch.float32
    tokens = _batch(2).inputs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(kept(tokens), halved(tokens))


@pytest.mark.parametrize("qlora", [False, True])
@pytest.mark.parametrize("targets", [LORA_TARGETS, ("wq", "wv", "w2")], ids=["all", "some"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_planner_parameter_bytes_equal_the_engines_lora_model(precision, targets, qlora):
    """The planner's LoRA parameter bytes against the bytes of the model the engine builds (one rank): the frozen
    projections in the compute dtype, the adapted ones' base in NF4 under QLoRA, and the adapters on the targets
    alone (the planner priced adapters and NF4 on every projection whatever lora.targets said)."""
    from shardwise.planner.memory import stage_memory
    from shardwise.planner.plan import Plan
    from shardwise.planner.workload import Training

    args = preset("tiny") if not qlora else dataclasses.replace(preset("tiny"), dim=256, n_heads=4, n_kv_heads=2,
                                                                 ffn_hidden=512)  # whole NF4 blocks
    model = build_model(args)
    apply_lora(model, LoraConfig(rank=4, targets=list(targets), qlora=qlora), frozen_dtype=compute_dtype(precision))
    materialize(model, args, CPU, 0)
    # an NF4 weight's codes, scalers and factors; its per-tensor constants (a mean, the 16-entry table) are not priced
    measured = sum(sum(getattr(p, a).nbytes for a in SHARDED_PARTS) if is_nf4(p) else p.numel() * p.element_size()
                   for p in model.parameters())
    training = Training(seq_len=32, global_batch=1, precision=precision, lora_rank=4, qlora=qlora,
                        lora_targets=tuple(targets))
    assert stage_memory(args, training, Plan(), 0)["params"] == pytest.approx(measured, rel=1e-9)


def test_adapter_count_and_lora_flops_against_the_model():
    """adapter_params against the adapters of the built model; LoRA's FLOPs per token against torch's
    FlopCounterMode on a forward + backward of the adapted model (frozen weights: no weight-gradient matmuls)."""
    from torch.utils.flop_counter import FlopCounterMode

    from shardwise.loss import token_loss_sum
    from shardwise.model_args import adapter_params, flops_per_token

    args = preset("tiny")
    _, model = _models(LoraConfig(rank=4, targets=["wq", "wv", "w2"]))
    assert adapter_params(args, 4, ("wq", "wv", "w2")) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    batch = _batch(2, seq=32)
    with FlopCounterMode(display=False) as counter:
        token_loss_sum(model(batch.inputs), batch.targets).backward()
    tokens = batch.inputs.numel()
    expected = flops_per_token(args, 32, adapter_params(args, 4, ("wq", "wv", "w2"))) * tokens
    # the formula counts attention without the causal mask's saving (PaLM's MFU) as SDPA's FLOP count does;
    # block 0's input needs no gradient (the embedding is frozen): its q, k, v, gate and up projections skip
    # their input-gradient matmuls, which the formula (a per-token rate for any depth) does not model
    d, kv, f = args.dim, args.n_kv_heads * args.head_dim, args.ffn_hidden
    # (and so do the adapters' A matmuls on block 0's q and v)
    skipped = 2 * (d * d + 2 * d * kv + 2 * d * f + 2 * 4 * d) * tokens
    assert counter.get_total_flops() == pytest.approx(expected - skipped, rel=1e-6)


@pytest.mark.parametrize("config, overrides", [
    ("parity.toml", []),
    ("parity.toml", ["lora.rank=4"]),
    ("parity.toml", ["lora.rank=8", "lora.alpha=3.0", "lora.targets=['w2', 'wq']"]),
    ("qlora.toml", []),
])
def test_the_launchers_adapter_spec_is_the_built_models(config, overrides):
    """The launcher checks a resumed run's adapters (rank, alpha, targets, QLoRA) from the config alone, before it
    imports torch (run_folder.config_adapter_spec); the ranks' load compares what the built model holds
    (lora.adapter_spec). They must agree, or the launcher would refuse a run the ranks accept (or pass one they
    refuse)."""
    from pathlib import Path

    from shardwise.lora import adapter_spec
    from shardwise.run_folder import config_adapter_spec

    cfg = load_config(str(Path(__file__).parent / "configs" / config), overrides)
    model = build_model(cfg.model)
    apply_lora(model, cfg.lora)
    assert config_adapter_spec(cfg) == adapter_spec([model])
