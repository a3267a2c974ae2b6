"""`shardwise plan`: search (or evaluate) parallel plans for a model on a cluster and say why.

The main CLI wires these two functions in: `add_plan_arguments(parser)` and `run_plan(args) -> int`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import tomllib
import typing
from pathlib import Path

from shardwise.config import ConfigError, fit_world, load_config, planner_split, qlora_error
from shardwise.hardware import GB, Cluster, GiB, PlannerError, resolve_accelerator
from shardwise.layout import LAYOUT_KEYS, Layout, complete_layout, layout_text, parse_layout
from shardwise.model_args import PROJECTIONS, ModelArgs, count_text, num_params, projection_shapes
from shardwise.planner.experts import dispatch_ranks, imbalance, max_imbalance
from shardwise.planner.explain import explain, render
from shardwise.planner.memory import reserved_bytes
from shardwise.planner.plan import Plan, engine_error, system_parallel_error
from shardwise.planner.search import Evaluation, evaluate, pipeline_keys, search
from shardwise.planner.system import SYSTEMS, System, resolve_system
from shardwise.planner.workload import LAYOUTS, PER_OP_OPTIMIZERS, PP_SCHEDULES, Optimizer, Training, resolve_model

DEFAULT_BATCH_TOKENS = 4 * 2**20  # Llama 2/3 pretraining batches are 4M tokens (Touvron et al. 2023)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", required=True, help="preset name, Hugging Face config.json, or shardwise TOML config")
    a("--gpus", type=int, required=True, help="world size")
    a("--gpu", default="h100", help="accelerator from the catalogue, or a `shardwise bench` profile JSON")
    a("--gpus-per-node", type=int, default=8, help="devices sharing the fast intra-node link")
    a("--seq-len", type=int, default=None, help="tokens per sequence (default: min(4096, model max))")
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--global-batch-tokens", type=int, default=None, help="tokens per optimizer step")
    batch.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step")
    a("--precision", default=None, choices=["fp32", "bf16", "fp16", "fp8"],
      help="matmul precision (default bf16, or a --model job's train.precision; fp8: float8 training of the "
           "blocks' linears as the system runs it, torchao's (torchtitan, shardwise) or Transformer Engine's "
           "(megatron-core), attention and the output head in bf16, MFU over the bf16 peak; shardwise's engine "
           "trains in fp32, bf16 or fp16)")
    a("--optimizer", default=None, choices=list(typing.get_args(Optimizer)),
      help="default adamw, or a --model job's optim.name")
    a("--system", default="shardwise",
      help=f"the engine the plan is for: {', '.join(SYSTEMS)}, or a TOML file describing one (docs/planner.md, "
           "'Systems'); its choices are the defaults of --layout, --attention, --dropout and --compile")
    a("--layout", default=None, choices=list(LAYOUTS),
      help="how mixed precision stores model state (see docs/planner.md; default: the system's)")
    a("--attention", default=None, choices=["fused", "unfused"],
      help="fused: one kernel, no s x s tensors (FlashAttention, SDPA); unfused: Megatron-LM before "
           "FlashAttention (batched GEMMs, softmax over the stored s x s scores), to evaluate runs of 2021-22 "
           "(default: the system's)")
    a("--dropout", action=argparse.BooleanOptionalAction, default=None,
      help="Megatron's hidden and attention dropout (its masks are kept; default: the system's)")
    a("--compile", action=argparse.BooleanOptionalAction, default=None,
      help="each block compiled with torch.compile: its elementwise operators fused (shardwise's train.compile, "
           "which --write-config writes; zero-bubble pipelines, which the engine does not compile, are left out; "
           "default: the system's)")
    a("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank instead of all weights")
    a("--qlora", action="store_true", help="4-bit NF4 base weights (with --lora-rank)")
    a("--lora-targets", default=None, metavar="NAMES",
      help=f"the projections LoRA adapts, comma-separated (lora.targets; default all: {','.join(PROJECTIONS)})")
    a("--lora-dropout", type=float, default=None, metavar="P",
      help="dropout on the adapted linears' inputs (lora.dropout; default 0): its masks and dropped copies are kept")
    a("--expert-imbalance", type=float, default=0.0,
      help="mixture of experts: routed tokens on the busiest expert-parallel rank over the mean (default: derived "
           "for a randomly initialised router, see docs/planner.md)")
    a("--dispatch-ranks", type=float, default=0.0,
      help="mixture of experts under a system whose moe_dispatch is deepep: the expert-parallel ranks a token is "
           "sent to, on average (default: derived for uniform routing, see docs/planner.md)")
    a("--gpu-memory-gib", type=float, default=None, help="override the device memory")
    a("--host-memory-gib", type=float, default=None,
      help="host memory per node (--gpus-per-node GPUs) that offload may fill (default: the GPU's server, 2,048 GiB "
           "for 8 H100, H200 or A100 80GB, 223.5 GiB a GB200; unchecked for a GPU the catalogue has no server for)")
    a("--intra-node-gbs", type=float, default=None, help="override intra-node bandwidth, GB/s per direction")
    a("--inter-node-gbs", type=float, default=None, help="override inter-node bandwidth, GB/s per direction")
    a("--max-tp", type=int, default=None, help="largest tensor-parallel degree to consider")
    a("--plan", default=None, help='fix knobs, e.g. "dp=32,tp=8,pp=4,micro_batch=2,activation_checkpoint=full"')
    a("--top-k", type=int, default=5, help="plans to show")
    a("--json", action="store_true", help="print JSON (documented in docs/planner.md)")
    a("--write-config", default=None, metavar="PATH", help="write the best plan as a `shardwise train` config")
    a("--plot", default=None, metavar="PATH", help="draw the memory breakdown (matplotlib PNG)")


def build_inputs(ns: argparse.Namespace):
    """(model args, training, cluster) from parsed flags; every bad value raises PlannerError naming its flag."""
    for flag, value in (("--seq-len", ns.seq_len), ("--global-batch-tokens", ns.global_batch_tokens),
                        ("--global-batch", ns.global_batch), ("--top-k", ns.top_k), ("--max-tp", ns.max_tp)):
        if value is not None and value < 1:
            raise PlannerError(flag, f"{value} < 1", "pass a positive number, or leave it out for the default")
    model = resolve_model(ns.model)
    if ns.expert_imbalance and not model.n_experts:  # a dense model routes nothing: the flag would change nothing
        raise PlannerError("--expert-imbalance", f"{model.name} is a dense model, with no experts to route",
                           "leave --expert-imbalance out, or plan a mixture of experts (e.g. mixtral-8x7b)")
    # an expert's own cap (moe/max_load's): the busiest rank's with one expert per rank, n_experts / top_k
    most = max_imbalance(model, ep=model.n_experts) if model.n_experts else 0.0
    if model.n_experts and ns.expert_imbalance > most:
        raise PlannerError("--expert-imbalance", f"{ns.expert_imbalance:g} > n_experts / top_k = {most:g}, the load "
                           "of every token's copies on the same experts", f"pass a ratio between 1 and {most:g} "
                           "(moe/max_load as a training run logs it)")
    ns = _job_defaults(ns)
    seq = ns.seq_len or min(4096, model.max_seq_len)
    if seq > model.max_seq_len:
        raise PlannerError("--seq-len", f"{seq} exceeds the model's max_seq_len {model.max_seq_len}",
                           "shorten it or use a model config with a longer context")
    if ns.global_batch is not None:
        batch = ns.global_batch
    else:
        tokens = ns.global_batch_tokens or max(DEFAULT_BATCH_TOKENS, seq)
        if tokens % seq:
            raise PlannerError("--global-batch-tokens", f"{tokens} is not a whole number of {seq}-token sequences",
                               "use a multiple of --seq-len, or give --global-batch in sequences")
        batch = tokens // seq
    acc = resolve_accelerator(ns.gpu)
    system = system_of(ns)
    if ns.lora_targets is not None and not ns.lora_rank:
        raise PlannerError("--lora-targets", "it says which projections LoRA adapts, and no --lora-rank is given",
                           "also pass --lora-rank R")
    targets = PROJECTIONS if ns.lora_targets is None else tuple(t.strip() for t in ns.lora_targets.split(","))
    if ns.dispatch_ranks and (not model.n_experts or system.moe_dispatch != "deepep"):
        why = (f"the system {system.name} sends every routed copy" if model.n_experts
               else f"{model.name} is a dense model")
        raise PlannerError("--dispatch-ranks", f"it describes DeepEP's dispatch of a mixture of experts, and {why}",
                           'leave --dispatch-ranks out, or use a system file with moe_dispatch = "deepep"')
    training = Training(seq_len=seq, global_batch=batch, precision=ns.precision or "bf16",
                        optimizer=ns.optimizer or "adamw", lora_rank=ns.lora_rank, qlora=ns.qlora,
                        lora_targets=targets, lora_dropout=ns.lora_dropout or 0.0,
                        expert_imbalance=ns.expert_imbalance, dispatch_ranks=ns.dispatch_ranks,
                        **system.training_fields())
    if training.qlora:
        # NF4 needs each linear's weight in whole blocks whatever the layout (FSDP's chunks only add to that): a
        # shape that has none is refused here, as the config refuses it, not left to a search that finds no plan
        error = qlora_error(model, [t for t in training.lora_targets if t in projection_shapes(model)], Layout())
        if error is not None:
            raise PlannerError("--qlora", error.problem, "use a model whose projections hold whole NF4 blocks, or "
                               "drop --qlora (LoRA on a bf16 base)")
    for flag, value in (("--gpu-memory-gib", ns.gpu_memory_gib), ("--intra-node-gbs", ns.intra_node_gbs),
                        ("--inter-node-gbs", ns.inter_node_gbs), ("--host-memory-gib", ns.host_memory_gib)):
        if value is not None and not 0 < value < math.inf:  # nan too
            raise PlannerError(flag, f"{value} is not a positive number", "give a positive, finite value")
    if ns.gpu_memory_gib is not None:
        acc = dataclasses.replace(acc, memory_bytes=ns.gpu_memory_gib * GiB)
    if ns.host_memory_gib is not None:  # per node, as a server's RAM is sold; the planner checks it per device
        acc = dataclasses.replace(acc, host_memory_bytes=ns.host_memory_gib * GiB / min(ns.gpus_per_node, ns.gpus))
    if ns.intra_node_gbs is not None:
        acc = dataclasses.replace(acc, intra_node_bw=ns.intra_node_gbs * GB)
    if ns.inter_node_gbs is not None:
        acc = dataclasses.replace(acc, inter_node_bw=ns.inter_node_gbs * GB)
    for dtype in (training.precision, training.compute_dtype):  # fp8: the linears', and bf16 for the rest
        if dtype not in acc.peak_flops:
            why = ", which float8 training runs attention and the head in" if dtype != training.precision else ""
            raise PlannerError("--precision", f"{acc.name} has no {dtype} matmul support in the catalogue{why}",
                               f"use one of {', '.join(sorted(set(acc.peak_flops) - {'fp8'}))}")
    cluster = Cluster(acc, gpus=ns.gpus, gpus_per_node=min(ns.gpus_per_node, ns.gpus))
    return model, training, cluster


def _job_defaults(ns: argparse.Namespace) -> argparse.Namespace:
    """With a shardwise TOML config as --model, its job's sequence length, global batch, precision, optimizer,
    compile and adapters for the flags not given (a config --write-config wrote plans again as the job it holds),
    said on stderr."""
    path = Path(ns.model)
    if path.suffix != ".toml" or not path.is_file():
        return ns
    job, ns, taken = load_config(path, sizing=True), argparse.Namespace(**vars(ns)), []
    # only what the job sets: a [model] table alone is planned at the flags' defaults, as a preset is (it was
    # planned at the config's own, 256 tokens and 16 sequences a rank)
    raw = tomllib.loads(path.read_text())
    data, train = raw.get("data", {}), raw.get("train", {})
    if ns.seq_len is None and "seq_len" in data:
        ns.seq_len = job.data.seq_len
        taken.append(f"data.seq_len {job.data.seq_len} (--seq-len)")
    if ns.global_batch is None and ns.global_batch_tokens is None and job.train.global_batch:
        ns.global_batch = job.train.global_batch
        taken.append(f"train.global_batch {job.train.global_batch} (--global-batch)")
    elif ns.global_batch is None and ns.global_batch_tokens is None and {"micro_batch", "grad_accum"} & set(train):
        # no train.global_batch (what --write-config writes): micro_batch x grad_accum x dp, the batch the job
        # trains, with dp as `shardwise train --nproc` fits a job that sets no data-parallel degree (config.fit_world)
        fitted = dataclasses.replace(job)
        fit_world(fitted, ns.gpus)
        t, dp = fitted.train, fitted.parallel.dp
        ns.global_batch = t.micro_batch * t.grad_accum * dp
        taken.append(f"train.micro_batch {t.micro_batch} x grad_accum {t.grad_accum} x dp {dp} = {ns.global_batch} "
                     "sequences (--global-batch)")
    if ns.precision is None and "train" in raw:  # a job trains at its precision, the config's default if unset
        ns.precision = job.train.precision
        taken.append(f"train.precision {job.train.precision}{'' if 'precision' in train else ' (unset: its default)'}"
                     " (--precision)")
    if ns.optimizer is None and "name" in raw.get("optim", {}):
        ns.optimizer = job.optim.name
        taken.append(f"optim.name {job.optim.name} (--optimizer)")
    if getattr(ns, "compile", None) is None and "compile" in train:
        ns.compile = job.train.compile
        taken.append(f"train.compile {str(job.train.compile).lower()} (--{'' if job.train.compile else 'no-'}compile)")
    if not ns.lora_rank and job.lora.rank:
        ns.lora_rank, ns.qlora = job.lora.rank, ns.qlora or job.lora.qlora
        taken.append(f"lora.rank {job.lora.rank}{' with lora.qlora' if job.lora.qlora else ''} (--lora-rank"
                     f"{', --qlora' if job.lora.qlora else ''})")
    if ns.lora_rank and job.lora.rank:  # the job's adapters, at its rank or the one given
        if ns.lora_targets is None and tuple(job.lora.targets) != PROJECTIONS:
            ns.lora_targets = ",".join(job.lora.targets)
            taken.append(f"lora.targets {ns.lora_targets} (--lora-targets)")
        if ns.lora_dropout is None and job.lora.dropout:
            ns.lora_dropout = job.lora.dropout
            taken.append(f"lora.dropout {job.lora.dropout:g} (--lora-dropout)")
    print(f"shardwise plan: --model {path}: its [model]" + "".join(f", {t}" for t in taken)
          + "; a flag given overrides each, and the rest (the cluster, the layout) are the flags'",
          file=sys.stderr)
    if "parallel" in raw and ns.plan is None:
        _own_layout_hint(job, ns.gpus)
    return ns


def _own_layout_hint(job, gpus: int) -> None:
    """A job's [parallel] is searched over, not taken: say how to size the job's own layout (on --gpus ranks)."""
    fitted = dataclasses.replace(job)
    try:
        fit_world(fitted, gpus)
    except ConfigError:  # its batch does not split on --gpus: the search says what does
        return
    p, t = fitted.parallel, fitted.train
    if p.world_size != gpus:
        return
    keys = layout_text(p, *planner_split(p, t.micro_batch, t.grad_accum))
    print(f"shardwise plan: its [parallel] is searched over, not taken; its own layout: --plan \"{keys}\"",
          file=sys.stderr)


def system_of(ns: argparse.Namespace) -> System:
    """--system, with what --layout, --attention, --dropout and --compile change in it (the system's name then
    says so); an --optimizer that is not Composer's under a system that prices Composer's step pass by pass
    (optimizer_passes per-op: llm-foundry) is its own library's step, priced fused, and the name says so too."""
    system = resolve_system(ns.system)
    optimizer = getattr(ns, "optimizer", None) or "adamw"
    passes = "fused" if system.optimizer_passes == "per-op" and optimizer not in PER_OP_OPTIMIZERS else None
    # a bf16 model (state_dtype bf16: torchtune's) at --precision fp32 is that system's model in fp32
    precision = getattr(ns, "precision", None) or "bf16"
    if precision == "fp16" and system.state_dtype == "bf16" and ns.layout in (None, "fsdp-mp"):
        raise PlannerError("--precision", f"fp16 with --system {system.name}, whose model trains in bf16 "
                           "(state_dtype bf16: torchtune's dtype is bf16 or fp32)", "pass --precision bf16 or fp32")
    unmixed = precision == "fp32" and system.state_dtype != "fp32"
    given = {k: v for k, v in (("layout", ns.layout), ("attention", ns.attention), ("dropout", ns.dropout),
                               ("compile", getattr(ns, "compile", None)), ("optimizer_passes", passes),
                               ("state_dtype", "fp32" if unmixed else None),
                               ("reduce_dtype", "fp32" if unmixed and system.reduce_dtype != precision else None))
             if v is not None and v != getattr(system, k)}
    if not given:
        return system
    resets = _left_with_the_layout(system, given.get("layout"))
    # (a layout leaving fsdp-mp takes a bf16 model's state back to fp32, twice the bytes: named with the layout)
    named = {**given, **{k: v for k, v in resets.items() if k == "state_dtype" and k not in given}}
    changes = ", ".join(f"{k} {v}" if not isinstance(v, bool) else k if v else f"no {k}" for k, v in named.items())
    fields = {**resets, **given}  # (both may reset optimizer_passes)
    return dataclasses.replace(system, name=f"{system.name} ({changes})", summary=f"{system.summary}; changed: "
                               f"{changes}", **fields)


