"""Per-rank memory, itemised: model state, activations, transient buffers, allowances.

Derivations are in docs/planner.md; each function here names the section it implements. Sizes are bytes.
The activation accounting is the one of Korthikanti et al. (2022), redone for our block: RMSNorm instead of
LayerNorm, SwiGLU instead of GeLU, grouped-query attention, fused SDPA (no s^2 score matrix: the kernel saves
q, k, v, its output and one fp32 log-sum-exp per head and query) and no dropout.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from shardwise.hardware import GiB, PlannerError
from shardwise.layout import layer_costs, split_layers, stages_of_rank
from shardwise.model_args import ModelArgs, head_rows, projection_shapes
from shardwise.planner.experts import deepep_rows, kept_share, moe_token_split, routed_per_token
from shardwise.planner.plan import Plan
from shardwise.planner.timeline import zbv_order
from shardwise.planner.workload import (
    LOW_BIT_BLOCK,
    LOW_BIT_CODE_BOOK,
    LOW_BIT_MIN_VALUES,
    OPTIMIZER_STATE_BYTES,
    PARAM_DTYPE_STATE,
    QLORA_BITS,
    Training,
    recipe_for,
)

# ---------------------------------------------------------------------------------------------------
# Parameters (docs/planner.md, "Parameters per rank")


def linear_shapes(args: ModelArgs) -> list[tuple[str, int, int, str]]:
    """(name, in, out, how tp splits it) for the linears of a block (seven; six with a GELU MLP), in forward order:
    'col' splits outputs, 'row' inputs,
    'kv' is a column split that cannot go below one KV head per rank."""
    splits = {"wq": "col", "wk": "kv", "wv": "kv", "wo": "row", "w1": "col", "w3": "col", "w2": "row"}
    return [(name, n_in, n_out, splits[name]) for name, (n_in, n_out) in projection_shapes(args).items()]


def kv_split(args: ModelArgs, tp: int) -> int:
    """How many ways KV heads split: with more tp ranks than KV heads, heads are replicated."""
    return min(tp, args.n_kv_heads)


def layer_params(args: ModelArgs, tp: int = 1) -> float:
    """Parameters of one dense block held by one tp rank (norm weights are replicated)."""
    return _layer_params(args, tp)


def block_modules(args: ModelArgs, tp: int) -> list[float]:
    """Parameters (per tp rank) of each of a block's linear modules in forward order, as Megatron's GPT has them:
    Q, K and V one module, the MLP's gate and up projections one."""
    n = {k: i * o / tp for k, (i, o) in projection_shapes(args).items()}
    return [n["wq"] + n["wk"] + n["wv"], n["wo"], n["w1"] + n.get("w3", 0.0), n["w2"]]


def block_params(args: ModelArgs, tp: int = 1, moe: bool = False, ep: int = 1) -> float:
    """Parameters of one block on one rank: a dense block (layer_params), or a mixture of experts' block: its
    attention split by tp and its norms, and the MoE whole on every tp rank (the engine does not split it): the
    router and shared experts (moe_shared_params) and the routed experts of its ep rank (expert_params)."""
    return _moe_block_params(args, tp, ep) if moe else _layer_params(args, tp)


def moe_shared_params(args: ModelArgs) -> float:
    """An MoE block's router (n_experts x d) and shared experts (a SwiGLU of n_shared_experts x expert_hidden):
    FSDP shards them with the rest of the block."""
    return args.n_experts * args.dim + 3 * args.dim * args.n_shared_experts * args.expert_hidden


def expert_params(args: ModelArgs, ep: int = 1) -> float:
    """The routed experts one ep rank holds in one MoE block: n_experts / ep of them, w1 and w3 (hidden x d) and w2
    (d x hidden) each. With ep > 1 their state is sharded over Layout.expert_shard_group, apart from the block's
    (FSDP's, or under Megatron-Core the distributed optimizer's over its expert-data-parallel group)."""
    return args.n_experts // ep * 3 * args.dim * args.expert_hidden


# The memoised functions below are keyed on ModelArgs and Training themselves (frozen, hashed once), and on the
# layout's fields they read, passed one by one


@functools.lru_cache(maxsize=4096)
def _layer_params(args: ModelArgs, tp: int) -> float:
    total = 2 * args.dim
    for _, n_in, n_out, split in linear_shapes(args):
        total += n_in * n_out / (kv_split(args, tp) if split == "kv" else tp)
    return total


ATTENTION = ("wq", "wk", "wv", "wo")


def attention_params(args: ModelArgs, tp: int = 1) -> float:
    """The attention's matmul weights of one block on one tp rank (an MoE block's only split ones)."""
    return sum(block_tensor_params(args, tp, moe=True)[:len(ATTENTION)])


@functools.lru_cache(maxsize=4096)
def _moe_block_params(args: ModelArgs, tp: int, ep: int) -> float:
    return sum(block_tensor_params(args, tp, moe=True, ep=ep))


