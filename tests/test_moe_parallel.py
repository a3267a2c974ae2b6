"""Mixture of experts under every layout: parity with one device through `shardwise verify`, the all-to-all bytes
the routing implies, checkpoints resharded across expert-parallel degrees, and bad input refused up front."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.config import ConfigError, load_config, validate
from shardwise.distributed import run_distributed

CONFIG = str(Path(__file__).parent / "configs" / "moe.toml")


def _cli(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.multiprocess
def test_every_expert_parallel_layout_matches_one_device():
    """ep 2, ep 4, ep x FSDP, ep x tp (with SP), ep x pp, ep x HSDP and cp (with and without ep), with the
    balancing loss, the router z-loss and the expert bias on (strong enough to change the routing within the
    steps), against one device: fp32, 1e-5."""
    layouts = ["dp_shard=2,ep=2", "dp_shard=4,ep=4", "dp_shard=4,ep=2,activation_checkpoint=full",
               "dp_shard=2,activation_checkpoint=selective",
               "dp_shard=2,ep=2,tp=2,sequence_parallel=true", "dp_shard=2,ep=2,pp=2",
               "dp_replicate=2,dp_shard=2,ep=2,zero_stage=2", "cp=2", "dp_shard=2,cp=2,ep=4"]
    flags = [a for layout in layouts for a in ("--layout", layout)]
    run = _cli("verify", "--config", CONFIG, "--steps", "3", "--json", *flags)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(run.stdout[run.stdout.index("{"):])["layouts"]
    assert [r["layout"] for r in rows] == layouts
    assert all(r["ok"] for r in rows), rows



@pytest.mark.multiprocess
def test_capacity_under_a_pipeline_matches_one_device():
    """A capacity counts per forward, and a pipeline's forwards are its pipeline micro-batches (train.micro_batch /
    n_microbatches): the reference reads the global batch in those. Until 2026-12-02 it read train.micro_batch
    sequences at a time, whose capacity drops other pairs: 8.9e-3 in the parameters at pp 2 x ep 2 after 3 steps."""
    layouts = ["dp_shard=2,ep=2,pp=2", "pp=2,pp_microbatches=4"]
    flags = [a for layout in layouts for a in ("--layout", layout)]
    run = _cli("verify", "--config", CONFIG, "--set", "model.capacity_factor=1.0", "--steps", "3", "--json", *flags)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(run.stdout[run.stdout.index("{"):])["layouts"]
    assert all(r["ok"] for r in rows), rows

def _routed_exchange(config: str):
    """One forward and backward of the ep=2 model on this rank under the comm counter, and the (token, expert)
    pairs each MoE layer's router sent to the other rank's experts (read from the router's choices)."""
    from shardwise.moe import Router
    from shardwise.parallel.comm import CommCounter
    from shardwise.parallel.runtime import Runtime
    from shardwise.simulate import build_step_inputs
    from shardwise.train import loss_sum

    cfg = load_config(config, ["parallel.dp_shard=2", "parallel.ep=2"])
    runtime = Runtime.create(cfg)
    model, _, _, batches = build_step_inputs(cfg, runtime)
    rank, local = runtime.mesh.ep.get_local_rank(), cfg.model.n_experts // 2
    remote = []

    def count(module, inputs, output):
        chosen = output[2]
        remote.append(int(((chosen // local) != rank).sum()))

    for module in model.modules():
        if isinstance(module, Router):
            module.register_forward_hook(count)
    with CommCounter() as counter:
        loss_sum(model, batches[0], runtime.device, "fp32").backward()
    stats = counter.stats
    runtime.close()
    return remote, stats.wire["all_to_all"], stats.calls["all_to_all"]


@pytest.mark.multiprocess
def test_all_to_all_bytes_are_what_the_routing_implies():
    cfg = load_config(CONFIG, [])
    dim, n_experts = cfg.model.dim, cfg.model.n_experts
    for remote, wire, calls in run_distributed(_routed_exchange, 2, CONFIG):
        layers = len(remote)
        assert layers == cfg.model.n_moe_layers
        # per layer: the routed rows out and back in forward, their gradients back and out in backward (fp32),
        # and the per-expert counts (int64, half of them to the other rank)
        expected = sum(4 * r * dim * 4 for r in remote) + layers * n_experts // 2 * 8
        assert wire == expected
        assert calls == 5 * layers  # 3 in forward (counts, tokens, results), 2 in backward


def _train(out, steps, *extra, nproc):
    return _cli("train", "--config", CONFIG, "--nproc", str(nproc), f"--set=metrics.out_dir='{out}'",
                f"--set=train.steps={steps}", "--set=checkpoint.enabled=true", "--set=checkpoint.every=2",
                "--set=train.val_every=0", "--set=metrics.log_every=1", "--set=train.micro_batch=4",
                "--set=train.global_batch=16", *[f"--set={e}" for e in extra])


def _logged(out, key="loss"):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r}


@pytest.mark.multiprocess
def test_checkpoint_reshards_from_ep2_to_ep4_and_resumes(tmp_path):
    """4 steps on dp_shard 2 x ep 2, then on with 4 ranks at ep 4 (the same global batch): the same losses and
    balancing-loss and load metrics as 6 steps at ep 4 throughout (the expert bias, moved every step, is restored
    with the weights; the metrics are summed over ranks whichever layout routes)."""
    split, whole = tmp_path / "split", tmp_path / "whole"
    first = _train(split, 6, "parallel.dp_shard=2", "parallel.ep=2", "train.stop_after=4", nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train(split, 6, "parallel.dp_shard=4", "parallel.ep=4", nproc=4)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed after step 4" in second.stdout
    reference = _train(whole, 6, "parallel.dp_shard=4", "parallel.ep=4", nproc=4)
    assert reference.returncode == 0, reference.stderr[-3000:]
    for key in ("loss", "moe/aux_loss", "moe/max_load"):
        got, want = _logged(split, key), _logged(whole, key)
        assert sorted(got) == sorted(want) == list(range(1, 7))
        assert [got[s] for s in want] == pytest.approx([want[s] for s in want], rel=1e-5)


@pytest.mark.parametrize("sets, field", [
    (["parallel.dp_shard=2", "parallel.ep=3"], "parallel.ep"),  # 3 does not divide 8 experts
    (["parallel.dp_shard=2", "parallel.ep=4"], "parallel.ep"),  # more than dp_shard x cp
    (["parallel.dp_replicate=2", "parallel.ep=2"], "parallel.ep"),  # ZeRO-0: no dp_shard to draw from
    (["model.top_k=9"], "model.top_k"),
    (["model.top_k=1"], "model.route_norm"),  # a weight renormalised to 1: the router never learns from the loss
    # each cp rank applies the capacity to its part of the sequences: other tokens dropped than on one device
    (["model.capacity_factor=1.0", "parallel.cp=2"], "parallel.cp"),
    (["model.n_experts=0", "parallel.dp_shard=2", "parallel.ep=2"], "parallel.ep"),
    (["lora.rank=8"], "lora.rank"),
    (["parallel.dp_shard=2", "parallel.ep=2", "parallel.activation_checkpoint='selective'"],
     "parallel.activation_checkpoint"),
])
def test_bad_moe_input_names_the_field(sets, field):
    with pytest.raises(ConfigError) as err:
        validate(load_config(CONFIG, sets))
    assert err.value.field == field
    assert "\n" not in str(err.value)


def test_expert_bias_is_in_the_checkpoint_state_and_counts_are_not():
    from shardwise.model import build_model

    model = build_model(load_config(CONFIG, []).model)
    keys = set(model.state_dict())
    assert any(k.endswith("moe.expert_bias") for k in keys)
    assert not any(k.endswith(("tokens_per_expert", "dropped", "aux_loss")) for k in keys)
    assert torch.Size([8]) == model.layers["1"].moe.expert_bias.shape
