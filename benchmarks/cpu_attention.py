"""The engine's blockwise CPU attention (model.cpu_causal_attention) against torch's SDPA, side by side.

Two measurements, each at 1 thread (4 sequences: one rank of FSDP 2 or DDP 2 in the torchtitan comparison)
and at 2 threads (8 sequences: the single layout), on torchtitan's llama3 debug model shape (dim 256, 16 heads of
16, 6 layers, ffn 768, vocab 2048) at 1,024 tokens, fp32:
  - attention alone: forward + backward of one layer's attention;
  - the whole model: forward + backward (no optimizer), every layer's attention swapped through its
    `attention_fn` (the hook context parallelism uses).
The two sides alternate in one process; each row is the median over --reps. The engine itself runs the blockwise
form only with one thread (model._blockwise_on_cpu); this script forces each side at both thread counts.

    python benchmarks/cpu_attention.py [--reps 6] [--seq-len 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from shardwise.model import CPU_ATTENTION_BLOCK, build_model, fuse_head_loss, materialize
from shardwise.model_args import ModelArgs


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def blockwise(q, k, v):
    return torch.ops.shardwise.cpu_causal_attention(q, k, v, CPU_ATTENTION_BLOCK)[0]


SIDES = {"sdpa": sdpa, "blockwise": blockwise}


def attention_step(args: ModelArgs, batch: int, seq: int):
    # (batch, heads, seq, head_dim) views of sequence-major storage, as the model passes them
    q, k, v = (torch.randn(batch, seq, args.n_heads, args.head_dim).transpose(1, 2).requires_grad_()
               for _ in range(3))
    grad = torch.randn(batch, seq, args.n_heads, args.head_dim).transpose(1, 2)
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


def timed(step, reps: int) -> dict[str, float]:
    times = {name: [] for name in SIDES}
    for fn in SIDES.values():  # warm-up
        step(fn)
    for _ in range(reps):
        for name, fn in SIDES.items():
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
    print(f"blockwise ({CPU_ATTENTION_BLOCK}-row blocks) vs SDPA, {ns.seq_len} tokens, fp32, median of {ns.reps}")
    print("| what | threads | sequences | SDPA s | blockwise s | blockwise / SDPA |")
    print("| --- | --- | --- | --- | --- | --- |")
    for threads, batch in ((1, 4), (2, 8)):
        torch.set_num_threads(threads)
        for what, build in (("attention, one layer", attention_step), ("whole model", model_step)):
            t = timed(build(args, batch, ns.seq_len), ns.reps)
            print(f"| {what} | {threads} | {batch} | {t['sdpa']:.3f} | {t['blockwise']:.3f} | "
                  f"**{t['blockwise'] / t['sdpa']:.3f}** |", flush=True)


if __name__ == "__main__":
    main()