def block_tensor_params(args: ModelArgs, tp: int = 1, moe: bool = False, ep: int = 1) -> list[float]:
    """Parameters of each of one block's parameter tensors on one rank: its linears (an MoE block: the attention's,
    the router, the routed experts' w1, w3, w2 and the shared experts' w1, w3, w2), then its two norms."""
    split = [n_in * n_out / (kv_split(args, tp) if how == "kv" else tp)
             for name, n_in, n_out, how in linear_shapes(args) if not moe or name in ATTENTION]
    if moe:
        d, h, shared = args.dim, args.expert_hidden, args.n_shared_experts * args.expert_hidden
        split += [args.n_experts * d] + 3 * [args.n_experts // ep * d * h] + (3 * [d * shared] if shared else [])
    return split + [args.dim, args.dim]


def blocks_params(args: ModelArgs, tp: int, ep: int, layers: int, moe_layers: int) -> float:
    """Parameters of `layers` blocks on one rank, `moe_layers` of them MoE blocks."""
    if not moe_layers:
        return layers * _layer_params(args, tp)
    return (layers - moe_layers) * _layer_params(args, tp) + moe_layers * _moe_block_params(args, tp, ep)


class StageShape(NamedTuple):
    """What one rank of a pipeline stage holds, from the model's shape and the layout's degrees alone."""

    layers: int
    """Blocks (pipeline_layers)."""
    params: float
    """Parameters on one rank: its blocks, plus the embedding (first rank) and the final norm and head (the rank
    holding the last stage)."""
    root: float
    """Parameters outside the blocks (the root FSDP unit): embedding, final norm, head."""
    last: bool
    """Holds the output head (the last stage's rank, or the head's under nanotron's cut: _head_stage)."""
    boundaries: int
    """Receive buffers per micro-batch: one for each held stage's incoming activation (all but the first stage)
    and one for its incoming gradient (all but the last)."""
    moe_layers: int = 0
    """Of `layers`, the mixture-of-experts blocks."""
    experts: float = 0.0
    """Of `params`, the routed experts (n_experts / ep per MoE block): their state is sharded over
    expert_shard_group."""
    last_moe: bool = False
    """The rank's last block, the first whose backward runs, is an MoE block."""

    @property
    def blocks(self) -> float:
        """Parameters of the blocks alone."""
        return self.params - self.root


def stage_shape(args: ModelArgs, plan: Plan, stage: int, seq_len: int, split: str = "cost") -> StageShape:
    """StageShape of pipeline rank `stage` under the system's pipeline split (Training.pipeline_split); memoised,
    since a search asks for it under every batch split, ZeRO stage and recompute policy of the same degrees."""
    return _stage_shape(args, seq_len, plan.tp, plan.pp, plan.stages_per_rank, plan.pp_schedule, stage, plan.ep,
                        split)


@functools.lru_cache(maxsize=65536)
def _stage_shape(args: ModelArgs, seq_len: int, tp: int, pp: int, per_rank: int, schedule: str,
                 stage: int, ep: int = 1, split: str = "cost") -> StageShape:
    ids = _rank_layers(args, seq_len, pp, per_rank, schedule, split)[stage]
    layers, moe_layers = len(ids), sum(map(args.is_moe_layer, ids))
    last = stage == _head_rank(pp, per_rank, schedule, _head_stage(args, pp, per_rank, split))
    emb = args.vocab_size * args.dim / tp  # vocab-parallel embedding and head
    root = (emb if stage == 0 else 0.0) + (args.dim + (0 if args.tie_embeddings and pp == 1 else emb) if last else 0.0)
    n = pp * per_rank
    boundaries = sum((s > 0) + (s < n - 1) for s in stages_of_rank(schedule, pp, stage, per_rank))
    return StageShape(layers, blocks_params(args, tp, ep, layers, moe_layers) + root, root, last, boundaries,
                      moe_layers, moe_layers * expert_params(args, ep), bool(ids) and args.is_moe_layer(max(ids)))


class Placement(NamedTuple):
    """Where the model sits on a layout's pipeline ranks, worked out once per (model, sequence, degrees)."""

    ranks: tuple[int, ...]
    """The ranks whose peak memory or time can be the largest (ranks_to_check)."""
    max_layers: int
    """The most blocks any rank holds."""
    max_params: float
    """The most parameters any rank holds (it paces gradient reduction and the optimizer)."""
    max_blocks: float = 0.0
    """The most block parameters any rank holds."""
    max_moe_layers: int = 0
    """The most MoE blocks any rank holds."""
    max_experts: float = 0.0
    """The most routed-expert parameters any rank holds."""


def placement(args: ModelArgs, plan: Plan, seq_len: int, split: str = "cost") -> Placement:
    return _placement(args, seq_len, plan.tp, plan.pp, plan.stages_per_rank, plan.pp_schedule, plan.ep, split,
                      checkpoint_period(plan))


@functools.lru_cache(maxsize=4096)
def _placement(args: ModelArgs, seq_len: int, tp: int, pp: int, per_rank: int, schedule: str,
               ep: int = 1, split: str = "cost", every: int = 1) -> Placement:
    ranks = _ranks_to_check(args, seq_len, pp, per_rank, schedule, split, every)
    shapes = [_stage_shape(args, seq_len, tp, pp, per_rank, schedule, r, ep, split) for r in ranks]
    return Placement(ranks, max(_pipeline_layers(args, seq_len, pp, per_rank, schedule, split)),
                     max(s.params for s in shapes),
                     max(blocks_params(args, tp, ep, s.layers, s.moe_layers) for s in shapes),
                     max(s.moe_layers for s in shapes), max(s.experts for s in shapes))


def stage_params(args: ModelArgs, plan: Plan, stage: int, seq_len: int, split: str = "cost") -> float:
    """Parameters one rank of pipeline stage `stage` holds: its blocks, plus embedding (first) / norm+head (the rank
    holding the last stage)."""
    return stage_shape(args, plan, stage, seq_len, split).params


def pipeline_layers(args: ModelArgs, plan: Plan, seq_len: int, split: str = "cost") -> tuple[int, ...]:
    """Blocks on each pipeline rank, as the system cuts and places them (`split`: Training.pipeline_split): the
    engine's `split_layers` over its own `layer_costs` (the cost-balanced split, which gives the stage with the
    output head fewer blocks), or DeepSpeed's `slot_split`; each rank holding the stages `stages_of_rank` gives
    it (a loop, or a V for zero-bubble)."""
    return _pipeline_layers(args, seq_len, plan.pp, plan.stages_per_rank, plan.pp_schedule, split)


@functools.lru_cache(maxsize=4096)
def _pipeline_layers(args: ModelArgs, seq_len: int, pp: int, per_rank: int, schedule: str,
                     split: str = "cost") -> tuple[int, ...]:
    return tuple(map(len, _rank_layers(args, seq_len, pp, per_rank, schedule, split)))


@functools.lru_cache(maxsize=4096)
def _rank_layers(args: ModelArgs, seq_len: int, pp: int, per_rank: int, schedule: str,
                 split: str = "cost") -> tuple[tuple[int, ...], ...]:
    """The blocks (layer indices) each pipeline rank holds."""
    stages = _split(args, seq_len, pp * per_rank, split)
    return tuple(tuple(i for s in stages_of_rank(schedule, pp, rank, per_rank) for i in stages[s])
                 for rank in range(pp))


@functools.lru_cache(maxsize=1024)
def _split(args: ModelArgs, seq_len: int, n_stages: int, split: str = "cost") -> list[range]:
    # the split depends on the number of stages only, not on how they are placed; a search meets each count
    # under several (pp, virtual stages) pairs, and the engine's dynamic program is the costly part
    if n_stages == 1:
        return [range(args.n_layers)]
    if split == "slots":
        slots = slot_split(args.n_layers, n_stages)
        if all(slots):  # else DeepSpeed's cut leaves a stage without a block: the engine's split
            return slots
    if split == "nanotron":
        return nanotron_split(args, n_stages)[0]
    return split_layers(layer_costs(args, seq_len), n_stages)


@functools.lru_cache(maxsize=1024)
def nanotron_split(args: ModelArgs, n_stages: int) -> tuple[list[range], int]:
    """(blocks of each stage, the stage holding the output head) as nanotron cuts its pipeline blocks
    (models/base.py build_model at github.com/huggingface/nanotron 67c5ebb6): the blocks in order, the embedding,
    each decoder layer, the final norm, the head, the fp32 cast and the loss, at the costs
    get_block_compute_costs gives them (a decoder layer 4 n_heads head_dim d + 3 ffn d, the head V d, the others
    0), each assigned to the current stage, which moves on after the block whose cumulative cost exceeds
    (stage + 1) / n_stages of the total. The block that crosses a share stays on the stage before it, so the first
    stage takes one more than its share, and the head can land before the last stage: the stages after it get
    no decoder layer (the last, the fp32 cast and the loss on the logits the head's rank sends it, which the
    planner leaves out: it prices the loss on the head's rank)."""
    layer = 4 * args.n_heads * args.head_dim * args.dim + 3 * args.ffn_hidden * args.dim
    costs = [0] + [layer] * args.n_layers + [0, args.vocab_size * args.dim, 0, 0]
    total, cumulative, stage = sum(costs), 0, 0
    owner = []
    for cost in costs:
        cumulative += cost
        owner.append(stage)
        if cumulative > total * ((stage + 1) / n_stages):  # (nanotron's rounding: the share first)
            stage += 1
    layers = owner[1:1 + args.n_layers]
    stages = [range(layers.index(s), len(layers) - layers[::-1].index(s)) if s in layers else range(0)
              for s in range(n_stages)]
    return stages, owner[2 + args.n_layers]


def slot_split(n_layers: int, n_stages: int) -> list[range]:
    """DeepSpeed's pipeline partition over `type:transformer|embedding` (Megatron-DeepSpeed's --pp-partition-method,
    BLOOM's): the input embedding and the tied output embedding each take a block's slot, and
    `partition_balanced` cuts the n_layers + 2 slots, each of weight 1, greedily from the first into parts of the
    smallest bottleneck, ceil(slots / stages) (deepspeed/runtime/utils.py, `_lprobe`). The blocks of each stage;
    a stage can be left with none (the last, when the parts run out)."""
    per = -(-(n_layers + 2) // n_stages)
    # slot 0 is the embedding, slot i the block i - 1, slot n_layers + 1 the output embedding
    return [range(min(max(k * per - 1, 0), n_layers), min((k + 1) * per - 1, n_layers)) for k in range(n_stages)]


def zero_bubble_chunks(args: ModelArgs, plan: Plan, stage: int, seq_len: int,
                       split: str = "cost") -> tuple[range, range]:
    """The blocks of a zero-bubble rank's two stages: chunk 0 (stage `stage`) and chunk 1 (stage 2P - 1 - stage)."""
    stages = _split(args, seq_len, 2 * plan.pp, split)
    return stages[stage], stages[2 * plan.pp - 1 - stage]


def stage_layers(args: ModelArgs, plan: Plan, stage: int, seq_len: int, split: str = "cost") -> int:
    """Blocks on pipeline rank `stage` (see pipeline_layers)."""
    return stage_shape(args, plan, stage, seq_len, split).layers


def checkpoint_period(plan: Plan) -> int:
    """Every how many blocks one is checkpointed (Layout.activation_checkpoint_every; 1 without recompute)."""
    return plan.activation_checkpoint_every if plan.activation_checkpoint != "none" else 1


def partial_checkpointing(plan: Plan) -> bool:
    """Only some blocks are checkpointed (activation_checkpoint_every > 1): which ones is the system's
    (Training.partial_checkpoint); the others keep what they would without recompute."""
    return checkpoint_period(plan) > 1


def checkpointed_order(args: ModelArgs, training: Training, plan: Plan, stage: int) -> tuple[bool, ...]:
    """Whether each block of pipeline rank `stage` is checkpointed, in backward order (the rank's last block, the
    first whose backward runs, first): every block under a recompute policy with k = 1, those the system picks
    otherwise (Training.partial_checkpoint: the engine's model indices 0, k, 2k, ...; or every k-th of the rank's
    own blocks counted from 1, as torchtitan's and fms-fsdp's wrappers count them)."""
    return _checkpointed_order(args, training.seq_len, plan.pp, plan.stages_per_rank, plan.pp_schedule,
                               training.pipeline_split, stage, checkpoint_period(plan), training.partial_checkpoint,
                               plan.activation_checkpoint != "none")


@functools.lru_cache(maxsize=4096)
def _checkpointed_order(args: ModelArgs, seq_len: int, pp: int, per_rank: int, schedule: str, split: str,
                        stage: int, every: int, style: str, recompute: bool) -> tuple[bool, ...]:
    ids = sorted(_rank_layers(args, seq_len, pp, per_rank, schedule, split)[stage])
    if style == "last":
        kept = [(j + 1) % every == 0 for j in range(len(ids))]
    else:
        kept = [i % every == 0 for i in ids]
    return tuple(recompute and k for k in reversed(kept))


def checkpointed_blocks(args: ModelArgs, training: Training, plan: Plan, stage: int) -> int:
    """The blocks of pipeline rank `stage` that are checkpointed."""
    return sum(checkpointed_order(args, training, plan, stage))


def first_backward_replayed(args: ModelArgs, training: Training, plan: Plan, stage: int) -> bool:
    """Whether the block whose backward runs first on the rank is checkpointed: its last; of a rank holding several
    chunks (an interleaved schedule), whose backwards in steady state follow one another, any chunk's last (the
    larger moment: a replay makes the block's tensors again where a kept block's backward frees them)."""
    order = checkpointed_order(args, training, plan, stage)
    if plan.stages_per_rank == 1 or not partial_checkpointing(plan):
        return order[0]
    ids = sorted(_rank_layers(args, training.seq_len, plan.pp, plan.stages_per_rank, plan.pp_schedule,
                              training.pipeline_split)[stage], reverse=True)
    return any(kept for i, kept in zip(ids, order) if i + 1 not in ids)


def block_zero_checkpointed(args: ModelArgs, training: Training, plan: Plan) -> bool:
    """Whether the model's first block (pipeline rank 0's first, its last in backward order) is checkpointed."""
    return checkpointed_order(args, training, plan, 0)[-1]


def backward_plan(args: ModelArgs, training: Training, plan: Plan, stage: int, nth: int = 0) -> Plan:
    """`plan` as the rank's `nth` block in backward order sees it (0: the first whose backward runs,
    first_backward_replayed): checkpointed under the plan's policy or not at all (partial_checkpointing), every
    block alike."""
    if not partial_checkpointing(plan):
        return plan
    replayed = first_backward_replayed(args, training, plan, stage) if nth == 0 else \
        checkpointed_order(args, training, plan, stage)[nth]
    return replace(plan, activation_checkpoint=plan.activation_checkpoint if replayed else "none",
                   activation_checkpoint_every=1)


def _head_stage(args: ModelArgs, pp: int, per_rank: int, split: str) -> int:
    """The stage holding the output head (final norm, head, loss): the last, but under nanotron's cut
    (nanotron_split)."""
    if split == "nanotron" and pp * per_rank > 1:
        return nanotron_split(args, pp * per_rank)[1]
    return pp * per_rank - 1


@functools.lru_cache(maxsize=1024)
def _head_rank(pp: int, per_rank: int, schedule: str, stage: int) -> int:
    """The pipeline rank holding stage `stage` (the head's: _head_stage): under the zero-bubble V the last stage
    folds back onto rank 0."""
    return next(r for r in range(pp) if stage in stages_of_rank(schedule, pp, r, per_rank))


def ranks_to_check(args: ModelArgs, plan: Plan, seq_len: int, split: str = "cost") -> tuple[int, ...]:
    """The pipeline ranks whose peak memory or time can be the largest: the first (embedding, most micro-batches
    in flight) and the next with its block count, the one with the head, and the first rank with each block count
    (among ranks with equal blocks the earlier one holds at least as many micro-batches in flight; under
    zero-bubble the last one too); of a mixture of experts, each count of blocks and MoE blocks; checkpointing
    every k-th block, each count of checkpointed blocks and whether the rank's last block is one."""
    return _ranks_to_check(args, seq_len, plan.pp, plan.stages_per_rank, plan.pp_schedule, split,
                           checkpoint_period(plan))


@functools.lru_cache(maxsize=4096)
def _ranks_to_check(args: ModelArgs, seq_len: int, pp: int, per_rank: int, schedule: str,
                    split: str = "cost", every: int = 1) -> tuple[int, ...]:
    ranks = _rank_layers(args, seq_len, pp, per_rank, schedule, split)
    # (checkpointing every k-th block: ranks with as many blocks may checkpoint a different number of them, and
    # the first backward may or may not replay its block)
    kinds = [(len(ids), sum(map(args.is_moe_layer, ids)))
             + ((sum(i % every == 0 for i in ids), bool(ids) and max(ids) % every == 0) if every > 1 else ())
             for ids in ranks]
    first_with = {n: kinds.index(n) for n in set(kinds)}
    # rank 0 also holds the embedding, and under LoRA its first block skips input gradients
    # (timing.lora_first_block_skipped): the next rank with its blocks can be the slower
    after_first = next((r for r in range(1, len(kinds)) if kinds[r] == kinds[0]), 0)
    head = _head_rank(pp, per_rank, schedule, _head_stage(args, pp, per_rank, split))
    ends = {0, after_first, head}
    # (the ranks after the head under nanotron's cut hold no block and no parameter: never the fullest or slowest)
    first_with = {n: r for n, r in first_with.items() if n[0] or r == head}
    if args.n_moe_layers:
        # a rank between the ends holds as many receive buffers as any other such rank and no more micro-batches in
        # flight than an earlier one: one with no more dense and no more MoE blocks than an earlier such rank, and
        # the same kind of last block (its first backward), can be neither the fullest nor the slowest
        def dominated(j: int) -> bool:
            dense_j, moe_j = kinds[j][0] - kinds[j][1], kinds[j][1]
            return any(kinds[i][0] - kinds[i][1] >= dense_j and kinds[i][1] >= moe_j
                       and args.is_moe_layer(max(ranks[i])) == args.is_moe_layer(max(ranks[j]))
                       for i in first_with.values() if i < j and i not in ends)
        first_with = {n: r for n, r in first_with.items() if r in ends or not dominated(r)}
    if schedule == "zero-bubble":
        # the V's later ranks defer more weight passes to the cool-down, each keeping its micro-batch's graph
        # (_zero_bubble_held): among ranks with equal blocks the last can hold the most
        last_with = {n: len(kinds) - 1 - kinds[::-1].index(n) for n in set(kinds)}
        return tuple(sorted({*ends, *first_with.values(), *last_with.values()}))
    return tuple(sorted({*ends, *first_with.values()}))


def adapted_shapes(args: ModelArgs, training: Training) -> list[tuple[str, int, int, str]]:
    """linear_shapes of the projections LoRA adapts (Training.lora_targets; those the block has: a GELU MLP has no
    w3, which the engine then skips)."""
    return [shape for shape in linear_shapes(args) if shape[0] in training.lora_targets]


LINEAR_GROUPS = (("wq", "wk", "wv"), ("wo",), ("w1", "w3"), ("w2",))
"""A dense block's linears by input, in forward order: each group's input is made from the outputs of those before
it (and the block's input); a group is one linear under fused projections (Training.fused_projections: Q/K/V one,
w1 and w3 one)."""


def adapter_groups(args: ModelArgs, training: Training) -> list[tuple[tuple[str, int, int, str], ...]]:
    """The adapted linears (adapted_shapes) by the adapter that adapts them: each its own (shardwise.lora: an
    adapter per projection), or under fused projections (Training.fused_projections) one adapter per fused linear,
    as NeMo's LoRA adapts Megatron-Core's linear_qkv (LoraKQVAdapter: one A of d x r, one B of r x (q + 2 kv), one
    dropout of its input) and linear_fc1: its A, its dropout and their outputs once for the group. Only under the
    layout 'megatron' (NeMo's LoRA is the one that runs there): lit-gpt's LoRAQKVLinear, the other fused LoRA we
    know, keeps an A per enabled projection, priced as an adapter each."""
    shapes = adapted_shapes(args, training)
    if not (training.fused_projections and training.layout == "megatron"):
        return [(shape,) for shape in shapes]
    groups = [tuple(shape for shape in shapes if shape[0] in fused) for fused in LINEAR_GROUPS]
    return [group for group in groups if group]


def lora_params(args: ModelArgs, training: Training, tp: int = 1) -> float:
    """Trainable adapter parameters per block: r (in + out) on each adapter (adapter_groups: an adapter's out is
    its linears'), split by tp like the linear."""
    return sum(training.lora_rank * (group[0][1] + sum(n_out for _, _, n_out, _ in group)) / tp
               for group in adapter_groups(args, training))


def adapted_base_params(args: ModelArgs, training: Training, tp: int = 1) -> float:
    """Frozen base weights of a block's adapted linears on one tp rank (QLoRA stores these in NF4)."""
    return sum(n_in * n_out / (kv_split(args, tp) if split == "kv" else tp)
               for _, n_in, n_out, split in adapted_shapes(args, training))


# ---------------------------------------------------------------------------------------------------
# Model state (docs/planner.md, "Model state"): ZeRO's (2 + 2 + K) Psi and its variants


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model-state item, before sharding."""

    params: float
    grads: float
    master: float
    optimizer: float


def state_bytes_per_param(training: Training) -> StateBytes:
    """Bytes/param of weights, gradients, fp32 master copy and optimizer state for a recipe.

    'zero': fp16/bf16 weights and gradients, fp32 master + moments in the optimizer (Rajbhandari et al.: 2+2+K,
    K=12 for Adam -> 16 bytes). 'megatron': bf16 weights, fp32 gradient accumulation buffer (2+4+12 = 18; bf16
    under grads_in_fp32 False, and under optimizer_dtype bf16 Apex's bf16 Adam state: 2+2+4 in bf16, 2+2+2+4 in fp8).
    'torch': fp32 weights and gradients, the weights being the master (4+4+8 = 16); compute copies are transient
    (see transient_bytes). fp32 training: 4+4+states, no master. A bf16 model (Training.state_dtype, layout
    'fsdp-mp'): 2+2+4 under AdamW, no master.
    """
    if training.state_dtype == "bf16":  # the model in bf16, its optimizer's state in the parameter's dtype
        opt = OPTIMIZER_STATE_BYTES[training.optimizer]
        return StateBytes(2.0, 2.0, 0.0, opt / 2 if training.optimizer in PARAM_DTYPE_STATE else opt)
    return _state_bytes(training.optimizer, training.mixed, training.layout, training.grads_in_fp32,
                        training.optimizer_dtype, training.precision == "fp8")


@functools.lru_cache(maxsize=64)
def _state_bytes(optimizer: str, mixed: bool, layout: str, grads_in_fp32: bool, optimizer_dtype: str = "fp32",
                 fp8: bool = False) -> StateBytes:
    opt = OPTIMIZER_STATE_BYTES[optimizer]
    if not mixed:
        return StateBytes(4.0, 4.0, 0.0, opt)
    if layout == "zero":
        return StateBytes(2.0, 2.0, 4.0, opt)
    if layout == "megatron" and optimizer_dtype == "bf16":
        # Apex's distributed Adam in bf16 (Training.optimizer_dtype): bf16 moments; a bf16 master only for fp8
        return StateBytes(2.0, 4.0 if grads_in_fp32 else 2.0, 2.0 if fp8 else 0.0, opt / 2)
    if layout == "megatron":
        return StateBytes(2.0, 4.0 if grads_in_fp32 else 2.0, 4.0, opt)
    return StateBytes(4.0, 4.0, 0.0, opt)


def model_state_bytes(n_params: float, training: Training, zero_stage: int, shard: int,
                      offload: str = "none", n_trainable: float | None = None,
                      n_quantizable: float = 0.0, n_matmul: float = 0.0, n_linear: float = 0.0) -> dict[str, float]:
    """Itemised model-state bytes on one rank for n_params local parameters, sharded over `shard` ranks.

    ZeRO stage 1 shards master weights and optimizer state, 2 also gradients, 3 also weights. With LoRA only
    `n_trainable` parameters have gradients and optimizer state. The frozen weights that only feed a matmul
    (`n_matmul`: the blocks' linears and the head) are stored in the compute dtype, as the engine stores them
    (shardwise.lora: autocast would cast them at every use), the embedding and norms as the weights are stored;
    QLoRA stores `n_quantizable` of the matmul weights (the adapted linears) in 4-bit NF4, Transformer Engine's
    float8 the blocks' linears among them (`n_linear`, not the head) in float8 (Training.float8_frozen_weights).
    Offload moves
    optimizer state and master ('optimizer') or everything ('full') to the host.
    """
    b = state_bytes_per_param(training)
    trainable = n_params if n_trainable is None else n_trainable
    if n_trainable is None:
        weights = n_params * b.params
    else:  # LoRA: frozen base + adapters (adapters get their own full-precision treatment)
        quantized = n_quantizable if training.qlora else 0.0
        float8 = n_linear if training.float8_frozen_weights else 0.0
        matmul = max(n_matmul, quantized)
        weights = (quantized * QLORA_BITS / 8 + float8
                   + (matmul - quantized - float8) * (2.0 if training.mixed else 4.0)
                   + (n_params - matmul) * b.params + trainable * b.params)
    items = {
        "params": weights / (shard if zero_stage >= 3 else 1),
        "grads": (trainable * b.grads / (shard if zero_stage >= 2 else 1)
                  + (trainable * 2.0 if training.bf16_optimizer_active(zero_stage, offload) else 0.0)),
        "master_weights": trainable * b.master / (shard if zero_stage >= 1 else 1),
        "optimizer_state": trainable * b.optimizer / (shard if zero_stage >= 1 else 1),
    }
    if offload in ("optimizer", "full"):
        items["master_weights"] = items["optimizer_state"] = 0.0
    if offload == "full":
        items["params"] = items["grads"] = 0.0
    return items


# ---------------------------------------------------------------------------------------------------
# Activations (docs/planner.md, "Activations")


@dataclass(frozen=True)
class Term:
    """One tensor a block saves for backward: elements per token, its dtype class, how parallelism splits it.

    kind: 'stream' (residual-stream dtype), 'act' (matmul-activation dtype), 'stat' (fp32 statistics), 'f32' (an
    fp32 tensor whatever the run's dtypes), 'index' (int64 indices), 'f8' (a float8 copy, Transformer Engine's),
    'mask' (a dropout mask: bool, one byte).
    split: 'seq' (sequence-parallel tensors: / tp with SP), 'full' (the whole hidden vector on every tp rank),
    'tp' (heads or MLP columns: / tp), 'kv' (KV heads: / min(tp, n_kv)).
    """

    name: str
    elems: float
    kind: str
    split: str
    copies: int = 1


def block_terms(args: ModelArgs, training: Training, recompute: str, zero_stage: int, moe: bool = False,
                routed: float = 0.0, ep: int = 1) -> list[Term]:
    """What one block keeps for backward under a recompute policy (per token of the micro-batch). An MoE block
    (`moe`) has its attention and then moe_terms, `routed` (token, expert) pairs per token on this rank. Under
    Transformer Engine's float8 (Training.float8) the linears' inputs are kept in float8 (te_float8_terms), and
    under Training.activation_fp8_input the fused SwiGLU's (the w1 and w3 outputs)."""
    terms = _block_terms(args, training, recompute, zero_stage, moe, routed, ep)
    if training.activation_fp8_input:  # Megatron-Core's fused SwiGLU keeps its input in float8
        terms = [replace(t, kind="f8") if t.name in ("w1_out", "w3_out") else t for t in terms]
    if training.linear_dtype == "fp8" and training.float8 != "torchao" and recompute != "full" \
            and not training.lora_rank:  # a frozen weight's linear keeps no input (TE: ln_out if weight.requires_grad)
        return te_float8_terms(terms, args, moe)
    return terms


# the tensors a block keeps that are a linear's input (the norms' outputs feed Q/K/V and the MLP's first linear, the
# gate product or GELU output its last one)
TE_FLOAT8_INPUTS = frozenset({"attention_norm_output", "ffn_norm_output", "swiglu_out", "gelu_out"})


TE_FLOAT8_MOE_INPUTS = frozenset({"attention_norm_output", "expert_input", "expert_swiglu_out",
                                  "shared_swiglu_out"})
"""An MoE block's tensors that are a float8 linear's input: the attention's, and the experts' (GroupedLinear's fc1
and fc2 inputs) and shared experts' last; the FFN norm's output stays, which the 16-bit router reads."""


def te_float8_terms(terms: list[Term], args: ModelArgs, moe: bool = False) -> list[Term]:
    """A block's saved tensors as Transformer Engine keeps them in float8 training: each linear saves the float8
    (transposed) copy of its input that its weight-gradient GEMM reads, one byte an element, instead of the bf16
    tensor (TE's LayerNormLinear and Linear save their quantised input when fp8 is on). The norms' outputs and the
    MLP's last input become float8; the attention output projection's float8 input is kept beside the bf16
    attention output the attention's own backward keeps (and still kept when the attention core is recomputed).
    An MoE block (`moe`): the routed experts' inputs to fc1 and fc2 become float8 (TE's GroupedLinear), the FFN
    norm's output stays 16-bit for the router, and the shared experts' fc1 keeps its own float8 copy of it."""
    inputs = TE_FLOAT8_MOE_INPUTS if moe else TE_FLOAT8_INPUTS
    out = [replace(t, kind="f8") if t.name in inputs else t for t in terms]
    out.append(Term("wo_input_f8", args.q_dim, "f8", "tp"))
    if moe and args.n_shared_experts and any(t.name == "ffn_norm_output" for t in terms):
        out.append(Term("shared_fc1_input_f8", args.dim, "f8", "full"))
    return out


def _block_terms(args: ModelArgs, training: Training, recompute: str, zero_stage: int, moe: bool,
                 routed: float, ep: int) -> list[Term]:
    d, q, kv, f, a = args.dim, args.q_dim, args.n_kv_heads * args.head_dim, args.ffn_hidden, args.n_heads
    if recompute == "full":
        return [Term("block_input", d, "stream", "tp" if training.distribute_checkpoints else "seq")]
    matmuls = matmul_output_terms(args)
    sdpa = [Term("sdpa_out", q, "act", "tp"), Term("sdpa_lse", a, "stat", "tp")]
    if recompute == "selective" and training.selective == "alternate-matmuls" and not moe:
        # torchtitan's op-level policy: the checkpoint keeps the block input, the policy the attention's output
        # and every second matmul output in forward order (SwiGLU: wq, wv, w1, w2 kept; wk, wo, w3 recomputed)
        return [Term("block_input", d, "stream", "seq"), *matmuls[0::2], *sdpa]
    if recompute == "selective":
        # the policy keeps every matmul / SDPA output, LoRA's adapter matmuls' too; the checkpoint keeps the block input
        adapters = adapter_output_terms(args, training)
        on_attention = [t for t in adapters if t.name.split("_")[0] in ATTENTION]
        attention = [Term("block_input", d, "stream", "seq"), *matmuls[:4], *sdpa, *on_attention]
        if moe:
            return attention + moe_terms(args, training, "selective", routed, ep)
        return attention + matmuls[4:] + [t for t in adapters if t not in on_attention]
    terms = _norm_terms("attention_norm", d, training, output_split=block_norm_output_split(training),
                        autocast_copies=input_copies(training, ("wq", "wk", "wv"), training.fused_projections))
    terms += [Term("q_rotated", q, "act", "tp"), Term("k_rotated", kv, "act", "kv"), Term("v", kv, "act", "kv"),
              Term("sdpa_out", q, "act", "tp"), Term("sdpa_lse", a, "stat", "tp")]
    terms += lora_kept_terms(args, training, ATTENTION)
    if moe:
        return terms + moe_terms(args, training, "none", routed, ep)
    terms += lora_kept_terms(args, training, ("w1", "w3", "w2"))
    if args.mlp == "gelu":  # GELU's input (w1's output) and its output (w2's input)
        terms += _norm_terms("ffn_norm", d, training, output_split=block_norm_output_split(training),
                             autocast_copies=input_copies(training, ("w1",)))
        return terms + [Term(name, f, "act", "tp") for name in ("w1_out", "gelu_out") if w2_input_kept(training)
                        or name != "gelu_out"]
    terms += _norm_terms("ffn_norm", d, training, output_split=block_norm_output_split(training),
                         autocast_copies=input_copies(training, ("w1", "w3"), training.fused_projections))
    return terms + [Term(name, f, "act", "tp") for name in swiglu_saved(training)
                    if w2_input_kept(training) or name != "swiglu_out"]


def lora_kept_terms(args: ModelArgs, training: Training, names: tuple[str, ...]) -> list[Term]:
    """What the adapters on the linears among `names` keep beyond their inputs: B's matmul keeps its input, x A^T
    (adapter_output_terms' first), for B's gradient; and what LoRA's dropout keeps (lora_dropout_terms)."""
    outputs = [t for t in adapter_output_terms(args, training) if t.name.endswith("_lora_a_out")
               and t.name.split("_")[0] in names]
    return outputs + lora_dropout_terms(args, training, names)


def lora_dropout_terms(args: ModelArgs, training: Training, names: tuple[str, ...]) -> list[Term]:
    """What LoRA's dropout (Training.lora_dropout) adds to a block's saved tensors on the adapted linears among
    `names`: dropout(x) A^T B^T keeps dropout's mask, one byte an element of x (a GPU's fused kernel,
    native_dropout: shardwise.simulate.gpu_dropout), and A's matmul keeps the dropped x in place of x. The dropped
    copies of a norm's output are input_copies' (one per adapter, autocast or not), of w2's input the gate product
    w2_input_kept keeps; the dropped copy of wo's input is kept beside the attention's output, which the attention
    keeps for its own backward."""
    if not (training.lora_rank and training.lora_dropout):
        return []
    d, q, f = args.dim, args.q_dim, args.ffn_hidden
    # NeMo's dropout runs on the norm's sequence-parallel shard, before the adapter gathers it
    norm_split = norm_output_split(training)
    inputs = {"wq": (d, norm_split), "wk": (d, norm_split), "wv": (d, norm_split), "wo": (q, "tp"),
              "w1": (d, norm_split), "w3": (d, norm_split), "w2": (f, "tp")}
    # one mask per adapter (adapter_groups), named by its first linear
    adapted = [group[0][0] for group in adapter_groups(args, training) if group[0][0] in names]
    terms = [Term(f"{n}_lora_dropout_mask", elems, "mask", split) for n in adapted for elems, split in [inputs[n]]]
    return terms + [Term("wo_lora_dropped_input", q, "act", "tp")] * ("wo" in adapted)


def first_block_unkept_bytes(args: ModelArgs, training: Training, plan: Plan) -> float:
    """What the model's first block does not keep under LoRA, per micro-batch, of what block_terms prices for every
    block: autograd records an operation only when an input needs a gradient, and the first block's input (the
    frozen embedding's output) needs none, nor its frozen norms' outputs; an adapter's output first does. So its
    attention norm keeps nothing; the attention (q, k, v, its output and statistics) only after an adapter on q, k
    or v (its output also as wo's adapter's input); the MLP's norm only after an adapter in the attention; SiLU
    and the gate product their inputs only where w1's (w3's) output needs a gradient; and LoRA's dropout no mask
    where the adapter's input needs none (lora_dropout_terms; where wo's input needs none the attention does not
    keep it, and wo's dropped copy takes its place). What an adapter's own matmuls keep is kept: they train."""
    if not training.lora_rank or plan.activation_checkpoint != "none" or args.n_experts and args.is_moe_layer(0):
        return 0.0
    adapted = {n for n in projection_shapes(args) if n in training.lora_targets}
    qkv, attention = bool({"wq", "wk", "wv"} & adapted), bool(set(ATTENTION) & adapted)
    gate, up = attention or "w1" in adapted, attention or "w3" in adapted  # w1's, w3's output needs a gradient
    needs_grad = {"wq": False, "wk": False, "wv": False, "wo": qkv, "w1": attention, "w3": attention,
                  "w2": bool(adapted - {"w2"})}
    unkept = {"attention_norm_input", "attention_norm_rstd"}
    unkept |= set() if qkv else {"q_rotated", "k_rotated", "v", "sdpa_lse"} | (set() if "wo" in adapted else
                                                                                 {"sdpa_out"})
    unkept |= set() if attention else {"ffn_norm_input", "ffn_norm_rstd"}
    if training.swiglu != "fused":  # SiLU keeps w1's output, the product each factor for the other's gradient
        unkept |= (set() if gate else {"w1_out", "w3_out"}) | (set() if up or args.mlp == "gelu" else {"silu_out"})
    terms = [t for t in block_terms(args, training, "none", plan.zero_stage) if t.name in unkept]
    terms += [t for t in lora_dropout_terms(args, training, tuple(adapted)) if not needs_grad[t.name[:2]]]
    tokens = plan.micro_batch * training.seq_len / plan.cp
    return tokens * sum(term_bytes(t, args, training, plan) for t in terms)


def input_copies(training: Training, consumers: tuple[str, ...], one_linear: bool = False) -> int:
    """Copies of a norm's output that the linears it feeds (`consumers`) keep for backward: under autocast (fp32
    stream, low-precision matmuls) each casts its own, else they share the tensor; consumers that are `one_linear`
    (Q, K and V, or w1 and w3, as one projection: Training.fused_projections) cast and keep one. Under LoRA
    only the adapted linears keep one (their adapter's A needs it): autograd keeps a matmul's input for its
    weight's gradient, which a frozen weight does not have."""
    n = sum(c in training.lora_targets for c in consumers) if training.lora_rank else len(consumers)
    n = min(n, 1) if one_linear else n
    # under LoRA's dropout each adapter keeps its own dropped copy (lora_dropout_terms)
    own = training.act_bytes != training.stream_bytes or bool(training.lora_rank and training.lora_dropout)
    return n if own else min(n, 1)


def w2_input_kept(training: Training) -> bool:
    """Whether w2 keeps its input (the gate product, GELU's output) for backward: trained, or adapted under LoRA."""
    return not training.lora_rank or "w2" in training.lora_targets


def swiglu_saved(training: Training, prefix: str = "") -> list[str]:
    """What a SwiGLU MLP keeps for backward beyond its input norm (Training.swiglu): eager operators keep the w1
    and w3 outputs (SiLU's input, the product's right factor), SiLU's output (the product's left factor) and the
    gate product (w2's input). A fused SwiGLU keeps its input only and recomputes SiLU in backward: Megatron-Core's
    SwiGLUFunction (megatron/core/fusions/fused_bias_swiglu.py, on by default with --swiglu:
    --bias-swiglu-fusion) saves the fc1 output, w1 and w3 side by side. w2 keeps the product either way."""
    names = ("w1_out", "w3_out", "swiglu_out") if training.swiglu == "fused" else \
        ("w1_out", "silu_out", "w3_out", "swiglu_out")
    return [prefix + name for name in names]


def matmul_output_terms(args: ModelArgs) -> list[Term]:
    """A dense block's matmul outputs, per token, in forward order (a GELU MLP has no w3)."""
    d, q, kv, f = args.dim, args.q_dim, args.n_kv_heads * args.head_dim, args.ffn_hidden
    outputs = {"wq": Term("wq_out", q, "act", "tp"), "wk": Term("wk_out", kv, "act", "kv"),
               "wv": Term("wv_out", kv, "act", "kv"), "wo": Term("wo_out", d, "act", "full"),
               "w1": Term("w1_out", f, "act", "tp"), "w3": Term("w3_out", f, "act", "tp"),
               "w2": Term("w2_out", d, "act", "full")}
    return [outputs[name] for name in projection_shapes(args)]


def adapter_output_terms(args: ModelArgs, training: Training) -> list[Term]:
    """The outputs of LoRA's two matmuls on each of a block's adapted linears (shardwise.lora.LoRALinear), in forward
    order: x A^T, `rank` wide (A replicated beside a column-parallel base, a partial sum beside a row-parallel one:
    whole on every tp rank), and its product with B^T, as wide and split as the base's output. None without LoRA."""
    rank = training.lora_rank
    if not rank:
        return []
    first = {group[0][0] for group in adapter_groups(args, training)}  # an adapter's x A^T, once (fused projections)
    return [term for out in matmul_output_terms(args) if out.name.removesuffix("_out") in training.lora_targets
            for term in ((Term(out.name.replace("_out", "_lora_a_out"), rank, "act", "full"),)
                         * (out.name.removesuffix("_out") in first)
                         + (replace(out, name=out.name.replace("_out", "_lora_b_out")),))]


def weight_pass_grad_bytes(args: ModelArgs, training: Training, plan: Plan, moe: bool = False) -> float:
    """What one block keeps, per micro-batch, between zero-bubble's input pass and its deferred weight pass
    beyond its saved activations: the gradient arriving at each node where a weight's branch leaves the input
    gradient's path (torch.distributed.pipelining's stage_backward_input keeps them for stage_backward_weight),
    the shape of that node's output: each matmul's output and each trained norm's output. An MoE block's
    experts and router: their matmul outputs (moe_terms' selective set, which is exactly those)."""
    terms = matmul_output_terms(args)
    if moe:
        terms = terms[:4] + moe_terms(args, training, "selective", routed_per_token(args, training, plan), plan.ep)
    if not training.lora_rank:
        terms += [Term("norm_output_grad", args.dim, "stream", "seq")] * 2
    tokens = plan.micro_batch * training.seq_len / plan.cp
    return tokens * sum(term_bytes(t, args, training, plan) for t in terms)


# the saved tensors only the nodes a weight pass runs keep (each matmul saves its input and weight, the norms'
# weight products their normalised input): the norms' outputs (the attention's and MLP's matmul inputs), the
# normalised inputs, the MLP's gate product or GELU output (w2's input), the experts' inputs (and their and the
# shared experts' gate products, w2's input; TE's float8 copy of the norm output for the shared experts). (The
# attention's output is also saved by the attention, which the weight pass does not run.)
WEIGHT_PASS_INPUTS = frozenset({"attention_norm_output", "attention_norm_normalized", "ffn_norm_output",
                                "ffn_norm_normalized", "swiglu_out", "gelu_out", "expert_input", "wo_input_f8",
                                "expert_swiglu_out", "shared_swiglu_out", "shared_fc1_input_f8"})


def weight_pass_leftover_bytes(args: ModelArgs, training: Training, plan: Plan, moe: bool = False) -> float:
    """Full recompute under zero-bubble: what the weight pass's rebuild of one block keeps until the pass ends.
    The rebuild remakes every tensor the block saves (its 'none' set) at once. The weight pass runs only the
    nodes on a weight's branch (the matmuls, the norms' weight products), each unpacking what it saved; what
    only the input pass's nodes saved (the norms' inputs and statistics, the rotated queries and keys, the
    values, the attention's output and statistics, the MLP's w1 and w3 outputs and SiLU) stays until the graph
    is freed at the pass's end."""
    routed = routed_per_token(args, training, plan) if moe else 0.0
    terms = block_terms(args, training, "none", plan.zero_stage, moe, routed, plan.ep)
    tokens = plan.micro_batch * training.seq_len / plan.cp
    read = tokens * sum(term_bytes(t, args, training, plan) for t in terms if t.name in WEIGHT_PASS_INPUTS)
    return layer_activation_bytes(args, training, plan, recompute="none", moe=moe) - read


def moe_terms(args: ModelArgs, training: Training, recompute: str, routed: float, ep: int) -> list[Term]:
    """What a mixture of experts (shardwise.moe.MoE) keeps for backward, per token, after the attention; every tp
    rank runs it whole on the whole sequence (split 'full'), or under Megatron-Core's experts (Training.moe_layer
    'megatron-core': expert tensor parallelism 1) on its sequence-parallel shard (split 'seq'). `routed`: (token,
    expert) pairs this rank's experts compute per token of its micro-batch (experts.routed_per_token: top_k, times
    the imbalance under ep). The tensors are shardwise's engine's (_moe_terms) or Megatron-Core's
    (megatron_moe_terms, for every recompute policy but full: its selective recompute is the attention core's)."""
    if training.moe_layer == "megatron-core":
        return megatron_moe_terms(args, training, routed, ep)
    return _moe_terms(args, training, recompute, routed, ep)


def megatron_moe_terms(args: ModelArgs, training: Training, routed: float, ep: int) -> list[Term]:
    """What Megatron-Core's MoELayer keeps for backward, per token of the rank's sequence-parallel shard (split 'seq':
    expert tensor parallelism 1, each tp rank routing its own tokens), read in Megatron-LM core_r0.17.0
    (transformer/moe: moe_layer.py, router.py, token_dispatcher.py, moe_utils.py, experts.py TEGroupedMLP) with
    Transformer Engine 2's fused permutation and router (moe_permute_fusion, moe_router_fusion):

    * the pre-MLP norm (TENorm, alone: the router and the experts both read its output) its input and rstd, and the
      router's linear (RouterGatingLinearFunction) its input, the norm's output, 16-bit (not a float8 linear);
    * the fused top-k its fp32 scores and its routing map (one byte an expert), the auxiliary loss's score
      function its own fp32 scores;
    * the permutation (moe_permute_with_probs) its row map, int32 [tokens, 2 E + 1], reused by the unpermutation
      that combines the experts' outputs (the routing weights are applied inside the experts, so the combine keeps
      no tokens); with more than one local expert the sort of the received rows into local-expert order
      (sort_chunks_by_idxs) its own int32 row map, one a received row (its inverse in the combine, another, is
      not counted);
    * the grouped MLP (TEGroupedMLP): fc1 (TE's GroupedLinear) its input, the received rows (float8 under TE's
      recipes: te_float8_terms); the fused weighted SwiGLU (weighted_bias_swiglu_impl) its input, fc1's output
      of 2 expert_hidden (float8 under activation_func_fp8_input_store), and the rows' fp32 routing weights; fc2
      its input (float8 likewise);
    * shared experts (SharedExpertMLP, tp 1 only: plan.folded_experts_error) as a dense SwiGLU MLP: the norm's
      output (kept already), fc1's output and fc2's input.

    The routed rows are `routed` a token (its top_k, times the busiest rank's imbalance under ep). Not counted:
    TE's padding of each expert's rows to 16 for its float8 GEMMs (Fp8Padding's copy: under 16 rows an expert
    per micro-batch), the dispatched tokens' 16-bit buffer (freed once fc1 has quantised them)."""
    d, e, h, shared = args.dim, args.n_experts, args.expert_hidden, args.n_shared_experts * args.expert_hidden
    terms = [Term("ffn_norm_input", d, "stream", "seq"), Term("ffn_norm_rstd", 1, "stat", "seq"),
             Term("ffn_norm_output", d, "act", "seq"),
             Term("router_scores", e, "stat", "seq"), Term("routing_map", e, "mask", "seq"),
             # int32 row maps: counted as 4-byte 'stat' elements
             Term("permute_row_map", 2 * e + 1, "stat", "seq")]
    if args.aux_loss_coeff > 0:
        terms.append(Term("aux_scores", e, "stat", "seq"))
    if e // ep > 1:
        terms.append(Term("expert_sort_map", routed, "stat", "seq"))
    terms += [Term("expert_input", routed * d, "act", "seq"),
              Term("expert_fc1_out", routed * 2 * h, "f8" if training.activation_fp8_input else "act", "seq"),
              Term("expert_probs", routed, "stat", "seq"), Term("expert_swiglu_out", routed * h, "act", "seq")]
    if shared:
        terms += [Term("shared_fc1_out", 2 * shared, "act", "seq"), Term("shared_swiglu_out", shared, "act", "seq")]
    if args.z_loss_coeff > 0:
        terms += [Term("z_logits", e, "stat", "seq"), Term("z_logsumexp", 1, "stat", "seq")]
    return terms


def _moe_terms(args: ModelArgs, training: Training, recompute: str, routed: float, ep: int) -> list[Term]:
    """moe_terms as shardwise's engine keeps them, every tp rank running the MoE whole.

    none: the FFN norm (its output cast once for the router's linear and once for each of the shared experts' w1
    and w3 under autocast); the router's fp32 scores (softmax / sigmoid output), the top-k expert indices, the
    gathered weights and their normaliser (route_norm); the combine weights; the int64 indices of the gather of
    the routed copies and of their scatter back; the experts' input and their SwiGLU (w1, SiLU and w3 outputs and
    the gate product, as a dense MLP's); the experts' outputs as scattered back (index_copy keeps its source for
    its shape); under ep > 1 the permutation of the received copies into expert order and the experts' outputs it
    puts back (the engine's index_copy); the combined copies the weights multiply; the shared experts' SwiGLU; the
    balancing loss's score sum.
    selective (the engine's policy keeps the outputs of the matmuls and the experts' grouped GEMMs; the engine
    refuses it with ep > 1, see layout.engine_cannot_run): the router's logits, the experts' w1, w3 and w2 outputs,
    the shared experts' w1, w3 and w2 outputs."""
    d, k, h = args.dim, args.top_k, args.expert_hidden
    shared, kept = args.n_shared_experts * h, args.top_k * kept_share(args)
    if recompute == "selective":
        logits = "f32" if args.router_dtype == "fp32" else "act"  # the matmul's output: fp32 under router_dtype fp32
        terms = [Term("router_logits", args.n_experts, logits, "full"),
                 Term("expert_w1_out", routed * h, "act", "full"), Term("expert_w3_out", routed * h, "act", "full"),
                 Term("expert_w2_out", routed * d, "act", "full")]
        if shared:
            terms += [Term("shared_w1_out", shared, "act", "full"), Term("shared_w3_out", shared, "act", "full"),
                      Term("shared_w2_out", d, "act", "full")]
        return terms
    autocast = training.act_bytes != training.stream_bytes
    casts = 1 + (2 if shared else 0)
    terms = _norm_terms("ffn_norm", d, training, autocast_copies=casts if autocast else 1, output_split="full")
    terms += [Term("router_scores", args.n_experts, "stat", "full"), Term("topk_experts", k, "index", "full")]
    if args.route_norm:
        terms += [Term("route_weights", k, "stat", "full"), Term("route_normaliser", 1, "stat", "full")]
    if training.moe_dispatch == "deepep":
        # DeepEP's dispatch (Training.moe_dispatch): the grouped GEMM's input in expert order; the fused permute's
        # row map, an int32 for each received row and local expert (rows: a token's per destination rank, times
        # the imbalance); each copy's routing weight, which the fused weighted SwiGLU multiplies in and keeps with
        # its input (w1's and w3's outputs), whatever the system's dense SwiGLU; its output, w2's input. The combine
        # keeps nothing of the experts' outputs
        rows = deepep_rows(args, training, ep, routed)
        terms += [Term("expert_input", routed * d, "act", "full"),
                  Term("expert_row_map", rows * args.n_experts / ep, "stat", "full"),
                  Term("expert_probs", routed, "stat", "full")]
        terms += [Term(name, routed * h, "act", "full") for name in ("expert_w1_out", "expert_w3_out",
                                                                      "expert_swiglu_out")]
    else:
        terms += [Term("combine_weights", k, "act", "full"), Term("gather_index", kept, "index", "full"),
                  Term("scatter_index", kept, "index", "full"), Term("expert_input", routed * d, "act", "full")]
        terms += [Term(name, routed * h, "act", "full") for name in swiglu_saved(training, "expert_")]
        # the scatter of the experts' outputs back to token order (index_copy) keeps its source for its shape: the
        # combined copies, and under ep > 1 also the experts' own outputs that the engine puts back in source order
        terms.append(Term("scatter_source", kept * d, "act", "full"))
        if ep > 1:
            terms += [Term("expert_order", routed, "index", "full"), Term("expert_output", routed * d, "act", "full")]
        terms.append(Term("combine_out", kept * d, "act", "full"))
    if shared:
        terms += [Term(name, shared, "act", "full") for name in swiglu_saved(training, "shared_")]
    if args.aux_loss_coeff > 0:
        terms.append(Term("aux_score_sum", 1, "stat", "full"))
    if args.z_loss_coeff > 0:  # logsumexp's backward keeps its input and output, the square's its input (the same)
        terms += [Term("z_logits", args.n_experts, "stat", "full"), Term("z_logsumexp", 1, "stat", "full")]
    return terms


def block_norm_fused(training: Training) -> bool:
    """A block's RMSNorm keeps (input, rstd) only: torch's fused kernel, or the kernel torch.compile generates for a
    compiled block (its partitioner recomputes the upcast and x * rstd, measured in tests/test_planner_system.py).
    The final norm sits outside the compiled blocks (torchtitan compiles each block): fused_rmsnorm alone."""
    return training.fused_rmsnorm or training.compile


def _norm_terms(name: str, d: int, training: Training, autocast_copies: int,
                output_split: str | None = None, in_block: bool = True) -> list[Term]:
    # input and rstd are what the norm's backward needs; the composite form also saves x * rstd for the weight grad,
    # which a frozen weight (LoRA) does not have. The composite form computes in fp32 ("upcast is needed for fp16
    # and bf16": torch's CompositeImplicitAutograd rms_norm before its fused kernel, and Hugging Face's
    # LlamaRMSNorm): its square and its product with rstd save the upcast input, 4 bytes an element whatever the
    # stream's dtype, and the weight's product saves x * rstd cast back to the stream's (block_norm_fused: a
    # compiled block's norm keeps what the fused kernel does)
    composite = not (block_norm_fused(training) if in_block else training.fused_rmsnorm)
    terms = [Term(f"{name}_input", d, "f32" if composite else "stream", "seq"), Term(f"{name}_rstd", 1, "stat", "seq")]
    if composite and not training.lora_rank:
        terms.append(Term(f"{name}_normalized", d, "stream", "seq"))
    split = output_split or norm_output_split(training)
    terms.append(Term(f"{name}_output", d, "act", split, copies=autocast_copies))
    return terms


def norm_output_split(training: Training) -> str:
    """How a norm's kept output is split: it feeds column-parallel linears, and torch (DTensor) saves their
    all-gathered, full-sequence input; Megatron saves the sequence-parallel shard and gathers it again in backward
    (Korthikanti et al., 4.2.2)."""
    return "seq" if training.layout == "megatron" else "full"


def block_norm_output_split(training: Training) -> str:
    """norm_output_split of a block's norms, which under LoRA only the adapters keep: NeMo's (layout 'megatron')
    take the whole sequence for their A (ParallelLinearAdapter: gather_from_sequence_parallel_region after the
    dropout, or Transformer Engine's gathered norm output, return_layernorm_output_gathered; linear_in a column-
    parallel linear without sequence parallelism keeps its input for A's gradient)."""
    return "full" if training.layout == "megatron" and training.lora_rank else norm_output_split(training)


TERM_BYTES = {"stat": 4, "f32": 4, "index": 8, "f8": 1, "mask": 1}


def term_bytes(term: Term, args: ModelArgs, training: Training, plan: Plan) -> float:
    """Bytes per token of one term on one rank."""
    size = {"stream": training.stream_bytes, "act": training.act_bytes, **TERM_BYTES}[term.kind]
    div = {"seq": plan.tp if plan.sequence_parallel else 1, "full": 1, "tp": plan.tp,
           "kv": kv_split(args, plan.tp)}[term.split]
    return term.elems * size * term.copies / div


def layer_activation_bytes(args: ModelArgs, training: Training, plan: Plan, recompute: str | None = None,
                           seq_len: int | None = None, attention_scores: bool = True, moe: bool = False,
                           dequantised: bool = True) -> float:
    """Bytes one block (an MoE block with `moe`) keeps for backward for one micro-batch on one rank (tokens =
    micro_batch x seq / cp).

    With unfused attention (`Training.fused_attention` False) also the s x s tensors Korthikanti et al. count,
    5 a s^2 b bytes in 16-bit with dropout (softmax output and dropout output in the activation dtype, the
    dropout mask in one byte; 2 a s^2 b without dropout), split over tp by heads, unless recomputed: their
    selective recompute is exactly these, and keeps every other tensor (`attention_scores` False: leave them
    out). With `Training.dropout`, the two hidden dropout masks (1 byte per element of the residual stream,
    split over tp only with sequence parallelism), unless fully recomputed. A compiled QLoRA block also keeps its
    adapted linears' dequantised weights (`dequantised` False: leave them out, as the elementwise traffic does)."""
    recompute = plan.activation_checkpoint if recompute is None else recompute
    if recompute == "selective" and training.selective == "none":  # plan.engine_error's refusal, for evaluate
        raise PlannerError("--plan activation_checkpoint", f"selective, and {training.system} has no op-level "
                           "selective checkpointing (selective = none)",
                           "use activation_checkpoint=none or full, or a system with selective checkpointing")
    seq = seq_len or training.seq_len
    tokens = plan.micro_batch * seq / plan.cp
    unfused = not training.fused_attention
    if unfused and recompute == "none" and attention_scores:
        kept = 2 * training.act_bytes + 1 if training.dropout else training.act_bytes
        total = tokens * args.n_heads / plan.tp * seq * kept
    else:
        total = 0.0
    if training.dropout and recompute != "full":
        total += 2 * tokens * args.dim / (plan.tp if plan.sequence_parallel else 1)
    core = recompute == "selective" and (unfused or training.selective == "attention-core")
    if core:
        recompute = "none"  # the attention core's recompute keeps every other tensor
    total += tokens * _per_token(args, training, plan, recompute, moe)
    if training.qlora and training.compile and recompute == "none" and dequantised:
        # a compiled block keeps each adapted linear's dequantised base weight for its input gradient (AOTAutograd's
        # partitioner saves it rather than rebuild it from the NF4 codes: tests/test_planner_system.py), once a
        # micro-batch; eager torchao keeps the NF4 weight and dequantises again (down_projection_backward_bytes).
        # A selective policy that recomputes all but the matmuls (shardwise's, torchtitan's) rebuilds it instead
        # (the partitioner takes their PREFER_RECOMPUTE as must-recompute); attention-core selective keeps it
        total += adapted_base_params(args, training, plan.tp) * training.act_bytes
    if recompute == "selective":
        total += kept_reduce_scatter_bytes(args, training, plan, seq, moe)
    if core and not unfused:
        # a fused kernel's output and log-sum-exp are what its checkpoint drops (Megatron-Core's selective
        # recompute of core_attn): the forward kernel runs again in backward from the kept q, k, v
        total -= tokens * (args.q_dim * training.act_bytes + args.n_heads * TERM_BYTES["stat"]) / plan.tp
    if recompute == "none" and training.act_bytes != 4 and training.layout == "torch":
        # shardwise's apply_rotary casts the halves of the fp32 cos/sin table it uses to the activation dtype for q
        # and for k, and saves them: 2 (seq, head_dim) copies per block, independent of the batch
        total += 2 * seq / plan.cp * args.head_dim * training.act_bytes
    return total


def kept_reduce_scatter_bytes(args: ModelArgs, training: Training, plan: Plan, seq: int, moe: bool = False) -> float:
    """Bytes of the reduce-scatters' outputs a block keeps under selective recompute with sequence parallelism:
    torchtitan's op-level policy keeps them (`_c10d_functional.reduce_scatter_tensor` is in its `_save_list`),
    wo's and w2's (an MoE block's attention has the one), each a rank's slice of the sequence; the engine's policy
    and Megatron's keep none."""
    if not (training.selective == "alternate-matmuls" and training.fused_attention and plan.tp > 1
            and plan.sequence_parallel):
        return 0.0
    return (1 if moe else 2) * plan.micro_batch * seq / plan.cp * args.dim * training.act_bytes / plan.tp


def _per_token(args: ModelArgs, training: Training, plan: Plan, recompute: str, moe: bool = False) -> float:
    routed = routed_per_token(args, training, plan) if moe else 0.0
    key = (args, training, recompute, plan.tp, plan.sequence_parallel, plan.zero_stage >= 3, moe, routed, plan.ep)
    cached = _PER_TOKEN.get(key)
    if cached is None:
        terms = block_terms(args, training, recompute, plan.zero_stage, moe, routed, plan.ep)
        cached = _remember(_PER_TOKEN, key, sum(term_bytes(t, args, training, plan) for t in terms))
    return cached


_PER_TOKEN: dict[tuple, float] = {}  # a pure function's memo: keys hold every input it reads
MEMO_LIMIT = 200_000  # entries per memo before it is emptied, so a long-lived process does not grow without end


def _remember(memo: dict, key: tuple, value):
    if len(memo) >= MEMO_LIMIT:
        memo.clear()
    memo[key] = value
    return value


def head_activation_bytes(args: ModelArgs, training: Training, plan: Plan, seq_len: int | None = None) -> float:
    """Last stage: the final norm, and the output head with the loss. Unfused: the head's input, the loss's
    saved fp32 log-probabilities and the int64 targets. Fused (fused_head): the gradients the fused head and loss
    make in forward and keep for backward, that of the norm output (in the stream's dtype) and, when the head
    trains, that of its weight (fp32: head_weight_grad_bytes)."""
    tokens = plan.micro_batch * (seq_len or training.seq_len) / plan.cp
    terms = _norm_terms("final_norm", args.dim, training, autocast_copies=1, in_block=False)
    if fused_head(training, plan):
        per_token = sum(term_bytes(t, args, training, plan) for t in terms[:-1])  # the output is not saved
        return (per_token + args.dim * training.stream_bytes) * tokens + head_weight_grad_bytes(args, training, plan)
    per_token = sum(term_bytes(t, args, training, plan) for t in terms)
    if training.loss_kernel:  # the kernel keeps the logits (compute dtype) and each row's fp32 log-sum-exp
        per_token += training.act_bytes * loss_vocab(args, training, plan) + 4
    else:
        per_token += 4 * loss_vocab(args, training, plan)  # log_softmax output, fp32
    per_token += 8  # int64 targets
    return per_token * tokens


def fused_head(training: Training, plan: Plan) -> bool:
    """shardwise's engine fuses the output head with the loss (shardwise.loss.head_loss_sum) wherever the head is
    a plain linear (shardwise.model.fuse_head_loss): with or without tensor parallelism (the fused loss is then
    vocabulary-parallel), and on a pipeline's last stage (in the schedule's loss). Other systems
    (Training.fuse_head) materialise the logits."""
    return training.fuses_head


def head_weight_grad_bytes(args: ModelArgs, training: Training, plan: Plan) -> float:
    """The fused head's weight gradient (fp32; this rank's vocabulary rows under tp), made in the loss's forward;
    none when the head is frozen (LoRA)."""
    if training.lora_rank or not fused_head(training, plan):
        return 0.0
    return args.vocab_size / plan.tp * args.dim * 4.0


def loss_vocab(args: ModelArgs, training: Training, plan: Plan) -> float:
    """Logit columns the loss sees per token on one rank: V / t with a vocab-parallel loss; V in shardwise's
    engine, whose head all-gathers the logits so that the loss runs as on one device."""
    return args.vocab_size / plan.tp if training.loss_parallel else args.vocab_size


def embedding_activation_bytes(args: ModelArgs, training: Training, plan: Plan, seq_len: int | None = None) -> float:
    """First stage: the embedding's backward needs only the int64 token ids; with a LayerNorm on the embedding's
    output (Training.embedding_norm, BLOOM's), which no block's checkpoint covers, also its input in the compute
    dtype and its fp32 statistics, and Megatron's dropout after it keeps its one-byte mask."""
    tokens = plan.micro_batch * (seq_len or training.seq_len) / plan.cp
    if not training.embedding_norm:
        return 8 * tokens
    width = args.dim / plan.tp if plan.sequence_parallel else args.dim
    return tokens * (8 + width * (training.act_bytes + (1 if training.dropout else 0)) + 8)


def bf16_optimizer_segments(args: ModelArgs, training: Training, plan: Plan, stage: int) -> float:
    """Bytes of the two transients DeepSpeed's BF16_Optimizer (Training.keeps_bf16_grads) makes that no cached block
    can hold, as the code BLOOM ran had it (DeepSpeed's bf16 branch of 2022-02-27 to 03-01, Megatron-DeepSpeed
    00f5f889; docs/planner.md, "BLOOM's layout search"): each takes a new segment, which the caching allocator then
    keeps, so it adds to the memory the device shows (an inference about the allocator, not measured):
    - after every micro-batch's backward, update_hp_grads adds each bf16 gradient into the fp32 buffer through an
      fp32 copy of it: 4 bytes times the stage's largest parameter (the vocabulary-parallel embedding, on the
      first and last stages);
    - once a step, the pipeline engine all-reduces each fp32 gradient group through a bf16 copy of the whole group
      (communication_data_type bf16 under bf16; every group larger than its 5e8-element bucket): 2 bytes times
      the largest of Megatron-DeepSpeed's groups, whose weight-decay list (the embeddings, an embedding norm's
      weight, each block's four weight matrices, in model order) is cut into two halves by count."""
    if not (training.bf16_optimizer_active(plan.zero_stage, plan.offload) and training.bf16_grad_transients):
        return 0.0
    shape = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split)
    emb = args.vocab_size * args.dim / plan.tp
    first = [emb] + ([float(args.dim)] if training.embedding_norm else []) if stage == 0 else []
    last = [emb] if shape.last and not (stage == 0 and args.tie_embeddings) else []
    weights = first + block_modules(args, plan.tp) * (shape.layers - shape.moe_layers) + last
    half = len(weights) // 2
    return 4 * max(weights) + 2 * max(sum(weights[:half]), sum(weights[half:]))


def in_flight(plan: Plan, stage: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of the rank's whole layer set.

    GPipe runs all M forwards first: M. 1F1B: rank i warms up with P - i forwards, then alternates: min(P - i, M).
    Interleaved (Narayanan et al. 2021): rank i runs 2(P - i - 1) + (v - 1)P + 1 chunk forwards before its first
    backward, each chunk 1/v of its layers; for rank 0 that is P + (P - 1)/v stage-equivalents.
    Zero-bubble, as the engine runs it (ZBV: two stages per rank in a V, Qi et al. 2024, "Pipeline Parallelism
    with Controllable Memory"), balances memory over the ranks: each holds what 1F1B's first rank holds, P
    micro-batches of its layers, min(P, M). (That count decides only when gradients exist; the bytes held are
    _zero_bubble_held's walk of the rank's order, chunk by chunk.)
    """
    p, m, v = plan.pp, plan.grad_accum, plan.virtual_stages
    if p == 1:
        return 1.0
    if plan.pp_schedule == "gpipe":
        return float(m)
    if plan.pp_schedule == "interleaved-1f1b":
        chunks = min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)
        return chunks / v
    if plan.pp_schedule == "zero-bubble":
        return float(min(p, m))
    return float(min(p - stage, m))


# ---------------------------------------------------------------------------------------------------
# Transient buffers (docs/planner.md, "Transient buffers")


def block_backward_bytes(args: ModelArgs, training: Training, plan: Plan, moe: bool = False,
                         accumulating: bool = False, weight_grads: bool = True) -> dict[str, float]:
    """The first block's backward at its largest, the largest of three moments (by what each adds to the saved
    activations, _block_backward_net).

    Inside the down projection's backward (w2, the block's first matmul backward; `weight_grads`: a backward
    that makes weight gradients, not zero-bubble's input pass), at the cast of w2's weight gradient: the block's
    output gradient (in the stream dtype and, under autocast, cast for the matmul), w2's input gradient and its
    weight gradient, in the compute dtype where the weight was cast ('working') and in the parameter's
    ('weight_grad'); the gate product w2 kept is freed ('freed'). Without a cast the moment is the weight gradient's
    making, the gate product still held. Counted on the simulator's tracker, op by op.

    Inside the MLP's SiLU backward: the gate product's backward has freed its saved SiLU and w3 outputs (2 f/t
    per token, 'freed') and written the gradients of both, and SiLU's backward writes the gradient of the w1
    output (3 f/t, 'working', with the residual-stream gradient, d); w2's weight gradient already exists in fp32
    ('weight_grad': under autocast the matmul's low-precision gradient is cast up and accumulated into the fp32
    parameter's gradient). A GELU MLP: inside GELU's backward, w2's backward has freed the GELU output it kept
    (f/t) and written its gradient, and GELU's backward writes the gradient of w1's output (2 f/t working).

    Inside the FFN norm's backward, once the MLP's is done (ffn_norm_backward_bytes): every MLP weight's gradient
    exists, the MLP's saved tensors, the norm output's copies and (without recompute) the MLP's compute-dtype
    weight copies are freed, and the norm's backward works on the stream. On the simulator the SiLU's moment is
    the larger without recompute (Llama 2 7B: what the norm's has freed outweighs its three weight gradients)
    and the norm's with full recompute (Llama 3 70B and Llama 2 7B under tp).

    With recompute the block's activations are first rebuilt ('recomputed': its none set less what the policy kept
    of it, kept_beyond_autograd),
    and under autocast the replayed forward casts the block's weights again: the copies its matmuls have not
    yet released ('copies_rebuilt'). Under gradient accumulation (`accumulating`: the rank's gradients exist
    from an earlier micro-batch) a weight's new gradient is a temporary until it is added to them ('pending':
    w2's at its own moment; the other moments come after their weights' gradients were added).
    An MoE block (`moe`): inside its routed experts' SwiGLU, whose f/t per token is expert_hidden per routed pair,
    and w2's gradient of every expert the rank holds; under recompute, or inside the replayed forward at the
    return of the experts' outputs (moe_dispatch_bytes), whichever is larger. Its rows are the tokens the rank
    routes (Megatron-Core's: its sequence-parallel shard, experts.moe_token_split)."""
    block_tokens = plan.micro_batch * training.seq_len / plan.cp  # (term_bytes splits each term itself)
    tokens = block_tokens / (moe_token_split(training, plan) if moe else 1)
    e = training.act_bytes
    if moe:
        f = routed_per_token(args, training, plan) * args.expert_hidden
        weight_grad = expert_params(args, plan.ep) / 3
    else:
        f = args.ffn_hidden / plan.tp
        weight_grad = args.dim * f
    freed, working = (1, 2) if args.mlp == "gelu" and not moe else (2, 3)
    grad_bytes = 0.0 if training.lora_rank else unsharded_grad_bytes(training)
    out = {"freed": tokens * freed * f * e, "working": tokens * (working * f * e + args.dim * training.stream_bytes),
           "weight_grad": weight_grad * grad_bytes, "copies_freed": 0.0, "recomputed": 0.0, "pending": 0.0,
           "copies_rebuilt": 0.0 if moe else _recast_copies(args, training, plan, but_w2=True)}
    if not moe:
        moments = [out, ffn_norm_backward_bytes(args, training, plan)]
        if weight_grads:
            moments.append(down_projection_backward_bytes(args, training, plan))
        out = max(moments, key=functools.partial(_block_backward_net, accumulating=accumulating))
    if plan.activation_checkpoint != "none":
        # what the replay makes: the no-recompute set less what the policy kept of it (a policy may also keep
        # tensors that set lacks, as wq's output beside the rotated q it replays: those are not rebuilt)
        out["recomputed"] = (layer_activation_bytes(args, training, plan, "none", moe=moe)
                             - layer_activation_bytes(args, training, plan, moe=moe)
                             + block_tokens * kept_beyond_autograd(args, training, plan, moe))
        if moe:
            # the replayed forward also casts the experts again; at the return of their outputs it holds the
            # dispatch's buffers, before any gradient of the block exists: the larger of that and the SiLU's
            out["recomputed"] += routed_copy_bytes(args, training, plan)
            replay = {"freed": 0.0, "working": tokens * moe_dispatch_bytes(args, training, plan), "weight_grad": 0.0,
                      "copies_freed": 0.0, "recomputed": out["recomputed"], "pending": 0.0, "copies_rebuilt": 0.0}
            out = max(out, replay, key=functools.partial(_block_backward_net, accumulating=accumulating))
    return out


def same_tensor(args: ModelArgs, plan: Plan) -> dict[str, str]:
    """A policy's kept tensors that the no-recompute set may hold under another name: the block's input is the
    attention norm's input (unless the norm saves an fp32 upcast of a 16-bit stream: another tensor, which a replay
    makes again), v is a view of wv's output, the experts' grouped w2 output is what the scatter back to token
    order keeps as its source (ep 1: the engine's index_copy; under ep the put back in source order's), and an fp32
    router's logits are what the z-loss keeps (`.float()` of an fp32 tensor is the tensor)."""
    alias = {"block_input": "attention_norm_input", "wv_out": "v",
             "expert_w2_out": "scatter_source" if plan.ep == 1 else "expert_output"}
    if args.router_dtype == "fp32":
        alias["router_logits"] = "z_logits"
    return alias


def kept_beyond_autograd(args: ModelArgs, training: Training, plan: Plan, moe: bool = False) -> float:
    """Bytes per token of what a block keeps under its recompute policy that it would not keep without recompute:
    a selective policy's matmul outputs whose consumers save something else (wq's and wk's outputs beside the
    rotated q and k, wo's and w2's, the router's logits; a frozen LoRA linear's, which no backward reads), and the
    reduce-scatters' outputs torchtitan's policy keeps under sequence parallelism (kept_reduce_scatter_bytes). Its
    replay still rebuilds all of the no-recompute set it did not keep, so the replay's bytes are that set's less
    the kept ones plus these. None for the attention core's recompute, which keeps the rest."""
    recompute = plan.activation_checkpoint
    if recompute == "none" or recompute == "selective" and (not training.fused_attention
                                                              or training.selective == "attention-core"):
        return 0.0
    routed = routed_per_token(args, training, plan) if moe else 0.0
    # memoised as _per_token (a search asks for every micro-batch and dp split): the key holds what the terms read
    key = (args, training, recompute, plan.tp, plan.sequence_parallel, plan.zero_stage, moe, routed, plan.ep)
    cached = _BEYOND.get(key)
    if cached is None:
        cached = _remember(_BEYOND, key, _kept_beyond(args, training, plan, recompute, moe, routed))
    return cached


_BEYOND: dict[tuple, float] = {}


def _kept_beyond(args: ModelArgs, training: Training, plan: Plan, recompute: str, moe: bool, routed: float) -> float:
    held = {t.name: term_bytes(t, args, training, plan)
            for t in block_terms(args, training, "none", plan.zero_stage, moe, routed, plan.ep)}
    kept = [(t, term_bytes(t, args, training, plan))
            for t in block_terms(args, training, recompute, plan.zero_stage, moe, routed, plan.ep)]
    alias = same_tensor(args, plan)
    beyond = sum(size for t, size in kept if held.get(alias.get(t.name, t.name)) != size)
    if recompute == "selective":
        tokens = plan.micro_batch * training.seq_len / plan.cp
        beyond += kept_reduce_scatter_bytes(args, training, plan, training.seq_len, moe) / tokens
    return beyond


def _block_backward_net(parts: dict[str, float], accumulating: bool = False) -> float:
    # 'recomputed' is the same at every moment and is set after the choice; under accumulation a moment's weight
    # gradients are added to the rank's (counted once, as its gradients) but for the one being added ('pending')
    made = parts["pending"] if accumulating else parts["weight_grad"]
    return parts["working"] + made + parts["copies_rebuilt"] - parts["freed"] - parts["copies_freed"]


def _recast_copies(args: ModelArgs, training: Training, plan: Plan, but_w2: bool = False,
                   attention_only: bool = False) -> float:
    """The compute-dtype copies of a dense block's matmul weights that a replayed forward casts again (recompute
    under casts_weights; weight_copy_bytes counts none for a recomputed block), all of them or those a moment of
    its backward still holds: all but w2's, or the attention's."""
    if not casts_weights(training) or plan.activation_checkpoint == "none":
        return 0.0
    if attention_only:
        return attention_params(args, plan.tp) * training.act_bytes
    n = layer_params(args, plan.tp) - 2 * args.dim - (args.dim * args.ffn_hidden / plan.tp if but_w2 else 0.0)
    return n * training.act_bytes


def down_projection_backward_bytes(args: ModelArgs, training: Training, plan: Plan) -> dict[str, float]:
    """A dense block's backward inside w2's, at the cast of its weight gradient (see block_backward_bytes)."""
    tokens = plan.micro_batch * training.seq_len / plan.cp
    d, f, e = args.dim, args.ffn_hidden / plan.tp, training.act_bytes
    autocast = training.act_bytes != training.stream_bytes
    grad = 0.0 if training.lora_rank else d * f * unsharded_grad_bytes(training)
    kept_input = w2_input_kept(training)
    # QLoRA rebuilds an NF4 weight of the MLP (d x f, whichever of w1, w3, w2 is adapted) in its backward: priced
    # here, inside w2's, the MLP's first (for w1 or w3 alone an upper bound: w2's gate product is freed by theirs)
    nf4 = training.qlora and not training.compile and any(t in training.lora_targets for t in ("w1", "w3", "w2"))
    # autograd adds a new gradient to the one there (torch's engines: layouts torch and fsdp-mp); Megatron's
    # gradient-accumulation fusion makes the weight gradient's GEMM add into main_grad, and DeepSpeed's layout
    # reduces in every micro-batch: no second gradient there
    pending = grad if training.layout in ("torch", "fsdp-mp") else 0.0
    copies = casts_weights(training)
    kept = copies and plan.activation_checkpoint == "none"  # as weight_copy_bytes
    # at the cast the matmul's node is done and has released the gate product it kept (if it kept it: trained or
    # adapted); without a cast the moment is the making of the weight gradient, the gate product still held. QLoRA
    # rebuilds w2's base from its NF4 codes for the input gradient (NF4_DEQUANT_BYTES per weight)
    return {"freed": tokens * f * e if copies and kept_input else 0.0,
            "working": tokens * (f * e + d * training.stream_bytes + (d * e if autocast else 0.0))
            + (d * f * e if copies else 0.0) + (d * f * NF4_DEQUANT_BYTES if nf4 else 0.0),
            "weight_grad": grad, "pending": pending, "copies_freed": d * f * e if kept else 0.0, "recomputed": 0.0,
            "copies_rebuilt": _recast_copies(args, training, plan, but_w2=True)}


NF4_DEQUANT_BYTES = 8 + 3 * 4
"""Bytes per weight that torchao's NF4Tensor.get_original_weight holds at its largest, the interleaving stack: both
halves' 4-bit codes widened to int64 indices (8), their looked-up values, those scaled by the blocks' constants and
the stacked result, each in the dtype the weight was quantised from (shardwise.nf4 quantises the fp32 weights: 4).
The simulator's tracker measured 20.4 inside Llama 3 8B's w2 backward."""


# the fp32 token x d temporaries of the FFN norm's backward at its largest, besides the residual-stream gradient:
# the composite RMSNorm's autograd graph (grad * weight, its product with rstd, the mean's and the square's
# backward; counted on the simulator's tracker, tests/test_planner.py), a fused kernel's output and input gradients
NORM_BACKWARD_TEMPS = {False: 4, True: 2}


def ffn_norm_backward_bytes(args: ModelArgs, training: Training, plan: Plan) -> dict[str, float]:
    """A dense block's backward inside its FFN norm's backward (see block_backward_bytes): freed, the MLP's
    saved tensors (SwiGLU: w1, SiLU, w3 outputs and the gate product; GELU: w1 and GELU outputs) and the norm
    output's compute-dtype copies; working, the residual-stream gradient and the norm backward's fp32
    temporaries (NORM_BACKWARD_TEMPS) on the rank's tokens (a sequence slice under sequence parallelism);
    weight_grad, every MLP weight's gradient (FSDP reduce-scatters them only once the block's backward ends);
    copies_freed, the MLP weights' compute-dtype copies their matmuls kept (weight_copy_bytes)."""
    tokens = plan.micro_batch * training.seq_len / plan.cp
    d, f, e = args.dim, args.ffn_hidden / plan.tp, training.act_bytes
    saved, weights = (2, 2) if args.mlp == "gelu" else (4, 3)
    saved -= not w2_input_kept(training)
    copies = input_copies(training, ("w1",) if args.mlp == "gelu" else ("w1", "w3"), training.fused_projections)
    output = _norm_terms("ffn_norm", d, training, autocast_copies=copies,
                         output_split=block_norm_output_split(training))[-1]
    seq = plan.tp if plan.sequence_parallel else 1
    temps = NORM_BACKWARD_TEMPS[block_norm_fused(training)]
    kept_copies = casts_weights(training) and plan.activation_checkpoint == "none"  # as weight_copy_bytes
    return {"freed": tokens * (saved * f * e + term_bytes(output, args, training, plan)),
            "working": tokens * d * (training.stream_bytes + temps * 4) / seq,
            "weight_grad": 0.0 if training.lora_rank else weights * d * f * unsharded_grad_bytes(training),
            "copies_freed": weights * d * f * e if kept_copies else 0.0, "recomputed": 0.0, "pending": 0.0,
            # (the MLP's recast copies are released by now)
            "copies_rebuilt": _recast_copies(args, training, plan, attention_only=True)}


def moe_dispatch_bytes(args: ModelArgs, training: Training, plan: Plan) -> float:
    """Per token, what an MoE block's forward holds beyond its saved tensors at its largest, the return of the
    experts' outputs (shardwise.moe.MoE.forward, expert_parallel.exchange), less the saved tensors made after it
    (the combined copies, the shared experts' SwiGLU). Held by the caller while the experts run: the gathered
    routed copies in the stream dtype and their cast to the compute dtype (the same tensor when the dtypes
    agree); under ep > 1 also the copies received from the ep ranks, the outputs put back in source order and
    the copies the combine all-to-all returns. Under DeepEP's dispatch (Training.moe_dispatch): w2's output in
    expert order and the rows the combine returns, one per token and destination rank. A full recompute rebuilds
    it inside backward."""
    d, kept, routed = args.dim, args.top_k * kept_share(args), routed_per_token(args, training, plan)
    later_shared = 4 * args.n_shared_experts * args.expert_hidden * training.act_bytes
    if training.moe_dispatch == "deepep":
        # DeepEP's (Training.moe_dispatch): w2's output in expert order and, put back in the order received, the
        # rows the combine returns (one per token and destination rank)
        rows = deepep_rows(args, training, plan.ep, routed)
        return max(0.0, (routed + rows) * d * training.act_bytes - later_shared)
    held = kept * d * training.stream_bytes
    if training.act_bytes != training.stream_bytes:
        held += kept * d * training.act_bytes
    if plan.ep > 1:
        held += 2 * routed * d * training.act_bytes + kept * d * training.act_bytes
    later = kept * d * training.act_bytes + later_shared
    return max(0.0, held - later)


def routed_copy_bytes(args: ModelArgs, training: Training, plan: Plan) -> float:
    """The compute-dtype copies of the rank's routed experts that GroupedExperts.compute casts at each forward and
    its grouped GEMMs save: made again when a checkpointed MoE block is recomputed (the layout 'torch' under
    mixed precision; the other layouts hold low-precision weights)."""
    if not casts_weights(training):
        return 0.0
    return expert_params(args, plan.ep) * training.act_bytes


def logits_bytes(args: ModelArgs, training: Training, plan: Plan) -> float:
    """Last stage, the loss's largest working set. Unfused: inside its backward, the fp32 gradient of the
    log-probabilities and the fp32 gradient of the logits that log_softmax's backward writes, both `loss_vocab`
    wide (the log-probabilities themselves are saved activations; the low-precision logits and their fp32 upcast
    are saved by nothing and freed when the forward returns). Fused (fused_head): inside its forward, a block of
    rows (shardwise.loss.head_rows) at its largest: its fp32 logits and log-probabilities; under mixed precision,
    if larger, its fp32 gradient, that gradient in the compute dtype and the block's weight-gradient product in
    the compute dtype before it is added to the fp32 sum (none for LoRA's frozen head), or the next block's logits
    beside the previous block's log-probabilities and gradient; and under mixed precision the compute-dtype copies
    of the head's input and weight (LoRA stores its frozen head in that dtype) throughout. A cross-entropy kernel
    (Training.loss_kernel): the gradient of the logits its backward writes, in the compute dtype. torch's loss
    parallel (dtensor_loss_parallel) holds a third fp32 tensor in that backward; Megatron's (megatron_cross_entropy)
    one tensor in the compute dtype, or the fp32 logits where larger, in a forward that shifts them out of place
    (Training.ce_shift_in_place)."""
    tokens = plan.micro_batch * training.seq_len / plan.cp
    if training.loss_kernel and not fused_head(training, plan):
        # (a chunked loss, Training.loss_chunks: one chunk's gradient beyond the saved logits, which its chunk's
        # node frees as it makes it, here and below)
        return tokens * loss_vocab(args, training, plan) * training.act_bytes / training.loss_chunks
    if fused_head(training, plan):
        v, d, e = args.vocab_size / plan.tp, args.dim, training.act_bytes
        block = head_rows(int(tokens), d, int(v)) * v
        # the head's input, whole on every rank throughout: the final norm's output, which nothing saves (the fused
        # head keeps its gradient instead), or under tp its gather (from its sequence slices with sequence parallelism)
        gathered = tokens * d * training.stream_bytes
        if not training.mixed:
            return block * (4 + 4) + gathered
        # LoRA's frozen head makes no weight-gradient product, and is stored in the compute dtype (apply_lora's
        # frozen_dtype): no copy of it either, unless it is the (fp32) embedding's weight. Both were counted, 1.8 GiB
        # too many for Llama 3 8B's head
        product = 0.0 if training.lora_rank else v * d * e
        copy = v * d * e if not training.lora_rank or args.tie_embeddings else 0.0
        # a block's logits are upcast and normalised while the previous block's log-probabilities and gradient in
        # the compute dtype are still held (the loop's names): what peaks there once no weight-gradient product does
        previous = block * (4 + e) if tokens > block / v else 0.0
        return max(block * (4 + 4) + previous, block * (4 + e) + product) + tokens * d * e + copy + gathered
    if megatron_cross_entropy(training):
        # the gradient it writes into its saved fp32 softmax, cast by autograd to the logits' dtype (none in fp32);
        # a loss that shifts the logits out of place (Training.ce_shift_in_place False: nanotron's) holds the
        # upcast logits beside that softmax at the end of its forward, the larger of the two
        grad = training.act_bytes if training.act_bytes < 4 else 0.0
        return tokens * loss_vocab(args, training, plan) * (grad if training.ce_shift_in_place else max(grad, 4))
    if dtensor_loss_parallel(training, plan):  # (unchunked: Training refuses loss_chunks with a parallel loss)
        return tokens * loss_vocab(args, training, plan) * 4 * 3
    return tokens * loss_vocab(args, training, plan) * 4 * 2 / training.loss_chunks


def megatron_cross_entropy(training: Training) -> bool:
    """The loss is Megatron's vocab-parallel cross-entropy (megatron.core.tensor_parallel.cross_entropy and its fused
    twin; Megatron-LM's and Megatron-DeepSpeed's before them): an autograd function whose forward upcasts the logits
    to an fp32 copy that it normalises in place and saves as the softmax (head_activation_bytes' fp32 row), and
    whose backward writes the logits' gradient into that same tensor; autograd casts it back to the logits' dtype.
    Beside the saved softmax the loss's working set is one tensor in the compute dtype, where torch's log_softmax
    and nll_loss make two fp32 ones (tests/test_planner_system.py runs megatron-core's two implementations). The
    layouts megatron and zero under a vocab-parallel loss."""
    return training.loss_parallel and training.layout in ("megatron", "zero")


def dtensor_loss_parallel(training: Training, plan: Plan) -> bool:
    """The loss runs on vocabulary-parallel DTensor logits under torch's loss_parallel (torchtitan under tp, whose
    layouts are fsdp-mp, or torch where FSDP does not shard). Its backward
    (torch.distributed.tensor.parallel.loss._nll_loss_and_log_softmax_backward) is composite: it makes
    zeros_like(log-probabilities), adds exp(log-probabilities) to it and multiplies the sum by the incoming
    gradient, so three fp32 tensors of the logits' size are live beside the saved log-probabilities where one
    kernel's backward makes two (tests/test_planner_system.py measures the three). Megatron's vocab-parallel
    cross-entropy is its own autograd function (layouts megatron and zero)."""
    return training.loss_parallel and plan.tp > 1 and training.layout in ("torch", "fsdp-mp")


def casts_weights(training: Training) -> bool:
    """The engine casts its fp32 weights to low-precision copies for the matmuls (autocast; an MoE's routed experts
    cast themselves): shardwise's layout 'torch' under mixed precision, unless the weights are LoRA's frozen base
    (adapter_copy_bytes: the adapters' own)."""
    return training.mixed and training.layout == "torch" and not training.lora_rank


def adapter_copy_bytes(args: ModelArgs, training: Training, plan: Plan, stage: int) -> float:
    """LoRA under autocast: the compute-dtype copies of a stage's fp32 adapters, which autocast casts at their first
    use in a forward and caches (they are leaves that train), and their matmuls save for the input's gradient
    (Llama 3 8B r=16: 2.5 MiB a block)."""
    if not (training.lora_rank and training.mixed and training.layout == "torch"):
        return 0.0
    layers = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split).layers
    return layers * lora_params(args, training, plan.tp) * training.act_bytes


def weight_copy_bytes(args: ModelArgs, training: Training, plan: Plan, stage: int) -> float:
    """One micro-batch's low-precision weight copies (layout 'torch', mixed precision). Autocast casts each fp32
    matmul weight at its first use in a forward and the matmul saves that copy for its input gradient, so every
    copy lives from the forward to its layer's backward, once per micro-batch in flight: the blocks' linears
    (except under recompute, where a block saves only what its checkpoint keeps and casts again in backward)
    and the output head (never checkpointed). The embedding lookup and the norms use the fp32 weights. An MoE
    block's router and shared experts are cast by autocast, its routed experts by GroupedExperts.compute's own
    casts (each forward), all saved by their matmuls: every weight of the rank's experts.
    """
    if not casts_weights(training):
        return adapter_copy_bytes(args, training, plan, stage) if plan.activation_checkpoint == "none" else 0.0
    n = 0.0
    shape = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split)
    if plan.activation_checkpoint == "none":
        n += shape.blocks - shape.layers * 2 * args.dim if shape.moe_layers else \
            shape.layers * (layer_params(args, plan.tp) - 2 * args.dim)
    if shape.last and not fused_head(training, plan):  # the fused head's copy is not saved
        n += args.vocab_size * args.dim / plan.tp
    return n * training.act_bytes


def autocast_cache_bytes(args: ModelArgs, training: Training, plan: Plan, stage: int) -> float:
    """The low-precision weight copies autocast's cache holds until its context exits, beyond those the matmuls
    save (weight_copy_bytes): under recompute, every block's linear weights cast in this forward. The fused head
    (fused_head) runs inside the forward, so inside that context, with all of them alive. Autocast casts an MoE
    block's attention and router; its routed experts cast themselves (GroupedExperts.compute) and are not
    cached. None without recompute (the matmuls keep them anyway), where autocast does not cast (fp32,
    other layouts, LoRA's frozen weights), or in a pipeline (the schedule's loss runs the fused head after the
    stage's forward has left its autocast context)."""
    if plan.activation_checkpoint == "none" or plan.pp > 1:
        # (a pipeline runs the fused head in the schedule's loss, after the stage's autocast exits)
        return 0.0
    if not casts_weights(training):
        return adapter_copy_bytes(args, training, plan, stage)
    shape = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split)
    dense = shape.layers - shape.moe_layers
    return (dense * (layer_params(args, plan.tp) - 2 * args.dim)
            + shape.moe_layers * attention_params(args, plan.tp)) * training.act_bytes


def gathered_weight_bytes(training: Training) -> float:
    """Bytes per parameter of a weight FSDP gathers: fp32 under 'torch' (the engine gives FSDP2 no mixed-precision
    policy; autocast casts after the gather), the compute dtype under 'fsdp-mp'/'zero'/'megatron'."""
    return 4.0 if training.layout == "torch" or not training.mixed else 2.0


def gathered_unit_bytes(args: ModelArgs, training: Training, plan: Plan, stage: int) -> tuple[float, float]:
    """Bytes per parameter FSDP gathers for a block and for the root unit (embedding, final norm, head) of pipeline
    rank `stage`: gathered_weight_bytes, except under LoRA, whose frozen matmul weights FSDP gathers as the engine
    stores them (shardwise.lora: the compute dtype, QLoRA's NF4 for the adapted projections; Transformer Engine's
    float8 under Training.float8_frozen_weights), while the embedding,
    the norms and the adapters keep the layout's; a block's adapters are counted per parameter of the block.
    Pricing every frozen weight at fp32 put a LoRA plan's FSDP buffers at 1.6x the simulator's (Llama 3.2 1B,
    ZeRO-2 over 2 ranks under autocast)."""
    g = gathered_weight_bytes(training)
    if not training.lora_rank:
        return g, g
    frozen = min(g, 2.0 if training.mixed else 4.0)
    linear = 1.0 if training.float8_frozen_weights else frozen  # Transformer Engine's float8 weights (not the head)
    block = layer_params(args, plan.tp)
    linears = block - 2 * args.dim  # the norms are the rest
    adapted = adapted_base_params(args, training, plan.tp)
    block_bytes = (adapted * (QLORA_BITS / 8 if training.qlora else linear) + (linears - adapted) * linear
                   + (block - linears) * g + lora_params(args, training, plan.tp) * g)
    shape = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split)
    head = args.vocab_size * args.dim / plan.tp if shape.last and not args.tie_embeddings else 0.0
    root = shape.root
    return block_bytes / block, ((root - head) * g + head * frozen) / root if root else g


def unsharded_grad_bytes(training: Training) -> float:
    """Bytes per parameter of a gradient as backward makes it, before FSDP reduces it: under 'fsdp-mp' the
    gathered weight is in the compute dtype and so is its gradient (FSDP2 casts it to reduce_dtype, fp32, for
    the reduce-scatter); otherwise the stored gradient's dtype."""
    return 2.0 if training.layout == "fsdp-mp" and training.mixed else state_bytes_per_param(training).grads


def reduce_grad_bytes(training: Training) -> float:
    """Bytes per parameter of a gradient as data parallelism reduces it: the compute dtype's where FSDP reduces in
    it (Training.reduce_dtype bf16 or fp16), otherwise the stored gradient's."""
    return 2.0 if training.reduce_dtype != "fp32" else state_bytes_per_param(training).grads


def replicates(training: Training, plan: Plan) -> bool:
    """ZeRO-0/1 in shardwise's engine (and DDP in torchtitan's): FSDP2's `replicate` over more than one rank."""
    return training.fsdp2 and plan.zero_stage <= 1 and plan.dp * plan.cp > 1


def replica_copy(training: Training, plan: Plan) -> bool:
    """Whether a replicated rank (replicates) holds a second copy of its weights through forward and backward:
    FSDP2's replicate gathers each unit into a buffer of its own, as FSDP over one rank (shardwise's engine,
    Training.fsdp_replicate); torch's DDP computes on the module's own parameters (DistributedDataParallel keeps no
    copy of them, its buckets are ddp_bucket_bytes), and under the layout 'torch' autocast's copies are counted as
    compute copies (weight_copy_bytes). Under 'fsdp-mp' (torchtitan's DDP of fp32 weights under autocast) the copy
    at the gathered width, bf16, stands for autocast's copies, which weight_copy_bytes does not count there."""
    return replicates(training, plan) and (training.fsdp_replicate or training.layout != "torch")


def ddp_bucket_bytes(training: Training, plan: Plan) -> float:
    """Gradient reduction below ZeRO-2 uses buckets (gradients as bucket views): two in flight. DeepSpeed's ZeRO-1
    uses its own (zero_bucket_bytes); nanotron's ZeRO-1 none (Training.zero1_all_reduce: no DDP, the buffer
    all-reduced in place); torch's DDP without bucket views reduces in its resident copy (ddp_bucket_copy_bytes)."""
    if plan.dp == 1 and plan.cp == 1 or plan.zero_stage >= 2 or any(zero_bucket_bytes(training, plan)) or (
            plan.zero_stage == 1 and training.zero1_all_reduce) or ddp_bucket_copy(training, plan):
        return 0.0
    return 2 * training.ddp_bucket_mb * 2**20


def ddp_bucket_copy(training: Training, plan: Plan) -> bool:
    """torch's DDP wraps the model without gradient_as_bucket_view (Training.ddp_bucket_view False) over more than one
    rank: at ZeRO-0, and at ZeRO-1 where the layout keeps DDP beside a sharded optimizer (torch's layouts:
    ZeroRedundancyOptimizer; Megatron's arrangement at ZeRO-1 is its distributed optimizer, nanotron's runs
    without DDP)."""
    return (not training.ddp_bucket_view and plan.dp * plan.cp > 1
            and (plan.zero_stage == 0 or plan.zero_stage == 1 and training.fsdp2))


def ddp_bucket_copy_bytes(args: ModelArgs, training: Training, plan: Plan, stage: int) -> float:
    """Under ddp_bucket_copy, the buckets torch's Reducer allocates when DDP wraps the model (reducer.cpp,
    initialize_buckets: a flat tensor per bucket in the gradients' dtype), which it copies each gradient into as
    autograd makes it (mark_variable_ready copies unless the gradient is a view of the bucket): a second copy of the
    gradients of the stage's trainable weights (LoRA's adapters alone), in the weights' dtype, resident from the
    wrap on beside autograd's own, at every moment (its own item, `ddp_bucket_copy`: 2.5 GiB for the Ultra-Scale
    Playbook's 1.34B model at tp 1 under nanotron, 4 bytes a parameter under torchtitan's DDP)."""
    if not ddp_bucket_copy(training, plan):
        return 0.0
    shape = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split)
    trainable = shape.layers * lora_params(args, training, plan.tp) if training.lora_rank else shape.params
    return trainable * state_bytes_per_param(training).params


