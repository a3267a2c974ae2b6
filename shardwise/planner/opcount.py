"""How many operators a training step dispatches: the multiplier of the per-operator overhead in the time model.

Every operator costs a fixed amount besides its arithmetic: on a CPU, Python and the dispatcher (argument
parsing, autograd bookkeeping, allocation), on a GPU the kernel launch. We count the operators of our own model
(`shardwise.model`) by running it under a counting TorchDispatchMode at a tiny size; the count depends on the
code path, not on the tensor sizes, so it holds for every size with the same structure (grouped-query attention
or not, tied embeddings or not). Counts are per micro-batch (forward + backward) for one block and for the rest
(embedding, final norm, head, loss), and per optimizer step (the engine's own: gradient norm, clipping, AdamW
as shardwise.optim builds it, torch's fused kernel, zero_grad), split into calls and per-tensor work: a foreach
operator is one launch of a multi-tensor kernel on a GPU but a loop of one operator per tensor on a CPU; a fused
operator is one call on both.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # no public equivalent; documented in torch's docs

from shardwise.config import OptimConfig
from shardwise.loss import autocast_context, token_loss_sum
from shardwise.model import RMSNorm, Transformer, fuse_head_loss
from shardwise.model_args import ModelArgs
from shardwise.optim import build_optimizer
from shardwise.planner.operators import CAST_INPUTS, Elementwise, LoraOps, OpCounts, moe_structure


class OpCounter(TorchDispatchMode):
    """Counts dispatched operators; a foreach operator also adds the length of its tensor list to `per_tensor`."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.per_tensor = 0
        self.bytes = 0
        """Bytes of the tensors each operator reads (its tensor arguments) and writes (its new outputs, and the
        arguments it modifies in place: an in-place foreach operator returns nothing)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if func.overloadpacket.__name__.startswith("_foreach") and args and isinstance(args[0], (list, tuple)):
            self.per_tensor += len(args[0])
        else:
            self.per_tensor += 1
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        written = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema.arguments)
                   if a.alias_info is not None and a.alias_info.is_write]
        outs = out if len(schema.returns) > 1 else (out,)  # one return may be a list (Tensor[])
        fresh = [o for o, r in zip(outs, schema.returns) if r.alias_info is None]
        self.bytes += _tensor_bytes((args, kwargs)) + _tensor_bytes((written, fresh))
        return out


def _tensor_bytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(x) for x in tree)
    if isinstance(tree, dict):
        return sum(_tensor_bytes(x) for x in tree.values())
    return 0


TINY = dict(dim=16, n_heads=2, ffn_hidden=32, vocab_size=32, max_seq_len=8)
TINY_MOE = dict(n_experts=4, top_k=2, moe_ffn_hidden=32)
"""Rows of 16 and 32 fp32 values: 16-byte aligned, so the experts run as torch._grouped_mm (moe.grouped_mm_supported),
as they do on a GPU in bf16."""


def tiny_args(args: ModelArgs, n_layers: int = 1) -> ModelArgs:
    """`args` at a size where the arithmetic is negligible, with the same code paths (GQA, tied embeddings; of a
    mixture of experts the MoE structure, operators.moe_structure, with every block an MoE block)."""
    moe = {}
    if args.n_experts:
        moe = dict(TINY_MOE, n_shared_experts=min(1, args.n_shared_experts), score_func=args.score_func,
                   route_norm=args.route_norm, route_scale=args.route_scale, capacity_factor=args.capacity_factor,
                   aux_loss_coeff=args.aux_loss_coeff, z_loss_coeff=args.z_loss_coeff)
    return ModelArgs(name="opcount", n_layers=n_layers, n_kv_heads=1 if args.n_kv_heads < args.n_heads else 2,
                     tie_embeddings=args.tie_embeddings, **TINY, **moe)


def micro_batch(model: Transformer, args: ModelArgs, precision: str = "fp32") -> None:
    """One forward + backward as the engine runs it (shardwise.train.loss_sum: summed token cross-entropy, the head
    fused with it, as the engine runs a plain head: shardwise.model.fuse_head_loss), under the precision's
    autocast."""
    tokens = torch.randint(0, args.vocab_size, (1, args.max_seq_len))
    fuse_head_loss(model)
    with autocast_context(precision, torch.device("cpu")):
        out = model(tokens, targets=tokens) if model.fused_loss else model(tokens)
    (out if model.fused_loss else token_loss_sum(out, tokens)).backward()


def optimizer_step(model: Transformer, optimizer: torch.optim.Optimizer) -> None:
    """The engine's own optimizer step (shardwise.train.optimizer_step, fp32: gradient norm, clipping, AdamW,
    zero_grad) with clipping active, as whenever the norm exceeds the threshold (early training; the planner's
    benchmark runs): the step's dearest case, one more pass over the gradients."""
    from shardwise.train import optimizer_step as engine_step  # the trainer's imports are heavy: only here

    engine_step(list(model.parameters()), optimizer, _NO_SCALER, grad_clip=CLIP_ALWAYS, loss=torch.zeros(()))


