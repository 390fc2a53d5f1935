"""The ``moezero`` command (DESIGN.md §4).

``moezero train [--config FILE] [--set KEY=VALUE ...] [--nproc N] [--out DIR] [--data PATH]``
with no arguments trains the embedded default recipe on 2 local ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from torch_impl.config import ConfigError, load_config
from torch_impl.data import DataError, make_corpus
from torch_impl.parallel import validate


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moezero", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a MoE model (the embedded default with no flags)")
    train.add_argument("--config", help="YAML or JSON recipe (default: the embedded recipe)")
    train.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override one dotted config key; repeatable")
    train.add_argument("--nproc", type=int, default=2,
                       help="local ranks to spawn (ignored under torchrun; default 2)")
    train.add_argument("--out", help="run directory (default runs/<timestamp>)")
    train.add_argument("--data", help="train on this text file (byte-level) instead of the "
                                      "synthetic corpus")
    return parser


def _train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.data:
        overrides.append(f"data.path={args.data}")
    if args.nproc < 1:
        raise ConfigError("--nproc", f"must be >= 1, got {args.nproc}", "command line")
    cfg = load_config(args.config, overrides)
    d = cfg.data
    make_corpus(d.path, vocab=d.synthetic_vocab, sources=d.synthetic_sources,
                seed=d.synthetic_seed).check_seq_len(cfg.train.seq_len)
    world = int(os.environ.get("WORLD_SIZE", args.nproc))
    try:
        validate(world, cfg.moe.ep_size, cfg.moe.num_experts)
    except ValueError as exc:
        key, _, problem = str(exc).partition(": ")
        raise ConfigError(key, problem, f"world size {world}") from None
    run_dir = Path(args.out or cfg.train.out_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))

    from torch_impl.engine import check_supported  # torch import deferred: errors above stay fast
    from torch_impl.launcher import launch

    check_supported(cfg)
    return launch(cfg, run_dir, args.nproc)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
    except (ConfigError, DataError) as exc:
        print(f"moezero: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
