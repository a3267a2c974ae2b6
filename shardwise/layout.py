"""The parallel layout, written once: the degrees and the knobs that go with them (`Layout`, the `[parallel]` table of
a job), read from a string such as "dp_shard=2,tp=2" by one parser with one set of defaults, and where its pieces
go: which layers each pipeline stage runs and which stages each rank holds.

The trainer, the planner (its `Plan` is a Layout and a batch split), the simulator and `shardwise verify` all use
this module. No torch here: the planner sizes and times layouts without building anything.

Mesh order, outermost to innermost (torchtitan's): pp, dp_replicate, dp_shard, cp, tp. tp is innermost so it lands
inside a node; pp outermost so its point-to-point traffic is what crosses the slowest links.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import typing
from dataclasses import dataclass
from typing import Literal

from shardwise.errors import ConfigError
from shardwise.model_args import ModelArgs, mlp_params

Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"]
Recompute = Literal["none", "full", "selective"]
Offload = Literal["none", "optimizer", "full"]
MixedPrecision = Literal["autocast", "fsdp"]


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    """Data-parallel replicas: ZeRO-0/1 data parallelism, or the replicate dim of HSDP (ZeRO-2/3)."""
    dp_shard: int = 1
    """Data-parallel ranks that shard state (FSDP; needs zero_stage 2 or 3)."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row split inside each block); innermost mesh dim."""
    pp: int = 1
    """Pipeline-parallel stages (ranks); outermost mesh dim."""
    cp: int = 1
    """Context-parallel degree: the sequence is split across this many ranks."""
    ep: int = 1
    """Expert-parallel degree: a mixture of experts' experts split over this many ranks, drawn from the dp_shard x
    cp ranks (as torchtitan): it adds no ranks, needs ZeRO-2/3, and FSDP shards the experts over the
    dp_shard x cp / ep ranks that remain. (The planner also prices Megatron-Core's, drawn from the tp x cp x dp
    ranks at ZeRO-0/1: expert_parallel_error's moe_layer.)"""
    zero_stage: int = -1
    """0: replicated (DDP), 1: + optimizer state sharded, 2: + gradients sharded, 3: + parameters sharded. Left
    unset: 3 when dp_shard > 1 (FSDP's default) or ep > 1 (the engine's expert parallelism needs FSDP), else 0."""
    sequence_parallel: bool = False
    """With tp > 1: norms and residuals hold a 1/tp slice of the sequence (Korthikanti et al. 2022)."""
    pp_schedule: Schedule = "1f1b"
    """Pipeline schedule; interleaved-1f1b runs virtual_stages (default 2) stages per rank, zero-bubble 2 (a V)."""
    pp_microbatches: int = 0
    """Pipeline micro-batches each train.micro_batch is cut into; 0 means pp x stages per rank."""
    virtual_stages: int = 0
    """Pipeline stages per rank (model chunks) for interleaved-1f1b; 0: its default, 2 (1 for other schedules)."""
    activation_checkpoint: Recompute = "none"
    """Recompute in backward what forward would keep: none, full (keep block inputs), selective (keep matmul
    outputs, recompute the cheap elementwise work; Korthikanti et al. 2022)."""
    activation_checkpoint_every: int = 1
    """Checkpoint every k-th block (1: all of them)."""
    offload: Offload = "none"
    """Keep all model state in host memory and step the optimizer there: 'full' (FSDP2's CPUOffloadPolicy; needs
    zero_stage 2 or 3, on one device too). 'optimizer' (only the optimizer state) is priced by the planner but
    the engine has no implementation of it."""
    bucket_mb: float = 25.0
    """ZeRO-0/1: gradients are all-reduced in buckets of about this many MB, overlapped with backward."""
    mixed_precision: MixedPrecision = "autocast"
    """How bf16 (train.precision) runs where FSDP shards the weights. 'autocast': fp32 weights gathered and cast at
    each matmul, the residual stream in fp32 (and every other layout runs so). 'fsdp': FSDP2's
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), torchtitan's default: the shards, the optimizer and
    checkpoints stay fp32, all-gathers carry bf16 (half the bytes), forward and backward run in bf16 (the residual
    stream too), gradients are reduced in fp32. Needs train.precision = 'bf16' and FSDP sharding (zero_stage 2/3
    over dp_shard x cp > 1)."""

    def __post_init__(self):
        # the defaults that depend on other fields, resolved once so that every reader sees the same layout
        if self.zero_stage == -1:
            object.__setattr__(self, "zero_stage", default_zero_stage(self.dp_shard, self.ep))
        if self.virtual_stages == 0:
            interleaved = self.pp > 1 and self.pp_schedule == "interleaved-1f1b"
            object.__setattr__(self, "virtual_stages", 2 if interleaved else 1)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def stages_per_rank(self) -> int:
        """Model chunks per pipeline rank: two for zero-bubble (its V), virtual_stages otherwise."""
        return 2 if self.pp_schedule == "zero-bubble" else self.virtual_stages

    @property
    def n_microbatches(self) -> int:
        return self.pp_microbatches or self.pp * self.stages_per_rank

    @property
    def shard_group(self) -> int:
        """Ranks that split model state: ZeRO-1 shards the optimizer over every data-parallel rank (dp_replicate x
        dp_shard x cp: cp ranks hold the same weights); ZeRO-2/3 are FSDP over dp_shard x cp, replicated across
        dp_replicate (HSDP)."""
        if self.zero_stage == 1:
            return self.dp * self.cp
        return self.dp_shard * self.cp

    @property
    def expert_shard_group(self) -> int:
        """Ranks FSDP shards each expert's state over (ep ranks hold different experts). Under ZeRO-0/1 (the
        planner's pricing of Megatron-Core's expert parallelism: ep drawn from the tp x cp x dp ranks, expert
        tensor parallelism 1) the ranks holding the same experts, over which ZeRO-1 shards their optimizer state
        and their gradients are reduced (its expert-data-parallel group)."""
        if self.ep == 1:
            return self.shard_group
        return (self.tp * self.cp * self.dp if self.zero_stage < 2 else self.shard_group) // self.ep

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """The mesh axes of shard_group, for placing its collectives."""
        return ("dp_replicate", "dp_shard", "cp") if self.zero_stage == 1 else ("dp_shard", "cp")


