"""``moezero prepare-data``: documents -> token shards, a document index and a manifest.

Worker processes (spawned; one tokenizer thread each) each take a
:class:`~moezero.data.readers.WorkItem` (whole documents of one input), tokenize its documents
in batches with the tokenizer's own ``encode_batch_fast`` (or ``encode_batch``), append the end-of-document id to each and write one shard of raw
little-endian token ids (uint16 when every id fits, else uint32). The parent shows a progress
bar over input bytes, then writes ``documents.npy`` (int64 offsets of every document in the
concatenated token stream, ``num_documents + 1`` entries), ``unigram.npy`` (token counts) and
``manifest.json`` (``indexed.FORMAT``; tokenizer hash and vocabulary size, document and token
counts, shards). Everything is written under ``OUT/.partial`` and moved into ``OUT`` at the
end, the manifest last (:mod:`moezero.data.outdir`: ``OUT`` may be an empty directory, a
symlink to one or an empty mount point; one run at a time holds it): a failure leaves nothing
behind.

``--format chat`` / ``prompt-completion`` read ``.jsonl`` records instead
(:mod:`moezero.data.chat`): each worker also writes ``mask-NNNNN.bin`` (one uint8 per token,
1 = trained) beside its shard, and the manifest gains ``input_format``, ``chat_template`` and
``loss_mask`` (docs/data.md).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from moezero.data import chat, chat_template, readers, tokenizer
from moezero.data.common import DataError
from moezero.data.indexed import (
    DOCUMENTS,
    FORMAT,
    MANIFEST,
    UNIGRAM,
    mask_name,
    shard_name,
    token_dtype,
)
from moezero.data.outdir import OutFolder

_BATCH_CHARS = 4 << 20  # text per encode call: bounds a worker's memory for the encodings


@dataclass(frozen=True)
class PrepareOptions:
    """What ``prepare-data`` was asked for (besides the inputs and output)."""

    read: readers.ReadOptions
    eod_token: str | None = None
    workers: int = 1
    progress: bool = True
    format: str = "text"  # text | chat | prompt-completion
    train_on: chat.TrainOn = "assistant"
    chat_template: Path | None = None  # --chat-template FILE


@dataclass(frozen=True)
class _Job:
    """Everything a worker needs, picklable: the tokenizer file, ids and options."""

    tokenizer_json: str
    eod_id: int
    dtype: str
    vocab_size: int
    read: readers.ReadOptions
    out: str
    chat: chat.ChatOptions | None = None  # None: plain text documents


@dataclass(frozen=True)
class ShardResult:
    index: int
    path: str
    documents: np.ndarray  # int64 token count of each document
    counts: np.ndarray  # int64 [vocab] token histogram
    crc32: int  # of the shard file's bytes
    max_token_id: int  # -1 for an empty shard
    mask_crc32: int | None = None  # of the loss-mask file (chat and prompt-completion)
    trained: int = 0  # tokens the mask trains on


_WORKER: dict = {}


def _init_worker(job: _Job) -> None:
    _WORKER["job"], _WORKER["tokenizer"] = job, tokenizer.load_tokenizer(Path(job.tokenizer_json))


def _init_pool_worker(job: _Job) -> None:
    """A pool worker tokenizes on one thread: the pool gives the parallelism, and one thread
    per process scaled better than the tokenizer's thread pool here (BENCHMARKS.md). The
    variable is read by the Rust side when it first encodes, in this fresh process only."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    _init_worker(job)


def _encoder(tok):
    return getattr(tok, "encode_batch_fast", None) or tok.encode_batch


def tokenize_documents(tok, texts: list[str], eod_id: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``texts`` (with the tokenizer's own special tokens), each followed by
    ``eod_id`` unless it already ends with it; and each document's length."""
    ids = [e.ids for e in _encoder(tok)(texts, add_special_tokens=True)]  # fresh lists
    for doc in ids:
        if doc[-1:] != [eod_id]:
            doc.append(eod_id)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum()))
    return flat, lengths


