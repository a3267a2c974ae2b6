"""A mixture of experts against Hugging Face's Mixtral (Jiang et al. 2024): the same logits and routing as
`transformers.MixtralForCausalLM`, export that `from_pretrained` loads, import of what `save_pretrained` writes.

transformers runs its experts with the eager per-expert loop here, so the reference does not share our grouped GEMM.
"""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from shardwise import hf
from shardwise.model import build_model, materialize
from shardwise.model_args import ModelArgs, args_from_hf_config, preset
from shardwise.moe import grouped_mm_supported

from distributed import run_distributed

transformers = pytest.importorskip("transformers")

# expert hidden 32 and dim 64 are multiples of 4: fp32 rows 16-byte aligned, so our grouped GEMM path runs
ARGS = ModelArgs(name="tiny-mixtral", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=32,
                 n_experts=8, top_k=2, rope_theta=1e6, max_seq_len=64, aux_loss_coeff=0.02)
TOKENS = torch.randint(0, ARGS.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)")


def _their_model() -> "transformers.MixtralForCausalLM":
    """A random tiny Mixtral, off transformers' init (norms included); a router wide enough that no token's
    k-th and (k+1)-th experts are within rounding of each other."""
    torch.manual_seed(0)
    theirs = transformers.MixtralForCausalLM(transformers.MixtralConfig(**hf.hf_config(ARGS)))
    theirs.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
    return theirs.eval()


def _ours_from(theirs) -> nn.Module:
    """Our model holding transformers' in-memory weights, mapped here by hand: gate_up_proj is [gate; up] on dim 1."""
    h, sd = ARGS.expert_hidden, {}
    for name, value in theirs.state_dict().items():
        m = _FUSED.fullmatch(name)
        if m is None:
            sd[hf.from_hf_name(name)] = value
            continue
        layer = f"layers.{m.group(1)}.moe"
        if m.group(2) == "gate.weight":
            sd[f"{layer}.router.weight"] = value
        elif m.group(2) == "experts.gate_up_proj":
            sd[f"{layer}.experts.w1"], sd[f"{layer}.experts.w3"] = value[:, :h], value[:, h:]
        else:
            sd[f"{layer}.experts.w2"] = value
    ours = build_model(ARGS)
    materialize(ours, ARGS, "cpu", seed=5)
    missing, unexpected = ours.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.endswith("moe.expert_bias") for k in missing)  # the bias has no counterpart
    return ours.eval()


