"""The planner against published large-scale training runs: the layout as given (`--plan`), and the search.

    python benchmarks/planner_published.py [--no-nccl-sms]

--no-nccl-sms leaves out the SMs NCCL's kernels hold while a hidden collective runs (Accelerator.nccl_channels, the
channel counts of NCCL's init logs: hardware.NCCL_BOARD_CHANNELS), which the catalogue prices since 2026-12-05
(docs/planner.md, "NCCL's SMs"): the run the figures before that date come from.

For each published run: the planner's step time for the layout the source states (knobs the source does not state
are completed by the search: the fastest completion that fits), its throughput in the source's own FLOP
definition and its MFU (model FLOPs), next to the published figures, with the ratio predicted/published of
throughput (= published/predicted step time: above 1 the planner is optimistic); its peak memory per GPU and
whether that fits, next to whether the run fitted; then the fastest plan the search finds for the same job.

Every figure below was read in a stored copy of the source named next to it (URL given). Nothing is fitted:
the planner runs with its catalogue hardware (datasheet peaks, stated efficiencies).

Model mapping. The GPT-style models (Megatron-LM's, BLOOM, MPT) have a GELU MLP of inner size 4h and multi-head
attention: they are described as such (ModelArgs(mlp="gelu", ffn_hidden=4h, n_kv_heads=n_heads), tied embedding),
so that their parameters, FLOPs and saved activations are the GPT block's: the planner's training FLOPs per token,
6 N + 12 l h s with N = 12 l h^2 + V h (tied head counted once), equal Korthikanti et al.'s eq. 7, 72 B s l h^2 (1 +
s/(6h) + V/(12 l h)) per B s tokens (checked and printed below), and its activations per layer their table 2
(tests/test_planner_system.py). Not mapped: biases, learned position embeddings (BLOOM and MPT: ALiBi or learned),
LayerNorm vs RMSNorm (the same tensors kept, one more statistic).

FLOP definitions. Narayanan et al. (2021) report "achieved teraFLOP/s" from their eq. 3, 96 B s l h^2 (1 + s/(6h)
+ V/(16 l h)), which counts the recomputation forward (4 passes over the blocks, 3 over the logit layer): that is
hardware FLOPs, 4/3 of model FLOPs for the blocks. BLOOM's log prints "TFLOPs" with the 4*2 (recompute)
coefficient likewise. Korthikanti et al. (2022) and Llama 3 (Dubey et al. 2024, after PaLM) report MFU in model
FLOPs, the planner's `mfu`. So each run's published step time is either measured (Korthikanti table 5, BLOOM's
log) or implied by its throughput and its own FLOP formula; the predicted throughput in the source's definition
is published throughput x published time / predicted time, and the predicted MFU is the planner's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shardwise.hardware import GiB
from shardwise.layout import parse_layout
from shardwise.model_args import PROJECTIONS, ModelArgs, flops_per_token, num_params, preset
from shardwise.planner import Cluster, Plan, PlannerError, Training, accelerator, evaluate, search, timing
from shardwise.planner.memory import reserved_bytes
from shardwise.planner.search import Evaluation
from shardwise.planner.system import resolve_system

NARAYANAN = ("Narayanan et al. 2021, Efficient Large-Scale LM Training on GPU Clusters Using Megatron-LM, "
             "https://arxiv.org/abs/2104.04473")
KORTHIKANTI = ("Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models, "
               "https://arxiv.org/abs/2205.05198")
LLAMA3 = "Dubey et al. 2024, The Llama 3 Herd of Models, https://arxiv.org/abs/2407.21783"
BLOOM = ("BigScience tr11-176B-ml training README, "
         "https://github.com/bigscience-workshop/bigscience/blob/master/train/tr11-176B-ml/README.md")


def gpt(name: str, h: int, a: int, l: int, vocab: int = 51200, seq: int = 2048, tied: bool = True) -> ModelArgs:
    """A GPT-3-style model: GELU MLP of 4h, multi-head attention, tied embedding (see the docstring)."""
    return ModelArgs(name=name, dim=h, n_heads=a, n_kv_heads=a, n_layers=l, vocab_size=vocab,
                     ffn_hidden=4 * h, mlp="gelu", max_seq_len=seq, tie_embeddings=tied)


def eq3_flops(args: ModelArgs, batch: int, seq: int) -> float:
    """Narayanan et al. eq. 3 (with recomputation): FLOPs per iteration."""
    h, l, v = args.dim, args.n_layers, args.vocab_size
    return 96 * batch * seq * l * h * h * (1 + seq / (6 * h) + v / (16 * l * h))


def eq7_flops(args: ModelArgs, batch: int, seq: int) -> float:
    """Korthikanti et al. eq. 7: model FLOPs per iteration (no recomputation)."""
    h, l, v = args.dim, args.n_layers, args.vocab_size
    return 72 * batch * seq * l * h * h * (1 + seq / (6 * h) + v / (12 * l * h))


@dataclass
class Run:
    name: str
    model: ModelArgs
    gpus: int
    seq: int
    batch: int
    """Global batch in sequences."""
    plan: str
    """The knobs the source states (--plan syntax); the search completes the rest."""
    source: str
    quote: str
    """Where in the source, and the figures as printed there."""
    tflops: float | None = None
    """Published throughput per GPU, in the source's FLOP definition (`flops`)."""
    step_s: float | None = None
    """Published (measured) seconds per iteration, where the source gives one."""
    mfu: float | None = None
    """Published MFU (model FLOPs), where the source prints one."""
    flops: str = "model"
    """'eq3': Narayanan eq. 3 (hardware FLOPs incl. recompute); 'model': model FLOPs (eq. 7 / PaLM); 'bloom':
    BLOOM's own hardware-FLOP count (only with a measured step time)."""
    fitted: bool = True
    """Whether the run fitted in memory (False: the source reports it did not)."""
    gpu: str = "a100-80gb"
    layout: str = "megatron"
    inter_node_gbs: float | None = None
    """Per-GPU network bandwidth, GB/s per direction, where the cluster differs from the catalogue's."""
    gpus_per_node: int = 8
    """GPUs sharing the fast link (the NVLink domain): 8 but on a GB200 NVL72 rack."""
    search: bool = True
    """Also run the free search for this job (once per distinct job)."""
    system: str | None = None
    """The system that ran it (shardwise.planner.system), where it is one of the planner's presets; None: the
    layout and attention fields below describe it (the 2021-22 rows and Llama 3, whose stacks are Megatron-LM of
    its time, DeepSpeed and Meta's own)."""
    mem_gib: float | None = None
    """Published peak memory per GPU, GiB, where the source gives one."""
    gpu_memory_gib: float | None = None
    mem_bandwidth_tbs: float | None = None
    """Device memory and its bandwidth, where the source's GPU differs from the catalogue's."""
    peak_tflops: float | None = None
    """Dense bf16 peak, TFLOP/s, where the source's GPU runs below the catalogue's (a lower power limit); every
    dtype's peak is scaled by the same share."""
    fused_attention: bool = False
    """Megatron-LM (2021-22) and BLOOM ran attention unfused (batched GEMMs, a fused scale + mask + softmax kernel:
    Training.fused_attention) with Megatron's default dropout of 0.1 (BLOOM's README: "The default Megatron-LM
    dropout settings are inherited"; Korthikanti et al. count its masks); Llama 3 a fused kernel, no dropout."""
    compile: bool = False
    """Each block compiled with torch.compile (Training.compile), where the source says so."""
    compile_loss: bool | None = None
    """Whether the system compiled its loss with the blocks (Training.compile_loss), where its code of the time
    differs from the system's preset (torchtitan before April 2025: not)."""
    cp_repeats_kv: bool | None = None
    """Whether context parallelism carried K and V repeated to every query head (Training.cp_repeats_kv), where its
    code of the time differs from the system's preset (torchtitan before January 2026: it did)."""
    precision: str = "bf16"
    """The matmul precision (Training.precision): fp8 for torchao's float8 training of the blocks' linears."""
    attention_kernel: str | None = None
    """The fused attention kernel (Training.attention_kernel), where the run's differs from its system's (the
    FlashAttention column of FlashAttention-2's table: flash1; NVIDIA's NeMo runs of 2023-24 whose launch scripts
    turned Transformer Engine's cuDNN attention off: flash2, NEMO_FLASH_ATTN) or a row described field by field
    states one."""
    fused_rmsnorm: bool = True
    """Whether torch.nn.RMSNorm ran as torch's fused kernel (Training.fused_rmsnorm): on a GPU since torch 2.8
    (pytorch/pytorch PR 153666, May 2025); before that its composite form, several eager passes."""
    float8: str | None = None
    """The float8 recipe (Training.float8), where it is not the system's default (NeMo's FP8-CS: te-current)."""
    grads_in_fp32: bool | None = None
    """Megatron's main gradients in fp32 (Training.grads_in_fp32), where the run's code differs from the system's
    preset (NeMo 2's performance recipes, and NeMo 1's where Apex's distributed Adam ran grad_sync_dtype bf16:
    bf16)."""
    optimizer_dtype: str | None = None
    """AdamW's state in bf16 as Apex's distributed Adam keeps it (Training.optimizer_dtype), where the run's config
    sets it (NeMo 1's Nemotron-4 340B configs: optim.dtype bf16)."""
    reduce_dtype: str | None = None
    """FSDP's gradient reduction in the compute dtype (Training.reduce_dtype), where the run's code differs from the
    system's preset (llm-foundry's PURE, and its DEFAULT under Composer 0.14-0.16; metaseq's OPT, fp16)."""
    optimizer_passes: str | None = None
    """The optimizer step a pass per operation (Training.optimizer_passes), where the run's code differs from the
    system's preset (torchtitan's foreach AdamW before February 2025)."""
    dropout: bool | None = None
    """Megatron's dropout of 0.1 (Training.dropout), where the run's config differs from the system's preset (NeMo's
    GPT-3 175B config)."""
    overlap_grad_reduce: bool | None = None
    """The gradients' data-parallel reduction during the backward (Training.overlap_grad_reduce), where the run's code
    differs from the system's preset, or (rows described field by field) False where it ran after the backward:
    DeepSpeed's pipeline engine (ReduceGrads after the schedule's last backward: BLOOM, MT-NLG); None: the
    preset's, or True."""
    distribute_checkpoints: bool = False
    """Megatron's --distribute-checkpointed-activations (Training.distribute_checkpoints), where the source ran it."""
    keeps_bf16_grads: bool = False
    """DeepSpeed's BF16_Optimizer keeping the bf16 gradients (Training.keeps_bf16_grads), where the run used it."""
    pipeline_split: str = "cost"
    """How the run cut its pipeline stages (Training.pipeline_split): 'slots' for DeepSpeed's partition over
    `type:transformer|embedding`."""
    embedding_norm: bool = False
    """A LayerNorm on the embedding's output (Training.embedding_norm: BLOOM's)."""
    offload: str | None = None
    """What the run kept in host memory (Plan.offload) where shardwise's engine cannot (DeepSpeed's ZeRO-Offload of
    the optimizer, 'optimizer'): the search does not offer it, so the completed plan is priced with it."""
    fixed_overhead_gib: float = Training.fixed_overhead_gib
    """The CUDA context and libraries (Training.fixed_overhead_gib): the planner's default, or what the source
    measured."""
    loss_chunks: int | None = None
    """The loss over chunks of the logits (Training.loss_chunks), where the run's loss differs from the system's
    preset (torchtune's rows before its chunked cross-entropy: 1)."""
    activation_offload: bool = False
    """The blocks' saved inputs offloaded to the host (Training.activation_offload), where the run did."""
    offload_layers: int = 0
    """Megatron-Core's CPU offloading of the first this many blocks' activations (Training.offload_layers:
    cpu_offloading_num_layers), where the run's recipe set it."""
    optimizer_in_backward: bool = False
    """Each parameter stepped in backward (Training.optimizer_in_backward), where the run did."""
    expandable_segments: bool | None = None
    """torch's allocator with expandable segments (Training.expandable_segments), where the run's launcher differs
    from its system's preset; None: the preset's."""
    activation_fp8_input: bool = False
    """Megatron-Core's fused SwiGLU keeping its input in float8 (Training.activation_fp8_input), where the run's
    config set activation_func_fp8_input_store."""
    lora_rank: int = 0
    qlora: bool = False
    lora_targets: tuple[str, ...] = PROJECTIONS
    lora_dropout: float = 0.0
    """LoRA (Training.lora_rank, qlora, lora_targets, lora_dropout), where the run fine-tuned adapters."""
    expert_imbalance: float = 0.0
    """A mixture of experts' routed tokens on the busiest ep rank over the mean (Training.expert_imbalance), where
    the source states its routing (AutoModel's fake_balanced_gate: 1.0); 0: the planner's untrained router."""
    dispatch_ranks: float = 0.0
    """Under DeepEP's dispatch, the ep ranks a token goes to (Training.dispatch_ranks), where the source's routing
    fixes it (AutoModel's fake_balanced_gate: 1); 0: derived for uniform routing."""
    ep_overlap: bool = False
    """Megatron-Core's all-to-all overlap (Training.ep_overlap), where the run's recipe set it."""
    cp_exchange: str | None = None
    """How context parallelism moves K and V (Training.cp_exchange), where the run's recipe differs from its system's
    (Transformer Engine's cp_comm_type a2a: 'a2a')."""
    mem_counts: Literal["device", "reserved", "active"] = "device"
    """What the published peak counts: 'device', the device's whole use (nvidia-smi's, with the CUDA context),
    compared with the planner's total; 'reserved', torch's max_memory_reserved (what its caching allocator holds),
    compared with memory.reserved_bytes (no CUDA context or NCCL buffers; FSDP2's gradient shards cached in its
    reduce-scatter stream); 'active', torch's active bytes (memory_stats "active_bytes.all.peak": what tensors
    hold), compared with the planner's total less its fragmentation allowance and fixed overhead."""

    def published_step(self) -> float:
        """Measured, or implied by the published throughput and the source's FLOP formula."""
        if self.step_s is not None:
            return self.step_s
        flops = eq3_flops(self.model, self.batch, self.seq) if self.flops == "eq3" else \
            flops_per_token(self.model, self.seq) * self.batch * self.seq
        return flops / (self.tflops * 1e12 * self.gpus)


