"""The planner against the Ultra-Scale Playbook's benchmark sweep: 1,751 measured layouts of four Llama shapes on 1
to 64 nodes of 8 H100s (1,738 of them evaluated), ranked within each (model, nodes) cell.

    python benchmarks/planner_ultrascale.py [--cells 1B/1,8B/16] [--quick]

Source: Hugging Face's "The Ultra-Scale Playbook: Training LLMs on GPU Clusters" (Tazi, Mom, Zhao, Nguyen, Mekkouri,
Werra, Wolf; February 2025, huggingface.co/spaces/nanotron/ultrascale-playbook), its interactive figure of every
benchmarked layout, assets/data/benchmarks/benchmarks_interactive.html, read in a stored copy of the space
(github.com/vinjn/nanotron-ultrascale-playbook at 924e4d0, fragments/benchmarks_interactive.html). Each point's
hover text gives "Nodes, MBS, GradAcc, GBS, DP, PP, TP, ZeRO" and "MFU, tok/s/gpu, tok/s, GPU memory", or nan for
the runs the figure marks "crashed/oom". `benchmarks/data/ultrascale_playbook.csv` holds them as printed (3,257
distinct layouts: 1,751 measured, 1,506 crashed or out of memory). The text: "We ran over 4,100 distributed
experiments ... with up to 512 GPUs"; "1-64 nodes of 8xH100s"; "All the following benchmarks were conducted with a
sequence length of 4,096 and a global batch size of 1M tokens" (256 sequences); inter-node traffic over EFA
("between nodes (EFA)").

The models and code are nanotron's scripts/scaling_benchmarks.py (PR 281, merged 2025-02-19) at the branch that ran
them (nouamane/bench2 at 67c5ebb6): (layers, hidden, heads, intermediate) = 1B (16, 2048, 32, 8192), 3B (28, 3072,
32, 8192), 8B (32, 4096, 32, 14336), 80B (80, 8192, 64, 28672); multi-head attention (NUM_KEY_VALUE_HEADS None:
"we can't bench tp>8 if we use 8 KV heads"); vocabulary 131,072; embeddings tied below an intermediate size of
10,000 (1B, 3B); tp_mode REDUCE_SCATTER (sequence parallelism); no recompute; pp_engine 1f1b
(examples/config_tiny_llama_bench.yaml on that branch); the system `benchmarks/systems/nanotron.toml`. Its parameter
count (estimate_num_params) gives the figure's sizes, 1.34, 3.57, 8.86 and 80.0 B. The cluster, from run_multinode.sh
(hostnames ip-26-0-..., /fsx, partition hopper-prod): AWS's p5 H100 nodes, 8 GPUs on NVLink and 3,200 Gb/s of EFA a
node, the catalogue's H100 (50 GB/s a GPU a direction).

The measurement (nanotron's trainer.py, NANOTRON_BENCHMARK=1): the third step's wall time after a barrier and a
device synchronisation, global batch x sequence / time; "tok/s/gpu" divides by the world size. The figure's MFU
is the model FLOPs of nanotron's get_flops (attention counted over the whole s x s, not causal) with the vocabulary's
matmul once per copy of its weight (twice for the untied 8B and 80B and, in a pipeline, for the tied ones; once in
get_flops at 67c5ebb6) over 989.5 TFLOP/s: it agrees with tok/s/gpu within the printing's rounding but for 11 of the
1,002 rows at 5% MFU or more (80B pipelined ZeRO-0 rows at micro-batch 1, about 11% below), so tokens/s, not MFU, is
compared here. "GPU memory" is one of
the two peaks nanotron's log_throughput writes on world rank 0 (a rank of the first pipeline stage), "Mem Alloc (GB)"
(max_memory_allocated) or "Mem Res (GB)" (max_memory_reserved), both in GiB; which one the figure plots is not
stated, so both of the planner's counterparts are printed, for stage 0. Left out: twelve measured rows whose DP x MBS x
GradAcc is not the 256 sequences their GBS column states (their tokens/s was measured at the smaller batch). Five
layouts appear measured two or three times with different results (8B on 2 nodes at d2 t8 mb1: 3,449 and 737
tokens/s a GPU; four 80B layouts within 25%): the file keeps the first the figure lists, the fastest.

For each cell (one model on one node count: the sweep) the script prints the rank correlation of predicted and
published tokens/s per GPU over the cell's measured layouts, the ratio predicted / published throughput
(median, range) over the layouts the planner says fit, the memory ratios, the fit verdicts (measured layouts
predicted not to fit; crashed-or-out-of-memory layouts predicted to fit: "crashed" includes hangs and other failures,
so the second is not a verdict the source states), and the best layout, measured and predicted. Then two counts from
the figure alone, not the planner: the pipelined rows faster than the bench branch's last commit could run them (its
p2p polls each message with 0.1-s sleeps: POLL_FLOOR_S), so the figure mixes two versions of nanotron's pipeline; and
how far apart the peaks of ZeRO-0 layouts holding the same rank state lie (docs/planner.md, "The Ultra-Scale
Playbook's sweep, held out").
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from planner_published import Run, given_plan, spearman, training_of  # noqa: E402

from shardwise.hardware import GiB  # noqa: E402
from shardwise.model_args import ModelArgs, flops_per_token  # noqa: E402
from shardwise.planner import PlannerError  # noqa: E402
from shardwise.planner.memory import reserved_bytes, stage_memory  # noqa: E402

SOURCE = ("Hugging Face, The Ultra-Scale Playbook (2025), assets/data/benchmarks/benchmarks_interactive.html, "
          "https://huggingface.co/spaces/nanotron/ultrascale-playbook")
DATA = Path(__file__).parent / "data" / "ultrascale_playbook.csv"
SEQ, BATCH = 4096, 256
SHAPES = {"1B": (16, 2048, 32, 8192), "3B": (28, 3072, 32, 8192), "8B": (32, 4096, 32, 14336),
          "80B": (80, 8192, 64, 28672)}
"""scaling_benchmarks.py's model_configs: (layers, hidden size, heads, intermediate size)."""


