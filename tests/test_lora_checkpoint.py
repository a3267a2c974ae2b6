"""LoRA checkpoints and export: adapter-only checkpoints that resume exactly and under another layout, refuse
other adapter settings, and export as a merged Hugging Face model or as peft's adapter folder.

References: the uninterrupted run (exact resume), the saving run's adapter values (resharding), transformers'
and peft's own forward passes (export), the Hugging Face folder's tensors (the base under init_from_hf).
"""

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_checkpoint import ADAMW, CONFIG, _assert_refused, _build, _cfg, _full_params, _steps
from torch.distributed.tensor import DTensor

from shardwise import hf
from shardwise.checkpoint import Checkpointer, TrainState, _read_metadata, latest_checkpoint, load
from shardwise.config import LORA_TARGETS
from shardwise.errors import CheckpointError
from shardwise.lora import LoRALinear, apply_lora, is_adapter
from shardwise.model import build_model, materialize
from shardwise.parallel.runtime import Runtime
from shardwise.train import build_training_model, train

from distributed import run_distributed

# dropout on: a resume must also bring back the RNG stream the adapters' dropout draws from
LORA = ["lora.rank=4", "lora.alpha=8", "lora.dropout=0.1"]
LORA_NO_DROPOUT = ["lora.rank=4", "lora.alpha=8"]  # across layouts, ranks draw different dropout masks
FSDP2 = ["parallel.dp_shard=2", "parallel.zero_stage=3", "train.micro_batch=4"]  # the one-process global batch


def _adapters(parts) -> dict[str, torch.Tensor]:
    return {n: v for n, v in _full_params(parts).items() if is_adapter(n)}


@torch.no_grad()
def _scramble_adapters(state) -> None:
    """Overwrite every rank's piece of every adapter: only a complete load brings the saved values back (the
    base is left as built: an adapter checkpoint does not hold it)."""
    for part in state.parts:
        for name, p in part.named_parameters():
            if is_adapter(name):
                (p.to_local() if isinstance(p, DTensor) else p).fill_(0.125)


