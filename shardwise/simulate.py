"""The simulator: one rank of a large job, run for real on one CPU, with fake tensors and a fake process group.

`shardwise simulate` builds the model on meta, joins a "fake" process group of the job's world size as one rank,
applies the real `parallelize()` (or cuts the real pipeline stages), materialises the parameters as fake
tensors (shapes without storage), and runs real training steps: forward, backward, optimizer step. A memory
tracker sees every tensor the step creates and frees, so the peak it reports is what that rank of the real
job would hold, by category; a `CommCounter` sees every collective. The planner's formula-based prediction
is printed beside each figure as measured / predicted.

Two steps are run when they differ: the first allocates the optimizer state (Adam's moments), the second is
the steady state. A pipeline is simulated as its first, a middle and its last stage (they hold different
layers, embedding, head and numbers of micro-batches in flight).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import multiprocessing
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.config import (
    ConfigError,
    JobConfig,
    autocast_precision,
    fit_world,
    layout_tables,
    load_config,
    planner_split,
    validate_model,
    validate_parallel,
    with_overrides,
)
from shardwise.data import Batch
from shardwise.distributed import DistEnv, fork_server
from shardwise.layout import Layout, complete_layout, parse_layout
from shardwise.model import materialize
from shardwise.moe import moe_layers
from shardwise.parallel.comm import TYPES, CommCounter
from shardwise.parallel.context_parallel import load_balanced_positions
from shardwise.parallel.mesh import MESH_DIMS, MeshView, build_mesh
from shardwise.parallel.pipeline import Pipeline, model_parts
from shardwise.parallel.runtime import Runtime
from shardwise.parallel.torch_private import (
    FakeTensors,
    build_tracker,
    fake_scalar,
    forget_sharding_caches,
    init_fake_process_group,
    initialize_pipeline,
    unanimous_pipeline_vote,
    untracked_sharding_propagation,
)
from shardwise.planner import Plan, PlannerError, Training, resolve_model, stage_memory
from shardwise.planner.memory import simulator_categories
from shardwise.planner.plan import partial_checkpoint_error
from shardwise.train import (
    build_grad_scaler,
    build_optimizer_for,
    build_training_model,
    pipeline_train_step,
    train_step,
)

GiB = 2**30
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "communication_buffers")
# the trackers' categories (torch.distributed._tools) -> ours. Buffers (the rotary table) count as parameters:
# both are model state that lives the whole run. FSDP's unsharded parameters and gradients exist only between
# an all-gather and the reshard / between backward and the reduce-scatter, so they are communication buffers.
# A pipeline's receive buffers (received activations and their gradients) are activations: the trackers are given
# them as "Inputs" (FSDP's) or "Other" (the generic one's, which files nothing else there).
_CATEGORY = {
    "Parameter": "parameters", "Sharded Param": "parameters", "Buffer": "parameters",
    "Gradient": "gradients", "Sharded Grad": "gradients",
    "Optstate": "optimizer_state", "OptState": "optimizer_state",
    "Activation": "activations", "Inputs": "activations", "Other": "activations",
    "Temp": "temporaries",
    "Unsharded Param": "communication_buffers", "Unsharded Grad": "communication_buffers",
    "All Gather": "communication_buffers", "Reduce Scatter": "communication_buffers",
}
_MODEL_STATE = {"Parameter": "parameters", "Sharded Param": "parameters", "Gradient": "gradients",
                "Sharded Grad": "gradients", "Optstate": "optimizer_state", "OptState": "optimizer_state"}


# ---------------------------------------------------------------------------------------------------
# What one step measures


@dataclass
class StepMeasure:
    """One training step of one rank, as the memory tracker and the collective counter saw it."""

    peak_bytes: int
    """Highest total of live tensor bytes during the step."""
    peak: dict[str, int]
    """That total split into CATEGORIES."""
    peak_detail: dict[str, int]
    """That total in the tracker's own categories (torch.distributed._tools)."""
    phase: str
    """When the peak happened: forward, backward, recompute or optimizer."""
    modules: list[str]
    """The innermost modules running at the peak."""
    model_state: dict[str, int]
    """Bytes of parameters (not buffers) and optimizer state held after the step, and of the largest set of
    gradients alive during it."""
    collectives: dict[str, dict[str, float]]
    """type -> calls, payload_bytes (the logical buffers) and wire_bytes (one rank's ring traffic)."""


