"""A plan as a `shardwise train` config: the TOML the engine runs as is."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from shardwise.config import load_config
from shardwise.hardware import PlannerError
from shardwise.model_args import PRESETS, ModelArgs
from shardwise.planner.plan import Plan
from shardwise.planner.workload import Training


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def plan_tables(args: ModelArgs, training: Training, plan: Plan) -> dict[str, dict]:
    """Config tables for one plan. The planner's micro-batches map onto the engine's as follows: without a
    pipeline, train.micro_batch x train.grad_accum as planned; with one, the engine runs all of a step's
    pipeline micro-batches in one schedule step, so train.micro_batch = micro_batch x grad_accum, cut into
    pp_microbatches = grad_accum pipeline micro-batches."""
    if plan.offload != "none":
        raise PlannerError("--write-config", f"the engine has no {plan.offload} offload yet",
                           "pass --plan with offload=none")
    if training.precision not in ("fp32", "bf16", "fp16"):
        raise PlannerError("--write-config", f"the engine trains in fp32, bf16 or fp16, not {training.precision}",
                           "plan with --precision bf16")
    preset = PRESETS.get(args.name)
    model = {"name": args.name} if preset == args else dataclasses.asdict(args)
    parallel = {"dp_replicate": plan.dp_replicate, "dp_shard": plan.dp_shard, "tp": plan.tp, "pp": plan.pp,
                "cp": plan.cp, "zero_stage": plan.zero_stage, "sequence_parallel": plan.sequence_parallel}
    train = {"precision": training.precision, "activation_checkpoint": plan.recompute}
    if plan.pp > 1:
        parallel |= {"pp_schedule": plan.schedule, "virtual_stages": plan.virtual_stages,
                     "pp_microbatches": plan.grad_accum}
        train |= {"micro_batch": plan.micro_batch * plan.grad_accum, "grad_accum": 1}
    else:
        train |= {"micro_batch": plan.micro_batch, "grad_accum": plan.grad_accum}
    return {"model": model, "data": {"seq_len": training.seq_len}, "train": train, "parallel": parallel}


def write_config(path: str | Path, args: ModelArgs, training: Training, plan: Plan) -> None:
    """Write the plan's config and check that `shardwise train` accepts it (validation, not a run)."""
    lines = [f"# written by `shardwise plan`: {plan.world} ranks"]
    for table, values in plan_tables(args, training, plan).items():
        lines += ["", f"[{table}]", *(f"{k} = {_toml_value(v)}" for k, v in values.items())]
    Path(path).write_text("\n".join(lines) + "\n")
    load_config(path)  # raises ConfigError naming the field if the engine would refuse it
