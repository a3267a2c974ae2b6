"""A Llama-style decoder, written once for one device.

Token embedding -> n_layers x [RMSNorm -> grouped-query attention with rotary positions -> residual,
RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> output head. Rotary embedding uses the "rotate half"
layout of Hugging Face's Llama, so weights map one to one onto `transformers.LlamaForCausalLM`.

The model is built on the meta device (no memory) and materialised by `init_weights`, which draws every
parameter from a generator seeded by (seed, parameter name): a model that is later split across ranks, or
built in another order, gets the same numbers as the single-device one.

Parallel transforms (tensor, pipeline, context parallel, FSDP) edit this model in place from outside; the
only concession to them is that `layers` is a ModuleDict keyed by layer index, so a pipeline stage that drops
layers keeps the others' parameter names.
"""

from __future__ import annotations

import math
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.utils._python_dispatch import _disable_current_modes

from shardwise import nf4
from shardwise.loss import head_loss_sum
from shardwise.model_args import ModelArgs
from shardwise.moe import MoE

# ---------------------------------------------------------------------------------------------------
# Modules


def rotary_table(args: ModelArgs, max_seq_len: int | None = None, device=None) -> torch.Tensor:
    """cos and sin of every (position, frequency), shape (2, max_seq_len, head_dim) (default: args.max_seq_len)."""
    head_dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if args.rope_scaling_factor:
        inv_freq = llama3_frequencies(inv_freq, args)
    angles = torch.outer(torch.arange(max_seq_len or args.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()])


