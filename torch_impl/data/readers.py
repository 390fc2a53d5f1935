"""Input files of ``prepare-data`` as documents: ``.txt``, ``.jsonl`` and ``.parquet``.

``plan_work`` checks every input (exists, known suffix, not empty, the parquet text column is
there and holds strings) and cuts it into :class:`WorkItem` pieces of whole documents — byte
ranges ending at a document boundary, or parquet row groups — that worker processes read on
their own with ``read_documents``. Every problem is a one-line ``DataError`` naming the file
(and the line or row).

A ``.txt`` file's documents are its paragraphs (blank-line separated, the default), its lines,
or the whole file (``ReadOptions.txt_split``). A ``.jsonl`` line is one document, its text in
``ReadOptions.text_field`` (a dotted path reaches into nested objects); blank lines are
skipped. A ``.parquet`` row is one document, its text in the column ``text_field``. Empty
texts are skipped.
"""

from __future__ import annotations

import json
import mmap
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moezero.data.common import DataError, lone_surrogate

SUFFIXES = (".txt", ".jsonl", ".parquet")
_PARAGRAPH_END = re.compile(rb"\n[ \t\r]*\n")
_PARAGRAPH_SPLIT = re.compile(r"\n[ \t\r]*\n")


@dataclass(frozen=True)
class ReadOptions:
    """How documents are found in the inputs."""

    text_field: str = "text"
    txt_split: Literal["paragraph", "line", "file"] = "paragraph"
    chunk_bytes: int = 16 << 20


@dataclass(frozen=True)
class WorkItem:
    """Whole documents of one input: bytes ``[start, stop)`` of a text file, or row groups
    ``[start, stop)`` of a parquet file; ``size`` is its share of the input bytes (progress)."""

    index: int
    path: str
    start: int
    stop: int
    size: int

    @property
    def kind(self) -> str:
        return Path(self.path).suffix


def plan_work(paths: list[Path], options: ReadOptions) -> list[WorkItem]:
    """Every input checked and cut into pieces of whole documents, in input order."""
    items: list[WorkItem] = []
    for path in paths:
        _check_input(path)
        pieces = (_parquet_pieces(path, options) if path.suffix == ".parquet"
                  else _text_pieces(path, options))
        items += [WorkItem(len(items) + i, str(path), a, b, size)
                  for i, (a, b, size) in enumerate(pieces)]
    return items


def _check_input(path: Path) -> None:
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.is_dir():
        raise DataError(f"{path}: is a directory; give the input files")
    if path.suffix not in SUFFIXES:
        raise DataError(f"{path}: unknown input type {path.suffix or '(no suffix)'!r}; "
                        f"expected one of {', '.join(SUFFIXES)}")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty input (no documents)")


def _text_pieces(path: Path, options: ReadOptions) -> list[tuple[int, int, int]]:
    """Byte ranges of about ``chunk_bytes`` each, every one ending at a document boundary."""
    size = path.stat().st_size
    if path.suffix == ".txt" and options.txt_split == "file":
        return [(0, size, size)]
    pieces, start = [], 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        while start < size:
            stop = _boundary(mm, path, options, min(start + options.chunk_bytes, size))
            pieces.append((start, stop, stop - start))
            start = stop
    return pieces


def _boundary(mm: mmap.mmap, path: Path, options: ReadOptions, pos: int) -> int:
    """The first document end at or after ``pos`` (the file's end if none)."""
    if pos >= len(mm):
        return len(mm)
    if path.suffix == ".txt" and options.txt_split == "paragraph":
        found = _PARAGRAPH_END.search(mm, pos)
        return found.end() if found else len(mm)
    found = mm.find(b"\n", pos)
    return found + 1 if found >= 0 else len(mm)


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow "
                        "(pip install 'moezero[data]')") from None
    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends
        raise DataError(f"{path}: not a readable parquet file ({_one_line(exc)})") from None


