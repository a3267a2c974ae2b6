"""`shardwise <command>`: the command line (also `python -m shardwise`)."""

from __future__ import annotations

import argparse
import sys

from shardwise.config import ConfigError, load_config


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model from a TOML config")
    p.add_argument("--config", help="TOML file (see configs/); omitted: the built-in defaults")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a field, e.g. --set optim.lr=3e-4 (repeatable)",
    )
    p.set_defaults(run=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # validates before anything is built or written
    from shardwise.train import train  # heavy imports only once the config is known good

    summary = train(cfg)
    losses = summary["losses"]
    line = f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    if "val_loss" in summary:
        line += f", val_loss {summary['val_loss']:.4f}"
    print(f"{line}; metrics in {cfg.metrics.out_dir}/metrics.jsonl")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as e:
        # a bad value is the user's to fix: one line naming the field, no traceback
        print(f"shardwise: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