def llama3_frequencies(inv_freq: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Llama 3.1's rotary frequency scaling (Meta's `apply_scaling`; transformers' rope_type 'llama3'): the
    frequencies whose wavelength is longer than original / low_freq_factor are divided by the factor, those shorter
    than original / high_freq_factor kept, and those between blended linearly in original / wavelength."""
    factor, low, high = args.rope_scaling_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
    original = args.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(between, blended, scaled)


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) by the table rows of its positions (rope: (2, seq, head_dim)).

    x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1) for the halves x1, x2 of the head: written
    as one autograd function on the halves, since the table's two halves are equal. The composite (a
    concatenation, a negation and three full-width products and sums, and their backward) makes five
    temporaries of x's size per call; this makes none, and its backward is the inverse rotation.
    """
    half = x.shape[-1] // 2
    table = rope[:, :, None, :half].to(x.dtype)  # (2, seq, 1, half): broadcast over the heads
    if torch.compiler.is_compiling():  # inductor fuses the plain form into one kernel (and cannot trace out=)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * table[0] - x2 * table[1], x2 * table[0] + x1 * table[1]], dim=-1)
    return _Rotate.apply(x, table[0], table[1])


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, torch.empty_like(x))

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin, torch.empty_like(grad)), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """(x1 cos - x2 sin, x2 cos + x1 sin) for the halves x1, x2 of the last dimension, written to `out`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out1, out2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=out1)
    out1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=out2)
    out2.addcmul_(x1, sin)
    return out


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm, with its forward and backward written out for fp32 on a CPU (`_RMSNorm`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or weight is None
                or weight.dtype != x.dtype or self.eps is None
                or torch.compiler.is_compiling()):  # inductor fuses the plain form
            return super().forward(x)
        if not isinstance(x, DTensor) and not isinstance(weight, DTensor):  # fake tensors too (the simulator)
            return _RMSNorm.apply(x, weight, self.eps)
        # sequence parallelism: tokens sharded, the weight replicated. Each rank normalises its own tokens; its
        # weight gradient is its tokens' share of the sum (Partial over the mesh dims that shard the tokens),
        # which DTensor reduces as it does torch's form's.
        if (isinstance(x, DTensor) and isinstance(weight, DTensor) and x.device_mesh == weight.device_mesh
                and all(isinstance(p, Replicate) for p in weight.placements)
                and all(isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim % x.ndim != x.ndim - 1)
                        for p in x.placements)):
            grad_w = [Partial() if isinstance(p, Shard) else Replicate() for p in x.placements]
            local = _RMSNorm.apply(x.to_local(), weight.to_local(grad_placements=grad_w), self.eps)
            return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False)
        return super().forward(x)


class _RMSNorm(torch.autograd.Function):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension, fp32, on a CPU.

    Why our own: torch 2.13's `rms_norm` is one fused kernel on a GPU but the composite form on a CPU (a square,
    a mean, a product with rstd and one with the weight, each a pass over x, and autograd's backward of each:
    28 bytes per element forward, 100 backward, counted by planner.opcount). This reads x once for its norm
    (`vector_norm`, no x^2 written) and saves only (x, rstd), as the GPU kernel does: 20 bytes forward. The
    backward is the closed form, its two reductions (over a row, over a column) of g * x matrix-vector products:
    52 bytes, counted the same way. Values agree with the composite's to fp32 rounding. Under sequence
    parallelism each rank runs it on its own tokens (RMSNorm.forward).
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        # bf16 (FSDP2's mixed-precision policy: parallel.mixed_precision) is computed in fp32 and rounded once, as
        # the GPU kernel does, and saves x in bf16 with an fp32 rstd (torch's composite saved six times x's bytes)
        dim, low = x.shape[-1], x.dtype in (torch.bfloat16, torch.float16)
        xf = x.float() if low else x
        rstd = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(dim).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        out = torch.mul(xf, rstd).mul_(weight)
        return out.to(x.dtype) if low else out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        low = x.dtype in (torch.bfloat16, torch.float16)
        if low:
            grad_x, grad_w = _RMSNorm._backward_fp32(grad.float(), x.float(), weight.float(), rstd,
                                                     ctx.needs_input_grad[1])
            return grad_x.to(x.dtype), None if grad_w is None else grad_w.to(weight.dtype), None
        grad_x, grad_w = _RMSNorm._backward_fp32(grad, x, weight, rstd, ctx.needs_input_grad[1])
        return grad_x, grad_w, None

    @staticmethod
    def _backward_fp32(grad, x, weight, rstd, weight_grad: bool):
        dim = x.shape[-1]
        gx = torch.mul(grad, x).reshape(-1, dim)
        # the weight's gradient: sum over tokens of rstd g x (a frozen weight, LoRA's, has none)
        grad_w = torch.mv(gx.t(), rstd.view(-1)) if weight_grad else None
        # dx = rstd g w - x rstd^3 mean(g w x)
        coef = torch.mv(gx, weight).view(rstd.shape).mul_(rstd.pow(3)).div_(-dim)
        grad_x = torch.mul(grad, weight).mul_(rstd).addcmul_(x, coef)
        return grad_x, grad_w


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over (batch, heads, seq, head_dim); k and v may have fewer (grouped) heads."""
    if _cpu_attention_eligible(q, k):
        if torch.is_autocast_enabled("cpu"):  # as autocast does for SDPA: compute in its lower precision
            dtype = torch.get_autocast_dtype("cpu")
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        with torch.autocast("cpu", enabled=False):
            form = cpu_attention_form(q, k, v)
            if form is not None:
                return torch.ops.shardwise.cpu_causal_attention(q, k, v, form.block, form.fp32_backward,
                                                                form.fp32_forward, form.workers)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


CPU_ATTENTION_BLOCK = 128
"""Query rows per diagonal piece of `cpu_causal_attention` (the masked work is at most half a block per row)."""

CPU_ATTENTION_MARGIN = 0.03
"""How much faster than SDPA another CPU attention form must time to be chosen (`cpu_attention_form`)."""


@dataclass(frozen=True)
class CpuAttention:
    """A form of `cpu_causal_attention`: query rows per piece (>= the sequence: one causal call, SDPA's kernel
    call); whether a bf16 attention's backward runs in fp32, and its forward too; and over how many threads of
    one intra-op thread each its (batch or key/value head) slices run side by side."""

    block: int
    fp32_backward: bool = False
    fp32_forward: bool = False
    workers: int = 1


_cpu_attention_forms: dict[tuple, CpuAttention | None] = {}


