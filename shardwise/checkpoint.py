"""Checkpoints: the whole training state, saved sharded with torch.distributed.checkpoint (DCP), loadable
under any parallel layout.

What a checkpoint holds, and in which form (every form is independent of the layout that wrote it):
- model: `get_model_state_dict` of this rank's parts, keyed by the full-model parameter name; DTensors are
  written as the shards they are, and DCP cuts whatever the loading layout asks for out of them (resharding).
  A LoRA model's checkpoint holds its adapters only (meta.json records their rank, alpha / rank and targets):
  the frozen base is rebuilt at resume from where it came from (the seeded init, or checkpoint.init_from_hf).
- optimizer: `get_optimizer_state_dict` in its flattened form ("state.<param>.exp_avg"), whose tensors are
  shaped like their parameter. parallel.data_parallel gives and takes that form for any optimizer: ZeRO-1's,
  which keeps a 1/N slice of each local tensor, all-gathers its slices into it and cuts them out again, so a
  ZeRO-1 checkpoint loads under ZeRO-3 and back.
- per rank: the torch CPU (and CUDA) RNG states; a layout with another world size takes rank r % saved world.
- train_state.json: step, LR schedule, loss scaler, data-loader position and the optimizer's hyperparameters
  (lr, betas, ...), all plain numbers. DCP would pickle these, and loading pickles runs arbitrary code.
- meta.json: format version, step, model shape, layout, and the size and CRC32 of every file.

Atomic: ranks write into `checkpoints/step_<N>.tmp`; once every rank's data is written (DCP's save is
collective and returns only after its coordinator wrote `.metadata`), rank 0 writes meta.json and renames the
folder to `step_<N>`. A folder without that name and both metadata files is partial and is never loaded.
Saving a step that already has a checkpoint moves the old one to `step_<N>.replaced` until the new one is in; a
crash between the two renames leaves `step_<N>.replaced`, which counts as step N's checkpoint. Other folders (a
user's `step_<N>.old` backup, say) are never loaded, counted or deleted.

Safe: every check (model shape, keys, sizes, dtypes, file sizes, checksums) runs before a single tensor is
read into the model, and fails with a one-line `CheckpointError` naming the path and the fix. DCP's
`.metadata` (a pickle) is read with an unpickler that admits only DCP's metadata classes and torch dtypes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import pickle
import re
import shutil
import signal
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from shardwise.errors import CheckpointError
from shardwise.lora import adapter_spec, is_adapter
from shardwise.model import canonical_name, cpu_attention_forms, restore_cpu_attention_forms
from shardwise.model_args import ModelArgs
from shardwise.parallel.data_parallel import (
    optimizer_load_targets,
    optimizer_name,
    optimizer_state_dict,
    set_optimizer_state,
)
from shardwise.run_folder import (
    DCP_METADATA,
    FORMAT,
    META,
    MOVE_ASIDE,
    REPLACED_DIR,
    TRAIN_STATE,
    UNFINISHED_DIR,
    VERSION,
    Scan,
    check_lora,
    check_lora_base,
    check_model,
    check_optimizer,
    checkpoint_root,
    loader_fixes,
    read_checkpoint_json,
    scan_checkpoints,
)

log = logging.getLogger("shardwise.checkpoint")


@dataclass
class TrainState:
    """Everything the training loop owns that a checkpoint restores (built fresh before `load`)."""

    parts: list[nn.Module]
    """This rank's model: [model], or its pipeline stage modules (Pipeline.stages)."""
    optimizer: Any = None
    """The optimizer over all of `parts` (a torch Optimizer, or ZeRO-1's sharded one); None: weights only."""
    schedule: Any = None
    """The LR scheduler (LambdaLR), or None."""
    scaler: torch.amp.GradScaler | None = None
    """The loss scaler, or None."""
    loader: Any = None
    """The data loader (anything with state_dict/load_state_dict of plain numbers), or None."""


# ---------------------------------------------------------------------------------------------------
# Finding checkpoints


EARLIER = "earlier"
"""Where a run started over (checkpoint.resume = false) puts what an earlier run left in its folder: a run folder
of its own (its checkpoints and records), which `export --run` and `generate --run` read."""