LAYOUT_KEYS = tuple(f.name for f in dataclasses.fields(Layout))
BATCH_KEYS = ("micro_batch", "grad_accum")
"""The batch split a layout string may also fix: the [train] fields of those names."""


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def layout_text(layout: Layout, micro_batch: int, grad_accum: int) -> str:
    """The layout string that `parse_layout` and `complete_layout` read back as `layout` and this batch split, and
    that `shardwise plan --plan` takes as the whole plan (it searches the keys left out): the degrees, ZeRO stage,
    recompute and offload always, a pipeline's schedule and tp's sequence parallelism where they apply (a schedule
    without a pipeline is refused, for one), and every other key where it is not the default."""
    default = Layout()
    always = ["dp_replicate", "dp_shard", "tp", "pp", "cp", "zero_stage", "activation_checkpoint", "offload"]
    always += ["pp_schedule", "virtual_stages"] if layout.pp > 1 else []
    always += ["sequence_parallel"] if layout.tp > 1 else []
    always += ["mixed_precision"] if layout.zero_stage >= 2 else []
    keys = [k for k in LAYOUT_KEYS if k in always or getattr(layout, k) != getattr(default, k)]
    return ",".join([*(f"{k}={_text(getattr(layout, k))}" for k in keys),
                     f"micro_batch={micro_batch}", f"grad_accum={grad_accum}"])


