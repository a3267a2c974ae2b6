"""Checkpoints: exact resume, resume under another layout, atomicity, damaged input, Hugging Face interchange.

The reference for every resume is the same run without interruption (or, across layouts, the continuation
under the saving layout, which the parity tests tie to one device).
"""

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch.distributed.tensor import DTensor

from shardwise import checkpoint, hf, run_folder
from shardwise.checkpoint import Checkpointer, CheckpointError, TrainState, latest_checkpoint, load, scan_checkpoints
from shardwise.config import load_config
from shardwise.model import build_model, materialize
from shardwise.optim import build_lr_schedule, effective_lr
from shardwise.parallel.pipeline import Pipeline
from shardwise.parallel.runtime import Runtime
from shardwise.train import (
    build_data,
    build_grad_scaler,
    build_optimizer_for,
    build_training_model,
    pipeline_train_step,
    train_step,
)

from distributed import run_distributed

CONFIG = str(Path(__file__).parent / "configs" / "parity.toml")
# AdamW (two moments and a step count per parameter) with clipping, warmup and cosine decay: every piece of
# optimizer and schedule state must come back for the continuation to match
ADAMW = ["optim.name='adamw'", "optim.lr=3e-3", "optim.grad_clip=1.0", "optim.warmup_steps=2", "train.steps=4",
         "model.n_layers=4"]


def _cfg(overrides=()):
    return load_config(CONFIG, [*ADAMW, *overrides])


def _build(cfg, runtime):
    """A fresh training state under cfg's layout, exactly as the trainer builds it."""
    _, loader, _ = build_data(cfg, runtime)
    model = build_training_model(cfg, runtime)
    global_batch = cfg.train.micro_batch * cfg.train.grad_accum * runtime.dp_size
    optimizer, inner = build_optimizer_for(model, cfg, runtime, effective_lr(cfg.optim, global_batch))
    schedule = build_lr_schedule(inner, cfg.optim, cfg.train.steps)
    parts = list(model.stages) if isinstance(model, Pipeline) else [model]
    state = TrainState(parts, optimizer, schedule, build_grad_scaler(cfg.train, runtime.device), loader)
    state.model = model  # what the step runs: the model, or the pipeline
    return state


def _steps(state, cfg, runtime, n):
    losses = []
    tokens = cfg.train.micro_batch * cfg.train.grad_accum * runtime.dp_size * cfg.data.seq_len
    for _ in range(n):
        batches = state.loader.next_step()
        if isinstance(state.model, Pipeline):
            r = pipeline_train_step(state.model, state.optimizer, state.scaler, batches, grad_clip=cfg.optim.grad_clip,
                                    global_tokens=tokens, runtime=runtime)
        else:
            r = train_step(state.model, state.optimizer, state.scaler, batches, device=runtime.device,
                           grad_clip=cfg.optim.grad_clip, global_tokens=tokens, runtime=runtime)
        state.schedule.step()
        losses.append(r.loss)
    return losses


def _full_params(parts):
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for part in parts for n, p in part.named_parameters()}


def _all_ranks(flag: bool) -> bool:
    """flag on every rank (pipeline ranks compare different parameters)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _scramble(state):
    """Overwrite the fresh model so that only a complete load can bring back the saved values."""
    with torch.no_grad():
        for p in (p for part in state.parts for p in part.parameters()):
            (p.to_local() if isinstance(p, DTensor) else p).fill_(0.125)


def _resume_job(overrides, run_dir, save_at=2, total=4, async_save=False, keep=3):
    """Train `total` steps saving at `save_at`; then a fresh state loads the save and trains the rest."""
    cfg = _cfg(overrides)
    runtime = Runtime.create(cfg)
    ckpt = Checkpointer(run_dir, cfg.model, layout=vars(cfg.parallel), keep=keep, async_save=async_save)
    state = _build(cfg, runtime)
    losses = _steps(state, cfg, runtime, save_at)
    ckpt.save(save_at, state)
    losses += _steps(state, cfg, runtime, total - save_at)  # an async save writes while these run
    ckpt.close()
    reference = _full_params(state.parts)

    fresh = _build(cfg, runtime)
    _scramble(fresh)
    step = ckpt.resume(fresh)
    resumed = _steps(fresh, cfg, runtime, total - step)
    params = _full_params(fresh.parts)
    return {"losses": losses, "resumed": resumed, "step": step,
            "equal": _all_ranks(all(torch.equal(params[n], reference[n]) for n in reference))}


def _continue_job(overrides, run_dir, steps=2):
    """A fresh state under another layout loads the run's newest checkpoint and trains `steps` more."""
    cfg = _cfg(overrides)
    runtime = Runtime.create(cfg)
    state = _build(cfg, runtime)
    _scramble(state)
    step = Checkpointer(run_dir, cfg.model).resume(state)
    return {"step": step, "losses": _steps(state, cfg, runtime, steps)}


