"""Documents streamed from ``trainmesh prepare``'s inputs, in a fixed order, in bounded memory: text files,
JSONL (``text`` field), Parquet and ``datasets.save_to_disk`` directories (``text`` column), or directories
of them. Every document passes :func:`document_pieces`, which hands it on in pieces of at most two
``PIECE_BYTES`` reads, so no document is ever held whole."""

from __future__ import annotations

import codecs
import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainmesh.data.jsonl import TEXT_FIELD, Reads, jsonl_documents
from trainmesh.data.text import TOKEN_FILE_SUFFIXES, DataError, decode_utf8, files_under, text_documents

PIECE_BYTES = 1 << 20
ARROW_BATCH_ROWS = 1024
HF_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Piece:
    """Part of a document: its text, whether the document ends with it, and the input bytes it consumed
    (for the progress bar's MB/s and ETA)."""

    text: str
    ends_document: bool
    input_bytes: int


def document_pieces(reads: Reads) -> Iterator[Piece]:
    """One document from its text in reads: whole in one read, else pieces cut after each read's last newline (the
    rest carried on), so a piece holds at most two reads; tokens at a cut may differ, as at a document boundary."""
    rest, held = "", None
    for read in reads:
        if held is not None:
            text = rest + held[0]
            cut = text.rfind("\n") + 1 or len(text)
            yield Piece(text[:cut], False, held[1])
            rest = text[cut:]
        held = read
    text, n = held if held is not None else ("", 0)
    yield Piece(rest + text, True, n)


def _decoded(raw_reads: Iterable[Any], where: str) -> Reads:
    """UTF-8 reads decoded, each with its byte count (a character split between reads is carried over)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, raw = 0, None
    for ahead in raw_reads:
        if raw is not None:
            yield decode_utf8(decoder, raw, where, offset, final=False), len(raw)
            offset += len(raw)
        raw = ahead
    if raw is not None:
        yield decode_utf8(decoder, raw, where, offset, final=True), len(raw)


def is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / m).is_file() for m in HF_DATASET_MARKERS)


def _skipped(relative: Path) -> bool:
    """Hidden files and ``__pycache__`` (compiled bytecode) inside an input directory."""
    return any(part.startswith(".") or part == "__pycache__" for part in relative.parts)


def input_files(paths: list[str]) -> list[Path]:
    """Every input, directories expanded (hidden files and ``__pycache__`` left out; a saved HF dataset
    stays one input), in the order given."""
    out: list[Path] = []
    for p in map(Path, paths):
        if is_hf_dataset(p):
            out.append(p)
        elif p.is_dir():
            out += [f for f in files_under(p) if not _skipped(f.relative_to(p))]
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"input {p} does not exist")
    return out


def input_size(path: Path) -> int:
    """Bytes the progress bar counts for one input."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*.arrow"))
    return path.stat().st_size


def _file_reads(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from iter(lambda: f.read(PIECE_BYTES), b"")


def text_pieces(path: Path) -> Iterator[Piece]:
    """One document, the whole file."""
    return document_pieces(_decoded(_file_reads(path), str(path)))


def jsonl_pieces(path: Path) -> Iterator[Piece]:
    """One document per line: the line's ``text`` field."""
    for reads in jsonl_documents(path, PIECE_BYTES):
        yield from document_pieces(reads)


def _string_column(type_: Any, where: Path) -> None:
    import pyarrow as pa

    if not (pa.types.is_string(type_) or pa.types.is_large_string(type_)):
        raise DataError(f"{where}: column {TEXT_FIELD!r} holds {type_}, but prepare reads documents from a string "
                        f"(utf8) column; cast it to string or write the documents as text")


def _cells(array: Any) -> Iterator[memoryview | None]:
    """The UTF-8 bytes of each cell of an Arrow string array, as views of its buffer (None for a null): a long
    document is viewed in place, never copied into one Python string."""
    import pyarrow as pa

    _, offsets, data = array.buffers()
    width = np.dtype(np.int64 if pa.types.is_large_string(array.type) else np.int32)
    ends = np.frombuffer(offsets, dtype=width, count=len(array) + 1, offset=array.offset * width.itemsize)
    raw = memoryview(data) if data is not None else memoryview(b"")
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    for i in range(len(array)):
        yield raw[ends[i]:ends[i + 1]] if valid[i] else None


def _cell_reads(cell: memoryview | None) -> Iterator[memoryview]:
    if cell is not None:
        yield from (cell[i:i + PIECE_BYTES] for i in range(0, len(cell), PIECE_BYTES))


def _column_pieces(batches: Iterator[Any], rows: int, size: int, where: Path) -> Iterator[Piece]:
    """Documents of the ``text`` column of Arrow record batches or tables (a null is an empty document),
    progress spread evenly over rows."""
    done = 0
    for batch in batches:
        if TEXT_FIELD not in batch.schema.names:
            raise DataError(f"{where} has no {TEXT_FIELD!r} column (columns: {', '.join(batch.schema.names)})")
        _string_column(batch.schema.field(TEXT_FIELD).type, where)
        column = batch.column(TEXT_FIELD)
        for array in getattr(column, "chunks", [column]):
            for cell in _cells(array):
                done += 1
                share = size * done // rows - size * (done - 1) // rows
                for p in document_pieces(_decoded(_cell_reads(cell), f"{where} row {done - 1}")):
                    yield dataclasses.replace(p, input_bytes=share if p.ends_document else 0)


def parquet_pieces(path: Path) -> Iterator[Piece]:
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid (a ValueError) or OSError for a bad file
        raise DataError(f"{path} is not a readable Parquet file ({e})") from None
    if TEXT_FIELD not in f.schema_arrow.names:
        raise DataError(f"{path} has no {TEXT_FIELD!r} column (columns: {', '.join(f.schema_arrow.names)})")
    _string_column(f.schema_arrow.field(TEXT_FIELD).type, path)
    yield from _column_pieces(f.iter_batches(batch_size=ARROW_BATCH_ROWS, columns=[TEXT_FIELD]),
                              max(1, f.metadata.num_rows), path.stat().st_size, path)


def hf_dataset_pieces(path: Path) -> Iterator[Piece]:
    """A ``save_to_disk`` directory (every split of a DatasetDict, in its stored order)."""
    import datasets

    loaded = datasets.load_from_disk(str(path))
    splits = list(loaded.values()) if isinstance(loaded, datasets.DatasetDict) else [loaded]
    rows = max(1, sum(len(s) for s in splits))
    tables = (t for s in splits for t in s.with_format("arrow").iter(batch_size=ARROW_BATCH_ROWS))
    yield from _column_pieces(tables, rows, input_size(path), path)


def pieces(path: Path) -> Iterator[Piece]:
    """The documents of one input, by its format."""
    if is_hf_dataset(path):
        return hf_dataset_pieces(path)
    if path.suffix == ".parquet":
        return parquet_pieces(path)
    if path.suffix in (".jsonl", ".ndjson"):
        return jsonl_pieces(path)
    if path.suffix in TOKEN_FILE_SUFFIXES:
        raise DataError(f"{path} looks like a binary token file; prepare reads text, JSONL, Parquet or a saved HF "
                        f"dataset (a directory prepare wrote is already tokenized: pass it to train --data)")
    return text_pieces(path)


def document_texts(inputs: list[str]) -> Iterator[str]:
    """The text of ``inputs`` piece by piece (the default corpus when empty), for training a tokenizer."""
    if not inputs:
        yield from (d.decode("utf-8", errors="ignore") for d in text_documents(""))
        return
    for f in input_files(inputs):
        yield from (p.text for p in pieces(f))
