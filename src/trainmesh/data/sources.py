"""Documents streamed from the inputs of ``trainmesh prepare``, in a fixed order, in bounded memory.

Each input is a text file (one document), a JSONL file (one document per line, its ``text`` field), a
Parquet file (its ``text`` column, read a batch of rows at a time with pyarrow), a directory saved by
Hugging Face ``datasets`` ``save_to_disk`` (its ``text`` column, memory-mapped Arrow; nothing is
downloaded), or a directory of such files. A large text file is handed on in pieces of about
``PIECE_BYTES`` cut at line ends, so no file is ever held whole.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainmesh.data.text import TOKEN_FILE_SUFFIXES, DataError, files_under, text_documents

PIECE_BYTES = 1 << 20
TEXT_FIELD = "text"
HF_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


@dataclass(frozen=True)
class Piece:
    """Part of a document: its text, whether the document ends with it, and the input bytes it consumed
    (for the progress bar's MB/s and ETA)."""

    text: str
    ends_document: bool
    input_bytes: int


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


def _decode(decoder: codecs.IncrementalDecoder, raw: bytes, path: Path, offset: int, final: bool = False) -> str:
    try:
        return decoder.decode(raw, final)
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (invalid byte 0x{e.object[e.start]:02x} at offset "
                        f"{offset + e.start}); convert it to UTF-8 or leave it out of --input") from None


def text_pieces(path: Path) -> Iterator[Piece]:
    """One document: whole when it fits in one read, else in pieces cut after a newline (a character split
    between reads is carried over). Tokens at a cut may differ from tokenizing the whole file, as if the
    file had a document-internal boundary there; only files over ``PIECE_BYTES`` have cuts."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, rest = 0, ""
    with open(path, "rb") as f:
        chunk = f.read(PIECE_BYTES)
        while True:
            ahead = f.read(PIECE_BYTES)
            text = rest + _decode(decoder, chunk, path, offset, final=not ahead)
            if not ahead:
                yield Piece(text, True, len(chunk))
                return
            cut = text.rfind("\n") + 1 or len(text)
            yield Piece(text[:cut], False, len(chunk))
            offset, rest, chunk = offset + len(chunk), text[cut:], ahead


def jsonl_pieces(path: Path) -> Iterator[Piece]:
    """One document per line: the line's ``text`` field."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)[TEXT_FIELD]
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{path}:{n}: not a JSON object with a string {TEXT_FIELD!r} field") from None
            if not isinstance(text, str):
                raise DataError(f"{path}:{n}: the {TEXT_FIELD!r} field is {type(text).__name__}, not a string")
            yield Piece(text, True, len(line))


def _column_pieces(batches: Iterator, rows: int, size: int, where: Path) -> Iterator[Piece]:
    """Documents of the ``text`` column of Arrow record batches, progress spread evenly over rows."""
    done = 0
    for batch in batches:
        if TEXT_FIELD not in batch.schema.names:
            raise DataError(f"{where} has no {TEXT_FIELD!r} column (columns: {', '.join(batch.schema.names)})")
        for text in batch.column(TEXT_FIELD).to_pylist():
            done += 1
            yield Piece(text or "", True, size * done // rows - size * (done - 1) // rows)


def parquet_pieces(path: Path) -> Iterator[Piece]:
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid (a ValueError) or OSError for a bad file
        raise DataError(f"{path} is not a readable Parquet file ({e})") from None
    if TEXT_FIELD not in f.schema_arrow.names:
        raise DataError(f"{path} has no {TEXT_FIELD!r} column (columns: {', '.join(f.schema_arrow.names)})")
    yield from _column_pieces(f.iter_batches(batch_size=1024, columns=[TEXT_FIELD]), max(1, f.metadata.num_rows),
                              path.stat().st_size, path)


def hf_dataset_pieces(path: Path) -> Iterator[Piece]:
    """A ``save_to_disk`` directory (every split of a DatasetDict, in its stored order)."""
    import datasets

    loaded = datasets.load_from_disk(str(path))
    splits = list(loaded.values()) if isinstance(loaded, datasets.DatasetDict) else [loaded]
    size = input_size(path)
    rows = max(1, sum(len(s) for s in splits))
    done = 0
    for split in splits:
        table = split.with_format("arrow")
        for batch in table.iter(batch_size=1024):
            names = batch.schema.names
            if TEXT_FIELD not in names:
                raise DataError(f"{path} has no {TEXT_FIELD!r} column (columns: {', '.join(names)})")
            for text in batch.column(TEXT_FIELD).to_pylist():
                done += 1
                yield Piece(text or "", True, size * done // rows - size * (done - 1) // rows)


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
