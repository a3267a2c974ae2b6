"""Process-group set-up from torchrun's environment, what a failed collective means, a shardwise error handed to
the launcher, and a spawner of functions on N local gloo ranks (for tests and benchmarks)."""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # before any group exists: see shutdown
import torch.multiprocessing as mp

from shardwise.launch.local import free_port


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    store: dist.Store | None = None
    """The job's key-value store (None for a world of one): used to take a roll call when a collective fails."""
    timeout_s: float = 600.0
    """The process group's timeout: how long a collective may wait before it fails."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's largest on 64-bit: blocks above it are always mapped afresh


def keep_host_memory() -> bool:
    """Let glibc's allocator keep freed blocks of up to 32 MB for reuse instead of returning them to the kernel.

    A training step on the CPU frees and allocates the same activation-sized blocks (tens of MB) every step. By
    default glibc maps each one afresh and unmaps it when freed, so every page of it faults again on its first
    write: ~45,000 faults and ~0.07 s of kernel time per step of benchmarks/peer_torchtitan.py's debug model.
    This is what the allocators PyTorch's CPU guides recommend instead (jemalloc, tcmalloc; the
    `torch.backends.xeon.run_cpu` launcher preloads them) do; glibc's own settings do it without a new library.
    Memory freed stays with the process, as it does in CUDA's caching allocator. Returns False where the C
    library is not glibc (the settings are then left alone)."""
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def release_memory() -> None:
    """Hand back what a finished run's allocators kept (keep_host_memory's blocks, CUDA's cache) while this
    process goes on: a run trained in a process that then does other work (verify's single-device reference,
    beside the ranks it launches next)."""
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing was kept beyond its own default


def _libc():
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def set_deterministic() -> None:
    """Deterministic kernels for this process, as torchtitan's `set_determinism` sets them: every operator's
    deterministic implementation (one without raises), cuDNN's deterministic algorithms without its benchmark, and a
    fixed cuBLAS workspace (read when cuBLAS starts, so before the first matmul on the GPU)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def init_distributed(device_choice: str = "auto", timeout_s: float = 600.0, group_of_one: bool = False) -> DistEnv:
    """Join the job torchrun started (NCCL on GPU, gloo on CPU); a plain run is a world of one, with a process
    group of its own only when `group_of_one` (FSDP2 on one device, for its CPU offload, needs a mesh)."""
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    store = None
    timeout = datetime.timedelta(seconds=timeout_s)
    if world > 1 or group_of_one:
        time_out_new_groups(timeout)
    if (world > 1 or group_of_one) and not dist.is_initialized():
        store = _attempt_store(timeout) if world > 1 else dist.HashStore()
        dist.init_process_group(
            "nccl" if use_cuda else "gloo", store=store, rank=rank, world_size=world,
            timeout=timeout, device_id=device if use_cuda else None,
        )
    return DistEnv(rank, world, local_rank, device, store, timeout_s)


def time_out_new_groups(timeout: datetime.timedelta) -> None:
    """Give the process groups made from now on without a timeout of their own the job's: the device mesh's dims and
    flattened dims (torch's new_group with timeout=None), the async checkpoint writer's group.

    torch gives such a group c10d's module default (30 min for gloo, 10 for NCCL), not the default group's timeout.
    Every layout with a mesh of 2 dims or more (FSDP x TP, HSDP, pp x dp, ...) runs its collectives on such groups,
    so a hung rank there was an error only after 30 minutes, whatever train.collective_timeout_s said (torchtitan
    sets each mesh group's timeout itself: set_pg_timeouts). c10d reads these module globals at each new group."""
    c10d = dist.distributed_c10d
    c10d.default_pg_timeout = timeout
    c10d.default_pg_nccl_timeout = timeout


ATTEMPT_ENV = "SHARDWISE_ATTEMPT"
"""The name of this attempt at the job, the same on every rank (shardwise.torchrun sets it at each rendezvous)."""


def attempt() -> str:
    """This attempt's name: shardwise.torchrun's, else torchrun's restart count (0 outside torchrun)."""
    return os.environ.get(ATTEMPT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """The job's store (torch's env:// rendezvous), its keys prefixed by the attempt's name.

    torchrun keeps one store server for all restarts of a job and torch's workers connect to it without a
    per-attempt prefix, so after a restart a rank may read a peer's gloo address left by the previous attempt
    (a dead process) before the peer overwrites it, and fail with "Connection refused". A prefix per attempt
    gives each attempt its own keys.
    """
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"shardwise/attempt{attempt()}", store)


# ---------------------------------------------------------------------------------------------------
# A failed collective, explained
#
# Gloo's errors say "Timed out waiting 600000ms for recv operation" or "Connection closed by peer", without the
# operation or the rank at fault; torch has no flight recorder for gloo. So when a collective fails, every rank
# that sees the failure checks in on the job's store; the ranks that do not check in are the hung or dead ones.

_FAILURE_WORDS = ("timed out", "timeout", "connection closed by peer", "connection reset by peer", "broken pipe")
ROLL_CALL_MAX_S = 30.0
"""Longest wait for the other ranks to check in: ranks blocked behind the hung one time out within about one
collective timeout of each other; and torchrun stops the survivors of a dead rank within seconds."""