def _cpu_attention_eligible(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `causal_attention` may take another form than SDPA: self-attention longer than a block, on a CPU,
    on plain tensors, outside `torch.compile` (inductor has its own) and outside deterministic mode (the form is
    chosen by timing, `cpu_attention_form`)."""
    return (q.device.type == "cpu" and q.shape[-2] == k.shape[-2] > CPU_ATTENTION_BLOCK  # the kernel takes GQA
            and q.dtype in (torch.float32, torch.bfloat16, torch.float64)
            and not isinstance(q, DTensor) and not is_fake(q) and not torch.compiler.is_compiling()
            and not torch.are_deterministic_algorithms_enabled())


def cpu_attention_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> CpuAttention | None:
    """The form `causal_attention` computes these operands' shape in on this machine (None: SDPA), chosen the
    first time the shape comes with gradients on, by timing each form's forward + backward on the operands, and
    kept for the process (so a recomputation under activation checkpointing runs the same operators, and
    validation the form training chose). Without gradients a shape not chosen for runs SDPA: the forms are timed
    with their backward, and a prompt's length changes from one `shardwise generate` to the next.

    Why time it: which form is faster depends on the CPU, not only on the shape. The blockwise form skips the
    masked keys but makes smaller kernel calls; measured (docs/foundation.md, benchmarks/cpu_attention.py) it
    was 0.78 of SDPA's time on one machine of this project's kind and 1.06 on another with the same two cores.
    torch 2.13's bf16 CPU flash backward took 1.7 times its fp32 backward on that second machine, so a bf16
    attention also tries its backward in fp32 (on inputs upcast from bf16, so at least as accurate). A form is
    chosen over SDPA only when it times `CPU_ATTENTION_MARGIN` faster; cuDNN's `benchmark` mode chooses its
    convolution algorithms the same way, and like it this is off under `torch.use_deterministic_algorithms`.
    """
    key = (tuple(q.shape), tuple(k.shape), q.dtype, torch.get_num_threads())
    if key not in _cpu_attention_forms:
        if not torch.is_grad_enabled():  # inference (a prompt, validation before any step): SDPA, nothing timed
            return None
        _cpu_attention_forms[key] = _fastest_cpu_attention(q, k, v)
    return _cpu_attention_forms[key]


def cpu_attention_forms() -> list[list]:
    """The forms chosen in this process, as JSON: [q shape, k shape, dtype, threads, None or [block,
    fp32_backward, fp32_forward, workers]] each (a checkpoint of before the last two has two: their defaults). A
    checkpoint keeps every rank's (checkpoint.Checkpointer.save), so that a resumed run computes attention as the
    run it continues did: the forms agree only to rounding, and timing could choose another one."""
    return [[list(q), list(k), str(dtype).removeprefix("torch."), threads,
             None if form is None else [form.block, form.fp32_backward, form.fp32_forward, form.workers]]
            for (q, k, dtype, threads), form in _cpu_attention_forms.items()]


def restore_cpu_attention_forms(entries: list[list]) -> None:
    """Take the forms `cpu_attention_forms` wrote as this process's choice for those shapes."""
    for q, k, dtype, threads, form in entries:
        _cpu_attention_forms[(tuple(q), tuple(k), getattr(torch, dtype), threads)] = (
            None if form is None else CpuAttention(*form))


def _fastest_cpu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> CpuAttention | None:
    seq, threads = q.shape[-2], torch.get_num_threads()
    forms: list[CpuAttention | None] = [None]
    for workers in (1, threads) if threads > 1 else (1,):
        if workers > 1:  # SDPA's one call, its slices side by side
            forms.append(CpuAttention(seq, workers=workers))
        if q.dtype == torch.bfloat16:
            forms += [CpuAttention(seq, fp32_backward=True, workers=workers),
                      CpuAttention(CPU_ATTENTION_BLOCK, fp32_backward=True, workers=workers),
                      CpuAttention(CPU_ATTENTION_BLOCK, fp32_backward=True, fp32_forward=True, workers=workers)]
        else:
            forms.append(CpuAttention(CPU_ATTENTION_BLOCK, workers=workers))
    best = dict.fromkeys(forms, math.inf)
    # outside any dispatch mode (selective checkpointing's cache, a FLOP counter) and autograd: only the kernels
    with _disable_current_modes(), torch.no_grad():
        q, k, v = q.detach(), k.detach(), v.detach()
        for _ in range(3):  # alternated, the best of three (the first warms up)
            for form in forms:
                best[form] = min(best[form], _time_cpu_attention(form, q, k, v))
    fastest = min(forms, key=best.__getitem__)
    return fastest if best[fastest] < (1 - CPU_ATTENTION_MARGIN) * best[None] else None


def _time_cpu_attention(form: CpuAttention | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """Seconds for one forward + backward of `form` (None: SDPA's kernel) on these operands."""
    start = time.perf_counter()
    if form is None:
        out, lse = _cpu_flash(q, k, v, 0.0, True)
        _cpu_flash_backward(out, q, k, v, out, lse, 0.0, True)
    else:
        out, lse = _blockwise_attention(q, k, v, form.block, form.fp32_forward, form.workers)
        _blockwise_attention_backward(out, q, k, v, out, lse, form.block, form.fp32_backward, form.workers)
    return time.perf_counter() - start


_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@torch.library.custom_op("shardwise::cpu_causal_attention", mutates_args=())
def cpu_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, fp32_backward: bool,
                         fp32_forward: bool = False, workers: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention on a CPU, in pieces that skip the masked keys; returns (output, logsumexp).

    Why our own: torch 2.13's CPU flash kernel skips only whole 512-key tiles above the diagonal: at 1,024
    tokens it computes 75% of the score square where causal attention needs half. Here the rows go in blocks;
    block i attends to its own keys under the causal mask (one small square) and to all keys before it without
    one (a rectangle), each a call of that same kernel, and the two partial results are merged by their
    log-sum-exp, as ring attention merges its steps (Liu et al. 2023). At 1,024 tokens and 128-row blocks that
    is 56% of the square. The backward (below) calls the kernel's backward on the same pieces with the merged
    output and log-sum-exp, which is what each piece's softmax is normalised by; with `fp32_backward` a bf16
    attention's backward runs on fp32 copies (torch's bf16 CPU backward can be slower than its fp32 one), with
    `fp32_forward` its forward too. With `workers` > 1 the sequences (or, for fewer sequences than workers, the
    key/value heads with their query heads) are split into that many slices, each computed by a thread of one
    intra-op thread (`_in_slices`): the kernel's many small calls keep two cores busier that way than as calls
    of two OpenMP threads each, and the figures are the same bit for bit (the kernel computes every sequence
    and head on its own). One op to autograd and to selective activation checkpointing, which keeps its output
    as it keeps SDPA's.
    """
    return _blockwise_attention(q, k, v, block, fp32_forward, workers)


def _blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, fp32_forward: bool = False,
                         workers: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = q.dtype
    if fp32_forward and dtype in (torch.bfloat16, torch.float16):
        q, k, v = (t.float() for t in (q, k, v))  # strides kept: sequence-major stays so
    out, lse = _attention_outputs(q)

    def rows_in_blocks(s: tuple[slice, slice, slice]) -> None:
        qs, ks, vs, outs, lses = q[s[:2]], k[s[::2]], v[s[::2]], out[s[:2]], lse[s[:2]]
        for start in range(0, q.shape[-2], block):
            rows = slice(start, start + block)
            o, o_lse = _cpu_flash(qs[..., rows, :], ks[..., rows, :], vs[..., rows, :], 0.0, True)
            if start:
                prefix, prefix_lse = _cpu_flash(qs[..., rows, :], ks[..., :start, :], vs[..., :start, :], 0.0, False)
                # log(e^a + e^b) in operators that round an element the same wherever it falls in the tensor:
                # torch.logaddexp's vector and scalar (tail) paths differ in the last bit, so a slice of the
                # batch would not give the whole's figures bit for bit. Every causal row has a key: no -inf.
                merged = torch.maximum(o_lse, prefix_lse).add_((o_lse - prefix_lse).abs_().neg_().exp_().log1p_())
                o = (o * (o_lse - merged).exp_().unsqueeze(-1)).addcmul_(prefix,
                                                                         (prefix_lse - merged).exp_().unsqueeze(-1))
                o_lse = merged
            outs[..., rows, :] = o
            lses[..., rows] = o_lse

    _in_slices(rows_in_blocks, q, k, workers)
    return out.to(dtype), lse


def _attention_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output in the query's memory layout (as SDPA's), and the log-sum-exp in the kernel's accumulation type."""
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.promote_types(q.dtype, torch.float32))


