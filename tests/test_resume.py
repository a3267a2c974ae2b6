"""The training loop with checkpoints: exact resume, SIGTERM, non-finite steps."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from shardwise.metrics import read_sample_log

CONFIG = str(Path(__file__).parent / "configs" / "parity.toml")


def _train(out, steps, *extra, nproc=1, popen=False, launcher=()):
    cmd = [sys.executable, "-m", "shardwise", "train", "--config", CONFIG, f"--set=metrics.out_dir='{out}'",
           f"--set=train.steps={steps}", "--set=checkpoint.enabled=true", "--set=checkpoint.every=2",
           "--set=metrics.log_every=1", "--set=train.val_every=0", "--set=metrics.tensorboard=false",
           *[f"--set={e}" for e in extra], "--save-final", str(Path(out) / "final.safetensors")]
    if nproc > 1:
        cmd += ["--nproc", str(nproc), *launcher]
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@contextlib.contextmanager
def _reaped(proc):
    """Kill what is left of a run started with popen=True (the launcher, torchrun and its workers) on the way out."""
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _losses(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _params(out):
    return load_file(Path(out) / "final.safetensors")


FSDP2 = ["parallel.dp_shard=2", "parallel.zero_stage=3", "metrics.log_samples=true"]


@pytest.fixture(scope="module")
def fsdp2_whole(tmp_path_factory):
    """8 uninterrupted steps of FSDP over 2 processes, with the sample log: the reference for interrupted runs."""
    whole = tmp_path_factory.mktemp("fsdp2") / "whole"
    run = _train(whole, 8, *FSDP2, nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    return whole


@pytest.mark.parametrize("nproc", [1, 2], ids=["one-device", "fsdp2"])
@pytest.mark.multiprocess
def test_interrupted_run_resumes_exactly(tmp_path, nproc, request):
    layout = FSDP2 if nproc == 2 else []
    whole, split = (request.getfixturevalue("fsdp2_whole") if nproc == 2 else tmp_path / "whole"), tmp_path / "split"
    runs = [_train(split, 8, *layout, "train.stop_after=4", nproc=nproc)]  # stops at step 4, saved
    if nproc == 1:
        runs.append(_train(whole, 8, *layout, nproc=nproc))
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    second = _train(split, 8, *layout, nproc=nproc)
    assert second.returncode == 0, second.stderr[-2000:]
    assert _losses(split) == _losses(whole)  # steps 1-4 from the first run, 5-8 after resuming at step 4
    a, b = _params(whole), _params(split)
    assert all((a[k] == b[k]).all() for k in a)  # bitwise


def _wait_for_a_step(out, proc, seconds):
    """Until the run started with popen=True has logged a step (failing if it ends or takes longer)."""
    deadline = time.time() + seconds
    while not (out / "metrics.jsonl").exists() or not _losses(out):
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.2)


@pytest.mark.multiprocess
def test_sigterm_saves_and_exits_cleanly_then_resumes(tmp_path):
    out = tmp_path / "run"
    with _reaped(_train(out, 10_000, popen=True)) as proc:
        _wait_for_a_step(out, proc, 120)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    stopped = max(_losses(out))
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved[-1] == f"step_{stopped}"
    again = _train(out, stopped + 2)
    assert again.returncode == 0 and "resumed after step" in again.stdout + again.stderr
    assert max(_losses(out)) == stopped + 2


@pytest.mark.multiprocess
def test_sigterm_to_the_whole_process_group_saves_and_exits_0(tmp_path):
    """Slurm and `kill -- -PGID` signal every process of the job: torchrun's agent too, which raised (exit 1, its
    SignalException traceback) and would SIGKILL the ranks 30 s later whether their save was done or not. Sent
    again and again (an impatient second scancel), it killed a rank that had saved and put its handlers back, or the
    agent once its ranks had exited: the saved job ended failed."""
    out = tmp_path / "run"
    with _reaped(_train(out, 10_000, *FSDP2, nproc=2, popen=True)) as proc:
        _wait_for_a_step(out, proc, 180)
        deadline = time.time() + 180
        while proc.poll() is None and time.time() < deadline:  # through the save and every process's shutdown
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(0.05)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "SignalException" not in err and "Traceback" not in err, err[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == f"step_{max(_losses(out))}"


@pytest.mark.multiprocess
def test_a_signal_stops_a_run_without_checkpoints_cleanly(tmp_path):
    """Slurm's SIGUSR1 warning killed a run without checkpoints (rc 138): it now ends after its step, saving
    nothing, as a run with checkpoints does after saving."""
    out = tmp_path / "run"
    with _reaped(_train(out, 10_000, "checkpoint.enabled=false", popen=True)) as proc:
        _wait_for_a_step(out, proc, 120)
        proc.send_signal(signal.SIGUSR1)
        output, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "nothing saved (checkpoint.enabled = false)" in output and not (out / "checkpoints").exists()


def test_a_signal_while_the_run_is_built_stops_it_after_its_first_step(tmp_path, monkeypatch):
    """A stop signal before the loop's handler was installed (while the process groups, data and model were built: a
    minute on a busy machine) killed the rank, and `shardwise train --nproc` ended with torchrun's traceback and
    nothing saved (trial, 2026-12-02). It is caught from the start: the run saves after its first step and stops."""
    import shardwise.train
    from shardwise.config import load_config

    reached_default = []
    previous = signal.signal(signal.SIGUSR1, lambda *args: reached_default.append(True))
    build_data = shardwise.train.build_data

    def signalled_while_built(*args):
        os.kill(os.getpid(), signal.SIGUSR1)
        return build_data(*args)

    monkeypatch.setattr(shardwise.train, "build_data", signalled_while_built)
    try:
        summary = shardwise.train.train(load_config(CONFIG, [
            f"metrics.out_dir='{tmp_path}'", "train.steps=4", "checkpoint.enabled=true", "train.val_every=0",
            "metrics.tensorboard=false", "metrics.progress=false"]))
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not reached_default and summary.get("stopped_at") == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]


def test_a_signal_while_a_rank_imports_torch_stops_the_run_after_its_first_step(tmp_path, monkeypatch):
    """The same before train() runs: a rank of `shardwise train --nproc` spends seconds importing torch, and a stop
    signal then killed it (torchrun's traceback, exit 1; trial, 2026-12-02)."""
    import shardwise.train
    from shardwise.cli import main

    reached_default = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    signal.signal(signal.SIGUSR1, lambda *args: reached_default.append(True))
    train = shardwise.train.train

    def signalled_before(*args, **kwargs):  # as if it came during `from shardwise.train import train`
        os.kill(os.getpid(), signal.SIGUSR1)
        return train(*args, **kwargs)

    monkeypatch.setattr(shardwise.train, "train", signalled_before)
    try:
        assert main(["train", "--config", CONFIG, f"--set=metrics.out_dir='{tmp_path}'", "--set=train.steps=4",
                     "--set=checkpoint.enabled=true", "--set=train.val_every=0", "--set=metrics.tensorboard=false",
                     "--set=metrics.progress=false"]) == 0
        assert not reached_default
    finally:  # the command line's process ends with the run: it leaves them ignored after a stop
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert json.loads((tmp_path / "stopped.json").read_text()) == {"step": 1, "signal": True}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_1"]


def test_a_stop_after_before_the_resumed_step_is_refused(tmp_path, capsys):
    """train.stop_after = 5 on a run resuming at step 8 never fired: the run trained to its end."""
    from shardwise.cli import main

    common = ["train", "--config", CONFIG, f"--set=metrics.out_dir='{tmp_path}'", "--set=checkpoint.enabled=true",
              "--set=train.val_every=0", "--set=metrics.tensorboard=false", "--set=metrics.progress=false"]
    assert main([*common, "--set=train.steps=2"]) == 0
    assert main([*common, "--set=train.steps=4", "--set=train.stop_after=1"]) == 2
    err = capsys.readouterr().err
    assert "train.stop_after: 1 is before step 3" in err and err.count("\n") == 1
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]