# Two spawned jobs (starting gloo processes costs more than the training here): four ranks save under
# dp2 x tp2 (ZeRO-3), dp2 x tp2 (ZeRO-1) and pp2 x dp2, resume each exactly, and reshard to FSDP over 4 and
# to tp2 x dp2; two ranks then reshard to 2 ranks and import a Hugging Face folder under tp=2.
DP2_TP2 = ["parallel.dp_shard=2", "parallel.tp=2", "parallel.zero_stage=3"]
FSDP4 = ["parallel.dp_shard=4", "parallel.zero_stage=3", "train.micro_batch=4"]  # same global batch of 16
ZERO1_DP2_TP2 = ["parallel.dp_replicate=2", "parallel.tp=2", "parallel.zero_stage=1"]
# two stages per rank (interleaved 1F1B): a rank's state comes from several stage modules
PP2_DP2 = ["parallel.pp=2", "parallel.dp_shard=2", "parallel.zero_stage=3", "parallel.virtual_stages=2",
           "parallel.pp_schedule='interleaved-1f1b'"]
TP2_DP2 = ["parallel.tp=2", "parallel.dp_replicate=2"]
ZERO3_DP2 = ["parallel.dp_shard=2", "parallel.zero_stage=3"]
ZERO2_DP2 = ["parallel.dp_shard=2", "parallel.zero_stage=2"]
ZERO1_DP2 = ["parallel.dp_replicate=2", "parallel.zero_stage=1"]


def _four_rank_job(run_tp, run_zero1, run_pp):
    return {"tp": _resume_job(DP2_TP2, run_tp), "fsdp4": _continue_job(FSDP4, run_tp),
            "zero1": _resume_job(ZERO1_DP2_TP2, run_zero1),
            "pp": _resume_job(PP2_DP2, run_pp), "pp_to_tp": _continue_job(TP2_DP2, run_pp)}


def _two_rank_job(run_tp, run_zero1, hf_dir, tokens, hf_out):
    return {"from_tp": _continue_job(ZERO2_DP2, run_tp), "from_tp_to_zero1": _continue_job(ZERO1_DP2, run_tp),
            "from_zero1": _continue_job(ZERO3_DP2, run_zero1), "hf_logits": _hf_round_trip(hf_dir, tokens, hf_out),
            "refused": _refused_on_rank0(run_tp)}