# --------------------------------------------------------------------------------------------------
# Narayanan et al. 2021, table 1 (weak scaling; A100 80GB, Selene: 8 GPUs/node, 8x HDR 200 Gb/s per node;
# V = 51,200, s = 2048; "we use the interleaved pipeline schedule with the scatter/gather optimization enabled"
# (sec. 5.1); eq. 3 "assumes activation recomputation"). Row: params (B), heads, hidden, layers, tp, pp, GPUs,
# batch, achieved teraFLOP/s per GPU, % of peak. Micro-batch and virtual stages are not given: the search
# picks them. Sequence parallelism postdates the paper: off. No distributed optimizer in 2021: ZeRO-0.
# The scatter/gather optimization (sec. 4.1: pipeline sends "reduced to bsh/t") is what the planner's
# 'megatron' layout prices for pipeline sends without sequence parallelism. The gradients' data-parallel reduction
# is priced behind the backward (overlap_grad_reduce, the default), here and in Korthikanti's rows, though
# Megatron-LM's default of the time (--DDP-impl local) all-reduced after it (train_step: allreduce_gradients after
# forward_backward_func; the system 'megatron-lm-2021' prices that): the papers state neither the DDP
# implementation nor the precision (fp16 main gradients reduce half fp32's bytes), and priced after the backward
# table 1's four smallest rows move from 0.94-1.00 to 0.89-0.92 in fp32 and 0.93-0.96 in fp16. Left as it was
# until the runs' settings are known (docs/planner.md, "Gradients reduced after the backward").
T1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
      (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
      (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
      (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
      (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52)]

GPT3 = gpt("gpt3-175b", 12288, 96, 96)  # "GPT-3 model with 175 billion parameters (96 layers, 96 attention heads,
MT530 = gpt("gpt-530b", 20480, 128, 105)  # hidden size of 12288)" (5.3.2); 530B: table 1 row 529.6


def narayanan_runs() -> list[Run]:
    runs = []
    for p, a, h, l, tp, pp, n, batch, x, pct in T1:
        dp = n // (tp * pp)
        knobs = f"tp={tp},pp={pp},cp=1,dp_replicate={dp},zero_stage=0,activation_checkpoint=full"
        knobs += ",sequence_parallel=false" if tp > 1 else ""
        knobs += ",pp_schedule=interleaved-1f1b" if pp > 1 else ""
        runs.append(Run(f"N21 T1 {p}B n={n}", gpt(f"gpt-{p}b", h, a, l), n, 2048, batch, knobs, NARAYANAN,
                        f"table 1 row: {p} | {a} | {h} | {l} | {tp} | {pp} | {n} | {batch} | {x} | {pct}%",
                        tflops=x, flops="eq3", search=p not in (3.6, 7.5)))  # (runtime: under a minute)
    # Table 2 (PTD-P vs ZeRO-3, "global batch sizes are fixed"): model-parallel size 96 (175B) and 280 (530B),
    # micro-batch 1. The tp/pp split is not printed: tp = 8 ("For large enough models, we use a
    # tensor-model-parallel size of 8", 4.1), so pp = 12 and 35 (530B: table 1's 8 x 35). Schedule as in 5.1.
    for model, mp, pp, batch, rows in ((GPT3, 96, 12, 1536, ((384, 153), (768, 149), (1536, 141))),
                                       (MT530, 280, 35, 2240, ((560, 171), (1120, 167), (2240, 159)))):
        for n, x in rows:
            dp = n // mp
            runs.append(Run(f"N21 T2 PTD {model.name} n={n}", model, n, 2048, batch,
                            f"tp=8,pp={pp},cp=1,dp_replicate={dp},zero_stage=0,micro_batch=1,activation_checkpoint=full,"
                            f"sequence_parallel=false,pp_schedule=interleaved-1f1b", NARAYANAN,
                            f"table 2 PTD row: model-parallel {mp}, batch {batch}, {n} GPUs, microbatch 1, {x} TF/s",
                            tflops=x, flops="eq3", search=False))
    # Table 2, "ZeRO-3 without Model Parallelism" (DeepSpeed of March 2021, the system 'deepspeed-2021': fp16
    # weights+grads, fp32 master+Adam, layout 'zero', whose ZeRO-3 gathers the weights module by module for every
    # micro-batch's forward, recomputed forward and backward and reduce-scatters in every backward); recompute
    # assumed (the teraFLOP/s are eq. 3's, which assumes it). Caption: "The 530-billion-parameter GPT model did not
    # fit on 560 GPUs when using a microbatch size of 4 with ZeRO-3, so we increased the number of GPUs used to 640
    # and global batch size to 2560".
    for model, rows in ((GPT3, ((384, 1536, 4, 144), (768, 1536, 2, 88), (1536, 1536, 1, 44))),
                        (MT530, ((640, 2560, 4, 138), (1120, 2240, 2, 98), (2240, 2240, 1, 48)))):
        for n, batch, mb, x in rows:
            runs.append(Run(f"N21 T2 ZeRO-3 {model.name} n={n}", model, n, 2048, batch,
                            f"tp=1,pp=1,cp=1,dp_shard={n},zero_stage=3,micro_batch={mb},activation_checkpoint=full",
                            NARAYANAN,
                            f"table 2 ZeRO-3 row: batch {batch}, {n} GPUs, microbatch {mb}, {x} TF/s",
                            tflops=x, flops="eq3", system="deepspeed-2021", search=False))
    runs.append(Run(f"N21 T2 ZeRO-3 {MT530.name} n=560 OOM", MT530, 560, 2048, 2240,
                    "tp=1,pp=1,cp=1,dp_shard=560,zero_stage=3,micro_batch=4,activation_checkpoint=full", NARAYANAN,
                    "table 2 caption: did not fit on 560 GPUs with microbatch 4 (batch 2240)", fitted=False,
                    system="deepspeed-2021", search=False))
    return runs


# --------------------------------------------------------------------------------------------------
# Korthikanti et al. 2022: table 3 (configurations: "no data parallelism", tp 8, "interleaving schedule with
# three interleaving stages (m = 3) for the 175B and 530B models", s = 2048, v = 51200, A100 80GB Selene) and
# table 5 (end-to-end iteration time, "Full Recompute" and "Present Work" = sequence parallelism + selective
# recompute, MFU and HFU). Their attention is unfused (their activation count has the 5as/h term of the s x s
# tensors), and their selective recompute recomputes its core (QK^T, softmax, dropout, AV): the planner's
# activation_checkpoint=selective with fused_attention=False. "Present Work" is that with sequence parallelism;
# "Full Recompute" is activation_checkpoint=full without it. The activation-memory claim (sec. 6.1): "Without the
# memory savings
# provided by sequence parallelism and selective recompute together, none of the these models will fit into
# memory" -> tp + selective without SP is an out-of-memory row for each model.
K22 = [("22B", gpt("gpt-22b", 6144, 64, 48), 1, 8, 4, 4, 1, 1.42, 1.10, 0.415, 0.437),
       ("175B", GPT3, 8, 64, 64, 1, 3, 18.13, 13.75, 0.514, 0.528),
       ("530B", MT530, 35, 280, 280, 1, 3, 49.05, 37.83, 0.560, 0.570),
       ("1T", gpt("gpt-1t", 25600, 160, 128), 64, 512, 512, 1, 1, 94.42, 71.49, 0.563, 0.570)]


def korthikanti_runs() -> list[Run]:
    runs = []
    for size, model, pp, n, batch, mb, v, full_s, present_s, mfu, hfu in K22:
        sched = "" if pp == 1 else (",pp_schedule=interleaved-1f1b,virtual_stages=3" if v > 1 else ",pp_schedule=1f1b")
        base = f"tp=8,pp={pp},cp=1,dp_replicate=1,zero_stage=0,micro_batch={mb}{sched}"
        row = (f"table 3: {size} tp 8 pp {pp} GPUs {n} batch {batch} mb {mb}; table 5: {full_s} s full, "
               f"{present_s} s present, MFU {mfu:.1%} HFU {hfu:.1%}")
        runs.append(Run(f"K22 {size} present (SP, sel.)", model, n, 2048, batch,
                        base + ",activation_checkpoint=selective,sequence_parallel=true", KORTHIKANTI, row,
                        step_s=present_s,
                        mfu=mfu, tflops=mfu * 312))
        # the full-recompute baseline: same job, published time only (its model-FLOP TF/s and MFU derived)
        runs.append(Run(f"K22 {size} full recompute", model, n, 2048, batch,
                        base + ",activation_checkpoint=full,sequence_parallel=false", KORTHIKANTI, row, step_s=full_s,
                        tflops=mfu * 312 * present_s / full_s, search=False))
        runs.append(Run(f"K22 {size} tp+sel., no SP: OOM", model, n, 2048, batch,
                        base + ",activation_checkpoint=selective,sequence_parallel=false", KORTHIKANTI,
                        "sec. 6.1: none fit without SP and selective recompute together", fitted=False, search=False))
    runs.append(Run("K22 530B dp=8 (2240 GPUs)", MT530, 2240, 2048, 2240,
                    "tp=8,pp=35,cp=1,dp_replicate=8,zero_stage=0,micro_batch=1,activation_checkpoint=selective,"
                    "sequence_parallel=true,pp_schedule=interleaved-1f1b,virtual_stages=3", KORTHIKANTI,
                    "sec. 6.3: 8-way data parallelism (2240 GPUs), batch x 8: 39.15 s/iteration, MFU 54.2%",
                    step_s=39.15, mfu=0.542, tflops=0.542 * 312, search=False))
    return runs


# --------------------------------------------------------------------------------------------------
# Llama 3 405B, table 4 ("Scaling configurations and MFU for each stage of Llama 3 405B pre-training"): GPUs | TP |
# CP | PP | DP | Seq. Len. | Batch size/DP | Tokens/Batch | TFLOPs/GPU | BF16 MFU. H100 80GB HBM3, 8 GPUs per
# server on NVLink, 400 Gb/s per GPU (RoCE) = the catalogue's h100. DP is FSDP that "shards optimizer states and
# gradients, but for model shards we do not reshard after forward" with "FP32 gradient accumulation ... and
# reduce-scatter gradients in FP32" once per step: with the weights kept through backward, ZeRO-1-like traffic,
# so zero_stage=1. "Interleaved schedule (Narayanan et al., 2021) with V pipeline stages on
# one pipeline rank"; "we could pre-train Llama 3 on sequences of 8K tokens without activation checkpointing".
# Third row: stored copies print DP 4 (one) and 8 (two); 8 x 16 x 16 x 8 = 16,384 GPUs and 131,072 x 16 x 8 =
# 16M tokens, so DP = 8. Its CP is all-gather based, the planner's ring-based. Meta's stack is neither of the
# planner's layouts: both are shown.
def llama3_runs() -> list[Run]:
    runs = []
    rows = [(8192, 1, 64, 8192, 32, 430, 0.43, ",activation_checkpoint=none",
             "8,192 | 8 | 1 | 16 | 64 | 8,192 | 32 | 16M | 430 | 43%"),
            (16384, 1, 128, 8192, 16, 400, 0.41, ",activation_checkpoint=none",
             "16,384 | 8 | 1 | 16 | 128 | 8,192 | 16 | 16M | 400 | 41%"),
            (16384, 16, 8, 131072, 16, 380, 0.38, "", "16,384 | 8 | 16 | 16 | 8 | 131,072 | 16 | 16M | 380 | 38%")]
    for n, cp, dp, seq, per_dp, x, mfu, extra, row in rows:
        for layout in ("torch", "megatron"):
            runs.append(Run(f"Llama3 405B {seq // 1024}K n={n} {layout}", preset("llama3-405b"), n, seq,
                            dp * per_dp, f"tp=8,pp=16,cp={cp},dp_replicate={dp},zero_stage=1,"
                            f"pp_schedule=interleaved-1f1b{extra}", LLAMA3, f"table 4 row: {row}", tflops=x, mfu=mfu,
                            gpu="h100", layout=layout, search=layout == "megatron",
                            fused_attention=True))
    return runs


# --------------------------------------------------------------------------------------------------
# BLOOM 176B (README of the training): h 14336, 70 layers, 112 heads, vocabulary 250,680 (embedding sized
# 250880 x 14336), tied embedding, ALiBi, GELU; "TP=4 PP=12 DP=8 MBS=2", GBS 2048, seq 2048; BF16_Optimizer "implements
# its own ZeRO Stage 1", "accumulates grads in fp32" (layout 'megatron'), and keeps autograd's bf16 gradients beside
# them (DeepSpeed's deepspeed/runtime/bf16_optimizer.py, its stored versions of 2023 on: backward() with
# clear_lp_grads=False, the grads freed only by the next backward: Training.keeps_bf16_grads);
# "--deepspeed-activation-checkpointing";
# DeepSpeed's pipeline (1F1B and GPipe cost the same time in the planner; its TrainSchedule reduces the gradients
# after the last backward, ReduceGrads: overlap_grad_reduce False, here and for MT-NLG); no sequence parallelism
# ("developed after BLOOM was trained", HF blog). Measured: the log line at the end of epoch one, "elapsed time per
# iteration (s): 104.70 | ... global batch size: 2048 | ... TFLOPs: 149.77" (hardware FLOPs, "4*2 co-efficient").
# Hardware: 48 nodes of 8 A100 80GB, "4 OmniPath links" per node; 100 Gb/s each (BLOOM paper, 2211.05100 p. 18,
# as quoted in stored summaries): 400 Gb/s per 8 GPUs = 6.25 GB/s per GPU, a quarter of Selene's.
# Megatron-Turing NLG 530B (Smith et al. 2022, arXiv 2201.11990, sec. 2.4), trained with DeepSpeed's pipeline
# and data parallelism and Megatron's tensor slicing on Selene (DGX A100 80GB, 8 HDR per node, as Narayanan's):
# "8-way tensor-slicing ... 35-way pipeline parallelism ... global batch size 1920 on 280, 350, and 420 DGX A100
# servers, the latency per iteration observed is 60.1, 50.2, and 44.4 seconds respectively. These correspond to
# 126, 121, and 113 TFLOP/s per GPU" (as quoted by llm-analysis's MT-NLG example, which reproduces the FLOPs:
# Narayanan's eq. 3, which assumes full recomputation). The model is Narayanan's 530B (h 20480, 128 heads, 105
# layers: 3 per stage). Not stated, left to the search: micro-batch, ZeRO stage. DeepSpeed's pipeline engine runs
# 1F1B, not interleaved; no sequence parallelism (2021).
MTNLG = ("Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B, "
         "https://arxiv.org/abs/2201.11990, sec. 2.4, as quoted in "
         "https://github.com/cli99/llm-analysis/blob/main/examples/megatron-turing-nlg/README.md")


def mtnlg_runs() -> list[Run]:
    return [Run(f"MT-NLG 530B n={n}", MT530, n, 2048, 1920,
                f"tp=8,pp=35,cp=1,dp_replicate={n // 280},activation_checkpoint=full,sequence_parallel=false,"
                "pp_schedule=1f1b", MTNLG, f"sec. 2.4: {n // 8} DGX A100 servers, batch 1920: {step} s/iteration, "
                f"{x} TFLOP/s per GPU", step_s=step, tflops=x, flops="eq3", search=False, overlap_grad_reduce=False)
            for n, step, x in ((2240, 60.1, 126), (2800, 50.2, 121), (3360, 44.4, 113))]


# BLOOM's search for its layout (bigscience, train/tr11-176B-ml/chronicles-prequel.md, "Rebalancing layers",
# 2022-02-28): the same 48 Jean Zay nodes (384 A100 80GB) and code as BLOOM's run above (Megatron-DeepSpeed, the BF16
# optimizer "just written to accumulate gradients in fp32" with its own ZeRO-1, keeping the bf16 gradients too, as
# above, DeepSpeed's pipeline, full recompute, unfused attention), batch 2,048 x 2,048, vocabulary 250k,
# "--pp-partition-method 'type:transformer|embedding'" (each embedding a block's slot: Training.pipeline_split
# 'slots'), BLOOM's embedding LayerNorm (Training.embedding_norm), the CUDA context the document measured, and the
# BF16 optimizer's two large transients (memory.bf16_optimizer_segments). Each table is one model (hidden x layers)
# under several layouts and head counts: "Sec/it" measured at iteration 2, "Mem" the "max memory used by the first
# (last) nodes" read with nvidia-smi (taken as GiB: nvidia-smi prints MiB, and "67GB" read as thousands of MiB would
# be 2.4% less), "OOM" where it did not fit. Every row of the section's tables is kept. Rows: hidden, layers, dp, tp,
# pp, micro-batch, heads, memory GB (None: OOM), seconds per iteration, TFLOPs as printed.
BLOOM_CONTEXT_GIB = 1573 / 1024
"""The CUDA context as the same document measured it on an A100 ("40GB A100 takes 1573MiB for cuda kernels")."""
BLOOM_PREQUEL = ("bigscience, train/tr11-176B-ml/chronicles-prequel.md, \"Rebalancing layers\", "
                 "https://github.com/bigscience-workshop/bigscience/blob/master/train/tr11-176B-ml/chronicles-prequel.md")
BLOOM_PREQUEL_ROWS = [
    (12288, 106, 8, 4, 12, 2, 64, 67, 116.54, 149.75), (12288, 106, 8, 4, 12, 2, 96, 65, 118.79, 146.90),
    (12288, 106, 8, 4, 12, 2, 128, 67, 121.42, 143.73), (12288, 106, 8, 4, 12, 4, 96, 79, 120.34, 145.01),
    (12288, 100, 16, 4, 6, 2, 64, None, None, None), (12288, 100, 16, 4, 6, 1, 64, None, None, None),
    (12288, 100, 8, 8, 6, 2, 64, 61, 139.72, 117.91), (12288, 100, 8, 8, 6, 4, 64, 72, 120.96, 136.20),
    (13312, 82, 4, 8, 12, 4, 64, 52, 111.79, 141.76), (13312, 82, 8, 4, 12, 2, 64, 63, 104.45, 151.71),
    (13312, 82, 8, 4, 12, 2, 104, 62, 123.71, 128.10), (13312, 82, 8, 4, 12, 2, 128, 60, 108.78, 145.68),
    (13312, 82, 8, 4, 12, 4, 64, 74, 104.82, 151.18), (13312, 94, 8, 4, 12, 2, 128, 67, 124.10, 146.12),
    (14336, 70, 4, 8, 12, 2, 64, 40, 121.63, 128.92), (14336, 70, 8, 4, 12, 2, 64, 59, 102.03, 153.68),
    (14336, 70, 8, 4, 12, 2, 112, 59, 104.50, 150.05), (14336, 70, 8, 4, 12, 2, 128, 60, 105.89, 148.08),
    (14336, 70, 8, 4, 12, 4, 64, 73, 102.27, 153.33), (14336, 82, 8, 4, 12, 2, 128, None, None, None)]


def bloom_prequel_runs() -> list[Run]:
    runs = []
    for h, l, dp, tp, pp, mb, heads, mem, sec, tflops in BLOOM_PREQUEL_ROWS:
        model = gpt(f"bloom-{h}x{l}", h, heads, l, vocab=250880)
        runs.append(Run(f"BigScience {h}x{l} a{heads} d{dp} t{tp} p{pp} mb{mb}" + ("" if sec else " OOM"), model,
                        384, 2048, 2048,
                        f"tp={tp},pp={pp},cp=1,dp_replicate={dp},zero_stage=1,micro_batch={mb},"
                        "activation_checkpoint=full,sequence_parallel=false,pp_schedule=1f1b", BLOOM_PREQUEL,
                        f"NHIDDEN={h} NLAYERS={l}: DP {dp} TP {tp} PP {pp} MBS {mb} NHEADS {heads} | "
                        + (f"{mem}GB | {sec} s/it | {tflops} TFLOPs" if sec else "OOM"),
                        step_s=sec, tflops=tflops, flops="bloom", fitted=sec is not None,
                        mem_gib=mem, inter_node_gbs=400 / 8 / 8, keeps_bf16_grads=True, search=False,
                        pipeline_split="slots", embedding_norm=True, fixed_overhead_gib=BLOOM_CONTEXT_GIB,
                        overlap_grad_reduce=False))
    return runs


# OPT-175B (Zhang et al. 2022, arXiv 2205.01068): "We trained OPT-175B on 992 80GB A100 GPUs, by utilizing Fully
# Sharded Data Parallel ... with Megatron-LM Tensor Parallelism ... We achieve utilization of up to 147 TFLOP/s per
# GPU. We keep Adam state in FP32, since we shard it across all hosts, while the model weights remained in FP16"
# (sec. 2.4); 96 layers, 96 heads, d 12288, batch 2M tokens (table 1), sequence 2048, dropout 0.1 but not on the
# embeddings (sec. 2.2). The team's chronicle of the run (metaseq, projects/OPT/chronicles/10_percent_update.md,
# November 2021): "8x Tensor Parallelism", "Batch-size of 2M", and "we need 33 days to fully train at this scale with
# 1024 80GB A100s" for 300B tokens: 102.7 tokens/s per GPU, which is 147.3 TFLOP/s per GPU in Narayanan's eq. 3 (with
# recomputation): the paper's 147 is that count. How it ran, from metaseq's launcher (metaseq/launcher/
# opt_baselines.py): --memory-efficient-fp16 (fp16 weights and gradients, fp32 Adam state), --ddp-backend
# fully_sharded (fairscale's FSDP: a unit per layer, each gathered on its own stream in its forward, so behind the
# previous layer's compute: the planner's FSDP units, layout 'fsdp-mp', which also gathers 2-byte weights; its fp32
# shards are not metaseq's, memory is not compared; its reduce-scatter is fp16, metaseq's FSDP being fairscale's
# without mixed_precision or fp32_reduce_scatter under --memory-efficient-fp16: reduce_dtype fp16, since
# 2026-12-05) with --no-reshard-after-forward (ZeRO-2: the
# gathered weights kept through backward), --checkpoint-activations with
# --distribute-checkpointed-activations, vocab-parallel cross-entropy, tied embedding, dropout and attention dropout
# 0.1, one micro-batch a step (--update-freq 1) of (batch // data-parallel ranks) // 2048 sequences: 8 of 124
# ranks, 992 in all. Attention of 2021: Megatron's unfused kernels (FlashAttention came in 2022). Not mapped: ReLU
# for GELU (the same FLOPs), learned positions. On Azure's A100 80GB nodes (8 HDR 200 Gb/s, as the catalogue's).
OPT = ("Zhang et al. 2022, OPT: Open Pre-trained Transformer Language Models, https://arxiv.org/abs/2205.01068, "
       "sec. 2.4; metaseq, projects/OPT/chronicles/10_percent_update.md and metaseq/launcher/opt_baselines.py, "
       "https://github.com/facebookresearch/metaseq")


def opt_runs() -> list[Run]:
    model = gpt("opt-175b", 12288, 96, 96, vocab=50272)
    return [Run("OPT 175B n=992", model, 992, 2048, 992,
                "tp=8,pp=1,cp=1,dp_shard=124,zero_stage=2,micro_batch=8,grad_accum=1,activation_checkpoint=full,"
                "sequence_parallel=false", OPT, "sec. 2.4: 992 A100 80GB, up to 147 TFLOP/s per GPU; chronicle: 8x "
                "TP, 2M batch, 33 days on 1024 GPUs for 300B tokens", tflops=147, flops="eq3", layout="fsdp-mp",
                precision="fp16", distribute_checkpoints=True, search=False, reduce_dtype="fp16")]


def bloom_runs() -> list[Run]:
    model = gpt("bloom-176b", 14336, 112, 70, vocab=250880)
    return [Run("BLOOM 176B n=384", model, 384, 2048, 2048,
                "tp=4,pp=12,cp=1,dp_replicate=8,zero_stage=1,micro_batch=2,activation_checkpoint=full,sequence_parallel=false,"
                "pp_schedule=1f1b", BLOOM, "TP=4 PP=12 DP=8 MBS=2, GBS 2048; log: 104.70 s/iteration, TFLOPs 149.77",
                step_s=104.70, tflops=149.77, flops="bloom", inter_node_gbs=400 / 8 / 8, keeps_bf16_grads=True,
                pipeline_split="slots", embedding_norm=True, fixed_overhead_gib=BLOOM_CONTEXT_GIB,
                overlap_grad_reduce=False)]


# --------------------------------------------------------------------------------------------------
# torchtitan's own benchmark of Llama 3.1 8B, 70B and 405B (torch, torchao and torchtitan of 2024/12/23-26):
# FSDP2 with bf16 parameters for compute and fp32 reduction (its default MixedPrecisionPolicy), sequence 8192 unless a
# table varies it, tables 1-6, every row. "Each H100 GPU is equipped with 96GB HBM2e with 2.4 TB/sec peak memory
# bandwidth", 400 Gb/s RDMA per GPU, "the default 500W power limit" (the H100 SXM's is 700 W). Its peak, in the
# source's own footnote: "HBM2e-based SXM H100 with lower TDP, the actual peak TFLOPs number is between SXM and NVL,
# and we don't know its exact value". The datasheets give 989.4 (SXM5) and 835.5 (H100 NVL: 1,671 TFLOP/s bf16 with
# sparsity) dense bf16 TFLOP/s; the rows are evaluated at the middle of those bounds, 912.5 (every dtype's peak scaled
# alike).
# Memory is torchtitan's logged peak of reserved memory ("memory readings are stable"; for pipelines "the maximum
# across all GPUs"), TPS/GPU read at step 90. Its norm was torch.nn.RMSNorm (torchtitan's build_norm, "rmsnorm"),
# composite on a GPU until torch 2.8: torchtitan issue 374 (2024) waits for "the CUDA kernel when it is ready in
# core", which came with pytorch PR 153666 (2025).
# How the rows ran, from torchtitan's code of the time: torch.compile compiles each block (Training.compile);
# Float8 is torchao's float8 training with tensorwise dynamic scaling on every linear but the output head
# (precision fp8); local batch = one micro-batch (no gradient accumulation then), except in a pipeline, whose
# micro-batches default to the number of stages (pipeline_parallel_microbatches or parallel_dims.pp: local batch 32
# in 8 micro-batches of 4) and whose interleaved schedule defaults to 2 stages per rank; TP always with sequence
# parallelism and loss parallel; FSDP reshards after forward except in a pipeline ("For PP, do not reshard after
# forward to avoid per-microbatch all-gathers", apply_fsdp): there it is what the planner calls ZeRO-2; context
# parallelism is torch's ring attention, load-balanced, sharding the weights with the dp_shard ranks; the loss was
# not compiled with the blocks (train.py at 9dec370: "# if job_config.training.compile: loss_fn =
# torch.compile(loss_fn)", commented out), so it ran eager on fp32 logits (compile_loss=False); its AdamW was torch's
# foreach implementation (optimizer.fused false by default until PR 881 of 2025-02-24 made fused the default: a pass
# per operation, optimizer_passes "per-op", since 2026-12-06); its model repeated K
# and V to every query head before scaled_dot_product_attention (repeat_kv, until PR 2259 of January 2026), so the
# context-parallel exchange carried them repeated (cp_repeats_kv=True).
# Not modelled: asynchronous TP (AsyncTP, tables 4-6: TP's collectives are priced on the critical path).
TORCHTITAN = ("torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, "
              "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md")


TORCHTITAN_H100_PEAK = (989.4 + 835.5) / 2
GRAND_TETON_H100 = dict(gpu_memory_gib=96, mem_bandwidth_tbs=2.4, peak_tflops=TORCHTITAN_H100_PEAK)
"""The H100s of torchtitan's benchmarks, as the Run fields that describe them (above)."""

# table, model, GPUs, sequence, layout (--plan keys; micro_batch = the local batch, or its pipeline micro-batch),
# global batch (sequences), compile, Float8, AsyncTP, TPS/GPU, memory GiB, the row as printed
TORCHTITAN_ROWS = [
    (1, "llama3-8b", 8, 8192, "dp_shard=8,zero_stage=3,micro_batch=2,activation_checkpoint=selective", 16,
     False, False, False, 5762, 82.4, "FSDP | 5,762 | 82.4"),
    (1, "llama3-8b", 8, 8192, "dp_shard=8,zero_stage=3,micro_batch=2,activation_checkpoint=selective", 16,
     True, False, False, 6667, 77.0, "FSDP + torch.compile | 6,667 | 77.0"),
    (1, "llama3-8b", 8, 8192, "dp_shard=8,zero_stage=3,micro_batch=2,activation_checkpoint=selective", 16,
     True, True, False, 8532, 76.8, "FSDP + torch.compile + Float8 | 8,532 | 76.8"),
    (2, "llama3-8b", 8, 32768, "dp_shard=8,cp=1,zero_stage=3,micro_batch=1,activation_checkpoint=full", 8,
     True, True, False, 3890, 83.9, "FSDP 8, CP 1 | 32768 | 3,890 | 83.9"),
    (2, "llama3-8b", 8, 65536, "dp_shard=4,cp=2,zero_stage=3,micro_batch=1,activation_checkpoint=full", 4,
     True, True, False, 2540, 84.2, "FSDP 4, CP 2 | 65536 | 2,540 | 84.2"),
    (2, "llama3-8b", 8, 131072, "dp_shard=2,cp=4,zero_stage=3,micro_batch=1,activation_checkpoint=full", 2,
     True, True, False, 1071, 84.0, "FSDP 2, CP 4 | 131072 | 1,071 | 84.0"),
    (2, "llama3-8b", 8, 262144, "dp_shard=1,cp=8,zero_stage=3,micro_batch=1,activation_checkpoint=full", 1,
     True, True, False, 548, 84.5, "FSDP 1, CP 8 | 262144 | 548 | 84.5"),
    (3, "llama3-8b", 128, 8192, "dp_shard=128,zero_stage=3,micro_batch=2,activation_checkpoint=selective", 256,
     False, False, False, 5605, 67.0, "FSDP | 5,605 | 67.0"),
    (3, "llama3-8b", 128, 8192, "dp_shard=128,zero_stage=3,micro_batch=2,activation_checkpoint=selective", 256,
     True, False, False, 6514, 62.0, "FSDP + torch.compile | 6,514 | 62.0"),
    (3, "llama3-8b", 128, 8192, "dp_shard=128,zero_stage=3,micro_batch=2,activation_checkpoint=selective", 256,
     True, True, False, 8380, 61.8, "FSDP + torch.compile + Float8 | 8,380 | 61.8"),
    (4, "llama3-70b", 256, 8192, "dp_shard=32,tp=8,zero_stage=3,micro_batch=16,activation_checkpoint=full", 512,
     True, True, False, 829, 71.9, "2D | 829 | 71.9"),
    (4, "llama3-70b", 256, 8192, "dp_shard=32,tp=8,zero_stage=3,micro_batch=16,activation_checkpoint=full", 512,
     True, True, True, 876, 67.6, "2D + AsyncTP | 876 | 67.6"),
    (5, "llama3-405b", 512, 8192, "dp_shard=8,tp=8,pp=8,zero_stage=2,micro_batch=4,pp_schedule=1f1b,"
     "activation_checkpoint=full", 256, True, True, True, 100, 82.5, "1F1B | 100 | 82.5"),
    (5, "llama3-405b", 512, 8192, "dp_shard=8,tp=8,pp=8,zero_stage=2,micro_batch=4,pp_schedule=interleaved-1f1b,"
     "virtual_stages=2,activation_checkpoint=full", 256, True, True, True, 128, 72.7, "Interleaved 1F1B | 128 | 72.7"),
    (6, "llama3-405b", 512, 32768, "dp_shard=8,cp=1,tp=8,pp=8,zero_stage=2,micro_batch=1,pp_schedule=1f1b,"
     "activation_checkpoint=full", 64, True, True, True, 76, 75.3, "FSDP 8, CP 1 | 32768 | 76 | 75.3"),
    (6, "llama3-405b", 512, 65536, "dp_shard=4,cp=2,tp=8,pp=8,zero_stage=2,micro_batch=1,pp_schedule=1f1b,"
     "activation_checkpoint=full", 32, True, True, True, 47, 75.9, "FSDP 4, CP 2 | 65536 | 47 | 75.9"),
    (6, "llama3-405b", 512, 131072, "dp_shard=2,cp=4,tp=8,pp=8,zero_stage=2,micro_batch=1,pp_schedule=1f1b,"
     "activation_checkpoint=full", 16, True, True, True, 31, 77.1, "FSDP 2, CP 4 | 131072 | 31 | 77.1"),
    (6, "llama3-405b", 512, 262144, "dp_shard=1,cp=8,tp=8,pp=8,zero_stage=2,micro_batch=1,pp_schedule=1f1b,"
     "activation_checkpoint=full", 8, True, True, True, 16, 84.9, "FSDP 1, CP 8 | 262144 | 16 | 84.9"),
]


def torchtitan_runs() -> list[Run]:
    runs = []
    for table, name, n, seq, plan, batch, compiled, float8, async_tp, tps, mem, row in TORCHTITAN_ROWS:
        model = dataclasses.replace(preset(name), max_seq_len=max(seq, preset(name).max_seq_len))
        tp = "tp=" in plan
        how = ("+compile" if compiled else "") + ("+Float8" if float8 else "") + ("+AsyncTP" if async_tp else "")
        how = f" {how.removeprefix('+')}" if how else ""
        pipeline = " PP i1F1B" if "interleaved" in plan else " PP 1F1B" if "pp=" in plan else ""
        layout = "FSDP" + (" TP" if tp else "") + pipeline + (" CP" if "cp=" in plan and "cp=1," not in plan else "")
        size = name.removeprefix("llama3-").upper()
        runs.append(Run(f"torchtitan {size} {layout}{how} n={n} s={seq // 1024}K", model, n, seq, batch,
                        f"{plan}{',sequence_parallel=true' if tp else ''}", TORCHTITAN, f"table {table} row: {row}",
                        tflops=tps * flops_per_token(model, seq) / 1e12, mem_gib=mem, mem_counts="reserved",
                        gpu="h100", system="torchtitan",
                        **GRAND_TETON_H100,
                        search=table in (1, 2) and not compiled, fused_rmsnorm=False, compile=compiled,
                        compile_loss=False, cp_repeats_kv=True, precision="fp8" if float8 else "bf16",
                        optimizer_passes="per-op"))
    return runs


# --------------------------------------------------------------------------------------------------
# torchtitan's async-TP benchmark (benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, "done by the PyTorch team in
# June 2025"): the same Grand Teton H100s as the 2024 tables (96GB HBM2e, 2.4 TB/s, "the default 500W power limit",
# 400 Gb/s per GPU), torch 38410cf9 (2025-06-14), torchtitan 820504e (2025-06-13; the file prints 2024/06/13, the
# commit is of 2025). "Llama3 70b on 256 H100s with FSDP=32, TP=8, torch.compile, full AC, local batch size 16" and
# "Llama3 8b on 64 H100s with FSDP=8, TP=8, torch.compile, per op SAC, local batch size 12"; sequence 8192 (both
# tomls at 820504e). Its loss was compiled (components/loss.py at 820504e: "Compiling the loss function with
# torch.compile"). Kept: the bfloat16 and float8 tensorwise rows, vanilla and async (the planner's torchao recipe is
# tensorwise). TP's collectives are priced on the critical path, async or not (as for the 2024 tables).
# These rows were added after the planner's terms were set (2026-12-05): they were evaluated first as they stand,
# a held-out check (docs/planner.md, "torchtitan's benchmark").
TORCHTITAN_2025 = ("torchtitan, benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, "
                   "https://github.com/pytorch/torchtitan/blob/main/benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md")
# model, GPUs, layout, global batch, Float8, vanilla TP tokens/s, async TP tokens/s, the row as printed
TORCHTITAN_2025_ROWS = [
    ("llama3-70b", 256, "dp_shard=32,tp=8,zero_stage=3,micro_batch=16,activation_checkpoint=full", 512, False,
     597.3, 652.4, "None (bfloat16) | 597.3 | 652.4 | 1.09"),
    ("llama3-70b", 256, "dp_shard=32,tp=8,zero_stage=3,micro_batch=16,activation_checkpoint=full", 512, True,
     809.8, 942.4, "float8 tensorwise | 809.8 | 942.4 | 1.16"),
    ("llama3-8b", 64, "dp_shard=8,tp=8,zero_stage=3,micro_batch=12,activation_checkpoint=selective", 96, False,
     4378, 4809.4, "None (bfloat16) | 4378 | 4809.4 | 1.10"),
    ("llama3-8b", 64, "dp_shard=8,tp=8,zero_stage=3,micro_batch=12,activation_checkpoint=selective", 96, True,
     5078.1, 5570.1, "float8 tensorwise | 5078.1 | 5570.1 | 1.10")]


def torchtitan_2025_runs() -> list[Run]:
    runs = []
    for name, n, plan, batch, float8, tps, async_tps, row in TORCHTITAN_2025_ROWS:
        model = preset(name)
        for async_tp, x in ((False, tps), (True, async_tps)):
            how = "compile" + ("+Float8" if float8 else "") + ("+AsyncTP" if async_tp else "")
            runs.append(Run(f"torchtitan 2025 {name.removeprefix('llama3-').upper()} FSDP TP {how} n={n} s=8K",
                            model, n, 8192, batch, f"{plan},sequence_parallel=true", TORCHTITAN_2025,
                            f"{'Async' if async_tp else 'Vanilla'} TP: {row}",
                            tflops=x * flops_per_token(model, 8192) / 1e12, gpu="h100", system="torchtitan",
                            **GRAND_TETON_H100, search=False,
                            compile=True, precision="fp8" if float8 else "bf16"))
    return runs


# --------------------------------------------------------------------------------------------------
# torchtitan's H200 baseline by Trainy (benchmarks/llama3_8b_h200_2025-06_torchtitan.md, June 2025; the same table
# in llama3-8b_h200_202506_trainy-whitefiber.md): Llama 3.1 8B on 4 and 8 hosts of 8 H200s (NVLink inside a host,
# "400Gb/s (Mellanox CX-7) per GPU" between hosts), torch 2.8.0a0 (NGC 25.05), torchtitan e7c0cae (2025-06-13):
# "--job.config-file torchtitan/models/llama3/train_configs/llama3_8b.toml --training.local_batch_size=2
# --training.compile --model.converters="float8" --float8.enable_fsdp_float8_all_gather
# --float8.precompute_float8_dynamic_scale_for_fsdp --float8.force_recompute_fp8_weight_in_bwd". That toml at
# e7c0cae: seq_len 8192, data_parallel_shard_degree -1 (FSDP over every GPU), activation_checkpoint mode "selective",
# selective_ac_option "op"; float8 filter_fqns ["output"]. Under --training.compile torchtitan then also compiled
# the loss (components/loss.py build_cross_entropy_loss). "TPS and Memory(GiB) are arbitrarily sampled at the
# 100th iteration." Memory is torchtitan's logged "memory", torch's max_memory_reserved (mem_counts "reserved").
# Not modelled: the float8 all-gather (the weights travel in float8, half the bytes; the planner sends bf16, and
# this FSDP traffic hides behind compute either way) and the weight casts it moves onto the shards.
TRAINY = ("torchtitan, benchmarks/llama3_8b_h200_2025-06_torchtitan.md (Trainy, June 2025), "
          "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_8b_h200_2025-06_torchtitan.md")
TRAINY_ROWS = [(4, 10938, 47.96), (8, 10753, 46.97)]  # NUM_NODES | TPS/GPU | Memory(GiB)


def trainy_runs() -> list[Run]:
    model = preset("llama3-8b")
    return [Run(f"torchtitan H200 8B FSDP compile+Float8 n={8 * nodes} s=8K", model, 8 * nodes, 8192, 2 * 8 * nodes,
                f"dp_shard={8 * nodes},zero_stage=3,micro_batch=2,activation_checkpoint=selective", TRAINY,
                f"NUM_NODES {nodes} | TPS/GPU {tps} | Memory(GiB) {mem}",
                tflops=tps * flops_per_token(model, 8192) / 1e12, mem_gib=mem, mem_counts="reserved", gpu="h200",
                system="torchtitan",
                search=nodes == 4, compile=True, precision="fp8")
            for nodes, tps, mem in TRAINY_ROWS]


# --------------------------------------------------------------------------------------------------
# torchao's float8 training benchmarks, run with torchtitan (torchao/float8/README.md, "Training benchmarks"; in
# docs since January 2026): "Single-node training on 8xH100 GPUs, batch size 1, sequence length 8192, steps 100,
# torch.compile, FSDP2, per-op SAC" (torchao 890e0ac8 of 2025-02-28, table added 2025-03-12, PR 1793), and the same
# on 8 MI300X (torchtitan 2c8b5947 of 2025-08-08). The script (benchmarks/float8/training/torchtitan_benchmark.sh)
# runs llama3_8b.toml (op-level SAC, FSDP over the 8 GPUs) with --training.compile and, for "tensorwise",
# --float8.enable_fsdp_float8_all_gather --float8.precompute_float8_dynamic_scale_for_fsdp. Kept: the bfloat16 and
# tensorwise rows (the planner's torchao recipe is tensorwise; the rowwise rows are left out). The H100 run's torch
# ("pytorch version: 2.7.0a0") ran torch.nn.RMSNorm composite outside the compiled blocks (the final norm:
# fused_rmsnorm False; the fused kernel came with torch 2.8). The H100 run predates
# torchtitan's compiled loss (April 2025), the MI300X run has it. The README does not say which H100; the script's
# PR (pytorch/ao PR 1802, 2025-02-28, by the table's author the same day) shows its log on the machine: "memory:
# 47.79GiB(50.30%)", a device of 95.0 GiB, the 96GB HBM2e H100 of torchtitan's own benchmark (its "default 500W
# power limit", 2.4 TB/s, peak between SXM and NVL), not the catalogue's 80 GB SXM, so the H100 rows are evaluated
# as torchtitan's (until 2026-12-06 as the catalogue's: 1.21 and 1.22). "Peak Memory (GB)" is torchtitan's logged
# peak, which it prints in GiB.
TORCHAO = ("torchao, torchao/float8/README.md (Training benchmarks), "
           "https://github.com/pytorch/ao/blob/main/torchao/float8/README.md")
TORCHAO_ROWS = [("h100", "bf16", False, 6150, 47.65, "none (bfloat16) | 47.65 | 6150"),
                ("h100", "fp8", False, 7689.5, 47.77, "tensorwise with float8 all-gather | 47.77 | 7689.5"),
                ("mi300x", "bf16", True, 5376.5, 39.09, "none (bfloat16) | 39.09 | 5376.5"),
                ("mi300x", "fp8", True, 6166.0, 39.07, "tensorwise with float8 all-gather | 39.07 | 6166.0")]


def torchao_runs() -> list[Run]:
    model = preset("llama3-8b")
    return [Run(f"torchao {gpu.upper()} 8B FSDP compile{'+Float8' if precision == 'fp8' else ''} n=8 s=8K", model, 8,
                8192, 8, "dp_shard=8,zero_stage=3,micro_batch=1,activation_checkpoint=selective", TORCHAO,
                f"Llama3-8b | {row}", tflops=tps * flops_per_token(model, 8192) / 1e12, mem_gib=mem,
                mem_counts="reserved", gpu=gpu,
                system="torchtitan", search=False, compile=True, compile_loss=compiled_loss, precision=precision,
                fused_rmsnorm=gpu != "h100", **(GRAND_TETON_H100 if gpu == "h100" else {}))
            for gpu, precision, compiled_loss, tps, mem, row in TORCHAO_ROWS]


# --------------------------------------------------------------------------------------------------
# OLMo-core's throughput table (allenai/OLMo-core README.md, "Throughput numbers from these scripts with various
# different configuration settings are reported below, measured on a cluster with NVIDIA H100 GPUs"; tokens per
# second per device), as it stood from commit e27ba74 (2024-11-05, the 1B's numbers updated with its micro-batch)
# to March 2025; the 7B's and 13B's numbers date from September and October 2024, their scripts unchanged since
# but for the loss (flash-attn's fused cross-entropy, then the compiled loss). The scripts at e27ba74
# (src/scripts/train/OLMo-{1B,7B,13B}.py, Llama-8B.py): TransformerConfig.olmo_{1B,7B,13B} / llama3_8B with
# compile=True (each block compiled; torch's SDPA, flash-attn and its fused norms being off under compile), FSDP2
# over the data-parallel mesh (fully_shard per block, MixedPrecisionPolicy bf16 params, fp32 reduce; gradients
# reduced every micro-batch: the trainer's no_sync is for DDP only), fused AdamW, compile_loss with a z-loss, no
# activation checkpointing; rank micro-batch 8 x 4096 (1B), 2 x 4096 (7B, 8B), 1 x 4096 (13B); global batch 1024
# x 4096 (2048 for the 13B); the dolma2 tokenizer padded to 100,352 (the 8B's too); "--model.float8_config.enabled=
# true": torchao's tensorwise dynamic scaling with the float8 all-gather (olmo_core/float8.py). The launcher's
# default is one node of 8 GPUs (internal/experiment.py: num_nodes=1, num_gpus=8), taken as the run's size (the
# README does not state it). Shapes (nn/transformer/config.py): 1B d 2048, 18 layers, 16 heads, FFN 5,632; 7B d
# 4096, 32 layers, 32 heads, FFN 11,008; 13B d 5120, 40 layers, 40 heads, FFN 13,824 (multi-head attention);
# Llama 3 8B as Meta's. OLMo-1124's QK-norm and reordered norms (an RMSNorm over the query and the key projections,
# and the block's two norms on its branches' outputs instead of their inputs) are not in the planner's model: two
# more norms a block, which compile fuses with their neighbours. Not modelled either: the float8 all-gather (the
# weights travel in float8; the planner sends bf16, as for torchtitan's Float8 rows). Throughput only (no memory
# published). Added on
# 2026-12-05 and evaluated first as the planner stood (held out: docs/heldout-2026-12-05/).
OLMO_CORE = ("allenai/OLMo-core, README.md (throughput table), "
             "https://github.com/allenai/OLMo-core/blob/e27ba74550f12a685b95aded46c88f845a7e2d6d/README.md")
OLMO_SHAPES = {"1b": dict(dim=2048, n_layers=18, n_heads=16, n_kv_heads=16, ffn_hidden=5632),
               "7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden=11008),
               "13b": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_hidden=13824)}
# model, architecture, micro-batch, global batch (sequences), BF16 TPS, BF16/FP8 TPS
OLMO_CORE_ROWS = [("1b", "OLMo-1124", 8, 1024, 55000, 65000), ("7b", "OLMo-1124", 2, 1024, 10000, 13000),
                  ("8b", "Llama", 2, 1024, 9500, 12500), ("13b", "OLMo-1124", 1, 2048, 4600, 5500)]


def olmo_core_runs() -> list[Run]:
    runs = []
    for size, arch, mb, gbs, bf16_tps, fp8_tps in OLMO_CORE_ROWS:
        if size == "8b":
            model = dataclasses.replace(preset("llama3-8b"), name="olmo-core-llama3-8b", vocab_size=100352,
                                        max_seq_len=4096)
        else:
            model = ModelArgs(name=f"olmo-1124-{size}", vocab_size=100352, max_seq_len=4096, **OLMO_SHAPES[size])
        for precision, tps in (("bf16", bf16_tps), ("fp8", fp8_tps)):
            label = "BF16" if precision == "bf16" else "BF16/FP8"
            runs.append(Run(f"OLMo-core {size.upper()} {label} n=8 s=4K", model, 8, 4096, gbs,
                            f"dp_shard=8,zero_stage=3,micro_batch={mb},activation_checkpoint=none", OLMO_CORE,
                            f"{size.upper()} | {arch} | 4096 | {label} | {tps:,} TPS",
                            tflops=tps * flops_per_token(model, 4096) / 1e12, gpu="h100", system="torchtitan",
                            search=False, compile=True, compile_loss=True, precision=precision,
                            fused_rmsnorm=False, expandable_segments=False))  # (OLMo-core's code never sets it)
    return runs


# --------------------------------------------------------------------------------------------------
# llm-foundry's MPT throughput tables (scripts/train/benchmarking/README.md): MPT models (GPT-style: GELU MLP of 4h,
# multi-head attention, tied embedding, vocabulary 50,368; d_model / n_heads / n_layers from
# scripts/train/yamls/pretrain/mpt-*.yaml, d_head 128 everywhere but 125m and 350m) trained with Composer's FSDP
# (FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2, one unit per block), mixed precision DEFAULT or PURE (below),
# attn_impl flash (triton in the 8-64 GPU H100 table: docs/planner.md), activation checkpointing of whole blocks
# or none, a few steps each. The
# columns kept, in the source's order: Model, SeqLen, # GPUs, GPU, MFU, MicroBatchSize, GradAccum,
# GlobalBatchSize, Throughput (T/s/GPU), MP Mode, Sharding Strategy, Activation Checkpointing; tables "H100 80GB
# BF16 (Large Scale, >= 128 GPUs)", "H100 80GB BF16" and "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"
# (= the catalogue's 25 GB/s per GPU); the FP8 table is left out (Transformer Engine's linears under FSDP, which the
# planner's float8 recipes do not describe). "A100 40GB with 1600 Gbps node-node interconnect (RoCE)" (78 rows,
# FOUNDRY_40GB_ROWS) was added on 2026-12-05 and evaluated first as the planner stood (held out:
# docs/heldout-2026-12-05/). It is the oldest table (in the README at llm-foundry's first commits, May 2023; its
# sweep.sh: image mosaicml/pytorch:1.13.1, Composer 0.14, submit_benchmarks.py's --fsdp_config_mixed_precision
# default PURE and --attn_impl default triton).
# The gradients' reduction dtype, from Composer's mosaic_fsdp.py of each table's version: PURE is FSDP1's
# MixedPrecision(param_dtype, reduce_dtype, buffer_dtype all bf16) in every version; DEFAULT sets param_dtype bf16
# and no reduce_dtype in Composer 0.14-0.16, which FSDP1 then "takes on the param_dtype value, still running
# gradient reduction in low precision" (torch's MixedPrecision docstring), and reduce_dtype fp32 from 0.17. So the
# A100 tables and the 8-64 GPU H100 table (Composer 0.14 and 0.16) reduce in bf16, the large-scale H100 table
# (Composer 0.17) in fp32 (Training.reduce_dtype; until 2026-12-05 every row was priced with fp32 reduction).
FOUNDRY = ("llm-foundry, scripts/train/benchmarking/README.md, "
           "https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md")
MPT = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
       "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
       "70b": (8192, 64, 80)}
