"""Local text read whole into memory (``--data FILE_OR_DIR``, or by default this Python's stdlib sources, so
a first run needs no download): bytes, or one document per file with ``--tokenizer``. Larger corpora go
through ``trainmesh prepare``."""

from __future__ import annotations

import codecs
import os
import sysconfig
from pathlib import Path

import torch

VOCAB_SIZE = 256
DEFAULT_CORPUS_BYTES = 16 * 2**20
TOKEN_FILE_SUFFIXES = (".bin", ".npy", ".npz", ".pt", ".idx")
PREPARE_HINT = ("train --data takes UTF-8 text or a directory written by 'trainmesh prepare'; tokenize a corpus "
                "with: trainmesh prepare --input TEXT... --tokenizer tok.json --out DIR")


class DataError(ValueError):
    """Unusable training data; the message names the file and the problem."""


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files in a fixed order (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        files += [Path(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return files


def files_under(path: Path) -> list[Path]:
    """``path`` itself if a file, else every file below it in sorted order."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        if not files:
            raise DataError(f"data directory {path} contains no files")
        return files
    raise DataError(f"data path {path} does not exist")


def _utf8_error(data: bytes) -> int | None:
    """Offset of the first byte that is not valid UTF-8, or None."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start
    return None


def not_text_error(f: Path, data: bytes, bad: int) -> DataError:
    """The error for a file that is not UTF-8 text: a token file (by its suffix; small ids can be valid
    UTF-8) is pointed at ``prepare``, not at re-encoding."""
    if f.suffix in TOKEN_FILE_SUFFIXES:
        return DataError(f"{f} looks like a binary token file, not text; {PREPARE_HINT}")
    return DataError(f"{f} is not UTF-8 text (invalid byte 0x{data[bad]:02x} at offset {bad}); convert it to "
                     f"UTF-8 or leave it out of --data ({PREPARE_HINT})")


def utf8_error(where: str, e: UnicodeDecodeError, offset: int) -> DataError:
    """The error for bytes of ``where`` that are not UTF-8 (``offset``: where ``e``'s bytes start)."""
    return DataError(f"{where} is not UTF-8 text (invalid byte 0x{e.object[e.start]:02x} at offset "
                     f"{offset + e.start}); convert it to UTF-8 or leave it out of --input")


def decode_utf8(decoder: codecs.IncrementalDecoder, raw: bytes, where: str, offset: int, final: bool) -> str:
    """``raw`` (from ``offset`` of ``where``) decoded; a character split at its end is completed by the next."""
    try:
        return decoder.decode(raw, final)
    except UnicodeDecodeError as e:
        raise utf8_error(where, e, offset) from None


def read_documents(files: list[Path], max_bytes: int | None = None, skip_invalid: bool = False) -> list[bytes]:
    """The contents of ``files``, one document each, which must be UTF-8 (a binary file would train silently);
    ``skip_invalid`` drops such files instead. Stops once ``max_bytes`` are read."""
    docs, total = [], 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read {f}: {e.strerror}") from None
        bad = 0 if f.suffix in TOKEN_FILE_SUFFIXES else _utf8_error(data)
        if bad is not None:
            if skip_invalid:
                continue
            raise not_text_error(f, data, bad)
        docs.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            docs[-1] = data[:len(data) - (total - max_bytes)]
            break
    return docs


def read_bytes(files: list[Path], max_bytes: int | None = None, skip_invalid: bool = False) -> bytes:
    """Concatenated contents of ``files`` (see :func:`read_documents`)."""
    return b"".join(read_documents(files, max_bytes, skip_invalid))


def text_documents(path: str = "") -> list[bytes]:
    """The documents of ``path`` (a file or directory; empty: the default corpus)."""
    if path:
        return read_documents(files_under(Path(path)))
    return read_documents(stdlib_sources(), DEFAULT_CORPUS_BYTES, skip_invalid=True)


def load_tokens(path: str = "", tokenizer: str = "") -> torch.Tensor:
    """All tokens of ``path`` (a file or directory; empty: the default corpus): a uint8 tensor of bytes, or
    with ``tokenizer`` an int32 tensor of its ids, each file followed by the end-of-document token."""
    docs = text_documents(path)
    if not tokenizer:
        raw = b"".join(docs)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    from trainmesh.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    eos = [] if tok.eos_id is None else [tok.eos_id]
    ids = [i for doc in tok.encode_batch([d.decode("utf-8", errors="ignore") for d in docs]) for i in (*doc, *eos)]
    return torch.tensor(ids, dtype=torch.int32)
