"""Search: every valid plan, pruned by memory, ranked by step time; and the reason behind the winner.

The objective is the usual one for hybrid parallelism: minimise T_step subject to M_device <= M_budget. The
space is walked degrees first (tp, cp, pp, dp split, ZeRO stage, offload), then micro-batch, schedule and
recompute. Three kinds of pruning keep it fast, none of which drops a plan that could win under this model:

* memory lower bounds: a degree combination and schedule that fit neither with one sequence per micro-batch nor
  with the whole local batch as one (full recompute; the second is the smaller when accumulation holds gradients
  unsharded) are skipped whole; micro-batches are tried in increasing size and, while a step has more than two
  micro-batches per stage, the walk stops at the first that cannot fit even with full recompute;
* dominance in the model: for fixed other knobs, recompute none < selective < full in time and the reverse in
  memory, so the first policy that fits is the only one kept; GPipe has 1F1B's time and more memory, so it
  cannot win a search (it stays available through --plan; zero-bubble, with a smaller bubble but more memory off
  the first rank, and 1F1B are both searched); sequence parallelism costs the same communication as plain tp and
  saves memory;
* offload is slower than not offloading, so it is searched only when nothing fits without it.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field

from shardwise.config import tp_error
from shardwise.hardware import Cluster, GiB, PlannerError
from shardwise.model_args import ModelArgs, projection_shapes
from shardwise.planner.memory import LINEAR_GROUPS, host_bytes, peak_memory, stage_memory, state_bound
from shardwise.planner.plan import (
    Plan,
    engine_runs,
    ep_overlap_error,
    folded_experts_error,
    partial_checkpoint_error,
    system_layout_error,
    validate_plan,
    zero_fix,
)
from shardwise.planner.timing import StepTime, step_time
from shardwise.planner.workload import Training


@dataclass
class Evaluation:
    """The itemised per-rank prediction for one plan: what the simulator and the CLI consume."""

    plan: Plan
    memory: dict[str, float]
    """Bytes per item on the rank with the highest peak, with 'total'."""
    memory_stage: int
    """The pipeline stage that rank belongs to."""
    time: StepTime
    budget: float
    """Device memory the plan must fit in, bytes."""
    host: float = 0.0
    """Host memory one rank's offload fills, bytes (memory.host_bytes)."""
    host_budget: float = 0.0
    """Host memory per device, bytes (Accelerator.host_memory_bytes); 0: not known, not checked."""

    @property
    def fits_host(self) -> bool:
        return not self.host_budget or self.host <= self.host_budget

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.budget and self.fits_host

    def to_json(self) -> dict:
        p = self.plan
        out = {k: getattr(p, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "zero_stage",
                                          "micro_batch", "grad_accum", "activation_checkpoint",
                                          "activation_checkpoint_every", "pp_schedule", "virtual_stages",
                                          "sequence_parallel", "offload", "mixed_precision")}
        out["dp"] = p.dp
        out["memory_gib"] = {k: round(v / GiB, 3) for k, v in self.memory.items()}
        out["memory_stage"] = self.memory_stage
        out["host_memory_gib"] = round(self.host / GiB, 3)
        out["fits"] = self.fits
        t = self.time
        out.update(step_time_s=t.step_time_s, tokens_per_s=t.tokens_per_s, mfu=t.mfu,
                   bubble_fraction=t.bubble_fraction, exposed_comm_s=t.exposed_comm_s)
        out["time_s"] = {"compute": t.compute_s, "recompute": t.recompute_s, "bubble": t.bubble_s,
                         "optimizer": t.optimizer_s, "offload": t.offload_s, "comm_total": t.comm_total_s,
                         **{k.removesuffix("_s"): v for k, v in t.detail.items()}}
        return out


def evaluate(args: ModelArgs, training: Training, plan: Plan, cluster: Cluster) -> Evaluation:
    """Memory and time of one plan (validated first)."""
    check_recipe(args, training)
    validate_plan(plan, cluster.gpus, training.global_batch, args.n_layers, args.n_heads, args.n_experts,
                  training.moe_layer, args.n_shared_experts, training.ep_overlap)
    stage, mem = peak_memory(args, training, plan)
    return Evaluation(plan, mem, stage, step_time(args, training, plan, cluster), budget(cluster),
                      host_bytes(args, training, plan), cluster.accelerator.host_memory_bytes)


def budget(cluster: Cluster) -> float:
    return cluster.accelerator.memory_bytes - cluster.reserved_bytes


# ---------------------------------------------------------------------------------------------------
# The walk


@dataclass
class SearchResult:
    ranked: list[Evaluation]
    """Plans that fit, fastest first (top_k of them)."""
    evaluated: int
    """Full evaluations made."""
    best_by_knob: dict[tuple[str, object], float] = field(default_factory=dict)
    """(knob, value) -> fastest fitting step time seen with that value."""
    min_memory_by_knob: dict[tuple[str, object], float] = field(default_factory=dict)
    """(knob, value) -> smallest peak memory seen (or lower bound) with that value."""
    layouts: int = 0
    """Degree combinations (tp, cp, pp, dp split) that divide the cluster and the batch: 0 means no layout, not
    no memory."""
    least_host: float = math.inf
    """The least host memory per device of the offload layouts left out for want of it (bytes; inf: none was)."""


TIE = 1e-3
"""Step times this close (relative) rank by memory: the model is not that exact, and less memory is the safer plan."""
KNOBS = ("tp", "pp", "cp", "ep", "dp_shard", "dp_replicate", "zero_stage", "micro_batch", "activation_checkpoint",
         "pp_schedule", "virtual_stages", "offload", "mixed_precision")


