"""The device mesh: named dims (pp, dp_replicate, dp_shard, cp, tp), tp innermost.

With expert parallelism, dp_shard is built as two dims, dp_shard_mod_ep x dp_shard_in_ep (as torchtitan), so that
ep = dp_shard_in_ep x cp, the innermost ranks of dp_shard x cp, and FSDP shards the experts over dp_shard_mod_ep.

Ranks are laid out row-major over the dims, so consecutive ranks differ first in tp: with 8 GPUs per node
and tp <= 8, a tensor-parallel group sits inside one node on NVLink, and the slower inter-node links carry
the data-parallel and pipeline traffic, which moves less often and overlaps with compute.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.layout import Layout
from shardwise.parallel.compat import concatenate_meshes, flatten_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def mesh_dims(p: Layout) -> dict[str, int]:
    """The mesh's dims and their sizes, outermost first."""
    if p.ep == 1:
        return {dim: getattr(p, dim) for dim in MESH_DIMS}
    in_ep = p.ep // p.cp
    return {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard_mod_ep": p.dp_shard // in_ep,
            "dp_shard_in_ep": in_ep, "cp": p.cp, "tp": p.tp}


def build_mesh(p: Layout, device_type: str) -> DeviceMesh:
    dims = mesh_dims(p)
    return init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=tuple(dims))


@dataclass
class MeshView:
    """The sub-meshes each parallelism works on, and this rank's coordinates."""

    mesh: DeviceMesh
    p: Layout

    # each sub-mesh is made once: flattening creates process groups

    @functools.cached_property
    def tp(self) -> DeviceMesh:
        return self.mesh["tp"]

    @functools.cached_property
    def cp(self) -> DeviceMesh:
        return self.mesh["cp"]

    @functools.cached_property
    def pp(self) -> DeviceMesh:
        return self.mesh["pp"]

    @property
    def _dp_shard_dims(self) -> tuple[str, ...]:
        return ("dp_shard",) if self.p.ep == 1 else ("dp_shard_mod_ep", "dp_shard_in_ep")

    @functools.cached_property
    def grad_reduce(self) -> DeviceMesh:
        """Ranks holding the same parameters on different data: dp and cp (cp ranks see other tokens).

        ZeRO-0/1 all-reduce gradients over it."""
        return flatten_mesh(self.mesh, ("dp_replicate", *self._dp_shard_dims, "cp"), "dp_cp")

    @functools.cached_property
    def fsdp(self) -> DeviceMesh:
        """ZeRO-2/3: 1-D (dp_shard x cp) for FSDP, or 2-D (dp_replicate, dp_shard x cp) for HSDP."""
        return self._sharding(flatten_mesh(self.mesh, (*self._dp_shard_dims, "cp"), "dp_shard_cp"))

    @functools.cached_property
    def ep(self) -> DeviceMesh:
        """The expert-parallel ranks: dp_shard_in_ep x cp."""
        return flatten_mesh(self.mesh, ("dp_shard_in_ep", "cp"), "ep")

    @functools.cached_property
    def expert_fsdp(self) -> DeviceMesh:
        """With ep > 1, what FSDP shards the experts over: dp_shard_mod_ep (with dp_replicate, HSDP)."""
        return self._sharding(self.mesh["dp_shard_mod_ep"])

    def _sharding(self, shard: DeviceMesh) -> DeviceMesh:
        if self.p.dp_replicate == 1:
            return shard
        return concatenate_meshes([self.mesh["dp_replicate"], shard])

    def coordinate(self, dim: str) -> int:
        if dim == "dp_shard" and self.p.ep > 1:
            in_ep = self.p.ep // self.p.cp
            return self.mesh.get_local_rank("dp_shard_mod_ep") * in_ep + self.mesh.get_local_rank("dp_shard_in_ep")
        return self.mesh.get_local_rank(dim)

    @property
    def dp_rank(self) -> int:
        return self.coordinate("dp_replicate") * self.p.dp_shard + self.coordinate("dp_shard")
