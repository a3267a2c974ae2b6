"""`shardwise launch slurm`: what it refuses before anything is written or submitted, and the script it writes run by
a real Slurm (slurmctld, slurmd and munge on this machine, started by the fixture below): the job trains, saves at
the time-limit warning, is requeued, resumes, and ends as a run nobody stopped.

.ci/run installs Slurm (Debian's slurmd, slurmctld, munge) and sets SHARDWISE_REQUIRE_SLURM=1, so that there a
missing Slurm fails the tests instead of skipping them.
"""

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_resume import CONFIG, FSDP2, _losses, _params, _train

from shardwise.cli import main
from shardwise.errors import ConfigError
from shardwise.launch.local import free_port
from shardwise.metrics import read_sample_log

REQUIRED = os.environ.get("SHARDWISE_REQUIRE_SLURM") == "1"
# what test_resume's _train sets, for the job's own command line
RUN = ["train.steps=24", "checkpoint.enabled=true", "checkpoint.every=2", "metrics.log_every=1", "train.val_every=0",
       "metrics.tensorboard=false", *FSDP2]


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise", "launch", "slurm", *args], capture_output=True,
                          text=True, timeout=120)


# ---------------------------------------------------------------------------------------------------
# Before anything is submitted


def test_the_script_is_bash_with_the_allocation_and_the_rendezvous(tmp_path):
    out = tmp_path / "run"
    done = _launch("--config", CONFIG, "--nodes", "2", "--gpus-per-node", "4", "--set", "parallel.dp_replicate=8",
                   "--set", f"metrics.out_dir='{out}'", "--partition", "gpu", "--time", "4:00:00", "--dry-run")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    checked = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    for directive in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--partition=gpu", "--time=4:00:00",
                      f"--output={out}/slurm-%j.out", "--signal=B:USR1@120", "--no-requeue"):
        assert f"#SBATCH {directive}\n" in text
    assert "--nproc 4 --nnodes 2" in text and '--rdzv-endpoint "$head:$port" --rdzv-id "$SLURM_JOB_ID"' in text
    assert "scontrol requeue" not in text  # not asked for
    assert "--cpus-per-task" not in text  # not asked for: the site's default
    # two nodes and a run folder on this machine's own disk: said, not refused (a cluster may mount it anyway)
    assert "may not see" in done.stderr and not out.exists()  # a dry run writes nothing
    # sbatch opens --output before the script runs: a job printed for a folder not yet made would fail without a log
    assert "mkdir -p) before sbatch" in done.stderr and str(out) in done.stderr
    out.mkdir()
    again = _launch("--config", CONFIG, "--nodes", "1", "--nproc-per-node", "2", "--set", f"metrics.out_dir='{out}'")
    assert again.returncode == 0 and "mkdir" not in again.stderr, again.stderr


