"""A catalogue of accelerators: memory, dense peak FLOP/s per precision, memory bandwidth.

Figures are the vendors' datasheet numbers for dense math (no 2:4 sparsity), per GPU, for the SXM/OAM
part unless the name says otherwise. The planner and the MFU metric both read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TERA = 1e12


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gib: float
    """Device memory as sold (GB on the datasheet, stated here in GiB)."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by precision: fp32, tf32, bf16, fp16, fp8 (absent = unsupported)."""
    mem_bandwidth: float
    """Bytes per second to device memory."""


def _gb(gb: float) -> float:
    return gb * 1e9 / 2**30


def _acc(name: str, mem_gb: float, bw_tbs: float, **tflops: float) -> Accelerator:
    return Accelerator(name, _gb(mem_gb), {k: v * TERA for k, v in tflops.items()}, bw_tbs * 1e12)


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in [
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5 and PCIe columns)
        _acc("h100", 80, 3.35, fp32=66.9, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9),
        _acc("h100-pcie", 80, 2.0, fp32=51.2, tf32=378.0, bf16=756.0, fp16=756.0, fp8=1513.0),
        # NVIDIA H200 datasheet: H100's compute, 141 GB HBM3e at 4.8 TB/s
        _acc("h200", 141, 4.8, fp32=66.9, tf32=494.7, bf16=989.4, fp16=989.4, fp8=1978.9),
        # NVIDIA A100 datasheet (SXM4)
        _acc("a100-40gb", 40, 1.555, fp32=19.5, tf32=156.0, bf16=312.0, fp16=312.0),
        _acc("a100", 80, 2.039, fp32=19.5, tf32=156.0, bf16=312.0, fp16=312.0),
        # NVIDIA HGX B200 datasheet, per GPU
        _acc("b200", 180, 7.7, fp32=80.0, tf32=1100.0, bf16=2250.0, fp16=2250.0, fp8=4500.0),
        # AMD Instinct MI300X datasheet
        _acc("mi300x", 192, 5.3, fp32=163.4, tf32=653.7, bf16=1307.4, fp16=1307.4, fp8=2614.9),
        # NVIDIA L4 and A10 datasheets
        _acc("l4", 24, 0.3, fp32=30.3, tf32=60.0, bf16=121.0, fp16=121.0, fp8=242.5),
        _acc("a10", 24, 0.6, fp32=31.2, tf32=62.5, bf16=125.0, fp16=125.0),
        # NVIDIA V100 SXM2 datasheet: no bf16
        _acc("v100", 32, 0.9, fp32=15.7, fp16=125.0),
    ]
}


def detect_accelerator(device: torch.device) -> str | None:
    """Catalogue name of the GPU behind `device`, or None (CPU, or a GPU we have no figures for)."""
    if device.type != "cuda":
        return None
    label = torch.cuda.get_device_name(device).lower()
    memory_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    if "h100" in label:
        return "h100-pcie" if "pcie" in label else "h100"
    if "a100" in label:
        return "a100" if memory_gib > 50 else "a100-40gb"
    for name in ("h200", "b200", "mi300x", "l4", "a10", "v100"):
        if name in label:
            return name
    return None


def matmul_peak(acc: Accelerator, precision: str) -> float:
    """Peak FLOP/s for training at `precision` ('fp32', 'bf16', 'fp16', 'fp8'); fp32 matmuls use plain fp32."""
    if precision not in acc.peak_flops:
        raise KeyError(f"{acc.name} has no {precision} peak in the catalogue")
    return acc.peak_flops[precision]
