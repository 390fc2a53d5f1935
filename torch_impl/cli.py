"""The ``moezero`` command (``moezero docs`` lists the documentation pages it ships).

``moezero train [--config FILE] [--set KEY=VALUE ...] [--nproc N] [--out DIR] [--data PATH]``
with no arguments trains the embedded default recipe on 2 local ranks.

``moezero checkpoint inspect|verify|export DIR`` reads a checkpoint (a step directory, or a
checkpoint root whose ``latest`` is taken): its groups and sizes, every checksum (exit 1 naming
the first bad file and byte range), or consolidated model weights as Hugging Face safetensors
(``--format hf`` or ``hf-<model_type>``: a model ``transformers`` loads, docs/hf.md).

``moezero import-hf PATH --out DIR`` turns a local Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE
or OLMoE directory into a weights-only moezero checkpoint that ``moezero train --set
checkpoint.load=DIR`` fine-tunes.

``moezero prepare-data INPUT... --tokenizer PATH --out DIR`` tokenizes .txt/.jsonl/.parquet
files into a prepared dataset that ``--set data.path=DIR`` trains on (docs/data.md).

``moezero estimate [--config FILE] [--set ...] --nproc N`` prints one rank's bytes of params,
gradients and optimizer state per tier and its predicted peak, computed from the config without
building the model (with ``checkpoint.load``, the checkpoint's architecture, as ``train``
adopts it; docs/scale.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from moezero import cli_checkpoint as ckpt_cmd
from moezero.catalog import listing as recipe_listing
from moezero.catalog import resolve as resolve_recipe
from moezero.config import ConfigError, load_config
from moezero.data import DataError
from moezero.plan.store import CheckpointError

if TYPE_CHECKING:  # torch-free at import: the CLI's early errors stay fast
    from moezero.offload.options import IOOptions

CONFIG_HELP = ("YAML or JSON recipe file, or the name of a packaged one (moezero recipes); "
               "default: the embedded recipe")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moezero", description="Mixture-of-Experts training with ZeRO-sharded data "
        "parallelism.", epilog="Documentation: 'moezero docs' lists the pages installed with "
        "moezero; 'moezero docs TOPIC' prints one (e.g. moezero docs finetune).")
    parser.add_argument("--version", action="version", version=f"moezero {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a MoE model (the embedded default with no flags)")
    train.add_argument("--config", help=CONFIG_HELP)
    train.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override one dotted config key; repeatable")
    train.add_argument("--nproc", type=int, default=None,
                       help="local ranks to spawn (ignored under torchrun; default: one per "
                            "CUDA device under NCCL, else 2)")
    train.add_argument("--out", help="run directory (default runs/<timestamp>)")
    train.add_argument("--data", help="train on this prepared dataset (prepare-data) or text "
                                      "file (byte-level) instead of the synthetic corpus")
    sub.add_parser("recipes", help="list the packaged recipes: model, hardware, predicted peak")
    example = sub.add_parser("example", help="make inputs for a first run with nothing "
                                             "downloaded (needs the hf extra)")
    example.add_argument("name", choices=("tiny-hf",),
                         help="tiny-hf: DIR/tiny-qwen3/ (a random Hugging Face Qwen3-MoE with a "
                              "tokenizer and chat template) and DIR/chats.jsonl")
    example.add_argument("dir", metavar="DIR", help="folder to write them in")
    docs = sub.add_parser("docs", help="where the documentation is; its pages, or one page")
    docs.add_argument("topic", nargs="?", metavar="TOPIC", help="a page to print (e.g. finetune)")
    ckpt_cmd.checkpoint_parser(sub)
    hf = sub.add_parser("import-hf", help="a local Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE "
                                          "or OLMoE directory to a weights-only moezero "
                                          "checkpoint (moezero docs hf)")
    hf.add_argument("path", metavar="PATH", help="directory with config.json and safetensors")
    hf.add_argument("--out", required=True, metavar="DIR",
                    help="checkpoint root to create (new or empty)")
    hf.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                    help="dtype of the weights written (default: the source's; fp32 masters "
                         "are derived exactly at load)")
    ckpt_cmd.import_deepspeed_parser(sub)
    _prepare_parser(sub)
    est = sub.add_parser("estimate", help="per-rank bytes of params, grads and optimizer state "
                                          "per tier, from the config alone (moezero docs scale)")
    est.add_argument("--config", help=CONFIG_HELP)
    est.add_argument("--set", dest="overrides", action="append", default=[],
                     metavar="KEY=VALUE", help="override one dotted config key; repeatable")
    est.add_argument("--nproc", type=int, required=True, help="world size W")
    est.add_argument("--rank", type=int, default=0, help="the rank to estimate (default 0)")
    est.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                     help="compute device kind (precision auto resolves by it; default cuda)")
    return parser


def _version() -> str:
    """The installed distribution's version (``unknown`` when run from a bare source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moezero")
    except PackageNotFoundError:
        return "unknown"


