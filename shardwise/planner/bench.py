"""`shardwise bench`: measure this machine and write a hardware profile the planner takes instead of datasheets.

What it measures: large-matmul FLOP/s per dtype, fused attention (forward + backward) FLOP/s, memory bandwidth (a
large copy), and gloo (CPU) or NCCL (GPU) all-reduce / all-gather / reduce-scatter bus bandwidth between local
processes, reported the way nccl-tests does: algbw = bytes / time; busbw = algbw x 2(N-1)/N for all-reduce and
x (N-1)/N for the other two, which is the per-link bandwidth B of the ring formulas in comm.py. The latency
alpha comes from a tiny all-reduce: 2(N-1) alpha.

With `--base GPU`, the datasheet entry is kept and its efficiencies become measured / datasheet; without it (a
CPU, or a device not in the catalogue) the measured rates become the peaks and the efficiencies 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.planner.hardware import GiB, Accelerator, PlannerError, accelerator

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--out", default="hardware_profile.json", help="where to write the profile JSON")
    a("--base", default=None, help="catalogue GPU whose datasheet numbers to keep (efficiencies become measured)")
    a("--world", type=int, default=2, help="local processes for the collective measurements")
    a("--matmul-size", type=int, default=2048, help="n of the n x n x n matmul")
    a("--comm-mb", type=float, default=64.0, help="largest collective message, MB")
    a("--iters", type=int, default=5, help="timed repetitions per measurement")
    a("--device", default="auto", choices=["auto", "cpu", "cuda"])


def run_bench(ns: argparse.Namespace) -> int:
    try:
        profile = measure(ns)
    except PlannerError as e:
        print(f"shardwise bench: {e}", file=sys.stderr)
        return 2
    Path(ns.out).write_text(json.dumps(profile, indent=2))
    m = profile["measurements"]
    print(f"wrote {ns.out}: matmul {', '.join(f'{k} {v / 1e12:.2f} TFLOP/s' for k, v in m['matmul_flops'].items())}; "
          f"memory {m['mem_bandwidth'] / 1e9:.1f} GB/s; all-reduce busbw {m['all_reduce_busbw'] / 1e9:.2f} GB/s "
          f"over {ns.world} ranks, latency {m['latency_s'] * 1e6:.0f} us")
    return 0


def _device(choice: str) -> str:
    if choice == "cuda" and not torch.cuda.is_available():
        raise PlannerError("--device", "CUDA is not available here", "use --device cpu or auto")
    return "cuda" if choice == "cuda" or choice == "auto" and torch.cuda.is_available() else "cpu"


def _timed(fn, iters: int, device: str) -> float:
    fn()  # warm-up: first calls pay for allocation and kernel selection
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def matmul_flops(n: int, dtype: torch.dtype, device: str, iters: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _timed(lambda: a @ b, iters, device)


def attention_flops(device: str, dtype: torch.dtype, iters: int) -> float:
    """Causal SDPA forward + backward: (2 + 5) matmuls of 2 s d FLOPs per query, halved by the mask."""
    bsz, heads, seq, hd = 2, 8, 1024, 64
    q, k, v = (torch.randn(bsz, heads, seq, hd, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    flops = 0.5 * 7 * 2 * bsz * heads * seq * seq * hd
    return flops / _timed(step, iters, device)


def mem_bandwidth(device: str, iters: int) -> float:
    x = torch.empty(64 * 2**20, dtype=torch.float32, device=device).fill_(1.0)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / _timed(lambda: y.copy_(x), iters, device)  # read + write


def _collective_worker(rank: int, world: int, init: str, device: str, sizes: list[int], iters: int, out: str):
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    results = {}
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        n = max(world, n - n % world)
        x = torch.ones(n, device=dev)
        parts = torch.empty(n // world, device=dev)
        gathered = torch.empty(n, device=dev)
        ops = {"all_reduce": lambda: dist.all_reduce(x),
               "all_gather": lambda: _all_gather(gathered, parts),
               "reduce_scatter": lambda: _reduce_scatter(parts, x)}
        for name, op in ops.items():
            dist.barrier()
            t = _timed(op, iters, device)
            t_max = torch.tensor([t])
            dist.all_reduce(t_max, op=dist.ReduceOp.MAX)
            results.setdefault(name, {})[n * 4] = t_max.item()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


# torch 2.13 renames the flat-tensor collectives (the old names still work, with a deprecation warning)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def collectives(world: int, device: str, max_bytes: int, iters: int) -> dict:
    """{op: {bytes: seconds}} measured across `world` local processes."""
    if device == "cuda" and torch.cuda.device_count() < world:
        raise PlannerError("--world", f"{world} ranks but {torch.cuda.device_count()} GPUs", "lower --world")
    sizes = [4] + [s for s in (2**16, 2**20, 2**24, 2**26, 2**28) if s <= max_bytes]
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:  # a free local port for the rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = os.path.join(tmp, "collectives.json")
        mp.spawn(_collective_worker, args=(world, f"tcp://127.0.0.1:{port}", device, sizes, iters, out),
                 nprocs=world, join=True)
        raw = json.loads(Path(out).read_text())
    return {op: {int(k): v for k, v in by_size.items()} for op, by_size in raw.items()}


def bus_bandwidth(times: dict[int, float], op: str, world: int) -> float:
    """nccl-tests' bus bandwidth at the largest message."""
    nbytes = max(times)
    factor = 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world
    return nbytes / times[nbytes] * factor


