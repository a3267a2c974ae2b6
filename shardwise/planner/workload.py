"""What is being trained: the model shape and the training recipe the planner sizes.

A model comes from a preset name, a ModelArgs, a shardwise TOML config (its [model] table) or a Hugging Face
`config.json` (Llama-family keys). The recipe (`Training`) fixes everything that changes bytes per parameter or
per activation but is not a parallel degree: precision, optimizer, state layout, LoRA/QLoRA, offload.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from shardwise.config import NF4_BLOCK_SIZE, NF4_SCALER_BLOCK_SIZE
from shardwise.frozen import hashed_once
from shardwise.hardware import PlannerError
from shardwise.layout import Schedule, fsdp_shards
from shardwise.model_args import PRESETS, PROJECTIONS, ModelArgs, args_from_hf_config

Precision = Literal["fp32", "bf16", "fp16", "fp8"]
Optimizer = Literal["adamw", "sgd", "momentum", "adamw8bit", "adamw4bit", "adafactor"]
Layout = Literal["torch", "fsdp-mp", "zero", "megatron"]
LAYOUTS: tuple[str, ...] = ("torch", "fsdp-mp", "zero", "megatron")
Selective = Literal["matmuls", "alternate-matmuls", "attention-core", "none"]
SELECTIVE: tuple[str, ...] = ("matmuls", "alternate-matmuls", "attention-core", "none")
PARTIAL_CHECKPOINTS: tuple[str, ...] = ("first", "last", "none")
"""Training.partial_checkpoint's values."""
ATTENTION_KERNELS: tuple[str, ...] = ("flash1", "flash2", "flash3", "cudnn")
CpExchange = Literal["allgather", "ring", "torch", "a2a"]
CP_EXCHANGES: tuple[str, ...] = ("allgather", "ring", "torch", "a2a")
Zero3Fetch = Literal["prefetch", "module-sync"]
ZERO3_FETCH: tuple[str, ...] = ("prefetch", "module-sync")
PipelineSplit = Literal["cost", "slots", "nanotron"]
PIPELINE_SPLITS: tuple[str, ...] = ("cost", "slots", "nanotron")
PP_SCHEDULES: tuple[str, ...] = get_args(Schedule)
"""Every pipeline schedule shardwise's engine runs."""
Float8Recipe = Literal["torchao", "te-delayed", "te-current"]
FLOAT8_RECIPES: tuple[str, ...] = ("torchao", "te-delayed", "te-current")

# Bytes per parameter of optimizer state beyond the master weights, as the engine's optimizers keep it:
# - torch's AdamW two fp32 moments (exp_avg, exp_avg_sq), momentum SGD one velocity (momentum_buffer), SGD nothing;
# - torchao's AdamW8bit both moments as uint8 codes plus an fp32 scale per block of 256 (2 x (1 + 4/256) = 2.03125),
#   AdamW4bit both as packed 4-bit codes plus an fp32 scale per block of 128 (2 x (0.5 + 4/128) = 1.0625), and
#   each moment of each tensor its own 256-entry (16-entry) fp32 code book. torchao quantises a tensor only when a
#   rank's piece of it has 4096 values or more and is a whole number of blocks (bitsandbytes' rule): other pieces,
#   and the embedding and head (shardwise.optim.FULL_PRECISION_STATE), keep fp32 moments. memory.low_bit_state
#   counts that tensor by tensor;
# - torch's Adafactor no first moment and a second moment factored into fp32 row and column means, 4(r + c) bytes
#   for an r x c matrix: 0.0078 B/param at 1024 x 1024, 0.002 at 4096 x 4096, counted as 0.
OPTIMIZER_STATE_BYTES = {"adamw": 8.0, "momentum": 4.0, "sgd": 0.0, "adamw8bit": 2.0 + 2 * 4 / 256,
                         "adamw4bit": 1.0 + 2 * 4 / 128, "adafactor": 0.0}
PARAM_DTYPE_STATE = ("adamw", "momentum", "sgd", "adafactor")
"""The optimizers whose state torch keeps in the parameter's dtype (OPTIMIZER_STATE_BYTES counts it for fp32
parameters: half as much for a bf16 model, Training.state_dtype); torchao's low-bit AdamWs quantise theirs."""
PER_OP_MOMENTS = {"adamw": 2, "momentum": 1, "sgd": 0}
"""The optimizers Training.optimizer_passes 'per-op' prices (Composer's DecoupledAdamW and DecoupledSGDW loops; torch's
foreach AdamW moves as much in fp32), and the moments each keeps."""
PER_OP_OPTIMIZERS = tuple(PER_OP_MOMENTS)
LOW_BIT_BLOCK = {"adamw8bit": 256, "adamw4bit": 128}
"""Values per fp32 scale of torchao's low-bit AdamWs (their default block sizes, which the engine keeps)."""
LOW_BIT_CODE_BOOK = {"adamw8bit": 256, "adamw4bit": 16}
"""fp32 entries of the code book each quantised moment keeps (torchao makes one per moment of every tensor)."""
LOW_BIT_MIN_VALUES = 4096
"""A rank's piece of a tensor with fewer values keeps fp32 moments under the low-bit AdamWs."""

# QLoRA stores the frozen base weights in 4-bit NormalFloat with double-quantised block constants (Dettmers et al.
# 2023, section 3), as torchao's NF4Tensor holds them for the engine's fp32 weights (shardwise/nf4.py): a 4-bit
# code per weight, an int8 absmax scaler per NF4_BLOCK_SIZE (64) weights, and an fp32 factor per
# NF4_SCALER_BLOCK_SIZE (256) scalers: 4.127 bits. Each tensor also keeps the scalers' fp32 mean and the 16-entry
# fp32 code table (68 bytes, on every rank), left out here.
QLORA_BITS = 4 + 8 / NF4_BLOCK_SIZE + 32 / (NF4_BLOCK_SIZE * NF4_SCALER_BLOCK_SIZE)