def test_lora_resume_is_exact_and_the_checkpoint_holds_only_adapters(tmp_path):
    cfg = _cfg(LORA)
    runtime = Runtime.create(cfg)
    ckpt = Checkpointer(tmp_path, cfg.model)
    state = _build(cfg, runtime)
    losses = _steps(state, cfg, runtime, 2)
    ckpt.save(2, state)
    losses += _steps(state, cfg, runtime, 2)
    reference = _full_params(state.parts)

    fresh = _build(cfg, runtime)
    _scramble_adapters(fresh)
    assert ckpt.resume(fresh) == 2
    assert _steps(fresh, cfg, runtime, 2) == losses[2:]  # identical floats
    params = _full_params(fresh.parts)
    assert all(torch.equal(params[n], reference[n]) for n in reference)

    path = latest_checkpoint(tmp_path)
    keys = _read_metadata(path).state_dict_metadata
    adapters = {n for n in reference if is_adapter(n)}
    assert {k.removeprefix("model/") for k in keys if k.startswith("model/")} == adapters
    assert {k.removeprefix("optim/state.").rpartition(".")[0] for k in keys if k.startswith("optim/")} == adapters
    meta = json.loads((path / "meta.json").read_text())
    assert meta["lora"] == {"rank": 4, "scale": 2.0, "targets": sorted(LORA_TARGETS), "qlora": False}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A LoRA checkpoint and a full-training one, each of one step."""
    paths = {}
    for name, overrides in (("lora", LORA), ("full", [])):
        run = tmp_path_factory.mktemp(name)
        cfg = _cfg(overrides)
        runtime = Runtime.create(cfg)
        state = _build(cfg, runtime)
        _steps(state, cfg, runtime, 1)
        Checkpointer(run, cfg.model).save(1, state)
        paths[name] = latest_checkpoint(run)
    return paths


@pytest.mark.parametrize("checkpoint, overrides, words", [
    ("lora", ["lora.rank=0"], ["LoRA rank 4", "no LoRA", "set lora.rank = 4, lora.alpha = 8 and lora.targets"]),
    ("lora", ["lora.rank=8", "lora.alpha=16"], ["LoRA rank 4", "LoRA rank 8"]),
    ("lora", [*LORA, "lora.targets=['wq','wv']"], ["targets wq,wv"]),
    ("lora", [*LORA, "lora.alpha=16"], ["alpha/rank 2", "alpha/rank 4"]),
    ("full", LORA, ["no LoRA", "init_from_hf"]),
])
def test_other_adapter_settings_are_refused_in_one_line(saved, checkpoint, overrides, words):
    _assert_refused(saved[checkpoint], overrides, *words)
    # before any process starts (train --nproc, launch local and slurm: run_folder.check_resume), the same line;
    # until 2026-12-03 the adapters were checked only in the ranks, after they had built the model and read the data
    from shardwise.run_folder import check_resume

    path = saved[checkpoint]
    cfg = _cfg([*overrides, "checkpoint.enabled=true", f"metrics.out_dir='{path.parent.parent}'"])
    with pytest.raises(CheckpointError) as early:
        check_resume(cfg)
    with pytest.raises(CheckpointError) as late:
        load(path, _build(cfg, Runtime.create(cfg)), cfg.model)
    assert str(early.value) == str(late.value)


def test_a_lora_model_imports_a_hugging_face_base_and_keeps_its_seeded_adapters(hf_base):
    folder, tokens, logits = hf_base
    cfg = _cfg(LORA)
    model = build_training_model(cfg, Runtime.create(cfg))
    seeded = _adapters([model])
    hf.import_hf([model], folder)
    assert all(torch.equal(v, seeded[n]) for n, v in _adapters([model]).items())
    with torch.no_grad():  # B = 0: the adapted model is the base
        torch.testing.assert_close(model.eval()(tokens), logits, rtol=1e-5, atol=1e-5)


def test_merged_weight_dequantises_an_nf4_base():
    logging.getLogger("torchao").setLevel(logging.ERROR)  # its CUDA kernels do not load on a CPU machine
    from torchao.quantization import to_nf4

    layer = LoRALinear(256, 64, rank=2, alpha=4.0, dropout=0.0)
    for p in (layer.weight, layer.lora_a, layer.lora_b):
        torch.nn.init.normal_(p)
    nf4 = to_nf4(layer.weight.detach())
    layer.weight = torch.nn.Parameter(nf4, requires_grad=False)
    expected = nf4.get_original_weight() + 2.0 * layer.lora_b.detach() @ layer.lora_a.detach()
    torch.testing.assert_close(layer.merged_weight(), expected, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# A LoRA run from a Hugging Face base, stopped, resumed, exported through the command line


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    """A random tiny Llama saved by transformers, and its logits on some tokens."""
    transformers = pytest.importorskip("transformers")
    args = _cfg().model
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf.hf_config(args))).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp("hf_base")
    theirs.save_pretrained(folder)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return folder, tokens, theirs(tokens).logits


def _hf_model(folder):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()


def test_lora_run_resumes_on_its_hf_base_and_exports_merged_and_peft(hf_base, tmp_path):
    from peft import PeftModel

    from shardwise.cli import main

    folder, tokens, base_logits = hf_base
    run = tmp_path / "run"
    overrides = [*LORA, "checkpoint.enabled=true", f"checkpoint.init_from_hf='{folder}'",
                 f"metrics.out_dir='{run}'", "metrics.progress=false", "metrics.tensorboard=false"]
    assert train(_cfg([*overrides, "train.stop_after=2"]))["stopped_at"] == 2
    final = tmp_path / "final.safetensors"
    assert train(_cfg(overrides), save_final=str(final))["first_step"] == 3

    # resumed on the Hugging Face base (bitwise), with trained adapters
    trained = load_file(final)
    base = {hf.from_hf_name(k): v for k, v in load_file(folder / "model.safetensors").items()}
    assert all(torch.equal(trained[n], v) for n, v in base.items())
    assert trained["layers.0.attention.wq.lora_b"].abs().sum() > 0

    # the reference: a LoRA model with the trained values, built here from the saved tensors
    cfg = _cfg(overrides)
    model = build_model(cfg.model)
    apply_lora(model, cfg.lora)
    materialize(model, cfg.model, "cpu", seed=5)
    model.load_state_dict(trained)
    with torch.no_grad():
        adapted = model.eval()(tokens)

    sets = [a for o in (*ADAMW, *overrides) for a in ("--set", o)]
    for fmt in ("merged", "base", "peft"):
        assert main(["export", "--config", CONFIG, *sets, "--out", str(tmp_path / fmt), "--format", fmt]) == 0
    with torch.no_grad():
        torch.testing.assert_close(_hf_model(tmp_path / "merged")(tokens).logits, adapted, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_hf_model(tmp_path / "base")(tokens).logits, base_logits, rtol=1e-5, atol=1e-5)
        peft_model = PeftModel.from_pretrained(_hf_model(folder), tmp_path / "peft").eval()
        torch.testing.assert_close(peft_model(tokens).logits, adapted, rtol=1e-5, atol=1e-5)
    # a model folder carries the run's tokenizer, and a fine-tuned one its base's start and end ids
    ids = ("bos_token_id", "eos_token_id")
    base_config = json.loads((folder / "config.json").read_text())
    for fmt in ("merged", "base"):
        exported = json.loads((tmp_path / fmt / "config.json").read_text())
        assert {k: exported[k] for k in ids} == {k: base_config[k] for k in ids}
        assert (tmp_path / fmt / "tokenizer.json").is_file()
    # others may read an export, as its config.json (safetensors writes 0600)
    umask = os.umask(0)
    os.umask(umask)
    for file in ("merged/model.safetensors", "peft/adapter_model.safetensors"):
        assert (tmp_path / file).stat().st_mode & 0o777 == 0o666 & ~umask
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(folder).resolve())
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"}


def test_lora_adapters_resume_and_export_only_onto_the_base_they_were_trained_on(hf_base, tmp_path, capsys):
    """An adapter checkpoint holds no base: resumed without checkpoint.init_from_hf it went on from a random base
    (loss 4.1 -> 7.2), and its retention then deleted every good checkpoint; export merged onto it silently."""
    import shutil

    from shardwise.cli import main

    folder = hf_base[0]
    run = tmp_path / "run"
    overrides = [*LORA, "checkpoint.enabled=true", f"metrics.out_dir='{run}'", "metrics.progress=false",
                 "metrics.tensorboard=false"]
    on_base = [*overrides, f"checkpoint.init_from_hf='{folder}'"]
    assert train(_cfg([*on_base, "train.stop_after=1"]))["stopped_at"] == 1
    other = tmp_path / "other"  # the same architecture, other weights
    shutil.copytree(folder, other)
    weights = load_file(other / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, other / "model.safetensors", metadata={"format": "pt"})
    moved = tmp_path / "moved"  # the same base elsewhere
    shutil.copytree(folder, moved)
    for extra, words in (([], ["trained on the base in", str(Path(folder).resolve()), "set checkpoint.init_from_hf"]),
                         ([f"checkpoint.init_from_hf='{other}'"], ["holds other weights"])):
        sets = [a for o in (*ADAMW, *overrides, *extra) for a in ("--set", o)]
        for command in (["train", "--config", CONFIG, *sets], ["export", "--config", CONFIG, *sets, "--out",
                                                               str(tmp_path / "out")]):
            assert main(command) == 3
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and all(w in err for w in words), err
    assert not (tmp_path / "out").exists() and [p.name for p in (run / "checkpoints").iterdir()] == ["step_1"]
    assert train(_cfg([*overrides, f"checkpoint.init_from_hf='{moved}'", "train.steps=2"]))["first_step"] == 2


def test_a_run_whose_tokenizer_is_not_the_hugging_face_folders_is_refused(hf_base, tmp_path):
    """data.tokenizer defaults to 'byte': a fine-tuning run that set checkpoint.init_from_hf and not data.tokenizer
    trained the folder's embeddings on byte ids (its tokenizer.json unread) without a word."""
    import shutil

    import tokenizers

    from shardwise.config import ConfigError

    folder = tmp_path / "base"
    shutil.copytree(hf_base[0], folder)
    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train_from_iterator([Path(json.__file__).read_text()], vocab_size=300, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok.save(str(folder / "tokenizer.json"))
    run = [*LORA, f"checkpoint.init_from_hf='{folder}'", f"metrics.out_dir='{tmp_path / 'run'}'",
           "metrics.progress=false", "metrics.tensorboard=false", "train.steps=1"]
    for tokenizer in ("byte", "bpe"):
        with pytest.raises(ConfigError) as e:
            train(_cfg([*run, f"data.tokenizer='{tokenizer}'", "data.bpe_vocab_size=300"]))
        assert e.value.field == "data.tokenizer" and str(folder / "tokenizer.json") in e.value.fix
    copy = tmp_path / "copy.json"  # the folder's tokenizer, wherever it is
    shutil.copy(folder / "tokenizer.json", copy)
    assert train(_cfg([*run, f"data.tokenizer='{copy}'"]))["first_step"] == 1


def test_a_tokenizer_of_more_ids_than_the_hugging_face_folder_names_data_tokenizer(hf_base, tmp_path):
    """A tokenizer of more ids than the folder's vocabulary was refused as 'set model.vocab_size >= N', whose fix
    init_from_hf then refused as another shape than the folder's: the wrong tokenizer is the field to name."""
    import shutil

    import tokenizers

    from shardwise.config import ConfigError

    tok = tokenizers.ByteLevelBPETokenizer()
    tok.train_from_iterator([Path(json.__file__).read_text()], vocab_size=400, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    tok.save(str(tmp_path / "big.json"))
    assert tok.get_vocab_size() > _cfg().model.vocab_size
    with_tokenizer = tmp_path / "base"  # its own tokenizer.json (300 ids), and one without (hf_base's)
    shutil.copytree(hf_base[0], with_tokenizer)
    small = tokenizers.ByteLevelBPETokenizer()
    small.train_from_iterator([Path(json.__file__).read_text()], vocab_size=300, special_tokens=["<|endoftext|>"],
                              show_progress=False)
    small.save(str(with_tokenizer / "tokenizer.json"))
    for folder in (with_tokenizer, hf_base[0]):
        run = [*LORA, f"checkpoint.init_from_hf='{folder}'", f"metrics.out_dir='{tmp_path / 'run'}'",
               "metrics.progress=false", "metrics.tensorboard=false", "train.steps=1",
               f"data.tokenizer='{tmp_path / 'big.json'}'"]
        with pytest.raises(ConfigError) as e:
            train(_cfg(run))
        assert e.value.field == "data.tokenizer" and "vocab_size" not in e.value.fix, e.value


def test_export_refuses_to_write_over_the_runs_base(hf_base, tmp_path, capsys):
    """`export --out BASE` with BASE the run's checkpoint.init_from_hf replaced the base's weights with the merged
    model: the base was gone and every resume, export and generate of the run's adapters was then refused."""
    import shutil

    from shardwise.cli import main

    folder = tmp_path / "base"
    shutil.copytree(hf_base[0], folder)
    weights = (folder / "model.safetensors").read_bytes()
    overrides = [*LORA, "checkpoint.enabled=true", f"metrics.out_dir='{tmp_path / 'run'}'", "metrics.progress=false",
                 "metrics.tensorboard=false", f"checkpoint.init_from_hf='{folder}'", "train.steps=1"]
    assert train(_cfg(overrides))["first_step"] == 1
    sets = [a for o in (*ADAMW, *overrides) for a in ("--set", o)]
    for fmt in ("merged", "base", "peft"):  # peft: an adapter beside the base, which init_from_hf then refuses
        assert main(["export", "--config", CONFIG, *sets, "--out", str(folder / "."), "--format", fmt]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("shardwise: error: --out: ") and "init_from_hf" in err[0], err
    assert (folder / "model.safetensors").read_bytes() == weights and not (folder / "adapter_config.json").exists()
    assert main(["export", "--config", CONFIG, *sets, "--out", str(tmp_path / "merged")]) == 0


def test_export_and_generate_of_a_run_whose_base_moved_name_init_from_hf(hf_base, tmp_path, capsys):
    """A LoRA checkpoint holds only adapters: with its base folder moved or deleted since training, `export --run`
    and `generate --run` were a FileNotFoundError traceback from inside the import."""
    import shutil

    from shardwise.cli import main

    folder = tmp_path / "base"
    shutil.copytree(hf_base[0], folder)
    run = tmp_path / "run"
    overrides = [*LORA, "checkpoint.enabled=true", f"metrics.out_dir='{run}'", "metrics.progress=false",
                 "metrics.tensorboard=false", f"checkpoint.init_from_hf='{folder}'", "train.steps=1"]
    assert train(_cfg(overrides))["first_step"] == 1
    folder.rename(tmp_path / "moved")
    for command in (["export", "--run", str(run), "--out", str(tmp_path / "merged")],
                    ["generate", "--run", str(run), "--prompt", "a", "--max-new-tokens", "1"]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("shardwise: error: checkpoint.init_from_hf: "), err
        assert str(folder.resolve()) in err[0] and "put the base back" in err[0], err
    assert not (tmp_path / "merged").exists()
    (tmp_path / "moved").rename(folder)  # back where the run took it from: the export goes through
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "merged")]) == 0


@pytest.fixture(scope="module")
def peft_adapter(hf_base, tmp_path_factory):
    """An adapter made by peft on hf_base's transformers model (rank 4, alpha 8, every projection, A and B random),
    saved by peft, and that model's logits with it."""
    from peft import LoraConfig, get_peft_model

    folder, tokens, _ = hf_base
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(_hf_model(folder), LoraConfig(r=4, lora_alpha=8, target_modules=modules))
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    adapter = tmp_path_factory.mktemp("adapter")
    model.save_pretrained(adapter)
    with torch.no_grad():
        return adapter, model.eval()(tokens).logits, load_file(adapter / "adapter_model.safetensors")


def test_a_lora_run_starts_from_a_peft_adapter_with_peft_s_logits(hf_base, peft_adapter, tmp_path):
    """lora.init_from: the adapters peft saved go into the model in place of the seeded ones (B = 0), and the model
    computes what peft's does; a run trains on from them."""
    folder, tokens, _ = hf_base
    adapter, peft_logits, peft_tensors = peft_adapter
    overrides = [*LORA_NO_DROPOUT, f"checkpoint.init_from_hf='{folder}'", f"lora.init_from='{adapter}'"]
    cfg = _cfg(overrides)
    model = build_training_model(cfg, Runtime.create(cfg))
    hf.import_hf([model], folder)
    hf.import_peft([model], adapter)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), peft_logits, rtol=1e-5, atol=1e-5)

    final = tmp_path / "final.safetensors"  # the trainer's own path: one AdamW step away from the adapter
    train(_cfg([*overrides, "train.steps=1", f"metrics.out_dir='{tmp_path / 'run'}'", "metrics.progress=false",
                "metrics.tensorboard=false"]), save_final=str(final))
    trained = load_file(final)
    lr = 3e-3  # ADAMW's; an Adam step moves each value by about the lr
    for name in _adapters([model]):
        moved = (trained[name] - peft_tensors[hf.to_peft_name(name)]).abs().max()
        assert 0 < moved < 2 * lr, (name, moved)


