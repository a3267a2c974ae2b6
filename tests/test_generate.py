"""Sampling: the KV cache against the training forward, transformers' filters and greedy `generate`, seeds, and
`shardwise generate` on a run trained under a 2-rank layout and on a Hugging Face folder."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.cli import main
from shardwise.config import load_config
from shardwise.generate import Sampling, filter_logits, generate_ids, kv_cache, load_hf, next_token
from shardwise.model import build_model, causal_attention, materialize

CONFIG = str(Path(__file__).parent / "configs" / "parity.toml")


@pytest.fixture(scope="module")
def model():
    args = load_config(CONFIG, ["model.n_layers=2"]).model  # 8 query heads on 4 key/value heads: GQA
    m = build_model(args)
    materialize(m, args, "cpu", seed=5)
    # sharp attention: at N(0, 0.02) the attention scores are ~0.03 and attention is nearly uniform, which would
    # hide a wrong mask, position or cached key; x8 on both projections makes the scores ~2
    with torch.no_grad():
        for block in m.layers.values():
            block.attention.wq.weight.mul_(8)
            block.attention.wk.weight.mul_(8)
    return m.eval()


def _prompt(n, vocab, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------------------------------
# KV cache


@torch.no_grad()
def test_cached_logits_equal_the_training_forward(model):
    """A prompt of 7, a chunk of 5 (a mask offset by the cached positions), then one token at a time: every
    position's logits equal those of one forward over the whole sequence."""
    tokens = torch.tensor([_prompt(24, model.args.vocab_size)] * 2)  # a batch of two
    full = model(tokens)
    pieces, bounds = [], [0, 7, 12, *range(13, 25)]
    with kv_cache(model, batch=2, max_len=24) as cache:
        for lo, hi in zip(bounds, bounds[1:]):
            pieces.append(model(tokens[:, lo:hi], torch.arange(lo, hi)))
        assert cache.lengths == [24, 24]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    # the model's own attention is back
    assert all(block.attention.attention_fn is causal_attention for block in model.layers.values())


@torch.no_grad()
def test_cache_under_bf16_autocast_with_a_lora_model_stored_in_bf16():
    """A LoRA run trained in bf16 stores its frozen projections in bf16 and runs under autocast: the cache takes
    autocast's dtype, and its logits are the full forward's (to bf16's precision)."""
    from shardwise.lora import apply_lora
    from shardwise.loss import autocast_context

    cfg = load_config(CONFIG, ["model.n_layers=2", "lora.rank=4", "train.precision='bf16'"])
    m = build_model(cfg.model)
    apply_lora(m, cfg.lora, torch.bfloat16)
    materialize(m, cfg.model, "cpu", seed=5)
    for name, p in m.named_parameters():
        if name.endswith("lora_b"):
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))  # adapters that change the output
    m.eval()
    tokens = torch.tensor([_prompt(16, cfg.model.vocab_size)])
    with autocast_context("bf16", torch.device("cpu")):
        full = m(tokens)
        with kv_cache(m, batch=1, max_len=16) as cache:
            pieces = [m(tokens[:, :9], torch.arange(9))] + [m(tokens[:, i:i + 1], torch.arange(i, i + 1))
                                                            for i in range(9, 16)]
    assert cache.keys.dtype == torch.bfloat16
    torch.testing.assert_close(torch.cat(pieces, dim=1).float(), full.float(), rtol=2e-2, atol=2e-2)
    new = generate_ids(m, tokens[0].tolist(), 5, Sampling(temperature=0), precision="bf16")
    assert len(new) == 5


def test_greedy_decoding_with_cache_equals_without(model):
    prompt = _prompt(6, model.args.vocab_size, seed=1)
    greedy = Sampling(temperature=0)
    cached = generate_ids(model, prompt, 20, greedy, use_cache=True)
    uncached = generate_ids(model, prompt, 20, greedy, use_cache=False)
    assert len(cached) == 20 and cached == uncached


