"""Step time: compute, each axis's communication (overlapped or exposed), the pipeline bubble, the optimizer.

T_step = T_compute + T_comm,exposed + T_bubble + T_misc (compute, the communication overlap leaves exposed, the
pipeline bubble, and the rest); T_misc is the optimizer step, offload traffic and the sharding wrappers' buffer
copies (the step's scalar all-reduces count as communication). Derivations in docs/planner.md, "Time model".
"""

from __future__ import annotations

import functools
import math
from dataclasses import astuple, dataclass, replace

from shardwise.hardware import DTYPE_BYTES, Accelerator, Cluster, PlannerError
from shardwise.model_args import ModelArgs, adapter_params, flops_per_token, head_rows, projection_shapes
from shardwise.planner.comm import (
    all_gather,
    all_reduce,
    all_to_all,
    axis_link,
    expert_links,
    p2p,
    reduce_scatter,
)
from shardwise.planner.experts import (
    counts_bytes,
    dispatch_bytes,
    moe_token_split,
    routed_per_token,
)
from shardwise.planner.memory import (
    ATTENTION,
    LINEAR_GROUPS,
    adapted_base_params,
    adapted_shapes,
    adapter_groups,
    attention_params,
    block_modules,
    block_norm_output_split,
    block_params,
    block_tensor_params,
    block_terms,
    block_zero_checkpointed,
    casts_weights,
    checkpoint_period,
    checkpointed_blocks,
    expert_params,
    fused_head,
    gathered_unit_bytes,
    gathered_weight_bytes,
    kv_split,
    layer_activation_bytes,
    layer_params,
    linear_shapes,
    lora_params,
    norm_output_split,
    offloaded_shards,
    partial_checkpointing,
    placement,
    reduce_grad_bytes,
    replicates,
    stage_shape,
    state_bytes_per_param,
    term_bytes,
    unsharded_grad_bytes,
    zero_bubble_chunks,
)
from shardwise.planner.operators import ELEMENTWISE, LORA_OPS, QLORA_DEQUANT, lora_block_ops, op_counts, optimizer_ops
from shardwise.planner.plan import Plan
from shardwise.planner.workload import PER_OP_MOMENTS, QLORA_BITS, Training, recipe_for

HOST_DRAM_BW_PER_GPU = 25e9
"""Host-memory bandwidth one GPU's share of a CPU optimizer step gets (about 200 GB/s per socket pair / 8)."""


@dataclass(frozen=True)
class StageCost:
    """Seconds for one micro-batch on the heaviest pipeline rank, split the way the schedules need."""

    forward: float
    """Forward compute."""
    backward_input: float
    """Backward compute producing activation gradients (B in zero-bubble terms)."""
    backward_weight: float
    """Backward compute producing weight gradients (W)."""
    recompute: float
    """Extra forward work for activation recomputation."""
    tp_comm: float
    """Tensor-parallel collectives (on the critical path: we assume no async TP)."""
    cp_exposed: float
    """Ring-attention transfers not hidden behind attention compute."""
    pp_p2p: float
    """Activation and gradient sends across the rank's stage boundaries."""
    op_overhead: float = 0.0
    """Fixed per-operator cost (dispatch, launch) not hidden behind the arithmetic (see `op_overhead`)."""
    ep_comm: float = 0.0
    """Expert parallelism's all-to-alls (on the critical path: each is a barrier between routing and experts)."""
    tp_comm_weight: float = 0.0
    """Of tp_comm, the collectives of the forward the deferred weight pass replays (zero-bubble under full
    recompute: `_weight_pass_replay`): they run in W's slot, not in F's or B's."""

    @property
    def total(self) -> float:
        return (self.forward + self.backward_input + self.backward_weight + self.recompute + self.tp_comm
                + self.cp_exposed + self.pp_p2p + self.op_overhead + self.ep_comm)

    @property
    def compute(self) -> float:
        return self.forward + self.backward_input + self.backward_weight


def layer_times(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator,
                moe: bool = False) -> dict[str, float]:
    """Seconds of one block's forward on one rank for one micro-batch: matmuls, attention, elementwise. An MoE
    block (`moe`): its attention's matmuls, and per token the router's (n_experts x d), the routed experts' (3 d
    expert_hidden per pair the busiest rank computes: experts.routed_per_token) and the shared experts', none
    split by tp (every tp rank runs the whole MoE; under Megatron-Core's each routes its sequence-parallel shard,
    moe_linear_times); the experts' own ('experts', 'experts_bwd_input', 'experts_bwd_weight': expert_mlp_times)
    apart too, for Megatron-Core's all-to-all overlap (_ep_comm)."""
    peak = acc.peak(training.compute_dtype)
    q_tokens = plan.micro_batch * training.seq_len / plan.cp
    experts = expert_mlp_times(args, training, plan, acc, q_tokens) if moe else (0.0, 0.0, 0.0)
    if moe:  # (refuses torchao's float8 of the experts)
        mm, mm_in, mm_w = moe_linear_times(args, training, plan, acc, q_tokens, experts)
    else:
        mm, mm_in, mm_w = linear_times(args, training, plan, acc, q_tokens)
    # the last linear's forward, which a recompute that stops early leaves out (an MoE block's is not modelled)
    tail = 0.0 if moe else linear_times(args, training, plan, acc, q_tokens, last_only=True)[0]
    bandwidth = acc.mem_bandwidth * acc.bandwidth_efficiency
    if training.fused_attention:
        # QK^T and AV: 2 x 2 s q_dim FLOPs per query, halved by the causal mask (the kernel skips masked tiles); with
        # cp each rank's queries see on average half the sequence either way (load-balanced ring attention).
        # FlashAttention's backward does 5 matmuls to the forward's 2 (2.5x), all of them input-side.
        attn = 0.5 * 4 * q_tokens * training.seq_len * args.q_dim / plan.tp / (
            peak * acc.attention_eff(training.seq_len, args.head_dim, training.attention_kernel))
        attn_bwd = 2.5 * attn
    else:
        # batched GEMMs over the whole s x s (the mask does not skip work), at the matmul rate; backward's four
        # (dV, dP, dQ, dK) are twice the forward's two. Each s x s element moves in forward: scores written and
        # read by the softmax, probabilities written and read by AV: 4 a bytes (a = activation bytes); in
        # backward: the probabilities read by dV, dP written and read with the probabilities by the softmax's
        # backward, which writes dscores, read by the dQ and dK GEMMs: 7 a. Dropout on the probabilities adds its
        # output (written, read by AV) and 1-byte mask in forward, 2 a + 1, and in backward its own pass (dP and
        # the mask read, dprobs written), 2 a + 1.
        mm_attn = 4 * q_tokens * training.seq_len * args.q_dim / plan.tp / (peak * acc.matmul_efficiency)
        elements = q_tokens * args.n_heads / plan.tp * training.seq_len
        a, extra = training.act_bytes, (2 * training.act_bytes + 1 if training.dropout else 0)
        attn = mm_attn + elements * (4 * a + extra) / bandwidth
        attn_bwd = 2 * mm_attn + elements * (7 * a + extra) / bandwidth
    if training.elementwise == "eager" and not training.compile and not moe:
        elementwise, elementwise_bwd = (q_tokens * b / bandwidth for b in eager_elementwise_bytes(
            args, training, plan, cpu=not acc.launch_async))  # a CPU: launches are not asynchronous
    else:
        # fused kernels write each saved tensor once and read it once; backward reads and writes twice as much.
        # Counted on the tensors as the block's kernels write them (bf16): Transformer Engine's float8 copies are
        # its casts' writes, priced with the linears (te_float8_cast_seconds); under LoRA it keeps none
        te_copies = training.float8 != "torchao" and not training.lora_rank
        bf16_kernels = replace(training, float8="torchao") if te_copies else training
        bf16_kernels = replace(bf16_kernels, activation_fp8_input=False)
        kept = layer_activation_bytes(args, bf16_kernels, plan, "none", attention_scores=False, moe=moe,
                                      dequantised=False)
        if block_norm_output_split(training) != norm_output_split(training) and plan.sequence_parallel:
            # NeMo's adapters keep a norm's output whole, but the all-gather writes it: the kernels write the shard
            kept -= q_tokens * sum(term_bytes(t, args, training, plan) - term_bytes(
                replace(t, split="seq"), args, training, plan) for t in block_terms(
                args, bf16_kernels, "none", plan.zero_stage) if t.name.endswith("norm_output"))
        elementwise = 2 * kept / bandwidth
        elementwise_bwd = 2 * elementwise
        if training.activation_fp8_input and not moe:
            # Megatron's float8 SwiGLU input: a cast of the w1 and w3 outputs in forward (2 bytes read, 1 written)
            # and back in backward (1 read, 2 written), beside the kernels above
            cast = q_tokens * 2 * args.ffn_hidden / plan.tp * 3 / bandwidth
            elementwise, elementwise_bwd = elementwise + cast, elementwise_bwd + cast
    adapter, adapter_in, adapter_w = (0.0, 0.0, 0.0) if moe else adapter_times(args, training, plan, acc, q_tokens)
    return {"experts": experts[0], "experts_bwd_input": experts[1], "experts_bwd_weight": experts[2],
            "matmul": mm, "matmul_bwd_input": mm_in, "matmul_bwd_weight": mm_w, "matmul_last": tail,
            "attention": attn, "attention_bwd": attn_bwd, "elementwise": elementwise,
            "elementwise_bwd": elementwise_bwd, "adapter": adapter, "adapter_bwd_input": adapter_in,
            "adapter_bwd_weight": adapter_w}


def moe_linear_times(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator,
                     tokens: float, experts: tuple[float, float, float] | None = None) -> tuple[float, float, float]:
    """Seconds of an MoE block's matmuls on one rank over `tokens` rows, (forward, input gradients, weight
    gradients), each pass the same: the attention's linears (split by tp), the router (n_experts x d), the shared
    experts' SwiGLU and the routed experts' (3 d expert_hidden per (token, expert) pair the busiest rank computes:
    experts.routed_per_token), the MoE's over every token on every tp rank (or under Megatron-Core's MoE layer
    each tp rank's sequence-parallel shard: experts.moe_token_split), all at the large-GEMM rate (the experts'
    grouped GEMMs' shapes per expert are not modelled). In float8 through Transformer Engine (Megatron-Core: TE's
    Linear and GroupedLinear) every linear but the router runs at the fp8 peak, and TE's casts are added as for a
    dense block (te_float8_cast_seconds): the attention's qkv (its input from the fused norm) and proj over the
    tokens, the shared experts' fc1 and fc2 over the MoE's rows, the routed experts' over their (token, expert)
    pairs, with the rank's experts' weights cast once a step (per micro-batch under ZeRO-3), one cast kernel a
    module (TE's GroupedLinear quantises each expert's weight apart: their per-kernel floor is not counted, nor each
    expert's token padding). torchao's float8 of the experts is refused. `experts`: expert_mlp_times' result,
    where the caller has it already."""
    if training.linear_dtype == "fp8" and training.float8 == "torchao":
        raise PlannerError("--precision", f"torchao's float8 training of {args.name}'s mixture of experts (its "
                           "grouped expert GEMMs) is not modelled", "use --precision bf16, or a system that trains "
                           "in float8 through Transformer Engine (megatron-core)")
    # the router's rows: every token on every tp rank, or under Megatron-Core's experts each tp rank's
    # sequence-parallel shard (experts.moe_token_split)
    moe_tokens = tokens / moe_token_split(training, plan)
    fp8_rate = acc.peak(training.linear_dtype) * acc.matmul_efficiency
    seconds = 2 * (tokens * attention_params(args, plan.tp) / fp8_rate
                   + moe_tokens * args.n_experts * args.dim / (acc.peak(training.compute_dtype)
                                                               * acc.matmul_efficiency))
    fwd = bwd_in = bwd_w = seconds
    if training.linear_dtype == "fp8":  # Transformer Engine's (torchao's is refused in layer_times)
        bandwidth = acc.mem_bandwidth * acc.bandwidth_efficiency
        share, current = te_weight_cast_share(training, plan), training.float8 == "te-current"
        attention = te_modules(rank_linear_shapes(args, plan)[:len(ATTENTION)])
        cast_fwd, cast_bwd = te_float8_cast_seconds(attention, tokens, bandwidth, share, current=current,
                                                    stored=training.float8_frozen_weights)
        fwd, bwd_in = fwd + cast_fwd, bwd_in + cast_bwd
    experts = experts or expert_mlp_times(args, training, plan, acc, tokens)
    return fwd + experts[0], bwd_in + experts[1], bwd_w + experts[2]