def measure_step(model, optimizer, scaler, batches: list[Batch], cfg: JobConfig, runtime: Runtime) -> StepMeasure:
    """Run one real training step under a fresh memory tracker and collective counter (fake or real tensors)."""
    piped = isinstance(model, Pipeline)
    modules = model_parts(model)
    inner = getattr(optimizer, "inner", optimizer)  # ZeRO-1's ShardedOptimizer wraps a torch optimizer
    tracker = build_tracker(modules, inner, model.schedule if piped else None)
    counter = _StepCounter()
    tokens = cfg.train.micro_batch * cfg.train.grad_accum * runtime.dp_size * cfg.data.seq_len
    with untracked_sharding_propagation(tracker), tracker, counter:
        if piped:
            pipeline_train_step(model, optimizer, scaler, batches, grad_clip=cfg.optim.grad_clip,
                                global_tokens=tokens, runtime=runtime)
        else:
            train_step(model, optimizer, scaler, batches, device=runtime.device, precision=autocast_precision(cfg),
                       grad_clip=cfg.optim.grad_clip, global_tokens=tokens, runtime=runtime)
    return _summarise(tracker, counter)


def _summarise(tracker, counter: CommCounter) -> StepMeasure:
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    detail = {_name(k): int(v) for k, v in snapshot.items() if _name(k) != "Total" and v}
    peak = dict.fromkeys(CATEGORIES, 0)
    for name, value in detail.items():
        peak[_CATEGORY.get(name, "temporaries")] += value
    stats = counter.stats
    collectives = {kind: {"calls": stats.calls[kind], "payload_bytes": stats.payload[kind],
                          "wire_bytes": stats.wire[kind]} for kind in TYPES if stats.calls.get(kind)}
    # weights and optimizer state as they persist between steps (without FSDP/replicate's unsharded copies and
    # the optimizer step's temporaries); gradients as the largest set alive (zero_grad frees them each step)
    state = _model_state(tracker.category_max)
    end = _model_state({_name(k): int(v) for k, v in
                        next(iter(tracker.get_tracker_snapshot("current").values()), {}).items()
                        if _name(k) in _MODEL_STATE})
    state["parameters"], state["optimizer_state"] = end["parameters"], end["optimizer_state"]
    return StepMeasure(sum(detail.values()), peak, detail, tracker.moment.phase, tracker.moment.modules, state,
                       collectives)


class _StepCounter(CommCounter):
    """CommCounter that also answers `.item()` of a fake tensor (see torch_private.fake_scalar): one dispatch
    mode instead of two, since every op of the step pays for each mode on the stack."""

    def __init__(self):
        super().__init__()
        self.fake_scalar = fake_scalar

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        value = self.fake_scalar(func, args)
        return value if value is not None else super().__torch_dispatch__(func, types, args, kwargs)


def _model_state(category_max: dict[str, int]) -> dict[str, int]:
    out = dict.fromkeys(("parameters", "gradients", "optimizer_state"), 0)
    for name, value in category_max.items():
        out[_MODEL_STATE[name]] += value
    return out


def _name(key) -> str:
    return key.value if hasattr(key, "value") else str(key)


# ---------------------------------------------------------------------------------------------------
# One simulated rank


