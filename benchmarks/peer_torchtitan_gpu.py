"""shardwise against torchtitan 0.2.2 on one GPU: Llama 3.2 1B's shape, bf16, eager and with compiled blocks.

The GPU side of the torchtitan comparison (benchmarks/peer_torchtitan.py is the CPU side), prepared for a lent
single-GPU machine (the device tool): torch 2.11, no package registry, no network.

What it measures. Both systems train the same model: Llama 3.2 1B's shape (dim 2048, 16 blocks, 32 heads, 8 KV
heads, SwiGLU inner size 8192, vocabulary 128,256, rope theta 5e5) with an untied output head, as torchtitan's
llama3 model always has one (1,498,482,688 parameters; the table marks a run whose count differs MISMATCH). Each step
is 8 sequences x 2048 tokens (torchtitan --training.local_batch_size 8, shardwise train.micro_batch 8, no
accumulation), no activation checkpointing, AdamW (both use torch's fused kernel), gradient clipping at 1.0, on the
same tokenizer and corpus (peer_torchtitan/prep_data.py: a 2,048-token BPE over the standard library's *.py files;
the ids index the first rows of the 128,256-row embedding and head, every row still in each matmul).
  bf16. torchtitan 0.2.2 on one GPU does not shard (data_parallel_shard_degree -1 resolves to 1), so its
    mixed_precision_param = bfloat16 takes effect as torch.autocast(bf16) around the forward and the loss
    (torchtitan.distributed.utils.maybe_enable_amp: "Mixed precision training is handled by AMP"), with fp32
    weights, gradients and optimizer state. shardwise's equivalent is train.precision = 'bf16' with
    parallel.mixed_precision = 'autocast' (its default): bf16 autocast, fp32 master weights.
  Cases. eager; compile: each transformer block compiled with torch.compile (torchtitan --compile.enable
    --compile.components model, which compiles each block with fullgraph=True; shardwise train.compile).
  Order. Repetition r runs eager then compile, each case torchtitan first on odd r and shardwise first on even r,
    every run a fresh process. The first --discard steps of a run are left out (compilation, allocator warm-up);
    tokens/s of a run is the median of its kept steps, of a system in a case the median over repetitions.
  MFU. tokens/s x FLOPs per token / the GPU's bf16 dense peak, the same formula for both:
    FLOPs/token = 6 N + 12 L d s (shardwise.model_args.flops_per_token), N the weights in matmuls (every linear
    and the output head: not the embedding lookup nor the norms) = 1,235,746,816, L = 16, d = 2048, s = 2048: 8.22
    GFLOP per token. The peak is shardwise's catalogue entry for the machine's GPU (H200: 989.4 TFLOP/s, the SXM
    datasheet's dense bf16; --peak-tflops overrides). torchtitan's own logged MFU (its N also counts the norms,
    its peak from lspci or the device name) is not used.
  Timing. Each system's own per-step clock: torchtitan's tps (tokens since the last log over the wall time since
    it, log every step, a .item() of the loss in it), shardwise's metrics.jsonl tokens_per_s (log_every 1, the
    loss also read back each step); both include fetching the batch.
  Not the same in the two (left as each system does it): the initialisation, the learning-rate schedule after
    its 2 warm-up steps, rope scaling (torchtitan 0.2.2 applies Llama 3.1's, factor 8; shardwise the llama3.2-1b
    preset's, Llama 3.2's factor 32: the same work), the loss
    (torchtitan writes the fp32 logits of the whole batch, shardwise fuses the head with the loss, block by
    block), and the memory figure (torchtitan logs the allocator's max reserved, shardwise max allocated).

Output. <out>/peer_torchtitan_gpu.md (a table per case: tokens/s of each, shardwise / torchtitan and per
repetition, MFU of each, step time, first -> last loss of each, peak memory), <out>/peer_torchtitan_gpu.json (the
same and every run's steps), <out>/logs/<run>.log; both rewritten after every run, so a call stopped at its limit
keeps what finished. A run that fails or times out is its cell in the table and the others still run; a run is
started only while --budget-s leaves it its estimate (RUN_ESTIMATE_S), else reported as skipped.

The device machine has torch 2.11, triton 3.6, tokenizers, tensorboard, einops, pillow, fsspec, pyarrow, pandas,
xxhash, requests, httpx, huggingface-hub, pyyaml and tqdm; torchtitan 0.2.2 and what it needs beyond those are
carried as wheels (1.6 MiB in all; multiprocess's wheel is per Python version, the machine's is 3.12). torchtitan
0.3.0 cannot be used there: it imports DataParallelMeshDims from torch.distributed.fsdp, which torch 2.11 lacks.
Here, once:

    mkdir -p .git/info && echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 -d .whl torchtitan==0.2.2 torchdata==0.11.0 datasets==4.7.0 \\
        dill==0.4.0 multiprocess==0.70.18 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1

(.whl may also hold gpu_checks.py's torchao wheel: --no-deps installs it too, unused here), then one device run,
carry [".whl"], timeout_s 600 (the runs share --budget-s, 480 s, which leaves the call's start and end a margin):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/peer_torchtitan_gpu.py --out $OUT

Takes (estimated, not measured on the GPU): preparing the data ~20-60 s (the tokenizer trained, shardwise's
token cache written; torchtitan's dataset is read through `datasets`, which caches it at its first run), an eager
run ~30-60 s (start-up and 30 steps of ~0.3 s), a compiled run ~60-150 s (inductor compiles one block's forward
and backward; a system's second compiled run finds them in inductor's cache). 2 repetitions x 2 cases x 2
systems = 8 runs; if the budget runs out, the second repetition's last runs are the ones skipped.

On this CPU (torch 2.11, torchtitan 0.2.2 from --target folders on PYTHONPATH) the same plumbing with a 1.5M-
parameter model, 8 steps of 2 x 128 tokens, a nominal 1 TFLOP/s peak for the MFU column (made up: plumbing only):

    PYTHONPATH=$PWD:<torchtitan 0.2.2 and its deps> python benchmarks/peer_torchtitan_gpu.py --smoke --out /tmp/ptg

Both GPU scripts in one device call, 8B cases first: benchmarks/gpu_session.sh.
"""

