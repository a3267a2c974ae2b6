"""The single-device step: accumulation, recompute, loss scaling, and a short real run."""

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from shardwise.activation_checkpoint import apply_activation_checkpointing
from shardwise.config import OptimConfig, TrainConfig, load_config
from shardwise.data import Batch
from shardwise.model import build_model, materialize
from shardwise.model_args import preset
from shardwise.optim import build_optimizer, lr_factor
from shardwise.train import build_grad_scaler, loss_sum, optimizer_step, train, train_step

from probes import LiveBytes, SavedBytes

CPU = torch.device("cpu")


def _model(args=None, seed=0, policy="none", every=1):
    args = args or preset("tiny")
    model = build_model(args)
    apply_activation_checkpointing(model, policy, every)
    materialize(model, args, CPU, seed)
    return model


def _batch(rows, seq=32, vocab=320, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), list(range(rows)))


def _split(batch, k):
    n = batch.inputs.shape[0] // k
    cuts = [slice(i * n, (i + 1) * n) for i in range(k)]
    return [Batch(batch.inputs[c], batch.targets[c], batch.sample_ids[c]) for c in cuts]


def _grads(model, batches):
    total_tokens = sum(b.targets.numel() for b in batches)
    loss = 0.0
    for b in batches:
        part = loss_sum(model, b, CPU, "fp32") / total_tokens
        part.backward()
        loss += part.item()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss, grads


@pytest.mark.parametrize("k", [2, 4])
def test_grad_accumulation_equals_one_big_batch(k):
    model = _model()
    batch = _batch(8)
    loss_one, grads_one = _grads(model, [batch])
    loss_k, grads_k = _grads(model, _split(batch, k))
    assert loss_k == pytest.approx(loss_one, rel=1e-6)
    for name, g in grads_one.items():
        torch.testing.assert_close(grads_k[name], g, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("clip", [0.5, 1e6])
def test_clipping_scales_the_gradients_to_the_threshold(clip):
    """The optimizer sees gradients whose total norm is the threshold when the norm exceeds it, and the
    gradients unchanged when it does not; the step reports the norm before clipping."""
    seen = {}

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            seen["norm"] = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
            seen["grads"] = [p.grad.clone() for p in model.parameters()]
            return super().step(closure)

    model = _model()
    loss_sum(model, _batch(4), CPU, "fp32").backward()
    raw = [p.grad.clone() for p in model.parameters()]
    raw_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in raw])).item()
    assert raw_norm > 0.5
    opt = Recording(model.parameters(), lr=0.0)
    result = optimizer_step(list(model.parameters()), opt, build_grad_scaler(TrainConfig(), CPU), clip,
                            torch.zeros(()))
    assert result.grad_norm == pytest.approx(raw_norm, rel=1e-5)
    if clip < raw_norm:
        assert seen["norm"] == pytest.approx(clip, rel=1e-5)
        for g, r in zip(seen["grads"], raw):
            torch.testing.assert_close(g, r * (clip / (raw_norm + 1e-6)), rtol=1e-6, atol=0)
    else:
        assert all(torch.equal(g, r) for g, r in zip(seen["grads"], raw))


def test_grad_accumulation_full_step_equals_one_big_batch():
    """Through clipping and the optimizer: k x (b/k) and one batch b give the same updated weights.

    Momentum SGD, because Adam's first step is lr * sign(g) and turns 1e-9 differences of near-zero gradients
    into differences of 2 lr, which says nothing about accumulation.
    """
    batch = _batch(8)
    results = []
    for batches in ([batch], _split(batch, 4)):
        model = _model()
        opt = build_optimizer(model, OptimConfig(name="momentum"), lr=1e-1)
        scaler = build_grad_scaler(TrainConfig(), CPU)
        r = train_step(model, opt, scaler, batches, device=CPU, grad_clip=1.0)
        results.append((r, model.state_dict()))
    (r1, sd1), (r2, sd2) = results
    assert r2.loss == pytest.approx(r1.loss, rel=1e-6) and r2.grad_norm == pytest.approx(r1.grad_norm, rel=1e-6)
    for name in sd1:
        torch.testing.assert_close(sd2[name], sd1[name], rtol=1e-6, atol=1e-6, msg=name)