def zero_bucket_bytes(training: Training, plan: Plan) -> tuple[float, float]:
    """DeepSpeed's contiguous gradient buckets (Training.reduce_bucket_size elements each, in the weights' dtype),
    as (kept for the whole run, held from a backward's first gradient to its end). ZeRO-3 allocates one at
    initialisation and keeps it (stage3.py: each ipg bucket's buffer); ZeRO-1 and 2 one at the first gradient hook
    of each backward, two under overlap_comm, and free them when the backward ends (stage_1_and_2.py
    process_gradients -> setup_buckets, _release_ipg_buffers)."""
    if training.layout != "zero" or not training.reduce_bucket_size or plan.zero_stage < 1:
        return 0.0, 0.0
    bucket = training.reduce_bucket_size * state_bytes_per_param(training).params
    if plan.zero_stage >= 3:
        return bucket, 0.0
    return 0.0, bucket * (2 if training.overlap_comm else 1)


# ---------------------------------------------------------------------------------------------------
# The breakdown at the peak (docs/planner.md, "The moment of the peak")

DYNAMIC_ITEMS = ("activations", "backward_and_logits", "fsdp_buffers", "ddp_buckets")
"""The items the fragmentation allowance is a share of (Training.fragmentation)."""
MOMENTS = ("loss_backward", "first_block_backward", "weight_pass", "second_block_backward", "late_block_backward",
           "later_block_backward", "next_block_backward", "end_of_backward", "embedding_backward", "optimizer_step")