def set_aside(run_dir: str | os.PathLike, records: tuple[str, ...] = (), read: tuple[str, ...] = (),
              why: str = "checkpoint.resume = false") -> list[int]:
    """Move the run folder's checkpoints to <run_dir>/earlier/checkpoints (earlier-2, -3, ... when an earlier
    start-over is there: nothing is deleted), with the `records` of the run that saved them (its job_config.json,
    metrics log, tokenizer: the new run rewrites them, and the checkpoints could no longer be exported), so that a
    run started from scratch in the folder never mixes its saves with them and a later resume goes on from its own;
    the steps moved (collective: rank 0 moves them and returns their steps, every rank waits). A record among the
    files the new run `read`s (data.tokenizer set to the run's own tokenizer.json) is copied: moved, the new run
    found no tokenizer. `why`: the setting that makes the run start over, for the warning. A move the file system
    refuses is a CheckpointError on every rank (until 2026-12-03 rank 0's traceback, the others waiting)."""
    root = checkpoint_root(run_dir)
    # rank 0 alone reads the folder: another rank's scan could list checkpoints/ as rank 0 moved it away
    scan = scan_checkpoints(run_dir) if _rank() == 0 else Scan([], [])
    steps = [step for step, _ in scan.complete]
    earlier, error = Path(run_dir) / EARLIER, None
    if steps or scan.partial:
        n = 1
        while earlier.exists():
            n += 1
            earlier = earlier.with_name(f"{EARLIER}-{n}")
        try:
            earlier.mkdir()
            root.rename(earlier / root.name)
            inputs = {Path(path).expanduser().resolve() for path in read}
            for name in records:
                record = Path(run_dir) / name
                if record.resolve() in inputs and record.is_file():
                    shutil.copy2(record, earlier / name)
                elif record.exists():
                    record.rename(earlier / name)
        except OSError as e:  # a read-only folder, a full disk: every rank raises one line, none waits
            error = f"{e} (nothing was deleted; what had moved is in {earlier})"
        else:
            log.warning("%s: the run starts over, and the checkpoints of the earlier run in %s (steps %s) are moved "
                        "with its records to %s (a run folder: export --run reads it)", why, run_dir,
                        ", ".join(map(str, steps)) or "none complete", earlier)
    refused = _agree(error)  # also the barrier after rank 0's moves
    if refused:
        raise CheckpointError(root, f"{why}: setting the earlier run's checkpoints aside failed: {refused}",
                              "make metrics.out_dir writable (or free space there) and start again, or use a new "
                              "metrics.out_dir")
    return steps


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of the run, or None; partial ones are logged (by rank 0) and skipped."""
    scan = scan_checkpoints(run_dir)
    for folder, why in scan.partial if _rank() == 0 else []:
        log.warning("ignoring partial checkpoint %s: %s", folder, why)
    return scan.complete[-1][1] if scan.complete else None


# ---------------------------------------------------------------------------------------------------
# Names: parts -> the full model's parameter names


def _container(parts: list[nn.Module]) -> nn.Module:
    return parts[0] if len(parts) == 1 else nn.ModuleList(parts)


def _canonical(key: str, multi: bool) -> str:
    """A state-dict key of the container with the part index (pipeline stages) removed."""
    if not multi:
        return key
    for prefix in ("state.", "param_groups.", ""):
        if key.startswith(prefix) and re.match(r"\d+\.", key[len(prefix):]):
            rest = key[len(prefix):]
            return prefix + rest[rest.index(".") + 1:]
    return key


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every save/load without a process group; one process is a normal case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# ---------------------------------------------------------------------------------------------------
# The state in checkpoint form: flat dict of tensors (DCP) + plain numbers (JSON)


def _rng_states(device: torch.device | None) -> dict[str, torch.Tensor]:
    states = {f"rng/{_rank()}/cpu": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        states[f"rng/{_rank()}/cuda"] = torch.cuda.get_rng_state(device)
    return states


def _device(parts: list[nn.Module]) -> torch.device:
    for p in parts[0].parameters():
        return p.device
    return torch.device("cpu")


def _optimizer_state(state: TrainState) -> tuple[dict, dict]:
    """(tensors, plain values) of the optimizer, flattened and keyed by canonical parameter name."""
    osd = optimizer_state_dict(_container(state.parts), state.optimizer)
    multi = len(state.parts) > 1
    tensors = {_canonical(k, multi): v for k, v in osd.items() if torch.is_tensor(v)}
    plain = {_canonical(k, multi): v for k, v in osd.items() if not torch.is_tensor(v)}
    return tensors, plain


def _model_state(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    multi = len(parts) > 1
    return {_canonical(k, multi): v for k, v in _saved_params(parts, get_model_state_dict(_container(parts))).items()}


def _saved_params(parts: list[nn.Module], state_dict: dict) -> dict:
    """The part of the model a checkpoint holds: all of it, or a LoRA model's adapters (the base is frozen, and
    rebuilt from its source at resume, so QLoRA's NF4 base never reaches a checkpoint)."""
    if adapter_spec(parts) is None:
        return state_dict
    return {k: v for k, v in state_dict.items() if is_adapter(k)}