def test_a_run_that_goes_on_from_its_checkpoint_says_lora_init_from_is_not_read(hf_base, peft_adapter, tmp_path,
                                                                                caplog):
    """A run folder with a checkpoint resumes from it, adapters included: lora.init_from, given again to start anew
    from an adapter, went unread without a word."""
    overrides = [*LORA_NO_DROPOUT, f"checkpoint.init_from_hf='{hf_base[0]}'", f"lora.init_from='{peft_adapter[0]}'",
                 "checkpoint.enabled=true", "checkpoint.every=1", f"metrics.out_dir='{tmp_path / 'run'}'",
                 "metrics.progress=false", "metrics.tensorboard=false"]
    with caplog.at_level(logging.WARNING, logger="shardwise.train"):
        train(_cfg([*overrides, "train.steps=1"]))
        assert not [r for r in caplog.records if "lora.init_from" in r.getMessage()]  # read at the first step
        train(_cfg([*overrides, "train.steps=2"]))
    warned = [r.getMessage() for r in caplog.records if "lora.init_from is not read" in r.getMessage()]
    assert len(warned) == 1 and "checkpoint of step 1" in warned[0], warned


@pytest.mark.parametrize("peft_settings, words", [
    ({"r": 8}, ["r 8, lora_alpha 8", "rank 4", "set lora.rank = 8, lora.alpha = 8 and lora.targets"]),
    ({"lora_alpha": 16}, ["lora_alpha 16", "set lora.rank = 4, lora.alpha = 16"]),
    ({"target_modules": ["v_proj", "q_proj"]}, ["on wq,wv", "lora.targets = ['wq', 'wv']"]),
])
def test_a_peft_adapter_of_another_rank_alpha_or_targets_names_the_values_to_set(hf_base, tmp_path, peft_settings,
                                                                                 words):
    from peft import LoraConfig, get_peft_model

    from shardwise.config import ConfigError

    settings = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"], **peft_settings}
    get_peft_model(_hf_model(hf_base[0]), LoraConfig(**settings)).save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as e:
        _cfg([*LORA_NO_DROPOUT, f"lora.init_from='{tmp_path}'"])
    message = str(e.value)
    assert e.value.field == "lora.init_from" and "\n" not in message and all(w in message for w in words), message


