"""What ``data.*`` names, opened and checked for a run: the trainer's and the CLI's entry.

``data.path`` unset: the synthetic corpus. One path to a file: that file's bytes. Otherwise
one or more prepared datasets (``moezero prepare-data``), blended by ``data.weights`` (by
training tokens when unset), each split by documents (``data.val_fraction`` held out).
``check_data`` runs every check the ranks would, before any rank starts, and records the
datasets' tokenizer in ``cfg.tokenizer`` when the config has none yet (so checkpoints carry
it and ``export`` writes it back). It also verifies every shard's crc32 and largest token
id (``TokenDataset.verify``); the ranks check the largest ids the manifests record.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from moezero.config import Config
from moezero.data.batches import Batches, make_corpus
from moezero.data.common import MODEL_VOCAB, DataError
from moezero.data.indexed import PackedSplit, TokenDataset, is_prepared, open_splits
from moezero.data.sampler import BlendCorpus, TokenBatches, TokenBlend
from moezero.data.text import TextCorpus

DataStream = Batches | TokenBatches
"""A rank's data: ``next()``, ``val_batch(j)`` (tokens), ``next_batch()``,
``val_micro_batch(j)`` (``MicroBatch``: tokens, loss mask, documents), ``state_dict()``/``accepts``/``load_state_dict``,
``corpus`` (``describe()``, ``unigram_entropy``, ``entropy_floor``)."""


def _is_byte_text(cfg: Config) -> bool:
    paths = cfg.data.paths
    return len(paths) == 1 and isinstance(cfg.data.path, str) and not Path(paths[0]).is_dir()


def _generated(cfg: Config, *, dp_rank: int, dp_size: int) -> Batches:
    d, t = cfg.data, cfg.train
    if d.document_mask:
        raise DataError(f"data.document_mask: needs prepared datasets (their document index), "
                        f"not {'a text file' if d.path else 'the synthetic corpus'}")
    if d.path is None:
        corpus = make_corpus(None, vocab=d.synthetic_vocab, sources=d.synthetic_sources,
                             seed=d.synthetic_seed)
    else:
        if cfg.model.vocab_size < MODEL_VOCAB:
            raise DataError(f"data.path {d.path}: a text file is read as bytes, which needs "
                            f"model.vocab_size >= 256, got {cfg.model.vocab_size}")
        corpus = TextCorpus(d.path, d.val_fraction)
    corpus.check_seq_len(t.seq_len, validation=t.eval_every > 0)
    return Batches(corpus, global_batch=t.micro_batch_size * dp_size, seq_len=t.seq_len,
                   seed=t.seed, dp_rank=dp_rank, dp_size=dp_size)


def _check_dataset(cfg: Config, ds: TokenDataset, train: PackedSplit,
                   val: PackedSplit | None) -> None:
    if ds.vocab_size > cfg.model.vocab_size:
        raise DataError(f"dataset {ds.path}: its tokenizer has {ds.vocab_size} tokens, more "
                        f"than the model's vocabulary (model.vocab_size {cfg.model.vocab_size})")
    want = cfg.tokenizer.sha256
    if want and ds.tokenizer["sha256"] != want:
        raise DataError(f"dataset {ds.path} was prepared with another tokenizer than the "
                        f"model's (tokenizer.json sha256 {ds.tokenizer['sha256'][:12]}…, model's "
                        f"{want[:12]}… from {cfg.tokenizer.path}); prepare it with "
                        "--tokenizer set to the model's checkpoint")
    train.check("")
    if cfg.train.eval_every > 0:
        if val is None:
            raise DataError(f"dataset {ds.path}: train.eval_every needs held-out documents, "
                            "but data.val_fraction is 0 (or set train.eval_every=0)")
        val.check(" (raise data.val_fraction, or set train.eval_every=0)")


def _check_token_ids(ds: TokenDataset, maxima: list[int | None], vocab_size: int) -> None:
    """DataError naming the first shard holding an id the model has no embedding for."""
    for entry, top in zip(ds.manifest["shards"], maxima, strict=True):
        if top is not None and top >= vocab_size:
            raise DataError(f"{ds.path / entry['file']}: holds token id {top}, beyond the "
                            f"model's vocabulary (model.vocab_size {vocab_size})")


def verify_dataset(ds: TokenDataset, vocab_size: int,
                   note: Callable[[str], None] | None = None) -> None:
    """Every shard read through: its crc32 and largest id against the manifest, its ids against
    the model's vocabulary; ``note`` hears about a manifest without checksums."""
    if not ds.has_checksums and note is not None:
        note(f"dataset {ds.path}: no shard checksums in its manifest (an older prepare-data); "
             "token ids range-checked only")
    _check_token_ids(ds, ds.verify(), vocab_size)


