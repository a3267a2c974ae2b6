"""shardwise against torchtitan 0.3.0: the same model, tokenizer, data and batch, trained on CPU with gloo.

What it measures. torchtitan's llama3 debug model (6,163,712 parameters: dim 256, 6 layers, 16 heads, vocab
2048) and the shardwise job written to match it (peer_torchtitan/sw_debug.toml), both trained for --steps
steps on 8 sequences x 1024 tokens per step, fp32 (bf16 for the bf16 layout), no compile (except in the
compile layouts), no activation checkpointing, in the layouts:

    single   one process                      fsdp  FSDP 2 (ZeRO-3)        tp   TP 2 + sequence parallel
    ddp      data parallel 2 (replicated)     pp    PP 2, 1F1B, 4 x 2 seq  bf16 one process, bf16
    tp_nosp  TP 2 without sequence parallel (not run unless named in --layouts)
    compile  one process, each block compiled with torch.compile (inductor; both systems compile the blocks only)
    fsdp_compile  FSDP 2 with the blocks compiled (compile layouts: not run unless named in --layouts)
    fsdp_bf16  FSDP 2 in bf16 under FSDP2's MixedPrecisionPolicy in both (shardwise's parallel.mixed_precision =
             'fsdp'; not run unless named in --layouts)

Each repetition runs the two systems back to back, torchtitan first on odd repetitions and shardwise first on
even ones, each after the machine's 1-minute load average fell below 1.0. The runs share --cores cores
(OMP_NUM_THREADS = cores / processes). Per layout it prints tokens/s per rank of each system (the median over
repetitions of each run's median over the steps after --discard), shardwise / torchtitan, the step times
(median and interquartile range of all kept steps), the first and last loss of each, and whether both fell; the
table also goes to <work-dir>/out/summary.md.

torchtitan does not train on CPU as shipped: peer_torchtitan/cpu_launch.py patches its device helpers and
two torch APIs it expects, and peer_torchtitan/cpu_titan swaps FlexAttention for causal SDPA (see both files).

Run from the repository root with the python of the environment shardwise is installed in:

    .venv/bin/python benchmarks/peer_torchtitan.py                        # 3 reps x 6 layouts x 2 systems
    .venv/bin/python benchmarks/peer_torchtitan.py --layouts single fsdp --reps 1 --no-wait
    .venv/bin/python benchmarks/peer_torchtitan.py --parse-only --json out.json   # re-read the logs of a run

Needs: python3 with venv, and pip access the first time (torch 2.13.0 and torchtitan 0.3.0 are installed into
--titan-venv, ~2.5 GB, unless there already); <100 MB under --work-dir for the assets, token cache and logs.

Takes: measured on a shared 2-core machine, a 6-step run took 50-100 s: ~20 s of start-up, then 4.5-14 s per
step depending on the system, the layout and the machine's other load. A 20-step run is then ~2 min on an idle
machine, and waiting for the load average to fall below 1.0 after it adds ~1 min: the default 3 reps x 6 layouts
x 2 systems = 36 runs take ~2 hours (--no-wait: ~1.2 hours, with noisier figures). The first invocation adds the
set-up: torchtitan's venv (minutes, downloads), tokenizer training and token cache (~1 min).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent / "peer_torchtitan"
SHARDWISE_CONFIG = HERE / "sw_debug.toml"
TORCH, TORCHTITAN = "2.13.0", "0.3.0"
EXPECTED_PARAMS = 6_163_712
GLOBAL_BATCH = 8  # sequences per optimizer step, in every layout
SEED = 42
RUN_TIMEOUT_S = 1500
SYSTEMS = ("titan", "sw")
NAMES = {"titan": "torchtitan", "sw": "shardwise"}


@dataclass(frozen=True)
class Layout:
    """One parallel layout as each system spells it; both train GLOBAL_BATCH sequences per step."""

    nproc: int
    titan: tuple[str, ...]
    """torchtitan command-line flags"""
    shardwise: tuple[str, ...]
    """shardwise config overrides (each passed as --set KEY=VALUE)"""
    bf16: bool = False


LAYOUTS = {
    "single": Layout(1, ("--training.local_batch_size", "8"), ("train.micro_batch=8",)),
    "fsdp": Layout(2, ("--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree", "2"),
                   ("parallel.dp_shard=2", "parallel.zero_stage=3", "train.micro_batch=4")),
    # torchtitan's enable_sequence_parallel defaults to true
    "tp": Layout(2, ("--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2",
                     "--parallelism.data_parallel_shard_degree", "1"),
                 ("parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch=8")),
    "ddp": Layout(2, ("--training.local_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2",
                      "--parallelism.data_parallel_shard_degree", "1"),
                  ("parallel.dp_replicate=2", "parallel.zero_stage=0", "train.micro_batch=4")),
    # 1F1B over 2 stages, 4 micro-batches of 2 sequences
    "pp": Layout(2, ("--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2",
                     "--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_schedule",
                     "1F1B", "--parallelism.pipeline_parallel_microbatch_size", "2"),
                 ("parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=4", "train.micro_batch=8")),
    # torchtitan: FSDP2's MixedPrecisionPolicy(param_dtype=bf16), installed even on one process; shardwise: autocast
    "bf16": Layout(1, ("--training.local_batch_size", "8"), ("train.micro_batch=8",), bf16=True),
    "tp_nosp": Layout(2, ("--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2",
                          "--parallelism.data_parallel_shard_degree", "1",
                          "--parallelism.no-enable-sequence-parallel"),
                      ("parallel.tp=2", "parallel.sequence_parallel=false", "train.micro_batch=8")),
}
# torch.compile of each block: torchtitan's "model" component compiles the blocks one by one, as train.compile does
TITAN_COMPILE = ("--compile.enable", "--compile.components", "model")
LAYOUTS["compile"] = Layout(1, (*LAYOUTS["single"].titan, *TITAN_COMPILE), (*LAYOUTS["single"].shardwise,
                                                                           "train.compile=true"))
LAYOUTS["fsdp_compile"] = Layout(2, (*LAYOUTS["fsdp"].titan, *TITAN_COMPILE), (*LAYOUTS["fsdp"].shardwise,
                                                                               "train.compile=true"))
# FSDP 2 in bf16, both under FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): torchtitan's
# --training.mixed_precision_param bfloat16 (its default reduce dtype is fp32), shardwise's parallel.mixed_precision
LAYOUTS["fsdp_bf16"] = Layout(2, LAYOUTS["fsdp"].titan, (*LAYOUTS["fsdp"].shardwise, "parallel.mixed_precision='fsdp'"),
                              bf16=True)
DEFAULT_LAYOUTS = ["single", "fsdp", "tp", "ddp", "pp", "bf16"]


@dataclass(frozen=True)
class Paths:
    """Where everything lives: the two environments and the work folder."""

    work: Path
    titan_venv: Path
    shardwise_bin: Path

    @property
    def run(self) -> Path:
        """torchtitan's working directory: its debug model reads ./tests/assets"""
        return self.work / "run"

    @property
    def assets(self) -> Path:
        return self.run / "tests" / "assets"

    @property
    def tokenizer(self) -> Path:
        return self.assets / "tokenizer" / "tokenizer.json"

    @property
    def out(self) -> Path:
        return self.work / "out"

    def shardwise_data(self, seq_len: int) -> list[str]:
        """The overrides that point shardwise at the shared tokenizer and this work folder's token cache."""
        return [f"data.tokenizer={json.dumps(str(self.tokenizer))}",
                f"data.cache_dir={json.dumps(str(self.work / 'sw_cache'))}", f"data.seq_len={seq_len}"]


