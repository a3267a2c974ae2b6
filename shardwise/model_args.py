"""The model's shape (ModelArgs), the published presets, and what follows from the shape alone: parameter
count, FLOPs per token, and the mapping from a Hugging Face config.json.

No torch here: the planner sizes and times models from these without building anything.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from shardwise.frozen import hashed_once


@hashed_once
@dataclass(frozen=True)
class ModelArgs:
    name: str = "debug"
    """Preset the shape came from (see PRESETS), or a name of your own for a custom shape (a config then gives
    at least dim, n_layers, n_heads and vocab_size: config.CUSTOM_SHAPE)."""
    dim: int = 128
    """Hidden size d."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads; must divide dim unless attn_head_dim is set."""
    n_kv_heads: int = 2
    """Key/value heads for grouped-query attention; must divide n_heads (= n_heads for plain multi-head)."""
    attn_head_dim: int = 0
    """Width of one attention head (Hugging Face's head_dim); 0: dim // n_heads, as in Llama. Qwen3 (128 on hidden
    sizes of 2048 to 4096 with 32 to 64 heads) and Mistral NeMo (128 on 5120 with 32) set it: the queries are then
    n_heads x attn_head_dim wide (q_dim), not dim."""
    vocab_size: int = 512
    """Rows of the embedding and output head; at least the tokenizer's vocabulary."""
    ffn_hidden: int = 384
    """Inner size of the SwiGLU MLP."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """The dense MLP: SwiGLU (w1 gate, w3 up, w2 down: Llama), or 'gelu', two matrices d -> ffn_hidden -> d with a
    GELU between (GPT-3, OPT, BLOOM, MPT). 'gelu' is for the planner, to size published runs of those models; the
    engine builds SwiGLU only and refuses it (config.model.mlp)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rope_scaling_factor: float = 0.0
    """Llama 3.1's rotary frequency scaling (Hugging Face rope_type 'llama3'): the factor the low frequencies are
    divided by (Llama 3.1: 8, Llama 3.2: 32); 0: plain rotary embedding. With the next three fields."""
    rope_low_freq_factor: float = 1.0
    """Frequencies of wavelengths above rope_original_max_seq_len / this are divided by rope_scaling_factor."""
    rope_high_freq_factor: float = 4.0
    """Frequencies of wavelengths below rope_original_max_seq_len / this are kept; those between are blended."""
    rope_original_max_seq_len: int = 8192
    """The context the model was pre-trained at before its context was extended (Llama 3.1 and 3.2: 8192)."""
    max_seq_len: int = 2048
    """Longest sequence the rotary table covers."""
    tie_embeddings: bool = False
    """Share the token-embedding matrix with the output head."""
    # mixture of experts (a block's MLP replaced by routed experts; see shardwise.moe)
    n_experts: int = 0
    """Routed experts per MoE block; 0: every block has the dense SwiGLU MLP."""
    top_k: int = 2
    """Experts each token is routed to (token choice)."""
    moe_ffn_hidden: int = 0
    """Inner size of each expert's SwiGLU MLP; 0: ffn_hidden."""
    n_shared_experts: int = 0
    """Experts every token also goes through, unrouted (DeepSeekMoE's shared experts), each of moe_ffn_hidden."""
    n_dense_layers: int = 0
    """The first blocks keep the dense MLP of ffn_hidden (DeepSeek-V3: 3)."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over experts (Mixtral, Qwen3-MoE) or a sigmoid each (DeepSeek-V3)."""
    router_dtype: Literal["auto", "fp32"] = "auto"
    """The router's matmul: 'auto' in the compute dtype (bf16 under bf16 autocast, as torchtitan's gate), or 'fp32'
    (Megatron-Core's --moe-router-dtype fp32), whose expert choices bf16's rounding of the logits does not move.
    The scores, the top-k and the weights are fp32 either way."""
    route_norm: bool = True
    """Renormalise a token's top-k scores to sum to 1 before they weight the experts' outputs (refused with top_k = 1:
    every weight would be 1, and the router would get no gradient)."""
    route_scale: float = 1.0
    """Multiplies the combine weights (DeepSeek-V3's routed scaling factor, 2.5)."""
    capacity_factor: float = 0.0
    """0: dropless. Else an expert takes at most ceil(capacity_factor x tokens x top_k / n_experts) of a rank's
    micro-batch tokens in training (GShard, Switch); the rest skip it and are counted as dropped."""
    aux_loss_coeff: float = 0.0
    """Load-balancing loss alpha x n_experts x sum_i f_i P_i (Switch Transformer), per sequence; 0: off."""
    z_loss_coeff: float = 0.0
    """Router z-loss: this x the mean over a sequence's tokens of logsumexp(router logits)^2 (ST-MoE, Zoph et al.
    2022, eq. 5: it keeps the logits small, so the router's softmax stays out of fp32 and bf16 rounding; 1e-3
    there; Megatron-Core's --moe-z-loss-coeff), per sequence as the balancing loss; 0: off."""
    bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each step an expert's routing bias rises by this much if
    it took fewer tokens than the mean, falls if more; 0: off (the bias stays 0)."""

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def q_dim(self) -> int:
        """Width of the queries and of the attention's output (wq's output, wo's input): n_heads x head_dim, which
        is dim unless attn_head_dim sets the head width apart from it."""
        return self.n_heads * self.head_dim

    @property
    def expert_hidden(self) -> int:
        return self.moe_ffn_hidden or self.ffn_hidden

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and layer >= self.n_dense_layers

    @property
    def n_moe_layers(self) -> int:
        return max(0, self.n_layers - self.n_dense_layers) if self.n_experts else 0


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
                ffn_hidden=8192, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True,
                rope_scaling_factor=32.0),
        _preset("llama3.2-3b", dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
                ffn_hidden=8192, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True,
                rope_scaling_factor=32.0),
        _preset("llama2-7b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                ffn_hidden=11008, max_seq_len=4096),
        _preset("llama2-70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                ffn_hidden=28672, max_seq_len=4096),
        _preset("llama3-8b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                ffn_hidden=14336, rope_theta=500000.0, max_seq_len=8192),
        _preset("llama3-70b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                ffn_hidden=28672, rope_theta=500000.0, max_seq_len=8192),
        _preset("llama3-405b", dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                ffn_hidden=53248, rope_theta=500000.0, max_seq_len=8192, rope_scaling_factor=8.0),  # Llama 3.1's
        # mixtures of experts. Mixtral 8x7B: Jiang et al. 2024 and its config.json. Qwen3-30B-A3B (its
        # config.json): head_dim 128 on a hidden size of 2048 (32 query heads: 4096 wide); "-like": without its
        # per-head q/k norms. Their balancing losses are their config.json's router_aux_loss_coef (0.02 and
        # 0.001). The
        # DeepSeek-V3-like shape (DeepSeek-AI 2024, table of hyper-parameters) has GQA attention in place of MLA.
        _preset("debug-moe", n_experts=8, top_k=2, moe_ffn_hidden=96, n_shared_experts=1, n_dense_layers=1,
                aux_loss_coeff=0.01),  # Switch Transformer's alpha: without it the demo's bytes go to one expert
        _preset("mixtral-8x7b", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                ffn_hidden=14336, rope_theta=1e6, max_seq_len=32768, n_experts=8, top_k=2, aux_loss_coeff=0.02),
        _preset("qwen3-30b-a3b-like", dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, attn_head_dim=128,
                vocab_size=151936,
                ffn_hidden=6144, moe_ffn_hidden=768, rope_theta=1e6, max_seq_len=40960, norm_eps=1e-6,
                n_experts=128, top_k=8, aux_loss_coeff=0.001),
        _preset("deepseek-v3-like", dim=7168, n_layers=61, n_heads=128, n_kv_heads=8, vocab_size=129280,
                ffn_hidden=18432, moe_ffn_hidden=2048, n_experts=256, top_k=8, n_shared_experts=1,
                n_dense_layers=3, score_func="sigmoid", route_scale=2.5, max_seq_len=4096,
                bias_update_rate=0.001),
        # Mistral NeMo 12B (Mistral AI and NVIDIA, 2024; its config.json): a Llama block with heads of 128 on a
        # hidden size of 5120 (32 query heads, 4096 wide), 128K context
        _preset("mistral-nemo-12b", dim=5120, n_layers=40, n_heads=32, n_kv_heads=8, attn_head_dim=128,
                vocab_size=131072, ffn_hidden=14336, rope_theta=1e6, max_seq_len=131072),
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


def mlp_params(args: ModelArgs, layer: int, *, active: bool = False) -> int:
    """Parameters of block `layer`'s MLP: the dense SwiGLU, or the router, the experts and the shared experts
    (active=True: only the top_k experts a token goes through)."""
    d = args.dim
    if not args.is_moe_layer(layer):
        return (2 if args.mlp == "gelu" else 3) * d * args.ffn_hidden
    experts = args.top_k if active else args.n_experts
    return d * args.n_experts + (experts + args.n_shared_experts) * 3 * d * args.expert_hidden


def count_text(n: float) -> str:
    """A parameter count as people write it: 8.03B, 0.92M (a tiny model's was printed as 0.00B)."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def num_params(args: ModelArgs, *, embedding: bool = True, active: bool = False) -> int:
    """Parameter count; embedding=False leaves out the input embedding table (it does no matmul); active=True
    counts, of a mixture of experts, the parameters one token uses (its top_k experts, not all of them)."""
    d, q, kv = args.dim, args.q_dim, args.n_kv_heads * args.head_dim
    attn = d * q + 2 * d * kv + q * d
    blocks = sum(attn + mlp_params(args, i, active=active) + 2 * d for i in range(args.n_layers))
    emb = args.vocab_size * d
    head = 0 if args.tie_embeddings else args.vocab_size * d
    total = blocks + d + head + emb
    if not embedding:
        # with tied weights the shared matrix still does the output matmul, so it stays in
        total -= 0 if args.tie_embeddings else emb
    return total


def network_fields(args: ModelArgs) -> list[str]:
    """The fields (or properties) of `args` that weights for it must agree on: what a checkpoint or a Hugging Face
    folder is checked against (the names, norm epsilon and rotary base may differ)."""
    fields = ["dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "tie_embeddings", "n_experts",
              "n_shared_experts", "n_dense_layers"]
    if args.n_moe_layers < args.n_layers:  # some block has the dense MLP
        fields.append("ffn_hidden")
    if args.n_experts:
        fields += ["expert_hidden", "top_k", "score_func", "route_norm", "route_scale"]
    return fields


def network_diffs(theirs: ModelArgs, ours: ModelArgs) -> list[tuple[str, object, object]]:
    """(field, theirs, ours) for each of network_fields(ours) on which weights made for `theirs` do not fit."""
    return [(f, getattr(theirs, f), getattr(ours, f)) for f in network_fields(ours)
            if getattr(theirs, f) != getattr(ours, f)]


PROJECTIONS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
"""A block's linears: attention (wq, wk, wv, wo) and MLP (w1 gate, w3 up, w2 down)."""


def projection_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    """(in, out) features of each of a block's linears, by their name in the model, in forward order: seven, or
    six for a GELU MLP (no w3)."""
    d, q, kv, f = args.dim, args.q_dim, args.n_kv_heads * args.head_dim, args.ffn_hidden
    shapes = {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d), "w1": (d, f), "w3": (d, f), "w2": (f, d)}
    if args.mlp == "gelu":
        del shapes["w3"]
    return shapes


