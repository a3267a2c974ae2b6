"""The device mesh: named dims (pp, dp_replicate, dp_shard, cp, tp), tp innermost.

Ranks are laid out row-major over the dims, so consecutive ranks differ first in tp: with 8 GPUs per node
and tp <= 8, a tensor-parallel group sits inside one node on NVLink, and the slower inter-node links carry
the data-parallel and pipeline traffic, which moves less often and overlaps with compute.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.layout import Layout
from shardwise.parallel.compat import flatten_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def build_mesh(p: Layout, device_type: str) -> DeviceMesh:
    sizes = tuple(getattr(p, dim) for dim in MESH_DIMS)
    return init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)


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

    @functools.cached_property
    def grad_reduce(self) -> DeviceMesh:
        """Ranks holding the same parameters on different data: dp and cp (cp ranks see other tokens).

        ZeRO-0/1 all-reduce gradients over it."""
        return flatten_mesh(self.mesh, ("dp_replicate", "dp_shard", "cp"), "dp_cp")

    @functools.cached_property
    def fsdp(self) -> DeviceMesh:
        """ZeRO-2/3: 1-D (dp_shard x cp) for FSDP, or 2-D (dp_replicate, dp_shard x cp) for HSDP."""
        shard = flatten_mesh(self.mesh, ("dp_shard", "cp"), "dp_shard_cp")
        if self.p.dp_replicate == 1:
            return shard
        return self.mesh["dp_replicate", "dp_shard_cp"]

    def coordinate(self, dim: str) -> int:
        return self.mesh.get_local_rank(dim)

    @property
    def dp_rank(self) -> int:
        return self.coordinate("dp_replicate") * self.p.dp_shard + self.coordinate("dp_shard")
