"""Operator counts of a training step, by model structure: the multiplier of the per-operator overhead in the time
model. Counted on the real model under torch 2.13 by `opcount` (see there for how), and pinned here so that the
planner needs no torch; `tests/test_planner.py` counts them again and checks this table.
"""

from __future__ import annotations

import dataclasses
import functools
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
    """Operator calls of one optimizer step (gradient norm, fused AdamW, zero_grad), foreach calls counted once."""
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
    the gradient norm and clipping (foreach, a pass per operation) and the fused AdamW kernel, which touches the
    weight, gradient and both moments once (a foreach AdamW ran a pass per operation: 96 bytes in all)."""
    moe_block: int = 0
    """Of a mixture of experts, operators of one MoE block's forward + backward (0 for a dense model)."""
    tensors_per_moe_block: int = 0
    """Of a mixture of experts, parameter tensors of one MoE block (0 for a dense model)."""


# (grouped-query attention, tied embeddings, autocast) -> counts. Under autocast (the engine in bf16 or fp16: fp32
# weights, Training.autocasts) a block casts its 7 weights and 5 fp32 matmul inputs (the norms' outputs) to bf16 and
# backward their gradients back, RoPE's 2 tables, and in backward the gradients of wo's and w2's bf16 outputs added
# into the fp32 residual stream: 28 operators more (counted in bf16; fp16 casts alike). The optimizer steps outside.
OP_COUNTS: dict[tuple[bool, bool, bool], OpCounts] = {
    (False, False, False): OpCounts(*(212, 53, 13, 22, 3.0, 18.0, 9, 3, 44.09722222222222)),
    (False, True, False): OpCounts(*(212, 53, 13, 22, 3.0, 18.0, 9, 2, 44.09722222222222)),
    (True, False, False): OpCounts(*(212, 53, 13, 22, 3.0, 18.0, 9, 3, 44.10787671232877)),
    (True, True, False): OpCounts(*(212, 53, 13, 22, 3.0, 18.0, 9, 2, 44.10787671232877)),
    (False, False, True): OpCounts(*(240, 58, 17, 22, 3.0, 18.0, 9, 3, 44.09722222222222)),
    (False, True, True): OpCounts(*(240, 58, 17, 22, 3.0, 18.0, 9, 2, 44.09722222222222)),
    (True, False, True): OpCounts(*(240, 58, 17, 22, 3.0, 18.0, 9, 3, 44.10787671232877)),
    (True, True, True): OpCounts(*(240, 58, 17, 22, 3.0, 18.0, 9, 2, 44.10787671232877)),
}


CAST_INPUTS = ("wq", "wk", "wv", "w1", "w3")
"""The projections whose input is a norm's fp32 output (the engine's residual stream is fp32): under autocast every
matmul that takes it casts it again, an adapter's too. wo and w2 take their block's bf16 attention output and gated
product."""


@dataclass(frozen=True)
class LoraOps:
    """What LoRA changes in a micro-batch's operators (opcount.lora_op_counts): a LoRA model's block dispatches
    `lora_block_ops`, its embedding, head and loss `rest + this rest`."""

    per_adapter: int
    """Operators one adapted linear adds: its two adapter matmuls, the scale and the add forward, their backwards
    and the adapters' gradients (with dropout: its mask and product forward, and the product's backward); under
    autocast, the casts of the adapters' weights and their gradients."""
    input_cast: int
    """Operators an adapter on one of CAST_INPUTS adds besides: under autocast its fp32 input's own cast, forward
    and backward (0 in fp32)."""
    frozen_block: int
    """Operators a block loses when its weights are frozen: every weight's gradient (matmuls, norms' reductions)
    and its accumulation."""
    rest: int
    """The same outside the blocks (embedding and head frozen, and the first block's backward stops at its first
    adapter), counted with every projection adapted; with fewer adapters it can lose up to a block's backward
    more (the first block's, when the earliest adapter is its last projection), under 60 operators."""
    adapted_linear: int
    """Operators of one adapted linear's forward + backward, on an fp32 input (what tensor parallelism runs on
    DTensors)."""
    frozen_linear: int
    """The same of a frozen plain linear (a projection LoRA does not adapt)."""