def test_stop_token_ends_generation(model):
    prompt = _prompt(6, model.args.vocab_size, seed=1)
    first = generate_ids(model, prompt, 20, Sampling(temperature=0))
    stop = first[4]
    assert generate_ids(model, prompt, 20, Sampling(temperature=0), stop_ids=[stop]) == first[:first.index(stop) + 1]


# ---------------------------------------------------------------------------------------------------
# Sampling


def test_complete_says_after_how_many_tokens_the_model_stopped(model):
    """A new user's sampled run printed only its prompt: the model had written end-of-text at once, and nothing
    said so. `complete` returns where a stop token ended the text (the CLI says it on stderr), None without one."""
    from shardwise.data import ByteTokenizer
    from shardwise.generate import Loaded, complete

    tok = ByteTokenizer()
    prompt = "def f(x):"
    ids = [tok.eos_id, *tok.encode(prompt).tolist()]
    first = generate_ids(model, ids, 12, Sampling(temperature=0))
    stop = first[5]
    text, stopped = complete(Loaded(model, tok, [tok.eos_id], [stop]), prompt, 12, Sampling(temperature=0))
    assert stopped == first.index(stop) and text == tok.decode([*ids[1:], *first[:stopped]])
    assert complete(Loaded(model, tok, [tok.eos_id], []), prompt, 12, Sampling(temperature=0))[1] is None


def test_seeded_sampling_is_reproducible_and_seeds_differ(model):
    prompt = _prompt(6, model.args.vocab_size, seed=2)
    runs = {seed: generate_ids(model, prompt, 20, Sampling(temperature=1.0, seed=seed)) for seed in (1, 2)}
    assert generate_ids(model, prompt, 20, Sampling(temperature=1.0, seed=1)) == runs[1]
    assert runs[1] != runs[2]
    # the same draws with and without the cache: the cache changes nothing the sampler sees
    assert generate_ids(model, prompt, 20, Sampling(temperature=1.0, seed=1), use_cache=False) == runs[1]


def test_filters_by_hand():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = probs.log()

    def kept(**kw):
        return torch.isfinite(filter_logits(logits, **kw)).nonzero().flatten().tolist()

    assert kept(top_k=2) == [0, 1]
    # nucleus: ascending cumulative 0.05, 0.15, 0.30, 0.50, 1.0; drop the tail whose mass is <= 1 - p
    assert kept(top_p=0.8) == [0, 1, 2]  # drops mass 0.15: 0.85 >= 0.8 stays
    assert kept(top_p=0.6) == [0, 1]  # drops mass 0.30
    assert kept(top_p=0.4) == [0]  # drops mass 0.50
    assert kept(top_p=0.01) == [0]  # the most likely token always stays
    # top-k first, then top-p over the renormalised survivors: 0.5, 0.2, 0.15 -> 0.588, 0.235, 0.176
    assert kept(top_k=3, top_p=0.7) == [0, 1]
    # ties with the k-th logit stay, as in transformers
    assert torch.isfinite(filter_logits(torch.tensor([1.0, 2.0, 2.0, 0.0]), top_k=1)).tolist() == [
        False, True, True, False]


def test_filters_match_transformers_warpers():
    transformers = pytest.importorskip("transformers")
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = torch.randn(8, 50, generator=torch.Generator().manual_seed(0)) * 3
    for t, k, p in [(1.0, 5, 1.0), (0.7, 0, 0.9), (1.3, 10, 0.5), (0.5, 50, 0.95)]:
        theirs = TemperatureLogitsWarper(t)(None, scores)
        theirs = TopKLogitsWarper(k)(None, theirs) if k else theirs
        theirs = TopPLogitsWarper(p)(None, theirs) if p < 1 else theirs
        torch.testing.assert_close(filter_logits(scores / t, k, p), theirs, rtol=0, atol=0)
    assert transformers is not None


def test_temperature_zero_is_argmax_and_top_k_one_is_greedy():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(3))
    best = int(logits.argmax())
    assert next_token(logits, Sampling(temperature=0), None) == best
    g = torch.Generator().manual_seed(0)
    assert {next_token(logits, Sampling(temperature=2.0, top_k=1), g) for _ in range(20)} == {best}