def _refused_on_rank0(run_dir):
    """Rank 0's train_state.json write refused under ZeRO-3 on two ranks: every rank's line, and the newest
    checkpoint afterwards (the other rank used to wait in DCP's collectives while rank 0 printed a traceback)."""
    cfg = _cfg(ZERO3_DP2)
    runtime = Runtime.create(cfg)
    state = _build(cfg, runtime)
    newest = latest_checkpoint(run_dir)
    real = checkpoint._fsync_write

    def full(path, text):
        if path.name == "train_state.json" and dist.get_rank() == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, text)

    checkpoint._fsync_write = full
    try:
        Checkpointer(run_dir, cfg.model).save(99, state)
        message = None
    except CheckpointError as e:
        message = str(e)
    finally:
        checkpoint._fsync_write = real
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    return {"messages": messages, "newest_before": newest, "newest_after": latest_checkpoint(run_dir)}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    runs = tmp_path_factory.mktemp("tp"), tmp_path_factory.mktemp("zero1"), tmp_path_factory.mktemp("pp")
    return runs, run_distributed(_four_rank_job, 4, *runs)[0]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A random tiny Llama saved by transformers itself, and its logits on some tokens."""
    transformers = pytest.importorskip("transformers")
    args = _cfg().model
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf.hf_config(args))).eval()
    with torch.no_grad():
        for p in theirs.parameters():  # off the default init, norms included, so a mix-up shows
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp("hf")
    theirs.save_pretrained(folder)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = theirs(tokens).logits
    return folder, tokens, logits


@pytest.fixture(scope="module")
def two_ranks(four_ranks, hf_folder, tmp_path_factory):
    (run_tp, run_zero1, _), _ = four_ranks
    folder, tokens, _ = hf_folder
    out = tmp_path_factory.mktemp("hf_out")
    return {**run_distributed(_two_rank_job, 2, run_tp, run_zero1, folder, tokens, out)[0], "hf_out": out}


def _hf_round_trip(folder, tokens, out):
    """Import a transformers folder under tp=2, and export it again from there (gathering the DTensors)."""
    cfg = _cfg(["parallel.tp=2"])
    runtime = Runtime.create(cfg)
    model = build_training_model(cfg, runtime)
    hf.import_hf([model], folder)
    hf.export_hf([model], cfg.model, out, runtime)
    with torch.no_grad():
        return model(tokens)


def test_exact_resume_one_device(tmp_path):
    out = _resume_job([], tmp_path)
    assert out["step"] == 2
    assert out["resumed"] == out["losses"][2:]  # identical floats, not close ones
    assert out["equal"]


@pytest.mark.parametrize("workers", [1, 2], ids=["one-thread", "split"])
def test_resume_computes_attention_in_the_forms_the_run_chose(tmp_path, monkeypatch, workers):
    """The CPU attention's form is chosen by timing (model.cpu_attention_form) and the forms agree only to
    rounding: a checkpoint keeps each rank's choice, so a resumed run whose timing would choose another form
    continues bit for bit; a form split over threads too."""
    from shardwise import model as model_module

    monkeypatch.setattr(model_module, "_cpu_attention_forms", {})
    chosen = {"form": model_module.CpuAttention(model_module.CPU_ATTENTION_BLOCK, workers=workers)}
    monkeypatch.setattr(model_module, "_fastest_cpu_attention", lambda q, k, v: chosen["form"])
    cfg = _cfg(["data.seq_len=256", "model.n_layers=2", "train.micro_batch=2"])  # two blocks of 128 tokens
    runtime = Runtime.create(cfg)
    ckpt = Checkpointer(tmp_path, cfg.model, layout=vars(cfg.parallel))
    state = _build(cfg, runtime)
    _steps(state, cfg, runtime, 2)
    ckpt.save(2, state)
    losses = _steps(state, cfg, runtime, 2)
    reference = _full_params(state.parts)
    assert set(model_module._cpu_attention_forms.values()) == {chosen["form"]}

    model_module._cpu_attention_forms.clear()  # as a new process
    chosen["form"] = None  # whose timing would choose SDPA
    fresh = _build(cfg, runtime)
    assert ckpt.resume(fresh) == 2
    assert _steps(fresh, cfg, runtime, 2) == losses  # identical floats
    params = _full_params(fresh.parts)
    assert all(torch.equal(params[n], reference[n]) for n in reference)
    assert set(model_module._cpu_attention_forms.values()) == {model_module.CpuAttention(
        model_module.CPU_ATTENTION_BLOCK, workers=workers)}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the background save, one process
def test_async_save_and_keep_last(tmp_path):
    cfg = _cfg()
    runtime = Runtime.create(cfg)
    state = _build(cfg, runtime)
    ckpt = Checkpointer(tmp_path, cfg.model, keep=2, async_save=True)
    for step in range(1, 5):
        _steps(state, cfg, runtime, 1)  # while the previous step's checkpoint is written in the background
        ckpt.save(step, state)
    ckpt.close()
    assert [s for s, _ in scan_checkpoints(tmp_path).complete] == [3, 4]
    fresh = _build(cfg, runtime)
    _scramble(fresh)
    assert ckpt.resume(fresh) == 4
    params, reference = _full_params(fresh.parts), _full_params(state.parts)
    assert all(torch.equal(params[n], reference[n]) for n in reference)
    assert _steps(fresh, cfg, runtime, 1) == _steps(state, cfg, runtime, 1)


@pytest.mark.multiprocess
def test_exact_resume_dp2_tp2(four_ranks):
    out = four_ranks[1]["tp"]
    assert out["step"] == 2 and out["resumed"] == out["losses"][2:] and out["equal"]


@pytest.mark.multiprocess
def test_exact_resume_zero1(four_ranks):
    out = four_ranks[1]["zero1"]
    assert out["step"] == 2 and out["resumed"] == out["losses"][2:] and out["equal"]


@pytest.mark.multiprocess
def test_reshard_dp2_tp2_to_fsdp4_and_to_two_ranks_zero2_and_zero1(four_ranks, two_ranks):
    same_layout = four_ranks[1]["tp"]["losses"][2:]
    for other in (four_ranks[1]["fsdp4"], two_ranks["from_tp"], two_ranks["from_tp_to_zero1"]):
        assert other["step"] == 2
        assert other["losses"] == pytest.approx(same_layout, rel=1e-5)


@pytest.mark.multiprocess
def test_exact_resume_pp2_dp2_and_reshard_to_tp2_dp2(four_ranks):
    out, other = four_ranks[1]["pp"], four_ranks[1]["pp_to_tp"]
    assert out["step"] == 2 and out["resumed"] == out["losses"][2:] and out["equal"]
    assert other["losses"] == pytest.approx(out["losses"][2:], rel=1e-5)


@pytest.mark.multiprocess
def test_reshard_zero1_to_zero3_on_two_ranks(four_ranks, two_ranks):
    assert two_ranks["from_zero1"]["losses"] == pytest.approx(four_ranks[1]["zero1"]["losses"][2:], rel=1e-5)


@pytest.mark.multiprocess
def test_hf_import_and_export_under_tp2(hf_folder, two_ranks):
    torch.testing.assert_close(two_ranks["hf_logits"], hf_folder[2], rtol=1e-5, atol=1e-5)
    import transformers

    again = transformers.LlamaForCausalLM.from_pretrained(two_ranks["hf_out"], local_files_only=True,
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(hf_folder[1]).logits, hf_folder[2], rtol=1e-5, atol=1e-5)


def test_hf_export_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    args = _cfg().model
    model = build_model(args)
    materialize(model, args, "cpu", seed=3)
    hf.export_hf([model], args, tmp_path)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path, local_files_only=True,
                                                           dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)
    # and back: a fresh model imports the exported folder to the same numbers
    again = build_model(args)
    materialize(again, args, "cpu", seed=4)
    hf.import_hf([again], tmp_path)
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------------
# Partial, damaged and mismatched checkpoints


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A one-device run with a checkpoint at step 2."""
    run = tmp_path_factory.mktemp("saved")
    cfg = _cfg()
    runtime = Runtime.create(cfg)
    state = _build(cfg, runtime)
    _steps(state, cfg, runtime, 2)
    Checkpointer(run, cfg.model).save(2, state)
    return run, _full_params(state.parts)


