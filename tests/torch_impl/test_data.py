"""Tests for moezero.data: corpora, entropy targets, deterministic sharded batches."""

import json

import numpy as np
import pytest

from moezero.data import (
    Batches,
    DataError,
    MarkovMixture,
    TextCorpus,
    entropy_nats,
    make_corpus,
)

TEXT = b"the quick brown fox jumps over the lazy dog. " * 20


@pytest.fixture(scope="module")
def markov():
    return make_corpus(None, vocab=32, sources=4, seed=0)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(TEXT)
    return path


def _batches(corpus, dp_rank=0, dp_size=1, seed=7, global_batch=8, seq_len=16):
    return Batches(
        corpus,
        global_batch=global_batch,
        seq_len=seq_len,
        seed=seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )


def test_markov_corpus_shape_range_and_determinism(markov):
    again = make_corpus(None, vocab=32, sources=4, seed=0)
    np.testing.assert_array_equal(markov.transition_SVV, again.transition_SVV)
    other = make_corpus(None, vocab=32, sources=4, seed=1)
    assert not np.allclose(markov.transition_SVV, other.transition_SVV)
    x = markov.sample(np.random.default_rng(3), 5, 40)
    assert x.shape == (5, 40) and x.dtype == np.int64
    assert x.min() >= 0 and x.max() < 32
    np.testing.assert_array_equal(x, again.sample(np.random.default_rng(3), 5, 40))
    assert markov.vocab_size_needed == 32
    np.testing.assert_allclose(markov.transition_SVV.sum(axis=2), 1.0)
    desc = markov.describe()
    assert "\n" not in desc and "4 sources" in desc


def test_markov_floor_well_below_unigram(markov):
    assert 0.9 < markov.entropy_floor < 1.8
    assert markov.unigram_entropy > 3.0
    assert markov.unigram_entropy <= np.log(32) + 1e-9


def test_entropy_floor_matches_true_model_cross_entropy(markov):
    tokens_NL, source_N = markov.sample_with_sources(np.random.default_rng(11), 2000, 200)
    prev, nxt = tokens_NL[:, :-1], tokens_NL[:, 1:]
    p = markov.transition_SVV[source_N[:, None], prev, nxt]
    assert (p > 0).all(), "sampled a zero-probability transition"
    cross_entropy = float(-np.log(p).mean())
    assert cross_entropy == pytest.approx(markov.entropy_floor, rel=0.03)


def test_unigram_entropy_matches_samples(markov):
    tokens = markov.sample(np.random.default_rng(12), 2000, 200)
    counts = np.bincount(tokens.ravel(), minlength=32)
    assert entropy_nats(counts / counts.sum()) == pytest.approx(markov.unigram_entropy, rel=0.02)


def test_stationary_is_stationary(markov):
    for pi_V, t_VV in zip(markov.stationary_SV, markov.transition_SVV, strict=True):
        np.testing.assert_allclose(pi_V @ t_VV, pi_V, atol=1e-10)
        assert pi_V.sum() == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(vocab=1, sources=2, seed=0),
        dict(vocab=257, sources=2, seed=0),
        dict(vocab=32, sources=0, seed=0),
        dict(vocab=32, sources=2, seed=-1),
    ],
)
def test_markov_bad_settings(kwargs):
    with pytest.raises(DataError):
        MarkovMixture(**kwargs)


def test_small_vocab_works():
    corpus = MarkovMixture(vocab=2, sources=3, seed=5)
    x = corpus.sample(np.random.default_rng(0), 4, 10)
    assert set(np.unique(x)) <= {0, 1}
    assert 0 <= corpus.entropy_floor <= corpus.unigram_entropy <= np.log(2) + 1e-9


