"""Process-group set-up from torchrun's environment, the local launcher behind `--nproc`, and a spawner of
functions on N local gloo ranks (for tests and benchmarks)."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_choice: str = "auto", timeout_s: float = 600.0) -> DistEnv:
    """Join the job torchrun started (NCCL on GPU, gloo on CPU); a plain run is a world of one."""
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if use_cuda else None,
        )
    return DistEnv(rank, world, local_rank, device)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def launch_local(nproc: int, argv: list[str], max_restarts: int = 0) -> int:
    """Re-run this command under torchrun with `nproc` processes on this machine."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--max-restarts={max_restarts}", "-m", "shardwise", *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(cmd, env=env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = ("ok", fn(*args))
    except BaseException:  # report every rank's failure to the parent, whatever it is
        results[rank] = ("error", traceback.format_exc())
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world: int, *args) -> list:
    """fn(*args) on `world` ranks with a gloo process group initialised; returns the ranks' results in order.

    fn must be importable (a module-level function) and return picklable values. A failure on any rank
    raises here with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_entry, args=(world, _free_port(), fn, args, results), nprocs=world,
                           start_method="spawn", join=True)
        out = dict(results)
    for rank in range(world):
        status, value = out[rank]
        if status != "ok":
            raise AssertionError(f"rank {rank} failed:\n{value}")
    return [out[r][1] for r in range(world)]