def _schedule_state(schedule) -> dict:
    """The scheduler's state with its per-group lists collapsed to one value (layouts group differently)."""
    sd = schedule.state_dict()
    n = len(schedule.optimizer.param_groups)
    out = {}
    for k, v in sd.items():
        if isinstance(v, list) and len(v) == n:
            if any(x != v[0] for x in v):
                raise ValueError(f"lr schedule {k} differs between param groups ({v}); cannot store it per layout")
            out[k] = {"per_group": v[0]}
        else:
            out[k] = v
    return out


def _load_schedule(schedule, saved: dict) -> list[str]:
    """Restore the schedule's position; its peak (base_lrs, from optim.lr) stays the config's. Returns the change
    as a line for the log, if the checkpoint was trained with another."""
    n, current = len(schedule.optimizer.param_groups), schedule.state_dict()
    loaded = {k: [v["per_group"]] * n if isinstance(v, dict) and "per_group" in v else v for k, v in saved.items()}
    schedule.load_state_dict({k: _as_tensors(current.get(k), v) for k, v in loaded.items()})
    was, now = [float(x) for x in schedule.base_lrs], [float(x) for x in current["base_lrs"]]
    if was == now:
        return []
    schedule.base_lrs = list(current["base_lrs"])
    lrs = [base * factor(schedule.last_epoch) for base, factor in zip(now, schedule.lr_lambdas)]
    for group, lr in zip(schedule.optimizer.param_groups, lrs):
        if torch.is_tensor(group["lr"]):  # torchao's optimizers keep lr as a tensor
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    schedule._last_lr = lrs
    return [f"optim.lr (peak {was[0]:g} -> {now[0]:g})"]


def _as_tensors(current: Any, value: Any) -> Any:
    """Per-group numbers as tensors where the live schedule holds tensors (torchao's optimizers keep lr as one, and
    LambdaLR then multiplies base_lr in float32: a Python float would round the next lr differently)."""
    if isinstance(current, list) and isinstance(value, list) and current and torch.is_tensor(current[0]):
        return [torch.tensor(v, dtype=c.dtype) for v, c in zip(value, current)]
    return value


def _plain_json(value: Any) -> Any:
    """Tuples become lists; anything JSON cannot hold exactly is refused."""
    if isinstance(value, dict):
        return {str(k): _plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} in a checkpoint's JSON")


# ---------------------------------------------------------------------------------------------------
# Saving


def _gather_plain(plain: dict) -> dict:
    """Union of every rank's plain values on rank 0 (pipeline ranks hold different parameters)."""
    merged = {}
    for d in _gather_by_rank(plain) or []:
        merged.update(d)
    return merged


