"""Step time the planner predicts with this machine's calibrated profile vs the step time of real runs on it.

1. Calibrate: `shardwise bench --world N --threads T` for every (processes, threads) the layouts use (a rank of
   an N-process job gets cores // N threads and shares the cores and the memory bus with the other N - 1, so its
   compute rates depend on N; the collectives are gloo over loopback, the "intra-node" tier). Every run is
   also bracketed by a fresh measurement of the compute rates of its ranks (`bench.compute_rates`, all ranks at
   once), because the load of a shared machine changes within seconds to minutes: the prediction for a run uses
   the mean of the two.
2. For each layout: `shardwise train --config <the plan as written by shardwise plan --write-config> --nproc N`
   for a few steps; the measured step time is the median `step_time_s` in the run's metrics.jsonl after the
   warm-up steps (the first carry one-off work, the second the communication counter): the planner predicts a
   typical step (the profile's collectives are median timings, as a step sums many of them). The fastest step
   is printed too.
3. Predict: `evaluate` (what `shardwise plan --plan` reports for a plan) with that profile.

No factor is fitted: the planner's rates are the profile's measured peaks with efficiency 1 ("pred/meas"). The
"calibrated" column also sets the matmul efficiency from the single-device run alone (the issue's "efficiency
that can be calibrated": this model's kernels against the bench's) and keeps it for every parallel layout,
whose ratios then test the parallel terms only.

    python benchmarks/planner_vs_measured.py [--repeats 3] [--steps 24] [--profiles DIR]
    python benchmarks/planner_vs_measured.py --only "small model, 1 core" "small model, 1 core, LoRA r8" --steps 40
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwise.hardware import Accelerator
from shardwise.model_args import ModelArgs
from shardwise.planner import Cluster, Plan, Training, evaluate, load_profile
from shardwise.planner.bench import ATTENTION_SHAPES, OVERHEADS, compute_rates, matmul_table
from shardwise.planner.config_out import write_config

# Big enough that the matmuls dominate the step (per-op Python overhead is ~1% of it), small enough that a run
# of 8 steps takes ~20 s on 2 cores: 3.2M parameters, 8 x 128 tokens per step, ~20 GFLOP per step.
MODEL = ModelArgs(name="planner-bench", dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768,
                  vocab_size=320, max_seq_len=128)
SEQ_LEN, GLOBAL_BATCH = 128, 8

# (name, plan, CPU threads per rank: None for what `--nproc` sets, cores // processes). "1 device, 1 core" is the
# device every rank of the 2-process layouts is; on a machine shared with other jobs a 2-thread process loses
# far more than half its speed whenever one of its threads is descheduled (the other waits for it at every
# parallel region), so the 2-core row is shown but is not the reference for calibration.
LAYOUTS: list[tuple[str, Plan, int | None]] = [
    ("1 device, 1 core", Plan(micro_batch=8), 1),
    ("1 device, 2 cores", Plan(micro_batch=8), None),
    ("dp 2, ZeRO-0", Plan(dp_replicate=2, micro_batch=4), None),
    ("dp 2, ZeRO-1", Plan(dp_replicate=2, zero_stage=1, micro_batch=4), None),
    ("FSDP 2 (ZeRO-3)", Plan(dp_shard=2, zero_stage=3, micro_batch=4), None),
    ("tp 2", Plan(tp=2, micro_batch=8), None),
    ("pp 2, 1f1b, 2 micro-batches", Plan(pp=2, micro_batch=4, grad_accum=2, pp_schedule="1f1b"), None),
    ("pp 2, gpipe, 4 micro-batches", Plan(pp=2, micro_batch=2, grad_accum=4, pp_schedule="gpipe"), None),
    ("dp 2 x tp 2 (4 processes)", Plan(dp_replicate=2, tp=2, micro_batch=4), None),
]
REFERENCE = "1 device, 1 core"

# A model small enough that the per-operator cost is a large share of its step, trained whole and with LoRA:
# LoRA's frozen weights drop their gradients' operators and every adapter adds its own (operators.LORA_OPS), which
# the planner's count of the step's operators has to follow. Not in the default set.
SMALL = ModelArgs(name="planner-bench-small", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=192,
                  vocab_size=320, max_seq_len=128)
SMALL_JOBS = [("small model, 1 core", Plan(micro_batch=2), 1), ("small model, 1 core, LoRA r8", Plan(micro_batch=2), 1)]
JOBS = {name: (SMALL, Training(seq_len=SEQ_LEN, global_batch=2, precision="fp32", optimizer="adamw", lora_rank=rank))
        for (name, _, _), rank in zip(SMALL_JOBS, (0, 8))}
"""The model and recipe of each layout that does not train MODEL at GLOBAL_BATCH x SEQ_LEN (`training()`)."""


def threads_of(plan: Plan, threads: int | None) -> int:
    return threads or max(1, (os.cpu_count() or 1) // plan.world)


def training() -> Training:
    return Training(seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, precision="fp32", optimizer="adamw")


def job(name: str) -> tuple[ModelArgs, Training]:
    """The model and recipe the layout `name` trains."""
    return JOBS.get(name, (MODEL, training()))


def calibrate_profiles(kinds: set[tuple[int, int]], out_dir: Path, iters: int) -> dict[tuple[int, int], Path]:
    """A `shardwise bench` profile for each (processes, threads per process) the layouts use."""
    paths = {}
    for world, threads in sorted(kinds):
        path = out_dir / f"profile_world{world}_threads{threads}.json"
        cmd = [sys.executable, "-m", "shardwise.planner.bench", "--world", str(world), "--threads", str(threads),
               "--device", "cpu", "--matmul-size", "1024", "--comm-mb", "32", "--iters", str(iters),
               "--out", str(path)]
        for attempt in range(3):  # the rendezvous port can be taken by another job between probe and bind
            if subprocess.run(cmd, env=_env()).returncode == 0:
                break
        else:
            raise RuntimeError(f"{' '.join(cmd)} failed three times")
        paths[world, threads] = path
    return paths


def _env(threads: int | None = None) -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # launch_local sets cores // nproc, as the profile assumes
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def measure(name: str, plan: Plan, threads: int | None, steps: int, warmup: int, work: Path) -> dict:
    """The median and the fastest step time (seconds) of a real run of `plan` after `warmup` steps, and the load
    average. The median is what the planner predicts (a typical step); the fastest is the one other jobs
    disturbed least."""
    config, run = work / "plan.toml", work / "run"
    shutil.rmtree(run, ignore_errors=True)  # training appends to an existing metrics.jsonl: start clean
    write_config(config, *job(name), plan)
    sets = [f"train.steps={steps}", "train.val_every=0", "metrics.log_every=1", f"metrics.out_dir='{run}'",
            "data.max_corpus_mb=1"]
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "shardwise", "train", "--config", str(config), "--nproc", str(plan.world),
           *(f"--set={s}" for s in sets)]
    done = subprocess.run(cmd, env=_env(threads), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > warmup]
    return {"median": statistics.median(times), "min": min(times), "load": (load + os.getloadavg()[0]) / 2}


def rates_now(plan: Plan, threads: int | None, iters: int) -> dict:
    """This moment's compute rates of a rank of this layout (bench.compute_rates: every rank measuring at once)."""
    return compute_rates(plan.world, "cpu", threads_of(plan, threads), 1024, ["fp32"], iters)


