"""A plan as a `shardwise train` config: the TOML the engine runs as is."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from shardwise.config import ConfigError, has_hf_weights, layout_tables, load_config, toml_value
from shardwise.hardware import PlannerError
from shardwise.layout import LAYOUT_KEYS, Layout
from shardwise.model_args import PRESETS, ModelArgs
from shardwise.planner.plan import Plan
from shardwise.planner.workload import Training


def hf_weights_folder(model: str) -> Path | None:
    """The Hugging Face folder `plan --model` names (the folder, or its config.json), if it holds weights: the run
    the plan is for fine-tunes them."""
    path = Path(model)
    folder = path.parent if path.name == "config.json" else path
    if folder.is_dir() and (folder / "config.json").is_file() and has_hf_weights(folder):
        return folder.resolve()
    return None


def plan_tables(args: ModelArgs, training: Training, plan: Plan, hf_folder: Path | None = None) -> dict[str, dict]:
    """Config tables for one plan: its layout and batch split as config.layout_tables maps them; with `hf_folder`
    (a model planned from a Hugging Face folder with weights), the run starts from those weights and reads text with
    the folder's tokenizer.json (where it has one)."""
    if plan.offload == "optimizer":
        raise PlannerError("--write-config", "the engine has no optimizer-only offload",
                           "pass --plan with offload=full or offload=none")
    _engine_runs(training)
    preset = PRESETS.get(args.name)
    model = {"name": args.name} if preset == args else dataclasses.asdict(args)
    layout = Layout(**{k: getattr(plan, k) for k in LAYOUT_KEYS})
    tables = layout_tables(layout, plan.micro_batch, plan.grad_accum)
    out = {"model": model, "data": {"seq_len": training.seq_len}, "optim": {"name": training.optimizer},
           "train": {"precision": training.precision, **tables["train"],
                     **({"compile": True} if training.compile else {})}, "parallel": tables["parallel"]}
    if training.lora_rank:
        out["lora"] = {"rank": training.lora_rank, "qlora": training.qlora, "targets": list(training.lora_targets),
                       **({"dropout": training.lora_dropout} if training.lora_dropout else {})}
    if hf_folder is not None:  # planned from the folder, the run fine-tunes its weights (it trained a random init)
        if (hf_folder / "tokenizer.json").is_file():
            out["data"]["tokenizer"] = str(hf_folder / "tokenizer.json")
        out["checkpoint"] = {"init_from_hf": str(hf_folder)}
    return out


def _engine_runs(training: Training) -> None:
    """Refuse a recipe the engine would not run as planned: a config never drops a knob the plan was priced with."""
    from shardwise.planner.system import SYSTEMS

    engine = SYSTEMS["shardwise"].training_fields()
    # (compile is a knob of the engine's: train.compile)
    differs = [k for k, v in engine.items() if k not in ("system", "compile") and getattr(training, k) != v
               and not (k == "fuse_head" and training.fuses_head == (training.layout == "torch"))]
    refusals = [  # another system first; then what a flag changed in shardwise's (its name says "shardwise (...)")
        (training.system.split(" (")[0] != "shardwise", "--system", f"the plan is sized for {training.system}, "
         "and shardwise's engine runs differently",
         f"plan with --system shardwise{' --compile' if training.compile else ''}"),
        (training.precision not in ("fp32", "bf16", "fp16"), "--precision",
         f"the engine trains in fp32, bf16 or fp16, not {training.precision}", "plan with --precision bf16"),
        (training.layout == "fsdp-mp", "--layout", "the engine runs FSDP2's mixed-precision policy as a plan knob, "
         "parallel.mixed_precision, not as a --layout", "plan without --layout, with --plan mixed_precision=fsdp"),
        (training.layout != "torch", "--layout", f"the engine stores state as torch does, not as {training.layout}",
         "plan with --layout torch"),
        (not training.fused_attention, "--attention", "the engine's attention is fused (SDPA)",
         "plan with --attention fused"),
        (training.dropout, "--dropout", "the engine's model has no dropout", "plan without --dropout"),
        (training.loss_parallel, "loss_parallel", "the engine gathers logits before the loss",
         "plan without loss_parallel"),
        (bool(differs), "--system", f"the engine runs {', '.join(f'{k} = {engine[k]}' for k in differs)}, not "
         f"{', '.join(f'{k} = {getattr(training, k)}' for k in differs)}", "plan with --system shardwise"),
    ]
    for refused, flag, problem, fix in refusals:
        if refused:
            raise PlannerError(f"--write-config {flag}", problem, fix)


