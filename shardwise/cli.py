"""`shardwise <command>`: the command line (also `python -m shardwise`)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import math
import os
import re
import shutil
import signal
import sys
from pathlib import Path

from shardwise.chat import chat_template
from shardwise.config import (
    HF_WEIGHT_FILES,
    STOPPED_FILE,
    ConfigError,
    check_file_to_write,
    check_restarts,
    fit_nodes,
    fit_world,
    has_hf_weights,
    hf_weights_metadata,
    load_config,
)
from shardwise.launch.local import LAUNCHED, Rendezvous, node_range
from shardwise.layout import Layout
from shardwise.run_folder import check_resume


def _add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file (see configs/); omitted: the built-in defaults")
    _add_overrides(p)
    p.add_argument("--nproc", type=int, default=0,
                   help="start this many processes on this machine (torchrun); the degrees must multiply to it")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="with --nproc: restart all processes this many times when one fails (they resume from "
                        "the newest checkpoint); default 0, or 3 with an elastic --nnodes MIN:MAX")
    p.add_argument("--save-final", metavar="PATH", help="write the final parameters, unsharded, to safetensors")
    p.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                   help="with --nproc: the job spans this many machines, each running this command (what "
                        "`shardwise launch slurm` writes); --rdzv-endpoint and --rdzv-id say where they meet. "
                        "MIN:MAX: elastic (torchrun's): the job runs on the machines it has between MIN and MAX, "
                        "restarting from its newest checkpoint when one leaves or joins, with the world it then has "
                        "(needs checkpoints; set train.global_batch to keep the batch the same)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="torchrun's c10d rendezvous (with --nnodes)")
    p.add_argument("--rdzv-id", help="the job's id, the same on every machine (with --nnodes)")
    p.add_argument("--stopped-exit-code", type=int, default=0, metavar="CODE",
                   help="exit with CODE, not 0, when a signal (SIGTERM, SIGUSR1) stopped the run before its last step "
                        "and the state was saved: a Kubernetes Job reruns only what failed (`launch k8s` sets it)")
    p.add_argument("--rdzv-conf", default="", metavar="KEY=VALUE,...",
                   help="torchrun's --rdzv-conf, e.g. last_call_timeout=10 (how long an elastic rendezvous waits "
                        "for more machines once it has MIN; default 30 s)")
    p.set_defaults(run=_run_train)


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a field, e.g. --set optim.lr=3e-4 (repeatable)",
    )


def _run_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # validates before anything is built or written
    if args.save_final:
        check_file_to_write("--save-final", args.save_final)
    if args.nproc < 0:
        raise ConfigError("--nproc", f"{args.nproc} < 0", "give the processes per machine, or leave it out for one")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise ConfigError("--max-restarts", f"{args.max_restarts} < 0", "give 0 or more")
    if not args.nproc and (args.nnodes != "1" or args.rdzv_endpoint or args.rdzv_id or args.max_restarts):
        flag = "--max-restarts" if args.max_restarts and args.nnodes == "1" else "--nnodes"
        raise ConfigError(flag, "machines, restarts and a rendezvous say how torchrun starts the processes, "
                          "and --nproc (which starts them) is not given", "add --nproc with the processes per machine")
    if args.nproc:
        from shardwise.launch.local import launch_local

        rendezvous = _rendezvous(args)
        fit_nodes(cfg, args.nproc, rendezvous.nodes if rendezvous else (1, 1))
        argv = ["train"] + (["--config", args.config] if args.config else [])
        argv += [f"--set={o}" for o in args.overrides]
        argv += ["--save-final", args.save_final] if args.save_final else []
        elastic = rendezvous is not None and rendezvous.elastic
        restarts = args.max_restarts if args.max_restarts is not None else 3 if elastic else 0
        check_restarts(cfg, restarts)
        check_resume(cfg)
        if rendezvous is None:  # one machine: what is wrong with the data, before any rank starts. (Over several,
            # every machine's launcher would tokenize the corpus at once: there rank 0 builds it, the others wait)
            from shardwise.data import prepare  # tokenizers and numpy; not torch

            prepare(cfg, cfg.parallel.dp)
        return launch_local(args.nproc, argv, max_restarts=restarts, rendezvous=rendezvous,
                            stopped_exit_code=args.stopped_exit_code,
                            stopped_marker=Path(cfg.metrics.out_dir) / STOPPED_FILE)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # a plain run (torchrun's ranks check it together, in load)
        fitted = copy.copy(cfg)  # fit_world replaces its tables
        fit_world(fitted, 1)
        check_resume(fitted)
    # a stop signal while this process imports torch (seconds, more on a busy machine) killed it: noted here, it
    # stops the run after its first step, as one that comes later does (train's StopSignal takes over from this)
    early: list[int] = []

    def note(signum, frame):
        early.append(signum)

    previous = {s: signal.signal(s, note) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        from shardwise.train import train  # heavy imports only once the config is known good

        # this process ends with the run
        summary = train(cfg, save_final=args.save_final, process_exits=True, stopped_before=early)
    finally:
        for s, handler in previous.items():
            if signal.getsignal(s) is note:  # (after a stop, StopSignal leaves them ignored: kept so)
                signal.signal(s, handler)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    losses = summary["losses"]
    if not losses:  # resumed at its last step
        print(f"done: nothing to train, the run is at step {summary['first_step'] - 1} of {cfg.train.steps}; "
              f"metrics in {cfg.metrics.out_dir}/metrics.jsonl")
        return 0
    line = f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    if "val_loss" in summary:
        line += f", val_loss {summary['val_loss']:.4f}"
    line += f"; metrics in {cfg.metrics.out_dir}/metrics.jsonl"
    if cfg.checkpoint.enabled:
        from shardwise.checkpoint import latest_checkpoint

        newest = latest_checkpoint(cfg.metrics.out_dir)
        line += f"; checkpoint {newest}" if newest is not None else ""
    print(line)
    return args.stopped_exit_code if "stopped_at" in summary else 0


def _rendezvous(args: argparse.Namespace) -> Rendezvous | None:
    """Where the machines of a job over several meet; None for one machine (torchrun --standalone)."""
    nodes = node_range(args.nnodes)
    if nodes == (1, 1) and not args.rdzv_endpoint:
        return None
    if not (args.rdzv_endpoint and args.rdzv_id):
        raise ConfigError("--rdzv-endpoint", "a job over several machines needs where they meet",
                          "set --rdzv-endpoint HOST:PORT (the first machine) and --rdzv-id (the job's id)")
    return Rendezvous(nodes, args.rdzv_endpoint, args.rdzv_id, args.rdzv_conf)


def _add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", dest="run_dir", metavar="DIR",
                   help="a training run's folder (its metrics.out_dir): exported with the config it was trained with "
                        "(its job_config.json), as generate --run reads it")
    p.add_argument("--config", help="the run's TOML file (its metrics.out_dir holds the checkpoints), instead of --run")
    _add_overrides(p)
    p.add_argument("--out", required=True, help="folder to write config.json and safetensors into")
    p.add_argument("--format", choices=("merged", "base", "peft"), default="merged",
                   help="merged: the model, a LoRA run's adapters merged into its weights (W + alpha/r BA; the "
                        "default); base: a LoRA run's frozen base alone; peft: a LoRA run's adapters as "
                        "adapter_config.json + adapter_model.safetensors, which peft loads on the base")
    p.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    cfg = _export_config(args)
    cfg.parallel = Layout()  # one process reads any layout's checkpoint
    cfg.train.deterministic = False  # a training setting: the export computes nothing it would change
    if args.format != "merged" and not cfg.lora.rank:
        raise ConfigError("--format", f"{args.format} needs a LoRA run's adapters, and lora.rank is 0",
                          "use --format merged (the default) for a run that trains every weight")
    if args.format != "peft":  # a model folder's config.json: refused before the checkpoint is read
        from shardwise.hf import hf_config

        try:
            hf_config(cfg.model)
        except ValueError as e:
            raise ConfigError("model", str(e).split("; fix: ")[0], "keep it as a shardwise checkpoint (shardwise "
                              "generate --run reads it); only a Mixtral-shaped mixture exports") from None
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} is a file", "give a folder to write into (made if missing)")
    base = cfg.checkpoint.init_from_hf
    if base and out.resolve() == Path(base).resolve():
        # merged and base replaced the base's config.json and weights: the run's adapters (which need that base) were
        # then refused by every resume, export and generate, and the base itself was gone; peft put its adapter beside
        # the base, which transformers then applies to every load of it and checkpoint.init_from_hf refuses
        harm = ("whose weights this export would replace" if args.format != "peft" else "which an adapter beside it "
                "would make load as the adapted model (and which the run's resume would then refuse)")
        raise ConfigError("--out", f"{out} is the run's base (checkpoint.init_from_hf), {harm}", "give another folder")
    # transformers (with peft installed) loads a folder's adapter_config.json onto its model: a merged export over
    # an earlier peft one applied the adapters twice, without a word (a base beside its adapter is peft's layout)
    if args.format == "merged" and (out / "adapter_config.json").is_file():
        raise ConfigError("--out", f"{out} holds adapter_config.json of another export, which transformers would "
                          "apply again on top of the merged weights", "give an empty folder, or remove the "
                          "adapter's files")
    if args.format == "peft" and hf_weights_metadata(out).get("shardwise_export") == "merged":
        # the other way round: peft's adapter beside weights that already hold it, applied twice
        raise ConfigError("--out", f"{out} holds a merged export, which transformers would apply the adapters to "
                          "again", "give an empty folder, or write the base there first (--format base)")
    made = next((d for d in reversed((out, *out.parents)) if not d.exists()), None)  # the first folder made
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError("--out", f"cannot make {out} ({e.strerror})", "give a folder you can write to") from None
    from shardwise.train import export_hf_from_checkpoint

    try:
        path = export_hf_from_checkpoint(cfg, args.out, args.format)
    except BaseException:
        if made is not None:  # a failed export leaves behind no folder that it made
            shutil.rmtree(made, ignore_errors=True)
        raise
    kind = args.format if cfg.lora.rank else "the whole model"  # "merged" says adapters where a run has none
    print(f"exported {path} to {args.out} ({kind})")
    if args.format == "peft" and not cfg.checkpoint.init_from_hf:
        print("the adapters' base is the run's seeded initial model: write it with --format base")
    return 0


def _export_config(args: argparse.Namespace):
    """The config to export with: the run's own (--run), or --config and --set, refused where they differ from the
    run's job_config.json in what the export writes and the checkpoint does not check. Its meta.json checks the
    adapters (rank, alpha / rank, targets, NF4) and a Hugging Face base, and its tensors the shapes; not the model
    fields config.json gives that shape no tensor (rope_theta, norm_eps), nor train.seed, which rebuilds a LoRA
    run's seeded base (its checkpoint holds only the adapters). An export with another --config wrote another
    model, without a word."""
    import dataclasses
    import json

    from shardwise.config import read_run_record, run_record, to_dict
    from shardwise.hf import hf_config

    if args.run_dir:
        if args.config or args.overrides:
            raise ConfigError("--run", "given with --config or --set", "pass --run DIR alone (the run is exported "
                              "with the config it was trained with), or --config with its --set overrides")
        record = Path(args.run_dir) / "job_config.json"
        if not record.is_file():
            raise ConfigError("--run", f"{args.run_dir} has no job_config.json", "pass the metrics.out_dir of a "
                              "training run, or use --config")
        return read_run_record(args.run_dir)
    cfg = load_config(args.config, args.overrides)
    record = Path(cfg.metrics.out_dir) / "job_config.json"
    if not record.is_file():  # no run there: the checkpoint's own error follows
        return cfg
    saved_cfg = read_run_record(cfg.metrics.out_dir)
    saved, mine = to_dict(saved_cfg), run_record(cfg)  # both with defaults filled
    try:  # the model as config.json gives it: training-only fields (capacity_factor, aux_loss_coeff) do not count
        written = hf_config(saved_cfg.model)
        pairs = [(f"model.{k}", saved["model"][k], mine["model"][k]) for k in mine["model"]
                 if written != hf_config(dataclasses.replace(saved_cfg.model, **{k: mine["model"][k]}))]
    except (ValueError, TypeError):  # not a Hugging Face model (a peft export writes no config.json)
        pairs = []
    if cfg.lora.rank and not cfg.checkpoint.init_from_hf:
        pairs.append(("train.seed", saved["train"]["seed"], mine["train"]["seed"]))
    for name, was, now in pairs:
        if was != now:
            raise ConfigError(name, f"{json.dumps(now)} here, {json.dumps(was)} in the run's job_config.json "
                              f"({cfg.metrics.out_dir}): the export would not be the model that was trained",
                              f"export with --run {cfg.metrics.out_dir} (the run's own config), or set "
                              f"{name} = {json.dumps(was)}")
    return cfg


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", dest="run_dir", metavar="DIR",
                   help="a training run's folder (its metrics.out_dir), with checkpoints")
    p.add_argument("--hf", dest="hf_dir", metavar="DIR",
                   help="a Hugging Face Llama or Mixtral folder (config.json, safetensors, tokenizer.json)")
    p.add_argument("--adapter", metavar="DIR", help="a peft LoRA adapter folder (adapter_config.json + "
                   "adapter_model.safetensors) to apply on --hf's model, as peft.PeftModel.from_pretrained does")
    p.add_argument("--prompt", default="", help="text the model continues (with --chat: the user's message)")
    p.add_argument("--chat", action="store_true",
                   help="an instruction-tuned --hf model: the prompt as the user's turn in the folder's chat template "
                        "(tokenizer_config.json's chat_template or chat_template.jinja); prints the reply alone")
    p.add_argument("--system", help="with --chat: a system message before the user's")
    p.add_argument("--max-new-tokens", type=int, default=200, help="stop after this many tokens (or at end-of-text)")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy (the most likely token each step)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens that sum to p")
    p.add_argument("--seed", type=int, default=0, help="the same seed gives the same text")
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    _check_generate(args)  # before torch is imported or anything is loaded
    from shardwise.generate import Sampling, complete, load_hf, load_run

    loaded = load_run(args.run_dir) if args.run_dir else load_hf(args.hf_dir, args.adapter)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    chat = ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
        {"role": "user", "content": args.prompt}] if args.chat else None
    text, stopped = complete(loaded, args.prompt, args.max_new_tokens, sampling, chat)
    print(text)
    if stopped is not None:  # a short (or empty) answer is the model's, not a failure
        print(f"(the model wrote end-of-text after {stopped} token(s))", file=sys.stderr)
    return 0


def _check_generate(args: argparse.Namespace) -> None:
    if bool(args.run_dir) == bool(args.hf_dir):
        given = "both given" if args.run_dir else "neither given"
        raise ConfigError("--run/--hf", given, "pass one: --run DIR for a training run's folder, --hf DIR for a "
                          "Hugging Face Llama folder")
    flag, folder = ("--run", Path(args.run_dir)) if args.run_dir else ("--hf", Path(args.hf_dir))
    needs = ["job_config.json", "checkpoints"] if args.run_dir else ["config.json", "tokenizer.json"]
    missing = [n for n in needs if not (folder / n).exists()]
    if not folder.is_dir():
        raise ConfigError(flag, f"no folder {folder}", "pass the path of an existing folder")
    if args.adapter and not args.hf_dir:
        raise ConfigError("--adapter", "given without --hf", "pass the base model's folder with --hf (a run's "
                          "adapters are in its checkpoint: --run DIR alone)")
    if args.hf_dir and (folder / "adapter_config.json").is_file() and not args.adapter:
        # peft's layout (an adapter beside its base, as export --format peft then base writes it): transformers
        # applies the adapter, and the weights read here were the base's alone, decoded without a word
        raise ConfigError(flag, f"{folder} holds a peft adapter (adapter_config.json), which generate applies only "
                          "when asked: its text would be the base model's", f"pass --adapter {folder} to apply it "
                          "on the base beside it")
    if missing:
        fix = ("train with checkpoint.enabled = true, and pass its metrics.out_dir" if args.run_dir
               else "copy the model's tokenizer.json (and config.json) from where the weights came from")
        raise ConfigError(flag, f"{folder} has no {' and no '.join(missing)}", fix)
    if args.hf_dir and not has_hf_weights(folder):
        raise ConfigError(flag, f"{folder} has no {' and no '.join(HF_WEIGHT_FILES)}",
                          "pass a folder written by save_pretrained (safetensors weights) or shardwise export")
    if args.run_dir and not any((folder / "checkpoints").glob("step_*/meta.json")):
        raise ConfigError(flag, f"{folder} has no complete checkpoint", "let the run save one "
                          "(checkpoint.every, or the end of the run)")
    if args.system is not None and not args.chat:
        raise ConfigError("--system", "given without --chat", "add --chat (a system message is a turn of a chat)")
    if args.chat and args.run_dir:
        raise ConfigError("--chat", "a training run's folder holds no chat template", "export the run (shardwise "
                          "export --run DIR --out OUT: one fine-tuned from a Hugging Face folder keeps its chat "
                          "template) and pass --hf OUT, or drop --chat")
    if args.chat and chat_template(folder) is None:
        raise ConfigError("--chat", f"{folder} has no chat template (chat_template.jinja, or tokenizer_config.json's "
                          "chat_template)", "pass an instruction-tuned model's folder, or drop --chat")
    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", f"{args.max_new_tokens} < 1", "ask for at least one token")
    if not 0 <= args.temperature < math.inf:  # nan too
        raise ConfigError("--temperature", f"{args.temperature} is not a finite number >= 0",
                          "0 for greedy decoding, or a positive value")
    if args.top_k < 0:
        raise ConfigError("--top-k", f"{args.top_k} < 0", "0 keeps every token, k > 0 the k most likely")
    if not 0 < args.top_p <= 1:
        raise ConfigError("--top-p", f"{args.top_p} is outside (0, 1]", "a share of probability in (0, 1]; 1 keeps all")


def _add_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file; omitted: the built-in defaults")
    _add_overrides(p)
    p.add_argument("--layout", action="append", required=True,
                   help='degrees and knobs, e.g. "dp_shard=2,tp=2" or "pp=2,pp_schedule=1f1b" (repeatable)')
    p.add_argument("--steps", type=int, default=5, help="optimizer steps to compare")
    p.add_argument("--rtol", type=float, default=1e-5, help="largest relative difference allowed")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(run=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    from shardwise.verify import run_verify

    return run_verify(args)


def _add_launch(p: argparse.ArgumentParser) -> None:
    from shardwise.launch.k8s import add_k8s_arguments
    from shardwise.launch.local import add_local_arguments
    from shardwise.launch.slurm import add_slurm_arguments

    schedulers = p.add_subparsers(dest="scheduler", required=True)
    for name, text, description, add in [
        ("slurm", "an sbatch script: srun + torchrun, save before the time limit, requeue",
         "write (--write), submit (--submit) or print an sbatch script for the job", add_slurm_arguments),
        ("k8s", "Kubernetes manifests: a Kubeflow Trainer TrainJob, or a JobSet; Kueue, GPUs, a shared volume",
         "write (--write) or print the manifests that run the job on Kubernetes (the pods read --config: put it in "
         "the image or on the volume)", add_k8s_arguments),
        ("local", "several machines played on this one: one torchrun agent each, elastic with MIN:MAX",
         "run the job as --nnodes machines of --nproc-per-node ranks each, all on this machine, meeting at a c10d "
         "rendezvous as a cluster's would; --leave takes one away mid-run, to see an elastic job go on with the "
         "machines it has", add_local_arguments),
    ]:
        scheduler = schedulers.add_parser(name, help=text, description=description)
        scheduler.set_defaults(command_parser=scheduler)
        scheduler.add_argument("--config", help="the job's TOML file; omitted: the built-in defaults")
        _add_overrides(scheduler)
        add(scheduler)


def _add_plan(p: argparse.ArgumentParser) -> None:
    from shardwise.planner.cli import add_plan_arguments, run_plan

    add_plan_arguments(p)
    p.set_defaults(run=run_plan)


def _add_bench(p: argparse.ArgumentParser) -> None:
    from shardwise.planner.bench import add_bench_arguments, run_bench

    add_bench_arguments(p)
    p.set_defaults(run=run_bench)


def _add_simulate(p: argparse.ArgumentParser) -> None:
    from shardwise.simulate import add_simulate_arguments, run_simulate

    add_simulate_arguments(p)
    p.set_defaults(run=run_simulate)


# name: (help, adds the command's arguments). Only the command being run is built: its module may import torch,
# which `shardwise plan` (and `--help`) need not wait for.
COMMANDS = {
    "train": ("train a model from a TOML config", _add_train),
    "export": ("write the newest checkpoint of a run as a Hugging Face Llama (or Mixtral) folder", _add_export),
    "generate": ("write text with a trained run or a Hugging Face Llama or Mixtral folder (KV cache, sampling)",
                 _add_generate),
    "verify": ("prove parallel layouts train exactly like one device", _add_verify),
    "launch": ("run the job on a cluster (Slurm, Kubernetes), or as several machines on this one", _add_launch),
    "plan": ("memory and step time of parallel plans, the best one, and why", _add_plan),
    "bench": ("measure this machine's FLOP/s and collective bandwidth (a planner profile)", _add_bench),
    "simulate": ("run one real training step as ranks of a large world, on fake tensors", _add_simulate),
}


class _Parser(argparse.ArgumentParser):
    """argparse, with a flag's bad value (`--nodes two`, `--kind pytorchjob`), a missing required flag or two flags
    that exclude each other said in one line naming the flag, as every other error of the command line is (argparse
    printed its usage, a screen of it for `launch slurm`, above its own line)."""

    def error(self, message: str):
        flag, problem = self.prog, message
        if m := re.fullmatch(r"argument ([^:]+): (.*)", message, re.S):
            flag, problem = m.groups()
        elif message.startswith("the following arguments are required: "):
            flag, problem = message.split(": ", 1)[1], "required"
        print(f"shardwise: error: {ConfigError(flag, problem, f'`{self.prog} --help` lists the arguments')}",
              file=sys.stderr)
        self.exit(2)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with `command`'s arguments (every command's when None, none for "") and the other commands
    listed."""
    parser = _Parser(prog="shardwise", description=__doc__)  # its subcommands' parsers are _Parsers too
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (text, add) in COMMANDS.items():
        p = sub.add_parser(name, help=text, description=text)
        p.set_defaults(command_parser=p)  # a nested command's own (launch slurm) replaces it
        if command in (None, name):
            add(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), "")  # the first word; "" lists the commands
    # no command (`shardwise --help`) or an unknown one: the list of commands needs none's arguments, and bench's and
    # simulate's import torch (5 s of `shardwise --help`)
    args, unknown = build_parser(command if command in COMMANDS else "").parse_known_args(argv)
    from shardwise.errors import CheckpointError, TrainingError

    try:
        if unknown:
            raise _unknown_argument(args.command_parser, unknown[0])
        return args.run(args)
    except ConfigError as e:
        # a bad value is the user's to fix: one line naming the field, no traceback
        return _error(e, 2, final=True)
    except (CheckpointError, TrainingError) as e:
        # a checkpoint the run cannot load (or write) is the same on a restart; a lost peer or a hang may not be
        return _error(e, 3, final=isinstance(e, CheckpointError))
    except KeyboardInterrupt:
        # Ctrl-C: stop where it is, without Python's traceback (a run's newest checkpoint is what it resumes from;
        # SIGTERM or train.stop_after save first). Under --nproc every rank gets the signal, and so does shardwise's
        # launcher, which says it for its machine (it and local rank 0 both did); under a torchrun started otherwise
        # (by hand, by a cluster's own launcher) local rank 0 does
        rank = os.environ.get("LOCAL_RANK")
        if rank is None or (rank == "0" and LAUNCHED not in os.environ):
            print("shardwise: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader of our output went away (`shardwise plan ... | head`): nothing left to say, and no traceback
        # when Python flushes stdout at exit (the Python docs' recipe, "Note on SIGPIPE")
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _unknown_argument(parser: argparse.ArgumentParser, given: str) -> ConfigError:
    """A misspelt flag as one line naming it, the command and the nearest flag (argparse printed the top-level
    usage, `shardwise [-h]`, and no suggestion)."""
    flags = re.findall(r"--[a-z][\w-]*", parser.format_usage())
    name = given.split("=", 1)[0]
    near = difflib.get_close_matches(name, flags, n=1)
    fix = f"did you mean {near[0]}? " if near else ""
    if "--set" in flags:  # a config field written as a flag (`train --stpes 5` was told "did you mean --set?")
        from shardwise.config import JobConfig

        fields = {f"{table}.{f.name}": f.name for table, value in vars(JobConfig()).items()
                  for f in dataclasses.fields(value)}
        word = name.lstrip("-").replace("-", "_")
        field = difflib.get_close_matches(word, fields.values(), n=1, cutoff=0.75)
        # the command's own flag when it is as near (simulate --seqlen is --seq-len, not --set data.seq_len)
        if field and not (near and _closeness(word, near[0]) >= _closeness(word, field[0])):
            key = next(k for k, v in fields.items() if v == field[0])
            fix = f"did you mean --set {key}=...? "
    return ConfigError(given, f"not an argument of `{parser.prog}`", f"{fix}`{parser.prog} --help` lists them")


def _closeness(word: str, flag_or_field: str) -> float:
    """How near a misspelt flag's name is to a flag or field name, both written as field names are."""
    return difflib.SequenceMatcher(None, word, flag_or_field.lstrip("-").replace("-", "_")).ratio()


def _error(e: Exception, exit_code: int, final: bool) -> int:
    """Print a shardwise error as one line, once per job: under torchrun every rank meets it, so only rank 0
    prints it and each rank hands it to the launcher, which prints it when rank 0 did not fail with one, and does
    not restart the job for it when it is `final` (every attempt would meet it)."""
    line = f"shardwise: error: {e}"
    from shardwise.distributed import hand_error_to_launcher

    if not hand_error_to_launcher(line, exit_code, final) or int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
