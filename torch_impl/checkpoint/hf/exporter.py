"""``moezero checkpoint export --format hf|hf-<model_type>``: any moezero checkpoint as a
Hugging Face model directory ``from_pretrained`` loads (docs/hf.md, "Export").

The family is the one named, or the one that holds the checkpoint's architecture (chosen by
QK-norm and the shared expert); what it cannot hold is refused in one line. K/V projections
keep their grouped-query shapes; the expert biases (buffers) are written as the family's
``e_score_correction_bias``, fp32 at any ``dtype`` (as the Hub holds them). Streamed as
``tools.write_weights``: one 8 MiB chunk at a time.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from moezero.checkpoint import tokenizer as hf_tokenizer
from moezero.checkpoint.hf.arch import arch_of
from moezero.checkpoint.hf.carried import attach, checked, hf_section
from moezero.checkpoint.hf.families import family_for
from moezero.checkpoint.hf.names import hf_name
from moezero.checkpoint.tools import write_weights
from moezero.plan import store
from moezero.plan.store import CheckpointError

HF_CONFIG = "config.json"


def export_hf(ckpt: Path, out: Path, dtype: str = "fp32", shard_bytes: int | None = None,
              model_type: str | None = None) -> list[Path]:
    """``config.json`` + safetensors shards + ``model.safetensors.index.json`` of family
    ``model_type`` (None: the one that holds the architecture).

    Raises:
        CheckpointError: (one line) the checkpoint's architecture does not fit the family, or
            it holds LoRA adapters (``--merge-lora`` folds them in: ``peft_export``).
    """
    manifest = store.read_manifest(ckpt)
    adapters = [f for f, _ in manifest.layout.shapes if f.endswith((".lora_A", ".lora_B"))]
    if adapters or manifest.base:
        raise CheckpointError(f"{ckpt}: holds LoRA adapters ({len(adapters)} tensors, e.g. "
                              f"{adapters[0] if adapters else '?'}); export them with --format peft, or "
                              "merged with --merge-lora --format hf (docs/finetune.md)")
    arch = arch_of(manifest)
    family = family_for(arch, model_type or hf_section(manifest.config).get("model_type"))
    tokenizer_files = hf_tokenizer.files_to_export(manifest.config)
    carried = checked(family, manifest.config)  # a vision tower written back: Qwen3.5-MoE
    shapes = manifest.layout.shapes + manifest.layout.buffers
    items = family.export_items(shapes, arch) if family.export_items else \
        [(hf_name(fqn, family), fqn, shape) for fqn, shape in shapes]
    files = write_weights(ckpt, manifest, out, items, dtype, shard_bytes=shard_bytes,
                          meta={"format": "pt", "moezero.step": str(manifest.step)},
                          keep_fp32=frozenset(f for f, _ in manifest.layout.buffers))
    config = {**family.config(arch, dtype), **hf_tokenizer.config_ids(manifest.config)}
    config, files = attach(family, carried, config, out, files)
    (out / HF_CONFIG).write_text(json.dumps(config, indent=2))
    return [out / HF_CONFIG, *files, *hf_tokenizer.copy_export(tokenizer_files, out)]


def num_params(manifest) -> int:
    """Elements of every parameter of a checkpoint."""
    return sum(math.prod(shape) for _, shape in manifest.layout.shapes)
