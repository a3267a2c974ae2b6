"""Process-group set-up from torchrun's environment, and the local launcher behind `--nproc`."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def launch_local(nproc: int, argv: list[str]) -> int:
    """Re-run this command under torchrun with `nproc` processes on this machine."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "shardwise", *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(cmd, env=env)