def _gather_by_rank(value: Any) -> list | None:
    """Every rank's `value`, in rank order, on rank 0 (None on the others)."""
    if _world() == 1:
        return [value]
    everyone = [None] * _world() if _rank() == 0 else None
    dist.gather_object(value, everyone, dst=0)
    return everyone


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _crc32(file: Path) -> int:
    crc = 0
    with open(file, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return crc


def _file_digests(folder: Path) -> dict[str, dict]:
    """Size and CRC32 of every file of the checkpoint (CRC32: corruption, not tampering, is what it catches)."""
    return {path.name: {"bytes": path.stat().st_size, "crc32": _crc32(path)}
            for path in sorted(folder.iterdir()) if path.is_file() and path.name != META}


class Checkpointer:
    """Saves the training state every time the loop asks, keeps the last `keep`, and resumes from the newest.

    Every rank constructs one (with async_save it creates a gloo process group for the background writes) and
    calls save/load/resume/close at the same points of the loop.
    """

    def __init__(self, run_dir: str | os.PathLike, model_args: ModelArgs, *, layout: dict | None = None,
                 keep: int = 3, async_save: bool = False, lora_base: dict | None = None):
        if keep < 1:
            raise ValueError("keep must be >= 1 (the newest checkpoint is what a restart resumes from)")
        self.root = checkpoint_root(run_dir)
        self.model_args, self.layout, self.keep, self.async_save = model_args, layout or {}, keep, async_save
        self.lora_base = lora_base
        """A LoRA run's base (lora_base_identity), recorded with its adapters and checked on resume."""
        self._pending: tuple[Any, Path, Path, dict] | None = None
        # background writes run their collectives on their own gloo group, off the training group's stream
        self._async_group = dist.new_group(backend="gloo") if async_save and _world() > 1 else None

    # --- save -------------------------------------------------------------------------------------------
    def save(self, step: int, state: TrainState) -> None:
        """Write a checkpoint of `state` after `step` optimizer steps (collective: every rank calls it).

        Synchronous mode returns once the checkpoint is committed. Async mode returns after the staging copy;
        the write finishes in the background and is committed at the next save, `wait` or `close`.
        """
        self.wait()
        tmp, final = self.root / f"step_{step}.tmp", self.root / f"step_{step}"
        tensors, plain_optim = self._collect(state)
        plain_optim = _gather_plain(plain_optim)
        meta = {"format": FORMAT, "version": VERSION, "step": step, "model": dataclasses.asdict(self.model_args),
                "layout": self.layout, "world_size": _world(), "optimizer": optimizer_name(state.optimizer),
                "lora": adapter_spec(state.parts), "cpu_attention_forms": _gather_by_rank(cpu_attention_forms())}
        if meta["lora"] is not None:
            meta["lora_base"] = self.lora_base
        refused = None
        if _rank() == 0:
            train_state = {
                "step": step,
                "lr_schedule": _schedule_state(state.schedule) if state.schedule is not None else None,
                "grad_scaler": state.scaler.state_dict() if state.scaler is not None else None,
                "data_loader": state.loader.state_dict() if state.loader is not None else None,
                "optimizer_param_groups": plain_optim,
            }
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                for folder, _ in scan_checkpoints(self.root.parent).partial:
                    if UNFINISHED_DIR.fullmatch(folder.name) or REPLACED_DIR.fullmatch(folder.name):
                        shutil.rmtree(folder)  # unfinished writes of earlier, crashed attempts; replaced copies
                tmp.mkdir()
                _fsync_write(tmp / TRAIN_STATE, json.dumps(_plain_json(train_state), indent=1))
            except OSError as e:
                refused = e
        self._raise_refused(_agree_refused(refused), step, tmp)  # the barrier before the ranks write into tmp
        writer = dcp.FileSystemWriter(str(tmp))
        with _quiet_single_process():
            if self.async_save:
                future = dcp.async_save(tensors, storage_writer=writer, process_group=self._async_group,
                                        no_dist=not dist.is_initialized())
                self._pending = (future, tmp, final, meta)
            else:
                try:
                    dcp.save(tensors, storage_writer=writer, no_dist=not dist.is_initialized())
                except CheckpointException as e:
                    raise self._write_failed(e, step, tmp) or e from None
        if not self.async_save:
            self._commit(tmp, final, meta)

    def _write_failed(self, error: CheckpointException, step: int, tmp: Path) -> CheckpointError | None:
        """A save whose writes the file system refused (a full disk, a read-only or unwritable folder) as one line;
        None for any other failure (a bug: its traceback stays). DCP gathers every rank's failure and raises them on
        every rank, so every rank raises this line together. Until 2026-12-01 a full disk was a traceback of DCP's
        from every rank and torchrun's report, exit code 1."""
        refused = {rank: exc for rank, (exc, _) in error.failures.items() if isinstance(exc, OSError)}
        return self._refused_error(refused, step, tmp) if refused else None

    def _refused_error(self, refused: dict[int, Any], step: int, tmp: Path) -> CheckpointError:
        ranks = ", ".join(map(str, sorted(refused)))
        complete = scan_checkpoints(self.root.parent).complete
        kept = (f"it resumes from {complete[-1][1].name}, the newest complete checkpoint, which this failure left "
                f"untouched" if complete else "no checkpoint is complete yet, so it starts over")
        return CheckpointError(tmp, f"saving step {step} failed on rank{'s' if len(refused) > 1 else ''} {ranks}: "
                                    f"{refused[min(refused)]}",
                               f"free space where metrics.out_dir is, or make it writable, and start the run again: "
                               f"{kept}")

    def _raise_refused(self, refused: dict[int, str], step: int, tmp: Path) -> None:
        """Rank 0's own writes (the folder, train_state.json, meta.json, the rename) refused by the file system: the
        same line as DCP's refused writes, raised on every rank together. Until 2026-12-02 it was rank 0's traceback
        while the other ranks waited at the next collective."""
        if refused:
            raise self._refused_error(refused, step, tmp)

    def _collect(self, state: TrainState) -> tuple[dict, dict]:
        optim_tensors, plain = _optimizer_state(state)
        tensors = {f"model/{k}": v for k, v in _model_state(state.parts).items()}
        tensors.update({f"optim/{k}": v for k, v in optim_tensors.items()})
        tensors.update({k: v.clone() for k, v in _rng_states(_device(state.parts)).items()})
        return tensors, plain

    def wait(self) -> None:
        """Finish and commit a pending asynchronous save (collective)."""
        if self._pending is None:
            return
        future, tmp, final, meta = self._pending
        self._pending = None
        try:
            result = future.result()
        except CheckpointException as e:
            raise self._write_failed(e, meta["step"], tmp) or e from None
        if hasattr(result, "upload_completion"):
            result.upload_completion.result()
        self._commit(tmp, final, meta)

    def _commit(self, tmp: Path, final: Path, meta: dict) -> None:
        # DCP's save returns on any rank only after its coordinator has gathered every rank's write results and
        # written .metadata: all data is on disk. The barrier keeps ranks in step with the rename.
        _barrier()
        refused = None
        if _rank() == 0:
            try:
                self._rename_in(tmp, final, meta)
            except OSError as e:
                refused = e
        self._raise_refused(_agree_refused(refused), meta["step"], tmp)

    def _rename_in(self, tmp: Path, final: Path, meta: dict) -> None:
        meta["files"] = _file_digests(tmp)
        _fsync_write(tmp / META, json.dumps(_plain_json(meta), indent=1))
        old = final.with_name(final.name + ".replaced")
        if final.exists():  # the same step saved again: the old copy goes once the new one is in
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        dir_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        shutil.rmtree(old, ignore_errors=True)
        for _, folder in scan_checkpoints(self.root.parent).complete[: -self.keep]:
            shutil.rmtree(folder)
        log.info("checkpoint %s committed", final)

    def close(self) -> None:
        self.wait()

    # --- load -------------------------------------------------------------------------------------------
    def resume(self, state: TrainState) -> int:
        """Load the newest complete checkpoint of the run into `state`; the step it was saved at, 0 if none."""
        path = latest_checkpoint(self.root.parent)
        return 0 if path is None else load(path, state, self.model_args, lora_base=self.lora_base)


# ---------------------------------------------------------------------------------------------------
# Loading


class _SafeUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch.Size/dtype/layout and plain containers; nothing that runs code."""

    _BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool"}

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # DCP's metadata dataclasses and enums
                return obj
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):  # looks a torch.layout up by its name
            return super().find_class(module, name)
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return super().find_class(module, name)
        if module == "collections" and name == "OrderedDict" or module == "builtins" and name in self._BUILTINS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


class _SafeReader(dcp.FileSystemReader):
    """FileSystemReader whose metadata is read by _SafeUnpickler (tensor data DCP reads as raw bytes)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with open(Path(self.path) / DCP_METADATA, "rb") as f:
            metadata = _SafeUnpickler(io.BytesIO(f.read())).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{DCP_METADATA} holds a {type(metadata).__name__}, not DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_meta(path: Path, meta: dict, model_args: ModelArgs, parts: list[nn.Module]) -> None:
    written, saved = check_model(path, meta, model_args), meta["model"]
    # the rest (norm epsilon, rotary base and scaling, ...) fits the same weights, and changing it on resume is a
    # technique (a longer context's rotary base), not always a mistake: said, not refused
    changed = [f"model.{f} {getattr(written, f)} -> {getattr(model_args, f)}" for f in ModelArgs.__dataclass_fields__
               if f in saved and f not in ("name", "max_seq_len") and getattr(written, f) != getattr(model_args, f)]
    if changed and _rank() == 0:
        log.warning("resuming %s with a changed model: %s (the weights were trained with the earlier values)",
                    path.name, ", ".join(changed))
    check_lora(path, meta.get("lora"), adapter_spec(parts))


def _check_files(path: Path, meta: dict) -> str | None:
    """This rank's share of the file checks: present, full size, CRC32 as written. An error message or None."""
    files = sorted(meta.get("files", {}).items())
    for name, info in files[_rank()::_world()]:
        file = path / name
        if not file.is_file():
            return f"file {name} is missing"
        size = file.stat().st_size
        if size != info["bytes"]:
            return f"file {name} has {size} bytes, {info['bytes']} were written (truncated or damaged)"
        if _crc32(file) != info["crc32"]:
            return f"file {name} fails its CRC32 check (corrupted)"
    return None


def _check_targets(path: Path, metadata: Metadata, targets: dict[str, torch.Tensor]) -> str | None:
    """Every tensor this rank needs exists in the checkpoint, as a tensor of the same global shape and dtype."""
    md = metadata.state_dict_metadata
    for key, t in targets.items():
        entry = md.get(key)
        if entry is None:
            return f"it has no {key!r} (a different model or optimizer)"
        if not isinstance(entry, TensorStorageMetadata):
            return f"{key!r} is not stored as a tensor"
        if tuple(entry.size) != tuple(t.shape) or entry.properties.dtype != t.dtype:
            return (f"{key!r} is {entry.properties.dtype} {tuple(entry.size)}, this run has {t.dtype} "
                    f"{tuple(t.shape)} (a different model shape)")
    for info in metadata.storage_data.values():
        file = path / info.relative_path
        if not file.is_file() or file.stat().st_size < info.offset + info.length:
            return f"shard file {info.relative_path} is missing or truncated"
    return None


def _agree_refused(error: OSError | None) -> dict[int, str]:
    """Rank 0's refused write, if any, on every rank (a collective that is also the barrier after rank 0's writes)."""
    text = None if error is None else str(error)
    if _world() == 1:
        return {} if text is None else {0: text}
    errors = [None] * _world()
    dist.all_gather_object(errors, text)
    return {rank: e for rank, e in enumerate(errors) if e is not None}


def _agree(error: str | None) -> str | None:
    """The first error any rank found (so all ranks raise together instead of some waiting in a collective)."""
    if _world() == 1:
        return error
    errors = [None] * _world()
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e), None)


