"""LoRA: low-rank adapters on a frozen model (Hu et al. 2022), applied in place to the meta model.

Each adapted projection y = x W^T becomes y = x W^T + (alpha / r) * dropout(x) A^T B^T, with A (r x in) and B
(out x r) trained and W frozen. B starts at zero, so the adapted model starts as the base model. Every weight that
is not an adapter is frozen (embedding, norms and head too), and only adapters reach the optimizer.

`apply_lora` swaps the target `nn.Linear`s of every block for `LoRALinear` on the meta device, before any parallel
transform: the base weight keeps its name (`layers.0.attention.wq.weight`), so checkpoints and Hugging Face import
see the same names; the adapters are `...wq.lora_a` and `...wq.lora_b`, initialised by `model.init_value` from
(seed, name) like every other parameter, so every layout starts from the same adapters.

QLoRA (`lora.qlora`): the adapted projections' frozen weights are stored in 4-bit NF4 (see nf4.py for the order
in which that composes with FSDP); the forward is the same, `F.linear` dequantising the NF4 weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise import nf4
from shardwise.config import LoraConfig

ADAPTER_SUFFIXES = ("lora_a", "lora_b")


class LoRALinear(nn.Linear):
    """An nn.Linear (so tensor parallelism and FSDP treat it as one) with a trainable low-rank update.

    The adapters are parameters of this module, not submodules: a parallel style that places a linear's
    parameters sees them with the base weight (see parallel/tensor_parallel.py for their placements).
    """

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.rank, self.scale = rank, alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=dtype))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # with an NF4 weight (QLoRA), torchao's F.linear dequantises it; its backward gives x's gradient only
        update = F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)
        return F.linear(x, self.weight) + self.scale * update

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / r) B A: the plain linear this module computes (without dropout), whole and in fp32.
        A collective when the module is sharded: every rank calls it."""
        a, b = full_value(self.lora_a).float(), full_value(self.lora_b).float()
        return full_value(self.weight).float() + self.scale * (b @ a)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scale={self.scale:g}"


def dense(weight: torch.Tensor) -> torch.Tensor:
    """The weight as a plain tensor: QLoRA's NF4 base (torchao's NF4Tensor) dequantised, any other as it is.

    Duck-typed on NF4Tensor's `get_original_weight` so that torchao is imported only by the runs that use it;
    `.float()` would not do: on an NF4 tensor of an fp32 original it is a no-op that returns the NF4 tensor.
    """
    return weight.get_original_weight() if hasattr(weight, "get_original_weight") else weight


def full_value(param: torch.Tensor) -> torch.Tensor:
    """The parameter's whole value as a plain tensor: gathered if it is a DTensor (a collective: every rank of its
    mesh calls it), QLoRA's NF4 base dequantised.

    A sharded NF4 weight is dequantised shard by shard and the plain pieces gathered, never gathered as NF4:
    DTensor's gather of an NF4 local tensor goes through torchao's functional all-gather of its parts, which on
    gloo corrupted the heap ("malloc(): unaligned tcache chunk detected": a final save's SIGABRT in CI; a 2-rank
    loop of such gathers crashed within seconds, tests/test_qlora.py). The result is the same bits: each FSDP
    shard holds whole blocks of scalers (config._validate_qlora) and the per-tensor scaler mean, so its
    dequantised rows are those rows of the whole weight dequantised.
    """
    if not isinstance(param, DTensor):
        return dense(param)
    local = param.to_local()
    plain = dense(local)
    if plain is not local:
        param = DTensor.from_local(plain, param.device_mesh, param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride())
    return param.full_tensor()


def is_adapter(name: str) -> bool:
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_spec(parts: list[nn.Module]) -> dict | None:
    """What the adapters of a model are (rank, alpha / rank, targets, and whether their base is QLoRA's NF4), as an
    adapter checkpoint records it and a run resuming it must match; None for a model without LoRA."""
    layers = {name.rsplit(".", 1)[-1]: m for part in parts for name, m in part.named_modules()
              if isinstance(m, LoRALinear)}
    if not layers:
        return None
    first = next(iter(layers.values()))
    return {"rank": first.rank, "scale": first.scale, "targets": sorted(layers), "qlora": nf4.is_nf4(first.weight)}


def apply_lora(model: nn.Module, cfg: LoraConfig, frozen_dtype: torch.dtype = torch.float32) -> None:
    """Adapt the `cfg.targets` projections of every block and freeze everything else (no-op when rank is 0).

    `frozen_dtype` (the compute dtype of mixed precision) stores the frozen matrices that only ever feed a matmul
    (the blocks' projections and the output head) at half the bytes: autocast would cast them to it at every use,
    so the matmuls see the same numbers. The embedding (its output is the fp32 residual stream) and the norms
    (autocast runs them in fp32) keep their dtype; adapters stay fp32, the optimizer's master copy.
    """
    if cfg.rank == 0:
        return
    for block in model.layers.values():
        for parent in (block.attention, block.feed_forward):
            for target in cfg.targets:
                base = getattr(parent, target, None)
                if isinstance(base, nn.Linear) and not isinstance(base, LoRALinear):
                    setattr(parent, target, _adapted(base, cfg))
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    if frozen_dtype != torch.float32:
        _store_frozen_linears(model, frozen_dtype)


def _store_frozen_linears(model: nn.Module, dtype: torch.dtype) -> None:
    for module in model.modules():
        # QLoRA's NF4 weights stay as they are: quantised from the fp32 values under every precision, so a bf16
        # and an fp32 run hold the same 4-bit numbers (and NF4's scaler factors are fp32: planner's QLORA_BITS)
        if isinstance(module, nn.Linear) and not module.weight.requires_grad and not nf4.is_nf4(module.weight):
            module.weight = nn.Parameter(module.weight.to(dtype), requires_grad=False)
    model.tie_weights()  # a head tied to the embedding shares the embedding's (kept) dtype


def _adapted(base: nn.Linear, cfg: LoraConfig) -> LoRALinear:
    layer = LoRALinear(base.in_features, base.out_features, cfg.rank, cfg.alpha, cfg.dropout,
                       device=base.weight.device, dtype=base.weight.dtype)
    # QLoRA: NF4 on the meta device already, so that FSDP2 (applied later) shards the 4-bit storage
    layer.weight = nn.Parameter(nf4.quantize(base.weight), requires_grad=False) if cfg.qlora else base.weight
    return layer


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters only, by parameter name (what an adapter checkpoint or a peft export holds)."""
    return {name: p for name, p in model.named_parameters() if is_adapter(name)}