# ---------------------------------------------------------------------------------------------------
# Set-up: torchtitan's environment, the shared data, the parameter counts


def installed_versions(python: Path) -> tuple[str, str] | None:
    """(torch, torchtitan) versions installed for `python`, or None when either is missing."""
    done = subprocess.run([str(python), "-c", "from importlib.metadata import version; "
                           "print(version('torch'), version('torchtitan'))"], capture_output=True, text=True)
    return tuple(done.stdout.split()) if done.returncode == 0 else None


def ensure_titan_venv(venv: Path) -> None:
    """torch 2.13.0 and torchtitan 0.3.0 in their own virtual environment, installed only when missing."""
    python = venv / "bin" / "python"
    versions = installed_versions(python) if python.exists() else None
    if versions and versions[0].split("+")[0] == TORCH and versions[1] == TORCHTITAN:
        return
    print(f"installing torch {TORCH} and torchtitan {TORCHTITAN} into {venv} (found: {versions})", flush=True)
    if not python.exists():
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)  # the venv's bundled pip 23 crashes on torchtitan's deps
    subprocess.run(pip + [f"torch=={TORCH}"], check=True)  # first, so torchtitan's deps keep this torch
    subprocess.run(pip + [f"torchtitan=={TORCHTITAN}"], check=True)
    # torchtitan imports triton at start-up (its expert-parallel kernels) and torch's CPU build does not
    # install it; only the import is needed, so nothing of what it depends on
    subprocess.run(pip + ["--no-deps", "triton"], check=True)