def _measure(policy, args, every=1):
    """(bytes saved through autograd's hooks, bytes alive after forward, gradients) for one policy."""
    model = _model(args, policy=policy, every=every)
    batch = _batch(4, seq=64, vocab=args.vocab_size)
    saved, live = SavedBytes(model), LiveBytes(model)
    with saved, live:
        loss = loss_sum(model, batch, CPU, "fp32")
    kept = live.total
    loss.backward()
    return saved.total, kept, {n: p.grad for n, p in model.named_parameters()}


def test_activation_checkpointing_same_grads_fewer_saved_bytes():
    args = preset("tiny", n_layers=4)
    L, b, s, d, f, h = args.n_layers, 4, 64, args.dim, args.ffn_hidden, args.n_heads
    bsd, bsf, bskv = b * s * d, b * s * f, b * s * args.n_kv_heads * args.head_dim
    saved_none, live_none, g_none = _measure("none", args)
    saved_full, live_full, g_full = _measure("full", args)
    _, live_sel, g_sel = _measure("selective", args)
    _, live_every2, g_every2 = _measure("full", args, every=2)
    for grads in (g_full, g_sel, g_every2):
        for name, g in g_none.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)

    # One block without recompute saves, in fp32 (counted from the ops, not from this code):
    # 6 bsd: its input x and the norm's output, q after rotary, the attention output, h = x + attn and the
    #        norm's output (the engine's CPU RMSNorm saves its input and rstd, as torch's GPU kernel does; torch's
    #        composite form also saved x*rstd and h*rstd); 2 bs: the two rstd; 2 bs kv: k after rotary, v;
    # b h s: attention's log-sum-exp; 4 bsf: gate, up, silu(gate), silu(gate) * up.
    per_block = 4 * (6 * bsd + 2 * b * s + 2 * bskv + b * h * s + 4 * bsf)
    # full: of each block's saves only its input remains (the checkpoint saves it to re-run the block), both
    # as autograd's hooks see it and in memory
    assert saved_none - saved_full == L * (per_block - 4 * bsd)
    assert live_none - live_full == L * (per_block - 4 * bsd)
    assert live_none - live_every2 == L // 2 * (per_block - 4 * bsd)
    # selective keeps the block input and the outputs of the matmuls and attention: x, q, k, v, attention
    # output and log-sum-exp, wo, gate, up and w2 outputs (5 bsd + 2 bs kv + b h s + 2 bsf)
    kept = 4 * (5 * bsd + 2 * bskv + b * h * s + 2 * bsf)
    assert live_none - live_sel == L * (per_block - kept)
    assert live_sel < 0.67 * live_none and live_full < 0.15 * live_none  # 0.663: the norms save (x, rstd)


def test_fp16_inf_gradient_skips_step_and_halves_scale():
    model = _model()
    opt = build_optimizer(model, OptimConfig(), lr=1e-2)
    scaler = build_grad_scaler(TrainConfig(precision="fp16", loss_scale_init=1024.0), CPU)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    poison = model.layers["0"].attention.wq.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
    r = train_step(model, opt, scaler, [_batch(4)], device=CPU, precision="fp16", grad_clip=1.0)
    poison.remove()
    assert r.skipped and scaler.get_scale() == 512.0
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    r = train_step(model, opt, scaler, [_batch(4)], device=CPU, precision="fp16", grad_clip=1.0)
    assert not r.skipped and scaler.get_scale() == 512.0
    assert not torch.equal(model.layers["0"].attention.wq.weight, before["layers.0.attention.wq.weight"])


