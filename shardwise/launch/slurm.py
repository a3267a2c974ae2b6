"""`shardwise launch slurm`: an sbatch script that runs a job on a Slurm allocation.

The script runs one task per node (`srun --ntasks-per-node=1`), with --cpus-per-task CPUs when given (else the
site's default, often one CPU for torchrun's agent and all its ranks). Each task is `shardwise train --nproc P
--nnodes N`: torchrun with its c10d rendezvous on the allocation's first node (`scontrol show hostnames`) and the
job id as the rendezvous id, so the nodes find each other from Slurm's own variables, never from guessed ones. Every
path in it is absolute: the run folder (metrics.out_dir, where the checkpoints and the job's log go) must be on
storage every node sees.

Stopping and requeue. `#SBATCH --signal=B:USR1@S` has Slurm signal the batch shell S seconds before the time limit
(`scancel --signal=USR1 --batch JOB` does the same by hand). The shell passes USR1 on to every process of the job
step (`scancel --signal=USR1 JOB`): shardwise's launcher and torchrun's agent ignore it, and each rank finishes its
step, the ranks save together and exit 0 (checkpoint.StopSignal). With --requeue the shell then requeues the job
(`scontrol requeue`), and the job, started again under the same id, resumes from its newest checkpoint as any run
does (checkpoint.resume), the data loader where it stopped.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from shardwise.config import STOPPED_FILE, check_file_to_write, fit_world, load_config, validate_parallel
from shardwise.errors import ConfigError
from shardwise.launch.local import ranks_per_node
from shardwise.run_folder import check_resume

STOP_SIGNAL = "USR1"
STOPPED_EXIT_CODE = 75
"""Without --requeue, the script exits with this (EX_TEMPFAIL, as `launch k8s`'s pods) when the warning stopped the
run and it saved: Slurm then counts the job FAILED, not COMPLETED (an afterok dependency does not start on a half
run), as it would have counted it TIMEOUT had it run into the limit."""
# file systems that every node of a cluster mounts (the run folder of a multi-node job must be on one)
SHARED_FILE_SYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "fuse.glusterfs",
                       "wekafs", "9p", "virtiofs", "fuse.juicefs", "fuse.sshfs", "cifs", "smb3")


@dataclass(frozen=True)
class SlurmJob:
    """What the sbatch script says: the allocation, the `shardwise train` command, stopping and requeue."""

    train_args: tuple[str, ...]  # --config FILE and --save-final PATH (absolute), the --set overrides
    nodes: int
    nproc_per_node: int
    gpus_per_node: int
    out_dir: Path
    workdir: Path
    name: str = "shardwise"
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    requeue: bool = False
    warn_seconds: int = 120
    cpus_per_task: int | None = None  # the CPUs of the one task per node: torchrun's agent and its ranks
    sbatch: tuple[str, ...] = ()  # further #SBATCH options, as given (--sbatch)


MAX_SIGNAL_SECONDS = 65535
"""sbatch --signal=<sig>@<sig_time>: "sig_time must be an integer between 0 and 65535" (sbatch(1))."""
SLURM_NAME = re.compile(r"[A-Za-z0-9_.,+-]+")
"""What a job name, partition (or a comma-separated list of them) or account is written with here."""
OWN_OPTIONS = {
    "--job-name": "--job-name", "--nodes": "--nodes", "--ntasks-per-node": "", "--ntasks": "",
    "--gpus-per-node": "--gpus-per-node", "--cpus-per-task": "--cpus-per-task", "--partition": "--partition",
    "--time": "--time", "--account": "--account", "--chdir": "", "--output": "", "--error": "", "--open-mode": "",
    "--signal": "--warn-seconds", "--requeue": "--requeue", "--no-requeue": "--requeue"}
"""The sbatch options the script writes itself, and the flag of `launch slurm` that sets each ("": none, the script
depends on it): an --sbatch option repeating one is refused rather than left to override it."""
SBATCH_PREFIXES = ("--gpus", "--ntasks")
"""sbatch's own options whose names begin one of OWN_OPTIONS' (--gpus of --gpus-per-node): sbatch reads an option
(an #SBATCH line's too) with getopt_long, which takes an exact name as itself and a unique beginning of one as that
option (--sig=USR2@60 is --signal), so only these are not read as abbreviations."""
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def time_limit_seconds(text: str) -> int | None:
    """--time as sbatch reads it, in seconds (None: unlimited): "minutes", "minutes:seconds",
    "hours:minutes:seconds", "days-hours", "days-hours:minutes", "days-hours:minutes:seconds"; 0, UNLIMITED or
    INFINITE for none (sbatch(1))."""
    if text.strip().upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.fullmatch(text.strip())
    if m is None:
        raise ConfigError("--time", f"{text!r} is not a Slurm time limit", "write e.g. 90 (minutes), 4:00:00 or "
                          "1-12:00:00")
    days, a, b, c = (int(g) if g else 0 for g in m.groups())
    if m.group(1):  # days-hours[:minutes[:seconds]]
        seconds = ((days * 24 + a) * 60 + b) * 60 + c
    elif m.group(4):  # hours:minutes:seconds
        seconds = (a * 60 + b) * 60 + c
    else:  # minutes[:seconds]
        seconds = a * 60 + b
    return seconds or None  # "A time limit of zero requests that no time limit be imposed"


def add_slurm_arguments(p: argparse.ArgumentParser) -> None:
    """The scheduler's flags; the job's own (--config, --set) are the CLI's, as for `shardwise train`."""
    p.add_argument("--nodes", type=int, required=True, help="nodes to allocate")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (--gpus-per-node to Slurm)")
    p.add_argument("--nproc-per-node", type=int, default=0,
                   help="processes per node; default: one per GPU (required for a CPU job)")
    p.add_argument("--partition", help="Slurm partition")
    p.add_argument("--time", help="time limit, as Slurm writes it (e.g. 4:00:00)")
    p.add_argument("--account", help="Slurm account to charge")
    p.add_argument("--save-final", metavar="PATH",
                   help="the job writes its final parameters, unsharded, to safetensors (shardwise train's flag)")
    p.add_argument("--job-name", default="shardwise", help="the job's name in squeue")
    p.add_argument("--cpus-per-task", type=int, metavar="N",
                   help="CPUs per node for torchrun's agent and its ranks (#SBATCH --cpus-per-task; srun's too); "
                        "default: the site's (often one, for all of them)")
    p.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                   help="another #SBATCH line, e.g. --sbatch=--exclusive --sbatch=--qos=high (repeatable; write "
                        "it with '=', as the option starts with --)")
    p.add_argument("--requeue", action="store_true",
                   help="after the save that the time-limit warning asks for, requeue the job; it resumes")
    p.add_argument("--warn-seconds", type=int, default=120,
                   help="how long before the time limit Slurm asks the ranks to save (their step and the save "
                        "must fit in it)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--submit", action="store_true", help="write the script into the run folder and sbatch it")
    out.add_argument("--write", metavar="PATH", help="write the script to PATH")
    out.add_argument("--dry-run", action="store_true", help="print the script (what happens with neither flag)")
    p.set_defaults(run=run_slurm)


def slurm_job(args: argparse.Namespace) -> SlurmJob:
    """The job the arguments describe, every check made before anything is written or submitted."""
    cfg = load_config(args.config, args.overrides)
    if args.nodes < 1:
        raise ConfigError("--nodes", f"{args.nodes} is not a number of nodes", "set --nodes 1 or more")
    per_node = ranks_per_node(args.gpus_per_node, args.nproc_per_node)
    world = args.nodes * per_node
    fit_world(cfg, world)
    if cfg.parallel.world_size != world:
        raise ConfigError("--nodes", f"{args.nodes} nodes x {per_node} processes = {world} ranks, but the layout's "
                          f"degrees (dp_replicate x dp_shard x tp x pp x cp) multiply to {cfg.parallel.world_size}",
                          f"allocate nodes x processes = {cfg.parallel.world_size}, or change [parallel]")
    validate_parallel(cfg, world)
    check_resume(cfg)  # the run folder as this machine sees it (a shared file system: as the job will)
    if args.warn_seconds < 1:
        raise ConfigError("--warn-seconds", f"{args.warn_seconds} leaves no time to save",
                          "set it to 1 or more: a step and a save must fit in it (the default is 120)")
    if args.warn_seconds > MAX_SIGNAL_SECONDS:
        raise ConfigError("--warn-seconds", f"{args.warn_seconds} is more than sbatch's --signal takes "
                          f"({MAX_SIGNAL_SECONDS} s)", f"set it to {MAX_SIGNAL_SECONDS} or less")
    limit = time_limit_seconds(args.time) if args.time is not None else None
    if limit is not None and args.warn_seconds >= limit:
        raise ConfigError("--warn-seconds", f"{args.warn_seconds} s is not within the job's time limit "
                          f"(--time {args.time} = {limit} s)", "warn a few minutes before the limit, e.g. 120")
    for flag, value in (("--job-name", args.job_name), ("--partition", args.partition),
                        ("--account", args.account)):
        if value is not None and not SLURM_NAME.fullmatch(value):
            raise ConfigError(flag, f"{value!r} is not a Slurm name (letters, digits and - _ . , + only: an "
                              "#SBATCH line would split or lose it)", "give the name as Slurm lists it")
    if args.cpus_per_task is not None and args.cpus_per_task < 1:
        raise ConfigError("--cpus-per-task", f"{args.cpus_per_task} is not a number of CPUs",
                          "give 1 or more (the CPUs for the agent and all ranks of a node), or leave it out")
    for option in args.sbatch:
        _check_sbatch_option(option)
    for flag, path, example in (("--save-final", args.save_final, "runs/my-run/final.safetensors"),
                                ("--write", args.write, "runs/my-run/job.sh")):
        if path:
            check_file_to_write(flag, path, example)
    if args.requeue and not (cfg.checkpoint.enabled and cfg.checkpoint.resume):
        field = "checkpoint.enabled" if not cfg.checkpoint.enabled else "checkpoint.resume"
        raise ConfigError(field, "--requeue starts the job again, which goes on from its newest checkpoint only "
                          "with checkpoints saved and resumed", f"set {field} = true")
    out_dir = Path(cfg.metrics.out_dir).absolute()
    for name, path in (("metrics.out_dir", out_dir), ("the working folder", Path.cwd())):
        if any(c.isspace() or c in "'\"" for c in str(path)):  # #SBATCH --output= and --chdir= take no quoting
            raise ConfigError(name, f"{str(path)!r} has blanks or quotes, which an #SBATCH line cannot hold",
                              "use a path without them")
    train_args = [*(["--config", str(Path(args.config).absolute())] if args.config else []),
                  *[f"--set={o}" for o in args.overrides], f"--set=metrics.out_dir={json.dumps(str(out_dir))}",
                  *(["--save-final", str(Path(args.save_final).absolute())] if args.save_final else [])]
    job = SlurmJob(tuple(train_args), args.nodes, per_node, args.gpus_per_node, out_dir, Path.cwd(),
                   args.job_name, args.partition, args.time, args.account, args.requeue, args.warn_seconds,
                   args.cpus_per_task, tuple(args.sbatch))
    return job


def _check_sbatch_option(option: str) -> None:
    """An --sbatch OPTION that one #SBATCH line holds, and not one the script sets itself."""
    if not option.startswith("--") or len(option) < 3 or any(c in option for c in "\r\n"):
        raise ConfigError("--sbatch", f"{option!r} is not a long sbatch option on one line (an #SBATCH line takes "
                          "one, starting with --)", "write e.g. --sbatch=--exclusive or --sbatch=--qos=high")
    given = own = option.split("=", 1)[0].split()[0]
    if own not in OWN_OPTIONS and own not in SBATCH_PREFIXES:
        # an abbreviation (getopt_long's): --sig=USR2@60 replaced the script's --signal, --outp= its --output
        own = next((o for o in OWN_OPTIONS if o.startswith(own)), own)
    if own in OWN_OPTIONS:
        flag = OWN_OPTIONS[own]
        named = own if given == own else f"{given} (sbatch reads it as {own})"
        raise ConfigError("--sbatch", f"{named} is written by the script itself" + ("" if flag else ", which "
                          "depends on it"), f"use launch slurm's {flag}" if flag else f"leave {given} out")


def script(job: SlurmJob) -> str:
    """The sbatch script for `job`."""
    cpus = [f"--cpus-per-task={job.cpus_per_task}"] if job.cpus_per_task else []
    directives = [f"--job-name={job.name}", f"--nodes={job.nodes}", "--ntasks-per-node=1", *cpus,
                  *([f"--gpus-per-node={job.gpus_per_node}"] if job.gpus_per_node else []),
                  *([f"--partition={job.partition}"] if job.partition else []),
                  *([f"--time={job.time}"] if job.time else []),
                  *([f"--account={job.account}"] if job.account else []),
                  f"--chdir={job.workdir}", f"--output={job.out_dir}/slurm-%j.out", "--open-mode=append",
                  f"--signal=B:{STOP_SIGNAL}@{job.warn_seconds}", "--requeue" if job.requeue else "--no-requeue",
                  *job.sbatch]
    train = [sys.executable, "-m", "shardwise", "train", *job.train_args, "--nproc", str(job.nproc_per_node),
             "--nnodes", str(job.nodes)]
    lines = [
        "#!/bin/bash",
        f"# written by `shardwise launch slurm`: {job.nodes} node(s) x {job.nproc_per_node} process(es), run folder "
        f"{job.out_dir}",
        *(f"#SBATCH {d}" for d in directives),
        "set -u",
        "",
        "# torchrun's c10d rendezvous on the allocation's first node, on a port of the job's own",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "port=$((20000 + SLURM_JOB_ID % 12000))",  # below the kernel's ephemeral ports (32768 on)
        "",
        f"# {STOP_SIGNAL}: the time limit is {job.warn_seconds} s away (or `scancel --signal={STOP_SIGNAL} --batch`):"
        " every process of",
        "# the step gets it; the ranks finish their step, save and exit 0 (srun --kill-on-bad-exit would kill the",
        "# other nodes' ranks at the first that exited otherwise)",
        "stopping=0",
        f"stop() {{ stopping=1; echo \"shardwise: {STOP_SIGNAL}: saving and stopping\"; "
        f"scancel --signal={STOP_SIGNAL} \"$SLURM_JOB_ID\"; }}",
        f"trap stop {STOP_SIGNAL}",
        "",
        # srun is given the CPUs too: some Slurm versions (22.05 among them) do not pass sbatch's on to it
        f"srun {shlex.join(['--ntasks-per-node=1', *cpus, '--kill-on-bad-exit=1', *train])} \\",
        '    --rdzv-endpoint "$head:$port" --rdzv-id "$SLURM_JOB_ID" &',
        "step=$!",
        "# wait returns early when a trapped signal arrives: wait again until the step has ended",
        'while true; do wait "$step"; code=$?; kill -0 "$step" 2>/dev/null || break; done',
    ]
    # the ranks write it when they stopped before the last step: a warning during the last step ends a run that is
    # complete, neither requeued nor failed (train.stop_after alone ends the job as before)
    stopped = shlex.quote(str(job.out_dir / STOPPED_FILE))
    if job.requeue:
        lines += [
            f'if [ "$stopping" = 1 ] && [ "$code" = 0 ] && [ -f {stopped} ]; then',
            '    echo "shardwise: saved; requeueing job $SLURM_JOB_ID (it resumes from the newest checkpoint)"',
            '    scontrol requeue "$SLURM_JOB_ID"',
            "fi",
        ]
    else:  # exit 0 would make the job COMPLETED, and an afterok dependency (an evaluation) start on a half run
        lines += [
            f'if [ "$stopping" = 1 ] && [ "$code" = 0 ] && [ -f {stopped} ]; then',
            '    echo "shardwise: the run stopped before its last step; the job ends FAILED (exit code '
            f'{STOPPED_EXIT_CODE}), not COMPLETED: submit it again to go on from its newest checkpoint"',
            f"    code={STOPPED_EXIT_CODE}",
            "fi",
        ]
    lines.append('exit "$code"')
    return "\n".join(lines) + "\n"


def file_system(path: Path) -> str:
    """The type of the file system `path` is on (/proc/mounts: the longest mount point above it)."""
    best, kind = "", "unknown"
    path = path.absolute()
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (path == Path(point) or Path(point) in path.parents) and len(point) > len(best):
            best, kind = point, fields[2]
    return kind


def partition_nodes(partition: str | None) -> tuple[str, int] | None:
    """(the partitions, the most nodes a job may have in any of them) as `scontrol show partition` reads them: the
    named ones (a comma-separated list: Slurm runs the job in whichever takes it) or the default; None where
    scontrol cannot tell (not on PATH, no controller, an unknown partition: sbatch names that itself)."""
    if shutil.which("scontrol") is None:
        return None
    done = subprocess.run(["scontrol", "-o", "show", "partition"], capture_output=True, text=True)
    if done.returncode:
        return None
    shown = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in done.stdout.splitlines()]
    wanted = partition.split(",") if partition else None
    limits = {}
    for fields in shown:
        name = fields.get("PartitionName")
        if (name in wanted) if wanted else fields.get("Default") == "YES":
            total, most = fields.get("TotalNodes", ""), fields.get("MaxNodes", "UNLIMITED")
            if not total.isdigit():
                return None
            limits[name] = int(total) if not most.isdigit() else min(int(total), int(most))
    if not limits or wanted and len(limits) < len(wanted):
        return None
    return ",".join(limits), max(limits.values())


