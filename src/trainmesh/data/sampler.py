"""The sampler that hands each data-parallel rank its slice of a global batch.

Step s's batch depends on ``(seed, s)`` alone (packed windows across document ends, as GPT-2 and Megatron-LM); a rank
takes a contiguous slice, so every layout sees one process's batch and resuming needs only ``s``."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class TokenSequence(Protocol):
    """A tensor of token ids, or :class:`trainmesh.data.shards.ShardStream`: a length and slices."""

    def __len__(self) -> int: ...

    def __getitem__(self, window: slice) -> Any: ...


def global_batch_offsets(n_tokens: int, seq_len: int, global_batch: int, seed: int, step: int) -> torch.Tensor:
    """Start offsets of ``step``'s ``global_batch`` sequences, the same in every layout; the seed is taken modulo
    2**64, as ``manual_seed`` accepts."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**64)
    return torch.randint(0, n_tokens - seq_len, (global_batch,), generator=gen)


def get_batch(tokens: TokenSequence, seq_len: int, global_batch: int, seed: int, step: int,
              dp_rank: int = 0, dp_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's contiguous slice of the global batch: inputs and next-token targets."""
    offsets = global_batch_offsets(len(tokens), seq_len, global_batch, seed, step)
    per_rank = global_batch // dp_size
    mine = offsets[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    window = torch.stack([torch.as_tensor(tokens[o:o + seq_len + 1]) for o in mine.tolist()]).long()
    return window[:, :-1], window[:, 1:]


def documents_from_eos(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Each input token's document index in its window (``[batch, seq]``, from 0, non-decreasing): a document
    begins after every end-of-document token, which ``prepare`` writes after each document and which belongs to the
    document it ends. A window's first document is often the tail of one begun before it."""
    ends = (inputs == eos_id).long()
    return ends.cumsum(1) - ends
