"""Accelerators and clusters: the numbers the time and memory models divide by.

Every figure in the catalogue is a vendor datasheet number (dense, i.e. without 2:4 sparsity), cited next to
the entry. Datasheet peaks are what MFU is defined against; what a device actually reaches is the job of the
three efficiencies on `Accelerator`, whose defaults are stated assumptions and which `shardwise bench`
replaces with measured values (see `load_profile`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path

from shardwise.frozen import hashed_once

GB = 1e9  # datasheets and published memory tables (ZeRO's 120 GB for 7.5B parameters) count in powers of ten
GiB = 2**30
TFLOPS = 1e12


class PlannerError(ValueError):
    """A planner input that cannot work, naming the flag or field and the fix."""

    def __init__(self, field_name: str, problem: str, fix: str):
        self.field = field_name
        super().__init__(f"{field_name}: {problem}; fix: {fix}")


@hashed_once
@dataclass(frozen=True)
class Accelerator:
    name: str
    """Catalogue key, e.g. 'h100'."""
    memory_bytes: float
    """Device memory (HBM/GDDR) in bytes."""
    peak_flops: dict[str, float]
    """Dense peak matmul FLOP/s per compute dtype ('bf16', 'fp16', 'fp8', 'fp32'); a missing dtype is unsupported."""
    mem_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    intra_node_bw: float
    """GPU-to-GPU bandwidth inside a node, bytes/s per direction per GPU (NVLink, Infinity Fabric or PCIe)."""
    inter_node_bw: float
    """Network bandwidth between nodes, bytes/s per direction per GPU (one NIC per GPU in the usual build)."""
    host_bw: float
    """Host-to-device bandwidth for offload, bytes/s per direction (the GPU's PCIe link)."""
    intra_node_fabric: str = ""
    """The link between GPUs in a node as NCCL's cost model tells them apart: 'nvlink' (NVLink or NVSwitch; AMD's
    Infinity Fabric is taken as such for RCCL) or 'pcie'; collectives are then priced as NCCL prices its
    algorithms and protocols (planner.comm.nccl_time). '' (a CPU's gloo, or a profile that leaves it out): the
    alpha-beta model from the two latencies below."""
    intra_node_latency: float = 3e-6
    """Per-hop latency alpha inside a node, seconds (NCCL small-message latency is a few microseconds)."""
    inter_node_latency: float = 8e-6
    """Per-hop latency alpha between nodes, seconds (InfiniBand round trips plus NCCL proxy overhead)."""
    matmul_efficiency: float = 0.70
    """Share of peak that large GEMMs reach; assumption (cuBLAS on big bf16 GEMMs), replaced by `shardwise bench`.
    A GEMM's own shape can take more off (matmul_eff)."""
    matmul_by_shape: dict[str, float] | None = None
    """Measured rate by GEMM shape, keyed "m,n,k", relative to the large GEMM's that matmul_efficiency describes
    (`shardwise bench` measures a grid: on a CPU, small and thin GEMMs reach far less than the large cube);
    None (the catalogue): the roofline, and tile and wave quantisation where `sms` is given (matmul_eff)."""
    sms: int = 0
    """Streaming multiprocessors (compute units on AMD) a GEMM's output tiles are spread over, for tile and wave
    quantisation (gemm_tile_share); 0 (the catalogue's default): left out. NVIDIA's architecture whitepapers give
    132 for the H100 and H200 SXM, 114 for the H100 PCIe, 108 for the A100, 80 for the V100. Why the catalogue
    leaves it out: docs/planner.md, "Compute by shape"."""
    nccl_channels: int = 0
    """NCCL's channels for a ring inside one node, as its init log prints them ("32 coll channels" on H100 boards,
    24 on an HGX A100: NCCL_BOARD_CHANNELS). Each runs as one CTA that holds an SM for the collective's whole run and
    never shares it with a compute kernel (NCCL issue 689), so a collective hidden behind compute still takes those
    SMs from it (planner.comm.group_link, Link.sm_share). 0: not modelled (a GPU whose count no source gives). What
    it changes: docs/planner.md, "NCCL's SMs". A comm_overlap measured on a GPU already includes it: a profile that
    sets comm_overlap over a base GPU gets 0 unless it sets this too (load_profile)."""
    attention_efficiency: float = 0.45
    """Share of peak that fused attention (forward + backward) reaches, for a kernel attention_by_kernel does not
    name (a stated assumption between the published figures below)."""
    attention_by_kernel: dict[str, float] | None = None
    """Share of peak a named attention kernel reaches on this GPU (Training.attention_kernel), from the kernels' own
    papers (KERNEL_EFFICIENCY); None or a kernel not named: attention_efficiency."""
    bandwidth_efficiency: float = 0.75
    """Share of mem_bandwidth that elementwise kernels (norms, SwiGLU, rotary, residuals) reach."""
    comm_efficiency: float = 0.80
    """Share of link bandwidth a large collective reaches (nccl-tests bus bandwidth vs. the link rate)."""
    comm_overlap: float = 1.0
    """Share of a collective that can run hidden behind compute issued alongside it (the wrappers' asynchronous
    collectives): 1 for the catalogue GPUs (a stated assumption: NCCL's kernels run beside the GEMMs; the SMs they
    take from them are priced apart, and only where `nccl_channels` is given), measured by `shardwise bench` (about
    0 for gloo on a CPU, which reduces with the cores the matmuls use; on a GPU the measurement includes NCCL's
    SMs)."""
    collective_sync_s: float = 0.0
    """Seconds a blocking collective costs beyond its own time when the ranks arrive at it from compute: their
    arrival skew (the same compute does not take exactly as long on every rank, and the collective starts when
    the slowest arrives) and waking the communication threads. Measured by `shardwise bench` (`collective_sync`;
    1 to 2 ms for gloo on this 2-core machine); 0 for the catalogue (not measured there: NCCL ranks run the same
    kernels in step, and the host does not wait)."""
    op_overhead_s: float = 5e-6
    """Fixed seconds per operator of forward and backward besides its arithmetic: a kernel launch on a GPU
    (about 5 us; a stated assumption for the catalogue), Python and dispatcher time on a CPU; measured by
    `shardwise bench` as the time of our model's forward + backward at a tiny size over its operator count."""
    optimizer_op_overhead_s: float = 5e-6
    """The same per operator of the optimizer step (a foreach kernel launch on a GPU; one tensor's turn in a
    foreach loop on a CPU); measured by `shardwise bench` on a tiny model's AdamW step."""
    dtensor_op_overhead_s: float = 0.0
    """Extra seconds per operator of forward and backward when it runs on DTensors (tensor parallelism):
    sharding propagation, redistribution, wrapping, issuing functional collectives, host-side; measured by
    `shardwise bench` on a 2-rank mesh, 0 for the catalogue (not measured there)."""
    dtensor_optimizer_op_overhead_s: float = 0.0
    """Extra seconds per operator of the optimizer step (per tensor of a foreach call) when the parameters are
    DTensors (every layout with tp, dp or cp > 1 in shardwise's engine: FSDP2's replicate and fully_shard and
    tensor parallelism all make them so): DTensor's dispatch of each element of the foreach lists; measured by
    `shardwise bench`, 0 for the catalogue (not measured there)."""
    replicate_unit_overhead_s: float = 0.0
    zero2_unit_overhead_s: float = 0.0
    zero3_unit_overhead_s: float = 0.0
    """Host seconds per micro-batch (forward + backward) that each data-parallel unit of shardwise's engine costs
    beyond the collectives it issues: FSDP2's replicate (ZeRO-0/1, a unit per bucket of blocks and the root) and
    fully_shard (ZeRO-2 and 3, a unit per block and the root), their hooks, copy-in/out and issuing. Measured by
    `shardwise bench` on a CPU (1 to 4 ms per unit on a 2-core machine); 0 for the catalogue (not measured; a
    GPU's host runs ahead of its kernels)."""
    launch_async: bool = True
    """Operators are issued asynchronously to a device (a GPU's stream), so their fixed cost overlaps with
    earlier operators' arithmetic: time = max(arithmetic, overhead). False on a CPU: time = arithmetic + overhead."""
    attention_by_shape: dict[str, float] | None = None
    """Measured attention_efficiency by shape, keyed "sequence length,head dimension" (`shardwise bench`
    measures a grid); None (the catalogue): attention_efficiency for every shape. See attention_eff."""
    busbw_curves: dict[str, dict[int, float]] | None = None
    """Measured intra-node bus bandwidth of each collective ('all_reduce', 'all_gather', 'reduce_scatter') by
    message size in bytes, as nccl-tests tabulates it; `shardwise bench` writes it. Small messages reach far less
    than large ones, and on gloo the three collectives differ (its reduce-scatter is an all-reduce underneath).
    None (the catalogue): alpha-beta from intra_node_bw and the latency. The inter-node tier scales the curve by
    inter_node_bw / intra_node_bw."""
    host_memory_bytes: float = 0.0
    """Host memory per device in the usual server (its RAM over its GPUs), bytes: what offload may fill. 0 (a GPU
    the catalogue has no server for, a profile): not known, and offload's use of it is not checked."""
    source: str = ""
    """Where the datasheet numbers come from."""

    def attention_eff(self, seq: int, head_dim: int, kernel: str = "flash2") -> float:
        """Share of peak fused attention reaches at this shape: bilinear in log2(sequence) and log2(head
        dimension) between the measured shapes, clamped to their range; without a measured table, the kernel's
        published share on this GPU (attention_by_kernel), else attention_efficiency."""
        if not self.attention_by_shape:
            return (self.attention_by_kernel or {}).get(kernel, self.attention_efficiency)
        return _interpolated(self.attention_by_shape, (seq, head_dim))

    def matmul_eff(self, m: float, n: float, k: float, dtype: str = "bf16", batch: float = 1.0) -> float:
        """Share of peak a GEMM of (m x k) @ (k x n), `batch` of them at once, reaches. With a measured table
        (matmul_by_shape): matmul_efficiency times the table, interpolated in log2 of each dimension between its
        shapes and clamped to their range. Else matmul_efficiency, times the share of the GPU's tile slots the
        output tiles fill where `sms` is known (gemm_tile_share: tile and wave quantisation), and never faster than
        reading A and B and writing C once at the elementwise bandwidth (the roofline: thin GEMMs, e.g. the key and
        value projections of grouped-query attention split by tp, or a LoRA adapter's, are bound by memory)."""
        return _matmul_eff(self, m, n, k, dtype, batch)

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise PlannerError(
                "--precision", f"{self.name} has no {dtype} matmul support in the catalogue",
                f"use one of {', '.join(sorted(self.peak_flops))}",
            )
        return self.peak_flops[dtype]


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}

