"""The byte-level text corpus's split (docs/data.md): the last ``ceil(val_fraction × size)`` bytes
are held out, and no training window reads a held-out byte nor a validation window a training
byte — checked on a file whose head and tail are different bytes, through ``Batches``."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from moezero.data import Batches, TextCorpus

SEQ = 4


@pytest.mark.parametrize("size,fraction", [(100, 0.07), (200, 0.55), (60, 0.1), (1000, 0.01),
                                           (37, 0.3), (64, 0.5)])
def test_the_held_out_tail_never_overlaps_the_training_bytes(tmp_path, size, fraction):
    tail = math.ceil(Fraction(str(fraction)) * size)  # the fraction as written, exactly
    path = tmp_path / "t.txt"
    head_N, tail_N = np.arange(size - tail) % 128, 128 + np.arange(tail) % 128
    path.write_bytes(np.concatenate([head_N, tail_N]).astype(np.uint8).tobytes())
    corpus = TextCorpus(path, fraction)
    assert (corpus.train_bytes.size, corpus.val_bytes.size) == (size - tail, tail)
    batches = Batches(corpus, global_batch=64, seq_len=SEQ, seed=0, dp_rank=0, dp_size=1)
    train = np.concatenate([batches.next() for _ in range(40)])
    val = np.concatenate([batches.val_batch(i) for i in range(40)])
    assert train.max() < 128 and val.min() >= 128  # no byte of the other side
    # the boundary itself is read: a training window ends at the last head byte, a
    # validation window starts at the first tail byte
    assert (train == head_N[-(SEQ + 1):]).all(axis=1).any()
    assert (val == tail_N[:SEQ + 1]).all(axis=1).any()