def _typed(key: str, value: str, hint, source: str):
    if hint is bool:
        if value.lower() not in ("true", "false", "1", "0"):
            raise ConfigError(f"{source} {key}", f"{value!r} is not a boolean", f"write {key}=true or false")
        return value.lower() in ("true", "1")
    if hint is int or hint is float:
        try:
            return hint(value)
        except ValueError:
            kind = "a whole number" if hint is int else "a number"
            raise ConfigError(f"{source} {key}", f"{value!r} is not {kind}",
                              f"write {key}=<{hint.__name__}>") from None
    choices = typing.get_args(hint)
    if value not in choices:
        raise ConfigError(f"{source} {key}", f"{value!r} is not a choice", f"use one of {', '.join(choices)}")
    return value


def parse_layout(text: str, source: str = "--layout") -> dict:
    """'dp_shard=2,tp=2,pp_schedule=gpipe' -> {'dp_shard': 2, 'tp': 2, 'pp_schedule': 'gpipe'}: the keys a user
    fixed, typed. Keys: the [parallel] fields (Layout), dp (data-parallel ranks, placed by `complete_layout`), and
    micro_batch and grad_accum (the [train] batch split)."""
    hints = typing.get_type_hints(Layout) | {"dp": int, "micro_batch": int, "grad_accum": int}
    fixed: dict = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            raise ConfigError(source, f"'{item}' is not key=value", f'write e.g. {source} "dp_shard=2,tp=2"')
        if key not in hints:
            raise ConfigError(source, f"unknown key {key!r}", f"use {', '.join(['dp', *LAYOUT_KEYS, *BATCH_KEYS])}")
        if key in fixed:
            raise ConfigError(f"{source} {key}", "given twice", "keep one value")
        fixed[key] = _typed(key, value.strip("'\""), hints[key], source)
    if "dp" in fixed and {"dp_replicate", "dp_shard"} <= fixed.keys():
        if fixed["dp"] != fixed["dp_replicate"] * fixed["dp_shard"]:
            raise ConfigError(f"{source} dp", "dp != dp_replicate * dp_shard", "give dp or its two factors")
    return fixed


def default_zero_stage(dp_shard: int, ep: int) -> int:
    """Layout.zero_stage left unset: 3 when dp_shard > 1 (FSDP's default) or ep > 1 (expert parallelism draws its
    ranks from dp_shard, which needs FSDP), else 0."""
    return 3 if dp_shard > 1 or ep > 1 else 0


