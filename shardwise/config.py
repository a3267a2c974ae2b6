"""One typed config tree for a training job.

A job is read from a TOML file whose tables mirror the dataclasses below ([model], [data], [optim],
[train], [metrics]); `--set section.field=value` overrides any field. `load_config` rejects unknown keys and
values of the wrong type, then `validate` checks how the fields fit together. Both run before anything is
built or written, and both raise `ConfigError`, which names the field and the fix.

Every field carries a one-line docstring (the string literal below it); `field_docs` reads them back.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import itertools
import json
import math
import os
import textwrap
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shardwise.errors import ConfigError
from shardwise.layout import (
    Layout,
    capacity_error,
    engine_cannot_run,
    expert_parallel_error,
    fsdp_mixed_precision,
    pipeline_batch_error,
)
from shardwise.model_args import PRESETS, PROJECTIONS, ModelArgs, projection_shapes


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)
    """Text files or folders to train on; empty means the embedded corpus (this Python's own stdlib source). A file
    is one document; a .jsonl file is one per line, its "text" field."""
    tokenizer: str = "byte"
    """'byte' (256 byte values + end-of-text), 'bpe' (trained locally on the corpus), or a tokenizer.json path."""
    bpe_vocab_size: int = 2048
    """Vocabulary size when tokenizer = 'bpe'."""
    seq_len: int = 256
    """Tokens per training sample (the model sees seq_len inputs and predicts seq_len targets)."""
    val_fraction: float = 0.01
    """Share of the token stream, taken from its end, held out for validation."""
    max_corpus_mb: float = 16.0
    """Read at most this many MB of text from the corpus (files taken in sorted order); 0 means no limit."""
    cache_dir: str = ""
    """Where packed token shards are cached; empty means $SHARDWISE_CACHE or ~/.cache/shardwise."""
    shard_tokens: int = 1 << 24
    """Tokens per on-disk shard file."""


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd", "momentum", "adamw8bit", "adamw4bit", "adafactor"] = "adamw"
    """Optimizer: AdamW (2 fp32 states/param), plain SGD (none), SGD with Nesterov-free momentum (1 state/param),
    AdamW with 8-bit or 4-bit block-quantised states (torchao), or Adafactor (factored second moment)."""
    lr: float = 3e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr_ratio: float = 0.1
    """The decay ends at lr * min_lr_ratio at the last step."""
    warmup_steps: int = 20
    """Steps of linear warmup from 0 to lr."""
    decay: Literal["cosine", "linear", "sqrt", "constant"] = "cosine"
    """The lr's shape from its peak to lr * min_lr_ratio: cosine, linear, sqrt (1 - sqrt of the progress), or
    constant (no decay: the peak to the end)."""
    decay_ratio: float = 0.0
    """The share of train.steps the decay takes, at the end of the run; between warmup and it the lr stays at its
    peak (warmup-stable-decay: MiniCPM's WSD, torchtitan's lr_scheduler.decay_ratio). 0: every step after warmup
    decays."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not norms or embeddings)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    momentum: float = 0.9
    """Momentum for name = 'momentum'."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    lr_scaling: Literal["none", "linear"] = "none"
    """'linear' scales lr by global_batch / base_global_batch (Goyal et al.'s linear scaling rule)."""
    base_global_batch: int = 0
    """Global batch (sequences) at which lr was tuned; needed when lr_scaling = 'linear'."""


LORA_TARGETS = PROJECTIONS
"""The projections of a block LoRA can adapt: attention (wq, wk, wv, wo) and MLP (w1 gate, w3 up, w2 down)."""
HF_PROJECTIONS = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w1", "up_proj": "w3",
                  "down_proj": "w2"}
"""A Llama block's projections by their Hugging Face (and peft target_modules) names, and the engine's names."""
# QLoRA's NF4 storage (torchao's to_nf4 defaults, as in Dettmers et al. 2023; see shardwise/nf4.py): one int8
# absmax scaler per NF4_BLOCK_SIZE weights, one quantisation factor per NF4_SCALER_BLOCK_SIZE scalers
NF4_BLOCK_SIZE = 64
NF4_SCALER_BLOCK_SIZE = 256


@dataclass
class LoraConfig:
    rank: int = 0
    """LoRA adapters of this rank on `targets` in every block, all other weights frozen (Hu et al. 2022); 0 trains
    every weight."""
    alpha: float = 16.0
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input (not on the frozen projection's)."""
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Projections to adapt, by name: wq, wk, wv, wo (attention), w1, w3, w2 (MLP)."""
    qlora: bool = False
    """QLoRA: store the frozen weights of the adapted projections in 4-bit NormalFloat (NF4, torchao; Dettmers et
    al. 2023)."""
    init_from: str = ""
    """A peft LoRA adapter folder (adapter_config.json + adapter_model.safetensors, as peft's `save_pretrained` and
    `shardwise export --format peft` write them) whose adapters the run starts from in place of the seeded ones
    (B = 0): to go on training an adapter made elsewhere. Its r, lora_alpha and target_modules must be this run's
    rank, alpha and targets, its tensors this model's shapes. A resumed run takes its adapters from its checkpoint."""


@dataclass
class TrainConfig:
    steps: int = 200
    """Optimizer steps to run."""
    micro_batch: int = 16
    """Sequences per forward/backward pass on one rank."""
    grad_accum: int = 1
    """Micro-batches accumulated before each optimizer step (global batch = micro_batch x grad_accum x dp)."""
    global_batch: int = 0
    """Sequences per optimizer step over all data-parallel ranks, kept whatever the world: grad_accum then follows
    (global_batch / (micro_batch x dp)), as torchtitan's global_batch_size and Megatron's --global-batch-size do. An
    elastic job that loses or gains ranks keeps its batch, its lr and its data order. 0: micro_batch x grad_accum x
    dp."""
    seed: int = 0
    """Seeds weight init (a function of seed and parameter name) and the data order."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32, or mixed precision with fp32 master weights: bf16 autocast, or fp16 autocast with loss scaling."""
    loss_scale_init: float = 65536.0
    """fp16 only: initial dynamic loss scale."""
    loss_scale_growth_interval: int = 2000
    """fp16 only: double the loss scale after this many steps without inf/nan."""
    compile: bool = False
    """torch.compile each transformer block."""
    deterministic: bool = False
    """Bitwise-repeatable runs (torchtitan's debug.deterministic): torch.use_deterministic_algorithms, cuDNN's
    deterministic mode without its benchmark, cuBLAS's fixed workspace (CUBLAS_WORKSPACE_CONFIG). On CPU it also
    keeps attention on SDPA's kernel: otherwise each rank times the engine's attention forms once per shape and
    takes the fastest, and two runs whose ranks chose differently differ by rounding. Slower; an op without a
    deterministic implementation raises."""
    val_every: int = 50
    """Evaluate validation loss every this many steps (and at the end); 0 disables."""
    val_batches: int = 4
    """Global batches per validation evaluation (each of micro_batch x grad_accum x dp sequences, as Megatron's
    --eval-iters): every layout of the same global batch evaluates the same samples."""
    stop_after: int = 0
    """Stop after this step as a preemption would (saving a checkpoint), e.g. to continue on another layout;
    0 runs to `steps`. The schedule still spans `steps`."""
    max_nonfinite_steps: int = 0
    """Steps with a non-finite loss or gradient skipped (no update) before the run stops with an error."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'auto' takes CUDA when present, else CPU."""
    collective_timeout_s: float = 600.0
    """A collective that waits longer than this raises an error (a hung or dead rank) instead of hanging."""


@dataclass
class CheckpointConfig:
    enabled: bool = False
    """Save the whole training state (DCP, sharded) under metrics.out_dir/checkpoints, and resume from it."""
    every: int = 500
    """Save every this many steps; also at the end, and when SIGTERM asks the run to stop."""
    keep: int = 3
    """Keep the newest this many complete checkpoints."""
    async_save: bool = False
    """Write in the background; training waits only for the copy of the state (staging)."""
    resume: bool = True
    """Start from the newest complete checkpoint in the run folder, if there is one."""
    init_from_hf: str = ""
    """A Hugging Face Llama folder (config.json + safetensors) whose weights replace the initialisation."""


@dataclass
class MetricsConfig:
    out_dir: str = "runs/demo"
    """Run folder: metrics.jsonl, TensorBoard events and the resolved config go here."""
    log_every: int = 10
    """Write metrics every this many steps."""
    tensorboard: bool = True
    """Write TensorBoard event files to out_dir/tb."""
    progress: bool = True
    """Show progress: a bar on a terminal, else one plain line per logged step."""
    accelerator: str = "auto"
    """Accelerator for MFU: a name from shardwise.hardware.CATALOGUE, or 'auto' to detect it."""
    peak_flops: float = 0.0
    """Declared peak FLOP/s per device for MFU; overrides the catalogue (needed on CPU, which has no entry)."""
    log_samples: bool = False
    """Append each step's sample ids to out_dir/samples/dp<rank>.jsonl, one file per data-parallel rank: an audit
    that a run (with restarts) trained on every sample exactly once. A replayed step's later line supersedes."""
    profile_step: int = 0
    """Run this step under torch.profiler (0: none). Every rank writes out_dir/profile/rank<r>.txt (operators by
    self time) and a Chrome trace rank<r>.json (open it in Perfetto or chrome://tracing). The profiler's own
    overhead is in that step's logged time."""


@dataclass
class JobConfig:
    model: ModelArgs = field(default_factory=ModelArgs)
    """Model architecture; `name` picks a preset from shardwise.model.PRESETS, other keys override it."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and sample length."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batch, precision, recompute and length of the run."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters (LoRA, QLoRA) instead of training every weight."""
    parallel: Layout = field(default_factory=Layout)
    """Degrees of each parallelism (their product is the world size) and how each is run."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Sharded checkpoints, resume, preemption."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Where and how often to report."""


# ---------------------------------------------------------------------------------------------------
# Reading: TOML + overrides -> typed tree


def autocast_precision(cfg: JobConfig) -> str:
    """The precision autocast runs the job's forward in: train.precision, or none ('fp32') where FSDP2's
    mixed-precision policy casts the weights to bf16 instead (layout.fsdp_mixed_precision)."""
    return "fp32" if fsdp_mixed_precision(cfg.parallel) else cfg.train.precision


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = (), *, sizing: bool = False) -> JobConfig:
    """Read a TOML file (or nothing, for the defaults), apply `key=value` overrides, type-check, validate.

    sizing=True reads a job to size it (`plan`, `simulate`) before it runs, maybe on another machine: what only the
    run needs is not checked (data.paths, data.tokenizer and a Hugging Face folder that are not here, the block's
    MLP being one the engine builds: the planner also sizes GELU MLPs)."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError("--config", f"no file {path}", "pass the path of a TOML file, e.g. configs/demo.toml")
        except IsADirectoryError:
            raise ConfigError("--config", f"{path} is a folder", "pass the path of a TOML file, e.g. configs/demo.toml")
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError("--config", f"{path} is not valid TOML ({e})", "fix the TOML syntax")
    _apply_overrides(raw, overrides)
    cfg = from_dict(raw)
    validate(cfg, sizing=sizing)
    return cfg


def from_dict(raw: dict[str, Any]) -> JobConfig:
    """Build the typed tree from nested dicts; the model table starts from the preset it names."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    model_raw = raw.get("model", {})
    if isinstance(model_raw, dict):
        name = model_raw.get("name", ModelArgs.name)
        if name in PRESETS:
            raw["model"] = {**dataclasses.asdict(PRESETS[name]), **model_raw}
        elif missing := [k for k in CUSTOM_SHAPE if k not in model_raw]:
            # a name of one's own describes a custom shape; without it a mistyped preset would train ModelArgs'
            # defaults under that name
            near = difflib.get_close_matches(name, PRESETS, n=1)
            raise ConfigError("model.name", f"{name!r} is not a preset, and a custom model needs "
                              f"{', '.join('model.' + k for k in missing)}",
                              (f"did you mean {near[0]!r}? " if near else "")
                              + f"use one of {', '.join(PRESETS)}, or give the shape")
    return _build(JobConfig, raw, "")


HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
"""A Hugging Face folder's weights: one safetensors file, or the index of several (what hf writes and reads)."""


def has_hf_weights(folder: str | os.PathLike) -> bool:
    return any((Path(folder) / name).is_file() for name in HF_WEIGHT_FILES)


def _safetensors_header(file: Path) -> dict[str, Any]:
    """A safetensors file's JSON header (tensor entries and `__metadata__`), read without torch."""
    with open(file, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


def hf_weights_metadata(folder: str | os.PathLike) -> dict[str, str]:
    """The `__metadata__` of a Hugging Face folder's weights (model.safetensors, or the first file its index names),
    read from the header without torch; {} where there is none or it cannot be read."""
    folder = Path(folder)
    single, index = (folder / name for name in HF_WEIGHT_FILES)
    try:
        if index.is_file():
            single = folder / next(iter(json.loads(index.read_text())["weight_map"].values()))
        return dict(_safetensors_header(single).get("__metadata__") or {})
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return {}


def hf_tensor_names(folder: str | os.PathLike) -> list[str]:
    """The tensor names of a Hugging Face folder's weights: the index's, or the safetensors header's (no torch);
    [] for files that cannot be read so (their reader says what is wrong with them)."""
    folder = Path(folder)
    single, index = (folder / name for name in HF_WEIGHT_FILES)
    try:
        if index.is_file():
            return list(json.loads(index.read_text())["weight_map"])
        return [k for k in _safetensors_header(single) if k != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError):
        return []


CUSTOM_SHAPE = ("dim", "n_layers", "n_heads", "vocab_size")
"""What a model table naming no preset must give: the rest have defaults that fit any shape."""


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


STOPPED_FILE = "stopped.json"
"""In the run folder while the run's last attempt stopped before its last step (a signal, train.stop_after): its
step. Written by the main rank at the stop, removed at each start; launchers read it (the run's outcome, not
whether they passed on a signal) to exit with --stopped-exit-code, and `launch slurm`'s script to end the job
FAILED or requeue it."""


def read_run_record(run_dir: str | os.PathLike) -> JobConfig:
    """The config a run folder recorded (job_config.json, run_record's), its out_dir that folder: the run may have
    moved since it was trained."""
    cfg = from_dict(json.loads((Path(run_dir) / "job_config.json").read_text()))
    cfg.metrics.out_dir = str(run_dir)
    return cfg


def run_record(cfg: JobConfig) -> dict[str, Any]:
    """The job as a run folder keeps it (job_config.json, which `generate --run` reads): its file and folder paths
    made absolute, so that the record means the same files from any working folder. Written relative, a run trained
    with data.tokenizer = 'base/tokenizer.json' could not be read by `generate --run` from another folder (refused
    naming data.tokenizer, which generate has no flag for)."""
    raw = to_dict(cfg)
    data, checkpoint = raw["data"], raw["checkpoint"]
    data["paths"] = [os.path.abspath(p) for p in data["paths"]]
    if data["tokenizer"] not in ("byte", "bpe"):
        data["tokenizer"] = os.path.abspath(os.path.expanduser(data["tokenizer"]))
    for table, key in ((data, "cache_dir"), (checkpoint, "init_from_hf"), (raw["lora"], "init_from")):
        if table[key]:
            table[key] = os.path.abspath(table[key])
    return raw


def with_overrides(cfg: JobConfig, overrides: list[str]) -> JobConfig:
    """`cfg` with `key=value` overrides applied, type-checked as `load_config` checks them (not validated: a
    simulated job may be larger than any machine here)."""
    raw = to_dict(cfg)
    _apply_overrides(raw, overrides)
    return from_dict(raw)


def toml_value(value: Any) -> str:
    """A value as TOML writes it (and `--set` reads it)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # a JSON string is a TOML basic string, quotes and backslashes escaped
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(toml_value, value))}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def layout_settings(layout: Layout) -> list[str]:
    """The whole [parallel] table of `layout` as `--set` overrides (every field: nothing left to a default)."""
    return [f"parallel.{k}={toml_value(v)}" for k, v in dataclasses.asdict(layout).items()]


def layout_tables(layout: Layout, micro_batch: int, grad_accum: int) -> dict[str, dict]:
    """[parallel] and [train] values that run `layout` on the planner's batch split (micro_batch sequences per
    micro-batch, grad_accum micro-batches per step and data-parallel rank). Without a pipeline that is
    train.micro_batch x train.grad_accum as given; with one, the engine runs all of a step's micro-batches in one
    schedule step: train.micro_batch = micro_batch x grad_accum, cut into pp_microbatches = grad_accum."""
    parallel = dataclasses.asdict(layout)
    if layout.pp > 1:
        parallel["pp_microbatches"] = grad_accum
        return {"parallel": parallel, "train": {"micro_batch": micro_batch * grad_accum, "grad_accum": 1}}
    return {"parallel": parallel, "train": {"micro_batch": micro_batch, "grad_accum": grad_accum}}


def planner_split(layout: Layout, micro_batch: int, grad_accum: int) -> tuple[int, int]:
    """layout_tables read back: a job's train.micro_batch and train.grad_accum as the planner's (micro_batch,
    grad_accum). Under a pipeline a schedule step's sequences are cut into its pipeline micro-batches, which the
    planner counts as accumulation."""
    cut = layout.n_microbatches if layout.pp > 1 else 1
    return max(1, micro_batch // cut), grad_accum * cut


def _apply_overrides(raw: dict[str, Any], overrides: list[str]) -> None:
    """Apply `key=value` overrides in order. A preset named by one (`model.name`, other than the table's) replaces
    the model table first: `--set model.name=debug` on a config whose [model] gives a shape (an 8B written from a
    Hugging Face config.json) built the 8B under the name 'debug', as a preset fills only what the table leaves
    out. Other `model.*` overrides go on top of the preset, in any order."""
    named = [_override_value(item) for item in overrides if item.partition("=")[0].strip() == "model.name"]
    table = raw.get("model")
    if named and named[-1] in PRESETS and isinstance(table, dict) and table.get("name", ModelArgs.name) != named[-1]:
        raw["model"] = {}
    for item in overrides:
        _apply_override(raw, item)


def _override_value(item: str) -> Any:
    """The value of a `key=value` override, as TOML reads it (a bare word as a string)."""
    text = item.partition("=")[2]
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, _ = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError("--set", f"'{item}' is not key=value", "write e.g. --set optim.lr=3e-4")
    value = _override_value(item)
    *parents, leaf = key.strip().split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(key, f"'{part}' is a value, not a section", "set a field inside a section")
    node[leaf] = value


MOVED = {"train.activation_checkpoint": "parallel.activation_checkpoint",
         "train.activation_checkpoint_every": "parallel.activation_checkpoint_every"}
"""Keys an earlier version read, and where they are now (activation checkpointing is part of the layout)."""


ALIASES = {"model.": {
    # Hugging Face config.json names (LlamaConfig, MixtralConfig) and torchtitan's / Megatron's, for ours
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_layers": "n_layers",
    "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads", "intermediate_size": "ffn_hidden",
    "ffn_dim": "ffn_hidden", "ffn_hidden_size": "ffn_hidden",
    "hidden_dim": "ffn_hidden", "rms_norm_eps": "norm_eps", "max_position_embeddings": "max_seq_len",
    "seq_length": "max_seq_len", "tie_word_embeddings": "tie_embeddings", "num_local_experts": "n_experts",
    "num_experts": "n_experts", "num_experts_per_tok": "top_k", "moe_intermediate_size": "moe_ffn_hidden",
    "router_z_loss_coef": "z_loss_coeff", "router_aux_loss_coef": "aux_loss_coeff", "head_dim": "attn_head_dim",
    "kv_channels": "attn_head_dim"}}
"""Other systems' names for a field, so that the unknown-key error names ours (difflib's nearest name for ffn_dim
was dim, a different field)."""


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(prefix.rstrip(".") or "config", "expected a table", f"write [{prefix.rstrip('.')}]")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if f"{prefix}{key}" in MOVED:
            raise ConfigError(f"{prefix}{key}", "moved", f"write it as {MOVED[f'{prefix}{key}']}")
        if key not in names:
            alias = ALIASES.get(prefix, {}).get(key)
            near = [alias] if alias in names else difflib.get_close_matches(key, names, n=1)
            raise ConfigError(
                f"{prefix}{key}", "unknown key", (f"did you mean {prefix}{near[0]}? " if near else "")
                + f"remove it or use one of: {', '.join(sorted(names))}")
    kwargs = {key: _coerce(hints[key], value, f"{prefix}{key}") for key, value in raw.items()}
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, name: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, f"{name}.")
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(name, f"{value!r} is not a choice", f"use one of {', '.join(map(repr, choices))}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(name, f"expected a list, got {value!r}", f"write {name} = [...]")
        return [_coerce(item_tp, v, name) for v in value]
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            if option is type(None) and value is None:
                return None
        return _coerce(next(t for t in typing.get_args(tp) if t is not type(None)), value, name)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # TOML and --set read nan and inf; no field takes them
                raise ConfigError(name, f"{value} is not a finite number", f"give {name} a finite value")
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
    else:
        return value
    article = "an" if tp.__name__[0] in "aeiou" else "a"
    raise ConfigError(name, f"expected {tp.__name__}, got {value!r}", f"give {name} {article} {tp.__name__} value")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a config dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)
    return docs


# ---------------------------------------------------------------------------------------------------
# Validation: how the fields fit together


def validate_model(cfg: JobConfig) -> None:
    """The model's shape and its fit with the data (what `validate` checks of them, nothing of this machine)."""
    _validate_model(cfg.model, cfg.data)


def validate(cfg: JobConfig, *, sizing: bool = False) -> None:
    """Raise ConfigError for the first field that cannot work, before anything is built or written (sizing: see
    load_config)."""
    _validate_model(cfg.model, cfg.data, sizing)
    _validate_data(cfg.data, sizing)
    _validate_optim(cfg.optim)
    _validate_train(cfg.train)
    _validate_lora(cfg.lora)
    _validate_moe(cfg)
    validate_parallel(cfg)
    # after the layout: an MoE config with n_experts = 0 and ep > 1 is told of ep, which names the dense model
    _validate_dense_model_has_no_moe_fields(cfg.model)
    for key in ("every", "keep"):
        _positive(f"checkpoint.{key}", getattr(cfg.checkpoint, key))
    hf = cfg.checkpoint.init_from_hf if not sizing or Path(cfg.checkpoint.init_from_hf).exists() else ""
    if hf and Path(hf).is_file():  # its config.json or a weight file, given for the folder
        raise ConfigError("checkpoint.init_from_hf", f"{hf} is a file", f"set it to the folder that holds it "
                          f"('{Path(hf).parent}'): a Hugging Face model folder (config.json + *.safetensors)")
    if hf and not (Path(hf) / "config.json").is_file():
        raise ConfigError("checkpoint.init_from_hf", f"{hf} has no config.json",
                          "point it at a Hugging Face model folder (config.json + *.safetensors)")
    if hf and not has_hf_weights(hf):
        # found when the weights were read, it was a traceback from inside the training processes
        raise ConfigError("checkpoint.init_from_hf", f"{hf} has no {' and no '.join(HF_WEIGHT_FILES)}",
                          "point it at a folder written by save_pretrained (safetensors weights) or shardwise export")
    if hf and (Path(hf) / "adapter_config.json").is_file():
        # peft's layout, an adapter beside its base: transformers applies it, the import read the base alone
        raise ConfigError("checkpoint.init_from_hf", f"{hf} holds a peft adapter (adapter_config.json) that the "
                          "import would drop: the run would start from the base alone",
                          "point it at a merged export of that fine-tune (shardwise export --format merged) in "
                          "another folder, or at the base alone")
    if hf:
        _validate_hf_shape(cfg.model, hf)
    if cfg.lora.init_from:
        # after the base: an adapter checked against a [model] that is not the base's was refused as another base's
        _validate_lora_init(cfg.lora, cfg.model)
    decaying = round(cfg.optim.decay_ratio * cfg.train.steps)
    if cfg.optim.decay_ratio > 0 and cfg.optim.decay != "constant" and \
            cfg.optim.warmup_steps + decaying > cfg.train.steps:
        raise ConfigError("optim.decay_ratio", f"{cfg.optim.decay_ratio:g} of train.steps = {cfg.train.steps} is "
                          f"{decaying} steps of decay, which with optim.warmup_steps = {cfg.optim.warmup_steps} is "
                          "more than the run has", "make optim.decay_ratio or optim.warmup_steps smaller")
    if not 0 <= cfg.train.stop_after <= cfg.train.steps:
        raise ConfigError("train.stop_after", f"{cfg.train.stop_after} is outside 0..train.steps",
                          "use 0, or a step no later than train.steps")
    if cfg.train.max_nonfinite_steps < 0:
        raise ConfigError("train.max_nonfinite_steps", "negative", "use 0 to stop at the first non-finite step")
    if cfg.metrics.log_every < 1:
        raise ConfigError("metrics.log_every", f"{cfg.metrics.log_every} < 1", "set it to 1 or more")
    if cfg.metrics.accelerator != "auto":
        from shardwise.hardware import ALIASES, CATALOGUE

        if ALIASES.get(cfg.metrics.accelerator, cfg.metrics.accelerator) not in CATALOGUE:
            raise ConfigError("metrics.accelerator", f"unknown accelerator {cfg.metrics.accelerator!r}",
                              f"use 'auto' or one of {', '.join(CATALOGUE)}")
    if not 0 <= cfg.metrics.profile_step <= cfg.train.steps:
        raise ConfigError("metrics.profile_step", f"{cfg.metrics.profile_step} is not a step of this run "
                          f"(1 to train.steps = {cfg.train.steps})", "set a step in that range, or 0 for none")
    if cfg.metrics.peak_flops < 0:
        raise ConfigError("metrics.peak_flops", "negative", "set a positive FLOP/s figure, or 0 for the catalogue")
    out = cfg.metrics.out_dir
    if not out.strip():  # '' wrote the run's files into the working folder
        raise ConfigError("metrics.out_dir", "empty", "name the run's folder, e.g. 'runs/my-run'")
    if Path(out).exists() and not Path(out).is_dir():
        raise ConfigError("metrics.out_dir", f"{out} is a file", "name a folder (made if missing)")


def check_file_to_write(flag: str, path: str, example: str = "runs/my-run/final.safetensors") -> None:
    """A file a command will write at its end (--save-final): refused now, not after the training, if it names a
    folder or sits below a file. `example`: a path of the kind `flag` writes, for the fix."""
    target = Path(path)
    if not path.strip() or target.is_dir():
        raise ConfigError(flag, f"{path!r} is {'a folder' if path.strip() else 'empty'}",
                          f"name a file to write, e.g. {example}")
    blocker = next((p for p in target.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(flag, f"{blocker} is a file, so {path} cannot be made", "name a path in a folder")


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(name, f"{value} must be positive", f"set {name} to a value > 0")


def _validate_model(m: ModelArgs, data: DataConfig, sizing: bool = False) -> None:
    if m.mlp != "swiglu" and not sizing:
        raise ConfigError("model.mlp", f"the engine's block has a SwiGLU MLP, not {m.mlp!r} (that is for "
                          "`shardwise plan` only)", 'remove model.mlp, or set it to "swiglu"')
    for key in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_hidden", "max_seq_len"):
        _positive(f"model.{key}", getattr(m, key))
    if m.attn_head_dim < 0:
        raise ConfigError("model.attn_head_dim", f"{m.attn_head_dim} is negative",
                          "set the width of one attention head, or 0 for dim // n_heads")
    if m.dim % m.n_heads and not m.attn_head_dim:
        raise ConfigError(
            "model.n_heads", f"{m.n_heads} heads do not divide model.dim={m.dim}",
            f"pick n_heads among the divisors of {m.dim}, change dim, or set model.attn_head_dim",
        )
    if m.head_dim % 2:
        field = "model.attn_head_dim" if m.attn_head_dim else "model.n_heads"
        raise ConfigError(field, f"head dim {m.head_dim} is odd", "rotary embedding needs an even head dim")
    _positive("model.n_kv_heads", m.n_kv_heads)
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            "model.n_kv_heads", f"{m.n_kv_heads} KV heads do not divide n_heads={m.n_heads}",
            "pick n_kv_heads among the divisors of n_heads",
        )
    _positive("model.norm_eps", m.norm_eps)
    _positive("model.rope_theta", m.rope_theta)
    _validate_rope_scaling(m)
    if data.seq_len > m.max_seq_len:
        raise ConfigError(
            "data.seq_len", f"{data.seq_len} exceeds model.max_seq_len={m.max_seq_len}",
            "shorten data.seq_len or raise model.max_seq_len",
        )
    if data.tokenizer == "byte" and m.vocab_size < 257:
        raise ConfigError("model.vocab_size", f"{m.vocab_size} < 257 byte tokens", "set model.vocab_size >= 257")
    if data.tokenizer == "bpe" and m.vocab_size < data.bpe_vocab_size:
        raise ConfigError(
            "model.vocab_size", f"{m.vocab_size} < data.bpe_vocab_size={data.bpe_vocab_size}",
            "raise model.vocab_size or lower data.bpe_vocab_size",
        )


def _validate_data(d: DataConfig, sizing: bool = False) -> None:
    for p in d.paths:
        if not Path(p).exists() and not sizing:
            raise ConfigError("data.paths", f"{p} does not exist", "point data.paths at existing text files or folders")
    if d.tokenizer not in ("byte", "bpe") and not Path(d.tokenizer).is_file() and not (
            sizing and not Path(d.tokenizer).exists()):
        inside = Path(d.tokenizer) / "tokenizer.json"  # a model folder given for its tokenizer
        raise ConfigError(
            "data.tokenizer", f"{d.tokenizer!r} is neither 'byte', 'bpe' nor a file",
            f"set data.tokenizer = '{inside}'" if inside.is_file()
            else "use 'byte', 'bpe' or the path of a tokenizer.json",
        )
    if d.tokenizer == "bpe" and d.bpe_vocab_size < 260:
        raise ConfigError("data.bpe_vocab_size", f"{d.bpe_vocab_size} is too small",
                          "use at least 260 (bytes + merges)")
    _positive("data.seq_len", d.seq_len)
    if not 0 < d.val_fraction < 0.5:
        raise ConfigError("data.val_fraction", f"{d.val_fraction} is outside (0, 0.5)", "use e.g. 0.01")
    if d.max_corpus_mb < 0:
        raise ConfigError("data.max_corpus_mb", "negative", "use 0 for no limit or a positive size")
    if d.shard_tokens < d.seq_len + 1:
        raise ConfigError("data.shard_tokens", f"{d.shard_tokens} < seq_len + 1", "raise data.shard_tokens")
    if d.cache_dir:  # a file there (or above) was a traceback from every rank when the cache was first written
        cache = Path(d.cache_dir).expanduser()
        blocker = next((p for p in (cache, *cache.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise ConfigError("data.cache_dir", f"{blocker} is a file, so the token cache cannot be made in "
                              f"{d.cache_dir}", "name a folder (made if missing), or leave it empty for "
                              "$SHARDWISE_CACHE or ~/.cache/shardwise")


def _validate_optim(o: OptimConfig) -> None:
    _positive("optim.lr", o.lr)
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError("optim.min_lr_ratio", f"{o.min_lr_ratio} outside [0, 1]", "use a ratio such as 0.1")
    if not 0 <= o.decay_ratio <= 1:
        raise ConfigError("optim.decay_ratio", f"{o.decay_ratio} outside [0, 1]", "use e.g. 0.2 (the last fifth of "
                          "the steps decays), or 0 for a decay over every step after warmup")
    for key in ("warmup_steps", "weight_decay", "grad_clip", "momentum"):
        if getattr(o, key) < 0:
            raise ConfigError(f"optim.{key}", f"{getattr(o, key)} is negative", f"set optim.{key} >= 0")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(o, key) < 1:
            raise ConfigError(f"optim.{key}", f"{getattr(o, key)} outside [0, 1)", "use e.g. 0.9 / 0.95")
    _positive("optim.eps", o.eps)
    if o.momentum >= 1:
        raise ConfigError("optim.momentum", f"{o.momentum} >= 1 (the velocity would grow without bound)",
                          "use a value in [0, 1), e.g. 0.9")
    if o.base_global_batch < 0:
        raise ConfigError("optim.base_global_batch", f"{o.base_global_batch} is negative",
                          "set the global batch (sequences) lr was tuned at, or 0")
    if o.lr_scaling == "linear" and o.base_global_batch < 1:
        raise ConfigError(
            "optim.base_global_batch", "lr_scaling = 'linear' needs the batch lr was tuned at",
            "set optim.base_global_batch to that global batch in sequences",
        )


def _validate_lora(lora: LoraConfig) -> None:
    if lora.rank < 0:
        raise ConfigError("lora.rank", f"{lora.rank} < 0", "use a positive rank such as 16, or 0 to train every weight")
    if lora.rank == 0:
        if lora.qlora:
            raise ConfigError("lora.qlora", "QLoRA trains LoRA adapters, and lora.rank is 0", "set lora.rank, e.g. 16")
        return
    _positive("lora.alpha", lora.alpha)
    if not 0 <= lora.dropout < 1:
        raise ConfigError("lora.dropout", f"{lora.dropout} outside [0, 1)", "use e.g. 0.0 or 0.05")
    unknown = [t for t in lora.targets if t not in LORA_TARGETS]
    hf_names = {t: HF_PROJECTIONS[t] for t in unknown if t in HF_PROJECTIONS}
    if hf_names:  # peft's target_modules for Llama name the Hugging Face modules
        raise ConfigError("lora.targets", f"{', '.join(hf_names)} {'is' if len(hf_names) == 1 else 'are'} the "
                          "Hugging Face name of a projection, and the engine's model names them otherwise",
                          "write " + ", ".join(f"{v} for {k}" for k, v in hf_names.items()))
    if unknown or not lora.targets:
        raise ConfigError("lora.targets", f"{unknown or 'an empty list'} names no projection of a block",
                          f"use some of {', '.join(LORA_TARGETS)}")
    repeated = sorted({t for t in lora.targets if lora.targets.count(t) > 1})
    if repeated:  # counted twice by the FLOP count, listed twice in the peft export's target_modules
        raise ConfigError("lora.targets", f"{', '.join(repeated)} listed more than once", "name each projection once")


PEFT_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# adapter_config.json fields of peft's LoRA that the engine's (W x + alpha/r B A x on whole projections) lacks; those
# that change which tensors the adapter holds are also found by their keys and shapes, the others only here: aLoRA
# (alora_invocation_tokens) adds B A x only from its invocation tokens on, with plain LoRA's tensors, and was taken
# for LoRA on every token until 2026-12-02 (peft 0.21's newer variants are listed with it)
_PEFT_FEATURES = ("use_dora", "use_rslora", "fan_in_fan_out", "bias", "lora_bias", "modules_to_save", "rank_pattern",
                  "alpha_pattern", "layers_to_transform", "layer_replication", "exclude_modules", "target_parameters",
                  "alora_invocation_tokens", "use_qalora", "use_bdlora", "kasa_config", "monteclora_config",
                  "arrow_config", "trainable_token_indices")


def _validate_lora_init(lora: LoraConfig, model: ModelArgs) -> None:
    """lora.init_from: a peft adapter this model can hold (peft_adapter_lora), of this run's rank, alpha and
    targets."""
    theirs = peft_adapter_lora(lora.init_from, model, "lora.init_from")
    if (theirs.rank, theirs.alpha, sorted(theirs.targets)) != (lora.rank, lora.alpha, sorted(lora.targets)):
        raise ConfigError("lora.init_from", f"the adapter has r {theirs.rank}, lora_alpha {theirs.alpha:g} on "
                          f"{','.join(sorted(theirs.targets))}; this run rank {lora.rank}, alpha {lora.alpha:g} on "
                          f"{','.join(sorted(lora.targets))}", f"set lora.rank = {theirs.rank}, lora.alpha = "
                          f"{theirs.alpha:g} and lora.targets = {theirs.targets}")


def peft_adapter_lora(folder: str | os.PathLike, model: ModelArgs, field: str) -> LoraConfig:
    """The LoRA of a peft adapter folder (its r, lora_alpha and target_modules; init_from the folder), checked to be
    plain LoRA on a Llama block's projections holding a tensor of `model`'s shape for every adapter and nothing
    else (read from the files' headers, without torch). `field`: what to name in a refusal."""
    folder = Path(folder)
    missing = [name for name in PEFT_ADAPTER_FILES if not (folder / name).is_file()]
    if missing:
        raise ConfigError(field, f"{folder} has no {' and no '.join(missing)}", "point it at a peft adapter folder "
                          "(peft's save_pretrained, or shardwise export --format peft)")
    try:
        adapter = json.loads((folder / "adapter_config.json").read_text())
        header = _safetensors_header(folder / "adapter_model.safetensors")
    except (OSError, ValueError) as e:
        raise ConfigError(field, f"{folder}'s adapter cannot be read ({e})", "write it again with save_pretrained")
    if adapter.get("peft_type") != "LORA":
        raise ConfigError(field, f"{folder} holds a {adapter.get('peft_type')} adapter, not LoRA",
                          "point it at a LoRA adapter")
    other = [k for k in _PEFT_FEATURES if adapter.get(k) not in (None, False, "none", [], {})]
    if other:
        raise ConfigError(field, f"the adapter sets {', '.join(f'{k} = {adapter[k]!r}' for k in other)}, which the "
                          "engine's LoRA (alpha / r x B A on whole projections) does not have",
                          "start from a plain LoRA adapter")
    modules = adapter.get("target_modules")
    if not isinstance(modules, list) or not modules or any(m not in HF_PROJECTIONS for m in modules):
        raise ConfigError(field, f"its target_modules {modules!r} are not a list of a Llama block's projections",
                          f"start from an adapter on some of {', '.join(HF_PROJECTIONS)}")
    rank, alpha = adapter.get("r"), adapter.get("lora_alpha")
    if not (isinstance(rank, int) and rank > 0 and isinstance(alpha, (int, float)) and alpha > 0):
        raise ConfigError(field, f"its r {rank!r} and lora_alpha {alpha!r} are not a rank and a scale",
                          "write it again with save_pretrained")
    targets = [t for t in LORA_TARGETS if t in {HF_PROJECTIONS[m] for m in modules}]
    expected = peft_adapter_shapes(model, rank, targets)
    held = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    for key in sorted(expected.keys() | held.keys()):
        if held.get(key) != expected.get(key):
            what = ("has no tensor " + key if key not in held else f"holds {key} of shape {held[key]}, which this "
                    "model has no place for" if key not in expected else f"holds {key} of shape {held[key]}, this "
                    f"model's is {expected[key]}")
            raise ConfigError(field, f"{folder} {what}", "start from an adapter trained on this model's shape "
                              "(the base of its base_model_name_or_path)")
    return LoraConfig(rank=rank, alpha=float(alpha), targets=targets, init_from=str(folder))


def peft_adapter_shapes(model: ModelArgs, rank: int, targets: list[str]) -> dict[str, tuple[int, int]]:
    """The tensors a peft adapter of `rank` on `targets` holds for `model`, by the key peft saves each under
    (hf.to_peft_name's): lora_A (rank x in) and lora_B (out x rank) of every adapted projection of every block."""
    hf_name = {ours: theirs for theirs, ours in HF_PROJECTIONS.items()}
    shapes = {}
    for layer, target in itertools.product(range(model.n_layers), targets):
        module = "self_attn" if target in ("wq", "wk", "wv", "wo") else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{module}.{hf_name[target]}"
        fan_in, fan_out = projection_shapes(model)[target]
        shapes[f"{prefix}.lora_A.weight"], shapes[f"{prefix}.lora_B.weight"] = (rank, fan_in), (fan_out, rank)
    return shapes


def _validate_qlora(cfg: JobConfig, world_known: bool) -> None:
    if cfg.lora.qlora:
        error = qlora_error(cfg.model, cfg.lora.targets, cfg.parallel, ranks_known=world_known)
        if error is not None:
            raise error


def qlora_error(model: ModelArgs, targets: list[str], layout: Layout, ranks_known: bool = True) -> ConfigError | None:
    """What QLoRA of `targets` cannot run in this layout (None: it can): the NF4 base must be quantisable whole
    and, under FSDP, split into whole blocks of scalers per rank. The config refuses these jobs and the planner's
    search leaves these plans out.
    `ranks_known` False: a job that sets no data-parallel degree gets dp_shard from its world later (fit_world),
    so whether FSDP shards over a mesh of one is checked then."""
    if layout.tp > 1:
        return ConfigError("lora.qlora", f"tensor parallelism (tp={layout.tp}) would split NF4 weights along dim 1 "
                           "(row-wise wo/w2), and torchao's NF4 splits only along dim 0",
                           "set parallel.tp = 1 (shard the 4-bit base with FSDP: dp_shard > 1), or lora.qlora = false")
    # torchao quantises blocks of NF4_BLOCK_SIZE weights and double-quantises blocks of NF4_SCALER_BLOCK_SIZE
    # scalers: a weight must hold whole scaler blocks, and each FSDP shard (dim-0 chunk) whole ones too
    unit = NF4_BLOCK_SIZE * NF4_SCALER_BLOCK_SIZE
    shards = layout.dp_shard * layout.cp if layout.zero_stage >= 2 else 1
    # (a job that sets no dp degree: `--nproc 2` gives it dp_shard 2, which fit_world fills in and checks again)
    if layout.offload == "full" and shards == 1 and (ranks_known or layout.dp > 1):
        # offload runs FSDP2 over a mesh of one, whose shortcut (no all-gather) copies only the first of the parts
        # NF4 gathers (codes, block scales, factor): the first forward failed with a ValueError from torchao
        return ConfigError("lora.qlora", "with parallel.offload = 'full' and dp_shard x cp = 1, torch's FSDP2 shards "
                           "over a mesh of one, whose shortcut drops all but the first part of each NF4 weight",
                           "shard the 4-bit base over 2 ranks or more (parallel.dp_shard = 2, --nproc 2), or set "
                           "parallel.offload = 'none' (the NF4 base is already a quarter of bf16's bytes)")
    shapes = projection_shapes(model)
    for target in targets:
        inp, out = shapes[target]
        if out * inp % unit:
            return ConfigError("lora.qlora", f"{target}'s weight ({out} x {inp} = {out * inp}) is not a multiple of "
                               f"{unit} ({NF4_BLOCK_SIZE}-weight blocks x {NF4_SCALER_BLOCK_SIZE}-scaler blocks), "
                               "which NF4 needs", f"drop {target} from lora.targets or change the model's shape")
    # every target whole blocks first: the degrees that fit are then never none (1 always is)
    for target in targets:
        inp, out = shapes[target]
        if shards > 1 and not _cuts_into_nf4_shards(out, inp, shards):
            # the degrees every target cuts into: naming this target's alone, the next target was refused next
            fits = [n for n in range(1, min(shapes[t][0] * shapes[t][1] for t in targets) // unit + 1)
                    if all(_cuts_into_nf4_shards(*shapes[t][::-1], n) for t in targets)]
            return ConfigError("lora.qlora", f"FSDP cuts {target}'s NF4 weight ({out} x {inp}) into {shards} dim-0 "
                               f"chunks (dp_shard x cp), which must each hold a multiple of {unit} weights",
                               f"use dp_shard x cp = {' or '.join(map(str, fits))} (what every adapted weight cuts "
                               f"into), drop {target} from lora.targets, or use zero_stage 0/1 (the frozen base is "
                               "then not sharded)")
    return None


def _cuts_into_nf4_shards(out: int, inp: int, shards: int) -> bool:
    """An out x inp NF4 weight cut into `shards` dim-0 chunks of whole scaler blocks each."""
    return out % shards == 0 and out * inp % (NF4_BLOCK_SIZE * NF4_SCALER_BLOCK_SIZE * shards) == 0


def _validate_moe(cfg: JobConfig) -> None:
    m = cfg.model
    if m.n_experts == 0:
        return
    if m.n_experts < 0:
        raise ConfigError("model.n_experts", f"{m.n_experts} is negative", "set the routed experts, or 0 for dense")
    if not 1 <= m.top_k <= m.n_experts:
        raise ConfigError("model.top_k", f"{m.top_k} experts per token out of n_experts = {m.n_experts}",
                          f"pick top_k between 1 and {m.n_experts}")
    if m.top_k == 1 and m.route_norm:
        # w / w = 1: the one weight carries no gradient, so the loss never reaches the router (Switch Transformer's
        # top-1 weighs the expert's output by its score)
        raise ConfigError("model.route_norm", "with top_k = 1 it divides each token's one score by itself: every "
                          "weight is 1 and the router gets no gradient from the loss",
                          "set model.route_norm = false, or top_k >= 2")
    if not 0 <= m.n_dense_layers <= m.n_layers:
        raise ConfigError("model.n_dense_layers", f"{m.n_dense_layers} is outside 0..n_layers = {m.n_layers}",
                          f"pick 0 to {m.n_layers}")
    for key in ("moe_ffn_hidden", "n_shared_experts", "capacity_factor", "aux_loss_coeff", "z_loss_coeff",
                "bias_update_rate"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}", f"{getattr(m, key)} is negative", f"set model.{key} >= 0")
    if m.route_scale <= 0:
        raise ConfigError("model.route_scale", f"{m.route_scale} must be positive", "set model.route_scale > 0")
    if cfg.lora.rank:
        raise ConfigError("lora.rank", "LoRA adapts dense linears and a mixture of experts' experts are 3-D weights "
                          "with no adapters here", "set lora.rank = 0 (full fine-tuning) for an MoE model")


_MOE_FIELDS = ("top_k", "moe_ffn_hidden", "n_shared_experts", "n_dense_layers", "score_func", "router_dtype",
               "route_norm", "route_scale", "capacity_factor", "aux_loss_coeff", "z_loss_coeff", "bias_update_rate")
"""The [model] fields only a mixture of experts reads."""


def _validate_dense_model_has_no_moe_fields(m: ModelArgs) -> None:
    """A mixture's field set on a dense model (a dense preset taken for an MoE one, n_experts forgotten) changed
    nothing and trained a dense model without a word."""
    if m.n_experts:
        return
    for key in _MOE_FIELDS:
        if getattr(m, key) != ModelArgs.__dataclass_fields__[key].default:
            raise ConfigError(f"model.{key}", f"{getattr(m, key)!r} is a mixture of experts' field and model {m.name} "
                              "is dense (n_experts = 0), so it would change nothing",
                              f"set model.n_experts for a mixture of experts (or take an MoE preset such as "
                              f"debug-moe), or remove model.{key}")


def _validate_ep(cfg: JobConfig, world_known: bool) -> None:
    p, m = cfg.parallel, cfg.model
    _positive("parallel.ep", p.ep)
    error = expert_parallel_error(p, m.n_experts, f"model {m.name}", ranks_known=world_known)
    error = error or capacity_error(p, m.capacity_factor if m.n_experts else 0.0)
    if error is not None:
        raise error


def _validate_train(t: TrainConfig) -> None:
    for key in ("steps", "micro_batch", "grad_accum", "val_batches"):
        _positive(f"train.{key}", getattr(t, key))
    if t.global_batch < 0:
        raise ConfigError("train.global_batch", f"{t.global_batch} is negative",
                          "set the sequences per step, or 0 for micro_batch x grad_accum x dp")
    if t.global_batch and t.grad_accum != 1:
        raise ConfigError("train.global_batch", "set together with train.grad_accum, which it decides",
                          "set one of them")
    if t.val_every < 0:
        raise ConfigError("train.val_every", "negative", "use 0 to disable validation")
    _positive("train.loss_scale_init", t.loss_scale_init)
    _positive("train.collective_timeout_s", t.collective_timeout_s)
    _positive("train.loss_scale_growth_interval", t.loss_scale_growth_interval)
    if t.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("train.device", "CUDA is not available here", "use 'auto' or 'cpu'")


def _validate_rope_scaling(m: ModelArgs) -> None:
    """Llama 3.1's rotary scaling (model.rope_scaling_factor > 0): the bands its other fields set must exist."""
    if m.rope_scaling_factor < 0:
        raise ConfigError("model.rope_scaling_factor", f"{m.rope_scaling_factor} < 0",
                          "use 0 (plain rotary embedding) or Llama 3.1's factor (8; Llama 3.2: 32)")
    if not m.rope_scaling_factor:
        return
    _positive("model.rope_original_max_seq_len", m.rope_original_max_seq_len)
    if not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        raise ConfigError("model.rope_high_freq_factor", f"low {m.rope_low_freq_factor}, high "
                          f"{m.rope_high_freq_factor}: the scaling needs 0 < model.rope_low_freq_factor < "
                          "model.rope_high_freq_factor", "use Llama 3.1's 1.0 and 4.0")


_SETTABLE = {"expert_hidden": "moe_ffn_hidden", "head_dim": "attn_head_dim"}
"""network_fields' properties, by the [model] field that sets them (an expert's inner size is moe_ffn_hidden's, a
head's width attn_head_dim's)."""


def _validate_hf_shape(args: ModelArgs, folder: str) -> None:
    """The folder's weights fit the [model] config: found here, before anything starts, where it was found when
    the weights were read (after checkpoint.resume = false had already moved the earlier checkpoints aside)."""
    from shardwise.model_args import args_from_hf_config, compute_diffs, hf_biases, hf_rope_scaling, network_diffs

    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
        theirs = args_from_hf_config(raw)
    except (ValueError, KeyError, TypeError) as e:  # not JSON, or a model the engine cannot express
        raise ConfigError("checkpoint.init_from_hf", f"{folder}/config.json: {e}",
                          "point it at a Llama or Mixtral folder") from None

    def refuse(problem: str, diffs: list[tuple[str, object, object]]) -> None:
        if diffs:
            raise ConfigError("checkpoint.init_from_hf", f"{folder} {problem} (folder vs [model]: "
                              + ", ".join(f"{f} {a} vs {b}" for f, a, b in diffs) + ")",
                              "set " + ", ".join(f"model.{_SETTABLE.get(f, f)} = {json.dumps(a)}" for f, a, _ in diffs)
                              + " as the folder's config.json says")

    biases = hf_biases(raw)  # or no flag, as Qwen2's q/k/v biases: the tensors say so
    biases = f"config.json has {biases}" if biases else next(
        (f"weights hold {k}" for k in hf_tensor_names(folder) if k.endswith(".bias")), None)
    if biases:
        raise ConfigError("checkpoint.init_from_hf", f"{folder}'s {biases}: its projections add "
                          "biases, which the engine's Llama does not have (they would be dropped)",
                          "fine-tune a Llama whose projections have no biases")
    from shardwise.hf import unread_hf_tensors

    unread = unread_hf_tensors(hf_tensor_names(folder))
    if unread:
        more = f" and {len(unread) - 1} more" if len(unread) > 1 else ""
        raise ConfigError("checkpoint.init_from_hf", f"{folder}'s weights hold {unread[0]}{more}, which the engine's "
                          "Llama and Mixtral have no place for (they would be dropped, as Qwen3's q_norm and k_norm)",
                          "fine-tune a Llama, Mistral or Mixtral folder")
    scaling = hf_rope_scaling(raw)
    if scaling:
        raise ConfigError("checkpoint.init_from_hf", f"{folder}/config.json asks for {scaling!r} rotary scaling, "
                          "which the engine's rotary embedding does not have (its logits would not be the model's)",
                          "fine-tune a model with plain rotary embeddings (rope_type 'default') or Llama 3.1's "
                          "scaling (rope_type 'llama3')")
    # the weights were trained with the folder's norm epsilon, rotary base and scaling: until 2026-11-28 the
    # [model]'s (a custom shape's defaults: rope_theta 10000) replaced them without a word, and the imported model's
    # logits were not the folder's. Shape and values in one line: a [model] written from the shape alone was
    # refused twice, the second time for the rotary values
    shape, values = network_diffs(theirs, args), compute_diffs(theirs, args)
    refuse(" and ".join(p for p, d in (("holds another model shape", shape),
                                       ("was trained with other values", values)) if d), shape + values)


def fit_world(cfg: JobConfig, world_size: int) -> None:
    """Fit a job to its world: a job that sets no data-parallel degree runs data parallel over the ranks its other
    degrees leave (dp_shard for ZeRO-2/3, else dp_replicate); one that sets train.global_batch accumulates the
    micro-batches that batch needs on that many data-parallel ranks."""
    p = cfg.parallel
    if p.dp == 1 and world_size > p.world_size and world_size % p.world_size == 0:
        key = "dp_shard" if p.zero_stage >= 2 else "dp_replicate"
        cfg.parallel = p = dataclasses.replace(p, **{key: world_size // p.world_size})
    t = cfg.train
    if t.global_batch:
        if t.global_batch % (t.micro_batch * p.dp):
            raise ConfigError(
                "train.global_batch", f"{t.global_batch} sequences do not split into micro-batches of "
                f"{t.micro_batch} on {p.dp} data-parallel ranks",
                f"make it a multiple of micro_batch x dp = {t.micro_batch * p.dp}")
        cfg.train = dataclasses.replace(t, grad_accum=t.global_batch // (t.micro_batch * p.dp))


def check_restarts(cfg: JobConfig, restarts: int) -> None:
    """torchrun's restarts of a job whose rank failed go on from its newest checkpoint only when the run saves and
    resumes them: otherwise each restart trained from the initialisation again, moving the first attempt's
    checkpoints aside under checkpoint.resume = false (the demo's), and the job still ended with exit code 0.
    `launch slurm --requeue` and an elastic job refuse the same."""
    if restarts > 0 and not (cfg.checkpoint.enabled and cfg.checkpoint.resume):
        field = "checkpoint.enabled" if not cfg.checkpoint.enabled else "checkpoint.resume"
        raise ConfigError(field, f"--max-restarts {restarts} starts the job again when a rank fails, which goes on "
                          "from its newest checkpoint only with checkpoints saved and resumed (without, each restart "
                          "trains from the start)", f"set {field} = true, or leave out --max-restarts")


def fit_nodes(cfg: JobConfig, nproc: int, nodes: tuple[int, int]) -> None:
    """Check the job on every world it may run on (nproc x each number of machines in the range), before any
    process starts; an elastic job also needs the checkpoints it restarts from. Leaves cfg fitted to the largest."""
    low, high = nodes
    if low < high and not (cfg.checkpoint.enabled and cfg.checkpoint.resume):
        field = "checkpoint.enabled" if not cfg.checkpoint.enabled else "checkpoint.resume"
        raise ConfigError(field, "an elastic job restarts from its newest checkpoint when a machine leaves or joins",
                          f"set {field} = true")
    if low < high and not cfg.train.global_batch:
        _elastic_batch(cfg, nproc, nodes)
    for n in range(low, high + 1):
        world = n * nproc
        fitted = copy.deepcopy(cfg) if n < high else cfg
        try:
            fit_world(fitted, world)
            validate_parallel(fitted, world)
        except ConfigError as e:
            if low == high:
                raise
            on = f"{n} machine{'s' * (n > 1)} ({world} rank{'s' * (world > 1)})"
            raise ConfigError(e.field, f"on {on}: {e.problem}", e.fix) from None


def _elastic_batch(cfg: JobConfig, nproc: int, nodes: tuple[int, int]) -> None:
    """An elastic job that fills data parallelism from its world and sets no global batch would train a different
    batch on each world, and a restart cannot resume a data loader saved under another batch: refuse it, naming a
    global batch that splits on every world in the range (the largest world's batch, rounded up to one)."""
    t = cfg.train
    dps = set()
    for n in range(nodes[0], nodes[1] + 1):
        fitted = copy.deepcopy(cfg)
        fit_world(fitted, n * nproc)
        dps.add(fitted.parallel.dp)
    if len(dps) == 1:
        return
    step = t.micro_batch * math.lcm(*dps)
    batch = -(-t.micro_batch * t.grad_accum * max(dps) // step) * step
    raise ConfigError("train.global_batch", f"an elastic job's data-parallel degree follows its machines "
                      f"({', '.join(map(str, sorted(dps)))} ranks), and without a global batch its batch would change "
                      "with them, which a restart cannot resume",
                      f"set train.global_batch = {batch} (it splits on every world in the range)")


def validate_parallel(cfg: JobConfig, world_size: int | None = None) -> None:
    """How the parallel degrees fit the model, the batch and the world; runs before any process group exists."""
    p = cfg.parallel
    for key in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "virtual_stages", "bucket_mb"):
        _positive(f"parallel.{key}", getattr(p, key))
    if world_size is not None and p.world_size != world_size:
        raise ConfigError(
            "parallel", f"dp_replicate x dp_shard x tp x pp x cp = {p.world_size} but the world has {world_size} ranks",
            f"make the degrees multiply to {world_size}, or launch {p.world_size} processes",
        )
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError("parallel.zero_stage", f"{p.zero_stage} is not 0-3", "use 0, 1, 2 or 3")
    _positive("parallel.activation_checkpoint_every", p.activation_checkpoint_every)
    if p.activation_checkpoint == "none" and p.activation_checkpoint_every != 1:  # it was ignored
        raise ConfigError("parallel.activation_checkpoint_every",
                          f"checkpoint every {p.activation_checkpoint_every} blocks, and activation_checkpoint = none",
                          "set parallel.activation_checkpoint to full or selective, or leave the interval out")
    if p.dp_shard > 1 and p.zero_stage < 2:
        raise ConfigError(
            "parallel.dp_shard", f"sharding over {p.dp_shard} ranks needs zero_stage 2 or 3 (FSDP)",
            "set parallel.zero_stage = 2 or 3, or use parallel.dp_replicate for ZeRO-0/1",
        )
    # (with ep > 1 it is ep's own check that names what is wrong: ZeRO-3 is its default, and it needs dp_shard x cp)
    if p.zero_stage >= 2 and p.dp_shard * p.cp == 1 and p.dp_replicate > 1 and p.ep == 1:
        raise ConfigError(
            "parallel.zero_stage", f"ZeRO-{p.zero_stage} shards over dp_shard, which is 1",
            "set parallel.dp_shard > 1 (HSDP keeps dp_replicate), or use zero_stage 0/1",
        )
    _validate_tp(cfg)
    _validate_pp(cfg)
    _validate_ep(cfg, world_size is not None)
    if p.cp > 1 and cfg.data.seq_len % (2 * p.cp):
        raise ConfigError(
            "data.seq_len", f"{cfg.data.seq_len} is not divisible by 2 x cp = {2 * p.cp} (load-balanced chunks)",
            f"use a multiple of {2 * p.cp * p.tp if p.sequence_parallel else 2 * p.cp}",
        )
    error = engine_cannot_run(p, cfg.train.precision, cfg.train.compile, cfg.optim.name)
    if error is not None:
        raise error
    # here, not only in validate: `--nproc 3` with zero_stage 3 and no degree set shards the NF4 base over the
    # world that fit_world fills in, and a base that does not cut into 3 was a traceback from every rank's FSDP
    _validate_qlora(cfg, world_size is not None)


def _validate_tp(cfg: JobConfig) -> None:
    p = cfg.parallel
    if p.tp == 1 and p.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel", "needs tp > 1", "set parallel.tp > 1 or turn it off")
    error = tp_error(cfg.model, p, cfg.data.seq_len)
    if error is not None:
        raise error


def tied_pipeline_error(model: ModelArgs, layout: Layout) -> ConfigError | None:
    """A head tied to the embedding in a pipeline: the engine puts them on different stages and does not keep the
    two copies in step (Megatron all-reduces their gradients between the first and last stage; we do not)."""
    if layout.pp > 1 and model.tie_embeddings:
        return ConfigError("model.tie_embeddings", "the embedding and head sit on different pipeline stages",
                           "set tie_embeddings = false with pp > 1")
    return None


def tp_error(model: ModelArgs, layout: Layout, seq_len: int) -> ConfigError | None:
    """What tensor parallelism cannot split in this model (None: it can): tp must divide the heads, the KV heads,
    the MLP's width and the vocabulary, and under sequence parallelism each cp rank's tokens. The config refuses
    these jobs and the planner's search leaves these plans out."""
    tp = layout.tp
    if tp == 1:
        return None
    for key, what in (("n_heads", "attention heads"), ("n_kv_heads", "KV heads"), ("ffn_hidden", "MLP width"),
                      ("vocab_size", "vocabulary rows")):
        if getattr(model, key) % tp:
            return ConfigError(
                "parallel.tp", f"tp={tp} does not divide model.{key}={getattr(model, key)} ({what})",
                "pick tp among the common divisors of n_heads, n_kv_heads, ffn_hidden and vocab_size: "
                + ", ".join(str(d) for d in range(1, model.n_kv_heads + 1) if not any(
                    getattr(model, k) % d for k in ("n_heads", "n_kv_heads", "ffn_hidden", "vocab_size"))),
            )
    local_seq = seq_len // layout.cp
    if layout.sequence_parallel and local_seq % tp:
        return ConfigError(
            "data.seq_len", f"sequence parallel splits {local_seq} tokens per cp rank over tp={tp}",
            "make data.seq_len / cp divisible by tp",
        )
    return None


def _validate_pp(cfg: JobConfig) -> None:
    p, m = cfg.parallel, cfg.model
    if p.pp == 1:
        if p.virtual_stages > 1:
            raise ConfigError("parallel.virtual_stages", "needs pp > 1", "set parallel.pp > 1 or virtual_stages = 1")
        if p.pp_microbatches:  # it was ignored
            raise ConfigError("parallel.pp_microbatches", f"{p.pp_microbatches} pipeline micro-batches, and pp = 1",
                              "set parallel.pp > 1, or leave pp_microbatches out (train.grad_accum accumulates)")
        if p.pp_schedule != Layout.pp_schedule:  # it was ignored (the default names no choice: nothing to drop)
            raise ConfigError("parallel.pp_schedule", f"{p.pp_schedule} schedules pipeline stages, and pp = 1",
                              "set parallel.pp > 1, or leave pp_schedule out")
        return
    if p.pp_schedule == "interleaved-1f1b" and p.virtual_stages < 2:
        raise ConfigError("parallel.virtual_stages", "interleaved-1f1b needs >= 2 stages per rank",
                          "set it to 2 or more")
    if p.pp_schedule in ("gpipe", "1f1b") and p.virtual_stages != 1:
        raise ConfigError(
            "parallel.virtual_stages", f"{p.pp_schedule} runs one stage per rank",
            "set virtual_stages = 1, or pp_schedule = 'interleaved-1f1b'",
        )
    if p.pp_schedule == "zero-bubble" and p.virtual_stages not in (1, 2):
        raise ConfigError("parallel.virtual_stages", "zero-bubble (ZBV) runs exactly 2 stages per rank",
                          "leave virtual_stages at 1 or 2")
    stages = p.pp * p.stages_per_rank
    if m.n_layers < stages:
        raise ConfigError(
            "model.n_layers", f"{m.n_layers} layers cannot fill pp x stages per rank = {stages} stages",
            f"use at least {stages} layers, or fewer pipeline stages",
        )
    if error := tied_pipeline_error(m, p):
        raise error
    n = p.n_microbatches
    if cfg.train.micro_batch % n:
        least = 1 if p.pp_schedule == "gpipe" else p.pp  # every other schedule takes one per stage at least
        fits = [d for d in range(least, cfg.train.micro_batch + 1) if cfg.train.micro_batch % d == 0]
        raise ConfigError(
            "train.micro_batch", f"{cfg.train.micro_batch} sequences cannot be cut into {n} pipeline micro-batches",
            f"make train.micro_batch a multiple of {n}"
            + (f", or set parallel.pp_microbatches to one of {', '.join(map(str, fits))}" if fits else ""),
        )
    error = pipeline_batch_error(p, n)
    if error is not None:
        raise error
    # one schedule step runs all grad_accum x n micro-batches of an optimizer step (see parallel/pipeline.py)
    steps = n * cfg.train.grad_accum
    rounds = max(1, steps // p.pp)
    if p.pp_schedule == "interleaved-1f1b" and steps % rounds:
        raise ConfigError(
            "parallel.pp_microbatches",
            f"interleaved-1f1b runs the {steps} micro-batches of a step (grad_accum x {n}) in rounds of pp={p.pp}, "
            f"and {rounds} rounds do not divide them", f"make pp_microbatches x grad_accum a multiple of {p.pp}",
        )