from __future__ import annotations

import argparse
import dataclasses
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
ROOT = HERE.parent.parent
SYSTEMS = ("titan", "sw")
NAMES = {"titan": "torchtitan", "sw": "shardwise"}
CASES = ("eager", "compile")
RUN_ESTIMATE_S = {"eager": 60, "compile": 100}
"""Seconds a run is given at least: one is not started unless the budget has this much left. On an H200
(2026-12-04) an eager run took 36-39 s and torchtitan's compiled one 50 s; 180 s for a compiled run skipped
shardwise's with 145 s left."""
RUN_CAP_S = {"eager": 240, "compile": 420}
"""A run's own time limit, before the budget cuts it."""


@dataclass(frozen=True)
class Shape:
    """The model (as torchtitan's flavor in peer_torchtitan/gpu_launch.py and as shardwise's model table: the two
    must describe the same network, which the parameter counts check) and the run's sizes."""

    flavor: str
    model_toml: str
    batch: int
    seq_len: int
    steps: int
    discard: int


FULL = Shape("1B", '[model]\nname = "llama3.2-1b"\ndim = 2048\nn_layers = 16\nn_heads = 32\nn_kv_heads = 8\n'
             'ffn_hidden = 8192\nvocab_size = 128256\nrope_theta = 500000.0\nmax_seq_len = 2048\n'
             'tie_embeddings = false\n', batch=8, seq_len=2048, steps=30, discard=10)
SMOKE = Shape("smoke", '[model]\nname = "smoke"\ndim = 128\nn_layers = 2\nn_heads = 4\nn_kv_heads = 2\n'
              'ffn_hidden = 512\nvocab_size = 4096\nrope_theta = 500000.0\nmax_seq_len = 128\n'
              'tie_embeddings = false\n', batch=2, seq_len=128, steps=8, discard=2)

