"""The tokenizer of a Hugging Face model through moezero's checkpoints (docs/hf.md).

``import-hf`` copies a model folder's tokenizer files (``data.tokenizer.TOKENIZER_FILES``)
into ``<out>/tokenizer/`` and records them in the checkpoint's config (``tokenizer.path``,
the SHA-256 of ``tokenizer.json``, the vocabulary size, the bos/eos/pad ids); training carries
that section into every checkpoint it writes; ``export --format hf-*`` copies the files back
beside the weights and writes the ids into ``config.json``, so the exported folder loads with
``AutoTokenizer.from_pretrained`` as well as the model class. Checked before anything is
written: a tokenizer that changed since it was recorded is refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from moezero.data import DataError
from moezero.data import tokenizer as tok
from moezero.plan.store import CheckpointError

FOLDER = "tokenizer"
IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _present(folder: Path) -> list[Path]:
    return [folder / name for name in tok.TOKENIZER_FILES if (folder / name).is_file()]


def describe_import(src: Path, out: Path) -> dict | None:
    """The ``tokenizer`` config section ``import-hf`` records for model folder ``src`` (its
    files will live in ``out/tokenizer``), or None when ``src`` has no tokenizer files."""
    if not _present(src):
        return None
    section = {"path": str((out / FOLDER).resolve())}
    if not (src / tok.TOKENIZER_JSON).is_file():  # e.g. sentencepiece only: copied, not used
        return section
    try:
        info = tok.describe_folder(src)
    except DataError as exc:
        raise CheckpointError(f"{src}: tokenizer: {exc}") from None
    return {**section, "sha256": info.sha256, "vocab_size": info.vocab_size,
            **{k: info.special.get(k) for k in IDS}}


def copy_import(src: Path, out: Path) -> list[Path]:
    """Copy ``src``'s tokenizer files into ``out/tokenizer`` (created)."""
    files = _present(src)
    if files:
        (out / FOLDER).mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(f, out / FOLDER / f.name)) for f in files]


def files_to_export(config: dict) -> list[Path]:
    """The tokenizer files a checkpoint's config records, checked (nothing when it records
    none).

    Raises:
        CheckpointError: (one line) the recorded folder or ``tokenizer.json`` is missing, or
            ``tokenizer.json`` changed since it was recorded.
    """
    section = (config or {}).get("tokenizer") or {}
    if not section.get("path"):
        return []
    folder = Path(section["path"])
    files = _present(folder)
    if not files:
        raise CheckpointError(f"the checkpoint's tokenizer {folder} (tokenizer.path) has no "
                              "tokenizer files; restore them to export")
    if section.get("sha256"):
        path = folder / tok.TOKENIZER_JSON
        if not path.is_file() or tok.file_sha256(path) != section["sha256"]:
            raise CheckpointError(f"{path}: missing or changed since the checkpoint recorded it "
                                  f"(sha256 {section['sha256'][:12]}…)")
    return files


def copy_export(files: list[Path], out: Path) -> list[Path]:
    return [Path(shutil.copy2(f, out / f.name)) for f in files]


def config_ids(config: dict) -> dict:
    """The recorded bos/eos/pad ids, for an exported ``config.json`` (unset ones left out)."""
    section = (config or {}).get("tokenizer") or {}
    return {k: section[k] for k in IDS if section.get(k) is not None}
