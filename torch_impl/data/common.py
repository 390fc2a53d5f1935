"""Shared pieces of the data package: its error type and argument checks."""

from __future__ import annotations

import numpy as np

MODEL_VOCAB = 256  # bytes; the synthetic corpus's alphabet must fit it too


class DataError(ValueError):
    """A bad data path, corpus setting or batching setting (one-line message)."""


def entropy_nats(p_V: np.ndarray) -> float:
    """Shannon entropy in nats of a probability vector (zeros contribute nothing)."""
    p_V = p_V[p_V > 0]
    return float(-(p_V * np.log(p_V)).sum())


def check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