def _parquet_pieces(path: Path, options: ReadOptions) -> list[tuple[int, int, int]]:
    """One piece per run of row groups of about ``chunk_bytes``; the text column checked."""
    import pyarrow as pa

    pf = _parquet_file(path)
    schema = pf.schema_arrow
    if options.text_field not in schema.names:
        raise DataError(f"{path}: no column {options.text_field!r} (columns: "
                        f"{', '.join(schema.names)}); choose one with --text-field")
    kind = schema.field(options.text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: column {options.text_field!r} holds {kind}, not strings")
    meta = pf.metadata
    if meta.num_rows == 0:
        raise DataError(f"{path}: empty input (no rows)")
    pieces, start, size = [], 0, 0
    for g in range(meta.num_row_groups):
        size += meta.row_group(g).total_byte_size
        if size >= options.chunk_bytes or g == meta.num_row_groups - 1:
            pieces.append((start, g + 1, size))
            start, size = g + 1, 0
    return pieces


def read_documents(item: WorkItem, options: ReadOptions) -> Iterator[str]:
    """The non-empty document texts of one piece, in file order."""
    if item.kind == ".parquet":
        yield from _parquet_documents(item, options)
        return
    text = _decode(item)
    if item.kind == ".jsonl":
        yield from _jsonl_documents(item, text, options.text_field)
    elif options.txt_split == "file":
        if text.strip():
            yield text
    else:
        parts = text.split("\n") if options.txt_split == "line" else _PARAGRAPH_SPLIT.split(text)
        yield from (p.strip("\r\n") for p in parts if p.strip())


def _decode(item: WorkItem) -> str:
    with open(item.path, "rb") as f:
        f.seek(item.start)
        raw = f.read(item.stop - item.start)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        at = item.start + exc.start
        raise DataError(f"{item.path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
                        f"{at}, line {_line_of(item.path, at)})") from None


def _line_of(path: str, offset: int) -> int:
    """1-based line number of a byte offset (computed only to report an error)."""
    with open(path, "rb") as f:
        return f.read(offset).count(b"\n") + 1


def _jsonl_documents(item: WorkItem, text: str, field: str) -> Iterator[str]:
    for obj, where in _jsonl_objects(item, text):
        value = _field(obj, field, item.path, where)
        if value:
            yield value


def _jsonl_objects(item: WorkItem, text: str) -> Iterator[tuple[dict, int]]:
    """Each non-blank line's JSON object and the line's byte offset in the file."""
    offset = item.start
    for line in text.split("\n"):
        where = offset
        offset += len(line.encode("utf-8")) + 1 if not line.isascii() else len(line) + 1
        if line.strip():
            yield _json_line(line, item.path, where), where


def read_records(item: WorkItem) -> Iterator[tuple[dict, int]]:
    """The JSON objects of a ``.jsonl`` piece, each with its line's byte offset in the file
    (``location`` turns it into ``file:line`` for an error)."""
    yield from _jsonl_objects(item, _decode(item))


def location(path: str, offset: int) -> str:
    """``file:line`` of a byte offset (the line counted only when an error needs it)."""
    return f"{path}:{_line_of(path, offset)}"


def _json_line(line: str, path: str, offset: int) -> dict:
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise DataError(f"{path}:{_line_of(path, offset)}: not valid JSON "
                        f"({_one_line(exc)})") from None
    except RecursionError:
        raise DataError(f"{path}:{_line_of(path, offset)}: not valid JSON (nested too "
                        "deeply)") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}:{_line_of(path, offset)}: a JSON {type(obj).__name__}, "
                        "expected an object per line")
    return obj


def _field(obj: dict, field: str, path: str, offset: int) -> str:
    """``obj[field]`` (dotted: nested), which must be a string."""
    value: object = obj
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            raise DataError(f"{path}:{_line_of(path, offset)}: no field {field!r} "
                            "(choose the text field with --text-field)")
        value = value[part]
    if not isinstance(value, str):
        raise DataError(f"{path}:{_line_of(path, offset)}: field {field!r} is a "
                        f"{type(value).__name__}, expected a string")
    if (where := lone_surrogate(value)) is not None:
        raise DataError(f"{path}:{_line_of(path, offset)}: field {field!r} holds a lone "
                        f"surrogate ({where})")
    return value


def _parquet_documents(item: WorkItem, options: ReadOptions) -> Iterator[str]:
    pf = _parquet_file(Path(item.path))
    row = sum(pf.metadata.row_group(g).num_rows for g in range(item.start))
    for g in range(item.start, item.stop):
        column = pf.read_row_group(g, columns=[options.text_field]).column(0).to_pylist()
        for i, value in enumerate(column):
            if value is None:
                raise DataError(f"{item.path}: row {row + i}: {options.text_field!r} is null")
            if value:
                yield value
        row += len(column)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def input_paths(inputs: list[str]) -> list[Path]:
    """The command line's inputs as paths, each named once."""
    seen: dict[str, Path] = {}
    for text in inputs:
        seen.setdefault(os.path.realpath(text), Path(text))
    return list(seen.values())
