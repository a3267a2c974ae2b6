"""The GPU checks of issues 15 and 19, as one prepared script for a lent single-GPU machine (the device tool).

The machine has no package registry, torch 2.11 (not the 2.13 this project pins), transformers and peft, and no
torchao: carry torchao's wheel. Here, once:

    mkdir -p .git/info && echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0

then one device run, carry [".whl"], timeout_s 600 (the cases share --budget-s, 540 s):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/gpu_checks.py --out $OUT

Each case is `shardwise plan ... --json --write-config` and then `shardwise train` on the written config, unchanged
but for the number of steps and the run folder, so it also checks that the planner's configs run:
  issue 15  Llama 3 8B (random weights; seq 2048, 8 sequences a step, bf16) with QLoRA and with LoRA (rank 16):
            the run's peak allocated memory (torch.cuda.max_memory_allocated since the process started; the model
            is initialised weight by weight, so its steps set it) against the planner's (its total less the
            allocator's fragmentation and the CUDA context, which that counter does not see), and tokens/s against
            the planner's. The same model cut to 8 blocks in full fine-tuning, LoRA and QLoRA: tokens/s of
            each, and the adapters' against full fine-tuning's.
  issue 19  Llama 3.2 1B (bf16, seq 2048) on one GPU, eager and with each block compiled (train.compile):
            tokens/s and MFU, measured and planned.
  the micro-batch study ("mb" in --only): LoRA on the 8-block 8B model at 1 x 8, the 1B model at 1 x 8 and 8 x 1,
            eager and compiled, the last step of each profiled (metrics.profile_step; <out>/profiles/<case>.txt),
            after the planner's 1 x 8 plans ran at 0.54-0.65 of its tokens/s on an H200 (2026-12-04,
            docs/finetuning.md).
The plan is for the GPU the machine has (the catalogue entry of its name; --gpu overrides). The table goes to
stdout and to <out>/gpu_checks.md, the figures to <out>/gpu_checks.json, the runs' output to <out>/gpu_checks.log;
the table and the JSON are rewritten after each case, so a run stopped at the call's limit keeps what it finished.
A case that fails (a plan that does not fit, a run that errs or times out) is reported as such and the others
still run; each case's time limit is cut to what is left of --budget-s, and once too little is left the rest are
reported as skipped. `--only 8B` and `--only 1B` split the
cases over two calls.

Not here: issue 19's comparison with torchtitan on the GPU is benchmarks/peer_torchtitan_gpu.py (torchtitan 0.2.2:
0.3.0 does not import on torch 2.11), its own call of the same kind; the two do not fit one session's 15 device
minutes together at their default sizes (this one's --only and that one's --cases and --reps cut them down).
On torch 2.11 (PyPI's build, on this CPU, 2026-11-28) this script's --smoke runs, as do shardwise's single-device
paths it uses (LoRA, QLoRA through torchao 0.18, compiled blocks). The unit tests there (`pytest -m "not
multiprocess" --ignore=tests/test_k8s.py` at 6e7689a; the Kubernetes schema packages were not installed): 722
passed, 67 failed, 2 xfailed. The failures: the simulator's pipelines (torch.distributed.pipelining._utils.
InferenceMode is newer), the tests' saved-tensor probe (SelectiveCheckpointContext.op_output is newer; two QLoRA
tests fail only after it, and pass alone), and the planner's pinned operator counts of MoE blocks.

    python benchmarks/gpu_checks.py --smoke --out /tmp/gpu   # the same plumbing on this machine's CPU, small model

Both GPU scripts in one device call: benchmarks/gpu_session.sh (it says what has run and what is left).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PLAN_TIMEOUT_S = 60
CUT = '[model]\nname = "llama3-8b"\nn_layers = 8\n'  # Llama 3 8B's blocks, 8 of its 32
SMOKE_MODEL = ('[model]\nname = "smoke"\ndim = 256\nn_layers = 2\nn_heads = 4\nn_kv_heads = 4\nffn_hidden = 768\n'
               'vocab_size = 512\nmax_seq_len = 256\n')


@dataclass
class Case:
    name: str
    issue: int
    model: str
    """a preset name, or a TOML model description written to a file"""
    plan_flags: list[str]
    steps: int = 6
    discard: int = 2
    """first steps left out of tokens/s (the first carries one-off work; compile's first two, compilation)"""
    timeout_s: int = 240
    baseline: str = ""
    """the case whose tokens/s this one's is set against (full fine-tuning for adapters, eager for compile)"""
    profile: bool = False
    """profile the last step (metrics.profile_step; left out of tokens/s): its operator tables come back as
    <out>/profiles/<case>.txt, host time and device time per operator"""
    result: dict = field(default_factory=dict)


def cases(smoke: bool) -> list[Case]:
    batch = ["--seq-len", "2048", "--global-batch", "8"]
    if smoke:  # a small model on the CPU, its linears whole NF4 blocks: the plumbing only
        batch, small = ["--seq-len", "128", "--global-batch", "4"], SMOKE_MODEL
        return [Case("small, full FT", 15, small, batch, steps=3, discard=1),
                Case("small, QLoRA r8", 15, small, ["--lora-rank", "8", "--qlora", *batch], steps=3, discard=1,
                     baseline="small, full FT"),
                Case("small, compiled blocks", 19, small, ["--compile", *batch], steps=3, discard=1,
                     baseline="small, full FT"),
                Case("small, mb 2 x 2", 19, small, ["--plan", "micro_batch=2", *batch], steps=4, discard=1,
                     profile=True)]
    return [
        Case("8B QLoRA r16", 15, "llama3-8b", ["--lora-rank", "16", "--qlora", *batch]),
        Case("8B LoRA r16", 15, "llama3-8b", ["--lora-rank", "16", *batch]),
        Case("8B cut to 8 blocks, full FT", 15, CUT, batch),
        Case("8B cut to 8 blocks, LoRA r16", 15, CUT, ["--lora-rank", "16", *batch],
             baseline="8B cut to 8 blocks, full FT"),
        Case("8B cut to 8 blocks, QLoRA r16", 15, CUT, ["--lora-rank", "16", "--qlora", *batch],
             baseline="8B cut to 8 blocks, full FT"),
        Case("1B eager", 19, "llama3.2-1b", batch),
        Case("1B compiled blocks", 19, "llama3.2-1b", ["--compile", *batch], steps=8, discard=4, timeout_s=420,
             baseline="1B eager"),
        # the micro-batch study (2026-12-04: the planner prices 1 x 8 and 8 x 1 alike, the GPU ran the planner's
        # 1 x 8 at 0.54-0.65 of its tokens/s and 8 x 1 at 0.80-0.88): where each one's step goes, host and device.
        # Full fine-tuning's gap was since priced (whole-weight traffic); LoRA's at 1 x 8 (0.60-0.65) was not
        Case("8B cut to 8 blocks, LoRA r16, mb 1 x 8", 15, CUT, ["--lora-rank", "16", "--plan", "micro_batch=1",
                                                              *batch], steps=7, profile=True),
        Case("1B eager, mb 1 x 8", 19, "llama3.2-1b", ["--plan", "micro_batch=1", *batch], steps=7, profile=True),
        Case("1B eager, mb 8 x 1", 19, "llama3.2-1b", ["--plan", "micro_batch=8", *batch], steps=7, profile=True,
             baseline="1B eager, mb 1 x 8"),
        Case("1B compiled blocks, mb 8 x 1", 19, "llama3.2-1b", ["--compile", "--plan", "micro_batch=8", *batch],
             steps=9, discard=4, timeout_s=420, profile=True, baseline="1B eager, mb 8 x 1"),
    ]


def run(cmd: list[str], log, timeout_s: int) -> subprocess.CompletedProcess:
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:  # what it printed is what tells why
        log.write(f"{_text(e.stdout)[-20000:]}{_text(e.stderr)[-20000:]}\n(timed out after {timeout_s} s)\n")
        log.flush()
        raise
    log.write(out.stdout[-20000:] + out.stderr[-20000:])
    log.flush()
    return out


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def measure(case: Case, work: Path, gpu: str, log, out: Path) -> dict:
    """Plan the case, write its config, train it; the planner's figures beside the run's."""
    model = case.model
    if "\n" in model:
        model_file = work / "model.toml"
        model_file.write_text(model)
        model = str(model_file)
    config, run_dir = work / "config.toml", work / "run"
    planned = run([sys.executable, "-m", "shardwise", "plan", "--model", model, "--gpus", "1", "--gpu", gpu,
                   *case.plan_flags, "--json", "--write-config", str(config)], log, PLAN_TIMEOUT_S)
    if planned.returncode != 0:
        return {"error": "plan: " + (planned.stderr.strip().splitlines() or ["?"])[-1]}
    best = json.loads(planned.stdout)["plans"][0]
    if not best["fits"]:
        return {"error": f"plan: no plan fits ({best['memory_gib']['total']:.1f} GiB)", "plan": best}
    memory = best["memory_gib"]
    started = time.time()
    profile = ["--set", f"metrics.profile_step={case.steps}"] if case.profile else []
    trained = run([sys.executable, "-m", "shardwise", "train", "--config", str(config),
                   "--set", f"train.steps={case.steps}", "--set", "train.val_every=0",
                   "--set", f"metrics.out_dir='{run_dir}'", "--set", "metrics.log_every=1",
                   "--set", "metrics.tensorboard=false", *profile], log, case.timeout_s)
    if trained.returncode != 0:
        return {"error": "train: " + (trained.stderr.strip().splitlines() or ["?"])[-1], "plan": best}
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "tokens_per_s" in s]
    if not steps:
        return {"error": "train: no step logged tokens/s", "plan": best}
    kept = steps[case.discard:-1 if case.profile else None] or steps  # a profiled step runs slower
    if case.profile and (run_dir / "profile" / "rank0.txt").exists():
        (out / "profiles").mkdir(exist_ok=True)
        shutil.copy(run_dir / "profile" / "rank0.txt", out / "profiles" / f"{slug(case.name)}.txt")
    result = {
        "plan": {k: best[k] for k in ("micro_batch", "grad_accum", "activation_checkpoint", "offload", "zero_stage")},
        "planned_allocated_gib": memory["total"] - memory["fragmentation"] - memory["fixed_overhead"],
        "planned_total_gib": memory["total"],
        "peak_allocated_gib": max(s["peak_memory_gib"] for s in steps),
        "planned_tokens_per_s": best["tokens_per_s"],
        "tokens_per_s": statistics.median(s["tokens_per_s"] for s in kept),
        "planned_mfu": best["mfu"],
        "mfu": statistics.median(s["mfu"] for s in kept) if all("mfu" in s for s in kept) else None,
        "losses": [round(steps[0]["loss"], 4), round(steps[-1]["loss"], 4)],
        "steps": len(steps), "steps_kept": len(kept),  # equal: too few steps to leave any out
        "wall_s": round(time.time() - started, 1),
    }
    return result


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def table(done: list[Case]) -> str:
    rows = ["| case | issue | plan (mb x accum, recompute) | peak allocated GiB (planned) | measured / planned "
            "| tokens/s (planned) | measured / planned | MFU (planned) | loss first -> last "
            "| tokens/s against another case |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    speed = {c.name: (c.result["tokens_per_s"], c.result["planned_tokens_per_s"]) for c in done
             if "tokens_per_s" in c.result}
    for c in done:
        r = c.result
        if "error" in r:
            error = r["error"][:160].replace("|", "/")
            rows.append(f"| {c.name} | {c.issue} | failed: {error} |" + " |" * 7)
            continue
        p = r["plan"]
        base = speed.get(c.baseline)
        vs_base = (f"{r['tokens_per_s'] / base[0]:.2f} (planned {r['planned_tokens_per_s'] / base[1]:.2f}), "
                   f"against {c.baseline}" if base else "")
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        rows.append(
            f"| {c.name} | {c.issue} | {p['micro_batch']} x {p['grad_accum']}, {p['activation_checkpoint']} "
            f"| {r['peak_allocated_gib']:.1f} ({r['planned_allocated_gib']:.1f}) "
            f"| **{r['peak_allocated_gib'] / r['planned_allocated_gib']:.3f}** "
            f"| {r['tokens_per_s']:,.0f} ({r['planned_tokens_per_s']:,.0f}) "
            f"| **{r['tokens_per_s'] / r['planned_tokens_per_s']:.3f}** | {mfu} ({r['planned_mfu']:.1%}) "
            f"| {r['losses'][0]} -> {r['losses'][1]} | {vs_base} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the table, the figures and the log")
    parser.add_argument("--gpu", help="the catalogue entry to plan for (default: the machine's GPU, else h100)")
    parser.add_argument("--smoke", action="store_true", help="a small model on the CPU: checks the plumbing")
    parser.add_argument("--only", nargs="*", help="run only the cases whose names contain one of these")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="seconds for all cases: each case's limit is cut to what is left (default 540)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    from shardwise.hardware import detect_accelerator

    gpu = args.gpu or (detect_accelerator(torch.device("cuda")) if torch.cuda.is_available() else None) or "h100"
    header = (f"torch {torch.__version__}, "
              + (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU: CPU")
              + f"; planned for the catalogue's {gpu}")
    print(header, flush=True)
    started, done = time.time(), []
    with open(args.out / "gpu_checks.log", "w") as log:
        for case in cases(args.smoke):
            if args.only and not any(o in case.name for o in args.only):
                continue
            # each case's limit is cut to what is left of the budget; one with too little left is not started
            case.timeout_s = min(case.timeout_s, int(args.budget_s - (time.time() - started)) - PLAN_TIMEOUT_S)
            if case.timeout_s < 30:
                case.result = {"error": f"skipped: --budget-s {args.budget_s:.0f} spent"}
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    try:
                        case.result = measure(case, Path(tmp), gpu, log, args.out)
                    except subprocess.TimeoutExpired as e:
                        case.result = {"error": f"timed out after {e.timeout:.0f} s"}
                    except Exception as e:  # one case's failure is its row; the others still run
                        case.result = {"error": f"{type(e).__name__}: {e}"}
            print(case.name, json.dumps(case.result), flush=True)
            done.append(case)
            # what is done so far is kept, whatever stops the script later
            (args.out / "gpu_checks.json").write_text(
                json.dumps({"header": header, "cases": {c.name: c.result for c in done}}, indent=1))
            (args.out / "gpu_checks.md").write_text(f"{header}\n\n{table(done)}\n")
    print("\n" + (args.out / "gpu_checks.md").read_text())


if __name__ == "__main__":
    main()