def expert_mlp_times(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator,
                     tokens: float) -> tuple[float, float, float]:
    """Of moe_linear_times, the experts' own: the shared experts' SwiGLU over the MoE's rows and the routed
    experts' over their (token, expert) pairs, at the linears' rate, with TE's float8 casts of their inputs,
    outputs' gradients and weights (forward, input gradients, weight gradients). Megatron-Core's combined 1F1B
    schedule runs these in its 'mlp' node, beside the all-to-alls (_ep_comm)."""
    d, h = args.dim, args.expert_hidden
    shared = args.n_shared_experts * h
    routed = routed_per_token(args, training, plan)
    moe_tokens = tokens / moe_token_split(training, plan)
    fp8_rate = acc.peak(training.linear_dtype) * acc.matmul_efficiency
    fwd = bwd_in = bwd_w = 2 * moe_tokens * (3 * d * shared + routed * 3 * d * h) / fp8_rate
    if training.linear_dtype == "fp8":
        bandwidth = acc.mem_bandwidth * acc.bandwidth_efficiency
        share, current = te_weight_cast_share(training, plan), training.float8 == "te-current"
        shared_fcs = {"shared_fc1": (d, 2 * shared, 2 * d * shared), "shared_fc2": (shared, d, shared * d)} \
            if shared else {}
        experts = args.n_experts // plan.ep
        grouped = {"expert_fc1": (d, 2 * h, experts * 2 * d * h), "expert_fc2": (h, d, experts * h * d)}
        for modules, rows in ((shared_fcs, moe_tokens), (grouped, moe_tokens * routed)):
            if modules:
                cast_fwd, cast_bwd = te_float8_cast_seconds(modules, rows, bandwidth, share, current=current,
                                                            stored=training.float8_frozen_weights)
                fwd, bwd_in = fwd + cast_fwd, bwd_in + cast_bwd
    return fwd, bwd_in, bwd_w


def eager_elementwise_bytes(args: ModelArgs, training: Training, plan: Plan,
                            cpu: bool = False) -> tuple[float, float]:
    """Bytes per token one dense block's eager elementwise operators read and write on one rank, (forward,
    backward): the traffic counted on the engine's block (operators.ELEMENTWISE), per element of the dim, the
    queries' (n_heads x head_dim), the KV and the ffn widths, of head_dim (RoPE's tables) and per token. Under tp
    the query, KV and ffn widths are split; the dim-wide traffic (norms, residual adds, casts) only with sequence
    parallelism: with it that undercounts the casts of an all-gathered norm output. The table counts the
    engine's RMSNorm on a CPU (`cpu`, shardwise.model._RMSNorm); torch's fused kernel (`fused_rmsnorm`, on a
    GPU) replaces those two norms' passes with its own: forward reads the input and writes the output, backward
    reads the gradient and the input and writes the input's gradient, in the residual stream's dtype; torch's
    composite form (not `fused_rmsnorm`: a GPU before torch 2.8) with its counted passes."""
    counted = ELEMENTWISE["fp32" if training.precision == "fp32" else "bf16"]
    dim = args.dim / (plan.tp if plan.sequence_parallel else 1)
    widths = (dim, args.q_dim / plan.tp, args.n_kv_heads * args.head_dim / kv_split(args, plan.tp),
              args.ffn_hidden / plan.tp, args.head_dim, 1)
    forward, backward = (sum(c * w for c, w in zip(coefficients, widths))
                         for coefficients in (counted.forward, counted.backward))
    if not training.fused_rmsnorm:
        forward += dim * (counted.composite_forward - counted.norm_forward)
        backward += dim * (counted.composite_backward - counted.norm_backward)
    elif not cpu:
        stream = training.stream_bytes
        forward += dim * (2 * 2 * stream - counted.norm_forward)
        backward += dim * (2 * 3 * stream - counted.norm_backward)
    return forward, backward


def gemm_seconds(m: float, n: float, k: float, training: Training, acc: Accelerator,
                 dtype: str | None = None) -> float:
    """Seconds of one (m x k) @ (k x n) GEMM in `dtype` (default: the recipe's compute dtype), at the rate its
    shape reaches."""
    dtype = dtype or training.compute_dtype
    return 2 * m * n * k / (acc.peak(dtype) * acc.matmul_eff(m, n, k, dtype))


FLOAT8_KERNEL_S = 2e-6
"""Least seconds of any kernel in a float8 cast: torchao's float8 roofline (torchao.testing.training.roofline_utils,
KERNEL_LAUNCH_OVERHEAD_SEC: "run a triton kernel with a single element read/write on an H100 and measure GPU time
from the trace"); every kernel of a cast takes at least this, the second stage of an amax reduction (a few elements)
exactly this."""


def float8_cast_seconds(tokens: float, n_in: float, n_out: float, bandwidth: float,
                        fused: bool = True) -> tuple[float, float]:
    """Seconds of the float8 casts of one Float8Linear of (n_in, n_out) features over `tokens` rows, (forward,
    backward), kernel by kernel as torchao's float8 roofline prices tensorwise scaling
    (torchao.testing.training.roofline_utils, get_float8_mem_sympy; torchao 0.18), with its fusion modelling where
    the block is compiled (`fused`): each kernel takes max(its bytes / bandwidth, FLOAT8_KERNEL_S).

    * the input (tokens x n_in) and the output's gradient (tokens x n_out): an amax pass (reads the tensor in bf16,
      2 bytes an element; compiled, fused into the kernel that made the tensor: none), the amax's second stage, and
      a cast that reads the tensor in bf16 and writes it in float8 twice, row- and column-major for the two GEMMs
      that use it: 2 + 2 bytes an element;
    * the weight (n_in x n_out): an amax pass (reads it in bf16: 2 bytes), its second stage, and two casts, each
      reading bf16 and writing float8 once (2 + 1): one in forward, the transposed one in backward.

    The input's and the weight's forward kernels run in forward, the weight's second cast and the gradient's
    kernels in backward. The weight is cast whole on every rank: weights gathered in bf16 (FSDP2's float8
    all-gather, which casts the shard, is not modelled)."""
    def kernel(nbytes: float) -> float:
        return max(nbytes / bandwidth, FLOAT8_KERNEL_S)

    x, w, dy = tokens * n_in, n_in * n_out, tokens * n_out

    def amax(n: float) -> float:  # the amax pass (a launch where it is fused) and its second stage
        return kernel(0.0 if fused else 2 * n) + FLOAT8_KERNEL_S

    forward = amax(x) + kernel(4 * x) + kernel(2 * w) + FLOAT8_KERNEL_S + kernel(3 * w)
    backward = kernel(3 * w) + amax(dy) + kernel(4 * dy)
    return forward, backward


# Transformer Engine's linears as Megatron-Core builds a block (TELayerNormColumnParallelLinear for Q/K/V and for
# the MLP's gate + up, TERowParallelLinear for the attention's and the MLP's output projections): which of the
# planner's linears share one module, and so one float8 cast of their input and of their output's gradient
TE_MODULES = {"wq": "qkv", "wk": "qkv", "wv": "qkv", "wo": "proj", "w1": "fc1", "w3": "fc1", "w2": "fc2"}
TE_NORM_FUSED = frozenset({"qkv", "fc1"})
"""The modules whose input is a norm's output: TE's fused norm writes it in float8 directly, leaving only its
transposed copy for the weight gradient to make."""


def te_float8_cast_seconds(modules: dict[str, tuple[float, float, float]], tokens: float, bandwidth: float,
                           micro_batches: int, current: bool, stored: bool = False) -> tuple[float, float]:
    """Seconds of Transformer Engine's float8 casts in one block over `tokens` rows, (forward, backward), for
    `modules`: name -> (input features, output features, weight elements) on this rank.

    TE runs each linear with two float8 copies of each operand, row-wise for one GEMM and column-wise (transposed)
    for the other (Hopper's float8 GEMMs take only the TN layout): a cast_transpose kernel reads the bf16 tensor
    once and writes both, 2 + 1 + 1 bytes an element. A module whose input is a norm's output gets it in float8
    from the fused norm and makes only the transpose (1 + 1); the output's gradient is cast_transposed in backward.
    The weight is cast the same way (2 + 1 + 1) on a step's first micro-batch only: Megatron-Core tells TE which
    micro-batch is the first (is_first_microbatch) and TE keeps the float8 weight for the rest, so its cost is
    spread over the step's `micro_batches`. Delayed scaling takes the scale from the amax history (the amax comes
    out of the cast itself); current scaling (`current`) first reads the tensor for its amax (2 bytes an element,
    and the weight's once per step). Weights stored in float8 (`stored`: LoRA's frozen ones,
    Training.float8_frozen_weights) are not cast; each backward transposes them for its input-gradient GEMM (1 + 1
    bytes an element). Each kernel takes at least FLOAT8_KERNEL_S."""
    def kernel(nbytes: float) -> float:
        return max(nbytes / bandwidth, FLOAT8_KERNEL_S)

    amax = 2 if current else 0
    forward = backward = 0.0
    for name, (n_in, n_out, weight) in modules.items():
        x, dy = tokens * n_in, tokens * n_out
        forward += kernel((2 if name in TE_NORM_FUSED else 4 + amax) * x)
        if amax and name in TE_NORM_FUSED:
            forward += kernel(amax * x)
        if stored:
            backward += kernel(2 * weight)
        else:
            forward += kernel((4 + amax) * weight) / micro_batches
        backward += kernel((4 + amax) * dy)
    return forward, backward


def rank_linear_shapes(args: ModelArgs, plan: Plan) -> list[tuple[str, float, float]]:
    """(name, in, out) features of a dense block's linears on one tp rank, in forward order: split as
    memory.linear_shapes says ('row' its inputs, 'kv' its outputs by at most the KV heads, 'col' its outputs)."""
    out = []
    for name, n_in, n_out, split in linear_shapes(args):
        if split == "row":
            n_in /= plan.tp
        else:
            n_out /= kv_split(args, plan.tp) if split == "kv" else plan.tp
        out.append((name, n_in, n_out))
    return out


def te_modules(shapes: list[tuple[str, float, float]]) -> dict[str, tuple[float, float, float]]:
    """Transformer Engine's modules over the linears `shapes` (rank_linear_shapes), as te_float8_cast_seconds takes
    them: name -> (input features, output features, weight elements); wq, wk and wv are one module (qkv), w1 and w3
    another (fc1)."""
    modules: dict[str, tuple[float, float, float]] = {}
    for name, n_in, n_out in shapes:
        _, out, weight = modules.get(TE_MODULES[name], (n_in, 0.0, 0.0))
        modules[TE_MODULES[name]] = (n_in, out + n_out, weight + n_in * n_out)
    return modules


def te_weight_cast_share(training: Training, plan: Plan) -> int:
    """Micro-batches over which Transformer Engine's float8 weights are cast once (te_float8_cast_seconds): the
    step's, unless ZeRO-3 gathers the weights afresh for each micro-batch; 1 outside TE's float8."""
    if training.linear_dtype != "fp8" or training.float8 == "torchao" or plan.zero_stage >= 3:
        return 1
    return max(plan.grad_accum, 1)


def lora_first_block_skipped(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator,
                             times: dict[str, float]) -> float:
    """Seconds of input gradients the first block does not compute under LoRA: the embedding is frozen, so the
    block's input needs no gradient, and a linear's input needs one only if an adapter before it in the block made
    part of it (LINEAR_GROUPS): until the first adapted group, no input gradient of the frozen linears (x's, through
    W) or of their adapters (through A) is computed, nor the attention's backward where no query, key or value
    projection is adapted (its gradient reaches only frozen inputs). Counted from the engine's LoRA model by
    torch's matmul counter (tests/test_planner.py). Left priced, a little high: the skipped gradients' tp
    reductions, context parallelism's dK/dV exchange, the norm's and rotary's backward and QLoRA's backward
    dequantisation of those linears."""
    tokens = plan.micro_batch * training.seq_len / plan.cp  # a dense block's rows (its GEMMs split by tp)
    shapes = {name: (n_in, n_out) for name, n_in, n_out in rank_linear_shapes(args, plan)}
    first = {group[0][0] for group in adapter_groups(args, training)}  # an adapter's A, once (fused projections)
    skipped, upstream = 0.0, False
    for group in LINEAR_GROUPS:
        for name in (n for n in group if n in shapes and not upstream):
            n_in, n_out = shapes[name]
            skipped += gemm_seconds(tokens, n_in, n_out, training, acc, training.linear_dtype)
            if name in first:
                skipped += gemm_seconds(tokens, n_in, training.lora_rank, training, acc)
        if group == LINEAR_GROUPS[0] and not any(n in training.lora_targets for n in group):
            skipped += times["attention_bwd"]
        upstream = upstream or any(n in training.lora_targets and n in shapes for n in group)
    return skipped


def adapter_times(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator,
                  tokens: float) -> tuple[float, float, float]:
    """Seconds of a block's LoRA adapters on one tp rank over `tokens` rows: (forward, input gradients, weight
    gradients). Each adapted linear's adapter (shardwise.lora.LoRALinear: F.linear(F.linear(x, A), B)) is six thin
    GEMMs at their shapes (bound by reading the activations: Accelerator.matmul_eff's roofline): x A and (x A) B
    forward; the gradient through B and A backward, in the input-gradient pass; B's and A's own in the weight pass
    (zero-bubble's deferred one: torch's stage_backward_input leaves them to stage_backward_weight). On a tp rank
    the adapter spans what its linear does (A whole and B split for a column-parallel linear, A split and B whole
    for a row-parallel one: parallel/tensor_parallel.py). Under fused projections one adapter spans a fused linear
    (memory.adapter_groups): one A over the shared input, one B over the linears' outputs together."""
    fwd = bwd_in = bwd_w = 0.0
    r = training.lora_rank
    if not r:
        return fwd, bwd_in, bwd_w
    shapes = {name: (n_in, n_out) for name, n_in, n_out in rank_linear_shapes(args, plan)}
    for group in adapter_groups(args, training):
        n_in, n_out = shapes[group[0][0]][0], sum(shapes[name][1] for name, *_ in group)
        fwd += gemm_seconds(tokens, r, n_in, training, acc) + gemm_seconds(tokens, n_out, r, training, acc)
        bwd_in += gemm_seconds(tokens, r, n_out, training, acc) + gemm_seconds(tokens, n_in, r, training, acc)
        bwd_w += gemm_seconds(n_out, r, tokens, training, acc) + gemm_seconds(r, n_in, tokens, training, acc)
    return fwd, bwd_in, bwd_w


