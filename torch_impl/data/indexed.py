"""A prepared token dataset (written by ``moezero prepare-data``), read through numpy memmaps.

On disk: ``manifest.json`` (``FORMAT``), ``shard-NNNNN.bin`` (raw little-endian uint16 or
uint32 token ids, documents never split across shards), ``documents.npy`` (int64 offsets of
every document in the concatenated token stream; ``num_documents + 1`` entries) and
``unigram.npy`` (token counts). Chat and prompt-completion datasets also hold
``mask-NNNNN.bin`` beside each shard (one uint8 per token, 1 = trained; ``TokenDataset.mask``),
prepared once and never recomputed at train time.

``split_documents`` holds out documents for validation: document ``i`` is held out when
``ceil((i+1) f) - ceil(i f) == 1`` — ``ceil(n f)`` documents spread evenly, the first one
always among them — so the split depends on the dataset alone (not on seeds, W or the
tokenizer's speed). A ``PackedSplit`` concatenates the documents of one side and cuts the
stream into samples of ``seq_len + 1`` tokens that overlap by one (inputs and shifted
targets): sample ``j`` is tokens ``[j L, j L + L + 1)``; documents are packed across sample
boundaries, each ending with its end-of-document token.

Integrity: the manifest records each shard's ``crc32`` and ``max_token_id`` (and the
dataset's ``max_token_id``). Opening checks the counts against the files; :meth:`TokenDataset.verify`
streams every shard in chunks to check its crc32 and largest id; ``max_token_ids`` gives
the ids the vocabulary check needs. Manifests of older versions carry neither field.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from moezero.data.common import DataError, entropy_nats

FORMAT = "moezero.tokens.v1"
MANIFEST = "manifest.json"
DOCUMENTS = "documents.npy"
UNIGRAM = "unigram.npy"
VERIFY_CHUNK = 8 << 20  # bytes read at a time by ``TokenDataset.verify``


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def mask_name(index: int) -> str:
    return f"mask-{index:05d}.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


class TokenDataset:
    """A prepared dataset, opened read-only: its manifest, memmapped shards, document offsets."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = _read_manifest(self.path)
        self.tokenizer: dict = self.manifest["tokenizer"]
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        self.shards = [self._open_shard(s) for s in self.manifest["shards"]]
        self.masks = [self._open_mask(s) for s in self.manifest["shards"]] if self.has_mask \
            else None
        self.shard_starts = np.zeros(len(self.shards) + 1, dtype=np.int64)
        np.cumsum([s.size for s in self.shards], out=self.shard_starts[1:])
        if self.manifest.get("num_tokens") != int(self.shard_starts[-1]):
            raise DataError(f"{self.path / MANIFEST}: num_tokens {self.manifest.get('num_tokens')}"
                            f" differs from its shards' {int(self.shard_starts[-1])} tokens")
        self.offsets = self._load(DOCUMENTS, mmap_mode="r")
        if self.offsets.shape != (self.manifest["num_documents"] + 1,) or \
                int(self.offsets[-1]) != self.shard_starts[-1]:
            raise DataError(f"{self.path / DOCUMENTS}: does not match the manifest's "
                            "document and token counts")

    @property
    def num_documents(self) -> int:
        return self.offsets.size - 1

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer["vocab_size"])

    def _load(self, name: str, **kw) -> np.ndarray:
        try:
            return np.load(self.path / name, **kw)
        except (OSError, ValueError) as exc:
            raise DataError(f"{self.path / name}: unreadable ({' '.join(str(exc).split())})") \
                from None

    def _open_shard(self, entry: dict) -> np.ndarray:
        path = self.path / entry["file"]
        if not path.is_file() or path.stat().st_size != entry["tokens"] * self.dtype.itemsize:
            raise DataError(f"{path}: missing or not {entry['tokens']} tokens of "
                            f"{self.dtype.name} (an incomplete copy of the dataset?)")
        if entry["tokens"] == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(path, dtype=self.dtype, mode="r")

    def _open_mask(self, entry: dict) -> np.ndarray:
        path = self.path / entry.get("mask_file", "")
        if not path.is_file() or path.stat().st_size != entry["tokens"]:
            raise DataError(f"{path}: missing or not {entry['tokens']} loss-mask bytes (an "
                            "incomplete copy of the dataset?)")
        if entry["tokens"] == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.memmap(path, dtype=np.uint8, mode="r")

    @property
    def has_mask(self) -> bool:
        """Whether a loss mask was prepared beside the tokens (chat, prompt-completion)."""
        return "loss_mask" in self.manifest

    @property
    def has_checksums(self) -> bool:
        """Whether the manifest records every shard's crc32 (older versions did not)."""
        return all("crc32" in s and "max_token_id" in s for s in self.manifest["shards"])

    def max_token_ids(self) -> list[int | None]:
        """Each shard's largest token id as the manifest records it (None: not recorded)."""
        return [s.get("max_token_id") for s in self.manifest["shards"]]

    def verify(self, chunk_bytes: int = VERIFY_CHUNK) -> list[int]:
        """Each shard's largest token id, read from the files ``chunk_bytes`` at a time; checks
        the crc32 and largest id the manifest records (when it records them).

        Raises:
            DataError: (one line) naming the first shard that differs from its manifest entry.
        """
        maxima = []
        for entry in self.manifest["shards"]:
            path = self.path / entry["file"]
            crc, top = scan_shard(path, self.dtype, chunk_bytes)
            if "crc32" in entry and crc != entry["crc32"]:
                raise DataError(f"{path}: crc32 {crc:#010x}, manifest says {entry['crc32']:#010x}"
                                " (the shard changed after prepare-data)")
            if entry.get("max_token_id", top) != top:
                raise DataError(f"{path}: largest token id {top}, manifest says "
                                f"{entry['max_token_id']}")
            maxima.append(top)
            if self.has_mask:
                self._verify_mask(entry, chunk_bytes)
        return maxima

    def _verify_mask(self, entry: dict, chunk_bytes: int) -> None:
        path = self.path / entry["mask_file"]
        crc, top = scan_shard(path, np.dtype(np.uint8), chunk_bytes)
        if crc != entry.get("mask_crc32", crc):
            raise DataError(f"{path}: crc32 {crc:#010x}, manifest says "
                            f"{entry['mask_crc32']:#010x} (the loss mask changed after "
                            "prepare-data)")
        if top > 1:
            raise DataError(f"{path}: holds {top}, a loss mask holds only 0 and 1")

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of the concatenated stream, int64 (may span shards)."""
        return _gather(self.shards, self.shard_starts, start, stop, np.int64)

    def mask(self, start: int, stop: int) -> np.ndarray:
        """Loss mask of tokens ``[start, stop)`` (bool: True = trained); all True for a
        dataset prepared without one (plain text: every token is trained)."""
        if self.masks is None:
            return np.ones(stop - start, dtype=bool)
        return _gather(self.masks, self.shard_starts, start, stop, np.uint8).astype(bool)

    def unigram_counts(self) -> np.ndarray:
        return self._load(UNIGRAM)

    def describe(self) -> str:
        return (f"{self.path}: {self.num_documents:,} documents, {self.shard_starts[-1]:,} "
                f"tokens, vocab {self.vocab_size:,}, unigram "
                f"{entropy_nats(self.unigram_counts() / max(1, self.shard_starts[-1])):.3f} "
                "nats/token")


def _gather(shards: list[np.ndarray], shard_starts: np.ndarray, start: int, stop: int,
            dtype) -> np.ndarray:
    """Elements ``[start, stop)`` of the concatenation of ``shards`` (may span shards)."""
    out = np.empty(stop - start, dtype=dtype)
    pos, shard = start, int(np.searchsorted(shard_starts, start, side="right")) - 1
    while pos < stop:
        base = shard_starts[shard]
        take = min(stop, shard_starts[shard + 1]) - pos
        out[pos - start:pos - start + take] = shards[shard][pos - base:pos - base + take]
        pos, shard = pos + take, shard + 1
    return out


def scan_shard(path: Path, dtype: np.dtype, chunk_bytes: int = VERIFY_CHUNK) -> tuple[int, int]:
    """The crc32 and the largest token id (-1 when empty) of a shard file, read in chunks
    into one reused buffer."""
    buf = bytearray(max(1, chunk_bytes // dtype.itemsize) * dtype.itemsize)
    view, crc, top = memoryview(buf), 0, -1
    with open(path, "rb") as f:
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
            ids = np.frombuffer(buf, dtype=dtype, count=n // dtype.itemsize)
            top = max(top, int(ids.max())) if ids.size else top
    return crc, top


def _read_manifest(path: Path) -> dict:
    if not path.is_dir():
        raise DataError(f"data.path {path}: no such dataset directory")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise DataError(f"data.path {path}: no {MANIFEST} (not a dataset made by "
                        "moezero prepare-data)") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path / MANIFEST}: unreadable ({' '.join(str(exc).split())})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path / MANIFEST}: not a {FORMAT} manifest")
    return manifest


def split_documents(num_documents: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) document ids: ``ceil(n f)`` documents spread evenly held out."""
    i = np.arange(num_documents, dtype=np.float64)
    held = (np.ceil((i + 1) * val_fraction) - np.ceil(i * val_fraction)) >= 1
    ids = np.arange(num_documents, dtype=np.int64)
    return ids[~held], ids[held]


