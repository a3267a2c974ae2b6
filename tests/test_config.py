"""Config reading and validation: bad input fails fast, names the field, writes nothing."""

import dataclasses
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

from shardwise.config import ConfigError, JobConfig, field_docs, load_config
from shardwise.model_args import PRESETS


def _write(tmp_path, text):
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_preset_then_overrides(tmp_path):
    path = _write(tmp_path, """
        [model]
        name = "llama3-8b"
        n_layers = 2
        [optim]
        lr = 1e-4
    """)
    cfg = load_config(path, ["optim.lr=3e-4", "train.precision=bf16", "data.seq_len=128"])
    assert cfg.model.dim == PRESETS["llama3-8b"].dim and cfg.model.n_layers == 2
    assert cfg.optim.lr == 3e-4 and cfg.train.precision == "bf16" and cfg.data.seq_len == 128


def test_every_field_has_a_docstring():
    sections = typing.get_type_hints(JobConfig)
    for cls in [JobConfig, *sections.values()]:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name, "").strip(), f"{cls.__name__}.{f.name} has no docstring"


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["model.n_heads=3"], "model.n_heads"),
        (["optim.lr=-1e-3"], "optim.lr"),
        (["optim.lrr=1e-3"], "optim.lrr"),
        (["train.precision=fp8"], "train.precision"),
        (["train.micro_batch=2.5"], "train.micro_batch"),
        (["model.n_kv_heads=3"], "model.n_kv_heads"),
        (["data.seq_len=4096"], "data.seq_len"),
        (["optim.lr_scaling=linear"], "optim.base_global_batch"),
        (["train.steps=10", "metrics.profile_step=11"], "metrics.profile_step"),
        (["optim.lr=nan"], "optim.lr"),  # TOML and --set read nan and inf
        (["metrics.out_dir=''"], "metrics.out_dir"),  # wrote the run's files into the working folder
        ([f"metrics.out_dir='{__file__}'"], "metrics.out_dir"),  # a file: FileExistsError at the start
        ([f"data.cache_dir='{__file__}/cache'"], "data.cache_dir"),  # below a file: a traceback from every rank
        (["optim.momentum=1.5"], "optim.momentum"),
        (["optim.base_global_batch=-8"], "optim.base_global_batch"),
        (["parallel.bucket_mb=-1"], "parallel.bucket_mb"),
        (["parallel.pp_microbatches=3"], "parallel.pp_microbatches"),  # without pp: ignored
        (["parallel.pp_schedule='zero-bubble'"], "parallel.pp_schedule"),  # without pp: ignored
        (["parallel.activation_checkpoint_every=2"], "parallel.activation_checkpoint_every"),  # without recompute
        (["train.collective_timeout_s=inf"], "train.collective_timeout_s"),
        (["model.name='llama3-8B'"], "model.name"),  # a mistyped preset, which used to train the defaults
    ],
)
def test_validation_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.field == field
    assert "fix:" in str(err.value)


def test_a_custom_model_name_with_its_shape_is_accepted():
    cfg = load_config(None, ["model.name='mine'", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
                             "model.vocab_size=320"])
    assert (cfg.model.name, cfg.model.dim, cfg.model.n_layers) == ("mine", 64, 2)


def test_a_preset_named_by_set_replaces_the_files_model_table(tmp_path):
    """A config whose [model] gives an 8B's shape (as one written from a Hugging Face config.json), run with --set
    model.name=debug, built the 8B under the name 'debug' (and was killed for memory): the preset fills only what a
    table leaves out. A preset named on the command line replaces the file's table; other --set model.* go on top,
    whatever their order; the file's own name, set again, keeps the table."""
    from shardwise.model_args import PRESETS, ModelArgs

    path = _write(tmp_path, "[model]\nname = 'llama3-8b'\nn_layers = 4\nvocab_size = 2048\n")
    assert load_config(path).model.n_layers == 4
    cfg = load_config(path, ["model.n_layers=3", "model.name='debug'"])
    assert (cfg.model.dim, cfg.model.vocab_size, cfg.model.n_layers) == (PRESETS["debug"].dim,
                                                                         PRESETS["debug"].vocab_size, 3)
    cfg = load_config(path, ["model.name='llama3-8b'"])
    assert (cfg.model.n_layers, cfg.model.vocab_size) == (4, 2048)
    custom = _write(tmp_path, "[model]\nname = 'mine'\ndim = 64\nn_layers = 2\nn_heads = 4\nvocab_size = 320\n")
    assert load_config(custom, ["model.name='debug'"]).model == PRESETS["debug"]
    unnamed = _write(tmp_path, "[model]\nn_layers = 2\n")  # the default preset's name, left out
    assert load_config(unnamed, [f"model.name='{ModelArgs.name}'"]).model.n_layers == 2