GPU_SMS = {"h100": 132, "h200": 132, "h100-pcie": 114, "a100-40gb": 108, "a100-80gb": 108, "v100": 80}
"""SMs by catalogue GPU (NVIDIA's architecture whitepapers, as Accelerator.sms lists them): what NCCL's CTAs are a
share of where a profile sets nccl_channels without sms."""

GEMM_TILES = ((256, 128), (128, 256), (160, 128), (128, 160), (128, 128))
"""Output tiles (rows x columns) cuBLAS's large-GEMM kernels compute per thread block: the larger ones NVIDIA's "Matrix
Multiplication Background User's Guide" (Deep Learning Performance documentation, "Dimension Quantization
Effects") lists as the most efficient. Smaller tiles exist for small problems; we let split-K fill the GPU there."""

SPLIT_K_MIN = 512
"""Fewest k elements each part of a split-K GEMM keeps (a part must amortise its own prologue and the reduction of
the partial sums): an assumption."""


def gemm_tile_share(m: float, n: float, k: float, sms: int, batch: float = 1.0) -> float:
    """Share of the GPU's tile slots a GEMM's work fills, for the best of GEMM_TILES: tile quantisation (the last
    row and column of tiles are computed whole: m n / (ceil(m / tm) tm ceil(n / tn) tn)) times wave quantisation
    (tiles run `sms` at a time, and the last wave's empty slots are lost: tiles / (ceil(tiles / sms) sms)). A grid
    with fewer tiles than SMs is split along k (cuBLAS's split-K) into as many parts as fill the SMs, each at
    least SPLIT_K_MIN deep."""
    best = 0.0
    for tm, tn in GEMM_TILES:
        rows, cols = math.ceil(m / tm), math.ceil(n / tn)
        tiles = rows * cols * batch
        splits = max(1, min(sms // tiles, int(k // SPLIT_K_MIN))) if tiles < sms else 1
        work = tiles * splits
        best = max(best, m * n / (rows * tm * cols * tn) * work / (math.ceil(work / sms) * sms))
    return best


@functools.lru_cache(maxsize=65536)
def _matmul_eff(acc: Accelerator, m: float, n: float, k: float, dtype: str, batch: float) -> float:
    """Accelerator.matmul_eff, memoised: a search prices the same few shapes ~10^5 times, and a measured table's
    keys are parsed on every interpolation."""
    if acc.matmul_by_shape:
        return acc.matmul_efficiency * _interpolated(acc.matmul_by_shape, (m, n, k))
    eff = acc.matmul_efficiency * (gemm_tile_share(m, n, k, acc.sms, batch) if acc.sms else 1.0)
    compute_s = 2 * m * n * k * batch / (acc.peak(dtype) * eff)
    bandwidth = acc.mem_bandwidth * acc.bandwidth_efficiency
    memory_s = batch * (m * k + k * n + m * n) * DTYPE_BYTES[dtype] / bandwidth
    return eff * compute_s / max(compute_s, memory_s)


def _interpolated(table: dict[str, float], point: tuple[float, ...]) -> float:
    """Multilinear interpolation in log2 of each coordinate over a full grid keyed "x,y,...", clamped to its range."""
    grid = {tuple(int(x) for x in key.split(",")): value for key, value in table.items()}
    axes = [sorted({key[i] for key in grid}) for i in range(len(point))]
    corners = [()]
    weights = [1.0]
    for values, x in zip(axes, point):
        x = min(max(x, values[0]), values[-1])
        hi = next(i for i, v in enumerate(values) if v >= x)
        lo = max(0, hi - 1)
        w = 0.0 if values[hi] == values[lo] else (
            (math.log2(x) - math.log2(values[lo])) / (math.log2(values[hi]) - math.log2(values[lo])))
        corners = [c + (values[j],) for c in corners for j in (lo, hi)]
        weights = [wt * f for wt in weights for f in (1 - w, w)]
    return sum(wt * grid[c] for c, wt in zip(corners, weights))


def _gpu(name: str, mem_gib: float, bf16: float | None, fp16: float, fp8: float | None, fp32: float,
         bw_tbs: float, intra_gbs: float, inter_gbs: float, host_gbs: float, source: str) -> Accelerator:
    peaks = {"fp16": fp16 * TFLOPS, "fp32": fp32 * TFLOPS}
    if bf16 is not None:
        peaks["bf16"] = bf16 * TFLOPS
    if fp8 is not None:
        peaks["fp8"] = fp8 * TFLOPS
    return Accelerator(name=name, memory_bytes=mem_gib * GiB, peak_flops=peaks, mem_bandwidth=bw_tbs * 1e12,
                       intra_node_bw=intra_gbs * GB, inter_node_bw=inter_gbs * GB, host_bw=host_gbs * GB,
                       intra_node_fabric="pcie" if name in PCIE_ONLY else "nvlink", source=source)


PCIE_ONLY = {"h100-pcie", "l4", "a10g", "rtx-4090", "rtx-a6000", "l40s"}
"""Catalogue GPUs whose nodes link them over PCIe only (no NVLink bridge or switch in the usual build)."""


# Memory: HBM is sold in binary units ("80 GB" is 80 GiB; nvidia-smi shows 81559 MiB on an H100 SXM, 81920 MiB
# on an A100 80GB), so capacities below are GiB. Dense peaks in TFLOP/s (sparsity figures halved away). fp32 is
# the non-tensor-core FP32 rate: PyTorch runs fp32 matmuls without TF32 unless told to. NVLink figures are per
# direction (the datasheets quote both directions added). inter-node: one NIC per GPU, per direction
# (400 Gb/s NDR = 50 GB/s, 200 Gb/s HDR = 25 GB/s).
CATALOGUE: dict[str, Accelerator] = {
    a.name: a
    for a in [
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, BF16/FP16 1979 TF sparse, FP8 3958
        # sparse, FP32 67 TF, NVLink 900 GB/s; DGX H100: 8x 400 Gb/s ConnectX-7; host PCIe Gen5 x16.
        _gpu("h100", 79.6, 989.4, 989.4, 1978.9, 67.0, 3.35, 450, 50, 64, "NVIDIA H100 datasheet, SXM5"),
        # Same datasheet, PCIe column: 80 GB HBM2e, 2.0 TB/s, BF16 1513 sparse, FP8 3026 sparse, FP32 51 TF;
        # no NVSwitch: GPUs talk over PCIe Gen5 (64 GB/s per direction).
        _gpu("h100-pcie", 80, 756.5, 756.5, 1513.0, 51.2, 2.0, 64, 50, 64, "NVIDIA H100 datasheet, PCIe"),
        # NVIDIA H200 datasheet (SXM): 141 GB HBM3e (nvidia-smi: 143771 MiB), 4.8 TB/s, compute as H100 SXM,
        # NVLink 900 GB/s.
        _gpu("h200", 140.4, 989.4, 989.4, 1978.9, 67.0, 4.8, 450, 50, 64, "NVIDIA H200 datasheet, SXM"),
        # NVIDIA A100 datasheet: 40 GB HBM2 1.555 TB/s / 80 GB HBM2e 2.039 TB/s; BF16/FP16 312 TF, FP32 19.5 TF,
        # no FP8; NVLink 600 GB/s; DGX A100: 8x 200 Gb/s HDR; host PCIe Gen4 x16 (32 GB/s).
        _gpu("a100-40gb", 40, 312.0, 312.0, None, 19.5, 1.555, 300, 25, 32, "NVIDIA A100 datasheet, SXM 40GB"),
        _gpu("a100-80gb", 80, 312.0, 312.0, None, 19.5, 2.039, 300, 25, 32, "NVIDIA A100 datasheet, SXM 80GB"),
        # NVIDIA Blackwell / HGX B200 datasheet: FP16/BF16 4.5 PF sparse (2.25 dense), FP8 9 PF sparse, FP32 80 TF
        # (approx.), HBM3e 8 TB/s, NVLink 5 1.8 TB/s. Memory: 192 GB was announced; shipping boards expose 180 GB
        # (DGX B200 datasheet: 1,440 GB of GPU memory for 8), and nvidia-smi prints 183359 MiB (179.1 GiB) on a B200
        # (its output as quoted in public repositories' logs).
        _gpu("b200", 179.1, 2250.0, 2250.0, 4500.0, 80.0, 8.0, 900, 50, 64, "NVIDIA HGX B200 datasheet"),
        # NVIDIA GB200 NVL72 datasheet, per rack of 72 Blackwell GPUs (tensor figures with sparsity): FP8 720 PF,
        # FP16/BF16 360 PF, FP64 3,240 TF, HBM3e 13.4 TB at 576 TB/s, NVLink 130 TB/s: a GPU 2.5 PF bf16 and 5 PF fp8
        # dense, 8 TB/s, 1.8 TB/s of NVLink 5 both ways; FP32 twice FP64 (90 TF; Blackwell's ratio, as the B200's 80
        # to 40). Memory as nvidia-smi prints it on a GB200 (189471 MiB, 1200 W; its output as quoted in public
        # logs). One ConnectX-7 400 Gb/s NIC a GPU (four a compute tray). The host is the superchip's Grace over
        # NVLink-C2C, 900 GB/s both ways for the superchip: taken as shared by its two GPUs, 225 GB/s a GPU a
        # direction (an inference: no source gives a GPU's share). The NVLink domain is the rack's 72 GPUs: pass
        # --gpus-per-node with the GPUs a job takes of each rack (72, or 64 for 16 of its 18 trays).
        _gpu("gb200", 185.03, 2500.0, 2500.0, 5000.0, 90.0, 8.0, 900, 50, 225, "NVIDIA GB200 NVL72 datasheet"),
        # AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s, BF16/FP16 1307.4 TF dense, FP8 2614.9, FP32
        # 163.4 TF; Infinity Fabric 7 links x 64 GB/s per direction to the 7 peers (448 GB/s); PCIe Gen5 host.
        _gpu("mi300x", 192, 1307.4, 1307.4, 2614.9, 163.4, 5.3, 448, 50, 64, "AMD Instinct MI300X datasheet"),
        # NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, BF16/FP16 242 TF sparse, FP8 485 sparse, FP32 30.3 TF;
        # PCIe Gen4 x16 only; cloud nodes (e.g. g2-standard-96) share 100 Gb/s among 8 GPUs.
        _gpu("l4", 24, 121.0, 121.0, 242.5, 30.3, 0.3, 32, 1.5, 32, "NVIDIA L4 datasheet"),
        # NVIDIA A10G (AWS g5): 24 GB GDDR6, 600 GB/s, FP16/BF16 tensor 70 TF dense, FP32 31.2 TF (NVIDIA's A10G
        # product brief as quoted by AWS; the A10 datasheet gives 125 TF for the higher-clocked A10); PCIe Gen4;
        # g5.48xlarge: 100 Gb/s shared by 8 GPUs.
        _gpu("a10g", 24, 70.0, 70.0, None, 31.2, 0.6, 32, 1.5, 32, "NVIDIA A10G brief / AWS g5"),
        # The GPUs fine-tuning runs on outside data-centre boards (torchtune's README tables: an RTX 4090, an RTX
        # A6000; the L40S of the clouds' 8-GPU PCIe servers), each on PCIe only (a bridge links A6000s in pairs
        # alone). Memory as nvidia-smi prints it (public logs): 24564 MiB on a 4090, 49140 MiB on an A6000 (ECC off,
        # its default), 46068 MiB on an L40S (ECC on, its default). Dense tensor peaks with fp32 accumulation, as
        # PyTorch's matmuls accumulate (a GeForce card runs those at half its fp16-accumulate rate).
        # NVIDIA Ada GPU architecture whitepaper, RTX 4090: BF16/FP16 tensor with FP32 accumulate 165.2 TF dense
        # (330.4 sparse), FP8 330.3, FP32 82.6 TF, GDDR6X 1,008 GB/s, PCIe Gen4 x16, no NVLink.
        _gpu("rtx-4090", 23.99, 165.2, 165.2, 330.3, 82.6, 1.008, 32, 1.5, 32, "NVIDIA Ada whitepaper, RTX 4090"),
        # NVIDIA RTX A6000 datasheet: 48 GB GDDR6, 768 GB/s, tensor 309.7 TF sparse (154.8 dense FP16/BF16), FP32
        # 38.7 TF, no FP8; NVLink bridge for two cards only (112.5 GB/s both ways), so PCIe Gen4 between the rest.
        _gpu("rtx-a6000", 47.99, 154.8, 154.8, None, 38.7, 0.768, 32, 1.5, 32, "NVIDIA RTX A6000 datasheet"),
        # NVIDIA L40S datasheet (as Bekman's accelerator tables quote it, stas00/ml-engineering
        # compute/accelerator/README.md): BF16/FP16 362 TF dense, FP8 733, FP32 91.6, GDDR6 864 GB/s; PCIe Gen4 x16,
        # no NVLink; cloud nodes of 8 (AWS g6e.48xlarge) share 400 Gb/s: 6.25 GB/s a GPU.
        _gpu("l40s", 44.99, 362.0, 362.0, 733.0, 91.6, 0.864, 32, 6.25, 32, "NVIDIA L40S datasheet"),
        # NVIDIA V100 datasheet (SXM2 32 GB): HBM2 900 GB/s, FP16 tensor 125 TF, FP32 15.7 TF, no BF16/FP8;
        # NVLink 300 GB/s; DGX-1/2 era EDR 100 Gb/s per GPU; host PCIe Gen3 (16 GB/s).
        _gpu("v100", 32, None, 125.0, None, 15.7, 0.9, 150, 12.5, 16, "NVIDIA V100 datasheet, SXM2 32GB"),
    ]
}
# Fused attention, forward + backward, as a share of the 16-bit peak, by kernel and GPU generation.
# Ampere, from the FlashAttention-2 paper (Dao 2023, arXiv 2307.08691, abstract; midpoints of the ranges it states):
# FlashAttention "reaching only 25-40% of the theoretical maximum FLOPs/s" on A100, FlashAttention-2 "50-73%".
# Hopper, FlashAttention-2 measured on an H100 in the shape the planner's rows run (causal, head dimension 128,
# sequence 8,192), by flash-attention's own hopper/benchmark_attn.py as printed in Dao-AILab/flash-attention PR
# #1791 (2025-07-31, "Results of python benchmark_attn.py", main): "Fav2 fwd: 1.935ms, 284.1 TFLOPS", "Fav2 bwd:
# 4.788ms, 287.1 TFLOPS" (causal FLOPs halved, as the planner counts them; backward 2.5 x forward). Forward and
# backward together: 3.5 / (1/284.1 + 2.5/287.1) = 286.2 TFLOP/s, 0.289 of the SXM's 989.4. FlashAttention-3's
# abstract says FlashAttention-2 reaches "only 35% utilization on the H100": its best forward (no mask, long
# sequences: 369.9 TFLOP/s in the same run), which causal training does not reach. torch's SDPA flash backend is
# FlashAttention-2. FlashAttention-1 on Hopper is published nowhere we found; it is derived: both kernels are
# written for Ampere (mma.sync tensor-core instructions, no Hopper wgmma or TMA), so Hopper's peak is out of both
# kernels' reach alike, and FlashAttention-1 keeps on Hopper the share of its Ampere figure that FlashAttention-2
# keeps of its own: 0.325 x 0.289 / 0.615.
# FlashAttention-3 (Hopper only: wgmma and TMA), measured on an H100 in the same shape class, bf16, causal, head
# dimension 128, sequence 8,192 (batch 4, 48 heads), by TritonBench against its own kernel (meta-pytorch/tritonbench
# PR #1267, 2026-09-15, "Performance on H100 BF16, B=4, H=48, D=128", FA3 column): forward 4,817.44 us, backward
# 15,308.16 us. Over the planner's causal FLOPs (2 B H s^2 d forward, 2.5 x that backward), 3.5 x 3.30 TFLOP over
# 20.13 ms: 574 TFLOP/s, 0.580 of the SXM's 989.4.
# cuDNN's fused (flash) attention, Transformer Engine's FusedAttention sub-backend 1, measured on an "NVIDIA H100 80GB
# HBM3" by Transformer Engine's own benchmarks/attention/benchmark_attention.py, as its attention tutorial prints the
# run (docs/examples/attention/attention.ipynb: TE 1.10.0.dev, cuDNN 9.3.0, flash-attn 2.4.2), case test_3: batch
# 2, 32 heads in 4 groups, head dimension 128, sequence 8,192, causal, bf16: "cuDNN fwd+bwd (ms) 7.4875",
# flash-attn 11.8879. Over the planner's causal FLOPs (3.5 x 2 B H s^2 d = 3.85 TFLOP): 514 TFLOP/s, 0.519 of the
# SXM's 989.4 (flash-attn in the same run: 0.327, beside the 0.289 above).
# Not stated for a kernel or GPU (cuDNN on Ampere; FlashAttention-3 on other GPUs): attention_efficiency.
FLASH2_H100_TFLOPS = (284.1, 287.1)
"""FlashAttention-2 on an H100, causal, head dimension 128, sequence 8,192: forward and backward TFLOP/s (PR #1791)."""
FLASH2_HOPPER = round(3.5 / (1 / FLASH2_H100_TFLOPS[0] + 2.5 / FLASH2_H100_TFLOPS[1]) * 1e12
                      / CATALOGUE["h100"].peak_flops["bf16"], 3)
FLASH3_H100_US = (4817.44, 15308.16)
"""FlashAttention-3 on an H100, causal, head dimension 128, sequence 8,192, batch 4 x 48 heads: forward and backward
microseconds (TritonBench PR #1267)."""
FLASH3_HOPPER = round(3.5 * 2 * 4 * 48 * 8192 ** 2 * 128 / (sum(FLASH3_H100_US) * 1e-6)
                      / CATALOGUE["h100"].peak_flops["bf16"], 3)
CUDNN_H100_MS = 7.4875
"""cuDNN 9.3's attention on an H100, forward + backward, causal, head dimension 128, sequence 8,192, batch 2 x 32
heads (Transformer Engine's attention tutorial, benchmark_attention.py test_3)."""
CUDNN_HOPPER = round(3.5 * 2 * 2 * 32 * 8192 ** 2 * 128 / (CUDNN_H100_MS * 1e-3)
                     / CATALOGUE["h100"].peak_flops["bf16"], 3)
KERNEL_EFFICIENCY = {"ampere": {"flash1": 0.325, "flash2": 0.615},
                     "hopper": {"flash1": 0.325 * FLASH2_HOPPER / 0.615, "flash2": FLASH2_HOPPER,
                                "flash3": FLASH3_HOPPER, "cudnn": CUDNN_HOPPER}}
for _name, _generation in (("a100-40gb", "ampere"), ("a100-80gb", "ampere"), ("h100", "hopper"),
                           ("h100-pcie", "hopper"), ("h200", "hopper")):
    CATALOGUE[_name] = dataclasses.replace(CATALOGUE[_name], attention_by_kernel=KERNEL_EFFICIENCY[_generation])

# Large-GEMM efficiency by GPU. The default, 0.70, is the A100's: the assumption the 2021-22 tables are evaluated
# with. A GPU whose best achievable bf16 matmul rate is published keeps the same share of it as the A100 does, so
# its efficiency is 0.70 times its achievable share of peak over the A100's. Source: Bekman, "Machine Learning
# Engineering", Maximum Achievable Matmul FLOPS table (compute/accelerator/README.md; mamf-finder.py, the best of a
# brute-force search over shapes, torch 2.6-2.7 with CUDA 12.6): A100 SXM 271.2 of 312 TFLOP/s (86.9%), H100 SXM
# 794.5 of 989 (80.3%, "H200 is the same"), B200 SXM 1745.0 of 2250 (77.6%), and AMD MI300X 668.4 (torch 2.5.1 on
# ROCm 6.3, TunableOp on: 51.1% of the catalogue's 1,307.4), GB200 1822.0 of 2500 (72.9%: torch 2.10 with CUDA 13.0,
# the table's row of September 2025). The MI300X was left out while the table had two rows
# for it that disagreed (60.1% with ROCm 6.2 beside the 51.4%); its version of August 2026 (stas00/ml-engineering
# 744d01e) keeps the ROCm 6.3 one alone. Not scaled: GPUs the table lacks (H100 PCIe, L4, A10G, V100). Its float8
# rows (H100 SXM 1402.6 of 1979, 70.9%) are not used: the same rule in float8 made the published float8 rows 4-7%
# slower than measured on average (docs/planner.md, "Compute by shape").
MAMF_SHARE = {"a100": 0.869, "h100": 0.803, "h200": 0.803, "b200": 0.776, "gb200": 0.729,
              "mi300x": round(668.4 / 1307.4, 3)}
"""Each GPU's best achievable bf16 matmul rate over its dense peak, from the MAMF table above: a GPU's
matmul_efficiency is the A100's 0.70 scaled by its share over the A100's. (Until 2026-12-07 the GB200 took the B200's
77.6%, on a reading of the table that missed its GB200 row: the same die at 1200 W runs 4% more matmul FLOP/s than
the B200 at 1000 W, not the 11% its datasheet peak says.)"""
for _name in ("h100", "h200", "b200", "gb200", "mi300x"):
    CATALOGUE[_name] = dataclasses.replace(CATALOGUE[_name], matmul_efficiency=round(
        Accelerator.matmul_efficiency * MAMF_SHARE[_name] / MAMF_SHARE["a100"], 4))

NCCL_BOARD_CHANNELS = {"h100": 32, "h200": 32, "a100-80gb": 24, "a100-40gb": 24}
"""NCCL's channels for a ring inside one 8-GPU board, as its init logs print them: "32 coll channels" on H100 boards
(NCCL 2.2x logs quoted in NVIDIA/nccl and nccl-tests issues), "Channel 23/24" on an HGX A100 (nccl-tests issue 100).
The H200 is taken as the H100: the same GH100 die (132 SMs) on the same NVLink 4 switch board, which is what NCCL's
ring search sizes its channels by (inferred, no H200 log read). The others are not given: 0, not modelled."""
for _name, _channels in NCCL_BOARD_CHANNELS.items():
    CATALOGUE[_name] = dataclasses.replace(CATALOGUE[_name], nccl_channels=_channels)

# Host memory per GPU of the servers the catalogue's GPUs come in (CPU offload fills it): NVIDIA's DGX datasheets
# give 2 TB of system memory for the DGX H100 and H200 and the DGX A100 640GB (80 GB GPUs), 1 TB for the DGX A100
# 320GB (40 GB GPUs), each for 8 GPUs; DIMMs are sold in binary units (32 x 64 GiB), so 2 TB is 2,048 GiB.
HOST_GIB_PER_GPU = {"h100": 256, "h200": 256, "a100-80gb": 256, "a100-40gb": 128, "gb200": 480e9 / 2 / GiB}
"""(The GB200's is its superchip's Grace, 480 GB of LPDDR5X for two GPUs, the GB200 superchip's specification, taken
as decimal gigabytes: 223.5 GiB a GPU.)"""
for _name, _gib in HOST_GIB_PER_GPU.items():
    CATALOGUE[_name] = dataclasses.replace(CATALOGUE[_name], host_memory_bytes=_gib * GiB)

ALIASES = {"h100-sxm": "h100", "a100": "a100-80gb", "h200-sxm": "h200", "mi300": "mi300x", "4090": "rtx-4090",
           "rtx4090": "rtx-4090", "a6000": "rtx-a6000"}


def accelerator(name: str) -> Accelerator:
    """A catalogue entry (a copy, safe to edit) by name or alias."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in CATALOGUE:
        raise PlannerError("--gpu", f"unknown accelerator {name!r}",
                           f"use one of {', '.join(CATALOGUE)} or a profile JSON from `shardwise bench`")
    return dataclasses.replace(CATALOGUE[key], peak_flops=dict(CATALOGUE[key].peak_flops))


@hashed_once
@dataclass(frozen=True)
class Cluster:
    """The machines a plan runs on: how many devices and how they are wired."""

    accelerator: Accelerator
    """The device every rank runs on."""
    gpus: int
    """World size."""
    gpus_per_node: int = 8
    """Devices that share the fast intra-node link (NVLink domain)."""
    reserved_bytes: float = 0.0
    """Memory per device not available to training (CUDA context, NCCL buffers); see memory.FIXED_OVERHEAD."""
    rail_collectives: bool = True
    """A collective over groups with several members per node spreads its inter-node bytes over those members'
    NICs (NCCL's channels on nodes with a NIC per GPU: planner.comm.group_link); False: every rank's ring is bound
    to one NIC, as DeepSpeed's ZeRO-3 of 2021 measured (benchmarks/planner_published.py)."""

    def __post_init__(self):
        if self.gpus < 1:
            raise PlannerError("--gpus", f"{self.gpus} devices", "pass --gpus 1 or more")
        if self.gpus_per_node < 1:
            raise PlannerError("--gpus-per-node", f"{self.gpus_per_node}", "pass 1 or more")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise PlannerError("--gpus", f"{self.gpus} is not a whole number of {self.gpus_per_node}-GPU nodes",
                               "use a multiple of --gpus-per-node")

    @property
    def nodes(self) -> int:
        return max(1, self.gpus // self.gpus_per_node)


# ---------------------------------------------------------------------------------------------------
# Hardware profiles: `shardwise bench` writes one, the planner reads it in place of datasheet numbers

PROFILE_KEYS = {f.name for f in dataclasses.fields(Accelerator)}


def load_profile(path: str | Path) -> Accelerator:
    """An Accelerator from a JSON profile: either a full entry, or {"base": "h100", ...overrides}."""
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlannerError("--gpu", f"no profile file {path}", "pass a catalogue name or a `shardwise bench` JSON")
    except json.JSONDecodeError as e:
        raise PlannerError("--gpu", f"{path} is not valid JSON ({e})", "regenerate it with `shardwise bench`")
    except (UnicodeDecodeError, IsADirectoryError) as e:
        raise PlannerError("--gpu", f"{path} is not a JSON file ({e})", "pass a `shardwise bench` JSON") from None
    if not isinstance(raw, dict):
        raise PlannerError("--gpu", f"{path} holds no JSON object", "pass a `shardwise bench` JSON")
    raw.pop("measurements", None)  # what `shardwise bench` saw, kept in the file for the record
    base = raw.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise PlannerError("--gpu", f"profile {path}: base = {base!r} is not a name", 'give "base": "<gpu>"')
    unknown = set(raw) - PROFILE_KEYS
    if unknown:
        raise PlannerError("--gpu", f"profile {path} has unknown keys {sorted(unknown)}",
                           f"use only {sorted(PROFILE_KEYS)}")
    _check_profile_values(path, raw)
    if raw.get("busbw_curves"):  # JSON keys are strings
        raw["busbw_curves"] = {op: {int(size): bw for size, bw in curve.items()}
                               for op, curve in raw["busbw_curves"].items()}
    for field_name, dims in (("matmul_by_shape", 3), ("attention_by_shape", 2)):
        if raw.get(field_name):
            _check_grid(path, field_name, raw[field_name], dims)
    if base is not None:
        based = accelerator(base)
        if "attention_efficiency" in raw:  # a measured or stated share replaces the catalogue's per-kernel ones
            raw.setdefault("attention_by_kernel", None)
        if "comm_overlap" in raw:  # a measured overlap already holds NCCL's SMs: not counted twice
            raw.setdefault("nccl_channels", 0)
        if raw.get("name", based.name) != based.name and "sms" not in raw:  # another GPU on the base's figures:
            raw.setdefault("nccl_channels", 0)  # its board's channels and SMs are the profile's to give
        return dataclasses.replace(based, **raw)
    missing = {f.name for f in dataclasses.fields(Accelerator) if f.default is dataclasses.MISSING} - set(raw)
    if missing:
        raise PlannerError("--gpu", f"profile {path} lacks {sorted(missing)}", 'add them or give "base": "<gpu>"')
    return Accelerator(**raw)


# profile fields a zero would divide by or make meaningless; every other number may be 0
_POSITIVE_FIELDS = frozenset({"memory_bytes", "mem_bandwidth", "intra_node_bw", "inter_node_bw", "host_bw",
                              "matmul_efficiency", "attention_efficiency", "bandwidth_efficiency", "comm_efficiency"})


def _check_profile_values(path, raw: dict) -> None:
    """Each value of a profile has its field's type: finite numbers (positive where _POSITIVE_FIELDS says, else
    not negative), names, and tables of such numbers."""
    def number(value, positive: bool) -> bool:
        return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and (value > 0 if positive else value >= 0))

    def table(value, depth: int) -> bool:
        return isinstance(value, dict) and all(isinstance(k, str) and (table(v, depth - 1) if depth > 1
                                                                       else number(v, True)) for k, v in value.items())

    hints = typing.get_type_hints(Accelerator)
    for key, value in raw.items():
        hint = getattr(hints[key], "__name__", str(hints[key])) if isinstance(hints[key], type) else str(hints[key])
        if key == "busbw_curves":  # {collective: {message bytes: bus bandwidth}}
            ok = value is None or table(value, 2) and all(size.isdigit() for c in value.values() for size in c)
        elif "dict" in hint:
            ok = value is None and "None" in hint or table(value, 1) and (bool(value) or key != "peak_flops")
        elif hints[key] is bool:
            ok = isinstance(value, bool)
        elif hints[key] is str:
            ok = isinstance(value, str)
        else:  # float or int
            ok = number(value, key in _POSITIVE_FIELDS) and (hints[key] is not int or isinstance(value, int))
        if not ok:
            kind = "a positive number" if key in _POSITIVE_FIELDS else hint.replace("typing.", "")
            raise PlannerError("--gpu", f"profile {path}: {key} = {value!r} is not {kind}",
                               "regenerate it with `shardwise bench`, or fix that value")


def _check_grid(path, field_name: str, table: dict, dims: int) -> None:
    """A by-shape table is a full grid of positive sizes (what `_interpolated` reads), keyed "x,y[,z]"."""
    try:
        keys = {tuple(int(x) for x in key.split(",")) for key in table}
    except ValueError:
        keys = set()
    shaped = bool(keys) and all(len(key) == dims and min(key) >= 1 for key in keys)
    if not shaped or len(keys) != math.prod(len({key[i] for key in keys}) for i in range(dims)):
        raise PlannerError("--gpu", f"profile {path}: {field_name} is not a full grid of {dims} positive sizes "
                                    f'per key ("{",".join("n" * dims)}")', "regenerate it with `shardwise bench`")


def resolve_accelerator(spec: str) -> Accelerator:
    """A catalogue name, or the path of a JSON hardware profile."""
    if spec.endswith(".json") or Path(spec).is_file():
        return load_profile(spec)
    return accelerator(spec)



def detect_accelerator(device) -> str | None:
    """Catalogue name of the GPU behind a torch device, or None (CPU, or a GPU the catalogue lacks)."""
    import torch

    if device.type != "cuda":
        return None
    label = torch.cuda.get_device_name(device).lower()
    if "h100" in label:
        return "h100-pcie" if "pcie" in label else "h100"
    if "a100" in label:
        return "a100-80gb" if torch.cuda.get_device_properties(device).total_memory > 50 * GiB else "a100-40gb"
    names = {"rtx 4090": "rtx-4090", "rtx a6000": "rtx-a6000", "l40s": "l40s"}  # ("nvidia l40s" before "l4")
    found = next((key for part, key in names.items() if part in label), None)
    return found or next((name for name in ("h200", "gb200", "b200", "mi300x", "l4", "a10g", "v100") if name in label),
                         None)
