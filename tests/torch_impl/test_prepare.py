"""``moezero prepare-data`` (docs/data.md): .txt/.jsonl/.parquet -> token shards, document index
and manifest, checked against the tokenizer itself; worker processes give the same bytes; bad
input is one line, exit 2, and nothing written."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from moezero.cli import main
from moezero.data.indexed import TokenDataset
from tests.torch_impl.tokenizer_util import save_tokenizer, sentences, train_bpe

pytest.importorskip("tokenizers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

DOCS = sentences(120, seed=1)
EOD = 1  # "</s>", the tokenizer_config's eos_token


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_tokenizer(train_bpe(sentences(400)), tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


def write_inputs(root: Path) -> dict[str, list[str]]:
    """The same kind of documents in each format; returns each file's documents in order."""
    root.mkdir(parents=True, exist_ok=True)
    txt, jsonl, parquet = DOCS[:30], DOCS[30:80], DOCS[80:]
    paragraphs = [" ".join(d.split()[:4]) + "\n" + " ".join(d.split()[4:]) for d in txt]
    (root / "a.txt").write_text("\n\n".join(paragraphs) + "\n")
    (root / "b.jsonl").write_text("".join(json.dumps({"text": d, "n": i}) + "\n" +
                                          ("\n" if i % 7 == 0 else "")  # blank lines: skipped
                                          for i, d in enumerate(jsonl)))
    pq.write_table(pa.table({"text": parquet, "n": list(range(len(parquet)))}),
                   root / "c.parquet", row_group_size=11)
    return {"a.txt": paragraphs, "b.jsonl": jsonl, "c.parquet": parquet}


