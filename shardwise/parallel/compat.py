"""The private torch APIs shardwise relies on, in one place so a torch upgrade touches one file.

Each has no public equivalent in torch 2.13:
- DeviceMesh._flatten: one process group over several mesh dims (e.g. dp_shard x cp for FSDP), as torchtitan;
- DeviceMesh._concatenate: a mesh of several such meshes' dims (HSDP's dp_replicate x flattened dp_shard_cp) that
  reuses their process groups; slicing a flattened dim from the root mesh, which did this before, warns that it
  is deprecated;
- replicate (FSDP2-based DDP): bucketed gradient all-reduce overlapped with backward that composes with
  DTensor tensor parallelism and FSDP's grouping; nn.parallel.DistributedDataParallel does not take DTensors;
- all_to_all_single_autograd: an all-to-all with uneven splits that autograd runs backwards (expert parallelism);
  the public torch.distributed.nn.functional.all_to_all_single is deprecated in its favour.
And the flat-tensor collectives under the names torch 2.13 gives them, all_gather_single and reduce_scatter_single,
falling back to the names they replace (all_gather_into_tensor, reduce_scatter_tensor: deprecated in 2.13, the only
ones before it, e.g. in the torch 2.11 of the GPU machines this project borrows).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed._composable.replicate_with_fsdp import replicate  # noqa: F401
from torch.distributed._functional_collectives import all_to_all_single_autograd  # noqa: F401
from torch.distributed.device_mesh import DeviceMesh

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def flatten_mesh(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """A 1-D mesh over the given (adjacent) dims of `mesh`, named `name`."""
    if len(dims) == 1:
        return mesh[dims[0]]
    return mesh[dims]._flatten(name)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are those of `meshes` (sub-meshes of one root, flattened or not), in order."""
    return DeviceMesh._concatenate(meshes)
