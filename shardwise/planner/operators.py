"""Operator counts of a training step, by model structure: the multiplier of the per-operator overhead in the time
model. Counted on the real model under torch 2.13 by `opcount` (see there for how), and pinned here so that the
planner needs no torch; `tests/test_planner.py` counts them again and checks this table.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.model_args import ModelArgs


@dataclass(frozen=True)
class OpCounts:
    block: int
    """Operators of one block's forward + backward."""
    rest: int
    """Operators of embedding, final norm, output head and loss, forward + backward."""
    linear: int
    """Operators of one nn.Linear's forward + backward (tensor parallelism runs these on DTensors: 7 per block)."""
    optimizer_calls: int
    """Operator calls of one optimizer step (gradient norm, AdamW foreach, zero_grad), foreach calls counted once."""
    optimizer_per_tensor: float
    """Operators per parameter tensor of one optimizer step when each foreach call loops over its tensors."""
    optimizer_fixed: float
    """Operators of one optimizer step that do not repeat per tensor, in the same (looped) count."""
    tensors_per_block: int
    """Parameter tensors of one block."""
    tensors_rest: int
    """Parameter tensors outside the blocks."""
    optimizer_bytes_per_param: float
    """Bytes the optimizer step's operators read and write per parameter (fp32 state), summed over its passes:
    a foreach AdamW runs a pass per operation (lerp, mul, addcmul, sqrt, div, ...), each reading and writing
    parameter-sized tensors, where a fused kernel would touch each tensor once."""


# (grouped-query attention, tied embeddings) -> counts
OP_COUNTS: dict[tuple[bool, bool], OpCounts] = {
    (False, False): OpCounts(*(210, 52, 13, 52, 13.0, 17.0, 9, 3, 96.11111111111111)),
    (False, True): OpCounts(*(210, 52, 13, 50, 13.0, 17.0, 9, 2, 96.11111111111111)),
    (True, False): OpCounts(*(210, 52, 13, 52, 13.0, 17.0, 9, 3, 96.12328767123287)),
    (True, True): OpCounts(*(210, 52, 13, 50, 13.0, 17.0, 9, 2, 96.12328767123287)),
}


@dataclass(frozen=True)
class Dequant:
    """What QLoRA's NF4 base adds to one adapted linear's forward and backward (opcount.qlora_dequant_counts):
    torchao dequantises the weight with a chain of eager kernels each time it is used, in forward (and in a
    recompute) and again for the input gradient, and these kernels read and write several times the weight."""

    forward_ops: float
    forward_bytes: float
    """Bytes read and written per weight element in forward."""
    backward_ops: float
    backward_bytes: float


# precision -> dequantisation cost (at 256 x 256 weights: the per-tensor constants are already negligible there)
QLORA_DEQUANT: dict[str, Dequant] = {
    "fp32": Dequant(25.0, 71.40875244140625, 24.0, 67.53375244140625),
    "bf16": Dequant(26.0, 77.40875244140625, 25.0, 75.47125244140625),
    "fp16": Dequant(26.0, 77.40875244140625, 25.0, 75.47125244140625),
}


def op_counts(args: ModelArgs) -> OpCounts:
    """Operator counts of `args`'s structure."""
    return OP_COUNTS[args.n_kv_heads < args.n_heads, args.tie_embeddings]


def optimizer_ops(counts: OpCounts, tensors: int, looped: bool) -> float:
    """Operators of one optimizer step over `tensors` parameter tensors: each foreach call once (`looped` False: a
    GPU's multi-tensor kernels) or once per tensor (a CPU's foreach loops)."""
    if looped:
        return counts.optimizer_fixed + counts.optimizer_per_tensor * tensors
    return counts.optimizer_calls
