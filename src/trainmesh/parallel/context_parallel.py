"""Context parallelism: each sequence split over the ``cp`` axis, attention computed across the split.

``ring`` (Liu et al., 2023, Ring Attention; Megatron-core's p2p CP) passes K/V blocks round and merges partial
results by log-sum-exp (online softmax; Dao et al., 2022, Alg. 1) in at least fp32; ``a2a`` (DeepSpeed-Ulysses,
Jacobs et al., 2023) trades the sequence split for a head split. Rank r holds chunks r and 2·cp−1−r of 2·cp
(Megatron-core's causal balance); position ids stay global; ``ModelSpec.cp_plan`` names the modules. A micro-batch of
packed documents (:mod:`trainmesh.models.documents`) is cut into ``CHUNKS_PER_RANK`` chunks a rank instead, dealt out
by :func:`balanced_shards` so every rank computes as many attention blocks; attention stays within documents."""

from __future__ import annotations

import contextlib
import fnmatch
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from trainmesh.distributed.comm import Comm
from trainmesh.models.documents import current, current_documents
from trainmesh.layout import CP_IMPLS

AXIS = "cp"

Starts = Sequence[int]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# --- which tokens a rank holds -----------------------------------------------------------------------

def chunk_starts(seq_len: int, cp: int, rank: int) -> list[int]:
    """Global start positions of the two chunks (of ``seq_len / (2·cp)`` tokens) cp rank ``rank`` holds."""
    size = seq_len // (2 * cp)
    return [rank * size, (2 * cp - 1 - rank) * size]


