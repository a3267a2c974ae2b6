"""Hugging Face Llama and Mixtral interchange: config and parameter names, both ways.

Our rotary embedding uses the same "rotate half" layout as `transformers`' Llama, so weights map one to one
with no permutation of the query/key rows. `export_hf` writes a folder `LlamaForCausalLM.from_pretrained` loads
(for a LoRA model: the merged weights W + (alpha / r) B A, or the base alone); `export_peft` writes a LoRA model's
adapters as the folder `peft.PeftModel.from_pretrained` loads; `import_hf` reads a Hugging Face folder
(safetensors only: no pickles) into a model under any parallel layout.

A mixture of experts is written as `MixtralForCausalLM` (Jiang et al. 2024), with the tensor names of the published
Mixtral checkpoints: one w1/w3/w2 per expert, where we hold each as one (n_experts, out, in) tensor. transformers 5
fuses them on load (gate_up_proj, down_proj) and splits them again in `save_pretrained`; `import_hf` also reads the
fused form (`save_pretrained(save_original_format=False)`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import torch

from shardwise.config import HF_WEIGHT_FILES, LoraConfig
from shardwise.lora import LoRALinear, full_value, is_adapter
from shardwise.model_args import ModelArgs, args_from_hf_config, network_diffs

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
    "moe.router.weight": "block_sparse_moe.gate.weight",
}
# our 3-D expert weights -> one 2-D tensor per expert ({j}) in the published Mixtral checkpoints
_EXPERT_NAMES = {
    "moe.experts.w1": "block_sparse_moe.experts.{j}.w1.weight",
    "moe.experts.w3": "block_sparse_moe.experts.{j}.w3.weight",
    "moe.experts.w2": "block_sparse_moe.experts.{j}.w2.weight",
}
# transformers 5's own Mixtral tensors: (name, which half of dim 1), gate and up concatenated as [gate; up]
_FUSED_NAMES = {
    "moe.router.weight": ("mlp.gate.weight", None),
    "moe.experts.w1": ("mlp.experts.gate_up_proj", 0),
    "moe.experts.w3": ("mlp.experts.gate_up_proj", 1),
    "moe.experts.w2": ("mlp.experts.down_proj", None),
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


def _in_layer(name: str, table: dict) -> tuple[str, object] | None:
    """table's entry for the per-layer part of `name`, as (layer index, entry); None if it has none."""
    m = _LAYER.fullmatch(name)
    return (m.group(1), table[m.group(2)]) if m and m.group(2) in table else None


def expert_hf_names(name: str, n_experts: int) -> list[str] | None:
    """The Mixtral names of the experts of our 3-D expert weight `name`, in expert order (None for others):
    layers.0.moe.experts.w1 -> [model.layers.0.block_sparse_moe.experts.0.w1.weight, ...]."""
    found = _in_layer(name, _EXPERT_NAMES)
    if found is None:
        return None
    layer, pattern = found
    return [f"model.layers.{layer}.{pattern.format(j=j)}" for j in range(n_experts)]


def hf_module_name(target: str) -> str:
    """The transformers module of one of our block projections ("wq" -> "q_proj"): peft's target_modules."""
    for ours, theirs in _LAYER_NAMES.items():
        if ours.split(".")[1] == target:
            return theirs.split(".")[1]
    raise KeyError(f"no Hugging Face module for projection {target!r}")


# our adapter -> peft's: lora_A (r x in) and lora_B (out x r) are nn.Linear weights, laid out as ours
_PEFT_ADAPTERS = {"lora_a": "lora_A", "lora_b": "lora_B"}


def to_peft_name(name: str) -> str:
    """The key peft saves an adapter under: layers.0.attention.wq.lora_a ->
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    module, _, adapter = name.rpartition(".")
    return f"base_model.model.{to_hf_name(module + '.weight').removesuffix('.weight')}.{_PEFT_ADAPTERS[adapter]}.weight"


_HF_EXPERT = re.compile("|".join(re.escape(name).replace(r"\{j\}", r"\d+") for name in _EXPERT_NAMES.values()))
"""The published Mixtral checkpoints' per-expert tensor names (_EXPERT_NAMES, any expert j)."""


def unread_hf_tensors(names) -> list[str]:
    """The tensors of a Hugging Face folder (by name) that no parameter of ours is read from: a model type whose
    config.json reads as a Llama's but whose blocks hold more (Qwen3's q_norm and k_norm) lost them without a word.
    Rotary's cached inverse frequencies, which older checkpoints hold, are not weights."""
    ours = {*_LAYER_NAMES.values(), *(name for name, _ in _FUSED_NAMES.values())}

    def read(key: str) -> bool:
        m = _HF_LAYER.fullmatch(key)
        return (key in _TOP_NAMES.values() or key.endswith("rotary_emb.inv_freq")
                or (m is not None and (m.group(2) in ours or _HF_EXPERT.fullmatch(m.group(2)) is not None)))

    return [key for key in names if not read(key)]