def prepare_data(paths: Paths, seq_len: int) -> None:
    """The shared tokenizer and corpus (once), and shardwise's token cache warmed outside the timed runs."""
    cmd = [str(paths.shardwise_bin / "python"), str(HERE / "prep_data.py"), str(paths.assets), str(SHARDWISE_CONFIG)]
    subprocess.run(cmd + [f"--set={s}" for s in paths.shardwise_data(seq_len)], check=True)


def check_parameter_counts(paths: Paths) -> None:
    """Stop unless both systems build a model of EXPECTED_PARAMS parameters."""
    script = str(HERE / "count_params.py")
    counts = {}
    for name, cmd in (("torchtitan", [str(paths.titan_venv / "bin" / "python"), script, "titan"]),
                      ("shardwise", [str(paths.shardwise_bin / "python"), script, "shardwise", str(SHARDWISE_CONFIG)])):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"counting {name}'s parameters failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
        counts[name] = int(done.stdout.split()[-1])
    print("parameters: " + ", ".join(f"{name} {n:,}" for name, n in counts.items()))
    if set(counts.values()) != {EXPECTED_PARAMS}:
        sys.exit(f"the two models must both have {EXPECTED_PARAMS:,} parameters to be compared: fix {SHARDWISE_CONFIG}"
                 " (or the torchtitan version) until they do")


# ---------------------------------------------------------------------------------------------------
# One timed run


def wait_until_idle(max_load: float = 1.0, poll_s: int = 30) -> None:
    """Block until the 1-minute load average is below max_load (another job's processes would share the cores)."""
    while (load := os.getloadavg()[0]) >= max_load:
        print(f"  load {load:.2f} >= {max_load}, waiting {poll_s} s", flush=True)
        time.sleep(poll_s)


def titan_command(paths: Paths, layout: Layout, steps: int, seq_len: int, dump: Path) -> list[str]:
    return [
        str(paths.titan_venv / "bin" / "torchrun"), "--nproc_per_node", str(layout.nproc),
        "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0",
        "--tee", "3",  # every rank's stdout and stderr into the log, prefixed [default<rank>]:
        str(HERE / "cpu_launch.py"), "--module", "cpu_titan", "--config", "llama3_debugmodel_cpu",
        # DTensor on the model-parallel axes only and FSDP2 on a plain mesh (the recipe's choice, not 0.3.0's
        # default spmd_types path)
        "--parallelism.spmd_backend", "partial_dtensor",
        "--training.mixed_precision_param", "bfloat16" if layout.bf16 else "float32",
        "--training.steps", str(steps), "--training.seq_len", str(seq_len), "--debug.seed", str(SEED),
        "--dump_folder", str(dump), *layout.titan,
        "activation-checkpoint:none",  # the debug model's default is selective activation checkpointing
    ]