def _left_with_the_layout(system: System, layout: str | None) -> dict:
    """The system's fields that describe one state layout, back at their defaults when --layout leaves it (a
    Megatron-Core system as the layout torch keeps no main-gradient buffer or distributed optimizer)."""
    if layout is None:
        return {}
    defaults = {f.name: f.default for f in dataclasses.fields(System)}
    owned = {("megatron",): ("grads_in_fp32", "optimizer_dtype", "pp_overlap_p2p", "overlap_param_gather", "float8",
                             "moe_layer", "ep_overlap", "zero1_all_reduce"),
             ("zero",): ("reduce_bucket_size", "overlap_comm"),
             ("megatron", "zero"): ("overlap_grad_reduce", "ce_shift_in_place"),
             ("megatron", "torch", "fsdp-mp"): ("ddp_bucket_view",),
             ("fsdp-mp",): ("reduce_dtype", "flat_params", "optimizer_passes", "state_dtype")}
    resets = {k: defaults[k] for owners, keys in owned.items() if layout not in owners for k in keys
              if getattr(system, k) != defaults[k]}
    if layout == "megatron" and system.layout != "megatron" and not system.ddp_bucket_view:
        # a torch layout's DDP is not Megatron-Core's, whose contiguous buffer is its bucket (nanotron, on the layout
        # megatron, wraps in torch's DDP at ZeRO-0 whatever layout it is priced as)
        resets["ddp_bucket_view"] = defaults["ddp_bucket_view"]
    return resets