def run_slurm(args: argparse.Namespace) -> int:
    job = slurm_job(args)
    if args.submit:  # Slurm takes a job larger than its partition and leaves it pending (reason PartitionNodeLimit)
        allowed = partition_nodes(job.partition)
        if allowed and job.nodes > allowed[1]:
            names, most = allowed
            where = f"partitions {names} let" if "," in names else f"partition {names} lets"
            raise ConfigError("--nodes", f"{job.nodes} nodes, but {where} a job have at most {most} (scontrol show "
                              "partition): Slurm would leave it pending for ever",
                              f"ask for at most {most} node{'s' if most > 1 else ''}, or name a larger partition "
                              "with --partition")
    kind = file_system(job.out_dir)
    if job.nodes > 1 and kind not in SHARED_FILE_SYSTEMS:
        print(f"shardwise: warning: metrics.out_dir {job.out_dir} is on {kind}, which other nodes may not see: "
              "the checkpoints of a multi-node job must be on shared storage", file=sys.stderr)
    text = script(job)
    if not (args.submit or args.write):
        if not job.out_dir.is_dir():  # --submit and --write make it
            print(f"shardwise: warning: the run folder {job.out_dir} does not exist: make it (mkdir -p) before "
                  "sbatch, which opens the job's log there (--output) before the script runs and fails the job, "
                  "with no log, without it", file=sys.stderr)
        print(text, end="")
        return 0
    if args.submit and shutil.which("sbatch") is None:
        raise ConfigError("--submit", "sbatch is not on PATH (this is not a Slurm login node)",
                          "write the script with --write PATH and submit it where Slurm runs")
    job.out_dir.mkdir(parents=True, exist_ok=True)  # Slurm writes the job's log there from its first line
    path = Path(args.write) if args.write else job.out_dir / "slurm-job.sh"
    path.write_text(text)
    path.chmod(0o755)
    if not args.submit:
        print(f"wrote {path}; submit it with: sbatch {path}")
        return 0
    done = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if done.returncode:
        print(f"shardwise: error: sbatch refused {path}: {done.stderr.strip()}", file=sys.stderr)
        return done.returncode
    job_id = done.stdout.strip().split(";")[0]
    print(f"submitted job {job_id} ({path}); its log: {job.out_dir}/slurm-{job_id}.out")
    return 0

