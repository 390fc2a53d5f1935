"""The checkpoint commands of ``moezero``: ``checkpoint inspect|verify|export``,
``import-hf`` and ``import-deepspeed`` (their parsers and handlers; ``moezero.cli`` dispatches).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moezero.plan.store import CheckpointError, read_manifest

HF_FORMATS = ("hf-mixtral", "hf-qwen2_moe", "hf-qwen3_moe", "hf-olmoe")
"""``checkpoint export --format`` values of the Hugging Face families (``checkpoint.hf``)."""
PEFT_NOTE = ("moezero: note: loading this adapter, PEFT warns that the rank_pattern and "
             "alpha_pattern key 'mlp\\.experts\\.gate_up_proj' matched no targeted module: "
             "expected, the key applies to the targeted expert parameter (moezero docs finetune)")
"""Printed by ``checkpoint export --format peft`` when the adapter has a fused gate_up
adapter of rank 2r: PEFT's check looks at ``target_modules`` only (docs/finetune.md)."""
def checkpoint_parser(sub) -> None:
    """``moezero checkpoint inspect|verify|export``."""
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
            cmd.add_argument("--format", choices=("moezero", "hf", *HF_FORMATS, "peft"),
                             default="moezero",
                             help="moezero: tensors keyed by moezero FQNs; hf: config.json + "
                                  "Hugging Face names of the family that holds the "
                                  "architecture; hf-<model_type>: of that family (moezero docs hf); "
                                  "peft: a LoRA checkpoint's adapters for PEFT (moezero docs finetune)")
            cmd.add_argument("--merge-lora", action="store_true",
                             help="with --format hf: fold a LoRA checkpoint's adapters into "
                                  "full weights")
            cmd.add_argument("--base", metavar="PATH",
                             help="with --format peft or --merge-lora: where the LoRA run's "
                                  "base checkpoint is now, if it moved (its step directory or "
                                  "root; checked to be the same base)")
            cmd.add_argument("--out", required=True, metavar="PATH",
                             help="output directory (created)")


def import_deepspeed_parser(sub) -> None:
    ds = sub.add_parser("import-deepspeed", help="a DeepSpeed ZeRO checkpoint of a Hugging Face "
                                                 "MoE model, optimizer state included "
                                                 "(moezero docs migrate-deepspeed)")
    ds.add_argument("path", metavar="CKPT_DIR", help="DeepSpeed checkpoint folder")
    ds.add_argument("--tag", help="tag folder (default: 'latest', else the only global_step*)")
    ds.add_argument("--out", required=True, metavar="DIR",
                    help="checkpoint root to create (new or empty)")
    ds.add_argument("--model-config", metavar="PATH",
                    help="the model's Hugging Face config.json (or its folder), where it is not "
                         "in CKPT_DIR or the folder above it")
    ds.add_argument("--names", metavar="YAML", help="DeepSpeed name pattern -> moezero FQN "
                                                   "pattern, for native MoE modules")


def import_deepspeed(args: argparse.Namespace) -> int:
    from moezero.checkpoint.deepspeed import import_deepspeed as run_import
    from moezero.checkpoint.deepspeed import report

    try:
        done = run_import(Path(args.path), Path(args.out), args.tag, args.names,
                                args.model_config)
    except OSError as exc:
        raise CheckpointError(f"import-deepspeed to {args.out}: {exc.strerror or exc}") from None
    except KeyboardInterrupt:  # the importer has removed what it wrote
        print(f"moezero: interrupted: import-deepspeed stopped; nothing was kept in {args.out}",
              file=sys.stderr)
        return 130
    print(report.render(done, args.out))
    return 0


def import_hf(args: argparse.Namespace) -> int:
    from moezero.checkpoint import hf  # torch import deferred, as for train

    try:
        step_dir = hf.import_hf(Path(args.path), Path(args.out), args.dtype)
    except OSError as exc:
        raise CheckpointError(f"import-hf to {args.out}: {exc.strerror or exc}") from None
    manifest = read_manifest(step_dir)
    note = (manifest.state or {}).get("source", {}).get("note")
    if note:
        print(f"moezero: {note}")
    numel, dtype = hf.num_params(manifest), manifest.layout.dtype
    print(f"imported {args.path}: {numel:,} parameters as weights-only checkpoint {step_dir} "
          f"({dtype})\n"
          f"fine-tune: moezero train --set checkpoint.load={args.out} "
          f"(or --config {Path(args.out) / 'config.yaml'})")
    return 0


def _export(ckpt: Path, args: argparse.Namespace) -> list[Path]:
    """``checkpoint export``'s files in ``args.out`` (``args.format`` resolved for the line)."""
    from moezero.checkpoint import tools as checkpoint_tools

    base = None if args.base is None else Path(args.base)
    if args.format == "peft":
        from moezero.checkpoint.hf.peft_export import export_peft

        return export_peft(ckpt, Path(args.out), args.dtype, base)
    if args.format.startswith("hf"):
        from moezero.checkpoint.hf import export_hf
        from moezero.checkpoint.hf.peft_export import export_merged

        model_type = args.format.removeprefix("hf").lstrip("-") or None
        if args.merge_lora:
            files = export_merged(ckpt, Path(args.out), args.dtype, model_type, base)
        else:
            files = export_hf(ckpt, Path(args.out), args.dtype, model_type=model_type)
        args.format = "hf-" + json.loads(files[0].read_text())["model_type"]
        return files
    return checkpoint_tools.export(ckpt, Path(args.out), args.dtype)


def checkpoint(args: argparse.Namespace) -> int:
    from moezero.checkpoint import tools as checkpoint_tools  # torch import deferred, as for train
    from moezero.checkpoint.core import find_checkpoint

    ckpt = find_checkpoint(args.dir)
    if args.action == "inspect":
        print(checkpoint_tools.describe(ckpt))
        return 0
    if args.action == "export":
        if args.merge_lora and not args.format.startswith("hf"):
            raise CheckpointError(f"--merge-lora writes Hugging Face weights: it needs --format "
                                  f"hf or hf-<model_type>, not --format {args.format}")
        if args.base is not None and not (args.merge_lora or args.format == "peft"):
            raise CheckpointError("--base is read by --format peft and --merge-lora (a LoRA "
                                  f"run's base), not by --format {args.format}")
        try:
            files = checkpoint_tools.into_empty(Path(args.out), lambda: _export(ckpt, args))
        except OSError as exc:
            raise CheckpointError(f"export to {args.out}: {exc.strerror or exc}") from None
        if args.format == "peft" and "rank_pattern" in json.loads(files[0].read_text()):
            print(PEFT_NOTE)
        print(f"exported {ckpt.name} as {args.format} {args.dtype}: "
              + ", ".join(str(f) for f in files))
        return 0
    problems = checkpoint_tools.verify(ckpt)
    for line in problems:
        print(f"moezero: checkpoint verify: {line}", file=sys.stderr)
    if problems:
        return 1
    print(f"ok: {ckpt}: every checksum matches")
    return 0
