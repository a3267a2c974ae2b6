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

import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    name: str = "debug"
    """Preset the shape came from (see PRESETS), or a name of your own for a custom shape."""
    dim: int = 128
    """Hidden size d."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads; must divide dim."""
    n_kv_heads: int = 2
    """Key/value heads for grouped-query attention; must divide n_heads (= n_heads for plain multi-head)."""
    vocab_size: int = 512
    """Rows of the embedding and output head; at least the tokenizer's vocabulary."""
    ffn_hidden: int = 384
    """Inner size of the SwiGLU MLP."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    max_seq_len: int = 2048
    """Longest sequence the rotary table covers."""
    tie_embeddings: bool = False
    """Share the token-embedding matrix with the output head."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def _preset(name: str, **kw) -> ModelArgs:
    return ModelArgs(name=name, **kw)


# Published shapes. Llama 3: Dubey et al. 2024, table 3 (and the released config.json files); Llama 2: Touvron
# et al. 2023. GPT-3 175B (Brown et al. 2020: 96 layers, d 12288, 96 heads) is given our SwiGLU block with the
# inner size 8/3 d that keeps the MLP's parameter count at GPT-3's 8 d^2.
PRESETS: dict[str, ModelArgs] = {
    p.name: p
    for p in [
        _preset("debug"),
        _preset("tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, ffn_hidden=192,
                max_seq_len=256),
        _preset("llama3.2-1b", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                ffn_hidden=8192, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True),
        _preset("llama3.2-3b", dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
                ffn_hidden=8192, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True),
        _preset("llama2-7b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                ffn_hidden=11008, max_seq_len=4096),
        _preset("llama2-70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                ffn_hidden=28672, max_seq_len=4096),
        _preset("llama3-8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                ffn_hidden=14336, rope_theta=500000.0, max_seq_len=8192),
        _preset("llama3-70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                ffn_hidden=28672, rope_theta=500000.0, max_seq_len=8192),
        _preset("llama3-405b", dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                ffn_hidden=53248, rope_theta=500000.0, max_seq_len=8192),
        _preset("gpt3-175b", dim=12288, n_layers=96, n_heads=96, n_kv_heads=96, vocab_size=50257,
                ffn_hidden=32768, max_seq_len=2048, tie_embeddings=True),
    ]
}


def preset(name: str, **overrides) -> ModelArgs:
    """A preset shape, optionally with fields replaced."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


# ---------------------------------------------------------------------------------------------------
# Sizes and FLOPs, from the shape alone (the planner uses these without building anything)


def num_params(args: ModelArgs, *, embedding: bool = True) -> int:
    """Parameter count; embedding=False leaves out the input embedding table (it does no matmul)."""
    d, kv = args.dim, args.n_kv_heads * args.head_dim
    attn = d * d + 2 * d * kv + d * d
    mlp = 3 * d * args.ffn_hidden
    per_layer = attn + mlp + 2 * d
    emb = args.vocab_size * d
    head = 0 if args.tie_embeddings else args.vocab_size * d
    total = args.n_layers * per_layer + d + head + emb
    if not embedding:
        # with tied weights the shared matrix still does the output matmul, so it stays in
        total -= 0 if args.tie_embeddings else emb
    return total


def flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token: 6 N + 12 L d s (Kaplan et al.; Chinchilla appendix F).

    N counts the weights that take part in a matmul (every linear layer and the output head, not the
    embedding lookup or the norms); 12 L d s is the attention-score and attention-value matmuls, forward and
    backward, counted without the causal mask's saving, as the PaLM MFU definition does.
    """
    matmul_params = num_params(args, embedding=False) - (2 * args.n_layers + 1) * args.dim
    return 6.0 * matmul_params + 12.0 * args.n_layers * args.dim * seq_len


# ---------------------------------------------------------------------------------------------------
# Modules


def rotary_table(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """cos and sin of every (position, frequency), shape (2, max_seq_len, head_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) by the table rows of its positions (rope: (2, seq, head_dim))."""
    cos, sin = rope[0].to(x.dtype), rope[1].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over (batch, heads, seq, head_dim); k and v may have fewer (grouped) heads."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


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
        q = self.wq(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        # the table may be longer than this sequence (the whole rotary table, when the caller cannot know the
        # sequence length: under sequence parallelism the block's input holds 1/tp of it)
        rope = rope[:, :seq]
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        out = self.attention_fn(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # recomputed, never saved: it is a function of the shape, so checkpoints carry only weights
        self.register_buffer("rope", rotary_table(args.head_dim, args.max_seq_len, args.rope_theta), persistent=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head; call again after anything that replaces parameters."""
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for (batch, seq) token ids; `positions` (seq,) selects rotary rows when the sequence is a slice.

        A pipeline stage may have no embedding (it then takes hidden states) or no output head (it then
        returns hidden states); on one device both are present.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope if positions is None else self.rope[:, positions]
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


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
    Output head: N(0, dim^-0.5). Norm weights: ones.
    """
    name = canonical_name(name)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(("wo.weight", "w2.weight")):
        std = 0.02 / math.sqrt(2 * args.n_layers)
    elif name == "output.weight":
        std = args.dim**-0.5
    else:
        std = 0.02
    return torch.empty(shape).normal_(0.0, std, generator=param_generator(seed, name))


@torch.no_grad()
def materialize(model: nn.Module, args: ModelArgs, device: torch.device | str, seed: int) -> None:
    """Allocate a meta-device model on `device` and give every parameter its (seed, name) initial value.

    Parameters that are DTensors (sharded by tensor parallelism or FSDP) receive just their local piece of
    the full value, so every layout starts from the numbers the single-device model starts from.
    """
    model.to_empty(device=device)
    if isinstance(model, Transformer):
        model.tie_weights()
        model.rope = rotary_table(args.head_dim, args.max_seq_len, args.rope_theta, device=device)
    for name, param in model.named_parameters():
        full = init_value(args, name, param.shape, seed)
        param.copy_(_local_piece(param, full).to(param.dtype))


def _local_piece(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # distribute_tensor with src_data_rank=None slices locally: no communication, no random numbers
        return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return full.to(param.device)
