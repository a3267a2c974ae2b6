"""`shardwise bench`: measure this machine and write a hardware profile the planner takes instead of datasheets.

What it measures: large-matmul FLOP/s per dtype, fused attention (forward + backward) FLOP/s, memory bandwidth (a
large copy), and gloo (CPU) or NCCL (GPU) all-reduce / all-gather / reduce-scatter bus bandwidth between local
processes, reported the way nccl-tests does: algbw = bytes / time; busbw = algbw x 2(N-1)/N for all-reduce and
x (N-1)/N for the other two, which is the per-link bandwidth B of the ring formulas in comm.py. The latency
alpha comes from a tiny all-reduce: 2(N-1) alpha. And whether a collective runs alongside compute: the share of
the shorter of the two that disappears when both are issued together (`comm_overlap`). On a CPU also the fixed
cost of one operator (our model's forward + backward at a tiny size over its operator count, see opcount.py), of
one optimizer operator, and the extra cost of an operator on DTensors.

The profile describes one rank of a `--world`-rank job on this machine: the compute rates are measured in
`--world` processes at once, each on its own GPU or, on a CPU, with its share of the cores (`--threads`,
by default cores // world, what `shardwise train --nproc` gives each rank), and the slowest rank's rate is kept.
Every compute timing is the fastest of its repetitions (on a shared machine, the one no other job interrupted);
collectives, whose time varies from call to call by itself, take the median of samples that are each the mean of
many calls (`_timed_collective`). Also what a collective costs beyond its own time when the ranks arrive from
compute (`collective_sync`).

With `--base GPU`, the datasheet entry is kept and its efficiencies become measured / datasheet; without it (a
CPU, or a device not in the catalogue) the measured rates become the peaks and the efficiencies 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.config import OptimConfig
from shardwise.distributed import shutdown
from shardwise.hardware import ALIASES, CATALOGUE, Accelerator, GiB, PlannerError, accelerator
from shardwise.model import Transformer, causal_attention
from shardwise.model_args import ModelArgs
from shardwise.optim import build_optimizer
from shardwise.parallel.compat import all_gather_single, reduce_scatter_single
from shardwise.parallel.tensor_parallel import split_model  # (and shardwise.parallel's hook for shutdown)
from shardwise.planner import opcount

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--out", default="hardware_profile.json", help="where to write the profile JSON")
    a("--base", default=None, help="catalogue GPU whose datasheet numbers to keep (efficiencies become measured)")
    a("--world", type=int, default=2,
      help="ranks of the job the profile describes (compute measured in this many processes at once; "
           "collectives across max(2, world))")
    a("--threads", type=int, default=0, help="CPU threads per rank; 0: cores // world, as `train --nproc` sets")
    a("--matmul-size", type=int, default=2048, help="n of the n x n x n matmul")
    a("--matmul-grid", default=None,
      help="comma-separated sizes that m, n and k of the measured GEMM shapes take (default: "
           + "; ".join(f"{d} {','.join(map(str, g))}" for d, g in MATMUL_GRID.items()) + ")")
    a("--comm-mb", type=float, default=64.0, help="largest collective message, MB")
    a("--iters", type=int, default=5, help="timed repetitions per measurement")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"])


def run_bench(ns: argparse.Namespace) -> int:
    try:
        profile = measure(ns)
    except PlannerError as e:
        print(f"shardwise: error: {e}", file=sys.stderr)
        return 2
    Path(ns.out).write_text(json.dumps(profile, indent=2))
    m = profile["measurements"]
    print(f"wrote {ns.out}: per rank of {ns.world} ({m['threads_per_rank']} threads on a CPU): matmul "
          f"{', '.join(f'{k} {v / 1e12:.3f} TFLOP/s' for k, v in m['matmul_flops'].items())}; "
          f"memory {m['mem_bandwidth'] / 1e9:.1f} GB/s; all-reduce busbw {m['all_reduce_busbw'] / 1e9:.2f} GB/s "
          f"over {m['collective_world']} ranks, latency {m['latency_s'] * 1e6:.0f} us, overlap with compute "
          f"{profile['comm_overlap']:.2f}, sync {profile['collective_sync_s'] * 1e6:.0f} us; per operator "
          f"{profile['op_overhead_s'] * 1e6:.1f} us (optimizer {profile['optimizer_op_overhead_s'] * 1e6:.1f} us, "
          f"DTensor +{profile['dtensor_op_overhead_s'] * 1e6:.1f} us, optimizer on DTensors "
          f"+{profile['dtensor_optimizer_op_overhead_s'] * 1e6:.1f} us); per data-parallel unit and micro-batch: "
          f"replicate {profile['replicate_unit_overhead_s'] * 1e3:.2f} ms, ZeRO-2 "
          f"{profile['zero2_unit_overhead_s'] * 1e3:.2f} ms, ZeRO-3 {profile['zero3_unit_overhead_s'] * 1e3:.2f} ms")
    return 0


def _device(choice: str) -> str:
    if choice == "cuda" and not torch.cuda.is_available():
        raise PlannerError("--device", "CUDA is not available here", "use --device cpu or auto")
    return "cuda" if choice == "cuda" or choice == "auto" and torch.cuda.is_available() else "cpu"


def _timed(fn, iters: int, device: str, min_seconds: float = 0.0) -> float:
    """Seconds per call of `fn`, from the fastest of `iters` samples: what the device does when nothing else
    interrupts it (on a machine shared with other jobs most samples are slowed by them, by varying amounts).
    A sample repeats `fn` for at least `min_seconds`, so that ranks time-sharing cores (more processes than
    cores) are measured at their share, not in the moments they happen to run alone. (Collectives:
    `_timed_collective`.)"""
    warm = _once(fn, device)  # also the warm-up: first calls pay for allocation and kernel selection
    reps = max(1, math.ceil(min_seconds / max(warm, 1e-9)))

    def sample():
        for _ in range(reps):
            fn()

    samples = sorted(_once(sample, device) for _ in range(iters))
    return samples[0] / reps


def _once(fn, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


OVERHEADS = ("op_overhead_s", "optimizer_op_overhead_s", "dtensor_op_overhead_s", "dtensor_optimizer_op_overhead_s",
             "replicate_unit_overhead_s", "zero2_unit_overhead_s", "zero3_unit_overhead_s")
"""The per-operator costs (seconds, CPU only) `compute_rates` measures beside the rates; the profile's fields."""