def _copy(saved, tmp_path):
    shutil.copytree(saved[0], tmp_path / "run")
    return tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_2"


def test_partial_checkpoints_are_ignored_and_reported(saved_run, tmp_path, caplog):
    run, good = _copy(saved_run, tmp_path)
    (good.parent / "step_3.tmp").mkdir()  # a save that never committed
    shutil.copytree(good, good.parent / "step_4")
    (good.parent / "step_4" / "meta.json").unlink()  # a folder without its metadata
    with caplog.at_level(logging.WARNING, logger="shardwise.checkpoint"):
        assert latest_checkpoint(run) == good
    assert "step_3.tmp" in caplog.text and "step_4" in caplog.text and "meta.json" in caplog.text
    # the next save clears the unfinished write and commits next to the older checkpoint
    cfg, state, _ = _fresh_state()
    Checkpointer(run, cfg.model).save(5, state)
    assert not (good.parent / "step_3.tmp").exists()
    assert [s for s, _ in scan_checkpoints(run).complete] == [2, 5]


def test_only_rank_0_reads_the_run_folder_it_sets_aside(tmp_path, monkeypatch):
    """A run started over: rank 0 moves checkpoints/ to earlier/ while the others wait. Each other rank scanned the
    folder too, and one that listed checkpoints/ as it was moved away failed with a FileNotFoundError traceback
    (review, 2026-12-02); the steps it found were used by nothing."""
    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)

    def scan(run_dir):
        raise FileNotFoundError(checkpoint.checkpoint_root(run_dir))  # as rank 0's rename left it

    monkeypatch.setattr(checkpoint, "scan_checkpoints", scan)
    monkeypatch.setattr(checkpoint, "_rank", lambda: 1)
    assert checkpoint.set_aside(tmp_path) == []
    assert (tmp_path / "checkpoints" / "step_2").is_dir()  # rank 0's to move