_NO_SCALER = torch.amp.GradScaler("cpu", enabled=False)
CLIP_ALWAYS = 1e-12
"""A clipping threshold below any gradient norm of a step that learns: the step scales every gradient."""


def _count(fn) -> OpCounter:
    with OpCounter() as c:
        fn()
    return c


@functools.cache
def _moe_counts(base: ModelArgs) -> tuple[int, float, int]:
    """(operators, operators per routed expert, parameter tensors) of one MoE block of `base`'s structure beyond a
    dense block's: a block counted as the difference between a 2-block and a 1-block model, as _counts does, with
    4 and with 8 experts (the capacity's cut runs once per expert)."""
    blocks = []
    for n_experts in (4, 8):
        torch.manual_seed(0)
        one, two = (Transformer(dataclasses.replace(tiny_args(base, n), n_experts=n_experts)) for n in (1, 2))
        micro_batch(one, one.args)  # warm-up
        calls = [_count(lambda: micro_batch(model, model.args)).calls for model in (two, one)]
        blocks.append(calls[0] - calls[1])
    dense = _counts(base.n_kv_heads < base.n_heads, base.tie_embeddings)
    per_expert = (blocks[1] - blocks[0]) / 4
    return (round(blocks[0] - 4 * per_expert) - dense.block, per_expert,
            len(list(one.layers["0"].parameters())) - dense.tensors_per_block)


def linear_calls(module: torch.nn.Module, precision: str = "fp32") -> int:
    """Operators of one forward + backward of a linear `module` (of TINY's width) on an fp32 activation under the
    precision's autocast."""
    leaf = torch.randn(1, 8, TINY["dim"], requires_grad=True)

    def run(module: torch.nn.Module | None):
        x = leaf.clone()  # an activation, as in a block: autocast caches its casts of leaves (weights) only
        with autocast_context(precision, torch.device("cpu")):
            y = module(x) if module is not None else x
        y.sum().backward()

    run(module)  # warm-up
    return _count(lambda: run(module)).calls - _count(lambda: run(None)).calls


@functools.cache
def _counts(gqa: bool, tied: bool, precision: str = "fp32") -> OpCounts:
    """OpCounts of the structure: the micro-batch's under the precision's autocast (with bf16, each matmul casts its
    input and its fp32 weight, and backward casts their gradients back); the optimizer's, outside autocast as the
    engine steps, the same in every precision."""
    base = ModelArgs(n_heads=2, n_kv_heads=1 if gqa else 2, tie_embeddings=tied)
    torch.manual_seed(0)
    one, two = (Transformer(tiny_args(base, n)) for n in (1, 2))
    micro_batch(one, one.args, precision)  # warm-up: first calls take one-off paths
    n1 = _count(lambda: micro_batch(one, one.args, precision)).calls
    n2 = _count(lambda: micro_batch(two, two.args, precision)).calls
    block = n2 - n1
    lin = linear_calls(torch.nn.Linear(TINY["dim"], TINY["dim"], bias=False), precision)
    if precision != "fp32":
        return dataclasses.replace(_counts(gqa, tied), block=block, rest=n1 - block, linear=lin)
    tensors_block = len(list(one.layers["0"].parameters()))
    tensors_rest = len(list(one.parameters())) - tensors_block
    opt_counts = []
    for model in (one, two):
        opt = build_optimizer(model, OptimConfig(), lr=1e-3)
        micro_batch(model, model.args)
        optimizer_step(model, opt)  # the first step creates the states
        micro_batch(model, model.args)
        opt_counts.append(_count(lambda: optimizer_step(model, opt)))
    per_tensor = (opt_counts[1].per_tensor - opt_counts[0].per_tensor) / tensors_block
    block_params = sum(p.numel() for p in one.layers["0"].parameters())
    bytes_per_param = (opt_counts[1].bytes - opt_counts[0].bytes) / block_params  # the extra block's
    return OpCounts(block=block, rest=n1 - block, linear=lin, optimizer_calls=opt_counts[0].calls,
                    optimizer_per_tensor=per_tensor,
                    optimizer_fixed=opt_counts[0].per_tensor - per_tensor * (tensors_block + tensors_rest),
                    tensors_per_block=tensors_block, tensors_rest=tensors_rest,
                    optimizer_bytes_per_param=bytes_per_param)