def _chosen(model, routers: dict[str, nn.Module]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's logits for TOKENS, and each router's chosen experts (tokens, k), sorted per token: the same set
    in any order compares equal. Both routers return them third (ours after scores and weights, theirs after
    logits and weights)."""
    seen = {}
    hooks = [r.register_forward_hook(lambda _m, _i, out, n=n: seen.__setitem__(n, out[2].sort(-1).values))
             for n, r in routers.items()]
    with torch.no_grad():
        logits = model(TOKENS)
    for h in hooks:
        h.remove()
    return logits if isinstance(logits, torch.Tensor) else logits.logits, seen


@pytest.fixture(scope="module")
def pair():
    theirs = _their_model()
    return theirs, _ours_from(theirs)


def test_logits_and_routing_match_transformers_mixtral(pair):
    theirs, ours = pair
    assert grouped_mm_supported(torch.zeros(1, ARGS.dim), ours.layers["0"].moe.experts.w1)
    expected, their_choice = _chosen(theirs, {str(i): layer.mlp.gate for i, layer in enumerate(theirs.model.layers)})
    got, our_choice = _chosen(ours, {i: layer.moe.router for i, layer in ours.layers.items()})
    assert set(our_choice) == set(their_choice) == {"0", "1"}
    for layer in our_choice:
        assert torch.equal(our_choice[layer], their_choice[layer]), layer
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_export_loads_in_transformers_with_the_published_names(pair, tmp_path):
    theirs, ours = pair
    hf.export_hf([ours], ARGS, tmp_path)
    names = set(load_file(tmp_path / hf.SINGLE_FILE))
    # the names of the Mixtral checkpoints on the Hub, one tensor per expert
    assert "model.layers.1.block_sparse_moe.gate.weight" in names
    for j in range(ARGS.n_experts):
        for w in ("w1", "w2", "w3"):
            assert f"model.layers.1.block_sparse_moe.experts.{j}.{w}.weight" in names
    assert not any(".mlp." in n for n in names)
    loaded, info = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path, local_files_only=True, dtype=torch.float32, experts_implementation="eager", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert loaded.config.num_local_experts == ARGS.n_experts and loaded.config.router_aux_loss_coef == 0.02
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(TOKENS).logits, theirs(TOKENS).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("original_format", [True, False], ids=["per-expert", "fused"])
def test_save_pretrained_folder_imports(pair, tmp_path, original_format):
    theirs, _ = pair
    theirs.save_pretrained(tmp_path, save_original_format=original_format)
    config = json.loads((tmp_path / "config.json").read_text())
    args = args_from_hf_config(config)
    # transformers 5 keeps the rotary base only inside rope_parameters
    assert "rope_theta" not in config and args.rope_theta == ARGS.rope_theta
    assert (args.n_experts, args.top_k, args.expert_hidden, args.aux_loss_coeff) == (8, 2, 32, 0.02)
    ours = build_model(args)
    materialize(ours, args, "cpu", seed=0, init_values=False)
    hf.import_hf([ours], tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(TOKENS), theirs(TOKENS).logits, rtol=0, atol=1e-5)


def test_published_mixtral_config_is_the_preset():
    # mistralai/Mixtral-8x7B-v0.1's config.json, as published
    published = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                 "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                 "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                 "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
                 "vocab_size": 32000, "hidden_act": "silu", "output_router_logits": False}
    args = args_from_hf_config(published, name="mixtral-8x7b")
    assert args.aux_loss_coeff == 0.02
    assert args == preset("mixtral-8x7b", aux_loss_coeff=0.02)
    again = args_from_hf_config(hf.hf_config(args), name="mixtral-8x7b")
    assert again == args


@pytest.mark.parametrize("config", ["Qwen2MoeConfig", "Qwen3MoeConfig", "OlmoeConfig", "DeepseekV3Config"])
def test_another_kind_of_mixture_is_refused_not_read_as_a_dense_llama(config, tmp_path, capsys):
    """A Qwen-MoE, OLMoE or DeepSeek config.json (as transformers writes it) was read as a Llama without its
    experts: `plan --model` sized Qwen1.5-MoE-A2.7B as a dense 1.9B model (it has 14.3B), without a word."""
    from shardwise.cli import main

    raw = getattr(transformers, config)().to_dict()
    with pytest.raises(ValueError, match="mixture of experts"):
        args_from_hf_config(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["plan", "--model", str(tmp_path / "config.json"), "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: --model: ") and "mixture of experts" in err and err.count("\n") == 1


@pytest.mark.parametrize("override, named", [
    (dict(score_func="sigmoid"), "score_func"), (dict(route_norm=False), "route_norm"),
    (dict(route_scale=2.5), "route_scale"), (dict(n_shared_experts=1), "n_shared_experts"),
    (dict(n_dense_layers=1), "n_dense_layers"), (dict(bias_update_rate=1e-3), "bias_update_rate"),
])
def test_mixtures_mixtral_cannot_express_are_refused(tmp_path, override, named):
    args = dataclasses.replace(ARGS, **override)
    with pytest.raises(ValueError, match=named):
        hf.hf_config(args)
    model = build_model(args)
    materialize(model, args, "cpu", seed=0)
    with pytest.raises(ValueError, match=named):
        hf.export_hf([model], args, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_import_refuses_another_mixture(pair, tmp_path):
    hf.export_hf([pair[1]], ARGS, tmp_path)
    for override, named in ((dict(top_k=1), "top_k"), (dict(n_experts=4), "n_experts"),
                            (dict(moe_ffn_hidden=48), "expert_hidden"), (dict(n_dense_layers=1), "n_dense_layers")):
        args = dataclasses.replace(ARGS, **override)
        model = build_model(args)
        materialize(model, args, "cpu", seed=0)
        with pytest.raises(ValueError, match=named):
            hf.import_hf([model], tmp_path)


def _import_under_expert_parallel(folder) -> dict[str, torch.Tensor]:
    """On each of 2 ranks: the experts split by expert index (ep=2), then the folder imported; this rank's pieces."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from shardwise.parallel.expert_parallel import apply_expert_parallel

    model = build_model(ARGS)
    materialize(model, ARGS, "cpu", seed=3)
    apply_expert_parallel(model, init_device_mesh("cpu", (2,)))
    hf.import_hf([model], folder)
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters() if isinstance(p, DTensor)}


@pytest.mark.multiprocess
def test_import_gives_each_expert_parallel_rank_its_experts(pair, tmp_path):
    hf.export_hf([pair[1]], ARGS, tmp_path)
    ranks = run_distributed(_import_under_expert_parallel, 2, tmp_path)
    full = dict(pair[1].named_parameters())
    assert len(ranks[0]) == 3 * ARGS.n_layers
    half = ARGS.n_experts // 2
    for rank, pieces in enumerate(ranks):
        for name, local in pieces.items():
            assert torch.equal(local, full[name].detach()[rank * half:(rank + 1) * half]), (rank, name)


def test_export_of_a_mixture_mixtral_cannot_express_is_one_line_before_the_checkpoint_is_read(tmp_path, capsys):
    """`shardwise export` of the MoE test config (shared expert, dense block, balancing bias) ended in a traceback."""
    from shardwise.cli import main

    config = str(Path(__file__).parent / "configs" / "moe.toml")
    out = tmp_path / "hf"
    assert main(["export", "--config", config, "--set", f"metrics.out_dir='{tmp_path / 'none'}'",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: model: model ") and "n_shared_experts" in err and err.count("\n") == 1
    assert not out.exists()
