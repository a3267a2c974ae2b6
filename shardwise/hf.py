"""Hugging Face Llama interchange: config and parameter names, both ways.

Our rotary embedding uses the same "rotate half" layout as `transformers`' Llama, so weights map one to one
with no permutation of the query/key rows.
"""

from __future__ import annotations

import re

from shardwise.model import ModelArgs

# ours -> transformers, for the per-layer parameters ({i} is the layer index)
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def to_hf_name(name: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise KeyError(f"no Hugging Face name for parameter {name!r}")


def from_hf_name(name: str) -> str:
    for ours, theirs in _TOP_NAMES.items():
        if name == theirs:
            return ours
    m = _HF_LAYER.fullmatch(name)
    if m:
        for ours, theirs in _LAYER_NAMES.items():
            if m.group(2) == theirs:
                return f"layers.{m.group(1)}.{ours}"
    raise KeyError(f"unknown Hugging Face Llama parameter {name!r}")


def hf_config(args: ModelArgs) -> dict:
    """A `LlamaConfig` dict describing the same network."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def args_from_hf_config(cfg: dict, name: str = "hf") -> ModelArgs:
    """ModelArgs from a Llama-family config.json (as a dict); ValueError if it describes another network."""
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not SwiGLU's silu")
    n_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    if head_dim * n_heads != cfg["hidden_size"]:
        raise ValueError("head_dim * num_attention_heads != hidden_size is not supported")
    return ModelArgs(
        name=name,
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        vocab_size=cfg["vocab_size"],
        ffn_hidden=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )
