"""A run folder's checkpoints as files, without torch: which are complete (scan_checkpoints), and what a resumed run
must agree with in the newest one (check_resume). The launcher reads them before it starts any process, as it reads
the config: a resume that changed the model, the optimizer, the batch or train.steps was refused by every rank only
after each had imported torch, built its model and read the data (seconds to minutes; under Slurm, after the queue).
shardwise.checkpoint.load checks the same things again, with everything else (keys, sizes, checksums), in the ranks.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.errors import CheckpointError, ConfigError
from shardwise.model_args import ModelArgs, network_diffs

FORMAT = "shardwise-checkpoint"
VERSION = 1
META, TRAIN_STATE, DCP_METADATA = "meta.json", "train_state.json", ".metadata"
STEP_DIR = re.compile(r"step_(\d+)")
REPLACED_DIR = re.compile(r"step_(\d+)\.replaced")
UNFINISHED_DIR = re.compile(r"step_\d+\.tmp")

MOVE_ASIDE = "move this step's folder out of the run's checkpoints/ folder: the one before it is then the newest"
"""The fix for a damaged checkpoint: a run resumes from (and export and generate read) the newest complete one."""

# what save writes into each JSON file: key -> the types its value may have
_META_SHAPE = {"format": (str,), "version": (int,), "step": (int,), "model": (dict,), "files": (dict,),
               "world_size": (int,), "optimizer": (str, type(None)), "lora": (dict, type(None))}
_TRAIN_STATE_SHAPE = {"step": (int,), "lr_schedule": (dict, type(None)), "grad_scaler": (dict, type(None)),
                      "data_loader": (dict, type(None)), "optimizer_param_groups": (dict,)}

OPTIMIZER_CLASSES = {"adamw": "AdamW", "adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit", "adafactor": "Adafactor",
                     "sgd": "SGD", "momentum": "SGD"}
"""The class each optim.name builds (shardwise.optim.build_optimizer): a checkpoint records its optimizer by it."""
OPTIMIZER_NAMES = {"AdamW": "'adamw'", "SGD": "'sgd' or 'momentum' (torch's SGD, without or with momentum)",
                   "AdamW8bit": "'adamw8bit'", "AdamW4bit": "'adamw4bit'", "Adafactor": "'adafactor'"}
"""optim.name for each optimizer class a checkpoint names."""


@dataclass
class Scan:
    complete: list[tuple[int, Path]]
    """(step, folder) of every complete checkpoint, oldest first."""
    partial: list[tuple[Path, str]]
    """(folder, why) of every partial one: an unfinished write, or a folder missing its metadata."""


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def scan_checkpoints(run_dir: str | os.PathLike) -> Scan:
    """Complete and partial checkpoints under run_dir/checkpoints (no reading beyond file names)."""
    root = checkpoint_root(run_dir)
    complete, partial = [], []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if not entry.is_dir():
            continue
        m = STEP_DIR.fullmatch(entry.name)
        replaced = REPLACED_DIR.fullmatch(entry.name)
        if replaced is not None and not entry.with_name(f"step_{replaced.group(1)}").exists():
            m = replaced  # a committed checkpoint whose replacement (the same step saved again) never arrived
        if m is None:
            unfinished = UNFINISHED_DIR.fullmatch(entry.name) or replaced is not None
            partial.append((entry, "unfinished write (never committed)" if unfinished
                            else "not a checkpoint's name (step_<N>); left alone"))
            continue
        missing = [f for f in (META, TRAIN_STATE, DCP_METADATA) if not (entry / f).is_file()]
        if missing:
            partial.append((entry, f"missing {', '.join(missing)}"))
        else:
            complete.append((int(m.group(1)), entry))
    return Scan(sorted(complete), partial)


def _read_json(path: Path, name: str) -> dict:
    try:
        return json.loads((path / name).read_text())
    except FileNotFoundError:
        raise CheckpointError(path, f"{name} is missing (an unfinished or damaged save)",
                              MOVE_ASIDE) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(path, f"{name} is not valid JSON ({e})", MOVE_ASIDE) from None


def _check_shape(path: Path, name: str, value: Any, shape: dict) -> None:
    """A JSON file of the checkpoint holds what save writes (valid JSON can still be damaged or hand-edited)."""
    if not isinstance(value, dict):
        problem = f"{name} holds a {type(value).__name__}, not the object save writes"
    else:
        wrong = next(((k, v) for k, v in shape.items()
                      if k not in value or not isinstance(value[k], v) or isinstance(value[k], bool)), None)
        problem = None if wrong is None else (
            f"{name} has no {wrong[0]!r}" if wrong[0] not in value else
            f"{name}'s {wrong[0]!r} is {value[wrong[0]]!r}, not a {' or '.join(t.__name__ for t in wrong[1])}")
        files = value.get("files") if problem is None and name == META else {}
        bad = next((f for f, info in files.items() if not isinstance(info, dict) or not all(
            isinstance(info.get(k), int) and not isinstance(info.get(k), bool) for k in ("bytes", "crc32"))), None)
        if problem is None and bad is not None:
            problem = f"{name}'s entry for file {bad} lacks its size or CRC32"
    if problem:
        raise CheckpointError(path, f"{problem} (damaged or edited)", MOVE_ASIDE)


def read_checkpoint_json(path: Path) -> tuple[dict, dict]:
    """The checkpoint's meta.json and train_state.json, each checked to hold what save writes."""
    meta, train_state = _read_json(path, META), _read_json(path, TRAIN_STATE)
    _check_shape(path, META, meta, _META_SHAPE)
    _check_shape(path, TRAIN_STATE, train_state, _TRAIN_STATE_SHAPE)
    return meta, train_state