def failed_collective(exc: BaseException) -> str | None:
    """The torch.distributed operation `exc` was raised in when it is a collective's timeout or lost peer."""
    if not isinstance(exc, (RuntimeError, dist.DistError)) or not any(w in str(exc).lower() for w in _FAILURE_WORDS):
        return None
    ops = [f.name for f in traceback.extract_tb(exc.__traceback__)
           if f.filename.endswith(os.path.join("torch", "distributed", "distributed_c10d.py"))]
    ops = [op for op in ops if not op.startswith("_") and op != "wrapper"]
    return ops[-1] if ops else "a collective"


def explain_failure(exc: BaseException, env: DistEnv, step: int) -> str | None:
    """One line naming the operation, this rank and the ranks that are hung or dead; None if `exc` is not a
    failed collective."""
    op = failed_collective(exc)
    if op is None:
        return None
    wait_s = min(env.timeout_s, ROLL_CALL_MAX_S)
    missing, stopped_after = roll_call(env, wait_s)
    if missing is None:
        who = "the job's store did not answer either (the store's host rank may be the one at fault)"
    elif missing:
        shown = ", ".join(map(str, missing[:16])) + (f" and {len(missing) - 16} more" if len(missing) > 16 else "")
        ranks = f"rank{'s' if len(missing) > 1 else ''} {shown}"
        if stopped_after is None:
            who = f"{ranks} did not check in within {wait_s:.0f} s: hung or dead"
        else:  # torchrun stops the job as soon as a rank has exited: the others may be blocked behind it, alive
            who = (f"{ranks} had not checked in when the job was stopped, {stopped_after:.1f} s into the roll call: "
                   f"dead, or blocked behind a dead rank")
    else:
        who = "every rank checked in (a transient network failure, or a rank that fell behind and recovered)"
    cause = "timed out" if any(w in str(exc).lower() for w in ("timed out", "timeout")) else "lost its peer"
    # "rank 2's all_reduce lost its peer", not "all_reduce lost its peer on rank 2": that read as if rank 2 were the
    # one lost, where it is the rank reporting
    return (f"step {step}: rank {env.rank}'s {op} {cause} (train.collective_timeout_s = {env.timeout_s:g} s); "
            f"{who}. The first error: {_first_line(exc)}")


def _first_line(exc: BaseException, limit: int = 400) -> str:
    """The error's first line, cut at `limit` characters with a mark that it was (it once was cut silently at 200,
    which could end mid-path before gloo's operation and its timeout)."""
    lines = str(exc).splitlines() or [type(exc).__name__]
    line = lines[0]
    return line if len(line) <= limit else line[:limit] + " [...]"


class _Terminated(Exception):
    pass


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def roll_call(env: DistEnv, wait_s: float) -> tuple[list[int] | None, float | None]:
    """Check this rank in; the ranks that have not checked in after wait_s (None if the store is unreachable), and
    the seconds after which a SIGTERM ended the wait (None if none did).

    Returns at once if SIGTERM arrives meanwhile (torchrun stopping the job), with the ranks missing so far.
    """
    if env.store is None:
        return [], None
    keys = [f"shardwise/roll_call/{r}" for r in range(env.world_size)]
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    everyone, start, stopped_after = False, time.monotonic(), None
    try:
        env.store.set_timeout(datetime.timedelta(seconds=max(wait_s, 1.0)))
        env.store.set(keys[env.rank], "1")
        deadline = start + wait_s
        while not (everyone := env.store.check(keys)) and time.monotonic() < deadline:
            time.sleep(0.2)
    except _Terminated:
        stopped_after = time.monotonic() - start
    except (RuntimeError, dist.DistError):
        return None, None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if everyone:
        return [], None
    try:  # one query per rank, only when someone is missing
        return [r for r, key in enumerate(keys) if not env.store.check([key])], stopped_after
    except (RuntimeError, dist.DistError):
        return None, None


_BEFORE_SHUTDOWN: list[Callable[[], None]] = []


def before_shutdown(fn: Callable[[], None]) -> Callable[[], None]:
    """Register `fn` to run in shutdown() before the process groups are destroyed: what else holds groups lets
    go of them there (shardwise.parallel registers the emptying of DTensor's caches)."""
    _BEFORE_SHUTDOWN.append(fn)
    return fn


def shutdown() -> None:
    """Destroy every process group now, joining their gloo worker threads.

    destroy_process_group() drops only torch's own references: a group and its threads live on while anything
    else holds it, and DTensor's sharding caches hold every mesh they saw (a mesh holds its groups) until the
    interpreter finalizes. A gloo thread that then frees a finished collective's tensors asks for the GIL;
    during finalization Python ends it with pthread_exit, whose unwinding through the work's noexcept destructor
    calls std::terminate (SIGABRT). So: the `before_shutdown` hooks empty the caches, then the garbage that
    still holds groups (modules and DTensors form cycles) is collected while the interpreter is whole. The
    caller must hold no mesh, group or parallelized module. torch.distributed.nn.functional takes the default
    group as a default argument (`group=group.WORLD`, evaluated at import; torch's checkpoint code imports it):
    this module imports it before any group exists.
    """
    if not dist.is_initialized():
        return
    for fn in _BEFORE_SHUTDOWN:
        fn()
    dist.destroy_process_group()
    gc.collect()