@pytest.mark.parametrize("flag, fix", [("--stpes", "--set train.steps="), ("--lr", "--set optim.lr="),
                                       ("--micro-batch", "--set train.micro_batch="), ("--nprc", "--nproc?")])
def test_a_config_field_written_as_a_flag_is_told_its_set(flag, fix, capsys):
    """`train --stpes 5` was told "did you mean --set?"; a field's name, written as a flag, is now named whole."""
    from shardwise.cli import main

    assert main(["train", "--config", str(Path(__file__).parents[1] / "configs" / "demo.toml"), flag, "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"shardwise: error: {flag}: not an argument") and fix in err and "\n" not in err, err


@pytest.mark.parametrize("flag, fix", [("--seqlen", "did you mean --seq-len?"),
                                       ("--microbatch", "did you mean --micro-batch?"),
                                       ("--precison", "did you mean --precision?")])
def test_a_misspelt_flag_of_the_command_is_told_that_flag_not_a_config_field(flag, fix, capsys):
    """simulate --seqlen was told "did you mean --set data.seq_len=...?", a config field, where simulate has its
    own --seq-len: the nearest flag of the command is named when it is as near as the field."""
    from shardwise.cli import main

    assert main(["simulate", flag, "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"shardwise: error: {flag}: not an argument") and fix in err and "--set" not in err, err


BAD_CONFIGS = {
    "heads": ("[model]\ndim = 128\nn_heads = 5\n", "model.n_heads"),
    "negative_lr": ("[optim]\nlr = -0.001\n", "optim.lr"),
    "unknown_key": ("[train]\nstepz = 10\n", "train.stepz"),
    "missing_data": ("[data]\npaths = ['/no/such/corpus']\n", "data.paths"),
}


# the "heads" case also starts the CLI as its own process
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.multiprocess) if c == "heads" else c
                                  for c in sorted(BAD_CONFIGS)])
def test_cli_rejects_bad_config_in_one_line(tmp_path, capsys, monkeypatch, case):
    """`shardwise train` in this process (`main`, what the console script calls): exit 2, one line naming the
    field, nothing written. One case runs as its own process as well, to see the real stderr and exit code."""
    from shardwise.cli import main

    text, field = BAD_CONFIGS[case]
    out_dir = tmp_path / "run"
    path = _write(tmp_path, text + f"\n[metrics]\nout_dir = '{out_dir}'\n")
    cache = tmp_path / "cache"
    monkeypatch.setenv("SHARDWISE_CACHE", str(cache))
    code = main(["train", "--config", str(path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert field in lines[0]
    assert not out_dir.exists() and not cache.exists()
    if case == "heads":
        proc = subprocess.run(
            [sys.executable, "-m", "shardwise", "train", "--config", str(path)],
            capture_output=True, text=True, env={"SHARDWISE_CACHE": str(cache), "PATH": "/usr/bin:/bin"},
        )
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == lines, proc.stderr
        assert not out_dir.exists() and not cache.exists()


@pytest.mark.parametrize("key, ours", [("ffn_dim", "ffn_hidden"), ("intermediate_size", "ffn_hidden"),
                                       ("hidden_size", "dim"), ("num_key_value_heads", "n_kv_heads")])
def test_another_systems_name_for_a_model_field_is_told_ours(tmp_path, key, ours):
    """difflib's nearest name for ffn_dim was dim, another field: a Hugging Face or torchtitan name now gets ours."""
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, f"[model]\n{key} = 512\n"), [])
    assert f"model.{key}: unknown key; fix: did you mean model.{ours}?" in str(e.value)


def test_an_init_from_hf_folder_of_another_shape_is_refused_with_the_config(tmp_path):
    """Found when the weights were read, it was a traceback after checkpoint.resume = false had already moved the
    earlier checkpoints aside; now the config is refused first, naming the [model] fields to set."""
    import json

    from shardwise.hf import hf_config

    (tmp_path / "config.json").write_text(json.dumps(hf_config(PRESETS["debug"])))
    (tmp_path / "model.safetensors").write_bytes(b"")  # the shape is read from config.json alone
    base = ["model.name='debug'", f"checkpoint.init_from_hf='{tmp_path}'"]
    load_config(None, base)  # the folder's own shape
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "model.n_layers=2"])
    assert e.value.field == "checkpoint.init_from_hf" and "n_layers 4 vs 2" in e.value.problem
    assert e.value.fix.startswith("set model.n_layers = 4")
    with pytest.raises(ConfigError) as e:  # shape and rotary base in one line: it took two refusals to learn both
        load_config(None, [*base, "model.n_layers=2", "model.rope_theta=500000.0"])
    assert "n_layers 4 vs 2" in e.value.problem and "rope_theta 10000.0 vs 500000.0" in e.value.problem
    assert e.value.fix.startswith("set model.n_layers = 4, model.rope_theta = 10000.0")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError) as e:
        load_config(None, base)
    assert e.value.field == "checkpoint.init_from_hf"


