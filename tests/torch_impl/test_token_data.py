"""Prepared datasets in training (docs/data.md): the split by documents, packing, blends, the
global-sample order at any world size and its resume, and the one-line checks of data.*."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moezero.config import load_config
from moezero.data import DataError
from moezero.data.blend import blend_positions, normalise
from moezero.data.build import build_batches, check_data
from moezero.data.indexed import TokenDataset, open_splits, split_documents
from moezero.data.prepare import PrepareOptions, prepare
from moezero.data.readers import ReadOptions
from tests.torch_impl.tokenizer_util import save_tokenizer, sentences, train_bpe

pytest.importorskip("tokenizers")

SEQ = 16


def make_dataset(root: Path, tok_dir: Path, docs: list[str], name: str,
                 chunk: int = 1 << 20) -> Path:
    src = root / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([str(src)], root / name, tok_dir,
            PrepareOptions(ReadOptions(chunk_bytes=chunk), progress=False))
    return root / name


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    tok_dir = save_tokenizer(train_bpe(sentences(400)), root / "tok")
    a = make_dataset(root, tok_dir, sentences(200, seed=2), "a", chunk=2000)  # several shards
    b = make_dataset(root, tok_dir, [s.upper() for s in sentences(60, seed=3)], "b")
    return {"a": a, "b": b, "tok": tok_dir, "root": root}


def cfg_for(*paths, **sets):
    overrides = [f"data.path={json.dumps([str(p) for p in paths])}", f"train.seq_len={SEQ}",
                 "train.micro_batch_size=2", "model.vocab_size=320", "data.val_fraction=0.1"]
    return load_config(None, overrides + [f"{k}={v}" for k, v in sets.items()])


@pytest.mark.parametrize("n,f", [(1, 0.5), (10, 0.1), (200, 0.05), (37, 0.3), (5, 0.0)])
def test_split_holds_out_ceil_n_f_documents_spread_evenly(n, f):
    train, val = split_documents(n, f)
    assert val.size == math.ceil(n * f - 1e-9) and train.size + val.size == n
    assert set(train.tolist()).isdisjoint(val.tolist())
    if f:
        assert val[0] == 0 and np.all(np.diff(val) >= math.floor(1 / f))


def test_packed_split_is_the_concatenation_of_its_documents(data):
    ds, train, val = open_splits(data["a"], seq_len=SEQ, val_fraction=0.1)
    assert len(ds.shards) > 2
    train_ids, val_ids = split_documents(ds.num_documents, 0.1)
    for split, ids in ((train, train_ids), (val, val_ids)):
        stream = np.concatenate([ds.read(int(ds.offsets[i]), int(ds.offsets[i + 1])) for i in ids])
        assert split.num_tokens == stream.size and split.num_samples == (stream.size - 1) // SEQ
        for j in range(split.num_samples):
            np.testing.assert_array_equal(split.sample(j), stream[j * SEQ:j * SEQ + SEQ + 1])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.01, 10), min_size=1, max_size=4), st.integers(0, 5000),
       st.integers(1, 300))
def test_blend_order_is_proportional_and_any_range_agrees(weights, start, length):
    w = normalise(weights)
    d_all, j_all = blend_positions(w, 0, start + length)
    d, j = blend_positions(w, start, start + length)
    np.testing.assert_array_equal(d, d_all[start:])
    np.testing.assert_array_equal(j, j_all[start:])
    counts = np.cumsum(np.eye(w.size, dtype=np.int64)[d_all], axis=0)
    bound = 0.5 + w * w.size / 2  # the low-discrepancy bound in blend.py's docstring
    assert np.all(np.abs(counts - np.arange(1, d_all.size + 1)[:, None] * w) <= bound + 1e-9)
    for k in range(w.size):  # each dataset's samples are taken in order 0, 1, 2, ...
        np.testing.assert_array_equal(j_all[d_all == k], np.arange((d_all == k).sum()))


def _stream(cfg, world: int, steps: int, state=None) -> tuple[list, list]:
    ranks = [build_batches(cfg, dp_rank=r, dp_size=world) for r in range(world)]
    if state is not None:
        for b in ranks:
            b.load_state_dict(state)
    ids, rows = [], []
    for _ in range(steps):
        for b in ranks:
            rows.append(b.next())
            ids.append(b.last_ids)
    return np.concatenate(ids), np.concatenate(rows)


def test_global_order_is_the_same_at_any_world_size_and_resumes_across_it(data):
    cfg = cfg_for(data["a"], data["b"], **{"data.weights": "[3, 1]"})
    ids1, rows1 = _stream(cfg, 1, 12)
    ids2, rows2 = _stream(cfg, 2, 6)
    ids4, rows4 = _stream(cfg, 4, 3)
    for ids, rows in ((ids2, rows2), (ids4, rows4)):
        np.testing.assert_array_equal(ids, ids1)
        np.testing.assert_array_equal(rows, rows1)
    assert set(np.unique(ids1[:, 0])) == {0, 1} and (ids1[:, 0] == 0).sum() == 18
    first = [build_batches(cfg, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(2):
        for b in first:
            b.next()
    state = json.loads(json.dumps(first[0].state_dict()))
    assert state == {"consumed_samples": 8, "seed": 0}
    ids_resumed, rows_resumed = _stream(cfg, 1, 4, state)  # W=2 -> W=1 after 8 samples
    np.testing.assert_array_equal(ids_resumed, ids1[8:16])
    np.testing.assert_array_equal(rows_resumed, rows1[8:16])


def test_every_training_sample_once_per_epoch_in_a_new_order(data):
    cfg = cfg_for(data["b"])
    batches = build_batches(cfg, dp_rank=0, dp_size=1)
    n = batches.train.splits[0].num_samples
    seen = []
    while len(seen) < 2 * n:
        batches.next()
        seen += batches.last_ids[:, 1].tolist()
    first, second = seen[:n], seen[n:2 * n]
    assert sorted(first) == list(range(n)) == sorted(second) and first != second


def test_validation_batches_are_fixed_held_out_samples(data):
    cfg = cfg_for(data["a"])
    one = build_batches(cfg, dp_rank=0, dp_size=1)
    two = [build_batches(cfg, dp_rank=r, dp_size=2) for r in range(2)]
    _, _, val = open_splits(data["a"], seq_len=SEQ, val_fraction=0.1)
    np.testing.assert_array_equal(one.val_batch(0), np.stack([val.sample(0), val.sample(1)]))
    one.next()
    np.testing.assert_array_equal(one.val_batch(1), np.stack([val.sample(2), val.sample(3)]))
    np.testing.assert_array_equal(np.concatenate([b.val_batch(0) for b in two]),
                                  np.stack([val.sample(i) for i in range(4)]))


def test_check_data_records_the_datasets_tokenizer(data):
    cfg = check_data(cfg_for(data["a"]))
    manifest = TokenDataset(data["a"]).manifest["tokenizer"]
    assert cfg.tokenizer.sha256 == manifest["sha256"] and cfg.tokenizer.vocab_size == 300
    assert Path(cfg.tokenizer.path) == data["tok"].resolve()
    assert (cfg.tokenizer.bos_token_id, cfg.tokenizer.eos_token_id) == (0, 1)


def _bad(data, case):
    if case == "shorter than one sequence":
        return cfg_for(data["b"], **{"train.seq_len": 4096}), "shorter than one sequence"
    if case == "validation shorter than one sequence":
        return (cfg_for(data["b"], **{"data.val_fraction": 0.02, "train.seq_len": 96}),
                "its validation split (2 documents) has")
    if case == "vocab larger than model":
        return cfg_for(data["a"], **{"model.vocab_size": 256}), "its tokenizer has 300 tokens"
    if case == "another tokenizer":
        cfg = cfg_for(data["a"], **{"tokenizer.sha256": "ab" * 32})
        return cfg, "was prepared with another tokenizer than the model's"
    if case == "no held-out documents":
        return cfg_for(data["a"], **{"data.val_fraction": 0}), "data.val_fraction is 0"
    if case == "not a dataset":
        return cfg_for(data["root"] / "tok"), "no manifest.json"
    if case == "byte-level with a small vocab":
        text = data["root"] / "t.txt"
        text.write_text("abc " * 300)
        return (load_config(None, [f"data.path={text}", "model.vocab_size=128"]),
                "needs model.vocab_size >= 256")
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["shorter than one sequence",
                                  "validation shorter than one sequence",
                                  "vocab larger than model", "another tokenizer",
                                  "no held-out documents", "not a dataset",
                                  "byte-level with a small vocab"])
def test_bad_data_is_one_line(data, case):
    cfg, want = _bad(data, case)
    with pytest.raises(DataError) as info:
        check_data(cfg)
    assert want in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_cli_refuses_bad_data_in_one_line_before_any_rank_starts(data, tmp_path, capsys):
    from moezero.cli import main

    capsys.readouterr()
    code = main(["train", "--data", str(data["b"]), "--set", "model.vocab_size=320",
                 "--set", "train.seq_len=4096", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("moezero: error: dataset ") and "shorter than one sequence" in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("sets,key", [
    (["data.path=[a, b]", "data.weights=[1]"], "data.weights: 1 weights for 2 data.path"),
    (["data.path=[a, b]", "data.weights=[1, 0]"], "data.weights: must all be > 0"),
    (["data.path=[]"], "data.path: an empty list"),
    (["tokenizer.vocab_size=300", "model.vocab_size=256"], "tokenizer.vocab_size: must be <="),
])
def test_bad_data_keys_are_one_line_config_errors(sets, key):
    from moezero.config import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(None, sets)
    assert str(info.value).startswith(key) and "\n" not in str(info.value), str(info.value)