def adapter_params(args: ModelArgs, rank: int, targets=PROJECTIONS) -> int:
    """LoRA's trainable parameters over the whole model: r (in + out) per adapted linear of every block."""
    shapes = projection_shapes(args)
    return args.n_layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)


def flops_per_token(args: ModelArgs, seq_len: int, adapter_params: float | None = None) -> float:
    """Training FLOPs (forward + backward) per token: 6 N + 12 L d_q s (Kaplan et al.; Chinchilla appendix F; d_q
    the queries' width, n_heads x head_dim, which is d unless attn_head_dim sets it apart).

    N counts the weights that take part in a matmul (every linear layer and the output head, not the
    embedding lookup or the norms; of a mixture of experts, the router and the top_k experts a token uses);
    12 L d_q s is the attention-score and attention-value matmuls, forward and backward, counted without the
    causal mask's saving, as the PaLM MFU definition does.
    With LoRA (`adapter_params`, the adapters' count) a frozen weight does the forward and the input-gradient
    matmuls but no weight gradient: 4 N, plus 6 per adapter parameter; the attention matmuls are all still done.
    """
    matmul_params = num_params(args, embedding=False, active=True) - (2 * args.n_layers + 1) * args.dim
    attention = 12.0 * args.n_layers * args.q_dim * seq_len
    if adapter_params is None:
        return 6.0 * matmul_params + attention
    return 4.0 * matmul_params + 6.0 * adapter_params + attention