FOUNDRY_ROWS = """
70b 2048 512 h100_80gb 41.25 8 1 4096 1007 DEFAULT FULL_SHARD True
70b 2048 256 h100_80gb 42.42 8 1 2048 1035 DEFAULT FULL_SHARD True
70b 2048 128 h100_80gb 43.36 8 1 1024 1058 DEFAULT FULL_SHARD True
30b 2048 512 h100_80gb 40.27 8 1 4096 2115 DEFAULT FULL_SHARD True
30b 2048 256 h100_80gb 40.89 8 1 2048 2148 DEFAULT FULL_SHARD True
30b 2048 128 h100_80gb 41.85 8 1 1024 2199 DEFAULT FULL_SHARD True
13b 2048 512 h100_80gb 41.12 16 1 8192 4952 DEFAULT FULL_SHARD True
13b 2048 256 h100_80gb 41.42 16 1 4096 4989 DEFAULT FULL_SHARD True
13b 2048 128 h100_80gb 42.18 16 1 2048 5080 DEFAULT FULL_SHARD True
7b 2048 512 h100_80gb 42.2 6 1 3072 9670 DEFAULT FULL_SHARD False
7b 2048 256 h100_80gb 44.15 6 1 1536 10119 DEFAULT FULL_SHARD False
7b 2048 128 h100_80gb 45.71 6 1 768 10475 DEFAULT FULL_SHARD False
3b 2048 512 h100_80gb 39.24 8 1 4096 21664 DEFAULT SHARD_GRAD_OP False
3b 2048 256 h100_80gb 41.25 8 1 2048 22772 DEFAULT SHARD_GRAD_OP False
3b 2048 128 h100_80gb 42.43 8 1 1024 23422 DEFAULT SHARD_GRAD_OP False
1b 2048 512 h100_80gb 36.65 12 1 6144 39837 DEFAULT SHARD_GRAD_OP False
1b 2048 256 h100_80gb 39.15 12 1 3072 42555 DEFAULT SHARD_GRAD_OP False
1b 2048 128 h100_80gb 40.6 12 1 1536 44123 DEFAULT SHARD_GRAD_OP False
70b 2048 64 h100_80gb 42.57 8 4 2048 1039 DEFAULT FULL_SHARD True
70b 2048 32 h100_80gb 36.15 2 16 1024 882 DEFAULT FULL_SHARD True
30b 8192 8 h100_80gb 29.92 1 21 168 1384 DEFAULT FULL_SHARD True
30b 4096 8 h100_80gb 35.86 1 21 168 1802 DEFAULT FULL_SHARD True
30b 2048 32 h100_80gb 43.92 14 3 1344 2308 DEFAULT FULL_SHARD True
30b 2048 16 h100_80gb 43.07 10 3 480 2263 DEFAULT FULL_SHARD True
30b 2048 8 h100_80gb 38.11 3 21 504 2002 DEFAULT FULL_SHARD True
30b 1024 8 h100_80gb 38.76 6 21 1008 2084 DEFAULT FULL_SHARD True
13b 32768 8 h100_80gb 31.68 1 3 24 1976 DEFAULT FULL_SHARD True
13b 16384 8 h100_80gb 35.55 3 3 72 2985 DEFAULT FULL_SHARD True
13b 4096 8 h100_80gb 41.6 10 3 240 4717 DEFAULT FULL_SHARD True
13b 2048 64 h100_80gb 39.86 2 1 128 4800 DEFAULT FULL_SHARD False
13b 2048 32 h100_80gb 39.95 2 1 64 4811 DEFAULT FULL_SHARD False
13b 2048 16 h100_80gb 39.58 2 1 32 4767 DEFAULT FULL_SHARD False
13b 2048 8 h100_80gb 39.79 2 1 16 4792 DEFAULT FULL_SHARD False
13b 1024 8 h100_80gb 44.27 40 3 960 5502 DEFAULT FULL_SHARD True
7b 65536 8 h100_80gb 28.59 1 2 16 1956 DEFAULT FULL_SHARD True
7b 32768 8 h100_80gb 30.94 2 2 32 3318 DEFAULT FULL_SHARD True
7b 8192 8 h100_80gb 37.14 8 2 128 6935 DEFAULT FULL_SHARD True
7b 4096 8 h100_80gb 40.42 16 2 256 8611 DEFAULT FULL_SHARD True
7b 2048 8 h100_80gb 46.44 6 1 48 10643 DEFAULT FULL_SHARD False
7b 1024 8 h100_80gb 42.83 64 2 1024 10203 DEFAULT FULL_SHARD True
3b 65536 8 h100_80gb 26.81 1 2 16 3262 DEFAULT FULL_SHARD True
3b 32768 8 h100_80gb 28.84 3 6 144 5873 DEFAULT FULL_SHARD True
3b 16384 8 h100_80gb 36.34 1 6 48 11152 DEFAULT FULL_SHARD False
3b 8192 8 h100_80gb 40.31 3 6 144 16578 DEFAULT FULL_SHARD False
3b 4096 8 h100_80gb 42.31 5 6 240 20964 DEFAULT FULL_SHARD False
3b 2048 64 h100_80gb 40.8 6 3 1152 22525 DEFAULT FULL_SHARD False
3b 2048 32 h100_80gb 41.7 6 3 576 23021 DEFAULT FULL_SHARD False
3b 2048 16 h100_80gb 43.73 10 3 480 24142 DEFAULT FULL_SHARD False
3b 1024 8 h100_80gb 46.2 20 6 960 27046 DEFAULT FULL_SHARD False
3b 512 8 h100_80gb 46.32 40 6 1920 27965 DEFAULT FULL_SHARD False
1b 65536 8 h100_80gb 26.34 1 2 16 5506 DEFAULT FULL_SHARD True
1b 32768 8 h100_80gb 33.54 1 4 32 12025 DEFAULT FULL_SHARD False
1b 16384 8 h100_80gb 35.22 2 4 64 19649 DEFAULT FULL_SHARD False
1b 8192 8 h100_80gb 37.73 3 4 96 29157 DEFAULT FULL_SHARD False
1b 4096 8 h100_80gb 40.26 7 4 224 38535 DEFAULT FULL_SHARD False
1b 2048 64 h100_80gb 40.85 20 1 1280 44402 DEFAULT FULL_SHARD False
1b 2048 32 h100_80gb 41.52 20 1 640 45130 DEFAULT FULL_SHARD False
1b 2048 16 h100_80gb 42.36 20 1 320 46037 DEFAULT FULL_SHARD False
1b 2048 8 h100_80gb 41.82 14 1 112 45455 DEFAULT FULL_SHARD False
1b 1024 8 h100_80gb 41.95 18 4 576 48910 DEFAULT FULL_SHARD False
1b 512 8 h100_80gb 43.21 56 4 1792 52275 DEFAULT FULL_SHARD False
760m 32768 8 h100_80gb 31.84 1 2 16 16291 DEFAULT FULL_SHARD False
760m 16384 8 h100_80gb 33.57 3 2 48 27815 DEFAULT FULL_SHARD False
760m 8192 8 h100_80gb 34.84 6 2 96 41825 DEFAULT FULL_SHARD False
760m 4096 8 h100_80gb 35.83 12 2 192 55459 DEFAULT FULL_SHARD False
760m 2048 32 h100_80gb 37.57 24 1 768 67971 DEFAULT FULL_SHARD False
760m 2048 16 h100_80gb 37.89 24 1 384 68551 DEFAULT FULL_SHARD False
760m 2048 8 h100_80gb 34.9 24 2 384 63147 DEFAULT FULL_SHARD False
760m 1024 8 h100_80gb 39.76 48 2 768 78581 DEFAULT FULL_SHARD False
760m 512 8 h100_80gb 40.42 96 2 1536 83749 DEFAULT FULL_SHARD False
70b 2048 64 a100_80gb 53.33 8 4 2048 410 PURE FULL_SHARD True
70b 2048 32 a100_80gb 48.56 2 16 1024 373 PURE FULL_SHARD True
30b 8192 8 a100_80gb 39.38 1 21 168 574 DEFAULT FULL_SHARD True
30b 4096 8 a100_80gb 51.37 1 21 168 814 DEFAULT FULL_SHARD True
30b 2048 8 a100_80gb 55.3 3 21 504 916 DEFAULT FULL_SHARD True
30b 1024 8 a100_80gb 55.82 6 21 1008 946 DEFAULT FULL_SHARD True
30b 512 8 a100_80gb 56.4 12 21 2016 967 DEFAULT FULL_SHARD True
13b 32768 8 a100_80gb 51.69 1 3 24 1016 DEFAULT FULL_SHARD True
13b 16384 8 a100_80gb 54.07 3 3 72 1431 DEFAULT FULL_SHARD True
13b 8192 8 a100_80gb 56.07 5 3 120 1795 DEFAULT FULL_SHARD True
13b 4096 8 a100_80gb 57.62 10 3 240 2060 DEFAULT FULL_SHARD True
13b 2048 8 a100_80gb 59.57 2 3 48 2262 DEFAULT FULL_SHARD False
13b 1024 8 a100_80gb 59.48 40 3 960 2330 DEFAULT FULL_SHARD True
7b 65536 8 a100_80gb 46.97 1 2 16 1013 DEFAULT FULL_SHARD True
7b 32768 8 a100_80gb 49.46 2 2 32 1672 DEFAULT FULL_SHARD True
7b 16384 8 a100_80gb 51.96 4 2 64 2453 DEFAULT FULL_SHARD True
7b 8192 8 a100_80gb 54.47 8 2 128 3206 DEFAULT FULL_SHARD True
7b 4096 8 a100_80gb 54.84 16 2 256 3684 DEFAULT FULL_SHARD True
7b 2048 8 a100_80gb 64.23 6 2 96 4641 DEFAULT FULL_SHARD False
7b 1024 8 a100_80gb 58.01 64 2 1024 4357 DEFAULT FULL_SHARD True
3b 65536 8 a100_80gb 46.05 1 2 16 1767 DEFAULT FULL_SHARD True
3b 32768 8 a100_80gb 47.18 3 6 144 3029 DEFAULT FULL_SHARD True
3b 16384 8 a100_80gb 57.13 1 6 48 5529 DEFAULT FULL_SHARD False
3b 8192 8 a100_80gb 59.34 3 6 144 7695 DEFAULT FULL_SHARD False
3b 4096 8 a100_80gb 60.53 5 6 240 9457 DEFAULT FULL_SHARD False
3b 2048 8 a100_80gb 62.11 10 2 160 10811 DEFAULT FULL_SHARD False
3b 1024 8 a100_80gb 62.73 20 6 960 11580 DEFAULT FULL_SHARD False
3b 512 8 a100_80gb 63.71 40 6 1920 12127 DEFAULT FULL_SHARD False
1b 65536 8 a100_80gb 46.18 1 2 16 3044 DEFAULT FULL_SHARD True
1b 32768 8 a100_80gb 55.52 1 4 32 6275 DEFAULT FULL_SHARD False
1b 16384 8 a100_80gb 56.6 2 4 64 9956 DEFAULT FULL_SHARD False
1b 8192 8 a100_80gb 56.69 3 4 96 13814 DEFAULT FULL_SHARD False
1b 4096 8 a100_80gb 59.0 7 4 224 17807 DEFAULT FULL_SHARD False
1b 2048 8 a100_80gb 59.86 14 4 448 20513 DEFAULT FULL_SHARD False
1b 1024 8 a100_80gb 60.15 18 4 576 22112 DEFAULT FULL_SHARD False
1b 512 8 a100_80gb 60.68 56 4 1792 23148 DEFAULT FULL_SHARD False
760m 65536 8 a100_80gb 45.34 1 2 16 4143 DEFAULT FULL_SHARD True
760m 32768 8 a100_80gb 54.57 1 2 16 8802 DEFAULT FULL_SHARD False
760m 16384 8 a100_80gb 54.64 3 2 48 14274 DEFAULT FULL_SHARD False
760m 8192 8 a100_80gb 55.31 6 2 96 20933 DEFAULT FULL_SHARD False
760m 4096 8 a100_80gb 56.05 12 2 192 27351 DEFAULT FULL_SHARD False
760m 2048 8 a100_80gb 56.85 24 2 384 32434 DEFAULT FULL_SHARD False
760m 1024 8 a100_80gb 47.76 48 2 768 29765 DEFAULT FULL_SHARD False
760m 512 8 a100_80gb 45.07 96 2 1536 29446 DEFAULT FULL_SHARD False
350m 65536 8 a100_80gb 52.7 1 2 16 7524 DEFAULT FULL_SHARD False
350m 32768 8 a100_80gb 52.46 2 2 32 13652 DEFAULT FULL_SHARD False
350m 16384 8 a100_80gb 53.28 4 2 64 23559 DEFAULT FULL_SHARD False
350m 8192 8 a100_80gb 53.8 8 2 128 36569 DEFAULT FULL_SHARD False
350m 4096 8 a100_80gb 53.31 16 2 256 49555 DEFAULT FULL_SHARD False
350m 2048 8 a100_80gb 51.62 32 2 512 58782 DEFAULT FULL_SHARD False
350m 1024 8 a100_80gb 50.51 64 2 1024 64813 DEFAULT FULL_SHARD False
350m 512 8 a100_80gb 50.61 128 2 2048 69330 DEFAULT FULL_SHARD False
125m 65536 8 a100_80gb 54.13 1 2 16 20368 DEFAULT FULL_SHARD False
125m 32768 8 a100_80gb 52.71 2 2 32 36407 DEFAULT FULL_SHARD False
125m 16384 8 a100_80gb 50.61 4 2 64 60040 DEFAULT FULL_SHARD False
125m 8192 8 a100_80gb 48.85 8 2 128 90392 DEFAULT FULL_SHARD False
125m 4096 8 a100_80gb 46.08 16 2 256 118396 DEFAULT FULL_SHARD False
125m 2048 8 a100_80gb 44.79 40 2 640 142830 DEFAULT FULL_SHARD False
125m 2048 8 a100_80gb 44.45 32 2 512 141737 DEFAULT FULL_SHARD False
125m 1024 8 a100_80gb 43.15 64 2 1024 156468 DEFAULT FULL_SHARD False
125m 512 8 a100_80gb 42.56 128 2 2048 165681 DEFAULT FULL_SHARD False
"""
FOUNDRY_40GB_ROWS = """
70b 2048 128 a100_40gb 48.91 4 1 512 376 PURE FULL_SHARD True
70b 2048 64 a100_40gb 35.87 2 1 128 276 PURE FULL_SHARD True
30b 2048 128 a100_40gb 52.25 6 1 768 865 PURE FULL_SHARD True
30b 2048 32 a100_40gb 51.74 4 1 128 857 PURE FULL_SHARD True
13b 8192 8 a100_40gb 43.95 1 16 128 1407 PURE FULL_SHARD True
13b 4096 8 a100_40gb 44.85 2 16 256 1603 PURE FULL_SHARD True
13b 2048 128 a100_40gb 51.93 16 1 2048 1972 PURE FULL_SHARD True
13b 2048 64 a100_40gb 52.04 16 1 1024 1976 PURE FULL_SHARD True
13b 2048 32 a100_40gb 52.62 14 1 448 1998 PURE FULL_SHARD True
13b 2048 16 a100_40gb 52.5 10 1 160 1993 PURE FULL_SHARD True
13b 2048 8 a100_40gb 43.94 4 16 512 1668 PURE FULL_SHARD True
13b 1024 8 a100_40gb 44.07 8 16 1024 1727 PURE FULL_SHARD True
13b 512 8 a100_40gb 44.28 16 16 2048 1763 PURE FULL_SHARD True
7b 16384 8 a100_40gb 47.65 1 4 32 2249 PURE FULL_SHARD True
7b 8192 8 a100_40gb 49.04 3 4 96 2887 PURE FULL_SHARD True
7b 4096 8 a100_40gb 50.11 6 4 192 3366 PURE FULL_SHARD True
7b 2048 128 a100_40gb 50.14 18 1 2304 3623 PURE FULL_SHARD True
7b 2048 64 a100_40gb 50.73 18 1 1152 3665 PURE FULL_SHARD True
7b 2048 32 a100_40gb 51.55 18 1 576 3725 PURE FULL_SHARD True
7b 2048 16 a100_40gb 50.44 16 1 256 3645 PURE FULL_SHARD True
7b 2048 8 a100_40gb 50.92 12 4 384 3679 PURE FULL_SHARD True
7b 1024 8 a100_40gb 51.31 24 4 768 3854 PURE FULL_SHARD True
7b 512 8 a100_40gb 50.85 48 4 1536 3895 PURE FULL_SHARD True
3b 32768 8 a100_40gb 46.03 1 4 32 2955 PURE FULL_SHARD True
3b 16384 8 a100_40gb 46.14 2 8 128 4465 PURE FULL_SHARD True
3b 8192 8 a100_40gb 55.13 1 8 64 7149 PURE FULL_SHARD False
3b 4096 8 a100_40gb 56.18 2 8 128 8777 PURE FULL_SHARD False
3b 2048 128 a100_40gb 54.8 6 1 768 9538 PURE FULL_SHARD False
3b 2048 64 a100_40gb 55.94 6 1 384 9736 PURE FULL_SHARD False
3b 2048 32 a100_40gb 56.96 6 1 192 9914 PURE FULL_SHARD False
3b 2048 16 a100_40gb 56.02 5 1 80 9750 PURE FULL_SHARD False
3b 2048 8 a100_40gb 57.82 5 8 320 10065 PURE FULL_SHARD False
3b 1024 8 a100_40gb 58.14 10 8 640 10731 PURE FULL_SHARD False
3b 512 8 a100_40gb 59.49 20 8 1280 11324 PURE FULL_SHARD False
1b 32768 8 a100_40gb 45.07 1 4 32 5095 PURE FULL_SHARD True
1b 16384 8 a100_40gb 55.23 1 8 64 9715 PURE FULL_SHARD False
1b 8192 8 a100_40gb 55.29 2 8 128 13474 PURE FULL_SHARD False
1b 4096 8 a100_40gb 55.85 4 8 256 16856 PURE FULL_SHARD False
1b 2048 128 a100_40gb 54.41 10 1 1280 18647 PURE FULL_SHARD False
1b 2048 64 a100_40gb 55.44 10 1 640 19001 PURE FULL_SHARD False
1b 2048 32 a100_40gb 45.39 10 1 320 15555 PURE FULL_SHARD False
1b 2048 16 a100_40gb 55.69 8 1 128 19085 PURE FULL_SHARD False
1b 2048 8 a100_40gb 56.23 8 8 512 19271 PURE FULL_SHARD False
1b 1024 8 a100_40gb 57.02 16 8 1024 20959 PURE FULL_SHARD False
1b 512 8 a100_40gb 57.1 32 8 2048 21782 PURE FULL_SHARD False
760m 32768 8 a100_40gb 44.53 1 4 32 7183 PURE FULL_SHARD True
760m 16384 8 a100_40gb 53.26 1 4 32 13914 PURE FULL_SHARD False
760m 8192 8 a100_40gb 53.12 3 4 96 20106 PURE FULL_SHARD False
760m 4096 8 a100_40gb 53.0 6 4 192 25863 PURE FULL_SHARD False
760m 2048 128 a100_40gb 50.73 12 1 1536 28940 PURE FULL_SHARD False
760m 2048 64 a100_40gb 51.44 12 1 768 29344 PURE FULL_SHARD False
760m 2048 32 a100_40gb 51.97 12 1 384 29648 PURE FULL_SHARD False
760m 2048 16 a100_40gb 51.9 12 1 192 29607 PURE FULL_SHARD False
760m 2048 8 a100_40gb 52.89 12 4 384 30173 PURE FULL_SHARD False
760m 1024 8 a100_40gb 53.63 24 4 768 33422 PURE FULL_SHARD False
760m 512 8 a100_40gb 53.47 48 4 1536 34938 PURE FULL_SHARD False
350m 32768 8 a100_40gb 51.55 1 4 32 13416 PURE FULL_SHARD False
350m 16384 8 a100_40gb 51.78 2 4 64 22896 PURE FULL_SHARD False
350m 8192 8 a100_40gb 51.39 4 4 128 34933 PURE FULL_SHARD False
350m 4096 8 a100_40gb 50.38 8 4 256 46833 PURE FULL_SHARD False
350m 2048 128 a100_40gb 45.61 18 1 2304 51934 PURE FULL_SHARD False
350m 2048 64 a100_40gb 46.27 18 1 1152 52689 PURE FULL_SHARD False
350m 2048 32 a100_40gb 47.26 18 1 576 53811 PURE FULL_SHARD False
350m 2048 16 a100_40gb 48.66 18 1 288 55413 PURE FULL_SHARD False
350m 2048 8 a100_40gb 49.17 16 4 512 55995 PURE FULL_SHARD False
350m 1024 8 a100_40gb 48.73 32 4 1024 62523 PURE FULL_SHARD False
350m 512 8 a100_40gb 48.39 64 4 2048 66284 PURE FULL_SHARD False
125m 32768 8 a100_40gb 47.27 1 4 32 32651 PURE FULL_SHARD False
125m 16384 8 a100_40gb 46.77 2 3 48 55484 PURE FULL_SHARD False
125m 8192 8 a100_40gb 46.94 5 3 120 86858 PURE FULL_SHARD False
125m 4096 8 a100_40gb 44.82 13 3 312 115162 PURE FULL_SHARD False
125m 2048 128 a100_40gb 38.86 26 1 3328 123936 PURE FULL_SHARD False
125m 2048 64 a100_40gb 39.27 26 1 1664 125234 PURE FULL_SHARD False
125m 2048 32 a100_40gb 39.86 26 1 832 127122 PURE FULL_SHARD False
125m 2048 16 a100_40gb 40.93 26 1 416 130535 PURE FULL_SHARD False
125m 2048 8 a100_40gb 42.75 26 3 624 136334 PURE FULL_SHARD False
125m 1024 8 a100_40gb 40.89 52 3 1248 148289 PURE FULL_SHARD False
125m 512 8 a100_40gb 40.26 104 3 2496 156735 PURE FULL_SHARD False
"""
# The same README's "H100 80GB FP8" table (added with the 8-64 GPU H100 table, #543, October 2023; sweep.sh runs
# every H100 line in fp8 and bf16): submit_benchmarks.py sets the model's fc_type 'te' (Transformer Engine 0.10's
# linears, installed for the fp8 runs) and Composer's amp_fp8 (TE's fp8_autocast, delayed scaling) under the same
# FSDP1 (DEFAULT, bf16 reduction as Composer 0.16 ran it) and Triton attention. The planner has no description of
# Transformer Engine's linears under FSDP (its te-* recipes are Megatron-Core's modules): the rows are evaluated with
# torchao's float8 recipe in their place, a stand-in, said so here and in docs/planner.md. The table's MFU is of the
# fp8 peak. Added on 2026-12-06 and evaluated first as the planner stood (held out: docs/heldout-2026-12-06/).
FOUNDRY_FP8_ROWS = """
3b 32768 8 h100_80gb 14.38 3 6 144 5856 DEFAULT FULL_SHARD True
3b 8192 8 h100_80gb 23.28 3 6 144 19146 DEFAULT FULL_SHARD False
3b 2048 8 h100_80gb 27.7 10 6 480 30586 DEFAULT FULL_SHARD False
3b 512 8 h100_80gb 30.25 40 6 1920 36527 DEFAULT FULL_SHARD False
1b 32768 8 h100_80gb 17.55 1 4 32 12580 DEFAULT FULL_SHARD False
1b 8192 8 h100_80gb 20.71 2 4 64 32010 DEFAULT FULL_SHARD False
1b 512 8 h100_80gb 29.06 56 4 1792 70315 DEFAULT FULL_SHARD False
"""
FOUNDRY_GPUS = {"h100_80gb": ("h100", "h100"), "a100_80gb": ("a100", "a100-80gb"),
                "a100_40gb": ("a100-40gb", "a100-40gb")}
"""The table's GPU column: the run-name tag and the catalogue's accelerator."""


def foundry_runs() -> list[Run]:
    runs = []
    lines = [(line, "bf16") for line in (FOUNDRY_ROWS + FOUNDRY_40GB_ROWS).split("\n")]
    for line, precision in lines + [(line, "fp8") for line in FOUNDRY_FP8_ROWS.split("\n")]:
        if not line.strip():
            continue
        size, seq, n, gpu, mfu, mb, accum, batch, tps, mode, sharding, ac = line.split()
        seq, n, mb, accum, batch, tps = int(seq), int(n), int(mb), int(accum), int(batch), int(tps)
        h, a, l = MPT[size]
        model = gpt(f"mpt-{size}", h, a, l, vocab=50368, seq=seq)
        zero = 3 if sharding == "FULL_SHARD" else 2
        recompute = "full" if ac == "True" else "none"
        tag, accelerator = FOUNDRY_GPUS[gpu]
        composer_17 = gpu == "h100_80gb" and n >= 128  # the large-scale table
        reduce_dtype = "bf16" if mode == "PURE" or not composer_17 else None
        fp8 = "fp8 " if precision == "fp8" else ""
        runs.append(Run(f"foundry {fp8}{tag} {size} s={seq} n={n} mb={mb}", model, n, seq, batch,
                        f"tp=1,pp=1,cp=1,dp_shard={n},zero_stage={zero},micro_batch={mb},grad_accum={accum},"
                        f"activation_checkpoint={recompute}", FOUNDRY,
                        f"{line.strip()} ({fp8}MFU %, T/s/GPU)", tflops=tps * flops_per_token(model, seq) / 1e12,
                        gpu=accelerator, system="llm-foundry", search=False, reduce_dtype=reduce_dtype,
                        precision=precision))
    return runs


# --------------------------------------------------------------------------------------------------
# Megatron-Core's scaling table (Megatron-LM README, images/model_table.png, July 2024): GPT models of 1.7B to 462B
# on 48 to 6,144 H100s, vocabulary 131,072, sequence 4,096, "Fine-grained overlapping with DP
# (--overlap-grad-reduce, --overlap-param-gather), TP (--tp-comm-overlap), and PP"; data parallelism 48 in every
# row. The parameter counts the table names are those of a GELU MLP of 4h with an untied output layer (1.7B: 12 x
# 24 x 2048^2 + 2 x 131072 x 2048 = 1.745B; 462B: 461.4B). --overlap-param-gather needs the distributed optimizer:
# ZeRO-1. Not stated: micro-batch, recompute, sequence parallelism, the pipeline schedule (completed by the search).
# Per-GPU teraFLOP/s are model FLOPs (the MFU column is them over the H100's 989 TF/s).
MCORE = ("Megatron-LM README, Performance Benchmarking (images/model_table.png), "
         "https://github.com/NVIDIA/Megatron-LM/blob/main/README.md")
MCORE_ROWS = [("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8, 0.41), ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9, 0.47),
              ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1, 0.49), ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6, 0.46),
              ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7, 0.42), ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5, 0.43),
              ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8, 0.44),
              ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4, 0.48),
              ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9, 0.47)]


def mcore_runs() -> list[Run]:
    runs = []
    for size, a, h, l, tp, pp, n, batch, tf, mfu in MCORE_ROWS:
        model = gpt(f"mcore-{size.lower()}", h, a, l, vocab=131072, seq=4096, tied=False)
        runs.append(Run(f"MCore {size} n={n}", model, n, 4096, batch,
                        f"tp={tp},pp={pp},cp=1,dp_replicate=48,zero_stage=1", MCORE,
                        f"{size}: {a} heads, hidden {h}, {l} layers, TP {tp}, PP {pp}, DP 48, {n} GPUs, batch {batch}, "
                        f"{tf} TF/s per GPU, MFU {mfu:.0%}", tflops=tf, mfu=mfu, gpu="h100", system="megatron-core"))
    return runs


# --------------------------------------------------------------------------------------------------
# NVIDIA's NeMo performance summaries: Megatron-Core (NeMo, later Megatron Bridge) pre-training on DGX-H100 in
# float8 through Transformer Engine, each row's GPUs, GBS, MBS, sequence length, TP, PP, CP, VP, FSDP and
# tokens/s per GPU as printed (the model TFLOP/s column is NeMo's own count; the planner compares tokens/s).
# * NeMo 24.07 (docs/source/performance/performance_summary.md of NVIDIA/NeMo: "pre-training performance ... at
#   FP8 precision", container NeMo24.07, System: DGX-H100): TE's default recipe then, delayed scaling. GPT3
#   models are NeMo's gpt3 configs (5B: hidden 4096, 24 layers, 32 heads; 20B: 6144, 44, 48; 175B: 12288, 96,
#   96; GELU MLP of 4h, tied embedding, the GPT-2 vocabulary padded to 50,304); Llama 2 13B is Meta's (5120, 40
#   layers, 40 heads, ffn 13,824, vocabulary 32,000); Nemotron-4 340B is the technical report's (arXiv 2406.11704:
#   96 layers, hidden 18,432, 96 heads, 8 KV heads, squared-ReLU MLP of 73,728 (priced as the GELU MLP of that
#   shape), vocabulary 256,000, untied). The Nemotron 8B and 22B rows are left out (their shapes are not
#   published with the table).
# * Megatron Bridge 25.11 and 26.02 (docs/performance-summary.md and docs/performance-summary-archive.md of
#   NVIDIA-NeMo/Megatron-Bridge, DGX-H100): 25.11 prints the precision FP8-CS (current scaling, te-current);
#   26.02 prints "FP8", taken as the same recipe as 25.11's on the same GPUs (an inference). FSDP 1 is
#   Megatron-Core's own FSDP (ZeRO-3 here), FSDP 0 its DDP with the distributed optimizer (ZeRO-1). The
#   mixture-of-experts rows and the other GPUs are left out.
# Recompute is not stated: the search completes it, as the micro-batch count and ZeRO stage where a row leaves
# them free, except for Nemotron-4 340B in 24.07, whose config in NeMo's launcher of that release
# (launcher_scripts/conf/training/nemotron/nemotron_340b.yaml at tag 24.07) sets selective recompute of the
# attention core, Apex's distributed Adam with its state in bf16 (optim.dtype bf16: Training.optimizer_dtype) and
# bf16 gradient reduction (grad_sync_dtype bf16); the other models' configs there set none of these. The GPT-3 and
# Llama example scripts of the same tag (examples/training/{gpt,llama}/h100/*_fp8*.sh, beside the README whose
# pre-training table prints these models, within a few percent of NeMo's summary) add
# +training.model.optim.grad_sync_dtype=bf16 to every one (PR #384's 175B script too): inferred that the summary's
# runs reduced their gradients in bf16 (grads_in_fp32 False, since 2026-12-07; the scripts' node counts are not
# all the summary's); the Nemotron-8B and -22B scripts do not. The GPT-3 configs of that tag keep Megatron's dropout
# of 0.1 (hidden_dropout, attention_dropout: launcher_scripts/conf/training/gpt3/*.yaml, which no script overrides), as
# the DGX Cloud rows' GPT-3 configs do (Run.dropout, since 2026-12-07); the Llama and Nemotron configs set 0.
# NeMo's H100 recipes overlap TP's communication with its GEMMs (userbuffers), which the planner does not model (as
# torchtitan's AsyncTP).
# The attention kernel of NVIDIA's NeMo runs of 2023-24. Transformer Engine picks DotProductAttention's backend at
# run time: since v1.2 (December 2023) it prefers cuDNN's fused attention to flash-attn on sm90 ("Select
# FusedAttention on sm90 and FlashAttention on others for performance", attention.py), which `--system megatron-core`
# describes (attention_kernel cudnn); before (v1.0-1.1, and the revision MLPerf Training v3.1's GPT-3 built,
# 09ba842 of October 2023, beside flash-attn 2.0.8 in its Dockerfile) flash-attn came first wherever it was
# installed. NeMo's launcher turned cuDNN's off for every job from 13 February 2024 ("NVTE_FUSED_ATTN: 0 # Disable
# cudnn FA until we've tested it more", launcher_scripts/conf/config.yaml of NVIDIA/NeMo-Framework-Launcher, in its
# tags 24.01 to 24.07) until 29 August 2024 ("enable fused attention", 04b8d09), but for jobs launched with PR #384's
# GPT-3 175B script from 13 August (20ab57b3: the script sets NVTE_FUSED_ATTN=1; the PR's 175b.yaml has the VP 6
# NeMo's 24.07 summary prints for 175B, where tag 24.07 has 12, though the script passes 12); the DGX Cloud recipes
# of 24.11.1 (NVIDIA/dgxc-benchmarking 35a9aec) kept the same variable at 0 for GPT-3 175B (nemo_megatron/launch.sh)
# and Nemotron-4 340B (nemotron/configure.sh; 1 for the 15B, and llama3.1/configure.sh 1 with NVTE_FLASH_ATTN 0), and
# 25.04.01's recipes set it to 1 or leave TE's default. Inferred from those settings (no source prints a run's
# kernel): NeMo 24.03.01's long-sequence runs, NeMo 24.07's performance summary but its GPT-3 175B rows (cuDNN: an
# uncertain call, on flash-attn they would be 1.04 and 0.99 instead of 1.06 and 1.01), those two DGX Cloud rows and
# MLPerf v3.1's GPT-3 ran flash-attn 2 (FlashAttention-2, 'flash2', its measured Hopper share), context parallelism
# included (TE's ring calls flash-attn's kernels then: AttnFuncWithCP, v1.4); assumed: NVIDIA's published NeMo runs
# of that time went through the launcher. MLPerf v4.0's and v4.1's LoRA configs set NVTE_FUSED_ATTN=1 and
# NVTE_FLASH_ATTN=0 (cuDNN). Found on 2026-12-07, after these rows had been evaluated with cuDNN's share (the
# long-sequence rows 1.14 to 1.60 optimistic, rising with the attention's share of the step).
NEMO_FLASH_ATTN = "flash2"
NEMO = ("NVIDIA NeMo performance summary, NeMo 24.07, "
        "https://github.com/NVIDIA/NeMo/blob/main/docs/source/performance/performance_summary.md")
BRIDGE = ("NVIDIA Megatron Bridge performance summary, "
          "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/docs/performance-summary.md and "
          "docs/performance-summary-archive.md")
NEMO_GPT = {"gpt3-5b": (4096, 32, 24), "gpt3-20b": (6144, 48, 44), "gpt3-175b": (12288, 96, 96)}
LLAMA2_13B = ModelArgs(name="llama2-13b", dim=5120, n_heads=40, n_kv_heads=40, n_layers=40, vocab_size=32000,
                       ffn_hidden=13824, max_seq_len=4096, tie_embeddings=False)
