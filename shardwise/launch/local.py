"""The launcher behind `shardwise train --nproc` (torchrun on this machine, as one machine of a job or the whole
job), and `shardwise launch local`: several such machines on this one, for trying multi-machine and elastic jobs
without a cluster.

No torch here: the launcher starts torchrun (shardwise.torchrun) as a process and only passes signals on.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from shardwise.config import check_file_to_write, check_restarts, fit_nodes, load_config
from shardwise.errors import ConfigError
from shardwise.run_folder import check_resume


@dataclass(frozen=True)
class Rendezvous:
    """Where the machines of a job meet: torchrun's c10d rendezvous."""

    nodes: tuple[int, int]
    """(MIN, MAX) machines; MIN < MAX is an elastic job."""
    endpoint: str
    """HOST:PORT of the rendezvous store (hosted by the torchrun agent on that host)."""
    run_id: str
    """The job's id, the same on every machine."""
    conf: str = ""
    """torchrun's --rdzv-conf (KEY=VALUE,...)."""

    @property
    def elastic(self) -> bool:
        return self.nodes[0] < self.nodes[1]

    def torchrun_args(self) -> list[str]:
        low, high = self.nodes
        args = [f"--nnodes={low}:{high}" if self.elastic else f"--nnodes={low}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}"]
        return args + ([f"--rdzv-conf={self.conf}"] if self.conf else [])


def node_range(text: str, field: str = "--nnodes") -> tuple[int, int]:
    """N or MIN:MAX machines (the command line's `field`) as (MIN, MAX)."""
    try:
        low, colon, high = text.partition(":")
        nodes = (int(low), int(high if colon else low))  # "1:" has no MAX
    except ValueError:
        nodes = (0, 0)
    if not 1 <= nodes[0] <= nodes[1]:
        raise ConfigError(field, f"{text!r} is not a number of machines or a range of them",
                          f"set {field} N, or MIN:MAX with 1 <= MIN <= MAX for an elastic job")
    return nodes


def ranks_per_node(gpus_per_node: int, nproc_per_node: int) -> int:
    """Ranks on each machine: --nproc-per-node, else one per GPU (--gpus-per-node)."""
    for flag, count in (("--gpus-per-node", gpus_per_node), ("--nproc-per-node", nproc_per_node)):
        if count < 0:
            meaning = "no GPUs" if flag == "--gpus-per-node" else "one process per GPU"
            raise ConfigError(flag, f"{count} is below 0", f"set {flag} >= 0 (0: {meaning})")
    if not (nproc_per_node or gpus_per_node):
        raise ConfigError("--nproc-per-node", "a CPU job (--gpus-per-node 0) needs its ranks per node",
                          "set --nproc-per-node, or --gpus-per-node for one rank per GPU")
    if gpus_per_node and nproc_per_node > gpus_per_node:
        # each rank takes the GPU of its local rank (cuda:LOCAL_RANK): the ranks past the node's last GPU have none
        # and fail once the job has waited in the queue and started
        raise ConfigError("--nproc-per-node", f"{nproc_per_node} processes per node, but each rank runs on a GPU of "
                          f"its own and a node has {gpus_per_node} (--gpus-per-node)",
                          f"set --nproc-per-node {gpus_per_node} or less, or --gpus-per-node {nproc_per_node}")
    return nproc_per_node or gpus_per_node


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0, rendezvous: Rendezvous | None = None,
                 stopped_exit_code: int = 0, stopped_marker: Path | None = None) -> int:
    """Re-run this command under torchrun (shardwise.torchrun) with `nproc` processes on this machine; SIGTERM and
    SIGUSR1 (Slurm's warning before the time limit) stop it cleanly.

    rendezvous: where the machines meet when the job spans several, each running this (else --standalone).
    stopped_exit_code: the exit code when a signal stopped the job and the ranks saved (what a scheduler that
    only reruns failed work, as a Kubernetes Job does, needs to see instead of 0).
    stopped_marker: the run folder's STOPPED_FILE: where given, the job counts as stopped only if its ranks wrote it
    (a signal during the last step ends a run that is complete), and also when it says that a signal to another
    machine stopped it.
    """
    cmd, env = torchrun_command(nproc, argv, max_restarts, rendezvous)
    torchrun = subprocess.Popen(cmd, env=env)
    stop = [signal.SIGTERM, signal.SIGUSR1]
    stopped = []

    def stop_ranks(signum, frame):
        # the first of each signal only: the ranks are stopping after it. A repeated one (a second `kill`) reached a
        # rank that had saved and put its handlers back, or torchrun once the ranks had exited, and the saved job
        # ended with exit 1 and torchrun's traceback. (A SIGTERM after a SIGUSR1 still goes on: a rank that had not
        # yet installed its handler ignored the SIGUSR1.)
        if signum not in stopped:
            _stop_ranks(torchrun.pid, signum)
        stopped.append(signum)

    previous = {s: signal.signal(s, stop_ranks) for s in stop}
    try:
        try:
            code = torchrun.wait()
        except KeyboardInterrupt:
            # Ctrl-C reached torchrun too, which is stopping the ranks: returning now gave the prompt back while
            # they lived on (up to 30 s), the run folder still locked, their last lines printed after it. A second
            # Ctrl-C stops them at once.
            try:
                torchrun.wait()
            except KeyboardInterrupt:
                take_away(torchrun.pid)
                torchrun.wait()
            raise
        if code < 0:
            # torchrun itself died of a signal (a stop before the ranks existed, which it does not pass on): without
            # a word, and exit 241 for SIGTERM's -15. A shell's code for it, 128 + the signal, and a line
            print(f"shardwise: torchrun was ended by {signal.Signals(-code).name} (nothing trained after that)",
                  file=sys.stderr)
            return 128 - code
        early = stopped and (stopped_marker is None or stopped_marker.is_file())
        return stopped_exit_code if code == 0 and (early or stopped_by_signal(stopped_marker)) else code
    finally:
        # after a stop, a repeated stop signal has nothing left to stop: the command is returning its exit code.
        # Put back, the default handler let one kill the command itself on its way out (exit -15 after a good save)
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_IGN if stopped else handler)


