"""The whole job a user runs, through the CLI, on one layout of each family.

Each feature has its own tests elsewhere; these catch what breaks where features meet (a validation pass under
ZeRO-3 once left FSDP's root unsharded, and the save that followed it failed). One job per layout turns on
everything at once: validation and checkpoints every 2 steps, logging to JSONL and TensorBoard, the sample log,
gradient accumulation, activation checkpointing, and bf16 where it meets a parallelism. It runs 4 steps (step 4
validates, then saves: the final save), then resumes from step 4 with more steps to go and is stopped mid-run by
SIGTERM, which must save and exit 0. The checkpoint the SIGTERM left is then loaded onto one device, checked as any
resume checks it.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.checkpoint import TrainState, load, scan_checkpoints
from shardwise.config import load_config
from shardwise.model import build_model, materialize

CONFIG = str(Path(__file__).parent / "configs" / "parity.toml")
JOB = ["train.val_every=2", "train.val_batches=2", "checkpoint.enabled=true", "checkpoint.every=2",
       "metrics.log_every=1", "metrics.tensorboard=true", "metrics.log_samples=true", "train.micro_batch=4",
       "train.grad_accum=2"]
FULL, SELECTIVE = "parallel.activation_checkpoint='full'", "parallel.activation_checkpoint='selective'"
BF16 = "train.precision='bf16'"  # where autocast meets DTensor, ring attention or the pipeline (~1.5 s a run here)

# (processes, settings): one representative of each family; HSDP runs ZeRO-2 so that stage is here too
LAYOUTS = {
    "one-device": (1, [FULL, BF16]),
    "ddp": (2, [SELECTIVE]),
    "zero1": (2, ["parallel.zero_stage=1", FULL]),
    "fsdp": (2, ["parallel.dp_shard=2", "parallel.zero_stage=3", FULL, BF16]),
    "hsdp-zero2": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.zero_stage=2", SELECTIVE]),
    "tp-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", SELECTIVE, BF16]),
    "pp": (2, ["parallel.pp=2", "parallel.pp_schedule='1f1b'", FULL]),
    "cp": (2, ["parallel.cp=2", FULL, BF16]),
    "3d": (8, ["parallel.dp_shard=2", "parallel.zero_stage=3", "parallel.tp=2", "parallel.sequence_parallel=true",
               "parallel.pp=2", FULL, BF16]),
}


def _command(out: Path, steps: int, nproc: int, settings: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "shardwise", "train", "--config", CONFIG, f"--set=metrics.out_dir='{out}'",
           f"--set=train.steps={steps}", *[f"--set={s}" for s in JOB + settings]]
    return cmd + (["--nproc", str(nproc)] if nproc > 1 else [])


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(out) if "loss" in r}


def _complete_steps(out: Path) -> list[int]:
    scan = scan_checkpoints(out)
    assert not scan.partial, f"partial checkpoints left: {scan.partial}"
    return [step for step, _ in scan.complete]


def _run_until_sigterm(cmd: list[str], out: Path, after_step: int) -> subprocess.CompletedProcess:
    """Start the job, send SIGTERM to the command (as a scheduler does) once a step past `after_step` is logged."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while max(_losses(out), default=0) <= after_step:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                stdout, stderr = proc.communicate()
                pytest.fail(f"the job ended (or hung) before step {after_step + 1}:\n{stderr[-3000:]}")
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _load_on_one_device(out: Path, step: int) -> None:
    """Load the checkpoint's weights into a one-device model, through every check a resume makes."""
    cfg = load_config(CONFIG, [])
    model = build_model(cfg.model)
    materialize(model, cfg.model, "cpu", seed=1)
    assert load(out / "checkpoints" / f"step_{step}", TrainState([model]), cfg.model) == step


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_whole_job_saves_after_validation_resumes_and_stops_on_sigterm(tmp_path, layout):
    nproc, settings = LAYOUTS[layout]
    out = tmp_path / "run"

    first = subprocess.run(_command(out, 4, nproc, settings), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert _complete_steps(out) == [2, 4]
    assert [r["step"] for r in _rows(out) if "val_loss" in r] == [2, 4]
    assert list((out / "tb").iterdir()), "no TensorBoard events written"

    second = _run_until_sigterm(_command(out, 10_000, nproc, settings), out, after_step=4)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed after step 4" in second.stdout
    assert "stopped as asked" in second.stdout
    losses = _losses(out)
    stopped = max(losses)
    assert stopped > 4 and sorted(losses) == list(range(1, stopped + 1))
    assert all(math.isfinite(v) for v in losses.values())
    assert _complete_steps(out)[-1] == stopped
    _load_on_one_device(out, stopped)