def test_a_changed_norm_epsilon_or_rotary_base_resumes_with_a_warning(saved_run, caplog):
    """They fit the same weights (a longer context's rotary base is a reason to change one), but the weights were
    trained with the earlier values: said, where it was silent (loss 4.18 -> 5.49 with norm_eps = 0.1)."""
    path = saved_run[0] / "checkpoints" / "step_2"
    cfg, state, _ = _fresh_state(["model.norm_eps=0.1", "model.rope_theta=500000.0"])
    with caplog.at_level(logging.WARNING, logger="shardwise.checkpoint"):
        assert load(path, state, cfg.model) == 2
    assert "model.norm_eps" in caplog.text and "-> 0.1" in caplog.text and "model.rope_theta" in caplog.text
    caplog.clear()
    cfg, state, _ = _fresh_state()
    with caplog.at_level(logging.WARNING, logger="shardwise.checkpoint"):
        load(path, state, cfg.model)
    assert "changed model" not in caplog.text


def _fresh_state(overrides=()):
    cfg = _cfg(overrides)
    runtime = Runtime.create(cfg)
    state = _build(cfg, runtime)
    return cfg, state, _full_params(state.parts)


def _assert_refused(path, overrides, *words):
    cfg, state, before = _fresh_state(overrides)
    with pytest.raises(CheckpointError) as err:
        load(path, state, cfg.model)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "fix:" in message, message
    for word in words:
        assert word in message, message
    after = _full_params(state.parts)
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing was overwritten
    assert state.loader.state_dict()["step_in_epoch"] == 0


def test_weights_only_load(saved_run):
    cfg, state, _ = _fresh_state()
    _scramble(state)
    assert load(latest_checkpoint(saved_run[0]), TrainState(state.parts), cfg.model) == 2
    params = _full_params(state.parts)
    assert all(torch.equal(params[n], saved_run[1][n]) for n in params)


def test_truncated_shard_file_is_refused(saved_run, tmp_path):
    _, path = _copy(saved_run, tmp_path)
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _assert_refused(path, [], "truncated")


def test_corrupted_shard_file_is_refused(saved_run, tmp_path):
    _, path = _copy(saved_run, tmp_path)
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _assert_refused(path, [], "CRC32")


def test_missing_metadata_is_refused(saved_run, tmp_path):
    _, path = _copy(saved_run, tmp_path)
    (path / "meta.json").unlink()
    _assert_refused(path, [], "meta.json is missing")


@pytest.mark.parametrize("name, edit, words", [
    ("meta.json", lambda meta: [], "meta.json holds a list"),  # AttributeError before
    ("train_state.json", lambda state: [], "train_state.json holds a list"),
    ("meta.json", lambda meta: {**meta, "files": 5}, "meta.json's 'files' is 5"),
    ("meta.json", lambda meta: {k: v for k, v in meta.items() if k != "model"}, "meta.json has no 'model'"),
    # without its file list the CRC checks were skipped and a corrupted shard loaded
    ("meta.json", lambda meta: {k: v for k, v in meta.items() if k != "files"}, "meta.json has no 'files'"),
    ("train_state.json", lambda state: {**state, "step": "x"}, "train_state.json's 'step' is 'x'"),
    ("meta.json", lambda meta: {**meta, "files": {k: {} for k in meta["files"]}}, "lacks its size or CRC32"),
    # an adapter record without its settings: a KeyError traceback where the fix names them
    ("meta.json", lambda meta: {**meta, "lora": {"rank": 4}}, "meta.json's 'lora' is {'rank': 4}"),
])
def test_damaged_checkpoint_json_is_refused(saved_run, tmp_path, name, edit, words):
    _, path = _copy(saved_run, tmp_path)
    (path / name).write_text(json.dumps(edit(json.loads((path / name).read_text()))))
    _assert_refused(path, [], words, "move this step's folder out")


def test_other_model_shape_is_refused(saved_run, tmp_path):
    _, path = _copy(saved_run, tmp_path)
    _assert_refused(path, ["model.dim=32", "model.ffn_hidden=96"], "different model", "dim 64 vs 32")