@pytest.mark.multiprocess
def test_fp16_loss_scaling_trains_under_tensor_parallelism_and_zero1(tmp_path):
    """fp16's unscale reads every gradient, however the layout splits it: tp alone mixes DTensor and plain gradients
    (one foreach call over both failed in DTensor) and ZeRO-1's optimizer holds slices without gradients before its
    step (torch's scaler found no inf check and asserted). Both now train as one device does: tp skips the first
    step's overflow as one device does, and the losses after it are the same.

    Data parallelism is held to what `shardwise verify` compares it with: one device reading the same micro-batches
    (micro_batch 8, grad_accum 2 for dp 2), whose gradients are summed as the ranks' are. Until 2026-12-02 each
    rank's loss was doubled for an averaging reduction to undo, so its fp16 gradients within a micro-batch were
    twice one device's: its first step overflowed and was skipped where one device's was not (this test then
    compared it with one device at micro_batch 16, which overflowed alike)."""
    config = str(Path(__file__).parent / "configs" / "parity.toml")
    runs = {}
    for name, sets, nproc in [("ref", [], []), ("tp", ["parallel.tp=2"], ["--nproc=2"]),
                              ("ref2", ["train.grad_accum=2"], []),
                              ("zero1", ["parallel.dp_replicate=2", "parallel.zero_stage=1"], ["--nproc=2"]),
                              ("fsdp", ["parallel.dp_shard=2", "parallel.zero_stage=2"], ["--nproc=2"])]:
        out = tmp_path / name
        sets = ["train.steps=3", "train.precision=fp16", "train.val_every=0", f"metrics.out_dir='{out}'",
                "metrics.log_every=1", "metrics.tensorboard=false", "metrics.progress=false", *sets]
        proc = subprocess.run([sys.executable, "-m", "shardwise", "train", "--config", config,
                               *[f"--set={s}" for s in sets], *nproc], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [(r["skipped"], r["loss"]) for r in rows if "loss" in r and "skipped" in r]
    assert [s for s, _ in runs["ref"]] == [1, 0, 0] and [s for s, _ in runs["ref2"]] == [0, 0, 0], runs
    for got, ref, rel in (("tp", "ref", 2e-3), ("zero1", "ref2", 1e-6), ("fsdp", "ref2", 1e-5)):
        assert [s for s, _ in runs[got]] == [s for s, _ in runs[ref]], (got, runs)
        assert [loss for _, loss in runs[got]] == pytest.approx([loss for _, loss in runs[ref]], rel=rel), got


def test_lr_schedule_warmup_and_cosine():
    assert lr_factor(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(99, 10, 100, 0.1) == pytest.approx(0.1)
    mid = 10 + (100 - 10 - 1) / 2
    assert lr_factor(int(mid), 10, 100, 0.1) == pytest.approx(0.55, abs=0.02)


@pytest.mark.parametrize("decay, shape", [("cosine", lambda p: 0.5 * (1 + math.cos(math.pi * p))),
                                          ("linear", lambda p: 1 - p), ("sqrt", lambda p: 1 - math.sqrt(p)),
                                          ("constant", lambda p: 1.0)])
def test_lr_schedule_warmup_stable_decay(decay, shape):
    """optim.decay_ratio 0.2 of 100 steps after 10 of warmup: the peak through step 79 (0-based), then the decay's
    shape over the last 20 steps to min_lr_ratio at step 99 (torchtitan's warmup-stable-decay); without it the
    decay starts at the peak."""
    lrs = [lr_factor(s, 10, 100, 0.1, decay, 0.2) for s in range(100)]
    assert lrs[:10] == pytest.approx([(s + 1) / 10 for s in range(10)]) and lrs[10:80] == pytest.approx([1.0] * 70)
    assert lrs[80:] == pytest.approx([0.1 + 0.9 * shape((s - 79) / 20) for s in range(80, 100)])
    assert lr_factor(10, 10, 100, 0.1, decay) == 1.0 and lr_factor(99, 10, 100, 0.1, decay) == pytest.approx(
        0.1 + 0.9 * shape(1.0))


def test_a_decay_that_does_not_fit_after_warmup_names_the_ratio():
    from shardwise.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.steps=100", "optim.warmup_steps=30", "optim.decay_ratio=0.8"])
    assert e.value.field == "optim.decay_ratio" and "80 steps of decay" in e.value.problem
    load_config(None, ["train.steps=100", "optim.warmup_steps=30", "optim.decay_ratio=0.7"])


def test_short_run_on_text_learns(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    cfg = load_config(None, [
        "model.name='tiny'", f"data.paths=['{corpus}']", f"data.cache_dir='{tmp_path / 'cache'}'",
        "data.seq_len=64", "data.val_fraction=0.1", "train.micro_batch=4", "train.steps=30", "train.val_every=30",
        "optim.lr=1e-2", "optim.warmup_steps=5", f"metrics.out_dir='{tmp_path / 'run'}'", "metrics.log_every=5",
        "metrics.progress=false", "metrics.peak_flops=1e11", "metrics.profile_step=2",
    ])
    summary = train(cfg)
    losses = summary["losses"]
    assert losses[-1] < 0.5 * losses[0]
    assert summary["val_loss"] < 0.5 * losses[0]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == [5, 10, 15, 20, 25, 30]
    for key in ("grad_norm", "lr", "tokens_per_s", "mfu", "peak_memory_gib"):
        assert logged[-1][key] > 0
    assert list((tmp_path / "run" / "tb").iterdir())
    # step 2 ran under the profiler: its operators by self time (the model's matmuls among them) and its trace
    table = (tmp_path / "run" / "profile" / "rank0.txt").read_text()
    assert "Self CPU" in table and "aten::mm" in table
    assert json.loads((tmp_path / "run" / "profile" / "rank0.json").read_text())["traceEvents"]


def test_a_prompt_completion_run_averages_its_loss_over_the_completions_tokens(tmp_path):
    """With prompts in the corpus a step's loss is the mean token cross-entropy over the targets that count in the
    whole global batch (completions and their end-of-text), however it is cut into micro-batches, and validation's
    likewise. Reference: torch's cross-entropy with ignore_index on the model's logits, from the same init and
    samples; a prompt's targets are IGNORE_INDEX, so the mean is not over every token."""
    import torch.nn.functional as F

    from shardwise.data import IGNORE_INDEX
    from shardwise.parallel.runtime import Runtime
    from shardwise.train import build_data, build_training_model, evaluate

    corpus = tmp_path / "sft.jsonl"
    corpus.write_text("".join(json.dumps({"prompt": f"Q: {i} + {i % 7}?\nA: ", "completion": f"{i + i % 7}"}) + "\n"
                              for i in range(400)))
    cfg = load_config(None, [
        "model.name='tiny'", f"data.paths=['{corpus}']", f"data.cache_dir='{tmp_path / 'cache'}'", "data.seq_len=32",
        "train.micro_batch=2", "train.grad_accum=3", "train.steps=1", "train.val_every=1", "optim.name='sgd'",
        f"metrics.out_dir='{tmp_path / 'run'}'", "metrics.progress=false", "metrics.tensorboard=false",
    ])
    runtime = Runtime.create(cfg)
    _, loader, val = build_data(cfg, runtime)
    model = build_training_model(cfg, runtime)  # the run's init, before its step
    with torch.no_grad():
        means = []
        for batches in (loader.next_step(), val):
            targets = torch.cat([b.targets for b in batches])
            assert 0 < (targets != IGNORE_INDEX).sum() < targets.numel() / 2  # mostly prompt
            logits = torch.cat([model(b.inputs) for b in batches])
            means.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX).item())
    assert evaluate(model, val, CPU, "fp32") == pytest.approx(means[1], rel=1e-5)
    assert train(cfg)["losses"][0] == pytest.approx(means[0], rel=1e-5)


def _logged_peak_memory(rank_gib: list[float]) -> float:
    """On a gloo rank: the peak memory a logged step reports, each rank's own peak being rank_gib[rank]."""
    import types

    import torch.distributed as dist

    import shardwise.train as training

    training.peak_memory_bytes = lambda device: int(rank_gib[dist.get_rank()] * 2**30)
    meter = training.Throughput.__new__(training.Throughput)
    meter.runtime = types.SimpleNamespace(world_size=dist.get_world_size(), device=torch.device("cpu"))
    return meter._peak_memory() / 2**30


@pytest.mark.multiprocess
def test_the_logged_peak_memory_is_the_highest_ranks():
    """Ranks differ (a pipeline's first stage holds the most): every rank reports the highest, where the log was
    rank 0's alone."""
    from distributed import run_distributed

    assert run_distributed(_logged_peak_memory, 2, [1.5, 3.25]) == [3.25, 3.25]


def test_the_logged_lr_is_the_one_the_step_ran_at(tmp_path):
    """Linear warmup over 4 steps: steps 1, 2, 3 run at 1/4, 2/4, 3/4 of the peak, and that is what is logged (the
    schedule's next value was logged: 2/4 at step 1)."""
    cfg = load_config(None, [
        "model.name='debug'", "data.seq_len=32", "data.max_corpus_mb=1", "train.micro_batch=2", "train.steps=3",
        "train.val_every=0", "optim.lr=0.01", "optim.warmup_steps=4", f"metrics.out_dir='{tmp_path / 'run'}'",
        "metrics.log_every=1", "metrics.progress=false", "metrics.tensorboard=false",
    ])
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows if "lr" in r] == pytest.approx([0.0025, 0.005, 0.0075])