@functools.cache
def lora_op_counts(dropout: bool, precision: str = "fp32") -> LoraOps:
    """What LoRA (shardwise.lora) changes in the operators of a micro-batch's forward + backward, counted as
    OP_COUNTS are (a block as a 2-block model less a 1-block one, under the precision's autocast) on the engine's
    model with one projection a block adapted (wo, then wq: the difference is an fp32 input's cast,
    operators.CAST_INPUTS) and with all seven: the difference is six adapters' operators, and what the block
    loses with its frozen weights follows. `dropout`: adapters with dropout on their input (lora.dropout > 0)."""
    from shardwise.config import LoraConfig
    from shardwise.lora import LoRALinear, apply_lora
    from shardwise.model import materialize
    from shardwise.model_args import PROJECTIONS

    base = ModelArgs(n_heads=2, n_kv_heads=1)
    p = 0.1 if dropout else 0.0

    def counts(targets: tuple[str, ...]) -> tuple[int, int]:
        """(block, rest) of a LoRA model adapting `targets` in every block."""
        calls = []
        for n_layers in (1, 2):
            args = tiny_args(base, n_layers)
            torch.manual_seed(0)
            model = Transformer(args)
            apply_lora(model, LoraConfig(rank=2, dropout=p, targets=list(targets)), torch.float32)
            materialize(model, args, "cpu", 0)
            micro_batch(model, args, precision)  # warm-up
            calls.append(_count(lambda: micro_batch(model, args, precision)).calls)
        return calls[1] - calls[0], 2 * calls[0] - calls[1]

    (one, _), (cast, _), (seven, rest) = counts(("wo",)), counts(("wq",)), counts(PROJECTIONS)
    input_cast = cast - one
    per_adapter, uneven = divmod(seven - one - input_cast * len(CAST_INPUTS), len(PROJECTIONS) - 1)
    assert not uneven, "the adapters of a block differ in more than their inputs' casts"
    dense = _counts(True, False, precision)

    torch.manual_seed(0)
    adapted = LoRALinear(TINY["dim"], TINY["dim"], rank=2, alpha=16.0, dropout=p)
    with torch.no_grad():
        for param in adapted.parameters():
            param.normal_()
    adapted.weight.requires_grad_(False)
    frozen = torch.nn.Linear(TINY["dim"], TINY["dim"], bias=False).requires_grad_(False)
    return LoraOps(per_adapter=per_adapter, input_cast=input_cast, frozen_block=dense.block - (one - per_adapter),
                   rest=rest - dense.rest,
                   adapted_linear=linear_calls(adapted, precision), frozen_linear=linear_calls(frozen, precision))