# ---------------------------------------------------------------------------------------------------
# A Hugging Face folder: greedy tokens against transformers' own generate


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A random tiny LlamaForCausalLM written by save_pretrained, with a byte-level BPE tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("hf")
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=256, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(folder)
    tok = tokenizers.ByteLevelBPETokenizer()
    text = [Path(json.__file__).read_text()]
    tok.train_from_iterator(text, vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save(str(folder / "tokenizer.json"))
    return folder, theirs


def test_a_llama_3_2_style_folder_imports_with_its_rotary_scaling(tmp_path):
    """A folder whose config asks for Llama 3.1 / 3.2's rotary scaling (rope_type 'llama3'; its pre-training context
    cut to 32 so that 200 tokens reach the scaled band) loads with transformers' logits."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path)
    from shardwise.hf import import_hf
    from shardwise.model_args import args_from_hf_config

    args = args_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert (args.rope_scaling_factor, args.rope_original_max_seq_len) == (32.0, 32)
    ours = build_model(args)
    materialize(ours, args, "cpu", seed=0, init_values=False)
    import_hf([ours], tmp_path)
    tokens = torch.randint(0, 320, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours.eval()(tokens) - theirs(tokens).logits).abs().max().item() <= 1e-5


def test_hf_greedy_tokens_match_transformers_generate(hf_folder, capsys):
    folder, theirs = hf_folder
    loaded = load_hf(folder)
    prompt = loaded.prefix + list(loaded.tokenizer.encode("def loads(s, *, cls=None"))
    ours = generate_ids(loaded.model, prompt, 20, Sampling(temperature=0), loaded.stop_ids)
    with torch.no_grad():
        out = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, eos_token_id=2,
                              pad_token_id=0)
    assert ours == out[0, len(prompt):].tolist()
    assert main(["generate", "--hf", str(folder), "--prompt", "def loads(s, *, cls=None", "--temperature", "0",
                 "--max-new-tokens", "20"]) == 0
    new = [i for i in ours if i not in loaded.stop_ids]
    expected = loaded.tokenizer.decode(prompt[1:] + new)
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize("argv, flag", [
    ([], "--run/--hf"),
    (["--run", "R", "--hf", "H"], "--run/--hf"),
    (["--run", "H"], "--run"),  # a folder, but not a training run's
    (["--hf", "H", "--temperature", "-0.5"], "--temperature"),
    (["--hf", "H", "--top-p", "0"], "--top-p"),
    (["--hf", "H", "--top-p", "1.01"], "--top-p"),
    (["--hf", "H", "--top-k", "-1"], "--top-k"),
    (["--hf", "H", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--hf", "H", "--max-new-tokens", "250"], "--max-new-tokens"),  # past the model's 256 positions
    (["--hf", "H", "--temperature", "nan"], "--temperature"),
], ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_bad_input_is_one_line_naming_the_flag(hf_folder, tmp_path, capsys, argv, flag):
    folder = str(hf_folder[0])
    argv = [folder if a in ("H", "R") else a for a in argv]
    assert main(["generate", "--prompt", "x = 1\n" * 4, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"shardwise: error: {flag}: ") and "fix:" in err[0]


def test_a_prompt_that_fills_the_model_names_the_prompt(hf_folder, capsys):
    assert main(["generate", "--hf", str(hf_folder[0]), "--prompt", "x" * 300]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardwise: error: --prompt: ") and "fewer than 256 tokens" in err


def test_hf_folder_without_tokenizer_says_what_is_needed(hf_folder, tmp_path, capsys):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((hf_folder[0] / name).read_bytes())
    assert main(["generate", "--hf", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: --hf: ") and "no tokenizer.json" in err


def test_generate_run_reads_a_run_with_relative_paths_from_another_folder(tmp_path, monkeypatch):
    """A run trained with data.tokenizer = 'tok/tokenizer.json' (relative) kept that path in job_config.json, and
    `generate --run` from any other working folder was refused naming data.tokenizer."""
    from shardwise import data
    from shardwise.config import DataConfig
    from shardwise.generate import load_run
    from shardwise.train import train

    work = tmp_path / "work"
    (work / "tok").mkdir(parents=True)
    (work / "tok" / "tokenizer.json").write_text(data.tokenizer_json(DataConfig(), tmp_path))
    monkeypatch.chdir(work)
    train(load_config(CONFIG, ["data.tokenizer='tok/tokenizer.json'", "metrics.out_dir='runs/rel'", "train.steps=1",
                               "checkpoint.enabled=true", "metrics.tensorboard=false", "metrics.progress=false",
                               "train.val_every=0", "model.n_layers=2"]))
    monkeypatch.chdir(tmp_path)
    loaded = load_run(work / "runs" / "rel")
    assert loaded.tokenizer.vocab_size == 257


def _bpe_run(tmp_path, corpus, steps, *extra):
    from shardwise.train import train

    return train(load_config(CONFIG, [f"data.paths=['{corpus}']", "data.tokenizer='bpe'", "data.bpe_vocab_size=300",
                                      f"data.cache_dir='{tmp_path / 'cache'}'", f"metrics.out_dir='{tmp_path / 'run'}'",
                                      f"train.steps={steps}", "checkpoint.enabled=true", "metrics.tensorboard=false",
                                      "metrics.progress=false", "train.val_every=0", "model.n_layers=2",
                                      "train.micro_batch=2", *extra]))


def test_generate_and_export_read_the_tokenizer_the_run_trained_with(tmp_path):
    """A 'bpe' run's tokenizer was rebuilt from data.paths at each generate --run and export: after the corpus
    changed, a BPE of other ids (garbage text, and an export carrying it); after it was removed, a refusal."""
    from shardwise.cli import main
    from shardwise.generate import load_run

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"the quick brown fox {i} jumps over the lazy dog\n" for i in range(300)))
    _bpe_run(tmp_path, corpus, 1)
    (trained,) = (tmp_path / "cache" / "tokenizers").glob("bpe-*.json")
    probe = "the quick brown fox 12 jumps"
    ids = load_run(tmp_path / "run").tokenizer.encode(probe)
    corpus.write_text("".join(f"lorem ipsum dolor {i} sit amet consectetur\n" for i in range(300)))
    assert load_run(tmp_path / "run").tokenizer.encode(probe) == ids
    assert main(["export", "--config", CONFIG, "--set", f"data.paths=['{corpus}']", "--set", "data.tokenizer='bpe'",
                 "--set", "data.bpe_vocab_size=300", "--set", f"data.cache_dir='{tmp_path / 'cache'}'", "--set",
                 f"metrics.out_dir='{tmp_path / 'run'}'", "--set", "model.n_layers=2",
                 "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == trained.read_text()
    # transformers' AutoTokenizer reads the folder as the run's tokenizer, its end-of-text token named (without a
    # tokenizer_config.json it had no eos_token, which trainers that pad or stop with it need)
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    eos = load_run(tmp_path / "run").tokenizer.eos_id
    assert theirs(probe)["input_ids"] == ids and theirs.eos_token_id == eos and theirs.bos_token_id == eos
    corpus.unlink()
    assert load_run(tmp_path / "run").tokenizer.encode(probe) == ids


@pytest.mark.parametrize("context", [65536, 128])
def test_a_run_fine_tuned_from_a_folder_exports_the_folders_tokenizer_config(hf_folder, tmp_path, context):
    """A model fine-tuned with its base's own tokenizer keeps the base's tokenizer_config.json (its chat template,
    its special tokens), generation_config.json and context length; the export had neither file, and its config.json
    gave model.max_seq_len (2048 unless set) as the context of a 64K base, and then of a 128-token one fine-tuned at
    64 (the [model] written without max_seq_len)."""
    import shutil

    from shardwise.model_args import args_from_hf_config

    base = tmp_path / "base"
    shutil.copytree(hf_folder[0], base)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                        "chat_template": "{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}"}
    (base / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.6}))
    config = json.loads((base / "config.json").read_text())
    config["max_position_embeddings"] = context  # fine-tuned at 64 tokens (CONFIG's data.seq_len)
    (base / "config.json").write_text(json.dumps(config))
    args = args_from_hf_config(json.loads((base / "config.json").read_text()))
    fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "norm_eps", "rope_theta")
    model = [f"model.{k}={json.dumps(getattr(args, k))}" for k in fields]
    sets = [a for o in (*model, "model.name='tiny'", f"checkpoint.init_from_hf='{base}'", "checkpoint.enabled=true",
                        f"data.tokenizer='{base / 'tokenizer.json'}'", f"metrics.out_dir='{tmp_path / 'run'}'",
                        "train.steps=1", "train.micro_batch=2", "metrics.progress=false", "metrics.tensorboard=false")
            for a in ("--set", o)]
    assert main(["train", "--config", CONFIG, *sets]) == 0
    assert main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_text() == (base / name).read_text()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["max_position_embeddings"] == context


def test_a_resume_whose_tokenizer_gives_other_ids_is_refused(tmp_path):
    """The same text, the same token count, other ids (two tokens swapped): the checkpoint's embeddings are indexed
    by the saved tokenizer's ids, and the resume went on with the new ones without a word."""
    from shardwise.config import ConfigError

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"the quick brown fox {i} jumps over the lazy dog\n" for i in range(300)))
    _bpe_run(tmp_path, corpus, 1)
    saved = json.loads((tmp_path / "run" / "tokenizer.json").read_text())
    vocab = saved["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (tmp_path / "swapped.json").write_text(json.dumps(saved))
    with pytest.raises(ConfigError) as e:
        _bpe_run(tmp_path, corpus, 2, f"data.tokenizer='{tmp_path / 'swapped.json'}'")
    assert e.value.field == "data.tokenizer" and "this run trained with" in str(e.value)
    _bpe_run(tmp_path, corpus, 2, f"data.tokenizer='{tmp_path / 'run' / 'tokenizer.json'}'")  # its own: goes on


def test_a_resume_with_another_kind_of_tokenizer_is_refused_naming_it(tmp_path):
    """A 'bpe' run resumed with the byte tokenizer: the other sample count was refused first, as the data loader's
    ("read the same data as the run did"), where what changed is data.tokenizer (trial, 2026-12-02)."""
    from shardwise.config import ConfigError

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"the quick brown fox {i} jumps over the lazy dog\n" for i in range(300)))
    _bpe_run(tmp_path, corpus, 1)
    with pytest.raises(ConfigError) as e:
        _bpe_run(tmp_path, corpus, 2, "data.tokenizer='byte'")
    assert e.value.field == "data.tokenizer" and "this run trained with" in str(e.value)