def shardwise_command(paths: Paths, layout: Layout, steps: int, seq_len: int, out_dir: Path) -> list[str]:
    precision = "bf16" if layout.bf16 else "fp32"
    sets = [*paths.shardwise_data(seq_len), f"train.steps={steps}", f"train.precision={precision}",
            f"metrics.out_dir={json.dumps(str(out_dir))}", *layout.shardwise]
    nproc = ["--nproc", str(layout.nproc)] if layout.nproc > 1 else []
    return [str(paths.shardwise_bin / "shardwise"), "train", "--config", str(SHARDWISE_CONFIG), *nproc,
            *(arg for s in sets for arg in ("--set", s))]


def run_logged(cmd: list[str], log: Path, cwd: Path, env: dict[str, str]) -> int:
    """Run cmd with its output in log; kill its whole process group (torchrun and the ranks) past the timeout."""
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
        f.write(f"rc={rc} wall_s={time.perf_counter() - start:.1f}\n")
    return rc


def run_one(system: str, name: str, rep: int, args: argparse.Namespace, paths: Paths) -> None:
    """One timed run of one system in one layout; its log is <out>/<system>_<layout>_r<rep>.log."""
    layout, run = LAYOUTS[name], f"{system}_{name}_r{rep}"
    if not args.no_wait:
        wait_until_idle()
    threads = max(1, args.cores // layout.nproc)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if system == "titan":
        dump = paths.out / f"{run}.dump"
        shutil.rmtree(dump, ignore_errors=True)
        cmd = titan_command(paths, layout, args.steps, args.seq_len, dump)
        env["PYTHONPATH"] = str(HERE)  # for --module cpu_titan
    else:
        metrics = paths.out / run
        shutil.rmtree(metrics, ignore_errors=True)  # shardwise appends to an existing metrics.jsonl
        cmd = shardwise_command(paths, layout, args.steps, args.seq_len, metrics)
    print(f"[{time.strftime('%H:%M:%S')}] {run} (load {os.getloadavg()[0]:.2f}, {layout.nproc} processes, "
          f"OMP_NUM_THREADS={threads})", flush=True)
    start = time.perf_counter()
    rc = run_logged(cmd, paths.out / f"{run}.log", paths.run, env)
    print(f"[{time.strftime('%H:%M:%S')}] {run} done, rc={rc} ({time.perf_counter() - start:.0f} s)"
          + ("" if rc == 0 else f": see {paths.out / f'{run}.log'}"), flush=True)


# ---------------------------------------------------------------------------------------------------
# Reading the runs back

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# torchtitan's per-step line, prefixed by torchrun's --tee: "[default0]:... step:  3  loss:  7.1  ... tps: 4,321 ..."
TITAN_STEP = re.compile(r"\[default(\d+)\]:.*(?<!validate )step:\s*(\d+)\s+loss:\s*(-?[\d.]+).*?tps:\s*([\d,]+)")


@dataclass
class Run:
    """One run's per-step tokens/s per rank and loss, keyed by step (1-based)."""

    system: str
    layout: str
    rep: int
    tps: dict[int, float] = field(default_factory=dict)
    loss: dict[int, float] = field(default_factory=dict)

    def kept(self, discard: int) -> list[float]:
        return [tps for step, tps in sorted(self.tps.items()) if step > discard]

    def step_times(self, discard: int, seq_len: int) -> list[float]:
        world = LAYOUTS[self.layout].nproc
        return [GLOBAL_BATCH * seq_len / (tps * world) for tps in self.kept(discard)]


def read_titan(run: Run, log: Path) -> None:
    """torchtitan's tps is already per rank: local tokens / (step time x tp x pp). Rank 0's is taken; the loss
    from any rank that has it (under PP only the last stage does, the others print -1)."""
    for line in log.read_text(errors="replace").splitlines():
        match = TITAN_STEP.search(ANSI.sub("", line))
        if not match:
            continue
        rank, step, loss, tps = int(match[1]), int(match[2]), float(match[3]), float(match[4].replace(",", ""))
        if rank == 0:
            run.tps[step] = tps
        if loss >= 0:
            run.loss[step] = loss


def read_shardwise(run: Run, metrics: Path) -> None:
    """shardwise's tokens_per_s is global tokens / step time: divided by the world size, per rank."""
    if not metrics.exists():
        return
    world = LAYOUTS[run.layout].nproc
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "tokens_per_s" in row:
            run.tps[row["step"]] = row["tokens_per_s"] / world
            run.loss[row["step"]] = row["loss"]


def read_run(out: Path, system: str, layout: str, rep: int) -> Run:
    run = Run(system, layout, rep)
    if system == "titan" and (out / f"titan_{layout}_r{rep}.log").exists():
        read_titan(run, out / f"titan_{layout}_r{rep}.log")
    elif system == "sw":
        read_shardwise(run, out / f"sw_{layout}_r{rep}" / "metrics.jsonl")
    return run


# ---------------------------------------------------------------------------------------------------
# The table


def describe_runs(runs: list[Run], discard: int, seq_len: int) -> list[str]:
    lines = [f"per run (steps > {discard}): tokens/s per rank (median), step time s median (min-max), "
             "loss first -> last"]
    for run in runs:
        kept = run.kept(discard)
        if not kept or not run.loss:
            lines.append(f"  {run.layout:8s} {NAMES[run.system]:10s} r{run.rep}  no steps after {discard}: failed?")
            continue
        times = run.step_times(discard, seq_len)
        lines.append(f"  {run.layout:8s} {NAMES[run.system]:10s} r{run.rep}  {statistics.median(kept):8.0f} tok/s  "
                     f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f}) s  "
                     f"{run.loss[min(run.loss)]:.3f} -> {run.loss[max(run.loss)]:.3f}")
    return lines


