"""Samples of prepared datasets in a global order that does not depend on the world size.

``TokenBlend`` numbers the samples of a weighted blend of packed splits: global sample ``k``
is sample ``j`` of dataset ``d`` (``blend.blend_positions``), and within a dataset the
training order is a fresh permutation every epoch (seeded by ``(seed, d, epoch)``);
validation samples are taken in order. ``TokenBatches`` gives rank ``r`` of ``W`` the
samples ``[p + r b, p + (r+1) b)`` of each global micro-batch, where ``p`` is the number of
global samples consumed so far and ``b`` the per-rank micro-batch; ``p`` is its state. A run
resumed at another W (same per-rank batch or not) continues the same global sample order.
"""

from __future__ import annotations

import numpy as np

from moezero.data.blend import blend_positions, normalise
from moezero.data.common import DataError, MicroBatch, check_int, entropy_nats
from moezero.data.indexed import PackedSplit

_EPOCH_TAG = 0x45504F43


class TokenBlend:
    """Global sample ``k`` -> tokens, over packed splits of one or more datasets."""

    def __init__(self, splits: list[PackedSplit], weights: list[float], *, seed: int,
                 shuffle: bool):
        self.splits, self.weights = splits, normalise(weights)
        self.seed, self.shuffle = seed, shuffle
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def positions(self, start: int, stop: int) -> np.ndarray:
        """(dataset, sample index within its split) of global samples ``[start, stop)``,
        int64 [n, 2]: the sample ids a run consumes."""
        dataset, within = blend_positions(self.weights, start, stop)
        index = np.array([self._index(int(d), int(j)) for d, j in zip(dataset, within,
                                                                      strict=True)], np.int64)
        return np.stack([dataset, index.reshape(-1)], axis=1)

    def _index(self, d: int, j: int) -> int:
        n = self.splits[d].num_samples
        epoch, i = divmod(j, n)
        if not self.shuffle:
            return i
        key = (d, epoch)
        if key not in self._perms:
            if len(self._perms) >= 2 * len(self.splits):
                self._perms.clear()
            rng = np.random.default_rng([_EPOCH_TAG, self.seed, d, epoch])
            self._perms[key] = rng.permutation(n)
        return int(self._perms[key][i])

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The tokens of sample ids (from :meth:`positions`), int64 [n, seq_len + 1]."""
        return np.stack([self.splits[d].sample(int(i)) for d, i in ids])

    @property
    def has_mask(self) -> bool:
        """Whether any dataset of the blend holds a loss mask (then every batch carries one)."""
        return any(split.dataset.has_mask for split in self.splits)

    def micro_batch(self, ids: np.ndarray, *, document_mask: bool) -> MicroBatch:
        """The tokens of sample ids with the targets' loss mask (when a dataset has one) and
        each input's document (with ``document_mask``)."""
        mask = np.stack([self.splits[d].sample_mask(int(i))[1:] for d, i in ids]) \
            if self.has_mask else None
        docs = np.stack([self.splits[d].sample_documents(int(i))[:-1] for d, i in ids]) \
            if document_mask else None
        return MicroBatch(self.rows(ids), mask, docs)


class BlendCorpus:
    """What the trainer shows of a blend: a description and its unigram entropy."""

    def __init__(self, datasets, weights: np.ndarray):
        self.datasets, self.weights = datasets, weights
        mix = sum(w * ds.unigram_counts() / max(1, ds.unigram_counts().sum())
                  for w, ds in zip(weights, datasets, strict=True))
        self.unigram_entropy = entropy_nats(mix)
        self.entropy_floor: float | None = None

    def describe(self) -> str:
        if len(self.datasets) == 1:
            return f"prepared dataset {self.datasets[0].describe()}"
        parts = [f"{w:.3f} x {ds.path}" for w, ds in zip(self.weights, self.datasets, strict=True)]
        return f"blend of {len(parts)} prepared datasets ({', '.join(parts)}), unigram " \
               f"{self.unigram_entropy:.3f} nats/token"


class TokenBatches:
    """This rank's micro-batches of a blend, resumable from the global samples consumed."""

    def __init__(self, train: TokenBlend, val: TokenBlend | None, corpus: BlendCorpus, *,
                 local_batch: int, dp_rank: int, dp_size: int, document_mask: bool = False):
        self.train, self.val, self.corpus = train, val, corpus
        self.document_mask = document_mask
        self.local_batch = check_int("micro_batch_size", local_batch, 1)
        self.dp_size = check_int("dp_size", dp_size, 1)
        self.dp_rank = check_int("dp_rank", dp_rank, 0)
        if self.dp_rank >= self.dp_size:
            raise DataError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        self.global_batch = self.local_batch * self.dp_size
        self.consumed = 0
        self.last_ids = np.zeros((0, 2), np.int64)

    def next(self) -> np.ndarray:
        """This rank's rows of the next global micro-batch, int64 [b, seq_len + 1]."""
        return self.train.rows(self._advance())

    def next_batch(self) -> MicroBatch:
        """``next()`` with the loss mask and the documents (``MicroBatch``)."""
        return self.train.micro_batch(self._advance(), document_mask=self.document_mask)

    def _advance(self) -> np.ndarray:
        lo = self.consumed + self.dp_rank * self.local_batch
        self.last_ids = self.train.positions(lo, lo + self.local_batch)
        self.consumed += self.global_batch
        return self.last_ids

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        return self.next()

    def val_batch(self, index: int) -> np.ndarray:
        """This rank's rows of validation batch ``index`` (the same at every evaluation)."""
        return self.val.rows(self._val_ids(index))

    def val_micro_batch(self, index: int) -> MicroBatch:
        """``val_batch(index)`` with the loss mask and the documents (``MicroBatch``)."""
        return self.val.micro_batch(self._val_ids(index), document_mask=self.document_mask)

    def _val_ids(self, index: int) -> np.ndarray:
        if self.val is None:
            raise DataError("no validation split: data.val_fraction is 0")
        lo = index * self.global_batch + self.dp_rank * self.local_batch
        return self.val.positions(lo, lo + self.local_batch)

    def state_dict(self) -> dict:
        return {"consumed_samples": int(self.consumed), "seed": int(self.train.seed)}

    @staticmethod
    def accepts(state: object) -> bool:
        """Whether ``state`` is a position of this kind of stream (global samples)."""
        return isinstance(state, dict) and set(state) == {"consumed_samples", "seed"}

    def load_state_dict(self, state: dict) -> None:
        """Resume after the saved number of global samples, in the saved seed's order."""
        if not self.accepts(state):
            raise DataError("data state must be a dict with keys consumed_samples and seed, "
                            f"got {state!r}")
        self.consumed = check_int("data state consumed_samples", state["consumed_samples"], 0)
        self.train.seed = check_int("data state seed", state["seed"], 0)
        self.train._perms.clear()