@dataclass
class RankReport:
    rank: int
    coordinates: dict[str, int]
    """This rank's position on each mesh dim (pp, dp_replicate, dp_shard, cp, tp)."""
    steps: list[StepMeasure]
    """The steps run (two when the first differs from the second, e.g. Adam allocating its state)."""
    planner: dict[str, float] = field(default_factory=dict)
    """The planner's prediction for this rank's pipeline stage, in CATEGORIES plus 'total'."""

    @property
    def peak_step(self) -> StepMeasure:
        return max(self.steps, key=lambda s: s.peak_bytes)

    def ratios(self) -> dict[str, float | None]:
        """Measured / predicted per category and for the total (None where the planner predicts 0)."""
        peak = self.peak_step
        measured = {**peak.peak, "total": peak.peak_bytes}
        return {k: (measured[k] / self.planner[k] if self.planner.get(k) else None) for k in measured}

    def to_json(self) -> dict:
        peak = self.peak_step
        return {
            "rank": self.rank, "coordinates": self.coordinates, "peak_bytes": peak.peak_bytes,
            "peak": peak.peak, "peak_detail": peak.peak_detail,
            "moment": {"step": self.steps.index(peak) + 1, "phase": peak.phase, "modules": peak.modules},
            "model_state": peak.model_state, "collectives": self.steps[-1].collectives,
            "steps": [asdict(s) for s in self.steps],
            "planner": {k: round(v) for k, v in self.planner.items()}, "ratio": self.ratios(),
        }


def simulate_rank(cfg: JobConfig, world: int, rank: int, first_step: bool = False) -> RankReport:
    """Join a fake process group of `world` ranks as `rank`, build this rank's model, measure its steps.

    Default: the steady-state step only. The optimizer's state (Adam's moments) is allocated first by an
    untracked optimizer step on zero gradients, so the one measured step holds everything a later step of
    the real run holds; a real first step holds the same minus that state until its optimizer step, so its
    peak is no higher. first_step=True measures the real first step from a fresh optimizer and then the
    second (kept if it differs): the same answer, one more simulated forward and backward.
    """
    init_fake_process_group(rank, world)
    try:
        runtime = build_fake_runtime(cfg, rank, world)
        fakes = FakeTensors()
        # FSDP's build makes millions of small objects (N chunks of every parameter): keep the garbage
        # collector off while it does, then exempt them from its full passes (one in eight of the step's time)
        gc.disable()
        model, optimizer, scaler, batches = build_step_inputs(cfg, runtime, fakes)
        gc.enable()
        gc.freeze()
        with fakes, unanimous_pipeline_vote(), gpu_dropout():
            if not first_step:
                allocate_optimizer_state(model, optimizer)
                if isinstance(model, Pipeline):
                    initialize_pipeline(model.schedule)
            steps = [measure_step(model, optimizer, scaler, batches, cfg, runtime)]
            if first_step:
                second = measure_step(model, optimizer, scaler, batches, cfg, runtime)
                if _differs(steps[0], second):
                    steps.append(second)
        coordinates = {d: runtime.mesh.coordinate(d) for d in MESH_DIMS}
        return RankReport(rank, coordinates, steps)
    finally:
        gc.enable()
        gc.unfreeze()
        dist.destroy_process_group()
        forget_sharding_caches()


@contextlib.contextmanager
def gpu_dropout():
    """Dropout as the GPU job runs it. On CUDA, at::dropout takes the fused kernel (native_dropout: its
    is_fused_kernel_acceptable), whose backward keeps a one-byte mask; on a CPU it multiplies by a noise tensor in
    the input's dtype and keeps that (four bytes an element of an fp32 input). The simulator measures the GPU job,
    so nn.Dropout (F.dropout: LoRA's lora.dropout) runs native_dropout here, as on the GPU."""
    cpu_dropout = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or not 0 < p < 1 or input.numel() == 0:  # what CUDA leaves to at::dropout's other path
            return cpu_dropout(input, p, training, inplace)
        out = torch.native_dropout(input, p, True)[0]
        return input.copy_(out) if inplace else out

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = cpu_dropout


