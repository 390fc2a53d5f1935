"""The ``data`` series: ``moezero prepare-data`` against the tokenizer's own batch encoding.

A jsonl corpus of at least ``size["data_mb"]`` MB is generated (Zipf-distributed pseudo-words
in sentences and paragraphs of varied length; deterministic), a byte-level BPE is trained on a
slice of it with ``tokenizers``, and in the same run:

- the floor: ``encode_batch_fast`` (or ``encode_batch``) of the tokenizer itself over every
  document, already in memory (batches of ``BATCH_DOCS``; the Rust side uses every core);
- for reference, the same on one thread (``RAYON_NUM_THREADS=1``, a fresh process) times the
  cores: what perfectly scaling tokenization would reach;
- ``moezero prepare-data corpus.jsonl --tokenizer ... --out ...`` as a user runs it (a fresh
  process: reading and parsing the jsonl, worker processes, shards, index and manifest).

Throughput is input text bytes per second of wall time; the target is prepare-data at
>= 80% of the floor. The corpus, tokenizer and dataset are removed afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

BATCH_DOCS = 2000
VOCAB = 8192
_LETTERS = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", dtype=np.uint8)


def _words(rng: np.random.Generator, count: int) -> list[str]:
    """``count`` pseudo-words, 1-10 letters, common letters more often."""
    lengths = rng.integers(1, 11, size=count)
    letters = _LETTERS[np.minimum(rng.geometric(0.18, size=int(lengths.sum())) - 1, 25)]
    text = letters.tobytes().decode()
    cuts = np.cumsum(lengths)
    return [text[a:b] for a, b in zip(np.r_[0, cuts[:-1]], cuts, strict=True)]


def generate_corpus(path: Path, megabytes: float, seed: int = 0) -> dict:
    """A jsonl file of at least ``megabytes`` MB, one ``{"text": ...}`` document per line."""
    rng = np.random.default_rng(seed)
    vocab = np.array(_words(rng, 50_000), dtype=object)
    target, written, docs = int(megabytes * 1e6), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            lines = []
            for _ in range(1000):
                n = int(rng.integers(50, 1500))
                ids = np.minimum(rng.zipf(1.15, size=n) - 1, vocab.size - 1)
                words = vocab[ids]
                stops = rng.random(n) < 0.08
                words[stops] = [w + "." for w in words[stops]]
                lines.append(json.dumps({"text": " ".join(words)}) + "\n")
            chunk = "".join(lines)
            f.write(chunk)
            written += len(chunk.encode())
            docs += len(lines)
    return {"bytes": path.stat().st_size, "documents": docs}


def _texts(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def train_tokenizer(texts: list[str], folder: Path) -> Path:
    """A byte-level BPE of ``VOCAB`` tokens trained on ``texts``, saved with an eos token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder


def floor_encode(texts: list[str], tokenizer_json: Path) -> dict:
    """The tokenizer's own batch encoding of every document (text already in memory)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    encode = getattr(tok, "encode_batch_fast", None) or tok.encode_batch
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(texts), BATCH_DOCS):
        tokens += sum(len(e.ids) for e in encode(texts[i:i + BATCH_DOCS]))
    return {"seconds": time.perf_counter() - start, "tokens": tokens,
            "method": encode.__name__}


def single_thread_encode(corpus: Path, tokenizer_json: Path) -> dict:
    """``floor_encode`` in a fresh process whose Rust thread pool has one thread."""
    cmd = [sys.executable, "-m", "benchmarks.data_prep", str(corpus), str(tokenizer_json)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env={**os.environ, "RAYON_NUM_THREADS": "1"},
                          cwd=Path(__file__).resolve().parent.parent)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_prepare(corpus: Path, tokenizer: Path, out: Path) -> dict:
    """``moezero prepare-data`` in a fresh process, timed from start to exit."""
    cmd = [sys.executable, "-m", "moezero.cli", "prepare-data", str(corpus), "--tokenizer",
           str(tokenizer), "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    manifest = json.loads((out / "manifest.json").read_text())
    return {"seconds": seconds, "tokens": manifest["num_tokens"],
            "documents": manifest["num_documents"], "shards": len(manifest["shards"]),
            "line": proc.stdout.strip().splitlines()[-1]}


def data_prep(work: Path, megabytes: float) -> dict:
    """The whole series; files under ``work/data`` are removed at the end."""
    folder = work / "data"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        corpus = folder / "corpus.jsonl"
        result = {"corpus": generate_corpus(corpus, megabytes), "workers": os.cpu_count()}
        texts = _texts(corpus)
        tokenizer = train_tokenizer(texts[:2000], folder / "tok")
        result["floor"] = floor_encode(texts, tokenizer / "tokenizer.json")
        del texts
        result["one_thread"] = single_thread_encode(corpus, tokenizer / "tokenizer.json")
        result["prepare"] = run_prepare(corpus, tokenizer, folder / "dataset")
        return result
    except Exception as exc:  # reported in BENCHMARKS.md, the other series still render
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":  # single_thread_encode's child: python -m benchmarks.data_prep C T
    print(json.dumps(floor_encode(_texts(Path(sys.argv[1])), Path(sys.argv[2]))))