def test_hf_folder_without_weights_is_refused_in_one_line(hf_folder, tmp_path, capsys):
    """A folder with config.json and tokenizer.json but no safetensors was a FileNotFoundError traceback."""
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((hf_folder[0] / name).read_bytes())
    assert main(["generate", "--hf", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise: error: --hf: ") and "model.safetensors" in err[0], err


def test_hf_folder_holding_a_peft_adapter_is_refused_in_one_line(hf_folder, tmp_path, capsys):
    """`export --format peft` and then `--format base` into one folder is peft's layout, which transformers loads
    with the adapter applied; `generate --hf` read the base weights alone and wrote the base model's text without a
    word. An adapter folder alone was told to copy config.json in, after which the same happened."""
    beside = tmp_path / "beside"
    beside.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (beside / name).write_bytes((hf_folder[0] / name).read_bytes())
    alone = tmp_path / "alone"
    alone.mkdir()
    for folder in (beside, alone):
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
        assert main(["generate", "--hf", str(folder), "--prompt", "x"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("shardwise: error: --hf: "), err
        assert "adapter_config.json" in err[0] and f"--adapter {folder}" in err[0], err
    assert main(["generate", "--run", str(beside), "--adapter", str(beside), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise: error: --adapter: given without --hf"), err


def test_hf_greedy_tokens_with_a_peft_adapter_match_peft_s_generate(hf_folder, tmp_path, capsys):
    """`generate --hf BASE --adapter DIR` decodes what transformers + peft decode with that adapter on that base,
    token for token; an adapter of another model's shape is refused naming the flag."""
    import transformers
    from peft import LoraConfig, get_peft_model

    folder, theirs = hf_folder
    peft_model = get_peft_model(copy.deepcopy(theirs), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj",
                                                                  "v_proj", "down_proj"]))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    peft_model.save_pretrained(tmp_path / "adapter")
    loaded = load_hf(folder, tmp_path / "adapter")
    prompt = loaded.prefix + list(loaded.tokenizer.encode("def loads(s, *, cls=None"))
    ours = generate_ids(loaded.model, prompt, 20, Sampling(temperature=0), loaded.stop_ids)
    with torch.no_grad():
        out = peft_model.eval().generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=20,
                                         eos_token_id=2, pad_token_id=0)
        base = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, eos_token_id=2,
                               pad_token_id=0)
    assert ours == out[0, len(prompt):].tolist() != base[0, len(prompt):].tolist()
    args = ["generate", "--hf", str(folder), "--prompt", "x", "--adapter", str(tmp_path / "adapter")]
    assert main(args) == 0
    capsys.readouterr()
    other = tmp_path / "other"  # the adapter of a model with another MLP width
    other_model = get_peft_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4)), LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"]))
    other_model.save_pretrained(other)
    assert main([*args[:-1], str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise: error: --adapter: ") and "down_proj" in err[0], err


def test_hf_folder_with_rotary_scaling_is_refused_in_one_line(hf_folder, tmp_path, capsys):
    """A folder asking for a rotary scaling the engine does not have (YaRN; Llama 3.1's 'llama3' it has) was
    decoded with plain rotary embeddings, its logits not the model's."""
    import json

    for name in ("model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_bytes((hf_folder[0] / name).read_bytes())
    config = json.loads((hf_folder[0] / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["generate", "--hf", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise: error: --hf: ") and "'yarn' rotary scaling" in err[0]


def test_hf_folder_the_engine_cannot_express_is_refused_in_one_line(hf_folder, tmp_path, capsys):
    """Projections with biases (a config flag, or bias tensors under none) were decoded without them, the logits not
    the model's; a shape args_from_hf_config refuses (heads that do not divide hidden_size, no head_dim) was a
    ValueError traceback, and a
    tokenizer.json of more ids than the model's vocabulary an IndexError once the prompt held one of them."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((hf_folder[0] / "config.json").read_text())
    weights = load_file(hf_folder[0] / "model.safetensors")
    biased = {**weights, "model.layers.0.self_attn.q_proj.bias": torch.ones(config["hidden_size"])}
    for change, tensors, words in (({"attention_bias": True}, weights, "attention_bias = true"),
                                   ({"mlp_bias": True}, weights, "mlp_bias = true"),
                                   ({}, biased, "q_proj.bias"),
                                   ({"head_dim": None, "num_attention_heads": 3}, weights,
                                    "num_attention_heads = 3 does not divide"),
                                   # a head width the weights were not made for (since attn_head_dim: a shape error)
                                   ({"head_dim": 2 * config["hidden_size"] // config["num_attention_heads"]},
                                    weights, "wq.weight has shape"),
                                   ({"vocab_size": 256}, {**weights, "model.embed_tokens.weight":
                                                          weights["model.embed_tokens.weight"][:256],
                                                          "lm_head.weight": weights["lm_head.weight"][:256]},
                                    "tokenizer.json has 300 ids")):
        (tmp_path / "tokenizer.json").write_bytes((hf_folder[0] / "tokenizer.json").read_bytes())
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
        assert main(["generate", "--hf", str(tmp_path), "--prompt", "x"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("shardwise: error: --hf: ") and words in err[0], err


# ---------------------------------------------------------------------------------------------------
# A run trained on two ranks, generated from in one process


@pytest.mark.multiprocess
def test_generate_from_a_tensor_parallel_run(tmp_path, capsys):
    """Train 3 steps with tp=2 saving a checkpoint, then `shardwise generate --run` in this one process; the
    reference decodes, without a cache, from the parameters the two ranks gathered at the end (--save-final)."""
    from safetensors.torch import load_file

    from shardwise.data import ByteTokenizer

    run, final = tmp_path / "run", tmp_path / "final.safetensors"
    sets = [f"metrics.out_dir='{run}'", "train.steps=3", "checkpoint.enabled=true", "parallel.tp=2",
            "model.n_layers=2"]
    proc = subprocess.run([sys.executable, "-m", "shardwise", "train", "--config", CONFIG,
                           *[f"--set={s}" for s in sets], "--nproc=2", "--save-final", str(final)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    prompt = "import os\n"
    assert main(["generate", "--run", str(run), "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", "30"]) == 0
    written = capsys.readouterr().out

    args = load_config(CONFIG, sets).model
    reference = build_model(args)
    materialize(reference, args, "cpu", seed=0)
    reference.load_state_dict(load_file(str(final)))  # every parameter (the rotary table is no state)
    tok = ByteTokenizer()
    ids = [tok.eos_id, *tok.encode(prompt).tolist()]
    new = generate_ids(reference.eval(), ids, 30, Sampling(temperature=0), [tok.eos_id], use_cache=False)
    assert written == tok.decode(ids[1:] + new) + "\n"

    # exported, the folder carries the run's tokenizer and end-of-text framing: generate --hf writes the same
    # (it could not: the folder had no tokenizer.json, and a byte-tokenizer run had none to copy)
    folder = tmp_path / "exported"
    assert main(["export", "--config", CONFIG, *[f"--set={s}" for s in sets], "--out", str(folder)]) == 0
    capsys.readouterr()
    assert main(["generate", "--hf", str(folder), "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", "30"]) == 0
    assert capsys.readouterr().out == written
    assert written.startswith(prompt) and len(written) > len(prompt) + 1


def test_a_tokenizer_config_names_the_first_of_a_list_of_end_tokens(hf_folder, tmp_path):
    """Llama 3's config.json lists its end tokens (eos_token_id: [128001, 128008, 128009]); a base with such a
    list and no tokenizer_config.json of its own, fine-tuned with its tokenizer, gets one naming the first, and keeps
    its generation_config.json."""
    import tokenizers

    from shardwise.hf import write_tokenizer_files

    tokenizer = (hf_folder[0] / "tokenizer.json").read_text()
    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer.json").write_text(tokenizer)
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    out = tmp_path / "out"
    out.mkdir()
    write_tokenizer_files(out, tokenizer, {"bos_token_id": 1, "eos_token_id": [2, 3]}, 256, base)
    config = json.loads((out / "tokenizer_config.json").read_text())
    names = tokenizers.Tokenizer.from_str(tokenizer)
    assert (config["bos_token"], config["eos_token"]) == (names.id_to_token(1), names.id_to_token(2))
    assert (out / "generation_config.json").read_text() == (base / "generation_config.json").read_text()


# ---------------------------------------------------------------------------------------------------
# Chat templates

# Meta-Llama-3-8B-Instruct's tokenizer_config.json chat_template, verbatim
LLAMA3_TEMPLATE = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
                   "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
                   "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
                   "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
                   "<|end_header_id|>\\n\\n' }}{% endif %}")
# what the sandbox settings decide: trim_blocks and lstrip_blocks (the indented lines), loop controls, the
# generation tag, raise_exception, tojson (not HTML-escaped) and strftime_now
LAYOUT_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
<<SYS>>{{ message['content'] | tojson }} {{ strftime_now('%Y') }}<</SYS>>
        {% continue %}
    {% endif %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('Conversation roles must be system, user or assistant') }}
    {% endif %}
    {% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}
    {% else %}
[INST] {{ message['content'] }} [/INST]
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}"""
CHAT_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CONVERSATIONS = [
    [{"role": "user", "content": "def loads(s):"}],
    [{"role": "system", "content": "You write Python <b>&</b> \"JSON\"."},
     {"role": "user", "content": "  def loads(s):  "}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]


@pytest.fixture(scope="module")
def chat_folder(hf_folder, tmp_path_factory):
    """hf_folder with Llama 3's turn markers as special tokens, its chat template, and <|eot_id|> as a stop token."""
    import shutil

    import tokenizers

    folder = tmp_path_factory.mktemp("chat")
    for file in hf_folder[0].iterdir():
        shutil.copy(file, folder)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(CHAT_SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    eot = tok.token_to_id("<|eot_id|>")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "tokenizer_class": "PreTrainedTokenizerFast",
         "chat_template": LLAMA3_TEMPLATE}))
    # as save_pretrained writes a special token beside it: an AddedToken's fields
    (folder / "special_tokens_map.json").write_text(json.dumps(
        {"eos_token": {"content": "<|eot_id|>", "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False}}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, eot]}))
    return folder, hf_folder[1]


@pytest.mark.parametrize("template", [LLAMA3_TEMPLATE, LAYOUT_TEMPLATE], ids=["llama3", "layout"])
def test_a_chat_is_the_text_and_ids_transformers_apply_chat_template_gives(chat_folder, tmp_path, template):
    """`generate --chat` renders the folder's template as transformers' apply_chat_template (add_generation_prompt)
    does, and encodes the turn markers as their special ids (plain `encode` keeps them as text)."""
    import shutil

    transformers = pytest.importorskip("transformers")
    from shardwise.chat import render_chat, special_tokens
    from shardwise.data import HFTokenizer
    from shardwise.errors import ConfigError

    folder = tmp_path / "f"
    shutil.copytree(chat_folder[0], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    ours = HFTokenizer(folder / "tokenizer.json", "file")
    for messages in CONVERSATIONS:
        text = render_chat(template, messages, special_tokens(folder))
        assert text == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ours.encode_with_special_tokens(text) == list(ids)
        assert ours.encode(text) != list(ids)  # the markers' text, byte by byte
    with pytest.raises(ConfigError) as err:
        render_chat(LAYOUT_TEMPLATE, [{"role": "tool", "content": "x"}], special_tokens(folder))
    assert err.value.field == "--chat" and "roles must be system, user or assistant" in err.value.problem


def test_generate_chat_replies_as_transformers_generate_on_the_chat_template(chat_folder, capsys):
    transformers = pytest.importorskip("transformers")
    folder, model = chat_folder
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "Python only."}, {"role": "user", "content": "def loads(s, *, cls"}]
    ids = list(theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20, eos_token_id=eos,
                             pad_token_id=0)[0, len(ids):].tolist()
    reply = [i for i in out if i not in eos]
    assert main(["generate", "--hf", str(folder), "--chat", "--system", "Python only.", "--prompt",
                 "def loads(s, *, cls", "--temperature", "0", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out == theirs.decode(reply) + "\n"


@pytest.mark.parametrize("argv, words", [
    (["--hf", "H", "--system", "x"], "--system: given without --chat"),
    (["--hf", "H", "--chat"], "has no chat template"),
    (["--run", "R", "--chat"], "--chat: a training run's folder holds no chat template"),
])
def test_chat_without_what_it_needs_is_one_line(hf_folder, tmp_path, capsys, argv, words):
    (tmp_path / "checkpoints" / "step_1").mkdir(parents=True)  # what generate --run looks for first
    (tmp_path / "checkpoints" / "step_1" / "meta.json").write_text("{}")
    (tmp_path / "job_config.json").write_text("{}")
    argv = [{"H": str(hf_folder[0]), "R": str(tmp_path)}.get(a, a) for a in argv]
    assert main(["generate", "--prompt", "x", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0] and "fix:" in err[0], err