def _read_metadata(path: Path) -> Metadata:
    try:
        return _SafeReader(str(path)).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(path, f"DCP {DCP_METADATA} is missing", MOVE_ASIDE) from None
    except Exception as e:  # noqa: BLE001 - any failure to parse is a damaged file
        raise CheckpointError(path, f"DCP {DCP_METADATA} cannot be read ({type(e).__name__}: {e})",
                              MOVE_ASIDE) from None


def _saved_optimizer_tensors(parts: list[nn.Module], metadata: Metadata) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Size and dtype of each optimizer tensor the checkpoint holds for these parts' parameters, keyed as the
    optimizer over the parts names it (with the part index): what ZeRO-1 makes its load buffers from."""
    multi = len(parts) > 1
    fqns = [canonical_name(n) for n, _ in _container(parts).named_parameters()]
    own = {_canonical(fqn, multi): fqn for fqn in fqns}  # the checkpoint's name -> the optimizer's
    saved = {}
    for key, entry in metadata.state_dict_metadata.items():
        name, _, state = key.removeprefix("optim/state.").rpartition(".")
        if key.startswith("optim/state.") and name in own and isinstance(entry, TensorStorageMetadata):
            saved[f"state.{own[name]}.{state}"] = (torch.Size(entry.size), entry.properties.dtype)
    return saved


def _plain_keys(state: TrainState, optim_live: dict) -> list[str]:
    """The optimizer's non-tensor values (hyperparameters: "param_groups.<name>.lr", ...) a load needs."""
    return [_canonical(k, len(state.parts) > 1) for k, v in optim_live.items() if not torch.is_tensor(v)]