def test_another_optimizer_names_the_optim_name_to_set(saved_run, tmp_path):
    """optim.name = 'momentum' against an AdamW checkpoint said "this run uses SGD" and named no setting."""
    _, path = _copy(saved_run, tmp_path)
    _assert_refused(path, ["optim.name='momentum'"], "it holds AdamW state, this run uses SGD",
                    "fix: set optim.name = 'adamw'")


@pytest.mark.parametrize("overrides, words", [
    (["model.dim=32", "model.ffn_hidden=96"], "dim 64 vs 32"),
    (["optim.name='momentum'"], "it holds AdamW state, this run uses SGD"),
    (["train.micro_batch=4"], "global_batch=8, this run has 4"),
    (["train.seed=7"], "seed=0, this run has 7"),
    (["train.steps=1"], "train.steps: 1 is below step 2"),
    (["train.stop_after=2"], "train.stop_after: 2 is before step 3"),
    (["lora.rank=4"], "it holds no LoRA (every weight), this run trains LoRA rank 4, alpha/rank 4"),
], ids=["model", "optimizer", "batch", "seed", "steps", "stop_after", "lora"])
def test_a_resume_the_checkpoint_refuses_is_refused_before_any_process_starts(saved_run, tmp_path, monkeypatch,
                                                                               capsys, overrides, words):
    """`train --nproc 2` on a run folder whose newest checkpoint the config cannot resume: the launcher reads the
    checkpoint's JSON and says what the ranks' load would, before it starts them (they imported torch, built the
    model and read the data first, then every rank refused); a plain run says it before it imports torch."""
    from shardwise import cli
    from shardwise.launch import local

    run, path = _copy(saved_run, tmp_path)
    monkeypatch.setattr(local, "launch_local", lambda *a, **k: pytest.fail("a process was started"))
    sets = [f"--set={o}" for o in [*ADAMW, f"metrics.out_dir='{run}'", "checkpoint.enabled=true", *overrides]]
    config_error = overrides[0].startswith(("train.steps", "train.stop_after"))  # exit code 2; the checkpoint's: 3
    for nproc in (["--nproc", "1"], []):
        assert cli.main(["train", "--config", CONFIG, *nproc, *sets]) == (2 if config_error else 3)
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and words in err and "fix:" in err, err
    if not config_error:  # the ranks' load: the same line
        cfg, state, _ = _fresh_state(overrides)
        with pytest.raises(CheckpointError) as refused:
            load(path, state, cfg.model)
        assert err == f"shardwise: error: {refused.value}"
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_2"]


def test_a_changed_global_batch_names_the_batch_to_set_not_the_folder_to_move(saved_run, tmp_path):
    """The run's data order follows its global batch: resuming with another is the config's to fix, and moving
    the step's folder aside (the fix for damage, which the message gave) finds an older one with the same batch."""
    _, path = _copy(saved_run, tmp_path)
    _assert_refused(path, ["train.micro_batch=4"], "global_batch=8, this run has 4",
                    "fix: set train.global_batch = 8")
    with pytest.raises(CheckpointError) as err:
        load(path, _fresh_state(["train.micro_batch=4"])[1], _cfg().model)
    assert "move this step's folder" not in str(err.value)


def test_an_adapter_checkpoint_names_the_lora_settings_it_was_saved_with(tmp_path):
    with pytest.raises(CheckpointError) as err:
        run_folder.check_lora(tmp_path, {"rank": 16, "scale": 2.0, "targets": ["wq", "wv"]},
                              {"rank": 16, "scale": 1.0, "targets": ["wq", "wv"]})
    assert 'set lora.rank = 16, lora.alpha = 32 and lora.targets = ["wq", "wv"]' in str(err.value)


def test_an_adapter_checkpoints_base_record_without_its_folder_is_damaged(tmp_path):
    """The base a LoRA run's adapters were trained on, as meta.json records it, without its folder: the message that
    names the folder to set was a KeyError traceback."""
    for mine in (None, {"init_from_hf": "/base", "config_crc32": 1, "weights": {}}):
        with pytest.raises(CheckpointError) as err:
            run_folder.check_lora_base(tmp_path, {"config_crc32": 1, "weights": {}}, mine)
        assert "meta.json's 'lora_base' is {'config_crc32': 1, 'weights': {}} (damaged or edited)" in str(err.value)