@hashed_once
@dataclass(frozen=True)
class Training:
    """The recipe: sequence and batch, numerics, optimizer, adapters and offload."""

    seq_len: int = 4096
    """Tokens per sequence."""
    global_batch: int = 512
    """Sequences per optimizer step, over all data-parallel ranks and accumulation steps."""
    precision: Precision = "bf16"
    """Matmul precision: fp32, or mixed bf16/fp16 with fp32 master state; fp8: the blocks' linears in float8 as
    the system's recipe runs them (`float8`: torchao's or Transformer Engine's; attention and the output head in
    bf16)."""
    optimizer: Optimizer = "adamw"
    """adamw (2 fp32 states), momentum (1), sgd (0), adamw8bit / adamw4bit (2 block-quantised states, torchao),
    adafactor (factored second moment only)."""
    layout: Layout = "torch"
    """How mixed precision stores model state: 'torch' fp32 weights+grads cast per use (autocast; shardwise's
    engine), 'fsdp-mp' fp32 weights+grads sharded by FSDP2 and gathered in the compute dtype (FSDP2's
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), torchtitan's default: the whole forward, residual
    stream included, runs in bf16), 'zero' bf16 weights+grads with an fp32 master in the optimizer (ZeRO paper),
    'megatron' bf16 weights, fp32 grads."""
    system: str = "shardwise"
    """The name of the system this recipe describes (planner.system): shown with every plan."""
    pp_schedules: tuple[str, ...] = PP_SCHEDULES
    """The pipeline schedules the system runs (shardwise.layout.Schedule's names); empty: it has no pipeline
    parallelism. A plan with another pp>1 schedule is one the system cannot run (plan.engine_error)."""
    pp_zero_max: int = 3
    """The highest ZeRO stage the system runs beside a pipeline (DeepSpeed's pipeline engine: 1)."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """The ZeRO stages the system runs (torchtitan: DDP or FSDP, no optimizer-only sharding: 0, 2, 3). ZeRO-0 over
    one rank (no data parallelism) is every system's."""
    ddp_alone: bool = False
    """ZeRO-0 over more than one rank (DDP) only as the layout's one parallelism: torchtitan's apply_ddp until
    March 2026 ('DDP has not supported > 1D parallelism'; its cp always ran under FSDP)."""
    zero3_grads_at_start: bool = False
    """DeepSpeed's ZeRO-3 (layout 'zero') allocates the rank's gradient partitions when it starts (stage3.py,
    grad_partitions_flat_buffer, since v0.6.0 of March 2022, PR 1453; v0.3.13's grads_in_partition was made in the
    first backward and freed after the step): resident at every moment, on the device unless offload_optimizer keeps
    them on the host."""
    fsdp_replicate: bool = True
    """ZeRO-0/1 over several ranks is FSDP2's replicate (shardwise's engine: replicate_with_fsdp), whose gradients
    FSDP2 reduces, and makes, in a stream of its own (memory.reserved_bytes), not torch's DDP or DDP-based replicate
    (autograd's gradients on the default stream)."""
    offload_stages: tuple[int, ...] = (2, 3)
    """The ZeRO stages at which the system offloads weights, gradients and optimizer state to the host (offload
    'full': FSDP's CPU offload at 2 or 3, DeepSpeed's offload_param at 3 only); empty: none (Megatron's host offload
    is the optimizer's alone)."""
    hsdp_stages: tuple[int, ...] = (2, 3)
    """The ZeRO stages the system runs as hybrid sharding: replicas (dp_replicate > 1) of a group sharded over
    dp_shard x cp > 1. Empty: none (torchtune's releases, DeepSpeed before MiCS)."""
    tensor_parallel: bool = True
    """The system splits attention heads and the MLP over tp ranks (Megatron's tensor parallelism)."""
    context_parallel: bool = True
    """The system splits the sequence over cp ranks for attention (ring or torch's context_parallel)."""
    expert_parallel: bool = True
    """The system splits a mixture of experts' experts over ep ranks."""
    moe_layer: Literal["engine", "megatron-core"] = "engine"
    """Whose mixture-of-experts layer. 'engine' (shardwise's, and torchtitan's as it): expert parallelism draws on
    the dp_shard x cp ranks of ZeRO-2/3, each expert's state sharded over the dp_shard x cp / ep ranks that hold
    it, and every tp rank runs the MoE whole on the whole sequence, saving what shardwise.moe saves.
    'megatron-core' (Megatron-Core's MoELayer with expert tensor parallelism 1, as NVIDIA's recipes set it): ep
    draws on the tp x cp x dp ranks at ZeRO-0/1 (its expert groups fold over tp), each expert replicated over the
    tp x cp x dp / ep ranks that hold it (its expert-data-parallel group: the distributed optimizer shards its state
    over them, its gradients are reduced over them), each tp rank routes its sequence-parallel shard of the tokens,
    and the layer saves what its grouped MLP and fused permutation save (memory.moe_terms)."""
    ep_overlap: bool = False
    """Megatron-Core's --overlap-moe-expert-parallel-comm (with --delay-wgrad-compute): its combined 1F1B schedule
    runs one micro-batch's forward and another's backward layer by layer on two streams, each all-to-all beside
    the other's compute (timing._ep_comm); moe_layer 'megatron-core' only."""
    fuse_head: bool | None = None
    """The output head and the cross-entropy run fused, a block of rows at a time, where the head is a plain
    linear (shardwise's engine: no TP, no pipeline); False: the logits are materialised and the loss saves fp32
    log-probabilities. None: fused exactly under the layout 'torch' (shardwise's engine)."""
    ce_kernel: bool = False
    """Where the logits are materialised (no fused head), the cross-entropy is one kernel over the compute-dtype
    logits (flash-attn's xentropy, as llm-foundry uses it): it keeps them and a log-sum-exp per row, and its
    backward writes one gradient in the compute dtype. False: torch's fp32 log_softmax + nll_loss (4 V bytes
    kept per token, two fp32 gradients in backward)."""
    loss_chunks: int = 1
    """Where the logits are materialised (no fused head), the loss runs over this many chunks of them, each its own
    autograd node (torchtune's CEWithChunkedOutputLoss: the model returns its logits in 8 chunks, and under compile
    each chunk's cross-entropy is its own compiled call). Its backward then makes one chunk's gradient at a time and
    frees that chunk's saved tensors when it is made, so the loss's working set is a chunk's (memory.logits_bytes).
    1: one node over all of them."""
    activation_offload: bool = False
    """Under full recompute, each checkpointed block's saved input goes to host memory as forward makes it and comes
    back before that block's backward (torchtune's enable_activation_offloading: OffloadActivations, saved-tensor
    hooks around the model's forward, copies on a side stream; torch's non-reentrant checkpoint saves a block's
    inputs through autograd, which those hooks see). Its forward stash keeps the last five offloaded tensors on the
    device (max_fwd_stash_size), counted as five blocks' inputs (memory.OFFLOAD_STASH); the copies run behind
    compute as far as the device overlaps them (timing.activation_offload_time)."""
    offload_layers: int = 0
    """Megatron-Core's CPU offloading of activations (cpu_offloading, cpu_offloading_num_layers): every tensor a
    stage's first `offload_layers` blocks save goes to host memory on a side stream after that block's forward and
    comes back during the backward, through Transformer Engine's get_cpu_offload_context, whose synchroniser of TE
    2.10 on (cpu_offload.py, DefaultOffloadSynchronizer: block i's copy must finish by block L - k + i's forward,
    its reload start at block L - 1 - k + i's backward) keeps the device's saved activations at (L - k) blocks'
    (memory.offload_kept_share; TE 2.9 and earlier keep one more). The copies run at the host link's bandwidth
    behind the forward and the backward (timing.layer_offload_time) and fill host memory (memory.host_bytes).
    Megatron-Core refuses it under pipeline parallelism and with recompute (transformer_config.py); 0: off. Layout
    'megatron' only."""
    optimizer_in_backward: bool = False
    """The optimizer steps each parameter in backward, as soon as autograd has accumulated its gradient, and frees
    that gradient (torchtune's optimizer_in_bwd: an optimizer per parameter, stepped from a post-accumulate-grad
    hook): no gradient set is held at the end of backward or at the step (memory._model_state). Needs one
    micro-batch a step (plan.engine_error); the step's time is the same, run inside backward."""
    grad_sync: Literal["step", "micro-batch"] = "step"
    """When sharded data parallelism (ZeRO-2/3) reduces gradients under accumulation: once per step, keeping them
    unsharded until the last micro-batch (shardwise's engine: FSDP2's set_requires_gradient_sync; Megatron's
    buffer), or in every micro-batch's backward, keeping only the shard (torchtitan, Composer's FSDP, DeepSpeed:
    layout 'zero' always does)."""
    zero3_fetch: Zero3Fetch = "prefetch"
    """How ZeRO-3 under the layout 'zero' fetches weights: 'prefetch', each unit's gather behind the previous unit's
    compute (FSDP; DeepSpeed since mid-2021), or 'module-sync', DeepSpeed's first ZeRO-3 (v0.3.13, March 2021,
    deepspeed/runtime/zero/stage3.py): weights gathered linear module by linear module, the next one prefetched
    while the current one computes and the device synchronised before each (so a module's compute overlaps one
    gather only), a recomputed forward gathering again, and backward re-gathering every weight whose reuse
    distance exceeds stage3_max_reuse_distance (timing.module_sync_zero3)."""
    swiglu: Literal["eager", "fused"] = "eager"
    """How a SwiGLU MLP keeps its tensors for backward: 'eager' (PyTorch operators: the w1 and w3 outputs, SiLU's
    output and the gate product) or 'fused' (one autograd function that saves its input, w1 and w3 outputs, and
    recomputes SiLU: Megatron-Core's SwiGLUFunction; w2 still keeps the product). memory.swiglu_saved."""
    fused_projections: bool = False
    """Q, K and V computed by one linear, and a SwiGLU's w1 and w3 by one (flash-attn's Wqkv; lit-gpt's attn and
    xformers' SwiGLU; Megatron-Core's linear_qkv and linear_fc1), each keeping its input once for backward. It
    matters under autocast over an fp32 residual stream (the layout 'torch'), where each linear casts and keeps its
    own bf16 copy of the norm's output: three and two for shardwise's and Hugging Face's separate projections, one
    each for fused ones (memory.input_copies), and under LoRA in the layout 'megatron', where one adapter adapts a
    fused linear (NeMo's LoraKQVAdapter on linear_qkv: memory.adapter_groups), one A, one dropout and their outputs
    for the group. Their GEMMs are priced as the ones they replace."""
    activation_fp8_input: bool = False
    """A fused SwiGLU keeps its input (the w1 and w3 outputs) in float8 for backward and casts it back there:
    Megatron-Core's activation_func_fp8_input_store (fusions/fused_bias_swiglu.py: input.to(float8_e4m3fn)), as
    NVIDIA's MLPerf v4.1 LoRA config for the H200 sets it (FP8_ACTIVATION). Layout 'megatron' with swiglu
    'fused' only; a mixture of experts' expert MLPs are not counted so (memory.block_terms)."""
    partial_checkpoint: str = "first"
    """Which blocks activation_checkpoint_every = k checkpoints: 'first' those whose model index is a multiple of
    k (shardwise's engine: blocks 0, k, 2k, ...), 'last' every k-th of the rank's blocks counted from 1 (blocks
    k-1, 2k-1, ... of its own: torchtitan's selective_ac_option "k" counts the blocks each process wraps, as IBM's
    fms-fsdp at 5e522b4 counts the model's), 'none' a system that checkpoints every block or none, as its presets
    describe it (k > 1 refused: plan.partial_checkpoint_error)."""
    selective: Selective = "matmuls"
    """What activation_checkpoint=selective keeps: 'matmuls' every matmul and attention output (shardwise's
    policy), 'alternate-matmuls' every second matmul output and the attention output (torchtitan's op-level
    policy), 'attention-core' everything but the attention core, which is recomputed (Korthikanti et al.;
    Megatron's selective recompute; always so with unfused attention), 'none' a system without op-level
    selective checkpointing (activation_checkpoint=selective refused: plan.engine_error)."""
    distribute_checkpoints: bool = False
    """Under full recompute without sequence parallelism, each block's saved input is split over the tp ranks and
    all-gathered again before the block is recomputed (Megatron-LM's --distribute-checkpointed-activations,
    before sequence parallelism; metaseq ran OPT-175B with it). memory.block_terms, timing._tp_comm."""
    pp_overlap_p2p: bool = False
    """Megatron-Core's interleaved schedule overlaps the steady state's pipeline sends and receives with the next
    chunk's compute (--overlap-p2p-communication: Megatron-LM's default under interleaving, NeMo's wherever virtual
    stages > 1); its warm-up and cool-down send and receive blocking (timing.pp_overlap_share)."""
    overlap_param_gather: bool = False
    """Under the layout 'megatron' with its distributed optimizer (zero_stage 1; Megatron-FSDP's ZeRO-2/3 keep their
    own pricing), the updated weights are all-gathered bucket by bucket behind the next step's forward
    (--overlap-param-gather: a forward pre-hook waits on a bucket's gather and starts the next one's,
    megatron/core/distributed/param_and_grad_buffer.py finish_param_sync), not all at once after the optimizer step.
    Off by default in Megatron-LM; the published Megatron-Core runs set it, and NeMo does wherever data parallelism
    is over 1 (and Apex's distributed Adam in NeMo 1, overlap_param_sync). timing.dp_comm."""
    overlap_grad_reduce: bool = True
    """The data-parallel reduction of gradients below ZeRO-3 issued bucket by bucket as backward produces them,
    behind the rest of the backward (torch's DDP and FSDP, Megatron-Core's --overlap-grad-reduce, Apex's distributed
    Adam with overlap_grad_sync); False (layouts 'megatron' and 'zero' only; ZeRO-3 reduces in its hooks either
    way): the whole reduction after the last backward, exposed, as Megatron-LM ran it before --overlap-grad-reduce
    (September 2023: train_step called allreduce_gradients, or the distributed optimizer's reduce_model_grads, after
    forward_backward_func), NeMo 1.7-1.9's Megatron GPT (async_grad_allreduce = False; from 1.10 it reduced during
    the backward but under a pipeline, and 1.11 under sequence parallelism too, where it also turned off Apex's
    overlap_grad_sync) and DeepSpeed's pipeline engine (its TrainSchedule's ReduceGrads after the last backward).
    DeepSpeed's ZeRO engine hides it only with overlap_comm (grad_reduce_hidden). timing.dp_comm."""
    grads_in_fp32: bool = True
    """Under the layout 'megatron', its main-gradient buffer (and the data-parallel reduction of it) in fp32:
    Megatron-LM's --accumulate-allreduce-grads-in-fp32, which it sets itself for bf16; False: in the weights'
    dtype, as NeMo 2's performance recipes run it (the precision plugin's grad_reduce_in_fp32=False overrides the
    DDP config, nemo/lightning/pytorch/plugins/mixed_precision.py). memory.state_bytes_per_param."""
    optimizer_dtype: Literal["fp32", "bf16"] = "fp32"
    """Under the layout 'megatron', the dtype of AdamW's state as Apex's DistributedFusedAdam keeps it (its `dtype`,
    NeMo 1's optim.dtype, which its Nemotron-4 340B configs set to bf16): 'bf16' keeps both moments in bf16 and,
    as NeMo sets store_params (megatron_base_model.py, v2.0.0rc0), no master copy in a bf16 run (the optimizer's
    dtype is the weights': the update goes to the bf16 weight shards) and a bf16 one where float8 weights need it
    (fp8_params: taken to go with --precision fp8, as NeMo's float8 recipes set it). Precision bf16 or fp8 only.
    memory.state_bytes_per_param."""
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Under the layout 'fsdp-mp' (FSDP with a mixed-precision policy), the dtype gradients are reduce-scattered
    (and, without sync, accumulated) in: fp32 as FSDP2's MixedPrecisionPolicy(reduce_dtype=float32) sets it
    (torchtitan's default; Composer's DEFAULT from 0.17) or bf16, the compute dtype, as FSDP1's MixedPrecision
    reduces where reduce_dtype is bf16 or None ("this takes on the param_dtype value": Composer's PURE, and its
    DEFAULT in 0.14-0.16, composer/trainer/mosaic_fsdp.py; fp16 for fairscale's FSDP of an fp16 model, as metaseq
    ran OPT). The sharded gradient the optimizer reads stays fp32. Under the layout 'torch' (fp32 weights under
    autocast) it describes FSDP's MixedPrecision(param_dtype=fp32, reduce_dtype=bf16): fp32 weights gathered, their
    fp32 gradients cast to bf16 for the reduction and kept fp32 between micro-batches (Lightning's FSDP under
    precision "bf16-mixed", lightning/fabric/plugins/precision/fsdp.py; not shardwise's engine, whose FSDP2 gets no
    policy under autocast). memory.reduce_grad_bytes, timing.dp_comm."""
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    """Under the layout 'fsdp-mp', the dtype the model itself is stored and trained in. 'fp32': fp32 weights (the
    optimizer's master), gathered and computed in the compute dtype, as every other layout keeps an fp32 copy.
    'bf16': the model built in bf16 and trained so, with no fp32 copy anywhere (torchtune's `dtype: bf16`, its
    models built under set_default_dtype; Lightning's "bf16-true"): weights, gradients and the optimizer's moments
    in bf16 (torch's optimizers keep their state in the parameter's dtype), 2 + 2 + 4 bytes a parameter under
    AdamW, no autocast, and FSDP2 (where it shards) gathering what it stores. Unsharded plans keep it too (it is
    the model, not FSDP's policy). Precision bf16 or fp8 (float8 linears on a bf16 model) only.
    memory.state_bytes_per_param."""
    optimizer_passes: Literal["fused", "per-op"] = "fused"
    """How the optimizer step moves its state through memory, where the engine is not shardwise's (whose step the
    planner counts on the real one: opcount). 'fused': one kernel reads the weights, gradients and state once and
    writes them once (torch's fused AdamW, Apex's and Transformer Engine's FusedAdam, DeepSpeed's). 'per-op' (layout
    'fsdp-mp' only): a pass per operation, as Composer's decoupled optimizers run under llm-foundry (composer/optim/
    decoupled_weight_decay.py, v0.14 to 0.17: a Python loop over the parameters of unfused in-place operations)
    and torch's foreach AdamW (torchtitan's default until February 2025), after the gradient clipping's norm pass
    and scaling pass: per_op_optimizer_bytes."""
    reduce_bucket_size: float = 0.0
    """Under the layout 'zero', DeepSpeed's reduce_bucket_size (elements) with contiguous_gradients: the gradient
    buckets it allocates in the weights' dtype, one kept from initialisation at ZeRO-3, one (two under
    `overlap_comm`) held through each backward at ZeRO-1 and 2 (memory.zero_bucket_bytes). DeepSpeed's default is 5e8
    (zero/config.py), 1 GB in bf16; 0: none (its contiguous_gradients off, or another system)."""
    overlap_comm: bool = False
    """DeepSpeed's overlap_comm at ZeRO-1 and 2: a second gradient bucket (its default: on at ZeRO-3, off below)."""
    flat_params: bool = False
    """Under the layout 'fsdp-mp', FSDP1's FlatParameter (torch's FullyShardedDataParallel, as Composer wraps
    llm-foundry's blocks) in place of FSDP2's per-parameter shards: a unit's shard is all-gathered straight into its
    flat unsharded buffer, whose views the blocks compute with, and the flat gradient is reduce-scattered as it
    lies, so there is no copy-in or copy-out around the collectives (FSDP2 packs and splits, on the compute stream
    for two of them); instead every backward joins the views' gradients into the flat gradient (autograd's
    SplitWithSizesBackward, on the compute stream), and a flat gradient in another dtype than the reduction's is
    cast whole on FSDP1's post-backward stream (torch/distributed/fsdp/_runtime_utils.py, _post_backward_hook and
    _reduce_grad). timing.sharding_copies."""
    keeps_bf16_grads: bool = False
    """DeepSpeed's BF16_Optimizer, as Megatron-DeepSpeed trained BLOOM (DeepSpeed runs it at ZeRO 0-1 without
    offload: bf16_optimizer_active). It keeps the bf16 gradients autograd writes beside its fp32 accumulation
    buffer, 2 bytes a parameter, not sharded, until the next backward frees them (backward() with
    clear_lp_grads=False: memory.model_state_bytes); and after every micro-batch's backward it adds them into
    that buffer, one pass over the stage's gradients (timing.bf16_accumulation_seconds)."""
    zero1_all_reduce: bool = False
    """ZeRO-1's gradients all-reduced whole after the backward, not reduce-scattered behind it: nanotron runs ZeRO-1
    without DDP (trainer.py: make_ddp only at ZeRO-0) and then sync_gradients_across_dp(reduce_scatter=False), one
    all-reduce of its fp32 buffer; layout 'megatron' only (timing.dp_comm)."""
    ddp_bucket_view: bool = True
    """torch's DistributedDataParallel runs with gradient_as_bucket_view: the gradients are views into its buckets,
    two of which are in flight (memory.ddp_bucket_bytes). False, torch's default: the Reducer allocates its buckets
    when the model is wrapped, a flat copy of every gradient in the gradients' dtype, and copies each gradient into
    them as it is ready, so the copy is resident beside autograd's gradients (memory.ddp_bucket_copy_bytes:
    nanotron at ZeRO-0, whose trainer.py wraps the model in DDP with dp > 1 and no gradient_as_bucket_view;
    torchtitan's DDP, torch's replicate, which passes none either)."""
    ce_shift_in_place: bool = True
    """Megatron's vocab-parallel cross-entropy subtracts each row's maximum from its fp32 logits in place, so its
    forward holds one fp32 tensor of the logits' size (the softmax it saves). False: the subtraction makes a new
    fp32 tensor while the upcast logits stay alive (nanotron's _ShardedCrossEntropy, `sharded_logits -
    logits_max`, its caller holding the fp32 logits until the model's forward returns): two fp32 tensors of the
    logits' size at the end of the forward (memory.logits_bytes)."""
    bf16_grad_transients: bool = True
    """Under keeps_bf16_grads, the two transient copies DeepSpeed's BF16_Optimizer makes, each in a segment of its
    own (memory.bf16_optimizer_segments); False for a system that keeps bf16 gradients without them (nanotron:
    autograd's bf16 gradients until its accumulation adds them into the fp32 buffer, in place, and DDP's buckets at
    ZeRO-0)."""
    embedding_norm: bool = False
    """The model normalises the embedding's output (BLOOM's --embed-layernorm): the first stage keeps the norm's
    input and statistics, and a dropout's mask after it, for every micro-batch in flight
    (memory.embedding_activation_bytes)."""
    pipeline_split: PipelineSplit = "cost"
    """How the system cuts the blocks into pipeline stages: 'cost', the engine's cost-balanced split
    (layout.split_layers over layer_costs: fewer blocks on the stages with the embedding and the head; shardwise,
    torchtitan), 'slots', DeepSpeed's partition over `type:transformer|embedding` (memory.slot_split: each
    embedding takes a block's slot; Megatron-DeepSpeed's --pp-partition-method, as BLOOM ran it), or 'nanotron',
    nanotron's greedy cut at equal shares of its block costs (memory.nanotron_split: the first stage takes the
    block that crosses its share, and the head can end on a rank before the last, the ranks after it empty)."""
    lora_rank: int = 0
    """LoRA rank on the `lora_targets` linears of every block (0 = full training)."""
    qlora: bool = False
    """Store the adapted linears' frozen base weights in 4-bit NF4 (needs lora_rank > 0)."""
    lora_targets: tuple[str, ...] = PROJECTIONS
    """The projections LoRA adapts in every block, by the engine's names (lora.targets; default all of them): the
    others stay frozen in the compute dtype, without adapters or NF4."""
    lora_dropout: float = 0.0
    """Dropout on each adapted linear's input before its adapter (lora.dropout; peft's lora_dropout): each adapter
    keeps a one-byte mask and its own dropped copy of its input for backward (memory.lora_dropout_terms)."""
    fused_rmsnorm: bool = True
    """RMSNorm saves (input, rstd): torch's fused kernel on a GPU, the engine's own on a CPU (shardwise.model.RMSNorm);
    False for torch's composite form (a GPU before torch 2.8, as torchtitan's 2024 runs), which also saves x*rstd."""
    fused_attention: bool = True
    """Attention is one fused kernel (FlashAttention, torch's SDPA): no s x s tensor in memory, causal tiles
    skipped. False: Megatron-LM's attention before FlashAttention (the 2021-22 runs, BLOOM): QK^T and AV as
    batched GEMMs over the whole s x s, the scores through a fused scale + mask + softmax kernel and dropout,
    each s x s tensor written to and read from memory, and the softmax output, dropout mask and dropout output
    kept for backward (Korthikanti et al.'s 5 a s^2 b bytes per layer, with dropout)."""
    elementwise: Literal["fused", "eager"] = "eager"
    """How the block's elementwise work runs: 'eager', one PyTorch operator at a time, each its own pass over memory
    (shardwise's engine, torchtitan without torch.compile), priced by the traffic counted on the engine's block
    (operators.ELEMENTWISE); or 'fused' kernels that write each tensor backward keeps once and read it once
    (Megatron's fused norms, bias-GeLU, bias-dropout-add; a compiled block; llm-foundry's one-kernel LayerNorm
    and GELU)."""
    float8: Float8Recipe = "torchao"
    """How precision fp8 runs the blocks' linears (timing.linear_times, memory.block_terms): 'torchao', torchao's
    float8 training (each linear casts its own input, weight and output gradient, tensorwise dynamic scaling, and
    saves its input in bf16: torchtitan), or Transformer Engine under Megatron-Core: one cast per distinct input
    (Q/K/V one linear, the MLP's gate and up one, the norm writing its output in float8), the float8 weights cast
    on a step's first micro-batch and cached for the rest, and each linear's input saved in float8 for its weight
    gradient; 'te-delayed' scales by the amax history (Megatron-Core's default --fp8-recipe delayed: no amax
    pass), 'te-current' by the tensor's own amax (Megatron's tensorwise recipe, NeMo's FP8-CS: an amax pass before
    each cast). Under LoRA (Transformer Engine's recipes only: NeMo's LoRA) the frozen linears run their forward and
    input-gradient GEMMs in float8 from float8 weights (float8_frozen_weights) and keep no input, the adapters in
    the compute dtype."""
    compile: bool = False
    """Each block compiled with torch.compile (shardwise's train.compile, torchtitan's compile): inductor fuses the
    block's elementwise operators, which are then priced as `elementwise` 'fused' whatever that field says. Memory
    is counted as the eager block keeps it (what inductor's partitioner saves instead is not modelled: torchtitan's
    benchmark measured 5 GiB less with compile on Llama 3.1 8B)."""
    checkpoint_early_stop: bool = True
    """Full recompute replays a block's forward only as far as its last tensor saved for backward: torch's
    non-reentrant torch.utils.checkpoint stops there (early stop, on by default since torch 2.1: pytorch PR 96866,
    March 2023), and a compiled block's partitioner recomputes only what its backward reads. The block's last
    linear (w2), whose output no backward reads, then does not run again, nor the tensor-parallel reduction of its
    output (timing). Measured on this engine's blocks: every linear but w2 runs again (tests/test_planner_system.py).
    False: a reentrant checkpoint replays the whole forward (Megatron's CheckpointFunction, DeepSpeed's)."""
    cp_exchange: CpExchange = "allgather"
    """How context parallelism moves K and V (timing._cp_exposed): 'allgather', every rank's K and V (its KV heads,
    in the compute dtype) all-gathered before the attention and their gradients reduce-scattered after its
    backward, each on the critical path (shardwise's engine: parallel.context_parallel, blocking collectives);
    'ring', each rank's K and V passed round
    the cp ranks, dK and dV back, in the compute dtype, each hop behind the attention it serves (Transformer
    Engine's ring under Megatron-Core); or 'torch', torch's
    context_parallel (torch.distributed.tensor.experimental._attention, as torchtitan runs it): K and V
    all-gathered once before the first of the cp attention steps (rotate method 'allgather', torchtitan's
    default), the gathered K and V again in backward, and dK and dV handed on at each of the cp steps in fp32
    (accumulated in fp32: convert_to_f32); under `compile` each collective is waited on where it is issued
    (inductor does not move the wait), so none of it hides behind the attention; eager, each is waited on at its
    first use, one attention step later; or 'a2a', the all-to-all exchange of DeepSpeed-Ulysses as Transformer
    Engine runs it (cp_comm_type "a2a", AttnFuncWithCPAndQKVOA2A): Q, K and V each all-to-all'd from sequence shards
    to head shards before the attention, which then runs over the whole sequence for 1/cp of the heads, and its
    output back after; in backward the saved output and its gradient, then dQ, dK and dV (TE 1.11 to 2.7); each
    waited on before the attention or the next layer (priced exposed). A tp rank's heads, and KV heads, must divide
    by cp (plan.engine_error)."""
    cp_repeats_kv: bool = False
    """Under context parallelism the K and V the exchange carries are repeated to every query head (torchtitan's
    model called repeat_kv before scaled_dot_product_attention until January 2026, its PR 2259): n_heads / tp
    heads a rank, not the KV heads."""
    compile_loss: bool = False
    """Under `compile`, the loss function is compiled too (torchtitan since April 2025: components/loss.py
    build_cross_entropy_loss wraps cross_entropy(pred.float(), ...) in torch.compile when compile is on; its code
    of December 2024 had that line commented out). Inductor fuses the fp32 upcast, the log-sum-exp and the
    backward into kernels over the compute-dtype logits, so the loss keeps what `ce_kernel` describes
    (`loss_kernel`)."""
    attention_kernel: str = "flash2"
    """The fused attention kernel, whose share of peak the accelerator's catalogue entry gives where its paper
    states one (hardware.KERNEL_EFFICIENCY): flash1, flash2 (torch's SDPA), flash3, cudnn."""
    dropout: bool = False
    """Megatron-LM's default hidden and attention dropout (p = 0.1; GPT-3-style runs and BLOOM kept it): a 1-byte
    mask per element after the attention's output projection and after the MLP, kept for backward (2 s b h bytes
    per layer, split over tp only with sequence parallelism), and, with unfused attention, dropout over the s x s
    probabilities. shardwise's model has no dropout."""
    loss_parallel: bool = False
    """The loss runs on vocab-parallel logit shards (Megatron's vocab-parallel cross-entropy) instead of on logits
    all-gathered to every tp rank, as shardwise's engine does (its output head returns replicated logits)."""
    ddp_bucket_mb: float = 25.0
    """DDP gradient bucket size (torch default 25 MB); two buckets are in flight at once."""
    fragmentation: float = 0.10
    """Allocator allowance: this share of activation and transient bytes is lost to fragmentation."""
    expandable_segments: bool = False
    """torch's caching allocator runs with expandable segments (PYTORCH_ALLOC_CONF="expandable_segments:True";
    PYTORCH_CUDA_ALLOC_CONF, its name before torch 2.9, is still read). Each stream's pool (small, large) is then one
    virtual range that grows by mapping physical memory, and when an allocation finds no room the allocator unmaps
    its free blocks' memory and maps it again where the allocation needs it (CUDACachingAllocator's
    release_cached_blocks; outside CUDA-graph capture, after syncing the streams): a hole between live tensors is not
    lost to a larger one. So whether a plan fits is sized without the fragmentation allowance (fit_fragmentation:
    what stays lost is under one mapping granule at either end of a free block, 20 MiB in the large pool, left
    out); what the allocator holds before it runs short still has its holes (reserved_bytes keeps the allowance,
    at most the device). The remapping's synchronisation is not priced."""
    fixed_overhead_gib: float = 1.0
    """Per-device memory not available to tensors: CUDA context, cuBLAS workspace, NCCL buffers."""
    expert_imbalance: float = 0.0
    """Mixture of experts under expert parallelism: routed tokens on the busiest ep rank over the mean, per MoE
    layer and micro-batch (>= 1; e.g. read from the engine's per-expert counts); 0: derived for a randomly
    initialised router over random tokens (planner.experts.init_imbalance)."""
    moe_dispatch: Literal["copies", "deepep"] = "copies"
    """How a mixture of experts moves tokens to its experts. 'copies' (shardwise's engine, torchtitan's): every
    routed (token, expert) copy is gathered, exchanged by all-to-all under ep and put back with index_copy, which
    keeps its copies (memory.moe_terms). 'deepep': DeepEP's dispatch as NeMo AutoModel runs it
    (moe/layers.py GroupedExpertsDeepEP): a token goes once to each ep rank holding any of its experts and comes
    back once, combined; a fused permute orders the received tokens into per-expert copies keeping only its row
    map; the routing weights multiply inside the experts' fused weighted SwiGLU; nothing else is kept per copy."""
    dispatch_ranks: float = 0.0
    """Under moe_dispatch 'deepep', the ep ranks a token is sent to, on average; 0: derived for independent
    uniform routing (experts.dispatch_ranks). NeMo AutoModel's fake balanced gate gives token i the top_k
    consecutive experts from i x top_k, all on one rank wherever top_k divides the experts a rank holds: 1."""

    def __post_init__(self):
        for key in ("seq_len", "global_batch"):
            if getattr(self, key) < 1:
                raise PlannerError(f"--{key.replace('_', '-')}", f"{getattr(self, key)} < 1", "pass a positive number")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise PlannerError("--optimizer", f"unknown optimizer {self.optimizer!r}",
                               f"use one of {', '.join(OPTIMIZER_STATE_BYTES)}")
        if self.precision not in ("fp32", "bf16", "fp16", "fp8"):
            raise PlannerError("--precision", f"unknown precision {self.precision!r}", "use fp32, bf16, fp16 or fp8")
        if self.layout not in LAYOUTS:
            raise PlannerError("--layout", f"unknown layout {self.layout!r}", f"use one of {', '.join(LAYOUTS)}")
        if self.pipeline_split not in PIPELINE_SPLITS:
            raise PlannerError("--system pipeline_split", f"unknown split {self.pipeline_split!r}",
                               f"use one of {', '.join(PIPELINE_SPLITS)}")
        if self.zero1_all_reduce and self.layout != "megatron":
            raise PlannerError("--system zero1_all_reduce", f"it describes nanotron's ZeRO-1 on the layout megatron, "
                               f"not {self.layout}", "leave it false, or use layout = megatron")
        if not self.ddp_bucket_view and (self.fsdp2 and self.fsdp_replicate or self.layout == "zero"):
            raise PlannerError("--system ddp_bucket_view", "it describes torch's DistributedDataParallel, and this "
                               "system's data parallelism is " + ("DeepSpeed's engine" if self.layout == "zero" else
                                                                  "FSDP2's replicate (fsdp_replicate)"),
                               "leave it true")
        megatron_loss = (self.loss_parallel and self.layout in ("megatron", "zero") and not self.loss_kernel
                         and not self.fuses_head)
        if not self.ce_shift_in_place and not megatron_loss:
            raise PlannerError("--system ce_shift_in_place", "it describes Megatron's vocab-parallel cross-entropy "
                               "(loss_parallel on the layouts megatron and zero, no cross-entropy kernel, the head "
                               "not fused with it)",
                               "leave it true")
        if self.pipeline_split == "nanotron":
            # nanotron's cut can leave the ranks after the head without a block: priced for what nanotron runs
            # (1F1B and all-forward-all-backward, whole-layer recompute, nothing offloaded), not beyond it
            beyond = sorted(set(self.pp_schedules) - {"gpipe", "1f1b"})
            if beyond or self.partial_checkpoint != "none" or self.offload_layers:
                what = (f"the schedules {', '.join(beyond)}" if beyond else
                        "checkpointing one block in k" if self.partial_checkpoint != "none" else
                        "Megatron-Core's activation offload")
                raise PlannerError("--system pipeline_split", f"nanotron's cut is priced with nanotron's schedules "
                                   f"and recompute, not with {what}",
                                   "leave pipeline_split at cost, or keep pp_schedules to gpipe and 1f1b, "
                                   "partial_checkpoint none and offload_layers 0")
        if self.cp_exchange not in CP_EXCHANGES:
            raise PlannerError("--system cp_exchange", f"{self.cp_exchange!r} is not one of {', '.join(CP_EXCHANGES)}",
                               f"use one of {', '.join(CP_EXCHANGES)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise PlannerError("--system attention_kernel", f"unknown kernel {self.attention_kernel!r}",
                               f"use one of {', '.join(ATTENTION_KERNELS)}")
        if self.elementwise not in ("fused", "eager"):
            raise PlannerError("--system elementwise", f"unknown elementwise mode {self.elementwise!r}",
                               "use fused or eager")
        if self.grad_sync not in ("step", "micro-batch"):
            raise PlannerError("--system grad_sync", f"unknown gradient sync {self.grad_sync!r}",
                               "use step or micro-batch")
        if self.offload_layers < 0:
            raise PlannerError("--system offload_layers", f"{self.offload_layers} blocks", "give 0 or more")
        if self.offload_layers and self.layout != "megatron":
            raise PlannerError("--system offload_layers", f"it describes Megatron-Core's cpu_offloading, not the "
                               f"layout {self.layout}", 'start from base = "megatron-core", or leave it out')
        if self.zero3_fetch not in ZERO3_FETCH:
            raise PlannerError("--system zero3_fetch", f"unknown ZeRO-3 fetch {self.zero3_fetch!r}",
                               f"use one of {', '.join(ZERO3_FETCH)}")
        if not self.grads_in_fp32 and self.layout != "megatron":
            raise PlannerError("--system grads_in_fp32", f"false describes Megatron's main-gradient buffer, not "
                               f"the layout {self.layout}",
                               'use layout megatron (base = "megatron-core"), or leave it true')
        if self.pp_overlap_p2p and self.layout != "megatron":
            raise PlannerError("--system pp_overlap_p2p", f"true describes Megatron-Core's interleaved schedule, not "
                               f"the layout {self.layout}'s pipeline",
                               'use layout megatron (base = "megatron-core"), or leave it false')
        for key in ("reduce_bucket_size", "overlap_comm"):
            if getattr(self, key) and self.layout != "zero":
                raise PlannerError(f"--system {key}", f"{key} describes DeepSpeed's gradient buckets under the "
                                   f"layout zero, not {self.layout}", f'use layout zero (base = "deepspeed"), or '
                                   f"leave {key} {'0' if key == 'reduce_bucket_size' else 'false'}")
        if not 0 <= self.reduce_bucket_size < float("inf"):
            raise PlannerError("--system reduce_bucket_size", f"{self.reduce_bucket_size} elements",
                               "give 0 or more (DeepSpeed's default is 5e8)")
        if self.overlap_comm and not self.reduce_bucket_size:
            raise PlannerError("--system overlap_comm", "true without gradient buckets (reduce_bucket_size 0) "
                               "changes nothing", "set reduce_bucket_size (DeepSpeed's default is 5e8), or leave "
                               "overlap_comm false")
        if not isinstance(self.loss_chunks, int) or self.loss_chunks < 1:
            raise PlannerError("--system loss_chunks", f"{self.loss_chunks!r} is not a whole number of chunks",
                               "give 1 or more (torchtune's CEWithChunkedOutputLoss: 8)")
        if self.loss_chunks > 1 and self.fuses_head:
            raise PlannerError("--system loss_chunks", "the head is fused with the loss, which never materialises "
                               "the logits to chunk", "set fuse_head = false, or leave loss_chunks 1")
        if self.loss_chunks > 1 and self.loss_parallel:
            raise PlannerError("--system loss_chunks", "a vocabulary-parallel loss (loss_parallel: Megatron's, "
                               "torch's loss_parallel) runs over all the logits at once",
                               "set loss_parallel = false, or leave loss_chunks 1")
        if self.state_dtype not in ("fp32", "bf16"):
            raise PlannerError("--system state_dtype", f"{self.state_dtype!r} is not fp32 or bf16",
                               "set state_dtype to fp32 or bf16")
        if self.state_dtype == "bf16" and (self.layout != "fsdp-mp" or self.compute_dtype != "bf16"):
            raise PlannerError("--system state_dtype", "bf16 describes a bf16 model trained without an fp32 copy "
                               f"(layout fsdp-mp, precision bf16 or fp8), not the layout {self.layout} in "
                               f"{self.precision}", 'set state_dtype = "fp32" (and reduce_dtype = "fp32") in the '
                               "system file, or keep layout fsdp-mp with --precision bf16")
        if self.optimizer_passes not in ("fused", "per-op"):
            raise PlannerError("--system optimizer_passes", f"{self.optimizer_passes!r} is not fused or per-op",
                               "set optimizer_passes to fused or per-op")
        if self.optimizer_passes == "per-op" and self.layout != "fsdp-mp":
            raise PlannerError("--system optimizer_passes", "per-op describes an optimizer stepping FSDP's fp32 "
                               f"shards a pass per operation (layout fsdp-mp), not the layout {self.layout}",
                               'use layout fsdp-mp (base = "llm-foundry"), or leave optimizer_passes fused')
        if self.optimizer_passes == "per-op" and self.optimizer not in PER_OP_OPTIMIZERS:
            raise PlannerError("--optimizer", f"{self.optimizer} under the system's optimizer_passes per-op "
                               "(AdamW and SGD a pass per operation: Composer's loops, torch's foreach)",
                               f"use {', '.join(PER_OP_OPTIMIZERS)}, or a system TOML with optimizer_passes = "
                               '"fused" (docs/planner.md, "Systems")')
        if self.flat_params and self.layout != "fsdp-mp":
            raise PlannerError("--system flat_params", f"true describes FSDP1's flat parameters under the layout "
                               f"fsdp-mp, not the layout {self.layout}",
                               'use layout fsdp-mp (base = "llm-foundry"), or leave it false')
        if self.reduce_dtype not in ("fp32", "bf16", "fp16"):
            raise PlannerError("--system reduce_dtype", f"unknown reduce dtype {self.reduce_dtype!r}",
                               "use fp32, or the run's compute dtype (bf16, fp16)")
        if self.reduce_dtype != "fp32" and self.layout not in ("fsdp-mp", "torch"):
            raise PlannerError("--system reduce_dtype", f"{self.reduce_dtype} describes FSDP's reduction under the "
                               f"layouts fsdp-mp and torch, and the layout is {self.layout}",
                               'use layout fsdp-mp or torch (a system file on base = "llm-foundry", "torchtitan" or '
                               '"shardwise"), or leave it fp32')
        if self.reduce_dtype != "fp32" and self.compute_dtype != self.reduce_dtype:
            raise PlannerError("--system reduce_dtype", f"{self.reduce_dtype} describes FSDP's reduction in the run's "
                               f"compute dtype, and --precision is {self.precision}",
                               f"pass --precision {self.reduce_dtype}, or leave it fp32")
        if self.reduce_dtype != "fp32" and self.layout == "torch" and self.system.split(" (")[0] == "shardwise":
            raise PlannerError("--system reduce_dtype", f"{self.reduce_dtype}, and shardwise's engine reduces in fp32 "
                               "(its FSDP2 under autocast gets no policy; its own policy, mixed_precision fsdp, "
                               "reduces in fp32)", "leave it fp32, or describe another system in a file of its own")
        if self.optimizer_dtype not in ("fp32", "bf16"):
            raise PlannerError("--system optimizer_dtype", f"unknown optimizer dtype {self.optimizer_dtype!r}",
                               "use fp32 or bf16")
        if self.optimizer_dtype == "bf16":
            if self.layout != "megatron":
                raise PlannerError("--system optimizer_dtype", "bf16 describes Apex's distributed Adam under the "
                                   f"layout megatron, not {self.layout}",
                                   'use layout megatron (base = "megatron-core"), or leave it fp32')
            if self.optimizer != "adamw":
                raise PlannerError("--optimizer", f"{self.optimizer} with the system's optimizer_dtype bf16 (Apex's "
                                   "distributed Adam)", "pass --optimizer adamw, or set optimizer_dtype fp32")
            if self.precision not in ("bf16", "fp8"):
                raise PlannerError("--precision", f"{self.precision} with the system's optimizer_dtype bf16 (Apex's "
                                   "bf16 Adam state: no master in bf16, a bf16 one in fp8)",
                                   "pass --precision bf16 or fp8, or set optimizer_dtype fp32")
        if not self.overlap_grad_reduce and self.layout not in ("megatron", "zero"):
            raise PlannerError("--system overlap_grad_reduce", "false describes a reduction after the backward "
                               f"(Megatron-LM before 2023, DeepSpeed's pipeline), not the layout {self.layout}, "
                               "whose hooks reduce during it", 'use layout megatron or zero, or leave it true')
        if self.overlap_param_gather and self.layout != "megatron":
            raise PlannerError("--system overlap_param_gather", "true describes Megatron-Core's distributed "
                               f"optimizer, not the layout {self.layout}",
                               'use layout megatron (base = "megatron-core"), or leave it false')
        if self.zero3_fetch == "module-sync" and (self.layout != "zero" or self.lora_rank):
            raise PlannerError("--system zero3_fetch", "module-sync describes DeepSpeed's first ZeRO-3, which trained "
                               f"every weight in the layout 'zero', not {'LoRA' if self.lora_rank else self.layout}",
                               "use zero3_fetch = prefetch, or layout zero without LoRA")
        if self.activation_fp8_input and (self.layout != "megatron" or self.swiglu != "fused"):
            raise PlannerError("--system activation_fp8_input", "it describes Megatron-Core's fused SwiGLU keeping "
                               f"its input in float8, not the layout {self.layout} with swiglu {self.swiglu}",
                               'use base = "megatron-core", or leave it false')
        if self.float8 not in FLOAT8_RECIPES:
            raise PlannerError("--system float8", f"unknown float8 recipe {self.float8!r}",
                               f"use one of {', '.join(FLOAT8_RECIPES)}")
        if self.partial_checkpoint not in PARTIAL_CHECKPOINTS:
            raise PlannerError("--system partial_checkpoint", f"{self.partial_checkpoint!r}",
                               f"use one of {', '.join(PARTIAL_CHECKPOINTS)}")
        if self.selective not in SELECTIVE:
            raise PlannerError("--system selective", f"unknown selective policy {self.selective!r}",
                               f"use one of {', '.join(SELECTIVE)}")
        if self.moe_dispatch not in ("copies", "deepep"):
            raise PlannerError("--system moe_dispatch", f"unknown dispatch {self.moe_dispatch!r}",
                               "use copies or deepep")
        if self.moe_layer not in ("engine", "megatron-core"):
            raise PlannerError("--system moe_layer", f"unknown MoE layer {self.moe_layer!r}",
                               "use engine or megatron-core")
        if self.ep_overlap and self.moe_layer != "megatron-core":
            raise PlannerError("--system ep_overlap", "Megatron-Core's combined 1F1B schedule, and the MoE layer is "
                               f"{self.moe_layer}'s", 'set moe_layer = "megatron-core", or leave ep_overlap false')
        if self.dispatch_ranks and self.dispatch_ranks < 1:
            raise PlannerError("--dispatch-ranks", f"{self.dispatch_ranks} < 1: a routed token goes to one rank at "
                               "least", "pass a number >= 1, or 0 to derive it")
        if self.expert_imbalance and self.expert_imbalance < 1:
            raise PlannerError("--expert-imbalance", f"{self.expert_imbalance} < 1: the busiest rank takes at least "
                               "the mean", "pass a ratio >= 1, or 0 to derive it")
        if self.lora_rank < 0:
            raise PlannerError("--lora-rank", f"{self.lora_rank} < 0",
                               "use a positive rank such as 16, or leave it out to train every weight")
        if self.qlora and self.lora_rank < 1:
            raise PlannerError("--qlora", "QLoRA trains LoRA adapters", "also pass --lora-rank R")
        if not 0 <= self.lora_dropout < 1:  # nan too
            raise PlannerError("--lora-dropout", f"{self.lora_dropout} is outside [0, 1)",
                               "pass a probability such as 0.05, or 0 for none")
        if self.lora_dropout and self.lora_rank < 1:
            raise PlannerError("--lora-dropout", "it drops LoRA adapters' inputs, and no --lora-rank is given",
                               "also pass --lora-rank R")
        unknown = [t for t in self.lora_targets if t not in PROJECTIONS]
        if unknown or not self.lora_targets:
            raise PlannerError("--lora-targets", f"{unknown or 'none'} names no projection of a block",
                               f"name some of {', '.join(PROJECTIONS)}")
        if self.precision == "fp8" and self.qlora:
            raise PlannerError("--precision", "fp8 is float8 training of the linears, which nothing here runs under "
                               "QLoRA (NF4 base weights)", "use --precision bf16 with --qlora")
        if self.precision == "fp8" and self.lora_rank and self.float8 == "torchao":
            # NeMo's LoRA runs Transformer Engine's float8 under the adapters (fp8 with peft in its configs); torchao's
            # Float8Linear (shardwise's engine, torchtitan) is not combined with LoRA anywhere we know
            raise PlannerError("--precision", "fp8 under LoRA adapters is described for Transformer Engine's float8 "
                               "(NeMo's LoRA), not torchao's recipe, which nothing here runs under adapters",
                               "use --precision bf16 with --lora-rank, or a system whose float8 is te-delayed or "
                               "te-current (base megatron-core)")

    @property
    def mixed(self) -> bool:
        return self.precision != "fp32"

    @property
    def autocasts(self) -> bool:
        """Whether the step runs under torch's autocast on fp32 weights (layout 'torch' in bf16 or fp16: shardwise's
        engine), which dispatches a cast of each matmul's inputs and of their gradients (operators.OP_COUNTS)."""
        return self.layout == "torch" and self.precision in ("bf16", "fp16")

    @property
    def loss_kernel(self) -> bool:
        """The cross-entropy over materialised logits is one kernel over the compute-dtype logits (memory.py): a
        kernel the system calls (`ce_kernel`), or the loss compiled with the blocks (`compile_loss`)."""
        return self.ce_kernel or (self.compile and self.compile_loss)

    @property
    def compute_dtype(self) -> str:
        """The dtype of the matmuls outside the blocks' linears (attention, the output head) and of MFU's peak: under
        fp8 only the linears run in float8 (`linear_dtype`), as torchao's float8 training converts them."""
        return "bf16" if self.precision == "fp8" else self.precision

    @property
    def linear_dtype(self) -> str:
        """The dtype of the blocks' linear GEMMs: fp8 is float8 training of every linear but the output head, by the
        recipe `float8` names (torchao.float8.convert_to_float8_training as torchtitan applies it, or Transformer
        Engine's modules under Megatron-Core); its casts are priced in timing.linear_times."""
        return self.precision

    @property
    def float8_frozen_weights(self) -> bool:
        """LoRA's frozen block linears stored in float8, one byte a weight: Transformer Engine's float8 under LoRA as
        NeMo runs it, whose configs set fp8_params with fp8 (TE's fp8_model_init: the weights are Float8Tensors, no
        bf16 copy), as its MLPerf Llama 2 70B LoRA submissions did (megatron_gpt_peft_tuning_config.yaml:
        fp8_params ${FP8}). Each backward makes the weight's transposed float8 copy afresh, as those configs ask
        (disable_parameter_transpose_cache; with the cache TE would keep it, a byte a weight more): timing
        te_float8_cast_seconds, memory.model_state_bytes."""
        return bool(self.lora_rank) and self.linear_dtype == "fp8" and self.float8 != "torchao"

    @property
    def syncs_every_micro_batch(self) -> bool:
        """Whether sharded gradients (ZeRO-2/3) are reduce-scattered in every micro-batch's backward: the system's
        grad_sync, and always under the layouts 'zero' (DeepSpeed) and 'megatron', whose ZeRO-2/3 is Megatron-FSDP
        (--data-parallel-sharding-strategy optim_grads / optim_grads_params): its gradient buffer holds only the
        rank's shard, so each backward's gradients are reduce-scattered into it. (Megatron's ZeRO-1, the
        distributed optimizer, keeps the whole fp32 buffer and reduces once per step: the callers ask only at
        ZeRO-2/3.)"""
        return self.grad_sync == "micro-batch" or self.layout in ("zero", "megatron")

    def reduces_every_micro_batch(self, pp: int) -> bool:
        """Whether ZeRO-2/3 reduce-scatter gradients in every micro-batch's backward (keeping only the shard) in a
        plan of `pp` pipeline stages: the system's choice (`syncs_every_micro_batch`), except in a pipeline of FSDP2
        units, where torch.distributed.pipelining turns gradient sync off for every backward but the step's last
        (PipelineStage.backward_maybe_with_nosync: set_requires_gradient_sync(False), then a post-backward with it
        on for the last; torch 2.13 turns it off for every backward and reduces after the last one,
        perform_reduce_grad, which timing still prices as behind that backward), whatever the trainer asks
        (torchtitan's): the gradients are kept unsharded, in the reduce dtype, until then."""
        return self.syncs_every_micro_batch and not (pp > 1 and self.fsdp2)

    @property
    def grad_reduce_hidden(self) -> bool:
        """Whether the gradients' reduction below ZeRO-3 hides behind the backward (timing.dp_comm): as
        overlap_grad_reduce says, and under DeepSpeed's ZeRO engine (layout 'zero') only with overlap_comm: without
        it ZeRO-0 and 1 reduce at the accumulation boundary after the backward (engine.allreduce_gradients; ZeRO-1
        registers no gradient hooks, stage_1_and_2.py) and ZeRO-2's hooks reduce on the compute stream
        (average_tensor: current_stream()), which the backward then waits for."""
        return self.overlap_grad_reduce and (self.layout != "zero" or self.overlap_comm)

    @property
    def fsdp2(self) -> bool:
        """The state lives in FSDP2 / replicate units, one per block and one for the root (shardwise, torchtitan)."""
        return self.layout in ("torch", "fsdp-mp")

    def bf16_optimizer_active(self, zero_stage: int, offload: str) -> bool:
        """Whether keeps_bf16_grads applies to a plan: DeepSpeed uses its BF16_Optimizer at ZeRO 0-1 without
        offload (engine._do_optimizer_sanity_check; ZeRO-2/3 run its ZeRO optimizer), on bf16 weights (layouts
        'megatron' and 'zero'; 'torch' and 'fsdp-mp' keep fp32 weights, whose gradients are fp32)."""
        return (self.keeps_bf16_grads and self.mixed and zero_stage <= 1 and offload == "none"
                and self.layout in ("megatron", "zero"))

    @property
    def fuses_head(self) -> bool:
        return self.layout == "torch" if self.fuse_head is None else self.fuse_head

    @property
    def act_bytes(self) -> int:
        """Bytes of a matmul input/output saved for backward (fp8 recipes keep bf16 copies for the backward)."""
        return 4 if self.precision == "fp32" else 2

    @property
    def stream_bytes(self) -> int:
        """Bytes of the residual stream. Under 'torch' the weights (and so the embedding output) are fp32 at every
        ZeRO stage (the engine gives FSDP2 no mixed-precision policy: it gathers fp32 weights and autocast casts
        them per use), and autocast leaves additions and norms in fp32. 'fsdp-mp'/'zero'/'megatron' run in bf16."""
        if self.precision == "fp32" or self.layout == "torch":
            return 4
        return 2


