"""Training data: where tokens come from and how each step's batch is drawn: local text (:mod:`.text`),
``trainmesh prepare`` into shards (:mod:`.prepare`, :mod:`.sources`, :mod:`.jsonl`, :mod:`.workers`),
memory-mapped shards (:mod:`.shards`) and each step's batch as a function of ``(seed, step)`` (:mod:`.sampler`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainmesh.data.sampler import (PackedWindows, TokenSequence, conversation_starts, document_lengths,
                                   documents_from_eos, get_batch, global_batch_offsets)
from trainmesh.data.shards import Index, ShardStream, index_tokenizer, is_prepared, read_index, verify_shard
from trainmesh.data.text import VOCAB_SIZE, DataError, load_tokens, read_bytes, stdlib_sources
from trainmesh.data.tokenizer import TokenizerFile

VAL_FRACTION = 0.05


def _enough(source: str, split: str, n: int, seq_len: int, fix: str) -> None:
    if n < seq_len + 1:
        raise DataError(f"{source} has {n} {split} tokens; training with seq_len={seq_len} needs at least "
                        f"{seq_len + 1} ({fix})")


@dataclass(frozen=True)
class TokenData:
    """Train and validation token sequences (chat data: :class:`PackedWindows`) and where they came from;
    ``note``: what the user should hear once about them (conversations cut to fit a window)."""

    train: TokenSequence | PackedWindows
    val: TokenSequence | PackedWindows
    source: str
    note: str = ""
    eos_id: int | None = None  # the end-of-document token of prepared data (None: text, no document ends)

    @classmethod
    def load(cls, path: str, seq_len: int, tokenizer: str = "", verify: bool = False) -> "TokenData":
        """The data of ``--data`` (``""``: the default corpus): prepared shards memory-mapped, else text read into
        memory; ``verify`` checks every shard's hash and ids once, before ranks start."""
        if is_prepared(path):
            return cls._prepared(path, seq_len, tokenizer, verify)
        tokens = load_tokens(path, tokenizer)
        source = path or "the Python standard library sources"
        need = 2 * (seq_len + 1)
        if len(tokens) < need:
            raise DataError(f"{source} has {len(tokens)} tokens; training with seq_len={seq_len} needs at "
                            f"least {need} (one sequence each for training and validation)")
        n_val = max(seq_len + 1, int(len(tokens) * VAL_FRACTION))
        return cls(tokens[:-n_val], tokens[-n_val:], source)

    @classmethod
    def _prepared(cls, path: str, seq_len: int, tokenizer: str, verify: bool) -> "TokenData":
        index = read_index(path)
        index_tokenizer(index, tokenizer)
        if verify:
            for shard in index.shards:
                verify_shard(index, shard)
        if index.train_on:
            return cls._chat(index, path, seq_len)
        train, val = ShardStream(index, index.split("train")), ShardStream(index, index.split("val"))
        _enough(path, "training", len(train), seq_len, "prepare more text")
        _enough(path, "held-out", len(val), seq_len, "prepare with a larger --val-fraction")
        return cls(train, val, f"{path} ({len(train):,} tokens)", eos_id=index.eos_id)

    @classmethod
    def _chat(cls, index: Index, path: str, seq_len: int) -> "TokenData":
        """Chat data: each split's conversations packed into windows of ``seq_len + 1`` tokens."""
        train, val = (PackedWindows(ShardStream(index, index.split(s)), ShardStream(index, index.split(s), labels=True),
                                    seq_len, index.eos_id) for s in ("train", "val"))
        for split, windows in (("training", train), ("held-out", val)):
            if not len(windows.windows):
                raise DataError(f"{path} has no {split} conversations; prepare more of them, or with a larger "
                                f"--val-fraction")
        cut = train.cut + val.cut
        note = (f"{cut:,} conversation(s) of {path} are longer than a window of seq_len + 1 = {seq_len + 1} tokens; "
                f"each is cut into windows of that length" if cut else "")
        return cls(train, val, f"{path} ({len(train.windows):,} windows of chat, {index.train_on} tokens trained)",
                   note)


def document_mix(path: str) -> tuple[int, ...]:
    """The lengths of the documents (chat data: conversations) at the start of prepared data's training split, the
    mix a document-masked step attends over; refused in one line for data with no document ends."""
    if not is_prepared(path):
        raise DataError(f"{path or 'the default corpus'} is not prepared data, so it has no document ends; give "
                        f"a directory `trainmesh prepare` wrote, or the lengths as N,N,...")
    index = read_index(path)
    tokens = ShardStream(index, index.split("train"))
    if not index.train_on:
        return document_lengths(tokens, index.eos_id)
    starts = conversation_starts(ShardStream(index, index.split("train"), labels=True))
    return tuple(np.diff(starts, append=len(tokens))[:1 << 14].tolist())


def data_vocab_size(path: str, tokenizer: str) -> int | None:
    """The vocabulary the data's ids come from: the index's for prepared data, the tokenizer's for text
    with ``--tokenizer``; None for bytes (the model preset's vocabulary stands)."""
    if is_prepared(path):
        return read_index(path).vocab_size
    if tokenizer:
        from trainmesh.data.tokenizer import tokenizer_vocab_size

        return tokenizer_vocab_size(tokenizer)
    return None


def pin_tokenizer(path: str, tokenizer: str) -> TokenizerFile | None:
    """The run's tokenizer pinned by content (None: bytes): ``--tokenizer`` checked against what prepared data ``path``
    records (:func:`~trainmesh.data.shards.index_tokenizer`), else that one; read once, copied into checkpoints."""
    if is_prepared(path):
        return index_tokenizer(read_index(path), tokenizer)
    return TokenizerFile.read(tokenizer) if tokenizer else None


__all__ = ["DataError", "PackedWindows", "TokenData", "TokenSequence", "VOCAB_SIZE", "data_vocab_size",
           "document_lengths", "document_mix", "documents_from_eos", "get_batch", "is_prepared", "pin_tokenizer",
           "global_batch_offsets", "load_tokens", "read_bytes", "stdlib_sources"]