def test_the_step_stop_after_ends_a_run_at_is_logged(tmp_path, capsys):
    """A run stopped by train.stop_after logs its last step as a finished run does: with log_every = 10 the loss of
    step 3, which the run's "done" line reports, was in no line of metrics.jsonl, and the run resumed after it
    logged from step 10 on (trial, 2026-12-02)."""
    from shardwise.cli import main

    common = ["train", "--config", CONFIG, f"--set=metrics.out_dir='{tmp_path}'", "--set=checkpoint.enabled=true",
              "--set=train.val_every=0", "--set=metrics.tensorboard=false", "--set=metrics.progress=false",
              "--set=metrics.log_every=10", "--set=train.steps=4"]
    assert main([*common, "--set=train.stop_after=3"]) == 0
    assert "loss" in capsys.readouterr().out
    assert sorted(_losses(tmp_path)) == [3]
    assert main(common) == 0  # resumed: its last step (4) is logged, step 3's line kept
    assert sorted(_losses(tmp_path)) == [3, 4]


@pytest.mark.multiprocess
def test_nonfinite_loss_stops_with_step_named(tmp_path):
    out = tmp_path / "run"
    proc = _train(out, 20, "optim.lr=1e12")
    assert proc.returncode == 3
    line = proc.stderr.strip().splitlines()[-1]
    assert "non-finite" in line and "step" in line and "rank 0" in line