# ---------------------------------------------------------------------------------------------------
# A shardwise error under the launcher
#
# A bad config, checkpoint or run is one line for the user to act on, and every rank meets it. So rank 0 alone prints
# it, and every rank hands the line and its exit code to the launcher through torchelastic's error file
# (TORCHELASTIC_ERROR_FILE: torchrun gives each worker one and reads it back into the failures of its
# ChildFailedError): a structured channel, so `shardwise.torchrun` ends the job with that exit code instead of
# torchrun's report, and prints the line itself when rank 0 has none.

_KEY = "shardwise"
_STOPPED_BY_TORCHRUN = (-signal.SIGTERM, -signal.SIGKILL)
"""How ranks that did not fail themselves end when torchrun stops the group around a failed one."""


def hand_error_to_launcher(line: str, exit_code: int, final: bool = False) -> bool:
    """Write a shardwise error to this worker's torchelastic error file; False when there is none (not torchrun).
    final: every attempt would meet it (see restart_cannot_help)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    # torchelastic's fields as its ErrorHandler writes them, the line for a traceback (what torchrun run directly
    # shows as the failure's cause), and ours under a key of their own
    message = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
    with open(path, "w") as f:
        json.dump({"message": message, _KEY: {"exit_code": exit_code, "line": line, "final": final}}, f)
    return True


def handed_error(failures: dict) -> tuple[int, int, str] | None:
    """(rank, exit code, line) of the shardwise error a failed torchrun job ends with: rank 0's, else the first
    rank's to fail; None when some rank failed otherwise (a bug or a crash: its traceback and torchrun's report
    stay).

    failures: ChildFailedError.failures, {global rank: ProcessFailure}.
    """
    # a rank that torchrun stopped after it handed its error over (and printed it, on rank 0) still handed it
    records = {r: f.error_file_data[_KEY] for r, f in failures.items() if _KEY in f.error_file_data}
    handed = {r: rec for r, rec in records.items() if failures[r].exitcode in (rec["exit_code"], *_STOPPED_BY_TORCHRUN)}
    if not handed or any(r not in handed and f.exitcode not in _STOPPED_BY_TORCHRUN for r, f in failures.items()):
        return None
    rank = 0 if 0 in handed else min(handed, key=lambda r: (failures[r].timestamp, r))
    return rank, handed[rank]["exit_code"], handed[rank]["line"]


def restart_cannot_help(failures: dict) -> bool:
    """Whether the error a failed torchrun job ends with (handed_error's) is one every attempt meets: a config, or a
    checkpoint, that the user must change. torchrun's restarts (--max-restarts, 3 for an elastic job) each met it
    again after a new rendezvous: its line once per attempt and machine, minutes of it, and on the machines left
    when the first one gave up, the rendezvous' traceback."""
    handed = handed_error(failures)
    return handed is not None and failures[handed[0]].error_file_data[_KEY].get("final", False)


def _entry(rank: int, world: int, port: int, fn, args, results, environ: dict[str, str]):
    os.environ.clear()  # the caller's, as a spawned process would have it (the fork server's is from its start)
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = ("ok", fn(*args))
    except BaseException:  # report every rank's failure to the parent, whatever it is
        results[rank] = ("error", traceback.format_exc())
    else:
        # Rank 0's process hosts the store every group is made through. A rank whose fn ends with no collective
        # (making its own one-rank groups, say) could exit while another still uses the store: that rank's
        # "Broken pipe". A failed rank skips this: its exit ends the barrier with an error, and its own report
        # is the one that counts.
        with contextlib.suppress(Exception):
            dist.barrier()
    finally:
        shutdown()


def fork_server():
    """multiprocessing's fork-server context, its server importing torch and shardwise before it forks anything
    (set here, read when the server starts: the first use in the process). A process it forks starts with them
    imported, and with nothing run: no thread pools, no process groups (a fork of a process that has run torch
    ops would copy its thread pools half-alive; a spawned one imports them again, ~4-5 s of CPU)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed.tensor", "torch._dynamo", "shardwise.train"])
    return ctx


def run_distributed(fn, world: int, *args) -> list:
    """fn(*args) on `world` ranks with a gloo process group initialised; returns the ranks' results in order.

    fn must be importable (a module-level function) and return picklable values. A failure on any rank
    raises here with that rank's traceback.

    The ranks are forked from multiprocessing's fork server, which imports torch and shardwise once (it runs
    nothing: no threads, no process group) and forks every later call's ranks from there: a spawned rank spent
    ~4 s of CPU importing them, most of a small test's time. Each rank takes the caller's environment.
    """
    ctx = fork_server()
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_entry, args=(world, free_port(), fn, args, results, dict(os.environ)), nprocs=world,
                           start_method="forkserver", join=True)
        out = dict(results)
    for rank in range(world):
        status, value = out[rank]
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
    return [out[r][1] for r in range(world)]