def _restore_type(current: Any, saved: Any) -> Any:
    return tuple(saved) if isinstance(current, tuple) and isinstance(saved, list) else saved


def load(path: str | os.PathLike, state: TrainState, model_args: ModelArgs, lora_base: dict | None = None) -> int:
    """Restore `state` (freshly built, any layout) from a checkpoint folder; returns its step (collective).
    `lora_base`: where a LoRA run's frozen base comes from (lora_base_identity), which the adapters must have
    been trained on.

    Everything is checked first; a damaged or mismatched checkpoint raises CheckpointError on every rank and
    leaves the model, optimizer and loader as they were.
    """
    path = Path(path)
    meta, train_state = read_checkpoint_json(path)
    _check_meta(path, meta, model_args, state.parts)
    if meta.get("lora") is not None and "lora_base" in meta:  # recorded since 2026-11-28
        if not isinstance(meta["lora_base"], (dict, type(None))):
            raise CheckpointError(path, f"{META}'s 'lora_base' is {meta['lora_base']!r} (damaged or edited)",
                                  MOVE_ASIDE)
        check_lora_base(path, meta["lora_base"], lora_base)
    if state.optimizer is not None:
        check_optimizer(path, meta.get("optimizer"), optimizer_name(state.optimizer))
    metadata = _read_metadata(path)
    targets, model_live, optim_live = _targets(state, metadata, int(meta.get("world_size", 1)))
    missing = [k for k in _plain_keys(state, optim_live) if k not in train_state.get("optimizer_param_groups", {})]
    loader = _check_loader(train_state, state)  # the config's to fix, not the checkpoint's
    error = (_check_targets(path, metadata, targets) or (loader and loader[0])
             or (f"{TRAIN_STATE} lacks {missing[0]}" if missing else None) or _check_files(path, meta))
    error = _agree(error)  # "rank r: ..." under several ranks
    if error:
        # the loader's fix where its problem is the one agreed on: comparing with == gave every multi-rank job the
        # damaged checkpoint's fix (move the good step aside) for a changed global batch
        raise CheckpointError(path, error, loader[1] if loader and error.endswith(loader[0]) else
                              MOVE_ASIDE + " (or fix the config to match it)")

    with _quiet_single_process():
        dcp.load(targets, storage_reader=_SafeReader(str(path)), no_dist=not dist.is_initialized())
    _restore(state, targets, model_live, optim_live, train_state)
    forms = meta.get("cpu_attention_forms") or []  # rank r continues rank r % saved world's, as its RNG streams
    if forms:
        restore_cpu_attention_forms(forms[_rank() % len(forms)])
    return int(train_state["step"])