def test_text_corpus_windows_come_from_file(text_file):
    corpus = make_corpus(str(text_file), vocab=32, sources=4, seed=0)
    assert isinstance(corpus, TextCorpus)
    assert corpus.vocab_size_needed == 256 and corpus.entropy_floor is None
    counts = np.bincount(np.frombuffer(TEXT, np.uint8), minlength=256)
    assert corpus.unigram_entropy == pytest.approx(entropy_nats(counts / counts.sum()))
    batch = _batches(corpus, seq_len=30).next()
    assert batch.shape == (8, 31) and batch.dtype == np.int64
    for row in batch:
        assert bytes(row.astype(np.uint8)) in TEXT
    assert str(text_file) in corpus.describe() and "\n" not in corpus.describe()


def test_text_corpus_accepts_exact_minimum_length(tmp_path):
    path = tmp_path / "short.txt"
    path.write_bytes(b"abcdef")
    batch = _batches(TextCorpus(path), seq_len=4).next()
    assert {bytes(r.astype(np.uint8)) for r in batch} <= {b"abcde", b"bcdef"}


def _bad_path(tmp_path, kind):
    if kind == "missing":
        return tmp_path / "nope.txt"
    if kind == "directory":
        return tmp_path
    path = tmp_path / f"{kind}.txt"
    path.write_bytes(b"" if kind == "empty" else b"abcde")
    return path


@pytest.mark.parametrize("kind", ["missing", "directory", "empty", "short"])
def test_bad_text_inputs_give_one_line_error_naming_path(tmp_path, kind):
    path = _bad_path(tmp_path, kind)
    with pytest.raises(DataError) as info:
        corpus = make_corpus(str(path), vocab=32, sources=4, seed=0)
        _batches(corpus, seq_len=4)  # needs 6 bytes; "short" has 5
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert isinstance(info.value, ValueError)


def test_unreadable_file_gives_one_line_error(text_file, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(np, "fromfile", refuse)  # chmod 0 cannot stop root
    with pytest.raises(DataError, match="Permission denied") as info:
        TextCorpus(text_file)
    assert str(text_file) in str(info.value) and "\n" not in str(info.value)


def test_batches_deterministic_across_instances(markov):
    a, b = _batches(markov), _batches(markov)
    for _ in range(3):
        np.testing.assert_array_equal(a.next(), b.next())
    assert not np.array_equal(_batches(markov, seed=8).next(), _batches(markov).next())


@pytest.mark.parametrize("dp_size", [1, 2, 4])
@pytest.mark.parametrize("which", ["markov", "text"])
def test_global_batch_independent_of_dp_size(markov, text_file, dp_size, which):
    corpus = markov if which == "markov" else TextCorpus(text_file)
    reference = _batches(corpus)
    expected = [reference.next() for _ in range(3)]
    ranks = [_batches(corpus, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for step in range(3):
        slices = [rank.next() for rank in ranks]
        assert all(s.shape == (8 // dp_size, 17) for s in slices)
        np.testing.assert_array_equal(np.concatenate(slices), expected[step])
    assert all(rank.step == 3 for rank in ranks)


def test_consecutive_batches_differ(markov):
    batches = _batches(markov)
    assert not np.array_equal(batches.next(), batches.next())


def test_resume_continues_identically_even_at_new_world_size(markov):
    uninterrupted = _batches(markov)
    expected = [uninterrupted.next() for _ in range(5)]
    first = _batches(markov)
    for _ in range(2):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"step": 2, "seed": 7}
    resumed = [_batches(markov, seed=999, dp_rank=r, dp_size=2) for r in range(2)]
    for rank in resumed:
        rank.load_state_dict(state)
    for step in range(2, 5):
        np.testing.assert_array_equal(np.concatenate([r.next() for r in resumed]), expected[step])


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(global_batch=6, dp_size=4),
        dict(dp_rank=2, dp_size=2),
        dict(global_batch=0),
        dict(seq_len=0),
        dict(dp_size=0),
        dict(seed=-3),
    ],
)
def test_bad_batching_settings(markov, kwargs):
    with pytest.raises(DataError) as info:
        _batches(markov, **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "state", [{"step": 1}, {"step": -1, "seed": 0}, {"step": "1", "seed": 0}, []]
)
def test_bad_state_dict(markov, state):
    with pytest.raises(DataError):
        _batches(markov).load_state_dict(state)