def test_launcher_picks_the_handed_error_rank_0_first(tmp_path, monkeypatch):
    """shardwise.torchrun ends a job with a rank's handed error only when no rank failed any other way."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from shardwise.distributed import hand_error_to_launcher, handed_error

    def failure(rank, exitcode, line=None):
        path = tmp_path / f"{rank}-{exitcode}-{line}.json"  # a rank that handed no error has no file
        if line:
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
            assert hand_error_to_launcher(line, 3)
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))

    assert handed_error({0: failure(0, 3, "zero"), 1: failure(1, 3, "one")}) == (0, 3, "zero")
    assert handed_error({0: failure(0, -15), 2: failure(2, 3, "two")}) == (2, 3, "two")  # rank 0 stopped first
    assert handed_error({0: failure(0, 3, "zero"), 1: failure(1, 1)}) is None  # a bug on rank 1: its traceback
    assert handed_error({0: failure(0, 1, "zero")}) is None  # the error was handed, then something else ended it


def test_a_handed_error_every_attempt_meets_is_not_restarted(tmp_path, monkeypatch):
    """A config or checkpoint error is handed as final: torchrun's restarts met it again, each after a rendezvous."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from shardwise.distributed import hand_error_to_launcher, restart_cannot_help

    def failure(rank, exitcode, final=None):
        path = tmp_path / f"{rank}-{exitcode}-{final}.json"
        if final is not None:
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
            assert hand_error_to_launcher("shardwise: error: x", exitcode, final)
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))

    assert restart_cannot_help({0: failure(0, 2, True), 1: failure(1, -15)})
    assert not restart_cannot_help({0: failure(0, 3, False)})  # a lost peer, a hang: a restart may get past it
    assert not restart_cannot_help({0: failure(0, 2, True), 1: failure(1, 1)})  # a crash beside it: torchrun's way


