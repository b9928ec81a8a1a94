"""The sampler that hands each data-parallel rank its slice of a global batch.

Step s's batch depends on ``(seed, s)`` alone (packed windows across document ends, as GPT-2 and Megatron-LM; chat
data in :class:`PackedWindows`, whole conversations); a rank takes a contiguous slice, so every layout sees one
process's batch and resuming needs only ``s``."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from trainmesh.data.chat import START, TRAINED
from trainmesh.training.loss import IGNORE_INDEX

SCAN_TOKENS = 1 << 24


class TokenSequence(Protocol):
    """A tensor of token ids, or :class:`trainmesh.data.shards.ShardStream`: a length and slices."""

    def __len__(self) -> int: ...

    def __getitem__(self, window: slice) -> Any: ...


def _draw(high: int, global_batch: int, seed: int, step: int) -> torch.Tensor:
    """``global_batch`` integers below ``high`` that depend on ``(seed, step)`` alone; the seed is taken modulo
    2**64, as ``manual_seed`` accepts."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**64)
    return torch.randint(0, high, (global_batch,), generator=gen)


def global_batch_offsets(n_tokens: int, seq_len: int, global_batch: int, seed: int, step: int) -> torch.Tensor:
    """Start offsets of ``step``'s ``global_batch`` sequences, the same in every layout."""
    return _draw(n_tokens - seq_len, global_batch, seed, step)


def _mine(drawn: torch.Tensor, dp_rank: int, dp_size: int) -> list[int]:
    per_rank = len(drawn) // dp_size
    return drawn[dp_rank * per_rank:(dp_rank + 1) * per_rank].tolist()


class PackedWindows:
    """Chat data as windows of ``seq_len + 1`` tokens, each whole conversations in data order, packed greedily:
    a conversation that does not fit in what is left of a window starts the next one, and one longer than a window
    is cut into windows of its own (:attr:`cut` counts them). A window's rest is padding, never trained."""

    def __init__(self, tokens: TokenSequence, labels: TokenSequence, seq_len: int, pad_id: int) -> None:
        self.tokens, self.labels, self.seq_len, self.pad_id = tokens, labels, seq_len, pad_id
        self.windows, self.cut = pack(conversation_starts(labels), len(tokens), seq_len + 1)

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, global_batch: int, seed: int, step: int, dp_rank: int = 0,
              dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This data-parallel rank's slice of ``step``'s global batch of windows: inputs, targets (untrained ones
        -100) and documents (each input token's conversation within its window, from 0; padding one more)."""
        rows = [self.window(int(self.windows[k, 0]), int(self.windows[k, 1]))
                for k in _mine(_draw(len(self.windows), global_batch, seed, step), dp_rank, dp_size)]
        return tuple(torch.stack([torch.from_numpy(r[i]) for r in rows]) for i in range(3))

    def window(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One window's inputs, targets and documents from tokens ``start:stop`` of the stream, padded."""
        size = self.seq_len + 1
        ids = np.full(size, self.pad_id, dtype=np.int64)
        labels = np.zeros(size, dtype=np.int64)
        ids[:stop - start], labels[:stop - start] = self.tokens[start:stop], self.labels[start:stop]
        opens = (labels & START) != 0
        opens[0] = False  # a window cut from a long conversation opens with its first document all the same
        opens[stop - start:] = False
        opens[min(stop - start, size - 1)] = True  # the padding, a document of its own
        targets = np.where(((labels & TRAINED) != 0) & ((labels & START) == 0), ids, IGNORE_INDEX)
        return ids[:-1], targets[1:], np.cumsum(opens)[:-1]


def conversation_starts(labels: TokenSequence) -> np.ndarray:
    """The stream offsets of the tokens that open a conversation, read in bounded parts."""
    parts = [np.flatnonzero(labels[at:at + SCAN_TOKENS] & START) + at for at in range(0, len(labels), SCAN_TOKENS)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def pack(starts: np.ndarray, n_tokens: int, size: int) -> tuple[np.ndarray, int]:
    """Greedy packing of the conversations opening at ``starts`` (of a stream of ``n_tokens``) into windows of at
    most ``size`` tokens: ``[n, 2]`` (start, stop) spans of the stream, and how many conversations were cut (into
    whole windows, the rest of the conversation opening the next window)."""
    windows, cut, open_at = [], 0, None  # open_at: where the window being filled starts
    for start, stop in zip(starts.tolist(), [*starts[1:].tolist(), n_tokens]):
        if open_at is not None and stop - open_at > size:
            windows.append((open_at, start))
            open_at = None
        if stop - start > size:
            cut += 1
            whole = (stop - start) // size
            windows += [(start + k * size, start + (k + 1) * size) for k in range(whole)]
            start += whole * size
        if open_at is None and start < stop:
            open_at = start
    if open_at is not None:
        windows.append((open_at, n_tokens))
    return np.array(windows, dtype=np.int64).reshape(-1, 2), cut


def get_batch(tokens: TokenSequence | PackedWindows, seq_len: int, global_batch: int, seed: int, step: int,
              dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, ...]:
    """This data-parallel rank's contiguous slice of the global batch: inputs and next-token targets (and, for
    chat data, :meth:`PackedWindows.batch`'s documents)."""
    if isinstance(tokens, PackedWindows):
        if seq_len != tokens.seq_len:
            raise ValueError(f"these chat windows were packed for seq_len={tokens.seq_len}, not {seq_len}")
        return tokens.batch(global_batch, seed, step, dp_rank, dp_size)
    mine = _mine(global_batch_offsets(len(tokens), seq_len, global_batch, seed, step), dp_rank, dp_size)
    window = torch.stack([torch.as_tensor(tokens[o:o + seq_len + 1]) for o in mine]).long()
    return window[:, :-1], window[:, 1:]


def documents_from_eos(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Each input token's document index in its window (``[batch, seq]``, from 0, non-decreasing): a document
    begins after every end-of-document token, which ``prepare`` writes after each document and which belongs to the
    document it ends. A window's first document is often the tail of one begun before it."""
    ends = (inputs == eos_id).long()
    return ends.cumsum(1) - ends


def document_lengths(tokens: TokenSequence, eos_id: int, limit: int = 1 << 20) -> tuple[int, ...]:
    """The lengths of the whole documents among the first ``limit`` tokens (each with its end-of-document token):
    the mix the planner prices a document-masked step by."""
    head = torch.as_tensor(tokens[0:min(len(tokens), limit)]).long()
    ends = (head == eos_id).nonzero().flatten()
    return tuple(torch.diff(ends, prepend=ends.new_tensor([-1])).tolist())
