"""End to end with a real tokenizer and no download (issue 17): a byte-level BPE trained here,
saved in a tiny random Mixtral folder -> ``import-hf`` -> ``prepare-data --tokenizer CHECKPOINT``
on .txt, .jsonl and .parquet -> ``moezero train`` at W=2, ep=2 with validation -> ``export
--format hf-mixtral`` -> ``transformers`` loads the model and the tokenizer, and its logits on
a tokenized sentence equal moezero's. Also: a dataset prepared with another tokenizer than the
checkpoint's is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moezero.cli import main
from tests.torch_impl.test_cli import moezero
from tests.torch_impl.test_hf import moezero_model
from tests.torch_impl.tokenizer_util import save_tokenizer, sentences, train_bpe

transformers = pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
transformers.utils.logging.disable_progress_bar()

TOL = 1e-5  # fp32, as the issue asks
MODEL = dict(vocab_size=304, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
             num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=0,
             eos_token_id=1, pad_token_id=2)
SENTENCE = "the quick fox sat under the red tree and then ran."


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    """A Mixtral folder with a tokenizer trained on the corpus, imported as a checkpoint."""
    root = tmp_path_factory.mktemp("e2e")
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**MODEL)).save_pretrained(
        root / "hf")
    save_tokenizer(train_bpe(sentences(2000)), root / "hf")
    assert main(["import-hf", str(root / "hf"), "--out", str(root / "ckpt")]) == 0
    return root


def write_corpus(root: Path) -> list[Path]:
    text = sentences(1500, seed=5)
    (root / "a.txt").write_text("\n\n".join(text[:500]) + "\n")
    (root / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in text[500:1000]))
    pq.write_table(pa.table({"text": text[1000:]}), root / "c.parquet", row_group_size=100)
    return [root / "a.txt", root / "b.jsonl", root / "c.parquet"]


def test_import_train_export_with_a_tokenizer(imported, tmp_path, capsys):
    ckpt = imported / "ckpt"
    recorded = json.loads(next(ckpt.glob("step_*/manifest.json")).read_text())["config"]
    assert recorded["tokenizer"]["vocab_size"] == 300 and recorded["tokenizer"]["eos_token_id"] == 1
    assert (ckpt / "tokenizer" / "tokenizer.json").is_file()
    a, b, c = write_corpus(tmp_path)
    assert main(["prepare-data", str(a), str(b), "--tokenizer", str(ckpt),
                 "--out", str(tmp_path / "ds1")]) == 0
    assert main(["prepare-data", str(c), "--tokenizer", str(ckpt), "--out",
                 str(tmp_path / "ds2")]) == 0
    capsys.readouterr()
    res = moezero("train", "--nproc", "2", "--set", f"checkpoint.load={ckpt}",
                  "--set", f"data.path=[{tmp_path / 'ds1'}, {tmp_path / 'ds2'}]",
                  "--set", "data.weights=[2, 1]", "--set", "data.val_fraction=0.05",
                  "--set", "moe.ep_size=2", "--set", "train.steps=16", "--set", "train.seq_len=32",
                  "--set", "train.micro_batch_size=4", "--set", "train.eval_every=5",
                  "--set", "train.eval_batches=2", "--set", "optimizer.lr=1e-2",
                  "--set", "optimizer.warmup_steps=2", "--out", str(tmp_path / "run"), timeout=300)
    assert res.returncode == 0, res.stderr
    assert "blend of 2 prepared datasets" in res.stdout and "| val_loss " in res.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    print(f"validation loss by step: {evals}")
    assert [s for s, _ in evals] == [5, 10, 15, 16]
    assert evals[-1][1] < evals[0][1] - 0.3, evals  # the validation loss falls
    tokens = 2 * 4 * 32 * 2  # W x micro-batch x seq_len x top-k assignments per layer and step
    assert all(sum(layer["tokens_per_expert"]) == tokens for r in rows for layer in r["moe"])
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    _export_and_compare(tmp_path, ckpt)


def _export_and_compare(tmp_path: Path, ckpt: Path) -> None:
    out = tmp_path / "export"
    assert main(["checkpoint", "export", str(tmp_path / "run" / "checkpoints"), "--format",
                 "hf-mixtral", "--out", str(out)]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer(SENTENCE, return_tensors="pt").input_ids
    from tokenizers import Tokenizer

    assert ids[0].tolist() == Tokenizer.from_file(str(ckpt / "tokenizer" / "tokenizer.json")
                                                  ).encode(SENTENCE).ids
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id) == (1, 0)
    model = transformers.MixtralForCausalLM.from_pretrained(out).eval()
    assert (model.config.eos_token_id, model.config.bos_token_id) == (1, 0)
    ours = moezero_model(tmp_path / "run" / "checkpoints")
    with torch.no_grad():
        theirs, mine = model(ids).logits, ours(ids)[0]
    print(f"export: logits max abs diff {(theirs - mine).abs().max().item():.3e}")
    torch.testing.assert_close(mine, theirs, rtol=TOL, atol=TOL)


def test_a_dataset_of_another_tokenizer_is_refused(imported, tmp_path, capsys):
    other = save_tokenizer(train_bpe([s.upper() for s in sentences(500)]), tmp_path / "other")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                              for t in sentences(200)))
    assert main(["prepare-data", str(tmp_path / "a.jsonl"), "--tokenizer", str(other),
                 "--out", str(tmp_path / "ds")]) == 0
    capsys.readouterr()
    code = main(["train", "--set", f"checkpoint.load={imported / 'ckpt'}", "--data",
                 str(tmp_path / "ds"), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "was prepared with another tokenizer than the model's" in err[0]
    assert not (tmp_path / "run").exists()
    assert np.load(tmp_path / "ds" / "documents.npy").size == 201