def summarise(runs: list[Run], layout: str, discard: int, seq_len: int) -> dict | None:
    """One table row: both systems' figures for one layout, or None if either has no usable run."""
    row: dict = {"layout": layout}
    for system in SYSTEMS:
        ok = [r for r in runs if r.system == system and r.layout == layout and r.kept(discard) and r.loss]
        if not ok:
            return None
        times = sorted(t for r in ok for t in r.step_times(discard, seq_len))
        quartiles = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        row[system] = {
            "reps": len(ok),
            "tokens_per_s_per_rank": statistics.median(statistics.median(r.kept(discard)) for r in ok),
            "step_s": {"median": statistics.median(times), "p25": quartiles[0], "p75": quartiles[2]},
            "first_loss": statistics.median(r.loss[min(r.loss)] for r in ok),
            "last_loss": statistics.median(r.loss[max(r.loss)] for r in ok),
            "loss_fell": all(r.loss[max(r.loss)] < r.loss[min(r.loss)] for r in ok),
        }
    row["ratio"] = row["sw"]["tokens_per_s_per_rank"] / row["titan"]["tokens_per_s_per_rank"]
    # each repetition's pair, run one after the other: the machine's drift between repetitions cancels in its ratio
    paired = {system: {r.rep: statistics.median(r.kept(discard)) for r in runs if r.system == system
                       and r.layout == layout and r.kept(discard) and r.loss} for system in SYSTEMS}
    row["rep_ratios"] = [paired["sw"][rep] / paired["titan"][rep] for rep in sorted(paired["sw"])
                         if rep in paired["titan"]]
    return row


def markdown_table(rows: list[dict]) -> list[str]:
    lines = ["| layout | torchtitan tok/s/rank | shardwise tok/s/rank | shardwise / torchtitan | "
             "per repetition (median) | step s torchtitan [IQR] | step s shardwise [IQR] | loss torchtitan | "
             "loss shardwise | both fell |",
             "|---|---:|---:|---:|---|---|---|---|---|---|"]
    for row in rows:
        titan, sw = row["titan"], row["sw"]
        step = [f"{s['step_s']['median']:.3f} [{s['step_s']['p25']:.3f}-{s['step_s']['p75']:.3f}]" for s in (titan, sw)]
        loss = [f"{s['first_loss']:.3f} -> {s['last_loss']:.3f}" for s in (titan, sw)]
        fell = "yes" if titan["loss_fell"] and sw["loss_fell"] else "no"
        reps = row["rep_ratios"]
        paired = ", ".join(f"{r:.3f}" for r in reps) + (f" ({statistics.median(reps):.3f})" if len(reps) > 1 else "")
        lines.append(f"| {row['layout']} | {titan['tokens_per_s_per_rank']:.0f} | {sw['tokens_per_s_per_rank']:.0f} | "
                     f"**{row['ratio']:.3f}** | {paired} | {step[0]} | {step[1]} | {loss[0]} | {loss[1]} | {fell} |")
    return lines