def check_model(path: Path, meta: dict, model_args: ModelArgs) -> ModelArgs:
    """The checkpoint's format, and a model the weights fit; returns the model it was saved with."""
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(path, f"format {meta.get('format')!r} version {meta.get('version')!r} is not "
                              f"{FORMAT} version {VERSION}", "load it with the shardwise version that wrote it")
    saved = meta.get("model", {})
    # a field newer than the checkpoint takes its default there (a dense model's n_experts = 0)
    written = ModelArgs(**{k: v for k, v in saved.items() if k in ModelArgs.__dataclass_fields__})
    diffs = [f"{f} {a} vs {b}" for f, a, b in network_diffs(written, model_args)]
    if diffs:
        raise CheckpointError(path, f"it holds a different model (checkpoint vs this run: {', '.join(diffs)})",
                              "set the [model] config to the checkpoint's shape, or start a new run folder")
    return written


def check_optimizer(path: Path, saved: str | None, mine: str) -> None:
    """The optimizer the state was saved from (its class name) is the run's."""
    if saved != mine:
        raise CheckpointError(path, f"it holds {saved} state, this run uses {mine}",
                              f"set optim.name = {OPTIMIZER_NAMES.get(saved, 'the checkpoint optimizer')}")


def loader_fixes(saved: dict) -> dict[str, str]:
    """How to give a data loader the order the saved one (its state_dict) had, by the value that differs."""
    return {"seed": "set train.seed as the run had it",
            "global_batch": f"set train.global_batch = {saved.get('global_batch')} (sequences per step: the "
                            "micro-batch and accumulation then follow on any layout)",
            "num_samples": "read the same data as the run did (data.seq_len, the files and the split decide how "
                           "many samples there are)"}


def lora_text(spec: dict | None) -> str:
    if spec is None:
        return "no LoRA (every weight)"
    base = {True: " on an NF4 base (QLoRA)", False: " on an unquantised base"}.get(spec.get("qlora"), "")
    return f"LoRA rank {spec['rank']}, alpha/rank {spec['scale']:g}, targets {','.join(spec['targets'])}{base}"


def check_lora(path: Path, saved: dict | None, mine: dict | None) -> None:
    """An adapter checkpoint resumes only into the same adapters (it holds nothing else), and a full one only
    into full training (a LoRA run starts from a base through checkpoint.init_from_hf, not through resume)."""
    if saved is not None and mine is not None and "qlora" not in saved:  # recorded since 2026-11-28
        mine = {k: v for k, v in mine.items() if k != "qlora"}
    if saved == mine:
        return
    if saved is not None and not (isinstance(saved.get("rank"), int) and isinstance(saved.get("scale"), (int, float))
                                  and isinstance(saved.get("targets"), list)):
        raise CheckpointError(path, f"{META}'s 'lora' is {saved!r} (damaged or edited)", MOVE_ASIDE)
    # QLoRA's adapters were trained against the NF4-rounded base: resumed or exported onto the unquantised one (or
    # the other way), they would adapt other weights, and until 2026-11-28 they did, without a word
    qlora = f", lora.qlora = {str(saved['qlora']).lower()}" if saved is not None and "qlora" in saved else ""
    fix = (f"set lora.rank = {saved['rank']}, lora.alpha = {saved['rank'] * saved['scale']:g} and lora.targets = "
           f"{json.dumps(saved['targets'])}{qlora}, as the checkpoint was saved" if saved is not None else
           "set lora.rank = 0, or export the run (shardwise export) and start a LoRA run on it with "
           "checkpoint.init_from_hf in a new run folder")
    raise CheckpointError(path, f"it holds {lora_text(saved)}, this run trains {lora_text(mine)}", fix)


def lora_base_identity(init_from_hf: str) -> dict | None:
    """What a LoRA run's frozen base is, as its checkpoints record it: None for the seeded init (train.seed is
    checked with the data loader), else the Hugging Face folder's path, a digest of its config.json, and the size
    and a digest of both ends of each weight file. An adapter checkpoint holds no base: resumed or exported onto
    another, it would apply its adapters to weights they were not trained with, silently."""
    if not init_from_hf:
        return None
    folder = Path(init_from_hf).resolve()
    config = folder / "config.json"
    weights = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    return {"init_from_hf": str(folder),
            "config_crc32": zlib.crc32(config.read_bytes()) if config.is_file() else None,
            "weights": {f.name: [f.stat().st_size, _ends_crc32(f)] for f in weights}}