@cpu_causal_attention.register_fake
def _(q, k, v, block, fp32_backward, fp32_forward=False, workers=1):
    return _attention_outputs(q)


@torch.library.custom_op("shardwise::cpu_causal_attention_backward", mutates_args=())
def cpu_causal_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  out: torch.Tensor, lse: torch.Tensor, block: int, fp32_backward: bool,
                                  workers: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _blockwise_attention_backward(grad, q, k, v, out, lse, block, fp32_backward, workers)


def _blockwise_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  out: torch.Tensor, lse: torch.Tensor, block: int, fp32_backward: bool,
                                  workers: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = q.dtype
    if fp32_backward and dtype in (torch.bfloat16, torch.float16):
        grad, q, k, v, out = (t.float() for t in (grad, q, k, v, out))  # strides kept: sequence-major stays so
    dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)

    def rows_in_blocks(s: tuple[slice, slice, slice]) -> None:
        qs, ks, vs, dqs, dks, dvs = q[s[:2]], k[s[::2]], v[s[::2]], dq[s[:2]], dk[s[::2]], dv[s[::2]]
        grads, outs, lses = grad[s[:2]], out[s[:2]], lse[s[:2]]
        for start in range(0, q.shape[-2], block):
            rows = slice(start, start + block)
            g, qr, o, o_lse = grads[..., rows, :], qs[..., rows, :], outs[..., rows, :], lses[..., rows]
            gq, gk, gv = _cpu_flash_backward(g, qr, ks[..., rows, :], vs[..., rows, :], o, o_lse, 0.0, True)
            dks[..., rows, :] += gk
            dvs[..., rows, :] += gv
            if start:
                gq_prefix, gk, gv = _cpu_flash_backward(g, qr, ks[..., :start, :], vs[..., :start, :], o, o_lse, 0.0,
                                                        False)
                gq += gq_prefix
                dks[..., :start, :] += gk
                dvs[..., :start, :] += gv
            dqs[..., rows, :] = gq

    _in_slices(rows_in_blocks, q, k, workers)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


