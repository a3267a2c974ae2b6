"""The system a plan is for: what the planner assumes about the engine that would run it.

The same layout costs different memory and time in different engines: where the weights are kept and in which
dtype they are gathered, the residual stream's dtype, whether the logits are ever materialised, what selective
checkpointing keeps, how attention runs. A `System` names those choices; `shardwise plan --system NAME` (or a TOML
file describing one) sizes plans as that system would run them, and `shardwise` itself is one of them. Each
preset states where its choices are read from (the system's own code or paper).

A system TOML holds the fields of `System` at top level; `base = "NAME"` starts from a preset, and the file's
name names the system (torchtitan-no-sac.toml):

    base = "torchtitan"
    selective = "matmuls"
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

from shardwise.hardware import PlannerError
from shardwise.planner.workload import (
    ATTENTION_KERNELS,
    CP_EXCHANGES,
    FLOAT8_RECIPES,
    LAYOUTS,
    PARTIAL_CHECKPOINTS,
    PIPELINE_SPLITS,
    PP_SCHEDULES,
    SELECTIVE,
    ZERO3_FETCH,
    Layout,
    Selective,
    Zero3Fetch,
)


@dataclass(frozen=True)
class System:
    name: str
    summary: str
    """One line: what the planner assumes, as the plan output prints it."""
    layout: Layout = "torch"
    """How state is stored and gathered (workload.Training.layout)."""
    fuse_head: bool | None = None
    """Output head and cross-entropy fused where the head is a plain linear (Training.fuse_head); None: exactly
    under the layout 'torch' (shardwise's engine)."""
    loss_parallel: bool = False
    """Cross-entropy on vocab-parallel logit shards under TP instead of all-gathered logits."""
    attention: str = "fused"
    """'fused' (FlashAttention, SDPA) or 'unfused' (Megatron-LM's 2021-22 batched GEMMs + softmax)."""
    attention_kernel: str = "flash2"
    """The fused kernel (Training.attention_kernel): flash1, flash2, flash3 or cudnn."""
    dropout: bool = False
    """Megatron's hidden and attention dropout (p = 0.1): its masks are kept for backward."""
    ce_kernel: bool = False
    """The cross-entropy is one kernel over compute-dtype logits (Training.ce_kernel)."""
    grad_sync: str = "step"
    """Under accumulation, sharded gradients reduced once per step or every micro-batch (Training.grad_sync)."""
    selective: Selective = "matmuls"
    """What activation_checkpoint=selective keeps (Training.selective)."""
    partial_checkpoint: str = "none"
    """Which blocks checkpointing one block in k wraps, or 'none' where the system has no such knob
    (Training.partial_checkpoint)."""
    elementwise: str = "eager"
    """'eager' (one PyTorch operator at a time, each a pass over memory) or 'fused' kernels (Training.elementwise)."""
    swiglu: str = "eager"
    """A SwiGLU MLP as PyTorch operators ('eager') or one autograd function that keeps its input ('fused')
    (Training.swiglu)."""
    fused_projections: bool = False
    """Q, K and V one linear, and a SwiGLU's w1 and w3 one, each keeping its input once
    (Training.fused_projections)."""
    zero3_fetch: Zero3Fetch = "prefetch"
    """How ZeRO-3 fetches weights under the layout 'zero': 'prefetch' or DeepSpeed 2021's 'module-sync'
    (Training.zero3_fetch)."""
    compile: bool = False
    """Each block compiled with torch.compile (Training.compile; `shardwise plan --compile`)."""
    compile_loss: bool = False
    """Under compile, the loss function is compiled too (Training.compile_loss)."""
    cp_exchange: str = "allgather"
    """How context parallelism moves K and V: all-gathered and exposed ('allgather', this engine's), passed round
    a ring behind the attention ('ring'), torch's context_parallel ('torch') or Transformer Engine's all-to-all to
    head shards ('a2a', its cp_comm_type "a2a") (Training.cp_exchange)."""
    cp_repeats_kv: bool = False
    """K and V repeated to every query head before the CP exchange (Training.cp_repeats_kv: torchtitan until
    January 2026)."""
    checkpoint_early_stop: bool = True
    """Full recompute stops at the block's last saved tensor, its last linear not run again (torch's non-reentrant
    checkpoint since torch 2.1, or a compiled block); False: the whole forward is replayed (a reentrant checkpoint:
    Megatron's, DeepSpeed's). Training.checkpoint_early_stop."""
    float8: str = "torchao"
    """How --precision fp8 runs the linears: torchao, te-delayed or te-current (Training.float8)."""
    distribute_checkpoints: bool = False
    """Megatron-LM's --distribute-checkpointed-activations: under full recompute without sequence parallelism the
    saved block inputs are split over tp (Training.distribute_checkpoints)."""
    pp_overlap_p2p: bool = False
    """Megatron-Core's overlapped interleaved schedule (Training.pp_overlap_p2p)."""
    overlap_param_gather: bool = False
    """Megatron-Core's distributed optimizer gathers the updated weights behind the next forward
    (Training.overlap_param_gather); layout 'megatron' only."""
    overlap_grad_reduce: bool = True
    """Gradients reduced during the backward (False: after it, exposed: Training.overlap_grad_reduce); layouts
    'megatron' and 'zero' only."""
    grads_in_fp32: bool = True
    """Megatron's main gradients (and their data-parallel reduction) in fp32, or in the weights' dtype
    (Training.grads_in_fp32: NeMo 2's performance recipes); layout 'megatron' only."""
    optimizer_dtype: str = "fp32"
    """AdamW's moments (and master, where one is kept) in bf16 as Apex's distributed Adam keeps them
    (Training.optimizer_dtype); layout 'megatron' only."""
    reduce_bucket_size: float = 0.0
    """DeepSpeed's contiguous gradient buckets, elements (Training.reduce_bucket_size); layout 'zero' only."""
    overlap_comm: bool = False
    """DeepSpeed's overlap_comm: ZeRO-1/2's second gradient bucket (Training.overlap_comm); layout 'zero' only."""
    reduce_dtype: str = "fp32"
    """FSDP's gradient reduction in fp32 or in the compute dtype (Training.reduce_dtype); layouts 'fsdp-mp' and
    'torch' (Lightning's FSDP under bf16-mixed)."""
    flat_params: bool = False
    """FSDP1's flat parameters in place of FSDP2's (Training.flat_params); layout 'fsdp-mp' only."""
    loss_chunks: int = 1
    """The loss over this many chunks of the logits, each its own autograd node (Training.loss_chunks: torchtune's
    CEWithChunkedOutputLoss, 8)."""
    activation_offload: bool = False
    """Under full recompute, the blocks' saved inputs offloaded to host memory (Training.activation_offload:
    torchtune's enable_activation_offloading)."""
    activation_fp8_input: bool = False
    """Megatron-Core's fused SwiGLU keeping its input in float8 (Training.activation_fp8_input)."""
    offload_layers: int = 0
    """Megatron-Core's CPU offloading of the activations of a stage's first this many blocks
    (Training.offload_layers: cpu_offloading_num_layers); layout 'megatron' only."""
    optimizer_in_backward: bool = False
    """Each parameter stepped and its gradient freed in backward (Training.optimizer_in_backward: torchtune's
    optimizer_in_bwd)."""
    state_dtype: str = "fp32"
    """The model stored and trained in bf16 with no fp32 copy (Training.state_dtype: torchtune's dtype bf16);
    layout 'fsdp-mp' only."""
    fused_rmsnorm: bool = True
    """RMSNorm as torch's fused kernel, or False: a composite in fp32 that also keeps its normalised input
    (Training.fused_rmsnorm: torchtune's own RMSNorm, torch.nn.RMSNorm on a GPU before torch 2.8)."""
    optimizer_passes: str = "fused"
    """The optimizer step as one fused kernel or a pass per operation (Training.optimizer_passes: Composer's
    decoupled optimizers, torch's foreach AdamW); layout 'fsdp-mp' only."""
    keeps_bf16_grads: bool = False
    """The optimizer keeps autograd's bf16 gradients beside its fp32 buffer (Training.keeps_bf16_grads: DeepSpeed's
    BF16_Optimizer)."""
    bf16_grad_transients: bool = True
    """Under keeps_bf16_grads, DeepSpeed's two transient copies (Training.bf16_grad_transients)."""
    ddp_bucket_view: bool = True
    """torch DDP's gradients are views into its buckets; False: its buckets a resident copy of every gradient
    (Training.ddp_bucket_view: nanotron's ZeRO-0, torchtitan's DDP)."""
    ce_shift_in_place: bool = True
    """The vocab-parallel loss shifts its fp32 logits in place; False: into a second fp32 tensor
    (Training.ce_shift_in_place: nanotron's)."""
    zero1_all_reduce: bool = False
    """ZeRO-1's gradients all-reduced whole after the backward (Training.zero1_all_reduce: nanotron's)."""
    pipeline_split: str = "cost"
    """How the blocks are cut into pipeline stages: 'cost', DeepSpeed's 'slots' or 'nanotron'
    (Training.pipeline_split)."""
    moe_dispatch: str = "copies"
    """How a mixture of experts moves tokens: every routed copy ('copies') or DeepEP's once per rank ('deepep')
    (Training.moe_dispatch)."""
    pp_schedules: tuple[str, ...] = PP_SCHEDULES
    """The pipeline schedules the system runs; empty: no pipeline parallelism (Training.pp_schedules). The search
    offers no other, and --plan asking for one is refused."""
    pp_zero_max: int = 3
    """The highest ZeRO stage it runs beside a pipeline (Training.pp_zero_max)."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """The ZeRO stages it runs (Training.zero_stages)."""
    ddp_alone: bool = False
    """DDP only as the layout's one parallelism (Training.ddp_alone)."""
    fsdp_replicate: bool = False
    """ZeRO-0/1 over several ranks as FSDP2's replicate (Training.fsdp_replicate)."""
    zero3_grads_at_start: bool = False
    """DeepSpeed's ZeRO-3 gradient partitions allocated at start (Training.zero3_grads_at_start)."""
    hsdp_stages: tuple[int, ...] = (2, 3)
    """The ZeRO stages it runs as hybrid sharding (Training.hsdp_stages)."""
    offload_stages: tuple[int, ...] = (2, 3)
    """The ZeRO stages at which it offloads weights, gradients and optimizer state (Training.offload_stages)."""
    tensor_parallel: bool = True
    """It splits attention heads and the MLP over tp ranks (Training.tensor_parallel)."""
    context_parallel: bool = True
    """It splits the sequence over cp ranks for attention (Training.context_parallel)."""
    expert_parallel: bool = True
    """It splits a mixture of experts' experts over ep ranks (Training.expert_parallel)."""
    moe_layer: str = "engine"
    """Whose mixture-of-experts layer: shardwise's engine's ('engine') or Megatron-Core's MoELayer with expert tensor
    parallelism 1 ('megatron-core'): where ep draws its ranks, what the layer saves (Training.moe_layer)."""
    ep_overlap: bool = False
    """Megatron-Core's all-to-all overlap, --overlap-moe-expert-parallel-comm (Training.ep_overlap)."""
    expandable_segments: bool = False
    """Its launcher runs torch's allocator with expandable segments (Training.expandable_segments)."""
    source: str = ""
    """Where the choices are read from."""

    def __post_init__(self):
        checks = (("layout", self.layout, LAYOUTS), ("attention", self.attention, ("fused", "unfused")),
                  ("selective", self.selective, SELECTIVE),
                  ("partial_checkpoint", self.partial_checkpoint, PARTIAL_CHECKPOINTS),
                  ("grad_sync", self.grad_sync, ("step", "micro-batch")),
                  ("attention_kernel", self.attention_kernel, ATTENTION_KERNELS),
                  ("elementwise", self.elementwise, ("fused", "eager")), ("swiglu", self.swiglu, ("fused", "eager")),
                  ("zero3_fetch", self.zero3_fetch, ZERO3_FETCH), ("float8", self.float8, FLOAT8_RECIPES),
                  ("pipeline_split", self.pipeline_split, PIPELINE_SPLITS),
                  ("moe_dispatch", self.moe_dispatch, ("copies", "deepep")),
                  ("moe_layer", self.moe_layer, ("engine", "megatron-core")),
                  ("cp_exchange", self.cp_exchange, CP_EXCHANGES),
                  ("optimizer_dtype", self.optimizer_dtype, ("fp32", "bf16")),
                  ("optimizer_passes", self.optimizer_passes, ("fused", "per-op")),
                  ("state_dtype", self.state_dtype, ("fp32", "bf16")),
                  ("reduce_dtype", self.reduce_dtype, ("fp32", "bf16", "fp16")))
        for key, value, allowed in checks:
            if value not in allowed:
                raise PlannerError(f"--system {key}", f"{value!r} is not one of {', '.join(allowed)}",
                                   f"set {key} to one of them")
        for schedule in self.pp_schedules:
            if schedule not in PP_SCHEDULES:
                raise PlannerError("--system pp_schedules", f"{schedule!r} is not one of {', '.join(PP_SCHEDULES)}",
                                   "list schedules among them ([] for a system without pipeline parallelism)")
        if self.pp_zero_max not in (0, 1, 2, 3):
            raise PlannerError("--system pp_zero_max", f"{self.pp_zero_max}", "use 0, 1, 2 or 3")
        for key, stages, least in (("zero_stages", self.zero_stages, 1), ("hsdp_stages", self.hsdp_stages, 0),
                                   ("offload_stages", self.offload_stages, 0)):
            if len(stages) < least or any(type(z) is not int or z not in (0, 1, 2, 3) for z in stages) or \
                    list(stages) != sorted(set(stages)):
                raise PlannerError(f"--system {key}", f"{list(stages)}", "list "
                                   + ("one or more" if least else "none or some") + " of 0, 1, 2 and 3, ascending")
        if self.activation_fp8_input and (self.layout != "megatron" or self.swiglu != "fused"):
            raise PlannerError("--system activation_fp8_input", "it describes Megatron-Core's fused SwiGLU keeping "
                               f"its input in float8, not the layout {self.layout} with swiglu {self.swiglu}",
                               'start from base = "megatron-core", or leave it false')
        if self.float8 != "torchao" and self.layout != "megatron":
            raise PlannerError("--system float8", f"{self.float8} is Transformer Engine as Megatron-Core runs it, "
                               f"not the layout {self.layout}", 'start from base = "megatron-core", or use torchao')
        for key, value in (("moe_layer", self.moe_layer == "megatron-core"), ("ep_overlap", self.ep_overlap)):
            if value and self.layout != "megatron":
                raise PlannerError(f"--system {key}", f"it describes Megatron-Core's MoE layer, not the layout "
                                   f"{self.layout}", f'start from base = "megatron-core", or leave {key} out')

    def training_fields(self) -> dict:
        """The Training fields this system fixes."""
        return {"system": self.name, "layout": self.layout, "fuse_head": self.fuse_head,
                "loss_parallel": self.loss_parallel, "fused_attention": self.attention == "fused",
                "attention_kernel": self.attention_kernel,
                "dropout": self.dropout, "ce_kernel": self.ce_kernel, "grad_sync": self.grad_sync,
                "selective": self.selective, "partial_checkpoint": self.partial_checkpoint,
                "elementwise": self.elementwise, "swiglu": self.swiglu,
                "fused_projections": self.fused_projections, "activation_fp8_input": self.activation_fp8_input,
                "zero3_fetch": self.zero3_fetch, "compile": self.compile, "compile_loss": self.compile_loss,
                "checkpoint_early_stop": self.checkpoint_early_stop, "float8": self.float8,
                "cp_exchange": self.cp_exchange, "cp_repeats_kv": self.cp_repeats_kv,
                "distribute_checkpoints": self.distribute_checkpoints, "keeps_bf16_grads": self.keeps_bf16_grads,
                "bf16_grad_transients": self.bf16_grad_transients, "zero1_all_reduce": self.zero1_all_reduce,
                "ddp_bucket_view": self.ddp_bucket_view, "ce_shift_in_place": self.ce_shift_in_place,
                "grads_in_fp32": self.grads_in_fp32, "pp_overlap_p2p": self.pp_overlap_p2p,
                "overlap_param_gather": self.overlap_param_gather,
                "overlap_grad_reduce": self.overlap_grad_reduce, "optimizer_dtype": self.optimizer_dtype,
                "reduce_dtype": self.reduce_dtype, "flat_params": self.flat_params,
                "optimizer_passes": self.optimizer_passes, "state_dtype": self.state_dtype,
                "fused_rmsnorm": self.fused_rmsnorm, "loss_chunks": self.loss_chunks,
                "activation_offload": self.activation_offload, "optimizer_in_backward": self.optimizer_in_backward,
                "offload_layers": self.offload_layers,
                "reduce_bucket_size": self.reduce_bucket_size,
                "overlap_comm": self.overlap_comm,
                "pipeline_split": self.pipeline_split, "moe_dispatch": self.moe_dispatch,
                "pp_schedules": self.pp_schedules, "pp_zero_max": self.pp_zero_max, "zero_stages": self.zero_stages,
                "ddp_alone": self.ddp_alone, "fsdp_replicate": self.fsdp_replicate, "hsdp_stages": self.hsdp_stages,
                "offload_stages": self.offload_stages, "zero3_grads_at_start": self.zero3_grads_at_start,
                "tensor_parallel": self.tensor_parallel, "context_parallel": self.context_parallel,
                "expert_parallel": self.expert_parallel, "moe_layer": self.moe_layer, "ep_overlap": self.ep_overlap,
                "expandable_segments": self.expandable_segments}


MEGATRON_SCHEDULES = ("1f1b", "interleaved-1f1b")
"""Megatron's pipeline schedules: forward_backward_pipelining_without_interleaving (1F1B) and _with_interleaving."""
DEEPSPEED_PIPELINE = ("its pipeline engine runs one training schedule, 1F1B (runtime/pipe/schedule.py "
                      "TrainSchedule), and refuses ZeRO-2 and 3 beside it (runtime/pipe/engine.py: 'ZeRO-2 and ZeRO-3 "
                      "are incompatible with pipeline parallelism'); its sequence parallelism is Ulysses' all-to-all "
                      "of heads, not the ring attention the planner prices as cp")

SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("shardwise", "fp32 weights and gradients cast per use by autocast (fp32 residual stream), the head "
           "fused with the loss where it is a plain linear (vocabulary-parallel under TP), selective checkpointing "
           "keeps every matmul output, eager elementwise operators; where FSDP shards, bf16 may run under FSDP2's "
           "mixed-precision policy instead (the plan's bf16 column: parallel.mixed_precision)",
           source="this engine: shardwise.parallel, shardwise.loss.head_loss_sum, "
                  "shardwise.activation_checkpoint, shardwise.parallel.data_parallel.mixed_precision_policy",
           fsdp_replicate=True, partial_checkpoint="first"),
    System("torchtitan", "FSDP2 MixedPrecisionPolicy (fp32 shards, bf16 gathers and compute, fp32 reduction), "
           "bf16 residual stream, materialised logits upcast to fp32 for the loss, loss parallel under TP, "
           "op-level selective checkpointing (every second matmul recomputed), eager elementwise operators (no "
           "torch.compile; with --compile each block and the loss are compiled, the loss one pass over the bf16 "
           "logits)",
           layout="fsdp-mp", fuse_head=False, loss_parallel=True, selective="alternate-matmuls",
           partial_checkpoint="last",
           grad_sync="micro-batch", compile_loss=True, cp_exchange="torch", zero_stages=(0, 2, 3), ddp_alone=True,
           expandable_segments=True, ddp_bucket_view=False,
           source="torchtitan (github.com/pytorch/torchtitan): parallelize_llama.apply_fsdp "
                  "(mp_policy param_dtype bf16, reduce_dtype fp32), apply_ac (op SAC: 'Saves output of all compute "
                  "ops, except every second mm'; selective_ac_option 'k': every k-th of the blocks each process wraps, "
                  "counted from 1), cross_entropy_loss (pred.float()), loss_parallel by default, "
                  "components/loss.py build_cross_entropy_loss (torch.compile(loss_fn) under compile, since "
                  "April 2025: PR 1033), full AC through torch's checkpoint_wrapper (non-reentrant), context "
                  "parallelism through torch's context_parallel (rotate method allgather: PR 728; K and V as the "
                  "model's GQA heads since PR 2259, January 2026), pipeline schedules by name from "
                  "torch.distributed.pipelining (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble among them), "
                  "data parallelism by apply_ddp or apply_fsdp (FSDP or HSDP, fsdp_reshard_after_forward): no "
                  "optimizer-only sharding (ZeRO-1), FSDP wherever dp_shard or cp is, and DDP only alone ('DDP has "
                  "not supported > 1D parallelism', from the benchmarks' 2024 code until PR 2458, March 2026; "
                  "apply_ddp's replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100), whose "
                  "DistributedDataParallel has no gradient_as_bucket_view: a resident copy of the gradients); "
                  "run_train.sh launches with PYTORCH_ALLOC_CONF=expandable_segments:True (run_llama_train.sh "
                  "since October 2024, a5e57e4)"),
    System("megatron-core", "bf16 weights, fp32 main gradients in one contiguous buffer (distributed optimizer = "
           "ZeRO-1), sequence-parallel shards saved, vocab-parallel cross-entropy, fused attention and SwiGLU, "
           "selective recompute of the attention core, the interleaved schedule's steady-state pipeline sends "
           "overlapped, the updated weights gathered behind the next forward (--overlap-param-gather), "
           "--precision fp8 through Transformer Engine",
           layout="megatron", fuse_head=False, loss_parallel=True, selective="attention-core",
           attention_kernel="cudnn",
           elementwise="fused", swiglu="fused", float8="te-delayed", checkpoint_early_stop=False,
           cp_exchange="ring", pp_overlap_p2p=True, overlap_param_gather=True, pp_schedules=MEGATRON_SCHEDULES,
           offload_stages=(), fused_projections=True, moe_layer="megatron-core",
           source="Megatron-LM / Megatron-Core (github.com/NVIDIA/Megatron-LM): DistributedDataParallel grad "
                  "buffer, --recompute-granularity selective (core_attn), vocab_parallel_cross_entropy, "
                  "--overlap-p2p-communication (on by default under the interleaved schedule), "
                  "--overlap-param-gather (as its README's scaling runs and NeMo's recipes set it: "
                  "distributed/param_and_grad_buffer.py finish_param_sync), "
                  "fusions/fused_bias_swiglu.py (SwiGLUFunction saves its input; --bias-swiglu-fusion is on by "
                  "default), extensions/transformer_engine.py (TE linears told is_first_microbatch: float8 "
                  "weights cached over a step), --fp8-recipe delayed by default; pipeline_parallel/schedules.py "
                  "(1F1B without interleaving, or interleaved: no GPipe, no zero-bubble schedule); host offload of "
                  "the optimizer alone (--optimizer-cpu-offload, February 2025), not of weights and gradients; "
                  "transformer/attention.py linear_qkv and mlp.py linear_fc1 (Q/K/V one linear, SwiGLU's gate and "
                  "up one: NeMo's LoRA adapts each with one adapter, LoraKQVAdapter on linear_qkv); "
                  "core/parallel_state.py (expert parallelism drawn from the data-parallel ranks, each expert's "
                  "gradients reduced and its distributed-optimizer state sharded over its expert-data-parallel "
                  "group)"),
    System("megatron-lm-2021", "Megatron-LM of Narayanan et al. 2021 and Korthikanti et al. 2022: as "
           "megatron-core, with unfused attention (s x s scores in memory), dropout 0.1, and the gradients' "
           "data-parallel reduction after the backward",
           layout="megatron", fuse_head=False, loss_parallel=True, attention="unfused", dropout=True,
           elementwise="fused", checkpoint_early_stop=False,
           selective="attention-core", cp_exchange="ring", pp_schedules=MEGATRON_SCHEDULES, context_parallel=False,
           overlap_grad_reduce=False,
           zero_stages=(0, 1), offload_stages=(), expert_parallel=False,
           source="Narayanan et al. 2021 (arXiv 2104.04473); Korthikanti et al. 2022 (arXiv 2205.05198), "
                  "section 4 (context parallelism came later, with Megatron-Core's --context-parallel-size; data "
                  "parallelism: DDP, or the distributed optimizer of 2022 as ZeRO-1; Megatron's FSDP came in 2025; "
                  "its mixtures of experts came with Megatron-Core); megatron/training.py train_step (May 2022): "
                  "allreduce_gradients after forward_backward_func, --overlap-grad-reduce only from September "
                  "2023; NeMo 1's Megatron GPT of 2022 runs this code through apex.transformer (its own "
                  "reduction after the backward in v1.7-v1.9, and from v1.10 under a pipeline, v1.11 under "
                  "sequence parallelism too)"),
    System("llm-foundry", "FSDP (FSDP1) with mixed precision DEFAULT: fp32 shards, bf16 gathers and compute, fp32 "
           "reduction (Composer 0.17 on; reduce_dtype bf16 for PURE or Composer 0.14-0.16); bf16 residual stream; "
           "logits materialised in bf16 and flash-attn's cross-entropy kernel; FlashAttention-1 (flash-attn 1.0.9, "
           "its [gpu] extra at v0.3.0, which its benchmarks installed); Composer's DecoupledAdamW, a pass per "
           "operation",
           layout="fsdp-mp", fuse_head=False, ce_kernel=True, grad_sync="micro-batch", selective="attention-core",
           elementwise="fused", flat_params=True, optimizer_passes="per-op",
           attention_kernel="flash1", cp_exchange="ring", pp_schedules=(), tensor_parallel=False,
           context_parallel=False, zero_stages=(0, 2, 3),
           source="llm-foundry (github.com/mosaicml/llm-foundry): fsdp_config mixed_precision DEFAULT/PURE, "
                  "loss_fn fused_crossentropy (flash_attn.losses.cross_entropy), attn_impl flash; Composer's FSDP is "
                  "torch's FullyShardedDataParallel (FSDP1: flat parameters); setup.py at "
                  "v0.3.0: flash-attn==1.0.9; scripts/train/benchmarking/submit_benchmarks.py (#543): "
                  "pip_install -e .[gpu]; yamls/pretrain/mpt-*.yaml: activation_checkpointing_reentrant false, "
                  "optimizer decoupled_adamw and gradient_clipping norm (composer/optim/decoupled_weight_decay.py, "
                  "v0.14-0.17) "
                  "(torch 2.1 images from October 2023, #648; setup.py torch>=2.1 at the January 2024 tables, #838); "
                  "data parallelism only: no pipeline or context parallelism, and its tensor parallelism (tp_config, "
                  "llmfoundry/tp, #1521 of September 2024) shards the MLP alone, not the planner's tp; FSDP's "
                  "sharding strategies NO_SHARD, SHARD_GRAD_OP and FULL_SHARD (HYBRID_SHARD over replicas): no "
                  "ZeRO-1"),
    System("torchtune", "the model in bf16 and trained so (dtype bf16: weights, gradients and AdamW's moments in "
           "bf16, no fp32 copy, no autocast), FSDP2 with no mixed-precision policy where it shards (gathers and "
           "reductions in bf16), bf16 residual stream, its RMSNorm composite in fp32, the logits materialised in "
           "bf16 chunks for CEWithChunkedOutputLoss (compiled with the layers under --compile), whole-layer "
           "checkpointing only (no op-level selective), eager elementwise operators, torch's fused AdamW",
           layout="fsdp-mp", state_dtype="bf16", reduce_dtype="bf16", fuse_head=False, grad_sync="micro-batch",
           compile_loss=True, fused_rmsnorm=False, loss_chunks=8, cp_exchange="torch", selective="none",
           pp_schedules=(), zero_stages=(2, 3), tensor_parallel=False, context_parallel=False, hsdp_stages=(),
           expert_parallel=False,
           source="torchtune (github.com/pytorch/torchtune, v0.4-v0.6): recipes/full_finetune_single_device.py and "
                  "full_finetune_distributed.py (the model built under training.set_default_dtype(dtype), dtype: "
                  "bf16 in every config; fully_shard without a MixedPrecisionPolicy; training.compile_model "
                  "compiles each layer and training.compile_loss the loss), modules/rms_norm.py (x.float(), rsqrt, "
                  "type_as), modules/loss/ce_chunked_output_loss.py (8 chunks, each upcast in the loss), "
                  "training/activations.py (checkpoint_wrapper per layer, non-reentrant; its ac_mode 'selective' "
                  "wraps every k-th layer whole, no op-level policy: selective none), "
                  "training/_activation_offloading.py (enable_activation_offloading, off by default), the configs' "
                  "optimizer torch.optim.AdamW with fused: True; data parallelism only in those releases: no "
                  "pipeline in its recipes, its tensor_parallel_dim (v0.6) refused beside the fused optimizer "
                  "('Tensor parallelism is currently incompatible with fused optimizer') and without sequence "
                  "parallelism (BASE_LLAMA_TP_PLAN), context_parallel_dim only after v0.6.1 (PR 2668, May 2025); its "
                  "distributed recipes shard with FSDP2 (fsdp_reshard_after_forward: ZeRO-3, or 2 set False) over "
                  "every data-parallel rank, no DDP, no hybrid sharding (PR 2415, after v0.6.1); no expert "
                  "parallelism (its first mixture of experts, Llama 4, PR 2570, April 2025, splits experts by "
                  "tensor parallelism: ExpertTensorParallel)"),
    System("deepspeed", "DeepSpeed ZeRO: bf16 weights and gradients, fp32 master weights and moments in the "
           "optimizer, contiguous gradient buckets of 5e8 elements (below ZeRO-3 the reduction hidden only with "
           "overlap_comm, off by default), materialised logits and an fp32 loss, fused attention",
           layout="zero", fuse_head=False, grad_sync="micro-batch", selective="attention-core",
           elementwise="fused", checkpoint_early_stop=False, cp_exchange="ring", reduce_bucket_size=5e8,
           pp_schedules=("1f1b",), pp_zero_max=1, context_parallel=False, hsdp_stages=(3,), offload_stages=(3,),
           zero3_grads_at_start=True,
           source="Rajbhandari et al. 2020, ZeRO (arXiv 1910.02054), section 3: 2 + 2 + K bytes per parameter; "
                  "DeepSpeed's zero/config.py defaults (reduce_bucket_size 5e8, contiguous_gradients true, "
                  "overlap_comm only at stage 3), stage3.py and stage_1_and_2.py ipg buckets, stage3.py's "
                  "gradient partitions allocated at start; " + DEEPSPEED_PIPELINE
                  + "; tensor parallelism from Megatron's mpu (Megatron-DeepSpeed) or AutoTP training "
                  "(runtime/tensor_parallel, PR 7004, February 2025); hybrid sharding for ZeRO-3 only (MiCS: "
                  "runtime/zero/mics.py, April 2023); the weights offloaded at ZeRO-3 only (offload_param; ZeRO-2 "
                  "offloads the optimizer)"),
    System("deepspeed-2021", "DeepSpeed's first ZeRO-3 (v0.3.13, March 2021) on Megatron's GPT: as deepspeed, "
           "with weights fetched module by module with a device synchronisation before each, gathered again for "
           "a recomputed forward, unfused attention and dropout 0.1",
           layout="zero", fuse_head=False, loss_parallel=True, attention="unfused", dropout=True,
           grad_sync="micro-batch", elementwise="fused", zero3_fetch="module-sync", checkpoint_early_stop=False,
           cp_exchange="ring", pp_schedules=("1f1b",), pp_zero_max=1, context_parallel=False, hsdp_stages=(),
           offload_stages=(3,), expert_parallel=False,
           source="DeepSpeed v0.3.13 (github.com/microsoft/DeepSpeed): deepspeed/runtime/zero/stage3.py "
                  "PartitionedParameterCoordinator, partition_parameters.py _allgather_param, zero/constants.py "
                  "defaults; Narayanan et al. 2021 (arXiv 2104.04473), table 2; its pipeline engine ran 1F1B "
                  "(runtime/pipe/schedule.py TrainSchedule) beside ZeRO-1: of ZeRO-2 its code says 'enough to run a "
                  "demo', and v0.3.16 (PR 980, April 2021) refuses ZeRO-2 and 3 beside a pipeline; tensor "
                  "parallelism from Megatron's mpu; no sequence or context parallelism, nor hybrid sharding, in "
                  "2021; ZeRO-3 Offload of the weights too (zero/constants.py cpu_offload_params, v0.3.13); "
                  "DeepSpeed-MoE's expert parallelism came later in 2021"),
)}