def model(name: str) -> ModelArgs:
    layers, hidden, heads, inter = SHAPES[name]
    return ModelArgs(name=f"nanotron-{name}", dim=hidden, n_heads=heads, n_kv_heads=heads, n_layers=layers,
                     vocab_size=131072, ffn_hidden=inter, max_seq_len=SEQ, tie_embeddings=inter < 10_000)


def rows() -> list[dict]:
    with DATA.open() as f:
        return [{k: (v if k == "model" else float(v)) for k, v in r.items()} for r in csv.DictReader(f)]


def run_of(r: dict) -> Run:
    m = model(r["model"])
    dp, tp, pp, mbs, acc, zero = (int(r[k]) for k in ("dp", "tp", "pp", "mbs", "grad_acc", "zero"))
    gpus = 8 * int(r["nodes"])
    plan = (f"tp={tp},pp={pp},cp=1,dp_replicate={dp},zero_stage={zero},micro_batch={mbs},grad_accum={acc},"
            f"activation_checkpoint=none,sequence_parallel={'true' if tp > 1 else 'false'}"
            + (",pp_schedule=1f1b" if pp > 1 else ""))
    measured = not math.isnan(r["tok_s_gpu"])
    return Run(f"Ultrascale {r['model']} n={gpus} d{dp} t{tp} p{pp} mb{mbs} ga{acc} z{zero}", m, gpus, SEQ,
               dp * mbs * acc, plan, SOURCE,
               f"Nodes: {int(r['nodes'])} MBS: {mbs} GradAcc: {acc} DP: {dp} PP: {pp} TP: {tp} ZeRO: {zero} | "
               + (f"tok/s/gpu: {r['tok_s_gpu']:,.0f} GPU memory: {r['mem_gb']} GB" if measured else "nan"),
               tflops=r["tok_s_gpu"] * flops_per_token(m, SEQ) / 1e12 if measured else None,
               mem_gib=r["mem_gb"] if measured else None, fitted=measured, gpu="h100", search=False,
               system="nanotron.toml")