def with_rates(acc: Accelerator, rates: dict) -> Accelerator:
    """The profile with its compute rates and per-operator costs replaced by `rates` (as `shardwise bench` turns
    them into a profile)."""
    return dataclasses.replace(acc, peak_flops={**acc.peak_flops, "fp32": rates["matmul_fp32"]},
                               attention_efficiency=min(1.0, rates["attention"] / rates["matmul_fp32"]),
                               attention_by_shape={f"{seq},{hd}": min(1.0, rates[f"attention_{seq}_{hd}"]
                                                                      / rates["matmul_fp32"])
                                                   for seq, hd in ATTENTION_SHAPES},
                               mem_bandwidth=rates["mem_bandwidth"],
                               matmul_by_shape=matmul_table(rates, rates["matmul_fp32"]),
                               **{k: rates[k] for k in OVERHEADS if k in rates})


def predict(plan: Plan, acc: Accelerator, name: str = REFERENCE):
    return evaluate(*job(name), plan, Cluster(acc, plan.world, gpus_per_node=plan.world)).time


def _optimizer_fixed(name: str, plan: Plan, acc: Accelerator) -> float:
    """The optimizer step's per-operator part (timing.optimizer_time less its memory traffic)."""
    return (predict(plan, acc, name).optimizer_s
            - predict(plan, dataclasses.replace(acc, optimizer_op_overhead_s=0.0), name).optimizer_s)


