"""Deterministic per-rank batching of the generated corpora (synthetic, byte-level text).

The global batch for step ``i`` is a pure function of ``(corpus, seed, i)``, so a run sees the
same token stream at any data-parallel world size with the same global batch. Plain numpy: no
torch, no distributed calls; the trainer converts the int64 arrays to tensors.
"""

from __future__ import annotations

import os

import numpy as np

from moezero.data.common import DataError, MicroBatch, check_int
from moezero.data.synthetic import MarkovMixture
from moezero.data.text import TextCorpus

_BATCH_TAG = 0x42415443
_VAL_TAG = 0x56414C31

Corpus = MarkovMixture | TextCorpus


def make_corpus(
    data_cfg_path: str | os.PathLike | None, *, vocab: int, sources: int, seed: int
) -> Corpus:
    """The text corpus at ``data_cfg_path``, or the synthetic mixture when it is None."""
    if data_cfg_path is None:
        return MarkovMixture(vocab=vocab, sources=sources, seed=seed)
    return TextCorpus(data_cfg_path)


class Batches:
    """Global batches, split by data-parallel rank, resumable from a small state.

    Global batch ``i`` is ``corpus.sample`` under a generator seeded with
    ``(seed, i)``, so it is identical for every ``dp_size``; rank ``r`` gets rows
    ``[r*b, (r+1)*b)`` with ``b = global_batch // dp_size``. Every call to
    :meth:`next` consumes one step (the trainer calls it once per micro-batch).
    """

    def __init__(
        self,
        corpus: Corpus,
        *,
        global_batch: int,
        seq_len: int,
        seed: int,
        dp_rank: int,
        dp_size: int,
    ):
        self.global_batch = check_int("global_batch", global_batch, 1)
        self.dp_size = check_int("dp_size", dp_size, 1)
        self.dp_rank = check_int("dp_rank", dp_rank, 0)
        if self.dp_rank >= self.dp_size:
            raise DataError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        if self.global_batch % self.dp_size:
            raise DataError(f"global_batch {global_batch} is not divisible by dp_size {dp_size}")
        corpus.check_seq_len(seq_len)
        self.corpus = corpus
        self.seq_len = seq_len
        self.seed = check_int("data seed", seed, 0)
        self.local_batch = self.global_batch // self.dp_size
        self.step = 0

    def global_batch_at(self, step: int) -> np.ndarray:
        """The whole global batch number ``step``, int64 [global_batch, seq_len + 1]."""
        rng = np.random.default_rng([_BATCH_TAG, self.seed, step])
        return self.corpus.sample(rng, self.global_batch, self.seq_len + 1)

    def next(self) -> np.ndarray:
        """This rank's rows of global batch ``self.step``; advances ``step``."""
        lo = self.dp_rank * self.local_batch
        rows = self.global_batch_at(self.step)[lo : lo + self.local_batch]
        self.step += 1
        return rows

    def next_batch(self) -> MicroBatch:
        """``next()`` as a ``MicroBatch``: generated corpora train every target, no documents."""
        return MicroBatch(self.next())

    def val_micro_batch(self, index: int) -> MicroBatch:
        return MicroBatch(self.val_batch(index))

    def val_batch(self, index: int) -> np.ndarray:
        """This rank's rows of validation batch ``index``: ``corpus.sample_val`` under a seed
        stream of its own, so every evaluation sees the same held-out batches."""
        rng = np.random.default_rng([_VAL_TAG, self.seed, index])
        rows = self.corpus.sample_val(rng, self.global_batch, self.seq_len + 1)
        lo = self.dp_rank * self.local_batch
        return rows[lo : lo + self.local_batch]

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        return self.next()

    def state_dict(self) -> dict:
        return {"step": int(self.step), "seed": int(self.seed)}

    @staticmethod
    def accepts(state: object) -> bool:
        """Whether ``state`` is a position of this kind of stream (a step count)."""
        return isinstance(state, dict) and set(state) == {"step", "seed"}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved step with the saved seed (the saved stream wins)."""
        if not isinstance(state, dict) or set(state) != {"step", "seed"}:
            raise DataError(f"data state must be a dict with keys step and seed, got {state!r}")
        self.step = check_int("data state step", state["step"], 0)
        self.seed = check_int("data state seed", state["seed"], 0)