def _targets(state: TrainState, metadata: Metadata, saved_world: int) -> tuple[dict, dict, dict]:
    """The tensors to read into (DCP key -> tensor), and the live model/optimizer state dicts they belong to."""
    multi = len(state.parts) > 1
    model_live = _saved_params(state.parts, get_model_state_dict(_container(state.parts)))
    targets = {f"model/{_canonical(k, multi)}": v for k, v in model_live.items()}
    optim_live: dict = {}
    if state.optimizer is not None:
        saved = _saved_optimizer_tensors(state.parts, metadata)
        optim_live = optimizer_load_targets(_container(state.parts), state.optimizer, saved)
        targets.update({f"optim/{_canonical(k, multi)}": v for k, v in optim_live.items() if torch.is_tensor(v)})
    src = _rank() % saved_world  # under another world size, rank r continues rank r % saved world's streams
    for key, value in _rng_states(_device(state.parts)).items():
        key = key.replace(f"rng/{_rank()}/", f"rng/{src}/")
        if key.endswith("/cpu") or key in metadata.state_dict_metadata:  # CUDA streams only if saved on CUDA
            targets[key] = value.clone()
    return targets, model_live, optim_live


def _restore(state: TrainState, targets: dict, model_live: dict, optim_live: dict, train_state: dict) -> None:
    """Hand the read tensors and the JSON state to their owners."""
    multi = len(state.parts) > 1
    # a LoRA checkpoint sets the adapters only (not strict), on the base already in place
    set_model_state_dict(_container(state.parts), {k: targets[f"model/{_canonical(k, multi)}"] for k in model_live},
                         options=StateDictOptions(strict=adapter_spec(state.parts) is None))
    plain = train_state["optimizer_param_groups"]
    changed = []
    if state.optimizer is not None:
        changed += _set_optimizer(state, optim_live, targets, plain)
    if state.schedule is not None and train_state["lr_schedule"] is not None:
        changed += _load_schedule(state.schedule, train_state["lr_schedule"])
    if changed and _rank() == 0:
        log.warning("resuming step %s with the config's %s: the checkpoint was trained with the earlier values",
                    train_state["step"], "; ".join(changed))
    if state.scaler is not None and train_state["grad_scaler"]:
        state.scaler.load_state_dict(train_state["grad_scaler"])
    if state.loader is not None and train_state["data_loader"] is not None:
        state.loader.load_state_dict(train_state["data_loader"])
    for key, value in targets.items():
        if key.startswith("rng/") and key.endswith("/cpu"):
            torch.set_rng_state(value)
        elif key.startswith("rng/"):
            torch.cuda.set_rng_state(value, _device(state.parts))


