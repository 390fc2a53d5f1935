"""Shared pieces of the data package: its error type and argument checks."""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

MODEL_VOCAB = 256  # bytes; the synthetic corpus's alphabet must fit it too


class MicroBatch(NamedTuple):
    """One rank's micro-batch: ``tokens`` int64 [b, S+1] (inputs and shifted targets);
    ``loss_mask`` bool [b, S], True where target ``s`` is trained (None: every target);
    ``documents`` int64 [b, S], the document of each input (None: no document mask)."""

    tokens: np.ndarray
    loss_mask: np.ndarray | None = None
    documents: np.ndarray | None = None


class DataError(ValueError):
    """A bad data path, corpus setting or batching setting (one-line message)."""


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> str | None:
    """Where ``text`` holds a lone surrogate (JSON's ``"\\ud800"`` decodes to one; no text
    encoding can write it, so a tokenizer fails on it), as ``U+D800 at character 7``."""
    found = _SURROGATE.search(text)
    return None if found is None else f"U+{ord(found.group()):04X} at character {found.start()}"


def entropy_nats(p_V: np.ndarray) -> float:
    """Shannon entropy in nats of a probability vector (zeros contribute nothing)."""
    p_V = p_V[p_V > 0]
    return float(-(p_V * np.log(p_V)).sum())


def check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