def test_bf16_autocast_close_to_fp32_and_keeps_fp32_master_weights():
    model = _model()
    batch = _batch(4)
    fp32 = loss_sum(model, batch, CPU, "fp32").item()
    bf16 = loss_sum(model, batch, CPU, "bf16")
    assert bf16.dtype == torch.float32  # the loss is computed in fp32 from bf16 logits
    assert bf16.item() == pytest.approx(fp32, rel=1e-2)
    opt = build_optimizer(model, OptimConfig(), lr=1e-2)
    train_step(model, opt, build_grad_scaler(TrainConfig(), CPU), [batch], device=CPU, precision="bf16")
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.multiprocess
@pytest.mark.parametrize("moe", [False, True])
def test_compiled_blocks_match_eager(moe):
    """Compiled blocks give the eager model's loss and gradients; a mixture-of-experts block (compiled part by
    part, its routed experts eager: parallel.compile_block) too, where compiling it whole failed in its first
    forward."""
    from shardwise.parallel import compile_block

    args = preset("tiny", n_experts=4, top_k=2, moe_ffn_hidden=32, n_shared_experts=1) if moe else None
    eager, compiled = _model(args), _model(args)
    for block in compiled.layers.values():
        compile_block(block)
    batch = _batch(2)
    losses, grads = [], []
    for model in (eager, compiled):
        loss = loss_sum(model, batch, CPU, "fp32")
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-5, msg=name)


