"""Text to token ids and back: byte tokens (the zero-setup default) or any Hugging Face ``tokenizer.json``.

Both kinds answer ``encode(str) -> list[int]``, ``decode(list[int]) -> str`` and ``vocab_size``. A file
tokenizer is read through the ``tokenizers`` library (the ``hf`` extra), imported only when one is asked for.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Protocol

BYTE_VOCAB = 256


class TokenizerError(ValueError):
    """A tokenizer that cannot be used; the message names the file and what to do."""


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens; decoding replaces a sequence that is not valid UTF-8 (a model can emit one)."""

    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class FileTokenizer:
    """A ``tokenizers.Tokenizer`` read from a ``tokenizer.json``."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise TokenizerError(f"tokenizer {path} needs the 'tokenizers' package; pip install "
                                 f"'trainmesh[hf]'") from None
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - tokenizers raises bare Exceptions for unreadable files
            raise TokenizerError(f"tokenizer {path} cannot be read as a tokenizer.json "
                                 f"({' '.join(str(e).split())})") from None
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer in file ``path``; ``""`` is byte tokens."""
    return FileTokenizer(path) if path else ByteTokenizer()


def tokenizer_sha256(path: str) -> str:
    """SHA-256 of the tokenizer file's bytes: what a checkpoint records so a different file is noticed."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as e:
        raise TokenizerError(f"tokenizer {path} cannot be read: {e.strerror}") from None


def tokenizer_record(path: str) -> dict[str, str]:
    """What a checkpoint records of the tokenizer ``path`` (``""``: byte tokens), so that generation decodes
    with the same one: the file's absolute path, for finding it again, and its SHA-256, for knowing it."""
    if not path:
        return {"kind": "bytes"}
    return {"kind": "file", "path": str(Path(path).resolve()), "sha256": tokenizer_sha256(path)}