# Nemotron-8B and -22B as NeMo's launcher of 24.07 configures them (launcher_scripts/conf/training/nemotron/
# nemotron_{8b,22b}.yaml): multi-head attention, squared-ReLU MLP of 4h (two matrices, as GELU's), no bias, untied
# embeddings, Nemotron's 256,000-token SentencePiece vocabulary. Their two rows of the 24.07 table were added on
# 2026-12-05, after the Megatron-Core weight-gather overlap and the bf16 optimizer state, and evaluated before
# anything else changed (held out: docs/heldout-2026-12-05/nemo-24.07-nemotron-8b-22b-held-out.txt).
NEMOTRON_8B = ModelArgs(name="nemotron-8b", dim=4096, n_heads=32, n_kv_heads=32, n_layers=32, vocab_size=256000,
                        ffn_hidden=16384, mlp="gelu", max_seq_len=4096, tie_embeddings=False)
NEMOTRON_22B = ModelArgs(name="nemotron-22b", dim=6144, n_heads=48, n_kv_heads=48, n_layers=40, vocab_size=256000,
                         ffn_hidden=24576, mlp="gelu", max_seq_len=4096, tie_embeddings=False)
NEMOTRON4_340B = ModelArgs(name="nemotron4-340b", dim=18432, n_heads=96, n_kv_heads=8, n_layers=96, vocab_size=256000,
                           ffn_hidden=73728, mlp="gelu", max_seq_len=4096, tie_embeddings=False)
# release, model, GPUs, GBS, MBS, sequence, FSDP, TP, PP, CP, VP, tokens/s per GPU
NEMO_ROWS = [("24.07", "gpt3-5b", 64, 2048, 4, 2048, 0, 1, 1, 1, 1, 22521),
             ("24.07", "gpt3-20b", 64, 256, 2, 2048, 0, 2, 1, 1, 1, 5851),
             ("24.07", "gpt3-175b", 128, 256, 1, 2048, 0, 4, 8, 1, 6, 726),
             ("24.07", "gpt3-175b", 512, 2048, 2, 2048, 0, 4, 8, 1, 6, 782),
             ("24.07", "llama2-7b", 8, 128, 1, 4096, 0, 1, 1, 1, 1, 16847),
             ("24.07", "llama2-13b", 16, 128, 1, 4096, 0, 1, 4, 1, 10, 8646),
             ("24.07", "llama2-70b", 64, 128, 1, 4096, 0, 4, 4, 1, 20, 1707),
             ("24.07", "nemotron-8b", 64, 256, 4, 4096, 0, 2, 1, 1, 1, 12701),
             ("24.07", "nemotron-22b", 64, 256, 2, 4096, 0, 2, 4, 1, 10, 4256),
             ("24.07", "nemotron4-340b", 128, 32, 1, 4096, 0, 8, 8, 1, 12, 322),
             ("24.07", "llama3-8b", 8, 128, 1, 8192, 0, 1, 1, 2, 1, 12036),
             ("24.07", "llama3-70b", 64, 128, 1, 8192, 0, 4, 4, 2, 5, 1533),
             ("25.11", "llama3-8b", 8, 128, 1, 8192, 1, 1, 1, 1, 1, 14451),
             ("25.11", "llama3-70b", 64, 128, 1, 8192, 0, 4, 8, 1, 5, 1602),
             ("25.11", "llama3-405b", 1024, 512, 1, 8192, 0, 8, 8, 2, 8, 292),
             ("26.02", "llama3-70b", 64, 256, 1, 8192, 0, 4, 8, 1, 5, 1621),
             ("26.02", "llama3-405b", 1024, 1536, 1, 8192, 0, 8, 8, 2, 8, 311)]
# Megatron Bridge 25.11 on DGX-B200 (the same summary, "System: DGX-B200"), its two dense rows in FP8-CS (the
# parenthesised FP8-MX figures are another recipe, left out): Llama 3 8B on 8 GPUs and Llama 3.1 405B on 128, on the
# catalogue's B200 (179.1 GiB as nvidia-smi prints it; the DGX B200 datasheet: 1,440 GB of GPU memory for 8). Added
# on 2026-12-05 and evaluated first as the planner stood: held out (docs/planner.md, "NeMo in float8").
NEMO_B200_ROWS = [("25.11", "llama3-8b", 8, 128, 2, 8192, 0, 1, 1, 1, 1, 30624),
                  ("25.11", "llama3-405b", 128, 64, 1, 8192, 0, 4, 8, 2, 8, 661)]