_FAULTS = """
import resource, sys, torch
from shardwise.distributed import keep_host_memory
kept = keep_host_memory() if sys.argv[1] == "keep" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(11):  # a step: 8 activations of 24 MB (the debug model's MLP) made, written, then all freed
    before = faults()
    blocks = [torch.ones(6 << 20) for _ in range(8)]
    del blocks
    counts.append(faults() - before)
print(kept, sorted(counts)[5])
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator settings")
def test_cpu_training_reuses_freed_host_memory():
    """A step frees and makes the same activation-sized blocks again: with keep_host_memory (what training on
    the CPU sets) freed 24 MB blocks are reused, not unmapped and faulted in again page by page (8 x 6,144 4 KB
    pages a step; the median over 11 steps)."""
    runs = {mode: subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True)
            .stdout.split() for mode in ("keep", "default")}
    # glibc's default returns them to the kernel (~49,000 faults a step here) unless something allocated later
    # sits above them in the heap, which varies from run to run: only the kept run's count is asserted
    assert runs["keep"][0] == "True" and float(runs["keep"][1]) < 1000
    assert float(runs["keep"][1]) <= float(runs["default"][1])


def test_a_fresh_run_starts_its_logs_and_a_resumed_one_drops_the_steps_it_does_again(tmp_path):
    """A new user ran 40 steps, then a fresh 10-step run in the same folder: its metrics.jsonl held steps 10-40 of
    the first run and step 10 of the second, and TensorBoard showed both. A start now drops its folder's lines
    from its first step on (TensorBoard's own reader is the check for its events), in the sample log too."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from shardwise.config import MetricsConfig
    from shardwise.metrics import MetricsWriter, SampleLog, read_sample_log

    cfg = MetricsConfig(out_dir=str(tmp_path), progress=False)

    def run(first, last, loss, dp_size=1):
        writer = MetricsWriter(cfg, last, first_step=first)
        logs = [SampleLog(str(tmp_path), r, True, first_step=first, dp_size=dp_size) for r in range(dp_size)]
        for step in range(first, last + 1):
            writer.log(step, {"loss": loss + step})
            for r, log in enumerate(logs):
                log.log(step, [Batch(torch.zeros(1, 2), torch.zeros(1, 2), sample_ids=[100 * r + step])])
        writer.close()
        for log in logs:
            log.close()

    def losses():
        rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in rows]

    def tensorboard():
        events = EventAccumulator(str(tmp_path / "tb"))
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars("loss")]

    run(1, 6, 100.0, dp_size=2)
    run(1, 3, 200.0)  # a fresh run, on one rank
    assert losses() == tensorboard() == [(1, 201.0), (2, 202.0), (3, 203.0)]
    assert read_sample_log(tmp_path) == {0: {1: [1], 2: [2], 3: [3]}, 1: {}}
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "loss": 20')  # a crash cut the line short
    run(3, 4, 300.0)  # resumed from step 2's checkpoint
    assert losses() == tensorboard() == [(1, 201.0), (2, 202.0), (3, 303.0), (4, 304.0)]
    assert read_sample_log(tmp_path)[0] == {1: [1], 2: [2], 3: [3], 4: [4]}


