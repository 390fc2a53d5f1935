"""A text file read as bytes (vocab 256): the data option that needs no tokenizer."""

from __future__ import annotations

import math
import os
from fractions import Fraction
from pathlib import Path

import numpy as np

from moezero.data.common import MODEL_VOCAB, DataError, check_int, entropy_nats


class TextCorpus:
    """Raw bytes of a file as tokens (vocab 256); samples are random windows.

    With ``val_fraction > 0`` the last ``ceil(val_fraction * size)`` bytes are held out:
    training windows lie in the head, validation windows (:meth:`sample_val`) in the tail.
    ``entropy_floor`` is None (unknown for real text); ``unigram_entropy`` is the entropy of
    the file's byte histogram.
    """

    def __init__(self, path: str | os.PathLike, val_fraction: float = 0.0):
        self.path = Path(path)
        if not self.path.exists():
            raise DataError(f"data file {self.path}: no such file")
        if self.path.is_dir():
            raise DataError(f"data file {self.path}: is a directory, expected a text file")
        try:
            self.bytes_ = np.fromfile(self.path, dtype=np.uint8)
        except OSError as e:
            raise DataError(f"data file {self.path}: cannot read ({e.strerror or e})") from None
        if self.bytes_.size == 0:
            raise DataError(f"data file {self.path}: is empty")
        counts = np.bincount(self.bytes_, minlength=MODEL_VOCAB)
        self.entropy_floor: float | None = None
        self.unigram_entropy = entropy_nats(counts / counts.sum())
        self.vocab_size_needed = MODEL_VOCAB
        self.cut = self.bytes_.size - held_out(self.bytes_.size, val_fraction)
        self.train_bytes, self.val_bytes = self.bytes_[:self.cut], self.bytes_[self.cut:]

    def check_seq_len(self, seq_len: int, *, validation: bool = False) -> None:
        """Windows of ``seq_len + 1`` bytes need at least ``seq_len + 2`` bytes in each part
        that is read (the training head; the held-out tail too with ``validation``)."""
        check_int("seq_len", seq_len, 1)
        parts = [("", self.train_bytes)]
        if validation:
            parts.append(("held-out tail (data.val_fraction) ", self.val_bytes))
        for what, part in parts:
            if part.size < seq_len + 2:
                raise DataError(
                    f"data file {self.path}: {what or ''}{part.size} bytes is too short for "
                    f"seq_len {seq_len} (needs at least {seq_len + 2})"
                )

    def sample(self, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
        """``n`` random training windows of ``length`` consecutive bytes, int64 [n, length]."""
        return self._windows(self.train_bytes, rng, n, length)

    def sample_val(self, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
        """``n`` random windows of the held-out tail, int64 [n, length]."""
        return self._windows(self.val_bytes, rng, n, length)

    def _windows(self, part: np.ndarray, rng, n: int, length: int) -> np.ndarray:
        if part.size < length + 1:
            self.check_seq_len(length - 1, validation=part is self.val_bytes)
        start_N = rng.integers(0, part.size - length + 1, size=n)
        return part[start_N[:, None] + np.arange(length)].astype(np.int64)

    def describe(self) -> str:
        held = f", last {self.val_bytes.size} held out" if self.val_bytes.size else ""
        return (
            f"bytes of {self.path}: {self.bytes_.size} bytes{held}, vocab 256, "
            f"unigram {self.unigram_entropy:.3f} nats/token"
        )


def held_out(size: int, val_fraction: float) -> int:
    """``ceil(val_fraction × size)`` for the fraction as written (``0.07`` is 7/100): the float
    product can land just above an integer (``0.07 * 100 == 7.000000000000001``) and move the
    cut a byte into the training head."""
    return math.ceil(Fraction(repr(float(val_fraction))) * size)