def _ends_crc32(file: Path, span: int = 1 << 20) -> int:
    """CRC32 of a file's first and last MiB: for a weight file, its header and tensors at both ends. Two bases of
    one architecture (a model and its instruction-tuned version) have the same sizes and often the same
    config.json, not the same weights; reading whole multi-GB files at every start would be slow."""
    with file.open("rb") as f:
        head = f.read(span)
        f.seek(max(0, file.stat().st_size - span))
        return zlib.crc32(f.read(span), zlib.crc32(head))


def check_lora_base(path: Path, saved: dict | None, mine: dict | None) -> None:
    """The adapters resume or export only onto the base they were trained on; a base folder moved elsewhere with
    the same contents is the same base."""
    if saved is None and mine is None:
        return
    if saved is not None and not isinstance(saved.get("init_from_hf"), str):
        raise CheckpointError(path, f"{META}'s 'lora_base' is {saved!r} (damaged or edited)", MOVE_ASIDE)
    if saved is not None and mine is not None and {k: v for k, v in saved.items() if k != "init_from_hf"} == {
            k: v for k, v in mine.items() if k != "init_from_hf"}:
        return
    if saved is None:
        raise CheckpointError(path, "its adapters were trained on the seeded base (no checkpoint.init_from_hf), this "
                              f"run puts them on {mine['init_from_hf']}", "set checkpoint.init_from_hf = ''")
    where = f"the base in {saved['init_from_hf']}"
    if mine is None:
        raise CheckpointError(path, f"its adapters were trained on {where}, this run has no checkpoint.init_from_hf",
                              f"set checkpoint.init_from_hf = '{saved['init_from_hf']}'")
    raise CheckpointError(path, f"its adapters were trained on {where}, and {mine['init_from_hf']} holds other "
                          "weights (config.json or weight files differ)",
                          f"set checkpoint.init_from_hf to that base ('{saved['init_from_hf']}')")


def config_adapter_spec(cfg) -> dict | None:
    """`lora.adapter_spec` of the model `cfg` builds, from the config alone (no torch): apply_lora adapts each of
    lora.targets in every block, all of them nn.Linear (the config refuses LoRA on a mixture of experts, whose
    experts are 3-D weights). tests/test_lora.py holds it equal to adapter_spec of built models."""
    lora = cfg.lora
    if not lora.rank:
        return None
    return {"rank": lora.rank, "scale": lora.alpha / lora.rank, "targets": sorted(lora.targets), "qlora": lora.qlora}


def check_steps(cfg, step: int) -> None:
    """train.steps and train.stop_after against the step a resumed run goes on from (`step`: its checkpoint's)."""
    t, out = cfg.train, cfg.metrics.out_dir
    if step > t.steps:
        raise ConfigError("train.steps", f"{t.steps} is below step {step}, where the run in {out} has its newest "
                          "checkpoint", f"set train.steps above {step} to go on, or use another metrics.out_dir for a "
                          "new run")
    if 0 < t.stop_after <= step:  # it would never fire: the run would train to its end
        raise ConfigError("train.stop_after", f"{t.stop_after} is before step {step + 1}, where the run in {out} "
                          "goes on", f"set it to {step + 1} or later, or 0")


def check_resume(cfg) -> None:
    """Before any process starts: the run the config resumes (its newest complete checkpoint, when it resumes one)
    goes on with this config, as far as the checkpoint's JSON tells (the model, the optimizer, the data order, the
    steps); a mismatch is the one line the ranks' load would raise. `cfg` fitted to its world (config.fit_nodes)."""
    if not (cfg.checkpoint.enabled and cfg.checkpoint.resume):
        return
    complete = scan_checkpoints(cfg.metrics.out_dir).complete
    if not complete:
        return
    path = complete[-1][1]
    meta, train_state = read_checkpoint_json(path)
    check_steps(cfg, train_state["step"])
    check_model(path, meta, cfg.model)
    check_lora(path, meta.get("lora"), config_adapter_spec(cfg))  # in the order load checks them
    # recorded since 2026-11-28; one that is neither a dict nor null is damaged, which the ranks' load says
    if meta.get("lora") is not None and "lora_base" in meta and isinstance(meta["lora_base"], (dict, type(None))):
        check_lora_base(path, meta["lora_base"], lora_base_identity(cfg.checkpoint.init_from_hf))
    if meta["optimizer"] is not None:
        check_optimizer(path, meta["optimizer"], OPTIMIZER_CLASSES[cfg.optim.name])
    saved = train_state["data_loader"] or {}
    mine = {"seed": cfg.train.seed, "global_batch": cfg.train.micro_batch * cfg.train.grad_accum * cfg.parallel.dp}
    for key, fix in loader_fixes(saved).items():
        if key in mine and key in saved and saved[key] != mine[key]:
            raise CheckpointError(path, f"the data loader was saved with {key}={saved[key]}, this run has "
                                  f"{mine[key]}", fix)
