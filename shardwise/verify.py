"""`shardwise verify`: train the same steps on one device and under each layout, and compare.

The reference reads the same global batch as the layout (the union of what its data-parallel ranks read): one device
with grad_accum x dp micro-batches (of a pipeline's own size under pp: `reference_batches`). It starts from the same
(seed, name) initialisation. Losses and gradient norms are compared at every step (the norm catches a gradient
scaled wrongly, which Adam's update and clipping would hide from the loss); parameters at the end, per tensor as
||p - p_ref|| / ||p_ref||. Each layout also reports which parameters its steps changed from their initial values: a
parity in which nothing trained would prove nothing, and a LoRA run must change its adapters and leave the frozen
base bitwise as it started.

The reference runs in this process, and the layouts of one world size in one launch of that many ranks, which
train them in turn (`run_jobs`): a few steps of a small model take less than starting the ranks does.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwise.config import ConfigError, JobConfig, layout_settings, load_config
from shardwise.layout import BATCH_KEYS, Layout, complete_layout, parse_layout

ONE_DEVICE = layout_settings(Layout())
"""The [parallel] table of the reference (and of the base config verify checks first): one device, whatever the
config's own [parallel] table says. Each layout replaces that table whole (layout_overrides); a reference that kept
it ran, under a config written by `plan --write-config`, as the planned job (refused: "the degrees ask for 16 ranks
but this is a single process; fix: add --nproc 16", which verify lacks), or was refused for the table's
pp_microbatches, which no run of verify uses."""


def layout_overrides(text: str) -> list[str]:
    """'dp_shard=2,tp=2' -> the --set overrides of the whole [parallel] table it means (shardwise.layout's parser
    and defaults: here dp_shard > 1 is ZeRO-3), plus train.micro_batch / train.grad_accum where it gives them."""
    fixed = parse_layout(text, "--layout")
    return [*layout_settings(complete_layout(fixed, source="--layout")),
            *(f"train.{k}={fixed[k]}" for k in BATCH_KEYS if k in fixed)]


def reference_batches(cfg: JobConfig) -> tuple[int, int]:
    """(train.micro_batch, train.grad_accum) of the one-device reference for the layout `cfg`: the global batch in
    the micro-batches the layout's forwards see. Under a pipeline a rank's train.micro_batch is one schedule step's
    sequences, which the schedule cuts into n_microbatches contiguous pipeline micro-batches; the loss does not
    depend on the cut, but a mixture of experts' capacity (model.capacity_factor) counts per forward."""
    accum = cfg.train.global_batch // cfg.train.micro_batch or cfg.train.grad_accum * cfg.parallel.dp
    cut = cfg.parallel.n_microbatches if cfg.parallel.pp > 1 else 1
    return cfg.train.micro_batch // cut, accum * cut


def _quiet(out_dir: Path, steps: int) -> list[str]:
    return [f"train.steps={steps}", f"metrics.out_dir='{out_dir}'", "metrics.log_every=1", "metrics.progress=false",
            "metrics.tensorboard=false", "train.val_every=0"]


def _train_here(config: str | None, overrides: list[str], final: Path) -> None:
    """One device: `shardwise train`'s own function in this process, which has imported torch already (a process
    of its own would spend most of a few-step run starting up)."""
    from shardwise.distributed import release_memory
    from shardwise.train import train

    _forget_compiled()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            train(load_config(config, overrides), save_final=str(final))
    finally:
        release_memory()  # not kept beside the ranks launched next


def _forget_compiled() -> None:
    """Drop what torch.compile compiled for an earlier run in this process (train.compile): dynamo's cache lives
    as long as the process, and a run must compile for itself, as `shardwise train` would (the guards of an
    earlier layout's graphs can pass for the next one's, and its shapes would already be marked dynamic)."""
    if "torch._dynamo" in sys.modules:
        import torch._dynamo

        torch._dynamo.reset()


def _train_launched(config: str | None, runs: list[tuple[list[str], Path]], nproc: int, tmp: Path) -> None:
    """Several runs of one world size, in turn, in one launch of `nproc` ranks (`run_jobs`): each rank pays
    torch's start-up once, not once per layout."""
    from shardwise.launch.local import torchrun_command

    jobs = tmp / f"jobs-{nproc}.json"
    jobs.write_text(json.dumps([{"config": config, "overrides": o, "final": str(final)} for o, final in runs]))
    cmd, env = torchrun_command(nproc, [str(jobs)], module="shardwise.verify")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        # torchrun's own report says little: show what the ranks said (each rank's traceback ends with the
        # layout it was training: run_jobs)
        said = [line for line in proc.stderr.splitlines() if line.startswith("[rank")]
        which = list(dict.fromkeys(line for line in said if _FAILED_IN in line))
        raise RuntimeError(f"a launch of {nproc} ranks for {len(runs)} layout(s) failed:\n"
                           + "\n".join(which + said[-25:] or [proc.stderr[-3000:]]))


_FAILED_IN = "in verify's run of:"


def run_jobs(path: str) -> None:
    """A rank of `_train_launched`'s launch: train each job of the JSON file at `path` in turn, as `shardwise train`
    does (train() builds the process group and tears it down). Each job is a new attempt to the job's store
    (shardwise.distributed's attempt prefix, as after a restart), so no job reads the gloo addresses of the one
    before."""
    from shardwise.distributed import ATTEMPT_ENV, attempt
    from shardwise.train import train

    base = int(attempt())  # a number, later attempts larger (shardwise.torchrun's: the rendezvous's time in ns)
    for i, job in enumerate(json.loads(Path(path).read_text())):
        os.environ[ATTEMPT_ENV] = str(base + i)
        _forget_compiled()
        try:
            train(load_config(job["config"], job["overrides"]), save_final=job["final"])
        except BaseException as e:  # the traceback then says which of the launch's layouts failed
            e.add_note(f"{_FAILED_IN} {' '.join(job['overrides'])}")
            raise


def _results(out_dir: Path) -> tuple[list[tuple[float, float]], dict]:
    """A finished run's (loss, gradient norm) per step and its final parameters."""
    from safetensors.torch import load_file

    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    params = {}
    for path in sorted(out_dir.glob("final.safetensors*")):
        params.update(load_file(path))
    return [(r["loss"], r["grad_norm"]) for r in logged], params


def _rel(a: float, b: float) -> float:
    """|a - b| / |b|; 0 for the same inf (both runs skipped an fp16 overflow), inf where only one is finite or
    either is nan (inf / inf was nan, which max() over the steps passed over)."""
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / abs(b) if b else abs(a)


def initial_parameters(cfg: JobConfig) -> dict:
    """Every parameter's value before the first step, by name, as every layout starts (one device, CPU)."""
    from shardwise.hf import import_hf
    from shardwise.lora import apply_lora
    from shardwise.model import build_model, canonical_name, materialize

    model = build_model(cfg.model)
    apply_lora(model, cfg.lora)
    materialize(model, cfg.model, "cpu", cfg.train.seed)
    if cfg.checkpoint.init_from_hf:
        import_hf([model], cfg.checkpoint.init_from_hf)
    return {canonical_name(n): p.detach() for n, p in model.named_parameters()}


def changed(initial: dict, params: dict) -> list[str]:
    """The parameters whose final value is not bitwise their initial one."""
    import torch

    return sorted(k for k, v in params.items() if k not in initial or not torch.equal(v, initial[k].to(v.dtype)))


def _param_rel(p, ref) -> float:
    """||p - ref|| / ||ref||; the plain difference for a reference of zeros (a LoRA B that did not move)."""
    diff, norm = (p - ref).norm().item(), ref.norm().item()
    return diff / norm if norm else diff


def compare(ref: tuple[list, dict], got: tuple[list, dict]) -> dict:
    """Largest relative differences: loss and gradient norm over the steps, parameters (per tensor) at the end."""
    (ref_steps, ref_params), (steps, params) = ref, got
    if len(steps) != len(ref_steps) or set(params) != set(ref_params):
        inf = float("inf")
        return {"loss_rel": inf, "grad_norm_rel": inf, "param_rel": inf, "error": "different steps or parameters"}
    loss_rel = max(_rel(a[0], b[0]) for a, b in zip(steps, ref_steps))
    grad_norm_rel = max(_rel(a[1], b[1]) for a, b in zip(steps, ref_steps))
    per_tensor = {k: _param_rel(params[k], v) for k, v in ref_params.items()}
    worst = max(per_tensor, key=per_tensor.get)
    return {"loss_rel": loss_rel, "grad_norm_rel": grad_norm_rel, "param_rel": per_tensor[worst],
            "worst_param": worst}


def check_verify_arguments(args: argparse.Namespace) -> None:
    """verify's own flags, before any config is read."""
    if args.steps < 1:
        raise ConfigError("--steps", f"{args.steps} < 1", "compare at least one optimizer step, e.g. --steps 5")
    if not 0 <= args.rtol < math.inf:  # nan too
        raise ConfigError("--rtol", f"{args.rtol} is not a finite tolerance >= 0", "pass e.g. 1e-5")
    for item in args.overrides:
        key, _, value = (part.strip() for part in item.partition("="))
        if key.startswith("parallel."):  # it would apply to the reference too
            raise ConfigError("--set", f"{item}: the layouts to verify come from --layout, and --set applies to the "
                              "one-device reference as well",
                              f'pass it in --layout instead (--layout "{key.removeprefix("parallel.")}={value}")')
    for text in args.layout:
        if not text.strip():
            raise ConfigError("--layout", "an empty layout is one device, the reference itself",
                              'give degrees, e.g. --layout "dp_shard=2"')


def run_verify(args: argparse.Namespace) -> int:
    check_verify_arguments(args)
    base = load_config(args.config, [*args.overrides, *ONE_DEVICE])  # first: its errors name its own fields
    if base.lora.rank and base.lora.dropout > 0:
        # each rank draws its own masks for its own micro-batches: no layout can draw one device's
        raise ConfigError("lora.dropout", f"{base.lora.dropout} > 0 draws random masks that differ between one "
                          "device and a layout", "verify with --set lora.dropout=0")
    layouts = [(text, layout_overrides(text)) for text in args.layout]
    configs = []
    for text, extra in layouts:  # every layout is validated before anything runs
        cfg = load_config(args.config, [*args.overrides, *extra])
        if cfg.parallel.mixed_precision == "fsdp":
            raise ConfigError("--layout mixed_precision", "'fsdp' runs forward and backward in bf16 from bf16 "
                              "weights, and the one-device reference runs autocast (fp32 weights): other roundings, "
                              "far beyond any tolerance that checks a layout", "verify the layout without it")
        configs.append((text, extra, cfg))
    initial = initial_parameters(configs[0][2])  # layouts change how parameters are split, not their values
    results = []
    with tempfile.TemporaryDirectory(prefix="shardwise-verify-") as tmp:
        refs: dict[tuple[int, int], Path] = {}  # the global batch's micro-batches, as one device reads them -> its run
        launches: dict[int, list[tuple[list[str], Path]]] = {}  # world size -> its layouts' runs
        outs = []
        for i, (text, extra, cfg) in enumerate(configs):
            split = reference_batches(cfg)
            if split not in refs:
                micro_batch, accum = split
                refs[split] = out = Path(tmp) / f"ref-{micro_batch}x{accum}"
                _train_here(args.config, [*args.overrides, *ONE_DEVICE, "train.global_batch=0",
                                          f"train.grad_accum={accum}", f"train.micro_batch={micro_batch}",
                                          *_quiet(out, args.steps)],
                            out / "final.safetensors")
            out = Path(tmp) / f"layout-{i}"
            overrides = [*args.overrides, *extra, *_quiet(out, args.steps)]
            if cfg.parallel.world_size == 1:
                _train_here(args.config, overrides, out / "final.safetensors")
            else:
                launches.setdefault(cfg.parallel.world_size, []).append((overrides, out / "final.safetensors"))
            outs.append((refs[split], out))
        for world, runs in launches.items():
            _train_launched(args.config, runs, world, Path(tmp))
        references = {out: _results(out) for out in refs.values()}
        for (text, _, cfg), (ref_out, out) in zip(configs, outs):
            got = _results(out)
            row = {"layout": text, "world_size": cfg.parallel.world_size, **compare(references[ref_out], got)}
            row["ok"] = max(row["loss_rel"], row["grad_norm_rel"], row["param_rel"]) <= args.rtol
            row["trained"] = changed(initial, got[1])
            results.append(row)
            if not args.json:
                # a failure says by how much and where: the largest parameter difference's tensor is where to look
                failed = (f"FAIL (beyond --rtol {args.rtol:g}; parameters differ most in {row['worst_param']})"
                          if "worst_param" in row else f"FAIL ({row.get('error', f'beyond --rtol {args.rtol:g}')})")
                print(f"{text:<50} world {row['world_size']:>2}  loss {row['loss_rel']:.1e}  "
                      f"grad norm {row['grad_norm_rel']:.1e}  params {row['param_rel']:.1e}  "
                      f"trained {len(row['trained'])}/{len(got[1])}  {'ok' if row['ok'] else failed}", flush=True)
    if args.json:
        print(json.dumps({"steps": args.steps, "rtol": args.rtol, "layouts": results}, indent=2))
    note = adaptive_optimizer_note(results, base.optim.name, args.rtol)
    if note:
        print(note, file=sys.stderr)
    for text, _, cfg in configs:
        note = unread_embedding_note(text, cfg, args.steps)
        if note:
            print(note, file=sys.stderr)
    return 0 if all(r["ok"] for r in results) else 1


def unread_embedding_rows(cfg: JobConfig, steps: int) -> tuple[int, list[tuple[int, int]]]:
    """The highest token id the first `steps` training steps look up, and the ranges of embedding rows, one per
    tensor-parallel rank that holds them (the weight's Shard(0): ceil(V / tp) rows a rank, as torch's chunk cuts
    it), in which none of the ids they look up falls: that rank's lookup (shardwise.parallel's vocabulary-parallel
    embedding) then runs on no id of the data, and verify compares nothing of it. The same global batches as the
    reference reads, in the same order (data.DataLoader on one data-parallel rank)."""
    import torch

    from shardwise import data

    tokenizer = data.build_tokenizer(cfg.data, data.resolve_cache_root(cfg.data))
    loader = data.DataLoader(data.TokenDataset.build(cfg.data, tokenizer), micro_batch=cfg.train.micro_batch,
                             grad_accum=cfg.train.global_batch // cfg.train.micro_batch or
                             cfg.train.grad_accum * cfg.parallel.dp, seed=cfg.train.seed)
    ids = torch.unique(torch.cat([b.inputs.flatten() for _ in range(steps) for b in loader.next_step()]))
    rows = -(-cfg.model.vocab_size // cfg.parallel.tp)
    shards = [(start, min(start + rows, cfg.model.vocab_size)) for start in range(0, cfg.model.vocab_size, rows)]
    return int(ids.max()), [(a, b) for a, b in shards if not ((ids >= a) & (ids < b)).any()]


def unread_embedding_note(text: str, cfg: JobConfig, steps: int) -> str | None:
    """What to tell a user whose tp layout's data never looks up some ranks' embedding rows: a byte-level corpus
    of ASCII text reads ids below 128 of a vocabulary of 320, so under tp 2 the second rank's rows are never read,
    and an off-by-one in its lookup passed verify (a helper's trial, 2026-12-01)."""
    if cfg.parallel.tp == 1:
        return None
    highest, unread = unread_embedding_rows(cfg, steps)
    if not unread:
        return None
    ranges = ", ".join(f"{a}-{b - 1}" for a, b in unread)
    return (f"note: {text}: the {steps} steps' batches look up token ids up to {highest} of model.vocab_size = "
            f"{cfg.model.vocab_size}, so the tensor-parallel embedding's rows {ranges} are never read and their "
            f"ranks' lookups are not compared; to cover them, verify on data whose ids span the vocabulary (e.g. "
            f"data.tokenizer = 'bpe' with data.bpe_vocab_size near model.vocab_size)")


ADAPTIVE = ("adamw", "adamw8bit", "adamw4bit", "adafactor")
"""Optimizers whose update is normalised per element: a 1e-9 difference of a near-zero gradient moves a parameter
by about lr (LoRA's A at the first step, where B = 0, has a gradient of exactly zero on one device)."""


def adaptive_optimizer_note(results: list[dict], optimizer: str, rtol: float) -> str | None:
    """What to tell a user whose layout failed on its parameters alone under an adaptive optimizer (loss and gradient
    norm within tolerance): a LoRA config with AdamW failed `verify --layout tp=2` at 3.2e-5 without a word on why,
    though the layout was exact under momentum SGD (1.0e-6)."""
    params_only = [r["layout"] for r in results if not r["ok"] and max(r["loss_rel"], r["grad_norm_rel"]) <= rtol]
    if optimizer not in ADAPTIVE or not params_only:
        return None
    return (f"note: {', '.join(params_only)} matched the loss and gradient norm and differed only in the parameters: "
            f"optim.name = '{optimizer}' normalises each update, which turns rounding-sized differences of near-zero "
            "gradients into lr-sized steps; to test the layout itself, verify with --set optim.name=momentum "
            "--set optim.grad_clip=0 (as tests/configs/parity.toml does)")


if __name__ == "__main__":  # a rank of _train_launched's launch
    run_jobs(sys.argv[1])