def stage_memory(args: ModelArgs, training: Training, plan: Plan, stage: int,
                 moment: str | None = None) -> dict[str, float]:
    """Itemised bytes on one rank of pipeline stage `stage` at its peak: the largest of `moment_memory` with its
    fragmentation allowance (_peak; or at `moment`, one of MOMENTS)."""
    training = recipe_for(training, plan)
    base, changes = _moment_parts(args, training, plan, stage)
    items = _moment(base, changes, moment or _peak(base, changes, training))
    dynamic = sum(items[k] for k in DYNAMIC_ITEMS)
    items["fragmentation"] = fit_fragmentation(training) * dynamic
    items["allocator_segments"] = bf16_optimizer_segments(args, training, plan, stage)
    items["fixed_overhead"] = training.fixed_overhead_gib * GiB
    items["total"] = sum(items.values())
    return items


def reserved_bytes(args: ModelArgs, training: Training, plan: Plan, stage: int, limit: float | None = None) -> float:
    """What torch's `max_memory_reserved` reads on a rank of pipeline stage `stage` (docs/planner.md, "Reserved
    memory"): what torch's caching allocator holds at the largest of `moment_memory`'s moments, so without the fixed
    overhead (the CUDA context and NCCL's buffers, allocated outside it; its cuBLAS workspaces, tens of MiB, are left
    in the overhead), with the fragmentation allowance, and under torch's FSDP (ZeRO-2/3; ZeRO-0/1 where it is
    FSDP2's replicate, Training.fsdp_replicate) with the gradients it reduces (a sharded rank's shards, a replicated
    rank's whole set) at every moment, made yet or not. FSDP2 allocates them in a stream of its own (foreach_reduce:
    each parameter's .grad is a view of the reduce-scatter output, made in the reduce-scatter stream, or its cast to
    the parameters' dtype, made there or, under HSDP, in the all-reduce stream; FSDP1 in its post-backward stream)
    and the caching allocator hands a freed block back only to allocations on the stream that made it, so
    once zero_grad frees them they stay reserved, out of the default stream's reach, through the next step's
    forward. Where they are not live they do not count towards fitting: an allocation that fails releases the
    cached blocks and retries (the allocator's alloc retries), so the figure is at most `limit` (the device's bytes
    less the fixed overhead) where one is given."""
    training = recipe_for(training, plan)
    cached = _model_state(args, training, plan, stage)["grads"] if training.fsdp2 and (
        plan.zero_stage >= 2 or training.fsdp_replicate and replicates(training, plan)) else 0.0
    segments = bf16_optimizer_segments(args, training, plan, stage)
    held = 0.0
    for items in moment_memory(args, training, plan, stage).values():
        dynamic = sum(items.get(k, 0.0) for k in DYNAMIC_ITEMS)
        held = max(held, sum(items.values()) + training.fragmentation * dynamic + segments
                   + max(0.0, cached - items.get("grads", 0.0)))
    return held if limit is None else min(held, limit)