# the rest of the shardwise job: torchtitan 0.2.2's defaults where they matter to a step (AdamW lr 8e-4, weight
# decay 0.1, eps 1e-8, clipping 1.0), 2 warm-up steps as torchtitan is given
SW_JOB = """
[data]
tokenizer = {tokenizer}
cache_dir = {cache}
seq_len = {seq_len}

[optim]
lr = 8e-4
warmup_steps = 2
weight_decay = 0.1
grad_clip = 1.0

[train]
micro_batch = {batch}
val_every = 0
precision = "bf16"

[metrics]
log_every = 1
tensorboard = false
progress = false
"""


@dataclass
class Run:
    """One run of one system in one case: its steps (1-based) and what went wrong, if anything."""

    system: str
    case: str
    rep: int
    tps: dict[int, float] = field(default_factory=dict)
    loss: dict[int, float] = field(default_factory=dict)
    memory_gib: float | None = None
    params: int | None = None
    error: str = ""
    wall_s: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.system}_{self.case}_r{self.rep}"

    def kept(self, discard: int) -> list[float]:
        return [tps for step, tps in sorted(self.tps.items()) if step > discard]


# ---------------------------------------------------------------------------------------------------
# Set-up


def device_facts(peak_tflops: float | None) -> dict:
    """The GPU's name, its bf16 dense peak from shardwise's catalogue, the versions; in a child process, so that
    this one holds no CUDA context while the runs use the GPU."""
    probe = ("import json, torch\nfrom importlib.metadata import PackageNotFoundError, version\n"
             "try:\n    titan = version('torchtitan')\nexcept PackageNotFoundError:\n    titan = 'not installed'\n"
             "from shardwise.hardware import accelerator, detect_accelerator\n"
             "cuda = torch.cuda.is_available()\nname = detect_accelerator(torch.device('cuda')) if cuda else None\n"
             "print(json.dumps({'device': torch.cuda.get_device_name(0) if cuda else 'CPU', 'catalogue': name,\n"
             "  'peak_flops': accelerator(name).peak('bf16') if name else None, 'torch': torch.__version__,\n"
             "  'torchtitan': titan}))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"probing the device failed:\n{done.stderr[-3000:]}")
    facts = json.loads(done.stdout.splitlines()[-1])
    if peak_tflops:
        facts["peak_flops"], facts["catalogue"] = peak_tflops * 1e12, f"--peak-tflops {peak_tflops}"
    return facts


def prepare(work: Path, shape: Shape, log) -> Path:
    """The shared tokenizer and corpus (torchtitan reads them as ./tests/assets), shardwise's job file and its
    token cache; returns the job file."""
    assets = work / "run" / "tests" / "assets"
    config = work / "sw_job.toml"
    config.write_text(shape.model_toml + SW_JOB.format(
        tokenizer=json.dumps(str(assets / "tokenizer" / "tokenizer.json")), cache=json.dumps(str(work / "sw_cache")),
        seq_len=shape.seq_len, batch=shape.batch))
    cmd = [sys.executable, str(HERE / "prep_data.py"), str(assets), str(config)]
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    return config


def planned_figures(config: Path, seq_len: int) -> tuple[int, float]:
    """shardwise's parameter count and FLOPs per token (6 N + 12 L d s) of the job's model, from its shape."""
    from shardwise.config import load_config
    from shardwise.model_args import flops_per_token, num_params

    model = load_config(config).model
    return num_params(model), flops_per_token(model, seq_len)


# ---------------------------------------------------------------------------------------------------
# One run


def titan_command(shape: Shape, case: str, steps: int, dump: Path, cpu: bool) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        str(HERE / "gpu_launch.py"), *(["--cpu"] if cpu else []),
        "--model.name", "llama3", "--model.flavor", shape.flavor,
        "--training.local_batch_size", str(shape.batch), "--training.seq_len", str(shape.seq_len),
        "--training.steps", str(steps), "--training.mixed_precision_param", "bfloat16",
        "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.disable_color_printing",
        "--activation_checkpoint.mode", "none",  # its default is selective recompute; shardwise's is none
        "--debug.seed", "42", "--job.dump_folder", str(dump),
        *(["--compile.enable", "--compile.components", "model"] if case == "compile" else []),
    ]