def job_tables(job: dict, planned: dict[str, dict], training: Training) -> dict[str, dict]:
    """A job's own tables (`plan --model job.toml`) with what the plan decides put in: the whole [parallel], the
    batch split, train.precision, train.compile, data.seq_len, optim.name and the adapters' rank, NF4, targets and
    dropout. The rest is the job's (its data, learning rate and schedule, lora.alpha, steps, checkpoints,
    metrics): the config written for a 1-GPU job kept none of it, and trained the defaults."""
    out = {table: dict(values) if isinstance(values, dict) else values for table, values in job.items()}
    for table, values in planned.items():
        if table == "parallel" or table not in out:
            out[table] = dict(values)
        elif table != "model":  # the job's [model] is what was planned, as the job wrote it
            out[table].update(values)
    train = out["train"]
    if not training.compile:  # (plan_tables writes the knobs that are on)
        train.pop("compile", None)
    if not training.lora_dropout and "lora" in out:
        out["lora"].pop("dropout", None)
    if "global_batch" in train:  # the job's way of giving its batch, which also fixes it on an elastic world
        dp = out["parallel"]["dp_replicate"] * out["parallel"]["dp_shard"]
        train["global_batch"] = train["micro_batch"] * train.pop("grad_accum") * dp
    return out


def write_config(path: str | Path, args: ModelArgs, training: Training, plan: Plan,
                 hf_folder: Path | None = None, job: Path | None = None) -> str:
    """Write the plan's config and check that `shardwise train` accepts it (validation, not a run); with `job`
    (the shardwise TOML planned), the job's own settings with the plan's put in (job_tables). Returns a note for
    the user ('' when there is none)."""
    path = Path(path)
    tables = plan_tables(args, training, plan, hf_folder)
    # a run of its own folder that keeps what it trained: a fine-tune has something to export and a long run
    # something to resume (checkpoint.enabled's default, off, saved nothing, in the demo's runs/demo); a job's own
    # settings of either win
    defaults = {"metrics": {"out_dir": f"runs/{path.stem}"}, "checkpoint": {"enabled": True}}
    lines = [f"# written by `shardwise plan`: {plan.world} rank{'s' if plan.world > 1 else ''}"]
    if job is None:
        lines += ["# [data] reads the standard library's Python files with the byte tokenizer unless set (data.paths,",
                  "# data.tokenizer); a fine-tuning run names its Hugging Face weights with checkpoint.init_from_hf"]
    else:
        tables = job_tables(tomllib.loads(job.read_text()), tables, training)
        lines += [f"# planned from {job}: its settings, with the plan's [parallel], batch split, precision,",
                  "# compile, data.seq_len, optim.name and adapters"]
    for table, values in defaults.items():
        tables[table] = {**values, **tables.get(table, {})}
    for table, values in tables.items():
        lines += ["", f"[{table}]", *(f"{k} = {toml_value(v)}" for k, v in values.items())]
    draft = path.with_name(f".{path.name}.draft.toml")
    draft.write_text("\n".join(lines) + "\n")
    note = ""
    try:
        try:
            load_config(draft)  # raises ConfigError naming the field if the engine would refuse it
        except ConfigError as e:
            if job is None or e.field not in ELSEWHERE:
                raise
            # the job's files are its cluster's (as `plan` sized it): the rest is checked as train would
            load_config(draft, sizing=True)
            note = f"{e.field} is not on this machine ({e.problem}): the run's machines need it"
    except BaseException:
        draft.unlink()  # nothing is left at `path` that `shardwise train` would refuse
        raise
    draft.replace(path)
    return note


ELSEWHERE = ("data.paths", "data.tokenizer", "checkpoint.init_from_hf")
"""Fields naming files that a job planned here may keep on the cluster it runs on."""
