"""The simulator: big jobs fit on this machine, a simulated rank is the real rank, model state is ZeRO's."""

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from shardwise.config import load_config
from shardwise.model import build_model
from shardwise.model_args import num_params, preset
from shardwise.simulate import measured_run

from distributed import run_distributed

CONFIG = str(Path(__file__).parent / "configs" / "parity.toml")
GiB = 2**30

# ---------------------------------------------------------------------------------------------------
# Faithful: the simulated rank is the real rank


def _real_steps(layouts):
    """On each gloo rank, per layout: the trainer's model, optimizer and three steps, measured as the simulator
    measures (the layouts of one world share one set of processes)."""
    from shardwise.parallel.runtime import Runtime
    from shardwise.simulate import build_step_inputs, measure_step

    out = []
    for overrides in layouts:
        cfg = load_config(CONFIG, overrides)
        runtime = Runtime.create(cfg)
        model, optimizer, scaler, batches = build_step_inputs(cfg, runtime)
        out.append([asdict(measure_step(model, optimizer, scaler, batches, cfg, runtime)) for _ in range(3)])
    return out


def _program_order(steps: list[dict]) -> dict:
    """The lower of the two steady steps: the one less likely to carry a free that came late.

    gloo runs each collective on a worker thread that holds the tensors it was given, so a buffer the step has
    let go of (a reduce-scatter's input, a sent activation) can be freed on that thread a moment after the
    collective's wait returns, and now and then after the main thread's next allocation: the tracker then counts
    it at a peak it was not part of. Seen: the tracker's free callbacks for an 80 KiB tensor run on a thread
    that is not Python's, in one run of two of pp2-zero3; and rank 0's peak there 184 KiB (6%) over its usual
    one in one CI run, never in dozens here. The simulator's collectives hold nothing past their wait. Two such
    late frees in a row would still fail the test; steps 2 and 3 were byte-equal in every run seen here."""
    return min(steps[1:], key=lambda s: s["peak_bytes"])