# (lora.dropout > 0, autocast) -> what LoRA changes (counted by opcount.lora_op_counts on torch 2.13; autocast in bf16)
LORA_OPS: dict[tuple[bool, bool], LoraOps] = {
    (False, False): LoraOps(per_adapter=30, input_cast=0, frozen_block=43, rest=-49, adapted_linear=38,
                            frozen_linear=8),
    (True, False): LoraOps(per_adapter=35, input_cast=0, frozen_block=43, rest=-52, adapted_linear=43,
                           frozen_linear=8),
    (False, True): LoraOps(per_adapter=34, input_cast=2, frozen_block=50, rest=-56, adapted_linear=47,
                           frozen_linear=11),
    (True, True): LoraOps(per_adapter=39, input_cast=2, frozen_block=50, rest=-59, adapted_linear=52,
                          frozen_linear=11),
}


def lora_block_ops(block: int, lora: LoraOps, targets) -> int:
    """Operators of a LoRA block adapting the projections `targets`, from its dense count `block`."""
    return block - lora.frozen_block + sum(lora.per_adapter + lora.input_cast * (t in CAST_INPUTS) for t in targets)


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


@dataclass(frozen=True)
class Elementwise:
    """Bytes one dense block's eager elementwise operators read and write per token (opcount.elementwise_traffic):
    every operator of the engine's block that is neither a matmul nor the attention kernel nor a view, each its
    own pass over memory, as eager PyTorch runs them (RMSNorm's composite form, RoPE, SiLU and the gate's product,
    the residual adds, autocast's casts of each matmul's input and their backwards)."""

    forward: tuple[float, float, float, float, float, float]
    """Forward bytes per token per element of (dim: the residual stream, q dim: the queries and the attention's
    output, n_heads x head_dim, kv dim, ffn hidden, head_dim: RoPE's cos and sin, and 1: the norms' statistics)."""
    backward: tuple[float, float, float, float, float, float]
    """Backward bytes per token, the same way."""
    norm_forward: float
    """Of the forward's dim coefficient, the two RMSNorms as the engine runs them on a CPU (fp32:
    shardwise.model._RMSNorm; a GPU runs torch's fused kernel)."""
    norm_backward: float
    """The same of the backward's."""
    composite_forward: float
    """The two RMSNorms' forward in torch's composite form (torch.nn.RMSNorm on a CPU, and on a GPU before
    torch 2.8), per dim element."""
    composite_backward: float
    """The same of the backward's."""


# precision -> the engine's block's elementwise traffic (fp16 and fp8 run bf16's: the same casts, 2-byte activations)
ELEMENTWISE: dict[str, Elementwise] = {
    "fp32": Elementwise((64.0, 24.0, 24.0, 20.0, 8.0, 80.0), (156.0, 24.0, 24.0, 36.0, 12.0, 88.0), 40.0, 104.0, 56.0,
                        200.0),
    "bf16": Elementwise((90.0, 12.0, 12.0, 10.0, 10.0, 80.0), (198.0, 12.0, 12.0, 18.0, 6.0, 88.0), 40.0, 104.0, 56.0,
                        200.0),
}


def moe_structure(args: ModelArgs) -> tuple[bool, bool, bool, bool, bool]:
    """What sets an MoE block's operators: (route_norm, shared experts, capacity, balancing loss, z-loss). Softmax
    and sigmoid scores dispatch as many."""
    return (args.route_norm, args.n_shared_experts > 0, args.capacity_factor > 0, args.aux_loss_coeff > 0,
            args.z_loss_coeff > 0)