@pytest.mark.parametrize("change, words", [
    ({"use_dora": True}, ["use_dora = True", "plain LoRA"]),
    # aLoRA: plain LoRA's tensors, applied from the invocation tokens on (it was applied to every token)
    ({"alora_invocation_tokens": [7, 11]}, ["alora_invocation_tokens = [7, 11]", "plain LoRA"]),
    ({"target_modules": ".*proj"}, ["target_modules '.*proj'"]),
    ({"peft_type": "IA3"}, ["IA3 adapter"]),
])
def test_a_peft_adapter_with_what_the_engine_s_lora_lacks_is_refused_in_one_line(peft_adapter, tmp_path, change,
                                                                                   words):
    import shutil

    from shardwise.config import ConfigError

    adapter = tmp_path / "adapter"
    shutil.copytree(peft_adapter[0], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as e:
        _cfg([*LORA_NO_DROPOUT, f"lora.init_from='{adapter}'"])
    message = str(e.value)
    assert e.value.field == "lora.init_from" and "\n" not in message and all(w in message for w in words), message


def test_a_peft_adapter_of_another_model_shape_is_refused_naming_the_tensor(peft_adapter, tmp_path):
    """An adapter for another base (here: one layer fewer than the model, a narrower MLP) passes on its config
    alone: its tensors are read (their headers) before any process starts."""
    from shardwise.config import ConfigError

    adapter = peft_adapter[0]
    for other, words in ((["model.n_layers=5"], ["has no tensor base_model.model.model.layers.4."]),
                         (["model.ffn_hidden=256"], ["down_proj.lora_A.weight of shape (4, 192)", "(4, 256)"])):
        with pytest.raises(ConfigError) as e:
            _cfg([*LORA_NO_DROPOUT, f"lora.init_from='{adapter}'", *other])
        assert e.value.field == "lora.init_from" and all(w in str(e.value) for w in words), e.value
    with pytest.raises(ConfigError) as e:
        _cfg([*LORA_NO_DROPOUT, f"lora.init_from='{tmp_path}'"])
    assert "adapter_config.json and no adapter_model.safetensors" in e.value.problem


def test_a_model_config_off_its_base_is_refused_naming_the_base_not_the_adapter(hf_base, peft_adapter):
    """The adapter fits the base it was made on (hf_base); a [model] that is not that base's shape is the [model]'s
    fault, and the line names the value to set: checked against the [model] first, the adapter was refused as one
    "trained on another base"."""
    from shardwise.config import ConfigError

    with pytest.raises(ConfigError) as e:
        _cfg([*LORA_NO_DROPOUT, f"checkpoint.init_from_hf='{hf_base[0]}'", f"lora.init_from='{peft_adapter[0]}'",
              "model.ffn_hidden=256"])
    assert e.value.field == "checkpoint.init_from_hf" and "set model.ffn_hidden = 192" in str(e.value), e.value


def test_a_merged_export_is_refused_over_a_peft_export(hf_base, tmp_path, capsys):
    """A merged export over an earlier peft export left adapter_config.json beside the merged weights:
    transformers (peft installed) loaded the adapters onto them, applied twice (logits 7% off), without a word; and
    a peft export over a merged one did the same."""
    from shardwise.cli import main

    overrides = [*LORA, "checkpoint.enabled=true", f"metrics.out_dir='{tmp_path / 'run'}'", "metrics.progress=false",
                 "metrics.tensorboard=false", f"checkpoint.init_from_hf='{hf_base[0]}'", "train.steps=1"]
    assert train(_cfg(overrides))["first_step"] == 1
    sets = [a for o in (*ADAMW, *overrides) for a in ("--set", o)]
    out = tmp_path / "out"
    assert main(["export", "--config", CONFIG, *sets, "--out", str(out), "--format", "peft"]) == 0
    capsys.readouterr()
    assert main(["export", "--config", CONFIG, *sets, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise: error: --out: ") and "adapter_config.json" in err[0], err
    assert not (out / "model.safetensors").exists()
    for fmt in ("peft", "base"):  # again, and the base beside its adapter (peft's own layout): written
        assert main(["export", "--config", CONFIG, *sets, "--out", str(out), "--format", fmt]) == 0
    # the other way round: a peft export over a merged one (the folder's weights say which they are)
    merged = tmp_path / "merged"
    assert main(["export", "--config", CONFIG, *sets, "--out", str(merged)]) == 0
    capsys.readouterr()
    assert main(["export", "--config", CONFIG, *sets, "--out", str(merged), "--format", "peft"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise: error: --out: ") and "merged" in err[0], err
    assert not (merged / "adapter_config.json").exists()
    assert main(["export", "--config", CONFIG, *sets, "--out", str(merged), "--format", "base"]) == 0
    assert main(["export", "--config", CONFIG, *sets, "--out", str(merged), "--format", "peft"]) == 0


def test_peft_export_of_a_full_run_names_the_format_flag(capsys, tmp_path):
    from shardwise.cli import main

    assert main(["export", "--set", f"metrics.out_dir='{tmp_path}'", "--out", str(tmp_path / "x"),
                 "--format", "peft"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--format" in err and "lora.rank is 0" in err


def test_a_failed_export_leaves_no_folder_it_made(capsys, tmp_path):
    from shardwise.cli import main

    out = tmp_path / "new" / "export"
    assert main(["export", "--set", f"metrics.out_dir='{tmp_path / 'run'}'", "--out", str(out)]) == 3  # CheckpointError
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "checkpoint" in err
    assert not (tmp_path / "new").exists()


def test_export_refuses_a_config_other_than_the_runs_and_run_exports_with_the_runs_own(tmp_path, capsys):
    """A LoRA checkpoint holds only its adapters: export rebuilt the frozen base from --config, so a run trained from
    the seeded init and exported with another train.seed wrote adapters merged onto another base; a model field that
    shapes no tensor (rope_theta) went to config.json as given. Both were written without a word. Now they are
    refused naming the field, and `export --run DIR` reads the run's own job_config.json."""
    from shardwise.cli import main

    run = tmp_path / "run"
    overrides = [*LORA, "checkpoint.enabled=true", f"metrics.out_dir='{run}'", "metrics.progress=false",
                 "metrics.tensorboard=false", "train.steps=1", "train.seed=3"]
    assert train(_cfg(overrides))["first_step"] == 1
    sets = [a for o in (*ADAMW, *overrides) for a in ("--set", o)]
    for other, field in (("train.seed=4", "train.seed"), ("model.rope_theta=1234.0", "model.rope_theta")):
        out = tmp_path / field
        assert main(["export", "--config", CONFIG, *sets, "--set", other, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"shardwise: error: {field}: ") and "--run" in err[0], err
        assert not out.exists()
    assert main(["export", "--config", CONFIG, *sets, "--out", str(tmp_path / "config")]) == 0
    assert main(["export", "--run", str(run), "--out", str(tmp_path / "run_export")]) == 0
    exported = [load_file(tmp_path / name / "model.safetensors") for name in ("config", "run_export")]
    assert exported[0].keys() == exported[1].keys()
    assert all(torch.equal(exported[0][k], exported[1][k]) for k in exported[0])
    assert (json.loads((tmp_path / "config" / "config.json").read_text())
            == json.loads((tmp_path / "run_export" / "config.json").read_text()))
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--set", "train.seed=4", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("shardwise: error: --run: ")


# ---------------------------------------------------------------------------------------------------
# Across layouts: saved by one process, resumed by FSDP over two ranks, and back


def _save(run, overrides):
    """Train 2 steps and save; the adapters as saved and the losses of 2 more steps."""
    cfg = _cfg([*LORA_NO_DROPOUT, *overrides])
    runtime = Runtime.create(cfg)
    state = _build(cfg, runtime)
    _steps(state, cfg, runtime, 2)
    Checkpointer(run, cfg.model).save(2, state)
    return {"adapters": _adapters(state.parts), "next": _steps(state, cfg, runtime, 2)}


def _resume(run, overrides, export_to=None):
    """A fresh state (adapters scrambled on every rank) resumes the run; its adapters, an export of it (merged
    and peft) and the losses of 2 more steps."""
    cfg = _cfg([*LORA_NO_DROPOUT, *overrides])
    runtime = Runtime.create(cfg)
    state = _build(cfg, runtime)
    _scramble_adapters(state)
    step = Checkpointer(run, cfg.model).resume(state)
    if export_to is not None:
        hf.export_hf(state.parts, cfg.model, export_to / "merged", runtime)
        hf.export_peft(state.parts, cfg.lora, export_to / "peft", runtime)
    return {"step": step, "adapters": _adapters(state.parts), "next": _steps(state, cfg, runtime, 2)}


def _from_adapter(adapter, overrides):
    """The adapters of a model of this layout given a peft adapter (lora.init_from), as full tensors."""
    cfg = _cfg([*LORA_NO_DROPOUT, f"lora.init_from='{adapter}'", *overrides])
    model = build_training_model(cfg, Runtime.create(cfg))
    hf.import_peft([model], adapter)
    return _adapters([model])


def _two_rank_job(saved_by_one, run, export_to, adapter):
    return {"resumed": _resume(saved_by_one, FSDP2, export_to), "saved": _save(run, FSDP2),
            "from_adapter": [_from_adapter(adapter, layout) for layout in (FSDP2, ["parallel.tp=2"])]}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.multiprocess
def test_lora_checkpoint_reshards_between_one_process_and_fsdp2(tmp_path, peft_adapter):
    one, two, exported = tmp_path / "one", tmp_path / "two", tmp_path / "exported"
    by_one = _save(one, [])
    out = run_distributed(_two_rank_job, 2, one, two, exported, peft_adapter[0])[0]
    # a peft adapter goes into every rank's piece of every adapter, under FSDP (A and B split by rows) and tensor
    # parallelism (A or B split after its base, the other whole)
    for adapters in out["from_adapter"]:
        assert _same(adapters, {n: peft_adapter[2][hf.to_peft_name(n)] for n in adapters})
    # one process -> FSDP over 2: every rank's shard of every adapter comes back (the full tensors gather both)
    assert out["resumed"]["step"] == 2 and _same(out["resumed"]["adapters"], by_one["adapters"])
    assert out["resumed"]["next"] == pytest.approx(by_one["next"], rel=1e-5)
    # FSDP over 2 -> one process
    back = _resume(two, [])
    assert back["step"] == 2 and _same(back["adapters"], out["saved"]["adapters"])
    assert back["next"] == pytest.approx(out["saved"]["next"], rel=1e-5)
    # an export under FSDP (sharded adapters gathered, merged on their shards) is the one-process export
    cfg = _cfg(LORA_NO_DROPOUT)
    model = build_training_model(cfg, Runtime.create(cfg))
    load(latest_checkpoint(one), TrainState([model]), cfg.model)
    hf.export_hf([model], cfg.model, tmp_path / "merged_one")
    hf.export_peft([model], cfg.lora, tmp_path / "peft_one")
    for got, want in ((exported / "merged" / hf.SINGLE_FILE, tmp_path / "merged_one" / hf.SINGLE_FILE),
                      (exported / "peft" / hf.ADAPTER_FILE, tmp_path / "peft_one" / hf.ADAPTER_FILE)):
        got, want = load_file(got), load_file(want)
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)


def test_two_fresh_runs_with_adapter_dropout_train_alike(tmp_path):
    """LoRA's dropout draws from torch's own generator, which this torch seeds at random in each process: two
    identical runs differed from step 2. It now follows train.seed (as a resume restores it)."""
    import subprocess
    import sys

    losses = []
    for run in ("a", "b"):  # fresh processes: each starts with its own random generator state
        out = tmp_path / run
        sets = [f"--set={o}" for o in (*ADAMW, *LORA, f"metrics.out_dir='{out}'", "metrics.log_every=1",
                                       "train.steps=3", "metrics.progress=false", "metrics.tensorboard=false")]
        done = subprocess.run([sys.executable, "-m", "shardwise", "train", "--config", CONFIG, *sets],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        losses.append([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
                       if "loss" in json.loads(line)])
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_lora_settings_without_a_rank_are_named_as_unused(tmp_path, caplog):
    """A [lora] table that sets alpha or targets but no rank (0: every weight trains) ran full fine-tuning without
    a word."""
    base = ["metrics.progress=false", "metrics.tensorboard=false", "train.steps=1", "train.val_every=0"]
    for sets, words in ((["lora.alpha=32", "lora.targets=['wq']"], "lora.alpha, lora.targets are not used"),
                        ([], None)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardwise.train"):
            train(_cfg([*base, f"metrics.out_dir='{tmp_path / str(len(sets))}'", *sets]))
        unused = [r.getMessage() for r in caplog.records if "lora.rank = 0" in r.getMessage()]
        assert (unused and words in unused[0]) if words else not unused, unused


def test_a_lora_run_that_saves_nothing_says_so(tmp_path, caplog):
    """A LoRA fine-tune with checkpoint.enabled = false (the default) trained adapters that nothing kept, without a
    word until `export` found no checkpoint."""
    base = [*LORA, "metrics.progress=false", "metrics.tensorboard=false", "train.steps=1", "train.val_every=0"]
    for sets, warned in ((["checkpoint.enabled=false"], True), (["checkpoint.enabled=true"], False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardwise.train"):
            train(_cfg([*base, f"metrics.out_dir='{tmp_path / str(warned)}'", *sets]))
        lines = [r.getMessage() for r in caplog.records if "adapters this run trains are not saved" in r.getMessage()]
        assert bool(lines) == warned, lines
