"""Hugging Face tokenizers as moezero reads them: ``tokenizer.json`` (the ``tokenizers`` library)
found in a file, a model folder, or a moezero checkpoint made by ``moezero import-hf``.

``TokenizerInfo`` is the plain record of one tokenizer: where its files are, the SHA-256 of its
``tokenizer.json`` (what a prepared dataset and a checkpoint are matched by), its vocabulary
size, the end-of-document id ``prepare-data`` appends and the special-token ids a model folder
declares. ``tokenizers`` is imported only when a tokenizer is loaded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from moezero.data.common import DataError

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "chat_template.jinja", "chat_template.json")
"""The files of a Hugging Face tokenizer that ``import-hf`` copies and ``export`` writes back."""
SPECIAL_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
_EOD_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>")
_MANIFEST = "manifest.json"


@dataclass(frozen=True)
class TokenizerInfo:
    """One tokenizer: its folder (or ``tokenizer.json``'s folder), hash, sizes and ids.

    ``model_vocab`` is the vocabulary of the model the tokenizer came with (``config.json`` or
    the checkpoint's ``model.vocab_size``), None for a bare tokenizer; ``special`` maps
    ``bos_token_id``/``eos_token_id``/``pad_token_id``/``unk_token_id`` to ids (absent: unknown).
    """

    json_path: Path
    sha256: str
    vocab_size: int
    special: dict = field(default_factory=dict)
    model_vocab: int | None = None

    @property
    def folder(self) -> Path:
        return self.json_path.parent

    def load(self):
        """The ``tokenizers.Tokenizer``."""
        return load_tokenizer(self.json_path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def load_tokenizer(path: Path):
    """``tokenizers.Tokenizer.from_file``, its failure as one line."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("the tokenizers package is needed to read a tokenizer "
                        "(pip install 'moezero[data]')") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises a bare Exception
        raise DataError(f"{path}: not a tokenizers tokenizer.json "
                        f"({' '.join(str(exc).split())[:200]})") from None


def read_json(path: Path) -> dict:
    """A JSON object from ``path``, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: unreadable JSON ({' '.join(str(exc).split())[:200]})") from None
    return obj if isinstance(obj, dict) else {}


def _token_text(value) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_id(value) -> int | None:
    """An id from ``config.json`` (an int, or a list whose first entry is the main one)."""
    if isinstance(value, list) and value:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def special_ids(folder: Path, tokenizer) -> dict:
    """``bos/eos/pad/unk_token_id`` of a model folder: the tokens ``tokenizer_config.json``
    names first (what the tokenizer itself uses), then the ids of ``generation_config.json``
    and ``config.json``."""
    out: dict[str, int] = {}
    tok_cfg = read_json(folder / "tokenizer_config.json")
    for key in SPECIAL_KEYS:
        text = _token_text(tok_cfg.get(key.removesuffix("_id")))
        token_id = tokenizer.token_to_id(text) if text is not None else None
        if token_id is not None:
            out[key] = token_id
    for name in ("generation_config.json", "config.json"):
        cfg = read_json(folder / name)
        for key in SPECIAL_KEYS:
            if key not in out and _first_id(cfg.get(key)) is not None:
                out[key] = _first_id(cfg.get(key))
    return out


def describe_folder(folder: Path, *, model_vocab: int | None = None,
                    special: dict | None = None) -> TokenizerInfo:
    """The :class:`TokenizerInfo` of a folder holding ``tokenizer.json``."""
    tokenizer = load_tokenizer(folder / TOKENIZER_JSON)
    if special is None:
        special = special_ids(folder, tokenizer)
    if model_vocab is None:
        model_vocab = _first_id(read_json(folder / "config.json").get("vocab_size"))
    return TokenizerInfo(folder / TOKENIZER_JSON, file_sha256(folder / TOKENIZER_JSON),
                         tokenizer.get_vocab_size(with_added_tokens=True),
                         {k: v for k, v in special.items() if v is not None}, model_vocab)


def _checkpoint_tokenizer(path: Path) -> TokenizerInfo:
    """The tokenizer a moezero checkpoint's config records (``tokenizer.path``)."""
    from moezero.plan.store import CheckpointError, find_checkpoint, read_manifest

    try:
        config = read_manifest(find_checkpoint(path)).config
    except CheckpointError as exc:
        raise DataError(f"--tokenizer {path}: {exc}") from None
    tok = (config or {}).get("tokenizer") or {}
    if not tok.get("path"):
        raise DataError(f"--tokenizer {path}: the checkpoint records no tokenizer (import-hf "
                        f"copies one from a model folder that has {TOKENIZER_JSON})")
    folder = Path(tok["path"])
    if not (folder / TOKENIZER_JSON).is_file():
        raise DataError(f"--tokenizer {path}: the checkpoint's tokenizer {folder / TOKENIZER_JSON} "
                        "is missing")
    info = describe_folder(folder, model_vocab=(config.get("model") or {}).get("vocab_size"),
                           special={k: tok.get(k) for k in SPECIAL_KEYS})
    if tok.get("sha256") and tok["sha256"] != info.sha256:
        raise DataError(f"--tokenizer {path}: {info.json_path} changed since the checkpoint "
                        f"recorded it (sha256 {info.sha256[:12]}, recorded {tok['sha256'][:12]})")
    return info


def resolve(path: str | Path) -> TokenizerInfo:
    """The tokenizer ``--tokenizer PATH`` names: a ``tokenizer.json`` file, a folder holding one
    (a Hugging Face model folder), or a moezero checkpoint (root or step directory) whose
    config records one.

    Raises:
        DataError: (one line) nothing usable at ``path``.
    """
    path = Path(path)
    if path.is_file():
        return describe_folder(path.parent) if path.name == TOKENIZER_JSON else _bare_file(path)
    if not path.is_dir():
        raise DataError(f"--tokenizer {path}: no such file or directory")
    if (path / TOKENIZER_JSON).is_file():
        return describe_folder(path)
    if (path / _MANIFEST).is_file() or (path / "latest").exists() or any(path.glob("step_*")):
        return _checkpoint_tokenizer(path)
    raise DataError(f"--tokenizer {path}: no {TOKENIZER_JSON} there (nor a moezero checkpoint)")


def _bare_file(path: Path) -> TokenizerInfo:
    """A tokenizer file under another name: usable, described on its own."""
    tokenizer = load_tokenizer(path)
    return TokenizerInfo(path, file_sha256(path),
                         tokenizer.get_vocab_size(with_added_tokens=True), {}, None)


def end_of_document(info: TokenizerInfo, tokenizer, token: str | None = None) -> int:
    """The id appended after every document: ``token`` if given, else the model's EOS id, else
    a well-known end token of the vocabulary.

    Raises:
        DataError: ``token`` is not in the vocabulary, or nothing identifies the end token.
    """
    if token is not None:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise DataError(f"--eod-token {token!r}: not in the vocabulary of {info.json_path}")
        return token_id
    if "eos_token_id" in info.special:
        return info.special["eos_token_id"]
    for name in _EOD_NAMES:
        if tokenizer.token_to_id(name) is not None:
            return tokenizer.token_to_id(name)
    raise DataError(f"{info.json_path}: no end-of-document token found (no eos_token in its "
                    "folder's tokenizer_config.json or config.json); pass --eod-token TOKEN")