def _batches(docs, limit: int = _BATCH_CHARS):
    batch, chars = [], 0
    for text in docs:
        batch.append(text)
        chars += len(text)
        if chars >= limit:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _run_item(item: readers.WorkItem) -> ShardResult:
    """One piece: read, tokenize in batches, write its shard (in a worker or in-process)."""
    job, tok = _WORKER["job"], _WORKER["tokenizer"]
    if job.chat is not None:
        return _run_records(item, job, tok)
    dtype = np.dtype(job.dtype)
    path = Path(job.out) / shard_name(item.index)
    lengths, counts = [], np.zeros(job.vocab_size, dtype=np.int64)
    crc, top = 0, -1
    with open(path, "wb") as f:
        for texts in _batches(readers.read_documents(item, job.read)):
            flat, docs = tokenize_documents(tok, texts, job.eod_id, dtype)
            flat.tofile(f)
            crc = zlib.crc32(flat, crc)
            top = max(top, int(flat.max())) if flat.size else top
            lengths.append(docs)
            counts += np.bincount(flat, minlength=job.vocab_size)[:job.vocab_size]
    documents = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    return ShardResult(item.index, item.path, documents, counts, crc, top)


def _encoded_records(item: readers.WorkItem, job: _Job, tok):
    """(ids, mask) of each record of a ``.jsonl`` piece; errors name ``file:line``."""
    for record, offset in readers.read_records(item):
        try:
            yield chat.encode_record(record, tok, job.chat, job.eod_id)
        except DataError as exc:
            raise DataError(f"{readers.location(item.path, offset)}: {exc}") from None


def _run_records(item: readers.WorkItem, job: _Job, tok) -> ShardResult:
    """A chat or prompt-completion piece: its token shard and, beside it, its loss mask."""
    dtype = np.dtype(job.dtype)
    lengths, counts = [], np.zeros(job.vocab_size, dtype=np.int64)
    crc, mask_crc, top, trained = 0, 0, -1, 0
    out = Path(job.out)
    with open(out / shard_name(item.index), "wb") as f, \
            open(out / mask_name(item.index), "wb") as m:
        for ids, mask in _encoded_records(item, job, tok):
            flat = np.asarray(ids, dtype=dtype)
            flat.tofile(f)
            mask.tofile(m)
            crc, mask_crc = zlib.crc32(flat, crc), zlib.crc32(mask, mask_crc)
            top = max(top, int(flat.max())) if flat.size else top
            trained += int(mask.sum())
            lengths.append(flat.size)
            counts += np.bincount(flat, minlength=job.vocab_size)[:job.vocab_size]
    documents = np.asarray(lengths, dtype=np.int64)
    return ShardResult(item.index, item.path, documents, counts, crc, top, mask_crc, trained)


def _job(info: tokenizer.TokenizerInfo, eod_id: int, options: PrepareOptions, out: Path,
         chat_options: chat.ChatOptions | None) -> _Job:
    return _Job(str(info.json_path), eod_id, token_dtype(info.vocab_size).name, info.vocab_size,
                options.read, str(out), chat_options)


def _chat_options(info: tokenizer.TokenizerInfo, options: PrepareOptions, paths: list[Path]
                  ) -> chat.ChatOptions | None:
    """The record options of a chat or prompt-completion run (None for text): inputs must be
    ``.jsonl``; a chat needs a template (prompt-completion only for message lists: a record
    of them is refused when the tokenizer has none)."""
    if options.format == "text":
        return None
    for path in paths:
        if path.suffix != ".jsonl":
            raise DataError(f"{path}: --format {options.format} reads .jsonl files (one record "
                            "per line)")
    template = chat_template.find(info.folder, options.chat_template,
                                  required=options.format == "chat")
    return chat.ChatOptions(options.format, options.train_on, template)


def _results(items: list[readers.WorkItem], job: _Job, options: PrepareOptions) -> list:
    """Every item's result, in item order; a bar over input bytes."""
    from tqdm import tqdm

    bar = tqdm(total=sum(i.size for i in items), unit="B", unit_scale=True, desc="tokenize",
               disable=not options.progress, dynamic_ncols=True, mininterval=0.5)
    done: dict[int, ShardResult] = {}
    workers = min(options.workers, len(items))
    with bar:
        if workers <= 1:
            _init_worker(job)
            results = map(_run_item, items)
            pool = None
        else:
            pool = multiprocessing.get_context("spawn").Pool(workers, _init_pool_worker, (job,))
            results = pool.imap_unordered(_run_item, items)
        try:
            for result in results:
                done[result.index] = result
                bar.update(items[result.index].size)
        finally:
            if pool is not None:
                pool.terminate()
    return [done[i] for i in range(len(items))]


def _check_every_input_has_documents(paths: list[Path], results: list[ShardResult]) -> None:
    per_input = {str(p): 0 for p in paths}
    for r in results:
        per_input[r.path] += r.documents.size
    for path, count in per_input.items():
        if count == 0:
            raise DataError(f"{path}: empty input (no documents)")


