"""Training data: a synthetic Markov-mixture corpus, a byte-level text corpus, and
deterministic per-rank batching.

The global batch for step ``i`` is a pure function of ``(corpus, seed, i)``, so a
run sees the same token stream at any data-parallel world size, and a checkpoint
taken at one world size resumes at another. Plain numpy: no torch, no distributed
calls; the trainer converts the int64 arrays to tensors.

Shape legend: S = sources, V = vocab symbols, N = rows (sequences), L = tokens per row.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

MODEL_VOCAB = 256  # every token id must fit the model's embedding table
_SUCCESSORS = 5  # non-zero entries per transition row (fewer if vocab is smaller)
_ROW_CONCENTRATION = 1.0  # Dirichlet concentration over a row's successors
_CORPUS_TAG = 0x4D41524B  # keeps corpus-building and batch RNG streams apart
_BATCH_TAG = 0x42415443


class DataError(ValueError):
    """A bad data path, corpus setting or batching setting (one-line message)."""


def entropy_nats(p_V: np.ndarray) -> float:
    """Shannon entropy in nats of a probability vector (zeros contribute nothing)."""
    p_V = p_V[p_V > 0]
    return float(-(p_V * np.log(p_V)).sum())


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise DataError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _draw(cdf_NV: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One categorical draw per row from unnormalised cumulative sums.

    ``u < total`` strictly, so the chosen ``j`` has ``cdf[j-1] <= u < cdf[j]`` and
    therefore positive probability: zero-probability symbols are never drawn, even
    with float round-off in the cumulative sums.
    """
    u_N = rng.random(cdf_NV.shape[0]) * cdf_NV[:, -1]
    return (cdf_NV <= u_N[:, None]).sum(axis=1)


def _stationary(transition_VV: np.ndarray) -> np.ndarray:
    """Stationary distribution pi = pi P of an irreducible chain (solved, not iterated)."""
    num_vocab = transition_VV.shape[0]
    a = np.vstack([transition_VV.T - np.eye(num_vocab), np.ones((1, num_vocab))])
    b = np.zeros(num_vocab + 1)
    b[-1] = 1.0
    pi_V = np.clip(np.linalg.lstsq(a, b, rcond=None)[0], 0.0, None)
    return pi_V / pi_V.sum()


def _random_transition(rng: np.random.Generator, num_vocab: int) -> np.ndarray:
    """A sparse random transition matrix that is irreducible by construction.

    Every row puts Dirichlet weights on ``_SUCCESSORS`` symbols, one of which is the
    row's successor on a random Hamiltonian cycle, so every state reaches every
    other and the stationary distribution is unique.
    """
    k = min(_SUCCESSORS, num_vocab)
    perm_V = rng.permutation(num_vocab)
    cycle_next_V = np.empty(num_vocab, dtype=np.int64)
    cycle_next_V[perm_V] = np.roll(perm_V, -1)
    transition_VV = np.zeros((num_vocab, num_vocab))
    for i in range(num_vocab):
        others = np.delete(np.arange(num_vocab), cycle_next_V[i])
        succ = np.concatenate([[cycle_next_V[i]], rng.choice(others, k - 1, replace=False)])
        transition_VV[i, succ] = rng.dirichlet(np.full(k, _ROW_CONCENTRATION))
    return transition_VV