CONFIG_HYPERPARAMETERS = {"betas": "optim.beta1/beta2", "eps": "optim.eps", "weight_decay": "optim.weight_decay",
                          "momentum": "optim.momentum", "initial_lr": ""}
"""Optimizer hyperparameters the job's config sets (by their param_groups name: the config field). A resumed run
keeps the config's values, not the checkpoint's, and logs what changed (Megatron-LM makes the same choice with
--override-opt_param-scheduler): lowering optim.lr after a loss spike is a resume with another config. The peak
learning rate (initial_lr) is reported with the schedule (_load_schedule)."""


def _set_optimizer(state: TrainState, live: dict, targets: dict, plain: dict) -> list[str]:
    """Restore the optimizer's tensors and plain values, the config's hyperparameters kept; returns the changed
    fields as lines for the log."""
    multi = len(state.parts) > 1
    osd, changed = {}, {}
    for k, v in live.items():
        canonical = _canonical(k, multi)
        if torch.is_tensor(v):
            osd[k] = targets[f"optim/{canonical}"]
            continue
        saved = _restore_type(v, plain[canonical])
        field = CONFIG_HYPERPARAMETERS.get(canonical.rsplit(".", 1)[-1])
        osd[k] = v if field is not None else saved
        if field and saved != v:
            changed[field] = f"{field} ({_hp_text(saved)} -> {_hp_text(v)})"
    set_optimizer_state(_container(state.parts), state.optimizer, osd)
    return list(changed.values())


def _hp_text(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ", ".join(map(_hp_text, value))
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _check_loader(train_state: dict, state: TrainState) -> tuple[str, str] | None:
    """(what differs, its fix) where this run's data loader cannot continue the saved one's order."""
    saved = train_state.get("data_loader")
    if state.loader is None or saved is None:
        return None
    mine = state.loader.state_dict()
    for key, fix in loader_fixes(saved).items():
        if saved.get(key) != mine.get(key):
            return f"the data loader was saved with {key}={saved.get(key)}, this run has {mine.get(key)}", fix
    return None


# ---------------------------------------------------------------------------------------------------
# Preemption


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""What stops a run after its step (StopSignal)."""


class StopSignal:
    """Set by SIGTERM (what Slurm and Kubernetes send before a kill) or SIGUSR1 (Slurm's warning before the time
    limit, as `shardwise launch slurm` asks for it): the loop finishes its step, saves, exits.

    `requested()` is collective: ranks receive the signal at different moments, so they agree (any rank) before
    deciding to stop, and all stop after the same step.
    """

    def __init__(self, signals=STOP_SIGNALS, process_exits: bool = False):
        self._set, self._process_exits = False, process_exits
        self._previous = {s: signal.signal(s, self._handler) for s in signals}

    def _handler(self, signum, frame) -> None:
        self.request()

    def request(self) -> None:
        """Stop after the step in flight (what a stop signal asks): only a flag, the loop saves then."""
        self._set = True

    def close(self) -> None:
        """Put the previous handlers back. In a process that ends with the run (`process_exits`: the command line's)
        a stop leaves them ignored instead: a repeated stop signal (a second scancel, `kill -- -PGID` again) killed
        it after its save, while it closed its process groups, and the saved job ended with a failed rank. A Python
        handler left in place would not do, as the interpreter puts the default back when it finalizes."""
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_IGN if self._set and self._process_exits else handler)

    def requested(self, device: torch.device | str = "cpu") -> bool:
        """Whether any rank got the signal; `device` is where the process group's backend reduces (cuda: NCCL)."""
        flag = torch.tensor([1.0 if self._set else 0.0], device=device)
        if dist.is_initialized() and _world() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