def from_hf_name(name: str) -> str:
    for ours, theirs in _TOP_NAMES.items():
        if name == theirs:
            return ours
    m = _HF_LAYER.fullmatch(name)
    if m:
        for ours, theirs in _LAYER_NAMES.items():
            if m.group(2) == theirs:
                return f"layers.{m.group(1)}.{ours}"
    raise KeyError(f"unknown Hugging Face Llama or Mixtral parameter {name!r}")


def hf_config(args: ModelArgs) -> dict:
    """A `LlamaConfig` dict describing the same network, or for a mixture of experts a `MixtralConfig` one
    (ValueError if the mixture is one Mixtral cannot express)."""
    if args.n_experts:
        return _mixtral_config(args)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_decoder_config(args),
        "intermediate_size": args.ffn_hidden,
        "attention_bias": False,
        "mlp_bias": False,
    }


def _mixtral_config(args: ModelArgs) -> dict:
    """A `MixtralConfig` dict: Mixtral is softmax top-k routing, renormalised, in every block, nothing shared."""
    unsupported = [why for fails, why in (
        (args.score_func != "softmax", f"score_func {args.score_func!r} (Mixtral's router is a softmax)"),
        (not args.route_norm, "route_norm False (Mixtral renormalises a token's top-k weights)"),
        (args.route_scale != 1.0, f"route_scale {args.route_scale} (Mixtral does not scale the weights)"),
        (args.n_shared_experts > 0, f"n_shared_experts {args.n_shared_experts} (Mixtral has no shared experts)"),
        (args.n_dense_layers > 0, f"n_dense_layers {args.n_dense_layers} (every Mixtral block is a mixture)"),
        # a trained bias changes which experts a token picks, and Mixtral's router has none
        (args.bias_update_rate > 0, f"bias_update_rate {args.bias_update_rate} (Mixtral's router has no bias)"),
    ) if fails]
    if unsupported:
        raise ValueError(f"model {args.name!r} is a mixture of experts MixtralForCausalLM cannot express: "
                         f"{'; '.join(unsupported)}; fix: export a softmax-routed, renormalised, unscaled mixture "
                         "without shared experts, dense blocks or a balancing bias")
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **_decoder_config(args),
        "intermediate_size": args.expert_hidden,
        "num_local_experts": args.n_experts,
        "num_experts_per_tok": args.top_k,
        "router_aux_loss_coef": args.aux_loss_coeff,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def _decoder_config(args: ModelArgs) -> dict:
    """The config fields Llama and Mixtral share."""
    return {
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        **({"rope_scaling": {"rope_type": "llama3", "factor": args.rope_scaling_factor,
                             "low_freq_factor": args.rope_low_freq_factor,
                             "high_freq_factor": args.rope_high_freq_factor,
                             "original_max_position_embeddings": args.rope_original_max_seq_len}}
           if args.rope_scaling_factor else {}),
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


# ---------------------------------------------------------------------------------------------------
# Folders of safetensors + config.json, as `save_pretrained` writes and `from_pretrained` reads

SINGLE_FILE, INDEX_FILE = HF_WEIGHT_FILES


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return full_value(tensor).detach().to("cpu", copy=True).contiguous()


def _hf_tensors(parts, merge_lora: bool) -> dict[str, torch.Tensor]:
    """Every weight, full, on CPU, by its transformers name; a LoRA model's adapted projections merged
    (W + (alpha / r) B A, in the adapters' dtype) or, with merge_lora False, their frozen base alone.

    QLoRA's NF4 base is dequantised either way (lora.full_value).
    """
    from shardwise.model import canonical_name

    tensors = {}
    for part in parts:
        adapted = {canonical_name(n) + ".weight": m for n, m in part.named_modules() if isinstance(m, LoRALinear)}
        for name, param in part.named_parameters():
            name = canonical_name(name)
            if is_adapter(name):
                continue
            if merge_lora and name in adapted:
                layer = adapted[name]
                param = layer.merged_weight().to(layer.lora_a.dtype)
            full = _cpu(param)
            experts = expert_hf_names(name, full.shape[0])
            if experts:  # cloned: safetensors refuses tensors that share storage
                tensors.update(zip(experts, (w.clone() for w in full.unbind(0))))
            else:
                tensors[to_hf_name(name)] = full
    return tensors


def export_hf(parts, args: ModelArgs, folder: str | os.PathLike, runtime=None, *, merge_lora: bool = True,
              token_ids: dict[str, int] | None = None) -> None:
    """Write the model as a Hugging Face Llama or Mixtral folder (collective: every rank calls it).

    Sharded parameters are gathered (DTensor.full_tensor); one rank per pipeline stage writes that stage's
    safetensors file (model.safetensors with one stage, else model-0000k-of-0000n.safetensors and an index).
    Tied embeddings are written once, as transformers does. A LoRA model is written merged, or (merge_lora
    False) as its base: what `export_peft`'s adapters go on.
    """
    import torch.distributed as dist

    folder = Path(folder)
    config = hf_config(args)  # before any file is written: it refuses mixtures Mixtral cannot express
    config.update(token_ids or {})  # bos_token_id and eos_token_id (a base's max_position_embeddings), where known
    pp_rank, pp_size = (runtime.pp_rank, runtime.pp_size) if runtime is not None else (0, 1)
    writes = runtime.writes_stage_files if runtime is not None else True
    main = runtime.is_main if runtime is not None else True
    tensors = _hf_tensors(parts, merge_lora)
    # what the weights are, in their header: a peft export into this folder refuses a merged model, which
    # transformers would apply the adapters to a second time
    adapted = any(is_adapter(n) for part in parts for n, _ in part.named_parameters())
    kind = ("merged" if merge_lora else "base") if adapted else "model"
    file = SINGLE_FILE if pp_size == 1 else f"model-{pp_rank + 1:05d}-of-{pp_size:05d}.safetensors"
    if writes:
        folder.mkdir(parents=True, exist_ok=True)
        _save_shared(tensors, folder / file, {EXPORT_KIND: kind})
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
        (folder / "config.json").write_text(json.dumps(config, indent=2))


def write_tokenizer_files(folder: str | os.PathLike, tokenizer_json: str, token_ids: dict[str, int],
                          max_len: int, base: str | os.PathLike | None = None) -> None:
    """Beside an exported model: its tokenizer.json, and a tokenizer_config.json naming its beginning and end
    tokens, which `AutoTokenizer.from_pretrained` reads (without it the tokenizer has no eos_token, and trainers that
    pad or stop with it, TRL's among them, fail). A run fine-tuned from a Hugging Face folder with that folder's own
    tokenizer keeps the folder's tokenizer_config.json (its chat template, its special tokens) and
    generation_config.json, where it has them; any other run gets a tokenizer_config.json written from `token_ids`
    (bos_token_id, eos_token_id: an id, or a list whose first is named, as Llama 3's config.json lists its ends)."""
    import tokenizers

    folder = Path(folder)
    (folder / "tokenizer.json").write_text(tokenizer_json)
    base = Path(base) if base else None
    same = (base is not None and (base / "tokenizer.json").is_file()
            and json.loads((base / "tokenizer.json").read_text()) == json.loads(tokenizer_json))
    kept = [name for name in ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
            if same and (base / name).is_file()]
    for name in kept:
        (folder / name).write_text((base / name).read_text())
    if "tokenizer_config.json" in kept:
        return
    tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False}
    for key in ("bos", "eos"):
        ids = token_ids.get(f"{key}_token_id")
        ids = ids if isinstance(ids, list) else [ids]  # Llama 3's config.json lists its end tokens
        token = tokenizer.id_to_token(ids[0]) if ids and isinstance(ids[0], int) else None
        if token is not None:
            config[f"{key}_token"] = token
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