# Megatron Bridge on DGX-GB200 (the same summaries' "DGX-GB200" tables, releases 25.09, 25.11 and 26.02 as the H100
# rows above): its dense rows in FP8 with current scaling (25.09's table prints no precision column, its
# parenthesised figures being the FP8-MX recipe; 25.11 prints FP8-CS; 26.02 FP8, taken as the same), Llama 3 8B on 8
# GPUs, 70B on 64 under Megatron-FSDP, 405B on 128 (25.09: FSDP 64 x TP 2) or 256 (TP 4 x PP 16 x VP 4). A GB200
# NVL72 rack links 72 GPUs by NVLink; the jobs are taken to use 64 of each rack (16 of its 18 compute trays, whole
# powers of two of GPUs: an inference, the summaries state no placement), so the 405B's 128 and 256 GPUs span two and
# four racks over the trays' 400 Gb/s NICs. The MXFP8 and NVFP4 rows are left out (block-scaled recipes the planner
# does not describe), as are the GB300 rows (Blackwell Ultra, not in the catalogue). Added on 2026-12-07 with the
# catalogue's GB200 and evaluated first as the planner stood (held out: docs/heldout-2026-12-07/bridge-gb200-held-
# out.txt). The 405B's jobs ran torch's allocator with expandable segments: the perf scripts set
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for llama31 405b on gb200 in FP8-CS and FP8-MX (v0.1.0rc4
# setup_experiment.py, v0.2.0 and v0.3.0 perf_plugins.py), for no other dense job (Run.expandable_segments, since
# 2026-12-07, after the set was evaluated).
BRIDGE_GB200_RACK = 64
# ..., recompute, blocks' activations offloaded (each release's scripts/performance configs, below)
BRIDGE_GB200_ROWS = [("25.09", "llama3-8b", 8, 128, 2, 8192, 0, 1, 1, 1, 1, 31357, "none", 0),
                     ("25.09", "llama3-70b", 64, 128, 2, 8192, 1, 1, 1, 1, 1, 3986, "none", 40),
                     ("25.09", "llama3-405b", 128, 64, 1, 8192, 1, 2, 1, 1, 1, 729, "none", 95),
                     ("25.11", "llama3-8b", 8, 128, 2, 8192, 0, 1, 1, 1, 1, 31508, "none", 0),
                     ("25.11", "llama3-70b", 64, 256, 2, 8192, 1, 1, 1, 1, 1, 4312, "none", 40),
                     ("25.11", "llama3-405b", 256, 1536, 1, 8192, 0, 4, 16, 1, 4, 813, None, 0),
                     ("26.02", "llama3-70b", 64, 256, 2, 8192, 1, 1, 1, 1, 1, 4040, "none", 40),
                     ("26.02", "llama3-405b", 256, 1536, 1, 8192, 0, 4, 16, 1, 4, 793, "none", 0)]


# NVIDIA's DGX Cloud benchmarking recipes, release 25.04.01 (github.com/NVIDIA/dgxc-benchmarking, commit 85380ff:
# llama3.1/README.md, nemotron/README.md, nemo_megatron/README_175b.md and each folder's launch.sh): NeMo 25.02.01
# (NeMo 2.0's performance recipes, pretrain_recipe(performance_mode=True)) for Llama 3.1 and Nemotron-4, NeMo 24.12
# (its GPT-3 175B hydra config) for GPT-3, pre-training on DGX-H100 in BF16 and in FP8 (bf16_with_fp8_mixed and
# fp8_hybrid with an amax history of 1024: Transformer Engine's delayed scaling). Each table states the layout and
# "Training step time (seconds per step)", the last of 50 or 100 steps; every table grows GBS with the GPUs (weak
# scaling) and its step times move by under 6% from the smallest count to the largest, so the smallest and the
# largest are kept (the 405B proxies with fewer layers, below 512 GPUs, are left out). Nemotron-4 15B is the technical
# report's shape (arXiv 2402.16819: 32 layers, hidden 6,144, 48 heads, 8 KV heads, squared-ReLU MLP of 24,576 priced
# as the GELU MLP of that shape, vocabulary 256,000, untied); its README's table prints VP "NA" for the 340B and
# launch.sh sets 12. Added on 2026-12-05 and evaluated first as the planner stood: held out (docs/planner.md, "NVIDIA's
# DGX Cloud recipes, held out").
DGXC = ("NVIDIA DGX Cloud benchmarking recipes 25.04.01, https://github.com/NVIDIA/dgxc-benchmarking (commit 85380ff), "
        "llama3.1/README.md, nemotron/README.md, nemo_megatron/README_175b.md")
NEMOTRON4_15B = ModelArgs(name="nemotron4-15b", dim=6144, n_heads=48, n_kv_heads=8, n_layers=32, vocab_size=256000,
                          ffn_hidden=24576, mlp="gelu", max_seq_len=4096, tie_embeddings=False)
# NeMo, model, precision, GPUs, GBS, MBS, sequence, TP, PP, CP, VP, seconds per step
DGXC_ROWS = [("25.02.01", "llama3-8b", "bf16", 8, 128, 1, 8192, 1, 1, 2, 1, 12.27),
             ("25.02.01", "llama3-8b", "bf16", 128, 2048, 1, 8192, 1, 1, 2, 1, 12.33),
             ("25.02.01", "llama3-8b", "fp8", 8, 128, 1, 8192, 1, 1, 2, 1, 9.33),
             ("25.02.01", "llama3-8b", "fp8", 128, 2048, 1, 8192, 1, 1, 2, 1, 9.54),
             ("25.02.01", "llama3-70b", "bf16", 64, 128, 1, 8192, 4, 4, 2, 5, 14.66),
             ("25.02.01", "llama3-70b", "bf16", 2048, 4096, 1, 8192, 4, 4, 2, 5, 14.66),
             ("25.02.01", "llama3-70b", "fp8", 64, 128, 1, 8192, 4, 8, 1, 5, 9.86),
             ("25.02.01", "llama3-70b", "fp8", 2048, 4096, 1, 8192, 4, 8, 1, 5, 10.15),
             ("25.02.01", "llama3-405b", "bf16", 512, 256, 1, 8192, 8, 8, 2, 8, 19.78),
             ("25.02.01", "llama3-405b", "bf16", 2048, 1024, 1, 8192, 8, 8, 2, 8, 19.87),
             ("25.02.01", "llama3-405b", "fp8", 512, 256, 1, 8192, 8, 8, 2, 8, 12.37),
             ("25.02.01", "llama3-405b", "fp8", 2048, 1024, 1, 8192, 8, 8, 2, 8, 12.56),
             ("25.02.01", "nemotron4-15b", "bf16", 16, 64, 2, 4096, 2, 1, 1, 1, 2.66),
             ("25.02.01", "nemotron4-15b", "bf16", 2048, 8192, 2, 4096, 2, 1, 1, 1, 2.78),
             ("25.02.01", "nemotron4-15b", "fp8", 16, 64, 2, 4096, 2, 1, 1, 1, 1.98),
             ("25.02.01", "nemotron4-15b", "fp8", 2048, 8192, 2, 4096, 2, 1, 1, 1, 2.09),
             ("25.02.01", "nemotron4-340b", "bf16", 256, 64, 1, 4096, 8, 8, 1, 12, 4.36),
             ("25.02.01", "nemotron4-340b", "bf16", 2048, 512, 1, 4096, 8, 8, 1, 12, 4.43),
             ("25.02.01", "nemotron4-340b", "fp8", 256, 64, 1, 4096, 8, 8, 1, 12, 2.93),
             ("25.02.01", "nemotron4-340b", "fp8", 2048, 512, 1, 4096, 8, 8, 1, 12, 3.05),
             ("24.12", "gpt3-175b", "bf16", 128, 256, 1, 2048, 4, 8, 1, 6, 8.309),
             ("24.12", "gpt3-175b", "bf16", 2048, 4096, 1, 2048, 4, 8, 1, 6, 8.49),
             ("24.12", "gpt3-175b", "fp8", 128, 256, 1, 2048, 4, 8, 1, 6, 5.626),
             ("24.12", "gpt3-175b", "fp8", 2048, 4096, 1, 2048, 4, 8, 1, 6, 5.96)]

# The same repository's release 24.11.1 (commit 35a9aec: llama3.1/README_{8b,70b,405b}.md, nemotron/README_15b.md,
# nemo_megatron/README_175b.md, and each folder's launch.sh, configure.sh and yamls): NeMo 1's hydra path
# (megatron_gpt_pretraining.py) in nemo:24.09 (Llama 3.1, Nemotron-4) and nemo:24.05 (GPT-3), Apex's distributed
# Adam over dp x cp with grad_sync_dtype bf16, no recompute, TE's delayed scaling, other layouts than 25.04.01's:
# Llama 3.1 70B FP8 on its BF16 layout, 405B on t8 p9 c2 v7 as a proxy (16 KV groups, the GPT-2 vocabulary padded to
# 51,200: its yaml), Nemotron-4 15B on t4 with micro-batch 4, GPT-3 175B on v12. Added on 2026-12-05 after the
# changes the 25.04.01 rows led to, and evaluated with nothing changed after it (held out). Nemotron-4 340B
# (nemotron/README_340b.md, t8 p8 v12, 128 to 2,048 GPUs) was left out then: its yaml (nemotron4-340b-synth.yaml)
# keeps Adam's state in bf16 (optim.dtype bf16), which the planner had no knob for, and recomputes the attention core
# (activations_checkpoint_granularity selective). Its four rows were added once Training.optimizer_dtype was read
# from NeMo's and Apex's code (on the same day, after the Megatron-Core weight-gather overlap), and evaluated before
# anything else changed (held out: docs/heldout-2026-12-05/dgxc-24.11.1-nemotron4-340b-held-out.txt).
DGXC_2411 = ("NVIDIA DGX Cloud benchmarking recipes 24.11.1, https://github.com/NVIDIA/dgxc-benchmarking (commit "
             "35a9aec), llama3.1/README_{8b,70b,405b}.md, nemotron/README_15b.md, nemo_megatron/README_175b.md")
LLAMA31_405B_PROXY = ModelArgs(name="llama31-405b-proxy", dim=16384, n_heads=128, n_kv_heads=16, n_layers=126,
                               vocab_size=51200, ffn_hidden=53248, max_seq_len=8192, tie_embeddings=False)
DGXC_2411_ROWS = [("24.09", "llama3-8b", "bf16", 8, 128, 1, 8192, 1, 1, 2, 1, 12.91),
                  ("24.09", "llama3-8b", "bf16", 128, 2048, 1, 8192, 1, 1, 2, 1, 13.10),
                  ("24.09", "llama3-8b", "fp8", 8, 128, 1, 8192, 1, 1, 2, 1, 9.67),
                  ("24.09", "llama3-8b", "fp8", 128, 2048, 1, 8192, 1, 1, 2, 1, 9.82),
                  ("24.09", "llama3-70b", "bf16", 64, 128, 1, 8192, 4, 4, 2, 5, 14.72),
                  ("24.09", "llama3-70b", "bf16", 2048, 4096, 1, 8192, 4, 4, 2, 5, 14.98),
                  ("24.09", "llama3-70b", "fp8", 64, 128, 1, 8192, 4, 4, 2, 5, 11.01),
                  ("24.09", "llama3-70b", "fp8", 2048, 4096, 1, 8192, 4, 4, 2, 5, 11.39),
                  ("24.09", "llama31-405b-proxy", "bf16", 576, 252, 1, 8192, 8, 9, 2, 7, 17.20),
                  ("24.09", "llama31-405b-proxy", "bf16", 2304, 1008, 1, 8192, 8, 9, 2, 7, 17.62),
                  ("24.09", "llama31-405b-proxy", "fp8", 576, 252, 1, 8192, 8, 9, 2, 7, 11.24),
                  ("24.09", "llama31-405b-proxy", "fp8", 2304, 1008, 1, 8192, 8, 9, 2, 7, 12.35),
                  ("24.09", "nemotron4-15b", "bf16", 16, 64, 4, 4096, 4, 1, 1, 1, 2.83),
                  ("24.09", "nemotron4-15b", "bf16", 2048, 8192, 4, 4096, 4, 1, 1, 1, 2.96),
                  ("24.09", "nemotron4-15b", "fp8", 16, 64, 4, 4096, 4, 1, 1, 1, 2.08),
                  ("24.09", "nemotron4-15b", "fp8", 2048, 8192, 4, 4096, 4, 1, 1, 1, 2.18),
                  ("24.05", "gpt3-175b", "bf16", 128, 256, 1, 2048, 4, 8, 1, 12, 8.91),
                  ("24.05", "gpt3-175b", "bf16", 2048, 4096, 1, 2048, 4, 8, 1, 12, 9.02),
                  ("24.05", "gpt3-175b", "fp8", 128, 256, 1, 2048, 4, 8, 1, 12, 5.92),
                  ("24.05", "gpt3-175b", "fp8", 2048, 4096, 1, 2048, 4, 8, 1, 12, 6.24),
                  ("24.09", "nemotron4-340b", "bf16", 128, 32, 1, 4096, 8, 8, 1, 12, 4.61),
                  ("24.09", "nemotron4-340b", "bf16", 2048, 512, 1, 4096, 8, 8, 1, 12, 4.84),
                  ("24.09", "nemotron4-340b", "fp8", 128, 32, 1, 4096, 8, 8, 1, 12, 3.16),
                  ("24.09", "nemotron4-340b", "fp8", 2048, 512, 1, 4096, 8, 8, 1, 12, 3.49)]


def pp_knobs(pp: int, vp: int) -> str:
    """Megatron's pipeline schedule as a table prints it: interleaved where it gives virtual stages, else 1F1B."""
    if pp == 1:
        return ""
    return f",pp_schedule=interleaved-1f1b,virtual_stages={vp}" if vp > 1 else ",pp_schedule=1f1b"


def nemo_model(name: str, seq: int) -> ModelArgs:
    """The model one of NVIDIA's NeMo tables names, as NeMo's configs shape it (the presets for the rest)."""
    if name in NEMO_GPT:
        return gpt(name, *NEMO_GPT[name], vocab=50304, seq=seq)
    model = {"llama2-13b": LLAMA2_13B, "nemotron-8b": NEMOTRON_8B, "nemotron-22b": NEMOTRON_22B,
             "nemotron4-15b": NEMOTRON4_15B, "nemotron4-340b": NEMOTRON4_340B,
             "llama31-405b-proxy": LLAMA31_405B_PROXY}.get(name) or preset(name)
    return dataclasses.replace(model, max_seq_len=max(seq, model.max_seq_len))


def dgxc_runs() -> list[Run]:
    runs = []
    for source, rows in ((DGXC, DGXC_ROWS), (DGXC_2411, DGXC_2411_ROWS)):
        runs += [_dgxc_run(source, *row) for row in rows]
    return runs


def _dgxc_run(source: str, nemo: str, name: str, precision: str, n: int, gbs: int, mbs: int, seq: int, tp: int,
              pp: int, cp: int, vp: int, step_s: float) -> Run:
    model = nemo_model(name, seq)
    dp = n // (tp * pp * cp)
    nemotron_1 = nemo == "24.09" and name == "nemotron4-340b"  # NeMo 1's 340B yaml: bf16 Adam, selective recompute
    plan = (f"tp={tp},pp={pp},cp={cp},dp_replicate={dp},zero_stage=1,micro_batch={mbs},"
            f"activation_checkpoint={'selective' if nemotron_1 else 'none'}")
    plan += pp_knobs(pp, vp)
    row = (f"{name} {precision.upper()} | {n} GPUs | GBS {gbs} | MBS {mbs} | {seq} | TP {tp} | PP {pp} | CP {cp} | "
           f"VP {vp} | {step_s} s per step")
    tflops = gbs * seq * flops_per_token(model, seq) / (step_s * n * 1e12)
    short = name.removeprefix("gpt3-").upper() if "gpt3" in name else name
    return Run(f"DGXC {nemo} {short} {precision.upper()} n={n}", model, n, seq, gbs, plan, source,
               f"NeMo {nemo}, DGX-H100: {row}", tflops=tflops, step_s=step_s, gpu="h100",
               system="megatron-core", search=False, precision=precision,
               float8="te-delayed" if precision == "fp8" else None, grads_in_fp32=False, dropout=name in NEMO_GPT,
               optimizer_dtype="bf16" if nemotron_1 else None,
               attention_kernel=NEMO_FLASH_ATTN if source == DGXC_2411 and name in ("gpt3-175b", "nemotron4-340b")
               else None)


def nemo_runs() -> list[Run]:
    return ([_nemo_run(*row, "h100") for row in NEMO_ROWS] + [_nemo_run(*row, "b200") for row in NEMO_B200_ROWS])


def bridge_gb200_runs() -> list[Run]:
    return [_nemo_run(*row, "gb200", label="Bridge", recompute=recompute, offload_layers=offload,
                      expandable_segments=row[1] == "llama3-405b")
            for *row, recompute, offload in BRIDGE_GB200_ROWS]


# Megatron Bridge 26.06's fine-tuning rows (docs/performance-summary-archive.md of NVIDIA-NeMo/Megatron-Bridge, "26.06
# NeMo Container", "SFT Performance" and "LoRA Performance", Model: LLAMA3_70B; the release's first fine-tuning
# tables): Llama 3 70B in FP8 on DGX-H100 and DGX-GB200, the layout and tokens/s per GPU as printed, each as the
# release's recipe runs it (Megatron Bridge v0.5.0: scripts/performance/configs/llama/llama3_llm_finetune.py and
# llama3_workload_base_configs.py, LLAMA3_70B_{SFT,LORA}_CONFIG_{H100,GB200}_FP8_CS_V1, over
# src/megatron/bridge/recipes/llama/llama3.py): FP8 with per-tensor current scaling (the FP8_CS configs), 4,096-token
# sequences priced whole (the perf scripts' --data defaults to mock sequences of that length, in place of the
# recipe's packed SQuAD; which data the summary ran is not recorded), micro-batch 1, global batch 32, no recompute, the
# distributed optimizer with
# bf16 gradient reduction (set_llama3_common_peft_configs), sequence parallelism where tp > 1 (WorkloadBaseConfig),
# TP communication overlap (not priced, as everywhere), Transformer Engine's CUDA graphs of the MLP where the config
# sets them (not priced: the planner has no host term), torch's allocator with expandable segments (PERF_ENV_VARS of
# v0.5.0's Slurm executor, every job); LoRA of rank 16 (llama3_70b_peft_config; alpha 32, no dropout) on linear_qkv
# alone (the perf configs' target_modules override), the base frozen and kept in FP8 (the precision config's
# fp8_param_gather). The GB200 jobs of 32 and 8 GPUs
# sit in one NVL72 rack. The GB300 rows and the MXFP8 recipe are left out (not in the catalogue; block-scaled float8
# not described). Added on 2026-12-07 and evaluated first as the planner stood (held out: docs/heldout-2026-12-07/
# bridge-finetune-held-out.txt).
BRIDGE_FINETUNE_ROWS = [("SFT", "h100", 32, 4, 4, 5, 1638), ("LoRA", "h100", 8, 2, 4, 20, 2643),
                        ("SFT", "gb200", 32, 1, 8, 10, 3864), ("LoRA", "gb200", 8, 1, 2, 20, 6206)]


def bridge_finetune_runs() -> list[Run]:
    model = nemo_model("llama3-70b", 4096)
    runs = []
    for mode, gpu, n, tp, pp, vp, tps in BRIDGE_FINETUNE_ROWS:
        lora = mode == "LoRA"
        dp = n // (tp * pp)
        plan = (f"tp={tp},pp={pp},cp=1,dp_replicate={dp},zero_stage={int(dp > 1)},micro_batch=1,"
                "activation_checkpoint=none,"
                f"sequence_parallel={str(tp > 1).lower()}") + pp_knobs(pp, vp)
        row = f"26.06 DGX-{gpu.upper()} FP8 {mode} LLAMA3_70B | {n} | GBS 32 | MBS 1 | 4096 | TP {tp} | PP {pp} | " \
              f"VP {vp} | {tps} tokens/s/GPU"
        runs.append(Run(f"BridgeFT 26.06 {mode} llama3-70b {gpu.upper()} n={n}", model, n, 4096, 32, plan, BRIDGE,
                        row, tflops=tps * flops_per_token(model, 4096) / 1e12, gpu=gpu, system="megatron-core",
                        gpus_per_node=BRIDGE_GB200_RACK if gpu == "gb200" else 8, search=False, precision="fp8",
                        float8="te-current", grads_in_fp32=False, expandable_segments=True,
                        lora_rank=16 if lora else 0, lora_targets=("wq", "wk", "wv") if lora else PROJECTIONS))
    return runs


def _nemo_run(release: str, name: str, n: int, gbs: int, mbs: int, seq: int, fsdp: int, tp: int, pp: int, cp: int,
              vp: int, tps: float, gpu: str, label: str = "NeMo", recompute: str | None = None,
              offload_layers: int = 0, expandable_segments: bool | None = None) -> Run:
    model = nemo_model(name, seq)
    dp = n // (tp * pp * cp)
    dp_knobs = f"dp_shard={dp},zero_stage=3" if fsdp else f"dp_replicate={dp},zero_stage=1"
    plan = f"tp={tp},pp={pp},cp={cp},{dp_knobs},micro_batch={mbs}"
    nemotron_1 = release == "24.07" and name == "nemotron4-340b"  # its launcher config (above)
    if nemotron_1:
        plan += ",activation_checkpoint=selective"
    if recompute is not None:
        plan += f",activation_checkpoint={recompute}"
    plan += pp_knobs(pp, vp)
    row = (f"{name} | {n} | GBS {gbs} | MBS {mbs} | {seq} | FSDP {fsdp} | TP {tp} | PP {pp} | CP {cp} | VP {vp} | "
           f"{tps} tokens/s/GPU")
    on = "" if gpu == "h100" else f"{gpu.upper()} "
    return Run(f"{label} {release} {on}{name.removeprefix('gpt3-').upper() if 'gpt3' in name else name} n={n}",
               model, n, seq, gbs, plan, NEMO if release == "24.07" else BRIDGE,
               f"{release} DGX-{gpu.upper()} FP8{'-CS' if release == '25.11' else ''}: {row}",
               tflops=tps * flops_per_token(model, seq) / 1e12, gpu=gpu, system="megatron-core",
               gpus_per_node=BRIDGE_GB200_RACK if gpu == "gb200" else 8,
               search=False, precision="fp8", float8="te-delayed" if release == "24.07" else "te-current",
               attention_kernel=NEMO_FLASH_ATTN if release == "24.07" and name != "gpt3-175b" else None,
               optimizer_dtype="bf16" if nemotron_1 else None, offload_layers=offload_layers,
               expandable_segments=expandable_segments,
               grads_in_fp32=None if release == "24.07" and name.startswith("nemotron-") else False,
               dropout=True if release == "24.07" and name in NEMO_GPT else None)


# --------------------------------------------------------------------------------------------------
# NeMo's long-sequence performance (docs/source/performance/performance_long_sequence.md of NVIDIA/NeMo, in its
# documentation from October 2024 to May 2025; the "Batch Size" column from commit 14d427f575, April 2025): Llama 2
# 7B in FP8 on DGX-H100, NeMo 24.03.01, sequence 4K to 1M tokens on as many GPUs as thousands of tokens, a global
# batch of 4M tokens, and the layout "with CP" stated (TP, PP, DP, CP; the GPUs are their product in every row):
# model TFLOPS per GPU. NeMo's model FLOPs (nemo/utils/flops_formulas.py llama2: 12 + 12 g/a + 18 f/h + 12 s/h +
# 6 V/(L h), times the batch's tokens, L and h^2) are the planner's flops_per_token term for term (the attention at
# 12 L h s, without the causal mask's saving), so the published throughput converts to tokens exactly. Described as
# `--system megatron-core` with Transformer Engine's delayed scaling (the default then); the micro-batch and the
# recompute are not stated (completed by the search), nor the 8K row's schedule (taken as 1F1B); the gradients
# reduced in bf16, inferred from the release's Llama 2 7B FP8 script, a one-node 4K run (NeMo-Framework-Launcher
# 24.03.01, examples/training/llama/h100/llama2_7b_fp8.sh: +training.model.optim.grad_sync_dtype=bf16; since
# 2026-12-07).
# The "without CP"
# column states no layout, and the same file's DGX-B200 table (Llama 3 8B, NeMo 25.04) prints TP x PP x DP x CP a
# quarter of its GPU count in every row: both left out. Added on 2026-12-05 and evaluated first as the planner stood
# (held out: docs/heldout-2026-12-05/).
NEMO_LONG = ("NVIDIA NeMo, long sequence performance (docs/source/performance/performance_long_sequence.md), "
             "https://github.com/NVIDIA/NeMo/blob/r2.3.0/docs/source/performance/performance_long_sequence.md")
# sequence (K), GPUs, global batch, TP, PP, DP, CP, TFLOPS / GPU with CP
NEMO_LONG_ROWS = [(4, 4, 1024, 1, 1, 4, 1, 768), (8, 8, 512, 1, 2, 4, 1, 730), (16, 16, 256, 2, 1, 8, 1, 660),
                  (32, 32, 128, 2, 1, 8, 2, 610), (64, 64, 64, 4, 1, 8, 2, 574), (128, 128, 32, 4, 1, 8, 4, 555),
                  (256, 256, 16, 4, 1, 8, 8, 549), (512, 512, 8, 8, 1, 4, 16, 549), (1024, 1024, 4, 8, 1, 4, 32, 536)]


def nemo_long_runs() -> list[Run]:
    runs = []
    for k, n, gbs, tp, pp, dp, cp, tflops in NEMO_LONG_ROWS:
        assert tp * pp * dp * cp == n
        seq = k * 1024
        model = dataclasses.replace(preset("llama2-7b"), max_seq_len=seq)
        plan = f"tp={tp},pp={pp},cp={cp},dp_replicate={dp},zero_stage=1" + (",pp_schedule=1f1b" if pp > 1 else "")
        row = f"{k} | {n} | {gbs} | TP {tp} | PP {pp} | DP {dp} | CP {cp} | {tflops} TFLOPS/GPU"
        runs.append(Run(f"NeMoCP 24.03 Llama2-7B {k}K n={n}", model, n, seq, gbs, plan, NEMO_LONG,
                        f"LLAMA2-7B (FP8), NeMo 24.03.01, DGX-H100: {row}", tflops=tflops, gpu="h100",
                        system="megatron-core", search=False, precision="fp8", float8="te-delayed",
                        attention_kernel=NEMO_FLASH_ATTN, grads_in_fp32=False))
    return runs


# --------------------------------------------------------------------------------------------------
# NeMo 24.07's fine-tuning benchmark (NVIDIA/NeMo-Framework-Launcher at tag 24.07, examples/README.md, "Benchmark
# performance numbers (finetuning)": "LLAMA2 models with SFT (supervised fine-tuning), and LoRA (Low-rank adaptors)
# on DGXH100, with FP8", SQuAD v1.1 "packed to 4096 tokens", tokens/s per GPU), each row run by the script beside it
# (examples/peft/llama/h100/{7b,13b}_1node.sh, 70b_2node.sh and *_lora.sh) over launcher_scripts/conf/peft/llama/
# sft.yaml: micro-batch 1, global batch 32, FP8 with TE's delayed scaling (fp8_hybrid, amax history 512) and the
# weights stored in float8 (fp8_params), no recompute, no dropout, megatron_amp_O2, mcore_gpt; the launcher's
# NVTE_FUSED_ATTN=0 (NEMO_FLASH_ATTN). SFT (peft_scheme null): every weight trained by Apex's distributed Adam with
# its state in bf16 (optim dtype bf16, grad_sync_dtype bf16: optimizer_dtype, grads_in_fp32 False; ZeRO-1 where
# there is more than one data-parallel rank, the 70B's one unsharded); 13B on PP 4 x
# VP 10 and 70B on TP 4 (sequence parallel) x PP 4 x VP 20, their pipeline sends overlapped (overlap_p2p_comm, the
# interleaved schedule's); 70B also ub_tp_comm_overlap (not priced). LoRA (peft_scheme lora): NeMo's default target,
# linear_qkv alone (nemo/collections/nlp/parts/peft_config.py get_target_modules, default ("attention_qkv",)),
# rank 32 (lora_tuning.adapter_dim), no dropout, the frozen weights in float8; Apex's FusedAdam over the adapters
# (optim.name fused_adam: nothing sharded); 70B on TP 2 (sequence_parallel left False, which turns its
# ub_tp_comm_overlap off) x PP 4, 1F1B. Not described: the packing (the planner prices causal attention over the
# 4,096 tokens, where flash-attn's varlen kernel attends within each SQuAD sample), and TE's cache of the frozen
# float8 weights' transposes, which these configs leave on (the planner makes them afresh each backward, as
# MLPerf's LoRA configs asked: Training.float8_frozen_weights). NeMo's own performance summary printed the same six
# rows for 24.07 (docs/source/performance/performance_summary.md, 4c73f77, from which the pre-training rows above
# come) 1.4-6.3% faster but LoRA 13B (2.3% slower): the launcher's README, beside the scripts, is taken. Added on
# 2026-12-07 and evaluated first as the planner stood (held out: docs/heldout-2026-12-07/nemo-24.07-finetuning-held-
# out.txt).
NEMO_FINETUNE = ("NVIDIA NeMo Framework Launcher 24.07, examples/README.md, Benchmark performance numbers "
                 "(finetuning), https://github.com/NVIDIA/NeMo-Framework-Launcher/blob/24.07/examples/README.md")
# mode, model, GPUs, TP, PP, VP, tokens/s per GPU
NEMO_FINETUNE_ROWS = [("SFT", "llama2-7b", 8, 1, 1, 1, 16891), ("SFT", "llama2-13b", 8, 1, 4, 10, 9384),
                      ("SFT", "llama2-70b", 16, 4, 4, 20, 1739), ("LoRA", "llama2-7b", 8, 1, 1, 1, 23711),
                      ("LoRA", "llama2-13b", 8, 1, 1, 1, 14499), ("LoRA", "llama2-70b", 8, 2, 4, 1, 2470)]


def nemo_finetune_runs(rows=NEMO_FINETUNE_ROWS, label: str = "NeMoFT 24.07", source: str = NEMO_FINETUNE,
                       quote: str = "") -> list[Run]:
    runs = []
    for mode, name, n, tp, pp, vp, tps in rows:
        model = LLAMA2_13B if name == "llama2-13b" else preset(name)
        lora = mode == "LoRA"
        dp = n // (tp * pp)
        sp = mode == "SFT" and tp > 1
        plan = (f"tp={tp},pp={pp},cp=1,dp_replicate={dp},zero_stage={int(not lora and dp > 1)},micro_batch=1,"
                f"activation_checkpoint=none,sequence_parallel={str(sp).lower()}")
        plan += pp_knobs(pp, vp)
        row = f"{quote}{name.upper()} | {mode} | {n} | 32 | 1 | 4096 | {tp} | {pp} | {tps} tokens/s/GPU"
        runs.append(Run(f"{label} {mode} {name} n={n}", model, n, 4096, 32, plan, source, row,
                        tflops=tps * flops_per_token(model, 4096) / 1e12, gpu="h100", system="megatron-core",
                        search=False, precision="fp8", float8="te-delayed", attention_kernel=NEMO_FLASH_ATTN,
                        grads_in_fp32=None if lora else False, optimizer_dtype=None if lora else "bf16",
                        lora_rank=32 if lora else 0, lora_targets=("wq", "wk", "wv") if lora else PROJECTIONS))
    return runs


# --------------------------------------------------------------------------------------------------
# NeMo's launcher of 2024, its first two benchmark tables (NVIDIA/NeMo-Framework-Launcher, examples/README.md,
# "Benchmark performance numbers (pretraining)" and "(finetuning)": DGX-H100, FP8, tokens/s per GPU, each row's
# GPUs, GBS, MBS, sequence, TP and PP as printed), before the table NeMo 24.07's rows above come from:
# * 5 March 2024 (commit fa27ba49, kept at tag 24.03.01), run in the launcher's container of then, NeMo 24.01
#   (launcher_scripts/conf/config.yaml: nemo:24.01.framework until 12 March, then 24.01.01): GPT-3 5B and 20B,
#   Llama 2 7B, 13B and 70B, Nemotron-8B and -22B, and the six fine-tuning rows (SFT and LoRA of Llama 2; the same
#   layouts as 24.07's, 4-18% slower, unchanged in April).
# * 22 April 2024 (81b75a7c, "update GPT and LLAMA2 training records"; the container line names 24.01.01, moved to
#   24.03.01 two days later): GPT-3 5B and 20B and the three Llama 2 rows again, 4-8% faster; the Nemotron rows are
#   March's, kept.
# Left out: GPT-3 175B (its 741 tokens/s is MLPerf's, a link), and the June table (NeMo 24.05, the 24.07 summary's
# layouts). Described as NeMo 24.07's rows above are (nemo_runs: TE's delayed scaling, flash-attn through the
# launcher's NVTE_FUSED_ATTN 0, which config.yaml sets at both dates, the GPT-3 and Llama scripts' bf16 gradient
# reduction (examples/training/*/h100/*_fp8*.sh at tag 24.03.01), the GPT-3 configs' dropout of 0.1; recompute and
# sequence parallelism left to the search), their configs at tag 24.03.01 being 24.07's (but the Llama configs'
# bias-dropout-add fusion off, the Nemotron configs' gradient-accumulation fusion off and no fused cross-entropy:
# not priced). Where a
# printed layout differs from its config (the configs: 20B TP 2, MBS 2; Llama 2 13B TP 1, PP 4, VP 10; Nemotron-22B
# TP 2, PP 4, VP 10, MBS 1), the printed one is taken, with the config's virtual stages where its pipeline depth is
# the config's (Llama 2 70B VP 20, Nemotron-22B VP 10). April's 13B prints TP 4, PP 1 (June's: TP 1, PP 4, the
# config's, at 8,344 tokens/s): taken as printed. Added on 2026-12-07 and evaluated first as the planner stood
# (held out: docs/heldout-2026-12-07/nemo-launcher-2024-held-out.txt).
NEMO_LAUNCHER_2024 = {
    "24.01": ("NVIDIA NeMo Framework Launcher, examples/README.md of 5 March 2024 (tag 24.03.01), "
              "https://github.com/NVIDIA/NeMo-Framework-Launcher/blob/24.03.01/examples/README.md"),
    "24.04": ("NVIDIA NeMo Framework Launcher, examples/README.md of 22 April 2024 (commit 81b75a7c), "
              "https://github.com/NVIDIA/NeMo-Framework-Launcher/blob/81b75a7c/examples/README.md")}
# table, model, GPUs, GBS, MBS, sequence, TP, PP, VP, tokens/s per GPU
NEMO_LAUNCHER_2024_ROWS = [("24.01", "gpt3-5b", 64, 2048, 4, 2048, 1, 1, 1, 22599),
                           ("24.01", "gpt3-20b", 64, 256, 4, 2048, 4, 1, 1, 5152),
                           ("24.01", "llama2-7b", 8, 128, 1, 4096, 1, 1, 1, 15066),
                           ("24.01", "llama2-13b", 16, 128, 1, 4096, 2, 1, 1, 7728),
                           ("24.01", "llama2-70b", 64, 128, 1, 4096, 4, 4, 20, 1594),
                           ("24.01", "nemotron-8b", 8, 32, 2, 4096, 2, 1, 1, 11538),
                           ("24.01", "nemotron-22b", 16, 32, 2, 4096, 1, 4, 10, 3828),
                           ("24.04", "gpt3-5b", 64, 2048, 4, 2048, 1, 1, 1, 23574),
                           ("24.04", "gpt3-20b", 64, 256, 2, 2048, 2, 1, 1, 5528),
                           ("24.04", "llama2-7b", 8, 128, 1, 4096, 1, 1, 1, 16290),
                           ("24.04", "llama2-13b", 16, 128, 1, 4096, 4, 1, 1, 8317),
                           ("24.04", "llama2-70b", 64, 128, 1, 4096, 4, 4, 20, 1725)]
NEMO_LAUNCHER_2024_FINETUNE_ROWS = [("SFT", "llama2-7b", 8, 1, 1, 1, 14761), ("SFT", "llama2-13b", 8, 1, 4, 10, 8989),
                                    ("SFT", "llama2-70b", 16, 4, 4, 20, 1470), ("LoRA", "llama2-7b", 8, 1, 1, 1, 20750),
                                    ("LoRA", "llama2-13b", 8, 1, 1, 1, 12584), ("LoRA", "llama2-70b", 8, 2, 4, 1, 2279)]


def nemo_launcher_2024_runs() -> list[Run]:
    runs = []
    for table, name, n, gbs, mbs, seq, tp, pp, vp, tps in NEMO_LAUNCHER_2024_ROWS:
        model = nemo_model(name, seq)
        plan = f"tp={tp},pp={pp},cp=1,dp_replicate={n // (tp * pp)},zero_stage=1,micro_batch={mbs}" + pp_knobs(pp, vp)
        row = f"{name.upper()} | {n} | {gbs} | {mbs} | {seq} | {tp} | {pp} | {tps} tokens/s/GPU"
        short = name.removeprefix("gpt3-").upper() if name in NEMO_GPT else name
        runs.append(Run(f"NeMoL {table} {short} n={n}", model, n, seq, gbs, plan, NEMO_LAUNCHER_2024[table], row,
                        tflops=tps * flops_per_token(model, seq) / 1e12, gpu="h100", system="megatron-core",
                        search=False, precision="fp8", float8="te-delayed", attention_kernel=NEMO_FLASH_ATTN,
                        grads_in_fp32=None if name.startswith("nemotron") else False,
                        dropout=True if name in NEMO_GPT else None))
    return runs + nemo_finetune_runs(NEMO_LAUNCHER_2024_FINETUNE_ROWS, "NeMoL 24.01", NEMO_LAUNCHER_2024["24.01"],
                                     "finetuning: ")


# --------------------------------------------------------------------------------------------------
# NeMo Megatron's launcher (NVIDIA/NeMo-Framework-Launcher, then "bignlp"), README "Training Performance Results":
# GPT-3 5B and 175B "on different numbers of DGX nodes" (DGX A100 80GB SuperPOD, 8 GPUs a node: the catalogue's
# a100-80gb), tokens per second for the whole job, each table run with the conf/training/gpt3 config of the release
# that printed it (the README's support matrix names its NeMo):
# * 22.05 (README at commit b20f85d4, 2022-06-03, which replaced 22.03's table; conf/config.yaml:
#   bignlp-training:22.05, NeMo 1.9.0): 5B on 1, 2, 5, 9, 10, 18 and 20 nodes; TP 2, PP 1, micro-batch 2, global
#   batch 1440 (every node count divides it: DP = 4 x nodes, 1440 / (DP x 2) whole), no recompute
#   (activations_checkpoint_method block, 0 layers), fused_adam over megatron_amp_O2 with bf16: fp32 main gradients
#   all-reduced after the backward (NeMo v1.9's megatron_gpt_model.py: async_grad_allreduce = False; the preset's
#   overlap_grad_reduce False).
# * 22.08 (README at commit 3579cdb3, 2022-09-07; bignlp-training:22.08, NeMo 1.11.0; the same tables stayed until
#   2023): 5B on 1 to 32 nodes: TP 1, PP 1, micro-batch 2, global batch 2048, no recompute (granularity full, block,
#   0 layers), Apex's distributed_fused_adam (optimizer state sharded: reduce-scatter, then the updated weights
#   all-gathered, as Megatron's distributed optimizer, zero_stage=1), its gradient reduction overlapped with the
#   backward (Apex's overlap_grad_sync default; NeMo v1.11 turns it off only under pipeline or sequence
#   parallelism: overlap_grad_reduce True); 175B on 8 to 128 nodes: TP 8, PP 8 (1F1B: no virtual stages), micro-batch
#   2, global batch 2048, sequence parallelism, selective recompute, the distributed Adam's reduction after the
#   backward (sequence parallelism turns its overlap off).
# The models: GPT-3 5B (hidden 4096, 24 layers, 32 heads) and 175B (12288, 96, 96), FFN 4h, sequence 2048, GPT-2's
# BPE (50,257) padded to a multiple of 128 x TP (make_vocab_size_divisible_by 128: 50,304 at TP 1, 50,432 at TP 2,
# 51,200 at TP 8), tied embedding, dropout 0.1, learned positions (not mapped), unfused attention
# (masked_softmax_fusion; no FlashAttention in NeMo until 2023): NeMo's Megatron GPT of 2022 is Megatron-LM's code
# of Korthikanti et al. (apex.transformer): described as `--system megatron-lm-2021`. Added on 2026-12-06 and
# evaluated first as the planner stood (held out: docs/heldout-2026-12-06/).
NEMO_LAUNCHER = ("NVIDIA NeMo Megatron launcher README, Training Performance Results, "
                 "https://github.com/NVIDIA/NeMo-Framework-Launcher/blob/main/README.md")
NEMO_LAUNCHER_ROWS = {("22.05", "5B"): ((1, 39543), (2, 79128), (5, 195047), (9, 344523), (10, 383500),
                                        (18, 670254), (20, 731791)),
                      ("22.08", "5B"): ((1, 40345), (2, 79815), (4, 161754), (8, 312774), (16, 659481),
                                        (32, 1159288)),
                      ("22.08", "175B"): ((8, 7500), (16, 14950), (32, 29537), (64, 58211), (128, 109684))}
"""(Release, model): (nodes, tokens per second)."""


def nemo_launcher_runs() -> list[Run]:
    runs = []
    for (release, size), rows in NEMO_LAUNCHER_ROWS.items():
        if size == "5B":
            tp, pp, mb, gbs = (2, 1, 2, 1440) if release == "22.05" else (1, 1, 2, 2048)
            model = gpt("gpt3-5b", 4096, 32, 24, vocab=50304 if tp == 1 else 50432)
            knobs = "activation_checkpoint=none,sequence_parallel=false"
        else:
            tp, pp, mb, gbs = 8, 8, 2, 2048
            model = gpt("gpt3-175b", 12288, 96, 96, vocab=51200)
            knobs = "activation_checkpoint=selective,sequence_parallel=true,pp_schedule=1f1b"
        for nodes, tps in rows:
            n = 8 * nodes
            dp = n // (tp * pp)
            zero = 0 if release == "22.05" or dp == 1 else 1
            runs.append(Run(f"NeMo-Megatron {release} {size} n={n}", model, n, 2048, gbs,
                            f"tp={tp},pp={pp},cp=1,dp_replicate={dp},zero_stage={zero},micro_batch={mb},{knobs}",
                            NEMO_LAUNCHER, f"{release}: {size}, {nodes} nodes, {tps} tokens per second",
                            tflops=tps / n * flops_per_token(model, 2048) / 1e12, system="megatron-lm-2021",
                            search=False, overlap_grad_reduce=True if (release, size) == ("22.08", "5B") else None))
    return runs


# --------------------------------------------------------------------------------------------------
# Bekman, "Machine Learning Engineering", insights/when-to-upgrade-gpus/README.md (github.com/stas00/ml-engineering,
# commit 744d01e, August 2026), with its scripts: Llama-3.1-8B, Hugging Face's model (transformers 5.14.1), trained
# by DeepSpeed 0.19.2 on 8 H200s (torch 2.13.0 / CUDA 13.0, FlashAttention-3 3.0.0 through attn_implementation),
# batch 1 sequence per GPU, random tokens, AdamW, gradient clipping 1.0, bf16, every rank a data-parallel rank.
# * The sweep (benchmark.py as run_sweep.sh runs it): ZeRO-3 with overlap_comm and contiguous_gradients, the
#   optimizer offloaded to the CPU (pinned), activation checkpointing (gradient_checkpointing_enable with
#   use_reentrant False), Liger-Kernel; "steady-state TFLOPS/GPU" and "Peak memory (max_memory_reserved, worst
#   rank)" at 8K to 256K tokens. TFLOPS are benchmark.py's estimate_tflos over the step: 6 N tokens + 6 s^2 d_head
#   heads layers (causal), N the blocks' linears and one V x d (the head), so the step is that count over them.
# * The 8K step decomposition (bench_decompose.py's defaults: ZeRO-2, no checkpointing, no offload, no Liger):
#   461 TFLOPS in all; and "Liger-Kernel ... cuts peak memory ~20% (99 -> 80GiB)" at that 8K ZeRO-2 step. Its peak
#   is max_memory_reserved too (bench_decompose.py: the largest over the ranks). Without
#   Liger the norms are Hugging Face's LlamaRMSNorm, composite in fp32 (fused_rmsnorm False, since 2026-12-05).
# Described as two system files (benchmarks/systems/deepspeed-hf*.toml). Added on 2026-12-05 and evaluated first as
# the planner stood (held out: docs/heldout-2026-12-05/bekman-h200-deepspeed-held-out.txt).
BEKMAN = ("Bekman, Machine Learning Engineering, insights/when-to-upgrade-gpus (H200 rows), "
          "https://github.com/stas00/ml-engineering/blob/master/insights/when-to-upgrade-gpus/README.md")
BEKMAN_SWEEP = [(8, 141, 16.3), (32, 324, 25.8), (64, 391, 37.5), (128, 420, 66.5), (192, 422, 95.7),
                (256, 419, 124.5)]


def bekman_step(model: ModelArgs, seq: int, tflops: float) -> float:
    """Seconds per step implied by benchmark.py's estimate_tflos for one sequence and the TFLOPS it printed."""
    head_dim = model.head_dim
    linears = model.dim * model.ffn_hidden * 3 + model.dim * (2 * model.q_dim + 2 * model.n_kv_heads * head_dim)
    dense = linears * model.n_layers + model.vocab_size * model.dim
    attention = 6 * seq ** 2 * head_dim * model.n_heads * model.n_layers
    return (6 * dense * seq + attention) / (tflops * 1e12)


def bekman_runs() -> list[Run]:
    runs = []
    for k, tflops, mem in BEKMAN_SWEEP:
        seq = k * 1024
        model = dataclasses.replace(preset("llama3-8b"), max_seq_len=max(seq, 8192))
        step = bekman_step(model, seq, tflops)
        runs.append(Run(f"Bekman H200 8B ZeRO-3 offload AC Liger s={k}K", model, 8, seq, 8,
                        "dp_shard=8,zero_stage=3,micro_batch=1,activation_checkpoint=full", BEKMAN,
                        f"{k}K | {tflops} TFLOPS | {mem} GiB", tflops=tflops, step_s=step, mem_gib=mem,
                        mem_counts="reserved", gpu="h200",
                        system="deepspeed-hf-liger.toml", search=False, offload="optimizer"))
    model = preset("llama3-8b")
    zero2 = "dp_shard=8,zero_stage=2,micro_batch=1,activation_checkpoint=none"
    runs.append(Run("Bekman H200 8B ZeRO-2 s=8K", model, 8, 8192, 8, zero2, BEKMAN,
                    "step decomposition @ 8k, total | 461 TFLOPS; without Liger 99 GiB",
                    tflops=461, step_s=bekman_step(model, 8192, 461), mem_gib=99, mem_counts="reserved", gpu="h200",
                    system="deepspeed-hf.toml", search=False, fused_rmsnorm=False))
    runs.append(Run("Bekman H200 8B ZeRO-2 Liger s=8K (memory)", model, 8, 8192, 8, zero2, BEKMAN,
                    "Liger-Kernel cuts peak memory 99 -> 80GiB", mem_gib=80, mem_counts="reserved", gpu="h200",
                    system="deepspeed-hf-liger.toml", search=False))
    return runs


# --------------------------------------------------------------------------------------------------
# torchtune's "Optimization flags" table (pytorch/torchtune README.md, from commit 1814feb17 of 2024-11-18, PR 2003,
# to the project's last README): Llama 3.2 3B, recipe full_finetune_single_device, batch 2, max sequence 4096,
# precision bf16, one A100 (peak memory active 60 GiB: the 80 GB board); each technique added to the previous one.
# Kept: the packed rows, packing (every sequence 4096 tokens), + compile, + chunked cross-entropy, + activation
# checkpointing, + the optimizer step fused into backward, + activation offloading, and LoRA and QLoRA (on the
# rows before the optimizer in backward: "LoRA and QLoRA ... do not use optimizer_in_bwd or AdamW8bit"; the
# README's command for QLoRA: lora_finetune_single_device with llama3_2/3B_qlora_single_device, packed, compile,
# chunked cross-entropy, checkpointing, offloading, torch.optim.AdamW, batch 2; the 3B LoRA configs adapt q_proj,
# v_proj, output_proj and the MLP at rank 64, their optimizer fused: True, which that override keeps; QLoRA's
# base of those linears in NF4, torchao's). Left out: the baseline (alpaca's samples unpacked, padded per batch:
# its tokens per step are not stated) and + 8-bit AdamW (torchtune's docs offer torchao's AdamW8bit and
# bitsandbytes' PagedAdamW8bit, the single-device config's default, whose paged state is outside torch's
# allocator; which ran is not stated). How they ran, from the recipes and torchtune's modules at that commit
# (`--system torchtune`, system.SYSTEMS): the model built in bf16 and trained so (Training.state_dtype);
# torchtune's RMSNorm composite in fp32; the tied head F.linear(h, tok_embeddings.weight).float() materialising
# fp32 logits for torch's cross-entropy in the first two rows (loss_chunks 1; under compile the loss is compiled
# over those fp32 logits, made outside it: compile_loss False as the planner counts it, not one pass over bf16
# logits); CEWithChunkedOutputLoss from the third (the preset's 8 chunks, each upcast inside its own compiled
# call); each layer in torch's non-reentrant checkpoint_wrapper; optimizer_in_bwd (Training.optimizer_in_backward)
# and enable_activation_offloading (Training.activation_offload) where the rows add them. torch's AdamW fused, as
# the configs set it for torch.optim.AdamW: the full rows' command is not given, and a foreach step (the default
# without that flag) makes a moment-sized temporary at the step, 6 GiB here, which the published peaks of the
# checkpointed rows (24.9 GiB, 0.8 above the model state; torchtune resets the peak each step and logs it after
# the optimizer's) do not hold. Memory is torch's "active_bytes.all.peak" (training/memory.py get_memory_stats),
# tokens per second the labelled tokens of a step over its time. Added on 2026-12-06 and evaluated first as the
# planner stood, in two sets (held out: docs/heldout-2026-12-06/torchtune-*.txt).
TORCHTUNE = ("torchtune, README.md (Optimization flags), https://github.com/pytorch/torchtune/blob/main/README.md")
# technique, compile, the chunked loss (compiled with the layers: over bf16 logits), recompute, the optimizer in
# backward, activation offloading, peak memory active (GiB), tokens/s
TORCHTUNE_ROWS = [("+ Packed Dataset", False, False, "none", False, False, 60.0, 7075),
                  ("+ Compile", True, False, "none", False, False, 51.0, 8998),
                  ("+ Chunked Cross Entropy", True, True, "none", False, False, 42.9, 9174),
                  ("+ Activation Checkpointing", True, True, "full", False, False, 24.9, 7210),
                  ("+ Fuse optimizer step into backward", True, True, "full", True, False, 23.1, 7309),
                  ("+ Activation Offloading", True, True, "full", True, True, 21.8, 7301),
                  ("LoRA", True, True, "full", False, True, 8.5, 8210),
                  ("QLoRA", True, True, "full", False, True, 4.6, 8035)]
TORCHTUNE_LORA = ("wq", "wv", "wo", "w1", "w3", "w2")
"""The linears torchtune's Llama 3.2 3B LoRA configs adapt (lora_attn_modules q_proj, v_proj, output_proj;
apply_lora_to_mlp), at rank 64."""


def torchtune_runs() -> list[Run]:
    model = preset("llama3.2-3b")
    runs = []
    for technique, compiled, loss, recompute, in_backward, offload, mem, tps in TORCHTUNE_ROWS:
        adapters = technique in ("LoRA", "QLoRA")
        runs.append(Run(f"torchtune A100 3B {technique.removeprefix('+ ')}", model, 1, 4096, 2,
                        f"micro_batch=2,activation_checkpoint={recompute}", TORCHTUNE,
                        f"{technique} | {mem} | {tps}", tflops=tps * flops_per_token(model, 4096) / 1e12,
                        mem_gib=mem, mem_counts="active", system="torchtune", search=False, compile=compiled,
                        compile_loss=loss, loss_chunks=None if loss else 1, activation_offload=offload,
                        optimizer_in_backward=in_backward,
                        lora_rank=64 if adapters else 0, qlora=technique == "QLoRA",
                        lora_targets=TORCHTUNE_LORA if adapters else PROJECTIONS))
    return runs


# --------------------------------------------------------------------------------------------------
# NeMo AutoModel's performance summary (NVIDIA-NeMo/Automodel, docs/performance-summary.md, its .mdx since June
# 2026): "System: DGX-H100, Precision: BF16", PyTorch's FSDP2 (TP, CP and EP beside it); mock data, "Fake balanced
# gate is enabled to simulate ideal expert routing", no gradient clipping; time per global step and tokens/s per GPU
# (and AutoModel's own model TFLOP/s, not used). Each row as its recipe stood when the row was measured:
# * Qwen3 MoE 30B (Qwen/Qwen3-30B-A3B's config: the preset qwen3-30b-a3b-like, without its per-head q/k norms), the
#   row of 8d9bfb90e (2025-10-08), examples/benchmark/configs/qwen3_moe_30b_te_deepep.yaml there: 8 H100s, EP 8
#   over the 8 FSDP ranks (the experts not sharded further), reshard_after_forward False (ZeRO-2), every block
#   checkpointed, global batch 512, local batch 4, 16 accumulation steps, sequence 4096; the router's auxiliary
#   loss not run by the fake gate, which gives token i the 8 consecutive experts from 8i (mod 128), all on one of
#   the 8 ranks of 16 experts, so DeepEP sends each token to one rank (dispatch_ranks 1); its stack in
#   benchmarks/systems/automodel-moe-te.toml (DeepEP's dispatch described since 2026-12-06, after the held-out
#   evaluation).
# * Llama 3 70B pre-training on 64 H100s (2013a4dd6, 2026-04-10): FSDP 32 x CP 2, local batch 1, 4 accumulation
#   steps, sequence 8192, compiled layers, checkpointing; benchmarks/systems/automodel-fsdp2.toml.
# * LoRA (rank 16 on every linear but the head; "match_all_linear"), sequence 4096, global batch 32: Llama 3.1 8B
#   and Qwen2.5 7B on one H100 (507bfb751, 2025-12-16: micro-batch 2, 16 accumulation steps, no checkpointing, not
#   compiled; Hugging Face's models with Liger-Kernel: benchmarks/systems/automodel-hf-liger.toml; the 8B's LoRA
#   dropout 0.1 after the adapter, not priced), Llama 3.3 70B and Qwen2.5 32B on 8 and 16 H100s (2013a4dd6: TP 2 x
#   FSDP 4 or 8, micro-batch 2, checkpointing, compiled layers; the 70B with sequence parallelism and async TP,
#   which the planner does not price, as torchtitan's AsyncTP rows; automodel-fsdp2.toml). Qwen2.5's shapes
#   from its config.json (7B: hidden 3584, 28 layers, 28 heads, 4 KV heads, FFN 18944; 32B: 5120, 64, 40, 8,
#   27648; vocabulary 152064, untied), without its q/k/v biases (0.1M and 0.7M parameters).
# Added on 2026-12-06 and evaluated first as the planner stood (held out: docs/heldout-2026-12-06/automodel-held-
# out.txt), with descriptions a review of AutoModel's code then corrected (docs/planner.md, "NeMo AutoModel").
AUTOMODEL = ("NeMo AutoModel, docs/performance-summary.md, "
             "https://github.com/NVIDIA-NeMo/Automodel/blob/main/docs/performance-summary.mdx")
QWEN25_7B = dataclasses.replace(preset("llama3-8b"), name="qwen2.5-7b", dim=3584, n_layers=28, n_heads=28,
                                n_kv_heads=4, vocab_size=152064, ffn_hidden=18944, rope_theta=1e6, norm_eps=1e-6)
QWEN25_32B = dataclasses.replace(QWEN25_7B, name="qwen2.5-32b", dim=5120, n_layers=64, n_heads=40, n_kv_heads=8,
                                 ffn_hidden=27648)
# name, model, GPUs, sequence, global batch, the stated plan, compiled, seconds per step, the row as printed
AUTOMODEL_DENSE_ROWS = [
    ("Llama3 70B pretrain", preset("llama3-70b"), 64, 8192, 128,
     "dp_shard=32,cp=2,zero_stage=3,micro_batch=1,grad_accum=4,activation_checkpoint=full", True, 18.90,
     "Llama3 70B | 64 | 128 | 1 | 1 | 4 | 8192 | TP 1 | PP 1 | CP 2 | - | - | FSDP 32 | TE + fsdp2_prefetch | 18.90 | "
     "389 | 866.77"),
    ("LoRA Llama3 8B", preset("llama3-8b"), 1, 4096, 32,
     "micro_batch=2,grad_accum=16,activation_checkpoint=none", False, 10.51,
     "Llama3 8B | 1 | 32 | 2 | 2 | 16 | 4096 | 1 | 1 | 1 | - | 1 | 1 | TE + triton | 10.51 | 402 | 12472.87"),
    ("LoRA Qwen2.5 7B", QWEN25_7B, 1, 4096, 32,
     "micro_batch=2,grad_accum=16,activation_checkpoint=none", False, 9.29,
     "Qwen2.5 7B | 1 | 32 | 2 | 2 | 16 | 4096 | 1 | 1 | 1 | - | 1 | 1 | TE + triton | 9.29 | 423 | 14110.05"),
    ("LoRA Llama3 70B +AsyncTP", preset("llama3-70b"), 8, 4096, 32,
     "tp=2,sequence_parallel=true,dp_shard=4,zero_stage=3,micro_batch=2,grad_accum=4,activation_checkpoint=full",
     True, 15.00,
     "Llama3 70B | 8 | 32 | 2 | 2 | 4 | 4096 | 2 | 1 | 1 | - | 1 | 4 | TE + triton + fsdp2_prefetch | 15.00 | 316 | "
     "1091.85"),
    ("LoRA Qwen2.5 32B", QWEN25_32B, 8, 4096, 32,
     "tp=2,sequence_parallel=false,dp_shard=4,zero_stage=3,micro_batch=2,grad_accum=4,activation_checkpoint=full",
     True, 7.28,
     "Qwen2.5 32B | 8 | 32 | 2 | 2 | 4 | 4096 | 2 | 1 | 1 | - | 1 | 4 | TE + triton + fsdp2_prefetch | 7.28 | 301 | "
     "2250.31"),
    ("LoRA Llama3 70B 2-node +AsyncTP", preset("llama3-70b"), 16, 4096, 32,
     "tp=2,sequence_parallel=true,dp_shard=8,zero_stage=3,micro_batch=2,grad_accum=2,activation_checkpoint=full",
     True, 8.32,
     "Llama3 70B 2-node | 16 | 32 | 2 | 2 | 2 | 4096 | 2 | 1 | 1 | - | 1 | 8 | TE + triton + fsdp2_prefetch | 8.32 | "
     "285 | 984.85"),
    ("LoRA Qwen2.5 32B 2-node", QWEN25_32B, 16, 4096, 32,
     "tp=2,sequence_parallel=false,dp_shard=8,zero_stage=3,micro_batch=2,grad_accum=2,activation_checkpoint=full",
     True, 3.95,
     "Qwen2.5 32B 2-node | 16 | 32 | 2 | 2 | 2 | 4096 | 2 | 1 | 1 | - | 1 | 8 | TE + triton + fsdp2_prefetch | 3.95 | "
     "277 | 2072.89")]


def automodel_runs() -> list[Run]:
    qwen3 = dataclasses.replace(preset("qwen3-30b-a3b-like"), aux_loss_coeff=0.0)
    runs = [Run("AutoModel Qwen3 MoE 30B n=8 EP8", qwen3, 8, 4096, 512,
                "dp_shard=8,ep=8,zero_stage=2,micro_batch=4,grad_accum=16,activation_checkpoint=full", AUTOMODEL,
                "Qwen3 MoE 30B | 8 | 512 | 4 | 4 | 16 | 4096 | TP 1 | PP 1 | CP 1 | EP 8 | - | FSDP 8 | TE + DeepEP | "
                "21.773 | 277 | 12,040", step_s=21.773,
                tflops=512 * 4096 / 21.773 / 8 * flops_per_token(qwen3, 4096) / 1e12, gpu="h100",
                system="automodel-moe-te.toml", search=False, expert_imbalance=1.0, dispatch_ranks=1.0)]
    for name, model, n, seq, batch, plan, compiled, step, row in AUTOMODEL_DENSE_ROWS:
        model = dataclasses.replace(model, max_seq_len=max(model.max_seq_len, seq))
        runs.append(Run(f"AutoModel {name} n={n}", model, n, seq, batch, plan, AUTOMODEL, row, step_s=step,
                        tflops=batch * seq / step / n * flops_per_token(model, seq) / 1e12, gpu="h100",
                        system="automodel-hf-liger.toml" if n == 1 else "automodel-fsdp2.toml", search=False,
                        compile=compiled,
                        lora_rank=16 if name.startswith("LoRA") else 0))
    return runs


# --------------------------------------------------------------------------------------------------
# Five sources added on 2026-12-06 (the day's last run) and evaluated first as the planner stood (held out:
# docs/heldout-2026-12-06/fa2-glm-bloomberg-tinyllama-llama1-held-out.txt).
#
# FlashAttention-2 (Dao 2023, arXiv 2307.08691), sec. 4.2, table 1: "Training speed (TFLOPs/s/GPU) of GPT-style
# models on 8xA100 GPUs" (80GB SXM4, one node), "Without FlashAttention", FlashAttention and FlashAttention-2
# columns; FLOPs "6 * seqlen * number of params + 12 * number of layers * hidden dim * seqlen^2" (the planner's model
# FLOPs, the tied embedding counted once: the published time is implied by them; the README's 169k tokens/s at 189
# TFLOP/s for the 1.3B agree with that count within 2%, where leaving the embedding out would move it about 7%; the
# paper's count may include the learned position embedding and biases, under 2% more). The runs are flash-attn's
# own training code ("it should be the same training code", the author in Dao-AILab/flash-attention issue 558), its
# configs at the FlashAttention-2 release (4f285b3):
# experiment/pile/gpt3xl-flash (1.3B: 24 layers, 2048 wide, 16 heads), gpt3-2.7B-flash-hdim128 (2.7B: 32 x 2560,
# 20 heads: training/README.md's command, "we set head dimension to 128"), the 8K ones gpt3xl-flash-8k and
# gpt3-2.7B-flash-8k (32 heads of 80: the only 2.7B 8K config without rotary); micro-batch 8 and 4 at 2K on an
# 80 GB A100 (datamodule.batch_size by train.gpu_mem), global batch 512 sequences at 2K and 128 at 8K (1M tokens),
# DDP with ZeroRedundancyOptimizer (ZeRO-1), no activation checkpointing. The 8K configs' micro-batch of 4 is not
# what ran: the 2.7B's activations would be over 80 GB at Korthikanti et al.'s 34 bytes a token and hidden unit a
# layer (34 x 8192 x 4 x 2560 x 32 = 91 GB): the search picks it; GPT-2's tokenizer padded to 50,264, tied
# head, GELU MLP of 4h (benchmarks/systems/flash-attn-training.toml says how the code runs). The 2K "Without
# FlashAttention" figures (142, 149) are the "Megatron-LM" bars of the repository's November 2022 figure
# (assets/gpt3_training_efficiency.jpg: the same values), whose settings are not published: described as
# megatron-lm-2021, the layout left to the search. Their 8K figures (72, 80) say nothing of the code that ran: left
# out.
FA2_PAPER = ("Dao 2023, FlashAttention-2, https://arxiv.org/abs/2307.08691, sec. 4.2, table 1; configs: "
             "https://github.com/Dao-AILab/flash-attention/tree/main/training (4f285b3)")
# model, sequence, hidden, heads, layers, micro-batch (None: the search's), global batch, without /
# FlashAttention / FlashAttention-2
FA2_ROWS = [("GPT3-1.3B", 2048, 2048, 16, 24, 8, 512, 142, 189, 196),
            ("GPT3-1.3B", 8192, 2048, 16, 24, None, 128, 72, 170, 220),
            ("GPT3-2.7B", 2048, 2560, 20, 32, 4, 512, 149, 189, 205),
            ("GPT3-2.7B", 8192, 2560, 32, 32, None, 128, 80, 175, 225)]


def fa2_runs() -> list[Run]:
    runs = []
    for name, seq, h, a, l, mb, batch, without, fa1, fa2 in FA2_ROWS:
        model = gpt(name.lower(), h, a, l, vocab=50264, seq=seq)
        row = f"{name} {seq // 1024}k context | {without} | {fa1} | {fa2} TFLOPs/s"
        plan = ("tp=1,pp=1,cp=1,dp_replicate=8,zero_stage=1,activation_checkpoint=none"
                + (f",micro_batch={mb}" if seq == 2048 else ""))
        for column, kernel, x in (("FlashAttention-2", None, fa2), ("FlashAttention", "flash1", fa1)):
            runs.append(Run(f"FA2-table {name} {seq // 1024}K {column}", model, 8, seq, batch, plan, FA2_PAPER, row,
                            tflops=x, system="flash-attn-training.toml", attention_kernel=kernel,
                            search=kernel is None))
        if seq == 2048:
            runs.append(Run(f"FA2-table {name} 2K without (Megatron-LM)", model, 8, seq, batch, "cp=1", FA2_PAPER,
                            row + "; the Megatron-LM bar of assets/gpt3_training_efficiency.jpg", tflops=without,
                            system="megatron-lm-2021", search=False))
    return runs


# GLM-130B (Zeng et al. 2022, arXiv 2210.02414; github.com/THUDM/GLM-130B): 70 layers of 12288 (96 heads), GeGLU of
# 32768 (three matrices, as SwiGLU's), vocabulary 150,528, tied, sequence 2048; 96 DGX-A100 (8 x 40 GB), "4-way
# tensor parallelism and 8-way pipeline parallelism" (sec. 2.3), DeepSpeed's pipeline (PipeDream-Flush: 1F1B; its
# ReduceGrads after the last backward), 9 layers a middle stage and 8 on the two holding the embedding ("9x8-2=70",
# sec. 2.3: the planner cuts by cost), micro-batch 1, ZeRO-1, activation checkpointing of every layer with DeepSpeed's
# activation partitioning (distribute_checkpoints), fp16 (Apex O2) with an fp32 softmax, Megatron's fused masked
# softmax and bias-dropout (unfused attention, dropout 0.1; table 11's fused softmax, FlashAttention not
# mentioned), DeepSpeed 0.6.1 (the log's environment).
# Measured: logs/main-log-en.md, "Speed Testing (with Different Batch Sizes)": "134TFLOPS, 88.5s/iter, 48samples/s"
# at batch 4224 (the training's) and "141TFLOPS, 122.5s/iter, 50samples/s" at 6144 (hardware FLOPs: 134 / 312 =
# 42.9%, the paper's HFU 43.3%; the FFN's 3 x 8/3 h^2 make eq. 3's 12 h^2 a layer). The interconnect is not stated: the
# catalogue's DGX A100 (8 HDR 200 Gb/s a node).
GLM = ("Zeng et al. 2022, GLM-130B, https://arxiv.org/abs/2210.02414, sec. 2.3, table 11; "
       "https://github.com/THUDM/GLM-130B/blob/main/logs/main-log-en.md")
GLM130B = ModelArgs(name="glm-130b", dim=12288, n_layers=70, n_heads=96, n_kv_heads=96, vocab_size=150528,
                    ffn_hidden=32768, tie_embeddings=True, max_seq_len=2048)


def glm_runs() -> list[Run]:
    return [Run(f"GLM-130B n=768 batch {batch}", GLM130B, 768, 2048, batch,
                "tp=4,pp=8,cp=1,dp_replicate=24,zero_stage=1,micro_batch=1,activation_checkpoint=full,"
                "sequence_parallel=false,pp_schedule=1f1b", GLM, f"speed test: {x}TFLOPS, {step}s/iter",
                step_s=step, tflops=x, flops="eq3", gpu="a100-40gb", precision="fp16", distribute_checkpoints=True,
                overlap_grad_reduce=False, search=batch == 4224)
            for batch, step, x in ((4224, 88.5, 134), (6144, 122.5, 141))]


# BloombergGPT (Wu et al. 2023, arXiv 2303.17564, sec. 3.1-3.4, table 4): 70 layers of 7680 (40 heads), GELU MLP of 4h,
# vocabulary 131,072, tied, sequence 2048; 64 p4d.24xlarge (512 A100 40GB; EFA, 400 Gb/s a node: 6.25 GB/s a GPU);
# SageMaker's sharded data parallelism, "ZeRO optimization (stage 3) ... across 128 GPUs, and we have 4 copies of
# the model", activation checkpointing of every layer, bf16 over fp32 parameters
# (benchmarks/systems/sagemaker-smp-zero3.toml); batch 2048 sequences after step 7,200; "102 TFLOPs on average and
# each training step takes 32.5 seconds" (8 N FLOPs a token: the recompute counted, attention not). Micro-batch
# not stated: the search picks it.
BLOOMBERG = "Wu et al. 2023, BloombergGPT, https://arxiv.org/abs/2303.17564, sec. 3.3-3.4, table 4"


def bloomberg_runs() -> list[Run]:
    model = gpt("bloomberggpt-50b", 7680, 40, 70, vocab=131072)
    return [Run("BloombergGPT 50B n=512", model, 512, 2048, 2048,
                "tp=1,pp=1,cp=1,dp_replicate=4,dp_shard=128,zero_stage=3,activation_checkpoint=full", BLOOMBERG,
                "sec. 3.4: 102 TFLOPs on average, 32.5 s a step", step_s=32.5, tflops=102, flops="bloom",
                gpu="a100-40gb", inter_node_gbs=400 / 8 / 8, system="sagemaker-smp-zero3.toml")]


# TinyLlama 1.1B (github.com/jzhang38/TinyLlama at bf12224, README): "a throughput of 24k tokens per second per
# A100-40G GPU ... without activation checkpointing" (3,456 A100 hours for 300B tokens in its table: 24.1k); 16
# A100-40G (2 nodes); 22 layers of 2048, 32 heads in 4 groups, SwiGLU of 5632, vocabulary 32,000, untied, sequence
# 2048; pretrain/tinyllama.py: micro-batch 8, 64 sequences a GPU a step (512 // 8 devices), FSDP FULL_SHARD with
# bf16-mixed (benchmarks/systems/lit-gpt-fsdp.toml). Its interconnect is not stated: the catalogue's.
TINYLLAMA = "TinyLlama, README.md and pretrain/tinyllama.py, https://github.com/jzhang38/TinyLlama (bf12224)"


def tinyllama_runs() -> list[Run]:
    model = ModelArgs(name="tinyllama-1.1b", dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, vocab_size=32000,
                      ffn_hidden=5632, max_seq_len=2048)
    return [Run("TinyLlama 1.1B n=16", model, 16, 2048, 1024,
                "tp=1,pp=1,cp=1,dp_shard=16,zero_stage=3,micro_batch=8,grad_accum=8,activation_checkpoint=none",
                TINYLLAMA, "24k tokens per second per A100-40G GPU", tflops=24000 * flops_per_token(model, 2048) / 1e12,
                gpu="a100-40gb", system="lit-gpt-fsdp.toml")]


# LLaMA (Touvron et al. 2023, arXiv 2302.13971, sec. 2.4): "When training a 65B-parameter model, our code processes
# around 380 tokens/sec/GPU on 2048 A100 GPU with 80GB of RAM"; batch 4M tokens (table 2), taken as 2048 sequences
# of 2048 (LLaMA's context, not in the quoted text), in bf16 (not stated either);
# xformers' causal attention with FlashAttention's backward ("uses the backward from Dao et al. (2022)": flash1),
# checkpointing that saves "the outputs of linear layers" (selective, keeping every matmul's output), "model and
# sequence parallelism, as described by Korthikanti et al. (2022)" (tp with sequence parallelism: its degree, the
# pipeline's and the micro-batch not stated: the search completes them), computation overlapped with "the
# communication between GPUs over the network (due to all_reduce operations)".
# Its stack, like Llama 3's, is described field by field as Megatron's layout.
LLAMA1 = "Touvron et al. 2023, LLaMA: Open and Efficient Foundation Language Models, https://arxiv.org/abs/2302.13971"


def llama1_runs() -> list[Run]:
    model = ModelArgs(name="llama-65b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=64, vocab_size=32000,
                      ffn_hidden=22016, max_seq_len=2048)
    return [Run("LLaMA 65B n=2048", model, 2048, 2048, 2048,
                "cp=1,sequence_parallel=true,activation_checkpoint=selective", LLAMA1,
                "sec. 2.4: around 380 tokens/sec/GPU on 2048 A100 GPU with 80GB of RAM",
                tflops=380 * flops_per_token(model, 2048) / 1e12, fused_attention=True, attention_kernel="flash1")]


# IBM's fms-fsdp (github.com/foundation-model-stack/fms-fsdp; the PyTorch blog "Maximizing training throughput
# using PyTorch FSDP", 2024-03-13): Llama 2 shapes at sequence 4096, batch 2 a GPU and no accumulation (one
# backward a step), on 128 A100 80GB ("400Gbps network connectivity", a node: 6.25 GB/s a GPU) and 96 H100 ("800
# Gbps": 12.5 GB/s a GPU), in tokens/s/GPU: README.md at 5e522b4 (the blog's table, no compile) and at ed74fd5
# ("numbers are updated with torch.compile": the 7b's the same run compiled; the 34b and 70b moved to selective
# checkpointing). The rows used are those whose recompute
# the planner can state: 7b under HSDP (HYBRID_SHARD: FSDP over the node's 8 GPUs, replicas across nodes) without
# activation checkpointing, eager and compiled, and 34b and 70b under FSDP (FULL_SHARD) with "Full AC" (every
# block, eager); and since 2026-12-06 (held out, docs/heldout-2026-12-06/fms-fsdp-13b-held-out.txt) the 13b under
# FSDP with "Selective AC": ac_handler.py at 5e522b4 checkpoints every k-th block (count % k == 0), k not in the
# table, but the README's HFU / MFU for the row, 0.59 / 0.51 (A100) and 0.40 / 0.35 (H100), is (6 + 2 f) / 6 at
# f = 1/2 within their rounding (k = 3 would give 1.11): activation_checkpoint_every = 2 (its blocks 1, 3, ...,
# the engine's 0, 2, ...: as many); and the README's note that with every block checkpointed the 13b's A100
# throughput "falls to 1600 tokens/sec/GPU". Left out: the compiled 13b, 34b and 70b ("Selective AC" at a fraction
# of its blocks that their HFU / MFU does not pin: 1.13 and 1.07 for the 13b). The 34b is CodeLlama-34B's shape
# (48 layers of 8192, 64 heads in 8 groups, FFN 22016), vocabulary 32,000 as fms_fsdp/utils/config_utils.py builds
# it; the stack is benchmarks/systems/fms-fsdp.toml. Which of its two H100 clusters ran the compiled H100 row (the
# README names 96 H100s at 800 Gbps; the second blog, 2024-05-21, 464 at 3.2 Tbps) is not stated: the README's.
FMS = ("fms-fsdp, README.md at 5e522b4 and ed74fd5, https://github.com/foundation-model-stack/fms-fsdp; "
       "https://pytorch.org/blog/maximizing-training/")
FMS_SHAPES = {"7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden=11008),
              "13b": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_hidden=13824),
              "34b": dict(dim=8192, n_layers=48, n_heads=64, n_kv_heads=8, ffn_hidden=22016),
              "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672)}
# model, sharding, activation checkpointing, compiled, tokens/s/GPU on A100 and H100 (None: not published), the
# README row's cells, what the run's name adds
FMS_ROWS = [("7b", "hsdp", "none", False, 3700, 7500, "7b | hsdp | none | 2 | 3700 | 7500", ""),
            ("34b", "fsdp", "full", False, 700, 1550, "34b | fsdp | Full AC | 2 | 700 | 1550", ""),
            ("70b", "fsdp", "full", False, 370, 800, "70b | fsdp | Full AC | 2 | 370 | 800", ""),
            ("7b", "hsdp", "none", True, 4550, 9600, "7b | hsdp | Y | none | 2 | 4550 | 9600", ""),
            ("13b", "fsdp", "full,activation_checkpoint_every=2", False, 1800, 3800,
             "13b | FSDP | Selective AC | 2 | 1800 | 3800 (HFU / MFU 0.59 / 0.51, 0.40 / 0.35)", " AC 1/2"),
            ("13b", "fsdp", "full", False, 1600, None, "for 13B ... We can dial up the MFU by turning on activation "
             "checkpointing, however the throughput falls to 1600 tokens/sec/GPU", " full AC")]


def fms_runs() -> list[Run]:
    runs = []
    for size, sharding, ac, compiled, a100, h100, row, tag in FMS_ROWS:
        model = ModelArgs(name=f"fms-llama-{size}", vocab_size=32000, max_seq_len=4096, **FMS_SHAPES[size])
        for gpu, n, tps, network in (("a100-80gb", 128, a100, 400), ("h100", 96, h100, 800)):
            if tps is None:
                continue
            split = f"dp_shard=8,dp_replicate={n // 8}" if sharding == "hsdp" else f"dp_shard={n}"
            runs.append(Run(f"fms-fsdp {size} {gpu} n={n}{' compile' if compiled else ''}{tag}", model, n, 4096, 2 * n,
                            f"tp=1,pp=1,cp=1,{split},zero_stage=3,micro_batch=2,grad_accum=1,"
                            f"activation_checkpoint={ac}", FMS, row,
                            tflops=tps * flops_per_token(model, 4096) / 1e12, gpu=gpu,
                            inter_node_gbs=network / 8 / 8, system="fms-fsdp.toml", compile=compiled,
                            search=not compiled))
    return runs


# --------------------------------------------------------------------------------------------------
# MLPerf Training v3.1 (November 2023), benchmark gpt3: GPT-3 175B pre-training from a checkpoint on C4, closed
# division, the NVIDIA and Azure+NVIDIA submissions (mlcommons/training_results_v3.1, results/*/gpt3/result_{0,1,2}.txt:
# MLLOG lines; NVIDIA/benchmarks/gpt3/implementations/pytorch: the configs, conf/custom.yaml). Every step's time is in
# the logs, NeMo's `train_step_timing` (exp_manager log_step_timing, per step: "tracked_stats"); the figure is the
# median over a run's steps after its fifth, the median of the three runs (they agree within 0.1% but Azure's 1%). The
# blocks between evaluations, over their steps, are longer: 0.2% at 64 and 96 nodes, 1.1-1.4% at 512 to 1,024, 2.2-2.4%
# at 1,280 and 1,344, 3.1-3.7% on Azure (what passes between steps; the logged steps are 96.7-99.8% of the blocks' wall
# time). Eos is DGX H100 with 8 ConnectX-7 NDR 400 Gb/s a node (systems/*.json), Azure's ND H100 v5 8 x 400 Gb/s
# InfiniBand a VM: the catalogue's h100. NGC 23.09 (NeMo 23.09, Transformer Engine, cuDNN 8.9.5).
# The configs: TP 4, PP 8 (config_DGXH100_*x4x8_mbs1.sh), micro-batch 1, the
# interleaved schedule at conf/custom.yaml's default of 12 virtual stages (no config sets INTERLEAVED_PIPELINE),
# sequence parallelism, no recompute (granularity null), dropout 0.0 (hidden and attention), layernorm1p, FP8 hybrid
# with delayed scaling (amax history 1024: config_fp8.sh), Apex's distributed Adam (optim distributed_fused_adam:
# contiguous grad buffer, grad_sync_dtype bf16, overlapped grad and param sync), TP communication overlapped with the
# GEMMs through userbuffers (TP_COMM_OVERLAP, tp_overlap/h100tp4pp8mbs1.yaml: not priced, docs/planner.md). The global
# batch is the log's (MINIBS x DP; for the 64-node run, 2048 = 128 x 16, MINIBS 128: inferred from the log, the
# repository's 64x8x192 config would give 3072 and the README's 64x8x128 is not in it; either layout is TP 4 x PP 8).
# The model: 96 layers, hidden 12288, 96 heads, FFN 4h, sequence 2048, MLPerf's C4 sentencepiece vocabulary (50,257)
# padded to a multiple of 128 x TP (50,688), tied embedding. Described as `--system megatron-core` in FP8 with TE's
# delayed scaling, the gradients reduced in bf16 (grads_in_fp32 False, as the DGX Cloud rows of NeMo 1). Left out:
# v4.0's rows (NeMo 24.04): none of their logs carries step times (train_step_timing; LOG_METRICS=OFF in the 1,344-
# and 1,452-node configs), all three keep the weights in FP8 (FP8_PARAMS in config_common.sh) and the two large ones
# run the layers as CUDA graphs, which the planner does not describe. Added on 2026-12-06 and evaluated first as the
# planner stood (held out: docs/heldout-2026-12-06/).
MLPERF31 = ("MLCommons, MLPerf Training v3.1 results, gpt3, NVIDIA and Azure+NVIDIA closed-division submissions, "
            "https://github.com/mlcommons/training_results_v3.1")
# submission (results directory), nodes, global batch (sequences), median seconds per step
MLPERF31_ROWS = [("NVIDIA eos_n64_ngc23.09_nemo", 64, 2048, 11.05),
                 ("NVIDIA eos_n96_ngc23.09_nemo", 96, 3072, 11.075),
                 ("NVIDIA eos-dfw_n512_ngc23.09_nemo", 512, 2048, 1.608),
                 ("NVIDIA eos-dfw_n768_ngc23.09_nemo", 768, 3072, 1.615),
                 ("NVIDIA eos-dfw_n1024_ngc23.09_nemo", 1024, 4096, 1.619),
                 ("NVIDIA eos-dfw_n1280_ngc23.09_nemo", 1280, 2560, 0.9256),
                 ("NVIDIA eos-dfw_n1344_ngc23.09_nemo", 1344, 2688, 0.9296),
                 ("Azure+NVIDIA ND_H100_v5_n1344_pytorch", 1344, 2688, 0.945)]


# MLPerf Training v4.1 (November 2024), the same benchmark, its GPU submissions whose logs carry every step's time
# (train_step_timing, as v3.1's; eos-dfw_n1452_ngc24.04, v4.0's code rerun, logs none): NVIDIA's on 32 and 64 DGX H100
# (NGC 24.09: NeMo 24.09, Megatron-Core, Transformer Engine; NVIDIA/benchmarks/gpt3/implementations/
# eos_n{32,64}_ngc24.09_nemo), Oracle's on 192 and 384 BM.GPU.H100.8 (OCI: 8 H100 and 16 x 200 Gb/s RoCE a node,
# the catalogue's h100; Oracle/benchmarks/gpt3/DGXH100_128x8x64x4x8_mbs2, NVIDIA's recipe with its own NCCL
# settings) and NVIDIA's preview on 8 DGX B200. The configs: TP 4, PP 8, micro-batch 2 (v3.1's was 1), the
# interleaved schedule at INTERLEAVED_PIPELINE (NVIDIA's 6, Oracle's 4), sequence parallelism, no recompute, no
# dropout, FP8 with delayed scaling (config_fp8.sh), Apex's distributed Adam with bf16 gradient reduction
# (conf/optim/distributed_fused_adam.yaml: grad_sync_dtype bf16), TP communication overlapped (not priced), the
# attention TE's default (NVTE_FUSED_ATTN unset, set to 1 on the B200: cuDNN, the system's). Not described: the
# weights kept in FP8 (FP8_PARAMS True in config_common.sh), the embedding's weight gradient deferred
# (DEFER_EMBEDDING_WGRAD_COMPUTE), the B200's layers as CUDA graphs (LAYER_CUDA_GRAPH), eos_n64's vboost. The
# global batch is the log's (MINIBS x DP); the step, the median over a run's steps after its fifth, the median of
# the three runs. Added on 2026-12-07 and evaluated first as the planner stood (held out:
# docs/heldout-2026-12-07/mlperf-v4.1-gpt3-held-out.txt).
MLPERF41 = ("MLCommons, MLPerf Training v4.1 results, gpt3, NVIDIA and Oracle closed-division submissions, "
            "https://github.com/mlcommons/training_results_v4.1")
# submission (results directory), GPU, nodes of 8, global batch (sequences), virtual stages, median seconds per step
MLPERF41_ROWS = [("NVIDIA eos_n32_ngc24.09_nemo", "h100", 32, 2048, 6, 18.3739),
                 ("NVIDIA eos_n64_ngc24.09_nemo", "h100", 64, 2048, 6, 9.4962),
                 ("Oracle 1536xBM.GPU.H100.8", "h100", 192, 3072, 4, 5.1706),
                 ("Oracle 3072xBM.GPU.H100.8", "h100", 384, 3072, 4, 3.058),
                 ("NVIDIA b200_n8_preview_nemo", "b200", 8, 2048, 6, 36.2336)]


def mlperf_runs() -> list[Run]:
    model = gpt("gpt3-175b", *NEMO_GPT["gpt3-175b"], vocab=50688)
    runs = []
    for submission, nodes, gbs, step in MLPERF31_ROWS:
        n, tp, pp = 8 * nodes, 4, 8
        dp = n // (tp * pp)
        row = f"{submission}: {nodes} x 8 H100, global batch {gbs} x 2048, {step} s per step (train_step_timing)"
        runs.append(Run(f"MLPerf 3.1 {submission.split()[0]} 175B n={n}", model, n, 2048, gbs,
                        f"tp={tp},pp={pp},cp=1,dp_replicate={dp},zero_stage=1,micro_batch=1,sequence_parallel=true,"
                        "activation_checkpoint=none,pp_schedule=interleaved-1f1b,virtual_stages=12", MLPERF31, row,
                        tflops=gbs * 2048 * flops_per_token(model, 2048) / (step * n * 1e12), step_s=step, gpu="h100",
                        system="megatron-core", search=False, precision="fp8", float8="te-delayed",
                        grads_in_fp32=False, dropout=False, attention_kernel=NEMO_FLASH_ATTN))
    return runs


def mlperf41_runs() -> list[Run]:
    model = gpt("gpt3-175b", *NEMO_GPT["gpt3-175b"], vocab=50688)
    runs = []
    for submission, gpu, nodes, gbs, vp, step in MLPERF41_ROWS:
        n = 8 * nodes
        row = (f"{submission}: {nodes} x 8 {gpu.upper()}, global batch {gbs} x 2048, micro-batch 2, TP 4 x PP 8 x VP "
               f"{vp}, {step} s per step (train_step_timing)")
        on = "" if gpu == "h100" else f" {gpu.upper()}"
        runs.append(Run(f"MLPerf 4.1 GPT-3 {submission.split()[0]} 175B{on} n={n}", model, n, 2048, gbs,
                        f"tp=4,pp=8,cp=1,dp_replicate={n // 32},zero_stage=1,micro_batch=2,sequence_parallel=true,"
                        f"activation_checkpoint=none{pp_knobs(8, vp)}", MLPERF41, row,
                        tflops=gbs * 2048 * flops_per_token(model, 2048) / (step * n * 1e12), step_s=step, gpu=gpu,
                        system="megatron-core", search=False, precision="fp8", float8="te-delayed",
                        grads_in_fp32=False, dropout=False))
    return runs


# MLPerf Training v5.0 (June 2025), benchmark llama31_405b: Llama 3.1 405B pre-trained on C4 with the Mixtral 8x22B
# tokenizer (the implementations' README: "we replace the paper's TikTokenizer with the Mixtral 8x22b tokenizer",
# whose vocabulary is 32,768 in its Hugging Face config: not in the submission; a multiple of 128 x TP, so not
# padded), sequences of 8,192, its closed-division GPU submissions, each one's three runs
# (mlcommons/training_results_v5.0: results/*/llama31_405b/result_*.txt, benchmarks/llama31_405b/implementations/*).
# The logs carry every step's wall time (tracked_stats train_step_time: custom_callbacks.py's DeltaTimingCallback,
# from one on_train_batch_end to the next); the figure is the median over a run's steps after its fifth, the median of
# the three runs (which span under 1.3%). Every submission runs NVIDIA's NeMo recipe (pretrain.py over NeMo 2's
# Llama31Config405B): TP x PP 8 x CP 2 with the interleaved schedule at 8 virtual stages (INTERLEAVED_PIPELINE),
# micro-batch 1, the global batch MINIBS x DP (the log's global_batch_size), sequence parallelism, no recompute
# (ACT_CKPT_GRANULARITY unset), no dropout, Megatron-Core's distributed optimizer with overlapped gradient reduction
# and parameter gather and bf16 gradient reduction (grad_reduce_in_fp32=False), FP8 through Transformer Engine with
# delayed scaling (custom.yaml: fp8_recipe delayed, amax history 1; E4M3 throughout, FP8_HYBRID unset, priced as any
# float8) and the weights kept in FP8 (FP8_PARAMS /
# FP8_PARAM_GATHER, not described), the embedding and the loss counted as layers in the pipeline split
# (ASYM_PP_EMBED, ASYM_PP_LOSS: priced by the planner's own cost split), TP communication overlapped through
# userbuffers (TP_COMM_OVERLAP: not priced, as everywhere), torch's allocator with expandable segments
# (config_common.sh), TE's default attention (NVTE_FUSED_ATTN unset: cuDNN, the system's). The rows: NVIDIA's on
# 64 to 1,024 DGX H100 (NGC 25.01, eos-dfw, TP 8), Nebius's on 64 and 128 8-GPU H200 servers (the same recipe,
# TP 4), and the GB200 NVL72 submissions (NGC 25.04, TP 4; NVIDIA's tyche and IBM, CoreWeave and NVIDIA's carina), 64
# GPUs of each rack (the systems' JSON: 4 GPUs a node, "Nx NVIDIA GB200 NVL72" for 16 N nodes) with a whole-step CUDA
# graph (FULL_CUDA_GRAPH in config_common_cg.sh, which tyche_ngpu256's config sources but its submission lacks; the
# planner has no host term for it to remove) and, but tyche_ngpu256, Megatron's tp-pp-dp rank order
# (TP_PP_DP_MAPPING: data parallelism outermost, each pipeline within a rack; the planner's mesh order puts the
# pipeline outermost, so it prices the pipeline's sends on the network and the data-parallel collectives, hidden
# behind the backward, inside a rack: the reverse). Each GB200 config also sources a config_common_blackwell.sh
# that is not in the submission: taken to change neither the FP8 recipe nor the layout (v5.1's NVIDIA configs set
# FP8_RECIPE tensorwise for Blackwell: current scaling, which the planner prices within a few percent of delayed).
# Nebius's config turns NVLS back on (NCCL_NVLS_ENABLE=0 commented out: more NCCL memory, not modelled). Added on
# 2026-12-07 and evaluated first as the planner stood (held out:
# docs/heldout-2026-12-07/mlperf-v5.0-llama31-405b-held-out.txt).
MLPERF50 = ("MLCommons, MLPerf Training v5.0 results, llama31_405b, closed division, "
            "https://github.com/mlcommons/training_results_v5.0")
LLAMA31_405B_MIXTRAL = dataclasses.replace(preset("llama3-405b"), name="llama31-405b-mixtral-vocab", vocab_size=32768,
                                           max_seq_len=8192)
# submitter and results directory, GPU, GPUs, TP, global batch (sequences), median seconds per step
MLPERF50_ROWS = [("NVIDIA eos-dfw_n64_ngc25.01_nemo", "h100", 512, 8, 1152, 55.1433),
                 ("NVIDIA eos-dfw_n256_ngc25.01_nemo", "h100", 2048, 8, 1152, 14.2216),
                 ("NVIDIA eos-dfw_n304_ngc25.01_nemo", "h100", 2432, 8, 1216, 12.7116),
                 ("NVIDIA eos-dfw_n320_ngc25.01_nemo", "h100", 2560, 8, 1120, 11.1730),
                 ("NVIDIA eos-dfw_n1024_ngc25.01_nemo", "h100", 8192, 8, 1536, 5.1790),
                 ("Nebius nebius_soperator_8xH200_n64_ngc25.01_nemo", "h200", 512, 4, 1152, 50.0114),
                 ("Nebius nebius_soperator_8xH200_n128_ngc25.01_nemo", "h200", 1024, 4, 1152, 25.3553),
                 ("NVIDIA tyche_ngpu256_ngc25.04_nemo", "gb200", 256, 4, 448, 19.1694),
                 ("NVIDIA tyche_ngpu512_ngc25.04_nemo", "gb200", 512, 4, 896, 19.4321),
                 ("IBM+CoreWeave+NVIDIA carina_ngpu512_ngc25.04_nemo", "gb200", 512, 4, 896, 19.2783),
                 ("IBM+CoreWeave+NVIDIA carina_ngpu1024_ngc25.04_nemo", "gb200", 1024, 4, 768, 8.4492),
                 ("IBM+CoreWeave+NVIDIA carina_ngpu1536_ngc25.04_nemo", "gb200", 1536, 4, 1152, 8.4992),
                 ("IBM+CoreWeave+NVIDIA carina_ngpu2048_ngc25.04_nemo", "gb200", 2048, 4, 1280, 7.1584),
                 ("IBM+CoreWeave+NVIDIA carina_ngpu2496_ngc25.04_nemo", "gb200", 2496, 4, 1248, 5.8223)]


def mlperf_405b_run(name: str, source: str, submission: str, gpu: str, n: int, tp: int, gbs: int, step: float,
                    float8: str) -> Run:
    """A row of NVIDIA's NeMo recipe for MLPerf's Llama 3.1 405B, v5.0 and v5.1 alike: TP x PP 8 x CP 2 at 8 virtual
    stages, micro-batch 1, no recompute, no dropout, FP8 with bf16 gradient reduction, expandable segments; a GB200's
    NVLink domain is the 64 GPUs of a rack the recipe uses."""
    model = LLAMA31_405B_MIXTRAL
    dp = n // (tp * 8 * 2)
    row = (f"{submission}: {n} {gpu.upper()}, TP {tp} x PP 8 x CP 2 x DP {dp}, VP 8, micro-batch 1, global batch "
           f"{gbs} x 8192, {step} s per step (train_step_time)")
    return Run(name, model, n, 8192, gbs,
               f"tp={tp},pp=8,cp=2,dp_replicate={dp},zero_stage=1,micro_batch=1,sequence_parallel=true,"
               f"activation_checkpoint=none{pp_knobs(8, 8)}", source, row,
               tflops=gbs * 8192 * flops_per_token(model, 8192) / (step * n * 1e12), step_s=step, gpu=gpu,
               gpus_per_node=BRIDGE_GB200_RACK if gpu == "gb200" else 8, system="megatron-core", search=False,
               precision="fp8", float8=float8, grads_in_fp32=False, dropout=False, expandable_segments=True)


def mlperf50_runs() -> list[Run]:
    return [mlperf_405b_run(f"MLPerf 5.0 405B {submission.split()[0]} {gpu.upper()} n={n}", MLPERF50, submission, gpu,
                            n, tp, gbs, step, "te-delayed") for submission, gpu, n, tp, gbs, step in MLPERF50_ROWS]


# --------------------------------------------------------------------------------------------------
# MLPerf Training v5.1 (November 2025), the same benchmark: the round's new closed-division results in FP8 on GPUs the
# catalogue has. Those are the University of Florida's 32 and 56 DGX B200 servers (256 and 448 B200s), which ran
# NVIDIA's NeMo recipe of the round (NGC 25.09): their implementation directory hpg.dgxb200x8 holds
# config_DGXB200_{32,56}x8x144xtp4pp8cp2_cg.sh beside run_{32,56}n.sub, and its README points to b200_nemo, where the
# common files those configs source are (taken as the ones they ran). TP 4 x PP 8 x CP 2, 8 virtual stages,
# micro-batch 1, MINIBS 144 a data-parallel rank (the logs' global batch 576 and 1,008), sequence parallelism, no
# recompute, the distributed optimizer with bf16 gradient reduction, FP8 in E4M3 with per-tensor current scaling
# (FP8_RECIPE tensorwise: te-current), the embedding and the loss counted as layers in the pipeline split
# (ASYM_PP_EMBED, ASYM_PP_LOSS: priced by the planner's own cost split, as v5.0's), torch's allocator with expandable
# segments, TP communication not overlapped (TP_COMM_OVERLAP commented out in both configs; b200_nemo's 64-node one
# sets it). Not described: the weights gathered in FP8 (FP8_PARAM_GATHER), the whole-step CUDA graph (the planner has
# no host term for it to remove), Megatron's tp-pp-dp rank order (TP_PP_DP_MAPPING, as in v5.0's GB200 rows). Left
# out: NVIDIA's three GB200 results and its GB300 one, which ran NVFP4 (each README names a config sourcing
# config_common_fp4.sh; the planner does not describe NVFP4, and the GB300 is not in the catalogue), and Nebius's two
# H200 results, whose logs are v5.0's files resubmitted (the same git blobs; mlperf50_runs has them). The step: the
# median of each log's train_step_time after its fifth (the per-step values and the blocks' averages, as v5.0's
# figures were taken), the median of the three runs (which span under 0.3%). Added on 2026-12-07 and evaluated first
# as the planner stood (held out: docs/heldout-2026-12-07/mlperf-v5.1-llama31-405b-held-out.txt).
MLPERF51_405B = ("MLCommons, MLPerf Training v5.1 results, llama31_405b, closed division, "
                 "https://github.com/mlcommons/training_results_v5.1")
# results directory, GPUs, global batch (sequences), median seconds per step
MLPERF51_405B_ROWS = [("hpg.dgxb200x8.n32", 256, 576, 27.6449),
                      ("hpg.dgxb200x8.n56", 448, 1008, 27.9765)]


def mlperf51_405b_runs() -> list[Run]:
    return [mlperf_405b_run(f"MLPerf 5.1 405B UF B200 n={n}", MLPERF51_405B, f"University of Florida {submission}",
                            "b200", n, 4, gbs, step, "te-current") for submission, n, gbs, step in MLPERF51_405B_ROWS]


# --------------------------------------------------------------------------------------------------
# MLPerf Training v4.0 (June 2024), benchmark llama2_70b_lora: Llama 2 70B fine-tuned with LoRA on GovReport, closed
# division (mlcommons/training_results_v4.0: results/*/llama2_70b_lora/result_*.txt, MLLOG lines;
# benchmarks/llama2_70b_lora/implementations/*: the configs). Each log's "tracked_stats" is the throughput in
# samples/s of the blocks between evaluations, timed by the submission's callback from on_train_batch_start to
# on_train_batch_end (custom_callbacks.py Timer: step time only); the figure is the median over a run's blocks, the
# median over the ten runs (which span 1-3%, NVIDIA's 128 nodes' 5%). The rows used run NVIDIA's NeMo recipe (NGC
# 24.04: NeMo 2.0.0rc0, Megatron-Core 0.7, Transformer Engine 1.6), as do the other GPU submissions but Juniper's
# (Hugging Face with DeepSpeed, not described here): packed sequences of 8,192, micro-batch
# 1, LoRA rank 16 on linear_qkv and linear_proj (target_modules attention) with dropout 0.1 before the adapter, TP with
# SP, no recompute, FP8 (TE's delayed scaling) with the frozen weights in FP8 (fp8_params ${FP8}) and FP8 attention
# (FP8_DPA=1; TE 1.6 runs it without context parallelism only: attention.py sends a cp group's attention through
# attn_forward_func_with_cp in bf16), TP communication overlapped through userbuffers (TP_COMM_OVERLAP: not priced,
# docs/planner.md), Apex's FusedAdam (megatron_gpt_peft_tuning_config.yaml: optim.name fused_adam; Dell's logs print
# "Optimizer config = FusedAdam": no distributed optimizer, ZeRO-0); the FP8 amax all-reduced across the job in the
# H100 CP configs and the 16-server L40S's only (FP8_REDUCE_AMAX); the global batch is MINIBS x DP (the
# log's global_batch_size). Rows: NVIDIA's four (a DGX H100, 8 and 128 of them, a DGX H200) and the other layouts
# submitted (Fujitsu's 4-GPU server, TP 4 alone, TP overlap off; HPE's 2 nodes; smc's 64). Ten other 8-GPU H100
# submissions ran NVIDIA's single-node layout at 1.92 to 2.10 samples/s (NVIDIA's 2.15): Dell's, Red Hat's and
# Supermicro's AS-8125GS with TP overlap off (their logs' ub_tp_comm_overlap) at 1.92-1.97, the rest with it at
# 2.04-2.10. NVIDIA's two L40S submissions (16 and 96 servers of 4 L40S on PCIe, TP 4 x CP 2 across two servers, TP
# overlap off, FP8 attention off; 2 x 400 Gb/s east-west a server, systems/l40s_n16_ngc24.04_nemo.json) were added
# after the day's changes below (evaluated, not fitted to: no term was changed for them). Described as
# `--system megatron-core` in FP8 with TE's delayed scaling, LoRA r16 on wq, wk, wv and wo, dropout 0.1; attention
# priced in bf16 (FP8 attention is not described). The H200 config's FP8_ACTIVATION reaches NeMo's config as
# fp8_activation_input_store, which names no field of Megatron-Core 0.7's TransformerConfig (its
# activation_func_fp8_input_store; NeMo's build_transformer_config copies the fields it finds by name): not described.
# Added on 2026-12-07 and evaluated first as the planner stood (held out: docs/heldout-2026-12-07/: it refused FP8 under
# LoRA; described in bf16, the single-node rows did not fit).
#
# MLPerf Training v4.1 (November 2024), the same benchmark, NVIDIA's five submissions (NGC 24.09: the same recipe;
# NVIDIA/benchmarks/llama2_70b_lora/implementations/*_ngc24.09_nemo and b200_preview_nemo): a DGX H100 as in v4.0 (FP8
# attention on, no CUDA graphs); 8 and 128 of them at TP 4 x CP 2 with each layer captured as a CUDA graph
# (LAYER_CUDA_GRAPH=1, v4.0's same layouts ran without) and FP8 attention off; a DGX H200 at TP 1 x CP 2 (no SP),
# activation_func_fp8_input_store on (FP8_ACTIVATION, under the field's own name since v4.1), no graphs; a DGX B200
# (preview) at TP 1 x CP 2 with graphs and FP8 attention, its CP exchange an all-to-all (the yaml's cp_comm_type a2a;
# priced as the ring until 2026-12-07, Training.cp_exchange 'a2a' since) and its adapters' dropout through Thunder
# (NEMO_LORA_USE_THUNDER_DROPOUT, priced as any); Megatron-Core's distributed optimizer (optim
# mcore_distributed_optim; v4.0's was Apex's FusedAdam); the FP8 amax not all-reduced (FP8_REDUCE_AMAX False in
# config_common.sh but the B200's). Added the same day and evaluated first as the planner then
# stood (held out: docs/heldout-2026-12-07/mlperf-v4.1-llama2-70b-lora-held-out.txt).
MLPERF40_LORA = ("MLCommons, MLPerf Training v4.0 results, llama2_70b_lora, closed division, "
                 "https://github.com/mlcommons/training_results_v4.0")
MLPERF41_LORA = ("MLCommons, MLPerf Training v4.1 results, llama2_70b_lora, closed division, "
                 "https://github.com/mlcommons/training_results_v4.1")
# round, submission (results directory), GPU, GPUs, TP, CP, global batch (sequences), samples/s
MLPERF_LORA_ROWS = [("4.0", "NVIDIA eos_ngc24.04_nemo", "h100", 8, 4, 1, 8, 2.1548),
                    ("4.0", "NVIDIA h200_ngc24.04_nemo", "h200", 8, 2, 1, 8, 2.4744),
                    ("4.0", "NVIDIA eos_n8_ngc24.04_nemo", "h100", 64, 4, 2, 8, 12.5512),
                    ("4.0", "NVIDIA eos_n128_ngc24.04_nemo", "h100", 1024, 4, 2, 128, 189.6161),
                    ("4.0", "Fujitsu GX2560M7_H100_SXM_80GBx4", "h100", 4, 4, 1, 8, 0.9811),
                    ("4.0", "HPE HPE-Cray-XD670-Gen11-H100-SXM5-80GB_n2_pytorch_24.04", "h100", 16, 4, 2, 8, 3.0455),
                    ("4.0", "smc 64xSMC-H100-SXM-80GB", "h100", 512, 4, 2, 64, 92.917),
                    ("4.0", "NVIDIA l40s_n16_ngc24.04_nemo", "l40s", 64, 4, 2, 8, 2.7188),
                    ("4.0", "NVIDIA l40s_n96_ngc24.04_nemo", "l40s", 384, 4, 2, 48, 16.4258),
                    ("4.1", "NVIDIA eos_ngc24.09_nemo", "h100", 8, 4, 1, 8, 2.1818),
                    ("4.1", "NVIDIA h200_ngc24.09_nemo", "h200", 8, 1, 2, 8, 2.4757),
                    ("4.1", "NVIDIA eos_n8_ngc24.09_nemo", "h100", 64, 4, 2, 8, 14.7991),
                    ("4.1", "NVIDIA eos_n128_ngc24.09_nemo", "h100", 1024, 4, 2, 128, 234.8273),
                    ("4.1", "NVIDIA b200_preview_nemo", "b200", 8, 1, 2, 8, 4.6962)]


# MLPerf Training v5.0 (June 2025), the same benchmark, NVIDIA's five submissions (NGC 25.04, NeMo 2: train.py's
# llm.Llama2Config70B and LoRA; NVIDIA/benchmarks/llama2_70b_lora/implementations/{nyx_n1,tyche_ngpu8,72,144,512}_
# ngc25.04_nemo, one config_common.sh, train.py and yaml for all five): a DGX B200 and two GB200 trays at TP 1 x CP 1,
# one, two and eight GB200 NVL72 racks at TP 1 x CP 8 (the systems' JSON: 18 and 36 nodes of 4 in 1 and 2 racks, so
# 72 GPUs a rack; 128 nodes in 8 racks, 64), micro-batch 1, the global batch the data-parallel width (MINIBS 1),
# sequences packed to 8,192, LoRA of rank 16 (alpha 32) on linear_qkv and linear_proj with dropout 0.1 before the
# adapter, Megatron-Core's distributed optimizer, FP8 with delayed scaling (hybrid, amax history 4) and the frozen
# weights in FP8 (fp8_params), Megatron-Core's float8 SwiGLU input on the 8-GPU rows (FP8_ACT=1), no recompute.
# The CP exchange is Transformer Engine's all-to-all (cp_comm_type a2a: Training.cp_exchange 'a2a', since the set
# was evaluated; priced as the ring then). Not described: FP8 attention (FP8_DPA=1, NVTE_FP8_DPA_BWD=1: priced in
# bf16), Megatron-Core's CUDA graphs on the CP 8 rows (MCORE_CUDA_GRAPH), TE's
# transposed-weight cache kept (disable_parameter_transpose_cache False; Blackwell's float8 GEMMs take either layout),
# the unfused cross-entropy (cross_entropy_loss_fusion False: fp32 logits of 1 GiB at CP 1, an eighth at CP 8).
# Each packed sequence is attended whole, across its documents (train.py: return_cu_seqlen False), as priced.
# Each log's tracked_stats carries, per block between evaluations, train_step_time and max_memory_usage, written
# by NVIDIA/mlperf-common at the commit requirements.txt pins (0993367, mlperf_common/callbacks/logging.py: the
# block's time over its steps, evaluations outside it; torch.cuda.max_memory_allocated in GiB on global rank 0,
# never reset, so warm-up and evaluation count): the step is the median over a run's blocks, the median of its ten
# runs (which span under 3.2%); the memory is the largest a run logs, the same in all ten (168.8 GiB at CP 1, 82.3
# at CP 8), compared as active bytes. Added on 2026-12-07 and evaluated first as the planner stood (held out:
# docs/heldout-2026-12-07/mlperf-v5.0-llama2-70b-lora-held-out.txt).
MLPERF50_LORA = ("MLCommons, MLPerf Training v5.0 results, llama2_70b_lora, NVIDIA's closed-division submissions, "
                 "https://github.com/mlcommons/training_results_v5.0")
# submission (results directory), GPU, GPUs, GPUs in one NVLink domain, CP, median seconds per step, max GiB logged
MLPERF50_LORA_ROWS = [("nyx_n1_ngc25.04_nemo", "b200", 8, 8, 1, 1.5127, 168.827),
                      ("tyche_ngpu8_ngc25.04_nemo", "gb200", 8, 72, 1, 1.4864, 168.83),
                      ("tyche_ngpu72_ngc25.04_nemo", "gb200", 72, 72, 8, 0.2386, 82.323),
                      ("tyche_ngpu144_ngc25.04_nemo", "gb200", 144, 72, 8, 0.2440, 82.321),
                      ("tyche_ngpu512_ngc25.04_nemo", "gb200", 512, 64, 8, 0.2577, 82.321)]


NEMO_MLPERF_LORA = {"system": "megatron-core", "search": False, "precision": "fp8", "float8": "te-delayed",
                    "lora_rank": 16, "lora_targets": ("wq", "wk", "wv", "wo"), "lora_dropout": 0.1,
                    "cp_exchange": "a2a"}
"""NVIDIA's NeMo 2 recipe for MLPerf's Llama 2 70B LoRA, v5.0 and v5.1 alike: LoRA of rank 16 on linear_qkv and
linear_proj with dropout 0.1, FP8 with delayed scaling under Megatron-Core, Transformer Engine's all-to-all CP."""


def mlperf50_lora_runs() -> list[Run]:
    model = dataclasses.replace(preset("llama2-70b"), max_seq_len=8192)
    runs = []
    for submission, gpu, n, per_node, cp, step, mem in MLPERF50_LORA_ROWS:
        dp = n // cp
        row = (f"NVIDIA {submission}: {n} {gpu.upper()}, TP 1 CP {cp}, global batch {dp} x 8192, {step} s per step "
               f"(train_step_time), max_memory_usage {mem}")
        runs.append(Run(f"MLPerf 5.0 NVIDIA 70B LoRA {gpu.upper()} n={n}", model, n, 8192, dp,
                        f"tp=1,pp=1,cp={cp},dp_replicate={dp},zero_stage=1,micro_batch=1,sequence_parallel=false,"
                        "activation_checkpoint=none", MLPERF50_LORA, row,
                        tflops=dp * 8192 * flops_per_token(model, 8192) / (step * n * 1e12), step_s=step, gpu=gpu,
                        gpus_per_node=per_node, activation_fp8_input=cp == 1, mem_gib=mem, mem_counts="active",
                        **NEMO_MLPERF_LORA))
    return runs


def mlperf_lora_runs() -> list[Run]:
    model = dataclasses.replace(preset("llama2-70b"), max_seq_len=8192)
    runs = []
    for version, submission, gpu, n, tp, cp, gbs, samples in MLPERF_LORA_ROWS:
        dp, step = n // (tp * cp), gbs / samples
        row = f"{submission}: {n} {gpu.upper()}, TP {tp} CP {cp}, global batch {gbs} x 8192, {samples} samples/s"
        on = "" if gpu == "h100" else f" {gpu.upper()}"
        runs.append(Run(f"MLPerf {version} {submission.split()[0]} 70B LoRA{on} n={n}", model, n, 8192, gbs,
                        # v4.0 ran Apex's FusedAdam (optim fused_adam), v4.1 Megatron's distributed optimizer
                        f"tp={tp},pp=1,cp={cp},dp_replicate={dp},zero_stage={int(version == '4.1' and dp > 1)},"
                        "micro_batch=1,"
                        f"sequence_parallel={str(tp > 1).lower()},activation_checkpoint=none",
                        MLPERF40_LORA if version == "4.0" else MLPERF41_LORA, row,
                        tflops=gbs * 8192 * flops_per_token(model, 8192) / (step * n * 1e12), step_s=step, gpu=gpu,
                        system="megatron-core", search=False, precision="fp8", float8="te-delayed", lora_rank=16,
                        lora_targets=("wq", "wk", "wv", "wo"), lora_dropout=0.1,
                        activation_fp8_input=version == "4.1" and gpu == "h200",
                        cp_exchange="a2a" if gpu == "b200" else None,
                        **({"inter_node_gbs": 2 * 400 / 8 / 4} if gpu == "l40s" else {})))
    return runs


# MLPerf Training v5.1 (November 2025), benchmark llama31_8b: Llama 3.1 8B pre-trained on C4 at sequence 8,192, closed
# division (mlcommons/training_results_v5.1: results/*/llama31_8b/result_*.txt; benchmarks/llama31_8b/
# implementations/*: the configs). Every result on H100, H200, B200 or GB200 in FP8 (ten B200 and GB200 results ran
# NVFP4, config_common_fp4.sh or their logs' fp4 true: not described, left out; B300 and GB300 are not in the
# catalogue). NVIDIA's NeMo recipe (NGC 25.09, HPE's built on 25.08, Oracle's not stated; pretrain.py over NeMo 2's
# Llama31Config8B, byte-identical in every submission that publishes it) but Cisco's: 32 layers of 4096, 32 heads and
# 8 KV heads, SwiGLU of 14,336, the Llama 3.1 tokenizer's 128,256 tokens, untied (the logs: 8,030,261,248 parameters);
# documents packed and attended across (reset_attention_mask False), micro-batch 1 (MBS 2 on one or two 8-GPU nodes at
# CP 1), the global batch the data-parallel width times MINIBS (the logs' global_batch_size), no recompute, no
# dropout, Megatron-Core's distributed optimizer with the gradients reduced in bf16 (grad_reduce_in_fp32 False) and
# the reduction and the weights' gather overlapped, FP8 with per-tensor current scaling (FP8_RECIPE tensorwise:
# te-current; HYBRID), attention in bf16 (config_common_fp8attn.sh not sourced; the logs: fp8_dot_product_attention
# False), TE's fused cross-entropy (CE_FUSION_IMPL te), the CP exchange Megatron's default (p2p: the ring), a
# whole-step CUDA graph (config_common_cg.sh: no host term for it to remove), config_common_8b.sh unsetting the
# expandable segments but for the University of Florida's runs, whose run_*n.sub sets them again. Not described: the
# weights gathered in FP8 (FP8_PARAM_GATHER), TP's communication overlap (NVIDIA's 512 GB200s at TP 2), Megatron's
# gradient bucket size (768M parameters, 134M by the yaml's default, or Cisco's yaml's 64: a bucket a tensor). HPE's
# run used an unpublished "-trial" config: the settings from its log's configuration dump and
# DistributedDataParallel's printout. NVIDIA's GB200s: one NVL72 rack of 72 (18 x 4), and 8 racks of 64 (the systems'
# JSON: 8 NVL72s for 128 nodes of 4). Cisco's two H100 runs are an older recipe of the same code (NGC 25.01 image, its
# own config_common.sh): delayed scaling in E4M3 (FP8_HYBRID unset), the weights in FP8 (FP8_PARAMS), no CUDA graphs,
# TP 2 with SP and TP overlap at 16 nodes, PYTORCH_CUDA_ALLOC_CONF max_split_size_mb:128 (no expandable segments);
# their logs carry torch.cuda.max_memory_allocated in GiB on rank 0 (NVIDIA/mlperf-common at 0993367: the v5.0 LoRA
# rows' callback), compared as active bytes. The step: each log's tracked_stats train_step_time from mlperf-common's
# logging.py, the time of a block between evaluations over its steps; the median over a run's blocks, the median over
# its ten runs (which span under 1.4%, NVIDIA's 72 GB200s' 2.8%; NeMo's per-32-step timer, the callback's other
# train_step_time, reads 0.2-2% lower, Cisco's per-step 3-8%). Added on 2026-12-07 and evaluated first as the planner
# stood (held out: docs/heldout-2026-12-07/mlperf-v5.1-llama31-8b-held-out.txt).
MLPERF51_8B = ("MLCommons, MLPerf Training v5.1 results, llama31_8b, closed division, "
               "https://github.com/mlcommons/training_results_v5.1")
LLAMA31_8B = dataclasses.replace(preset("llama3-8b"), name="llama31-8b", max_seq_len=8192)
# submitter and results directory, GPU, GPUs, GPUs in one NVLink domain, TP, CP, micro-batch, global batch
# (sequences), median seconds per step, max GiB logged
MLPERF51_8B_ROWS = [("Cisco hpf_n8", "h100", 64, 8, 1, 1, 1, 64, 0.7419, 71.229),
                    ("Cisco hpf_n16", "h100", 128, 8, 2, 1, 1, 64, 0.5274, 35.707),
                    ("HPE HPE-Cray-XD670-H200-SXM5-141GB_n8_25.09", "h200", 64, 8, 1, 2, 1, 32, 0.3539, None),
                    ("Dell 2xXE9680Lx8B200-SXM-180GB", "b200", 16, 8, 1, 1, 2, 32, 0.5918, None),
                    ("Dell 2xXE9685Lx8B200-SXM-180GB", "b200", 16, 8, 1, 1, 2, 32, 0.5867, None),
                    ("Oracle 8xBM.GPU.B200.8", "b200", 64, 8, 1, 2, 1, 32, 0.1910, None),
                    ("UF hpg.dgxb200x8.n1", "b200", 8, 8, 1, 1, 2, 16, 0.5452, None),
                    ("UF hpg.dgxb200x8.n2", "b200", 16, 8, 1, 1, 2, 32, 0.5764, None),
                    ("UF hpg.dgxb200x8.n4", "b200", 32, 8, 1, 2, 1, 16, 0.1899, None),
                    ("UF hpg.dgxb200x8.n8", "b200", 64, 8, 1, 2, 1, 32, 0.1906, None),
                    ("UF hpg.dgxb200x8.n16", "b200", 128, 8, 1, 2, 1, 64, 0.1943, None),
                    ("UF hpg.dgxb200x8.n32", "b200", 256, 8, 1, 2, 1, 128, 0.2226, None),
                    ("Verda b200_8x8_ngc25.09", "b200", 64, 8, 1, 2, 1, 32, 0.1921, None),
                    ("NVIDIA tyche_ngpu72_ngc25.09_nemo", "gb200", 72, 72, 1, 2, 1, 36, 0.1716, None),
                    ("NVIDIA tyche_ngpu512_ngc25.09_nemo", "gb200", 512, BRIDGE_GB200_RACK, 2, 4, 1, 64, 0.0901, None)]


MLPERF51_SERVERS = {"Dell 2xXE9680Lx8B200-SXM-180GB": "XE9680L", "Dell 2xXE9685Lx8B200-SXM-180GB": "XE9685L",
                    "Dell 1xXE9680Lx8H200-SXM-141GB": "XE9680L", "Dell 1xXE9685Lx8B200-SXM-180GB": "XE9685L",
                    "Dell 1xXE9780x8B200-SXM-180GB": "XE9780", "Lenovo SR680aV3-8xB200_SXM_180GB": "SR680aV3",
                    "Lenovo SR780aV3-8xB200_SXM_180GB": "SR780aV3", "Supermicro AS-4126GS-NBR-LCC": "AS-4126GS",
                    "Supermicro AS-A126GS-TNBR": "AS-A126GS", "Supermicro SYS-422GS-NBRT-LCC": "SYS-422GS"}
"""The server of the MLPerf v5.1 rows whose submitter ran more than one kind: in their names."""


def mlperf51_who(submission: str) -> str:
    """A v5.1 row's name's submitter, with its server where the submitter ran several (MLPERF51_SERVERS)."""
    server = MLPERF51_SERVERS.get(submission)
    return submission.split()[0] + (f" {server}" if server else "")


def mlperf51_8b_runs() -> list[Run]:
    runs = []
    for submission, gpu, n, per_node, tp, cp, mbs, gbs, step, mem in MLPERF51_8B_ROWS:
        dp = n // (tp * cp)
        cisco = submission.startswith("Cisco")
        row = (f"{submission}: {n} {gpu.upper()}, TP {tp} x CP {cp} x DP {dp}, micro-batch {mbs}, global batch "
               f"{gbs} x 8192, {step} s per step (train_step_time)" + (f", max_memory_usage {mem}" if mem else ""))
        runs.append(Run(f"MLPerf 5.1 8B {mlperf51_who(submission)} {gpu.upper()} n={n}", LLAMA31_8B, n, 8192, gbs,
                        f"tp={tp},pp=1,cp={cp},dp_replicate={dp},zero_stage=1,micro_batch={mbs},"
                        f"sequence_parallel={str(tp > 1).lower()},activation_checkpoint=none", MLPERF51_8B, row,
                        tflops=gbs * 8192 * flops_per_token(LLAMA31_8B, 8192) / (step * n * 1e12), step_s=step,
                        gpu=gpu, gpus_per_node=per_node, system="megatron-core", search=False, precision="fp8",
                        float8="te-delayed" if cisco else "te-current", grads_in_fp32=False, dropout=False,
                        expandable_segments=submission.startswith("UF"), mem_gib=mem,
                        mem_counts="active" if mem else "device"))
    return runs


# MLPerf Training v5.1 (November 2025), the same LoRA benchmark: every closed-division result on H100, H200, B200 or
# GB200 in FP8 that ran NVIDIA's NeMo 2 recipe of the round (NGC 25.09; train.py, config_common.sh and the yaml as
# NVIDIA's, whose own 8-GPU GB200 result moved to NVFP4: it and the other NVFP4 results left out) and logs
# mlperf-common's train_step_time: Dell's, GigaComputing's, Lenovo's, Supermicro's and the University of Florida's
# B200 servers, Nebius's 4 B200 nodes, Dell's H200 server, NVIDIA's and Wiwynn's GB200 NVL72 racks (one, and 8 of 64
# or 72 GPUs). Wiwynn's published code is the v5.0 recipe, its logs NVIDIA's v5.1 image (nvdlfwea mlperftv51,
# 2025-10-06) and the round's settings; Nebius's published n4 config is an NVFP4 one, its logs an FP8 run at CP 4:
# each described as its logs show it. Nine results that ran the v4.1-era NeMo 1 recipe (Cisco's, Krai's, Quanta's and
# one of Dell's, on H100 and H200) log throughput alone, and Dell's 2xXE9685L logs are absent from the copy of the
# repository read here: left out. As v5.0 ran it (mlperf50_lora_runs): packed sequences of 8,192 attended whole,
# micro-batch 1, LoRA of rank 16 on linear_qkv and linear_proj with dropout 0.1, the distributed optimizer, FP8 with
# delayed scaling (hybrid, amax history 4) and the frozen weights in FP8 (train.py's CustomLlamaModel builds the model
# under te.fp8_model_init; FP8_PARAM_GATHER 0 only keeps the weights' gather off), Transformer Engine's all-to-all CP
# (cp_comm_type a2a), no recompute, no expandable segments; the float8 SwiGLU input (FP8_ACT) on the B200 and H200 CP
# 1 configs and Nebius's CP 4 run, not at CP 8 or the University of Florida's CP 4. Dell's H200 run ran TP 2 with SP
# (its log's dump; its folder's XE9680L common config sets TP 2), two micro-batches a step (MINIBS 2). Not described:
# FP8 attention (FP8_DPA=1, priced in bf16), the whole-step CUDA graph at CP 4 and 8 (MCORE_CUDA_GRAPH,
# full_iteration), TE's fused operations (USE_TE_OPS, FUSED_SINGLE_QKV_ROPE). The step: the median of each run's
# mlperf-common block train_step_time (the writer at the pin b86d175, after the one that stopped logging memory), the
# median of its ten runs (nine for Dell's XE9780: one was cancelled). Added on 2026-12-07 and evaluated first as the
# planner stood (held out: docs/heldout-2026-12-07/mlperf-v5.1-llama2-70b-lora-held-out.txt).
MLPERF51_LORA = ("MLCommons, MLPerf Training v5.1 results, llama2_70b_lora, closed division, "
                 "https://github.com/mlcommons/training_results_v5.1")
# submitter and results directory, GPU, GPUs, GPUs in one NVLink domain, TP, CP, global batch, float8 SwiGLU input,
# median seconds per step
MLPERF51_LORA_ROWS = [("Dell 1xXE9680Lx8H200-SXM-141GB", "h200", 8, 8, 2, 1, 8, True, 3.1468),
                      ("Dell 1xXE9685Lx8B200-SXM-180GB", "b200", 8, 8, 1, 1, 8, True, 1.2957),
                      ("Dell 1xXE9780x8B200-SXM-180GB", "b200", 8, 8, 1, 1, 8, True, 1.2963),
                      ("Dell 2xXE9680Lx8B200-SXM-180GB", "b200", 16, 8, 1, 1, 16, True, 1.3926),
                      ("GigaComputing G894-AD1_pytorch", "b200", 8, 8, 1, 1, 8, True, 1.3020),
                      ("Lenovo SR680aV3-8xB200_SXM_180GB", "b200", 8, 8, 1, 1, 8, True, 1.2934),
                      ("Lenovo SR780aV3-8xB200_SXM_180GB", "b200", 8, 8, 1, 1, 8, True, 1.3141),
                      ("Supermicro AS-4126GS-NBR-LCC", "b200", 8, 8, 1, 1, 8, True, 1.3120),
                      ("Supermicro AS-A126GS-TNBR", "b200", 8, 8, 1, 1, 8, True, 1.3030),
                      ("Supermicro SYS-422GS-NBRT-LCC", "b200", 8, 8, 1, 1, 8, True, 1.2976),
                      ("UF hpg.dgxb200x8.n1", "b200", 8, 8, 1, 1, 8, True, 1.3186),
                      ("UF hpg.dgxb200x8.n2", "b200", 16, 8, 1, 1, 16, True, 1.3236),
                      ("Nebius nebius_b200_n4", "b200", 32, 8, 1, 4, 8, True, 0.4063),
                      ("UF hpg.dgxb200x8.n4", "b200", 32, 8, 1, 4, 8, False, 0.3793),
                      ("UF hpg.dgxb200x8.n8", "b200", 64, 8, 1, 8, 8, False, 0.2155),
                      ("UF hpg.dgxb200x8.n16", "b200", 128, 8, 1, 8, 16, False, 0.2104),
                      ("NVIDIA tyche_ngpu72_ngc25.09_nemo", "gb200", 72, 72, 1, 8, 9, False, 0.1994),
                      ("Wiwynn 1xKinabalux18x4GB200", "gb200", 72, 72, 1, 8, 9, False, 0.1966),
                      ("NVIDIA tyche_ngpu512_ngc25.09_nemo", "gb200", 512, BRIDGE_GB200_RACK, 1, 8, 64, False, 0.2107),
                      ("Wiwynn 8xKinabalux18x4GB200", "gb200", 576, 72, 1, 8, 72, False, 0.2122)]


def mlperf51_lora_runs() -> list[Run]:
    model = dataclasses.replace(preset("llama2-70b"), max_seq_len=8192)
    runs = []
    for submission, gpu, n, per_node, tp, cp, gbs, act, step in MLPERF51_LORA_ROWS:
        dp = n // (tp * cp)
        row = (f"{submission}: {n} {gpu.upper()}, TP {tp} x CP {cp} x DP {dp}, global batch {gbs} x 8192, {step} s "
               "per step (train_step_time)")
        runs.append(Run(f"MLPerf 5.1 70B LoRA {mlperf51_who(submission)} {gpu.upper()} n={n}", model, n, 8192, gbs,
                        f"tp={tp},pp=1,cp={cp},dp_replicate={dp},zero_stage=1,micro_batch=1,"
                        f"sequence_parallel={str(tp > 1).lower()},activation_checkpoint=none", MLPERF51_LORA, row,
                        tflops=gbs * 8192 * flops_per_token(model, 8192) / (step * n * 1e12), step_s=step, gpu=gpu,
                        gpus_per_node=per_node, activation_fp8_input=act, **NEMO_MLPERF_LORA))
    return runs


# --------------------------------------------------------------------------------------------------
# Megatron Bridge's mixture-of-experts rows (NVIDIA-NeMo/Megatron-Bridge, docs/performance-summary.md and
# docs/performance-summary-archive.md, releases 25.09 to 26.06): Qwen3 30B-A3B and 235B-A22B pre-training on DGX-H100
# in FP8, the layout and tokens/s per GPU as printed; "we force-balance the token distribution among experts and
# all benchmarks are token-dropless" (25.09's: "tokendrop"). Every release's DGX-H100 Qwen3 row is taken but two
# whose printed layout is not the one the release's code sets (25.11's 30B prints 25.09's PP 2 x VP 24 at MBS 2,
# its recipe sets VP 12 at MBS 1 with the all-to-all overlapped; 26.02.01's 30B prints 26.02's PP 2 x VP 12 x EP 8,
# its recipe EP 16 over HybridEP, which 26.04 prints). Each release's code read at its tag (25.09 v0.1.0rc3, 25.11
# v0.2.0, 26.02 v0.3.0, 26.02.01 v0.3.1, 26.04 v0.4.0, 26.04.01 v0.4.2, 26.06 v0.5.0: docs/releases/
# software-versions.md): scripts/performance (configs/qwen3, utils/helpers.py) over the recipes
# src/megatron/bridge/recipes/qwen/qwen3_moe.py. Shared by every row: FP8 with per-tensor current scaling
# (bf16_with_fp8_current_scaling_mixed: te-current; 25.09's precision column is absent: its YAML has an fp8_cs block,
# and its MBS 2 is an FP8 recipe's, BF16's being 1, though delayed scaling, the launcher's default, is not ruled
# out), main gradients and their reduction in bf16 (grad_reduce_in_fp32 False), no recompute,
# the distributed optimizer (ZeRO-1) with its gathers and reductions overlapped, expert tensor parallelism 1 (the
# experts folded over the tp ranks: Training.moe_layer "megatron-core"), grouped GEMMs and fused permutation, no CUDA
# graphs. The dispatcher: all-to-all (alltoall, every routed copy) but DeepEP (26.02's 30B) and HybridEP (26.04's
# 30B on): benchmarks/systems/megatron-core-flex.toml. The all-to-all overlapped with another micro-batch's compute
# (overlap_moe_expert_parallel_comm with delay_wgrad_compute: Training.ep_overlap) in 25.11's 235B on and 26.02's
# 30B. Not priced: the host's synchronisation on each MoE layer's per-expert counts (the dropless all-to-all
# dispatcher's device-to-host copy before its exchange; TEGroupedMLP's tokens_per_expert.tolist()), tp's
# communication overlap (25.09's 235B), the weights kept in float8 (fp8_param_gather),
# Qwen3's per-head q/k norms (the preset qwen3-30b-a3b-like leaves them out). 25.09's token drop (capacity 1.0,
# padded to capacity) computes and exchanges what balanced routing does. Qwen3 235B-A22B from its config.json: 94
# layers, hidden 4096, 64 query heads and 4 KV heads of 128, 128 experts of 1536, top 8, vocabulary 151,936, untied.
# Added on 2026-12-07 and evaluated first as the planner stood (held out: docs/heldout-2026-12-07/
# megatron-bridge-moe-held-out.txt).
QWEN3_30B = preset("qwen3-30b-a3b-like")
QWEN3_235B = dataclasses.replace(QWEN3_30B, name="qwen3-235b-a22b-like", dim=4096, n_layers=94, n_heads=64,
                                 ffn_hidden=12288, moe_ffn_hidden=1536)
# release, model, GPUs, GBS, MBS, TP, PP, VP, EP, dispatcher, the all-to-all overlapped, tokens/s per GPU
BRIDGE_MOE_ROWS = [("25.09", "30B", 16, 512, 2, 1, 2, 24, 8, "alltoall", False, 10494),
                   ("25.09", "235B", 256, 2048, 1, 2, 8, 4, 32, "alltoall", False, 1204),
                   ("25.11", "235B", 256, 2048, 1, 2, 8, 4, 32, "alltoall", True, 1575),
                   ("26.02", "30B", 16, 1024, 1, 1, 2, 12, 8, "deepep", True, 5113),
                   ("26.02", "235B", 256, 8192, 1, 2, 8, 4, 32, "alltoall", True, 1633),
                   ("26.02.01", "235B", 256, 8192, 1, 2, 8, 4, 32, "alltoall", True, 1611),
                   ("26.04", "30B", 16, 1024, 1, 1, 1, 1, 16, "hybridep", False, 8901),
                   ("26.04", "235B", 256, 8192, 1, 2, 8, 4, 32, "alltoall", True, 1686),
                   ("26.04.01", "30B", 16, 1024, 1, 1, 1, 1, 16, "hybridep", False, 8960),
                   ("26.04.01", "235B", 256, 8192, 1, 2, 8, 4, 32, "alltoall", True, 1712),
                   ("26.06", "30B", 16, 1024, 1, 1, 1, 1, 16, "hybridep", False, 8826)]


def bridge_moe_runs() -> list[Run]:
    runs = []
    for release, size, n, gbs, mbs, tp, pp, vp, ep, dispatcher, overlap, tps in BRIDGE_MOE_ROWS:
        model = QWEN3_30B if size == "30B" else QWEN3_235B
        dp = n // (tp * pp)
        plan = (f"tp={tp},pp={pp},dp_replicate={dp},ep={ep},zero_stage=1,micro_batch={mbs},"
                f"activation_checkpoint=none")
        plan += pp_knobs(pp, vp)
        if tp > 1:
            plan += ",sequence_parallel=true"
        row = (f"Qwen3_{size} | DGX-H100 | {n} | GBS {gbs} | MBS {mbs} | TP {tp} | PP {pp} | "
               f"VP {vp if vp > 1 else 'n/a'} | EP {ep} | {tps} tokens/s/GPU")
        runs.append(Run(f"Bridge MoE {release} Qwen3 {size} n={n}", model, n, 4096, gbs, plan, BRIDGE,
                        f"{release}: {row} ({dispatcher}{', all-to-all overlapped' if overlap else ''})",
                        tflops=tps * flops_per_token(model, 4096) / 1e12, ep_overlap=overlap,
                        gpu="h100", system="megatron-core" if dispatcher == "alltoall" else "megatron-core-flex.toml",
                        search=False, precision="fp8", float8="te-current", grads_in_fp32=False,
                        expert_imbalance=1.0))
    return runs


RUNS = (narayanan_runs() + korthikanti_runs() + llama3_runs() + bloom_runs() + bloom_prequel_runs() + mtnlg_runs()
        + opt_runs()
        + torchtitan_runs() + torchtitan_2025_runs() + trainy_runs() + torchao_runs()
        + foundry_runs() + mcore_runs() + nemo_runs() + dgxc_runs() + bekman_runs() + nemo_long_runs()
        + nemo_launcher_runs() + olmo_core_runs() + torchtune_runs() + automodel_runs() + fa2_runs() + glm_runs()
        + bloomberg_runs() + tinyllama_runs() + llama1_runs() + fms_runs() + mlperf_runs()
        + mlperf_lora_runs() + bridge_moe_runs() + nemo_finetune_runs() + nemo_launcher_2024_runs()
        + mlperf41_runs() + bridge_gb200_runs() + bridge_finetune_runs() + mlperf50_runs()
        + mlperf50_lora_runs() + mlperf51_8b_runs() + mlperf51_lora_runs() + mlperf51_405b_runs())


# --------------------------------------------------------------------------------------------------


NCCL_SMS_MODELLED = True  # --no-nccl-sms: False


def cluster_of(run: Run) -> Cluster:
    acc = accelerator(run.gpu)
    if not NCCL_SMS_MODELLED:
        acc = dataclasses.replace(acc, nccl_channels=0)
    # DeepSpeed's ZeRO-3 of 2021 gathered parameter by parameter, synchronously, with a copy after each gather
    # (DeepSpeed issue #1174, "ZeRO3 is slow, even with nvlink for all-gather", and PR #1188, both June 2021), and
    # Narayanan et al.'s ZeRO-3 times do not fall from 768 to 1,536 GPUs: its rings are taken as bound to one NIC
    # per rank, where FSDP's flat-buffer collectives (llm-foundry's rows) use every NIC of the node
    rails = run.system != "deepspeed-2021"
    if run.inter_node_gbs is not None:
        acc = dataclasses.replace(acc, inter_node_bw=run.inter_node_gbs * 1e9)
    if run.gpu_memory_gib is not None:
        acc = dataclasses.replace(acc, memory_bytes=run.gpu_memory_gib * GiB)
    if run.mem_bandwidth_tbs is not None:
        acc = dataclasses.replace(acc, mem_bandwidth=run.mem_bandwidth_tbs * 1e12)
    if run.peak_tflops is not None:
        share = run.peak_tflops * 1e12 / acc.peak_flops["bf16"]
        acc = dataclasses.replace(acc, peak_flops={k: v * share for k, v in acc.peak_flops.items()})
    return Cluster(acc, run.gpus, gpus_per_node=run.gpus_per_node, rail_collectives=rails)


SYSTEM_FILES = Path(__file__).parent / "systems"


def system_of(run: Run):
    """The run's system: a preset by name, or a TOML file under benchmarks/systems (as `--system FILE`)."""
    return _system(run.system)


@functools.lru_cache(maxsize=None)
def _system(spec: str):
    """resolve_system, each file read once (training_of is asked for every run and search key)."""
    return resolve_system(str(SYSTEM_FILES / spec) if spec.endswith(".toml") else spec)


def training_of(run: Run) -> Training:
    if run.system is not None:
        fields = {**system_of(run).training_fields(), "compile": run.compile}
        if run.float8 is not None:
            fields["float8"] = run.float8
        if run.compile_loss is not None:
            fields["compile_loss"] = run.compile_loss
        if run.cp_repeats_kv is not None:
            fields["cp_repeats_kv"] = run.cp_repeats_kv
        if run.grads_in_fp32 is not None:
            fields["grads_in_fp32"] = run.grads_in_fp32
        if run.dropout is not None:
            fields["dropout"] = run.dropout
        if run.overlap_grad_reduce is not None:
            fields["overlap_grad_reduce"] = run.overlap_grad_reduce
        if run.optimizer_dtype is not None:
            fields["optimizer_dtype"] = run.optimizer_dtype
        if run.reduce_dtype is not None:
            fields["reduce_dtype"] = run.reduce_dtype
        if run.optimizer_passes is not None:
            fields["optimizer_passes"] = run.optimizer_passes
        if run.attention_kernel is not None:
            fields["attention_kernel"] = run.attention_kernel
        fields["fused_rmsnorm"] = fields["fused_rmsnorm"] and run.fused_rmsnorm  # (either says composite)
        fields["activation_offload"] = fields["activation_offload"] or run.activation_offload
        fields["offload_layers"] = run.offload_layers or fields["offload_layers"]
        fields["optimizer_in_backward"] = fields["optimizer_in_backward"] or run.optimizer_in_backward
        fields["activation_fp8_input"] = fields["activation_fp8_input"] or run.activation_fp8_input
        fields["ep_overlap"] = fields["ep_overlap"] or run.ep_overlap
        if run.expandable_segments is not None:
            fields["expandable_segments"] = run.expandable_segments
        if run.cp_exchange is not None:
            fields["cp_exchange"] = run.cp_exchange
        if run.loss_chunks is not None:
            fields["loss_chunks"] = run.loss_chunks
        return Training(seq_len=run.seq, global_batch=run.batch, precision=run.precision, lora_rank=run.lora_rank,
                        qlora=run.qlora, lora_targets=run.lora_targets, lora_dropout=run.lora_dropout,
                        expert_imbalance=run.expert_imbalance, dispatch_ranks=run.dispatch_ranks, **fields)
    # (the system presets' overrides: these rows state their stacks field by field below)
    assert run.grads_in_fp32 is None and run.dropout is None and run.optimizer_dtype is None, run.name
    # Megatron's vocab-parallel cross-entropy; shardwise's engine (and so 'torch') gathers the logits
    # (layout 'torch' is shardwise's engine, eager elementwise operators included). These stacks recompute with a
    # reentrant checkpoint that replays the whole forward (Megatron-LM's and DeepSpeed's CheckpointFunction,
    # metaseq's fairscale checkpoint_wrapper); Meta's of Llama 3 is not published: the same assumed. Llama 3's
    # context parallelism all-gathers K and V, whose exposed latency its paper calls small under GQA: priced as the
    # ring's hops behind the attention (cp_exchange 'ring'), not as shardwise's blocking all-gather
    return Training(seq_len=run.seq, global_batch=run.batch, layout=run.layout, loss_parallel=run.layout != "torch",
                    checkpoint_early_stop=False, cp_exchange="ring",
                    fused_attention=run.fused_attention, dropout=not run.fused_attention,
                    elementwise="eager" if run.layout == "torch" else "fused", precision=run.precision,
                    distribute_checkpoints=run.distribute_checkpoints, keeps_bf16_grads=run.keeps_bf16_grads,
                    pipeline_split=run.pipeline_split, embedding_norm=run.embedding_norm,
                    fixed_overhead_gib=run.fixed_overhead_gib, reduce_dtype=run.reduce_dtype or "fp32",
                    overlap_grad_reduce=run.overlap_grad_reduce is not False,
                    flat_params=run.layout == "fsdp-mp",  # (fairscale's FSDP, metaseq's OPT: flat as FSDP1's)
                    # (one block in k as shardwise's engine picks them; not described for the others)
                    partial_checkpoint="first" if run.layout == "torch" else "none",
                    **({"attention_kernel": run.attention_kernel} if run.attention_kernel else {}))


def given_plan(run: Run):
    """The fastest completion of the stated knobs that fits, or (none fits) the plan itself with micro-batch 1,
    full recompute and 2 virtual stages where left free, evaluated regardless of memory. Returns (evaluation,
    fits)."""
    args, training, cluster = run.model, training_of(run), cluster_of(run)
    # the search completes the plan without offload (it offers what shardwise's engine runs: Run.offload)
    fixed = {"offload": "none", **parse_layout(run.plan, "--plan")}
    ranked = search(args, training, cluster, fixed=fixed, top_k=1).ranked
    if ranked and run.offload:
        ev = evaluate(args, training, dataclasses.replace(ranked[0].plan, offload=run.offload), cluster)
        return ev, ev.fits
    if ranked:
        return ranked[0], True
    local = run.batch // (fixed.get("dp_replicate", 1) * fixed.get("dp_shard", 1))
    mb = fixed.get("micro_batch", 1)
    plan = Plan(**{"micro_batch": mb, "grad_accum": local // mb, "activation_checkpoint": "full",
                   "sequence_parallel": fixed.get("tp", 1) > 1, **{k: v for k, v in fixed.items() if k != "dp"},
                   **({"offload": run.offload} if run.offload else {})})
    ev = evaluate(args, training, plan, cluster)
    return ev, ev.fits


def describe(p: Plan) -> str:
    sched = {"none": "-", "1f1b": "1f1b", "gpipe": "gpipe", "zero-bubble": "zb",
             "interleaved-1f1b": f"i{p.virtual_stages}"}
    return (f"t{p.tp} p{p.pp} c{p.cp} d{p.dp_replicate}x{p.dp_shard} z{p.zero_stage} mb{p.micro_batch} "
            f"{sched[p.pp_schedule]} rc={p.activation_checkpoint[:3]}"
            f"{f'/{p.activation_checkpoint_every}' if p.activation_checkpoint_every > 1 else ''}"
            f"{' sp' if p.sequence_parallel else ''}"
            f"{f' offload={p.offload}' if p.offload != 'none' else ''}")


def check_mapping() -> None:
    print("model mapping: params (ours vs Narayanan eq. 2) and training FLOPs per token (ours vs eq. 7)")
    seen = set()
    for run in RUNS:
        a = run.model
        if a.name in seen or a.name.startswith(("llama", "bloom")) or a.n_kv_heads != a.n_heads:
            continue  # eq. 2 and eq. 7 are multi-head GPTs' (Nemotron-4's grouped-query attention is not)
        seen.add(a.name)
        h, l, v, s = a.dim, a.n_layers, a.vocab_size, 2048
        p_eq2 = 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h)) + (0 if a.tie_embeddings else v * h)
        ratio = flops_per_token(a, s) * s / eq7_flops(a, 1, s)
        print(f"  {a.name:11s} f={a.ffn_hidden:6d} params {num_params(a) / 1e9:8.2f}B vs {p_eq2 / 1e9:8.2f}B, "
              f"FLOPs/eq.7 = {ratio:.5f}")


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation: Pearson's on the ranks."""
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def published_memory(ev: Evaluation, run: Run, training: Training | None = None) -> float:
    """The planner's peak in bytes as the source counts its own (Run.mem_counts), for `ev` as evaluated with
    `training` (default: the run's, training_of)."""
    memory = ev.memory
    if run.mem_counts not in ("device", "reserved", "active"):
        raise ValueError(f"{run.name}: mem_counts {run.mem_counts!r} is not 'device', 'reserved' or 'active'")
    if run.mem_counts == "active":
        return memory["total"] - memory["fragmentation"] - memory["fixed_overhead"]
    if run.mem_counts == "reserved":
        return reserved_bytes(run.model, training or training_of(run), ev.plan, ev.memory_stage,
                              ev.budget - memory["fixed_overhead"])
    return memory["total"]