@pytest.mark.multiprocess
def test_ranks_that_outlive_a_failed_one_are_not_waited_for_30_s(tmp_path):
    """A rank killed in a job of 4 (FSDP 2 x TP 2): a survivor blocked in a collective with it runs no Python signal
    handler, so torchrun's SIGTERM went unanswered and the job ended (or restarted) after torchrun's 30 s wait for
    a save that cannot complete. Here rank 0 ignores SIGTERM as such a rank does, and rank 1 fails."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os, signal, sys, time\n"
                      "if os.environ['RANK'] == '0':\n"
                      "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                      "    time.sleep(120)\n"
                      "time.sleep(1)\n"
                      "sys.exit(1)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "shardwise.torchrun", "--standalone", "--nproc_per_node=2",
                           str(worker)], capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert time.monotonic() - start < 25, proc.stderr[-2000:]


@pytest.mark.multiprocess
def test_ctrl_c_under_the_launcher_is_no_traceback(tmp_path):
    """torchrun's agent raised its SignalException on Ctrl-C: its traceback followed the ranks' 'interrupted'."""
    worker = tmp_path / "worker.py"
    worker.write_text("import sys, time\ntry:\n    time.sleep(120)\nexcept KeyboardInterrupt:\n    sys.exit(130)\n")
    proc = subprocess.Popen([sys.executable, "-m", "shardwise.torchrun", "--standalone", "--nproc_per_node=1",
                             str(worker)], stderr=subprocess.PIPE, text=True, start_new_session=True)
    with _reaped(proc):
        time.sleep(8)  # the worker has started
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err, err[-2000:]


@pytest.mark.multiprocess
def test_an_error_under_the_launcher_is_one_line_and_its_exit_code(tmp_path):
    """Resuming under 4 ranks a checkpoint saved by 1 whose shard is damaged: every rank meets the error, the user
    sees its line once and exit code 3, without torchrun's report or a traceback. A global batch that differs is the
    launcher's to refuse, before the ranks start, with the same line and exit code."""
    out = tmp_path / "run"
    assert _train(out, 2).returncode == 0
    proc = _train(out, 4, nproc=4)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 3, text[-3000:]
    assert text.count("shardwise: error:") == 1 and "global_batch=8, this run has 32" in text, text[-3000:]
    # the batch to set, not the damaged checkpoint's fix (which it was under several ranks: "rank 0: ..." != ...)
    assert "fix: set train.global_batch = 8" in text and "move this step's folder" not in text, text[-3000:]
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-3000:]

    shard = next((out / "checkpoints" / "step_2").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = _train(out, 4, "train.micro_batch=2", nproc=4)  # the saved global batch of 8, over 4 ranks
    text = proc.stdout + proc.stderr
    assert proc.returncode == 3, text[-3000:]
    assert text.count("shardwise: error:") == 1 and "CRC32" in text and "move this step's folder" in text, text[-3000:]
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-3000:]