def test_metadata_pickle_cannot_run_code(saved_run, tmp_path):
    import os
    import pickle

    class Exploit:
        def __reduce__(self):
            return os.system, ("touch " + str(tmp_path / "pwned"),)

    _, path = _copy(saved_run, tmp_path)
    (path / ".metadata").write_bytes(pickle.dumps(Exploit()))
    _assert_refused(path, [], "refusing to unpickle")
    assert not (tmp_path / "pwned").exists()


def test_sigterm_sets_the_stop_flag():
    import os
    import signal

    from shardwise.checkpoint import StopSignal

    previous = signal.getsignal(signal.SIGTERM)
    for process_exits in (False, True):
        unused = StopSignal(process_exits=process_exits)
        unused.close()
        assert signal.getsignal(signal.SIGTERM) is previous  # no stop came: the handlers are put back
    stopped = StopSignal()  # in a process that goes on after the run (verify's reference)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.requested()
    stopped.close()
    assert signal.getsignal(signal.SIGTERM) is previous
    stop = StopSignal(process_exits=True)  # the command line's
    try:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGTERM)  # the process survives: the handler only sets a flag
        assert stop.requested()
        stop.close()
        # after a stop the process is on its way out: a repeated signal is ignored
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        for s, handler in stop._previous.items():
            signal.signal(s, handler)


def test_a_stopped_run_in_verifys_process_leaves_its_signal_handlers_as_they_were(tmp_path, monkeypatch):
    """verify trains its one-device reference in its own process. A SIGTERM that stopped that run left SIGTERM and
    SIGUSR1 ignored (StopSignal.close, meant for a process on its way out): verify could then no longer be stopped,
    and the ranks it launched next inherited the ignore."""
    import shardwise.train as train_module
    from shardwise import verify

    step = train_module.training_step

    def signalled(*args, **kwargs):  # the scheduler's SIGTERM, arriving while the run trains
        os.kill(os.getpid(), signal.SIGTERM)
        return step(*args, **kwargs)

    monkeypatch.setattr(train_module, "training_step", signalled)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    config = str(Path(__file__).parent / "configs" / "parity.toml")
    verify._train_here(config, [f"metrics.out_dir='{tmp_path}'", "train.steps=3", "metrics.progress=false",
                                "metrics.tensorboard=false", "train.val_every=0"], tmp_path / "final.safetensors")
    assert json.loads((tmp_path / "stopped.json").read_text())["signal"]  # the signal did stop it
    assert {s: signal.getsignal(s) for s in before} == before


# ---------------------------------------------------------------------------------------------------
# A process killed while it saves


def save_then_die(run: str, moment: str) -> None:
    """Train 2 steps and save; train 2 more and start saving step 4, SIGKILLing this process at `moment` of that
    save: while DCP writes the tensor data, or at the commit's rename. Run in a child process."""
    import os
    import signal

    import torch.distributed.checkpoint.filesystem as dcp_files

    cfg = _cfg()
    runtime = Runtime.create(cfg)
    state = _build(cfg, runtime)
    ckpt = Checkpointer(run, cfg.model)
    _steps(state, cfg, runtime, 2)
    ckpt.save(2, state)
    _steps(state, cfg, runtime, 2)
    written = []

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def write_one_then_die(*args, **kwargs):
        if written:
            die()
        written.append(real_write(*args, **kwargs))
        return written[-1]

    def write_then_die_after_meta(path, text):
        real_fsync_write(path, text)
        if path.name == "meta.json":
            die()

    real_write, real_fsync_write = dcp_files._write_item, checkpoint._fsync_write
    if moment == "data":
        dcp_files._write_item = write_one_then_die  # the second tensor is never written
    else:
        checkpoint._fsync_write = write_then_die_after_meta  # meta.json is written, the folder never renamed
    ckpt.save(4, state)