def test_cpus_per_task_and_other_directives_reach_the_script(tmp_path):
    out = tmp_path / "run"
    done = _launch("--config", CONFIG, "--nodes", "2", "--gpus-per-node", "4", "--set", "parallel.dp_replicate=8",
                   "--set", f"metrics.out_dir='{out}'", "--cpus-per-task", "48", "--sbatch=--exclusive",
                   "--sbatch=--qos=high", "--sbatch", "--comment=two words", "--dry-run")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True).returncode == 0
    directives = re.findall(r"^#SBATCH (.*)$", text, re.M)
    assert directives[:4] == ["--job-name=shardwise", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=48"]
    assert directives[-3:] == ["--exclusive", "--qos=high", "--comment=two words"]
    # srun is told too: Slurm 22.05 does not pass sbatch's --cpus-per-task on to it
    [srun] = [line for line in text.splitlines() if line.startswith("srun ")]
    assert shlex.split(srun.rstrip(" \\"))[1:4] == ["--ntasks-per-node=1", "--cpus-per-task=48", "--kill-on-bad-exit=1"]


def _documented(prefix: str) -> list[list[str]]:
    """The commands of docs/cluster.md's bash blocks that start with `prefix`, as the shell would split them."""
    text = (Path(__file__).parent.parent / "docs" / "cluster.md").read_text()
    lines = "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S)).replace("\\\n", " ").splitlines()
    return [shlex.split(line)[len(prefix.split()):] for line in lines if line.startswith(prefix)]


def test_the_documented_commands_work_verbatim(monkeypatch, capsys):
    """docs/cluster.md's examples, from the repository's root, printing the script instead of submitting it."""
    commands = _documented("shardwise launch slurm")
    assert commands and any("--requeue" in c for c in commands)
    monkeypatch.chdir(Path(__file__).parent.parent)
    for argv in commands:
        argv = ["--dry-run" if a == "--submit" else a for a in argv]
        assert main(["launch", "slurm", *argv]) == 0, capsys.readouterr().err
        assert "#SBATCH --requeue" in capsys.readouterr().out


@pytest.mark.parametrize("args, field", [
    (["--nodes", "3", "--nproc-per-node", "2", "--set", "parallel.dp_shard=2", "--set", "parallel.zero_stage=3"],
     "--nodes"),
    (["--nodes", "1"], "--nproc-per-node"),
    (["--nodes", "0", "--nproc-per-node", "2"], "--nodes"),
    (["--nodes", "1", "--nproc-per-node", "2", "--requeue"], "checkpoint.enabled"),
    (["--nodes", "1", "--nproc-per-node", "-3"], "--nproc-per-node"),  # it named --gpus-per-node
    (["--nodes", "1", "--nproc-per-node", "2", "--time", "banana"], "--time"),  # written as #SBATCH --time=banana
    (["--nodes", "1", "--nproc-per-node", "2", "--time", "-5"], "--time"),
    (["--nodes", "1", "--nproc-per-node", "2", "--time", "1:00", "--warn-seconds", "7200"], "--warn-seconds"),
    (["--nodes", "1", "--nproc-per-node", "2", "--warn-seconds", "100000"], "--warn-seconds"),  # sbatch: <= 65535
    (["--nodes", "1", "--nproc-per-node", "2", "--account", "x\ny"], "--account"),  # a line of its own
    (["--nodes", "1", "--nproc-per-node", "2", "--partition", "a b"], "--partition"),
    (["--nodes", "1", "--nproc-per-node", "2", "--save-final", "."], "--save-final"),  # a folder
    (["--nodes", "1", "--nproc-per-node", "2", "--requeue", "--set", "checkpoint.enabled=true", "--set",
      "checkpoint.resume=false"], "checkpoint.resume"),
    (["--nodes", "1", "--nproc-per-node", "2", "--cpus-per-task", "0"], "--cpus-per-task"),
    # a rank per GPU (cuda:LOCAL_RANK): ranks 8 to 15 of a node would have none
    (["--nodes", "2", "--gpus-per-node", "8", "--nproc-per-node", "16", "--set", "parallel.dp_shard=32"],
     "--nproc-per-node"),
    (["--nodes", "1", "--nproc-per-node", "2", "--sbatch=exclusive"], "--sbatch"),  # not an option
    (["--nodes", "1", "--nproc-per-node", "2", "--sbatch=--comment=a\n#SBATCH --nodes=9"], "--sbatch"),  # two lines
    (["--nodes", "1", "--nproc-per-node", "2", "--sbatch=--time=1:00"], "--sbatch"),  # launch slurm's --time
    (["--nodes", "1", "--nproc-per-node", "2", "--sbatch=--output=/tmp/x"], "--sbatch"),  # the script's own
    # sbatch takes a unique beginning of an option's name as the option: these replaced the script's --signal (no
    # save before the time limit, no requeue), --output and --no-requeue
    (["--nodes", "1", "--nproc-per-node", "2", "--sbatch=--sig=USR2@60"], "--sbatch"),
    (["--nodes", "1", "--nproc-per-node", "2", "--sbatch=--outp=/tmp/x"], "--sbatch"),
    (["--nodes", "1", "--nproc-per-node", "2", "--sbatch=--no-req"], "--sbatch"),
    # a misspelt flag was argparse's two lines under the top-level usage (`shardwise [-h]`), with no suggestion
    (["--nodes", "1", "--nproc-per-node", "2", "--partiton", "gpu"], "--partiton"),
])
def test_bad_input_is_one_line_naming_the_field_and_nothing_is_written(args, field, tmp_path, capsys):
    script = tmp_path / "job.sh"
    assert main(["launch", "slurm", "--config", CONFIG, *args, "--write", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardwise: error: {field}: ") and err.count("\n") == 1, err
    assert not script.exists()


@pytest.mark.parametrize("args, field", [
    (["launch", "slurm", "--nodes", "two"], "--nodes"),
    (["launch", "slurm", "--nproc-per-node", "2"], "--nodes"),  # required
    (["launch", "slurm", "--nodes", "1", "--submit", "--write", "job.sh"], "--write"),  # one or the other
    (["launch", "k8s", "--image", "x", "--kind", "pytorchjob"], "--kind"),
    (["launch", "local", "--nproc-per-node", "1.5"], "--nproc-per-node"),
    (["train", "--nproc", "two"], "--nproc"),
])
def test_a_bad_value_of_a_flag_is_one_line_naming_it(args, field, capsys):
    """argparse's own errors were its usage (a screen of it for launch slurm) above the line."""
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"shardwise: error: {field}: ") and err.count("\n") == 1, err
    assert "--help` lists the arguments" in err


@pytest.mark.parametrize("option", ["--gpus=16", "--ntasks=4", "--exclusive", "--qos=high", "--mem=0"])
def test_sbatch_options_whose_names_begin_the_scripts_own_are_not_abbreviations(option):
    """getopt_long takes an exact name as itself: --gpus is sbatch's own option, not --gpus-per-node abbreviated."""
    from shardwise.launch.slurm import _check_sbatch_option

    if option == "--ntasks=4":  # the script's own (one task per node), refused as itself
        with pytest.raises(ConfigError, match="--ntasks is written"):
            _check_sbatch_option(option)
    else:
        _check_sbatch_option(option)


@pytest.mark.parametrize("limit, seconds", [("90", 5400), ("1:30", 90), ("4:00:00", 14400), ("1-12", 129600),
                                            ("1-0:30", 88200), ("2-00:00:10", 172810), ("0", None),
                                            ("UNLIMITED", None)])
def test_time_limits_read_as_sbatch_reads_them(limit, seconds):
    from shardwise.launch.slurm import time_limit_seconds

    assert time_limit_seconds(limit) == seconds


def test_write_to_a_folder_is_refused(tmp_path, capsys):
    assert main(["launch", "slurm", "--config", CONFIG, "--nodes", "1", "--nproc-per-node", "2",
                 "--write", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: --write: ")
    assert "safetensors" not in err and "job.sh" in err  # the fix names a script, not a weights file


@pytest.mark.parametrize("args, field", [
    (["--nnodes", "2"], "--nnodes"),  # machines without --nproc: nothing would start them
    (["--nproc", "2", "--nnodes", "2"], "--rdzv-endpoint"),  # machines that do not know where to meet
])
def test_train_over_several_machines_needs_the_processes_and_the_rendezvous(args, field, capsys):
    assert main(["train", "--config", CONFIG, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardwise: error: {field}: ") and err.count("\n") == 1, err


# ---------------------------------------------------------------------------------------------------
# A real Slurm on this machine


def _munge() -> None:
    """A running munged (Slurm's authentication), started if there is none."""
    if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
        return
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)


def _slurm_conf(root: Path, host: str) -> Path:
    """A one-node cluster: this machine, its CPUs, jobs sharing them; the settings Debian's Slurm 22.05 runs with
    in a container (no cgroup process tracking or task binding); requeued jobs start again after 11 s, not 121."""
    (root / "state").mkdir()
    (root / "spool").mkdir()
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=shardwise-test", f"SlurmctldHost={host}", "SlurmUser=root", "AuthType=auth/munge",
        # how long a job's credential lives, and so how long a requeued job waits to start again (120 s by default)
        "AuthInfo=cred_expire=10",
        f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
        f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}", f"SlurmdLogFile={root / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
        "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "ReturnToService=2", "JobRequeue=1",
        f"NodeName={host} CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES", ""]))
    (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
    return conf


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """slurmctld and slurmd of a one-node cluster on this machine, for this module; SLURM_CONF points at it."""
    missing = [b for b in ("slurmctld", "slurmd", "munged", "sbatch", "scontrol") if shutil.which(b) is None]
    if missing or os.geteuid() != 0:
        why = f"Slurm is not installed ({', '.join(missing)})" if missing else "Slurm's daemons need root"
        if REQUIRED:
            pytest.fail(why)
        pytest.skip(f"{why}: .ci/run installs it (apt-get install slurmd slurmctld munge slurm-client)")
    _munge()
    host = socket.gethostname().split(".")[0]
    conf = _slurm_conf(tmp_path_factory.mktemp("slurm"), host)
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    try:
        subprocess.run(["slurmctld", "-f", str(conf)], check=True)
        subprocess.run(["slurmd", "-f", str(conf), "-N", host], check=True)
        _wait(lambda: subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True).stdout.strip()
              in ("idle", "mix"), 60, "the node to be idle")
        yield conf
    finally:
        subprocess.run(["scontrol", "shutdown"], capture_output=True)
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous


def _job(job_id: str) -> dict[str, str]:
    """`scontrol show job`'s fields (a finished job stays listed for MinJobAge, 300 s by default)."""
    line = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", line))


@pytest.mark.multiprocess
def test_a_slurm_job_saves_at_the_warning_is_requeued_and_ends_like_an_uninterrupted_run(slurm, tmp_path):
    whole, run = tmp_path / "whole", tmp_path / "slurm"
    reference = _train(whole, 24, *FSDP2, nproc=2)
    assert reference.returncode == 0, reference.stderr[-3000:]

    script = tmp_path / "job.sh"
    sets = [a for s in [*RUN, f"metrics.out_dir='{run}'"] for a in ("--set", s)]
    job = [*sets, "--config", CONFIG, "--nodes", "1", "--nproc-per-node", "2", "--requeue",
           "--save-final", str(run / "final.safetensors"), "--cpus-per-task", "2", "--sbatch=--comment=shardwise-test"]
    written = _launch(*job, "--write", str(script))
    assert written.returncode == 0, written.stderr
    assert subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True).returncode == 0
    submitted = _launch(*job, "--submit")
    assert submitted.returncode == 0, submitted.stderr
    job_id = re.search(r"submitted job (\d+)", submitted.stdout).group(1)
    shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    assert "CPUs/Task=2 " in shown and "Comment=shardwise-test " in shown, shown  # --cpus-per-task, --sbatch
    try:
        _wait(lambda: (run / "metrics.jsonl").exists() and max(_losses(run), default=0) >= 4, 300, "step 4")
        # what Slurm does --warn-seconds before the time limit: USR1 to the batch shell
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
        _wait(lambda: _job(job_id).get("Restarts") == "1", 300, "the requeue")
        _wait(lambda: _job(job_id).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 300, "the job's end")
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    log = (run / f"slurm-{job_id}.out").read_text()
    assert _job(job_id)["JobState"] == "COMPLETED", log[-3000:]
    assert "requeueing job" in log and "resumed after step" in log, log[-3000:]
    stopped = int(re.search(r"step (\d+): stopped as asked", log).group(1))
    assert 4 <= stopped < 24
    assert _losses(run) == _losses(whole)  # every step, the ones after the requeue too
    a, b = _params(whole), _params(run)
    assert all((a[k] == b[k]).all() for k in a)  # bitwise
    assert read_sample_log(run) == read_sample_log(whole)  # every sample once, in the same steps


@pytest.mark.multiprocess
def test_more_nodes_than_the_partition_has_are_refused_before_sbatch(slurm, tmp_path):
    """Slurm takes a job that asks for more nodes than its partition has and leaves it pending for ever (reason
    PartitionNodeLimit; `launch slurm --submit` said "submitted job N"). The fixture's partition has one node."""
    run = tmp_path / "run"
    queued = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    done = _launch("--config", CONFIG, "--set", f"metrics.out_dir='{run}'", "--nodes", "2", "--nproc-per-node", "1",
                   "--submit")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("shardwise: error: --nodes: 2 nodes, but partition debug lets a job have at most 1 ")
    assert not run.exists()
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == queued


@pytest.mark.multiprocess
def test_a_slurm_job_stopped_at_the_warning_without_requeue_ends_failed_with_its_checkpoint(slurm, tmp_path):
    """Without --requeue, a job the time-limit warning stopped saved and exited 0: Slurm counted it COMPLETED, and a
    job depending on it with afterok (an evaluation) started on a half-trained model. It now ends FAILED, exit 75."""
    from shardwise.checkpoint import latest_checkpoint

    run = tmp_path / "run"
    sets = [a for s in [*RUN[: len(RUN) - len(FSDP2)], f"metrics.out_dir='{run}'"] for a in ("--set", s)]
    submitted = _launch(*sets, "--config", CONFIG, "--nodes", "1", "--nproc-per-node", "1", "--cpus-per-task", "1",
                        "--submit")
    assert submitted.returncode == 0, submitted.stderr
    job_id = re.search(r"submitted job (\d+)", submitted.stdout).group(1)
    try:
        _wait(lambda: (run / "metrics.jsonl").exists() and max(_losses(run), default=0) >= 2, 300, "step 2")
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
        _wait(lambda: _job(job_id).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 300, "the job's end")
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    log = (run / f"slurm-{job_id}.out").read_text()
    assert (_job(job_id)["JobState"], _job(job_id)["ExitCode"]) == ("FAILED", "75:0"), log[-3000:]
    assert "the run stopped before its last step" in log and "requeueing" not in log, log[-3000:]
    stopped = int(re.search(r"step (\d+): stopped as asked", log).group(1))
    assert 2 <= stopped < 24 and latest_checkpoint(run).name == f"step_{stopped}"
