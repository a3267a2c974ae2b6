"""Run a test function on N gloo ranks (processes) on this machine and collect what each returns."""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