@pytest.mark.parametrize("moment", ["data", "commit"])
@pytest.mark.multiprocess
def test_kill_during_a_save_keeps_the_previous_checkpoint(saved_run, tmp_path, moment):
    run = tmp_path / "run"
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_checkpoint as t; " \
           f"t.save_then_die({str(run)!r}, {moment!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (run / "checkpoints" / "step_4.tmp").is_dir()  # the save had started
    assert (run / "checkpoints" / "step_4.tmp" / "meta.json").exists() == (moment == "commit")
    assert latest_checkpoint(run) == run / "checkpoints" / "step_2"
    cfg, state, _ = _fresh_state()
    _scramble(state)
    assert load(latest_checkpoint(run), state, cfg.model) == 2
    params = _full_params(state.parts)
    assert all(torch.equal(params[n], saved_run[1][n]) for n in params)  # the weights saved at step 2


def test_a_crash_while_replacing_a_step_keeps_it(saved_run, tmp_path):
    """Saving a step that exists moves the old copy aside first; a crash before the new one is renamed in leaves
    `step_N.replaced`, which still counts as step N."""
    run, good = _copy(saved_run, tmp_path)
    good.rename(good.with_name("step_2.replaced"))
    (good.parent / "step_2.tmp").mkdir()  # the replacement, never committed
    assert latest_checkpoint(run) == good.with_name("step_2.replaced")
    cfg, state, _ = _fresh_state()
    assert load(latest_checkpoint(run), state, cfg.model) == 2
    Checkpointer(run, cfg.model).save(2, state)  # the same step saved again: one step_2 is left
    assert sorted(p.name for p in good.parent.iterdir()) == ["step_2"]


def test_a_users_backup_folder_is_left_alone(saved_run, tmp_path):
    """A copy the user made beside the checkpoints (`step_2.old`) is neither loaded nor deleted by the saves that
    replace step 2 and by retention, and the scan says why it skips it."""
    run, good = _copy(saved_run, tmp_path)
    backup = good.with_name("step_2.old")
    shutil.copytree(good, backup)
    scan = scan_checkpoints(run)
    assert [folder for _, folder in scan.complete] == [good]
    assert scan.partial == [(backup, "not a checkpoint's name (step_<N>); left alone")]
    cfg, state, _ = _fresh_state()
    checkpointer = Checkpointer(run, cfg.model, keep=1)
    for step in (2, 3, 4):  # step 2 again (its old copy replaced), then retention down to one
        checkpointer.save(step, state)
    assert sorted(p.name for p in good.parent.iterdir()) == ["step_2.old", "step_4"]
    assert (backup / "meta.json").read_bytes() == (saved_run[0] / "checkpoints" / "step_2" / "meta.json").read_bytes()


@pytest.mark.parametrize("refused", ["train_state.json", "meta.json"])
def test_rank_0s_own_writes_refused_during_a_save_are_one_line(saved_run, tmp_path, monkeypatch, refused):
    """A full disk at train_state.json (before DCP writes) or meta.json (after it, before the rename) was a traceback
    of rank 0's; the newest complete checkpoint stays what a restart resumes from."""
    run, good = _copy(saved_run, tmp_path)
    real = checkpoint._fsync_write

    def full(path, text):
        if path.name == refused:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, text)

    monkeypatch.setattr(checkpoint, "_fsync_write", full)
    cfg, state, _ = _fresh_state()
    with pytest.raises(CheckpointError) as err:
        Checkpointer(run, cfg.model).save(5, state)
    message = str(err.value)
    assert "\n" not in message and "saving step 5 failed on rank 0: [Errno 28] No space left on device" in message
    assert "it resumes from step_2" in message, message
    assert latest_checkpoint(run) == good


@pytest.mark.multiprocess
def test_two_ranks_both_raise_rank_0s_refused_write(two_ranks):
    result = two_ranks["refused"]
    for message in result["messages"]:  # rank 0's and rank 1's
        assert message and "saving step 99 failed on rank 0: [Errno 28]" in message, result
    assert result["newest_after"] == result["newest_before"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_during_a_save_is_one_line_naming_the_checkpoint_resumed_from(saved_run, tmp_path, monkeypatch,
                                                                                   async_save):
    """The file system refusing DCP's writes (a full disk, a read-only folder) was DCP's traceback from every rank
    and torchrun's report, exit code 1; the newest complete checkpoint stays what a restart resumes from."""
    run, good = _copy(saved_run, tmp_path)

    class FullDisk(dcp_filesystem.FileSystemWriter):
        def write_data(self, plan, planner):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint.dcp, "FileSystemWriter", FullDisk)
    cfg, state, _ = _fresh_state()
    ckpt = Checkpointer(run, cfg.model, async_save=async_save)
    with pytest.raises(CheckpointError) as err:
        ckpt.save(5, state)
        ckpt.wait()
    message = str(err.value)
    assert "\n" not in message and "saving step 5 failed on rank 0: [Errno 28] No space left on device" in message
    assert "it resumes from step_2" in message, message
    assert latest_checkpoint(run) == good