def complete_plan(fixed: dict, training: Training, world: int, args: ModelArgs) -> Plan:
    """A whole plan from --plan's keys, filling what it omits with shardwise.layout's defaults and the least-memory
    batch split and recompute; used to report a given plan (fits or not) when no completion of it fits."""
    megatron_moe = training.moe_layer == "megatron-core" and args.n_experts
    least = {"activation_checkpoint": "full",
             **({"zero_stage": 3} if fixed.get("ep", 1) > 1 and not megatron_moe else {})}
    if megatron_moe and fixed.get("tp", 1) > 1 and "ep" not in fixed:
        # Megatron-Core's experts beside tp fold over it (plan.folded_experts_error): the smallest ep that can
        ranks = world // fixed.get("pp", 1)  # tp x cp x dp
        least["ep"] = next((e for e in range(2, ranks + 1) if ranks % e == 0 and args.n_experts % e == 0), 1)
    if megatron_moe and fixed.get("tp", 1) > 1:
        least["sequence_parallel"] = True  # (each tp rank routes its shard)
    if megatron_moe and fixed.get("ep", least.get("ep", 1)) > 1 and "dp_shard" not in fixed:
        least.setdefault("zero_stage", 1)  # its experts beside the distributed optimizer (ZeRO-1)
    if training.ep_overlap and fixed.get("ep", least.get("ep", 1)) > 1:
        # what its all-to-all overlap runs with (plan.ep_overlap_error): no full recompute, virtual stages
        least["activation_checkpoint"] = "selective"
        if fixed.get("pp", 1) > 1 and "pp_schedule" not in fixed:
            least.update(pp_schedule="interleaved-1f1b", virtual_stages=2)
    if "zero_stage" not in fixed and "dp_replicate" not in fixed and max(training.zero_stages) >= 2 and (
            0 not in training.zero_stages or training.ddp_alone):
        least["zero_stage"] = max(training.zero_stages)  # the system's sharding (torchtune has no DDP)
    asked = pipeline_keys(fixed)
    if asked and "pp" not in fixed:  # completed, the plan would have pp=1: not the pipeline asked for
        raise PlannerError("--plan pp", f"{asked[0]}={fixed[asked[0]]} asks for a pipeline and no plan with one "
                           "fits (or runs), so there is none to report", "give pp (the stages) to see that plan")
    layout = complete_layout({**least, **fixed}, world, source="--plan")
    accum = fixed.get("grad_accum", fixed.get("pp_microbatches"))
    # a fixed accumulation (or a pipeline's micro-batches) with no micro-batch: the micro-batch that makes the batch
    default_mb = training.global_batch // (layout.dp * accum) \
        if accum and training.global_batch % (layout.dp * accum) == 0 else 1
    mb = fixed.get("micro_batch", default_mb)
    if training.global_batch % (layout.dp * mb):
        raise PlannerError("--plan micro_batch", f"global batch {training.global_batch} is not a multiple of "
                           f"dp*micro_batch = {layout.dp * mb}", "change micro_batch, dp or the global batch")
    plan = Plan(**dataclasses.asdict(layout), micro_batch=mb,  # a pipeline's micro-batches are its accumulation
                grad_accum=fixed.get("grad_accum", fixed.get("pp_microbatches",
                                                             training.global_batch // (layout.dp * mb))))
    error = engine_error(plan, training, args)
    system_error = system_parallel_error(plan, training)
    if system_error is not None and error is not None and error.problem == system_error.problem:
        # what the system lacks (where the engine's own checks found nothing first), in the keys' completion
        key = system_error.field.removeprefix("parallel.")
        completed = ",".join(f"{k}={getattr(plan, k)}" for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp",
                                                                  "zero_stage") if k not in fixed)
        raise PlannerError(f"--plan {key}", f"{system_error.problem} (in the plan completed from the keys given: "
                           f"{completed})", system_error.fix)
    if error is not None and error.field == "parallel.pp_microbatches" and "pp_microbatches" in fixed:
        raise PlannerError("--plan pp_microbatches", f"{plan.grad_accum} < pp={plan.pp} stages, which "
                           f"{plan.pp_schedule} needs", "use pp_microbatches >= pp, or pp_schedule=gpipe")
    if error is not None and error.field == "parallel.pp_microbatches":
        raise PlannerError("--plan pp", f"{plan.grad_accum} micro-batches per step (global batch / (dp x "
                           f"micro_batch)) < pp={plan.pp} stages, which {plan.pp_schedule} needs",
                           f"use a global batch of at least {plan.pp * plan.dp * mb} sequences, fewer stages, or "
                           "pp_schedule=gpipe")
    if error is not None and error.field == "train.compile":  # the planner's flag, not the config's field
        raise PlannerError("--compile", error.problem, "leave out --compile (or pass --no-compile), or choose "
                           "another pp_schedule in --plan")
    if error is not None and error.field == "train.precision":
        raise PlannerError("--precision", error.problem, "pass --precision bf16, or leave pp out of --plan")
    if error is not None:
        raise PlannerError(f"--plan ({error.field})", error.problem, error.fix)
    return plan


def run_plan(ns: argparse.Namespace) -> int:
    try:
        return _run(ns)
    except (PlannerError, ConfigError) as e:  # both name the flag or field and the fix
        print(f"shardwise: error: {e}", file=sys.stderr)
        return 2


def check_output(path: str | None, flag: str, suffixes: tuple[str, ...] = ()) -> None:
    """Refuse an output path the command could not write, before any work: a folder, a folder that does not
    exist, or (when `suffixes` are given) a file type the writer cannot make."""
    if path is None:
        return
    target = Path(path)
    if not path:
        raise PlannerError(flag, "an empty path", "give the path of a file to write")
    if target.is_dir():
        raise PlannerError(flag, f"{path!r} is a folder, not a file", "give the path of a file to write")
    if not target.parent.is_dir():
        raise PlannerError(flag, f"no folder {target.parent}", "create it first, or write elsewhere")
    if suffixes and target.suffix.lower() not in suffixes:
        raise PlannerError(flag, f"cannot write a {target.suffix or 'suffix-less'} file",
                           f"end the path with {' or '.join(suffixes)}")


def _run(ns: argparse.Namespace) -> int:
    check_output(ns.write_config, "--write-config")
    check_output(ns.plot, "--plot", (".png", ".svg", ".pdf"))
    model, training, cluster = build_inputs(ns)
    fixed = parse_layout(ns.plan, "--plan") if ns.plan else {}
    if ns.max_tp is not None and fixed.get("tp", 1) > ns.max_tp:  # one of the two would be dropped without a word
        raise PlannerError("--max-tp", f"{ns.max_tp} is below the tp={fixed['tp']} that --plan fixes",
                           "leave out one of the two, or make them agree")
    start = time.perf_counter()
    result = search(model, training, cluster, fixed=fixed, top_k=ns.top_k, max_tp=ns.max_tp)
    seconds = time.perf_counter() - start
    plans: list[Evaluation] = result.ranked
    if not plans and fixed:  # report the given plan anyway: published layouts that ran out of memory matter
        plans = [evaluate(model, training, complete_plan(fixed, training, cluster.gpus, model), cluster)]
    expl = explain(model, training, cluster, result)
    if ns.write_config and plans and not plans[0].fits_host:
        node = cluster.gpus_per_node  # (at most --gpus)
        raise PlannerError("--write-config", f"the plan's offload needs {plans[0].host * node / GiB:,.0f} GiB of host "
                           f"memory per node of {plans[0].host_budget * node / GiB:,.0f}: it would not fit",
                           "use more GPUs, or give --host-memory-gib if the nodes have more")
    if ns.write_config and plans and not plans[0].fits:
        raise PlannerError("--write-config", f"the plan needs {plans[0].memory['total'] / GiB:.1f} GiB per GPU of "
                           f"{cluster.accelerator.memory_bytes / GiB:.0f}: it would not fit",
                           "relax --plan (e.g. activation_checkpoint, more tp or pp), or use more GPUs")
    if ns.write_config and plans:
        from shardwise.planner.config_out import hf_weights_folder, write_config

        job = Path(ns.model) if Path(ns.model).suffix == ".toml" else None  # (build_inputs read it as a job)
        note = write_config(ns.write_config, model, training, plans[0].plan, hf_weights_folder(ns.model), job)
        world, per_node = plans[0].plan.world, cluster.gpus_per_node
        run = f"shardwise train --config {ns.write_config}" + (f" --nproc {world}" if world > 1 else "")
        if world > per_node:  # several machines: a scheduler starts them (docs/cluster.md)
            run = (f"shardwise launch slurm --config {ns.write_config} --nodes {world // per_node} "
                   f"--gpus-per-node {per_node} --submit (or launch k8s)" if world % per_node == 0 else
                   f"shardwise launch slurm or k8s --config {ns.write_config} ({world} ranks over several machines: "
                   "docs/cluster.md)")
        print(f"shardwise plan: wrote plan 1's config ({world} rank{'s' if world > 1 else ''}) to "
              f"{ns.write_config}; run it with: {run}" + (f" ({note})" if note else ""), file=sys.stderr)
    if ns.plot:
        from shardwise.planner.plot import plot

        plot(plans, ns.plot)
    if ns.json:
        print(json.dumps(_json(model, training, cluster, plans, expl, result.evaluated, seconds), indent=2))
    else:
        # nothing sized for memory at all (no least memory noted, no offload left out for the host's): every layout
        # that divides the GPUs and the batch is one the engine does not run
        sized = bool(result.min_memory_by_knob) or result.least_host < math.inf
        print(_table(model, training, cluster, plans, seconds, result.evaluated, result.layouts, sized))
        print()
        print(render(expl, cluster))
    return 0 if plans and plans[0].fits else 1


def _json(model, training: Training, cluster: Cluster, plans: list[Evaluation], expl: dict, evaluated: int,
          seconds: float) -> dict:
    return {
        "model": dataclasses.asdict(model),
        "parameters": {"total": num_params(model), "active": num_params(model, active=True)},
        "training": dataclasses.asdict(training),
        "cluster": {"gpu": cluster.accelerator.name, "gpus": cluster.gpus, "gpus_per_node": cluster.gpus_per_node,
                    "memory_gib": cluster.accelerator.memory_bytes / GiB},
        "mfu_peak": training.compute_dtype,
        "plans": [ev.to_json() for ev in plans],
        "explanation": expl,
        "search": {"evaluated": evaluated, "seconds": seconds},
    }


COLUMNS = ("#", "dp(rep x shard)", "tp", "pp", "cp", "zero", "mb", "accum", "recompute", "schedule", "sp",
           "offload", "bf16", "mem GiB", "step s", "tok/s", "MFU", "bubble", "exp.comm s")
"""bf16: how bf16 runs where FSDP shards (parallel.mixed_precision: autocast or FSDP2's 'fsdp' policy), a knob of
shardwise's engine: '-' for another system, whose own policy the system line states."""
MOE_COLUMNS = COLUMNS[:5] + ("ep",) + COLUMNS[5:]
"""A mixture of experts' table also shows the expert-parallel degree."""


def _row(i: int, ev: Evaluation, moe: bool = False, bf16: bool = True) -> list[str]:
    p, t = ev.plan, ev.time
    sched = "-" if p.pp == 1 else p.pp_schedule + (f"/v{p.virtual_stages}" if p.virtual_stages > 1 else "")
    mem = f"{ev.memory['total'] / GiB:.1f}" + ("" if ev.memory["total"] <= ev.budget else " OOM") + (
        "" if ev.fits_host else " host OOM")
    degrees = [str(p.tp), str(p.pp), str(p.cp)] + ([str(p.ep)] if moe else [])
    return [str(i), f"{p.dp} ({p.dp_replicate}x{p.dp_shard})", *degrees, str(p.zero_stage),
            str(p.micro_batch), str(p.grad_accum), recompute_text(p), sched, "y" if p.sequence_parallel else "n",
            p.offload, p.mixed_precision if bf16 else "-", mem, f"{t.step_time_s:.3f}", f"{t.tokens_per_s:,.0f}",
            f"{100 * t.mfu:.1f}%", f"{100 * t.bubble_fraction:.1f}%", f"{t.exposed_comm_s:.3f}"]


def recompute_text(plan) -> str:
    """The plan's recompute column: its policy, and '/k' where one block in k is checkpointed."""
    every = plan.activation_checkpoint_every
    return plan.activation_checkpoint + (f"/{every}" if every > 1 and plan.activation_checkpoint != "none" else "")


def _adapters(training: Training) -> str:
    """The recipe's adapters for the table's first line ('' for full training)."""
    if not training.lora_rank:
        return ""
    where = "" if training.lora_targets == PROJECTIONS else f" on {','.join(training.lora_targets)}"
    dropout = f", dropout {training.lora_dropout:g}" if training.lora_dropout else ""
    return f", {'QLoRA' if training.qlora else 'LoRA'} r{training.lora_rank}{where}{dropout}"


def _adapter_note(training: Training) -> str:
    """Adapters are priced as shardwise's engine runs them, whichever system the rest describes."""
    if not training.lora_rank or training.system.split(" (")[0] == "shardwise":
        return ""
    where = ("every projection" if training.lora_targets == PROJECTIONS
             else ", ".join(training.lora_targets))
    return (f"; the adapters as shardwise runs them, whatever {training.system.split(' (')[0]} has: LoRA rank "
            f"{training.lora_rank} on {where} of every block" + (", the base in torchao's NF4"
                                                                          if training.qlora else ""))


def parallelism_summary(training: Training) -> str:
    """The parallelisms the system lacks (Training.tensor_parallel, context_parallel, expert_parallel,
    pp_schedules, zero_stages, ddp_alone, hsdp_stages, offload_stages, pp_zero_max),
    as the system line ends: '' for one that has them all."""
    parts = [] if training.tensor_parallel else ["no tensor parallelism"]
    parts += [] if training.context_parallel else ["no context parallelism"]
    parts += [] if training.expert_parallel else ["no expert parallelism"]
    if not training.pp_schedules:
        parts.append("no pipeline parallelism")
    elif len(training.pp_schedules) == 1:
        parts.append(f"pipeline schedule {training.pp_schedules[0]} only")
    elif set(training.pp_schedules) != set(PP_SCHEDULES):
        parts.append(f"pipeline schedules {', '.join(training.pp_schedules)}")
    if set(training.zero_stages) != {0, 1, 2, 3}:
        parts.append(f"ZeRO-{', '.join(map(str, training.zero_stages))} over data-parallel ranks")
    if training.ddp_alone:
        parts.append("DDP only alone")
    if tuple(training.hsdp_stages) != (2, 3):
        parts.append(f"hybrid sharding at ZeRO-{', '.join(map(str, training.hsdp_stages))} only"
                     if training.hsdp_stages else "no hybrid sharding")
    if tuple(training.offload_stages) != (2, 3):
        parts.append(f"host offload at ZeRO-{', '.join(map(str, training.offload_stages))} only"
                     if training.offload_stages else "no host offload of the weights")
    if training.pp_schedules and training.pp_zero_max < 3:
        parts.append(f"at most ZeRO-{training.pp_zero_max} beside a pipeline")
    return "".join(f"; {part}" for part in parts)


def system_summary(training: Training) -> str:
    known = SYSTEMS.get(training.system)
    if known is not None and known.training_fields() == {k: getattr(training, k) for k in known.training_fields()}:
        return known.summary + parallelism_summary(training)
    size = training.reduce_bucket_size
    buckets = f", DeepSpeed gradient buckets of {size:,.0f} elements" if size else ""
    unhidden = (", below ZeRO-3 the reduction unhidden without overlap_comm"
                if training.overlap_grad_reduce and not training.grad_reduce_hidden else "")
    selective = (", no op-level selective checkpointing" if training.selective == "none" else
                 f", selective keeps {training.selective if training.fused_attention else 'attention-core'}")
    return (f"{'the model in bf16 (no fp32 copy), ' if training.state_dtype == 'bf16' else ''}"
            f"layout {training.layout}, head {'fused with the loss' if training.fuses_head else 'materialised'}, "
            f"{'loss parallel' if training.loss_parallel or training.fuses_head else 'logits gathered'} under TP, "
            f"{'fused' if training.fused_attention else 'unfused'} attention{', dropout' if training.dropout else ''}"
            f"{selective}"
            f"{', ZeRO-3 fetched module by module' if training.zero3_fetch == 'module-sync' else ''}"
            f"{', compiled blocks (elementwise operators fused)' if training.compile else ''}"
            f"{', the loss one kernel over the logits' if training.loss_kernel and not training.fuses_head else ''}"
            f"{f', float8 {training.float8}' if training.float8 != 'torchao' else ''}"
            f"{', checkpoints split over tp' if training.distribute_checkpoints else ''}"
            f"{', stages cut as DeepSpeed (embeddings as slots)' if training.pipeline_split == 'slots' else ''}"
            f"{', stages cut as nanotron (greedy, equal cost shares)' if training.pipeline_split == 'nanotron' else ''}"
            f"{', bf16 gradients kept beside fp32' if training.keeps_bf16_grads else ''}"
            f"{' (no DeepSpeed transients)' if training.keeps_bf16_grads and not training.bf16_grad_transients else ''}"
            f"{', ZeRO-1 all-reduces whole after the backward' if training.zero1_all_reduce else ''}"
            f"{', DDP buckets a copy of the gradients' if not training.ddp_bucket_view else ''}"
            f"{', the loss shifts its fp32 logits into a copy' if not training.ce_shift_in_place else ''}"
            f"{', main gradients in the weights dtype' if not training.grads_in_fp32 else ''}"
            f"{', pipeline sends overlapped (interleaved)' if training.pp_overlap_p2p else ''}"
            f"{', the updated weights gathered behind the next forward' if training.overlap_param_gather else ''}"
            f"{', gradients reduced after the backward' if not training.overlap_grad_reduce else ''}"
            f"{', AdamW state in bf16 (Apex)' if training.optimizer_dtype == 'bf16' else ''}"
            f"{f', gradients reduced in {training.reduce_dtype}' if training.reduce_dtype != 'fp32' else ''}"
            f"{', FSDP1 flat parameters' if training.flat_params else ''}"
            f"{', the optimizer a pass per operation' if training.optimizer_passes == 'per-op' else ''}"
            f"{', the optimizer stepped in backward' if training.optimizer_in_backward else ''}"
            f"{f', the loss over {training.loss_chunks} chunks' if training.loss_chunks > 1 else ''}"
            f"{', checkpointed activations offloaded to the host' if training.activation_offload else ''}"
            f"{f', {training.offload_layers} blocks of activations offloaded' if training.offload_layers else ''}"
            f"{', composite fp32 RMSNorm' if not training.fused_rmsnorm else ''}"
            f"{buckets}"
            f"{', overlap_comm' if training.overlap_comm else ''}"
            f"{unhidden}"
            f"{parallelism_summary(training)}")


def _table(model, training: Training, cluster: Cluster, plans: list[Evaluation], seconds: float,
           evaluated: int, layouts: int, sized: bool = True) -> str:
    moe = bool(model.n_experts)
    # a mixture of experts stores every expert and runs top_k of them per token (what its FLOPs and MFU count)
    size = (f" ({count_text(num_params(model))} parameters, {count_text(num_params(model, active=True))} active per "
            f"token: top {model.top_k} of {model.n_experts} experts)" if moe else "")
    head = (f"{model.name}{size} on {cluster.gpus} x {cluster.accelerator.name} "
            f"({cluster.accelerator.memory_bytes / GiB:.0f} GiB), seq {training.seq_len}, global batch "
            f"{training.global_batch} seqs ({training.global_batch * training.seq_len:,} tokens), "
            f"{training.precision} {training.optimizer}{_adapters(training)}; {evaluated} plans sized in "
            f"{seconds:.2f} s\n"
            f"system: {training.system} - {system_summary(training)}" + _adapter_note(training))
    if not plans:
        if not layouts:
            return head + (f"\nNo layout divides {cluster.gpus} GPUs and the global batch of {training.global_batch} "
                           "sequences (dp must divide the batch; tp the heads and the GPUs of a node; pp is at most "
                           "the layers): use a GPU count or --global-batch that share divisors, or relax --plan.")
        if not sized:  # "try more GPUs" would make it worse
            return head + (f"\nNo plan the engine runs divides {cluster.gpus} GPUs and the global batch of "
                           f"{training.global_batch} sequences (a pipeline needs at least as many micro-batches per "
                           "step as stages; tp must divide the heads, the KV heads and the GPUs of a node; cp at most "
                           "16): use fewer GPUs, a larger --global-batch, or relax --plan.")
        return head + "\nNo plan fits in memory (try more GPUs, --lora-rank, or a larger --gpu)."
    columns = MOE_COLUMNS if moe else COLUMNS
    # a knob of shardwise's engine (layout torch); another system's own policy is its summary's
    bf16 = training.precision == "bf16" and training.layout == "torch"
    rows = [list(columns)] + [_row(i + 1, ev, moe, bf16) for i, ev in enumerate(plans)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows]
    best = plans[0]
    items = ", ".join(f"{k} {v / GiB:.1f}" for k, v in best.memory.items() if k != "total" and v > 0)
    notes = []
    if training.precision == "fp8":
        notes.append("MFU: model FLOPs over the bf16 peak (the float8 linears run at up to twice it)")
        if training.float8 != "torchao":
            cached = ("float8 weights cached over a step's micro-batches" if best.plan.zero_stage < 3 else
                      "float8 weights cast for each micro-batch (ZeRO-3 gathers them afresh)")
            notes.append(f"fp8: Transformer Engine's float8 ({training.float8.removeprefix('te-')} scaling) as "
                         f"Megatron-Core runs it: one cast per module input, {cached}, the linears' inputs saved "
                         "in float8")
        elif training.system.split(" (")[0] == "shardwise":
            notes.append("fp8: torchao's float8 training as torchtitan runs it, priced on shardwise's recipe; "
                         "shardwise's engine trains in fp32, bf16 or fp16 (--write-config refuses fp8)")
    if moe:
        notes.append(routing_note(model, training, best.plan))
    keys = layout_text(Layout(**{k: getattr(best.plan, k) for k in LAYOUT_KEYS}), best.plan.micro_batch,
                       best.plan.grad_accum)
    if training.layout != "torch":  # mixed precision is the system's own recipe (its summary), not this knob's
        keys = ",".join(k for k in keys.split(",") if not k.startswith("mixed_precision="))
    limit = best.budget - best.memory["fixed_overhead"]
    held = reserved_bytes(model, training, best.plan, best.memory_stage)
    reserved = min(held, limit) / GiB
    if not best.fits and best.fits_host and not training.expandable_segments and training.fragmentation > 0:
        # over the device by no more than the allowance: whether it runs is the allocator's, not the tensors'
        bare = evaluate(model, dataclasses.replace(training, expandable_segments=True), best.plan, cluster)
        if bare.fits:
            notes.append(f"memory: #1 is over the device only by the {training.fragmentation:.0%} fragmentation "
                         f"allowance ({bare.memory['total'] / GiB:.1f} GiB without it, of {best.budget / GiB:.1f}): "
                         "it runs if torch's caching allocator loses less than that to fragmentation, as under "
                         "expandable segments (PYTORCH_ALLOC_CONF=expandable_segments:True; a system file with "
                         "expandable_segments = true sizes the fit so)")
    if training.expandable_segments:
        capped = " (at most the device: the allocator remaps its free pages when short)" if held > limit else ""
        notes.append(f"memory: the fit is sized without the {training.fragmentation:.0%} fragmentation allowance "
                     f"(the system's launcher runs torch's allocator with expandable segments); the reserved "
                     f"figure keeps it{capped}")
    return "\n".join([head, *lines, f"Memory of #1 (GiB, stage {best.memory_stage}): {items}",
                      f"torch's max_memory_reserved would read about {reserved:.1f} GiB (what its caching allocator "
                      "holds: no CUDA context or NCCL buffers; docs/planner.md, 'Reserved memory')",
                      f"#1 as keys (plan --plan, simulate --plan, verify --layout): {keys}", *notes])


def routing_note(model: ModelArgs, training: Training, plan: Plan) -> str:
    """What the plan assumes of a mixture of experts' routing: dropless or the capacity, and under expert
    parallelism the load of the busiest rank, stated or derived (planner.experts)."""
    kept = (f"at most capacity_factor {model.capacity_factor:g} x the mean per expert" if model.capacity_factor > 0
            else "dropless")
    if plan.ep == 1:
        return f"experts of #1: {kept}, every expert on every rank (ep 1: no routing imbalance between ranks)"
    load = imbalance(model, training, plan)
    capped = training.expert_imbalance > load
    source = (f"--expert-imbalance {training.expert_imbalance:g}, at most {load:g} over {plan.ep} ranks" if capped
              else "as stated (--expert-imbalance)" if training.expert_imbalance else
              "an untrained router over random tokens; a trained one's measured load goes in --expert-imbalance")
    note = f"experts of #1: {kept}; the busiest of the ep {plan.ep} ranks routes {load:.3f} x the mean ({source})"
    if training.moe_dispatch == "deepep":
        ranks = dispatch_ranks(model, training, plan.ep)
        stated = training.dispatch_ranks
        how = ("uniform routing; a measured figure goes in --dispatch-ranks" if not stated else
               "--dispatch-ranks" if stated == ranks else
               f"--dispatch-ranks {stated:g}, kept to what top {model.top_k} of {model.n_experts} experts on "
               f"{plan.ep} ranks can touch")
        note += f"; DeepEP sends a token to {ranks:.2f} of them ({how})"
    return note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise plan", description=__doc__)
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