def sweep_of(run: Run) -> str | None:
    """The sweep a run belongs to, for rank order: one model on one kind of GPU from one source, its layouts,
    batches, sequence lengths and GPU counts varied (llm-foundry's tables); None: not part of a sweep."""
    if run.name.startswith("foundry"):
        return f"llm-foundry {run.gpu}{' fp8' if run.precision == 'fp8' else ''} {run.model.name}"
    if run.source == TRAINY:
        return "torchtitan H200 (Trainy)"
    if run.name.startswith("torchtitan"):
        return f"torchtitan {run.quote.split(' row')[0]}"
    if run.name.startswith("BigScience"):
        return f"BLOOM's layout search {run.name.split()[1]}"
    if run.source == NEMO_LONG:
        return "NeMo long sequence Llama 2 7B"
    if run.source == FA2_PAPER:
        return f"FlashAttention-2's table {run.model.name} {run.seq // 1024}K"
    if run.source == NEMO_LAUNCHER:
        return f"NeMo Megatron launcher {run.name.split()[1]} {run.name.split()[2]}"
    if run.source == MLPERF31:
        return "MLPerf v3.1 GPT-3 175B"
    if run.source == MLPERF41 and run.gpu == "h100":
        return "MLPerf v4.1 GPT-3 175B (H100)"
    if run.source in (MLPERF40_LORA, MLPERF41_LORA) and run.gpu == "h100":
        return f"MLPerf v{run.name.split()[1]} Llama 2 70B LoRA (H100)"
    if run.source == MLPERF50 and run.gpu in ("h100", "gb200"):
        return f"MLPerf v5.0 Llama 3.1 405B ({run.gpu.upper()})"
    if run.source == MLPERF51_8B and run.gpu == "b200":
        return "MLPerf v5.1 Llama 3.1 8B (B200)"
    if run.source == MLPERF51_LORA and run.gpu == "b200" and run.gpus > 16:
        return "MLPerf v5.1 Llama 2 70B LoRA (B200 with CP)"
    return None