_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
"""config.json keys that make a model a mixture of experts (Mixtral's, Qwen-MoE's and OLMoE's, DeepSeek's)."""


def args_from_hf_config(cfg: dict, name: str = "hf") -> ModelArgs:
    """ModelArgs from a Llama-family or Mixtral config.json (as a dict); ValueError if it describes another network."""
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    experts = next(((k, cfg[k]) for k in _EXPERT_KEYS if cfg.get(k)), None)
    if experts and cfg.get("model_type") != "mixtral":
        # Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek: read as a Llama, the model lost its experts without a word (a
        # Qwen1.5-MoE-A2.7B was planned as a dense 1.9B model (it has 14.3B))
        raise ValueError(f"model_type {cfg.get('model_type')!r} is a mixture of experts ({experts[0]} = "
                         f"{experts[1]}) that only a Mixtral config.json maps to here (read as a Llama it would "
                         "have no experts)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not SwiGLU's silu")
    sizes = (*required, "num_key_value_heads", "head_dim", "max_position_embeddings", "num_local_experts",
             "num_experts_per_tok", "sliding_window")
    for key in sizes:
        value = cfg.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{key} = {value!r} is not a positive whole number")
    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    if not cfg.get("head_dim") and cfg["hidden_size"] % n_heads:
        raise ValueError(f"num_attention_heads = {n_heads} does not divide hidden_size = {cfg['hidden_size']} and "
                         "head_dim is not given")
    if head_dim % 2:
        raise ValueError(f"head_dim = {head_dim} is odd: rotary embedding needs an even head width")
    mixtral = cfg.get("model_type") == "mixtral"
    # transformers 5 writes the base inside rope_parameters; a missing one is the model type's default
    rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta")
    max_seq_len = cfg.get("max_position_embeddings", 2048)
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        # over a sequence no longer than the window, sliding-window attention is plain causal attention
        max_seq_len = min(max_seq_len, cfg["sliding_window"])
    moe = dict(n_experts=cfg.get("num_local_experts", 8), top_k=cfg.get("num_experts_per_tok", 2),
               aux_loss_coeff=cfg.get("router_aux_loss_coef", 0.001)) if mixtral else {}
    kv = cfg.get("num_key_value_heads") or n_heads
    if n_heads % kv:
        raise ValueError(f"num_key_value_heads = {kv} does not divide num_attention_heads = {n_heads}")
    if moe and moe["top_k"] > moe["n_experts"]:
        raise ValueError(f"num_experts_per_tok = {moe['top_k']} > num_local_experts = {moe['n_experts']}")
    return ModelArgs(
        name=name,
        **_hf_llama3_scaling(cfg),
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=kv,
        attn_head_dim=0 if head_dim * n_heads == cfg["hidden_size"] else head_dim,
        vocab_size=cfg["vocab_size"],
        ffn_hidden=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=float(rope_theta or (1e6 if mixtral else 10000.0)),
        max_seq_len=max_seq_len,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **moe,
    )