def recipe_for(training: Training, plan) -> Training:
    """The recipe as a plan (a Layout) runs it. FSDP2's mixed-precision policy ('fsdp-mp') exists only where FSDP
    shards the weights (ZeRO-2/3 over more than one rank); elsewhere torchtitan trains under autocast (its DDP and
    single device), which is the layout 'torch'. (torchtitan's tensor or pipeline parallelism without FSDP runs with
    no mixed precision at all; the planner prices it under autocast too.) shardwise's engine (the layout 'torch')
    runs that policy where the plan asks for it (Layout.mixed_precision = 'fsdp', which the engine allows only
    where FSDP shards: layout.engine_cannot_run), its head still fused with the loss."""
    shards = fsdp_shards(plan)
    if training.layout == "fsdp-mp" and not shards and training.state_dtype == "fp32":
        return _under_autocast(training)
    if plan.mixed_precision == "fsdp" and training.layout == "torch" and shards:
        return _under_fsdp_policy(training)
    return training


@functools.lru_cache(maxsize=256)
def _under_autocast(training: Training) -> Training:
    # one object per recipe: the planner's memos are keyed on it, and a search asks ~10^5 times
    # (autocast: fp32 gradients, shardwise's FSDP2)
    return dataclasses.replace(training, layout="torch", reduce_dtype="fp32", flat_params=False,
                               optimizer_passes="fused")


