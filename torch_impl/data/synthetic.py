"""The built-in synthetic corpus: a uniform mixture of seeded first-order Markov sources,
whose entropy floor is known (so the loss has a target).

Shape legend: S = sources, V = vocab symbols, N = rows (sequences), L = tokens per row.
"""

from __future__ import annotations

import numpy as np

from moezero.data.common import MODEL_VOCAB, DataError, check_int, entropy_nats

_SUCCESSORS = 5  # non-zero entries per transition row (fewer if vocab is smaller)
_ROW_CONCENTRATION = 1.0  # Dirichlet concentration over a row's successors
_CORPUS_TAG = 0x4D41524B  # keeps corpus-building and batch RNG streams apart


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
        self.vocab = check_int("data vocab", vocab, 2)
        if self.vocab > MODEL_VOCAB:
            raise DataError(f"data vocab must be <= {MODEL_VOCAB}, got {vocab}")
        self.num_sources = check_int("data sources", sources, 1)
        self.seed = check_int("data seed", seed, 0)
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

    def sample_val(self, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
        """Validation sequences: fresh draws (the generator, not the data, holds them out)."""
        return self.sample(rng, n, length)

    def check_seq_len(self, seq_len: int, *, validation: bool = False) -> None:
        """Any positive sequence length works for a generated corpus."""
        check_int("seq_len", seq_len, 1)

    def describe(self) -> str:
        return (
            f"synthetic Markov mixture: {self.num_sources} sources, vocab {self.vocab}, "
            f"seed {self.seed}, entropy floor {self.entropy_floor:.3f} nats/token, "
            f"unigram {self.unigram_entropy:.3f} nats/token"
        )
