"""Exact causal attention that computes only the blocks of scores a sliding window and document boundaries leave
visible: each block of query rows runs one fused kernel call over just the keys its rows can see (from its first
row's earliest key to its last row), masked within that band. On CPU the calls run PyTorch's flash kernel, which
also yields each row's log-sum-exp (what attention sinks need); elsewhere an explicit form of the same kernel."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """One kernel call: batch ``rows``, the queries at key positions ``queries`` over the keys at ``keys`` (both
    [start, end)), key j visible to query i iff ``i - window < j <= i``."""

    rows: slice
    queries: tuple[int, int]
    keys: tuple[int, int]


def region_pieces(rows: slice, region: tuple[int, int], first_query: int, window: int | None,
                  block: int) -> list[Piece]:
    """The pieces of the queries from ``first_query`` to the end of ``region`` (key positions of one document, or
    of the whole sequence), ``block`` at a time, each over the region's keys from its first query's window start
    to its last query: (window + block - 1) keys a row rather than the region's whole prefix."""
    start, end = region
    reach = window or end - start
    return [Piece(rows, (s, min(s + block, end)), (max(start, s - reach + 1), min(s + block, end)))
            for s in range(max(start, first_query), end, block)]


def attention_pieces(q_len: int, k_len: int, window: int | None, block: int,
                     documents: torch.Tensor | None) -> list[Piece]:
    """Every piece of causal attention for queries at the last ``q_len`` of ``k_len`` positions: one region over
    all batch rows, or, given ``documents`` (``[batch, k_len]``, non-decreasing document index of each key
    position), a region per document, shared by consecutive rows of the same layout."""
    first = k_len - q_len
    if documents is None:
        return region_pieces(slice(None), (0, k_len), first, window, block)
    pieces, row = [], 0
    for regions, rows in itertools.groupby(_documents(line) for line in documents):
        count = len(list(rows))
        for region in regions:
            pieces += region_pieces(slice(row, row + count), region, first, window, block)
        row += count
    return pieces


def _documents(documents: torch.Tensor) -> list[tuple[int, int]]:
    """The [start, end) positions of each run of one document index along a row."""
    ends = list(itertools.accumulate(torch.unique_consecutive(documents, return_counts=True)[1].tolist()))
    return list(zip([0] + ends[:-1], ends))


def _mask(shape: tuple[int, int, int], window: int | None, dtype: torch.dtype,
          device: torch.device) -> torch.Tensor | None:
    """The additive mask (0 where visible, -inf elsewhere) of a piece of ``shape`` (its first query's offset past
    its first key, its queries, its keys), or None where its rows see all its keys."""
    offset, queries, keys = shape
    i = torch.arange(offset, offset + queries, device=device)[:, None]
    j = torch.arange(keys, device=device)
    hidden = (j > i) | (j <= i - window) if window is not None else j > i
    if not hidden.any():
        return None
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill(hidden, float("-inf"))


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask)


def _flash_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, False,
                                                                                attn_mask=mask)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores if mask is None else scores + mask


def _explicit_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The flash kernel's outputs spelled out: softmax(scores) @ v and each row's log-sum-exp."""
    scores = _scores(q, k, mask)
    lse = scores.logsumexp(-1)
    return (scores - lse.unsqueeze(-1)).exp() @ v, lse


def _explicit_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The flash kernel's backward spelled out [Dao, FlashAttention-2, 2023, 3.1]: P from ``lse``,
    dS = P * (grad @ v^T - rowsum(grad * out)), then the three products."""
    probs = (_scores(q, k, mask) - lse.unsqueeze(-1)).exp()
    dscores = probs * (grad @ v.transpose(-1, -2) - (grad * out).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    return dscores @ k, dscores.transpose(-1, -2) @ q, probs.transpose(-1, -2) @ grad


KERNELS: dict[str, tuple[Callable, Callable]] = {"cpu": (_flash_forward, _flash_backward)}


def _kernels(q: torch.Tensor, v: torch.Tensor) -> tuple[Callable, Callable]:
    """The fused kernel pair of the tensors' device type, else (or for value heads of their own width, as latent
    attention's, which the fused kernel refuses) the explicit one."""
    explicit = (_explicit_forward, _explicit_backward)
    return KERNELS.get(q.device.type, explicit) if q.shape[-1] == v.shape[-1] else explicit


class _Call:
    """A piece's slices of the full tensors (its queries' rows, its keys' rows) and its mask."""

    def __init__(self, piece: Piece, offset: int, mask: torch.Tensor | None) -> None:
        self.queries = (piece.rows, slice(None), slice(piece.queries[0] - offset, piece.queries[1] - offset))
        self.keys = (piece.rows, slice(None), slice(*piece.keys))
        self.mask = mask


def _calls(pieces: list[Piece], offset: int, window: int | None, dtype: torch.dtype,
           device: torch.device) -> list[_Call]:
    """Each piece's call, one mask per geometry (every block inside a window's reach has the same)."""
    masks: dict[tuple[int, int, int], torch.Tensor | None] = {}
    calls = []
    for p in pieces:
        shape = (p.queries[0] - p.keys[0], p.queries[1] - p.queries[0], p.keys[1] - p.keys[0])
        if shape not in masks:
            masks[shape] = _mask(shape, window, dtype, device)
        calls.append(_Call(p, offset, masks[shape]))
    return calls


class BlockedAttention(torch.autograd.Function):
    """Forward: each piece's kernel, its output and log-sum-exp written to its query rows, then each head's sink
    logit (if any) added to the denominator. Backward: each piece's kernel backward, the key gradients of
    overlapping bands summed."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                pieces: list[Piece], window: int | None) -> torch.Tensor:
        forward_kernel = _kernels(q, v)[0]
        calls = _calls(pieces, k.shape[2] - q.shape[2], window, q.dtype, q.device)
        out = q.new_empty((*q.shape[:3], v.shape[-1]))
        lse = q.new_empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))
        for call in calls:
            out[call.queries], lse[call.queries] = forward_kernel(q[call.queries], k[call.keys], v[call.keys],
                                                                  call.mask)
        if sinks is not None:  # a logit with no value: scale each row by its share of the larger denominator
            sunk = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
            out, lse = (out * (lse - sunk).exp().unsqueeze(-1)).to(q.dtype), sunk
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.calls = calls
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grad = grad.contiguous()  # once, rather than by each piece's kernel
        backward_kernel = _kernels(q, v)[1]
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for call in ctx.calls:
            dq[call.queries], part_k, part_v = backward_kernel(
                grad[call.queries], q[call.queries], k[call.keys], v[call.keys], out[call.queries],
                lse[call.queries], call.mask)
            dk[call.keys] += part_k
            dv[call.keys] += part_v
        sink_grad = None
        if sinks is not None:  # d out / d sink = -out * exp(sink - lse), lse including the sink
            share = (sinks.to(lse.dtype).view(1, -1, 1) - lse).exp()
            sink_grad = -(share * (grad * out).sum(-1)).sum((0, 2)).to(sinks.dtype)
        return dq, dk, dv, sink_grad, None, None


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, block: int,
                      documents: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the queries at the last ``q.shape[2]`` key positions over ``window`` keys and their own
    document, with per-head ``sinks`` logits in the denominator, as :class:`BlockedAttention` computes it."""
    pieces = attention_pieces(q.shape[2], k.shape[2], window, block, documents)
    return BlockedAttention.apply(q, k, v, sinks, pieces, window)