def test_an_init_from_hf_mixtral_of_another_expert_size_names_the_field_that_sets_it(tmp_path):
    """The fix said `set model.expert_hidden = 96`, a property no config can set (the field is moe_ffn_hidden);
    found importing a Mixtral folder into the mixtral-8x7b preset."""
    import json

    from shardwise.hf import hf_config

    mixtral = dataclasses.replace(PRESETS["debug-moe"], n_shared_experts=0, n_dense_layers=0)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(mixtral)))
    (tmp_path / "model.safetensors").write_bytes(b"")
    base = ["model.name='debug-moe'", "model.n_shared_experts=0", "model.n_dense_layers=0",
            f"checkpoint.init_from_hf='{tmp_path}'"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [*base, "model.moe_ffn_hidden=64"])
    assert "expert_hidden 96 vs 64" in e.value.problem and e.value.fix.startswith("set model.moe_ffn_hidden = 96")
    load_config(None, [*base, "model.moe_ffn_hidden=96"])  # what the fix says is accepted


def test_an_init_from_hf_folder_of_another_head_width_names_the_field_that_sets_it(tmp_path):
    """A folder whose heads are wider than dim / n_heads (Qwen3's head_dim 128): the fix names attn_head_dim, the
    field that sets the head width (model.head_dim is not one of ours), and what it says is accepted."""
    import json

    from shardwise.hf import hf_config

    wide = dataclasses.replace(PRESETS["tiny"], attn_head_dim=24)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(wide)))
    (tmp_path / "model.safetensors").write_bytes(b"")
    base = ["model.name='tiny'", f"checkpoint.init_from_hf='{tmp_path}'"]
    with pytest.raises(ConfigError) as e:
        load_config(None, base)
    assert "head_dim 24 vs 16" in e.value.problem and e.value.fix.startswith("set model.attn_head_dim = 24")
    load_config(None, [*base, "model.attn_head_dim=24"])


@pytest.mark.parametrize("setting", ["model.top_k=4", "model.moe_ffn_hidden=64", "model.aux_loss_coeff=0.01",
                                     "model.capacity_factor=1.25", "model.score_func='sigmoid'",
                                     "model.route_norm=false"])