def _hf_rope_parameters(cfg: dict) -> dict:
    """A Hugging Face config's rotary scaling parameters (transformers 5 writes them in rope_parameters, 4 in
    rope_scaling), {} for plain rotary."""
    for key in ("rope_parameters", "rope_scaling"):
        params = cfg.get(key)
        if isinstance(params, dict) and (params.get("rope_type") or params.get("type") or "default") != "default":
            return params
    return {}


def hf_rope_scaling(cfg: dict) -> str | None:
    """The rotary scaling a Hugging Face config.json (as a dict) asks for that the engine does not have ('linear',
    'dynamic', 'yarn', ...), None for plain rotary or Llama 3.1's 'llama3' (ModelArgs.rope_scaling_factor). Such a
    model's weights would run with other position encodings than they were trained with."""
    params = _hf_rope_parameters(cfg)
    kind = params.get("rope_type") or params.get("type")
    return None if not params or kind == "llama3" else str(kind)


def hf_biases(cfg: dict) -> str | None:
    """The biases a Hugging Face config.json (as a dict) gives the blocks' projections ('attention_bias = true',
    ...), None without: the engine's Llama has none, and importing such weights dropped them without a word."""
    flags = [f"{k} = true" for k in ("attention_bias", "mlp_bias") if cfg.get(k)]
    return " and ".join(flags) or None


def _hf_llama3_scaling(cfg: dict) -> dict:
    """ModelArgs' rotary scaling fields from a config whose rope_type is 'llama3' ({} otherwise)."""
    params = _hf_rope_parameters(cfg)
    if (params.get("rope_type") or params.get("type")) != "llama3":
        return {}
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if k not in params]
    if missing:
        raise ValueError(f"rope_type 'llama3' without {', '.join(missing)}")
    return {"rope_scaling_factor": float(params["factor"]),
            "rope_low_freq_factor": float(params["low_freq_factor"]),
            "rope_high_freq_factor": float(params["high_freq_factor"]),
            "rope_original_max_seq_len": int(params["original_max_position_embeddings"])}


ROPE_SCALING_FIELDS = ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                       "rope_original_max_seq_len")
HF_COMPUTE_FIELDS = ("norm_eps", "rope_theta", *ROPE_SCALING_FIELDS)
"""Fields that fit any weights but change what the network computes: a Hugging Face folder's weights were trained
with its own values (config.json's rms_norm_eps, rope_theta and Llama 3.1's rotary scaling)."""


def compute_diffs(theirs: ModelArgs, ours: ModelArgs) -> list[tuple[str, object, object]]:
    """(field, theirs, ours) for each of HF_COMPUTE_FIELDS on which the two differ."""
    return [(f, getattr(theirs, f), getattr(ours, f)) for f in HF_COMPUTE_FIELDS
            if not math.isclose(getattr(theirs, f), getattr(ours, f), rel_tol=1e-9)]


def head_rows(tokens: int, dim: int, vocab: int) -> int:
    """Rows per block of shardwise.loss.head_loss_sum: its logits no larger than the hidden states (Liger-Kernel's
    rule), and at least 128 rows (a narrower matmul wastes the accelerator)."""
    return min(tokens, max(128, -(-tokens * dim // vocab)))