def lora_first_block_replay_skipped(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator) -> float:
    """Seconds of the first block's recompute that an early-stopping checkpoint does not run under LoRA beyond w2
    (matmul_last): a saved tensor is packed before its op computes, so the replay stops before the last op that
    saves one. In later blocks that is w2's frozen linear (it packs its weight), after its adapter; in the first
    block, where w2's input needs no gradient (no adapter before it: lora_first_block_skipped), the frozen linear
    saves nothing and the last is w2's adapter's second GEMM, (x A) B, which then does not run again either."""
    targets = training.lora_targets
    upstream = [n for group in LINEAR_GROUPS[:-1] for n in group]
    if "w2" not in targets or any(n in targets for n in upstream):
        return 0.0
    tokens = plan.micro_batch * training.seq_len / plan.cp  # a dense block's rows (its GEMMs split by tp)
    _, _, n_out = next(shape for shape in rank_linear_shapes(args, plan) if shape[0] == "w2")
    return gemm_seconds(tokens, n_out, training.lora_rank, training, acc)


def linear_times(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator,
                 tokens: float, last_only: bool = False) -> tuple[float, float, float]:
    """Seconds of a dense block's linears on one tp rank over `tokens` rows: (forward, input gradients, weight
    gradients). Each linear of (in, out) features, split by tp as linear_shapes says, is three GEMMs: forward
    (tokens x in) @ (in x out), input gradient (tokens x out) @ (out x in), weight gradient (out x tokens) @
    (tokens x in), each at the efficiency of its own shape (Accelerator.matmul_eff) in the recipe's linear dtype.
    In float8 (precision fp8) the GEMMs run at the fp8 peak (at the same share of it as bf16's at the same shape:
    torchao's roofline assumes one achievable share for both) and the casts are added at the elementwise
    bandwidth: torchao's per linear (float8_cast_seconds; their amax passes fused where the block is compiled), or
    Transformer Engine's per module (te_float8_cast_seconds, Training.float8). `last_only`: the block's last
    linear alone (w2, which a recompute that stops early does not run again: Training.checkpoint_early_stop)."""
    dtype = training.linear_dtype
    bandwidth = acc.mem_bandwidth * acc.bandwidth_efficiency
    te = dtype == "fp8" and training.float8 != "torchao"
    fwd = bwd_in = bwd_w = 0.0
    shapes = rank_linear_shapes(args, plan)[-1:] if last_only else rank_linear_shapes(args, plan)
    for _, n_in, n_out in shapes:
        fwd += gemm_seconds(tokens, n_out, n_in, training, acc, dtype)
        bwd_in += gemm_seconds(tokens, n_in, n_out, training, acc, dtype)
        bwd_w += gemm_seconds(n_out, n_in, tokens, training, acc, dtype)
        if dtype == "fp8" and not te:
            cast_fwd, cast_bwd = float8_cast_seconds(tokens, n_in, n_out, bandwidth, fused=training.compile)
            fwd += cast_fwd
            bwd_in += cast_bwd
    if te:
        cast_fwd, cast_bwd = te_float8_cast_seconds(te_modules(shapes), tokens, bandwidth,
                                                    te_weight_cast_share(training, plan),
                                                    current=training.float8 == "te-current",
                                                    stored=training.float8_frozen_weights)
        fwd += cast_fwd
        bwd_in += cast_bwd
    return fwd, bwd_in, bwd_w


def stage_cost(args: ModelArgs, training: Training, plan: Plan, cluster: Cluster) -> StageCost:
    """One micro-batch's forward + backward on the heaviest pipeline rank: the one with the head, or one with the
    most blocks of the engine's cost-balanced split (memory.ranks_to_check)."""
    # memoised: a search asks again for every dp split and ZeRO stage. The key holds the model, recipe and cluster
    # (frozen, hashed once) and the layout's fields the cost reads (the pp link's stride depends on dp).
    key = (args, training, cluster, plan.tp, plan.cp, plan.pp, plan.dp, plan.virtual_stages, plan.pp_schedule,
           plan.micro_batch, plan.grad_accum, plan.activation_checkpoint, plan.sequence_parallel, plan.ep,
           te_weight_cast_share(training, plan), training.bf16_optimizer_active(plan.zero_stage, plan.offload),
           checkpoint_period(plan))
    cost = _STAGE_COSTS.get(key)
    if cost is None:
        ranks = placement(args, plan, training.seq_len, training.pipeline_split).ranks
        times = _block_times(args, training, plan, cluster.accelerator)
        cost = max((_stage_cost(args, training, plan, cluster, s, times) for s in ranks), key=lambda c: c.total)
        if len(_STAGE_COSTS) >= 100_000:
            _STAGE_COSTS.clear()
        _STAGE_COSTS[key] = cost
    return cost


_STAGE_COSTS: dict[tuple, StageCost] = {}


def _max_stage_params(args: ModelArgs, training: Training, plan: Plan) -> float:
    """Parameters on the pipeline rank holding the most (it sets the pace of gradient reduction and the optimizer)."""
    return placement(args, plan, training.seq_len, training.pipeline_split).max_params


def _gathered_bytes(args: ModelArgs, training: Training, plan: Plan, params: float, blocks: float) -> float:
    """Bytes FSDP gathers for `params` parameters of which `blocks` are in blocks (memory.gathered_unit_bytes:
    LoRA's frozen weights as the engine stores them); the root unit's as the first pipeline rank holds it (with
    the head where there is no pipeline; a pipeline's last rank holds the head in the compute dtype: fewer)."""
    in_block, in_root = gathered_unit_bytes(args, training, plan, 0)
    if in_block == in_root:
        return params * in_block
    return blocks * in_block + max(0.0, params - blocks) * in_root


def _block_times(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator) -> tuple[dict, dict | None]:
    """layer_times of a dense block and, of a mixture of experts, of an MoE block."""
    moe = layer_times(args, training, plan, acc, moe=True) if args.n_moe_layers else None
    return layer_times(args, training, plan, acc), moe


def _stage_cost(args: ModelArgs, training: Training, plan: Plan, cluster: Cluster, stage: int,
                times: tuple[dict, dict | None] | None = None) -> StageCost:
    if partial_checkpointing(plan):
        # some blocks checkpointed: each term is a sum over the rank's blocks (their forward, its replay, their
        # collectives and weight casts), so n checkpointed blocks of L cost n/L of the difference the policy makes
        every_block = replace(plan, activation_checkpoint_every=1)
        ck, bare = (_stage_cost(args, training, p, cluster, stage, times)
                    for p in (every_block, replace(every_block, activation_checkpoint="none")))
        shape = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split)
        share = checkpointed_blocks(args, training, plan, stage) / shape.layers
        cost = StageCost(*(b + share * (c - b) for c, b in zip(astuple(ck), astuple(bare))))
        if training.lora_rank and training.checkpoint_early_stop and plan.activation_checkpoint == "full" \
                and stage == 0 and shape.layers > shape.moe_layers:
            # but block 0's replay skips more (below): all of that where it is checkpointed (the engine's model
            # indices 0, k, ...), none where not (a system counting from 1), not a share
            skipped = lora_first_block_replay_skipped(args, training, every_block, cluster.accelerator)
            whole = skipped if block_zero_checkpointed(args, training, plan) else 0.0
            cost = replace(cost, recompute=cost.recompute + share * skipped - whole)
        return cost
    acc = cluster.accelerator
    t, t_moe = times or _block_times(args, training, plan, acc)
    shape = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split)
    layers, moe = shape.layers, shape.moe_layers
    # (blocks, their times): the dense blocks, and a mixture of experts' MoE blocks
    kinds = [(layers - moe, t)] + ([(moe, t_moe)] if moe else [])

    def blocks(term) -> float:
        return sum(n * term(times) for n, times in kinds)

    head_fwd, head_in, head_w = _head_times(args, training, plan, acc) if shape.last else (0.0, 0.0, 0.0)
    # weight gradients (W) and input gradients (B) each cost about one forward's matmuls, at their own shapes;
    # frozen LoRA weights have no W
    w_factor = 0.0 if training.lora_rank else 1.0
    fwd = blocks(lambda t: t["matmul"] + t["adapter"] + t["attention"] + t["elementwise"]) + head_fwd
    bwd_in = blocks(lambda t: t["matmul_bwd_input"] + t["adapter_bwd_input"] + t["attention_bwd"]
                    + t["elementwise_bwd"]) + head_in
    if training.lora_rank and stage == 0 and layers > moe:
        bwd_in -= lora_first_block_skipped(args, training, plan, acc, t)
    # (LoRA's adapters have weight gradients where their frozen linears have none)
    bwd_w = (blocks(lambda t: t["matmul_bwd_weight"]) + head_w) * w_factor + blocks(lambda t: t["adapter_bwd_weight"])
    if plan.activation_checkpoint == "full":
        # the forward again, but for the last linear where the checkpoint stops early (Training.checkpoint_early_stop);
        # LoRA's adapters all run again (the frozen base linear after them packs only its weight)
        recompute = blocks(lambda t: t["matmul"] + t["adapter"] + t["attention"] + t["elementwise"]
                           - (t["matmul_last"] if training.checkpoint_early_stop else 0.0))
        if training.lora_rank and training.checkpoint_early_stop and stage == 0 and layers > moe:
            recompute -= lora_first_block_replay_skipped(args, training, plan, acc)
    elif plan.activation_checkpoint == "selective":
        # Korthikanti et al.'s selective recompute is the attention core (QK^T, softmax, dropout, AV); a fused
        # kernel's backward recomputes that anyway, and selective then means the cheap elementwise tensors;
        # torchtitan's op-level policy also recomputes every second matmul (memory.block_terms)
        recompute = blocks(lambda t: t["elementwise"] if training.fused_attention else t["attention"])
        if training.selective == "attention-core" and training.fused_attention:
            recompute = blocks(lambda t: t["attention"])  # the fused kernel's forward, again in backward
        if training.selective == "alternate-matmuls" and training.fused_attention:
            recompute += (layers - moe) * t["matmul"] * recomputed_matmul_share(args, plan.tp)
    else:
        recompute = 0.0
    dequant_fwd, dequant_bwd, dequant_ops = qlora_dequant(args, training, plan, acc, layers)
    if dequant_fwd:  # QLoRA: the NF4 base is dequantised in forward, in a recompute, and for input gradients
        recomputes = plan.activation_checkpoint != "none"
        fwd, bwd_in, recompute = fwd + dequant_fwd, bwd_in + dequant_bwd, recompute + recomputes * dequant_fwd
    weights_fwd, weights_recompute, weights_bwd = weight_traffic_seconds(args, training, plan, acc, stage)
    fwd, recompute, bwd_w = fwd + weights_fwd, recompute + weights_recompute, bwd_w + weights_bwd
    bwd_w += bf16_accumulation_seconds(training, plan, acc, shape.params)
    replayed = _weight_pass_replay(args, training, plan, stage)
    bwd_w += replayed * recompute  # in the deferred weight pass, with its own time slot
    overhead = op_overhead(args, training, plan, acc, layers, shape.last, fwd + bwd_in + bwd_w + recompute, dequant_ops,
                           moe)
    tp_comm = _tp_comm(args, training, plan, cluster, layers, stage == 0, shape.last, moe)
    tp_comm_weight = 0.0
    if replayed:  # the replayed forward's collectives, in the weight pass
        bare = _tp_comm(args, training, replace(plan, activation_checkpoint="none"), cluster, layers, stage == 0,
                        shape.last, moe)
        tp_comm_weight = replayed * (tp_comm - bare)
    return StageCost(fwd, bwd_in, bwd_w, recompute, tp_comm + tp_comm_weight,
                     _cp_exposed(args, training, plan, cluster, layers, t["attention"], t["attention_bwd"]),
                     _pp_p2p(args, training, plan, cluster, stage), overhead,
                     _ep_comm(args, training, plan, cluster, moe, t_moe), tp_comm_weight)


CAST_BYTES = 4 + 2
"""Bytes per element of autocast's cast of an fp32 weight to the compute dtype (the weight read, the copy written),
and of that cast's backward, which turns the weight's compute-dtype gradient into fp32 (2 read, 4 written)."""
ACCUMULATE_BYTES = 4 + 4 + 4
"""Bytes per element of autograd's AccumulateGrad adding a micro-batch's fp32 gradient into `.grad` in place."""