def open_datasets(cfg: Config) -> list[tuple[TokenDataset, PackedSplit, PackedSplit | None]]:
    """Every prepared dataset of ``data.path`` with its splits, all checked (token ids against
    the largest the manifests record)."""
    opened = [open_splits(p, seq_len=cfg.train.seq_len, val_fraction=cfg.data.val_fraction)
              for p in cfg.data.paths]
    first = opened[0][0]
    for ds, train, val in opened:
        if ds.tokenizer["sha256"] != first.tokenizer["sha256"]:
            raise DataError(f"data.path: {ds.path} and {first.path} were prepared with "
                            "different tokenizers; a blend needs one")
        _check_dataset(cfg, ds, train, val)
        _check_token_ids(ds, ds.max_token_ids(), cfg.model.vocab_size)
    return opened


def _prepared(cfg: Config, *, dp_rank: int, dp_size: int) -> TokenBatches:
    opened = open_datasets(cfg)
    weights = cfg.data.weights or [train.num_tokens for _, train, _ in opened]
    seed = cfg.train.seed
    train = TokenBlend([t for _, t, _ in opened], weights, seed=seed, shuffle=True)
    vals = [v for _, _, v in opened]
    val = TokenBlend(vals, weights, seed=seed, shuffle=False) if all(vals) else None
    corpus = BlendCorpus([ds for ds, _, _ in opened], train.weights)
    return TokenBatches(train, val, corpus, local_batch=cfg.train.micro_batch_size,
                        dp_rank=dp_rank, dp_size=dp_size,
                        document_mask=document_mask(cfg, [ds for ds, _, _ in opened]))


CHAT_FORMATS = ("chat", "prompt-completion")


def document_mask(cfg: Config, datasets: list[TokenDataset]) -> bool:
    """``data.document_mask``, or when unset: whether any dataset holds chat or
    prompt-completion data (its manifest's ``input_format``)."""
    if cfg.data.document_mask is not None:
        return cfg.data.document_mask
    return any(ds.manifest.get("input_format") in CHAT_FORMATS for ds in datasets)


def build_batches(cfg: Config, *, dp_rank: int, dp_size: int) -> DataStream:
    """This rank's data stream for ``cfg`` (every rank calls it; no collective)."""
    if cfg.data.path is None or _is_byte_text(cfg):
        return _generated(cfg, dp_rank=dp_rank, dp_size=dp_size)
    for path in cfg.data.paths:
        if not is_prepared(path) and not Path(path).is_dir():
            raise DataError(f"data.path {path}: no such dataset directory (a list names "
                            "prepared datasets only)")
    return _prepared(cfg, dp_rank=dp_rank, dp_size=dp_size)


def check_data(cfg: Config, note: Callable[[str], None] | None = None) -> Config:
    """Every data check of the ranks, before any starts, and every prepared shard verified
    (crc32, token ids; ``note`` hears about manifests without checksums); ``cfg`` with
    ``tokenizer.*`` taken from the prepared datasets when it records none.

    Raises:
        DataError: (one line) naming the path and what is wrong.
    """
    batches = build_batches(cfg, dp_rank=0, dp_size=1)
    if not isinstance(batches, TokenBatches):
        return cfg
    for ds in batches.corpus.datasets:
        verify_dataset(ds, cfg.model.vocab_size, note)
    if cfg.tokenizer.sha256:
        return cfg
    tok = batches.corpus.datasets[0].tokenizer
    special = {"eos_token_id": tok["eod_id"], **(tok.get("special") or {})}
    data = cfg.model_dump(by_alias=True)
    data["tokenizer"] = {"path": str(Path(tok["path"]).parent), "sha256": tok["sha256"],
                         "vocab_size": tok["vocab_size"],
                         **{k: special.get(k) for k in ("bos_token_id", "eos_token_id",
                                                        "pad_token_id")}}
    return Config.model_validate(data)
