"""Byte-level text data and the sampler that hands each data-parallel rank its slice of a global batch.

The default corpus is this Python's own standard-library source, which is on every machine that runs
trainmesh, so a first run needs no download. Tokens are bytes (vocabulary 256), which needs no trained
tokenizer and accepts any file.

The global batch of step ``s`` is a function of ``(seed, s)`` alone: offsets drawn from a generator
seeded with both. A data-parallel rank takes a contiguous slice of that batch, so every layout sees the
same global batch a single process would see, and resuming at step ``s`` needs no loader state beyond
``s`` itself.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB_SIZE = 256
DEFAULT_CORPUS_BYTES = 16 * 2**20
VAL_FRACTION = 0.05


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


def _files_under(path: Path) -> list[Path]:
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


def read_bytes(files: list[Path], max_bytes: int | None = None, skip_invalid: bool = False) -> bytes:
    """Concatenated contents of ``files``, which must be UTF-8 text: a binary file passed by mistake
    would otherwise be trained on silently. ``skip_invalid`` drops such files instead (the default
    corpus holds a few deliberately mis-encoded test files)."""
    chunks, total = [], 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read {f}: {e.strerror}") from None
        bad = _utf8_error(data)
        if bad is not None:
            if skip_invalid:
                continue
            raise DataError(f"{f} is not UTF-8 text (invalid byte 0x{data[bad]:02x} at offset {bad}); "
                            f"convert it to UTF-8 or leave it out of --data")
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def load_tokens(path: str = "") -> torch.Tensor:
    """All tokens of ``path`` (a file or directory; empty: the default corpus) as a uint8 tensor."""
    if path:
        raw = read_bytes(_files_under(Path(path)))
    else:
        raw = read_bytes(stdlib_sources(), DEFAULT_CORPUS_BYTES, skip_invalid=True)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True)
class TokenData:
    """Train and validation token streams; validation is the last ``VAL_FRACTION`` of the corpus."""

    train: torch.Tensor
    val: torch.Tensor
    source: str

    @classmethod
    def load(cls, path: str, seq_len: int) -> "TokenData":
        tokens = load_tokens(path)
        source = path or "the Python standard library sources"
        need = 2 * (seq_len + 1)
        if len(tokens) < need:
            raise DataError(f"{source} has {len(tokens)} bytes; training with seq_len={seq_len} needs at "
                            f"least {need} (one sequence each for training and validation)")
        n_val = max(seq_len + 1, int(len(tokens) * VAL_FRACTION))
        return cls(tokens[:-n_val], tokens[-n_val:], source)


def global_batch_offsets(n_tokens: int, seq_len: int, global_batch: int, seed: int, step: int) -> torch.Tensor:
    """Start offsets of the ``global_batch`` sequences of ``step``: the same in every layout."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n_tokens - seq_len, (global_batch,), generator=gen)


def get_batch(tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int, step: int,
              dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's contiguous slice of the global batch: inputs and next-token targets."""
    offsets = global_batch_offsets(len(tokens), seq_len, global_batch, seed, step)
    per_rank = global_batch // dp_size
    mine = offsets[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    window = torch.stack([tokens[o:o + seq_len + 1] for o in mine.tolist()]).long()
    return window[:, :-1], window[:, 1:]