class MarkovMixture:
    """A uniform mixture of seeded first-order Markov sources over ``vocab`` symbols.

    A sequence picks one source uniformly and runs its chain from the source's
    stationary distribution. ``entropy_floor`` is the mean over sources of each
    source's entropy rate ``-sum_i pi_i sum_j P_ij log P_ij``: the per-token loss of
    a model that knows the source. It is a lower bound on achievable loss: it
    ignores the first token of each sequence (drawn from pi, not P) and the cost of
    identifying the source from context, both of which vanish as sequences grow.
    ``unigram_entropy`` is the entropy of the mixture's marginal symbol
    distribution: the loss of a model that predicts token frequencies only. For
    vocab 32 the floor is about 1.3 nats against a unigram entropy of about 3.4.
    """

    def __init__(self, *, vocab: int, sources: int, seed: int):
        self.vocab = _check_int("data vocab", vocab, 2)
        if self.vocab > MODEL_VOCAB:
            raise DataError(f"data vocab must be <= {MODEL_VOCAB}, got {vocab}")
        self.num_sources = _check_int("data sources", sources, 1)
        self.seed = _check_int("data seed", seed, 0)
        rng = np.random.default_rng([_CORPUS_TAG, self.seed])
        self.transition_SVV = np.stack(
            [_random_transition(rng, self.vocab) for _ in range(self.num_sources)]
        )
        self.stationary_SV = np.stack([_stationary(t) for t in self.transition_SVV])
        self._transition_cdf_SVV = np.cumsum(self.transition_SVV, axis=2)
        self._stationary_cdf_SV = np.cumsum(self.stationary_SV, axis=1)
        rates = [
            sum(pi * entropy_nats(row) for pi, row in zip(pi_V, t_VV, strict=True))
            for pi_V, t_VV in zip(self.stationary_SV, self.transition_SVV, strict=True)
        ]
        self.entropy_floor: float | None = float(np.mean(rates))
        self.unigram_entropy = entropy_nats(self.stationary_SV.mean(axis=0))
        self.vocab_size_needed = self.vocab

    def sample_with_sources(
        self, rng: np.random.Generator, n: int, length: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """``n`` sequences of ``length`` tokens (int64 [n, length]) and their source ids [n]."""
        source_N = rng.integers(0, self.num_sources, size=n)
        tokens_NL = np.empty((n, length), dtype=np.int64)
        if length == 0:
            return tokens_NL, source_N
        tokens_NL[:, 0] = _draw(self._stationary_cdf_SV[source_N], rng)
        for t in range(1, length):
            tokens_NL[:, t] = _draw(self._transition_cdf_SVV[source_N, tokens_NL[:, t - 1]], rng)
        return tokens_NL, source_N

    def sample(self, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
        """``n`` sequences of ``length`` tokens, int64 [n, length]."""
        return self.sample_with_sources(rng, n, length)[0]

    def check_seq_len(self, seq_len: int) -> None:
        """Any positive sequence length works for a generated corpus."""
        _check_int("seq_len", seq_len, 1)

    def describe(self) -> str:
        return (
            f"synthetic Markov mixture: {self.num_sources} sources, vocab {self.vocab}, "
            f"seed {self.seed}, entropy floor {self.entropy_floor:.3f} nats/token, "
            f"unigram {self.unigram_entropy:.3f} nats/token"
        )


class TextCorpus:
    """Raw bytes of a file as tokens (vocab 256); samples are random windows.

    ``entropy_floor`` is None (unknown for real text); ``unigram_entropy`` is the
    entropy of the file's byte histogram.
    """

    def __init__(self, path: str | os.PathLike):
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

    def check_seq_len(self, seq_len: int) -> None:
        """Windows of ``seq_len + 1`` bytes need a file of at least ``seq_len + 2`` bytes."""
        _check_int("seq_len", seq_len, 1)
        if self.bytes_.size < seq_len + 2:
            raise DataError(
                f"data file {self.path}: {self.bytes_.size} bytes is too short for "
                f"seq_len {seq_len} (needs at least {seq_len + 2})"
            )

    def sample(self, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
        """``n`` random windows of ``length`` consecutive bytes, int64 [n, length]."""
        self.check_seq_len(length - 1)
        start_N = rng.integers(0, self.bytes_.size - length + 1, size=n)
        return self.bytes_[start_N[:, None] + np.arange(length)].astype(np.int64)

    def describe(self) -> str:
        return (
            f"bytes of {self.path}: {self.bytes_.size} bytes, vocab 256, "
            f"unigram {self.unigram_entropy:.3f} nats/token"
        )


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
        self.global_batch = _check_int("global_batch", global_batch, 1)
        self.dp_size = _check_int("dp_size", dp_size, 1)
        self.dp_rank = _check_int("dp_rank", dp_rank, 0)
        if self.dp_rank >= self.dp_size:
            raise DataError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        if self.global_batch % self.dp_size:
            raise DataError(f"global_batch {global_batch} is not divisible by dp_size {dp_size}")
        corpus.check_seq_len(seq_len)
        self.corpus = corpus
        self.seq_len = seq_len
        self.seed = _check_int("data seed", seed, 0)
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

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        return self.next()

    def state_dict(self) -> dict:
        return {"step": int(self.step), "seed": int(self.seed)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved step with the saved seed (the saved stream wins)."""
        if not isinstance(state, dict) or set(state) != {"step", "seed"}:
            raise DataError(f"data state must be a dict with keys step and seed, got {state!r}")
        self.step = _check_int("data state step", state["step"], 0)
        self.seed = _check_int("data state seed", state["seed"], 0)
