"""`--plot`: the memory breakdown of the top plans and the best plan's pipeline timeline, as one PNG.

matplotlib is imported here only, so the planner itself does not depend on it.
"""

from __future__ import annotations

from shardwise.hardware import GiB, PlannerError
from shardwise.planner.search import Evaluation
from shardwise.planner.timeline import simulate

ITEMS = ("params", "buffers", "replica_params", "grads", "master_weights", "optimizer_state", "compute_copies",
         "activations", "backward_and_logits", "fsdp_buffers", "ddp_buckets", "ddp_bucket_copy", "p2p_buffers",
         "fragmentation", "allocator_segments", "fixed_overhead")
MAX_TIMELINE_MICROBATCHES = 32  # beyond this the bars are too thin to read; the drawing keeps the first 32


def plot(plans: list[Evaluation], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlannerError("--plot", "matplotlib is not installed", "pip install matplotlib, or drop --plot")
    if not plans:
        raise PlannerError("--plot", "no plan to draw", "drop --plot or give a plan that can be evaluated")
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [1, 1.6]})
    _memory(left, plans)
    _timeline(right, plans[0])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _memory(ax, plans: list[Evaluation]) -> None:
    labels = [f"#{i + 1}" for i in range(len(plans))]
    bottom = [0.0] * len(plans)
    for item in ITEMS:
        values = [ev.memory.get(item, 0.0) / GiB for ev in plans]
        if any(values):
            ax.bar(labels, values, bottom=bottom, label=item)
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(plans[0].budget / GiB, color="black", linestyle="--", linewidth=1, label="device memory")
    ax.set_ylabel("GiB per device (peak rank)")
    ax.set_title("Memory breakdown")
    ax.legend(fontsize=7, loc="upper right")


def _timeline(ax, ev: Evaluation) -> None:
    p = ev.plan
    if p.pp == 1:
        ax.text(0.5, 0.5, "no pipeline (pp = 1)", ha="center", va="center")
        ax.set_axis_off()
        return
    t = ev.time
    per_mb = t.detail["per_microbatch_s"]
    compute = t.compute_s + t.recompute_s
    fwd_share = 1 / 3 if compute == 0 else (t.compute_s / 3) / compute  # forward is a third of the compute
    schedule = p.pp_schedule if p.pp_schedule in ("gpipe", "1f1b") else "1f1b"
    m = min(p.grad_accum, MAX_TIMELINE_MICROBATCHES)
    ops = simulate(schedule, p.pp, m, per_mb * fwd_share, per_mb * (1 - fwd_share))
    for op in ops:
        ax.barh(op.rank, op.end - op.start, left=op.start, color="tab:blue" if op.kind == "F" else "tab:orange",
                edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(p.pp))
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_ylabel("pipeline rank")
    note = "" if schedule == p.pp_schedule else f" ({p.pp_schedule} drawn as 1F1B)"
    ax.set_title(f"{schedule} timeline, first {m} of {p.grad_accum} micro-batches{note}; "
                 f"bubble {100 * t.bubble_fraction:.1f}%")