@functools.cache
def qlora_dequant_counts(precision: str, dim: int = 256) -> tuple[float, float, float, float]:
    """What QLoRA adds to a block's forward + backward, per NF4 weight: (forward operators per adapted linear,
    forward bytes per weight, backward operators per adapted linear, backward bytes per weight).

    Counted as the difference between the engine's own block (shardwise.lora, shardwise.nf4: torchao's NF4Tensor,
    dequantised by `F.linear` in forward and again in backward, each time by a chain of eager kernels: unpack the
    4-bit codes to int64 indices, look up the NF4 table, rescale by the dequantised block constants, interleave,
    cast) with QLoRA and with plain LoRA, under the precision's autocast; at a size where every linear is whole
    NF4 blocks. Everything else the two blocks do is the same, so the difference is the dequantisation's."""
    from shardwise.config import LoraConfig
    from shardwise.lora import apply_lora
    from shardwise.loss import autocast_context, compute_dtype
    from shardwise.model import materialize

    def block(qlora: bool) -> list[int]:
        """(forward calls, forward bytes, backward calls, backward bytes) of the second of two blocks: the first
        block's inputs need no gradient (the embedding is frozen), so it skips the input-gradient matmuls."""
        per_depth = []
        for n_layers in (1, 2):
            args = ModelArgs(name="opcount", dim=dim, n_layers=n_layers, n_heads=2, n_kv_heads=2, ffn_hidden=dim,
                             vocab_size=32, max_seq_len=8)
            torch.manual_seed(0)
            model = Transformer(args)
            apply_lora(model, LoraConfig(rank=2, qlora=qlora), compute_dtype(precision))
            materialize(model, args, "cpu", 0)
            tokens = torch.randint(0, args.vocab_size, (1, args.max_seq_len))

            def forward():
                with autocast_context(precision, torch.device("cpu")):
                    return token_loss_sum(model(tokens), tokens)

            forward().backward()  # warm-up
            fwd = _count(forward)
            bwd = _count(forward().backward)
            per_depth.append([fwd.calls, fwd.bytes, bwd.calls, bwd.bytes])
        return [two - one for one, two in zip(*per_depth)]

    weights = 7 * dim * dim  # the block's seven linears, all dim x dim here
    (fc, fb, bc, bb), (qfc, qfb, qbc, qbb) = block(False), block(True)
    return (qfc - fc) / 7, (qfb - fb) / weights, (qbc - bc) / 7, (qbb - bb) / weights


def live_op_counts(args: ModelArgs, precision: str = "fp32") -> OpCounts:
    """Operator counts of `args`'s structure under the precision's autocast, counted now on this torch (once per
    structure, a fraction of a second); the planner reads the same numbers from operators.OP_COUNTS (and
    MOE_OP_COUNTS, counted in fp32) without torch."""
    dense = _counts(args.n_kv_heads < args.n_heads, args.tie_embeddings, precision)
    if not args.n_experts:
        return dense
    ops, per_expert, tensors = _moe_counts(_moe_base(args, moe_structure(args)))
    return dataclasses.replace(dense, moe_block=round(dense.block + ops + per_expert * args.n_experts),
                               tensors_per_moe_block=dense.tensors_per_block + tensors)


def _moe_base(args: ModelArgs, structure: tuple[bool, bool, bool, bool, bool]) -> ModelArgs:
    route_norm, shared, capacity, aux_loss, z_loss = structure
    return ModelArgs(n_heads=2, n_kv_heads=1 if args.n_kv_heads < args.n_heads else 2,
                     tie_embeddings=args.tie_embeddings, n_experts=TINY_MOE["n_experts"], score_func=args.score_func,
                     route_norm=route_norm, n_shared_experts=int(shared), capacity_factor=1.0 if capacity else 0.0,
                     aux_loss_coeff=0.01 if aux_loss else 0.0, z_loss_coeff=0.001 if z_loss else 0.0)


def moe_op_table() -> dict[tuple[bool, bool, bool, bool, bool], tuple[int, float, int]]:
    """operators.MOE_OP_COUNTS as counted on this torch and this shardwise.moe (print it to pin it again)."""
    structures = itertools.product((True, False), repeat=5)
    return {s: _moe_counts(_moe_base(ModelArgs(n_heads=2, n_kv_heads=1), s)) for s in structures}


NOT_ELEMENTWISE = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
                   "_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention",
                   "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention",
                   "_scaled_dot_product_cudnn_attention_backward", "cpu_causal_attention",
                   "cpu_causal_attention_backward"}
