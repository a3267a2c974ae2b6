"""Where this process stands in the job: its device, the mesh, and the few collectives the loop itself needs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

from shardwise.config import ConfigError, JobConfig, fit_world, validate_parallel
from shardwise.data import Batch
from shardwise.distributed import DistEnv, init_distributed, set_deterministic, shutdown
from shardwise.layout import fsdp_applies
from shardwise.parallel.mesh import MeshView, build_mesh

T = TypeVar("T")


@dataclass
class Runtime:
    env: DistEnv
    cfg: JobConfig
    mesh: MeshView | None
    positions: torch.Tensor | None = None
    """This rank's sequence positions under context parallelism (None: the whole sequence)."""
    step: int = 0
    """The optimizer step being taken (for error messages)."""

    @classmethod
    def create(cls, cfg: JobConfig) -> Runtime:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1 and cfg.parallel.world_size != 1:
            n = cfg.parallel.world_size
            raise ConfigError("parallel", f"the degrees ask for {n} ranks but this is a single process",
                              f"add --nproc {n}, or run under torchrun --nproc_per_node {n}")
        fit_world(cfg, world)  # replaces cfg.parallel (a frozen Layout): read it only after
        validate_parallel(cfg, world)  # before any process group exists
        p = cfg.parallel
        if cfg.train.deterministic:
            set_deterministic()
        env = init_distributed(cfg.train.device, cfg.train.collective_timeout_s, group_of_one=fsdp_applies(p))
        if world == 1 and not fsdp_applies(p):
            return cls(env, cfg, None)
        mesh = MeshView(build_mesh(p, env.device.type), p)
        runtime = cls(env, cfg, mesh)
        if p.cp > 1:
            from shardwise.parallel.context_parallel import load_balanced_positions

            runtime.positions = load_balanced_positions(cfg.data.seq_len, p.cp, mesh.coordinate("cp")).to(env.device)
        return runtime

    # --- who am I -------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.env.device

    @property
    def is_main(self) -> bool:
        return self.env.is_main

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank if self.mesh else 0

    @property
    def dp_size(self) -> int:
        return self.cfg.parallel.dp if self.mesh else 1

    @property
    def pp_rank(self) -> int:
        return self.mesh.coordinate("pp") if self.mesh else 0

    @property
    def pp_size(self) -> int:
        return self.cfg.parallel.pp if self.mesh else 1

    @property
    def pp_group(self):
        return self.mesh.pp.get_group() if self.mesh and self.pp_size > 1 else None

    @property
    def grad_reduce_size(self) -> int:
        return self.cfg.parallel.dp * self.cfg.parallel.cp if self.mesh else 1

    @property
    def writes_stage_files(self) -> bool:
        """One writer per pipeline stage: the rank at coordinate 0 of every other dim."""
        return self._first_along("dp_replicate", "dp_shard", "cp", "tp")

    @property
    def leads_data_rank(self) -> bool:
        """One rank per data-parallel rank: the one at coordinate 0 of tp, cp and pp (they read the same data)."""
        return self._first_along("pp", "cp", "tp")

    def _first_along(self, *dims: str) -> bool:
        """Whether this rank is at coordinate 0 of every one of `dims` (always, in a world of one)."""
        return not self.mesh or all(self.mesh.coordinate(d) == 0 for d in dims)

    def describe(self) -> str:
        if not self.mesh:
            return str(self.device)
        p = self.cfg.parallel
        degrees = ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
        dims = [f"{d}={getattr(p, d)}" for d in degrees if getattr(p, d) > 1]
        offload = [f"{p.offload} offload"] if p.offload != "none" else []
        return f"{self.world_size} x {self.device.type} ({', '.join([*dims, f'ZeRO-{p.zero_stage}', *offload])})"

    # --- the loop's own collectives --------------------------------------------------------------------
    def shard_sequence(self, batch: Batch) -> tuple[Batch, torch.Tensor | None]:
        """This rank's part of the sequence under context parallelism, and its positions."""
        if self.positions is None:
            return batch, None
        cpu_positions = self.positions.cpu()
        return Batch(batch.inputs.index_select(1, cpu_positions), batch.targets.index_select(1, cpu_positions),
                     batch.sample_ids, batch.step_targets, batch.masked), self.positions

    def sum_over_data_ranks(self, value: torch.Tensor) -> None:
        """Sum in place over the ranks that see different tokens (data and context parallel)."""
        if self.mesh and self.grad_reduce_size > 1:
            dist.all_reduce(value, group=self.mesh.grad_reduce.get_group())

    def main_first(self, fn: Callable[[], T]) -> T:
        """Run fn on rank 0, then on the others (e.g. to fill a shared cache once)."""
        if self.world_size == 1:
            return fn()
        if self.is_main:
            result = fn()
            dist.barrier()
            return result
        dist.barrier()
        return fn()

    def close(self) -> None:
        self.mesh = None  # a DeviceMesh holds its process groups: they must go with the others (see shutdown)
        shutdown()