def state_bound(args: ModelArgs, training: Training, plan: Plan, stage: int = 0) -> float:
    """A lower bound on stage_memory(...)["total"] from memoised parts: the optimizer step's moment (model state, the
    rotary table, DDP's bucket copy) and the fixed overhead."""
    training = recipe_for(training, plan)
    return (sum(_model_state(args, training, plan, stage).values()) + rotary_table_bytes(args)
            + ddp_bucket_copy_bytes(args, training, plan, stage) + training.fixed_overhead_gib * GiB)


def _peak(base: dict[str, float], changes: dict[str, dict[str, float]], training: Training) -> str:
    """The moment whose bytes with their fragmentation allowance (fit_fragmentation) are largest, summed from the
    items every moment shares and those it changes (a search asks this ~10^5 times: no moment's breakdown is
    built)."""
    shared, share = sum(base.values()), fit_fragmentation(training)

    def held(name: str) -> float:
        change = changes[name]
        # (the optimizer step keeps only model state of the base: _moment)
        dynamic = sum(change.get(k, 0.0 if name == "optimizer_step" else base.get(k, 0.0)) for k in DYNAMIC_ITEMS)
        return shared + sum(v - base.get(k, 0.0) for k, v in change.items()) + share * dynamic

    return max(changes, key=held)