def test_a_second_run_in_a_folder_another_run_trains_in_is_refused_and_touches_nothing(tmp_path, capsys):
    """Two runs started in one folder each cleared the other's unfinished checkpoint writes (one died with a
    traceback) and mixed their metrics. The run training there holds <folder>/.lock; a second start is refused in
    one line before it reads or writes anything there, and the folder is free again once the first has ended."""
    import fcntl
    import os

    from shardwise.cli import main
    from shardwise.train import RUN_LOCK

    run = tmp_path / "run"
    args = ["train", "--config", "tests/configs/parity.toml", "--set", f"metrics.out_dir='{run}'", "--set",
            "train.steps=2", "--set", "checkpoint.enabled=true", "--set", "metrics.progress=false"]
    run.mkdir()
    with open(run / RUN_LOCK, "a+") as held:  # another process's run, as the lock sees it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 4242 on elsewhere, since 2026-11-28 12:00:00\n")
        held.flush()
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("shardwise: error: metrics.out_dir: another run trains in") and "pid 4242" in err
        assert err.count("\n") == 1, err
        assert sorted(p.name for p in run.iterdir()) == [RUN_LOCK]
    assert main(args) == 0  # released: the folder is free
    assert f"pid {os.getpid()}" in (run / RUN_LOCK).read_text()
    assert (run / "checkpoints" / "step_2").is_dir()


def test_a_run_folder_the_run_cannot_write_is_refused_before_it_trains(tmp_path, capsys, monkeypatch):
    """A read-only checkpoints folder failed at the first save, steps later, in a PermissionError traceback. (The
    suite runs as root, whom permissions do not stop: os.access answers as for another user.)"""
    import os

    from shardwise.cli import main

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and Path(p).name != "checkpoints")
    args = ["train", "--config", "tests/configs/parity.toml", "--set", f"metrics.out_dir='{run}'", "--set",
            "train.steps=2", "--set", "checkpoint.enabled=true", "--set", "metrics.progress=false"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardwise: error: metrics.out_dir: cannot write {run / 'checkpoints'}"), err
    assert "make it writable" in err and err.count("\n") == 1
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints"]


def test_ctrl_c_ends_a_run_with_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    import shardwise.train
    from shardwise.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shardwise.train, "train", interrupted)
    assert main(["train", "--config", "tests/configs/parity.toml", "--set", f"metrics.out_dir='{tmp_path}'"]) == 130
    assert capsys.readouterr().err == "shardwise: interrupted\n"
    # under --nproc every rank gets Ctrl-C, and so does the launcher: it says so for its machine, and no rank does
    # (it was once per rank, then the launcher's and local rank 0's)
    import shardwise.launch.local as local

    monkeypatch.setattr(local, "launch_local", interrupted)
    assert main(["train", "--config", "tests/configs/parity.toml", "--set", f"metrics.out_dir='{tmp_path}'",
                 "--nproc", "2"]) == 130
    assert capsys.readouterr().err == "shardwise: interrupted\n"
    assert local.torchrun_command(2, ["train"])[1][local.LAUNCHED] == "1"
    for rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        monkeypatch.setenv(local.LAUNCHED, "1")
        assert main(["train", "--config", "tests/configs/parity.toml", "--set", f"metrics.out_dir='{tmp_path}'"]) == 130
        assert capsys.readouterr().err == ""
    # under a torchrun started otherwise (by hand, a cluster's own launcher) local rank 0 says it, and no other rank
    monkeypatch.delenv(local.LAUNCHED)
    for rank, said in (("0", "shardwise: interrupted\n"), ("1", "")):
        monkeypatch.setenv("LOCAL_RANK", rank)
        assert main(["train", "--config", "tests/configs/parity.toml", "--set", f"metrics.out_dir='{tmp_path}'"]) == 130
        assert capsys.readouterr().err == said


