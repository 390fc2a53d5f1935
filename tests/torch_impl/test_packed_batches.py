"""Prepared chat data reaches the trainer with its loss mask and documents: each micro-batch
(``TokenBatches.next_batch``) carries the targets' mask bytes and every input's document, equal
to the training split's stream written out here from the dataset's document index;
``data.document_mask`` defaults on for chat data and off for text, and is refused for data
without documents."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from moezero.config import Config
from moezero.data.build import build_batches
from moezero.data.common import DataError
from moezero.data.indexed import TokenDataset, split_documents
from tests.torch_impl.chat_util import CHATML, chat_tokenizer
from tests.torch_impl.test_chat_data import CONVERSATIONS, prepare, write_jsonl

pytest.importorskip("jinja2")
SEQ = 24


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat")
    tok_dir = chat_tokenizer(tmp / "tok", CHATML)
    write_jsonl(tmp / "c.jsonl", [{"messages": c} for c in CONVERSATIONS * 6])
    assert prepare([tmp / "c.jsonl"], tmp / "out", tok_dir, "--format", "chat",
                   "--chunk-mb", "0.002") == 0
    (tmp / "a.txt").write_text("the cat sat.\n\nthe dog ran.\n\n" * 40)
    assert prepare([tmp / "a.txt"], tmp / "text", tok_dir) == 0
    return tmp


def cfg_for(path, **data) -> Config:
    vocab = TokenDataset(path).vocab_size
    return Config.model_validate({"data": {"path": str(path), "val_fraction": 0.2, **data},
                                  "model": {"vocab_size": max(256, vocab)},
                                  "train": {"seq_len": SEQ, "micro_batch_size": 2}})


def streams(ds: TokenDataset, doc_ids: np.ndarray):
    """The split's tokens, mask bytes and document index, concatenated document by document."""
    spans = [(int(ds.offsets[d]), int(ds.offsets[d + 1])) for d in doc_ids]
    tokens = np.concatenate([ds.read(a, b) for a, b in spans])
    mask = np.concatenate([ds.mask(a, b) for a, b in spans])
    docs = np.concatenate([np.full(b - a, d) for d, (a, b) in zip(doc_ids, spans, strict=True)])
    return tokens, mask, docs


def test_micro_batches_carry_the_mask_and_documents(chat_dir):
    ds = TokenDataset(chat_dir / "out")
    train_ids, _ = split_documents(ds.num_documents, 0.2)
    tokens, mask, docs = streams(ds, train_ids)
    batches = build_batches(cfg_for(chat_dir / "out"), dp_rank=1, dp_size=2)
    assert batches.document_mask
    for _ in range(3):
        mb = batches.next_batch()
        for row, (_, j) in enumerate(batches.last_ids):
            lo = int(j) * SEQ
            np.testing.assert_array_equal(mb.tokens[row], tokens[lo:lo + SEQ + 1])
            np.testing.assert_array_equal(mb.loss_mask[row], mask[lo + 1:lo + SEQ + 1])
            np.testing.assert_array_equal(mb.documents[row], docs[lo:lo + SEQ])
    assert 0 < mb.loss_mask.sum() < mb.loss_mask.size
    val = batches.val_micro_batch(0)
    assert val.loss_mask is not None and val.documents is not None


def test_document_mask_defaults_and_switch(chat_dir):
    off = build_batches(cfg_for(chat_dir / "out", document_mask=False), dp_rank=0, dp_size=1)
    mb = off.next_batch()
    assert mb.documents is None and mb.loss_mask is not None
    text = build_batches(cfg_for(chat_dir / "text"), dp_rank=0, dp_size=1).next_batch()
    assert text.documents is None and text.loss_mask is None
    on = build_batches(cfg_for(chat_dir / "text", document_mask=True), dp_rank=0, dp_size=1)
    assert on.next_batch().documents is not None


def test_document_mask_needs_prepared_data():
    cfg = Config.model_validate({"data": {"document_mask": True}})
    with pytest.raises(DataError, match="data.document_mask: needs prepared datasets .* "
                                        "the synthetic corpus"):
        build_batches(cfg, dp_rank=0, dp_size=1)


def _train(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moezero.cli", "train", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_training_on_chat_data_reports_trained_and_seen_tokens(chat_dir, tmp_path):
    out = tmp_path / "run"
    res = _train("--data", str(chat_dir / "out"), "--nproc", "2", "--out", str(out),
                 *[f"--set={kv}" for kv in (
                     "model.vocab_size=320", "model.dim=32", "model.n_layers=1", "model.n_heads=2", "model.ffn_dim=32",
                     "moe.num_experts=4", f"train.seq_len={SEQ}", "train.micro_batch_size=2",
                     "train.steps=2", "train.eval_every=2", "train.eval_batches=1",
                     "data.val_fraction=0.2", "checkpoint.every=0")])
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["trained_tokens_per_s"] < r["tokens_per_s"] for r in rows)
    assert np.isfinite(rows[-1]["val_loss"])
    assert "trained)" in res.stdout and "tokens/s per rank (" in res.stdout  # log, summary


def test_document_mask_on_generated_data_is_one_line_exit_2(tmp_path):
    res = _train("--set", "data.document_mask=true", "--out", str(tmp_path / "r"), timeout=120)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.document_mask: needs prepared datasets" in lines[0], \
        res.stderr