def local_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the tokens cp rank ``rank`` holds, in the order it holds them."""
    size = seq_len // (2 * cp)
    return torch.cat([torch.arange(s, s + size) for s in chunk_starts(seq_len, cp, rank)])


CHUNKS_PER_RANK = 8
"""Chunks of a packed micro-batch each cp rank holds: with more, balancing has more freedom but the ring more, smaller
blocks to compute."""


def held_positions(starts: Starts, chunk: int) -> torch.Tensor:
    """Global positions of the tokens of the chunks (of ``chunk`` tokens) at ``starts``, in that order."""
    return torch.cat([torch.arange(s, s + chunk) for s in starts])


def _documents_meet(documents: torch.Tensor, q_start: int, q_len: int, k_start: int, k_len: int) -> bool:
    """Whether, in some sequence, a document has tokens in both segments (documents are non-decreasing, so each
    segment holds one range of them)."""
    low = torch.maximum(documents[:, q_start], documents[:, k_start])
    high = torch.minimum(documents[:, q_start + q_len - 1], documents[:, k_start + k_len - 1])
    return bool((low <= high).any())


def chunk_work(documents: torch.Tensor, chunk: int) -> list[int]:
    """For each chunk of ``chunk`` positions of ``[batch, seq]`` documents, the key chunks its queries see (causal,
    within documents): the blocks ring attention computes for it, the counted work :func:`balanced_shards` balances."""
    first, last = documents[:, ::chunk], documents[:, chunk - 1::chunk]  # [batch, chunks]: each one's document range
    meet = (torch.maximum(first[:, :, None], first[:, None]) <= torch.minimum(last[:, :, None], last[:, None])).any(0)
    return meet.tril().sum(1).tolist()


def balanced_shards(documents: torch.Tensor, cp: int,
                    per_rank: int = CHUNKS_PER_RANK) -> tuple[tuple[tuple[int, ...], ...], int]:
    """(each cp rank's chunk starts, the chunk size) for a micro-batch of packed ``documents``: ``per_rank`` chunks
    a rank (fewer where the sequence does not cut into as many), dealt heaviest first to the least loaded rank with room
    (LPT under equal counts): ranks hold equal tokens, so losses need no reweighting, and near-equal work."""
    seq = documents.shape[1]
    per_rank = max(n for n in range(1, per_rank + 1) if seq % (n * cp) == 0)
    chunk = seq // (per_rank * cp)
    work = chunk_work(documents, chunk)
    loads, held = [0] * cp, [[] for _ in range(cp)]
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        rank = min((r for r in range(cp) if len(held[r]) < per_rank), key=lambda r: (loads[r], r))
        held[rank].append(i * chunk)
        loads[rank] += work[i]
    return tuple(tuple(sorted(h)) for h in held), chunk


def _starts(seq_len: int, cp: int, rank: int) -> Starts:
    """The chunk starts ``rank`` holds: the packed micro-batch's balanced shards, else the head-tail pair."""
    packing = current()
    return packing.shards[rank] if packing is not None and packing.shards else chunk_starts(seq_len, cp, rank)


def _held(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the tokens ``rank`` holds, as :func:`_starts` deals them."""
    packing = current()
    if packing is not None and packing.shards:
        return held_positions(packing.shards[rank], packing.chunk)
    return local_positions(seq_len, cp, rank)


# --- blockwise attention with log-sum-exp merging ----------------------------------------------------

def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _mask(q_start: int, q_len: int, k_start: int, k_len: int, causal: bool, device: torch.device,
          window: int | None = None, documents: torch.Tensor | None = None,
          host: torch.Tensor | None = None) -> torch.Tensor | None | bool:
    """Visibility of a key segment to a query segment: False (skip the pair), None (all visible) or a boolean
    ``[q_len, k_len]`` causal (and ``window``) mask, as :func:`trainmesh.models.cache.causal_attention` masks; with
    ``documents`` (``[batch, seq]``) pairs no document spans are skipped and the mask is ``[batch, 1, 1, q, k]``,
    also within each query's document (``host``: a CPU copy of ``documents`` to test the skip on, without a device
    sync)."""
    if documents is None:
        return _causal_mask(q_start, q_len, k_start, k_len, causal, device, window)
    if not _documents_meet(documents if host is None else host, q_start, q_len, k_start, k_len):
        return False
    mask = _causal_mask(q_start, q_len, k_start, k_len, causal, device, window)
    if mask is False:
        return False
    same = documents[:, q_start:q_start + q_len, None] == documents[:, None, k_start:k_start + k_len]
    return (same if mask is None else same & mask)[:, None, None]


def _causal_mask(q_start: int, q_len: int, k_start: int, k_len: int, causal: bool, device: torch.device,
                 window: int | None) -> torch.Tensor | None | bool:
    """:func:`_mask` of one sequence of one document."""
    if not causal or (k_start + k_len - 1 <= q_start and (window is None or k_start > q_start + q_len - 1 - window)):
        return None
    if k_start > q_start + q_len - 1 or (window is not None and k_start + k_len - 1 <= q_start - window):
        return False
    q_pos = torch.arange(q_start, q_start + q_len, device=device).unsqueeze(1)
    k_pos = torch.arange(k_start, k_start + k_len, device=device).unsqueeze(0)
    return (k_pos <= q_pos) & (k_pos > q_pos - window) if window is not None else k_pos <= q_pos


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[b, h, t, d]`` queries as ``[b, kv_heads, h/kv_heads, t, d]``: query head j uses key head j // group."""
    b, h, t, d = q.shape
    return q.view(b, kv_heads, h // kv_heads, t, d)


def _scores(q5: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    s = (q5 @ k.unsqueeze(2).transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


class Accumulator:
    """Running softmax attention of one query segment (output as wide as a value head, lse); merging a block rescales
    both sides by ``exp(lse_side - logaddexp(lse, lse_block))``: the online softmax, exact in exact arithmetic."""

    def __init__(self, q5: torch.Tensor, width: int) -> None:
        self.out = torch.zeros((*q5.shape[:-1], width), dtype=_wide(q5.dtype), device=q5.device)
        self.lse = torch.full(q5.shape[:-1], float("-inf"), dtype=_wide(q5.dtype), device=q5.device)

    def merge(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        new = torch.logaddexp(self.lse, lse)
        safe = new.masked_fill(new == float("-inf"), 0.0)
        self.out = self.out * (self.lse - safe).exp().unsqueeze(-1) + out * (lse - safe).exp().unsqueeze(-1)
        self.lse = new


def block_forward(q5: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of grouped queries ``q5`` over one key/value block: (output, lse), both wide."""
    wide = _wide(q5.dtype)
    s = _scores(q5.to(wide), k.to(wide), mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = (s - lse.masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1)).exp()
    return p @ v.to(wide).unsqueeze(2), lse


def block_backward(q5: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   dout5: torch.Tensor, delta: torch.Tensor,
                   lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq5, dk, dv) of one block's part of the attention, from the *final* lse of the queries and
    ``delta = rowsum(dout · out)`` (Dao et al., 2022, Alg. 2; all wide)."""
    wide = _wide(q5.dtype)
    q5, k, v = q5.to(wide), k.to(wide), v.to(wide)
    p = (_scores(q5, k, mask, scale) - lse.unsqueeze(-1)).exp()
    dv = (p.transpose(-1, -2) @ dout5).sum(2)
    ds = p * (dout5 @ v.unsqueeze(2).transpose(-1, -2) - delta.unsqueeze(-1))
    dq5 = (ds @ k.unsqueeze(2)) * scale
    dk = (ds.transpose(-1, -2) @ q5).sum(2) * scale
    return dq5, dk, dv


def _segments(x: torch.Tensor, starts: Starts) -> list[tuple[torch.Tensor, int]]:
    """``x`` cut along the sequence (dim -2) into ``len(starts)`` equal contiguous segments, with their starts."""
    return list(zip(x.chunk(len(starts), dim=-2), starts))


def _pairs(q5: torch.Tensor, q_starts: Starts, k: torch.Tensor, v: torch.Tensor, k_starts: Starts, causal: bool,
           window: int | None = None, documents: torch.Tensor | None = None):
    """Every (query segment index, its q, key segment k, v, mask, key segment index) that sees something."""
    q_len, k_len = q5.shape[-2] // len(q_starts), k.shape[-2] // len(k_starts)
    host = None if documents is None else documents.cpu()
    for i, (qs, q0) in enumerate(_segments(q5, q_starts)):
        for j, ((ks, k0), (vs, _)) in enumerate(zip(_segments(k, k_starts), _segments(v, k_starts))):
            mask = _mask(q0, q_len, k0, k_len, causal, q5.device, window, documents, host)
            if mask is not False:
                yield i, qs, ks, vs, mask, j


def attend_block(accs: list[Accumulator], q5: torch.Tensor, q_starts: Starts, k: torch.Tensor, v: torch.Tensor,
                 k_starts: Starts, causal: bool, scale: float, window: int | None = None,
                 documents: torch.Tensor | None = None) -> None:
    """Merge the attention of every query segment to one key/value block into ``accs`` (fully masked
    segment pairs are skipped)."""
    for i, qs, ks, vs, mask, _ in _pairs(q5, q_starts, k, v, k_starts, causal, window, documents):
        accs[i].merge(*block_forward(qs, ks, vs, mask, scale))


def block_grads(q5: torch.Tensor, q_starts: Starts, k: torch.Tensor, v: torch.Tensor, k_starts: Starts,
                causal: bool, scale: float, dout5: torch.Tensor, delta: torch.Tensor,
                lse: torch.Tensor, window: int | None = None,
                documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq5, dk, dv) contributed by one key/value block, wide; the inverse of :func:`attend_block`."""
    wide = _wide(q5.dtype)
    dq = torch.zeros(q5.shape, dtype=wide, device=q5.device)
    dk = torch.zeros(k.shape, dtype=wide, device=k.device)
    dv = torch.zeros(v.shape, dtype=wide, device=v.device)
    dq_segs, dk_segs, dv_segs = (x.chunk(n, dim=-2) for x, n in ((dq, len(q_starts)), (dk, len(k_starts)),
                                                                 (dv, len(k_starts))))
    dout_segs, delta_segs, lse_segs = (x.chunk(len(q_starts), dim=-1 if x.dim() == 4 else -2)
                                       for x in (dout5, delta, lse))
    for i, qs, ks, vs, mask, j in _pairs(q5, q_starts, k, v, k_starts, causal, window, documents):
        g_q, g_k, g_v = block_backward(qs, ks, vs, mask, scale, dout_segs[i], delta_segs[i], lse_segs[i])
        dq_segs[i].add_(g_q)
        dk_segs[j].add_(g_k)
        dv_segs[j].add_(g_v)
    return dq, dk, dv


def _finish(accs: list[Accumulator]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([a.out for a in accs], dim=-2), torch.cat([a.lse for a in accs], dim=-1)


def _ungroup(x5: torch.Tensor) -> torch.Tensor:
    b, hk, g, t, d = x5.shape
    return x5.reshape(b, hk * g, t, d)


class _Blockwise(torch.autograd.Function):
    """Attention of ``q`` over key/value blocks one at a time: the ring's arithmetic without the ring, checkable
    against one SDPA; blocks are separate arguments (``k_1..k_n, v_1..v_n``) so autograd gives each its gradient."""

    @staticmethod
    def forward(ctx, q, q_starts, k_starts, causal, window, *kv):
        n = len(kv) // 2
        scale = 1 / math.sqrt(q.shape[-1])
        q5 = _grouped(q, kv[0].shape[1])
        accs = [Accumulator(s, kv[n].shape[-1]) for s, _ in _segments(q5, q_starts)]
        for k, v, starts in zip(kv[:n], kv[n:], k_starts):
            attend_block(accs, q5, q_starts, k, v, starts, causal, scale, window)
        out, lse = _finish(accs)
        ctx.save_for_backward(q, out, lse, *kv)
        ctx.args = (q_starts, k_starts, causal, scale, n, window)
        return _ungroup(out).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, *kv = ctx.saved_tensors
        q_starts, k_starts, causal, scale, n, window = ctx.args
        q5, dout5 = _grouped(q, kv[0].shape[1]), _grouped(dout, kv[0].shape[1]).to(out.dtype)
        delta = (dout5 * out).sum(-1)
        dq, dks, dvs = torch.zeros(q5.shape, dtype=out.dtype, device=q.device), [], []
        for k, v, starts in zip(kv[:n], kv[n:], k_starts):
            g_q, g_k, g_v = block_grads(q5, q_starts, k, v, starts, causal, scale, dout5, delta, lse, window)
            dq += g_q
            dks.append(g_k.to(k.dtype))
            dvs.append(g_v.to(v.dtype))
        return (_ungroup(dq).to(q.dtype), None, None, None, None, *dks, *dvs)


def blockwise_attention(q: torch.Tensor, k_blocks: Sequence[torch.Tensor], v_blocks: Sequence[torch.Tensor],
                        q_starts: Starts, k_starts: Sequence[Starts], causal: bool = True,
                        window: int | None = None) -> torch.Tensor:
    """Attention of ``q`` ``[b, h, t, d]`` (segments from ``q_starts``) over key/value blocks ``[b, kv_heads, s, d]``
    (from ``k_starts[i]``), merged by log-sum-exp, backward by :func:`block_grads`; ``window`` as the ring's."""
    return _Blockwise.apply(q, q_starts, k_starts, causal, window, *k_blocks, *v_blocks)


# --- the ring ------------------------------------------------------------------------------------------

@dataclass
class RingTimeline:
    """Seconds each ring step spent computing and then waiting for the next block (the transfer compute did not hide);
    backward's extra step ``cp`` is the wait for the key/value gradients to come home."""

    events: list[tuple[str, int, str, float]] = field(default_factory=list)  # (pass, step, kind, seconds)

    def total(self, kind: str, phase: str | None = None) -> float:
        """Seconds of ``kind`` (``compute`` or ``wait``), in ``phase`` (``forward``/``backward``) or both."""
        return sum(s for p, _, k, s in self.events if k == kind and phase in (None, p))


@contextlib.contextmanager
def _timed(timeline: RingTimeline | None, phase: str, step: int, kind: str) -> Iterator[None]:
    if timeline is None:
        yield
        return
    start = time.perf_counter()
    yield
    timeline.events.append((phase, step, kind, time.perf_counter() - start))


def _kv_split(kv: torch.Tensor, k_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values from the ring's one message, side by side as their widths may differ (MLA's value heads)."""
    return kv[..., :k_width], kv[..., k_width:]


class _RingAttention(torch.autograd.Function):
    """Forward: K/V blocks go round the cp ring (one isend/irecv pair per step, posted before the block
    at hand is computed); backward: K/V go round again with their gradients travelling behind them."""

    @staticmethod
    def forward(ctx, q, k, v, comm, causal, timeline, window):
        mesh = comm.mesh
        cp, r = mesh.size(AXIS), mesh.rank(AXIS)
        seq = q.shape[-2] * cp
        scale = 1 / math.sqrt(q.shape[-1])
        q5 = _grouped(q, k.shape[1])
        starts, documents = [_starts(seq, cp, rank) for rank in range(cp)], current_documents()
        q_starts = starts[r]
        nxt, prev = mesh.global_rank(cp=(r + 1) % cp), mesh.global_rank(cp=(r - 1) % cp)
        accs = [Accumulator(s, v.shape[-1]) for s, _ in _segments(q5, q_starts)]
        kv = torch.cat([k, v], dim=-1)
        for step in range(cp):
            works, incoming = [], None
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                works = comm.send_recv([(kv, nxt)], [(incoming, prev)], axis=AXIS, op="ring_kv")
            with _timed(timeline, "forward", step, "compute"):
                attend_block(accs, q5, q_starts, *_kv_split(kv, k.shape[-1]), starts[(r - step) % cp],
                             causal, scale, window, documents)
            with _timed(timeline, "forward", step, "wait"):
                for w in works:
                    w.wait()
            kv = incoming if incoming is not None else kv
        out, lse = _finish(accs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.causal, ctx.scale, ctx.timeline, ctx.window = comm, causal, scale, timeline, window
        ctx.starts, ctx.documents = starts, documents
        return _ungroup(out).to(q.dtype), lse.flatten(1, 2)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        comm, causal, scale, timeline = ctx.comm, ctx.causal, ctx.scale, ctx.timeline
        mesh = comm.mesh
        cp, r = mesh.size(AXIS), mesh.rank(AXIS)
        nxt, prev = mesh.global_rank(cp=(r + 1) % cp), mesh.global_rank(cp=(r - 1) % cp)
        q5, dout5 = _grouped(q, k.shape[1]), _grouped(dout, k.shape[1]).to(out.dtype)
        q_starts = ctx.starts[r]
        delta = (dout5 * out).sum(-1) - dlse.reshape(lse.shape)  # d lse_i / d s_ij = p_ij joins dP_ij
        dq = torch.zeros(q5.shape, dtype=out.dtype, device=q.device)
        kv = torch.cat([k, v], dim=-1)
        sent: list = []  # (message, its send): each message stays alive until its send completes
        for step in range(cp):
            dkv_in = torch.empty(kv.shape, dtype=out.dtype, device=kv.device) if step > 0 else None
            kv_in = torch.empty_like(kv) if step < cp - 1 else None
            recvs = [(t, prev) for t in (dkv_in, kv_in) if t is not None]
            works = comm.send_recv([(kv, nxt)] if kv_in is not None else [], recvs, axis=AXIS, op="ring_kv_grad")
            with _timed(timeline, "backward", step, "compute"):
                held = ctx.starts[(r - step) % cp]
                g_q, g_k, g_v = block_grads(q5, q_starts, *_kv_split(kv, k.shape[-1]), held, causal, scale, dout5,
                                            delta, lse, ctx.window, ctx.documents)
                dq += g_q
            with _timed(timeline, "backward", step, "wait"):
                for w in works:
                    w.wait()
            dkv = torch.cat([g_k, g_v], dim=-1) + (dkv_in if dkv_in is not None else 0)
            sent += [(dkv, w) for w in comm.send_recv([(dkv, nxt)], [], axis=AXIS, op="ring_kv_grad")]
            kv = kv_in if kv_in is not None else kv
        home = torch.empty(kv.shape, dtype=out.dtype, device=kv.device)
        with _timed(timeline, "backward", cp, "wait"):
            for w in comm.send_recv([], [(home, prev)], axis=AXIS, op="ring_kv_grad"):
                w.wait()
            for _, w in sent:
                w.wait()
        home_k, home_v = _kv_split(home, k.shape[-1])
        return _ungroup(dq).to(q.dtype), home_k.to(k.dtype), home_v.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, causal: bool = True,
                   timeline: RingTimeline | None = None, window: int | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's head-tail queries ``[b, h, t, d]`` over the whole sequence; ``timeline``
    records each step's compute and wait; ``window`` masks block pairs, skipping those outside it; ``sinks`` (one
    logit per query head, GPT-OSS's) join each softmax's denominator: the output times sigmoid(lse - sink)."""
    out, lse = _RingAttention.apply(q, k, v, comm, causal, timeline, window)
    if sinks is None:
        return out
    return (out * torch.sigmoid(lse - sinks.to(lse.dtype).view(-1, 1)).unsqueeze(-1)).to(out.dtype)


# --- all-to-all (Ulysses) ---------------------------------------------------------------------------

class _AllToAll(torch.autograd.Function):
    """Rank r's slice i of dim 0 goes to rank i's slice r, forward and (being its own adjoint) backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return _all_to_all(x, comm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.comm), None


def _all_to_all(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    comm.all_to_all(out, x, AXIS)
    return out


def _natural_order(seq: int, cp: int, device: torch.device) -> torch.Tensor:
    """Where each position lies in the concatenation of every cp rank's tokens (rank order)."""
    held = torch.cat([_held(seq, cp, r) for r in range(cp)])
    return torch.argsort(held).to(device)


def _heads_to_sequence(x: torch.Tensor, comm: Comm, order: torch.Tensor) -> torch.Tensor:
    """``[b, h, t/cp, d]`` sequence-split -> ``[b, h/cp, t, d]`` head-split, positions in natural order."""
    cp = comm.mesh.size(AXIS)
    b, h, t, d = x.shape
    parts = _AllToAll.apply(x.reshape(b, cp, h // cp, t, d).transpose(0, 1), comm)
    return parts.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d).index_select(2, order)


def _sequence_to_heads(y: torch.Tensor, comm: Comm, order: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_heads_to_sequence`."""
    cp = comm.mesh.size(AXIS)
    b, hc, seq, d = y.shape
    held = torch.empty_like(order).scatter_(0, order, torch.arange(seq, device=order.device))
    parts = y.index_select(2, held).reshape(b, hc, cp, seq // cp, d).permute(2, 0, 1, 3, 4)
    return _AllToAll.apply(parts, comm).transpose(0, 1).reshape(b, cp * hc, seq // cp, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core: Attention, comm: Comm) -> torch.Tensor:
    """``core`` (the model's own attention) on whole sequences for 1/cp of the heads, between two all-to-alls."""
    order = _natural_order(q.shape[-2] * comm.mesh.size(AXIS), comm.mesh.size(AXIS), q.device)
    q, k, v = (_heads_to_sequence(x, comm, order) for x in (q, k, v))
    return _sequence_to_heads(core(q, k, v), comm, order)


# --- applying context parallelism to a plain model -----------------------------------------------------

def _attention_style(module: nn.Module, comm: Comm, impl: str) -> None:
    """Route an attention core's forward through cp attention, on the instance so recomputation wrapping it later
    checkpoints the cp attention; the ring keeps the core's ``window`` and ``sinks`` (a module giving one logit per
    query head), a2a runs the core itself on whole sequences, its sinks cut to the heads this cp rank attends with."""
    sinks = getattr(module, "sinks", None)
    if impl == "ring":
        window = getattr(module, "window", None)
        module.forward = lambda q, k, v: ring_attention(q, k, v, comm, window=window,
                                                        sinks=None if sinks is None else sinks())
    else:
        if sinks is not None:
            cp, rank = comm.mesh.size(AXIS), comm.mesh.rank(AXIS)
            sinks.register_forward_hook(lambda _m, _args, out: out.chunk(cp)[rank])
        core = module.forward
        module.forward = lambda q, k, v: ulysses_attention(q, k, v, core, comm)


def _positions_style(module: nn.Module, positions: torch.Tensor) -> None:
    """A module taking position ids (``0..t-1`` of the local tokens) gets their global positions instead; packed
    documents' ids are already those of the tokens this rank holds, in their documents."""
    module.register_forward_pre_hook(lambda _m, args: args if current() is not None else
                                     (positions.to(args[0].device)[args[0]], *args[1:]))


def apply_context_parallel(model: nn.Module, plan: Mapping[str, str], comm: Comm, seq_len: int,
                           impl: str = "ring") -> None:
    """Make ``model`` compute on this cp rank's head-tail part of each sequence as if whole: ``plan`` maps module-name
    patterns to ``attention`` (parameter-free cores) or ``positions`` (modules taking position ids); all must match."""
    if impl not in CP_IMPLS:
        raise ValueError(f"unknown cp implementation {impl!r}; choose one of {', '.join(CP_IMPLS)}")
    mesh = comm.mesh
    positions = local_positions(seq_len, mesh.size(AXIS), mesh.rank(AXIS))
    names = [n for n, _ in model.named_modules() if n]
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"cp plan pattern {pattern!r} matches no module of the model")
        for name in hits:
            if style == "attention":
                _attention_style(model.get_submodule(name), comm, impl)
            elif style == "positions":
                _positions_style(model.get_submodule(name), positions)
            else:
                raise ValueError(f"unknown cp plan style {style!r} for {pattern!r}; choose attention or positions")


def shard_sequence(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's tokens of ``[batch, seq]`` ids or targets (chunks ``rank`` and ``2·cp−1−rank``)."""
    if cp == 1:
        return x
    return x.index_select(1, local_positions(x.shape[1], cp, rank).to(x.device))