def _interrupted_launch(tmp_path, monkeypatch, agent: str, ctrl_c_at: tuple[float, ...]) -> float:
    """launch_local with `agent` (Python source) in torchrun's place and Ctrl-C at each of `ctrl_c_at` seconds;
    the seconds until it raised KeyboardInterrupt."""
    import shardwise.launch.local as local

    script = tmp_path / "agent.py"
    script.write_text("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n" + agent)
    monkeypatch.setattr(local, "torchrun_command", lambda *a, **k: ([sys.executable, str(script)], None))
    # Python raises KeyboardInterrupt on SIGINT only where SIGINT was not ignored when it started, and a shell
    # starts background jobs with it ignored (CI under nohup ... &): this process's Ctrl-C is a terminal's here
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timers = [threading.Timer(t, os.kill, (os.getpid(), signal.SIGINT)) for t in ctrl_c_at]
    start = time.monotonic()
    for timer in timers:
        timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            local.launch_local(2, ["train"])
    finally:
        for timer in timers:  # a Ctrl-C still to come once the launcher has returned would stop pytest
            timer.cancel()
        signal.signal(signal.SIGINT, previous)
    return time.monotonic() - start


@pytest.mark.multiprocess
def test_torchrun_ended_by_a_signal_is_said_with_a_shells_exit_code(tmp_path, monkeypatch, capsys):
    """A SIGTERM to `shardwise train --nproc` before the ranks existed reached torchrun, which died of it: the
    command printed nothing and exited 241 (-15 as a byte), where a shell's code is 143 (trial, 2026-12-02)."""
    import shardwise.launch.local as local

    killed = "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n"
    monkeypatch.setattr(local, "torchrun_command", lambda *a, **k: ([sys.executable, "-c", killed], None))
    assert local.launch_local(2, ["train"]) == 143
    assert capsys.readouterr().err == "shardwise: torchrun was ended by SIGTERM (nothing trained after that)\n"


@pytest.mark.multiprocess
def test_ctrl_c_under_nproc_returns_once_torchrun_has_stopped_the_ranks(tmp_path, monkeypatch):
    """Ctrl-C reaches the launcher and torchrun's agent together, and the agent then stops the ranks (up to 30 s,
    SIGKILL after). The launcher returned at once: the prompt came back while the ranks still held the run folder's
    lock (a restart was refused: 'another run trains in ...') and printed their last lines after it."""
    stopped = tmp_path / "stopped"
    _interrupted_launch(tmp_path, monkeypatch, f"time.sleep(2)\nopen({str(stopped)!r}, 'w').close()\n", (0.5,))
    assert stopped.exists()