EXPORT_KIND = "shardwise_export"
"""The safetensors metadata key saying what an export's weights are: 'model' (a run without adapters), 'merged' (a
LoRA run's adapters merged in) or 'base' (a LoRA run's frozen base alone)."""


def _save_shared(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file creates its file readable by its owner only (0600); an exported model is for others
    to read, as the config.json beside it is: the mode the process's umask gives a new file."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt", **(metadata or {})})
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def peft_config(lora: LoraConfig, base_model: str | None) -> dict:
    """The `peft.LoraConfig` of our adapters, as `save_pretrained` writes it (fields left out take peft's
    defaults). peft scales by lora_alpha / r, as we do (no rsLoRA, no DoRA)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(hf_module_name(t) for t in lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def export_peft(parts, lora: LoraConfig, folder: str | os.PathLike, runtime=None,
                base_model: str | None = None) -> None:
    """Write a LoRA model's adapters as a peft folder: adapter_config.json + adapter_model.safetensors
    (collective: sharded adapters are gathered, pipeline stages' adapters sent to the main rank, which writes).

    `base_model` (the Hugging Face folder the run started from, if any) is recorded as base_model_name_or_path;
    the adapters go on that model, or on the base `export_hf(..., merge_lora=False)` writes.
    """
    import torch.distributed as dist

    from shardwise.model import canonical_name

    tensors = {to_peft_name(canonical_name(n)): _cpu(p) for part in parts for n, p in part.named_parameters()
               if is_adapter(n)}
    if dist.is_initialized() and dist.get_world_size() > 1:  # adapters are small: gather them whole
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, tensors)
        tensors = {k: v for theirs in everyone for k, v in theirs.items()}
    if runtime is None or runtime.is_main:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        _save_shared(tensors, folder / ADAPTER_FILE)
        (folder / ADAPTER_CONFIG).write_text(json.dumps(peft_config(lora, base_model), indent=2))


@torch.no_grad()
def import_peft(parts, folder: str | os.PathLike) -> None:
    """Give a LoRA model's adapters, in any layout, the values of a peft adapter folder (adapter_model.safetensors;
    its config and shapes were checked with the job's: config.peft_adapter_shapes). Every rank reads the adapters
    its parts hold and keeps its local piece, as import_hf does the base."""
    from safetensors import safe_open

    from shardwise.model import canonical_name, set_full_value

    with safe_open(str(Path(folder) / ADAPTER_FILE), framework="pt") as f:
        for part in parts:
            for name, param in list(part.named_parameters()):
                if is_adapter(name):
                    set_full_value(part, name, param, f.get_tensor(to_peft_name(canonical_name(name))))


def _hf_files(folder: Path) -> list[Path]:
    if (folder / INDEX_FILE).is_file():
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    raise FileNotFoundError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; fix: point at a folder "
                            "written by save_pretrained (safetensors) or export_hf")


def import_hf(parts, folder: str | os.PathLike) -> ModelArgs:
    """Load a Hugging Face Llama or Mixtral folder (local safetensors, no pickles) into a built model of any layout.

    Every rank reads the full tensors it needs and keeps its local piece (DTensor parameters get the slice of
    the full value their placement says, as `materialize` does); no communication. Returns the folder's shape;
    ValueError when it is not the model's shape or a parameter is missing. A LoRA model takes its base from the
    folder (which has no adapters); its adapters keep their seeded initial values.
    """
    from safetensors import safe_open

    folder = Path(folder)
    theirs = args_from_hf_config(json.loads((folder / "config.json").read_text()))
    ours = parts[0].args
    diffs = [f"{f} {a} vs {b}" for f, a, b in network_diffs(theirs, ours)]
    if diffs:
        raise ValueError(f"{folder} holds another model shape (folder vs this model: {', '.join(diffs)}); "
                         "fix: build the model from the folder's config (args_from_hf_config)")
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(safe_open(str(f), framework="pt")) for f in _hf_files(folder)]
        where = {key: f for f in files for key in f.keys()}
        biases = sorted(k for k in where if k.endswith(".bias"))
        if biases:  # a model type whose config has no bias flag (Qwen2's q/k/v): they were dropped without a word
            raise ValueError(f"{folder} holds biases the engine's Llama does not have ({biases[0]}, ...)")
        unread = unread_hf_tensors(where)
        if unread:
            raise ValueError(f"{folder} holds tensors the engine's Llama and Mixtral have no place for ({unread[0]}, "
                             "...): they would be dropped")
        _copy_into(parts, where, folder)
    return theirs


@torch.no_grad()
def _copy_into(parts, where: dict, folder: Path) -> None:
    """Each parameter's local piece of the full value its Hugging Face tensor(s) hold."""
    from shardwise.model import canonical_name, set_full_value

    for part in parts:
        for name, param in list(part.named_parameters()):
            if is_adapter(name):
                continue
            full = _full_tensor(canonical_name(name), param.shape[0], where, folder)
            if tuple(full.shape) != tuple(param.shape):
                raise ValueError(f"{folder}: the tensor for our {canonical_name(name)} has shape "
                                 f"{tuple(full.shape)}, the model {tuple(param.shape)}")
            set_full_value(part, name, param, full)


def _full_tensor(name: str, rows: int, where: dict, folder: Path) -> torch.Tensor:
    """Our full parameter `name` (`rows` long in dim 0) from the folder's tensors: renamed, stacked from one tensor
    per expert (Mixtral's checkpoints), or cut from transformers 5's fused experts."""
    fused = _in_layer(name, _FUSED_NAMES)
    if fused is not None:
        layer, (suffix, half) = fused
        key = f"model.layers.{layer}.{suffix}"
        if key in where:
            full = where[key].get_tensor(key)
            return full if half is None else full.chunk(2, dim=1)[half]
    experts = expert_hf_names(name, rows)
    if experts:
        return torch.stack([_read(where, key, name, folder) for key in experts])
    return _read(where, to_hf_name(name), name, folder)


def _read(where: dict, key: str, ours: str, folder: Path) -> torch.Tensor:
    if key not in where:
        raise ValueError(f"{folder} has no tensor {key!r} (our {ours})")
    return where[key].get_tensor(key)