def test_a_mixture_of_experts_field_on_a_dense_model_is_refused(setting):
    """Set on a dense preset (n_experts = 0) each trained a dense model without a word, whatever its value."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name='debug'", setting])
    assert e.value.field == setting.split("=")[0] and "n_experts" in e.value.fix
    load_config(None, ["model.name='debug'", "model.n_experts=8", setting])  # on a mixture: fine


def test_an_init_from_hf_folder_without_weights_is_refused_with_the_config(tmp_path):
    """A folder with a config.json but no safetensors (a PyTorch .bin checkpoint, a half-copied folder) passed the
    config and failed as a FileNotFoundError traceback inside the training processes."""
    import json

    from shardwise.hf import hf_config

    (tmp_path / "config.json").write_text(json.dumps(hf_config(PRESETS["debug"])))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name='debug'", f"checkpoint.init_from_hf='{tmp_path}'"])
    assert e.value.field == "checkpoint.init_from_hf" and "model.safetensors" in e.value.problem


def test_an_init_from_hf_folder_holding_a_peft_adapter_is_refused_with_the_config(tmp_path):
    """An adapter beside its base (peft's layout: export --format peft, then --format base into one folder) loads
    in transformers with the adapter applied; fine-tuning from it imported the base weights alone and dropped the
    adapter without a word (the first loss was the base's)."""
    import json

    from shardwise.hf import hf_config

    (tmp_path / "config.json").write_text(json.dumps(hf_config(PRESETS["debug"])))
    (tmp_path / "model.safetensors").write_bytes(b"")
    base = ["model.name='debug'", f"checkpoint.init_from_hf='{tmp_path}'"]
    load_config(None, base)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    with pytest.raises(ConfigError) as e:
        load_config(None, base)
    assert e.value.field == "checkpoint.init_from_hf" and "adapter_config.json" in e.value.problem
    assert "--format merged" in e.value.fix


def test_a_file_given_for_the_hugging_face_folder_names_the_folder(tmp_path):
    """checkpoint.init_from_hf = 'base/config.json' was refused as "base/config.json has no config.json", and
    data.tokenizer = 'base' (the folder) with no hint of the tokenizer.json inside it."""
    import json

    from shardwise.hf import hf_config

    (tmp_path / "config.json").write_text(json.dumps(hf_config(PRESETS["debug"])))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.name='debug'", f"checkpoint.init_from_hf='{tmp_path / 'config.json'}'"])
    assert e.value.field == "checkpoint.init_from_hf" and "is a file" in e.value.problem
    assert f"'{tmp_path}'" in e.value.fix
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"data.tokenizer='{tmp_path}'"])
    assert e.value.field == "data.tokenizer" and e.value.fix == f"set data.tokenizer = '{tmp_path / 'tokenizer.json'}'"


def test_an_init_from_hf_folder_with_other_rotary_or_norm_values_is_refused(tmp_path):
    """The folder's rope_theta, rms_norm_eps and rotary scaling were dropped for the [model]'s (a custom shape's
    defaults: rope_theta 10000): the imported model's logits differed from the folder's by 5% (rope_theta 500000)
    and 4% (Llama 3's 'llama3' scaling), without a word."""
    import json

    from shardwise.hf import hf_config

    folder = hf_config(PRESETS["debug"])
    (tmp_path / "model.safetensors").write_bytes(b"")
    base = ["model.name='debug'", f"checkpoint.init_from_hf='{tmp_path}'"]
    for change, words, fix in (({"rope_theta": 500000.0}, "rope_theta 500000.0 vs 10000.0", "model.rope_theta"),
                               ({"rms_norm_eps": 1e-6}, "norm_eps 1e-06 vs 1e-05", "model.norm_eps"),
                               ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 8192}},
                                "rope_scaling_factor 8.0 vs 0.0", "model.rope_scaling_factor = 8.0"),
                               ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' rotary scaling",
                                "rope_type 'default'"),
                               ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear' rotary scaling",
                                "rope_type 'default'")):
        (tmp_path / "config.json").write_text(json.dumps({**folder, **change}))
        with pytest.raises(ConfigError) as e:
            load_config(None, base)
        assert e.value.field == "checkpoint.init_from_hf" and words in e.value.problem and fix in e.value.fix
    (tmp_path / "config.json").write_text(json.dumps({**folder, "rope_parameters": {"rope_type": "default"}}))
    load_config(None, base)
    (tmp_path / "config.json").write_text(json.dumps({**folder, "rope_theta": 500000.0}))
    load_config(None, [*base, "model.rope_theta=500000.0"])
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}  # Llama 3.2's
    (tmp_path / "config.json").write_text(json.dumps({**folder, "rope_scaling": llama3}))
    load_config(None, [*base, "model.rope_scaling_factor=32.0"])