@cpu_causal_attention_backward.register_fake
def _(grad, q, k, v, out, lse, block, fp32_backward, workers=1):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _attention_slices(q: torch.Tensor, k: torch.Tensor, workers: int) -> list[tuple[slice, slice, slice]]:
    """(sequences, query heads, key/value heads) of each of up to `workers` slices of an attention: whole
    sequences where there are as many as workers (or more than key/value heads), else whole key/value heads,
    each with the query heads of its group."""
    batch, kv_heads = q.shape[0], k.shape[1]
    group, every = q.shape[1] // kv_heads, slice(None)
    if batch >= min(workers, kv_heads):
        n = min(batch, workers)
        return [(slice(batch * i // n, batch * (i + 1) // n), every, every) for i in range(n)]
    n = min(kv_heads, workers)
    bounds = [kv_heads * i // n for i in range(n + 1)]
    return [(every, slice(a * group, b * group), slice(a, b)) for a, b in zip(bounds, bounds[1:])]


def _in_slices(fn, q: torch.Tensor, k: torch.Tensor, workers: int) -> None:
    """fn(s) for each slice s of `_attention_slices`, side by side on `workers` threads (in this thread if one)."""
    slices = _attention_slices(q, k, workers)
    if len(slices) == 1:
        fn(slices[0])
        return
    inference = torch.is_inference_mode_enabled()

    def run(s):  # a new thread has autograd on and inference mode off: as the op's caller has them
        with torch.inference_mode(inference), torch.no_grad():
            fn(s)

    list(_attention_threads(workers).map(run, slices))


_attention_pools: dict[int, ThreadPoolExecutor] = {}
os.register_at_fork(after_in_child=_attention_pools.clear)  # a forked child has none of the threads


def _attention_threads(workers: int) -> ThreadPoolExecutor:
    """`workers` threads, each with one intra-op (OpenMP) thread of its own, made once per count and process.

    Why our own threads: PyTorch has no way to run operators side by side on one intra-op thread each (its
    inter-op pool, `torch.jit.fork`, gives each task the process's whole OpenMP team). OpenMP's thread count is a
    per-thread setting, so each of these threads sets its own to one; `torch.set_num_threads` also records the
    count as the process's default, which each thread reads once, on its first use, so the caller's is put back
    only once every one of these has read it. (A thread of the process's own that made its first parallel call
    in those few milliseconds would keep one intra-op thread.)"""
    pool = _attention_pools.get(workers)
    if pool is None:
        threads, ready = torch.get_num_threads(), threading.Barrier(workers + 1, timeout=60)

        def one_intra_op_thread():
            torch.set_num_threads(1)
            torch.get_num_threads()  # ATen reads the default once per thread, on its first use: while it is 1
            ready.wait()

        pool = ThreadPoolExecutor(workers, thread_name_prefix="shardwise-attention", initializer=one_intra_op_thread)
        try:
            for _ in range(workers):  # each waits in the initializer, so every submit starts a thread
                pool.submit(int)
            ready.wait()
        except BaseException:
            ready.abort()
            pool.shutdown(wait=False)
            raise
        finally:
            torch.set_num_threads(threads)
        _attention_pools[workers] = pool
    return pool


def _cpu_causal_attention_context(ctx, inputs, output):
    q, k, v, ctx.block, ctx.fp32_backward, _, ctx.workers = inputs
    ctx.save_for_backward(q, k, v, *output)


def _cpu_causal_attention_grad(ctx, grad, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    return (*torch.ops.shardwise.cpu_causal_attention_backward(grad, q, k, v, out, lse, ctx.block,
                                                               ctx.fp32_backward, ctx.workers), None, None, None, None)


cpu_causal_attention.register_autograd(_cpu_causal_attention_grad, setup_context=_cpu_causal_attention_context)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        # context parallelism swaps this for attention over a sequence split across ranks
        self.attention_fn = causal_attention
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        # the table may be longer than this sequence (the whole rotary table, when the caller cannot know the
        # sequence length: under sequence parallelism the block's input holds 1/tp of it)
        rope = rope[:, :seq]
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        # (batch, heads, seq, head_dim) views of sequence-major storage: attention's output comes back in that
        # layout, so the transpose below is a view and the output projection saves attention's output itself
        out = self.attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, hidden: int | None = None):
        super().__init__()
        hidden = hidden or args.ffn_hidden
        self.w1 = nn.Linear(args.dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Attention and an MLP: the dense SwiGLU `feed_forward`, or, in a mixture of experts' MoE layers, `moe`."""

    def __init__(self, args: ModelArgs, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        if args.is_moe_layer(layer):
            shared = FeedForward(args, args.n_shared_experts * args.expert_hidden) if args.n_shared_experts else None
            self.moe = MoE(args, shared)
        else:
            self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        mlp = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + mlp(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # recomputed, never saved: it is a function of the shape, so checkpoints carry only weights
        self.register_buffer("rope", rotary_table(args), persistent=False)
        # forward(targets=...) returns the loss with the head fused into it (shardwise.loss.head_loss_sum); the
        # trainer sets it where the head stays a plain linear (fuse_head_loss)
        self.fused_loss = False
        # a pipeline's last stage with a fused head: forward returns the normalised hidden states (this rank's
        # local part), and the schedule's loss_fn runs the head fused with the loss (shardwise.parallel.pipeline)
        self.head_in_loss = False
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head; call again after anything that replaces parameters."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, ignored: bool = False) -> torch.Tensor:
        """Logits for (batch, seq) token ids; `positions` (seq,) selects rotary rows when the sequence is a slice.
        Given `targets` (batch, seq) (only with `fused_loss`): their summed token cross-entropy instead, computed
        with the output head (`shardwise.loss.head_loss_sum`), so that the logits are never made whole; `ignored`:
        some targets are IGNORE_INDEX (a prompt's tokens, counted in no loss).

        A pipeline stage may have no embedding (it then takes hidden states) or no output head (it then
        returns hidden states); a last stage whose head runs in the schedule's loss (`head_in_loss`) returns its
        normalised hidden states. On one device both are present.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope if positions is None else self.rope[:, positions]
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        if targets is not None:
            return head_loss_sum(h, self.output.weight, targets, ignored)
        if self.head_in_loss:
            # DTensor.to_local() returns a view, on which FSDP2 warns that an in-place op would drop its backward
            # hook (nothing here writes it in place); the copy is one micro-batch's normalised hidden states, and
            # the DTensor's own is freed once copied (the norm's backward keeps its input, not its output)
            return h.to_local().clone() if isinstance(h, DTensor) else h
        return self.output(h) if self.output is not None else h


def fuse_head_loss(model: Transformer) -> None:
    """Let `model` compute the loss with its head fused (Transformer.fused_loss) if the head is a plain linear:
    an nn.Linear without bias on a plain weight, or on a tensor-parallel weight split by vocabulary rows (the loss
    is then vocabulary-parallel), not an NF4 tensor or a LoRA adapter, whose own forward must run. Call after
    those transforms and before data parallelism: FSDP shards the weight between forwards, and gathers it back
    (as a plain tensor, or the tensor-parallel DTensor) for the root module's forward, where the loss runs.

    The fused loss runs inside the model's forward (in a pipeline, in the schedule's loss on the last stage's
    output: shardwise.parallel.pipeline.pipeline_loss), the unfused one after it on the logits: a forward whose output
    is the loss starts FSDP's backward (and its prefetch of the last block) before the loss's backward, which is
    negligible when fused and the step's largest working set when not."""
    head = model.output
    weight = head.weight.data if type(head) is nn.Linear and head.bias is None else None  # None: no head (a stage)
    model.fused_loss = type(weight) is torch.Tensor or (
        isinstance(weight, DTensor) and weight.device_mesh.ndim == 1 and weight.placements == (Shard(0),)
        and type(weight.to_local()) is torch.Tensor)


def build_model(args: ModelArgs) -> Transformer:
    """The model on the meta device: shapes only, no memory. Materialise with `materialize`."""
    with torch.device("meta"):
        return Transformer(args)


# ---------------------------------------------------------------------------------------------------
# Deterministic initialisation


def canonical_name(name: str) -> str:
    """A parameter's name with the prefixes wrappers add (checkpointing, compile, FSDP) removed."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def param_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded by (seed, canonical parameter name): stable across runs, layouts and devices."""
    key = zlib.crc32(f"{seed}:{canonical_name(name)}".encode())
    return torch.Generator().manual_seed(seed * 2**32 + key)


def init_value(args: ModelArgs, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """The full (unsharded) fp32 initial value of one parameter, on CPU.

    Embeddings and input projections: N(0, 0.02). Projections that write into the residual stream (wo, w2):
    N(0, 0.02 / sqrt(2 n_layers)), GPT-2's scaling, so the residual's variance does not grow with depth.
    Output head: N(0, dim^-0.5). Norm weights: ones. Experts as the linears they stand for (w2 as the down
    projection); the router N(0, 0.02). LoRA adapters (see lora.py): A as nn.Linear initialises a
    weight (Kaiming-uniform with a = sqrt(5), peft's default), B zeros, so the adapted model starts as the base.
    """
    name = canonical_name(name)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("lora_b"):
        return torch.zeros(shape)
    if name.endswith("lora_a"):
        bound = 1.0 / math.sqrt(shape[1])
        return torch.empty(shape).uniform_(-bound, bound, generator=param_generator(seed, name))
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        std = 0.02 / math.sqrt(2 * args.n_layers)
    elif name == "output.weight":
        std = args.dim**-0.5
    else:
        std = 0.02
    return torch.empty(shape).normal_(0.0, std, generator=param_generator(seed, name))


@torch.no_grad()
def materialize(model: nn.Module, args: ModelArgs, device: torch.device | str, seed: int,
                init_values: bool = True) -> None:
    """Allocate a meta-device model on `device` and give every parameter its (seed, name) initial value.

    Parameters that are DTensors (sharded by tensor parallelism or FSDP) receive just their local piece of
    the full value, so every layout starts from the numbers the single-device model starts from.
    init_values=False leaves the storage as allocated (the simulator's fake tensors have no values to set).
    """
    model.to_empty(device=device)
    if isinstance(model, Transformer):
        model.tie_weights()
        model.rope = rotary_table(args, device=device)
    for module in model.modules():
        if isinstance(module, MoE):
            module.reset_buffers()  # to_empty left them as uninitialised memory
    for name, param in list(model.named_parameters()):
        if init_values:
            set_full_value(model, name, param, init_value(args, name, param.shape, seed))
        elif nf4.is_nf4(param):
            # to_empty gave an NF4Tensor storage for its sharded parts only: quantising a value makes all of it
            set_full_value(model, name, param, torch.empty(param.shape, dtype=param.dtype))


@torch.no_grad()
def set_full_value(model: nn.Module, name: str, param: torch.Tensor, full: torch.Tensor) -> None:
    """Give parameter `name` of `model` its local piece of the full single-device value `full` (no communication).

    A QLoRA base weight (NF4, see nf4.py) is quantised whole and then cut, the others are cut and copied.
    """
    if nf4.is_nf4(param):
        nf4.assign(model, name, full.to(param.dtype))
    else:
        param.copy_(_local_piece(param, full).to(param.dtype))


def _local_piece(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # distribute_tensor with src_data_rank=None slices locally: no communication, no random numbers
        return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return full.to(param.device)