class PackedSplit:
    """The documents ``doc_ids`` of a dataset, concatenated and cut into samples of
    ``seq_len + 1`` tokens (sample ``j``: stream tokens ``[j L, j L + L + 1)``).

    Consecutive documents that are contiguous on disk form one run, so a sample is read in
    one or a few slices.
    """

    def __init__(self, dataset: TokenDataset, doc_ids: np.ndarray, seq_len: int, name: str):
        self.dataset, self.seq_len, self.name = dataset, seq_len, name
        starts = np.asarray(dataset.offsets[doc_ids], dtype=np.int64)
        stops = np.asarray(dataset.offsets[doc_ids + 1], dtype=np.int64)
        cut = np.flatnonzero(starts[1:] != stops[:-1]) + 1
        first, last = np.r_[0, cut], np.r_[cut, doc_ids.size] - 1
        self.run_starts = starts[first] if doc_ids.size else np.zeros(0, np.int64)
        run_lengths = stops[last] - self.run_starts if doc_ids.size else np.zeros(0, np.int64)
        self.run_cum = np.zeros(run_lengths.size + 1, dtype=np.int64)
        np.cumsum(run_lengths, out=self.run_cum[1:])
        self.num_documents = int(doc_ids.size)
        self.num_tokens = int(self.run_cum[-1])
        self.num_samples = max(0, (self.num_tokens - 1) // seq_len)

    def check(self, why: str) -> None:
        """DataError unless the split holds at least one sample."""
        if self.num_samples < 1:
            raise DataError(
                f"dataset {self.dataset.path}: its {self.name} split ({self.num_documents} "
                f"documents) has {self.num_tokens} tokens, shorter than one sequence "
                f"(train.seq_len + 1 = {self.seq_len + 1} tokens){why}")

    def spans(self, j: int) -> list[tuple[int, int]]:
        """Sample ``j`` as ``[start, stop)`` ranges of the dataset's token stream."""
        lo, hi = j * self.seq_len, j * self.seq_len + self.seq_len + 1
        run = int(np.searchsorted(self.run_cum, lo, side="right")) - 1
        spans = []
        while lo < hi:
            take = min(hi, self.run_cum[run + 1]) - lo
            start = int(self.run_starts[run] + lo - self.run_cum[run])
            spans.append((start, start + int(take)))
            lo, run = lo + take, run + 1
        return spans

    def sample(self, j: int) -> np.ndarray:
        """Sample ``j`` (0 <= j < num_samples), int64 [seq_len + 1]."""
        parts = [self.dataset.read(a, b) for a, b in self.spans(j)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def sample_mask(self, j: int) -> np.ndarray:
        """The loss mask of sample ``j``'s tokens, bool [seq_len + 1] (all True for a
        dataset prepared without one)."""
        return np.concatenate([self.dataset.mask(a, b) for a, b in self.spans(j)])

    def sample_documents(self, j: int) -> np.ndarray:
        """The dataset's document index of each token of sample ``j``, int64 [seq_len + 1]."""
        pos = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.spans(j)])
        return np.searchsorted(self.dataset.offsets, pos, side="right").astype(np.int64) - 1


def open_splits(path: str | Path, *, seq_len: int, val_fraction: float,
                ) -> tuple[TokenDataset, PackedSplit, PackedSplit | None]:
    """A dataset and its training and validation splits (None when nothing is held out)."""
    dataset = TokenDataset(path)
    train_ids, val_ids = split_documents(dataset.num_documents, val_fraction)
    train = PackedSplit(dataset, train_ids, seq_len, "training")
    val = PackedSplit(dataset, val_ids, seq_len, "validation") if val_ids.size else None
    return dataset, train, val