def expected_tokens(tok, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    ids = [tok.encode(d).ids + [EOD] for d in docs]
    return np.concatenate(ids), np.cumsum([0] + [len(i) for i in ids])


def prepare(inputs, out, tok_dir, *extra) -> int:
    return main(["prepare-data", *map(str, inputs), "--tokenizer", str(tok_dir),
                 "--out", str(out), *extra])


def test_three_formats_give_the_tokenizers_own_ids(tmp_path, tok_dir, tok, capsys):
    docs = write_inputs(tmp_path / "in")
    assert prepare([tmp_path / "in" / name for name in docs], tmp_path / "ds", tok_dir) == 0
    assert "prepared" in capsys.readouterr().out
    ds = TokenDataset(tmp_path / "ds")
    want, offsets = expected_tokens(tok, [d for name in docs for d in docs[name]])
    np.testing.assert_array_equal(ds.read(0, int(ds.shard_starts[-1])), want)
    np.testing.assert_array_equal(np.asarray(ds.offsets), offsets)
    m = ds.manifest
    assert (m["num_documents"], m["num_tokens"], m["dtype"]) == (len(DOCS), want.size, "uint16")
    digest = hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert m["tokenizer"]["sha256"] == digest and m["tokenizer"]["vocab_size"] == 300
    assert m["tokenizer"]["eod_id"] == EOD and m["tokenizer"]["special"]["bos_token_id"] == 0
    np.testing.assert_array_equal(ds.unigram_counts(), np.bincount(want, minlength=300))
    assert not (tmp_path / "ds.partial").exists()
    assert sorted(p.name for p in (tmp_path / "ds").iterdir() if p.name.startswith(".")) == []


def test_nested_jsonl_field(tmp_path, tok_dir, tok):
    path = tmp_path / "n.jsonl"
    path.write_text("".join(json.dumps({"meta": {"body": d}}) + "\n" for d in DOCS[:5]))
    assert prepare([path], tmp_path / "ds", tok_dir, "--text-field", "meta.body") == 0
    ds = TokenDataset(tmp_path / "ds")
    np.testing.assert_array_equal(ds.read(0, int(ds.shard_starts[-1])),
                                  expected_tokens(tok, DOCS[:5])[0])


def test_worker_processes_write_the_same_dataset(tmp_path, tok_dir):
    docs = write_inputs(tmp_path / "in")
    jsonl = tmp_path / "in" / "b.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs["b.jsonl"]))
    inputs = [jsonl, tmp_path / "in" / "a.txt"]
    assert prepare(inputs, tmp_path / "one", tok_dir, "--workers", "1") == 0
    assert prepare(inputs, tmp_path / "two", tok_dir, "--workers", "2", "--chunk-mb",
                   "0.0005") == 0
    one, two = TokenDataset(tmp_path / "one"), TokenDataset(tmp_path / "two")
    assert len(two.shards) > 4 and len(one.shards) == 2
    np.testing.assert_array_equal(one.read(0, int(one.shard_starts[-1])),
                                  two.read(0, int(two.shard_starts[-1])))
    np.testing.assert_array_equal(np.asarray(one.offsets), np.asarray(two.offsets))


@pytest.mark.parametrize("split,count", [("line", 60), ("paragraph", 30), ("file", 1)])
def test_txt_split(tmp_path, tok_dir, tok, split, count):
    docs = write_inputs(tmp_path / "in")
    assert prepare([tmp_path / "in" / "a.txt"], tmp_path / "ds", tok_dir, "--txt-split",
                   split) == 0
    ds = TokenDataset(tmp_path / "ds")
    assert ds.num_documents == count
    if split == "paragraph":
        np.testing.assert_array_equal(ds.read(0, int(ds.shard_starts[-1])),
                                      expected_tokens(tok, docs["a.txt"])[0])


def _bad_inputs(root: Path, case: str, tok_dir: Path) -> tuple[list[Path], list[str], str]:
    """(inputs, extra flags, the expected message part) of one bad-input case."""
    good = root / "good.jsonl"
    good.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:20]))
    if case == "missing field":
        bad = root / "bad.jsonl"
        bad.write_text(good.read_text() + json.dumps({"txt": "no text here"}) + "\n")
        return [good, bad], [], "bad.jsonl:21: no field 'text'"
    if case == "missing field in a worker":
        bad = root / "bad.jsonl"
        bad.write_text(good.read_text() * 3 + json.dumps({"txt": "x"}) + "\n")
        return [good, bad], ["--workers", "2", "--chunk-mb", "0.001"], "bad.jsonl:61: no field"
    if case == "empty file":
        (root / "empty.txt").write_bytes(b"")
        return [good, root / "empty.txt"], [], "empty.txt: empty input"
    if case == "no documents":
        (root / "blank.jsonl").write_text("\n\n  \n")
        return [good, root / "blank.jsonl"], [], "blank.jsonl: empty input (no documents)"
    if case == "not utf-8":
        (root / "latin.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
        return [root / "latin.txt"], [], "latin.txt: not UTF-8 text (byte 0xe9 at offset 3, line 1)"
    if case == "invalid json":
        (root / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
        return [root / "broken.jsonl"], [], "broken.jsonl:2: not valid JSON"
    if case == "lone surrogate":  # a traceback from the tokenizer before (issue 38, item 11)
        (root / "s.jsonl").write_text('{"text": "a"}\n{"text": "ok \\udc00"}\n')
        return [root / "s.jsonl"], [], ("s.jsonl:2: field 'text' holds a lone surrogate "
                                        "(U+DC00 at character 3)")
    if case == "nested too deeply":
        (root / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
        return [root / "deep.jsonl"], [], "deep.jsonl:1: not valid JSON (nested too deeply)"
    if case == "parquet column":
        pq.write_table(pa.table({"content": ["a b c"]}), root / "c.parquet")
        return [root / "c.parquet"], [], "c.parquet: no column 'text' (columns: content)"
    if case == "unknown suffix":
        (root / "x.csv").write_text("text\nabc\n")
        return [root / "x.csv"], [], "x.csv: unknown input type '.csv'"
    if case == "tokenizer larger than model":
        (tok_dir / "config.json").write_text(json.dumps({"vocab_size": 256}))
        return [good], [], "vocabulary of 300 tokens is larger than the model's vocabulary (256)"
    raise AssertionError(case)


CASES = ["missing field", "missing field in a worker", "empty file", "no documents",
         "not utf-8", "invalid json", "lone surrogate", "nested too deeply", "parquet column", "unknown suffix",
         "tokenizer larger than model"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, tok_dir, case, capsys):
    if case == "tokenizer larger than model":  # a model folder whose config.json says 256
        tok_dir = save_tokenizer(train_bpe(sentences(400)), tmp_path / "model")
    inputs, extra, want = _bad_inputs(tmp_path, case, tok_dir)
    capsys.readouterr()
    code = prepare(inputs, tmp_path / "ds", tok_dir, *extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("moezero: error: ") and want in err[0], err[0]
    assert not (tmp_path / "ds").exists() and not (tmp_path / "ds.partial").exists()


def test_out_must_be_new_or_empty_and_tokenizer_must_exist(tmp_path, tok_dir, capsys):
    good = tmp_path / "good.txt"
    good.write_text("one paragraph\n")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "keep.txt").write_text("mine")
    assert prepare([good], tmp_path / "ds", tok_dir) == 2
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert (tmp_path / "ds" / "keep.txt").read_text() == "mine"
    assert prepare([good], tmp_path / "new", tmp_path) == 2
    assert "no tokenizer.json there" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    (tmp_path / "ds" / "keep.txt").unlink()
    assert prepare([good], tmp_path / "ds", tok_dir / "tokenizer.json") == 0  # empty dir: used
    assert TokenDataset(tmp_path / "ds").num_documents == 1


def test_out_a_symlink_to_an_empty_directory_is_written_into(tmp_path, tok_dir):
    """``--out`` a symlink to an empty directory: the dataset is written into the directory
    (it failed at the final rename, "Not a directory", after all the work; issue 38, item 10)."""
    good = tmp_path / "good.txt"
    good.write_text("one paragraph\n\nanother one\n")
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    assert prepare([good], tmp_path / "link", tok_dir, "--workers", "1") == 0
    assert (tmp_path / "link").is_symlink()
    assert TokenDataset(tmp_path / "target").num_documents == 2
    assert sorted(p.name for p in (tmp_path / "target").glob("*.partial*")) == []


def test_out_an_empty_mount_point_is_written_into(tmp_path, tok_dir, monkeypatch):
    """An empty mount point cannot be removed or renamed over (``EBUSY``): the dataset is
    written into it (it failed at the final rename, "Device or resource busy")."""
    import errno
    import os

    good = tmp_path / "good.txt"
    good.write_text("one paragraph\n")
    mount = tmp_path / "mnt"
    mount.mkdir()

    def busy(real):
        def call(src, *rest, **kw):
            if any(Path(p) == mount for p in (src, *rest[:1])):
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(mount))
            return real(src, *rest, **kw)
        return call

    for name in ("rmdir", "rename", "replace"):
        monkeypatch.setattr(os, name, busy(getattr(os, name)))
    assert prepare([good], mount, tok_dir, "--workers", "1") == 0
    assert TokenDataset(mount).num_documents == 1


def test_a_second_prepare_data_on_one_out_is_refused_and_the_first_completes(
        tmp_path, tok_dir, monkeypatch, capsys):
    """Two ``prepare-data`` on one ``--out``: the second is refused in one line at its start
    (it removed the first's work folder before, and one of them ended on a bare "No such
    file or directory"); the first's dataset is valid."""
    import threading

    from moezero.data import prepare as prep

    good = tmp_path / "good.txt"
    good.write_text("one paragraph\n\nanother one\n")
    real, started, release = prep._results, threading.Event(), threading.Event()

    def first_waits(*args):
        if not started.is_set():
            started.set()
            assert release.wait(60)
        return real(*args)

    monkeypatch.setattr(prep, "_results", first_waits)
    codes = {}
    first = threading.Thread(target=lambda: codes.setdefault(
        "first", prepare([good], tmp_path / "ds", tok_dir, "--workers", "1")))
    first.start()
    assert started.wait(60)
    capsys.readouterr()
    codes["second"] = prepare([good], tmp_path / "ds", tok_dir, "--workers", "1")
    err = capsys.readouterr().err.strip().splitlines()
    release.set()
    first.join(60)
    assert codes == {"first": 0, "second": 2}, (codes, err)
    assert len(err) == 1 and "another prepare-data" in err[0], err
    assert TokenDataset(tmp_path / "ds").num_documents == 2