def test_an_init_from_hf_folder_whose_projections_have_biases_is_refused(tmp_path):
    """A Llama config with attention_bias / mlp_bias, or weights holding biases under no flag (Qwen2's q/k/v), was
    imported with its biases dropped, without a word: the fine-tuned and exported model was not the folder's."""
    import json

    import torch
    from safetensors.torch import save_file

    from shardwise.hf import hf_config

    folder = hf_config(PRESETS["debug"])
    (tmp_path / "model.safetensors").write_bytes(b"")  # unreadable: nothing to say about its tensors here
    base = ["model.name='debug'", f"checkpoint.init_from_hf='{tmp_path}'"]
    for flag in ("attention_bias", "mlp_bias"):
        (tmp_path / "config.json").write_text(json.dumps({**folder, flag: True}))
        with pytest.raises(ConfigError) as e:
            load_config(None, base)
        assert e.value.field == "checkpoint.init_from_hf" and f"{flag} = true" in e.value.problem, e.value
    (tmp_path / "config.json").write_text(json.dumps(folder))
    load_config(None, base)
    save_file({"model.layers.0.self_attn.q_proj.bias": torch.zeros(4), "model.norm.weight": torch.ones(4)},
              tmp_path / "model.safetensors")
    with pytest.raises(ConfigError) as e:
        load_config(None, base)
    assert e.value.field == "checkpoint.init_from_hf" and "q_proj.bias" in e.value.problem, e.value
    save_file({"model.norm.weight": torch.ones(4)}, tmp_path / "model.safetensors")
    load_config(None, base)
    # Qwen3's config.json reads as a Llama's, and its q/k norms were dropped as the biases were
    save_file({"model.norm.weight": torch.ones(4), "model.layers.0.self_attn.q_norm.weight": torch.ones(4),
               "model.layers.0.self_attn.k_norm.weight": torch.ones(4)}, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError) as e:
        load_config(None, base)
    assert e.value.field == "checkpoint.init_from_hf" and "_norm.weight and 1 more" in e.value.problem, e.value
    from shardwise.hf import import_hf  # what generate --hf reads with
    from shardwise.model import build_model

    with pytest.raises(ValueError, match="k_norm.weight"):
        import_hf([build_model(PRESETS["debug"])], tmp_path)


def test_lora_targets_in_peft_names_or_repeated_are_refused_with_the_names_to_write():
    """peft's target_modules for Llama (q_proj, v_proj) were refused listing the engine's names without saying which
    is which; a repeated target trained once but was counted twice (FLOPs) and exported twice (target_modules)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["lora.rank=8", 'lora.targets=["q_proj", "v_proj", "wo"]'])
    assert e.value.field == "lora.targets" and "q_proj, v_proj are the Hugging Face name" in e.value.problem
    assert e.value.fix == "write wq for q_proj, wv for v_proj"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["lora.rank=8", 'lora.targets=["wq", "wv", "wq"]'])
    assert e.value.field == "lora.targets" and "wq listed more than once" in e.value.problem
    assert load_config(None, ["lora.rank=8", 'lora.targets=["wq", "wv"]']).lora.targets == ["wq", "wv"]


def test_expert_parallelism_is_checked_against_the_ranks_the_job_will_have():
    """`train --nproc 2 --set parallel.ep=2 --set parallel.zero_stage=3` was refused: the config's check ran before
    dp_shard was filled from the world (dp_shard x cp = 1), though --nproc 2 alone becomes dp_shard 2."""
    from pathlib import Path

    from shardwise.config import fit_nodes

    config = str(Path(__file__).parent / "configs" / "moe.toml")
    cfg = load_config(config, ["parallel.ep=2", "parallel.zero_stage=3"])  # the world is not known yet
    fit_nodes(cfg, 2, (1, 1))
    assert (cfg.parallel.dp_shard, cfg.parallel.ep) == (2, 2)
    with pytest.raises(ConfigError) as e:  # one process has no second rank to hold experts
        fit_nodes(load_config(config, ["parallel.ep=2", "parallel.zero_stage=3"]), 1, (1, 1))
    assert e.value.field == "parallel.ep" and "--nproc" in e.value.fix
    with pytest.raises(ConfigError) as e:  # a degree the job sets is checked at once
        load_config(config, ["parallel.ep=2", "parallel.zero_stage=3", "parallel.dp_shard=3"])
    assert e.value.field == "parallel.ep"