def _docs(args: argparse.Namespace) -> int:
    from moezero import helpdocs

    folder = helpdocs.docs_folder()
    text = helpdocs.page(folder, args.topic) if args.topic else helpdocs.listing(folder)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `moezero docs finetune | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _adopt(cfg, run_dir: Path):
    """With ``checkpoint.load``: the architecture keys the user did not set, from it (said on
    stdout)."""
    if not cfg.checkpoint.load:
        return cfg
    from moezero.checkpoint.adopt import adopt_architecture

    cfg, adopted = adopt_architecture(cfg, run_dir)
    if adopted:
        print(f"moezero: architecture from checkpoint {cfg.checkpoint.load}: "
              f"{', '.join(adopted)} (another value needs checkpoint.allow_arch_change)",
              flush=True)
    return cfg


def _base_dtype(cfg) -> str | None:
    """The weights' dtype of ``checkpoint.load`` (``bf16`` for a bf16 import), else None."""
    if not cfg.checkpoint.load or cfg.checkpoint.load == "latest":
        return None
    from moezero.checkpoint.hf.dtypes import BY_TAG
    from moezero.plan import store

    try:
        dtype = store.read_manifest(store.find_checkpoint(cfg.checkpoint.load)).layout.dtype
    except (store.CheckpointError, OSError):
        return None
    return BY_TAG.get(dtype)


def _estimate(args: argparse.Namespace) -> int:
    cfg = load_config(resolve_recipe(args.config), args.overrides)
    cfg = _adopt(cfg, Path(cfg.train.out_dir or "."))
    from moezero.distributed.topology import validate

    if not 0 <= args.rank < args.nproc:
        raise ConfigError("--rank", f"must be in [0, {args.nproc}), got {args.rank}", "command line")
    try:
        validate(args.nproc, cfg.moe.ep_size, cfg.moe.num_experts)
    except ValueError as exc:
        key, _, problem = str(exc).partition(": ")
        raise ConfigError(key, problem, f"world size {args.nproc}") from None
    from moezero.estimate import estimate, format_table

    print(format_table(estimate(cfg, args.nproc, rank=args.rank, device=args.device,
                                base_dtype=_base_dtype(cfg))))
    return 0


def _prepare_parser(sub) -> None:
    from moezero.data.readers import ReadOptions

    prep = sub.add_parser("prepare-data", help="tokenize .txt/.jsonl/.parquet files into a "
                                               "prepared dataset (moezero docs data)")
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help=".txt, .jsonl or .parquet")
    prep.add_argument("--tokenizer", required=True, metavar="PATH",
                      help="tokenizer.json, a model folder holding one, or a moezero "
                           "checkpoint made by import-hf")
    prep.add_argument("--out", required=True, metavar="DIR", help="dataset folder to create")
    prep.add_argument("--text-field", default=ReadOptions.text_field, metavar="NAME",
                      help="jsonl field (dotted for nested) / parquet column of the text")
    prep.add_argument("--txt-split", choices=("paragraph", "line", "file"),
                      default=ReadOptions.txt_split, help="a .txt file's documents")
    prep.add_argument("--eod-token", metavar="TOKEN",
                      help="appended after each document (default: the model's EOS token)")
    prep.add_argument("--workers", type=int, metavar="N",
                      help="tokenizer processes (default: the usable cores)")
    prep.add_argument("--chunk-mb", type=float, default=ReadOptions.chunk_bytes / 2**20,
                      metavar="MB", help="input per work item and shard (default 16)")
    prep.add_argument("--format", choices=("text", "chat", "prompt-completion"), default="text",
                      help="documents (text), .jsonl 'messages' rendered with the chat template "
                           "(chat), or .jsonl 'prompt'/'completion' (moezero docs data)")
    prep.add_argument("--train-on", choices=("all", "assistant", "last-assistant"),
                      default="assistant", help="tokens the loss mask keeps (chat formats)")
    prep.add_argument("--chat-template", metavar="FILE",
                      help="a jinja chat template to use instead of the tokenizer's")


def _prepare_data(args: argparse.Namespace) -> int:
    from moezero.data import prepare, readers

    workers = prepare.default_workers() if args.workers is None else args.workers
    if workers < 1 or not args.chunk_mb > 0:
        raise DataError(f"--workers must be >= 1 and --chunk-mb > 0, got {workers} and "
                        f"{args.chunk_mb}")
    read = readers.ReadOptions(args.text_field, args.txt_split,
                               max(1, int(args.chunk_mb * 2**20)))
    options = prepare.PrepareOptions(
        read, args.eod_token, workers, prepare.progress_default(), args.format, args.train_on,
        Path(args.chat_template) if args.chat_template else None)
    try:
        manifest = prepare.prepare(args.inputs, args.out, args.tokenizer, options)
    except OSError as exc:
        raise DataError(f"prepare-data to {args.out}: {exc.strerror or exc}") from None
    print(prepare.summary_line(manifest, Path(args.out)))
    return 0


def _train(args: argparse.Namespace, io: IOOptions | None = None) -> int:
    overrides = list(args.overrides)
    if args.data:
        overrides.append(f"data.path={args.data}")
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError("--nproc", f"must be >= 1, got {args.nproc}", "command line")
    cfg = load_config(resolve_recipe(args.config), overrides)
    run_dir = Path(args.out or cfg.train.out_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
    cfg = _adopt(cfg, run_dir)
    from moezero.data.build import check_data

    cfg = check_data(cfg, note=_note)  # every data check of the ranks, shards verified
    from moezero.distributed.topology import validate  # torch: prepare-data never loads it

    defaulted = args.nproc is None
    args.nproc = _check_devices(cfg, args.nproc)
    world = int(os.environ.get("WORLD_SIZE", args.nproc))

    try:
        validate(world, cfg.moe.ep_size, cfg.moe.num_experts)
    except ValueError as exc:
        key, _, problem = str(exc).partition(": ")
        where = f"world size {world}" + (
            f", one rank per CUDA device; use --set {key}=1 on one GPU, or "
            "--set dist.backend=gloo for 2 CPU ranks" if defaulted and world != 2 else "")
        raise ConfigError(key, problem, where) from None

    from moezero.engine import check_supported  # torch import deferred: errors above stay fast
    from moezero.memory_check import check_activation_memory, memory_of
    from moezero.rundir import check_run
    from moezero.train import checkpoint_size, launch_training, model_numel, preflight

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun: this node's ranks
    from moezero.distributed.devices import compute_device, cuda_device_count

    device = compute_device(cfg.dist.backend, cuda_device_count())
    frozen = model_numel(cfg) if cfg.peft.uses_lora else 0  # the base: no optimizer state
    check_supported(cfg, numel=model_numel(cfg, adapters=cfg.peft.uses_lora), frozen=frozen,
                    share=local / world, device=device)
    check_activation_memory(cfg, device=device.type, memory_bytes=memory_of(device.type),
                            local_ranks=local)
    resumes = preflight(cfg, run_dir)
    if cfg.train.deterministic:  # before any rank starts: cuBLAS reads it once per process
        from moezero.model.determinism import CUBLAS_WORKSPACE

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    check_run(run_dir, cfg.checkpoint.resolve_dir(run_dir), checkpoint_size(cfg),
              keep_last=cfg.checkpoint.keep_last, resumes=resumes,
              lock=int(os.environ.get("RANK", "0")) == 0)  # torchrun: rank 0 holds the lock
    return launch_training(cfg, run_dir, args.nproc, io)


def _check_devices(cfg, nproc: int | None) -> int:
    """``--nproc`` (default: one rank per CUDA device under NCCL, else 2), refused in one line
    where this machine cannot place the ranks (``moezero.distributed.devices``)."""
    from moezero.distributed.devices import (
        DeviceError,
        cuda_device_count,
        default_nproc,
        plan_devices,
    )

    count = cuda_device_count()
    nproc = nproc or default_nproc(cfg.dist.backend, count)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", nproc))  # torchrun: this node's ranks
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if "LOCAL_WORLD_SIZE" in os.environ else None
    try:
        plan_devices(local, cfg.dist.backend, count, visible)
    except DeviceError as exc:
        raise ConfigError(exc.key, exc.problem, f"{count} CUDA devices here") from None
    return nproc


def _note(line: str) -> None:
    print(f"moezero: note: {line}", file=sys.stderr)


def main(argv: list[str] | None = None, io: IOOptions | None = None) -> int:
    """Run one command; returns its exit code. ``io``: the ``train`` engines' I/O options
    (``moezero.offload.options.IOOptions``; a test's ``save_writer`` injects save faults)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args, io)
        if args.command == "checkpoint":
            return ckpt_cmd.checkpoint(args)
        if args.command == "import-hf":
            return ckpt_cmd.import_hf(args)
        if args.command == "import-deepspeed":
            return ckpt_cmd.import_deepspeed(args)
        if args.command == "prepare-data":
            return _prepare_data(args)
        if args.command == "estimate":
            return _estimate(args)
        if args.command == "example":
            from moezero.examples import tiny_hf

            return tiny_hf.main([args.dir])
        if args.command == "docs":
            return _docs(args)
        if args.command == "recipes":
            print(recipe_listing())
            return 0
    except (ConfigError, DataError, CheckpointError) as exc:
        print(f"moezero: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