def fit_fragmentation(training: Training) -> float:
    """The share of the dynamic items lost to the allocator when memory runs short, which decides whether a plan
    fits: the fragmentation allowance, or none under expandable segments (Training.expandable_segments)."""
    return 0.0 if training.expandable_segments else training.fragmentation


def peak_moment(args: ModelArgs, training: Training, plan: Plan, stage: int) -> str:
    """Which of MOMENTS holds the stage's peak (stage_memory's breakdown)."""
    training = recipe_for(training, plan)
    return _peak(*_moment_parts(args, training, plan, stage), training)


def moment_memory(args: ModelArgs, training: Training, plan: Plan, stage: int) -> dict[str, dict[str, float]]:
    """Itemised live bytes at each moment of a step that can hold the peak.

    Within a backward, each block's saved activations are freed as its gradients appear, so live memory is
    linear in the blocks done and its largest value is at an end: the start (the loss's backward on the last
    stage, the first block's backward elsewhere) or the end (after the first block's backward). The optimizer
    step holds model state only (and DeepSpeed's ZeRO-3 bucket, zero_bucket_bytes). Under gradient accumulation
    (and in a pipeline, whose micro-batches share the gradients) the last micro-batch's backward starts with every
    gradient already there. When no forward is left
    once the first backward starts, the next micro-batch's first block backward holds one micro-batch fewer but
    every gradient the first made.
    """
    training = recipe_for(training, plan)
    base, changes = _moment_parts(args, training, plan, stage)
    return {name: _moment(base, changes, name) for name in changes}


def _moment(base: dict[str, float], changes: dict[str, dict[str, float]], name: str) -> dict[str, float]:
    if name == "optimizer_step":  # model state (and what it lists), in the order the breakdown has always listed it
        return {**{k: base[k] for k in (*STATE_ITEMS, "buffers", "ddp_bucket_copy") if k in base}, **changes[name]}
    return {**base, **changes[name]}


STATE_ITEMS = ("params", "grads", "master_weights", "optimizer_state")


def _moment_parts(args: ModelArgs, training: Training, plan: Plan,
                  stage: int) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """(the items every moment of `moment_memory` starts from, what each moment changes or adds)."""
    state = _model_state(args, training, plan, stage)
    acts = _activation_items(args, training, plan, stage)
    # the block whose backward runs first, replayed or not (checkpointing some blocks: partial_checkpointing)
    first_plan = backward_plan(args, training, plan, stage)
    m = in_flight(plan, stage)
    # gradients are accumulated from the first finished backward on; the first backward starts with the most
    # micro-batches in flight, and with gradients already there only if forwards remain after it (more
    # micro-batches than in flight: accumulation without a pipeline, a pipeline's steady state); a pipeline
    # with M <= its warm-up (GPipe; 1F1B's first stages at small M) holds its gradients only as activations go
    shape = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split)
    last, accum, accum_early = shape.last, plan.grad_accum > 1, plan.grad_accum > m
    # gradients FSDP keeps unsharded across micro-batches: only where it reduces once per step
    keep_unsharded = accum and not training.reduces_every_micro_batch(plan.pp)
    keep_unsharded_early = accum_early and not training.reduces_every_micro_batch(plan.pp)
    # (a mesh of one too, offload's on one device: FSDP2 still copies each shard into a gathered buffer of its own,
    # _fsdp_param_group's world_size == 1 path, and keeps the unsharded gradients)
    fsdp, gathered = plan.zero_stage >= 2, gathered_weight_bytes(training)
    gathered_block, gathered_root = gathered_unit_bytes(args, training, plan, stage)
    stage_p, root_p, block_p = shape.params, shape.root, layer_params(args, plan.tp)
    if shape.moe_layers:
        # experts FSDP does not shard (expert_shard_group 1) are whole on the rank: model state, not gathered; but
        # FSDP2 (shardwise's engine, torchtitan) still wraps them over their one-rank group, and makes their gathered
        # copy and unsharded gradients as for any group (the simulator: 3.4x these buffers on Mixtral at ep 8 when
        # counted whole)
        whole = plan.ep > 1 and plan.expert_shard_group == 1 and not training.fsdp2
        moe_block = block_params(args, plan.tp, True, plan.ep) - (expert_params(args, plan.ep) if whole else 0.0)
        block_p = max(moe_block, block_p if shape.layers > shape.moe_layers else 0.0)
        stage_p -= shape.experts if whole else 0.0
    head_p = args.vocab_size * args.dim / plan.tp + args.dim if last else 0.0
    grad_bytes = unsharded_grad_bytes(training) if fsdp else state_bytes_per_param(training).grads
    # gradients kept unsharded across micro-batches are accumulated in the wider of the reduce dtype and their own:
    # FSDP2 upcasts bf16 gradients to an fp32 reduce dtype; fp32 weights' fp32 gradients stay fp32 where FSDP casts
    # them to a bf16 reduce dtype for the collective only (FSDP1's MixedPrecision(param fp32, reduce bf16))
    kept_grad_bytes = max(reduce_grad_bytes(training), unsharded_grad_bytes(training))
    # FSDP: the root unit stays gathered from the forward to the end of backward (reshard_after_forward=False);
    # ZeRO-2 keeps every block gathered too, ZeRO-3 the running block and the prefetched next one. Gradient
    # accumulation without synchronisation keeps every gradient unsharded until the last micro-batch (shardwise's
    # engine); a system that reduce-scatters in every micro-batch's backward keeps only the shard.
    held = held_early = 0.0
    # DeepSpeed's first ZeRO-3 (module-sync) gathers module by module and releases each after use: no root unit
    # stays gathered, and a block's backward holds the running module and the next one prefetched
    module_sync = plan.zero_stage >= 3 and training.zero3_fetch == "module-sync"
    # the stage's weights as FSDP2 gathers them (a LoRA model's frozen ones as the engine stores them): FSDP's
    # buffers, and replicate's working copy (FSDP over one rank)
    whole_stage = (stage_p - root_p) * gathered_block + root_p * gathered_root
    if fsdp:
        # (DeepSpeed's and Megatron's ZeRO-2 keep whole weights as model state: nothing is gathered)
        root_held = 0.0 if module_sync else root_p
        held = held_early = (root_held * gathered_root if plan.zero_stage >= 3 else
                             whole_stage if training.fsdp2 else 0.0)
        held += stage_p * kept_grad_bytes if keep_unsharded and not training.lora_rank else 0.0
        held_early += stage_p * kept_grad_bytes if keep_unsharded_early and not training.lora_rank else 0.0
    kept_buckets, backward_buckets = zero_bucket_bytes(training, plan)
    base = {**state, "buffers": rotary_table_bytes(args),
            "replica_params": whole_stage if replica_copy(training, plan) else 0.0,
            "ddp_buckets": kept_buckets}
    copy = ddp_bucket_copy_bytes(args, training, plan, stage)
    if copy:
        base["ddp_bucket_copy"] = copy
    if plan.pp > 1:
        base["p2p_buffers"] = p2p_buffer_bytes(args, training, plan, stage)
    # Megatron-LM's data-parallel wrapper allocates every parameter's main_grad in one contiguous buffer when the
    # model is wrapped (its grad buffer): resident from the first backward on, whatever the accumulation
    resident = training.layout == "megatron"
    early_grads = state["grads"] if (accum_early or resident) and not fsdp else 0.0
    if training.layout == "zero" and plan.zero_stage >= 3 and training.zero3_grads_at_start:
        # DeepSpeed's ZeRO-3 allocates the rank's gradient partitions when it starts (stage3.py,
        # grad_partitions_flat_buffer): there at every moment (on the host under offload_optimizer: none here,
        # _model_state)
        early_grads = state["grads"]
    # a system that reduce-scatters every micro-batch's gradients (FSDP outside a pipeline, Composer's FSDP1,
    # Megatron-FSDP, DeepSpeed's ZeRO-2/3) holds the rank's shards from the first micro-batch's backward on: the
    # later micro-batches run beside them (not where DeepSpeed's offload_optimizer keeps them on the host:
    # stage3.py's grad_partitions_flat_buffer on the CPU)
    shards_early = fsdp and not keep_unsharded and not (training.layout == "zero" and plan.offload != "none")
    if shards_early and accum_early:
        early_grads = state["grads"]
    # what the micro-batches in flight hold: m of the rank's set, or zero-bubble's walk (_zero_bubble_held),
    # whose input passes keep every micro-batch's graph and the gradients its weight pass starts from
    zero_bubble = None
    if "zero_bubble_chunks" in acts:
        # a chunk's gradients exist from its first weight pass on (kept unsharded by FSDP between micro-batches)
        kept = stage_p * kept_grad_bytes if fsdp and keep_unsharded and not training.lora_rank else 0.0
        grads_made = kept + (state["grads"] if accum and not fsdp else 0.0)
        # under FSDP2's mixed-precision policy a weight pass leaves its gradients in the compute dtype on the
        # gathered weights until the chunk's next input pass, whose post-backward hooks fold them into the
        # reduce-dtype accumulators (_zero_bubble_held)
        pending = stage_p * unsharded_grad_bytes(training) \
            if fsdp and training.fsdp2 and not training.lora_rank \
            and unsharded_grad_bytes(training) != kept_grad_bytes else 0.0
        # (what the block backward already counts as made: the pending gradients hold it)
        fresh = head_p * grad_bytes - acts["head_weight_grad"] + acts["block_backward"]["weight_grad"]
        zero_bubble = _zero_bubble_held(plan, stage, acts["zero_bubble_chunks"], grads_made, pending, fresh)
        done = zero_bubble["input_pass"][3]
        held_early = held - kept + kept * done
        early_grads = state["grads"] * done if accum and not fsdp else early_grads
    # an interleaved schedule's last rank holds m stage-equivalents of its layers but the head of one micro-batch:
    # the head is in its last chunk, whose backward follows its forward in steady state (Megatron's schedule and
    # torch.distributed.pipelining's ScheduleInterleaved1F1B alike); 1F1B's last rank holds one micro-batch anyway,
    # GPipe's every one
    heads = min(1.0, m) if plan.pp > 1 and plan.pp_schedule == "interleaved-1f1b" else m
    held_acts, held_copies, held_grads = zero_bubble["input_pass"][:3] if zero_bubble else \
        ((acts["activations"] - acts["head"]) * m + acts["head"] * heads,
         (acts["copies"] - acts["head_copy"]) * m + acts["head_copy"] * heads, 0.0)
    out = {}
    if last:
        # the fused head's working set is made inside the forward, among its activations (fused_head)
        work, cached, last_gather = (acts["logits"], 0.0), 0.0, 0.0
        if fused_head(training, plan):
            # ... with autocast's cached weight copies, and the last block's all-gather buffer, which FSDP2 keeps
            # until the root's post-forward frees it (the fused head runs inside the root's forward; a pipeline's
            # runs in the schedule's loss, after the stage's forward has returned)
            work, cached = (0.0, acts["logits"]), acts["autocast_cache"]
            last_gather = block_p * gathered_block if fsdp and plan.pp == 1 else 0.0
        out["loss_backward"] = {"grads": early_grads, "activations": held_acts + work[1],
                                "compute_copies": held_copies + cached, "backward_and_logits": work[0],
                                "fsdp_buffers": held_early + last_gather}
    # the first block's backward (block_backward_bytes): the head's saved tensors are gone and its gradient
    # exists. FSDP gathers the running block and prefetches the next (ZeRO-3); the gradients FSDP has not yet
    # reduce-scattered are autograd's, not its buffers
    # (recomputed tensors are made in backward: the tracker sees them as temporaries)
    # (with the rank's gradients already there, a new one is a temporary until added: block_backward_bytes)
    bwd_name = "block_backward_accumulating" if early_grads and not fsdp else "block_backward"
    bwd = acts[bwd_name]
    # the fused head's weight gradient was made in forward, fp32 (an activation until its backward hands it over).
    # An fp32 gradient is handed over as it is, and the tracker keeps counting it where it was made; one of another
    # dtype (FSDP2's mixed-precision policy: bf16) is a new tensor, and the fp32 one is freed: kept among the saved
    # tensors, it gave the temporaries a negative item (-0.12 GiB for Llama 3 8B on 8 ranks)
    head_grad = acts["head_weight_grad"] if zero_bubble or grad_bytes == 4.0 else 0.0
    # (LoRA freezes the head: it makes no weight gradient, as it makes none of the blocks' weights)
    fresh_grads = (0.0 if training.lora_rank else head_p * grad_bytes) - head_grad + bwd["weight_grad"]

    def working(bwd: dict[str, float], accumulating: bool, block: Plan = first_plan) -> float:
        rebuilt = bwd["recomputed"] - bwd["freed"] if block.activation_checkpoint != "none" else 0.0
        return (bwd["working"] + rebuilt + bwd["copies_rebuilt"] + (bwd["pending"] if accumulating else 0.0)
                + held_grads)

    # ZeRO-3 gathers the running block and prefetches the next: a stage of one block has none to prefetch.
    # Module-sync: the running linear module and the next in forward order (timing.module_sync_zero3's one module
    # ahead; under full recompute the last module, kept from its recomputation to its backward, is the running
    # one): the largest two neighbours, the last with the next block's first
    gathering = min(2, shape.layers) * block_p * gathered_block
    if module_sync:
        mods = block_modules(args, plan.tp)
        gathering = max(a + b for a, b in zip(mods, mods[1:] + mods[:1])) * gathered

    def saved(bwd: dict[str, float], block: Plan = first_plan) -> tuple[float, float]:
        # (activations, compute copies) still held in `block`'s backward, the blocks after it not counted
        if zero_bubble:
            return held_acts, held_copies
        return (held_acts - acts["head"] + head_grad
                - (bwd["freed"] if block.activation_checkpoint == "none" else 0.0),
                held_copies - acts["head_copy"] - bwd["copies_freed"])

    partial = partial_checkpointing(plan)
    if partial:
        # (checkpointing some blocks: what each block keeps, replayed or not, and the blocks done before the nth)
        order = checkpointed_order(args, training, plan, stage)
        plans = {True: replace(plan, activation_checkpoint_every=1),
                 False: replace(plan, activation_checkpoint="none", activation_checkpoint_every=1)}
        kept_each = {r: layer_activation_bytes(args, training, p) for r, p in plans.items()}
        copies_each = _activation_items(args, training, plans[False], stage)["first_block_copies"]
        done_kept, done_bare = [0.0], [0]  # (of the blocks before the nth: what they kept, how many were not replayed)
        for replayed in order:
            done_kept.append(done_kept[-1] + kept_each[replayed])
            done_bare.append(done_bare[-1] + (not replayed))

    def in_block(nth: int) -> dict[str, float]:
        """Checkpointing some blocks (partial_checkpointing): inside the backward of the rank's `nth` block in
        backward order, with its own working set (a replay or none), the saved tensors and weight copies of the
        blocks before it gone. Empty where every block is alike (the moments above price it)."""
        if not partial:
            return {}
        block = backward_plan(args, training, plan, stage, nth)
        b = _activation_items(args, training, block, stage)[bwd_name]
        kept, copies = saved(b, block)
        return {"activations": kept - done_kept[nth],
                "compute_copies": copies - done_bare[nth] * copies_each,
                "backward_and_logits": working(b, bool(early_grads) and not fsdp, block)
                + (fresh_grads if fsdp else 0.0)}

    out["first_block_backward"] = {
        "grads": early_grads or (0.0 if fsdp else fresh_grads),
        "activations": saved(bwd)[0], "compute_copies": saved(bwd)[1],
        "backward_and_logits": working(bwd, bool(early_grads) and not fsdp) + (fresh_grads if fsdp else 0.0),
        "fsdp_buffers": held_early + (gathering if plan.zero_stage >= 3 and fsdp else 0.0),
        "ddp_buckets": kept_buckets + backward_buckets}
    if zero_bubble and plan.activation_checkpoint == "full":
        # the end of a weight pass that rebuilt its chunk's blocks (_zero_bubble_held)
        w_acts, w_copies, w_other, w_done = zero_bubble["weight_pass"]
        out["weight_pass"] = {**out["first_block_backward"], "activations": w_acts, "compute_copies": w_copies,
                              "backward_and_logits": w_other + (fresh_grads if fsdp else 0.0),
                              "fsdp_buffers": held - kept + kept * w_done,
                              "grads": state["grads"] * w_done if accum and not fsdp else early_grads}
    if fsdp and training.fsdp2 and shape.layers >= 2 and not keep_unsharded:
        # FSDP2 keeps a unit's reduce-scatter input (its gradients in the reduce dtype) until the next unit's
        # reduce-scatter: the second block's backward holds the first block's (the last unit of an MoE block
        # under ep, whose experts are their own unit, is the block without them), and the first block's saved
        # tensors and weight copies are gone. Under recompute (a checkpoint input per block) this moment is the
        # larger. (DeepSpeed's ZeRO-3, layout 'zero', reduces through its own gradient buckets instead.)
        first = out["first_block_backward"]
        # (what a block's backward frees of the kept ones: under activation offloading, its share on the device)
        done = layer_activation_bytes(args, training, first_plan, moe=shape.last_moe) \
            * offload_kept_share(training, plan, shape.layers)
        scattered = block_params(args, plan.tp, shape.last_moe, plan.ep)
        if shape.last_moe and plan.ep > 1:
            scattered -= expert_params(args, plan.ep)
        out["second_block_backward"] = {
            **first, "activations": first["activations"] - done,
            "compute_copies": first["compute_copies"] - acts["first_block_copies"],
            "fsdp_buffers": first["fsdp_buffers"] + scattered * reduce_grad_bytes(training),  # (its input's dtype)
            **in_block(1)}
        if shape.layers >= 3 and not zero_bubble and not shape.moe_layers:
            # the next-to-last block's backward: the same working set and buffers (the block after it gathered,
            # ZeRO-3's prefetch; the one before it still holding its reduce-scatter input), but every block's
            # sharded gradient that FSDP has reduce-scattered (all but these two; the root's only at the end) and
            # the saved tensors of two blocks of this micro-batch. The saved tensors shrink by a block as the
            # gradients grow by one, so where a block's sharded gradients outweigh its saved tensors (recompute,
            # FSDP over few ranks) this end of the backward is the peak: Llama 2 7B, FSDP 8, full recompute, under
            # FSDP2's mixed-precision policy measured 15.39 GiB in the simulator "in layers.1", 13.53 predicted
            # without this moment (2026-12-02, from a helper's trial)
            gone = shape.layers - 2
            blocks_share = (stage_p - root_p) / stage_p if stage_p else 0.0
            out["late_block_backward"] = {
                **out["second_block_backward"],
                "grads": early_grads or state["grads"] * blocks_share * gone / shape.layers,
                "activations": first["activations"] - done * (gone + 1),
                "compute_copies": first["compute_copies"]
                - (acts["copies"] - acts["head_copy"]) * (gone + 1) / shape.layers,
                **in_block(gone)}
    if partial and shape.layers >= 2 and not zero_bubble and not shape.moe_layers:
        # the backward of each later block, replayed or not: the saved tensors of those before it gone, their
        # gradients made (FSDP2 reduce-scatters them to shards, a replicated rank keeps them whole, others as at the
        # first block), its own working set; the largest of them (a replayed block's, where gradients are few)
        fsdp2_shards = "second_block_backward" in out
        inherit = out["second_block_backward" if fsdp2_shards else "first_block_backward"]
        blocks_share = (stage_p - root_p) / stage_p if stage_p else 0.0

        def later(nth: int) -> dict[str, float]:
            grads = inherit["grads"]
            if not early_grads and fsdp2_shards:
                grads = state["grads"] * blocks_share * nth / shape.layers
            elif not early_grads and not fsdp and not training.lora_rank:
                grads = inherit["grads"] + nth * block_p * grad_bytes
            # (FSDP2's replicate frees each block's working copy after its backward)
            copy = base["replica_params"] - nth * block_p * gathered_block if base["replica_params"] else 0.0
            items = {**inherit, **in_block(nth), "grads": grads, "replica_params": copy}
            if nth == shape.layers - 1 and plan.zero_stage >= 3 and fsdp and not module_sync:
                # the rank's last backward has no next block for ZeRO-3 to prefetch
                items["fsdp_buffers"] -= block_p * gathered_block
            return items

        # (the block whose moment is largest with the allowance that decides the fit; under expandable segments the
        # reserved figure, which keeps the allowance, takes the same block)
        share = fit_fragmentation(training)
        out["later_block_backward"] = max(
            (later(nth) for nth in range(1, shape.layers)),
            key=lambda items: sum(items.values()) + share * sum(items.get(k, 0.0) for k in DYNAMIC_ITEMS))
    if accum and not accum_early and m >= 2 and not zero_bubble:
        # no forward is left once the first backward starts (1F1B's first stages at M = P - i, GPipe): the next
        # micro-batch's first block backward holds one micro-batch fewer, but every gradient the first made
        after = acts["block_backward" if fsdp else "block_backward_accumulating"]
        out["next_block_backward"] = {
            **out["first_block_backward"], "grads": 0.0 if fsdp and not shards_early else state["grads"],
            # (under FSDP `after` is `bwd`: the same fresh gradients)
            "backward_and_logits": working(after, not fsdp) + (fresh_grads if fsdp else 0.0),
            "activations": saved(after)[0] - acts["activations"], "compute_copies": saved(after)[1] - acts["copies"],
            "fsdp_buffers": held + (gathering if plan.zero_stage >= 3 and fsdp else 0.0)}
    # replicate frees each bucket's working copy after its backward: only the root's is left at the end
    # the embedding's backward, the last of the first stage's: torch's dense embedding backward makes a whole
    # gradient of the (vocabulary-parallel) table, which is added to the one earlier micro-batches made
    # (under FSDP2's mixed-precision policy that gradient is bf16, beside the fp32 accumulators FSDP2 keeps: it is
    # upcast into them when the root's backward ends)
    lookup = 0.0
    if stage == 0 and accum and training.fsdp2 and not training.lora_rank and (keep_unsharded or not fsdp):
        lookup = args.vocab_size / plan.tp * args.dim * (grad_bytes if fsdp else kept_grad_bytes)
    out["end_of_backward"] = {
        "replica_params": root_p * gathered_root if base["replica_params"] else 0.0,
        "activations": held_acts * (m - 1) / m, "compute_copies": held_copies * (m - 1) / m,
        "backward_and_logits": 0.0, "ddp_buckets": ddp_bucket_bytes(training, plan) + kept_buckets + backward_buckets,
        "fsdp_buffers": held + (root_p * grad_bytes if fsdp and not keep_unsharded else 0.0)}
    if plan.pp > 1 and fsdp and training.fsdp2 and keep_unsharded:
        # torch.distributed.pipelining keeps an FSDP stage gathered after every backward but the step's last
        # (PipelineStage sets reshard_after_backward False, and True for the last): at the end of the others all
        # the stage's blocks are there beside the root (ZeRO-2 holds them all along), and no sharded gradient
        # exists yet
        out["end_of_backward"]["grads"] = 0.0
        if plan.zero_stage >= 3:
            out["end_of_backward"]["fsdp_buffers"] = held + (stage_p - root_p) * gathered_block
    if lookup:  # (a micro-batch's: replicate's working copies are still there for the next)
        out["embedding_backward"] = {**out["end_of_backward"], "replica_params": base["replica_params"],
                                     "backward_and_logits": lookup}
    # FSDP reshards after backward: the optimizer sees sharded weights and gradients only
    out["optimizer_step"] = dict.fromkeys(("replica_params", "activations", "compute_copies",
                                           "backward_and_logits", "fsdp_buffers"), 0.0)
    out["optimizer_step"]["ddp_buckets"] = kept_buckets  # (DeepSpeed's ZeRO-3 bucket is never freed)
    if training.layout == "megatron" and training.mixed and not training.grads_in_fp32 and (
            training.optimizer_dtype == "fp32"):
        # Megatron's optimizer hands its fp32 master weights an fp32 copy of their bf16 main gradients
        # (DistributedOptimizer: shard_main_param.grad = shard_model_grad.float()): the master's size, transient
        out["optimizer_step"]["backward_and_logits"] = state["master_weights"]
    if plan.pp > 1:
        out["optimizer_step"]["p2p_buffers"] = 0.0
    return base, out