def complete_layout(fixed: dict, world: int | None = None, source: str = "--layout") -> Layout:
    """The Layout a partial one means: tp, pp, cp default to 1; dp to the ranks `world` leaves (1 without a
    world); `dp=N` is dp_shard under ZeRO-2/3 and dp_replicate otherwise; the rest are Layout's defaults."""
    tp, pp, cp = (fixed.get(k, 1) for k in ("tp", "pp", "cp"))
    if world is not None and world % (tp * pp * cp):
        raise ConfigError(source, f"tp*pp*cp = {tp * pp * cp} does not divide the {world} ranks",
                          "pick degrees whose product divides the world size")
    given = {k: v for k, v in fixed.items() if k in LAYOUT_KEYS}
    default_dp = world // (tp * pp * cp) if world is not None else 1
    if "dp_replicate" not in given and "dp_shard" not in given:
        dp = fixed.get("dp", default_dp)
        # ep draws from dp_shard, so a layout with ep and no zero_stage is sharded (Layout's default)
        zero_stage = given.get("zero_stage", default_zero_stage(1, given.get("ep", 1)))
        given["dp_shard" if zero_stage >= 2 else "dp_replicate"] = dp
    elif "dp" in fixed or world is not None:
        dp = fixed.get("dp", default_dp)
        known = given.get("dp_replicate") or given.get("dp_shard")
        if dp % known and "dp" in fixed:
            raise ConfigError(f"{source} dp", f"{known} does not divide dp={dp}", "give dp or its two factors")
        if dp % known:  # dp is what the world leaves: name the key the user gave, not a dp they never wrote
            key = "dp_replicate" if "dp_replicate" in given else "dp_shard"
            raise ConfigError(f"{source} {key}", f"{known} does not divide the {dp} data-parallel ranks that the "
                              f"{world} ranks leave besides tp*pp*cp = {tp * pp * cp}",
                              f"give a {key} that divides {dp}")
        given.setdefault("dp_shard" if "dp_replicate" in given else "dp_replicate", dp // known)
    return Layout(**given)


def engine_cannot_run(layout: Layout, precision: str, compile: bool = False,
                      optimizer: str = "adamw", engine_moe: bool = True) -> ConfigError | None:
    """What the engine cannot run on torch 2.13 in this layout, as the error naming the field (None: it can). The
    config refuses these jobs and the planner's search leaves these plans out. `engine_moe` False: the mixture of
    experts is not the engine's (the planner's Megatron-Core MoE layer, whose selective recompute is the attention
    core's and replays no all-to-all)."""
    error = _offload_error(layout) or _optimizer_error(layout, optimizer) or _mixed_precision_error(layout, precision)
    if error is not None:
        return error
    if layout.ep > 1 and layout.activation_checkpoint == "selective" and engine_moe:
        return ConfigError("parallel.activation_checkpoint", "selective checkpointing cannot replay expert "
                           "parallelism's all-to-all in torch 2.13 (its recompute does not find the functional "
                           "collective's records)", "use 'full' or 'none' with ep > 1")
    if layout.pp > 1 and precision == "fp16":
        return ConfigError("train.precision", "fp16 loss scaling with pp > 1: each stage would find inf/nan and "
                           "skip on its own", "use bf16 or fp32 with pipeline parallelism")
    if layout.pp == 1 or layout.pp_schedule != "zero-bubble":
        return None
    if compile:
        return ConfigError("train.compile", "zero-bubble splits backward into input and weight passes, which "
                           "compiled blocks do not support in torch 2.13",
                           "set train.compile = false, or use another parallel.pp_schedule")
    if layout.zero_stage == 3 and layout.dp_shard * layout.cp > 1:
        return ConfigError("parallel.zero_stage", "ZeRO-3 reshards parameters between zero-bubble's input and "
                           "weight backward passes and the weight gradients come out wrong in torch 2.13",
                           "use zero_stage = 2 with zero-bubble")
    if layout.activation_checkpoint == "selective":
        return ConfigError("parallel.activation_checkpoint", "zero-bubble runs two backward passes over each block "
                           "(input, then weight gradients) and selective checkpointing allows one",
                           "use 'full' or 'none' with zero-bubble")
    return None


def capacity_error(layout: Layout, capacity_factor: float) -> ConfigError | None:
    """A mixture of experts with a capacity (GShard's: each expert keeps ceil(capacity_factor x T k / E) of a
    forward's T tokens) under context parallelism: each cp rank counts the capacity over its own part of every
    sequence, so it drops other (token, expert) pairs than one device does, and the run differs from it (verify:
    4.2e-3 in the parameters at cp 2). Refused by the config and not offered by the planner."""
    if capacity_factor > 0 and layout.cp > 1:
        return ConfigError("parallel.cp", f"cp={layout.cp} with model.capacity_factor = {capacity_factor:g}: each "
                           "context-parallel rank applies the capacity to its part of the sequences, so other tokens "
                           "are dropped than on one device", "set model.capacity_factor = 0 (dropless), or cp = 1")
    return None


def expert_parallel_error(layout: Layout, n_experts: int, model: str = "the model",
                          ranks_known: bool = True, moe_layer: str = "engine") -> ConfigError | None:
    """What the engine refuses of a mixture of experts in this layout, as the error naming the field (None: it
    runs it). Expert parallelism borrows its ranks from dp_shard x cp (as torchtitan): ep divides n_experts and
    dp_shard x cp, is a multiple of cp, and needs FSDP (ZeRO-2/3). The config refuses these jobs and the planner's
    --plan (key from the field's name).
    `ranks_known` False: a job that sets no data-parallel degree gets dp_shard from its world later (fit_world),
    so how ep divides the ranks is checked then. `moe_layer` 'megatron-core': what the planner prices of
    Megatron-Core's expert parallelism (the planner's Training.moe_layer): at ZeRO-0/1 ep divides the tp x cp x dp
    ranks (expert tensor parallelism 1: the expert groups folded over the tp ranks, each routing its
    sequence-parallel shard); at ZeRO-2/3 (its FSDP) as the engine's (beside tp the planner's
    folded_experts_error refuses it)."""
    ep = layout.ep
    if ep == 1:
        return None
    if not n_experts:
        return ConfigError("parallel.ep", f"ep={ep} splits experts and {model} has none",
                           "use ep = 1 for a dense model")
    if n_experts % ep:
        return ConfigError("parallel.ep", f"ep={ep} does not divide the {n_experts} experts",
                           "pick ep among the divisors of n_experts")
    if moe_layer == "megatron-core" and layout.zero_stage < 2:
        group = layout.tp * layout.cp * layout.dp
        if group % ep:
            return ConfigError("parallel.ep", f"ep={ep} is drawn from the tp x cp x dp = {group} ranks and does not "
                               "divide them", f"use an ep dividing {group}")
        return None
    if layout.zero_stage < 2:
        return ConfigError("parallel.ep", f"ep={ep} splits the experts over FSDP's ranks and zero_stage is "
                           f"{layout.zero_stage}", "use zero_stage 2 or 3, with dp_shard x cp a multiple of ep")
    if not ranks_known and layout.dp == 1:
        return None
    group = layout.dp_shard * layout.cp
    if group % ep:
        return ConfigError("parallel.ep", f"ep={ep} is drawn from the dp_shard x cp = {group} ranks and does not "
                           "divide them", f"use an ep dividing {group}, or a dp_shard x cp that ep divides (a job that "
                           "sets no dp degree gets dp_shard from the processes it runs on: --nproc)")
    if ep % layout.cp:
        return ConfigError("parallel.ep", f"ep={ep} is not a multiple of cp={layout.cp} (an expert group holds whole "
                           "context-parallel groups)", "use a multiple of cp")
    return None


def pipeline_batch_error(layout: Layout, n_microbatches: int) -> ConfigError | None:
    """What the pipeline schedules refuse of a step's `n_microbatches` pipeline micro-batches (None: they run it):
    every schedule but GPipe needs at least one per stage. The config refuses these jobs and the planner's search
    leaves these plans out."""
    if layout.pp > 1 and layout.pp_schedule != "gpipe" and n_microbatches < layout.pp:
        return ConfigError("parallel.pp_microbatches", f"{n_microbatches} micro-batches < pp={layout.pp} stages",
                           f"use at least {layout.pp} (more shrinks the bubble (P-1)/(M+P-1))")
    return None


def fsdp_applies(layout: Layout) -> bool:
    """Whether the engine wraps the model in FSDP2's fully_shard: ZeRO-2/3 over more than one rank, or with full
    offload (FSDP2 is what moves the state to the host; on one data-parallel rank it shards over a mesh of one)."""
    return fsdp_shards(layout) or layout.zero_stage >= 2 and layout.offload == "full"


def fsdp_shards(layout: Layout) -> bool:
    """Whether FSDP shards the weights over more than one rank: ZeRO-2/3 over dp_shard x cp > 1."""
    return layout.zero_stage >= 2 and layout.dp_shard * layout.cp > 1


def fsdp_mixed_precision(layout: Layout) -> bool:
    """Whether FSDP2's MixedPrecisionPolicy runs (parallel.mixed_precision = 'fsdp'; engine_cannot_run refuses it
    where FSDP does not shard). The planner prices it as its layout 'fsdp-mp' (planner.workload.recipe_for)."""
    return layout.mixed_precision == "fsdp" and fsdp_shards(layout)


def _offload_error(layout: Layout) -> ConfigError | None:
    if layout.offload == "optimizer":
        return ConfigError("parallel.offload", "'optimizer' offload has no implementation here: torchao's "
                           "CPUOffloadOptimizer runs on CUDA only, takes no DTensor parameters and keeps per-tensor "
                           "optimizers that DCP checkpoints cannot hold",
                           "use parallel.offload = 'full' (FSDP2's CPUOffloadPolicy: state and step on the host)")
    if layout.offload == "full" and layout.zero_stage < 2:
        return ConfigError("parallel.offload", f"'full' offload is FSDP2's CPUOffloadPolicy and zero_stage is "
                           f"{layout.zero_stage}", "set parallel.zero_stage = 2 or 3 (one device runs FSDP over a "
                           "mesh of one)")
    return None


def _mixed_precision_error(layout: Layout, precision: str) -> ConfigError | None:
    if layout.mixed_precision == "autocast":
        return None
    if layout.mixed_precision != "fsdp":
        return ConfigError("parallel.mixed_precision", f"{layout.mixed_precision!r} is not 'autocast' or 'fsdp'",
                           "use 'autocast' (fp32 weights cast per matmul) or 'fsdp' (FSDP2's bf16 gathers)")
    if precision != "bf16":
        return ConfigError("parallel.mixed_precision", f"'fsdp' is FSDP2's MixedPrecisionPolicy with bf16 "
                           f"parameters and train.precision is {precision}",
                           "set train.precision = 'bf16', or parallel.mixed_precision = 'autocast'")
    if not fsdp_shards(layout):
        return ConfigError("parallel.mixed_precision", f"'fsdp' is FSDP2's policy for the weights FSDP shards, and "
                           f"zero_stage {layout.zero_stage} over dp_shard x cp = {layout.dp_shard * layout.cp} "
                           "shards none", "use 'autocast', or zero_stage 2/3 with dp_shard x cp > 1")
    return None


def _optimizer_error(layout: Layout, optimizer: str) -> ConfigError | None:
    """torch's Adafactor factors each parameter's second moment over its rows and columns: it needs whole tensors."""
    if optimizer != "adafactor":
        return None
    if layout.tp > 1 or fsdp_applies(layout):
        return ConfigError("optim.name", "torch's Adafactor cannot update sharded DTensors (tensor parallel, FSDP, "
                           "offload): its row and column statistics fail in place on them",
                           "use adamw or adamw8bit, or adafactor with tp = 1 and zero_stage 0")
    if layout.zero_stage == 1 and layout.dp * layout.cp > 1:
        return ConfigError("optim.name", "ZeRO-1 hands the optimizer flat 1/N slices of each parameter, of which "
                           "Adafactor would keep an unfactored second moment", "use zero_stage 0 with adafactor")
    return None

# ---------------------------------------------------------------------------------------------------
# Split: which layers each stage runs


def layer_costs(args: ModelArgs, seq_len: int) -> tuple[int, list[int], int]:
    """(embedding, each block, final norm + head): training FLOPs per token, forward + backward.

    Compute is what sets a stage's pace, so cost is FLOPs, counted as `flops_per_token` does: a block is
    6 x its matmul weights + 12 d_q s for attention scores and values (d_q = n_heads x head_dim); the head is
    6 d V for its matmul plus
    the loss's softmax and its gradient (counted as 5 operations per logit) and the final norm (~8 d). The
    embedding does no matmul: its lookup and the scatter-add of its gradient are ~2 d per token, counted,
    and negligible next to a block, whereas the head is 0.6 (Llama 2, V = 32k) to 2 (Llama 3, V = 128k)
    blocks. Memory balance is the planner's concern: the first stage holds the embedding table and, under
    1F1B, the most micro-batches in flight.
    """
    d, q, kv = args.dim, args.q_dim, args.n_kv_heads * args.head_dim
    attention = 6 * (2 * d * q + 2 * d * kv) + 12 * q * seq_len
    blocks = [attention + 6 * mlp_params(args, i, active=True) for i in range(args.n_layers)]
    head = 6 * d * args.vocab_size + 5 * args.vocab_size + 8 * d
    return 2 * d, blocks, head


def stage_costs(costs: tuple[int, list[int], int], split: list[range]) -> list[int]:
    """Cost of each stage of `split`: its blocks, plus the embedding on the first and the head on the last."""
    embedding, blocks, head = costs
    out = [sum(blocks[i] for i in layers) for layers in split]
    out[0] += embedding
    out[-1] += head
    return out


def split_layers(costs: tuple[int, list[int], int], n_stages: int) -> list[range]:
    """Contiguous layer ranges, at least one layer each, minimising the largest stage cost.

    Among the splits that reach that optimum, the one with the smallest sum of squared stage costs (the
    most even). Two dynamic programs over (stages, layers). The first finds the optimum in
    O(n_stages x n_layers x log n_layers): the best largest cost of s stages over a prefix grows with the
    prefix while the cost of the stage after it shrinks as that stage starts later, so the best start is
    where the two cross, found by bisection. The second only tries the starts whose stage stays within that
    optimum, a window of about n_layers / n_stages, so it is O(n_layers^2) at worst (a 405B model's
    126 layers over 64 stages takes milliseconds, which a planner search that meets many stage counts needs).
    """
    embedding, blocks, head = costs
    n = len(blocks)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {n_stages} stages of at least one layer")
    prefix = [0, *itertools.accumulate(blocks)]

    extra = [embedding if s == 0 else 0 for s in range(n_stages)]
    extra[-1] += head

    def ends(s: int) -> range:  # where stage s can end, leaving a layer for each later stage
        return range(s + 1, n - n_stages + s + 2)

    # (stage s runs layers i..j-1 at cost prefix[j] - prefix[i] + extra[s]; written out in the loops, which run
    # n_stages x n_layers x log n_layers times)
    # worst[s][j]: the smallest largest stage cost of stages 0..s covering layers 0..j-1
    worst = [[0] * (n + 1) for _ in range(n_stages)]
    for j in ends(0):
        worst[0][j] = prefix[j] + extra[0]
    for s in range(1, n_stages):
        before, here, top = worst[s - 1], worst[s], extra[s]
        for j in ends(s):
            end = prefix[j] + top
            lo, hi = s, j - 1  # the first start at which the stages before cost at least stage s does
            while lo < hi:
                mid = (lo + hi) // 2
                if before[mid] >= end - prefix[mid]:
                    hi = mid
                else:
                    lo = mid + 1
            here[j] = min(max(before[i], end - prefix[i]) for i in {lo, max(s, lo - 1)})
    limit = worst[-1][n]

    # best[s][j]: (sum of squared costs, start of stage s) over the splits of layers 0..j-1 into stages 0..s
    # whose every stage costs at most `limit`
    best = [[None] * (n + 1) for _ in range(n_stages)]
    for j in ends(0):
        if prefix[j] + extra[0] <= limit:
            best[0][j] = ((prefix[j] + extra[0]) ** 2, 0)
    for s in range(1, n_stages):
        before, here, top = best[s - 1], best[s], extra[s]
        for j in ends(s):
            end = prefix[j] + top
            first = max(s, bisect.bisect_left(prefix, end - limit))
            options = [(before[i][0] + (end - prefix[i]) ** 2, i) for i in range(first, j) if before[i] is not None]
            here[j] = min(options) if options else None
    split, j = [], n
    for s in reversed(range(n_stages)):
        i = best[s][j][1]
        split.append(range(i, j))
        j = i
    return split[::-1]


# ---------------------------------------------------------------------------------------------------
# Place: which stages each rank runs


def stages_of_rank(schedule: str, pp: int, rank: int, stages_per_rank: int) -> list[int]:
    """Stage indices pipeline rank `rank` holds, in pipeline order: a loop, or a V for zero-bubble."""
    if schedule == "zero-bubble":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(stages_per_rank)]
