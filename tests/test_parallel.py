"""The parallel engine: every layout trains like one device; bad layouts stop before any process starts; a job
leaves no process group behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CONFIG = str(Path(__file__).parent / "configs" / "parity.toml")


def _shardwise(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True, text=True,
                          timeout=timeout)


INVALID = [
    # (overrides, nproc, field named in the message)
    (["parallel.tp=3"], 3, "parallel.tp"),  # heads 8 not divisible by 3
    (["model.n_kv_heads=2", "parallel.tp=4"], 4, "parallel.tp"),  # KV heads vs tp
    (["parallel.pp=4", "parallel.pp_schedule='interleaved-1f1b'", "parallel.virtual_stages=4"], 4,
     "model.n_layers"),  # 8 layers < 16 stages
    (["parallel.pp=2", "parallel.pp_microbatches=3"], 2, "train.micro_batch"),  # 8 not divisible by 3
    (["parallel.cp=4", "data.seq_len=60"], 4, "data.seq_len"),  # 60 not divisible by 2 x 4
    (["parallel.tp=4", "parallel.sequence_parallel=true", "parallel.cp=2", "data.seq_len=36"], 8,
     "data.seq_len"),  # 36 / cp 2 = 18 tokens not divisible by tp 4
    (["parallel.tp=2"], 3, "parallel"),  # the world has 3 ranks, the degrees 2 (4 would be dp 2 x tp 2)
    (["parallel.dp_shard=2", "parallel.zero_stage=1"], 2, "parallel.dp_shard"),  # sharding needs ZeRO-2/3
    (["parallel.sequence_parallel=true"], 1, "parallel.sequence_parallel"),  # no tp
    # interleaved-1f1b runs 2 stages per rank unless told otherwise; 1 is not interleaving
    (["parallel.pp=2", "parallel.pp_schedule='interleaved-1f1b'", "parallel.virtual_stages=1"], 2,
     "parallel.virtual_stages"),
    (["train.activation_checkpoint='full'"], 1, "train.activation_checkpoint"),  # moved to [parallel]
    (["parallel.offload='optimizer'"], 1, "parallel.offload"),  # the planner prices it; the engine has none
    (["parallel.offload='full'"], 1, "parallel.offload"),  # FSDP2's CPUOffloadPolicy: needs zero_stage 2/3
    (["optim.name='adafactor'", "parallel.dp_shard=2"], 2, "optim.name"),  # Adafactor fails on FSDP's DTensors
    (["optim.name='adafactor'", "parallel.tp=2"], 2, "optim.name"),  # and on tensor-parallel ones
    (["optim.name='adafactor'", "parallel.dp_replicate=2", "parallel.zero_stage=1"], 2, "optim.name"),  # slices
    # FSDP2's MixedPrecisionPolicy gathers bf16 weights: the job must train in bf16, and FSDP must shard them
    (["parallel.mixed_precision='fsdp'", "parallel.dp_shard=2"], 2, "parallel.mixed_precision"),
    (["parallel.mixed_precision='fsdp'", "train.precision='bf16'", "parallel.dp_replicate=2"], 2,
     "parallel.mixed_precision"),
    (["parallel.mixed_precision='fp8'", "train.precision='bf16'"], 1, "parallel.mixed_precision"),
]


@pytest.mark.parametrize("overrides, nproc, field", INVALID, ids=[i[2] + f"-{n}" for n, i in enumerate(INVALID)])
def test_invalid_layout_rejected_before_any_process(tmp_path, capsys, monkeypatch, overrides, nproc, field):
    """`shardwise train --nproc N` with a bad layout: exit 2 and one line naming the field, before torchrun is
    started or anything is written (the command runs in this process; starting a launcher fails the test)."""
    import shardwise.launch.local
    from shardwise.cli import main

    def no_launch(*args, **kwargs):
        raise AssertionError("a process was started for an invalid layout")

    monkeypatch.setattr(shardwise.launch.local, "launch_local", no_launch)
    code = main(["train", "--config", CONFIG, *[f"--set={o}" for o in overrides],
                 f"--set=metrics.out_dir='{tmp_path / 'run'}'", "--nproc", str(nproc)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"shardwise: error: {field}"), lines
    assert not (tmp_path / "run").exists()


# Each group runs in one `shardwise verify` call: the single-device reference is computed once per global
# batch and every layout of the group is compared with it (losses at every step, parameters at the end).
PARITY = {
    "zero-dp2": ["dp=2", "dp=2,zero_stage=1", "dp_shard=2,zero_stage=2", "dp_shard=2,zero_stage=3"],
    "zero-dp4": ["dp=4", "dp=4,zero_stage=1", "dp_shard=4,zero_stage=2", "dp_shard=4,zero_stage=3",
                 "dp_replicate=2,dp_shard=2"],
    "tp": ["tp=2", "tp=2,sequence_parallel=true", "tp=4", "tp=4,sequence_parallel=true"],
    "cp": ["cp=2", "cp=4"],
    # FSDP x tp without accumulation or recompute is the selective row's layout less the recompute (and
    # adamw's row at ZeRO-2): not run on its own
    "multi-axis": ["dp=2,tp=2,zero_stage=1", "dp_shard=2,cp=2,tp=2,sequence_parallel=true",
                   "dp_shard=2,tp=2,grad_accum=2", "dp_shard=2,tp=2,activation_checkpoint=selective",
                   "dp_shard=2,cp=2,activation_checkpoint=full"],
}


# AdamW at a realistic learning rate, with clipping: the sharded optimizer states of ZeRO-1/2/3 under TP
ADAMW = ["--set=optim.name='adamw'", "--set=optim.lr=3e-4", "--set=optim.grad_clip=1.0"]
PARITY["adamw"] = ["dp=2,zero_stage=1", "dp_shard=2,tp=2,zero_stage=2"]
# Heads of 12 on the residual of 64 (queries 96 wide: model.attn_head_dim, Qwen3's and Mistral NeMo's shape):
# tp splits wq's output and wo's input by heads, cp cuts the sequence under the wider heads, FSDP shards them
WIDE_HEADS = ["--set=model.attn_head_dim=12"]
PARITY["wide-heads"] = ["tp=2,sequence_parallel=true", "dp_shard=2,cp=2", "tp=4"]
EXTRA = {"adamw": ADAMW, "wide-heads": WIDE_HEADS}


@pytest.mark.parametrize("group", sorted(PARITY))
@pytest.mark.multiprocess
def test_layouts_match_single_device(group):
    args = ["verify", "--config", CONFIG, "--steps", "3", "--json", *EXTRA.get(group, [])]
    for layout in PARITY[group]:
        args += ["--layout", layout]
    proc = _shardwise(*args)
    assert proc.stdout, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    for row in report["layouts"]:
        assert max(row["loss_rel"], row["grad_norm_rel"], row["param_rel"]) <= 1e-5, row
    assert proc.returncode == 0


@pytest.mark.multiprocess
def test_prompt_completion_training_matches_single_device(tmp_path):
    """A corpus of prompts and completions (the loss over the completions' tokens only, divided by the step's count
    of them) trains under FSDP with accumulation, TP + SP (the vocabulary-parallel fused loss), a pipeline (the
    last stage's fused loss) and context parallelism (sequence slices) as on one device."""
    corpus = tmp_path / "sft.jsonl"
    corpus.write_text("".join(json.dumps({"prompt": f"Q: {i} + {i % 7}?\nA: ", "completion": f"{i + i % 7}"}) + "\n"
                              for i in range(600)))
    layouts = ["dp_shard=2,grad_accum=2", "tp=2,sequence_parallel=true", "pp=2", "cp=2"]
    proc = _shardwise("verify", "--config", CONFIG, "--steps", "3", "--json", f"--set=data.paths=['{corpus}']",
                      f"--set=data.cache_dir='{tmp_path / 'cache'}'", *[a for x in layouts for a in ("--layout", x)])
    assert proc.stdout, proc.stderr[-3000:]
    for row in json.loads(proc.stdout)["layouts"]:
        assert max(row["loss_rel"], row["grad_norm_rel"], row["param_rel"]) <= 1e-5, row
    assert proc.returncode == 0


@pytest.mark.multiprocess
def test_a_layout_verifies_the_same_alone_and_after_another_in_its_launch():
    """`verify` trains the layouts of one world size in turn in one launch: with compiled blocks, tp=2 after
    other layouts gives exactly the figures of tp=2 alone (each run compiles for itself; a compile cache kept
    from the run before moved them by ~1e-7, inside the parity tolerance, so only equality shows it). The
    layouts before it also show compiled blocks reproducing one device with full recompute, in a 1F1B pipeline
    and under context parallelism (verify fails if any layout does)."""
    rows = []
    for layouts in (["dp=2,activation_checkpoint=full", "pp=2,pp_schedule=1f1b", "cp=2", "tp=2"], ["tp=2"]):
        proc = _shardwise("verify", "--config", CONFIG, "--steps", "2", "--json", "--set=train.compile=true",
                          *[a for layout in layouts for a in ("--layout", layout)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows.append(json.loads(proc.stdout)["layouts"][-1])
    shared, alone = rows
    assert shared["layout"] == alone["layout"] == "tp=2"
    assert [shared[k] for k in ("loss_rel", "grad_norm_rel", "param_rel")] == \
        [alone[k] for k in ("loss_rel", "grad_norm_rel", "param_rel")]


def _embedding_lookups():
    """torch's RowwiseParallel and our VocabParallelEmbedding on the same weights and ids (a vocabulary of 1001
    rows, not divisible by 2, every row among the ids), with and without sequence parallelism: outputs, gradients
    and their placement."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from shardwise.parallel.tensor_parallel import VocabParallelEmbedding

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    # every row looked up (each rank's first and last among them), in shuffled order
    ids = torch.cat([torch.arange(1001), torch.randint(0, 1001, (23,))])[torch.randperm(1024)].view(4, 256)
    reference = torch.nn.Embedding(1001, 16)
    results = []
    for layout in (Replicate(), Shard(1)):
        for style in (RowwiseParallel(input_layouts=Replicate(), output_layouts=layout),
                      VocabParallelEmbedding(layout)):
            embedding = torch.nn.Embedding(1001, 16)
            embedding.load_state_dict(reference.state_dict())
            parallelize_module(embedding, mesh, style)
            out = embedding(ids)
            (out.float() ** 2).sum().backward()
            grad = embedding.weight.grad
            results.append((out.detach(), grad.full_tensor(), grad.placements, tuple(grad.to_local().shape)))
    return results


@pytest.mark.multiprocess
def test_vocab_parallel_embedding_keeps_its_rows_of_the_gradient():
    """Bitwise RowwiseParallel's outputs and gradient, but each rank holds only its rows of the gradient;
    RowwiseParallel's backward leaves every rank the whole vocabulary's (the reason for our own style)."""
    from torch.distributed.tensor import Replicate, Shard

    from distributed import run_distributed

    for rank, results in enumerate(run_distributed(_embedding_lookups, 2)):
        for (out_r, grad_r, placement_r, shape_r), (out_v, grad_v, placement_v, shape_v) in (results[:2], results[2:]):
            assert out_r.equal(out_v) and grad_r.equal(grad_v)
            assert placement_v == (Shard(0),) and shape_v == ((501 if rank == 0 else 500), 16)
            assert placement_r == (Replicate(),) and shape_r == (1001, 16)


def _vocab_parallel_heads(ignored: bool):
    """The fused head and loss (shardwise.loss.head_loss_sum) on one device and split by vocabulary rows over the
    ranks (1001 rows, not divisible by 2; 96 tokens, so the loss runs in blocks), with the input replicated and
    as sequence slices (sequence parallelism): loss, input gradient and weight gradient, gathered whole."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from shardwise.data import IGNORE_INDEX
    from shardwise.loss import head_loss_sum

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    hidden, weight, targets = torch.randn(2, 48, 16), torch.randn(1001, 16) * 0.3, torch.randint(0, 1001, (2, 48))
    targets[0, :3] = torch.tensor([0, 500, 1000])  # the first and last rows of each rank's piece
    if ignored:
        targets[1, ::2] = IGNORE_INDEX  # a prompt's tokens: in no rank's loss
    results = []
    for layout in (None, Replicate(), Shard(1)):
        if layout is None:
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        else:
            w = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
            # sequence parallelism's norm hands the head a DTensor of sequence slices, otherwise a plain tensor
            h = distribute_tensor(hidden, mesh, [layout]).requires_grad_() if layout == Shard(1) else \
                hidden.clone().requires_grad_()
        loss = head_loss_sum(h, w, targets, ignored)
        (loss * 0.5).backward()
        whole = [g.full_tensor() if isinstance(g, DTensor) else g for g in (h.grad, w.grad)]
        results.append((loss.detach(), *whole, getattr(w.grad, "placements", None)))
    return results


@pytest.mark.multiprocess
def test_vocab_parallel_fused_head_matches_one_device():
    """Under tp the fused head and loss run on each rank's vocabulary rows: the loss (whole on every rank), the
    input's gradient (reduced over the ranks) and the weight's (each rank its rows) equal the one-device ones, with
    and without ignored targets (a prompt's)."""
    import torch
    from torch.distributed.tensor import Shard

    from distributed import run_distributed

    for results in run_distributed(_vocab_parallel_heads, 2, False) + run_distributed(_vocab_parallel_heads, 2, True):
        (loss, grad_h, grad_w, _), *split = results
        for loss_t, grad_h_t, grad_w_t, placements in split:
            torch.testing.assert_close(loss_t, loss, rtol=1e-6, atol=0)
            torch.testing.assert_close(grad_h_t, grad_h, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(grad_w_t, grad_w, rtol=1e-5, atol=1e-7)
            assert placements == (Shard(0),)


def _gloo_threads_after_training(out: str) -> list[str]:
    """Train 2 steps with tensor parallelism on this rank, then name the gloo threads still running."""
    from shardwise.config import load_config
    from shardwise.train import train

    train(load_config(CONFIG, ["parallel.tp=2", "train.steps=2", f"metrics.out_dir='{out}'", "train.val_every=0",
                               "metrics.tensorboard=false", "metrics.progress=false"]))
    names = [(Path("/proc/self/task") / t / "comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
@pytest.mark.multiprocess
def test_no_gloo_thread_outlives_a_job(tmp_path):
    """A job destroys every process group it made, joining their gloo threads, before it returns: a gloo
    thread still running when the interpreter finalizes can abort the process (see distributed.shutdown).
    Under tensor parallelism the mesh's groups were kept alive by DTensor's caches and by the model."""
    from distributed import run_distributed

    assert run_distributed(_gloo_threads_after_training, 2, str(tmp_path / "run")) == [[], []]


def _groups_of_one_after_the_other_rank_is_done(groups: int) -> int:
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(1.0)  # the other rank has nothing left to do with this one
    for _ in range(groups):
        dist.new_group([dist.get_rank()], use_local_synchronization=True)
    return dist.get_rank()


def _rank_one_fails() -> str:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one's own error")
    return "done"


@pytest.mark.multiprocess
def test_a_rank_still_making_groups_when_another_is_done_keeps_the_store():
    """Rank 0's process hosts the store the test ranks make their groups through. A rank whose function ended with
    no collective (here: one-rank groups, as a mesh's size-1 dims are made) used to exit while the other was still
    making its own: that rank's "Broken pipe" (a CI failure of test_optim's low-bit layouts)."""
    from distributed import run_distributed

    assert run_distributed(_groups_of_one_after_the_other_rank_is_done, 2, 10) == [0, 1]


@pytest.mark.multiprocess
def test_a_failed_test_rank_is_reported_with_its_own_error():
    """The rank that raised is reported, not a rank whose wait for it ended with an error."""
    from distributed import run_distributed

    with pytest.raises(AssertionError, match="(?s)rank 1 failed:.*rank one's own error"):
        run_distributed(_rank_one_fails, 2)


def test_verify_refuses_fsdp_mixed_precision_before_any_process(capsys, monkeypatch):
    """FSDP2's bf16 policy computes from bf16 weights and one device from autocast's fp32 ones: verify cannot hold
    them to a tolerance, and says so in one line naming the key, nothing started."""
    import shardwise.verify
    from shardwise.cli import main

    def no_run(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(shardwise.verify, "_train_here", no_run)
    monkeypatch.setattr(shardwise.verify, "_train_launched", no_run)
    code = main(["verify", "--config", CONFIG, "--set=train.precision='bf16'", "--layout",
                 "dp_shard=2,zero_stage=3,mixed_precision=fsdp"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("shardwise: error: --layout mixed_precision"), lines
