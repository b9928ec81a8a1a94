"""Packed documents: the micro-batch being computed, when its windows hold several documents, as a context that
attention cores and position modules read, so attention stays inside each document and positions restart at each.

Why a context and not a forward argument: the training step sets it once per micro-batch (:func:`packed`) around the
forward and the backward of that micro-batch, so it reaches every pipeline stage, every block a recomputation redoes
in backward, and the cp attention that replaced a core, without threading an argument through the stage contract,
the blocks and Hugging Face's modules (Megatron's ``packed_seq_params`` reach its layers the same way). Outside
:func:`packed` (decoding, a plain forward) nothing changes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packing:
    """One micro-batch's documents. ``documents``: ``[batch, seq]`` document index (non-decreasing, from 0) of every
    position of the *whole* sequence, in natural order; ``positions``: ``[batch, t]`` each token's position in its
    document, for the tokens this rank's model computes, in the order it holds them; ``shards``: under context
    parallelism, the start of every chunk (of ``chunk`` tokens) each cp rank holds, read only by cp attention."""

    documents: torch.Tensor
    positions: torch.Tensor
    shards: tuple[tuple[int, ...], ...] = ()
    chunk: int = 0


_current: list[Packing] = []


@contextlib.contextmanager
def packed(packing: Packing | None = None) -> Iterator[None]:
    """Compute inside ``packing``'s documents (None: as one document per sequence, the unchanged path)."""
    if packing is None:
        yield
        return
    _current.append(packing)
    try:
        yield
    finally:
        _current.pop()


def current() -> Packing | None:
    """The packing of the micro-batch being computed, None outside :func:`packed`."""
    return _current[-1] if _current else None


def current_documents() -> torch.Tensor | None:
    """``[batch, seq]`` document index of every position, for an attention core (None: one document)."""
    packing = current()
    return None if packing is None else packing.documents


def token_positions(start: int, length: int, device: torch.device) -> torch.Tensor:
    """Position ids of the ``length`` tokens computed now: each token's place in its document (``[batch, length]``)
    inside :func:`packed`, else ``start .. start + length - 1`` (``start`` > 0 when a cache holds earlier ones)."""
    packing = current()
    if packing is None:
        return torch.arange(start, start + length, device=device)
    return packing.positions.to(device)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each position's place in its document, from ``[batch, seq]`` non-decreasing document indices: its index
    less that of its document's first position."""
    seq = documents.shape[-1]
    first = torch.searchsorted(documents.contiguous(), documents.contiguous())
    return torch.arange(seq, device=documents.device) - first