W = max(len(run.name) for run in RUNS)
"""Width of the run-name column."""


def hide_tp_comm(share: float) -> None:
    """The counterfactual `--tp-comm-hidden SHARE`, not a planner knob: that share of tensor parallelism's
    collectives hidden in the runs described as Megatron-Core with sequence parallelism, as Transformer Engine's
    userbuffers overlap would hide it, which the planner does not price (docs/planner.md, "NVIDIA's DGX Cloud
    recipes, held out")."""
    priced = timing._tp_comm

    def tp_comm(args, training, plan, cluster, *rest, **kw):
        seconds = priced(args, training, plan, cluster, *rest, **kw)
        return seconds * (1 - share) if training.system == "megatron-core" and plan.sequence_parallel else seconds

    timing._tp_comm = tp_comm


def main() -> None:
    global NCCL_SMS_MODELLED
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-nccl-sms", action="store_true",
                        help="leave out the SMs NCCL's kernels take from hidden compute (the catalogue's "
                             "nccl_channels), as the planner did before 2026-12-05")
    parser.add_argument("--tp-comm-hidden", type=float, default=0.0, metavar="SHARE",
                        help="a counterfactual: hide this share of tp's collectives in the runs described as "
                             "Megatron-Core (TE's userbuffers overlap, not priced)")
    ns = parser.parse_args()
    NCCL_SMS_MODELLED = not ns.no_nccl_sms
    if ns.tp_comm_hidden:
        hide_tp_comm(ns.tp_comm_hidden)
    start_all = time.perf_counter()
    check_mapping()
    print()
    head = (f"{'run':{W}s} {'pred s':>8s} {'pub s':>8s} {'TF/s pred':>9s} {'pub':>5s} {'ratio':>5s} "
            f"{'MFU pred':>8s} {'pub':>6s} {'GiB':>6s} fit/pub  given plan (completed)")
    print(head)
    print("-" * len(head))
    ratios, searches, search_lines, memories, mem_lines, sweeps = [], {}, [], [], [], {}
    for run in RUNS:
        try:
            ev, fits = given_plan(run)
        except PlannerError as e:
            print(f"{run.name:{W}s} cannot be expressed: {e}")
            continue
        t = ev.time
        pub_s = run.published_step() if (run.tflops or run.step_s) else None
        mem = published_memory(ev, run) / GiB
        if run.mem_gib is not None:
            memories.append((run.name, mem / run.mem_gib))
            mem_lines.append(f"  {run.name:{W}s} predicted {mem:5.1f} GiB, published {run.mem_gib:5.1f} GiB: "
                             f"{mem / run.mem_gib:.3f}")
        fit_col = f"{'yes' if fits else 'NO':>3s}/{'yes' if run.fitted else 'NO':3s}"
        flag = "" if fits == run.fitted else "  <- disagrees"
        if pub_s is None:
            print(f"{run.name:{W}s} {t.step_time_s:8.2f} {'-':>8s} {'-':>9s} {'-':>5s} {'-':>5s} {t.mfu:8.1%} "
                  f"{'-':>6s} {mem:6.1f} {fit_col}  {describe(ev.plan)}{flag}")
        else:
            tf_pred = run.tflops * pub_s / t.step_time_s if run.tflops else float("nan")
            ratio = pub_s / t.step_time_s
            pub_mfu = run.mfu if run.mfu is not None else \
                flops_per_token(run.model, run.seq) * run.batch * run.seq / (
                    pub_s * run.gpus * cluster_of(run).accelerator.peak("bf16"))
            mark = "" if run.mfu is not None else "*"
            if fits and run.fitted:
                ratios.append((run.name, ratio))
            if sweep_of(run):  # tokens/s per GPU, predicted and published
                tokens = run.batch * run.seq / run.gpus
                sweeps.setdefault(sweep_of(run), []).append((tokens / t.step_time_s, tokens / pub_s))
            print(f"{run.name:{W}s} {t.step_time_s:8.2f} {pub_s:7.2f}{'m' if run.step_s else ' '} {tf_pred:9.0f} "
                  f"{run.tflops:5.0f} {ratio:5.2f} "
                  f"{t.mfu:8.1%} {pub_mfu:5.1%}{mark} {mem:6.1f} {fit_col}  {describe(ev.plan)}{flag}")
        if run.search:
            key = (run.model.name, run.gpus, run.seq, run.batch, run.gpu, training_of(run), cluster_of(run))
            if key not in searches:
                t0 = time.perf_counter()
                best = search(run.model, training_of(run), cluster_of(run), top_k=1)
                searches[key] = (best, time.perf_counter() - t0)
                b = best.ranked[0] if best.ranked else None
                line = (f"{run.name:{W}s} " + (f"{b.time.step_time_s:8.2f} s  MFU {b.time.mfu:5.1%}  "
                                               f"{b.memory['total'] / GiB:5.1f} GiB  {describe(b.plan)}"
                                               if b else "nothing fits"))
                search_lines.append(line + f"  ({searches[key][1]:.1f} s, {best.evaluated} sized)")
    print("\nm: measured step time (otherwise implied by the published throughput and the source's FLOP formula)")
    print("* published MFU derived from the published time and the planner's model FLOPs (not printed by the source)")
    print("ratio = predicted / published throughput = published / predicted step time (> 1: planner optimistic)\n")
    era = [x for x in ratios if x[0].startswith(("N21", "K22", "Llama3", "BLOOM"))]
    groups = {"all": ratios, "all but ZeRO-3": [x for x in ratios if "ZeRO-3" not in x[0]],
              "all before the DGX Cloud rows":
                  [x for x in ratios if not x[0].startswith("DGXC")],
              "described as Megatron-Core (the table, NeMo, DGX Cloud)":
                  [x for x in ratios if x[0].startswith(("MCore", "NeMo", "DGXC"))
                   and not x[0].startswith("NeMo-Megatron")],
              "2021-24 (N21..BLOOM)": era, "  those but ZeRO-3": [x for x in era if "ZeRO-3" not in x[0]]}
    for name, prefix in (("Narayanan PTD-P", "N21 T"), ("Narayanan ZeRO-3", "N21 T2 ZeRO-3"),
                         ("Korthikanti", "K22"), ("Llama 3", "Llama3"), ("BLOOM", "BLOOM"), ("MT-NLG", "MT-NLG"),
                         ("OPT", "OPT"), ("BLOOM's layout search", "BigScience"),
                         ("torchtitan", "torchtitan"), ("torchao's float8 (torchtitan)", "torchao"),
                         ("Megatron-Core", "MCore"), ("NeMo FP8", "NeMo "),
                         ("NeMo long sequence (CP)", "NeMoCP"), ("NVIDIA DGXC", "DGXC"),
                         ("llm-foundry H100", "foundry h100"),
                         ("llm-foundry A100", "foundry a100 "), ("llm-foundry A100 40GB", "foundry a100-40gb"),
                         ("llm-foundry H100 FP8 (torchao's recipe for TE's)", "foundry fp8"),
                         ("DeepSpeed + HF on H200 (Bekman)", "Bekman"), ("OLMo-core (torch FSDP2)", "OLMo-core"),
                         ("torchtune (one A100, bf16)", "torchtune"), ("NeMo AutoModel (FSDP2, H100)", "AutoModel"),
                         ("NeMo Megatron launcher (2022, A100)", "NeMo-Megatron"),
                         ("FlashAttention-2's table (8 A100)", "FA2-table"), ("GLM-130B", "GLM-130B"),
                         ("BloombergGPT", "BloombergGPT"), ("TinyLlama", "TinyLlama"), ("LLaMA 65B", "LLaMA 65B"),
                         ("fms-fsdp (FSDP1, A100 and H100)", "fms-fsdp"),
                         ("MLPerf v3.1 GPT-3 175B (NeMo 23.09, H100)", "MLPerf 3.1"),
                         ("MLPerf v4.0 Llama 2 70B LoRA (NeMo 24.04)", "MLPerf 4.0"),
                         ("MLPerf v4.1 Llama 2 70B LoRA (NeMo 24.09)", "MLPerf 4.1 NVIDIA"),
                         ("Megatron Bridge MoE (Qwen3, H100 FP8, 25.09-26.06)", "Bridge MoE"),
                         ("NeMo 24.07 fine-tuning (SFT, LoRA; H100 FP8)", "NeMoFT"),
                         ("NeMo launcher 2024 (24.01-24.03, H100 FP8)", "NeMoL"),
                         ("MLPerf v4.1 GPT-3 175B (NeMo 24.09, H100 and B200)", "MLPerf 4.1 GPT-3"),
                         ("Megatron Bridge on GB200 (FP8, 25.09-26.02)", "Bridge 2"),
                         ("Megatron Bridge 26.06 fine-tuning (Llama 3 70B SFT, LoRA; FP8)", "BridgeFT"),
                         ("MLPerf v5.0 Llama 3.1 405B (NeMo 25.01-25.04; H100, H200, GB200)", "MLPerf 5.0 405B"),
                         ("MLPerf v5.0 Llama 2 70B LoRA (NeMo 25.04; NVIDIA's B200 and GB200)",
                          "MLPerf 5.0 NVIDIA 70B LoRA"),
                         ("MLPerf v5.1 Llama 3.1 8B (NeMo 25.01-25.09; H100, H200, B200, GB200)", "MLPerf 5.1 8B"),
                         ("MLPerf v5.1 Llama 2 70B LoRA (NeMo 25.09; H200, B200, GB200)", "MLPerf 5.1 70B LoRA"),
                         ("MLPerf v5.1 Llama 3.1 405B (NeMo 25.09; the University of Florida's B200s)",
                          "MLPerf 5.1 405B")):
        groups[name] = [x for x in ratios if x[0].startswith(prefix) and (prefix != "N21 T" or "ZeRO-3" not in x[0])]
        if name == "torchtitan":  # what the planner models, and the two features of its rows it does not price
            titan = groups[name]
            groups["  no CP, no AsyncTP"] = [x for x in titan if " CP " not in x[0] and "AsyncTP" not in x[0]]
            groups["  AsyncTP, no CP"] = [x for x in titan if " CP " not in x[0] and "AsyncTP" in x[0]]
            groups["  CP"] = [x for x in titan if " CP " in x[0]]
        if name.startswith("NeMo launcher 2024"):
            groups["  pre-training"] = [x for x in groups[name] if " SFT " not in x[0] and " LoRA " not in x[0]]
            groups["  fine-tuning"] = [x for x in groups[name] if " SFT " in x[0] or " LoRA " in x[0]]
        if name == "NeMo FP8":
            groups["  on B200"] = [x for x in groups[name] if " B200 " in x[0]]
        if name.startswith("MLPerf v5.0 Llama 3.1"):
            for gpu in ("H100", "H200", "GB200"):
                groups[f"  {gpu}"] = [x for x in groups[name] if f" {gpu} " in x[0]]
        if name.startswith("Megatron Bridge MoE"):
            for size in ("30B", "235B"):
                groups[f"  Qwen3 {size}"] = [x for x in groups[name] if f" {size} " in x[0]]
        if name == "NVIDIA DGXC":
            groups["  BF16"] = [x for x in groups[name] if " BF16 " in x[0]]
            groups["  FP8"] = [x for x in groups[name] if " FP8 " in x[0]]
            for release, nemo in (("25.04.01 (NeMo 25.02, 24.12)", ("DGXC 25", "DGXC 24.12")),
                                  ("24.11.1 (NeMo 24.09, 24.05)", ("DGXC 24.09", "DGXC 24.05"))):
                rows = [x for x in groups[name] if x[0].startswith(nemo)]
                groups[f"  {release}"] = rows
                for precision in ("BF16", "FP8"):
                    groups[f"    {release.split()[0]} {precision}"] = [x for x in rows if f" {precision} " in x[0]]
    print("timed runs whose given plan fits (ratio = predicted/published throughput):")
    for name, rs in groups.items():
        if rs:
            logs = [math.log(r) for _, r in rs]
            print(f"  {name:17s} n={len(rs):2d}  geometric mean {math.exp(sum(logs) / len(logs)):.3f}  "
                  f"mean |ratio - 1| {sum(abs(r - 1) for _, r in rs) / len(rs):5.1%}  "
                  f"median {statistics.median(abs(r - 1) for _, r in rs):5.1%}  "
                  f"range {min(r for _, r in rs):.2f}..{max(r for _, r in rs):.2f}")
    print("\nrank order of tokens/s per GPU within each sweep (Spearman, predicted against published):")
    for name, pairs in sweeps.items():
        if len(pairs) >= 3:
            rho = spearman([a for a, _ in pairs], [b for _, b in pairs])
            print(f"  {name:32s} n={len(pairs):2d}  {rho:5.2f}")
    print("\npeak memory per GPU where published (predicted / published):")
    for line in mem_lines:
        print(line)
    if memories:
        within = sum(abs(r - 1) <= 0.10 for _, r in memories)
        print(f"  within 10%: {within} of {len(memories)}; median |ratio - 1| "
              f"{statistics.median(abs(r - 1) for _, r in memories):.1%}")
    print()
    print("search, same job, any layout (fastest plan that fits):")
    for line in search_lines:
        print(line)
    print(f"\ntotal {time.perf_counter() - start_all:.1f} s")


if __name__ == "__main__":
    main()
