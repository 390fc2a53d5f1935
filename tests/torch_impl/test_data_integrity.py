"""Prepared datasets are checked before the first step (docs/data.md, "Integrity"): every shard's
crc32 and largest token id recorded by prepare-data, verified in chunks when training opens the
dataset; token ids beyond the model's vocabulary and a manifest whose counts disagree with its
files are one line naming the file, exit 2."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from moezero.config import load_config
from moezero.data import DataError
from moezero.data.build import build_batches, check_data
from moezero.data.indexed import TokenDataset
from moezero.data.prepare import PrepareOptions, prepare
from moezero.data.readers import ReadOptions
from tests.torch_impl.tokenizer_util import save_tokenizer, sentences, train_bpe

pytest.importorskip("tokenizers")

VOCAB = 300  # the test tokenizer's


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("integrity")
    tok_dir = save_tokenizer(train_bpe(sentences(400)), root / "tok")
    src = root / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in sentences(200, seed=2)))
    prepare([str(src)], root / "ds", tok_dir,
            PrepareOptions(ReadOptions(chunk_bytes=2000), progress=False))
    return root / "ds"


@pytest.fixture
def ds(clean, tmp_path) -> Path:
    """A fresh copy of the clean dataset, for one test to damage."""
    return Path(shutil.copytree(clean, tmp_path / "ds"))


def cfg_for(path: Path, vocab: int = 320):
    return load_config(None, [f"data.path={path}", "train.seq_len=16",
                              "train.micro_batch_size=2", f"model.vocab_size={vocab}",
                              "data.val_fraction=0.1"])


def edit_manifest(path: Path, change) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    change(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def put_token(path: Path, shard: int, position: int, token: int) -> Path:
    """Overwrite one token id of a shard in place; returns the shard's path."""
    file = path / f"shard-{shard:05d}.bin"
    ids = np.fromfile(file, dtype="<u2")
    ids[position] = token
    ids.tofile(file)
    return file


def test_prepare_records_each_shards_crc32_and_largest_id(clean):
    manifest = json.loads((clean / "manifest.json").read_text())
    assert len(manifest["shards"]) > 2
    for entry in manifest["shards"]:
        data = (clean / entry["file"]).read_bytes()
        assert entry["crc32"] == zlib.crc32(data)
        assert entry["max_token_id"] == int(np.frombuffer(data, "<u2").max())
    assert manifest["max_token_id"] == max(e["max_token_id"] for e in manifest["shards"])


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_changed_token_in_any_chunk_is_refused_naming_the_shard(ds, where):
    size = len(np.fromfile(ds / "shard-00001.bin", dtype="<u2"))
    position = {"first": 0, "middle": size // 2, "last": size - 1}[where]
    old = int(np.fromfile(ds / "shard-00001.bin", dtype="<u2")[position])
    file = put_token(ds, 1, position, 3 if old != 3 else 4)  # still inside the vocabulary
    with pytest.raises(DataError) as info:
        TokenDataset(ds).verify(chunk_bytes=64)  # the shard spans many chunks
    assert str(file) in str(info.value) and "crc32" in str(info.value), str(info.value)
    with pytest.raises(DataError, match="shard-00001.bin: crc32"):
        check_data(cfg_for(ds))


def test_a_clean_dataset_verifies_in_small_chunks(clean):
    maxima = TokenDataset(clean).verify(chunk_bytes=6)
    manifest = json.loads((clean / "manifest.json").read_text())
    assert maxima == [e["max_token_id"] for e in manifest["shards"]]


def _recorded(ds: Path, shard: int, token: int):
    """Put ``token`` in ``shard`` and record it in the manifest as prepare-data would have."""
    file = put_token(ds, shard, 5, token)

    def change(m):
        entry = m["shards"][shard]
        entry["crc32"] = zlib.crc32(file.read_bytes())
        entry["max_token_id"] = max(entry.get("max_token_id", 0), token)
        m["max_token_id"] = max(m.get("max_token_id", 0), token)
    edit_manifest(ds, change)


def test_token_ids_beyond_the_models_vocabulary_are_refused_naming_the_shard(ds):
    _recorded(ds, 2, VOCAB)  # ids reach 300; the model has 300 embeddings
    for build in (lambda c: check_data(c), lambda c: build_batches(c, dp_rank=0, dp_size=1)):
        with pytest.raises(DataError) as info:
            build(cfg_for(ds, vocab=VOCAB))
        msg = str(info.value)
        assert "shard-00002.bin" in msg and "token id 300" in msg and "\n" not in msg, msg
        assert "model.vocab_size 300" in msg, msg
    check_data(cfg_for(ds, vocab=VOCAB + 1))  # fits a larger vocabulary


def test_the_cli_refuses_out_of_range_ids_before_the_first_step(ds, tmp_path, capsys):
    from moezero.cli import main

    _recorded(ds, 0, VOCAB + 5)
    capsys.readouterr()
    code = main(["train", "--data", str(ds), "--set", f"model.vocab_size={VOCAB}",
                 "--set", "train.seq_len=16", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("moezero: error: ") and "shard-00000.bin" in err[0], err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_largest_id_that_differs_from_the_shard_is_refused(ds):
    edit_manifest(ds, lambda m: m["shards"][1].update(max_token_id=7))
    with pytest.raises(DataError, match=r"shard-00001.bin: largest token id \d+, manifest says 7"):
        check_data(cfg_for(ds))


@pytest.mark.parametrize("delta", [1, -1])
def test_a_wrong_num_tokens_in_the_manifest_is_refused(ds, delta):
    edit_manifest(ds, lambda m: m.update(num_tokens=m["num_tokens"] + delta))
    with pytest.raises(DataError) as info:
        TokenDataset(ds)
    assert str(ds / "manifest.json") in str(info.value) and "num_tokens" in str(info.value)


def _strip_checksums(m):
    m.pop("max_token_id")
    for entry in m["shards"]:
        entry.pop("crc32"), entry.pop("max_token_id")


def test_an_older_manifest_is_range_checked_and_noted_in_one_line(ds):
    edit_manifest(ds, _strip_checksums)
    notes = []
    check_data(cfg_for(ds), note=notes.append)
    assert len(notes) == 1 and str(ds) in notes[0] and "no shard checksums" in notes[0], notes
    put_token(ds, 1, 5, VOCAB)
    with pytest.raises(DataError, match="shard-00001.bin: holds token id 300"):
        check_data(cfg_for(ds, vocab=VOCAB), note=notes.append)