"""Operators the time model prices on their own: the matmuls (by shape) and the attention kernel."""
NO_TRAFFIC = {"_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
"""Operators that move no data and whose schema does not say so: a view without an alias annotation, and
allocations (their output is written by the next operator, which is counted)."""


class ElementwiseCounter(OpCounter):
    """Bytes read and written by the operators that are neither matmuls nor attention nor views (an operator that
    returns an alias of an input without writing it moves nothing; an in-place or out= one is counted): what eager
    PyTorch spends memory bandwidth on besides the GEMMs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if (name in NOT_ELEMENTWISE or name in NO_TRAFFIC
                or any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def block_elementwise_bytes(precision: str, dim: int, n_heads: int, n_kv_heads: int, ffn: int,
                            head_dim: int = 0) -> tuple[float, float]:
    """(forward, backward) bytes per token of one dense block's elementwise operators on the engine's model, under
    the precision's autocast: a 2-block model less a 1-block one (one block), at 2 x 64 tokens less at 2 x 32 (per
    token: what does not scale with tokens, weight casts and weight gradients, drops out). `head_dim`: the heads'
    width where it is not dim // n_heads (ModelArgs.attn_head_dim)."""
    from shardwise.loss import autocast_context

    counts = {}
    for n_layers, seq in itertools.product((1, 2), (32, 64)):
        args = ModelArgs(name="opcount", dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                         ffn_hidden=ffn, vocab_size=32, max_seq_len=seq, attn_head_dim=head_dim)
        torch.manual_seed(0)
        model = Transformer(args)
        fuse_head_loss(model)
        tokens = torch.randint(0, args.vocab_size, (2, seq))

        def forward():
            with autocast_context(precision, torch.device("cpu")):
                return model(tokens, targets=tokens) if model.fused_loss else token_loss_sum(model(tokens), tokens)

        forward().backward()  # warm-up
        model.zero_grad(set_to_none=True)
        with ElementwiseCounter() as fwd:
            loss = forward()
        with ElementwiseCounter() as bwd:
            loss.backward()
        counts[n_layers, seq] = (fwd.bytes, bwd.bytes)
    return tuple((counts[2, 64][i] - counts[1, 64][i] - counts[2, 32][i] + counts[1, 32][i]) / (2 * 32)
                 for i in (0, 1))


@functools.cache
def elementwise_traffic(precision: str) -> Elementwise:
    """operators.ELEMENTWISE[precision] as counted now: bytes per token of one dense block's eager elementwise
    operators (RMSNorms, RoPE, SwiGLU, residual adds, autocast's casts), forward and backward, as coefficients of
    (dim, q dim, kv dim, ffn hidden, head_dim, 1), and per dim element the two RMSNorms as the engine runs them on
    a CPU and in torch's composite form (both counted apart on one norm).

    Counted by block_elementwise_bytes at shapes that move dim (with the heads: head_dim 16), the query heads at
    a fixed head width (ModelArgs.attn_head_dim), KV heads, ffn hidden and head_dim one at a time from a base.
    Every operator's tensors are one of these widths per token (the residual stream's dim; the queries' and the
    attention output's n_heads x head_dim; RoPE's cos and sin tables: a head_dim) or a scalar per token (the
    norms' statistics), so the six solve it."""
    base, wide, queries, kv, ffn, heads = (block_elementwise_bytes(precision, *shape) for shape in (
        (64, 4, 2, 96), (128, 8, 4, 96), (64, 6, 2, 96, 16), (64, 4, 4, 96), (64, 4, 2, 160), (64, 2, 1, 96)))
    coefficients = []
    for i in (0, 1):
        per_kv = (kv[i] - base[i]) / 32
        per_ffn = (ffn[i] - base[i]) / 64
        per_q = (queries[i] - base[i]) / 32  # 6 heads of 16 on a dim of 64: only the queries' width moves
        per_dim = (wide[i] - base[i] - 32 * per_kv - 64 * per_q) / 64  # dim 64 -> 128 moves q and kv with it
        per_head_dim = (heads[i] - base[i]) / 16  # half the heads of twice the size: only head_dim moves
        per_token = (base[i] - 64 * per_dim - 64 * per_q - 32 * per_kv - 96 * per_ffn
                     - 16 * per_head_dim)  # statistics (rstd)
        coefficients.append((per_dim, per_q, per_kv, per_ffn, per_head_dim, per_token))
    norms = []
    for kind in (RMSNorm, torch.nn.RMSNorm):  # the engine's, and torch's composite form
        norm = {}  # one RMSNorm's (forward, backward) bytes at width 64 and 128, over 64 and 128 tokens
        for width, tokens in itertools.product((64, 128), (64, 128)):
            x = torch.randn(2, tokens // 2, width, requires_grad=True)
            with ElementwiseCounter() as norm_fwd:
                y = kind(width, eps=1e-5)(x)
            with ElementwiseCounter() as norm_bwd:
                y.sum().backward()
            norm[width, tokens] = (norm_fwd.bytes, norm_bwd.bytes)
        # the block's two norms, per token (the weight's reads drop out) and dim element (the statistics drop out)
        norms += [2 * (norm[128, 128][i] - norm[64, 128][i] - norm[128, 64][i] + norm[64, 64][i]) / (64 * 64)
                  for i in (0, 1)]
    return Elementwise(*coefficients, *norms)
