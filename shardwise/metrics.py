"""Training metrics: throughput, MFU and peak memory, written to a progress bar, JSONL and TensorBoard."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from shardwise.config import MetricsConfig
from shardwise.distributed import attempt
from shardwise.hardware import PlannerError, accelerator, detect_accelerator


def peak_flops(cfg: MetricsConfig, precision: str, device: torch.device) -> float | None:
    """Peak dense FLOP/s of one device at the training precision, or None when unknown (MFU not shown)."""
    if cfg.peak_flops > 0:
        return cfg.peak_flops
    name = detect_accelerator(device) if cfg.accelerator == "auto" else cfg.accelerator
    if name is None:
        return None
    try:
        return accelerator(name).peak(precision)
    except PlannerError:
        return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory so far: the CUDA caching allocator's high-water mark, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes


class MetricsWriter:
    """One line of JSON per logged step, the same scalars to TensorBoard, a summary on the progress bar."""

    def __init__(self, cfg: MetricsConfig, total_steps: int, enabled: bool = True, first_step: int = 1):
        """`first_step`: the step this start runs first. The run folder's earlier lines from that step on are
        dropped (in TensorBoard, purged): a fresh run (1) starts its log, and a resumed one keeps the steps up to
        its checkpoint and does the later ones again, as an interrupted run's log had them too."""
        self.enabled = enabled
        self._progress = cfg.progress
        self._jsonl = self._tb = self._bar = None
        if not enabled:
            return
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._jsonl = _log_from(out / "metrics.jsonl", first_step)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out / "tb"), purge_step=first_step)
        if cfg.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        shown = {k: values[k] for k in ("loss", "lr", "tokens_per_s", "mfu") if k in values}
        if "loss" not in shown:
            return
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
        elif self._progress:
            # no terminal (a log file, CI): one plain line per logged step instead of a redrawn bar
            print(f"step {step}: " + "  ".join(f"{k} {v:.4g}" for k, v in shown.items()), flush=True)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for handle in (self._bar, self._tb, self._jsonl):
            if handle is not None:
                handle.close()


def _log_from(path: Path, first_step: int):
    """`path` opened for appending, its lines of `first_step` and later dropped (and any line a crash cut short)."""
    kept = []
    if first_step > 1 and path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("step", 0) < first_step:
                kept.append(line + "\n")
    path.write_text("".join(kept))
    return path.open("a")


class SampleLog:
    """Each step's sample ids, one JSON line per step, in out_dir/samples/dp<rank>.jsonl (metrics.log_samples).

    One writer per data-parallel rank (the others of its tp/cp/pp group read the same samples). Lines are
    appended and flushed, so a step replayed after a restart appears twice; each line names its attempt
    (distributed.attempt: the same on every rank of one start, later starts sorting after earlier ones), and the
    latest attempt's lines are the ones that count. `read_sample_log` applies that rule. A start drops the lines
    of the steps it runs (`first_step` on), as metrics.jsonl does.
    """

    def __init__(self, out_dir: str, dp_rank: int, enabled: bool, first_step: int = 1, dp_size: int = 1):
        """Lines of `first_step` and later are dropped from this rank's file, as MetricsWriter drops them, and
        rank 0 drops them from the files of ranks an earlier world had beyond this one's `dp_size`."""
        self._file, self._attempt = None, int(attempt())
        if enabled:
            folder = Path(out_dir) / "samples"
            folder.mkdir(parents=True, exist_ok=True)
            if dp_rank == 0:
                for path in folder.glob("dp*.jsonl"):
                    if path.stem[2:].isdigit() and int(path.stem[2:]) >= dp_size:
                        _log_from(path, first_step).close()
            self._file = _log_from(folder / f"dp{dp_rank}.jsonl", first_step)

    def log(self, step: int, batches) -> None:
        if self._file is not None:
            ids = [i for batch in batches for i in batch.sample_ids]
            self._file.write(json.dumps({"step": step, "ids": ids, "attempt": self._attempt}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_sample_log(out_dir: str | Path) -> dict[int, dict[int, list[int]]]:
    """{dp_rank: {step: sample ids}} from a run's sample log: each step as its latest attempt read it (the
    last line of the step in each rank's file; a rank's line from an earlier attempt than another rank's for the
    same step is dropped: the world changed, and that rank's step was done again by the ranks of the new one)."""
    logs: dict[int, dict[int, tuple[int, list[int]]]] = {}
    for path in sorted((Path(out_dir) / "samples").glob("dp*.jsonl")):
        steps = {}
        for line in path.read_text().splitlines():
            row = json.loads(line)
            steps[row["step"]] = (row.get("attempt", 0), row["ids"])
        logs[int(path.stem[2:])] = steps
    latest: dict[int, int] = {}
    for steps in logs.values():
        for step, (att, _) in steps.items():
            latest[step] = max(att, latest.get(step, att))
    return {dp: {step: ids for step, (att, ids) in steps.items() if att == latest[step]}
            for dp, steps in sorted(logs.items())}


def samples_by_step(out_dir: str | Path) -> dict[int, list[int]]:
    """{step: the step's sample ids over all data-parallel ranks, in rank order}: a run's global batches,
    comparable between runs on different worlds."""
    steps: dict[int, list[int]] = {}
    for _, rank in sorted(read_sample_log(out_dir).items()):
        for step, ids in rank.items():
            steps.setdefault(step, []).extend(ids)
    return dict(sorted(steps.items()))
