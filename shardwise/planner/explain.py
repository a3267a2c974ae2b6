"""Why the best plan is what it is: which constraint broke on one device, and the cheapest fix that respects it.

Three parts: which of the three ways a run outgrows one device (model too big, batch too small, wall-clock too
long) applies; where the plan stops on the decision sequence, cheapest fix first (LoRA -> BF16 + checkpointing ->
DDP -> ZeRO-1/2 -> FSDP -> TP -> PP -> 3D); and, for every degree and knob, what the search saw when it was set
otherwise (slower, by how much, or out of memory, by how much).

The steps' public sources: LoRA and QLoRA (Hu et al. 2022; Dettmers et al. 2023), activation checkpointing (Chen
et al. 2016), PyTorch DDP (Li et al. 2020), ZeRO (Rajbhandari et al. 2020), PyTorch FSDP (Zhao et al. 2023),
Megatron-LM tensor parallelism (Shoeybi et al. 2019), GPipe pipeline parallelism (Huang et al. 2019) and 3D
parallelism (Narayanan et al. 2021).
"""

from __future__ import annotations

import dataclasses
import math

from shardwise.hardware import Cluster, GiB
from shardwise.model_args import ModelArgs, count_text, num_params
from shardwise.planner.memory import adapted_base_params, layer_params, lora_params, model_state_bytes
from shardwise.planner.search import TIE, Evaluation, SearchResult, budget, mixed_precisions, search
from shardwise.planner.workload import Training

EXPLAINED = ("tp", "pp", "cp", "ep", "dp_shard", "dp_replicate", "zero_stage", "micro_batch",
             "activation_checkpoint", "pp_schedule", "virtual_stages", "offload", "mixed_precision")
"""The knobs explained; `ep` (expert parallelism, GShard: Lepikhin et al. 2020) only for a mixture of experts,
`mixed_precision` only where the search tried both (search.mixed_precisions: shardwise's engine in bf16)."""


def single_device(args: ModelArgs, training: Training, cluster: Cluster) -> dict:
    """The one-device diagnosis: which constraint breaks first."""
    one = dataclasses.replace(cluster, gpus=1)
    limit = budget(one)
    n = num_params(args)
    trainable = None
    if training.lora_rank:
        trainable = args.n_layers * lora_params(args, training)
    linears = args.n_layers * (layer_params(args) - 2 * args.dim)
    adapted = args.n_layers * adapted_base_params(args, training)
    matmul = linears + (0 if args.tie_embeddings else args.vocab_size * args.dim)
    states = sum(model_state_bytes(n, training, 0, 1, "none", trainable, adapted, matmul, linears).values())
    states += training.fixed_overhead_gib * GiB
    out = {"model_state_gib": states / GiB, "budget_gib": limit / GiB, "fits": False, "max_micro_batch": 0,
           "step_time_s": None}
    if states > limit:
        out["failure"] = "model too big"
        # both figures: the model state itself (16 bytes x 8.03B = 119.7 GiB) and with the fixed overhead
        out["reason"] = (f"model state alone is {states / GiB - training.fixed_overhead_gib:.1f} GiB "
                         f"({count_text(n)} parameters), {states / GiB:.1f} with the "
                         f"{training.fixed_overhead_gib:g} GiB fixed overhead, against {limit / GiB:.1f} GiB")
        return out
    fixed = {"offload": "none"}
    result = search(args, training, one, fixed=fixed, top_k=1)
    best = result.ranked
    if not best:
        out["failure"] = "model too big"
        out["reason"] = (f"model state fits ({states / GiB:.1f} GiB) but not even one {training.seq_len}-token "
                         "sequence's activations do, with full recompute")
        return out
    ev = best[0]
    # the largest micro-batch any fitting plan ran (the fastest may run a smaller one: recompute costs time)
    largest = max(value for knob, value in result.best_by_knob if knob == "micro_batch")
    out.update(fits=True, max_micro_batch=largest, step_time_s=ev.time.step_time_s,
               tokens_per_s=ev.time.tokens_per_s)
    if largest < training.global_batch:
        out["failure"] = "batch too small" if cluster.gpus == 1 else "wall-clock too long"
        out["reason"] = (f"one device holds at most {largest} of the global batch's {training.global_batch} "
                         f"sequences per pass, so it accumulates: the fastest plan runs {ev.plan.micro_batch} per "
                         f"pass, {ev.plan.grad_accum} passes a step, {ev.time.step_time_s:.2f} s per step")
    else:
        out["failure"] = "wall-clock too long" if cluster.gpus > 1 else "none"
        out["reason"] = f"the whole batch fits on one device: {ev.time.step_time_s:.2f} s per step"
    return out