def shardwise_command(config: Path, case: str, steps: int, out_dir: Path) -> list[str]:
    sets = [f"train.steps={steps}", f"train.compile={'true' if case == 'compile' else 'false'}",
            f"metrics.out_dir={json.dumps(str(out_dir))}"]
    return [sys.executable, "-m", "shardwise", "train", "--config", str(config),
            *(arg for s in sets for arg in ("--set", s))]


def run_logged(cmd: list[str], log: Path, cwd: Path, env: dict[str, str], timeout_s: float) -> tuple[int, bool]:
    """(exit status, timed out): cmd's output in log, its whole process group (torchrun and the trainer) killed
    past the timeout."""
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(), True


ANSI = re.compile(r"\x1b\[[0-9;]*m")
TITAN_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*(-?[\d.]+).*?memory:\s*(-?[\d.]+)GiB.*?tps:\s*([\d,]+)")
TITAN_PARAMS = re.compile(r"size:\s*([\d,]+) total parameters")


def read_titan(run: Run, log: Path) -> None:
    for line in log.read_text(errors="replace").splitlines():
        line = ANSI.sub("", line)
        if match := TITAN_STEP.search(line):
            step = int(match[1])
            run.loss[step], run.tps[step] = float(match[2]), float(match[4].replace(",", ""))
            run.memory_gib = max(run.memory_gib or 0.0, float(match[3]))
        elif match := TITAN_PARAMS.search(line):
            run.params = int(match[1].replace(",", ""))


def read_shardwise(run: Run, metrics: Path, params: int) -> None:
    run.params = params  # the job's own count (its model is built from the same ModelArgs)
    if not metrics.exists():
        return
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        if "tokens_per_s" in row:
            run.tps[row["step"]], run.loss[row["step"]] = row["tokens_per_s"], row["loss"]
            run.memory_gib = max(run.memory_gib or 0.0, row["peak_memory_gib"])