def resolve_system(spec: str | System) -> System:
    """A preset name, a System, or a TOML file describing one."""
    if isinstance(spec, System):
        return spec
    if spec in SYSTEMS:
        return SYSTEMS[spec]
    path = Path(spec)
    if path.suffix != ".toml" or not path.is_file():
        raise PlannerError("--system", f"{spec!r} is neither a system nor a TOML file",
                           f"use one of {', '.join(SYSTEMS)}, or a TOML file (docs/planner.md, 'Systems')")
    try:
        table = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise PlannerError("--system", f"{path}: {e}", "fix the TOML syntax") from None
    base_name = table.pop("base", "shardwise")
    if not isinstance(base_name, str) or base_name not in SYSTEMS:
        raise PlannerError(f"--system {path} base", f"unknown system {base_name!r}", f"use one of {', '.join(SYSTEMS)}")
    fields = [f.name for f in dataclasses.fields(System) if f.name not in ("name", "summary", "source")]
    for key, value in table.items():
        if key not in fields:
            raise PlannerError(f"--system {path}", f"unknown key {key!r} (the file's name names the system)",
                               f"use base or {', '.join(fields)}")
        expected = bool if key in ("fuse_head", "loss_parallel", "dropout", "ce_kernel", "compile", "compile_loss",
                                   "checkpoint_early_stop", "cp_repeats_kv", "distribute_checkpoints",
                                   "keeps_bf16_grads", "bf16_grad_transients", "zero1_all_reduce", "grads_in_fp32",
                                   "ddp_bucket_view", "ce_shift_in_place", "pp_overlap_p2p", "overlap_param_gather",
                                   "overlap_grad_reduce", "overlap_comm", "flat_params", "fused_rmsnorm",
                                   "fused_projections", "activation_fp8_input", "activation_offload",
                                   "optimizer_in_backward", "tensor_parallel", "context_parallel", "ddp_alone",
                                   "fsdp_replicate", "zero3_grads_at_start", "expert_parallel", "ep_overlap",
                                   "expandable_segments") else \
            float if key == "reduce_bucket_size" else \
            int if key in ("loss_chunks", "pp_zero_max", "offload_layers") else \
            list if key in ("pp_schedules", "zero_stages", "hsdp_stages", "offload_stages") else str
        if type(value) is not expected and not (expected is float and type(value) is int):
            raise PlannerError(f"--system {path} {key}", f"{value!r} is not a {expected.__name__}",
                               f"give {key} a {expected.__name__}")
    for key in ("pp_schedules", "zero_stages", "hsdp_stages", "offload_stages"):  # TOML arrays, kept as tuples
        if key in table:
            table[key] = tuple(table[key])
    if path.stem in SYSTEMS:
        raise PlannerError(f"--system {path}", f"the file is named like the preset {path.stem!r}",
                           "rename the file: a plan says which system it was sized for by this name")
    changed = ", ".join(f"{k} = {v}" for k, v in table.items()) or "nothing changed"
    return dataclasses.replace(SYSTEMS[base_name], name=path.stem, summary=f"{base_name}, {changed}",
                               source=str(path), **table)