# moe_structure -> (operators, operators per routed expert, parameter tensors) an MoE block has beyond a dense block
# with the same attention: the router, top-k and the combine weights, the sort by expert, the grouped GEMMs
# (torch._grouped_mm: what a GPU in bf16 and a CPU run; the engine's exact loop over experts is not priced), the scatter
# back and the combine, the routing counters, the shared experts, the capacity's cut (one slice per expert) and the
# balancing loss and the z-loss. Counted by opcount.moe_op_table (print it to pin it again after shardwise.moe
# changes).
MOE_OP_COUNTS: dict[tuple[bool, bool, bool, bool, bool], tuple[int, float, int]] = {
    (True, True, True, True, True): (160, 1.0, 4),
    (True, True, True, True, False): (136, 1.0, 4),
    (True, True, True, False, True): (123, 1.0, 4),
    (True, True, True, False, False): (98, 1.0, 4),
    (True, True, False, True, True): (159, 0.0, 4),
    (True, True, False, True, False): (135, 0.0, 4),
    (True, True, False, False, True): (122, 0.0, 4),
    (True, True, False, False, False): (97, 0.0, 4),
    (True, False, True, True, True): (113, 1.0, 1),
    (True, False, True, True, False): (89, 1.0, 1),
    (True, False, True, False, True): (76, 1.0, 1),
    (True, False, True, False, False): (51, 1.0, 1),
    (True, False, False, True, True): (112, 0.0, 1),
    (True, False, False, True, False): (88, 0.0, 1),
    (True, False, False, False, True): (75, 0.0, 1),
    (True, False, False, False, False): (50, 0.0, 1),
    (False, True, True, True, True): (149, 1.0, 4),
    (False, True, True, True, False): (125, 1.0, 4),
    (False, True, True, False, True): (112, 1.0, 4),
    (False, True, True, False, False): (87, 1.0, 4),
    (False, True, False, True, True): (148, 0.0, 4),
    (False, True, False, True, False): (124, 0.0, 4),
    (False, True, False, False, True): (111, 0.0, 4),
    (False, True, False, False, False): (86, 0.0, 4),
    (False, False, True, True, True): (102, 1.0, 1),
    (False, False, True, True, False): (78, 1.0, 1),
    (False, False, True, False, True): (65, 1.0, 1),
    (False, False, True, False, False): (40, 1.0, 1),
    (False, False, False, True, True): (101, 0.0, 1),
    (False, False, False, True, False): (77, 0.0, 1),
    (False, False, False, False, True): (64, 0.0, 1),
    (False, False, False, False, False): (39, 0.0, 1),
}


def op_counts(args: ModelArgs, autocast: bool = False) -> OpCounts:
    """Operator counts of `args`'s structure; `autocast`: as the engine dispatches them in bf16 or fp16
    (Training.autocasts). The MoE's own operators are counted in fp32 (a grouped GEMM's casts are not)."""
    dense = OP_COUNTS[args.n_kv_heads < args.n_heads, args.tie_embeddings, autocast]
    if not args.n_experts:
        return dense
    return _with_moe(dense, MOE_OP_COUNTS[moe_structure(args)], args.n_experts)


@functools.cache
def _with_moe(dense: OpCounts, extra: tuple[int, float, int], n_experts: int) -> OpCounts:
    ops, per_expert, tensors = extra
    return dataclasses.replace(dense, moe_block=round(dense.block + ops + per_expert * n_experts),
                               tensors_per_moe_block=dense.tensors_per_block + tensors)


def optimizer_ops(counts: OpCounts, tensors: int, looped: bool) -> float:
    """Operators of one optimizer step over `tensors` parameter tensors: each foreach call once (`looped` False: a
    GPU's multi-tensor kernels) or once per tensor (a CPU's foreach loops)."""
    if looped:
        return counts.optimizer_fixed + counts.optimizer_per_tensor * tensors
    return counts.optimizer_calls