@torch.no_grad()
def allocate_optimizer_state(model, optimizer) -> None:
    """Let the optimizer create its state as its first step does: one step on zero gradients, then none."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _differs(a: StepMeasure, b: StepMeasure) -> bool:
    return (a.peak_bytes, a.peak, a.collectives) != (b.peak_bytes, b.peak, b.collectives)


def build_fake_runtime(cfg: JobConfig, rank: int, world: int) -> Runtime:
    """The Runtime `Runtime.create` would build on that rank, over the fake process group already joined."""
    p = cfg.parallel
    mesh = MeshView(build_mesh(p, "cpu"), p)
    # sub-meshes create process groups: make them now, not lazily inside fake mode (whose tensors they can't read)
    for name in ("tp", "cp", "pp", "grad_reduce", "fsdp"):
        getattr(mesh, name)
    runtime = Runtime(DistEnv(rank, world, 0, torch.device("cpu")), cfg, mesh)
    if p.cp > 1:
        runtime.positions = load_balanced_positions(cfg.data.seq_len, p.cp, mesh.coordinate("cp"))
    return runtime


def fake_materializer(fakes) -> Callable:
    """`model.materialize` for the trainer's builders, making storage-less fake tensors (under `fakes`) without
    initial values: drawing them (and slicing each into its shards) costs time and changes no byte the step
    allocates. parallelize() runs before, outside fake mode (it only reshapes meta tensors)."""
    def materialize_fake(module, args, device, seed):
        with fakes:
            materialize(module, args, device, seed, init_values=False)

    return materialize_fake


def build_step_inputs(cfg: JobConfig, runtime: Runtime, fakes=None):
    """Model (or pipeline), optimizer, grad scaler and one step's micro-batches, as the trainer builds them."""
    model = build_training_model(cfg, runtime, materialize if fakes is None else fake_materializer(fakes))
    if fakes is not None:
        state_balanced_routing(model_parts(model), grouped_mm=cfg.train.precision == "bf16")
    optimizer, _ = build_optimizer_for(model, cfg, runtime, cfg.optim.lr)
    scaler = build_grad_scaler(cfg.train, runtime.device)
    shape = (cfg.train.micro_batch, cfg.data.seq_len)
    batches = [Batch(torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long), None)
               for _ in range(cfg.train.grad_accum)]
    return model, optimizer, scaler, batches


def balanced_load(pairs: int, n_experts: int) -> list[int]:
    """(token, expert) pairs spread as evenly as whole numbers allow: the first pairs % n_experts get one more."""
    base, extra = divmod(pairs, n_experts)
    return [base + (i < extra) for i in range(n_experts)]


def state_balanced_routing(parts, grouped_mm: bool) -> None:
    """Fake tensors hold no router scores to route by: every MoE layer, on every rank, is given the balanced
    load (what the balancing losses aim at; the planner prices a stated imbalance on top). The experts run as
    on a GPU: one grouped GEMM in bf16 (torch's fake kernel takes no other dtype), else the loop."""
    for moe in moe_layers(parts):
        moe.stated_load = functools.partial(balanced_load, n_experts=moe.n_experts)
        moe.experts.stated_load = True
        moe.experts.use_grouped_mm = grouped_mm


# ---------------------------------------------------------------------------------------------------
# A whole simulation


