"""The ``moezero`` command (DESIGN.md §4).

``moezero train [--config FILE] [--set KEY=VALUE ...] [--nproc N] [--out DIR] [--data PATH]``
with no arguments trains the embedded default recipe on 2 local ranks.

``moezero checkpoint inspect|verify|export DIR`` reads a checkpoint (a step directory, or a
checkpoint root whose ``latest`` is taken): its groups and sizes, every checksum (exit 1 naming
the first bad file and byte range), or consolidated model weights as Hugging Face safetensors.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from reference.plan.store import CheckpointError
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
    ckpt = sub.add_parser("checkpoint", help="inspect, verify or export a checkpoint")
    action = ckpt.add_subparsers(dest="action", required=True)
    for name, text in (("inspect", "groups, tensors and bytes of a checkpoint"),
                       ("verify", "recompute every checksum; exit 1 naming the first bad range"),
                       ("export", "consolidated model weights (safetensors + index), no "
                                  "optimizer state")):
        cmd = action.add_parser(name, help=text)
        cmd.add_argument("dir", metavar="DIR", help="a step directory, or a checkpoint root "
                                                    "(its latest complete checkpoint)")
        if name == "export":
            cmd.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")
            cmd.add_argument("--out", required=True, metavar="PATH",
                             help="output directory (created)")
    return parser


def _checkpoint(args: argparse.Namespace) -> int:
    from torch_impl import checkpoint_tools  # torch import deferred, as for train
    from torch_impl.checkpoint import find_checkpoint

    ckpt = find_checkpoint(args.dir)
    if args.action == "inspect":
        print(checkpoint_tools.describe(ckpt))
        return 0
    if args.action == "export":
        try:
            files = checkpoint_tools.export(ckpt, Path(args.out), args.dtype)
        except OSError as exc:
            raise CheckpointError(f"export to {args.out}: {exc.strerror or exc}") from None
        print(f"exported step {ckpt.name} as {args.dtype}: " + ", ".join(str(f) for f in files))
        return 0
    problems = checkpoint_tools.verify(ckpt)
    for line in problems:
        print(f"moezero: checkpoint verify: {line}", file=sys.stderr)
    if problems:
        return 1
    print(f"ok: {ckpt}: every checksum matches")
    return 0


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
    from torch_impl.train import preflight

    check_supported(cfg)
    preflight(cfg, run_dir)
    return launch(cfg, run_dir, args.nproc)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "checkpoint":
            return _checkpoint(args)
    except (ConfigError, DataError, CheckpointError) as exc:
        print(f"moezero: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