def divisors(n: int) -> list[int]:
    """The divisors of n, ascending (in O(sqrt n): --gpus may be large)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def search(args: ModelArgs, training: Training, cluster: Cluster, fixed: dict | None = None, top_k: int = 5,
           max_tp: int | None = None, max_cp: int = 16, max_virtual: int = 8) -> SearchResult:
    """All plans consistent with `fixed` (knobs from --plan), ranked by predicted step time."""
    check_fixed(args, training, cluster, fixed or {}, max_cp)
    fixed = _resolved(fixed)
    result = SearchResult([], 0)
    # the offloads the engine runs ('optimizer' it does not: layout.engine_cannot_run)
    offloads = [fixed["offload"]] if "offload" in fixed else ["none", "full"] if training.offload_stages else ["none"]
    fits: list[Evaluation] = []
    for offload in offloads:
        for base in _degree_plans(args, training, cluster, fixed, max_tp, max_cp, offload):
            result.layouts += 1
            _search_degrees(args, training, cluster, base, fixed, max_virtual, result, fits)
        if fits:
            break
    fits.sort(key=lambda e: (e.time.step_time_s, e.memory["total"]))
    # plans within TIE of the fastest are one step time to this model: the least memory leads (a debug model's
    # micro-batch of 1024 won over 32 by 1e-6 s at 30 times the activations)
    fastest = fits[0].time.step_time_s * (1 + TIE) if fits else 0.0
    tied = sorted((e for e in fits if e.time.step_time_s <= fastest), key=lambda e: e.memory["total"])
    result.ranked = (tied + [e for e in fits if e.time.step_time_s > fastest])[:top_k]
    return result


def plan_space(args: ModelArgs, training: Training, cluster: Cluster, fixed: dict | None = None, offload: str = "none",
               max_tp: int | None = None, max_cp: int = 16, max_virtual: int = 8):
    """Every plan the search walks for one offload setting, before any pruning: what an exhaustive search would
    evaluate (tests check that the pruned walk finds the same best plan; benchmarks/planner_search.py times both).
    Recompute of every block or none: the search's checkpointing of one block in k (_fewest_checkpoints), where the
    faster policy did not fit, is checked on its own."""
    fixed = _resolved(fixed)
    recomputes = _recomputes(fixed)
    for base in _degree_plans(args, training, cluster, fixed, max_tp, max_cp, offload):
        local = training.global_batch // base.dp
        for schedule, v in _schedules(args, training, base, fixed, max_virtual):
            for mb in _micro_batches(local, fixed):
                if not _schedule_takes(schedule, base.pp, local // mb):
                    continue
                for recompute in recomputes:
                    plan = _with(base, micro_batch=mb, grad_accum=local // mb, pp_schedule=schedule,
                                 virtual_stages=v, activation_checkpoint=recompute)
                    if engine_runs(plan, training, args) and ep_overlap_error(plan, training.ep_overlap) is None:
                        yield plan


def _resolved(fixed: dict | None) -> dict:
    """--plan's keys as the walk reads them: a pipeline's micro-batches are its accumulation
    (config.layout_tables), so a fixed pp_microbatches fixes grad_accum."""
    fixed = dict(fixed or {})
    if "pp_microbatches" in fixed:
        fixed.setdefault("grad_accum", fixed["pp_microbatches"])
    return fixed


def check_recipe(args: ModelArgs, training: Training) -> None:
    """Reject a recipe the planner does not model for this model, naming the flag."""
    if args.n_experts and training.lora_rank:
        raise PlannerError("--lora-rank", "LoRA adapts dense linears and a mixture of experts' experts are 3-D "
                           "weights without adapters (the engine refuses it too)", "train all weights of an MoE model")
    if training.lora_rank and training.layout == "megatron" and training.fused_projections:
        present = projection_shapes(args)  # (a GELU MLP has no w3: its w1 is linear_fc1 whole)
        for fused in LINEAR_GROUPS:
            names = [name for name in fused if name in present]
            if 0 < sum(name in training.lora_targets for name in names) < len(names):
                raise PlannerError("--lora-targets", "NeMo's LoRA adapts Megatron-Core's fused linear_qkv and "
                                   "linear_fc1 whole, not part of one", f"name {', '.join(names)} together")
    if training.offload_layers >= args.n_layers:
        # megatron/core/transformer/transformer_config.py: "CPU offloading can be done only for layers less than ..."
        raise PlannerError("--system offload_layers", f"{training.offload_layers} of the model's {args.n_layers} "
                           "blocks offloaded", f"offload fewer than {args.n_layers} (Megatron-Core refuses more)")
    if args.n_experts and training.moe_dispatch == "deepep" and args.capacity_factor > 0:
        raise PlannerError("--system moe_dispatch", f"deepep is dropless, and the model sets capacity_factor "
                           f"{args.capacity_factor}", "use moe_dispatch = copies, or a dropless model")


def check_fixed(args: ModelArgs, training: Training, cluster: Cluster, fixed: dict, max_cp: int = 16) -> None:
    """Reject --plan values no plan can have, naming the key (`max_cp`: the search's largest free cp)."""
    check_recipe(args, training)
    world = cluster.gpus

    def bad(key: str, problem: str, fix: str) -> None:
        raise PlannerError(f"--plan {key}", problem, fix)

    for key, value in fixed.items():
        if isinstance(value, int) and not isinstance(value, bool) and value < (0 if key == "zero_stage" else 1):
            bad(key, f"{value} is negative" if key == "zero_stage" else f"{value} is not positive",
                "use 0, 1, 2 or 3" if key == "zero_stage" else "use 1 or more")
    error = system_fixed_error(training, fixed)  # (before the degrees' divisibility: tp=3 in a system with no tp)
    if error is not None:
        bad(*error)
    tp, cp, pp = fixed.get("tp", 1), fixed.get("cp", 1), fixed.get("pp", 1)
    # every rank holds a share of some sequence: tp splits heads, cp the sequence, pp the layers, dp the batch
    cp_most = cp if "cp" in fixed else max_cp
    most = args.n_heads * cp_most * args.n_layers * training.global_batch
    if world > most:
        raise PlannerError("--gpus", f"{world} GPUs are more than a plan can use: {training.global_batch} sequences "
                           f"x {args.n_layers} layers x {args.n_heads} heads x cp <= {cp_most} is {most}",
                           "use fewer GPUs or a larger --global-batch")
    if args.n_heads % tp or world % tp:
        bad("tp", f"tp={tp} must divide both {args.n_heads} heads and {world} GPUs", "pick a common divisor")
    if world % (tp * cp) or cp > 1 and training.seq_len % (2 * cp):  # the engine cuts 2 cp chunks (load balance)
        bad("cp", f"cp={cp} must divide --gpus/tp, and 2 x cp the sequence ({training.seq_len})", "pick a divisor")
    if cp > 1 and not training.fused_attention:
        bad("cp", f"cp={cp} with unfused attention (ring attention runs a fused kernel per block)", "use cp=1")
    if pp > args.n_layers or world % (tp * cp * pp):
        bad("pp", f"pp={pp} must be <= {args.n_layers} layers and divide --gpus/(tp*cp)", "pick a divisor")
    if training.offload_layers and fixed.get("activation_checkpoint", "none") != "none":  # (plan.engine_error)
        bad("activation_checkpoint", f"{fixed['activation_checkpoint']}, and the system offloads activations "
            "(offload_layers: Megatron-Core's cpu_offloading refuses recompute)", "use none, or offload_layers = 0")
    if training.offload_layers and fixed.get("pp", 1) > 1:
        bad("pp", f"pp={fixed['pp']}, and the system offloads activations (offload_layers: Megatron-Core's "
            "cpu_offloading has no pipeline)", "use pp=1, or offload_layers = 0")
    if fixed.get("sequence_parallel") and fixed.get("tp") == 1:
        bad("sequence_parallel", "sequence parallelism splits what tensor parallelism leaves whole, and tp=1",
            "use tp > 1, or leave sequence_parallel out")
    for key in ("pp_schedule", "virtual_stages"):  # (each asks for a pipeline: the search would drop it at pp=1)
        if pp == 1 and "pp" in fixed and key in fixed and (key == "pp_schedule" or fixed[key] > 1):
            bad(key, f"{key}={fixed[key]} is a pipeline's, and pp=1", f"use pp > 1, or leave {key} out")
    if fixed.get("virtual_stages", 1) > 1 and fixed.get("pp_schedule", "interleaved-1f1b") != "interleaved-1f1b":
        bad("virtual_stages", f"{fixed['virtual_stages']} stages per rank, and only interleaved-1f1b has virtual "
            f"stages (pp_schedule={fixed['pp_schedule']})", "use virtual_stages=1, or pp_schedule=interleaved-1f1b")
    if "pp_microbatches" in fixed:  # a plan's pipeline micro-batches are its accumulation (config.layout_tables)
        if pp == 1 and "pp" in fixed:
            bad("pp_microbatches", "a step's pipeline micro-batches need a pipeline, and pp=1", "use pp > 1")
        if fixed.get("grad_accum", fixed["pp_microbatches"]) != fixed["pp_microbatches"]:
            bad("pp_microbatches", f"{fixed['pp_microbatches']} != grad_accum {fixed['grad_accum']}: a pipeline's "
                "micro-batches are its accumulation", "give one of them")
    per_rank = 2 if fixed.get("pp_schedule") == "zero-bubble" else fixed.get("virtual_stages", 1)
    if pp * per_rank > args.n_layers:
        bad("virtual_stages", f"pp={pp} x {per_rank} stages per rank is {pp * per_rank} pipeline stages, more than "
            f"the {args.n_layers} layers", "use fewer virtual stages (each stage holds at least one block)")
    degrees = [fixed.get(k) for k in ("dp_replicate", "dp_shard")]
    dp = fixed.get("dp", math.prod(degrees) if None not in degrees else None)
    if dp is not None and {"tp", "pp", "cp"} <= set(fixed) and dp * tp * pp * cp != world:
        bad("dp", f"dp*tp*pp*cp = {dp * tp * pp * cp} but --gpus is {world}", "make the product the world size")
    # a dp no plan can have (the search came back empty, and the given plan's batch split took the blame)
    if "dp" in fixed and world % (fixed["dp"] * tp * pp * cp):
        rest = world // (tp * pp * cp)
        bad("dp", f"dp={fixed['dp']} does not divide the {rest} data-parallel ranks that the {world} GPUs leave "
            f"besides tp*pp*cp = {tp * pp * cp}", f"give a dp that divides {rest}")
    if fixed.get("zero_stage", 0) > 3:
        bad("zero_stage", f"{fixed['zero_stage']}", "use 0, 1, 2 or 3")
    every = fixed.get("activation_checkpoint_every", 1)
    if every != 1 and fixed.get("activation_checkpoint") == "none":  # (the engine's config refuses it too)
        bad("activation_checkpoint_every", f"{every}, and activation_checkpoint = none",
            "set activation_checkpoint = full or selective, or leave activation_checkpoint_every out")
    if every != 1 and (args.n_experts or training.activation_offload or training.partial_checkpoint == "none"):
        # (partial_checkpoint_error's, whatever the rest of the plan)
        error = partial_checkpoint_error(Plan(activation_checkpoint="full", activation_checkpoint_every=every),
                                         training, args)
        bad("activation_checkpoint_every", error.problem, error.fix)
    # keys of the layout the planner does not price: its plans (and --write-config) would drop them without a word
    if fixed.get("bucket_mb", training.ddp_bucket_mb) != training.ddp_bucket_mb:
        bad("bucket_mb", f"{fixed['bucket_mb']:g}: the planner prices DDP buckets of {training.ddp_bucket_mb:g} MB "
            "(Training.ddp_bucket_mb) and its plans carry the engine's default", "leave it out, and set "
            "parallel.bucket_mb in the written config")
    if fixed.get("offload") == "optimizer":
        bad("offload", "the engine has no optimizer-only offload", "use offload=full or offload=none")
    if fixed.get("mixed_precision", "autocast") != "autocast":
        if fixed["mixed_precision"] not in mixed_precisions(dataclasses.replace(training, precision="bf16")):
            bad("mixed_precision", f"{fixed['mixed_precision']!r} is shardwise's engine's FSDP2 policy, and "
                f"{training.system} runs its own recipe (layout {training.layout})",
                "leave mixed_precision out, or plan with --system shardwise")
        if training.precision != "bf16":
            bad("mixed_precision", f"'fsdp' is FSDP2's policy with bf16 parameters and --precision is "
                f"{training.precision}", "pass --precision bf16, or leave mixed_precision out")
        if fixed.get("zero_stage", 3) < 2:
            bad("mixed_precision", f"'fsdp' is FSDP2's policy for the weights FSDP shards, and zero_stage is "
                f"{fixed['zero_stage']}", "use zero_stage 2 or 3 with dp_shard x cp > 1")
    if fixed.get("activation_checkpoint") == "selective" and training.selective == "none":
        bad("activation_checkpoint", f"selective, and {training.system} has no op-level selective checkpointing "
            "(selective = none)", "use activation_checkpoint=none or full, or a system with selective checkpointing")
    ep = fixed.get("ep", 1)
    if ep > 1 and not args.n_experts:
        bad("ep", f"ep={ep} splits experts and {args.name} has none", "use ep=1 (or leave it out) for a dense model")
    if args.n_experts % ep or ep > 1 and world % ep:
        bad("ep", f"ep={ep} must divide the {args.n_experts} experts and --gpus", "pick a common divisor")
    megatron_moe = training.moe_layer == "megatron-core"  # Megatron-Core's: the tp x cp x dp ranks at ZeRO-0/1
    if args.n_experts and megatron_moe and fixed.get("tp", 1) > 1:
        # (a free ep or ZeRO stage: the search offers ep > 1 beside tp at ZeRO-0/1 only; dp_shard > 1 is ZeRO-2/3)
        zero = fixed.get("zero_stage", 2 if fixed.get("dp_shard", 1) > 1 else 1)
        partial = Plan(tp=fixed["tp"], ep=fixed.get("ep", 2), sequence_parallel=fixed.get("sequence_parallel", True),
                       zero_stage=zero)
        error = folded_experts_error(partial, args.n_experts, args.n_shared_experts, training.moe_layer)
        if error is not None:
            bad(error.field.removeprefix("parallel."), error.problem, error.fix)
    if ep > 1 and training.ep_overlap:
        partial = {k: fixed[k] for k in ("pp", "pp_schedule", "virtual_stages", "activation_checkpoint") if k in fixed}
        if partial.get("pp", 2) == 1:
            partial = {k: v for k, v in partial.items() if k not in ("pp_schedule", "virtual_stages")}
        error = ep_overlap_error(Plan(ep=ep, **{"pp": 2, "pp_schedule": "interleaved-1f1b", "virtual_stages": 2,
                                                **partial}), True)
        if error is not None:
            bad(error.field.removeprefix("parallel."), error.problem, error.fix)
    if ep > 1 and not megatron_moe and {"dp_shard", "cp"} <= set(fixed) and (fixed["dp_shard"] * cp) % ep:
        bad("ep", f"ep={ep} splits the experts over the dp_shard x cp = {fixed['dp_shard'] * cp} ranks of "
            "ZeRO-2/3, and does not divide them", "make dp_shard x cp a multiple of ep")
    if ep > 1 and not megatron_moe and fixed.get("zero_stage", 3) < 2:
        bad("ep", f"ep={ep} splits the experts over FSDP's ranks and zero_stage is {fixed['zero_stage']}",
            "use zero_stage 2 or 3 (or leave it out)")
    others = {k: fixed[k] for k in ("pp",) + (() if megatron_moe else ("tp", "dp_replicate")) if fixed.get(k, 1) > 1}
    room = world // math.prod(others.values())  # dp_shard x cp divides this
    if ep > 1 and others and room % ep:
        given = " x ".join(f"{k}={v}" for k, v in others.items())
        drawn = "tp x cp x dp" if megatron_moe else "dp_shard x cp"
        bad("ep", f"ep={ep} is drawn from the {drawn} ranks, and with {given} they divide {room}",
            f"use an ep dividing {room}, or smaller {' and '.join(others)}")

    error = system_zero_error(training, fixed, world)  # (last: once every degree is known to divide the world)
    if error is not None:
        bad(*error)


def pipeline_keys(fixed: dict) -> list[str]:
    """The --plan keys that ask for a pipeline: pp > 1, pp_schedule, pp_microbatches, virtual_stages > 1."""
    return [k for k in ("pp", "pp_schedule", "pp_microbatches", "virtual_stages")
            if k in fixed and (k not in ("pp", "virtual_stages") or fixed[k] > 1)]


def system_fixed_error(training: Training, fixed: dict) -> tuple[str, str, str] | None:
    """(--plan key, problem, fix) for a key that asks for a parallelism the system lacks (plan.system_parallel_error,
    which every plan the search offers passes): tensor, context, expert or pipeline parallelism it does not have (a
    pipeline is asked for by pp > 1, and also by pp_schedule, pp_microbatches or virtual_stages > 1), or a schedule
    it does not run. Its ZeRO stages: system_zero_error."""
    name, schedules = training.system, training.pp_schedules
    tp, cp, pp, virtual = (fixed.get(k, 1) for k in ("tp", "cp", "pp", "virtual_stages"))
    if not training.tensor_parallel and (tp > 1 or fixed.get("sequence_parallel")):
        key = "tp" if tp > 1 else "sequence_parallel"
        value = str(fixed[key]).lower()  # (as --plan writes it)
        return key, f"{key}={value}, and {name} has no tensor parallelism of the planner's kind (heads and the " \
            "MLP split over tp ranks)", f"leave {key} out, or plan with another --system"
    if cp > 1 and not training.context_parallel:
        return "cp", f"cp={cp}, and {name} has no context parallelism of the planner's kind (ring attention over " \
            "sequence shards)", "use cp=1, or plan with another --system"
    if fixed.get("ep", 1) > 1 and not training.expert_parallel:
        return "ep", f"ep={fixed['ep']}, and {name} has no expert parallelism", \
            "use ep=1, or plan with another --system"
    asked = pipeline_keys(fixed)
    if asked and not schedules:
        return asked[0], f"{asked[0]}={fixed[asked[0]]} asks for a pipeline, and {name} has no pipeline parallelism", \
            f"leave {asked[0]} out, or plan with another --system"
    runs = f"{name} runs {', '.join(schedules)}" if len(schedules) > 1 else f"{name} runs {schedules[0]} only" \
        if schedules else ""
    if "pp_schedule" in fixed and fixed["pp_schedule"] not in schedules:
        return "pp_schedule", f"{fixed['pp_schedule']}, and {runs}", \
            f"use pp_schedule={schedules[0]}" + (" or another of those" if len(schedules) > 1 else "")
    if virtual > 1 and "interleaved-1f1b" not in schedules:
        return "virtual_stages", f"{virtual} stages per rank are interleaved-1f1b's, and {runs}", \
            "use virtual_stages=1 (or leave it out)"
    return None


def system_zero_error(training: Training, fixed: dict, world: int) -> tuple[str, str, str] | None:
    """(--plan key, problem, fix) for ZeRO keys the system does not run, read with what the other keys leave of the
    data-parallel ranks (check_fixed calls it once the degrees are known to divide the world): a ZeRO stage it does
    not run (ZeRO-0 where the keys leave more than one data-parallel rank, or where it runs DDP alone, beside other
    parallelism), host offload at a stage it does not offload at, replicas it cannot run, or, beside a pipeline,
    sharding above pp_zero_max (dp_shard, ep, offload=full and a dp the keys leave sharded use ZeRO-2/3)."""
    name, schedules = training.system, training.pp_schedules
    tp, cp, pp = (fixed.get(k, 1) for k in ("tp", "cp", "pp"))
    asked = pipeline_keys(fixed)
    zero = fixed.get("zero_stage")
    # what the keys leave of the data-parallel ranks: tp and pp given (or absent from the system) leave dp x cp
    has = {"tp": training.tensor_parallel, "cp": training.context_parallel, "pp": bool(schedules)}
    known = {k: k in fixed or not has[k] for k in has}
    dpcp = world // (tp * pp) if known["tp"] and known["pp"] else None
    if "dp" in fixed and known["cp"]:
        dpcp = fixed["dp"] * cp
    dp = dpcp // cp if dpcp is not None and known["cp"] else fixed.get("dp")
    if dp is None and {"dp_replicate", "dp_shard"} <= set(fixed):
        dp = fixed["dp_replicate"] * fixed["dp_shard"]
    least = max(dpcp or 1, (dp or 1) * cp, fixed.get("dp_replicate", 1) * fixed.get("dp_shard", 1) * cp)
    shard = fixed.get("dp_shard", dp // fixed["dp_replicate"] if dp and "dp_replicate" in fixed else
                      1 if fixed.get("dp_replicate") == world // (tp * cp * pp) else None)  # (the most dp leaves)
    # how the keys split them: FSDP over dp_shard x cp (ZeRO-2/3; ep is drawn from it) or replicas (ZeRO-0/1); cp
    # alone decides nothing (ZeRO-0/1 run beside it)
    fsdp_ep = fixed.get("ep", 1) > 1 and training.moe_layer == "engine"
    sharded = True if (shard or 1) > 1 or fsdp_ep or (zero or 0) >= 2 else \
        False if shard == 1 and cp == 1 else None
    # parallelism besides data parallelism
    others = tp * pp * cp > 1 or dpcp is not None and dpcp < world or dp is not None and dp * cp < world
    ddp = not (training.ddp_alone and others)
    if zero is not None and zero not in training.zero_stages and (zero > 0 or least > 1):
        return "zero_stage", f"{zero}, and {name} runs ZeRO-{', '.join(map(str, training.zero_stages))}", \
            zero_fix(training, sharded, ddp)
    if zero == 0 and not ddp and least > 1:
        given = ", ".join(f"{k}={fixed[k]}" for k in ("tp", "pp", "cp", "dp") if k in fixed)
        return "zero_stage", f"ZeRO-0 (DDP) beside other parallelism ({given} given), and {name} runs DDP as the " \
            "only parallelism", zero_fix(training, sharded, ddp)
    if zero == 0 and training.ddp_alone and fixed.get("dp_replicate", 1) > 1 and \
            fixed["dp_replicate"] * tp * pp * cp < world:
        return "zero_stage", f"ZeRO-0 (DDP) over dp_replicate={fixed['dp_replicate']} leaves ranks to other " \
            f"parallelism, and {name} runs DDP as the only parallelism", \
            f"use dp_replicate={world // (tp * pp * cp)}, or zero_stage={training.zero_stages[-1]} with dp_shard"
    if fixed.get("offload") == "full" and (not training.offload_stages or zero is not None and zero not in
                                           training.offload_stages):
        stages = training.offload_stages
        return "offload", "full, and " + (f"{name} offloads the weights at ZeRO-{', '.join(map(str, stages))} only"
                                          if stages else f"{name} never offloads weights, gradients and optimizer "
                                          "state (FSDP's CPU offload, ZeRO-Infinity's)"), \
            f"use zero_stage={stages[-1]}" if stages else "use offload=none, or plan with another --system"
    replicas = [z for z in training.zero_stages if z < 2] + list(training.hsdp_stages)  # stages beside replicas
    if fixed.get("dp_replicate", 1) > 1 and not replicas:
        return "dp_replicate", f"dp_replicate={fixed['dp_replicate']} replicas, and {name} runs neither DDP nor " \
            "hybrid sharding", "leave dp_replicate out (shard over every data-parallel rank)"
    replicated = fixed.get("dp_replicate", dp // shard if dp and shard else 1)
    if replicated > 1 and sharded and (zero is None and not training.hsdp_stages or zero is not None and zero >= 2
                                       and zero not in training.hsdp_stages):
        hsdp = ", ".join(map(str, training.hsdp_stages))
        key = "dp_replicate" if "dp_replicate" in fixed else "dp_shard"  # (replicas inferred: dp_shard was given)
        fix = f"use zero_stage={training.hsdp_stages[-1]}" if hsdp else \
            "leave dp_replicate out (shard over every data-parallel rank)" if key == "dp_replicate" else \
            f"use dp_shard={dp} (no replicas)"
        return key, f"{key}={fixed[key]} leaves {replicated} replicas of a sharded group (hybrid sharding), and " \
            f"{name} " + (f"runs it with ZeRO-{hsdp} only" if hsdp else "has no hybrid sharding"), fix
    if asked and training.pp_zero_max < 3:
        at_most = f"{name} runs at most ZeRO-{training.pp_zero_max} beside a pipeline"
        if zero is not None and zero > training.pp_zero_max:
            return "zero_stage", f"ZeRO-{zero} with {asked[0]}={fixed[asked[0]]}, and {at_most}", \
                f"use zero_stage <= {training.pp_zero_max}, or no pipeline"
        sharding = [k for k in ("dp_shard", "ep") if fixed.get(k, 1) > 1 and (k != "ep" or fsdp_ep)] + (
            ["offload"] if fixed.get("offload") == "full" else [])
        if sharding and training.pp_zero_max < 2:
            key = sharding[0]
            return key, f"{key}={fixed[key]} shards with ZeRO-2/3 and {asked[0]}={fixed[asked[0]]} asks for a " \
                f"pipeline, and {at_most}", f"leave {key} out, or no pipeline"
        if shard is not None and shard > 1 and training.pp_zero_max < 2:  # a split the keys leave sharded
            key = "dp_replicate" if "dp_replicate" in fixed else "dp"
            return key, f"{key}={fixed[key]} leaves dp_shard={shard} (ZeRO-2/3) beside {asked[0]}=" \
                f"{fixed[asked[0]]}, and {at_most}", f"use dp_replicate={dp} (every data-parallel rank a replica)"
    return None


def _degree_plans(args: ModelArgs, training: Training, cluster: Cluster, fixed: dict, max_tp: int | None,
                  max_cp: int, offload: str = "none"):
    world = cluster.gpus
    # only the parallelisms the system has (Training.tensor_parallel, context_parallel, pp_schedules)
    tps = _choices(fixed, "tp", [t for t in divisors(math.gcd(args.n_heads, cluster.gpus_per_node, world))
                                 if (max_tp is None or t <= max_tp) and (t == 1 or training.tensor_parallel)])
    for tp in tps:
        if world % tp or tp == 1 and fixed.get("sequence_parallel"):  # the engine runs it with tp > 1 only
            continue
        # ring attention is a fused kernel per block: unfused attention (Training.fused_attention) has no cp
        cps = _choices(fixed, "cp", [c for c in divisors(world // tp) if c <= max_cp and training.fused_attention
                                     and training.context_parallel and training.seq_len % (2 * c) == 0 or c == 1])
        for cp in cps:
            if (world // tp) % cp:
                continue
            # a fixed pp_microbatches asks for a pipeline (it has no meaning without one)
            # (pp_microbatches and virtual_stages > 1 ask for a pipeline; pp_schedule does too: _schedules)
            pps = _choices(fixed, "pp", [p for p in divisors(world // (tp * cp)) if p <= args.n_layers
                                         and (p > 1 or "pp_microbatches" not in fixed
                                              and fixed.get("virtual_stages", 1) == 1)
                                         and (p == 1 or training.pp_schedules)])
            for pp in pps:
                if (world // (tp * cp)) % pp:
                    continue
                dp = world // (tp * cp * pp)
                if "dp" in fixed and fixed["dp"] != dp or training.global_batch % dp:
                    continue
                for plan in _dp_splits(dp, tp, cp, pp, fixed, offload, args.n_experts, mixed_precisions(training),
                                       training.moe_layer):
                    if system_layout_error(plan, training) is None and folded_experts_error(
                            plan, args.n_experts, args.n_shared_experts, training.moe_layer) is None:
                        # (degrees and ZeRO the system runs; its experts beside tp as the planner prices them)
                        yield plan


def mixed_precisions(training: Training) -> list[str]:
    """The ways bf16 can run where FSDP shards (Layout.mixed_precision) that --plan may fix: shardwise's engine (the
    layout 'torch') has autocast and FSDP2's policy; every other system's recipe is its own (--system), so the knob
    stays 'autocast', a system file on the layout 'torch' too (Lightning's FSDP under bf16-mixed has no such
    knob: its gathers stay fp32). The search tries both where FSDP shards."""
    ours = training.system.split(" (")[0] == "shardwise"
    return ["autocast", "fsdp"] if ours and training.layout == "torch" and training.precision == "bf16" \
        else ["autocast"]


def _dp_splits(dp: int, tp: int, cp: int, pp: int, fixed: dict, offload: str = "none", n_experts: int = 0,
               mixed: tuple | list = ("autocast",), moe_layer: str = "engine"):
    shards = _choices(fixed, "dp_shard", divisors(dp))
    for dp_shard in shards:
        if dp % dp_shard or "dp_replicate" in fixed and fixed["dp_replicate"] != dp // dp_shard:
            continue
        # as the engine runs ZeRO: 0 and 1 over dp_replicate (1 shards the optimizer over the whole dp x cp
        # group), 2 and 3 are FSDP over dp_shard x cp, with dp_replicate as HSDP's replicas
        stages = ([0] + ([1] if dp * cp > 1 else [])) if dp_shard == 1 else []
        if dp_shard * cp > 1:
            stages += [2, 3]
        if offload == "full":  # FSDP2's CPUOffloadPolicy: ZeRO-2/3, over a mesh of one where nothing else shards
            stages = [2, 3] if dp_shard * cp > 1 or dp == 1 else []
        for zero in [z for z in stages if fixed.get("zero_stage", z) == z]:  # (a fixed stage only where it runs)
            degrees = expert_degrees(n_experts, dp_shard, cp, zero, dp, tp, moe_layer)
            # FSDP2's mixed-precision policy where FSDP shards (layout.fsdp_shards), autocast elsewhere (a fixed
            # 'fsdp' elsewhere is left out by engine_runs)
            policies = _choices(fixed, "mixed_precision", list(mixed) if zero >= 2 and dp_shard * cp > 1
                                else ["autocast"])
            for ep in _choices(fixed, "ep", degrees):
                if ep not in degrees:
                    continue
                for policy in policies:
                    yield Plan(dp_replicate=dp // dp_shard, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, ep=ep,
                               zero_stage=zero, sequence_parallel=fixed.get("sequence_parallel", tp > 1),
                               offload=offload, mixed_precision=policy,
                               activation_checkpoint_every=fixed.get("activation_checkpoint_every", 1))


def expert_degrees(n_experts: int, dp_shard: int, cp: int, zero_stage: int, dp: int = 1, tp: int = 1,
                   moe_layer: str = "engine") -> list[int]:
    """The ep a layout can have: 1, and for a mixture of experts under ZeRO-2/3 every divisor of dp_shard x cp that
    divides n_experts and is a multiple of cp (the engine's expert parallelism borrows the dp_shard x cp ranks).
    Under Megatron-Core's (`moe_layer` 'megatron-core', Training.moe_layer) at ZeRO-0/1 every divisor of the
    tp x cp x dp ranks that divides n_experts (expert tensor parallelism 1: its expert groups fold over tp), and at
    ZeRO-2/3 (its FSDP) the engine's, without tp. A dense model has only 1."""
    if not n_experts:
        return [1]
    if moe_layer == "megatron-core" and zero_stage < 2:
        return [1] + [e for e in divisors(tp * cp * dp) if e > 1 and n_experts % e == 0]
    if zero_stage < 2 or moe_layer == "megatron-core" and tp > 1:
        return [1]
    return [1] + [e for e in divisors(dp_shard * cp) if e > 1 and n_experts % e == 0 and e % cp == 0]


def _choices(fixed: dict, key: str, options: list) -> list:
    return [fixed[key]] if key in fixed else options


def _recomputes(fixed: dict) -> list[str]:
    """The recompute policies to try, in order of time (and the reverse of memory): a fixed
    activation_checkpoint_every > 1 asks for one that checkpoints."""
    every = fixed.get("activation_checkpoint_every", 1) != 1
    return _choices(fixed, "activation_checkpoint", ["selective", "full"] if every else ["none", "selective", "full"])


def _search_degrees(args: ModelArgs, training: Training, cluster: Cluster, base: Plan, fixed: dict,
                    max_virtual: int, result: SearchResult, fits: list[Evaluation]) -> None:
    if tp_error(args, base, training.seq_len) is not None:
        # the engine cannot split this model so (tp not dividing its heads, MLP or vocabulary): no plan runs, and its
        # memory is not a reason the explanation may give ('tp=8: out of memory' for a 50,257-token vocabulary)
        return
    limit = budget(cluster)
    local = training.global_batch // base.dp
    schedules = _schedules(args, training, base, fixed, max_virtual)
    if not schedules:
        return
    host = host_bytes(args, training, base)  # the degrees, ZeRO stage and offload decide it, nothing after them
    if cluster.accelerator.host_memory_bytes and host > cluster.accelerator.host_memory_bytes:
        result.least_host = min(result.least_host, host)
        return
    # (Megatron-Core's all-to-all overlap refuses full recompute: plan.ep_overlap_error)
    recomputes = [r for r in _recomputes(fixed) if r != "full" or not (training.ep_overlap and base.ep > 1)]
    if training.offload_layers:  # Megatron-Core's CPU offloading refuses recompute (plan.engine_error): the floor
        recomputes = [r for r in recomputes if r == "none"]  # is then no recompute's, with the blocks offloaded
    if not recomputes:
        return
    # lower bound per schedule, under the most recompute allowed (schedules hold different micro-batches in flight
    # and place the head differently: zero-bubble's V puts it on the first rank): the least of one sequence per
    # micro-batch and, where the schedule can run it, the whole local batch as one micro-batch. The second is not
    # larger whenever accumulation costs memory of its own: FSDP without per-micro-batch synchronisation keeps
    # every gradient unsharded from the first micro-batch to the last, and one micro-batch keeps none.
    floors, owners = [], []
    for schedule in schedules:
        name, v = schedule
        for mb in {1, local}:
            if not _schedule_takes(name, base.pp, local // mb):
                continue
            floors.append(_with(base, micro_batch=mb, grad_accum=local // mb, activation_checkpoint=recomputes[-1],
                                pp_schedule=name, virtual_stages=v))
            owners.append(schedule)
    fitting = _floors_that_fit(args, training, floors, limit, result)
    alive = [s for s in schedules if any(fits for owner, fits in zip(owners, fitting) if owner == s)]
    # Memory grows with the micro-batch and falls with recompute (none, selective, full). So, per schedule, the
    # first policy that may still fit, and a schedule none of whose policies fit a micro-batch is not tried at
    # larger ones. That holds while a step has more than 2 pp micro-batches: then every rank holds its most in
    # flight and accumulates gradients from its first backward. With fewer, fewer are in flight and the
    # accumulated gradients go (at one), so memory can fall as the micro-batch grows: every schedule is tried.
    start = dict.fromkeys(alive, 0)
    for mb in _micro_batches(local, fixed):
        steady = local // mb > 2 * base.pp
        for schedule, v in list(start) if steady else alive:
            if not _schedule_takes(schedule, base.pp, local // mb):
                continue
            plan = _with(base, micro_batch=mb, grad_accum=local // mb, pp_schedule=schedule, virtual_stages=v)
            first = start[schedule, v] if steady else 0
            found = _cheapest_recompute(args, training, cluster, plan, recomputes[first:], limit, result,
                                        "activation_checkpoint_every" not in fixed, first)
            if found is not None:
                fits.append(found[1])
            if steady and found is None:
                del start[schedule, v]
            elif steady:
                start[schedule, v] = first + found[0]


def _micro_batches(local: int, fixed: dict) -> list[int]:
    """Micro-batch sizes that split a rank's `local` sequences as --plan allows (accumulation is the rest)."""
    return [mb for mb in _choices(fixed, "micro_batch", divisors(local))
            if local % mb == 0 and ("grad_accum" not in fixed or fixed["grad_accum"] == local // mb)]


def _schedule_takes(schedule: str, pp: int, grad_accum: int) -> bool:
    """Whether the schedule runs a step of `grad_accum` micro-batches as the search prices it (interleaving: in
    rounds of pp)."""
    return schedule != "interleaved-1f1b" or grad_accum % pp == 0


def _floors_that_fit(args: ModelArgs, training: Training, floors: list[Plan], limit: float,
                     result: SearchResult) -> list[bool]:
    """Which of `floors` fit within `limit`; when none does, the least of their peaks is noted for the explanation.

    A plan's model state (state_bound) is below its first rank's peak, which is below the plan's peak
    (peak_memory checks more ranks): a floor over the limit by a bound is out without the rest, and the least peak
    is found by visiting floors from the lowest bound up, stopping once the next bound exceeds the least peak found
    (ties go to the earlier floor, as min())."""
    bounds = [state_bound(args, training, f) for f in floors]
    firsts: dict[int, dict[str, float]] = {}
    peaks: dict[int, float] = {}

    def first(i: int) -> float:
        if i not in firsts:
            firsts[i] = stage_memory(args, training, floors[i], 0)
        return firsts[i]["total"]

    def peak(i: int) -> float:
        if i not in peaks:
            peaks[i] = peak_memory(args, training, floors[i], firsts[i])[1]["total"]
        return peaks[i]

    fits = [bounds[i] <= limit and first(i) <= limit and peak(i) <= limit for i in range(len(floors))]
    if any(fits) or all(_cannot_lower(result, f, firsts[i]["total"] if i in firsts else bounds[i])
                        for i, f in enumerate(floors)):
        return fits  # (when no floor's bound is below the least memory noted for its knobs, noting changes nothing)
    least = (math.inf, 0)
    for i in sorted(range(len(floors)), key=lambda i: bounds[i]):
        if bounds[i] > least[0]:
            break
        if first(i) <= least[0]:
            least = min(least, (peak(i), i))
    _note_memory(result, floors[least[1]], least[0])
    return fits


def _cheapest_recompute(args: ModelArgs, training: Training, cluster: Cluster, plan: Plan, recomputes: list[str],
                        limit: float, result: SearchResult, partial: bool = False,
                        skipped: int = 0) -> tuple[int, Evaluation] | None:
    """The fastest recompute policy that fits, and its index in `recomputes`: none < selective < full in time and
    the reverse in memory, so the first that fits, in that order, is the only one worth timing. With `partial`
    (activation_checkpoint_every free), where a faster policy did not fit (here, or among the `skipped` ones before
    `recomputes`, which did not fit a smaller micro-batch), the policy found checkpointing one block in k for the
    largest k that fits (_fewest_checkpoints)."""
    found = None
    for index, recompute in enumerate(recomputes):
        candidate = _with(plan, activation_checkpoint=recompute)  # valid by construction
        if not engine_runs(candidate, training, args):
            continue
        result.evaluated += 1
        # the first rank alone often settles it; its total is a lower bound on the plan's peak
        first = stage_memory(args, training, candidate, 0)
        if first["total"] > limit:
            _note_memory(result, candidate, first["total"])
            continue
        stage, mem = peak_memory(args, training, candidate, first)
        if mem["total"] <= limit:
            found = (index, candidate, stage, mem)
            break
        _note_memory(result, candidate, mem["total"])
    if found is None:
        return None
    index, candidate, stage, mem = found
    host = host_bytes(args, training, candidate)  # (Megatron-Core's offloaded activations grow with the micro-batch)
    if cluster.accelerator.host_memory_bytes and host > cluster.accelerator.host_memory_bytes:
        result.least_host = min(result.least_host, host)
        return None
    if partial and skipped + index > 0 and candidate.activation_checkpoint != "none" and _may_lead(
            args, training, cluster, candidate, result):
        candidate, stage, mem = _fewest_checkpoints(args, training, candidate, stage, mem, limit, result)
    ev = Evaluation(candidate, mem, stage, step_time(args, training, candidate, cluster), limit, host,
                    cluster.accelerator.host_memory_bytes)
    _note(result, ev)
    return index, ev


def _may_lead(args: ModelArgs, training: Training, cluster: Cluster, plan: Plan, result: SearchResult) -> bool:
    """Whether `plan` with fewer blocks checkpointed could be within TIE of the fastest plan found so far, judged by
    its step time without recompute less MAY_LEAD_MARGIN: a heuristic, not a bound (with cp and ZeRO-3 a plan
    replaying some blocks priced up to 6.4% faster than without recompute: the heaviest rank's backward hides more
    of the gathers). A plan left so keeps its every-block time among the knobs' best times
    (SearchResult.best_by_knob): what its knobs' values allow at most."""
    fastest = min(result.best_by_knob.values(), default=math.inf)
    if fastest == math.inf:
        return True
    without = step_time(args, training, _with(plan, activation_checkpoint="none"), cluster).step_time_s
    return without * (1 - MAY_LEAD_MARGIN) <= fastest * (1 + TIE)


MAY_LEAD_MARGIN = 0.10
"""How much faster than without recompute _may_lead lets a plan with some blocks replayed be."""


def _fewest_checkpoints(args: ModelArgs, training: Training, plan: Plan, stage: int, mem: dict[str, float],
                        limit: float, result: SearchResult) -> tuple[Plan, int, dict[str, float]]:
    """`plan` (which fits, checkpointing every block) checkpointing one block in k for the largest k that fits, and
    its peak (stage, breakdown): each block left out saves its replay and keeps what it would without recompute,
    so the time falls and the memory grows with k (torchtitan's selective_ac_option "k", fms-fsdp's fraction). By
    bisection over 1 (the plan) to the model's blocks (one block checkpointed, or none on a rank of fewer), as
    memory grows with k a block at a time (in a pipeline not strictly: bisection can stop below the largest);
    where the planner does not price it (plan.partial_checkpoint_error), the plan as it is."""
    if partial_checkpoint_error(_with(plan, activation_checkpoint_every=2), training, args) is not None:
        return plan, stage, mem
    best, below, above = (plan, stage, mem), 1, args.n_layers + 1
    while above - below > 1:
        every = (below + above) // 2
        trial = _with(plan, activation_checkpoint_every=every)
        result.evaluated += 1
        first = stage_memory(args, training, trial, 0)
        peak = peak_memory(args, training, trial, first) if first["total"] <= limit else (0, first)
        if peak[1]["total"] <= limit:
            best, below = (trial, *peak), every
        else:
            _note_memory(result, trial, peak[1]["total"])
            above = every
    return best


def _schedules(args: ModelArgs, training: Training, base: Plan, fixed: dict,
               max_virtual: int) -> list[tuple[str, int]]:
    if base.pp == 1:  # a fixed pipeline schedule rules out pp = 1; without a pipeline the schedule is not used
        return [(base.pp_schedule, 1)] if "pp_schedule" not in fixed else []
    # 1f1b too: the engine cannot run zero-bubble with ZeRO-3 or selective recompute (see engine_runs); only the
    # schedules the system runs (Training.pp_schedules)
    # (Megatron-Core overlaps the all-to-alls under the interleaved schedule only: plan.ep_overlap_error)
    overlap = training.ep_overlap and base.ep > 1
    names = [n for n in _choices(fixed, "pp_schedule", ["zero-bubble", "interleaved-1f1b", "1f1b"])
             if n in training.pp_schedules and (fixed.get("virtual_stages", 1) == 1 or n == "interleaved-1f1b")
             and (n == "interleaved-1f1b" or not overlap)]
    out = []
    for name in names:
        if name == "interleaved-1f1b":
            vs = _choices(fixed, "virtual_stages", list(range(2, max_virtual + 1)))
            out += [(name, v) for v in vs if base.pp * v <= args.n_layers  # a stage holds at least one block
                    and (v > 1 or not overlap)]
        elif name != "zero-bubble" or 2 * base.pp <= args.n_layers:  # the V needs two stages per rank
            out.append((name, 1))
    return out


def _with(plan: Plan, **changes) -> Plan:
    """dataclasses.replace without its per-call field introspection or __init__ (the search makes ~10^5 of these):
    the plan's defaults are already resolved (Layout.__post_init__) and the search never sets a field to its
    unresolved sentinel."""
    new = object.__new__(Plan)
    new.__dict__.update(plan.__dict__, **changes)
    return new


_KNOB_VALUES = operator.attrgetter(*KNOBS)


def _note(result: SearchResult, ev: Evaluation) -> None:
    t = ev.time.step_time_s
    best = result.best_by_knob
    for key in zip(KNOBS, _KNOB_VALUES(ev.plan)):
        if t < best.get(key, math.inf):
            best[key] = t
    _note_memory(result, ev.plan, ev.memory["total"])


def _cannot_lower(result: SearchResult, plan: Plan, bound: float) -> bool:
    """Whether a plan whose peak is at least `bound` would lower none of min_memory_by_knob's entries."""
    least = result.min_memory_by_knob
    return all(least.get(key, math.inf) <= bound for key in zip(KNOBS, _KNOB_VALUES(plan)))


def _note_memory(result: SearchResult, plan: Plan, total: float) -> None:
    least = result.min_memory_by_knob
    for key in zip(KNOBS, _KNOB_VALUES(plan)):
        if total < least.get(key, math.inf):
            least[key] = total
