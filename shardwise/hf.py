"""Hugging Face Llama interchange: config and parameter names, both ways.

Our rotary embedding uses the same "rotate half" layout as `transformers`' Llama, so weights map one to one
with no permutation of the query/key rows. `export_hf` writes a folder `LlamaForCausalLM.from_pretrained` loads;
`import_hf` reads such a folder (safetensors only: no pickles) into a model under any parallel layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import torch

from shardwise.model_args import ModelArgs, args_from_hf_config

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


# ---------------------------------------------------------------------------------------------------
# Folders of safetensors + config.json, as `LlamaForCausalLM.save_pretrained` writes and `from_pretrained` reads

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


def _full(param):
    from torch.distributed.tensor import DTensor

    return param.full_tensor() if isinstance(param, DTensor) else param


def export_hf(parts, args: ModelArgs, folder: str | os.PathLike, runtime=None) -> None:
    """Write the model as a Hugging Face Llama folder (collective: every rank calls it).

    Sharded parameters are gathered (DTensor.full_tensor); one rank per pipeline stage writes that stage's
    safetensors file (model.safetensors with one stage, else model-0000k-of-0000n.safetensors and an index).
    Tied embeddings are written once, as transformers does.
    """
    import torch.distributed as dist
    from safetensors.torch import save_file

    from shardwise.model import canonical_name

    folder = Path(folder)
    pp_rank, pp_size = (runtime.pp_rank, runtime.pp_size) if runtime is not None else (0, 1)
    writes = runtime.writes_stage_files if runtime is not None else True
    main = runtime.is_main if runtime is not None else True
    tensors = {}
    for part in parts:
        for name, param in part.named_parameters():
            tensors[to_hf_name(canonical_name(name))] = _full(param).detach().to("cpu", copy=True).contiguous()
    file = SINGLE_FILE if pp_size == 1 else f"model-{pp_rank + 1:05d}-of-{pp_size:05d}.safetensors"
    if writes:
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    mine = ({n: file for n in tensors}, size) if writes else ({}, 0)
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)  # after every writer wrote: the index names finished files
    if main:
        folder.mkdir(parents=True, exist_ok=True)
        if pp_size > 1:
            weight_map = {k: v for names, _ in everyone for k, v in names.items()}
            index = {"metadata": {"total_size": sum(size for _, size in everyone)}, "weight_map": weight_map}
            (folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True))
        (folder / "config.json").write_text(json.dumps(hf_config(args), indent=2))


def _hf_files(folder: Path) -> list[Path]:
    if (folder / INDEX_FILE).is_file():
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    raise FileNotFoundError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; fix: point at a folder "
                            "written by save_pretrained (safetensors) or export_hf")


def import_hf(parts, folder: str | os.PathLike) -> ModelArgs:
    """Load a Hugging Face Llama folder (local safetensors, no pickles) into a built model of any layout.

    Every rank reads the full tensors it needs and keeps its local piece (DTensor parameters get the slice of
    the full value their placement says, as `materialize` does); no communication. Returns the folder's shape;
    ValueError when it is not the model's shape or a parameter is missing.
    """
    from safetensors import safe_open

    folder = Path(folder)
    theirs = args_from_hf_config(json.loads((folder / "config.json").read_text()))
    ours = parts[0].args
    fields = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "tie_embeddings")
    diffs = [f"{f} {getattr(theirs, f)} vs {getattr(ours, f)}"
             for f in fields if getattr(theirs, f) != getattr(ours, f)]
    if diffs:
        raise ValueError(f"{folder} holds another model shape (folder vs this model: {', '.join(diffs)}); "
                         "fix: build the model from the folder's config (args_from_hf_config)")
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(str(f), framework="pt")) for f in _hf_files(folder)]
        _copy_into(parts, {key: f for f in files for key in f.keys()}, folder)
    return theirs


@torch.no_grad()
def _copy_into(parts, where: dict, folder: Path) -> None:
    """Each parameter's local piece of the full tensor of the same (Hugging Face) name."""
    from shardwise.model import _local_piece, canonical_name

    for part in parts:
        for name, param in part.named_parameters():
            key = to_hf_name(canonical_name(name))
            if key not in where:
                raise ValueError(f"{folder} has no tensor {key!r} (our {canonical_name(name)})")
            full = where[key].get_tensor(key)
            if tuple(full.shape) != tuple(param.shape):
                raise ValueError(f"{folder}: {key} has shape {tuple(full.shape)}, the model {tuple(param.shape)}")
            param.copy_(_local_piece(param, full.to(param.dtype)))