@pytest.mark.multiprocess
def test_export_to_hugging_face_and_start_from_it(tmp_path):
    from shardwise.hf import from_hf_name

    run, hf_dir = tmp_path / "run", tmp_path / "hf"
    assert _train(run, 2).returncode == 0
    proc = subprocess.run([sys.executable, "-m", "shardwise", "export", "--config", CONFIG,
                           f"--set=metrics.out_dir='{run}'", "--out", str(hf_dir)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = {from_hf_name(k): v for k, v in load_file(hf_dir / "model.safetensors").items()}
    final = _params(run)
    assert exported.keys() == final.keys() and all((exported[k] == final[k]).all() for k in final)
    tuned = tmp_path / "tuned"
    proc = _train(tuned, 1, f"checkpoint.init_from_hf='{hf_dir}'", "optim.lr=1e-9")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # with a negligible learning rate the weights stay the exported ones
    assert all(((_params(tuned)[k] - final[k]).abs().max() < 1e-6) for k in final)


def _worker_pids(out):
    """{rank: PID} of the training processes torchrun started for the run writing to `out` (not the launchers)."""
    pids = {}
    for proc in Path("/proc").iterdir():
        try:
            text = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = dict(v.split(b"=", 1) for v in (proc / "environ").read_bytes().split(b"\0") if b"=" in v)
        except (OSError, ValueError):
            continue
        if "shardwise" in text and str(out) in text and b"RANK" in env and "shardwise.torchrun" not in text:
            pids[int(env[b"RANK"])] = int(proc.name)
    return pids


@pytest.mark.multiprocess
def test_killed_rank_restarts_and_ends_like_an_uninterrupted_run(tmp_path, fsdp2_whole):
    """SIGKILL one of 2 ranks mid-run under --max-restarts: torchrun restarts both, they resume from the newest
    checkpoint, and the run ends with the losses and (bitwise) parameters of a run nobody killed, having trained
    on every sample exactly once (the sample log, replayed steps superseding the lost ones)."""
    whole, killed = fsdp2_whole, tmp_path / "killed"
    with _reaped(_train(killed, 8, *FSDP2, nproc=2, popen=True, launcher=["--max-restarts", "2"])) as proc:
        deadline = time.time() + 300
        while not ((killed / "metrics.jsonl").exists() and max(_losses(killed), default=0) >= 3):
            assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "timeout"
            time.sleep(0.1)
        os.kill(_worker_pids(killed)[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed after step" in out  # the restarted ranks started from a checkpoint
    assert _losses(killed) == _losses(whole)  # the replayed steps overwrite the ones logged before the kill
    a, b = _params(whole), _params(killed)
    assert all((a[k] == b[k]).all() for k in a)
    logs = [(killed / "samples" / f).read_text() for f in ("dp0.jsonl", "dp1.jsonl")]
    rows = [json.loads(line) for log in logs for line in log.splitlines()]
    # the restart did the steps after its checkpoint again (each printed by both attempts: the kill lost work that
    # was redone), and its start dropped the lost attempt's lines of them from the sample log
    assert len(re.findall(r"step \d+: loss", out)) > 8
    assert len(rows) == 16 and len({row["attempt"] for row in rows}) == 2
    assert read_sample_log(killed) == read_sample_log(whole)
    ids = [i for rank in read_sample_log(killed).values() for step in rank.values() for i in step]
    assert len(ids) == len(set(ids)) == 8 * 16  # 8 steps x global batch 16, none twice (all in one epoch)


@pytest.mark.multiprocess
def test_a_hung_rank_becomes_an_error_naming_the_operation_and_the_rank(tmp_path):
    """SIGSTOP one of 2 ranks: with train.collective_timeout_s = 5 the other's collective times out and the run
    ends with one line naming the operation, the step, this rank and the hung one, instead of hanging."""
    out = tmp_path / "run"
    err_file = (tmp_path / "stderr").open("w+")
    cmd = [sys.executable, "-m", "shardwise", "train", "--config", CONFIG, f"--set=metrics.out_dir='{out}'",
           "--set=train.steps=10000", "--set=metrics.log_every=1", "--set=train.val_every=0",
           "--set=metrics.tensorboard=false", "--set=parallel.dp_replicate=2", "--set=train.collective_timeout_s=5",
           "--nproc", "2"]
    with _reaped(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_file, text=True,
                                  start_new_session=True)) as proc:
        deadline = time.time() + 300
        while not ((out / "metrics.jsonl").exists() and _losses(out)):
            assert time.time() < deadline and proc.poll() is None, "the run did not start"
            time.sleep(0.1)
        hung = _worker_pids(out)[1]
        os.kill(hung, signal.SIGSTOP)
        while "shardwise: error:" not in Path(err_file.name).read_text():
            assert time.time() < deadline and proc.poll() is None, Path(err_file.name).read_text()[-3000:]
            time.sleep(0.2)
        os.kill(hung, signal.SIGKILL)  # torchrun would SIGKILL it too, 30 s after its SIGTERM
        assert proc.wait(timeout=120) != 0
    line = next(x for x in Path(err_file.name).read_text().splitlines() if x.startswith("shardwise: error:"))
    assert re.search(r"step \d+: rank 0's (all_reduce|all_gather\w*|reduce_scatter\w*|barrier) timed out ", line), line
    assert "rank 1 did not check in" in line and "hung or dead" in line, line


def _group_timeouts(overrides):
    """On each rank: the timeout of every process group of the job's mesh (its dims and flattened dims)."""
    import torch

    from shardwise.config import load_config
    from shardwise.parallel.runtime import Runtime

    runtime = Runtime.create(load_config(CONFIG, overrides))
    mesh = runtime.mesh
    groups = {"tp": mesh.tp, "dp_shard": mesh.mesh["dp_shard"], "fsdp": mesh.fsdp, "grad_reduce": mesh.grad_reduce}
    return {name: m.get_group()._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for name, m in groups.items()}


@pytest.mark.multiprocess
def test_every_group_of_the_mesh_times_out_with_the_job():
    """FSDP 2 x TP 2 with train.collective_timeout_s = 5 and a rank stopped (SIGSTOP): the other ranks waited 30
    minutes, the timeout torch gives a group made without one (new_group), and the run hung instead of ending with
    the line naming the hung rank."""
    from distributed import run_distributed

    overrides = ["parallel.dp_shard=2", "parallel.tp=2", "train.collective_timeout_s=5"]
    for timeouts in run_distributed(_group_timeouts, 4, overrides):
        assert set(timeouts.values()) == {5.0}, timeouts


def test_a_roll_call_that_torchrun_ends_does_not_claim_it_waited():
    """torchrun SIGTERMs the survivors as soon as a rank has exited, which ends their roll call at once. The line
    said 'rank 1 did not check in within 30 s: hung or dead' after a fraction of a second, and named as hung
    ranks that were alive, blocked in a collective with the dead one (4 ranks, one SIGKILLed: 'ranks 1, 2')."""
    import threading

    import torch
    import torch.distributed as dist

    from shardwise.distributed import DistEnv, explain_failure

    env = DistEnv(0, 2, 0, torch.device("cpu"), dist.HashStore(), timeout_s=600)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()  # torchrun stopping the job
    start = time.monotonic()
    line = explain_failure(RuntimeError("Read error: Connection reset by peer"), env, step=7)
    assert time.monotonic() - start < 10
    assert "rank 1 had not checked in when the job was stopped" in line, line
    assert "within" not in line, line
    # the rank reporting, named as such (it read as if rank 0 were the peer lost)
    assert line.startswith("step 7: rank 0's ") and "lost its peer (" in line, line


def test_the_first_error_is_cut_with_a_mark():
    from shardwise.distributed import _first_line

    assert _first_line(RuntimeError("short\nsecond")) == "short"
    long = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] " + "x" * 500 + " Timed out"
    assert _first_line(RuntimeError(long)) == long[:400] + " [...]"
    assert _first_line(RuntimeError("")) == "RuntimeError"


def test_a_run_resumed_at_or_past_its_last_step_says_so(tmp_path, capsys):
    """A run folder whose newest checkpoint is at train.steps has nothing to train (it crashed with an IndexError
    printing the losses); one past it names train.steps."""
    from shardwise.cli import main

    def run(steps):
        return main(["train", "--config", CONFIG, f"--set=metrics.out_dir='{tmp_path}'", f"--set=train.steps={steps}",
                     "--set=checkpoint.enabled=true", "--set=train.val_every=0", "--set=metrics.tensorboard=false",
                     "--set=metrics.progress=false"])

    assert run(2) == 0
    capsys.readouterr()
    assert run(2) == 0
    assert "nothing to train, the run is at step 2 of 2" in capsys.readouterr().out
    assert run(1) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardwise: error: train.steps: 1 is below step 2") and "\n" not in err
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]


def test_a_run_started_over_sets_the_earlier_runs_checkpoints_aside(tmp_path, capsys):
    """checkpoint.resume = false in a folder with checkpoints (the demo's config, run twice) used to save among them:
    a later resume went on from the earlier run's newest. They are moved to earlier/checkpoints, untouched, and
    the folder's checkpoints are the new run's. The earlier run's records go with them: its job_config.json and
    metrics were overwritten, and its checkpoints could no longer be exported (trial, 2026-12-02)."""
    from shardwise.cli import main

    common = ["train", "--config", CONFIG, f"--set=metrics.out_dir='{tmp_path}'", "--set=checkpoint.enabled=true",
              "--set=checkpoint.every=2", "--set=train.val_every=0", "--set=metrics.tensorboard=false",
              "--set=metrics.progress=false"]
    assert main([*common, "--set=train.steps=4"]) == 0
    (tmp_path / "profile").mkdir()  # what metrics.profile_step writes (profiled here, it takes a minute)
    (tmp_path / "profile" / "rank0.txt").write_text("the earlier run's operators")
    before = {p.relative_to(tmp_path / "checkpoints"): p.stat().st_mtime_ns
              for p in (tmp_path / "checkpoints").rglob("*")}
    records = {name: (tmp_path / name).read_bytes() for name in ("job_config.json", "metrics.jsonl",
                                                                  "profile/rank0.txt")}
    assert main([*common, "--set=train.steps=2", "--set=checkpoint.resume=false"]) == 0
    assert {p.relative_to(tmp_path / "earlier" / "checkpoints"): p.stat().st_mtime_ns
            for p in (tmp_path / "earlier" / "checkpoints").rglob("*")} == before
    assert all((tmp_path / "earlier" / name).read_bytes() == kept for name, kept in records.items())
    assert not (tmp_path / "profile").exists()  # the earlier run's trace went with it (it stayed, among the new's)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]
    assert main(["export", "--run", str(tmp_path / "earlier"), "--out", str(tmp_path / "hf")]) == 0
    # a second start-over keeps the first one's set-aside checkpoints (it deleted them)
    assert main([*common, "--set=train.steps=2", "--set=checkpoint.resume=false"]) == 0
    assert sorted(p.name for p in (tmp_path / "earlier-2" / "checkpoints").iterdir()) == ["step_2"]
    assert sorted(p.name for p in (tmp_path / "earlier" / "checkpoints").iterdir()) == ["step_2", "step_4"]
    capsys.readouterr()
    assert main([*common, "--set=train.steps=3"]) == 0
    out = capsys.readouterr()
    assert "resumed after step 2" in out.out + out.err


def test_a_start_over_the_file_system_refuses_is_one_line_and_moves_nothing_away(tmp_path, capsys, monkeypatch):
    """A run started over in a folder whose earlier checkpoints cannot be moved (a read-only or full file system)
    was rank 0's OSError traceback, the other ranks waiting at the barrier after it. It is one line naming the
    setting, the error and the fix, exit 3, and the earlier checkpoints stay where a resume finds them."""
    import errno
    import pathlib

    from shardwise.checkpoint import latest_checkpoint
    from shardwise.cli import main

    common = ["train", "--config", CONFIG, f"--set=metrics.out_dir='{tmp_path}'", "--set=checkpoint.enabled=true",
              "--set=checkpoint.every=2", "--set=train.val_every=0", "--set=metrics.tensorboard=false",
              "--set=metrics.progress=false", "--set=train.steps=2"]
    assert main(common) == 0
    newest = latest_checkpoint(tmp_path)

    def refused(self, target):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(pathlib.Path, "rename", refused)
    capsys.readouterr()
    assert main([*common, "--set=checkpoint.resume=false"]) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "checkpoint.resume = false: setting the earlier run's checkpoints aside failed: " \
        "[Errno 30] Read-only file system" in lines[0] and "fix: make metrics.out_dir writable" in lines[0], lines
    assert latest_checkpoint(tmp_path) == newest


def test_a_run_without_checkpoints_sets_the_earlier_runs_checkpoints_aside_too(tmp_path):
    """checkpoint.enabled = false in a folder with another run's checkpoints left them there and rewrote that run's
    records (job_config.json, metrics.jsonl, tokenizer.json): export --run then wrote its checkpoint with the new
    run's config (review, 2026-12-02). It starts over as resume = false does: the earlier run goes to earlier/."""
    from shardwise.cli import main

    common = ["train", "--config", CONFIG, f"--set=metrics.out_dir='{tmp_path}'", "--set=train.val_every=0",
              "--set=metrics.tensorboard=false", "--set=metrics.progress=false", "--set=train.steps=2"]
    assert main([*common, "--set=checkpoint.enabled=true"]) == 0
    records = {name: (tmp_path / name).read_bytes() for name in ("job_config.json", "metrics.jsonl")}
    assert main([*common, "--set=checkpoint.enabled=false", "--set=train.seed=7"]) == 0
    assert sorted(p.name for p in (tmp_path / "earlier" / "checkpoints").iterdir()) == ["step_2"]
    assert all((tmp_path / "earlier" / name).read_bytes() == kept for name, kept in records.items())
    assert not (tmp_path / "checkpoints").exists()
    assert main(["export", "--run", str(tmp_path / "earlier"), "--out", str(tmp_path / "hf")]) == 0


def test_a_run_started_over_takes_the_earlier_runs_tensorboard_log_along(tmp_path):
    """The earlier run's TensorBoard events (metrics.tensorboard, on by default) stayed in the folder when its other
    records moved to earlier/: the new run wrote beside them with purge_step 1, which hides the earlier run's steps,
    and earlier/ had no TensorBoard log."""
    from shardwise.cli import main

    common = ["train", "--config", CONFIG, f"--set=metrics.out_dir='{tmp_path}'", "--set=checkpoint.enabled=true",
              "--set=checkpoint.every=2", "--set=train.val_every=0", "--set=metrics.tensorboard=true",
              "--set=metrics.progress=false", "--set=train.steps=2"]
    assert main(common) == 0
    before = sorted(p.name for p in (tmp_path / "tb").iterdir())
    assert before
    assert main([*common, "--set=checkpoint.resume=false"]) == 0
    assert sorted(p.name for p in (tmp_path / "earlier" / "tb").iterdir()) == before
    assert not set(before) & {p.name for p in (tmp_path / "tb").iterdir()}


def test_a_run_started_over_that_reads_the_runs_own_tokenizer_keeps_it(tmp_path):
    """data.tokenizer = '<run>/tokenizer.json' (what a resume refused for other ids is told to set) and
    checkpoint.resume = false: the start-over moved that file into earlier/ with the records, and the new run failed
    with a FileNotFoundError traceback writing its tokenizer. It is copied there, and the new run trains."""
    from shardwise.cli import main

    common = ["train", "--config", CONFIG, f"--set=metrics.out_dir='{tmp_path}'", "--set=checkpoint.enabled=true",
              "--set=checkpoint.every=2", "--set=train.val_every=0", "--set=metrics.tensorboard=false",
              "--set=metrics.progress=false", "--set=train.steps=2"]
    assert main(common) == 0
    saved = (tmp_path / "tokenizer.json").read_bytes()
    own = f"--set=data.tokenizer='{tmp_path / 'tokenizer.json'}'"
    assert main([*common, own, "--set=checkpoint.resume=false"]) == 0
    assert (tmp_path / "earlier" / "tokenizer.json").read_bytes() == saved
    assert (tmp_path / "tokenizer.json").read_bytes() == saved
    assert sorted(p.name for p in (tmp_path / "earlier" / "checkpoints").iterdir()) == ["step_2"]


def test_a_sigterm_between_two_rounds_of_ranks_ends_the_agent(monkeypatch):
    """A SIGTERM that finds the ranks it stopped gone is a repeat, ignored: the agent is returning their 0. Once
    torchrun restarts them (they failed instead of saving), one that comes before the new round runs is torchrun's
    again, and the agent ends; it was ignored, and a scheduler's stop dropped (review, 2026-12-02)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    import shardwise.launch.local
    import shardwise.torchrun as agent

    monkeypatch.setattr(shardwise.launch.local, "_children", lambda pid: [])  # the ranks have exited
    monkeypatch.setattr(agent, "_stopped_ranks", {12345})
    agent._stop_ranks_first(signal.SIGTERM, None)  # a repeat: ignored
    monkeypatch.setattr(agent, "_TORCHRUN_RESTART", lambda self, group: None)
    agent._restart_forgets_the_stop(None, None)
    with pytest.raises(SignalException):
        agent._stop_ranks_first(signal.SIGTERM, None)


def test_repeated_sigterms_to_the_agent_keep_one_entry_per_rank(monkeypatch):
    """Each SIGTERM passed on to the ranks appended them again to what the agent remembers of the stop: a scheduler
    that repeats its signal grew the list for the whole job (review, 2026-12-02)."""
    import shardwise.launch.local
    import shardwise.torchrun as agent

    sent = []
    monkeypatch.setattr(shardwise.launch.local, "_children", lambda pid: [101, 102])
    monkeypatch.setattr(agent.os, "kill", lambda pid, signum: sent.append(pid))
    monkeypatch.setattr(agent, "_stopped_ranks", set())
    for _ in range(3):
        agent._stop_ranks_first(signal.SIGTERM, None)
    assert sent == [101, 102] * 3 and len(agent._stopped_ranks) == 2


@pytest.mark.multiprocess
def test_a_repeated_sigterm_to_the_command_still_saves_and_exits_0(tmp_path):
    """`shardwise train --nproc` passed every SIGTERM it received on to the ranks: one that came after a rank had
    saved and put its handlers back (an impatient second `kill`, a scheduler's repeated signal) killed it while it
    shut down, and the saved run ended with exit 1 and torchrun's ChildFailedError report (trial, 2026-12-02). The
    ranks are stopping after the first; the command passes that one on."""
    out = tmp_path / "run"
    with _reaped(_train(out, 10_000, *FSDP2, nproc=2, popen=True)) as proc:
        _wait_for_a_step(out, proc, 180)
        deadline = time.time() + 180
        while proc.poll() is None and time.time() < deadline:  # through the save and the ranks' shutdown
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err and "ChildFailedError" not in err, err[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == f"step_{max(_losses(out))}"
