"""Training data: the synthetic and byte-level corpora, prepared token datasets (shards +
document index + manifest, ``moezero prepare-data``), blends, the validation split and the
resumable samplers.

Modules: ``synthetic`` (seeded Markov mixture), ``text`` (a file read as bytes), ``batches``
(step-seeded random batches of those two), ``tokenizer`` (Hugging Face ``tokenizers`` files),
``readers`` and ``prepare`` (``prepare-data``), ``indexed`` (a prepared dataset: memmapped
shards, split by documents, packed samples), ``blend`` and ``sampler`` (global-sample
positions over a weighted blend, resumable at any world size), ``build`` (the trainer's entry:
what ``data.*`` names). Plain numpy: no torch, no distributed calls.
"""

from __future__ import annotations

from moezero.data.batches import Batches, Corpus, make_corpus
from moezero.data.common import MODEL_VOCAB, DataError, entropy_nats
from moezero.data.synthetic import MarkovMixture
from moezero.data.text import TextCorpus

__all__ = ["MODEL_VOCAB", "Batches", "Corpus", "DataError", "MarkovMixture", "TextCorpus",
           "entropy_nats", "make_corpus"]
