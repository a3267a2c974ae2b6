"""The engine's CPU attention forms (model.cpu_causal_attention) against torch's SDPA, side by side.

Two measurements, each at 1 thread (4 sequences: one rank of FSDP 2 or DDP 2 in the torchtitan comparison)
and at 2 threads (8 sequences: the single layout), on torchtitan's llama3 debug model shape (dim 256, 16 heads of
16, 6 layers, ffn 768, vocab 2048) at 1,024 tokens, fp32:
  - attention alone: forward + backward of one layer's attention;
  - the whole model: forward + backward (no optimizer), every layer's attention swapped through its
    `attention_fn` (the hook context parallelism uses).
The blockwise form runs as one call of the process's intra-op threads and, at 2 threads, also split over 2
threads of one intra-op thread each (`split`: model.CpuAttention.workers).
Then bf16 attention alone: SDPA against its backward computed in fp32 (one call, and blockwise) and against the
blockwise form computed in fp32 throughout, split over the threads.
The sides alternate in one process; each row is the median over --reps. The last column is the form the engine
itself chooses for that shape on this machine (model.cpu_attention_form, by timing: "sdpa", "blocks" for the
blockwise form, "one call" for SDPA's kernel in the engine's op, "+fp32 bwd", "+fp32", "split over N"); this
script forces each side.

    python benchmarks/cpu_attention.py [--reps 6] [--seq-len 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from shardwise.distributed import keep_host_memory
from shardwise.model import CPU_ATTENTION_BLOCK, build_model, cpu_attention_form, fuse_head_loss, materialize
from shardwise.model_args import ModelArgs


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def blockwise(q, k, v):
    return torch.ops.shardwise.cpu_causal_attention(q, k, v, CPU_ATTENTION_BLOCK, False)[0]


def blockwise_split(q, k, v):
    return torch.ops.shardwise.cpu_causal_attention(q, k, v, CPU_ATTENTION_BLOCK, False, False,
                                                    torch.get_num_threads())[0]


def fp32_backward(q, k, v):
    return torch.ops.shardwise.cpu_causal_attention(q, k, v, q.shape[-2], True)[0]


def blockwise_fp32_backward(q, k, v):
    return torch.ops.shardwise.cpu_causal_attention(q, k, v, CPU_ATTENTION_BLOCK, True)[0]


def blockwise_fp32_split(q, k, v):
    return torch.ops.shardwise.cpu_causal_attention(q, k, v, CPU_ATTENTION_BLOCK, True, True,
                                                    torch.get_num_threads())[0]


FP32 = {"sdpa": sdpa, "blockwise": blockwise, "split": blockwise_split}
BF16 = {"sdpa": sdpa, "fp32 bwd": fp32_backward, "blocks + fp32 bwd": blockwise_fp32_backward,
        "blocks, fp32, split": blockwise_fp32_split}


def operands(args: ModelArgs, batch: int, seq: int, dtype=torch.float32):
    # (batch, heads, seq, head_dim) views of sequence-major storage, as the model passes them
    return [torch.randn(batch, seq, args.n_heads, args.head_dim, dtype=dtype).transpose(1, 2) for _ in range(4)]


def chosen(q, k, v) -> str:
    form = cpu_attention_form(q, k, v)
    if form is None:
        return "sdpa"
    return (("blocks" if form.block < q.shape[-2] else "one call")
            + (" + fp32" if form.fp32_forward else " + fp32 bwd" if form.fp32_backward else "")
            + (f", split over {form.workers}" if form.workers > 1 else ""))


def attention_step(args: ModelArgs, batch: int, seq: int, dtype=torch.float32):
    q, k, v, grad = operands(args, batch, seq, dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    return lambda fn: fn(q, k, v).backward(grad)


def model_step(args: ModelArgs, batch: int, seq: int):
    model = build_model(args)
    materialize(model, args, "cpu", 0)
    fuse_head_loss(model)  # the loss as training computes it
    tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step(fn):
        for layer in model.layers.values():
            layer.attention.attention_fn = fn
        model(tokens, targets=tokens).backward()
        model.zero_grad(set_to_none=True)
    return step


def timed(step, reps: int, sides=FP32) -> dict[str, float]:
    times = {name: [] for name in sides}
    for fn in sides.values():  # warm-up
        step(fn)
    for _ in range(reps):
        for name, fn in sides.items():
            start = time.perf_counter()
            step(fn)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=1024)
    ns = parser.parse_args()
    args = ModelArgs(name="debug", dim=256, n_layers=6, n_heads=16, n_kv_heads=16, vocab_size=2048,
                     ffn_hidden=768, rope_theta=500000.0, max_seq_len=ns.seq_len, tie_embeddings=False)
    keep_host_memory()  # as training on a CPU does
    print(f"blockwise ({CPU_ATTENTION_BLOCK}-row blocks) vs SDPA, {ns.seq_len} tokens, fp32, median of {ns.reps}")
    print("| what | threads | sequences | SDPA s | blockwise s | blockwise / SDPA | split s | split / SDPA "
          "| engine's choice |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for threads, batch in ((1, 4), (2, 8)):
        torch.set_num_threads(threads)
        sides = FP32 if threads > 1 else {k: v for k, v in FP32.items() if k != "split"}
        choice = chosen(*operands(args, batch, ns.seq_len)[:3])
        for what, build in (("attention, one layer", attention_step), ("whole model", model_step)):
            t = timed(build(args, batch, ns.seq_len), ns.reps, sides)
            split = f"{t['split']:.3f} | **{t['split'] / t['sdpa']:.3f}**" if "split" in t else "- | -"
            print(f"| {what} | {threads} | {batch} | {t['sdpa']:.3f} | {t['blockwise']:.3f} | "
                  f"**{t['blockwise'] / t['sdpa']:.3f}** | {split} | {choice} |", flush=True)
    print(f"\nbf16 attention, one layer, against SDPA's bf16, median of {ns.reps}")
    print("| threads | sequences | SDPA s | fp32 bwd s | / SDPA | blocks + fp32 bwd s | / SDPA | blocks, fp32, split s "
          "| / SDPA | engine's choice |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for threads, batch in ((1, 4), (2, 8)):
        torch.set_num_threads(threads)
        choice = chosen(*operands(args, batch, ns.seq_len, torch.bfloat16)[:3])
        t = timed(attention_step(args, batch, ns.seq_len, torch.bfloat16), ns.reps, BF16)
        print(f"| {threads} | {batch} | {t['sdpa']:.3f} | " + " | ".join(
            f"{t[name]:.3f} | **{t[name] / t['sdpa']:.3f}**" for name in list(BF16)[1:]) + f" | {choice} |",
            flush=True)


if __name__ == "__main__":
    main()