def prepare(inputs: list[str], out: str | Path, tokenizer_path: str | Path,
            options: PrepareOptions) -> dict:
    """Tokenize ``inputs`` into the prepared dataset ``out``; returns its manifest.

    Raises:
        DataError: (one line) a bad input, tokenizer or output; nothing is left at ``out``.
    """
    out, paths = Path(out), readers.input_paths(inputs)
    if not paths:
        raise DataError("prepare-data: no input files given")
    info = tokenizer.resolve(tokenizer_path)
    if info.model_vocab is not None and info.vocab_size > info.model_vocab:
        raise DataError(f"--tokenizer {tokenizer_path}: vocabulary of {info.vocab_size} tokens "
                        f"is larger than the model's vocabulary ({info.model_vocab})")
    eod_id = tokenizer.end_of_document(info, info.load(), options.eod_token)
    chat_options = _chat_options(info, options, paths)
    items = readers.plan_work(paths, options.read)
    folder = OutFolder.open(out)
    partial = folder.staging
    try:
        start = time.perf_counter()
        results = _results(items, _job(info, eod_id, options, partial, chat_options), options)
        _check_every_input_has_documents(paths, results)
        manifest = _write_index(partial, results, info, eod_id, options, paths)
        if chat_options is not None:
            manifest = _with_mask(partial, manifest, results, chat_options)
        manifest["seconds"] = round(time.perf_counter() - start, 3)
        folder.commit(MANIFEST)
    except BaseException:
        folder.discard()
        raise
    return manifest


def _write_index(partial: Path, results: list[ShardResult], info: tokenizer.TokenizerInfo,
                 eod_id: int, options: PrepareOptions, paths: list[Path]) -> dict:
    lengths = np.concatenate([r.documents for r in results])
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    np.save(partial / DOCUMENTS, offsets)
    np.save(partial / UNIGRAM, sum(r.counts for r in results))
    manifest = {
        "format": FORMAT, "dtype": token_dtype(info.vocab_size).name,
        "tokenizer": {"sha256": info.sha256, "vocab_size": info.vocab_size, "eod_id": eod_id,
                      "path": str(info.json_path.resolve()), "special": info.special},
        "num_documents": int(lengths.size), "num_tokens": int(offsets[-1]),
        "max_token_id": max(r.max_token_id for r in results),
        "shards": [{"file": shard_name(r.index), "documents": int(r.documents.size),
                    "tokens": int(r.documents.sum()), "crc32": r.crc32,
                    "max_token_id": r.max_token_id} for r in results],
        "documents": DOCUMENTS, "unigram": UNIGRAM,
        "inputs": [{"path": str(p.resolve()), "bytes": p.stat().st_size} for p in paths],
        "options": {**asdict(options.read), "eod_token": options.eod_token},
    }
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _with_mask(partial: Path, manifest: dict, results: list[ShardResult],
               chat_options: chat.ChatOptions) -> dict:
    """The manifest of a chat or prompt-completion dataset: the input format, the template's
    hash and origin, the loss mask's counts and each mask file's crc32 (written again)."""
    trained = sum(r.trained for r in results)
    template = chat_options.template
    manifest = {
        **manifest, "input_format": chat_options.format,
        "chat_template": None if template is None else {"sha256": template.sha256,
                                                        "origin": template.origin},
        "loss_mask": {"train_on": chat_options.train_on, "dtype": "uint8",
                      "trained_tokens": trained, "masked_tokens": manifest["num_tokens"] - trained},
        "shards": [{**entry, "mask_file": mask_name(r.index), "mask_crc32": r.mask_crc32}
                   for entry, r in zip(manifest["shards"], results, strict=True)],
    }
    manifest["options"] = {**manifest["options"], "format": chat_options.format,
                           "train_on": chat_options.train_on}
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def summary_line(manifest: dict, out: Path) -> str:
    mb = sum(i["bytes"] for i in manifest["inputs"]) / 1e6
    seconds = manifest.get("seconds") or float("nan")
    return (f"prepared {out}: {manifest['num_documents']:,} documents, "
            f"{manifest['num_tokens']:,} tokens ({manifest['dtype']}, vocabulary "
            f"{manifest['tokenizer']['vocab_size']:,}, end-of-document id "
            f"{manifest['tokenizer']['eod_id']}) from {mb:,.1f} MB in {seconds:.1f} s "
            f"({mb / seconds:,.1f} MB/s)")


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def progress_default() -> bool:
    return sys.stderr.isatty()