def ranks_to_simulate(p: Layout, world: int) -> list[int]:
    """Rank 0, or for a pipeline the first rank of its first, middle and last stage (pp is the outermost dim)."""
    per_stage = world // p.pp
    return sorted({s * per_stage for s in (0, p.pp // 2, p.pp - 1)})


def simulate(cfg: JobConfig, world: int, ranks: list[int] | None = None, first_step: bool = False,
             processes: int = 1, start_method: str = "forkserver", announce: bool = False) -> list[RankReport]:
    """Simulate the given ranks (default: `ranks_to_simulate`) and attach the planner's prediction to each
    (`announce`: say on stderr what is about to run, before the wait).

    processes > 1 simulates several ranks at once, each in its own process (a pipeline's stages are
    independent simulations); worth it for large models, where a rank takes far longer than starting Python.
    processes = 0: all of them at once. On 2 cores, 3 ranks of 30 s each end after ~50 s that way, and after
    ~60 s two at a time (the third waits for a whole rank). start_method: how those processes start
    (multiprocessing's): "forkserver" (shardwise.distributed.fork_server: forked from a server that imported
    torch and shardwise once and ran nothing), "spawn" imports them again in each (~5 s of CPU apiece); the CLI,
    a fresh process that has run nothing yet, forks them itself (a fork of a process that has run torch ops or
    collectives would copy its thread pools half-alive).
    """
    validate_model(cfg)
    if cfg.parallel.world_size != world:  # (validate_parallel's fix, "launch N processes", is not simulate's)
        raise ConfigError("--world", f"the config's degrees multiply to {cfg.parallel.world_size} ranks, not {world}",
                          f"give --world {cfg.parallel.world_size}, or degrees that multiply to {world}")
    validate_parallel(cfg, world)
    _check_simulable(cfg)
    ranks = ranks if ranks is not None else ranks_to_simulate(cfg.parallel, world)
    for rank in ranks:
        if not 0 <= rank < world:
            raise ConfigError("--rank", f"{rank} is not in 0..{world - 1}", "pick a rank of the world")
    if announce:
        # a large model's forward and backward on fake tensors takes seconds to minutes on a CPU, once per
        # micro-batch: say so before the wait (a planner config with 64 micro-batches ran 10 minutes unannounced)
        micro = cfg.train.grad_accum * (cfg.parallel.pp_microbatches or cfg.parallel.pp)
        steps = "the first two training steps" if first_step else "one training step"
        print(f"shardwise simulate: {len(ranks)} rank(s) of {world}, each {steps} of {micro} micro-batch(es) on "
              "fake tensors...", file=sys.stderr, flush=True)
    processes = processes or len(ranks)
    if processes > 1 and len(ranks) > 1:
        context = fork_server() if start_method == "forkserver" else multiprocessing.get_context(start_method)
        with ProcessPoolExecutor(min(processes, len(ranks)), mp_context=context) as pool:
            reports = list(pool.map(simulate_rank, *zip(*[(cfg, world, r, first_step) for r in ranks])))
    else:
        reports = [simulate_rank(cfg, world, rank, first_step) for rank in ranks]
    for report in reports:
        report.planner = planner_prediction(cfg, report.coordinates.get("pp", 0))
    return reports


def _check_simulable(cfg: JobConfig) -> None:
    """Refuse what fake tensors cannot show, rather than print ratios that mean nothing."""
    if cfg.optim.name in ("adamw8bit", "adamw4bit"):
        # torchao's update is torch.compile'd, and eager it reads the block scales' values (.item())
        raise ConfigError("optim.name", f"{cfg.optim.name}'s step (torchao) cannot run on fake tensors",
                          "simulate with optim.name = 'adamw'; its state bytes are checked on real tensors "
                          "(tests/test_optim.py)")
    if cfg.parallel.offload != "none":
        raise ConfigError("parallel.offload", "the simulated ranks run on the host, where offloaded state would "
                          "be counted as the device's", "simulate with parallel.offload = 'none'")


def planner_prediction(cfg: JobConfig, stage: int, moment: str | None = None) -> dict[str, float]:
    """The planner's itemised peak for this layout and stage (or its `moment`, one of memory.MOMENTS), in the
    simulator's categories.

    Allowances for what is not tensors (fragmentation, CUDA context) are set to 0: the tracker counts tensors.
    Empty where the planner does not price the layout: checkpointing every k-th block of a mixture of experts or
    under zero-bubble (plan.partial_checkpoint_error; it was once printed as if every block were checkpointed).
    """
    p, t = cfg.parallel, cfg.train
    training = Training(seq_len=cfg.data.seq_len, global_batch=t.micro_batch * t.grad_accum * p.dp,
                        precision=t.precision, optimizer=cfg.optim.name, layout="torch",
                        lora_rank=cfg.lora.rank, qlora=cfg.lora.qlora, lora_targets=tuple(cfg.lora.targets),
                        lora_dropout=cfg.lora.dropout if cfg.lora.rank else 0.0,
                        ddp_bucket_mb=p.bucket_mb, fragmentation=0.0, fixed_overhead_gib=0.0,
                        expert_imbalance=1.0)  # the load state_balanced_routing gives every MoE layer
    micro_batch, grad_accum = planner_split(p, t.micro_batch, t.grad_accum)
    plan = Plan(**dataclasses.asdict(p), micro_batch=micro_batch, grad_accum=grad_accum)
    if partial_checkpoint_error(plan, training, cfg.model) is not None:
        return {}
    return simulator_categories(stage_memory(cfg.model, training, plan, stage, moment))


# ---------------------------------------------------------------------------------------------------
# Command line


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--config", help="a training TOML (the one `train` takes); or give --model and --plan")
    a("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
      help="override a config field, e.g. --set parallel.tp=8 (repeatable)")
    a("--model", help="a model preset (e.g. llama3-70b), Hugging Face config.json or shardwise TOML")
    a("--plan", help='the planner\'s plan keys, e.g. "tp=8,pp=4,dp=32,zero_stage=3"')
    a("--world", type=int, default=0, help="ranks in the job (with --config, default: the product of its degrees; "
      "with --model, required)")
    a("--rank", type=int, action="append", help="simulate this rank (repeatable; default: rank 0, or the first "
                                                "rank of the first, a middle and the last pipeline stage)")
    a("--seq-len", type=int, default=0, help="tokens per sequence (--model: default min(4096, model max), as "
      "`shardwise plan`)")
    a("--micro-batch", type=int, default=0, help="sequences per micro-batch (--model: default 1)")
    a("--precision", choices=("fp32", "bf16", "fp16"), default=None, help="--model: default bf16")
    a("--first-step", action="store_true", help="also simulate the first step from a fresh optimizer (slower; "
                                                "by default only the steady-state step, whose peak is no lower)")
    a("--processes", type=int, default=0,
      help="simulate up to this many ranks at once, each in its own process (default 0: every rank at once; "
           "ranks outnumbering the cores share them, which still ends sooner than queueing whole ranks)")
    a("--json", action="store_true", help="print the reports as JSON (see docs/simulator.md)")


def run_simulate(args: argparse.Namespace) -> int:
    try:
        cfg, world = config_from_args(args)
        start = time.perf_counter()
        fork = "fork" in multiprocessing.get_all_start_methods()
        reports = simulate(cfg, world, args.rank, args.first_step, processes=args.processes,
                           start_method="fork" if fork else "spawn", announce=True)
    except ConfigError as e:
        print(f"shardwise: error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps(to_json(cfg, world, reports, seconds), indent=2))
    else:
        print(format_reports(cfg, world, reports, seconds))
    return 0


def config_from_args(args: argparse.Namespace) -> tuple[JobConfig, int]:
    """The job config and world size from --config/--set or from --model/--plan."""
    for flag, value in (("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch), ("--world", args.world)):
        if value < 0:  # 0: the default
            raise ConfigError(flag, f"{value} < 0", "pass a positive number, or leave it out for the default")
    if args.config or not args.model:
        if args.plan:
            raise ConfigError("--plan", "goes with --model", "give --model NAME --plan ..., or a --config")
        cfg = load_config(args.config, args.overrides, sizing=True)  # its data need not be on this machine
        if args.seq_len or args.micro_batch or args.precision:
            raise ConfigError("--seq-len", "--seq-len/--micro-batch/--precision go with --model",
                              "use --set data.seq_len=... with --config")
        if args.world:  # data parallelism fills the world, as `train --nproc` fills it
            fit_world(cfg, args.world)
    else:
        cfg = config_from_plan(args.model, args.plan or "", args.world, args.seq_len,
                               args.micro_batch or 1, args.precision or "bf16", beyond_context=False)
        if args.overrides:  # the recipe beyond the layout: --set lora.rank=16, --set optim.name=adamw8bit, ...
            cfg = with_overrides(cfg, args.overrides)
    return cfg, args.world or cfg.parallel.world_size


def config_from_plan(model: str, plan: str, world: int, seq_len: int, micro_batch: int,
                     precision: str, beyond_context: bool = True) -> JobConfig:
    """A JobConfig for `--model NAME --plan KEYS`: the layout the keys mean (shardwise.layout's parser and
    defaults) on the planner's batch split, as `shardwise plan --write-config` writes it (config.layout_tables).
    `seq_len` 0: `shardwise plan`'s default, min(4096, the model's max_seq_len). `beyond_context` False refuses a
    `seq_len` over the model's max_seq_len, as `plan --seq-len` and `train` do; True raises max_seq_len to it."""
    if not world:
        raise ConfigError("--world", "missing", "give --world N with --model")
    fixed = parse_layout(plan, "--plan")
    layout = complete_layout(fixed, world, source="--plan")
    try:
        args = resolve_model(model)
    except PlannerError as e:
        raise ConfigError(e.field, *str(e).removeprefix(f"{e.field}: ").rsplit("; fix: ", 1)) from None
    seq_len = seq_len or min(4096, args.max_seq_len)  # as plan's --seq-len, so that both size the same job
    if seq_len > args.max_seq_len and not beyond_context:
        raise ConfigError("--seq-len", f"{seq_len} exceeds the model's max_seq_len {args.max_seq_len}",
                          "shorten it or use a model config with a longer context")
    # a pipeline's accumulation is its micro-batches: default one per stage
    accum = fixed.get("grad_accum", layout.pp if layout.pp > 1 else 1)
    tables = layout_tables(layout, micro_batch, accum)
    cfg = JobConfig()
    cfg.model = dataclasses.replace(args, max_seq_len=max(args.max_seq_len, seq_len))
    cfg.data.seq_len = seq_len
    cfg.train = dataclasses.replace(cfg.train, precision=precision, **tables["train"])
    cfg.parallel = Layout(**tables["parallel"])
    return cfg


def to_json(cfg: JobConfig, world: int, reports: list[RankReport], seconds: float) -> dict:
    p = cfg.parallel
    layout = {k: getattr(p, k) for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "zero_stage",
                                         "sequence_parallel")}
    if p.pp > 1:
        layout.update(pp_schedule=p.pp_schedule, pp_microbatches=p.n_microbatches)
    return {"model": cfg.model.name, "world": world, "layout": layout, "seq_len": cfg.data.seq_len,
            "micro_batch": cfg.train.micro_batch, "grad_accum": cfg.train.grad_accum,
            "precision": cfg.train.precision, "activation_checkpoint": cfg.parallel.activation_checkpoint,
            "seconds": round(seconds, 2), "ranks": [r.to_json() for r in reports]}


def _ratio(r: float | None) -> str:
    return "      -" if r is None else f"{r:7.2f}"


def format_reports(cfg: JobConfig, world: int, reports: list[RankReport], seconds: float) -> str:
    p = cfg.parallel
    dims = ", ".join(f"{d}={getattr(p, d)}" for d in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep")
                     if getattr(p, d) > 1)
    # a pipeline cuts train.micro_batch into pp_microbatches (the planner's micro-batch x accumulation)
    split = (f"micro-batch {cfg.train.micro_batch} cut into {p.pp_microbatches or p.pp} pipeline micro-batches"
             if p.pp > 1 else f"micro-batch {cfg.train.micro_batch}")
    lines = [f"simulated {cfg.model.name} on {world} ranks ({dims or 'one rank'}, ZeRO-{p.zero_stage}), "
             f"seq {cfg.data.seq_len} x {split} x accum {cfg.train.grad_accum}, "
             f"{cfg.train.precision}, {len(reports)} rank(s) in {seconds:.1f} s"]
    for r in reports:
        lines += [""] + _format_rank(r, p)
    return "\n".join(lines)


def _format_rank(r: RankReport, p: Layout) -> list[str]:
    peak, ratios = r.peak_step, r.ratios()
    unit, div = ("GiB", GiB) if peak.peak_bytes >= GiB else ("MiB", 2**20)
    coords = ", ".join(f"{k}={v}" for k, v in r.coordinates.items() if getattr(p, k) > 1)
    where = peak.phase + (f" in {', '.join(peak.modules[:3])}" if peak.modules else
                          "" if peak.phase == "optimizer" else ", outside every module (loss or clipping)")
    lines = [f"rank {r.rank} ({coords or 'alone'}): peak {peak.peak_bytes / div:.3f} {unit} in step "
             f"{r.steps.index(peak) + 1} of {len(r.steps)}, during {where}",
             f"  {'category':24}{unit:>9}  {'planner':>9}  {'ratio':>7}"]
    for k in (*CATEGORIES, "total"):
        measured = peak.peak_bytes if k == "total" else peak.peak[k]
        planned = f"{r.planner.get(k, 0.0) / div:9.3f}" if r.planner else f"{'-':>9}"
        lines.append(f"  {k:24}{measured / div:9.3f}  {planned}  {_ratio(ratios[k])}")
    if not r.planner and p.activation_checkpoint != "none" and p.activation_checkpoint_every != 1:
        lines.append(f"  planner: not compared (it does not price checkpointing of one block in "
                     f"{p.activation_checkpoint_every} of a mixture of experts or under zero-bubble: "
                     "parallel.activation_checkpoint_every)")
    lines.append("  model state (weights and optimizer state kept between steps, largest gradients): " +
                 ", ".join(f"{k} {v / div:.3f} {unit}" for k, v in peak.model_state.items()))
    lines.append(f"  {'collective':24}{'calls':>7}  {'payload ' + unit:>12}  {'wire ' + unit:>9}")
    for kind, c in r.steps[-1].collectives.items():
        lines.append(f"  {kind:24}{c['calls']:7d}  {c['payload_bytes'] / div:12.3f}  {c['wire_bytes'] / div:9.3f}")
    return lines


# Starts the command in a child of its own, forked from this small interpreter, and reports that child's rusage on
# stderr's last line. A process started from a large one (a test suite) carries the large one's resident size into
# its own peak: exec records the replaced memory's high-water mark in the process's maxrss. A fork starts a new
# maxrss; forked from this interpreter, the command's counts only what it and its ranks held.
_MEASURE = """
import json, os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
_, status, usage = os.wait4(pid, 0)
print(json.dumps([usage.ru_utime + usage.ru_stime, usage.ru_maxrss]), file=sys.stderr)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def measured_run(model: str, world: int, plan: str, seq_len: int = 8192) -> dict:
    """`shardwise simulate --json` for one plan (every simulated rank at once, as a user runs it), with what the
    command cost: CPU seconds over it and its rank processes, wall seconds, and max_rss_gib, a bound on the RAM
    they held at once (each of them counted at the largest one's peak). For benchmarks and tests."""
    cmd = [sys.executable, "-c", _MEASURE, "-m", "shardwise.simulate", "--model", model, "--world", str(world),
           "--plan", plan, "--seq-len", str(seq_len), "--micro-batch", "1", "--precision", "bf16", "--json"]
    wall = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - wall
    if proc.returncode:
        raise RuntimeError(f"simulating {model} x {world} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout)
    # wait4 in the child: the rusage of the command and the processes it waited for (its ranks)
    cpu_s, max_rss_kib = json.loads(proc.stderr.strip().splitlines()[-1])
    result["cpu_s"] = cpu_s
    result["wall_s"] = wall
    result["max_rss_gib"] = (1 + len(result["ranks"])) * max_rss_kib / 2**20  # the command and its ranks
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise simulate", description=__doc__.split("\n")[0])
    add_simulate_arguments(parser)
    return run_simulate(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
