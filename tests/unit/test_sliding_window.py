"""Sliding-window attention computed block by block equals the masked full attention, and the planner prices the
tiles a fused kernel computes."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from helpers import FP64_ATOL, tiled_pairs
from trainmesh.models import gemma, gpt_oss
from trainmesh.models.cache import causal_attention
from trainmesh.models.llama import AttentionCore
from trainmesh.plan import Layout, Workload, model_shape
from trainmesh.plan.flops import attention_forward_flops, attention_weights, core_width
from trainmesh.plan.timing import KERNEL_TILE, block_gemms


def masked_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """The whole score matrix under the bottom-right-aligned causal window mask (key j seen by query i iff
    i - window < j <= i)."""
    i = torch.arange(k.shape[2] - q.shape[2], k.shape[2])[:, None]
    j = torch.arange(k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j > i - window))


@pytest.mark.parametrize("q_len,k_len,window,block", [(10, 10, 3, 4), (10, 10, 1, 3), (17, 17, 5, 4),
                                                     (12, 12, 12, 4), (12, 12, 40, 4), (9, 9, 4, 64),
                                                     (5, 12, 4, 2), (1, 9, 3, 4), (1, 30, 3, 4), (7, 30, 9, 4)])
def test_banded_attention_equals_masked_full_attention_forward_and_backward(q_len: int, k_len: int, window: int,
                                                                             block: int) -> None:
    """Windows shorter, equal and longer than the sequence, window 1, lengths no multiple of the block, and
    queries that are only the last positions (decoding with a cache): outputs and gradients to float64 noise."""
    torch.manual_seed(0)
    q = torch.randn(2, 3, q_len, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, k_len, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ours, ref = causal_attention(q, k, v, window, block), masked_full(q, k, v, window)
    grad = torch.randn_like(ref)
    torch.testing.assert_close(ours, ref, atol=FP64_ATOL, rtol=0)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, atol=FP64_ATOL, rtol=0)


def test_attention_core_shares_kv_heads_under_a_window() -> None:
    """GQA: 4 query heads over 2 KV heads, each KV head repeated for its group, then the window's band."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 300, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 300, 8, dtype=torch.float64) for _ in range(2))
    ref = masked_full(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), 37)
    torch.testing.assert_close(AttentionCore(37)(q, k, v), ref, atol=FP64_ATOL, rtol=0)


def test_planner_prices_the_tiles_a_fused_kernel_computes_under_a_window() -> None:
    """mistral-7b at 1000 tokens: the core is priced at the 128 x 128 tiles holding a visible pair, masked parts
    included, counted here from the whole mask: the causal half and its diagonal tiles, and a window of 300 leaving
    out the tiles behind it; the MFU forward count takes each query's 300 keys."""
    i, j = torch.arange(1000)[:, None], torch.arange(1000)
    shape = model_shape("mistral-7b")
    qk, v = core_width(shape)
    for window, visible in ((None, j <= i), (300, (j <= i) & (j > i - 300))):
        work = Workload(dataclasses.replace(shape, sliding_window=window), 1, 1000)
        core = block_gemms(work, Layout())["attention"]
        assert core.flops == pytest.approx(2 * shape.n_heads * (qk + v) * tiled_pairs(visible, KERNEL_TILE))
    windowed = dataclasses.replace(shape, sliding_window=300)
    assert attention_forward_flops(windowed, 1000) == (2 * attention_weights(windowed)
                                                       + 2 * 300 * shape.n_heads * (qk + v))


@pytest.mark.parametrize("name,local", [("gemma3-1b", 22), ("gpt-oss-20b", 12)])
def test_planner_prices_local_and_global_layers_each_at_its_own_attention(name: str, local: int) -> None:
    """Gemma 3 (every 6th of 26 layers global) and GPT-OSS (alternate layers within 128 tokens): the core is priced
    at the layers' mean of the windowed tiles and the whole causal ones, each counted from the whole mask, and the
    MFU count at the mean of window and sequence keys; the shape's local layers are the model's own."""
    shape = model_shape(name)
    built = {**gemma.PLANNER_PRESETS, **gpt_oss.PLANNER_PRESETS}[name]
    assert shape.local_layers == local == sum(built.is_local(i) for i in range(built.n_layers))
    qk, v = core_width(shape)
    i, j = torch.arange(1024)[:, None], torch.arange(1024)
    window = shape.sliding_window
    pairs = (local * tiled_pairs((j <= i) & (j > i - window), KERNEL_TILE)
             + (shape.n_layers - local) * tiled_pairs(j <= i, KERNEL_TILE)) / shape.n_layers
    core = block_gemms(Workload(shape, 1, 1024), Layout())["attention"]
    assert core.flops == pytest.approx(2 * shape.n_heads * (qk + v) * pairs)
    keys = (local * window + (shape.n_layers - local) * 1024) / shape.n_layers
    assert attention_forward_flops(shape, 1024) == pytest.approx(2 * attention_weights(shape)
                                                                 + 2 * keys * shape.n_heads * (qk + v))
