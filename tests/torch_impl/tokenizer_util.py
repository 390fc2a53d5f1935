"""Tiny tokenizers and corpora built inside tests (nothing is downloaded).

``train_bpe`` trains a byte-level BPE with the ``tokenizers`` library on a generated corpus;
``save_tokenizer`` writes it as a Hugging Face tokenizer folder (``tokenizer.json`` +
``tokenizer_config.json`` naming the special tokens), the files a model folder holds.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2
WORDS = ("the cat dog fox bird sat ran saw ate on under over near a big small red blue "
         "quick lazy happy mat tree house river stone and then").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` sentences of a small grammar: learnable structure, repeated vocabulary."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(("the", "a")), rng.choice(WORDS[1:5]), rng.choice(WORDS[5:9])]
        words += [rng.choice(WORDS[9:13]), "the", rng.choice(WORDS[21:26])]
        if rng.random() < 0.5:
            words += ["and", "then", rng.choice(WORDS[5:9])]
        out.append(" ".join(words) + ".")
    return out


def train_bpe(texts: list[str], vocab_size: int = 300):
    """A byte-level BPE with ``SPECIALS`` first (``moezero.examples.tiny_hf.train_bpe``)."""
    from moezero.examples.tiny_hf import train_bpe as train

    return train(texts, vocab_size, SPECIALS)


def save_tokenizer(tok, folder: Path) -> Path:
    """``tokenizer.json`` + ``tokenizer_config.json`` in ``folder`` (created)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[0],
              "eos_token": SPECIALS[1], "pad_token": SPECIALS[2], "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
