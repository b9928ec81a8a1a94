"""Blocked attention (windows, documents, sinks) equals the whole score matrix under the same mask, outputs and
gradients in float64, on the fused CPU kernel and on the explicit form other devices run."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from helpers import tiled_pairs
from trainmesh.models import blocked_attention
from trainmesh.models.blocked_attention import attention_pieces
from trainmesh.models.cache import causal_attention
from trainmesh.models.llama import AttentionCore
from trainmesh.plan import Layout, Workload, make_cluster, model_shape
from trainmesh.plan.flops import core_width
from trainmesh.plan.timing import KERNEL_TILE, block_gemms, document_saving

ATOL = 1e-12


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
              documents: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over all scores with key j hidden from query i unless j <= i, i - window < j and both lie in one
    document; each head's sink an extra score of its logit with a zero value."""
    i = torch.arange(k.shape[2] - q.shape[2], k.shape[2])[:, None]
    j = torch.arange(k.shape[2])
    visible = (j <= i) & (j > i - (window or k.shape[2]))
    visible = visible.expand(q.shape[0], 1, *visible.shape)
    if documents is not None:
        visible = visible & (documents[:, None, -q.shape[2]:, None] == documents[:, None, None, :])
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~visible, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    return scores.softmax(-1)[..., :k.shape[2]] @ v


def layout(*lengths: int) -> list[int]:
    return [index for index, length in enumerate(lengths) for _ in range(length)]


def assert_same(q_len: int, k_len: int, block: int, **masks) -> None:
    """Outputs and the gradients of q, k, v (and sinks), three heads, ``block`` queries a piece."""
    torch.manual_seed(0)
    batch = 1 if masks.get("documents") is None else len(masks["documents"])
    q = torch.randn(batch, 3, q_len, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(batch, 3, k_len, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    inputs = [q, k, v] + ([masks["sinks"]] if masks.get("sinks") is not None else [])
    ours, ref = causal_attention(q, k, v, block=block, **masks), reference(q, k, v, **masks)
    grad = torch.randn_like(ref)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    for a, b in zip(torch.autograd.grad(ours, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("window", [None, 1, 3, 7, 40])
@pytest.mark.parametrize("block", [2, 5, 64])
def test_rows_with_different_documents(window: int | None, block: int) -> None:
    """Three rows: documents of 4, 9, 1 and 6 tokens; one document; many short ones (windows within them)."""
    documents = torch.tensor([layout(4, 9, 1, 6), layout(20), layout(3, 3, 2, 5, 7)])
    assert_same(20, 20, window=window, block=block, documents=documents)


@pytest.mark.parametrize("q_len", [1, 3, 11])
def test_queries_at_the_end_of_the_keys_decoding_within_documents(q_len: int) -> None:
    """Decoding with a cache: the queries are the last positions, the first of them inside a document."""
    documents = torch.tensor([layout(5, 10, 7), layout(2, 20)])
    assert_same(q_len, 22, window=4, block=3, documents=documents)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("q_len", [1, 9, 30])
def test_sinks_join_the_denominator(window: int | None, q_len: int) -> None:
    """GPT-OSS's sinks, with and without a window and documents; the sinks' own gradient too."""
    sinks = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64, requires_grad=True)
    assert_same(q_len, 30, window=window, block=4, sinks=sinks)
    assert_same(30, 30, window=window, block=4, sinks=sinks, documents=torch.tensor([layout(11, 19)]))


def test_the_explicit_kernel_other_devices_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a fused kernel for the device the same pieces run the spelled-out kernel, to the same noise."""
    monkeypatch.setattr(blocked_attention, "KERNELS", {})
    sinks = torch.tensor([0.5, -0.5, 1.0], dtype=torch.float64, requires_grad=True)
    assert_same(17, 17, window=5, block=4, documents=torch.tensor([layout(6, 11), layout(17)]), sinks=sinks)
    assert_same(2, 17, window=5, block=4)


def test_each_block_of_queries_reads_only_the_keys_it_can_see() -> None:
    """Window 3, blocks of 2 over documents of 5 and 3 tokens: each block's keys run from its first query's window
    start, cut at its document's start, to its last query; no piece crosses a document."""
    pieces = attention_pieces(8, 8, 3, 2, torch.tensor([layout(5, 3)]))
    assert [(p.queries, p.keys) for p in pieces] == [((0, 2), (0, 2)), ((2, 4), (0, 4)), ((4, 5), (2, 5)),
                                                     ((5, 7), (5, 7)), ((7, 8), (5, 8))]


def test_planner_prices_the_tiles_of_a_document_masked_step() -> None:
    """llama3-8b, sequences of 1024 tokens packed with documents: the attention core is priced at the 128 x 128
    tiles holding a pair of one document, counted here from the whole mask, with the mix cycled to fill the
    sequence and cut at its end ((300, 500) fills it as 300, 500, 224); shorter documents save more of the step; a
    bad length is refused."""
    shape = model_shape("llama3-8b")
    qk, v = core_width(shape)
    for mix, lengths in (((256, 512, 256), (256, 512, 256)), ((300, 500), (300, 500, 224))):
        documents = torch.tensor(layout(*lengths))
        i, j = torch.arange(1024)[:, None], torch.arange(1024)
        pairs = tiled_pairs((j <= i) & (documents[:, None] == documents), KERNEL_TILE)
        work = Workload(shape, 8, 1024, documents=mix)
        assert block_gemms(work, Layout())["attention"].flops == pytest.approx(8 * 2 * shape.n_heads * (qk + v) * pairs)
    cluster = make_cluster("h100-80gb", 8)
    savings = [document_saving(dataclasses.replace(work, documents=mix), Layout(dp=8), cluster)
               for mix in ((1024,), (512, 256), (128,))]
    assert savings == sorted(savings) and savings[1] > 0
    with pytest.raises(ValueError, match="documents=.0,"):
        Workload(shape, 8, 1024, documents=(0, 5))


def test_attention_core_with_sinks_shares_kv_heads_under_a_window() -> None:
    """GPT-OSS's core: 4 query heads over 2 KV heads, window 5, a sink per query head, against the reference on
    the repeated keys and values."""
    torch.manual_seed(0)
    core = AttentionCore(5, n_sinks=4).double()
    with torch.no_grad():
        core.sinks.weight.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    q = torch.randn(1, 4, 23, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 23, 8, dtype=torch.float64) for _ in range(2))
    ref = reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), 5, sinks=core.sinks.weight.detach())
    torch.testing.assert_close(core(q, k, v), ref, atol=ATOL, rtol=0)
