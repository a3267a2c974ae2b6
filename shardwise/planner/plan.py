"""A plan: a parallel layout (shardwise.layout.Layout, the engine's [parallel] table) and the batch split it runs.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from shardwise.config import qlora_error, tied_pipeline_error, tp_error
from shardwise.errors import ConfigError
from shardwise.hardware import PlannerError
from shardwise.layout import (
    Layout,
    MixedPrecision,
    Offload,
    Recompute,
    Schedule,
    capacity_error,
    engine_cannot_run,
    expert_parallel_error,
    pipeline_batch_error,
)
from shardwise.model_args import ModelArgs, projection_shapes

RECOMPUTE = typing.get_args(Recompute)
SCHEDULES = typing.get_args(Schedule)
OFFLOADS = typing.get_args(Offload)
MIXED_PRECISIONS = typing.get_args(MixedPrecision)


@dataclass(frozen=True)
class Plan(Layout):
    micro_batch: int = 1
    """Sequences per forward/backward on one rank."""
    grad_accum: int = 1
    """Micro-batches per optimizer step per data-parallel rank (the pipeline's M when pp > 1)."""

    @property
    def world(self) -> int:
        return self.world_size


def engine_runs(plan: Plan, training, args: ModelArgs) -> bool:
    """Whether shardwise's engine can run the plan (engine_error)."""
    return engine_error(plan, training, args) is None


def engine_error(plan: Plan, training, args: ModelArgs) -> ConfigError | None:
    """What shardwise's config would refuse of the plan, as its error (None: the engine runs it): of the layout
    (layout.engine_cannot_run), of tensor parallelism on the model `args` (config.tp_error), of a pipeline's
    micro-batches (a plan's grad_accum: config.layout_tables), of QLoRA on the adapted linears of the model
    (config.qlora_error), as shardwise's system (layout 'torch'), of
    a tied head in a pipeline (config.tied_pipeline_error), and the systems' own refusals: a parallelism or
    pipeline schedule the system lacks (system_parallel_error), activation offloading
    without full recompute (Training.activation_offload), the optimizer in backward under accumulation
    (Training.optimizer_in_backward), selective checkpointing where the system has none (Training.selective),
    Transformer Engine's all-to-all context parallelism over heads cp does not divide (Training.cp_exchange);
    and the planner's own: checkpointing every k-th block where it does not price it (partial_checkpoint_error)."""
    error = engine_cannot_run(plan, training.precision, training.compile, optimizer=training.optimizer,
                              engine_moe=training.moe_layer == "engine")
    if error is None:
        error = system_parallel_error(plan, training)
    if error is None:
        error = tp_error(args, plan, training.seq_len)
    if error is None and plan.pp > 1:
        error = pipeline_batch_error(plan, plan.grad_accum)
    if error is None and training.layout == "torch":  # shardwise's engine; Megatron keeps tied copies in step
        error = tied_pipeline_error(args, plan)
    if error is None and training.qlora:
        error = qlora_error(args, [t for t in training.lora_targets if t in projection_shapes(args)], plan)
    if error is None and args.n_experts:
        error = capacity_error(plan, args.capacity_factor)
    if error is None and training.optimizer_in_backward and plan.grad_accum > 1:
        # torchtune: "optimizer_in_bwd ... Requires gradient_accumulation_steps=1"
        error = ConfigError("parallel.grad_accum", f"{plan.grad_accum} micro-batches a step, and the system steps "
                            "each parameter in backward (optimizer_in_backward)",
                            "use grad_accum=1, or a system without optimizer_in_backward")
    if error is None and training.activation_offload and plan.pp > 1:
        error = ConfigError("parallel.pp", f"{plan.pp} pipeline stages, and the system offloads activations "
                            "(activation_offload: torchtune's recipes, which have no pipeline)",
                            "use pp=1, or a system without activation_offload")
    if error is None and training.offload_layers and plan.pp > 1:
        # megatron/core/transformer/transformer_config.py: "Currently there is no support for Pipeline parallelism
        # with CPU offloading"
        error = ConfigError("parallel.pp", f"{plan.pp} pipeline stages, and the system offloads activations "
                            "(offload_layers: Megatron-Core's cpu_offloading has no pipeline)",
                            "use pp=1, or offload_layers = 0")
    if error is None and training.offload_layers and plan.activation_checkpoint != "none":
        # the same file: "CPU offloading does not work when activation recomputation is enabled"
        error = ConfigError("parallel.activation_checkpoint", f"{plan.activation_checkpoint}, and the system "
                            "offloads activations (offload_layers: Megatron-Core's cpu_offloading refuses recompute)",
                            "use activation_checkpoint=none, or offload_layers = 0")
    if error is None and training.cp_exchange == "a2a" and plan.cp > 1:
        # transformer_engine/pytorch/attention.py, AttnFuncWithCPAndQKVOA2A: "The number of attention heads needs
        # to be divisible by CP size!" (each cp rank takes whole heads of its tp rank's, KV heads too)
        heads = args.n_heads // plan.tp
        # (KV heads split as memory.kv_split splits them, which this module cannot import: memory imports it)
        kv = heads if training.cp_repeats_kv else args.n_kv_heads // min(plan.tp, args.n_kv_heads)
        if heads % plan.cp or kv % plan.cp:
            error = ConfigError("parallel.cp", f"cp={plan.cp} over {heads} attention and {kv} KV heads a tp rank, "
                                "and the system exchanges them all-to-all (cp_exchange a2a: each cp rank takes whole "
                                "heads)", "use a cp that divides both, or cp_exchange ring")
    if error is None and training.offload_layers >= args.n_layers:
        # the same file: "CPU offloading can be done only for layers less than {num_layers}"
        error = ConfigError("--system offload_layers", f"{training.offload_layers} of the model's {args.n_layers} "
                            "blocks", f"offload fewer than {args.n_layers}")
    if error is None and plan.activation_checkpoint == "selective" and training.selective == "none":
        # torchtune: its ac_mode "selective" wraps every k-th layer whole (training/activations.py), no op policy
        error = ConfigError("parallel.activation_checkpoint", "selective, and the system has no op-level selective "
                            "checkpointing (selective = none)", "use activation_checkpoint=none or full, or a "
                            "system with selective checkpointing")
    if error is None and training.activation_offload and plan.activation_checkpoint != "full":
        # torchtune: "enable_activation_offloading should only be True when enable_activation_checkpointing is True"
        error = ConfigError("parallel.activation_checkpoint", f"{plan.activation_checkpoint}, and the system offloads "
                            "the activations checkpointing keeps (activation_offload)",
                            "use activation_checkpoint=full, or a system without activation_offload")
    if error is None:
        error = partial_checkpoint_error(plan, training, args)
    return error


def partial_checkpoint_error(plan: Plan, training, args: ModelArgs) -> ConfigError | None:
    """Checkpointing every k-th block (activation_checkpoint_every > 1) where the system has no such knob
    (Training.partial_checkpoint 'none') or the planner does not price it: a mixture of experts, zero-bubble's V
    (its weight passes replay checkpointed chunks), activation offloading (it stashes checkpoint inputs) and
    DeepSpeed's module-sync ZeRO-3 (its gathers follow each module's replay). The engine runs the latter; `shardwise
    simulate --config` measures their memory."""
    if plan.activation_checkpoint == "none" or plan.activation_checkpoint_every == 1:
        return None
    if training.partial_checkpoint == "none":
        return ConfigError("parallel.activation_checkpoint_every", f"{plan.activation_checkpoint_every}, and "
                           f"{training.system} checkpoints every block or none (partial_checkpoint = none)",
                           "use activation_checkpoint_every=1, or a system that checkpoints one block in k")
    why = ("a mixture of experts" if args.n_experts else
           "zero-bubble's weight passes" if plan.pp > 1 and plan.pp_schedule == "zero-bubble" else
           "activation offloading (activation_offload)" if training.activation_offload else
           "DeepSpeed's module-sync ZeRO-3" if plan.zero_stage >= 3 and training.zero3_fetch == "module-sync" else "")
    if not why:
        return None
    return ConfigError("parallel.activation_checkpoint_every", f"{plan.activation_checkpoint_every}: the planner "
                       f"prices checkpointing of some blocks without {why}", "use activation_checkpoint_every=1 "
                       "(and set it in the written config; `shardwise simulate --config` measures its memory)")


def system_parallel_error(plan: Plan, training) -> ConfigError | None:
    """A degree, ZeRO stage or pipeline schedule of the plan that the system (Training.system) does not have, as
    its error: system_layout_error, or a pipeline schedule outside Training.pp_schedules."""
    error = system_layout_error(plan, training)
    if error is None and plan.pp > 1 and plan.pp_schedule not in training.pp_schedules:
        schedules = training.pp_schedules
        error = ConfigError("parallel.pp_schedule", f"{plan.pp_schedule}, and {training.system} runs "
                            f"{', '.join(schedules)}", f"use pp_schedule={schedules[0]}"
                            + (" or another of those" if len(schedules) > 1 else ""))
    return error


def zero_fix(training, sharded: bool | None, ddp: bool = True) -> str:
    """The fix for a ZeRO stage the system lacks: a stage it has that fits how the plan splits its data-parallel
    ranks (`sharded`: dp_shard x cp > 1, FSDP's ZeRO-2/3; False: replicas, ZeRO-0/1; None: either), leaving out
    ZeRO-0 where DDP cannot run (`ddp` False: beside other parallelism under Training.ddp_alone)."""
    fits = [z for z in training.zero_stages if (sharded is None or (z >= 2) == sharded) and (ddp or z != 0)]
    if fits:
        return f"use zero_stage={fits[-1]}" + (" or another of those" if len(fits) > 1 else "")
    other = [z for z in training.zero_stages if (z >= 2) != bool(sharded) and (ddp or z != 0)]
    if not other:
        return "plan with another --system"
    return f"use dp_replicate with zero_stage={other[-1]}" if sharded else \
        f"use dp_shard (not dp_replicate) with zero_stage={other[-1]}"


def system_layout_error(plan: Plan, training) -> ConfigError | None:
    """What the system cannot run of the plan's degrees and ZeRO stage (the search's bases pass it before a
    schedule is chosen): tensor or context parallelism (Training.tensor_parallel, context_parallel), a pipeline
    (Training.pp_schedules empty), a ZeRO stage of 1-3 outside Training.zero_stages, or ZeRO-0 over more than one
    data-parallel rank where 0 is not among them, or beside tp, pp or cp where the system runs DDP alone
    (Training.ddp_alone), hybrid sharding (dp_replicate beside dp_shard x cp) outside Training.hsdp_stages, and
    beside a pipeline more than Training.pp_zero_max."""
    name, zero = training.system, plan.zero_stage
    if plan.tp > 1 and not training.tensor_parallel:
        return ConfigError("parallel.tp", f"{plan.tp}, and {name} has no tensor parallelism of the planner's kind "
                           "(attention heads and the MLP split over tp ranks)", "use tp=1, or another --system")
    if plan.cp > 1 and not training.context_parallel:
        return ConfigError("parallel.cp", f"{plan.cp}, and {name} has no context parallelism of the planner's kind "
                           "(ring attention over the cp ranks' sequence shards)", "use cp=1, or another --system")
    if plan.pp > 1 and not training.pp_schedules:
        return ConfigError("parallel.pp", f"{plan.pp}, and {name} has no pipeline parallelism",
                           "use pp=1, or another --system")
    if plan.ep > 1 and not training.expert_parallel:
        return ConfigError("parallel.ep", f"{plan.ep}, and {name} has no expert parallelism",
                           "use ep=1, or another --system")
    if plan.offload == "full" and zero not in training.offload_stages:
        stages = training.offload_stages
        return ConfigError("parallel.offload", f"full at ZeRO-{zero}, and {name} offloads weights, gradients and "
                           "optimizer state " + (f"at ZeRO-{', '.join(map(str, stages))} only" if stages else "never"),
                           f"use zero_stage={stages[-1]}" if stages else "use offload=none, or another --system")
    ranks = plan.dp * plan.cp
    sharded = plan.dp_shard * plan.cp > 1
    ddp = not (training.ddp_alone and plan.tp * plan.pp * plan.cp > 1)  # where DDP may run
    stages = ", ".join(map(str, training.zero_stages))
    if zero not in training.zero_stages and (zero > 0 or ranks > 1):
        return ConfigError("parallel.zero_stage", f"ZeRO-{zero} over {ranks} data-parallel rank(s), and {name} runs "
                           f"ZeRO-{stages}", zero_fix(training, sharded, ddp))
    if zero == 0 and ranks > 1 and not ddp:
        return ConfigError("parallel.zero_stage", f"ZeRO-0 (DDP) beside tp={plan.tp}, pp={plan.pp}, cp={plan.cp}, "
                           f"and {name} runs DDP as the only parallelism", zero_fix(training, sharded, ddp))
    if zero >= 2 and plan.dp_replicate > 1 and zero not in training.hsdp_stages:  # (a mesh of one under offload too)
        hsdp = ", ".join(map(str, training.hsdp_stages))
        return ConfigError("parallel.dp_replicate", f"{plan.dp_replicate} replicas of ZeRO-{zero} shards (hybrid "
                           f"sharding), and {name} " + (f"runs hybrid sharding with ZeRO-{hsdp} only" if hsdp
                                                        else "has no hybrid sharding"),
                           "use dp_replicate=1 (shard over every data-parallel rank)")
    if plan.pp > 1 and zero > training.pp_zero_max:
        return ConfigError("parallel.zero_stage", f"ZeRO-{zero} beside a pipeline, and {name} runs at most "
                           f"ZeRO-{training.pp_zero_max} with one",
                           f"use zero_stage <= {training.pp_zero_max}, or pp=1")
    return None


def validate_plan(plan: Plan, world: int, global_batch: int, n_layers: int, n_heads: int, n_experts: int = 0,
                  moe_layer: str = "engine", n_shared_experts: int = 0, ep_overlap: bool = False) -> None:
    """Raise PlannerError (naming the --plan key) for a plan that cannot run; `n_experts`: a mixture of experts'
    routed experts, `n_shared_experts` its shared ones, `moe_layer` and `ep_overlap` the system's
    (Training.moe_layer, Training.ep_overlap)."""
    if plan.world != world:
        raise PlannerError("--plan", f"dp*tp*pp*cp = {plan.world} but --gpus is {world}",
                           "choose degrees whose product is the number of GPUs")
    if n_heads % plan.tp:
        raise PlannerError("--plan tp", f"tp={plan.tp} does not divide {n_heads} heads", "pick a divisor")
    if plan.pp * plan.stages_per_rank > n_layers:
        raise PlannerError("--plan pp", f"{plan.pp * plan.stages_per_rank} pipeline stages (pp x stages per rank, "
                           f"two for zero-bubble) > {n_layers} layers", "use fewer stages")
    if plan.micro_batch * plan.grad_accum * plan.dp != global_batch:
        raise PlannerError("--plan micro_batch", f"micro_batch*grad_accum*dp = "
                           f"{plan.micro_batch * plan.grad_accum * plan.dp} != global batch {global_batch}",
                           "make micro_batch x grad_accum x dp equal the global batch in sequences")
    if plan.zero_stage not in (0, 1, 2, 3):
        raise PlannerError("--plan zero_stage", f"{plan.zero_stage}", "use 0, 1, 2 or 3")
    if plan.zero_stage and plan.shard_group == 1 and not (plan.offload == "full" and plan.dp == 1):
        raise PlannerError("--plan zero_stage", f"ZeRO-{plan.zero_stage} has only one rank to shard over",
                           "set dp_replicate (ZeRO-1) or dp_shard (ZeRO-2/3) > 1, or zero_stage=0")
    if plan.dp_shard > 1 and plan.zero_stage < 2:
        raise PlannerError("--plan dp_shard", f"sharding over {plan.dp_shard} ranks is FSDP: zero_stage 2 or 3",
                           "set zero_stage=2 or 3, or use dp_replicate for ZeRO-0/1")
    if plan.pp > 1 and plan.pp_schedule not in SCHEDULES:
        raise PlannerError("--plan pp_schedule", f"{plan.pp_schedule!r}", f"use one of {', '.join(SCHEDULES)}")
    if plan.virtual_stages > 1 and plan.pp_schedule != "interleaved-1f1b":
        raise PlannerError("--plan virtual_stages", "only interleaved-1f1b has virtual stages",
                           "set pp_schedule=interleaved-1f1b or virtual_stages=1")
    if plan.pp_schedule == "interleaved-1f1b" and plan.grad_accum % plan.pp:
        raise PlannerError("--plan grad_accum", f"interleaved-1f1b needs micro-batches ({plan.grad_accum}) "
                           f"to be a multiple of pp={plan.pp}", "change the micro-batch or the global batch")
    if plan.sequence_parallel and plan.tp == 1:
        raise PlannerError("--plan sequence_parallel", "sequence parallelism shards across tp", "set tp > 1")
    if plan.activation_checkpoint not in RECOMPUTE:
        raise PlannerError("--plan activation_checkpoint", f"{plan.activation_checkpoint!r}",
                           f"use one of {', '.join(RECOMPUTE)}")
    if plan.offload not in OFFLOADS:
        raise PlannerError("--plan offload", f"{plan.offload!r}", f"use one of {', '.join(OFFLOADS)}")
    if plan.mixed_precision not in MIXED_PRECISIONS:
        raise PlannerError("--plan mixed_precision", f"{plan.mixed_precision!r}",
                           f"use one of {', '.join(MIXED_PRECISIONS)}")
    # (Megatron-Core's experts beside tp first: its refusals name the field to change, whatever ep)
    for error in (folded_experts_error(plan, n_experts, n_shared_experts, moe_layer),
                  expert_parallel_error(plan, n_experts, moe_layer=moe_layer), ep_overlap_error(plan, ep_overlap)):
        if error is not None:
            raise PlannerError(f"--plan {error.field.removeprefix('parallel.')}", error.problem, error.fix)


def folded_experts_error(plan: Plan, n_experts: int, n_shared_experts: int, moe_layer: str) -> ConfigError | None:
    """What the planner does not price of a mixture of experts beside tp under Megatron-Core (Training.moe_layer
    'megatron-core'), as the error naming the field: it prices expert tensor parallelism 1 (the recipes' setting;
    Megatron's own default splits the experts by tp), each tp rank routing its sequence-parallel shard of the
    tokens, so tp needs sequence parallelism, and no shared experts (Megatron-Core splits them by tp, the planner
    keeps them whole); nor ep 1 beside tp (Megatron runs it, its experts' group then tp x cp x dp, which the
    planner does not separate from the data-parallel one at ep 1); nor beside tp at ZeRO-2/3 (Megatron's FSDP)."""
    if moe_layer != "megatron-core" or not n_experts or plan.tp == 1:
        return None
    if n_shared_experts:
        return ConfigError("parallel.tp", f"{plan.tp} with {n_shared_experts} shared expert(s): Megatron-Core splits "
                           "them by tp, which the planner does not price", "use tp=1 for this model")
    if plan.zero_stage >= 2:
        return ConfigError("parallel.zero_stage", f"{plan.zero_stage} with tp={plan.tp} and a mixture of experts: "
                           "Megatron-Core's FSDP beside tp is not priced for its experts",
                           "use zero_stage 0 or 1 (the distributed optimizer), or tp=1")
    if plan.ep == 1:
        return ConfigError("parallel.ep", f"1 with tp={plan.tp} and a mixture of experts: the planner prices "
                           "Megatron-Core's experts beside tp folded over the tp ranks (expert tensor parallelism "
                           "1) with ep > 1", f"use an ep > 1 that tp={plan.tp} x cp x dp divides, or tp=1")
    if not plan.sequence_parallel:
        return ConfigError("parallel.sequence_parallel", f"false with tp={plan.tp} and a mixture of experts: the "
                           "planner prices Megatron-Core's experts beside tp with each tp rank routing its "
                           "sequence-parallel shard", "set sequence_parallel=true")
    return None


def ep_overlap_error(plan: Plan, ep_overlap: bool) -> ConfigError | None:
    """What Megatron-Core refuses of its all-to-all overlap (Training.ep_overlap, transformer_config.py's checks):
    a pipeline without virtual stages (a virtual pipeline of 1 is none: arguments.py), and full recompute. It also
    asserts ep > 1; a system's ep_overlap describes the overlap where there is an all-to-all, so a plan without ep
    is priced as the recipe would run without the flag, not refused."""
    if not ep_overlap or plan.ep == 1:
        return None
    if plan.pp > 1 and (plan.pp_schedule != "interleaved-1f1b" or plan.virtual_stages < 2):
        return ConfigError("parallel.pp_schedule", f"{plan.pp_schedule} with {plan.virtual_stages} stage(s) per rank "
                           f"and pp={plan.pp}, and Megatron-Core overlaps the all-to-alls (ep_overlap) under the "
                           "interleaved schedule only", "use pp_schedule=interleaved-1f1b with virtual_stages >= 2, "
                           "or a system without ep_overlap")
    if plan.activation_checkpoint == "full":
        return ConfigError("parallel.activation_checkpoint", "full, and Megatron-Core's all-to-all overlap "
                           "(ep_overlap) refuses full recompute", "use none or selective, or a system without "
                           "ep_overlap")
    return None