_COMMON = ["model.n_layers=2", "optim.name='adamw'", "optim.grad_clip=1.0", "train.precision='bf16'"]
FAITHFUL = {
    # world: layouts (AdamW so the first step allocates state; bf16 autocast as on GPUs). One world, one set of
    # processes for all layouts: starting gloo ranks costs more than the layouts' steps.
    4: {"zero1-dp": ["parallel.dp_replicate=4", "parallel.zero_stage=1"],
        "hsdp-zero2": ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero_stage=2"],
        "zero3-tp-sp": ["parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                        "parallel.zero_stage=3"],
        "zero3-cp-checkpointed": ["parallel.dp_shard=2", "parallel.cp=2", "parallel.zero_stage=3",
                                  "parallel.activation_checkpoint='full'"],
        # pipelines: ranks 0 and 3 are the first and last stage; p2p sends are counted too
        "pp2-zero3": ["parallel.pp=2", "parallel.dp_shard=2", "parallel.zero_stage=3"],
        "pp2-tp2-sp": ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
        # accumulation: the model is called once per micro-batch, and FSDP keeps unsharded gradients between them
        # (the trackers used to refuse a root called twice)
        "zero3-accum": ["parallel.dp_shard=4", "parallel.zero_stage=3", "train.grad_accum=2"]},
}


@pytest.mark.parametrize("world", FAITHFUL)
@pytest.mark.multiprocess
def test_simulated_rank_matches_the_real_one(world):
    from shardwise.simulate import simulate_rank

    layouts = {name: _COMMON + overrides for name, overrides in FAITHFUL[world].items()}
    real = dict(zip(layouts, zip(*run_distributed(_real_steps, world, list(layouts.values())))))
    for name, overrides in layouts.items():
        cfg = load_config(CONFIG, overrides)
        for rank in (0, world - 1):
            sim, steps = simulate_rank(cfg, world, rank), real[name][rank]
            steady = _program_order(steps)
            # a first step holds no optimizer state until its end, so its peak is no higher than a steady one's
            real_peak = max(steps[0]["peak_bytes"], steady["peak_bytes"])
            assert sim.peak_step.peak_bytes == pytest.approx(real_peak, rel=0.05), (name, rank)
            # the steady step's collectives, byte for byte
            assert sim.steps[-1].collectives == steady["collectives"], (name, rank)
            for category, value in steady["peak"].items():
                assert sim.peak_step.peak[category] == pytest.approx(value, rel=0.05, abs=64 * 1024), \
                    (name, rank, category)


# ---------------------------------------------------------------------------------------------------
# Model state: ZeRO's formulas (Rajbhandari et al. 2020)

# Our engine keeps fp32 weights that are also the optimizer's master copy, fp32 gradients and Adam's two fp32
# moments, and casts to bf16 per use (autocast / FSDP2): 4 + 4 + 8 = 16 bytes per parameter, the ZeRO paper's
# 2 + 2 + K (K = 12) total arranged differently. Stage 1 shards the optimizer state, 2 also the gradients,
# 3 also the weights, so per rank: ZeRO-1 (4 + 4) Psi + 8 Psi/N, ZeRO-2 4 Psi + 12 Psi/N, ZeRO-3 16 Psi/N
# (the ZeRO paper's (2 + 2 + K) Psi / N_d for ZeRO-3 with mixed-precision Adam, K = 12).
ZERO = {1: (8, 8), 2: (4, 12), 3: (0, 16)}  # stage -> (unsharded bytes/param, sharded bytes/param)
_STATE_MODEL = ["model.dim=256", "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_hidden=768",
                "model.vocab_size=1024", "model.n_layers=4", "optim.name='adamw'", "train.precision='bf16'",
                "train.micro_batch=1"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_state_is_zero_formula(stage):
    from shardwise.simulate import simulate

    n = 8
    layout = [f"parallel.dp_replicate={n}"] if stage == 1 else [f"parallel.dp_shard={n}"]
    cfg = load_config(CONFIG, _STATE_MODEL + layout + [f"parallel.zero_stage={stage}"])
    psi = num_params(cfg.model)
    (report,) = simulate(cfg, n)
    peak = report.peak_step
    measured = sum(peak.model_state.values())
    unsharded, sharded = ZERO[stage]
    expected = unsharded * psi + sharded * psi / n
    # FSDP pads each parameter's dim 0 to a multiple of N (and gathers/reduces through unsharded buffers);
    # Adam keeps a 4-byte step counter per parameter tensor
    tolerance = peak.peak["communication_buffers"] + 4 * len(list(cfg_parameters(cfg)))
    assert abs(measured - expected) <= tolerance, (measured, expected, tolerance)
    if stage == 3:
        assert measured == pytest.approx(16 * psi / n, abs=tolerance)


def cfg_parameters(cfg):
    return build_model(cfg.model).parameters()


def stage_params(args, layers: range, first: bool, last: bool) -> int:
    """Parameters of a pipeline stage, from the model's shape: its blocks, the embedding on the first stage, the
    final norm and head on the last."""
    d, kv = args.dim, args.n_kv_heads * args.head_dim
    block = 2 * d * d + 2 * d * kv + 3 * d * args.ffn_hidden + 2 * d
    return len(layers) * block + (args.vocab_size * d if first else 0) + (d + args.vocab_size * d if last else 0)


@pytest.mark.parametrize("stage", [1, 3])
def test_pipeline_stage_model_state_is_zero_formula_of_its_parameters(stage):
    """pp 2 x 4 data ranks: each simulated stage holds ZeRO's bytes for the parameters of that stage."""
    from shardwise.layout import layer_costs, split_layers
    from shardwise.simulate import simulate

    n = 4
    layout = [f"parallel.dp_replicate={n}"] if stage == 1 else [f"parallel.dp_shard={n}"]
    cfg = load_config(CONFIG, _STATE_MODEL + layout + ["parallel.pp=2", "train.micro_batch=2",
                                                       f"parallel.zero_stage={stage}"])
    split = split_layers(layer_costs(cfg.model, cfg.data.seq_len), 2)
    reports = simulate(cfg, 2 * n)
    assert [r.coordinates["pp"] for r in reports] == [0, 1]
    for s, report in enumerate(reports):
        peak = report.peak_step
        psi = stage_params(cfg.model, split[s], s == 0, s == 1)
        unsharded, sharded = ZERO[stage]
        expected = unsharded * psi + sharded * psi / n
        # Adam's step counters; and from the second micro-batch on, a parameter's new gradient is added to the
        # accumulated one: both are alive for a moment (at most the largest tensor, the embedding or the head)
        largest = max(cfg.model.vocab_size, cfg.model.ffn_hidden) * cfg.model.dim
        tolerance = peak.peak["communication_buffers"] + 4 * (9 * len(split[s]) + 2) + 4 * largest
        assert abs(sum(peak.model_state.values()) - expected) <= tolerance, (s, peak.model_state, expected)


# ---------------------------------------------------------------------------------------------------
# The command line


@pytest.mark.multiprocess
def test_cli_json_and_table():
    args = ["--model", "tiny", "--world", "8", "--plan", "tp=2,dp=4,zero_stage=3", "--seq-len", "64"]
    proc = subprocess.run([sys.executable, "-m", "shardwise.simulate", *args, "--json"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["world"] == 8 and out["layout"]["tp"] == 2 and out["layout"]["dp_shard"] == 4
    (rank,) = out["ranks"]
    assert set(rank["peak"]) == {"parameters", "gradients", "optimizer_state", "activations", "temporaries",
                                 "communication_buffers"}
    assert rank["peak_bytes"] == sum(rank["peak"].values())
    assert rank["moment"]["phase"] in ("forward", "backward", "recompute", "optimizer")
    assert {"all_gather", "reduce_scatter", "all_reduce"} <= set(rank["collectives"])
    assert rank["ratio"]["total"] == pytest.approx(rank["peak_bytes"] / rank["planner"]["total"], rel=1e-3)


@pytest.mark.multiprocess
def test_bad_rank_is_a_config_error():
    proc = subprocess.run([sys.executable, "-m", "shardwise.simulate", "--config", CONFIG, "--set",
                           "parallel.dp_shard=2", "--set", "parallel.zero_stage=3", "--rank", "5"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("shardwise: error: --rank"), proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------
# Big jobs

# Llama 3 70B on 1,024 GPUs as the issue sizes it: tp 8 x pp 4 x FSDP 32 (three stages simulated, in two processes).
# tp 8 x FSDP 128 without a pipeline, and 405B on 16,384 ranks, are measured by benchmarks/simulate_scale.py
# (the suite's time is spent once on the largest case; 405B takes most of a minute).
BIG = [("llama3-70b", 1024, "tp=8,pp=4,dp=32,zero_stage=3")]


@pytest.mark.multiprocess
def test_measured_memory_is_the_commands_not_the_callers():
    # a process started from a large one (this suite, late in a run, holds over a GiB) used to carry the caller's
    # resident size into its peak: the big job's test failed for a caller of 1.1 GiB, not for its simulation
    small = measured_run("debug", 8, "tp=2,pp=1,dp=4,zero_stage=3", seq_len=256)["max_rss_gib"]
    ballast = torch.ones(2**30 // 4)  # 1 GiB, every page written, held while the command runs
    large = measured_run("debug", 8, "tp=2,pp=1,dp=4,zero_stage=3", seq_len=256)["max_rss_gib"]
    assert ballast.sum() == 2**30 // 4 and small < 1.0 and large < small + 0.1


@pytest.mark.parametrize("model, world, plan", BIG, ids=[plan for _, _, plan in BIG])
@pytest.mark.multiprocess
def test_big_job_simulates_in_8_gib_without_allocating_the_model(model, world, plan):
    from shardwise.layout import layer_costs, split_layers

    out = measured_run(model, world, plan)
    print(f"{model} x {out['world']} ({plan}): {out['cpu_s']:.1f} s CPU, {out['wall_s']:.1f} s wall, "
          f"{out['max_rss_gib']:.2f} GiB RSS")
    assert out["max_rss_gib"] < 8
    # the "simulates in under 60 s": the wall time a user waits for `shardwise simulate`, whose three
    # stages run at once (on this 2-core machine ~90-100 s CPU, ~47-52 s wall; benchmarks/simulate_scale.py and
    # docs/simulator.md have the figures)
    assert out["wall_s"] < 60
    args, pp = preset(model), out["layout"]["pp"]
    split = split_layers(layer_costs(args, out["seq_len"]), pp)
    assert [r["coordinates"]["pp"] for r in out["ranks"]] == sorted({0, pp // 2, pp - 1})
    for rank in out["ranks"]:
        # nothing model-sized was allocated: the rank's simulated peak is many times this process's memory
        assert rank["peak_bytes"] > 10 * out["max_rss_gib"] * GiB
        # the rank holds its share of its stage's fp32 weights: tp x FSDP shards every parameter over the
        # stage's ranks, FSDP giving each rank ceil(rows / N) rows of each tensor: at most one row more
        s = rank["coordinates"]["pp"]
        n_tensors = 9 * len(split[s]) + (s == 0) + 2 * (s == pp - 1)
        share = 4 * stage_params(args, split[s], s == 0, s == pp - 1) / (out["world"] // pp)
        slack = n_tensors * 4 * max(args.dim, args.ffn_hidden)
        assert share <= rank["model_state"]["parameters"] <= share + slack, (s, rank["model_state"], share)


@pytest.mark.parametrize("override, field", [("optim.name=adamw8bit", "optim.name"),
                                             ("parallel.offload=full", "parallel.offload")])
def test_what_fake_tensors_cannot_show_is_refused_before_any_rank_starts(override, field):
    from shardwise.config import ConfigError, load_config
    from shardwise.simulate import simulate

    cfg = load_config("tests/configs/parity.toml", ["parallel.dp_shard=2", override])
    with pytest.raises(ConfigError) as e:
        simulate(cfg, 2)
    assert e.value.field == field


@pytest.mark.parametrize("argv, flag", [
    (["--model", "debug", "--plan", "tp=2", "--world", "2", "--seq-len", "-8"], "--seq-len"),
    (["--model", "debug", "--plan", "tp=2", "--world", "2", "--micro-batch", "-1"], "--micro-batch"),
    (["--config", "configs/demo.toml", "--world", "-2"], "--world"),
])
def test_negative_sizes_name_their_flag(argv, flag):
    # --seq-len -8 reached torch.zeros on every rank; --world -2 named parallel.dp_replicate
    import argparse

    from shardwise.config import ConfigError
    from shardwise.simulate import add_simulate_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    argv = [str(Path(__file__).parents[1] / a) if a.endswith(".toml") else a for a in argv]
    with pytest.raises(ConfigError) as e:
        config_from_args(parser.parse_args(argv))
    assert e.value.field == flag


@pytest.mark.parametrize("sets, world, layout", [
    ([], 3, dict(dp_replicate=3)), (["parallel.zero_stage=3"], 4, dict(dp_shard=4)),
    (["parallel.tp=2"], 4, dict(tp=2, dp_replicate=2))])
def test_a_config_fills_the_world_with_data_parallelism_as_train_does(sets, world, layout):
    """`simulate --config X --world 3` was refused ("... or launch 1 processes") where `train --nproc 3` runs."""
    import argparse

    from shardwise.simulate import add_simulate_arguments, config_from_args, format_reports

    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    config = str(Path(__file__).parent / "configs" / "parity.toml")
    cfg, n = config_from_args(parser.parse_args(["--config", config, "--world", str(world),
                                                 *[a for s in sets for a in ("--set", s)]]))
    assert n == world and cfg.parallel.world_size == world
    assert all(getattr(cfg.parallel, k) == v for k, v in layout.items())
    header = format_reports(cfg, n, [], 0.0).splitlines()[0]
    assert all(f"{k}={v}" in header for k, v in layout.items()), header


def test_the_header_names_expert_parallelism_and_a_pipelines_micro_batches():
    from shardwise.simulate import config_from_plan, format_reports

    cfg = config_from_plan("debug-moe", "dp_shard=2,ep=2,pp=2,zero_stage=2", 4, 64, 1, "bf16")
    header = format_reports(cfg, 4, [], 0.0).splitlines()[0]
    assert "ep=2" in header and "cut into 2 pipeline micro-batches" in header, header


def test_a_simulated_model_is_validated():
    from shardwise.config import ConfigError, with_overrides
    from shardwise.simulate import config_from_plan, simulate

    # n_kv_heads=0 reached DTensor's sharding propagation
    cfg = with_overrides(config_from_plan("debug", "tp=2", 2, 64, 1, "fp32"), ["model.n_kv_heads=0"])
    with pytest.raises(ConfigError) as e:
        simulate(cfg, 2)
    assert e.value.field == "model.n_kv_heads"


def test_model_plan_default_sequence_is_the_planners():
    # `simulate --model M --plan P` and `plan --model M --plan P` size one job: without --seq-len both take
    # min(4096, the model's max_seq_len). simulate took 4096 whatever the model (gpt3-175b: 2,048 in plan, 4,096
    # here, its max_seq_len raised without a word)
    import argparse

    from shardwise.config import ConfigError
    from shardwise.planner.cli import add_plan_arguments, build_inputs
    from shardwise.simulate import add_simulate_arguments, config_from_args

    for model, seq in (("debug", 2048), ("gpt3-175b", 2048), ("llama3-8b", 4096)):
        parser = argparse.ArgumentParser()
        add_simulate_arguments(parser)
        cfg, _ = config_from_args(parser.parse_args(["--model", model, "--world", "2", "--plan", "dp=2"]))
        assert cfg.data.seq_len == seq and cfg.model.max_seq_len == preset_max(model), model
        planner = argparse.ArgumentParser()
        add_plan_arguments(planner)
        assert build_inputs(planner.parse_args(["--model", model, "--gpus", "2"]))[1].seq_len == seq
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    cfg, _ = config_from_args(parser.parse_args(["--model", "debug", "--world", "2", "--seq-len", "512"]))
    assert cfg.data.seq_len == 512
    # beyond the model's context: refused as plan and train refuse it (it ran, max_seq_len raised without a word)
    with pytest.raises(ConfigError) as e:
        config_from_args(parser.parse_args(["--model", "debug", "--world", "2", "--seq-len", "100000"]))
    assert e.value.field == "--seq-len" and "max_seq_len 2048" in str(e.value)


def preset_max(name: str) -> int:
    from shardwise.model_args import preset

    return preset(name).max_seq_len


def test_a_pipelines_last_stage_gives_fsdp_no_view_to_warn_about():
    """A last stage whose head runs in the schedule's loss returned DTensor.to_local() (a view) under tensor
    parallelism, and FSDP2 warned on every such run that an in-place op on it would drop its backward hook."""
    import warnings

    from shardwise.simulate import simulate_rank

    cfg = load_config(CONFIG, [*_COMMON, "parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                               "parallel.dp_shard=2", "parallel.zero_stage=3"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        simulate_rank(cfg, 8, 4)  # the last stage's first rank
    assert not [w for w in seen if "returned a view tensor" in str(w.message)]


def test_checkpointing_every_kth_block_is_compared_with_the_planner_but_not_of_a_mixture_of_experts():
    """The planner once priced checkpointing of every block only, and the simulator's planner column priced every
    block checkpointed for activation_checkpoint_every = 2, its ratios read as the planner's error; then the column
    was left empty. Now the planner prices it (tests/test_planner.py compares it at scale), except for a mixture
    of experts: there the column stays empty and the table says why."""
    from shardwise.simulate import format_reports, simulate

    cfg = load_config(CONFIG, [*_COMMON, "model.n_layers=4", "parallel.activation_checkpoint='full'",
                               "parallel.activation_checkpoint_every=2"])
    (report,) = simulate(cfg, 1)
    assert report.planner["total"] == pytest.approx(report.peak_step.peak_bytes, rel=0.10)
    assert "planner: not compared" not in format_reports(cfg, 1, [report], 1.0)
    moe = load_config(str(Path(CONFIG).with_name("moe.toml")),
                      ["optim.name='adamw'", "train.precision='bf16'", "parallel.activation_checkpoint='full'",
                       "parallel.activation_checkpoint_every=2"])
    (report,) = simulate(moe, 1)
    assert report.planner == {} and set(report.ratios().values()) == {None}
    text = format_reports(moe, 1, [report], 1.0)
    assert "planner: not compared" in text and "activation_checkpoint_every" in text and "mixture of experts" in text


def test_the_gradient_norm_under_fsdp_and_tp_logs_no_warning(caplog):
    """The clipped norm, partial over FSDP's and TP's dims, is reduced dim by dim: DTensor logged a warning about
    it on every rank of every FSDP x TP run."""
    import logging

    from shardwise.simulate import simulate_rank

    cfg = load_config(CONFIG, [*_COMMON, "parallel.dp_shard=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                               "parallel.zero_stage=3"])
    with caplog.at_level(logging.WARNING):
        simulate_rank(cfg, 4, 0)
    assert not [r for r in caplog.records if "sequential all_reduce" in r.getMessage()]


def test_a_world_the_degrees_do_not_fill_names_world_as_the_fix(capsys):
    """A 4-rank config simulated at --world 2 said "or launch 4 processes", which simulate does not do."""
    from shardwise.cli import main

    config = str(Path(__file__).parent / "configs" / "parity.toml")
    assert main(["simulate", "--config", config, "--set", "parallel.tp=2", "--set", "parallel.dp_replicate=2",
                 "--world", "2"]) == 2
    err = capsys.readouterr().err
    assert "--world: the config's degrees multiply to 4 ranks, not 2; fix: give --world 4" in err, err