def decision_sequence(ev: Evaluation, training: Training) -> list[str]:
    """Which of the decision sequence's eight steps the plan uses, and the last one it needs."""
    p = ev.plan
    # step 2 names the half (or both) the plan uses: "BF16 + checkpointing" read as recompute on a plan without it;
    # the half precision is the plan's own (a V100's fp16 read as "BF16", which it has none of)
    second = " + ".join(name for name, on in ((training.precision.upper(), training.mixed),
                                              (f"{p.activation_checkpoint} checkpointing" + (
                                                  f" of one block in {p.activation_checkpoint_every}"
                                                  if p.activation_checkpoint_every > 1 else ""),
                                               p.activation_checkpoint != "none")) if on)
    offload = f" + {p.offload} CPU offload" if p.offload != "none" else ""
    steps = [
        ("1 LoRA/QLoRA", training.lora_rank > 0),
        (f"2 {second}", bool(second)),
        ("3 DDP", p.dp > 1 and p.zero_stage == 0 or p.dp_replicate > 1),
        # offload (ZeRO-Offload; FSDP2's CPUOffloadPolicy) runs with ZeRO-2/3 only: named on that step, or a plan on
        # one GPU that fits only by offloading read as "4 ZeRO-1/2"
        ("4 ZeRO-1/2" + offload, p.zero_stage in (1, 2)),
        ("5 FSDP (ZeRO-3)" + offload, p.zero_stage == 3),
        ("6 tensor parallel", p.tp > 1),
        ("7 pipeline parallel", p.pp > 1),
        ("8 3D parallel", p.tp > 1 and p.pp > 1 and p.dp > 1),
    ]
    used = [name for name, on in steps if on]
    return used


def knob_reasons(ev: Evaluation, result: SearchResult, knobs: tuple[str, ...] = EXPLAINED) -> dict[str, str]:
    """For each degree and knob: the chosen value and what every alternative the search tried came to."""
    best_t = ev.time.step_time_s
    limit = ev.budget
    out = {}
    for knob in knobs:
        chosen = getattr(ev.plan, knob)
        alts = sorted({v for (k, v) in result.min_memory_by_knob if k == knob and v != chosen},
                      key=lambda v: (str(type(v)), v))
        parts = []
        for v in alts:
            t = result.best_by_knob.get((knob, v))
            if t is not None and t <= best_t * (1 + TIE):
                parts.append(f"{knob}={v}: the same step time (within {TIE:.1%}), no less memory")
            elif t is not None:
                parts.append(f"{knob}={v}: {100 * (t / best_t - 1):+.1f}% step time")
            else:
                m = result.min_memory_by_knob[(knob, v)]
                parts.append(f"{knob}={v}: out of memory (least {m / GiB:.1f} GiB > {limit / GiB:.1f})")
        out[knob] = f"{knob}={chosen}" + (" because " + "; ".join(parts) if parts else " (the only option)")
    return out


def explain(args: ModelArgs, training: Training, cluster: Cluster, result: SearchResult) -> dict:
    """Everything the CLI prints under the table, as data (the JSON output carries it too)."""
    out = {"single_device": single_device(args, training, cluster), "decision_sequence": [], "knobs": {}}
    if result.least_host < math.inf:  # offload layouts the search left out for the host's memory
        node = min(cluster.gpus_per_node, cluster.gpus)
        what = "offloaded activations (offload_layers)" if training.offload_layers else "offload"
        out["host_memory"] = (f"{what} left out: the least host memory a plan with them needs is "
                              f"{result.least_host * node / GiB:,.0f} GiB per node of "
                              f"{cluster.accelerator.host_memory_bytes * node / GiB:,.0f} (--host-memory-gib)")
    if result.ranked:
        best = result.ranked[0]
        out["decision_sequence"] = decision_sequence(best, training)
        lacks = ({"tp"} if not training.tensor_parallel else set()) | (
            {"ep"} if not training.expert_parallel else set()) | (
            {"cp"} if not training.context_parallel else set()) | (
            {"pp", "pp_schedule", "virtual_stages"} if not training.pp_schedules else set())  # the system has none
        out["knobs"] = knob_reasons(best, result, tuple(k for k in EXPLAINED if (k != "ep" or args.n_experts) and (
            k != "mixed_precision" or len(mixed_precisions(training)) > 1) and k not in lacks))
    return out


def render(expl: dict, cluster: Cluster) -> str:
    sd = expl["single_device"]
    lines = [f"On one {cluster.accelerator.name}: {sd['failure']} - {sd['reason']}."]
    if expl["decision_sequence"]:
        lines.append("Decision sequence (LoRA -> BF16 + checkpointing -> DDP -> ZeRO-1/2 -> FSDP -> TP -> PP -> 3D) "
                     "used: " + ", ".join(expl["decision_sequence"])
                     + f"; it stops at step {expl['decision_sequence'][-1].split()[0]}.")
    for text in expl["knobs"].values():
        lines.append("  " + text)
    if "host_memory" in expl:
        lines.append(expl["host_memory"][0].upper() + expl["host_memory"][1:] + ".")
    return "\n".join(lines)