def p2p_buffer_bytes(args: ModelArgs, training: Training, plan: Plan, stage: int) -> float:
    """Receive buffers of a pipeline rank. torch.distributed.pipelining (shardwise's engine) allocates, for each
    stage the rank holds, one buffer per micro-batch for the activations coming in (every stage but the first)
    and one for the gradients coming back (every stage but the last), and keeps them for the whole step (the
    simulator's tracker counts them as the stage's inputs). A buffer holds the boundary tensor: b s/c d elements
    of the residual stream, 1/t of them under sequence parallelism. Megatron's layout allocates per transfer: a
    received activation and a received gradient, double-buffered."""
    x = plan.micro_batch * training.seq_len / plan.cp * args.dim * training.stream_bytes
    if plan.sequence_parallel:
        x /= plan.tp
    if not training.fsdp2:
        return 4 * x
    return stage_shape(args, plan, stage, training.seq_len, training.pipeline_split).boundaries * plan.grad_accum * x


def _activation_items(args: ModelArgs, training: Training, plan: Plan, stage: int) -> dict[str, float]:
    """One micro-batch's saved activations and weight copies, the head's share of them, and the loss's and a block
    backward's working sets; memoised (they do not depend on the dp split, ZeRO stage or offload, which a search
    varies most)."""
    key = (args, training, plan.tp, plan.cp, plan.pp, plan.virtual_stages, plan.micro_batch,
           plan.activation_checkpoint, plan.sequence_parallel, plan.pp_schedule, stage, plan.ep,
           checkpoint_period(plan))
    cached = _ACTIVATIONS.get(key)
    if cached is None and partial_checkpointing(plan):
        cached = _remember(_ACTIVATIONS, key, _partial_activation_items(args, training, plan, stage))
    if cached is None:
        shape = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split)
        last = shape.last
        per_mb = (shape.layers - shape.moe_layers) * layer_activation_bytes(args, training, plan)
        if shape.moe_layers:
            per_mb += shape.moe_layers * layer_activation_bytes(args, training, plan, moe=True)
        per_mb *= offload_kept_share(training, plan, shape.layers)
        head = head_activation_bytes(args, training, plan) if last else 0.0
        if stage == 0:
            per_mb += embedding_activation_bytes(args, training, plan) - first_block_unkept_bytes(args, training, plan)
        copies = weight_copy_bytes(args, training, plan, stage)
        head_copy = args.vocab_size * args.dim / plan.tp * training.act_bytes \
            if last and casts_weights(training) and copies and not fused_head(training, plan) else 0.0
        cached = _remember(_ACTIVATIONS, key, {
            "activations": per_mb + head, "head": head, "copies": copies,
            "head_weight_grad": head_weight_grad_bytes(args, training, plan) if last else 0.0,
            "head_copy": head_copy, "logits": logits_bytes(args, training, plan) if last else 0.0,
            # (the weight copies of the block whose backward runs first: a block's share of the stage's)
            "first_block_copies": (copies - head_copy) / shape.layers if shape.layers else 0.0,
            "autocast_cache": autocast_cache_bytes(args, training, plan, stage) if last else 0.0,
            # zero-bubble's input pass makes no weight gradient (its weight pass is priced in _zero_bubble_held)
            **{name: block_backward_bytes(args, training, plan, shape.last_moe, accumulating=accumulating,
                                          weight_grads=not (plan.pp > 1 and plan.pp_schedule == "zero-bubble"))
               for name, accumulating in (("block_backward", False), ("block_backward_accumulating", True))}})
        if plan.pp > 1 and plan.pp_schedule == "zero-bubble":
            cached["zero_bubble_chunks"] = _zero_bubble_chunk_bytes(args, training, plan, stage, cached)
    return cached


def _partial_activation_items(args: ModelArgs, training: Training, plan: Plan, stage: int) -> dict[str, float]:
    """_activation_items of a rank checkpointing some of its blocks (partial_checkpointing): the saved tensors and
    weight copies of its checkpointed blocks as under the policy, of the others as without recompute (autocast's
    cache holds the copies of the checkpointed ones alone, those the others' matmuls do not save); the block
    backward of its first in backward order, checkpointed or not (backward_plan). Dense blocks, outside zero-bubble's V,
    without activation offloading (search.check_fixed refuses the rest)."""
    every_block = replace(plan, activation_checkpoint_every=1)
    bare = replace(every_block, activation_checkpoint="none")
    ck, none = (_activation_items(args, training, p, stage) for p in (every_block, bare))
    layers = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split).layers
    share = checkpointed_blocks(args, training, plan, stage) / layers
    # every item but the blocks' is the same either way (the head's, the embedding's), so a mix of the two by
    # the share of checkpointed blocks counts n blocks of one and the rest of the other
    out = {**ck, **{k: none[k] + share * (ck[k] - none[k]) for k in ("activations", "copies", "autocast_cache")}}
    if stage == 0:
        # LoRA's first block keeps no input unless checkpointed (first_block_unkept_bytes): the mix takes that off
        # for the share of blocks not checkpointed; it is off whole where block 0 is not checkpointed, not at all
        # where it is
        unkept = first_block_unkept_bytes(args, training, bare)
        out["activations"] += (1 - share) * unkept - (0.0 if block_zero_checkpointed(args, training, plan) else unkept)
    first = _activation_items(args, training, backward_plan(args, training, plan, stage), stage)
    return {**out, **{k: first[k] for k in ("block_backward", "block_backward_accumulating", "first_block_copies")}}


OFFLOAD_STASH = 5
"""Offloaded tensors torchtune's OffloadActivations keeps alive on the device behind its copies (max_fwd_stash_size,
its default), counted as that many blocks' saved inputs."""


def offload_kept_share(training: Training, plan: Plan, layers: int) -> float:
    """The share of a stage's blocks' saved activations on the device under activation offloading: torchtune's
    (Training.activation_offload, full recompute: what a checkpointed block keeps is its input), the forward
    stash's; Megatron-Core's (Training.offload_layers, no recompute), the blocks not offloaded, (L - k) / L, as
    Transformer Engine's synchroniser keeps them."""
    if training.offload_layers and plan.activation_checkpoint == "none":
        return (layers - min(training.offload_layers, layers)) / layers
    if not (training.activation_offload and plan.activation_checkpoint == "full") or layers <= OFFLOAD_STASH:
        return 1.0
    return OFFLOAD_STASH / layers


def _zero_bubble_chunk_bytes(args: ModelArgs, training: Training, plan: Plan, stage: int,
                             acts: dict[str, float]) -> tuple[tuple[float, ...], ...]:
    """Per chunk of a zero-bubble rank (chunk 0: stage `stage`, chunk 1: stage 2P - 1 - stage), per micro-batch:
    (saved activations, weight copies, the gradients its weight pass starts from, what a weight pass's rebuild
    keeps to its end), its share of the rank's parameters, the gradients its weight pass starts from of the
    block its input pass runs first (its last), and the share of the rank's parameters whose hooks run last in
    its input pass (its first block and the head); see _zero_bubble_held."""
    chunks = []
    layers = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split).layers
    emb = args.vocab_size * args.dim / plan.tp  # vocab-parallel embedding and head (as _stage_shape)
    blocks = zero_bubble_chunks(args, plan, stage, training.seq_len, training.pipeline_split)
    for s, ids in zip((stage, 2 * plan.pp - 1 - stage), blocks):
        moe = sum(map(args.is_moe_layer, ids))
        kinds = ((len(ids) - moe, False), (moe, True))
        a = sum(n * layer_activation_bytes(args, training, plan, moe=k) for n, k in kinds if n)
        a += embedding_activation_bytes(args, training, plan) - first_block_unkept_bytes(args, training, plan) \
            if s == 0 else 0.0
        last = s == 2 * plan.pp - 1
        a += acts["head"] if last else 0.0
        copies = (acts["copies"] - acts["head_copy"]) * len(ids) / layers + (acts["head_copy"] if last else 0.0)
        grads = rebuilt = first_grads = 0.0
        if s != 0:
            grads = sum(n * weight_pass_grad_bytes(args, training, plan, k) for n, k in kinds if n)
            # the input pass runs the chunk's blocks last to first: its first block is its last
            first_grads = weight_pass_grad_bytes(args, training, plan, args.is_moe_layer(ids[-1]))
            if plan.activation_checkpoint == "full":
                # the pass rebuilds one block at a time, whole, beside what the blocks before it left
                left = {k: weight_pass_leftover_bytes(args, training, plan, k) for n, k in kinds if n}
                whole = {k: layer_activation_bytes(args, training, plan, recompute="none", moe=k) for k in left}
                top = max(left, key=lambda k: whole[k] - left[k])
                rebuilt = sum(n * left[k] for n, k in kinds if n) + whole[top] - left[top]
        params = blocks_params(args, plan.tp, plan.ep, len(ids), moe) + emb * ((s == 0) + last)
        # the gradients a weight pass leaves pending (_zero_bubble_held): all the chunk's, but on the last stage,
        # whose output the final norm's weight (or the head's) makes, only the head's; and of those, what an
        # input pass's last hooks release: its first block's (its own FSDP units) and the head's (the root's)
        pending = emb if last else params
        end = emb if last else blocks_params(args, plan.tp, plan.ep, 1, int(args.is_moe_layer(ids[0])))
        chunks.append((a, copies, grads, rebuilt, params, first_grads, pending, end))
    total = sum(c[4] for c in chunks)
    return tuple((*c[:4], c[4] / total, c[5], c[6] / total, c[7] / total) for c in chunks)