@pytest.mark.multiprocess
def test_a_second_ctrl_c_under_nproc_stops_the_job_at_once(tmp_path, monkeypatch):
    alive = tmp_path / "alive"
    seconds = _interrupted_launch(tmp_path, monkeypatch,
                                  f"import os\nopen({str(alive)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n",
                                  (1.0, 1.5))
    pid = int(alive.read_text())
    try:
        assert seconds < 30
        with pytest.raises(ProcessLookupError):  # SIGKILLed and reaped
            os.kill(pid, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_pipeline_stages_autocast_keeps_no_weight_cache():
    """Under recompute autocast's cache held a low-precision copy of every block's weights of a pipeline stage until
    its forward returned (the last stage of Llama 3 8B at pp 2: 63.38 GiB in the simulator, 61.23 without), which a
    recomputed block casts again in backward regardless: a stage's forward runs without it. One model's forward
    keeps it, as the planner counts it there (its fused head runs inside that forward)."""
    from shardwise.loss import autocast_context, autocast_forward

    seen = []
    stage = torch.nn.Linear(4, 4)
    stage.forward = lambda x: seen.append((torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled()))
    autocast_forward(stage, "bf16", CPU)
    stage(torch.ones(1, 4))
    assert seen == [(True, False)]
    with autocast_context("bf16", CPU):
        assert torch.is_autocast_cache_enabled()


def test_deterministic_runs_take_no_timed_kernel_choice(tmp_path, monkeypatch):
    """Each rank timed the engine's CPU attention forms once per shape and took the fastest, so two runs of four
    ranks on a loaded machine differed by rounding from step 5 (measured: grad norm 3.630744218826294 against
    3.630743980407715). train.deterministic turns on torch's deterministic algorithms, under which nothing is timed;
    without it the choice is timed (the control)."""
    from shardwise import model

    timed = []

    def fastest(q, k, v):
        timed.append(tuple(q.shape))
        return None

    monkeypatch.setattr(model, "_fastest_cpu_attention", fastest)
    monkeypatch.setattr(model, "_cpu_attention_forms", {})
    # what set_deterministic changes for the process, put back after the test
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    run = ["model.name='debug'", "data.seq_len=256", "data.max_corpus_mb=1", "train.micro_batch=2", "train.steps=1",
           "train.val_every=0", "metrics.progress=false", "metrics.tensorboard=false"]
    try:
        train(load_config(None, [*run, "train.deterministic=true", f"metrics.out_dir='{tmp_path / 'a'}'"]))
        assert torch.are_deterministic_algorithms_enabled() and not timed
    finally:
        torch.use_deterministic_algorithms(False)
    train(load_config(None, [*run, f"metrics.out_dir='{tmp_path / 'b'}'"]))
    assert timed


def test_a_stop_before_the_last_step_is_marked_in_the_run_folder_and_one_at_it_is_the_runs_end(tmp_path):
    """Launchers and `launch slurm`'s script read the run's outcome from stopped.json, not from whether they passed
    on a signal: a Slurm job whose time-limit warning came during the last step ended FAILED (or was requeued),
    complete."""
    run = tmp_path / "run"
    common = ["model.name='debug'", "data.seq_len=32", "data.max_corpus_mb=1", "train.micro_batch=2", "train.steps=3",
              "train.val_every=0", "checkpoint.enabled=true", f"metrics.out_dir='{run}'", "metrics.progress=false",
              "metrics.tensorboard=false"]
    assert train(load_config(None, [*common, "train.stop_after=2"]))["stopped_at"] == 2
    assert json.loads((run / "stopped.json").read_text()) == {"step": 2, "signal": False}  # asked for: exit 0
    summary = train(load_config(None, common))  # resumed: runs step 3, the last
    assert "stopped_at" not in summary and not (run / "stopped.json").exists()
    at_end = train(load_config(None, [*common, "train.steps=4", "train.stop_after=4"]))  # a stop at the last step
    assert "stopped_at" not in at_end and not (run / "stopped.json").exists()


def test_a_warmup_as_long_as_the_run_is_said(tmp_path, caplog):
    """optim.warmup_steps (20 by default) at or past train.steps: a short run of one's own trained at a fraction of
    optim.lr, rising to the end, and never decayed, without a word (trial, 2026-12-02)."""
    import logging

    base = ["train.steps=2", "train.val_every=0", "metrics.tensorboard=false", "metrics.progress=false"]
    said = {}
    for warmup in (4, 1):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardwise.train"):
            train(load_config("tests/configs/parity.toml", [*base, f"optim.warmup_steps={warmup}",
                                                            f"metrics.out_dir='{tmp_path / str(warmup)}'"]))
        said[warmup] = [r.getMessage() for r in caplog.records if "optim.warmup_steps" in r.getMessage()]
    assert not said[1]
    assert said[4] and said[4][0].startswith("optim.warmup_steps = 4 >= train.steps = 2: the whole run is warmup, "
                                             "its lr rises to 50% of optim.lr and never decays"), said[4]