def stopped_by_signal(marker: Path | None) -> bool:
    """Whether the run's STOPPED_FILE says a signal stopped it before its last step, on whichever machine it arrived:
    the ranks agree on a stop, so every machine's ranks saved and ended, signalled or not (train.stop_after: False)."""
    try:
        return marker is not None and json.loads(marker.read_text()).get("signal", False)
    except (OSError, ValueError):
        return False


LAUNCHED = "SHARDWISE_LAUNCHED"
"""Set in the ranks' environment by shardwise's launcher (torchrun_command): it speaks for its machine (a Ctrl-C)."""


def torchrun_command(nproc: int, argv: list[str], max_restarts: int = 0, rendezvous: Rendezvous | None = None,
                     module: str = "shardwise") -> tuple[list[str], dict[str, str]]:
    """The command (and its environment) that runs `python -m module argv` as `nproc` ranks under torchrun
    (shardwise.torchrun); the cores are split between the ranks unless OMP_NUM_THREADS says otherwise."""
    where = ["--standalone"] if rendezvous is None else rendezvous.torchrun_args()
    cmd = [sys.executable, "-m", "shardwise.torchrun", *where, f"--nproc_per_node={nproc}",
           f"--max-restarts={max_restarts}", "-m", module, *argv]
    env = dict(os.environ, **{LAUNCHED: "1"})
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return cmd, env



def _stop_ranks(torchrun_pid: int, signum: int = signal.SIGTERM) -> None:
    """Pass the signal on to the ranks, not to torchrun: each rank finishes its step, saves and exits 0, and
    torchrun then exits 0 too. Signalled itself, torchrun signals the ranks, SIGKILLs them after 30 s whether or not
    their save is done, and exits non-zero with a traceback (it ignores SIGUSR1: shardwise.torchrun). Before the
    ranks exist, torchrun gets SIGTERM."""
    children = _children(torchrun_pid)
    for pid in children or [torchrun_pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum if children else signal.SIGTERM)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux's /proc; elsewhere none are found)."""
    children = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError):
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (command)": state, ppid, ...
            if int(fields[1]) == pid:
                children.append(int(stat.split("/")[2]))
    return children




def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------
# `shardwise launch local`


def add_local_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", default="2", metavar="N|MIN:MAX",
                   help="machines to play: one torchrun agent each (MAX of them for MIN:MAX, an elastic job)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes (ranks) per machine")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="restarts of the job when a rank fails or a machine leaves (default 0, 3 when elastic)")
    p.add_argument("--last-call", type=float, default=10.0, metavar="SECONDS",
                   help="how long an elastic rendezvous waits for more machines once it has MIN (torchrun's "
                        "last_call_timeout; these machines start together)")
    p.add_argument("--save-final", metavar="PATH", help="write the final parameters, unsharded, to safetensors")
    p.add_argument("--leave", metavar="MACHINE@STEP",
                   help="take machine MACHINE (1 or more) away once the run has logged step STEP, as a lost node: "
                        "its agent and ranks are killed (SIGKILL) and an elastic job goes on without it")
    p.set_defaults(run=run_launch_local)


def run_launch_local(args: argparse.Namespace) -> int:
    """`shardwise launch local`: every world the job may have checked, then its machines started."""
    cfg = load_config(args.config, args.overrides)
    nodes = node_range(args.nnodes)
    if args.nproc_per_node < 1:
        raise ConfigError("--nproc-per-node", f"{args.nproc_per_node} processes", "set --nproc-per-node 1 or more")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ConfigError("--max-restarts", f"{args.max_restarts} < 0", "give 0 or more")
    if not 0 <= args.last_call < math.inf:
        raise ConfigError("--last-call", f"{args.last_call} is not a finite number of seconds >= 0", "give e.g. 10")
    if args.save_final:
        check_file_to_write("--save-final", args.save_final)
    leave = leave_request(args.leave, nodes[1])
    if leave is not None and leave[1] >= cfg.train.steps:
        raise ConfigError("--leave", f"step {leave[1]} is not before the run's last (train.steps = {cfg.train.steps})",
                          "name a step the run passes, e.g. half of train.steps")
    fit_nodes(cfg, args.nproc_per_node, nodes)  # before any machine starts
    check_restarts(cfg, args.max_restarts or 0)
    check_resume(cfg)
    # what is wrong with the data, once, before any machine starts (as `train --nproc` on one machine): in the ranks
    # it was each machine's error line, on every restart, then the rendezvous' traceback. Every machine here shares
    # this one's files; cfg is fitted to the largest world, and every world of an elastic range has its global batch
    from shardwise.data import prepare  # tokenizers and numpy; not torch

    prepare(cfg, cfg.parallel.dp)
    return run_local(args, nodes, Path(cfg.metrics.out_dir))


