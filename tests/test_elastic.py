"""Elastic jobs (`--nnodes MIN:MAX`): a job keeps its global batch on any world (train.global_batch), every world
it may have is checked before anything starts, and a job that loses a machine mid-run finishes on the machines it
has, like a run that changed world size at the same step through a checkpoint, every sample read once.

The machines are torchrun agents on this one (`shardwise launch local`); one is killed as a lost node would be.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from shardwise.cli import main
from shardwise.config import ConfigError, fit_nodes, fit_world, load_config
from shardwise.launch.local import _last_step, free_port
from shardwise.metrics import read_sample_log, samples_by_step

CONFIG = str(Path(__file__).parent / "configs" / "parity.toml")
# parity.toml's micro-batch is 8: 16 sequences a step are 2 ranks x 1 micro-batch, or 1 rank x 2
RUN = ["train.steps=20", "train.global_batch=16", "checkpoint.enabled=true", "checkpoint.every=1",
       "metrics.log_every=1", "train.val_every=0", "metrics.tensorboard=false", "metrics.log_samples=true"]


# ---------------------------------------------------------------------------------------------------
# The batch on any world, and the worlds checked first


@pytest.mark.parametrize("world, parallel, dp, accum", [
    (1, [], 1, 4), (2, [], 2, 2), (4, [], 4, 1),
    (4, ["parallel.tp=2"], 2, 2),  # dp fills what tp leaves
    (4, ["parallel.zero_stage=3"], 4, 1),  # ZeRO-3 over the world: dp_shard
])
def test_global_batch_sets_grad_accum_for_the_world(world, parallel, dp, accum):
    cfg = load_config(CONFIG, ["train.global_batch=32", *parallel])
    fit_world(cfg, world)
    assert (cfg.parallel.dp, cfg.train.grad_accum, cfg.parallel.world_size) == (dp, accum, world)
    assert cfg.train.micro_batch * cfg.train.grad_accum * cfg.parallel.dp == 32


@pytest.mark.parametrize("overrides, field", [
    (["train.global_batch=16", "train.grad_accum=2"], "train.global_batch"),  # both say the same thing
    (["train.global_batch=-8"], "train.global_batch"),
])
def test_global_batch_that_cannot_be_is_refused(overrides, field):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, overrides)
    assert e.value.field == field


def test_a_world_the_global_batch_does_not_split_over_is_named():
    cfg = load_config(CONFIG, ["train.global_batch=16", "checkpoint.enabled=true"])
    with pytest.raises(ConfigError) as e:
        fit_nodes(cfg, 1, (1, 3))  # 1 and 2 ranks split 16 into micro-batches of 8; 3 ranks do not
    assert e.value.field == "train.global_batch" and "on 3 machines (3 ranks)" in e.value.problem


def test_a_world_of_one_machine_is_named_in_the_singular():
    cfg = load_config(CONFIG, ["train.global_batch=16", "checkpoint.enabled=true", "parallel.tp=2"])
    with pytest.raises(ConfigError) as e:
        fit_nodes(cfg, 1, (1, 2))  # tp 2 needs 2 ranks: one machine of one process has 1
    assert e.value.problem.startswith("on 1 machine (1 rank): "), e.value.problem


@pytest.mark.parametrize("nodes, nproc, overrides", [
    ((1, 2), 1, []), ((2, 4), 8, []), ((1, 3), 2, ["parallel.tp=2"]), ((3, 5), 1, ["train.grad_accum=3"])])
def test_an_elastic_job_without_a_global_batch_is_told_one_that_splits_on_every_world(nodes, nproc, overrides):
    cfg = load_config(CONFIG, ["checkpoint.enabled=true", *overrides])
    with pytest.raises(ConfigError) as e:
        fit_nodes(cfg, nproc, nodes)
    assert e.value.field == "train.global_batch"
    batch = int(e.value.fix.split("= ")[1].split()[0])
    top = load_config(CONFIG, ["checkpoint.enabled=true", *overrides])
    fit_world(top, nodes[1] * nproc)  # at least the batch the largest world would have trained
    assert batch >= top.train.micro_batch * top.train.grad_accum * top.parallel.dp
    layout = [o for o in overrides if not o.startswith("train.grad_accum")]  # the global batch decides it
    fit_nodes(load_config(CONFIG, ["checkpoint.enabled=true", f"train.global_batch={batch}", *layout]), nproc, nodes)


def _refused(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("args, field", [
    (["train", "--nproc", "1", "--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--rdzv-id", "j"], "checkpoint.enabled"),
    (["train", "--nproc", "1", "--nnodes", "2:1", "--rdzv-endpoint", "h:1", "--rdzv-id", "j"], "--nnodes"),
    (["train", "--nproc", "1", "--nnodes", "x", "--rdzv-endpoint", "h:1", "--rdzv-id", "j"], "--nnodes"),
    (["train", "--nnodes", "1:2"], "--nnodes"),  # machines without --nproc: nothing would start them
    (["launch", "local", "--nnodes", "1:2"], "checkpoint.enabled"),
    (["launch", "local", "--nnodes", "2", "--leave", "0@3"], "--leave"),  # the first hosts the rendezvous
    (["launch", "local", "--nnodes", "2", "--leave", "2@3"], "--leave"),  # there is no third
    (["launch", "local", "--nnodes", "2", "--nproc-per-node", "0"], "--nproc-per-node"),
    (["launch", "local", "--nnodes", "2", "--max-restarts", "-1"], "--max-restarts"),  # after a machine started
    # restarts without checkpoints to resume trained from the start again, and ended with exit code 0
    (["train", "--nproc", "2", "--max-restarts", "2"], "checkpoint.enabled"),
    (["train", "--nproc", "2", "--max-restarts", "2", "--set", "checkpoint.enabled=true", "--set",
      "checkpoint.resume=false"], "checkpoint.resume"),
    (["launch", "local", "--nnodes", "2", "--max-restarts", "1"], "checkpoint.enabled"),
    (["launch", "local", "--nnodes", "2", "--last-call", "-5"], "--last-call"),
    (["launch", "local", "--nnodes", "2", "--leave", "1@100000"], "--leave"),  # past train.steps: never fired
    (["launch", "local", "--nnodes", "2", "--save-final", "."], "--save-final"),  # a folder: failed at the end
    (["train", "--save-final", "."], "--save-final"),
    (["launch", "local", "--nnodes", "1:3", "--set", "train.global_batch=16", "--set", "checkpoint.enabled=true"],
     "train.global_batch"),
    # no global batch: the batch would follow the machines, and a restart on another world could not resume
    (["launch", "local", "--nnodes", "1:2", "--set", "checkpoint.enabled=true"], "train.global_batch"),
    (["train", "--nproc", "1", "--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--rdzv-id", "j", "--set",
      "checkpoint.enabled=true"], "train.global_batch"),
])
def test_bad_elastic_input_is_one_line_before_any_process(args, field, capsys, tmp_path, monkeypatch):
    import shardwise.launch.local

    def no_start(*a, **k):
        raise AssertionError("a process was started for a job that cannot run")

    monkeypatch.setattr(shardwise.launch.local, "launch_local", no_start)
    monkeypatch.setattr(shardwise.launch.local, "run_local", no_start)
    err = _refused([args[0], *args[1:], "--config", CONFIG, "--set", f"metrics.out_dir='{tmp_path / 'run'}'"], capsys)
    assert err.startswith(f"shardwise: error: {field}: "), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("nodes", ["2", "1:2"])
def test_launch_local_checks_the_data_before_any_machine_starts(nodes, capsys, tmp_path, monkeypatch):
    """A corpus too small for one global batch was found by the ranks: each machine printed the error line (again
    on each of an elastic job's restarts) and the rendezvous' traceback, minutes later."""
    import shardwise.launch.local

    def no_start(*a, **k):
        raise AssertionError("a machine was started for a job that cannot run")

    monkeypatch.setattr(shardwise.launch.local, "run_local", no_start)
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("hello world\n")
    sets = [f"data.paths=['{corpus}']", f"data.cache_dir='{tmp_path / 'cache'}'",
            f"metrics.out_dir='{tmp_path / 'run'}'", "train.global_batch=16", "checkpoint.enabled=true"]
    err = _refused(["launch", "local", "--config", CONFIG, "--nnodes", nodes, *[a for s in sets for a in ("--set", s)]],
                   capsys)
    assert err.startswith("shardwise: error: train.micro_batch: ") and "0 samples" in err, err


def test_leave_counts_the_steps_this_job_logs(tmp_path):
    """--leave MACHINE@STEP waits for STEP in the metrics this job appends: an earlier run's lines in the same
    folder took the machine away before the job had started (and then the job hung, one machine short)."""
    from shardwise.launch.local import _last_step

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    earlier = metrics.stat().st_size
    assert _last_step(metrics) == 3 and _last_step(metrics, earlier) == 0
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert _last_step(metrics, earlier) == 1


def test_the_sample_log_keeps_the_latest_attempt_of_each_step(tmp_path):
    """Two ranks read steps 1-3; rank 1's machine is lost during step 3 (its line for it logged), and the job,
    now one rank, goes on from step 2's checkpoint: step 3 is the new attempt's, on rank 0 alone."""
    folder = tmp_path / "samples"
    folder.mkdir()
    first, second = 1_000, 2_000
    rank0 = [(1, [0], first), (2, [2], first), (3, [4], first), (3, [4, 5], second), (4, [6, 7], second)]
    rank1 = [(1, [1], first), (2, [3], first), (3, [5], first)]
    for name, lines in (("dp0", rank0), ("dp1", rank1)):
        (folder / f"{name}.jsonl").write_text("".join(
            json.dumps({"step": s, "ids": ids, "attempt": a}) + "\n" for s, ids, a in lines))
    assert read_sample_log(tmp_path) == {0: {1: [0], 2: [2], 3: [4, 5], 4: [6, 7]}, 1: {1: [1], 2: [3]}}
    assert samples_by_step(tmp_path) == {1: [0, 1], 2: [2, 3], 3: [4, 5], 4: [6, 7]}


# ---------------------------------------------------------------------------------------------------
# A machine lost mid-run


def _shardwise(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "shardwise", *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _sets(out: Path, *extra: str) -> list[str]:
    return ["--config", CONFIG, *[a for s in [*RUN, f"metrics.out_dir='{out}'", *extra] for a in ("--set", s)]]


@pytest.mark.multiprocess
def test_an_elastic_job_that_loses_a_machine_finishes_like_a_world_change_through_a_checkpoint(tmp_path):
    """Two machines of one rank each, `--nnodes 1:2`; machine 1 is killed (agent and rank) after step 8. The job
    restarts on machine 0 from the newest checkpoint, resharded to one rank accumulating two micro-batches, and
    ends with the parameters of a run that stopped on 2 ranks after that step and went on with 1."""
    run, ref = tmp_path / "elastic", tmp_path / "reference"
    done = _shardwise("launch", "local", *_sets(run, "train.collective_timeout_s=10"), "--nnodes", "1:2",
                      "--nproc-per-node", "1", "--leave", "1@8", "--save-final", str(run / "final.safetensors"))
    assert "machine 1 left after step 8" in done.stderr, done.stderr[-3000:]
    resumed = [int(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines() + done.stderr.splitlines()
               if "resumed after step" in line for line in [line.split(" | ")[-1]]]
    assert len(resumed) == 1 and 7 <= resumed[0] < 20, done.stdout[-3000:]
    assert "on cpu | resumed" in done.stdout + done.stderr  # on one rank, no longer two

    _shardwise("train", *_sets(ref, f"train.stop_after={resumed[0]}"), "--nproc", "2")
    _shardwise("train", *_sets(ref), "--save-final", str(ref / "final.safetensors"))
    a, b = load_file(run / "final.safetensors"), load_file(ref / "final.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # bitwise

    steps = samples_by_step(run)
    assert steps == samples_by_step(ref) and list(steps) == list(range(1, 21))
    ids = [i for step in steps.values() for i in step]
    assert len(ids) == 20 * 16 == len(set(ids))  # every sample once


@pytest.mark.multiprocess
def test_an_error_every_attempt_meets_ends_an_elastic_job_at_once(tmp_path):
    """A run folder whose checkpoint holds another model: each machine's torchrun restarted its rank 3 times, every
    attempt printing the same line after a new rendezvous (2 minutes here), and the machine left last ended with
    the rendezvous' traceback. Now each machine says it once and the job ends."""
    run = tmp_path / "run"
    _shardwise("train", *_sets(run, "train.steps=2"))
    done = subprocess.run([sys.executable, "-m", "shardwise", "launch", "local", *_sets(run, "model.n_layers=4"),
                           "--nnodes", "1:2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("shardwise: error: ")]
    assert len(lines) <= 2 and "holds a different model" in lines[0], done.stderr[-3000:]  # one per machine at most
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------
# A signal to one machine


@pytest.mark.multiprocess
def test_a_signal_to_one_machine_ends_every_machine_with_the_stopped_exit_code(tmp_path):
    """A drained Kubernetes node SIGTERMs its pod alone. The ranks agree to stop and all save, but only that pod's
    launcher exited with --stopped-exit-code: the others exited 0, which a Job counts as their index done, and the
    drained pod's replacement then waited alone at the rendezvous. Every machine now says the run stopped."""
    run = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    machines = [subprocess.Popen(
        [sys.executable, "-m", "shardwise", "train", *_sets(run, "train.steps=10000"), "--nproc", "1", "--nnodes", "2",
         "--rdzv-endpoint", endpoint, "--rdzv-id", "drain", "--rdzv-conf", f"is_host={int(i == 0)}",
         "--stopped-exit-code", "75"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True) for i in range(2)]
    try:
        deadline = time.time() + 240
        while _last_step(run / "metrics.jsonl") < 2:
            assert time.time() < deadline and all(m.poll() is None for m in machines), machines[0].stderr.read()
            time.sleep(0.2)
        machines[1].send_signal(signal.SIGTERM)  # machine 1's launcher, as the kubelet signals the drained pod
        outputs = [m.communicate(timeout=240) for m in machines]
    finally:
        for m in machines:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(m.pid, signal.SIGKILL)
    assert [m.returncode for m in machines] == [75, 75], outputs[0][1][-3000:]
    stopped = json.loads((run / "stopped.json").read_text())
    assert stopped["signal"] and (run / "checkpoints" / f"step_{stopped['step']}" / "meta.json").is_file()
