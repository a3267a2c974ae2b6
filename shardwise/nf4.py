"""QLoRA's frozen base weights in 4-bit NormalFloat (NF4; Dettmers et al. 2023), stored by torchao's NF4Tensor.

An NF4Tensor keeps 4-bit codes (two per byte), one int8 absmax scaler per block of NF4_BLOCK_SIZE weights, and,
since the scalers are themselves quantised ("double quantisation"), one factor in the weight's dtype per
NF4_SCALER_BLOCK_SIZE scalers, plus the mean of all the scalers. `F.linear` on it dequantises (torchao's
__torch_function__), so LoRALinear's forward is the same for a plain and an NF4 weight.

The order a QLoRA model is built in, for every layout (train.build_training_model, pipeline.build_pipeline):
1. `lora.apply_lora` on the meta model turns each adapted projection's weight into a meta NF4Tensor (shapes
   only). It must be NF4 before FSDP2 sees it: fully_shard then cuts the codes, scalers and factors along
   dim 0 (torchao's split) and gathers them with NF4's fsdp_pre/post_all_gather, so each rank stores 1/N of the
   4-bit storage and the all-gather moves 4-bit data.
2. `parallelize`: FSDP2 (ZeRO-2/3) shards them; ZeRO-0/1's replicate leaves them out (frozen, there is nothing
   to all-reduce, and replicate cannot all-gather an NF4Tensor).
3. `model.materialize` (seed init) or `hf.import_hf`: each base weight's full single-device value is quantised
   whole, then this rank's dim-0 chunk of the result is assigned to the parameter. Quantising a shard on its own
   would give other numbers (the scalers' mean is taken over the whole tensor), so quantising first is what
   makes every layout hold the very numbers the single-device run holds.
Checkpoints never hold the NF4 base: it is rebuilt from the same source at resume.
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from shardwise.config import NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE

# the sharded parts of an NF4Tensor (torchao splits and gathers these) and its per-tensor constants
SHARDED_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor")
CONSTANT_PARTS = ("scaler_mean", "nf4")


@contextlib.contextmanager
def _quiet(*names: str):
    """Raise these loggers to ERROR for a while: torchao's import logs every CUDA kernel it cannot load on a
    machine without them, and torch warns about an enum torchao registers."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def _nf4_class() -> type:
    with _quiet("torchao", "torch.utils._pytree"):
        from torchao.quantization import NF4Tensor
    return NF4Tensor


def quantize(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (2-D, numel a multiple of NF4_BLOCK_SIZE x NF4_SCALER_BLOCK_SIZE) as an NF4Tensor on its device;
    on the meta device, the shapes alone."""
    return _nf4_class().from_tensor(weight.detach().contiguous(), NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def is_nf4(t: torch.Tensor) -> bool:
    """An NF4Tensor, or a DTensor whose local piece is one (torchao not imported yet: there is none)."""
    return "torchao" in sys.modules and isinstance(_local(t), _nf4_class())


def local_piece(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of NF4 parameter `param`, quantised from its full value: the whole tensor is quantised
    first, then cut along dim 0 as FSDP2 cut the meta parameter (even chunks; config.validate checked they are)."""
    quantized = quantize(full.to(param.device))
    if not isinstance(param, DTensor):
        return quantized
    local = quantized
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(f"an NF4 weight can only be split along dim 0, not {placement}")
            mesh = param.device_mesh
            local = torch.chunk(local, mesh.size(dim), dim=0)[mesh.get_local_rank(dim)]
    if local is not quantized:
        local = _own_storage(local)
    # from_local with run_check=False only wraps: the NF4 chunk is not copied or dequantised
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _own_storage(chunk: torch.Tensor) -> torch.Tensor:
    """A copy of NF4 chunk `chunk` in storage of its own. torchao's split makes each part of a chunk a view of the
    whole tensor's part, and a view keeps its whole storage alive: every rank would hold all ranks' NF4 bytes.
    Copied part by part (NF4's copy_ between equal layouts), not cloned: NF4's clone dequantises and quantises
    the chunk again, which changes its numbers."""
    owned = torch.empty_like(chunk)
    owned.copy_(chunk)
    return owned


@torch.no_grad()
def assign(model: nn.Module, name: str, full: torch.Tensor) -> None:
    """Set NF4 parameter `name` of `model` to its local piece of the full value `full`.

    Assigned through load_state_dict(assign=True), not copied: FSDP2 re-reads an assigned parameter in its
    load_state_dict hook, and copying into the NF4Tensor that `to_empty` made would keep its per-tensor
    constants on the meta device (torchao's empty_like moves only the sharded parts).
    """
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    param = getattr(owner, attr)
    value = nn.Parameter(local_piece(param, full), requires_grad=False)
    owner.load_state_dict({attr: value}, strict=False, assign=True)


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes an NF4Tensor (or this rank's piece of one) holds: its sharded parts and its per-tensor constants."""
    local = _local(t)
    return sum(getattr(local, part).nbytes for part in SHARDED_PARTS + CONSTANT_PARTS)
