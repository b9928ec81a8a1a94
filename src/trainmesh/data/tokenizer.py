"""Tokenizers: bytes by default (no setup), or any Hugging Face ``tokenizer.json`` (``--tokenizer``, the
``data`` extra, imported lazily); ``trainmesh tokenizer train`` trains a byte-level BPE (GPT-2, Radford
et al., 2019, §2.2). The vocabulary is padded to a multiple of 64·tp as Megatron-LM does, so tp slices are
equal; pad rows are never inputs or targets."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trainmesh.storage.safe_io import read_regular, sha256_hex

VOCAB_MULTIPLE = 64
BYTE_VOCAB = 256
EOS_TOKEN = "<|endoftext|>"
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
"""End-of-document tokens looked for, in this order, in a tokenizer that was not trained here."""


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message names the file and the fix."""


class Tokenizer(Protocol):
    """What trainmesh needs of a tokenizer."""

    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: the zero-setup default. It has no end-of-document token."""

    vocab_size = BYTE_VOCAB
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` read from a ``tokenizer.json`` (or from its bytes, ``data``, read once
    and checked elsewhere; ``path`` then only names it), with its end-of-document token."""

    def __init__(self, path: str, data: bytes | None = None) -> None:
        self.path = path
        self._tok = _read_hf(path) if data is None else _parse_hf(path, data)
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id: int | None = next((i for i in map(self._tok.token_to_id, EOS_CANDIDATES) if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` and each one's character span in it (chat data's loss mask is found by them)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("a tokenizer.json needs the 'tokenizers' package; pip install 'trainmesh[data]'") from None
    return tokenizers


def _read_hf(path: str) -> Any:
    p = Path(path)
    if not p.is_file():
        raise TokenizerError(f"tokenizer {path} does not exist" if not p.exists() else
                             f"tokenizer {path} is not a file; give the path of a tokenizer.json")
    tokenizers = _tokenizers()
    try:
        return tokenizers.Tokenizer.from_file(str(p))
    except Exception as e:  # the Rust side raises a plain Exception for any malformed file
        raise _not_a_tokenizer(path, e) from None


def _not_a_tokenizer(path: str, e: Exception) -> TokenizerError:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return TokenizerError(f"tokenizer {path} is not a Hugging Face tokenizer.json ({first})")


def _parse_hf(path: str, data: bytes) -> Any:
    tokenizers = _tokenizers()
    try:
        return tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # UnicodeDecodeError, or the Rust side's plain Exception
        raise _not_a_tokenizer(path, e) from None


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of ``path`` (a ``tokenizer.json``); ``""`` gives the byte tokenizer."""
    return HFTokenizer(path) if path else ByteTokenizer()


@functools.lru_cache(maxsize=16)
def _vocab_cached(path: str, mtime_ns: int, size: int) -> int:
    return HFTokenizer(path).vocab_size


def tokenizer_vocab_size(path: str) -> int:
    """The vocabulary size of ``path`` (256 for ``""``), read once per file version."""
    if not path:
        return BYTE_VOCAB
    try:
        st = Path(path).stat()
    except OSError:
        return HFTokenizer(path).vocab_size  # raises the one-line error
    return _vocab_cached(path, st.st_mtime_ns, st.st_size)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """``vocab_size`` rounded up to a multiple of 64·tp (Megatron-LM's padding; see the module docstring)."""
    multiple = VOCAB_MULTIPLE * tp
    return -(-vocab_size // multiple) * multiple


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path) -> HFTokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens (``<|endoftext|>`` included) on ``texts`` and save it
    as a ``tokenizer.json`` at ``out``."""
    tokenizers = _tokenizers()
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise TokenizerError(f"--vocab-size {vocab_size} is smaller than the {len(alphabet)} byte tokens plus "
                             f"{EOS_TOKEN}; choose at least {len(alphabet) + 1}")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                             initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out))
    return HFTokenizer(str(out))


TOKENIZER_FILE = "tokenizer.json"
"""The name of the copy of its tokenizer that a checkpoint and prepared data keep beside their files."""
TOKENIZER_LIMIT = 2**30


@dataclass(frozen=True)
class TokenizerFile:
    """A tokenizer pinned by content (bytes read once, SHA-256, ``source`` for messages): runs and their checkpoints
    keep exactly these bytes, so a file changed later cannot change what a run trains or decodes with."""

    source: str
    data: bytes = field(repr=False)
    sha256: str

    @classmethod
    def read(cls, path: str | Path, follow: bool = True) -> "TokenizerFile":
        """The regular file ``path`` (never a FIFO or a device), refused in one line if missing. A path the
        user gave may be a symbolic link (``follow``); one a checkpoint or data index names may not."""
        try:
            data = read_regular(Path(path).resolve() if follow else Path(path), TOKENIZER_LIMIT)
        except OSError as e:
            raise TokenizerError(f"tokenizer {' '.join(str(e).split())}") from None
        return cls(str(path), data, sha256_hex(data))

    def load(self) -> "HFTokenizer":
        return HFTokenizer(self.source, self.data)

    def short(self) -> str:
        """The file and the first 12 hex digits of its SHA-256, as messages name it."""
        return f"{self.source} (SHA-256 {self.sha256[:12]})"


def tokenizer_record(pinned: TokenizerFile | None) -> dict[str, Any]:
    """What a manifest records of a tokenizer (``None``: byte tokens): the SHA-256 and size of the ``tokenizer.json``
    copy beside it (the only one read) and its source path (shown, never read)."""
    if pinned is None:
        return {"kind": "bytes"}
    return {"kind": "copy", "sha256": pinned.sha256, "bytes": len(pinned.data),
            "source": str(Path(pinned.source).resolve())}


__all__ = ["ByteTokenizer", "HFTokenizer", "TOKENIZER_FILE", "Tokenizer", "TokenizerError", "TokenizerFile",
           "load_tokenizer", "padded_vocab", "tokenizer_record", "tokenizer_vocab_size", "train_bpe"]
