"""What a resume takes from its checkpoint: the architecture and tokenizer keys the run leaves
unset are adopted from the checkpoint's manifest; an architecture key set to another value is
refused in one line unless ``checkpoint.allow_arch_change`` lists it (docs/hf.md,
docs/reliability.md). Called by ``moezero train`` before any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from moezero.checkpoint.core import resolve_load
from moezero.config import ARCHITECTURE, Config, ConfigError
from moezero.config.errors import FieldError
from moezero.plan import store

ADOPTED_KEYS = {**ARCHITECTURE, "tokenizer": ("path", "sha256", "vocab_size", "bos_token_id",
                                           "eos_token_id", "pad_token_id"),
                "hf": ("model_type", "carried", "carried_sha256")}
"""The architecture keys (``moezero.config.ARCHITECTURE``), the model's tokenizer and what its
Hugging Face export needs: what a run resuming a checkpoint takes from it."""

def adopt_architecture(cfg: Config, run_dir: str | Path) -> tuple[Config, list[str]]:
    """``cfg`` with each ``ADOPTED_KEYS`` key the user did not set (in a file or with ``--set``)
    taken from the config in the manifest of the checkpoint ``checkpoint.load`` names.

    Returns:
        The config and the ``key=value`` items adopted (those that changed).

    Raises:
        CheckpointError: the checkpoint cannot be found or read (one line).
        ConfigError: an architecture key set to another value than the checkpoint's and not
            in ``checkpoint.allow_arch_change``, adopted values that make an invalid config, or
            ``peft.targets`` the checkpoint's model lacks (one line).
    """
    ckpt = resolve_load(cfg.checkpoint.load, cfg.checkpoint.resolve_dir(run_dir))
    saved = store.read_manifest(ckpt).config
    data, adopted = cfg.model_dump(by_alias=True), []
    for section, keys in ADOPTED_KEYS.items():
        theirs = saved.get(section) if isinstance(saved, dict) else None
        explicit = getattr(cfg, section).model_fields_set
        for key in keys:
            if not isinstance(theirs, dict) or key not in theirs \
                    or _same(theirs[key], data[section][key]):
                continue
            if key not in explicit:
                data[section][key] = theirs[key]
                adopted.append(f"{section}.{key}={theirs[key]}")
            elif section in ARCHITECTURE:
                _refuse_change(cfg, f"{section}.{key}", data[section][key], theirs[key], ckpt)
    if adopted:
        try:
            cfg = Config.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise ConfigError(".".join(map(str, err["loc"])), err["msg"],
                              f"architecture adopted from {ckpt}") from None
    try:  # the checks the schema leaves to the checkpoint's architecture
        cfg.check_peft_targets()
    except FieldError as exc:
        raise ConfigError(exc.field, exc.problem, f"architecture of checkpoint {ckpt}") from None
    return cfg, adopted


def _same(saved, ours) -> bool:
    """Whether a manifest's JSON value is the config's (a JSON list holds a tuple field)."""
    return saved == ours or (isinstance(ours, tuple) and saved == list(ours))


def _refuse_change(cfg: Config, key: str, ours, theirs, ckpt: Path) -> None:
    """ConfigError naming ``key`` and both values, unless ``checkpoint.allow_arch_change``
    lists it."""
    if key not in cfg.checkpoint.allow_arch_change:
        raise ConfigError(key, f"{json.dumps(ours)} differs from the checkpoint's "
                               f"{json.dumps(theirs)}; to change it deliberately, add it to "
                               "checkpoint.allow_arch_change", f"checkpoint {ckpt}")