def head_gradient_blocks(args: ModelArgs, training: Training, plan: Plan) -> int:
    """Blocks of rows the fused head runs one micro-batch in (shardwise.loss.head_loss_sum, model_args.head_rows:
    its whole input, this rank's vocabulary rows)."""
    tokens = plan.micro_batch * training.seq_len // plan.cp
    vocab = -(-args.vocab_size // plan.tp)
    return -(-tokens // head_rows(tokens, args.dim, vocab))


def weight_traffic_bytes(args: ModelArgs, training: Training, plan: Plan, stage: int
                         ) -> tuple[float, float, float]:
    """(forward, recompute, backward) bytes one micro-batch moves over a rank's weights and weight gradients in
    shardwise's engine (layout 'torch'), which the per-token elementwise count leaves out
    (opcount.block_elementwise_bytes: what does not scale with tokens drops out there):

    - autocast's casts (casts_weights; float8 linears cast their own, priced with them): each fp32 matmul weight
      of the rank's blocks is cast to the compute dtype in forward (again in a recompute, full or selective: the
      cast is not an operator selective checkpointing keeps), and its gradient is cast back to fp32 in backward
      (CAST_BYTES each);
    - the fused head (memory.fused_head), on the head's rank when the head trains: its fp32 weight gradient is
      made in the loss's forward, as zeros (4 bytes an element), and added to once per block of rows
      (head_gradient_blocks): under mixed precision each block's product is written in the compute dtype and
      then added (2 + 2 + 4 + 4), in fp32 one addmm_ reads and writes it (4 + 4); under mixed precision the
      weight is cast once (CAST_BYTES). The backward scales it in place by the loss's gradient (4 + 4). The
      product's GEMM is priced by its FLOPs elsewhere, but with as few rows as a block has it is bound by these
      writes;
    - gradient accumulation: every micro-batch after a step's first adds its fp32 gradients into `.grad`
      (ACCUMULATE_BYTES), over the rank's trainable parameters (unsharded: under FSDP the engine syncs gradients
      once a step), charged as (m - 1) / m of it to each of the m micro-batches.
    """
    if training.layout != "torch":
        return 0.0, 0.0, 0.0
    shape = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split)
    fwd = recompute = bwd = 0.0
    if casts_weights(training) and training.precision != "fp8":  # float8 linears cast their own (float8_cast_seconds)
        cast = (shape.blocks - shape.layers * 2 * args.dim if shape.moe_layers
                else shape.layers * (layer_params(args, plan.tp) - 2 * args.dim))
        fwd += cast * CAST_BYTES
        recompute += cast * CAST_BYTES if plan.activation_checkpoint != "none" else 0.0
        bwd += cast * CAST_BYTES
    if shape.last and fused_head(training, plan) and not training.lora_rank:
        head = args.vocab_size * args.dim / plan.tp
        per_block = 2 + 2 + 4 + 4 if training.mixed else 4 + 4
        fwd += head * (4 + head_gradient_blocks(args, training, plan) * per_block
                       + (CAST_BYTES if training.mixed else 0))
        bwd += head * (4 + 4)
    m = plan.grad_accum
    trainable = shape.layers * lora_params(args, training, plan.tp) if training.lora_rank else shape.params
    bwd += (m - 1) / m * trainable * ACCUMULATE_BYTES
    return fwd, recompute, bwd


def weight_traffic_seconds(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator,
                           stage: int) -> tuple[float, float, float]:
    """weight_traffic_bytes at the elementwise bandwidth."""
    bandwidth = acc.mem_bandwidth * acc.bandwidth_efficiency
    return tuple(b / bandwidth for b in weight_traffic_bytes(args, training, plan, stage))


BF16_ACCUMULATION_BYTES = 2 + 4 + 4 + 4 + 4
"""Bytes per parameter of DeepSpeed's BF16_Optimizer.update_hp_grads, `hp_grad.add_(lp.grad.to(float32))`: the
bf16 gradient read and its fp32 copy written, then the copy and the fp32 gradient read and the sum written."""


def bf16_accumulation_seconds(training: Training, plan: Plan, acc: Accelerator, stage_params: float) -> float:
    """Seconds per micro-batch of DeepSpeed's BF16_Optimizer adding the micro-batch's bf16 gradients into its fp32
    buffer (Training.keeps_bf16_grads; its pipeline engine calls update_hp_grads after every backward), over the
    stage's trainable parameters at the elementwise bandwidth; 0 where that optimizer does not run."""
    if not training.bf16_optimizer_active(plan.zero_stage, plan.offload) or training.lora_rank:
        return 0.0
    return stage_params * BF16_ACCUMULATION_BYTES / (acc.mem_bandwidth * acc.bandwidth_efficiency)


def _weight_pass_replay(args: ModelArgs, training: Training, plan: Plan, stage: int) -> float:
    """Of a rank's recompute, the share the engine runs twice: under zero-bubble the input pass and the deferred
    weight pass are separate backward calls, and torch's checkpoint rebuilds a block at each call that reaches
    it (shardwise.parallel.pipeline.Stage makes the weight pass's calls share one). The first stage has no input
    pass: its blocks are rebuilt once."""
    if plan.pp == 1 or plan.pp_schedule != "zero-bubble" or plan.activation_checkpoint != "full":
        return 0.0
    if stage != 0:
        return 1.0
    first, last = zero_bubble_chunks(args, plan, stage, training.seq_len, training.pipeline_split)
    return len(last) / (len(first) + len(last))


def recomputed_matmul_share(args: ModelArgs, tp: int) -> float:
    """Of a dense block's matmul FLOPs, the share torchtitan's op-level selective checkpointing recomputes: every
    second matmul in forward order (SwiGLU: wk, wo and w3)."""
    sizes = [n_in * n_out / (kv_split(args, tp) if split == "kv" else tp)
             for _, n_in, n_out, split in linear_shapes(args)]
    return sum(sizes[1::2]) / sum(sizes)


def qlora_dequant(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator,
                  layers: int) -> tuple[float, float, float]:
    """QLoRA: (forward seconds, backward seconds, operators) of dequantising a rank's NF4 base weights for one
    micro-batch. torchao's eager dequantisation is memory-bound: the bytes its kernels read and write per weight,
    counted on the engine's block (operators.QLORA_DEQUANT), at the elementwise bandwidth. In a compiled block
    (Training.compile) dynamo traces through the NF4 weight and inductor fuses its whole dequantisation into one
    kernel before the matmul (tests/test_planner_system.py reads the generated code): it reads the 4-bit codes and
    their block constants once and writes the weight once in the compute dtype, in forward (and a recompute); the
    backward's input gradient takes the weight the forward saved (memory.layer_activation_bytes), no pass. Every
    rank dequantises the whole (gathered) weight: FSDP shards the 4-bit storage, not this work. 0 without QLoRA."""
    if not training.qlora:
        return 0.0, 0.0, 0.0
    weights = layers * adapted_base_params(args, training, plan.tp)
    bandwidth = acc.mem_bandwidth * acc.bandwidth_efficiency
    if training.compile:
        moved = weights * (QLORA_BITS / 8 + DTYPE_BYTES[training.compute_dtype])
        return moved / bandwidth, 0.0, layers * len(adapted_shapes(args, training))
    # fp8 recipes dequantise to bf16 as well (the fp8 cast of the matmul input comes after, priced with the matmul)
    cost = QLORA_DEQUANT["bf16" if training.precision == "fp8" else training.precision]
    ops = layers * len(adapted_shapes(args, training)) * (cost.forward_ops + cost.backward_ops)
    return weights * cost.forward_bytes / bandwidth, weights * cost.backward_bytes / bandwidth, ops


def op_overhead(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator, layers: int, head: bool,
                compute: float, extra_ops: float = 0.0, moe_layers: int = 0) -> float:
    """Seconds of fixed per-operator cost in one micro-batch's forward + backward on a rank, beyond `compute`.

    Operators: the blocks' (`moe_layers` of them MoE blocks; and, on the head's rank, embedding, head and loss)
    counted in our model (opcount), with autocast's casts where the engine runs under it (Training.autocasts); a
    LoRA model's blocks lose their frozen weights' gradient operators and gain each adapter's (operators.LORA_OPS);
    under tp the 7 projections of each dense block (the 4 of an MoE block's
    attention: the MoE is plain tensors) run on DTensors and pay `dtensor_op_overhead_s` more per operator.
    On a CPU the cost adds to the arithmetic (the same cores do both); where launches are asynchronous (a GPU)
    it hides behind the kernels: only max(0, overhead - compute) is exposed. Recomputed forwards are not counted.
    """
    c = op_counts(args, training.autocasts)
    block, rest = c.block, c.rest
    projection_ops = len(projection_shapes(args)) * c.linear  # of a dense block, what tp runs on DTensors
    if training.lora_rank:  # the config refuses LoRA on a mixture of experts
        lora = LORA_OPS[training.lora_dropout > 0, training.autocasts]
        adapted = [group[0][0] for group in adapter_groups(args, training)]  # an adapter's operators once
        block, rest, adapters = lora_block_ops(block, lora, adapted), rest + lora.rest, len(adapted)
        projection_ops = (adapters * lora.adapted_linear
                          + (len(projection_shapes(args)) - adapters) * lora.frozen_linear)
    blocks = (layers - moe_layers) * block + moe_layers * c.moe_block
    t = (blocks + (rest if head else 0) + extra_ops) * acc.op_overhead_s
    if plan.tp > 1:
        t += ((layers - moe_layers) * projection_ops + moe_layers * 4 * c.linear) * acc.dtensor_op_overhead_s
    return max(0.0, t - compute) if acc.launch_async else t


def _head_times(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator) -> tuple[float, float, float]:
    """Output head on the last stage, (forward, input gradient, weight gradient): each its GEMM at its shape (the
    vocabulary split by tp) and the loss's softmax (elementwise over the vocabulary)."""
    tokens = plan.micro_batch * training.seq_len / plan.cp
    vocab = args.vocab_size / plan.tp
    loss = tokens * vocab * (training.act_bytes + 4 + 4) / (acc.mem_bandwidth * acc.bandwidth_efficiency)
    return (gemm_seconds(tokens, vocab, args.dim, training, acc) + loss,
            gemm_seconds(tokens, args.dim, vocab, training, acc) + loss,
            gemm_seconds(vocab, args.dim, tokens, training, acc) + loss)


def tp_block_bytes(training: Training) -> tuple[int, int]:
    """Bytes an element of a block's sequence-parallel all-gathers and of its reduce-scatters carry. The compute
    dtype both, except under torchao's float8 tensor parallelism, as torchtitan applies it to float8 linears
    (torchao.float8.float8_tensor_parallel, 2025): PrepareFloat8ModuleInput and Float8ColwiseParallel cast the
    sequence-sharded input to float8 "before the all-gather (i.e. Shard -> Replicate)", and Float8RowwiseParallel
    casts its output's gradient to float8 (NoopFwToFloat8BwDynamic) before the backward of its reduce-scatter, an
    all-gather; the reduce-scatters carry the matmuls' outputs and input gradients in the compute dtype.
    Transformer Engine's sequence-parallel gathers are priced in the compute dtype (not modelled in float8)."""
    if training.linear_dtype == "fp8" and training.float8 == "torchao":
        return DTYPE_BYTES["fp8"], training.act_bytes
    return training.act_bytes, training.act_bytes


def _tp_comm(args: ModelArgs, training: Training, plan: Plan, cluster: Cluster, layers: int, embedding: bool,
             head: bool, moe_layers: int = 0) -> float:
    """Per block: forward 2 all-reduces of the hidden activations (after wo and w2), backward 2 more (for the
    column-parallel inputs); with sequence parallelism each all-reduce is an all-gather + reduce-scatter pair.
    Full recompute replays the forward's two, after all-gathering the block's saved input where it was split
    over the tp ranks (Training.distribute_checkpoints, without sequence parallelism); a recompute that stops
    early (Training.checkpoint_early_stop) stops before the last linear, whose output's reduction (the all-reduce,
    or the reduce-scatter of the pair) it leaves out. Selective recompute by torch's checkpoint (the policies
    'matmuls' and 'alternate-matmuls') replays the collectives its policy does not keep, as early-stopping full
    recompute does; torchtitan's policy keeps the reduce-scatters' outputs, so under sequence parallelism it
    replays the two all-gathers only; Megatron's ('attention-core', and every policy over unfused attention)
    replays none. The embedding's rank
    reduces the partial lookups once; the head's rank reduces the head's input gradient once and, unless the loss
    runs on vocabulary-parallel logits (`loss_parallel`, or shardwise's fused head: memory.fused_head),
    all-gathers the logits to every tp rank in forward (shardwise's engine does where its head is not fused: LoRA
    or NF4 on the head).
    An MoE block (`moe_layers` of the `layers`) has only its attention's pair: every tp rank runs the whole MoE on
    replicated input and keeps its output; with sequence parallelism that input is all-gathered in forward and
    the output's gradient in backward (the input's gradient, whole on every rank, is sliced, not reduced); a
    recompute, full or selective, replays all three of its forward's collectives (less the reduce-scatter
    torchtitan's policy keeps). Megatron-Core's MoE (Training.moe_layer 'megatron-core') routes each tp rank's
    sequence-parallel shard: nothing beyond the attention's pair.
    Under torchao's float8 tensor parallelism a block's all-gathers carry float8 (tp_block_bytes)."""
    if plan.tp == 1:
        return 0.0
    n, link = axis_link(plan, ("tp",), cluster, spread=True)
    tokens = plan.micro_batch * training.seq_len / plan.cp
    x = tokens * args.dim * training.act_bytes
    one = all_gather(x, n, link) + reduce_scatter(x, n, link) if plan.sequence_parallel else all_reduce(x, n, link)
    block = one  # a block's pair, its all-gather in float8 where the linears cast before it (tp_block_bytes)
    gathered, scattered = (tokens * args.dim * b for b in tp_block_bytes(training))
    if plan.sequence_parallel:
        block = all_gather(gathered, n, link) + reduce_scatter(scattered, n, link)
    # torch's selective checkpoint (non-reentrant, so it stops early) keeps its policy's ops and replays the rest,
    # collectives too, but the reduce-scatters where torchtitan's policy keeps them
    selective = (plan.activation_checkpoint == "selective" and training.fused_attention
                 and training.selective != "attention-core")
    kept_scatter = reduce_scatter(scattered, n, link) if (
        selective and training.selective == "alternate-matmuls" and plan.sequence_parallel) else 0.0
    replayed = 0.0
    if plan.activation_checkpoint == "full" or selective:
        stops_early = selective or training.checkpoint_early_stop  # before the last linear's reduction
        last = (reduce_scatter(scattered, n, link) if plan.sequence_parallel else all_reduce(x, n, link)) \
            if stops_early else 0.0
        replayed = 2 * block - last - kept_scatter
    total = (layers - moe_layers) * (4 * block + replayed) + (one if embedding else 0.0)
    if plan.activation_checkpoint == "full" and training.distribute_checkpoints and not plan.sequence_parallel:
        total += layers * all_gather(tokens * args.dim * training.stream_bytes, n, link)
    if moe_layers:  # an MoE block's recompute needs all three of its forward's collectives (the MoE's input too)
        gathers = plan.sequence_parallel and training.moe_layer != "megatron-core"
        moe_pass = one + (all_gather(x, n, link) if gathers else 0.0)
        moe_replayed = moe_pass - kept_scatter if plan.activation_checkpoint == "full" or selective else 0.0
        total += moe_layers * (2 * moe_pass + moe_replayed)
    if head:
        total += one
        if not (training.loss_parallel or fused_head(training, plan)):  # the fused loss is vocabulary-parallel
            total += all_gather(tokens * args.vocab_size * training.act_bytes, n, link)
    return total


def _ep_comm(args: ModelArgs, training: Training, plan: Plan, cluster: Cluster, moe_layers: int,
             t_moe: dict | None = None) -> float:
    """Expert parallelism, per MoE block and micro-batch: forward exchanges the per-expert counts, then dispatches
    the routed copies to their experts' ranks and combines the results back (two all-to-alls of the copies);
    backward runs the two again for their gradients; full recompute replays the forward's three. Each waits for
    the busiest rank, which receives (dispatch) and sends back (combine) the imbalance times the mean:
    tokens x routed_per_token x d in the compute dtype, or under DeepEP's dispatch each token once per rank it goes
    to (experts.dispatch_bytes). Over the ep group's link (comm.expert_links).

    Under Megatron-Core's all-to-all overlap (Training.ep_overlap) what is exposed of them is ep_overlap_exposed's
    where the schedule merges a forward with a backward, the rest as above."""
    if plan.ep == 1 or not moe_layers:
        return 0.0
    (n, link), _ = expert_links(plan, cluster)
    copies = all_to_all(dispatch_bytes(args, training, plan), n, link)
    counts = all_to_all(counts_bytes(args), n, link)
    forward = counts + 2 * copies
    replay = forward if plan.activation_checkpoint == "full" else 0.0
    if not training.ep_overlap or t_moe is None:
        return moe_layers * (forward + replay + 2 * copies)
    merged = merged_share(plan)
    exposed = ep_overlap_exposed(t_moe, copies, counts, link.sm_share)
    return moe_layers * (merged * exposed + (1 - merged) * (forward + 2 * copies) + replay)


def ep_overlap_exposed(t: dict, copies: float, counts: float, sm_share: float = 0.0) -> float:
    """Seconds of all-to-all one MoE block leaves exposed per micro-batch under Megatron-Core's combined 1F1B
    (--overlap-moe-expert-parallel-comm, with --delay-wgrad-compute): one micro-batch's forward and another's
    backward of the block run together, its all-to-alls on a communication stream, in three phases
    (models/common/model_chunk_schedule_plan.py, TransformerLayerSchedulePlan.run, core_r0.17.0):

        comm:  combine_bwd | dispatch_fwd -> dispatch_bwd   | combine_fwd
        comp:  attn_fwd    | mlp_bwd -> mlp_bwd_dw -> mlp_fwd | attn_bwd

    'mlp' is the experts' grouped MLP (layer_times' experts: their GEMMs and casts), 'attn' the rest of the block
    (attention, norms, router, permutation). In the middle phase the experts' forward waits for the forward's
    dispatch and the backward's dispatch for the experts' input gradients. Each phase takes its longer stream,
    and compute beside a collective runs on the SMs NCCL leaves it (`sm_share` of the shorter, Link.sm_share).
    What the pair takes beyond its compute is the exposed all-to-all."""
    mlp_f, mlp_dgrad, mlp_dw = t["experts"], t["experts_bwd_input"], t["experts_bwd_weight"]
    block_f = t["matmul"] + t["attention"] + t["elementwise"]
    block_b = t["matmul_bwd_input"] + t["matmul_bwd_weight"] + t["attention_bwd"] + t["elementwise_bwd"]
    attn_f, attn_b = block_f - mlp_f, block_b - mlp_dgrad - mlp_dw

    def phase(comm: float, comp: float) -> float:
        return max(comm, comp) + sm_share * min(comm, comp)

    dispatch_f = counts + copies
    comm_end = max(dispatch_f, mlp_dgrad) + copies
    comp_end = max(mlp_dgrad + mlp_dw, dispatch_f) + mlp_f
    middle = max(comm_end, comp_end) + sm_share * min(dispatch_f + copies, mlp_dgrad + mlp_dw + mlp_f)
    pair = phase(copies, attn_f) + middle + phase(copies, attn_b)
    return max(0.0, pair - (block_f + block_b))


def merged_share(plan: Plan) -> float:
    """Of a rank's forward and backward passes of model chunks in a step, the share Megatron-Core's combined 1F1B
    runs merged: all but the warm-up forwards before the first backward (and as many backwards at the end), on the
    first pipeline rank, which waits longest: (pp - 1) x 2 + (vp - 1) x pp + 1 of M x vp chunk passes under the
    interleaved schedule (schedules.py's warm-up count, one more forward under the overlap), and without a pipeline
    the first micro-batch's forward of M (forward_backward_no_pipelining merges each forward with the previous
    backward). Megatron runs the overlap under no other pipeline schedule (plan.ep_overlap_error)."""
    m, pp, vp = plan.grad_accum, plan.pp, plan.virtual_stages
    if pp == 1:
        warm, passes = 1, m
    else:
        warm, passes = (pp - 1) * 2 + (vp - 1) * pp + 1, m * vp
    return max(0.0, 1 - warm / passes)


def _cp_exposed(args: ModelArgs, training: Training, plan: Plan, cluster: Cluster, layers: int,
                attention: float, attention_bwd: float) -> float:
    """Context parallelism's K/V traffic on the critical path, by Training.cp_exchange. 'allgather' (this engine's):
    the K and V of every rank all-gathered before the attention (again in a recomputed forward) and their gradients
    reduce-scattered after, none of it hidden. Ring attention passes each rank's K and V round the cp ring (cp - 1
    hops) in forward, and K, V, dK, dV in backward; each hop overlaps with the attention compute of the block it
    serves. torch's context_parallel
    (Training.cp_exchange 'torch') all-gathers K and V in forward, in a recomputed forward and in backward, and
    hands dK and dV (fp32) on at each of its cp steps; compiled blocks wait on each collective where it is issued,
    so all of it is exposed. Eager ones wait at first use: the gather behind the first step's attention (the
    rank's own diagonal block, 1/cp of its attention), each step's dK and dV behind the next step's. Transformer
    Engine's all-to-all (Training.cp_exchange 'a2a') moves Q, K and V to head shards before the attention and its
    output back after (four all-to-alls a forward, the recomputed one's too: full recompute, or Megatron-Core's
    selective one, which checkpoints TE's attention whole), and in backward the saved output and dO to head shards
    again and dQ, dK and dV back (five: AttnFuncWithCPAndQKVOA2A.backward from TE 1.11 to 2.7; 2.8 saves the output
    in head shards and sends dO alone), none of it hidden: the attention waits for its inputs, the next layer for its
    output."""
    if plan.cp == 1:
        return 0.0
    n, link = axis_link(plan, ("cp",), cluster)
    w = cluster.accelerator.comm_overlap
    kv = cp_kv_elements(args, training, plan)
    passes = 2 if plan.activation_checkpoint == "full" else 1  # the forward, and a recomputed one
    if training.cp_exchange == "allgather":  # each blocking the compute stream
        gathered = n * kv * training.act_bytes
        return layers * (passes * all_gather(gathered, n, link) + reduce_scatter(gathered, n, link))
    if training.cp_exchange == "torch":
        gather = all_gather(n * kv * training.act_bytes, n, link)
        grads = n * p2p(kv * 4, link)
        if training.compile:
            return layers * (passes * gather + gather + grads)
        step, step_bwd = attention / n, attention_bwd / n
        return layers * (passes * exposed_part(gather, step, w) + exposed_part(gather, step_bwd, w)
                         + n * exposed_part(grads / n, step_bwd, w))
    if training.cp_exchange == "a2a":  # Q, K, V to head shards, the output back; backward: O and dO, dQ, dK, dV
        q = all_to_all(plan.micro_batch * training.seq_len / plan.cp * args.n_heads / plan.tp * args.head_dim
                       * training.act_bytes, n, link)
        k = all_to_all(kv / 2 * training.act_bytes, n, link)
        # Megatron-Core's selective recompute checkpoints TE's attention whole, its exchanges with it
        core = plan.activation_checkpoint == "selective" and training.selective == "attention-core"
        return layers * ((passes + core) * (2 * q + 2 * k) + 3 * q + 2 * k)
    fwd = (n - 1) * p2p(kv * training.act_bytes, link)
    bwd = (n - 1) * p2p(2 * kv * training.act_bytes, link)
    return layers * (passes * exposed_part(fwd, attention, w) + exposed_part(bwd, attention_bwd, w))


def cp_kv_elements(args: ModelArgs, training: Training, plan: Plan) -> float:
    """Elements of K and V one cp rank holds for one block and micro-batch (its tp slice of the heads): the KV
    heads, or every query head's where the model repeats them first (Training.cp_repeats_kv)."""
    heads = args.n_heads / plan.tp if training.cp_repeats_kv else args.n_kv_heads / kv_split(args, plan.tp)
    return plan.micro_batch * training.seq_len / plan.cp * 2 * heads * args.head_dim


def exposed_part(comm: float, compute: float, overlap: float) -> float:
    """Seconds of `comm` left on the critical path when it runs alongside `compute`: all of it beyond the
    compute, and the share (1 - overlap) of the rest that the hardware cannot run concurrently
    (Accelerator.comm_overlap)."""
    return comm - overlap * min(comm, compute)


def _pp_p2p(args: ModelArgs, training: Training, plan: Plan, cluster: Cluster, stage: int) -> float:
    """Each micro-batch crosses the rank's boundaries once forward (activations) and once backward (their
    gradient), v times with interleaving; under sequence parallelism only the rank's sequence shard travels, and
    so it does in Megatron's layout (its scatter/gather optimisation). Megatron-Core's interleaved schedule with
    Training.pp_overlap_p2p waits on a steady-state chunk's sends and receives only after the next chunk's compute
    (megatron/core/pipeline_parallel/schedules.py, forward_backward_pipelining_with_interleaving): what stays on
    the critical path is the warm-up's forwards and the cool-down's backwards, which send and receive blocking,
    (p - 1 - r) 2 + (v - 1) p chunks each on pipeline rank r of the m v (pp_overlap_share)."""
    if plan.pp == 1:
        return 0.0
    return _pp_p2p_bytes_time(args, training, plan, cluster) * pp_overlap_share(training, plan, stage)


def pp_overlap_share(training: Training, plan: Plan, stage: int) -> float:
    """The share of a pipeline rank's sends and receives on its critical path: 1, or under Megatron-Core's
    overlapped interleaved schedule (Training.pp_overlap_p2p) its warm-up (and as many cool-down) chunks of the m v,
    as the schedule counts them (num_warmup_microbatches: (p - r - 1) 2 + (v - 1) p, its micro-batch group per
    virtual stage being p by default; at most m v)."""
    if not (training.pp_overlap_p2p and plan.pp_schedule == "interleaved-1f1b" and plan.virtual_stages > 1):
        return 1.0
    chunks = plan.grad_accum * plan.virtual_stages
    warmup = (plan.pp - stage - 1) * 2 + (plan.virtual_stages - 1) * plan.pp
    return min(chunks, warmup) / chunks


def _pp_p2p_bytes_time(args: ModelArgs, training: Training, plan: Plan, cluster: Cluster) -> float:
    _, link = axis_link(plan, ("pp",), cluster)
    x = plan.micro_batch * training.seq_len / plan.cp * args.dim * training.stream_bytes  # the residual stream
    if plan.sequence_parallel:
        x /= plan.tp
    elif training.layout == "megatron" and plan.tp > 1:
        # Megatron's scatter/gather (Narayanan et al. 2021, section 4.1): each tp rank sends only its 1/t of the
        # replicated activations across the (inter-node) pp link; the receiving stage all-gathers them over tp
        n, tp_link = axis_link(plan, ("tp",), cluster)
        return 2 * plan.virtual_stages * (p2p(x / plan.tp, link) + all_gather(x, n, tp_link))
    return 2 * plan.virtual_stages * p2p(x, link)


# ---------------------------------------------------------------------------------------------------
# Pipeline schedule


def pipeline_time(cost: StageCost, plan: Plan) -> float:
    """Wall-clock of the M micro-batches on the heaviest rank, bubble included.

    1F1B and GPipe: (M + P - 1) slots of t_mb, bubble (P-1)/(M+P-1) (GPipe, Huang et al. 2019; 1F1B has the
    same bubble, Narayanan et al. 2021). Interleaved with v chunks: the fill and drain slots shrink to chunk size,
    (P-1) t_mb / v, so bubble = (P-1)/(vM + P - 1).
    Zero-bubble ZB-H1 (Qi et al. 2024): the deferred weight-gradient passes fill the drain, leaving
    (P-1)(t_F + t_B - t_W).
    """
    m, p, v = plan.grad_accum, plan.pp, plan.virtual_stages
    t = cost.total
    if p == 1:
        return m * t
    if plan.pp_schedule == "interleaved-1f1b":
        return (m + (p - 1) / v) * t
    if plan.pp_schedule == "zero-bubble":
        tp = cost.tp_comm - cost.tp_comm_weight
        fwd = cost.forward + tp / 2 + cost.pp_p2p / 2 + cost.cp_exposed / 2 + cost.ep_comm / 2
        bwd_in = (cost.backward_input + cost.recompute + tp / 2 + cost.pp_p2p / 2 + cost.cp_exposed / 2
                  + cost.ep_comm / 2)
        return m * t + (p - 1) * max(0.0, fwd + bwd_in - cost.backward_weight - cost.tp_comm_weight)
    return (m + p - 1) * t


def bubble_fraction(plan: Plan, cost: StageCost | None = None) -> float:
    if plan.pp == 1:
        return 0.0
    if cost is None:  # equal forward/backward split is enough for the closed forms
        cost = StageCost(1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0)
    total = pipeline_time(cost, plan)
    return (total - plan.grad_accum * cost.total) / total


# ---------------------------------------------------------------------------------------------------
# Data-parallel communication, optimizer, offload


def dp_comm(args: ModelArgs, training: Training, plan: Plan, cluster: Cluster, cost: StageCost
            ) -> tuple[float, float]:
    """(total, exposed) seconds per step of gradient reduction and ZeRO parameter gathering. Under expert
    parallelism each MoE block's routed experts are an FSDP unit of their own over the expert shard group
    (comm.expert_links), their gradients all-reduced across dp_replicate (HSDP) as the rest; under Megatron-Core's
    (ZeRO-0/1 over the data-parallel ranks) each MoE block's experts are reduced (and at ZeRO-1 gathered) over
    their expert-data-parallel group, the rest over all the data-parallel ranks."""
    red_n, red_link = axis_link(plan, ("dp_replicate", "dp_shard", "cp"), cluster, spread=True)
    sh_n, sh_link = axis_link(plan, plan.shard_axes, cluster, spread=True)
    rep_n, rep_link = axis_link(plan, ("dp_replicate",), cluster, spread=True) if plan.zero_stage >= 2 else (1, None)
    (_, _), (ex_n, ex_link) = expert_links(plan, cluster)
    if red_n == 1 and (plan.ep == 1 or ex_n == 1):  # (Megatron-Core's experts fold over tp: their group may not be 1)
        return 0.0, 0.0
    b = state_bytes_per_param(training)
    where = placement(args, plan, training.seq_len, training.pipeline_split)
    # without expert parallelism the experts travel with their block (one unit)
    experts, moe_layers = (where.max_experts, where.max_moe_layers) if plan.ep > 1 else (0.0, 0)
    n_params = _max_stage_params(args, training, plan) - experts
    layers = where.max_layers
    trainable = layers * lora_params(args, training, plan.tp) if training.lora_rank else n_params
    reduced = reduce_grad_bytes(training)  # per parameter, as the reduction moves it (Training.reduce_dtype)
    grads = trainable * reduced
    # weights travel as FSDP holds them (memory.gathered_weight_bytes): fp32 in shardwise's engine, bf16 in the
    # ZeRO paper's and Megatron's layouts; LoRA's frozen weights as the engine stores them (gathered_unit_bytes)
    gathered = _gathered_bytes(args, training, plan, n_params, where.max_blocks - experts)
    m, z, w = plan.grad_accum, plan.zero_stage, cluster.accelerator.comm_overlap
    bwd = cost.backward_input + cost.backward_weight + cost.recompute

    # shardwise's engine (layout torch) moves data-parallel traffic unit by unit: FSDP2 one collective per block
    # and one for the root (embedding, final norm, head); replicate one per bucket of whole blocks (up to
    # ddp_bucket_mb) and one for the root. Small messages reach less bandwidth (the measured curves), and each
    # pays the latency. The other layouts' buckets are taken as one message.
    # (n_params is the rank with the most parameters, layers the one with the most blocks: clamp)
    block_params_ = where.max_blocks - experts
    in_blocks = min(1.0, block_params_ / n_params) if not training.lora_rank else 1.0

    def by_unit(op, nbytes: float, n: int, link, per_bucket: int = 1) -> float:
        if not training.fsdp2 or n == 1:
            return op(nbytes, n, link)
        block, root = nbytes * in_blocks / layers, nbytes * (1 - in_blocks)
        full, rest = divmod(layers, per_bucket)
        return (full * op(per_bucket * block, n, link) + (op(rest * block, n, link) if rest else 0.0)
                + (op(root, n, link) if root > 0 else 0.0))


    def expert_units(op, bytes_per_param: float, n: int, link) -> float:
        # one collective per MoE block's experts (their FSDP unit)
        return moe_layers * op(experts / moe_layers * bytes_per_param, n, link) if experts else 0.0

    # NCCL's kernels hold their SMs while they run: compute hidden behind a collective runs on the rest, so of a
    # link's hidden time the share its CTAs hold stays on the critical path (Link.sm_share; 0 unless modelled)
    w_red, w_sh = w * (1 - red_link.sm_share), w * (1 - sh_link.sm_share)

    def behind_backward(comm: float, overlap: float = w_sh) -> float:
        # gradients are reduced bucket by bucket as backward produces them: the last bucket (one block's share)
        # has no backward left to hide behind; or none of it hides (Training.grad_reduce_hidden: reduced after the
        # backward, or on its stream)
        if not training.grad_reduce_hidden:
            return comm
        return comm - overlap * min(comm * (1 - 1 / layers), bwd)

    if z == 0 or z == 1 and replicates(training, plan):
        # ZeRO-0, and ZeRO-1 as shardwise's engine runs it: replicate's bucketed all-reduce, then the sharded
        # optimizer all-gathers the updated fp32 slices before the next forward, one collective per parameter
        # tensor (each pays the latency; the tensors outside the blocks are taken as one)
        comm = by_unit(all_reduce, grads, red_n, red_link, per_bucket=blocks_per_bucket(args, training))
        # the routed experts' gradients over the ranks holding the same experts (Megatron-Core's expert parallelism
        # at ZeRO-0: its expert-data-parallel group)
        comm += expert_units(all_reduce, reduced, ex_n, ex_link)
        ag = 0.0
        if z == 1:
            # back to back after the optimizer step: only the first comes from compute (pays the link's sync)
            def gathers(moe: bool) -> float:
                return sum(all_gather(n * 4.0, sh_n, sh_link, after_compute=False)
                           for n in block_tensor_params(args, plan.tp, moe, plan.ep))

            if training.lora_rank:
                # an A and a B adapter on each of the block's adapted linears (taken as equal)
                adapters = 2 * len(adapter_groups(args, training))
                blocks = layers * adapters * all_gather(lora_params(args, training, plan.tp) / adapters * 4.0,
                                                        sh_n, sh_link, after_compute=False)
            else:
                moe = where.max_moe_layers
                blocks = (layers - moe) * gathers(False) + (moe * gathers(True) if moe else 0.0)
            rest = trainable - (0.0 if training.lora_rank else block_params_)
            ag = blocks + (all_gather(rest * 4.0, sh_n, sh_link, after_compute=False) if rest > 0
                           else 0.0) + sh_link.sync
        return comm + ag, behind_backward(comm, w_red) + ag
    # HSDP's all-reduce of the reduced shards across the replicas. Under torch's FSDP (layouts torch and fsdp-mp)
    # each unit's follows its reduce-scatter on a stream of its own (FSDP1's _reduce_grad: _all_reduce_stream after
    # the post-backward stream; FSDP2's foreach_reduce: its all_reduce_stream), as often as the reduce-scatter, and
    # hides behind the rest of the backward with it (priced with it, one after the other: conservative where a
    # unit's all-reduce can run beside the next unit's reduce-scatter; until 2026-12-06 it was priced once a step,
    # exposed, as it still is for the other layouts: DeepSpeed's MiCS and Megatron-FSDP all-reduce across replicas
    # once a step, bucket by bucket in the last micro-batch's backward, mics.py's allreduce_mics_shard_grads; that
    # overlap is not priced)
    hsdp = by_unit(all_reduce, grads / sh_n, rep_n, rep_link) + expert_units(all_reduce, reduced / ex_n, rep_n,
                                                                              rep_link)
    hsdp_with_rs, hsdp = (hsdp, 0.0) if training.fsdp2 else (0.0, hsdp)
    rs = by_unit(reduce_scatter, grads, sh_n, sh_link) + expert_units(reduce_scatter, reduced, ex_n, ex_link)
    # How often gradients are reduced: shardwise's engine (layout torch) once per step, in the last micro-batch's
    # backward (FSDP2 without gradient sync keeps them unsharded until then, set_gradient_sync); so does Megatron,
    # which accumulates them in its buffer. DeepSpeed (layout zero) reduce-scatters in every micro-batch's
    # backward at ZeRO-2 and 3, which keep only the shard.
    n_rs = m if training.reduces_every_micro_batch(plan.pp) and z >= 2 else 1
    if z == 1 or z == 2 and not training.fsdp2:
        # the updated weights are all-gathered after the step, before the next forward: exposed, or under
        # Megatron-Core's --overlap-param-gather bucket by bucket, each bucket's gather waited on by the forward
        # pre-hook of its first module, which then starts the next bucket's (finish_param_sync): one gather in
        # flight behind the forward, the first exposed. Buckets take the parameters in reverse (backward) order, so
        # the forward's first holds the input embedding and the end of the first block: taken as the embedding and
        # one block's weights (NeMo's buckets of 128M elements are 0.6 of a Llama 3 8B block). In a pipeline every
        # virtual stage is a bucket of its own, the first stage's gathered beside the optimizer step in NeMo's
        # recipes (overlap_param_gather_with_optimizer_step): one block's weights
        ag = all_gather(trainable * b.params, sh_n, sh_link) + expert_units(all_gather, b.params, ex_n, ex_link)
        first = ag / layers + (ag * args.vocab_size * args.dim / plan.tp / n_params if plan.pp == 1 else 0.0)
        hides = training.overlap_param_gather and z == 1  # the distributed optimizer's (Megatron-FSDP's not read)
        ag_exposed = ag - w_sh * min(ag - first, cost.forward) if hides else ag
        if z == 1 and training.zero1_all_reduce:
            # nanotron's ZeRO-1 (Training.zero1_all_reduce): the whole gradient buffer all-reduced once the
            # backward is done, then each rank steps its shard
            whole = all_reduce(grads, sh_n, sh_link) + expert_units(all_reduce, reduced, ex_n, ex_link)
            return whole + hsdp + ag, whole + hsdp + ag_exposed
        return (n_rs * (rs + hsdp_with_rs) + hsdp + ag,
                n_rs * behind_backward(rs + hsdp_with_rs) + hsdp + ag_exposed)
    if z == 3 and training.zero3_fetch == "module-sync":
        if where.max_moe_layers:
            raise PlannerError("--system zero3_fetch", "module-sync prices a dense block's four linear modules, and "
                               f"{args.name} has experts", "use zero3_fetch = prefetch for a mixture of experts")
        block_total, block_exposed = module_sync_zero3(args, training, plan, cost, layers, sh_n, sh_link)
        rest = max(0.0, n_params - block_params_)  # the embedding and head: gathered in forward and backward, exposed
        rest_comm = (2 * all_gather(rest * gathered_weight_bytes(training), sh_n, sh_link)
                     + reduce_scatter(rest * b.grads, sh_n, sh_link))
        return m * (block_total + rest_comm) + hsdp, m * (block_exposed + rest_comm) + hsdp
    # Weights gathered for every micro-batch: FSDP2 reshards after every backward, so ZeRO-2 gathers them again
    # for each forward (kept through backward); ZeRO-3 for forward and again for backward. Each block's gather is
    # prefetched behind the previous block's compute (the first block's has nothing before it). In a pipeline,
    # torch.distributed.pipelining keeps the stage gathered after every backward but the step's last
    # (reshard_after_backward False): ZeRO-2, which does not reshard after forward either, gathers once per step
    # (the simulator counts one all-gather per unit whatever the micro-batches); ZeRO-3 still reshards after
    # each forward.
    experts_ag = expert_units(all_gather, gathered_weight_bytes(training), ex_n, ex_link)
    ag = by_unit(all_gather, gathered, sh_n, sh_link) + experts_ag
    first = ag / layers
    fwd_exposed = ag - w_sh * min(ag - first, cost.forward)
    if z == 2:
        n_ag = 1 if plan.pp > 1 and training.fsdp2 else m
        return (n_ag * ag + n_rs * (rs + hsdp_with_rs) + hsdp,
                n_ag * fwd_exposed + n_rs * behind_backward(rs + hsdp_with_rs) + hsdp)
    # FSDP2's root (embedding, final norm, head) is not resharded after forward: backward gathers the blocks only
    if not training.fsdp2:
        ag_bwd = ag
    elif where.max_moe_layers:
        moe, per_param = where.max_moe_layers, gathered / n_params
        dense_block = layer_params(args, plan.tp)
        moe_block = block_params(args, plan.tp, True, plan.ep) - (expert_params(args, plan.ep) if experts else 0.0)
        ag_bwd = ((layers - moe) * all_gather(dense_block * per_param, sh_n, sh_link)
                  + moe * all_gather(moe_block * per_param, sh_n, sh_link) + experts_ag)
    else:
        ag_bwd = layers * all_gather(layer_params(args, plan.tp) * (gathered / n_params), sh_n, sh_link)

    def bwd_exposed(comm: float) -> float:
        return comm - w_sh * min(comm - first, bwd)

    # In a pipeline of FSDP2 stages the blocks stay gathered after each backward (torch.distributed.pipelining), so
    # the forward that follows finds them gathered and only reshards them: every unit is gathered for the step's
    # first forward and the blocks again for each micro-batch's backward, (M + 1) x the blocks in all (the simulator
    # counts that on the middle ranks, one block a micro-batch more on the last rank but one and less on the last)
    n_fwd = 1 if plan.pp > 1 and training.fsdp2 else m
    comm = n_fwd * ag + m * ag_bwd + n_rs * (rs + hsdp_with_rs) + hsdp
    exposed = (n_fwd * fwd_exposed + (m - n_rs) * bwd_exposed(ag_bwd) + n_rs * bwd_exposed(ag_bwd + rs + hsdp_with_rs)
               + hsdp)
    return comm, exposed


DS_MAX_REUSE_DISTANCE = 1e9
"""DeepSpeed's stage3_max_reuse_distance default, elements (deepspeed/runtime/zero/constants.py, v0.3.13): a
module's weights stay gathered when the parameters used before their next use number fewer."""


def module_sync_zero3(args: ModelArgs, training: Training, plan: Plan, cost: StageCost, layers: int, n: int,
                      link) -> tuple[float, float]:
    """(total, exposed) seconds of one micro-batch's weight gathers and gradient reduce-scatters over the blocks
    under DeepSpeed's first ZeRO-3 (Training.zero3_fetch 'module-sync'), read from v0.3.13's stage3.py:

    * `fetch_sub_module` waits for the module's weights and then `torch.cuda.synchronize()`s, and
      `prefetch_next_sub_modules` gathers the weights used next up to `stage3_prefetch_bucket_size` (5e7
      elements; every linear here is larger, so one module ahead) while the module computes: each module
      takes max(its compute, the next module's gather);
    * with full recompute the checkpointed forward runs the modules' hooks again and gathers again; in backward
      a weight is gathered a third time unless its reuse distance (2 x the parameters of the block's later
      modules: their recomputed forward and backward) is under `stage3_max_reuse_distance`;
    * in backward each module's gradient is reduce-scattered on the reduction stream while the next module
      computes, beside that module's prefetch, on the same link.

    Compute is shared among a block's modules by their parameters. Not modelled: `stage3_max_live_parameters`
    (1e9 elements by default), under which a larger module's prefetch waits (a 530B block's 1.3e9 and 1.7e9
    element linears), and the host's work in the hooks."""
    mods = block_modules(args, plan.tp)
    k, total = len(mods), sum(mods)
    share = [p / total for p in mods]
    g = [all_gather(p * gathered_weight_bytes(training), n, link) for p in mods]
    rs = [reduce_scatter(p * state_bytes_per_param(training).grads, n, link) for p in mods]
    fwd, rec, bwd = (x / layers for x in (cost.forward, cost.recompute,
                                          cost.backward_input + cost.backward_weight))
    full = plan.activation_checkpoint == "full"
    kept = [full and 2 * sum(mods[j + 1:]) < DS_MAX_REUSE_DISTANCE for j in range(k)]
    t = sum(max(fwd * share[j], g[(j + 1) % k]) for j in range(k))
    t += sum(max(rec * share[j], g[(j + 1) % k]) for j in range(k)) if full else rec
    for j in reversed(range(k)):
        # next: this block's previous module, or (j = 0) the block below's recomputed first module / last module
        nxt = j - 1 if j else (0 if full else k - 1)
        fetch = 0.0 if j and kept[nxt] else g[nxt]
        t += max(bwd * share[j], fetch + rs[(j + 1) % k])  # (j = k-1: the block above's first gradient)
    comm = sum(g) * (2 if full else 1) + sum(x for x, keep in zip(g, kept) if not keep) + sum(rs)
    return layers * comm, max(0.0, layers * t - (cost.forward + cost.recompute + cost.backward_input
                                                 + cost.backward_weight))


def step_scalars(plan: Plan, cluster: Cluster, args: ModelArgs | None = None, moe_layers: int = 0) -> float:
    """Seconds per step of the scalar all-reduces the training step waits on besides the model's traffic: the
    loss summed over the ranks that see different tokens (dp x cp) and, in a pipeline, over its stages; the
    gradient norm's partial sums over the ranks its gradients are split across (tensor parallel, the ZeRO-2/3
    shard group: a DTensor `full_tensor`; under expert parallelism the experts' own mesh, once more) and over the
    pipeline stages. A few bytes each: latency and the link's sync. A mixture of experts with auxiliary-loss-free
    balancing (`args.bias_update_rate`) also sums its per-expert counts over the dp x cp ranks (moe.end_of_step:
    fp32, n_experts for each of the rank's `moe_layers`)."""
    t = 0.0
    for axes, count in ((("dp_replicate", "dp_shard", "cp"), 1), (("pp",), 2), (("tp",), 1),
                        (plan.shard_axes, (1 + (plan.ep > 1)) if plan.zero_stage >= 2 else 0)):
        n, link = axis_link(plan, axes, cluster)
        t += count * all_reduce(4.0, n, link)
    if args is not None and args.bias_update_rate > 0 and moe_layers:
        n, link = axis_link(plan, ("dp_replicate", "dp_shard", "cp"), cluster)
        t += all_reduce(4.0 * args.n_experts * moe_layers, n, link)
    return t


def sharding_copies(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator) -> float:
    """Exposed seconds per step of the copies FSDP2 (and its `replicate`, shardwise's ZeRO-0/1) makes around its
    collectives. Each gradient reduction packs the rank's unsharded gradients into one flat buffer of the reduce
    dtype (`chunk_cat`: reads them as backward made them, writes them cast) and, under replicate, copies the
    reduced result out (under ZeRO-2/3 the shard is a view of it: cast or accumulated where that applies);
    each gathering of parameters packs the rank's shards (copy-in) and splits the gathered buffer into the
    unsharded parameters (copy-out). Each copy reads and writes its bytes once, at memory bandwidth. Two run on
    the compute stream, on the critical path: the gather's copy-out (in the unshard's wait) and the reduction's
    pack (torch's `foreach_reduce`, called from the post-backward hook, runs `foreach_reduce_scatter_copy_in`
    before the reduce-scatter stream waits on the current one: PR 129721, torch 2.5; before it the pack ran on
    the reduce-scatter stream and the compute stream waited on it at once). The others run on FSDP2's
    communication streams and hide behind compute as far as communication does (`comm_overlap`; on a CPU, not
    at all). Counts as in `dp_comm`: one reduction per step, or one per micro-batch where gradients are synced
    in each (Training.grad_sync); ZeRO-2 gathers every weight once per micro-batch, ZeRO-3 the blocks again in
    backward. Megatron's layout keeps gradients in one contiguous buffer: no copies. FSDP1's flat parameter
    (Training.flat_params) gathers into and reduces from its flat buffers in place, but every backward joins the
    weights' gradients into the flat gradient on the compute stream (they are views of it), and casts it to the
    reduce dtype where they differ. DeepSpeed with contiguous gradients (Training.reduce_bucket_size) copies each
    gradient into its reduction bucket as backward makes it (deepspeed_bucket_copies)."""
    if training.layout == "zero":
        return deepspeed_bucket_copies(args, training, plan, acc)
    if not training.fsdp2 or plan.dp * plan.cp == 1:
        return 0.0
    n_params = _max_stage_params(args, training, plan)
    where = placement(args, plan, training.seq_len, training.pipeline_split)
    layers = where.max_layers
    trainable = layers * lora_params(args, training, plan.tp) if training.lora_rank else n_params
    # bytes moved (read and written) per step: the pack (each gradient read as backward made it, written in the
    # reduce dtype) and what follows the reduction: under ZeRO-2/3 the sharded gradient is a view of the output,
    # cast to the weights' dtype or added into the gradient kept from the micro-batch before where that applies
    # (a shard, read and written: counted so, at most); under replicate (ZeRO-0/1) the whole reduced gradient is
    # copied out of the collective's buffer
    gb, rb = unsharded_grad_bytes(training), reduce_grad_bytes(training)
    reductions = plan.grad_accum if training.reduces_every_micro_batch(plan.pp) and plan.zero_stage >= 2 else 1
    packed = reductions * trainable * (gb + rb)
    copied_out = reductions * 2 * trainable * rb / (plan.shard_group if plan.zero_stage >= 2 else 1)
    if training.flat_params:
        # FSDP1: the weights are views of the flat parameter (torch.split), so each backward's autograd joins their
        # gradients into the flat gradient (SplitWithSizesBackward, a cat read and written in the gradient's dtype)
        # on the compute stream; the flat gradient is reduce-scattered as it lies, after a cast to the reduce dtype
        # where they differ (on FSDP1's post-backward stream), and each gather lands in the flat buffer (the shard
        # cast to the compute dtype before it, on the unshard stream: shard-sized, not counted)
        joined = plan.grad_accum * trainable * 2 * gb
        cast = reductions * trainable * (gb + rb) if gb != rb else 0.0
        return (joined + (1 - acc.comm_overlap) * cast) / (acc.mem_bandwidth * acc.bandwidth_efficiency)
    gathered = 0.0
    if plan.zero_stage >= 2:
        weights = _gathered_bytes(args, training, plan, n_params, where.max_blocks)
        blocks = where.max_blocks * gathered_unit_bytes(args, training, plan, 0)[0]
        # (in a pipeline ZeRO-2 gathers once per step, ZeRO-3 every unit once and the blocks per micro-batch: dp_comm)
        if plan.pp > 1:
            gathered = weights + (plan.grad_accum * blocks if plan.zero_stage == 3 else 0.0)
        else:
            gathered = plan.grad_accum * (weights + (blocks if plan.zero_stage == 3 else 0.0))
    if plan.ep > 1 and where.max_experts:  # the experts' shards are 1 / expert_shard_group of them
        share = where.max_experts / n_params
        copied_in = gathered * ((1 - share) / plan.shard_group + share / plan.expert_shard_group)
    else:
        copied_in = gathered / plan.shard_group
    # the gather's copy-out and the pack on the compute stream; the rest on the communication streams. A gather's
    # copies read and write its bytes
    exposed = 2 * gathered + packed + (1 - acc.comm_overlap) * (copied_out + 2 * copied_in)
    return exposed / (acc.mem_bandwidth * acc.bandwidth_efficiency)


def deepspeed_bucket_copies(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator) -> float:
    """Exposed seconds per step of DeepSpeed's contiguous gradients (Training.reduce_bucket_size): in every
    backward each gradient is copied into the reduction bucket by its hook (read and written in the gradients'
    dtype), except a tensor larger than the bucket, reduced where it lies. ZeRO-1/2 copy on the current (compute)
    stream (stage_1_and_2.py, reduce_independent_p_g_buckets_and_remove_grads); ZeRO-3 on its
    reduce_and_partition_stream (stage3.py, __add_grad_to_ipg_bucket), hidden as far as communication is."""
    if not training.reduce_bucket_size or plan.zero_stage == 0 or plan.dp * plan.cp == 1:
        return 0.0
    where = placement(args, plan, training.seq_len, training.pipeline_split)
    n_params = _max_stage_params(args, training, plan)
    blocks = where.max_layers * layer_params(args, plan.tp)  # every block tensor is smaller than a bucket here
    rest = n_params - blocks  # the embedding and the head: copied only where one fits a bucket
    copied = blocks + (rest if args.vocab_size * args.dim / plan.tp <= training.reduce_bucket_size else 0.0)
    moved = plan.grad_accum * copied * 2 * unsharded_grad_bytes(training)
    hidden = 1 - acc.comm_overlap if plan.zero_stage == 3 else 1.0
    return hidden * moved / (acc.mem_bandwidth * acc.bandwidth_efficiency)


def optimizer_time(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator) -> float:
    """The optimizer step is memory-bound: at least read weights, grads, master and states and write weights, master
    and states once (a fused kernel; the offloaded step). Shardwise's engine (layout torch, fp32 state) runs the
    gradient norm and clipping (foreach: a pass per operation) and torch's fused AdamW: the bytes its operators
    read and write per parameter are counted on the real step (opcount.optimizer_bytes_per_param)."""
    b = state_bytes_per_param(training)
    n_params = local_params(args, training, plan)
    if training.lora_rank:
        n_params = (placement(args, plan, training.seq_len, training.pipeline_split).max_layers
                    * lora_params(args, training, plan.tp))
        if plan.zero_stage >= 1:
            n_params /= plan.shard_group
    touched = 2 * b.params + b.grads + 2 * (b.master + b.optimizer)
    if training.optimizer_passes == "per-op":
        touched = per_op_optimizer_bytes(training)
    if plan.offload != "none":
        return n_params * touched / HOST_DRAM_BW_PER_GPU
    c = op_counts(args)
    if training.layout == "torch" and training.optimizer == "adamw":
        touched = max(touched, c.optimizer_bytes_per_param)
    memory = n_params * touched / (acc.mem_bandwidth * acc.bandwidth_efficiency)
    # fixed cost per operator of the step (gradient norm, AdamW, zero_grad) over the rank's tensors
    where = placement(args, plan, training.seq_len, training.pipeline_split)
    tensors = where.max_layers * c.tensors_per_block + c.tensors_rest + where.max_moe_layers * (
        c.tensors_per_moe_block - c.tensors_per_block)
    if training.lora_rank:  # only the adapters are in the optimizer: A and B of each adapted linear
        tensors = where.max_layers * 2 * len(adapter_groups(args, training))
    per_op = acc.optimizer_op_overhead_s
    if training.fsdp2 and plan.tp * plan.dp * plan.cp > 1:
        per_op += acc.dtensor_optimizer_op_overhead_s  # the engine's parameters are DTensors (see Accelerator)
    fixed = optimizer_ops(c, tensors, looped=not acc.launch_async) * per_op
    return max(memory, fixed) if acc.launch_async else memory + fixed


def per_op_optimizer_bytes(training: Training) -> float:
    """Bytes per parameter one optimizer step reads and writes when each operation is its own pass over the
    tensors (Training.optimizer_passes 'per-op'), counted on Composer's decoupled optimizers (composer/optim/
    decoupled_weight_decay.py, v0.14 to 0.17) with o a moment's bytes, g the gradient's, p the weight's:
    AdamW's exp_avg.mul_.add_ (2o, 2o + g), exp_avg_sq.mul_.addcmul_ (2o, 2o + 2g: the gradient read twice),
    denom = sqrt / c .add_ eps (three passes of 2o, the first writing a new tensor) and param.addcdiv_ (2p + 2o):
    16o + 3g + 2p; SGDW with momentum buf.mul_.add_ (2o, 2o + g) and param.add_ (2p + o): 5o + g + 2p; plain SGDW
    param.add_ (2p + g). Before it FSDP1's clip_grad_norm_ reads every gradient for the norm and scales it in place
    (g + 2g). Weight decay (param.mul_, 2p) is left out: llm-foundry's pretraining yamls set it to 0. torch's
    foreach AdamW with weight decay (torchtitan's before February 2025) moves as much in fp32, the layout's dtype:
    lerp_ (2o + g), mul_ and addcmul_ (2o, 2o + 2g), sqrt, div_ and add_ (2o each), addcdiv_ (2p + 2o) and the
    decay's mul_ (2p), 14o + 3g + 4p, after its foreach clipping's norm and scaling (3g): equal to Composer's
    16o + 3g + 2p only because o = p under fsdp-mp (fp32 moments and shards), which is the one layout per-op takes."""
    b = state_bytes_per_param(training)
    # layout fsdp-mp: the step updates FSDP's fp32 shards in place, which are the master (no separate copy)
    o, g, p = b.optimizer / max(1, PER_OP_MOMENTS[training.optimizer]), b.grads, b.params
    step = {"adamw": 16 * o + 3 * g + 2 * p, "momentum": 5 * o + g + 2 * p, "sgd": g + 2 * p}[training.optimizer]
    return step + 3 * g


def offload_time(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator, cost: StageCost) -> float:
    """Exposed host<->device traffic. 'optimizer': gradients down, updated weights up, once per step.
    'full' (FSDP2's CPUOffloadPolicy): the reduced gradients down once per step, and the weights' shards up for
    each all-gather, overlapped with the micro-batch's compute: forward's, and backward's under ZeRO-3 (ZeRO-2
    keeps the gathered weights from forward to backward). FSDP2 copies a shard as it is stored and casts it to its
    param_dtype on the device: fp32 under autocast and under FSDP2's policy alike; a LoRA model's frozen weights,
    most of its bytes, in the compute dtype, QLoRA's in NF4 (memory.offloaded_shards). Under LoRA only the
    adapters have gradients to copy back."""
    if plan.offload == "none":
        return 0.0
    if plan.offload == "optimizer":
        b = state_bytes_per_param(training)
        compute_bytes = 2.0 if training.mixed else 4.0
        return local_params(args, training, plan) * (b.grads + compute_bytes) / acc.host_bw
    params, grads = offloaded_shards(args, training, plan)
    per_mb = (2 if plan.zero_stage == 3 else 1) * params / acc.host_bw
    return grads / acc.host_bw + plan.grad_accum * exposed_part(per_mb, cost.compute, acc.comm_overlap)


def activation_offload_time(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator,
                            cost: StageCost) -> float:
    """Exposed seconds of activation offloading (Training.activation_offload, full recompute): each micro-batch's
    checkpointed block inputs copied to the host in forward and back in backward, on a side stream behind the
    micro-batch's compute as far as the device overlaps copies with kernels (comm_overlap)."""
    if not (training.activation_offload and plan.activation_checkpoint == "full"):
        return 0.0
    layers = placement(args, plan, training.seq_len, training.pipeline_split).max_layers
    per_mb = 2 * layers * layer_activation_bytes(args, training, plan) / acc.host_bw
    return plan.grad_accum * exposed_part(per_mb, cost.compute, acc.comm_overlap)


def layer_offload_time(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator, cost: StageCost) -> float:
    """Exposed seconds of Megatron-Core's CPU offloading (Training.offload_layers, no recompute): each micro-batch's
    offloaded blocks' saved activations copied to the host behind its forward and back behind its backward, on a
    side stream, as far as the device overlaps copies with kernels (comm_overlap). Transformer Engine's synchroniser
    lets block i's copy run until block L - k + i's forward: the k copies, one after another, fit the forward's
    time or hold it up by what they exceed it by (and the reloads the backward's)."""
    if not (training.offload_layers and plan.activation_checkpoint == "none"):
        return 0.0
    layers = placement(args, plan, training.seq_len, training.pipeline_split).max_layers
    copies = min(training.offload_layers, layers) * layer_activation_bytes(args, training, plan) / acc.host_bw
    backward = cost.backward_input + cost.backward_weight
    return plan.grad_accum * (exposed_part(copies, cost.forward, acc.comm_overlap)
                              + exposed_part(copies, backward, acc.comm_overlap))


def dp_unit_overhead(args: ModelArgs, training: Training, plan: Plan, acc: Accelerator) -> float:
    """Host seconds per micro-batch of the engine's data-parallel wrappers on a rank (layout torch): a unit per
    block and the root under fully_shard (ZeRO-2/3), per bucket of blocks (as `data_parallel._buckets` groups
    them, by fp32 parameter bytes) and the root under replicate (ZeRO-0/1), each at the profile's measured cost.
    Where launches are asynchronous the host runs ahead of the device: 0."""
    if not training.fsdp2 or acc.launch_async:
        return 0.0
    layers = placement(args, plan, training.seq_len, training.pipeline_split).max_layers
    if plan.zero_stage >= 2:
        if plan.shard_group == 1:
            return 0.0
        per_unit = acc.zero3_unit_overhead_s if plan.zero_stage == 3 else acc.zero2_unit_overhead_s
        # under expert parallelism each MoE block's experts are a unit of their own
        experts = placement(args, plan, training.seq_len, training.pipeline_split).max_moe_layers if plan.ep > 1 else 0
        return (layers + 1 + experts) * per_unit
    if plan.dp * plan.cp == 1:
        return 0.0
    return (math.ceil(layers / blocks_per_bucket(args, training)) + 1) * acc.replicate_unit_overhead_s


def blocks_per_bucket(args: ModelArgs, training: Training) -> int:
    """Blocks in one of replicate's buckets, as `data_parallel._buckets` groups them: until the group's parameter
    bytes reach ddp_bucket_mb, counting every parameter (frozen ones too) at its global size (a DTensor's numel)
    in fp32, as the engine holds them. A mixture of experts' blocks differ: their mean size is taken."""
    block = layer_params(args, 1)
    if args.n_moe_layers:
        block = (args.n_moe_layers * block_params(args, 1, True) + (args.n_layers - args.n_moe_layers) * block) / (
            args.n_layers)
    return max(1, math.ceil(training.ddp_bucket_mb * 2**20 / (4 * block)))


def local_params(args: ModelArgs, training: Training, plan: Plan) -> float:
    """Parameters whose state the rank holding the most keeps after sharding: from ZeRO-1 on, 1 / shard_group of
    them, and of the routed experts 1 / expert_shard_group."""
    n_params = _max_stage_params(args, training, plan)
    if plan.zero_stage < 1:
        return n_params
    experts = placement(args, plan, training.seq_len, training.pipeline_split).max_experts
    if not experts:
        return n_params / plan.shard_group
    return (n_params - experts) / plan.shard_group + experts / plan.expert_shard_group


# ---------------------------------------------------------------------------------------------------
# Summary


@functools.lru_cache(maxsize=1024)
def _flops_per_token(args: ModelArgs, training: Training) -> float:
    adapters = adapter_params(args, training.lora_rank, training.lora_targets) if training.lora_rank else None
    return flops_per_token(args, training.seq_len, adapters)


@dataclass(frozen=True)
class StepTime:
    step_time_s: float
    compute_s: float
    recompute_s: float
    bubble_s: float
    bubble_fraction: float
    exposed_comm_s: float
    comm_total_s: float
    optimizer_s: float
    offload_s: float
    tokens_per_s: float
    mfu: float
    detail: dict


def step_time(args: ModelArgs, training: Training, plan: Plan, cluster: Cluster) -> StepTime:
    training = recipe_for(training, plan)
    acc = cluster.accelerator
    cost = stage_cost(args, training, plan, cluster)
    pipe = pipeline_time(cost, plan)
    m = plan.grad_accum
    bubble = pipe - m * cost.total
    dp_total, dp_exposed = dp_comm(args, training, plan, cluster, cost)
    opt = optimizer_time(args, training, plan, acc)
    off = (offload_time(args, training, plan, acc, cost) + activation_offload_time(args, training, plan, acc, cost)
           + layer_offload_time(args, training, plan, acc, cost))
    copies = sharding_copies(args, training, plan, acc)
    where = placement(args, plan, training.seq_len, training.pipeline_split)
    scalars = step_scalars(plan, cluster, args, where.max_moe_layers)
    hooks = m * dp_unit_overhead(args, training, plan, acc)
    total = pipe + dp_exposed + copies + opt + off + scalars + hooks
    tokens = training.global_batch * training.seq_len
    tps = tokens / total
    mfu = _flops_per_token(args, training) * tps / (plan.world * acc.peak(training.compute_dtype))
    exposed = m * (cost.tp_comm + cost.cp_exposed + cost.pp_p2p + cost.ep_comm) + dp_exposed + off + scalars
    return StepTime(
        step_time_s=total, compute_s=m * cost.compute, recompute_s=m * cost.recompute, bubble_s=bubble,
        bubble_fraction=bubble / pipe if pipe else 0.0, exposed_comm_s=exposed,
        comm_total_s=m * (cost.tp_comm + cost.pp_p2p + cost.ep_comm) + dp_total + scalars, optimizer_s=opt,
        offload_s=off,
        tokens_per_s=tps, mfu=mfu,
        detail={"tp_comm_s": m * cost.tp_comm, "cp_exposed_s": m * cost.cp_exposed, "pp_p2p_s": m * cost.pp_p2p,
                "ep_comm_s": m * cost.ep_comm,
                "dp_comm_s": dp_total, "dp_exposed_s": dp_exposed,
                "per_microbatch_s": cost.total, "op_overhead_s": m * cost.op_overhead,
                "sharding_copies_s": copies, "step_scalars_s": scalars, "dp_unit_overhead_s": hooks},
    )