def report(args: argparse.Namespace, paths: Paths) -> None:
    runs = [read_run(paths.out, system, layout, rep)
            for layout in args.layouts for rep in range(1, args.reps + 1) for system in SYSTEMS]
    rows = [row for layout in args.layouts if (row := summarise(runs, layout, args.discard, args.seq_len))]
    missing = [layout for layout in args.layouts if layout not in {row["layout"] for row in rows}]
    header = (f"shardwise vs torchtitan {TORCHTITAN}, {GLOBAL_BATCH} x {args.seq_len} tokens per step, "
              f"{args.steps} steps (first {args.discard} left out), {args.reps} rep(s), {args.cores} cores; "
              f"tokens/s per rank: median over reps of each run's median, and the ratio of them; per repetition: "
              f"shardwise / torchtitan of the two runs of each repetition (their median); step s: median [IQR] of "
              f"all kept steps; "
              f"loss: first -> last step, median over reps")
    lines = describe_runs(runs, args.discard, args.seq_len) + ["", header, "", *markdown_table(rows)]
    if missing:
        lines += ["", f"no result for {', '.join(missing)}: a run failed, see its log in {paths.out}"]
    print("\n" + "\n".join(lines))
    (paths.out / "summary.md").write_text("\n".join(lines) + "\n")
    print(f"\nwritten to {paths.out / 'summary.md'}")
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        runs_json = [asdict(r) for r in runs]
        args.json.write_text(json.dumps({"settings": settings, "rows": rows, "runs": runs_json}, indent=1))
        print(f"and {args.json}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, choices=list(LAYOUTS))
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each (layout, system) run")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run")
    parser.add_argument("--discard", type=int, default=5, help="steps left out of the timings (warm-up)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--cores", type=int, default=2, help="cores the ranks of a run share: OMP_NUM_THREADS = "
                        "cores / processes")
    parser.add_argument("--no-wait", action="store_true", help="start each run without waiting for an idle machine")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/titan"), help="assets, token cache, logs (out/)")
    parser.add_argument("--titan-venv", type=Path, default=Path("/tmp/venv-titan"),
                        help=f"virtual environment with torch {TORCH} and torchtitan {TORCHTITAN} (made if missing)")
    parser.add_argument("--shardwise-bin", type=Path, default=Path(sys.executable).parent,
                        help="bin folder of the environment shardwise is installed in (default: this python's)")
    parser.add_argument("--parse-only", action="store_true", help="only read the logs already in <work-dir>/out")
    parser.add_argument("--json", type=Path, help="also write the table and every run's steps to this file")
    args = parser.parse_args()
    if args.discard >= args.steps:
        parser.error(f"--discard {args.discard} leaves none of the {args.steps} steps")
    paths = Paths(args.work_dir.resolve(), args.titan_venv.absolute(), args.shardwise_bin.absolute())

    if not args.parse_only:
        ensure_titan_venv(paths.titan_venv)
        prepare_data(paths, args.seq_len)
        check_parameter_counts(paths)
        paths.out.mkdir(parents=True, exist_ok=True)
        for rep in range(1, args.reps + 1):
            for layout in args.layouts:
                for system in SYSTEMS if rep % 2 else reversed(SYSTEMS):  # odd reps torchtitan first
                    run_one(system, layout, rep, args, paths)
    report(args, paths)


if __name__ == "__main__":
    main()