def matmul_efficiency_from(measured: float, acc: Accelerator) -> float:
    """The matmul efficiency at which the single-device prediction equals `measured`. Predicted time is
    A + B / efficiency (only the matmul terms scale), so two evaluations give A and B."""
    one, half = (predict(LAYOUTS[0][1], dataclasses.replace(acc, matmul_efficiency=e)).step_time_s
                 for e in (1.0, 0.5))
    b = half - one
    return b / (measured - (one - b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default=None, help="folder of profile_world<N>.json from an earlier run "
                        "(default: calibrate before every repetition)")
    parser.add_argument("--out", default=None, help="folder for profiles and results (default: a temp folder)")
    parser.add_argument("--steps", type=int, default=24, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the measurement")
    parser.add_argument("--repeats", type=int, default=3, help="calibrations + runs of every layout")
    parser.add_argument("--iters", type=int, default=10, help="repetitions per bench measurement")
    parser.add_argument("--only", nargs="*", default=None, help="layout names to run (default: every "
                        "layout of MODEL; the SMALL_JOBS rows only when named)")
    ns = parser.parse_args(argv)
    out = Path(ns.out or tempfile.mkdtemp(prefix="planner_vs_measured_"))
    out.mkdir(parents=True, exist_ok=True)
    layouts = [(name, plan, threads) for name, plan, threads in LAYOUTS + SMALL_JOBS
               if ((name, plan, threads) in LAYOUTS if ns.only is None else name in ns.only)]
    kinds = {(plan.world, threads_of(plan, threads)) for _, plan, threads in layouts}
    # each repetition calibrates and then runs every layout, and its predictions use its own profiles: the
    # load that other jobs put on a shared machine drifts over minutes, so a measurement is compared with a
    # calibration taken minutes, not a quarter of an hour, apart
    reps = []
    for rep in range(ns.repeats):
        rep_dir = out / f"rep{rep}"
        rep_dir.mkdir(exist_ok=True)
        if ns.profiles:
            profiles = {(w, t): Path(ns.profiles) / f"profile_world{w}_threads{t}.json" for w, t in kinds}
        else:
            profiles = calibrate_profiles(kinds, rep_dir, ns.iters)
        accs = {k: load_profile(path) for k, path in profiles.items()}
        runs, run_accs = {}, {}
        for name, plan, threads in layouts:
            work = rep_dir / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
            work.mkdir(exist_ok=True)
            # compute rates just before and just after the run: the load of a shared machine changes within
            # seconds to minutes (here the matmul rate of one core has read 55 and 93 GFLOP/s a few seconds apart),
            # so the run is predicted with the mean of the two that bracket it
            before = rates_now(plan, threads, ns.iters)
            runs[name] = measure(name, plan, threads, ns.steps, ns.warmup, work)
            after = rates_now(plan, threads, ns.iters)
            rates = {k: (before[k] + after[k]) / 2 for k in before}
            run_accs[name] = with_rates(accs[plan.world, threads_of(plan, threads)], rates)
            runs[name]["matmul_gflops"] = [round(before["matmul_fp32"] / 1e9, 1), round(after["matmul_fp32"] / 1e9, 1)]
            print(f"  rep {rep + 1}, {name}: {runs[name]}", file=sys.stderr, flush=True)
        reps.append({"profiles": run_accs, "runs": runs})

    # the "efficiency that can be calibrated": matmul efficiency from the single-device run alone (this
    # model's GEMMs, attention and elementwise work against the bench's), kept for every parallel layout, whose
    # ratios then test the parallel terms only
    calibrated = None
    if REFERENCE in reps[0]["runs"]:
        calibrated = [{k: dataclasses.replace(a, matmul_efficiency=matmul_efficiency_from(
            r["runs"][REFERENCE]["median"], r["profiles"][REFERENCE])) for k, a in r["profiles"].items()}
            for r in reps]
    note = ("" if calibrated is None else "; calibrated: matmul efficiency from the '1 device' run, "
            + ", ".join(f"{c[REFERENCE].matmul_efficiency:.2f}" for c in calibrated))
    results = []
    for name, plan, threads in layouts:
        pairs = [(predict(plan, r["profiles"][name], name), r["runs"][name]) for r in reps]
        median = statistics.median
        results.append({
            "layout": name, "ranks": plan.world,
            "predicted_s": median(t.step_time_s for t, _ in pairs), "compute_s": median(t.compute_s for t, _ in pairs),
            "exposed_comm_s": median(t.exposed_comm_s for t, _ in pairs),
            "bubble_s": median(t.bubble_s for t, _ in pairs),
            "overhead_s": median(t.detail["op_overhead_s"] + t.detail["sharding_copies_s"]
                                 + _optimizer_fixed(name, plan, r["profiles"][name])
                                 for (t, _), r in zip(pairs, reps)),
            "measured_min_s": median(m["min"] for _, m in pairs),
            "measured_median_s": median(m["median"] for _, m in pairs),
            "ratio": median(t.step_time_s / m["median"] for t, m in pairs),
            "ratios": [round(t.step_time_s / m["median"], 3) for t, m in pairs],
            "ratio_to_fastest": median(t.step_time_s / m["min"] for t, m in pairs),
            # the same prediction with one matmul rate (the large cube's) for every GEMM shape
            "ratio_one_rate": median(predict(plan, dataclasses.replace(r["profiles"][name], matmul_by_shape=None),
                                             name).step_time_s / r["runs"][name]["median"] for r in reps),
            "ratio_calibrated": None if calibrated is None else median(
                predict(plan, c[name], name).step_time_s / r["runs"][name]["median"] for c, r in zip(calibrated, reps)),
            "load": median(m["load"] for _, m in pairs)})
    (out / "results.json").write_text(json.dumps({"results": results}, indent=2))
    shapes = sorted({f"{model.name}: {tr.global_batch} x {tr.seq_len}"
                     for model, tr in (job(name) for name, _, _ in layouts)})
    print(f"{', '.join(shapes)} tokens per step, fp32 AdamW, gloo on {os.cpu_count()} cores; "
          f"{ns.repeats} repetitions (calibration + {ns.steps - ns.warmup} timed steps per layout){note}; "
          f"medians over the repetitions; results in {out}")
    head = ("layout", "ranks", "predicted s", "(compute", "exp. comm", "bubble", "overheads)", "measured s",
            "(fastest step)", "pred/meas", "per repetition", "one GEMM rate", "pred/fastest", "calibrated", "load")
    rows = [head] + [(r["layout"], str(r["ranks"]), f"{r['predicted_s']:.3f}", f"{r['compute_s']:.3f}",
                      f"{r['exposed_comm_s']:.3f}", f"{r['bubble_s']:.3f}", f"{r['overhead_s']:.3f}",
                      f"{r['measured_median_s']:.3f}", f"{r['measured_min_s']:.3f}", f"{r['ratio']:.2f}",
                      " ".join(f"{x:.2f}" for x in r["ratios"]), f"{r['ratio_one_rate']:.2f}",
                      f"{r['ratio_to_fastest']:.2f}",
                      "-" if r["ratio_calibrated"] is None else f"{r['ratio_calibrated']:.2f}",
                      f"{r['load']:.1f}") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    for row in rows:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