def leave_request(text: str | None, machines: int) -> tuple[int, int] | None:
    """--leave MACHINE@STEP as (machine, step); the first machine hosts the rendezvous and cannot leave."""
    if text is None:
        return None
    machine, _, step = text.partition("@")
    if not (machine.isdigit() and step.isdigit() and 1 <= int(machine) < machines and int(step) >= 1):
        raise ConfigError("--leave", f"{text!r} is not MACHINE@STEP with 1 <= MACHINE < {machines} and STEP >= 1",
                          "name a machine other than the first (it hosts the rendezvous), e.g. --leave 1@8")
    return int(machine), int(step)


def run_local(args: argparse.Namespace, nodes: tuple[int, int], out_dir: Path) -> int:
    """Start the job's machines, each a session of its own; the first (which hosts the rendezvous) ends the job and
    its exit code is the job's. With --leave, one machine is killed mid-run (out_dir's metrics.jsonl says when)."""
    low, high = nodes
    leave = leave_request(args.leave, high)
    endpoint, run_id = f"127.0.0.1:{free_port()}", f"local-{uuid.uuid4().hex[:8]}"
    metrics = out_dir / "metrics.jsonl"
    logged = metrics.stat().st_size if metrics.is_file() else 0  # an earlier run's lines: not this job's steps
    train = [sys.executable, "-m", "shardwise", "train", *(["--config", args.config] if args.config else []),
             *[f"--set={o}" for o in args.overrides], "--nproc", str(args.nproc_per_node),
             "--nnodes", f"{low}:{high}" if low < high else str(low), "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
             *(["--max-restarts", str(args.max_restarts)] if args.max_restarts is not None else [])]
    machines = []
    for i in range(high):
        # Every machine's address matches the endpoint here, so each says whether it hosts the rendezvous's store
        # (the first does: it ends the job). The first writes the final parameters. Each is a session of its own,
        # so that killing its process group takes that machine away (its agent and ranks) and nothing else.
        conf = f"is_host={int(i == 0)}" + (f",last_call_timeout={args.last_call:g}" if low < high else "")
        save = ["--save-final", args.save_final] if args.save_final and i == 0 else []
        machines.append(subprocess.Popen([*train, "--rdzv-conf", conf, *save], start_new_session=True))
        print(f"shardwise: machine {i}: pid {machines[-1].pid}", file=sys.stderr, flush=True)
    stop = [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT]
    previous = {s: signal.signal(s, lambda signum, frame: _signal_all(machines, signum)) for s in stop}
    try:
        if leave is not None:
            machine, step = leave
            while machines[0].poll() is None and _last_step(metrics, logged) < step:
                if metrics.is_file() and metrics.stat().st_size < logged:
                    logged = 0  # the job started the log again, dropping the earlier run's steps it does over
                time.sleep(0.1)
            if machines[0].poll() is None:
                processes = take_away(machines[machine].pid)
                print(f"shardwise: machine {machine} left after step {step} ({processes} processes killed)",
                      file=sys.stderr, flush=True)
        codes = [m.wait() for m in machines]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("shardwise: machines ended with exit codes " + ", ".join(map(str, codes)), file=sys.stderr)
    return codes[0]


def _last_step(metrics: Path, offset: int = 0) -> int:
    """The last step a run's metrics.jsonl has logged past byte `offset` (0 before its first)."""
    try:
        with metrics.open("rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    steps = []
    for line in (x for x in lines if x.startswith("{") and x.endswith("}")):
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            steps.append(json.loads(line).get("step", 0))
    return max(steps, default=0)


def take_away(pid: int) -> int:
    """SIGKILL a machine's launcher and every process under it (torchrun's agent, and its ranks, which torchrun
    starts in sessions of their own: a process group would miss them), as if the machine had gone; how many."""
    tree, frontier = [], [pid]
    while frontier:
        tree += frontier
        frontier = [child for parent in frontier for child in _children(parent)]
    for p in tree:  # parents first: none of them is left to start another
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return len(tree)


def _signal_all(machines: list[subprocess.Popen], signum: int) -> None:
    """Pass a stop on to every machine's launcher (which passes it to its ranks: they save and exit 0)."""
    for m in machines:
        with contextlib.suppress(ProcessLookupError):
            os.kill(m.pid, signal.SIGTERM if signum == signal.SIGINT else signum)