SUSTAINED_S = 0.25
"""Shortest sample of a compute-rate measurement when the ranks' threads outnumber the cores: many scheduler time
slices, so that each rank is measured at its share of the cores."""


def matmul_flops(n: int, dtype: torch.dtype, device: str, iters: int, min_seconds: float = 0.0) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _timed(lambda: a @ b, iters, device, min_seconds)


MATMUL_GRID = {"cpu": (128, 512, 2048), "cuda": (256, 1024, 4096, 16384)}
"""Sizes each of m, n and k takes in the grid of GEMM shapes measured (every combination): what a transformer's
linears are (tokens x features x features, and features x features x tokens for weight gradients) spans them, and
small or thin GEMMs reach a far lower rate than the large cube (Accelerator.matmul_by_shape)."""


def matmul_shape_flops(m: int, n: int, k: int, dtype: torch.dtype, device: str, iters: int,
                       min_seconds: float = 0.0) -> float:
    """FLOP/s of (m x k) @ (k x n), the layout of a linear's forward (activations @ weight^T)."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, k, device=device).to(dtype).t()
    return 2 * m * n * k / _timed(lambda: a @ b, iters, device, min_seconds)


ATTENTION_SHAPES = [(seq, hd) for seq in (128, 512, 2048) for hd in (32, 64, 128)]
"""(sequence length, head dimension) at which fused attention is measured: its rate depends on both (short
sequences and narrow heads leave the kernel's tiles part empty), and the planner interpolates between them."""


def attention_flops(device: str, dtype: torch.dtype, iters: int, min_seconds: float = 0.0, seq: int = 1024,
                    hd: int = 64) -> float:
    """The engine's causal attention (model.causal_attention: SDPA, or on a CPU the form timed fastest there),
    forward + backward, on the engine's layout (heads of sequence-major storage): (2 + 5) matmuls of 2 s d FLOPs
    per query, halved by the mask. As many (batch x head) rows as make about 1 GFLOP per call on a CPU (100 on a
    GPU)."""
    flops_per_row = 0.5 * 7 * 2 * seq * seq * hd
    rows = max(1, round((1e11 if device.startswith("cuda") else 1e9) / flops_per_row))
    q, k, v = (torch.randn(1, seq, rows, hd, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
               for _ in range(3))

    def step():
        out = causal_attention(q, k, v)
        out.sum().backward()

    return rows * flops_per_row / _timed(step, iters, device, min_seconds)


def mem_bandwidth(device: str, iters: int, min_seconds: float = 0.0) -> float:
    x = torch.empty(64 * 2**20, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / _timed(lambda: y.copy_(x), iters, device, min_seconds)  # read + write


def op_overhead(iters: int, min_seconds: float = 0.0) -> float:
    """Seconds per operator of our model's forward + backward at a tiny size (opcount.TINY): the arithmetic is
    negligible there, so the time over the counted operators is the fixed cost of one (Python, dispatcher,
    autograd bookkeeping and allocation on a CPU; the launch on a GPU would need the model there: CPU only)."""
    model = Transformer(opcount.tiny_args(ModelArgs(), n_layers=2))
    with opcount.OpCounter() as c:
        opcount.micro_batch(model, model.args)
    return _timed(lambda: opcount.micro_batch(model, model.args), iters, "cpu", min_seconds) / c.calls


def optimizer_op_overhead(iters: int, min_seconds: float = 0.0) -> float:
    """Seconds per operator of an optimizer step (gradient norm and AdamW, as the engine runs them: foreach and
    fused kernels) on a tiny model of 8 blocks, a foreach call counted once per tensor it loops over (as on a
    CPU), a fused one once. The gradients are kept between repetitions (zero_grad, which drops them, costs no
    operator)."""
    model = Transformer(opcount.tiny_args(ModelArgs(), n_layers=8))
    opt = build_optimizer(model, OptimConfig(), lr=1e-3)
    opcount.micro_batch(model, model.args)
    grads = [p.grad for p in model.parameters()]

    def step():
        torch.nn.utils.get_total_norm(grads, foreach=True)
        opt.step()

    step()  # creates the states
    with opcount.OpCounter() as c:
        step()
    return _timed(step, iters, "cpu", min_seconds) / c.per_tensor


def dtensor_op_overhead(iters: int, min_seconds: float = 0.0) -> float:
    """Extra seconds per operator on DTensors, as tensor parallelism runs them: our tiny model split over a pair
    of ranks by the engine (`split_model`, the smallest tp), per block (`_host_seconds_per_block`), over the
    operators of a block's 7 projections: sharding propagation, redistribution, wrapping and issuing the
    functional collectives, host-side work that grows with the operators, not the sizes. Not on a 1-rank mesh
    where there is a pair: there a Partial placement needs no collective, and the functional collectives' host
    work (about 200 us of CPU per call on a 2-core machine) never runs."""
    mesh = _pair_mesh()
    base = ModelArgs(n_heads=2, n_kv_heads=2)  # the tiny model's 2 heads, each KV head on its own rank
    per_block = _host_seconds_per_block(base, lambda model: split_model(model, mesh, sequence_parallel=False),
                                        iters, min_seconds)
    return per_block / (7 * opcount.live_op_counts(base).linear)


def dtensor_optimizer_op_overhead(iters: int, min_seconds: float = 0.0) -> float:
    """Extra seconds per operator of an optimizer step (gradient norm and AdamW, as
    `optimizer_op_overhead` times them) when the parameters are DTensors, as every parallel layout of the engine
    but a pure pipeline makes them: the tiny 8-block model's parameters and gradients replicated over a pair of
    ranks (as FSDP2's replicate leaves them) against the plain ones, this thread's CPU time times the plain
    step's wall / CPU time (see `_host_seconds_per_block`), over the plain step's operators."""
    from torch.distributed.tensor import distribute_module

    mesh = _pair_mesh()
    cpu, wall, ops = {}, {}, 0
    for split in (False, True):
        torch.manual_seed(0)
        model = Transformer(opcount.tiny_args(ModelArgs(), n_layers=8))
        if split:
            distribute_module(model, mesh)  # every parameter replicated (a DTensor)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt = build_optimizer(model, OptimConfig(), lr=1e-3)
        grads = [p.grad for p in model.parameters()]

        def step():
            torch.nn.utils.get_total_norm(grads, foreach=True)
            opt.step()

        step()  # creates the states
        if not split:
            with opcount.OpCounter() as c:
                step()
            ops = c.per_tensor
        cpu[split], wall[split] = _thread_timed(step, iters, min_seconds)
    return max(0.0, (cpu[True] - cpu[False]) * wall[False] / cpu[False]) / ops


def dp_unit_overhead(kind: str, iters: int, min_seconds: float = 0.0) -> float:
    """Host seconds per micro-batch (forward + backward) of one data-parallel unit of the engine's wrappers,
    `kind` "replicate" (ZeRO-0/1), "zero2" or "zero3" (fully_shard without and with resharding after forward):
    the tiny model wrapped over a pair of ranks by the engine (`apply_data_parallel`, each block its own bucket,
    so a unit per block and the root), per block (`_host_seconds_per_block`): the wrappers' hooks, their copies
    in and out of the communication buffers, and issuing the collectives."""
    from types import SimpleNamespace

    from shardwise.layout import Layout
    from shardwise.parallel.data_parallel import apply_data_parallel

    mesh = _pair_mesh()
    view = SimpleNamespace(grad_reduce=mesh, fsdp=mesh)  # the two sub-meshes apply_data_parallel reads
    zero = {"replicate": 0, "zero2": 2, "zero3": 3}[kind]
    # the layout of that pair: the engine wraps by the layout's degrees (ZeRO-2/3 shard over dp_shard)
    degrees = {"dp_shard": mesh.size()} if zero >= 2 else {"dp_replicate": mesh.size()}
    config = Layout(**degrees, zero_stage=zero, bucket_mb=0.0)
    return _host_seconds_per_block(ModelArgs(), lambda model: apply_data_parallel(model, view, config),
                                   iters, min_seconds)


def _pair_mesh():
    """A mesh of this rank and its neighbour (the smallest parallel group), or of this rank alone in a 1-rank or
    odd world. Every rank takes part in creating every subgroup."""
    from torch.distributed.device_mesh import DeviceMesh

    pair, _ = dist.new_subgroups(group_size=2 if dist.get_world_size() % 2 == 0 else 1)
    return DeviceMesh.from_group(pair, "cpu")


def _host_seconds_per_block(base: ModelArgs, transform, iters: int, min_seconds: float = 0.0) -> float:
    """Host seconds per block that `transform(model)` (the engine's tensor or data parallelism) adds to our tiny
    model's forward + backward: 3 blocks less 1, transformed less plain, halved. Timed as this thread's CPU time,
    so that the waits for the collectives (which the planner prices as communication) are left out: gloo runs
    them on threads of its own, and this one sleeps. Times the plain model's wall / CPU time, the share of a
    core this rank gets (1 unless the ranks' threads outnumber the cores)."""
    cpu, wall = {}, {}
    for changed in (False, True):
        for n_layers in (1, 3):
            torch.manual_seed(0)  # the same tokens on both ranks of a pair
            model = Transformer(opcount.tiny_args(base, n_layers))
            if changed:
                transform(model)
            cpu[changed, n_layers], wall[changed, n_layers] = _thread_timed(
                lambda: opcount.micro_batch(model, model.args), iters, min_seconds)
    per_block = (cpu[True, 3] - cpu[True, 1] - cpu[False, 3] + cpu[False, 1]) / 2
    return max(0.0, per_block * wall[False, 3] / cpu[False, 3])


def _thread_timed(fn, iters: int, min_seconds: float = 0.0) -> tuple[float, float]:
    """(CPU seconds of this thread, wall seconds) per call of `fn`, each from the fastest of `iters` samples of
    at least max(min_seconds, 50 ms). `fn` may hold collectives: the ranks agree on the calls per sample."""
    fn()  # warm-up: first calls take one-off paths
    start = time.perf_counter()
    fn()
    reps = max(1, math.ceil(max(min_seconds, 0.05) / max(_max_over_ranks(time.perf_counter() - start), 1e-9)))
    cpu, wall = [], []
    for _ in range(iters):
        dist.barrier()
        c0, w0 = time.thread_time(), time.perf_counter()
        for _ in range(reps):
            fn()
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
    return min(cpu) / reps, min(wall) / reps


def _max_over_ranks(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _init(rank: int, world: int, init: str, device: str, threads: int, backend: str) -> str:
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    return f"cuda:{rank}" if device == "cuda" else "cpu"


def _compute_worker(rank: int, world: int, init: str, device: str, threads: int, matmul_size: int,
                    dtypes: list[str], iters: int, grid: tuple[int, ...], out: str):
    """Every rank measures at once (a barrier before each measurement); the slowest rank's time is kept."""
    dev = _init(rank, world, init, device, threads, "gloo")
    attn_dtype = torch.float32 if device == "cpu" else torch.bfloat16
    shared = device == "cpu" and world * threads > (os.cpu_count() or 1)
    jobs = {**{f"matmul_{k}": partial(matmul_flops, matmul_size, DTYPES[k], dev) for k in dtypes},
            "attention": partial(attention_flops, dev, attn_dtype), "mem_bandwidth": partial(mem_bandwidth, dev),
            **{f"attention_{seq}_{hd}": partial(attention_flops, dev, attn_dtype, seq=seq, hd=hd)
               for seq, hd in ATTENTION_SHAPES},
            **{f"matmul_shape_{m}_{n}_{k}": partial(matmul_shape_flops, m, n, k, attn_dtype, dev)
               for m in grid for n in grid for k in grid}}
    overheads = {"op_overhead_s": op_overhead, "optimizer_op_overhead_s": optimizer_op_overhead,
                 "dtensor_op_overhead_s": dtensor_op_overhead,
                 "dtensor_optimizer_op_overhead_s": dtensor_optimizer_op_overhead,
                 **{f"{kind}_unit_overhead_s": partial(dp_unit_overhead, kind)
                    for kind in ("replicate", "zero2", "zero3")}} if device == "cpu" else {}
    results = {}
    for i, (name, job) in enumerate(jobs.items()):
        if rank == 0:
            _progress("compute", i + 1, len(jobs) + len(overheads), name)
        dist.barrier()
        rate = job(iters, SUSTAINED_S if shared else 0.0)
        slowest = torch.tensor([rate], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MIN)
        results[name] = slowest.item()
    for i, (name, job) in enumerate(overheads.items(), len(jobs)):
        if rank == 0:
            _progress("compute", i + 1, len(jobs) + len(overheads), name)
        dist.barrier()
        slowest = torch.tensor([job(iters, SUSTAINED_S if shared else 0.0)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        results[name] = slowest.item()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    shutdown()  # the overheads' pair meshes made groups that DTensor's caches hold


def _collective_worker(rank: int, world: int, init: str, device: str, threads: int, sizes: list[int], iters: int,
                       out: str):
    dev = _init(rank, world, init, device, threads, "nccl" if device == "cuda" else "gloo")
    results = {}
    for i, nbytes in enumerate(sizes):
        if rank == 0:
            _progress("collectives", i + 1, len(sizes) + 1, f"{nbytes:,} bytes")
        n = max(1, nbytes // 4)
        n = max(world, n - n % world)
        x = torch.ones(n, device=dev)
        parts = torch.empty(n // world, device=dev)
        gathered = torch.empty(n, device=dev)
        ops = {"all_reduce": lambda: dist.all_reduce(x),
               "all_gather": lambda: all_gather_single(gathered, parts),
               "reduce_scatter": lambda: reduce_scatter_single(parts, x)}
        for name, op in ops.items():
            dist.barrier()
            results.setdefault(name, {})[n * 4] = _max_over_ranks(_timed_collective(op, iters, dev))
    if rank == 0:
        _progress("collectives", len(sizes) + 1, len(sizes) + 1, "overlap with compute")
    results["overlap"] = comm_overlap(dev, min(max(sizes), 2**24), iters)
    results["sync"] = collective_sync(dev, iters)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _progress(phase: str, i: int, n: int, what: str) -> None:
    """Where the measurement is (minutes on a CPU), from rank 0: on a terminal one line rewritten in place, ended
    after the last of the collectives; elsewhere (a log) a line as each phase starts."""
    if sys.stderr.isatty():
        last = phase == "collectives" and i == n
        print(f"\rshardwise bench: {phase} {i}/{n}: {what}\033[K", end="\n" if last else "", file=sys.stderr,
              flush=True)
    elif i == 1:
        print(f"shardwise bench: measuring {phase} ({n} measurements)", file=sys.stderr, flush=True)


COLLECTIVE_SAMPLE_S = 0.05
"""Shortest sample of a collective's timing: a loop of back-to-back calls, so that a sample is the mean of many."""


def _timed_collective(op, iters: int, device: str) -> float:
    """Seconds per call of collective `op`: the median of `iters` samples, each the mean of back-to-back calls
    over at least COLLECTIVE_SAMPLE_S.

    Why means: a gloo collective's own time varies from call to call even on an idle machine, and not around a
    typical value: most calls of a small all-reduce here take 0.2 ms, some take several (its threads wait for the
    scheduler), and the mean is 1 to 2 ms. A training step sums many collectives, and a sum of many varying
    terms is near the sum of their means. Why the median of the samples: a burst of other jobs' load falls on a
    few samples only. Every rank makes the same number of calls (the largest any rank asks for)."""
    warm = _once(op, device)
    reps = int(_max_over_ranks(max(1, math.ceil(COLLECTIVE_SAMPLE_S / max(warm, 1e-9)))))

    def sample():
        for _ in range(reps):
            op()

    samples = sorted(_once(sample, device) for _ in range(iters))
    return samples[len(samples) // 2] / reps


def collective_sync(device: str, iters: int, nbytes: int = 2**18, segments: int = 40,
                    segment_s: float = 0.005) -> dict[str, float]:
    """What a blocking collective costs beyond its own time when every rank computes before it, as in a training
    step (tensor parallelism's all-reduces between a block's matmuls, FSDP's gathers between blocks).

    Three loops of `segments` each: compute alone (matmuls of about `segment_s`), the all-reduce alone (back to
    back), and compute then all-reduce: sync = (t_both - t_compute - t_comm) / segments, at least 0. It is the
    ranks' arrival skew (the same compute does not take the same time on every rank: the collective starts when
    the slowest arrives) plus waking the communication thread after the compute. Medians of interleaved
    repetitions, each loop's time the slowest rank's."""
    a = torch.randn(256, 256, device=device)
    x = torch.ones(max(1, nbytes // 4), device=device)
    reps = int(_max_over_ranks(max(1, round(segment_s / max(_timed(lambda: a @ a, 3, device), 1e-9)))))

    def compute():
        for _ in range(reps):
            a @ a

    loops = {"compute_s": lambda: [compute() for _ in range(segments)],
             "comm_s": lambda: [dist.all_reduce(x) for _ in range(segments)],
             "both_s": lambda: [(compute(), dist.all_reduce(x)) for _ in range(segments)]}
    times = {key: [] for key in loops}
    for _ in range(max(5, iters)):
        for key, fn in loops.items():
            dist.barrier()
            times[key].append(_max_over_ranks(_once(fn, device)))
    out = {key: sorted(v)[len(v) // 2] / segments for key, v in times.items()}
    out["sync_s"] = max(0.0, out["both_s"] - out["compute_s"] - out["comm_s"])
    return out


def comm_overlap(device: str, nbytes: int, iters: int) -> dict[str, float]:
    """How much of an all-reduce hides behind matmuls issued while it runs (as DDP/FSDP issue them).

    t_comm and t_compute alone, then both at once (the all-reduce asynchronous, as the data-parallel wrappers
    issue it; the matmul count chosen so the two take about as long): overlap = (t_comm + t_compute - t_both) /
    min(t_comm, t_compute), 1 when the shorter one is fully hidden, 0 when they run one after the other (gloo on
    a CPU reduces with the same cores the matmuls use)."""
    x = torch.ones(max(1, nbytes // 4), device=device)
    a = torch.randn(512, 512, device=device)
    t_comm = _max_over_ranks(_timed(lambda: dist.all_reduce(x), iters, device))
    t_one = _max_over_ranks(_timed(lambda: a @ a, iters, device))
    reps = max(1, round(t_comm / t_one))

    def compute():
        for _ in range(reps):
            a @ a

    def both():
        work = dist.all_reduce(x, async_op=True)
        compute()
        work.wait()

    # the three interleaved, each the fastest of its repetitions, so that a busy spell of the machine cannot
    # fall on one of them only
    times = {"comm_s": [], "compute_s": [], "both_s": []}
    for _ in range(max(3 * iters, 15)):  # short (tens of ms): many, since a busy spell can inflate any one
        for key, fn in (("comm_s", lambda: dist.all_reduce(x)), ("compute_s", compute), ("both_s", both)):
            dist.barrier()
            times[key].append(_max_over_ranks(_once(fn, device)))
    out = {key: min(values) for key, values in times.items()}
    out["overlap"] = (out["comm_s"] + out["compute_s"] - out["both_s"]) / min(out["comm_s"], out["compute_s"])
    return out


def _spawn(worker, world: int, *args) -> dict:
    """Run worker(rank, world, init, *args, out) in `world` local processes; rank 0's JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:  # a free local port for the rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(world, f"tcp://127.0.0.1:{port}", *args, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def compute_rates(world: int, device: str, threads: int, matmul_size: int, dtypes: list[str], iters: int,
                  grid: tuple[int, ...] | None = None) -> dict:
    """{'matmul_<dtype>', 'attention', 'matmul_shape_<m>_<n>_<k>' (the grid's GEMMs, default MATMUL_GRID):
    FLOP/s, 'mem_bandwidth': bytes/s} of the slowest of `world` ranks measuring at once."""
    if device == "cuda" and torch.cuda.device_count() < world:
        raise PlannerError("--world", f"{world} ranks but {torch.cuda.device_count()} GPUs", "lower --world")
    grid = MATMUL_GRID[device] if grid is None else tuple(grid)
    return _spawn(_compute_worker, world, device, threads, matmul_size, dtypes, iters, grid)


def matmul_table(rates: dict, large: float) -> dict[str, float]:
    """The grid's GEMM rates in `rates` (compute_rates) relative to the large GEMM's rate: the profile's
    matmul_by_shape."""
    prefix = "matmul_shape_"
    return {",".join(name[len(prefix):].split("_")): rate / large
            for name, rate in rates.items() if name.startswith(prefix)}


def collectives(world: int, device: str, max_bytes: int, iters: int, threads: int = 1) -> dict:
    """{op: {bytes: seconds}} measured across `world` local processes, 'overlap' (see comm_overlap) and 'sync'
    (see collective_sync)."""
    if device == "cuda" and torch.cuda.device_count() < world:
        raise PlannerError("--world", f"{world} ranks but {torch.cuda.device_count()} GPUs", "lower --world")
    # every factor of 4 from 64 KiB: the planner interpolates between them (comm.measured_time)
    sizes = [4] + [2**k for k in range(16, 29, 2) if 2**k <= max_bytes]
    raw = _spawn(_collective_worker, world, device, threads, sizes, iters)
    overlap, sync = raw.pop("overlap"), raw.pop("sync")
    return {**{op: {int(k): v for k, v in by_size.items()} for op, by_size in raw.items()}, "overlap": overlap,
            "sync": sync}


def bus_bandwidth(times: dict[int, float], op: str, world: int) -> float:
    """nccl-tests' bus bandwidth at the largest message."""
    nbytes = max(times)
    factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
    return nbytes / times[nbytes] * factor


def check_bench_arguments(ns: argparse.Namespace) -> None:
    """Every flag checked before anything is measured (the measurement takes a minute or more)."""
    for flag, value, least in (("--world", ns.world, 1), ("--matmul-size", ns.matmul_size, 1),
                               ("--iters", ns.iters, 1), ("--threads", ns.threads, 0)):
        if value < least:
            raise PlannerError(flag, f"{value} < {least}", f"pass {flag} {least} or more"
                               + (" (0: cores // world)" if flag == "--threads" else ""))
    if not 0 < ns.comm_mb < math.inf:
        raise PlannerError("--comm-mb", f"{ns.comm_mb} is not a positive size", "pass e.g. 64")
    if ns.base is not None and ALIASES.get(ns.base.lower(), ns.base.lower()) not in CATALOGUE:
        raise PlannerError("--base", f"unknown accelerator {ns.base!r}", f"use one of {', '.join(CATALOGUE)}")
    _grid(ns.matmul_grid)
    out = Path(ns.out)
    if out.is_dir() or not out.parent.is_dir():
        raise PlannerError("--out", f"{ns.out} is a folder" if out.is_dir() else f"no folder {out.parent}",
                           "name a file in an existing folder")


def measure(ns: argparse.Namespace) -> dict:
    check_bench_arguments(ns)
    device = _device(ns.device)
    threads = ns.threads or max(1, (os.cpu_count() or 1) // ns.world)
    comm_world = max(2, ns.world)  # the link exists whatever the job's size; a one-rank job never uses it
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    dtypes = ["fp32", "bf16"] if device == "cpu" else ["fp32", "bf16", "fp16"]
    rates = compute_rates(ns.world, device, threads, ns.matmul_size, dtypes, ns.iters, _grid(ns.matmul_grid))
    mm = {k: rates[f"matmul_{k}"] for k in dtypes}
    attn, bw = rates["attention"], rates["mem_bandwidth"]
    attn_shapes = {f"{seq},{hd}": rates[f"attention_{seq}_{hd}"] for seq, hd in ATTENTION_SHAPES}
    coll = collectives(comm_world, device, int(ns.comm_mb * 1e6), ns.iters,
                       max(1, (os.cpu_count() or 1) // comm_world) if device == "cpu" else 1)
    overlap, sync = coll.pop("overlap"), coll.pop("sync")
    busbw = {op: bus_bandwidth(t, op, comm_world) for op, t in coll.items()}
    latency = coll["all_reduce"][min(coll["all_reduce"])] / (2 * (comm_world - 1))
    # per-operator costs (CPU only: a GPU keeps the catalogue's launch figure) and each collective's own bus
    # bandwidth (gloo's all-gather and reduce-scatter are slower than its all-reduce)
    measured = {k: rates[k] for k in OVERHEADS if k in rates}
    curves = {op: {size: bus_bandwidth({size: seconds}, op, comm_world) for size, seconds in t.items()}
              for op, t in coll.items()}
    measured |= {"busbw_curves": curves, "launch_async": device == "cuda", "collective_sync_s": sync["sync_s"]}
    measurements = {"matmul_flops": mm, "attention_flops": attn, "attention_flops_by_shape": attn_shapes,
                    "mem_bandwidth": bw, "latency_s": latency,
                    **{f"{op}_busbw": v for op, v in busbw.items()}, "overlap": overlap, "sync": sync,
                    "collective_times_s": {op: {str(k): v for k, v in t.items()} for op, t in coll.items()},
                    "world": ns.world, "collective_world": comm_world, "threads_per_rank": threads,
                    "device": device, "host": socket.gethostname(), "cpu_count": os.cpu_count(),
                    "load_average": [load, os.getloadavg() if load else None],
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    attn_dtype = "fp32" if device == "cpu" else "bf16"
    by_shape = matmul_table(rates, mm[attn_dtype])  # measured in the dtype the attention is
    measurements["matmul_flops_by_shape"] = {key: r * mm[attn_dtype] for key, r in by_shape.items()}
    measured["matmul_by_shape"] = by_shape
    comm_overlap = min(1.0, max(0.0, overlap["overlap"]))
    if ns.base:
        acc = accelerator(ns.base)
        acc = dataclasses.replace(
            acc, matmul_efficiency=min(1.0, mm["bf16"] / acc.peak("bf16")) if "bf16" in acc.peak_flops else
            acc.matmul_efficiency,
            attention_efficiency=min(1.0, attn / acc.peak(attn_dtype)),
            attention_by_shape={k: min(1.0, r / acc.peak(attn_dtype)) for k, r in attn_shapes.items()},
            bandwidth_efficiency=min(1.0, bw / acc.mem_bandwidth), intra_node_bw=busbw["all_reduce"],
            comm_efficiency=1.0, intra_node_latency=latency, comm_overlap=comm_overlap, nccl_channels=0, **measured,
            source=f"{acc.source}; efficiencies by shardwise bench")
    else:
        acc = Accelerator(
            name=f"{device}-bench", memory_bytes=_device_memory(device), peak_flops=mm, mem_bandwidth=bw,
            intra_node_bw=busbw["all_reduce"], inter_node_bw=busbw["all_reduce"], host_bw=bw,
            intra_node_latency=latency, inter_node_latency=latency, matmul_efficiency=1.0,
            attention_efficiency=min(1.0, attn / mm[attn_dtype]), bandwidth_efficiency=1.0, comm_efficiency=1.0,
            attention_by_shape={k: min(1.0, r / mm[attn_dtype]) for k, r in attn_shapes.items()},
            comm_overlap=comm_overlap, **measured,
            source=f"measured by shardwise bench: one of {ns.world} ranks, {threads} threads each (peaks are "
                   "achieved rates; inter-node = this machine's links)")
    if device == "cpu" and not ns.base:  # the ranks share the host's memory (a --base keeps its datasheet's)
        acc = dataclasses.replace(acc, memory_bytes=acc.memory_bytes / ns.world)
    return {**dataclasses.asdict(acc), "measurements": measurements}


def _grid(spec: str | None) -> tuple[int, ...] | None:
    if spec is None:
        return None
    try:
        grid = tuple(int(x) for x in spec.split(","))
    except ValueError:
        grid = ()
    if not grid or min(grid) < 1:
        raise PlannerError("--matmul-grid", f"{spec!r} is not a list of positive sizes", "pass e.g. 128,512,2048")
    return grid


def _device_memory(device: str) -> float:
    if device == "cuda":
        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) if hasattr(os, "sysconf") else 16 * GiB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise bench", description=__doc__)
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