def measure(ns: argparse.Namespace) -> dict:
    device = _device(ns.device)
    if ns.world < 2:
        raise PlannerError("--world", "collectives need at least 2 ranks", "pass --world 2 or more")
    dtypes = ["fp32", "bf16"] if device == "cpu" else ["fp32", "bf16", "fp16"]
    mm = {k: matmul_flops(ns.matmul_size, DTYPES[k], device, ns.iters) for k in dtypes}
    attn = attention_flops(device, torch.float32 if device == "cpu" else torch.bfloat16, ns.iters)
    bw = mem_bandwidth(device, ns.iters)
    coll = collectives(ns.world, device, int(ns.comm_mb * 1e6), ns.iters)
    busbw = {op: bus_bandwidth(t, op, ns.world) for op, t in coll.items()}
    latency = coll["all_reduce"][min(coll["all_reduce"])] / (2 * (ns.world - 1))
    measurements = {"matmul_flops": mm, "attention_flops": attn, "mem_bandwidth": bw, "latency_s": latency,
                    **{f"{op}_busbw": v for op, v in busbw.items()},
                    "collective_times_s": {op: {str(k): v for k, v in t.items()} for op, t in coll.items()},
                    "world": ns.world, "device": device, "host": socket.gethostname(),
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    attn_dtype = "fp32" if device == "cpu" else "bf16"
    if ns.base:
        acc = accelerator(ns.base)
        acc = dataclasses.replace(
            acc, matmul_efficiency=min(1.0, mm["bf16"] / acc.peak("bf16")) if "bf16" in acc.peak_flops else
            acc.matmul_efficiency,
            attention_efficiency=min(1.0, attn / acc.peak(attn_dtype)),
            bandwidth_efficiency=min(1.0, bw / acc.mem_bandwidth), intra_node_bw=busbw["all_reduce"],
            comm_efficiency=1.0, intra_node_latency=latency, source=f"{acc.source}; efficiencies by shardwise bench")
    else:
        acc = Accelerator(
            name=f"{device}-bench", memory_bytes=_device_memory(device), peak_flops=mm, mem_bandwidth=bw,
            intra_node_bw=busbw["all_reduce"], inter_node_bw=busbw["all_reduce"], host_bw=bw,
            intra_node_latency=latency, inter_node_latency=latency, matmul_efficiency=1.0,
            attention_efficiency=min(1.0, attn / mm[attn_dtype]), bandwidth_efficiency=1.0, comm_efficiency=1.0,
            source="measured by shardwise bench (peaks are achieved rates; inter-node = this machine's links)")
    return {**dataclasses.asdict(acc), "measurements": measurements}


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