def stage0_memory(run: Run, ev) -> tuple[float, float]:
    """Stage 0's peak (world rank 0's, which nanotron logs) as torch counts allocated and reserved bytes."""
    training = training_of(run)
    items = stage_memory(run.model, training, ev.plan, 0)
    allocated = items["total"] - items["fragmentation"] - items["fixed_overhead"]
    return allocated, reserved_bytes(run.model, training, ev.plan, 0, ev.budget - items["fixed_overhead"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", default="", help="only these cells, e.g. 1B/1,8B/16 (model/nodes)")
    parser.add_argument("--quick", action="store_true", help="measured layouts only (no crashed ones)")
    ns = parser.parse_args()
    cells = {tuple(c.split("/")) for c in ns.cells.split(",") if c}
    start = time.perf_counter()
    by_cell: dict[tuple[str, int], list] = {}
    skipped, unexpressed = 0, []
    for r in rows():
        if cells and (r["model"], str(int(r["nodes"]))) not in cells:
            continue
        measured = not math.isnan(r["tok_s_gpu"])
        if measured and int(r["dp"] * r["mbs"] * r["grad_acc"]) != BATCH:
            skipped += 1
            continue
        if ns.quick and not measured:
            continue
        run = run_of(r)
        try:
            ev, fits = given_plan(run)
        except PlannerError:  # more stages than blocks: nanotron counts its embedding, norm, head and loss as
            unexpressed.append(run)  # pipeline blocks too (PipelineBlock), the planner's split does not
            continue
        allocated, reserved = stage0_memory(run, ev)
        by_cell.setdefault((r["model"], int(r["nodes"])), []).append((run, ev, fits, allocated, reserved, r))
    print(f"left out: {skipped} measured rows whose DP x MBS x GradAcc is not {BATCH}; {len(unexpressed)} layouts with "
          f"more pipeline stages than blocks, which the planner does not split ("
          f"{sum(r.fitted for r in unexpressed)} of them measured: "
          f"{', '.join(r.name for r in unexpressed if r.fitted) or 'none'})\n")
    head = (f"{'cell':10s} {'n':>4s} {'rho':>5s} {'ratio med':>9s} {'range':>11s} {'fit n':>5s} "
            f"{'mem alloc':>9s} {'mem res':>8s} {'ran, NO':>7s} {'crash, yes':>10s}  best measured / best predicted")
    print(head)
    print("-" * len(head))
    all_ratios, all_alloc, all_res, rhos, ran_no, crash_yes, crashed = [], [], [], [], 0, 0, 0
    for (name, nodes), items in sorted(by_cell.items(), key=lambda kv: (int(kv[0][0][:-1]), kv[0][1])):
        ok = [x for x in items if x[0].fitted]
        bad = [x for x in items if not x[0].fitted]
        crashed += len(bad)
        tokens = BATCH * SEQ
        pred = [tokens / x[0].gpus / x[1].time.step_time_s for x in ok]
        pub = [tokens / x[0].gpus / x[0].published_step() for x in ok]
        rho = spearman(pred, pub) if len(ok) >= 3 else float("nan")
        if len(ok) >= 3:
            rhos.append(((name, nodes), rho))
        ratios = [p / q for p, q, x in zip(pred, pub, ok) if x[2]]
        alloc = [x[3] / GiB / x[0].mem_gib for x in ok if x[0].mem_gib]
        res = [x[4] / GiB / x[0].mem_gib for x in ok if x[0].mem_gib]
        all_ratios += ratios
        all_alloc += alloc
        all_res += res
        no = sum(not x[2] for x in ok)
        yes = sum(x[2] for x in bad)
        ran_no += no
        crash_yes += yes
        best_pub = max(range(len(ok)), key=pub.__getitem__) if ok else None
        best_pred = max(range(len(ok)), key=lambda i: pred[i] if ok[i][2] else 0) if ok else None
        tail = (f"{ok[best_pub][0].name.split(maxsplit=3)[3]} {pub[best_pub]:,.0f} / "
                f"{ok[best_pred][0].name.split(maxsplit=3)[3]} (measured {pub[best_pred]:,.0f})") if ok else ""
        med = statistics.median(ratios) if ratios else float("nan")
        rng = f"{min(ratios):.2f}..{max(ratios):.2f}" if ratios else "-"
        within = (f"{sum(abs(a - 1) <= 0.1 for a in alloc):3d}/{len(alloc):<3d}" if alloc else "-")
        within_r = (f"{sum(abs(a - 1) <= 0.1 for a in res):3d}/{len(res):<3d}" if res else "-")
        print(f"{name + '/' + str(nodes):10s} {len(ok):4d} {rho:5.2f} {med:9.3f} {rng:>11s} {len(ratios):5d} "
              f"{within:>9s} {within_r:>8s} {no:7d} {yes:5d}/{len(bad):<4d}  {tail}")
    print()
    if all_ratios:
        print(f"throughput, layouts predicted to fit: n={len(all_ratios)}, median |ratio - 1| "
              f"{statistics.median(abs(r - 1) for r in all_ratios):.1%}, geometric mean "
              f"{math.exp(statistics.fmean(math.log(r) for r in all_ratios)):.3f}")
    if rhos:
        print(f"rank order: {sum(r >= 0.8 for _, r in rhos)} of {len(rhos)} cells at Spearman >= 0.8, median "
              f"{statistics.median(r for _, r in rhos):.2f}, lowest {min(r for _, r in rhos):.2f}")
    for label, mem in (("allocated (max_memory_allocated)", all_alloc), ("reserved (max_memory_reserved)", all_res)):
        if mem:
            print(f"memory as {label}: {sum(abs(m - 1) <= 0.1 for m in mem)} of {len(mem)} within 10%, median "
                  f"ratio {statistics.median(mem):.3f}")
    print(f"fit verdicts: {ran_no} measured layouts predicted not to fit; {crash_yes} of {crashed} crashed-or-OOM "
          f"layouts predicted to fit")
    measured = [x[5] for items in by_cell.values() for x in items if x[0].fitted]
    below, pipelined = polling_floor_counts(measured)
    if pipelined:
        print(f"pipelined rows faster than nanotron 67c5ebb6's p2p polling allows ({POLL_FLOOR_S:g} s a micro-batch), "
              f"so run on an earlier pipeline: {sum(below.values())} of {sum(pipelined.values())} (by nodes: "
              + ", ".join(f"{n}: {below[n]}/{pipelined[n]}" for n in sorted(pipelined)) + ")")
    groups, spans = same_rank_memory(measured)
    if groups:
        print(f"memory, ZeRO-0 layouts of one rank state on several node counts (dp > 1, micro-batches >= pp): "
              f"{groups} groups, {sum(s > 1.1 for s in spans)} spanning more than 10%, "
              f"{sum(s > 1.2 for s in spans)} more than 20%")
    print(f"\ntotal {time.perf_counter() - start:.1f} s")


POLL_FLOOR_S = 2 * 2 * 0.1
"""A lower bound on a micro-batch on pipeline stage 0 under nanotron 67c5ebb6's p2p.py (the bench branch's last
commit): each send and receive polls each of its two metadata messages with `while not work.is_completed():
time.sleep(0.1)` (its parent sent them with blocking dist.send), and stage 0 makes three transfers a micro-batch (its
hidden states and its sequence mask out, each a PipelineBlock output of its own, and the gradient back): six polled
messages. Four of them are counted, room for a poll that finds its message already complete."""


def polling_floor_counts(rows: list[dict]) -> tuple[dict[int, int], dict[int, int]]:
    """Of the measured pipelined rows, by node count: those whose step is shorter than POLL_FLOOR_S a micro-batch
    (so not run on 67c5ebb6), and all of them. From the figure alone, not the planner."""
    below: dict[int, int] = {}
    pipelined: dict[int, int] = {}
    for r in rows:
        if r["pp"] > 1:
            n = int(r["nodes"])
            step = BATCH * SEQ / (r["tok_s_gpu"] * 8 * n)
            pipelined[n] = pipelined.get(n, 0) + 1
            below[n] = below.get(n, 0) + (step < POLL_FLOOR_S * r["grad_acc"])
    return below, pipelined


def same_rank_memory(rows: list[dict]) -> tuple[int, list[float]]:
    """Measured ZeRO-0 layouts over more than one data-parallel rank (DDP's buckets) with at least as many
    micro-batches as stages, grouped by model, tp, pp and micro-batch: a rank's state and what it holds in flight do
    not depend on the node count there. (groups measured on several node counts, each one's largest over smallest
    peak)."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        if r["zero"] == 0 and r["dp"] > 1 and r["grad_acc"] >= r["pp"]:
            groups.setdefault((r["model"], r["tp"], r["pp"], r["mbs"]), []).append(r["mem_gb"])
    spans = [max(g) / min(g) for g in groups.values() if len(g) > 1]
    return len(spans), spans


if __name__ == "__main__":
    main()