def last_error(log: Path) -> str:
    """The line of the log that says why a run failed: the last one naming an error, else the last line."""
    lines = [ANSI.sub("", x).strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    errors = [x for x in lines if re.search(r"(^\w*(Error|Exception)\b|error:|Killed|out of memory)", x)]
    return (errors or lines or ["no output"])[-1][:300]


def run_one(run: Run, shape: Shape, work: Path, out: Path, config: Path, params: int, timeout_s: float,
            cpu: bool) -> None:
    """Run one system in one case and read its steps back into `run`."""
    log = out / "logs" / f"{run.name}.log"
    # the machine has no network: the hub's clients are not to look for anything (the data are local files)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if run.system == "titan":
        dump = work / "dumps" / run.name
        shutil.rmtree(dump, ignore_errors=True)
        cmd = titan_command(shape, run.case, shape.steps, dump, cpu)
    else:
        metrics = work / "sw_runs" / run.name
        shutil.rmtree(metrics, ignore_errors=True)  # shardwise appends to an existing metrics.jsonl
        cmd = shardwise_command(config, run.case, shape.steps, metrics)
    started = time.perf_counter()
    rc, timed_out = run_logged(cmd, log, work / "run", env, timeout_s)
    run.wall_s = round(time.perf_counter() - started, 1)
    if run.system == "titan":
        read_titan(run, log)
    else:
        read_shardwise(run, work / "sw_runs" / run.name / "metrics.jsonl", params)
    if timed_out:
        run.error = f"timed out after {timeout_s:.0f} s ({len(run.tps)} steps logged)"
    elif rc != 0:
        run.error = f"rc {rc}: {last_error(log)}"
    elif len(run.kept(shape.discard)) == 0:
        run.error = f"no step after the first {shape.discard} logged: {last_error(log)}"


# ---------------------------------------------------------------------------------------------------
# The table


def summarise(runs: list[Run], case: str, shape: Shape, flops: float, peak: float | None, params: int) -> dict:
    """One case's figures per system (None where no run of it worked) and their ratio."""
    row: dict = {"case": case}
    discard, tokens_per_step = shape.discard, shape.batch * shape.seq_len
    for system in SYSTEMS:
        mine = [r for r in runs if r.system == system and r.case == case]
        ok = [r for r in mine if not r.error]
        if not ok:
            row[system] = {"error": "; ".join(f"r{r.rep}: {r.error}" for r in mine) or "not run"}
            continue
        tps = statistics.median(statistics.median(r.kept(discard)) for r in ok)
        row[system] = {
            "reps": len(ok), "tokens_per_s": tps, "mfu": tps * flops / peak if peak else None,
            "step_s": statistics.median(tokens_per_step / t for r in ok for t in r.kept(discard)),
            "first_loss": statistics.median(r.loss[min(r.loss)] for r in ok),
            "last_loss": statistics.median(r.loss[max(r.loss)] for r in ok),
            "loss_fell": all(r.loss[max(r.loss)] < r.loss[min(r.loss)] for r in ok),
            "memory_gib": max(r.memory_gib or 0.0 for r in ok),
            "params": sorted({r.params for r in ok}, key=str), "params_match": all(r.params == params for r in ok),
            "failed_reps": [f"r{r.rep}: {r.error}" for r in mine if r.error],
        }
    if "tokens_per_s" in row["titan"] and "tokens_per_s" in row["sw"]:
        row["ratio"] = row["sw"]["tokens_per_s"] / row["titan"]["tokens_per_s"]
        by_rep = {s: {r.rep: statistics.median(r.kept(discard)) for r in runs if r.system == s and r.case == case
                      and not r.error} for s in SYSTEMS}
        row["rep_ratios"] = [by_rep["sw"][k] / by_rep["titan"][k] for k in sorted(by_rep["sw"]) if k in by_rep["titan"]]
    return row


def markdown(rows: list[dict]) -> list[str]:
    lines = ["| case | system | tokens/s | shardwise / torchtitan (per repetition) | MFU | step s | "
             "loss first -> last | peak memory GiB | parameters |", "|---|---|---:|---|---:|---:|---|---:|---|"]
    for row in rows:
        for system in SYSTEMS:
            s = row[system]
            if "error" in s:
                lines.append(f"| {row['case']} | {NAMES[system]} | no result: {s['error'][:200].replace('|', '/')} |"
                             + " |" * 6)
                continue
            ratio = ""
            if system == "sw" and "ratio" in row:
                ratio = f"**{row['ratio']:.3f}** ({', '.join(f'{r:.3f}' for r in row['rep_ratios'])})"
            mfu = f"{s['mfu']:.1%}" if s["mfu"] is not None else "-"
            fell = "" if s["loss_fell"] else " (did not fall)"
            params = ", ".join(f"{p:,}" if p else "?" for p in s["params"]) + ("" if s["params_match"] else " MISMATCH")
            failed = f" ({len(s['failed_reps'])} rep(s) failed)" if s["failed_reps"] else ""
            lines.append(f"| {row['case']} | {NAMES[system]} | {s['tokens_per_s']:,.0f}{failed} | {ratio} | {mfu} | "
                         f"{s['step_s']:.3f} | {s['first_loss']:.3f} -> {s['last_loss']:.3f}{fell} | "
                         f"{s['memory_gib']:.1f} | {params} |")
    return lines


def write_report(out: Path, header: str, facts: dict, settings: dict, runs: list[Run], shape: Shape, flops: float,
                 params: int) -> str:
    rows = [summarise(runs, case, shape, flops, facts["peak_flops"], params) for case in settings["cases"]]
    text = "\n".join([header, "", *markdown(rows)]) + "\n"
    (out / "peer_torchtitan_gpu.md").write_text(text)
    (out / "peer_torchtitan_gpu.json").write_text(json.dumps(
        {"header": header, "device": facts, "settings": settings, "flops_per_token": flops, "params": params,
         "rows": rows, "runs": [asdict(r) for r in runs]}, indent=1))
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the table, the figures and the logs")
    parser.add_argument("--smoke", action="store_true", help="a small model on the CPU: checks the plumbing")
    parser.add_argument("--reps", type=int, default=2, help="repetitions of each (case, system) run")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for the data and all runs")
    parser.add_argument("--peak-tflops", type=float, help="bf16 dense peak for MFU (default: the catalogue's)")
    parser.add_argument("--batch", type=int, help=f"sequences per step (default {FULL.batch}; smoke {SMOKE.batch})")
    parser.add_argument("--steps", type=int, help=f"steps per run (default {FULL.steps}; smoke {SMOKE.steps})")
    parser.add_argument("--discard", type=int, help=f"first steps left out (default {FULL.discard}; smoke "
                        f"{SMOKE.discard})")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/peer_torchtitan_gpu"),
                        help="assets, token cache, run folders")
    args = parser.parse_args()
    started = time.time()
    shape = SMOKE if args.smoke else FULL
    shape = dataclasses.replace(shape, **{k: v for k in ("batch", "steps", "discard") if (v := getattr(args, k))})
    if shape.discard >= shape.steps:
        parser.error(f"--discard {shape.discard} leaves none of the {shape.steps} steps")
    out, work = args.out.resolve(), args.work_dir.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (work / "run").mkdir(parents=True, exist_ok=True)
    facts = device_facts(args.peak_tflops or (1.0 if args.smoke else None))
    with open(out / "logs" / "prepare.log", "w") as log:
        try:
            config = prepare(work, shape, log)
        except subprocess.CalledProcessError as e:  # nothing can run without the data: say so where results go
            (out / "peer_torchtitan_gpu.md").write_text(f"preparing the data failed ({e}): see logs/prepare.log\n")
            sys.exit(f"preparing the data failed ({e}): see {out / 'logs' / 'prepare.log'}")
    params, flops = planned_figures(config, shape.seq_len)
    peak = f"{facts['peak_flops'] / 1e12:.1f} TFLOP/s ({facts['catalogue']})" if facts["peak_flops"] else "unknown"
    header = (f"shardwise vs torchtitan {facts['torchtitan']} on {facts['device']}, torch {facts['torch']}: model "
              f"{shape.flavor} ({params:,} parameters), {shape.batch} x {shape.seq_len} tokens per step, bf16 "
              f"autocast, {shape.steps} steps of which the first {shape.discard} are left out; tokens/s: median over "
              f"repetitions of each run's median step; MFU: tokens/s x {flops / 1e9:.3f} GFLOP/token (6 N + 12 L d "
              f"s) / bf16 dense peak {peak}; data prepared in {time.time() - started:.0f} s")
    print(header, flush=True)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | asdict(shape)
    runs: list[Run] = []
    for rep in range(1, args.reps + 1):
        for case in args.cases:
            for system in SYSTEMS if rep % 2 else reversed(SYSTEMS):  # odd repetitions torchtitan first
                run = Run(system, case, rep)
                left = args.budget_s - (time.time() - started)
                if left < RUN_ESTIMATE_S[case]:
                    run.error = f"skipped: {left:.0f} s of --budget-s {args.budget_s:.0f} left"
                else:
                    try:
                        run_one(run, shape, work, out, config, params, min(RUN_CAP_S[case], left), args.smoke)
                    except Exception as e:  # one run's failure is its cell; the others still run
                        run.error = f"{type(e).__name__}: {e}"
                runs.append(run)
                kept = run.kept(shape.discard)
                print(f"[{time.time() - started:5.0f} s] {run.name}: "
                      + (run.error or f"{statistics.median(kept):,.0f} tokens/s, {run.wall_s} s"), flush=True)
                text = write_report(out, header, facts, settings, runs, shape, flops, params)
    print("\n" + text)


if __name__ == "__main__":
    main()
