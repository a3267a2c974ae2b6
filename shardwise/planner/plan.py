"""A plan: the parallel degrees and the knobs that go with them, as the engine's [parallel] section will hold them.

Mesh order, outermost to innermost (torchtitan's): pp, dp_replicate, dp_shard, cp, tp. tp is innermost so it
lands inside a node; pp outermost so its point-to-point traffic is what crosses the slowest links.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shardwise.hardware import PlannerError

Recompute = Literal["none", "selective", "full"]
Schedule = Literal["none", "gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]
Offload = Literal["none", "optimizer", "full"]

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
OFFLOADS = ("none", "optimizer", "full")


@dataclass(frozen=True)
class Plan:
    dp_replicate: int = 1
    """Data-parallel replicas: DDP / ZeRO-1 ranks, or the replicate dim of HSDP (ZeRO-2/3)."""
    dp_shard: int = 1
    """Data-parallel ranks that shard model state with FSDP (ZeRO-2/3), together with cp."""
    tp: int = 1
    """Tensor-parallel degree (heads and MLP columns split), inside a node."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel degree (sequence split, ring attention)."""
    zero_stage: int = 0
    """0 DDP; 1 + optimizer state sharded over the whole dp group; 2 + gradients, 3 + weights, over dp_shard x cp."""
    micro_batch: int = 1
    """Sequences per forward/backward on one rank."""
    grad_accum: int = 1
    """Micro-batches per optimizer step per data-parallel rank (the pipeline's M when pp > 1)."""
    recompute: Recompute = "none"
    """Activation recomputation: none, selective (keep matmul outputs), full (keep block inputs)."""
    schedule: Schedule = "none"
    """Pipeline schedule ('none' when pp = 1)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved-1f1b only)."""
    sequence_parallel: bool = False
    """Shard norm/residual activations along the sequence across tp ranks."""
    offload: Offload = "none"
    """Keep optimizer state (and master weights) or all model state in host memory."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def stages_per_rank(self) -> int:
        """Model chunks per pipeline rank as the engine builds them (config.ParallelConfig.stages_per_rank): two
        for zero-bubble, whose V shape the engine runs, virtual_stages otherwise."""
        return 2 if self.schedule == "zero-bubble" else self.virtual_stages

    @property
    def shard_group(self) -> int:
        """Ranks that split model state, as the engine (config.ParallelConfig) runs ZeRO: stage 1 shards the
        optimizer over every data-parallel rank (dp_replicate x dp_shard x cp: cp ranks hold the same weights);
        stages 2 and 3 are FSDP over dp_shard x cp, replicated across dp_replicate (HSDP)."""
        if self.zero_stage == 1:
            return self.dp * self.cp
        return self.dp_shard * self.cp

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """The mesh axes of shard_group, for placing its collectives."""
        return ("dp_replicate", "dp_shard", "cp") if self.zero_stage == 1 else ("dp_shard", "cp")


def engine_runs(plan: Plan, training) -> bool:
    """Whether shardwise's engine can run the plan (torch 2.13 limits its validation rejects, see
    config._validate_pp): zero-bubble with ZeRO-3 sharding or with selective recompute, fp16 with a pipeline."""
    if plan.pp > 1 and training.precision == "fp16":
        return False
    if plan.schedule == "zero-bubble":
        return not (plan.zero_stage == 3 and plan.dp_shard * plan.cp > 1) and plan.recompute != "selective"
    return True


def validate_plan(plan: Plan, world: int, global_batch: int, n_layers: int, n_heads: int) -> None:
    """Raise PlannerError (naming the --plan key) for a plan that cannot run."""
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
    if plan.zero_stage and plan.shard_group == 1:
        raise PlannerError("--plan zero_stage", f"ZeRO-{plan.zero_stage} has only one rank to shard over",
                           "set dp_replicate (ZeRO-1) or dp_shard (ZeRO-2/3) > 1, or zero_stage=0")
    if plan.dp_shard > 1 and plan.zero_stage < 2:
        raise PlannerError("--plan dp_shard", f"sharding over {plan.dp_shard} ranks is FSDP: zero_stage 2 or 3",
                           "set zero_stage=2 or 3, or use dp_replicate for ZeRO-0/1")
    if plan.pp == 1 and plan.schedule != "none":
        raise PlannerError("--plan schedule", "a schedule needs pp > 1", "drop schedule or set pp")
    if plan.pp > 1 and plan.schedule not in SCHEDULES:
        raise PlannerError("--plan schedule", f"{plan.schedule!r}", f"use one of {', '.join(SCHEDULES)}")
    if plan.virtual_stages > 1 and plan.schedule != "interleaved-1f1b":
        raise PlannerError("--plan virtual_stages", "only interleaved-1f1b has virtual stages",
                           "set schedule=interleaved-1f1b or virtual_stages=1")
    if plan.schedule == "interleaved-1f1b" and plan.grad_accum % plan.pp:
        raise PlannerError("--plan grad_accum", f"interleaved-1f1b needs micro-batches ({plan.grad_accum}) "
                           f"to be a multiple of pp={plan.pp}", "change the micro-batch or the global batch")
    if plan.sequence_parallel and plan.tp == 1:
        raise PlannerError("--plan sequence_parallel", "sequence parallelism shards across tp", "set tp > 1")
    if plan.recompute not in RECOMPUTE:
        raise PlannerError("--plan recompute", f"{plan.recompute!r}", f"use one of {', '.join(RECOMPUTE)}")
    if plan.offload not in OFFLOADS:
        raise PlannerError("--plan offload", f"{plan.offload!r}", f"use one of {', '.join(OFFLOADS)}")


_INT_KEYS = {"dp", "dp_replicate", "dp_shard", "tp", "pp", "cp", "zero_stage", "micro_batch", "grad_accum",
             "virtual_stages"}
_STR_KEYS = {"recompute", "schedule", "offload"}
_BOOL_KEYS = {"sequence_parallel", "sp"}


def parse_plan(text: str) -> dict:
    """'dp=32,tp=8,pp=4,recompute=full' -> {'dp': 32, ...}: the knobs a user fixed (the search picks the rest)."""
    fixed: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise PlannerError("--plan", f"'{item}' is not key=value", 'write e.g. --plan "dp=8,tp=2"')
        if key in _INT_KEYS:
            try:
                fixed[key] = int(value)
            except ValueError:
                raise PlannerError(f"--plan {key}", f"{value!r} is not an integer", f"write {key}=<integer>")
        elif key in _STR_KEYS:
            fixed[key] = value
        elif key in _BOOL_KEYS:
            if value.lower() not in ("true", "false", "1", "0"):
                raise PlannerError(f"--plan {key}", f"{value!r} is not a boolean", f"write {key}=true or false")
            fixed["sequence_parallel"] = value.lower() in ("true", "1")
        else:
            raise PlannerError("--plan", f"unknown key {key!r}",
                               f"use {', '.join(sorted(_INT_KEYS | _STR_KEYS | {'sequence_parallel'}))}")
    if "dp" in fixed and "dp_replicate" in fixed and "dp_shard" in fixed:
        if fixed["dp"] != fixed["dp_replicate"] * fixed["dp_shard"]:
            raise PlannerError("--plan dp", "dp != dp_replicate * dp_shard", "give dp or its two factors")
    return fixed