@functools.lru_cache(maxsize=256)
def _under_fsdp_policy(training: Training) -> Training:
    return dataclasses.replace(training, layout="fsdp-mp", fuse_head=training.fuses_head)


def resolve_model(spec: str | ModelArgs) -> ModelArgs:
    """A preset name, a ModelArgs, a Hugging Face config.json, or a shardwise TOML config."""
    if isinstance(spec, ModelArgs):
        return spec
    if spec in PRESETS:
        return dataclasses.replace(PRESETS[spec])
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():  # a Hugging Face model folder, as from_pretrained takes it
        path = path / "config.json"
    if path.is_file() and path.suffix == ".json":
        try:
            cfg = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlannerError("--model", f"{path} is not JSON ({e})", "pass a Hugging Face config.json") from None
        if not isinstance(cfg, dict):
            raise PlannerError("--model", f"{path} holds no JSON object", "pass a Hugging Face config.json")
        return from_hf_config(cfg, name=path.parent.name or path.stem)
    if path.is_file() and path.suffix == ".toml":
        from shardwise.config import load_config

        return load_config(path, sizing=True).model
    raise PlannerError("--model", f"{spec!r} is neither a preset nor a config file",
                       f"use one of {', '.join(PRESETS)}, a Hugging Face config.json (or its folder) or a "
                       "shardwise TOML")


def from_hf_config(cfg: dict, name: str = "hf") -> ModelArgs:
    """Map a Llama-family (LlamaConfig keys) or Mixtral Hugging Face config onto ModelArgs."""
    try:
        return args_from_hf_config(cfg, name)
    except ValueError as e:
        raise PlannerError("--model", str(e), "pass a Llama-family or Mixtral (decoder, SwiGLU) config.json")