def _zero_bubble_held(plan: Plan, stage: int, chunks: tuple, grads: float, pending: float = 0.0,
                      fresh: float = 0.0) -> dict[str, tuple[float, float, float, float]]:
    """What a zero-bubble rank's micro-batches in flight hold at its fullest moments, as (saved activations,
    weight copies, other backward tensors, the share of the rank's gradients made so far): 'input_pass' at the
    end of an input pass (of the first stage: of its backward), 'weight_pass' at the end of a weight pass.
    `grads`: the bytes of all the rank's gradients once made (a chunk's exist from its first weight pass on).

    The rank runs two stages, a V (zbv_order): chunk 0 is stage `stage`, chunk 1 stage 2P - 1 - stage. A
    micro-batch of a chunk holds that chunk's activations and weight copies from its forward to its weight pass,
    and from its input pass on also the gradients the weight pass starts from (weight_pass_grad_bytes): the
    input pass keeps the graph (retain_graph) and frees nothing. The first stage has no input pass: its weight
    pass is one full backward. Under full recompute a weight pass rebuilds its chunk's blocks again, one at a
    time, and keeps part of what each rebuilt to its end (weight_pass_leftover_bytes). Each fullest moment is
    found by walking the rank's order with each chunk's bytes (`chunks`, _zero_bubble_chunk_bytes): on the
    first rank the last stage's micro-batch runs its forward, input and weight pass back to back, so only one
    is ever in flight there.

    `pending`: the bytes of all the rank's gradients in the compute dtype, where FSDP2's mixed-precision policy
    upcasts them (0 elsewhere). The weight pass (stage_backward_weight) calls autograd.grad on the weights and
    sets each gathered weight's .grad itself: no FSDP post-backward hook runs, so the chunk's bf16 gradients stay
    until its next input pass, where each FSDP unit's post-backward (at its input's gradient; the root's at the
    pass's end) adds them into its fp32 accumulator and frees them; the step's last weight passes leave theirs
    to the final reduction. An input pass of a chunk holding them is at its fullest at one of its ends: at its
    first block, every pending gradient and that block's share of the gradients kept for the weight pass; at its
    last block, all those kept and the pending gradients of the first block and the head. `fresh`: what the
    block backward counts as made at that moment (its weight gradients, the head's), which the pending hold.
    (The first stage's full backward runs the hooks as it goes: it leaves none.)"""
    q = tuple(c[6] * pending for c in chunks)
    # the running chunk's, less `fresh`: at an input pass at its fuller end, at a weight pass all it left
    running = (tuple(max(0.0, max(c[6] * pending - (c[2] - c[5]), c[7] * pending) - fresh) if pending else 0.0
                     for c in chunks), tuple(max(0.0, x - fresh) if pending else 0.0 for x in q))
    out = {}
    for moment, counts in zip(("input_pass", "weight_pass"), _zero_bubble_peaks(
            plan.pp, plan.grad_accum, stage, tuple(c[0] + c[1] for c in chunks), tuple(c[2] for c in chunks),
            tuple(c[3] for c in chunks), tuple(c[4] * grads for c in chunks), q, running)):
        alive, inputs, chunk, done, held = counts
        extra = _pending_held(moment == "input_pass", chunk, held, q, running)
        out[moment] = (sum(n * c[0] for n, c in zip(alive, chunks)), sum(n * c[1] for n, c in zip(alive, chunks)),
                       sum(n * c[2] for n, c in zip(inputs, chunks)) + extra
                       + (chunks[chunk][3] if moment == "weight_pass" and chunk >= 0 else 0.0),
                       sum(c[4] for d, c in zip(done, chunks) if d))
    return out


def _pending_held(input_pass: bool, chunk: int, held: tuple, q: tuple, running: tuple) -> float:
    """The pending compute-dtype gradients a moment holds (_zero_bubble_held): the other chunk's (q), and the
    running chunk's as `running` gives them (at an input pass, at a weight pass)."""
    return sum(running[0 if input_pass else 1][c] if c == chunk else q[c] for c in range(2) if held[c])


def _zero_bubble_peaks(p: int, m: int, rank: int, a: tuple, g: tuple, r: tuple, k: tuple,
                       q: tuple = (0.0, 0.0), running: tuple = ((0.0, 0.0), (0.0, 0.0))) -> tuple[tuple, tuple]:
    """The fullest end of an input pass and of a weight pass of `rank`, each as (micro-batches in flight per
    chunk, of them past their input pass, the chunk whose pass it is, whether each chunk has run a weight pass,
    whether each chunk holds pending gradients): per chunk, a bytes per micro-batch in flight, g per micro-batch
    past its input pass, r the rebuild a weight pass keeps to its end, k a chunk's gradients once made, q its
    pending compute-dtype gradients, `running` what of them a pass of the chunk holds (an input pass's at its
    fuller end, a weight pass's), per chunk."""
    def held(state: tuple, input_pass: bool) -> float:
        (n0, n1), (i0, i1), chunk, (w0, w1), pend = state
        return n0 * a[0] + n1 * a[1] + i0 * g[0] + i1 * g[1] + (r[chunk] if not input_pass else 0.0) \
            + w0 * k[0] + w1 * k[1] + _pending_held(input_pass, chunk, pend, q, running)

    # past 2p micro-batches the steady state only repeats: the same distinct states (tests/test_planner.py), and a
    # walk of millions of micro-batches (a tiny --seq-len) took minutes
    moments = _zero_bubble_moments(p, min(m, ZB_MOMENTS_SATURATE * p), rank)
    none = ((0, 0), (0, 0), -1, (False, False), (False, False))
    return max(moments["I"], key=lambda state: held(state, True), default=none), \
        max(moments["W"], key=lambda state: held(state, False), default=none) if any(r) else none


ZB_MOMENTS_SATURATE = 4
"""From this many micro-batches per stage on (m >= 4p), a zero-bubble rank's distinct states no longer change."""


@functools.lru_cache(maxsize=4096)
def _zero_bubble_moments(p: int, m: int, rank: int) -> dict[str, tuple]:
    """Every distinct state of `rank` at the end of an input pass (of the first stage: of its backward, 'I') and
    of a weight pass ('W'), as in _zero_bubble_peaks; the steady state repeats a few, so a search's many byte
    counts are weighed against a handful of states. A chunk holds pending gradients from each of its weight
    passes (the first stage's full backward leaves none) to its next input pass, which is counted holding them."""
    split = (rank != 0, True)  # the first stage's backward is its weight pass, whole
    state: dict[tuple[int, int], bool] = {}
    seen: dict[str, set] = {"I": set(), "W": set()}
    weighted = [False, False]
    pending = [False, False]
    for kind, chunk, i in zbv_order(p, m, rank):
        if kind == "F":
            state[(chunk, i)] = False
            continue
        if kind == "I" and split[chunk]:
            state[(chunk, i)] = True
        moment = "I" if (kind == "I") == split[chunk] else "W" if kind == "W" else None
        if kind == "W":  # its gradients are being made (every weight pass ends at a moment)
            weighted[chunk] = True
            pending[chunk] = split[chunk]
        if moment:
            alive, inputs = [0, 0], [0, 0]
            for (c, _), done in state.items():
                alive[c] += 1
                inputs[c] += done
            seen[moment].add(((alive[0], alive[1]), (inputs[0], inputs[1]), chunk, tuple(weighted),
                              tuple(pending)))
        if kind == "I":  # its units' post-backward hooks fold the pending gradients in
            pending[chunk] = False
        if kind == "W":
            del state[(chunk, i)]
    return {k: tuple(sorted(v)) for k, v in seen.items()}


_ACTIVATIONS: dict[tuple, dict[str, float]] = {}  # a pure function's memo: keys hold every input it reads


def _model_state(args: ModelArgs, training: Training, plan: Plan, stage: int) -> dict[str, float]:
    """model_state_bytes for a stage; memoised, since a search asks for it under many micro-batches and schedules."""
    key = (args, training, plan.tp, plan.pp, plan.virtual_stages, plan.pp_schedule, plan.zero_stage,
           plan.shard_group, plan.offload, stage, plan.ep)
    cached = _MODEL_STATE.get(key)
    if cached is None:
        shape = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split)
        layers = shape.layers
        trainable = layers * lora_params(args, training, plan.tp) if training.lora_rank else None
        linears = layers * (layer_params(args, plan.tp) - 2 * args.dim)
        adapted = layers * adapted_base_params(args, training, plan.tp)
        head = args.vocab_size * args.dim / plan.tp if shape.last and not args.tie_embeddings else 0.0
        # the routed experts are sharded over expert_shard_group (the ranks holding the same experts: dp_shard x cp
        # / ep under FSDP, tp x cp x dp / ep under Megatron-Core's distributed optimizer; all of shard_group without
        # expert parallelism), everything else over shard_group
        items = model_state_bytes(shape.params - shape.experts, training, plan.zero_stage, plan.shard_group,
                                  plan.offload, trainable, adapted, linears + head, linears)
        experts = model_state_bytes(shape.experts, training, plan.zero_stage, plan.expert_shard_group, plan.offload)
        if training.fsdp2 and plan.zero_stage == 2 and plan.offload != "full":
            # FSDP2 keeps the shard; the gathered copy is an FSDP buffer
            items["params"] /= plan.shard_group
            experts["params"] /= plan.expert_shard_group
        if shape.experts:
            items = {k: v + experts[k] for k, v in items.items()}
        if training.optimizer in LOW_BIT_BLOCK and plan.offload == "none":
            items["optimizer_state"] = low_bit_state(args, training, plan, stage)
        if training.optimizer_in_backward:
            # each parameter's gradient is stepped and freed as autograd finishes it: no gradient set is ever held
            # (a block's in its backward, made there, as without it)
            items["grads"] = 0.0
        if training.layout == "zero" and plan.offload == "optimizer":
            # DeepSpeed under offload_optimizer keeps the gradient partitions on the host (stage3.py: its device is
            # the CPU, v0.3.13's too; stage_1_and_2.py's copy_grads_in_partition returns before making one on the
            # device)
            items["grads"] = 0.0
        cached = _remember(_MODEL_STATE, key, items)
    return cached


_MODEL_STATE: dict[tuple, dict[str, float]] = {}  # a pure function's memo: keys hold every input it reads


def offloaded_shards(args: ModelArgs, training: Training, plan: Plan) -> tuple[float, float]:
    """(parameter bytes, gradient bytes) of one rank's shards under FSDP2's CPUOffloadPolicy, on the pipeline rank
    holding the most: the parameters as stored, which FSDP2 copies to the device before each all-gather (QLoRA's
    NF4 base, LoRA's frozen weights in the compute dtype, the rest in their own dtype), and the reduced gradients
    it copies back once a step (under LoRA the adapters' only: the base has none)."""
    kept = replace(plan, offload="none")
    states = [_model_state(args, training, kept, stage) for stage in range(plan.pp)]
    return max(s["params"] for s in states), max(s["grads"] for s in states)


def host_bytes(args: ModelArgs, training: Training, plan: Plan) -> float:
    """Bytes of host memory one rank's offload fills, on the stage that holds the most: the model state offload
    moves off the device (FSDP2's CPUOffloadPolicy keeps the parameter shards, their gradients and the optimizer
    state in host memory, and steps the optimizer there). A planner that checked only the device offered a 405B
    model on one 8-GPU node with 6 TB of it in the node's RAM. With them, the activations Megatron-Core's CPU
    offloading keeps there (Training.offload_layers: its blocks' saved tensors for the micro-batch in flight;
    torchtune's activation offloading, a block input each, is not counted)."""
    activations = 0.0
    if training.offload_layers and plan.activation_checkpoint == "none":
        activations = min(training.offload_layers, args.n_layers) * layer_activation_bytes(args, training, plan)
    if plan.offload == "none":
        return activations
    kept = replace(plan, offload="none")
    return activations + max(sum(_model_state(args, training, kept, stage).values())
                             - sum(_model_state(args, training, plan, stage).values()) for stage in range(plan.pp))


class _Trained(NamedTuple):
    """Tensors of one kind that a rank trains, as the optimizer sees them: `count` of them of `shape` on the rank
    before data parallelism splits them (tensor- and expert-parallel pieces), split over `ranks` along `dim`
    (FSDP2's Shard(dim)) or flat (dim None: ZeRO-1's slices), with fp32 moments whatever their size (`fp32`)."""

    count: int
    shape: tuple[int, ...]
    fp32: bool = False
    ranks: int = 1
    dim: int | None = 0

    @property
    def rows(self) -> int:
        """The length of the split dimension (every value when flat)."""
        return math.prod(self.shape) if self.dim is None else self.shape[self.dim]

    @property
    def chunk(self) -> int:
        """Rows per rank: FSDP2's and ZeRO-1's ceil split (the last ranks hold fewer, or none)."""
        return -(-self.rows // self.ranks)

    def piece(self, rank: int) -> int:
        """Values of one tensor on data-parallel rank `rank`."""
        return max(0, min(self.chunk, self.rows - rank * self.chunk)) * (math.prod(self.shape) // self.rows)


def low_bit_state(args: ModelArgs, training: Training, plan: Plan, stage: int) -> float:
    """Bytes of a low-bit AdamW's two moments on the data-parallel rank of pipeline rank `stage` holding the most,
    tensor by tensor as torchao keeps them (shardwise.optim): a rank's piece of a tensor (its DTensor's local
    tensor under FSDP2 and tensor parallelism, its flat slice under ZeRO-1) is quantised when it has
    LOW_BIT_MIN_VALUES values or more and is a whole number of blocks, at OPTIMIZER_STATE_BYTES a value plus two
    code books; otherwise, and always for the embedding and head (shardwise's engine keeps them out), both moments
    are fp32. On a small model, or a LoRA adapter (rank x width) split over many ranks, every piece is fp32: 4x the
    quantised bytes. A bf16 model (Training.state_dtype): the unquantised moments are bf16, and the embedding and
    head are quantised like any tensor (torchao's rule alone)."""
    kinds = _trained_kinds(args, training, plan, stage)
    block, full = LOW_BIT_BLOCK[training.optimizer], OPTIMIZER_STATE_BYTES[training.optimizer]
    books = 2 * 4 * LOW_BIT_CODE_BOOK[training.optimizer]
    # a bf16 model (Training.state_dtype): torchao's unquantised moments take the parameter's dtype, and only
    # shardwise's engine keeps the embedding and head out of quantisation (shardwise.optim)
    bf16_model = training.state_dtype == "bf16"
    unquantised = 4.0 if bf16_model else 8.0

    def state(kind: _Trained, rank: int) -> float:
        n = kind.piece(rank)
        if (kind.fp32 and not bf16_model) or n < LOW_BIT_MIN_VALUES or n % block:
            return unquantised * n
        return full * n + books

    # a kind's piece changes only where its whole chunks end (FSDP2's and ZeRO-1's ceil split): the sum over
    # kinds is largest on rank 0 or at one of those ranks
    ranks = {0}
    for kind in kinds:
        whole = kind.rows // kind.chunk
        ranks |= {r for r in (whole, whole + 1) if r < kind.ranks}
    return max(sum(k.count * state(k, r % k.ranks) for k in kinds) for r in ranks)


def _trained_kinds(args: ModelArgs, training: Training, plan: Plan, stage: int) -> list[_Trained]:
    """The tensors pipeline rank `stage` trains, by kind (_Trained): the blocks' norms, projections and experts, and
    the root's embedding, final norm and head; under LoRA the adapters alone (lora_a (r, in), lora_b (out, r) on
    every projection: shardwise.lora, which splits lora_b like a column-parallel base and lora_a like a row-parallel
    one)."""
    tp, kvs = plan.tp, kv_split(args, plan.tp)
    ids = _rank_layers(args, training.seq_len, plan.pp, plan.stages_per_rank, plan.pp_schedule,
                       training.pipeline_split)[stage]
    shape = stage_shape(args, plan, stage, training.seq_len, training.pipeline_split)
    flat = plan.zero_stage == 1
    split = {"ranks": plan.shard_group, "dim": None if flat else 0} if plan.zero_stage >= 1 else {}

    def local(n_in: int, n_out: int, how: str) -> tuple[int, int]:
        """(out, in) of a projection's piece on a tp rank."""
        if how == "row":
            return n_out, n_in // tp
        return n_out // (kvs if how == "kv" else tp), n_in

    kinds: list[_Trained] = []
    for moe, blocks in ((False, len(ids) - shape.moe_layers), (True, shape.moe_layers)):
        if not blocks:
            continue
        projections = [p for p in linear_shapes(args) if not moe or p[0] in ATTENTION]
        if training.lora_rank:
            r = training.lora_rank
            for group in adapter_groups(args, training):  # an A over the input, a B over the group's outputs
                inp = local(*group[0][1:])[1]
                out = sum(local(n_in, n_out, how)[0] for _, n_in, n_out, how in group)
                kinds += [_Trained(blocks, (r, inp), **split), _Trained(blocks, (out, r), **split)]
            continue
        kinds.append(_Trained(2 * blocks, (args.dim,), **split))  # the attention and MLP norms
        kinds += [_Trained(blocks, local(n_in, n_out, how), **split) for _, n_in, n_out, how in projections]
        if moe:  # the MoE is whole on every tp rank: router, shared experts, and this ep rank's routed experts
            kinds.append(_Trained(blocks, (args.n_experts, args.dim), **split))
            if args.n_shared_experts:
                hidden = args.n_shared_experts * args.expert_hidden
                kinds += [_Trained(2 * blocks, (hidden, args.dim), **split),
                          _Trained(blocks, (args.dim, hidden), **split)]
            experts = args.n_experts // plan.ep
            ranks = plan.shard_group if flat else plan.expert_shard_group
            # FSDP2 splits them by expert when they divide evenly, else along dim 1 (data_parallel._expert_placement)
            dim = None if flat else 0 if experts % ranks == 0 else 1
            routed = {"ranks": ranks, "dim": dim} if split else {}
            kinds += [_Trained(2 * blocks, (experts, args.expert_hidden, args.dim), **routed),
                      _Trained(blocks, (experts, args.dim, args.expert_hidden), **routed)]
    if not training.lora_rank:
        vocabulary = (-(-args.vocab_size // tp), args.dim)  # vocabulary-parallel: rank 0 holds the most rows
        matrices = (stage == 0) + (shape.last and not (args.tie_embeddings and plan.pp == 1))
        if matrices:
            kinds.append(_Trained(matrices, vocabulary, fp32=True, **split))
        if shape.last:
            kinds.append(_Trained(1, (args.dim,), **split))
    return kinds


def rotary_table_bytes(args: ModelArgs) -> float:
    """The model's fp32 cos/sin table, (2, max_seq_len, head_dim), a buffer on every rank."""
    return 2 * args.max_seq_len * args.head_dim * 4.0


def simulator_categories(items: dict[str, float]) -> dict[str, float]:
    """A breakdown in the simulator's categories (shardwise.simulate.CATEGORIES), without the allowances for what
    is not tensors. Weight copies are saved by forward, so they are activations; replicate's working copy of the
    weights is tracked as parameters; FSDP's gathered weights and unsharded gradients are communication buffers."""
    out = {
        "parameters": items["params"] + items["buffers"] + items["replica_params"],
        "gradients": items["grads"],
        "optimizer_state": items["master_weights"] + items["optimizer_state"],
        # the pipeline's receive buffers are the stage's inputs, which the tracker counts as activations
        "activations": items["activations"] + items["compute_copies"] + items.get("p2p_buffers", 0.0),
        "temporaries": items["backward_and_logits"],
        "communication_buffers": items["fsdp_buffers"] + items["ddp_buckets"] + items.get("ddp_bucket_copy", 0.0),
    }
    out["total"] = sum(out.values())
    return out


def peak_memory(args: ModelArgs, training: Training, plan: Plan,
                first: dict[str, float] | None = None) -> tuple[int, dict[str, float]]:
    """(stage, breakdown) of the pipeline rank with the highest peak, among `ranks_to_check`: the first (most
    micro-batches in flight, the embedding), the one with the output head and logits, and the first rank with
    each block count of the engine's split. `first` passes stage 0's breakdown if already computed."""
    first = first or stage_memory(args, training, plan, 0)
    best = (0, first)
    for rank in ranks_to_check(args, plan, training.seq_len, training.pipeline_split)[1:]:
        items = stage_memory(args, training, plan, rank)
        if items["total"] > best[1]["total"]:
            best = (rank, items)
    return best


def to_gib(items: dict[str, float]) -> dict[str, float]:
    return {k: round(v / GiB, 3) for k, v in items.items()}
